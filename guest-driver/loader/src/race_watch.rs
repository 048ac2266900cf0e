//! The race watch: a driver binary's own loads and stores of chosen pool blocks, seen by the NT model's race
//! detector and scheduler as the natively built driver's RtlCopyFromVa/RtlCopyToVa are. The native driver's shared
//! state passes through the model; vhca.sys's is its own memory, which the model cannot see, so in an interleaving
//! run the loader makes the blocks it is told to watch (by pool tag, `vhca.race_watch`) inaccessible and traps each
//! instruction of the binary that touches them, the way Microsoft Research's DataCollider sampled kernel accesses
//! with breakpoints (here every access, by page protection).
//!
//! One trapped access:
//! 1. The fault (`on_fault`, from the SIGSEGV handler) sends the thread, on its own stack, through `hook_trampoline`
//!    into `hook`: for the binary's own instruction a scheduling point (where a preemption puts another
//!    processor's whole update between a load and its store) and a watched access named by the instruction's RVA
//!    and symbol; for any instruction its decoding (`redirect.rs`). None of it belongs in a signal handler (the
//!    point may pause the thread; the report takes the model's locks; the decoder allocates), which is why the
//!    thread leaves it.
//! 2. Where a copy of the instruction means the same, the trampoline returns into one that moves the registers it
//!    addresses the block through into the block's alias (a second mapping of the same pages, made when the block
//!    is watched), runs it, moves them back and jumps home (`out_of_line.rs`): done, one signal in all. A copy that
//!    faults (the alias went with a free meanwhile) is taken back to the image's instruction (`on_copy_fault`),
//!    which runs in place as in step 3's fallback, so a fault of its own is named at the image's address.
//! 3. Otherwise the same instruction runs again and faults again; now it is expected (`ARMED`), so the handler
//!    moves those registers itself and sets the trap flag, and after that one instruction the processor traps
//!    (SIGTRAP, `on_step`): the registers are moved back.
//!
//! The block's own pages are never opened on this path, so every access by every thread traps, however close
//! together. Only an instruction the decoding cannot move (it also uses its address register as data, or a
//! repeated string instruction), or a block without an alias (private memory: the guest's backend maps its memory
//! shared while the watch is on), is stepped with the block's pages open instead: for that one instruction another
//! processor's access to the block is missed (a miss, never a false report). `step_counts` tells how many ran
//! which way, and a vhca.sys run prints them. What else it cannot see: the access's width (the detector is told
//! of its first byte). A copy the binary hands to a CRT routine (memcpy, memmove, memset, memcmp: ntoskrnl.exe's
//! exports, bound to libc's) is reported by the routine's thunk, bytes and call site, and runs on the blocks'
//! aliases (`crt_call`); a fault in other code outside the image (the loader's own, inside a kernel call) goes
//! through the alias too and is not reported. Paged pool is never watched (Force IRQL checking's trim owns its
//! protection).

mod out_of_line;
mod redirect;

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use redirect::{Access, Aliases, Plan, Shifts};

const PAGE: usize = 4096;
/// RFLAGS.TF: the processor traps after the next instruction.
const TRAP_FLAG: i64 = 0x100;
/// Bytes below the interrupted stack pointer the trampoline's frame leaves alone: the System V red zone, for a
/// fault in code of this process's own convention (the Windows x64 code of the binary keeps nothing below rsp).
const RED_ZONE: i64 = 128;

/// One watched block: its pages (whole, from `first`), its model address at `first`, its alias (a second mapping
/// of the same pages, always accessible, that stepped instructions and CRT copies go through; 0 when the pages
/// cannot have one), and how many threads are stepping an instruction with them open (only without an alias).
struct Block {
    bytes: usize,
    model_first: u64,
    alias: usize,
    open: u32,
    /// Device registers (`insert_device_registers`), of this device: the binary's stores there are doorbells,
    /// not watched memory.
    device: Option<u64>,
}

impl Block {
    /// What the byte `offset` into the block is to the model.
    fn target(&self, offset: usize) -> Target {
        match self.device {
            Some(device) => Target::Device(device),
            None => Target::Memory(self.model_first + offset as u64),
        }
    }
}

