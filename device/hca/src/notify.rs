//! Everything the HCA tells the outside: log events to the sink, and asynchronous events (queue 1) held until the
//! transport has a driver buffer to put them in.

use std::collections::VecDeque;
use std::sync::Arc;

use vhca_proto::{Event, EventKind, FaultCause};

use crate::event_records::{EventSink, HcaEvent};

/// Async events held while the driver posts no event buffers; beyond this the newest are dropped (and logged).
const ASYNC_QUEUE_LIMIT: usize = 1024;

pub struct Notifier {
    sink: Arc<dyn EventSink>,
    /// `sink.keeps_events()`, asked once.
    keeps: bool,
    pending: VecDeque<Event>,
}

impl Notifier {
    pub fn new(sink: Arc<dyn EventSink>) -> Notifier {
        Notifier { keeps: sink.keeps_events(), sink, pending: VecDeque::new() }
    }

    pub fn emit(&self, event: HcaEvent) {
        if self.keeps {
            self.sink.emit(event);
        }
    }

    /// `emit` for the records made on every DMA, doorbell and completion: built only if the sink keeps them.
    #[inline]
    pub fn emit_with(&self, build: impl FnOnce() -> HcaEvent) {
        if self.keeps {
            self.sink.emit(build());
        }
    }

    /// See `EventSink::request_started` (a clock for stamping events: not asked of a sink that keeps none).
    pub fn request_started(&self) {
        if self.keeps {
            self.sink.request_started();
        }
    }

    pub fn push_async(&mut self, kind: EventKind, handle: u32, cause: FaultCause, detail: u32, addr: u64) {
        let queued = self.pending.len() < ASYNC_QUEUE_LIMIT;
        self.emit(HcaEvent::AsyncEvent { event: kind_name(kind), handle, cause: cause.name(), detail, queued });
        if queued {
            self.pending.push_back(Event {
                kind: (kind as u32).into(),
                handle: handle.into(),
                cause: (cause as u32).into(),
                detail: detail.into(),
                addr: addr.into(),
                reserved: 0.into(),
            });
        }
    }

    pub fn pop_async(&mut self) -> Option<Event> {
        self.pending.pop_front()
    }
}

pub fn kind_name(kind: EventKind) -> &'static str {
    match kind {
        EventKind::CqCompletion => "cq_completion",
        EventKind::QpFatal => "qp_fatal",
        EventKind::DmaFault => "dma_fault",
        EventKind::MapRegistersExhausted => "map_registers_exhausted",
    }
}
