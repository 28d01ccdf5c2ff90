//! The firing loop: every replica runs it, each tick fires once across all of them.
//!
//! # Protocol
//!
//! Every `schedule_poll_ms` a replica reads Redis server time (`TIME`, the fleet's one clock)
//! and, per enabled schedule, lists the ticks between its cursor and now. A tick is *on time*
//! until `tick + schedule_tolerance_ms`. For each on-time tick the replica runs `claim.lua`, a
//! set-if-absent of `(schedule, tick)` with a short lease ([`CLAIM_LEASE`]); the claimant
//! submits the task — the schedule's template with id `<name>@<tick>` — to `<ns>.submit` with
//! a publisher confirm, exactly as any producer does, then `resolve.lua` records `fired` (kept
//! for the tolerance plus an hour) and advances the schedule's last mark. The other replicas
//! see the claim and keep the tick pending; if the claimant dies before resolving, its lease
//! runs out and another replica claims the tick, and the deterministic id lets the scheduler's
//! dedupe drop a copy the dead claimant may already have published.
//!
//! Admission applies as to any producer: with the fleet Red (normal lane) or the ingress full
//! (broker nack) the claimant keeps its claim and retries every poll until the tolerance runs
//! out, then records the tick `missed` (reason `pressure_red` / `ingress_full` / `error`).
//!
//! # First tick
//!
//! A schedule's first due tick is the first after its creation (or resume) time — the Redis
//! server time the API read when it recorded the change — not after the first poll that sees
//! it: a tick between the change and that poll is due like any other (fired within the
//! tolerance, else handled by the missed-fire policy). The API writes a *born* mark
//! ([`born_key`]) before recording a creation or resume; a replica that finds a schedule
//! without a last mark starts from the change time only when the born mark is there. A
//! replica that finds neither (Redis lost them, together with the dedupe marks) starts from
//! now: after a Redis loss nothing already fired fires again, and ticks missed during the loss
//! are not caught up. Replicas that kept running through the loss keep their cursors in memory
//! and go on without a gap.
//!
//! # Missed ticks
//!
//! Ticks whose tolerance passed before any replica could fire them — every replica stopped,
//! Redis or the broker down — are found at (re)start from the last mark and handled by the
//! schedule's policy, over the whole gap at once, however long: `skip` records them missed
//! (`skipped`); `catch_up` fires the latest `catch_up_max` of them now, oldest first, and
//! records all the older ones missed (`catch_up_limit`) — so an outage of any length fires at
//! most `catch_up_max` late ticks, and they are the latest. The misses are recorded with one
//! Redis call (`miss.lua`: the last mark moves past them; only the last one keeps a per-tick
//! record), and counted by the replica whose call moved the mark. Ticks before a schedule was
//! defined or resumed are never caught up. The walk costs one `next_after` per overdue tick
//! (about 15 µs each in a debug build: an every-second schedule down for a day is 86,400 of
//! them) and yields to the runtime every 10,000. Known edge: two replicas restarting at the same moment whose `now`s
//! differ by a tick or more may both walk the gap; the fires stay once each (claims), but a
//! tick one of them caught up can also be counted missed by the other (a metric, not a fire).
//!
//! Metrics: `fleet_schedule_fires_total{schedule,trigger}`, `fleet_schedule_misses_total{schedule,reason}`,
//! `fleet_schedule_lag_seconds{schedule}` (tick to confirmed submission).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use chrono::{DateTime, TimeZone, Utc};
use deadpool_redis::redis::Script;
use fleet::{broker::amqp, metrics as m, Envelope, Lane, Store};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::definition::{MissedPolicy, Schedule};
use super::log::{Board, Entry};
use crate::backpressure::{Pressure, Sample};
use crate::config::SchedulerConfig;
use fleet::process::Ticker;

/// How long a claim holds a tick without being renewed: long enough for a publish and its
/// confirm, short enough that a crashed claimant's tick is taken over within its tolerance.
pub const CLAIM_LEASE: Duration = Duration::from_secs(2);
/// Most ticks of one schedule handled per poll (the rest wait for the next poll). Bounds the
/// work after a long outage of an every-second schedule.
const MAX_DUE: usize = 10_000;
/// Overdue ticks walked between two yields to the runtime (a long outage of an every-second
/// schedule is walked in one poll).
const WALK_YIELD: usize = 10_000;

