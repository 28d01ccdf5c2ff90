//! The heartbeat: liveness, load and health for the scheduler, every `heartbeat_interval_ms`.
//!
//! Each beat carries the running counts per lane and the list of running tasks (renewing
//! their leases, so a worker that dies frees its slots within one `run_lease_ms`), outcome
//! totals, the latency EWMA, CPU utilisation and a health figure for weighted routing:
//! `(1 − recent error ratio) × (1 − cpu / 2)`, clamped to `[0.05, 1]` — errors weigh fully,
//! a busy CPU halves the weight at most, and no worker drops to zero (it could never prove
//! itself healthy again).
//!
//! The reply drives the worker: `gone` → register again (Redis lost the registration),
//! `conflict` → another process holds the id: shut down; state `draining` while not draining
//! → an operator asked for a drain. Between beats the state is polled every second (one
//! `HGET`), so a drain asked through the API takes effect within a second. Redis errors are
//! logged and counted; the worker keeps running on what it has.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use fleet::http::Readiness;
use fleet::process::Ticker;
use fleet::registry::{Beat, BeatReply, WorkerState};

use crate::drain::{Control, Mode};
use crate::eject::Ejector;
use crate::registry::{set_state_logged, Registrar};
use crate::stats::Stats;

/// How often the worker's state is read between beats.
pub const STATE_POLL: Duration = Duration::from_secs(1);

/// The heartbeat loop.
pub struct Heartbeat {
    pub registrar: Registrar,
    pub control: Control,
    pub stats: Arc<Stats>,
    pub ejector: Ejector,
    pub interval: Duration,
    pub run_lease: Duration,
    /// Notified when something found the registration gone (beat now).
    pub gone: Arc<Notify>,
    pub readiness: Readiness,
}

