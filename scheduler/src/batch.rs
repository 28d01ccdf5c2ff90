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
//!   written elsewhere, e.g. a cancel before dispatch), with the result of a succeeded member
//!   another member takes in `payload_from` (read in one more round trip, for those only).
//!
//! * Chains and DAGs ([`fleet::batch::dag`]): whenever an end record or a cancel reaches a
//!   batch with waiting members (woken by the fold, [`Batches::moved`], and at every tick),
//!   each waiting member whose parents all succeeded is published to `<ns>.submit` with its
//!   own id (confirmed), then its `BatchReleased` record appended; one a parent of which
//!   ended otherwise gets its status `dead` / `dependency_failed` (one round trip for all of
//!   them) and its end record appended, and the steps are computed again at once so a failure
//!   cascades down a whole chain in one pass. Two replicas releasing the same member publish
//!   the same id (the ingress dedupe drops the copy); two failing it write the same status
//!   and append the same end state (counted once).
//!
//! * A paused batch ([`fleet::control::Target::Batch`]) releases no waiting member and fires
//!   no callback until its resume; its published members wait in its hold queue
//!   ([`crate::pause`]).
//! * A batch cancelled as a whole ([`fleet::control::Op::BatchCancel`]) releases and fires
//!   nothing, ever ([`Batches::due`], [`Batches::steps`]).
//!
//! Costs nothing while no batch is pending: no Redis command, no publish.

use std::sync::Arc;
use std::time::Duration;

use fleet::batch::{Batches, Step};
use fleet::broker::amqp;
use fleet::status::{DeadReason, TaskState};
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
/// Most rounds of steps in one pass (a failure cascades one level per round).
const CASCADE_MAX: usize = 10_000;
/// Most members released per publish batch (confirms awaited together).
const RELEASE_BATCH: usize = 500;

/// The loop (one per session).
pub struct BatchLoop {
    pub store: Store,
    pub conn: Arc<lapin::Connection>,
    pub batches: Batches,
    pub pressure: watch::Receiver<Sample>,
    /// How long a status record lives (a dependency_failed member's).
    pub status_ttl: Duration,
    /// The pauses in force ([`crate::pause`]): a paused batch releases no waiting member and
    /// fires no callback until its resume.
    pub pauses: crate::pause::Pauses,
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
                // The timers first: a DAG whose end records never stop coming must not starve
                // the callbacks and the sweep (a wake-up not taken now waits for the next turn).
                _ = tick.tick() => {
                    self.step(&publisher).await;
                    self.fire(&publisher).await;
                }
                _ = sweep.tick() => self.sweep(&publisher).await,
                _ = self.batches.moved() => self.step(&publisher).await,
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
            // A paused batch's callbacks wait for its resume.
            if self.pauses.current().batch_paused(&due.progress.id) {
                continue;
            }
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

    /// Releases or fails the waiting members whose parents have ended, until none is left to
    /// decide (a cascade of failures in one pass, at most [`CASCADE_MAX`] rounds).
    ///
    /// # Cancel safety
    /// Not cancel safe, like [`Self::fire`]: a member published without its released record
    /// is published again (a duplicate, dropped by the ingress dedupe).
    async fn step(&self, publisher: &amqp::Publisher) {
        if self.batches.is_empty() {
            return;
        }
        for _ in 0..CASCADE_MAX {
            let steps = self.batches.steps();
            if steps.is_empty() {
                return;
            }
            let mut releases = Vec::new();
            let mut fails = Vec::new();
            let pauses = self.pauses.current();
            for s in steps {
                match s {
                    // A paused batch releases nothing until its resume (the next tick after it).
                    Step::Release { batch, .. } if pauses.batch_paused(&batch) => {}
                    Step::Release {
                        batch,
                        task,
                        envelope,
                    } => releases.push((batch, task, envelope)),
                    Step::Fail {
                        batch,
                        task,
                        lane,
                        detail,
                    } => fails.push((batch, task, lane, detail)),
                }
            }
            let mut progressed = false;
            for chunk in releases.chunks(RELEASE_BATCH) {
                progressed |= self.release(publisher, chunk).await;
            }
            if !fails.is_empty() {
                progressed |= self.fail(publisher, &fails).await;
            }
            if !progressed {
                // Refused (pressure, the broker away): tried again at the next tick.
                return;
            }
        }
    }

