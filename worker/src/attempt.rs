//! One attempt of one task: from a delivery to exactly one outcome.
//!
//! ```text
//! delivery ─ parse ──(bad)──────────────────────────────► dead (reason = refusal code), ack
//!              │
//!              ├ start recorded (ledger, status running)
//!              ├ deadline passed? ─────────────────────► expired: dead-letter, ack
//!              └ run handler, cut at min(deadline, max_task_ms)
//!                   ├ Ok ─────────────────────────────────► succeeded, ack
//!                   ├ Retryable, attempts left ───────────► retried: republish via a delay tier, ack
//!                   │   (the policy, backoff and tiers: [`crate::retry`])
//!                   ├ Retryable at the last attempt ──────► dead (max_attempts), ack
//!                   ├ Permanent ──────────────────────────► dead (permanent_error), ack
//!                   ├ deadline reached ───────────────────► expired: dead-letter, ack
//!                   └ cancelled by an operator ────────────► cancelled (stopped: see crate::cancel),
//!                                                             kept in <ns>.cancelled, ack
//! a cancelled task's copy (start.lua, or this worker's memory of the control stream) ► kept in
//!                                                             <ns>.cancelled (confirmed), acked, never run
//! any publish refused or channel gone ────────────────────► failed: nack + requeue (the broker keeps it);
//!                                                             the attempt counts as used: its next copy
//!                                                             runs as a new attempt (`Finished::spent`)
//! ```
//!
//! The ack always comes last: after the handler, and after the broker confirmed any retry or
//! dead-letter copy. A crash anywhere before it leaves the delivery unacked, and the broker
//! gives it to another worker (at-least-once). A handler panic is caught (the handler runs in
//! its own task) and counts as a retryable failure.

use std::sync::Arc;
use std::time::Duration;

use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use lapin::Channel;
use serde_json::Value;
use tokio::sync::OwnedSemaphorePermit;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use fleet::broker::amqp::{
    headers, task_properties, ATTEMPTS_HEADER, DETAIL_HEADER, REASON_HEADER, WORKER_HEADER,
};
use fleet::metrics as m;
use fleet::process::Stage;
use fleet::run::{Claim, ClaimRequest, Finished};
use fleet::status::truncate;
use fleet::status::{DeadReason, TaskState};
use fleet::{Envelope, Lane, Names, PerLane};

use crate::acks::Slot;
use crate::broker::Broker;
use crate::eject::Ejector;
use crate::executor::{Handlers, TaskContext, TaskError};
use crate::ledger::Ledger;
use crate::retry::{self, Backoff, Fate};
use crate::stats::Stats;

/// Longest header text (AMQP headers travel in one frame; keep them small).
pub(crate) const MAX_HEADER_TEXT: usize = 1024;

/// What every attempt needs, shared by all of them.
pub struct Shared {
    pub worker_id: Arc<str>,
    pub group: String,
    pub names: Names,
    pub handlers: Handlers,
    pub broker: Arc<Broker>,
    pub ledger: Ledger,
    pub stats: Arc<Stats>,
    pub ejector: Ejector,
    pub backoff: Backoff,
    pub max_task: Duration,
    /// Largest delivery parsed (fleet's own copies: see [`fleet::task::internal_limit`]).
    pub max_task_bytes: usize,
    pub default_max_attempts: u32,
    /// The fleet's clock (Redis time) for deadlines and waits.
    pub clock: fleet::redis::Clock,
    /// Normal runs hold it shared; a crash suspect holds it alone (runs in isolation).
    pub isolation: Arc<tokio::sync::RwLock<()>>,
    /// The stage attempts and handler runs are spawned on: the drain waits for it within the
    /// grace, and stopping it cuts every run now (hard stop).
    pub work: Stage,
    /// Per-task metric handles, registered once.
    pub meters: PerLane<Meters>,
    /// Keeps the deadline timers firing while a handler blocks its thread.
    pub nudge: Arc<crate::nudge::Nudge>,
    /// The cancels this worker knows (from the control stream) and the runs they stop.
    pub cancels: Arc<crate::cancel::CancelBoard>,
    /// A cancelled exec run's time between SIGTERM and SIGKILL (`FLEET_CANCEL_GRACE_MS`).
    pub cancel_grace: Duration,
}

/// One lane's per-task metric handles, registered once per worker: a labelled
/// `metrics::counter!` is a registry lookup (label hashing, a `String` for the group) per call,
/// which every task paid three times.
pub struct Meters {
    /// `fleet_task_wait_seconds{lane}`: submission to start.
    wait: metrics::Histogram,
    /// `fleet_task_run_seconds{group, lane}`: the handler's run.
    run: metrics::Histogram,
    /// `fleet_tasks_completed_total{group, lane, outcome}`, one per [`Outcome`] (in
    /// [`Outcome::ALL`] order).
    completed: [metrics::Counter; 6],
}

impl Meters {
    /// The handles of `group`'s `lane` (the recorder must be installed first:
    /// [`fleet::metrics::install`]).
    pub fn new(group: &str, lane: Lane) -> Self {
        let l = lane.as_str();
        Meters {
            wait: metrics::histogram!(m::TASK_WAIT, "lane" => l),
            run: metrics::histogram!(m::TASK_RUN, "group" => group.to_string(), "lane" => l),
            completed: Outcome::ALL.map(|o| metrics::counter!(m::TASKS_COMPLETED, "group" => group.to_string(), "lane" => l, "outcome" => o.as_str())),
        }
    }

