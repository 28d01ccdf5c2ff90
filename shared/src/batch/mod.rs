//! Batches: many tasks submitted together, with callback tasks fired **exactly once** when the
//! batch is done — `on_success` when every member succeeded, `on_complete` when every member
//! ended, whatever the outcome. Each callback's payload gets the batch's figures
//! ([`Progress`]: counts per final state and the ids that failed) under the key `batch`.
//!
//! # Where a batch lives: the control stream, not Redis
//!
//! The rule of the design is that Redis may be lost. A batch's definition (its member ids and
//! callbacks) and its progress (which members ended, how) are therefore **records of the
//! durable control stream** `<ns>.control` ([`crate::control`]), never only Redis state:
//!
//! * [`Op::BatchDef`] — appended (publisher confirm) by `POST /v1/batches` *before* any
//!   member is published: a member can never end in a batch nobody knows; or by the ingress
//!   that reads a batch's closing message (AMQP, *after* its members: their end records may
//!   come first, and the fold keeps them).
//! * [`Op::BatchEnd`] — appended by the worker that gives a member its final state
//!   (`succeeded`, `dead`, `expired`, `cancelled`), *before* the outcome is written to Redis
//!   and the delivery acked: a worker killed in between leaves the attempt not done, so its
//!   redelivered copy runs and appends again (the other order lost the record when a worker
//!   died after its outcome and Redis was then flushed — found by the e2e test). A cancelled
//!   task's record follows its keep in `<ns>.cancelled`. A repeat: progress is a *set* of
//!   ended ids per batch, so a repeat counts once. Tasks without a `batch` field append
//!   nothing: the hot path gains no command and no publish.
//! * [`Op::BatchFired`] — appended by the scheduler replica that published a callback.
//!
//! Every scheduler replica folds the stream into a [`Batches`] board in memory (the same fold
//! as pauses and the audit log), so progress is the same through every replica and survives a
//! Redis FLUSHALL untouched: nothing of it is in Redis. Why not a Redis set with a stream as
//! backup? Rebuilding from the outcomes after a loss needs them somewhere durable anyway (a
//! finished task is acked and gone from the broker), so the stream *is* the record and Redis
//! would only be a cache of it.
//!
//! **A missed end record.** If a worker cannot append its end record (broker trouble at that
//! moment) it logs and acks anyway (its outcome is in Redis). A replica's sweep covers it:
//! a batch that has not moved for [`STALL`] has its pending members' states read from Redis
//! (one pipelined read) and the final ones appended as end records. This also covers finals
//! written outside a worker (a cancel that reached a task before dispatch). A worker whose
//! channel died (a hard stop) fails its append *and* its ack: the redelivered copy is then a
//! duplicate, and the worker that acks it appends the end record again from the status it
//! reads (the e2e worker-kill + FLUSHALL test failed about half its runs without this). Only
//! both at once — a failed append *and* a Redis loss before the sweep or a duplicate copy —
//! would leave a member pending.
//!
//! # Exactly once
//!
//! A replica fires only when it has read the stream up to its barrier (the session's
//! `caught_up`), so it knows every `BatchFired` appended before. It publishes the callback
//! with the deterministic id `<batch>:on_success` / `<batch>:on_complete` (publisher confirm),
//! then appends `BatchFired`. Two replicas that see the batch complete at the same moment both
//! publish the same id: the scheduler's dedupe (one set-if-absent per id at ingress) drops the
//! second copy. A replica that crashes between its publish and its `BatchFired` leaves the
//! callback to another replica, whose copy is again a duplicate. The one window left is that
//! crash *plus* a Redis loss (the dedupe mark) before another replica republishes.
//!
//! The stream's retention ([`crate::control::MAX_AGE`], 7 days) bounds a batch's life.
//!
//! # Over AMQP: the closing message
//!
//! A producer without the HTTP API publishes the members as ordinary tasks to `<ns>.submit`,
//! each with `"batch": "<id>"`, then one **closing message** with the AMQP property
//! `type` = [`CLOSE_TYPE`] (the ingress tells it from a task without reading its body) and
//! the body `{"id": "<id>", "tasks": [...], "on_success"?: envelope, "on_complete"?:
//! envelope}`: `tasks` lists the member ids (strings) and, for members that wait for others,
//! their whole envelopes with `after` (not published by the producer: they travel in the
//! definition, as through the API). The scheduler's ingress checks it as `POST /v1/batches`
//! checks its body, appends the `BatchDef` record (publisher confirm) and only then acks the
//! close: unconfirmed, the close goes back to its queue and comes again. A close that defines
//! nothing (not JSON, no `id`, empty, over [`MAX_TASKS`], a bad callback, a cycle...) is
//! dead-lettered with reason `bad_batch` and a detail naming the fault. A repeated close (a
//! redelivery, a producer's retry) changes nothing: the fold keeps the first definition.
//!
//! Members may end before their close arrives (the fold keeps end records of a batch not yet
//! defined), so the batch completes as soon as it is defined if they all ended. A task
//! published with `batch` but **not listed** in the close is not a member: it runs, its end
//! record is ignored by the figures, and no callback waits for it. A member named in a
//! waiting envelope's `payload_from` must carry `"pass_result": true` itself (it was published
//! before the close, so the scheduler cannot mark it).
//!
//! # Cancelled or paused as a whole
//!
//! * [`Op::BatchCancel`] (`POST /v1/batches/{id}/cancel`): the fold marks the batch cancelled
//!   ([`Progress::cancel`]) and ends its waiting members `cancelled`; a cancelled batch is never
//!   [`due`](Batches::due) and has no [`steps`](Batches::steps). The record is appended
//!   *before* any member's own cancel record, so every reader folds the batch's cancel before
//!   it can see the last member end — no replica fires `on_complete` in between. Stream order
//!   decides the race with the last member's end record: a batch-cancel record folded after
//!   every member ended changes nothing ([`CancelOutcome::Late`]: the callbacks fire, the API
//!   answers 409 `finished`), the same on every replica. The members
//!   then end through their cancel records as any cancelled task does
//!   (`scheduler::api::batch_control` explains the promise).
//! * A pause of the batch ([`crate::control::Target::Batch`]) lives in the pause set, not
//!   here: the scheduler holds its members in a hold queue, and its batch loop releases no
//!   waiting member and fires no callback while it is in force.
//!
//! # Chains and DAGs
//!
//! A member may wait for others of its batch (`after`): see [`dag`] — the waiting members
//! travel in the definition record and are released by the same loop that fires callbacks.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde::Serialize;
use serde_json::{json, Map, Value};

