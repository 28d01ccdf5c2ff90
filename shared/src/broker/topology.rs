//! Idempotent declaration of the AMQP topology.
//!
//! ```text
//! producers ──► <ns>.submit (direct, key = lane) ──► <ns>.ingress.<lane>   bounded, reject-publish
//! scheduler ──► <ns>.tasks  (direct) ─┬─► <ns>.group.<group>.<lane>        per-label task queues
//!                                     │   (…<lane>.<shard> when FLEET_SHARDS > 1: normal lane)
//!                                     ├─► <ns>.park.<group>.<lane>         bounded wait for room
//!                                     ├─► <ns>.delayed                     back from a delay tier
//!                                     ├─► <ns>.dead                        dead letters
//!                                     ├─► <ns>.cancelled                   cancelled tasks'
//!                                     │   messages (bounded, 7 days), for a bulk retry
//!                                     └─► <ns>.dead.broker                 the broker's own dead
//!                                         letters (group queues' DLX), given a reason by the
//!                                         scheduler and moved to <ns>.dead
//! anyone    ──► <ns>.hold   (headers fleet-tier) ──► <ns>.hold.<ms>  ──(held by the scheduler's
//!                                                    tier loops until each hop ends)──► <ns>.delayed
//! ```
//! Declaring is idempotent, so every process declares what it uses at start-up.

use std::time::Duration;

use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{Channel, ExchangeKind};

use crate::broker::delay;
use crate::error::{Error, Result};
use crate::names::Names;
use crate::task::headers;
use crate::task::{Lane, PerLane};

/// Queue type of the task queues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueType {
    /// Replicated (Raft) queues: the default, for clusters.
    Quorum,
    /// Classic durable queues: fine on one node, cheaper to create and delete.
    Classic,
}

/// What declaring the topology reads of the settings. The settings live in a wing above this
/// one ([`crate::settings::CommonConfig`] implements this trait), so the broker wing names what
/// it needs instead of importing them.
pub trait QueueSettings {
    /// The names of the namespace.
    fn names(&self) -> Names;
    /// The namespace (`FLEET_NAMESPACE`).
    fn namespace(&self) -> &str;
    /// Type of the task queues (`FLEET_QUEUE_TYPE`).
    fn queue_type(&self) -> QueueType;
    /// `x-queue-leader-locator` of new quorum queues, or `None`.
    fn leader_locator(&self) -> Option<&str>;
    /// Bound of each lane's ingress queue (messages).
    fn ingress_max(&self) -> PerLane<u32>;
    /// Bound of each park queue (messages), per lane.
    fn park_max(&self) -> PerLane<u32>;
    /// Shard queues of a group's lane (1: unsharded).
    fn shards(&self, lane: Lane) -> u32;
}

/// Redeliveries after which a quorum group queue dead-letters a message that keeps killing
/// its consumers (a poison message), instead of looping forever.
pub const DELIVERY_LIMIT: i64 = 20;

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..Default::default()
    }
}

/// Namespaces whose quorum queues were created before fleet set `x-queue-leader-locator`
/// (found by [`probe_leader_locator`]): their queues are declared without it, since RabbitMQ
/// refuses a redeclare whose arguments differ (406 `inequivalent arg`).
static LOCATOR_PREDATES: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

fn locator_predates(ns: &str) -> bool {
    LOCATOR_PREDATES
        .lock()
        .map(|v| v.iter().any(|n| n == ns))
        .unwrap_or(false)
}

