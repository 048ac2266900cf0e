//! The NT model's side of a run's interrupts: each MSI-X message runs the driver's ISR (at its DIRQL, then its DPC
//! as the IRQL drops) on the interrupt thread that took it, and a clock thread gives the model its clock interrupt
//! every tick.
//!
//! Why on the interrupt thread: Windows runs an ISR on the processor the message interrupted, with no thread switch
//! first, and its DPC on the same processor as the IRQL drops. A hand-off to a delivery thread of its own cost each
//! message one more wake-up and context switch of the guest (16-30 us under TCG, measured by timestamps in the
//! guest: docs/bench.md section 6) and each run one more thread. A DPC that runs long (the scenarios that spin or
//! wait in one on purpose, until the watchdog stops them) holds the interrupt thread meanwhile, as it holds its
//! processor on Windows: the messages that come meanwhile wait in their eventfds and are delivered after it,
//! counted then. Nothing waits for the interrupt thread while the driver's DPC runs: the program's own message
//! waits end when the driver connects its interrupt (its commands wait on the KEVENT the DPC sets, and each queue
//! has its own lock, vfio_command_transport.rs), and the clock keeps its own thread, so the watchdog still sees a
//! DPC that never returns.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use vhca_ntapi::PDEVICE_OBJECT;
use vhca_ntmodel::NtModel;

use crate::interrupt_thread::MessageInterruptSink;

/// The model a message goes to, and as whose.
struct Target {
    kernel: Arc<NtModel>,
    device: PDEVICE_OBJECT,
}

/// The interrupt thread's sink for the model: messages run the ISR once a model is attached, and are dropped before
/// (no driver has connected anything then, so there is no ISR to run).
#[derive(Default)]
pub struct ModelInterrupts {
    /// Held while a message is delivered, so a detach waits for the ISR and DPC in flight and none runs after it.
    target: Mutex<Option<Target>>,
}

impl MessageInterruptSink for ModelInterrupts {
    fn message(&self, id: u32) {
        if let Some(t) = self.target.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            t.kernel.deliver(t.device, id);
        }
    }
}

/// One attached model: its messages' target and its clock thread. Detached, stopped and joined on every path
/// (`Drop`).
pub struct ModelDelivery {
    sink: Arc<ModelInterrupts>,
    stop_clock: Arc<AtomicBool>,
    clock: Option<JoinHandle<()>>,
}

impl ModelInterrupts {
    /// Starts delivering this sink's messages to `kernel` as `device`'s, and its clock interrupts.
    pub fn attach(self: &Arc<Self>, kernel: Arc<NtModel>, device: PDEVICE_OBJECT) -> std::io::Result<ModelDelivery> {
        let target = Target { kernel: kernel.clone(), device };
        let stop_clock = Arc::new(AtomicBool::new(false));
        let stop = stop_clock.clone();
        let clock = std::thread::Builder::new().name("nt-clock".into()).spawn(move || {
            let tick = kernel.timing().tick;
            let mut next = Instant::now() + tick;
            while !stop.load(Ordering::Acquire) {
                let now = Instant::now();
                if now < next {
                    // Parked, not slept: the drop unparks it, so a run's teardown does not wait out a tick (15.6 ms
                    // by default); a wake before the tick only looks again.
                    std::thread::park_timeout(next - now);
                    continue;
                }
                kernel.clock_interrupt();
                next = Instant::now() + tick;
            }
        })?;
        *self.target.lock().unwrap_or_else(|e| e.into_inner()) = Some(target);
        Ok(ModelDelivery { sink: self.clone(), stop_clock, clock: Some(clock) })
    }
}

impl Drop for ModelDelivery {
    /// Detaching waits for a message being delivered (the sink's lock); the flag and an unpark end the clock's
    /// thread at once.
    fn drop(&mut self) {
        self.sink.target.lock().unwrap_or_else(|e| e.into_inner()).take();
        self.stop_clock.store(true, Ordering::Release);
        if let Some(clock) = self.clock.take() {
            clock.thread().unpark();
            if clock.join().is_err() {
                crate::report::progress("the NT model's clock thread panicked");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vhca_ntmodel::NtModelConfig;

    #[test]
    fn messages_reach_the_model_only_while_attached_and_the_threads_end_on_drop() {
        let (kernel, _backend) = NtModel::for_tests(NtModelConfig::default());
        let sink = Arc::new(ModelInterrupts::default());
        sink.message(0);
        let delivery = sink.attach(kernel.clone(), crate::driver_run::PDO).unwrap();
        assert!(sink.target.lock().unwrap().is_some());
        sink.message(0);
        drop(delivery);
        assert!(sink.target.lock().unwrap().is_none(), "detached on drop");
        // The clock thread was joined and the target dropped: the model is held only here again.
        assert_eq!(Arc::strong_count(&kernel), 1);
    }

    #[test]
    fn the_clock_thread_ends_at_once_and_does_not_wait_out_its_tick() {
        let timing = vhca_ntmodel::TimingConfig { tick: std::time::Duration::from_secs(5), ..Default::default() };
        let (kernel, _backend) = NtModel::for_tests_with_timing(NtModelConfig::default(), timing);
        let delivery = Arc::new(ModelInterrupts::default()).attach(kernel.clone(), crate::driver_run::PDO).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let started = Instant::now();
        drop(delivery);
        assert!(started.elapsed() < std::time::Duration::from_secs(2), "waited {:?}", started.elapsed());
        assert_eq!(Arc::strong_count(&kernel), 1, "the clock thread joined");
    }
}
