//! 64 KiB RDMA_WRITE through the device's real DMA path: map registers, then `QueueDma` over vm-memory's
//! `IommuMemory` with one IOTLB entry per 4 KiB page (as QEMU's intel-iommu sends them) over a memfd, against a
//! plain memcpy of the same size in the same run. Prints the ratio at the end. docs/bench.md has the numbers.

#[path = "../tests/common/verbs.rs"]
mod verbs;

use std::fs::File;
use std::hint::black_box;
use std::os::fd::FromRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::Criterion;
use vhca_device::event_log::EventLog;
use vhca_device::iommu_dma::QueueDma;
use vhca_device::memory::{map_regions, GuestMem, RegionDesc};
use vhca_device::shared::Shared;
use vhca_hca::{Hca, HcaConfig, NullSink};
use vhca_proto::status::WcStatus;
use vhca_proto::*;
use vm_memory::{Bytes, GuestAddress, Permissions};
use zerocopy::IntoBytes;

const LEN: usize = 64 * 1024;
const PAGE: u64 = PAGE_SIZE;
/// Guest RAM: a memfd of this size, "mapped in QEMU" at UADDR and reached by the device at IOVA.
const MEM: u64 = 0x10_0000;
const UADDR: u64 = 0x7f55_0000_0000;
const IOVA: u64 = 0x1_0000_0000;
const CQ_OFF: u64 = 0;
const CQ_ENTRIES: u32 = 64;
const SQ_OFF: u64 = 0x2000;
const RQ_OFF: u64 = 0x4000;
const WQ_ENTRIES: u32 = 16;
const SRC_OFF: u64 = 0x10000;
const DST_OFF: u64 = 0x30000;
const MR_PAGES: u64 = LEN as u64 / PAGE;

