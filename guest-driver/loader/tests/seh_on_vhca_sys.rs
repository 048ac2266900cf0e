//! The real thing: vhca.sys's clang-built probe wrapper (guest-driver/sys/c/probe.c) loaded by the loader. Its
//! .xdata reads as clang wrote it (a frame-pointer prolog, __C_specific_handler, one scope taking every exception),
//! and called through the Windows ABI it returns MmProbeAndLockPages' raised STATUS_ACCESS_VIOLATION (a user-mode
//! probe of kernel pool) from its __except, and STATUS_SUCCESS with the pages locked for a kernel-mode one.
//! Without the package this test fails under CI=true (the test command builds it first) and skips otherwise.

mod common;

use std::ffi::c_void;
use std::sync::Arc;

use common::vhca_sys_package::{package_dir, vhca_sys};
use common::{routine, NoBus};
use vhca_loader::driver_symbols::DriverSymbols;
use vhca_loader::io_manager::IoManager;
use vhca_loader::kernel_context::{install, LoaderKernel};
use vhca_loader::nt_thunks::NtThunks;
use vhca_loader::seh::c_specific_handler::{actions, ScopeAction, ScopeRecord};
use vhca_loader::seh::unwind_info::{RuntimeFunction, UnwindInfo, UnwindOp, UNW_FLAG_EHANDLER, UNW_FLAG_UHANDLER};
use vhca_ntmodel::{NtModel, NtModelConfig};

const STATUS_ACCESS_VIOLATION: i32 = 0xC000_0005_u32 as i32;
const POOL_FLAG_NON_PAGED: u64 = 0x40;
const MDL_PAGES_LOCKED: i16 = 0x2;

#[test]
fn vhca_sys_probe_wrapper_takes_the_raised_status_in_its_except() {
    let dir = package_dir();
    let Some(bytes) = vhca_sys() else { return };
    let (model, _backend) = NtModel::for_tests(NtModelConfig::default());
    let model: Arc<NtModel> = model;
    assert!(install(LoaderKernel::new(model, IoManager::new(Box::new(NoBus)))));
    let image = vhca_loader::load(&bytes, &NtThunks).expect("vhca.sys loads");
    vhca_loader::driver_stack::register(&image, "vhca.sys");
    let symbols = DriverSymbols::load(&dir.join("vhca.pdb"), image.image.entry_rva);
    let wrapper = symbols.rva_of(|name| name == "vhca_probe_and_lock_pages").expect("the wrapper is in vhca.pdb");

    // Its unwind data, as the dispatch reads it from the mapped image.
    let (pdata_rva, pdata_size) = image.image.exception_directory.expect(".pdata");
    // SAFETY: the mapped image's .pdata and .xdata (read-only sections, mapped for the image's life).
    let at = |rva: u32, len: usize| unsafe { std::slice::from_raw_parts(image.at(rva) as *const u8, len) };
    let function = RuntimeFunction::lookup(at(pdata_rva, pdata_size as usize), wrapper).expect("an entry");
    assert_eq!(function.begin, wrapper);
    let info = UnwindInfo::parse_at(at(function.unwind_info, 64), function.unwind_info).expect("clang's UNWIND_INFO");
    assert_eq!(info.flags, UNW_FLAG_EHANDLER | UNW_FLAG_UHANDLER);
    assert_eq!((info.frame_register, info.frame_offset), (5, 2), "rbp = rsp + 0x20");
    let ops: Vec<UnwindOp> = info.ops.iter().map(|(_, op)| *op).collect();
    assert_eq!(ops, [UnwindOp::SetFramePointer, UnwindOp::Alloc(32), UnwindOp::PushNonvolatile(5)]);
    let (_, data) = info.handler.expect("a language handler");
    let words = |rva: u32, n: usize| -> Vec<u32> {
        at(rva, 4 * n).chunks_exact(4).map(|w| u32::from_le_bytes(w.try_into().unwrap())).collect()
    };
    assert_eq!(words(data, 1), [1], "one __try");
    let s = words(data + 4, 4);
    let scope = ScopeRecord { begin: s[0], end: s[1], handler: s[2], jump_target: s[3] };
    assert_eq!(scope.handler, 1, "EXCEPTION_EXECUTE_HANDLER");
    // The call's return address is inside the __try (clang ends the range one past it): a search takes it, and the
    // unwind to it stops at its own __except.
    assert_eq!(actions(&[scope], 0, scope.end - 1, false, None), [ScopeAction::Filter(0)]);
    assert_eq!(actions(&[scope], 0, scope.end - 1, true, Some(scope.jump_target)), [ScopeAction::Stop]);

    type Pool2 = unsafe extern "win64" fn(u64, usize, u32) -> *mut c_void;
    type AllocateMdl = unsafe extern "win64" fn(*mut c_void, u32, u8, u8, *mut c_void) -> *mut i16;
    type Probe = unsafe extern "win64" fn(*mut i16, i8, i32) -> i32;
    type Mdl = unsafe extern "win64" fn(*mut i16);
    type FreePool = unsafe extern "win64" fn(*mut c_void, u32);
    let (pool2, allocate_mdl): (Pool2, AllocateMdl) = (routine("ExAllocatePool2"), routine("IoAllocateMdl"));
    let (unlock, free_mdl, free_pool): (Mdl, Mdl, FreePool) =
        (routine("MmUnlockPages"), routine("IoFreeMdl"), routine("ExFreePoolWithTag"));
    // SAFETY: the wrapper's C signature, (PMDL, KPROCESSOR_MODE, LOCK_OPERATION) -> NTSTATUS, x64 convention.
    let probe = unsafe { std::mem::transmute::<usize, Probe>(image.at(wrapper)) };
    let tag = u32::from_le_bytes(*b"SehT");
    // SAFETY (the calls): the bound thunks and the image's wrapper, with the arguments their Windows signatures take.
    unsafe {
        let pool = pool2(POOL_FLAG_NON_PAGED, 4096, tag);
        assert!(!pool.is_null());
        let mdl = allocate_mdl(pool, 4096, 0, 0, std::ptr::null_mut());
        assert!(!mdl.is_null());
        // MDL.MdlFlags is at offset 10 (Next 8, Size 2).
        let flags = || mdl.cast::<u8>().add(10).cast::<i16>().read();
        assert_eq!(probe(mdl, 1, 0), STATUS_ACCESS_VIOLATION, "a user-mode probe of kernel pool raises, caught");
        assert_eq!(flags() & MDL_PAGES_LOCKED, 0);
        assert_eq!(probe(mdl, 0, 0), 0, "a kernel-mode probe of its own pool locks");
        assert_ne!(flags() & MDL_PAGES_LOCKED, 0);
        unlock(mdl);
        free_mdl(mdl);
        free_pool(pool, tag);
    }
}
