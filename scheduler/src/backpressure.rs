//! Admission control: Green / Yellow / Red from two live signals.
//!
//! * **pending** — normal-lane ingress backlog + parked tasks + reserved-not-started, against
//!   `max_pending` (yellow at 0.7, red at 0.9 by default): work accepted but not yet running.
//! * **load** — running tasks over capacity across the fleet (yellow 0.68, red 0.85): how busy
//!   the workers are.
//!
//! Either signal at red makes Red. Green dispatches freely; Yellow waits the throttle delay
//! between dispatch batches (so throughput falls smoothly before anything is refused); Red
//! stops taking normal-lane work from ingress — it stays in the broker, the bounded ingress
//! fills and producers are refused — and is rechecked every `red_recheck`. The critical lane
//! is never gated by these signals. (The reference design computed a load signal but never fed
//! it; here both are computed from every [fleet view](crate::view), sampled every
//! `pressure_interval` from Redis and the broker.)
//!
//! **The intake gate answers "workers are behind", not fleet's own bookkeeping.** The published
//! state (metric, API) counts everything as the design says, but the gate that paces and pauses
//! intake is computed from the work that waits *beyond* what the groups are draining: tasks
//! parked (no matching group has room), tasks waiting for a matching worker, and tasks in a
//! group's queue beyond its room (`behind`: a task only one group can take is dispatched
//! straight to that group's queue even past its room — see `reserve.lua`'s direct dispatch —
//! so its excess is counted there, read from the broker's queue depth). A group's room
//! follows what it drains (Little's law: completion rate × `FLEET_TARGET_QUEUE_MS`, at least
//! `capacity × (1 + backlog_factor)`; see [`room_for`]; a group with no completion measured
//! yet starts at [`SEED_FACTOR`] × that floor, and an idle group keeps its last rate), so work
//! within the room is by construction work the workers will start within the target time — it
//! never drives the gate, and neither does load alone: a busy worker is the point, a worker
//! with a queue beyond its room is behind.
//! The ingress backlog is left out too: a pause cannot shrink it, so a gate that counted it
//! would hold itself Red forever once producers had queued `0.9 × max_pending` tasks.
//! Yellow slows dispatch in proportion to how far into Yellow the gate is (up to the throttle
//! delay per batch); Red pauses normal intake until the gate leaves Red (watched, not polled).
//! Once Red, the gate stays Red until its count falls below the yellow threshold
//! (hysteresis: a burst does not flap the intake channel open and shut).

use std::sync::Arc;

use fleet::registry::GroupView;
use fleet::{Lane, PerLane, Store};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::config::SchedulerConfig;
use crate::session::Session;
use crate::view::ViewRx;

/// The pressure state; the discriminant is the `fleet_pressure_state` value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pressure {
    #[default]
    Green = 0,
    Yellow = 1,
    Red = 2,
}

/// Thresholds of the controller.
#[derive(Debug, Clone, Copy)]
pub struct Thresholds {
    pub max_pending: u32,
    pub pending_yellow: f64,
    pub pending_red: f64,
    pub load_yellow: f64,
    pub load_red: f64,
}

impl Thresholds {
    pub fn from_config(c: &SchedulerConfig) -> Self {
        Thresholds {
            max_pending: c.max_pending,
            pending_yellow: c.pending_yellow,
            pending_red: c.pending_red,
            load_yellow: c.load_yellow,
            load_red: c.load_red,
        }
    }

    /// The state for a pending count and a load ratio (running / capacity).
    pub fn evaluate(&self, pending: u64, load: f64) -> Pressure {
        let p = pending as f64 / f64::from(self.max_pending.max(1));
        let by_pending = if p >= self.pending_red {
            Pressure::Red
        } else if p >= self.pending_yellow {
            Pressure::Yellow
        } else {
            Pressure::Green
        };
        let by_load = if load >= self.load_red {
            Pressure::Red
        } else if load >= self.load_yellow {
            Pressure::Yellow
        } else {
            Pressure::Green
        };
        by_pending.max(by_load)
    }
}

/// One sample of the signals, as the API shows it.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Sample {
    pub state: Pressure,
    /// The intake gate: the same evaluation without the ingress backlog (see module docs).
    pub gate: Pressure,
    pub pending: u64,
    pub ingress_backlog: u64,
    pub parked: u64,
    /// Tasks in group queues beyond each group's room (summed over groups; normal lane).
    pub behind: u64,
    pub reserved: u64,
    pub running: u64,
    pub capacity: u64,
    pub load: f64,
    /// When this sample was taken (this process's clock, ms since the Unix epoch); 0 before
    /// the first. The API shows its age and calls it stale when no sample came for a while.
    pub sampled_at_ms: i64,
}

