//! The steps of a user-mode provider's life over vhca's interface, each checking what the driver answered and naming
//! the step when it is wrong: open with a context, a connected pair of QPs, REG_MR, an RDMA write, POLL_CQ, destroy.

use alloc::format;
use alloc::string::String;
use alloc::vec::Vec;

use vhca_driver_core::ioctl_codec::*;
use vhca_proto::{Cqe, Sge, Wqe, WrOpcode, ACCESS_REMOTE_WRITE, CQE_SIZE, WQE_SIZE, WR_SIGNALED};
use zerocopy::little_endian::U32;
use zerocopy::{FromBytes, IntoBytes};

use crate::{process_bytes, Reply, VerbsProcess};

/// The most CQEs one poll takes.
const POLL_MAX: usize = 4;

/// Two QPs of one file connected to each other on one CQ and PD (RDMA writes allowed), what a loopback provider
/// sets up first: the handles the driver gave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectedPair {
    pub pd: U32,
    pub cq: U32,
    pub a: U32,
    pub b: U32,
}

/// A process with vhca's interface open and a context agreed, and the steps of a provider's life, each checking
/// what the driver answered and naming the step when it is wrong.
pub struct Provider<'a, P: VerbsProcess> {
    process: &'a mut P,
    file: usize,
    /// The CQE buffer every poll reuses, allocated at the first.
    cqes: Option<usize>,
}

