//! The task as data, with no I/O: the envelope (versioned JSON), its parsing with reasons that
//! name the bad field and its JSON Schema; the lanes ([`Lane`], one value per lane:
//! [`PerLane`]); label sets, selectors and group names ([`Labels`]); the routing [`Strategy`] a
//! task may ask for; every `x-fleet-*` header name ([`headers`]); an HTTP submission body
//! ([`parse_body`]).
//!
//! Producers, fuzzers and every other wing read these; this wing reads none of them but
//! [`crate::error`]. `headers` stays a public module: its constants read as `headers::REASON`.

mod envelope;
pub mod headers;
mod lane;
mod selector;
mod strategy;
mod submit;
pub mod trace;

pub use envelope::{
    check_key, escape, internal_limit, new_id, Envelope, Limits, Reject, KNOWN_FIELDS,
    MAX_ATTEMPTS_MAX, MAX_ATTEMPTS_MIN, MAX_DELAY, MAX_KEY_BYTES, SCHEMA,
};
pub use lane::{Lane, PerLane};
pub use selector::{Labels, SelectorError, PROTOCOL_LABEL};
pub use strategy::Strategy;
pub use submit::{bind_key, parse_body, BadSubmission, Submitted};
pub use trace::TraceContext;
