//! The PnP manager's sequences on a started stack beyond the straight line, as Windows sends them: a rebalance
//! (QUERY_STOP, then STOP and START with resources again, or CANCEL_STOP when the stack refused), a query-remove
//! cancelled, and disable/enable (QUERY_REMOVE, REMOVE, then a new AddDevice and START), with the rules Microsoft's
//! pages give a function driver for each checked (docs/verifier.md "PnP sequences").

use std::sync::Mutex;

use windows_sys::Win32::Foundation::{NTSTATUS, STATUS_UNSUCCESSFUL};

/// Which sequence a life runs between START_DEVICE and its last REMOVE_DEVICE (`vhca.pnp=`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PnpSequence {
    /// DriverEntry, AddDevice, START, REMOVE: nothing in between.
    #[default]
    Straight,
    /// `rebalance[:N]`: N times QUERY_STOP → STOP → START (CANCEL_STOP instead when QUERY_STOP is refused).
    Rebalance(u32),
    /// `query-stop-cancel`: QUERY_STOP → CANCEL_STOP, as when another stack refused the rebalance.
    QueryStopCancel,
    /// `query-remove-cancel`: QUERY_REMOVE → CANCEL_REMOVE, as when a handle kept the device from being disabled.
    QueryRemoveCancel,
    /// `disable-enable[:N]`: N times QUERY_REMOVE → REMOVE, then AddDevice and START again (`pnputil
    /// /disable-device` then `/enable-device`).
    DisableEnable(u32),
    /// `surprise-removal`: SURPRISE_REMOVAL, then REMOVE, with no query first: what Windows sends once the bus
    /// driver reports the device missing. The device itself stays present here (no hot-unplug behind it).
    SurpriseRemoval,
    /// `hot-unplug`: the same two IRPs after a real hot-unplug: the PnP manager waits for the bus driver's word that
    /// the device left (the planned `RemovalNotice`), then sends SURPRISE_REMOVAL and REMOVE.
    HotUnplug,
    /// `rebalance-during-traffic`: one rebalance while a user process has QPs live and a write in flight, sent from
    /// the process's own program (`pnp_life::rebalance_now`); the sequence's outcome is that rebalance's.
    RebalanceDuringTraffic,
    /// `hot-unplug-during-traffic`: a real hot-unplug while a user process has a write in flight: its program waits
    /// for the removal notice and has SURPRISE_REMOVAL sent (`pnp_life::surprise_removal_now`); REMOVE follows
    /// once the process exited, as Windows sends it once every handle is closed.
    HotUnplugDuringTraffic,
}

impl PnpSequence {
    /// The `vhca.pnp=` value: `rebalance`, `rebalance:N`, `query-stop-cancel`, `query-remove-cancel`,
    /// `disable-enable`, `disable-enable:N` (N > 0) or `straight`.
    pub fn parse(value: &str) -> Result<PnpSequence, String> {
        let (name, count) = match value.split_once(':') {
            Some((name, n)) => {
                (name, Some(n.parse().ok().filter(|n| *n > 0).ok_or(format!("not a count > 0: {n:?}"))?))
            }
            None => (value, None),
        };
        match (name, count) {
            ("straight", None) => Ok(PnpSequence::Straight),
            ("rebalance", n) => Ok(PnpSequence::Rebalance(n.unwrap_or(1))),
            ("disable-enable", n) => Ok(PnpSequence::DisableEnable(n.unwrap_or(1))),
            ("query-stop-cancel", None) => Ok(PnpSequence::QueryStopCancel),
            ("query-remove-cancel", None) => Ok(PnpSequence::QueryRemoveCancel),
            ("surprise-removal", None) => Ok(PnpSequence::SurpriseRemoval),
            ("hot-unplug", None) => Ok(PnpSequence::HotUnplug),
            ("rebalance-during-traffic", None) => Ok(PnpSequence::RebalanceDuringTraffic),
            ("hot-unplug-during-traffic", None) => Ok(PnpSequence::HotUnplugDuringTraffic),
            _ => Err(format!(
                "not straight, rebalance[:N], query-stop-cancel, query-remove-cancel, disable-enable[:N], \
                 surprise-removal, hot-unplug, rebalance-during-traffic or hot-unplug-during-traffic: {value:?}"
            )),
        }
    }
}

