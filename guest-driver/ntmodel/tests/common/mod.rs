//! Test fixtures: a modelled machine, a fake HCA that answers commands and DMAs through the host backend, and a
//! channel over the real device model (vhca-hca) in process.
#![allow(dead_code)]

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use vhca_driver_core::{CommandTransport, CommandTransportError};
use vhca_ntapi::{PAGE_SIZE, PDEVICE_OBJECT};
use vhca_ntmodel::{HostDmaBackend, NtModel, NtModelConfig, VerifierFlags};
use vhca_proto::*;
use zerocopy::{FromBytes, IntoBytes};

pub const PDO: PDEVICE_OBJECT = PDEVICE_OBJECT(0xFFFF_C000_0000_1000);

/// IoConnectInterruptEx's message-based parameters for `isr` on the PDO, as a driver fills them (no spin lock of
/// its own, no fallback routine).
pub fn message_parameters(
    isr: vhca_ntapi::PKMESSAGE_SERVICE_ROUTINE,
) -> vhca_ntapi::IO_CONNECT_INTERRUPT_MESSAGE_BASED_PARAMETERS {
    vhca_ntapi::IO_CONNECT_INTERRUPT_MESSAGE_BASED_PARAMETERS {
        PhysicalDeviceObject: PDO,
        MessageServiceRoutine: isr,
        SpinLock: vhca_ntapi::PKSPIN_LOCK::NULL,
        SynchronizeIrql: vhca_ntapi::PASSIVE_LEVEL,
        FloatingSave: false,
        FallBackServiceRoutine: None,
    }
}

/// The interrupt path over `dev` as the native driver core connects it (one message, the PDO for the interrupt and
/// the work item), behind the object-safe face the scenarios hold.
pub fn connected_waits(k: &Arc<NtModel>, dev: &FakeDevice) -> Box<dyn vhca_driver_core::CqCompletions> {
    use vhca_driver_core::{CompletionWaits, PathDevices, DEFAULT_CQE_BUDGET};
    k.assign_interrupts(PDO, vhca_ntmodel::InterruptResources::Messages(1));
    let waits = CompletionWaits::connect(
        k.clone(),
        Arc::new(dev.clone()),
        PathDevices::pdo_only(PDO),
        DEFAULT_CQE_BUDGET,
        None,
    );
    Box::new(waits.expect("connect"))
}

pub fn machine(flags: u32) -> (Arc<NtModel>, Arc<HostDmaBackend>) {
    NtModel::for_tests(NtModelConfig { verifier: VerifierFlags(flags), ..NtModelConfig::default() })
}

pub fn machine_with(config: NtModelConfig) -> (Arc<NtModel>, Arc<HostDmaBackend>) {
    NtModel::for_tests(config)
}

#[derive(Debug, Clone)]
pub struct Registered {
    pub pages: Vec<u64>,
    pub first_page_offset: u32,
    pub length: u64,
    pub entries: u32,
}

#[derive(Default)]
struct FakeState {
    next_handle: u32,
    cqs: HashMap<u32, Registered>,
    mrs: HashMap<u32, Registered>,
    doorbells: Vec<Doorbell>,
    events: VecDeque<Event>,
    commands: Vec<Opcode>,
}

/// A device that accepts every command, remembers page lists, and writes CQEs or MR bytes on request through
/// the backend's IOTLB, reporting a refused DMA to the model as the platform would (an IOMMU fault).
#[derive(Clone)]
pub struct FakeDevice {
    state: Arc<Mutex<FakeState>>,
    backend: Arc<HostDmaBackend>,
    model: Arc<NtModel>,
}

impl FakeDevice {
    pub fn new(model: Arc<NtModel>, backend: Arc<HostDmaBackend>) -> FakeDevice {
        FakeDevice { state: Arc::new(Mutex::new(FakeState { next_handle: 1, ..Default::default() })), backend, model }
    }

    pub fn cq(&self, handle: u32) -> Registered {
        self.state.lock().unwrap().cqs[&handle].clone()
    }

    pub fn mr(&self, lkey: u32) -> Registered {
        self.state.lock().unwrap().mrs[&lkey].clone()
    }

    pub fn commands(&self) -> Vec<Opcode> {
        self.state.lock().unwrap().commands.clone()
    }

    pub fn doorbells(&self) -> Vec<Doorbell> {
        self.state.lock().unwrap().doorbells.clone()
    }

    /// Queues an asynchronous event, as the device writes one on its event queue.
    pub fn push_event(&self, kind: EventKind, handle: u32) {
        let event = Event { kind: (kind as u32).into(), handle: handle.into(), ..Default::default() };
        self.state.lock().unwrap().events.push_back(event);
    }

