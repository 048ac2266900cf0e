//! The device's sandbox, so that a bug a guest or QEMU finds cannot be turned against the host: every capability
//! is dropped once the socket is bound, and once the connection is set up a seccomp filter (rust-vmm's seccompiler)
//! allows only the system calls serving it needs. A forbidden call is trapped: one line on stderr naming it, and
//! the device exits with `SANDBOX_EXIT`, which the runner judges as a device failure.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::OnceLock;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter, SeccompRule, TargetArch,
};

/// Exit status after a forbidden system call.
pub const SANDBOX_EXIT: i32 = 3;

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error("cannot drop capabilities: {0}")]
    Capabilities(#[from] caps::errors::CapsError),
    #[error("cannot build the seccomp filter: {0}")]
    Filter(#[from] seccompiler::BackendError),
    #[error("cannot install the seccomp filter: {0}")]
    Install(#[from] seccompiler::Error),
    #[error("cannot install the SIGSYS handler: {0}")]
    Handler(std::io::Error),
    #[error("no seccomp support for architecture {0}")]
    Arch(String),
}

/// The device needs no privilege at all: clears every capability set and the bounding set, so neither this
/// process nor anything it could exec regains one.
pub fn drop_capabilities() -> Result<(), SandboxError> {
    use caps::CapSet;
    for cap in caps::all() {
        // Dropping from the bounding set needs CAP_SETPCAP, which is still in the effective set at this point.
        if caps::has_cap(None, CapSet::Bounding, cap)? {
            let _ = caps::drop(None, CapSet::Bounding, cap);
        }
    }
    caps::clear(None, CapSet::Ambient)?;
    caps::clear(None, CapSet::Inheritable)?;
    caps::clear(None, CapSet::Effective)?;
    caps::clear(None, CapSet::Permitted)?;
    Ok(())
}

/// What serving an established connection calls: socket I/O with fds (recvmsg), mapping the memfds of
/// SET_MEM_TABLE, epoll for the kick fds, futexes between the threads, the event log (its writer thread is started
/// before the filter and needs only write, futex and the clock from then on), and the exit path (closing, unmapping,
/// removing the socket file). No socket, open, exec, fork, ptrace or kill.
fn allowed_syscalls() -> Vec<i64> {
    let mut calls = vec![
        libc::SYS_read,
        libc::SYS_write,
        libc::SYS_readv,
        libc::SYS_writev,
        libc::SYS_pread64,
        libc::SYS_pwrite64,
        libc::SYS_recvmsg,
        libc::SYS_sendmsg,
        libc::SYS_recvfrom,
        libc::SYS_sendto,
        libc::SYS_shutdown,
        libc::SYS_close,
        libc::SYS_fcntl,
        libc::SYS_dup,
        libc::SYS_dup3,
        libc::SYS_fstat,
        libc::SYS_newfstatat,
        libc::SYS_statx,
        libc::SYS_lseek,
        libc::SYS_fsync,
        libc::SYS_fdatasync,
        libc::SYS_mmap,
        libc::SYS_munmap,
        libc::SYS_mremap,
        libc::SYS_mprotect,
        libc::SYS_madvise,
        libc::SYS_brk,
        libc::SYS_epoll_create1,
        libc::SYS_epoll_ctl,
        libc::SYS_epoll_pwait,
        libc::SYS_epoll_pwait2,
        libc::SYS_ppoll,
        libc::SYS_futex,
        libc::SYS_sched_yield,
        libc::SYS_clock_gettime,
        libc::SYS_clock_nanosleep,
        libc::SYS_nanosleep,
        libc::SYS_getrandom,
        libc::SYS_gettid,
        libc::SYS_getpid,
        libc::SYS_rt_sigreturn,
        libc::SYS_rt_sigprocmask,
        libc::SYS_sigaltstack,
        libc::SYS_unlinkat,
        libc::SYS_exit,
        libc::SYS_exit_group,
        // The queue worker's first steps, which may run after the filter is on: glibc's per-thread set-up and
        // its malloc arena sizing.
        libc::SYS_rseq,
        libc::SYS_set_robust_list,
        libc::SYS_sched_getaffinity,
    ];
    #[cfg(target_arch = "x86_64")]
    calls.extend([libc::SYS_epoll_wait, libc::SYS_poll, libc::SYS_unlink, libc::SYS_stat]);
    calls
}

fn filter() -> Result<BpfProgram, SandboxError> {
    let arch = TargetArch::try_from(std::env::consts::ARCH)
        .map_err(|_| SandboxError::Arch(std::env::consts::ARCH.to_string()))?;
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
        allowed_syscalls().into_iter().map(|call| (call, Vec::new())).collect();
    // std names the worker thread from inside it (PR_SET_NAME); no other prctl.
    let set_name = SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, libc::PR_SET_NAME as u64)?;
    rules.insert(libc::SYS_prctl, vec![SeccompRule::new(vec![set_name])?]);
    // The event log's stop path (event_log::install_flush_guards) flushes on SIGTERM/SIGINT/SIGHUP, then restores
    // the signal's default action and raises it at this process: sigaction for those three signals only, and tgkill
    // aimed at this process only (never another one).
    let stop_signals = [libc::SIGTERM, libc::SIGINT, libc::SIGHUP]
        .into_iter()
        .map(|signal| SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, signal as u64))
        .map(|condition| SeccompRule::new(vec![condition?]))
        .collect::<Result<Vec<_>, _>>()?;
    rules.insert(libc::SYS_rt_sigaction, stop_signals);
    let own_process =
        SeccompCondition::new(0, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, u64::from(std::process::id()))?;
    rules.insert(libc::SYS_tgkill, vec![SeccompRule::new(vec![own_process])?]);
    Ok(SeccompFilter::new(rules, SeccompAction::Trap, SeccompAction::Allow, arch)?.try_into()?)
}

