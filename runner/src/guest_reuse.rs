//! A restored guest that served a run and can serve the next one on the same worker, instead of a fresh restore: the
//! watch hands it back when the run left it clean, and the runs it served so far go into the next run's restore log.

use vhca_suite::ConcreteRun;

use crate::load_ahead::{GuestHome, Loaded};

/// Whether a run's guest may serve another run at all, known before it starts. One whose HCA is hot-unplugged
/// mid-run (hot_unplug.rs) may not: its kernel went through an eject of a device its program held (vfio-pci's
/// request, the removal that waited for the program) and its device was stopped, not hung up on, so neither "the
/// HCA ejected by the agent" nor "the device exited cleanly" can say it is as the snapshot left it.
pub fn may_serve_again(run: &ConcreteRun) -> bool {
    !crate::hot_unplug::asked_by(run)
}

/// A restored guest that served a run and said it can serve another (its agent's readiness line came after the
/// run's result, its HCA ejected and the device gone): running, its agent waiting for the next request on the
/// console. Its QEMU has translated the paths a run takes, which a fresh QEMU translates afresh.
pub struct ReadyGuest {
    /// Declared first so it drops first: QEMU is gone before its work dir is removed.
    pub loaded: Loaded,
    pub home: GuestHome,
    /// Runs this guest served so far.
    pub served: u32,
}

impl ReadyGuest {
    pub fn new(loaded: Loaded, home: GuestHome, served: u32) -> ReadyGuest {
        ReadyGuest { loaded, home, served }
    }

    /// The guest, its home, and how many runs it served.
    pub fn into_parts(self) -> (Loaded, GuestHome, u32) {
        let ReadyGuest { loaded, home, served } = self;
        (loaded, home, served)
    }
}
