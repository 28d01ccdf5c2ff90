//! What an autoscaler reads: `GET /v1/scaling` and the `fleet_scaling_*` gauges.
//!
//! A worker Deployment should grow for work that more workers would run, and only for that.
//! `fleet_group_backlog` counts every waiting task alike; here the backlog of each group and
//! lane is split into **ready** (could run now if there were room) and **blocked**, by cause:
//!
//! * `paused` — the group's lane is paused ([`crate::pause`]), or the task's fairness key is.
//! * `over_key_limit` — its key holds `running + reserved ≥ max_running`.
//! * `rate_limited` — its key has a rate and its token bucket holds less than one token.
//! * `not_yet_due` — it waits in a delay tier (`not_before`, retry backoff). A task in a tier
//!   has not been routed yet, so this cause is fleet-wide: it is reported under
//!   [`UNROUTED`], not under a group.
//!
//! **One definition, one source.** Every figure is computed by the stats loop
//! ([`crate::stats`]) from what it already read on the same tick: the [fleet view]
//! (group queues, park queues, fair park queues, capacity, load, reservations), its
//! [`crate::stats::GroupSample`] (oldest reservation, paused lanes) and its key
//! figures ([`fleet::Store::key_figures`]). `ready + blocked` of a group lane is what
//! `fleet_group_backlog` + `fleet_group_backlog_paused` count for it.
//!
//! **Keys, approximately.** Keyed tasks wait in a group's fair park queues, whose depth is
//! known per group; what is known per key (`waiting`, a Redis counter the park code keeps)
//! is fleet-wide. The waiting tasks of blocked keys are split among the groups in proportion
//! to each group's fair park depth, capped at it ([`apportion`]): exact when one group holds
//! keyed work (the common case), an estimate when several do. Keys are blocked only on the
//! normal lane (fair park queues are normal-lane only).
//!
//! **Rates** are over the last minute (less right after start), from differences of samples
//! kept in memory: `dispatch_rate` is this replica's `fleet_tasks_dispatched_total` (a task
//! published to the group's queue); `submit_rate` of a group lane is the rate tasks were
//! routed to it — dispatched plus the growth of its park backlog (arrivals = departures +
//! growth), never below 0. The top-level `submit_rate` is this replica's
//! `fleet_tasks_submitted_total` (tasks taken from ingress): the signal to wake a Deployment
//! scaled to zero, whose group does not exist while it has no worker. With several replicas
//! each reports its own share of the rates (KEDA reaches one of them; sum them in Prometheus).
//!
//! **Age.** `oldest_ready_age_seconds` is the age of the oldest task dispatched to the group's
//! lane and not started (its reservation), 0 when nothing is ready: parked tasks are older
//! still, so it is a lower bound of the oldest ready task's age.
//!
//! **Not yet due** is the ready count of the delay tier queues (`<ns>.hold.<ms>`) plus the
//! deliveries this replica's tier loops hold (unacked, up to their prefetch per tier:
//! [`crate::tiers::HeldCount`]); what other replicas hold is not counted: a lower bound with
//! several replicas, exact with one.
//!
//! [fleet view]: crate::view

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use fleet::control::{KeyFigures, KeyLimits};
use fleet::{broker::delay, metrics as m, Lane, Names};
use metrics_exporter_prometheus::PrometheusHandle;
use serde::{Deserialize, Serialize};

use crate::session::Session;
use crate::stats::GroupSample;
use crate::view::FleetView;

/// The pseudo-group of the figures no group has yet: tasks in delay tiers (`not_yet_due`) and
/// tasks held for a paused kind (`paused`), in the gauges (with `lane="any"`).
pub const UNROUTED: &str = "_unrouted";

/// How far back the rates look.
pub const RATE_WINDOW: Duration = Duration::from_secs(60);

/// Why a waiting task cannot run now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cause {
    Paused,
    OverKeyLimit,
    NotYetDue,
    RateLimited,
}

impl Cause {
    pub const ALL: [Cause; 4] = [
        Cause::Paused,
        Cause::OverKeyLimit,
        Cause::NotYetDue,
        Cause::RateLimited,
    ];

    /// The word in the API and the `cause` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::Paused => "paused",
            Cause::OverKeyLimit => "over_key_limit",
            Cause::NotYetDue => "not_yet_due",
            Cause::RateLimited => "rate_limited",
        }
    }
}