use crate::control::{new_id, Op, Record};

pub mod dag;
use dag::Dep;
pub use dag::Step;

/// How long a batch with pending members must not move before a sweep reads their states
/// from Redis (long enough that a worker's own end record normally arrives first).
pub const STALL: Duration = Duration::from_secs(3);
/// The callback names, in firing order.
pub const CALLBACKS: [&str; 2] = ["on_success", "on_complete"];
/// Most members in one batch (one `BatchDef` record holds all their ids).
pub const MAX_TASKS: usize = 20_000;
/// The AMQP `type` property of a batch's **closing message**: published to `<ns>.submit`
/// like a task (after the members, each carrying `"batch": "<id>"`), with the body
/// `{"id": batch, "tasks": [member ids | waiting envelopes], "on_success"?, "on_complete"?}`,
/// it defines the batch over AMQP alone (see "# Over AMQP: the closing message").
pub const CLOSE_TYPE: &str = "fleet.batch.close";

/// One batch as folded from the stream.
#[derive(Debug, Default, Clone)]
struct Batch {
    /// Defined (its `BatchDef` read); end records may arrive for a batch not yet defined.
    defined: bool,
    at_ms: i64,
    tasks: Vec<String>,
    members: HashSet<String>,
    on_success: Option<Value>,
    on_complete: Option<Value>,
    /// Final state per ended member.
    ended: HashMap<String, String>,
    fired: BTreeSet<String>,
    /// When the fold last changed (Unix ms, record time): the stall sweep's clock.
    moved_ms: i64,
    /// The members that wait for others ([`dag`]), by id.
    waiting: HashMap<String, Dep>,
    /// Waiting members published (their `BatchReleased` read).
    released: HashSet<String>,
    /// Results carried by end records (members named in a `payload_from`).
    results: HashMap<String, Value>,
    /// Cancelled as a whole ([`Op::BatchCancel`]): no callback fires, nothing is released.
    cancel: Option<Cancelled>,
    /// Batch-cancel records folded after every member had ended (by stream order the batch
    /// was complete first: its callbacks fire, the cancel changes nothing).
    late_cancels: HashSet<String>,
}

/// What a batch-cancel record did once folded ([`Batches::cancel_outcome`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelOutcome {
    /// The batch is cancelled by it (or by an earlier one).
    Held,
    /// Every member had ended before it in the stream: the batch completed, it changed nothing.
    Late,
}

/// Every batch, and which batch each waiting member is in (a cancel names only the task).
#[derive(Debug, Default)]
struct Board {
    batches: HashMap<String, Batch>,
    waiting_in: HashMap<String, String>,
}

