//! Where schedule definitions live: a RabbitMQ **stream** `<ns>.schedules`, an append-only,
//! durable log of changes (`put`, `delete`, `pause`, `resume`), and the in-memory [`Board`]
//! every replica folds it into.
//!
//! # Why a stream
//!
//! Definitions are configuration, not state: they must survive a Redis loss (fleet's rule:
//! Redis holds only what may be lost), and every scheduler replica must see a change made
//! through any replica's API. A file named by a setting survives Redis but not across
//! replicas on different machines (each has its own copy, the API can change only one). A
//! classic or quorum queue is consumed destructively, so a second replica — or a restart —
//! would not see what another already read. A stream is read non-destructively from any
//! offset by any number of consumers, is durable and replicated like the task queues, and
//! orders all changes totally: every replica replays the same log from `first` and reaches the
//! same definitions. Redis keeps only the per-tick claims, the last-fired marks and the born
//! marks (see [`super::fire`]).
//!
//! # Creation is first-put-wins
//!
//! A `put` for a name that already has a schedule is ignored by the fold: of two replicas
//! creating one name at once, the record that comes first in the stream defines it, on every
//! replica alike (the stream's total order decides, not a Redis claim, so this holds after a
//! Redis loss too). The API answers `201` only when the schedule it waited for carries its own
//! record's id ([`Entry::put_id`]), else `409` (see [`super::api`]).
//!
//! Changes are rare (operator actions), so the log is small; it is not compacted. A replica
//! knows it has caught up when it reads back a `sync` record it appended itself after
//! subscribing; the scheduler reports ready (`/readyz`) only then, and until then its schedule
//! routes answer 503 and the firing loop waits. A writer waits until its own replica has applied its record, so a read after a write on the
//! same replica sees it.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use fleet::{broker::amqp, Names};
use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::definition::{Schedule, ScheduleSpec};

/// Records read from the stream per credit window.
const PREFETCH: u16 = 256;
/// Ids of the last applied records kept for writers waiting on their own.
const RECENT: usize = 1024;

/// One change to the definitions.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Change {
    /// Adds a schedule; ignored when the name exists (first put wins).
    Put {
        schedule: ScheduleSpec,
    },
    Delete {
        name: String,
    },
    Pause {
        name: String,
    },
    Resume {
        name: String,
    },
    /// A replica's catch-up marker; changes nothing.
    Sync,
}

/// A record of the log: a change, its id and when it was made (ms since the epoch, Redis
/// server time).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub id: String,
    pub at_ms: i64,
    #[serde(flatten)]
    pub change: Change,
}

impl Record {
    pub fn new(change: Change, at_ms: i64) -> Self {
        Record {
            id: uuid::Uuid::new_v4().simple().to_string(),
            at_ms,
            change,
        }
    }
}

/// A schedule as the board holds it.
#[derive(Debug, Clone)]
pub struct Entry {
    pub schedule: Arc<Schedule>,
    /// When it was defined or resumed (ms, Redis server time): its first due tick is the
    /// first after this; ticks before it are never fired or caught up.
    pub changed_at_ms: i64,
    /// When it was defined (ms, Redis server time): marks in Redis older than this belong to a
    /// deleted schedule of the same name.
    pub created_at_ms: i64,
    /// Id of the `put` record that defined it.
    pub put_id: String,
}

impl Entry {
    pub fn enabled(&self) -> bool {
        self.schedule.spec.enabled
    }
}

type Defs = BTreeMap<String, Entry>;

fn apply(defs: &mut Defs, rec: &Record) {
    match &rec.change {
        Change::Put { schedule } if defs.contains_key(&schedule.name) => {
            tracing::debug!(record = %rec.id, schedule = %schedule.name, "ignoring a put for an existing schedule (first put wins)");
        }
        Change::Put { schedule } => match Schedule::new(schedule.clone()) {
            Ok(s) => {
                defs.insert(
                    s.name().to_string(),
                    Entry {
                        schedule: Arc::new(s),
                        changed_at_ms: rec.at_ms,
                        created_at_ms: rec.at_ms,
                        put_id: rec.id.clone(),
                    },
                );
            }
            Err(e) => {
                tracing::warn!(record = %rec.id, error = %e, "ignoring an invalid schedule in the definitions log")
            }
        },
        Change::Delete { name } => {
            defs.remove(name);
        }
        Change::Pause { name } | Change::Resume { name } => {
            let enable = matches!(rec.change, Change::Resume { .. });
            if let Some(e) = defs.get_mut(name) {
                if e.schedule.spec.enabled != enable {
                    let mut s = (*e.schedule).clone();
                    s.spec.enabled = enable;
                    e.schedule = Arc::new(s);
                    e.changed_at_ms = rec.at_ms;
                }
            }
        }
        Change::Sync => {}
    }
}

