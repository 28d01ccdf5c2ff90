//! Park queues: where a group's tasks wait, durably and in order, while no matching group
//! has room — without blocking tasks bound for other groups (no head-of-line blocking).
//!
//! One loop per (group, lane) consumes the park queue and offers what it holds to the
//! reservation script again every `RETRY` until room frees (the reference design's trigger
//! loop). Held tasks stay unacked, so a scheduler crash returns them to the park queue.
//! While it holds tasks the loop keeps the group's "parked" flag alive, so new submissions
//! queue behind parked ones rather than overtaking them.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use fleet::{topology, Lane};
use futures::{FutureExt, StreamExt};
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::dispatch::{Dispatcher, Source, UNMATCHED};

/// How soon held tasks are offered again: from `RETRY_MIN`, doubling while nothing frees up,
/// up to `RETRY_MAX`. A busy group frees slots every few milliseconds; an idle wait costs
/// at most 20 reservation calls a second.
pub const RETRY_MIN: Duration = Duration::from_millis(2);
pub const RETRY_MAX: Duration = Duration::from_millis(50);
/// How often tasks waiting for a matching worker are offered again: a new worker's tasks
/// start within this, at 4 reservation calls a second per lane while any wait.
pub const UNMATCHED_RETRY: Duration = Duration::from_millis(250);
/// Lifetime of the parked flag; renewed while tasks are held.
pub const FLAG_TTL_MS: i64 = 3000;
/// Most tasks a release loop holds out of its park queue: a batch, but never more than a
/// quarter of the queue's bound — held tasks are unacked and do not count against the bound,
/// which must mean what it says (the critical lane's is small on purpose).
pub fn hold_max(batch_max: u16, bound: u32) -> u16 {
    let quarter = u16::try_from((bound / 4).max(1)).unwrap_or(u16::MAX);
    batch_max.min(quarter)
}

/// Consumes one park queue.
pub async fn release_loop(d: Arc<Dispatcher>, group: String, lane: Lane, shutdown: CancellationToken) -> fleet::Result<()> {
    let queue = d.names.park_queue(&group, lane);
    let ch = d.conn.create_channel().await?;
    let hold_max = hold_max(d.cfg.batch_max, d.cfg.common.park_bound(lane));
    ch.basic_qos(hold_max, BasicQosOptions::default()).await?;
    let mut consumer = ch.basic_consume(queue.as_str().into(), "".into(), BasicConsumeOptions::default(), FieldTable::default()).await?;
    let mut held = Vec::new();
    let mut retry = RETRY_MIN;
    // The waiting-for-worker queue is a park queue of no group: its tasks take no group's
    // room ahead of others, and no group's "parked" flag is kept for them.
    let unmatched = group == UNMATCHED;
    let source = if unmatched { Source::Unmatched } else { Source::Park };
    loop {
        if held.is_empty() {
            let next = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                n = consumer.next() => n,
            };
            match next {
                Some(Ok(dl)) => held.push(dl),
                Some(Err(e)) => return Err(e.into()),
                None => return Err(fleet::Error::Other(format!("consumer of {queue} ended"))),
            }
        }
        let mut drained = false;
        while held.len() < usize::from(hold_max) {
            match consumer.next().now_or_never() {
                Some(Some(Ok(dl))) => held.push(dl),
                Some(Some(Err(e))) => return Err(e.into()),
                _ => {
                    drained = true;
                    break;
                }
            }
        }
        let out = d.process(std::mem::take(&mut held), &source, &shutdown).await;
        held = out.held;
        if held.is_empty() && drained && !unmatched {
            // Everything parked here is on its way: new work may take room directly again.
            if let Err(e) = d.store.clear_parked(&group, lane).await {
                tracing::debug!(error = %e, "cannot clear parked flag");
            }
        }
        retry = if out.dispatched > 0 { RETRY_MIN } else { (retry * 2).min(RETRY_MAX) };
        if !held.is_empty() {
            if unmatched {
                // Nothing frees room here; a worker registering does. Ask a few times a second.
                retry = UNMATCHED_RETRY;
            } else if let Err(e) = d.store.mark_parked(&group, lane, FLAG_TTL_MS).await {
                tracing::debug!(error = %e, "cannot renew parked flag");
            }
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                _ = tokio::time::sleep(retry) => {}
            }
        }
    }
}

/// Finds groups (from Redis, every 2 s) and starts a release loop for each group and lane.
pub async fn discover(d: Arc<Dispatcher>, tracker: TaskTracker, shutdown: CancellationToken) -> fleet::Result<()> {
    let mut running: HashSet<(String, Lane)> = HashSet::new();
    let mut ticker = crate::ticker::Ticker::new(Duration::from_secs(2));
    while ticker.tick(&shutdown).await {
        let groups = match d.store.group_names().await {
            Ok(mut g) => {
                g.push(UNMATCHED.to_string());
                g
            }
            Err(e) => {
                tracing::warn!(error = %e, "park discovery: cannot list groups");
                continue;
            }
        };
        for g in groups {
            for lane in Lane::ALL {
                if running.contains(&(g.clone(), lane)) {
                    continue;
                }
                if let Err(e) = topology::declare_park(&d.publisher, &d.cfg.common, &g, lane).await {
                    tracing::warn!(error = %e, group = %g, "cannot declare park queue");
                    return Err(e);
                }
                running.insert((g.clone(), lane));
                let (d2, g2, sd) = (d.clone(), g.clone(), shutdown.clone());
                let span = tracing::info_span!("park", group = %g, lane = %lane);
                tracker.spawn(tracing::Instrument::instrument(
                    async move {
                        if let Err(e) = release_loop(d2, g2, lane, sd.clone()).await {
                            tracing::warn!(error = %e, "park loop failed; the session restarts");
                            sd.cancel();
                        }
                    },
                    span,
                ));
            }
        }
    }
    Ok(())
}
