//! The race watch: a driver binary's own loads and stores of chosen pool blocks, seen by the NT model's race
//! detector and scheduler as the natively built driver's RtlCopyFromVa/RtlCopyToVa are. The native driver's shared
//! state passes through the model; vhca.sys's is its own memory, which the model cannot see, so in an interleaving
//! run the loader makes the blocks it is told to watch (by pool tag, `vhca.race_watch`) inaccessible and traps each
//! instruction of the binary that touches them, the way Microsoft Research's DataCollider sampled kernel accesses
//! with breakpoints (here every access, by page protection).
//!
//! One trapped access, in three steps:
//! 1. The fault (`on_fault`, from the SIGSEGV handler) sends the thread, on its own stack, through `hook_trampoline`
//!    into `hook`: a scheduling point (where a preemption puts another processor's whole update between a load and
//!    its store) and a watched access named by the instruction's RVA and symbol. Neither belongs in a signal
//!    handler (the point may pause the thread; both take the model's locks), which is why the thread leaves it.
//! 2. The same instruction runs again and faults again; now it is expected (`ARMED`), so the handler opens the
//!    block's pages and sets the trap flag.
//! 3. After that one instruction the processor traps (SIGTRAP, `on_step`): the pages are closed again.
//!
//! What it cannot see: an access another processor makes to the same block during step 2's one instruction (the
//! pages are open for every thread then; a miss, never a false report); the access's width (the detector is told of
//! its first byte). A copy the binary hands to a CRT routine (memcpy, memmove, memset, memcmp: ntoskrnl.exe's
//! exports, bound to libc's) is reported by the routine's thunk, bytes and call site, before it runs with the blocks
//! open (`crt_call`); a fault in other code outside the image (the loader's own, inside a kernel call) is stepped
//! and not reported. Paged pool is never watched (Force IRQL checking's trim owns its protection).

use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

const PAGE: usize = 4096;
/// RFLAGS.TF: the processor traps after the next instruction.
const TRAP_FLAG: i64 = 0x100;
/// Bytes below the interrupted stack pointer the trampoline's frame leaves alone: the System V red zone, for a
/// fault in code of this process's own convention (the Windows x64 code of the binary keeps nothing below rsp).
const RED_ZONE: i64 = 128;

/// One watched block: its pages (whole, from `first`), its model address at `first`, and how many threads are
/// stepping an instruction with them open.
struct Block {
    bytes: usize,
    model_first: u64,
    open: u32,
}

/// The pool tags to watch and the blocks of them the driver holds, by the process address of their first page.
pub struct RaceWatch {
    tags: Vec<u32>,
    /// Common buffers too (`common-buffers` in the list): the rings and CQs the driver shares with its device.
    common_buffers: bool,
    blocks: Mutex<BTreeMap<usize, Block>>,
}

/// What `vhca.race_watch` lists: pool tags, and `common-buffers`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WatchList {
    pub tags: Vec<u32>,
    pub common_buffers: bool,
}

impl WatchList {
    /// `TAG[,TAG...]` with `common-buffers` among them or alone; the word that is neither is the error.
    pub fn parse(text: &str) -> Result<WatchList, String> {
        let mut list = WatchList::default();
        for word in text.split(',') {
            match word {
                "common-buffers" => list.common_buffers = true,
                _ => list.tags.push(parse_tag(word).ok_or_else(|| word.to_string())?),
            }
        }
        Ok(list)
    }
}

