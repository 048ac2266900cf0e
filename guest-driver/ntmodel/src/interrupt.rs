//! Interrupt objects: IoConnectInterruptEx (CONNECT_MESSAGE_BASED, with its line-based fallback) and
//! IoDisconnectInterruptEx; a device's interrupt delivered from outside (the platform); the ISR at its DIRQL under the
//! interrupt spin lock; KeSynchronizeExecution and the interrupt spin lock routines.

use std::collections::HashMap;
use std::sync::Mutex;

use vhca_ntapi::*;

use crate::bugcheck::Bugcheck;
use crate::interleaving::{PointKind, SyncObject};
use crate::locks::LockKind;
use crate::verifier::{c4, VerifierFlags};
use crate::{lock, NtModel};

/// What the PnP manager gave a device (its START_DEVICE resources): messages, as its MSI or MSI-X capability was
/// granted, or one line-based interrupt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InterruptResources {
    Messages(u32),
    Line,
}

/// The DIRQL of every message and of the line interrupt: the model's choice, above DISPATCH_LEVEL and below the
/// clock's.
pub const DEVICE_DIRQL: KIRQL = 5;
/// Message n's vector is 0x50 + n (the model's numbering).
const VECTOR_BASE: u32 = 0x50;
/// Where a message is written: x86's interrupt window (the local APICs).
const MESSAGE_ADDRESS: u64 = 0xFEE0_0000;

#[derive(Clone)]
enum Service {
    Message(PKMESSAGE_SERVICE_ROUTINE),
    Line(PKSERVICE_ROUTINE),
}

#[derive(Clone)]
struct Connection {
    /// One KINTERRUPT per message, or the line's one.
    objects: Vec<u64>,
    service: Service,
    /// The ISR's stand-in address in the driver's image, for bugcheck parameters.
    service_address: u64,
    spin_lock: u64,
    /// The ISR's IRQL, the interrupt spin lock's and KeSynchronizeExecution's (the UnifiedIrql).
    irql: KIRQL,
}

#[derive(Default)]
struct InterruptState {
    resources: HashMap<PDEVICE_OBJECT, InterruptResources>,
    connections: HashMap<PDEVICE_OBJECT, Connection>,
    by_object: HashMap<u64, PDEVICE_OBJECT>,
}

#[derive(Default)]
pub(crate) struct Interrupts {
    state: Mutex<InterruptState>,
}

impl NtModel {
    /// The PnP manager's part: the interrupt resources `device` starts with. The program that sees the device (the
    /// guest over VFIO, a test) says what it has before the driver connects.
    pub fn assign_interrupts(&self, device: PDEVICE_OBJECT, resources: InterruptResources) {
        lock(&self.interrupts.state).resources.insert(device, resources);
    }

