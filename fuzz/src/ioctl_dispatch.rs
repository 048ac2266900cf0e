//! Harness over the device-control dispatcher both personalities call: arbitrary IOCTLs from two files against a
//! model HCA that panics when a verb reaches it with something the dispatcher should have refused.
//!
//! Input: records of `file (1) | code selector (1) | input length (1) | output capacity (2) | input bytes`. Selector
//! 0..=14 is one of the codes, 15 closes the file (CLEANUP, then a fresh CREATE), 16 is WAIT_CQ (added after the
//! seeds were made, so theirs keep their meaning), anything else takes a raw code from the next 4 bytes. A WAIT_CQ
//! left pending is tried again at once, as the driver's poller would. The direct methods' MDL buffer is the output, pre-filled with input bytes after the record.

use std::collections::BTreeMap;

use vhca_driver_core::ioctl_codec::*;
use vhca_driver_core::{dispatch_device_control, poll_for_wait, DriverError, FileContext, RegisteredMr, UserVerbs};
use vhca_proto::{Cqe, QueryDeviceResp, Wqe, WrOpcode, MAX_SGE};

const CODES: [u32; 15] = [
    IOCTL_VHCA_OPEN_CONTEXT,
    IOCTL_VHCA_QUERY_DEVICE,
    IOCTL_VHCA_ALLOC_PD,
    IOCTL_VHCA_DEALLOC_PD,
    IOCTL_VHCA_CREATE_CQ,
    IOCTL_VHCA_DESTROY_CQ,
    IOCTL_VHCA_CREATE_QP,
    IOCTL_VHCA_DESTROY_QP,
    IOCTL_VHCA_CONNECT_QP,
    IOCTL_VHCA_REG_MR,
    IOCTL_VHCA_DEREG_MR,
    IOCTL_VHCA_POST_SEND,
    IOCTL_VHCA_POST_RECV,
    IOCTL_VHCA_POLL_CQ,
    IOCTL_VHCA_REQ_NOTIFY_CQ,
];

/// The selector byte of each code (its index in CODES), and of a file's close.
pub mod selector {
    pub const OPEN_CONTEXT: u8 = 0;
    pub const QUERY_DEVICE: u8 = 1;
    pub const ALLOC_PD: u8 = 2;
    pub const DEALLOC_PD: u8 = 3;
    pub const CREATE_CQ: u8 = 4;
    pub const DESTROY_CQ: u8 = 5;
    pub const CREATE_QP: u8 = 6;
    pub const DESTROY_QP: u8 = 7;
    pub const CONNECT_QP: u8 = 8;
    pub const REG_MR: u8 = 9;
    pub const DEREG_MR: u8 = 10;
    pub const POST_SEND: u8 = 11;
    pub const POST_RECV: u8 = 12;
    pub const POLL_CQ: u8 = 13;
    pub const REQ_NOTIFY_CQ: u8 = 14;
    pub const CLOSE: u8 = 15;
    pub const WAIT_CQ: u8 = 16;
}
const FILES: usize = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Pd,
    Cq,
    Qp,
    Mr { addr: u64, length: u32 },
}

/// The HCA as the dispatcher must use it: one namespace of handles, each with the file that made it.
#[derive(Default)]
struct ModelHca {
    next: u32,
    objects: BTreeMap<u32, (usize, Kind)>,
    /// The file on whose behalf the dispatcher is running now.
    caller: usize,
}

impl ModelHca {
    fn make(&mut self, kind: Kind) -> u32 {
        self.next += 1;
        self.objects.insert(self.next, (self.caller, kind));
        self.next
    }

    /// The dispatcher passes only the caller's own handles of the right kind.
    fn owned(&self, handle: u32, is: fn(&Kind) -> bool) -> Kind {
        match self.objects.get(&handle) {
            Some(&(file, kind)) if file == self.caller && is(&kind) => kind,
            other => panic!("handle {handle} reached a verb for file {}: {other:?}", self.caller),
        }
    }

