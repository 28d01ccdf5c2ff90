//! Operator control that must outlive Redis: the durable **control stream** `<ns>.control`,
//! the cancels it carries, the pauses ([`PauseSet`], `pause.rs`) and the **audit log** it is.
//!
//! # The audit log
//!
//! Every operator action — cancel, drain, dead-letter replay, bulk action, pause and resume,
//! schedule add/remove/pause/resume/fire, key limits, a batch's cancel — appends a record
//! naming who acted (the token's name and role, [`crate::settings::Caller`]; never the
//! secret), when, on what (the target or query) and how many it touched. A cancel is its own record ([`Op::Cancel`]), as
//! are pauses, key limits ([`Op::KeyLimit`], its own audit entry `key_limit`) and a batch's
//! cancel ([`Op::BatchCancel`], entry `batch_cancel`, its members' cancels naming it); any other
//! action is an [`Op::Audit`] — a drain's and a bulk action's appended before they are applied
//! (their promise), a replay's and a schedule change's right after. Every scheduler
//! replica folds the stream into an [`AuditLog`] in memory (`GET /v1/audit` answers from it), so
//! the log survives Redis loss and is the same through every replica; it holds what the
//! stream holds: [`MAX_AGE`] of records (at most [`AUDIT_MAX`] entries in memory).
//!
//! # The promise of a cancel
//!
//! `POST /v1/tasks/{id}/cancel` answers 202 only after its [`Record`] is in the control
//! stream (a RabbitMQ stream: durable, replicated like the task queues, read non-destructively
//! by any number of readers — the same choice as the schedules' `<ns>.schedules`, for the same
//! reasons). Redis holds the fast copy: the task's status record is marked `cancelled`
//! (`lua/cancel.lua`), and every place a task is next reached reads that state in a script it
//! runs anyway — dispatch's reservation (`route/reserve.lua`) and the worker's claim
//! (`lua/start.lua`) — so the hot path gains no command. From the stream:
//!
//! * every **worker** follows it ([`Cancels`] in memory) and so learns of a cancel at once: a
//!   run of a cancelled task is stopped within milliseconds (no heartbeat wait), and a copy of
//!   a cancelled task is refused before its claim even if Redis lost the mark;
//! * every **scheduler replica** follows it and writes the marks again ([`Store::cancel`]
//!   in `replay` mode) when Redis lost them: it keeps a key ([`Names::control_applied`]) that
//!   a Redis loss takes with it, and re-applies every cancel it knows when the key is gone.
//!
//! So an accepted cancel holds across scheduler replicas (the stream is shared), a worker
//! crash (its redelivered copy meets the mark in `start.lua`, or the next worker's memory) and
//! a Redis loss (the stream is not in Redis). It holds for [`MAX_AGE`] — the stream's
//! retention — and, in Redis, for the status TTL after the cancel.
//!
//! A new run of the id — submitted again after its dedupe window, with a later `submitted_at`
//! — is not the cancelled one: neither the replay nor a worker's memory cancels it.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use deadpool_redis::redis;
use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::names::Names;
use crate::redis::{millis, Store};
use crate::settings::Caller;

mod keys;
mod pause;
pub use keys::{
    KeyFigures, KeyLimit, KeyLimitSpec, KeyLimits, KeyOverride, KeyOverrides, DEFAULT_KEY,
    SPEC_FIELDS,
};
pub use pause::{Pause, PauseSet, Target, RENEW_AFTER};

/// How long the control stream keeps a record (its `x-max-age`): declared with the namespace's
/// other queues by [`crate::broker::topology`], which owns it.
pub use crate::broker::topology::CONTROL_MAX_AGE as MAX_AGE;
/// Records read from the stream per credit window.
const PREFETCH: u16 = 512;
/// Longest a reason or a name kept in a record (longer ones are cut).
pub const MAX_TEXT: usize = 512;

