//! The Lua scripts, each one atomic decision, loaded once and run by SHA (the `redis`
//! crate falls back to `SCRIPT LOAD` on `NOSCRIPT`, e.g. after a Redis restart).
//! Every script is the prelude `lua/keys.lua` (key layout, the one clock, the status words and
//! the status writers) followed by its own file; the registry's scripts (in `registry/`, beside
//! their Rust) have the registry prelude `registry/worker.lua` in between.

use deadpool_redis::redis::Script;

/// The common prelude of every script but the rate limiter.
pub const PRELUDE: &str = include_str!("lua/keys.lua");

/// The registry's prelude (after [`PRELUDE`]): worker capacity and removal.
pub const REGISTRY_PRELUDE: &str = include_str!("registry/worker.lua");

macro_rules! script {
    ($file:literal) => {
        Script::new(concat!(
            include_str!("lua/keys.lua"),
            "\n",
            include_str!(concat!("lua/", $file))
        ))
    };
    (registry $file:literal) => {
        Script::new(concat!(
            include_str!("lua/keys.lua"),
            "\n",
            include_str!("registry/worker.lua"),
            "\n",
            include_str!(concat!("registry/", $file))
        ))
    };
}

/// Every script's own file (without preludes), by file name, for tests that read the Lua.
pub const SOURCES: &[(&str, &str)] = &[
    ("lua/keys.lua", include_str!("lua/keys.lua")),
    ("registry/worker.lua", include_str!("registry/worker.lua")),
    (
        "registry/register.lua",
        include_str!("registry/register.lua"),
    ),
    (
        "registry/heartbeat.lua",
        include_str!("registry/heartbeat.lua"),
    ),
    (
        "registry/set_state.lua",
        include_str!("registry/set_state.lua"),
    ),
    ("registry/eject.lua", include_str!("registry/eject.lua")),
    ("registry/evict.lua", include_str!("registry/evict.lua")),
    (
        "registry/deregister.lua",
        include_str!("registry/deregister.lua"),
    ),
    (
        "registry/outcomes.lua",
        include_str!("registry/outcomes.lua"),
    ),
    ("registry/reclaim.lua", include_str!("registry/reclaim.lua")),
    ("route/reserve.lua", include_str!("route/reserve.lua")),
    ("lua/start.lua", include_str!("lua/start.lua")),
    ("lua/finish.lua", include_str!("lua/finish.lua")),
    ("lua/ratelimit.lua", include_str!("lua/ratelimit.lua")),
    ("lua/broker_dead.lua", include_str!("lua/broker_dead.lua")),
    ("lua/rooms.lua", include_str!("lua/rooms.lua")),
    ("lua/dead_claim.lua", include_str!("lua/dead_claim.lua")),
    ("lua/dead_unclaim.lua", include_str!("lua/dead_unclaim.lua")),
    ("lua/dead_lock.lua", include_str!("lua/dead_lock.lua")),
    ("lua/cancel.lua", include_str!("lua/cancel.lua")),
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
    /// `lua/start.lua`: a worker claims task attempts before running them (batch); exactly one run
    /// per attempt.
    pub start: Script,
    /// `lua/finish.lua`: a worker records attempts' outcomes, or releases attempts that ended
    /// without one (batch).
    pub finish: Script,
    /// `lua/ratelimit.lua` (no prelude): the GCRA token bucket every scheduler replica shares.
    pub ratelimit: Script,
    /// `registry/outcomes.lua`: a worker publishes its figures (user attempts by outcome) as it
    /// records finishes.
    pub outcomes: Script,
    /// `lua/broker_dead.lua`: the status of a task the broker dead-lettered itself (a quorum
    /// queue's delivery limit).
    pub broker_dead: Script,
    /// `registry/reclaim.lua`: removes a departed group after its grace, in steps around the
    /// deletion of its queues.
    pub reclaim: Script,
    /// `lua/rooms.lua`: sets each still-existing group's room ahead of its workers.
    pub rooms: Script,
    /// `lua/dead_claim.lua`: claims task ids for a dead-letter replay, one replay of an id at a
    /// time.
    pub dead_claim: Script,
    /// `lua/dead_unclaim.lua`: gives back ids a replay claimed but could not publish.
    pub dead_unclaim: Script,
    /// `lua/dead_lock.lua`: renews or releases the dead-queue reader lease while the caller holds
    /// it.
    pub dead_lock: Script,
    /// `lua/cancel.lua`: marks tasks cancelled (an operator's cancel, or the control stream
    /// applied again after a Redis loss; see [`crate::control`]).
    pub cancel: Script,
}

impl Scripts {
    /// Every script, built from its files (nothing is sent to Redis until a script first
    /// runs).
    pub fn load() -> Self {
        Scripts {
            register: script!(registry "register.lua"),
            heartbeat: script!(registry "heartbeat.lua"),
            set_state: script!(registry "set_state.lua"),
            eject: script!(registry "eject.lua"),
            evict: script!(registry "evict.lua"),
            deregister: script!(registry "deregister.lua"),
            reserve: Script::new(concat!(
                include_str!("lua/keys.lua"),
                "\n",
                include_str!("route/reserve.lua")
            )),
            start: script!("start.lua"),
            finish: script!("finish.lua"),
            ratelimit: Script::new(include_str!("lua/ratelimit.lua")),
            outcomes: script!(registry "outcomes.lua"),
            broker_dead: script!("broker_dead.lua"),
            reclaim: script!(registry "reclaim.lua"),
            rooms: script!("rooms.lua"),
            dead_claim: script!("dead_claim.lua"),
            dead_unclaim: script!("dead_unclaim.lua"),
            dead_lock: script!("dead_lock.lua"),
            cancel: script!("cancel.lua"),
        }
    }
}
