//! Kernel locks with real blocking (FAST_MUTEX, guarded mutex, KMUTEX, ERESOURCE, spin lock), their IRQL rules,
//! the verifier's deadlock detection (recursion, lock-order cycles, wrong-thread and unacquired releases) and 0xB8.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::ThreadId;

use vhca_ntapi::*;

use crate::bugcheck::Bugcheck;
use crate::interleaving::{PointKind, SyncObject, WaitChannel};
use crate::verifier::{c4, VerifierFlags};
use crate::{lock, NtModel};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LockKind {
    FastMutex,
    GuardedMutex,
    KMutex,
    Resource,
    SpinLock,
}

impl LockKind {
    /// The owner may take it again (KMUTEX always; ERESOURCE exclusively).
    fn recursive(self) -> bool {
        matches!(self, LockKind::KMutex | LockKind::Resource)
    }
}

#[derive(Default)]
struct LockState {
    owner: Option<ThreadId>,
    depth: u32,
    shared: HashMap<ThreadId, u32>,
    /// The IRQL to go back to on release (FAST_MUTEX).
    saved_irql: KIRQL,
}

pub(crate) struct LockObject {
    kind: LockKind,
    addr: u64,
    state: Mutex<LockState>,
    freed: Condvar,
}

#[derive(Default)]
pub(crate) struct LockTable {
    objects: HashMap<u64, Arc<LockObject>>,
    /// Lock-order edges a -> b: b was acquired while a was held.
    order: HashSet<(u64, u64)>,
}

impl LockTable {
    fn reaches(&self, from: u64, to: u64) -> bool {
        let mut seen = HashSet::new();
        let mut stack = vec![from];
        while let Some(n) = stack.pop() {
            if n == to {
                return true;
            }
            if seen.insert(n) {
                stack.extend(self.order.iter().filter(|(a, _)| *a == n).map(|(_, b)| *b));
            }
        }
        false
    }
}

impl NtModel {
    pub(crate) fn new_lock(&self, kind: LockKind) -> u64 {
        let addr = self.new_object();
        let obj = Arc::new(LockObject { kind, addr, state: Mutex::new(LockState::default()), freed: Condvar::new() });
        lock(&self.locks).objects.insert(addr, obj);
        addr
    }

    fn lock_object(&self, addr: u64) -> Option<Arc<LockObject>> {
        lock(&self.locks).objects.get(&addr).cloned()
    }

    /// Deadlock detection before a thread blocks on `obj`. First the processor's own: an ISR (or a routine at a
    /// higher IRQL) wanting a lock the context it interrupted holds would spin forever on Windows, whatever kind of
    /// acquisition it is (KeAcquireSpinLockAtDpcLevel in an ISR as much as the interrupt spin lock).
    fn before_acquire(&self, obj: &LockObject) -> Result<(), Bugcheck> {
        let r = self.interrupt_deadlock_check(obj.addr);
        self.ok(r);
        let held = self.with_thread(|t| t.held.clone());
        if !self.checks(VerifierFlags::DEADLOCK_DETECTION) {
            return Ok(());
        }
        if held.contains(&obj.addr) {
            if obj.kind.recursive() {
                return Ok(());
            }
            self.found(Bugcheck::c4(c4::SELF_DEADLOCK, obj.addr, 0, 0))?;
        }
        let mut table = lock(&self.locks);
        if held.iter().any(|h| table.reaches(obj.addr, *h)) {
            self.found(Bugcheck::c4(c4::LOCK_HIERARCHY_VIOLATION, obj.addr, 0, 0))?;
        }
        for h in held {
            table.order.insert((h, obj.addr));
        }
        Ok(())
    }

    /// Release checks: the releasing thread must be the one holding the lock.
    fn before_release(&self, obj: &LockObject) -> Result<(), Bugcheck> {
        let (mine, me) = self.with_thread(|t| (t.held.contains(&obj.addr), t.ethread));
        if mine || !self.checks(VerifierFlags::DEADLOCK_DETECTION) {
            return Ok(());
        }
        let st = lock(&obj.state);
        let owner = st.owner.or_else(|| st.shared.keys().next().copied());
        drop(st);
        match owner {
            Some(tid) => {
                let other = lock(&self.threads).get(&tid).map(|t| t.ethread).unwrap_or(0);
                self.found(Bugcheck::c4(c4::WRONG_THREAD_RELEASE, obj.addr, other, me))
            }
            None => self.found(Bugcheck::c4(c4::RELEASE_UNACQUIRED, obj.addr, 0, 0)),
        }
    }

