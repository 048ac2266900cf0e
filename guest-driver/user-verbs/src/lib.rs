//! A user-mode verbs provider's life over vhca's device interface, written once against any process that can
//! open the interface and send it IOCTLs: the Linux guest's loader user process (vhca.sys through the PE loader,
//! `vhca.user=loopback`) and the Windows test program (`vhca-verbs-test.exe`, DeviceIoControl on a real handle).
//! So the program a Windows user runs is the same code the seed suite runs against vhca.sys here.
#![no_std]

extern crate alloc;

mod held_write;
mod loopback;
mod provider;
mod wait_cancel;
mod wait_destroy;

pub use held_write::{write_in_flight_then, HeldWriteSummary, HELD_WR_ID, IN_FLIGHT_EVENT, RESUMED_EVENT};
pub use loopback::{rdma_write_loopback, LoopbackSummary, LOOPBACK_BYTES};
pub use provider::{ConnectedPair, Provider};
pub use wait_cancel::{wait_cancel, WaitCancelSummary, STATUS_CANCELLED};
pub use wait_destroy::wait_on_destroyed_cq;

/// What DeviceIoControl gave back: the IRP's final status and its Information (bytes written to the output, or
/// taken from an IN_DIRECT buffer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reply {
    pub status: i32,
    pub information: usize,
}

/// A user process as the provider sees it: its own memory, and a handle on the device interface.
pub trait VerbsProcess {
    /// CreateFile on vhca's device interface: a handle number, or the NTSTATUS (Windows: the Win32 error) why not.
    fn open_interface(&mut self) -> Result<usize, i32>;
    /// DeviceIoControl on `file`. For METHOD_BUFFERED `output` may be the caller's local; for the direct methods it
    /// must be process memory from `allocate` (the I/O manager probes and locks it in the caller's context).
    fn device_control(&mut self, file: usize, code: u32, input: &[u8], output: &mut [u8]) -> Reply;
    /// VirtualAlloc: `bytes` of the process's own memory starting `in_page_offset` into a page; its address.
    fn allocate(&mut self, bytes: usize, in_page_offset: usize) -> Option<usize>;
    /// Sleeps about `ms` milliseconds between polls (the completion arrives by the device's interrupt meanwhile).
    fn pause(&mut self, ms: u32);
    /// Progress, one line at a time (the serial log, the console).
    fn log(&mut self, line: &str);
}

/// What DeviceIoControl on an overlapped handle did: answered at once, or left pending under a number the process
/// gave the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overlapped {
    Done(Reply),
    Pending(usize),
}

/// A process whose handle on the interface is overlapped (FILE_FLAG_OVERLAPPED), so a request the driver keeps
/// pending returns to the caller, who may wait for it or cancel it.
pub trait OverlappedProcess: VerbsProcess {
    /// DeviceIoControl with an OVERLAPPED. The output is `len` bytes of this process's memory at `at` (from
    /// `allocate`), which the driver may write until the request completes.
    fn device_control_overlapped(&mut self, file: usize, code: u32, input: &[u8], at: usize, len: usize) -> Overlapped;
    /// HasOverlappedIoCompleted.
    fn is_complete(&mut self, request: usize) -> bool;
    /// CancelIoEx on the request: whether the driver's cancel routine ran, where the process can tell (None: it
    /// cannot, as a Windows process cannot). The request completes when its driver completes it.
    fn cancel(&mut self, request: usize) -> Option<bool>;
    /// GetOverlappedResultEx: the completed request's reply (and the request forgotten), or None while it is still
    /// pending after `ms` milliseconds.
    fn wait(&mut self, request: usize, ms: u32) -> Option<Reply>;
}

/// `len` bytes of the process's memory at `at`, as the program reads and writes it.
///
/// # Safety
/// `at` came from this process's `allocate` with at least `len` bytes, mapped until the process exits.
pub unsafe fn process_bytes<'a>(at: usize, len: usize) -> &'a mut [u8] {
    // SAFETY: the caller's contract.
    unsafe { core::slice::from_raw_parts_mut(at as *mut u8, len) }
}

#[cfg(test)]
mod tests {
    extern crate std;

    use std::string::String;
    use std::vec::Vec;

    use vhca_driver_core::ioctl_codec::{IOCTL_VHCA_OPEN_CONTEXT, IOCTL_VHCA_QUERY_DEVICE, USER_ABI_VERSION};

    use super::*;

    /// A process whose driver answers OPEN_CONTEXT as vhca.sys does and everything else with `rest`.
    struct Fake {
        present: bool,
        rest: Reply,
        codes: Vec<u32>,
    }

    impl VerbsProcess for Fake {
        fn open_interface(&mut self) -> Result<usize, i32> {
            if self.present {
                Ok(0)
            } else {
                Err(0xC000_000E_u32 as i32)
            }
        }
        fn device_control(&mut self, _file: usize, code: u32, _input: &[u8], output: &mut [u8]) -> Reply {
            self.codes.push(code);
            if code == IOCTL_VHCA_OPEN_CONTEXT {
                output[..4].copy_from_slice(&USER_ABI_VERSION.to_le_bytes());
                return Reply { status: 0, information: 16 };
            }
            self.rest
        }
        fn allocate(&mut self, _bytes: usize, _in_page_offset: usize) -> Option<usize> {
            None
        }
        fn pause(&mut self, _ms: u32) {}
        fn log(&mut self, _line: &str) {}
    }

    fn run(present: bool, rest: Reply) -> (Result<LoopbackSummary, String>, Vec<u32>) {
        let mut fake = Fake { present, rest, codes: Vec::new() };
        let outcome = rdma_write_loopback(&mut fake);
        (outcome, fake.codes)
    }

    #[test]
    fn no_interface_is_an_error_before_any_ioctl() {
        let (outcome, codes) = run(false, Reply { status: 0, information: 0 });
        assert_eq!(outcome.unwrap_err(), "CreateFile on the interface: 0xc000000e");
        assert!(codes.is_empty());
    }

    #[test]
    fn a_step_the_driver_refuses_stops_the_life_and_is_named() {
        let (outcome, codes) = run(true, Reply { status: 0xC000_000D_u32 as i32, information: 0 });
        assert_eq!(outcome.unwrap_err(), "QUERY_DEVICE: status 0xc000000d, 0 bytes");
        assert_eq!(codes, [IOCTL_VHCA_OPEN_CONTEXT, IOCTL_VHCA_QUERY_DEVICE], "nothing after the refusal");
        let (outcome, _) = run(true, Reply { status: 0, information: 0 });
        assert!(outcome.unwrap_err().starts_with("QUERY_DEVICE"), "success with no attributes is no answer");
    }
}