/// Blocked tasks by cause.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Blocked {
    pub paused: u64,
    pub over_key_limit: u64,
    pub not_yet_due: u64,
    pub rate_limited: u64,
}

impl Blocked {
    pub fn get(&self, c: Cause) -> u64 {
        match c {
            Cause::Paused => self.paused,
            Cause::OverKeyLimit => self.over_key_limit,
            Cause::NotYetDue => self.not_yet_due,
            Cause::RateLimited => self.rate_limited,
        }
    }

    fn get_mut(&mut self, c: Cause) -> &mut u64 {
        match c {
            Cause::Paused => &mut self.paused,
            Cause::OverKeyLimit => &mut self.over_key_limit,
            Cause::NotYetDue => &mut self.not_yet_due,
            Cause::RateLimited => &mut self.rate_limited,
        }
    }

    pub fn total(&self) -> u64 {
        Cause::ALL.iter().map(|c| self.get(*c)).sum()
    }

    fn add(&mut self, o: &Blocked) {
        for c in Cause::ALL {
            *self.get_mut(c) += o.get(c);
        }
    }
}

/// The figures of one group lane (or of a group, summed over its lanes): the flat object of
/// `GET /v1/scaling?group=G&lane=L`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Figures {
    /// Tasks that could run now if there were room.
    pub ready: u64,
    /// Tasks waiting that more workers would not run (`blocked_by` summed).
    pub blocked: u64,
    pub blocked_by: Blocked,
    /// Age of the oldest ready task, in seconds (see the module docs); 0 when none is ready.
    pub oldest_ready_age_seconds: f64,
    /// Tasks routed to the group lane per second over the last minute.
    pub submit_rate: f64,
    /// Tasks dispatched to the group lane's queue per second over the last minute.
    pub dispatch_rate: f64,
    /// Tasks running now.
    pub running: u64,
    /// Tasks dispatched and not started.
    pub reserved: u64,
    /// Slots of the group's active workers in the lane.
    pub capacity: u64,
}

impl Figures {
    fn add(&mut self, o: &Figures) {
        self.ready += o.ready;
        self.blocked += o.blocked;
        self.blocked_by.add(&o.blocked_by);
        self.oldest_ready_age_seconds = self
            .oldest_ready_age_seconds
            .max(o.oldest_ready_age_seconds);
        self.submit_rate += o.submit_rate;
        self.dispatch_rate += o.dispatch_rate;
        self.running += o.running;
        self.reserved += o.reserved;
        self.capacity += o.capacity;
    }
}

/// One group: its lanes summed, and each lane.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct GroupScaling {
    #[serde(flatten)]
    pub total: Figures,
    pub lanes: BTreeMap<&'static str, Figures>,
}

/// One fairness key (fleet-wide: a key's tasks may go to any group).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct KeyScaling {
    /// Its waiting tasks when it is not blocked.
    pub ready: u64,
    /// Its waiting tasks when it is blocked.
    pub blocked: u64,
    /// Why it is blocked (`null`: it is not).
    pub cause: Option<Cause>,
    pub running: u64,
    pub reserved: u64,
    pub max_running: Option<u32>,
    /// Its tasks dispatched per second over the last minute (all replicas: a Redis counter).
    pub dispatch_rate: f64,
}

/// What no group holds yet.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Unrouted {
    /// Tasks in delay tiers (exact with one replica, a lower bound with several: see the
    /// module docs).
    pub not_yet_due: u64,
    /// Tasks held for a paused kind.
    pub paused: u64,
    /// Tasks waiting for a worker that matches them: no live group does (e.g. a Deployment
    /// scaled to zero). Ready for a Deployment whose workers would match. The queue's ready
    /// tasks and those its release loop holds on this replica (a lower bound with several).
    pub unmatched: u64,
}

/// The whole answer of `GET /v1/scaling`.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Scaling {
    /// When the figures were sampled (Redis time, RFC 3339 UTC; one stats tick old at most).
    pub as_of: String,
    /// Tasks taken from ingress per second over the last minute (this replica, both lanes).
    pub submit_rate: f64,
    /// Tasks dispatched per second over the last minute (this replica, every group).
    pub dispatch_rate: f64,
    pub groups: BTreeMap<String, GroupScaling>,
    pub keys: BTreeMap<String, KeyScaling>,
    pub unrouted: Unrouted,
}

