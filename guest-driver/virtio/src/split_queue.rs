//! Driver side of a virtio split virtqueue: descriptor table, avail ring and used ring in DMA memory.
//! Publishes buffer chains and collects completions; knows nothing of PCI (the caller notifies the device).

use alloc::vec;
use alloc::vec::Vec;
use core::sync::atomic::{fence, AtomicU16, Ordering};
use core::time::Duration;

use crate::constants::{AVAIL_F_NO_INTERRUPT, DESC_F_NEXT, DESC_F_WRITE, USED_F_NO_NOTIFY};
use crate::dma_memory::DmaMemory;
use crate::poll_wait::PollWait;

const DESC_SIZE: usize = 16;
/// Largest split queue the spec allows.
pub const MAX_QUEUE_SIZE: u16 = 32768;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QueueError {
    #[error("queue size {0} is not a power of two in 1..=32768")]
    BadSize(u16),
    #[error(
        "ring memory of {have} bytes at host {host:#x}, iova {iova:#x} is too small or misaligned for {need} bytes"
    )]
    BadMemory { have: usize, need: usize, host: usize, iova: u64 },
    #[error("a chain needs at least one buffer")]
    EmptyChain,
    #[error("{wanted} descriptors wanted, {free} free")]
    Full { wanted: usize, free: usize },
    #[error("buffer {0} is device-readable after a device-writable one; the spec puts readable buffers first")]
    ReadableAfterWritable(usize),
    #[error("device published used index {used_idx} while {outstanding} chains were outstanding (last seen {last})")]
    UsedIndexJump { used_idx: u16, last: u16, outstanding: usize },
    #[error("device returned head {0}, which is not an outstanding chain")]
    BadUsedId(u32),
    #[error("no completion within {0:?}")]
    Timeout(Duration),
}

/// One buffer of a chain, in the device's address space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buffer {
    pub iova: u64,
    pub len: u32,
    pub device_writes: bool,
}

/// A completion: which chain, and how many bytes the device says it wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Used {
    pub head: u16,
    pub len: u32,
}

/// Where the three parts sit inside the queue's memory (offsets), with the spec's alignments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingLayout {
    pub size: u16,
    pub desc: usize,
    pub avail: usize,
    pub used: usize,
    pub bytes: usize,
}

impl RingLayout {
    pub fn new(size: u16) -> Result<RingLayout, QueueError> {
        if size == 0 || size > MAX_QUEUE_SIZE || !size.is_power_of_two() {
            return Err(QueueError::BadSize(size));
        }
        let n = size as usize;
        let avail = DESC_SIZE * n;
        // flags, idx, ring[n], used_event: 2 + 2 + 2n + 2; the used ring wants 4-byte alignment.
        let used = (avail + 6 + 2 * n + 3) & !3;
        // flags, idx, ring[n] of {id: u32, len: u32}, avail_event.
        let bytes = used + 6 + 8 * n;
        Ok(RingLayout { size, desc: 0, avail, used, bytes })
    }
}

/// A split virtqueue over memory `M` the device reaches by IOVA.
pub struct SplitQueue<M: DmaMemory> {
    mem: M,
    layout: RingLayout,
    /// Free descriptor indices, used as a stack.
    free: Vec<u16>,
    /// For each head that is with the device, the descriptors of its chain (to free on completion).
    outstanding: Vec<Option<Vec<u16>>>,
    outstanding_count: usize,
    next_avail: u16,
    last_used: u16,
}