/// A batch's figures: `GET /v1/batches/{id}` and the `batch` object of a callback's payload.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Progress {
    /// The batch id.
    pub id: String,
    /// Members in all.
    pub total: usize,
    /// Members that succeeded.
    pub succeeded: usize,
    /// Members dead (any reason).
    pub dead: usize,
    /// Members that expired.
    pub expired: usize,
    /// Members cancelled.
    pub cancelled: usize,
    /// Members not yet ended.
    pub pending: usize,
    /// Ids of the members that ended other than `succeeded`, in submission order.
    pub failed: Vec<String>,
    /// Callbacks published (`on_success`, `on_complete`).
    pub fired: Vec<String>,
    /// Callbacks the batch has.
    pub callbacks: Vec<String>,
    /// Members waiting for others ([`dag`]: `after`), neither released nor ended, in
    /// submission order.
    pub waiting: Vec<String>,
    /// Every member ended.
    pub complete: bool,
    /// When the batch was accepted (Unix ms).
    pub at_ms: i64,
    /// The batch's cancel (`POST /v1/batches/{id}/cancel`), when it was cancelled as a whole:
    /// its callbacks never fire. Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cancel: Option<Cancelled>,
}

/// A batch's cancel as a whole ([`Op::BatchCancel`]), as `GET /v1/batches/{id}` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Cancelled {
    /// The id of its control record (the audit entry; every member's cancel names it).
    pub record: String,
    /// When it was accepted (Unix ms).
    pub at_ms: i64,
    /// Who: the token's name, or `anonymous`.
    pub by: String,
    /// The token's role, or `open`.
    pub role: String,
    /// Why (may be empty).
    pub reason: String,
}

/// A callback due: the batch is complete and its callback not yet recorded as fired.
#[derive(Debug, Clone)]
pub struct Due {
    /// `on_success` or `on_complete`.
    pub callback: &'static str,
    /// The envelope to publish (JSON), with its deterministic id and the figures merged in.
    pub envelope: Value,
    /// The figures.
    pub progress: Progress,
}

/// Every batch this process read in the control stream (cheap to clone: shared).
#[derive(Debug, Clone, Default)]
pub struct Batches {
    inner: Arc<RwLock<Board>>,
    /// Woken when an end record or a cancel reaches a batch with waiting members.
    moved: Arc<tokio::sync::Notify>,
}

impl Batches {
    /// Folds one record in; `true` when it was a batch record. Idempotent: a record read
    /// twice (a replay, a repeated end) changes nothing the second time.
    pub fn apply(&self, rec: &Record) -> bool {
        let Ok(mut guard) = self.inner.write() else {
            return false;
        };
        let board = &mut *guard;
        let m = &mut board.batches;
        match &rec.op {
            Op::BatchDef {
                batch,
                tasks,
                on_success,
                on_complete,
                waiting,
            } => {
                let b = m.entry(batch.clone()).or_default();
                if !b.defined {
                    b.defined = true;
                    b.at_ms = rec.at_ms;
                    b.tasks = tasks.clone();
                    b.members = tasks.iter().cloned().collect();
                    b.on_success = on_success.clone();
                    b.on_complete = on_complete.clone();
                    b.moved_ms = rec.at_ms;
                    for (id, dep) in waiting.iter().filter_map(Dep::of) {
                        board.waiting_in.insert(id.clone(), batch.clone());
                        b.waiting.insert(id, dep);
                    }
                    if !b.waiting.is_empty() {
                        self.moved.notify_one();
                    }
                }
                true
            }
            Op::BatchEnd {
                batch,
                task,
                state,
                result,
            } => {
                let b = m.entry(batch.clone()).or_default();
                if !b.ended.contains_key(task) {
                    b.ended.insert(task.clone(), state.clone());
                    b.moved_ms = b.moved_ms.max(rec.at_ms);
                    if let Some(r) = result {
                        b.results.insert(task.clone(), r.clone());
                    }
                    if !b.waiting.is_empty() {
                        self.moved.notify_one();
                    }
                }
                true
            }
            Op::BatchReleased { batch, task } => {
                m.entry(batch.clone())
                    .or_default()
                    .released
                    .insert(task.clone());
                true
            }
            Op::BatchFired { batch, callback } => {
                m.entry(batch.clone())
                    .or_default()
                    .fired
                    .insert(callback.clone());
                true
            }
            Op::BatchCancel {
                batch,
                reason,
                by,
                role,
                ..
            } => {
                let b = m.entry(batch.clone()).or_default();
                // Stream order decides: a batch whose every member ended before this record is
                // complete, and stays so on every replica (its callbacks fire).
                let complete = b.defined && b.tasks.iter().all(|t| b.ended.contains_key(t));
                if b.cancel.is_none() && complete {
                    b.late_cancels.insert(rec.id.clone());
                } else if b.cancel.is_none() {
                    b.cancel = Some(Cancelled {
                        record: rec.id.clone(),
                        at_ms: rec.at_ms,
                        by: by.clone(),
                        role: role.clone(),
                        reason: reason.clone(),
                    });
                    b.moved_ms = b.moved_ms.max(rec.at_ms);
                    // Its waiting members are never released: they end here, as a waiting
                    // member's own cancel does (their cancel records follow).
                    let cancelled = crate::status::TaskState::Cancelled.to_string();
                    let Batch {
                        waiting,
                        released,
                        ended,
                        ..
                    } = b;
                    for t in waiting.keys() {
                        if !released.contains(t) && !ended.contains_key(t) {
                            ended.insert(t.clone(), cancelled.clone());
                        }
                    }
                }
                true
            }
            // A waiting member cancelled before its release never runs: it ends here (a
            // released one ends through its worker, like any member).
            Op::Cancel { task, .. } => {
                let Some(b) = board
                    .waiting_in
                    .get(task)
                    .and_then(|batch| m.get_mut(batch))
                else {
                    return false;
                };
                if !b.released.contains(task) && !b.ended.contains_key(task) {
                    b.ended.insert(
                        task.clone(),
                        crate::status::TaskState::Cancelled.to_string(),
                    );
                    b.moved_ms = b.moved_ms.max(rec.at_ms);
                    self.moved.notify_one();
                }
                false
            }
            _ => false,
        }
    }

