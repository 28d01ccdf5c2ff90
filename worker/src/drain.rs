//! The worker's mode, its shutdown stages and the lame-duck drain.
//!
//! A worker is `Active` (consuming), `Ejected` (outlier cool-down: alive, not consuming, comes
//! back) or `Draining` (lame duck: alive, not consuming, finishing its running tasks, then
//! gone). Draining is final. It starts on SIGTERM/SIGINT (the `shutdown` token of
//! [`crate::Worker::start`]), on `POST /drain`, when the worker sees its state set to
//! `draining` in Redis (`POST /v1/workers/{id}/drain` on the scheduler), or on a fatal
//! conflict ([`Control::fail`]).
//!
//! Every loop of the worker runs on one of five [`Stages`] ([`fleet::process`]), built in
//! this order and stopped in the reverse one by [`Drain::run`]:
//!
//! ```text
//! stage       loops                                   drain step
//! intake      lane consumers                          1 state `draining` in Redis at once (its
//!                                                       capacity leaves the group: the scheduler
//!                                                       stops routing to it; its subsetting
//!                                                       ordinal is freed: its peers take its
//!                                                       shards within a second); 2 consumers
//!                                                       cancelled (the broker stops delivering; a
//!                                                       delivery already on the wire is nacked back)
//! work        task attempts and handler runs          3 running tasks get `drain_grace_ms`
//! background  heartbeat, ejection, shard watch        4 stopped (a late beat would register again)
//! ledger      batched start/finish writes             5 flushed
//!             —                                       6 deregistered; AMQP connection closed
//! serve       HTTP (`/healthz` to the end), signals   7 stopped; exit 0
//! ```
//!
//! Past the grace, or on a second signal (the `force` token), the AMQP connection is closed
//! instead at step 3: the broker requeues every unacknowledged task for another worker
//! (at-least-once), the work stage is stopped (cutting every run), and the exit code is 1. A
//! fatal conflict skips the state change and the deregistration (the id belongs to another
//! process now) and fails too.
//!
//! Every step that waits on the broker is bounded ([`STEP_LIMIT`]; the consumer cancels and
//! the connection close in `lane` and [`Broker::close`]): a worker told to stop while
//! RabbitMQ does not answer (paused, partitioned, overloaded) still exits, after a warning
//! naming the step — what it could not tell the broker, the broker learns from the closed
//! connection. The ledger's stage is waited for in full: it talks to Redis only, each of its
//! writes is bounded by the store's own timeouts and its last flush by its retry limit, and
//! cutting it short would leave the outcome of an acked task unrecorded. A background loop past
//! its limit (its only unbounded wait, a queue redeclaration after its group was reclaimed,
//! never registers afterwards) is left to end with the process.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use fleet::process::{Shutdown, Stage};
use fleet::redis::Store;
use fleet::registry::WorkerState;

use crate::broker::Broker;
use crate::registry::{set_state_logged, Registrar};
use crate::stats::Stats;

/// How long attempts get to notice a hard stop before the worker returns anyway.
const ABORT_WAIT: Duration = Duration::from_secs(2);

/// The most a drain step that waits on a server (consumer cancels, background loops, the
/// HTTP server) may take before the drain goes on without it.
pub const STEP_LIMIT: Duration = Duration::from_secs(5);

/// What the worker is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Active,
    Ejected,
    Draining,
}

