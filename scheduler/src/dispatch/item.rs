//! One delivery on its way through a batch ([`Item`]), and its first step: reading the
//! envelope and screening it ([`Item::read`]).

use fleet::{broker::amqp, broker::delay, metrics as m, status, Envelope};
use lapin::message::Delivery;

use super::{Fate, ReserveMode, Source};
use crate::config::SchedulerConfig;

/// One delivery of a batch: what it is and what becomes of it.
pub struct Item {
    /// The message as it came (acked, requeued or handed back as the batch settles).
    pub delivery: Delivery,
    /// The task, `None` when the delivery is no readable envelope (then its fate is decided:
    /// [`Source::refused`]).
    pub envelope: Option<Envelope>,
    /// What becomes of it; `None` until the reservation decides (a task to route).
    pub fate: Option<Fate>,
    /// What the reservation call is asked about it; `None`: nothing (refused, or screened
    /// out by a source that does not dedupe what it does not route).
    pub ask: Option<ReserveMode>,
}

impl Item {
    /// Reads `delivery` from `source` at `now` (the store's clock): parses the envelope under
    /// the source's limits and, for a source that screens ([`Source::screens`]), normalises it
    /// and decides the fate of an expired task (dead-lettered `expired`) or one not due yet (a
    /// delay tier) and, when `pauses` holds its kind or its batch, its hold queue
    /// ([`crate::pause`]: parked behind the pseudo-group [`crate::pause::hold_group`]). What is
    /// left is asked of the reservation.
    pub fn read(
        delivery: Delivery,
        source: &Source,
        cfg: &SchedulerConfig,
        now: chrono::DateTime<chrono::Utc>,
        pauses: Option<&fleet::control::PauseSet>,
    ) -> Item {
        let mut item = Item {
            delivery,
            envelope: None,
            fate: None,
            ask: None,
        };
        let e = match parse(&item.delivery, source, cfg, now) {
            Ok(e) => e,
            Err(r) => {
                item.fate = Some(source.refused(&r));
                return item;
            }
        };
        if source.counts_submitted() {
            metrics::counter!(m::TASKS_SUBMITTED, "lane" => e.lane.as_str()).increment(1);
        }
        let unrouted = source.dedupes_unrouted().then_some(ReserveMode::DedupeOnly);
        (item.fate, item.ask) = if !source.screens() {
            (None, Some(source.mode()))
        } else if e.is_expired(now) {
            (
                Some(Fate::Dead(
                    status::DeadReason::Expired,
                    "deadline passed before dispatch".into(),
                )),
                unrouted,
            )
        } else if let Some(tier) = e
            .not_before
            .and_then(|nb| (nb - now).to_std().ok())
            .and_then(delay::tier_for)
        {
            (Some(Fate::Delay(tier)), unrouted)
        } else if let Some(g) = pauses
            .and_then(|p| p.held(&e.kind, fleet::batch::batch_of(&e)))
            .as_ref()
            .and_then(crate::pause::hold_group)
        {
            // Its kind or its batch is paused fleet-wide: it waits in the hold's queue, not
            // behind a group (where it would block other kinds and batches).
            (Some(Fate::Park(g)), unrouted)
        } else {
            (None, Some(source.mode()))
        };
        item.envelope = Some(e);
        item
    }

    /// Whether the reservation is asked to route it (not only to dedupe it).
    pub fn to_route(&self) -> bool {
        self.ask.is_some_and(|mode| mode != ReserveMode::DedupeOnly)
    }
}