impl<M: DmaMemory> SplitQueue<M> {
    /// Lays the rings out at the start of `mem` and zeroes them, with VRING_AVAIL_F_NO_INTERRUPT in the avail ring's
    /// flags: a driver that polls its used ring (vhca.sys until its interrupt is connected, the Linux guest program
    /// with `vhca.completion=poll`, any doorbell queue) only pays for an interrupt per used buffer; one that waits for
    /// its queue's MSI-X message asks for them with `set_interrupts_wanted`. Under TCG an unwanted interrupt cost a
    /// wake-up of QEMU's main loop per completion (QEMU reads the call eventfd there: no irqfd without KVM),
    /// competing for the CPU with the vCPU and the device. Virtio 1.2, 2.7.7: the flag is advice the device may
    /// ignore; nothing else is negotiated.
    pub fn new(size: u16, mem: M) -> Result<SplitQueue<M>, QueueError> {
        let layout = RingLayout::new(size)?;
        let addr = mem.host_ptr().as_ptr() as usize;
        if mem.len() < layout.bytes || addr % DESC_SIZE != 0 || mem.iova() % DESC_SIZE as u64 != 0 {
            return Err(QueueError::BadMemory { have: mem.len(), need: layout.bytes, host: addr, iova: mem.iova() });
        }
        // Cannot fail: the length was just checked.
        let _ = mem.fill(0, layout.bytes, 0);
        let queue = SplitQueue {
            mem,
            layout,
            free: (0..size).rev().collect(),
            outstanding: vec![None; size as usize],
            outstanding_count: 0,
            next_avail: 0,
            last_used: 0,
        };
        queue.avail_flags().store(AVAIL_F_NO_INTERRUPT.to_le(), Ordering::Release);
        Ok(queue)
    }

    pub fn size(&self) -> u16 {
        self.layout.size
    }

    pub fn memory(&self) -> &M {
        &self.mem
    }

    /// Device addresses of descriptor table, avail ring and used ring, for the transport to program.
    pub fn ring_iovas(&self) -> [u64; 3] {
        let base = self.mem.iova();
        [base + self.layout.desc as u64, base + self.layout.avail as u64, base + self.layout.used as u64]
    }

    pub fn free_descriptors(&self) -> usize {
        self.free.len()
    }

    fn ptr(&self, offset: usize) -> *mut u8 {
        debug_assert!(offset < self.layout.bytes);
        self.mem.host_ptr().as_ptr().wrapping_add(offset)
    }

    /// The avail or used ring's `idx` field, shared with the device: accessed atomically so the release/acquire
    /// pairing orders the ring contents around it.
    fn idx(&self, ring: usize) -> &AtomicU16 {
        // SAFETY: `ring + 2` is inside the checked ring memory, 2-byte aligned (ring offsets are multiples of 4 in a
        // 16-aligned block), and the memory lives as long as `self`. Only atomic accesses are made to this u16.
        unsafe { AtomicU16::from_ptr(self.ptr(ring + 2).cast::<u16>()) }
    }

    /// Publishes a chain (device-readable buffers first) and returns its head. The caller then notifies the device
    /// if `notification_needed` says so.
    pub fn add_chain(&mut self, buffers: &[Buffer]) -> Result<u16, QueueError> {
        if buffers.is_empty() {
            return Err(QueueError::EmptyChain);
        }
        if let Some(i) = buffers.windows(2).position(|w| w[0].device_writes && !w[1].device_writes) {
            return Err(QueueError::ReadableAfterWritable(i + 1));
        }
        if buffers.len() > self.free.len() {
            return Err(QueueError::Full { wanted: buffers.len(), free: self.free.len() });
        }
        let split = self.free.len() - buffers.len();
        let mut chain = self.free.split_off(split);
        chain.reverse();
        for (i, (buffer, &index)) in buffers.iter().zip(&chain).enumerate() {
            let next = chain.get(i + 1).copied();
            let mut flags = if buffer.device_writes { DESC_F_WRITE } else { 0 };
            if next.is_some() {
                flags |= DESC_F_NEXT;
            }
            let at = self.layout.desc + DESC_SIZE * index as usize;
            // SAFETY: `index` < size, so the 16-byte descriptor lies inside the table; fields are naturally aligned.
            unsafe {
                core::ptr::write_volatile(self.ptr(at).cast::<u64>(), buffer.iova.to_le());
                core::ptr::write_volatile(self.ptr(at + 8).cast::<u32>(), buffer.len.to_le());
                core::ptr::write_volatile(self.ptr(at + 12).cast::<u16>(), flags.to_le());
                core::ptr::write_volatile(self.ptr(at + 14).cast::<u16>(), next.unwrap_or(0).to_le());
            }
        }
        let head = chain[0];
        let slot = self.layout.avail + 4 + 2 * (self.next_avail & (self.layout.size - 1)) as usize;
        // SAFETY: the masked slot index is < size, so the u16 lies inside the avail ring; 2-byte aligned.
        unsafe { core::ptr::write_volatile(self.ptr(slot).cast::<u16>(), head.to_le()) };
        self.next_avail = self.next_avail.wrapping_add(1);
        // Release: descriptors and the ring slot become visible to the device no later than the new index.
        self.idx(self.layout.avail).store(self.next_avail.to_le(), Ordering::Release);
        // virtio 1.2, 2.7.13 step 6: the index store is visible before the notification check (`notification_needed`)
        // and before the MMIO write of a notify.
        fence(Ordering::SeqCst);
        self.outstanding[head as usize] = Some(chain);
        self.outstanding_count += 1;
        Ok(head)
    }

