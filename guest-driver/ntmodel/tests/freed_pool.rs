//! Freed pool as Windows leaves it: without Special Pool its pages stay mapped where the driver was handed them,
//! holding what was written, while the device's view goes at the free; with Special Pool (0x1) they are held too,
//! but the model's own access is 0xD5 (DRIVER_PAGE_FAULT_IN_FREED_SPECIAL_POOL).

use std::sync::{Arc, Mutex};

use vhca_ntapi::*;
use vhca_ntmodel::{BackendError, Bugcheck, CaptureBugchecks, DmaBackend, HostDmaBackend, HostMemId, NtModel};
use vhca_ntmodel::{NtModelConfig, VerifierFlags};

const POOL_TRACKING: u32 = 0x8;
const SPECIAL_POOL: u32 = 0x1;
const TAG: u32 = pool_tag(b"vhca");

/// Host memory that remembers what it handed out, so a test can look at a block after the model freed it.
#[derive(Default)]
struct Recording {
    host: HostDmaBackend,
    allocated: Mutex<Vec<HostMemId>>,
}

impl DmaBackend for Recording {
    fn alloc(&self, pages: usize) -> Result<HostMemId, BackendError> {
        let mem = self.host.alloc(pages)?;
        self.allocated.lock().unwrap().push(mem);
        Ok(mem)
    }
    fn free(&self, mem: HostMemId) -> Result<(), BackendError> {
        self.host.free(mem)
    }
    fn read(&self, mem: HostMemId, offset: usize, buf: &mut [u8]) -> Result<(), BackendError> {
        self.host.read(mem, offset, buf)
    }
    fn write(&self, mem: HostMemId, offset: usize, buf: &[u8]) -> Result<(), BackendError> {
        self.host.write(mem, offset, buf)
    }
    fn map(&self, mem: HostMemId, first_page: usize, pages: usize) -> Result<u64, BackendError> {
        self.host.map(mem, first_page, pages)
    }
    fn unmap(&self, iova: u64, pages: usize) -> Result<(), BackendError> {
        self.host.unmap(iova, pages)
    }
    fn host_address(&self, mem: HostMemId) -> Option<*mut u8> {
        self.host.host_address(mem)
    }
    fn revoke_device_access(&self, mem: HostMemId) -> Result<(), BackendError> {
        self.host.revoke_device_access(mem)
    }
}

fn machine(flags: u32) -> (NtModel, Arc<Recording>) {
    let backend = Arc::new(Recording::default());
    let config = NtModelConfig { verifier: VerifierFlags(flags), ..NtModelConfig::default() };
    (NtModel::new(config, backend.clone(), Arc::new(CaptureBugchecks)), backend)
}

struct Freed {
    mem: HostMemId,
    host: *mut u8,
    iova: u64,
    va: PVOID,
}

const WRITTEN: &[u8] = b"the driver's state, before its free";

/// Non-paged pool, written, mapped for the device and handed out at a process address, then freed.
fn write_map_and_free(k: &NtModel, backend: &Recording) -> Freed {
    let va = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 64, TAG);
    assert!(!va.is_null());
    k.RtlCopyToVa(va, WRITTEN);
    let mem = *backend.allocated.lock().unwrap().last().expect("the pool's memory");
    let host = k.host_view(va).expect("pool has a process address").host_base as *mut u8;
    assert_eq!(backend.host_address(mem), Some(host));
    let iova = backend.map(mem, 0, 1).expect("a device mapping");
    k.ExFreePoolWithTag(va, TAG);
    Freed { mem, host, iova, va }
}

