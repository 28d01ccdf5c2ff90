//! A schedule's definition: name, cron expression (with seconds), IANA time zone, the envelope
//! template each fire submits, the missed-fire policy and whether it is enabled — and the one
//! piece of calendar arithmetic fleet needs, the next tick after an instant.
//!
//! # Ticks across daylight-saving changes
//!
//! Cron fields are local wall-clock times in the schedule's zone (`chrono-tz`, the IANA
//! database). Vixie cron's rule (also what Sidekiq #5049 and node-schedule #435 asked for)
//! decides what a change of the zone's offset does, by the expression's minute and hour fields:
//!
//! * **Interval schedules** — a wildcard or a step (`*`, `*/10`, `5/15`) in the minute or the
//!   hour field: ticks keep their real-time pace. Every instant whose wall-clock time in the
//!   zone matches is a tick, so in the repeated hour of a fall-back `*/10 * * * * *` fires
//!   every 10 s throughout (each local time twice, once per offset), and `0 15 * * * *` fires
//!   at 02:15 CEST and again an hour later at 02:15 CET. Spring forward: the missing local
//!   times are not ticks; the next existing one is.
//! * **Fixed-time schedules** — minute and hour both plain values or lists/ranges of values
//!   (`0 30 2 * * *`): a local time fires once, at its first instant, and never at or before
//!   the instant asked about. So a `Europe/Berlin` schedule at `30 2 * * *` does not fire on
//!   the spring-forward day (02:30 does not exist; as Vixie cron and Kubernetes CronJob for
//!   skipped times) and fires once, at 02:30 CEST, on the fall-back day.
//!
//! The `cron` crate alone enumerates local times and yields *both* instants of a repeated one
//! (and, started inside the repeated hour, instants earlier than the start); interval
//! schedules are therefore enumerated per UTC offset ([`Schedule::next_after`]), fixed-time
//! ones filtered to the first instant.

use std::str::FromStr;

use chrono::{DateTime, FixedOffset, Offset, SecondsFormat, TimeZone, Utc};
use chrono_tz::Tz;
use fleet::Envelope;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Longest schedule name (it is part of every fired task's id and of Redis keys).
pub const MAX_NAME_LEN: usize = 64;
/// Largest `catch_up_max`: a restart never floods the fleet with more than this per schedule.
pub const MAX_CATCH_UP: u32 = 1000;
/// Envelope fields a template may carry; the id and times are the scheduler's.
pub const TEMPLATE_FIELDS: &[&str] = &[
    "kind",
    "payload",
    "labels",
    "protocol",
    "lane",
    "timeout_ms",
    "max_attempts",
];
/// Candidate local times examined per `next_after` call: the longest run of skipped candidates
/// is an every-second schedule inside a repeated hour (3,600 × 2).
const MAX_CANDIDATES: usize = 10_000;
/// Offset changes crossed per `next_after` call of an interval schedule before giving up
/// (two a year in DST zones: an expression whose next tick is 100 years away still fits).
const MAX_OFFSET_CHANGES: usize = 512;

/// What to do with ticks whose tolerance passed while no scheduler could fire them (every
/// replica stopped, Redis or the broker down).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MissedPolicy {
    /// Count them as missed and carry on from now (Celery beat, Kubernetes CronJob default).
    #[default]
    Skip,
    /// Fire the most recent `catch_up_max` of them, oldest first; count the older ones missed.
    CatchUp,
}

fn default_tz() -> String {
    "UTC".into()
}
fn default_true() -> bool {
    true
}
fn default_catch_up() -> u32 {
    1
}

/// A schedule as the API takes it and the definitions log stores it.
///
/// ```json
/// {"name": "nightly", "cron": "0 30 2 * * *", "timezone": "Europe/Berlin",
///  "task": {"kind": "report", "payload": {"full": true}, "labels": {"gpu": "true"}},
///  "missed": "catch_up", "catch_up_max": 3, "enabled": true}
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleSpec {
    /// `[A-Za-z0-9_.-]`, 1..=64 characters.
    pub name: String,
    /// Six or seven fields, `sec min hour day-of-month month day-of-week [year]` (the `cron`
    /// crate's syntax); a classic five-field expression gets second `0` prepended.
    pub cron: String,
    /// IANA zone name (`Europe/Berlin`); default `UTC`.
    #[serde(default = "default_tz")]
    pub timezone: String,
    /// Envelope template: `kind` (required), `payload`, `labels`, `protocol`, `lane`,
    /// `timeout_ms` (relative to the fire), `max_attempts`.
    pub task: Map<String, Value>,
    #[serde(default)]
    pub missed: MissedPolicy,
    /// Bound of `catch_up` (1..=1000, default 1); ignored by `skip`.
    #[serde(default = "default_catch_up")]
    pub catch_up_max: u32,
    #[serde(default = "default_true")]
    pub enabled: bool,
}

