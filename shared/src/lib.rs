//! fleet's library crate: everything the scheduler, the worker and `fleetctl` share, in wings —
//! one folder per concept, its files private behind the few names its `mod.rs` re-exports.
//!
//! The wings, lowest first; a wing uses only wings above it in this list (a unit test,
//! `wings::no_circle_between_wings`, reads the sources and fails on a circle):
//!
//! * [`process`] — what every process is made of: logging ([`process::telemetry`]), redaction
//!   of printed text, the ordered shutdown stages and the one loop ticker.
//! * [`error`] — the crate's error type; its classification decides a task's fate.
//! * [`tls`] — TLS client settings for RabbitMQ and Redis.
//! * [`metrics`] — metric names, their help text and the Prometheus exporter.
//! * [`task`] — the task as data: the envelope (versioned JSON), lanes, selectors and labels,
//!   the routing strategy a task asks for, every `x-fleet-*` header name, HTTP submission bodies.
//! * [`trace`] — span export over OTLP: a task's admit, reserve, queue wait, run and ack in its
//!   producer's W3C trace (off unless `FLEET_OTLP_ENDPOINT` is set).
//! * [`names`] — the one place that builds every AMQP name and Redis key under the namespace,
//!   with its Lua half `keys.lua` (every script's prelude).
//! * [`redis`] — the Redis connection ([`Store`]), Sentinel failover, the script loader and the
//!   key convention every script follows.
//! * [`status`] — task status records and words, one writer per transition.
//! * [`run`] — a task attempt's run: claims (`start.lua`), outcomes (`finish.lua`), the
//!   wait-time histograms workers share.
//! * [`broker`] — RabbitMQ: connections and publishing, the node list, topology, delay tiers,
//!   dead letters, the producer, subsetting of shard queues.
//! * [`control`] — the durable control stream (`<ns>.control`: operators' cancels), what a
//!   202 promises: each replica and worker reads it, and the marks are written again after a
//!   Redis loss.
//! * [`registry`] — workers, heartbeats, eviction, groups and their reclaim (Rust beside Lua).
//! * [`route`] — which group gets a task: the reservation script, dedupe, park flags.
//! * [`ratelimit`] — the GCRA bucket every scheduler replica shares.
//! * [`settings`] — every setting declared once, parsed from the environment and a file; API
//!   tokens and roles, allowed hosts.
//! * [`http`] — `/metrics`, `/healthz`, `/readyz`.

#![warn(missing_docs)]

pub mod batch;
pub mod broker;
pub mod control;
pub mod error;
pub mod http;
pub mod metrics;
pub mod names;
pub mod process;
pub mod ratelimit;
pub mod redis;
pub mod registry;
pub mod route;
pub mod run;
pub mod settings;
pub mod status;
pub mod task;
pub mod tls;
pub mod trace;

#[cfg(test)]
mod wings;

pub use error::{Error, Result};
pub use names::Names;
pub use redis::Store;
pub use task::{Envelope, Labels, Lane, PerLane};
