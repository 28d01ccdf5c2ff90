//! Reclaiming departed groups: a group (label set) with no worker and no task for
//! `FLEET_GROUP_RECLAIM_AFTER_MS` is removed — its Redis keys, its lane and park queues, this
//! scheduler's park consumers and its in-memory state — so a fleet whose workers come and go
//! with unique labels (one pod = one group) does not accumulate them. A worker of that label set
//! registering later recreates the group as any new group.
//!
//! One tick (every `min(grace, FLEET_HEALTH_INTERVAL_MS)`, at least 100 ms, see
//! [`SchedulerConfig::reclaim_interval`](crate::config::SchedulerConfig::reclaim_interval)):
//!
//! 1. Candidates: groups of the [fleet view](crate::view) — one sampled after the previous tick
//!    ended, so a group this loop reclaimed is not seen again — with no worker, no capacity and
//!    no running or reserved task whose four queues (lane and park, both lanes) hold no ready
//!    message. The queues are asked now (passive declares), not read from the view: a
//!    candidate's queues must be empty when it is claimed, not a tick ago.
//! 2. Claim (`registry/reclaim.lua` in the library, atomic against a worker registering): only a group that still
//!    has no worker and no running, reserved or parked record, and has been so for the whole
//!    grace (Redis time), loses its keys; a tombstone `rc:<group>` = `pending` then makes the
//!    registration of a worker of that group wait (it retries) until the queues are gone.
//! 3. This scheduler stops the group's park loops (their channels close: anything they held
//!    goes back to its queue), forgets its declared park queues, and waits a settle time
//!    (twice the slowest sampling interval, 1-10 s; the fleet view ticks at least as often, so
//!    a view sampled before the claim is superseded within it) so that loops that read a view
//!    sampled before the claim are done with it. (None of them creates a group's queue or key:
//!    the view reads park depths passively, rooms are written only to groups that exist,
//!    discovery skips a group stopped after its view was sampled.)
//! 4. Each of the queues is unbound from `<ns>.tasks` (a task routed to it from then on comes
//!    back to its publisher, mandatory, and its source is requeued), asked for a message with
//!    `basic.get` (served by a quorum queue's leader, unlike a passive declare's count, which
//!    reads 0 when the leader is slow or lost; a message found is put back as a copy), and —
//!    a lane queue — for its consumers, and deleted if it has neither, with `if-empty` as well
//!    when it is a classic queue (other replicas' park consumers are cancelled by the deletion,
//!    which their park loops expect). Each deletion is bounded (`DELETE_LIMIT`). Quorum
//!    queues (the default) refuse `if-empty` and `if-unused` with a connection-level error
//!    (540 NOT_IMPLEMENTED, RabbitMQ 3.10), which would close the scheduler's whole
//!    connection; unbinding first is what makes the check and the delete one step for them. A
//!    queue that is not empty means work arrived (and a broker that keeps failing leaves them
//!    too): the claim is undone (`restore`: the queues are declared and bound again, then the
//!    group is back, its grace starting again) and the group is tried again after another
//!    grace.
//! 5. Done: the tombstone becomes the deletion's time for [`done_hold`]; a worker whose queue
//!    declaration is older must declare them again before it registers (register.lua), so no
//!    task is ever routed to a queue that no longer exists.
//!
//! Several scheduler replicas may run this: one claim wins, the others see the group vanish and
//! stop their own park loops for it. Every replica sets the `fleet_groups` gauge each tick.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fleet::broker::amqp;
use fleet::broker::topology::QueueType;
use fleet::process::Ticker;
use fleet::registry::{GroupView, ReclaimClaim};
use fleet::{broker::topology, metrics as m, Lane};
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicNackOptions, QueueBindOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use tokio_util::sync::CancellationToken;

use crate::park::{ParkLoops, Queues};
use crate::probe::ProbeBoard;
use crate::session::Session;
use crate::view::ViewRx;

/// Life of the `pending` tombstone beyond the settle time: the longest the queue deletions of
/// one tick may take before workers of the group may register anyway.
const PENDING_HOLD: Duration = Duration::from_secs(60);

