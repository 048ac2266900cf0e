//! Dispatcher objects a thread can wait on (events, and timers' signal state): KeInitializeEvent, KeSetEvent,
//! KeClearEvent, and KeWaitForSingleObject with its timeout on the model's clock and its IRQL rules.

use std::collections::HashMap;
use std::sync::{Condvar, Mutex};

use vhca_ntapi::*;

use crate::bugcheck::Bugcheck;
use crate::verifier::{c4, VerifierFlags};
use crate::{lock, NtModel};

/// Notification objects stay signaled until cleared; synchronization objects are cleared by the wait they satisfy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reset {
    Notification,
    Synchronization,
}

struct Signal {
    reset: Reset,
    signaled: bool,
}

pub(crate) struct Dispatcher {
    objects: Mutex<HashMap<u64, Signal>>,
    /// An object was signaled, a timer set, or the clock moved: waiters look again.
    changed: Condvar,
}

impl Dispatcher {
    pub fn new() -> Dispatcher {
        Dispatcher { objects: Mutex::new(HashMap::new()), changed: Condvar::new() }
    }
}

impl NtModel {
    pub(crate) fn new_dispatcher_object(&self, reset: Reset, signaled: bool) -> u64 {
        let addr = self.new_object();
        lock(&self.dispatcher.objects).insert(addr, Signal { reset, signaled });
        addr
    }

    /// Sets or clears an object's signal state; returns the previous one.
    pub(crate) fn set_signal(&self, addr: u64, signaled: bool) -> bool {
        let mut objects = lock(&self.dispatcher.objects);
        let Some(s) = objects.get_mut(&addr) else {
            drop(objects);
            self.never_initialised(addr)
        };
        let was = std::mem::replace(&mut s.signaled, signaled);
        drop(objects);
        if signaled {
            self.dispatcher.changed.notify_all();
        }
        was
    }

    /// Every waiter looks again (the clock moved, a timer was set): taken under the objects' lock so a waiter
    /// between its look and its sleep cannot miss it.
    pub(crate) fn wake_waiters(&self) {
        let _objects = lock(&self.dispatcher.objects);
        self.dispatcher.changed.notify_all();
    }

    /// KeSetEvent: above DISPATCH_LEVEL is 0xC4/0x80 (P2 IRQL, P3 the event); with Wait = TRUE above APC_LEVEL
    /// the model assumes 0xC4/0xE5. Wait = TRUE keeps no IRQL raised here: the model has no context switch to save.
    pub(crate) fn event_set(&self, event: PKEVENT, wait: bool) -> i32 {
        let irql = self.irql();
        if self.checks(VerifierFlags::IRQL_CHECKING) {
            if irql > DISPATCH_LEVEL {
                self.violation(Bugcheck::c4(c4::SET_EVENT_ABOVE_DISPATCH, irql as u64, event.0, 0));
            } else if wait && irql > APC_LEVEL {
                self.violation(Bugcheck::c4(c4::KERNEL_API_WRONG_IRQL, irql as u64, 0, 0));
            }
        }
        self.set_signal(event.0, true) as i32
    }

    pub(crate) fn event_clear(&self, event: PKEVENT) {
        self.irql_at_most(DISPATCH_LEVEL);
        self.set_signal(event.0, false);
    }

    /// KeWaitForSingleObject's IRQL rules (IRQL checking): above DISPATCH_LEVEL 0x120, at DISPATCH_LEVEL 0x121
    /// with no timeout and 0x122 with a non-zero one. Windows passes the addresses of the IRQL and of the timeout;
    /// the model passes the IRQL and the timeout's value (0 for none).
    fn wait_irql_check(&self, object: u64, timeout: Option<i64>) {
        let irql = self.irql();
        if !self.checks(VerifierFlags::IRQL_CHECKING) || irql < DISPATCH_LEVEL {
            return;
        }
        let p4 = timeout.unwrap_or(0) as u64;
        if irql > DISPATCH_LEVEL {
            self.violation(Bugcheck::c4(c4::WAIT_ABOVE_DISPATCH, irql as u64, object, p4));
        } else if timeout.is_none() {
            self.violation(Bugcheck::c4(c4::WAIT_AT_DISPATCH_NO_TIMEOUT, irql as u64, object, 0));
        } else if timeout != Some(0) {
            self.violation(Bugcheck::c4(c4::WAIT_AT_DISPATCH_NONZERO_TIMEOUT, irql as u64, object, p4));
        }
    }

    /// Waits until `object` is signaled (a synchronization object is cleared by the wait) or the timeout passes.
    /// A negative timeout is relative; a positive one is absolute on the model's clock (0 = the model's start).
    /// While it waits, the thread runs the clock's work a processor would: expiring timers that fall due (its own
    /// may be one) and running the DPCs they queue.
    pub(crate) fn wait_for_single_object(&self, object: DISPATCHER_OBJECT, timeout: Option<i64>) -> NTSTATUS {
        let addr = object.address();
        self.wait_irql_check(addr, timeout);
        let deadline =
            timeout.map(|t| if t < 0 { self.clock.now().saturating_add(t.unsigned_abs()) } else { t as u64 });
        loop {
            let next_expiry = self.next_timer_due();
            let mut objects = lock(&self.dispatcher.objects);
            let now = self.clock.now();
            let Some(s) = objects.get_mut(&addr) else {
                drop(objects);
                self.never_initialised(addr)
            };
            if s.signaled {
                if s.reset == Reset::Synchronization {
                    s.signaled = false;
                }
                return STATUS_SUCCESS;
            }
            if deadline.is_some_and(|d| now >= d) {
                return STATUS_TIMEOUT;
            }
            let wake_at = [deadline, next_expiry].into_iter().flatten().min();
            match wake_at.and_then(|at| self.clock.host_wait_until(at)) {
                Some(wait) => drop(self.dispatcher.changed.wait_timeout(objects, wait)),
                None => drop(self.dispatcher.changed.wait(objects)),
            }
            self.expire_timers();
            if self.irql() < DISPATCH_LEVEL {
                self.run_queued_dpcs();
            }
        }
    }
}
