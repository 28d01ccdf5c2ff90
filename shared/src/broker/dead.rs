//! Dead letters (`<ns>.dead`): reading them without removing them, and replaying them as new
//! submissions. `fleetctl dead list|replay` and the scheduler's `/v1/dead` API both use this
//! module, so the two never disagree on what a replay resets.
//!
//! **Reading without removing.** AMQP 0-9-1 has no "peek": a reader takes messages with
//! `basic.get` *without acking them* and closes its channel, which hands every unacked message
//! back to the queue (classic queues put them back in place; quorum queues count it as a
//! redelivery — the dead queue has no delivery limit, so nothing is dropped). While a reader
//! holds a message no other reader can see it, so every reader of a namespace's dead queue —
//! each scheduler replica's API, `fleetctl` — first takes one lease in Redis ([`ReaderLease`],
//! `deadrd`, renewed while it reads): a listing on one replica is complete whatever the others
//! do, and a replay considers exactly the letters in the queue when it starts (the queue is
//! FIFO and nobody else holds any, so its first `depth` gets are those letters; a replayed task
//! that dies again lands behind them). A lease and not a listing that hides nothing: RabbitMQ
//! has no way to read a queue's messages without taking them (a stream would, but the dead
//! queue is a quorum queue that `basic.get`, acks and the broker's dead-lettering need). Waiting
//! for the lease is bounded ([`LEASE_WAIT`]); a reader that dies frees it when its TTL runs out.
//! A listing is bounded by `scan`: a queue deeper than that is reported with its depth and the
//! first `scan` letters.
//!
//! **Replay** = the task submitted again, as if new: attempt 0, no `not_before`, a fresh
//! `submitted_at` (so its wait is measured from the replay and it gets the full no-match grace;
//! sent in the `x-fleet-submitted-at` header), a relative `timeout_ms` restarted (an absolute
//! `deadline` is the producer's and stays). It is published with confirms to `<ns>.submit` with
//! the `x-fleet-replay` header and only then acked off the dead queue: a failure leaves the
//! letter where it was. Per letter, before publishing:
//!
//! * **Size.** The producer's size limit (`FLEET_MAX_TASK_BYTES`) is for the producer's bytes;
//!   the scheduler measures a replay without the fields fleet itself fills in
//!   ([`Envelope::fleet_fields_len`]), and the replay measures it the same way first: a letter
//!   that would still be over the limit (an `oversized` letter, unless the limit was raised) is
//!   refused with that reason instead of being sent into a certain re-death.
//! * **One replay of an id at a time** (`broker/dead_claim.lua`, atomic in Redis): the id is
//!   claimed only if its status is absent or final; the claim clears its dedupe mark and holds
//!   the status `queued` until the scheduler dispatches it. Another letter of the same id, in
//!   this replay or on another replica, finds the id in flight (or its replay succeeded within
//!   the dedupe window) and is left in the dead queue with that reason — two letters of one id
//!   never run it twice. A replayed task that died again may be replayed at once. A failed publish gives the
//!   claim back (`broker/dead_unclaim.lua`).
//!
//! **Cancelled tasks** are never dead letters, but their messages are kept the same way in
//! `<ns>.cancelled` ([`Names::cancelled_queue`]) by whoever dropped them; [`replay_from`] replays
//! from either queue with everything above (the bulk retry of `POST /v1/tasks/bulk`).
//!
//! Without Redis ([`replay`] given no store: `fleetctl` with Redis unreachable) there is neither
//! lease nor claim: the replay proceeds as before, with a warning.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use deadpool_redis::redis;
use lapin::options::{BasicAckOptions, BasicGetOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use serde::Serialize;
use serde_json::Value;

use crate::broker::amqp;
use crate::error::{Error, Result};
use crate::status::DeadReason;
use crate::task::headers;
use crate::{Envelope, Names, Store};

/// One dead letter as operators see it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct DeadLetter {
    /// The task id (the envelope's, or the message id of an unparseable body); `-` if neither.
    pub id: String,
    /// The envelope's `kind`; `-` for a body that is not an envelope.
    pub kind: String,
    /// Why it died: fleet's `x-fleet-reason` (a [`DeadReason`]: `max_attempts`,
    /// `permanent_error`, `no_matching_worker`, `worker_lost`, a refusal code...) or the
    /// broker's own (`x-first-death-reason`, e.g. `delivery_limit`); `-` when the letter has
    /// neither. Kept as the letter says it: a letter from another version or another producer
    /// may carry a word this version does not know ([`DeadLetter::dead_reason`] types it).
    pub reason: String,
    /// The last error or the refusal's detail (at most 1 KiB).
    pub detail: String,
    /// Attempts made, when known.
    pub attempts: Option<u64>,
    /// The last worker that handled it, when known.
    pub worker: Option<String>,
    /// When it was dead-lettered, ms since the Unix epoch (whole seconds: the AMQP timestamp).
    pub dead_at_ms: Option<i64>,
    /// False for a body that is not a valid envelope (it can be inspected, not replayed).
    pub replayable: bool,
    /// The message body: the envelope as JSON, or the raw text of a body that is not JSON.
    pub envelope: Value,
}