/// What an address in a watched block is to the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    /// Watched memory, at this model address.
    Memory(u64),
    /// A register of this device.
    Device(u64),
}

/// How the watched accesses of this process ran: through an alias, or with their block open (the miss window).
static THROUGH_ALIAS: AtomicU64 = AtomicU64::new(0);
static WITH_BLOCK_OPEN: AtomicU64 = AtomicU64::new(0);
/// Of the accesses through an alias, those run as a copy of their instruction (one signal, not three).
static AS_COPIES: AtomicU64 = AtomicU64::new(0);
/// The binary's stores to device registers the watch reported as doorbells.
static DOORBELLS: AtomicU64 = AtomicU64::new(0);

/// (accesses stepped through an alias, accesses and CRT calls stepped with their block open) so far.
pub fn step_counts() -> (u64, u64) {
    (THROUGH_ALIAS.load(Ordering::Relaxed), WITH_BLOCK_OPEN.load(Ordering::Relaxed))
}

/// Of `step_counts`' accesses through an alias, those that ran as copies of their instruction so far.
pub fn copied() -> u64 {
    AS_COPIES.load(Ordering::Relaxed)
}

/// The binary's stores to device registers reported as doorbells so far.
pub fn doorbells() -> u64 {
    DOORBELLS.load(Ordering::Relaxed)
}

impl Aliases for BTreeMap<usize, Block> {
    fn alias_of(&self, address: u64) -> Option<(u64, u64, u64)> {
        let address = usize::try_from(address).ok()?;
        let (first, block) = self.range(..=address).next_back()?;
        (address - first < block.bytes).then_some((*first as u64, block.bytes as u64, block.alias as u64))
    }
}

/// The pool tags to watch and the blocks of them the driver holds, by the process address of their first page.
pub struct RaceWatch {
    tags: Vec<u32>,
    /// Common buffers too (`common-buffers` in the list): the rings and CQs the driver shares with its device.
    common_buffers: bool,
    /// Device registers too (`with_doorbells`): the binary's stores there are its doorbells.
    doorbells: bool,
    blocks: Mutex<BTreeMap<usize, Block>>,
}

/// What `vhca.race_watch` lists: pool tags, and `common-buffers`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WatchList {
    pub tags: Vec<u32>,
    pub common_buffers: bool,
}