    fn completed(&self, o: Outcome) -> &metrics::Counter {
        &self.completed[o as usize]
    }
}

/// How an attempt ended, as counted in `fleet_tasks_completed_total{outcome}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Succeeded,
    Retried,
    Dead,
    Expired,
    /// Could not be recorded in the broker: nacked back to it.
    Failed,
    /// Stopped by an operator's cancel (or, never run, dropped as cancelled).
    Cancelled,
}

impl Outcome {
    /// Every outcome, in discriminant order.
    pub const ALL: [Outcome; 6] = [
        Outcome::Succeeded,
        Outcome::Retried,
        Outcome::Dead,
        Outcome::Expired,
        Outcome::Failed,
        Outcome::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Succeeded => "succeeded",
            Outcome::Retried => "retried",
            Outcome::Dead => "dead",
            Outcome::Expired => "expired",
            Outcome::Failed => "failed",
            Outcome::Cancelled => "cancelled",
        }
    }
}

/// How long past the grace a graceful handler's cancelled run is awaited before it is dropped.
const CANCEL_MARGIN: Duration = Duration::from_secs(2);

/// How often a held copy asks again whether the run of its attempt elsewhere has ended.
const WAIT_POLL: Duration = Duration::from_millis(500);

/// Handles one delivery. `slot` is its place in its channel's ack window (dropped unacked when
/// it is settled another way); `channel` keeps the delivery's channel open until it is acked;
/// `permit` is the lane slot, given back when this returns.
pub async fn handle(
    shared: Arc<Shared>,
    lane: Lane,
    delivery: Delivery,
    slot: Slot,
    channel: Arc<Channel>,
    permit: OwnedSemaphorePermit,
) {
    let _keep = (channel, permit);
    let env = match Envelope::from_slice(&delivery.data, shared.max_task_bytes) {
        Ok(env) => env,
        Err(reject) => return Box::pin(refuse(&shared, lane, delivery, reject)).await,
    };
    let base = env.attempt.saturating_add(1);
    let span = tracing::info_span!("task", task.id = %fleet::task::escape(&env.id), kind = %fleet::task::escape(&env.kind), lane = %lane, attempt = base);
    // Only the scheduler publishes with this header (see `amqp::PROBE_HEADER`).
    let probe =
        fleet::broker::amqp::header_text(&delivery.properties, fleet::broker::amqp::PROBE_HEADER)
            .is_some();
    attempt_task(shared, lane, delivery, slot, env, base, probe)
        .instrument(span)
        .await
}

/// The run slot an attempt holds: shared with other runs, or alone. Held for its `Drop`.
#[allow(dead_code)]
enum RunGuard {
    Shared(tokio::sync::OwnedRwLockReadGuard<()>),
    Alone(tokio::sync::OwnedRwLockWriteGuard<()>),
}

/// One delivery and its parsed envelope, as claiming and settling its attempt see them.
#[derive(Clone, Copy)]
struct Task<'a> {
    shared: &'a Shared,
    lane: Lane,
    delivery: &'a Delivery,
    env: &'a Envelope,
    /// A scheduler health probe (see [`attempt_task`]).
    probe: bool,
}

