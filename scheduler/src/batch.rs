//! The batch loop ([`fleet::batch`]): fires the callbacks of complete batches and sweeps
//! stalled ones. Every replica runs it, from the moment its control loop has read the stream
//! up to its barrier (so it knows every callback already fired).
//!
//! * Every [`TICK`]: each callback due ([`fleet::batch::Batches::due`]) is published to
//!   `<ns>.submit` with its deterministic id `<batch>:<callback>` (confirmed), then its
//!   `BatchFired` record is appended. Two replicas firing at once publish the same id: the
//!   scheduler's dedupe drops the second copy. Refused (the normal lane Red, ingress full, the
//!   broker away), it is tried again at the next tick.
//! * Every [`SWEEP`]: batches that have not moved for [`fleet::batch::STALL`] have their
//!   pending members' states read from Redis (one pipelined read per [`SWEEP_MAX`] ids); final
//!   ones are appended as end records (a worker's own record was lost, or the final state was
//!   written elsewhere, e.g. a cancel before dispatch).
//!
//! Costs nothing while no batch is pending: no Redis command, no publish.

use std::sync::Arc;
use std::time::Duration;

use fleet::batch::Batches;
use fleet::broker::amqp;
use fleet::status::TaskState;
use fleet::Store;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::backpressure::{Pressure, Sample};

/// How often due callbacks are looked for (in memory).
pub const TICK: Duration = Duration::from_millis(200);
/// How often stalled batches are swept.
pub const SWEEP: Duration = Duration::from_secs(1);
/// Most pending ids read per sweep.
pub const SWEEP_MAX: usize = 5_000;

/// The loop (one per session).
pub struct BatchLoop {
    pub store: Store,
    pub conn: Arc<lapin::Connection>,
    pub batches: Batches,
    pub pressure: watch::Receiver<Sample>,
}

impl BatchLoop {
    /// Runs until `shutdown` (`Ok`) or a broker failure opening its channel (`Err`: the
    /// session restarts). Publish and Redis failures are logged and tried again.
    pub async fn run(self, shutdown: CancellationToken) -> fleet::Result<()> {
        let publisher = tokio::select! {
            p = amqp::confirm_channel(&self.conn) => p?,
            _ = shutdown.cancelled() => return Ok(()),
        };
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut sweep = tokio::time::interval(SWEEP);
        sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                _ = tick.tick() => self.fire(&publisher).await,
                _ = sweep.tick() => self.sweep(&publisher).await,
            }
        }
    }

    /// Publishes every due callback, then records it fired.
    ///
    /// # Cancel safety
    /// Not cancel safe: dropped after a publish, the callback may be in `<ns>.submit` without
    /// its fired record; the next firing publishes the same id again (a duplicate, dropped).
    async fn fire(&self, publisher: &amqp::Publisher) {
        if self.batches.is_empty() {
            return;
        }
        for due in self.batches.due() {
            let critical = due.envelope.get("lane").and_then(|l| l.as_str()) == Some("critical");
            if !critical && self.pressure.borrow().state == Pressure::Red {
                continue;
            }
            let id = fleet::batch::callback_id(&due.progress.id, due.callback);
            let body = match serde_json::to_vec(&due.envelope) {
                Ok(b) => b,
                Err(e) => {
                    tracing::warn!(error = %e, batch = %due.progress.id, "cannot encode a batch callback");
                    continue;
                }
            };
            let names = &self.store.names;
            let lane = if critical { "critical" } else { "normal" };
            let sent = match amqp::publish(
                publisher,
                &names.submit_exchange(),
                lane,
                &body,
                amqp::task_properties(&id, None),
            )
            .await
            {
                Ok(c) => amqp::confirmed(c).await,
                Err(e) => Err(e),
            };
            if let Err(e) = sent {
                tracing::warn!(error = %e, batch = %due.progress.id, callback = due.callback, "batch callback not taken by the broker; tried again shortly");
                continue;
            }
            let rec = fleet::batch::fired_record(
                &due.progress.id,
                due.callback,
                self.store.clock.now_ms(),
            );
            if let Err(e) = fleet::control::append(publisher, names, &rec).await {
                // Published but not recorded: the next tick publishes the same id again.
                tracing::warn!(error = %e, batch = %due.progress.id, "cannot record a fired callback");
                continue;
            }
            self.batches.apply(&rec);
            tracing::info!(batch = %due.progress.id, callback = due.callback, total = due.progress.total, succeeded = due.progress.succeeded, failed = due.progress.failed.len(), "batch callback fired");
        }
    }

    /// Reads the states of stalled batches' pending members and appends the final ones.
    async fn sweep(&self, publisher: &amqp::Publisher) {
        if self.batches.is_empty() {
            return;
        }
        let now = self.store.clock.now_ms();
        let stall = fleet::redis::millis(fleet::batch::STALL);
        for (batch, pending) in self.batches.stalled(now - stall, SWEEP_MAX) {
            let ids: Vec<&str> = pending.iter().map(String::as_str).collect();
            let states = match self.store.task_states(&ids).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::debug!(error = %e, "cannot read a stalled batch's states");
                    return;
                }
            };
            let recs: Vec<_> = pending
                .iter()
                .zip(states)
                .filter_map(|(id, s)| {
                    let s = s?;
                    let terminal = [
                        TaskState::Succeeded,
                        TaskState::Dead,
                        TaskState::Expired,
                        TaskState::Cancelled,
                    ]
                    .iter()
                    .any(|t| t.as_str() == s);
                    terminal.then(|| fleet::batch::end_record(&batch, id, &s, now))
                })
                .collect();
            if recs.is_empty() {
                self.batches.touch(&batch, now);
                continue;
            }
            tracing::info!(batch = %batch, ended = recs.len(), "a stalled batch's members found ended in Redis");
            let results = fleet::control::append_batch(publisher, &self.store.names, &recs).await;
            for (rec, r) in recs.iter().zip(results) {
                if r.is_ok() {
                    self.batches.apply(rec);
                }
            }
            self.batches.touch(&batch, now);
        }
    }
}