/// One thing the PnP manager does to the stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PnpStep {
    QueryStop,
    CancelStop,
    Stop,
    /// START_DEVICE with the resources assigned again.
    Start,
    QueryRemove,
    CancelRemove,
    Remove,
    SurpriseRemoval,
    /// The driver's AddDevice with the same PDO, once REMOVE deleted its FDO.
    AddDevice,
}

impl PnpStep {
    pub fn name(self) -> &'static str {
        match self {
            PnpStep::QueryStop => "IRP_MN_QUERY_STOP_DEVICE",
            PnpStep::CancelStop => "IRP_MN_CANCEL_STOP_DEVICE",
            PnpStep::Stop => "IRP_MN_STOP_DEVICE",
            PnpStep::Start => "IRP_MN_START_DEVICE",
            PnpStep::QueryRemove => "IRP_MN_QUERY_REMOVE_DEVICE",
            PnpStep::CancelRemove => "IRP_MN_CANCEL_REMOVE_DEVICE",
            PnpStep::Remove => "IRP_MN_REMOVE_DEVICE",
            PnpStep::SurpriseRemoval => "IRP_MN_SURPRISE_REMOVAL",
            PnpStep::AddDevice => "AddDevice",
        }
    }
}

/// The stack the sequence runs on: each step sent at PASSIVE_LEVEL in the PnP manager's thread, its final status
/// back. `devices_left` is how many device objects the driver still has (after a REMOVE: none may be).
pub trait PnpStack {
    fn send(&mut self, step: PnpStep) -> NTSTATUS;
    fn devices_left(&self) -> usize;
    /// Whether the last step's IRP reached the bus driver (AddDevice has none: true).
    fn reached_bus(&mut self) -> bool;
}

/// What a sequence did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SequenceOutcome {
    /// Every step sent, with the status it came back with.
    pub steps: Vec<(PnpStep, NTSTATUS)>,
    /// Queries the driver refused (allowed: the PnP manager then cancels, and the device stays started).
    pub refused: u32,
    /// The first rule broken or step failed, which ends the sequence.
    pub failure: Option<String>,
    /// The driver's stack is gone (REMOVE succeeded and no AddDevice followed, or AddDevice failed): the life's own
    /// REMOVE_DEVICE is not sent.
    pub stack_gone: bool,
}

impl SequenceOutcome {
    /// The first rule broken is the one reported: what follows from it is not.
    fn fail(&mut self, why: String) {
        self.failure.get_or_insert(why);
    }

    /// One step. A function driver that succeeds a PnP IRP passes it down to the bus driver ("Passing PnP IRPs Down
    /// the Device Stack": only a driver that fails it completes it without passing it on; the bus driver, the
    /// parent, handles the cancels and START first): a success the bus never saw breaks that rule.
    fn send(&mut self, stack: &mut dyn PnpStack, step: PnpStep) -> NTSTATUS {
        let status = stack.send(step);
        self.steps.push((step, status));
        if status >= 0 && !stack.reached_bus() {
            self.fail(format!("{} succeeded without reaching the bus driver", step.name()));
            return STATUS_UNSUCCESSFUL;
        }
        status
    }

    /// A step the driver must not fail: STOP ("A driver must set Irp->IoStatus.Status to STATUS_SUCCESS",
    /// IRP_MN_STOP_DEVICE's page), CANCEL_STOP and CANCEL_REMOVE ("The driver must not fail this operation",
    /// Handling an IRP_MN_CANCEL_STOP_DEVICE / _REMOVE_DEVICE Request), REMOVE ("Drivers must succeed this IRP",
    /// IRP_MN_REMOVE_DEVICE's page).
    fn must_succeed(&mut self, stack: &mut dyn PnpStack, step: PnpStep) -> bool {
        let status = self.send(stack, step);
        if status < 0 {
            self.fail(format!("{} failed with {:#010x}: a driver must not fail it", step.name(), status as u32));
        }
        status >= 0
    }

    fn start(&mut self, stack: &mut dyn PnpStack) -> bool {
        let status = self.send(stack, PnpStep::Start);
        if status < 0 {
            self.fail(format!("IRP_MN_START_DEVICE after the stop failed with {:#010x}", status as u32));
        }
        status >= 0
    }