impl WatchList {
    /// Nothing to watch.
    pub fn is_empty(&self) -> bool {
        self.tags.is_empty() && !self.common_buffers
    }

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
    /// What the fault hands `hook`: the address touched, the instruction, whether it was a write, and whether the
    /// instruction is the binary's (reported) or the loader's own (only decoded).
    static PENDING: Cell<(usize, usize, bool, bool)> = const { Cell::new((0, 0, false, false)) };
    /// The registers as the first fault found them, and where on the stack the trampoline returns from: `hook`
    /// plans with the one and may point the other at a copy of the instruction (out_of_line.rs).
    static GREGS: Cell<[i64; 23]> = const { Cell::new([0; 23]) };
    static RETURN_SLOT: Cell<usize> = const { Cell::new(0) };
    /// The armed instruction as `hook` decoded it, for running it through its blocks' aliases.
    static PLAN: Cell<Plan> = const { Cell::new(Plan::EMPTY) };
    /// The register moves of the instruction this thread is stepping through aliases, undone after it.
    static SHIFTED: Cell<Shifts> = const { Cell::new([None; 2]) };
    /// The decoder's scratch, kept per thread (it allocates once).
    static DECODER: RefCell<Option<iced_x86::InstructionInfoFactory>> = const { RefCell::new(None) };
    /// The blocks this thread opened for the instruction it is stepping (two: one instruction may touch two).
    static STEPPING: Cell<[usize; 2]> = const { Cell::new([0; 2]) };
    /// A hooked read being stepped: where its bytes can be read (the alias, or the block opened), its address,
    /// the instruction, and the bytes there before it ran. A read-modify-write instruction (`inc qword [rax]`)
    /// faults as a read under QEMU's TCG, which loads first, so whether it also wrote is told by the bytes after
    /// the step.
    static READ_STEP: Cell<(usize, usize, usize, u64)> = const { Cell::new((0, 0, 0, 0)) };
    /// What `after_hook` reports: a stepped read that changed its bytes, at this address, by this instruction.
    static WROTE: Cell<(usize, usize)> = const { Cell::new((0, 0)) };
    /// An instruction taken back from its copy after a fault there (`on_copy_fault`), running again in place under
    /// the trap flag: its step ends here whether or not it touched a watched block again.
    static RERUN: Cell<bool> = const { Cell::new(false) };
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

/// Up to 8 bytes at `address`, within its page (an alias, or a block the caller stepped or is stepping open).
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

/// A second mapping of the `bytes` at `first`, read/write, or 0 when the pages cannot have one: mremap with an old
/// size of 0 duplicates a shared mapping and refuses a private one (the guest's backend maps its memory shared
/// while the watch is on, for this).
fn alias_of_pages(first: usize, bytes: usize) -> usize {
    // SAFETY: a new mapping at an address the kernel picks; the pages at `first` stay where they are (old size 0).
    let alias = unsafe { libc::mremap(first as *mut libc::c_void, 0, bytes, libc::MREMAP_MAYMOVE) };
    if alias == libc::MAP_FAILED {
        return 0;
    }
    protect(alias as usize, bytes, true);
    alias as usize
}

/// Sets the protection of whole pages at `at`.
fn protect(at: usize, bytes: usize, accessible: bool) {
    let protection = if accessible { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_NONE };
    // SAFETY: whole pages of one watched range: a pool block or common buffer the backend maps for it alone (one
    // mapping per allocation), the device registers the bus mapped for MmMapIoSpaceEx, or the alias made of either;
    // nothing but the driver, the model's checks and the watch touch them.
    unsafe { libc::mprotect(at as *mut libc::c_void, bytes, protection) };
}

impl RaceWatch {
    /// A watch over what `list` names; with nothing it watches nothing and costs nothing.
    pub fn new(list: WatchList) -> RaceWatch {
        let watch = RaceWatch {
            tags: list.tags,
            common_buffers: list.common_buffers,
            doorbells: false,
            blocks: Mutex::default(),
        };
        if watch.is_on() {
            watch.start();
        }
        watch
    }

    /// The same, and the device registers the bus maps (MmMapIoSpaceEx) trapped whatever the list says: an
    /// interleaving run's doorbells are then the binary's own stores (`insert_device_registers`), not every kernel
    /// call, with or without a pool block watched.
    pub fn with_doorbells(list: WatchList) -> RaceWatch {
        let mut watch = RaceWatch::new(list);
        if !watch.is_on() {
            watch.start();
        }
        watch.doorbells = true;
        watch
    }

    fn start(&self) {
        install_trap_handler();
        vhca_ntmodel::observe_points(protect_pending);
    }

    /// Whether any pool block or common buffer is watched.
    pub fn is_on(&self) -> bool {
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
        let alias = alias_of_pages(first, bytes);
        crate::lock(&self.blocks).insert(first, Block { bytes, model_first, alias, open: 0, device: None });
        PENDING_BLOCKS.with(|p| p.borrow_mut().push((first, bytes)));
    }

    /// The device registers the bus mapped at `at` (`bytes`) for `device`, when anything is watched or the watch
    /// was made `with_doorbells`: trapped from now on, so the binary's stores there reach the model as its
    /// doorbells (`binary_doorbell`) and kernel calls need not stand in for them. `alias` maps the same whole pages a second time (given their first address and
    /// length), through which the trapped accesses run. True when they are trapped.
    pub fn insert_device_registers(
        &self,
        at: usize,
        bytes: usize,
        device: u64,
        alias: impl FnOnce(usize, usize) -> Option<usize>,
    ) -> bool {
        if !(self.is_on() || self.doorbells) || at == 0 || bytes == 0 {
            return false;
        }
        let first = at - at % PAGE;
        let bytes = (at + bytes).div_ceil(PAGE) * PAGE - first;
        let alias = alias(first, bytes).unwrap_or(0);
        crate::lock(&self.blocks).insert(first, Block { bytes, model_first: 0, alias, open: 0, device: Some(device) });
        // At once: the driver may ring a doorbell before its next kernel call.
        protect(first, bytes, false);
        true
    }

