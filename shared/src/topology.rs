//! Idempotent declaration of the AMQP topology.
//!
//! ```text
//! producers ──► <ns>.submit (direct, key = lane) ──► <ns>.ingress.<lane>   bounded, reject-publish
//! scheduler ──► <ns>.tasks  (direct) ─┬─► <ns>.group.<group>.<lane>        per-label task queues
//!                                     ├─► <ns>.park.<group>.<lane>         bounded wait for room
//!                                     ├─► <ns>.delayed                     back from a delay tier
//!                                     └─► <ns>.dead                        dead letters
//! anyone    ──► <ns>.delay  (headers fleet-tier) ──► <ns>.delay.<ms> ──(TTL, DLX)──► <ns>.delayed
//! ```
//! Declaring is idempotent, so every process declares what it uses at start-up.

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, ExchangeKind};

use crate::headers;
use crate::config::{CommonConfig, QueueType};
use crate::delay;
use crate::envelope::Lane;
use crate::error::{Error, Result};
use crate::names::Names;

/// Redeliveries after which a quorum group queue dead-letters a message that keeps killing
/// its consumers (a poison message), instead of looping forever.
pub const DELIVERY_LIMIT: i64 = 20;

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions { durable: true, ..Default::default() }
}

fn args(qt: QueueType) -> FieldTable {
    let mut t = FieldTable::default();
    if qt == QueueType::Quorum {
        t.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    }
    t
}

fn bounded(qt: QueueType, max: u32) -> FieldTable {
    let mut t = args(qt);
    t.insert("x-max-length".into(), AMQPValue::LongLongInt(i64::from(max)));
    t.insert("x-overflow".into(), AMQPValue::LongString("reject-publish".into()));
    t
}

async fn exchange(ch: &Channel, name: &str, kind: ExchangeKind) -> Result<()> {
    ch.exchange_declare(
        ShortString::from(name),
        kind,
        ExchangeDeclareOptions { durable: true, ..Default::default() },
        FieldTable::default(),
    )
    .await?;
    Ok(())
}

/// Declares a queue. `bound_setting` names the setting its `x-max-length` comes from, if any.
/// A queue that exists with other arguments (406 PRECONDITION_FAILED) is a permanent error
/// naming the setting, the value asked for, the broker's value and what to do.
async fn queue(ch: &Channel, name: &str, arguments: FieldTable, bound_setting: Option<&str>) -> Result<u32> {
    match ch.queue_declare(ShortString::from(name), durable(), arguments).await {
        Ok(q) => Ok(q.message_count()),
        Err(e) => Err(match crate::amqp::classify(e, "FLEET_QUEUE_TYPE", "") {
            Error::Permanent { message, .. } if message.contains("inequivalent arg") => {
                let setting = if message.contains("'x-max-length'") { bound_setting.unwrap_or("FLEET_NAMESPACE") } else { "FLEET_QUEUE_TYPE" };
                Error::Permanent {
                    setting: setting.to_string(),
                    message: format!(
                        "queue `{name}` already exists with other arguments ({message}; \"received\" is what this process asked for, \"current\" what the broker has). \
                         Set {setting} to the broker's value, or delete the queue (its messages are lost: `rabbitmqctl delete_queue {name}`), or use another FLEET_NAMESPACE"
                    ),
                }
            }
            other => other,
        }),
    }
}

async fn bind(ch: &Channel, queue: &str, exchange: &str, key: &str, arguments: FieldTable) -> Result<()> {
    ch.queue_bind(ShortString::from(queue), ShortString::from(exchange), ShortString::from(key), QueueBindOptions::default(), arguments)
        .await?;
    Ok(())
}

/// Declares the bounded ingress queues (the scheduler's: their bounds are its settings).
pub async fn declare_ingress(ch: &Channel, cfg: &CommonConfig) -> Result<()> {
    let n = cfg.names();
    exchange(ch, &n.submit_exchange(), ExchangeKind::Direct).await?;
    for lane in Lane::ALL {
        let q = n.ingress_queue(lane);
        let setting = match lane {
            Lane::Normal => "FLEET_INGRESS_MAX_NORMAL",
            Lane::Critical => "FLEET_INGRESS_MAX_CRITICAL",
        };
        queue(ch, &q, bounded(cfg.queue_type, cfg.ingress_max(lane)), Some(setting)).await?;
        bind(ch, &q, &n.submit_exchange(), lane.as_str(), FieldTable::default()).await?;
    }
    Ok(())
}

