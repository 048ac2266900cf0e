//! Which pool a driver asked for, as the two ways of asking (ExAllocatePoolWithTag's POOL_TYPE, ExAllocatePool2's
//! POOL_FLAGS) say it: paged or not, executable or not, and the pool type Driver Verifier names in its parameters.

use vhca_ntapi::*;

/// Parameter 1 of 0xC4 for Code integrity checks' executable pool: "The caller specified an executable pool type.
/// (Expected: NonPagedPoolNx)", P2 the address in the driver's code, P3 the pool type, P4 the pool tag
/// (https://learn.microsoft.com/windows-hardware/drivers/devtest/code-integrity-checking).
pub const C4_EXECUTABLE_POOL: u64 = 0x2000;

/// One allocation request's pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolRequest {
    /// The POOL_TYPE value, as verifier parameters carry it (an ExAllocatePool2 request: the type its flags mean).
    pub pool_type: u32,
    pub paged: bool,
    /// Instruction execution enabled in the memory: NonPagedPool (= NonPagedPoolExecute) and
    /// POOL_FLAG_NON_PAGED_EXECUTE. Paged pool is not (the model is x64, where only x86 makes it executable).
    pub executable: bool,
}

impl PoolRequest {
    /// An ExAllocatePoolWithTag POOL_TYPE value, by its bits (the odd types are paged, 512 is NX), so the types
    /// the enumeration reserves (cache-aligned, session) still land in the right pool.
    pub fn from_pool_type(pool_type: u32) -> PoolRequest {
        let paged = pool_type & POOL_TYPE_PAGED_BIT != 0;
        PoolRequest { pool_type, paged, executable: !paged && pool_type & POOL_TYPE_NX_BIT == 0 }
    }

    /// An ExAllocatePool2 POOL_FLAGS value; None where ExAllocatePool2 returns NULL for "invalid POOL_FLAGS"
    /// (https://learn.microsoft.com/windows-hardware/drivers/ddi/wdm/nf-wdm-exallocatepool2). Microsoft does not
    /// list which values are invalid; the model takes two: a required flag the pool does not recognize (the
    /// POOL_FLAGS page: the allocation fails), and not exactly one of the three pool flags (non-paged, non-paged
    /// executable, paged), since a block lives in one pool.
    pub fn from_pool_flags(flags: u64) -> Option<PoolRequest> {
        if flags & POOL_FLAGS_REQUIRED & !POOL_FLAGS_KNOWN_REQUIRED != 0 {
            return None;
        }
        let pools = flags & (POOL_FLAG_NON_PAGED | POOL_FLAG_NON_PAGED_EXECUTE | POOL_FLAG_PAGED);
        let pool_type = match pools {
            POOL_FLAG_NON_PAGED => POOL_TYPE::NonPagedPoolNx,
            POOL_FLAG_NON_PAGED_EXECUTE => POOL_TYPE::NonPagedPool,
            POOL_FLAG_PAGED => POOL_TYPE::PagedPool,
            _ => return None,
        };
        Some(PoolRequest::from(pool_type))
    }
}

impl From<POOL_TYPE> for PoolRequest {
    fn from(pool_type: POOL_TYPE) -> PoolRequest {
        PoolRequest::from_pool_type(pool_type as u32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pool_types_and_flags_say_which_pool_and_whether_it_executes() {
        let of = |t: u32| {
            let r = PoolRequest::from_pool_type(t);
            (r.paged, r.executable)
        };
        assert_eq!(of(0), (false, true), "NonPagedPool = NonPagedPoolExecute");
        assert_eq!(of(1), (true, false), "PagedPool");
        assert_eq!(of(512), (false, false), "NonPagedPoolNx");
        assert_eq!(of(516), (false, false), "NonPagedPoolNxCacheAligned");
        assert_eq!(of(4), (false, true), "NonPagedPoolCacheAligned");
        assert_eq!(of(33), (true, false), "PagedPoolSession");

        let flags = |f: u64| PoolRequest::from_pool_flags(f).map(|r| (r.pool_type, r.paged, r.executable));
        assert_eq!(flags(POOL_FLAG_NON_PAGED), Some((512, false, false)));
        assert_eq!(flags(POOL_FLAG_NON_PAGED_EXECUTE), Some((0, false, true)));
        assert_eq!(flags(POOL_FLAG_PAGED | POOL_FLAG_UNINITIALIZED), Some((1, true, false)));
        assert_eq!(flags(POOL_FLAG_NON_PAGED | POOL_FLAG_SPECIAL_POOL), Some((512, false, false)), "optional flag");
        assert_eq!(flags(0), None, "no pool");
        assert_eq!(flags(POOL_FLAG_NON_PAGED | POOL_FLAG_PAGED), None, "two pools");
        assert_eq!(flags(POOL_FLAG_NON_PAGED | 0x800), None, "a required flag wdm.h does not know");
    }
}
