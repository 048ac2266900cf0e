//! In an interleaving mode a driver binary's kernel calls are named by the driver's own site (RVAs in its image,
//! as the low-resources simulation names them), not by the loader's thunk line: points, pauses and race reports of
//! vhca.sys must say where in the binary the call came from. The same fixture as driver_call_sites.rs; one test
//! function, as a process has one kernel.

#[path = "support/call_site_fixture.rs"]
mod call_site_fixture;

use std::sync::Arc;

use call_site_fixture::{fixture, INNER, OUTER, RETURN_IN_INNER, RETURN_IN_OUTER};
use vhca_loader::driver_stack;
use vhca_loader::io_manager::{BusDriver, IoManager};
use vhca_loader::kernel_context::{install, LoaderKernel};
use vhca_loader::nt_thunks::NtThunks;
use vhca_loader::windows_sys::Wdk::Foundation::IO_STACK_LOCATION;
use vhca_loader::windows_sys::Win32::Foundation::{NTSTATUS, STATUS_NOT_SUPPORTED};
use vhca_ntmodel::{InterleavingConfig, InterleavingMode, NtModel, NtModelConfig};

struct NoBus;

impl BusDriver for NoBus {
    fn pnp(&self, _stack: &IO_STACK_LOCATION) -> NTSTATUS {
        STATUS_NOT_SUPPORTED
    }
}

#[test]
fn a_recorded_point_of_a_binarys_call_names_the_drivers_rva_stack() {
    // Record alone: no verifier flag, so the low-resources simulation is off and cannot be what captures the site.
    let interleaving = InterleavingConfig { mode: InterleavingMode::Record, ..InterleavingConfig::default() };
    let (model, _backend) = NtModel::for_tests(NtModelConfig { interleaving, ..Default::default() });
    let model: Arc<NtModel> = model;
    assert!(install(LoaderKernel::new(model.clone(), IoManager::new(Box::new(NoBus)))));
    let image = vhca_loader::load(&fixture(), &NtThunks).expect("the fixture loads");
    driver_stack::register(&image, "fixture.sys");

    type Routine = unsafe extern "win64" fn() -> *mut u8;
    // SAFETY: both functions take nothing and return ExAllocatePool2's result, Windows x64 convention.
    let (outer, inner): (Routine, Routine) = unsafe {
        (std::mem::transmute::<usize, Routine>(image.at(OUTER)), std::mem::transmute::<usize, Routine>(image.at(INNER)))
    };
    // SAFETY (both calls): the fixture's code, bound to the loader's ExAllocatePool2.
    assert!(!unsafe { outer() }.is_null(), "nothing fails an allocation with the simulation off");
    assert!(!unsafe { inner() }.is_null());

    let sites: Vec<String> =
        model.schedule_points().into_iter().filter(|p| p.kind == "call ExAllocatePool").map(|p| p.site).collect();
    let through_outer = format!("fixture.sys+{RETURN_IN_INNER:#x} < fixture.sys+{RETURN_IN_OUTER:#x}");
    let inner_alone = format!("fixture.sys+{RETURN_IN_INNER:#x}");
    assert_eq!(sites, [through_outer, inner_alone], "{:?}", model.schedule_points());
    assert!(model.fault_points().is_empty(), "the simulation stayed off: the capture was the interleaving mode's");
}
