//! The HCA driven as a guest would drive it: command chains, WQEs written into guest memory, doorbells, and IOTLB
//! invalidations and remaps, all through the device's real IOTLB and IOMMU-translated memory (`QueueDma`). Checks
//! the property tests' invariants after every step: no DMA outside the pages of live objects (or the command in
//! flight) and the IOTLB's current mappings, map registers in use equal to live objects' pages, and every refused
//! command or doorbell logged with its cause.
//!
//! Input: records `[op][len][len bytes]`, easy to write by hand for seeds (see `encode`).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use vhca_device::event_log::EventLog;
use vhca_device::iommu_dma::QueueDma;
use vhca_device::shared::Shared;
use vhca_hca::{Dma, DmaError, EventSink, Hca, HcaConfig, HcaEvent};
use vhca_proto::{CommandHeader, Opcode, DOORBELL_SIZE};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap, Permissions};
use zerocopy::IntoBytes;

pub const PAGE: u64 = 0x1000;
/// Guest pages the IOTLB can map; page indices in the input are taken modulo `POOL_PAGES + 4`, so a few name
/// IOVAs that were never backed.
pub const POOL_PAGES: u64 = 32;
/// IOVA of pool page 0: unlike the QEMU address, so a device mixing the two up is caught.
pub const IOVA: u64 = 0x10_0000;
const UADDR: u64 = 0x7f00_0000_0000;

pub const OP_COMMAND: u8 = 0;
pub const OP_RAW_COMMAND: u8 = 1;
pub const OP_DOORBELLS: u8 = 2;
pub const OP_GUEST_WRITE: u8 = 3;
pub const OP_INVALIDATE: u8 = 4;
pub const OP_REMAP: u8 = 5;
const OPS: u8 = 6;

pub fn page_iova(index: u8) -> u64 {
    IOVA + u64::from(index) % (POOL_PAGES + 4) * PAGE
}

/// One record of the input format.
pub fn encode(op: u8, payload: &[u8]) -> Vec<u8> {
    let len = u8::try_from(payload.len()).expect("a record carries at most 255 bytes");
    let mut out = vec![op, len];
    out.extend_from_slice(payload);
    out
}

/// A command record: opcode, tag, the pool pages of its page list, then the fixed body.
pub fn command_record(opcode: Opcode, tag: u8, pages: &[u8], body: &[u8]) -> Vec<u8> {
    let mut payload = vec![opcode as u8, tag, u8::try_from(pages.len()).expect("few pages")];
    payload.extend_from_slice(pages);
    payload.extend_from_slice(body);
    encode(OP_COMMAND, &payload)
}

#[derive(Default)]
struct Collected(Mutex<Vec<HcaEvent>>);

impl EventSink for Collected {
    fn emit(&self, event: HcaEvent) {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).push(event);
    }
}

/// Every DMA the HCA makes goes through here to the real `QueueDma`; successful ones are checked against what the
/// HCA may touch.
struct Watched<'a> {
    inner: QueueDma<'a>,
    allowed: &'a BTreeSet<u64>,
    mapped: &'a BTreeMap<u64, Permissions>,
}

impl Watched<'_> {
    fn check(&self, iova: u64, len: usize, write: bool) {
        let Some(pages) = vhca_proto::pages_spanned(iova, len) else { panic!("DMA at {iova:#x}+{len} wraps") };
        for page in pages {
            assert!(self.allowed.contains(&page), "DMA at {iova:#x}+{len} touches page {page:#x} of no live object");
            let perm = self.mapped.get(&page).copied().unwrap_or(Permissions::No);
            let ok = if write { perm.has_write() } else { perm.allow(Permissions::Read) };
            assert!(ok, "DMA at {iova:#x}+{len} succeeded on page {page:#x} the IOTLB maps {perm:?}");
        }
    }
}

impl Dma for Watched<'_> {
    fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), DmaError> {
        self.inner.read(iova, buf)?;
        if !buf.is_empty() {
            self.check(iova, buf.len(), false);
        }
        Ok(())
    }

    fn write(&self, iova: u64, buf: &[u8]) -> Result<(), DmaError> {
        self.inner.write(iova, buf)?;
        if !buf.is_empty() {
            self.check(iova, buf.len(), true);
        }
        Ok(())
    }
}

