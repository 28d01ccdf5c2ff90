//! Admission control: one pressure state, Green / Yellow / Red, that says what intake does.
//!
//! **What each state means** (one definition; the API, the metric `fleet_pressure_state`, the
//! console and the alerts all show this one):
//!
//! * **Green** — intake is open: the work that waits *beyond* what the groups drain is below
//!   `pending_yellow × max_pending` (0.7 by default).
//! * **Yellow** — intake is throttled: that work is at or above the yellow threshold; dispatch
//!   waits part of the throttle delay between batches, in proportion to how far into Yellow it
//!   is (so throughput falls smoothly before anything is refused).
//! * **Red** — intake is closed: that work is at or above `pending_red × max_pending` (0.9);
//!   normal-lane work stays in the broker, the bounded ingress fills and producers are
//!   refused; it is rechecked every `red_recheck` (watched, not polled). The critical lane is
//!   never gated.
//!
//! A fleet at 100 % utilisation with nothing waiting beyond its rooms is Green: busy workers
//! are the point. Utilisation (running / capacity) is reported beside the state as
//! [`LoadLevel`] (`low` below `load_yellow` 0.68, `high` from it, `full` from `load_red` 0.85)
//! and never makes the state (it only lets the dwell give way early on a fleet that has run
//! dry, below), and neither does the ingress backlog (a pause cannot shrink it:
//! a state that counted it would hold itself Red once producers had queued `0.9 ×
//! max_pending` tasks). `pending` (ingress + parked + reserved) is reported as a figure.
//!
//! **The count behind the state** ([`Sample::waiting`]) is the work that waits beyond what
//! the groups are draining: tasks parked (no matching group has room), tasks waiting for a
//! matching worker, and tasks in a group's queue beyond its room (`behind`: a task only one
//! group can take is dispatched straight to that group's queue even past its room — see
//! `reserve.lua`'s direct dispatch — so its excess is counted there, read from the broker's
//! queue depth). A group's `behind` and its parked tasks count in full while its workers are
//! all busy (load ≥ capacity, or no active worker at all), or when it has not drained for the
//! [`stall_window`]; ahead of free slots that drain, only beyond [`AHEAD_ROOMS`] rooms
//! ([`waiting_on_workers`]): up to there a queue or a park ahead of free slots is being
//! drained as fast as the broker delivers and the park release loop moves it, not waiting on
//! workers. Tasks waiting for a matching worker always count. A group's room follows what it drains (Little's law: completion rate ×
//! `FLEET_TARGET_QUEUE_MS`, at least `capacity × (1 + backlog_factor)`; see [`room_for`]; a
//! group with no completion measured yet starts at [`SEED_FACTOR`] × that floor, and an idle
//! group keeps its last rate), so work within the room is by construction work the workers
//! will start within the target time.
//!
//! **Hysteresis** ([`Hold`]), two parts: (1) a band — once Red, the state stays Red until the
//! count falls below the *yellow* threshold (a thermostat's dead band); (2) a minimum dwell —
//! a state gives way to a lower one only after it has held for `pressure_hold`
//! (`FLEET_PRESSURE_HOLD_MS`, 1 s by default: four pressure intervals), while a higher one is entered at once
//! (protection first). This is the asymmetric stabilisation window of Kubernetes' Horizontal
//! Pod Autoscaler (scale up at once, scale down only after the recommendation held for the
//! window; `behavior.scaleDown.stabilizationWindowSeconds`), and a thermostat's minimum
//! on/off time: without it a burst flapped the state (and the intake channel, each closing
//! handing a full prefetch back to the broker) ten times in 3.2 s. The dwell gives way early
//! in one case: the fleet has **run dry** ([`Sample::dry`]) — nothing counted as waiting,
//! nothing parked (paused lanes aside), no group queue holding more than its room, and the
//! workers with headroom (load below `load_yellow`). A closed intake then only idles the
//! workers while the ingress holds work: the benchmark's 10-group burst dropped from 1,826
//! waiting to 0 in one interval, and its fleet drained its parks and sat idle for the rest of
//! the 1 s dwell with 3,823 tasks in the ingress (BENCHMARKS.md round 24). Parks and queues
//! beyond a room do not flicker the way a snapshot of a few-ms task's slots does, so a fleet
//! still working through them keeps the dwell; a flood after the reopening closes the intake
//! again at once.
//!
//! Every sample comes from a [fleet view](crate::view), taken every `pressure_interval` from
//! Redis and the broker.

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

