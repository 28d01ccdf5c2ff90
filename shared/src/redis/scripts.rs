//! The Lua scripts, each one atomic decision, loaded once and run by SHA (the `redis`
//! crate falls back to `SCRIPT LOAD` on `NOSCRIPT`, e.g. after a Redis restart).
//! A script under the prefix rule (see the key convention in [`crate::redis`]) is the prelude
//! `names/keys.lua` (key layout, the one clock, the status words and the status writers)
//! followed by its own file; the registry's scripts (in `registry/`, beside their Rust) have the
//! registry prelude `registry/worker.lua` in between. A script that gets whole keys is its own
//! file alone.

use deadpool_redis::redis::Script;

/// The common prelude of every script that builds keys from the namespace prefix (the
/// prefix rule of [`crate::redis`]); the scripts that get whole keys load without it.
pub const PRELUDE: &str = include_str!("../names/keys.lua");

/// The registry's prelude (after [`PRELUDE`]): worker capacity and removal.
pub const REGISTRY_PRELUDE: &str = include_str!("../registry/worker.lua");

macro_rules! script {
    ($file:literal) => {
        Script::new(concat!(
            include_str!("../names/keys.lua"),
            "\n",
            include_str!($file)
        ))
    };
    (registry $file:literal) => {
        Script::new(concat!(
            include_str!("../names/keys.lua"),
            "\n",
            include_str!("../registry/worker.lua"),
            "\n",
            include_str!($file)
        ))
    };
}

/// Every script's own file (without preludes), by file name, for tests that read the Lua.
pub const SOURCES: &[(&str, &str)] = &[
    ("names/keys.lua", include_str!("../names/keys.lua")),
    (
        "registry/worker.lua",
        include_str!("../registry/worker.lua"),
    ),
    (
        "registry/register.lua",
        include_str!("../registry/register.lua"),
    ),
    (
        "registry/heartbeat.lua",
        include_str!("../registry/heartbeat.lua"),
    ),
    (
        "registry/set_state.lua",
        include_str!("../registry/set_state.lua"),
    ),
    ("registry/eject.lua", include_str!("../registry/eject.lua")),
    ("registry/evict.lua", include_str!("../registry/evict.lua")),
    (
        "registry/deregister.lua",
        include_str!("../registry/deregister.lua"),
    ),
    (
        "registry/outcomes.lua",
        include_str!("../registry/outcomes.lua"),
    ),
    (
        "registry/reclaim.lua",
        include_str!("../registry/reclaim.lua"),
    ),
    ("route/reserve.lua", include_str!("../route/reserve.lua")),
    ("run/start.lua", include_str!("../run/start.lua")),
    ("run/finish.lua", include_str!("../run/finish.lua")),
    (
        "ratelimit/ratelimit.lua",
        include_str!("../ratelimit/ratelimit.lua"),
    ),
    (
        "status/broker_dead.lua",
        include_str!("../status/broker_dead.lua"),
    ),
    ("registry/rooms.lua", include_str!("../registry/rooms.lua")),
    (
        "broker/dead_claim.lua",
        include_str!("../broker/dead_claim.lua"),
    ),
    (
        "broker/dead_unclaim.lua",
        include_str!("../broker/dead_unclaim.lua"),
    ),
    (
        "broker/dead_lock.lua",
        include_str!("../broker/dead_lock.lua"),
    ),
    ("control/cancel.lua", include_str!("../control/cancel.lua")),
    (
        "control/forget_keys.lua",
        include_str!("../control/forget_keys.lua"),
    ),
    ("status/decided.lua", include_str!("../status/decided.lua")),
    ("status/walk.lua", include_str!("../status/walk.lua")),
    ("status/trim.lua", include_str!("../status/trim.lua")),
    ("status/forget.lua", include_str!("../status/forget.lua")),
];

