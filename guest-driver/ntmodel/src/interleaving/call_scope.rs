//! Where the kernel call running on a thread came from, as points and racing accesses name it: the innermost
//! kernel routine's caller (kernel.rs enters a scope per routine), or a site the PE loader named.
//!
//! Apart from the low-resources simulation's entry, which keeps the outermost native entry on purpose (its sites
//! must not change when the model calls itself): a race report wants the innermost caller, the driver's line.

use std::cell::Cell;
use std::panic::Location;

use crate::low_resources::{current_site_label, site_is_named};

thread_local! {
    static INNERMOST: Cell<Option<&'static Location<'static>>> = const { Cell::new(None) };
}

/// A kernel routine's scope: its caller is the thread's current site until the scope ends (or a bugcheck unwinds
/// through it), when the outer routine's is back.
pub(crate) struct CallScope {
    previous: Option<&'static Location<'static>>,
}

impl Drop for CallScope {
    fn drop(&mut self) {
        INNERMOST.with(|c| c.set(self.previous));
    }
}

pub(crate) fn enter(caller: &'static Location<'static>) -> CallScope {
    CallScope { previous: INNERMOST.with(|c| c.replace(Some(caller))) }
}

/// The calling thread's current site, or empty when it is in no kernel call.
pub(crate) fn current_site() -> String {
    if site_is_named() {
        return current_site_label().unwrap_or_default();
    }
    match INNERMOST.with(|c| c.get()) {
        Some(location) => format!("{}:{}:{}", location.file(), location.line(), location.column()),
        None => current_site_label().unwrap_or_default(),
    }
}