/// The fleet's utilisation band (running / capacity against `load_yellow` and `load_red`):
/// a figure beside the pressure state, never a pressure state (a busy fleet is healthy).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Default, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum LoadLevel {
    #[default]
    Low,
    High,
    Full,
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

    /// The state for a count of tasks waiting beyond the groups' rooms (before hysteresis):
    /// Yellow from `pending_yellow × max_pending`, Red from `pending_red × max_pending`.
    pub fn evaluate(&self, waiting: u64) -> Pressure {
        let p = waiting as f64 / f64::from(self.max_pending.max(1));
        if p >= self.pending_red {
            Pressure::Red
        } else if p >= self.pending_yellow {
            Pressure::Yellow
        } else {
            Pressure::Green
        }
    }

    /// The utilisation band of a load ratio (running / capacity).
    pub fn load_level(&self, load: f64) -> LoadLevel {
        if load >= self.load_red {
            LoadLevel::Full
        } else if load >= self.load_yellow {
            LoadLevel::High
        } else {
            LoadLevel::Low
        }
    }
}

/// One sample of the signals, as the API shows it.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Sample {
    /// The pressure state (see the module docs), after hysteresis ([`Hold`]).
    pub state: Pressure,
    /// The intake gate: the same value as `state` (kept for clients that read it; there is
    /// one state).
    pub gate: Pressure,
    /// When `state` was entered (this process's clock, ms since the Unix epoch).
    pub since_ms: i64,
    /// Tasks waiting beyond what the groups drain — the count the state is computed from:
    /// those waiting for a matching worker, and each group's parked tasks and `behind` as far
    /// as they wait on its workers ([`waiting_on_workers`]).
    pub waiting: u64,
    /// Work accepted and not running: ingress backlog + parked + reserved-not-started (a
    /// figure; it does not make the state).
    pub pending: u64,
    pub ingress_backlog: u64,
    /// Tasks parked, including those waiting for a matching worker (normal lane).
    pub parked: u64,
    /// Tasks in group queues beyond each group's room, in the groups where they wait on the
    /// workers ([`waiting_on_workers`]; summed over groups; normal lane).
    pub behind: u64,
    /// Tasks in the groups' queues beyond their rooms, every group, whether or not they count
    /// in `waiting` (normal lane; a figure of the controller, not shown by the API).
    #[serde(skip)]
    pub beyond_rooms: u64,
    pub reserved: u64,
    pub running: u64,
    pub capacity: u64,
    /// `running / capacity` (0 with no capacity).
    pub load: f64,
    /// The utilisation band of `load` (a figure, not a state).
    pub load_level: LoadLevel,
    /// When this sample was taken (this process's clock, ms since the Unix epoch); 0 before
    /// the first. The API shows its age and calls it stale when no sample came for a while.
    pub sampled_at_ms: i64,
}

/// Tasks queued beyond the groups' rooms ([`behind`]), summed over groups.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Beyond {
    /// Every group's, counted or not.
    pub all: u64,
    /// The part that counts: each group's [`waiting_on_workers`] of it.
    pub counted: u64,
}