/// Why a key's waiting tasks cannot run now, if they cannot: the reservation script's order
/// (`kblocked` in `reserve.lua`): paused, then at its max, then out of tokens.
pub fn key_cause(
    limits: &KeyLimits,
    key: &str,
    f: &KeyFigures,
    paused: bool,
    tokens: Option<f64>,
) -> Option<Cause> {
    let l = limits.for_key(key);
    if paused {
        return Some(Cause::Paused);
    }
    if l.max_running
        .is_some_and(|max| f.running + f.reserved >= u64::from(max))
    {
        return Some(Cause::OverKeyLimit);
    }
    if l.rate.is_some() && tokens.is_some_and(|t| t < 1.0) {
        return Some(Cause::RateLimited);
    }
    None
}

/// The tokens in a key's bucket at `now_ms` (Redis ms), as `reserve.lua` computes them: the
/// stored tokens refilled at `rate` since `ts`, at most `burst`; a key without a bucket holds
/// one token (at most `burst`).
pub fn bucket_tokens(stored: Option<(f64, i64)>, rate: f64, burst: u32, now_ms: i64) -> f64 {
    let burst = f64::from(burst);
    match stored {
        None => 1f64.min(burst),
        Some((tok, ts)) => burst.min(tok + ((now_ms - ts).max(0) as f64) * rate / 1000.0),
    }
}

/// Splits `blocked` (fleet-wide waiting of blocked keys, by cause) among groups in proportion
/// to their fair park depths, each group's share capped at its depth (causes in
/// [`Cause::ALL`] order). Exact when one group has keyed work.
pub fn apportion(fair: &BTreeMap<String, u64>, blocked: &Blocked) -> BTreeMap<String, Blocked> {
    let total: u64 = fair.values().sum();
    fair.iter()
        .map(|(g, depth)| {
            let mut left = *depth;
            let mut b = Blocked::default();
            if total > 0 {
                for c in Cause::ALL {
                    let share = ((u128::from(blocked.get(c)) * u128::from(*depth))
                        / u128::from(total)) as u64;
                    let share = share.min(left);
                    *b.get_mut(c) = share;
                    left -= share;
                }
            }
            (g.clone(), b)
        })
        .collect()
}

/// Samples of counters and levels for rates over [`RATE_WINDOW`].
#[derive(Debug, Default)]
pub struct Window {
    samples: VecDeque<(Instant, HashMap<String, f64>)>,
}

impl Window {
    /// Adds a sample taken at `at`, dropping those older than the window (keeping one at or
    /// beyond its start).
    pub fn push(&mut self, at: Instant, values: HashMap<String, f64>) {
        self.samples.push_back((at, values));
        while self.samples.len() > 2
            && self
                .samples
                .get(1)
                .is_some_and(|(t, _)| at.duration_since(*t) >= RATE_WINDOW)
        {
            self.samples.pop_front();
        }
    }

    /// Increase per second of the counter `id` over the window, reset-aware as Prometheus's
    /// `rate()`: between two samples a fall is a reset to 0, so the increase is the new value
    /// (a key's `dispatched` restarts from 0 when Redis loses it or the key is forgotten,
    /// `FLEET_KEY_FORGET_MS`; a series missing from a sample reads 0). 0 with fewer than two
    /// samples.
    pub fn counter_rate(&self, id: &str) -> f64 {
        let (Some((t0, _)), Some((t1, _))) = (self.samples.front(), self.samples.back()) else {
            return 0.0;
        };
        let dt = t1.duration_since(*t0).as_secs_f64();
        if dt <= 0.0 {
            return 0.0;
        }
        let mut up = 0.0;
        let mut prev: Option<f64> = None;
        for (_, values) in &self.samples {
            let v = values.get(id).copied().unwrap_or(0.0);
            if let Some(p) = prev {
                up += if v >= p { v - p } else { v };
            }
            prev = Some(v);
        }
        up / dt
    }