    /// Whether the device wants an available-buffer notification (a kick) for what `add_chain` just published. A
    /// device busy-polling its avail ring sets VRING_USED_F_NO_NOTIFY in the used ring's flags; without
    /// VIRTIO_F_EVENT_IDX (never negotiated here) virtio 1.2, 2.7.10.1 says: flags 1, the driver SHOULD NOT notify;
    /// flags 0, it MUST. The flag is advice that can change at any moment: a device ending its polling clears it
    /// and then looks at the avail index once more, so a chain published while the flag read 1 is never lost.
    pub fn notification_needed(&self) -> bool {
        // 2.7.13.4.1: "The driver MUST perform a suitable memory barrier before reading flags or avail_event, to
        // avoid missing a notification": the avail index store must not pass this load (a store-load barrier).
        fence(Ordering::SeqCst);
        let flags = u16::from_le(self.used_flags().load(Ordering::Relaxed));
        flags & USED_F_NO_NOTIFY == 0
    }

    /// Calls `notify` (the transport's doorbell write) unless the device has suppressed notifications, as 2.7.13
    /// step 7 says; returns whether it did. Call it after `add_chain`.
    pub fn kick<E>(&self, notify: impl FnOnce() -> Result<(), E>) -> Result<bool, E> {
        if !self.notification_needed() {
            return Ok(false);
        }
        notify().map(|()| true)
    }

    /// Asks the device for used-buffer notifications (`true`: the flags word 0) or declines them (`false`, how `new`
    /// leaves a queue). A driver that waits for an interrupt asks before its first chain, so no completion can come
    /// without one; a wait must still poll the used ring after each interrupt (2.7.7: the flag is only advice, and
    /// a shared vector's message may be another queue's).
    pub fn set_interrupts_wanted(&self, wanted: bool) {
        let flags = if wanted { 0 } else { AVAIL_F_NO_INTERRUPT };
        self.avail_flags().store(flags.to_le(), Ordering::Release);
    }

    /// The avail ring's `flags` field, written by this driver.
    fn avail_flags(&self) -> &AtomicU16 {
        // SAFETY: the avail ring's first u16 is inside the checked ring memory, 2-byte aligned (ring offsets are
        // multiples of 4 in a 16-aligned block), and lives as long as `self`. Only atomic accesses are made to it.
        unsafe { AtomicU16::from_ptr(self.ptr(self.layout.avail).cast::<u16>()) }
    }

    /// The used ring's `flags` field, written by the device.
    fn used_flags(&self) -> &AtomicU16 {
        // SAFETY: the used ring's first u16 is inside the checked ring memory, 4-byte aligned, and lives as long as
        // `self`. Only atomic accesses are made to it by this driver.
        unsafe { AtomicU16::from_ptr(self.ptr(self.layout.used).cast::<u16>()) }
    }

