//! Ring memory for CQs and work queues: one contiguous piece first, then smaller pieces down to single pages
//! (the seed's algorithm), as common buffers or as contiguous memory mapped with MapTransfer.

use alloc::boxed::Box;
use alloc::sync::Arc;
use alloc::vec::Vec;

use vhca_ntapi::*;

use crate::dma_delivery::Delivery;
use crate::error::DriverError;

/// Where ring pages come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RingMemory {
    /// AllocateCommonBuffer: device and CPU share the pages; PASSIVE_LEVEL only.
    CommonBuffer,
    /// MmAllocateContiguousMemorySpecifyCache + MDL + AllocateAdapterChannel + MapTransfer: the seed's
    /// DISPATCH_LEVEL-capable alternative; costs map registers and is double-buffered under DMA checking.
    ContiguousMapTransfer,
}

#[derive(Debug, Clone, Copy)]
enum Backing {
    Common { bytes: u32 },
    Mapped { mdl: PMDL, base: MAP_REGISTER_BASE, registers: u32, bytes: u32 },
}

#[derive(Debug, Clone, Copy)]
struct Piece {
    va: PVOID,
    logical: u64,
    pages: u32,
    backing: Backing,
}

/// A ring's pages: CPU addresses for the driver, device addresses for the command's page list.
#[derive(Debug, Clone)]
pub(crate) struct Ring {
    pieces: Vec<Piece>,
    pages: u32,
}

impl Ring {
    /// Allocates `pages` pages, trying piece sizes pages, pages/2, ... 1 until every piece fits (with `fallback`;
    /// without it one contiguous attempt only).
    pub fn allocate<K: NtKernel + 'static>(
        kernel: &Arc<K>,
        adapter: PDMA_ADAPTER,
        device: PDEVICE_OBJECT,
        memory: RingMemory,
        pages: u32,
        fallback: bool,
    ) -> Result<Ring, DriverError> {
        if pages == 0 {
            return Err(DriverError::InvalidParameter("ring of zero pages"));
        }
        let mut piece_pages = pages;
        loop {
            match Self::allocate_pieces(kernel, adapter, device, memory, pages, piece_pages) {
                Ok(ring) => return Ok(ring),
                // Physically contiguous memory is scarce: retry with pieces half as long, down to single pages.
                Err(DriverError::NoMemory { .. }) if fallback && piece_pages > 1 => {
                    piece_pages = piece_pages.div_ceil(2)
                }
                Err(e) => return Err(e),
            }
        }
    }

    fn allocate_pieces<K: NtKernel + 'static>(
        kernel: &Arc<K>,
        adapter: PDMA_ADAPTER,
        device: PDEVICE_OBJECT,
        memory: RingMemory,
        pages: u32,
        piece_pages: u32,
    ) -> Result<Ring, DriverError> {
        let mut ring = Ring { pieces: Vec::new(), pages: 0 };
        while ring.pages < pages {
            let n = piece_pages.min(pages - ring.pages);
            let piece = match memory {
                RingMemory::CommonBuffer => common_piece(&**kernel, adapter, n),
                RingMemory::ContiguousMapTransfer => mapped_piece(kernel, adapter, device, n),
            };
            match piece {
                Ok(p) => {
                    ring.pieces.push(p);
                    ring.pages += n;
                }
                Err(e) => {
                    ring.free(&**kernel, adapter);
                    return Err(e);
                }
            }
        }
        Ok(ring)
    }

    /// Device address of every page, in ring order: the page list CREATE_CQ / CREATE_QP take.
    pub fn page_list(&self) -> Vec<u64> {
        self.pieces.iter().flat_map(|p| (0..p.pages as u64).map(move |i| p.logical + i * PAGE_SIZE)).collect()
    }

    /// Pages in each piece, in order (shows whether the contiguous attempt or a fallback won).
    pub fn piece_pages(&self) -> Vec<u32> {
        self.pieces.iter().map(|p| p.pages).collect()
    }

    pub fn pages(&self) -> u32 {
        self.pages
    }

    /// CPU address of byte `offset` of the ring; None past its end.
    pub fn va(&self, offset: u64) -> Option<PVOID> {
        let mut left = offset;
        for p in &self.pieces {
            let size = p.pages as u64 * PAGE_SIZE;
            if left < size {
                return p.va.offset(left);
            }
            left -= size;
        }
        None
    }

    /// Frees every piece (the device must no longer use the ring).
    pub fn free<K: NtKernel>(&mut self, kernel: &K, adapter: PDMA_ADAPTER) {
        for p in self.pieces.drain(..) {
            match p.backing {
                Backing::Common { bytes } => {
                    kernel.FreeCommonBuffer(adapter, bytes, PHYSICAL_ADDRESS(p.logical), p.va, true);
                }
                Backing::Mapped { mdl, base, registers, bytes } => {
                    let old = kernel.KeRaiseIrql(DISPATCH_LEVEL);
                    kernel.FlushAdapterBuffers(adapter, mdl, base, p.va, bytes, false);
                    kernel.FreeMapRegisters(adapter, base, registers);
                    kernel.KeLowerIrql(old);
                    kernel.IoFreeMdl(mdl);
                    kernel.MmFreeContiguousMemory(p.va);
                }
            }
        }
        self.pages = 0;
    }
}

