//! Park discovery ([`Discovery`]): every group of the fleet view, and the waiting-for-worker
//! pseudo-group, gets its park queues declared and a release loop per lane.

use std::sync::Arc;
use std::time::Instant;

use fleet::process::Stage;
use fleet::process::Ticker;
use fleet::Lane;
use tokio_util::sync::CancellationToken;

use super::{ParkLoops, Queues, Release, UNMATCHED};
use crate::config::PARK_DISCOVERY_INTERVAL;
use crate::dispatch::Dispatcher;
use crate::view::ViewRx;

/// Finds groups (in the [fleet view](crate::view), every [`PARK_DISCOVERY_INTERVAL`]) and
/// starts a [`Release`] loop for each group and lane, on `stage` (the session's). Park queues
/// are declared first, on channels of their own ([`Queues::declare`]); the release loops
/// dispatch through `dispatcher`.
pub struct Discovery {
    /// The session's park queues.
    pub queues: Arc<Queues>,
    /// The dispatcher the release loops run their batches through.
    pub dispatcher: Arc<Dispatcher>,
    /// The session's park loops (shared with reclaim, which stops a group's).
    pub loops: Arc<ParkLoops>,
    /// The stage the release loops are spawned on (the session's).
    pub stage: Stage,
    /// The fleet view whose groups are looked at.
    pub view: ViewRx,
}

impl Discovery {
    /// Looks every [`PARK_DISCOVERY_INTERVAL`] until `shutdown`.
    ///
    /// # Errors
    /// The view loop is gone, or a park queue cannot be declared (the broker refused it:
    /// the session ends and restarts).
    pub async fn run(mut self, shutdown: CancellationToken) -> fleet::Result<()> {
        let mut ticker = Ticker::new(PARK_DISCOVERY_INTERVAL);
        let mut last = None;
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = ticker.next() => self.tick(&mut last, &shutdown).await?,
            }
        }
        Ok(())
    }

    /// One pass over a view newer than the previous pass's (`last`: when that one was
    /// sampled). The view's `sampled_at` is when its list was read: a group stopped for a
    /// reclaim after it is skipped (the list may be stale).
    async fn tick(
        &mut self,
        last: &mut Option<Instant>,
        shutdown: &CancellationToken,
    ) -> fleet::Result<()> {
        let Some(view) = self.view.after(*last, shutdown).await? else {
            return Ok(());
        };
        *last = Some(view.sampled_at);
        let Discovery {
            queues,
            dispatcher,
            loops,
            stage,
            ..
        } = &*self;
        let listed_at = view.sampled_at;
        // Every group, the waiting-for-worker queue, and the hold queue of every kind and batch
        // a pause named (paused: its loop waits; resumed: it drains what is left).
        let held: Vec<String> = dispatcher
            .session
            .pauses
            .current()
            .holds()
            .filter_map(crate::pause::hold_group)
            .collect();
        let groups = view
            .group_names()
            .chain(std::iter::once(UNMATCHED))
            .chain(held.iter().map(String::as_str));
        for g in groups {
            for lane in Lane::ALL {
                let Some((n, token)) = loops.claim_start(g, lane, listed_at, shutdown) else {
                    continue;
                };
                if let Err(e) = queues.declare(g, lane).await {
                    tracing::warn!(error = %e, group = %g, "cannot declare park queue");
                    return Err(e);
                }
                let release = Release {
                    d: dispatcher.clone(),
                    group: g.to_string(),
                    lane,
                };
                let (g2, sd, l2) = (g.to_string(), shutdown.clone(), loops.clone());
                let handle = stage.spawn(
                    tracing::info_span!("park", group = %g, lane = %lane),
                    async move {
                        let r = release.run(token).await;
                        l2.ended(&g2, lane, n);
                        if let Err(e) = r {
                            tracing::warn!(error = %e, "park loop failed; the session restarts");
                            sd.cancel();
                        }
                    },
                );
                loops.started(g, lane, n, handle);
            }
        }
        Ok(())
    }
}
