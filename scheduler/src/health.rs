//! The health checker: evicts silent workers and rescues orphaned groups' tasks.
//!
//! * **Eviction** (every `health_interval`): workers whose last heartbeat is older than
//!   `heartbeat_timeout` are removed by one idempotent script — capacity out of their group,
//!   running records released — so any number of scheduler replicas may run it. Their
//!   unacked tasks come back from the broker when their connection dies.
//! * **Orphans**: a group with no active worker keeps its queued tasks. This loop moves them to
//!   another group whose labels satisfy them when one has room (counted as rerouted); otherwise
//!   they stay in the group queue and wait until a worker returns. Nothing is dropped.
//!
//!   Looking at a task means taking it from its queue. One that cannot move is published again
//!   to the back of its own queue (then the taken copy is acked) rather than returned with a
//!   nack: a nack counts as a redelivery, and a quorum group queue dead-letters a message past
//!   its delivery limit ([`fleet::topology::DELIVERY_LIMIT`]), so a task waiting for its group
//!   would die after that many ticks; a nack also puts it back at the head, where it would hide
//!   every task behind it from the next tick. And when no group at all has capacity in the
//!   lane, the orphaned queues are not touched.

use std::sync::Arc;
use std::time::Instant;

use fleet::dedupe::Dedupe;
use fleet::registry::GroupView;
use fleet::route::Reservation;
use fleet::route::ReserveRequest;
use fleet::ticker::Ticker;
use fleet::{amqp, metrics as m, Envelope, Lane};
use lapin::options::{BasicAckOptions, BasicGetOptions, BasicNackOptions};
use tokio_util::sync::CancellationToken;

use crate::dispatch::Dispatcher;
use crate::session::Session;
use crate::view::{FleetView, ViewRx};

/// Most tasks moved from one orphaned group queue per tick.
const ORPHAN_BATCH: usize = 500;

/// The health checker's loop: eviction, then orphan rescue, every `health_interval`.
/// Eviction is a script on the present state; orphan rescue reads the groups and queue depths
/// of the [fleet view](crate::view) — one sampled after the eviction, so an evicted worker's
/// group is already seen without it — and moves tasks through the dispatcher (a reservation
/// per task).
pub struct HealthCheck {
    pub session: Arc<Session>,
    pub dispatcher: Arc<Dispatcher>,
    pub view: ViewRx,
}

impl HealthCheck {
    pub async fn run(mut self, shutdown: CancellationToken) -> fleet::Result<()> {
        let mut ticker = Ticker::new(self.session.cfg.health_interval);
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = ticker.next() => self.tick(&shutdown).await?,
            }
        }
        Ok(())
    }

    /// One tick. `Err` only when the view loop is gone (the session is ending).
    async fn tick(&mut self, shutdown: &CancellationToken) -> fleet::Result<()> {
        let (s, cfg) = (&self.session, &self.session.cfg);
        // Eviction is one script on the present state (not the fleet view): idempotent, and
        // safe for any number of replicas.
        match s.store.evict_stale(cfg.heartbeat_timeout).await {
            Ok(ids) => {
                for id in &ids {
                    tracing::warn!(worker = %id, timeout_ms = cfg.heartbeat_timeout.as_millis() as u64, "worker evicted: no heartbeat");
                }
                metrics::counter!(m::WORKER_EVICTIONS).increment(ids.len() as u64);
            }
            Err(e) => {
                metrics::counter!(m::REDIS_ERRORS).increment(1);
                tracing::warn!(error = %e, "eviction check failed");
            }
        }
        // A view sampled after the eviction (none while Redis is unreadable: no rescue then).
        let Some(view) = self.view.since(Some(Instant::now()), shutdown).await? else {
            return Ok(());
        };
        if let Err(e) = rescue_orphans(&self.dispatcher, &view).await {
            tracing::warn!(error = %e, "orphan rescue failed");
        }
        Ok(())
    }
}

