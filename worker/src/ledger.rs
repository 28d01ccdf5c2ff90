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
//! A claim made while the ledger holds no record at all (an idle worker) is written by its
//! attempt directly: the batch would be that one claim, and the hand-offs to and from the
//! loop would only add to the time from delivery to start.
//!
//! Redis state may be lost (the broker holds every task), so the trade-offs lean towards never
//! stalling work: a claim that cannot be written is answered "unknown" at once and the attempt
//! runs anyway (at-least-once while Redis is down); an outcome that cannot be written is
//! retried with capped backoff, and its attempt stops waiting for it after [`OUTCOME_WAIT`]
//! (the ack is not held hostage by a dead Redis). When the channel is full, records are
//! dropped and counted.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use fleet::redis::Store;
use fleet::run::{Claim, ClaimRequest, Finished};

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
    Claim {
        req: ClaimRequest,
        reply: oneshot::Sender<Option<Claim>>,
    },
    /// An attempt ended (with an outcome, or released: see [`Finished::release`]); `written`
    /// is told once it is in Redis.
    Finish {
        fin: Finished,
        written: Option<oneshot::Sender<()>>,
    },
}

/// The sending side, used by task attempts. Cheap to clone; never blocks.
#[derive(Clone)]
pub struct Ledger {
    tx: mpsc::Sender<Op>,
    writer: Arc<Writer>,
}

/// What writing claims needs, shared by the batching loop and direct claims.
struct Writer {
    store: Store,
    worker_id: String,
    instance: String,
    group: String,
    run_lease: Duration,
    status_ttl: Duration,
    gone: Arc<Notify>,
    /// Records sent to the loop and not yet written, plus direct claims in flight: 0 means
    /// the ledger is idle.
    busy: AtomicUsize,
}

impl Writer {
    /// Writes claims (one `start` call); `None` answers every one "unknown" (Redis failed).
    async fn claim(&self, reqs: &[ClaimRequest]) -> Option<Vec<Claim>> {
        match self
            .store
            .claim(
                &self.worker_id,
                &self.group,
                &self.instance,
                self.run_lease,
                self.status_ttl,
                reqs,
            )
            .await
        {
            Ok((registered, answers)) => {
                if !registered {
                    self.gone.notify_one();
                }
                Some(answers)
            }
            Err(e) => {
                metrics::counter!(fleet::metrics::REDIS_ERRORS).increment(1);
                tracing::warn!(error = %e, tasks = reqs.len(), "cannot claim task attempts in Redis; running them unchecked");
                None
            }
        }
    }
}

/// Holds one unit of [`Writer::busy`] until dropped (a cancelled direct claim gives it back).
struct Busy<'a>(&'a AtomicUsize);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Ledger {
    /// The store the ledger writes to (for a read outside the ledger's batches).
    pub fn store(&self) -> &Store {
        &self.writer.store
    }

    /// Gives back this group's reservation of task `id` on `lane` (a task this worker sends
    /// back unclaimed: its claim, which would have taken the reservation, never happens).
    /// Errors: Redis could not answer — the reservation then lapses with its lease.
    pub async fn unreserve(&self, lane: fleet::Lane, id: &str) -> fleet::Result<()> {
        let w = &self.writer;
        w.store
            .unreserve(&[(w.group.clone(), lane, id.to_string())])
            .await
    }

    /// Marks task `id` cancelled by `c` (`cancel.lua` in its replay mode: not over a final
    /// state nor over a later run's record) — for a copy this worker refuses because its
    /// batch was cancelled as a whole while it has read no cancel record of the task's own
    /// (not yet appended, or never: the replica that took the batch's cancel stopped before
    /// it): without this its status could say `queued` until a second cancel of the batch.
    /// Errors: Redis could not answer (the status is then written by that second cancel).
    pub async fn mark_cancelled(&self, id: &str, c: &fleet::control::Cancel) -> fleet::Result<()> {
        let w = &self.writer;
        w.store
            .cancel(
                fleet::control::Mode::Replay,
                &[(id.to_string(), c.at_ms, c.by.clone(), c.reason.clone())],
                w.status_ttl,
            )
            .await
            .map(drop)
    }