/// Why a definition was refused (the API answers 400 with it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Invalid {
    #[error("name `{0}`: use 1 to 64 of A-Z a-z 0-9 _ . -")]
    Name(String),
    #[error("cron `{0}`: {1}")]
    Cron(String, String),
    #[error("timezone `{0}` is not an IANA zone name")]
    Timezone(String),
    #[error("task: {0}")]
    Task(String),
    #[error("catch_up_max must be between 1 and {MAX_CATCH_UP}, got {0}")]
    CatchUpMax(u32),
}

/// A validated schedule: its spec plus the parsed expression and zone.
#[derive(Debug, Clone)]
pub struct Schedule {
    pub spec: ScheduleSpec,
    cron: cron::Schedule,
    tz: Tz,
    /// A wildcard or step in the minute or hour field: real-time pace across offset changes
    /// (see the module docs).
    interval: bool,
}

impl Schedule {
    /// Validates a spec: name, expression, zone, template (built into an envelope once).
    pub fn new(mut spec: ScheduleSpec) -> Result<Self, Invalid> {
        let n = &spec.name;
        if n.is_empty()
            || n.len() > MAX_NAME_LEN
            || !n
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
        {
            return Err(Invalid::Name(n.clone()));
        }
        let fields = spec.cron.split_whitespace().count();
        let expr = if fields == 5 {
            format!("0 {}", spec.cron.trim())
        } else {
            spec.cron.trim().to_string()
        };
        if !(5..=7).contains(&fields) {
            return Err(Invalid::Cron(
                spec.cron.clone(),
                format!("expected 6 or 7 fields (5 for classic cron), got {fields}"),
            ));
        }
        check_field_ranges(spec.cron.trim(), fields)
            .map_err(|why| Invalid::Cron(spec.cron.clone(), why))?;
        let cron = cron::Schedule::from_str(&expr)
            .map_err(|e| Invalid::Cron(spec.cron.clone(), e.to_string()))?;
        let interval = expr
            .split_whitespace()
            .skip(1)
            .take(2)
            .any(|f| f.contains('*') || f.contains('/'));
        spec.cron = expr;
        let tz =
            Tz::from_str(&spec.timezone).map_err(|_| Invalid::Timezone(spec.timezone.clone()))?;
        if !(1..=MAX_CATCH_UP).contains(&spec.catch_up_max) {
            return Err(Invalid::CatchUpMax(spec.catch_up_max));
        }
        if let Some(k) = spec
            .task
            .keys()
            .find(|k| !TEMPLATE_FIELDS.contains(&k.as_str()))
        {
            return Err(Invalid::Task(format!(
                "field `{k}` cannot be templated (allowed: {})",
                TEMPLATE_FIELDS.join(", ")
            )));
        }
        let s = Schedule {
            spec,
            cron,
            tz,
            interval,
        };
        // The template must make a valid envelope now, not at 3 a.m.
        s.envelope(Utc::now(), "probe", 1).map_err(Invalid::Task)?;
        Ok(s)
    }

    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// The first tick strictly after `t`, as an instant; `None` when the expression has no
    /// more (a past year, or none found within the search bounds). See the module docs for
    /// the daylight-saving rule.
    pub fn next_after(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        if self.interval {
            self.next_real_time(t)
        } else {
            self.next_fixed_time(t)
        }
    }

    /// True for an interval schedule (real-time pace through offset changes).
    pub fn is_interval(&self) -> bool {
        self.interval
    }

    /// Fixed-time rule: each local time once, at its first instant.
    fn next_fixed_time(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let local = t.with_timezone(&self.tz);
        for cand in self.cron.after(&local).take(MAX_CANDIDATES) {
            let first = self.tz.from_local_datetime(&cand.naive_local()).earliest();
            // The later instant of a repeated local time: that local time already fired.
            if first.as_ref() != Some(&cand) {
                continue;
            }
            let at = cand.with_timezone(&Utc);
            if at > t {
                return Some(at);
            }
        }
        None
    }

