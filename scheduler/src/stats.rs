//! Samples what dashboards and autoscalers read: queue depth per queue, group capacity, load
//! and reserved, workers by state, and per group the backlog (group queue + park queue) and
//! the age of its oldest waiting task — the input a KEDA-style autoscaler needs.
//!
//! Groups and queue depths come from the [fleet view](crate::view) (a view newer than the one
//! of the previous tick); the oldest reservation of each group and the workers by state are
//! read from Redis here (only this loop needs them).
//!
//! Each tick ends with the autoscaling figures ([`crate::scaling`]: `GET /v1/scaling`, the
//! `fleet_scaling_*` gauges), computed from this tick's group sample and key figures.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::Instant;

use fleet::process::Ticker;
use fleet::{metrics as m, Lane};
use tokio::sync::RwLock;
use tokio_util::sync::CancellationToken;

use crate::session::Session;
use crate::view::{FleetView, ViewRx};

/// What the last sample found per group, for `GET /v1/groups` (and the console).
#[derive(Debug, Clone, Default, serde::Serialize, PartialEq)]
pub struct GroupSample {
    /// Tasks waiting for the group and ready to run: its lane queues plus the park queues of
    /// its lanes not paused (what an autoscaler scales for).
    pub backlog: u32,
    /// Tasks parked for a paused lane of the group ([`crate::pause`]): not ready.
    pub backlog_paused: u32,
    /// Whether an operator paused a lane of the group (or the whole group).
    pub paused: bool,
    /// The paused lanes, normal first (empty when none is).
    pub paused_lanes: Vec<fleet::Lane>,
    /// Ready messages in the group's normal and critical lane queues.
    pub queued: u32,
    pub queued_critical: u32,
    /// Tasks parked for the group (normal and critical lane).
    pub parked: u32,
    pub parked_critical: u32,
    /// Age of the oldest task dispatched to the group and not yet started, in seconds.
    pub oldest_task_age_seconds: f64,
    /// When these figures were sampled (Redis time, RFC 3339 UTC): they are as of this
    /// stats tick (`FLEET_STATS_INTERVAL_MS`), not of the request.
    pub sampled_at: String,
}

/// The last sample per group, shared with the API.
pub type GroupBoard = Arc<RwLock<HashMap<String, GroupSample>>>;

/// The sampling loop: every `stats_interval`.
pub struct Sampler {
    pub session: Arc<Session>,
    pub board: GroupBoard,
    pub view: ViewRx,
    /// Where the autoscaling figures of each sample go ([`crate::scaling`]).
    pub scaling: crate::scaling::Board,
}

impl Sampler {
    pub async fn run(mut self, shutdown: CancellationToken) -> fleet::Result<()> {
        let s = self.session.clone();
        let mut ticker = Ticker::new(s.cfg.stats_interval);
        for lane in Lane::ALL {
            metrics::gauge!(m::QUEUE_BOUND, "queue" => s.names.ingress_queue(lane))
                .set(f64::from(s.cfg.common.ingress_max[lane]));
        }
        let mut last: Option<Instant> = None;
        // The key label values shown at the last sample (set to 0 once they leave the top).
        let mut shown_keys = BTreeSet::new();
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = ticker.next() => {
                    let Some(view) = self.view.after(last, &shutdown).await? else { continue };
                    last = Some(view.sampled_at);
                    if let Err(e) = sample(&s, &view, &self.board).await {
                        tracing::debug!(error = %e, "stats sample failed");
                    }
                    let now = s.store.clock.now_ms();
                    let figures = match key_gauges(&s, &mut shown_keys, now).await {
                        Ok(f) => f,
                        Err(e) => {
                            tracing::debug!(error = %e, "key stats sample failed");
                            continue;
                        }
                    };
                    // The autoscaling figures: this tick's group sample and key figures.
                    let groups = self.board.read().await.clone();
                    if let Err(e) = crate::scaling::sample(&s, &view, &groups, &figures, now, &self.scaling).await {
                        tracing::debug!(error = %e, "scaling sample failed");
                    }
                }
            }
        }
        Ok(())
    }
}

