//! Retry: what happens to a task whose run failed — *whether* it runs again ([`decide`]),
//! *when* ([`Backoff`]) and *where it waits* meanwhile ([`tiers`]).
//!
//! * **Policy** ([`decide`], pure): success → `succeeded`; a permanent error (the task's fault)
//!   → dead (`permanent_error`); a retryable error → retried while attempts are left, else dead
//!   (`max_attempts`); a deadline reached, or one the next attempt could not start before, →
//!   expired. The error's type decides, never its text ([`crate::executor::TaskError`]).
//! * **Backoff**: capped exponential with *full jitter* (AWS Architecture Blog, "Exponential
//!   Backoff and Jitter"): the wait before attempt `n + 1` is uniform in
//!   `[0, min(cap, base × 2^(n−1))]`. Why full jitter: when a dependency fails, every task that
//!   touched it fails at about the same time; a deterministic backoff brings them all back at
//!   the same time again (a retry storm). Spreading each wait over the whole interval
//!   de-synchronises them, at the price of some retries coming back early; the cap bounds the
//!   wait for tasks that fail many times.
//! * **Tiers**: the wait happens in the broker's delay tiers ([`fleet::broker::delay`], shared with
//!   `not_before`), never in this process: a worker that dies while a task waits loses nothing.

mod backoff;
mod policy;
pub mod tiers;

pub use backoff::Backoff;
pub use policy::{decide, Fate};
pub(crate) use tiers::publish;