impl Heartbeat {
    pub async fn run(self, shutdown: CancellationToken) {
        let mut beat = Ticker::new(self.interval);
        let mut poll = Ticker::new(STATE_POLL);
        let mut cpu = CpuSampler::new();
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = self.gone.notified() => self.beat(&mut cpu).await,
                _ = beat.next() => self.beat(&mut cpu).await,
                _ = poll.next() => self.poll(&mut cpu).await,
            }
        }
    }

    async fn beat(&self, cpu: &mut CpuSampler) {
        let b = self.collect(cpu);
        let store = self.registrar.store();
        if let Err(e) = store.measure_clock().await {
            tracing::debug!(error = %e, "cannot measure the clock against Redis");
        }
        match store
            .heartbeat(
                self.registrar.id(),
                self.registrar.instance(),
                self.run_lease,
                &b,
            )
            .await
        {
            Ok(reply) => {
                self.readiness.set_redis(true);
                // For the scheduler's console; kept a little longer than a beat apart.
                let (waits, skew) = (self.stats.waits.encode(), store.clock.skew_ms());
                if let Err(e) = store
                    .share_worker_stats(self.registrar.id(), &waits, skew, self.interval * 3)
                    .await
                {
                    tracing::debug!(error = %e, "cannot share the wait histogram");
                }
                self.on_reply(reply, &b).await;
                // The figures also go out with every ledger batch; this covers a registration
                // made again (which starts from an empty record).
                if let Err(e) = store
                    .set_outcomes(
                        self.registrar.id(),
                        self.registrar.instance(),
                        &self.stats.outcomes(),
                    )
                    .await
                {
                    self.redis_error(&e, "cannot publish the task figures");
                }
            }
            Err(e) => self.redis_error(&e, "heartbeat failed"),
        }
    }

    async fn on_reply(&self, reply: BeatReply, b: &Beat) {
        let mode = self.control.mode();
        match reply {
            BeatReply::Gone => {
                tracing::warn!(
                    "registration lost (Redis data loss or eviction); registering again"
                );
                match self.registrar.register(mode.state()).await {
                    Ok(()) => {
                        // The fresh registration has no running records: renew them at once
                        // (once: a registration lost again waits for the next beat).
                        let store = self.registrar.store();
                        if let Err(e) = store
                            .heartbeat(
                                self.registrar.id(),
                                self.registrar.instance(),
                                self.run_lease,
                                b,
                            )
                            .await
                        {
                            self.redis_error(&e, "heartbeat after registering again failed");
                        }
                    }
                    Err(fleet::Error::DuplicateWorker(m)) => self.control.fail(m),
                    Err(e) => self.redis_error(&e, "registering again failed"),
                }
            }
            BeatReply::Conflict => {
                self.control.fail(format!(
                    "worker id `{}` is now held by another process",
                    self.registrar.id()
                ));
            }
            BeatReply::State(s) => self.reconcile(mode, s).await,
        }
    }

    /// Brings our state and Redis's in step: a drain asked in Redis is obeyed; any other
    /// difference (a lost `set_state`) is corrected from our side.
    async fn reconcile(&self, mode: Mode, stored: WorkerState) {
        if stored == WorkerState::Draining && mode != Mode::Draining {
            self.control
                .request_drain("state set to draining in Redis (drain requested through the API)");
        } else if stored != mode.state() {
            tracing::info!(
                stored = stored.as_str(),
                ours = mode.state().as_str(),
                "correcting the worker state in Redis"
            );
            // A drain asked since `stored` was read is kept by the script, and obeyed here.
            if set_state_logged(self.registrar.store(), self.registrar.id(), mode.state()).await
                == Some(WorkerState::Draining)
                && mode != Mode::Draining
            {
                self.control.request_drain(
                    "state set to draining in Redis (drain requested through the API)",
                );
            }
        }
    }

    async fn poll(&self, cpu: &mut CpuSampler) {
        let store = self.registrar.store();
        match store.worker_state(self.registrar.id()).await {
            Ok(Some(WorkerState::Draining)) if self.control.mode() != Mode::Draining => {
                self.control.request_drain(
                    "state set to draining in Redis (drain requested through the API)",
                );
            }
            // A read proves nothing about writes (a read-only Redis answers it): readiness
            // is set by the heartbeat, a write.
            Ok(Some(_)) => {}
            // Gone: the heartbeat sorts it out (and re-registers).
            Ok(None) => self.beat(cpu).await,
            Err(e) => self.redis_error(&e, "cannot read the worker state"),
        }
    }

    fn collect(&self, cpu: &mut CpuSampler) -> Beat {
        let (load, running) = self.stats.running();
        let (succeeded, failed) = self.stats.totals();
        let cpu = cpu.sample();
        Beat {
            load,
            succeeded,
            failed,
            latency_ewma_ms: self.stats.latency_ewma_ms(),
            cpu,
            health: health(self.ejector.error_ratio(), cpu),
            running,
            keys: self.stats.keys(),
        }
    }

    fn redis_error(&self, e: &fleet::Error, what: &str) {
        metrics::counter!(fleet::metrics::REDIS_ERRORS).increment(1);
        self.readiness.set_redis(false);
        tracing::warn!(error = %e, "{what}");
    }
}

/// `(1 − error ratio) × (1 − cpu / 2)`, clamped to `[0.05, 1]`.
pub fn health(error_ratio: f64, cpu: f64) -> f64 {
    let h = (1.0 - error_ratio.clamp(0.0, 1.0)) * (1.0 - cpu.clamp(0.0, 1.0) / 2.0);
    h.clamp(0.05, 1.0)
}

/// CPU utilisation of this process from `/proc/self/stat` (user + system time) over wall
/// time and cores, `0..1`; 0 where `/proc` is unavailable.
pub struct CpuSampler {
    last: Option<(Instant, f64)>,
    cores: f64,
}

/// Clock ticks per second of `/proc` times. `USER_HZ` is 100 on every Linux architecture's
/// user-space ABI (the kernel's internal HZ may differ), so no `sysconf` call is needed.
const USER_HZ: f64 = 100.0;

impl CpuSampler {
    pub fn new() -> Self {
        let cores = std::thread::available_parallelism()
            .map(|n| n.get() as f64)
            .unwrap_or(1.0);
        let mut s = CpuSampler { last: None, cores };
        s.sample();
        s
    }

    /// Utilisation since the previous sample, `0..=1` (0 on the first sample, where `/proc`
    /// is unavailable, or when no wall time passed).
    pub fn sample(&mut self) -> f64 {
        let Some(cpu) = process_cpu_seconds() else {
            return 0.0;
        };
        self.sample_at(Instant::now(), cpu)
    }

