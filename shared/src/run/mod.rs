//! A task attempt's run, from the worker's side, each step beside its script: the claim
//! before it runs (`start.rs` + `start.lua`: exactly one run per attempt,
//! [`Store::claim`](crate::Store::claim), [`Claim`]) and the outcome after (`finish.rs` +
//! `finish.lua`, [`Store::finish`](crate::Store::finish), [`Finished`]); and the wait-time
//! histograms workers share with the scheduler's console ([`waits`]).
//!
//! **Reservations and in-flight records, both leased.**
//!
//! * A **reservation** (`resv:<group>:<lane>`, member = task id, score = lease expiry) is taken
//!   by the scheduler when it dispatches a task to a group queue and turned into a running
//!   record when a worker starts it. If the task sits in the queue past the lease the slot is
//!   simply counted free again (the worker's prefetch still bounds what actually runs), so a
//!   scheduler crash between reserve and publish leaks a slot for one lease at most.
//! * A **running record** (`run:<group>:<lane>`) is renewed by the worker's heartbeat; a worker
//!   that dies stops renewing it and its slots come back within one lease even when no health
//!   checker runs. The health checker releases them at once on eviction.
//!
//! `waits` stays a public module: its functions read as `waits::quantile`, `waits::decode`.

mod finish;
mod start;
pub mod waits;

pub use finish::Finished;
pub use start::{Claim, ClaimRequest};
