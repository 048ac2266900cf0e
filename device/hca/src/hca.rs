//! The HCA: its configuration, its object tables and the entry points the transport calls. The work behind each
//! entry point lives in commands.rs (queue 0), doorbells.rs (queue 2), work_requests.rs and completions.rs.

use std::collections::BTreeMap;
use std::sync::Arc;

use vhca_proto::{DeviceConfig, ABI_VERSION, CONFIG_MAGIC, NUM_QUEUES};

use crate::completions::DelayedCompletion;
use crate::cq::Cq;
use crate::dma_engine::DmaEngine;
use crate::event_records::HcaEvent;
use crate::fault_injection::{FaultInjection, Injector};
use crate::handles::HandleAllocator;
use crate::held_work::HeldWork;
use crate::map_registers::MapRegisterPool;
use crate::mr::MrTable;
use crate::notify::Notifier;
use crate::pd::PdTable;
use crate::qp::Qp;
use crate::{Dma, EventSink};

#[derive(Debug, Clone)]
pub struct HcaConfig {
    /// Size of the map-register pool: one register per ring or MR page.
    pub map_registers: u32,
    pub max_pd: u32,
    pub max_cq: u32,
    /// Largest CQ, in CQEs.
    pub max_cqe: u32,
    pub max_qp: u32,
    /// Largest SQ or RQ, in WQEs.
    pub max_qp_wr: u32,
    pub max_mr: u32,
    /// Read one byte of every page when a ring or MR is mapped, so an IOVA the vIOMMU refuses fails the command
    /// (Status::IommuFault) instead of a later work request. Off by default: it adds DMA the driver did not ask for.
    pub probe_pages: bool,
    /// A register made stale by an IOTLB invalidation is re-validated on its next use (logged) instead of refused.
    /// Off by default: a stale translation is a driver bug (memory unmapped while still registered).
    pub revalidate_stale: bool,
    pub node_guid: u64,
    pub injection: FaultInjection,
}

impl Default for HcaConfig {
    fn default() -> Self {
        HcaConfig {
            map_registers: 4096,
            max_pd: 1024,
            max_cq: 1024,
            max_cqe: 32768,
            max_qp: 1024,
            max_qp_wr: 8192,
            max_mr: 4096,
            probe_pages: false,
            revalidate_stale: false,
            node_guid: 0x5648_4341_0000_0001,
            injection: FaultInjection::default(),
        }
    }
}

pub struct Hca {
    pub(crate) config: HcaConfig,
    pub(crate) out: Notifier,
    pub(crate) engine: DmaEngine,
    pub(crate) pds: PdTable,
    pub(crate) cqs: BTreeMap<u32, Cq>,
    pub(crate) cq_handles: HandleAllocator,
    pub(crate) qps: BTreeMap<u32, Qp>,
    pub(crate) qp_handles: HandleAllocator,
    pub(crate) mrs: MrTable,
    pub(crate) delayed: Vec<DelayedCompletion>,
    /// Doorbell records fully processed; the clock of delayed completions.
    pub(crate) doorbells_done: u64,
    /// True while a doorbell record is being processed (a completion made then waits from the next record on).
    pub(crate) in_doorbell: bool,
    /// The send work request the hold_completion knob holds, until the transport releases it (`held_work`).
    pub(crate) held: Option<HeldWork>,
    /// How long to hold the request held since the transport last asked (`Hca::take_new_hold`).
    pub(crate) new_hold: Option<std::time::Duration>,
}

/// QP numbers start above the special QPs 0 and 1 of InfiniBand, so a zeroed dest_qpn never names a QP.
const FIRST_QPN: u32 = 0x10;

impl Hca {
    pub fn new(config: HcaConfig, events: Arc<dyn EventSink>) -> Hca {
        let engine = DmaEngine::new(
            MapRegisterPool::new(config.map_registers),
            Injector::new(config.injection.clone()),
            config.revalidate_stale,
        );
        Hca {
            out: Notifier::new(events),
            engine,
            pds: PdTable::new(config.max_pd),
            cqs: BTreeMap::new(),
            cq_handles: HandleAllocator::new(1, config.max_cq),
            qps: BTreeMap::new(),
            qp_handles: HandleAllocator::new(FIRST_QPN, config.max_qp),
            mrs: MrTable::new(config.max_mr),
            delayed: Vec::new(),
            doorbells_done: 0,
            in_doorbell: false,
            held: None,
            new_hold: None,
            config,
        }
    }

    /// The 12-byte config space the transport serves through GET_CONFIG.
    pub fn device_config(&self) -> DeviceConfig {
        DeviceConfig {
            magic: CONFIG_MAGIC.into(),
            abi_version: ABI_VERSION.into(),
            num_queues: NUM_QUEUES.into(),
            map_registers: self.config.map_registers.into(),
        }
    }

    /// Executes one command: `request` is the device-readable part of the chain (header + body + page list).
    /// Returns the response (header + body) for the device-writable part. Never fails: refusals are statuses.
    pub fn execute(&mut self, dma: &dyn Dma, request: &[u8]) -> Vec<u8> {
        self.out.request_started();
        self.execute_command(dma, request)
    }

    /// Handles the device-readable bytes of one doorbell-queue chain (queue 2): zero or more `Doorbell` records.
    /// Work it triggers runs now, by DMA through `dma`.
    pub fn doorbell(&mut self, dma: &dyn Dma, records: &[u8]) {
        self.ring_doorbells(dma, records);
    }

    /// The next asynchronous event for the event queue (queue 1), if any. The transport writes it into the next
    /// buffer the driver posted there; while none is posted, events wait here.
    pub fn pop_async_event(&mut self) -> Option<vhca_proto::Event> {
        self.out.pop_async()
    }

    /// QEMU invalidated IOTLB entries covering [iova, iova + size): map registers whose page meets the range are
    /// stale from now on, and their next use is refused as StaleTranslation (unless `revalidate_stale`).
    pub fn iotlb_invalidated(&mut self, iova: u64, size: u64) {
        self.out.request_started();
        let registers = self.engine.pool.invalidate(iova, size);
        if registers > 0 {
            self.out.emit(HcaEvent::TranslationsStale { iova, size, registers, injected: false });
        }
    }

    /// Map registers in the pool, and how many are free now.
    pub fn map_registers(&self) -> (u32, u32) {
        (self.engine.pool.total(), self.engine.pool.free_count())
    }

    /// The state of a QP, if it exists (for tests and diagnostics).
    pub fn qp_state(&self, qpn: u32) -> Option<vhca_proto::QpState> {
        self.qps.get(&qpn).map(|q| q.state)
    }
}