fn claim_script() -> &'static Script {
    static S: OnceLock<Script> = OnceLock::new();
    S.get_or_init(|| Script::new(include_str!("claim.lua")))
}

fn resolve_script() -> &'static Script {
    static S: OnceLock<Script> = OnceLock::new();
    S.get_or_init(|| Script::new(include_str!("resolve.lua")))
}

fn miss_script() -> &'static Script {
    static S: OnceLock<Script> = OnceLock::new();
    S.get_or_init(|| Script::new(include_str!("miss.lua")))
}

/// The *born* mark of schedule `name`: `{ns}:sb:<name>`, the Redis time (ms) of its latest
/// creation or resume, written by the API before the change is recorded. Its presence tells a
/// replica that Redis has not lost the schedule's marks since, so the first due tick is the
/// first after the change (see the module docs). Never expires (one small key per name).
pub fn born_key(names: &fleet::Names, name: &str) -> String {
    format!("{}sb:{}", names.prefix(), name)
}

/// Redis server time (fleet's one clock): measures this process's offset against Redis `TIME`
/// (which also updates `fleet_clock_skew_seconds`) and returns the clock's reading.
///
/// # Errors
/// Redis unreachable or slow.
pub async fn server_now(store: &Store) -> fleet::Result<DateTime<Utc>> {
    store.measure_clock().await?;
    Ok(store.clock.now())
}

/// Why a submission was not accepted; the `reason` label of misses and the API's refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Normal-lane work while the fleet is Red.
    PressureRed,
    /// The broker nacked the publish (ingress full) or could not route it.
    IngressFull,
    /// No AMQP channel, or it failed.
    Error,
}

impl Refusal {
    pub fn reason(self) -> &'static str {
        match self {
            Refusal::PressureRed => "pressure_red",
            Refusal::IngressFull => "ingress_full",
            Refusal::Error => "error",
        }
    }
}

/// Submits one fired task through admission: refused while the normal lane is Red, else
/// published to `<ns>.submit` (routing key = lane) and confirmed.
///
/// # Cancel safety
/// Not cancel safe: dropped after the publish went out, the task may be in `<ns>.submit`
/// while the caller never learns it was confirmed (whoever fires the tick again submits the
/// same id `<name>@<tick>`, and the scheduler's dedupe drops the copy).
pub async fn submit(
    ch: &fleet::broker::amqp::Publisher,
    names: &fleet::Names,
    pressure: &watch::Receiver<Sample>,
    env: &Envelope,
) -> Result<(), Refusal> {
    if env.lane == Lane::Normal && pressure.borrow().state == Pressure::Red {
        return Err(Refusal::PressureRed);
    }
    let props = amqp::task_properties(&env.id, None);
    match amqp::publish(
        ch,
        &names.submit_exchange(),
        env.lane.as_str(),
        &env.to_bytes(),
        props,
    )
    .await
    {
        Ok(c) => match amqp::confirmed(c).await {
            Ok(()) => Ok(()),
            Err(fleet::Error::Refused(_)) => Err(Refusal::IngressFull),
            Err(_) => Err(Refusal::Error),
        },
        Err(_) => Err(Refusal::Error),
    }
}

/// The overdue ticks a step records missed: how many, the first and the last.
#[derive(Debug, Default)]
struct Missed {
    count: u64,
    range: Option<(DateTime<Utc>, DateTime<Utc>)>,
}

impl Missed {
    fn add(&mut self, t: DateTime<Utc>) {
        self.count += 1;
        self.range = Some(match self.range {
            Some((first, _)) => (first, t),
            None => (t, t),
        });
    }
}