    /// Change per second of the level `id` between the oldest sample in the window and the
    /// newest (a series missing from the oldest starts at 0); 0 with fewer than two samples.
    pub fn rate(&self, id: &str) -> f64 {
        let (Some((t0, first)), Some((t1, last))) = (self.samples.front(), self.samples.back())
        else {
            return 0.0;
        };
        let dt = t1.duration_since(*t0).as_secs_f64();
        if dt <= 0.0 {
            return 0.0;
        }
        let v1 = last.get(id).copied().unwrap_or(0.0);
        let v0 = first.get(id).copied().unwrap_or(0.0);
        (v1 - v0) / dt
    }
}

/// The last answer and what rates and gauges need between ticks; shared with the API.
#[derive(Clone)]
pub struct Board {
    inner: Arc<Inner>,
}

struct Inner {
    last: Mutex<Arc<Scaling>>,
    window: Mutex<Window>,
    /// The group labels the gauges were last written for (set to 0 when a group is gone).
    shown: Mutex<BTreeSet<String>>,
    handle: Option<PrometheusHandle>,
}

impl Board {
    /// A board reading this process's own counters from `handle` (`None`: rates of 0 from
    /// them, as in unit tests).
    pub fn new(handle: Option<PrometheusHandle>) -> Self {
        Board {
            inner: Arc::new(Inner {
                last: Mutex::new(Arc::default()),
                window: Mutex::default(),
                shown: Mutex::default(),
                handle,
            }),
        }
    }