    /// Waits until an end record or a cancel reaches a batch with waiting members (at once if
    /// one did since the last wait).
    ///
    /// # Cancel safety
    /// Cancel safe: a wake-up not taken stays for the next call.
    pub async fn moved(&self) {
        self.moved.notified().await;
    }

    /// What to do next for the waiting members of every batch ([`dag`]): release those whose
    /// parents all succeeded, fail those one of whose parents ended otherwise. A member
    /// released or ended is never named again.
    pub fn steps(&self) -> Vec<Step> {
        let Ok(board) = self.inner.read() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        // Only batches with a member still waiting: a tick costs nothing for the others.
        let open = |b: &Batch| {
            b.waiting
                .keys()
                .any(|t| !b.released.contains(t) && !b.ended.contains_key(t))
        };
        for (id, b) in board
            .batches
            .iter()
            .filter(|(_, b)| b.defined && b.cancel.is_none() && open(b))
        {
            // Submission order: a chain's links come out in order.
            for task in b.tasks.iter() {
                let Some(dep) = b.waiting.get(task) else {
                    continue;
                };
                if b.released.contains(task) || b.ended.contains_key(task) {
                    continue;
                }
                let failed = dep.after.iter().find_map(|p| {
                    b.ended
                        .get(p)
                        .filter(|s| s.as_str() != "succeeded")
                        .map(|s| (p, s))
                });
                let fail = |detail: String| Step::Fail {
                    batch: id.clone(),
                    task: task.clone(),
                    lane: dep
                        .envelope
                        .get("lane")
                        .and_then(Value::as_str)
                        .unwrap_or("normal")
                        .to_string(),
                    detail,
                };
                if let Some((p, s)) = failed {
                    out.push(fail(format!("dependency `{p}` ended {s}")));
                    continue;
                }
                if !dep.after.iter().all(|p| b.ended.contains_key(p)) {
                    continue;
                }
                let envelope = match &dep.payload_from {
                    None => dep.envelope.clone(),
                    Some(p) => match b.results.get(p) {
                        Some(r) => dag::with_parent_result(&dep.envelope, r),
                        None => {
                            out.push(fail(format!(
                                "the result of `{p}` (payload_from) is not known: larger than {} bytes of JSON, or lost with Redis",
                                crate::status::MAX_STATUS_TEXT
                            )));
                            continue;
                        }
                    },
                };
                out.push(Step::Release {
                    batch: id.clone(),
                    task: task.clone(),
                    envelope,
                });
            }
        }
        out
    }

    /// The figures of batch `id`; `None` when no definition of it was read.
    pub fn progress(&self, id: &str) -> Option<Progress> {
        let m = self.inner.read().ok()?;
        let b = m.batches.get(id).filter(|b| b.defined)?;
        Some(figures(id, b))
    }

    /// The members of batch `id` a cancel of it acts on ([`Op::BatchCancel`]), in submission
    /// order: those not ended, and the waiting ones the batch's cancel ended in this fold
    /// (never released: their cancel record marks their status). `None`: no definition read.
    pub fn to_cancel(&self, id: &str) -> Option<Vec<String>> {
        let m = self.inner.read().ok()?;
        let b = m.batches.get(id).filter(|b| b.defined)?;
        let cancelled = crate::status::TaskState::Cancelled.as_str();
        Some(
            b.tasks
                .iter()
                .filter(|t| match b.ended.get(*t) {
                    None => true,
                    Some(s) => {
                        s == cancelled && b.waiting.contains_key(*t) && !b.released.contains(*t)
                    }
                })
                .cloned()
                .collect(),
        )
    }