/// Finds out, once per connection and before anything else is declared, whether this
/// namespace's queues predate the leader locator: declares `<ns>.dead` (a queue every version
/// has, with the arguments [`declare_core`] gives it) on a channel of its own; a 406 naming
/// `x-queue-leader-locator` means an older fleet created it, and then no queue of the namespace
/// gets the argument in this process (new leaders are still placed by the broker's default;
/// an operator may set `queue_leader_locator = balanced` in rabbitmq.conf). Any other failure
/// is left to [`declare_core`] to report.
///
/// # Errors
/// Opening the channel failed (connection lost).
pub async fn probe_leader_locator(
    conn: &lapin::Connection,
    cfg: &impl QueueSettings,
) -> Result<()> {
    if cfg.queue_type() != QueueType::Quorum
        || cfg.leader_locator().is_none()
        || locator_predates(cfg.namespace())
    {
        return Ok(());
    }
    let ch = conn.create_channel().await?;
    match ch
        .queue_declare(
            ShortString::from(cfg.names().dead_queue()),
            durable(),
            args(cfg),
        )
        .await
    {
        Ok(_) => {
            let _ = ch.close(200, "ok".into()).await;
        }
        Err(e) if crate::broker::amqp::inequivalent_arg(&e) == Some("x-queue-leader-locator") => {
            tracing::info!(namespace = %cfg.namespace(), "this namespace's quorum queues predate x-queue-leader-locator; declaring them without it");
            if let Ok(mut v) = LOCATOR_PREDATES.lock() {
                v.push(cfg.namespace().to_string());
            }
        }
        Err(_) => {}
    }
    Ok(())
}

/// Arguments every task queue of type `qt` gets: for quorum queues the type and, unless
/// `FLEET_QUEUE_LEADER_LOCATOR` is `none`, `x-queue-leader-locator` (RabbitMQ ≥ 3.10:
/// `balanced` places each new queue's Raft leader on the node with the fewest leaders, so one
/// node does not do every queue's leader work; `client-local` on the node this process is
/// connected to).
fn args(cfg: &impl QueueSettings) -> FieldTable {
    let mut t = FieldTable::default();
    if cfg.queue_type() == QueueType::Quorum {
        t.insert(
            "x-queue-type".into(),
            AMQPValue::LongString("quorum".into()),
        );
        if let Some(l) = cfg
            .leader_locator()
            .filter(|_| !locator_predates(cfg.namespace()))
        {
            t.insert(
                "x-queue-leader-locator".into(),
                AMQPValue::LongString(l.into()),
            );
        }
    }
    t
}

/// Most messages `<ns>.cancelled` holds ([`Names::cancelled_queue`]); past it the oldest is
/// dropped (`x-overflow: drop-head`: a cancel is never refused for want of room — the newest
/// cancels are the ones an operator is likeliest to take back). About 1 KiB a message: ~100 MB
/// at the bound.
pub const CANCELLED_MAX: i64 = 100_000;
/// How long `<ns>.cancelled` keeps a message (`x-message-ttl`): the control stream's retention
/// ([`CONTROL_MAX_AGE`], 7 days), not the status TTL. A retry selects cancelled tasks by their
/// status record, so a message that outlives its record (24 h by default) can no longer be
/// selected and only waits to age out; but the status TTL is each process's own setting
/// (`FLEET_STATUS_TTL_MS`), and a queue argument taken from it would make any two processes
/// configured differently refuse each other's declare (406 `inequivalent arg`). A constant
/// never does, and 7 days outlives any status TTL in use while bounding what is kept to what
/// the cancel itself is remembered for.
pub const CANCELLED_TTL: Duration = CONTROL_MAX_AGE;

/// The arguments of `<ns>.cancelled`: the namespace's queue type, [`CANCELLED_MAX`] with
/// `drop-head`, [`CANCELLED_TTL`].
fn cancelled_args(cfg: &impl QueueSettings) -> FieldTable {
    let mut t = args(cfg);
    t.insert("x-max-length".into(), AMQPValue::LongLongInt(CANCELLED_MAX));
    t.insert(
        "x-overflow".into(),
        AMQPValue::LongString("drop-head".into()),
    );
    t.insert(
        "x-message-ttl".into(),
        AMQPValue::LongLongInt(i64::try_from(CANCELLED_TTL.as_millis()).unwrap_or(i64::MAX)),
    );
    t
}

