//! The task envelope: what producers publish, in any language.
//!
//! Parsing is done field by field from `serde_json::Value`s, not by `#[derive(Deserialize)]`,
//! so that every refusal names the field at fault (`bad_field: max_attempts: expected a
//! non-negative integer`) and unknown fields are kept verbatim (forward compatibility). Bytes
//! are read in one pass ([`Fields`]): each known field's value straight into its slot, only
//! unknown ones into a map — the same result as parsing the whole object into a `Value` and
//! taking the fields out of it ([`Envelope::from_value_limited`]), without building and
//! emptying that map once per task. One difference, on purpose: serde_json (its `raw_value`
//! feature) reads an object whose first key is `$serde_json::private::RawValue` as the JSON
//! text in that key's string, when it builds a `Value`; the one-pass read takes it as an
//! ordinary unknown field, as it takes every other key. The schema shipped in
//! `shared/schema/envelope.schema.json` is checked against this code by tests.

use std::collections::BTreeMap;

use chrono::{DateTime, Duration, Utc};
use serde_json::{Map, Value};

use super::{Lane, Strategy};
use crate::task::{Labels, PROTOCOL_LABEL};

/// Envelope format version written by this code.
pub const VERSION: u64 = 1;
/// The JSON Schema of the envelope, as shipped for producers in other languages.
pub const SCHEMA: &str = include_str!("../../schema/envelope.schema.json");
/// `not_before` further ahead than this is refused as absurd.
pub const MAX_DELAY: Duration = Duration::days(30);

/// Why an envelope was refused. `code()` is the bounded `reason` label of
/// `fleet_tasks_rejected_total` and the `x-fleet-reason` header; `Display` is the detail.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Reject {
    /// Not JSON (the parser's message).
    #[error("malformed JSON: {0}")]
    MalformedJson(String),
    /// JSON, but not an object.
    #[error("the envelope must be a JSON object")]
    NotAnObject,
    /// No `kind`.
    #[error("missing required field `kind`")]
    MissingKind,
    /// A known field of the wrong type or value: (field, what was expected).
    #[error("field `{0}`: {1}")]
    BadField(&'static str, String),
    /// A `lane` other than `normal` or `critical`.
    #[error("unknown lane `{0}` (use normal or critical)")]
    UnknownLane(String),
    /// Larger than the size limit, in bytes as encoded.
    #[error("envelope is {size} bytes, over the limit of {limit}")]
    Oversized {
        /// The envelope's size, in bytes.
        size: usize,
        /// The limit, in bytes.
        limit: usize,
    },
    /// `labels` that are not a valid selector (the selector parser's message).
    #[error("invalid label selector: {0}")]
    BadSelector(String),
    /// A `strategy` fleet does not know.
    #[error("unknown strategy `{0}` (use least_loaded, round_robin or weighted)")]
    UnknownStrategy(String),
    /// `not_before` further ahead than [`MAX_DELAY`] (its days).
    #[error("not_before is more than {0} days ahead")]
    TooFarAhead(i64),
    /// A dimension past its limit (label pairs, id or kind bytes, payload depth).
    #[error("{what} is {got}, over the limit of {limit}")]
    OverLimit {
        /// Which dimension (`label pairs`, `id bytes`, ...).
        what: &'static str,
        /// Its value in this envelope.
        got: usize,
        /// Its limit ([`Limits`]).
        limit: usize,
    },
}

impl Reject {
    /// The bounded reason word: `malformed_json`, `not_an_object`, `missing_kind`,
    /// `bad_field`, `unknown_lane`, `oversized`, `bad_selector`, `unknown_strategy`,
    /// `bad_not_before` or `over_limit`.
    pub fn code(&self) -> &'static str {
        match self {
            Reject::MalformedJson(_) => "malformed_json",
            Reject::NotAnObject => "not_an_object",
            Reject::MissingKind => "missing_kind",
            Reject::BadField(..) => "bad_field",
            Reject::UnknownLane(_) => "unknown_lane",
            Reject::Oversized { .. } => "oversized",
            Reject::BadSelector(_) => "bad_selector",
            Reject::UnknownStrategy(_) => "unknown_strategy",
            Reject::TooFarAhead(_) => "bad_not_before",
            Reject::OverLimit { .. } => "over_limit",
        }
    }
}

/// Bounds on every dimension of an envelope, checked at the door (the scheduler's ingress and
/// `POST /v1/tasks`) before any state is written, so no input can make a Redis script or a log
/// line misbehave. Each has a setting (`FLEET_MAX_TASK_BYTES`, `FLEET_MAX_LABEL_PAIRS`,
/// `FLEET_MAX_ID_BYTES`, `FLEET_MAX_KIND_BYTES`, `FLEET_MAX_PAYLOAD_DEPTH`). Label keys and
/// values are bounded by the selector syntax itself (1-63 bytes of `[A-Za-z0-9_.-/]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest envelope, in bytes as the producer encoded it (checked once, on those bytes:
    /// what fleet adds later never counts against it).
    pub max_bytes: usize,
    /// Most `key=value` pairs in `labels` (the selector).
    pub max_label_pairs: usize,
    /// Longest `id`, in bytes (UTF-8).
    pub max_id_bytes: usize,
    /// Longest `kind`, in bytes (UTF-8).
    pub max_kind_bytes: usize,
    /// Deepest nesting of arrays and objects in `payload` (a scalar payload has depth 0).
    pub max_payload_depth: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_bytes: 1 << 20,
            max_label_pairs: 16,
            max_id_bytes: 200,
            max_kind_bytes: 128,
            max_payload_depth: 32,
        }
    }
}

impl Limits {
    /// The limits for fleet's own copies of an accepted task (group queues, retries, park and
    /// delay hops): the producer's size limit no longer applies — it was checked once at the
    /// door, and fleet's fields and JSON re-encoding (`1e2` becomes `100.0`) may add to it —
    /// only a generous guard against a foreign publish straight to an internal queue.
    pub fn internal(self) -> Self {
        Limits {
            max_bytes: internal_limit(self.max_bytes),
            ..self
        }
    }
}

/// Largest delivery fleet parses from its own queues: 8 × the producer limit + 64 KiB.
pub fn internal_limit(max_bytes: usize) -> usize {
    max_bytes.saturating_mul(8).saturating_add(64 * 1024)
}