impl DeadLetter {
    /// [`DeadLetter::reason`] as a [`DeadReason`]; `None` for a word this version does not know
    /// (or `-`).
    pub fn dead_reason(&self) -> Option<DeadReason> {
        self.reason.parse().ok()
    }
}

/// A bounded view of the dead queue.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Listing {
    /// Messages in the dead queue when the listing started.
    pub depth: u32,
    /// The first `min(depth, scan)` letters, oldest first.
    pub letters: Vec<DeadLetter>,
}

/// Which dead letters a replay takes: every one matching all the given conditions.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Selection {
    /// Only these task ids (`None`: any id).
    pub ids: Option<BTreeSet<String>>,
    /// Only this reason.
    pub reason: Option<String>,
    /// Only this kind.
    pub kind: Option<String>,
}

impl Selection {
    /// Every dead letter.
    pub fn all() -> Self {
        Selection::default()
    }

    /// The letters of these task ids.
    pub fn ids<I: IntoIterator<Item = S>, S: Into<String>>(ids: I) -> Self {
        Selection {
            ids: Some(ids.into_iter().map(Into::into).collect()),
            ..Default::default()
        }
    }

    /// Whether letter `d` meets every condition given.
    pub fn matches(&self, d: &DeadLetter) -> bool {
        self.ids.as_ref().is_none_or(|ids| ids.contains(&d.id))
            && self.reason.as_ref().is_none_or(|r| *r == d.reason)
            && self.kind.as_ref().is_none_or(|k| *k == d.kind)
    }
}

/// What a replay did.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct ReplayReport {
    /// Task ids published to `<ns>.submit` and removed from the dead queue.
    pub replayed: Vec<String>,
    /// Selected letters left in the dead queue, with why (publish refused, not an envelope).
    pub failed: Vec<(String, String)>,
    /// Asked-for ids that were not in the dead queue.
    pub missing: Vec<String>,
}

/// Reads a dead letter's fields from its properties and body.
pub fn describe(props: &BasicProperties, data: &[u8]) -> DeadLetter {
    let parsed = Envelope::from_slice(data, usize::MAX);
    let body: Value = serde_json::from_slice(data)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(data).into_owned()));
    let text = |k: &str| body.get(k).and_then(Value::as_str).map(str::to_string);
    let id = text("id")
        .or_else(|| props.message_id().as_ref().map(|s| s.to_string()))
        .unwrap_or_else(|| "-".into());
    let reason = amqp::header_str(props, headers::REASON)
        .or_else(|| amqp::header_str(props, "x-first-death-reason"))
        .unwrap_or_else(|| "-".into());
    let attempts = amqp::header_str(props, headers::ATTEMPTS)
        .and_then(|a| a.parse().ok())
        .or_else(|| body.get("attempt").and_then(Value::as_u64));
    // The broker's own death time first: a letter it dead-lettered (delivery limit, TTL) keeps
    // the timestamp of its last publish — when it was dispatched, not when it died — also
    // after the backstop republishes it with the same properties.
    let dead_at_ms =
        death_time_ms(props).or_else(|| props.timestamp().map(|s| (s as i64).saturating_mul(1000)));
    DeadLetter {
        id,
        kind: text("kind").unwrap_or_else(|| "-".into()),
        reason,
        detail: amqp::header_str(props, headers::DETAIL).unwrap_or_default(),
        attempts,
        worker: amqp::header_str(props, headers::WORKER),
        dead_at_ms,
        replayable: parsed.is_ok(),
        envelope: body,
    }
}

