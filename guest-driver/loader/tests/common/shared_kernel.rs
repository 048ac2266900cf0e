//! The one IRQL-checked kernel that a test process's DPC, timer, work-item and interrupt thunk tests take turns on,
//! and what their fake driver routines ask of it: the current IRQL, kernel objects in the driver's own memory.
//!
//! Why turns: the model's processors are shared by every thread, so a clock interrupt or a DPC drain in one test
//! would run a DPC another test keeps queued at DISPATCH_LEVEL. Why one kernel: `install` takes one per process.

use std::sync::{Mutex, MutexGuard, OnceLock};

use vhca_loader::io_manager::IoManager;
use vhca_loader::kernel_context::{install, kernel, LoaderKernel};
use vhca_ntmodel::{NtModel, NtModelConfig, VerifierFlags};

use super::{routine, NoBus};

/// The installed kernel (installed by the first caller), and the calling test's turn on it.
pub fn take_turn() -> (&'static LoaderKernel, MutexGuard<'static, ()>) {
    static ONCE: OnceLock<()> = OnceLock::new();
    static TURN: Mutex<()> = Mutex::new(());
    // A test that failed in its turn poisons the lock; the next test's turn is still its own.
    let turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    ONCE.get_or_init(|| {
        let config = NtModelConfig { verifier: VerifierFlags::IRQL_CHECKING, ..Default::default() };
        let (model, _backend) = NtModel::for_tests(config);
        assert!(install(LoaderKernel::new(model, IoManager::new(Box::new(NoBus)))));
    });
    (kernel(), turn)
}

/// The current IRQL, as the driver reads it (KeGetCurrentIrql).
pub fn irql() -> u8 {
    let f: unsafe extern "win64" fn() -> u8 = routine("KeGetCurrentIrql");
    // SAFETY: the thunk, no arguments.
    unsafe { f() }
}

/// A zeroed kernel object in the caller's memory, as a device extension holds it, never freed (a KDPC the model
/// may still name must stay resident).
pub fn resident<T>() -> *mut T {
    // SAFETY: an all-zero KDPC/KTIMER/KEVENT is the uninitialized state their Ke*Initialize* routines expect.
    Box::into_raw(Box::new(unsafe { std::mem::zeroed::<T>() }))
}