/// Moves tasks out of group queues whose group has no active capacity (in `view`), where
/// another group can take them. Returns how many were moved.
pub async fn rescue_orphans(d: &Dispatcher, view: &FleetView) -> fleet::Result<usize> {
    let s = &d.session;
    let groups = &view.groups;
    let mut moved = 0;
    for lane in Lane::ALL {
        let cap = |g: &GroupView| g.capacities()[lane];
        // Nowhere to go: leave the orphans untouched.
        if !groups.iter().any(|g| cap(g) > 0) {
            continue;
        }
        let shards = s.cfg.common.shards(lane);
        for g in groups.iter().filter(|g| cap(g) == 0) {
            for shard in 0..shards {
                let queue = s.names.group_shard_queue(&g.group, lane, shard, shards);
                // Empty (or missing) when the view was sampled: the next tick looks again.
                if view.depth(&queue).unwrap_or(0) == 0 {
                    continue;
                }
                let own_key = s.names.group_shard_key(&g.group, lane, shard, shards);
                moved += move_queue(d, &g.group, &queue, &own_key, lane).await?;
            }
        }
    }
    Ok(moved)
}

/// Takes tasks from an orphaned queue and reroutes them, until one cannot move (it goes to the
/// back of the queue; the next tick starts with the task behind it) or a batch is done.
/// `own_key` routes back to `queue` itself.
async fn move_queue(
    d: &Dispatcher,
    group: &str,
    queue: &str,
    own_key: &str,
    lane: Lane,
) -> fleet::Result<usize> {
    let ch = d.session.conn.create_channel().await?;
    let mut moved = 0;
    for _ in 0..ORPHAN_BATCH {
        let Some(msg) = ch
            .basic_get(queue.into(), BasicGetOptions::default())
            .await?
        else {
            break;
        };
        let delivery = msg.delivery;
        let env = match Envelope::from_slice(&delivery.data, usize::MAX) {
            Ok(e) => e,
            Err(_) => {
                // Not ours to judge here: leave it for a worker (which dead-letters it).
                delivery
                    .acker
                    .nack(BasicNackOptions {
                        requeue: true,
                        ..Default::default()
                    })
                    .await?;
                break;
            }
        };
        let req = ReserveRequest {
            id: env.id.clone(),
            lane,
            selector: env.selector(),
            kind: env.kind.clone(),
            strategy: env.strategy,
            dedupe: Dedupe::Skip,
            from_park: true,
            dedupe_only: false,
        };
        let answer = d
            .session
            .store
            .reserve(std::slice::from_ref(&req), d.params())
            .await;
        let to = match &answer {
            Ok(a) => match a.first() {
                Some(Reservation::Reserved(to)) => Some(to.clone()),
                _ => None,
            },
            Err(_) => None,
        };
        // Where it goes: another group, or (no room anywhere, no match, its own group came
        // back, Redis unreachable) the back of its own queue.
        let key = match &to {
            Some(to) if to != group => d.group_key(to, lane),
            _ => own_key.to_string(),
        };
        // Properties as they came (message id, headers: a health probe stays one).
        let r = amqp::publish_confirmed(
            &d.session.publisher,
            &d.session.names.tasks_exchange(),
            &key,
            &delivery.data,
            delivery.properties.clone(),
        )
        .await;
        if let Err(e) = r {
            if let Some(to) = &to {
                let _ = d
                    .session
                    .store
                    .unreserve(&[(to.clone(), lane, env.id.clone())])
                    .await;
            }
            delivery
                .acker
                .nack(BasicNackOptions {
                    requeue: true,
                    ..Default::default()
                })
                .await?;
            return Err(e);
        }
        delivery.acker.ack(BasicAckOptions::default()).await?;
        answer?;
        match to {
            Some(to) if to != group => {
                metrics::counter!(m::TASKS_REROUTED).increment(1);
                tracing::info!(task.id = %env.id, from = %group, to = %to, "orphaned task rerouted");
                moved += 1;
            }
            // Waits in its group's queue for a worker to return.
            _ => break,
        }
    }
    let _ = ch.close(200, "ok".into()).await;
    Ok(moved)
}