/// The envelope of `d` from `source`, or why it is refused.
fn parse(
    d: &Delivery,
    source: &Source,
    cfg: &SchedulerConfig,
    now: chrono::DateTime<chrono::Utc>,
) -> Result<Envelope, fleet::task::Reject> {
    let limits = source.limits(cfg.common.limits);
    // A body without an id takes the AMQP `message_id` of a submission.
    let message_id = source.default_id(d);
    // A dead-letter replay is measured without fleet's fields from its first pass.
    let replay = source.is_replay(d);
    let parse_limits = if replay { limits.internal() } else { limits };
    let mut e = Envelope::parse_with_id(&d.data, &parse_limits, message_id.as_deref())?;
    // Measured only for a replay (the measure writes the envelope out: not per task).
    if replay {
        let size = d.data.len().saturating_sub(e.fleet_fields_len());
        if size > limits.max_bytes {
            return Err(fleet::task::Reject::Oversized {
                size,
                limit: limits.max_bytes,
            });
        }
    }
    if let Some(lane) = source.lane() {
        e.lane = lane;
    }
    // A deadline runs from submission: the producer's `submitted_at`, else the API's
    // `x-fleet-submitted-at` header (ms), else the AMQP `timestamp` property (s), else now
    // (first seen here).
    if source.starts_clock() && e.submitted_at.is_none() {
        let header = amqp::header_text(&d.properties, amqp::SUBMITTED_AT_HEADER)
            .and_then(|ms| fleet::task::headers::parse_submitted_at(&ms));
        // The AMQP timestamp has whole seconds: it is taken only when the task evidently
        // waited (2 s or more); a fresh one runs from now, so the truncation never takes up
        // to a second off a short timeout.
        let stamp = d
            .properties
            .timestamp()
            .and_then(|t| i64::try_from(t).ok())
            .and_then(|t| chrono::DateTime::from_timestamp(t, 0))
            .filter(|t| now - *t >= chrono::Duration::seconds(2));
        e.submitted_at = header.or(stamp);
    }
    if source.starts_clock() && e.trace.is_none() {
        e.trace = trace_context(d, fleet::trace::enabled());
    }
    if source.screens() {
        e.normalize(now, cfg.common.default_max_attempts)?;
    }
    Ok(e)
}

