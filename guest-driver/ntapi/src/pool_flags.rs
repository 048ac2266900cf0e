//! ExAllocatePool2's POOL_FLAGS and the POOL_TYPE bits that say which pool a request means, with wdm.h's values
//! (windows-sys's metadata lacks these #defines): one place for the model, the loader and vhca.sys.

/// POOL_FLAGS (https://learn.microsoft.com/windows-hardware/drivers/kernel/pool_flags): the low 32 bits are required
/// flags, "allocation fails if they cannot be satisfied", the high 32 optional ones.
pub const POOL_FLAG_USE_QUOTA: u64 = 0x1;
pub const POOL_FLAG_UNINITIALIZED: u64 = 0x2;
pub const POOL_FLAG_SESSION: u64 = 0x4;
pub const POOL_FLAG_CACHE_ALIGNED: u64 = 0x8;
pub const POOL_FLAG_RESERVED1: u64 = 0x10;
pub const POOL_FLAG_RAISE_ON_FAILURE: u64 = 0x20;
/// "Non paged pool NX".
pub const POOL_FLAG_NON_PAGED: u64 = 0x40;
/// "Non paged pool executable".
pub const POOL_FLAG_NON_PAGED_EXECUTE: u64 = 0x80;
/// Paged pool: "executable on x86, non-executable on all other platforms".
pub const POOL_FLAG_PAGED: u64 = 0x100;
pub const POOL_FLAG_RESERVED2: u64 = 0x200;
pub const POOL_FLAG_RESERVED3: u64 = 0x400;
/// The required flags wdm.h knows (POOL_FLAG_LAST_KNOWN_REQUIRED is POOL_FLAG_RESERVED3): any other required bit is
/// one the pool "does not recognize", so the allocation fails.
pub const POOL_FLAGS_KNOWN_REQUIRED: u64 = 0x7FF;
/// The required half of a POOL_FLAGS value.
pub const POOL_FLAGS_REQUIRED: u64 = 0xFFFF_FFFF;
/// Optional: special pool if it can (ignored where it cannot).
pub const POOL_FLAG_SPECIAL_POOL: u64 = 0x1_0000_0000;

/// POOL_TYPE's raw bits (https://learn.microsoft.com/windows-hardware/drivers/ddi/wdm/ne-wdm-_pool_type): every
/// paged type is odd (PagedPool 1, PagedPoolCacheAligned 5, PagedPoolSession 33), every NX type has 512 set
/// (NonPagedPoolNx 512, NonPagedPoolNxCacheAligned 516, NonPagedPoolSessionNx 544).
pub const POOL_TYPE_PAGED_BIT: u32 = 0x1;
pub const POOL_TYPE_NX_BIT: u32 = 0x200;