    fn remove(&mut self, handle: u32, is: fn(&Kind) -> bool) {
        self.owned(handle, is);
        self.objects.remove(&handle);
    }

    fn check_wqe(&self, wqe: &Wqe, send: bool) {
        let opcode = WrOpcode::from_u32(wqe.opcode.get()).expect("unknown opcode posted");
        assert_eq!(send, opcode != WrOpcode::Recv, "opcode on the wrong queue");
        let used = wqe.num_sge.get() as usize;
        assert!(used <= MAX_SGE, "{used} SGEs posted");
        for sge in &wqe.sge[..used] {
            let Kind::Mr { addr, length } = self.owned(sge.lkey.get(), |k| matches!(k, Kind::Mr { .. })) else {
                unreachable!()
            };
            let (start, end) = (sge.addr.get(), sge.addr.get() as u128 + sge.length.get() as u128);
            assert!(start >= addr && end <= addr as u128 + length as u128, "SGE outside its MR");
        }
    }
}

fn is_pd(k: &Kind) -> bool {
    *k == Kind::Pd
}
fn is_cq(k: &Kind) -> bool {
    *k == Kind::Cq
}
fn is_qp(k: &Kind) -> bool {
    *k == Kind::Qp
}
fn is_mr(k: &Kind) -> bool {
    matches!(k, Kind::Mr { .. })
}

impl UserVerbs for ModelHca {
    fn query_device(&self) -> QueryDeviceResp {
        QueryDeviceResp::default()
    }
    fn alloc_pd(&mut self) -> Result<u32, DriverError> {
        Ok(self.make(Kind::Pd))
    }
    fn dealloc_pd(&mut self, pd: u32) -> Result<(), DriverError> {
        self.remove(pd, is_pd);
        Ok(())
    }
    fn create_cq(&mut self, entries: u32) -> Result<u32, DriverError> {
        if !entries.is_power_of_two() {
            return Err(DriverError::InvalidParameter("ring entries must be a power of two"));
        }
        Ok(self.make(Kind::Cq))
    }
    fn destroy_cq(&mut self, cq: u32) -> Result<(), DriverError> {
        self.remove(cq, is_cq);
        Ok(())
    }
    fn req_notify_cq(&mut self, cq: u32, _solicited_only: bool) -> Result<(), DriverError> {
        self.owned(cq, is_cq);
        Ok(())
    }
    fn poll_cq(&mut self, cq: u32, max: usize) -> Result<Vec<Cqe>, DriverError> {
        self.owned(cq, is_cq);
        // More than asked for: the dispatcher must still write no more than max.
        Ok(vec![Cqe::default(); max + 1])
    }
    fn create_qp(&mut self, pd: u32, send_cq: u32, recv_cq: u32, _sq: u32, _rq: u32) -> Result<u32, DriverError> {
        self.owned(pd, is_pd);
        self.owned(send_cq, is_cq);
        self.owned(recv_cq, is_cq);
        Ok(self.make(Kind::Qp))
    }
    fn connect_qp(&mut self, qpn: u32, _dest_qpn: u32, _access: u32) -> Result<(), DriverError> {
        self.owned(qpn, is_qp);
        Ok(())
    }
    fn destroy_qp(&mut self, qpn: u32) -> Result<(), DriverError> {
        self.remove(qpn, is_qp);
        Ok(())
    }
    fn reg_user_mr(&mut self, pd: u32, addr: u64, length: u32, _access: u32) -> Result<RegisteredMr, DriverError> {
        self.owned(pd, is_pd);
        assert!(length > 0 && addr != 0 && addr.checked_add(length as u64).is_some(), "bad range registered");
        let lkey = self.make(Kind::Mr { addr, length });
        Ok(RegisteredMr { lkey, rkey: lkey, addr, length })
    }
    fn dereg_mr(&mut self, lkey: u32) -> Result<(), DriverError> {
        self.remove(lkey, is_mr);
        Ok(())
    }
    fn post_send(&mut self, qpn: u32, wqe: &Wqe) -> Result<(), DriverError> {
        self.owned(qpn, is_qp);
        self.check_wqe(wqe, true);
        Ok(())
    }
    fn post_recv(&mut self, qpn: u32, wqe: &Wqe) -> Result<(), DriverError> {
        self.owned(qpn, is_qp);
        self.check_wqe(wqe, false);
        Ok(())
    }
}