    /// The last answer.
    pub fn current(&self) -> Arc<Scaling> {
        match self.inner.last.lock() {
            Ok(l) => l.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    fn set(&self, s: Scaling) {
        if let Ok(mut l) = self.inner.last.lock() {
            *l = Arc::new(s);
        }
    }
}

fn rate_id(kind: &str, a: &str, b: &str) -> String {
    format!("{kind}\u{1f}{a}\u{1f}{b}")
}

/// One sample, on the stats loop's tick: `groups` is the stats loop's sample of this tick,
/// `figures` its key figures (as of `now_ms`, Redis time).
pub async fn sample(
    s: &Session,
    view: &FleetView,
    groups: &HashMap<String, GroupSample>,
    figures: &BTreeMap<String, KeyFigures>,
    now_ms: i64,
    board: &Board,
) -> fleet::Result<()> {
    let n = &s.names;
    let pauses = s.pauses.current();
    let limits = s.pauses.key_limits();
    let lease = s.cfg.reservation_lease.as_millis() as i64;

    // Keys: which are blocked, and why (a bucket is read only for a rated key with work).
    let rated: Vec<&String> = figures
        .iter()
        .filter(|(k, f)| f.waiting > 0 && limits.for_key(k).rate.is_some() && !pauses.key_paused(k))
        .map(|(k, _)| k)
        .collect();
    let mut buckets: HashMap<&str, Option<(f64, i64)>> = HashMap::new();
    let names: Vec<&str> = rated.iter().map(|k| k.as_str()).collect();
    for (k, b) in names.iter().zip(s.store.key_buckets(&names).await?) {
        buckets.insert(k, b);
    }

    let mut counters = HashMap::new();
    let page = board.inner.handle.as_ref().map(|h| h.render());
    let own = page.as_deref().map(own_counters).unwrap_or_default();
    for ((group, lane), v) in &own.dispatched {
        counters.insert(rate_id("d", group, lane), *v);
    }
    for (lane, v) in &own.submitted {
        counters.insert(rate_id("s", lane, ""), *v);
    }
    for (k, f) in figures {
        counters.insert(rate_id("k", k, ""), f.dispatched as f64);
    }
    // Park backlog per group lane (a level; its growth is arrivals not dispatched).
    let mut fair: BTreeMap<String, u64> = BTreeMap::new();
    for g in &view.groups {
        let gs = groups.get(&g.group).cloned().unwrap_or_default();
        let mut f = 0u64;
        for q in 0..s.cfg.common.fair_queues {
            let fq = n.park_queue(&Names::fair_group(&g.group, q), Lane::Normal);
            f += u64::from(view.depth(&fq).unwrap_or(0));
        }
        if !gs.paused_lanes.contains(&Lane::Normal) {
            fair.insert(g.group.clone(), f);
        }
        counters.insert(
            rate_id("p", &g.group, Lane::Normal.as_str()),
            f64::from(gs.parked),
        );
        counters.insert(
            rate_id("p", &g.group, Lane::Critical.as_str()),
            f64::from(gs.parked_critical),
        );
    }
    let window = {
        let mut w = match board.inner.window.lock() {
            Ok(w) => w,
            Err(p) => p.into_inner(),
        };
        w.push(Instant::now(), counters);
        std::mem::take(&mut *w)
    };

    let mut out = Scaling {
        as_of: fleet::status::rfc3339_ms(now_ms),
        ..Default::default()
    };
    let mut key_blocked = Blocked::default();
    for (k, f) in figures {
        let tokens = limits.for_key(k).rate.and_then(|(rate, burst)| {
            buckets
                .get(k.as_str())
                .map(|b| bucket_tokens(*b, rate, burst, now_ms))
        });
        let cause = key_cause(&limits, k, f, pauses.key_paused(k), tokens);
        let mut ks = KeyScaling {
            cause,
            running: f.running,
            reserved: f.reserved,
            max_running: limits.for_key(k).max_running,
            dispatch_rate: window.counter_rate(&rate_id("k", k, "")),
            ..Default::default()
        };
        match cause {
            Some(c) => {
                ks.blocked = f.waiting;
                *key_blocked.get_mut(c) += f.waiting;
            }
            None => ks.ready = f.waiting,
        }
        out.keys.insert(k.clone(), ks);
    }
    let by_group = apportion(&fair, &key_blocked);

    for g in &view.groups {
        let gs = groups.get(&g.group).cloned().unwrap_or_default();
        let mut gsc = GroupScaling::default();
        for lane in Lane::ALL {
            let (queued, parked, running, reserved, capacity) = match lane {
                Lane::Normal => (gs.queued, gs.parked, g.load, g.reserved, g.capacity),
                Lane::Critical => (
                    gs.queued_critical,
                    gs.parked_critical,
                    g.critical_load,
                    g.critical_reserved,
                    g.critical_capacity,
                ),
            };
            let mut f = Figures {
                running: u64::from(running),
                reserved: u64::from(reserved),
                capacity: u64::from(capacity),
                ..Default::default()
            };
            // Dispatched tasks run whatever is paused (they left fleet's hands): ready.
            let mut ready = u64::from(queued);
            if gs.paused_lanes.contains(&lane) {
                f.blocked_by.paused = u64::from(parked);
            } else {
                let keyed = match lane {
                    Lane::Normal => by_group.get(&g.group).copied().unwrap_or_default(),
                    Lane::Critical => Blocked::default(),
                };
                f.blocked_by = keyed;
                ready += u64::from(parked).saturating_sub(keyed.total());
            }
            f.ready = ready;
            f.blocked = f.blocked_by.total();
            let oldest = match lane {
                Lane::Normal => Some(gs.oldest_task_age_seconds),
                Lane::Critical if ready > 0 => s
                    .store
                    .oldest_reservation(&g.group, Lane::Critical)
                    .await
                    .ok()
                    .flatten()
                    .map(|(_, exp)| ((now_ms - (exp - lease)).max(0) as f64) / 1000.0),
                Lane::Critical => None,
            };
            f.oldest_ready_age_seconds = if ready == 0 {
                0.0
            } else {
                oldest.unwrap_or(0.0)
            };
            f.dispatch_rate = window.counter_rate(&rate_id("d", &g.group, lane.as_str()));
            f.submit_rate =
                (f.dispatch_rate + window.rate(&rate_id("p", &g.group, lane.as_str()))).max(0.0);
            gsc.total.add(&f);
            gsc.lanes.insert(lane.as_str(), f);
        }
        out.groups.insert(g.group.clone(), gsc);
    }
    out.submit_rate = Lane::ALL
        .iter()
        .map(|l| window.counter_rate(&rate_id("s", l.as_str(), "")))
        .sum();
    out.dispatch_rate = out.groups.values().map(|g| g.total.dispatch_rate).sum();

    // What no group holds.
    // Ready in the waiting-for-worker queue, and held by this replica's loop (unacked).
    out.unrouted.unmatched = u64::from(
        view.depth(&n.park_queue(Names::UNMATCHED_GROUP, Lane::Normal))
            .unwrap_or(0),
    ) + u64::from(s.parks_held.get(Names::UNMATCHED_GROUP, Lane::Normal));
    out.unrouted.paused = s.pauses.held().values().sum();
    out.unrouted.not_yet_due = tier_depths(s).await + s.tiers_held.get();

    // Put the window back (taken out so no lock is held across an await).
    if let Ok(mut w) = board.inner.window.lock() {
        *w = window;
    }
    gauges(&out, board);
    board.set(out);
    Ok(())
}

/// Ready messages in the delay tier queues (passive declares on the session's prober: a tier
/// queue that is missing answers 404, which on the session connection would cost it a channel
/// id every refresh — `fleet::broker::probe`).
async fn tier_depths(s: &Session) -> u64 {
    let mut sum = 0u64;
    for t in delay::tiers() {
        if let Ok(Some(q)) = s.probe.queue(&s.names.delay_queue(t)).await {
            sum += u64::from(q.ready);
        }
    }
    sum
}

fn gauges(s: &Scaling, board: &Board) {
    let mut now_shown = BTreeSet::new();
    for (group, g) in &s.groups {
        for (lane, f) in &g.lanes {
            lane_gauges(group, lane, f);
        }
        now_shown.insert(group.clone());
    }
    let unrouted = Figures {
        blocked_by: Blocked {
            not_yet_due: s.unrouted.not_yet_due,
            paused: s.unrouted.paused,
            ..Default::default()
        },
        ..Default::default()
    };
    lane_gauges(UNROUTED, "any", &unrouted);
    let unmatched = Figures {
        ready: s.unrouted.unmatched,
        ..Default::default()
    };
    lane_gauges(Names::UNMATCHED_GROUP, Lane::Normal.as_str(), &unmatched);
    let mut shown = match board.inner.shown.lock() {
        Ok(s) => s,
        Err(p) => p.into_inner(),
    };
    for gone in shown.difference(&now_shown) {
        for lane in Lane::ALL {
            lane_gauges(gone, lane.as_str(), &Figures::default());
        }
    }
    *shown = now_shown;
}

fn lane_gauges(group: &str, lane: &str, f: &Figures) {
    let (g, l) = (group.to_string(), lane.to_string());
    metrics::gauge!(m::SCALING_READY, "group" => g.clone(), "lane" => l.clone())
        .set(f.ready as f64);
    metrics::gauge!(m::SCALING_OLDEST_READY_AGE, "group" => g.clone(), "lane" => l.clone())
        .set(f.oldest_ready_age_seconds);
    for c in Cause::ALL {
        metrics::gauge!(m::SCALING_BLOCKED, "group" => g.clone(), "lane" => l.clone(), "cause" => c.as_str())
            .set(f.blocked_by.get(c) as f64);
    }
}

/// This process's own counters, from its Prometheus page.
#[derive(Debug, Default, PartialEq)]
struct Own {
    /// `fleet_tasks_dispatched_total` by (group, lane).
    dispatched: BTreeMap<(String, String), f64>,
    /// `fleet_tasks_submitted_total` by lane.
    submitted: BTreeMap<String, f64>,
}

fn own_counters(page: &str) -> Own {
    let mut own = Own::default();
    for line in page.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(v) = value.parse::<f64>() else {
            continue;
        };
        if let Some(labels) = series
            .strip_prefix(m::TASKS_DISPATCHED)
            .and_then(|r| r.strip_prefix('{'))
        {
            let l = labels_of(labels);
            if let (Some(g), Some(lane)) = (l.get("group"), l.get("lane")) {
                *own.dispatched.entry((g.clone(), lane.clone())).or_default() += v;
            }
        } else if let Some(labels) = series
            .strip_prefix(m::TASKS_SUBMITTED)
            .and_then(|r| r.strip_prefix('{'))
        {
            if let Some(lane) = labels_of(labels).get("lane") {
                *own.submitted.entry(lane.clone()).or_default() += v;
            }
        }
    }
    own
}

/// The labels of a series, from the text after its `{` (escapes `\\`, `\"`, `\n` undone).
fn labels_of(text: &str) -> HashMap<String, String> {
    let mut out = HashMap::new();
    let mut rest = text;
    while let Some((name, after)) = rest.split_once("=\"") {
        let name = name.trim_start_matches([',', ' ']).to_string();
        let mut value = String::new();
        let mut chars = after.char_indices();
        let mut end = after.len();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => match chars.next() {
                    Some((_, 'n')) => value.push('\n'),
                    Some((_, e)) => value.push(e),
                    None => {}
                },
                '"' => {
                    end = i + 1;
                    break;
                }
                c => value.push(c),
            }
        }
        out.insert(name, value);
        rest = &after[end..];
        if rest.starts_with('}') {
            break;
        }
    }
    out
}