fn bounded(cfg: &impl QueueSettings, max: u32) -> FieldTable {
    let mut t = args(cfg);
    t.insert(
        "x-max-length".into(),
        AMQPValue::LongLongInt(i64::from(max)),
    );
    t.insert(
        "x-overflow".into(),
        AMQPValue::LongString("reject-publish".into()),
    );
    t
}

async fn exchange(ch: &Channel, name: &str, kind: ExchangeKind) -> Result<()> {
    ch.exchange_declare(
        ShortString::from(name),
        kind,
        ExchangeDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await?;
    Ok(())
}

/// Declares a queue. `bound_setting` names the setting its `x-max-length` comes from, if any.
/// A queue that exists with other arguments (406 PRECONDITION_FAILED) is a permanent error
/// naming the setting, the value asked for, the broker's value and what to do.
async fn queue(
    ch: &Channel,
    name: &str,
    arguments: FieldTable,
    bound_setting: Option<&str>,
) -> Result<u32> {
    match ch
        .queue_declare(ShortString::from(name), durable(), arguments)
        .await
    {
        Ok(q) => Ok(q.message_count()),
        Err(e) => {
            let arg = crate::broker::amqp::inequivalent_arg(&e).map(str::to_owned);
            Err(match (crate::broker::amqp::classify(e, "FLEET_QUEUE_TYPE", ""), arg.as_deref()) {
            (Error::Permanent { message, .. }, Some("x-dead-letter-routing-key")) => Error::Permanent {
                setting: "FLEET_NAMESPACE".to_string(),
                message: format!(
                    "queue `{name}` was declared by an older fleet ({message}): group queues now send the broker's own dead letters to `<ns>.dead.broker`. \
                     Let the queue drain, then delete it (`rabbitmqctl delete_queue {name}`; add `--if-empty` for a classic queue — quorum queues refuse it) so it is declared again, or use another FLEET_NAMESPACE"
                ),
            },
            (Error::Permanent { message, .. }, Some(arg)) => {
                let setting = match arg {
                    "x-max-length" => bound_setting.unwrap_or("FLEET_NAMESPACE"),
                    // A quorum queue created before fleet spread queue leaders.
                    "x-queue-leader-locator" => "FLEET_QUEUE_LEADER_LOCATOR",
                    _ => "FLEET_QUEUE_TYPE",
                };
                Error::Permanent {
                    setting: setting.to_string(),
                    message: format!(
                        "queue `{name}` already exists with other arguments ({message}; \"received\" is what this process asked for, \"current\" what the broker has). \
                         Set {setting} to the broker's value, or delete the queue (its messages are lost: `rabbitmqctl delete_queue {name}`), or use another FLEET_NAMESPACE"
                    ),
                }
            }
            (other, _) => other,
        })
        }
    }
}

async fn bind(
    ch: &Channel,
    queue: &str,
    exchange: &str,
    key: &str,
    arguments: FieldTable,
) -> Result<()> {
    ch.queue_bind(
        ShortString::from(queue),
        ShortString::from(exchange),
        ShortString::from(key),
        QueueBindOptions::default(),
        arguments,
    )
    .await?;
    Ok(())
}

/// Declares the bounded ingress queues (the scheduler's: their bounds are its settings).
pub async fn declare_ingress(ch: &Channel, cfg: &impl QueueSettings) -> Result<()> {
    let n = cfg.names();
    exchange(ch, &n.submit_exchange(), ExchangeKind::Direct).await?;
    for lane in Lane::ALL {
        let q = n.ingress_queue(lane);
        queue(
            ch,
            &q,
            bounded(cfg, cfg.ingress_max()[lane]),
            Some(INGRESS_MAX_SETTING[lane]),
        )
        .await?;
        bind(
            ch,
            &q,
            &n.submit_exchange(),
            lane.as_str(),
            FieldTable::default(),
        )
        .await?;
    }
    Ok(())
}

/// Declares what every process uses: exchanges, delayed, dead and the delay tiers (not the
/// ingress queues — see [`declare_ingress`] — nor the per-group queues).
pub async fn declare_core(ch: &Channel, cfg: &impl QueueSettings) -> Result<()> {
    let n = cfg.names();
    exchange(ch, &n.submit_exchange(), ExchangeKind::Direct).await?;
    exchange(ch, &n.tasks_exchange(), ExchangeKind::Direct).await?;
    exchange(ch, &n.delay_exchange(), ExchangeKind::Headers).await?;
    queue(ch, &n.dead_queue(), args(cfg), None).await?;
    bind(
        ch,
        &n.dead_queue(),
        &n.tasks_exchange(),
        Names::DEAD_KEY,
        FieldTable::default(),
    )
    .await?;
    // Cancelled tasks' messages, kept for a bulk retry (never in `<ns>.dead`): bounded and
    // aged, since nobody need ever read them.
    queue(ch, &n.cancelled_queue(), cancelled_args(cfg), None).await?;
    bind(
        ch,
        &n.cancelled_queue(),
        &n.tasks_exchange(),
        Names::CANCELLED_KEY,
        FieldTable::default(),
    )
    .await?;
    // Declared by every process before any group queue: a dead letter routed to no queue
    // would be dropped by the broker.
    queue(ch, &n.broker_dead_queue(), args(cfg), None).await?;
    bind(
        ch,
        &n.broker_dead_queue(),
        &n.tasks_exchange(),
        Names::BROKER_DEAD_KEY,
        FieldTable::default(),
    )
    .await?;
    // Operator actions that must outlive Redis (cancels): every process reads it.
    declare_control_stream(ch, &n).await?;
    queue(ch, &n.delayed_queue(), args(cfg), None).await?;
    bind(
        ch,
        &n.delayed_queue(),
        &n.tasks_exchange(),
        Names::DELAYED_KEY,
        FieldTable::default(),
    )
    .await?;
    // Delay tiers are of FLEET_QUEUE_TYPE: with quorum queues (the default) they are
    // replicated like every other queue holding a task, so a task waiting for its retry or
    // its `not_before` survives the loss of a node. No TTL and no dead-lettering: the
    // scheduler's tier loops hold each message until its hop ends and forward it themselves
    // (see `crate::broker::delay` for why).
    for tier in delay::tiers() {
        let q = n.delay_queue(tier);
        queue(ch, &q, args(cfg), None).await?;
        let mut h = FieldTable::default();
        h.insert("x-match".into(), AMQPValue::LongString("all".into()));
        h.insert(
            headers::TIER.into(),
            AMQPValue::LongString(tier.to_string().into()),
        );
        bind(ch, &q, &n.delay_exchange(), "", h).await?;
    }
    Ok(())
}

/// Declares one group's lane queues (both lanes; every shard of a sharded lane, see
/// [`crate::broker`]). Returns nothing: idempotent. Their names are first recorded in the
/// namespace's catalog ([`record_group`]), so the clean-up finds them whatever Redis holds.
///
/// What the broker dead-letters from them itself (a quorum queue past [`DELIVERY_LIMIT`])
/// goes to `<ns>.dead.broker`, not straight to `<ns>.dead`: the scheduler's backstop gives it
/// `x-fleet-reason` and a true status first (scheduler/src/backstop.rs). Fleet's own dead
/// letters are published to `<ns>.dead` directly.
pub async fn declare_group(ch: &Channel, cfg: &impl QueueSettings, group: &str) -> Result<()> {
    let n = cfg.names();
    let queues: Vec<String> = Lane::ALL
        .iter()
        .flat_map(|&lane| {
            let shards = cfg.shards(lane);
            (0..shards).map(move |shard| (lane, shard, shards))
        })
        .map(|(lane, shard, shards)| n.group_shard_queue(group, lane, shard, shards))
        .collect();
    record_group(ch, cfg, group, &queues).await?;
    for lane in Lane::ALL {
        let shards = cfg.shards(lane);
        for shard in 0..shards {
            let q = n.group_shard_queue(group, lane, shard, shards);
            let mut a = args(cfg);
            a.insert(
                "x-dead-letter-exchange".into(),
                AMQPValue::LongString(n.tasks_exchange().into()),
            );
            a.insert(
                "x-dead-letter-routing-key".into(),
                AMQPValue::LongString(Names::BROKER_DEAD_KEY.into()),
            );
            if cfg.queue_type() == QueueType::Quorum {
                a.insert(
                    "x-delivery-limit".into(),
                    AMQPValue::LongLongInt(DELIVERY_LIMIT),
                );
            }
            queue(ch, &q, a, None).await?;
            bind(
                ch,
                &q,
                &n.tasks_exchange(),
                &n.group_shard_key(group, lane, shard, shards),
                FieldTable::default(),
            )
            .await?;
        }
    }
    Ok(())
}

/// Declares one group's park queue for a lane, recorded first in the catalog like
/// [`declare_group`]'s queues.
pub async fn declare_park(
    ch: &Channel,
    cfg: &impl QueueSettings,
    group: &str,
    lane: Lane,
) -> Result<()> {
    let n = cfg.names();
    let q = n.park_queue(group, lane);
    record_group(ch, cfg, group, std::slice::from_ref(&q)).await?;
    queue(
        ch,
        &q,
        bounded(cfg, cfg.park_max()[lane]),
        Some(PARK_MAX_SETTING[lane]),
    )
    .await?;
    bind(
        ch,
        &q,
        &n.tasks_exchange(),
        &n.park_key(group, lane),
        FieldTable::default(),
    )
    .await
}

/// The settings the bounds come from ([`QueueSettings::ingress_max`], [`QueueSettings::park_max`]).
const INGRESS_MAX_SETTING: PerLane<&str> = PerLane {
    normal: "FLEET_INGRESS_MAX_NORMAL",
    critical: "FLEET_INGRESS_MAX_CRITICAL",
};
const PARK_MAX_SETTING: PerLane<&str> = PerLane {
    normal: "FLEET_PARK_MAX",
    critical: "FLEET_PARK_MAX_CRITICAL",
};

// A queue's depth is asked of a `crate::broker::probe::Prober`, never by a passive declare on a
// long-lived connection: a 404 there costs that connection a channel id for good (lapin 4.12).

/// One record of the namespace's queue catalog ([`Names::catalog_queue`]): a group and the
/// exact names of the queues a process was about to declare for it. JSON on the wire:
/// `{"group": "protocol=builtin", "queues": ["ns.group.protocol=builtin.normal", …]}`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CatalogRecord {
    /// The group name.
    pub group: String,
    /// The queue names declared for it (lane, shard and park queues).
    pub queues: Vec<String>,
}