struct Harness {
    shared: Shared,
    ram: GuestMemoryMmap<()>,
    hca: Hca,
    events: Arc<Collected>,
    /// Pool pages the IOTLB maps now, with their permission (what the test set, mirrored).
    mapped: BTreeMap<u64, Permissions>,
    /// Live objects (kind, handle) and the page IOVAs their creating command listed.
    objects: BTreeMap<(&'static str, u32), Vec<u64>>,
    total: u32,
    seen: Vec<HcaEvent>,
}

impl Harness {
    fn new(map_registers: u32) -> Harness {
        let log = Arc::new(EventLog::to_writer(Box::new(std::io::sink())));
        // No miss wait: there is no QEMU to answer, so a miss is an IOMMU fault at once.
        let shared = Shared::new(log, 4, Duration::ZERO).expect("eventfd for the shared state");
        let ram = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(UADDR), (POOL_PAGES * PAGE) as usize)])
            .expect("anonymous guest memory");
        shared.replace_memory(ram.clone());
        let mut mapped = BTreeMap::new();
        for page in 0..POOL_PAGES {
            // The last pages start read-only and write-only, as a driver's mappings may be.
            let perm = match page {
                p if p >= POOL_PAGES - 2 => Permissions::Write,
                p if p >= POOL_PAGES - 4 => Permissions::Read,
                _ => Permissions::ReadWrite,
            };
            mapped.insert(IOVA + page * PAGE, perm);
        }
        let mut harness = Harness {
            shared,
            ram,
            hca: Hca::new(HcaConfig { map_registers, ..HcaConfig::default() }, Arc::new(Collected::default())),
            events: Arc::new(Collected::default()),
            mapped: BTreeMap::new(),
            objects: BTreeMap::new(),
            total: map_registers,
            seen: Vec::new(),
        };
        harness.hca = Hca::new(HcaConfig { map_registers, ..HcaConfig::default() }, harness.events.clone());
        for (page, perm) in mapped {
            harness.map(page, perm);
        }
        harness.total = harness.hca.map_registers().0;
        harness
    }

    fn map(&mut self, page: u64, perm: Permissions) {
        let uaddr = UADDR + (page - IOVA);
        if page < IOVA + POOL_PAGES * PAGE && self.shared.iommu.update(page, PAGE, uaddr, perm).is_ok() {
            self.mapped.insert(page, perm);
        }
    }

    fn take_events(&mut self) -> Vec<HcaEvent> {
        let events = std::mem::take(&mut *self.events.0.lock().unwrap_or_else(|p| p.into_inner()));
        self.seen.extend(events.iter().cloned());
        events
    }

    fn allowed(&self, in_flight: &[u64]) -> BTreeSet<u64> {
        self.objects.values().flatten().chain(in_flight).map(|p| p & !(PAGE - 1)).collect()
    }

    fn execute(&mut self, request: &[u8]) {
        let in_flight = vhca_proto::listed_pages(request).collect::<Vec<u64>>();
        let allowed = self.allowed(&in_flight);
        let mem = self.shared.mem();
        let response = {
            let dma = Watched { inner: QueueDma::new(&self.shared, &mem, 0), allowed: &allowed, mapped: &self.mapped };
            self.hca.execute(&dma, request)
        };
        let events = self.take_events();
        let checked = vhca_hca::invariants::check_command(request, &response, &events);
        let status = checked.unwrap_or_else(|broken| panic!("command {request:02x?}: {broken}")).0;
        for event in &events {
            if let HcaEvent::Object { action, object, handle, .. } = event {
                if action.starts_with("creat") {
                    assert!(
                        self.objects.insert((object, *handle), in_flight.clone()).is_none(),
                        "{object} {handle:#x} created twice"
                    );
                } else {
                    assert!(self.objects.remove(&(object, *handle)).is_some(), "{object} {handle:#x} was not alive");
                }
            }
        }
        self.check_registers(&format!("command {request:02x?} -> {status:?}"));
    }

    fn doorbells(&mut self, records: &[u8]) {
        let allowed = self.allowed(&[]);
        let mem = self.shared.mem();
        {
            let dma = Watched { inner: QueueDma::new(&self.shared, &mem, 2), allowed: &allowed, mapped: &self.mapped };
            self.hca.doorbell(&dma, records);
        }
        let lines: Vec<(bool, bool)> = self
            .take_events()
            .iter()
            .filter_map(|e| match e {
                HcaEvent::Doorbell { ok, detail, .. } => Some((*ok, detail.as_ref().is_some_and(|d| !d.is_empty()))),
                _ => None,
            })
            .collect();
        assert_eq!(lines.len(), records.len().div_ceil(DOORBELL_SIZE), "one doorbell line per record");
        assert!(lines.iter().all(|(ok, why)| *ok || *why), "a refused doorbell without a cause: {lines:?}");
        self.check_registers("doorbells");
    }

    /// Registers in use are the pages of live objects: none leaks, none is shared.
    fn check_registers(&self, what: &str) {
        let (total, free) = self.hca.map_registers();
        assert_eq!(total, self.total, "{what}: the pool changed size");
        assert!(free <= total, "{what}: {free} free of {total}");
        let held: usize = self.objects.values().map(Vec::len).sum();
        assert_eq!((total - free) as usize, held, "{what}: registers in use differ from live objects' pages");
    }

    fn step(&mut self, op: u8, payload: &[u8]) {
        match op % OPS {
            OP_COMMAND => {
                let [opcode, tag, count, rest @ ..] = payload else { return };
                let count = usize::from(*count).min(rest.len());
                let (pages, body) = rest.split_at(count);
                let mut tail = body.to_vec();
                tail.extend(pages.iter().flat_map(|p| page_iova(*p).to_le_bytes()));
                let header = CommandHeader {
                    opcode: u32::from(*opcode).into(),
                    tag: u32::from(*tag).into(),
                    body_len: (tail.len() as u32).into(),
                    reserved: 0.into(),
                };
                let mut request = header.as_bytes().to_vec();
                request.extend(tail);
                self.execute(&request);
            }
            OP_RAW_COMMAND => self.execute(payload),
            OP_DOORBELLS => self.doorbells(payload),
            OP_GUEST_WRITE => {
                let [page, offset_lo, offset_hi, bytes @ ..] = payload else { return };
                let page = page_iova(*page);
                let offset = u64::from(u16::from_le_bytes([*offset_lo, *offset_hi])) % PAGE;
                let len = (bytes.len() as u64).min(PAGE - offset) as usize;
                if page < IOVA + POOL_PAGES * PAGE {
                    let at = GuestAddress(UADDR + (page - IOVA) + offset);
                    self.ram.write_slice(&bytes[..len], at).expect("inside the pool");
                }
            }
            OP_INVALIDATE => {
                let [page, count, ..] = payload else { return };
                let (iova, size) = (page_iova(*page), u64::from(*count % 8 + 1) * PAGE);
                self.shared.iommu.invalidate(iova, size);
                self.mapped.retain(|p, _| *p < iova || *p >= iova + size);
                self.hca.iotlb_invalidated(iova, size);
                self.take_events();
                self.check_registers("invalidate");
            }
            _ => {
                let [page, perm, ..] = payload else { return };
                let perm = match perm % 3 {
                    0 => Permissions::Read,
                    1 => Permissions::Write,
                    _ => Permissions::ReadWrite,
                };
                self.map(page_iova(*page), perm);
            }
        }
    }
}

/// One input: the first byte picks the map-register pool (small pools reach exhaustion), then records.
pub fn run(data: &[u8]) {
    trace(data);
}

/// `run`, returning every event the HCA logged (the replay test checks the seeds reach deep states).
pub fn trace(data: &[u8]) -> Vec<HcaEvent> {
    let mut seen = Vec::new();
    let Some((&pool, mut rest)) = data.split_first() else { return seen };
    let mut harness = Harness::new(u32::from(pool % 64) + 1);
    let mut steps = 0;
    while let [op, len, tail @ ..] = rest {
        let len = usize::from(*len).min(tail.len());
        harness.step(*op, &tail[..len]);
        seen.append(&mut harness.seen);
        rest = &tail[len..];
        steps += 1;
        if steps == 64 {
            break;
        }
    }
    seen
}
