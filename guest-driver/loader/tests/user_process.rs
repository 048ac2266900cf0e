//! The model's user process through the driver's imports: pages of its memory a driver locked (IoAllocateMdl, then
//! MmProbeAndLockPages UserMode in its context) and did not unlock stop the machine at its exit, 0x76 (0, the
//! process, the pages, 0) or, under Pool Tracking, 0xCB (the MDL, 0, the MDL, its pages); unlocked, the exit is
//! silent; another context's UserMode probe of its memory is refused (raised into a caller without a handler: 0x7E
//! with STATUS_ACCESS_VIOLATION). A bugcheck ends the process, so each case runs in a child (this binary again).

mod common;

use std::ffi::c_void;
use std::sync::Arc;

use common::{child_of_this_test, routine, NoBus, StopAndExit, STOPPED};
use vhca_loader::io_manager::IoManager;
use vhca_loader::kernel_context::{install, kernel, LoaderKernel};
use vhca_loader::user_process::UserProcess;
use vhca_ntmodel::{HostDmaBackend, NtModel, NtModelConfig, VerifierFlags};

const CASE: &str = "VHCA_LOADER_USER_PROCESS_CASE";
const EXITED: &str = "exited clean";

type AllocateMdl = unsafe extern "win64" fn(*mut c_void, u32, u8, u8, *mut c_void) -> *mut c_void;
type ProbeAndLock = unsafe extern "win64" fn(*mut c_void, i8, i32);
type MdlRoutine = unsafe extern "win64" fn(*mut c_void);

fn run_case(case: &str) {
    let verifier = if case == "locked-tracked" { VerifierFlags(0xAA) } else { VerifierFlags::NONE };
    let config = NtModelConfig { verifier, ..Default::default() };
    let model = Arc::new(NtModel::new(config, Arc::new(HostDmaBackend::new(None)), Arc::new(StopAndExit)));
    assert!(install(LoaderKernel::new(model, IoManager::new(Box::new(NoBus)))));
    let allocate_mdl: AllocateMdl = routine("IoAllocateMdl");
    let probe: ProbeAndLock = routine("MmProbeAndLockPages");
    let unlock: MdlRoutine = routine("MmUnlockPages");
    let free_mdl: MdlRoutine = routine("IoFreeMdl");
    let mut process = UserProcess::new(kernel().io.device_pdo());
    // Three pages: 0x1a0 into the first, 2 pages and 300 bytes long.
    let bytes = 2 * 4096 + 300;
    let at = process.allocate(bytes, 0x1a0).expect("user memory");
    println!("process {:#x}", process.id());
    // SAFETY: the imports as a driver calls them, at PASSIVE_LEVEL; the MDL describes the process's own memory.
    let mdl = unsafe { allocate_mdl(at as *mut c_void, bytes as u32, 0, 0, std::ptr::null_mut()) };
    assert!(!mdl.is_null());
    println!("mdl {:#x}", mdl as usize);
    match case {
        "locked" | "locked-tracked" => process.in_context(|| unsafe { probe(mdl, 1, 2) }),
        "unlocked" => {
            process.in_context(|| unsafe { probe(mdl, 1, 2) });
            // SAFETY: as above: the MDL the probe locked.
            unsafe {
                unlock(mdl);
                free_mdl(mdl);
            }
        }
        // The System process's UserMode probe of the user process's memory: refused, raised with no handler.
        "other-context" => unsafe { probe(mdl, 1, 2) },
        _ => panic!("unknown case {case}"),
    }
    process.exit();
    println!("{EXITED}");
}

#[test]
#[ignore = "run by the tests below as a child process"]
fn child() {
    run_case(&std::env::var(CASE).expect("the case"));
}

/// The case's output and whether it stopped, with the process object and MDL it printed.
fn case(name: &str) -> (String, bool, String, String) {
    let out = child_of_this_test(CASE, name).output().expect("the child runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stopped = out.status.code() == Some(STOPPED);
    let value = |key: &str| {
        // Anywhere in a line: the harness writes the test's name before the child's first line.
        stdout.lines().find_map(|l| l.split_once(key)).map(|(_, v)| v.trim().to_string()).unwrap_or_default()
    };
    (stdout.clone(), stopped, value("process "), value("mdl "))
}

/// The STOP line's hex words after its code, as numbers.
fn stop(stdout: &str, code: &str) -> Vec<u64> {
    let line = stdout.lines().find(|l| l.contains(code)).unwrap_or_else(|| panic!("no {code} in:\n{stdout}"));
    let inside = line.split_once('(').and_then(|(_, rest)| rest.split_once(')')).map(|(p, _)| p).unwrap_or("");
    inside.split(',').map(|p| u64::from_str_radix(p.trim().trim_start_matches("0x"), 16).unwrap()).collect()
}

fn hex(text: &str) -> u64 {
    u64::from_str_radix(text.trim_start_matches("0x"), 16).unwrap_or_else(|_| panic!("not hex: {text:?}"))
}

#[test]
fn an_exit_with_pages_locked_is_0x76_naming_the_process_and_its_pages() {
    let (stdout, stopped, process, _) = case("locked");
    assert!(stopped, "{stdout}");
    assert_eq!(stop(&stdout, "0x00000076"), [0, hex(&process), 3, 0], "{stdout}");
}

#[test]
fn under_pool_tracking_the_exit_is_0xcb_naming_the_mdl() {
    let (stdout, stopped, _, mdl) = case("locked-tracked");
    assert!(stopped, "{stdout}");
    assert_eq!(stop(&stdout, "0x000000CB"), [hex(&mdl), 0, hex(&mdl), 3], "{stdout}");
}

#[test]
fn an_exit_after_the_unlock_is_silent() {
    let (stdout, stopped, _, _) = case("unlocked");
    assert!(!stopped && stdout.contains(EXITED), "{stdout}");
}

#[test]
fn a_user_mode_probe_from_another_context_is_an_access_violation() {
    let (stdout, stopped, _, _) = case("other-context");
    assert!(stopped, "{stdout}");
    assert_eq!(stop(&stdout, "0x0000007E")[0], 0xC000_0005, "{stdout}");
}
