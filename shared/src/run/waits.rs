//! Wait-time histograms the workers share with the scheduler: time from a task's submission to
//! the start of an attempt, in seconds, counted in the same buckets as the
//! `fleet_task_wait_seconds` metric ([`BOUNDS`]).
//!
//! The metric lives in each worker's own `/metrics`; the scheduler cannot read it. So each
//! worker also writes its cumulative bucket counts — and its clock skew against Redis — to a
//! small Redis hash at every heartbeat (`<ns>:wait:<worker>`, expiring with the worker), and the
//! scheduler turns the differences between two readings into quantiles for its console
//! ([`quantile`]). Like every Redis state it may be lost: a lost reading only leaves a gap in a
//! chart.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use deadpool_redis::redis;

use crate::error::Result;
use crate::redis::Store;

pub use crate::metrics::SECONDS_BUCKETS as BOUNDS;

/// Counts per bucket (not cumulative): `BOUNDS.len() + 1` of them.
pub type Counts = Vec<u64>;

/// A lock-free histogram of wait times.
#[derive(Debug, Default)]
pub struct WaitHistogram {
    counts: [AtomicU64; BOUNDS.len() + 1],
}

impl WaitHistogram {
    /// Counts one wait in its bucket (the first bound at or above it, else the overflow).
    pub fn record(&self, wait: Duration) {
        let s = wait.as_secs_f64();
        let i = BOUNDS.iter().position(|b| s <= *b).unwrap_or(BOUNDS.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
    }

    /// The counts since the process started, as `c0,c1,…,c15`.
    pub fn encode(&self) -> String {
        self.counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed).to_string())
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// Parses [`WaitHistogram::encode`]'s text; `None` for anything else.
pub fn decode(s: &str) -> Option<Counts> {
    let v: Vec<u64> = s
        .split(',')
        .map(|c| c.trim().parse().ok())
        .collect::<Option<_>>()?;
    (v.len() == BOUNDS.len() + 1).then_some(v)
}

/// The `q`-quantile (0..=1) of bucketed samples, in seconds, interpolated linearly inside its
/// bucket the way Prometheus' `histogram_quantile` does (the first bucket starts at 0; a
/// quantile in the open last bucket is reported as the last bound). `None` without samples.
pub fn quantile(counts: &[u64], q: f64) -> Option<f64> {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return None;
    }
    let rank = q.clamp(0.0, 1.0) * total as f64;
    let mut below = 0u64;
    for (i, c) in counts.iter().enumerate() {
        if *c > 0 && (below + c) as f64 >= rank {
            let Some(hi) = BOUNDS.get(i) else {
                return BOUNDS.last().copied();
            };
            let lo = if i == 0 { 0.0 } else { BOUNDS[i - 1] };
            return Some(lo + (hi - lo) * ((rank - below as f64) / *c as f64).clamp(0.0, 1.0));
        }
        below += c;
    }
    BOUNDS.last().copied()
}

/// What a worker shares at each heartbeat (see the module docs).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Shared {
    /// Cumulative wait bucket counts.
    pub waits: Option<Counts>,
    /// The worker's clock minus Redis's, in milliseconds.
    pub skew_ms: Option<i64>,
}

impl Store {
    /// Writes a worker's wait histogram ([`WaitHistogram::encode`]) and clock skew, expiring
    /// after `ttl`.
    pub async fn share_worker_stats(
        &self,
        worker: &str,
        waits: &str,
        skew_ms: i64,
        ttl: Duration,
    ) -> Result<()> {
        let key = self.names.waits(worker);
        let ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        let mut p = redis::pipe();
        p.cmd("HSET")
            .arg(&key)
            .arg("waits")
            .arg(waits)
            .arg("skew_ms")
            .arg(skew_ms)
            .ignore();
        p.cmd("PEXPIRE").arg(&key).arg(ms).ignore();
        self.pipe::<()>(&p).await
    }

    /// What these workers shared, in order (default: nothing written, or expired).
    pub async fn worker_stats(&self, workers: &[String]) -> Result<Vec<Shared>> {
        if workers.is_empty() {
            return Ok(vec![]);
        }
        let mut p = redis::pipe();
        for w in workers {
            p.cmd("HMGET")
                .arg(self.names.waits(w))
                .arg("waits")
                .arg("skew_ms");
        }
        let raw: Vec<(Option<String>, Option<i64>)> = self.pipe(&p).await?;
        Ok(raw
            .into_iter()
            .map(|(w, skew_ms)| Shared {
                waits: w.as_deref().and_then(decode),
                skew_ms,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_buckets() {
        let h = WaitHistogram::default();
        h.record(Duration::from_millis(1));
        h.record(Duration::from_millis(70));
        h.record(Duration::from_secs(1000));
        let c = decode(&h.encode()).unwrap_or_default();
        assert_eq!(c.len(), 16);
        assert_eq!((c[0], c[5], c[15], c.iter().sum::<u64>()), (1, 1, 1, 3));
        assert_eq!(decode("1,2"), None);
        assert_eq!(decode("x"), None);
    }

    #[test]
    fn quantiles_interpolate_like_prometheus() {
        let mut c = vec![0u64; 16];
        assert_eq!(quantile(&c, 0.5), None);
        // 100 samples in (0.1, 0.25]: the median is the bucket's middle.
        c[6] = 100;
        let p50 = quantile(&c, 0.5).unwrap_or_default();
        assert!((p50 - 0.175).abs() < 1e-9, "{p50}");
        assert!((quantile(&c, 0.99).unwrap_or_default() - 0.2485).abs() < 1e-9);
        // 99 fast ones and one in the open bucket: p99 stays in the fast bucket, p100 is capped.
        let mut c = vec![0u64; 16];
        c[0] = 99;
        c[15] = 1;
        assert!(quantile(&c, 0.99).unwrap_or_default() <= 0.001);
        assert_eq!(quantile(&c, 1.0), Some(300.0));
    }
}
