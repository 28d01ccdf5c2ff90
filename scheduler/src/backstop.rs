//! The backstop for dead letters the broker makes itself.
//!
//! A quorum group queue dead-letters a message redelivered more than
//! [`fleet::broker::topology::DELIVERY_LIMIT`] times (RabbitMQ's `x-delivery-limit`) on its own, with
//! no word from fleet: no `x-fleet-reason`, and a status that still says `queued` or `running`.
//! The group queues' dead-letter routing key therefore leads to the internal queue
//! `<ns>.dead.broker`, which this loop consumes. For each letter it
//!
//! 1. drops a scheduler health probe (acked, never a user's dead letter); keeps a cancelled
//!    task's letter in `<ns>.cancelled` instead of the dead-letter queue (confirmed, then
//!    acked: a bulk retry can run it again);
//! 2. republishes the message, body and properties unchanged (the broker's `x-death` history
//!    included), to the dead-letter queue `<ns>.dead` with `x-fleet-reason` = the broker's
//!    reason (`x-first-death-reason`, e.g. `delivery_limit`) and an `x-fleet-detail`, waiting
//!    for the publisher confirm;
//! 3. writes the task's status `dead` with that reason, releasing its reservation and running
//!    records ([`fleet::Store::record_broker_dead`]) — unless its attempt had already ended with
//!    a final state, in which case the letter was a stale copy and step 2 is skipped;
//! 4. acks the letter.
//!
//! A crash between 2 and 4 leaves the letter in `<ns>.dead.broker`; its next reading finds the
//! status final and drops it, so the dead-letter queue gets it once (at-least-once only while
//! Redis is unreachable). While Redis refuses step 3 the letter is held, not acked: the status
//! is never left saying `queued` or `running` for a task that is in `<ns>.dead`. Several scheduler replicas share the queue as competing consumers.

use std::sync::Arc;

use fleet::broker::amqp::{self, DETAIL_HEADER, PROBE_HEADER, REASON_HEADER};
use fleet::{metrics as m, Envelope, Lane, Names};
use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::{AMQPValue, FieldTable};
use tokio_util::sync::CancellationToken;

use crate::session::Session;

/// Letters the loop holds unacked at once.
const PREFETCH: u16 = 32;
/// Retries of a letter's status write while Redis fails: from `STATUS_RETRY_MIN`, doubling
/// up to `STATUS_RETRY_MAX`.
const STATUS_RETRY_MIN: std::time::Duration = std::time::Duration::from_millis(200);
const STATUS_RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(5);
/// How often a letter held that way is warned about again.
const STATUS_REWARN: std::time::Duration = std::time::Duration::from_secs(60);

/// The backstop loop.
pub struct Backstop {
    pub session: Arc<Session>,
}

impl Backstop {
    /// Consumes `<ns>.dead.broker` until shutdown (`Ok`) or a channel error (`Err`: the
    /// session restarts).
    pub async fn run(self, shutdown: CancellationToken) -> fleet::Result<()> {
        let s = &self.session;
        let queue = s.names.broker_dead_queue();
        let ch = s.conn.create_channel().await?;
        ch.basic_qos(PREFETCH, BasicQosOptions::default()).await?;
        let mut consumer = ch
            .basic_consume(
                queue.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let result = loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break Ok(()),
                next = consumer.next() => match next {
                    Some(Ok(delivery)) => {
                        if let Err(e) = handle(s, delivery, &shutdown).await {
                            break Err(e);
                        }
                    }
                    Some(Err(e)) => break Err(e.into()),
                    None => break Err(fleet::Error::ConsumerEnded { queue: queue.to_string() }),
                },
            }
        };
        let _ = ch.close(200, "backstop done".into()).await;
        result
    }
}

/// What the broker's headers say about a letter.
#[derive(Debug, Clone, PartialEq)]
pub struct BrokerDeath {
    /// `x-first-death-reason` (`delivery_limit`, `rejected`, `expired`, `maxlen`); `unknown`.
    pub reason: String,
    /// The group and lane of the queue it died in, when that was a group queue.
    pub from: Option<(String, Lane)>,
    /// `x-death[0].count` (how many times it died there).
    pub count: Option<i64>,
}