    /// The block at `at` is being freed (or device registers unmapped): accessible again first, as the model
    /// reuses its pages.
    pub fn remove(&self, at: usize) {
        let first = at - at % PAGE;
        if let Some(block) = crate::lock(&self.blocks).remove(&first) {
            protect(first, block.bytes, true);
            if block.alias != 0 {
                // SAFETY: the alias `watch` made of this block, which only stepped instructions of the watch use.
                unsafe { libc::munmap(block.alias as *mut libc::c_void, block.bytes) };
            }
        }
    }

    /// A CRT routine (memcpy, memmove, memset, memcmp) the binary called from `caller` over `ranges` (address,
    /// bytes, written): the bytes of each in a watched block are reported as the binary's access at its call site,
    /// then `f` runs on the addresses it is given, one per range. Where every range that touches a watched block
    /// lies in one aliased block, those are the ranges' places in the aliases; else they are the ranges
    /// themselves, with the blocks they touch open (a copy through them would otherwise fault at every
    /// instruction). All or none: memmove orders an overlapping copy by comparing its two addresses.
    pub fn crt_call<T>(&self, caller: u64, ranges: &[(usize, usize, bool)], f: impl FnOnce(&[usize]) -> T) -> T {
        let mut at: Vec<usize> = ranges.iter().map(|r| r.0).collect();
        if !self.is_on() {
            return f(&at);
        }
        let mut views = at.clone();
        let mut touched: Vec<usize> = Vec::new();
        let mut through_aliases = true;
        for (&(start, bytes, write), view) in ranges.iter().zip(views.iter_mut()).filter(|(r, _)| r.1 > 0) {
            let parts: Vec<(usize, Target, u64)> = {
                let blocks = crate::lock(&self.blocks);
                let alias =
                    blocks.alias_of(start as u64).filter(|(f, b, a)| *a != 0 && (start + bytes) as u64 <= f + b);
                if let Some((first, _, alias)) = alias {
                    *view = alias as usize + (start - first as usize);
                }
                blocks
                    .range(..start + bytes)
                    .filter(|(first, b)| **first + b.bytes > start)
                    .map(|(first, b)| {
                        let from = start.max(*first);
                        let end = (start + bytes).min(first + b.bytes);
                        (*first, b.target(from - first), (end - from) as u64)
                    })
                    .collect()
            };
            through_aliases &= parts.is_empty() || *view != start;
            for (first, target, len) in parts {
                if let Some(k) = crate::kernel_context::installed() {
                    // The call's own byte names the site: a return address may begin the next routine.
                    let site = crate::driver_fault::image_site(caller.saturating_sub(1));
                    match target {
                        Target::Memory(va) => k.model.binary_access(va, len, write, &site),
                        Target::Device(device) if write => k.model.binary_doorbell(device, &site),
                        Target::Device(_) => {}
                    }
                }
                touched.push(first);
            }
        }
        if touched.is_empty() {
            return f(&at);
        }
        if through_aliases {
            THROUGH_ALIAS.fetch_add(1, Ordering::Relaxed);
            at = views;
            return f(&at);
        }
        WITH_BLOCK_OPEN.fetch_add(1, Ordering::Relaxed);
        for first in &touched {
            self.open(*first);
        }
        let result = f(&at);
        for first in touched {
            self.close(first);
        }
        result
    }

    /// The watched block holding `address`: its first page's address and what `address` is in it.
    fn block_of(&self, address: usize) -> Option<(usize, Target)> {
        let blocks = crate::lock(&self.blocks);
        let (first, block) = blocks.range(..=address).next_back()?;
        (address - first < block.bytes).then(|| (*first, block.target(address - first)))
    }

    /// The device whose registers hold `address`, when they are watched.
    fn device_of(&self, address: usize) -> Option<u64> {
        match self.block_of(address)?.1 {
            Target::Device(device) => Some(device),
            Target::Memory(_) => None,
        }
    }