/// What the catalog holds: every group and queue name ever recorded (deduplicated), the
/// number of records read, and how many could not be read (not a [`CatalogRecord`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Catalog {
    /// Every group named by a record.
    pub groups: std::collections::BTreeSet<String>,
    /// Every queue named by a record.
    pub queues: std::collections::BTreeSet<String>,
    /// Records read.
    pub records: usize,
    /// Messages that were not a [`CatalogRecord`].
    pub unreadable: usize,
}

/// Records that `group`'s `queues` are about to be declared, in the namespace's catalog
/// queue ([`Names::catalog_queue`], durable, of FLEET_QUEUE_TYPE), with a publisher confirm
/// (`ch` is put in confirm mode). Called by [`declare_group`] and [`declare_park`] before
/// their declares, so no group queue exists that the catalog does not name — whether or not
/// Redis was reachable when it was declared, or survived since.
///
/// # Why a catalog in the broker
/// AMQP 0-9-1 cannot list queues; the management HTTP API can, but its plugin is optional
/// (not enabled by `ops/services.sh`, nor on many installs) and needs other credentials.
/// Redis knows the groups only while its registry lives (a Redis loss, or a worker that
/// declared its queues while Redis was unreachable, leaves it silent). The broker itself is
/// the one store that holds the queues, so it holds their record: one message of about
/// 100 bytes per declaration (a worker connecting, a scheduler parking for a group or
/// checking a reclaim), read — without removing it — by `fleetctl delete-namespace`
/// ([`read_catalog`]) and deleted with the namespace. It is not compacted: a namespace whose
/// workers reconnect 10,000 times holds about 1 MB of records.
///
/// # Errors
/// The broker refused the declare or the publish ([`Error::Refused`] for a nack).
pub async fn record_group(
    ch: &Channel,
    cfg: &impl QueueSettings,
    group: &str,
    queues: &[String],
) -> Result<()> {
    use lapin::options::ConfirmSelectOptions;
    let q = cfg.names().catalog_queue();
    queue(ch, &q, args(cfg), None).await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    let body = serde_json::to_vec(&CatalogRecord {
        group: group.to_string(),
        queues: queues.to_vec(),
    })?;
    let props = lapin::BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2);
    crate::broker::amqp::publish_confirmed(
        &crate::broker::amqp::Publisher::new(ch.clone()),
        "",
        &q,
        &body,
        props,
    )
    .await
}

