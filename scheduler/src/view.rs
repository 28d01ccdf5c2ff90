//! The fleet view: one loop reads every group from Redis and the depth of every queue the
//! session's loops look at from the broker, once per tick, and publishes the result as an
//! `Arc<FleetView>` on a [`tokio::sync::watch`] channel. The loops that used to list every
//! group on their own tick — pressure ([`crate::backpressure::Controller`]), health
//! ([`crate::health`]), probes ([`crate::probe`]), stats ([`crate::stats`]), park discovery
//! ([`crate::park::Discovery`]) and reclaim ([`crate::reclaim`]) — read the latest view instead.
//!
//! **Shape.** [`FleetView`]: `sampled_at` (a monotonic [`Instant`] taken *before* Redis is
//! read: a change made before it is in the view), `groups` (every group's
//! [`GroupView`], sorted by name: workers, capacity, running and reserved tasks per lane —
//! counts of tasks) and the depths (ready messages, by passive declare) of: both ingress
//! queues, the dead-letter and delayed queues, every group's park queue and shard queues (one
//! per lane when unsharded) in both lanes, and the normal-lane park queue of the
//! waiting-for-worker pseudo-group ([`fleet::Names::UNMATCHED_GROUP`]). A queue that does not
//! exist (or whose depth the broker did not give) has no depth ([`FleetView::depth`] is
//! `None`); each reader decides what that means, as it did when it read the broker itself.
//!
//! **Tick.** [`interval`]: the smallest interval of the loops that read the view —
//! `pressure_interval` (250 ms by default, and the smallest by default: stats 1 s, park
//! discovery 2 s, health and probes 10 s, reclaim at most the health interval), unless an operator sets another consumer's interval
//! below it. Every consumer then finds a view at most one of its own ticks old, and the
//! pressure controller, which runs once per view, keeps measuring every `pressure_interval`.
//! One channel serves every passive declare of a tick (reopened after a missing queue's 404
//! closes it), where the stats loop used to open one per queue.
//!
//! **Failures.** A tick whose Redis read fails publishes nothing: the last good view stays,
//! and the readers that wait for a newer one ([`ViewRx::since`], [`ViewRx::after`]) wait —
//! an unreadable Redis is never taken for "no groups", so nothing is evicted, reclaimed or
//! stopped on a failed sample. Before the first good sample the channel holds `None`, and the
//! readers wait for one.
//!
//! **Fresher reads.** The view is a snapshot up to one tick old. What must act on the present
//! reads it directly: eviction is one script ([`fleet::Store::evict_stale`]); reclaim checks the
//! queues of each candidate passively and claims it with a script that checks Redis again
//! before anything is deleted; a park release loop whose queue vanished asks Redis whether its
//! group was reclaimed; the reservation script decides every dispatch.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fleet::process::Ticker;
use fleet::registry::GroupView;
use fleet::{metrics as m, Lane};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::config::{SchedulerConfig, PARK_DISCOVERY_INTERVAL};
use crate::session::Session;

/// Queues a session declared itself, whose depth the view reads on every tick however long
/// ago the broker last said it had none (see [`ViewLoop`]). Implemented by the session's park
/// queues ([`crate::park::Queues`]), which the view is given rather than imports.
pub trait Declared: Send + Sync {
    /// The names of the queues (as [`fleet::Names`] gives them).
    fn declared(&self) -> std::collections::HashSet<String>;
}

/// One sample of the fleet: groups from Redis and queue depths from the broker.
#[derive(Debug, Clone)]
pub struct FleetView {
    /// When the sample began, before Redis was read.
    pub sampled_at: Instant,
    /// Every group, sorted by name.
    pub groups: Vec<GroupView>,
    /// Ready messages per queue name; a queue missing here did not exist (or did not answer).
    depths: HashMap<String, u32>,
}

impl FleetView {
    /// Ready messages in `queue` when the view was sampled; `None` when the queue did not
    /// exist, or is not one the view samples.
    pub fn depth(&self, queue: &str) -> Option<u32> {
        self.depths.get(queue).copied()
    }

    /// The names of every group, sorted.
    pub fn group_names(&self) -> impl Iterator<Item = &str> {
        self.groups.iter().map(|g| g.group.as_str())
    }
}

/// The tick of the view: the smallest interval of its readers (see the module docs), at
/// least 1 ms.
pub fn interval(cfg: &SchedulerConfig) -> Duration {
    [
        cfg.pressure_interval,
        cfg.stats_interval,
        cfg.health_interval,
        cfg.probe_interval,
        PARK_DISCOVERY_INTERVAL,
        cfg.reclaim_interval(),
    ]
    .into_iter()
    .min()
    .unwrap_or(cfg.pressure_interval)
    .max(Duration::from_millis(1))
}

