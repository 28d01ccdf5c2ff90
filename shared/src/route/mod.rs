//! Routing: which group gets a task.
//!
//! The choice and the reservation are one Lua script (`reserve.lua`, beside this file; its Rust
//! side in [`reserve`]), so that any number
//! of scheduler replicas can route concurrently without over-reserving. Candidate groups come
//! from a label index (`idx:<k>=<v>` sets, intersected), so routing cost grows with the number
//! of *matching groups*, never with the number of workers. A candidate must also handle the
//! task's `kind` — every active worker of the group handles it ([`crate::registry::Kinds`]) —
//! read from the group hash with its capacity (no extra command per task). A group has room while
//! `running + reserved < capacity × (1 + backlog_factor)`; reservations carry a lease, so a
//! scheduler that dies after reserving leaks nothing for longer than the lease.
//!
//! The same script call dedupes ([`Dedupe`], one mark per task id) and parks a task whose
//! candidate groups are all full ([`park`]: the group's "has parked tasks" flag), so both live
//! here with the reservation. `reserve` and `park` stay public modules (`park::FLAG_TTL_MS`).

mod dedupe;
pub mod park;
pub mod reserve;

pub use dedupe::Dedupe;
pub use reserve::{KeyArg, ReserveParams, ReserveRequest, Reserved, TaskDescription};

/// The outcome of one reservation attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reservation {
    /// Reserved in this group; publish to its lane queue.
    Reserved(String),
    /// Groups match but none has room; the best candidate is named (park the task there).
    Full(String),
    /// A task with a fairness key parks behind `group`: in its fair park queue `queue` (see
    /// [`crate::Names::fair_group`]; `None`: the group's own park queue). `blocked`: its key
    /// is paused, at its `max_running` or out of rate tokens (nothing was taken); otherwise
    /// the group had no room.
    KeyPark {
        /// The group it waits for.
        group: String,
        /// Its fair park queue's index, if it has one.
        queue: Option<u16>,
        /// Its key may take nothing now (rather than: no room).
        blocked: bool,
    },
    /// No live group matches the selector and handles the task's kind.
    NoMatch,
    /// The task id was seen within the dedupe window.
    Duplicate,
    /// Dedupe only (no routing asked): not a duplicate.
    Fresh,
    /// An operator cancelled the task: drop it (ack), never dispatch it; nothing was reserved.
    Cancelled,
    /// The reservation script failed on this task alone (its detail): dead-letter it.
    Failed(String),
}