#[derive(Default)]
struct BoardState {
    defs: Defs,
    loaded: bool,
    recent: VecDeque<String>,
}

/// The definitions as this replica knows them. Shared by the API, the firing loop and the
/// log follower; outlives AMQP sessions. Cheap to clone.
#[derive(Clone)]
pub struct Board {
    state: Arc<RwLock<BoardState>>,
    applied: Arc<watch::Sender<u64>>,
}

impl Default for Board {
    fn default() -> Self {
        Board {
            state: Arc::default(),
            applied: Arc::new(watch::channel(0).0),
        }
    }
}

impl Board {
    /// True once the log was read up to this replica's sync marker.
    pub fn loaded(&self) -> bool {
        self.state.read().map(|s| s.loaded).unwrap_or(false)
    }

    /// Every schedule, by name.
    pub fn entries(&self) -> Vec<Entry> {
        self.state
            .read()
            .map(|s| s.defs.values().cloned().collect())
            .unwrap_or_default()
    }

    pub fn get(&self, name: &str) -> Option<Entry> {
        self.state.read().ok()?.defs.get(name).cloned()
    }

    fn replace(&self, defs: Defs, ids: Vec<String>) {
        if let Ok(mut s) = self.state.write() {
            s.defs = defs;
            s.loaded = true;
            for id in ids.into_iter().rev().take(RECENT).rev() {
                push_recent(&mut s.recent, id);
            }
        }
        self.applied.send_modify(|n| *n += 1);
    }

    fn apply(&self, rec: &Record) {
        if let Ok(mut s) = self.state.write() {
            apply(&mut s.defs, rec);
            push_recent(&mut s.recent, rec.id.clone());
        }
        self.applied.send_modify(|n| *n += 1);
    }

    fn has_applied(&self, id: &str) -> bool {
        self.state
            .read()
            .map(|s| s.recent.iter().any(|r| r == id))
            .unwrap_or(false)
    }

    /// Waits until this replica has applied record `id`; `false` after `timeout`.
    ///
    /// # Cancel safety
    /// Cancel safe: it only watches this replica's state; dropped, it has changed nothing.
    pub async fn wait_applied(&self, id: &str, timeout: Duration) -> bool {
        let mut rx = self.applied.subscribe();
        tokio::time::timeout(timeout, async {
            loop {
                if self.has_applied(id) {
                    return;
                }
                if rx.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
            }
        })
        .await
        .is_ok()
    }
}

fn push_recent(recent: &mut VecDeque<String>, id: String) {
    if recent.len() >= RECENT {
        recent.pop_front();
    }
    recent.push_back(id);
}

/// Declares the stream (idempotent; no `x-max-age`: a definition is kept until deleted).
pub async fn declare(ch: &Channel, names: &Names) -> fleet::Result<()> {
    fleet::broker::topology::declare_stream(ch, &names.schedules_stream(), None).await
}

/// Appends a record with a publisher confirm. `Err(Refused)` when the broker did not take it.
pub async fn append(ch: &amqp::Publisher, names: &Names, rec: &Record) -> fleet::Result<()> {
    let body = serde_json::to_vec(rec)?;
    let props = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_message_id(rec.id.as_str().into());
    amqp::publish_confirmed(ch, "", &names.schedules_stream(), &body, props).await
}

/// Longest the replay up to this replica's sync marker may take before the session fails.
const LOAD_TIMEOUT: Duration = Duration::from_secs(30);

/// The log's consumer of one AMQP session, after the replay.
pub struct Follower {
    ch: Channel,
    consumer: lapin::Consumer,
    board: Board,
}

/// Opens the log for one AMQP session: subscribes from the first record, appends a sync
/// marker, replays everything before the marker into a fresh map and swaps it into `board`.
/// The scheduler reports ready only after this, so its API never answers from a partial view.
/// `Err` when the broker fails or the marker's confirm and the replay take over 30 s (the
/// session restarts).
pub async fn open(
    conn: &Connection,
    publisher: &amqp::Publisher,
    names: &Names,
    board: Board,
) -> fleet::Result<Follower> {
    let ch = conn.create_channel().await?;
    declare(&ch, names).await?;
    ch.basic_qos(PREFETCH, BasicQosOptions::default()).await?;
    let mut args = FieldTable::default();
    args.insert(
        "x-stream-offset".into(),
        AMQPValue::LongString("first".into()),
    );
    let mut consumer = ch
        .basic_consume(
            names.schedules_stream().as_str().into(),
            "".into(),
            BasicConsumeOptions::default(),
            args,
        )
        .await?;
    let marker = Record::new(Change::Sync, 0);
    let (mut defs, mut ids) = (Defs::new(), Vec::new());
    // The marker's confirm inside the limit too: a stream without a leader never confirms.
    let replay = async {
        append(publisher, names, &marker).await?;
        loop {
            let Some(rec) = next(&mut consumer).await? else {
                continue;
            };
            ids.push(rec.id.clone());
            if rec.id == marker.id {
                return Ok::<_, fleet::Error>(());
            }
            apply(&mut defs, &rec);
        }
    };
    match tokio::time::timeout(LOAD_TIMEOUT, replay).await {
        Ok(r) => r?,
        Err(_) => {
            return Err(fleet::Error::Timeout {
                what: "the schedules stream: this replica's own sync marker, read back".into(),
                after: LOAD_TIMEOUT,
            })
        }
    }
    tracing::info!(schedules = defs.len(), "schedule definitions loaded");
    board.replace(defs, ids);
    Ok(Follower {
        ch,
        consumer,
        board,
    })
}

