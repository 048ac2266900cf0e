//! The guest-visible round trip of one command (`vhca.scenario=roundtrip`): QUERY_DEVICE on vhca's command queue —
//! guest → vIOMMU → vhost-user → vhca-device → guest — against one 64-byte read from QEMU's in-process virtio-rng
//! behind the same vIOMMU, in the same guest and run, `samples` of each, interleaved. Both complete through the same
//! wait (`SplitQueue::wait_used`: a bounded spin, then sleeps); the rng is also timed with sleeps only (the wait as
//! it was before the spin), spinning on the used ring only, and the doorbell write alone (the kick: an MMIO write
//! that exits to QEMU). QUERY_DEVICE is timed once more back to back, where a busy-polling device is still polling
//! when the next request comes (no kick), and one poll of the used ring is timed (the spin's unit of cost). The
//! runner's `bench --roundtrip` prints what this reports.
//!
//! QUERY_DEVICE waits as the run's `vhca.completion` says (polling, or its queue's MSI-X message); the rng is also
//! read waiting for its own MSI-X message (`rng_read_interrupt`), through the same wait, so a run with
//! `vhca.completion=interrupt` compares the two interrupt paths and a polling run the two polling ones.

use std::ops::DerefMut;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use serde::Serialize;
use vhca_virtio::PollWait;

use crate::bring_up::setup_queue;
use crate::cmdline::{Completion, Options, PciId};
use crate::pci;
use crate::queue_interrupts::QueueInterrupts;
use crate::report::{progress, Report};
use crate::rng::ENTROPY_BYTES;
use crate::vfio::{self, DmaAccess};
use crate::vfio_command_transport::CommandQueue;
use crate::vfio_dma::{DmaMapper, DmaMemory, DmaRegion};
use crate::virtio_pci::{Deadline, VirtioPci, F_ACCESS_PLATFORM, F_VERSION_1, STATUS_ACKNOWLEDGE, STATUS_DRIVER};
use crate::virtqueue::Buffer;

/// QEMU's virtio-rng (modern id); the runner adds it behind its own root port for this scenario.
pub const RNG: PciId = PciId { vendor: vhca_proto::PCI_VENDOR_VIRTIO, device: 0x1044 };
/// Samples of each kind unless `vhca.samples` says otherwise.
pub const DEFAULT_SAMPLES: usize = 10_000;

/// Median, 99th percentile and extremes of one series, in microseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Series {
    pub samples: usize,
    pub median_us: f64,
    pub p99_us: f64,
    pub min_us: f64,
    pub max_us: f64,
}