fn common_piece<K: NtKernel>(kernel: &K, adapter: PDMA_ADAPTER, pages: u32) -> Result<Piece, DriverError> {
    let bytes = pages * PAGE_SIZE as u32;
    let mut logical = PHYSICAL_ADDRESS(0);
    let va = kernel.AllocateCommonBuffer(adapter, bytes, &mut logical, true);
    if va.is_null() {
        return Err(DriverError::NoMemory { routine: "AllocateCommonBuffer", bytes: bytes as u64 });
    }
    kernel.RtlCopyToVa(va, &alloc::vec![0u8; bytes as usize]);
    Ok(Piece { va, logical: logical.0, pages, backing: Backing::Common { bytes } })
}

/// The seed's DISPATCH_LEVEL recipe: contiguous memory, an MDL for it, then AllocateAdapterChannel at DISPATCH_LEVEL
/// whose AdapterControl routine maps the piece with MapTransfer and keeps the map registers. A routine Windows queues
/// (registers short) is given up: when it runs later it takes nothing and lets the registers go.
fn mapped_piece<K: NtKernel + 'static>(
    kernel: &Arc<K>,
    adapter: PDMA_ADAPTER,
    device: PDEVICE_OBJECT,
    pages: u32,
) -> Result<Piece, DriverError> {
    let bytes = pages * PAGE_SIZE as u32;
    let any = PHYSICAL_ADDRESS(0);
    let max = PHYSICAL_ADDRESS(u64::MAX);
    let va =
        kernel.MmAllocateContiguousMemorySpecifyCache(bytes as usize, any, max, any, MEMORY_CACHING_TYPE::MmCached);
    if va.is_null() {
        return Err(DriverError::NoMemory { routine: "MmAllocateContiguousMemorySpecifyCache", bytes: bytes as u64 });
    }
    kernel.RtlCopyToVa(va, &alloc::vec![0u8; bytes as usize]);
    let mdl = kernel.IoAllocateMdl(va, bytes, false, false);
    if mdl.is_null() {
        kernel.MmFreeContiguousMemory(va);
        return Err(DriverError::NoMemory { routine: "IoAllocateMdl", bytes: bytes as u64 });
    }
    kernel.MmBuildMdlForNonPagedPool(mdl);
    let delivery: Arc<Delivery<_>> = Arc::new(Delivery::new());
    let routine: PDRIVER_CONTROL = {
        let (delivery, kernel) = (delivery.clone(), kernel.clone());
        Box::new(move |_device, base| {
            if delivery.abandoned() {
                return IO_ALLOCATION_ACTION::DeallocateObject;
            }
            let mut length = bytes;
            let mapped = kernel.MapTransfer(adapter, mdl, base, va, &mut length, false);
            match (delivery.deliver((base, mapped)), mapped) {
                (Ok(()), Ok(_)) => IO_ALLOCATION_ACTION::DeallocateObjectKeepRegisters,
                (Ok(()), Err(_)) => IO_ALLOCATION_ACTION::DeallocateObject,
                (Err(_), Ok(_)) => {
                    kernel.FlushAdapterBuffers(adapter, mdl, base, va, bytes, false);
                    IO_ALLOCATION_ACTION::DeallocateObject
                }
                (Err(_), Err(_)) => IO_ALLOCATION_ACTION::DeallocateObject,
            }
        })
    };
    let old = kernel.KeRaiseIrql(DISPATCH_LEVEL);
    let status = kernel.AllocateAdapterChannel(adapter, device, pages, routine);
    kernel.KeLowerIrql(old);
    let result = match (status.is_success(), delivery.take()) {
        (false, _) => Err(DriverError::Kernel { routine: "AllocateAdapterChannel", status }),
        (true, None) => Err(DriverError::DmaQueued { routine: "AllocateAdapterChannel" }),
        (true, Some((_, Err(status)))) => Err(DriverError::Kernel { routine: "MapTransfer", status: *status }),
        (true, Some((base, Ok(logical)))) => Ok(Piece {
            va,
            logical: logical.0,
            pages,
            backing: Backing::Mapped { mdl, base: *base, registers: pages, bytes },
        }),
    };
    if result.is_err() {
        kernel.IoFreeMdl(mdl);
        kernel.MmFreeContiguousMemory(va);
    }
    result
}
