//! vhca.sys's lock, timer and event routines are scheduling points named by the driver's call site, as its
//! faultable ones are: a spin lock's call point and its acquire point name the RVAs of the binary's frames, not
//! the loader's lock_thunks.rs line. The call-site fixture with KeAcquireSpinLockRaiseToDpc as its one import; one
//! test function, as a process has one kernel.

#[path = "support/call_site_fixture.rs"]
mod call_site_fixture;

use std::sync::Arc;

use call_site_fixture::{fixture_importing, INNER, OUTER, RETURN_IN_INNER, RETURN_IN_OUTER};
use vhca_loader::driver_stack;
use vhca_loader::io_manager::{BusDriver, IoManager};
use vhca_loader::kernel_context::{install, LoaderKernel};
use vhca_loader::nt_thunks::NtThunks;
use vhca_loader::windows_sys::Wdk::Foundation::IO_STACK_LOCATION;
use vhca_loader::windows_sys::Win32::Foundation::{NTSTATUS, STATUS_NOT_SUPPORTED};
use vhca_loader::ImportResolver;
use vhca_ntmodel::{InterleavingConfig, InterleavingMode, NtModel, NtModelConfig};

struct NoBus;

impl BusDriver for NoBus {
    fn pnp(&self, _stack: &IO_STACK_LOCATION) -> NTSTATUS {
        STATUS_NOT_SUPPORTED
    }
}

#[test]
fn a_spin_lock_s_points_name_the_drivers_rva_stack() {
    // Record alone, no verifier flag: the low-resources simulation is off and cannot be what captures the site.
    let interleaving = InterleavingConfig { mode: InterleavingMode::Record, ..InterleavingConfig::default() };
    let (model, _backend) = NtModel::for_tests(NtModelConfig { interleaving, ..Default::default() });
    let model: Arc<NtModel> = model;
    assert!(install(LoaderKernel::new(model.clone(), IoManager::new(Box::new(NoBus)))));
    let image = vhca_loader::load(&fixture_importing("KeAcquireSpinLockRaiseToDpc"), &NtThunks).expect("it loads");
    driver_stack::register(&image, "fixture.sys");
    let release = NtThunks.resolve("ntoskrnl.exe", "KeReleaseSpinLock").expect("the loader binds KeReleaseSpinLock");

    type Routine = unsafe extern "win64" fn() -> u64;
    type Release = unsafe extern "win64" fn(usize, u8);
    // SAFETY: both fixture functions take nothing and return the import's result in rax; the release thunk is the
    // loader's KeReleaseSpinLock(SpinLock, NewIrql), Windows x64 convention.
    let (outer, inner, release) = unsafe {
        (
            std::mem::transmute::<usize, Routine>(image.at(OUTER)),
            std::mem::transmute::<usize, Routine>(image.at(INNER)),
            std::mem::transmute::<usize, Release>(release),
        )
    };
    for acquire in [outer, inner] {
        // SAFETY: the fixture's code acquires the spin lock at 0x40 (an address the loader only binds); released
        // from here (a Rust caller: no driver site) at the IRQL the acquire returned.
        unsafe {
            let old = acquire() as u8;
            release(0x40, old);
        }
    }

    let points = model.schedule_points();
    let sites = |kind: &dyn Fn(&str) -> bool| -> Vec<String> {
        points.iter().filter(|p| kind(&p.kind)).map(|p| p.site.clone()).collect()
    };
    let through_outer = format!("fixture.sys+{RETURN_IN_INNER:#x} < fixture.sys+{RETURN_IN_OUTER:#x}");
    let inner_alone = format!("fixture.sys+{RETURN_IN_INNER:#x}");
    assert_eq!(sites(&|k| k == "call KeAcquireSpinLock"), [through_outer.clone(), inner_alone.clone()], "{points:?}");
    assert_eq!(sites(&|k| k.starts_with("acquire ")), [through_outer.clone(), inner_alone.clone()], "{points:?}");
    // The control: the release came from Rust, so its points keep the thunk's own line.
    let released = sites(&|k| k == "call KeReleaseSpinLock");
    assert_eq!(released.len(), 2, "{points:?}");
    assert!(released.iter().all(|s| s.contains("lock_thunks.rs")), "{released:?}");
}
