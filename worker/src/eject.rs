//! Outlier ejection: a worker that fails much more than it succeeds takes itself out of
//! rotation for a cool-down instead of eating its group's tasks.
//!
//! The signal is a sliding window of the last `eject_window` handler outcomes. Once it holds at
//! least `eject_min_samples` outcomes and the error ratio is above `eject_error_ratio`, the
//! worker sets its state to `ejected` (its capacity leaves the group, so the scheduler stops
//! routing to it), cancels its consumers, and waits `eject_cooldown_ms`; then it clears the
//! window, goes `active` and consumes again. The minimum sample count keeps one early failure
//! from ejecting a fresh worker; a count window (rather than a time window) reacts as fast on
//! a busy worker as on an idle one. Permanent errors are the task's fault (bad input), not the
//! worker's, and do not count.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use fleet::redis::Store;
use fleet::registry::WorkerState;

use crate::config::EjectConfig;
use crate::drain::{Control, Mode};

/// The last outcomes, `true` = failure.
#[derive(Debug, Clone)]
pub struct Window {
    outcomes: VecDeque<bool>,
    failures: usize,
    size: usize,
    min_samples: usize,
    max_ratio: f64,
}

impl Window {
    pub fn new(cfg: &EjectConfig) -> Self {
        Window {
            outcomes: VecDeque::with_capacity(cfg.window),
            failures: 0,
            size: cfg.window.max(1),
            min_samples: cfg.min_samples,
            max_ratio: cfg.error_ratio,
        }
    }

    /// Records an outcome; true when the window now calls for ejection.
    pub fn record(&mut self, failure: bool) -> bool {
        if self.outcomes.len() == self.size && self.outcomes.pop_front() == Some(true) {
            self.failures -= 1;
        }
        self.outcomes.push_back(failure);
        if failure {
            self.failures += 1;
        }
        self.tripped()
    }

    pub fn tripped(&self) -> bool {
        self.outcomes.len() >= self.min_samples && self.error_ratio() > self.max_ratio
    }

    /// Failures over outcomes in the window (0 when empty).
    pub fn error_ratio(&self) -> f64 {
        if self.outcomes.is_empty() {
            0.0
        } else {
            self.failures as f64 / self.outcomes.len() as f64
        }
    }

    pub fn clear(&mut self) {
        self.outcomes.clear();
        self.failures = 0;
    }
}

/// The shared window plus the wake-up of the ejection loop.
#[derive(Clone)]
pub struct Ejector {
    window: Arc<Mutex<Window>>,
    tripped: Arc<Notify>,
}

impl Ejector {
    pub fn new(cfg: &EjectConfig) -> Self {
        Ejector {
            window: Arc::new(Mutex::new(Window::new(cfg))),
            tripped: Arc::new(Notify::new()),
        }
    }

    /// Records a handler outcome (from the attempt that ran it).
    pub fn record(&self, failure: bool) {
        let tripped = match self.window.lock() {
            Ok(mut w) => w.record(failure),
            Err(_) => false,
        };
        if tripped {
            self.tripped.notify_one();
        }
    }

    /// The recent error ratio (for the heartbeat's health figure).
    pub fn error_ratio(&self) -> f64 {
        self.window.lock().map(|w| w.error_ratio()).unwrap_or(0.0)
    }

    fn is_tripped(&self) -> bool {
        self.window.lock().map(|w| w.tripped()).unwrap_or(false)
    }

    fn clear(&self) {
        if let Ok(mut w) = self.window.lock() {
            w.clear();
        }
    }
}

/// The ejection loop: waits for the window to trip and runs the eject → cool-down → reactivate
/// cycle, until `shutdown`.
pub struct Ejection {
    pub ejector: Ejector,
    pub cfg: EjectConfig,
    pub control: Control,
    pub store: Store,
    pub worker_id: String,
}

