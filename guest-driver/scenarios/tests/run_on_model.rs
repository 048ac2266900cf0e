//! `vhca_scenarios::run` over the NT model and the in-process device model, with a host the test controls: what
//! the run does after a success and after a failure, and the error path a host may ask for.

#[path = "../../ntmodel/tests/common/mod.rs"]
mod common;

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{machine, HcaChannel, PDO};
use serde_json::Value;
use vhca_ntapi::PVOID;
use vhca_ntmodel::NtModel;
use vhca_scenarios::{run, Scenario, ScenarioHost, ScenarioOptions};

struct TestHost {
    kernel: Arc<NtModel>,
    origin: Instant,
    details: RefCell<BTreeMap<String, Value>>,
    /// User buffers cannot be had: the user-buffer scenarios stop after their first allocations.
    no_user_memory: bool,
    error_path: bool,
    closed: Cell<u32>,
}

impl ScenarioHost for TestHost {
    type Kernel = NtModel;
    type Channel = HcaChannel;
    fn say(&self, _: std::fmt::Arguments<'_>) {}
    fn detail(&self, key: &str, value: Value) {
        self.details.borrow_mut().insert(key.into(), value);
    }
    fn lock_chosen(&self, name: &'static str) {
        self.detail("lock", name.into());
    }
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }
    fn sleep(&self, duration: Duration) {
        std::thread::sleep(duration)
    }
    fn alloc_user_buffer(&self, len: u32, in_page_offset: u64) -> PVOID {
        if self.no_user_memory {
            return PVOID::NULL;
        }
        self.kernel.alloc_user_buffer(len as u64, in_page_offset)
    }
    fn free_user_buffer(&self, va: PVOID) {
        self.kernel.free_user_buffer(va)
    }
    fn report_platform_iommu_faults(&self, _: Duration) -> Option<usize> {
        None
    }
    fn dma_checking(&self) -> Option<bool> {
        Some(false)
    }
    fn error_path(&self, _: &anyhow::Error) -> bool {
        self.error_path
    }
    fn driver_closed(&self) -> anyhow::Result<()> {
        self.closed.set(self.closed.get() + 1);
        Ok(())
    }
}

fn host(no_user_memory: bool, error_path: bool) -> (TestHost, HcaChannel) {
    let (kernel, backend) = machine(0);
    let host = TestHost {
        kernel,
        origin: Instant::now(),
        details: RefCell::new(BTreeMap::new()),
        no_user_memory,
        error_path,
        closed: Cell::new(0),
    };
    (host, HcaChannel::new(backend))
}

fn run_with(scenario: Scenario, host: &TestHost, channel: HcaChannel) -> anyhow::Result<()> {
    run(scenario, host, host.kernel.clone(), channel, PDO, &ScenarioOptions::default(), Duration::from_secs(5))
}

#[test]
fn a_success_closes_the_driver_and_a_failure_leaves_it_open() {
    let (ok, channel) = host(false, false);
    run_with(Scenario::UserBufferProbeLock, &ok, channel).unwrap();
    assert_eq!(ok.closed.get(), 1);
    assert_eq!(ok.details.borrow()["data"]["matches"], true);

    let (failing, channel) = host(true, false);
    let error = run_with(Scenario::UserBufferProbeLock, &failing, channel).unwrap_err();
    assert!(error.to_string().contains("user buffer"), "{error}");
    assert_eq!(failing.closed.get(), 0, "the driver stays open after a failure");
}

#[test]
fn the_error_path_closes_and_unloads_as_after_a_success() {
    let (host, channel) = host(true, true);
    run_with(Scenario::UserBufferProbeLock, &host, channel).expect("the host took the error path");
    assert_eq!(host.closed.get(), 1, "closed and unloaded as after a success");
    let details = host.details.borrow();
    assert!(details["error_path"].as_str().unwrap().contains("user buffer"), "{details:?}");
}
