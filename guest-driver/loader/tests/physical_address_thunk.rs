//! MmGetPhysicalAddress through the loader, as vhca.sys's bug variant calls it: the model's frame behind a pool
//! pointer the binary holds, which a device reaches only without DMA remapping. One kernel per process.

mod common;

use std::ffi::c_void;

use common::{routine, NoBus};
use vhca_loader::io_manager::IoManager;
use vhca_loader::kernel_context::{install, kernel, LoaderKernel};
use vhca_ntmodel::{NtModel, NtModelConfig};

const NON_PAGED_POOL: u32 = 0;
const TAG: u32 = u32::from_le_bytes(*b"vhca");

#[test]
fn the_binarys_pool_pointer_has_the_models_frame_which_only_the_identity_domain_maps() {
    let (model, backend) = NtModel::for_tests(NtModelConfig::default());
    assert!(install(LoaderKernel::new(model, IoManager::new(Box::new(NoBus)))));
    let allocate: unsafe extern "win64" fn(u32, usize, u32) -> *mut c_void = routine("ExAllocatePoolWithTag");
    let physical_of: unsafe extern "win64" fn(*mut c_void) -> i64 = routine("MmGetPhysicalAddress");
    // SAFETY: the thunks with their Windows signatures; the pool blocks are live until the test ends.
    let (remapped, identity) = unsafe {
        let p = allocate(NON_PAGED_POOL, 4096, TAG);
        assert!(!p.is_null());
        let remapped = physical_of(p.cast::<u8>().add(0x10).cast()) as u64;
        kernel().model.set_dma_remapping(false);
        let q = allocate(NON_PAGED_POOL, 4096, TAG);
        (remapped, physical_of(q) as u64)
    };
    assert!(remapped >= 1 << 32 && remapped % 4096 == 0x10, "the frame above 4 GiB, the offset kept: {remapped:#x}");
    assert!(backend.device_write(remapped, &[1]).is_err(), "under remapping nothing maps the frame");
    backend.device_write(identity, &[1]).expect("the identity domain maps the frame");
    // SAFETY: as above; a pointer into no block has no frame.
    assert_eq!(unsafe { physical_of(std::ptr::null_mut()) }, 0);
}