/// All scripts of the fleet.
pub struct Scripts {
    /// `registry/register.lua`: adds (or re-adds) a worker to the registry and its capacity to its
    /// group.
    pub register: Script,
    /// `registry/heartbeat.lua`: a worker's liveness and figures; renews its running tasks'
    /// leases.
    pub heartbeat: Script,
    /// `registry/set_state.lua`: moves a worker between active, draining and ejected, adjusting
    /// its group's capacity and its subsetting ordinal.
    pub set_state: Script,
    /// `registry/eject.lua`: marks an active worker `ejected` unless its group would be left with
    /// no active normal-lane capacity.
    pub eject: Script,
    /// `registry/evict.lua`: removes every worker silent past the timeout (idempotent, for any
    /// number of schedulers).
    pub evict: Script,
    /// `registry/deregister.lua`: a worker leaves (end of drain), when its instance owns the id.
    pub deregister: Script,
    /// `route/reserve.lua`: for a batch of tasks, dedupes, chooses a group with room and reserves
    /// a leased slot.
    pub reserve: Script,
    /// `run/start.lua`: a worker claims task attempts before running them (batch); exactly one run
    /// per attempt.
    pub start: Script,
    /// `run/finish.lua`: a worker records attempts' outcomes, or releases attempts that ended
    /// without one (batch).
    pub finish: Script,
    /// `ratelimit/ratelimit.lua` (no prelude): the GCRA token bucket every scheduler replica shares.
    pub ratelimit: Script,
    /// `registry/outcomes.lua`: a worker publishes its figures (user attempts by outcome) as it
    /// records finishes.
    pub outcomes: Script,
    /// `status/broker_dead.lua`: the status of a task the broker dead-lettered itself (a quorum
    /// queue's delivery limit).
    pub broker_dead: Script,
    /// `registry/reclaim.lua`: removes a departed group after its grace, in steps around the
    /// deletion of its queues.
    pub reclaim: Script,
    /// `registry/rooms.lua`: sets each still-existing group's room ahead of its workers.
    pub rooms: Script,
    /// `broker/dead_claim.lua`: claims task ids for a dead-letter replay, one replay of an id at a
    /// time.
    pub dead_claim: Script,
    /// `broker/dead_unclaim.lua` (no prelude: whole keys): gives back ids a replay claimed but could not publish.
    pub dead_unclaim: Script,
    /// `broker/dead_lock.lua` (no prelude: whole key): renews or releases the dead-queue reader lease while the caller holds
    /// it.
    pub dead_lock: Script,
    /// `control/cancel.lua`: marks tasks cancelled (an operator's cancel, or the control stream
    /// applied again after a Redis loss; see `fleet::control`).
    pub cancel: Script,
    /// `control/forget_keys.lua`: forgets the fairness keys that went idle (their figures,
    /// lapsed leases and K_ka entry).
    pub forget_keys: Script,
    /// `status/decided.lua`: the status transitions the scheduler decided for a batch
    /// ([`crate::status::Writes`]), never over a final state.
    pub decided: Script,
    /// `status/walk.lua`: one step of a walk of the task index, newest first
    /// ([`crate::status::index`]).
    pub walk: Script,
    /// `status/trim.lua`: removes the oldest index entries whose status record is gone.
    pub trim: Script,
    /// `status/forget.lua`: removes the dead or expired records of deleted dead letters.
    pub forget: Script,
}

impl Scripts {
    /// Every script, built from its files (nothing is sent to Redis until a script first
    /// runs).
    pub fn load() -> Self {
        Scripts {
            register: script!(registry "../registry/register.lua"),
            heartbeat: script!(registry "../registry/heartbeat.lua"),
            set_state: script!(registry "../registry/set_state.lua"),
            eject: script!(registry "../registry/eject.lua"),
            evict: script!(registry "../registry/evict.lua"),
            deregister: script!(registry "../registry/deregister.lua"),
            reserve: Script::new(concat!(
                include_str!("../names/keys.lua"),
                "\n",
                include_str!("../route/reserve.lua")
            )),
            start: script!("../run/start.lua"),
            finish: script!("../run/finish.lua"),
            ratelimit: Script::new(include_str!("../ratelimit/ratelimit.lua")),
            outcomes: Script::new(include_str!("../registry/outcomes.lua")),
            broker_dead: script!("../status/broker_dead.lua"),
            reclaim: script!(registry "../registry/reclaim.lua"),
            rooms: Script::new(include_str!("../registry/rooms.lua")),
            dead_claim: script!("../broker/dead_claim.lua"),
            dead_unclaim: Script::new(include_str!("../broker/dead_unclaim.lua")),
            dead_lock: Script::new(include_str!("../broker/dead_lock.lua")),
            cancel: script!("../control/cancel.lua"),
            forget_keys: script!("../control/forget_keys.lua"),
            decided: script!("../status/decided.lua"),
            walk: script!("../status/walk.lua"),
            trim: script!("../status/trim.lua"),
            forget: script!("../status/forget.lua"),
        }
    }
}