thread_local! {
    /// The instruction whose access `hook` has seen: its next fault on watched pages is stepped, not hooked again.
    static ARMED: Cell<usize> = const { Cell::new(0) };
    /// What the fault hands `hook`: the address touched, the instruction, and whether it was a write.
    static PENDING: Cell<(usize, usize, bool)> = const { Cell::new((0, 0, false)) };
    /// The blocks this thread opened for the instruction it is stepping (two: one instruction may touch two).
    static STEPPING: Cell<[usize; 2]> = const { Cell::new([0; 2]) };
    /// A hooked read being stepped: its address, the instruction, and the bytes there before it ran. A
    /// read-modify-write instruction (`inc qword [rax]`) faults as a read under QEMU's TCG, which loads first, so
    /// whether it also wrote is told by the bytes after the step.
    static READ_STEP: Cell<(usize, usize, u64)> = const { Cell::new((0, 0, 0)) };
    /// What `after_hook` reports: a stepped read that changed its bytes, at this address, by this instruction.
    static WROTE: Cell<(usize, usize)> = const { Cell::new((0, 0)) };
    /// Blocks this thread was given and has not passed a scheduling point since (first page, bytes): closed at its
    /// next point (`protect_pending`).
    static PENDING_BLOCKS: std::cell::RefCell<Vec<(usize, usize)>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// At each scheduling point of the calling thread: the blocks it was given since its last one are closed now.
/// Until then only it can know their addresses (another thread learns of a block through an order the model sees:
/// a kernel call, each a point), so its first stores into a block it initialises (a ring zeroed 16 bytes an
/// instruction: 16 384 traps for 256 KiB) race with nothing and are not trapped.
fn protect_pending() {
    let Some(k) = crate::kernel_context::installed() else { return };
    if !k.race_watch.is_on() {
        return;
    }
    let pending = PENDING_BLOCKS.with(|p| std::mem::take(&mut *p.borrow_mut()));
    for (first, bytes) in pending {
        // Freed before its first point: gone from the books, so left as it is.
        if crate::lock(&k.race_watch.blocks).get(&first).is_some_and(|b| b.bytes == bytes) {
            protect(first, bytes, false);
        }
    }
}

/// Up to 8 bytes at `address`, within its page (open: the caller stepped or is stepping it).
///
/// # Safety
/// The page holding `address` is accessible.
unsafe fn bytes_at(address: usize) -> u64 {
    let n = (PAGE - address % PAGE).min(8);
    let mut bytes = [0u8; 8];
    // SAFETY: n bytes within the caller's open page.
    unsafe { std::ptr::copy_nonoverlapping(address as *const u8, bytes.as_mut_ptr(), n) };
    u64::from_le_bytes(bytes)
}

static TRAP_HANDLER: AtomicBool = AtomicBool::new(false);

/// Sets the protection of whole pages at `at`.
fn protect(at: usize, bytes: usize, accessible: bool) {
    let protection = if accessible { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_NONE };
    // SAFETY: whole pages of one pool block that the backend maps for that block alone (one anonymous mapping per
    // allocation), which nothing but the driver and the model's checks of that block touch.
    unsafe { libc::mprotect(at as *mut libc::c_void, bytes, protection) };
}

impl RaceWatch {
    /// A watch over what `list` names; with nothing it watches nothing and costs nothing.
    pub fn new(list: WatchList) -> RaceWatch {
        if list.tags.is_empty() && !list.common_buffers {
            return RaceWatch { tags: Vec::new(), common_buffers: false, blocks: Mutex::default() };
        }
        install_trap_handler();
        vhca_ntmodel::observe_points(protect_pending);
        RaceWatch { tags: list.tags, common_buffers: list.common_buffers, blocks: Mutex::default() }
    }

    fn is_on(&self) -> bool {
        !self.tags.is_empty() || self.common_buffers
    }

    /// A common buffer of `bytes` at `at` (model address `model_va`): watched when the list says so.
    pub fn insert_common_buffer(&self, at: usize, bytes: usize, model_va: u64) {
        if self.common_buffers {
            self.watch(at, bytes, model_va);
        }
    }

    /// Whether a block tagged `tag` is watched.
    pub fn watches(&self, tag: u32) -> bool {
        self.tags.contains(&tag)
    }

    /// A non-paged pool block of `bytes` at process address `at` (model address `model_va`) was given out with
    /// `tag`: watched from now if the tag is on the list. Its pages must be its own (the caller's contract:
    /// the guest's backend maps each allocation alone).
    pub fn insert(&self, at: usize, bytes: usize, model_va: u64, tag: u32) {
        if self.watches(tag) {
            self.watch(at, bytes, model_va);
        }
    }

    fn watch(&self, at: usize, bytes: usize, model_va: u64) {
        if at == 0 || bytes == 0 {
            return;
        }
        let first = at - at % PAGE;
        let bytes = (at + bytes).div_ceil(PAGE) * PAGE - first;
        let model_first = model_va - (at - first) as u64;
        crate::lock(&self.blocks).insert(first, Block { bytes, model_first, open: 0 });
        PENDING_BLOCKS.with(|p| p.borrow_mut().push((first, bytes)));
    }

    /// The block at `at` is being freed: accessible again first, as the model reuses its pages.
    pub fn remove(&self, at: usize) {
        let first = at - at % PAGE;
        if let Some(block) = crate::lock(&self.blocks).remove(&first) {
            protect(first, block.bytes, true);
        }
    }

    /// A CRT routine (memcpy, memmove, memset, memcmp) the binary called from `caller` over `ranges` (address,
    /// bytes, written): the bytes of each in a watched block are reported as the binary's access at its call site,
    /// then `f` runs with those blocks open (a copy through them would otherwise fault at every instruction).
    pub fn crt_call<T>(&self, caller: u64, ranges: &[(usize, usize, bool)], f: impl FnOnce() -> T) -> T {
        if !self.is_on() {
            return f();
        }
        let mut opened = Vec::new();
        for &(at, bytes, write) in ranges.iter().filter(|r| r.1 > 0) {
            let touched: Vec<(usize, u64, u64)> = {
                let blocks = crate::lock(&self.blocks);
                blocks
                    .range(..at + bytes)
                    .filter(|(first, b)| **first + b.bytes > at)
                    .map(|(first, b)| {
                        let start = at.max(*first);
                        let end = (at + bytes).min(first + b.bytes);
                        (*first, b.model_first + (start - first) as u64, (end - start) as u64)
                    })
                    .collect()
            };
            for (first, va, len) in touched {
                if let Some(k) = crate::kernel_context::installed() {
                    // The call's own byte names the site: a return address may begin the next routine.
                    let site = crate::driver_fault::image_site(caller.saturating_sub(1));
                    k.model.binary_access(va, len, write, &site);
                }
                self.open(first);
                opened.push(first);
            }
        }
        let result = f();
        for first in opened {
            self.close(first);
        }
        result
    }

    /// The watched block holding `address`: its first page's address and the model address of `address`.
    fn block_of(&self, address: usize) -> Option<(usize, u64)> {
        let blocks = crate::lock(&self.blocks);
        let (first, block) = blocks.range(..=address).next_back()?;
        (address - first < block.bytes).then(|| (*first, block.model_first + (address - first) as u64))
    }

    /// Opens the block at `first` for one stepped instruction.
    fn open(&self, first: usize) {
        let mut blocks = crate::lock(&self.blocks);
        if let Some(block) = blocks.get_mut(&first) {
            if block.open == 0 {
                protect(first, block.bytes, true);
            }
            block.open += 1;
        }
    }

    /// The stepped instruction ran: the block at `first` closes when no other thread steps in it.
    fn close(&self, first: usize) {
        let mut blocks = crate::lock(&self.blocks);
        if let Some(block) = blocks.get_mut(&first) {
            block.open = block.open.saturating_sub(1);
            if block.open == 0 {
                protect(first, block.bytes, false);
            }
        }
    }
}

/// A SIGSEGV at `address` by the instruction at `rip`: true when it was the race watch's and the thread may resume
/// (into `hook`, or stepping the instruction), false when it is no watched block's.
///
/// # Safety
/// `context` is this SIGSEGV's ucontext; `in_driver` says whether `rip` is the binary's own code.
pub(crate) unsafe fn on_fault(address: usize, write: bool, in_driver: bool, context: &mut libc::ucontext_t) -> bool {
    let Some(k) = crate::kernel_context::installed() else { return false };
    let Some((first, _)) = k.race_watch.block_of(address) else { return false };
    let gregs = &mut context.uc_mcontext.gregs;
    let rip = gregs[libc::REG_RIP as usize] as usize;
    let stepping = STEPPING.get();
    let step = ARMED.get() == rip || !in_driver || stepping[0] != 0;
    if step {
        // The hooked instruction again, one not the binary's, or a second block the stepped instruction touches.
        let hooked = ARMED.replace(0) == rip;
        let slot = usize::from(stepping[0] != 0);
        if stepping[slot] != 0 {
            // A third block in one instruction: nothing does that; leave it to the default verdicts.
            return false;
        }
        let mut now = stepping;
        now[slot] = first;
        STEPPING.set(now);
        k.race_watch.open(first);
        if hooked && !write {
            // SAFETY: the block holding `address` was just opened.
            READ_STEP.set((address, rip, unsafe { bytes_at(address) }));
        }
        gregs[libc::REG_EFL as usize] |= TRAP_FLAG;
        return true;
    }
    PENDING.set((address, rip, write));
    // A call of `hook_trampoline` from below the red zone: [rsp] the instruction to run again, which the
    // trampoline's `ret 128` returns to with the stack pointer as it was.
    let rsp = gregs[libc::REG_RSP as usize] - RED_ZONE - 8;
    // SAFETY: the interrupted thread's own stack, below its stack pointer and the red zone (unused by any frame).
    unsafe { (rsp as *mut u64).write(rip as u64) };
    gregs[libc::REG_RSP as usize] = rsp;
    gregs[libc::REG_RIP as usize] = hook_trampoline as *const () as usize as i64;
    true
}

/// The instruction after a watched access ran under the trap flag: its blocks close and the flag is cleared.
/// False when the thread stepped nothing (not the watch's trap).
///
/// # Safety
/// `context` is this SIGTRAP's ucontext.
unsafe fn on_step(context: &mut libc::ucontext_t) -> bool {
    let stepping = STEPPING.replace([0; 2]);
    if stepping[0] == 0 {
        return false;
    }
    let (read_at, read_by, before) = READ_STEP.replace((0, 0, 0));
    // SAFETY: the stepped read's block is still open (it closes below).
    let wrote = read_at != 0 && unsafe { bytes_at(read_at) } != before;
    if let Some(k) = crate::kernel_context::installed() {
        for first in stepping.into_iter().filter(|f| *f != 0) {
            k.race_watch.close(first);
        }
    }
    let gregs = &mut context.uc_mcontext.gregs;
    gregs[libc::REG_EFL as usize] &= !TRAP_FLAG;
    if wrote {
        // Out of the handler to report the write (the model's locks), then on to the next instruction.
        WROTE.set((read_at, read_by));
        let rsp = gregs[libc::REG_RSP as usize] - RED_ZONE - 8;
        // SAFETY: the interrupted thread's own stack, below its stack pointer and the red zone.
        unsafe { (rsp as *mut u64).write(gregs[libc::REG_RIP as usize] as u64) };
        gregs[libc::REG_RSP as usize] = rsp;
        gregs[libc::REG_RIP as usize] = after_trampoline as *const () as usize as i64;
    }
    true
}

extern "C" fn on_trap(signal: libc::c_int, _info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    // SAFETY: the kernel's ucontext for this signal.
    if unsafe { on_step(&mut *(context as *mut libc::ucontext_t)) } {
        return;
    }
    // Not a step of ours (a breakpoint instruction): the default action, as without this handler; the signal is
    // blocked here and is delivered when the handler returns.
    // SAFETY: restoring the default disposition and raising the signal again, both async-signal-safe.
    unsafe {
        libc::signal(signal, libc::SIG_DFL);
        libc::raise(signal);
    }
}

fn install_trap_handler() {
    if TRAP_HANDLER.swap(true, Ordering::SeqCst) {
        return;
    }
    // SAFETY: an SA_SIGINFO handler for SIGTRAP on the alternate stack (driver_fault::prepare_thread gives every
    // thread that runs driver code one), a process-wide setting made before any block is watched.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_trap as extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) as usize;
        action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGTRAP, &action, std::ptr::null_mut());
    }
}