    /// Blocks until the calling thread owns `obj` exclusively (or shared), then records it as held. Every kind of
    /// lock passes here, the interrupt spin lock too: its take is what makes KeSynchronizeExecution an edge.
    fn block_acquire(&self, obj: &LockObject, shared: bool, wait: bool) -> bool {
        self.point(PointKind::Acquire(obj.addr));
        let me = std::thread::current().id();
        let mut blocked = false;
        let mut st = lock(&obj.state);
        loop {
            let owned_by_me = st.owner == Some(me);
            if owned_by_me && obj.kind.recursive() {
                st.depth += 1;
                break;
            }
            let free_for_me =
                if shared { st.owner.is_none() || owned_by_me } else { st.owner.is_none() && st.shared.is_empty() };
            if free_for_me {
                if shared && !owned_by_me {
                    *st.shared.entry(me).or_insert(0) += 1;
                } else if shared {
                    st.depth += 1;
                } else {
                    st.owner = Some(me);
                    st.depth = 1;
                }
                break;
            }
            if !wait {
                return false;
            }
            if self.block_on(WaitChannel::Lock(obj.addr)) {
                // A thread waiting for a lock counts as quiescent for a paused one (it may hold this very lock)
                // until the lock is freed; then it looks again.
                blocked = true;
                continue;
            }
            st = obj.freed.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        drop(st);
        if blocked {
            self.active();
        }
        self.hb_acquire(SyncObject::Lock(obj.addr));
        self.with_thread(|t| t.held.push(obj.addr));
        true
    }

    /// Drops one level of the calling thread's hold on `obj`; wakes waiters when it is free.
    fn block_release(&self, obj: &LockObject) {
        self.hb_release(SyncObject::Lock(obj.addr));
        let me = std::thread::current().id();
        let mut st = lock(&obj.state);
        if st.owner == Some(me) {
            st.depth = st.depth.saturating_sub(1);
            if st.depth == 0 {
                st.owner = None;
            }
        } else if let Some(n) = st.shared.get_mut(&me) {
            *n -= 1;
            if *n == 0 {
                st.shared.remove(&me);
            }
        } else {
            // Released by a thread that does not hold it (no deadlock detection): Windows would corrupt the lock;
            // the model frees it so the run continues.
            st.owner = None;
            st.depth = 0;
        }
        drop(st);
        self.wake(WaitChannel::Lock(obj.addr));
        obj.freed.notify_all();
        self.with_thread(|t| {
            if let Some(i) = t.held.iter().rposition(|h| *h == obj.addr) {
                t.held.remove(i);
            }
        });
        self.point(PointKind::Release(obj.addr));
    }

    fn must_lock(&self, addr: u64) -> Arc<LockObject> {
        match self.lock_object(addr) {
            Some(o) => o,
            // A pointer that was never initialised as a lock: the verifier's "uninitialised resource".
            None => self.raise(Bugcheck::c4(0x1002, addr, 0, 0)),
        }
    }

    pub(crate) fn fast_mutex_acquire(&self, m: PFAST_MUTEX) {
        let obj = self.must_lock(m.0);
        let irql = self.irql();
        if self.checks(VerifierFlags::IRQL_CHECKING) && irql > APC_LEVEL {
            self.violation(Bugcheck::c4(c4::ACQUIRE_FAST_MUTEX_ABOVE_APC, irql as u64, m.0, 0));
        }
        let r = self.before_acquire(&obj);
        self.ok(r);
        // Windows raises to APC_LEVEL before waiting, so the owner (and the waiter) run at APC_LEVEL.
        self.set_irql(irql.max(APC_LEVEL));
        self.block_acquire(&obj, false, true);
        lock(&obj.state).saved_irql = irql;
    }

    pub(crate) fn fast_mutex_release(&self, m: PFAST_MUTEX) {
        let obj = self.must_lock(m.0);
        let irql = self.irql();
        if self.checks(VerifierFlags::IRQL_CHECKING) && irql != APC_LEVEL {
            self.violation(Bugcheck::c4(c4::RELEASE_FAST_MUTEX_NOT_APC, irql as u64, m.0, 0));
        }
        let r = self.before_release(&obj);
        self.ok(r);
        let saved = lock(&obj.state).saved_irql;
        self.block_release(&obj);
        self.set_irql(saved);
    }

    pub(crate) fn guarded_mutex_acquire(&self, m: PKGUARDED_MUTEX) {
        let obj = self.must_lock(m.0);
        let irql = self.irql();
        if self.checks(VerifierFlags::IRQL_CHECKING) && irql > APC_LEVEL {
            self.violation(Bugcheck::c4(c4::KERNEL_API_WRONG_IRQL, irql as u64, 0, 0));
        }
        let r = self.before_acquire(&obj);
        self.ok(r);
        self.with_thread(|t| t.apc_disable += 1);
        self.block_acquire(&obj, false, true);
    }

    pub(crate) fn guarded_mutex_release(&self, m: PKGUARDED_MUTEX) {
        let obj = self.must_lock(m.0);
        let irql = self.irql();
        if self.checks(VerifierFlags::IRQL_CHECKING) && irql > APC_LEVEL {
            self.violation(Bugcheck::c4(c4::KERNEL_API_WRONG_IRQL, irql as u64, 0, 0));
        }
        let r = self.before_release(&obj);
        self.ok(r);
        self.block_release(&obj);
        self.with_thread(|t| t.apc_disable = t.apc_disable.saturating_sub(1));
    }

    /// KeWaitForMutexObject, a wait with no timeout: IRQL checking's 0xC4/0x120 above DISPATCH_LEVEL and 0x121 at
    /// it, deadlock detection, then the kernel's 0xB8 when a DPC or an ISR would block.
    pub(crate) fn kmutex_wait(&self, m: PKMUTEX) -> NTSTATUS {
        let obj = self.must_lock(m.0);
        let irql = self.irql();
        if self.checks(VerifierFlags::IRQL_CHECKING) {
            if irql > DISPATCH_LEVEL {
                self.violation(Bugcheck::c4(c4::WAIT_ABOVE_DISPATCH, irql as u64, m.0, 0));
            }
            if irql == DISPATCH_LEVEL {
                self.violation(Bugcheck::c4(c4::WAIT_AT_DISPATCH_NO_TIMEOUT, irql as u64, m.0, 0));
            }
        }
        let r = self.before_acquire(&obj);
        self.ok(r);
        // A DPC or an ISR that cannot take the mutex at once would have to block: the kernel's 0xB8, as for any
        // dispatcher object, after the verifier's checks. One it can take (free, or owned by the thread the routine
        // borrowed, recursively) switches to nothing.
        let may_block = !self.in_borrowed_routine();
        if !self.block_acquire(&obj, false, may_block) {
            self.switch_from_dpc();
            // 0xB8 disabled: the wait blocks the thread the routine borrowed (the DPC watchdog counts it).
            self.block_acquire(&obj, false, true);
        }
        self.with_thread(|t| t.apc_disable += 1);
        STATUS_SUCCESS
    }

    pub(crate) fn kmutex_release(&self, m: PKMUTEX) -> i32 {
        let obj = self.must_lock(m.0);
        let irql = self.irql();
        if self.checks(VerifierFlags::IRQL_CHECKING) && irql > DISPATCH_LEVEL {
            self.violation(Bugcheck::c4(c4::KERNEL_API_WRONG_IRQL, irql as u64, 0, 0));
        }
        let r = self.before_release(&obj);
        self.ok(r);
        self.block_release(&obj);
        self.with_thread(|t| t.apc_disable = t.apc_disable.saturating_sub(1));
        0
    }

    fn resource_apc_check(&self, r: PERESOURCE, subcode: u64) {
        let (irql, apc_disable) = self.with_thread(|t| (t.irql, t.apc_disable));
        if self.checks(VerifierFlags::IRQL_CHECKING) {
            if irql > APC_LEVEL {
                self.violation(Bugcheck::c4(c4::KERNEL_API_WRONG_IRQL, irql as u64, 0, 0));
            }
            if irql == PASSIVE_LEVEL && apc_disable == 0 {
                self.violation(Bugcheck::c4(subcode, irql as u64, apc_disable as u64, r.0));
            }
        }
    }

    pub(crate) fn resource_acquire(&self, r: PERESOURCE, shared: bool, wait: bool) -> bool {
        let obj = self.must_lock(r.0);
        self.resource_apc_check(r, c4::ACQUIRE_RESOURCE_APCS_ENABLED);
        let c = self.before_acquire(&obj);
        self.ok(c);
        self.block_acquire(&obj, shared, wait)
    }

    pub(crate) fn resource_release(&self, r: PERESOURCE) {
        let obj = self.must_lock(r.0);
        self.resource_apc_check(r, c4::RELEASE_RESOURCE_APCS_ENABLED);
        let c = self.before_release(&obj);
        self.ok(c);
        self.block_release(&obj);
    }

    pub(crate) fn spin_lock_acquire(&self, l: PKSPIN_LOCK) -> KIRQL {
        let obj = self.must_lock(l.0);
        let irql = self.irql();
        if self.checks(VerifierFlags::IRQL_CHECKING) && irql > DISPATCH_LEVEL {
            self.violation(Bugcheck::c4(c4::ACQUIRE_SPIN_LOCK_ABOVE_DISPATCH, irql as u64, l.0, 0));
        }
        let r = self.before_acquire(&obj);
        self.ok(r);
        self.set_irql(DISPATCH_LEVEL.max(irql));
        self.block_acquire(&obj, false, true);
        irql
    }

    pub(crate) fn spin_lock_release(&self, l: PKSPIN_LOCK, new_irql: KIRQL) {
        let obj = self.must_lock(l.0);
        let irql = self.irql();
        if self.checks(VerifierFlags::IRQL_CHECKING) && irql != DISPATCH_LEVEL {
            self.violation(Bugcheck::c4(c4::RELEASE_SPIN_LOCK_NOT_DISPATCH, irql as u64, l.0, 0));
        }
        let r = self.before_release(&obj);
        self.ok(r);
        self.block_release(&obj);
        self.set_irql(new_irql);
    }

    /// KeAcquireSpinLockAtDpcLevel: below DISPATCH_LEVEL is 0xC4/0x40 (IRQL checking); the IRQL stays.
    pub(crate) fn spin_lock_acquire_at_dpc_level(&self, l: PKSPIN_LOCK) {
        let irql = self.irql();
        if self.checks(VerifierFlags::IRQL_CHECKING) && irql < DISPATCH_LEVEL {
            self.violation(Bugcheck::c4(c4::ACQUIRE_SPIN_LOCK_AT_DPC_BELOW_DISPATCH, irql as u64, l.0, 0));
        }
        self.spin_lock_take(l.0);
    }

    /// KeReleaseSpinLockFromDpcLevel: below DISPATCH_LEVEL is 0xC4/0x41 (IRQL checking); the IRQL stays.
    pub(crate) fn spin_lock_release_from_dpc_level(&self, l: PKSPIN_LOCK) {
        let irql = self.irql();
        if self.checks(VerifierFlags::IRQL_CHECKING) && irql < DISPATCH_LEVEL {
            self.violation(Bugcheck::c4(c4::RELEASE_SPIN_LOCK_FROM_DPC_BELOW_DISPATCH, irql as u64, l.0, 0));
        }
        self.spin_lock_give(l.0);
    }

    /// Takes a spin lock without touching the IRQL (the caller is where it must be): deadlock detection first.
    /// The interrupt spin lock is one of these.
    pub(crate) fn spin_lock_take(&self, l: u64) {
        let obj = self.must_lock(l);
        let r = self.before_acquire(&obj);
        self.ok(r);
        self.block_acquire(&obj, false, true);
    }

    pub(crate) fn spin_lock_give(&self, l: u64) {
        let obj = self.must_lock(l);
        let r = self.before_release(&obj);
        self.ok(r);
        self.block_release(&obj);
    }

    /// Waits until nobody holds the lock, without taking part in the lock order: IoDisconnectInterruptEx waiting
    /// for an ISR that is running.
    pub(crate) fn spin_lock_wait_free(&self, l: u64) {
        let obj = self.must_lock(l);
        self.block_acquire(&obj, false, true);
        self.block_release(&obj);
    }

    pub(crate) fn raise_irql(&self, new: KIRQL) -> KIRQL {
        let irql = self.irql();
        if self.checks(VerifierFlags::IRQL_CHECKING) && (new < irql || new > HIGH_LEVEL) {
            self.violation(Bugcheck::c4(c4::RAISE_IRQL_INVALID, irql as u64, new as u64, 0));
        }
        self.set_irql(new);
        irql
    }

    pub(crate) fn lower_irql(&self, new: KIRQL) {
        let irql = self.irql();
        if self.checks(VerifierFlags::IRQL_CHECKING) && (new > irql || new > HIGH_LEVEL) {
            self.violation(Bugcheck::c4(c4::LOWER_IRQL_INVALID, irql as u64, new as u64, 0));
        }
        self.set_irql(new);
    }

    pub(crate) fn enter_critical_region(&self) {
        let irql = self.irql();
        if self.checks(VerifierFlags::IRQL_CHECKING) && irql > APC_LEVEL {
            self.violation(Bugcheck::c4(c4::ENTER_CRITICAL_REGION_ABOVE_APC, irql as u64, 0, 0));
        }
        self.with_thread(|t| t.apc_disable += 1);
    }

    pub(crate) fn leave_critical_region(&self) {
        let (irql, count) = self.with_thread(|t| (t.irql, t.apc_disable));
        if self.checks(VerifierFlags::IRQL_CHECKING) && irql > APC_LEVEL {
            self.violation(Bugcheck::c4(c4::LEAVE_CRITICAL_REGION_ABOVE_APC, irql as u64, 0, 0));
        }
        if count == 0 && self.verifier().enabled() {
            self.violation(Bugcheck::c4(c4::LEAVE_CRITICAL_REGION_NOT_IN_ONE, 0, 0, 0));
        }
        self.with_thread(|t| t.apc_disable = t.apc_disable.saturating_sub(1));
    }
}