/// Walks the overdue ticks of `s` after `cursor` — those whose tolerance passed by `now` —
/// to the end of the gap, however long: returns the new cursor (the last overdue tick, or
/// `cursor`), the latest `keep` of them (oldest first; to catch up) and the older ones as a
/// count and range (to record missed). One `next_after` per tick; yields to the runtime every
/// [`WALK_YIELD`] ticks.
async fn walk_overdue(
    s: &Schedule,
    mut cursor: DateTime<Utc>,
    now: DateTime<Utc>,
    tolerance: chrono::Duration,
    keep: usize,
) -> (DateTime<Utc>, VecDeque<DateTime<Utc>>, Missed) {
    let mut caught: VecDeque<DateTime<Utc>> = VecDeque::with_capacity(keep);
    let mut missed = Missed::default();
    let mut walked = 0usize;
    while let Some(t) = s.next_after(cursor) {
        if t > now || t + tolerance >= now {
            break;
        }
        cursor = t;
        let dropped = if keep == 0 {
            Some(t)
        } else if caught.len() == keep {
            let old = caught.pop_front();
            caught.push_back(t);
            old
        } else {
            caught.push_back(t);
            None
        };
        if let Some(d) = dropped {
            missed.add(d);
        }
        walked += 1;
        if walked.is_multiple_of(WALK_YIELD) {
            tokio::task::yield_now().await;
        }
    }
    (cursor, caught, missed)
}

/// Ticks of `s` in `(from, to]`.
fn count_ticks(s: &Schedule, from: DateTime<Utc>, to: DateTime<Utc>) -> u64 {
    let (mut t, mut n) = (from, 0);
    while let Some(next) = s.next_after(t) {
        if next > to {
            break;
        }
        n += 1;
        t = next;
    }
    n
}

/// A tick waiting to be fired by this replica or resolved by another.
#[derive(Debug, Clone)]
struct Pending {
    tick: DateTime<Utc>,
    deadline: DateTime<Utc>,
    /// This replica holds the claim.
    mine: bool,
    /// Why the last attempt failed.
    refused: Option<Refusal>,
    /// Its task was accepted; only recording it `fired` is left (that write failed).
    submitted: bool,
}

/// Per-schedule progress of this replica.
struct Track {
    changed_at_ms: i64,
    /// Ticks up to here were listed.
    cursor: DateTime<Utc>,
    pending: Vec<Pending>,
}

/// The firing loop of one AMQP session.
pub struct Firing {
    pub cfg: Arc<SchedulerConfig>,
    pub store: Store,
    pub board: Board,
    /// A confirm channel of its own.
    pub publisher: fleet::broker::amqp::Publisher,
    pub pressure: watch::Receiver<Sample>,
    /// This process's id in claims.
    pub replica: String,
}