    /// QUERY_STOP, then STOP and START if the stack agreed, CANCEL_STOP if it refused ("If any driver in the
    /// stack fails the query-stop IRP, the PnP manager sends an IRP_MN_CANCEL_STOP_DEVICE", Stopping a Device).
    fn rebalance(&mut self, stack: &mut dyn PnpStack) -> bool {
        if self.send(stack, PnpStep::QueryStop) < 0 {
            self.refused += 1;
            return self.must_succeed(stack, PnpStep::CancelStop);
        }
        self.must_succeed(stack, PnpStep::Stop) && self.start(stack)
    }

    /// QUERY_REMOVE, then REMOVE with no device object left after it, then AddDevice and START; CANCEL_REMOVE if
    /// the stack refused the query.
    fn disable_enable(&mut self, stack: &mut dyn PnpStack) -> bool {
        if self.send(stack, PnpStep::QueryRemove) < 0 {
            self.refused += 1;
            return self.must_succeed(stack, PnpStep::CancelRemove);
        }
        if !self.must_succeed(stack, PnpStep::Remove) {
            return false;
        }
        self.stack_gone = true;
        let left = stack.devices_left();
        if left > 0 {
            self.fail(format!("{left} device object(s) left after IRP_MN_REMOVE_DEVICE"));
            return false;
        }
        let status = self.send(stack, PnpStep::AddDevice);
        if status < 0 {
            self.fail(format!("AddDevice after the disable failed with {:#010x}", status as u32));
            return false;
        }
        self.stack_gone = false;
        self.start(stack)
    }
}

/// Runs `sequence` on a started stack, stopping at the first failure.
pub fn run(sequence: PnpSequence, stack: &mut dyn PnpStack) -> SequenceOutcome {
    let mut outcome = SequenceOutcome::default();
    match sequence {
        PnpSequence::Straight => {}
        PnpSequence::Rebalance(n) => {
            for _ in 0..n {
                if !outcome.rebalance(stack) {
                    break;
                }
            }
        }
        PnpSequence::QueryStopCancel => {
            if outcome.send(stack, PnpStep::QueryStop) < 0 {
                outcome.refused += 1;
            }
            outcome.must_succeed(stack, PnpStep::CancelStop);
        }
        PnpSequence::QueryRemoveCancel => {
            if outcome.send(stack, PnpStep::QueryRemove) < 0 {
                outcome.refused += 1;
            }
            outcome.must_succeed(stack, PnpStep::CancelRemove);
        }
        PnpSequence::DisableEnable(n) => {
            for _ in 0..n {
                if !outcome.disable_enable(stack) {
                    break;
                }
            }
        }
        PnpSequence::SurpriseRemoval => outcome.surprise_removal(stack),
        // Windows sends the surprise removal only once the bus driver reported the device missing; a notice that
        // never comes is the platform's failure, and the device is then not removed: no IRP is sent.
        PnpSequence::HotUnplug => match crate::lock(&NOTICE).take() {
            Some(notice) => match notice() {
                Ok(()) => outcome.surprise_removal(stack),
                Err(why) => outcome.fail(format!("the device was not hot-unplugged: {why}")),
            },
            None => outcome.fail("no bus driver here reports a hot-unplug".into()),
        },
        PnpSequence::RebalanceDuringTraffic => match crate::lock(&IN_TRAFFIC).take() {
            Some(done) => outcome = done,
            None => outcome.fail("the user program sent no rebalance".into()),
        },
        PnpSequence::HotUnplugDuringTraffic => match crate::lock(&IN_TRAFFIC).take() {
            Some(done) => {
                outcome = done;
                if outcome.failure.is_none() && outcome.must_succeed(stack, PnpStep::Remove) {
                    outcome.stack_gone = true;
                    let left = stack.devices_left();
                    if left > 0 {
                        outcome.fail(format!("{left} device object(s) left after IRP_MN_REMOVE_DEVICE"));
                    }
                }
            }
            None => outcome.fail("the user program sent no surprise removal".into()),
        },
    }
    outcome
}

/// A real hot-unplug now, from a user program with requests live: waits for the bus driver's removal notice, then
/// SURPRISE_REMOVAL, which the driver must succeed; REMOVE is the sequence's, after the process. Kept as
/// `hot-unplug-during-traffic`'s outcome.
pub(crate) fn surprise_in_traffic(stack: &mut dyn PnpStack) -> SequenceOutcome {
    let mut outcome = SequenceOutcome::default();
    match crate::lock(&NOTICE).take() {
        Some(notice) => match notice() {
            Ok(()) => {
                outcome.must_succeed(stack, PnpStep::SurpriseRemoval);
            }
            Err(why) => outcome.fail(format!("the device was not hot-unplugged: {why}")),
        },
        None => outcome.fail("no bus driver here reports a hot-unplug".into()),
    }
    *crate::lock(&IN_TRAFFIC) = Some(outcome.clone());
    outcome
}

