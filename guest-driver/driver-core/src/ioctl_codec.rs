//! The device-control ABI a user-mode verbs provider speaks to vhca's device interface: the IOCTL codes (CTL_CODE
//! of our device type), each one's fixed input and output layouts, and the NTSTATUS values the dispatcher answers.

use vhca_ntapi::NTSTATUS;
use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// Our device type: 0x8000 and above are the vendor range (below is Microsoft's); 0x56 is 'V'.
pub const FILE_DEVICE_VHCA: u32 = 0x8056;

/// GUID_DEVINTERFACE_VHCA, the device interface class vhca.sys registers and a user-mode provider looks up (our own
/// class: no Microsoft class fits an RDMA verbs provider's private IOCTLs), as GUID::from_u128 takes it.
pub const DEVICE_INTERFACE_GUID: u128 = 0x5648_4341_7665_7262_a5c3_1d2e_8f40_9b76;

/// How the I/O manager passes the buffers (the low two bits of a code).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferMethod {
    /// Both buffers copied through Irp->AssociatedIrp.SystemBuffer.
    Buffered = 0,
    /// Input buffered; the output buffer described by Irp->MdlAddress, probed for read (data into the driver).
    InDirect = 1,
    /// Input buffered; the output buffer described by Irp->MdlAddress, probed for write (data out of the driver).
    OutDirect = 2,
    Neither = 3,
}

/// FILE_READ_DATA | FILE_WRITE_DATA: the I/O manager refuses a code with these bits on a handle not opened for
/// them, before the driver sees it. Every code that changes state asks for both; QUERY_DEVICE only reads.
const FILE_READ_DATA: u32 = 1;
const FILE_READ_WRITE: u32 = 3;

/// Windows' CTL_CODE macro (devioctl.h).
pub const fn ctl_code(device_type: u32, function: u32, method: TransferMethod, access: u32) -> u32 {
    (device_type << 16) | (access << 14) | (function << 2) | method as u32
}

pub const fn method_of(code: u32) -> TransferMethod {
    match code & 3 {
        0 => TransferMethod::Buffered,
        1 => TransferMethod::InDirect,
        2 => TransferMethod::OutDirect,
        _ => TransferMethod::Neither,
    }
}

// Functions from 0x800 up are vendor-defined.
pub const IOCTL_VHCA_OPEN_CONTEXT: u32 = ctl_code(FILE_DEVICE_VHCA, 0x800, TransferMethod::Buffered, FILE_READ_WRITE);
pub const IOCTL_VHCA_QUERY_DEVICE: u32 = ctl_code(FILE_DEVICE_VHCA, 0x801, TransferMethod::Buffered, FILE_READ_DATA);
pub const IOCTL_VHCA_ALLOC_PD: u32 = ctl_code(FILE_DEVICE_VHCA, 0x802, TransferMethod::Buffered, FILE_READ_WRITE);
pub const IOCTL_VHCA_DEALLOC_PD: u32 = ctl_code(FILE_DEVICE_VHCA, 0x803, TransferMethod::Buffered, FILE_READ_WRITE);
pub const IOCTL_VHCA_CREATE_CQ: u32 = ctl_code(FILE_DEVICE_VHCA, 0x804, TransferMethod::Buffered, FILE_READ_WRITE);
pub const IOCTL_VHCA_DESTROY_CQ: u32 = ctl_code(FILE_DEVICE_VHCA, 0x805, TransferMethod::Buffered, FILE_READ_WRITE);
pub const IOCTL_VHCA_CREATE_QP: u32 = ctl_code(FILE_DEVICE_VHCA, 0x806, TransferMethod::Buffered, FILE_READ_WRITE);
pub const IOCTL_VHCA_DESTROY_QP: u32 = ctl_code(FILE_DEVICE_VHCA, 0x807, TransferMethod::Buffered, FILE_READ_WRITE);
pub const IOCTL_VHCA_CONNECT_QP: u32 = ctl_code(FILE_DEVICE_VHCA, 0x808, TransferMethod::Buffered, FILE_READ_WRITE);
/// Buffered although it names a buffer: the MR outlives the IRP, and an IN/OUT_DIRECT MDL is unlocked when the IRP
/// completes. The driver probes and locks the buffer itself, in the caller's context, for the MR's life.
pub const IOCTL_VHCA_REG_MR: u32 = ctl_code(FILE_DEVICE_VHCA, 0x809, TransferMethod::Buffered, FILE_READ_WRITE);
pub const IOCTL_VHCA_DEREG_MR: u32 = ctl_code(FILE_DEVICE_VHCA, 0x80A, TransferMethod::Buffered, FILE_READ_WRITE);
/// The WQE array in the MDL buffer, read by the driver during the IRP alone.
pub const IOCTL_VHCA_POST_SEND: u32 = ctl_code(FILE_DEVICE_VHCA, 0x80B, TransferMethod::InDirect, FILE_READ_WRITE);
pub const IOCTL_VHCA_POST_RECV: u32 = ctl_code(FILE_DEVICE_VHCA, 0x80C, TransferMethod::InDirect, FILE_READ_WRITE);
/// The CQE array written into the MDL buffer.
pub const IOCTL_VHCA_POLL_CQ: u32 = ctl_code(FILE_DEVICE_VHCA, 0x80D, TransferMethod::OutDirect, FILE_READ_WRITE);
pub const IOCTL_VHCA_REQ_NOTIFY_CQ: u32 = ctl_code(FILE_DEVICE_VHCA, 0x80E, TransferMethod::Buffered, FILE_READ_WRITE);
/// POLL_CQ that waits: the CQEs now if there are any, otherwise the request stays pending until the CQ has some (or
/// it is cancelled, its CQ destroyed, its file cleaned up). Input PollCqIn, output as POLL_CQ's.
pub const IOCTL_VHCA_WAIT_CQ: u32 = ctl_code(FILE_DEVICE_VHCA, 0x80F, TransferMethod::OutDirect, FILE_READ_WRITE);

