//! The real vhca.sys's CREATE, DEVICE_CONTROL, CLEANUP and CLOSE routines, reached as a user-mode caller's requests
//! reach them (user_requests.rs): each must be the driver's own (a missing one passes down to the bus driver, whose
//! answer differs), CREATE must leave a context in FsContext and CLOSE take it back. Without START_DEVICE the HCA is
//! not there, so an IOCTL is answered STATUS_DEVICE_NOT_READY by the dispatch routine itself; a user process's direct
//! buffer is locked by the I/O manager before the driver sees it, or refused when it is not the process's memory.
//! Without the package this test fails under CI=true (the test command builds it first) and skips otherwise.

mod common;

use std::sync::Arc;

use common::vhca_sys_package::vhca_sys;
use common::NoBus;
use vhca_loader::device_interfaces;
use vhca_loader::io_manager::IoManager;
use vhca_loader::kernel_context::{install, kernel, LoaderKernel};
use vhca_loader::nt_thunks::NtThunks;
use vhca_loader::user_process::UserProcess;
use vhca_loader::user_requests::{add_driver, UserFile};
use vhca_ntmodel::{NtModel, NtModelConfig};

const IRP_MJ_CREATE: usize = 0;
const IRP_MJ_READ: usize = 3;
const IRP_MJ_DEVICE_CONTROL: usize = 14;
const IRP_MJ_CLEANUP: usize = 18;
const IRP_MJ_CLOSE: usize = 2;
/// IOCTL_VHCA_OPEN_CONTEXT (docs/protocol.md section 12) and its input: ABI version 1.
const IOCTL_VHCA_OPEN_CONTEXT: u32 = 0x8056_E000;
const STATUS_DEVICE_NOT_READY: i32 = 0xC000_00A3_u32 as i32;
const STATUS_INVALID_DEVICE_REQUEST: i32 = 0xC000_0010_u32 as i32;
/// IOCTL_VHCA_POLL_CQ, METHOD_OUT_DIRECT (docs/protocol.md section 12).
const IOCTL_VHCA_POLL_CQ: u32 = 0x8056_E036;
const STATUS_ACCESS_VIOLATION: i32 = 0xC000_0005_u32 as i32;
const STATUS_NO_SUCH_DEVICE: i32 = 0xC000_000E_u32 as i32;

#[test]
fn vhca_sys_answers_create_device_control_cleanup_and_close_itself() {
    let Some(bytes) = vhca_sys() else { return };
    let (model, _backend) = NtModel::for_tests(NtModelConfig::default());
    let model: Arc<NtModel> = model;
    assert!(install(LoaderKernel::new(model, IoManager::new(Box::new(NoBus)))));
    let image = vhca_loader::load(&bytes, &NtThunks).expect("vhca.sys loads");
    vhca_loader::driver_stack::register(&image, "vhca.sys");
    let added = add_driver(&image).expect("DriverEntry and AddDevice");

    // SAFETY: the driver object DriverEntry filled in.
    let table = unsafe { (*added.driver).MajorFunction };
    let pass_down = table[IRP_MJ_READ].map(|f| f as usize);
    for (name, major) in [
        ("CREATE", IRP_MJ_CREATE),
        ("CLEANUP", IRP_MJ_CLEANUP),
        ("CLOSE", IRP_MJ_CLOSE),
        ("DEVICE_CONTROL", IRP_MJ_DEVICE_CONTROL),
    ] {
        let routine = table[major].map(|f| f as usize);
        assert!(routine.is_some() && routine != pass_down, "IRP_MJ_{name} goes down unchanged");
    }

    let file = UserFile::create(added.top).expect("CREATE succeeds");
    assert!(!file.fs_context().is_null(), "CREATE left no FileContext in FsContext");
    let input = [1u8, 0, 0, 0, 0, 0, 0, 0];
    let mut output = [0u8; 16];
    let reply = file.device_control(IOCTL_VHCA_OPEN_CONTEXT, &input, &mut output);
    assert_eq!(reply.status, STATUS_DEVICE_NOT_READY, "{reply:?}");
    assert_eq!(reply.information, 0);
    // OPEN_CONTEXT's function with METHOD_NEITHER: no vhca code uses it, refused before the HCA is looked for.
    let reply = file.device_control(IOCTL_VHCA_OPEN_CONTEXT | 3, &input, &mut output);
    assert_eq!(reply.status, STATUS_INVALID_DEVICE_REQUEST, "{reply:?}");
    // Not started: no interface was registered (START_DEVICE registers and enables it).
    assert!(device_interfaces::all().is_empty());

    // A user process's OUT_DIRECT buffer is probed and locked by the I/O manager in its context before the IRP goes:
    // its own memory reaches the driver (which answers DEVICE_NOT_READY), memory that is not its own fails the call
    // with STATUS_ACCESS_VIOLATION without the driver, and no MDL of either is left.
    let mut process = UserProcess::new(kernel().io.device_pdo());
    assert_eq!(process.open_interface().err(), Some(STATUS_NO_SUCH_DEVICE), "no interface enabled yet");
    let own = process.allocate(64, 0x10).expect("user memory");
    let poll = [0u8; 8];
    // SAFETY: 64 bytes of the process's own memory, live until its exit.
    let out = unsafe { std::slice::from_raw_parts_mut(own as *mut u8, 64) };
    let reply = process.in_context(|| file.device_control(IOCTL_VHCA_POLL_CQ, &poll, out));
    assert_eq!(reply.status, STATUS_DEVICE_NOT_READY, "{reply:?}");
    let mut not_its_own = [0u8; 64];
    let reply = process.in_context(|| file.device_control(IOCTL_VHCA_POLL_CQ, &poll, &mut not_its_own));
    assert_eq!(reply.status, STATUS_ACCESS_VIOLATION, "{reply:?}");
    let left = kernel().model.unreleased_resources();
    assert!(left.iter().all(|r| !r.starts_with("MDL") && !r.contains("locked")), "{left:?}");
    process.exit();

    assert_eq!(file.close(), (0, 0), "CLEANUP, CLOSE");
}