    /// DMA to a registered page list at byte `offset` of the registration; a refusal becomes an IOMMU fault.
    fn dma_write(&self, reg: &Registered, offset: u64, data: &[u8]) -> bool {
        let at = reg.first_page_offset as u64 + offset;
        let page = (at / PAGE_SIZE) as usize;
        let iova = reg.pages[page] + at % PAGE_SIZE;
        match self.backend.device_write(iova, data) {
            Ok(()) => true,
            Err(_) => {
                self.model.report_iommu_fault(PDO, iova, FaultCause::IommuUnmapped as u64);
                false
            }
        }
    }

    pub fn write_cqe(&self, cq: u32, index: u32, wr_id: u64) -> bool {
        let reg = self.cq(cq);
        let cqe = Cqe {
            wr_id: wr_id.into(),
            status: (vhca_proto::status::WcStatus::Success as u32).into(),
            opcode: (WrOpcode::Recv as u32).into(),
            qpn: 1.into(),
            byte_len: 0.into(),
            vendor_err: 0.into(),
            owner: cqe_owner(index, reg.entries).into(),
        };
        self.dma_write(&reg, (index % reg.entries) as u64 * CQE_SIZE as u64, cqe.as_bytes())
    }

    pub fn write_mr(&self, lkey: u32, offset: u64, data: &[u8]) -> bool {
        let reg = self.mr(lkey);
        self.dma_write(&reg, offset, data)
    }
}

impl CommandTransport for FakeDevice {
    fn execute(&self, request: &[u8], _response_capacity: usize) -> Result<Vec<u8>, CommandTransportError> {
        let (header, body) = CommandHeader::read_from_prefix(request).map_err(|_| CommandTransportError::Refused(1))?;
        let opcode = Opcode::from_u32(header.opcode.get()).ok_or(CommandTransportError::Refused(2))?;
        let mut s = self.state.lock().unwrap();
        s.commands.push(opcode);
        let handle = s.next_handle;
        s.next_handle += 1;
        let fixed = opcode.request_size();
        let pages: Vec<u64> =
            body[fixed..].chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap())).collect();
        let resp: Vec<u8> = match opcode {
            Opcode::QueryDevice => {
                QueryDeviceResp { map_registers_total: 64.into(), ..Default::default() }.as_bytes().to_vec()
            }
            Opcode::CreateCq => {
                let (req, _) = CreateCqReq::read_from_prefix(body).unwrap();
                let reg = Registered { pages, first_page_offset: 0, length: 0, entries: req.entries.get() };
                s.cqs.insert(handle, reg);
                HandleResp { handle: handle.into(), reserved: 0.into() }.as_bytes().to_vec()
            }
            Opcode::RegMr => {
                let (req, _) = RegMrReq::read_from_prefix(body).unwrap();
                let reg = Registered {
                    pages,
                    first_page_offset: req.first_page_offset.get(),
                    length: req.length.get(),
                    entries: 0,
                };
                s.mrs.insert(handle, reg);
                RegMrResp { lkey: handle.into(), rkey: handle.into() }.as_bytes().to_vec()
            }
            Opcode::AllocPd | Opcode::CreateQp => {
                HandleResp { handle: handle.into(), reserved: 0.into() }.as_bytes().to_vec()
            }
            _ => Vec::new(),
        };
        let rh = ResponseHeader {
            status: 0.into(),
            opcode: header.opcode,
            tag: header.tag,
            body_len: (resp.len() as u32).into(),
        };
        let mut out = rh.as_bytes().to_vec();
        out.extend(resp);
        Ok(out)
    }

    fn ring_doorbell(&self, records: &[u8]) -> Result<(), CommandTransportError> {
        let mut s = self.state.lock().unwrap();
        for r in records.chunks_exact(DOORBELL_SIZE) {
            s.doorbells.push(Doorbell::read_from_bytes(r).unwrap());
        }
        Ok(())
    }

    fn poll_event(&self) -> Option<Event> {
        self.state.lock().unwrap().events.pop_front()
    }
}

/// The real device model's view of memory: the backend's IOTLB.
pub struct BackendDma(pub Arc<HostDmaBackend>);

impl vhca_hca::Dma for BackendDma {
    fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), vhca_hca::DmaError> {
        self.0.device_read(iova, buf).map_err(|_| vhca_hca::DmaError { iova, cause: FaultCause::IommuUnmapped })
    }
    fn write(&self, iova: u64, buf: &[u8]) -> Result<(), vhca_hca::DmaError> {
        self.0.device_write(iova, buf).map_err(|_| vhca_hca::DmaError { iova, cause: FaultCause::IommuUnmapped })
    }
}