/// Computes the signals from group views and queue depths (`parked`: every parked task,
/// including those waiting for a matching worker, paused lanes left out, a figure;
/// `parked_waiting`: the part of it that counts — waiting for a matching worker, plus each
/// group's [`waiting_on_workers`] of its park; `behind`: the tasks queued beyond the rooms).
/// The state is the raw evaluation of `parked_waiting + behind.counted`; [`Hold::apply`] adds
/// the hysteresis.
pub fn sample(
    t: &Thresholds,
    groups: &[GroupView],
    ingress_backlog: u64,
    parked: u64,
    parked_waiting: u64,
    behind: Beyond,
) -> Sample {
    let reserved: u64 = groups.iter().map(|g| u64::from(g.reserved)).sum();
    let running: u64 = groups.iter().map(|g| u64::from(g.load)).sum();
    let capacity: u64 = groups.iter().map(|g| u64::from(g.capacity)).sum();
    let load = if capacity == 0 {
        0.0
    } else {
        running as f64 / capacity as f64
    };
    let waiting = parked_waiting + behind.counted;
    let state = t.evaluate(waiting);
    let now = fleet::redis::now_ms();
    Sample {
        state,
        gate: state,
        since_ms: now,
        waiting,
        pending: ingress_backlog + parked + reserved,
        ingress_backlog,
        parked,
        behind: behind.counted,
        beyond_rooms: behind.all,
        reserved,
        running,
        capacity,
        load,
        load_level: t.load_level(load),
        sampled_at_ms: now,
    }
}

impl Sample {
    /// Whether the fleet has run dry: nothing parked (paused lanes aside) and no group queue
    /// beyond its room — so nothing counts as waiting either, `waiting` being a part of those
    /// two — and the workers below `load_yellow` (running / capacity). Holding the intake
    /// closed then only idles the workers ([`Hold`]).
    pub fn dry(&self, load_yellow: f64) -> bool {
        self.parked == 0 && self.beyond_rooms == 0 && self.load < load_yellow
    }
}

/// The hysteresis of the state (see the module docs): a dead band (Red holds until the count
/// is below the yellow threshold) and a minimum dwell (`hold`: a state gives way to a lower
/// one only after it has held this long, unless the fleet has run dry, [`Sample::dry`]; a
/// higher one is entered at once).
#[derive(Debug, Clone, Copy)]
pub struct Hold {
    /// The minimum dwell.
    pub hold: std::time::Duration,
    /// The load (running / capacity) below which a fleet with nothing waiting has run dry.
    pub load_yellow: f64,
}

impl Hold {
    /// The state to publish: `raw` is the new sample's evaluation, `prev` the last
    /// published sample (`None` before the first). Sets `state`, `gate` and `since_ms`.
    pub fn apply(&self, prev: Option<&Sample>, mut raw: Sample) -> Sample {
        let Some(prev) = prev else { return raw };
        let mut want = raw.state;
        if prev.state == Pressure::Red && want == Pressure::Yellow {
            want = Pressure::Red;
        }
        let held_ms = raw.sampled_at_ms - prev.since_ms;
        if want < prev.state && held_ms < self.hold.as_millis() as i64 && !raw.dry(self.load_yellow)
        {
            want = prev.state;
        }
        raw.state = want;
        raw.gate = want;
        raw.since_ms = if want == prev.state {
            prev.since_ms
        } else {
            raw.sampled_at_ms
        };
        raw
    }
}

/// Whether a group's waiting work (parked, or queued beyond its room) waits on its workers:
/// only while they are all busy (normal-lane load ≥ capacity), or when it has none (capacity
/// 0). Work ahead of free slots is being drained as fast as the broker delivers and the park
/// release loop moves it.
pub fn all_busy(g: &GroupView) -> bool {
    g.load >= g.capacity
}