/// Longest wait for a group's park loops to stop.
const STOP_WAIT: Duration = Duration::from_secs(10);

/// How long the tombstone of a reclaimed group keeps refusing workers whose queue declaration
/// is older than the deletion: as long as the grace, between 1 s and 1 min. (A worker that
/// declares and registers further apart than that — only while Redis is unreachable at its
/// start — finds its queues gone at its first consume and declares them again.)
pub fn done_hold(grace: Duration) -> Duration {
    grace.clamp(Duration::from_secs(1), Duration::from_secs(60))
}

/// The time a tick waits between claiming groups and deleting their queues: twice the slowest
/// interval of the loops that declare park queues of the groups they list, 1-10 s.
pub fn settle(stats: Duration, pressure: Duration) -> Duration {
    (2 * stats.max(pressure)).clamp(Duration::from_secs(1), Duration::from_secs(10))
}

/// A group is a candidate when nothing in Redis says it is in use.
fn departed(g: &GroupView) -> bool {
    g.workers == 0
        && g.capacity == 0
        && g.critical_capacity == 0
        && g.load == 0
        && g.reserved == 0
        && g.critical_load == 0
        && g.critical_reserved == 0
}

/// The reclaim loop: sets `fleet_groups` every tick (also with reclaim off,
/// `FLEET_GROUP_RECLAIM_AFTER_MS=0`) and reclaims departed groups.
pub struct Reclaimer {
    /// The session whose groups it reclaims.
    pub session: Arc<Session>,
    /// The session's park loops: a reclaimed group's are stopped.
    pub loops: Arc<ParkLoops>,
    /// The session's park queues: a reclaimed group's are forgotten (or declared again when
    /// the reclaim is undone).
    pub queues: Arc<Queues>,
    /// The probe results: a reclaimed group's are dropped.
    pub probes: ProbeBoard,
    /// The fleet view whose groups are candidates.
    pub view: ViewRx,
}

impl Reclaimer {
    /// Ticks every [`SchedulerConfig::reclaim_interval`](crate::config::SchedulerConfig::reclaim_interval)
    /// until `shutdown`.
    ///
    /// # Errors
    /// The view loop is gone (the session is ending).
    pub async fn run(mut self, shutdown: CancellationToken) -> fleet::Result<()> {
        let mut ticker = Ticker::new(self.session.cfg.reclaim_interval());
        let mut known: HashSet<String> = HashSet::new();
        let mut ended: Option<Instant> = None;
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = ticker.next() => {
                    self.tick(&mut known, ended, &shutdown).await?;
                    ended = Some(Instant::now());
                }
            }
        }
        Ok(())
    }

    /// One tick on a view sampled after the previous tick ended (`ended`); `known` holds the
    /// groups seen at the previous one. Waits while no such view comes (Redis unreadable):
    /// a failed sample never reads as "every group gone". `Err` only when the view loop is
    /// gone (the session is ending).
    async fn tick(
        &mut self,
        known: &mut HashSet<String>,
        ended: Option<Instant>,
        shutdown: &CancellationToken,
    ) -> fleet::Result<()> {
        let Some(view) = self.view.since(ended, shutdown).await? else {
            return Ok(());
        };
        let Reclaimer {
            session: s,
            loops,
            queues,
            probes,
            ..
        } = &*self;
        let groups = &view.groups;
        // Groups another replica reclaimed: stop this replica's loops and state for them.
        let now: HashSet<String> = groups.iter().map(|g| g.group.clone()).collect();
        for gone in known.difference(&now) {
            loops.stop_group(gone, STOP_WAIT).await;
            loops.reclaimed(gone);
            queues.forget(gone);
            probes.write().await.remove(gone);
        }
        *known = now;
        if let Some(grace) = s.cfg.group_reclaim_after {
            let n = pass(s, loops, queues, probes, groups, grace, shutdown).await;
            for g in &n {
                known.remove(g);
            }
        }
        metrics::gauge!(m::GROUPS).set(known.len() as f64);
        Ok(())
    }
}