/// Claims the attempt (exactly one run per attempt; see `run/start.lua`) and takes its run
/// slot. `None` when this copy must not run; it has then been settled here (a duplicate acked,
/// a lost task dead-lettered) or left to the broker (its channel is gone).
///
/// A scheduler health probe that died with its worker is dropped (acked), never dead-lettered
/// nor counted as a user's task.
async fn claim(
    task: Task<'_>,
    slot: &mut Slot,
    base: u32,
    max_attempts: u32,
) -> Option<(u32, RunGuard)> {
    let Task {
        shared,
        lane,
        delivery,
        env,
        probe,
    } = task;
    let mut req = ClaimRequest {
        lane,
        id: env.id.clone(),
        base,
        max_attempts,
        isolated: false,
        key: env.key.clone(),
    };
    let mut alone: Option<tokio::sync::OwnedRwLockWriteGuard<()>> = None;
    // The attempt number Redis last gave this copy: a crash suspect's is one past its base.
    let mut known = base;
    loop {
        let run_as = match shared.ledger.claim(req.clone()).await {
            // Redis could not answer: run it (at-least-once while Redis is down), under the
            // number it last gave (its retry, base + 1 past it, is then a new attempt).
            None => known,
            Some(Claim::Run(n)) => n,
            Some(Claim::Isolate(n)) => {
                known = n;
                tracing::warn!(attempt = n, "in flight when its worker died: runs alone until it ends or crashes on its own");
                // Already held when a re-claim answers `iso` again (the record changed owner
                // in between): taking the write lock a second time would wait on itself.
                if alone.is_none() {
                    alone = Some(shared.isolation.clone().write_owned().await);
                }
                req.isolated = true;
                continue;
            }
            Some(Claim::Wait) => {
                // Another live process runs it now: wait holding nothing, so this process
                // runs its other tasks meanwhile (a claim that answers `iso` again retakes it).
                alone = None;
                req.isolated = false;
                if !delivery.acker.usable() {
                    return None;
                }
                tokio::select! {
                    _ = shared.work.stopping() => return None,
                    _ = tokio::time::sleep(WAIT_POLL) => {}
                }
                continue;
            }
            Some(Claim::Cancelled) => {
                // Kept in `<ns>.cancelled` first (a bulk retry runs it again from there); not
                // kept, the copy goes back to the broker and is handled again.
                if !probe && !keep_cancelled(shared, delivery, env, env.attempt).await {
                    return None;
                }
                tracing::info!(
                    "a cancelled task: kept in the cancelled queue, acked without running"
                );
                if !probe {
                    shared.meters[lane]
                        .completed(Outcome::Cancelled)
                        .increment(1);
                }
                slot.ack().await;
                return None;
            }
            Some(Claim::Duplicate) => {
                tracing::info!("a copy of an attempt that already ran or runs elsewhere: acked without running");
                if !probe {
                    batch_end_again(shared, env).await;
                }
                metrics::counter!(m::DUPLICATE_DELIVERIES, "lane" => lane.as_str()).increment(1);
                slot.ack().await;
                return None;
            }
            Some(Claim::Spent(n)) => {
                tracing::warn!(
                    attempt = n,
                    "task dead: its last attempt ran, but the broker did not confirm its outcome"
                );
                let error = "its last attempt ran, but the broker did not confirm its outcome";
                let r = if probe {
                    Ok(())
                } else {
                    Box::pin(dead_letter(
                        shared,
                        env,
                        n,
                        DeadReason::MaxAttempts.as_str(),
                        error,
                    ))
                    .await
                };
                match r {
                    Ok(()) => {
                        slot.ack().await;
                        if !probe {
                            shared.stats.outcome("dead");
                            shared.meters[lane].completed(Outcome::Dead).increment(1);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot dead-letter a spent task; requeued");
                        nack_requeue(delivery).await;
                    }
                }
                return None;
            }
            Some(Claim::Dead(n)) if probe => {
                tracing::info!(attempt = n, "a health probe lost with its worker: dropped");
                slot.ack().await;
                metrics::counter!(m::PROBES_COMPLETED, "group" => shared.group.clone(), "outcome" => "dead").increment(1);
                return None;
            }
            Some(Claim::Dead(n)) => {
                let error =
                    "the worker process died while running this task alone, on its last attempt";
                tracing::warn!(
                    attempt = n,
                    "task dead: its worker died while running it (worker_lost)"
                );
                match Box::pin(dead_letter(shared, env, n, "worker_lost", error)).await {
                    Ok(()) => {
                        slot.ack().await;
                        shared.stats.outcome("dead");
                        shared.meters[lane].completed(Outcome::Dead).increment(1);
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot dead-letter a lost task; requeued");
                        nack_requeue(delivery).await;
                    }
                }
                return None;
            }
        };
        let slot = match alone {
            Some(g) => RunGuard::Alone(g),
            None => RunGuard::Shared(shared.isolation.clone().read_owned().await),
        };
        return Some((run_as, slot));
    }
}

/// `probe`: a scheduler health probe, counted in `fleet_probes_completed_total` and left out
/// of the worker's task figures (metrics, `/status`, `GET /v1/workers`).
async fn attempt_task(
    shared: Arc<Shared>,
    lane: Lane,
    delivery: Delivery,
    mut slot: Slot,
    env: Envelope,
    base: u32,
    probe: bool,
) {
    let max_attempts = env.max_attempts_or(shared.default_max_attempts);
    let task = Task {
        shared: &shared,
        lane,
        delivery: &delivery,
        env: &env,
        probe,
    };
    let submitted_ms = env.submitted_at.map(|t| t.timestamp_millis());
    // Cancelled (this worker read it in the control stream): never claimed, never run — even
    // while Redis is without the mark (start.lua refuses it otherwise).
    if let Some(cancel) = (!probe)
        .then(|| shared.cancels.cancel_of_env(&env))
        .flatten()
    {
        // Kept in `<ns>.cancelled` before the ack (see `keep_cancelled`).
        if !keep_cancelled(&shared, &delivery, &env, env.attempt).await {
            return;
        }
        // Refused for its batch's cancel alone (this worker has read no cancel record of its
        // own: not appended yet — the API appends members' records in paced chunks after the
        // batch's — or never, when the replica that took the cancel stopped): its status is
        // written here (idempotent with the API's mark), or it could stay `queued`.
        if shared.cancels.cancel_of(&env.id, submitted_ms).is_none() {
            if let Err(e) = shared.ledger.mark_cancelled(&env.id, &cancel).await {
                tracing::warn!(error = %e, "cannot mark a member of a cancelled batch cancelled; a second cancel of the batch writes it");
            }
        }
        batch_end(&shared, &env, TaskState::Cancelled.as_str(), None).await;
        tracing::info!("a cancelled task: kept in the cancelled queue, acked without running");
        if let Err(e) = shared.ledger.unreserve(lane, &env.id).await {
            tracing::debug!(error = %e, "cannot give back a cancelled task's reservation; it lapses with its lease");
        }
        shared.meters[lane]
            .completed(Outcome::Cancelled)
            .increment(1);
        slot.ack().await;
        return;
    }
    // After the cancel check: a cancelled task is dropped here, not sent on to another group.
    if !probe && shared.handlers.get(&env.kind).is_none() {
        reroute(task, &mut slot).await;
        return;
    }
    let Some((attempt, _slot)) = claim(task, &mut slot, base, max_attempts).await else {
        return;
    };
    // Counted as running until this guard drops, on every way out (issue 37 item 4).
    let _running = shared.stats.running_guard(lane, &env.id);
    if let Some(k) = &env.key {
        shared.stats.set_key(&env.id, k);
    }
    let now = shared.clock.now();
    if let Some(submitted) = env.submitted_at {
        let wait = (now - submitted).to_std().unwrap_or(Duration::ZERO);
        shared.meters[lane].wait.record(wait.as_secs_f64());
        shared.stats.waits.record(wait);
        if attempt == 1 && !probe {
            let span = (submitted.into(), now.into());
            fleet::trace::record("queue wait", &env, Some(&shared.group), 1, span, None);
        }
    }

    let fate = if env.is_expired(now) {
        Fate::Expired {
            detail: "deadline passed before the task started".into(),
        }
    } else {
        let Some((result, took)) = run(&shared, &env, attempt, probe).await else {
            // Hard stop: no outcome; the broker gets the task back with the connection, and
            // its next copy runs this attempt again.
            shared
                .ledger
                .release(Finished::release(lane, env.id.clone(), attempt));
            return;
        };
        shared.meters[lane].run.record(took.as_secs_f64());
        // A run an operator stopped says nothing of this worker's health: it counts neither
        // as a run nor as an error towards outlier ejection.
        let stopped = !probe && shared.cancels.cancel_of(&env.id, submitted_ms).is_some();
        if !probe && !stopped {
            shared.stats.ran(result.is_ok(), took);
        }
        match &result {
            _ if stopped => {}
            Ok(_) => shared.ejector.record(false),
            Err(TaskError::Permanent(_)) => {}
            Err(_) => shared.ejector.record(true),
        }
        let time_left = env
            .deadline
            .map(|d| (d - shared.clock.now()).to_std().unwrap_or(Duration::ZERO));
        retry::decide(result, attempt, max_attempts, time_left, &shared.backoff)
    };
    // Cancelled while it ran (its run was stopped), or as it ended: the attempt ends
    // `cancelled` whatever the handler answered — never retried, never dead-lettered.
    if let Some(c) = (!probe)
        .then(|| shared.cancels.cancel_of(&env.id, submitted_ms))
        .flatten()
    {
        tracing::info!(by = %c.by, reason = %fleet::task::escape(&c.reason), "task cancelled: its attempt ended");
        shared.meters[lane]
            .completed(Outcome::Cancelled)
            .increment(1);
        if !shared
            .ledger
            .finish(Finished::cancelled(
                lane,
                env.id.clone(),
                attempt,
                &c.by,
                &c.reason,
            ))
            .await
        {
            tracing::warn!(
                "cancel not yet written to Redis (retried in the background); acking anyway"
            );
        }
        // Kept in `<ns>.cancelled` before the ack; not kept, the copy goes back to the broker
        // and its next reading (this worker's memory, or start.lua) keeps it.
        if !keep_cancelled(&shared, &delivery, &env, attempt).await {
            return;
        }
        batch_end(&shared, &env, TaskState::Cancelled.as_str(), None).await;
        if slot.usable() {
            slot.ack().await;
        }
        return;
    }

    let settling = fleet::trace::enabled().then(std::time::SystemTime::now);
    let outcome = settle(task, &mut slot, (attempt, max_attempts), fate).await;
    if let Some(start) = settling.filter(|_| !probe) {
        let span = (start, std::time::SystemTime::now());
        let (group, word) = (Some(&*shared.group), Some(outcome.as_str()));
        fleet::trace::record("ack", &env, group, attempt, span, word);
    }
    if probe {
        metrics::counter!(m::PROBES_COMPLETED, "group" => shared.group.clone(), "outcome" => outcome.as_str()).increment(1);
    } else {
        shared.meters[lane].completed(outcome).increment(1);
    }
}

/// Runs the handler in its own task, cut at the run deadline, stopped by an operator's cancel
/// (`probe`: a health probe, never cancelled). `None` on a hard stop.
async fn run(
    shared: &Shared,
    env: &Envelope,
    attempt: u32,
    probe: bool,
) -> Option<(Result<Value, TaskError>, Duration)> {
    let started = Instant::now();
    let to_deadline = env
        .deadline
        .map(|d| (d - shared.clock.now()).to_std().unwrap_or(Duration::ZERO));
    let (limit, by_deadline) = match to_deadline {
        Some(left) if left <= shared.max_task => (left, true),
        _ => (shared.max_task, false),
    };
    let Some(handler) = shared.handlers.get(&env.kind) else {
        return Some((
            Err(TaskError::Permanent(format!("unknown kind `{}`", env.kind))),
            started.elapsed(),
        ));
    };
    let cancel = shared.work.token().child_token();
    let stop = CancellationToken::new();
    // A probe is never cancelled: its watch is a token nobody fires.
    let watch = (!probe).then(|| {
        shared
            .cancels
            .watch(&env.id, env.submitted_at.map(|t| t.timestamp_millis()))
    });
    let cancelled = watch
        .as_ref()
        .map_or_else(CancellationToken::new, |w| w.token.clone());
    // Cancelled between the check before the claim and now (the stream's record came while the
    // claim was written): the handler is not started at all.
    if cancelled.is_cancelled() {
        return Some((
            Err(TaskError::retryable("cancelled by an operator")),
            Duration::ZERO,
        ));
    }
    let graceful = handler.stops_gracefully();
    let span = (!probe)
        .then(|| fleet::trace::Live::start("run", env, Some(&shared.group), attempt))
        .flatten();
    let ctx = TaskContext {
        trace: fleet::trace::for_handler(env, span.as_ref()).cloned(),
        envelope: env.clone(),
        attempt,
        worker_id: shared.worker_id.clone(),
        deadline: env.deadline,
        run_deadline: started + limit,
        cancel: cancel.clone(),
        stop: stop.clone(),
        cancel_grace: shared.cancel_grace,
    };
    // `call` runs inside the spawned task, so a handler that panics while building its future
    // is caught like one that panics while running it (and never unwinds through this attempt,
    // which would leave the delivery unacked and the slot taken).
    let _running = shared.nudge.enter();
    let mut join = shared
        .work
        .spawn_here(async move { handler.call(ctx).await });
    let result = tokio::select! {
        biased;
        r = &mut join => match r {
            Ok(r) => r,
            Err(e) if e.is_panic() => {
                let msg = panic_message(e.into_panic());
                tracing::error!(panic = %msg, "handler panicked");
                Err(TaskError::Retryable(format!("handler panicked: {msg}")))
            }
            Err(_) => Err(TaskError::retryable("handler task cancelled")),
        }
        // A handler that times its own I/O by the run deadline (the http executor) fails at
        // the very instant the run would have been cut: the deadline ended that run, not a
        // retryable fault (which could otherwise be retried with a sliver of time left).
        .map_err(|e| if by_deadline && Instant::now() >= started + limit { TaskError::Expired } else { e }),
        _ = tokio::time::sleep_until(started + limit) => {
            cancel.cancel();
            join.abort();
            if by_deadline {
                Err(TaskError::Expired)
            } else {
                Err(TaskError::Retryable(format!("run cut at max_task_ms ({} ms)", shared.max_task.as_millis())))
            }
        }
        // An operator's cancel: a graceful handler (exec) ends its run within the grace
        // (SIGTERM, then SIGKILL); any other is dropped at once (an http request aborted).
        _ = cancelled.cancelled() => {
            stop.cancel();
            if graceful {
                let _ = tokio::time::timeout(shared.cancel_grace + CANCEL_MARGIN, &mut join).await;
            }
            cancel.cancel();
            join.abort();
            Err(TaskError::retryable("cancelled by an operator"))
        }
        _ = shared.work.stopping() => {
            cancel.cancel();
            join.abort();
            return None;
        }
    };
    drop(watch);
    if let Some(span) = span {
        match &result {
            Ok(_) => span.end("ok", None),
            Err(e) => span.end("error", Some(&e.to_string())),
        }
    }
    Some((result, started.elapsed()))
}

fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".into()
    }
}

