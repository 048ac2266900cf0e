//! vhca.sys: the vhca driver core (vhca-driver-core) and the shared virtio transport (vhca-virtio) as a PnP WDM driver.
//! The portable half (scenario choice, result line, BAR and interrupt resources) builds and is tested everywhere; the
//! kernel half (everything that calls ntoskrnl.exe or HAL.dll) only for target_os = "windows".
#![cfg_attr(not(test), no_std)]
#![allow(non_snake_case)]

extern crate alloc;

pub mod bar_resources;
pub mod interrupt_resources;
pub mod result_line;
pub mod scenario_choice;
pub mod scenario_run;

#[cfg(target_os = "windows")]
mod kernel;
#[cfg(target_os = "windows")]
pub use kernel::driver_entry;