/// Reads `x-first-death-reason` and `x-death[0]` (queue, count). `names` parses the queue name
/// `<ns>.group.<group>.<lane>`.
pub fn broker_death(names: &Names, headers: Option<&FieldTable>) -> BrokerDeath {
    let text = |v: &AMQPValue| match v {
        AMQPValue::LongString(s) => Some(s.to_string()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        _ => None,
    };
    let h = headers.map(|h| h.inner());
    let first = h.and_then(|h| match h.get("x-death") {
        Some(AMQPValue::FieldArray(a)) => match a.as_slice().first() {
            Some(AMQPValue::FieldTable(t)) => Some(t.inner().clone()),
            _ => None,
        },
        _ => None,
    });
    let reason = h
        .and_then(|h| h.get("x-first-death-reason").and_then(text))
        .or_else(|| first.as_ref().and_then(|f| f.get("reason").and_then(text)))
        .unwrap_or_else(|| "unknown".into());
    let queue = h
        .and_then(|h| h.get("x-first-death-queue").and_then(text))
        .or_else(|| first.as_ref().and_then(|f| f.get("queue").and_then(text)));
    let from = queue.and_then(|q| group_of(names, &q));
    let count = first.as_ref().and_then(|f| match f.get("count") {
        Some(AMQPValue::LongLongInt(n)) => Some(*n),
        Some(AMQPValue::LongInt(n)) => Some(i64::from(*n)),
        _ => None,
    });
    BrokerDeath {
        reason,
        from,
        count,
    }
}

/// `<ns>.group.<group>.<lane>`, or a shard `<ns>.group.<group>.normal.<n>` (see
/// [`Names::group_shard_queue`]) → (group, lane).
fn group_of(names: &Names, queue: &str) -> Option<(String, Lane)> {
    let prefix = names.group_queue("", Lane::Normal);
    let prefix = prefix.strip_suffix(&format!(".{}", Lane::Normal))?;
    let rest = queue.strip_prefix(prefix)?;
    let shard_suffix = format!(".{}.", Lane::Normal);
    let rest = match rest.rsplit_once('.') {
        Some((head, n))
            if !n.is_empty()
                && n.bytes().all(|b| b.is_ascii_digit())
                && format!("{head}.").ends_with(&shard_suffix) =>
        {
            head
        }
        _ => rest,
    };
    let (group, lane) = rest.rsplit_once('.')?;
    let lane = Lane::ALL.into_iter().find(|l| l.as_str() == lane)?;
    (!group.is_empty()).then(|| (group.to_string(), lane))
}

/// Publishes `delivery`'s body, with its properties and `headers` added, to the tasks exchange
/// under `key` (the dead-letter or the cancelled queue), confirmed. `Ok(false)`: not confirmed —
/// logged with `what` failed, the delivery nacked back to its queue and the loop paused 500 ms
/// (no spinning on a refusing queue). Errors: the nack itself failed.
async fn move_letter(
    s: &Session,
    delivery: &Delivery,
    headers: &[(&str, String)],
    key: &str,
    id: &str,
    what: &str,
) -> fleet::Result<bool> {
    let mut table = delivery.properties.headers().clone().unwrap_or_default();
    for (k, v) in headers {
        table.insert((*k).into(), AMQPValue::LongString(v.clone().into()));
    }
    let out = delivery.properties.clone().with_headers(table);
    let published = amqp::publish_confirmed(
        &s.publisher(),
        &s.names.tasks_exchange(),
        key,
        &delivery.data,
        out,
    )
    .await;
    if let Err(e) = published {
        tracing::warn!(task.id = %fleet::task::escape(id), error = %e, "cannot {what}; requeued");
        delivery
            .acker
            .nack(BasicNackOptions {
                requeue: true,
                ..Default::default()
            })
            .await?;
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        return Ok(false);
    }
    Ok(true)
}

/// One letter, steps 1-4 of the module's account. Returns without acking when `shutdown`
/// fires while Redis refuses its status (the letter goes back to its queue with the channel).
async fn handle(
    s: &Session,
    delivery: Delivery,
    shutdown: &CancellationToken,
) -> fleet::Result<()> {
    let props = delivery.properties.clone();
    let death = broker_death(&s.names, props.headers().as_ref());
    let parsed = Envelope::from_slice(&delivery.data, usize::MAX).ok();
    let id = parsed
        .as_ref()
        .map(|e| e.id.clone())
        .or_else(|| props.message_id().as_ref().map(|s| s.to_string()))
        .unwrap_or_default();
    // Health probes never become a user's dead letter (nor a status anyone reads).
    if amqp::header_text(&props, PROBE_HEADER).is_some() {
        tracing::info!(task.id = %fleet::task::escape(&id), reason = %death.reason, "a health probe dead-lettered by the broker: dropped");
        delivery.acker.ack(BasicAckOptions::default()).await?;
        return Ok(());
    }
    let lane = death
        .from
        .as_ref()
        .map(|(_, l)| *l)
        .or_else(|| parsed.as_ref().map(|e| e.lane))
        .unwrap_or(Lane::Normal);
    let group = death.from.as_ref().map(|(g, _)| g.clone());
    let detail = match death.reason.as_str() {
        "delivery_limit" => format!(
            "dead-lettered by the broker: delivered more than {} times (the group queue's x-delivery-limit) without an outcome",
            fleet::broker::topology::DELIVERY_LIMIT
        ),
        other => format!("dead-lettered by the broker ({other})"),
    };

    // A letter whose attempt already ended is a stale copy (also: this loop's own letter, read
    // again after a crash between publish and ack).
    if !id.is_empty() {
        if let Ok(Some(st)) = s.store.task_status(&id).await {
            let state = st.get("state").map(String::as_str).unwrap_or_default();
            // A cancelled task never reaches the dead-letter queue, whatever its run record:
            // its message is kept in `<ns>.cancelled` (for a bulk retry), then acked.
            if state == fleet::status::TaskState::Cancelled.as_str() {
                let headers = [(REASON_HEADER, state.to_string())];
                let what = "keep a cancelled task's broker dead letter in the cancelled queue";
                if !move_letter(s, &delivery, &headers, Names::CANCELLED_KEY, &id, what).await? {
                    return Ok(());
                }
                tracing::info!(task.id = %fleet::task::escape(&id), reason = %death.reason, "the broker dead-lettered a cancelled task: kept in the cancelled queue");
                delivery.acker.ack(BasicAckOptions::default()).await?;
                return Ok(());
            }
            if st.get("run_st").map(String::as_str) == Some("done")
                && fleet::status::TERMINAL.contains(&state)
            {
                tracing::info!(task.id = %fleet::task::escape(&id), state, reason = %death.reason, "the broker dead-lettered a copy of a finished task: dropped");
                metrics::counter!(m::DUPLICATE_DELIVERIES, "lane" => lane.as_str()).increment(1);
                delivery.acker.ack(BasicAckOptions::default()).await?;
                return Ok(());
            }
        }
    }

    let headers = [
        (REASON_HEADER, death.reason.clone()),
        (DETAIL_HEADER, detail.clone()),
    ];
    let what = "move a broker dead letter to the dead-letter queue";
    if !move_letter(s, &delivery, &headers, Names::DEAD_KEY, &id, what).await? {
        return Ok(());
    }
    // The letter is acked only once its status says `dead`: acked before, a Redis outage
    // would leave the task `queued` or `running` for good, with nothing left in any queue to
    // correct it. Until Redis answers the loop holds this letter (the others wait in their
    // queue); a stop meanwhile leaves it unacked, and its next reading moves it again (a
    // second copy in `<ns>.dead`, dropped as a duplicate when replayed).
    if !id.is_empty() {
        let mut backoff = STATUS_RETRY_MIN;
        let (mut tries, mut warned_at) = (0u32, None::<std::time::Instant>);
        while let Err(e) = s
            .store
            .record_broker_dead(
                &id,
                group.as_deref(),
                lane,
                &death.reason,
                &detail,
                s.cfg.common.status_ttl,
            )
            .await
        {
            metrics::counter!(m::REDIS_ERRORS).increment(1);
            tries += 1;
            // Any error is retried, not only a lost connection: an ACL or script error is an
            // operator's to fix, and a letter acked before would leave its status lying. Said
            // again every minute while it lasts (the other letters wait in their queue).
            if warned_at.is_none_or(|t| t.elapsed() >= STATUS_REWARN) {
                tracing::warn!(task.id = %fleet::task::escape(&id), error = %e, tries, "cannot write the status of a broker dead letter; holding it (and the letters behind it) until Redis takes it");
                warned_at = Some(std::time::Instant::now());
            }
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(STATUS_RETRY_MAX);
        }
    }
    tracing::warn!(
        task.id = %fleet::task::escape(&id),
        reason = %death.reason,
        deaths = death.count.unwrap_or(0),
        group = group.as_deref().unwrap_or("-"),
        "task dead-lettered by the broker: moved to the dead-letter queue with its reason"
    );
    metrics::counter!(m::TASKS_COMPLETED, "group" => group.unwrap_or_default(), "lane" => lane.as_str(), "outcome" => "dead").increment(1);
    delivery.acker.ack(BasicAckOptions::default()).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::ShortString;

    fn death_headers(queue: &str, reason: &str) -> FieldTable {
        let mut first = FieldTable::default();
        first.insert("queue".into(), AMQPValue::LongString(queue.into()));
        first.insert("reason".into(), AMQPValue::LongString(reason.into()));
        first.insert("count".into(), AMQPValue::LongLongInt(1));
        let mut h = FieldTable::default();
        h.insert(
            "x-death".into(),
            AMQPValue::FieldArray(vec![AMQPValue::FieldTable(first)].into()),
        );
        h.insert(
            ShortString::from("x-first-death-reason"),
            AMQPValue::LongString(reason.into()),
        );
        h
    }

    #[test]
    fn reads_reason_group_and_lane_of_a_broker_dead_letter() {
        let n = Names::new("ns");
        let h = death_headers(
            "ns.group.pool=a.b,protocol=builtin.critical",
            "delivery_limit",
        );
        let d = broker_death(&n, Some(&h));
        assert_eq!(d.reason, "delivery_limit");
        assert_eq!(
            d.from,
            Some(("pool=a.b,protocol=builtin".to_string(), Lane::Critical))
        );
        assert_eq!(d.count, Some(1));
        // A shard queue of a sharded group's normal lane.
        let d = broker_death(
            &n,
            Some(&death_headers(
                "ns.group.gpu=true.normal.7",
                "delivery_limit",
            )),
        );
        assert_eq!(d.from, Some(("gpu=true".to_string(), Lane::Normal)));
        // Not a group queue of this namespace; no headers at all.
        assert_eq!(
            broker_death(&n, Some(&death_headers("other.group.g.normal", "rejected"))).from,
            None
        );
        assert_eq!(
            broker_death(&n, None),
            BrokerDeath {
                reason: "unknown".into(),
                from: None,
                count: None
            }
        );
    }
}