#[test]
fn freed_pool_still_reads_what_was_written_through_its_process_address_without_special_pool() {
    let (k, backend) = machine(POOL_TRACKING);
    let freed = write_map_and_free(&k, &backend);
    assert_eq!(backend.host_address(freed.mem), Some(freed.host), "the block stays where the driver had it");
    let mut stale = [0u8; WRITTEN.len()];
    for (i, byte) in stale.iter_mut().enumerate() {
        // SAFETY: the backend still holds this block at this address (asserted above); its Vec never moves.
        *byte = unsafe { freed.host.add(i).read_volatile() };
    }
    assert_eq!(&stale, WRITTEN);
    assert_eq!(k.freed_pool_held(), PAGE_SIZE, "one page held");
    let mut buf = [0u8; 8];
    assert!(
        matches!(backend.host.device_read(freed.iova, &mut buf), Err(BackendError::NotMapped { .. })),
        "the device's view went at the free"
    );
    // The model's own books forget the block as before: its model address is gone, a second free is 0xC4/0x13.
    assert_eq!(k.host_view(freed.va), None);
    let second = NtModel::run_guarded(|| k.ExFreePoolWithTag(freed.va, TAG)).expect_err("a double free");
    assert_eq!(second, Bugcheck::c4(0x13, 0, freed.va.0, 0));
    drop(k);
    assert_eq!(backend.host_address(freed.mem), None, "the model gave it back when it went away");
}

#[test]
fn freed_special_pool_is_held_off_the_device_and_the_models_own_read_of_it_is_0xd5() {
    let (k, backend) = machine(SPECIAL_POOL | POOL_TRACKING);
    let freed = write_map_and_free(&k, &backend);
    // Held, so its process addresses are not reused while a driver binary may still touch them (the loader makes
    // them inaccessible through `with_freed_special_pool`).
    assert!(backend.host_address(freed.mem).is_some());
    let mut protected = None;
    assert!(k.with_freed_special_pool(freed.va, |view| protected = Some(view)));
    assert_eq!(protected.map(|v| (v.host_base, v.bytes)), Some((freed.host as usize, 2 * PAGE_SIZE)));
    let mut buf = [0u8; 8];
    assert!(backend.host.device_read(freed.iova, &mut buf).is_err(), "the device's view went at the free");
    let late = NtModel::run_guarded(|| k.RtlCopyFromVa(&mut buf, freed.va)).expect_err("a read of freed pool");
    assert_eq!(late, Bugcheck::new(0xD5, freed.va.0, 0, 0, 0));
}

#[test]
fn a_backend_that_cannot_keep_cpu_only_memory_frees_at_once() {
    /// The trait's default `revoke_device_access`: the model must not keep a block the device may still reach.
    #[derive(Default)]
    struct NoRevoke(Recording);
    impl DmaBackend for NoRevoke {
        fn alloc(&self, pages: usize) -> Result<HostMemId, BackendError> {
            self.0.alloc(pages)
        }
        fn free(&self, mem: HostMemId) -> Result<(), BackendError> {
            self.0.free(mem)
        }
        fn read(&self, mem: HostMemId, offset: usize, buf: &mut [u8]) -> Result<(), BackendError> {
            self.0.read(mem, offset, buf)
        }
        fn write(&self, mem: HostMemId, offset: usize, buf: &[u8]) -> Result<(), BackendError> {
            self.0.write(mem, offset, buf)
        }
        fn map(&self, mem: HostMemId, first_page: usize, pages: usize) -> Result<u64, BackendError> {
            self.0.map(mem, first_page, pages)
        }
        fn unmap(&self, iova: u64, pages: usize) -> Result<(), BackendError> {
            self.0.unmap(iova, pages)
        }
    }
    let backend = Arc::new(NoRevoke::default());
    let config = NtModelConfig { verifier: VerifierFlags(POOL_TRACKING), ..NtModelConfig::default() };
    let k = NtModel::new(config, backend.clone(), Arc::new(CaptureBugchecks));
    let va = k.ExAllocatePoolWithTag(POOL_TYPE::NonPagedPool, 64, TAG);
    k.ExFreePoolWithTag(va, TAG);
    assert_eq!(backend.0.host.allocated_pages(), 0);
    assert_eq!(k.freed_pool_held(), 0);
}