    /// Takes one completion if the device has published one; frees that chain's descriptors.
    pub fn poll_used(&mut self) -> Result<Option<Used>, QueueError> {
        // Acquire: the used element and the buffers it covers are read only after the index that publishes them.
        let used_idx = u16::from_le(self.idx(self.layout.used).load(Ordering::Acquire));
        if used_idx == self.last_used {
            return Ok(None);
        }
        let pending = used_idx.wrapping_sub(self.last_used) as usize;
        if pending > self.outstanding_count {
            return Err(QueueError::UsedIndexJump {
                used_idx,
                last: self.last_used,
                outstanding: self.outstanding_count,
            });
        }
        let at = self.layout.used + 4 + 8 * (self.last_used & (self.layout.size - 1)) as usize;
        // SAFETY: the masked element index is < size, so both u32s lie inside the used ring; 4-byte aligned.
        let (id, len) = unsafe {
            (
                u32::from_le(core::ptr::read_volatile(self.ptr(at).cast::<u32>())),
                u32::from_le(core::ptr::read_volatile(self.ptr(at + 4).cast::<u32>())),
            )
        };
        let chain = usize::try_from(id).ok().and_then(|i| self.outstanding.get_mut(i)).and_then(Option::take);
        let chain = chain.ok_or(QueueError::BadUsedId(id))?;
        self.free.extend(chain.iter().rev());
        self.outstanding_count -= 1;
        self.last_used = self.last_used.wrapping_add(1);
        // `id` named an outstanding slot, so it is < size <= 32768.
        Ok(Some(Used { head: id as u16, len }))
    }

