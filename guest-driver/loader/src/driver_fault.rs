//! A fault inside driver code ends the run with the bugcheck Windows gives, never a silent exit: SIGSEGV/SIGBUS
//! with the instruction pointer in the image becomes 0x7E (an access violation at a user-space address such as NULL,
//! raised as an exception no handler takes in a system thread) or 0x50 (a reference to an invalid kernel address),
//! with a line naming the RVA and the nearest symbol. A touch of paged pool the verifier trimmed (pageable_pool.rs),
//! from any code, pages it in below DISPATCH_LEVEL and is 0xD1 at or above it. Any other fault outside the image is
//! the loader's own crash and is left to the default action. A privileged instruction in the image comes first:
//! `mov` to or from CR8 is emulated (`cr8_emulation`), any other is 0x7E naming it (`privileged_instructions`).

use std::sync::OnceLock;

use vhca_ntapi::{NtKernel, DISPATCH_LEVEL};

use crate::cr8_emulation;
use crate::driver_symbols::DriverSymbols;
use crate::privileged_instructions::{self, Privileged};

/// SYSTEM_THREAD_EXCEPTION_NOT_HANDLED (Microsoft, "Bug Check 0x7E"): P1 the exception code, P2 the faulting
/// instruction, P3/P4 the exception and context records (not kept here: 0).
pub const SYSTEM_THREAD_EXCEPTION_NOT_HANDLED: u32 = 0x7E;
/// PAGE_FAULT_IN_NONPAGED_AREA (Microsoft, "Bug Check 0x50"): P1 the address referenced, P2 0 read / 2 write /
/// 0x10 execute, P3 the faulting instruction, P4 the type of fault (0 here: not present).
pub const PAGE_FAULT_IN_NONPAGED_AREA: u32 = 0x50;
const STATUS_ACCESS_VIOLATION: u64 = 0xC000_0005;
/// Addresses below this are the null page range Windows never maps in any process: a driver touching them is the
/// classic NULL dereference, which Windows raises as an access violation exception (the model's assumption for
/// the 0x7E/0x50 split; Microsoft documents both checks but not a threshold).
const NULL_RANGE: u64 = 0x1_0000;

struct Image {
    base: usize,
    size: usize,
    name: String,
    symbols: DriverSymbols,
}

static IMAGE: OnceLock<Image> = OnceLock::new();

/// The bugcheck a fault at `address` by the instruction at `rip` gives, from the x86 page-fault error code.
pub fn fault_bugcheck(address: u64, rip: u64, error_code: u64) -> (u32, [u64; 4]) {
    if address < NULL_RANGE {
        (SYSTEM_THREAD_EXCEPTION_NOT_HANDLED, [STATUS_ACCESS_VIOLATION, rip, 0, 0])
    } else {
        // Page-fault error code: bit 1 write, bit 4 instruction fetch.
        let access = if error_code & 0x10 != 0 {
            0x10
        } else if error_code & 0x2 != 0 {
            2
        } else {
            0
        };
        (PAGE_FAULT_IN_NONPAGED_AREA, [address, access, rip, 0])
    }
}

/// DRIVER_IRQL_NOT_LESS_OR_EQUAL (Microsoft, "Bug Check 0xD1"): P1 the address referenced, P2 the IRQL, P3 0 read /
/// 1 write / 8 execute, P4 the address of the instruction that referenced it.
pub const DRIVER_IRQL_NOT_LESS_OR_EQUAL: u32 = 0xD1;

/// The bugcheck for a touch of trimmed paged pool at `irql` (DISPATCH_LEVEL or above) by the instruction at `rip`.
pub fn paged_touch_bugcheck(address: u64, irql: u8, rip: u64, error_code: u64) -> (u32, [u64; 4]) {
    let access = if error_code & 0x10 != 0 {
        8
    } else if error_code & 0x2 != 0 {
        1
    } else {
        0
    };
    (DRIVER_IRQL_NOT_LESS_OR_EQUAL, [address, irql as u64, access, rip])
}

/// Installs the handlers for the image at `base`..`base + size`. Once per process.
pub fn install(base: usize, size: usize, name: &str, symbols: DriverSymbols) {
    let _ = IMAGE.set(Image { base, size, name: name.to_string(), symbols });
    install_handlers();
}

/// The process-wide handlers alone, with no image to name (a test whose driver routines are the test's own: a
/// trimmed paged pool touch still gets its verdict).
pub fn install_handlers() {
    prepare_thread();
    // SAFETY: SA_SIGINFO handlers for SIGSEGV and SIGBUS, a process-wide setting made before any driver code runs.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_fault as extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void) as usize;
        action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGSEGV, &action, std::ptr::null_mut());
        libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut());
    }
}

