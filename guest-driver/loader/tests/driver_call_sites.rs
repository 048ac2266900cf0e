//! A faultable import's call site is the driver's part of the call stack as RVAs: the return address, then the
//! frames an x64 unwind through the image's .pdata/.xdata finds, the same when the image is loaded again at another
//! base, and another site for another path to the same call. The image is a small hand-assembled PE (two functions
//! with unwind info, one calling ExAllocatePool2 through its IAT), so the expected frames are known exactly.
//! One test function: a process has one kernel.

use std::sync::Arc;

use vhca_loader::driver_stack;
use vhca_loader::io_manager::{BusDriver, IoManager};
use vhca_loader::kernel_context::{install, LoaderKernel};
use vhca_loader::nt_thunks::NtThunks;
use vhca_loader::windows_sys::Wdk::Foundation::IO_STACK_LOCATION;
use vhca_loader::windows_sys::Win32::Foundation::{NTSTATUS, STATUS_NOT_SUPPORTED};
use vhca_ntmodel::{FaultableRoutine, LowResourcesConfig, NtModel, NtModelConfig, SiteFrame, VerifierFlags};

struct NoBus;

impl BusDriver for NoBus {
    fn pnp(&self, _stack: &IO_STACK_LOCATION) -> NTSTATUS {
        STATUS_NOT_SUPPORTED
    }
}

#[path = "support/call_site_fixture.rs"]
mod call_site_fixture;

use call_site_fixture::{fixture, INNER, OUTER, RETURN_IN_INNER, RETURN_IN_OUTER};

fn frames(site: &vhca_ntmodel::CallSite) -> Vec<(String, u32)> {
    site.frames()
        .iter()
        .map(|f| match f {
            SiteFrame::Image { module, rva } => (module.clone(), *rva),
            other => panic!("a loaded image's site has image frames only, got {other}"),
        })
        .collect()
}

#[test]
fn a_call_site_is_the_drivers_rva_stack_and_survives_a_reload() {
    // Windows' systematic simulation: each new call stack fails the first time it is seen.
    let config = NtModelConfig {
        verifier: VerifierFlags(VerifierFlags::SYSTEMATIC_LOW_RESOURCES.0),
        low_resources: LowResourcesConfig::default(),
        ..Default::default()
    };
    let (model, _backend) = NtModel::for_tests(config);
    let model: Arc<NtModel> = model;
    assert!(install(LoaderKernel::new(model.clone(), IoManager::new(Box::new(NoBus)))));

    let bytes = fixture();
    let first = vhca_loader::load(&bytes, &NtThunks).expect("the fixture loads");
    let second = vhca_loader::load(&bytes, &NtThunks).expect("the fixture loads again");
    assert_ne!(first.base(), second.base(), "two loads, two bases");
    driver_stack::register(&first, "fixture.sys");
    driver_stack::register(&second, "fixture.sys");

    type Routine = unsafe extern "win64" fn() -> *mut u8;
    // SAFETY: both functions take nothing and return ExAllocatePool2's result, Windows x64 convention.
    let (outer_a, outer_b, inner_b): (Routine, Routine, Routine) = unsafe {
        (
            std::mem::transmute::<usize, Routine>(first.at(OUTER)),
            std::mem::transmute::<usize, Routine>(second.at(OUTER)),
            std::mem::transmute::<usize, Routine>(second.at(INNER)),
        )
    };
    // SAFETY (the three calls): the fixture's code, bound to the loader's ExAllocatePool2.
    let a = unsafe { outer_a() };
    assert!(a.is_null(), "the first sighting of outer -> inner -> ExAllocatePool2 fails (systematic)");
    let b = unsafe { outer_b() };
    assert!(!b.is_null(), "the same stack in the image loaded at another base is the same site: not failed again");
    let c = unsafe { inner_b() };
    assert!(c.is_null(), "inner called from elsewhere is another stack: failed on its first sighting");

    let points = model.fault_points();
    assert_eq!(points.len(), 2, "{points:?}");
    let name = |rva| ("fixture.sys".to_string(), rva);
    assert_eq!(points[0].routine, FaultableRoutine::ExAllocatePoolWithTag);
    assert_eq!(frames(&points[0].site), vec![name(RETURN_IN_INNER), name(RETURN_IN_OUTER)]);
    assert_eq!(points[0].site.to_string(), "fixture.sys+0x103b < fixture.sys+0x1009");
    assert_eq!(frames(&points[1].site), vec![name(RETURN_IN_INNER)]);
    let injected = model.injected_faults();
    assert_eq!(injected.iter().map(|f| f.point).collect::<Vec<_>>(), vec![1, 2]);
}