/// Renders text for a log line with control characters escaped (`\n`, `\u{1b}`), so a task's
/// error or payload cannot forge log lines or colour a terminal.
pub fn escape(s: &str) -> std::borrow::Cow<'_, str> {
    if s.chars().any(char::is_control) {
        std::borrow::Cow::Owned(
            s.chars()
                .flat_map(|c| {
                    if c.is_control() {
                        c.escape_default().collect::<Vec<_>>()
                    } else {
                        vec![c]
                    }
                })
                .collect(),
        )
    } else {
        std::borrow::Cow::Borrowed(s)
    }
}

fn depth(v: &Value) -> usize {
    match v {
        Value::Array(a) => 1 + a.iter().map(depth).max().unwrap_or(0),
        Value::Object(o) => 1 + o.values().map(depth).max().unwrap_or(0),
        _ => 0,
    }
}

/// Longest fairness `key`, in bytes.
pub const MAX_KEY_BYTES: usize = 64;

/// Checks a fairness key: 1-[`MAX_KEY_BYTES`] bytes of `[A-Za-z0-9_.:@/-]` (safe inside Redis
/// key names, metric labels and the `lane|id` lists of the scripts).
///
/// # Errors
/// [`Reject::BadField`] (`key`) saying what is wrong.
pub fn check_key(key: &str) -> Result<(), Reject> {
    if key.is_empty() || key.len() > MAX_KEY_BYTES {
        return Err(Reject::BadField(
            "key",
            format!("must be 1-{MAX_KEY_BYTES} bytes, got {}", key.len()),
        ));
    }
    if !key
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"_.:@/-".contains(&b))
    {
        return Err(Reject::BadField(
            "key",
            "only letters, digits and _ . : @ / - are allowed".into(),
        ));
    }
    Ok(())
}

/// A task. Only `kind` is required on the wire; [`Envelope::normalize`] fills in the rest.
#[derive(Debug, Clone, PartialEq)]
pub struct Envelope {
    /// The client-chosen id, which is the idempotency key (generated when absent).
    pub id: String,
    /// The handler name.
    pub kind: String,
    /// Any JSON value, passed to the handler.
    pub payload: Value,
    /// The selector: every `key=value` must be present on the worker (exact match).
    pub labels: Labels,
    /// The executor the task needs (`builtin`, `http` or `exec`), a selector label too.
    pub protocol: Option<String>,
    /// The lane it travels in.
    pub lane: Lane,
    /// Absolute deadline: never started after it, cancelled at it.
    pub deadline: Option<DateTime<Utc>>,
    /// Relative deadline in milliseconds from submission, used when `deadline` is absent.
    pub timeout_ms: Option<u64>,
    /// Delayed start: not before this time (at most [`MAX_DELAY`] ahead).
    pub not_before: Option<DateTime<Utc>>,
    /// Runs allowed in all, [`MAX_ATTEMPTS_MIN`]..=[`MAX_ATTEMPTS_MAX`]; the fleet's default
    /// when absent.
    pub max_attempts: Option<u32>,
    /// Attempts already made (0 when first submitted).
    pub attempt: u32,
    /// When fleet accepted it (set on acceptance when absent): what waits are measured from.
    pub submitted_at: Option<DateTime<Utc>>,
    /// Overrides the scheduler's routing strategy for this task.
    pub strategy: Option<Strategy>,
    /// The fairness and concurrency key (a tenant, a customer, a pipeline): 1-64 bytes of
    /// `[A-Za-z0-9_.:@/-]` ([`MAX_KEY_BYTES`]). Its limits and weight are the operator's
    /// ([`crate::control::KeyLimits`]); `None`: the shared default key.
    pub key: Option<String>,
    /// The producer's W3C trace context (fields `traceparent`, `tracestate`: see
    /// [`crate::task::trace`] for why it travels in the envelope). An invalid `traceparent` is
    /// dropped, never refused.
    pub trace: Option<super::TraceContext>,
    /// Unknown fields, kept verbatim.
    pub extra: Map<String, Value>,
}

impl Envelope {
    /// A new envelope with a generated id and defaults.
    pub fn new(kind: impl Into<String>, payload: Value) -> Self {
        Envelope {
            id: new_id(),
            kind: kind.into(),
            payload,
            labels: Labels::default(),
            protocol: None,
            lane: Lane::Normal,
            deadline: None,
            timeout_ms: None,
            not_before: None,
            max_attempts: None,
            attempt: 0,
            submitted_at: None,
            strategy: None,
            key: None,
            trace: None,
            extra: Map::new(),
        }
    }

    /// Parses raw bytes with the default [`Limits`] but this size limit (bytes).
    pub fn from_slice(bytes: &[u8], max_bytes: usize) -> Result<Self, Reject> {
        Self::parse(
            bytes,
            &Limits {
                max_bytes,
                ..Limits::default()
            },
        )
    }

    /// Parses raw bytes, enforcing every limit: the size first, on these bytes.
    pub fn parse(bytes: &[u8], limits: &Limits) -> Result<Self, Reject> {
        Self::parse_with_id(bytes, limits, None)
    }

    /// [`Envelope::parse`], taking `default_id` (the AMQP `message_id` property) as the id when
    /// the body has none — and it is a valid id; otherwise one is generated.
    pub fn parse_with_id(
        bytes: &[u8],
        limits: &Limits,
        default_id: Option<&str>,
    ) -> Result<Self, Reject> {
        if bytes.len() > limits.max_bytes {
            return Err(Reject::Oversized {
                size: bytes.len(),
                limit: limits.max_bytes,
            });
        }
        let TopLevel(Some(mut fields)) =
            serde_json::from_slice(bytes).map_err(|e| Reject::MalformedJson(e.to_string()))?
        else {
            return Err(Reject::NotAnObject);
        };
        if let Some(id) = default_id {
            let valid = !id.is_empty()
                && id.len() <= limits.max_id_bytes
                && !id.chars().any(char::is_control);
            if valid && fields.id.as_ref().is_none_or(Value::is_null) {
                fields.id = Some(Value::String(id.to_string()));
            }
        }
        Self::from_fields(fields, limits)
    }

    /// Parses a JSON value field by field with the default [`Limits`] (size aside); errors name
    /// the field.
    pub fn from_value(value: Value) -> Result<Self, Reject> {
        Self::from_value_limited(value, &Limits::default())
    }

