//! QEMU's virtio-rng as a stand-in device: proves VFIO, the transport and the virtqueue work without any backend.
//! One request of 64 writable bytes; the data must arrive, because a completion alone proves nothing:
//! behind intel-iommu with an unmapped IOVA, QEMU's virtio-rng still completes the request with length 64 and writes no data.

use std::time::Duration;

use crate::report::EntropyRead;
use crate::vfio::DmaAccess;
use crate::vfio_dma::DmaRegion;
use crate::vfio_dma::{DmaMapper, DmaMemory};
use crate::virtio_pci::QueueNotifier;
use crate::virtqueue::{Buffer, SplitQueue};

pub const ENTROPY_BYTES: usize = 64;

/// Reads entropy into a zeroed DMA buffer; fails unless the device wrote the full 64 bytes and they are not all
/// zero (the buffer starts zeroed, so all-zero means the DMA never landed). The completion is waited for as the queue
/// was set up: polling, or until its MSI-X message (`vhca.completion=interrupt`, `SplitQueue::wait_by_interrupt`).
pub fn read_entropy(
    queue: &mut SplitQueue<DmaRegion>,
    notifier: &QueueNotifier,
    mapper: &DmaMapper,
    timeout: Duration,
) -> anyhow::Result<EntropyRead> {
    let buffer = mapper.alloc(ENTROPY_BYTES, DmaAccess::READ_WRITE)?;
    buffer.fill(0, ENTROPY_BYTES, 0)?;
    let head = queue.add_chain(&[Buffer { iova: buffer.iova(), len: ENTROPY_BYTES as u32, device_writes: true }])?;
    notifier.notify()?;
    let used = queue.wait_used(timeout)?;
    anyhow::ensure!(used.head == head, "completion for head {}, expected {head}", used.head);
    let mut bytes = [0u8; ENTROPY_BYTES];
    buffer.read_bytes(0, &mut bytes)?;
    let bytes_hex = hex::encode(bytes);
    anyhow::ensure!(
        used.len as usize == ENTROPY_BYTES,
        "device reported {} bytes, asked for {ENTROPY_BYTES}",
        used.len
    );
    anyhow::ensure!(
        bytes.iter().any(|b| *b != 0),
        "completion said {} bytes but the buffer is still all zero: the DMA did not land",
        used.len
    );
    let iova = buffer.iova();
    buffer.unmap()?;
    Ok(EntropyRead { iova, used_len: used.len, bytes_hex })
}

/// The negative control: asks for entropy into an IOVA that was reserved but never mapped. The IOMMU must refuse
/// the write; whatever the completion says is returned for the report, and the caller checks the fault log.
pub fn read_entropy_unmapped(
    queue: &mut SplitQueue<DmaRegion>,
    notifier: &QueueNotifier,
    mapper: &DmaMapper,
    timeout: Duration,
) -> anyhow::Result<EntropyRead> {
    let iova = mapper.reserve_iova(ENTROPY_BYTES)?;
    let head = queue.add_chain(&[Buffer { iova, len: ENTROPY_BYTES as u32, device_writes: true }])?;
    notifier.notify()?;
    let used = queue.wait_used(timeout)?;
    anyhow::ensure!(used.head == head, "completion for head {}, expected {head}", used.head);
    Ok(EntropyRead { iova, used_len: used.len, bytes_hex: String::new() })
}
