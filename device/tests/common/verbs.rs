//! The driver's side of the verbs, as bytes: command requests, WQEs and doorbell records built from proto's
//! layouts, and responses and CQEs parsed back. Knows nothing of transports; the socket tests and benches share it.
#![allow(dead_code)]

use vhca_proto::status::WcStatus;
use vhca_proto::*;
use zerocopy::{FromBytes, IntoBytes};

/// A command request: header, fixed body, then the page list.
pub fn request(opcode: Opcode, tag: u32, body: &[u8], pages: &[u64]) -> Vec<u8> {
    let mut req = vec![0; request_len(body.len(), pages.len()).expect("request size")];
    encode_request(&mut req, opcode, tag, body, pages).expect("request encodes");
    req
}

/// Status, echoed tag and body of a response.
pub fn parse_response(bytes: &[u8]) -> (Status, u32, Vec<u8>) {
    let (header, rest) = ResponseHeader::read_from_prefix(bytes).expect("response header");
    let status = Status::from_u32(header.status.get()).expect("known status");
    let len = header.body_len.get() as usize;
    (status, header.tag.get(), rest[..len].to_vec())
}

pub fn handle_of(body: &[u8]) -> u32 {
    HandleResp::read_from_bytes(body).expect("handle response").handle.get()
}

pub fn handle_req(handle: u32) -> Vec<u8> {
    HandleReq { handle: handle.into(), reserved: 0.into() }.as_bytes().to_vec()
}

pub fn create_cq_body(entries: u32, pages: u32) -> Vec<u8> {
    CreateCqReq { entries: entries.into(), page_count: pages.into() }.as_bytes().to_vec()
}

pub fn reg_mr_body(pd: u32, access: u32, addr: u64, length: u64, pages: u32) -> Vec<u8> {
    RegMrReq {
        pd: pd.into(),
        access: access.into(),
        addr: addr.into(),
        length: length.into(),
        first_page_offset: 0.into(),
        page_count: pages.into(),
    }
    .as_bytes()
    .to_vec()
}

pub fn create_qp_body(pd: u32, cq: u32, sq_entries: u32, rq_entries: u32) -> Vec<u8> {
    CreateQpReq {
        pd: pd.into(),
        qp_type: QP_TYPE_RC.into(),
        send_cq: cq.into(),
        recv_cq: cq.into(),
        sq_entries: sq_entries.into(),
        rq_entries: rq_entries.into(),
        sq_page_count: (ring_pages(sq_entries, WQE_SIZE) as u32).into(),
        rq_page_count: (ring_pages(rq_entries, WQE_SIZE) as u32).into(),
    }
    .as_bytes()
    .to_vec()
}

pub fn modify_qp_body(qpn: u32, mask: u32, state: QpState, dest_qpn: u32, access: u32) -> Vec<u8> {
    ModifyQpReq {
        qpn: qpn.into(),
        attr_mask: mask.into(),
        state: (state as u32).into(),
        dest_qpn: dest_qpn.into(),
        access: access.into(),
        reserved: 0.into(),
    }
    .as_bytes()
    .to_vec()
}

/// The three MODIFY_QP bodies that take a QP from RESET to RTS with `dest` as its loopback peer.
pub fn bring_up_bodies(qpn: u32, dest: u32, access: u32) -> [Vec<u8>; 3] {
    [
        modify_qp_body(qpn, QP_ATTR_STATE | QP_ATTR_ACCESS_FLAGS, QpState::Init, 0, access),
        modify_qp_body(qpn, QP_ATTR_STATE | QP_ATTR_DEST_QPN, QpState::Rtr, dest, 0),
        modify_qp_body(qpn, QP_ATTR_STATE, QpState::Rts, 0, 0),
    ]
}

/// A one-SGE RDMA_WRITE of `len` bytes from `(src_addr, lkey)` to `(dst_addr, rkey)`.
pub fn rdma_write_wqe(wr_id: u64, src_addr: u64, lkey: u32, len: u32, dst_addr: u64, rkey: u32) -> Wqe {
    let mut w = Wqe {
        wr_id: wr_id.into(),
        opcode: (WrOpcode::RdmaWrite as u32).into(),
        flags: WR_SIGNALED.into(),
        remote_addr: dst_addr.into(),
        rkey: rkey.into(),
        num_sge: 1.into(),
        sge: [Sge::default(); MAX_SGE],
    };
    w.sge[0] = Sge { addr: src_addr.into(), length: len.into(), lkey: lkey.into() };
    w
}

pub fn doorbell(kind: DoorbellKind, handle: u32, index: u32, flags: u32) -> Vec<u8> {
    Doorbell { kind: (kind as u32).into(), handle: handle.into(), index: index.into(), flags: flags.into() }
        .as_bytes()
        .to_vec()
}

/// A CQE that is valid at ring index `index` (its owner word matches the lap), else None.
pub fn valid_cqe(raw: &[u8], index: u32, entries: u32) -> Option<Cqe> {
    let cqe = Cqe::read_from_bytes(raw).expect("32-byte CQE");
    (cqe.owner.get() == cqe_owner(index, entries)).then_some(cqe)
}

pub fn cqe_status(cqe: &Cqe) -> WcStatus {
    WcStatus::from_u32(cqe.status.get()).expect("known wc status")
}

/// A deterministic byte pattern, different per seed, so misplaced bytes show.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 8) as u8)).collect()
}
