//! The ledger: a worker's writes of task starts and finishes to Redis, batched off the hot path.
//!
//! A task attempt never waits for Redis: it drops a record into a bounded channel and goes on.
//! One background loop takes records in batches — whatever arrived within [`FLUSH_EVERY`], at
//! most [`FLUSH_OPS`] — and writes each batch with one `start` script call, then one `finish`
//! call (starts before finishes, so a task that starts and ends within one batch ends up
//! finished), then the releases. At a few thousand tasks per second that is a few hundred
//! Redis calls per second instead of two per task.
//!
//! Redis state may be lost (the broker holds every task), so the trade-offs lean towards
//! never stalling work: when Redis fails, the batch is retried with capped backoff while new
//! records wait in the channel; when the channel is full, new records are dropped and
//! counted. A dropped start only delays the lease renewal of its task until the next
//! heartbeat, which lists every running task; a dropped finish leaves a running record that
//! expires with its lease.

use std::sync::Arc;
use std::time::Duration;

use deadpool_redis::redis;
use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use fleet::lease::Finished;
use fleet::store::Store;
use fleet::Lane;

use crate::stats::Stats;

/// Longest a record waits for its batch.
pub const FLUSH_EVERY: Duration = Duration::from_millis(5);
/// Largest batch.
pub const FLUSH_OPS: usize = 128;
/// Records buffered while Redis is slow or down; beyond that, records are dropped.
pub const BUFFER: usize = 16_384;
/// How long the final flush at shutdown keeps retrying.
const FINAL_FLUSH: Duration = Duration::from_secs(5);

/// One record.
#[derive(Debug, Clone)]
pub enum Op {
    /// A task attempt started: reservation → running record, status `running`.
    Start { lane: Lane, id: String, attempt: u32 },
    /// A task attempt ended with an outcome recorded in its status.
    Finish(Finished),
    /// A task attempt ended without an outcome (it went back to the broker): only release
    /// its running record, leave its status as it is.
    Release { lane: Lane, id: String },
}

/// The sending side, used by task attempts. Cheap to clone; never blocks.
#[derive(Clone)]
pub struct Ledger {
    tx: mpsc::Sender<Op>,
}

impl Ledger {
    /// A ledger and its batching loop (run it with [`Batcher::run`]).
    pub fn new(store: Store, worker_id: String, group: String, run_lease: Duration, status_ttl: Duration) -> (Ledger, Batcher) {
        let (tx, rx) = mpsc::channel(BUFFER);
        let batcher = Batcher {
            rx,
            store,
            worker_id,
            group,
            lease_ms: ms(run_lease),
            status_ttl_ms: ms(status_ttl),
            gone: Arc::new(Notify::new()),
            figures: None,
        };
        (Ledger { tx }, batcher)
    }

    pub fn record(&self, op: Op) {
        if let Err(e) = self.tx.try_send(op) {
            metrics::counter!(LEDGER_DROPPED).increment(1);
            match e {
                mpsc::error::TrySendError::Full(_) => tracing::warn!("ledger buffer full (Redis down?): task record dropped"),
                mpsc::error::TrySendError::Closed(_) => tracing::debug!("ledger closed: task record dropped"),
            }
        }
    }

    pub fn start(&self, lane: Lane, id: &str, attempt: u32) {
        self.record(Op::Start { lane, id: id.to_string(), attempt });
    }

    pub fn finish(&self, f: Finished) {
        self.record(Op::Finish(f));
    }

    pub fn release(&self, lane: Lane, id: &str) {
        self.record(Op::Release { lane, id: id.to_string() });
    }
}

/// Counter of records dropped because the ledger's buffer was full.
pub const LEDGER_DROPPED: &str = "fleet_worker_ledger_dropped_total";

/// The batching loop.
pub struct Batcher {
    rx: mpsc::Receiver<Op>,
    store: Store,
    worker_id: String,
    group: String,
    lease_ms: i64,
    status_ttl_ms: i64,
    gone: Arc<Notify>,
    /// This worker's instance token and figures, published with each batch that finishes
    /// tasks (so `GET /v1/workers` is current); `None` publishes nothing.
    figures: Option<(String, Arc<Stats>)>,
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

impl Batcher {
    /// Publishes `stats`' outcome totals with every batch that records finishes.
    pub fn with_figures(mut self, instance: String, stats: Arc<Stats>) -> Self {
        self.figures = Some((instance, stats));
        self
    }

    /// Notified when a start finds the worker's registration gone (the heartbeat registers
    /// again).
    pub fn gone_signal(&self) -> Arc<Notify> {
        self.gone.clone()
    }

