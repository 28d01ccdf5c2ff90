//! Every message and request header fleet writes or reads, in one place.
//!
//! AMQP headers on task messages (set by the worker, the scheduler or `fleetctl`, read by
//! [`crate::broker::dead`], the worker's attempt loop and the tests) and the HTTP request headers the
//! worker's `http` executor sends to a task's endpoint. Values are text; numeric ones are
//! decimal (`ATTEMPTS`; `SUBMITTED_AT` in ms since the Unix epoch, with a fraction: see
//! [`submitted_at_value`]). Read them with
//! [`crate::broker::amqp::header_text`] / [`crate::broker::amqp::header_str`]; write them with
//! [`crate::broker::amqp::headers`].

/// Why a task was dead-lettered: a bounded reason code (`max_attempts`, `expired`,
/// `permanent_error`, `malformed_json`...).
pub const REASON: &str = "x-fleet-reason";
/// The human detail of a dead-lettering (last error, refused field...), at most 1 KiB.
pub const DETAIL: &str = "x-fleet-detail";
/// The last worker that ran a dead task (AMQP); the worker running the attempt (HTTP executor).
pub const WORKER: &str = "x-fleet-worker";
/// The attempts a dead task made (decimal).
pub const ATTEMPTS: &str = "x-fleet-attempts";
/// Marks a dead letter replayed by `fleetctl dead replay` (value `1`).
pub const REPLAY: &str = "x-fleet-replay";
/// On the scheduler's health probes (published straight to a group's critical queue;
/// producers' tasks are republished by the scheduler with headers of its own, so they cannot
/// carry it): a probe that fails or expires is dropped, never dead-lettered.
pub const PROBE: &str = "x-fleet-probe";
/// Set by `POST /v1/tasks` on what it publishes: the submission time (ms since the epoch) of an
/// envelope without `submitted_at`, so its deadline runs from the HTTP request.
pub const SUBMITTED_AT: &str = "x-fleet-submitted-at";
/// Selects a delay tier on the delay (headers) exchange. Not `x-` prefixed: RabbitMQ ignores
/// `x-` headers when matching, which would bind every tier to every message.
pub const TIER: &str = "fleet-tier";
/// On a message in a delay tier: when its hop ends (ms since the epoch, the fleet's clock) —
/// the scheduler's tier loop holds it until then, then forwards it to `<ns>.delayed`
/// ([`crate::broker::delay`]). `x-` prefixed, so the delay exchange's matching ignores it.
pub const HOP_DUE: &str = "x-fleet-hop-due";
/// HTTP executor request header: the task's id.
pub const TASK_ID: &str = "x-fleet-task-id";
/// HTTP executor request header: the attempt number, from 1.
pub const ATTEMPT: &str = "x-fleet-attempt";

/// The [`SUBMITTED_AT`] value of `t`: milliseconds since the epoch with three decimals
/// (`1796093365123.456`), so a wait measured from it is not up to 1 ms too long. A reader of
/// whole milliseconds (an older scheduler) refuses it and falls back to the AMQP timestamp.
pub fn submitted_at_value(t: chrono::DateTime<chrono::Utc>) -> String {
    format!(
        "{}.{:03}",
        t.timestamp_millis(),
        t.timestamp_subsec_micros() % 1000
    )
}

/// Reads a [`SUBMITTED_AT`] value: whole or fractional milliseconds since the epoch (µs kept;
/// both forms, so messages published before an upgrade still read). `None` if it is neither.
pub fn parse_submitted_at(v: &str) -> Option<chrono::DateTime<chrono::Utc>> {
    let (ms, frac) = match v.split_once('.') {
        Some((ms, frac)) => (ms, Some(frac)),
        None => (v, None),
    };
    let ms: i64 = ms.parse().ok()?;
    let us = match frac {
        None => 0,
        Some(f) if (1..=3).contains(&f.len()) && f.bytes().all(|b| b.is_ascii_digit()) => {
            f.parse::<i64>().ok()? * 10_i64.pow(3 - f.len() as u32)
        }
        Some(_) => return None,
    };
    chrono::DateTime::from_timestamp_micros(ms.checked_mul(1000)?.checked_add(us)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn submitted_at_round_trips_with_microseconds() {
        let t = chrono::DateTime::from_timestamp_micros(1_796_093_365_123_456).unwrap();
        assert_eq!(submitted_at_value(t), "1796093365123.456");
        assert_eq!(parse_submitted_at(&submitted_at_value(t)), Some(t));
        // Whole milliseconds (an older API) still read.
        assert_eq!(
            parse_submitted_at("1796093365123"),
            chrono::DateTime::from_timestamp_millis(1_796_093_365_123)
        );
        assert_eq!(
            parse_submitted_at("1796093365123.4"),
            chrono::DateTime::from_timestamp_micros(1_796_093_365_123_400)
        );
        for bad in ["", "x", "12.", "12.3456", "12.-1", "1e3"] {
            assert_eq!(parse_submitted_at(bad), None, "{bad}");
        }
    }
}