/// The part of a group's waiting work — its parked tasks, or its tasks queued beyond its room
/// ([`behind`]), normal lane — that waits on its workers, the count the state is computed
/// from (`waiting` and `room` in tasks):
/// - all of it while its workers are all busy ([`all_busy`]) or it has none, or while it does
///   not drain (`draining` false: for the stall window, see [`stall_window`], work waited, its
///   workers had free slots and it completed nothing — its only workers frozen and not
///   evicted yet, reservations a crashed replica holds until their lease lapses);
/// - ahead of free slots that drain, the part beyond [`AHEAD_ROOMS`] rooms: a burst's overflow
///   is what parks are for and is being released as slots free up (counting it closed the
///   benchmark's 10-group burst's intake at load 0.41 for 1.2 s of its 3.2 s, until the fleet
///   stood idle; counting it beyond one room still did), but a park that keeps growing is
///   overload whatever a snapshot of the load says (with tasks of a few ms a saturated
///   group's slots are rarely all leased at one instant: each waits a round trip between two
///   tasks).
pub fn waiting_on_workers(g: &GroupView, waiting: u64, room: u64, draining: bool) -> u64 {
    if all_busy(g) || !draining {
        waiting
    } else {
        waiting.saturating_sub(room.saturating_mul(AHEAD_ROOMS))
    }
}

/// How many rooms of waiting work a group whose slots are free and draining may hold before
/// the rest counts (see [`waiting_on_workers`]): at the default `FLEET_TARGET_QUEUE_MS`, four
/// seconds of what it completes.
pub const AHEAD_ROOMS: u64 = 4;

/// Tasks of one group beyond its room: what waits in its queue (`queued`, the broker's ready
/// count) plus what runs, less the room (tasks). Broker depth, not the reservation count: a
/// reservation's lease may lapse while its task still waits.
pub fn behind(queued: u64, running: u64, room: u64) -> u64 {
    (queued + running).saturating_sub(room)
}