/// One operator action in the control stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// Task `task` is cancelled: it must never run (again); a run going on is stopped.
    Cancel {
        /// The task id.
        task: String,
        /// Why (the request's `reason`; may be empty).
        #[serde(default)]
        reason: String,
        /// Who: the API token's name, or `anonymous` on an open API.
        #[serde(default)]
        by: String,
        /// The token's role (`admin`), or `open` on an open API; empty in records written
        /// before tokens had names.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        role: String,
        /// The id of the bulk action's audit record this cancel is part of (its audit entry is
        /// the bulk action's, not one per task).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        bulk: Option<String>,
    },
    /// Any other operator action, recorded for the audit log once it was applied.
    Audit {
        /// What was done: `drain`, `replay`, `bulk_cancel`, `bulk_retry`, `bulk_delete`,
        /// `pause`, `resume`, `schedule_add`, `schedule_remove`, `schedule_pause`,
        /// `schedule_resume`, `schedule_fire`
        action: String,
        /// On what: the target (`{"worker": id}`, `{"schedule": name}`) or the query.
        #[serde(default)]
        target: serde_json::Value,
        /// How many tasks, letters or workers it touched.
        #[serde(default)]
        count: u64,
        /// Who: the token's name, or `anonymous`.
        #[serde(default)]
        by: String,
        /// The token's role, or `open`.
        #[serde(default)]
        role: String,
        /// The operator's reason, if given.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        reason: String,
    },
    /// `target` is paused: it takes no new work ([`PauseSet`]).
    Pause {
        /// What is paused.
        target: Target,
        /// Why (may be empty).
        #[serde(default)]
        reason: String,
        /// Who.
        #[serde(default)]
        by: String,
        /// When the target was first paused (Unix ms), on a renewal ([`Record::renewal`]);
        /// absent: the record's own time.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        since_ms: Option<i64>,
    },
    /// `target` is resumed: its pause ends (a group's resume ends its lanes' pauses too).
    Resume {
        /// What is resumed.
        target: Target,
        /// Who.
        #[serde(default)]
        by: String,
    },
    /// The limits of a fairness key (or the default spec) set or cleared at runtime
    /// ([`KeyOverrides`]): the spec replaces the settings' spec of the key; no spec gives the
    /// key back to its settings. Its own audit entry (`key_limit`), renewals excepted.
    KeyLimit {
        /// The key; absent: the default spec (every key).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        key: Option<String>,
        /// The spec; absent: the override is cleared.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        spec: Option<KeyLimitSpec>,
        /// Who: the token's name, or `anonymous`.
        #[serde(default)]
        by: String,
        /// The token's role, or `open`.
        #[serde(default)]
        role: String,
        /// Why (may be empty).
        #[serde(default, skip_serializing_if = "String::is_empty")]
        reason: String,
        /// When the spec was first set (Unix ms), on a renewal ([`Record::key_limit_renewal`]);
        /// absent: the record's own time.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        since_ms: Option<i64>,
    },
    /// A batch was accepted ([`crate::batch`]): its member task ids and its callback templates
    /// (envelopes as JSON, `None`: no such callback). Appended before any member is published.
    BatchDef {
        /// The batch id.
        batch: String,
        /// Its member task ids, in submission order.
        tasks: Vec<String>,
        /// Submitted when every member succeeded.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        on_success: Option<serde_json::Value>,
        /// Submitted when every member ended, whatever the outcome.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        on_complete: Option<serde_json::Value>,
        /// The envelopes (JSON, `submitted_at` stamped) of the members that wait for others
        /// (`after`, [`crate::batch::dag`]): they are published only when released, so they
        /// live here until then. Empty for a batch without dependencies.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        waiting: Vec<serde_json::Value>,
    },
    /// A member of a batch ended in final state `state` (`succeeded`, `dead`, `expired`,
    /// `cancelled`): appended by the worker that ended it before its ack, or by a scheduler's
    /// sweep that found the final state in Redis. A repeat is harmless (counted once per task).
    BatchEnd {
        /// The batch id.
        batch: String,
        /// The member task id.
        task: String,
        /// Its final state word.
        state: String,
        /// Its result (the handler's JSON value), for a `succeeded` member another member names
        /// in `payload_from` ([`crate::batch::dag`]); at most
        /// [`crate::status::MAX_STATUS_TEXT`] bytes as JSON, absent otherwise.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        result: Option<serde_json::Value>,
    },
    /// A waiting member of a batch (one with `after`) was published to the ingress: every
    /// member it waits for succeeded ([`crate::batch::dag`]). A replica that reads it does not
    /// publish the member again.
    BatchReleased {
        /// The batch id.
        batch: String,
        /// The member task id.
        task: String,
    },
    /// A batch callback (`on_success` or `on_complete`) was published and confirmed.
    BatchFired {
        /// The batch id.
        batch: String,
        /// `on_success` or `on_complete`.
        callback: String,
    },
    /// A batch was cancelled as a whole ([`crate::batch`]): its callbacks never fire, its
    /// waiting members are never released, and every member not yet ended is cancelled —
    /// each through its own [`Op::Cancel`] (with `bulk` naming this record), appended *after*
    /// this one, so every reader folds the batch's cancel before any member ends by it. Its
    /// own audit entry (`batch_cancel`).
    BatchCancel {
        /// The batch id.
        batch: String,
        /// Why (may be empty).
        #[serde(default, skip_serializing_if = "String::is_empty")]
        reason: String,
        /// Who: the token's name, or `anonymous`.
        #[serde(default)]
        by: String,
        /// The token's role, or `open`.
        #[serde(default)]
        role: String,
        /// Members not yet ended when it was accepted (as the replica that accepted it knew).
        #[serde(default)]
        count: u64,
    },
    /// A reader's barrier: appended by a scheduler that follows the stream, which has read
    /// everything before it once it reads this record (its caught-up point).
    Barrier {
        /// The reader that appended it (a random id per reader).
        reader: String,
    },
}

