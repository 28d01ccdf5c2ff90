//! What the worker knows about its own work, for its heartbeat: the tasks running now (their
//! leases are renewed by each beat), outcome totals and a latency EWMA.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use fleet::run::waits::WaitHistogram;
use fleet::{Lane, PerLane};

/// Weight of the newest sample in the latency EWMA: about the last ten runs matter.
const EWMA_ALPHA: f64 = 0.2;

#[derive(Debug, Default)]
pub struct Stats {
    /// Running tasks: (lane, id) → how many copies (a redelivered duplicate may overlap).
    running: Mutex<HashMap<(Lane, String), u32>>,
    /// The fairness key of each running task that has one (id → key): the heartbeat renews
    /// the key's running entry with the group's.
    keys: Mutex<HashMap<String, String>>,
    succeeded: AtomicU64,
    failed: AtomicU64,
    /// f64 bits of the EWMA in milliseconds; NaN bits while there is no sample.
    ewma_bits: AtomicU64,
    /// Submission-to-start waits, shared with the scheduler's console at each heartbeat.
    pub waits: WaitHistogram,
    /// User task attempts by outcome, in the order of [`OUTCOMES`].
    outcomes: [AtomicU64; 5],
    /// The queues each lane consumes now (set by the lane once its consumers are up).
    consuming: Mutex<PerLane<Vec<String>>>,
}

/// One counted run ([`Stats::running_guard`]); dropping it ends the count.
#[must_use = "the run is counted only while the guard lives"]
pub struct RunningGuard {
    stats: std::sync::Arc<Stats>,
    lane: Lane,
    id: String,
}

impl Drop for RunningGuard {
    fn drop(&mut self) {
        self.stats.ended(self.lane, &self.id);
    }
}

/// The outcomes of `fleet_tasks_completed_total`, as the worker counts them for `/status` and
/// `GET /v1/workers` (the same words, so every view of a worker agrees).
pub const OUTCOMES: [&str; 5] = ["succeeded", "retried", "dead", "expired", "failed"];

