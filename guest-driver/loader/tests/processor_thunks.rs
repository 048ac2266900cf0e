//! The processor routines a driver binary imports, called as the binary calls them (the bound addresses, the
//! Windows x64 convention, the KDPC and PROCESSOR_NUMBER in the caller's memory), over the NT model's two
//! processors: the counts, a DPC targeted at processor 1 running there with the KPRCB behind GS saying so, and the
//! targets Windows refuses or ignores.

mod common;

use std::ffi::c_void;
use std::sync::Mutex;

use common::routine;
use common::shared_kernel::{irql, resident, take_turn};
use vhca_loader::processor_block::{gs_base, GS_LEGACY_PROCESSOR_NUMBER, GS_PROCESSOR_NUMBER};
use windows_sys::Wdk::Foundation::KDPC;
use windows_sys::Win32::Foundation::{NTSTATUS, STATUS_INVALID_PARAMETER, STATUS_SUCCESS};
use windows_sys::Win32::System::Kernel::PROCESSOR_NUMBER;

type Deferred = unsafe extern "win64" fn(*mut KDPC, *mut c_void, *mut c_void, *mut c_void);
type NumberEx = unsafe extern "win64" fn(*mut PROCESSOR_NUMBER) -> u32;

/// (KeGetCurrentProcessorNumberEx's index, its PROCESSOR_NUMBER.Number, KPRCB.Number, KPRCB.LegacyNumber, IRQL) of
/// one DPC call.
type Seen = (u32, u8, u32, u8, u8);
static SEEN: Mutex<Vec<Seen>> = Mutex::new(Vec::new());

unsafe extern "win64" fn where_am_i(_dpc: *mut KDPC, _context: *mut c_void, _a1: *mut c_void, _a2: *mut c_void) {
    let number: NumberEx = routine("KeGetCurrentProcessorNumberEx");
    let mut n = PROCESSOR_NUMBER { Group: 7, Number: 7, Reserved: 7 };
    let gs = gs_base();
    // SAFETY: the thunk with our PROCESSOR_NUMBER; the KPCR the loader gave this thread behind GS (gs_base), whose
    // KPRCB fields the WDK's inline routines read.
    let (index, prcb_number, legacy) = unsafe {
        (
            number(&mut n),
            ((gs + GS_PROCESSOR_NUMBER) as *const u32).read(),
            ((gs + GS_LEGACY_PROCESSOR_NUMBER) as *const u8).read(),
        )
    };
    assert_eq!((n.Group, n.Reserved), (0, 0));
    SEEN.lock().unwrap().push((index, n.Number, prcb_number, legacy, irql()));
}

#[test]
fn the_counts_the_dpc_targets_and_the_kprcb_follow_the_models_processors() {
    let (k, _turn) = take_turn();
    assert_eq!(k.model.processor_count(), 2, "the default machine");
    let count_ex: unsafe extern "win64" fn(u16) -> u32 = routine("KeQueryActiveProcessorCountEx");
    let count: unsafe extern "win64" fn(*mut u64) -> u32 = routine("KeQueryActiveProcessorCount");
    let init: unsafe extern "win64" fn(*mut KDPC, Deferred, *mut c_void) = routine("KeInitializeDpc");
    let insert: unsafe extern "win64" fn(*mut KDPC, *mut c_void, *mut c_void) -> u8 = routine("KeInsertQueueDpc");
    let flush: unsafe extern "win64" fn() = routine("KeFlushQueuedDpcs");
    let target: unsafe extern "win64" fn(*mut KDPC, i8) = routine("KeSetTargetProcessorDpc");
    let target_ex: unsafe extern "win64" fn(*mut KDPC, *const PROCESSOR_NUMBER) -> NTSTATUS =
        routine("KeSetTargetProcessorDpcEx");
    let dpc = resident::<KDPC>();
    let mut active = 0u64;
    // SAFETY (all calls below): the thunks at PASSIVE_LEVEL with the caller's KDPC, PROCESSOR_NUMBER and KAFFINITY.
    unsafe {
        assert_eq!((count_ex(0xFFFF), count_ex(0), count_ex(1)), (2, 2, 0));
        assert_eq!(count(&mut active), 2);
        assert_eq!(active, 0b11);
        assert_eq!(count(std::ptr::null_mut()), 2);

        init(dpc, where_am_i, std::ptr::null_mut());
        assert_eq!(target_ex(dpc, &PROCESSOR_NUMBER { Group: 0, Number: 2, Reserved: 0 }), STATUS_INVALID_PARAMETER);
        assert_eq!(target_ex(dpc, &PROCESSOR_NUMBER { Group: 1, Number: 0, Reserved: 0 }), STATUS_INVALID_PARAMETER);
        assert_eq!(target_ex(dpc, &PROCESSOR_NUMBER { Group: 0, Number: 1, Reserved: 0 }), STATUS_SUCCESS);
        assert_eq!(insert(dpc, std::ptr::null_mut(), std::ptr::null_mut()), 1);
        flush();
        // Past the processors, KeSetTargetProcessorDpc leaves the target; 0 brings the DPC back to this processor.
        target(dpc, 9);
        assert_eq!(insert(dpc, std::ptr::null_mut(), std::ptr::null_mut()), 1);
        flush();
        target(dpc, 0);
        assert_eq!(insert(dpc, std::ptr::null_mut(), std::ptr::null_mut()), 1);
    }
    assert_eq!(*SEEN.lock().unwrap(), [(1, 1, 1, 1, 2), (1, 1, 1, 1, 2), (0, 0, 0, 0, 2)]);
    assert_eq!(irql(), 0);
    assert!(k.model.bugchecks().is_empty());
}