/// A record of the control stream: an action, its id and when it was accepted (Unix ms,
/// Redis server time).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Unique id of this record (a UUID).
    pub id: String,
    /// When it was accepted: Unix ms, the fleet's clock.
    pub at_ms: i64,
    /// What was done.
    #[serde(flatten)]
    pub op: Op,
}

impl Record {
    /// A barrier of reader `reader` at `at_ms` ([`Op::Barrier`]).
    pub fn barrier(reader: &str, at_ms: i64) -> Self {
        Record {
            id: uuid::Uuid::new_v4().simple().to_string(),
            at_ms,
            op: Op::Barrier {
                reader: reader.to_string(),
            },
        }
    }

    /// A cancel of `task` by `who` for `reason` (cut at [`MAX_TEXT`] bytes) at `at_ms`.
    pub fn cancel(task: &str, reason: &str, who: &Caller, at_ms: i64) -> Self {
        Record {
            id: new_id(),
            at_ms,
            op: Op::Cancel {
                task: task.to_string(),
                reason: crate::status::truncate(reason, MAX_TEXT),
                by: crate::status::truncate(&who.name, MAX_TEXT),
                role: who.role_str().to_string(),
                bulk: None,
            },
        }
    }

    /// This cancel as part of the bulk action whose audit record is `bulk` (other records
    /// are returned unchanged).
    pub fn in_bulk(mut self, bulk: &str) -> Self {
        if let Op::Cancel { bulk: b, .. } = &mut self.op {
            *b = Some(bulk.to_string());
        }
        self
    }

    /// An audit record: `who` did `action` on `target`, touching `count`, for `reason`.
    pub fn audit(
        action: &str,
        target: serde_json::Value,
        count: u64,
        who: &Caller,
        reason: &str,
        at_ms: i64,
    ) -> Self {
        Record {
            id: new_id(),
            at_ms,
            op: Op::Audit {
                action: action.to_string(),
                target,
                count,
                by: crate::status::truncate(&who.name, MAX_TEXT),
                role: who.role_str().to_string(),
                reason: crate::status::truncate(reason, MAX_TEXT),
            },
        }
    }
}

/// A new record id (a UUID, 32 hex digits).
pub fn new_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// What is known of one cancelled task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cancel {
    /// When the cancel was accepted (Unix ms).
    pub at_ms: i64,
    /// Who cancelled it.
    pub by: String,
    /// Why.
    pub reason: String,
}

/// The cancels read from the control stream, by task id: one process's memory of them
/// (shared by its loops; cheap to clone).
#[derive(Clone, Default)]
pub struct Cancels {
    inner: Arc<RwLock<HashMap<String, Cancel>>>,
    /// Batches cancelled as a whole ([`Op::BatchCancel`]), by batch id.
    batches: Arc<RwLock<HashMap<String, Cancel>>>,
}

