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
//!   member is published: a member can never end in a batch nobody knows.
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
//! written outside a worker (a cancel that reached a task before dispatch). Only both at once
//! — a failed append *and* a Redis loss before the sweep — would leave a member pending.
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

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde::Serialize;
use serde_json::{json, Map, Value};

use crate::control::{new_id, Op, Record};

/// How long a batch with pending members must not move before a sweep reads their states
/// from Redis (long enough that a worker's own end record normally arrives first).
pub const STALL: Duration = Duration::from_secs(3);
/// The callback names, in firing order.
pub const CALLBACKS: [&str; 2] = ["on_success", "on_complete"];
/// Most members in one batch (one `BatchDef` record holds all their ids).
pub const MAX_TASKS: usize = 20_000;

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
    /// Every member ended.
    pub complete: bool,
    /// When the batch was accepted (Unix ms).
    pub at_ms: i64,
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
    inner: Arc<RwLock<HashMap<String, Batch>>>,
}

impl Batches {
    /// Folds one record in; `true` when it was a batch record. Idempotent: a record read
    /// twice (a replay, a repeated end) changes nothing the second time.
    pub fn apply(&self, rec: &Record) -> bool {
        let Ok(mut m) = self.inner.write() else {
            return false;
        };
        match &rec.op {
            Op::BatchDef {
                batch,
                tasks,
                on_success,
                on_complete,
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
                }
                true
            }
            Op::BatchEnd { batch, task, state } => {
                let b = m.entry(batch.clone()).or_default();
                if !b.ended.contains_key(task) {
                    b.ended.insert(task.clone(), state.clone());
                    b.moved_ms = b.moved_ms.max(rec.at_ms);
                }
                true
            }
            Op::BatchFired { batch, callback } => {
                m.entry(batch.clone())
                    .or_default()
                    .fired
                    .insert(callback.clone());
                true
            }
            _ => false,
        }
    }

    /// The figures of batch `id`; `None` when no definition of it was read.
    pub fn progress(&self, id: &str) -> Option<Progress> {
        let m = self.inner.read().ok()?;
        let b = m.get(id).filter(|b| b.defined)?;
        Some(figures(id, b))
    }

    /// Every complete batch's callbacks not yet fired, with their envelopes.
    pub fn due(&self) -> Vec<Due> {
        let Ok(m) = self.inner.read() else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for (id, b) in m.iter().filter(|(_, b)| b.defined) {
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

    /// Marks batch `id` as moved at `now_ms` (a sweep found nothing: it waits another
    /// [`STALL`] before reading again).
    pub fn touch(&self, id: &str, now_ms: i64) {
        if let Ok(mut m) = self.inner.write() {
            if let Some(b) = m.get_mut(id) {
                b.moved_ms = b.moved_ms.max(now_ms);
            }
        }
    }

    /// Drops batches accepted before `before_ms` (the stream no longer holds their records).
    pub fn prune(&self, before_ms: i64) {
        if let Ok(mut m) = self.inner.write() {
            m.retain(|_, b| !b.defined || b.at_ms >= before_ms);
        }
    }

    /// How many batches are known.
    pub fn len(&self) -> usize {
        self.inner.read().map(|m| m.len()).unwrap_or(0)
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
        complete: false,
        at_ms: b.at_ms,
    };
    for t in &b.tasks {
        match b.ended.get(t).map(String::as_str) {
            None => p.pending += 1,
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
    Record {
        id: new_id(),
        at_ms,
        op: Op::BatchEnd {
            batch: batch.to_string(),
            task: task.to_string(),
            state: state.to_string(),
        },
    }
}

/// A batch's definition record ([`Op::BatchDef`]) at `at_ms`.
pub fn def_record(
    batch: &str,
    tasks: Vec<String>,
    on_success: Option<Value>,
    on_complete: Option<Value>,
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
            Some(cb.clone()),
            Some(cb),
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
            Some(json!({"kind": "noop", "payload": 7})),
            None,
            2,
        ));
        let due = b.due();
        assert_eq!(due.len(), 1);
        assert_eq!(due[0].callback, "on_success");
        assert_eq!(due[0].envelope["payload"]["value"], 7);
        assert_eq!(due[0].envelope["payload"]["batch"]["succeeded"], 1);
    }

    #[test]
    fn records_round_trip_through_json() {
        let r = end_record("b", "t", "dead", 5);
        let back: Record = serde_json::from_slice(&serde_json::to_vec(&r).unwrap()).unwrap();
        assert_eq!(back, r);
    }
}