/// Step 1, on the driver's thread and stack: the access's scheduling point and its report to the race detector,
/// then the instruction runs again (`ARMED`).
extern "C" fn hook() {
    let (address, rip, write) = PENDING.get();
    if let Some(k) = crate::kernel_context::installed() {
        if let Some((_, va)) = k.race_watch.block_of(address) {
            let site = crate::driver_fault::image_site(rip as u64);
            k.model.binary_access(va, 1, write, &site);
        }
    }
    ARMED.set(rip);
}

/// After a stepped read that changed its bytes (a read-modify-write): the write, reported without a point of its
/// own (nothing can come between an instruction's load and its store).
extern "C" fn after_hook() {
    let (address, rip) = WROTE.replace((0, 0));
    if let Some(k) = crate::kernel_context::installed() {
        if let Some((_, va)) = k.race_watch.block_of(address) {
            let site = crate::driver_fault::image_site(rip as u64);
            k.model.binary_write_after_read(va, 1, &site);
        }
    }
}

// `hook_trampoline` is entered in place of a trapped instruction (`after_trampoline` in place of the one after a
// stepped read-modify-write) with [rsp] = that instruction's address, 128 bytes below the stack pointer it had: the
// instruction must find every register and flag as it left them (register_saving.rs), and `ret 128` goes back to it
// with the stack pointer it had.
crate::register_saving::saving_trampoline!(hook_trampoline => hook, argument: [], ret: ["ret 128"]);
crate::register_saving::saving_trampoline!(after_trampoline => after_hook, argument: [], ret: ["ret 128"]);

