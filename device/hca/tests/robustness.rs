//! Property tests of the HCA on guest-controlled input: arbitrary bytes, malformed commands, and random sequences of
//! commands, posted work, doorbells and IOTLB invalidations. The HCA must never panic, must answer every command
//! with a decodable response and a logged cause, must keep its map-register count equal to the pages of the objects
//! alive, and must never DMA outside the pages of those objects.

mod common;

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};

use common::{FakeIommu, Rig, PAGE};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, RngSeed};
use vhca_hca::{ContiguousPolicy, Dma, DmaError, FaultInjection, HcaConfig, HcaEvent};
use vhca_proto::*;
use zerocopy::{FromBytes, IntoBytes};

/// Fixed seed and no persistence file: CI runs the same cases every time, and a failure prints its minimal input.
fn config(cases: u32) -> Config {
    Config {
        cases,
        failure_persistence: None,
        rng_algorithm: RngAlgorithm::ChaCha,
        rng_seed: RngSeed::Fixed(0x5648_4341),
        max_shrink_iters: 2048,
        ..Config::default()
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Guest memory: a pool of pages the tests may hand out, some read-only or write-only, and addresses around it.

const BASE: u64 = 0x10_0000;
/// Pages BASE .. BASE + POOL_PAGES are mapped at the start of every case.
const POOL_PAGES: u64 = 48;
/// Pool pages from here on are mapped read-only, and from `WRITE_ONLY_FROM` on write-only.
const READ_ONLY_FROM: u64 = 40;
const WRITE_ONLY_FROM: u64 = 44;

fn pool_page(i: u64) -> u64 {
    BASE + (i % POOL_PAGES) * PAGE
}

/// An IOVA a guest might put in a page list: mostly pool pages, also unmapped, misaligned and top-of-space ones.
fn page_iova() -> impl Strategy<Value = u64> {
    prop_oneof![
        12 => (0..POOL_PAGES).prop_map(pool_page),
        2 => (POOL_PAGES..POOL_PAGES + 16).prop_map(|i| BASE + i * PAGE),
        1 => Just(0u64),
        1 => ((0..POOL_PAGES), 1..PAGE).prop_map(|(i, off)| pool_page(i) + off),
        1 => (0..4u64).prop_map(|k| !(PAGE - 1) - k * PAGE),
        1 => (0..PAGE).prop_map(|k| u64::MAX - k),
        1 => any::<u64>(),
    ]
}

/// A page list of `n` pages: a contiguous run from a pool page (what a driver usually sends), or any IOVAs.
fn page_list(n: usize) -> impl Strategy<Value = Vec<u64>> {
    prop_oneof![
        3 => (0..POOL_PAGES).prop_map(move |start| (0..n as u64).map(|p| pool_page(start + p)).collect()),
        2 => prop::collection::vec(page_iova(), n),
    ]
}

/// A page list for a ring or MR that needs `needed` pages: usually that many, sometimes not.
fn pages_for(needed: u64) -> impl Strategy<Value = Vec<u64>> {
    let needed = needed.min(64) as usize;
    prop_oneof![
        6 => page_list(needed),
        1 => (0..8usize).prop_flat_map(page_list),
    ]
}

// ---------------------------------------------------------------------------------------------------------------
// Handles, picked among live objects at run time (so sequences reach deep states) or given raw.

#[derive(Debug, Clone, Copy)]
enum Pick {
    /// The k-th live object of the kind, in handle order (a raw 0 when none is alive).
    Live(u8),
    Raw(u32),
}

fn pick() -> impl Strategy<Value = Pick> {
    prop_oneof![
        6 => any::<u8>().prop_map(Pick::Live),
        1 => prop_oneof![Just(0u32), Just(1), Just(0x10), Just(0x100), Just(u32::MAX), any::<u32>()].prop_map(Pick::Raw),
    ]
}

fn small_or_any_u32() -> impl Strategy<Value = u32> {
    prop_oneof![4 => 0..8u32, 1 => Just(u32::MAX), 1 => any::<u32>()]
}

/// Ring sizes: powers of two up to a little past the device's limits, and the odd bad value.
fn entries() -> impl Strategy<Value = u32> {
    prop_oneof![
        8 => (0..8u32).prop_map(|s| 1 << s),
        1 => (8..17u32).prop_map(|s| 1 << s),
        1 => Just(0u32),
        1 => Just(3u32),
        1 => any::<u32>(),
    ]
}

/// MR addresses: a few bases so SGEs and rkeys can land inside, plus wrapping ones.
fn mr_addr() -> impl Strategy<Value = u64> {
    prop_oneof![
        4 => (0..4u64).prop_map(|k| 0x7000_0000_0000 + k * 0x100_0000),
        1 => Just(u64::MAX - 100),
        1 => any::<u64>(),
    ]
}

// ---------------------------------------------------------------------------------------------------------------
// Commands.

#[derive(Debug, Clone)]
enum Body {
    /// QUERY_DEVICE, ALLOC_PD.
    Empty,
    QueryPort {
        port: u32,
    },
    /// DEALLOC_PD, DESTROY_CQ, DEREG_MR, DESTROY_QP: which table `pick` reads is the opcode's.
    Handle {
        pick: Pick,
    },
    CreateCq {
        entries: u32,
        page_count: Option<u32>,
        pages: Vec<u64>,
    },
    ReqNotifyCq {
        cq: Pick,
        solicited_only: u32,
    },
    RegMr {
        pd: Pick,
        access: u32,
        addr: u64,
        length: u64,
        first_page_offset: u32,
        page_count: Option<u32>,
        pages: Vec<u64>,
    },
    CreateQp {
        pd: Pick,
        qp_type: u32,
        send_cq: Pick,
        recv_cq: Pick,
        sq: (u32, Vec<u64>),
        rq: (u32, Vec<u64>),
        counts: Option<(u32, u32)>,
    },
    ModifyQp {
        qp: Pick,
        attr_mask: u32,
        state: u32,
        dest: Pick,
        access: u32,
    },
    Raw(Vec<u8>),
}

/// How the request's framing is bent: `body_len` off by some bytes or arbitrary, bytes cut off or added at the end.
#[derive(Debug, Clone)]
struct Framing {
    body_len: Option<u32>,
    body_len_delta: i32,
    cut: usize,
    extra: Vec<u8>,
}

#[derive(Debug, Clone)]
struct CommandSpec {
    opcode: u32,
    tag: u32,
    body: Body,
    framing: Framing,
}

fn framing() -> impl Strategy<Value = Framing> {
    let exact = Framing { body_len: None, body_len_delta: 0, cut: 0, extra: Vec::new() };
    prop_oneof![
        8 => Just(exact),
        1 => (-24..24i32).prop_map(|d| Framing { body_len: None, body_len_delta: d, cut: 0, extra: Vec::new() }),
        1 => prop_oneof![Just(u32::MAX), Just(MAX_REQUEST_SIZE as u32), any::<u32>()]
            .prop_map(|n| Framing { body_len: Some(n), body_len_delta: 0, cut: 0, extra: Vec::new() }),
        1 => (1..40usize).prop_map(|cut| Framing { body_len: None, body_len_delta: 0, cut, extra: Vec::new() }),
        1 => prop::collection::vec(any::<u8>(), 1..24)
            .prop_map(|extra| Framing { body_len: None, body_len_delta: 0, cut: 0, extra }),
    ]
}

fn create_cq_body() -> impl Strategy<Value = Body> {
    entries().prop_flat_map(|entries| {
        let needed = if entries == 0 { 1 } else { ring_pages(entries, CQE_SIZE) };
        (pages_for(needed), prop::option::weighted(0.1, small_or_any_u32()))
            .prop_map(move |(pages, page_count)| Body::CreateCq { entries, page_count, pages })
    })
}

fn reg_mr_body() -> impl Strategy<Value = Body> {
    let length = prop_oneof![4 => 1..3 * PAGE, 1 => Just(0u64), 1 => Just(u64::MAX), 1 => any::<u64>()];
    let offset = prop_oneof![4 => 0..PAGE as u32, 1 => Just(PAGE as u32), 1 => any::<u32>()];
    let access = prop_oneof![6 => 0..8u32, 1 => any::<u32>()];
    (pick(), access, mr_addr(), length, offset).prop_flat_map(|(pd, access, addr, length, first_page_offset)| {
        let needed = u64::from(first_page_offset).saturating_add(length).div_ceil(PAGE).clamp(1, 64);
        (pages_for(needed), prop::option::weighted(0.1, small_or_any_u32())).prop_map(move |(pages, page_count)| {
            Body::RegMr { pd, access, addr, length, first_page_offset, page_count, pages }
        })
    })
}

fn create_qp_body() -> impl Strategy<Value = Body> {
    let qp_type = prop_oneof![8 => Just(QP_TYPE_RC), 1 => any::<u32>()];
    (pick(), qp_type, pick(), pick(), entries(), entries()).prop_flat_map(
        |(pd, qp_type, send_cq, recv_cq, sq_entries, rq_entries)| {
            let need = |e: u32| if e == 0 { 1 } else { ring_pages(e, WQE_SIZE) };
            let counts = prop::option::weighted(0.1, (small_or_any_u32(), small_or_any_u32()));
            (pages_for(need(sq_entries)), pages_for(need(rq_entries)), counts).prop_map(move |(sq, rq, counts)| {
                Body::CreateQp { pd, qp_type, send_cq, recv_cq, sq: (sq_entries, sq), rq: (rq_entries, rq), counts }
            })
        },
    )
}

fn modify_qp_body() -> impl Strategy<Value = Body> {
    let mask = prop_oneof![
        6 => prop::sample::select(vec![
            QP_ATTR_STATE,
            QP_ATTR_STATE | QP_ATTR_ACCESS_FLAGS,
            QP_ATTR_STATE | QP_ATTR_DEST_QPN,
            QP_ATTR_ACCESS_FLAGS,
            QP_ATTR_DEST_QPN,
            0,
        ]),
        1 => any::<u32>(),
    ];
    let state = prop_oneof![8 => 0..7u32, 1 => any::<u32>()];
    let access = prop_oneof![6 => 0..8u32, 1 => any::<u32>()];
    (pick(), mask, state, pick(), access).prop_map(|(qp, attr_mask, state, dest, access)| Body::ModifyQp {
        qp,
        attr_mask,
        state,
        dest,
        access,
    })
}

/// A body of the right kind for `opcode`.
fn body_for(opcode: Opcode) -> BoxedStrategy<Body> {
    match opcode {
        Opcode::QueryDevice | Opcode::AllocPd => Just(Body::Empty).boxed(),
        Opcode::QueryPort => {
            prop_oneof![4 => Just(1u32), 1 => any::<u32>()].prop_map(|port| Body::QueryPort { port }).boxed()
        }
        Opcode::DeallocPd | Opcode::DestroyCq | Opcode::DeregMr | Opcode::DestroyQp => {
            pick().prop_map(|pick| Body::Handle { pick }).boxed()
        }
        Opcode::CreateCq => create_cq_body().boxed(),
        Opcode::ReqNotifyCq => (pick(), prop_oneof![4 => 0..2u32, 1 => any::<u32>()])
            .prop_map(|(cq, solicited_only)| Body::ReqNotifyCq { cq, solicited_only })
            .boxed(),
        Opcode::RegMr => reg_mr_body().boxed(),
        Opcode::CreateQp => create_qp_body().boxed(),
        Opcode::ModifyQp => modify_qp_body().boxed(),
    }
}

/// An opcode and a body built for it, or arbitrary body bytes behind a small opcode.
fn any_body() -> impl Strategy<Value = (u32, Body)> {
    prop_oneof![
        8 => prop::sample::select(Opcode::ALL.to_vec())
            .prop_flat_map(|opcode| body_for(opcode).prop_map(move |body| (opcode as u32, body))),
        1 => (0..16u32, prop::collection::vec(any::<u8>(), 0..96)).prop_map(|(opcode, bytes)| (opcode, Body::Raw(bytes))),
    ]
}

/// A command: usually the opcode its body was built for, sometimes another (valid or not) over the same body.
fn command() -> impl Strategy<Value = CommandSpec> {
    let other_opcode = prop_oneof![0..16u32, Just(u32::MAX), any::<u32>()];
    (any_body(), prop::option::weighted(0.1, other_opcode), any::<u32>(), framing()).prop_map(
        |((opcode, body), other, tag, framing)| CommandSpec { opcode: other.unwrap_or(opcode), tag, body, framing },
    )
}

// ---------------------------------------------------------------------------------------------------------------
// Work requests and doorbells.

#[derive(Debug, Clone)]
struct SgeSpec {
    mr: Pick,
    offset: u64,
    length: u32,
}

#[derive(Debug, Clone)]
struct WqeSpec {
    /// The opcode, and whether it is a send opcode a RECV queue replaces by RECV.
    opcode: (u32, bool),
    flags: u32,
    wr_id: u64,
    sges: Vec<SgeSpec>,
    /// num_sge as written, when it is not the number of SGEs.
    num_sge: Option<u32>,
    remote: SgeSpec,
}

fn sge() -> impl Strategy<Value = SgeSpec> {
    let offset = prop_oneof![8 => 0..PAGE, 2 => 0..2 * PAGE, 1 => any::<u64>()];
    let length = prop_oneof![8 => 0..256u32, 2 => 0..2 * PAGE as u32, 1 => any::<u32>()];
    (pick(), offset, length).prop_map(|(mr, offset, length)| SgeSpec { mr, offset, length })
}

fn wqe_spec() -> impl Strategy<Value = WqeSpec> {
    // The opcode for the queue it is posted on (a send opcode on the SQ, RECV on the RQ), or any other.
    let opcode = prop_oneof![
        8 => prop::sample::select(vec![0u32, 1, 2]).prop_map(|op| (op, true)),
        1 => prop_oneof![Just(128u32), any::<u32>()].prop_map(|op| (op, false)),
    ];
    let num_sge = prop::option::weighted(0.1, prop_oneof![Just(3u32), Just(u32::MAX), any::<u32>()]);
    (opcode, 0..4u32, any::<u64>(), prop::collection::vec(sge(), 0..=MAX_SGE), num_sge, sge()).prop_map(
        |(opcode, flags, wr_id, sges, num_sge, remote)| WqeSpec { opcode, flags, wr_id, sges, num_sge, remote },
    )
}

#[derive(Debug, Clone)]
struct DoorbellSpec {
    kind: u32,
    handle: Pick,
    /// Added (wrapping) to the queue's producer index, or the index itself when the handle names no QP.
    index: u32,
    flags: u32,
}

fn doorbell_spec() -> impl Strategy<Value = DoorbellSpec> {
    let kind = prop_oneof![8 => 1..4u32, 1 => Just(0u32), 1 => any::<u32>()];
    let index = prop_oneof![
        4 => 0..4u32,
        1 => (0..4u32).prop_map(|k| u32::MAX - k),
        1 => Just(1u32 << 31),
        1 => any::<u32>(),
    ];
    (kind, pick(), index, 0..4u32).prop_map(|(kind, handle, index, flags)| DoorbellSpec { kind, handle, index, flags })
}

#[derive(Debug, Clone)]
enum Step {
    Command(CommandSpec),
    /// MODIFY_QP RESET→INIT→RTR→RTS to `dest`: what random single modifies rarely manage in a row.
    BringUp {
        qp: Pick,
        dest: Pick,
        access: u32,
    },
    /// Writes a WQE into a live QP's ring at its next slot and, with `ring`, rings the doorbell for it.
    Post {
        qp: Pick,
        recv: bool,
        wqe: WqeSpec,
        ring: bool,
    },
    /// One chain of doorbell records, the last possibly cut short.
    Doorbells {
        records: Vec<DoorbellSpec>,
        cut: usize,
    },
    /// QEMU invalidated an IOTLB range (the fake keeps the pages mapped).
    Invalidate {
        iova: u64,
        size: u64,
    },
    /// The guest unmapped a pool page: the fake refuses it and QEMU's invalidation reaches the HCA.
    Unmap {
        page: u64,
    },
    Remap {
        page: u64,
    },
    /// The transport's timer for a held send request (hold_completion_ms) ran out.
    ReleaseHold,
}

fn step() -> impl Strategy<Value = Step> {
    let invalidate_iova = prop_oneof![4 => page_iova(), 1 => any::<u64>()];
    let invalidate_size = prop_oneof![4 => 1..3 * PAGE, 1 => Just(0u64), 1 => Just(u64::MAX), 1 => any::<u64>()];
    prop_oneof![
        10 => command().prop_map(Step::Command),
        2 => (pick(), pick(), 0..8u32).prop_map(|(qp, dest, access)| Step::BringUp { qp, dest, access }),
        8 => (pick(), any::<bool>(), wqe_spec(), prop::bool::weighted(0.85))
            .prop_map(|(qp, recv, wqe, ring)| Step::Post { qp, recv, wqe, ring }),
        3 => (prop::collection::vec(doorbell_spec(), 0..4), prop_oneof![4 => Just(0usize), 1 => 1..16usize])
            .prop_map(|(records, cut)| Step::Doorbells { records, cut }),
        1 => (invalidate_iova, invalidate_size).prop_map(|(iova, size)| Step::Invalidate { iova, size }),
        1 => (0..POOL_PAGES).prop_map(|page| Step::Unmap { page }),
        1 => (0..POOL_PAGES).prop_map(|page| Step::Remap { page }),
        1 => Just(Step::ReleaseHold),
    ]
}

/// Device configurations that make the edges reachable: tiny pools and tables, probing, re-validation, injection.
fn hca_config() -> impl Strategy<Value = HcaConfig> {
    let count = || prop::option::weighted(0.2, 1..6u64);
    let injection = (
        (count(), count(), count(), count(), prop::option::of(0..3u32)),
        (prop::option::weighted(0.2, 1..4u32), any::<bool>(), count(), prop::option::weighted(0.3, page_iova())),
        (prop::option::weighted(0.3, 1..3 * PAGE), count()),
    )
        .prop_map(
            |(
                (fail_reg_mr, fail_ring_map, drop, delay, delay_doorbells),
                (cap, split, inv, inv_iova),
                (size, hold),
            )| {
                FaultInjection {
                    fail_reg_mr,
                    fail_ring_map,
                    drop_completion: drop,
                    delay_completion: delay,
                    delay_doorbells,
                    max_contiguous_pages: cap,
                    contiguous_policy: if split { ContiguousPolicy::Split } else { ContiguousPolicy::Refuse },
                    invalidate_at_dma: inv,
                    invalidate_iova: inv_iova,
                    invalidate_size: size,
                    // The time is the transport's: here a hold lasts until a ReleaseHold step.
                    hold_completion_ms: hold.map(|_| 1),
                    hold_completion_wr: hold,
                }
            },
        );
    let table = || prop_oneof![1 => 1..4u32, 3 => Just(64u32)];
    let registers =
        prop_oneof![1 => prop::sample::select(vec![1u32, 3, 8]), 4 => prop::sample::select(vec![12u32, 24, 256])];
    (registers, table(), table(), table(), any::<bool>(), any::<bool>(), injection).prop_map(
        |(map_registers, max_cq, max_qp, max_mr, probe_pages, revalidate_stale, injection)| HcaConfig {
            map_registers,
            max_pd: 4,
            max_cq,
            max_qp,
            max_mr,
            probe_pages,
            revalidate_stale,
            injection,
            ..HcaConfig::default()
        },
    )
}

// ---------------------------------------------------------------------------------------------------------------
// The model: what the test knows is alive, and the DMA watch that holds the HCA to it.

#[derive(Debug, Clone)]
struct QpModel {
    pages: Vec<u64>,
    sq: (u32, usize),
    rq: (u32, usize),
    sq_posted: u32,
    rq_posted: u32,
}

#[derive(Debug, Clone)]
struct MrModel {
    pages: Vec<u64>,
    addr: u64,
}

#[derive(Debug, Default)]
struct Model {
    pds: BTreeSet<u32>,
    cqs: BTreeMap<u32, Vec<u64>>,
    qps: BTreeMap<u32, QpModel>,
    mrs: BTreeMap<u32, MrModel>,
    /// Every handle ever returned, per kind: handles are never reused.
    seen: BTreeSet<(&'static str, u32)>,
}

fn resolve<T>(table: &BTreeMap<u32, T>, pick: Pick) -> u32 {
    match pick {
        Pick::Live(k) if !table.is_empty() => *table.keys().nth(usize::from(k) % table.len()).unwrap_or(&0),
        Pick::Live(_) => 0,
        Pick::Raw(h) => h,
    }
}

fn resolve_pd(pds: &BTreeSet<u32>, pick: Pick) -> u32 {
    match pick {
        Pick::Live(k) if !pds.is_empty() => *pds.iter().nth(usize::from(k) % pds.len()).unwrap_or(&0),
        Pick::Live(_) => 0,
        Pick::Raw(h) => h,
    }
}

impl Model {
    /// Pages of live objects, with multiplicity (a guest may list one page twice).
    fn live_pages(&self) -> BTreeMap<u64, u32> {
        let mut pages = BTreeMap::new();
        let lists =
            self.cqs.values().chain(self.qps.values().map(|q| &q.pages)).chain(self.mrs.values().map(|m| &m.pages));
        for list in lists {
            for &p in list {
                *pages.entry(p & !(PAGE - 1)).or_insert(0) += 1;
            }
        }
        pages
    }

    fn registers_held(&self) -> u64 {
        let cq: usize = self.cqs.values().map(Vec::len).sum();
        let qp: usize = self.qps.values().map(|q| q.pages.len()).sum();
        let mr: usize = self.mrs.values().map(|m| m.pages.len()).sum();
        (cq + qp + mr) as u64
    }
}

/// `Dma` over the fake IOMMU that records every access touching a page outside `allowed`.
struct Watched<'a> {
    mem: &'a FakeIommu,
    allowed: BTreeSet<u64>,
    strays: RefCell<Vec<String>>,
}

impl Watched<'_> {
    fn check(&self, dir: &str, iova: u64, len: usize) {
        let Some(pages) = vhca_proto::pages_spanned(iova, len) else {
            self.strays.borrow_mut().push(format!("{dir} [{iova:#x} +{len:#x}) wraps the address space"));
            return;
        };
        if let Some(page) = pages.into_iter().find(|page| !self.allowed.contains(page)) {
            self.strays.borrow_mut().push(format!("{dir} [{iova:#x} +{len:#x}) touches page {page:#x}"));
        }
    }
}

impl Dma for Watched<'_> {
    fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        self.check("read", iova, buf.len());
        self.mem.read(iova, buf)
    }

    fn write(&self, iova: u64, buf: &[u8]) -> Result<(), DmaError> {
        self.check("write", iova, buf.len());
        self.mem.write(iova, buf)
    }
}