/// The `fleet_key_*` gauges: the `FLEET_KEY_METRICS_TOP` keys with the most tasks waiting
/// (then by name) one by one, the rest summed under `key="other"` — label values stay bounded
/// however many tenants there are. A key that leaves the top reads 0 in running and waiting
/// (the exporter keeps a series once written; its max keeps the limit). `shown` is what the
/// previous sample wrote. Returns the figures (as of `now`, Redis ms) for the autoscaling
/// figures ([`crate::scaling`]).
async fn key_gauges(
    s: &Session,
    shown: &mut BTreeSet<String>,
    now: i64,
) -> fleet::Result<BTreeMap<String, fleet::control::KeyFigures>> {
    let limits = s.pauses.key_limits();
    let figures = s
        .store
        .key_figures(limits.keys.keys().cloned(), now)
        .await?;
    let (top, other) = top_keys(&figures, s.cfg.key_metrics_top);
    let mut now_shown = BTreeSet::new();
    for (key, f) in &top {
        metrics::gauge!(m::KEY_RUNNING, "key" => key.clone()).set(f.running as f64);
        metrics::gauge!(m::KEY_WAITING, "key" => key.clone()).set(f.waiting as f64);
        if let Some(max) = limits.for_key(key).max_running {
            metrics::gauge!(m::KEY_MAX_RUNNING, "key" => key.clone()).set(f64::from(max));
        }
        now_shown.insert(key.clone());
    }
    if let Some((running, waiting)) = other {
        metrics::gauge!(m::KEY_RUNNING, "key" => OTHER_KEY).set(running as f64);
        metrics::gauge!(m::KEY_WAITING, "key" => OTHER_KEY).set(waiting as f64);
        now_shown.insert(OTHER_KEY.to_string());
    }
    for gone in shown.difference(&now_shown) {
        metrics::gauge!(m::KEY_RUNNING, "key" => gone.clone()).set(0.0);
        metrics::gauge!(m::KEY_WAITING, "key" => gone.clone()).set(0.0);
    }
    *shown = now_shown;
    // Keys idle past FLEET_KEY_FORGET_MS leave the hash this loop reads every second.
    let idle_since =
        now.saturating_sub(i64::try_from(s.cfg.key_forget.as_millis()).unwrap_or(i64::MAX));
    match s
        .store
        .forget_idle_keys(&figures, idle_since, FORGET_PER_TICK)
        .await
    {
        Ok((0, _)) => {}
        Ok((keys, lapsed)) => {
            // Leases that lapsed unseen (a crash's leftovers) count where reserve.lua's do.
            metrics::counter!(m::KEY_SLOTS_RECLAIMED).increment(lapsed);
            tracing::debug!(keys, lapsed, "forgot idle fairness keys");
        }
        Err(e) => tracing::debug!(error = %e, "forgetting idle keys failed"),
    }
    Ok(figures)
}

/// Most idle keys forgotten per stats tick (one script call; the rest go at the next ticks).
const FORGET_PER_TICK: usize = 500;

/// The label value of the keys summed together beyond the top N.
pub const OTHER_KEY: &str = "other";

/// The keys shown one by one with their figures, and the (running, waiting) sums of the rest.
type TopKeys = (
    Vec<(String, fleet::control::KeyFigures)>,
    Option<(u64, u64)>,
);

/// The `n` keys with the most tasks waiting (then by name), and the (running, waiting) sums
/// of the rest when there is a rest.
fn top_keys(figures: &BTreeMap<String, fleet::control::KeyFigures>, n: usize) -> TopKeys {
    let mut all: Vec<_> = figures.iter().collect();
    all.sort_by(|a, b| b.1.waiting.cmp(&a.1.waiting).then_with(|| a.0.cmp(b.0)));
    let rest = all.split_off(n.min(all.len()));
    let top = all
        .into_iter()
        .map(|(k, f)| (k.clone(), f.clone()))
        .collect();
    let other = (!rest.is_empty()).then(|| {
        rest.iter()
            .fold((0, 0), |(r, w), (_, f)| (r + f.running, w + f.waiting))
    });
    (top, other)
}

