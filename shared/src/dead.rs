//! Dead letters (`<ns>.dead`): reading them without removing them, and replaying them as new
//! submissions. `fleetctl dead list|replay` and the scheduler's `/v1/dead` API both use this
//! module, so the two never disagree on what a replay resets.
//!
//! **Reading without removing.** AMQP 0-9-1 has no "peek": a reader takes messages with
//! `basic.get` *without acking them* and closes its channel, which hands every unacked message
//! back to the queue (classic queues put them back in place; quorum queues count it as a
//! redelivery — the dead queue has no delivery limit, so nothing is dropped). While a listing
//! holds a message another reader cannot see it, so callers in one process serialise their
//! reads (the scheduler holds one permit per namespace). A listing is bounded by `scan`: a
//! queue deeper than that is reported with its depth and the first `scan` letters.
//!
//! **Replay** = the task submitted again, as if new: attempt 0, no `not_before`, a fresh
//! `submitted_at` (so its wait is measured from the replay and it gets the full no-match grace),
//! a relative `timeout_ms` restarted (an absolute `deadline` is the producer's and stays), its
//! dedupe mark and old status cleared in Redis (else the scheduler would drop it as a duplicate).
//! It is published with confirms to `<ns>.submit` and only then acked off the dead queue: a
//! failure leaves the letter where it was. Only the letters in the queue when the replay starts
//! are considered, so a replayed task that dies again is not replayed twice.

use std::collections::BTreeSet;

use lapin::options::{BasicAckOptions, BasicGetOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use serde::Serialize;
use serde_json::Value;

use crate::amqp;
use crate::error::Result;
use crate::headers;
use crate::status::DeadReason;
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

/// Lists up to `scan` dead letters without removing any (see the module docs).
pub async fn list(conn: &Connection, names: &Names, scan: u32) -> Result<Listing> {
    let ch = conn.create_channel().await?;
    let queue = names.dead_queue();
    let result = async {
        let depth = depth(&ch, &queue).await?;
        let mut letters = Vec::new();
        for _ in 0..scan.min(depth) {
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

/// Replays the selected dead letters (see the module docs). `store` clears each replayed
/// task's dedupe mark and old status; without it (Redis down) the scheduler may drop a replay
/// whose id it saw within its dedupe window, so callers should pass one.
pub async fn replay(
    conn: &Connection,
    store: Option<&Store>,
    names: &Names,
    sel: &Selection,
) -> Result<ReplayReport> {
    let get = conn.create_channel().await?;
    let result = replay_on(conn, &get, store, names, sel).await;
    // Everything not replayed goes back to the dead queue.
    let _ = get.close(200, ShortString::from("replay done")).await;
    result
}

async fn replay_on(
    conn: &Connection,
    get: &Channel,
    store: Option<&Store>,
    names: &Names,
    sel: &Selection,
) -> Result<ReplayReport> {
    let publish = amqp::confirm_channel(conn).await?;
    let queue = names.dead_queue();
    let total = depth(get, &queue).await?;
    let mut report = ReplayReport::default();
    let mut seen = BTreeSet::new();
    for _ in 0..total {
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
        reset_for_replay(&mut env);
        if let Some(store) = store {
            if let Err(e) = store.forget_task(&env.id).await {
                tracing::warn!(task.id = %env.id, error = %e, "cannot clear the dedupe mark of a replayed task; the scheduler may drop it as a duplicate");
            }
        }
        let props = amqp::task_properties(
            &env.id,
            Some(amqp::headers([(headers::REPLAY, "1".to_string())])),
        );
        match amqp::publish_confirmed(
            &publish,
            &names.submit_exchange(),
            env.lane.as_str(),
            &env.to_bytes(),
            props,
        )
        .await
        {
            Ok(()) => {
                // Replayed either way: a failed ack leaves the letter to come back to the dead
                // queue (where a later replay could send it once more), and the replays before
                // and after it still count — not an error for the whole call.
                if let Err(e) = d.acker.ack(BasicAckOptions::default()).await {
                    tracing::warn!(task.id = %env.id, error = %e, "replayed, but its dead letter could not be removed; it goes back to the dead queue");
                }
                report.replayed.push(env.id);
            }
            Err(e) => report.failed.push((env.id, e.to_string())),
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
