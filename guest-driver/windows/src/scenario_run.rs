//! The scenarios vhca.sys runs, written once against the driver core and the NT interface, so the same code runs
//! over the WDK shim in Windows and over the NT model in this repository's tests. Each returns its result line.

use alloc::format;
use alloc::sync::Arc;

use vhca_driver::{ClMutex, ClMutexKind, CommandChannel, Hca, HcaConfig};
use vhca_ntapi::{NtKernel, PDEVICE_OBJECT};

use crate::result_line::RunResult;
use crate::scenario_choice::WindowsScenario;

/// CQ entries the lock scenarios create: a 16 KiB ring (four pages) with the default CQE size, big enough that a
/// fragmented machine may have to fall back to pieces.
const CQ_ENTRIES: u32 = 256;

/// Opens the HCA on `pdo`, runs `scenario`, closes the HCA. PASSIVE_LEVEL, no lock held.
pub fn run<K: NtKernel + 'static, C: CommandChannel>(
    scenario: WindowsScenario,
    kernel: Arc<K>,
    channel: C,
    pdo: PDEVICE_OBJECT,
) -> RunResult {
    let mut result = RunResult::new(scenario.name());
    let mut hca = match Hca::open(kernel.clone(), channel, pdo, HcaConfig::default()) {
        Ok(hca) => hca,
        Err(e) => {
            result.fail(format!("Hca::open: {e}"));
            return result;
        }
    };
    result.detail("adapter_map_registers", hca.map_registers());
    result.detail("device_max_qp", hca.attributes().max_qp.get());
    let outcome = match scenario {
        WindowsScenario::Smoke => smoke(&mut hca),
        WindowsScenario::FastMutexCreateCq => create_cq_under(&mut hca, &kernel, ClMutexKind::FastMutex, &mut result),
        WindowsScenario::FixedLockCreateCq => create_cq_under(&mut hca, &kernel, ClMutexKind::KMutex, &mut result),
    };
    if let Err(e) = outcome {
        result.fail(e);
    }
    hca.close();
    result
}

type Driver<K, C> = Hca<K, C>;

fn smoke<K: NtKernel + 'static, C: CommandChannel>(hca: &mut Driver<K, C>) -> Result<(), alloc::string::String> {
    let pd = hca.alloc_pd().map_err(|e| format!("alloc_pd: {e}"))?;
    hca.dealloc_pd(pd).map_err(|e| format!("dealloc_pd: {e}"))
}

/// The seed's control path: the driver's cl_mutex held around create_cq, as IPoIB's PnP callback held it.
fn create_cq_under<K: NtKernel + 'static, C: CommandChannel>(
    hca: &mut Driver<K, C>,
    kernel: &Arc<K>,
    kind: ClMutexKind,
    result: &mut RunResult,
) -> Result<(), alloc::string::String> {
    let lock = ClMutex::new(kernel.clone(), kind);
    result.detail("lock", format!("{kind:?}"));
    lock.acquire();
    result.detail("irql_under_lock", kernel.KeGetCurrentIrql());
    let created = hca.alloc_pd().and_then(|pd| hca.create_cq(CQ_ENTRIES).map(|cq| (pd, cq)));
    lock.release();
    let (pd, cq) = created.map_err(|e| format!("create under {kind:?}: {e}"))?;
    if let Some(pieces) = hca.cq_ring_pieces(cq) {
        result.detail("cq_pieces", serde_json::Value::from(pieces));
    }
    lock.acquire();
    let destroyed = hca.destroy_cq(cq).and_then(|()| hca.dealloc_pd(pd));
    lock.release();
    destroyed.map_err(|e| format!("destroy under {kind:?}: {e}"))
}
