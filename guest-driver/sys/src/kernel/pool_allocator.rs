//! The global allocator: vhca.sys's Rust heap (Vec, Box, Arc) is one non-paged pool block with vhca's tag, reserved
//! in DriverEntry and carved up by linked_list_allocator's first-fit heap under a kernel spin lock, so alloc works at
//! IRQL <= DISPATCH_LEVEL; under Special Pool each Rust allocation is its own pool block instead.
//!
//! Why one reserved block and not a pool allocation per Rust allocation: Rust's collections treat a failed
//! allocation as fatal (a panic, here a bugcheck), while Windows fails pool allocations under low memory and Driver
//! Verifier's low resources simulation fails them on purpose (systematic mode: every call stack once). Found by that
//! simulation through the PE loader (docs/loader.md, "Low resources"): 186 of vhca.sys's 201 failure points in
//! low-resources-verbs were Rust allocations, each a bugcheck. With the heap reserved up front, the one allocation
//! Windows can fail is DriverEntry's, which then fails the load with STATUS_INSUFFICIENT_RESOURCES; every allocation
//! the driver can handle failing (rings, buffers, MDLs, S/G lists) is its own kernel call, as before.
//!
//! Why each Rust allocation is its own ExAllocatePool2 block under Special Pool (0x1): inside one 4 MiB block
//! Special Pool guards only the block's ends, so an overrun of a Vec or Box in vhca.sys would run into its heap
//! neighbour unseen; as a pool block of its own each gets its own pages and guard page, and its free its own
//! inaccessible pages. No slab is shared: a slab of small blocks would put several allocations on one page, where
//! Special Pool guards none of them but the last. The reserved heap stays as well, because the Rust paths are not
//! fallible (Vec::push, Box::new, format! abort on a failed allocation, and try_reserve covers only part of them;
//! making every driver path fallible is more than this allocator can promise): a pool block refused (real low
//! memory) is served from the heap instead, so no allocation panics, and under the low resources simulation
//! (0x4, 0x40000) the allocator keeps to the heap alone, as before, so the simulation's failure points stay the
//! driver's own kernel calls and not 186 Rust allocations it cannot handle.

use core::alloc::{GlobalAlloc, Layout};
use core::cell::UnsafeCell;
use core::ffi::c_void;
use core::ptr::NonNull;
use core::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use linked_list_allocator::Heap;
use vhca_ntapi::{pool_tag, POOL_FLAG_NON_PAGED};

use super::kernel_imports::{KeAcquireSpinLockRaiseToDpc, KeReleaseSpinLock};
use windows_sys::Wdk::System::SystemServices::{ExAllocatePool2, ExFreePoolWithTag, MmIsVerifierEnabled};

/// 'vhca' in a pool dump (!poolused, !pool).
pub const POOL_TAG: u32 = pool_tag(b"vhca");
/// The Rust heap's size: the seed scenarios use well under a megabyte of it at their peak; the rest is margin. A
/// Rust allocation it cannot satisfy is a panic (bugcheck 0x20000001), as any exhausted fixed heap.
pub const HEAP_BYTES: usize = 4 << 20;

/// Driver Verifier's flags the choice depends on: Special Pool, and the two low resources simulations.
const SPECIAL_POOL: u32 = 0x1;
const LOW_RESOURCES: u32 = 0x4 | 0x40000;
/// A pool block's alignment on x64 (MEMORY_ALLOCATION_ALIGNMENT); a Rust layout asking for more uses the heap.
const POOL_ALIGNMENT: usize = 16;

/// Each Rust allocation its own pool block (Special Pool on, no low resources simulation); set once in `reserve`.
static PER_ALLOCATION: AtomicBool = AtomicBool::new(false);
/// The heap block's address, so a free can tell heap memory from a pool block of its own.
static HEAP_BASE: AtomicUsize = AtomicUsize::new(0);

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
    HEAP_BASE.store(block as usize, Ordering::Release);
    let mut flags = 0u32;
    // SAFETY: PASSIVE_LEVEL; an out parameter on the stack.
    let verified = unsafe { MmIsVerifierEnabled(&mut flags) } >= 0;
    PER_ALLOCATION.store(verified && flags & SPECIAL_POOL != 0 && flags & LOW_RESOURCES == 0, Ordering::Release);
    true
}

/// Whether `ptr` is inside the reserved heap (else it is a pool block of its own).
fn in_heap(ptr: *mut u8) -> bool {
    let base = HEAP_BASE.load(Ordering::Acquire);
    base != 0 && (ptr as usize).wrapping_sub(base) < HEAP_BYTES
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
        HEAP_BASE.store(0, Ordering::Release);
        core::mem::replace(reserved, core::ptr::null_mut())
    });
    if !block.is_null() {
        // SAFETY: PASSIVE_LEVEL; the block `reserve` took with this tag, freed once (the heap forgot it above).
        unsafe { ExFreePoolWithTag(block.cast::<c_void>(), POOL_TAG) };
    }
}

pub struct PoolAllocator;

// SAFETY: every block comes from the one heap, which hands out each byte once and checks layouts itself, or is a
// pool block of its own, at least 16-byte aligned, whose layout asked no more; null when neither can serve it (and
// before `reserve`).
unsafe impl GlobalAlloc for PoolAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if PER_ALLOCATION.load(Ordering::Acquire) && layout.align() <= POOL_ALIGNMENT {
            // SAFETY: IRQL <= DISPATCH_LEVEL (Rust code in this driver never runs above it); non-paged NX pool with
            // vhca's tag.
            let block = unsafe { ExAllocatePool2(POOL_FLAG_NON_PAGED, layout.size(), POOL_TAG) }.cast::<u8>();
            if !block.is_null() {
                return block;
            }
        }
        HEAP.with(|heap, _| heap.allocate_first_fit(layout).map_or(core::ptr::null_mut(), NonNull::as_ptr))
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if !in_heap(ptr) {
            // SAFETY: IRQL <= DISPATCH_LEVEL; a block `alloc` took from the pool with this tag, freed once
            // (GlobalAlloc's contract).
            unsafe { ExFreePoolWithTag(ptr.cast::<c_void>(), POOL_TAG) };
            return;
        }
        // SAFETY: `ptr` came from `alloc` with this layout (GlobalAlloc's contract), and lies in this heap.
        HEAP.with(|heap, _| unsafe { heap.deallocate(NonNull::new_unchecked(ptr), layout) })
    }
}

#[global_allocator]
static ALLOCATOR: PoolAllocator = PoolAllocator;