    /// Where `address`, in a watched block, is in that block's alias.
    fn alias_address(&self, address: usize) -> Option<usize> {
        let (first, _, alias) = crate::lock(&self.blocks).alias_of(address as u64).filter(|b| b.2 != 0)?;
        Some(alias as usize + (address - first as usize))
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
    let shifted = SHIFTED.get()[0].is_some();
    let hooked = ARMED.get() == rip;
    if hooked && !shifted && stepping[0] == 0 {
        ARMED.set(0);
        // The hooked instruction again: through its blocks' aliases when `hook` could plan it.
        let plan = PLAN.replace(Plan::EMPTY);
        let shifts = (plan.rip == rip).then(|| plan.shifts(&gregs[..], &*crate::lock(&k.race_watch.blocks))).flatten();
        if let Some(shifts) = shifts {
            for s in shifts.iter().flatten() {
                gregs[s.greg] = (gregs[s.greg] as u64).wrapping_add(s.amount) as i64;
            }
            SHIFTED.set(shifts);
            THROUGH_ALIAS.fetch_add(1, Ordering::Relaxed);
            if in_driver && !write && k.race_watch.device_of(address).is_none() {
                if let Some(view) = k.race_watch.alias_address(address) {
                    // SAFETY: an alias page, always accessible.
                    READ_STEP.set((view, address, rip, unsafe { bytes_at(view) }));
                }
            }
            gregs[libc::REG_EFL as usize] |= TRAP_FLAG;
            return true;
        }
    }
    if hooked || shifted || stepping[0] != 0 {
        // Stepped with its block open: the hooked instruction no alias could take, or a second block the stepped
        // instruction touches.
        ARMED.set(0);
        let slot = usize::from(stepping[0] != 0);
        if stepping[slot] != 0 {
            // A third block in one instruction: nothing does that; leave it to the default verdicts.
            return false;
        }
        let mut now = stepping;
        now[slot] = first;
        STEPPING.set(now);
        WITH_BLOCK_OPEN.fetch_add(1, Ordering::Relaxed);
        k.race_watch.open(first);
        if hooked && in_driver && !write && k.race_watch.device_of(address).is_none() {
            // SAFETY: the block holding `address` was just opened.
            READ_STEP.set((address, address, rip, unsafe { bytes_at(address) }));
        }
        gregs[libc::REG_EFL as usize] |= TRAP_FLAG;
        return true;
    }
    PENDING.set((address, rip, write, in_driver));
    let mut snapshot = [0i64; 23];
    snapshot.copy_from_slice(&gregs[..23]);
    GREGS.set(snapshot);
    // A call of `hook_trampoline` from below the red zone: [rsp] the instruction to run again, which the
    // trampoline's `ret 128` returns to with the stack pointer as it was.
    let rsp = gregs[libc::REG_RSP as usize] - RED_ZONE - 8;
    RETURN_SLOT.set(rsp as usize);
    // SAFETY: the interrupted thread's own stack, below its stack pointer and the red zone (unused by any frame).
    unsafe { (rsp as *mut u64).write(rip as u64) };
    gregs[libc::REG_RSP as usize] = rsp;
    gregs[libc::REG_RIP as usize] = hook_trampoline as *const () as usize as i64;
    true
}

/// A SIGSEGV or SIGBUS by an instruction running as its copy (out_of_line.rs), the block's alias gone under it (a
/// free on another processor between the hook and the copy): the instruction is taken back to where the binary has
/// it, its registers as the binary left them, and runs again there with its watched block opened for it (`ARMED`,
/// no second hook: its access was reported), under the trap flag. What it touches then is the real memory, so a
/// fault it takes is the binary's own, at the image's address, and gets its verdict there. False when `context`'s
/// instruction is in no copy.
///
/// # Safety
/// `context` is this signal's ucontext.
pub(crate) unsafe fn on_copy_fault(context: &mut libc::ucontext_t) -> bool {
    let gregs = &mut context.uc_mcontext.gregs;
    let Some((rip, shifts)) = out_of_line::original_of(gregs[libc::REG_RIP as usize] as usize) else { return false };
    back_to_original(gregs, rip, shifts);
    true
}

/// `on_copy_fault`'s register work, apart for its test: every move undone (a faulting instruction changed none of
/// them), the instruction pointer at the original, armed to step in place.
fn back_to_original(gregs: &mut [i64], rip: usize, shifts: Shifts) {
    for s in shifts.iter().flatten() {
        gregs[s.greg] = (gregs[s.greg] as u64).wrapping_sub(s.amount) as i64;
    }
    gregs[libc::REG_RIP as usize] = rip as i64;
    gregs[libc::REG_EFL as usize] |= TRAP_FLAG;
    PLAN.set(Plan::EMPTY);
    ARMED.set(rip);
    RERUN.set(true);
}

/// The instruction after a watched access ran under the trap flag: its register moves are undone, its opened
/// blocks close, and the flag is cleared. False when the thread stepped nothing (not the watch's trap).
///
/// # Safety
/// `context` is this SIGTRAP's ucontext.
unsafe fn on_step(context: &mut libc::ucontext_t) -> bool {
    let stepping = STEPPING.replace([0; 2]);
    let shifted = SHIFTED.replace([None; 2]);
    let rerun = RERUN.replace(false);
    let gregs = &mut context.uc_mcontext.gregs;
    if stepping[0] == 0 && shifted[0].is_none() {
        if !rerun {
            return false;
        }
        // Taken back from its copy and run without touching a watched block (the block was freed meanwhile).
        ARMED.set(0);
        gregs[libc::REG_EFL as usize] &= !TRAP_FLAG;
        return true;
    }
    for s in shifted.iter().flatten().filter(|s| s.restore) {
        gregs[s.greg] = (gregs[s.greg] as u64).wrapping_sub(s.amount) as i64;
    }
    let (view, read_at, read_by, before) = READ_STEP.replace((0, 0, 0, 0));
    // SAFETY: the stepped read's alias, or its block, still open (it closes below).
    let wrote = view != 0 && unsafe { bytes_at(view) } != before;
    if let Some(k) = crate::kernel_context::installed() {
        for first in stepping.into_iter().filter(|f| *f != 0) {
            k.race_watch.close(first);
        }
    }
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

/// Step 1, on the interrupted thread and stack: for the binary's access, its scheduling point and its report to
/// the race detector; for any, the instruction's decoding. Then the instruction runs as a copy through its
/// blocks' aliases (the trampoline returns into the copy: out_of_line.rs), or, where no copy can mean the same,
/// again in place (`ARMED`: steps 2 and 3).
extern "C" fn hook() {
    let (address, rip, write, in_driver) = PENDING.get();
    let gregs = GREGS.get();
    let plan = decode_at(rip).unwrap_or(Plan::EMPTY);
    let Some(k) = crate::kernel_context::installed() else {
        ARMED.set(rip);
        return;
    };
    // Whether a copy can run it: its moves computed from the registers it faulted with, which it finds again (the
    // trampoline restores them).
    let copying =
        plan.relocatable_code().is_some() && plan.shifts(&gregs, &*crate::lock(&k.race_watch.blocks)).is_some();
    // What the instruction does there: as decoded for a copy (which has no step to tell a read-modify-write by
    // its bytes after), else as the fault says (a TCG read-modify-write faults as a read; its step tells).
    let access = if copying { plan.access_at(&gregs, address as u64) } else { None };
    let access = access.unwrap_or(if write { Access::Write } else { Access::Read });
    if in_driver {
        let site = || crate::driver_fault::image_site(rip as u64);
        match k.race_watch.block_of(address) {
            Some((_, Target::Memory(va))) => match access {
                Access::ReadWrite => {
                    let site = site();
                    k.model.binary_access(va, 1, false, &site);
                    k.model.binary_write_after_read(va, 1, &site);
                }
                Access::Write => k.model.binary_access(va, 1, true, &site()),
                Access::Read | Access::Conditional => k.model.binary_access(va, 1, write, &site()),
            },
            Some((_, Target::Device(device))) if matches!(access, Access::Write | Access::ReadWrite) => {
                DOORBELLS.fetch_add(1, Ordering::Relaxed);
                k.model.binary_doorbell(device, &site())
            }
            _ => {}
        }
    }
    // After the point, where the thread may have paused and a block may have gone: the moves again, then the copy.
    if copying {
        let shifts = plan.shifts(&gregs, &*crate::lock(&k.race_watch.blocks));
        let copy = shifts.zip(plan.relocatable_code()).and_then(|(s, code)| out_of_line::copy_of(rip, code, s));
        if let Some(copy) = copy {
            // SAFETY: the trampoline's return slot on this thread's stack, which `on_fault` wrote.
            unsafe { (RETURN_SLOT.get() as *mut u64).write(copy as u64) };
            THROUGH_ALIAS.fetch_add(1, Ordering::Relaxed);
            AS_COPIES.fetch_add(1, Ordering::Relaxed);
            return;
        }
    }
    PLAN.set(plan);
    ARMED.set(rip);
}

/// The instruction at `rip` as `redirect::decode` reads it. Its bytes are read within its page first: one that
/// runs on into the next page has that page mapped (the processor fetched it before the access faulted).
fn decode_at(rip: usize) -> Option<Plan> {
    DECODER.with(|decoder| {
        let mut decoder = decoder.borrow_mut();
        let info = decoder.get_or_insert_with(iced_x86::InstructionInfoFactory::new);
        let in_page = (PAGE - rip % PAGE).min(redirect::MAX_INSTRUCTION);
        // SAFETY: code the thread was running, within its page.
        let code = unsafe { std::slice::from_raw_parts(rip as *const u8, in_page) };
        redirect::decode(rip, code, info).or_else(|| {
            if in_page == redirect::MAX_INSTRUCTION {
                return None;
            }
            // SAFETY: as above, the instruction's bytes running on into the next page.
            let code = unsafe { std::slice::from_raw_parts(rip as *const u8, redirect::MAX_INSTRUCTION) };
            redirect::decode(rip, code, info)
        })
    })
}

/// After a stepped read that changed its bytes (a read-modify-write): the write, reported without a point of its
/// own (nothing can come between an instruction's load and its store).
extern "C" fn after_hook() {
    let (address, rip) = WROTE.replace((0, 0));
    if let Some(k) = crate::kernel_context::installed() {
        if let Some((_, Target::Memory(va))) = k.race_watch.block_of(address) {
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
    fn a_fault_in_a_copy_takes_the_instruction_back_to_the_image_with_its_registers_unmoved() {
        use redirect::Shift;
        let moved = Shift { greg: libc::REG_RCX as usize, number: 1, amount: 0x7000_0000, restore: true };
        let mut gregs = [0i64; 23];
        gregs[libc::REG_RCX as usize] = 0x7001_0008;
        gregs[libc::REG_RIP as usize] = 0x9999;
        back_to_original(&mut gregs, 0x4000_1234, [Some(moved), None]);
        assert_eq!(gregs[libc::REG_RCX as usize], 0x1_0008, "the block's own address again");
        assert_eq!(gregs[libc::REG_RIP as usize], 0x4000_1234, "the image's instruction");
        assert_ne!(gregs[libc::REG_EFL as usize] & TRAP_FLAG, 0, "stepped");
        assert_eq!((ARMED.get(), RERUN.get()), (0x4000_1234, true), "armed to step in place, not hooked again");
        ARMED.set(0);
        RERUN.set(false);
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
        let watch = RaceWatch { tags: vec![7], common_buffers: false, doorbells: false, blocks: Mutex::default() };
        watch.insert(block + 16, 8, 0x5000_0010, 6);
        assert_eq!(watch.block_of(block + 16), None, "an unwatched tag");
        watch.insert(block + 16, PAGE, 0x5000_0010, 7);
        assert_eq!(watch.block_of(block + 20), Some((block, Target::Memory(0x5000_0014))));
        let last = Target::Memory(0x5000_0000 + 2 * PAGE as u64 - 1);
        assert_eq!(watch.block_of(block + 2 * PAGE - 1), Some((block, last)));
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