/// One rebalance now, from a user program with requests live: QUERY_STOP, then STOP and START, or CANCEL_STOP when
/// the driver refused. `stack` is the started stack's; the outcome is kept as `rebalance-during-traffic`'s.
pub(crate) fn rebalance_in_traffic(stack: &mut dyn PnpStack) -> SequenceOutcome {
    let mut outcome = SequenceOutcome::default();
    outcome.rebalance(stack);
    *crate::lock(&IN_TRAFFIC) = Some(outcome.clone());
    outcome
}

static IN_TRAFFIC: Mutex<Option<SequenceOutcome>> = Mutex::new(None);

impl SequenceOutcome {
    /// "A driver must set Irp->IoStatus.Status to STATUS_SUCCESS" (IRP_MN_SURPRISE_REMOVAL's page); REMOVE follows
    /// once every handle is closed, with the same rules as any REMOVE.
    fn surprise_removal(&mut self, stack: &mut dyn PnpStack) {
        if self.must_succeed(stack, PnpStep::SurpriseRemoval) && self.must_succeed(stack, PnpStep::Remove) {
            self.stack_gone = true;
            let left = stack.devices_left();
            if left > 0 {
                self.fail(format!("{left} device object(s) left after IRP_MN_REMOVE_DEVICE"));
            }
        }
    }
}

/// The bus driver's word that its device left the machine (a real hot-unplug): blocks until the platform says so,
/// or fails saying why it never did. Called once, in the PnP manager's thread, before SURPRISE_REMOVAL.
pub type RemovalNotice = Box<dyn FnOnce() -> Result<(), String> + Send>;

static NOTICE: Mutex<Option<RemovalNotice>> = Mutex::new(None);

/// What `hot-unplug` waits on: the guest program's bus driver plans it with the platform's removal request.
pub fn plan_removal_notice(notice: RemovalNotice) {
    *crate::lock(&NOTICE) = Some(notice);
}

/// The sequence the next life runs, and what the last one did, for the guest's report.
static PLANNED: Mutex<PnpSequence> = Mutex::new(PnpSequence::Straight);
static OUTCOME: Mutex<Option<SequenceOutcome>> = Mutex::new(None);

pub fn plan(sequence: PnpSequence) {
    *crate::lock(&PLANNED) = sequence;
}

pub fn planned() -> PnpSequence {
    *crate::lock(&PLANNED)
}

pub(crate) fn record(outcome: SequenceOutcome) {
    *crate::lock(&OUTCOME) = Some(outcome);
}

/// What the last life's sequence did (None: it ran none, or did not reach START).
pub fn outcome() -> Option<SequenceOutcome> {
    crate::lock(&OUTCOME).clone()
}

#[cfg(test)]
mod tests {
    use super::*;
    use windows_sys::Win32::Foundation::{STATUS_SUCCESS, STATUS_UNSUCCESSFUL};

    /// A stack that answers each step from a rule and records nothing itself.
    struct Fake {
        answer: fn(PnpStep) -> NTSTATUS,
        devices: usize,
    }

    impl PnpStack for Fake {
        fn send(&mut self, step: PnpStep) -> NTSTATUS {
            match step {
                PnpStep::Remove => self.devices = 0,
                PnpStep::AddDevice => self.devices = 1,
                _ => {}
            }
            (self.answer)(step)
        }
        fn devices_left(&self) -> usize {
            self.devices
        }
        fn reached_bus(&mut self) -> bool {
            true
        }
    }

    fn steps(outcome: &SequenceOutcome) -> Vec<PnpStep> {
        outcome.steps.iter().map(|(s, _)| *s).collect()
    }