/// One reclaim pass over `groups`; returns the groups reclaimed.
async fn pass(
    s: &Session,
    loops: &ParkLoops,
    queues: &Queues,
    probes: &ProbeBoard,
    groups: &[GroupView],
    grace: Duration,
    shutdown: &CancellationToken,
) -> Vec<String> {
    let settle = settle(s.cfg.stats_interval, s.cfg.pressure_interval);
    let (pending, tombstone_life) = (settle + PENDING_HOLD, done_hold(grace));

    // 1-2: candidates with empty queues, claimed in Redis.
    let mut claimed: Vec<(String, String)> = Vec::new();
    for g in groups.iter().filter(|g| departed(g)) {
        if !queues_empty(s, &g.group).await {
            continue;
        }
        match s.store.reclaim_claim(&g.group, grace, pending).await {
            Ok(ReclaimClaim::Reclaimed { labels }) => claimed.push((g.group.clone(), labels)),
            Ok(ReclaimClaim::Wait(_) | ReclaimClaim::Busy(_) | ReclaimClaim::Absent) => {}
            Err(e) => {
                metrics::counter!(m::REDIS_ERRORS).increment(1);
                tracing::debug!(error = %e, group = %g.group, "reclaim: claim failed");
            }
        }
    }
    if claimed.is_empty() {
        return vec![];
    }
    // 3: this scheduler lets go of the groups.
    for (g, _) in &claimed {
        loops.stop_group(g, STOP_WAIT).await;
        queues.forget(g);
        probes.write().await.remove(g);
    }
    tokio::select! {
        biased;
        // Shutting down: leave the claims to their tombstones' expiry; the groups' queues stay
        // (empty) until a worker of the group comes back and declares them again.
        _ = shutdown.cancelled() => return vec![],
        _ = tokio::time::sleep(settle) => {}
    }
    // 4-5: delete the queues; undo the claim of a group whose queue held work.
    let mut done = Vec::with_capacity(claimed.len());
    for (g, labels) in claimed {
        match delete_queues(s, &g).await {
            Ok(()) => {
                if let Err(e) = s.store.reclaim_done(&g, tombstone_life).await {
                    tracing::warn!(error = %e, group = %g, "reclaim: cannot mark the group's queues deleted (its tombstone expires by itself)");
                }
                loops.reclaimed(&g);
                metrics::counter!(m::GROUPS_RECLAIMED).increment(1);
                tracing::info!(group = %g, grace_ms = grace.as_millis() as u64, "group reclaimed: no worker and no task for the grace; its queues, consumers and keys are removed");
                done.push(g);
            }
            Err(why) => {
                tracing::info!(group = %g, reason = %why, "group not reclaimed: its queues stay; trying again after another grace");
                restore(s, loops, queues, &g, &labels, pending, tombstone_life).await;
            }
        }
    }
    done
}

/// True when the group's lane and park queues (both lanes) hold no ready message (a missing
/// queue is empty). Unacked messages are not counted: those of a park loop keep the group's
/// parked flag alive (the claim refuses it); those of a worker keep its run records.
/// Asked of the broker now, not read from the fleet view: a task may have arrived since the
/// view was sampled, and these queues are about to be deleted.
async fn queues_empty(s: &Session, group: &str) -> bool {
    for lane in Lane::ALL {
        for (q, _, _) in group_bindings(s, group, lane) {
            let ready = s
                .probe
                .queue(&q)
                .await
                .ok()
                .flatten()
                .map_or(0, |q| q.ready);
            if ready > 0 {
                return false;
            }
        }
    }
    true
}

/// Why a group's queues were not all deleted.
#[derive(Debug)]
enum NotDeleted {
    /// A queue held a task or kept a consumer (406 PRECONDITION_FAILED on a classic queue's
    /// `if-empty` too): work arrived.
    NotEmpty(String),
    /// The broker kept failing (connection trouble) or refused the operation.
    Failed(String),
}

