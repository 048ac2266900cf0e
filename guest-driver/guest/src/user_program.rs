//! The user program a vhca.sys run plays once the device started (`vhca.user=`): a process of the loader's model
//! that opens vhca's device interface and drives its IOCTLs as a user-mode verbs provider would, then exits.

use std::time::Instant;

use vhca_driver_core::ioctl_codec::*;
use vhca_loader::user_process::{UserProcess, UserProgram};
use vhca_proto::ACCESS_LOCAL_WRITE;
use vhca_user_verbs::{rdma_write_loopback, Provider, Reply, VerbsProcess};
use zerocopy::little_endian::U32;
use zerocopy::IntoBytes;

use crate::report::progress;

/// What the user program does (`vhca.user=`); None: no user process.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum UserSequence {
    #[default]
    None,
    /// Opens a context, allocates a PD, registers an MR over its own memory and exits without DEREG_MR: what the
    /// driver's CLEANUP must release (the seed's user-exit-with-mr-registered and -released).
    ExitWithMr,
    /// REG_MR with pointers that are not the caller's (an unmapped kernel address, user space it never allocated),
    /// each of which must be refused with STATUS_ACCESS_VIOLATION, then one over its own memory that must work and
    /// DEREG_MR: the seed's ioctl-bad-user-pointer and -probed.
    BadPointer,
    /// The provider's whole life, as the Windows test program vhca-verbs-test.exe runs it (vhca-user-verbs): QPs
    /// connected, an RDMA write between two MRs polled to its completion and checked, a foreign handle refused,
    /// everything destroyed. The seed's user-verbs-loopback.
    Loopback,
    /// Two processes running Loopback at once, the second on its own thread bound to the model's next processor:
    /// two files, their IOCTLs dispatched into vhca.sys side by side (`vhca.user=loopback:2`, the seed's
    /// user-verbs-two-processes).
    TwoLoopbacks,
    /// WAIT_CQ kept pending: one cancelled, one answered by an RDMA write's completion, one left waiting at the
    /// exit (`vhca.user=wait-cancel`, the seed's user-wait-cancelled and user-wait-cancel-race;
    /// user_wait_cancel.rs).
    WaitCancel,
    /// WAIT_CQ pending on a CQ the same process then destroys (`vhca.user=wait-destroy`, the seed's
    /// user-wait-on-destroyed-cq and user-wait-destroyed-cq-drained; user_wait_cancel.rs).
    WaitDestroy,
}

impl UserSequence {
    pub fn parse(value: &str) -> Result<UserSequence, String> {
        match value {
            "exit-with-mr" => Ok(UserSequence::ExitWithMr),
            "bad-pointer" => Ok(UserSequence::BadPointer),
            "loopback" => Ok(UserSequence::Loopback),
            "loopback:2" => Ok(UserSequence::TwoLoopbacks),
            "wait-cancel" => Ok(UserSequence::WaitCancel),
            "wait-destroy" => Ok(UserSequence::WaitDestroy),
            _ => Err(format!(
                "not exit-with-mr, bad-pointer, loopback, loopback:2, wait-cancel or wait-destroy: {value:?}"
            )),
        }
    }

    /// The program for the loader's life to run (None: no user process).
    pub fn program(self) -> Option<UserProgram> {
        match self {
            UserSequence::None => None,
            UserSequence::ExitWithMr => Some(Box::new(exit_with_mr)),
            UserSequence::BadPointer => Some(Box::new(bad_pointer)),
            UserSequence::Loopback => Some(Box::new(loopback)),
            UserSequence::TwoLoopbacks => Some(Box::new(two_loopbacks)),
            UserSequence::WaitCancel => Some(Box::new(crate::user_wait_cancel::wait_cancel)),
            UserSequence::WaitDestroy => Some(Box::new(crate::user_wait_cancel::wait_destroy)),
        }
    }
}

/// Unaligned and over three pages, as a user buffer is: the MR starts 0x1a0 bytes into its first page.
const MR_BYTES: usize = 2 * 4096 + 300;
const MR_OFFSET: usize = 0x1a0;

/// A canonical kernel-half address no mapping holds, passed as if it were the caller's buffer; and user space the
/// process never allocated. Neither is the caller's memory, so a UserMode probe refuses both.
const KERNEL_ADDRESS: u64 = 0xFFFF_8000_0000_1000;
const UNALLOCATED_USER_ADDRESS: u64 = 0x10_0000_0000;
/// ntstatus.h: what a probe of memory that is not the caller's raises, and the IOCTL then answers.
const STATUS_ACCESS_VIOLATION: i32 = 0xC000_0005_u32 as i32;

/// REG_MR's request for MR_BYTES at `addr`, local write access.
fn reg_mr_in(pd: U32, addr: u64) -> RegMrIn {
    RegMrIn {
        addr: addr.into(),
        length: (MR_BYTES as u32).into(),
        pd,
        access: ACCESS_LOCAL_WRITE.into(),
        reserved: 0.into(),
    }
}

fn exit_with_mr(process: &mut UserProcess) -> Result<(), String> {
    let mut process = LoaderProcess(process);
    let mut p = Provider::open(&mut process)?;
    let pd: HandleOut = p.call("ALLOC_PD", IOCTL_VHCA_ALLOC_PD, &[])?;
    let addr = p.allocate(MR_BYTES, MR_OFFSET, "the MR")?;
    p.register(pd.handle, addr, MR_BYTES, ACCESS_LOCAL_WRITE)?;
    // The process exits here with the MR registered: its handle's CLEANUP is the driver's to release it.
    Ok(())
}