impl Firing {
    /// Runs until `shutdown`. Redis errors are retried at the next poll; an AMQP channel
    /// failure ends the session (`Err`). A tick being fired is finished before shutdown is
    /// honoured, so a stopping replica never leaves a claimed tick half-done.
    pub async fn run(self, shutdown: CancellationToken) -> fleet::Result<()> {
        let mut ticker = Ticker::new(self.cfg.schedule_poll);
        let mut tracks: HashMap<String, Track> = HashMap::new();
        let mut redis_down = false;
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = ticker.next() => self.tick(&mut tracks, &mut redis_down).await?,
            }
        }
        Ok(())
    }

    /// One poll: fires what is due. `redis_down` keeps the warning to one per outage.
    async fn tick(
        &self,
        tracks: &mut HashMap<String, Track>,
        redis_down: &mut bool,
    ) -> fleet::Result<()> {
        if !self.board.loaded() {
            return Ok(());
        }
        let now = match server_now(&self.store).await {
            Ok(t) => t,
            Err(e) => {
                metrics::counter!(m::REDIS_ERRORS).increment(1);
                if !*redis_down {
                    tracing::warn!(error = %e, "schedules: cannot read Redis time; retrying");
                    *redis_down = true;
                }
                return Ok(());
            }
        };
        *redis_down = false;
        let started = Instant::now();
        let entries = self.board.entries();
        tracks.retain(|name, _| entries.iter().any(|e| e.schedule.name() == name));
        for entry in &entries {
            let now = now + chrono::Duration::from_std(started.elapsed()).unwrap_or_default();
            if let Err(e) = self.step(entry, now, tracks).await {
                metrics::counter!(m::REDIS_ERRORS).increment(1);
                tracing::warn!(schedule = entry.schedule.name(), error = %e, "schedule step failed; retrying at the next poll");
            }
        }
        if !self.publisher.status().connected() {
            return Err(fleet::Error::ChannelClosed { what: "schedules" });
        }
        Ok(())
    }

    async fn step(
        &self,
        entry: &Entry,
        now: DateTime<Utc>,
        tracks: &mut HashMap<String, Track>,
    ) -> fleet::Result<()> {
        let s = &entry.schedule;
        let name = s.name();
        let tolerance = chrono::Duration::from_std(self.cfg.schedule_tolerance).unwrap_or_default();
        if tracks
            .get(name)
            .is_none_or(|t| t.changed_at_ms != entry.changed_at_ms)
        {
            let last = self.store.schedule_last(name).await?;
            let start_ms = match last {
                // A mark older than the change is a deleted namesake's or from before a pause.
                Some(l) => entry.changed_at_ms.max(l),
                None => {
                    let born: Option<i64> = self
                        .store
                        .query(
                            deadpool_redis::redis::cmd("GET")
                                .arg(born_key(&self.store.names, name)),
                        )
                        .await?;
                    if born.is_some() {
                        // Never fired yet: its first due tick is the first after the change.
                        entry.changed_at_ms
                    } else {
                        // Redis lost the marks (and the dedupe marks with them) — start from
                        // now, so nothing already fired is fired again.
                        entry.changed_at_ms.max(now.timestamp_millis())
                    }
                }
            };
            let cursor = Utc.timestamp_millis_opt(start_ms).single().unwrap_or(now);
            tracks.insert(
                name.to_string(),
                Track {
                    changed_at_ms: entry.changed_at_ms,
                    cursor,
                    pending: Vec::new(),
                },
            );
        }
        let Some(track) = tracks.get_mut(name) else {
            return Ok(());
        };
        if !entry.enabled() {
            track.cursor = now;
            track.pending.clear();
            return Ok(());
        }
        // The overdue ticks (tolerance passed, never fired), walked to the end of the gap
        // before the policy applies: only the latest `keep` are held, the rest counted.
        let keep = match s.spec.missed {
            MissedPolicy::Skip => 0,
            MissedPolicy::CatchUp => s.spec.catch_up_max as usize,
        };
        let walk_from = track.cursor;
        let (cursor, caught, missed) = walk_overdue(s, track.cursor, now, tolerance, keep).await;
        track.cursor = cursor;
        let mut listed = 0;
        while listed < MAX_DUE {
            let Some(t) = s.next_after(track.cursor) else {
                break;
            };
            if t > now {
                break;
            }
            track.cursor = t;
            listed += 1;
            track.pending.push(Pending {
                tick: t,
                deadline: t + tolerance,
                mine: false,
                refused: None,
                submitted: false,
            });
        }
        if !caught.is_empty() {
            tracing::info!(
                schedule = name,
                ticks = caught.len(),
                "catching up missed ticks"
            );
            // The ticks to catch up join the pending ones before any Redis call below: the
            // cursor has passed them, so a failed call must not drop them.
            let mut late: Vec<Pending> = caught
                .into_iter()
                .map(|t| Pending {
                    tick: t,
                    deadline: now + tolerance,
                    mine: false,
                    refused: None,
                    submitted: false,
                })
                .collect();
            late.append(&mut track.pending);
            track.pending = late;
        }
        if let Some((first, last)) = missed.range {
            let reason = if keep == 0 {
                "skipped"
            } else {
                "catch_up_limit"
            };
            // A failure here leaves these ticks unrecorded (never fired either: they are past
            // their tolerance) and ends the step; the pending ones stay.
            let prev = self.record_missed(name, last).await?;
            let counted = if prev >= last.timestamp_millis() {
                0
            } else if prev < first.timestamp_millis() {
                missed.count
            } else {
                // Another replica recorded part of the gap meanwhile: count only the rest.
                let from = Utc
                    .timestamp_millis_opt(prev.max(walk_from.timestamp_millis()))
                    .single()
                    .unwrap_or(first);
                count_ticks(s, from, last)
            };
            if counted > 0 {
                tracing::warn!(schedule = name, ticks = counted, reason, first = %first, last = %last, "ticks missed while no scheduler could fire them");
                metrics::counter!(m::SCHEDULE_MISSES, "schedule" => name.to_string(), "reason" => reason).increment(counted);
            }
        }
        // A failed attempt (Redis unreachable or slow) keeps its tick and every tick after it
        // pending, to be tried again at the next poll within their tolerance.
        let mut still = Vec::with_capacity(track.pending.len());
        let mut pending = std::mem::take(&mut track.pending).into_iter();
        let mut failed = None;
        while let Some(mut p) = pending.next() {
            match self.attempt(s, &mut p, now).await {
                Ok(true) => still.push(p),
                Ok(false) => {}
                Err(e) => {
                    still.push(p);
                    still.extend(pending);
                    failed = Some(e);
                    break;
                }
            }
        }
        track.pending = still;
        failed.map_or(Ok(()), Err)
    }

    /// One attempt at a pending tick; `Ok(true)` to keep it pending.
    async fn attempt(
        &self,
        s: &Schedule,
        p: &mut Pending,
        now: DateTime<Utc>,
    ) -> fleet::Result<bool> {
        let name = s.name();
        if p.submitted {
            // Its task went out; a Redis error kept it from being recorded `fired`. Whatever
            // the deadline, that is all that is left (its task runs: never `missed`).
            if self.resolve(name, p.tick, "fired").await? {
                metrics::counter!(m::SCHEDULE_FIRES, "schedule" => name.to_string(), "trigger" => "cron").increment(1);
            }
            return Ok(false);
        }
        if now > p.deadline {
            if p.mine && self.resolve(name, p.tick, "missed").await? {
                let reason = p.refused.unwrap_or(Refusal::Error).reason();
                tracing::warn!(schedule = name, tick = %p.tick, reason, "tick missed: not accepted within its tolerance");
                metrics::counter!(m::SCHEDULE_MISSES, "schedule" => name.to_string(), "reason" => reason).increment(1);
            }
            return Ok(false);
        }
        let key = self
            .store
            .names
            .schedule_tick(name, p.tick.timestamp_millis());
        let claimed: i64 = self
            .store
            .invoke(
                claim_script()
                    .key(&key)
                    .arg(&self.replica)
                    .arg(CLAIM_LEASE.as_millis() as u64),
            )
            .await?;
        match claimed {
            2 => return Ok(false),
            0 => {
                p.mine = false;
                return Ok(true);
            }
            _ => p.mine = true,
        }
        let env = match s.tick_envelope(p.tick, now, self.cfg.common.default_max_attempts) {
            Ok(e) => e,
            Err(e) => {
                // Validated at definition time; only a clock far off could get here.
                tracing::error!(schedule = name, error = %e, "cannot build the task of a tick");
                p.refused = Some(Refusal::Error);
                return Ok(true);
            }
        };
        let sent = Instant::now();
        match submit(&self.publisher, &self.store.names, &self.pressure, &env).await {
            Ok(()) => {
                p.submitted = true;
                if self.resolve(name, p.tick, "fired").await? {
                    let lag = (now - p.tick).to_std().unwrap_or_default() + sent.elapsed();
                    metrics::counter!(m::SCHEDULE_FIRES, "schedule" => name.to_string(), "trigger" => "cron").increment(1);
                    metrics::histogram!(m::SCHEDULE_LAG, "schedule" => name.to_string())
                        .record(lag.as_secs_f64());
                    tracing::debug!(schedule = name, task.id = %env.id, lag_ms = lag.as_millis() as u64, "fired");
                }
                Ok(false)
            }
            Err(r) => {
                if p.refused.is_none() {
                    tracing::info!(schedule = name, tick = %p.tick, reason = r.reason(), "fire refused; retrying within the tolerance");
                }
                p.refused = Some(r);
                Ok(true)
            }
        }
    }

    /// Records every tick up to `last` missed at once (`miss.lua`): moves the last mark to
    /// `last` and records `last` itself `missed`. Returns the last mark before the call (0 for
    /// none): the ticks after it were recorded by this call.
    async fn record_missed(&self, name: &str, last: DateTime<Utc>) -> fleet::Result<i64> {
        let names = &self.store.names;
        let ttl = self.cfg.schedule_tolerance + Duration::from_secs(3600);
        self.store
            .invoke(
                miss_script()
                    .key(names.schedule_tick(name, last.timestamp_millis()))
                    .key(names.schedule_last(name))
                    .arg(&self.replica)
                    .arg(last.timestamp_millis())
                    .arg(ttl.as_millis() as u64),
            )
            .await
    }

    /// Records a tick's outcome; `true` when this call recorded it (count it).
    async fn resolve(&self, name: &str, tick: DateTime<Utc>, outcome: &str) -> fleet::Result<bool> {
        let names = &self.store.names;
        let ttl = self.cfg.schedule_tolerance + Duration::from_secs(3600);
        let r: i64 = self
            .store
            .invoke(
                resolve_script()
                    .key(names.schedule_tick(name, tick.timestamp_millis()))
                    .key(names.schedule_last(name))
                    .arg(outcome)
                    .arg(&self.replica)
                    .arg(tick.timestamp_millis())
                    .arg(ttl.as_millis() as u64),
            )
            .await?;
        Ok(r == 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sched(cron: &str, tz: &str) -> Schedule {
        Schedule::new(
            serde_json::from_value(
                json!({"name": "s", "cron": cron, "timezone": tz, "task": {"kind": "noop"}}),
            )
            .unwrap(),
        )
        .unwrap()
    }

    fn utc(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    #[tokio::test]
    async fn the_catch_up_bound_holds_over_a_6_h_gap_and_keeps_the_latest_ticks() {
        // The case: `0-29 * * * * *`, catch_up_max 3, 6 h down (10,800 ticks, more than
        // one poll's 10,000 of before): 3 to fire, the latest; every other one missed.
        let s = sched("0-29 * * * * *", "UTC");
        let (from, now) = (utc("2026-12-01T00:00:00Z"), utc("2026-12-01T06:00:00Z"));
        let tol = chrono::Duration::seconds(10);
        let started = Instant::now();
        let (cursor, caught, missed) = walk_overdue(&s, from, now, tol, 3).await;
        eprintln!("walked 10,800 ticks in {:?}", started.elapsed());
        let labels: Vec<String> = caught
            .iter()
            .map(|t| super::super::definition::tick_label(*t))
            .collect();
        assert_eq!(
            labels,
            [
                "2026-12-01T05:59:27Z",
                "2026-12-01T05:59:28Z",
                "2026-12-01T05:59:29Z"
            ]
        );
        assert_eq!(cursor, utc("2026-12-01T05:59:29Z"));
        // 10,800 ticks from 00:00:00 on; the cursor's own tick is not in the gap.
        assert_eq!(missed.count, 6 * 60 * 30 - 1 - 3);
        assert_eq!(
            missed.range,
            Some((utc("2026-12-01T00:00:01Z"), utc("2026-12-01T05:59:26Z")))
        );
        // `skip`: all of them missed, none to fire; ticks within the tolerance are left alone.
        let e = sched("* * * * * *", "UTC");
        let (cursor, caught, missed) = walk_overdue(&e, from, now, tol, 0).await;
        assert!(caught.is_empty());
        // Overdue: after 00:00:00 and more than 10 s before 06:00:00 (05:59:50 is on time).
        assert_eq!(missed.count, 6 * 3600 - 11);
        assert_eq!(cursor, utc("2026-12-01T05:59:49Z"));
        assert_eq!(count_ticks(&e, from, cursor), missed.count);
    }

    #[tokio::test]
    async fn a_day_of_every_second_in_berlin_across_the_fall_back_is_90_000_ticks() {
        // 2026-10-25 has 25 hours in Europe/Berlin; the real-time pace counts every second.
        let s = sched("* * * * * *", "Europe/Berlin");
        let (from, to) = (utc("2026-10-24T22:00:00Z"), utc("2026-10-25T23:00:00Z"));
        let started = Instant::now();
        assert_eq!(count_ticks(&s, from, to), 25 * 3600);
        eprintln!("90,000 ticks counted in {:?}", started.elapsed());
    }
}
