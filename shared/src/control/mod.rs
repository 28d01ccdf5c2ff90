//! Operator control that must outlive Redis: the durable **control stream** `<ns>.control`
//! and what it carries — cancels (below) and pauses ([`PauseSet`], see `pause.rs`).
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

mod pause;
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
        /// Who: the API token's name, else its role (`admin`), or `anonymous` on an open API.
        #[serde(default)]
        by: String,
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

    /// A cancel of `task` by `by` for `reason` (both cut at [`MAX_TEXT`] bytes) at `at_ms`.
    pub fn cancel(task: &str, reason: &str, by: &str, at_ms: i64) -> Self {
        Record {
            id: uuid::Uuid::new_v4().simple().to_string(),
            at_ms,
            op: Op::Cancel {
                task: task.to_string(),
                reason: crate::status::truncate(reason, MAX_TEXT),
                by: crate::status::truncate(by, MAX_TEXT),
            },
        }
    }
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
}

impl Cancels {
    /// Adds the cancel of `rec` (other records change nothing); returns the task id it
    /// cancels, if any. The first cancel of an id is kept (a second changes nothing).
    pub fn apply(&self, rec: &Record) -> Option<String> {
        let Op::Cancel { task, reason, by } = &rec.op else {
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
    }
}

/// Appends a record with a publisher confirm: `Ok` once the broker holds it (the promise is
/// made), `Err` when it refused it or the channel failed (nothing promised).
pub async fn append(
    ch: &crate::broker::amqp::Publisher,
    names: &Names,
    rec: &Record,
) -> Result<()> {
    let body = serde_json::to_vec(rec)?;
    let props = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_message_id(rec.id.as_str().into());
    crate::broker::amqp::publish_confirmed(ch, "", &names.control_stream(), &body, props).await
}

/// A reader of the control stream from its first record (what [`MAX_AGE`] kept), on a
/// channel of its own.
pub struct Reader {
    ch: Channel,
    consumer: lapin::Consumer,
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
        Ok(Reader { ch, consumer })
    }

    /// The next record (acked); `Ok(None)` for an unreadable one (logged and skipped).
    /// `Err` when the consumer or its channel failed (open a new reader).
    ///
    /// # Cancel safety
    /// Cancel safe between records: a record received and not yet acked is read again by the
    /// next reader (every reader starts from the first record anyway).
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
        let rec = serde_json::from_slice::<Record>(&delivery.data);
        delivery.acker.ack(BasicAckOptions::default()).await?;
        match rec {
            Ok(r) => Ok(Some(r)),
            Err(e) => {
                tracing::warn!(error = %e, "ignoring an unreadable record in the control stream");
                Ok(None)
            }
        }
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

    #[test]
    fn records_round_trip_as_tagged_json() {
        let r = Record::cancel("t1", "wrong deploy", "admin", 42);
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["op"], "cancel");
        assert_eq!(v["task"], "t1");
        assert_eq!(v["reason"], "wrong deploy");
        assert_eq!(v["by"], "admin");
        assert_eq!(v["at_ms"], 42);
        assert_eq!(serde_json::from_value::<Record>(v).unwrap(), r);
    }

    #[test]
    fn long_texts_are_cut() {
        let r = Record::cancel("t", &"x".repeat(5000), "a", 1);
        let Op::Cancel { reason, .. } = r.op else {
            panic!("a cancel")
        };
        assert!(reason.len() <= MAX_TEXT + 8, "{}", reason.len());
    }

    #[test]
    fn a_cancel_applies_to_copies_submitted_before_it_only() {
        let c = Cancels::default();
        assert_eq!(
            c.apply(&Record::cancel("t", "why", "admin", 1000)),
            Some("t".into())
        );
        // The first cancel of an id is the one kept.
        c.apply(&Record::cancel("t", "again", "read", 2000));
        let got = c.get("t", Some(999)).unwrap();
        assert_eq!((got.at_ms, got.by.as_str()), (1000, "admin"));
        assert!(c.get("t", None).is_some(), "an unknown submission time");
        assert!(c.get("t", Some(1000)).is_some());
        assert!(c.get("t", Some(1001)).is_none(), "a later run of the id");
        assert!(c.get("u", None).is_none());
        assert_eq!(c.len(), 1);
        c.prune(1001);
        assert!(c.is_empty());
    }
}
