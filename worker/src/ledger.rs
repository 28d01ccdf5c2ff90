//! The ledger: a worker's claims and outcomes in Redis, batched across concurrent attempts.
//!
//! Every attempt makes two Redis writes, both awaited, neither made alone:
//! * a **claim** before it runs (the `start` script: exactly one run per attempt, crash
//!   counting, status `running`), and
//! * its **outcome** before its delivery is acked (the `finish` script), so an acked task is
//!   never left `running` by a crash — write the batch, then ack the batch.
//!
//! One background loop takes whatever records are waiting (at most [`FLUSH_OPS`]) and writes
//! them with one `start` and one `finish` call; while that call is in flight new records
//! gather for the next one, so batches grow with load and an idle worker pays no batching
//! delay. At a few thousand tasks per second that is a few hundred Redis calls per second.
//!
//! Redis state may be lost (the broker holds every task), so the trade-offs lean towards never
//! stalling work: a claim that cannot be written is answered "unknown" at once and the attempt
//! runs anyway (at-least-once while Redis is down); an outcome that cannot be written is
//! retried with capped backoff, and its attempt stops waiting for it after [`OUTCOME_WAIT`]
//! (the ack is not held hostage by a dead Redis). When the channel is full, records are
//! dropped and counted.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use fleet::lease::{Claim, ClaimRequest, Finished};
use fleet::store::Store;

use crate::stats::Stats;

/// Largest batch.
pub const FLUSH_OPS: usize = 256;
/// Records buffered while Redis is slow or down; beyond that, records are dropped.
pub const BUFFER: usize = 16_384;
/// How long an attempt waits for its outcome to be written before it acks anyway.
pub const OUTCOME_WAIT: Duration = Duration::from_secs(3);
/// How long the final flush at shutdown keeps retrying.
const FINAL_FLUSH: Duration = Duration::from_secs(5);

/// One record.
#[derive(Debug)]
pub enum Op {
    /// Claim an attempt before running it.
    Claim { req: ClaimRequest, reply: oneshot::Sender<Option<Claim>> },
    /// An attempt ended (with an outcome, or released: see [`Finished::release`]); `written`
    /// is told once it is in Redis.
    Finish { fin: Finished, written: Option<oneshot::Sender<()>> },
}

/// The sending side, used by task attempts. Cheap to clone; never blocks.
#[derive(Clone)]
pub struct Ledger {
    tx: mpsc::Sender<Op>,
}

impl Ledger {
    /// A ledger and its batching loop (run it with [`Batcher::run`]).
    pub fn new(store: Store, worker_id: String, instance: String, group: String, run_lease: Duration, status_ttl: Duration) -> (Ledger, Batcher) {
        let (tx, rx) = mpsc::channel(BUFFER);
        let batcher = Batcher { rx, store, worker_id, instance, group, run_lease, status_ttl, gone: Arc::new(Notify::new()), figures: None };
        (Ledger { tx }, batcher)
    }

    fn record(&self, op: Op) {
        if let Err(e) = self.tx.try_send(op) {
            metrics::counter!(LEDGER_DROPPED).increment(1);
            match e {
                mpsc::error::TrySendError::Full(_) => tracing::warn!("ledger buffer full (Redis down?): task record dropped"),
                mpsc::error::TrySendError::Closed(_) => tracing::debug!("ledger closed: task record dropped"),
            }
        }
    }

    /// Claims an attempt. `None` when Redis could not answer (the caller runs the attempt:
    /// at-least-once). Cancel safe.
    pub async fn claim(&self, req: ClaimRequest) -> Option<Claim> {
        let (reply, rx) = oneshot::channel();
        self.record(Op::Claim { req, reply });
        rx.await.ok().flatten()
    }

    /// Records an outcome and waits until it is written, at most [`OUTCOME_WAIT`]; true when
    /// written.
    pub async fn finish(&self, fin: Finished) -> bool {
        let (written, rx) = oneshot::channel();
        self.record(Op::Finish { fin, written: Some(written) });
        matches!(tokio::time::timeout(OUTCOME_WAIT, rx).await, Ok(Ok(())))
    }

    /// Releases an attempt that ended without an outcome (not awaited).
    pub fn release(&self, fin: Finished) {
        self.record(Op::Finish { fin, written: None });
    }
}

/// Counter of records dropped because the ledger's buffer was full.
pub const LEDGER_DROPPED: &str = "fleet_worker_ledger_dropped_total";