/// The socket file the SIGSYS handler removes before exiting, as a C string made before any trap can happen.
static SOCKET_PATH: OnceLock<CString> = OnceLock::new();

/// Installs the SIGSYS handler, then the filter on every thread of the process (the queue worker included).
/// `socket_path` is removed if a violation ends the device, as on every other exit.
pub fn install_filter(socket_path: &Path) -> Result<(), SandboxError> {
    let program = filter()?;
    if let Ok(path) = CString::new(socket_path.as_os_str().as_bytes()) {
        let _ = SOCKET_PATH.set(path);
    }
    // SAFETY: a zeroed sigaction is valid; the handler only makes async-signal-safe calls (write, _exit).
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_forbidden_syscall as *const () as usize;
        action.sa_flags = libc::SA_SIGINFO;
        if libc::sigaction(libc::SIGSYS, &action, std::ptr::null_mut()) != 0 {
            return Err(SandboxError::Handler(std::io::Error::last_os_error()));
        }
    }
    seccompiler::apply_filter_all_threads(&program)?;
    tracing::info!("sandbox on: {} system calls allowed, capabilities dropped", allowed_syscalls().len());
    Ok(())
}

/// Where the handler's lines point: this function and libc's `write`, so an address in a trap line can be placed in
/// the device binary or in libc afterwards (`addr2line`, `objdump -d` around the offset).
fn anchors() -> (usize, usize) {
    (on_forbidden_syscall as *const () as usize, libc::write as *const () as usize)
}

/// The SIGSYS a trapped call raises. `open` and `openat` are refused in place: the call returns EPERM and the device
/// goes on, because glibc and the Rust standard library open files lazily on paths no input controls (a refusal
/// there has a fallback or an error path; seen once, 2026-11-30: `contiguous-cq-fallback/verifier-on` ended mid-run
/// with a trapped `openat`, and 48 runs after it did not repeat it; the line then named no address, so the code
/// could not be found). Any other forbidden call ends the device: the handler names it on
/// stderr, removes the socket file and exits. Either way the line names the call and the address it was made from.
/// Only write, unlink and exit_group run here, all allowed by the filter; numbers are formatted by hand because
/// allocating is not async-signal-safe.
extern "C" fn on_forbidden_syscall(_signal: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    // For SIGSYS the kernel fills `_sigsys { void *_call_addr; int _syscall; unsigned _arch; }` right after the
    // three ints of the header (padded to 16 bytes on 64-bit); the libc crate has no accessor for it.
    const CALL_ADDR_OFFSET: usize = 16;
    const SYSCALL_OFFSET: usize = 16 + std::mem::size_of::<*const libc::c_void>();
    let (number, call_addr) = if info.is_null() {
        (-1, 0)
    } else {
        // SAFETY: the kernel passed a full siginfo_t for this SIGSYS; both offsets are inside it and aligned.
        unsafe {
            (
                info.cast::<u8>().add(SYSCALL_OFFSET).cast::<libc::c_int>().read(),
                info.cast::<u8>().add(CALL_ADDR_OFFSET).cast::<usize>().read(),
            )
        }
    };
    let refused = is_refused_in_place(number) && refuse_in_place(context);
    let mut line = Line::new();
    line.put(if refused {
        b"vhca-device: sandbox: refused system call "
    } else {
        b"vhca-device: sandbox: forbidden system call "
    });
    line.number(i64::from(number), 10);
    let (this, write) = anchors();
    line.put(b" at 0x");
    line.number(call_addr as i64, 16);
    line.put(b" (on_forbidden_syscall 0x");
    line.number(this as i64, 16);
    line.put(b", libc write 0x");
    line.number(write as i64, 16);
    if refused {
        line.put(b"); it returned EPERM, going on; stack");
        for word in stack_words(context) {
            line.put(b" 0x");
            line.number(word as i64, 16);
        }
        line.put(b"\n");
        line.write();
        return;
    }
    line.put(b") (seccomp); exiting. Run with --no-sandbox to debug.\n");
    line.write();
    // SAFETY: unlink(2) and _exit(2) are async-signal-safe; the path outlives the call.
    unsafe {
        if let Some(path) = SOCKET_PATH.get() {
            libc::unlink(path.as_ptr());
        }
        libc::_exit(SANDBOX_EXIT);
    }
}