/// Records the fate in the broker (publish) and in Redis (outcome), then acks; returns the
/// outcome. The ack comes last: a crash before it leaves the delivery with the broker, and its
/// redelivered copy finds the attempt `done` (a duplicate, acked without running).
///
/// A delivery whose channel died (consumer timeout, connection loss) is settled all the same:
/// its copy, redelivered meanwhile, waits on this attempt's run record rather than run, so
/// this run's outcome is the task's — only the ack is left out (the broker took it back).
async fn settle(
    task: Task<'_>,
    slot: &mut Slot,
    (attempt, max_attempts): (u32, u32),
    fate: Fate,
) -> Outcome {
    let Task {
        shared,
        lane,
        delivery,
        env,
        probe,
    } = task;
    // A user task's outcome is counted in the worker's figures before its ledger record, so
    // the batch that writes the record also publishes the figures.
    let count = |o: Outcome| {
        if !probe {
            shared.stats.outcome(o.as_str());
        }
        o
    };
    // The scheduler's health probes never reach the dead-letter queue nor retry: a lost probe
    // is the scheduler's to count (fleet_probe_failures_total), not a task of the user's.
    let fate = match fate {
        Fate::Retry { error, .. } if probe => Fate::Dead {
            reason: DeadReason::MaxAttempts,
            error,
        },
        f => f,
    };
    let (outcome, state, text, success, reason, published) = match fate {
        Fate::Succeeded(v) => (
            Outcome::Succeeded,
            TaskState::Succeeded,
            v.to_string(),
            true,
            None,
            Ok(()),
        ),
        Fate::Retry { error, delay } => {
            tracing::info!(error = %fleet::task::escape(&error), delay_ms = delay.as_millis() as u64, "attempt failed; retrying");
            let r = Box::pin(retry::publish(
                shared,
                env,
                attempt,
                Some(max_attempts),
                delay,
                &error,
                &[],
            ))
            .await;
            (Outcome::Retried, TaskState::Retrying, error, false, None, r)
        }
        Fate::Dead { reason, error } => {
            tracing::warn!(reason = reason.as_str(), error = %fleet::task::escape(&error), "task dead");
            let r = if probe {
                Ok(())
            } else {
                Box::pin(dead_letter(shared, env, attempt, reason.as_str(), &error)).await
            };
            (
                Outcome::Dead,
                TaskState::Dead,
                error,
                false,
                Some(reason),
                r,
            )
        }
        Fate::Expired { detail } => {
            tracing::info!(detail = %detail, "task expired");
            let r = if probe {
                Ok(())
            } else {
                Box::pin(dead_letter(
                    shared,
                    env,
                    attempt,
                    DeadReason::Expired.as_str(),
                    &detail,
                ))
                .await
            };
            (
                Outcome::Expired,
                TaskState::Expired,
                detail,
                false,
                Some(DeadReason::Expired),
                r,
            )
        }
    };
    if let Err(e) = published {
        // The handler ran: the attempt is used whether or not the broker took the copy (an
        // unconfirmed publish may still have landed). Released as spent, the next copy runs
        // as a new attempt; released plainly it would run this attempt a second time.
        tracing::warn!(error = %e, "cannot record the outcome in the broker; task requeued, its next copy runs as a new attempt");
        shared
            .ledger
            .release(Finished::spent(lane, env.id.clone(), attempt));
        nack_requeue(delivery).await;
        return count(Outcome::Failed);
    }
    count(outcome);
    // Before the outcome reaches Redis: a crash between the two leaves the attempt not done,
    // so its redelivered copy runs and appends again (counted once). The other order lost the
    // end record when a worker died after its outcome and Redis was lost before a sweep.
    if state.is_terminal() && !probe {
        // A parent named in another member's `payload_from` carries its result.
        let result = success
            .then(|| fleet::batch::dag::passed_result(env, &text))
            .flatten();
        batch_end(shared, env, state.as_str(), result).await;
    }
    if !shared
        .ledger
        .finish(Finished {
            lane,
            id: env.id.clone(),
            attempt,
            state: Some(state),
            text,
            success,
            reason,
        })
        .await
    {
        tracing::warn!(
            "outcome not yet written to Redis (retried in the background); acking anyway"
        );
    }
    if slot.usable() {
        slot.ack().await;
    } else {
        tracing::info!("channel closed before the task finished; outcome recorded, its redelivered copy will be acked as a duplicate");
    }
    outcome
}

