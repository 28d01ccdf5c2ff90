//! The worker's mode and the lame-duck drain.
//!
//! A worker is `Active` (consuming), `Ejected` (outlier cool-down: alive, not consuming, comes
//! back) or `Draining` (lame duck: alive, not consuming, finishing its running tasks, then
//! gone). Draining is final. It starts on SIGTERM/SIGINT (the `shutdown` token of
//! [`crate::Worker::run`]), on `POST /drain`, or when the worker sees its state set to
//! `draining` in Redis (`POST /v1/workers/{id}/drain` on the scheduler).
//!
//! Drain order: state `draining` in Redis at once (its capacity leaves the group, so the
//! scheduler stops routing to it) → consumers cancelled (the broker stops delivering; a
//! delivery already on the wire is nacked back) → running tasks get `drain_grace_ms` to finish
//! → ledger flushed, deregistered, exit 0. Past the grace, or on a second signal, the AMQP
//! connection is closed instead: the broker requeues every unacknowledged task for another
//! worker (at-least-once), and the exit code is 1.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// What the worker is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Active,
    Ejected,
    Draining,
}

impl Mode {
    pub fn state(self) -> fleet::registry::WorkerState {
        use fleet::registry::WorkerState;
        match self {
            Mode::Active => WorkerState::Active,
            Mode::Ejected => WorkerState::Ejected,
            Mode::Draining => WorkerState::Draining,
        }
    }
}

/// The mode, shared by every loop. Cheap to clone.
#[derive(Clone)]
pub struct Control {
    inner: Arc<Inner>,
}

struct Inner {
    mode: watch::Sender<Mode>,
    draining: CancellationToken,
    force: CancellationToken,
    drain_reason: Mutex<Option<String>>,
    fatal: Mutex<Option<String>>,
}

impl Control {
    /// `force` ends a drain at once (second signal).
    pub fn new(force: CancellationToken) -> Self {
        Control {
            inner: Arc::new(Inner {
                mode: watch::Sender::new(Mode::Active),
                draining: CancellationToken::new(),
                force,
                drain_reason: Mutex::new(None),
                fatal: Mutex::new(None),
            }),
        }
    }

    pub fn mode(&self) -> Mode {
        *self.inner.mode.borrow()
    }

    /// A receiver of mode changes.
    pub fn watch(&self) -> watch::Receiver<Mode> {
        self.inner.mode.subscribe()
    }

    /// Active → Ejected; false in any other mode.
    pub fn eject(&self) -> bool {
        self.transition(Mode::Active, Mode::Ejected)
    }

    /// Ejected → Active; false in any other mode.
    pub fn reactivate(&self) -> bool {
        self.transition(Mode::Ejected, Mode::Active)
    }

    fn transition(&self, from: Mode, to: Mode) -> bool {
        self.inner.mode.send_if_modified(|m| {
            if *m == from {
                *m = to;
                true
            } else {
                false
            }
        })
    }

    /// Starts draining (idempotent: the first reason is kept and logged).
    pub fn request_drain(&self, reason: &str) {
        if let Ok(mut r) = self.inner.drain_reason.lock() {
            if r.is_none() {
                tracing::info!(reason, "draining: taking no new tasks");
                *r = Some(reason.to_string());
            }
        }
        self.inner.mode.send_if_modified(|m| {
            let changed = *m != Mode::Draining;
            *m = Mode::Draining;
            changed
        });
        self.inner.draining.cancel();
    }

    /// Ends the worker with an error: drains and makes `run` fail.
    pub fn fail(&self, reason: impl Into<String>) {
        let reason = reason.into();
        tracing::error!(reason = %reason, "fatal: shutting down");
        if let Ok(mut f) = self.inner.fatal.lock() {
            f.get_or_insert(reason.clone());
        }
        self.request_drain(&reason);
    }

    pub fn fatal(&self) -> Option<String> {
        self.inner.fatal.lock().ok().and_then(|f| f.clone())
    }

    pub fn is_draining(&self) -> bool {
        self.inner.draining.is_cancelled()
    }

    /// Resolves when draining starts. Cancel safe.
    pub async fn draining(&self) {
        self.inner.draining.cancelled().await
    }

    /// Cancelled when the drain must end now.
    pub fn force(&self) -> &CancellationToken {
        &self.inner.force
    }
}

/// How waiting for running tasks ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// Every task finished within the grace.
    Clean,
    /// The grace ran out.
    GraceExceeded,
    /// A second signal (or a hard stop) cut the wait.
    Forced,
}

/// Waits for the tracked tasks to finish, at most `grace`, or until `force` fires. Closes the
/// tracker (no new task may be awaited after this); cancel safe.
pub async fn wait_for_tasks(tasks: &TaskTracker, grace: Duration, force: &CancellationToken) -> Finish {
    tasks.close();
    if tasks.is_empty() {
        return Finish::Clean;
    }
    tracing::info!(grace_ms = grace.as_millis() as u64, "waiting for running tasks to finish");
    tokio::select! {
        biased;
        _ = force.cancelled() => Finish::Forced,
        _ = tasks.wait() => Finish::Clean,
        _ = tokio::time::sleep(grace) => Finish::GraceExceeded,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transitions() {
        let c = Control::new(CancellationToken::new());
        assert!(!c.reactivate());
        assert!(c.eject());
        assert!(!c.eject());
        assert_eq!(c.mode(), Mode::Ejected);
        assert!(c.reactivate());
        c.request_drain("test");
        assert!(c.is_draining());
        assert!(!c.eject(), "draining is final");
        assert_eq!(c.mode(), Mode::Draining);
        c.fail("boom");
        assert_eq!(c.fatal().as_deref(), Some("boom"));
    }

    #[tokio::test(start_paused = true)]
    async fn grace_bounds_the_wait() {
        let tasks = TaskTracker::new();
        let force = CancellationToken::new();
        tasks.spawn(tokio::time::sleep(Duration::from_secs(5)));
        assert_eq!(wait_for_tasks(&tasks, Duration::from_secs(1), &force).await, Finish::GraceExceeded);
        assert_eq!(wait_for_tasks(&tasks, Duration::from_secs(10), &force).await, Finish::Clean);
        tasks.reopen();
        tasks.spawn(tokio::time::sleep(Duration::from_secs(5)));
        force.cancel();
        assert_eq!(wait_for_tasks(&tasks, Duration::from_secs(10), &force).await, Finish::Forced);
    }
}
