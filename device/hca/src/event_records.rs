//! What the HCA reports for the event log (schema: docs/events.md, version `EVENT_SCHEMA_VERSION`).
//! The HCA only builds these; the transport decides where the lines go and adds "seq" and "t_us".

use std::borrow::Cow;

use serde::Serialize;

/// Version of the event-log schema in docs/events.md. Bumped when a kind or field changes meaning or goes away.
pub const EVENT_SCHEMA_VERSION: u32 = 1;

/// One thing the HCA did or refused. Serialised with `"kind"` as tag into the device's JSON-lines event log.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum HcaEvent {
    /// A command finished.
    Command { opcode: String, tag: u32, status: String },
    /// Why a command was refused; precedes its `command` line.
    Refused { opcode: String, tag: u32, reason: String },
    /// A command created or destroyed an object (`object`: pd, cq, qp, mr; `handle`: its handle, QPN or lkey).
    Object { action: &'static str, object: &'static str, handle: u32, tag: u32 },
    /// Registers were taken for an object's pages. `in_use`/`free`: the pool after the change; `total`: its size.
    Map { owner: &'static str, handle: u32, registers: u32, first_iova: u64, in_use: u32, free: u32, total: u32 },
    /// Registers went back to the pool.
    Unmap { owner: &'static str, handle: u32, registers: u32, in_use: u32, free: u32, total: u32 },
    /// A command asked for more registers than were free; the pool is unchanged (`in_use`, `total` as before).
    MapRegistersExhausted {
        owner: &'static str,
        opcode: String,
        tag: u32,
        wanted: u32,
        free: u32,
        in_use: u32,
        total: u32,
    },
    /// One DMA the device made (or tried), through map registers. `n`: its 1-based ordinal (see invalidate_at_dma).
    Dma {
        n: u64,
        dir: &'static str,
        iova: u64,
        len: u64,
        purpose: &'static str,
        #[serde(skip_serializing_if = "Option::is_none")]
        qpn: Option<u32>,
        #[serde(skip_serializing_if = "Option::is_none")]
        wr_id: Option<u64>,
        ok: bool,
    },
    /// A check refused an access. Names the work request (qpn, wr_id) or the command (opcode, tag) behind it. Boxed:
    /// refusals are rare, and every event the log queues is as large as the largest kind (one per DMA is queued).
    Fault(Box<FaultEvent>),
    /// A QP changed state; `reason` is "modify_qp" or what forced it.
    QpState { qpn: u32, from: &'static str, to: &'static str, reason: String },
    /// A CQE was written (or, with `written: false`, could not be).
    Completion {
        cq: u32,
        index: u32,
        qpn: u32,
        wr_id: u64,
        opcode: &'static str,
        status: &'static str,
        vendor_err: &'static str,
        byte_len: u32,
        written: bool,
    },
    /// A fault-injection knob fired. `what`: the knob; `n`: the count it fired at.
    Injected { what: &'static str, n: u64, detail: String },
    /// A doorbell record was accepted (`ok`) or refused, with why.
    Doorbell {
        /// The kind's name ("sq", "rq", "cq_arm"), or its number when unknown: borrowed for the known kinds, so a
        /// doorbell costs no allocation.
        db: Cow<'static, str>,
        handle: u32,
        index: u32,
        ok: bool,
        #[serde(skip_serializing_if = "Option::is_none")]
        detail: Option<String>,
    },
    /// An IOTLB invalidation (from QEMU or injected) met registers: they are stale until re-validated.
    TranslationsStale { iova: u64, size: u64, registers: u32, injected: bool },
    /// Stale registers a transfer was about to use that the vIOMMU still maps where they led when taken: fresh again
    /// (the invalidation was wider than the unmap behind it).
    TranslationsConfirmed { registers: u32 },
    /// The request `hold_completion_ms` held (its `injected` line) stopped being held: `reason` "timer" (it executes
    /// now), "qp_flushed", "qp_reset" or "qp_destroyed" (it never will).
    HoldReleased { qpn: u32, sq_index: u32, n: u64, reason: &'static str },
    /// An asynchronous event queued for queue 1.
    AsyncEvent { event: &'static str, handle: u32, cause: &'static str, detail: u32, queued: bool },
}

/// The fields of a `fault` line.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FaultEvent {
    pub cause: &'static str,
    pub dir: &'static str,
    pub purpose: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iova: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub addr: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub key: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub register: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub qpn: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub wr_id: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub opcode: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tag: Option<u32>,
}

pub trait EventSink: Send + Sync {
    fn emit(&self, event: HcaEvent);

    /// Whether the sink keeps events at all. One that drops every event says no, and the HCA then builds no
    /// event records for it (one per DMA, doorbell and completion would be built only to be dropped). Nothing
    /// else changes: the driver's async events, statuses and every check are the same either way.
    fn keeps_events(&self) -> bool {
        true
    }

    /// The HCA starts on a new request (a command, a doorbell record, an IOTLB invalidation): a sink that stamps
    /// events with a time may read its clock here once and stamp the request's events with it.
    fn request_started(&self) {}
}

/// A sink that throws events away (benchmarks, callers that do not log).
pub struct NullSink;

impl EventSink for NullSink {
    fn emit(&self, _event: HcaEvent) {}

    fn keeps_events(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fault_line_is_flat_and_leaves_out_what_it_does_not_know() {
        let fault = HcaEvent::Fault(Box::new(FaultEvent {
            cause: "stale_register",
            dir: "read",
            purpose: "payload",
            iova: Some(0x8000_1000),
            addr: None,
            key: None,
            register: Some(3),
            qpn: Some(7),
            wr_id: Some(42),
            opcode: None,
            tag: None,
        }));
        let line = serde_json::to_string(&fault).unwrap();
        assert_eq!(
            line,
            r#"{"kind":"fault","cause":"stale_register","dir":"read","purpose":"payload","iova":2147487744,"register":3,"qpn":7,"wr_id":42}"#
        );
    }

    /// The device's log queues every event as large as the largest kind, one per DMA: a kind that grows past this
    /// (as `fault` did before it was boxed, 152 bytes) adds memory traffic to every DMA of a logged run.
    #[test]
    fn events_stay_small_enough_to_queue_one_per_dma() {
        assert!(std::mem::size_of::<HcaEvent>() <= 96, "HcaEvent is {} bytes", std::mem::size_of::<HcaEvent>());
    }
}