/// The watch for one HCA call: pages of live objects plus `extra` (a create command's own pages) are allowed.
fn watch<'a>(model: &Model, mem: &'a FakeIommu, extra: &[u64]) -> Watched<'a> {
    let mut allowed: BTreeSet<u64> = model.live_pages().into_keys().collect();
    allowed.extend(extra.iter().map(|p| p & !(PAGE - 1)));
    Watched { mem, allowed, strays: RefCell::new(Vec::new()) }
}

/// One case: the HCA on a fake IOMMU, the model of what is alive, and the pages the guest has mapped.
struct Harness {
    rig: Rig,
    model: Model,
    mapped: BTreeSet<u64>,
    total: u32,
}

impl Harness {
    fn new(config: HcaConfig) -> Harness {
        let rig = Rig::new(config);
        rig.mem.map(BASE, READ_ONLY_FROM, true, true);
        rig.mem.map(pool_page(READ_ONLY_FROM), WRITE_ONLY_FROM - READ_ONLY_FROM, true, false);
        rig.mem.map(pool_page(WRITE_ONLY_FROM), POOL_PAGES - WRITE_ONLY_FROM, false, true);
        let total = rig.hca.map_registers().0;
        let mapped = (0..POOL_PAGES).map(pool_page).collect();
        Harness { rig, model: Model::default(), mapped, total }
    }