    /// IoConnectInterruptEx, CONNECT_MESSAGE_BASED. Where Microsoft is silent the model assumes: a device with only
    /// a line-based interrupt and no fallback routine is STATUS_INVALID_DEVICE_REQUEST, as is a second connection
    /// for a device already connected.
    pub(crate) fn interrupt_connect(
        &self,
        p: IO_CONNECT_INTERRUPT_MESSAGE_BASED_PARAMETERS,
    ) -> Result<INTERRUPT_CONNECTION, NTSTATUS> {
        self.irql_at_most(PASSIVE_LEVEL);
        let device = p.PhysicalDeviceObject;
        if device.is_null() {
            return Err(STATUS_INVALID_PARAMETER);
        }
        let (resources, connected) = {
            let st = lock(&self.interrupts.state);
            (st.resources.get(&device).copied(), st.connections.contains_key(&device))
        };
        let service = match (resources, p.FallBackServiceRoutine) {
            (None | Some(InterruptResources::Messages(0)), _) => return Err(STATUS_NOT_FOUND),
            (Some(InterruptResources::Messages(_)), _) => Service::Message(p.MessageServiceRoutine),
            (Some(InterruptResources::Line), Some(fallback)) => Service::Line(fallback),
            (Some(InterruptResources::Line), None) => return Err(STATUS_INVALID_DEVICE_REQUEST),
        };
        if connected {
            return Err(STATUS_INVALID_DEVICE_REQUEST);
        }
        let count = match resources {
            Some(InterruptResources::Messages(n)) => n,
            _ => 1,
        };
        let spin_lock = if p.SpinLock.is_null() { self.new_lock(LockKind::SpinLock) } else { p.SpinLock.0 };
        let irql = DEVICE_DIRQL.max(p.SynchronizeIrql);
        let objects: Vec<u64> = (0..count).map(|_| self.new_object()).collect();
        let connection = match service {
            Service::Line(_) => INTERRUPT_CONNECTION::LineBased(PKINTERRUPT(objects[0])),
            Service::Message(_) => INTERRUPT_CONNECTION::MessageBased(IO_INTERRUPT_MESSAGE_INFO {
                UnifiedIrql: irql,
                MessageInfo: (0u32..)
                    .zip(&objects)
                    .map(|(n, object)| IO_INTERRUPT_MESSAGE_INFO_ENTRY {
                        MessageAddress: PHYSICAL_ADDRESS(MESSAGE_ADDRESS),
                        TargetProcessorSet: 1 << self.message_processor(n),
                        InterruptObject: PKINTERRUPT(*object),
                        MessageData: VECTOR_BASE + n,
                        Vector: VECTOR_BASE + n,
                        Irql: DEVICE_DIRQL,
                        // Messages are edge-triggered.
                        Mode: KINTERRUPT_MODE::Latched,
                        Polarity: KINTERRUPT_POLARITY::InterruptPolarityUnknown,
                    })
                    .collect(),
            }),
        };
        let service_address = self.new_routine_address();
        let mut st = lock(&self.interrupts.state);
        // Another thread may have connected the device since the look above.
        if st.connections.contains_key(&device) {
            return Err(STATUS_INVALID_DEVICE_REQUEST);
        }
        for object in &objects {
            st.by_object.insert(*object, device);
        }
        st.connections.insert(device, Connection { objects, service, service_address, spin_lock, irql });
        Ok(connection)
    }

    /// IoDisconnectInterruptEx: after it returns no ISR of the connection runs, nor is one still running.
    pub(crate) fn interrupt_disconnect(&self, connection: &INTERRUPT_CONNECTION) {
        self.irql_at_most(PASSIVE_LEVEL);
        let object = connection.InterruptObject().0;
        let gone = {
            let mut st = lock(&self.interrupts.state);
            let device = st.by_object.get(&object).copied();
            let gone = device.and_then(|d| st.connections.remove(&d));
            for o in gone.iter().flat_map(|c| &c.objects) {
                st.by_object.remove(o);
            }
            gone
        };
        if let Some(c) = gone {
            self.spin_lock_wait_free(c.spin_lock);
        }
    }

    fn connection_of(&self, interrupt: PKINTERRUPT) -> Connection {
        let c = {
            let st = lock(&self.interrupts.state);
            st.by_object.get(&interrupt.0).and_then(|d| st.connections.get(d)).cloned()
        };
        c.unwrap_or_else(|| self.never_initialised(interrupt.0))
    }

    fn still_connected(&self, device: PDEVICE_OBJECT, object: u64) -> bool {
        lock(&self.interrupts.state).connections.get(&device).is_some_and(|c| c.objects.contains(&object))
    }

    /// The processor message `message_id` comes to: message_id % N. The model's assumption: Windows spreads a
    /// device's MSI-X messages over the processors by default (the interrupt affinity policy
    /// IrqPolicyMachineDefault leaves the choice to the system), and a fixed spread keeps a run reproducible.
    pub fn message_processor(&self, message_id: u32) -> u32 {
        message_id % self.processor_count()
    }

    /// The platform delivers message `message_id` of `device` (0 for a line-based interrupt): the calling thread
    /// (the platform's interrupt thread) runs on the message's processor (`message_processor`), and the ISR runs
    /// there at the connection's IRQL with the interrupt spin lock held, in a context of its own, interrupting
    /// whatever that processor runs below the ISR's IRQL (and waiting while it runs at or above it: masked); then,
    /// the IRQL back below DISPATCH_LEVEL, the DPCs it queued run on that processor. FALSE when nothing is
    /// connected for it or the ISR said its device did not interrupt. The caller is a platform thread below
    /// DISPATCH_LEVEL, never the driver's own.
    pub fn deliver(&self, device: PDEVICE_OBJECT, message_id: u32) -> bool {
        let cpu = self.message_processor(message_id);
        // The platform's interrupt thread is busy only while it delivers: between messages it sleeps on the
        // device's eventfd, where a paused thread must not wait for it (nor count points of others as contended).
        self.active();
        let claimed = self.run_on_processor(cpu, || self.deliver_here(device, message_id));
        self.quiescent();
        claimed
    }