impl Cancels {
    /// Adds the cancel of `rec` (other records change nothing); returns the task id it
    /// cancels, if any. The first cancel of an id is kept (a second changes nothing).
    pub fn apply(&self, rec: &Record) -> Option<String> {
        if let Op::BatchCancel {
            batch, reason, by, ..
        } = &rec.op
        {
            if let Ok(mut m) = self.batches.write() {
                m.entry(batch.clone()).or_insert_with(|| Cancel {
                    at_ms: rec.at_ms,
                    by: by.clone(),
                    reason: reason.clone(),
                });
            }
            return None;
        }
        let Op::Cancel {
            task, reason, by, ..
        } = &rec.op
        else {
            return None;
        };
        if let Ok(mut m) = self.inner.write() {
            m.entry(task.clone()).or_insert_with(|| Cancel {
                at_ms: rec.at_ms,
                by: by.clone(),
                reason: reason.clone(),
            });
        }
        Some(task.clone())
    }

    /// The cancel that applies to a copy of task `id` submitted at `submitted_ms` (Unix ms;
    /// `None`: unknown, the cancel applies): none when the id was never cancelled, or when
    /// the copy belongs to a run of the id submitted after the cancel (a new run).
    pub fn get(&self, id: &str, submitted_ms: Option<i64>) -> Option<Cancel> {
        let m = self.inner.read().ok()?;
        let c = m.get(id)?;
        match submitted_ms {
            Some(s) if s > c.at_ms => None,
            _ => Some(c.clone()),
        }
    }

    /// The cancel of batch `batch` ([`Op::BatchCancel`]) that applies to a member copy
    /// submitted at `submitted_ms` (as [`get`](Self::get)): the backstop for a member whose
    /// own cancel record was never appended (the replica that accepted the batch's cancel
    /// stopped before it).
    pub fn get_batch(&self, batch: &str, submitted_ms: Option<i64>) -> Option<Cancel> {
        let m = self.batches.read().ok()?;
        let c = m.get(batch)?;
        match submitted_ms {
            Some(s) if s > c.at_ms => None,
            _ => Some(c.clone()),
        }
    }

    /// Every cancel known, as `(task id, cancel)`.
    pub fn all(&self) -> Vec<(String, Cancel)> {
        self.inner
            .read()
            .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default()
    }

    /// How many cancels are known.
    pub fn len(&self) -> usize {
        self.inner.read().map(|m| m.len()).unwrap_or(0)
    }

    /// Whether none is known.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets cancels accepted before `before_ms` (Unix ms): the stream no longer holds them.
    pub fn prune(&self, before_ms: i64) {
        if let Ok(mut m) = self.inner.write() {
            m.retain(|_, c| c.at_ms >= before_ms);
        }
        if let Ok(mut m) = self.batches.write() {
            m.retain(|_, c| c.at_ms >= before_ms);
        }
    }
}

/// Most audit entries one process keeps in memory (the oldest are dropped first).
pub const AUDIT_MAX: usize = 100_000;

/// One entry of the audit log: an operator action as `GET /v1/audit` shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AuditEntry {
    /// The control record's id.
    pub id: String,
    /// When it was accepted: Unix ms.
    pub at_ms: i64,
    /// What was done (`cancel`, `drain`, `pause`, ... — see [`Op::Audit`]).
    pub action: String,
    /// On what: the target or the query.
    pub target: serde_json::Value,
    /// How many it touched.
    pub count: u64,
    /// Who: the token's name, or `anonymous`.
    pub by: String,
    /// The token's role, or `open`.
    pub role: String,
    /// The operator's reason (may be empty).
    pub reason: String,
}

impl AuditEntry {
    /// The entry a record makes: every [`Op::Audit`], each [`Op::Cancel`] not part of a
    /// bulk action (the bulk action has one entry of its own) and each [`Op::KeyLimit`] but
    /// renewals (action `key_limit`, target `{"key": K or "*" for the default, "spec": S or
    /// null when cleared}`); `None` for other records.
    pub fn of(rec: &Record) -> Option<AuditEntry> {
        let (action, target, count, by, role, reason) = match &rec.op {
            Op::Cancel { bulk: Some(_), .. } => return None,
            Op::Cancel {
                task,
                reason,
                by,
                role,
                ..
            } => (
                "cancel".to_string(),
                serde_json::json!({ "task": task }),
                1,
                by,
                role,
                reason,
            ),
            Op::Audit {
                action,
                target,
                count,
                by,
                role,
                reason,
            } => (action.clone(), target.clone(), *count, by, role, reason),
            Op::KeyLimit {
                since_ms: Some(_), ..
            } => return None,
            Op::BatchCancel {
                batch,
                reason,
                by,
                role,
                count,
            } => (
                "batch_cancel".to_string(),
                serde_json::json!({ "batch": batch }),
                *count,
                by,
                role,
                reason,
            ),
            Op::KeyLimit {
                key,
                spec,
                by,
                role,
                reason,
                ..
            } => (
                "key_limit".to_string(),
                serde_json::json!({ "key": key.as_deref().unwrap_or("*"), "spec": spec }),
                1,
                by,
                role,
                reason,
            ),
            #[allow(unreachable_patterns)]
            _ => return None,
        };
        Some(AuditEntry {
            id: rec.id.clone(),
            at_ms: rec.at_ms,
            action,
            target,
            count,
            by: by.clone(),
            role: role.clone(),
            reason: reason.clone(),
        })
    }
}

