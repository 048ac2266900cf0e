//! The verbs the device-control dispatcher may call on a user's behalf, as a trait the driver's `Hca` implements,
//! so the dispatcher's checks are tested without a device and no IOCTL reaches a verb the trait does not name.

use alloc::vec::Vec;

use vhca_ntapi::{NtKernel, PVOID};
use vhca_proto::{Cqe, QueryDeviceResp, Wqe};

use crate::command_transport::CommandTransport;
use crate::error::DriverError;
use crate::hca::{Hca, MrMapping, MrSource, RegisteredMr};

pub trait UserVerbs {
    fn query_device(&self) -> QueryDeviceResp;
    fn alloc_pd(&mut self) -> Result<u32, DriverError>;
    fn dealloc_pd(&mut self, pd: u32) -> Result<(), DriverError>;
    fn create_cq(&mut self, entries: u32) -> Result<u32, DriverError>;
    fn destroy_cq(&mut self, cq: u32) -> Result<(), DriverError>;
    fn req_notify_cq(&mut self, cq: u32, solicited_only: bool) -> Result<(), DriverError>;
    fn poll_cq(&mut self, cq: u32, max: usize) -> Result<Vec<Cqe>, DriverError>;
    fn create_qp(&mut self, pd: u32, send_cq: u32, recv_cq: u32, sq: u32, rq: u32) -> Result<u32, DriverError>;
    fn connect_qp(&mut self, qpn: u32, dest_qpn: u32, access: u32) -> Result<(), DriverError>;
    fn destroy_qp(&mut self, qpn: u32) -> Result<(), DriverError>;
    /// A buffer in the calling process, probed and locked (UserMode) in its context for the MR's life.
    fn reg_user_mr(&mut self, pd: u32, addr: u64, length: u32, access: u32) -> Result<RegisteredMr, DriverError>;
    fn dereg_mr(&mut self, lkey: u32) -> Result<(), DriverError>;
    fn post_send(&mut self, qpn: u32, wqe: &Wqe) -> Result<(), DriverError>;
    fn post_recv(&mut self, qpn: u32, wqe: &Wqe) -> Result<(), DriverError>;
}

impl<K: NtKernel + 'static, C: CommandTransport> UserVerbs for Hca<K, C> {
    fn query_device(&self) -> QueryDeviceResp {
        *self.attributes()
    }
    fn alloc_pd(&mut self) -> Result<u32, DriverError> {
        Hca::alloc_pd(self)
    }
    fn dealloc_pd(&mut self, pd: u32) -> Result<(), DriverError> {
        Hca::dealloc_pd(self, pd)
    }
    fn create_cq(&mut self, entries: u32) -> Result<u32, DriverError> {
        Hca::create_cq(self, entries)
    }
    fn destroy_cq(&mut self, cq: u32) -> Result<(), DriverError> {
        Hca::destroy_cq(self, cq)
    }
    fn req_notify_cq(&mut self, cq: u32, solicited_only: bool) -> Result<(), DriverError> {
        Hca::req_notify_cq(self, cq, solicited_only)
    }
    fn poll_cq(&mut self, cq: u32, max: usize) -> Result<Vec<Cqe>, DriverError> {
        Hca::poll_cq(self, cq, max)
    }
    fn create_qp(&mut self, pd: u32, send_cq: u32, recv_cq: u32, sq: u32, rq: u32) -> Result<u32, DriverError> {
        Hca::create_qp(self, pd, send_cq, recv_cq, sq, rq)
    }
    fn connect_qp(&mut self, qpn: u32, dest_qpn: u32, access: u32) -> Result<(), DriverError> {
        Hca::connect_qp(self, qpn, dest_qpn, access)
    }
    fn destroy_qp(&mut self, qpn: u32) -> Result<(), DriverError> {
        Hca::destroy_qp(self, qpn)
    }
    fn reg_user_mr(&mut self, pd: u32, addr: u64, length: u32, access: u32) -> Result<RegisteredMr, DriverError> {
        // Scatter/gather held for the MR's life, as the seed's user registration maps it.
        let source = MrSource::User { va: PVOID(addr), length, skip_lock: false };
        Hca::reg_mr(self, pd, source, access, MrMapping::ScatterGather)
    }
    fn dereg_mr(&mut self, lkey: u32) -> Result<(), DriverError> {
        Hca::dereg_mr(self, lkey)
    }
    fn post_send(&mut self, qpn: u32, wqe: &Wqe) -> Result<(), DriverError> {
        Hca::post_send(self, qpn, wqe)
    }
    fn post_recv(&mut self, qpn: u32, wqe: &Wqe) -> Result<(), DriverError> {
        Hca::post_recv(self, qpn, wqe)
    }
}
