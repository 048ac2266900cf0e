//! What a scenario works with: the HCA, the kernel under it, its options, its host, and the events seen so far;
//! waits (events, completions) are polled on the host's clock, or, with the interrupt-driven completion path, sleep
//! on the KEVENT each CQ's completion callback sets.

use alloc::boxed::Box;
use alloc::format;
use alloc::string::String;
use alloc::sync::Arc;
use alloc::vec::Vec;
use core::cell::RefCell;
use core::fmt;
use core::time::Duration;

use serde::Serialize;
use serde_json::{json, Value};
use vhca_driver_core::{ClMutexKind, CqCompletions, Hca, RingReuse};
use vhca_ntapi::PDEVICE_OBJECT;
use vhca_proto::{Cqe, Event, EventKind, FaultCause};

use crate::verbs::Buffer;
use crate::{lock_name, ScenarioHost, ScenarioOptions};

pub struct Ctx<'a, H: ScenarioHost> {
    pub hca: Hca<H::Kernel, H::Channel>,
    pub kernel: Arc<H::Kernel>,
    pub host: &'a H,
    pub options: &'a ScenarioOptions,
    pub(crate) timeout: Duration,
    events: Vec<Value>,
    /// A failure that must not stop the run before the driver unloads (the unload's checks come first).
    pub(crate) deferred: Option<String>,
    /// Buffers the scenario allocated and has not freed: what the run gives back when the host lets a stopped
    /// scenario unload through the driver's error path (`ScenarioHost::error_path`).
    buffers: RefCell<Vec<Buffer>>,
    /// The interrupt path, when the host connected one: CQ waits and events come from it.
    pub(crate) completions: Option<Box<dyn CqCompletions>>,
    /// The driver's own device object (`ScenarioHost::own_device`, else the PDO): what its work items are
    /// allocated for.
    pub(crate) own_device: PDEVICE_OBJECT,
    /// The HCA's PDO: what a scenario's own DMA adapter is asked for (IoGetDmaAdapter takes the PDO).
    pub(crate) pdo: PDEVICE_OBJECT,
}

impl<'a, H: ScenarioHost> Ctx<'a, H> {
    pub(crate) fn new(
        hca: Hca<H::Kernel, H::Channel>,
        kernel: Arc<H::Kernel>,
        host: &'a H,
        options: &'a ScenarioOptions,
        timeout: Duration,
        completions: Option<Box<dyn CqCompletions>>,
        (own_device, pdo): (PDEVICE_OBJECT, PDEVICE_OBJECT),
    ) -> Self {
        Ctx {
            hca,
            kernel,
            host,
            options,
            timeout,
            events: Vec::new(),
            deferred: None,
            buffers: RefCell::new(Vec::new()),
            completions,
            own_device,
            pdo,
        }
    }

    /// Remembers a buffer the scenario allocated until it frees it.
    pub(crate) fn own(&self, buffer: Buffer) -> Buffer {
        self.buffers.borrow_mut().push(buffer);
        buffer
    }

    pub(crate) fn disown(&self, buffer: &Buffer) {
        self.buffers.borrow_mut().retain(|b| b.va() != buffer.va());
    }

    /// Takes the buffers still owned, common buffers first (they need the adapter, so they go before the close).
    pub(crate) fn take_leftovers(&self) -> (Vec<Buffer>, Vec<Buffer>) {
        core::mem::take(&mut *self.buffers.borrow_mut()).into_iter().partition(|b| matches!(b, Buffer::Common { .. }))
    }

    /// Adds `key: value` to the result's details (kept if the machine bugchecks later).
    pub fn detail(&self, key: &str, value: impl Serialize) {
        let value = serde_json::to_value(value).unwrap_or_else(|e| Value::String(format!("unserialisable: {e}")));
        self.host.detail(key, value);
    }

    /// Fails the run after the driver has unloaded, so the verifier's unload checks still get their say.
    pub fn defer_failure(&mut self, why: String) {
        self.host.say(format_args!("failure, reported after unload: {why}"));
        self.deferred.get_or_insert(why);
    }

    pub fn say(&self, message: impl fmt::Display) {
        self.host.say(format_args!("{message}"));
    }

    /// The lock the control path takes: `vhca.lock` if given, else the scenario's choice; `vhca.break_fix`
    /// swaps a fixed choice for the seed's FAST_MUTEX.
    pub fn lock_kind(&self, scenario_choice: ClMutexKind) -> ClMutexKind {
        let kind = self.options.lock.unwrap_or(scenario_choice);
        let kind = if self.options.break_fix { ClMutexKind::FastMutex } else { kind };
        self.host.lock_chosen(lock_name(kind));
        kind
    }

    /// Takes every event the device has delivered. A DMA fault event is the device's own diagnostic, for the
    /// report: an IOMMU fault reaches the kernel from the platform (`report_platform_iommu_faults`), not from here.
    pub fn drain_events(&mut self) -> Vec<Event> {
        let mut out = Vec::new();
        // With the interrupt path its DPC takes every event off the device; those that are not CQ completions wait
        // there for this.
        let next = || match &self.completions {
            Some(c) => c.take_event(),
            None => self.hca.poll_event(),
        };
        while let Some(event) = next() {
            out.push(event);
        }
        for event in &out {
            let view = event_view(event);
            self.host.say(format_args!("event: {view}"));
            self.events.push(view);
            self.detail("events", &self.events);
        }
        out
    }