async fn sample(s: &Session, view: &FleetView, board: &GroupBoard) -> fleet::Result<()> {
    let n = &s.names;
    let mut queues = vec![n.dead_queue(), n.delayed_queue()];
    queues.extend(Lane::ALL.iter().map(|l| n.ingress_queue(*l)));
    for q in &queues {
        if let Some(depth) = view.depth(q) {
            metrics::gauge!(m::QUEUE_DEPTH, "queue" => q.clone()).set(f64::from(depth));
        }
    }
    let groups = &view.groups;
    // Redis time: the reservations' expiries below are stamped in it (a skewed scheduler clock
    // would shift every age, or clamp it to 0).
    let now = s.store.clock.now_ms();
    let lease = s.cfg.reservation_lease.as_millis() as i64;
    let mut seen = HashMap::with_capacity(groups.len());
    let pauses = s.pauses.current();
    // Tasks held for paused kinds and batches, per hold (both lanes), for `GET /v1/pauses`.
    let mut held = HashMap::new();
    for hold in pauses.holds() {
        let Some(g) = crate::pause::hold_group(hold) else {
            continue;
        };
        let mut count = 0u64;
        for lane in Lane::ALL {
            let q = n.park_queue(&g, lane);
            if let Some(depth) = view.depth(&q) {
                metrics::gauge!(m::QUEUE_DEPTH, "queue" => q).set(f64::from(depth));
                count += u64::from(depth);
            }
        }
        held.insert(hold.clone(), count);
    }
    s.pauses.set_held(held);
    for g in groups {
        let mut gs = GroupSample::default();
        gs.paused_lanes = pauses.paused_lanes(&g.group);
        gs.paused = !gs.paused_lanes.is_empty();
        metrics::gauge!(m::GROUP_PAUSED, "group" => g.group.clone()).set(if gs.paused {
            1.0
        } else {
            0.0
        });
        metrics::gauge!(m::GROUP_CAPACITY, "group" => g.group.clone()).set(f64::from(g.capacity));
        metrics::gauge!(m::GROUP_LOAD, "group" => g.group.clone()).set(f64::from(g.load));
        metrics::gauge!(m::GROUP_RESERVED, "group" => g.group.clone()).set(f64::from(g.reserved));
        for lane in Lane::ALL {
            metrics::gauge!(m::QUEUE_BOUND, "queue" => n.park_queue(&g.group, lane))
                .set(f64::from(s.cfg.common.park_max[lane]));
        }
        let mut backlog = 0u32;
        for lane in Lane::ALL {
            let mut queued = 0u32;
            for q in n.group_shard_queues(&g.group, lane, s.cfg.common.shards(lane)) {
                if let Some(depth) = view.depth(&q) {
                    metrics::gauge!(m::QUEUE_DEPTH, "queue" => q).set(f64::from(depth));
                    backlog += depth;
                    queued += depth;
                }
            }
            *(if lane == Lane::Normal {
                &mut gs.queued
            } else {
                &mut gs.queued_critical
            }) = queued;
            // A park queue not declared yet (or deleted with its reclaimed group) holds nothing.
            let park = n.park_queue(&g.group, lane);
            let mut depth = view.depth(&park).unwrap_or(0);
            metrics::gauge!(m::QUEUE_DEPTH, "queue" => park).set(f64::from(depth));
            // What this replica's release loop holds (unacked: in no ready count) waits too.
            depth += s.parks_held.get(&g.group, lane);
            // Keyed tasks waiting in the group's fair park queues (normal lane).
            if lane == Lane::Normal {
                for q in 0..s.cfg.common.fair_queues {
                    let fq = n.park_queue(&fleet::Names::fair_group(&g.group, q), lane);
                    if let Some(fd) = view.depth(&fq) {
                        metrics::gauge!(m::QUEUE_DEPTH, "queue" => fq).set(f64::from(fd));
                        depth += fd;
                    }
                }
            }
            if gs.paused_lanes.contains(&lane) {
                gs.backlog_paused += depth;
            } else {
                backlog += depth;
            }
            *(if lane == Lane::Normal {
                &mut gs.parked
            } else {
                &mut gs.parked_critical
            }) = depth;
        }
        metrics::gauge!(m::GROUP_BACKLOG, "group" => g.group.clone()).set(f64::from(backlog));
        metrics::gauge!(m::GROUP_BACKLOG_PAUSED, "group" => g.group.clone())
            .set(f64::from(gs.backlog_paused));
        // Oldest reservation not yet started: its lease expiry minus the lease is when it was
        // dispatched. Parked tasks are older still; their age is bounded below by this.
        let oldest = s
            .store
            .oldest_reservation(&g.group, Lane::Normal)
            .await
            .ok()
            .flatten();
        let age = oldest
            .map(|(_, exp)| ((now - (exp - lease)).max(0) as f64) / 1000.0)
            .unwrap_or(0.0);
        let age = if backlog == 0 { 0.0 } else { age };
        metrics::gauge!(m::GROUP_OLDEST_AGE, "group" => g.group.clone()).set(age);
        gs.backlog = backlog;
        gs.oldest_task_age_seconds = age;
        gs.sampled_at = fleet::status::rfc3339_ms(now);
        seen.insert(g.group.clone(), gs);
    }
    *board.write().await = seen;
    let workers = s.store.workers().await?;
    let mut by_state: BTreeMap<&str, u32> = [("active", 0), ("draining", 0), ("ejected", 0)]
        .into_iter()
        .collect();
    for w in &workers {
        if let Some(c) = by_state.get_mut(w.state.as_str()) {
            *c += 1;
        }
    }
    for (state, count) in by_state {
        metrics::gauge!(m::WORKERS, "state" => state).set(f64::from(count));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use fleet::control::KeyFigures;

    #[test]
    fn the_top_keys_by_waiting_and_the_rest_summed() {
        let f = |running, waiting| KeyFigures {
            running,
            waiting,
            ..Default::default()
        };
        let figures: BTreeMap<String, KeyFigures> = [
            ("a", f(1, 5)),
            ("b", f(2, 9)),
            ("c", f(3, 5)),
            ("d", f(4, 0)),
            ("e", f(5, 1)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
        let (top, other) = top_keys(&figures, 2);
        let names: Vec<_> = top.iter().map(|t| t.0.as_str()).collect();
        assert_eq!(names, ["b", "a"], "by waiting, then by name");
        assert_eq!(other, Some((3 + 4 + 5, 5 + 1)));
        let (top, other) = top_keys(&figures, 20);
        assert_eq!((top.len(), other), (5, None));
    }
}