    /// [`Self::sample`] with the reading given: `cpu` is the process's CPU seconds (user +
    /// system) at `now`. The change in CPU seconds over the wall seconds, per core, clamped
    /// to `[0, 1]`.
    fn sample_at(&mut self, now: Instant, cpu: f64) -> f64 {
        let util = match self.last {
            Some((t, c)) => {
                let wall = now.duration_since(t).as_secs_f64();
                if wall > 0.0 {
                    ((cpu - c) / wall / self.cores).clamp(0.0, 1.0)
                } else {
                    0.0
                }
            }
            None => 0.0,
        };
        self.last = Some((now, cpu));
        util
    }
}

impl Default for CpuSampler {
    fn default() -> Self {
        Self::new()
    }
}

fn process_cpu_seconds() -> Option<f64> {
    parse_stat(&std::fs::read_to_string("/proc/self/stat").ok()?)
}

/// utime + stime (fields 14 and 15) in seconds. The command name (field 2) may hold spaces
/// and parentheses, so fields are counted from the last `)`.
fn parse_stat(stat: &str) -> Option<f64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / USER_HZ)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn health_formula() {
        assert_eq!(health(0.0, 0.0), 1.0);
        assert_eq!(health(0.5, 0.0), 0.5);
        assert_eq!(health(0.0, 1.0), 0.5);
        assert!((health(0.5, 0.5) - 0.375).abs() < 1e-9);
        assert_eq!(health(1.0, 1.0), 0.05);
        assert_eq!(health(-3.0, 7.0), 0.5);
    }

    #[test]
    fn stat_parsing() {
        let line =
            "4242 (my (odd) prog) S 1 4242 4242 0 -1 4194560 500 0 0 0 250 50 0 0 20 0 4 0 100 0 0";
        assert_eq!(parse_stat(line), Some(3.0));
        assert_eq!(parse_stat("garbage"), None);
        assert!(process_cpu_seconds().is_some(), "Linux has /proc/self/stat");
    }

    /// The computation itself, on given readings: CPU seconds over wall seconds per core.
    #[test]
    fn sampler_divides_cpu_time_by_wall_time_and_cores() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut s = CpuSampler {
            last: None,
            cores: 2.0,
        };
        assert_eq!(
            s.sample_at(at(0), 10.0),
            0.0,
            "the first sample has nothing to compare with"
        );
        assert_eq!(
            s.sample_at(at(1000), 11.5),
            0.75,
            "1.5 CPU s in 1 s on 2 cores"
        );
        assert_eq!(
            s.sample_at(at(3000), 12.5),
            0.25,
            "1 CPU s in 2 s on 2 cores"
        );
        assert_eq!(s.sample_at(at(4000), 12.5), 0.0, "idle");
        assert_eq!(s.sample_at(at(4000), 13.0), 0.0, "no wall time passed");
        assert_eq!(
            s.sample_at(at(4500), 16.0),
            1.0,
            "more than every core (a coarse /proc tick) is clamped"
        );
        assert_eq!(
            s.sample_at(at(5000), 15.0),
            0.0,
            "a counter going back is clamped"
        );
        let mut one = CpuSampler {
            last: None,
            cores: 1.0,
        };
        one.sample_at(at(0), 0.0);
        assert_eq!(one.sample_at(at(500), 0.25), 0.5);
    }

    /// Live: busy work in this process shows as a utilisation above zero. Spins until
    /// `/proc` counts at least 50 ms more CPU time (bounded by 30 s of wall time).
    #[test]
    fn sampler_sees_busy_work() {
        let mut s = CpuSampler::new();
        let start = process_cpu_seconds().unwrap_or(0.0);
        let give_up = std::time::Instant::now() + Duration::from_secs(30);
        let mut x = 0u64;
        while process_cpu_seconds().unwrap_or(0.0) < start + 0.05
            && std::time::Instant::now() < give_up
        {
            for i in 0..100_000u64 {
                x = x.wrapping_mul(31).wrapping_add(i);
            }
        }
        std::hint::black_box(x);
        let u = s.sample();
        assert!(u > 0.0 && u <= 1.0, "{u}");
    }
}
