//! The native twin of vhca.sys's PnP sequences (`vhca.pnp=`): how many times the guest program stops the device as
//! vhca.sys does at STOP or REMOVE (reset, then rings and buffers freed) and starts it again from nothing.

use vhca_loader::pnp_sequence::PnpSequence;

/// Stop/start cycles the native driver runs after its scenario. A rebalance and a disable/enable each stop and
/// start the device once per round; a cancelled query stops nothing (the driver core keeps running, as vhca.sys
/// does), so it has no native work and counts 0.
pub fn restarts(sequence: PnpSequence) -> u32 {
    match sequence {
        PnpSequence::Rebalance(n) | PnpSequence::DisableEnable(n) => n,
        // A surprise removal ends the device's life: the guest program's own teardown after the scenario is it (after
        // a real hot-unplug the same, once vfio-pci asked for the device: bring_up.rs, hot_unplug.rs).
        PnpSequence::Straight
        | PnpSequence::QueryStopCancel
        | PnpSequence::QueryRemoveCancel
        | PnpSequence::SurpriseRemoval
        | PnpSequence::HotUnplug => 0,
        // A user process's rebalance: vhca.sys only (the native program has no I/O manager for a user process).
        PnpSequence::RebalanceDuringTraffic | PnpSequence::HotUnplugDuringTraffic => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_stop_or_a_remove_restarts_the_device() {
        assert_eq!(restarts(PnpSequence::Rebalance(2)), 2);
        assert_eq!(restarts(PnpSequence::DisableEnable(3)), 3);
        assert_eq!(restarts(PnpSequence::QueryRemoveCancel), 0);
        assert_eq!(restarts(PnpSequence::Straight), 0);
        assert_eq!(restarts(PnpSequence::HotUnplug), 0);
    }
}