/// How far into Yellow the state's count ([`Sample::waiting`]) is, in `[0, 1]` (0 at the yellow
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
        let hold = Hold {
            hold: cfg.pressure_hold,
            load_yellow: cfg.load_yellow,
        };
        let stall = stall_window(cfg.pressure_interval);
        let mut first = true;
        let mut last = None;
        // Per group: the last sample at which it drained (nothing waiting, its workers all busy,
        // or work completed) — a stall window after it, all of its waiting work counts.
        let mut drained_at: std::collections::HashMap<String, std::time::Instant> =
            std::collections::HashMap::new();
        loop {
            // The next view (the loop's tick): `None` at shutdown; an error when the view loop
            // is gone, which ends the session.
            let view = match self.view.after(last, &shutdown).await {
                Ok(Some(v)) => v,
                Ok(None) | Err(_) => break,
            };
            last = Some(view.sampled_at);
            let groups = &view.groups;
            let drain = rates.update(&cfg, &self.session.store, groups).await;
            let rooms = &drain.rooms;
            let ingress = view.depth(&names.ingress_queue(Lane::Normal)).unwrap_or(0);
            let (mut parked, mut parked_counted) = (0u64, 0u64);
            let mut beyond_rooms = Beyond::default();
            // A park queue not declared yet holds nothing.
            let park_depth =
                |g: &str| u64::from(view.depth(&names.park_queue(g, Lane::Normal)).unwrap_or(0));
            // A paused lane's parked tasks are not "workers behind" (nor are the tasks held for a
            // paused kind, in no group's park queue): they must not close the intake for
            // everyone else.
            let pauses = self.session.pauses.current();
            // Tasks waiting for a matching worker always count: they are pending, and once
            // enough wait the gate turns Red and producers are refused.
            if !pauses.lane_paused(crate::park::UNMATCHED, Lane::Normal) {
                let n = park_depth(crate::park::UNMATCHED);
                parked += n;
                parked_counted += n;
            }
            let now = std::time::Instant::now();
            let live: std::collections::HashSet<&str> =
                groups.iter().map(|g| g.group.as_str()).collect();
            drained_at.retain(|g, _| live.contains(g.as_str()));
            for g in groups {
                let room = rooms.get(&g.group).copied().unwrap_or_else(|| {
                    room_seeded(g.capacity, cfg.backlog_factor, None, cfg.target_queue)
                });
                let park = if pauses.lane_paused(&g.group, Lane::Normal) {
                    0
                } else {
                    park_depth(&g.group)
                };
                parked += park;
                // Every shard of the group's normal lane (one queue when unsharded). A queue
                // that is not declared yet holds nothing.
                let queued: u64 = names
                    .group_shard_queues(&g.group, Lane::Normal, cfg.common.shards(Lane::Normal))
                    .iter()
                    .map(|q| u64::from(view.depth(q).unwrap_or(0)))
                    .sum();
                let beyond = behind(queued, u64::from(g.load), room);
                // Drained at this sample: nothing waits, its workers are all busy, or it
                // completed work since the last one.
                if (park == 0 && beyond == 0) || all_busy(g) || drain.completed.contains(&g.group) {
                    drained_at.insert(g.group.clone(), now);
                }
                let at = *drained_at.entry(g.group.clone()).or_insert(now);
                let draining = now.duration_since(at) < stall;
                // Ahead of free slots that drain, a park or a backlog is being drained as fast as
                // the broker delivers: counting it closed the intake on bursts (the 20k burst
                // read Red at load 0.00; the 10-group burst stood idle for 1.2 s of 3.2 s).
                parked_counted += waiting_on_workers(g, park, room, draining);
                beyond_rooms.all += beyond;
                beyond_rooms.counted += waiting_on_workers(g, beyond, room, draining);
            }
            let raw = sample(
                &t,
                groups,
                u64::from(ingress),
                parked,
                parked_counted,
                beyond_rooms,
            );
            let prev = (!first).then(|| *self.tx.borrow());
            first = false;
            let s = hold.apply(prev.as_ref(), raw);
            let old = self.tx.borrow().state;
            if old != s.state {
                tracing::info!(from = ?old, to = ?s.state, waiting = s.waiting, load = s.load, "pressure changed");
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

    /// Measures, writes every group's rooms to Redis, and returns the normal-lane rooms and
    /// which groups drain ([`Drain`]).
    async fn update(
        &mut self,
        cfg: &SchedulerConfig,
        store: &Store,
        groups: &[GroupView],
    ) -> Drain {
        let mut normal = std::collections::HashMap::new();
        let mut completed = std::collections::HashSet::new();
        let names: Vec<String> = groups.iter().map(|g| g.group.clone()).collect();
        // Groups that are gone (reclaimed, see crate::reclaim) are forgotten: memory stays
        // bounded by the live groups, and a group that comes back starts from a seeded room.
        let live: std::collections::HashSet<&str> = names.iter().map(String::as_str).collect();
        self.rate.retain(|g, _| live.contains(g.as_str()));
        self.last.retain(|g, _| live.contains(g.as_str()));
        let Ok(done) = store.group_completions(&names).await else {
            return Drain {
                rooms: normal,
                completed,
            };
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
                    if lane == Lane::Normal && n > 0 {
                        completed.insert(g.group.clone());
                    }
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
        Drain {
            rooms: normal,
            completed,
        }
    }
}

/// What [`Rates::update`] measured: each group's normal-lane room (tasks), and the groups
/// that completed normal-lane work in the interval.
struct Drain {
    rooms: std::collections::HashMap<String, u64>,
    completed: std::collections::HashSet<String>,
}

/// How long a group may hold waiting work (parked, or queued beyond its room) while its
/// workers have free slots and it completes nothing before all of that work counts (see
/// [`waiting_on_workers`]): 2 s, and at least four pressure intervals (`pressure_interval`),
/// so a burst's first samples, taken before any of its tasks completed, do not count it.
/// Free slots are filled within a dispatch round trip, so a group whose slots stay free this
/// long with work waiting for it and nothing completing takes nothing.
pub fn stall_window(pressure_interval: std::time::Duration) -> std::time::Duration {
    DRAIN_STALL.max(pressure_interval * 4)
}

/// The least [`stall_window`].
pub const DRAIN_STALL: std::time::Duration = std::time::Duration::from_secs(2);

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
        assert_eq!(t.evaluate(0), Pressure::Green);
        assert_eq!(t.evaluate(699), Pressure::Green);
        assert_eq!(t.evaluate(700), Pressure::Yellow);
        assert_eq!(t.evaluate(899), Pressure::Yellow);
        assert_eq!(t.evaluate(900), Pressure::Red);
        assert_eq!(t.load_level(0.67), LoadLevel::Low);
        assert_eq!(t.load_level(0.68), LoadLevel::High);
        assert_eq!(t.load_level(0.85), LoadLevel::Full);
        assert_eq!(t.load_level(1.0), LoadLevel::Full);
    }

    /// Tasks beyond the rooms, all of them counted.
    fn counted(n: u64) -> Beyond {
        Beyond { all: n, counted: n }
    }

    fn g(cap: u32, load: u32, resv: u32) -> GroupView {
        GroupView {
            group: "g".into(),
            labels: serde_json::Value::Null,
            workers: 1,
            capacity: cap,
            critical_capacity: 1,
            load,
            reserved: resv,
            critical_load: 0,
            critical_reserved: 0,
        }
    }

    #[test]
    fn sample_sums_groups() {
        let s = sample(
            &t(),
            &[g(10, 9, 5), g(10, 8, 5)],
            600,
            100,
            100,
            Beyond::default(),
        );
        assert_eq!(s.pending, 710);
        assert_eq!(s.capacity, 20);
        assert!((s.load - 0.85).abs() < 1e-9);
        // Full utilisation with nothing waiting beyond the rooms is healthy: Green.
        assert_eq!((s.state, s.load_level), (Pressure::Green, LoadLevel::Full));
        // A large ingress backlog alone does not make the state.
        let s = sample(&t(), &[g(10, 1, 0)], 950, 0, 0, Beyond::default());
        assert_eq!((s.state, s.gate), (Pressure::Green, Pressure::Green));
        let s = sample(&t(), &[g(10, 10, 10)], 0, 0, 0, Beyond::default());
        assert_eq!((s.state, s.gate), (Pressure::Green, Pressure::Green));
        let s = sample(&t(), &[g(10, 10, 10)], 0, 900, 900, Beyond::default());
        assert_eq!(
            (s.state, s.gate, s.waiting),
            (Pressure::Red, Pressure::Red, 900)
        );
        // Parked ahead of free slots (the park release loop is moving them): a figure, not
        // waiting.
        let s = sample(&t(), &[g(10, 4, 10)], 0, 900, 0, Beyond::default());
        assert_eq!((s.state, s.parked, s.waiting), (Pressure::Green, 900, 0));
        assert!(!all_busy(&g(10, 4, 10)) && !all_busy(&g(10, 9, 1)));
        assert!(
            all_busy(&g(10, 10, 0)) && all_busy(&g(0, 0, 0)),
            "busy, or no worker"
        );
        // A group's park or backlog: all of it behind busy workers, only beyond four rooms
        // while it drains ahead of free slots, all of it when nothing drains (free slots that
        // take nothing) or with no worker.
        assert_eq!(waiting_on_workers(&g(10, 10, 0), 300, 80, true), 300);
        assert_eq!(waiting_on_workers(&g(10, 4, 10), 300, 80, true), 0);
        assert_eq!(
            waiting_on_workers(&g(10, 4, 10), 3000, 80, true),
            3000 - 80 * AHEAD_ROOMS,
            "a park that keeps growing ahead of free slots counts beyond AHEAD_ROOMS rooms"
        );
        assert_eq!(waiting_on_workers(&g(10, 4, 10), 300, 80, false), 300);
        assert_eq!(waiting_on_workers(&g(0, 0, 0), 300, 80, true), 300);
        let ms = std::time::Duration::from_millis;
        assert_eq!(stall_window(ms(100)), DRAIN_STALL);
        assert_eq!(stall_window(ms(2000)), ms(8000));
        // Tasks dispatched straight to a group's queue beyond its room count too.
        let s = sample(
            &t(),
            &[g(10, 10, 0)],
            0,
            400,
            400,
            counted(behind(510, 10, 20)),
        );
        assert_eq!((s.behind, s.state), (500, Pressure::Red));
        assert_eq!(behind(5, 10, 20), 0, "within the room: not behind");
    }

    #[test]
    fn a_state_holds_its_minimum_time_before_a_lower_one() {
        let hold = Hold {
            hold: std::time::Duration::from_millis(2000),
            load_yellow: 0.68,
        };
        let at = |waiting: u64, ms: i64| {
            let mut s = sample(
                &t(),
                &[g(10, 10, 0)],
                0,
                waiting,
                waiting,
                Beyond::default(),
            );
            s.sampled_at_ms = ms;
            s.since_ms = ms;
            s
        };
        let red = hold.apply(None, at(950, 1000));
        assert_eq!((red.state, red.since_ms), (Pressure::Red, 1000));
        // Below red but not below yellow: the dead band keeps Red.
        let s = hold.apply(Some(&red), at(800, 5000));
        assert_eq!((s.state, s.since_ms), (Pressure::Red, 1000));
        // Green 500 ms after entering Red: held.
        let s = hold.apply(Some(&red), at(0, 1500));
        assert_eq!((s.state, s.since_ms), (Pressure::Red, 1000));
        // Nothing waiting, but the workers busy (load 1.0): still held.
        let s = hold.apply(Some(&s), at(0, 2900));
        assert_eq!((s.state, s.since_ms), (Pressure::Red, 1000));
        // Run dry (nothing waiting, load 0.5 < 0.68) 500 ms after entering Red: released at
        // once — a closed intake would only idle the workers.
        let mut dry = sample(&t(), &[g(10, 5, 0)], 0, 0, 0, Beyond::default());
        (dry.sampled_at_ms, dry.since_ms) = (1500, 1500);
        let d = hold.apply(Some(&red), dry);
        assert_eq!(
            (d.state, d.gate, d.since_ms),
            (Pressure::Green, Pressure::Green, 1500)
        );
        // ... but not with one task still waiting, nor at load_yellow, nor while a park or a
        // queue beyond a room is still being worked through (none of it counted as waiting).
        let mut one = sample(&t(), &[g(10, 5, 0)], 0, 1, 1, Beyond::default());
        (one.sampled_at_ms, one.since_ms) = (1500, 1500);
        assert_eq!(hold.apply(Some(&red), one).state, Pressure::Red);
        let mut parks = sample(&t(), &[g(10, 5, 0)], 0, 1307, 0, Beyond::default());
        (parks.sampled_at_ms, parks.since_ms) = (1500, 1500);
        assert_eq!(
            (parks.waiting, hold.apply(Some(&red), parks).state),
            (0, Pressure::Red)
        );
        let queued = Beyond {
            all: 40,
            counted: 0,
        };
        let mut q = sample(&t(), &[g(10, 5, 0)], 0, 0, 0, queued);
        (q.sampled_at_ms, q.since_ms) = (1500, 1500);
        assert_eq!(
            (q.waiting, hold.apply(Some(&red), q).state),
            (0, Pressure::Red)
        );
        let mut busy = sample(&t(), &[g(100, 68, 0)], 0, 0, 0, Beyond::default());
        (busy.sampled_at_ms, busy.since_ms) = (1500, 1500);
        assert_eq!(hold.apply(Some(&red), busy).state, Pressure::Red);
        // Green once Red held 2 s: released.
        let green = hold.apply(Some(&s), at(0, 3000));
        assert_eq!((green.state, green.since_ms), (Pressure::Green, 3000));
        // A higher state is entered at once.
        let y = hold.apply(Some(&green), at(750, 3100));
        assert_eq!((y.state, y.since_ms), (Pressure::Yellow, 3100));
        let r = hold.apply(Some(&y), at(950, 3200));
        assert_eq!(
            (r.state, r.gate, r.since_ms),
            (Pressure::Red, Pressure::Red, 3200)
        );
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
