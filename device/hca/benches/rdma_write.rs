//! 64 KiB RDMA_WRITE through the HCA (WQE read, map-register translation, fake-IOMMU DMA both ways, CQE write)
//! against a plain memcpy of the same size, in the same run. Prints the ratio at the end.

#[path = "../tests/common/mod.rs"]
mod common;

use std::hint::black_box;
use std::time::Instant;

use common::*;
use criterion::Criterion;
use vhca_hca::HcaConfig;
use vhca_proto::status::WcStatus;
use vhca_proto::*;

const LEN: usize = 64 * 1024;

struct Setup {
    rig: Rig,
    p: Pair,
    w: Wqe,
}

fn setup() -> Setup {
    let mut rig = Rig::quiet(HcaConfig { map_registers: 1024, ..Default::default() });
    let p = pair(&mut rig, ACCESS_ALL);
    let src = rig.reg_mr(p.pd, ACCESS_ALL, LEN as u64);
    let dst = rig.reg_mr(p.pd, ACCESS_ALL, LEN as u64);
    rig.mem.poke(src.iova, &pattern(LEN, 5));
    let w = wqe(1, WrOpcode::RdmaWrite, WR_SIGNALED, dst.addr, dst.key, &[sge(&src, 0, LEN as u32)]);
    let mut s = Setup { rig, p, w };
    one_write(&mut s);
    assert_eq!(s.rig.mem.peek(dst.iova, LEN), pattern(LEN, 5), "the benchmark moves the right bytes");
    s
}

fn one_write(s: &mut Setup) {
    s.rig.post_send(&mut s.p.a, &s.w);
    let c = s.rig.poll(&mut s.p.cq_a);
    debug_assert!(c.len() == 1 && c[0].status == WcStatus::Success);
    black_box(c);
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
    let mut s = setup();
    let src = pattern(LEN, 9);
    let mut dst = vec![0u8; LEN];
    {
        let mut group = criterion.benchmark_group("64KiB");
        group.throughput(criterion::Throughput::Bytes(LEN as u64));
        group.bench_function("rdma_write_through_map_registers", |b| b.iter(|| one_write(&mut s)));
        group.bench_function("memcpy", |b| b.iter(|| memcpy(&src, &mut dst)));
        group.finish();
    }
    criterion.final_summary();
    // The ratio, from one more interleaved measurement in this process.
    let iters = 2000;
    let hca = per_op_ns(iters, || one_write(&mut s));
    let copy = per_op_ns(iters, || memcpy(&src, &mut dst));
    println!("ratio: rdma_write {hca:.0} ns / memcpy {copy:.0} ns = {:.1}x", hca / copy);
}