impl Series {
    fn of(mut us: Vec<f64>) -> Series {
        us.sort_by(f64::total_cmp);
        let at = |q: f64| us.get(((us.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0.0);
        Series { samples: us.len(), median_us: at(0.5), p99_us: at(0.99), min_us: at(0.0), max_us: at(1.0) }
    }
}

/// What the scenario reports (under `details.roundtrip`).
#[derive(Debug, Clone, Serialize)]
pub struct RoundTrip {
    /// How QUERY_DEVICE waited (`vhca.completion`): `poll` or `interrupt`.
    pub completion: &'static str,
    /// QUERY_DEVICE through vhca: request written, chain added, kick, device, used ring polled (or its MSI-X
    /// message waited for), response checked.
    pub vhca_query_device: Series,
    /// One 64-byte read from virtio-rng waiting for the queue's MSI-X message (VFIO eventfd, the interrupt thread,
    /// the wait's wake-up), as a queue with `vhca.completion=interrupt` waits.
    pub rng_read_interrupt: Series,
    /// The same read, the waiter spinning (yielding the vCPU) until the interrupt thread has counted the rng's
    /// message, then taking the used entry: the interrupt's way into this program without the waiter's own sleep
    /// and wake-up, which is what `rng_read_interrupt` adds to it.
    pub rng_read_interrupt_seen: Series,
    /// MSI-X messages the rng delivered in the run (at least one per read that asked for them).
    pub rng_messages: u64,
    /// One 64-byte read from virtio-rng through the same wait, the queue asking for used-buffer notifications
    /// (interrupts): QEMU's rng answered faster so than with them declined (measured, docs/bench.md section 5).
    pub rng_read: Series,
    /// The same read with notifications declined (VRING_AVAIL_F_NO_INTERRUPT), as vhca's queues run.
    pub rng_read_no_interrupt: Series,
    /// The same read, waited for by sleeps only (no spin before the first sleep: the wait as it was before).
    pub rng_read_sleeping: Series,
    /// The same read, spinning on the used ring only.
    pub rng_read_spinning: Series,
    /// The kick alone: one doorbell write to virtio-rng's notify register.
    pub kick: Series,
    /// QUERY_DEVICE again, `samples` back to back after the interleaved ones.
    pub vhca_query_device_back_to_back: Series,
    /// One poll of an empty used ring with its spin hint, in nanoseconds (mean of 100 000).
    pub spin_poll_ns: f64,
    /// How long this program's wait (`Deadline`) spins on the used ring before its first sleep, in microseconds.
    pub spin_us: f64,
}

/// The guest's wait without the spin before the first sleep.
struct SleepsOnly(Deadline);

impl PollWait for SleepsOnly {
    fn pause(&mut self) -> bool {
        self.0.pause()
    }
    fn limit(&self) -> Duration {
        self.0.limit()
    }
    fn keep_spinning(&mut self, _polls: u32) -> bool {
        false
    }
}

/// QEMU's virtio-rng opened through VFIO, its features negotiated: its MSI-X and queue come next.
struct Rng {
    session: vfio::Session,
    mapper: DmaMapper,
    transport: VirtioPci,
}

fn open_rng(timeout: Duration) -> anyhow::Result<Rng> {
    let device = pci::wait_for(&[RNG], Duration::ZERO).context("virtio-rng (the runner adds it for this scenario)")?;
    device.bind_vfio()?;
    let session = vfio::Session::open(device.iommu_group()?, &device.address).context("virtio-rng: VFIO setup")?;
    let mapper = DmaMapper::new(session.container.clone());
    let transport = VirtioPci::open(&session.device).context("virtio-rng transport")?;
    transport.reset(timeout)?;
    transport.add_status(STATUS_ACKNOWLEDGE)?;
    transport.add_status(STATUS_DRIVER)?;
    transport.negotiate(F_VERSION_1 | F_ACCESS_PLATFORM, 0)?;
    Ok(Rng { session, mapper, transport })
}

/// The scenario's step on vhca's command queue (bring_up.rs calls it as its `RoundTripBench` once QUERY_DEVICE
/// answered): `vhca.samples` of each kind, the medians on the console, every figure under `details.roundtrip`.
pub fn measure_into(
    commands: &mut CommandQueue,
    options: &Options,
    timeout: Duration,
    report: &mut Report,
) -> anyhow::Result<()> {
    let samples = options.samples.unwrap_or(DEFAULT_SAMPLES);
    let measured = measure(commands, options.completion, samples, timeout)?;
    progress(format_args!(
        "round trip: QUERY_DEVICE by {} median {:.1} us, virtio-rng read median {:.1} us polled, {:.1} us by \
         interrupt ({samples} each)",
        measured.completion,
        measured.vhca_query_device.median_us,
        measured.rng_read.median_us,
        measured.rng_read_interrupt.median_us
    ));
    report.details.insert("roundtrip".into(), serde_json::to_value(measured)?);
    Ok(())
}

/// Measures `samples` of each, interleaved so both devices see the same guest and host load. `completion` is how
/// `commands` was set up to wait, for the report.
pub fn measure(
    commands: &mut CommandQueue,
    completion: Completion,
    samples: usize,
    timeout: Duration,
) -> anyhow::Result<RoundTrip> {
    let rng = open_rng(timeout)?;
    // Its MSI-X before its queue, as bring-up does: the queue's vector is programmed before queue_enable.
    let mut interrupts = QueueInterrupts::for_run(
        Completion::Interrupt,
        &rng.session.device,
        &rng.transport,
        1,
        &mut Report::default(),
    )?
    .context("virtio-rng: no MSI-X")?;
    let (mut queue, mut notifier) = setup_queue(&rng.transport, &rng.mapper, 0)?;
    interrupts.attach(0, &mut queue);
    rng.transport.driver_ok()?;
    let buffer = rng.mapper.alloc(ENTROPY_BYTES, DmaAccess::READ_WRITE)?;
    let chain = [Buffer { iova: buffer.iova(), len: ENTROPY_BYTES as u32, device_writes: true }];
    let (signals, vector) = queue.completion_waits(timeout).interrupt.context("virtio-rng waits by no message")?;
    let queue = &mut queue;
    let notifier = &mut notifier;
    // The polling waits, whatever this queue's own wait is now (the interrupt's, used by `rng_read_interrupt`).
    let polling = || Deadline::after(timeout);
    let (mut vhca, mut polled, mut spun, mut kicks) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut slept, mut quiet, mut by_interrupt, mut seen) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..samples {
        let t = Instant::now();
        commands.query_device()?;
        vhca.push(t.elapsed().as_secs_f64() * 1e6);

        // Interrupts asked for, as `wait_by_interrupt` left the queue: the MSI-X message ends the wait.
        let t = Instant::now();
        let head = queue.add_chain(&chain)?;
        notifier.notify()?;
        let used = queue.wait_used(timeout)?;
        by_interrupt.push(t.elapsed().as_secs_f64() * 1e6);
        ensure!(used.head == head && used.len as usize == ENTROPY_BYTES, "virtio-rng answered {used:?}");

        let t = Instant::now();
        let before = signals.fired(vector);
        let head = queue.add_chain(&chain)?;
        notifier.notify()?;
        while signals.fired(vector) == before {
            ensure!(t.elapsed() < timeout, "virtio-rng's message did not come within {timeout:?}");
            // One vCPU: the interrupt thread needs it to count the message.
            std::thread::yield_now();
        }
        let used = queue.deref_mut().wait_used(&mut polling())?;
        seen.push(t.elapsed().as_secs_f64() * 1e6);
        ensure!(used.head == head && used.len as usize == ENTROPY_BYTES, "virtio-rng answered {used:?}");

        // The in-process device at its best: asking for interrupts, polling (see `RoundTrip::rng_read`).
        let t = Instant::now();
        let head = queue.add_chain(&chain)?;
        notifier.notify()?;
        let used = queue.deref_mut().wait_used(&mut polling())?;
        polled.push(t.elapsed().as_secs_f64() * 1e6);
        ensure!(used.head == head && used.len as usize == ENTROPY_BYTES, "virtio-rng answered {used:?}");

        queue.set_interrupts_wanted(false);
        let t = Instant::now();
        let head = queue.add_chain(&chain)?;
        notifier.notify()?;
        let used = queue.deref_mut().wait_used(&mut polling())?;
        quiet.push(t.elapsed().as_secs_f64() * 1e6);
        queue.set_interrupts_wanted(true);
        ensure!(used.head == head && used.len as usize == ENTROPY_BYTES, "virtio-rng answered {used:?}");

        let t = Instant::now();
        let head = queue.add_chain(&chain)?;
        notifier.notify()?;
        let used = queue.deref_mut().wait_used(&mut SleepsOnly(Deadline::after(timeout)))?;
        slept.push(t.elapsed().as_secs_f64() * 1e6);
        ensure!(used.head == head && used.len as usize == ENTROPY_BYTES, "virtio-rng answered {used:?}");

        let t = Instant::now();
        let head = queue.add_chain(&chain)?;
        let kicked = Instant::now();
        notifier.notify()?;
        kicks.push(kicked.elapsed().as_secs_f64() * 1e6);
        let deadline = t + timeout;
        let used = loop {
            if let Some(used) = queue.poll_used()? {
                break used;
            }
            ensure!(Instant::now() < deadline, "virtio-rng did not answer within {timeout:?}");
            std::hint::spin_loop();
        };
        spun.push(t.elapsed().as_secs_f64() * 1e6);
        ensure!(used.head == head && used.len as usize == ENTROPY_BYTES, "virtio-rng answered {used:?}");
    }
    let mut back_to_back = Vec::with_capacity(samples);
    for _ in 0..samples {
        let t = Instant::now();
        commands.query_device()?;
        back_to_back.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let mut bytes = [0u8; ENTROPY_BYTES];
    buffer.read_bytes(0, &mut bytes)?;
    ensure!(bytes.iter().any(|b| *b != 0), "virtio-rng completed but its buffer is still all zero");
    let spin_poll_ns = spin_poll_ns(queue)?;
    // The rng is reset before its MSI-X goes, so no message of the run is missed (as bring-up ends a run).
    rng.transport.reset(timeout)?;
    let rng_messages = interrupts.finish().per_vector.iter().sum();
    Ok(RoundTrip {
        completion: completion.name(),
        vhca_query_device: Series::of(vhca),
        rng_read_interrupt: Series::of(by_interrupt),
        rng_read_interrupt_seen: Series::of(seen),
        rng_messages,
        rng_read: Series::of(polled),
        rng_read_no_interrupt: Series::of(quiet),
        rng_read_sleeping: Series::of(slept),
        rng_read_spinning: Series::of(spun),
        kick: Series::of(kicks),
        vhca_query_device_back_to_back: Series::of(back_to_back),
        spin_poll_ns,
        spin_us: crate::virtio_pci::SPIN_BEFORE_SLEEP.as_secs_f64() * 1e6,
    })
}

/// What one spin of `wait_used` costs: a poll of the used ring that finds nothing, and the spin hint.
fn spin_poll_ns(queue: &mut crate::virtqueue::SplitQueue<DmaRegion>) -> anyhow::Result<f64> {
    const POLLS: u32 = 100_000;
    let t = Instant::now();
    for _ in 0..POLLS {
        ensure!(queue.poll_used()?.is_none(), "virtio-rng completed a chain nobody posted");
        std::hint::spin_loop();
    }
    Ok(t.elapsed().as_secs_f64() * 1e9 / f64::from(POLLS))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_takes_median_and_p99_of_unsorted_samples() {
        let s = Series::of((1..=100).rev().map(f64::from).collect());
        assert_eq!((s.samples, s.min_us, s.max_us), (100, 1.0, 100.0));
        assert_eq!(s.median_us, 51.0);
        assert_eq!(s.p99_us, 99.0);
        let empty = Series::of(Vec::new());
        assert_eq!((empty.samples, empty.median_us), (0, 0.0));
    }
}
