//! Parking: where a group's tasks wait, durably and in order, while no matching group has
//! room — without blocking tasks bound for other groups (no head-of-line blocking). The
//! scheduler's whole side of it is here; the Redis side (the parked flag) is [`fleet::route::park`],
//! and the choice to park is `reserve.lua`'s ([`fleet::route`]).
//!
//! * **Where** — the reservation answers `full` naming the candidate group that will free room
//!   first; dispatch publishes the task to that group's park queue
//!   `<ns>.park.<group>.<lane>` ([`fleet::Names::park_queue`]). A task no live group matches
//!   waits in the park queue of the pseudo-group [`UNMATCHED`] (the waiting-for-worker queue)
//!   until one registers, or its grace passes.
//! * **Queues** — each park queue is declared by this session once, on a channel of its own,
//!   before its first task ([`Queues`]), and by discovery for every group it finds.
//! * **Flag** — while a group has parked tasks its flag (`pk:<group>:<lane>`) is set: by
//!   `reserve.lua` when a task parks, renewed by the group's release loop while it holds tasks,
//!   expiring by itself after [`fleet::route::park::FLAG_TTL_MS`] if the scheduler dies. The group
//!   counts as full for new work meanwhile, so new tasks park behind parked ones instead of
//!   overtaking them. The release loop clears it once its queue is drained.
//! * **Release order** — one loop per (group, lane) ([`Release`]) takes tasks from the head of
//!   its park queue and offers them to the reservation again (released tasks are not stopped
//!   by the flag), every [`RETRY_MIN`], doubling to [`RETRY_MAX`] while nothing frees; the
//!   waiting-for-worker queue's every [`UNMATCHED_RETRY`]. What still finds no room is held,
//!   unacked and in order, so a scheduler crash returns it to the head of its queue.
//! * **Bounds** — a park queue is bounded (`FLEET_PARK_MAX`, `FLEET_PARK_MAX_CRITICAL`; `reject-publish`): a park
//!   publish the broker refuses requeues its source and pauses the ingress loop. A release
//!   loop holds at most [`hold_max`] tasks (held tasks do not count against the bound).
//! * **Discovery and reclaim** — [`Discovery`] starts the loops of every group in the fleet
//!   view (every [`crate::config::PARK_DISCOVERY_INTERVAL`]); a group's reclaim stops them
//!   ([`ParkLoops::stop_group`]) and forgets its queues ([`Queues::forget`]), or declares them
//!   again when the reclaim is undone ([`Queues::declare`]).

/// How many tasks this session's release loops hold per (group, lane) — unacked, so in no
/// queue's ready count: the backlog figures add them (`fleetctl groups`, `GET /v1/groups`,
/// `GET /v1/scaling`'s `unmatched`). Each replica knows its own loops' only: with several
/// replicas a figure that adds them is a lower bound, like the delay tiers' (`crate::scaling`).
#[derive(Debug, Default)]
pub struct HeldByQueue(std::sync::Mutex<std::collections::HashMap<(String, fleet::Lane), u32>>);

impl HeldByQueue {
    /// The tasks held for `group`'s `lane` now (its park queue and, on the normal lane, its
    /// fair park queues).
    pub fn get(&self, group: &str, lane: fleet::Lane) -> u32 {
        self.0
            .lock()
            .map(|m| m.get(&(group.to_string(), lane)).copied().unwrap_or(0))
            .unwrap_or(0)
    }

    fn set(&self, group: &str, lane: fleet::Lane, n: usize) {
        if let Ok(mut m) = self.0.lock() {
            let n = u32::try_from(n).unwrap_or(u32::MAX);
            if n == 0 {
                m.remove(&(group.to_string(), lane));
            } else {
                m.insert((group.to_string(), lane), n);
            }
        }
    }
}

/// One release loop's entry in a [`HeldByQueue`]: set as its hold changes, removed when the
/// loop ends (its deliveries go back to the queue with its channel).
pub(crate) struct HeldShare<'a> {
    board: &'a HeldByQueue,
    group: &'a str,
    lane: fleet::Lane,
}

impl<'a> HeldShare<'a> {
    pub(crate) fn new(board: &'a HeldByQueue, group: &'a str, lane: fleet::Lane) -> Self {
        HeldShare { board, group, lane }
    }

    pub(crate) fn set(&self, n: usize) {
        self.board.set(self.group, self.lane, n);
    }
}

impl Drop for HeldShare<'_> {
    fn drop(&mut self) {
        self.board.set(self.group, self.lane, 0);
    }
}

pub mod discovery;
pub mod fair;
pub mod loops;
pub mod queues;
pub mod release;

pub use discovery::Discovery;
pub use loops::ParkLoops;
pub use queues::Queues;
pub use release::{hold_max, Release, RETRY_MAX, RETRY_MIN, UNMATCHED_RETRY};

/// The pseudo-group whose park queues hold tasks no live group matches yet
/// (`<ns>.park._unmatched.<lane>`): bounded, durable, counted as pending, nothing circles.
pub const UNMATCHED: &str = fleet::Names::UNMATCHED_GROUP;
