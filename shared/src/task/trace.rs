//! A task's trace context: the W3C Trace Context `traceparent` and `tracestate` of the
//! producer's span (<https://www.w3.org/TR/trace-context/>, W3C Recommendation), as data.
//!
//! **Where it travels: in the envelope**, as the top-level fields `traceparent` and
//! `tracestate`, not as AMQP headers. Every hop of a task re-serialises its envelope
//! ([`crate::Envelope::to_bytes`]) and builds its message headers afresh: dispatch, park,
//! delay tiers, worker retries, dead-lettering, the cancelled queue, dead-letter replays and
//! the orphan rescue — ten republish sites, each of which would need a header copy that a
//! later change could forget, silently cutting the trace. The envelope is what all of them
//! already carry whole, and what a dead letter keeps for a replay. The producer still gives the
//! context the W3C way — an AMQP header `traceparent` / `tracestate` on its publish, an HTTP
//! header on `POST /v1/tasks` — and the scheduler's ingress moves it into the envelope once
//! (a producer may also write the fields in the body; the body wins). Cost when the producer
//! sends none and export is off: one header-table lookup at ingress and nothing in the
//! envelope.
//!
//! An invalid `traceparent` (wrong length, upper-case or non-hex digits, an all-zero id,
//! version `ff`) is ignored, never refused: the task goes on without it, and a scheduler that
//! exports spans starts a new trace for it ([`TraceContext::generate`]), as the recommendation
//! asks of a receiver (§ 4.3: "the vendor … MUST create a new trace").

use rand::RngCore;

/// The `traceparent` field / header name (lower case, as the recommendation spells it).
pub const TRACEPARENT: &str = "traceparent";
/// The `tracestate` field / header name.
pub const TRACESTATE: &str = "tracestate";
/// The longest `tracestate` kept, in bytes: the recommendation's limit for what a vendor must
/// propagate (§ 3.3.1.1: 512 characters); a longer one is dropped whole.
pub const MAX_TRACESTATE_BYTES: usize = 512;

/// A W3C trace context: trace id, parent span id, flags and the vendors' `tracestate`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    /// The 16-byte trace id (never all zero).
    pub trace_id: [u8; 16],
    /// The 8-byte id of the parent span (never all zero): the producer's span, or the span a
    /// handler runs under once fleet passes it on.
    pub parent_id: [u8; 8],
    /// Trace flags; bit 0 is `sampled`.
    pub flags: u8,
    /// The `tracestate` list as received (at most [`MAX_TRACESTATE_BYTES`], no control
    /// characters), `None` when absent or dropped.
    pub state: Option<String>,
}

impl TraceContext {
    /// Parses a `traceparent` value (`00-<32 hex>-<16 hex>-<2 hex>`, lower-case hex; a later
    /// version's longer value is read by its first four fields) and, if given, a `tracestate`.
    /// `None` for an invalid `traceparent`; an invalid `tracestate` is dropped alone.
    ///
    /// # Examples
    /// ```
    /// use fleet::task::TraceContext;
    /// let t = TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None).unwrap();
    /// assert_eq!(t.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
    /// assert!(TraceContext::parse("00-00000000000000000000000000000000-00f067aa0ba902b7-01", None).is_none());
    /// ```
    pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<TraceContext> {
        let tp = traceparent.trim().as_bytes();
        if tp.len() < 55 || tp[2] != b'-' || tp[35] != b'-' || tp[52] != b'-' {
            return None;
        }
        let version = hex::<1>(&tp[0..2])?[0];
        // Version ff is invalid; version 00 is exactly 55 bytes; a later one may add fields
        // after a dash.
        if version == 0xff || (version == 0 && tp.len() != 55) || (tp.len() > 55 && tp[55] != b'-')
        {
            return None;
        }
        let trace_id = hex::<16>(&tp[3..35])?;
        let parent_id = hex::<8>(&tp[36..52])?;
        let flags = hex::<1>(&tp[53..55])?[0];
        if trace_id == [0; 16] || parent_id == [0; 8] {
            return None;
        }
        let state = tracestate
            .map(str::trim)
            .filter(|s| !s.is_empty() && s.len() <= MAX_TRACESTATE_BYTES)
            .filter(|s| s.bytes().all(|b| (0x20..0x7f).contains(&b)))
            .map(str::to_string);
        Some(TraceContext {
            trace_id,
            parent_id,
            flags,
            state,
        })
    }