/// A new view channel: the sending end for [`ViewLoop`], the reading end for the loops.
pub fn channel() -> (watch::Sender<Option<Arc<FleetView>>>, ViewRx) {
    let (tx, rx) = watch::channel(None);
    (tx, ViewRx(rx))
}

/// The reading end of the view channel (cheap to clone, one per loop).
#[derive(Clone)]
pub struct ViewRx(watch::Receiver<Option<Arc<FleetView>>>);

impl ViewRx {
    /// Waits for a view sampled at or after `at` (any view with `None`). `Ok(None)` once
    /// `shutdown` fires.
    ///
    /// # Errors
    /// The view loop is gone (the session is ending).
    pub async fn since(
        &mut self,
        at: Option<Instant>,
        shutdown: &CancellationToken,
    ) -> fleet::Result<Option<Arc<FleetView>>> {
        self.wait(|v| at.is_none_or(|at| v.sampled_at >= at), shutdown)
            .await
    }

    /// Waits for a view sampled strictly after `at` (one newer than the view a loop last
    /// used; any view with `None`). `Ok(None)` once `shutdown` fires.
    ///
    /// # Errors
    /// The view loop is gone (the session is ending).
    pub async fn after(
        &mut self,
        at: Option<Instant>,
        shutdown: &CancellationToken,
    ) -> fleet::Result<Option<Arc<FleetView>>> {
        self.wait(|v| at.is_none_or(|at| v.sampled_at > at), shutdown)
            .await
    }

    async fn wait(
        &mut self,
        fresh: impl Fn(&FleetView) -> bool,
        shutdown: &CancellationToken,
    ) -> fleet::Result<Option<Arc<FleetView>>> {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => Ok(None),
            r = self.0.wait_for(|v| v.as_deref().is_some_and(&fresh)) => match r {
                Ok(v) => Ok(v.clone()),
                Err(_) => Err(fleet::Error::LoopEnded { name: "fleet view" }),
            },
        }
    }
}

/// The sampling loop: one [`FleetView`] every [`interval`].
pub struct ViewLoop {
    /// The session whose store and connection it reads.
    pub session: Arc<Session>,
    /// Where each view is published.
    pub tx: watch::Sender<Option<Arc<FleetView>>>,
    /// The park queues the session declared: always read (see [`Declared`]).
    pub declared: Arc<dyn Declared>,
}

impl ViewLoop {
    /// Samples until `shutdown`; a failed Redis read skips the tick (the last view stays).
    pub async fn run(self, shutdown: CancellationToken) -> fleet::Result<()> {
        let mut ticker = Ticker::new(interval(&self.session.cfg));
        let mut depths = Depths {
            probe: &self.session.probe,
            missing: HashMap::new(),
        };
        let mut failing = false;
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = ticker.next() => match self.sample(&mut depths).await {
                    Ok(view) => {
                        if failing {
                            tracing::info!(groups = view.groups.len(), "fleet view: groups readable again");
                            failing = false;
                        }
                        self.tx.send_replace(Some(Arc::new(view)));
                    }
                    Err(e) => {
                        metrics::counter!(m::REDIS_ERRORS).increment(1);
                        if !failing {
                            tracing::warn!(error = %e, "fleet view: cannot read groups from Redis; keeping the last view");
                            failing = true;
                        }
                    }
                },
            }
        }
        // The prober's connection is the process's to close (scheduler::run), bounded.
        let _ = depths;
        Ok(())
    }

    /// One sample. Fails only when Redis cannot be read; a queue the broker does not answer
    /// for has no depth.
    async fn sample(&self, depths: &mut Depths<'_>) -> fleet::Result<FleetView> {
        let (s, n) = (&self.session, &self.session.names);
        let sampled_at = Instant::now();
        let groups = s.store.groups().await?;
        let mut queues = vec![n.dead_queue(), n.delayed_queue()];
        queues.extend(Lane::ALL.iter().map(|l| n.ingress_queue(*l)));
        let mut parks = Vec::new();
        for g in &groups {
            for lane in Lane::ALL {
                parks.push(n.park_queue(&g.group, lane));
                queues.extend(n.group_shard_queues(&g.group, lane, s.cfg.common.shards(lane)));
            }
        }
        // The fair park queues of keyed tasks that this session consumes (declared here).
        let declared_now = self.declared.declared();
        for g in &groups {
            for q in 0..s.cfg.common.fair_queues {
                let name = n.park_queue(&fleet::Names::fair_group(&g.group, q), Lane::Normal);
                if declared_now.contains(&name) {
                    parks.push(name);
                }
            }
        }
        // Tasks waiting for a matching worker (normal lane: what the pressure counts).
        parks.push(n.park_queue(fleet::Names::UNMATCHED_GROUP, Lane::Normal));
        // The hold queues of paused kinds and batches (and of those resumed, while they drain).
        for g in s
            .pauses
            .current()
            .holds()
            .filter_map(crate::pause::hold_group)
        {
            for lane in Lane::ALL {
                parks.push(n.park_queue(&g, lane));
            }
        }
        let mut out = HashMap::with_capacity(queues.len() + parks.len());
        for q in queues {
            if let Some(d) = depths.read(&q, true).await {
                out.insert(q, d);
            }
        }
        let declared = self.declared.declared();
        for q in parks {
            let always = declared.contains(&q);
            if let Some(d) = depths.read(&q, always).await {
                out.insert(q, d);
            }
        }
        Ok(FleetView {
            sampled_at,
            groups,
            depths: out,
        })
    }
}