fn bad_pointer(process: &mut UserProcess) -> Result<(), String> {
    let mut process = LoaderProcess(process);
    let mut p = Provider::open(&mut process)?;
    let pd: HandleOut = p.call("ALLOC_PD", IOCTL_VHCA_ALLOC_PD, &[])?;
    let mdls_before = vhca_loader::kernel_context::kernel().mdls.count();
    for (what, addr) in [("a kernel address", KERNEL_ADDRESS), ("unallocated user space", UNALLOCATED_USER_ADDRESS)] {
        let mut out = RegMrOut::default();
        let reply = p.control(IOCTL_VHCA_REG_MR, reg_mr_in(pd.handle, addr).as_bytes(), out.as_mut_bytes());
        if reply.status != STATUS_ACCESS_VIOLATION || reply.information != 0 {
            return Err(format!("REG_MR of {what} ({addr:#x}) answered {:#010x}", reply.status as u32));
        }
    }
    // The refusals left no MDL behind (each failed probe's MDL freed in the driver's error path) and the file
    // working; a page left locked would stop the exit.
    let mdls_after = vhca_loader::kernel_context::kernel().mdls.count();
    if mdls_after != mdls_before {
        return Err(format!("the refused REG_MRs left {} MDL(s) behind", mdls_after as isize - mdls_before as isize));
    }
    let addr = p.allocate(MR_BYTES, MR_OFFSET, "the MR")?;
    let mr = p.register(pd.handle, addr, MR_BYTES, ACCESS_LOCAL_WRITE)?;
    p.destroy("DEREG_MR", IOCTL_VHCA_DEREG_MR, mr.lkey)
}

/// The loader's user process as vhca-user-verbs' provider sees a process.
pub(crate) struct LoaderProcess<'a>(pub(crate) &'a mut UserProcess);

impl VerbsProcess for LoaderProcess<'_> {
    fn open_interface(&mut self) -> Result<usize, i32> {
        self.0.open_interface()
    }
    fn device_control(&mut self, file: usize, code: u32, input: &[u8], output: &mut [u8]) -> Reply {
        let reply = self.0.device_control(file, code, input, output);
        Reply { status: reply.status, information: reply.information }
    }
    fn allocate(&mut self, bytes: usize, in_page_offset: usize) -> Option<usize> {
        self.0.allocate(bytes, in_page_offset)
    }
    fn pause(&mut self, ms: u32) {
        std::thread::sleep(std::time::Duration::from_millis(ms.into()));
    }
    fn log(&mut self, line: &str) {
        progress(format_args!("{line}"));
    }
}

fn loopback(process: &mut UserProcess) -> Result<(), String> {
    let summary = rdma_write_loopback(&mut LoaderProcess(process))?;
    progress(format_args!(
        "user process: vhca-verbs loopback passed ({} bytes, {} poll(s), a foreign CQ refused with {:#010x})",
        summary.bytes, summary.polls, summary.refused_with as u32
    ));
    Ok(())
}

/// Loopback in this process and, at the same time, in a second one on another thread and processor, which exits
/// when its life ends; both must pass. What each process holds is its own file's: neither sees the other's handles.
fn two_loopbacks(process: &mut UserProcess) -> Result<(), String> {
    let pdo = process.pdo() as usize;
    let k = vhca_loader::kernel_context::kernel();
    let cpu = 1 % k.model.processor_count();
    let second = std::thread::Builder::new()
        .name("user-process-2".into())
        .spawn(move || {
            vhca_loader::driver_fault::prepare_thread();
            vhca_loader::kernel_context::kernel().model.run_on_processor(cpu, || {
                let mut other = UserProcess::new(pdo as *mut _);
                let started = Instant::now();
                let outcome = rdma_write_loopback(&mut LoaderProcess(&mut other));
                let ended = Instant::now();
                other.exit();
                (outcome, started, ended)
            })
        })
        .map_err(|e| format!("no thread for the second process: {e}"))?;
    let started = Instant::now();
    let first = rdma_write_loopback(&mut LoaderProcess(process));
    let ended = Instant::now();
    let (second, second_started, second_ended) =
        second.join().map_err(|_| "the second process's thread panicked".to_string())?;
    // Side by side, or the run tests what one process does: each life must begin before the other's ended.
    let overlap = ended.min(second_ended).saturating_duration_since(started.max(second_started));
    if overlap.is_zero() {
        return Err("the two processes' lives did not overlap: their requests never met in the driver".into());
    }
    progress(format_args!("user processes: the two lives overlapped for {} ms", overlap.as_millis()));
    for (which, outcome) in [("first", &first), ("second", &second)] {
        match outcome {
            Ok(s) => progress(format_args!(
                "user process ({which} of two): vhca-verbs loopback passed ({} bytes, {} poll(s))",
                s.bytes, s.polls
            )),
            Err(why) => return Err(format!("the {which} of two processes: {why}")),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sequence_is_named_or_refused() {
        assert_eq!(UserSequence::parse("exit-with-mr"), Ok(UserSequence::ExitWithMr));
        assert_eq!(UserSequence::parse("bad-pointer"), Ok(UserSequence::BadPointer));
        assert_eq!(UserSequence::parse("loopback"), Ok(UserSequence::Loopback));
        assert_eq!(UserSequence::parse("loopback:2"), Ok(UserSequence::TwoLoopbacks));
        assert_eq!(UserSequence::parse("wait-cancel"), Ok(UserSequence::WaitCancel));
        assert!(UserSequence::parse("exit").is_err());
        assert!(UserSequence::None.program().is_none());
        assert!(UserSequence::ExitWithMr.program().is_some());
    }
}