    fn events_since(&self, from: usize) -> Vec<HcaEvent> {
        self.rig.events.0.lock().unwrap()[from..].to_vec()
    }

    fn event_count(&self) -> usize {
        self.rig.events.0.lock().unwrap().len()
    }

    /// After every step: no stray DMA, and the pool holds exactly one register per page of a live object.
    fn check_invariants(&self, what: &str, strays: Vec<String>) -> Result<(), TestCaseError> {
        prop_assert!(strays.is_empty(), "{what}: DMA outside live objects' pages: {strays:?}");
        let (total, free) = self.rig.hca.map_registers();
        prop_assert_eq!(total, self.total, "{}: the pool changed size", what);
        prop_assert!(free <= total, "{what}: {free} free of {total}");
        prop_assert_eq!(
            u64::from(total - free),
            self.model.registers_held(),
            "{}: registers in use differ from the pages of live objects {:?}",
            what,
            self.model
        );
        Ok(())
    }

    /// Runs one request, checks the response, the log lines and the invariants; returns the status and body.
    fn execute(&mut self, request: &[u8]) -> Result<(Status, Vec<u8>), TestCaseError> {
        let in_flight = vhca_proto::listed_pages(request).collect::<Vec<u64>>();
        let before = self.event_count();
        let watched = watch(&self.model, &self.rig.mem, &in_flight);
        let response = self.rig.hca.execute(&watched, request);
        let strays = watched.strays.into_inner();
        // The log: one `command` line with the status, and for a refusal one `refused` line with a cause.
        let events = self.events_since(before);
        let checked = vhca_hca::invariants::check_command(request, &response, &events);
        let (status, body) =
            checked.map_err(|broken| TestCaseError::fail(format!("command {request:02x?}: {broken}")))?;
        let body = body.to_vec();
        if status == Status::Ok {
            self.record_success(request, &in_flight, &body)?;
        }
        self.check_invariants(&format!("command {request:02x?} -> {status:?}"), strays)?;
        Ok((status, body))
    }