    /// A ledger and its batching loop (run it with [`Batcher::run`]).
    pub fn new(
        store: Store,
        worker_id: String,
        instance: String,
        group: String,
        run_lease: Duration,
        status_ttl: Duration,
    ) -> (Ledger, Batcher) {
        let (tx, rx) = mpsc::channel(BUFFER);
        let writer = Arc::new(Writer {
            store,
            worker_id,
            instance,
            group,
            run_lease,
            status_ttl,
            gone: Arc::new(Notify::new()),
            busy: AtomicUsize::new(0),
        });
        let batcher = Batcher {
            rx,
            writer: writer.clone(),
            figures: None,
        };
        (Ledger { tx, writer }, batcher)
    }

    fn record(&self, op: Op) {
        self.writer.busy.fetch_add(1, Ordering::AcqRel);
        if let Err(e) = self.tx.try_send(op) {
            self.writer.busy.fetch_sub(1, Ordering::AcqRel);
            metrics::counter!(LEDGER_DROPPED).increment(1);
            match e {
                mpsc::error::TrySendError::Full(_) => {
                    tracing::warn!("ledger buffer full (Redis down?): task record dropped")
                }
                mpsc::error::TrySendError::Closed(_) => {
                    tracing::debug!("ledger closed: task record dropped")
                }
            }
        }
    }

