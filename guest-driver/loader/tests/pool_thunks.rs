//! The pool imports through the Windows ABI: ExAllocatePool2's POOL_FLAGS and ExAllocatePoolWithTag's POOL_TYPE
//! reach the model as the driver passed them, so under Code integrity checks an executable request is 0xC4/0x2000
//! naming the return address in the caller, the pool type and the tag, and an NX one passes; what ExAllocatePool2
//! refuses (invalid flags, tag 0) is NULL, or 0x7E under POOL_FLAG_RAISE_ON_FAILURE; the driver's pages are never
//! executable. A bugcheck in a thunk cannot unwind through the caller, so each case runs in a child process (this
//! binary again, its ignored `child` test) whose handler prints the STOP line and exits.

mod common;

use std::sync::Arc;

use common::{routine, NoBus, StopAndExit, STOPPED};
use vhca_loader::io_manager::IoManager;
use vhca_loader::kernel_context::{install, LoaderKernel};
use vhca_ntapi::*;
use vhca_ntmodel::{HostDmaBackend, NtModel, NtModelConfig, VerifierFlags};

const CASE: &str = "VHCA_LOADER_POOL_CASE";
const TAG: u32 = pool_tag(b"VhCi");

type Pool2 = unsafe extern "win64" fn(u64, usize, u32) -> *mut u8;
type PoolWithTag = unsafe extern "win64" fn(u32, usize, u32) -> *mut u8;

/// The permissions /proc/self/maps gives the mapping holding `at` ("rw-p", ...).
fn permissions(at: usize) -> String {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines()
        .find_map(|line| {
            let (range, rest) = line.split_once(' ')?;
            let (low, high) = range.split_once('-')?;
            let (low, high) = (usize::from_str_radix(low, 16).ok()?, usize::from_str_radix(high, 16).ok()?);
            (low <= at && at < high).then(|| rest[..4].to_string())
        })
        .unwrap_or_else(|| panic!("{at:#x} is not mapped"))
}

/// One case in this (child) process. Not inlined: the parent checks the STOP's P2 against its address.
#[inline(never)]
fn run_case(case: &str) {
    println!("run_case at {:#x}", run_case as *const () as usize);
    let verifier = match case {
        "executable-unchecked" => VerifierFlags(0xAA),
        _ => VerifierFlags(VerifierFlags::CODE_INTEGRITY.0 | 0xAA),
    };
    let config = NtModelConfig { verifier, ..Default::default() };
    let model = Arc::new(NtModel::new(config, Arc::new(HostDmaBackend::new(None)), Arc::new(StopAndExit)));
    assert!(install(LoaderKernel::new(model, IoManager::new(Box::new(NoBus)))));
    let pool2: Pool2 = routine("ExAllocatePool2");
    let with_tag: PoolWithTag = routine("ExAllocatePoolWithTag");
    let free: unsafe extern "win64" fn(*mut u8, u32) = routine("ExFreePoolWithTag");
    // SAFETY (all calls below): the thunks as a driver calls them, on blocks they returned.
    unsafe {
        match case {
            "executable-pool2" => {
                pool2(POOL_FLAG_NON_PAGED_EXECUTE, 64, TAG);
            }
            "executable-with-tag" => {
                with_tag(POOL_TYPE::NonPagedPool as u32, 64, TAG);
            }
            "executable-unchecked" => {
                let p = pool2(POOL_FLAG_NON_PAGED_EXECUTE, 64, TAG);
                assert!(!p.is_null(), "Windows hands out executable pool without the check");
                free(p, TAG);
            }
            "nx-and-paged" => {
                for p in [
                    pool2(POOL_FLAG_NON_PAGED, 64, TAG),
                    pool2(POOL_FLAG_PAGED | POOL_FLAG_UNINITIALIZED, 64, TAG),
                    with_tag(POOL_TYPE::NonPagedPoolNx as u32, 64, TAG),
                    with_tag(POOL_TYPE::PagedPool as u32, 64, TAG),
                ] {
                    assert!(!p.is_null());
                    p.write(0x5A);
                    let perms = permissions(p as usize);
                    assert!(!perms.contains('x'), "a driver's pool block is never executable: {perms}");
                    free(p, TAG);
                }
                for (flags, tag, why) in [
                    (0, TAG, "no pool named"),
                    (POOL_FLAG_NON_PAGED | POOL_FLAG_PAGED, TAG, "two pools"),
                    (POOL_FLAG_NON_PAGED | 0x800, TAG, "a required flag wdm.h does not know"),
                    (POOL_FLAG_NON_PAGED, 0, "tag 0"),
                ] {
                    assert!(pool2(flags, 64, tag).is_null(), "{why}: ExAllocatePool2 returns NULL");
                }
            }
            "raise-on-failure" => {
                pool2(POOL_FLAG_RAISE_ON_FAILURE | POOL_FLAG_NON_PAGED | POOL_FLAG_PAGED, 64, TAG);
            }
            other => panic!("no case {other}"),
        }
    }
    println!("no bugcheck");
}