thread_local! {
    static ALTERNATE_STACK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Gives the calling thread an alternate signal stack, once: the fault handlers are process-wide, an alternate
/// stack is per thread, and driver code also runs on the NT model's threads (the ISR on the interrupt delivery
/// thread, DPCs where they drain, work items on the worker thread), where a driver overflowing its stack must still
/// get its verdict. The callbacks into driver code call this before they enter it.
pub fn prepare_thread() {
    // GS: the KPCR the WDK's inline routines read (KeGetCurrentThread, the processor number), on the processor the
    // model runs this thread on.
    let processor = crate::kernel_context::installed()
        .map_or(0, |k| vhca_ntapi::NtAsyncKernel::KeGetCurrentProcessorNumber(k.model.as_ref()));
    crate::processor_block::prepare(processor);
    if ALTERNATE_STACK.with(|done| done.replace(true)) {
        return;
    }
    let stack_size = 64 * 1024;
    // SAFETY: a fresh anonymous mapping, kept for the thread's life (a thread's alternate stack must outlive it),
    // registered as this thread's alternate signal stack.
    unsafe {
        let stack = libc::mmap(
            std::ptr::null_mut(),
            stack_size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if stack != libc::MAP_FAILED {
            let ss = libc::stack_t { ss_sp: stack, ss_flags: 0, ss_size: stack_size };
            libc::sigaltstack(&ss, std::ptr::null_mut());
        }
    }
}

extern "C" fn on_fault(signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    // SAFETY: the kernel's siginfo and ucontext for this signal.
    let (address, rip, error_code) = unsafe {
        let ctx = &*(context as *const libc::ucontext_t);
        (
            (*info).si_addr() as u64,
            ctx.uc_mcontext.gregs[libc::REG_RIP as usize] as u64,
            ctx.uc_mcontext.gregs[libc::REG_ERR as usize] as u64,
        )
    };
    // SAFETY: the kernel's siginfo and ucontext for this signal, which the emulation may change to resume elsewhere.
    if unsafe { privileged_instruction(signal, &*info, &mut *(context as *mut libc::ucontext_t)) } {
        return;
    }
    // A fault inside the race watch's copy of an instruction (its block's alias gone): the instruction runs again
    // where the image has it, so whatever it touches faults, if at all, at the image's address.
    // SAFETY: this signal's ucontext, which the watch changes to resume at the original instruction.
    if unsafe { crate::race_watch::on_copy_fault(&mut *(context as *mut libc::ucontext_t)) } {
        return;
    }
    // A block the race watch traps (race_watch.rs): the access is hooked or stepped, and the thread goes on.
    let in_driver = IMAGE.get().is_some_and(|i| (rip as usize).wrapping_sub(i.base) < i.size);
    // SAFETY: this SIGSEGV's ucontext, which the watch may change to resume in its hook or under the trap flag.
    if signal == libc::SIGSEGV
        && unsafe {
            crate::race_watch::on_fault(
                address as usize,
                error_code & 0x2 != 0,
                in_driver,
                &mut *(context as *mut libc::ucontext_t),
            )
        }
    {
        return;
    }
    // Paged pool the verifier trimmed (pageable_pool.rs), touched by the driver or a CRT routine it called: paged
    // back in below DISPATCH_LEVEL (the instruction runs again), 0xD1 at or above it.
    if let Some(k) = crate::kernel_context::installed().filter(|k| k.pageable.is_trimmed(address as usize)) {
        let irql = k.model.KeGetCurrentIrql();
        if irql < DISPATCH_LEVEL {
            k.pageable.page_in(address as usize);
            return;
        }
        println!("VHCA-LOADER: pageable memory at {address:#x} touched at IRQL {irql} by the instruction at {rip:#x}");
        let (code, [p1, p2, p3, p4]) = paged_touch_bugcheck(address, irql, rip, error_code);
        crate::kernel_context::bugcheck(code, p1, p2, p3, p4)
    }
    // SAFETY: this signal's ucontext.
    let rsp = unsafe { (*(context as *const libc::ucontext_t)).uc_mcontext.gregs[libc::REG_RSP as usize] } as u64;
    special_pool_fault(address, rip, rsp, error_code);
    let Some(image) = IMAGE.get().filter(|i| (rip as usize).wrapping_sub(i.base) < i.size) else {
        // Not the driver: the loader's own fault takes the default action (a core, an abnormal exit).
        // SAFETY: restoring the default disposition; returning re-runs the faulting instruction.
        unsafe { libc::signal(signal, libc::SIG_DFL) };
        return;
    };
    // Formatting allocates, which a signal handler should not; the process ends right after, so a lock the
    // faulting driver thread could hold (none: driver code holds no loader lock) is the only risk.
    let rva = (rip as usize - image.base) as u32;
    // The PDB is read here, on the first fault (DriverSymbols reads it lazily): the faulting thread is in driver
    // code, which holds none of this process's locks, and the run ends with this fault anyway.
    let symbol = match image.symbols.nearest(rva) {
        Some((name, offset)) => format!("{name}+{offset:#x}"),
        None => "no symbol".to_string(),
    };
    let line = format!(
        "VHCA-LOADER: {} in {} at RVA {rva:#x} ({symbol}) touching {address:#x}",
        if signal == libc::SIGBUS { "bus error" } else { "access violation" },
        image.name
    );
    let (code, [p1, p2, p3, p4]) = fault_bugcheck(address, rip, error_code);
    // An access violation Windows raises as an exception (0x7E's case) goes to the driver's own handlers first;
    // the line and the bugcheck are what the dispatch stops with when none takes it.
    if code == SYSTEM_THREAD_EXCEPTION_NOT_HANDLED && signal == libc::SIGSEGV {
        let write = error_code & 0x2 != 0;
        // SAFETY: this SIGSEGV's context, its RIP in the image; the signal returns into the dispatch.
        unsafe {
            crate::seh::raise::hand_over_fault(
                &mut *(context as *mut libc::ucontext_t),
                address,
                write,
                line,
                (code, [p1, p2, p3, p4]),
            )
        };
        return;
    }
    println!("{line}");
    crate::kernel_context::bugcheck(code, p1, p2, p3, p4)
}

/// The driver's instruction at `rip` as reports name it: `vhca.sys+0x1234 (symbol+0x56)`, or the bare address when
/// it is not the image's. Reads the PDB on first use: not for a signal handler.
pub fn image_site(rip: u64) -> String {
    let Some(image) = IMAGE.get().filter(|i| (rip as usize).wrapping_sub(i.base) < i.size) else {
        return format!("{rip:#x}");
    };
    let rva = (rip as usize - image.base) as u32;
    match image.symbols.nearest(rva) {
        Some((name, offset)) => format!("{}+{rva:#x} ({name}+{offset:#x})", image.name),
        None => format!("{}+{rva:#x}", image.name),
    }
}

/// Special Pool's guard page or a freed special pool block (special_pool.rs), touched by the driver (0xD6 / 0xD5,
/// its RVA and symbol named) or by other code (0xCD / 0xCC); returns when the fault is not special pool's. The
/// driver's stores include the CRT routines it imports (memcpy, memset: ntoskrnl.exe's exports, bound through a
/// win64 thunk to libc's), which call nothing back: at their fault the nearest return address into the image on
/// the stack, a few words up (libc's frame, the thunk's saved registers), is the driver's call site, and that is
/// what is named. Never an exception the driver may handle: Microsoft's pages say these "cannot be
/// protected by a try - except handler".
fn special_pool_fault(address: u64, rip: u64, rsp: u64, error_code: u64) {
    let Some(k) = crate::kernel_context::installed() else { return };
    let Some(fault) = k.addresses.special_pool.fault(address as usize) else { return };
    let in_image = |at: u64| IMAGE.get().filter(|i| (at as usize).wrapping_sub(i.base) < i.size);
    let (image, site_address, called) = match in_image(rip) {
        Some(image) => (Some(image), rip, false),
        None => {
            // Deep enough for the win64 thunk's frame (its return, three pushes and the ten XMM registers the
            // Windows convention makes it save: 24 words) and libc's memcpy (none); a value that only looks like
            // a code address of the image could name the wrong site, never change the parameters (P3 is RIP).
            const WORDS: usize = 64;
            // SAFETY: the faulting thread's stack pointer, on its own mapped stack (a fault on the stack itself is
            // not special pool's, so never here); the words above the stack pointer are the thread's frames.
            let caller =
                (0..WORDS).map(|i| unsafe { (rsp as *const u64).add(i).read() }).find(|a| in_image(*a).is_some());
            match caller {
                Some(caller) => (in_image(caller), caller, true),
                None => (None, rip, false),
            }
        }
    };
    let site = match image {
        Some(image) => {
            let rva = (site_address as usize - image.base) as u32;
            // A return address follows its call, which may end the function: the symbol is the call's byte's.
            let symbol = match image.symbols.nearest(if called { rva - 1 } else { rva }) {
                Some((name, offset)) => format!("{name}+{offset:#x}"),
                None => "no symbol".to_string(),
            };
            let by = if called { "a routine called from (returning to) " } else { "" };
            format!("{by}{} at RVA {rva:#x} ({symbol})", image.name)
        }
        None => format!("the instruction at {rip:#x}, outside the driver"),
    };
    let what = match fault {
        crate::special_pool::SpecialPoolFault::GuardPage => "special pool guard page",
        crate::special_pool::SpecialPoolFault::Freed => "freed special pool",
    };
    println!("VHCA-LOADER: {what} at {address:#x} touched by {site}");
    let (code, [p1, p2, p3, p4]) = fault.bugcheck(address, rip, error_code, image.is_some());
    crate::kernel_context::bugcheck(code, p1, p2, p3, p4)
}

/// A #GP in the image (SIGSEGV with SI_KERNEL, which a page fault never gives) at a privileged instruction: `mov`
/// to or from CR8 is emulated and the thread resumes (true); any other stops the run naming the instruction, its
/// RVA and symbol. False: not the image, or not a privileged instruction, for the verdicts below.
///
/// # Safety
/// `info` and `context` are this SIGSEGV's.
unsafe fn privileged_instruction(signal: libc::c_int, info: &libc::siginfo_t, context: &mut libc::ucontext_t) -> bool {
    const SI_KERNEL: libc::c_int = 0x80;
    let rip = context.uc_mcontext.gregs[libc::REG_RIP as usize] as u64;
    if signal != libc::SIGSEGV || info.si_code != SI_KERNEL {
        return false;
    }
    let Some(image) = IMAGE.get().filter(|i| (rip as usize).wrapping_sub(i.base) < i.size) else { return false };
    // SAFETY: a #GP is raised after the processor fetched the whole instruction at RIP, and the decoder reads only
    // bytes the ones before it say belong to the instruction.
    let decoded = privileged_instructions::decode(|i| unsafe { ((rip as usize + i) as *const u8).read() });
    let what = match decoded {
        None => return false,
        // SAFETY: this SIGSEGV's context, raised by `access` in driver code.
        Some(Privileged::Cr8(access)) => match unsafe { cr8_emulation::emulate(access, context) } {
            Ok(()) => return true,
            Err(cr8_emulation::NotEmulated::ReservedBits(value)) => format!("mov cr8, reg with {value:#x}"),
            Err(cr8_emulation::NotEmulated::NoKernel) => return false,
        },
        Some(Privileged::Unemulated(instruction)) => instruction.to_string(),
    };
    let rva = (rip as usize - image.base) as u32;
    let symbol = match image.symbols.nearest(rva) {
        Some((name, offset)) => format!("{name}+{offset:#x}"),
        None => "no symbol".to_string(),
    };
    println!(
        "VHCA-LOADER: privileged instruction `{what}` in {} at RVA {rva:#x} ({symbol}), which the loader does not \
         emulate",
        image.name
    );
    let (code, [p1, p2, p3, p4]) = privileged_instructions::unemulated_bugcheck(rip);
    crate::kernel_context::bugcheck(code, p1, p2, p3, p4)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn null_is_0x7e_and_a_wild_kernel_address_is_0x50() {
        assert_eq!(fault_bugcheck(0, 0x1000, 4).0, SYSTEM_THREAD_EXCEPTION_NOT_HANDLED);
        assert_eq!(fault_bugcheck(0x10, 0x1000, 4).1, [STATUS_ACCESS_VIOLATION, 0x1000, 0, 0]);
        assert_eq!(
            fault_bugcheck(0xdead_0000, 0x2000, 0x6),
            (PAGE_FAULT_IN_NONPAGED_AREA, [0xdead_0000, 2, 0x2000, 0])
        );
        assert_eq!(fault_bugcheck(0xdead_0000, 0x2000, 0x14).1[1], 0x10);
    }

    #[test]
    fn trimmed_paged_pool_at_dispatch_is_0xd1_read_or_write() {
        assert_eq!(paged_touch_bugcheck(0x7f00_1000, 2, 0x1234, 0x4), (0xD1, [0x7f00_1000, 2, 0, 0x1234]));
        assert_eq!(paged_touch_bugcheck(0x7f00_1000, 5, 0x1234, 0x6).1[2], 1);
    }
}
