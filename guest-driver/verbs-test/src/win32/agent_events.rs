//! The `held-write` mode's two named events: the program tells the guest agent its write is in flight, and waits
//! for the agent to say the machine slept and resumed.

use alloc::format;
use alloc::string::String;

use vhca_verbs_test::{wide, IN_FLIGHT_EVENT, RESUMED_EVENT, RESUMED_WAIT_S};
use windows_sys::Win32::Foundation::{CloseHandle, GetLastError, HANDLE, WAIT_OBJECT_0};
use windows_sys::Win32::System::Threading::{CreateEventW, SetEvent, WaitForSingleObject};

/// A manual-reset event of that name, made or opened (the agent makes both before it starts the program).
fn named_event(name: &str) -> Result<HANDLE, String> {
    let wide = wide(name);
    // SAFETY: `wide` is NUL-terminated and outlives the call; no security attributes.
    let event = unsafe { CreateEventW(core::ptr::null(), 1, 0, wide.as_ptr()) };
    if event.is_null() {
        // SAFETY: no preconditions.
        return Err(format!("CreateEventW({name}): error {}", unsafe { GetLastError() }));
    }
    Ok(event)
}

/// Sets IN_FLIGHT_EVENT, then waits up to RESUMED_WAIT_S for RESUMED_EVENT: Ok once the agent set it.
pub fn in_flight_until_resumed() -> Result<(), String> {
    let in_flight = named_event(IN_FLIGHT_EVENT)?;
    let resumed = match named_event(RESUMED_EVENT) {
        Ok(e) => e,
        Err(why) => {
            // SAFETY: the handle named_event returned, closed once.
            unsafe { CloseHandle(in_flight) };
            return Err(why);
        }
    };
    // SAFETY: both are event handles this process holds until the CloseHandle calls below.
    let outcome = unsafe {
        if SetEvent(in_flight) == 0 {
            Err(format!("SetEvent({IN_FLIGHT_EVENT}): error {}", GetLastError()))
        } else if WaitForSingleObject(resumed, RESUMED_WAIT_S * 1000) != WAIT_OBJECT_0 {
            Err(format!("the agent did not set {RESUMED_EVENT} within {RESUMED_WAIT_S} s"))
        } else {
            Ok(())
        }
    };
    // SAFETY: each handle closed once, after its last use.
    unsafe {
        CloseHandle(in_flight);
        CloseHandle(resumed);
    }
    outcome
}