/// Not a test of its own: the parent runs it in a child process with the case in the environment.
#[test]
#[ignore]
fn child() {
    run_case(&std::env::var(CASE).expect("run by the tests below, with the case named"));
}

/// The child's exit status, its STOP line's code and parameters (or its whole output), and run_case's address.
fn outcome(case: &str) -> (i32, Option<(u32, [u64; 4])>, usize, String) {
    let out = common::child_of_this_test(CASE, case).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let hex = |t: &str| u64::from_str_radix(t.trim().trim_start_matches("0x"), 16).unwrap();
    let stop = stdout.lines().find_map(|l| {
        let at = l.find("*** STOP: ")?;
        let (code, params) = l[at + 10..].split_once(" (")?;
        let params: Vec<u64> = params.trim_end_matches(')').split(',').map(hex).collect();
        Some((hex(code) as u32, [params[0], params[1], params[2], params[3]]))
    });
    let base = stdout.lines().find_map(|l| l.find("run_case at ").map(|at| hex(&l[at + 12..]))).unwrap_or(0);
    (out.status.code().unwrap_or(-1), stop, base as usize, stdout)
}

/// 0xC4/0x2000 with P2 a return address inside run_case, P3 the pool type, P4 the tag.
fn assert_executable_pool_stop(case: &str, pool_type: u64) {
    let (status, stop, base, out) = outcome(case);
    assert_eq!(status, STOPPED, "{out}");
    let (code, [p1, p2, p3, p4]) = stop.unwrap_or_else(|| panic!("no STOP line: {out}"));
    assert_eq!((code, p1, p3, p4), (0xC4, 0x2000, pool_type, u64::from(TAG)), "{out}");
    assert!((base..base + 0x4000).contains(&(p2 as usize)), "P2 {p2:#x} is not in run_case at {base:#x}: {out}");
}

#[test]
fn executable_pool_through_exallocatepool2_is_c4_2000_under_code_integrity_checks() {
    assert_executable_pool_stop("executable-pool2", 0);
}

#[test]
fn executable_pool_through_exallocatepoolwithtag_is_c4_2000_under_code_integrity_checks() {
    assert_executable_pool_stop("executable-with-tag", 0);
}

#[test]
fn executable_pool_is_handed_out_without_code_integrity_checks() {
    let (status, stop, _, out) = outcome("executable-unchecked");
    assert!(status == 0 && stop.is_none() && out.contains("no bugcheck"), "{out}");
}

#[test]
fn nx_and_paged_pool_pass_and_invalid_requests_are_null() {
    let (status, stop, _, out) = outcome("nx-and-paged");
    assert!(status == 0 && stop.is_none() && out.contains("no bugcheck"), "{out}");
}

#[test]
fn a_refused_request_with_raise_on_failure_is_0x7e_insufficient_resources() {
    let (status, stop, _, out) = outcome("raise-on-failure");
    assert_eq!(status, STOPPED, "{out}");
    assert_eq!(stop, Some((0x7E, [0xC000_009A, 0, 0, 0])), "{out}");
}
