//! The processor control region a WDK-built x64 driver reads through GS, one per thread that runs driver code: a
//! KPCR with its KPRCB behind it and a KTHREAD stand-in, set as the thread's GS base (arch_prctl ARCH_SET_GS).
//!
//! The fields are the ones the WDK's x64 inline routines read (WDK 10 km/wdm.h and km/ntddk.h, public mirror
//! github.com/MuAlphaOmegaEpsilon/wdk-10): KeGetCurrentThread `__readgsqword(0x188)` (KPRCB.CurrentThread, the
//! KPRCB at KPCR+0x180), KeGetCurrentProcessorIndex `__readgsdword(0x1a4)` (KPRCB.Number, Windows 7 and later),
//! the legacy KeGetCurrentProcessorNumber `__readgsbyte(0x184)` (ntddk.h, without NT_PROCESSOR_GROUPS), KeGetPcr
//! `__readgsqword(FIELD_OFFSET(KPCR, Self))` (ntddk.h's AMD64 KPCR: Self at 0x18, CurrentPrcb at 0x20), and
//! PCR_MAJOR_VERSION / PCR_MINOR_VERSION (1, 1) at MajorVersion 0x60 / MinorVersion 0x62. KPCR.Irql (0x50) is not
//! kept: the x64 headers read the IRQL from CR8 only (`cr8_emulation`), and a stale copy would mislead.
//!
//! Why GS is free: on x86-64 Linux glibc and Rust's thread locals use FS (`%fs:` TLS and the stack protector's
//! canary); nothing in the loader's process reads GS (`tests/cr8_and_gs.rs` sets it and runs thread locals, the
//! allocator and the model over it). The kernel keeps each thread's GS base across switches and signals.

use std::cell::RefCell;

/// KPCR.Self: the KPCR's own address (KeGetPcr).
pub const KPCR_SELF: usize = 0x18;
/// KPCR.CurrentPrcb: the KPRCB's address.
pub const KPCR_CURRENT_PRCB: usize = 0x20;
/// KPCR.MajorVersion and MinorVersion (u16 each).
pub const KPCR_MAJOR_VERSION: usize = 0x60;
pub const KPCR_MINOR_VERSION: usize = 0x62;
/// The KPRCB inside the KPCR (KPCR.Prcb; "the offset to the PRCB in the PCR is fixed for all time", ntddk.h).
pub const KPCR_PRCB: usize = 0x180;
/// gs:[0x184]: KPRCB.LegacyNumber, the byte the legacy KeGetCurrentProcessorNumber reads.
pub const GS_LEGACY_PROCESSOR_NUMBER: usize = 0x184;
/// gs:[0x188]: KPRCB.CurrentThread (KeGetCurrentThread).
pub const GS_CURRENT_THREAD: usize = 0x188;
/// gs:[0x1a4]: KPRCB.Number (KeGetCurrentProcessorIndex).
pub const GS_PROCESSOR_NUMBER: usize = 0x1a4;

/// The KPCR and its KPRCB: Windows 10's KPRCB runs past 0x8000 bytes; a driver reading a field the loader does not
/// fill reads zero instead of faulting (the pages are touched only if read).
const PCR_BYTES: usize = 0x10000;
/// A KTHREAD stand-in: opaque to drivers (wdm.h declares no fields), zero, one page per thread.
const THREAD_BYTES: usize = 0x1000;

const ARCH_SET_GS: libc::c_int = 0x1001;
const ARCH_GET_GS: libc::c_int = 0x1004;

/// One thread's blocks, unmapped when the thread ends (after its GS base is cleared).
struct ThreadBlocks {
    base: usize,
}

impl Drop for ThreadBlocks {
    fn drop(&mut self) {
        // SAFETY: GS back to 0 first, so nothing on this thread reads the blocks after; then our own mapping.
        unsafe {
            libc::syscall(libc::SYS_arch_prctl, ARCH_SET_GS, 0usize);
            libc::munmap(self.base as *mut libc::c_void, PCR_BYTES + THREAD_BYTES);
        }
    }
}

