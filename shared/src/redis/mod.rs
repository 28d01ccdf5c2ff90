//! Redis: the connection with retry, backoff and failover ([`Store`]), Redis behind Sentinel
//! (`redis+sentinel://`, [`Target`]), and the Lua scripts, loaded in one place ([`Scripts`]).
//!
//! # Scripts and their keys
//! One atomic decision per `.lua` file, beside the Rust that runs it (`run/start.lua`,
//! `registry/*.lua`, `route/reserve.lua`, …), opening with a header (`KEYS[1]: …`,
//! `ARGV[1]: …`, `returns: …`); a script under the prefix rule below is the prelude
//! `names/keys.lua` followed by its own file (see [`Scripts`]).
//!
//! **One key convention.** Every key is built by [`Names`](crate::Names) in Rust or its Lua
//! mirror `names/keys.lua` (a test renders one against the other), and every key lives under
//! the namespace's hash tag `{<ns>}:`, so a fleet's keys share one Redis Cluster slot.
//! * **The rule:** a key the script knows up front comes in whole through `KEYS`
//!   (`ratelimit.lua`'s bucket, `broker/dead_lock.lua`'s lease, `broker/dead_unclaim.lua`'s
//!   records, `registry/outcomes.lua`'s worker hash, `registry/rooms.lua`'s group hashes, the
//!   scheduler's `schedule/*.lua`).
//! * **The one exception, the prefix rule:** a script that discovers keys while it runs gets
//!   the namespace prefix `{<ns>}:` as `KEYS[1]` and builds them with the `K_*` functions of
//!   `keys.lua`, never by hand. Discovering means: candidate groups read from the label index
//!   (`route/reserve.lua`), workers found past their heartbeat and the tasks they ran
//!   (the other `registry/*.lua`), and every script that calls the prelude's status writers (`status_*`,
//!   `remove_worker`: `run/start.lua`, `run/finish.lua`, `status/broker_dead.lua`,
//!   `broker/dead_claim.lua`), which touch a task's record, attempt log, run sets and dedupe
//!   mark from its id and what its record says. Such a script's header opens with
//!   `KEYS[1]: key prefix`; only these scripts load the prelude.
//!
//! Keys are never hard-coded inside Lua; randomness comes in through `ARGV`.

mod scripts;
mod sentinel;
mod store;

pub use scripts::{Scripts, PRELUDE, REGISTRY_PRELUDE, SOURCES};
pub use sentinel::Target;
pub use store::{
    millis, now_ms, permanent, Clock, Failure, Store, CALL_TIMEOUT, REPLICA_RECHECK, SKEW_WARN,
};
