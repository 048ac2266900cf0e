//! Why a verb failed: the kernel refused a resource, the device refused the command, or the channel broke.

use vhca_ntapi::NTSTATUS;
use vhca_proto::{Opcode, Status};

use crate::command_transport::CommandTransportError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DriverError {
    /// A kernel routine failed (MapTransfer out of map registers, probe-and-lock of a bad address, ...).
    Kernel {
        routine: &'static str,
        status: NTSTATUS,
    },
    /// The kernel queued the routine's execution routine until map registers free up; the driver does not wait
    /// for it (a late routine gives its resources straight back).
    DmaQueued {
        routine: &'static str,
    },
    /// An allocation returned NULL (contiguous memory, common buffer, pool, MDL).
    NoMemory {
        routine: &'static str,
        bytes: u64,
    },
    /// The device answered the command with an error status.
    Device {
        opcode: Opcode,
        status: Status,
    },
    /// The response did not match what the command expects.
    BadResponse {
        opcode: Opcode,
        reason: &'static str,
    },
    Transport(CommandTransportError),
    /// A handle (CQ, QP, MR key, PD) the driver does not know.
    UnknownHandle(u32),
    /// A parameter the device could never accept (zero entries, too many pages for one command, ...).
    InvalidParameter(&'static str),
    /// The work queue has no free slot.
    QueueFull,
}

impl core::fmt::Display for DriverError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            DriverError::Kernel { routine, status } => write!(f, "{routine} failed with status {:#010x}", status.0),
            DriverError::DmaQueued { routine } => {
                write!(f, "{routine} queued its execution routine (map registers short); request given up")
            }
            DriverError::NoMemory { routine, bytes } => write!(f, "{routine} could not allocate {bytes} bytes"),
            DriverError::Device { opcode, status } => write!(f, "{} refused: {}", opcode.name(), status.name()),
            DriverError::BadResponse { opcode, reason } => write!(f, "{} response malformed: {reason}", opcode.name()),
            DriverError::Transport(e) => write!(f, "command transport: {e}"),
            DriverError::UnknownHandle(h) => write!(f, "unknown handle {h}"),
            DriverError::InvalidParameter(p) => write!(f, "invalid parameter: {p}"),
            DriverError::QueueFull => write!(f, "work queue full"),
        }
    }
}

impl From<CommandTransportError> for DriverError {
    fn from(e: CommandTransportError) -> DriverError {
        DriverError::Transport(e)
    }
}