/// Computes the signals from group views and queue depths (`parked` includes the tasks
/// waiting for a matching worker; `behind` is [`behind`] summed over the groups).
pub fn sample(
    t: &Thresholds,
    groups: &[GroupView],
    ingress_backlog: u64,
    parked: u64,
    behind: u64,
) -> Sample {
    let reserved: u64 = groups.iter().map(|g| u64::from(g.reserved)).sum();
    let running: u64 = groups.iter().map(|g| u64::from(g.load)).sum();
    let capacity: u64 = groups.iter().map(|g| u64::from(g.capacity)).sum();
    let load = if capacity == 0 {
        0.0
    } else {
        running as f64 / capacity as f64
    };
    let pending = ingress_backlog + parked + reserved;
    let gate = t.evaluate(parked + behind, 0.0);
    Sample {
        state: t.evaluate(pending, load),
        gate,
        pending,
        ingress_backlog,
        parked,
        behind,
        reserved,
        running,
        capacity,
        load,
        sampled_at_ms: fleet::store::now_ms(),
    }
}

/// Tasks of one group beyond its room: what waits in its queue (`queued`, the broker's ready
/// count) plus what runs, less the room (tasks). Broker depth, not the reservation count: a
/// reservation's lease may lapse while its task still waits.
pub fn behind(queued: u64, running: u64, room: u64) -> u64 {
    (queued + running).saturating_sub(room)
}

/// How far into Yellow the gate's count (parked + behind) is, in `[0, 1]` (0 at the yellow
/// threshold, 1 at red): Yellow waits this fraction of the throttle delay between batches.
pub fn yellow_depth(t: &Thresholds, waiting: u64) -> f64 {
    let p = waiting as f64 / f64::from(t.max_pending.max(1));
    ((p - t.pending_yellow) / (t.pending_red - t.pending_yellow).max(f64::EPSILON)).clamp(0.0, 1.0)
}

/// A group's room ahead of its workers (Little's law, L = λ·W): what it completes per second
/// times the target time a task may queue, and never less than `capacity × (1 + backlog_factor)`
/// — deep for many tiny tasks, shallow for long ones, with no knob to tune per workload.
pub fn room_for(
    capacity: u32,
    backlog_factor: f64,
    completions_per_s: f64,
    target: std::time::Duration,
) -> u64 {
    let floor = (f64::from(capacity) * (1.0 + backlog_factor)).ceil();
    floor.max(completions_per_s * target.as_secs_f64()).round() as u64
}

/// The room of a group whose completion rate is not measured yet, as a multiple of the floor
/// `capacity × (1 + backlog_factor)`: a first burst takes this much before anything parks
/// (as TCP's initial window, RFC 6928: start with a few segments' worth rather than one,
/// then follow what is measured).
pub const SEED_FACTOR: f64 = 4.0;

/// [`room_for`] with the seed: `None` = no completion measured yet.
pub fn room_seeded(
    capacity: u32,
    backlog_factor: f64,
    completions_per_s: Option<f64>,
    target: std::time::Duration,
) -> u64 {
    match completions_per_s {
        Some(r) => room_for(capacity, backlog_factor, r, target),
        None => (f64::from(capacity) * (1.0 + backlog_factor) * SEED_FACTOR).ceil() as u64,
    }
}

/// Computes the signals from every new [fleet view](crate::view) (sampled every
/// `pressure_interval`, or more often when another reader of the view needs it) and publishes
/// the state on a watch channel. Groups and queue depths come from the view; the completion
/// counters (`Rates`) are read from Redis here, when the view arrives. No new view (Redis
/// unreadable) means no new sample: the last state stands.
pub struct Controller {
    pub session: Arc<Session>,
    pub view: ViewRx,
    pub tx: watch::Sender<Sample>,
}