    /// Every complete batch's callbacks not yet fired, with their envelopes.
    pub fn due(&self) -> Vec<Due> {
        let Ok(m) = self.inner.read() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        // A batch cancelled as a whole fires nothing (its cancel record precedes every
        // member's, so no reader sees it complete before it sees it cancelled).
        for (id, b) in m
            .batches
            .iter()
            .filter(|(_, b)| b.defined && b.cancel.is_none())
        {
            if b.members.iter().any(|t| !b.ended.contains_key(t)) {
                continue;
            }
            let p = figures(id, b);
            for (name, tpl) in [
                ("on_success", &b.on_success),
                ("on_complete", &b.on_complete),
            ] {
                let Some(tpl) = tpl else { continue };
                if b.fired.contains(name) || (name == "on_success" && p.succeeded != p.total) {
                    continue;
                }
                out.push(Due {
                    callback: name,
                    envelope: callback_envelope(tpl, name, &p),
                    progress: p.clone(),
                });
            }
        }
        out
    }

    /// Batches with members pending whose fold has not moved since `before_ms`: `(batch,
    /// pending ids)`, at most `limit` ids in all.
    pub fn stalled(&self, before_ms: i64, limit: usize) -> Vec<(String, Vec<String>)> {
        let Ok(m) = self.inner.read() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut n = 0;
        for (id, b) in m
            .batches
            .iter()
            .filter(|(_, b)| b.defined && b.moved_ms < before_ms)
        {
            let pending: Vec<String> = b
                .tasks
                .iter()
                .filter(|t| !b.ended.contains_key(*t))
                .take(limit.saturating_sub(n))
                .cloned()
                .collect();
            n += pending.len();
            if !pending.is_empty() {
                out.push((id.clone(), pending));
            }
            if n >= limit {
                break;
            }
        }
        out
    }

