//! Dispatcher objects a thread can wait on (events, and timers' signal state): KeInitializeEvent, KeSetEvent,
//! KeClearEvent, KeWaitForSingleObject and KeDelayExecutionThread on the model's clock, with their IRQL rules and
//! the kernel's refusal to block a DPC or an ISR (0xB8, which the KMUTEX wait in `locks` shares).

use std::collections::HashMap;
use std::sync::{Condvar, Mutex};

use vhca_ntapi::*;

use crate::bugcheck::Bugcheck;
use crate::interleaving::{SyncObject, WaitChannel};
use crate::processor::ProcessorNumber;
use crate::verifier::{c4, VerifierFlags};
use crate::{lock, NtModel, ETHREAD_BASE};

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

/// The stand-in ETHREAD of a processor's idle thread, what a wait on it would switch to: each model thread runs on a
/// processor of its own, so nothing else is ready there. The top slots of the thread stand-ins' range (ETHREAD_BASE
/// + n * 0x1000), which no model thread reaches.
fn idle_thread(cpu: ProcessorNumber) -> u64 {
    ETHREAD_BASE + 0x0FFF_FFFF_F000 - u64::from(cpu.0) * 0x1000
}

impl NtModel {
    pub(crate) fn new_dispatcher_object(&self, reset: Reset, signaled: bool) -> u64 {
        let addr = self.new_object();
        lock(&self.dispatcher.objects).insert(addr, Signal { reset, signaled });
        addr
    }

    /// Sets or clears an object's signal state; returns the previous one.
    pub(crate) fn set_signal(&self, addr: u64, signaled: bool) -> bool {
        if signaled {
            // Before the signal shows: a waiter it satisfies sees what this thread did up to here.
            self.hb_release(SyncObject::Dispatcher(addr));
        }
        let mut objects = lock(&self.dispatcher.objects);
        let Some(s) = objects.get_mut(&addr) else {
            drop(objects);
            self.never_initialised(addr)
        };
        let was = std::mem::replace(&mut s.signaled, signaled);
        drop(objects);
        if signaled {
            self.wake(WaitChannel::Dispatcher(addr));
            self.dispatcher.changed.notify_all();
        }
        was
    }

