//! vhca-verbs-test.exe's portable half: reading the interface list the configuration manager returns, and the
//! result line the program prints. The Win32 half (src/win32/) is in the binary, built for Windows only.
#![no_std]

extern crate alloc;

use alloc::format;
use alloc::string::String;
use core::fmt::Display;

/// The prefix of the one line the program prints at its end, for a script or the guest agent to find.
pub const RESULT_PREFIX: &str = "VHCA-VERBS-TEST";

/// Exit codes: 0 the life passed, 1 it failed (the line says where), 2 no vhca interface present, 3 a panic.
pub const EXIT_PASSED: u32 = 0;
pub const EXIT_FAILED: u32 = 1;
pub const EXIT_NO_DEVICE: u32 = 2;
pub const EXIT_PANIC: u32 = 3;

/// What the program runs, from its one argument: none (or `loopback`) the provider's loopback life, `wait-cancel`
/// the completion channel's (WAIT_CQ pending, cancelled, answered, left at the exit) and `wait-destroy` a WAIT_CQ
/// ended by DESTROY_CQ of its CQ, both on an overlapped handle; `held-write` an RDMA write the device holds, in
/// flight while the guest agent sleeps the machine (it sets IN_FLIGHT_EVENT, then waits for RESUMED_EVENT).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Loopback,
    WaitCancel,
    WaitDestroy,
    HeldWrite,
}

/// The named events of `held-write` (vhca-user-verbs', shared with the guest agent that sleeps the machine).
pub use vhca_user_verbs::{IN_FLIGHT_EVENT, RESUMED_EVENT};
/// How long `held-write` waits for RESUMED_EVENT: the agent's one sleep cycle (a 30 s wake timer) with room.
pub const RESUMED_WAIT_S: u32 = 180;

/// `name` as the NUL-terminated UTF-16 a `W` routine takes.
pub fn wide(name: &str) -> alloc::vec::Vec<u16> {
    name.encode_utf16().chain([0]).collect()
}

impl Mode {
    /// Whether the interface's handle is opened overlapped (FILE_FLAG_OVERLAPPED).
    pub fn overlapped(self) -> bool {
        matches!(self, Mode::WaitCancel | Mode::WaitDestroy)
    }
}

/// The mode GetCommandLineW's line asks for: the program's own name first (quoted or not, as CreateProcess passes
/// it), then at most one word. Err names what was not understood.
pub fn mode_of(command_line: &[u16]) -> Result<Mode, String> {
    let line = String::from_utf16_lossy(command_line.split(|&u| u == 0).next().unwrap_or(&[]));
    let line = line.trim_start();
    // The program's name: up to the closing quote if quoted, else up to the first blank.
    let rest = match line.strip_prefix('"') {
        Some(quoted) => quoted.split_once('"').map_or("", |(_, rest)| rest),
        None => line.split_once([' ', '\t']).map_or("", |(_, rest)| rest),
    };
    let mut words = rest.split_whitespace();
    let mode = match words.next() {
        None | Some("loopback") => Mode::Loopback,
        Some("wait-cancel") => Mode::WaitCancel,
        Some("wait-destroy") => Mode::WaitDestroy,
        Some("held-write") => Mode::HeldWrite,
        Some(other) => {
            return Err(format!(
                "unknown mode {other:?}: loopback (the default), wait-cancel, wait-destroy or held-write"
            ));
        }
    };
    match words.next() {
        None => Ok(mode),
        Some(extra) => Err(format!("one mode only, not also {extra:?}")),
    }
}

/// The first path of a REG_MULTI_SZ-shaped list (CM_Get_Device_Interface_ListW's): UTF-16 strings each ended by a
/// NUL, the list by an empty one. Its units without the NUL; None when the list is empty or not terminated.
pub fn first_interface(list: &[u16]) -> Option<&[u16]> {
    let end = list.iter().position(|&u| u == 0)?;
    (end > 0).then(|| &list[..end])
}

/// The line that ends the program's output, and its exit code: what a passed life saw (its summary), or where it
/// failed.
pub fn result_line(outcome: &Result<impl Display, String>) -> (String, u32) {
    match outcome {
        Ok(summary) => (format!("{RESULT_PREFIX} passed: {summary}"), EXIT_PASSED),
        Err(why) => (format!("{RESULT_PREFIX} failed: {why}"), EXIT_FAILED),
    }
}

