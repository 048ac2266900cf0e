//! The thunks a driver binary calls, called here the way the binary calls them (through the addresses the import
//! binding hands out, with the Windows x64 convention) on one installed kernel: IRQL through the model's locks,
//! the registry the driver reads its scenario from, events. One test function: a process has one kernel.

mod common;

use std::ffi::c_void;
use std::sync::Arc;

use common::{routine, NoBus};
use vhca_loader::io_manager::IoManager;
use vhca_loader::kernel_context::{install, kernel, LoaderKernel};
use vhca_ntmodel::{NtModel, NtModelConfig, VerifierFlags};
use windows_sys::Wdk::Foundation::{KEVENT, OBJECT_ATTRIBUTES};
use windows_sys::Win32::Foundation::{NTSTATUS, UNICODE_STRING};

fn unicode(units: &[u16]) -> UNICODE_STRING {
    UNICODE_STRING {
        Length: (units.len() * 2) as u16,
        MaximumLength: (units.len() * 2) as u16,
        Buffer: units.as_ptr() as *mut u16,
    }
}

#[test]
fn thunks_keep_irql_locks_registry_and_events_as_windows_does() {
    let flags = VerifierFlags::IRQL_CHECKING.0 | VerifierFlags::DEADLOCK_DETECTION.0;
    let (model, _backend) = NtModel::for_tests(NtModelConfig { verifier: VerifierFlags(flags), ..Default::default() });
    let model: Arc<NtModel> = model;
    assert!(install(LoaderKernel::new(model, IoManager::new(Box::new(NoBus)))));

    let irql: unsafe extern "win64" fn() -> u8 = routine("KeGetCurrentIrql");
    // SAFETY (all calls below): the thunks with their Windows signatures and live arguments, at PASSIVE_LEVEL.
    unsafe {
        // FAST_MUTEX: the owner runs at APC_LEVEL (Microsoft, ExAcquireFastMutex).
        let mut fast_mutex = [0u64; 7];
        let acquire: unsafe extern "win64" fn(*mut c_void) = routine("ExAcquireFastMutex");
        let release: unsafe extern "win64" fn(*mut c_void) = routine("ExReleaseFastMutex");
        acquire(fast_mutex.as_mut_ptr().cast());
        assert_eq!(irql(), 1);
        release(fast_mutex.as_mut_ptr().cast());
        assert_eq!(irql(), 0);

        // KMUTEX: waiting leaves the IRQL alone; KeWaitForSingleObject tells it from an event.
        let mut kmutex = [0u64; 7];
        let init: unsafe extern "win64" fn(*mut c_void, u32) = routine("KeInitializeMutex");
        let wait: unsafe extern "win64" fn(*mut c_void, u32, i8, u8, *const i64) -> NTSTATUS =
            routine("KeWaitForSingleObject");
        let release_mutex: unsafe extern "win64" fn(*mut c_void, u8) -> i32 = routine("KeReleaseMutex");
        init(kmutex.as_mut_ptr().cast(), 0);
        assert_eq!(wait(kmutex.as_mut_ptr().cast(), 0, 0, 0, std::ptr::null()), 0);
        assert_eq!(irql(), 0);
        release_mutex(kmutex.as_mut_ptr().cast(), 0);

        // Spin lock: DISPATCH_LEVEL while held, the old IRQL back on release.
        let mut spin = 0u64;
        let acquire_spin: unsafe extern "win64" fn(*mut u64) -> u8 = routine("KeAcquireSpinLockRaiseToDpc");
        let release_spin: unsafe extern "win64" fn(*mut u64, u8) = routine("KeReleaseSpinLock");
        let old = acquire_spin(&mut spin);
        assert_eq!((old, irql()), (0, 2));
        release_spin(&mut spin, old);
        assert_eq!(irql(), 0);

        // Events: a signalled notification event satisfies a wait; a timeout on an unsignalled one times out.
        let mut event: KEVENT = std::mem::zeroed();
        let init_event: unsafe extern "win64" fn(*mut KEVENT, u32, u8) = routine("KeInitializeEvent");
        init_event(&mut event, 0, 0);
        let timeout = -10_000i64; // 1 ms, relative
        assert_eq!(wait((&mut event as *mut KEVENT).cast(), 0, 0, 0, &timeout), 0x102);
        init_event(&mut event, 0, 1);
        assert_eq!(wait((&mut event as *mut KEVENT).cast(), 0, 0, 0, std::ptr::null()), 0);

        // Registry: the Parameters key the run sets, read as KEY_VALUE_PARTIAL_INFORMATION and written back.
        let key = "\\Registry\\Machine\\System\\CurrentControlSet\\Services\\vhca\\Parameters";
        kernel().registry.set_string(key, "Scenario", "fast-mutex-create-cq");
        let key_units: Vec<u16> = key.to_uppercase().encode_utf16().collect();
        let key_name = unicode(&key_units);
        let attributes = OBJECT_ATTRIBUTES {
            Length: std::mem::size_of::<OBJECT_ATTRIBUTES>() as u32,
            ObjectName: &key_name,
            ..std::mem::zeroed()
        };
        let open: unsafe extern "win64" fn(*mut *mut c_void, u32, *const OBJECT_ATTRIBUTES) -> NTSTATUS =
            routine("ZwOpenKey");
        let query: unsafe extern "win64" fn(
            *mut c_void,
            *const UNICODE_STRING,
            u32,
            *mut u8,
            u32,
            *mut u32,
        ) -> NTSTATUS = routine("ZwQueryValueKey");
        let set: unsafe extern "win64" fn(*mut c_void, *const UNICODE_STRING, u32, u32, *const u8, u32) -> NTSTATUS =
            routine("ZwSetValueKey");
        let close: unsafe extern "win64" fn(*mut c_void) -> NTSTATUS = routine("ZwClose");
        let mut handle = std::ptr::null_mut();
        assert_eq!(open(&mut handle, 0x20019, &attributes), 0);
        let value_units: Vec<u16> = "scenario".encode_utf16().collect();
        let value = unicode(&value_units);
        let mut needed = 0u32;
        let mut small = [0u8; 12];
        assert_eq!(query(handle, &value, 2, small.as_mut_ptr(), 12, &mut needed), 0x8000_0005u32 as i32);
        let mut buffer = vec![0u8; needed as usize];
        assert_eq!(query(handle, &value, 2, buffer.as_mut_ptr(), needed, &mut needed), 0);
        assert_eq!(u32::from_le_bytes(buffer[4..8].try_into().unwrap()), 1, "REG_SZ");
        let text: Vec<u16> = buffer[12..].chunks(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
        assert_eq!(String::from_utf16_lossy(&text), "fast-mutex-create-cq\0");
        let result_units: Vec<u16> = "Result".encode_utf16().collect();
        let line: Vec<u8> = "ok\0".encode_utf16().flat_map(u16::to_le_bytes).collect();
        assert_eq!(set(handle, &unicode(&result_units), 0, 1, line.as_ptr(), line.len() as u32), 0);
        assert_eq!(kernel().registry.string(key, "result").as_deref(), Some("ok"));
        assert_eq!(close(handle), 0);
        assert_eq!(close(handle), 0xC000_0008u32 as i32, "a closed handle is invalid");
        let missing_units: Vec<u16> = "Nope".encode_utf16().collect();
        let mut h2 = std::ptr::null_mut();
        let missing_name = unicode(&missing_units);
        let missing = OBJECT_ATTRIBUTES { ObjectName: &missing_name, ..attributes };
        assert_eq!(open(&mut h2, 0x20019, &missing), 0xC000_0034u32 as i32);
    }
    assert!(kernel().model.bugchecks().is_empty());
}