impl Ejection {
    pub async fn run(self, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = self.ejector.tripped.notified() => self.on_trip(&shutdown).await,
            }
        }
    }

    /// One trip: eject (unless stale, or the last active worker of the group), cool down, come
    /// back. Returns early on shutdown or a drain.
    async fn on_trip(&self, shutdown: &CancellationToken) {
        let Ejection {
            ejector,
            cfg,
            control,
            store,
            worker_id,
        } = self;
        // A trip recorded before a cool-down ended (tasks finishing while ejected) is stale:
        // only the window as it is now counts.
        if control.mode() != Mode::Active || !ejector.is_tripped() {
            return;
        }
        let ratio = ejector.error_ratio();
        // Never eject the last active worker of a group: its tasks would find no worker at all
        // (and end as no_matching_worker) instead of a failing one.
        match store.try_eject(worker_id).await {
            Ok(Some(false)) => {
                tracing::warn!(
                    error_ratio = ratio,
                    "too many errors, but this is the last active worker of its group: staying in"
                );
                ejector.clear();
                return;
            }
            Ok(_) => {}
            Err(e) => {
                metrics::counter!(fleet::metrics::REDIS_ERRORS).increment(1);
                tracing::warn!(error = %e, "cannot check the group before ejecting; ejecting locally");
            }
        }
        // Redis first: a drain an operator asked for there (final, see `set_state.lua`) wins
        // over the ejection, even when this worker has not seen it yet.
        if crate::registry::set_state_logged(store, worker_id, WorkerState::Ejected).await
            == Some(WorkerState::Draining)
        {
            control.request_drain("state draining set in Redis (drain requested through the API)");
            return;
        }
        if !control.eject() {
            return;
        }
        metrics::counter!(fleet::metrics::WORKER_EJECTIONS).increment(1);
        tracing::warn!(
            error_ratio = ratio,
            cooldown_ms = cfg.cooldown.as_millis() as u64,
            "too many errors: ejecting this worker"
        );
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = control.draining() => return,
            _ = tokio::time::sleep(cfg.cooldown) => {}
        }
        ejector.clear();
        if !control.reactivate() {
            return;
        }
        // An operator may have asked for a drain while we were ejected: the previous state
        // tells; honour it instead of overwriting it.
        if crate::registry::set_state_logged(store, worker_id, WorkerState::Active).await
            == Some(WorkerState::Draining)
        {
            control.request_drain("state draining set while ejected");
            return;
        }
        tracing::info!("cool-down over: active again");
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn window(size: usize, min: usize, ratio: f64) -> Window {
        Window::new(&EjectConfig {
            window: size,
            min_samples: min,
            error_ratio: ratio,
            cooldown: Duration::from_secs(1),
        })
    }

    #[test]
    fn needs_min_samples() {
        let mut w = window(20, 10, 0.5);
        for _ in 0..9 {
            assert!(!w.record(true));
        }
        assert!(w.record(true), "10 failures of 10");
    }

    #[test]
    fn ratio_must_exceed_the_threshold() {
        let mut w = window(10, 10, 0.5);
        for i in 0..10 {
            w.record(i % 2 == 1);
        }
        assert_eq!(w.error_ratio(), 0.5);
        assert!(!w.tripped(), "0.5 is not above 0.5");
        assert!(
            w.record(true),
            "6 of 10 after the oldest success slides out"
        );
    }

    #[test]
    fn old_outcomes_slide_out() {
        let mut w = window(4, 2, 0.5);
        for _ in 0..4 {
            w.record(true);
        }
        assert!(w.tripped());
        for _ in 0..3 {
            w.record(false);
        }
        assert_eq!(w.error_ratio(), 0.25);
        assert!(!w.tripped());
        w.record(false);
        assert_eq!(w.error_ratio(), 0.0);
    }

    #[test]
    fn clear_forgets_everything() {
        let mut w = window(5, 1, 0.1);
        assert!(w.record(true));
        w.clear();
        assert_eq!(w.error_ratio(), 0.0);
        assert!(!w.tripped());
        assert!(!w.record(false));
    }
}