    /// A new trace (random trace id and parent id, sampled): for a task that came without a
    /// valid context while spans are exported.
    pub fn generate() -> TraceContext {
        let mut rng = rand::rng();
        let mut trace_id = [0u8; 16];
        let mut parent_id = [0u8; 8];
        while trace_id == [0; 16] {
            rng.fill_bytes(&mut trace_id);
        }
        while parent_id == [0; 8] {
            rng.fill_bytes(&mut parent_id);
        }
        TraceContext {
            trace_id,
            parent_id,
            flags: 1,
            state: None,
        }
    }

    /// The same trace under another parent span (the span a handler runs in).
    pub fn child_of(&self, span_id: [u8; 8]) -> TraceContext {
        TraceContext {
            parent_id: span_id,
            ..self.clone()
        }
    }

    /// The `traceparent` value: `00-<trace id>-<parent id>-<flags>` (55 bytes).
    pub fn traceparent(&self) -> String {
        format!(
            "00-{}-{}-{:02x}",
            to_hex(&self.trace_id),
            to_hex(&self.parent_id),
            self.flags
        )
    }

    /// The trace id as 32 lower-case hex digits.
    pub fn trace_id_hex(&self) -> String {
        to_hex(&self.trace_id)
    }
}

/// `N` bytes from `2N` lower-case hex digits (upper case is invalid in a `traceparent`).
fn hex<const N: usize>(s: &[u8]) -> Option<[u8; N]> {
    if s.len() != 2 * N {
        return None;
    }
    let digit = |b: u8| match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        _ => None,
    };
    let mut out = [0u8; N];
    for (i, pair) in s.chunks_exact(2).enumerate() {
        out[i] = digit(pair[0])? << 4 | digit(pair[1])?;
    }
    Some(out)
}

fn to_hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    bytes
        .iter()
        .fold(String::with_capacity(bytes.len() * 2), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_valid_traceparent_round_trips() {
        let t = TraceContext::parse(TP, Some("congo=t61rcWkgMzE")).unwrap();
        assert_eq!(t.traceparent(), TP);
        assert_eq!(
            t.parent_id,
            [0x00, 0xf0, 0x67, 0xaa, 0x0b, 0xa9, 0x02, 0xb7]
        );
        assert_eq!(t.flags, 1);
        assert_eq!(t.state.as_deref(), Some("congo=t61rcWkgMzE"));
        // A later version's extra fields are ignored.
        let future = format!("cc{}-what-the-future-holds", &TP[2..]);
        assert_eq!(
            TraceContext::parse(&future, None).map(|t| t.trace_id),
            Some(t.trace_id)
        );
        let child = t.child_of([1; 8]);
        assert_eq!(child.trace_id, t.trace_id);
        assert_eq!(&child.traceparent()[36..52], "0101010101010101");
    }

    #[test]
    fn invalid_traceparents_are_ignored() {
        for bad in [
            "",
            "garbage",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceContext::parse(bad, None), None, "{bad}");
        }
        // A bad tracestate is dropped alone.
        let long = "a=".to_string() + &"b".repeat(MAX_TRACESTATE_BYTES);
        for bad_state in [long.as_str(), "a=b\nc=d", ""] {
            let t = TraceContext::parse(TP, Some(bad_state)).unwrap();
            assert_eq!(t.state, None);
        }
    }

    #[test]
    fn generated_contexts_are_valid_and_fresh() {
        let (a, b) = (TraceContext::generate(), TraceContext::generate());
        assert_ne!(a.trace_id, b.trace_id);
        assert_eq!(TraceContext::parse(&a.traceparent(), None), Some(a));
    }
}
