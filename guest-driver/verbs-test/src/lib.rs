//! vhca-verbs-test.exe's portable half: reading the interface list the configuration manager returns, and the
//! result line the program prints. The Win32 half (src/win32/) is in the binary, built for Windows only.
#![no_std]

extern crate alloc;

use alloc::format;
use alloc::string::String;

use vhca_user_verbs::LoopbackSummary;

/// The prefix of the one line the program prints at its end, for a script or the guest agent to find.
pub const RESULT_PREFIX: &str = "VHCA-VERBS-TEST";

/// Exit codes: 0 the life passed, 1 it failed (the line says where), 2 no vhca interface present, 3 a panic.
pub const EXIT_PASSED: u32 = 0;
pub const EXIT_FAILED: u32 = 1;
pub const EXIT_NO_DEVICE: u32 = 2;
pub const EXIT_PANIC: u32 = 3;

/// The first path of a REG_MULTI_SZ-shaped list (CM_Get_Device_Interface_ListW's): UTF-16 strings each ended by a
/// NUL, the list by an empty one. Its units without the NUL; None when the list is empty or not terminated.
pub fn first_interface(list: &[u16]) -> Option<&[u16]> {
    let end = list.iter().position(|&u| u == 0)?;
    (end > 0).then(|| &list[..end])
}

/// The line that ends the program's output, and its exit code.
pub fn result_line(outcome: &Result<LoopbackSummary, String>) -> (String, u32) {
    match outcome {
        Ok(s) => (
            format!(
                "{RESULT_PREFIX} passed: RDMA write of {} bytes after {} poll(s), matched before DEREG_MR: {}, foreign CQ \
                 refused with {:#010x}",
                s.bytes, s.polls, s.matched_before_dereg, s.refused_with as u32
            ),
            EXIT_PASSED,
        ),
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
        let (line, code) = result_line(&Err("POST_SEND: status 0xc000000d".into()));
        assert_eq!(line, "VHCA-VERBS-TEST failed: POST_SEND: status 0xc000000d");
        assert_eq!(code, EXIT_FAILED);
    }

    #[test]
    fn a_win32_error_becomes_a_negative_status_that_names_it() {
        assert_eq!(status_from_win32(0), 0);
        // ERROR_INVALID_HANDLE (6), as DeviceIoControl reports the driver's STATUS_INVALID_HANDLE.
        assert_eq!(status_from_win32(6) as u32, 0xC007_0006);
        assert!(status_from_win32(1168) < 0, "ERROR_NOT_FOUND");
    }
}
