//! The emulated HCA, independent of how it is transported: commands in, responses and DMA out.
//! The vhost-user transport (crate vhca-device) and the in-process tests drive it through the same `Dma` trait.

pub mod dma;
pub mod events;
mod hca;

pub use dma::{Dma, DmaError};
pub use events::{EventSink, HcaEvent};
pub use hca::{Hca, HcaConfig};
