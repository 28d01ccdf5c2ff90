//! Redis: the connection with retry, backoff and failover ([`Store`]), Redis behind Sentinel
//! (`redis+sentinel://`, [`Target`]), and the Lua scripts, loaded in one place ([`Scripts`]).
//!
//! # Scripts and their keys
//! One atomic decision per `.lua` file, beside the Rust that runs it (`run/start.lua`,
//! `registry/*.lua`, `route/reserve.lua`, …), opening with a header (`KEYS[1]: …`,
//! `ARGV[1]: …`, `returns: …`); every script but the rate limiter is the prelude
//! `names/keys.lua` followed by its own file (see [`Scripts`]).
//!
//! **One key convention.** Every key is built by [`Names`](crate::Names) in Rust or its Lua
//! mirror `names/keys.lua` (a test renders one against the other), and every key lives under
//! the namespace's hash tag `{<ns>}:`, so a fleet's keys share one Redis Cluster slot:
//! * a key the caller knows up front comes in whole through `KEYS` (`ratelimit.lua`'s bucket,
//!   `outcomes.lua`'s worker hash, `rooms.lua`'s group hashes);
//! * **the one exception — the prefix rule:** a script that discovers its keys while it runs
//!   (candidate groups from the label index, workers past their heartbeat, task ids read from a
//!   record) gets the namespace prefix `{<ns>}:` as `KEYS[1]` and builds those keys with the
//!   `K_*` functions of `keys.lua`, never by hand. Scripts that open with `KEYS[1]: key prefix`
//!   follow this rule for all their keys, as the prelude's functions are written for it.
//!
//! Keys are never hard-coded inside Lua; randomness comes in through `ARGV`.

mod scripts;
mod sentinel;
mod store;

pub use scripts::{Scripts, PRELUDE, REGISTRY_PRELUDE, SOURCES};
pub use sentinel::{Target, CLUSTER_SCHEME, SCHEME};
pub use store::{
    millis, now_ms, permanent, Clock, Failure, Store, CALL_TIMEOUT, REPLICA_RECHECK, REPLICA_WAIT,
    SKEW_WARN, SWITCH_PAUSE,
};
