//! cl_mutex, the driver's own mutex, as the openib-windows complib had it: one API over a choice of kernel
//! locks. A FAST_MUTEX runs its holder at APC_LEVEL (the seed's bug); a KMUTEX or an ERESOURCE keeps PASSIVE_LEVEL.

use alloc::sync::Arc;

use vhca_ntapi::{NtKernel, PERESOURCE, PFAST_MUTEX, PKMUTEX};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClMutexKind {
    FastMutex,
    KMutex,
    EResource,
}

#[derive(Debug, Clone, Copy)]
enum Lock {
    Fast(PFAST_MUTEX),
    Mutex(PKMUTEX),
    Resource(PERESOURCE),
}

pub struct ClMutex<K: NtKernel> {
    kernel: Arc<K>,
    lock: Lock,
}

impl<K: NtKernel> ClMutex<K> {
    pub fn new(kernel: Arc<K>, kind: ClMutexKind) -> ClMutex<K> {
        let lock = match kind {
            ClMutexKind::FastMutex => Lock::Fast(kernel.ExInitializeFastMutex()),
            ClMutexKind::KMutex => Lock::Mutex(kernel.KeInitializeMutex(0)),
            ClMutexKind::EResource => Lock::Resource(kernel.ExInitializeResourceLite()),
        };
        ClMutex { kernel, lock }
    }

    pub fn kind(&self) -> ClMutexKind {
        match self.lock {
            Lock::Fast(_) => ClMutexKind::FastMutex,
            Lock::Mutex(_) => ClMutexKind::KMutex,
            Lock::Resource(_) => ClMutexKind::EResource,
        }
    }

    pub fn acquire(&self) {
        match self.lock {
            Lock::Fast(m) => self.kernel.ExAcquireFastMutex(m),
            Lock::Mutex(m) => {
                self.kernel.KeWaitForMutexObject(m);
            }
            Lock::Resource(r) => {
                // ERESOURCE must be taken with normal kernel APCs disabled.
                self.kernel.KeEnterCriticalRegion();
                self.kernel.ExAcquireResourceExclusiveLite(r, true);
            }
        }
    }

    pub fn release(&self) {
        match self.lock {
            Lock::Fast(m) => self.kernel.ExReleaseFastMutex(m),
            Lock::Mutex(m) => {
                self.kernel.KeReleaseMutex(m, false);
            }
            Lock::Resource(r) => {
                self.kernel.ExReleaseResourceLite(r);
                self.kernel.KeLeaveCriticalRegion();
            }
        }
    }
}