    /// Every waiter looks again (the clock moved, a timer was set): taken under the objects' lock so a waiter
    /// between its look and its sleep cannot miss it.
    pub(crate) fn wake_waiters(&self) {
        // Not a wake for the interleaving modes: nothing was signaled, and a wait that ends by its timeout counts
        // as running once its thread runs.
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

    /// Whether the calling thread runs a DPC or an ISR now: a routine in a context borrowed from whatever thread
    /// its processor was running, which has no thread of its own to put in a wait state.
    pub(crate) fn in_borrowed_routine(&self) -> bool {
        self.with_thread(|t| t.watch.routine_since.is_some())
    }

    /// 0xB8 ATTEMPTED_SWITCH_FROM_DPC, in every verifier mode: a DPC or an ISR made a wait that has to block, and
    /// the kernel's wait code cannot switch away from it. P1 the original thread (the one the routine borrowed), P2
    /// the processor's idle thread, P3 an address on the original thread's stack (this frame's: the routine runs
    /// on that stack), P4 0. Returns only when the rule is disabled.
    pub(crate) fn switch_from_dpc(&self) {
        let frame = 0u8;
        let stack = std::ptr::addr_of!(frame) as u64;
        let original = self.with_thread(|t| t.ethread);
        self.violation(Bugcheck::switch_from_dpc(original, idle_thread(self.current_processor()), stack));
    }

    /// Waits until `object` is signaled (a synchronization object is cleared by the wait) or the timeout passes.
    /// A negative timeout is relative; a positive one is absolute on the model's clock (0 = the model's start).
    /// A wait that does not block (the object signaled, a zero timeout) is the same in a DPC or an ISR; one that
    /// would is 0xB8 there, after the verifier's IRQL rules.
    pub(crate) fn wait_for_single_object(&self, object: DISPATCHER_OBJECT, timeout: Option<i64>) -> NTSTATUS {
        let addr = object.address();
        self.wait_irql_check(addr, timeout);
        let deadline = timeout.map(|t| self.deadline(t));
        self.block_until(Some(addr), deadline, self.in_borrowed_routine())
    }

    /// KeDelayExecutionThread(KernelMode, Alertable, Interval): the thread waits on the clock alone. IRQL checking
    /// holds it to its page's <= APC_LEVEL (0xC4/0xE5, P2 the IRQL); in a DPC or an ISR it is 0xB8 in every mode
    /// after that, whatever the interval: a delay is a wait or, at zero, a yield, and the 0xB8 page names both. With
    /// 0xB8 disabled the delay blocks the thread the routine borrowed (the DPC watchdog counts it). The interval is
    /// the wait's timeout form (negative relative, positive absolute on the model's clock). No alert or user APC
    /// ever ends a delay early (the model has neither): STATUS_SUCCESS. A driver binary imports it (the loader's
    /// thunk calls this); the native build's sleeps are the guest program's own, so it is no `NtAsyncKernel` routine.
    #[track_caller]
    pub fn delay_execution_thread(&self, interval: i64) -> NTSTATUS {
        let _call = self.kernel_call("KeDelayExecutionThread");
        self.irql_at_most(APC_LEVEL);
        if self.in_borrowed_routine() {
            self.switch_from_dpc();
        }
        let deadline = self.deadline(interval);
        self.block_until(None, Some(deadline), false);
        STATUS_SUCCESS
    }

    /// A wait's timeout as a time on the model's clock: negative relative to now, else absolute.
    fn deadline(&self, timeout: i64) -> u64 {
        if timeout < 0 {
            self.clock.now().saturating_add(timeout.unsigned_abs())
        } else {
            timeout as u64
        }
    }

    /// Blocks until `object` (none: the clock alone) is signaled or `deadline` passes. While it waits, the thread
    /// runs the clock's work a processor would: expiring timers that fall due (its own may be one) and running the
    /// DPCs they queue. `cannot_block`: the caller is a DPC or an ISR, where having to block is 0xB8.
    fn block_until(&self, object: Option<u64>, deadline: Option<u64>, cannot_block: bool) -> NTSTATUS {
        let mut blocked = false;
        let status = self.block_until_inner(object, deadline, cannot_block, &mut blocked);
        if blocked {
            self.active();
        }
        if let (Some(addr), STATUS_SUCCESS) = (object, status) {
            self.hb_acquire(SyncObject::Dispatcher(addr));
        }
        status
    }

    /// `block_until`'s loop; `blocked` is set once the thread went quiescent to sleep, so the caller wakes it.
    fn block_until_inner(
        &self,
        object: Option<u64>,
        deadline: Option<u64>,
        mut cannot_block: bool,
        blocked: &mut bool,
    ) -> NTSTATUS {
        loop {
            let next_expiry = self.next_timer_due();
            let mut objects = lock(&self.dispatcher.objects);
            let now = self.clock.now();
            if let Some(addr) = object {
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
            }
            if deadline.is_some_and(|d| now >= d) {
                return STATUS_TIMEOUT;
            }
            if cannot_block {
                drop(objects);
                // A timer already due would have been expired by the clock interrupt before the wait looked.
                if next_expiry.is_some_and(|due| due <= now) {
                    self.expire_timers();
                    continue;
                }
                self.switch_from_dpc();
                // 0xB8 disabled: the wait blocks the thread the routine borrowed (the DPC watchdog counts it).
                cannot_block = false;
                continue;
            }
            // A delay waits on no object: nothing signals address 0.
            if self.block_on(WaitChannel::Dispatcher(object.unwrap_or(0))) {
                // Blocked again after each wake (a signal that another thread's wait took first); then look
                // again, as the signal may have come meanwhile.
                drop(objects);
                *blocked = true;
                continue;
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