fn memfd(len: u64) -> File {
    // SAFETY: the name is a valid NUL-terminated string; the result is checked before use.
    let fd = unsafe { libc::memfd_create(c"vhca-bench-ram".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: fd is a fresh descriptor that nothing else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(len).expect("size the memfd");
    file
}

fn pages(off: u64, n: u64) -> Vec<u64> {
    (0..n).map(|p| IOVA + off + p * PAGE).collect()
}

struct Setup {
    shared: Arc<Shared>,
    mem: Arc<GuestMem>,
    hca: Hca,
    qpn: u32,
    wqe: Wqe,
    posted: u32,
}

impl Setup {
    fn new() -> Setup {
        let events = Arc::new(EventLog::to_writer(Box::new(std::io::sink())));
        let shared = Arc::new(Shared::new(events, NUM_QUEUES, Duration::from_millis(100)).expect("shared state"));
        let region = RegionDesc { guest_phys_addr: 0, memory_size: MEM, userspace_addr: UADDR, mmap_offset: 0 };
        shared.replace_memory(map_regions(&[region], vec![memfd(MEM)]).expect("map the memfd"));
        for p in 0..MEM / PAGE {
            shared.iommu.update(IOVA + p * PAGE, PAGE, UADDR + p * PAGE, Permissions::ReadWrite).expect("IOTLB entry");
        }
        let mem = shared.mem();
        let hca = Hca::new(HcaConfig { map_registers: 1024, ..Default::default() }, Arc::new(NullSink));
        let mut s = Setup { shared, mem, hca, qpn: 0, wqe: Wqe::default(), posted: 0 };
        let pd = verbs::handle_of(&s.cmd(Opcode::AllocPd, &[], &[]));
        let cq = verbs::handle_of(&s.cmd(Opcode::CreateCq, &verbs::create_cq_body(CQ_ENTRIES, 1), &pages(CQ_OFF, 1)));
        let mut rings = pages(SQ_OFF, 1);
        rings.extend(pages(RQ_OFF, 1));
        let qpn =
            verbs::handle_of(&s.cmd(Opcode::CreateQp, &verbs::create_qp_body(pd, cq, WQ_ENTRIES, WQ_ENTRIES), &rings));
        for body in verbs::bring_up_bodies(qpn, qpn, ACCESS_ALL) {
            s.cmd(Opcode::ModifyQp, &body, &[]);
        }
        let (src_addr, dst_addr) = (0x7000_0000_0000 + SRC_OFF, 0x7000_0000_0000 + DST_OFF);
        let reg = |s: &mut Setup, addr, off| {
            let body = verbs::reg_mr_body(pd, ACCESS_ALL, addr, LEN as u64, MR_PAGES as u32);
            let resp = s.cmd(Opcode::RegMr, &body, &pages(off, MR_PAGES));
            <RegMrResp as zerocopy::FromBytes>::read_from_bytes(&resp).expect("REG_MR response").lkey.get()
        };
        let src_key = reg(&mut s, src_addr, SRC_OFF);
        let dst_key = reg(&mut s, dst_addr, DST_OFF);
        s.qpn = qpn;
        s.wqe = verbs::rdma_write_wqe(1, src_addr, src_key, LEN as u32, dst_addr, dst_key);
        s
    }

    /// One command through `Hca::execute` with the real DMA path; it must succeed.
    fn cmd(&mut self, opcode: Opcode, body: &[u8], pages: &[u64]) -> Vec<u8> {
        let dma = QueueDma::new(&self.shared, &self.mem, QUEUE_COMMAND);
        let (status, _tag, body) =
            verbs::parse_response(&self.hca.execute(&dma, &verbs::request(opcode, 1, body, pages)));
        assert_eq!(status, Status::Ok, "{opcode:?}");
        body
    }

    /// The driver's CPU writes guest RAM directly (QEMU's address), not through the IOMMU.
    fn cpu_write(&self, off: u64, bytes: &[u8]) {
        self.mem.get_backend().write_slice(bytes, GuestAddress(UADDR + off)).expect("guest RAM write");
    }

    fn cpu_read(&self, off: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        self.mem.get_backend().read_slice(&mut out, GuestAddress(UADDR + off)).expect("guest RAM read");
        out
    }

    /// Posts the WQE, rings the SQ doorbell, and polls its CQE: one RDMA_WRITE as a driver sees it.
    fn one_write(&mut self) -> WcStatus {
        let index = self.posted;
        self.posted = self.posted.wrapping_add(1);
        self.cpu_write(SQ_OFF + u64::from(index % WQ_ENTRIES) * WQE_SIZE as u64, self.wqe.as_bytes());
        let dma = QueueDma::new(&self.shared, &self.mem, QUEUE_DOORBELL);
        self.hca.doorbell(&dma, &verbs::doorbell(DoorbellKind::SendQueue, self.qpn, self.posted, 0));
        let raw = self.cpu_read(CQ_OFF + u64::from(index % CQ_ENTRIES) * CQE_SIZE as u64, CQE_SIZE);
        let cqe = verbs::valid_cqe(&raw, index, CQ_ENTRIES).expect("the write completed");
        verbs::cqe_status(black_box(&cqe))
    }
}

fn memcpy(src: &[u8], dst: &mut [u8]) {
    dst.copy_from_slice(black_box(src));
    black_box(dst);
}

fn per_op_ns(iters: u32, mut f: impl FnMut()) -> f64 {
    let start = Instant::now();
    for _ in 0..iters {
        f();
    }
    start.elapsed().as_nanos() as f64 / f64::from(iters)
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    let mut s = Setup::new();
    let data = verbs::pattern(LEN, 5);
    s.cpu_write(SRC_OFF, &data);
    assert_eq!(s.one_write(), WcStatus::Success);
    assert_eq!(s.cpu_read(DST_OFF, LEN), data, "the benchmark moves the right bytes");
    let src = verbs::pattern(LEN, 9);
    let mut dst = vec![0u8; LEN];
    {
        let mut group = criterion.benchmark_group("64KiB_real_iommu");
        group.throughput(criterion::Throughput::Bytes(LEN as u64));
        group.bench_function("rdma_write_through_map_registers_and_iotlb", |b| b.iter(|| s.one_write()));
        group.bench_function("memcpy", |b| b.iter(|| memcpy(&src, &mut dst)));
        group.finish();
    }
    criterion.final_summary();
    let iters = 2000;
    let hca = per_op_ns(iters, || {
        s.one_write();
    });
    let copy = per_op_ns(iters, || memcpy(&src, &mut dst));
    println!("ratio (real IommuMemory): rdma_write {hca:.0} ns / memcpy {copy:.0} ns = {:.1}x", hca / copy);
}
