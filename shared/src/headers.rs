//! Every message and request header fleet writes or reads, in one place.
//!
//! AMQP headers on task messages (set by the worker, the scheduler or `fleetctl`, read by
//! [`crate::dead`], the worker's attempt loop and the tests) and the HTTP request headers the
//! worker's `http` executor sends to a task's endpoint. Values are text; numeric ones are
//! decimal (`ATTEMPTS`, `SUBMITTED_AT` in ms since the Unix epoch). Read them with
//! [`crate::amqp::header_text`] / [`crate::amqp::header_str`]; write them with
//! [`crate::amqp::headers`].

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
/// HTTP executor request header: the task's id.
pub const TASK_ID: &str = "x-fleet-task-id";
/// HTTP executor request header: the attempt number, from 1.
pub const ATTEMPT: &str = "x-fleet-attempt";
