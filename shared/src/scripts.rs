//! The Lua scripts, each one atomic decision, loaded once and run by SHA (the `redis`
//! crate falls back to `SCRIPT LOAD` on `NOSCRIPT`, e.g. after a Redis restart).
//! Every script is the key-layout prelude `lua/keys.lua` followed by its own file.

use deadpool_redis::redis::Script;

macro_rules! script {
    ($file:literal) => {
        Script::new(concat!(include_str!("lua/keys.lua"), "\n", include_str!(concat!("lua/", $file))))
    };
}

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
}

impl Scripts {
    pub fn load() -> Self {
        Scripts {
            register: script!("register.lua"),
            heartbeat: script!("heartbeat.lua"),
            set_state: script!("set_state.lua"),
            eject: script!("eject.lua"),
            evict: script!("evict.lua"),
            deregister: script!("deregister.lua"),
            reserve: script!("reserve.lua"),
            start: script!("start.lua"),
            finish: script!("finish.lua"),
            ratelimit: Script::new(include_str!("lua/ratelimit.lua")),
            outcomes: script!("outcomes.lua"),
            broker_dead: script!("broker_dead.lua"),
            reclaim: script!("reclaim.lua"),
            rooms: script!("rooms.lua"),
        }
    }
}
