//! The user programs whose requests stay pending, in the loader's user process, whose overlapped requests are the
//! loader's `Pending`: user-wait-cancelled and user-wait-cancel-race (`vhca.user=wait-cancel`, vhca-user-verbs'
//! completion-channel life, the code vhca-verbs-test.exe runs in a Windows guest) and user-wait-on-destroyed-cq and
//! user-wait-destroyed-cq-drained (`vhca.user=wait-destroy`).

use std::time::Duration;

use vhca_loader::user_process::UserProcess;
use vhca_loader::user_requests::{Pending, Sent};
use vhca_user_verbs::{process_bytes, Overlapped, OverlappedProcess, Reply, VerbsProcess};

use crate::report::progress;
use crate::user_program::LoaderProcess;

/// The loader's process with its requests in flight, by the number `device_control_overlapped` gave each. One
/// still pending when this goes is dropped with it: its thread's exit cancels it (the loader's `Pending`), before
/// the process's CLEANUP and CLOSE.
struct OverlappedLoader<'a> {
    process: LoaderProcess<'a>,
    in_flight: Vec<Option<Pending<'static>>>,
}

impl VerbsProcess for OverlappedLoader<'_> {
    fn open_interface(&mut self) -> Result<usize, i32> {
        self.process.open_interface()
    }
    fn device_control(&mut self, file: usize, code: u32, input: &[u8], output: &mut [u8]) -> Reply {
        self.process.device_control(file, code, input, output)
    }
    fn allocate(&mut self, bytes: usize, in_page_offset: usize) -> Option<usize> {
        self.process.allocate(bytes, in_page_offset)
    }
    fn pause(&mut self, ms: u32) {
        self.process.pause(ms)
    }
    fn log(&mut self, line: &str) {
        self.process.log(line)
    }
}

impl OverlappedProcess for OverlappedLoader<'_> {
    fn device_control_overlapped(&mut self, file: usize, code: u32, input: &[u8], at: usize, len: usize) -> Overlapped {
        // SAFETY: the trait's contract: `len` bytes of this process's memory at `at`, mapped until the process
        // exits, which is after every request here ended (this wrapper goes first).
        let output: &'static mut [u8] = unsafe { process_bytes(at, len) };
        match self.process.0.device_control_overlapped(file, code, input, output) {
            Sent::Done(reply) => Overlapped::Done(Reply { status: reply.status, information: reply.information }),
            Sent::Pending(pending) => {
                progress(format_args!("user process: IOCTL {code:#x} pending (IRP {:#x})", pending.irp() as usize));
                self.in_flight.push(Some(pending));
                Overlapped::Pending(self.in_flight.len() - 1)
            }
        }
    }

    fn is_complete(&mut self, request: usize) -> bool {
        self.in_flight.get(request).and_then(Option::as_ref).is_none_or(Pending::is_complete)
    }

    fn cancel(&mut self, request: usize) -> Option<bool> {
        let ran = self.in_flight.get(request).and_then(Option::as_ref).map(Pending::cancel)?;
        progress(format_args!(
            "user process: CancelIoEx on the pending request: {}",
            if ran { "its cancel routine ran" } else { "the driver held it (no cancel routine set)" }
        ));
        Some(ran)
    }

    fn wait(&mut self, request: usize, ms: u32) -> Option<Reply> {
        let pending = self.in_flight.get_mut(request)?.take()?;
        match pending.wait(Some(Duration::from_millis(ms.into()))) {
            Ok(reply) => Some(Reply { status: reply.status, information: reply.information }),
            Err(still) => {
                self.in_flight[request] = Some(still);
                None
            }
        }
    }
}

pub fn wait_cancel(process: &mut UserProcess) -> Result<(), String> {
    let mut loader = OverlappedLoader { process: LoaderProcess(process), in_flight: Vec::new() };
    let summary = vhca_user_verbs::wait_cancel(&mut loader)?;
    progress(format_args!("user process: {summary}"));
    Ok(())
}

pub fn wait_destroy(process: &mut UserProcess) -> Result<(), String> {
    let mut loader = OverlappedLoader { process: LoaderProcess(process), in_flight: Vec::new() };
    vhca_user_verbs::wait_on_destroyed_cq(&mut loader)?;
    progress(format_args!("user process: a WAIT_CQ ended by DESTROY_CQ of its CQ"));
    Ok(())
}
