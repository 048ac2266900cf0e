//! The vhost-user transport, spoken directly: message framing, the front-end request dispatcher, and the backend
//! channel used for IOTLB misses. The `vhost` crate contributes request codes and feature bits only.

pub mod backend;
pub mod connection;
pub mod framing;
pub mod wire;
