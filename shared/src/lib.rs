//! fleet's library crate: everything the scheduler, the worker and `fleetctl` share.
//!
//! * [`envelope`] — the task envelope (versioned JSON), its parsing with reasons that name the
//!   bad field, and its JSON Schema; the lanes ([`Lane`], one value per lane: [`PerLane`]).
//! * [`selector`] — label sets, selector parsing and exact matching, group names.
//! * [`config`] — settings from the environment and an optional file; errors name the setting.
//! * [`settings`] — every setting declared once (flag, variable, default, range, help).
//! * [`redact`] — hiding URL passwords, escaping control characters in printed text.
//! * [`names`] — the one place that builds every AMQP name and Redis key under the namespace.
//! * [`topology`] — idempotent declaration of exchanges and queues.
//! * [`endpoints`] — the RabbitMQ node list of `FLEET_AMQP_URL` (cluster failover).
//! * [`amqp`] / [`store`] — connections with retry and backoff to RabbitMQ and Redis;
//!   [`sentinel`] — Redis behind Sentinel (`redis+sentinel://`), failover to the new master.
//! * [`headers`] — every `x-fleet-*` header name (AMQP messages, HTTP executor requests).
//! * [`amqp`] / [`store`] — connections with retry and backoff to RabbitMQ and Redis.
//! * [`scripts`] — the Lua scripts (one atomic decision each); typed wrappers live with their
//!   concept: [`registry`] (workers, heartbeats, eviction, reclaim — a folder with its Lua),
//!   [`route`] + [`lease`] (choice, reservation, in-flight records), [`ratelimit`] (GCRA
//!   bucket), [`status`] (task states, dead-letter reasons, one writer per transition).
//! * [`control`] — the durable control stream (cancels), replayed after a Redis loss.
//! * [`dead`] — dead letters: listing without removing, replaying as new submissions.
//! * [`subset`] — deterministic subsetting: which shard queues of a sharded group a worker
//!   consumes.
//! * [`delay`] — the broker delay tiers used for `not_before` and retry backoff.
//! * [`producer`] — submitting tasks: refused at once, or paced until accepted.
//! * [`metrics`] — metric names, their help text and the Prometheus exporter.
//! * [`waits`] — wait-time histograms workers share with the scheduler's console.
//! * [`auth`] — API bearer tokens and roles, the axum guard; [`tls`] — TLS client settings.
//! * [`submit`] — parsing of an HTTP submission body (one envelope or an array).
//! * [`ticker`] — the one shape of every periodic loop (an interval that ends with shutdown);
//!   [`shutdown`] — the stages a process's loops are stopped in, in order.
//! * [`telemetry`] — logging set-up; [`http`] — `/metrics`, `/healthz`, `/readyz`.

#![warn(missing_docs)]

pub mod amqp;
pub mod auth;
pub mod config;
pub mod control;
pub mod dead;
pub mod dedupe;
pub mod delay;
pub mod endpoints;
pub mod envelope;
pub mod error;
pub mod headers;
pub mod host;
pub mod http;
pub mod lease;
pub mod metrics;
pub mod names;
pub mod park;
pub mod producer;
pub mod ratelimit;
pub mod redact;
pub mod registry;
pub mod route;
pub mod scripts;
pub mod selector;
pub mod sentinel;
pub mod settings;
pub mod shutdown;
pub mod status;
pub mod store;
pub mod submit;
pub mod subset;
pub mod telemetry;
pub mod ticker;
pub mod tls;
pub mod topology;
pub mod waits;

pub use envelope::{Envelope, Lane, PerLane};
pub use error::{Error, Result};
pub use names::Names;
pub use selector::Labels;
pub use store::Store;