    /// Parses a JSON value field by field, enforcing every limit but the size (which belongs to
    /// the bytes); errors name the field.
    pub fn from_value_limited(value: Value, limits: &Limits) -> Result<Self, Reject> {
        let Value::Object(obj) = value else {
            return Err(Reject::NotAnObject);
        };
        let mut fields = Fields::default();
        for (k, v) in obj {
            fields.put(k, v);
        }
        Self::from_fields(fields, limits)
    }

    /// Checks the fields one by one, in a fixed order (the first refusal is the one reported);
    /// a `null` field is an absent one.
    fn from_fields(f: Fields, limits: &Limits) -> Result<Self, Reject> {
        let present = |v: Option<Value>| v.filter(|v| !v.is_null());
        let kind = match present(f.kind) {
            None => return Err(Reject::MissingKind),
            Some(Value::String(s)) if !s.trim().is_empty() => s,
            Some(_) => {
                return Err(Reject::BadField(
                    "kind",
                    "expected a non-empty string".into(),
                ))
            }
        };
        if kind.len() > limits.max_kind_bytes {
            return Err(Reject::OverLimit {
                what: "kind (bytes)",
                got: kind.len(),
                limit: limits.max_kind_bytes,
            });
        }
        if kind.chars().any(char::is_control) {
            return Err(Reject::BadField(
                "kind",
                "control characters are not allowed".into(),
            ));
        }
        let id = match present(f.id) {
            None => new_id(),
            Some(Value::String(s)) if !s.is_empty() => s,
            Some(_) => return Err(Reject::BadField("id", "expected a non-empty string".into())),
        };
        if id.len() > limits.max_id_bytes {
            return Err(Reject::OverLimit {
                what: "id (bytes)",
                got: id.len(),
                limit: limits.max_id_bytes,
            });
        }
        if id.chars().any(char::is_control) {
            return Err(Reject::BadField(
                "id",
                "control characters are not allowed".into(),
            ));
        }
        let payload = present(f.payload).unwrap_or(Value::Null);
        let d = depth(&payload);
        if d > limits.max_payload_depth {
            return Err(Reject::OverLimit {
                what: "payload nesting depth",
                got: d,
                limit: limits.max_payload_depth,
            });
        }
        let labels = match present(f.labels) {
            None => Labels::default(),
            Some(Value::Object(m)) if m.len() > limits.max_label_pairs => {
                return Err(Reject::OverLimit {
                    what: "labels (pairs)",
                    got: m.len(),
                    limit: limits.max_label_pairs,
                })
            }
            Some(Value::Object(m)) => {
                let mut map = BTreeMap::new();
                for (k, v) in m {
                    let Value::String(v) = v else {
                        return Err(Reject::BadSelector(format!(
                            "value of `{k}` must be a string"
                        )));
                    };
                    map.insert(k, v);
                }
                Labels::from_map(map).map_err(|e| Reject::BadSelector(e.to_string()))?
            }
            Some(Value::String(s)) => {
                Labels::parse(&s).map_err(|e| Reject::BadSelector(e.to_string()))?
            }
            Some(_) => {
                return Err(Reject::BadSelector(
                    "`labels` must be an object of strings".into(),
                ))
            }
        };
        if labels.len() > limits.max_label_pairs {
            return Err(Reject::OverLimit {
                what: "labels (pairs)",
                got: labels.len(),
                limit: limits.max_label_pairs,
            });
        }
        let protocol = match present(f.protocol) {
            None => None,
            Some(Value::String(s)) if !s.is_empty() => Some(s),
            Some(_) => return Err(Reject::BadField("protocol", "expected a string".into())),
        };
        let lane = match present(f.lane) {
            None => Lane::Normal,
            Some(Value::String(s)) => Lane::parse(&s).ok_or(Reject::UnknownLane(s))?,
            Some(other) => return Err(Reject::UnknownLane(other.to_string())),
        };
        let deadline = present(f.deadline)
            .map(|v| time_field("deadline", v))
            .transpose()?;
        let not_before = present(f.not_before)
            .map(|v| time_field("not_before", v))
            .transpose()?;
        let submitted_at = present(f.submitted_at)
            .map(|v| time_field("submitted_at", v))
            .transpose()?;
        let timeout_ms = present(f.timeout_ms)
            .map(|v| uint_field("timeout_ms", v))
            .transpose()?;
        // The schema's bounds (`minimum` 1, `maximum` 1000), refused rather than clamped: a
        // producer that asks for 0 attempts gets told, not silently one.
        let max_attempts = present(f.max_attempts)
            .map(|v| uint_field("max_attempts", v))
            .transpose()?
            .map(|n| {
                u32::try_from(n)
                    .ok()
                    .filter(|n| (MAX_ATTEMPTS_MIN..=MAX_ATTEMPTS_MAX).contains(n))
                    .ok_or_else(|| {
                        Reject::BadField(
                            "max_attempts",
                            format!(
                                "{n} is outside {MAX_ATTEMPTS_MIN}..={MAX_ATTEMPTS_MAX} (the schema's minimum and maximum)"
                            ),
                        )
                    })
            })
            .transpose()?;
        let attempt = present(f.attempt)
            .map(|v| uint_field("attempt", v))
            .transpose()?
            .unwrap_or(0);
        let attempt =
            u32::try_from(attempt).map_err(|_| Reject::BadField("attempt", "too large".into()))?;
        let strategy = match present(f.strategy) {
            None => None,
            Some(Value::String(s)) => Some(Strategy::parse(&s).ok_or(Reject::UnknownStrategy(s))?),
            Some(_) => return Err(Reject::BadField("strategy", "expected a string".into())),
        };
        let key = match present(f.key) {
            None => None,
            Some(Value::String(s)) => Some(check_key(&s).map(|()| s)?),
            Some(_) => return Err(Reject::BadField("key", "expected a string".into())),
        };
        // Never refused: an invalid context is ignored (a new trace), W3C Trace Context § 4.3.
        let tracestate = present(f.tracestate);
        let trace = match present(f.traceparent) {
            Some(Value::String(tp)) => super::TraceContext::parse(
                &tp,
                match &tracestate {
                    Some(Value::String(ts)) => Some(ts.as_str()),
                    _ => None,
                },
            ),
            _ => None,
        };
        if let Some(p) = &protocol {
            if labels.get(PROTOCOL_LABEL).is_some_and(|l| l != p) {
                return Err(Reject::BadSelector(format!(
                    "`protocol` {p} contradicts label protocol"
                )));
            }
        }
        Ok(Envelope {
            id,
            kind,
            payload,
            labels,
            protocol,
            lane,
            deadline,
            timeout_ms,
            not_before,
            max_attempts,
            attempt,
            submitted_at,
            strategy,
            key,
            trace,
            extra: f.extra,
        })
    }

