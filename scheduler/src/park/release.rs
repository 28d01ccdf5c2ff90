//! Park queues: where a group's tasks wait, durably and in order, while no matching group
//! has room — without blocking tasks bound for other groups (no head-of-line blocking).
//!
//! One loop per (group, lane) consumes the park queue and offers what it holds to the
//! reservation script again every `RETRY` until room frees (the reference design's trigger
//! loop). Held tasks stay unacked, so a scheduler crash returns them to the park queue.
//! While it holds tasks the loop keeps the group's "parked" flag alive, so new submissions
//! queue behind parked ones rather than overtaking them.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fleet::shutdown::Stage;
use fleet::ticker::Ticker;
use fleet::Lane;
use futures::{FutureExt, StreamExt};
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::dispatch::{Dispatcher, Source, UNMATCHED};
use crate::session::Session;
use crate::view::ViewRx;

/// How soon held tasks are offered again: from `RETRY_MIN`, doubling while nothing frees up,
/// up to `RETRY_MAX`. A busy group frees slots every few milliseconds; an idle wait costs
/// at most 20 reservation calls a second.
pub const RETRY_MIN: Duration = Duration::from_millis(2);
pub const RETRY_MAX: Duration = Duration::from_millis(50);
/// How often tasks waiting for a matching worker are offered again: a new worker's tasks
/// start within this, at 4 reservation calls a second per lane while any wait.
pub const UNMATCHED_RETRY: Duration = Duration::from_millis(250);
/// Most tasks a release loop holds out of its park queue: a batch, but never more than a
/// quarter of the queue's bound — held tasks are unacked and do not count against the bound,
/// which must mean what it says (the critical lane's is small on purpose).
pub fn hold_max(batch_max: u16, bound: u32) -> u16 {
    let quarter = u16::try_from((bound / 4).max(1)).unwrap_or(u16::MAX);
    batch_max.min(quarter)
}

/// The release loop of one park queue.
pub struct Release {
    pub d: Arc<Dispatcher>,
    pub group: String,
    pub lane: Lane,
}

impl Release {
    /// Consumes the park queue until `shutdown` (the session's end, or the group's reclaim)
    /// fires; then closes its channel, so tasks it held go back to the queue at once.
    pub async fn run(self, shutdown: CancellationToken) -> fleet::Result<()> {
        let Release { d, group, lane } = self;
        let queue = d.session.names.park_queue(&group, lane);
        let ch = d.session.conn.create_channel().await?;
        let r = consume(&d, &ch, &queue, &group, lane, &shutdown).await;
        let _ = ch.close(200, "ok".into()).await;
        match r? {
            Ended::Shutdown => Ok(()),
            // The queue was deleted under the consumer: the group was reclaimed (by another
            // scheduler replica, or while this loop was being stopped). Not a session failure.
            // (Asked of Redis now, not of the fleet view: the view may predate the reclaim.)
            Ended::ConsumerCancelled if !d.session.store.group_names().await?.contains(&group) => {
                tracing::info!(queue = %queue, "park queue deleted: its group was reclaimed");
                Ok(())
            }
            Ended::ConsumerCancelled => {
                Err(fleet::Error::Other(format!("consumer of {queue} ended")))
            }
            // Only this loop ends: discovery starts it again on its next pass (the group is
            // still in the view), on a fresh channel.
            Ended::ChannelClosed => {
                tracing::warn!(queue = %queue, "the broker closed this park loop's channel (its consumer timeout?); the loop starts again");
                Ok(())
            }
        }
    }
}

/// Why [`consume`] returned.
enum Ended {
    Shutdown,
    /// The broker ended the consumer (its queue was deleted).
    ConsumerCancelled,
    /// The broker closed the loop's channel (e.g. its consumer timeout, while a full group held
    /// tasks here longer): what the loop held is back in the queue.
    ChannelClosed,
}

async fn consume(
    d: &Dispatcher,
    ch: &lapin::Channel,
    queue: &str,
    group: &str,
    lane: Lane,
    shutdown: &CancellationToken,
) -> fleet::Result<Ended> {
    let hold_max = hold_max(d.session.cfg.batch_max, d.session.cfg.common.park_max[lane]);
    ch.basic_qos(hold_max, BasicQosOptions::default()).await?;
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    let mut held = Vec::new();
    let mut retry = RETRY_MIN;
    // The waiting-for-worker queue is a park queue of no group: its tasks take no group's
    // room ahead of others, and no group's "parked" flag is kept for them.
    let unmatched = group == UNMATCHED;
    let source = if unmatched {
        Source::Unmatched
    } else {
        Source::Park
    };
    loop {
        // With a full hold the consumer is not polled, so its end would go unseen: a channel
        // the broker closed (its consumer timeout, while a full group held tasks here longer)
        // has handed them back to the queue, and acking them here can only fail.
        if !ch.status().connected() {
            return Ok(Ended::ChannelClosed);
        }
        if held.is_empty() {
            let next = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(Ended::Shutdown),
                n = consumer.next() => n,
            };
            match next {
                Some(Ok(dl)) => held.push(dl),
                Some(Err(e)) => return Err(e.into()),
                None => return Ok(Ended::ConsumerCancelled),
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
        let out = d
            .process(std::mem::take(&mut held), &source, shutdown)
            .await;
        out.check_publisher(&d.session)?;
        // A publish that failed (e.g. the target park queue at its bound) requeued its source,
        // which comes straight back: wait as for a held task rather than spin on it.
        let refused = out.failed > 0;
        held = out.held;
        if held.is_empty() && drained && !refused && !unmatched {
            // Everything parked here is on its way: new work may take room directly again.
            if let Err(e) = d.session.store.clear_parked(group, lane).await {
                tracing::debug!(error = %e, "cannot clear parked flag");
            }
        }
        // `dispatched` counts decisions; a refused publish backs off like a held task.
        retry = if out.dispatched > 0 && !refused {
            RETRY_MIN
        } else {
            (retry * 2).min(RETRY_MAX)
        };
        if !held.is_empty() || refused {
            if unmatched {
                // Nothing frees room here; a worker registering does. Ask a few times a second.
                retry = UNMATCHED_RETRY;
            } else if let Err(e) = d
                .session
                .store
                .mark_parked(group, lane, fleet::park::FLAG_TTL_MS)
                .await
            {
                tracing::debug!(error = %e, "cannot renew parked flag");
            }
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(Ended::Shutdown),
                _ = tokio::time::sleep(retry) => {}
            }
        }
    }
}