/// A batch member's final state, appended to the control stream ([`fleet::batch`]) before its
/// ack, with its `result` when another member takes it (`payload_from`,
/// [`fleet::batch::dag::passed_result`]); a task without `batch` costs nothing. A refused append is logged, not retried here: a
/// scheduler's sweep reads the state from Redis when the batch stalls.
async fn batch_end(
    shared: &Shared,
    env: &Envelope,
    state: &str,
    result: Option<serde_json::Value>,
) {
    // Boxed, so the publish's state (kilobytes) is allocated only for a batch member, not
    // carried by every attempt's future.
    if let Some(batch) = fleet::batch::batch_of(env) {
        Box::pin(append_batch_end(shared, env, batch, state, result)).await;
    }
}

/// [`batch_end`] for a member of `batch`.
async fn append_batch_end(
    shared: &Shared,
    env: &Envelope,
    batch: &str,
    state: &str,
    result: Option<serde_json::Value>,
) {
    let rec = fleet::batch::end_record_with(batch, &env.id, state, result, shared.clock.now_ms());
    let body = match serde_json::to_vec(&rec) {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!(error = %e, "cannot encode a batch end record");
            return;
        }
    };
    let props = lapin::BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_message_id(rec.id.as_str().into());
    if let Err(e) = shared
        .broker
        .publish("", &shared.names.control_stream(), &body, props)
        .await
    {
        tracing::warn!(error = %e, batch, "cannot append a batch end record; a scheduler's sweep will find the state in Redis");
    }
}