/// The batching loop.
pub struct Batcher {
    rx: mpsc::Receiver<Op>,
    store: Store,
    worker_id: String,
    instance: String,
    group: String,
    run_lease: Duration,
    status_ttl: Duration,
    gone: Arc<Notify>,
    /// This worker's figures, published with each batch of outcomes (so `GET /v1/workers`
    /// is current); `None` publishes nothing.
    figures: Option<Arc<Stats>>,
}

/// Outcomes waiting to be written, with whoever waits for them.
type Finishes = Vec<(Finished, Option<oneshot::Sender<()>>)>;

impl Batcher {
    /// Publishes `stats`' outcome totals with every batch of outcomes written.
    pub fn with_figures(mut self, stats: Arc<Stats>) -> Self {
        self.figures = Some(stats);
        self
    }

    /// Notified when a claim finds the worker's registration gone (the heartbeat registers
    /// again).
    pub fn gone_signal(&self) -> Arc<Notify> {
        self.gone.clone()
    }

    /// Batches and writes until `shutdown`, then writes what is left (bounded in time).
    pub async fn run(mut self, shutdown: CancellationToken) {
        let mut batch: Vec<Op> = Vec::with_capacity(FLUSH_OPS);
        let mut finishes: Finishes = Vec::new();
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                n = self.rx.recv_many(&mut batch, FLUSH_OPS) => if n == 0 { break },
            }
            self.flush(&mut batch, &mut finishes, None, &shutdown).await;
        }
        // Final flush: everything still buffered, retried for a bounded time.
        self.rx.close();
        let give_up = Instant::now() + FINAL_FLUSH;
        let never = CancellationToken::new();
        while let Ok(op) = self.rx.try_recv() {
            batch.push(op);
        }
        self.flush(&mut batch, &mut finishes, Some(give_up), &never).await;
    }

    /// Writes a batch: claims once (answered "unknown" on failure), outcomes until written,
    /// `give_up` passes or `shutdown` fires (left in `finishes` for the final flush).
    async fn flush(&mut self, batch: &mut Vec<Op>, finishes: &mut Finishes, give_up: Option<Instant>, shutdown: &CancellationToken) {
        let mut claims = Vec::new();
        for op in batch.drain(..) {
            match op {
                Op::Claim { req, reply } => claims.push((req, reply)),
                Op::Finish { fin, written } => finishes.push((fin, written)),
            }
        }
        if !claims.is_empty() {
            let reqs: Vec<ClaimRequest> = claims.iter().map(|(r, _)| r.clone()).collect();
            match self.store.claim(&self.worker_id, &self.group, &self.instance, self.run_lease, self.status_ttl, &reqs).await {
                Ok((registered, answers)) => {
                    if !registered {
                        self.gone.notify_one();
                    }
                    for ((_, reply), a) in claims.into_iter().zip(answers) {
                        let _ = reply.send(Some(a));
                    }
                }
                Err(e) => {
                    metrics::counter!(fleet::metrics::REDIS_ERRORS).increment(1);
                    tracing::warn!(error = %e, tasks = claims.len(), "cannot claim task attempts in Redis; running them unchecked");
                    for (_, reply) in claims {
                        let _ = reply.send(None);
                    }
                }
            }
        }
        let mut delay = Duration::from_millis(50);
        while !finishes.is_empty() {
            let fins: Vec<Finished> = finishes.iter().map(|(f, _)| f.clone()).collect();
            match self.store.finish(&self.worker_id, &self.group, &self.instance, self.status_ttl, &fins).await {
                Ok(()) => {
                    for (_, written) in finishes.drain(..) {
                        if let Some(w) = written {
                            let _ = w.send(());
                        }
                    }
                    if let Some(stats) = &self.figures {
                        if let Err(e) = self.store.set_outcomes(&self.worker_id, &self.instance, &stats.outcomes()).await {
                            tracing::debug!(error = %e, "cannot publish the task figures (the heartbeat does it again)");
                        }
                    }
                    return;
                }
                Err(e) => {
                    metrics::counter!(fleet::metrics::REDIS_ERRORS).increment(1);
                    tracing::warn!(error = %e, pending = finishes.len(), retry_in_ms = delay.as_millis() as u64, "cannot write task outcomes to Redis");
                }
            }
            // Claims arriving meanwhile are not held up by the retry: Redis is failing.
            while let Ok(op) = self.rx.try_recv() {
                match op {
                    Op::Claim { reply, .. } => {
                        let _ = reply.send(None);
                    }
                    Op::Finish { fin, written } => finishes.push((fin, written)),
                }
            }
            if give_up.is_some_and(|g| Instant::now() + delay > g) {
                tracing::warn!(pending = finishes.len(), "giving up on task outcomes at shutdown");
                finishes.clear();
                return;
            }
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(Duration::from_secs(5));
        }
    }
}
