//! vhca-loader: runs the signed Windows driver binary (vhca.sys) in a Linux process. The image is read and checked
//! (`pe_image`), mapped with Windows' section protections and relocated (`image_mapping`), its ntoskrnl.exe/HAL.dll
//! imports bound to `extern "win64"` thunks over the NT model and its verifier (`nt_thunks` and one `*_thunks` file
//! per family, each reaching `kernel_context` and through it its family's `*_table`), and driven through a WDM
//! driver's PnP life on Windows-layout objects (`io_manager`, `irp_dispatch`, `pnp_life`); a fault in driver code is
//! a bugcheck (`driver_fault`), except a `mov` to or from CR8, the IRQL, which is emulated over the model
//! (`privileged_instructions`, `cr8_emulation`); GS points at a per-thread KPCR (`processor_block`).

pub mod address_space;
pub mod cr8_emulation;
pub mod csq_thunks;
pub mod debug_log;
pub mod device_interface_thunks;
pub mod device_interfaces;
pub mod dispatcher_thunks;
pub mod dma_table;
pub mod dma_thunks;
pub mod dpc_thunks;
pub mod driver_fault;
pub mod driver_stack;
pub mod driver_symbols;
pub mod image_mapping;
pub mod interrupt_table;
pub mod interrupt_thunks;
pub mod io_manager;
pub mod io_verification;
pub mod irp_cancel;
mod irp_dispatch;
pub mod kernel_context;
pub mod load_error;
mod loaded_images;
pub mod lock_table;
pub mod lock_thunks;
pub mod mdl_table;
pub mod memory_thunks;
pub mod nt_thunks;
pub mod object_table;
pub mod pageable_pool;
pub mod pe_image;
pub mod pnp_life;
pub mod pnp_sequence;
pub mod power_life;
pub mod privileged_instructions;
pub mod processor_block;
pub mod processor_thunks;
pub mod race_watch;
mod register_saving;
pub mod registry_table;
pub mod registry_thunks;
pub mod remove_lock_table;
pub mod remove_lock_thunks;
pub mod seh;
pub mod special_pool;
pub mod start_resources;
pub mod timer_thunks;
pub mod unbound_import_trap;
pub mod user_process;
pub mod user_requests;
pub mod work_item_thunks;

use std::sync::{Mutex, MutexGuard};

pub use image_mapping::{ImportResolver, MappedImage};
pub use load_error::LoadError;
pub use pe_image::PeImage;
/// The Windows-layout types the loader's callers (the guest's bus driver) fill in, from the same definitions.
pub use windows_sys;

/// Exit status of `vhca-load` when the driver called an import bound to a trap (`--trap-unbound`).
pub const EXIT_UNBOUND_IMPORT: i32 = 3;

/// Locks a loader table; a panic elsewhere never leaves one half-updated (each update is one statement).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Reads, checks and maps a driver image, binding its imports through `resolver`.
pub fn load(bytes: &[u8], resolver: &dyn ImportResolver) -> Result<MappedImage, LoadError> {
    let image = PeImage::parse(bytes)?;
    MappedImage::map(image, bytes, resolver)
}
