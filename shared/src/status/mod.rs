//! Task status records (`t:<id>` hashes with a TTL) and the attempt log (`ta:<id>`).
//!
//! A record says where a task is ([`TaskState`]: delayed, waiting_for_worker, parked, queued,
//! running, retrying, succeeded, dead, expired, cancelled), with its attempt, worker, times, a truncated
//! result or error and — for dead and expired — a [`DeadReason`]. Status is state that may be
//! lost: the task itself always lives in the broker.
//!
//! **One writer per transition.** The scripts that reserve, start and finish write the status
//! in the same atomic step (no extra round trip), through the `status_*` functions of
//! `names/keys.lua` — the prelude of every script:
//!
//! | transition | writer | called by |
//! |---|---|---|
//! | → queued / parked (dispatched, or waiting for room) | `status_queued`, `status_parked` | `reserve.lua` |
//! | → running (claimed) | `status_running` | `start.lua` |
//! | → queued as a crash suspect | `status_suspect` | `start.lua` |
//! | → queued (attempt lost with its worker, or released) | `status_requeued` | `remove_worker`, `finish.lua` |
//! | → succeeded / retrying / dead / expired (an attempt's outcome) | `status_finished` | `finish.lua` |
//! | → dead (worker lost on the last attempt; broker dead-lettered) | `status_dead` | `start.lua`, `broker_dead.lua` |
//! | → dead / expired, waiting_for_worker, delayed (decided by the scheduler; never over a final state) | `status_decided` ([`Writes`], `status/decided.lua`) | `scheduler::dispatch` |
//! | → parked behind `_kind.<kind>` (held for a paused kind) | [`Writes::held`] | `scheduler::dispatch` |
//! | → forgotten: a new run of an id submitted again after its dedupe window, its last run over | `status_resubmitted` | `reserve.lua` |
//! | → cancelled (an operator's cancel; re-applied from the control stream after a Redis loss) | `status_cancelled` | `cancel.lua` ([`crate::control`]) |
//! | → cancelled (the stopped attempt's end) | `status_cancel_ended` | `finish.lua` |
//! | → queued, held for a dead-letter replay (one replay of an id at a time) | `status_replayed` | `dead_claim.lua` ([`crate::broker::dead::replay`]) |
//!
//! The scripts spell the words through the tables `S`, `R` and `O` of `keys.lua`; a unit test
//! below checks them (and any such word written out in a script) against the enums, so the
//! two sides cannot drift. The one writer that is a script of this wing, `broker_dead.lua`
//! (the status of a task the broker dead-lettered itself), lives beside [`Writes`].
//!
//! **The task index.** The writer that creates a run's record also adds the id to the task
//! index (`index_run` in keys.lua: one `ZADD` per task, in a script that runs anyway), which
//! the task list and the bulk actions walk: see [`index`]. A dead letter deleted by an
//! operator takes its record with it (`status/forget.lua`).
//!
//! Reading: [`typed`] (the API's JSON), [`attempt_history`], [`Store::task_status`](crate::Store::task_status).

pub mod index;
mod read;
mod state;
mod write;

pub use read::{attempt_history, rfc3339_ms, typed, typed_attempt};
pub use state::{AttemptOutcome, DeadReason, TaskState, UnknownWord};
pub use write::{truncate, Writes, MAX_STATUS_TEXT};

/// States that end a task, as stored ([`TaskState::TERMINAL`]).
pub const TERMINAL: &[&str] = &[
    TaskState::Succeeded.as_str(),
    TaskState::Dead.as_str(),
    TaskState::Expired.as_str(),
    TaskState::Cancelled.as_str(),
];

/// Most entries a task's attempt log keeps (the oldest are dropped). Mirrors
/// `ATTEMPT_LOG_MAX` in `names/keys.lua`, which writes the log (a unit test keeps them equal).
pub const ATTEMPT_LOG_MAX: usize = 20;

#[cfg(test)]
mod lua_words {
    //! The status words of the Lua scripts against the enums.
    use std::collections::BTreeMap;

    use super::*;
    use crate::redis::SOURCES;