/// What [`AuditLog::list`] selects: newest first, entries older than `before` (a cursor: the
/// last entry's `(at_ms, id)` of the previous page), within `[since_ms, until_ms]`, of one
/// action or one token name, at most `limit`.
#[derive(Debug, Clone, Default)]
pub struct AuditQuery {
    /// Only this action.
    pub action: Option<String>,
    /// Only this token name.
    pub by: Option<String>,
    /// Not before (Unix ms).
    pub since_ms: Option<i64>,
    /// Not after (Unix ms).
    pub until_ms: Option<i64>,
    /// Strictly older than this `(at_ms, id)`.
    pub before: Option<(i64, String)>,
    /// Page size.
    pub limit: usize,
}

/// The audit log as one process read it from the control stream, in stream order (cheap to
/// clone; shared by the control loop, which fills it, and the API, which reads it).
#[derive(Clone, Default)]
pub struct AuditLog {
    inner: Arc<RwLock<AuditInner>>,
}

#[derive(Default)]
struct AuditInner {
    entries: std::collections::VecDeque<AuditEntry>,
    ids: std::collections::HashSet<String>,
    /// The stream was read up to a point this process appended (a barrier) at least once.
    loaded: bool,
}

impl AuditLog {
    /// Adds the entry `rec` makes, once per record id (a reader that starts again from the
    /// stream's first record adds nothing twice); keeps at most [`AUDIT_MAX`].
    pub fn apply(&self, rec: &Record) {
        let Some(e) = AuditEntry::of(rec) else {
            return;
        };
        // The stream drops whole segments: a reader may still see records past the retention
        // (a replica that reads them after a reconnect must not show what others pruned).
        if e.at_ms < crate::redis::now_ms() - MAX_AGE.as_millis() as i64 {
            return;
        }
        let Ok(mut g) = self.inner.write() else {
            return;
        };
        if !g.ids.insert(e.id.clone()) {
            return;
        }
        g.entries.push_back(e);
        while g.entries.len() > AUDIT_MAX {
            if let Some(old) = g.entries.pop_front() {
                g.ids.remove(&old.id);
            }
        }
    }

    /// Entries matching `q`, newest first (by time, then id), and how many match in all.
    pub fn list(&self, q: &AuditQuery) -> (Vec<AuditEntry>, usize) {
        let Ok(g) = self.inner.read() else {
            return (Vec::new(), 0);
        };
        let mut hits: Vec<&AuditEntry> = g
            .entries
            .iter()
            .filter(|e| q.action.as_deref().is_none_or(|a| e.action == a))
            .filter(|e| q.by.as_deref().is_none_or(|b| e.by == b))
            .filter(|e| q.since_ms.is_none_or(|s| e.at_ms >= s))
            .filter(|e| q.until_ms.is_none_or(|u| e.at_ms <= u))
            .collect();
        let total = hits.len();
        hits.sort_by(|a, b| (b.at_ms, &b.id).cmp(&(a.at_ms, &a.id)));
        let page = hits
            .into_iter()
            .filter(|e| {
                q.before
                    .as_ref()
                    .is_none_or(|(at, id)| (e.at_ms, &e.id) < (*at, id))
            })
            .take(q.limit)
            .cloned()
            .collect();
        (page, total)
    }

    /// How many entries are kept.
    pub fn len(&self) -> usize {
        self.inner.read().map(|g| g.entries.len()).unwrap_or(0)
    }

    /// Marks the log complete: its reader has read the stream up to a record appended after
    /// this process started (its barrier), so every earlier action is in it.
    pub fn set_loaded(&self) {
        if let Ok(mut g) = self.inner.write() {
            g.loaded = true;
        }
    }

