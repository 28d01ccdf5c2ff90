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
];

/// All scripts of the fleet.
pub struct Scripts {
    pub register: Script,
    pub heartbeat: Script,
    pub set_state: Script,
    pub eject: Script,
    pub evict: Script,
    pub deregister: Script,
    pub reserve: Script,
    pub start: Script,
    pub finish: Script,
    pub ratelimit: Script,
    pub outcomes: Script,
    pub broker_dead: Script,
    pub reclaim: Script,
    pub rooms: Script,
    pub dead_claim: Script,
    pub dead_unclaim: Script,
    pub dead_lock: Script,
}

impl Scripts {
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
        }
    }
}