impl std::fmt::Display for NotDeleted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotDeleted::NotEmpty(q) => write!(f, "{q} holds a task or keeps a consumer"),
            NotDeleted::Failed(e) => write!(f, "broker error: {e}"),
        }
    }
}

/// Attempts per queue deletion: a channel may fail for reasons of its own (lapin reports the
/// close of a channel whose id it reuses, e.g. a passive declare's 404, on the next one).
const DELETE_ATTEMPTS: u32 = 5;

/// Longest each step of one queue's deletion (asking the prober whether it exists; opening its
/// channel; unbind, look, delete; closing) may take before the deletion counts as failed, not retried: a pass must end well
/// within the `pending` tombstone's life ([`PENDING_HOLD`]).
const DELETE_LIMIT: Duration = Duration::from_secs(5);

/// One lane's queues of a group with the key binding each to `<ns>.tasks`, and whether it is
/// the park queue: its park queue, then every shard queue (one when the lane is not sharded).
fn group_bindings(s: &Session, group: &str, lane: Lane) -> Vec<(String, String, bool)> {
    let n = &s.names;
    let shards = s.cfg.common.shards(lane);
    let mut qs = vec![(n.park_queue(group, lane), n.park_key(group, lane), true)];
    qs.extend((0..shards).map(|k| {
        (
            n.group_shard_queue(group, lane, k, shards),
            n.group_shard_key(group, lane, k, shards),
            false,
        )
    }));
    qs
}

/// Deletes the group's park and lane queues (every shard) that hold no task (a queue already
/// gone counts as deleted); see step 4 of the module's account.
async fn delete_queues(s: &Session, group: &str) -> Result<(), NotDeleted> {
    for lane in Lane::ALL {
        for (q, key, park) in group_bindings(s, group, lane) {
            let mut attempt = 0;
            loop {
                attempt += 1;
                match delete_unbound(s, &q, &key, park).await {
                    Ok(Gone::Deleted) => break,
                    Ok(Gone::InUse) => return Err(NotDeleted::NotEmpty(q)),
                    Err(Step::Broker(e)) if amqp::reply_code(&e) == Some(406) => {
                        return Err(NotDeleted::NotEmpty(q))
                    }
                    // The broker's answer to the operation itself (e.g. 540 NOT_IMPLEMENTED) will
                    // not change on a retry; after no answer in time, a message `basic.get` took
                    // may still be held: never try to delete that queue again now.
                    Err(Step::Broker(e)) => return Err(NotDeleted::Failed(e.to_string())),
                    Err(Step::Slow) => {
                        return Err(NotDeleted::Failed(format!(
                            "{q}: no answer within {} s",
                            DELETE_LIMIT.as_secs()
                        )))
                    }
                    Err(Step::Retry(e)) if attempt >= DELETE_ATTEMPTS => {
                        return Err(NotDeleted::Failed(e))
                    }
                    Err(Step::Retry(e)) => {
                        tracing::debug!(error = %e, queue = %q, "reclaim: queue deletion failed; retrying");
                        tokio::time::sleep(Duration::from_millis(50 * u64::from(attempt))).await;
                    }
                }
            }
        }
    }
    Ok(())
}

/// What [`delete_unbound`] found.
enum Gone {
    /// Deleted (or already gone).
    Deleted,
    /// It holds a message, or a lane queue keeps a consumer: left (`restore` binds it again).
    InUse,
}

/// Why [`delete_unbound`] failed.
enum Step {
    /// Worth another try: a channel that could not be opened (lapin may report there an
    /// earlier channel's close), a 404 not confirmed.
    Retry(String),
    /// The broker refused an operation.
    Broker(lapin::Error),
    /// No answer within [`DELETE_LIMIT`].
    Slow,
}

