//! Each worker's guest for its next run, from the snapshot: the one its last run left clean (guest_reuse.rs), one
//! loaded ahead (load_ahead.rs), or one started when the run takes it. One slot per worker thread.

use std::cell::{Cell, RefCell};
use std::path::PathBuf;

use crate::guest_reuse::ReadyGuest;
use crate::load_ahead::{GuestHome, Loading, WarmGuest};
use crate::snapshot::Snapshot;

/// A worker's guest for its next run: one loading, or one that served a run already.
enum Ahead {
    Loading(WarmGuest),
    Ready(ReadyGuest),
}

/// What a run gets: a guest still loading (or loaded, paused), or one that served a run and waits for the next.
pub enum Taken {
    Loading(Loading, GuestHome),
    Ready(ReadyGuest),
}

thread_local! {
    /// This worker's guest for its next run.
    static NEXT: RefCell<Option<Ahead>> = const { RefCell::new(None) };
    /// Whether this worker may have another run after the current one (set by the suite loop; off elsewhere, so a
    /// lone `execute` never leaves a loaded guest behind).
    static MORE: Cell<bool> = const { Cell::new(false) };
}

/// Tells this worker's next `load_next` whether a run may follow the one it is about to start. A guest already
/// loaded ahead is for that run and stays; the worker's end (`discard`) drops one no run took.
pub fn expect_more_runs(more: bool) {
    MORE.with(|m| m.set(more));
}

/// True if this worker may have another run after its current one.
pub fn more_runs_expected() -> bool {
    MORE.with(Cell::get)
}

/// The guest for this worker's run: the one that served its last run, the one loaded ahead for `snapshot`, or one
/// started now.
pub fn take(snapshot: &Snapshot) -> std::io::Result<Taken> {
    let taken = |warm: WarmGuest| Taken::Loading(warm.loading, warm.home);
    match NEXT.with(|n| n.borrow_mut().take()) {
        Some(Ahead::Ready(ready)) if ready.home.is_of(snapshot) => Ok(Taken::Ready(ready)),
        Some(Ahead::Loading(warm)) if warm.home.is_of(snapshot) => Ok(taken(warm)),
        _ => WarmGuest::start(snapshot).map(taken),
    }
}

/// The guest this worker keeps for its next run, if it keeps one: its QEMU's pid and its work dir (for the soak,
/// which must tell it from a leftover).
pub fn kept_guest() -> Option<(u32, PathBuf)> {
    NEXT.with(|n| match &*n.borrow() {
        Some(Ahead::Ready(ready)) => Some((ready.loaded.qemu.pid(), ready.home.work.path().to_path_buf())),
        _ => None,
    })
}

/// Keeps a guest that served a run for this worker's next one (dropped, QEMU killed and reaped, if none comes).
pub fn keep(ready: ReadyGuest) {
    NEXT.with(|n| *n.borrow_mut() = Some(Ahead::Ready(ready)));
}

/// Starts loading this worker's next guest while its current run goes on. A failure only means the next run
/// starts its QEMU itself.
pub fn load_next(snapshot: &Snapshot) {
    if !MORE.with(Cell::get) || !snapshot.usable() {
        return;
    }
    if let Ok(warm) = WarmGuest::start(snapshot) {
        NEXT.with(|n| *n.borrow_mut() = Some(Ahead::Loading(warm)));
    }
}

/// Drops this worker's guest loaded ahead, if any (the worker has no run left for it).
pub fn discard() {
    NEXT.with(|n| n.borrow_mut().take());
}
