//! Span export over OTLP: the spans of a task's way through fleet, in its producer's trace.
//!
//! The trace context travels in the envelope ([`crate::task::trace`] says why and how it is
//! read). This wing turns the points of a task's way into spans, each a child of the producer's
//! span (the `parent-id` of its `traceparent`) and each with the attributes
//! [`ID`] (task id), [`KIND`], [`GROUP`], [`KEY`] (when the task has one) and [`ATTEMPT`]:
//!
//! | span | where | from → to |
//! |---|---|---|
//! | `admit` | scheduler | the submission read from ingress → screened (parse, limits, dedupe asked) |
//! | `reserve` | scheduler | the reservation call that decided it → its answer (`fleet.outcome`: dispatch, park, …); one per pass (a parked task is reserved again on release) |
//! | `queue wait` | worker | `submitted_at` → the start of its first attempt |
//! | `run` | worker | the executor's run of one attempt (`fleet.outcome`) |
//! | `ack` | worker | the outcome written and the delivery acked or republished |
//!
//! The handler's own spans belong under `run`: the http executor sends the context as a
//! `traceparent` header and the exec executor as `TRACEPARENT` (and `TRACESTATE`) in the
//! environment, both with `run`'s span id as parent when spans are exported (the producer's
//! otherwise); the builtin executor opens its span as `run`'s child.
//!
//! **Off by default, free when off.** Export starts only with `FLEET_OTLP_ENDPOINT`
//! ([`init`]); until then [`tracer`] is one atomic load answering `None`, and every caller
//! creates nothing. Spans are built with the `opentelemetry` API directly rather than through
//! `tracing-opentelemetry`: each has an explicit remote parent and most an explicit start time
//! (`queue wait` starts at submission, in another process), which the API says plainly, and no
//! `tracing` span of fleet's loops is exported by accident. Export is batched on the SDK's
//! background thread (at most [`BATCH_DELAY`] behind, [`QUEUE`] spans queued, the excess
//! dropped and never waited for), so a slow or absent collector never holds up a task;
//! [`Exporter::shutdown`] flushes what is queued on a clean stop.

mod export;

use std::sync::OnceLock;
use std::time::SystemTime;

use opentelemetry::trace::{
    Span as _, SpanContext, SpanId, SpanKind, TraceContextExt, TraceFlags, TraceId, TraceState,
    Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::SdkTracer;

use crate::task::TraceContext;
use crate::Envelope;

pub use export::{init, Exporter, BATCH_DELAY, QUEUE};

/// Attribute: the task's id.
pub const ID: &str = "fleet.task.id";
/// Attribute: the task's kind (handler name).
pub const KIND: &str = "fleet.task.kind";
/// Attribute: the group it was routed to or runs in (absent before routing).
pub const GROUP: &str = "fleet.group";
/// Attribute: its fairness key (envelope field `key`; absent when it has none).
pub const KEY: &str = "fleet.task.key";
/// Attribute: the attempt, from 1 (the attempt a scheduler span leads to).
pub const ATTEMPT: &str = "fleet.task.attempt";
/// Attribute: its lane.
pub const LANE: &str = "fleet.lane";
/// Attribute: what the step decided or how the run ended.
pub const OUTCOME: &str = "fleet.outcome";

static TRACER: OnceLock<SdkTracer> = OnceLock::new();

/// The process's tracer when spans are exported; `None` (one atomic load) when they are not.
#[inline]
pub fn tracer() -> Option<&'static SdkTracer> {
    TRACER.get()
}

/// Whether spans are exported (`FLEET_OTLP_ENDPOINT` set).
#[inline]
pub fn enabled() -> bool {
    TRACER.get().is_some()
}

/// The OpenTelemetry parent of a task's spans: its producer's span, as a remote span context.
pub fn parent(t: &TraceContext) -> Context {
    let state = t
        .state
        .as_deref()
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    Context::new().with_remote_span_context(SpanContext::new(
        TraceId::from_bytes(t.trace_id),
        SpanId::from_bytes(t.parent_id),
        TraceFlags::new(t.flags),
        true,
        state,
    ))
}