    fn deliver_here(&self, device: PDEVICE_OBJECT, message_id: u32) -> bool {
        let connection = lock(&self.interrupts.state).connections.get(&device).cloned();
        let Some(c) = connection else { return false };
        let object = match c.service {
            Service::Message(_) => match c.objects.get(message_id as usize) {
                Some(o) => *o,
                None => return false,
            },
            Service::Line(_) => c.objects[0],
        };
        self.before_unloaded_routine(c.service_address, c.irql);
        // Whatever the platform's thread saw of the device being told to act comes before the ISR.
        self.hb_acquire(SyncObject::Device(device.0));
        self.point(PointKind::IsrStart(message_id));
        let interrupting = self.interrupt_processor(self.current_processor(), c.irql);
        let claimed = self.in_borrowed_context(c.irql, || {
            let r = self.interrupt_deadlock_check(c.spin_lock);
            self.ok(r);
            self.spin_lock_take(c.spin_lock);
            // Disconnected while this waited for the lock: the ISR is gone.
            if !self.still_connected(device, object) {
                self.spin_lock_give(c.spin_lock);
                return false;
            }
            let (claimed, started) = self.timed_routine(|| match &c.service {
                Service::Message(isr) => isr(PKINTERRUPT(object), message_id),
                Service::Line(isr) => isr(PKINTERRUPT(object)),
            });
            let after = self.irql();
            if self.checks(VerifierFlags::IRQL_CHECKING) && after != c.irql {
                self.violation(Bugcheck::c4(c4::ISR_CHANGED_IRQL, c.service_address, c.irql as u64, after as u64));
            }
            self.with_thread(|t| t.irql = c.irql);
            self.spin_lock_give(c.spin_lock);
            let r = self.routine_overran(started);
            self.ok(r);
            claimed
        });
        drop(interrupting);
        if self.irql() < DISPATCH_LEVEL {
            self.run_queued_dpcs();
        }
        claimed
    }

    /// Raises to the connection's IRQL (0xC4/0xE5 under IRQL checking when the caller is above it: the model's
    /// reading, Microsoft names no code) and takes the interrupt spin lock; returns the IRQL to go back to.
    fn interrupt_lock_enter(&self, c: &Connection) -> KIRQL {
        let old = self.irql();
        if self.checks(VerifierFlags::IRQL_CHECKING) && old > c.irql {
            self.violation(Bugcheck::c4(c4::KERNEL_API_WRONG_IRQL, old as u64, 0, 0));
        }
        if old < c.irql {
            self.set_irql(c.irql);
        }
        self.spin_lock_take(c.spin_lock);
        old
    }

    pub(crate) fn interrupt_synchronize(&self, interrupt: PKINTERRUPT, routine: &mut dyn FnMut() -> bool) -> bool {
        let c = self.connection_of(interrupt);
        let old = self.interrupt_lock_enter(&c);
        let r = routine();
        self.spin_lock_give(c.spin_lock);
        self.set_irql(old);
        r
    }

    pub(crate) fn interrupt_lock_acquire(&self, interrupt: PKINTERRUPT) -> KIRQL {
        let c = self.connection_of(interrupt);
        self.interrupt_lock_enter(&c)
    }

    /// KeReleaseInterruptSpinLock: at the connection's IRQL (0xC4/0xE5 under IRQL checking otherwise, assumed).
    pub(crate) fn interrupt_lock_release(&self, interrupt: PKINTERRUPT, old_irql: KIRQL) {
        let c = self.connection_of(interrupt);
        let irql = self.irql();
        if self.checks(VerifierFlags::IRQL_CHECKING) && irql != c.irql {
            self.violation(Bugcheck::c4(c4::KERNEL_API_WRONG_IRQL, irql as u64, 0, 0));
        }
        self.spin_lock_give(c.spin_lock);
        self.set_irql(old_irql);
    }

    /// The ISR of a connection still in place, the lowest device first (for the unload checks).
    pub(crate) fn connected_isr(&self) -> Option<u64> {
        let st = lock(&self.interrupts.state);
        st.connections.iter().min_by_key(|(device, _)| **device).map(|(_, c)| c.service_address)
    }
}