struct NoEvents;
impl vhca_hca::EventSink for NoEvents {
    fn emit(&self, _event: vhca_hca::HcaEvent) {}
}

/// The driver core's channel straight into vhca-hca, in process.
pub struct HcaChannel {
    hca: Mutex<vhca_hca::Hca>,
    dma: BackendDma,
}

impl HcaChannel {
    pub fn new(backend: Arc<HostDmaBackend>) -> HcaChannel {
        let hca = vhca_hca::Hca::new(vhca_hca::HcaConfig::default(), Arc::new(NoEvents));
        HcaChannel { hca: Mutex::new(hca), dma: BackendDma(backend) }
    }
}

impl CommandTransport for HcaChannel {
    fn execute(&self, request: &[u8], _response_capacity: usize) -> Result<Vec<u8>, CommandTransportError> {
        Ok(self.hca.lock().unwrap().execute(&self.dma, request))
    }
    fn ring_doorbell(&self, records: &[u8]) -> Result<(), CommandTransportError> {
        self.hca.lock().unwrap().doorbell(&self.dma, records);
        Ok(())
    }
    fn poll_event(&self) -> Option<Event> {
        self.hca.lock().unwrap().pop_async_event()
    }
}

/// What an execution routine received, and the IRQL Windows (here the model) called it at.
pub type Received<T> = Arc<Mutex<Option<(T, vhca_ntapi::KIRQL)>>>;

/// An AdapterListControl that keeps the list it is given.
pub fn list_routine(k: &Arc<NtModel>) -> (Received<vhca_ntapi::SCATTER_GATHER_LIST>, vhca_ntapi::PDRIVER_LIST_CONTROL) {
    use vhca_ntapi::NtKernel;
    let slot: Received<vhca_ntapi::SCATTER_GATHER_LIST> = Arc::default();
    let (s, k) = (slot.clone(), k.clone());
    (slot, Box::new(move |_, list| *s.lock().unwrap() = Some((list.clone(), k.KeGetCurrentIrql()))))
}

/// An AdapterControl that keeps the map-register base and answers `action`.
pub fn channel_routine(
    k: &Arc<NtModel>,
    action: vhca_ntapi::IO_ALLOCATION_ACTION,
) -> (Received<vhca_ntapi::MAP_REGISTER_BASE>, vhca_ntapi::PDRIVER_CONTROL) {
    use vhca_ntapi::NtKernel;
    let slot: Received<vhca_ntapi::MAP_REGISTER_BASE> = Arc::default();
    let (s, k) = (slot.clone(), k.clone());
    (
        slot,
        Box::new(move |_, base| {
            *s.lock().unwrap() = Some((base, k.KeGetCurrentIrql()));
            action
        }),
    )
}

/// GetScatterGatherList at the caller's IRQL: the list if AdapterListControl ran before the call returned,
/// STATUS_PENDING if the model queued it, the call's status if it failed.
pub fn get_sg(
    k: &Arc<NtModel>,
    a: vhca_ntapi::PDMA_ADAPTER,
    mdl: vhca_ntapi::PMDL,
    va: vhca_ntapi::PVOID,
    length: u32,
    write_to_device: bool,
) -> Result<vhca_ntapi::SCATTER_GATHER_LIST, vhca_ntapi::NTSTATUS> {
    use vhca_ntapi::NtKernel;
    let (slot, routine) = list_routine(k);
    let status = k.GetScatterGatherList(a, PDO, mdl, va, length, routine, write_to_device);
    if !status.is_success() {
        return Err(status);
    }
    let got = slot.lock().unwrap().take();
    got.map(|(list, _)| list).ok_or(vhca_ntapi::STATUS_PENDING)
}

/// AllocateAdapterChannel at the caller's IRQL, AdapterControl answering `action`: the base if the routine ran
/// before the call returned, STATUS_PENDING if queued, the call's status if it failed.
pub fn alloc_channel(
    k: &Arc<NtModel>,
    a: vhca_ntapi::PDMA_ADAPTER,
    n: u32,
    action: vhca_ntapi::IO_ALLOCATION_ACTION,
) -> Result<vhca_ntapi::MAP_REGISTER_BASE, vhca_ntapi::NTSTATUS> {
    use vhca_ntapi::NtKernel;
    let (slot, routine) = channel_routine(k, action);
    let status = k.AllocateAdapterChannel(a, PDO, n, routine);
    if !status.is_success() {
        return Err(status);
    }
    let got = slot.lock().unwrap().take();
    got.map(|(base, _)| base).ok_or(vhca_ntapi::STATUS_PENDING)
}