/// The trace context of a submission without one in its body: the producer's `traceparent`
/// (and `tracestate`) AMQP headers when valid, else a new trace when spans are exported
/// (`export`), else none (W3C Trace Context: an invalid one is ignored, never refused). Costs
/// one header lookup when the producer sent none and spans are not exported.
fn trace_context(d: &Delivery, export: bool) -> Option<fleet::task::TraceContext> {
    use fleet::task::trace::{TraceContext, TRACEPARENT, TRACESTATE};
    let given = amqp::header_text(&d.properties, TRACEPARENT).and_then(|tp| {
        let ts = amqp::header_text(&d.properties, TRACESTATE);
        TraceContext::parse(&tp, ts.as_deref())
    });
    given.or_else(|| export.then(TraceContext::generate))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dispatch::Orphan;
    use fleet::Lane;

    fn cfg() -> SchedulerConfig {
        SchedulerConfig::from_settings(&fleet::settings::Settings::default()).unwrap()
    }

    fn delivery(body: Vec<u8>) -> Delivery {
        Delivery::mock(1, "".into(), "".into(), false, body)
    }

    /// A producer's valid `traceparent` header is taken; an invalid one is ignored: a fresh
    /// trace when spans are exported, none when not — never a refusal.
    #[test]
    fn an_invalid_traceparent_starts_a_fresh_trace() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let with = |v: &str| {
            let mut d = delivery(b"{}".to_vec());
            d.properties =
                amqp::task_properties("x", Some(amqp::headers([("traceparent", v.to_string())])));
            d
        };
        let given = trace_context(&with(tp), false).unwrap();
        assert_eq!(given.traceparent(), tp);
        let bad = with("00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01");
        assert_eq!(trace_context(&bad, false), None);
        let fresh = trace_context(&bad, true).unwrap();
        assert_ne!(fresh.trace_id, given.trace_id);
        assert_ne!(fresh.trace_id, [0; 16]);
        assert_eq!(trace_context(&delivery(b"{}".to_vec()), false), None);
        // Read through a whole submission: the task is admitted, with its fresh trace or none.
        let (cfg, now) = (cfg(), chrono::Utc::now());
        let body = Envelope::new("resize", serde_json::json!({})).to_bytes();
        let mut d = with("garbage");
        d.data = body;
        let i = Item::read(d, &Source::Ingress(Lane::Normal), &cfg, now, None);
        assert_eq!(i.ask, Some(ReserveMode::Route));
        assert_eq!(i.envelope.and_then(|e| e.trace), None);
    }

    fn orphan() -> Source {
        Source::Orphan(Orphan {
            group: "g".into(),
            lane: Lane::Critical,
            own_key: "g.critical".into(),
        })
    }

    /// The screening decides expired and delayed tasks before the reservation; what is left
    /// is asked in the source's mode, and only a submission's screened-out tasks are still
    /// asked for dedupe.
    #[test]
    fn reading_screens_by_source() {
        let (cfg, now) = (cfg(), chrono::Utc::now());
        let task = |f: &dyn Fn(&mut Envelope)| {
            let mut e = Envelope::new("resize", serde_json::json!({}));
            f(&mut e);
            e.to_bytes()
        };
        let due = task(&|_| {});
        let expired = task(&|e| e.deadline = Some(now - chrono::Duration::seconds(1)));
        let later = task(&|e| e.not_before = Some(now + chrono::Duration::seconds(60)));
        let read = |body: &[u8], s: &Source| {
            let i = Item::read(delivery(body.to_vec()), s, &cfg, now, None);
            (i.fate.map(|f| format!("{f:?}")), i.ask)
        };
        let ingress = Source::Ingress(Lane::Critical);
        let expired_fate = Some(r#"Dead(Expired, "deadline passed before dispatch")"#.to_string());
        let delay_fate = Some("Delay(51200)".to_string());
        use ReserveMode::*;
        type Row<'a> = (&'a [u8], Source, (Option<String>, Option<ReserveMode>));
        let rows: Vec<Row<'_>> = vec![
            (&due[..], ingress.clone(), (None, Some(Route))),
            (&due[..], Source::Delayed, (None, Some(Route))),
            (&due[..], Source::Park, (None, Some(Release))),
            (&due[..], Source::Unmatched, (None, Some(Route))),
            (&due[..], orphan(), (None, Some(Release))),
            (
                &expired[..],
                ingress.clone(),
                (expired_fate.clone(), Some(DedupeOnly)),
            ),
            (&expired[..], Source::Delayed, (expired_fate.clone(), None)),
            (&expired[..], Source::Park, (expired_fate, None)),
            // An orphan is moved as it is, expired or not: its worker judges it.
            (&expired[..], orphan(), (None, Some(Release))),
            (
                &later[..],
                ingress.clone(),
                (delay_fate.clone(), Some(DedupeOnly)),
            ),
            (&later[..], Source::Unmatched, (delay_fate, None)),
            (&later[..], orphan(), (None, Some(Release))),
        ];
        for (body, source, want) in rows {
            assert_eq!(read(body, &source), want, "{source:?}");
        }
    }

    /// A submission takes its routing key's lane and starts its clock; an orphan takes its
    /// queue's lane and is not normalised (it is published as it came).
    #[test]
    fn a_source_sets_lane_and_clock() {
        let (cfg, now) = (cfg(), chrono::Utc::now());
        let body = Envelope::new("resize", serde_json::json!({})).to_bytes();
        let i = Item::read(
            delivery(body.clone()),
            &Source::Ingress(Lane::Critical),
            &cfg,
            now,
            None,
        );
        let e = i.envelope.unwrap();
        assert_eq!((e.lane, e.submitted_at), (Lane::Critical, Some(now)));
        assert!(e.max_attempts.is_some(), "normalised");
        let i = Item::read(delivery(body), &orphan(), &cfg, now, None);
        let e = i.envelope.unwrap();
        assert_eq!(
            (e.lane, e.submitted_at, e.max_attempts),
            (Lane::Critical, None, None)
        );
    }

    /// A delivery that is no envelope is dead-lettered with its reason — except an orphan's,
    /// which is held for the rescue to put back (a worker dead-letters it).
    #[test]
    fn a_refused_delivery_dies_unless_it_is_an_orphan() {
        let (cfg, now) = (cfg(), chrono::Utc::now());
        for (source, want) in [
            (Source::Ingress(Lane::Normal), "Dead(MalformedJson"),
            (Source::Delayed, "Dead(MalformedJson"),
            (Source::Park, "Dead(MalformedJson"),
            (Source::Unmatched, "Dead(MalformedJson"),
            (orphan(), "Hold"),
        ] {
            let i = Item::read(delivery(b"not json".to_vec()), &source, &cfg, now, None);
            let fate = format!("{:?}", i.fate);
            assert!(
                fate.starts_with(&format!("Some({want}")),
                "{source:?}: {fate}"
            );
            assert!(i.envelope.is_none() && i.ask.is_none(), "{source:?}");
        }
    }
}