/// The ABI OPEN_CONTEXT agrees on; a caller asking for another is refused rather than guessed at.
pub const USER_ABI_VERSION: u32 = 1;
/// Most WQEs one POST_SEND/POST_RECV and CQEs one POLL_CQ carry: bounds the time one IRP holds the control path.
pub const MAX_WORK_PER_REQUEST: u32 = 64;
/// Most objects of each kind one file may hold, so one process cannot take the whole HCA.
pub const MAX_OBJECTS_PER_FILE: usize = 64;

// Statuses the dispatcher answers that ntapi has no use for elsewhere (values from ntstatus.h).
pub const STATUS_INVALID_HANDLE: NTSTATUS = NTSTATUS(0xC000_0008_u32 as i32);
pub const STATUS_INVALID_DEVICE_STATE: NTSTATUS = NTSTATUS(0xC000_0184_u32 as i32);
pub const STATUS_IO_DEVICE_ERROR: NTSTATUS = NTSTATUS(0xC000_0185_u32 as i32);
pub const STATUS_DEVICE_BUSY: NTSTATUS = NTSTATUS(0x8000_0011_u32 as i32);

macro_rules! ioctl_layout {
    ($(#[$m:meta])* $name:ident { $($(#[$fm:meta])* $field:ident: $ty:ty),* $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
        #[repr(C)]
        pub struct $name { $($(#[$fm])* pub $field: $ty),* }
    };
}

ioctl_layout!(OpenContextIn { abi_version: U32, reserved: U32 });
ioctl_layout!(OpenContextOut { abi_version: U32, max_objects: U32, max_work_per_request: U32, reserved: U32 });
ioctl_layout!(
    /// DEALLOC_PD, DESTROY_CQ, DESTROY_QP, DEREG_MR: the one handle (PD, CQ, QP number, MR lkey).
    HandleIn { handle: U32, reserved: U32 }
);
ioctl_layout!(
    /// ALLOC_PD, CREATE_QP: the new handle.
    HandleOut { handle: U32, reserved: U32 }
);
ioctl_layout!(CreateCqIn { entries: U32, reserved: U32 });
ioctl_layout!(CreateCqOut { cq: U32, entries: U32 });
ioctl_layout!(CreateQpIn { pd: U32, send_cq: U32, recv_cq: U32, sq_entries: U32, rq_entries: U32, reserved: U32 });
ioctl_layout!(ConnectQpIn { qpn: U32, dest_qpn: U32, access: U32, reserved: U32 });
ioctl_layout!(
    /// `addr` is the caller's own virtual address; the driver probes and locks it in the caller's context.
    RegMrIn { addr: U64, length: U32, pd: U32, access: U32, reserved: U32 }
);
ioctl_layout!(RegMrOut { addr: U64, length: U32, lkey: U32, rkey: U32, reserved: U32 });
ioctl_layout!(
    /// POST_SEND/POST_RECV: `count` WQEs (proto's 64-byte Wqe) follow in the MDL buffer.
    PostIn { qpn: U32, count: U32 }
);
ioctl_layout!(
    /// POLL_CQ: up to `max` CQEs (proto's 32-byte Cqe) are written into the MDL buffer.
    PollCqIn { cq: U32, max: U32 }
);
ioctl_layout!(
    /// REQ_NOTIFY_CQ: `flags` bit 0 = solicited completions only; the other bits are reserved.
    NotifyCqIn { cq: U32, flags: U32 }
);

pub const NOTIFY_SOLICITED_ONLY: u32 = 1;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_windows_ctl_codes_of_our_type() {
        // CTL_CODE(0x8056, 0x800, METHOD_BUFFERED, FILE_READ_DATA | FILE_WRITE_DATA) as devioctl.h computes it.
        assert_eq!(IOCTL_VHCA_OPEN_CONTEXT, 0x8056_E000);
        assert_eq!(IOCTL_VHCA_QUERY_DEVICE, 0x8056_6004);
        assert_eq!(method_of(IOCTL_VHCA_POST_SEND), TransferMethod::InDirect);
        assert_eq!(method_of(IOCTL_VHCA_POLL_CQ), TransferMethod::OutDirect);
        assert_eq!(method_of(IOCTL_VHCA_REG_MR), TransferMethod::Buffered);
    }
}
