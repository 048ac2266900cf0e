//! The vhca wire format: the one description of every byte the device and its driver exchange.
//! `no_std`, little-endian, fixed layouts; both sides encode and decode through these types only.
#![no_std]

pub mod command;
pub mod config;
pub mod doorbell;
pub mod event;
pub mod status;
pub mod work;

pub use command::*;
pub use config::*;
pub use doorbell::*;
pub use event::*;
pub use status::Status;
pub use work::*;

/// Page size of every ring, MR page list and map register: the guest's and the IOMMU's 4 KiB page.
pub const PAGE_SIZE: u64 = 4096;