    #[test]
    fn parses_every_sequence_and_refuses_the_rest() {
        assert_eq!(PnpSequence::parse("rebalance"), Ok(PnpSequence::Rebalance(1)));
        assert_eq!(PnpSequence::parse("disable-enable:3"), Ok(PnpSequence::DisableEnable(3)));
        assert_eq!(PnpSequence::parse("query-remove-cancel"), Ok(PnpSequence::QueryRemoveCancel));
        assert_eq!(PnpSequence::parse("query-stop-cancel"), Ok(PnpSequence::QueryStopCancel));
        assert_eq!(PnpSequence::parse("straight"), Ok(PnpSequence::Straight));
        assert_eq!(PnpSequence::parse("hot-unplug"), Ok(PnpSequence::HotUnplug));
        assert_eq!(PnpSequence::parse("rebalance-during-traffic"), Ok(PnpSequence::RebalanceDuringTraffic));
        for bad in ["rebalance:0", "query-stop-cancel:2", "eject", "disable-enable:x"] {
            assert!(PnpSequence::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_agreed_rebalance_is_query_stop_stop_start_each_time() {
        let mut stack = Fake { answer: |_| STATUS_SUCCESS, devices: 1 };
        let outcome = run(PnpSequence::Rebalance(2), &mut stack);
        use PnpStep::*;
        assert_eq!(steps(&outcome), [QueryStop, Stop, Start, QueryStop, Stop, Start]);
        assert_eq!((outcome.failure, outcome.refused, outcome.stack_gone), (None, 0, false));
    }

    #[test]
    fn a_refused_query_stop_is_cancelled_and_never_stopped() {
        let mut stack =
            Fake { answer: |s| if s == PnpStep::QueryStop { STATUS_UNSUCCESSFUL } else { STATUS_SUCCESS }, devices: 1 };
        let outcome = run(PnpSequence::Rebalance(1), &mut stack);
        assert_eq!(steps(&outcome), [PnpStep::QueryStop, PnpStep::CancelStop]);
        assert_eq!((outcome.failure, outcome.refused), (None, 1));
    }

    #[test]
    fn failing_a_stop_or_a_cancel_breaks_the_rule() {
        let mut stack =
            Fake { answer: |s| if s == PnpStep::Stop { STATUS_UNSUCCESSFUL } else { STATUS_SUCCESS }, devices: 1 };
        let outcome = run(PnpSequence::Rebalance(3), &mut stack);
        assert_eq!(steps(&outcome), [PnpStep::QueryStop, PnpStep::Stop]);
        assert!(outcome.failure.unwrap().contains("IRP_MN_STOP_DEVICE failed"));
        let mut stack = Fake {
            answer: |s| if s == PnpStep::CancelRemove { STATUS_UNSUCCESSFUL } else { STATUS_SUCCESS },
            devices: 1,
        };
        let outcome = run(PnpSequence::QueryRemoveCancel, &mut stack);
        assert_eq!(steps(&outcome), [PnpStep::QueryRemove, PnpStep::CancelRemove]);
        assert!(outcome.failure.unwrap().contains("must not fail"));
    }

    #[test]
    fn disable_enable_removes_then_adds_and_starts_again() {
        let mut stack = Fake { answer: |_| STATUS_SUCCESS, devices: 1 };
        let outcome = run(PnpSequence::DisableEnable(2), &mut stack);
        use PnpStep::*;
        assert_eq!(steps(&outcome), [QueryRemove, Remove, AddDevice, Start, QueryRemove, Remove, AddDevice, Start]);
        assert_eq!((outcome.failure, outcome.stack_gone), (None, false));
    }

    #[test]
    fn surprise_removal_is_followed_by_remove_and_must_succeed() {
        let mut stack = Fake { answer: |_| STATUS_SUCCESS, devices: 1 };
        let outcome = run(PnpSequence::SurpriseRemoval, &mut stack);
        assert_eq!(steps(&outcome), [PnpStep::SurpriseRemoval, PnpStep::Remove]);
        assert_eq!((outcome.failure, outcome.stack_gone), (None, true));
        let mut stack = Fake {
            answer: |s| if s == PnpStep::SurpriseRemoval { STATUS_UNSUCCESSFUL } else { STATUS_SUCCESS },
            devices: 1,
        };
        let outcome = run(PnpSequence::SurpriseRemoval, &mut stack);
        assert!(outcome.failure.unwrap().contains("IRP_MN_SURPRISE_REMOVAL failed"));
        assert!(!outcome.stack_gone, "the life's own REMOVE still frees a stack whose surprise removal failed");
    }

    #[test]
    fn a_hot_unplug_waits_for_the_notice_and_sends_nothing_without_one() {
        let mut stack = Fake { answer: |_| STATUS_SUCCESS, devices: 1 };
        plan_removal_notice(Box::new(|| Err("no request from vfio-pci within 10 s".into())));
        let outcome = run(PnpSequence::HotUnplug, &mut stack);
        assert!(outcome.steps.is_empty());
        assert!(outcome.failure.unwrap().contains("not hot-unplugged: no request"));
        let outcome = run(PnpSequence::HotUnplug, &mut stack);
        assert!(outcome.failure.unwrap().contains("no bus driver"), "a notice is used once");
        plan_removal_notice(Box::new(|| Ok(())));
        let outcome = run(PnpSequence::HotUnplug, &mut stack);
        assert_eq!(steps(&outcome), [PnpStep::SurpriseRemoval, PnpStep::Remove]);
        assert_eq!((outcome.failure, outcome.stack_gone), (None, true));
    }

    #[test]
    fn a_rebalance_during_traffic_is_the_user_programs_and_fails_without_one() {
        let outcome = run(PnpSequence::RebalanceDuringTraffic, &mut Fake { answer: |_| STATUS_SUCCESS, devices: 1 });
        assert!(outcome.failure.unwrap().contains("no rebalance"));
        let mut refusing =
            Fake { answer: |s| if s == PnpStep::QueryStop { STATUS_UNSUCCESSFUL } else { STATUS_SUCCESS }, devices: 1 };
        let sent = rebalance_in_traffic(&mut refusing);
        assert_eq!((steps(&sent), sent.refused), (vec![PnpStep::QueryStop, PnpStep::CancelStop], 1));
        let outcome = run(PnpSequence::RebalanceDuringTraffic, &mut refusing);
        assert_eq!(outcome, sent, "the sequence reports the rebalance the program sent");
    }

    #[test]
    fn a_hot_unplug_during_traffic_surprises_first_and_removes_after_the_program() {
        let mut stack = Fake { answer: |_| STATUS_SUCCESS, devices: 1 };
        plan_removal_notice(Box::new(|| Ok(())));
        let sent = surprise_in_traffic(&mut stack);
        assert_eq!((steps(&sent), sent.failure), (vec![PnpStep::SurpriseRemoval], None));
        let outcome = run(PnpSequence::HotUnplugDuringTraffic, &mut stack);
        assert_eq!(steps(&outcome), [PnpStep::SurpriseRemoval, PnpStep::Remove]);
        assert_eq!((outcome.failure, outcome.stack_gone), (None, true));
        let outcome = run(PnpSequence::HotUnplugDuringTraffic, &mut stack);
        assert!(outcome.failure.unwrap().contains("no surprise removal"));
    }

    #[test]
    fn a_cancel_completed_without_passing_it_down_breaks_the_rule() {
        /// Completes CANCEL_STOP itself, as vhca.sys would without forwarding it to the bus driver first.
        struct KeepsCancel(Option<PnpStep>);
        impl PnpStack for KeepsCancel {
            fn send(&mut self, step: PnpStep) -> NTSTATUS {
                self.0 = Some(step);
                STATUS_SUCCESS
            }
            fn devices_left(&self) -> usize {
                1
            }
            fn reached_bus(&mut self) -> bool {
                self.0 != Some(PnpStep::CancelStop)
            }
        }
        let outcome = run(PnpSequence::QueryStopCancel, &mut KeepsCancel(None));
        assert_eq!(
            outcome.failure.as_deref(),
            Some("IRP_MN_CANCEL_STOP_DEVICE succeeded without reaching the bus driver")
        );
    }

    #[test]
    fn a_device_left_after_remove_ends_the_disable() {
        struct Leaky;
        impl PnpStack for Leaky {
            fn send(&mut self, _: PnpStep) -> NTSTATUS {
                STATUS_SUCCESS
            }
            fn devices_left(&self) -> usize {
                1
            }
            fn reached_bus(&mut self) -> bool {
                true
            }
        }
        let outcome = run(PnpSequence::DisableEnable(1), &mut Leaky);
        assert_eq!(steps(&outcome), [PnpStep::QueryRemove, PnpStep::Remove]);
        assert!(outcome.failure.unwrap().contains("left after IRP_MN_REMOVE_DEVICE"));
        assert!(outcome.stack_gone, "the life must not send a second REMOVE to a stack that is gone");
    }
}