/// NTSTATUS_FROM_WIN32 (ntstatus.h's macro): a Win32 error as the NTSTATUS-shaped status vhca-user-verbs reads, so a
/// DeviceIoControl that failed is negative (FACILITY_NTWIN32, severity error) and names its Win32 error.
pub const fn status_from_win32(error: u32) -> i32 {
    if error == 0 {
        0
    } else {
        ((error & 0xFFFF) | (7 << 16) | 0xC000_0000) as i32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vhca_user_verbs::{LoopbackSummary, WaitCancelSummary};

    #[test]
    fn the_first_interface_is_read_up_to_its_nul() {
        let list: [u16; 7] = [b'\\' as u16, b'?' as u16, b'x' as u16, 0, b'y' as u16, 0, 0];
        assert_eq!(first_interface(&list), Some(&list[..3]));
        assert_eq!(first_interface(&[0, 0]), None, "an empty list: no device");
        assert_eq!(first_interface(&[b'x' as u16]), None, "not terminated: refused, not read past");
    }

    #[test]
    fn the_result_line_says_pass_or_where_it_failed() {
        let summary = LoopbackSummary { bytes: 8492, matched_before_dereg: false, polls: 3, refused_with: -1073741816 };
        let (line, code) = result_line(&Ok(summary));
        assert!(line.starts_with("VHCA-VERBS-TEST passed: RDMA write of 8492 bytes after 3 poll(s)"), "{line}");
        assert!(line.ends_with("0xc0000008"), "{line}");
        assert_eq!(code, EXIT_PASSED);
        let (line, code) = result_line(&Err::<LoopbackSummary, _>("POST_SEND: status 0xc000000d".into()));
        assert_eq!(line, "VHCA-VERBS-TEST failed: POST_SEND: status 0xc000000d");
        assert_eq!(code, EXIT_FAILED);
        let waited = WaitCancelSummary { cancel_routine_ran: None, answered_by: 0x3a17 };
        let (line, code) = result_line(&Ok(waited));
        assert_eq!(
            line,
            "VHCA-VERBS-TEST passed: a pending WAIT_CQ cancelled, one answered by RDMA write 0x3a17's completion, one \
             left pending at the exit"
        );
        assert_eq!(code, EXIT_PASSED);
    }

    fn utf16(text: &str) -> alloc::vec::Vec<u16> {
        text.encode_utf16().chain([0]).collect()
    }

    #[test]
    fn the_mode_is_the_one_word_after_the_programs_name() {
        assert_eq!(mode_of(&utf16("vhca-verbs-test.exe")), Ok(Mode::Loopback));
        assert_eq!(mode_of(&utf16(r#""C:\vhca\vhca-verbs-test.exe" wait-cancel"#)), Ok(Mode::WaitCancel));
        assert_eq!(mode_of(&utf16(r#""C:\Program Files\vhca\t.exe"  loopback "#)), Ok(Mode::Loopback));
        assert_eq!(mode_of(&utf16("t.exe\twait-cancel")), Ok(Mode::WaitCancel));
        assert_eq!(mode_of(&utf16("t.exe wait-destroy")), Ok(Mode::WaitDestroy));
        assert_eq!(mode_of(&utf16("t.exe held-write")), Ok(Mode::HeldWrite));
        assert!(!Mode::Loopback.overlapped() && Mode::WaitCancel.overlapped() && Mode::WaitDestroy.overlapped());
        assert!(!Mode::HeldWrite.overlapped(), "the held write is polled on a synchronous handle");
        assert!(mode_of(&utf16("t.exe wait")).unwrap_err().contains("unknown mode \"wait\""));
        assert!(mode_of(&utf16("t.exe loopback wait-cancel")).unwrap_err().contains("one mode only"));
        assert_eq!(mode_of(&[]), Ok(Mode::Loopback), "an empty line: the default");
    }

    #[test]
    fn the_held_write_events_are_global_and_named_once() {
        assert_eq!(IN_FLIGHT_EVENT, r"Global\vhca-verbs-test-write-in-flight");
        assert!(RESUMED_EVENT.starts_with(r"Global\") && RESUMED_EVENT != IN_FLIGHT_EVENT);
        let w = wide(RESUMED_EVENT);
        assert_eq!((w.len(), w.last()), (RESUMED_EVENT.len() + 1, Some(&0)));
    }

    #[test]
    fn a_win32_error_becomes_a_negative_status_that_names_it() {
        assert_eq!(status_from_win32(0), 0);
        // ERROR_INVALID_HANDLE (6), as DeviceIoControl reports the driver's STATUS_INVALID_HANDLE.
        assert_eq!(status_from_win32(6) as u32, 0xC007_0006);
        assert!(status_from_win32(1168) < 0, "ERROR_NOT_FOUND");
    }
}
