//! The NT model's side of a run's interrupts: each MSI-X message goes to the model (the driver's ISR at its DIRQL,
//! then its DPC) on a delivery thread, and a clock thread gives the model its clock interrupt every tick.
//!
//! Why a delivery thread and not the interrupt thread: the ISR and DPC are the driver's code and may run long (a
//! DPC that rings CQ-arm doorbells waits for the device to fetch them; the scenarios that spin or wait in a DPC
//! on purpose run until the watchdog stops them), and the interrupt thread must meanwhile keep counting messages
//! and waking the program's own waits. (The transport no longer makes it a deadlock: each queue has its own lock,
//! so the DPC never waits behind a command, vfio_command_transport.rs.)

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use vhca_ntapi::PDEVICE_OBJECT;
use vhca_ntmodel::NtModel;

use crate::interrupt_thread::MessageInterruptSink;

/// The interrupt thread's sink for the model: messages go to the delivery thread once a model is attached, and are
/// dropped before (no driver has connected anything then, so there is no ISR to run).
#[derive(Default)]
pub struct ModelInterrupts {
    delivery: Mutex<Option<Sender<u32>>>,
}

impl MessageInterruptSink for ModelInterrupts {
    fn message(&self, id: u32) {
        if let Some(tx) = self.delivery.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
            // A closed channel means the delivery thread already stopped: the message has no ISR left to run.
            let _ = tx.send(id);
        }
    }
}

/// The delivery and clock threads of one attached model. Stopped and joined on every path (`Drop`).
pub struct ModelDelivery {
    sink: Arc<ModelInterrupts>,
    stop_clock: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl ModelInterrupts {
    /// Starts delivering this sink's messages to `kernel` as `device`'s, and its clock interrupts.
    pub fn attach(self: &Arc<Self>, kernel: Arc<NtModel>, device: PDEVICE_OBJECT) -> std::io::Result<ModelDelivery> {
        let (tx, rx) = mpsc::channel::<u32>();
        let deliver_to = kernel.clone();
        let delivery = std::thread::Builder::new().name("nt-interrupts".into()).spawn(move || {
            for id in rx {
                deliver_to.deliver(device, id);
            }
        })?;
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
        });
        let clock = match clock {
            Ok(clock) => clock,
            Err(e) => {
                drop(tx);
                let _ = delivery.join();
                return Err(e);
            }
        };
        *self.delivery.lock().unwrap_or_else(|e| e.into_inner()) = Some(tx);
        Ok(ModelDelivery { sink: self.clone(), stop_clock, threads: vec![delivery, clock] })
    }
}

impl Drop for ModelDelivery {
    /// Closing the channel ends the delivery thread after the messages already sent; the flag and an unpark end
    /// the clock's at once.
    fn drop(&mut self) {
        self.sink.delivery.lock().unwrap_or_else(|e| e.into_inner()).take();
        self.stop_clock.store(true, Ordering::Release);
        self.threads.iter().for_each(|t| t.thread().unpark());
        for thread in self.threads.drain(..) {
            if thread.join().is_err() {
                crate::report::progress("an NT model interrupt thread panicked");
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
        assert!(sink.delivery.lock().unwrap().is_some());
        sink.message(0);
        drop(delivery);
        assert!(sink.delivery.lock().unwrap().is_none(), "detached on drop");
        // The threads were joined: the model is held only here again.
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
        assert_eq!(Arc::strong_count(&kernel), 1, "both threads joined");
    }
}