    /// Fills the defaults an accepted task carries from then on: `submitted_at`, the absolute
    /// `deadline` from `timeout_ms`, and `max_attempts`. Refuses absurd `not_before`.
    pub fn normalize(
        &mut self,
        now: DateTime<Utc>,
        default_max_attempts: u32,
    ) -> Result<(), Reject> {
        let submitted = *self.submitted_at.get_or_insert(now);
        if self.deadline.is_none() {
            if let Some(ms) = self.timeout_ms {
                let ms = i64::try_from(ms)
                    .unwrap_or(i64::MAX / 2)
                    .min(MAX_DELAY.num_milliseconds() * 12);
                self.deadline = Some(submitted + Duration::milliseconds(ms));
            }
        }
        if self.max_attempts.is_none() {
            self.max_attempts = Some(default_max_attempts.max(1));
        }
        if let Some(nb) = self.not_before {
            if nb - now > MAX_DELAY {
                return Err(Reject::TooFarAhead(MAX_DELAY.num_days()));
            }
        }
        Ok(())
    }

    /// The selector a worker must satisfy: the task's labels plus `protocol`, if any.
    pub fn selector(&self) -> Labels {
        match &self.protocol {
            Some(p) => self.labels.clone().with(PROTOCOL_LABEL, p),
            None => self.labels.clone(),
        }
    }

    /// The attempts allowed: `max_attempts`, else `default`; at least 1.
    pub fn max_attempts_or(&self, default: u32) -> u32 {
        self.max_attempts.unwrap_or(default).max(1)
    }

    /// Whether the deadline is at or before `now` (never without a deadline).
    pub fn is_expired(&self, now: DateTime<Utc>) -> bool {
        self.deadline.is_some_and(|d| d <= now)
    }

    /// The wire form (always includes the version `v`).
    pub fn to_value(&self) -> Value {
        let mut m = self.extra.clone();
        m.insert("v".into(), VERSION.into());
        m.insert("id".into(), self.id.clone().into());
        m.insert("kind".into(), self.kind.clone().into());
        m.insert("payload".into(), self.payload.clone());
        if !self.labels.is_empty() {
            m.insert(
                "labels".into(),
                serde_json::to_value(&self.labels).unwrap_or(Value::Null),
            );
        }
        let mut opt = |k: &str, v: Option<Value>| {
            if let Some(v) = v {
                m.insert(k.into(), v);
            }
        };
        opt("protocol", self.protocol.clone().map(Value::from));
        opt("lane", Some(self.lane.as_str().into()));
        opt("deadline", self.deadline.map(fmt_time));
        opt("timeout_ms", self.timeout_ms.map(Value::from));
        opt("not_before", self.not_before.map(fmt_time));
        opt("max_attempts", self.max_attempts.map(Value::from));
        opt("attempt", Some(self.attempt.into()));
        opt("submitted_at", self.submitted_at.map(fmt_time));
        opt("strategy", self.strategy.map(|s| s.as_str().into()));
        opt("key", self.key.clone().map(Value::from));
        if let Some(t) = &self.trace {
            opt("traceparent", Some(t.traceparent().into()));
            opt("tracestate", t.state.clone().map(Value::from));
        }
        Value::Object(m)
    }