    /// Polls until a completion arrives or `wait` gives up; `wait` decides how to pause between polls (a sleeping
    /// thread in the Linux guest, a delay or a stall by IRQL in vhca.sys). Polls are made back to back while
    /// `wait.keep_spinning` says so: a busy-polling device answers within them, and a sleep would add its own
    /// wake-up latency (under TCG a timer sleep overshoots by tens of microseconds).
    pub fn wait_used(&mut self, wait: &mut impl PollWait) -> Result<Used, QueueError> {
        let mut polls = 0;
        loop {
            if let Some(used) = self.poll_used()? {
                return Ok(used);
            }
            if !wait.keep_spinning(polls) {
                break;
            }
            polls = polls.saturating_add(1);
            core::hint::spin_loop();
        }
        loop {
            if let Some(used) = self.poll_used()? {
                return Ok(used);
            }
            if !wait.pause() {
                return Err(QueueError::Timeout(wait.limit()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{CountedWait, HeapDma};

    const IOVA: u64 = 0x10_0000_0000;

    /// The device's view of the same memory: reads avail, follows descriptors, writes used. Deliberately written
    /// from the spec's layout, not from the driver's helpers, so a wrong offset in either shows up.
    type Desc = (u64, u32, u16);

    struct FakeDevice {
        last_avail: u16,
        used_idx: u16,
        size: u16,
        layout: RingLayout,
    }

    fn rd<T: Copy>(mem: &HeapDma, offset: usize) -> T {
        // SAFETY: test offsets come from the layout inside the allocation; alignment matches the field.
        unsafe { std::ptr::read_volatile(mem.translate(IOVA + offset as u64, std::mem::size_of::<T>()).cast::<T>()) }
    }

    fn wr<T: Copy>(mem: &HeapDma, offset: usize, value: T) {
        // SAFETY: as in `rd`.
        unsafe { std::ptr::write_volatile(mem.translate(IOVA + offset as u64, std::mem::size_of::<T>()).cast(), value) }
    }

    impl FakeDevice {
        fn new(size: u16) -> FakeDevice {
            FakeDevice { last_avail: 0, used_idx: 0, size, layout: RingLayout::new(size).unwrap() }
        }

        /// Pops the next available chain: its head and each descriptor's (addr, len, flags).
        fn pop(&mut self, mem: &HeapDma) -> Option<(u16, Vec<Desc>)> {
            let avail_idx: u16 = rd(mem, self.layout.avail + 2);
            if avail_idx == self.last_avail {
                return None;
            }
            let head: u16 = rd(mem, self.layout.avail + 4 + 2 * (self.last_avail % self.size) as usize);
            self.last_avail = self.last_avail.wrapping_add(1);
            let mut descs = Vec::new();
            let mut index = head;
            loop {
                let at = 16 * index as usize;
                let (addr, len, flags, next): (u64, u32, u16, u16) =
                    (rd(mem, at), rd(mem, at + 8), rd(mem, at + 12), rd(mem, at + 14));
                descs.push((addr, len, flags));
                if flags & DESC_F_NEXT == 0 {
                    break;
                }
                assert!(descs.len() <= self.size as usize, "descriptor loop");
                index = next;
            }
            Some((head, descs))
        }

        /// Sets or clears VRING_USED_F_NO_NOTIFY, as a busy-polling device does.
        fn suppress_kicks(&self, mem: &HeapDma, on: bool) {
            wr(mem, self.layout.used, u16::from(on));
        }

        fn complete(&mut self, mem: &HeapDma, id: u32, len: u32) {
            let at = self.layout.used + 4 + 8 * (self.used_idx % self.size) as usize;
            wr(mem, at, id);
            wr(mem, at + 4, len);
            self.used_idx = self.used_idx.wrapping_add(1);
            wr(mem, self.layout.used + 2, self.used_idx);
        }
    }

    fn queue(size: u16) -> SplitQueue<HeapDma> {
        SplitQueue::new(size, HeapDma::new(4096 * 2, IOVA)).unwrap()
    }

    #[test]
    fn layout_follows_the_spec_alignments() {
        let l = RingLayout::new(64).unwrap();
        assert_eq!((l.desc, l.avail, l.used), (0, 1024, 1160));
        assert_eq!(l.bytes, 1160 + 6 + 8 * 64);
        assert_eq!(RingLayout::new(3), Err(QueueError::BadSize(3)));
        assert_eq!(RingLayout::new(0), Err(QueueError::BadSize(0)));
    }

    #[test]
    fn a_new_queue_asks_the_device_for_no_interrupts() {
        let q = queue(8);
        let layout = RingLayout::new(8).unwrap();
        // The avail ring's flags: VRING_AVAIL_F_NO_INTERRUPT, and nothing else (its index starts at 0).
        assert_eq!(u16::from_le(rd::<u16>(q.memory(), layout.avail)), AVAIL_F_NO_INTERRUPT);
        assert_eq!(AVAIL_F_NO_INTERRUPT, 1, "virtio 1.2, 2.7.6: VIRTQ_AVAIL_F_NO_INTERRUPT is 1");
        assert_eq!(rd::<u16>(q.memory(), layout.avail + 2), 0);
        q.set_interrupts_wanted(true);
        assert_eq!(rd::<u16>(q.memory(), layout.avail), 0);
        q.set_interrupts_wanted(false);
        assert_eq!(u16::from_le(rd::<u16>(q.memory(), layout.avail)), AVAIL_F_NO_INTERRUPT);
    }

    #[test]
    fn a_chain_reaches_the_device_and_its_completion_comes_back() {
        let mut q = queue(8);
        let mut dev = FakeDevice::new(8);
        let bufs = [
            Buffer { iova: 0xA000, len: 16, device_writes: false },
            Buffer { iova: 0xB000, len: 80, device_writes: true },
        ];
        let head = q.add_chain(&bufs).unwrap();
        assert_eq!(q.free_descriptors(), 6);
        let (dev_head, descs) = dev.pop(q.memory()).expect("device sees the chain");
        assert_eq!(dev_head, head);
        assert_eq!(descs, vec![(0xA000, 16, DESC_F_NEXT), (0xB000, 80, DESC_F_WRITE)]);
        assert!(dev.pop(q.memory()).is_none());

        assert_eq!(q.poll_used().unwrap(), None);
        dev.complete(q.memory(), head as u32, 80);
        assert_eq!(q.poll_used().unwrap(), Some(Used { head, len: 80 }));
        assert_eq!(q.free_descriptors(), 8);
        assert_eq!(q.poll_used().unwrap(), None);
    }

    #[test]
    fn indices_wrap_past_u16_without_losing_descriptors() {
        let mut q = queue(4);
        let mut dev = FakeDevice::new(4);
        for round in 0..70_000u32 {
            let writes = Buffer { iova: 0xC000 + round as u64, len: round, device_writes: true };
            let head = q.add_chain(&[writes]).unwrap();
            let (_, descs) = dev.pop(q.memory()).unwrap();
            assert_eq!(descs, vec![(0xC000 + round as u64, round, DESC_F_WRITE)]);
            dev.complete(q.memory(), head as u32, round);
            assert_eq!(q.wait_used(&mut CountedWait(1)).unwrap(), Used { head, len: round });
        }
        assert_eq!(q.free_descriptors(), 4);
    }

    #[test]
    fn out_of_order_completions_free_the_right_chains() {
        let mut q = queue(4);
        let mut dev = FakeDevice::new(4);
        let one = |iova| [Buffer { iova, len: 8, device_writes: false }, Buffer { iova, len: 8, device_writes: true }];
        let a = q.add_chain(&one(0x1000)).unwrap();
        let b = q.add_chain(&one(0x2000)).unwrap();
        assert_eq!(q.add_chain(&one(0x3000)), Err(QueueError::Full { wanted: 2, free: 0 }));
        dev.pop(q.memory()).unwrap();
        dev.pop(q.memory()).unwrap();
        dev.complete(q.memory(), b as u32, 1);
        assert_eq!(q.poll_used().unwrap().map(|u| u.head), Some(b));
        assert_eq!(q.free_descriptors(), 2);
        let c = q.add_chain(&one(0x3000)).unwrap();
        let (_, descs) = dev.pop(q.memory()).unwrap();
        assert_eq!(descs[0].0, 0x3000);
        dev.complete(q.memory(), a as u32, 2);
        dev.complete(q.memory(), c as u32, 3);
        assert_eq!(q.poll_used().unwrap().map(|u| u.head), Some(a));
        assert_eq!(q.poll_used().unwrap().map(|u| u.head), Some(c));
        assert_eq!(q.free_descriptors(), 4);
    }

    #[test]
    fn device_misbehaviour_is_an_error_not_a_panic() {
        let mut q = queue(4);
        let mut dev = FakeDevice::new(4);
        q.add_chain(&[Buffer { iova: 0x1000, len: 8, device_writes: true }]).unwrap();
        dev.complete(q.memory(), 3, 8); // head 3 was never handed out
        assert_eq!(q.poll_used(), Err(QueueError::BadUsedId(3)));

        let mut q = queue(4);
        let dev_layout = RingLayout::new(4).unwrap();
        wr(q.memory(), dev_layout.used + 2, 9u16); // index jumps past anything outstanding
        assert!(matches!(q.poll_used(), Err(QueueError::UsedIndexJump { used_idx: 9, .. })));
        assert_eq!(q.wait_used(&mut CountedWait(1)).unwrap_err(), q.poll_used().unwrap_err());
    }

    #[test]
    fn kicks_are_skipped_only_while_the_device_sets_no_notify() {
        let mut q = queue(4);
        let mut dev = FakeDevice::new(4);
        let chain = [Buffer { iova: 0x1000, len: 8, device_writes: true }];
        // A fresh ring's flags are 0 (2.7.10.1: the driver initialises them): every chain is notified.
        q.add_chain(&chain).unwrap();
        assert!(q.notification_needed());
        dev.suppress_kicks(q.memory(), true);
        q.add_chain(&chain).unwrap();
        assert!(!q.notification_needed(), "the device is polling: no kick");
        // The device sees both without a kick, then stops polling.
        assert!(dev.pop(q.memory()).is_some() && dev.pop(q.memory()).is_some());
        dev.suppress_kicks(q.memory(), false);
        q.add_chain(&chain).unwrap();
        assert!(q.notification_needed(), "polling ended: the kick is required again");
        let mut kicks = 0;
        assert_eq!(
            q.kick(|| -> Result<(), ()> {
                kicks += 1;
                Ok(())
            }),
            Ok(true)
        );
        dev.suppress_kicks(q.memory(), true);
        assert_eq!(
            q.kick(|| -> Result<(), ()> {
                kicks += 1;
                Ok(())
            }),
            Ok(false)
        );
        assert_eq!(kicks, 1, "the doorbell is written only while the flag is clear");
        dev.suppress_kicks(q.memory(), false);
        assert_eq!(q.kick(|| Err("gone")), Err("gone"), "a failed doorbell write is the caller's error");
        // Only the NO_NOTIFY bit counts; other bits of flags are not the driver's business.
        wr(q.memory(), dev.layout.used, 0xfffeu16);
        assert!(q.notification_needed());
    }

    /// Spins `spins` polls, then gives up at its first pause (counted).
    struct SpinThenGiveUp {
        spins: u32,
        pauses: u32,
    }

    impl PollWait for SpinThenGiveUp {
        fn pause(&mut self) -> bool {
            self.pauses += 1;
            false
        }
        fn limit(&self) -> Duration {
            Duration::ZERO
        }
        fn keep_spinning(&mut self, polls: u32) -> bool {
            polls < self.spins
        }
    }

    #[test]
    fn wait_used_spins_its_polls_before_the_first_pause() {
        // Without spinning the first empty poll pauses, and this wait gives up there.
        let mut q = queue(4);
        q.add_chain(&[Buffer { iova: 0x1000, len: 8, device_writes: true }]).unwrap();
        let mut wait = SpinThenGiveUp { spins: 0, pauses: 0 };
        assert_eq!(q.wait_used(&mut wait), Err(QueueError::Timeout(Duration::ZERO)));
        assert_eq!(wait.pauses, 1);

        // With spins, a completion the device writes from another thread meanwhile is taken without any pause.
        let mut q = queue(4);
        let head = q.add_chain(&[Buffer { iova: 0x1000, len: 8, device_writes: true }]).unwrap();
        // The used ring's address inside the heap allocation, as an integer so the device thread may hold it.
        let used_ring = q.memory().translate(IOVA + RingLayout::new(4).unwrap().used as u64, 12) as usize;
        let mut wait = SpinThenGiveUp { spins: u32::MAX, pauses: 0 };
        let used = std::thread::scope(|scope| {
            scope.spawn(move || {
                std::thread::sleep(Duration::from_millis(5));
                let ring = used_ring as *mut u8;
                // SAFETY: the used ring lies inside the queue's heap allocation, which outlives this scope; element
                // 0 (id, len) is written before the index that publishes it, as a device does.
                unsafe {
                    std::ptr::write_volatile(ring.add(4).cast::<u32>(), u32::from(head));
                    std::ptr::write_volatile(ring.add(8).cast::<u32>(), 8);
                    AtomicU16::from_ptr(ring.add(2).cast::<u16>()).store(1, Ordering::Release);
                }
            });
            q.wait_used(&mut wait)
        });
        assert_eq!(used, Ok(Used { head, len: 8 }));
        assert_eq!(wait.pauses, 0, "seen while spinning");
    }

    #[test]
    fn chains_are_validated_before_touching_the_ring() {
        let mut q = queue(4);
        assert_eq!(q.add_chain(&[]), Err(QueueError::EmptyChain));
        let bad = [
            Buffer { iova: 0x1000, len: 8, device_writes: true },
            Buffer { iova: 0x2000, len: 8, device_writes: false },
        ];
        assert_eq!(q.add_chain(&bad), Err(QueueError::ReadableAfterWritable(1)));
        assert_eq!(q.free_descriptors(), 4);
        let mut fresh = queue(4);
        assert_eq!(fresh.wait_used(&mut CountedWait(3)), Err(QueueError::Timeout(Duration::from_millis(1))));
    }
}
