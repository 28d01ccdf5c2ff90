//! Ordered shutdown: a process's long-lived loops grouped in *stages*, stopped stage by stage
//! in the reverse order of their creation (the last stage built is the first stopped, as values
//! are dropped), each stage only once the loops of the one before it have ended.
//!
//! The shape follows linkerd2-proxy's `main.rs` (`let drain = app.spawn(); … drain.drain()`):
//! build, spawn every loop on the stage it belongs to, and at the end stop the stages in order.
//! A stage is one [`CancellationToken`] (the signal its loops watch) and one [`TaskTracker`]
//! (so stopping it can wait until they have all returned); every loop has the one shape
//!
//! ```ignore
//! pub async fn run(self, shutdown: CancellationToken) {
//!     let mut ticker = Ticker::new(self.interval);
//!     loop {
//!         tokio::select! {
//!             biased;
//!             _ = shutdown.cancelled() => break,
//!             _ = other_event => self.on_event().await,
//!             _ = ticker.next() => self.tick().await,
//!         }
//!     }
//! }
//! ```
//!
//! spawned with [`Stage::spawn`]. Why stages rather than one token: the order matters. A worker
//! stops taking tasks, lets running ones finish, then stops its heartbeat (a late beat would
//! register it again), flushes its ledger, deregisters, and only then closes its HTTP server
//! (which answers `/healthz` to the end); see the worker's `drain` module.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

/// One stage of a [`Shutdown`]: a stop signal and the loops that watch it. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Stage {
    name: &'static str,
    token: CancellationToken,
    tracker: TaskTracker,
}

impl Stage {
    /// A stage on its own (not part of a [`Shutdown`]); `name` is for logs.
    pub fn new(name: &'static str) -> Self {
        Stage {
            name,
            token: CancellationToken::new(),
            tracker: TaskTracker::new(),
        }
    }

    /// A stage on its own whose signal also fires when `parent` is cancelled (a stage inside a
    /// larger one: a session within a process).
    pub fn with_parent(name: &'static str, parent: &CancellationToken) -> Self {
        Stage {
            name,
            token: parent.child_token(),
            tracker: TaskTracker::new(),
        }
    }

    /// The stage's name, for logs.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The signal this stage's loops watch (fired by [`Stage::stop`] or [`Stage::cancel`]).
    pub fn token(&self) -> CancellationToken {
        self.token.clone()
    }

    /// True once the stage's signal has fired.
    pub fn is_stopping(&self) -> bool {
        self.token.is_cancelled()
    }

    /// Resolves when the stage's signal fires.
    ///
    /// # Cancel safety
    /// Cancel safe: it only waits; dropped, it has changed nothing.
    pub async fn stopping(&self) {
        self.token.cancelled().await
    }

    /// Spawns `fut` on this stage, instrumented with `span`. The future should end when the
    /// stage's [`Stage::token`] fires; [`Stage::stop`] waits for it.
    pub fn spawn<F>(&self, span: tracing::Span, fut: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tracker.spawn(fut.instrument(span))
    }

    /// Spawns `fut` in the current span (task attempts inherit their lane's span).
    pub fn spawn_here<F>(&self, fut: F) -> JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tracker.spawn(fut.in_current_span())
    }

    /// Fires the stage's signal without waiting.
    pub fn cancel(&self) {
        self.token.cancel();
    }

    /// Takes no more tasks: what is spawned is all [`Stage::wait`] waits for.
    pub fn close(&self) {
        self.tracker.close();
    }

    /// Nothing spawned on this stage is still running.
    pub fn is_empty(&self) -> bool {
        self.tracker.is_empty()
    }

    /// Waits until the stage is closed and everything spawned on it has returned (without
    /// firing its signal).
    ///
    /// # Cancel safety
    /// Cancel safe: it only waits; dropped, it has changed nothing.
    pub async fn wait(&self) {
        self.tracker.wait().await
    }

    /// Stops the stage: fires its signal, closes it and waits until every loop on it returned.
    ///
    /// # Cancel safety
    /// Cancel safe: the signal and the close happen at its first poll, so a call dropped
    /// after that has still stopped the stage and only the wait for its loops is lost;
    /// calling it again waits again.
    pub async fn stop(&self) {
        self.token.cancel();
        self.tracker.close();
        self.tracker.wait().await;
    }

    /// [`Stage::stop`], waiting at most `limit`; false (and a warning) when loops were still
    /// running then.
    pub async fn stop_within(&self, limit: Duration) -> bool {
        let done = tokio::time::timeout(limit, self.stop()).await.is_ok();
        if !done {
            tracing::warn!(
                stage = self.name,
                limit_ms = limit.as_millis() as u64,
                running = self.tracker.len(),
                "loops did not stop in time"
            );
        }
        done
    }
}

/// The stages of a process, stopped last-built first ([`Shutdown::stop`]). Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Shutdown {
    stages: Arc<Mutex<Vec<Stage>>>,
}

impl Shutdown {
    /// No stages yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a stage; it is stopped before every stage added earlier.
    pub fn stage(&self, name: &'static str) -> Stage {
        let stage = Stage::new(name);
        self.stages
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(stage.clone());
        stage
    }

    /// Fires every stage's signal at once (a hard stop); [`Shutdown::stop`] still waits.
    pub fn cancel(&self) {
        for s in self
            .stages
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
        {
            s.cancel();
        }
    }

    /// Stops every stage not stopped yet, last-built first, each once the previous one is done.
    ///
    /// # Cancel safety
    /// Cancel safe in effect, not in progress: dropped mid-way, the stages stopped so far
    /// stay stopped, the one being stopped has its signal fired and is closed, and the
    /// earlier-built ones are left running; calling it again goes on from there.
    pub async fn stop(&self) {
        let stages: Vec<Stage> = self
            .stages
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        for s in stages.iter().rev() {
            s.stop().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// Stages stop last-built first, each after the loops of the one before it returned.
    #[tokio::test(start_paused = true)]
    async fn stages_stop_in_reverse_order_of_creation() {
        let shutdown = Shutdown::new();
        let order = Arc::new(Mutex::new(Vec::new()));
        let clock = Arc::new(AtomicUsize::new(0));
        for name in ["serve", "background", "intake"] {
            let stage = shutdown.stage(name);
            let (order, clock, token) = (order.clone(), clock.clone(), stage.token());
            stage.spawn(tracing::info_span!("loop"), async move {
                token.cancelled().await;
                // A loop that takes a while to wind down still ends before the next stage stops.
                tokio::time::sleep(Duration::from_millis(10)).await;
                order
                    .lock()
                    .unwrap()
                    .push((name, clock.fetch_add(1, Ordering::SeqCst)));
            });
        }
        shutdown.stop().await;
        assert_eq!(
            *order.lock().unwrap(),
            vec![("intake", 0), ("background", 1), ("serve", 2)]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn stop_within_gives_up_on_a_stuck_loop() {
        let stage = Stage::new("stuck");
        stage.spawn(tracing::Span::none(), std::future::pending::<()>());
        assert!(!stage.stop_within(Duration::from_secs(1)).await);
        assert!(stage.is_stopping());
        let quick = Stage::new("quick");
        let t = quick.token();
        quick.spawn(tracing::Span::none(), async move { t.cancelled().await });
        assert!(quick.stop_within(Duration::from_secs(1)).await);
    }
}
