//! The vhca HCA driver core: verbs (CQ, QP, MR, PD), rings and the control-path lock, written only against the
//! NT-shaped kernel interface (`vhca_ntapi::NtKernel`) and a `CommandTransport`. No platform code lives here.
#![no_std]

extern crate alloc;

mod cl_mutex;
mod command_codec;
mod command_event;
mod command_transport;
mod completion_path;
mod completion_waits;
mod cq_reader;
mod device_control;
mod dma_delivery;
mod error;
mod event_hand_off;
mod hca;
pub mod ioctl_codec;
mod ring;
mod user_verbs;

pub use cl_mutex::{ClMutex, ClMutexKind};
pub use command_event::CommandEvent;
pub use command_transport::{CommandTransport, CommandTransportError, CompletionSignal};
pub use completion_path::{
    CompletionCallback, CompletionCounts, CompletionHooks, CompletionPath, EventCallback, IsrWork, PathRoutine,
    RoutineObserver, DEFAULT_CQE_BUDGET,
};
pub use completion_waits::{CompletionWaits, CqCompletions, PathDevices};
pub use cq_reader::CqReader;
pub use device_control::{
    dispatch as dispatch_device_control, poll_for_wait, status_of, ControlReply, FileContext, ReleasedObjects,
};
pub use error::DriverError;
pub use event_hand_off::HandOffCounts;
pub use hca::{Hca, HcaConfig, MrMapping, MrSource, RegisteredMr, RingReuse};
pub use ring::RingMemory;
pub use user_verbs::UserVerbs;
