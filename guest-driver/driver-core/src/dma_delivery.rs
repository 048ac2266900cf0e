//! The hand-over from an execution routine (AdapterControl, AdapterListControl) to the control path that queued it.
//! Windows calls the routine before the queuing call returns when the resources are there, or later when they free
//! up; the control path takes the value if it came in time and otherwise gives up, and a routine that arrives after
//! that gives its resources straight back (Windows has no way to cancel a queued routine).

use alloc::boxed::Box;
use core::sync::atomic::{AtomicU8, Ordering};

use once_cell::race::OnceBox;

const WAITING: u8 = 0;
const DELIVERED: u8 = 1;
const ABANDONED: u8 = 2;

/// One value, delivered at most once by a routine and taken at most once by the control path; `L` is what a
/// control path that gives up leaves the late routine to release (the request's MDL, which must outlive it).
pub(crate) struct Delivery<T, L = ()> {
    value: OnceBox<T>,
    left: OnceBox<L>,
    state: AtomicU8,
}

impl<T, L> Delivery<T, L> {
    pub fn new() -> Delivery<T, L> {
        Delivery { value: OnceBox::new(), left: OnceBox::new(), state: AtomicU8::new(WAITING) }
    }

    /// `take`, leaving `left` to the routine if the value has not come: the late routine, once it has released
    /// what its value holds, releases `left` too (`left_behind`). Stored before the give-up takes effect, so a
    /// routine that finds the delivery abandoned always finds it.
    pub fn take_or_leave(&self, left: L) -> Option<&T> {
        let _ = self.left.set(alloc::boxed::Box::new(left));
        self.take()
    }

    /// What the control path left when it gave up; for the late routine, after `deliver` returned `Err`.
    pub fn left_behind(&self) -> Option<&L> {
        self.left.get()
    }

    /// The routine's side. `Ok` when the control path will take the value; `Err(value)` when it gave up already,
    /// and the routine must release what the value holds.
    pub fn deliver(&self, value: T) -> Result<(), &T> {
        if self.value.set(Box::new(value)).is_err() {
            // A second delivery cannot happen (Windows calls a routine once); keep the first.
            return Ok(());
        }
        match self.state.compare_exchange(WAITING, DELIVERED, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => Ok(()),
            Err(_) => Err(self.value.get().expect("set just above")),
        }
    }

    /// Whether the control path gave up: a routine called later checks this before it takes anything.
    pub fn abandoned(&self) -> bool {
        self.state.load(Ordering::Acquire) == ABANDONED
    }

    /// The control path's side, once the queuing call has returned: the value if the routine already delivered
    /// it, else `None`, and a routine that comes later finds the delivery abandoned.
    pub fn take(&self) -> Option<&T> {
        match self.state.compare_exchange(WAITING, ABANDONED, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => None,
            Err(_) => self.value.get(),
        }
    }
}
