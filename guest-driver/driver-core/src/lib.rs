//! The vhca HCA driver core: verbs (CQ, QP, MR, PD), rings and the control-path lock, written only against the
//! NT-shaped kernel interface (`vhca_ntapi::NtKernel`) and a `CommandChannel`. No platform code lives here.
#![no_std]

extern crate alloc;

mod channel;
mod cl_mutex;
mod command_codec;
mod dma_delivery;
mod error;
mod hca;
mod ring;

pub use channel::{ChannelError, CommandChannel};
pub use cl_mutex::{ClMutex, ClMutexKind};
pub use error::DriverError;
pub use hca::{Hca, HcaConfig, MrMapping, MrSource, RegisteredMr};
pub use ring::RingMemory;