/// `GET /v1/scaling` (role `read`), its routes with their own state.
pub fn routes(board: Board) -> Router {
    Router::new()
        .route("/v1/scaling", get(scaling))
        .with_state(board)
}

/// The query of `GET /v1/scaling`.
#[derive(Debug, Default, Deserialize)]
pub struct ScalingQuery {
    pub group: Option<String>,
    pub lane: Option<String>,
    pub key: Option<String>,
}

/// Without a query, the whole [`Scaling`] (a KEDA `metrics-api` scaler reads a path in it,
/// e.g. `groups.<group>.ready`). With `group=G` (and `lane=L`): one flat [`Figures`] object
/// with `as_of` and `known` (`false`: no such group now — a Deployment scaled to zero — and
/// every figure 0). With `key=K`: that key's [`KeyScaling`] (zeros when unknown).
async fn scaling(State(board): State<Board>, Query(q): Query<ScalingQuery>) -> Response {
    let s = board.current();
    let lane = match q.lane.as_deref().map(Lane::parse) {
        None => None,
        Some(Some(l)) => Some(l),
        Some(None) => {
            return crate::api::error(
                StatusCode::BAD_REQUEST,
                "bad_lane",
                "lane must be normal or critical",
            )
        }
    };
    if let Some(key) = q.key {
        let k = s.keys.get(&key).cloned();
        let known = k.is_some();
        return Json(Flat {
            as_of: &s.as_of,
            known,
            figures: k.unwrap_or_default(),
        })
        .into_response();
    }
    let Some(group) = q.group else {
        if lane.is_some() {
            return crate::api::error(
                StatusCode::BAD_REQUEST,
                "lane_without_group",
                "lane needs group",
            );
        }
        return Json(&*s).into_response();
    };
    let g = s.groups.get(&group);
    let figures = match (g, lane) {
        (None, _) => Figures::default(),
        (Some(g), None) => g.total.clone(),
        (Some(g), Some(l)) => g.lanes.get(l.as_str()).cloned().unwrap_or_default(),
    };
    Json(Flat {
        as_of: &s.as_of,
        known: g.is_some(),
        figures,
    })
    .into_response()
}

