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

pub mod reserve;

pub use reserve::{ReserveParams, ReserveRequest, TaskDescription};

/// How to choose among the groups with room.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// Lowest `(running + reserved) / capacity`.
    #[default]
    LeastLoaded,
    /// Rotate over the matching groups (a counter per lane and candidate set).
    RoundRobin,
    /// Random, weighted by free capacity × health (error ratio and CPU from heartbeats), as in
    /// the SRE book's weighted round robin.
    Weighted,
}

impl Strategy {
    /// The strategy's word: `least_loaded`, `round_robin` or `weighted`.
    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::LeastLoaded => "least_loaded",
            Strategy::RoundRobin => "round_robin",
            Strategy::Weighted => "weighted",
        }
    }

    /// The strategy [`as_str`](Self::as_str) names; `None` for any other word.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "least_loaded" => Some(Strategy::LeastLoaded),
            "round_robin" => Some(Strategy::RoundRobin),
            "weighted" => Some(Strategy::Weighted),
            _ => None,
        }
    }
}

/// The outcome of one reservation attempt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reservation {
    /// Reserved in this group; publish to its lane queue.
    Reserved(String),
    /// Groups match but none has room; the best candidate is named (park the task there).
    Full(String),
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