    /// Whether the log is complete ([`set_loaded`](Self::set_loaded)); until then a listing
    /// would show only part of the actions.
    pub fn loaded(&self) -> bool {
        self.inner.read().map(|g| g.loaded).unwrap_or(false)
    }

    /// Whether none is kept.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets entries accepted before `before_ms` (the stream no longer holds them).
    pub fn prune(&self, before_ms: i64) {
        if let Ok(mut g) = self.inner.write() {
            while g.entries.front().is_some_and(|e| e.at_ms < before_ms) {
                if let Some(old) = g.entries.pop_front() {
                    g.ids.remove(&old.id);
                }
            }
        }
    }
}

/// Appends a record with a publisher confirm: `Ok` once the broker holds it (the promise is
/// made), `Err` when it refused it or the channel failed (nothing promised).
pub async fn append(
    ch: &crate::broker::amqp::Publisher,
    names: &Names,
    rec: &Record,
) -> Result<()> {
    append_batch(ch, names, std::slice::from_ref(rec))
        .await
        .into_iter()
        .next()
        .unwrap_or(Err(Error::BadAnswer {
            from: "control::append",
            detail: "no confirm".into(),
        }))
}

/// Appends many records to the control stream together (one batch of publishes, then every
/// confirm awaited: a bulk cancel's records); per record, in order, `Ok` once the broker
/// confirmed it — only those are promises.
pub async fn append_batch(
    ch: &crate::broker::amqp::Publisher,
    names: &Names,
    recs: &[Record],
) -> Vec<Result<()>> {
    let stream = names.control_stream();
    let mut bodies = Vec::with_capacity(recs.len());
    for r in recs {
        bodies.push(serde_json::to_vec(r).map_err(Error::from));
    }
    let msgs: Vec<crate::broker::amqp::Outgoing<'_>> = recs
        .iter()
        .zip(&bodies)
        .filter_map(|(r, b)| {
            Some(crate::broker::amqp::Outgoing {
                exchange: "",
                routing_key: &stream,
                body: b.as_ref().ok()?,
                props: BasicProperties::default()
                    .with_content_type("application/json".into())
                    .with_delivery_mode(2)
                    .with_message_id(r.id.as_str().into()),
            })
        })
        .collect();
    let mut sent = crate::broker::amqp::publish_batch(ch, msgs)
        .await
        .into_iter();
    let mut out = Vec::with_capacity(recs.len());
    let mut waits = Vec::new();
    for b in bodies {
        match b {
            Err(e) => out.push(Some(Err(e))),
            Ok(_) => match sent.next() {
                Some(Ok(c)) => {
                    out.push(None);
                    waits.push(crate::broker::amqp::confirmed(c));
                }
                Some(Err(e)) => out.push(Some(Err(e))),
                None => out.push(Some(Err(Error::BadAnswer {
                    from: "control::append_batch",
                    detail: "no publish result".into(),
                }))),
            },
        }
    }
    let mut confirms = futures::future::join_all(waits).await.into_iter();
    out.into_iter()
        .map(|o| {
            o.unwrap_or_else(|| {
                confirms.next().unwrap_or(Err(Error::BadAnswer {
                    from: "control::append_batch",
                    detail: "no confirm".into(),
                }))
            })
        })
        .collect()
}

/// A reader of the control stream from its first record (what [`MAX_AGE`] kept), on a
/// channel of its own.
pub struct Reader {
    ch: Channel,
    consumer: lapin::Consumer,
    /// The delivery tag of the last record returned and not yet acked.
    unacked: Option<u64>,
}

impl Reader {
    /// Opens the stream from its first record. Errors: the broker failed (declare, qos or
    /// consume).
    pub async fn open(conn: &Connection, names: &Names) -> Result<Reader> {
        let ch = conn.create_channel().await?;
        crate::broker::topology::declare_control_stream(&ch, names).await?;
        ch.basic_qos(PREFETCH, BasicQosOptions::default()).await?;
        let mut args = FieldTable::default();
        args.insert(
            "x-stream-offset".into(),
            AMQPValue::LongString("first".into()),
        );
        let consumer = ch
            .basic_consume(
                names.control_stream().as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                args,
            )
            .await?;
        Ok(Reader {
            ch,
            consumer,
            unacked: None,
        })
    }