#[derive(Serialize)]
struct Flat<'a, T: Serialize> {
    as_of: &'a str,
    known: bool,
    #[serde(flatten)]
    figures: T,
}

#[cfg(test)]
mod tests {
    use super::*;
    use fleet::control::KeyLimitSpec;

    fn limits(max: Option<u32>, rate: Option<f64>) -> KeyLimits {
        let mut l = KeyLimits::default();
        l.keys.insert(
            "k".into(),
            KeyLimitSpec {
                max_running: max,
                rate,
                ..Default::default()
            },
        );
        l
    }

    #[test]
    fn a_key_is_blocked_in_the_reservation_scripts_order() {
        let f = |running, reserved| KeyFigures {
            running,
            reserved,
            waiting: 5,
            ..Default::default()
        };
        let l = limits(Some(2), Some(1.0));
        assert_eq!(
            key_cause(&l, "k", &f(0, 0), true, None),
            Some(Cause::Paused)
        );
        assert_eq!(
            key_cause(&l, "k", &f(1, 1), false, Some(0.0)),
            Some(Cause::OverKeyLimit)
        );
        assert_eq!(
            key_cause(&l, "k", &f(1, 0), false, Some(0.5)),
            Some(Cause::RateLimited)
        );
        assert_eq!(key_cause(&l, "k", &f(1, 0), false, Some(1.0)), None);
        assert_eq!(
            key_cause(&KeyLimits::default(), "k", &f(100, 0), false, None),
            None,
            "no limit: never blocked"
        );
    }