/// A duplicate copy of a batch member: when its status says it ended, its end record is
/// appended again (counted once). The worker that ended it may have failed to append it — its
/// channel died with a hard stop, the case that leaves the delivery to be redelivered as this
/// copy — and a Redis loss before a scheduler's sweep would then leave the member pending
/// for good. Costs one read per duplicate copy of a batch member only.
async fn batch_end_again(shared: &Shared, env: &Envelope) {
    if fleet::batch::batch_of(env).is_some() {
        Box::pin(batch_end_again_read(shared, env)).await;
    }
}

/// [`batch_end_again`] for a batch member.
async fn batch_end_again_read(shared: &Shared, env: &Envelope) {
    let Ok(Some(status)) = shared.ledger.store().task_status(&env.id).await else {
        return;
    };
    let Some(state) = status
        .get("state")
        .filter(|s| TaskState::is_terminal_word(s))
    else {
        return;
    };
    let result = (state == TaskState::Succeeded.as_str())
        .then(|| {
            status
                .get("result")
                .and_then(|t| fleet::batch::dag::passed_result(env, t))
        })
        .flatten();
    batch_end(shared, env, state, result).await;
}

/// Publishes the task to the dead-letter queue with its reason.
async fn dead_letter(
    shared: &Shared,
    env: &Envelope,
    attempt: u32,
    reason: &str,
    detail: &str,
) -> fleet::Result<()> {
    let mut dead = env.clone();
    dead.attempt = attempt;
    let h = headers([
        (REASON_HEADER, reason.to_string()),
        (DETAIL_HEADER, truncate(detail, MAX_HEADER_TEXT)),
        (ATTEMPTS_HEADER, attempt.to_string()),
        (WORKER_HEADER, shared.worker_id.to_string()),
    ]);
    shared
        .broker
        .publish(
            &shared.names.tasks_exchange(),
            Names::DEAD_KEY,
            &dead.to_bytes(),
            task_properties(&env.id, Some(h)),
        )
        .await
}

