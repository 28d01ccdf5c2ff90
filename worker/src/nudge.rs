//! Keeps the runtime's timers and I/O turning while a handler blocks its thread.
//!
//! Tokio's multi-thread scheduler has one I/O-and-timer driver, held by whichever idle worker
//! thread parked on it first; the others sleep on a condition variable until new work is
//! pushed. A worker leaving the driver to run tasks hands it to no one: if the task it runs
//! then blocks its thread (an embedder's synchronous handler, not on `spawn_blocking`), no
//! thread turns the driver, so no timer fires — not even the attempt's run deadline, which
//! would cut the handler — until some outside event wakes an idle worker. (Seen in CI: a 500 ms
//! deadline cut only when the 4 s blocking handler returned.)
//!
//! The nudge is that outside event: while any handler runs, a plain OS thread spawns an empty
//! task on the runtime every [`PERIOD`]. A task spawned from outside the runtime is pushed on
//! the shared queue and unparks an idle worker, which runs it, parks again and — the driver
//! being free — parks on the driver, so the deadline timer fires at most one period late.
//! With no handler running the thread only sleeps. It needs an idle worker thread to unpark:
//! on a `current_thread` runtime, or when every worker thread is blocked, a blocking handler
//! is still cut only when it returns.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// How often the nudge wakes an idle worker while handlers run: the most a run deadline can
/// be late when a handler blocks its thread.
pub const PERIOD: Duration = Duration::from_millis(100);

/// Counts running handlers; its thread nudges the runtime while the count is above zero.
/// The thread ends once the last `Arc<Nudge>` is dropped (the worker stopped).
#[derive(Debug, Default)]
pub struct Nudge {
    running: AtomicUsize,
}

/// One running handler: counted from [`Nudge::enter`] until dropped.
#[derive(Debug)]
pub struct Running<'a>(&'a Nudge);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Nudge {
    /// Starts the nudge thread for the current runtime. Outside a runtime, or when the OS
    /// refuses a thread, the nudge counts but never nudges (a warning says so): runs are still
    /// cut on time unless a handler blocks its thread.
    pub fn start() -> Arc<Self> {
        let nudge = Arc::new(Self::default());
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            tracing::warn!("no tokio runtime: blocking handlers are cut only when they return");
            return nudge;
        };
        let weak: Weak<Self> = Arc::downgrade(&nudge);
        let spawned = std::thread::Builder::new()
            .name("fleet-nudge".into())
            .spawn(move || loop {
                std::thread::sleep(PERIOD);
                let Some(n) = weak.upgrade() else { return };
                if n.running.load(Ordering::Relaxed) > 0 {
                    drop(rt.spawn(async {}));
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "no nudge thread: blocking handlers are cut only when they return");
        }
        nudge
    }

    /// Counts a handler as running until the guard is dropped.
    pub fn enter(&self) -> Running<'_> {
        self.running.fetch_add(1, Ordering::Relaxed);
        Running(self)
    }
}