    /// Updates the model after a command the HCA accepted.
    fn record_success(&mut self, request: &[u8], pages: &[u64], body: &[u8]) -> Result<(), TestCaseError> {
        let (header, rest) = CommandHeader::read_from_prefix(request).map_err(|_| fail("accepted a short request"))?;
        let fixed = rest.get(..header.body_len.get() as usize).unwrap_or(&[]);
        let handle_in = || HandleReq::read_from_prefix(fixed).map(|(h, _)| h.handle.get()).unwrap_or(0);
        let handle_out = || HandleResp::read_from_prefix(body).map(|(h, _)| h.handle.get()).unwrap_or(0);
        match Opcode::from_u32(header.opcode.get()) {
            Some(Opcode::AllocPd) => {
                let pd = handle_out();
                fresh(&mut self.model.seen, "pd", pd)?;
                self.model.pds.insert(pd);
            }
            Some(Opcode::DeallocPd) => prop_assert!(self.model.pds.remove(&handle_in()), "dealloc of a dead PD"),
            Some(Opcode::CreateCq) => {
                let cq = handle_out();
                fresh(&mut self.model.seen, "cq", cq)?;
                self.model.cqs.insert(cq, pages.to_vec());
            }
            Some(Opcode::DestroyCq) => prop_assert!(self.model.cqs.remove(&handle_in()).is_some(), "dead CQ"),
            Some(Opcode::RegMr) => {
                let key = RegMrResp::read_from_bytes(body).map_err(|_| fail("REG_MR response"))?.lkey.get();
                fresh(&mut self.model.seen, "mr", key)?;
                let req = RegMrReq::read_from_prefix(fixed).map_err(|_| fail("REG_MR body"))?.0;
                self.model.mrs.insert(key, MrModel { pages: pages.to_vec(), addr: req.addr.get() });
            }
            Some(Opcode::DeregMr) => prop_assert!(self.model.mrs.remove(&handle_in()).is_some(), "dead MR"),
            Some(Opcode::CreateQp) => {
                let qpn = handle_out();
                fresh(&mut self.model.seen, "qp", qpn)?;
                let req = CreateQpReq::read_from_prefix(fixed).map_err(|_| fail("CREATE_QP body"))?.0;
                let sq_pages = req.sq_page_count.get() as usize;
                let qp = QpModel {
                    pages: pages.to_vec(),
                    sq: (req.sq_entries.get(), 0),
                    rq: (req.rq_entries.get(), sq_pages),
                    sq_posted: 0,
                    rq_posted: 0,
                };
                self.model.qps.insert(qpn, qp);
            }
            Some(Opcode::DestroyQp) => prop_assert!(self.model.qps.remove(&handle_in()).is_some(), "dead QP"),
            Some(Opcode::ModifyQp) => {
                let req = ModifyQpReq::read_from_prefix(fixed).map_err(|_| fail("MODIFY_QP body"))?.0;
                // RESET restarts the rings, so the driver's producer counts start again too.
                if req.attr_mask.get() & QP_ATTR_STATE != 0 && req.state.get() == QpState::Reset as u32 {
                    if let Some(qp) = self.model.qps.get_mut(&req.qpn.get()) {
                        qp.sq_posted = 0;
                        qp.rq_posted = 0;
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn build(&self, spec: &CommandSpec) -> Vec<u8> {
        let m = &self.model;
        let h = |pick| HandleReq { handle: pick, reserved: 0.into() }.as_bytes().to_vec();
        let list = |pages: &[u64]| pages.iter().flat_map(|p| p.to_le_bytes()).collect::<Vec<u8>>();
        let mut body = match &spec.body {
            Body::Empty => Vec::new(),
            Body::QueryPort { port } => QueryPortReq { port: (*port).into(), reserved: 0.into() }.as_bytes().to_vec(),
            Body::Handle { pick } => {
                let handle = match Opcode::from_u32(spec.opcode) {
                    Some(Opcode::DeallocPd) => resolve_pd(&m.pds, *pick),
                    Some(Opcode::DeregMr) => resolve(&m.mrs, *pick),
                    Some(Opcode::DestroyQp) => resolve(&m.qps, *pick),
                    _ => resolve(&m.cqs, *pick),
                };
                h(handle.into())
            }
            Body::CreateCq { entries, page_count, pages } => {
                let count = page_count.unwrap_or(pages.len() as u32);
                let mut b = CreateCqReq { entries: (*entries).into(), page_count: count.into() }.as_bytes().to_vec();
                b.extend(list(pages));
                b
            }
            Body::ReqNotifyCq { cq, solicited_only } => {
                let req = ReqNotifyCqReq { cq: resolve(&m.cqs, *cq).into(), solicited_only: (*solicited_only).into() };
                req.as_bytes().to_vec()
            }
            Body::RegMr { pd, access, addr, length, first_page_offset, page_count, pages } => {
                let req = RegMrReq {
                    pd: resolve_pd(&m.pds, *pd).into(),
                    access: (*access).into(),
                    addr: (*addr).into(),
                    length: (*length).into(),
                    first_page_offset: (*first_page_offset).into(),
                    page_count: page_count.unwrap_or(pages.len() as u32).into(),
                };
                let mut b = req.as_bytes().to_vec();
                b.extend(list(pages));
                b
            }
            Body::CreateQp { pd, qp_type, send_cq, recv_cq, sq, rq, counts } => {
                let (sq_count, rq_count) = counts.unwrap_or((sq.1.len() as u32, rq.1.len() as u32));
                let req = CreateQpReq {
                    pd: resolve_pd(&m.pds, *pd).into(),
                    qp_type: (*qp_type).into(),
                    send_cq: resolve(&m.cqs, *send_cq).into(),
                    recv_cq: resolve(&m.cqs, *recv_cq).into(),
                    sq_entries: sq.0.into(),
                    rq_entries: rq.0.into(),
                    sq_page_count: sq_count.into(),
                    rq_page_count: rq_count.into(),
                };
                let mut b = req.as_bytes().to_vec();
                b.extend(list(&sq.1));
                b.extend(list(&rq.1));
                b
            }
            Body::ModifyQp { qp, attr_mask, state, dest, access } => ModifyQpReq {
                qpn: resolve(&m.qps, *qp).into(),
                attr_mask: (*attr_mask).into(),
                state: (*state).into(),
                dest_qpn: resolve(&m.qps, *dest).into(),
                access: (*access).into(),
                reserved: 0.into(),
            }
            .as_bytes()
            .to_vec(),
            Body::Raw(bytes) => bytes.clone(),
        };
        let f = &spec.framing;
        let body_len = f.body_len.unwrap_or_else(|| (body.len() as u32).wrapping_add_signed(f.body_len_delta));
        let header = CommandHeader {
            opcode: spec.opcode.into(),
            tag: spec.tag.into(),
            body_len: body_len.into(),
            reserved: 0.into(),
        };
        let mut request = header.as_bytes().to_vec();
        request.append(&mut body);
        request.truncate(request.len().saturating_sub(f.cut));
        request.extend_from_slice(&f.extra);
        request
    }

    fn modify(&mut self, qpn: u32, mask: u32, state: QpState, dest: u32, access: u32) -> Result<Status, TestCaseError> {
        let req = ModifyQpReq {
            qpn: qpn.into(),
            attr_mask: mask.into(),
            state: (state as u32).into(),
            dest_qpn: dest.into(),
            access: access.into(),
            reserved: 0.into(),
        };
        Ok(self.execute(&Rig::request(Opcode::ModifyQp, 0x4242, req.as_bytes(), &[]))?.0)
    }

    fn doorbells(&mut self, records: &[u8]) -> Result<(), TestCaseError> {
        let before = self.event_count();
        let watched = watch(&self.model, &self.rig.mem, &[]);
        self.rig.hca.doorbell(&watched, records);
        let strays = watched.strays.into_inner();
        // Every record, a short last one included, gets one doorbell line; a refused one says why.
        let lines: Vec<(bool, bool)> = self
            .events_since(before)
            .iter()
            .filter_map(|e| match e {
                HcaEvent::Doorbell { ok, detail, .. } => Some((*ok, detail.as_ref().is_some_and(|d| !d.is_empty()))),
                _ => None,
            })
            .collect();
        prop_assert_eq!(lines.len(), records.len().div_ceil(DOORBELL_SIZE), "doorbell lines for {:02x?}", records);
        prop_assert!(lines.iter().all(|(ok, why)| *ok || *why), "a refused doorbell without a cause: {lines:?}");
        self.check_invariants(&format!("doorbells {records:02x?}"), strays)
    }

    fn wqe(&self, spec: &WqeSpec, recv: bool) -> Wqe {
        let sge = |s: &SgeSpec| {
            let key = resolve(&self.model.mrs, s.mr);
            let base = self.model.mrs.get(&key).map_or(0, |m| m.addr);
            Sge { addr: base.wrapping_add(s.offset).into(), length: s.length.into(), lkey: key.into() }
        };
        let mut wqe = Wqe {
            wr_id: spec.wr_id.into(),
            opcode: match spec.opcode {
                (_, true) if recv => WrOpcode::Recv as u32,
                (op, _) => op,
            }
            .into(),
            flags: spec.flags.into(),
            remote_addr: sge(&spec.remote).addr,
            rkey: sge(&spec.remote).lkey,
            num_sge: spec.num_sge.unwrap_or(spec.sges.len() as u32).into(),
            sge: [Sge::default(); MAX_SGE],
        };
        for (slot, s) in wqe.sge.iter_mut().zip(&spec.sges) {
            *slot = sge(s);
        }
        wqe
    }

    fn run(&mut self, step: &Step) -> Result<(), TestCaseError> {
        match step {
            Step::Command(spec) => {
                let request = self.build(spec);
                self.execute(&request)?;
            }
            Step::BringUp { qp, dest, access } => {
                let (qpn, dest) = (resolve(&self.model.qps, *qp), resolve(&self.model.qps, *dest));
                let _ = self.modify(qpn, QP_ATTR_STATE | QP_ATTR_ACCESS_FLAGS, QpState::Init, 0, *access)?;
                let _ = self.modify(qpn, QP_ATTR_STATE | QP_ATTR_DEST_QPN, QpState::Rtr, dest, 0)?;
                let _ = self.modify(qpn, QP_ATTR_STATE, QpState::Rts, 0, 0)?;
            }
            Step::Post { qp, recv, wqe, ring } => {
                let qpn = resolve(&self.model.qps, *qp);
                let bytes = self.wqe(wqe, *recv);
                let Some(q) = self.model.qps.get_mut(&qpn) else {
                    return self.doorbells(&doorbell(if *recv { 2 } else { 1 }, qpn, 1, 0));
                };
                let ((entries, first), posted) =
                    if *recv { (q.rq, &mut q.rq_posted) } else { (q.sq, &mut q.sq_posted) };
                let offset = u64::from(*posted % entries.max(1)) * WQE_SIZE as u64;
                *posted = posted.wrapping_add(1);
                let index = *posted;
                let page = q.pages.get(first + (offset / PAGE) as usize).copied();
                // The guest writes its own ring; a page it listed but never mapped just stays unwritten.
                if let Some(page) = page.filter(|p| self.mapped.contains(p)) {
                    self.rig.mem.poke(page + offset % PAGE, bytes.as_bytes());
                }
                if *ring {
                    self.doorbells(&doorbell(if *recv { 2 } else { 1 }, qpn, index, 0))?;
                }
            }
            Step::Doorbells { records, cut } => {
                let mut bytes = Vec::new();
                for r in records {
                    let handle = match r.kind {
                        3 => resolve(&self.model.cqs, r.handle),
                        _ => resolve(&self.model.qps, r.handle),
                    };
                    let base =
                        self.model.qps.get(&handle).map_or(0, |q| if r.kind == 2 { q.rq_posted } else { q.sq_posted });
                    bytes.extend(doorbell(r.kind, handle, base.wrapping_add(r.index), r.flags));
                }
                bytes.truncate(bytes.len().saturating_sub(*cut));
                self.doorbells(&bytes)?;
            }
            Step::Invalidate { iova, size } => {
                self.rig.hca.iotlb_invalidated(*iova, *size);
                self.check_invariants("invalidate", Vec::new())?;
            }
            Step::Unmap { page } => {
                let iova = pool_page(*page);
                self.rig.mem.unmap(iova, 1);
                self.mapped.remove(&iova);
                self.rig.hca.iotlb_invalidated(iova, PAGE);
                self.check_invariants("unmap", Vec::new())?;
            }
            Step::Remap { page } => {
                let iova = pool_page(*page);
                if self.mapped.insert(iova) {
                    self.rig.mem.map(iova, 1, true, true);
                }
            }
            Step::ReleaseHold => {
                let watched = watch(&self.model, &self.rig.mem, &[]);
                self.rig.hca.release_held_work(&watched);
                let strays = watched.strays.into_inner();
                self.check_invariants("release of a held request", strays)?;
            }
        }
        Ok(())
    }

    /// What a driver sets up first: a PD, two CQs, two QPs connected to each other in RTS and two MRs, each on
    /// its own pool pages. Refusals (tiny pools or tables, injection) are fine: the steps then start from less.
    fn prologue(&mut self, access: u32) -> Result<(), TestCaseError> {
        self.execute(&Rig::request(Opcode::AllocPd, 1, &[], &[]))?;
        let pd = resolve_pd(&self.model.pds, Pick::Live(0));
        for page in [0, 1] {
            let req = CreateCqReq { entries: 64.into(), page_count: 1.into() };
            self.execute(&Rig::request(Opcode::CreateCq, 2, req.as_bytes(), &[pool_page(page)]))?;
        }
        let (cq_a, cq_b) = (resolve(&self.model.cqs, Pick::Live(0)), resolve(&self.model.cqs, Pick::Live(1)));
        for (cq, sq, rq) in [(cq_a, 2, 3), (cq_b, 4, 5)] {
            let req = CreateQpReq {
                pd: pd.into(),
                qp_type: QP_TYPE_RC.into(),
                send_cq: cq.into(),
                recv_cq: cq.into(),
                sq_entries: 16.into(),
                rq_entries: 16.into(),
                sq_page_count: 1.into(),
                rq_page_count: 1.into(),
            };
            self.execute(&Rig::request(Opcode::CreateQp, 3, req.as_bytes(), &[pool_page(sq), pool_page(rq)]))?;
        }
        for (k, first) in [(0u64, 6), (1, 8)] {
            let req = RegMrReq {
                pd: pd.into(),
                access: ACCESS_ALL.into(),
                addr: (0x7000_0000_0000 + k * 0x100_0000).into(),
                length: (2 * PAGE).into(),
                first_page_offset: 0.into(),
                page_count: 2.into(),
            };
            let pages = [pool_page(first), pool_page(first + 1)];
            self.execute(&Rig::request(Opcode::RegMr, 4, req.as_bytes(), &pages))?;
        }
        for (qp, dest) in [(Pick::Live(0), Pick::Live(1)), (Pick::Live(1), Pick::Live(0))] {
            self.run(&Step::BringUp { qp, dest, access })?;
        }
        Ok(())
    }

    /// Destroys everything alive, in the order the HCA allows; every destroy must succeed and free every register.
    fn teardown(&mut self) -> Result<(), TestCaseError> {
        let destroy = |opcode: Opcode, handle: u32| {
            Rig::request(opcode, 0x7d, HandleReq { handle: handle.into(), reserved: 0.into() }.as_bytes(), &[])
        };
        let qps: Vec<u32> = self.model.qps.keys().copied().collect();
        let mrs: Vec<u32> = self.model.mrs.keys().copied().collect();
        let cqs: Vec<u32> = self.model.cqs.keys().copied().collect();
        let pds: Vec<u32> = self.model.pds.iter().copied().collect();
        let all =
            [(Opcode::DestroyQp, qps), (Opcode::DeregMr, mrs), (Opcode::DestroyCq, cqs), (Opcode::DeallocPd, pds)];
        for (opcode, handles) in all {
            for handle in handles {
                let (status, _) = self.execute(&destroy(opcode, handle))?;
                prop_assert_eq!(status, Status::Ok, "{:?} {:#x}", opcode, handle);
            }
        }
        let (total, free) = self.rig.hca.map_registers();
        prop_assert_eq!(free, total, "registers still in use after everything was destroyed");
        Ok(())
    }
}

/// Handles are never reused: a second hand-out of one fails the case.
fn fresh(seen: &mut BTreeSet<(&'static str, u32)>, kind: &'static str, handle: u32) -> Result<(), TestCaseError> {
    prop_assert!(seen.insert((kind, handle)), "{} handle {:#x} handed out twice", kind, handle);
    Ok(())
}

fn doorbell(kind: u32, handle: u32, index: u32, flags: u32) -> Vec<u8> {
    Doorbell { kind: kind.into(), handle: handle.into(), index: index.into(), flags: flags.into() }.as_bytes().to_vec()
}

fn fail(what: &str) -> TestCaseError {
    TestCaseError::fail(format!("unparseable {what}"))
}

// ---------------------------------------------------------------------------------------------------------------
// The properties.

proptest! {
    #![proptest_config(config(512))]

    /// (a) Any bytes at all, as a command and as doorbell records.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..160), db in prop::collection::vec(any::<u8>(), 0..80)) {
        let mut h = Harness::new(HcaConfig { map_registers: 16, ..HcaConfig::default() });
        h.execute(&bytes)?;
        h.doorbells(&db)?;
        h.teardown()?;
    }

    /// (a) A well-formed header in front of arbitrary bytes, with any opcode and any body_len.
    #[test]
    fn any_header_with_random_body(
        opcode in prop_oneof![0..16u32, any::<u32>()],
        tag in any::<u32>(),
        body_len in prop_oneof![0..128u32, Just(u32::MAX), any::<u32>()],
        body in prop::collection::vec(any::<u8>(), 0..128),
    ) {
        let mut h = Harness::new(HcaConfig { map_registers: 16, ..HcaConfig::default() });
        let header = CommandHeader { opcode: opcode.into(), tag: tag.into(), body_len: body_len.into(), reserved: 0.into() };
        let mut request = header.as_bytes().to_vec();
        request.extend_from_slice(&body);
        h.execute(&request)?;
        h.teardown()?;
    }

    /// (b) Structured commands with bent fields, page lists and framing, each on a fresh device with a few objects
    /// already alive for the handles to name.
    #[test]
    fn malformed_commands_get_a_status(config in hca_config(), commands in prop::collection::vec(command(), 1..6)) {
        let mut h = Harness::new(config);
        for opcode in [Opcode::AllocPd, Opcode::QueryDevice] {
            h.execute(&Rig::request(opcode, 1, &[], &[]))?;
        }
        for spec in &commands {
            let request = h.build(spec);
            h.execute(&request)?;
        }
        h.teardown()?;
    }
}

proptest! {
    #![proptest_config(config(320))]

    /// (c) Sequences of commands, posted work, doorbells and invalidations; everything is destroyed at the end.
    #[test]
    fn random_sequences_keep_the_model(
        config in hca_config(),
        prologue in prop::option::weighted(0.85, prop_oneof![3 => Just(ACCESS_ALL), 1 => 0..8u32]),
        steps in prop::collection::vec(step(), 1..64),
    ) {
        let mut h = Harness::new(config);
        if let Some(access) = prologue {
            h.prologue(access)?;
        }
        for step in &steps {
            h.run(step)?;
        }
        h.teardown()?;
    }
}

/// The harness itself can fail: a DMA to a page no live object lists is caught, and so is a register count that
/// does not match the live objects.
#[test]
fn the_watch_catches_stray_dma_and_register_drift() {
    let h = Harness::new(HcaConfig::default());
    let watched = watch(&h.model, &h.rig.mem, &[pool_page(1)]);
    let mut buf = [0u8; 8];
    watched.read(pool_page(1) + 8, &mut buf).unwrap();
    assert!(watched.strays.borrow().is_empty());
    watched.read(pool_page(1) + PAGE - 4, &mut buf).unwrap();
    assert_eq!(watched.strays.borrow().len(), 1, "the second page of that access is not allowed");
    let _ = watched.write(u64::MAX - 2, &buf);
    assert_eq!(watched.strays.borrow().len(), 2, "a wrapping access is a stray");

    let mut h = Harness::new(HcaConfig { map_registers: 8, ..HcaConfig::default() });
    let req = CreateCqReq { entries: 64.into(), page_count: 1.into() };
    let (status, _) = h.execute(&Rig::request(Opcode::CreateCq, 1, req.as_bytes(), &[pool_page(0)])).unwrap();
    assert_eq!(status, Status::Ok);
    h.model.cqs.clear();
    assert!(h.check_invariants("drift", Vec::new()).is_err(), "a register held by no modelled object is drift");
}
