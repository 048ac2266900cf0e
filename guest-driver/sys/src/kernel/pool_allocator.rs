//! The global allocator: vhca.sys's Rust heap (Vec, Box, Arc) is one non-paged pool block with vhca's tag, reserved
//! in DriverEntry and carved up by linked_list_allocator's first-fit heap under a kernel spin lock, so alloc works at
//! IRQL <= DISPATCH_LEVEL.
//!
//! Why one reserved block and not a pool allocation per Rust allocation: Rust's collections treat a failed
//! allocation as fatal (a panic, here a bugcheck), while Windows fails pool allocations under low memory and Driver
//! Verifier's low resources simulation fails them on purpose (systematic mode: every call stack once). Found by that
//! simulation through the PE loader (docs/loader.md, "Low resources"): 186 of vhca.sys's 201 failure points in
//! low-resources-verbs were Rust allocations, each a bugcheck. With the heap reserved up front, the one allocation
//! Windows can fail is DriverEntry's, which then fails the load with STATUS_INSUFFICIENT_RESOURCES; every allocation
//! the driver can handle failing (rings, buffers, MDLs, S/G lists) is its own kernel call, as before.

use core::alloc::{GlobalAlloc, Layout};
use core::cell::UnsafeCell;
use core::ffi::c_void;
use core::ptr::NonNull;

use linked_list_allocator::Heap;
use vhca_ntapi::{pool_tag, POOL_FLAG_NON_PAGED};

use super::kernel_imports::{KeAcquireSpinLockRaiseToDpc, KeReleaseSpinLock};
use windows_sys::Wdk::System::SystemServices::{ExAllocatePool2, ExFreePoolWithTag};

/// 'vhca' in a pool dump (!poolused, !pool).
pub const POOL_TAG: u32 = pool_tag(b"vhca");
/// The Rust heap's size: the seed scenarios use well under a megabyte of it at their peak; the rest is margin. A
/// Rust allocation it cannot satisfy is a panic (bugcheck 0x20000001), as any exhausted fixed heap.
pub const HEAP_BYTES: usize = 4 << 20;

/// The heap and the KSPIN_LOCK that guards it (KeAcquireSpinLockRaiseToDpc: a holder is never preempted by a DPC
/// on its processor that allocates too).
struct DriverHeap {
    lock: UnsafeCell<usize>,
    heap: UnsafeCell<Heap>,
    /// The pool block behind the heap; null before DriverEntry reserved it and after DriverUnload freed it.
    block: UnsafeCell<*mut u8>,
}

// SAFETY: `heap` and `block` are touched only under `lock`, a kernel spin lock.
unsafe impl Sync for DriverHeap {}

static HEAP: DriverHeap = DriverHeap {
    lock: UnsafeCell::new(0),
    heap: UnsafeCell::new(Heap::empty()),
    block: UnsafeCell::new(core::ptr::null_mut()),
};

impl DriverHeap {
    /// Runs `f` on the heap with the spin lock held (DISPATCH_LEVEL).
    fn with<T>(&self, f: impl FnOnce(&mut Heap, &mut *mut u8) -> T) -> T {
        // SAFETY: IRQL <= DISPATCH_LEVEL (Rust code in this driver never runs above it); a KSPIN_LOCK in static
        // memory, released below with the IRQL it returned.
        let old = unsafe { KeAcquireSpinLockRaiseToDpc(self.lock.get()) };
        // SAFETY: the lock is held: nobody else has either cell.
        let r = unsafe { f(&mut *self.heap.get(), &mut *self.block.get()) };
        // SAFETY: taken above.
        unsafe { KeReleaseSpinLock(self.lock.get(), old) };
        r
    }
}

/// Reserves the Rust heap; DriverEntry's first act, PASSIVE_LEVEL. False when the pool refused it (DriverEntry then
/// fails with STATUS_INSUFFICIENT_RESOURCES, before anything of the driver allocates).
pub fn reserve() -> bool {
    // SAFETY: PASSIVE_LEVEL, non-paged NX pool with vhca's tag (data only: memory integrity's rule).
    let block = unsafe { ExAllocatePool2(POOL_FLAG_NON_PAGED, HEAP_BYTES, POOL_TAG) }.cast::<u8>();
    if block.is_null() {
        return false;
    }
    HEAP.with(|heap, reserved| {
        // SAFETY: a fresh pool block of HEAP_BYTES, owned by the heap from now on.
        unsafe { heap.init(block, HEAP_BYTES) };
        *reserved = block;
    });
    true
}

/// Gives the heap's block back to the pool; DriverUnload's last act. A heap with allocations still in it is left
/// alone: a leak stays a pool block Driver Verifier's pool tracking names at unload (0xC4/0x60), as it was when
/// each Rust allocation was its own.
pub fn release() {
    let block = HEAP.with(|heap, reserved| {
        if heap.used() != 0 || reserved.is_null() {
            return core::ptr::null_mut();
        }
        *heap = Heap::empty();
        core::mem::replace(reserved, core::ptr::null_mut())
    });
    if !block.is_null() {
        // SAFETY: PASSIVE_LEVEL; the block `reserve` took with this tag, freed once (the heap forgot it above).
        unsafe { ExFreePoolWithTag(block.cast::<c_void>(), POOL_TAG) };
    }
}

pub struct PoolAllocator;

// SAFETY: every block comes from the one heap, which hands out each byte once and checks layouts itself; it
// returns null when it cannot satisfy a request (and before `reserve`).
unsafe impl GlobalAlloc for PoolAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        HEAP.with(|heap, _| heap.allocate_first_fit(layout).map_or(core::ptr::null_mut(), NonNull::as_ptr))
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `alloc` with this layout (GlobalAlloc's contract), so from this heap.
        HEAP.with(|heap, _| unsafe { heap.deallocate(NonNull::new_unchecked(ptr), layout) })
    }
}

#[global_allocator]
static ALLOCATOR: PoolAllocator = PoolAllocator;
