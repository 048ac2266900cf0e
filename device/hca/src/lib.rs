//! The emulated HCA, independent of how it is transported: commands in, responses and DMA out.
//! The vhost-user transport (crate vhca-device) and the in-process tests drive it through the same `Dma` trait.

mod commands;
mod completions;
mod cq;
pub mod dma_access;
mod dma_engine;
mod doorbells;
pub mod event_records;
pub mod fault_injection;
mod handles;
mod hca;
mod held_work;
pub mod invariants;
mod map_registers;
mod mapped_pages;
mod mr;
mod notify;
mod pd;
mod qp;
mod work_requests;

pub use dma_access::{CopyEnd, Dma, DmaError};
pub use event_records::{EventSink, FaultEvent, HcaEvent, NullSink, EVENT_SCHEMA_VERSION};
pub use fault_injection::{ContiguousPolicy, FaultInjection, InjectionParseError};
pub use hca::{Hca, HcaConfig};
