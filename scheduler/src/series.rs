//! The last 15 minutes of throughput and wait time, for the console's charts
//! (`GET /v1/series`).
//!
//! Every `series_interval` (2 s by default) the scheduler takes one [`Point`]: how many tasks
//! were submitted, dispatched and refused in that interval (differences of its own counters
//! `fleet_tasks_submitted_total`, `fleet_tasks_dispatched_total`, `fleet_tasks_refused_total`,
//! read from its Prometheus registry), how many attempts succeeded and failed (differences of
//! the workers' totals in the registry, so at heartbeat granularity), and the p50/p99 wait —
//! submission to start — of the attempts that started in it (differences of the workers' wait
//! histograms, see `fleet::run::waits`). Points live in a ring of `15 min / interval` entries in
//! memory: a console shows the history of the replica it talks to, and a restart starts a new
//! history (Prometheus and the Grafana dashboard keep the long one).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fleet::metrics as m;
use fleet::process::Ticker;
use fleet::redis::now_ms;
use fleet::registry::WorkerView;
use fleet::run::waits::{self, Counts};
use fleet::Store;
use metrics_exporter_prometheus::PrometheusHandle;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

/// How much history the ring keeps.
pub const WINDOW: Duration = Duration::from_secs(15 * 60);

/// One interval's figures. Counts are per interval; divide by `seconds` for a rate.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Point {
    /// End of the interval, ms since the Unix epoch.
    pub at_ms: i64,
    /// Length of the interval, in seconds.
    pub seconds: f64,
    /// Tasks this scheduler took from ingress (both lanes).
    pub submitted: u64,
    /// Tasks this scheduler published to a group queue.
    pub dispatched: u64,
    /// Attempts that succeeded, fleet-wide (workers' totals as of their last heartbeat).
    pub succeeded: u64,
    /// Attempts that failed, fleet-wide (each retry counts).
    pub failed: u64,
    /// Submissions this scheduler's API refused (429/503).
    pub refused: u64,
    /// Attempts that started in the interval, fleet-wide.
    pub started: u64,
    /// Median wait (submission to start) of those attempts, in seconds.
    pub wait_p50: Option<f64>,
    /// 99th percentile of the same waits, in seconds.
    pub wait_p99: Option<f64>,
}

/// The shared ring; cloned into the API.
#[derive(Debug, Clone, Default)]
pub struct Series {
    inner: Arc<Mutex<VecDeque<Point>>>,
}

impl Series {
    /// The points, oldest first.
    pub fn points(&self) -> Vec<Point> {
        self.inner
            .lock()
            .map(|r| r.iter().cloned().collect())
            .unwrap_or_default()
    }

    fn push(&self, p: Point, keep: usize) {
        if let Ok(mut r) = self.inner.lock() {
            r.push_back(p);
            while r.len() > keep {
                r.pop_front();
            }
        }
    }
}

/// Sums of the scheduler's own counters.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Own {
    submitted: f64,
    dispatched: f64,
    refused: f64,
}

/// What the last sample saw, to take differences from.
#[derive(Debug, Default)]
struct Last {
    own: Own,
    /// Per worker id: (succeeded, failed) totals.
    totals: HashMap<String, (u64, u64)>,
    /// Per worker id: cumulative wait bucket counts.
    waits: HashMap<String, Counts>,
}

/// The sampling loop: a point into `series` every `every`, until `shutdown`.
pub struct Recorder {
    pub series: Series,
    pub handle: PrometheusHandle,
    pub store: Store,
    pub every: Duration,
    /// The previous reading (none before the first).
    last: Option<(Instant, Last)>,
}

impl Recorder {
    pub fn new(series: Series, handle: PrometheusHandle, store: Store, every: Duration) -> Self {
        Recorder {
            series,
            handle,
            store,
            every,
            last: None,
        }
    }