    /// The zone's UTC offset at instant `t`.
    fn offset_at(&self, t: DateTime<Utc>) -> FixedOffset {
        self.tz.offset_from_utc_datetime(&t.naive_utc()).fix()
    }

    /// Interval rule: the first instant after `t` whose wall-clock time in the zone matches.
    /// Enumerated under the offset in force: the crate's next match under offset `o` is the
    /// answer if `o` is still in force then; else the offset changed first, at an instant
    /// found by bisection (to the millisecond), and the search goes on from there under the
    /// new offset.
    fn next_real_time(&self, t: DateTime<Utc>) -> Option<DateTime<Utc>> {
        let mut from = t;
        let mut off = self.offset_at(t);
        for _ in 0..MAX_OFFSET_CHANGES {
            let cand = self
                .cron
                .after(&from.with_timezone(&off))
                .next()?
                .with_timezone(&Utc);
            if self.offset_at(cand) == off {
                return Some(cand);
            }
            // The offset changed in (from, cand]: find the first instant of the new one.
            let (mut lo, mut hi) = (from, cand);
            while hi - lo > chrono::Duration::milliseconds(1) {
                let mid = lo + (hi - lo) / 2;
                if self.offset_at(mid) == off {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            off = self.offset_at(hi);
            // Strictly after `from` = at or after `hi` (ticks are whole seconds).
            from = (hi - chrono::Duration::milliseconds(1)).max(t);
        }
        None
    }

    /// The task a fire submits: the template with id `<name>@<suffix>`, normalised at `now`.
    /// `Err` carries the envelope's refusal.
    pub fn envelope(
        &self,
        now: DateTime<Utc>,
        suffix: &str,
        default_max_attempts: u32,
    ) -> Result<Envelope, String> {
        let mut m = self.spec.task.clone();
        m.insert("id".into(), format!("{}@{suffix}", self.spec.name).into());
        let mut env = Envelope::from_value(Value::Object(m)).map_err(|r| r.to_string())?;
        env.normalize(now, default_max_attempts)
            .map_err(|r| r.to_string())?;
        Ok(env)
    }

    /// The task of the cron tick `tick`: id `<name>@<tick, RFC 3339 UTC, seconds>`, the same
    /// on every replica, so the scheduler's dedupe drops a second copy.
    pub fn tick_envelope(
        &self,
        tick: DateTime<Utc>,
        now: DateTime<Utc>,
        default_max_attempts: u32,
    ) -> Result<Envelope, String> {
        self.envelope(now, &tick_label(tick), default_max_attempts)
    }
}

/// The fields of a 6- or 7-field expression (`sec min hour day-of-month month day-of-week
/// [year]`) with the ranges of the `cron` crate that evaluates them (day-of-week 1-7 with
/// 1 = Sunday, as Quartz has it).
const FIELDS: [(&str, u32, u32); 7] = [
    ("second", 0, 59),
    ("minute", 0, 59),
    ("hour", 0, 23),
    ("day-of-month", 1, 31),
    ("month", 1, 12),
    ("day-of-week", 1, 7),
    ("year", 1970, 2100),
];

/// Checks every number of `user` (the expression as the user wrote it: 5 fields = classic
/// cron, no seconds) against its field's range, naming the field the user wrote and its
/// inclusive bounds. The `cron` crate's own message is off by one ("Hours must be less than
/// 23" for an hour of 24: its bound is inclusive) and speaks of the widened 6-field form.
/// Names (`MON`, `JAN`) and the crate's other syntax are left to it.
fn check_field_ranges(user: &str, fields: usize) -> Result<(), String> {
    let names = if fields == 5 {
        &FIELDS[1..6]
    } else {
        &FIELDS[..fields.min(7)]
    };
    for (i, (text, &(name, lo, hi))) in user.split_whitespace().zip(names).enumerate() {
        for part in text.split(',') {
            let (base, step) = match part.split_once('/') {
                Some((b, s)) => (b, Some(s)),
                None => (part, None),
            };
            if let Some(step) = step.filter(|s| s.bytes().all(|b| b.is_ascii_digit())) {
                if step.parse::<u32>().map_or(true, |n| n == 0) {
                    return Err(format!(
                        "{name} `{text}` (field {} of {fields}): a step must be at least 1",
                        i + 1
                    ));
                }
            }
            for n in base.split('-') {
                if n.is_empty() || !n.bytes().all(|b| b.is_ascii_digit()) {
                    continue;
                }
                match n.parse::<u32>() {
                    Ok(v) if (lo..=hi).contains(&v) => {}
                    _ => {
                        return Err(format!(
                            "{name} `{text}` (field {} of {fields}): {n} is outside {lo}-{hi}",
                            i + 1
                        ))
                    }
                }
            }
        }
    }
    Ok(())
}

/// A tick as it appears in task ids: `2026-11-30T10:00:00Z`.
pub fn tick_label(tick: DateTime<Utc>) -> String {
    tick.to_rfc3339_opts(SecondsFormat::Secs, true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sched(cron: &str, tz: &str) -> Schedule {
        let spec: ScheduleSpec = serde_json::from_value(
            json!({"name": "s", "cron": cron, "timezone": tz, "task": {"kind": "noop"}}),
        )
        .unwrap();
        Schedule::new(spec).unwrap()
    }

    fn utc(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    fn cron_error(cron: &str) -> String {
        let spec: ScheduleSpec = serde_json::from_value(
            json!({"name": "s", "cron": cron, "timezone": "UTC", "task": {"kind": "noop"}}),
        )
        .unwrap();
        Schedule::new(spec).unwrap_err().to_string()
    }

    /// A number out of its field's range is named in the user's own form (5 fields: no
    /// seconds) with the field's inclusive bounds; each field's bounds themselves are taken.
    #[test]
    fn an_out_of_range_cron_field_names_the_users_field_and_its_bounds() {
        assert_eq!(
            cron_error("0 24 * * *"),
            "cron `0 24 * * *`: hour `24` (field 2 of 5): 24 is outside 0-23"
        );
        assert_eq!(
            cron_error("60 * * * *"),
            "cron `60 * * * *`: minute `60` (field 1 of 5): 60 is outside 0-59"
        );
        assert_eq!(
            cron_error("0 0 12 32 * *"),
            "cron `0 0 12 32 * *`: day-of-month `32` (field 4 of 6): 32 is outside 1-31"
        );
        assert_eq!(
            cron_error("0 0 1-25 * * *"),
            "cron `0 0 1-25 * * *`: hour `1-25` (field 3 of 6): 25 is outside 0-23"
        );
        assert_eq!(
            cron_error("0 0 * 13 *"),
            "cron `0 0 * 13 *`: month `13` (field 4 of 5): 13 is outside 1-12"
        );
        assert!(cron_error("*/0 * * * *").contains("a step must be at least 1"));
        // The bounds are inclusive.
        sched("59 23 31 12 *", "UTC");
        sched("0 59 23 31 12 7 2100", "UTC");
        sched("0 0 0 1 1 1 1970", "UTC");
    }

    /// Every tick in `(from, to]`, walking a fake clock forward tick by tick.
    fn ticks(s: &Schedule, from: &str, to: &str) -> Vec<String> {
        let (mut t, end) = (utc(from), utc(to));
        let mut out = Vec::new();
        while let Some(n) = s.next_after(t) {
            if n > end {
                break;
            }
            out.push(tick_label(n));
            t = n;
        }
        out
    }

    #[test]
    fn berlin_spring_forward_skips_the_missing_local_time() {
        // 2026-03-29: 02:00 CET jumps to 03:00 CEST; 02:30 local does not exist that day.
        let s = sched("0 30 2 * * *", "Europe/Berlin");
        assert_eq!(
            ticks(&s, "2026-03-27T12:00:00Z", "2026-03-30T12:00:00Z"),
            ["2026-03-28T01:30:00Z", "2026-03-30T00:30:00Z"]
        );
        // Hourly: the 02:xx hour is missing, the others fire once each.
        let h = sched("0 15 * * * *", "Europe/Berlin");
        assert_eq!(
            ticks(&h, "2026-03-28T23:00:00Z", "2026-03-29T03:00:00Z"),
            [
                "2026-03-28T23:15:00Z",
                "2026-03-29T00:15:00Z",
                "2026-03-29T01:15:00Z",
                "2026-03-29T02:15:00Z"
            ]
        );
    }

    #[test]
    fn berlin_fall_back_fires_a_repeated_local_time_once() {
        // 2026-10-25: 03:00 CEST falls back to 02:00 CET; 02:30 local happens twice.
        let s = sched("0 30 2 * * *", "Europe/Berlin");
        assert_eq!(
            ticks(&s, "2026-10-23T12:00:00Z", "2026-10-26T12:00:00Z"),
            [
                "2026-10-24T00:30:00Z",
                "2026-10-25T00:30:00Z",
                "2026-10-26T01:30:00Z"
            ]
        );
        // Fixed minute and hour lists/ranges are fixed times too: once each.
        let l = sched("0 0,30 2-3 * * *", "Europe/Berlin");
        assert!(!l.is_interval());
        assert_eq!(
            ticks(&l, "2026-10-24T23:50:00Z", "2026-10-25T03:10:00Z"),
            [
                "2026-10-25T00:00:00Z", // 02:00 CEST
                "2026-10-25T00:30:00Z", // 02:30 CEST
                "2026-10-25T02:00:00Z", // 03:00 CET
                "2026-10-25T02:30:00Z", // 03:30 CET
            ]
        );
    }

    #[test]
    fn berlin_fall_back_keeps_the_real_time_pace_of_interval_schedules() {
        // Every 20 minutes across the repeated hour: the real-time pace goes on (Vixie cron),
        // 02:00, 02:20, 02:40 CEST and then the same local times again in CET.
        let m = sched("0 */20 * * * *", "Europe/Berlin");
        assert!(m.is_interval());
        assert_eq!(
            ticks(&m, "2026-10-24T23:50:00Z", "2026-10-25T02:10:00Z"),
            [
                "2026-10-25T00:00:00Z",
                "2026-10-25T00:20:00Z",
                "2026-10-25T00:40:00Z", // 02:00, 02:20, 02:40 CEST
                "2026-10-25T01:00:00Z",
                "2026-10-25T01:20:00Z",
                "2026-10-25T01:40:00Z", // 02:00, 02:20, 02:40 CET
                "2026-10-25T02:00:00Z", // 03:00 CET
            ]
        );
        // The issue's case: every 10 s, 15 s before the change, for a minute: 6 ticks a minute.
        let s = sched("*/10 * * * * *", "Europe/Berlin");
        assert_eq!(
            ticks(&s, "2026-10-25T00:59:45Z", "2026-10-25T01:00:45Z"),
            [
                "2026-10-25T00:59:50Z",
                "2026-10-25T01:00:00Z",
                "2026-10-25T01:00:10Z",
                "2026-10-25T01:00:20Z",
                "2026-10-25T01:00:30Z",
                "2026-10-25T01:00:40Z",
            ]
        );
        // A wildcard hour with a fixed minute: hourly in real time, 02:15 CEST and 02:15 CET.
        let h = sched("0 15 * * * *", "Europe/Berlin");
        assert_eq!(
            ticks(&h, "2026-10-24T23:00:00Z", "2026-10-25T03:00:00Z"),
            [
                "2026-10-24T23:15:00Z",
                "2026-10-25T00:15:00Z",
                "2026-10-25T01:15:00Z",
                "2026-10-25T02:15:00Z"
            ]
        );
        // Every second through the whole change: 3,600 × 3 ticks in three real hours, no gap.
        let e = sched("* * * * * *", "Europe/Berlin");
        let all = ticks(&e, "2026-10-24T23:59:59Z", "2026-10-25T02:59:59Z");
        assert_eq!(all.len(), 3 * 3600);
        assert_eq!(
            all.first().map(String::as_str),
            Some("2026-10-25T00:00:00Z")
        );
    }

    #[test]
    fn spring_forward_of_an_interval_schedule_goes_on_after_the_gap() {
        let s = sched("*/10 * * * * *", "Europe/Berlin");
        assert_eq!(
            ticks(&s, "2026-03-29T00:59:45Z", "2026-03-29T01:00:10Z"),
            [
                "2026-03-29T00:59:50Z", // 01:59:50 CET
                "2026-03-29T01:00:00Z", // 03:00:00 CEST
                "2026-03-29T01:00:10Z",
            ]
        );
        // A zone without changes is the crate's plain enumeration.
        let u = sched("*/10 * * * * *", "UTC");
        assert_eq!(
            ticks(&u, "2026-03-29T00:59:45Z", "2026-03-29T01:00:10Z"),
            [
                "2026-03-29T00:59:50Z",
                "2026-03-29T01:00:00Z",
                "2026-03-29T01:00:10Z",
            ]
        );
    }

    #[test]
    fn the_cron_crate_alone_fires_a_repeated_time_twice() {
        // Why `next_after` filters: the crate yields both instants of 02:30 on 2026-10-25.
        let s = sched("0 30 2 * * *", "Europe/Berlin");
        let from = utc("2026-10-24T12:00:00Z").with_timezone(&s.tz);
        let raw: Vec<String> = s
            .cron
            .after(&from)
            .take(3)
            .map(|t| tick_label(t.with_timezone(&Utc)))
            .collect();
        assert_eq!(
            raw,
            [
                "2026-10-25T00:30:00Z",
                "2026-10-25T01:30:00Z",
                "2026-10-26T01:30:00Z"
            ]
        );
    }

    #[test]
    fn asked_from_inside_the_repeated_hour_never_goes_back() {
        // A fixed time (every second of 02:30 local): 01:30:00Z is 02:30:00 CET, the second
        // pass, whose local times already fired in CEST: the next is the next day's 02:30:00.
        let f = sched("* 30 2 * * *", "Europe/Berlin");
        assert!(!f.is_interval());
        assert_eq!(
            f.next_after(utc("2026-10-25T01:30:00Z"))
                .map(tick_label)
                .as_deref(),
            Some("2026-10-26T01:30:00Z")
        );
        // An interval schedule goes on in real time, never before the instant asked about.
        let s = sched("* * * * * *", "Europe/Berlin");
        assert_eq!(
            s.next_after(utc("2026-10-25T01:30:00Z"))
                .map(tick_label)
                .as_deref(),
            Some("2026-10-25T01:30:01Z")
        );
        assert_eq!(
            s.next_after(utc("2026-10-25T00:59:58Z"))
                .map(tick_label)
                .as_deref(),
            Some("2026-10-25T00:59:59Z")
        );
        assert_eq!(
            s.next_after(utc("2026-10-25T00:59:59.500Z"))
                .map(tick_label)
                .as_deref(),
            Some("2026-10-25T01:00:00Z")
        );
    }

    #[test]
    fn utc_every_second_and_five_field_cron() {
        let s = sched("* * * * * *", "UTC");
        assert_eq!(
            ticks(&s, "2026-01-01T00:00:00Z", "2026-01-01T00:00:03Z"),
            [
                "2026-01-01T00:00:01Z",
                "2026-01-01T00:00:02Z",
                "2026-01-01T00:00:03Z"
            ]
        );
        let five = sched("*/15 * * * *", "UTC");
        assert_eq!(five.spec.cron, "0 */15 * * * *");
        assert_eq!(
            five.next_after(utc("2026-01-01T00:07:00Z"))
                .map(tick_label)
                .as_deref(),
            Some("2026-01-01T00:15:00Z")
        );
    }

    #[test]
    fn bad_definitions_say_what_is_wrong() {
        let mk = |v: Value| {
            Schedule::new(serde_json::from_value(v).unwrap())
                .unwrap_err()
                .to_string()
        };
        assert!(
            mk(json!({"name": "a b", "cron": "* * * * * *", "task": {"kind": "x"}}))
                .contains("name")
        );
        assert!(
            mk(json!({"name": "a", "cron": "* * *", "task": {"kind": "x"}})).contains("fields")
        );
        assert!(
            mk(json!({"name": "a", "cron": "99 * * * * *", "task": {"kind": "x"}}))
                .contains("cron")
        );
        assert!(mk(json!({"name": "a", "cron": "* * * * * *", "timezone": "Mars/Base", "task": {"kind": "x"}})).contains("Mars/Base"));
        assert!(
            mk(json!({"name": "a", "cron": "* * * * * *", "task": {"payload": 1}}))
                .contains("kind")
        );
        assert!(mk(
            json!({"name": "a", "cron": "* * * * * *", "task": {"kind": "x", "id": "fixed"}})
        )
        .contains("`id`"));
        assert!(mk(
            json!({"name": "a", "cron": "* * * * * *", "task": {"kind": "x", "lane": "fast"}})
        )
        .contains("lane"));
        assert!(mk(
            json!({"name": "a", "cron": "* * * * * *", "task": {"kind": "x"}, "catch_up_max": 0})
        )
        .contains("catch_up_max"));
    }

    #[test]
    fn a_tick_makes_a_deterministic_envelope() {
        let s = sched("* * * * * *", "UTC");
        let tick = utc("2026-01-01T00:00:05Z");
        let a = s.tick_envelope(tick, Utc::now(), 5).unwrap();
        let b = s.tick_envelope(tick, Utc::now(), 5).unwrap();
        assert_eq!(a.id, "s@2026-01-01T00:00:05Z");
        assert_eq!(a.id, b.id);
        assert_eq!(a.kind, "noop");
        assert_eq!(a.max_attempts, Some(5));
    }
}
