//! The worker registry in Redis: registration, heartbeats, states, eviction, groups and their
//! reclaim — the Rust beside the Lua it runs (`*.lua` in this folder; every registry script
//! but `outcomes.lua` and `rooms.lua`, which get whole keys, is `names/keys.lua` + `worker.lua`
//! + its own file; see the key convention in [`crate::redis`]).
//!
//! **Capacity as counters, load as leases.** A group's capacity is a counter per lane
//! (`g:<group>` fields `cap:normal`, `cap:critical`) that every state change adjusts by the
//! worker's contribution — its capacity while `active`, else 0 (`worker.lua` `contrib`) — so
//! routing reads one hash field instead of summing workers. Running and reserved counts are
//! *not* counters but leased sorted-set members, so they can never drift: an expired lease
//! simply stops counting.
//!
//! **Liveness.** A worker's heartbeat (`heartbeat`) stamps it in `workers` (a sorted set
//! scored by Redis time) and renews the leases of what it runs. The scheduler's health checker
//! evicts every worker silent past the heartbeat timeout (`evict`): `remove_worker` takes
//! back its capacity, frees its subsetting ordinal, releases its running records and puts the
//! task it was running back to `queued` (the broker redelivers it; the next claim counts the
//! crash, see `run/start.lua`). A registration under a live id is refused (the status word `duplicate`), unless
//! the new process proves the old one gone (its broker lock queue).
//!
//! **Kinds.** A worker advertises the task kinds it handles; a group handles a kind when every
//! active worker of it does (see [`Kinds`]). The reservation script routes a task only to a
//! group that handles its kind.
//!
//! **Departure.** A group with no worker and no work for a grace is reclaimed (`reclaim`).
//!
//! Submodules are private; their public names are re-exported here (`fleet::registry::…`).

mod evict;
mod groups;
mod heartbeat;
mod kinds;
mod reclaim;
mod worker;

pub use groups::GroupView;
pub use heartbeat::{Beat, BeatReply};
pub use kinds::{Kinds, KindsError, MAX_KIND_BYTES};
pub use reclaim::ReclaimClaim;
pub use worker::{Registration, WorkerState, WorkerView};