impl<'a, P: VerbsProcess> Provider<'a, P> {
    /// CreateFile on the interface, then OPEN_CONTEXT, which must agree on USER_ABI_VERSION.
    pub fn open(process: &'a mut P) -> Result<Provider<'a, P>, String> {
        let file = process.open_interface().map_err(|s| format!("CreateFile on the interface: {:#010x}", s as u32))?;
        let mut p = Provider { process, file, cqes: None };
        let open = OpenContextIn { abi_version: USER_ABI_VERSION.into(), reserved: 0.into() };
        let context: OpenContextOut = p.call("OPEN_CONTEXT", IOCTL_VHCA_OPEN_CONTEXT, open.as_bytes())?;
        if context.abi_version.get() != USER_ABI_VERSION {
            return Err(format!("OPEN_CONTEXT agreed on ABI {}", context.abi_version.get()));
        }
        Ok(p)
    }

    pub fn process(&mut self) -> &mut P {
        self.process
    }

    /// The open file's index in the process (what an overlapped request of its own is sent on).
    pub fn file(&self) -> usize {
        self.file
    }

    pub fn control(&mut self, code: u32, input: &[u8], output: &mut [u8]) -> Reply {
        self.process.device_control(self.file, code, input, output)
    }

    /// One METHOD_BUFFERED IOCTL that must succeed with exactly a `T` back (`()`: nothing back).
    pub fn call<T: FromBytes + IntoBytes + Default>(
        &mut self,
        name: &str,
        code: u32,
        input: &[u8],
    ) -> Result<T, String> {
        let mut out = T::default();
        let want = core::mem::size_of::<T>();
        let reply = self.control(code, input, out.as_mut_bytes());
        if reply.status < 0 {
            return Err(format!("{name}: status {:#010x}", reply.status as u32));
        }
        if reply.information != want {
            return Err(format!("{name}: {} bytes back, not {want}", reply.information));
        }
        Ok(out)
    }

    /// ALLOC_PD, CREATE_CQ (16 entries), two CREATE_QPs on it, each connected to the other.
    pub fn connected_pair(&mut self) -> Result<ConnectedPair, String> {
        let pd: HandleOut = self.call("ALLOC_PD", IOCTL_VHCA_ALLOC_PD, &[])?;
        let cq_in = CreateCqIn { entries: 16.into(), reserved: 0.into() };
        let cq: CreateCqOut = self.call("CREATE_CQ", IOCTL_VHCA_CREATE_CQ, cq_in.as_bytes())?;
        let qp_in = CreateQpIn {
            pd: pd.handle,
            send_cq: cq.cq,
            recv_cq: cq.cq,
            sq_entries: 16.into(),
            rq_entries: 16.into(),
            reserved: 0.into(),
        };
        let a: HandleOut = self.call("CREATE_QP", IOCTL_VHCA_CREATE_QP, qp_in.as_bytes())?;
        let b: HandleOut = self.call("CREATE_QP", IOCTL_VHCA_CREATE_QP, qp_in.as_bytes())?;
        for (qpn, dest) in [(a.handle, b.handle), (b.handle, a.handle)] {
            let connect = ConnectQpIn { qpn, dest_qpn: dest, access: ACCESS_REMOTE_WRITE.into(), reserved: 0.into() };
            self.call::<()>("CONNECT_QP", IOCTL_VHCA_CONNECT_QP, connect.as_bytes())?;
        }
        Ok(ConnectedPair { pd: pd.handle, cq: cq.cq, a: a.handle, b: b.handle })
    }

    /// DEALLOC_PD, DESTROY_CQ, DESTROY_QP or DEREG_MR of `handle`, which must succeed.
    pub fn destroy(&mut self, name: &str, code: u32, handle: U32) -> Result<(), String> {
        self.call::<()>(name, code, HandleIn { handle, reserved: 0.into() }.as_bytes())
    }

    /// `bytes` of the process's memory, `in_page_offset` into its first page.
    pub fn allocate(&mut self, bytes: usize, in_page_offset: usize, what: &str) -> Result<usize, String> {
        self.process.allocate(bytes, in_page_offset).ok_or_else(|| format!("no process memory for {what}"))
    }

    /// REG_MR of `len` bytes at `addr` of the process's memory, which must answer the range it asked for.
    pub fn register(&mut self, pd: U32, addr: usize, len: usize, access: u32) -> Result<RegMrOut, String> {
        let reg = RegMrIn {
            addr: (addr as u64).into(),
            length: (len as u32).into(),
            pd,
            access: access.into(),
            reserved: 0.into(),
        };
        let mr: RegMrOut = self.call("REG_MR", IOCTL_VHCA_REG_MR, reg.as_bytes())?;
        if mr.addr.get() != addr as u64 || mr.length.get() as usize != len {
            return Err(format!("REG_MR answered {mr:?} for {addr:#x}+{len:#x}"));
        }
        Ok(mr)
    }

    /// POST_SEND of one signaled RDMA write of `len` bytes from `src` to `dst` on `qp`; the WQE is in process
    /// memory (METHOD_IN_DIRECT: the I/O manager probes and locks it in the caller's context) and must be taken.
    pub fn post_rdma_write(
        &mut self,
        qp: U32,
        src: &RegMrOut,
        dst: &RegMrOut,
        len: usize,
        wr_id: u64,
    ) -> Result<(), String> {
        let mut write = Wqe {
            wr_id: wr_id.into(),
            opcode: (WrOpcode::RdmaWrite as u32).into(),
            flags: WR_SIGNALED.into(),
            remote_addr: dst.addr,
            rkey: dst.rkey,
            num_sge: 1.into(),
            ..Wqe::default()
        };
        write.sge[0] = Sge { addr: src.addr, length: (len as u32).into(), lkey: src.lkey };
        let record = self.allocate(WQE_SIZE, 0, "the WQE")?;
        // SAFETY: `allocate` gave WQE_SIZE bytes of the process's memory at `record`, mapped until it exits.
        let wqe = unsafe { process_bytes(record, WQE_SIZE) };
        wqe.copy_from_slice(write.as_bytes());
        let post = PostIn { qpn: qp, count: 1.into() };
        let reply = self.control(IOCTL_VHCA_POST_SEND, post.as_bytes(), wqe);
        if reply.status < 0 || reply.information != WQE_SIZE {
            return Err(format!("POST_SEND: status {:#010x}, {} bytes taken", reply.status as u32, reply.information));
        }
        Ok(())
    }

    /// POLL_CQ of up to POLL_MAX completions into process memory: its status and the completions it wrote (none
    /// when it failed: a refusal is an answer, not an error of the program).
    pub fn poll(&mut self, cq: U32) -> Result<(i32, Vec<Cqe>), String> {
        let at = self.cqe_buffer()?;
        let request = PollCqIn { cq, max: (POLL_MAX as u32).into() };
        // SAFETY: `at` holds CQE_SIZE * POLL_MAX bytes of the process's memory (cqe_buffer).
        let out = unsafe { process_bytes(at, CQE_SIZE * POLL_MAX) };
        let reply = self.control(IOCTL_VHCA_POLL_CQ, request.as_bytes(), out);
        if reply.status < 0 {
            return Ok((reply.status, Vec::new()));
        }
        let polled = reply.information.min(CQE_SIZE * POLL_MAX);
        // SAFETY: as above.
        let cqes =
            unsafe { process_bytes(at, polled) }.chunks_exact(CQE_SIZE).filter_map(|c| Cqe::read_from_bytes(c).ok());
        Ok((reply.status, cqes.collect()))
    }

    fn cqe_buffer(&mut self) -> Result<usize, String> {
        match self.cqes {
            Some(at) => Ok(at),
            None => {
                let at = self.allocate(CQE_SIZE * POLL_MAX, 0, "the CQEs")?;
                self.cqes = Some(at);
                Ok(at)
            }
        }
    }
}