    /// Claims an attempt: directly when the ledger is idle, else in the loop's next batch.
    /// `None` when Redis could not answer (the caller runs the attempt: at-least-once).
    ///
    /// # Cancel safety
    /// Cancel safe as far as the ledger goes: a dropped call leaves nothing to clean up in
    /// it, but the claim may still be written (the batch it joined goes on; a direct call
    /// already sent may land). The attempt then holds a claim nobody runs — as after a crash
    /// between claim and run — until its run lease lapses (heartbeats renew only tasks that
    /// still run here).
    pub async fn claim(&self, req: ClaimRequest) -> Option<Claim> {
        if self
            .writer
            .busy
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            let _busy = Busy(&self.writer.busy);
            // Boxed: the Redis call's future is most of an attempt's size otherwise, and every
            // attempt would carry (and move) it though only an idle worker's claims take this path.
            return Box::pin(self.writer.claim(std::slice::from_ref(&req)))
                .await
                .and_then(|mut a| a.pop());
        }
        let (reply, rx) = oneshot::channel();
        self.record(Op::Claim { req, reply });
        rx.await.ok().flatten()
    }

    /// Records an outcome and waits until it is written, at most [`OUTCOME_WAIT`]; true when
    /// written.
    pub async fn finish(&self, fin: Finished) -> bool {
        let (written, rx) = oneshot::channel();
        self.record(Op::Finish {
            fin,
            written: Some(written),
        });
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
    writer: Arc<Writer>,
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
        self.writer.gone.clone()
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
        self.flush(&mut batch, &mut finishes, Some(give_up), &never)
            .await;
    }

    /// Writes a batch: claims once (answered "unknown" on failure), outcomes until written,
    /// `give_up` passes or `shutdown` fires (left in `finishes` for the final flush). The
    /// first try sends the claims and the outcomes (with this worker's figures) together: on
    /// the one multiplexed Redis connection they go out as a pipeline and cost one round trip.
    async fn flush(
        &mut self,
        batch: &mut Vec<Op>,
        finishes: &mut Finishes,
        give_up: Option<Instant>,
        shutdown: &CancellationToken,
    ) {
        let taken = batch.len();
        let more = self.write(batch, finishes, give_up, shutdown).await;
        self.writer.busy.fetch_sub(taken + more, Ordering::AcqRel);
    }

    /// Writes the outcomes in `finishes` with the worker's current task figures (one `finish` call).
    async fn finish(&self, finishes: &Finishes) -> fleet::Result<()> {
        let fins: Vec<Finished> = finishes.iter().map(|(f, _)| f.clone()).collect();
        let figures = self
            .figures
            .as_ref()
            .map(|s| s.outcomes())
            .unwrap_or_default();
        let w = &self.writer;
        w.store
            .finish(
                &w.worker_id,
                &w.group,
                &w.instance,
                w.status_ttl,
                &fins,
                &figures,
            )
            .await
    }

    /// [`Batcher::flush`]'s work; returns how many more records it took from the channel
    /// while retrying.
    async fn write(
        &mut self,
        batch: &mut Vec<Op>,
        finishes: &mut Finishes,
        give_up: Option<Instant>,
        shutdown: &CancellationToken,
    ) -> usize {
        let mut claims = Vec::new();
        for op in batch.drain(..) {
            match op {
                Op::Claim { req, reply } => claims.push((req, reply)),
                Op::Finish { fin, written } => finishes.push((fin, written)),
            }
        }
        let reqs: Vec<ClaimRequest> = claims.iter().map(|(r, _)| r.clone()).collect();
        let w = &self.writer;
        let claimed = async {
            if reqs.is_empty() {
                return None;
            }
            Some(w.claim(&reqs).await)
        };
        let written = async {
            if finishes.is_empty() {
                return Ok(());
            }
            self.finish(finishes).await
        };
        let (claimed, written) = tokio::join!(claimed, written);
        if let Some(answers) = claimed {
            match answers {
                Some(answers) => {
                    for ((_, reply), a) in claims.into_iter().zip(answers) {
                        let _ = reply.send(Some(a));
                    }
                }
                None => {
                    for (_, reply) in claims {
                        let _ = reply.send(None);
                    }
                }
            }
        }
        match written {
            Ok(()) => return told(finishes, 0),
            Err(e) => {
                metrics::counter!(fleet::metrics::REDIS_ERRORS).increment(1);
                tracing::warn!(error = %e, pending = finishes.len(), "cannot write task outcomes to Redis; retrying");
            }
        }
        let mut more = 0;
        let mut delay = Duration::from_millis(50);
        loop {
            // Claims arriving meanwhile are not held up by the retry: each batch of them gets
            // its own `start` call at once, and is answered "unknown" only when that call
            // fails (answering without trying would run the attempt past start.lua's checks —
            // a cancel, a run elsewhere — whenever only the outcome write is failing).
            let mut claims = Vec::new();
            while let Ok(op) = self.rx.try_recv() {
                more += 1;
                match op {
                    Op::Claim { req, reply } => claims.push((req, reply)),
                    Op::Finish { fin, written } => finishes.push((fin, written)),
                }
            }
            if !claims.is_empty() {
                let reqs: Vec<ClaimRequest> = claims.iter().map(|(r, _)| r.clone()).collect();
                match self.writer.claim(&reqs).await {
                    Some(answers) => {
                        for ((_, reply), a) in claims.into_iter().zip(answers) {
                            let _ = reply.send(Some(a));
                        }
                    }
                    None => {
                        for (_, reply) in claims {
                            let _ = reply.send(None);
                        }
                    }
                }
            }
            if give_up.is_some_and(|g| Instant::now() + delay > g) {
                tracing::warn!(
                    pending = finishes.len(),
                    "giving up on task outcomes at shutdown"
                );
                finishes.clear();
                return more;
            }
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return more,
                _ = tokio::time::sleep(delay) => {}
            }
            delay = (delay * 2).min(Duration::from_secs(5));
            match self.finish(finishes).await {
                Ok(()) => return told(finishes, more),
                Err(e) => {
                    metrics::counter!(fleet::metrics::REDIS_ERRORS).increment(1);
                    tracing::warn!(error = %e, pending = finishes.len(), retry_in_ms = delay.as_millis() as u64, "cannot write task outcomes to Redis");
                }
            }
        }
    }
}

/// Tells whoever waits for the outcomes in `finishes` that they are written; returns `more`.
fn told(finishes: &mut Finishes, more: usize) -> usize {
    for (_, written) in finishes.drain(..) {
        if let Some(w) = written {
            let _ = w.send(());
        }
    }
    more
}