/// The calls a trap answers with EPERM instead of ending the device (see `on_forbidden_syscall`).
fn is_refused_in_place(number: libc::c_int) -> bool {
    let number = libc::c_long::from(number);
    number == libc::SYS_openat || number == libc::SYS_open
}

/// Makes the trapped call return -EPERM when the handler returns: the kernel did not run it (SECCOMP_RET_TRAP), and
/// execution goes on after the `syscall` instruction with the registers of `context`.
#[cfg(target_arch = "x86_64")]
fn refuse_in_place(context: *mut libc::c_void) -> bool {
    if context.is_null() {
        return false;
    }
    // SAFETY: with SA_SIGINFO the kernel passes the interrupted thread's ucontext_t as the third argument; rax holds
    // a system call's return value on x86_64, and writing it is how a SIGSYS handler answers for the kernel.
    unsafe {
        let uc = context.cast::<libc::ucontext_t>();
        (*uc).uc_mcontext.gregs[libc::REG_RAX as usize] = -i64::from(libc::EPERM);
    }
    true
}

#[cfg(not(target_arch = "x86_64"))]
fn refuse_in_place(_context: *mut libc::c_void) -> bool {
    false
}

/// The first words on the interrupted thread's stack: among them the return addresses of the refused call's callers
/// (glibc is built without frame pointers, so no chain can be walked), to place them afterwards like the call.
#[cfg(target_arch = "x86_64")]
fn stack_words(context: *mut libc::c_void) -> [usize; STACK_WORDS] {
    let mut words = [0usize; STACK_WORDS];
    if context.is_null() {
        return words;
    }
    // SAFETY: the kernel passed the interrupted thread's ucontext_t; its rsp points into that thread's stack, which
    // is mapped from rsp upward for at least the frames of the calls that led here (far more than 12 words).
    unsafe {
        let uc = context.cast::<libc::ucontext_t>();
        let rsp = (*uc).uc_mcontext.gregs[libc::REG_RSP as usize] as usize as *const usize;
        for (i, word) in words.iter_mut().enumerate() {
            *word = rsp.add(i).read();
        }
    }
    words
}

#[cfg(not(target_arch = "x86_64"))]
fn stack_words(_context: *mut libc::c_void) -> [usize; STACK_WORDS] {
    [0; STACK_WORDS]
}

const STACK_WORDS: usize = 12;

/// A stderr line built without allocating (the handler may run inside malloc).
struct Line {
    bytes: [u8; 512],
    len: usize,
}

impl Line {
    fn new() -> Line {
        Line { bytes: [0; 512], len: 0 }
    }

    fn put(&mut self, bytes: &[u8]) {
        let n = bytes.len().min(self.bytes.len() - self.len);
        self.bytes[self.len..self.len + n].copy_from_slice(&bytes[..n]);
        self.len += n;
    }

    /// `value` in `radix` (10 or 16), a minus sign first if negative.
    fn number(&mut self, value: i64, radix: u64) {
        let mut digits = [0u8; 20];
        let mut at = digits.len();
        let mut rest = if radix == 16 { value as u64 } else { value.unsigned_abs() };
        loop {
            at -= 1;
            digits[at] = b"0123456789abcdef"[(rest % radix) as usize];
            rest /= radix;
            if rest == 0 {
                break;
            }
        }
        if radix == 10 && value < 0 {
            self.put(b"-");
        }
        self.put(&digits[at..]);
    }

    fn write(&self) {
        // SAFETY: write(2) is async-signal-safe; the buffer outlives the call.
        unsafe {
            libc::write(libc::STDERR_FILENO, self.bytes.as_ptr().cast(), self.len);
        }
    }
}

/// For the test that shows what a refused open looks like: an open the filter refuses in place; the device goes on.
pub fn refused_open() -> std::io::Result<std::fs::File> {
    std::fs::File::open("/proc/self/status")
}

/// For the test that shows what a violation looks like: a call the filter forbids (a new network socket).
pub fn forbidden_syscall() {
    // SAFETY: socket(2) has no memory-safety preconditions; under the filter it never returns.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0) };
    if fd >= 0 {
        // SAFETY: closes the fd just created, owned by nobody else.
        unsafe { libc::close(fd) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_filter_compiles_for_this_architecture() {
        let program = filter().unwrap();
        assert!(program.len() > allowed_syscalls().len(), "one check per allowed call at least");
    }

    #[test]
    fn no_call_that_would_let_a_compromised_device_out() {
        let allowed = allowed_syscalls();
        for call in [
            libc::SYS_socket,
            libc::SYS_connect,
            libc::SYS_openat,
            libc::SYS_execve,
            libc::SYS_clone,
            libc::SYS_clone3,
            libc::SYS_ptrace,
            libc::SYS_kill,
            libc::SYS_process_vm_writev,
        ] {
            assert!(!allowed.contains(&call), "system call {call} is allowed");
        }
    }
}
