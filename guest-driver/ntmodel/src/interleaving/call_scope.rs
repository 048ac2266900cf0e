//! Where the kernel call running on a thread came from, as points and racing accesses name it: the innermost
//! kernel routine's caller (kernel.rs enters a scope per routine), or a site the PE loader named.
//!
//! Apart from the low-resources simulation's entry, which keeps the outermost native entry on purpose (its sites
//! must not change when the model calls itself): a race report wants the innermost caller, the driver's line.

use std::cell::{Cell, RefCell};
use std::panic::Location;

use crate::low_resources::{current_site_label, site_is_named};

thread_local! {
    static INNERMOST: Cell<Option<&'static Location<'static>>> = const { Cell::new(None) };
    /// A site the caller named for what it is about to do outside any kernel call (a driver binary's own load or
    /// store, which the loader traps): it wins over every other while it is set.
    static LABEL: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Runs `f` with `site` as the calling thread's current site, whatever kernel call it may be inside (a DPC or ISR
/// the model called back from one): the binary's instruction is where the access is, not the call around it.
pub(crate) fn with_label<T>(site: &str, f: impl FnOnce() -> T) -> T {
    struct Restore(Option<String>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let previous = self.0.take();
            LABEL.with(|l| *l.borrow_mut() = previous);
        }
    }
    let _restore = Restore(LABEL.with(|l| l.borrow_mut().replace(site.to_string())));
    f()
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
    if let Some(label) = LABEL.with(|l| l.borrow().clone()) {
        return label;
    }
    if site_is_named() {
        return current_site_label().unwrap_or_default();
    }
    match INNERMOST.with(|c| c.get()) {
        Some(location) => format!("{}:{}:{}", location.file(), location.line(), location.column()),
        None => current_site_label().unwrap_or_default(),
    }
}