    /// The platform's IOMMU fault reports about this device, handed to the kernel (`ScenarioHost`).
    pub fn report_platform_iommu_faults(&mut self, wait: Duration) -> Option<usize> {
        self.host.report_platform_iommu_faults(wait)
    }

    /// Waits for an event of `kind`; every event seen on the way is drained as above. With the interrupt path it
    /// sleeps on the KEVENT its work item sets when it hands events over (`CqCompletions::wait_event`); without
    /// one, or on a path without a work item (whose wait returns at once), it polls.
    pub fn wait_event(&mut self, kind: EventKind, wait: Duration) -> Option<Event> {
        let deadline = self.host.now() + wait;
        loop {
            if let Some(e) = self.drain_events().into_iter().find(|e| e.kind.get() == kind as u32) {
                return Some(e);
            }
            let now = self.host.now();
            if now >= deadline {
                return None;
            }
            let handed_over = self.completions.as_ref().is_some_and(|c| c.wait_event(deadline - now));
            if !handed_over && self.host.now() < deadline {
                self.host.sleep(Duration::from_millis(2));
            }
        }
    }

    /// Waits until `want` completions of `cq` arrived, or fails naming how many did: polling, or with the
    /// interrupt path on the CQ's event.
    pub fn poll_cq(&mut self, cq: u32, want: usize) -> anyhow::Result<Vec<Cqe>> {
        if self.completions.is_some() {
            return self.wait_cq(cq, want);
        }
        let deadline = self.host.now() + self.timeout;
        let mut got = Vec::new();
        while got.len() < want {
            got.extend(self.hca.poll_cq(cq, want - got.len()).map_err(|e| anyhow::anyhow!("poll_cq: {e}"))?);
            if got.len() >= want {
                break;
            }
            anyhow::ensure!(
                self.host.now() < deadline,
                "CQ {cq}: {} of {want} completions within {:?}",
                got.len(),
                self.timeout
            );
            self.host.sleep(Duration::from_micros(200));
        }
        Ok(got)
    }
}

impl<H: ScenarioHost> Ctx<'_, H> {
    /// The interrupt path's wait: the first wait on a CQ watches and arms it, and asks the DPC for one look (CQEs
    /// written before the arm raise no event); then each wait sleeps on the CQ's KEVENT (PASSIVE_LEVEL) until its
    /// callback has queued enough, or the timeout passes.
    fn wait_cq(&mut self, cq: u32, want: usize) -> anyhow::Result<Vec<Cqe>> {
        let Some(completions) = self.completions.as_ref() else { anyhow::bail!("no completion path") };
        if !completions.is_watched(cq) {
            let reader = self.hca.cq_reader(cq).ok_or_else(|| anyhow::anyhow!("CQ {cq} is not open"))?;
            completions.watch(cq, reader);
            self.hca.req_notify_cq(cq, false).map_err(|e| anyhow::anyhow!("req_notify_cq: {e}"))?;
            completions.kick(cq);
        }
        let deadline = self.host.now() + self.timeout;
        let mut got = Vec::new();
        loop {
            got.extend(completions.take(cq, want - got.len()));
            let now = self.host.now();
            if got.len() >= want || now >= deadline {
                break;
            }
            completions.wait(cq, deadline - now);
        }
        anyhow::ensure!(got.len() >= want, "CQ {cq}: {} of {want} completions within {:?}", got.len(), self.timeout);
        Ok(got)
    }

    /// Destroys `cq`, after the interrupt path (if any) has let go of its ring.
    pub fn destroy_cq(&mut self, cq: u32) -> Result<(), vhca_driver_core::DriverError> {
        if let Some(c) = &self.completions {
            c.unwatch(cq);
        }
        self.hca.destroy_cq(cq)
    }

    /// `Hca::reset_cq`, the interrupt path letting go of the old CQ first (its reader ends with it).
    pub fn reset_cq(&mut self, cq: u32, reuse: RingReuse) -> Result<u32, vhca_driver_core::DriverError> {
        if let Some(c) = &self.completions {
            c.unwatch(cq);
        }
        self.hca.reset_cq(cq, reuse)
    }
}

fn event_view(e: &Event) -> Value {
    let kind = match EventKind::from_u32(e.kind.get()) {
        Some(EventKind::CqCompletion) => "cq_completion",
        Some(EventKind::QpFatal) => "qp_fatal",
        Some(EventKind::DmaFault) => "dma_fault",
        Some(EventKind::MapRegistersExhausted) => "map_registers_exhausted",
        None => "unknown",
    };
    let cause = FaultCause::from_u32(e.cause.get()).map_or("unknown", FaultCause::name);
    json!({"kind": kind, "handle": e.handle.get(), "cause": cause, "detail": e.detail.get(),
           "addr": format!("{:#x}", e.addr.get())})
}
