//! The driver's part of the call stack at a kernel call, as Driver Verifier's systematic low resources simulation
//! identifies a call ("the portion of the call stack that comes from the driver", the same "even if the driver is
//! reloaded into a different memory location": docs/verifier.md). The faultable imports are bound to an entry stub
//! (`site_entry!`) that saves the caller's stack pointer and nonvolatile registers before the thunk runs; from them
//! the return address is the first frame, and each deeper one is an x64 unwind through the image's .pdata/.xdata, as
//! RtlVirtualUnwind does it (pe-unwind-info, Mozilla's parser and unwinder of PE x64 unwind info). vhca.sys has no
//! Linux unwind data, so the host's unwinder cannot do this. Frames are kept as RVAs (`CallSite::image`).

use std::cell::RefCell;

use pe_unwind_info::x86_64::{FunctionTableEntries, Register, UnwindState, XmmRegister};
use vhca_ntmodel::{CallSite, InjectionMode, InterleavingMode};

use crate::image_mapping::MappedImage;
use crate::loaded_images::{self, LoadedImage};
use crate::pe_image::PAGE;

/// How many of the driver's frames a site keeps at most (Windows' stack traces in `!verifier` stop at a few dozen).
pub const MAX_FRAMES: usize = 32;

/// Lets stack walks unwind through `image` under `name` (the module name the call sites print). An image without
/// an exception directory is not walkable: its calls have no site, and nothing fails there.
pub fn register(image: &MappedImage, name: &str) {
    let Some(pdata) = image.image.exception_directory else { return };
    let sections = image.image.sections.iter().map(|s| (s.rva, s.virtual_size.div_ceil(PAGE) * PAGE)).collect();
    loaded_images::insert(LoadedImage {
        name: name.to_string(),
        base: image.base(),
        size: image.size(),
        sections,
        pdata,
    });
}

/// The caller's registers at a faultable import's entry, as the entry stub pushed them (lowest address first): the
/// nonvolatile registers of the Windows x64 convention, the four register arguments, then the return address the
/// driver's `call` pushed. Its address + 12 words is the stack pointer at entry.
#[repr(C)]
pub struct EntryRegisters {
    pub rbx: u64,
    pub rbp: u64,
    pub rsi: u64,
    pub rdi: u64,
    pub r12: u64,
    pub r13: u64,
    pub r14: u64,
    pub r15: u64,
    pub arguments: [u64; 4],
    pub return_address: u64,
}

/// The x64 register file an unwind reads and updates, indexed by the unwind codes' register numbers.
struct Registers {
    gpr: [u64; 16],
    /// Stack reads stay within [low, high): the driver's stack from the import's entry up to the thread's top.
    stack: (u64, u64),
}

impl UnwindState for Registers {
    fn read_register(&mut self, register: Register) -> u64 {
        self.gpr[register as usize]
    }

    fn read_stack(&mut self, addr: u64) -> Option<u64> {
        let (low, high) = self.stack;
        if addr < low || addr.checked_add(8).is_none_or(|end| end > high) || !addr.is_multiple_of(8) {
            return None;
        }
        // SAFETY: an aligned word inside this thread's own stack, above the live frame of the import's caller.
        Some(unsafe { (addr as *const u64).read() })
    }

    fn write_register(&mut self, register: Register, value: u64) {
        self.gpr[register as usize] = value;
    }

    fn write_xmm_register(&mut self, _register: XmmRegister, _value: u128) {
        // A stack walk needs no vector registers.
    }
}

/// The return addresses of the driver's frames, innermost first, from the registers at an import's entry: the
/// return address, then one per unwound frame for as long as the unwind stays inside a registered image (the first
/// frame outside, the loader's or the kernel's code that called the driver, ends the driver's part).
pub fn driver_frames(entry: &EntryRegisters, stack_top: u64) -> (Option<(String, u64, u32)>, Vec<u64>) {
    // The table stays read-locked for the walk: the image it reads cannot be unmapped under it.
    loaded_images::with_image_at(entry.return_address, |image| {
        let entry_sp =
            entry as *const EntryRegisters as u64 + std::mem::offset_of!(EntryRegisters, return_address) as u64;
        let mut registers = Registers { gpr: [0; 16], stack: (entry_sp, stack_top) };
        for (register, value) in [
            (Register::RBX, entry.rbx),
            (Register::RBP, entry.rbp),
            (Register::RSI, entry.rsi),
            (Register::RDI, entry.rdi),
            (Register::R12, entry.r12),
            (Register::R13, entry.r13),
            (Register::R14, entry.r14),
            (Register::R15, entry.r15),
            // After the driver's call returns, its stack pointer is one word above the return address.
            (Register::RSP, entry_sp + 8),
        ] {
            registers.write_register(register, value);
        }
        let mut frames = vec![entry.return_address];
        let mut pc = entry.return_address;
        while frames.len() < MAX_FRAMES {
            let Some(pdata) = image.at_rva(image.pdata.0).map(|b| &b[..b.len().min(image.pdata.1 as usize)]) else {
                break;
            };
            let table = FunctionTableEntries::parse(pdata);
            let rva = (pc - image.base as u64) as u32;
            let Some(caller) = table.unwind_frame(&mut registers, |rva| image.at_rva(rva), rva) else { break };
            if !image.contains(caller) {
                break;
            }
            frames.push(caller);
            pc = caller;
        }
        (Some((image.name.clone(), image.base as u64, image.size as u32)), frames)
    })
    .unwrap_or((None, Vec::new()))
}

