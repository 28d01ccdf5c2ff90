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