    /// The next record; `Ok(None)` for an unreadable one (logged and skipped). `Err` when the
    /// consumer or its channel failed (open a new reader). Records are not acked here: call
    /// [`ack`](Self::ack) after acting on them (one ack covers every record before it).
    ///
    /// # Cancel safety
    /// Cancel safe: it awaits nothing after a record arrives, so a `next` dropped in a
    /// `select!` or a timeout loses no record (an earlier version acked inside and lost the
    /// record whose ack outlived a 2 ms batching timeout).
    pub async fn next(&mut self) -> Result<Option<Record>> {
        let delivery = match self.consumer.next().await {
            Some(Ok(d)) => d,
            Some(Err(e)) => return Err(e.into()),
            None => {
                return Err(Error::ConsumerEnded {
                    queue: "control stream".into(),
                })
            }
        };
        self.unacked = Some(delivery.delivery_tag);
        match serde_json::from_slice::<Record>(&delivery.data) {
            Ok(r) => Ok(Some(r)),
            Err(e) => {
                tracing::warn!(error = %e, "ignoring an unreadable record in the control stream");
                Ok(None)
            }
        }
    }

    /// Acks every record returned so far (the stream's credit: the broker sends at most
    /// 512 unacked records). Errors: the channel failed (open a new reader).
    pub async fn ack(&mut self) -> Result<()> {
        if let Some(tag) = self.unacked.take() {
            self.ch
                .basic_ack(tag, BasicAckOptions { multiple: true })
                .await?;
        }
        Ok(())
    }

    /// Closes the reader's channel.
    pub async fn close(self) {
        let _ = self.ch.close(200, "bye".into()).await;
    }
}

/// How [`Store::cancel`] treats a task without a status record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// A cancel being accepted: a task with no record is unknown (nothing written).
    Api,
    /// Records of the control stream written again (Redis may have lost them): a task with
    /// no record is marked too, unless its record belongs to a later run of the id.
    Replay,
}

impl Store {
    /// Marks tasks cancelled (`lua/cancel.lua`), each `(id, at_ms, by, reason)`; the marks
    /// live for `status_ttl`. Returns per task the state it had before: `None` (no record:
    /// in [`Mode::Api`] nothing was written) or its state word — `cancelled` (cancelled
    /// before), a final one (`succeeded`, `dead`, `expired`: left as it was), or any other
    /// (now cancelled). Errors: Redis failed (nothing or part of the batch written: the call
    /// is idempotent, repeat it).
    pub async fn cancel(
        &self,
        mode: Mode,
        tasks: &[(String, i64, String, String)],
        status_ttl: Duration,
    ) -> Result<Vec<Option<String>>> {
        if tasks.is_empty() {
            return Ok(Vec::new());
        }
        let mut inv = self.scripts.cancel.prepare_invoke();
        inv.key(self.names.prefix())
            .arg(millis(status_ttl))
            .arg(match mode {
                Mode::Api => "api",
                Mode::Replay => "replay",
            })
            .arg(tasks.len());
        for (id, at, by, reason) in tasks {
            inv.arg(id).arg(*at).arg(by).arg(reason);
        }
        let out: Vec<String> = self.invoke(&inv).await?;
        Ok(out
            .into_iter()
            .map(|s| (!s.is_empty()).then_some(s))
            .collect())
    }

    /// Whether the key that says "this Redis holds the control stream's marks" is there
    /// (a Redis loss takes it: the marks must then be written again).
    pub async fn control_applied(&self) -> Result<bool> {
        let n: i64 = self
            .query(redis::cmd("EXISTS").arg(self.names.control_applied()))
            .await?;
        Ok(n == 1)
    }