thread_local! {
    /// The site the entry stub found for the import about to run on this thread; the thunk takes it.
    static PENDING: RefCell<Option<CallSite>> = const { RefCell::new(None) };
    /// This thread's stack top (cached: reading it may parse /proc/self/maps for the main thread).
    static STACK_TOP: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// The highest address of the calling thread's stack.
fn stack_top() -> u64 {
    STACK_TOP.with(|top| {
        if top.get() == 0 {
            top.set(thread_stack_top().unwrap_or(0));
        }
        top.get()
    })
}

fn thread_stack_top() -> Option<u64> {
    // SAFETY: pthread_getattr_np fills `attr` for the calling thread, read and destroyed here.
    unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        if libc::pthread_getattr_np(libc::pthread_self(), &mut attr) != 0 {
            return None;
        }
        let (mut low, mut size) = (std::ptr::null_mut(), 0usize);
        let ok = libc::pthread_attr_getstack(&attr, &mut low, &mut size) == 0;
        libc::pthread_attr_destroy(&mut attr);
        ok.then(|| low as u64 + size as u64)
    }
}

/// Called by every entry stub before its thunk, on the driver's stack: records the driver's call site for the thunk
/// when something names calls by it: the low-resources simulation, or an interleaving mode (its points, pauses and
/// race reports then name the binary's RVA+symbol, not the thunk's line). The walk costs a few microseconds; with
/// both off, nothing.
///
/// # Safety
/// `entry` is the block an entry stub pushed on this thread's stack, below the driver's live frames.
pub unsafe extern "win64" fn capture(entry: *const EntryRegisters) {
    let wanted = crate::kernel_context::installed().is_some_and(|k| {
        k.model.injection_mode() != InjectionMode::Off || k.model.config().interleaving.mode != InterleavingMode::Off
    });
    let site = wanted.then(|| {
        // SAFETY: the caller's contract.
        let entry = unsafe { &*entry };
        match driver_frames(entry, stack_top()) {
            (Some((name, base, size)), frames) => Some(CallSite::image(&name, base, size, &frames)),
            (None, _) => None,
        }
    });
    PENDING.with(|p| *p.borrow_mut() = site.flatten());
}

/// Runs a faultable thunk's call into the model as called from the driver's site the entry stub captured (a call
/// with none, a thunk called from Rust in a test or with the simulation off, runs as is).
pub fn at_driver_site<T>(f: impl FnOnce() -> T) -> T {
    match PENDING.with(|p| p.borrow_mut().take()) {
        Some(site) => vhca_ntmodel::with_call_site(site, f),
        None => f(),
    }
}

/// Defines `$entry`, the address a faultable import is bound to: it saves the caller's nonvolatile registers, its
/// register arguments and (implicitly, by where they are) its stack pointer, calls `capture` with them, restores the
/// arguments and jumps to `$thunk` with the stack exactly as the driver's call left it, so the thunk returns
/// straight to the driver. Only integer arguments are preserved (xmm0-3 are volatile in `capture`): no faultable
/// routine takes a floating-point one.
macro_rules! site_entry {
    ($entry:ident => $thunk:path) => {
        #[unsafe(naked)]
        pub(crate) unsafe extern "win64" fn $entry() {
            core::arch::naked_asm!(
                // At entry rsp = 8 (mod 16), [rsp] = the driver's return address.
                "push rcx",
                "push rdx",
                "push r8",
                "push r9",
                "push r15",
                "push r14",
                "push r13",
                "push r12",
                "push rdi",
                "push rsi",
                "push rbp",
                "push rbx",
                // rsp -> EntryRegisters; 12 pushes keep rsp = 8 (mod 16): 0x28 = shadow space + alignment.
                "mov rcx, rsp",
                "sub rsp, 0x28",
                "call {capture}",
                // The nonvolatile registers are unchanged (capture is win64): drop their copies.
                "add rsp, 0x28 + 8 * 8",
                "pop r9",
                "pop r8",
                "pop rdx",
                "pop rcx",
                "jmp {thunk}",
                capture = sym $crate::driver_stack::capture,
                thunk = sym $thunk,
            )
        }
    };
}
pub(crate) use site_entry;