impl Controller {
    pub async fn run(mut self, shutdown: CancellationToken) {
        let cfg = self.session.cfg.clone();
        let t = Thresholds::from_config(&cfg);
        let names = &self.session.names;
        let mut rates = Rates::default();
        let mut last = None;
        loop {
            // The next view (the loop's tick): `None` at shutdown; an error when the view loop
            // is gone, which ends the session.
            let view = match self.view.after(last, &shutdown).await {
                Ok(Some(v)) => v,
                Ok(None) | Err(_) => break,
            };
            last = Some(view.sampled_at);
            let groups = &view.groups;
            let rooms = rates.update(&cfg, &self.session.store, groups).await;
            let ingress = view.depth(&names.ingress_queue(Lane::Normal)).unwrap_or(0);
            let mut parked = 0u64;
            let mut behind_total = 0u64;
            // Tasks waiting for a matching worker count too: they are pending, and once enough
            // wait the gate turns Red and producers are refused. A park queue not declared yet
            // holds nothing.
            let waiting = std::iter::once(crate::dispatch::UNMATCHED);
            for g in groups.iter().map(|g| g.group.as_str()).chain(waiting) {
                parked += u64::from(view.depth(&names.park_queue(g, Lane::Normal)).unwrap_or(0));
            }
            for g in groups {
                let room = rooms.get(&g.group).copied().unwrap_or_else(|| {
                    room_seeded(g.capacity, cfg.backlog_factor, None, cfg.target_queue)
                });
                // Every shard of the group's normal lane (one queue when unsharded). A queue
                // that is not declared yet holds nothing.
                let queued: u64 = names
                    .group_shard_queues(&g.group, Lane::Normal, cfg.common.shards(Lane::Normal))
                    .iter()
                    .map(|q| u64::from(view.depth(q).unwrap_or(0)))
                    .sum();
                behind_total += behind(queued, u64::from(g.load), room);
            }
            let mut s = sample(&t, groups, u64::from(ingress), parked, behind_total);
            // Hysteresis (a thermostat's): once Red, the gate stays Red until the count falls
            // below the yellow threshold — reopening at the first sample under red would flap
            // intake open and shut under a burst, each closing handing a full prefetch back to
            // the broker, while the work beyond the rooms still keeps the workers busy.
            if self.tx.borrow().gate == Pressure::Red && s.gate == Pressure::Yellow {
                s.gate = Pressure::Red;
            }
            let old = self.tx.borrow().state;
            if old != s.state {
                tracing::info!(from = ?old, to = ?s.state, pending = s.pending, load = s.load, "pressure changed");
            }
            metrics::gauge!(fleet::metrics::PRESSURE_STATE).set(s.state as u8 as f64);
            metrics::gauge!(fleet::metrics::PENDING).set(s.pending as f64);
            self.tx.send_replace(s);
        }
    }
}

/// Completion rates per group and lane (EWMA over the pressure ticks), and the rooms they set.
/// A rate is `None` until the group's first completions are measured (its room is seeded);
/// the first measurement is taken as it is, later ones are averaged; an interval with no
/// completions and nothing running or reserved keeps the last rate (an idle group can still
/// drain what it drained before: its room does not decay to the floor between bursts).
#[derive(Default)]
struct Rates {
    last: std::collections::HashMap<String, (PerLane<u64>, std::time::Instant)>,
    rate: std::collections::HashMap<String, PerLane<Option<f64>>>,
}

impl Rates {
    /// Weight of the newest interval in the rate average.
    const ALPHA: f64 = 0.5;

