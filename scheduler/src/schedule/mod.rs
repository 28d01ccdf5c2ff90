//! Periodic schedules: cron (with seconds, IANA time zones) through the same admission as any
//! task, each tick fired exactly once across every scheduler replica.
//!
//! * [`definition`] — what a schedule is, validation, and the next tick after an instant
//!   (correct across daylight-saving changes).
//! * [`log`] — where definitions live: the durable stream `<ns>.schedules`, folded by every
//!   replica into its [`Board`] (first put of a name wins); Redis holds only per-tick claims,
//!   last-fired marks and born marks.
//! * [`fire`] — the firing loop: claim `(schedule, tick)` in Redis, submit `<name>@<tick>` to
//!   `<ns>.submit` with a confirm, retry refusals within the tolerance, missed-fire policy.
//! * [`api`] — `/v1/schedules`: list, add, delete, pause, resume, fire now.

pub mod api;
pub mod definition;
pub mod fire;
pub mod log;

pub use definition::{MissedPolicy, Schedule, ScheduleSpec};
pub use log::Board;