    /// [`to_value`](Self::to_value) as JSON bytes — the same bytes, written from borrowed
    /// fields: no copy of the payload, the extra fields or the strings (the scheduler writes
    /// every task it routes; building the `Value` first cloned all of it). The keys come out
    /// sorted, as serde_json's `Map` (a `BTreeMap` without `preserve_order`) writes them.
    pub fn to_bytes(&self) -> Vec<u8> {
        /// One field's value, borrowed where the envelope holds it.
        #[derive(serde::Serialize)]
        #[serde(untagged)]
        enum Field<'a> {
            Json(&'a Value),
            Text(&'a str),
            Owned(Value),
            Number(u64),
        }
        let mut m: BTreeMap<&str, Field<'_>> = self
            .extra
            .iter()
            .map(|(k, v)| (k.as_str(), Field::Json(v)))
            .collect();
        m.insert("v", Field::Number(VERSION));
        m.insert("id", Field::Text(&self.id));
        m.insert("kind", Field::Text(&self.kind));
        m.insert("payload", Field::Json(&self.payload));
        if !self.labels.is_empty() {
            m.insert(
                "labels",
                Field::Owned(serde_json::to_value(&self.labels).unwrap_or(Value::Null)),
            );
        }
        if let Some(p) = &self.protocol {
            m.insert("protocol", Field::Text(p));
        }
        m.insert("lane", Field::Text(self.lane.as_str()));
        if let Some(t) = self.deadline {
            m.insert("deadline", Field::Owned(fmt_time(t)));
        }
        if let Some(t) = self.timeout_ms {
            m.insert("timeout_ms", Field::Number(t));
        }
        if let Some(t) = self.not_before {
            m.insert("not_before", Field::Owned(fmt_time(t)));
        }
        if let Some(n) = self.max_attempts {
            m.insert("max_attempts", Field::Number(u64::from(n)));
        }
        m.insert("attempt", Field::Number(u64::from(self.attempt)));
        if let Some(t) = self.submitted_at {
            m.insert("submitted_at", Field::Owned(fmt_time(t)));
        }
        if let Some(st) = self.strategy {
            m.insert("strategy", Field::Text(st.as_str()));
        }
        if let Some(k) = &self.key {
            m.insert("key", Field::Text(k));
        }
        if let Some(t) = &self.trace {
            m.insert("traceparent", Field::Owned(Value::String(t.traceparent())));
            if let Some(st) = &t.state {
                m.insert("tracestate", Field::Text(st));
            }
        }
        serde_json::to_vec(&m).unwrap_or_default()
    }

    /// Bytes of [`Envelope::to_bytes`] taken by the fields fleet itself fills in on an accepted
    /// task — `v`, `lane`, `attempt`, `max_attempts`, `submitted_at`, and `deadline` when it is
    /// derived from `timeout_ms` — each as `"key":value` plus its comma. A dead-letter replay is
    /// measured against the producer's size limit without them (`bytes − this`, see
    /// [`crate::broker::dead`]): the limit is for the producer's bytes, and a replay of a task near the
    /// limit must not meet it again through fleet's own additions. Bounded (a few hundred
    /// bytes: the values are an enum, numbers and times), so a submission that claims to be a
    /// replay gains no more than that.
    pub fn fleet_fields_len(&self) -> usize {
        let Value::Object(m) = self.to_value() else {
            return 0;
        };
        // The trace context too: fleet moves it from the producer's headers into the body
        // (bounded: 55 + 512 bytes).
        let mut keys = vec![
            "v",
            "lane",
            "attempt",
            "max_attempts",
            "submitted_at",
            "traceparent",
            "tracestate",
        ];
        if self.timeout_ms.is_some() {
            keys.push("deadline");
        }
        keys.iter()
            .filter_map(|k| m.get(*k).map(|v| (k, v)))
            .map(|(k, v)| k.len() + 4 + serde_json::to_string(v).map_or(0, |s| s.len()))
            .sum()
    }
}

/// An envelope object's fields as read: each of [`KNOWN_FIELDS`] in its own slot (the last one
/// wins when a key repeats, as in a `serde_json::Map`), every other field in `extra`.
/// `KNOWN_FIELDS`, this type and its `slot` are made from one list.
macro_rules! known_fields {
    ($($name:ident),* $(,)?) => {
        /// Fields this version knows; anything else is kept in `extra`.
        pub const KNOWN_FIELDS: &[&str] = &[$(stringify!($name)),*];

        #[derive(Default)]
        struct Fields {
            $($name: Option<Value>,)*
            extra: Map<String, Value>,
        }

        impl Fields {
            /// The slot of known field `name`; `None` for an unknown one.
            fn slot(&mut self, name: &str) -> Option<&mut Option<Value>> {
                Some(match name {
                    $(stringify!($name) => &mut self.$name,)*
                    _ => return None,
                })
            }
            /// Puts one field.
            fn put(&mut self, name: String, value: Value) {
                match self.slot(&name) {
                    Some(slot) => *slot = Some(value),
                    None => {
                        self.extra.insert(name, value);
                    }
                }
            }
        }
    };
}

known_fields! {
    v, id, kind, payload, labels, protocol, lane, deadline, timeout_ms, not_before, max_attempts,
    attempt, submitted_at, strategy, key, traceparent, tracestate,
}

/// A JSON document read for an envelope: an object's [`Fields`], or `None` for anything else
/// (refused as [`Reject::NotAnObject`]; read to its end, so a malformed one is still
/// `MalformedJson`).
struct TopLevel(Option<Fields>);

impl<'de> serde::Deserialize<'de> for TopLevel {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{MapAccess, SeqAccess, Visitor};
        use std::borrow::Cow;

        /// An object's key, borrowed from the input unless it holds an escape.
        struct Key<'de>(Cow<'de, str>);
        impl<'de> serde::Deserialize<'de> for Key<'de> {
            fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                struct KeyVisitor;
                impl<'de> Visitor<'de> for KeyVisitor {
                    type Value = Key<'de>;
                    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                        f.write_str("a string key")
                    }
                    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Key<'de>, E> {
                        Ok(Key(Cow::Borrowed(v)))
                    }
                    fn visit_str<E>(self, v: &str) -> Result<Key<'de>, E> {
                        Ok(Key(Cow::Owned(v.to_string())))
                    }
                    fn visit_string<E>(self, v: String) -> Result<Key<'de>, E> {
                        Ok(Key(Cow::Owned(v)))
                    }
                }
                d.deserialize_str(KeyVisitor)
            }
        }

        struct TopVisitor;
        impl<'de> Visitor<'de> for TopVisitor {
            type Value = TopLevel;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON document")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<TopLevel, A::Error> {
                let mut fields = Fields::default();
                while let Some(Key(name)) = map.next_key()? {
                    match fields.slot(&name) {
                        Some(slot) => *slot = Some(map.next_value()?),
                        None => {
                            let value = map.next_value()?;
                            fields.extra.insert(name.into_owned(), value);
                        }
                    }
                }
                Ok(TopLevel(Some(fields)))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TopLevel, A::Error> {
                // Read as values, not skipped: skipping does not check a string's UTF-8, and
                // the error must be the one a `Value` parse gives.
                while seq.next_element::<Value>()?.is_some() {}
                Ok(TopLevel(None))
            }
            fn visit_bool<E>(self, _: bool) -> Result<TopLevel, E> {
                Ok(TopLevel(None))
            }
            fn visit_i64<E>(self, _: i64) -> Result<TopLevel, E> {
                Ok(TopLevel(None))
            }
            fn visit_u64<E>(self, _: u64) -> Result<TopLevel, E> {
                Ok(TopLevel(None))
            }
            fn visit_f64<E>(self, _: f64) -> Result<TopLevel, E> {
                Ok(TopLevel(None))
            }
            fn visit_str<E>(self, _: &str) -> Result<TopLevel, E> {
                Ok(TopLevel(None))
            }
            fn visit_unit<E>(self) -> Result<TopLevel, E> {
                Ok(TopLevel(None))
            }
        }
        d.deserialize_any(TopVisitor)
    }
}

/// An envelope time as RFC 3339 (UTC, `Z`) with microseconds: `submitted_at` is what every
/// wait (`fleet_task_wait_seconds`) is measured from, and a millisecond string would add up to
/// 1 ms (0.5 on average) to waits that are themselves about a millisecond on an idle fleet.
fn fmt_time(t: DateTime<Utc>) -> Value {
    Value::String(t.to_rfc3339_opts(chrono::SecondsFormat::Micros, true))
}

fn time_field(name: &'static str, v: Value) -> Result<DateTime<Utc>, Reject> {
    match v {
        Value::String(s) => DateTime::parse_from_rfc3339(&s)
            .map(|t| t.with_timezone(&Utc))
            .map_err(|e| Reject::BadField(name, format!("expected an RFC 3339 time: {e}"))),
        _ => Err(Reject::BadField(
            name,
            "expected an RFC 3339 time string".into(),
        )),
    }
}

