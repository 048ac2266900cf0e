//! The driver core against the real device model (vhca-hca) in process, through the host backend's IOTLB:
//! commands, rings and work requests end to end, as far as the device model answers them.

mod common;

use common::*;
use vhca_driver_core::*;
use vhca_ntapi::*;
use vhca_ntmodel::NtModel;
use vhca_proto::status::WcStatus;
use vhca_proto::{Sge, Wqe, WrOpcode, ABI_VERSION, ACCESS_ALL, WR_SIGNALED};

#[test]
fn open_queries_the_device_model() {
    let (k, b) = machine(0x209BB);
    let hca = Hca::open(k.clone(), HcaChannel::new(b), PDO, HcaConfig::default()).unwrap();
    assert_eq!(hca.attributes().abi_version.get(), ABI_VERSION as u32);
    assert_eq!(hca.attributes().page_size.get(), 4096);
    NtModel::run_guarded(|| hca.close()).unwrap();
}

#[test]
fn loopback_send_lands_in_the_receive_buffer_with_completions() {
    let (k, b) = machine(0x209BB);
    let mut hca = Hca::open(k.clone(), HcaChannel::new(b), PDO, HcaConfig::default()).unwrap();
    let run = NtModel::run_guarded(|| -> Result<(), DriverError> {
        let pd = hca.alloc_pd()?;
        let cq = hca.create_cq(64)?;
        let a = hca.create_qp(pd, cq, cq, 16, 16)?;
        let bq = hca.create_qp(pd, cq, cq, 16, 16)?;
        hca.connect_qp(a, bq, ACCESS_ALL)?;
        hca.connect_qp(bq, a, ACCESS_ALL)?;
        let mut la = PHYSICAL_ADDRESS(0);
        let va = k.AllocateCommonBuffer(hca.adapter(), 8192, &mut la, true);
        k.RtlCopyToVa(va, b"hello over vhca");
        let mr =
            hca.reg_mr(pd, MrSource::Common { va, logical: la, length: 8192 }, ACCESS_ALL, MrMapping::ScatterGather)?;
        let sge = |off: u64, len: u32| Sge { addr: (mr.addr + off).into(), length: len.into(), lkey: mr.lkey.into() };
        let mut recv =
            Wqe { wr_id: 2.into(), opcode: (WrOpcode::Recv as u32).into(), num_sge: 1.into(), ..Default::default() };
        recv.sge[0] = sge(4096, 64);
        hca.post_recv(bq, &recv)?;
        let mut send =
            Wqe { wr_id: 1.into(), opcode: (WrOpcode::Send as u32).into(), num_sge: 1.into(), ..Default::default() };
        send.flags = WR_SIGNALED.into();
        send.sge[0] = sge(0, 15);
        hca.post_send(a, &send)?;
        let mut cqes = Vec::new();
        for _ in 0..100 {
            cqes.extend(hca.poll_cq(cq, 16)?);
            if cqes.len() >= 2 {
                break;
            }
        }
        assert_eq!(cqes.len(), 2, "a send and a receive completion: {cqes:?}");
        assert!(cqes.iter().all(|c| c.status.get() == WcStatus::Success as u32), "{cqes:?}");
        let mut got = [0u8; 15];
        k.RtlCopyFromVa(&mut got, va.offset(4096).unwrap());
        assert_eq!(&got, b"hello over vhca");
        Ok(())
    });
    run.expect("no bugcheck").expect("verbs succeed on the device model");
}