    /// Sets the key [`Store::control_applied`] reads (after the marks were written).
    pub async fn set_control_applied(&self) -> Result<()> {
        self.query::<()>(redis::cmd("SET").arg(self.names.control_applied()).arg(1))
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::settings::Role;

    fn alice() -> Caller {
        Caller {
            name: "alice".into(),
            role: Some(Role::Admin),
        }
    }

    #[test]
    fn records_past_the_retention_are_not_kept() {
        let log = AuditLog::default();
        let old = crate::redis::now_ms() - MAX_AGE.as_millis() as i64 - 1000;
        log.apply(&Record::audit(
            "drain",
            serde_json::json!({}),
            1,
            &alice(),
            "",
            old,
        ));
        assert!(log.is_empty());
    }

    #[test]
    fn a_cancel_record_of_an_older_fleet_still_reads() {
        let old = r#"{"id":"x","at_ms":5,"op":"cancel","task":"t","reason":"","by":"admin"}"#;
        let r: Record = serde_json::from_str(old).unwrap();
        assert_eq!(AuditEntry::of(&r).unwrap().role, "");
    }

    #[test]
    fn the_audit_log_lists_newest_first_once_per_record_without_bulk_members() {
        let log = AuditLog::default();
        let t0 = crate::redis::now_ms();
        let drain = Record::audit(
            "drain",
            serde_json::json!({"worker": "w1"}),
            1,
            &alice(),
            "",
            t0 + 10,
        );
        let bulk = Record::audit(
            "bulk_cancel",
            serde_json::json!({"state": "queued"}),
            2,
            &alice(),
            "oops",
            t0 + 20,
        );
        let c1 = Record::cancel("t1", "oops", &alice(), t0 + 21).in_bulk(&bulk.id);
        let single = Record::cancel("t9", "", &Caller::anonymous(), t0 + 30);
        for r in [&drain, &bulk, &c1, &single, &drain] {
            log.apply(r);
        }
        assert_eq!(
            log.len(),
            3,
            "bulk members and a record read twice add nothing"
        );
        let all = |q: AuditQuery| log.list(&AuditQuery { limit: 10, ..q });
        let (page, total) = all(AuditQuery::default());
        assert_eq!(total, 3);
        let actions: Vec<_> = page.iter().map(|e| e.action.as_str()).collect();
        assert_eq!(actions, ["cancel", "bulk_cancel", "drain"]);
        assert_eq!(
            (page[0].by.as_str(), page[0].role.as_str()),
            ("anonymous", "open")
        );
        assert_eq!((page[1].count, page[1].reason.as_str()), (2, "oops"));
        let (p, _) = all(AuditQuery {
            action: Some("drain".into()),
            ..Default::default()
        });
        assert_eq!(p.len(), 1);
        let (p, t) = all(AuditQuery {
            since_ms: Some(t0 + 15),
            until_ms: Some(t0 + 25),
            ..Default::default()
        });
        assert_eq!((p.len(), t), (1, 1));
        let (p, _) = log.list(&AuditQuery {
            limit: 1,
            before: Some((page[0].at_ms, page[0].id.clone())),
            ..Default::default()
        });
        assert_eq!(p[0].action, "bulk_cancel", "the page after the first");
        log.prune(t0 + 15);
        assert_eq!(log.len(), 2);
    }

    #[test]
    fn records_round_trip_as_tagged_json() {
        let r = Record::cancel("t1", "wrong deploy", &alice(), 42);
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["op"], "cancel");
        assert_eq!(v["task"], "t1");
        assert_eq!(v["reason"], "wrong deploy");
        assert_eq!(v["by"], "alice");
        assert_eq!(v["role"], "admin");
        assert!(v.get("bulk").is_none());
        assert_eq!(v["at_ms"], 42);
        assert_eq!(serde_json::from_value::<Record>(v).unwrap(), r);
    }

    #[test]
    fn long_texts_are_cut() {
        let r = Record::cancel("t", &"x".repeat(5000), &alice(), 1);
        let Op::Cancel { reason, .. } = r.op else {
            panic!("a cancel")
        };
        assert!(reason.len() <= MAX_TEXT + 8, "{}", reason.len());
    }

    #[test]
    fn a_cancel_applies_to_copies_submitted_before_it_only() {
        let c = Cancels::default();
        assert_eq!(
            c.apply(&Record::cancel("t", "why", &alice(), 1000)),
            Some("t".into())
        );
        // The first cancel of an id is the one kept.
        c.apply(&Record::cancel("t", "again", &Caller::anonymous(), 2000));
        let got = c.get("t", Some(999)).unwrap();
        assert_eq!((got.at_ms, got.by.as_str()), (1000, "alice"));
        assert!(c.get("t", None).is_some(), "an unknown submission time");
        assert!(c.get("t", Some(1000)).is_some());
        assert!(c.get("t", Some(1001)).is_none(), "a later run of the id");
        assert!(c.get("u", None).is_none());
        assert_eq!(c.len(), 1);
        c.prune(1001);
        assert!(c.is_empty());
    }
}