impl Mode {
    pub fn state(self) -> WorkerState {
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

    /// Resolves when draining starts.
    ///
    /// # Cancel safety
    /// Cancel safe: it only waits; dropped, it has changed nothing.
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

/// Waits for the work stage's tasks to finish, at most `grace`, or until `force` fires. Closes
/// the stage (no new task may be awaited after this).
///
/// # Cancel safety
/// Cancel safe: the stage is closed at its first poll and stays closed; dropped after that,
/// only the wait is lost (the tasks run on), and calling it again waits again.
pub async fn wait_for_tasks(work: &Stage, grace: Duration, force: &CancellationToken) -> Finish {
    work.close();
    if work.is_empty() {
        return Finish::Clean;
    }
    tracing::info!(
        grace_ms = grace.as_millis() as u64,
        "waiting for running tasks to finish"
    );
    tokio::select! {
        biased;
        _ = force.cancelled() => Finish::Forced,
        _ = work.wait() => Finish::Clean,
        _ = tokio::time::sleep(grace) => Finish::GraceExceeded,
    }
}

/// The worker's shutdown stages (see the module docs): built `serve` first and `intake` last,
/// so an early stop ([`Shutdown::stop`]) ends them intake first, serve last.
pub struct Stages {
    /// All of them, for an early stop (start-up cut short): last built first.
    pub all: Shutdown,
    pub serve: Stage,
    pub ledger: Stage,
    pub background: Stage,
    pub work: Stage,
    pub intake: Stage,
}

impl Stages {
    pub fn new() -> Self {
        let all = Shutdown::new();
        let serve = all.stage("serve");
        let ledger = all.stage("ledger");
        let background = all.stage("background");
        let work = all.stage("work");
        let intake = all.stage("intake");
        Stages {
            all,
            serve,
            ledger,
            background,
            work,
            intake,
        }
    }
}

impl Default for Stages {
    fn default() -> Self {
        Self::new()
    }
}

/// What the drain sequence stops and tells, built by [`crate::Worker::start`].
pub struct Drain {
    pub control: Control,
    pub stages: Stages,
    pub store: Store,
    pub worker_id: String,
    pub registrar: Registrar,
    pub broker: Arc<Broker>,
    pub stats: Arc<Stats>,
}

impl Drain {
    /// The drain sequence (see the module docs), once a drain was requested. `Ok` after a clean
    /// drain.
    ///
    /// # Errors
    /// As [`crate::Running::drain`]: grace exceeded, forced, or a fatal conflict.
    pub async fn run(self, grace: Duration) -> crate::Result<()> {
        let Drain {
            control,
            stages,
            store,
            worker_id,
            registrar,
            broker,
            stats,
        } = self;
        let fatal = control.fatal();
        if fatal.is_none() {
            set_state_logged(&store, &worker_id, WorkerState::Draining).await;
        }
        // The lanes see the mode change (and the stage's signal), cancel their consumers, end.
        stages.intake.stop_within(STEP_LIMIT).await;
        let finish = wait_for_tasks(&stages.work, grace, control.force()).await;
        let (counts, _) = stats.running();
        let left = counts.normal + counts.critical;
        if finish != Finish::Clean {
            tracing::warn!(
                ?finish,
                running = left,
                "drain cut short: closing the connection, unacked tasks go back to the broker"
            );
            broker.close("drain cut short").await;
            stages.work.cancel();
            let _ = tokio::time::timeout(ABORT_WAIT, stages.work.wait()).await;
        }
        // Heartbeat, ejection and shard watch stop before deregistering (a late beat would
        // register again); then the ledger writes what it holds.
        stages.background.stop_within(STEP_LIMIT).await;
        stages.ledger.stop().await;
        if fatal.is_none() {
            registrar.deregister().await;
        }
        broker.close("drained").await;
        stages.serve.stop_within(STEP_LIMIT).await;

        match (fatal, finish) {
            (Some(f), _) => Err(crate::Error::Fatal(f)),
            (None, Finish::Clean) => {
                tracing::info!("drained");
                Ok(())
            }
            (None, Finish::GraceExceeded) => Err(crate::Error::GraceExceeded { grace, left }),
            (None, Finish::Forced) => Err(crate::Error::Interrupted { left }),
        }
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
        let work = Stage::new("work");
        let force = CancellationToken::new();
        work.spawn_here(tokio::time::sleep(Duration::from_secs(5)));
        assert_eq!(
            wait_for_tasks(&work, Duration::from_secs(1), &force).await,
            Finish::GraceExceeded
        );
        assert_eq!(
            wait_for_tasks(&work, Duration::from_secs(10), &force).await,
            Finish::Clean
        );
        let work = Stage::new("work");
        work.spawn_here(tokio::time::sleep(Duration::from_secs(5)));
        force.cancel();
        assert_eq!(
            wait_for_tasks(&work, Duration::from_secs(10), &force).await,
            Finish::Forced
        );
    }
}