    /// Publishes released members (batch, task, envelope) together (their confirms awaited
    /// together), then appends the released records of those confirmed; `true` when any was
    /// recorded. A member on the normal lane waits while the normal lane is Red.
    async fn release(
        &self,
        publisher: &amqp::Publisher,
        releases: &[(String, String, serde_json::Value)],
    ) -> bool {
        let red = self.pressure.borrow().state == Pressure::Red;
        let mut go = Vec::with_capacity(releases.len());
        for (batch, task, envelope) in releases {
            let lane = envelope
                .get("lane")
                .and_then(|l| l.as_str())
                .unwrap_or("normal");
            if lane != "critical" && red {
                continue;
            }
            match serde_json::to_vec(envelope) {
                Ok(body) => go.push((batch, task, lane, body)),
                Err(e) => {
                    tracing::warn!(error = %e, batch = %batch, task = %task, "cannot encode a released batch member")
                }
            }
        }
        if go.is_empty() {
            return false;
        }
        let names = &self.store.names;
        let exchange = names.submit_exchange();
        let confirms = amqp::publish_batch(
            publisher,
            go.iter().map(|(_, task, lane, body)| amqp::Outgoing {
                exchange: &exchange,
                routing_key: lane,
                body,
                props: amqp::task_properties(task, None),
            }),
        )
        .await;
        let now = self.store.clock.now_ms();
        let mut recs = Vec::with_capacity(go.len());
        for ((batch, task, _, _), c) in go.iter().zip(confirms) {
            let sent = match c {
                Ok(c) => amqp::confirmed(c).await,
                Err(e) => Err(e),
            };
            match sent {
                Ok(()) => recs.push(fleet::batch::released_record(batch, task, now)),
                Err(e) => {
                    tracing::warn!(error = %e, batch = %batch, task = %task, "released batch member not taken by the broker; tried again shortly")
                }
            }
        }
        let results = fleet::control::append_batch(publisher, names, &recs).await;
        let mut any = false;
        for (rec, r) in recs.iter().zip(results) {
            match r {
                Ok(()) => {
                    self.batches.apply(rec);
                    any = true;
                    if let fleet::control::Op::BatchReleased { batch, task } = &rec.op {
                        tracing::info!(batch = %batch, task = %task, "batch member released: every task it waits for succeeded");
                    }
                }
                // Published but not recorded: the next step publishes the same id again.
                Err(e) => tracing::warn!(error = %e, "cannot record a released batch member"),
            }
        }
        any
    }

    /// Ends `fails` (batch, task, lane, why) `dead` with reason `dependency_failed`: their
    /// statuses first (one round trip; a member already final — cancelled meanwhile — keeps
    /// its state, which its end record then says), then their end records. `true` when any
    /// was recorded.
    async fn fail(
        &self,
        publisher: &amqp::Publisher,
        fails: &[(String, String, String, String)],
    ) -> bool {
        let mut writes = fleet::status::Writes::new();
        for (_, task, lane, detail) in fails {
            let lane = fleet::Lane::parse(lane).unwrap_or(fleet::Lane::Normal);
            writes.ended(task, lane, DeadReason::DependencyFailed, detail);
        }
        let kept = match self.store.write_statuses(&writes, self.status_ttl).await {
            Ok(k) => k,
            Err(e) => {
                tracing::warn!(error = %e, "cannot write dependency_failed statuses; tried again shortly");
                return false;
            }
        };
        let now = self.store.clock.now_ms();
        let recs: Vec<_> = fails
            .iter()
            .map(|(batch, task, _, _)| {
                let state = kept
                    .iter()
                    .find(|(id, _)| id == task)
                    .map_or(TaskState::Dead.as_str(), |(_, s)| s.as_str());
                fleet::batch::end_record(batch, task, state, now)
            })
            .collect();
        let results = fleet::control::append_batch(publisher, &self.store.names, &recs).await;
        let mut any = false;
        for ((rec, r), (batch, task, _, detail)) in recs.iter().zip(results).zip(fails) {
            match r {
                Ok(()) => {
                    self.batches.apply(rec);
                    any = true;
                    tracing::info!(batch = %batch, task = %task, detail = %detail, "batch member dead: dependency_failed");
                }
                Err(e) => {
                    tracing::warn!(error = %e, batch = %batch, task = %task, "cannot record a dependency_failed member; tried again shortly")
                }
            }
        }
        any
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
            let ended: Vec<(&String, String)> = pending
                .iter()
                .zip(states)
                .filter_map(|(id, s)| {
                    let s = s?;
                    TaskState::is_terminal_word(&s).then_some((id, s))
                })
                .collect();
            // A succeeded parent another member takes the result of (`payload_from`): its
            // result is read too (one more round trip, for those only), so the child gets it.
            let wanted = self.batches.results_wanted(&batch);
            let want: Vec<&str> = ended
                .iter()
                .filter(|(id, s)| s == TaskState::Succeeded.as_str() && wanted.contains(*id))
                .map(|(id, _)| id.as_str())
                .collect();
            let texts = match self.store.task_results(&want).await {
                Ok(t) => t,
                Err(e) => {
                    tracing::debug!(error = %e, "cannot read a stalled batch's results");
                    return;
                }
            };
            let found: std::collections::HashMap<&str, serde_json::Value> = want
                .iter()
                .zip(texts)
                .filter_map(|(id, t)| {
                    let t = t.filter(|t| t.len() <= fleet::status::MAX_STATUS_TEXT)?;
                    Some((*id, serde_json::from_str(&t).ok()?))
                })
                .collect();
            let recs: Vec<_> = ended
                .iter()
                .map(|(id, s)| {
                    let result = found.get(id.as_str()).cloned();
                    fleet::batch::end_record_with(&batch, id, s, result, now)
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