/// The attributes every span of `e` carries: id, kind, lane, attempt (`attempt`, from 1), the
/// group when known and the key when it has one.
pub fn attributes(e: &Envelope, group: Option<&str>, attempt: u32) -> Vec<KeyValue> {
    let mut a = vec![
        KeyValue::new(ID, e.id.clone()),
        KeyValue::new(KIND, e.kind.clone()),
        KeyValue::new(LANE, e.lane.as_str()),
        KeyValue::new(ATTEMPT, i64::from(attempt)),
    ];
    if let Some(g) = group {
        a.push(KeyValue::new(GROUP, g.to_string()));
    }
    if let Some(k) = &e.key {
        a.push(KeyValue::new(KEY, k.clone()));
    }
    a
}

/// Records a finished span `name` of task `e` from `start` to `end` under its producer's span;
/// nothing when spans are not exported or the task has no trace context. `outcome`, when
/// given, is the [`OUTCOME`] attribute.
pub fn record(
    name: &'static str,
    e: &Envelope,
    group: Option<&str>,
    attempt: u32,
    (start, end): (SystemTime, SystemTime),
    outcome: Option<&'static str>,
) {
    let (Some(tracer), Some(t)) = (tracer(), &e.trace) else {
        return;
    };
    let mut attrs = attributes(e, group, attempt);
    if let Some(o) = outcome {
        attrs.push(KeyValue::new(OUTCOME, o));
    }
    let mut span = tracer
        .span_builder(name)
        .with_kind(SpanKind::Internal)
        .with_start_time(start)
        .with_attributes(attrs)
        .start_with_context(tracer, &parent(t));
    span.end_with_timestamp(end);
}

/// A span still open (a run): its id is what a handler is given as parent.
pub struct Live {
    span: opentelemetry_sdk::trace::Span,
    trace: TraceContext,
}

impl Live {
    /// Opens span `name` of task `e` now under its producer's span; `None` when spans are not
    /// exported or the task has no trace context.
    pub fn start(
        name: &'static str,
        e: &Envelope,
        group: Option<&str>,
        attempt: u32,
    ) -> Option<Live> {
        let (tracer, t) = (tracer()?, e.trace.as_ref()?);
        let span = tracer
            .span_builder(name)
            .with_kind(SpanKind::Internal)
            .with_attributes(attributes(e, group, attempt))
            .start_with_context(tracer, &parent(t));
        let id = span.span_context().span_id().to_bytes();
        Some(Live {
            trace: t.child_of(id),
            span,
        })
    }

    /// The trace context a handler runs under: this span as its parent.
    pub fn context(&self) -> &TraceContext {
        &self.trace
    }

    /// The OpenTelemetry context of this span, for its children (the builtin executor's).
    pub fn otel_context(&self) -> Context {
        parent(&self.trace)
    }

    /// Ends it now with `outcome` (and the error, if any, as its status).
    pub fn end(mut self, outcome: &'static str, error: Option<&str>) {
        self.span.set_attribute(KeyValue::new(OUTCOME, outcome));
        if let Some(e) = error {
            self.span
                .set_status(opentelemetry::trace::Status::error(e.to_string()));
        }
        self.span.end();
    }
}

/// Opens a child span `name` of `parent` (the builtin executor's span under `run`); `None`
/// when spans are not exported.
pub fn child(name: String, parent: &TraceContext) -> Option<opentelemetry_sdk::trace::Span> {
    let tracer = tracer()?;
    Some(
        tracer
            .span_builder(name)
            .with_kind(SpanKind::Internal)
            .start_with_context(tracer, &self::parent(parent)),
    )
}

/// The trace context a handler is given: `run`'s when spans are exported, else the
/// producer's as it came (so a handler that exports its own spans still joins the trace).
pub fn for_handler<'a>(e: &'a Envelope, run: Option<&'a Live>) -> Option<&'a TraceContext> {
    run.map(Live::context).or(e.trace.as_ref())
}