/// The pool tag a `vhca.race_watch` word names: one to four ASCII characters, padded with spaces as Windows pads a
/// short tag, in the byte order `ExAllocatePoolWithTag` takes it.
pub fn parse_tag(word: &str) -> Option<u32> {
    let bytes = word.as_bytes();
    if bytes.is_empty() || bytes.len() > 4 || !bytes.iter().all(|b| b.is_ascii_graphic()) {
        return None;
    }
    let mut tag = [b' '; 4];
    tag[..bytes.len()].copy_from_slice(bytes);
    Some(u32::from_le_bytes(tag))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_list_reads_tags_and_common_buffers() {
        let list = WatchList::parse("VhSw,common-buffers").unwrap();
        assert_eq!(list, WatchList { tags: vec![u32::from_le_bytes(*b"VhSw")], common_buffers: true });
        assert_eq!(WatchList::parse("VhSw,toolong"), Err("toolong".to_string()));
        assert_eq!(WatchList::parse(""), Err(String::new()));
    }

    #[test]
    fn tags_read_as_the_driver_writes_them() {
        assert_eq!(parse_tag("VhSw"), Some(u32::from_le_bytes(*b"VhSw")));
        assert_eq!(parse_tag("Ab"), Some(u32::from_le_bytes(*b"Ab  ")));
        for bad in ["", "toolong", "a b", "é"] {
            assert_eq!(parse_tag(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_watched_block_is_its_pages_and_a_free_opens_them() {
        let layout = std::alloc::Layout::from_size_align(3 * PAGE, PAGE).unwrap();
        // SAFETY: a fresh page-aligned block, freed below.
        let block = unsafe { std::alloc::alloc_zeroed(layout) } as usize;
        let watch = RaceWatch { tags: vec![7], common_buffers: false, blocks: Mutex::default() };
        watch.insert(block + 16, 8, 0x5000_0010, 6);
        assert_eq!(watch.block_of(block + 16), None, "an unwatched tag");
        watch.insert(block + 16, PAGE, 0x5000_0010, 7);
        assert_eq!(watch.block_of(block + 20), Some((block, 0x5000_0014)));
        assert_eq!(watch.block_of(block + 2 * PAGE - 1), Some((block, 0x5000_0000 + 2 * PAGE as u64 - 1)));
        assert_eq!(watch.block_of(block + 2 * PAGE), None, "past its last page");
        watch.open(block);
        watch.open(block);
        watch.close(block);
        // SAFETY: still open for the second stepper.
        unsafe { (block as *mut u8).write(1) };
        watch.close(block);
        watch.remove(block + 16);
        // SAFETY: accessible again after its removal; then freed.
        unsafe {
            (block as *mut u8).write(2);
            std::alloc::dealloc(block as *mut u8, layout);
        }
    }
}