pub fn run(data: &[u8]) {
    let mut hca = ModelHca::default();
    let mut files: Vec<FileContext> = (0..FILES).map(|_| FileContext::new()).collect();
    let mut rest = data;
    while let [file, selector, input_len, cap_lo, cap_hi, tail @ ..] = rest {
        let file = *file as usize % FILES;
        let (code, tail) = match *selector {
            s if (s as usize) < CODES.len() => (CODES[s as usize], tail),
            selector::WAIT_CQ => (IOCTL_VHCA_WAIT_CQ, tail),
            selector::CLOSE => {
                close(&mut hca, &mut files, file);
                rest = tail;
                continue;
            }
            _ => match tail {
                [a, b, c, d, more @ ..] => (u32::from_le_bytes([*a, *b, *c, *d]), more),
                _ => return,
            },
        };
        let take = (*input_len as usize).min(tail.len());
        let (input, tail) = tail.split_at(take);
        let capacity = u16::from_le_bytes([*cap_lo, *cap_hi]) as usize % 4096;
        let mut output = vec![0u8; capacity];
        // The direct methods read their MDL buffer: fill it from what follows, so WQE arrays can be made.
        let fill = capacity.min(tail.len());
        output[..fill].copy_from_slice(&tail[..fill]);
        let tail = if method_of(code) == TransferMethod::InDirect { &tail[fill..] } else { tail };
        hca.caller = file;
        let reply = dispatch_device_control(&mut hca, &mut files[file], code, input, &mut output);
        assert!(reply.information <= output.len(), "Information {} past the output", reply.information);
        assert!(reply.status.0 >= 0 || reply.information == 0, "a refusal reports bytes written");
        // STATUS_PENDING.
        if reply.status.0 == 0x103 {
            assert_eq!(code, IOCTL_VHCA_WAIT_CQ, "only WAIT_CQ is kept pending");
            assert_eq!(reply.information, 0);
            if let Some(again) = poll_for_wait(&mut hca, &files[file], input, &mut output) {
                assert!(again.information <= output.len() && (again.status.0 >= 0 || again.information == 0));
            }
        }
        rest = tail;
    }
    for file in 0..FILES {
        close(&mut hca, &mut files, file);
    }
    assert!(hca.objects.is_empty(), "objects outlive every file's CLEANUP: {:?}", hca.objects);
}

fn close(hca: &mut ModelHca, files: &mut [FileContext], file: usize) {
    hca.caller = file;
    let released = files[file].release(hca);
    assert_eq!(released.failed, 0);
    assert!(hca.objects.values().all(|(owner, _)| *owner != file), "CLEANUP left objects of file {file}");
    files[file] = FileContext::new();
}

/// One record of the input format, for the seeds.
pub fn record(file: u8, selector: u8, input: &[u8], capacity: u16, direct: &[u8]) -> Vec<u8> {
    let mut out = vec![file, selector, input.len() as u8];
    out.extend(capacity.to_le_bytes());
    out.extend(input);
    out.extend(direct);
    out
}

const _: () = {
    use selector::*;
    assert!(CODES[OPEN_CONTEXT as usize] == IOCTL_VHCA_OPEN_CONTEXT);
    assert!(CODES[CREATE_CQ as usize] == IOCTL_VHCA_CREATE_CQ);
    assert!(CODES[REG_MR as usize] == IOCTL_VHCA_REG_MR);
    assert!(CODES[POST_SEND as usize] == IOCTL_VHCA_POST_SEND);
    assert!(CODES[POLL_CQ as usize] == IOCTL_VHCA_POLL_CQ);
    assert!(CODES.len() == CLOSE as usize);
};
