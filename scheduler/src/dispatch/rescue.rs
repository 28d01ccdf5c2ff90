//! Orphan rescue: a group with no active worker keeps its queued tasks. The rescue (run by the
//! health loop after each eviction check, [`crate::health`]) moves them to another group whose
//! labels satisfy them when one has room (counted as rerouted); otherwise they stay in the
//! group queue and wait until a worker returns. Nothing is dropped.
//!
//! Each task goes through the dispatcher's pipeline alone, as [`Source::Orphan`]: reserved in
//! [`ReserveMode::Release`](super::ReserveMode::Release) (a parked flag does not stop it: it
//! waited already), tried once, and published as it came — to the group it was reserved in,
//! or to the back of its own queue ([`Fate::Back`](super::Fate::Back)).
//!
//! Looking at a task means taking it from its queue. One that cannot move is published again
//! to the back of its own queue (then the taken copy is acked) rather than returned with a
//! nack: a nack counts as a redelivery, and a quorum group queue dead-letters a message past
//! its delivery limit ([`fleet::broker::topology::DELIVERY_LIMIT`]), so a task waiting for its group
//! would die after that many ticks; a nack also puts it back at the head, where it would hide
//! every task behind it from the next tick. The first task that cannot move ends the queue's
//! turn (the next tick starts with the task behind it). And when no group at all has capacity
//! in the lane, the orphaned queues are not touched.

use fleet::registry::GroupView;
use fleet::Lane;
use lapin::options::{BasicGetOptions, BasicNackOptions};
use tokio_util::sync::CancellationToken;

use super::{Dispatcher, Orphan, Source};
use crate::view::FleetView;

/// Most tasks moved from one orphaned group queue per tick.
const ORPHAN_BATCH: usize = 500;

/// Moves tasks out of group queues whose group has no active capacity (in `view`), where
/// another group can take them. Returns how many were moved.
///
/// # Errors
/// A channel cannot be opened or a `basic.get` fails (the connection is in trouble), a
/// publish is not confirmed or an ack refused, or the reservation call fails (Redis
/// unreachable): the pass ends there, the task in hand requeued or back in its queue.
pub async fn rescue_orphans(
    d: &Dispatcher,
    view: &FleetView,
    shutdown: &CancellationToken,
) -> fleet::Result<usize> {
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
                let source = Source::Orphan(Orphan {
                    group: g.group.clone(),
                    lane,
                    own_key: s.names.group_shard_key(&g.group, lane, shard, shards),
                });
                moved += move_queue(d, &queue, &source, shutdown).await?;
            }
        }
    }
    Ok(moved)
}

/// Takes tasks from an orphaned queue one at a time and dispatches each from `source`, until
/// one cannot move (it goes to the back of the queue) or a batch is done.
async fn move_queue(
    d: &Dispatcher,
    queue: &str,
    source: &Source,
    shutdown: &CancellationToken,
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
        let out = d.process(vec![msg.delivery], source, shutdown).await;
        if let Some(e) = out.error {
            return Err(e);
        }
        // Not a readable envelope: not ours to judge here; leave it for a worker (which
        // dead-letters it).
        if !out.held.is_empty() {
            for held in out.held {
                held.acker
                    .nack(BasicNackOptions {
                        requeue: true,
                        ..Default::default()
                    })
                    .await?;
            }
            break;
        }
        if out.routed == 0 {
            // Waits in its group's queue for a worker to return.
            break;
        }
        moved += out.routed;
    }
    let _ = ch.close(200, "ok".into()).await;
    Ok(moved)
}
