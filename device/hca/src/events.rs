//! What the HCA reports for the event log. The transport decides where the lines go.

use serde::Serialize;

/// One thing the HCA did or refused. Serialised with `"kind"` as tag into the device's JSON-lines event log.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum HcaEvent {
    Command { opcode: String, tag: u32, status: String },
}

pub trait EventSink: Send + Sync {
    fn emit(&self, event: HcaEvent);
}
