//! Commands on the command queue (queue 0). A request chain is device-readable `CommandHeader` + request body,
//! followed by device-writable `ResponseHeader` + response body. Page lists (ring pages, MR pages) follow their fixed
//! request body inline as little-endian u64 IOVAs, one per 4 KiB page.

use zerocopy::little_endian::{U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

wire_enum! {
    pub enum Opcode {
        QueryDevice = 1 => "QUERY_DEVICE",
        QueryPort = 2 => "QUERY_PORT",
        AllocPd = 3 => "ALLOC_PD",
        DeallocPd = 4 => "DEALLOC_PD",
        CreateCq = 5 => "CREATE_CQ",
        DestroyCq = 6 => "DESTROY_CQ",
        ReqNotifyCq = 7 => "REQ_NOTIFY_CQ",
        RegMr = 8 => "REG_MR",
        DeregMr = 9 => "DEREG_MR",
        CreateQp = 10 => "CREATE_QP",
        ModifyQp = 11 => "MODIFY_QP",
        DestroyQp = 12 => "DESTROY_QP",
    }
}

impl Opcode {
    /// Size of the fixed request body (without any trailing page list).
    pub fn request_size(self) -> usize {
        use core::mem::size_of;
        match self {
            Opcode::QueryDevice | Opcode::AllocPd => 0,
            Opcode::QueryPort => size_of::<QueryPortReq>(),
            Opcode::DeallocPd | Opcode::DestroyCq | Opcode::DeregMr | Opcode::DestroyQp => size_of::<HandleReq>(),
            Opcode::CreateCq => size_of::<CreateCqReq>(),
            Opcode::ReqNotifyCq => size_of::<ReqNotifyCqReq>(),
            Opcode::RegMr => size_of::<RegMrReq>(),
            Opcode::CreateQp => size_of::<CreateQpReq>(),
            Opcode::ModifyQp => size_of::<ModifyQpReq>(),
        }
    }

    /// Size of the response body the driver must leave room for after the `ResponseHeader`.
    pub fn response_size(self) -> usize {
        use core::mem::size_of;
        match self {
            Opcode::QueryDevice => size_of::<QueryDeviceResp>(),
            Opcode::QueryPort => size_of::<QueryPortResp>(),
            Opcode::AllocPd | Opcode::CreateCq | Opcode::CreateQp => size_of::<HandleResp>(),
            Opcode::RegMr => size_of::<RegMrResp>(),
            Opcode::DeallocPd
            | Opcode::DestroyCq
            | Opcode::ReqNotifyCq
            | Opcode::DeregMr
            | Opcode::ModifyQp
            | Opcode::DestroyQp => 0,
        }
    }
}

/// Leads every request. `tag` is the driver's and comes back unchanged in the response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct CommandHeader {
    pub opcode: U32,
    pub tag: U32,
    /// Bytes after this header: fixed body plus any page list.
    pub body_len: U32,
    pub reserved: U32,
}

/// Leads every response. The device always writes it, also when it refuses the command.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct ResponseHeader {
    /// A `Status` value.
    pub status: U32,
    pub opcode: U32,
    pub tag: U32,
    /// Bytes of response body the device wrote after this header.
    pub body_len: U32,
}

/// The page IOVAs a request lists after its fixed body, as the layout puts them, without judging them (none when
/// the header, opcode or body length does not hold): for observers that must know what a request names whatever
/// the device makes of it (the HCA's property tests and its fuzz harness allow its DMA to those pages).
pub fn listed_pages(request: &[u8]) -> impl Iterator<Item = u64> + '_ {
    let list = CommandHeader::read_from_prefix(request).ok().and_then(|(header, rest)| {
        let opcode = Opcode::from_u32(header.opcode.get())?;
        let body = rest.get(..usize::try_from(header.body_len.get()).ok()?)?;
        body.get(opcode.request_size()..)
    });
    list.unwrap_or(&[]).chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
}

pub const COMMAND_HEADER_SIZE: usize = core::mem::size_of::<CommandHeader>();
pub const RESPONSE_HEADER_SIZE: usize = core::mem::size_of::<ResponseHeader>();
/// Largest request the device accepts (header, body and page list): bounds what one command can make it read.
pub const MAX_REQUEST_SIZE: usize = 16 * 1024;
/// Largest page list in one command: what fits in `MAX_REQUEST_SIZE` next to the largest fixed body.
pub const MAX_PAGES_PER_COMMAND: usize = 1024;

/// For commands that name one object: DEALLOC_PD, DESTROY_CQ, DEREG_MR (lkey), DESTROY_QP.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct HandleReq {
    pub handle: U32,
    pub reserved: U32,
}