/// Reads the namespace's queue catalog without removing anything (the records taken are
/// handed back when the reading channel closes). An absent catalog (a namespace of an older
/// fleet, or already deleted) reads as empty.
///
/// # Errors
/// The channel cannot be opened, or a read fails (connection lost).
pub async fn read_catalog(conn: &lapin::Connection, names: &Names) -> Result<Catalog> {
    use lapin::options::BasicGetOptions;
    let ch = conn.create_channel().await?;
    let q = names.catalog_queue();
    let result = async {
        let mut cat = Catalog::default();
        match ch
            .queue_declare(
                ShortString::from(q.as_str()),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
        {
            Ok(_) => {}
            Err(e) if crate::broker::amqp::reply_code(&e) == Some(404) => return Ok(cat),
            Err(e) => return Err(e.into()),
        }
        while let Some(m) = ch
            .basic_get(ShortString::from(q.as_str()), BasicGetOptions::default())
            .await?
        {
            cat.records += 1;
            match serde_json::from_slice::<CatalogRecord>(&m.delivery.data) {
                Ok(r) => {
                    cat.groups.insert(r.group);
                    cat.queues.extend(r.queues);
                }
                Err(_) => cat.unreadable += 1,
            }
        }
        Ok(cat)
    }
    .await;
    if ch.status().connected() {
        let _ = ch.close(200, ShortString::from("catalog read")).await;
    }
    result
}

/// What [`delete_namespace`] deleted: the groups found (catalog and Redis together, without
/// the waiting-for-worker pseudo-group [`Names::UNMATCHED_GROUP`]) and what the catalog held.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Deleted {
    /// The groups whose queues were deleted.
    pub groups: std::collections::BTreeSet<String>,
    /// Groups only the catalog named (Redis had forgotten them).
    pub catalog_only: usize,
    /// What the catalog held.
    pub catalog: Catalog,
}

