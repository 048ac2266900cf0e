//! Structured exception handling for the driver image, as Windows x64 does it: an exception raised into the driver
//! (by a thunk or a fault in its code) is dispatched through the image's .pdata/.xdata to its language handlers.
//! `unwind_info` reads the tables, `virtual_unwind` steps one frame, `frame_walk` finds a PC's image and function,
//! `dispatch` is RtlDispatchException and RtlUnwindEx, `c_specific_handler` the C scope-table handler, `raise`
//! where exceptions start and `resume` where the driver continues.

pub mod c_specific_handler;
pub mod context_record;
pub mod dispatch;
pub mod frame_walk;
pub mod raise;
mod resume;
pub mod unwind_info;
pub mod virtual_unwind;