/// The next record (acked); `Ok(None)` for an unreadable one (logged and skipped). Cancel
/// safe only between records: a record received and not yet acked is redelivered on the next
/// session.
async fn next(consumer: &mut lapin::Consumer) -> fleet::Result<Option<Record>> {
    let delivery = match consumer.next().await {
        Some(Ok(d)) => d,
        Some(Err(e)) => return Err(e.into()),
        None => {
            return Err(fleet::Error::ConsumerEnded {
                queue: "the schedules stream".into(),
            })
        }
    };
    let rec = serde_json::from_slice::<Record>(&delivery.data);
    delivery.acker.ack(BasicAckOptions::default()).await?;
    match rec {
        Ok(r) => Ok(Some(r)),
        Err(e) => {
            tracing::warn!(error = %e, "ignoring an unreadable record in the schedules stream");
            Ok(None)
        }
    }
}

impl Follower {
    /// Applies each new record as it arrives, until `shutdown` (`Ok`) or a broker failure
    /// (`Err`: the session restarts and the replay starts over).
    pub async fn run(mut self, shutdown: CancellationToken) -> fleet::Result<()> {
        loop {
            let rec = tokio::select! {
                biased;
                _ = shutdown.cancelled() => {
                    let _ = self.ch.close(200, "bye".into()).await;
                    return Ok(());
                }
                r = next(&mut self.consumer) => r?,
            };
            if let Some(rec) = rec {
                self.board.apply(&rec);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(name: &str) -> ScheduleSpec {
        serde_json::from_value(
            json!({"name": name, "cron": "* * * * * *", "task": {"kind": "noop"}}),
        )
        .unwrap()
    }

    #[test]
    fn folding_applies_changes_in_log_order() {
        let mut defs = Defs::new();
        for (i, c) in [
            Change::Put {
                schedule: spec("a"),
            },
            Change::Put {
                schedule: spec("b"),
            },
            Change::Pause { name: "a".into() },
            Change::Delete { name: "b".into() },
            Change::Sync,
            Change::Pause { name: "zzz".into() },
        ]
        .into_iter()
        .enumerate()
        {
            apply(&mut defs, &Record::new(c, i as i64));
        }
        assert_eq!(defs.keys().collect::<Vec<_>>(), ["a"]);
        assert!(!defs["a"].enabled());
        assert_eq!(defs["a"].changed_at_ms, 2);
        apply(
            &mut defs,
            &Record::new(Change::Resume { name: "a".into() }, 9),
        );
        assert!(defs["a"].enabled());
        assert_eq!(defs["a"].changed_at_ms, 9);
    }

    #[test]
    fn a_second_put_of_a_name_is_ignored_until_it_is_deleted() {
        let mut defs = Defs::new();
        let first = Record::new(
            Change::Put {
                schedule: spec("a"),
            },
            1,
        );
        let mut other = spec("a");
        other.cron = "0 0 * * * *".into();
        let second = Record::new(Change::Put { schedule: other }, 2);
        apply(&mut defs, &first);
        apply(&mut defs, &second);
        assert_eq!(defs["a"].put_id, first.id);
        assert_eq!(defs["a"].schedule.spec.cron, "* * * * * *");
        assert_eq!(defs["a"].created_at_ms, 1);
        apply(
            &mut defs,
            &Record::new(Change::Delete { name: "a".into() }, 3),
        );
        apply(&mut defs, &second);
        assert_eq!(defs["a"].put_id, second.id);
        assert_eq!(defs["a"].created_at_ms, 2);
    }

    #[test]
    fn records_round_trip_as_tagged_json() {
        let r = Record::new(Change::Pause { name: "n".into() }, 5);
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["op"], "pause");
        assert_eq!(v["name"], "n");
        assert_eq!(serde_json::from_value::<Record>(v).unwrap(), r);
    }
}