    pub async fn run(mut self, shutdown: CancellationToken) {
        let mut ticker = Ticker::new(self.every);
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = ticker.next() => self.tick().await,
            }
        }
    }

    /// Points kept: the window's worth.
    fn keep(&self) -> usize {
        (WINDOW.as_millis() / self.every.as_millis().max(1)).max(1) as usize
    }

    async fn tick(&mut self) {
        let keep = self.keep();
        let own = own_counters(&self.handle.render());
        let (workers, waits) = match fleet_view(&self.store).await {
            Ok(v) => v,
            Err(e) => {
                tracing::debug!(error = %e, "series: cannot read the fleet view");
                return;
            }
        };
        let now = Instant::now();
        let mut next = Last {
            own,
            ..Default::default()
        };
        let mut p = Point {
            at_ms: now_ms(),
            ..Default::default()
        };
        let mut started = vec![0u64; waits::BOUNDS.len() + 1];
        let last = &mut self.last;
        let prev = last.as_ref().map(|(_, l)| l);
        for w in &workers {
            let before = prev.and_then(|l| l.totals.get(&w.id)).copied();
            // Failed attempts: those whose handler failed (retried or dead-lettered), the one
            // definition of `failed` in every view (`WorkerView::failed`).
            let failed = w.failed;
            if prev.is_some() {
                p.succeeded += delta(before.map(|b| b.0), w.succeeded);
                p.failed += delta(before.map(|b| b.1), failed);
            }
            next.totals.insert(w.id.clone(), (w.succeeded, failed));
        }
        for (id, counts) in waits {
            if let Some(prev) = prev {
                let before = prev.waits.get(&id);
                for (i, c) in counts.iter().enumerate() {
                    started[i] += delta(before.and_then(|b| b.get(i)).copied(), *c);
                }
            }
            next.waits.insert(id, counts);
        }
        // A worker whose histogram expired for a moment keeps its last reading (so its next
        // one is not counted twice) while it is registered.
        if let Some(prev) = prev {
            for (id, c) in &prev.waits {
                if !next.waits.contains_key(id) && next.totals.contains_key(id) {
                    next.waits.insert(id.clone(), c.clone());
                }
            }
        }
        if let Some((at, prev)) = &last {
            p.seconds = now.duration_since(*at).as_secs_f64();
            p.submitted = (own.submitted - prev.own.submitted).max(0.0) as u64;
            p.dispatched = (own.dispatched - prev.own.dispatched).max(0.0) as u64;
            p.refused = (own.refused - prev.own.refused).max(0.0) as u64;
            p.started = started.iter().sum();
            p.wait_p50 = waits::quantile(&started, 0.5);
            p.wait_p99 = waits::quantile(&started, 0.99);
            self.series.push(p, keep);
        }
        *last = Some((now, next));
    }
}

/// Growth of a worker's total since the last reading. A worker first seen after the first
/// sample started since then: all of its total is new. A total that went down belongs to a
/// restarted worker with the same id: it counts from zero.
fn delta(before: Option<u64>, now: u64) -> u64 {
    match before {
        Some(b) if now >= b => now - b,
        _ => now,
    }
}

async fn fleet_view(store: &Store) -> fleet::Result<(Vec<WorkerView>, Vec<(String, Counts)>)> {
    let workers = store.workers().await?;
    let ids: Vec<String> = workers.iter().map(|w| w.id.clone()).collect();
    let shared = store.worker_stats(&ids).await?;
    let waits = ids
        .into_iter()
        .zip(shared)
        .filter_map(|(id, s)| s.waits.map(|h| (id, h)))
        .collect();
    Ok((workers, waits))
}

fn own_counters(page: &str) -> Own {
    Own {
        submitted: metric_sum(page, m::TASKS_SUBMITTED),
        dispatched: metric_sum(page, m::TASKS_DISPATCHED),
        refused: metric_sum(page, m::TASKS_REFUSED),
    }
}

/// Sum over all series of one metric in a Prometheus text page.
fn metric_sum(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            if !(rest.starts_with('{') || rest.starts_with(' ')) {
                return None;
            }
            l.rsplit(' ').next()?.parse::<f64>().ok()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_one_metric_over_its_labels() {
        let page = "# HELP fleet_tasks_submitted_total x\n\
                    fleet_tasks_submitted_total{lane=\"normal\"} 7\n\
                    fleet_tasks_submitted_total{lane=\"critical\"} 2\n\
                    fleet_tasks_submitted_total_other 100\n\
                    fleet_tasks_refused_total{reason=\"pressure_red\"} 3\n";
        let own = own_counters(page);
        assert_eq!(
            own,
            Own {
                submitted: 9.0,
                dispatched: 0.0,
                refused: 3.0
            }
        );
    }

    #[test]
    fn totals_grow_restart_and_appear() {
        assert_eq!(delta(Some(5), 8), 3);
        assert_eq!(delta(Some(5), 2), 2, "restarted worker");
        assert_eq!(delta(None, 4), 4, "new worker");
    }

    #[test]
    fn ring_keeps_the_window() {
        let s = Series::default();
        for i in 0..5 {
            s.push(
                Point {
                    at_ms: i,
                    ..Default::default()
                },
                3,
            );
        }
        assert_eq!(
            s.points().iter().map(|p| p.at_ms).collect::<Vec<_>>(),
            vec![2, 3, 4]
        );
    }
}