/// Deletes every queue and exchange of a namespace: the groups and queue names of the catalog
/// ([`read_catalog`]) together with `redis_groups` (what the registry still names, for queues
/// declared before the catalog existed) and their `shards` shard queues (the queues
/// [`delete_all_sharded`] deletes), over four channels at once, then the
/// catalog itself and the exchanges.
///
/// # Errors
/// The catalog cannot be read, or the deleting channel cannot be opened.
pub async fn delete_namespace(
    conn: &lapin::Connection,
    names: &Names,
    redis_groups: &[String],
    shards: u32,
) -> Result<Deleted> {
    let catalog = read_catalog(conn, names).await?;
    let mut groups: std::collections::BTreeSet<String> = redis_groups.iter().cloned().collect();
    // The waiting-for-worker park queues are recorded under their pseudo-group, which is no
    // group (delete_all_sharded deletes its queues in any case).
    let recorded: std::collections::BTreeSet<String> = catalog
        .groups
        .iter()
        .filter(|g| g.as_str() != Names::UNMATCHED_GROUP)
        .cloned()
        .collect();
    let catalog_only = recorded.difference(&groups).count();
    groups.extend(recorded);
    let list: Vec<String> = groups.iter().cloned().collect();
    // The catalog's own names first (queues Redis and the name rules may not know), then every
    // queue the names give, the catalog queue last: while any queue it names may still exist,
    // the catalog stays.
    let mut queues: Vec<String> = catalog
        .queues
        .iter()
        .filter(|q| **q != names.catalog_queue())
        .cloned()
        .collect();
    let mut known = namespace_queues(names, &list, shards);
    let catalog_queue = known.pop();
    queues.retain(|q| !known.contains(q));
    queues.extend(known);
    delete_queues_parallel(conn, queues).await?;
    let ch = conn.create_channel().await?;
    if let Some(q) = catalog_queue {
        delete_queues(&ch, [q.as_str()]).await;
    }
    delete_exchanges(&ch, names).await;
    let _ = ch.close(200, ShortString::from("deleted")).await;
    Ok(Deleted {
        groups,
        catalog_only,
        catalog,
    })
}