/// The name a view (`/status`, `GET /v1/workers`, fleetctl, the console) gives an outcome of
/// [`OUTCOMES`]: the metric's `failed` (the outcome could not be recorded) is `unrecorded`
/// there, so that `failed` means one thing everywhere — attempts whose handler failed
/// (`retried + dead`).
pub fn view_name(outcome: &'static str) -> &'static str {
    if outcome == "failed" {
        "unrecorded"
    } else {
        outcome
    }
}

impl Stats {
    pub fn new() -> Self {
        Stats {
            ewma_bits: AtomicU64::new(f64::NAN.to_bits()),
            ..Default::default()
        }
    }

    /// Records the queues a lane consumes now (empty: none, e.g. paused or reconnecting).
    pub fn set_consuming(&self, lane: Lane, queues: Vec<String>) {
        if let Ok(mut c) = self.consuming.lock() {
            c[lane] = queues;
        }
    }

    /// The queues a lane consumes now.
    pub fn consuming(&self, lane: Lane) -> Vec<String> {
        self.consuming
            .lock()
            .map(|c| c[lane].clone())
            .unwrap_or_default()
    }

    /// Counts a run of `id` in `lane` until the returned guard drops: the slot is given back on
    /// every way out of an attempt — its end, an early return, a panic, the attempt's future
    /// dropped (issue 37 item 4: a worker once kept `running=1` after a node loss and waited
    /// its whole drain grace for a run that had ended).
    pub fn running_guard(self: &std::sync::Arc<Self>, lane: Lane, id: &str) -> RunningGuard {
        self.started(lane, id);
        RunningGuard {
            stats: self.clone(),
            lane,
            id: id.to_string(),
        }
    }

    pub fn started(&self, lane: Lane, id: &str) {
        if let Ok(mut r) = self.running.lock() {
            *r.entry((lane, id.to_string())).or_insert(0) += 1;
        }
    }

    pub fn ended(&self, lane: Lane, id: &str) {
        let mut gone = false;
        if let Ok(mut r) = self.running.lock() {
            let key = (lane, id.to_string());
            if let Some(n) = r.get_mut(&key) {
                *n -= 1;
                if *n == 0 {
                    r.remove(&key);
                    gone = !r.keys().any(|(_, i)| i == id);
                }
            }
        }
        if gone {
            if let Ok(mut k) = self.keys.lock() {
                k.remove(id);
            }
        }
    }

    /// Records the fairness key of running task `id` (see [`Stats::keys`]).
    pub fn set_key(&self, id: &str, key: &str) {
        if let Ok(mut k) = self.keys.lock() {
            k.insert(id.to_string(), key.to_string());
        }
    }

    /// The fairness keys of the running tasks that have one (id → key).
    pub fn keys(&self) -> HashMap<String, String> {
        self.keys.lock().map(|k| k.clone()).unwrap_or_default()
    }

    /// Records a handler's result and run time.
    pub fn ran(&self, success: bool, took: Duration) {
        if success {
            self.succeeded.fetch_add(1, Ordering::Relaxed);
        } else {
            self.failed.fetch_add(1, Ordering::Relaxed);
        }
        let ms = took.as_secs_f64() * 1000.0;
        let _ = self
            .ewma_bits
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                let old = f64::from_bits(bits);
                let new = if old.is_nan() {
                    ms
                } else {
                    old + EWMA_ALPHA * (ms - old)
                };
                Some(new.to_bits())
            });
    }

    /// (how many run in each lane, the running tasks).
    pub fn running(&self) -> (PerLane<u32>, Vec<(Lane, String)>) {
        let Ok(r) = self.running.lock() else {
            return (PerLane::default(), vec![]);
        };
        let mut counts = PerLane::default();
        for ((lane, _), n) in r.iter() {
            counts[*lane] += n;
        }
        (counts, r.keys().cloned().collect())
    }

    /// Counts one user task attempt's outcome (one of [`OUTCOMES`]; others are ignored).
    pub fn outcome(&self, name: &str) {
        if let Some(i) = OUTCOMES.iter().position(|o| *o == name) {
            self.outcomes[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// User task attempts by outcome, every one of [`OUTCOMES`] in order.
    pub fn outcomes(&self) -> Vec<(&'static str, u64)> {
        OUTCOMES
            .iter()
            .zip(&self.outcomes)
            .map(|(o, n)| (*o, n.load(Ordering::Relaxed)))
            .collect()
    }

    pub fn totals(&self) -> (u64, u64) {
        (
            self.succeeded.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }

    pub fn latency_ewma_ms(&self) -> f64 {
        let v = f64::from_bits(self.ewma_bits.load(Ordering::Relaxed));
        if v.is_nan() {
            0.0
        } else {
            v
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn running_counts_duplicates() {
        let s = Stats::new();
        s.started(Lane::Normal, "a");
        s.started(Lane::Normal, "a");
        s.started(Lane::Critical, "p");
        let (
            PerLane {
                normal: n,
                critical: c,
            },
            list,
        ) = s.running();
        assert_eq!((n, c, list.len()), (2, 1, 2));
        s.ended(Lane::Normal, "a");
        s.ended(Lane::Normal, "a");
        s.ended(Lane::Normal, "zzz");
        assert_eq!(s.running().0.normal, 0);
    }

    #[test]
    fn a_running_guard_ends_its_run_however_it_drops() {
        let s = std::sync::Arc::new(Stats::new());
        let a = s.running_guard(Lane::Normal, "a");
        let b = s.running_guard(Lane::Normal, "a");
        assert_eq!(s.running().0.normal, 2);
        drop(a);
        assert_eq!(s.running().0.normal, 1);
        // A panic while the run is counted still gives the slot back.
        let s2 = s.clone();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _g = s2.running_guard(Lane::Critical, "p");
            panic!("handler bug");
        }));
        assert!(r.is_err());
        assert_eq!(s.running().0.critical, 0);
        drop(b);
        assert_eq!(s.running(), (PerLane::default(), vec![]));
    }

    #[test]
    fn ewma_moves_toward_samples() {
        let s = Stats::new();
        assert_eq!(s.latency_ewma_ms(), 0.0);
        s.ran(true, Duration::from_millis(100));
        assert_eq!(s.latency_ewma_ms(), 100.0);
        s.ran(false, Duration::from_millis(200));
        assert!((s.latency_ewma_ms() - 120.0).abs() < 1e-9);
        assert_eq!(s.totals(), (1, 1));
    }

    #[test]
    fn outcomes_are_counted_by_name() {
        let s = Stats::new();
        s.outcome("succeeded");
        s.outcome("succeeded");
        s.outcome("retried");
        s.outcome("bogus");
        assert_eq!(
            s.outcomes(),
            vec![
                ("succeeded", 2),
                ("retried", 1),
                ("dead", 0),
                ("expired", 0),
                ("failed", 0)
            ]
        );
    }
}