fn uint_field(name: &'static str, v: Value) -> Result<u64, Reject> {
    v.as_u64()
        .ok_or_else(|| Reject::BadField(name, "expected a non-negative integer".into()))
}

/// Least `max_attempts`, as `shared/schema/envelope.schema.json` has it.
pub const MAX_ATTEMPTS_MIN: u32 = 1;
/// Most `max_attempts`, as `shared/schema/envelope.schema.json` has it.
pub const MAX_ATTEMPTS_MAX: u32 = 1000;

/// A fresh task id.
pub fn new_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task::PerLane;
    use serde_json::json;

    /// The one-pass read of bytes gives what parsing a `Value` and taking its fields out gave:
    /// the same envelope or the same refusal, for duplicate keys (the last wins), escaped
    /// keys, `null`s, unknown fields, a message id, non-objects and malformed documents.
    #[test]
    fn bytes_and_value_paths_agree() {
        let limits = Limits::default();
        let cases: &[&[u8]] = &[
            br#"{"kind":"noop"}"#,
            br#"{"id":"a","kind":"resize","payload":{"w":[1,2.5,"x"]},"lane":"critical","x":1,"v":1}"#,
            br#"{"kind":"a","kind":"b","id":"1","id":"2","zz":1,"zz":2}"#,
            br#"{"ki\u006ed":"escaped","\u0069d":"e1","extra\u0020key":true}"#,
            br#"{"kind":"k","id":null,"lane":null,"payload":null,"labels":null,"key":null}"#,
            br#"{"kind":"k","labels":{"gpu":"a100"},"protocol":"builtin","strategy":"round_robin"}"#,
            br#"{"kind":"k","labels":"gpu=a100,zone=eu","max_attempts":3,"attempt":2,"timeout_ms":5}"#,
            br#"{"kind":"k","deadline":"2030-01-01T00:00:00Z","not_before":"2029-12-31T00:00:00.5Z"}"#,
            br#"{"kind":"k","submitted_at":"2029-12-31T00:00:00.123456Z","key":"tenant-1"}"#,
            br#"{"kind":"k","traceparent":"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01","tracestate":"a=b"}"#,
            br#"{"kind":"k","max_attempts":0}"#,
            br#"{"kind":"k","attempt":-1}"#,
            br#"{"kind":"k","lane":"fast"}"#,
            br#"{"kind":"k","lane":7}"#,
            br#"{"kind":"k","strategy":"best"}"#,
            br#"{"kind":"k","key":"a b"}"#,
            br#"{"kind":"k","deadline":"tomorrow"}"#,
            br#"{"kind":"k","labels":{"a":1}}"#,
            br#"{"kind":"k","protocol":"http","labels":{"protocol":"exec"}}"#,
            br#"{"kind":""}"#,
            br#"{"kind":5}"#,
            br#"{"id":"x"}"#,
            br#"{}"#,
            br#"[{"kind":"k"}]"#,
            br#""kind""#,
            br#"null"#,
            br#"7"#,
            br#"true"#,
            br#"{"kind":"k","#,
            br#"{"kind":"k"} x"#,
            br#"[1,2"#,
            // Found by the fuzzer: an array's string that is not UTF-8 (a skip missed it).
            b"[\"\x90\xdb\"",
            br#"{"kind":"k","payload":[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}"#,
        ];
        let long_id = "m".repeat(limits.max_id_bytes + 1);
        for (i, case) in cases.iter().enumerate() {
            let text = String::from_utf8_lossy(case);
            for default_id in [
                None,
                Some("m-1"),
                Some(""),
                Some("m\n1"),
                Some(long_id.as_str()),
            ] {
                let by_bytes = Envelope::parse_with_id(case, &limits, default_id);
                let by_value = match serde_json::from_slice::<Value>(case) {
                    Err(e) => Err(Reject::MalformedJson(e.to_string())),
                    Ok(mut v) => {
                        // The message id rule of e2e2b6f's `parse_with_id`, on the `Value`.
                        let valid = default_id.is_some_and(|id| {
                            !id.is_empty()
                                && id.len() <= limits.max_id_bytes
                                && !id.chars().any(char::is_control)
                        });
                        if let (Value::Object(o), Some(id), true) = (&mut v, default_id, valid) {
                            if o.get("id").is_none_or(Value::is_null) {
                                o.insert("id".into(), json!(id));
                            }
                        }
                        Envelope::from_value_limited(v, &limits)
                    }
                };
                match (by_bytes, by_value) {
                    (Ok(mut a), Ok(b)) => {
                        // A generated id differs by construction.
                        if a.id.len() == 32 && b.id.len() == 32 && a.id != b.id {
                            a.id = b.id.clone();
                        }
                        assert_eq!(a, b, "case {i}: {text}");
                    }
                    (a, b) => assert_eq!(a, b, "case {i}: {text}"),
                }
            }
        }
    }

    /// Every known field has a slot of its own in [`Fields`] (a value put under one name is
    /// read back under that name only), and other names go to `extra`.
    #[test]
    fn every_known_field_has_a_slot_of_its_own() {
        let mut f = Fields::default();
        for (i, name) in KNOWN_FIELDS.iter().enumerate() {
            f.put(name.to_string(), json!(i));
        }
        assert!(f.extra.is_empty());
        for (i, name) in KNOWN_FIELDS.iter().enumerate() {
            assert_eq!(f.slot(name).cloned(), Some(Some(json!(i))), "{name}");
        }
        for name in ["batch", "Kind", "ids", "", "payload_from"] {
            assert!(f.slot(name).is_none(), "{name}");
            f.put(name.to_string(), json!(true));
        }
        assert_eq!(f.extra.len(), 5);
    }

    /// The one difference from a `Value` parse (see the module's doc): serde_json's private
    /// `RawValue` key is an ordinary unknown field here, not JSON text to read in its place.
    #[test]
    fn serde_jsons_raw_value_key_is_an_ordinary_field() {
        let doc = br#"{"$serde_json::private::RawValue":"{\"kind\":\"k\"}"}"#;
        assert_eq!(
            Envelope::parse(doc, &Limits::default()),
            Err(Reject::MissingKind)
        );
        let doc = br#"{"$serde_json::private::RawValue":"{}","kind":"k"}"#;
        let e = Envelope::parse(doc, &Limits::default()).unwrap();
        assert_eq!(
            e.extra.get("$serde_json::private::RawValue"),
            Some(&json!("{}"))
        );
    }

    /// `to_bytes` writes from borrowed fields: byte for byte what serialising `to_value` gives,
    /// for an envelope with every field set, extra fields (one sorting between fleet's), and a
    /// bare one.
    #[test]
    fn to_bytes_is_to_value_serialised() {
        let bare = Envelope::new("resize", json!(null));
        let full = Envelope::parse(
            json!({
                "id": "t-1", "kind": "resize", "payload": {"b": [1, 2.5, "x"], "a": null},
                "labels": {"zone": "z1", "gpu": "a100"}, "protocol": "http", "lane": "critical",
                "deadline": "2026-12-05T10:00:00.123456Z", "timeout_ms": 5000,
                "not_before": "2026-12-05T09:00:00Z", "max_attempts": 7, "attempt": 2,
                "submitted_at": "2026-12-05T08:00:00.5Z", "strategy": "round_robin",
                "key": "tenant-a", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
                "tracestate": "congo=t61rcWkgMzE", "custom": {"z": 1}, "kindly": "yes", "aaa": 1
            })
            .to_string()
            .as_bytes(),
            &Limits::default(),
        );
        let full = match full {
            Ok(e) => e,
            Err(e) => panic!("the test envelope parses: {e}"),
        };
        assert!(full.trace.is_some() && full.extra.len() == 3, "{full:?}");
        for e in [bare, full] {
            let want = serde_json::to_vec(&e.to_value()).unwrap_or_default();
            assert_eq!(
                String::from_utf8_lossy(&e.to_bytes()),
                String::from_utf8_lossy(&want)
            );
        }
    }

    /// Every `minimum` / `maximum` of the JSON Schema is what `from_value` enforces: a value
    /// one past a bound is refused naming the field, the bound itself is taken.
    /// (`max_attempts: 0` was accepted as 1.)
    #[test]
    fn the_schema_numeric_bounds_are_enforced() {
        let schema: Value =
            serde_json::from_str(include_str!("../../schema/envelope.schema.json")).unwrap();
        let props = schema["properties"].as_object().unwrap();
        let mut checked = 0;
        for (field, p) in props {
            if p["type"] != "integer" || field == "v" {
                continue;
            }
            let accept = |n: i64| {
                let mut e = json!({"kind": "x"});
                e[field.as_str()] = json!(n);
                Envelope::from_value(e)
            };
            if let Some(min) = p["minimum"].as_i64() {
                assert!(accept(min).is_ok(), "{field} = {min} refused");
                let r = accept(min - 1).expect_err(&format!("{field} = {} accepted", min - 1));
                assert!(r.to_string().contains(field.as_str()), "{r}");
                checked += 1;
            }
            if let Some(max) = p["maximum"].as_i64() {
                assert!(accept(max).is_ok(), "{field} = {max} refused");
                let r = accept(max + 1).expect_err(&format!("{field} = {} accepted", max + 1));
                assert!(r.to_string().contains(field.as_str()), "{r}");
                checked += 1;
            }
        }
        assert_eq!(
            checked, 4,
            "timeout_ms, attempt and max_attempts' two bounds"
        );
    }

    #[test]
    fn minimal_envelope_gets_defaults() {
        let e = Envelope::from_slice(br#"{"kind":"noop"}"#, 1024).unwrap();
        assert_eq!(e.kind, "noop");
        assert_eq!(e.lane, Lane::Normal);
        assert_eq!(e.id.len(), 32);
        assert_eq!(e.attempt, 0);
    }

    #[test]
    fn round_trip_keeps_unknown_fields() {
        let v = json!({"id":"a","kind":"echo","payload":{"x":1},"labels":{"gpu":"true"},
            "lane":"critical","deadline":"2026-12-01T10:00:00Z","max_attempts":5,"future_field":[1,2]});
        let e = Envelope::from_value(v).unwrap();
        assert_eq!(e.extra.get("future_field"), Some(&json!([1, 2])));
        let again = Envelope::from_value(e.to_value()).unwrap();
        assert_eq!(again, e);
    }

    #[test]
    fn submitted_at_keeps_microseconds() {
        // Waits are measured from it: a millisecond string added up to 1 ms to each.
        let t = DateTime::parse_from_rfc3339("2026-12-01T10:00:00.123456Z")
            .unwrap()
            .with_timezone(&Utc);
        let mut e = Envelope::new("noop", json!(null));
        e.submitted_at = Some(t + chrono::Duration::nanoseconds(789));
        assert_eq!(
            e.to_value()["submitted_at"],
            json!("2026-12-01T10:00:00.123456Z")
        );
        let again = Envelope::from_slice(&e.to_bytes(), 1024).unwrap();
        assert_eq!(again.submitted_at, Some(t));
    }

    #[test]
    fn refusals_name_the_field() {
        let r = |b: &[u8]| Envelope::from_slice(b, 1 << 20).unwrap_err();
        assert_eq!(r(b"{nope").code(), "malformed_json");
        assert_eq!(r(b"[1]").code(), "not_an_object");
        assert_eq!(r(br#"{"payload":1}"#).code(), "missing_kind");
        assert_eq!(r(br#"{"kind":"x","lane":"bulk"}"#).code(), "unknown_lane");
        assert_eq!(
            r(br#"{"kind":"x","labels":{"a b":"1"}}"#).code(),
            "bad_selector"
        );
        let e = r(br#"{"kind":"x","max_attempts":"five"}"#);
        assert_eq!(e.code(), "bad_field");
        assert!(e.to_string().contains("max_attempts"), "{e}");
        let e = r(br#"{"kind":"x","deadline":"tomorrow"}"#);
        assert!(e.to_string().contains("deadline"), "{e}");
        let big = format!(r#"{{"kind":"x","payload":"{}"}}"#, "a".repeat(2000));
        assert_eq!(
            Envelope::from_slice(big.as_bytes(), 1000)
                .unwrap_err()
                .code(),
            "oversized"
        );
    }

    #[test]
    fn every_dimension_is_bounded() {
        let l = Limits::default();
        let r = |v: Value| Envelope::from_value_limited(v, &l).unwrap_err();
        let labels: serde_json::Map<String, Value> =
            (0..10_000).map(|i| (format!("k{i}"), json!("v"))).collect();
        let e = r(json!({"kind":"x","labels":labels}));
        assert_eq!(e.code(), "over_limit");
        assert!(e.to_string().contains("labels"), "{e}");
        assert_eq!(r(json!({"kind":"x","labels":"a=1,b=2,c=3,d=4,e=5,f=6,g=7,h=8,i=9,j=10,k=11,l=12,m=13,n=14,o=15,p=16,q=17"})).code(), "over_limit");
        assert!(Envelope::from_value_limited(json!({"kind":"x","labels":{"a":"1"}}), &l).is_ok());
        assert_eq!(
            r(json!({"kind":"x","id":"é".repeat(101)})).code(),
            "over_limit",
            "id is bounded in bytes"
        );
        assert!(Envelope::from_value_limited(json!({"kind":"x","id":"é".repeat(100)}), &l).is_ok());
        assert_eq!(r(json!({"kind":"k".repeat(129)})).code(), "over_limit");
        assert_eq!(
            r(json!({"kind":"echo\nFAKE LOG LINE level=ERROR\u{1b}[31m"})).code(),
            "bad_field"
        );
        assert_eq!(r(json!({"kind":"ex\u{0}ec"})).code(), "bad_field");
        assert_eq!(r(json!({"kind":"x","id":"a\rb"})).code(), "bad_field");
        let mut deep = json!(1);
        for _ in 0..33 {
            deep = json!([deep]);
        }
        assert_eq!(r(json!({"kind":"x","payload":deep})).code(), "over_limit");
        assert!(Envelope::from_value_limited(json!({"kind":"x","payload":deep[0]}), &l).is_ok());
        // The size is the producer's bytes; fleet's own copies get the internal guard.
        let body = format!(r#"{{"kind":"x","payload":"{}"}}"#, "a".repeat(4000));
        let small = Limits {
            max_bytes: body.len(),
            ..l
        };
        let mut env = Envelope::parse(body.as_bytes(), &small).unwrap();
        env.normalize(Utc::now(), 5).unwrap();
        assert!(env.to_bytes().len() > body.len(), "fleet adds fields");
        assert!(Envelope::parse(&env.to_bytes(), &small.internal()).is_ok());
    }

    #[test]
    fn escape_neutralises_control_characters() {
        assert_eq!(escape("plain"), "plain");
        assert_eq!(escape("a\nb\u{1b}[31m"), "a\\nb\\u{1b}[31m");
    }

    #[test]
    fn schema_matches_the_rust_type() {
        let schema: Value = serde_json::from_str(SCHEMA).unwrap();
        let props = schema["properties"].as_object().unwrap();
        // The batch fields are kept among the unknown fields (`extra`) and read from there
        // (`crate::batch`): documented in the schema, not fields of the type.
        let batch_fields = ["batch", "after", "payload_from", "pass_result"];
        let mut in_schema: Vec<&str> = props
            .keys()
            .map(String::as_str)
            .filter(|k| !batch_fields.contains(k))
            .collect();
        let mut in_rust: Vec<&str> = KNOWN_FIELDS.to_vec();
        for f in batch_fields {
            assert!(props.contains_key(f), "the schema documents `{f}`");
            assert!(!KNOWN_FIELDS.contains(&f), "`{f}` is kept in `extra`");
        }
        in_schema.sort_unstable();
        in_rust.sort_unstable();
        assert_eq!(
            in_schema, in_rust,
            "schema properties and KNOWN_FIELDS differ"
        );
        assert_eq!(schema["required"], json!(["kind"]));
        assert_eq!(
            schema["additionalProperties"],
            json!(true),
            "unknown fields are kept"
        );
        let lanes: Vec<&str> = Lane::ALL.iter().map(|l| l.as_str()).collect();
        assert_eq!(props["lane"]["enum"], json!(lanes));
        let strategies: Vec<&str> = [
            Strategy::LeastLoaded,
            Strategy::RoundRobin,
            Strategy::Weighted,
        ]
        .iter()
        .map(|s| s.as_str())
        .collect();
        assert_eq!(props["strategy"]["enum"], json!(strategies));
        // A full envelope written by this code uses only schema fields, with the schema's types.
        let mut e = Envelope::new("k", json!({"a": 1}));
        e.labels = Labels::parse("gpu=true").unwrap();
        e.protocol = Some("http".into());
        e.deadline = Some(Utc::now());
        e.timeout_ms = Some(5);
        e.not_before = Some(Utc::now());
        e.max_attempts = Some(3);
        e.submitted_at = Some(Utc::now());
        e.strategy = Some(Strategy::Weighted);
        for (k, v) in e.to_value().as_object().unwrap() {
            let p = &props[k.as_str()];
            assert!(!p.is_null(), "field {k} is not in the schema");
            let ok = match p["type"].as_str() {
                Some("string") => v.is_string(),
                Some("integer") => v.is_u64(),
                _ => true,
            };
            assert!(
                ok,
                "field {k} = {v} does not have the schema's type {}",
                p["type"]
            );
        }
    }

    #[test]
    fn per_lane_values() {
        let mut caps = PerLane {
            normal: 4u32,
            critical: 1,
        };
        assert_eq!((caps[Lane::Normal], *caps.get(Lane::Critical)), (4, 1));
        caps[Lane::Critical] += 1;
        *caps.get_mut(Lane::Normal) = 5;
        assert_eq!(
            caps.iter().collect::<Vec<_>>(),
            vec![(Lane::Normal, &5), (Lane::Critical, &2)]
        );
        assert_eq!(
            caps.map(|c| c * 2),
            PerLane {
                normal: 10,
                critical: 4
            }
        );
    }

    #[test]
    fn normalize_resolves_timeout_and_refuses_far_future() {
        let now = Utc::now();
        let mut e = Envelope::from_value(json!({"kind":"x","timeout_ms":1500})).unwrap();
        e.normalize(now, 5).unwrap();
        assert_eq!(e.deadline, Some(now + Duration::milliseconds(1500)));
        assert_eq!(e.max_attempts, Some(5));
        let mut far = Envelope::new("x", Value::Null);
        far.not_before = Some(now + Duration::days(400));
        assert_eq!(far.normalize(now, 5).unwrap_err().code(), "bad_not_before");
    }
}
