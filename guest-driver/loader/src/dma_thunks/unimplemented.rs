//! The DMA_OPERATIONS slots the loader does not implement: never NULL (a driver calling one would jump to 0), each a
//! routine that logs its name and fails the way its return type can: STATUS_NOT_SUPPORTED, NULL, FALSE, 0, nothing.
#![allow(non_snake_case)] // Thunks carry the names of the routines they stand in for.

use std::ffi::c_void;

use windows_sys::Win32::Foundation::{NTSTATUS, STATUS_NOT_SUPPORTED};

fn refused(name: &str, returned: &str) {
    println!("VHCA-LOADER: DMA_OPERATIONS.{name} is not implemented by the loader; it returned {returned}");
}

/// One stand-in per slot. Each takes no parameters: under the Windows x64 convention the caller passes the first
/// four in registers and the rest on its own stack, which it also cleans, so a callee that reads none of them
/// returns to a caller whose frame is as it left it.
macro_rules! stand_ins {
    ($($name:ident => $kind:tt),* $(,)?) => {$(
        stand_ins!(@one $name $kind);
    )*
        /// Every stand-in with its slot's name, for the table and its test.
        pub(super) fn all() -> Vec<(&'static str, usize)> {
            vec![$((stringify!($name), $name as *const () as usize)),*]
        }
    };
    (@one $name:ident status) => {
        pub(super) unsafe extern "win64" fn $name() -> NTSTATUS {
            refused(stringify!($name), "STATUS_NOT_SUPPORTED");
            STATUS_NOT_SUPPORTED
        }
    };
    (@one $name:ident null) => {
        pub(super) unsafe extern "win64" fn $name() -> *mut c_void {
            refused(stringify!($name), "NULL");
            std::ptr::null_mut()
        }
    };
    (@one $name:ident false) => {
        pub(super) unsafe extern "win64" fn $name() -> u8 {
            refused(stringify!($name), "FALSE");
            0
        }
    };
    (@one $name:ident zero) => {
        pub(super) unsafe extern "win64" fn $name() -> u32 {
            refused(stringify!($name), "0");
            0
        }
    };
    (@one $name:ident nothing) => {
        pub(super) unsafe extern "win64" fn $name() {
            refused(stringify!($name), "nothing (a VOID routine)");
        }
    };
}

stand_ins! {
    ReadDmaCounter => zero,
    BuildMdlFromScatterGatherList => status,
    AllocateAdapterChannelEx => status,
    ConfigureAdapterChannel => status,
    CancelAdapterChannel => false,
    MapTransferEx => status,
    FlushAdapterBuffersEx => status,
    FreeAdapterObject => nothing,
    CancelMappedTransfer => status,
    AllocateDomainCommonBuffer => status,
    FlushDmaBuffer => status,
    JoinDmaDomain => status,
    LeaveDmaDomain => status,
    GetDmaDomain => null,
    AllocateCommonBufferWithBounds => null,
    AllocateCommonBufferVector => status,
    GetCommonBufferFromVectorByIndex => nothing,
    FreeCommonBufferFromVector => nothing,
    FreeCommonBufferVector => nothing,
}