/// How many channels [`delete_namespace`] deletes queues over at once. A broker handles one
/// channel's `queue.delete` calls one after another, and a quorum queue's takes about 0.7 s
/// here (its Raft cluster is stopped and its log removed): a namespace's ~33 queues took 24 s
/// on one channel. Four at a time is modest (many quorum queues deleted at once can stall a
/// small node).
const DELETE_CHANNELS: usize = 4;

/// Deletes `queues` over [`DELETE_CHANNELS`] channels at once (best effort, as
/// [`delete_queues`]).
///
/// # Errors
/// A channel could not be opened.
async fn delete_queues_parallel(conn: &lapin::Connection, queues: Vec<String>) -> Result<()> {
    let mut chunks: Vec<Vec<String>> = vec![Vec::new(); DELETE_CHANNELS];
    for (i, q) in queues.into_iter().enumerate() {
        chunks[i % DELETE_CHANNELS].push(q);
    }
    let mut channels = Vec::with_capacity(DELETE_CHANNELS);
    for _ in 0..DELETE_CHANNELS {
        channels.push(conn.create_channel().await?);
    }
    futures::future::join_all(
        channels
            .iter()
            .zip(chunks.iter())
            .map(|(ch, qs)| async move {
                delete_queues(ch, qs.iter().map(String::as_str)).await;
                let _ = ch.close(200, ShortString::from("deleted")).await;
            }),
    )
    .await;
    Ok(())
}

/// Deletes queues (best effort: a missing queue is no error, other errors are ignored).
async fn delete_queues<'a>(ch: &Channel, queues: impl IntoIterator<Item = &'a str>) {
    use lapin::options::QueueDeleteOptions;
    for q in queues {
        let _ = ch
            .queue_delete(ShortString::from(q), QueueDeleteOptions::default())
            .await;
    }
}

/// Deletes every queue and exchange of an unsharded namespace: [`delete_all_sharded`] with
/// `shards` = 1.
pub async fn delete_all(ch: &Channel, names: &Names, groups: &[String]) -> Result<()> {
    delete_all_sharded(ch, names, groups, 1).await
}

