//! The interrupt connections a driver made with IoConnectInterruptEx, by the ConnectionContext it was handed (the
//! IO_INTERRUPT_MESSAGE_INFO's address, or the line's PKINTERRUPT), which is what IoDisconnectInterruptEx gets back.

use std::collections::HashMap;
use std::sync::Mutex;

use vhca_ntapi::INTERRUPT_CONNECTION;

/// One connection: the model's, and the IO_INTERRUPT_MESSAGE_INFO the loader wrote for the driver (None for a
/// line-based one), kept until the disconnect, as Windows keeps its table until then.
pub struct Connection {
    pub model: INTERRUPT_CONNECTION,
    pub message_table: Option<Box<[u64]>>,
}

#[derive(Default)]
pub struct InterruptConnections {
    by_context: Mutex<HashMap<usize, Connection>>,
}

impl InterruptConnections {
    pub fn insert(&self, context: usize, connection: Connection) {
        crate::lock(&self.by_context).insert(context, connection);
    }

    /// Ends the connection made under `context`, giving it back (None: the driver never got that context).
    pub fn remove(&self, context: usize) -> Option<Connection> {
        crate::lock(&self.by_context).remove(&context)
    }
}