/// Declares what every process uses: exchanges, delayed, dead and the delay tiers (not the
/// ingress queues — see [`declare_ingress`] — nor the per-group queues).
pub async fn declare_core(ch: &Channel, cfg: &CommonConfig) -> Result<()> {
    let n = cfg.names();
    exchange(ch, &n.submit_exchange(), ExchangeKind::Direct).await?;
    exchange(ch, &n.tasks_exchange(), ExchangeKind::Direct).await?;
    exchange(ch, &n.delay_exchange(), ExchangeKind::Headers).await?;
    queue(ch, &n.dead_queue(), args(cfg.queue_type), None).await?;
    bind(ch, &n.dead_queue(), &n.tasks_exchange(), Names::DEAD_KEY, FieldTable::default()).await?;
    queue(ch, &n.delayed_queue(), args(cfg.queue_type), None).await?;
    bind(ch, &n.delayed_queue(), &n.tasks_exchange(), Names::DELAYED_KEY, FieldTable::default()).await?;
    // Delay tiers are classic queues: one TTL per queue expires exactly at the head, and
    // they hold only short-lived copies that are cheap to lose on a node failure compared to
    // the cost of replicating every hop.
    for tier in delay::tiers() {
        let q = n.delay_queue(tier);
        let mut a = FieldTable::default();
        a.insert("x-message-ttl".into(), AMQPValue::LongLongInt(tier as i64));
        a.insert("x-dead-letter-exchange".into(), AMQPValue::LongString(n.tasks_exchange().into()));
        a.insert("x-dead-letter-routing-key".into(), AMQPValue::LongString(Names::DELAYED_KEY.into()));
        queue(ch, &q, a, None).await?;
        let mut h = FieldTable::default();
        h.insert("x-match".into(), AMQPValue::LongString("all".into()));
        h.insert(headers::TIER.into(), AMQPValue::LongString(tier.to_string().into()));
        bind(ch, &q, &n.delay_exchange(), "", h).await?;
    }
    Ok(())
}

/// Declares one group's lane queues (both lanes). Returns nothing: idempotent.
pub async fn declare_group(ch: &Channel, cfg: &CommonConfig, group: &str) -> Result<()> {
    let n = cfg.names();
    for lane in Lane::ALL {
        let q = n.group_queue(group, lane);
        let mut a = args(cfg.queue_type);
        a.insert("x-dead-letter-exchange".into(), AMQPValue::LongString(n.tasks_exchange().into()));
        a.insert("x-dead-letter-routing-key".into(), AMQPValue::LongString(Names::DEAD_KEY.into()));
        if cfg.queue_type == QueueType::Quorum {
            a.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(DELIVERY_LIMIT));
        }
        queue(ch, &q, a, None).await?;
        bind(ch, &q, &n.tasks_exchange(), &n.group_key(group, lane), FieldTable::default()).await?;
    }
    Ok(())
}

/// Declares one group's park queue for a lane.
pub async fn declare_park(ch: &Channel, cfg: &CommonConfig, group: &str, lane: Lane) -> Result<()> {
    let n = cfg.names();
    let q = n.park_queue(group, lane);
    queue(ch, &q, bounded(cfg.queue_type, cfg.park_bound(lane)), Some(park_setting(lane))).await?;
    bind(ch, &q, &n.tasks_exchange(), &n.park_key(group, lane), FieldTable::default()).await
}

/// Depth of a group's park queue, declaring it if needed (idempotent: same arguments), so
/// sampling never trips over a park queue that no task has needed yet.
pub async fn park_depth(ch: &Channel, cfg: &CommonConfig, group: &str, lane: Lane) -> Result<u32> {
    let q = cfg.names().park_queue(group, lane);
    queue(ch, &q, bounded(cfg.queue_type, cfg.park_bound(lane)), Some(park_setting(lane))).await
}

/// The setting a park queue's bound comes from.
fn park_setting(lane: Lane) -> &'static str {
    match lane {
        Lane::Normal => "FLEET_PARK_MAX",
        Lane::Critical => "FLEET_PARK_MAX_CRITICAL",
    }
}

/// Depth of a queue (passive declare), `None` when it does not exist. Uses its own channel
/// because a passive declare of a missing queue closes the channel.
pub async fn depth(conn: &lapin::Connection, queue_name: &str) -> Option<u32> {
    let ch = conn.create_channel().await.ok()?;
    let r = ch
        .queue_declare(ShortString::from(queue_name), QueueDeclareOptions { passive: true, ..Default::default() }, FieldTable::default())
        .await
        .ok()
        .map(|q| q.message_count());
    let _ = ch.close(200, "ok".into()).await;
    r
}

/// Deletes every queue and exchange of a namespace (tests' clean-up). Group and park
/// queues of the named groups are deleted too.
pub async fn delete_all(ch: &Channel, names: &Names, groups: &[String]) -> Result<()> {
    use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
    let mut queues: Vec<String> = Lane::ALL.iter().map(|l| names.ingress_queue(*l)).collect();
    queues.push(names.dead_queue());
    queues.push(names.delayed_queue());
    queues.push(names.schedules_stream());
    queues.extend(delay::tiers().map(|t| names.delay_queue(t)));
    for g in groups {
        for l in Lane::ALL {
            queues.push(names.group_queue(g, l));
            queues.push(names.park_queue(g, l));
        }
    }
    for q in queues {
        let _ = ch.queue_delete(ShortString::from(q.as_str()), QueueDeleteOptions::default()).await;
    }
    for e in [names.submit_exchange(), names.tasks_exchange(), names.delay_exchange()] {
        let _ = ch.exchange_delete(ShortString::from(e.as_str()), ExchangeDeleteOptions::default()).await;
    }
    Ok(())
}