/// Publishes a cancelled task's message to `<ns>.cancelled` ([`Names::cancelled_queue`]) as a
/// dead letter is published (the envelope with `attempt`, `x-fleet-reason: cancelled`, the
/// attempts and this worker), with a publisher confirm, so that a bulk retry can run it again
/// as a new run. `true` once confirmed: the caller acks the delivery. `false` when the broker
/// did not take it: the delivery has been handed back (nack + requeue after
/// [`REROUTE_REFUSED_WAIT`], so a refusing queue is not spun on), and its next copy is handled
/// again — the one copy of the task is never lost before the ack. A second keep of the same id
/// (a redelivered copy) may publish again: the retry takes one per id.
async fn keep_cancelled(
    shared: &Shared,
    delivery: &Delivery,
    env: &Envelope,
    attempt: u32,
) -> bool {
    // Boxed, so the publish's state (kilobytes) is allocated only for a cancelled copy, not
    // carried by every attempt's future.
    Box::pin(publish_cancelled(shared, delivery, env, attempt)).await
}

/// [`keep_cancelled`]'s publish.
async fn publish_cancelled(
    shared: &Shared,
    delivery: &Delivery,
    env: &Envelope,
    attempt: u32,
) -> bool {
    let mut kept = env.clone();
    kept.attempt = attempt;
    let h = headers([
        (REASON_HEADER, TaskState::Cancelled.as_str().to_string()),
        (ATTEMPTS_HEADER, attempt.to_string()),
        (WORKER_HEADER, shared.worker_id.to_string()),
    ]);
    match shared
        .broker
        .publish(
            &shared.names.tasks_exchange(),
            Names::CANCELLED_KEY,
            &kept.to_bytes(),
            task_properties(&env.id, Some(h)),
        )
        .await
    {
        Ok(()) => true,
        Err(e) => {
            tracing::warn!(error = %e, "cannot keep a cancelled task in the cancelled queue; requeued in {} ms", REROUTE_REFUSED_WAIT.as_millis());
            tokio::select! {
                _ = shared.work.stopping() => {}
                _ = tokio::time::sleep(REROUTE_REFUSED_WAIT) => {}
            }
            nack_requeue(delivery).await;
            false
        }
    }
}

/// How long a task sent back by `reroute` waits before the scheduler routes it again: one
/// delay-tier hop, so a group whose advertised kinds lag behind its workers cannot bounce a
/// task in a tight loop.
pub const REROUTE_DELAY: Duration = Duration::from_secs(1);
/// How many times a task may be sent back before it is dead-lettered `no_matching_worker`:
/// more means the scheduler keeps routing it to groups that do not handle it (a registration
/// that lies about its kinds), which no number of hops mends.
pub const MAX_REROUTES: u32 = 10;
/// The header counting a task's send-backs (`reroute`).
pub const REROUTES_HEADER: &str = "x-fleet-reroutes";
/// How long a send-back the broker refused waits before its delivery is requeued (it comes
/// straight back to this consumer: at once, a tier without a leader would spend the group
/// queue's delivery limit in a second).
pub const REROUTE_REFUSED_WAIT: Duration = Duration::from_secs(1);