    /// Measures, writes every group's rooms to Redis, and returns the normal-lane rooms.
    async fn update(
        &mut self,
        cfg: &SchedulerConfig,
        store: &Store,
        groups: &[GroupView],
    ) -> std::collections::HashMap<String, u64> {
        let mut normal = std::collections::HashMap::new();
        let names: Vec<String> = groups.iter().map(|g| g.group.clone()).collect();
        // Groups that are gone (reclaimed, see crate::reclaim) are forgotten: memory stays
        // bounded by the live groups, and a group that comes back starts from a seeded room.
        let live: std::collections::HashSet<&str> = names.iter().map(String::as_str).collect();
        self.rate.retain(|g, _| live.contains(g.as_str()));
        self.last.retain(|g, _| live.contains(g.as_str()));
        let Ok(done) = store.group_completions(&names).await else {
            return normal;
        };
        let now = std::time::Instant::now();
        let mut rooms = Vec::with_capacity(groups.len() * 2);
        for (g, counts) in groups.iter().zip(done) {
            let rate = self.rate.entry(g.group.clone()).or_default();
            if let Some((before, at)) = self.last.get(&g.group) {
                let secs = now.duration_since(*at).as_secs_f64().max(1e-3);
                let busy = g.in_flight().map(|n| n > 0);
                for lane in Lane::ALL {
                    let n = counts[lane].saturating_sub(before[lane]);
                    let r = n as f64 / secs;
                    rate[lane] = match rate[lane] {
                        None if n > 0 => Some(r),
                        None => None,
                        Some(old) if n == 0 && !busy[lane] => Some(old),
                        Some(old) => Some(Self::ALPHA * r + (1.0 - Self::ALPHA) * old),
                    };
                }
            }
            self.last.insert(g.group.clone(), (counts, now));
            for (lane, cap) in g.capacities().iter() {
                let room = room_seeded(*cap, cfg.backlog_factor, rate[lane], cfg.target_queue);
                if lane == Lane::Normal {
                    normal.insert(g.group.clone(), room);
                }
                rooms.push((g.group.clone(), lane, room));
            }
        }
        if let Err(e) = store.set_rooms(&rooms).await {
            tracing::debug!(error = %e, "cannot set group rooms");
        }
        normal
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t() -> Thresholds {
        Thresholds {
            max_pending: 1000,
            pending_yellow: 0.7,
            pending_red: 0.9,
            load_yellow: 0.68,
            load_red: 0.85,
        }
    }

    #[test]
    fn pressure_table() {
        let t = t();
        assert_eq!(t.evaluate(0, 0.0), Pressure::Green);
        assert_eq!(t.evaluate(699, 0.0), Pressure::Green);
        assert_eq!(t.evaluate(700, 0.0), Pressure::Yellow);
        assert_eq!(t.evaluate(899, 0.0), Pressure::Yellow);
        assert_eq!(t.evaluate(900, 0.0), Pressure::Red);
        assert_eq!(t.evaluate(0, 0.67), Pressure::Green);
        assert_eq!(t.evaluate(0, 0.68), Pressure::Yellow);
        assert_eq!(t.evaluate(0, 0.85), Pressure::Red);
        // Either signal at red makes Red; the worse of the two wins.
        assert_eq!(t.evaluate(700, 0.85), Pressure::Red);
        assert_eq!(t.evaluate(900, 0.1), Pressure::Red);
        assert_eq!(t.evaluate(700, 0.68), Pressure::Yellow);
        assert_eq!(t.evaluate(100, 0.68), Pressure::Yellow);
    }

    #[test]
    fn sample_sums_groups() {
        let g = |cap, load, resv| GroupView {
            group: "g".into(),
            labels: serde_json::Value::Null,
            workers: 1,
            capacity: cap,
            critical_capacity: 1,
            load,
            reserved: resv,
            critical_load: 0,
            critical_reserved: 0,
        };
        let s = sample(&t(), &[g(10, 9, 5), g(10, 8, 5)], 600, 100, 0);
        assert_eq!(s.pending, 710);
        assert_eq!(s.capacity, 20);
        assert!((s.load - 0.85).abs() < 1e-9);
        assert_eq!(s.state, Pressure::Red);
        // A large ingress backlog alone makes the state Red but does not close the gate.
        let s = sample(&t(), &[g(10, 1, 0)], 950, 0, 0);
        assert_eq!((s.state, s.gate), (Pressure::Red, Pressure::Green));
        // Busy workers with their room filled are not behind: only work beyond the room is.
        let s = sample(&t(), &[g(10, 10, 10)], 0, 0, 0);
        assert_eq!((s.state, s.gate), (Pressure::Red, Pressure::Green));
        let s = sample(&t(), &[g(10, 10, 10)], 0, 900, 0);
        assert_eq!(s.gate, Pressure::Red);
        // Tasks dispatched straight to a group's queue beyond its room close it too.
        let s = sample(&t(), &[g(10, 10, 0)], 0, 400, behind(510, 10, 20));
        assert_eq!((s.behind, s.gate), (500, Pressure::Red));
        assert_eq!(behind(5, 10, 20), 0, "within the room: not behind");
    }

    #[test]
    fn room_follows_the_drain_rate() {
        let w = std::time::Duration::from_secs(1);
        assert_eq!(
            room_for(8, 1.0, 0.0, w),
            16,
            "never below capacity × (1 + backlog_factor)"
        );
        assert_eq!(
            room_for(8, 1.0, 40.0, w),
            40,
            "200 ms tasks on 8 slots: one second of work"
        );
        assert_eq!(room_for(256, 1.0, 10_000.0, w), 10_000, "no-op tasks: deep");
        assert_eq!(
            room_seeded(8, 1.0, None, w),
            64,
            "nothing measured yet: SEED_FACTOR × the floor"
        );
        assert_eq!(
            room_seeded(8, 1.0, Some(0.0), w),
            16,
            "measured: Little's law"
        );
        assert_eq!(yellow_depth(&t(), 700), 0.0);
        assert!((yellow_depth(&t(), 800) - 0.5).abs() < 1e-9);
        assert_eq!(yellow_depth(&t(), 5000), 1.0);
    }
}