    #[test]
    fn buckets_refill_as_the_script_does() {
        assert_eq!(bucket_tokens(None, 2.0, 5, 0), 1.0);
        assert_eq!(bucket_tokens(Some((0.0, 1_000)), 2.0, 5, 1_250), 0.5);
        assert_eq!(bucket_tokens(Some((4.0, 0)), 2.0, 5, 10_000), 5.0);
        assert_eq!(
            bucket_tokens(Some((0.5, 2_000)), 2.0, 5, 1_000),
            0.5,
            "clock behind"
        );
    }

    #[test]
    fn blocked_keys_are_split_by_fair_depth_and_capped() {
        let b = Blocked {
            over_key_limit: 30,
            paused: 10,
            ..Default::default()
        };
        let one: BTreeMap<_, _> = [("g".to_string(), 100)].into();
        assert_eq!(apportion(&one, &b)["g"], b, "one group: exact");
        let two: BTreeMap<_, _> = [("a".to_string(), 30), ("b".to_string(), 10)].into();
        let got = apportion(&two, &b);
        assert_eq!((got["a"].paused, got["a"].over_key_limit), (7, 22));
        assert_eq!((got["b"].paused, got["b"].over_key_limit), (2, 7));
        let small: BTreeMap<_, _> = [("g".to_string(), 25)].into();
        let got = apportion(&small, &b)["g"];
        assert_eq!((got.paused, got.over_key_limit, got.total()), (10, 15, 25));
        let empty: BTreeMap<_, _> = [("g".to_string(), 0)].into();
        assert_eq!(apportion(&empty, &b)["g"].total(), 0);
    }

    #[test]
    fn rates_over_the_window() {
        let mut w = Window::default();
        let t0 = Instant::now();
        assert_eq!(w.rate("x"), 0.0);
        w.push(t0, [("x".to_string(), 10.0)].into());
        assert_eq!(w.rate("x"), 0.0, "one sample");
        w.push(
            t0 + Duration::from_secs(10),
            [("x".to_string(), 30.0)].into(),
        );
        assert_eq!(w.rate("x"), 2.0);
        assert_eq!(w.rate("y"), 0.0);
        for i in 2..=20 {
            w.push(
                t0 + Duration::from_secs(10 * i),
                [("x".to_string(), 10.0 + 20.0 * i as f64)].into(),
            );
        }
        assert_eq!(w.rate("x"), 2.0);
        assert_eq!(w.counter_rate("x"), 2.0);
        assert!(w.samples.len() <= 8, "{} samples kept", w.samples.len());
    }

    #[test]
    fn a_counter_that_restarts_from_zero_is_not_a_negative_rate() {
        let mut w = Window::default();
        let t0 = Instant::now();
        // 500 → 520, then forgotten (missing), then back from 0: 3, then 9.
        for (i, v) in [Some(500.0), Some(520.0), None, Some(3.0), Some(9.0)]
            .into_iter()
            .enumerate()
        {
            let values = v.map(|v| [("k".to_string(), v)].into()).unwrap_or_default();
            w.push(t0 + Duration::from_secs(10 * i as u64), values);
        }
        // 20 + 3 + 6 over 40 s; the level's reading would be (9 - 500) / 40.
        assert_eq!(w.counter_rate("k"), 29.0 / 40.0);
        assert!(w.rate("k") < 0.0);
    }

    #[test]
    fn own_counters_by_group_and_lane() {
        let page = "# TYPE fleet_tasks_dispatched_total counter\n\
            fleet_tasks_dispatched_total{group=\"gpu=true,zone=\\\"a\\\"\",lane=\"normal\"} 7\n\
            fleet_tasks_dispatched_total{lane=\"critical\",group=\"x\"} 2\n\
            fleet_tasks_submitted_total{lane=\"normal\"} 9\n\
            fleet_tasks_dispatched_total_other{group=\"x\",lane=\"normal\"} 100\n";
        let own = own_counters(page);
        assert_eq!(
            own.dispatched,
            BTreeMap::from([
                (("gpu=true,zone=\"a\"".into(), "normal".into()), 7.0),
                (("x".into(), "critical".into()), 2.0),
            ])
        );
        assert_eq!(own.submitted, BTreeMap::from([("normal".into(), 9.0)]));
    }
}
