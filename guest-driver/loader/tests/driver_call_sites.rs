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

/// `outer` (RVA 0x1000) calls `inner` (0x1020), which calls ExAllocatePool2(NonPaged, 0x100, 'Test') through the
/// IAT; each has a prologue its unwind info describes, and a NOP after its call so the return address is not an
/// epilogue (the unwind codes are what is exercised).
const OUTER: u32 = 0x1000;
const INNER: u32 = 0x1020;
/// The return addresses: after inner's call of the import, after outer's call of inner.
const RETURN_IN_INNER: u32 = 0x103B;
const RETURN_IN_OUTER: u32 = 0x1009;

fn put(image: &mut [u8], at: usize, bytes: &[u8]) {
    image[at..at + bytes.len()].copy_from_slice(bytes);
}

fn u16le(v: u16) -> [u8; 2] {
    v.to_le_bytes()
}

fn u32le(v: u32) -> [u8; 4] {
    v.to_le_bytes()
}

/// The PE file: headers (0x200), .text at RVA 0x1000 (file 0x200), .rdata at 0x2000 (file 0x400) holding the
/// import directory, the unwind info and .pdata.
fn fixture() -> Vec<u8> {
    let mut f = vec![0u8; 0x600];
    put(&mut f, 0, b"MZ");
    put(&mut f, 0x3C, &u32le(0x40));
    put(&mut f, 0x40, b"PE\0\0");
    // COFF header: AMD64, 2 sections, PE32+ optional header of 240 bytes, EXECUTABLE_IMAGE | LARGE_ADDRESS_AWARE.
    let coff = 0x44;
    put(&mut f, coff, &u16le(0x8664));
    put(&mut f, coff + 2, &u16le(2));
    put(&mut f, coff + 16, &u16le(240));
    put(&mut f, coff + 18, &u16le(0x22));
    let opt = coff + 20;
    put(&mut f, opt, &u16le(0x20B));
    put(&mut f, opt + 16, &u32le(OUTER)); // AddressOfEntryPoint
    put(&mut f, opt + 24, &0x1_4000_0000u64.to_le_bytes()); // ImageBase
    put(&mut f, opt + 32, &u32le(0x1000)); // SectionAlignment
    put(&mut f, opt + 36, &u32le(0x200)); // FileAlignment
    put(&mut f, opt + 48, &u16le(10)); // MajorSubsystemVersion
    put(&mut f, opt + 56, &u32le(0x3000)); // SizeOfImage
    put(&mut f, opt + 60, &u32le(0x200)); // SizeOfHeaders
    put(&mut f, opt + 68, &u16le(1)); // Subsystem: NATIVE
    put(&mut f, opt + 108, &u32le(16)); // NumberOfRvaAndSizes
    let dirs = opt + 112;
    put(&mut f, dirs + 8, &u32le(0x2000)); // import directory
    put(&mut f, dirs + 12, &u32le(40));
    put(&mut f, dirs + 3 * 8, &u32le(0x2090)); // exception directory (.pdata)
    put(&mut f, dirs + 3 * 8 + 4, &u32le(24));
    let sections = opt + 240;
    for (i, (name, rva, raw, characteristics)) in
        [(b".text\0\0\0", 0x1000u32, 0x200u32, 0x6000_0020u32), (b".rdata\0\0", 0x2000, 0x400, 0x4000_0040)]
            .into_iter()
            .enumerate()
    {
        let s = sections + i * 40;
        put(&mut f, s, name);
        put(&mut f, s + 8, &u32le(0x100)); // VirtualSize
        put(&mut f, s + 12, &u32le(rva));
        put(&mut f, s + 16, &u32le(0x200)); // SizeOfRawData
        put(&mut f, s + 20, &u32le(raw));
        put(&mut f, s + 36, &u32le(characteristics));
    }
    let text = |rva: u32| (rva - 0x1000 + 0x200) as usize;
    // outer: sub rsp,0x28; call inner; nop; add rsp,0x28; ret
    let call_inner = (INNER as i32 - (OUTER as i32 + 9)) as u32;
    let mut outer = vec![0x48, 0x83, 0xEC, 0x28, 0xE8];
    outer.extend(u32le(call_inner));
    outer.extend([0x90, 0x48, 0x83, 0xC4, 0x28, 0xC3]);
    put(&mut f, text(OUTER), &outer);
    // inner: push rbx; sub rsp,0x20; mov ecx,0x40; mov edx,0x100; mov r8d,'Test'; call [rip+IAT]; nop;
    // add rsp,0x20; pop rbx; ret
    let mut inner = vec![0x53, 0x48, 0x83, 0xEC, 0x20, 0xB9, 0x40, 0, 0, 0, 0xBA, 0, 1, 0, 0, 0x41, 0xB8];
    inner.extend(b"Test");
    inner.extend([0xFF, 0x15]);
    inner.extend(u32le(0x2038 - RETURN_IN_INNER));
    inner.extend([0x90, 0x48, 0x83, 0xC4, 0x20, 0x5B, 0xC3]);
    put(&mut f, text(INNER), &inner);
    let rdata = |rva: u32| (rva - 0x2000 + 0x400) as usize;
    // Import descriptor: OriginalFirstThunk 0x2028, Name 0x2060, FirstThunk 0x2038; then a zero descriptor.
    put(&mut f, rdata(0x2000), &u32le(0x2028));
    put(&mut f, rdata(0x200C), &u32le(0x2060));
    put(&mut f, rdata(0x2010), &u32le(0x2038));
    put(&mut f, rdata(0x2028), &0x2048u64.to_le_bytes()); // lookup table: hint/name at 0x2048
    put(&mut f, rdata(0x2038), &0x2048u64.to_le_bytes()); // IAT, the same until bound
    put(&mut f, rdata(0x204A), b"ExAllocatePool2\0");
    put(&mut f, rdata(0x2060), b"ntoskrnl.exe\0");
    // UNWIND_INFO, version 1. outer: prolog 4 bytes, one code: at 4, UWOP_ALLOC_SMALL (2) of (4 + 1) * 8 = 0x28.
    put(&mut f, rdata(0x2080), &[0x01, 0x04, 0x01, 0x00, 0x04, 0x42, 0x00, 0x00]);
    // inner: prolog 5 bytes; at 5 UWOP_ALLOC_SMALL 0x20, at 1 UWOP_PUSH_NONVOL (0) RBX (3).
    put(&mut f, rdata(0x2088), &[0x01, 0x05, 0x02, 0x00, 0x05, 0x32, 0x01, 0x30]);
    // .pdata: RUNTIME_FUNCTION (begin, end, unwind info) for each, sorted.
    for (i, (begin, end, info)) in [(OUTER, 0x100F, 0x2080u32), (INNER, 0x1042, 0x2088)].into_iter().enumerate() {
        let at = rdata(0x2090) + i * 12;
        put(&mut f, at, &u32le(begin));
        put(&mut f, at + 4, &u32le(end));
        put(&mut f, at + 8, &u32le(info));
    }
    f
}

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
