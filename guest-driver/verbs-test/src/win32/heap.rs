//! The program's Rust heap: the process heap (HeapAlloc), which aligns every block to MEMORY_ALLOCATION_ALIGNMENT
//! (16 on x64). Hand-written: no crate provides a GlobalAlloc over HeapAlloc for a program without std.

use core::alloc::{GlobalAlloc, Layout};
use core::ffi::c_void;

use windows_sys::Win32::System::Memory::{GetProcessHeap, HeapAlloc, HeapFree, HEAP_ZERO_MEMORY};

/// What the process heap guarantees (MEMORY_ALLOCATION_ALIGNMENT on x64).
const HEAP_ALIGNMENT: usize = 16;

struct ProcessHeap;

// SAFETY: HeapAlloc returns a block of at least `size` bytes aligned to 16 or NULL; a layout asking for more
// alignment gets NULL (an allocation failure), never a misaligned block. HeapFree takes back exactly what
// HeapAlloc gave. The process heap is serialised by Windows.
unsafe impl GlobalAlloc for ProcessHeap {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        self.allocate(layout, 0)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        self.allocate(layout, HEAP_ZERO_MEMORY)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: `ptr` came from HeapAlloc on the same heap (this allocator's contract).
        unsafe { HeapFree(GetProcessHeap(), 0, ptr as *const c_void) };
    }
}

impl ProcessHeap {
    fn allocate(&self, layout: Layout, flags: u32) -> *mut u8 {
        if layout.align() > HEAP_ALIGNMENT {
            return core::ptr::null_mut();
        }
        // SAFETY: the process heap exists for the process's life; a non-zero size is not required by HeapAlloc.
        unsafe { HeapAlloc(GetProcessHeap(), flags, layout.size()) as *mut u8 }
    }
}

#[global_allocator]
static HEAP: ProcessHeap = ProcessHeap;
