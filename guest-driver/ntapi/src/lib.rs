//! The NT kernel interface the vhca driver core is written against, with Windows' names, types and IRQL rules.
//! Two implementations: `vhca-ntmodel` (user space, with a Driver Verifier model) and, later, a WDK shim.
#![no_std]
#![allow(non_camel_case_types, non_snake_case)]

extern crate alloc;

mod bugcheck_codes;
mod kernel;
pub mod resource_list_layout;
mod types;

pub use bugcheck_codes::*;
pub use kernel::NtKernel;
pub use types::*;
