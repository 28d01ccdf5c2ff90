//! fleet's worker: registers in Redis, consumes its group's lane queues from RabbitMQ, runs
//! tasks with an executor, retries with backoff, ejects itself when it fails too much, and
//! drains as a lame duck.
//!
//! * [`config`] — [`WorkerConfig`] from the `FLEET_*` settings.
//! * [`worker`] — the [`Worker`]: build ([`Worker::builder`], which also embeds custom
//!   handlers) → [`Worker::start`] → [`Running::drain`].
//! * [`lane`] — a consumer per lane with its own channel, prefetch and semaphore.
//! * [`attempt`] — one attempt of one task: run, decide, publish, ack.
//! * [`executor`] — the [`Handler`] trait and the `builtin`, `http` and `exec` executors.
//! * [`shards`] — which shard queues of a sharded group this worker consumes (subsetting).
//! * [`retry`] — whether a failed task runs again, when (capped exponential backoff with full
//!   jitter) and where it waits (the broker's delay tiers).
//! * [`eject`] — outlier ejection from a sliding window of outcomes.
//! * [`drain`] — the worker's mode, its shutdown stages and the lame-duck drain sequence.
//! * [`registry`] / [`heartbeat`] — registration, heartbeats, re-registration.
//! * [`ledger`] — batched start/finish writes to Redis, off the hot path.
//! * [`broker`] — the RabbitMQ connection (re-established on loss) and confirmed publishing.
//! * [`stats`] — running tasks, totals and latency for the heartbeat.
//! * [`api`] — `/status`, `/drain` and the common endpoints.
//! * [`error`] — the worker's [`Error`]: why it could not start, why its drain was not clean.

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

pub mod acks;
pub mod api;
pub mod attempt;
pub mod broker;
pub mod cancel;
pub mod config;
pub mod drain;
pub mod eject;
pub mod error;
pub mod executor;
pub mod heartbeat;
pub mod lane;
pub mod ledger;
pub mod nudge;
pub mod registry;
pub mod retry;
pub mod shards;
pub mod stats;
pub mod worker;

pub use config::{ExecutorKind, WorkerConfig};
pub use error::{Error, Result};
pub use executor::{handler_fn, Handler, Handlers, TaskContext, TaskError};
pub use worker::{Running, Worker, WorkerBuilder};