    /// The Lua code without comments.
    fn code(src: &str) -> String {
        src.lines()
            .map(|l| l.find("--").map_or(l, |i| &l[..i]))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// `local NAME = { k = 'v', ... }` of keys.lua.
    fn table(name: &str) -> BTreeMap<String, String> {
        let keys = SOURCES
            .iter()
            .find(|(f, _)| *f == "names/keys.lua")
            .map(|(_, s)| *s)
            .unwrap_or_default();
        let start = format!("local {name} = {{");
        let line = keys
            .lines()
            .find(|l| l.starts_with(&start))
            .unwrap_or_else(|| panic!("keys.lua has no table {name}"));
        let body = line[start.len()..].trim_end().trim_end_matches('}');
        body.split(',')
            .filter(|e| !e.trim().is_empty())
            .map(|e| {
                let (k, v) = e
                    .split_once('=')
                    .unwrap_or_else(|| panic!("bad entry {e:?} in {name}"));
                (
                    k.trim().to_string(),
                    v.trim().trim_matches('\'').to_string(),
                )
            })
            .collect()
    }

    /// Every single-quoted literal of a piece of Lua.
    fn literals(code: &str) -> Vec<String> {
        code.split('\'')
            .skip(1)
            .step_by(2)
            .map(str::to_string)
            .collect()
    }

    /// Every `T.name` use (T one of the table names) in a piece of Lua.
    fn uses(code: &str, t: &str) -> Vec<String> {
        let pat = format!("{t}.");
        let mut out = Vec::new();
        for (i, _) in code.match_indices(&pat) {
            let before = code[..i].chars().last();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '.') {
                continue;
            }
            let name: String = code[i + pat.len()..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            out.push(name);
        }
        out
    }

    #[test]
    fn the_tables_are_the_enums_words() {
        for (k, v) in table("S") {
            assert_eq!(k, v);
            assert!(
                v.parse::<TaskState>().is_ok(),
                "S.{k}: `{v}` is not a TaskState"
            );
        }
        for (k, v) in table("R") {
            assert_eq!(k, v);
            assert!(
                v.parse::<DeadReason>().is_ok(),
                "R.{k}: `{v}` is not a DeadReason"
            );
        }
        for (k, v) in table("O") {
            assert_eq!(k, v);
            assert!(
                v.parse::<AttemptOutcome>().is_ok(),
                "O.{k}: `{v}` is not an AttemptOutcome"
            );
        }
    }

    #[test]
    fn scripts_use_only_the_tables_words() {
        let (s, r, o) = (table("S"), table("R"), table("O"));
        // Answers that happen to spell a state but are not one (reclaim's busy reasons: the
        // group still has running or parked records).
        let exempt = [
            ("registry/reclaim.lua", "running"),
            ("registry/reclaim.lua", "parked"),
        ];
        let mut seen = 0;
        for (file, src) in SOURCES {
            let mut code = code(src);
            if *file == "names/keys.lua" {
                code = code
                    .lines()
                    .filter(|l| {
                        !l.starts_with("local S =")
                            && !l.starts_with("local R =")
                            && !l.starts_with("local O =")
                    })
                    .collect::<Vec<_>>()
                    .join("\n");
            }
            for lit in literals(&code) {
                let word = lit.parse::<TaskState>().is_ok()
                    || lit.parse::<DeadReason>().is_ok()
                    || lit.parse::<AttemptOutcome>().is_ok();
                assert!(!word || exempt.contains(&(*file, lit.as_str())), "{file} spells out the status word '{lit}': use S.{lit}, R.{lit} or O.{lit} from keys.lua");
            }
            for (t, table) in [("S", &s), ("R", &r), ("O", &o)] {
                for name in uses(&code, t) {
                    assert!(
                        table.contains_key(&name),
                        "{file} uses {t}.{name}, which keys.lua's table {t} does not have"
                    );
                    seen += 1;
                }
            }
        }
        assert!(
            seen >= 15,
            "the scripts should write their status words through S, R and O (found {seen})"
        );
    }

    #[test]
    fn the_status_writers_are_the_only_state_writes() {
        // An HSET of a `state` field outside keys.lua's status writers may only be a worker's
        // state (the registry's scripts write `w:<id>` hashes).
        let mut writers = 0;
        for (file, src) in SOURCES {
            for call in code(src).split("redis.call(").skip(1) {
                let args = call.split(')').next().unwrap_or_default();
                if args.starts_with("'HSET'") && args.contains("'state'") {
                    assert!(
                        *file == "names/keys.lua" || file.starts_with("registry/"),
                        "{file} writes a task state outside the status writers: {args}"
                    );
                    writers += usize::from(*file == "names/keys.lua");
                }
            }
        }
        assert!(
            writers >= 5,
            "keys.lua's status writers set `state` (found {writers})"
        );
    }
}