thread_local! {
    static BLOCKS: RefCell<Option<ThreadBlocks>> = const { RefCell::new(None) };
}

/// What a thread's GS points at, as the driver reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessorBlock {
    pub kpcr: usize,
    pub kprcb: usize,
    pub kthread: usize,
    pub processor: u32,
}

/// Gives the calling thread its KPCR, KPRCB and KTHREAD behind GS, once, and its processor number there at every
/// call: `processor` is the model's number of the processor the thread runs on now (the loader calls this each
/// time the model enters driver code, and a thread changes processor between such entries: the interrupt thread
/// runs each message on its own processor). Windows keeps one KPCR per processor; here each thread has its own,
/// so the number is rewritten rather than the block swapped. None when the mapping or arch_prctl failed: driver
/// code then reads GS at base 0 and faults there (0x7E naming the instruction), as before this block existed.
pub fn prepare(processor: u32) -> Option<ProcessorBlock> {
    if let Some(kpcr) = BLOCKS.with(|b| b.borrow().as_ref().map(|b| b.base)) {
        write_processor_number(kpcr, processor);
        return Some(read_back(kpcr));
    }
    // SAFETY: a fresh private anonymous mapping, zero-filled.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            PCR_BYTES + THREAD_BYTES,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return None;
    }
    let kpcr = base as usize;
    let kthread = kpcr + PCR_BYTES;
    // SAFETY: every write is inside the mapping just made (the offsets are below PCR_BYTES).
    unsafe {
        let at = |offset: usize| (kpcr + offset) as *mut u8;
        (at(KPCR_SELF) as *mut u64).write(kpcr as u64);
        (at(KPCR_CURRENT_PRCB) as *mut u64).write((kpcr + KPCR_PRCB) as u64);
        (at(KPCR_MAJOR_VERSION) as *mut u16).write(1);
        (at(KPCR_MINOR_VERSION) as *mut u16).write(1);
        (at(GS_CURRENT_THREAD) as *mut u64).write(kthread as u64);
    }
    write_processor_number(kpcr, processor);
    // SAFETY: sets this thread's GS base to the block; nothing else in the process uses GS (module note).
    if unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_SET_GS, kpcr) } != 0 {
        // SAFETY: our mapping, never handed out.
        unsafe { libc::munmap(base, PCR_BYTES + THREAD_BYTES) };
        return None;
    }
    BLOCKS.with(|b| *b.borrow_mut() = Some(ThreadBlocks { base: kpcr }));
    Some(read_back(kpcr))
}

/// KPRCB.LegacyNumber and KPRCB.Number of the block at `kpcr`.
fn write_processor_number(kpcr: usize, processor: u32) {
    // SAFETY: the calling thread's own block, mapped while the thread lives; both offsets are below PCR_BYTES.
    unsafe {
        ((kpcr + GS_LEGACY_PROCESSOR_NUMBER) as *mut u8).write(processor as u8);
        ((kpcr + GS_PROCESSOR_NUMBER) as *mut u32).write(processor);
    }
}

/// The calling thread's GS base, as the kernel holds it (0 when none was set).
pub fn gs_base() -> usize {
    let mut base = 0usize;
    // SAFETY: ARCH_GET_GS writes the base into `base`.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_GET_GS, &mut base as *mut usize) };
    base
}

fn read_back(kpcr: usize) -> ProcessorBlock {
    // SAFETY: the calling thread's own block, mapped while the thread lives.
    unsafe {
        let at = |offset: usize| kpcr + offset;
        ProcessorBlock {
            kpcr: (at(KPCR_SELF) as *const u64).read() as usize,
            kprcb: (at(KPCR_CURRENT_PRCB) as *const u64).read() as usize,
            kthread: (at(GS_CURRENT_THREAD) as *const u64).read() as usize,
            processor: (at(GS_PROCESSOR_NUMBER) as *const u32).read(),
        }
    }
}