/// The park loops of one session by (group, lane): discovery starts them, a group's reclaim
/// stops them (see [`crate::reclaim`]).
#[derive(Default)]
pub struct ParkLoops {
    inner: std::sync::Mutex<LoopsState>,
}

/// A running loop: its start number, its token and its task.
type RunningLoop = (u64, CancellationToken, Option<JoinHandle<()>>);

#[derive(Default)]
struct LoopsState {
    /// Per loop: its start number (tells a loop from the one that replaced it), its token
    /// and its task.
    running: HashMap<(String, Lane), RunningLoop>,
    starts: u64,
    /// Groups stopped for a reclaim, with when: a discovery pass that listed the groups
    /// before that may hold a stale list, and skips them.
    stopped: HashMap<String, Instant>,
}

/// How long a reclaimed group is remembered by [`ParkLoops`].
const STOPPED_MEMORY: Duration = Duration::from_secs(300);

impl ParkLoops {
    fn state(&self) -> std::sync::MutexGuard<'_, LoopsState> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Reserves the start of a loop: its token, or `None` when it runs already or its group was
    /// stopped after `listed_at` (the list it comes from may be stale).
    fn claim_start(
        &self,
        group: &str,
        lane: Lane,
        listed_at: Instant,
        parent: &CancellationToken,
    ) -> Option<(u64, CancellationToken)> {
        let mut st = self.state();
        let key = (group.to_string(), lane);
        if st.running.contains_key(&key) || st.stopped.get(group).is_some_and(|at| *at >= listed_at)
        {
            return None;
        }
        let token = parent.child_token();
        st.starts += 1;
        let n = st.starts;
        st.running.insert(key, (n, token.clone(), None));
        Some((n, token))
    }

    fn started(&self, group: &str, lane: Lane, n: u64, handle: JoinHandle<()>) {
        if let Some((m, _, h)) = self.state().running.get_mut(&(group.to_string(), lane)) {
            if *m == n {
                *h = Some(handle);
            }
        }
    }

    /// Forgets a loop that ended by itself (unless another took its place).
    fn ended(&self, group: &str, lane: Lane, n: u64) {
        let mut st = self.state();
        let key = (group.to_string(), lane);
        if st.running.get(&key).is_some_and(|(m, _, _)| *m == n) {
            st.running.remove(&key);
        }
    }

    /// Stops a group's loops (both lanes) and keeps discovery from starting them again until
    /// [`ParkLoops::resume`]; waits for them to end (closing their channels), at most `wait`.
    pub async fn stop_group(&self, group: &str, wait: Duration) {
        let handles: Vec<JoinHandle<()>> = {
            let mut st = self.state();
            let now = Instant::now();
            st.stopped
                .retain(|_, at| now.duration_since(*at) < STOPPED_MEMORY);
            st.stopped.insert(group.to_string(), now);
            Lane::ALL
                .iter()
                .filter_map(|l| st.running.remove(&(group.to_string(), *l)))
                .filter_map(|(_, t, h)| {
                    t.cancel();
                    h
                })
                .collect()
        };
        let _ = tokio::time::timeout(wait, futures::future::join_all(handles)).await;
    }

    /// Marks a stopped group's reclaim as ended now (a discovery pass that listed the groups
    /// before this skips it).
    pub fn reclaimed(&self, group: &str) {
        self.state()
            .stopped
            .insert(group.to_string(), Instant::now());
    }

    /// Lets discovery start a stopped group's loops again (its reclaim was undone).
    pub fn resume(&self, group: &str) {
        self.state().stopped.remove(group);
    }

    /// Groups and lanes with a loop.
    pub fn running(&self) -> Vec<(String, Lane)> {
        self.state().running.keys().cloned().collect()
    }
}

/// How often discovery looks at the groups (of the fleet view).
pub const DISCOVERY_INTERVAL: Duration = Duration::from_secs(2);

/// Finds groups (in the [fleet view](crate::view), every 2 s) and starts a [`Release`] loop
/// for each group and lane, on `stage` (the session's). Park queues are declared on channels
/// of their own ([`Session::declare_park`]); the release loops dispatch through `dispatcher`.
pub struct Discovery {
    pub session: Arc<Session>,
    pub dispatcher: Arc<Dispatcher>,
    pub loops: Arc<ParkLoops>,
    pub stage: Stage,
    pub view: ViewRx,
}

impl Discovery {
    pub async fn run(mut self, shutdown: CancellationToken) -> fleet::Result<()> {
        let mut ticker = Ticker::new(DISCOVERY_INTERVAL);
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
            session,
            dispatcher,
            loops,
            stage,
            ..
        } = &*self;
        let listed_at = view.sampled_at;
        let groups = view.group_names().chain(std::iter::once(UNMATCHED));
        for g in groups {
            for lane in Lane::ALL {
                let Some((n, token)) = loops.claim_start(g, lane, listed_at, shutdown) else {
                    continue;
                };
                if let Err(e) = session.declare_park(g, lane).await {
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
