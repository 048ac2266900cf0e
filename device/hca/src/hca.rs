//! Command dispatch. The walking skeleton answers QUERY_DEVICE; everything else is refused with UNKNOWN_OPCODE.

use std::sync::Arc;

use vhca_proto::{
    CommandHeader, DeviceConfig, Opcode, QueryDeviceResp, ResponseHeader, Status, ABI_VERSION, COMMAND_HEADER_SIZE,
    CONFIG_MAGIC, NUM_QUEUES, PAGE_SIZE,
};
use zerocopy::{FromBytes, IntoBytes};

use crate::{Dma, EventSink, HcaEvent};

#[derive(Debug, Clone)]
pub struct HcaConfig {
    pub map_registers: u32,
}

impl Default for HcaConfig {
    fn default() -> Self {
        HcaConfig { map_registers: 4096 }
    }
}

pub struct Hca {
    config: HcaConfig,
    events: Arc<dyn EventSink>,
}

impl Hca {
    pub fn new(config: HcaConfig, events: Arc<dyn EventSink>) -> Hca {
        Hca { config, events }
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
    pub fn execute(&mut self, _dma: &dyn Dma, request: &[u8]) -> Vec<u8> {
        let Ok((header, _body)) = CommandHeader::read_from_prefix(request) else {
            return self.respond(0, 0, Status::BadLength, &[]);
        };
        let (opcode_raw, tag) = (header.opcode.get(), header.tag.get());
        debug_assert!(request.len() >= COMMAND_HEADER_SIZE);
        match Opcode::from_u32(opcode_raw) {
            Some(Opcode::QueryDevice) => {
                let resp = QueryDeviceResp {
                    abi_version: u32::from(ABI_VERSION).into(),
                    vendor_id: 0x1af4.into(),
                    map_registers_total: self.config.map_registers.into(),
                    map_registers_free: self.config.map_registers.into(),
                    page_size: (PAGE_SIZE as u32).into(),
                    ..Default::default()
                };
                self.respond(opcode_raw, tag, Status::Ok, resp.as_bytes())
            }
            _ => self.respond(opcode_raw, tag, Status::UnknownOpcode, &[]),
        }
    }

    /// Handles the device-readable bytes of one doorbell-queue chain (queue 2): zero or more `Doorbell` records.
    /// Work it triggers runs now, by DMA through `dma`.
    pub fn doorbell(&mut self, _dma: &dyn Dma, _records: &[u8]) {}

    /// The next asynchronous event for the event queue (queue 1), if any. The transport writes it into the next
    /// buffer the driver posted there; while none is posted, events wait here.
    pub fn pop_async_event(&mut self) -> Option<vhca_proto::Event> {
        None
    }

    /// QEMU invalidated IOTLB entries covering [iova, iova + size): translations the HCA cached for that range are
    /// stale from now on.
    pub fn iotlb_invalidated(&mut self, _iova: u64, _size: u64) {}

    fn respond(&self, opcode: u32, tag: u32, status: Status, body: &[u8]) -> Vec<u8> {
        let name = Opcode::from_u32(opcode).map_or_else(|| format!("0x{opcode:x}"), |o| o.name().to_string());
        self.events.emit(HcaEvent::Command { opcode: name, tag, status: status.name().to_string() });
        let header = ResponseHeader {
            status: (status as u32).into(),
            opcode: opcode.into(),
            tag: tag.into(),
            body_len: (body.len() as u32).into(),
        };
        let mut out = header.as_bytes().to_vec();
        out.extend_from_slice(body);
        out
    }
}