/// The broker's `x-death[0].time` (seconds) for a message the broker itself dead-lettered.
fn death_time_ms(props: &BasicProperties) -> Option<i64> {
    let h = props.headers().as_ref()?;
    let AMQPValue::FieldArray(deaths) = h.inner().get("x-death")? else {
        return None;
    };
    let AMQPValue::FieldTable(first) = deaths.as_slice().first()? else {
        return None;
    };
    match first.inner().get("time")? {
        AMQPValue::Timestamp(t) => Some((*t as i64).saturating_mul(1000)),
        _ => None,
    }
}

/// Messages ready in a queue (passive declare: an error if the queue does not exist).
async fn depth(ch: &Channel, queue: &str) -> Result<u32> {
    let q = ch
        .queue_declare(
            ShortString::from(queue),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    Ok(q.message_count())
}

/// Lists up to `scan` dead letters without removing any (see the module docs), holding the
/// namespace's [`ReaderLease`] when `store` is given. With Redis unreachable the listing goes
/// ahead without the lease (logged): a view that a concurrent reader may thin out beats none.
///
/// # Errors
/// The broker refused; the lease not free within [`LEASE_WAIT`] ([`Error::Busy`]).
pub async fn list(
    conn: &Connection,
    store: Option<&Store>,
    names: &Names,
    scan: u32,
) -> Result<Listing> {
    let mut lease = match store {
        Some(s) => match ReaderLease::acquire(s).await {
            Ok(l) => Some(l),
            Err(e @ Error::Busy(_)) => return Err(e),
            Err(e) => {
                tracing::warn!(error = %e, "cannot take the dead-queue reader lease (Redis); listing without it — a reader elsewhere may hide some letters");
                None
            }
        },
        None => None,
    };
    let result = list_on(conn, lease.as_mut(), names, scan).await;
    if let Some(l) = lease {
        l.release().await;
    }
    result
}

async fn list_on(
    conn: &Connection,
    mut lease: Option<&mut ReaderLease<'_>>,
    names: &Names,
    scan: u32,
) -> Result<Listing> {
    let ch = conn.create_channel().await?;
    let queue = names.dead_queue();
    let result = async {
        let depth = depth(&ch, &queue).await?;
        let mut letters = Vec::new();
        for _ in 0..scan.min(depth) {
            if let Some(l) = lease.as_deref_mut() {
                l.keep().await?;
            }
            let Some(m) = ch
                .basic_get(
                    ShortString::from(queue.as_str()),
                    BasicGetOptions::default(),
                )
                .await?
            else {
                break;
            };
            letters.push(describe(&m.delivery.properties, &m.delivery.data));
        }
        Ok(Listing { depth, letters })
    }
    .await;
    // Closing the channel hands every message taken back to the queue.
    let _ = ch.close(200, ShortString::from("dead list done")).await;
    result
}

/// How long a reader waits for the [`ReaderLease`] before giving up ([`Error::Busy`]).
pub const LEASE_WAIT: Duration = Duration::from_secs(30);
/// The lease's TTL: how long a reader that died holds the dead queue up. A live reader renews
/// it at a third of that ([`ReaderLease::keep`]), so a slow broker never lets it lapse.
const LEASE_TTL: Duration = Duration::from_secs(15);

/// The namespace's dead-queue reader lease (`deadrd` in Redis: the holder's token with a TTL;
/// see the module docs). Taken with `SET NX PX`, renewed and released by `broker/dead_lock.lua`
/// only while held.
pub struct ReaderLease<'a> {
    store: &'a Store,
    token: String,
    renewed: Instant,
}

