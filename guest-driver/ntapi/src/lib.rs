//! The NT kernel interface the vhca driver core is written against, with Windows' names, types and IRQL rules.
//! Two implementations: `vhca-ntmodel` (user space, with a Driver Verifier model) and the WDK shim of vhca-sys.
#![no_std]
#![allow(non_camel_case_types, non_snake_case)]

extern crate alloc;

mod bugcheck_codes;
mod kernel;
mod pool_flags;
pub mod resource_list_layout;
// Before async_kernel: its pointer types come from types' opaque_pointer! macro.
#[macro_use]
mod types;
mod async_kernel;

pub use async_kernel::*;
pub use bugcheck_codes::*;
pub use kernel::NtKernel;
pub use pool_flags::*;
pub use types::*;