/// How long a park queue the broker did not have is taken as still missing before it is
/// asked again (the park discovery interval): a passive declare of a missing queue costs the
/// channel (the broker closes it with 404), and most groups have no park queue most of the
/// time — asking every tick opened and closed a channel per such queue four times a second.
/// A park queue this session declared itself is always read, and so is every other queue
/// (group queues are declared by their workers, which may register a moment before).
const MISSING_RECHECK: Duration = PARK_DISCOVERY_INTERVAL;

/// Passive declares through the session's prober (a connection of its own: a missing
/// queue's 404 closes the channel and costs lapin a channel id, `fleet::broker::probe`).
struct Depths<'a> {
    probe: &'a fleet::broker::probe::Prober,
    /// Queues found missing, and when.
    missing: HashMap<String, Instant>,
}

impl Depths<'_> {
    /// The depth of `queue`; unless `always`, a queue found missing less than
    /// [`MISSING_RECHECK`] ago is taken as still missing without asking.
    async fn read(&mut self, queue: &str, always: bool) -> Option<u32> {
        if !always
            && self
                .missing
                .get(queue)
                .is_some_and(|at| at.elapsed() < MISSING_RECHECK)
        {
            return None;
        }
        let depth = self
            .probe
            .queue(queue)
            .await
            .ok()
            .flatten()
            .map(|q| q.ready);
        match depth {
            Some(_) => self.missing.remove(queue),
            None => self.missing.insert(queue.to_string(), Instant::now()),
        };
        depth
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(at: Instant) -> Arc<FleetView> {
        Arc::new(FleetView {
            sampled_at: at,
            groups: vec![],
            depths: HashMap::from([("q".to_string(), 3)]),
        })
    }

    #[tokio::test]
    async fn readers_wait_for_a_fresh_view_and_stop_at_shutdown() {
        let (tx, mut rx) = channel();
        let shutdown = CancellationToken::new();
        let t0 = Instant::now();
        tx.send_replace(Some(view(t0)));
        let v = rx.since(None, &shutdown).await.unwrap().unwrap();
        assert_eq!(
            (v.sampled_at, v.depth("q"), v.depth("other")),
            (t0, Some(3), None)
        );
        assert!(
            rx.since(Some(t0), &shutdown).await.unwrap().is_some(),
            "since is inclusive"
        );
        // Nothing newer than t0 yet: waits; a newer view ends the wait.
        let waiting = tokio::spawn({
            let (mut rx, sd) = (rx.clone(), shutdown.clone());
            async move {
                rx.after(Some(t0), &sd)
                    .await
                    .map(|v| v.map(|v| v.sampled_at))
            }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished());
        let t1 = t0 + Duration::from_millis(1);
        tx.send_replace(Some(view(t1)));
        assert_eq!(waiting.await.unwrap().unwrap(), Some(t1));
        // Shutdown ends a wait with no view; a dropped sender is an error.
        shutdown.cancel();
        assert!(rx.after(Some(t1), &shutdown).await.unwrap().is_none());
        drop(tx);
        assert!(rx.after(Some(t1), &CancellationToken::new()).await.is_err());
    }

    #[test]
    fn interval_is_the_smallest_readers_interval() {
        let mut cfg =
            SchedulerConfig::from_settings(&fleet::settings::Settings::default()).unwrap();
        assert_eq!(interval(&cfg), cfg.pressure_interval);
        cfg.stats_interval = Duration::from_millis(100);
        assert_eq!(interval(&cfg), Duration::from_millis(100));
    }
}