/// Deletes every queue (with its messages) and exchange of a namespace whose groups have
/// `shards` normal-lane shard queues (`FLEET_SHARDS`): ingress, dead, broker dead, cancelled, delayed,
/// schedules and control streams, queue catalog, delay tiers (current and legacy), the lane queues (unsharded and every
/// shard) and park queues of `groups`, and the park queues of the waiting-for-worker
/// pseudo-group [`Names::UNMATCHED_GROUP`]. Deleting a queue or exchange that does not exist
/// is no error (RabbitMQ answers delete-ok), so a `shards` above the real count is harmless;
/// one below it leaves the higher shards behind. Errors of single deletes are ignored (best
/// effort); returns `Ok` always.
pub async fn delete_all_sharded(
    ch: &Channel,
    names: &Names,
    groups: &[String],
    shards: u32,
) -> Result<()> {
    let queues = namespace_queues(names, groups, shards);
    delete_queues(ch, queues.iter().map(String::as_str)).await;
    delete_exchanges(ch, names).await;
    Ok(())
}

/// Every queue of a namespace whose `groups` have `shards` normal-lane shard queues, by the
/// name rules ([`delete_all_sharded`] lists them), the queue catalog last.
fn namespace_queues(names: &Names, groups: &[String], shards: u32) -> Vec<String> {
    let mut queues: Vec<String> = Lane::ALL.iter().map(|l| names.ingress_queue(*l)).collect();
    queues.push(names.dead_queue());
    queues.push(names.broker_dead_queue());
    queues.push(names.cancelled_queue());
    queues.push(names.delayed_queue());
    queues.push(names.schedules_stream());
    queues.push(names.control_stream());
    queues.extend(delay::tiers().map(|t| names.delay_queue(t)));
    queues.extend(delay::ttl_tiers().map(|t| names.ttl_delay_queue(t)));
    queues.extend(delay::ttl_tiers().map(|t| names.legacy_delay_queue(t)));
    for g in groups {
        for l in Lane::ALL {
            queues.push(names.group_queue(g, l));
            queues.push(names.park_queue(g, l));
        }
        if shards > 1 {
            queues.extend(names.group_shard_queues(g, Lane::Normal, shards));
        }
    }
    queues.extend(
        Lane::ALL
            .iter()
            .map(|l| names.park_queue(Names::UNMATCHED_GROUP, *l)),
    );
    queues.push(names.catalog_queue());
    queues
}

/// Deletes the namespace's exchanges (best effort).
async fn delete_exchanges(ch: &Channel, names: &Names) {
    use lapin::options::ExchangeDeleteOptions;
    for e in [
        names.submit_exchange(),
        names.tasks_exchange(),
        names.delay_exchange(),
        names.ttl_delay_exchange(),
        names.legacy_delay_exchange(),
    ] {
        let _ = ch
            .exchange_delete(
                ShortString::from(e.as_str()),
                ExchangeDeleteOptions::default(),
            )
            .await;
    }
}

/// How long the control stream (`<ns>.control`, [`crate::control`]) keeps a record (its
/// `x-max-age`), and so how long a cancel holds beyond Redis: a task message older than this
/// that was cancelled and lost its mark with Redis could run. Seven days: longer than any
/// delay or retry backoff fleet allows.
pub const CONTROL_MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);
/// The control stream's `x-max-age` argument for [`CONTROL_MAX_AGE`].
const CONTROL_MAX_AGE_ARG: &str = "7D";

/// Declares the control stream (idempotent; every process does, with the namespace's other
/// queues in [`declare_core`]).
pub async fn declare_control_stream(ch: &Channel, names: &Names) -> Result<()> {
    declare_stream(ch, &names.control_stream(), Some(CONTROL_MAX_AGE_ARG)).await
}

/// Declares a durable RabbitMQ stream `name` (idempotent), keeping records for `max_age`
/// (the `x-max-age` argument, e.g. `"7D"`; `None`: kept until deleted) — the control stream
/// and the schedules stream.
///
/// # Errors
/// The broker refused the declare (a queue of that name with other arguments) or the channel
/// failed.
pub async fn declare_stream(ch: &Channel, name: &str, max_age: Option<&str>) -> Result<()> {
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("stream".into()),
    );
    if let Some(age) = max_age {
        args.insert("x-max-age".into(), AMQPValue::LongString(age.into()));
    }
    ch.queue_declare(
        ShortString::from(name),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await?;
    Ok(())
}