impl<'a> ReaderLease<'a> {
    /// Waits up to [`LEASE_WAIT`] for the lease (polling every 20 ms).
    ///
    /// # Errors
    /// Redis unreachable; [`Error::Busy`] when another reader held it the whole time.
    ///
    /// # Cancel safety
    /// Dropped after it took the lease, the lease stays taken until its TTL runs out.
    pub async fn acquire(store: &'a Store) -> Result<Self> {
        let token = uuid::Uuid::new_v4().simple().to_string();
        let started = Instant::now();
        loop {
            let got: Option<String> = store
                .query(
                    redis::cmd("SET")
                        .arg(store.names.dead_lock())
                        .arg(&token)
                        .arg("NX")
                        .arg("PX")
                        .arg(crate::redis::millis(LEASE_TTL)),
                )
                .await?;
            if got.is_some() {
                return Ok(ReaderLease {
                    store,
                    token,
                    renewed: Instant::now(),
                });
            }
            if started.elapsed() >= LEASE_WAIT {
                return Err(Error::Busy(format!(
                    "another reader (a scheduler replica or fleetctl) has held the dead queue for {} s",
                    LEASE_WAIT.as_secs()
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Renews the lease once a third of its TTL has passed since the last renewal.
    ///
    /// # Errors
    /// Redis unreachable; [`Error::Busy`] if the lease was lost (it ran out: another reader
    /// may be reading now, so this one stops).
    pub async fn keep(&mut self) -> Result<()> {
        if self.renewed.elapsed() < LEASE_TTL / 3 {
            return Ok(());
        }
        if self.call(crate::redis::millis(LEASE_TTL)).await? == 0 {
            return Err(Error::Busy(
                "the dead-queue reader lease ran out while reading".into(),
            ));
        }
        self.renewed = Instant::now();
        Ok(())
    }

    /// Gives the lease back (a failure is logged: the TTL frees it).
    pub async fn release(self) {
        if let Err(e) = self.call(0).await {
            tracing::warn!(error = %e, "cannot release the dead-queue reader lease; it runs out by itself");
        }
    }

    async fn call(&self, ttl_ms: i64) -> Result<i64> {
        let mut inv = self.store.scripts.dead_lock.prepare_invoke();
        inv.key(self.store.names.dead_lock())
            .arg(&self.token)
            .arg(ttl_ms);
        self.store.invoke(&inv).await
    }
}

/// What a replay checks a letter against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplayLimits {
    /// The producer's size limit (`FLEET_MAX_TASK_BYTES`), in bytes, measured as the scheduler
    /// measures a replay ([`Envelope::fleet_fields_len`]).
    pub max_bytes: usize,
    /// The status TTL (`FLEET_STATUS_TTL_MS`): how long the claim's `queued` record lives.
    pub status_ttl: Duration,
}

/// Replays the selected dead letters (see the module docs). `store` takes the reader lease and
/// claims each id (one replay of an id at a time); without it (Redis down) neither happens and
/// the scheduler may drop a replay whose id it saw within its dedupe window, so callers should
/// pass one.
///
/// # Errors
/// The broker refused reading the queue; Redis unreachable when taking the lease;
/// [`Error::Busy`] (the lease). A letter that cannot be replayed is not an error: it is in
/// [`ReplayReport::failed`] with why.
pub async fn replay(
    conn: &Connection,
    store: Option<&Store>,
    names: &Names,
    sel: &Selection,
    limits: &ReplayLimits,
) -> Result<ReplayReport> {
    replay_from(conn, store, names, &names.dead_queue(), sel, limits).await
}

/// [`replay`] from any queue of task messages kept as dead letters are: `<ns>.dead`, or
/// `<ns>.cancelled` ([`Names::cancelled_queue`]: the messages of cancelled tasks, which a bulk
/// retry runs again as new runs). The same reader lease (one reader of either queue at a
/// time in the namespace), the same per-id claim (`dead_claim.lua`: a cancelled task's
/// status is final, so it is claimed as a dead one is), the same reset and confirms; what is
/// not replayed goes back to `queue`.
///
/// # Errors
/// As [`replay`]; a missing `queue` is an error of the broker (404).
pub async fn replay_from(
    conn: &Connection,
    store: Option<&Store>,
    names: &Names,
    queue: &str,
    sel: &Selection,
    limits: &ReplayLimits,
) -> Result<ReplayReport> {
    let mut lease = match store {
        Some(s) => Some(ReaderLease::acquire(s).await?),
        None => {
            tracing::warn!("replaying without Redis: no reader lease and no per-id claim; a replay on another replica at the same time may run an id twice");
            None
        }
    };
    let result = match conn.create_channel().await {
        Ok(get) => {
            let r = replay_on(conn, &get, store, lease.as_mut(), names, queue, sel, limits).await;
            // Everything not replayed goes back to its queue.
            let _ = get.close(200, ShortString::from("replay done")).await;
            r
        }
        Err(e) => Err(e.into()),
    };
    if let Some(l) = lease {
        l.release().await;
    }
    result
}

/// Why a letter of `size` producer bytes is not replayed under `limit`.
fn oversized_reason(size: usize, limit: usize) -> String {
    format!("oversized: the task is {size} bytes (without fleet's own fields), over the {limit}-byte limit (FLEET_MAX_TASK_BYTES); a replay would be dead-lettered again — raise the limit or submit it smaller")
}

async fn claim(store: &Store, token: &str, id: &str, ttl: Duration) -> Result<String> {
    let mut inv = store.scripts.dead_claim.prepare_invoke();
    inv.key(store.names.prefix())
        .arg(token)
        .arg(crate::redis::millis(ttl))
        .arg(id);
    let answer: Vec<String> = store.invoke(&inv).await?;
    Ok(answer.into_iter().next().unwrap_or_default())
}

async fn unclaim(store: &Store, token: &str, id: &str) {
    let mut inv = store.scripts.dead_unclaim.prepare_invoke();
    inv.key(store.names.task(id)).arg(token);
    if let Err(e) = store.invoke::<i64>(&inv).await {
        tracing::warn!(task.id = %crate::task::escape(id), error = %e, "cannot give back a replay's claim; the id counts as queued until its status record expires");
    }
}

#[allow(clippy::too_many_arguments)]
async fn replay_on(
    conn: &Connection,
    get: &Channel,
    store: Option<&Store>,
    mut lease: Option<&mut ReaderLease<'_>>,
    names: &Names,
    queue: &str,
    sel: &Selection,
    limits: &ReplayLimits,
) -> Result<ReplayReport> {
    let publish = amqp::confirm_channel(conn).await?;
    let total = depth(get, queue).await?;
    let token = uuid::Uuid::new_v4().simple().to_string();
    let mut report = ReplayReport::default();
    let mut seen = BTreeSet::new();
    let mut replayed = BTreeSet::new();
    for _ in 0..total {
        if let Some(l) = lease.as_deref_mut() {
            l.keep().await?;
        }
        let Some(m) = get
            .basic_get(ShortString::from(queue), BasicGetOptions::default())
            .await?
        else {
            break;
        };
        let d = m.delivery;
        let letter = describe(&d.properties, &d.data);
        if !sel.matches(&letter) {
            continue;
        }
        seen.insert(letter.id.clone());
        let mut env = match Envelope::from_slice(&d.data, usize::MAX) {
            Ok(e) => e,
            Err(r) => {
                report
                    .failed
                    .push((letter.id, format!("not a valid envelope: {r}")));
                continue;
            }
        };
        if replayed.contains(&env.id) {
            report.failed.push((
                env.id,
                "another dead letter of this id was replayed by this call; this one is left in its queue".into(),
            ));
            continue;
        }
        reset_for_replay(&mut env);
        // `submitted_at` travels in the header (the scheduler takes it from there), so the body
        // is the producer's fields and few of fleet's.
        let submitted = env.submitted_at.take().unwrap_or_else(chrono::Utc::now);
        let body = env.to_bytes();
        let size = body.len().saturating_sub(env.fleet_fields_len());
        if size > limits.max_bytes {
            report
                .failed
                .push((env.id, oversized_reason(size, limits.max_bytes)));
            continue;
        }
        if let Some(store) = store {
            match claim(store, &token, &env.id, limits.status_ttl).await {
                Ok(a) if a == "ok" => {}
                Ok(state) => {
                    let why = if state == crate::status::TaskState::Succeeded.as_str() {
                        "a replay of this id succeeded within the dedupe window".to_string()
                    } else {
                        format!("the task is {state} (replayed already, or submitted again)")
                    };
                    report
                        .failed
                        .push((env.id, format!("{why}; this letter is left in its queue")));
                    continue;
                }
                Err(e) => {
                    report
                        .failed
                        .push((env.id, format!("cannot claim the id in Redis: {e}")));
                    continue;
                }
            }
        }
        let props = amqp::task_properties(
            &env.id,
            Some(amqp::headers([
                (headers::REPLAY, "1".to_string()),
                (
                    headers::SUBMITTED_AT,
                    headers::submitted_at_value(submitted),
                ),
            ])),
        );
        match amqp::publish_confirmed(
            &publish,
            &names.submit_exchange(),
            env.lane.as_str(),
            &body,
            props,
        )
        .await
        {
            Ok(()) => {
                // Replayed either way: a failed ack leaves the letter to come back to the dead
                // queue (a later replay finds the id in flight or, once it ended, replays it
                // once more), and the replays before and after it still count — not an error
                // for the whole call.
                if let Err(e) = d.acker.ack(BasicAckOptions::default()).await {
                    tracing::warn!(task.id = %crate::task::escape(&env.id), error = %e, "replayed, but its dead letter could not be removed; it goes back to its queue");
                }
                replayed.insert(env.id.clone());
                report.replayed.push(env.id);
            }
            Err(e) => {
                // Only a definite refusal (a nack, unroutable) proves nothing was published:
                // after a lost channel or a confirm that never came the copy may be in the
                // broker and run, so the claim stays until its TTL — giving it back would let
                // a later replay run the id a second time.
                if let (Some(store), crate::Error::Refused(_)) = (store, &e) {
                    unclaim(store, &token, &env.id).await;
                }
                report.failed.push((env.id, e.to_string()));
            }
        }
    }
    let _ = publish.close(200, ShortString::from("replay done")).await;
    if let Some(ids) = &sel.ids {
        report.missing = ids
            .iter()
            .filter(|id| !seen.contains(*id))
            .cloned()
            .collect();
    }
    Ok(report)
}

/// What a deletion did.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct DeleteReport {
    /// Task ids whose dead letters were removed (acked off the dead queue) — every letter of
    /// the id in the queue.
    pub deleted: Vec<String>,
    /// Asked-for ids that were not in the dead queue.
    pub missing: Vec<String>,
}

/// Deletes the selected dead letters: each is taken off the dead queue for good (acked), and
/// its task's status record — when it still says dead or expired — goes with its attempt log
/// and its task-index entry (`status/forget.lua`), so the task leaves the task list. Reads the
/// queue as [`replay`] does (the reader lease, the letters in the queue when it starts; every
/// letter not selected goes back in place when the channel closes).
///
/// # Errors
/// The broker refused reading the queue; Redis unreachable when taking the lease;
/// [`Error::Busy`] (the lease).
pub async fn delete(
    conn: &Connection,
    store: &Store,
    names: &Names,
    sel: &Selection,
) -> Result<DeleteReport> {
    let mut lease = ReaderLease::acquire(store).await?;
    let result = match conn.create_channel().await {
        Ok(get) => {
            let r = delete_on(&get, &mut lease, names, sel).await;
            let _ = get.close(200, ShortString::from("delete done")).await;
            r
        }
        Err(e) => Err(e.into()),
    };
    lease.release().await;
    let report = result?;
    if !report.deleted.is_empty() {
        let mut inv = store.scripts.forget.prepare_invoke();
        inv.key(store.names.prefix());
        for id in &report.deleted {
            inv.arg(id);
        }
        if let Err(e) = store.invoke::<i64>(&inv).await {
            tracing::warn!(error = %e, "dead letters deleted; their status records stay until their TTL");
        }
    }
    Ok(report)
}

async fn delete_on(
    get: &Channel,
    lease: &mut ReaderLease<'_>,
    names: &Names,
    sel: &Selection,
) -> Result<DeleteReport> {
    let queue = names.dead_queue();
    let total = depth(get, &queue).await?;
    let mut report = DeleteReport::default();
    let mut deleted = BTreeSet::new();
    for _ in 0..total {
        lease.keep().await?;
        let Some(m) = get
            .basic_get(
                ShortString::from(queue.as_str()),
                BasicGetOptions::default(),
            )
            .await?
        else {
            break;
        };
        let d = m.delivery;
        let letter = describe(&d.properties, &d.data);
        if !sel.matches(&letter) {
            continue;
        }
        match d.acker.ack(BasicAckOptions::default()).await {
            Ok(_) => {
                if deleted.insert(letter.id.clone()) {
                    report.deleted.push(letter.id);
                }
            }
            Err(e) => {
                tracing::warn!(task.id = %crate::task::escape(&letter.id), error = %e, "cannot delete a dead letter; it goes back to the dead queue")
            }
        }
    }
    if let Some(ids) = &sel.ids {
        report.missing = ids
            .iter()
            .filter(|id| !deleted.contains(*id))
            .cloned()
            .collect();
    }
    Ok(report)
}

/// Turns a dead envelope into a new submission (see the module docs).
pub fn reset_for_replay(env: &mut Envelope) {
    env.attempt = 0;
    env.not_before = None;
    // Submitted now, to the millisecond (the AMQP timestamp the scheduler would fall back on
    // has whole seconds only).
    env.submitted_at = Some(chrono::Utc::now());
    if env.timeout_ms.is_some() {
        env.deadline = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A replay's claim given back (`dead_unclaim.lua`): the record
    /// the claim wrote goes; one dispatched since (it names a group), or another replay's,
    /// stays.
    #[tokio::test]
    async fn an_unclaim_deletes_only_its_own_undispatched_claim() {
        use deadpool_redis::redis;
        let ns = format!("unclaim-test-{}", uuid::Uuid::new_v4().simple());
        let store = Store::new("redis://127.0.0.1:6379", crate::Names::new(&ns)).unwrap();
        let ttl = Duration::from_secs(60);
        for id in ["a", "b", "c"] {
            assert_eq!(claim(&store, "tok", id, ttl).await.unwrap(), "ok");
        }
        // "b" was dispatched since (its record names a group); "c" is another replay's.
        for (id, f, v) in [("b", "group", "g1"), ("c", "replay", "other")] {
            store
                .query::<()>(redis::cmd("HSET").arg(store.names.task(id)).arg(f).arg(v))
                .await
                .unwrap();
        }
        for id in ["a", "b", "c"] {
            unclaim(&store, "tok", id).await;
        }
        let states: Vec<Option<String>> = store.task_states(&["a", "b", "c"]).await.unwrap();
        assert_eq!(states, [None, Some("queued".into()), Some("queued".into())]);
        store.delete_namespace().await.unwrap();
    }

    fn props(h: &[(&str, &str)]) -> BasicProperties {
        amqp::task_properties(
            "m-1",
            Some(amqp::headers(h.iter().map(|(k, v)| (*k, v.to_string())))),
        )
    }

    #[test]
    fn describes_an_exhausted_task() {
        let body = br#"{"id":"t-1","kind":"resize","payload":{},"attempt":3}"#;
        let p = props(&[
            (headers::REASON, "max_attempts"),
            (headers::DETAIL, "boom"),
            (headers::ATTEMPTS, "3"),
            (headers::WORKER, "w-1"),
        ]);
        let d = describe(&p, body);
        assert_eq!(
            (
                d.id.as_str(),
                d.kind.as_str(),
                d.reason.as_str(),
                d.detail.as_str()
            ),
            ("t-1", "resize", "max_attempts", "boom")
        );
        assert_eq!(d.dead_reason(), Some(DeadReason::MaxAttempts));
        assert_eq!(
            (d.attempts, d.worker.as_deref(), d.replayable),
            (Some(3), Some("w-1"), true)
        );
        assert!(
            d.dead_at_ms.is_some(),
            "task_properties stamps the publish time"
        );
    }

    #[test]
    fn a_broker_dead_letter_is_dated_by_its_death_not_its_dispatch() {
        let mut death = FieldTable::default();
        death.insert("time".into(), AMQPValue::Timestamp(2_000));
        death.insert(
            "reason".into(),
            AMQPValue::LongString("delivery_limit".into()),
        );
        let mut h = FieldTable::default();
        h.insert(
            "x-death".into(),
            AMQPValue::FieldArray(vec![AMQPValue::FieldTable(death)].into()),
        );
        let p = BasicProperties::default()
            .with_timestamp(1_000)
            .with_headers(h);
        let d = describe(&p, br#"{"id":"t-2","kind":"k","payload":{}}"#);
        assert_eq!(
            d.dead_at_ms,
            Some(2_000_000),
            "dated by x-death's time, not the dispatch timestamp"
        );
        let d = describe(
            &BasicProperties::default().with_timestamp(1_000),
            br#"{"id":"t-3","kind":"k","payload":{}}"#,
        );
        assert_eq!(
            d.dead_at_ms,
            Some(1_000_000),
            "a worker's dead letter: its publish time"
        );
    }

    #[test]
    fn describes_a_body_that_is_not_an_envelope() {
        let d = describe(&props(&[(headers::REASON, "malformed_json")]), b"{not json");
        assert_eq!(
            (d.id.as_str(), d.kind.as_str(), d.replayable),
            ("m-1", "-", false)
        );
        assert_eq!(d.envelope, Value::String("{not json".into()));
    }

    #[test]
    fn selection_matches_every_condition() {
        let d = describe(
            &props(&[(headers::REASON, "max_attempts")]),
            br#"{"id":"a","kind":"k"}"#,
        );
        assert!(Selection::all().matches(&d));
        assert!(Selection::ids(["a", "b"]).matches(&d));
        assert!(!Selection::ids(["b"]).matches(&d));
        let by_reason = Selection {
            reason: Some("max_attempts".into()),
            kind: Some("k".into()),
            ..Default::default()
        };
        assert!(by_reason.matches(&d));
        assert!(!Selection {
            kind: Some("other".into()),
            ..by_reason
        }
        .matches(&d));
    }

    #[test]
    fn replay_resets_attempts_and_relative_timeouts_only() {
        let mut e = Envelope::new("k", Value::Null);
        e.attempt = 3;
        e.timeout_ms = Some(1000);
        e.deadline = Some(chrono::Utc::now());
        let before = chrono::Utc::now() - chrono::Duration::hours(1);
        e.submitted_at = Some(before);
        reset_for_replay(&mut e);
        assert_eq!((e.attempt, e.deadline, e.not_before), (0, None, None));
        assert!(
            e.submitted_at.is_some_and(|t| t > before),
            "a replay is a new submission"
        );
        let mut abs = Envelope::new("k", Value::Null);
        let at = chrono::Utc::now();
        abs.deadline = Some(at);
        reset_for_replay(&mut abs);
        assert_eq!(
            abs.deadline,
            Some(at),
            "an absolute deadline is the producer's"
        );
    }
}