    /// Batches and writes until `shutdown`, then writes what is left (bounded in time).
    pub async fn run(mut self, shutdown: CancellationToken) {
        let span = tracing::info_span!("ledger", worker = %self.worker_id);
        async move {
            let mut batch: Vec<Op> = Vec::with_capacity(FLUSH_OPS);
            loop {
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => break,
                    n = self.rx.recv_many(&mut batch, FLUSH_OPS) => if n == 0 { break },
                }
                let until = Instant::now() + FLUSH_EVERY;
                while batch.len() < FLUSH_OPS {
                    let room = FLUSH_OPS - batch.len();
                    tokio::select! {
                        n = self.rx.recv_many(&mut batch, room) => if n == 0 { break },
                        _ = tokio::time::sleep_until(until) => break,
                    }
                }
                self.flush(&mut batch, None, &shutdown).await;
            }
            // Final flush: everything still buffered, retried for a bounded time.
            self.rx.close();
            let give_up = Instant::now() + FINAL_FLUSH;
            let never = CancellationToken::new();
            while let Ok(op) = self.rx.try_recv() {
                batch.push(op);
                if batch.len() >= FLUSH_OPS {
                    self.flush(&mut batch, Some(give_up), &never).await;
                }
            }
            self.flush(&mut batch, Some(give_up), &never).await;
        }
        .instrument(span)
        .await
    }

    /// Writes a batch, retrying with backoff until it is written, `give_up` passes or
    /// `shutdown` fires (the loop then flushes once more). Empties `batch`.
    async fn flush(&self, batch: &mut Vec<Op>, give_up: Option<Instant>, shutdown: &CancellationToken) {
        if batch.is_empty() {
            return;
        }
        let mut starts = Vec::new();
        let mut finishes = Vec::new();
        let mut releases = Vec::new();
        for op in batch.drain(..) {
            match op {
                Op::Start { lane, id, attempt } => starts.push((lane, id, attempt)),
                Op::Finish(f) => finishes.push(f),
                Op::Release { lane, id } => releases.push((lane, id)),
            }
        }
        let mut delay = Duration::from_millis(50);
        loop {
            match self.write(&mut starts, &mut finishes, &mut releases).await {
                Ok(()) => return,
                Err(e) => {
                    metrics::counter!(fleet::metrics::REDIS_ERRORS).increment(1);
                    tracing::warn!(error = %e, pending = starts.len() + finishes.len() + releases.len(), retry_in_ms = delay.as_millis() as u64, "cannot write task records to Redis");
                }
            }
            if give_up.is_some_and(|g| Instant::now() + delay > g) {
                tracing::warn!("giving up on task records at shutdown");
                return;
            }
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => {
                    // Hand the rest back to the final flush.
                    batch.extend(starts.drain(..).map(|(lane, id, attempt)| Op::Start { lane, id, attempt }));
                    batch.extend(finishes.drain(..).map(Op::Finish));
                    batch.extend(releases.drain(..).map(|(lane, id)| Op::Release { lane, id }));
                    return;
                }
                _ = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(Duration::from_secs(5));
        }
    }

    /// Writes starts, then finishes, then releases; each part is cleared once written, so a
    /// retry does not repeat it.
    async fn write(
        &self,
        starts: &mut Vec<(Lane, String, u32)>,
        finishes: &mut Vec<Finished>,
        releases: &mut Vec<(Lane, String)>,
    ) -> fleet::Result<()> {
        if !starts.is_empty() {
            let registered = self.store.start(&self.worker_id, &self.group, self.lease_ms, self.status_ttl_ms, starts).await?;
            if !registered {
                self.gone.notify_one();
            }
            starts.clear();
        }
        if !finishes.is_empty() {
            self.store.finish(&self.worker_id, &self.group, self.status_ttl_ms, finishes).await?;
            finishes.clear();
            if let Some((instance, stats)) = &self.figures {
                self.store.set_outcomes(&self.worker_id, instance, &stats.outcomes()).await?;
            }
        }
        if !releases.is_empty() {
            let names = &self.store.names;
            let mut p = redis::pipe();
            for (lane, id) in releases.iter() {
                p.cmd("ZREM").arg(names.running(&self.group, *lane)).arg(id).ignore();
                p.cmd("SREM").arg(names.worker_running(&self.worker_id)).arg(format!("{lane}|{id}")).ignore();
            }
            self.store.pipe::<()>(&p).await?;
            releases.clear();
        }
        Ok(())
    }
}