    /// The members of batch `id` whose result another member takes (`payload_from`, [`dag`]):
    /// an end record the sweep writes for one of them carries its result too.
    pub fn results_wanted(&self, id: &str) -> HashSet<String> {
        let Ok(m) = self.inner.read() else {
            return HashSet::new();
        };
        m.batches
            .get(id)
            .map(|b| {
                b.waiting
                    .values()
                    .filter_map(|d| d.payload_from.clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Marks batch `id` as moved at `now_ms` (a sweep found nothing: it waits another
    /// [`STALL`] before reading again).
    pub fn touch(&self, id: &str, now_ms: i64) {
        if let Ok(mut m) = self.inner.write() {
            if let Some(b) = m.batches.get_mut(id) {
                b.moved_ms = b.moved_ms.max(now_ms);
            }
        }
    }

    /// Drops batches accepted before `before_ms` (the stream no longer holds their records),
    /// and batches never defined (end records of members whose close never came: a producer
    /// that stopped, a refused member) whose last record is older than that — so ids chosen
    /// by producers cannot grow the board without bound.
    pub fn prune(&self, before_ms: i64) {
        if let Ok(mut m) = self.inner.write() {
            m.batches.retain(|_, b| {
                if b.defined {
                    b.at_ms >= before_ms
                } else {
                    b.moved_ms >= before_ms
                }
            });
            let Board {
                batches,
                waiting_in,
            } = &mut *m;
            waiting_in.retain(|_, batch| batches.contains_key(batch));
        }
    }

    /// What batch-cancel record `record` of batch `id` did, once this process folded it; `None`
    /// before.
    pub fn cancel_outcome(&self, id: &str, record: &str) -> Option<CancelOutcome> {
        let m = self.inner.read().ok()?;
        let b = m.batches.get(id)?;
        if b.late_cancels.contains(record) {
            Some(CancelOutcome::Late)
        } else if b.cancel.as_ref().is_some_and(|c| c.record == record) {
            Some(CancelOutcome::Held)
        } else {
            None
        }
    }

    /// The member ids of batch `id` in definition order, `None` when it is not defined.
    pub fn members(&self, id: &str) -> Option<Vec<String>> {
        let m = self.inner.read().ok()?;
        m.batches
            .get(id)
            .filter(|b| b.defined)
            .map(|b| b.tasks.clone())
    }

    /// How many batches are known.
    pub fn len(&self) -> usize {
        self.inner.read().map(|m| m.batches.len()).unwrap_or(0)
    }

    /// No batch known.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn figures(id: &str, b: &Batch) -> Progress {
    let mut p = Progress {
        id: id.to_string(),
        total: b.tasks.len(),
        succeeded: 0,
        dead: 0,
        expired: 0,
        cancelled: 0,
        pending: 0,
        failed: Vec::new(),
        fired: b.fired.iter().cloned().collect(),
        callbacks: [
            ("on_success", &b.on_success),
            ("on_complete", &b.on_complete),
        ]
        .iter()
        .filter(|(_, t)| t.is_some())
        .map(|(n, _)| n.to_string())
        .collect(),
        waiting: Vec::new(),
        complete: false,
        at_ms: b.at_ms,
        cancel: b.cancel.clone(),
    };
    for t in &b.tasks {
        match b.ended.get(t).map(String::as_str) {
            None => {
                p.pending += 1;
                if b.waiting.contains_key(t) && !b.released.contains(t) {
                    p.waiting.push(t.clone());
                }
            }
            Some("succeeded") => p.succeeded += 1,
            Some(s) => {
                match s {
                    "expired" => p.expired += 1,
                    "cancelled" => p.cancelled += 1,
                    _ => p.dead += 1,
                }
                p.failed.push(t.clone());
            }
        }
    }
    p.complete = p.pending == 0;
    p
}

/// The deterministic id of a batch's callback: `<batch>:<callback>`.
pub fn callback_id(batch: &str, callback: &str) -> String {
    format!("{batch}:{callback}")
}

/// The callback envelope from its template: id `<batch>:<callback>`, and the payload with the
/// figures under `batch` (`{"batch": {"id", "callback", "total", "succeeded", "dead",
/// "expired", "cancelled", "failed": [ids]}}` merged into an object payload; any other payload
/// is kept under `value`).
pub fn callback_envelope(template: &Value, callback: &str, p: &Progress) -> Value {
    let mut env = template.as_object().cloned().unwrap_or_default();
    env.insert("id".into(), Value::String(callback_id(&p.id, callback)));
    let figures = json!({
        "id": p.id, "callback": callback, "total": p.total, "succeeded": p.succeeded,
        "dead": p.dead, "expired": p.expired, "cancelled": p.cancelled, "failed": p.failed,
    });
    let mut payload = match env.remove("payload") {
        Some(Value::Object(o)) => o,
        None | Some(Value::Null) => Map::new(),
        Some(v) => Map::from_iter([("value".to_string(), v)]),
    };
    payload.insert("batch".into(), figures);
    env.insert("payload".into(), Value::Object(payload));
    Value::Object(env)
}

/// A member's end record ([`Op::BatchEnd`]) at `at_ms`.
pub fn end_record(batch: &str, task: &str, state: &str, at_ms: i64) -> Record {
    end_record_with(batch, task, state, None, at_ms)
}

/// A member's end record carrying its result (for a `payload_from` child, [`dag`]).
pub fn end_record_with(
    batch: &str,
    task: &str,
    state: &str,
    result: Option<Value>,
    at_ms: i64,
) -> Record {
    Record {
        id: new_id(),
        at_ms,
        op: Op::BatchEnd {
            batch: batch.to_string(),
            task: task.to_string(),
            state: state.to_string(),
            result,
        },
    }
}

/// A waiting member's released record ([`Op::BatchReleased`]) at `at_ms`.
pub fn released_record(batch: &str, task: &str, at_ms: i64) -> Record {
    Record {
        id: new_id(),
        at_ms,
        op: Op::BatchReleased {
            batch: batch.to_string(),
            task: task.to_string(),
        },
    }
}

/// A batch's definition record ([`Op::BatchDef`]) at `at_ms`; `waiting`: the envelopes of
/// the members that wait for others ([`dag`]).
pub fn def_record(
    batch: &str,
    tasks: Vec<String>,
    (on_success, on_complete): (Option<Value>, Option<Value>),
    waiting: Vec<Value>,
    at_ms: i64,
) -> Record {
    Record {
        id: new_id(),
        at_ms,
        op: Op::BatchDef {
            batch: batch.to_string(),
            tasks,
            on_success,
            on_complete,
            waiting,
        },
    }
}

/// A batch's cancel record ([`Op::BatchCancel`]) by `who` for `reason` (cut at
/// [`crate::control::MAX_TEXT`] bytes), `count` members not yet ended, at `at_ms`.
pub fn cancel_record(
    batch: &str,
    reason: &str,
    who: &crate::settings::Caller,
    count: u64,
    at_ms: i64,
) -> Record {
    let cut = |s: &str| crate::status::truncate(s, crate::control::MAX_TEXT);
    Record {
        id: new_id(),
        at_ms,
        op: Op::BatchCancel {
            batch: batch.to_string(),
            reason: cut(reason),
            by: cut(&who.name),
            role: who.role_str().to_string(),
            count,
        },
    }
}

/// A callback's fired record ([`Op::BatchFired`]) at `at_ms`.
pub fn fired_record(batch: &str, callback: &str, at_ms: i64) -> Record {
    Record {
        id: new_id(),
        at_ms,
        op: Op::BatchFired {
            batch: batch.to_string(),
            callback: callback.to_string(),
        },
    }
}

/// The batch a task belongs to: its envelope's `batch` field (kept among the unknown fields;
/// a string of 1..=128 bytes), `None` for a lone task.
pub fn batch_of(env: &crate::Envelope) -> Option<&str> {
    env.extra
        .get("batch")
        .and_then(Value::as_str)
        .filter(|b| !b.is_empty() && b.len() <= 128)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_each_member_once_and_fires_on_complete_only_with_failures() {
        let b = Batches::default();
        let ids: Vec<String> = (0..4).map(|i| format!("t{i}")).collect();
        let cb = json!({"kind": "noop", "payload": {"to": "ops"}});
        b.apply(&def_record(
            "b1",
            ids.clone(),
            (Some(cb.clone()), Some(cb)),
            Vec::new(),
            1,
        ));
        for (t, s) in [
            ("t0", "succeeded"),
            ("t1", "dead"),
            ("t1", "succeeded"),
            ("t2", "succeeded"),
        ] {
            b.apply(&end_record("b1", t, s, 2));
        }
        assert!(b.due().is_empty());
        let p = b.progress("b1").unwrap();
        assert_eq!((p.succeeded, p.dead, p.pending), (2, 1, 1));
        b.apply(&end_record("b1", "t3", "cancelled", 3));
        let due = b.due();
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].callback, "on_complete");
        assert_eq!(due[0].envelope["id"], "b1:on_complete");
        assert_eq!(due[0].envelope["payload"]["to"], "ops");
        assert_eq!(
            due[0].envelope["payload"]["batch"]["failed"],
            json!(["t1", "t3"])
        );
        b.apply(&fired_record("b1", "on_complete", 4));
        assert!(b.due().is_empty());
        assert_eq!(b.progress("b1").unwrap().fired, vec!["on_complete"]);
    }

    #[test]
    fn on_success_when_all_succeeded_and_ends_before_the_definition_count() {
        let b = Batches::default();
        b.apply(&end_record("b2", "a", "succeeded", 1));
        assert!(b.progress("b2").is_none());
        b.apply(&def_record(
            "b2",
            vec!["a".into()],
            (Some(json!({"kind": "noop", "payload": 7})), None),
            Vec::new(),
            2,
        ));
        let due = b.due();
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].callback, "on_success");
        assert_eq!(due[0].envelope["payload"]["value"], 7);
        assert_eq!(due[0].envelope["payload"]["batch"]["succeeded"], 1);
    }

    fn ids(steps: &[Step]) -> Vec<(&'static str, String)> {
        steps
            .iter()
            .map(|s| match s {
                Step::Release { task, .. } => ("release", task.clone()),
                Step::Fail { task, .. } => ("fail", task.clone()),
            })
            .collect()
    }

    #[test]
    fn a_diamond_releases_d_once_after_b_and_c() {
        let b = Batches::default();
        let waiting = vec![
            json!({"id": "b", "kind": "k", "after": ["a"]}),
            json!({"id": "c", "kind": "k", "after": ["a"]}),
            json!({"id": "d", "kind": "k", "after": ["b", "c"], "payload_from": "c"}),
        ];
        let all = ["a", "b", "c", "d"].map(String::from).to_vec();
        b.apply(&def_record("g", all, (None, None), waiting, 1));
        assert!(b.steps().is_empty());
        assert_eq!(b.progress("g").unwrap().waiting, vec!["b", "c", "d"]);
        b.apply(&end_record("g", "a", "succeeded", 2));
        assert_eq!(
            ids(&b.steps()),
            vec![("release", "b".into()), ("release", "c".into())]
        );
        b.apply(&released_record("g", "b", 3));
        b.apply(&released_record("g", "c", 3));
        assert!(b.steps().is_empty());
        b.apply(&end_record("g", "b", "succeeded", 4));
        assert!(b.steps().is_empty());
        b.apply(&end_record_with(
            "g",
            "c",
            "succeeded",
            Some(json!({"n": 2})),
            5,
        ));
        let steps = b.steps();
        let [Step::Release { task, envelope, .. }] = steps.as_slice() else {
            panic!("{steps:?}");
        };
        assert_eq!(task, "d");
        assert_eq!(envelope["payload"]["parent_result"], json!({"n": 2}));
        b.apply(&released_record("g", "d", 6));
        assert!(b.steps().is_empty());
        assert!(b.progress("g").unwrap().waiting.is_empty());
    }

    #[test]
    fn a_failure_cascades_and_a_cancel_ends_a_waiting_member() {
        let b = Batches::default();
        let waiting = vec![
            json!({"id": "c", "kind": "k", "after": ["p"]}),
            json!({"id": "g", "kind": "k", "after": ["c"]}),
            json!({"id": "x", "kind": "k", "after": ["p"]}),
        ];
        let all = ["p", "c", "g", "x"].map(String::from).to_vec();
        b.apply(&def_record("f", all, (None, None), waiting, 1));
        b.apply(&Record {
            id: new_id(),
            at_ms: 2,
            op: Op::Cancel {
                task: "x".into(),
                reason: String::new(),
                by: String::new(),
                role: String::new(),
                bulk: None,
            },
        });
        b.apply(&end_record("f", "p", "dead", 3));
        assert_eq!(ids(&b.steps()), vec![("fail", "c".into())]);
        b.apply(&end_record("f", "c", "dead", 4));
        assert_eq!(ids(&b.steps()), vec![("fail", "g".into())]);
        b.apply(&end_record("f", "g", "dead", 5));
        assert!(b.steps().is_empty());
        let p = b.progress("f").unwrap();
        assert_eq!((p.dead, p.cancelled, p.pending), (3, 1, 0));
    }

    #[test]
    fn a_batch_cancelled_as_a_whole_fires_nothing_and_releases_nothing() {
        let b = Batches::default();
        let waiting = vec![json!({"id": "w", "kind": "k", "after": ["a"]})];
        let all = ["a", "z", "w"].map(String::from).to_vec();
        let cb = json!({"kind": "noop"});
        b.apply(&def_record(
            "c",
            all,
            (Some(cb.clone()), Some(cb)),
            waiting,
            1,
        ));
        b.apply(&end_record("c", "z", "succeeded", 2));
        let who = crate::settings::Caller::anonymous();
        let rec = cancel_record("c", "oops", &who, 2, 3);
        b.apply(&rec);
        b.apply(&cancel_record("c", "again", &who, 0, 4));
        // `a` is still to cancel; `w` too (ended in the fold, its status not yet marked).
        assert_eq!(b.to_cancel("c"), Some(vec!["a".into(), "w".into()]));
        b.apply(&end_record("c", "a", "succeeded", 5));
        assert!(b.steps().is_empty(), "nothing released");
        assert!(b.due().is_empty(), "nothing fired");
        let p = b.progress("c").unwrap();
        assert_eq!((p.succeeded, p.cancelled, p.pending), (2, 1, 0));
        let c = p.cancel.unwrap();
        assert_eq!(
            (c.record.as_str(), c.reason.as_str(), c.at_ms),
            (rec.id.as_str(), "oops", 3)
        );
        assert_eq!(b.to_cancel("c"), Some(vec!["w".into()]));
        assert_eq!(b.to_cancel("nope"), None);
    }

    /// Stream order decides the race of a batch cancel with the last member's end: folded after
    /// it, the cancel changes nothing and the callbacks fire; folded before, it holds.
    #[test]
    fn a_batch_cancel_after_the_last_end_record_is_late_and_the_callbacks_fire() {
        let b = Batches::default();
        let cb = json!({"kind": "noop"});
        let two = ["a", "z"].map(String::from).to_vec();
        b.apply(&def_record(
            "c",
            two.clone(),
            (None, Some(cb.clone())),
            vec![],
            1,
        ));
        b.apply(&end_record("c", "a", "succeeded", 2));
        b.apply(&end_record("c", "z", "dead", 3));
        let who = crate::settings::Caller::anonymous();
        let late = cancel_record("c", "too late", &who, 0, 4);
        assert_eq!(b.cancel_outcome("c", &late.id), None, "not folded yet");
        b.apply(&late);
        assert_eq!(b.cancel_outcome("c", &late.id), Some(CancelOutcome::Late));
        assert!(b.progress("c").unwrap().cancel.is_none());
        assert_eq!(b.due().len(), 1, "on_complete fires");

        b.apply(&def_record("d", two, (None, Some(cb)), vec![], 1));
        b.apply(&end_record("d", "a", "succeeded", 2));
        let held = cancel_record("d", "in time", &who, 1, 3);
        b.apply(&held);
        b.apply(&end_record("d", "z", "cancelled", 4));
        assert_eq!(b.cancel_outcome("d", &held.id), Some(CancelOutcome::Held));
        assert!(
            b.due().iter().all(|d| d.progress.id != "d"),
            "nothing fires for d"
        );
    }

    #[test]
    fn records_round_trip_through_json() {
        let r = end_record("b", "t", "dead", 5);
        let back: Record = serde_json::from_slice(&serde_json::to_vec(&r).unwrap()).unwrap();
        assert_eq!(back, r);
    }
}