/// For commands that create one object: ALLOC_PD, CREATE_CQ, CREATE_QP (the QP number).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct HandleResp {
    pub handle: U32,
    pub reserved: U32,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct QueryDeviceResp {
    pub abi_version: U32,
    pub vendor_id: U32,
    pub max_pd: U32,
    pub max_cq: U32,
    pub max_cqe: U32,
    pub max_qp: U32,
    pub max_qp_wr: U32,
    pub max_sge: U32,
    pub max_mr: U32,
    pub map_registers_total: U32,
    pub map_registers_free: U32,
    pub page_size: U32,
    pub fw_version: U64,
    pub node_guid: U64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct QueryPortReq {
    pub port: U32,
    pub reserved: U32,
}

/// ibverbs port states; vhca's one port is always ACTIVE.
pub const PORT_STATE_ACTIVE: u32 = 4;
/// ibverbs MTU enum: 5 = 4096 bytes.
pub const MTU_4096: u32 = 5;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct QueryPortResp {
    pub state: U32,
    pub max_mtu: U32,
    pub active_mtu: U32,
    pub lid: U32,
    pub gid: [u8; 16],
}

/// CREATE_CQ: `entries` CQEs (a power of two) in a ring spread over `page_count` pages listed after this body.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct CreateCqReq {
    pub entries: U32,
    pub page_count: U32,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct ReqNotifyCqReq {
    pub cq: U32,
    /// 1: notify only for solicited completions.
    pub solicited_only: U32,
}

/// ibverbs access flags.
pub const ACCESS_LOCAL_WRITE: u32 = 1;
pub const ACCESS_REMOTE_WRITE: u32 = 2;
pub const ACCESS_REMOTE_READ: u32 = 4;
pub const ACCESS_ALL: u32 = ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE | ACCESS_REMOTE_READ;

/// REG_MR: registers `length` bytes at MR address `addr` (what SGEs and remote addresses use). The bytes live in the
/// listed pages, the first used from `first_page_offset`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct RegMrReq {
    pub pd: U32,
    pub access: U32,
    pub addr: U64,
    pub length: U64,
    pub first_page_offset: U32,
    pub page_count: U32,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct RegMrResp {
    pub lkey: U32,
    pub rkey: U32,
}

pub const QP_TYPE_RC: u32 = 2;

/// CREATE_QP: rings of `sq_entries` and `rq_entries` WQEs (powers of two); page list: SQ pages then RQ pages.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct CreateQpReq {
    pub pd: U32,
    pub qp_type: U32,
    pub send_cq: U32,
    pub recv_cq: U32,
    pub sq_entries: U32,
    pub rq_entries: U32,
    pub sq_page_count: U32,
    pub rq_page_count: U32,
}

wire_enum! {
    /// ibverbs QP states.
    pub enum QpState {
        Reset = 0 => "RESET",
        Init = 1 => "INIT",
        Rtr = 2 => "RTR",
        Rts = 3 => "RTS",
        Sqd = 4 => "SQD",
        Sqe = 5 => "SQE",
        Err = 6 => "ERR",
    }
}

/// MODIFY_QP attribute mask bits (which fields below are meant).
pub const QP_ATTR_STATE: u32 = 1;
pub const QP_ATTR_ACCESS_FLAGS: u32 = 8;
pub const QP_ATTR_DEST_QPN: u32 = 0x100000;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct ModifyQpReq {
    pub qpn: U32,
    pub attr_mask: U32,
    /// A `QpState` value.
    pub state: U32,
    /// The peer QP on this device (loopback).
    pub dest_qpn: U32,
    /// Remote access the QP allows (ACCESS_REMOTE_*).
    pub access: U32,
    pub reserved: U32,
}

/// Bytes a request takes: header, a fixed body of `body` bytes, and `pages` page-list entries. `None` on overflow.
pub fn request_len(body: usize, pages: usize) -> Option<usize> {
    pages.checked_mul(8)?.checked_add(body)?.checked_add(COMMAND_HEADER_SIZE)
}

/// Encodes a request (`CommandHeader`, fixed body, page list as little-endian u64s) into `out`, which must be exactly
/// `request_len(body.len(), pages.len())` bytes. `None` if it is not, or if the body length does not fit the header.
/// Without allocation, so the `no_std` driver core and the tests share the one encoding.
pub fn encode_request(out: &mut [u8], opcode: Opcode, tag: u32, body: &[u8], pages: &[u64]) -> Option<()> {
    if request_len(body.len(), pages.len())? != out.len() {
        return None;
    }
    let body_len = u32::try_from(out.len() - COMMAND_HEADER_SIZE).ok()?;
    let header = CommandHeader {
        opcode: (opcode as u32).into(),
        tag: tag.into(),
        body_len: body_len.into(),
        reserved: 0.into(),
    };
    let (head, rest) = out.split_at_mut(COMMAND_HEADER_SIZE);
    head.copy_from_slice(header.as_bytes());
    let (fixed, list) = rest.split_at_mut(body.len());
    fixed.copy_from_slice(body);
    for (slot, page) in list.chunks_exact_mut(8).zip(pages) {
        slot.copy_from_slice(&page.to_le_bytes());
    }
    Some(())
}