/// Unbinds `q` from `<ns>.tasks` (`key`) — every fleet publish to a group queue goes through
/// that exchange, so from then on nothing reaches it — then deletes it if it holds no message
/// and, a lane queue (not a `park` queue), keeps no consumer; on a channel of its own (a
/// failed operation closes it).
///
/// Emptiness is asked with `basic.get`, not read from a passive declare: a quorum queue's
/// declare answers 0 when its leader is slow or lost (RabbitMQ reports what it could not ask
/// as nothing), while a `basic.get` is served by the leader or fails. A message it gets is
/// put back as a confirmed copy through `<ns>.tasks` (the queue bound again first) and the
/// one taken acked, not nacked: a quorum queue counts a nack as a delivery and dead-letters
/// past `x-delivery-limit`, so a task waiting for its group's workers would die after that
/// many reclaim attempts (the same reason as `health.rs`'s orphan moves). A lane queue's
/// consumer (a worker's, even one evicted while frozen) may hold tasks unacked: such a queue is
/// kept. A park queue's consumers are scheduler replicas' park loops, which hold nothing for a
/// claimed group (the claim requires no parked task) and stop when the deletion cancels them.
/// Classic queues are deleted with `if-empty` as well; quorum queues refuse it (see the
/// module's account, step 4).
///
/// # Errors
/// [`Step`]. A 404 (the queue is gone) is `Ok(Deleted)` once a passive declare on a fresh
/// channel confirms it.
async fn delete_unbound(s: &Session, q: &str, key: &str, park: bool) -> Result<Gone, Step> {
    // A queue already gone (another replica's reclaim, a retry after a slow delete) is found
    // on the session's prober: an unbind of it on `ch` would be answered 404, which costs the
    // session connection a channel id for good (fleet::broker::probe).
    match tokio::time::timeout(DELETE_LIMIT, queue_exists(s, q)).await {
        Err(_) => return Err(Step::Slow),
        Ok(Err(e)) => return Err(Step::Retry(e.to_string())),
        Ok(Ok(false)) => return Ok(Gone::Deleted),
        Ok(Ok(true)) => {}
    }
    let ch = match tokio::time::timeout(DELETE_LIMIT, s.conn.create_channel()).await {
        Ok(ch) => ch.map_err(|e| Step::Retry(e.to_string()))?,
        Err(_) => return Err(Step::Slow),
    };
    let tasks = s.names.tasks_exchange();
    let work = async {
        ch.queue_unbind(
            q.into(),
            tasks.as_str().into(),
            key.into(),
            FieldTable::default(),
        )
        .await?;
        if let Some(m) = ch
            .basic_get(q.into(), BasicGetOptions { no_ack: false })
            .await?
        {
            ch.queue_bind(
                q.into(),
                tasks.as_str().into(),
                key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await?;
            match amqp::publish_confirmed(
                &s.publisher(),
                &tasks,
                key,
                &m.delivery.data,
                m.delivery.properties.clone(),
            )
            .await
            {
                Ok(()) => m.delivery.acker.ack(BasicAckOptions::default()).await?,
                Err(e) => {
                    tracing::warn!(queue = %q, error = %e, "reclaim: cannot put a task back as a copy; requeueing it (one delivery more)");
                    m.delivery
                        .acker
                        .nack(BasicNackOptions {
                            requeue: true,
                            ..Default::default()
                        })
                        .await?
                }
            };
            return Ok(Gone::InUse);
        }
        // Its consumers, asked of the prober (a queue that went meanwhile is deleted below:
        // the 404 path confirms a missing one). Unanswered, it is kept as if in use: a worker
        // may hold tasks from it.
        if !park {
            match s.probe.queue(q).await {
                Ok(Some(state)) if state.consumers > 0 => return Ok(Gone::InUse),
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!(queue = %q, error = %e, "reclaim: cannot ask for the queue's consumers; keeping it");
                    return Ok(Gone::InUse);
                }
            }
        }
        let if_empty = s.cfg.common.queue_type == QueueType::Classic;
        let left = ch
            .queue_delete(
                q.into(),
                QueueDeleteOptions {
                    if_empty,
                    ..Default::default()
                },
            )
            .await?;
        if left > 0 {
            // Not expected: nothing routes here and `basic.get` found it empty.
            tracing::error!(queue = %q, messages = left, "reclaim: a deleted queue still held messages");
        }
        Ok(Gone::Deleted)
    };
    let r: lapin::Result<Gone> = match tokio::time::timeout(DELETE_LIMIT, work).await {
        Ok(r) => r,
        Err(_) => {
            // Closing the channel hands back whatever it still holds.
            let _ = tokio::time::timeout(DELETE_LIMIT, ch.close(200, "slow".into())).await;
            return Err(Step::Slow);
        }
    };
    let _ = tokio::time::timeout(DELETE_LIMIT, ch.close(200, "ok".into())).await;
    match r {
        Err(e) if amqp::reply_code(&e) == Some(404) => {
            match tokio::time::timeout(DELETE_LIMIT, queue_exists(s, q)).await {
                Err(_) => Err(Step::Slow),
                Ok(Ok(false)) => Ok(Gone::Deleted),
                Ok(Ok(true)) => Err(Step::Retry(format!("{e} (the queue exists)"))),
                Ok(Err(e2)) => Err(Step::Retry(format!("{e}; and then {e2}"))),
            }
        }
        r => r.map_err(Step::Broker),
    }
}