/// A task of a kind this worker does not handle, delivered all the same: it was queued for
/// the group before this worker (re)started with fewer `FLEET_KINDS`, or before the group's
/// kinds (the intersection over its active workers) dropped it. Not the task's failure, and
/// not an attempt: it goes back to the scheduler unclaimed (its envelope as it came: attempt
/// and `max_attempts` untouched), through the delay path ([`REROUTE_DELAY`]), which routes it
/// to a group that handles its kind — or, none live, lets it wait for a worker like an
/// unmatched selector (dead-lettered `no_matching_worker` after the grace). Its reservation
/// here is given back. Sent back [`MAX_REROUTES`] times already, it is dead-lettered
/// `no_matching_worker`. When the broker refuses the send-back, the delivery is requeued
/// after [`REROUTE_REFUSED_WAIT`].
async fn reroute(task: Task<'_>, slot: &mut Slot) {
    let Task {
        shared,
        lane,
        delivery,
        env,
        ..
    } = task;
    let hops: u32 = fleet::broker::amqp::header_str(&delivery.properties, REROUTES_HEADER)
        .and_then(|h| h.parse().ok())
        .unwrap_or(0);
    let sent = if hops >= MAX_REROUTES {
        let detail = format!(
            "sent back {hops} times by workers that do not handle kind `{}`; the last: {}",
            env.kind, shared.worker_id
        );
        tracing::warn!(kind = %env.kind, hops, "a task routed again and again to workers that do not handle its kind: dead-lettered");
        let r = Box::pin(dead_letter(
            shared,
            env,
            env.attempt,
            DeadReason::NoMatchingWorker.as_str(),
            &detail,
        ))
        .await;
        if r.is_ok() {
            shared.stats.outcome("dead");
            shared.meters[lane].completed(Outcome::Dead).increment(1);
        }
        r
    } else {
        let detail = format!(
            "worker {} does not handle kind `{}`: routed again",
            shared.worker_id, env.kind
        );
        let r = Box::pin(crate::retry::tiers::publish(
            shared,
            env,
            env.attempt,
            None,
            REROUTE_DELAY,
            &detail,
            &[(REROUTES_HEADER, (hops + 1).to_string())],
        ))
        .await;
        if r.is_ok() {
            tracing::info!(kind = %env.kind, "a task of a kind this worker does not handle: sent back to be routed again");
            metrics::counter!(m::TASKS_REROUTED).increment(1);
        }
        r
    };
    match sent {
        Ok(()) => {
            if let Err(e) = shared.ledger.unreserve(lane, &env.id).await {
                tracing::debug!(error = %e, "cannot give back a sent-back task's reservation; it lapses with its lease");
            }
            slot.ack().await;
        }
        Err(e) => {
            tracing::warn!(error = %e, kind = %env.kind, "cannot send back a task of a kind this worker does not handle; requeued in {} ms", REROUTE_REFUSED_WAIT.as_millis());
            tokio::select! {
                _ = shared.work.stopping() => {}
                _ = tokio::time::sleep(REROUTE_REFUSED_WAIT) => {}
            }
            nack_requeue(delivery).await;
        }
    }
}

/// An unparseable delivery: dead-lettered as it came, with the refusal's code and detail.
async fn refuse(shared: &Shared, lane: Lane, delivery: Delivery, reject: fleet::task::Reject) {
    tracing::warn!(lane = %lane, reason = reject.code(), detail = %reject, "unparseable task dead-lettered");
    metrics::counter!(m::TASKS_REJECTED, "reason" => reject.code()).increment(1);
    let id = delivery
        .properties
        .message_id()
        .as_ref()
        .map(|s| s.to_string())
        .unwrap_or_default();
    let h = headers([
        (REASON_HEADER, reject.code().to_string()),
        (
            DETAIL_HEADER,
            truncate(&reject.to_string(), MAX_HEADER_TEXT),
        ),
        (WORKER_HEADER, shared.worker_id.to_string()),
    ]);
    let r = shared
        .broker
        .publish(
            &shared.names.tasks_exchange(),
            Names::DEAD_KEY,
            &delivery.data,
            task_properties(&id, Some(h)),
        )
        .await;
    match r {
        Ok(()) => {
            let ack = delivery.acker.ack(BasicAckOptions::default());
            match tokio::time::timeout(crate::acks::ACK_WAIT, ack).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "cannot ack a refused task"),
                Err(_) => tracing::warn!("ack of a refused task not written in time"),
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot dead-letter a refused task; requeued");
            nack_requeue(&delivery).await;
        }
    }
}

/// Hands a delivery back to the broker (nack with requeue), waiting at most
/// [`crate::acks::ACK_WAIT`]: a connection the broker blocked (a memory alarm) or one that died
/// mid-write may never take the frame, and the attempt waiting on it would hold its lane slot
/// and its `running` count (issue 37 item 4). Either way the broker has the task back once the
/// channel closes.
pub(crate) async fn nack_requeue(delivery: &Delivery) {
    let nack = delivery.acker.nack(BasicNackOptions {
        requeue: true,
        ..Default::default()
    });
    match tokio::time::timeout(crate::acks::ACK_WAIT, nack).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            tracing::debug!(error = %e, "nack failed (channel gone: the broker requeues anyway)")
        }
        Err(_) => tracing::warn!(
            limit_ms = crate::acks::ACK_WAIT.as_millis() as u64,
            "nack not written in time (connection blocked or lost); the broker gets the task back with the channel"
        ),
    }
}

#[cfg(test)]
mod tests {
    /// The size of the future an `async fn` of six owned arguments returns.
    fn future_size<A, B, C, D, E, G, F>(_: fn(A, B, C, D, E, G) -> F) -> usize {
        std::mem::size_of::<F>()
    }

    /// Every delivery is one spawned [`super::handle`]: its future is allocated and moved per
    /// task, so the rare paths (a Redis call that may connect, a batch member's end record,
    /// keeping a cancelled copy) are boxed where they are taken and not carried by every
    /// attempt. It was 14.8 KB (debug build) before they were; this bound is for the same
    /// (debug) build.
    #[test]
    fn an_attempts_future_stays_small() {
        let n = future_size(super::handle as fn(_, _, _, _, _, _) -> _);
        assert!(n <= 6 * 1024, "attempt::handle's future is {n} bytes");
    }
}