/// Whether `q` exists (passive declare on the session's prober): only a 404 says no.
async fn queue_exists(s: &Session, q: &str) -> fleet::Result<bool> {
    Ok(s.probe.queue(q).await?.is_some())
}

/// Undoes a claim: the group's queues are declared — and so bound — again first (those
/// already deleted, and those left unbound), then the group is back in Redis with its grace
/// restarted and discovery may start its park loops again. In that order, a worker waiting
/// for the tombstone never registers onto an unbound queue. When they cannot be declared again
/// (the connection is gone) the group is back all the same — what its queues hold stays
/// visible to the fleet view, the orphan rescue and the API — but its tombstone becomes the
/// time of now (`restore_undeclared`): a worker of the group declares, and binds, its queues
/// before it registers.
async fn restore(
    s: &Session,
    loops: &ParkLoops,
    queues: &Queues,
    group: &str,
    labels: &str,
    hold: Duration,
    tombstone_life: Duration,
) {
    let mut attempt = 0;
    let declared = loop {
        attempt += 1;
        match declare_again(s, queues, group).await {
            Ok(()) => break true,
            Err(e) if attempt >= DELETE_ATTEMPTS => {
                tracing::warn!(error = %e, group = %group, "reclaim: cannot declare the group's queues again; its workers declare them before they register");
                break false;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(50 * u64::from(attempt))).await,
        }
    };
    let r = if declared {
        s.store.reclaim_restore(group, labels, hold).await
    } else {
        s.store
            .reclaim_restore_undeclared(group, labels, tombstone_life)
            .await
    };
    if let Err(e) = r {
        tracing::warn!(error = %e, group = %group, "reclaim: cannot restore the group (a worker of the group registering recreates it)");
    }
    loops.resume(group);
}

/// Declares the group's lane queues (bound to `<ns>.tasks`) and — asked of the park module —
/// its park queues of both lanes.
///
/// # Errors
/// A channel cannot be opened, or the broker refuses a declare.
async fn declare_again(s: &Session, queues: &Queues, group: &str) -> fleet::Result<()> {
    let ch = s.conn.create_channel().await?;
    let r = topology::declare_group(&ch, &s.cfg.common, group).await;
    let _ = ch.close(200, "ok".into()).await;
    r?;
    for lane in Lane::ALL {
        queues.declare(group, lane).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_and_settle_are_bounded() {
        assert_eq!(
            done_hold(Duration::from_millis(200)),
            Duration::from_secs(1)
        );
        assert_eq!(done_hold(Duration::from_secs(600)), Duration::from_secs(60));
        assert_eq!(
            settle(Duration::from_millis(500), Duration::from_millis(100)),
            Duration::from_secs(1)
        );
        assert_eq!(
            settle(Duration::from_millis(1000), Duration::from_millis(250)),
            Duration::from_secs(2)
        );
        assert_eq!(
            settle(Duration::from_secs(60), Duration::from_millis(250)),
            Duration::from_secs(10)
        );
    }
}
