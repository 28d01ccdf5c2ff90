//! Reservations and in-flight records, both leased.
//!
//! * A **reservation** (`resv:<group>:<lane>`, member = task id, score = lease expiry) is taken
//!   by the scheduler when it dispatches a task to a group queue and turned into a running
//!   record when a worker starts it. If the task sits in the queue past the lease the slot is
//!   simply counted free again (the worker's prefetch still bounds what actually runs), so a
//!   scheduler crash between reserve and publish leaks a slot for one lease at most.
//! * A **running record** (`run:<group>:<lane>`) is renewed by the worker's heartbeat; a worker
//!   that dies stops renewing it and its slots come back within one lease even when no health
//!   checker runs. The health checker releases them at once on eviction.

use std::time::Duration;

use deadpool_redis::redis;

use crate::envelope::Lane;
use crate::error::Result;
use crate::route::{Reservation, Strategy};
use crate::selector::Labels;
use crate::status::{DeadReason, TaskState};
use crate::store::Store;

/// Dedupe behaviour of one reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dedupe {
    /// Not checked (tasks coming back from a delay tier or a park queue).
    Skip,
    /// Set-if-absent: a seen id is a duplicate.
    Check,
    /// A redelivered ingress message: a duplicate only if it was already handed on
    /// ([`Store::mark_handed_on`]); otherwise its mark may be this scheduler's own.
    Mark,
}

/// One task to route.
#[derive(Debug, Clone)]
pub struct ReserveRequest {
    pub id: String,
    pub lane: Lane,
    pub selector: Labels,
    pub strategy: Option<Strategy>,
    pub dedupe: Dedupe,
    /// Released from a park queue: may take room even while the group has parked tasks.
    pub from_park: bool,
    /// Dedupe only, no routing (a delayed submission, routed when it is due): the answer is
    /// [`Reservation::Fresh`] or [`Reservation::Duplicate`].
    pub dedupe_only: bool,
}

/// Parameters of routing common to a batch.
#[derive(Debug, Clone, Copy)]
pub struct ReserveParams {
    pub lease_ms: i64,
    pub backlog_factor: f64,
    pub strategy: Strategy,
    pub dedupe_window_ms: i64,
    pub status_ttl_ms: i64,
    /// Names this batch's dedupe marks (`p:<token>`): a retry of the same batch with the same
    /// token never takes its own marks for duplicates. New for every batch; reused by retries.
    pub token: u64,
    /// Direct dispatch: a normal-lane task that only one live group can take is reserved there even
    /// beyond the group's room (no routing choice to protect; the group's consumers' prefetch
    /// bounds what they hold), unless tasks already park for that group. The scheduler sets
    /// it; `false` makes every task need room (the script's bound alone).
    pub direct: bool,
    /// How long a group's "has parked tasks" flag lives unless renewed (ms): set here when a
    /// task parks, kept alive by the scheduler's park loop while it holds tasks.
    pub park_flag_ttl_ms: i64,
}

/// A finished task's outcome as recorded in its status.
#[derive(Debug, Clone)]
pub struct Finished {
    pub lane: Lane,
    pub id: String,
    /// The attempt that ended: a late write from an older attempt never overwrites the status
    /// of a newer one (ledger batches of different workers may land out of order).
    pub attempt: u32,
    /// `Succeeded`, `Retrying`, `Dead` or `Expired`; `None` for a release (no outcome).
    pub state: Option<TaskState>,
    /// The result (success) or the error text, truncated.
    pub text: String,
    pub success: bool,
    /// Why a task ended `dead` or `expired` (`max_attempts`, `permanent_error`, `expired`: the
    /// dead letter's `x-fleet-reason`), as the scheduler records for the states it decides;
    /// `None` otherwise.
    pub reason: Option<DeadReason>,
}

impl Finished {
    /// An attempt that ended without an outcome (hard stop): its delivery went back to the
    /// broker and the next copy runs the same attempt again.
    pub fn release(lane: Lane, id: String, attempt: u32) -> Self {
        Finished { lane, id, attempt, state: None, text: String::new(), success: false, reason: None }
    }
}

/// One attempt a worker asks to run.
#[derive(Debug, Clone)]
pub struct ClaimRequest {
    pub lane: Lane,
    pub id: String,
    /// The envelope's `attempt` + 1: the same for every copy of one delivery.
    pub base: u32,
    pub max_attempts: u32,
    /// This process runs nothing else now (a crash suspect's second claim).
    pub isolated: bool,
}

/// The answer to a claim (see `lua/start.lua`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// Run it, as this attempt number (crashes already counted).
    Run(u32),
    /// A crash suspect: it was in flight when its worker died. Run it only while this process
    /// runs nothing else, then claim again with `isolated`.
    Isolate(u32),
    /// Another copy of this attempt is running on a live worker: hold this delivery and ask
    /// again later; never run it meanwhile.
    Wait,
    /// A stale or duplicate copy (this attempt finished, or a newer one exists): ack it
    /// without running.
    Duplicate,
    /// Its worker died while running it alone on its last attempt: dead-letter it
    /// (`worker_lost`) with this attempt count.
    Dead(u32),
}

impl Claim {
    /// One answer of `start.lua`: its word and attempt number. `None` for a word the script
    /// never says (a script and binary out of step: the claim fails as a whole).
    fn from_answer(word: &str, attempt: u32) -> Option<Claim> {
        Some(match word {
            "run" => Claim::Run(attempt),
            "iso" => Claim::Isolate(attempt),
            "dlq" => Claim::Dead(attempt),
            "wait" => Claim::Wait,
            "dup" => Claim::Duplicate,
            _ => return None,
        })
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Longest result or error text kept in a status record.
pub const MAX_STATUS_TEXT: usize = 4096;

pub fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

impl Store {
    /// Routes and reserves a batch in one script call; one answer per request, in order.
    pub async fn reserve(&self, reqs: &[ReserveRequest], p: ReserveParams) -> Result<Vec<Reservation>> {
        if reqs.is_empty() {
            return Ok(vec![]);
        }
        // The batch's distinct selectors, sent once each; every task names its own by index.
        let mut selectors: Vec<Vec<String>> = Vec::new();
        let mut index: std::collections::HashMap<&Labels, usize> = std::collections::HashMap::new();
        let which: Vec<usize> = reqs
            .iter()
            .map(|r| {
                *index.entry(&r.selector).or_insert_with(|| {
                    selectors.push(r.selector.pairs());
                    selectors.len()
                })
            })
            .collect();
        let mut inv = self.scripts.reserve.prepare_invoke();
        inv.key(self.names.prefix())
            .arg(p.token)
            .arg(p.lease_ms)
            .arg(p.backlog_factor)
            .arg(p.strategy.as_str())
            .arg(p.dedupe_window_ms)
            .arg(p.status_ttl_ms)
            .arg(u8::from(p.direct))
            .arg(p.park_flag_ttl_ms)
            .arg(rand::random::<u32>())
            .arg(selectors.len());
        for pairs in &selectors {
            inv.arg(pairs.len()).arg(pairs);
        }
        inv.arg(reqs.len());
        for (r, k) in reqs.iter().zip(which) {
            inv.arg(&r.id)
                .arg(r.lane.as_str())
                .arg(r.strategy.map(Strategy::as_str).unwrap_or(""))
                .arg(match r.dedupe {
                    Dedupe::Skip => 0,
                    Dedupe::Check => 1,
                    Dedupe::Mark => 2,
                })
                .arg(if r.dedupe_only {
                    2
                } else if r.from_park {
                    1
                } else {
                    0
                })
                .arg(k);
        }
        // Two entries per task, answer then group (see `lua/reserve.lua`).
        let raw: Vec<String> = self.invoke(&inv).await?;
        Ok(raw
            .chunks(2)
            .map(|pair| match pair {
                [answer, group] => match answer.as_str() {
                    "reserved" => Reservation::Reserved(group.clone()),
                    "full" => Reservation::Full(group.clone()),
                    "dup" => Reservation::Duplicate,
                    "fresh" => Reservation::Fresh,
                    "none" => Reservation::NoMatch,
                    other => Reservation::Failed(format!("reserve script answered {other:?}")),
                },
                _ => Reservation::Failed("reserve script answered an odd number of entries".into()),
            })
            .collect())
    }

    /// Keeps a group's "has parked tasks" flag alive (the park loop calls this while it holds
    /// tasks), so new work keeps queueing behind parked work.
    pub async fn mark_parked(&self, group: &str, lane: Lane, ttl_ms: i64) -> Result<()> {
        self.query::<()>(redis::cmd("SET").arg(self.names.parked(group, lane)).arg(1).arg("PX").arg(ttl_ms)).await
    }

    /// Clears a group's "has parked tasks" flag (its park loop released everything).
    pub async fn clear_parked(&self, group: &str, lane: Lane) -> Result<()> {
        self.query::<()>(redis::cmd("DEL").arg(self.names.parked(group, lane))).await
    }

    /// Marks ingress submissions as handed on (their publishes are confirmed), just before
    /// their ingress messages are acked: a redelivery after a lost ack is then a duplicate.
    pub async fn mark_handed_on(&self, ids: &[&str]) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let mut p = redis::pipe();
        for id in ids {
            p.cmd("SET").arg(self.names.dedupe(id)).arg("a").arg("XX").arg("KEEPTTL").ignore();
        }
        self.pipe::<()>(&p).await
    }

    /// Gives back reservations whose publish failed.
    pub async fn unreserve(&self, items: &[(String, Lane, String)]) -> Result<()> {
        if items.is_empty() {
            return Ok(());
        }
        let mut p = redis::pipe();
        for (group, lane, id) in items {
            p.cmd("ZREM").arg(self.names.reserved(group, *lane)).arg(id).ignore();
        }
        self.pipe::<()>(&p).await
    }

    /// Claims task attempts for this worker process before it runs them (one `start` script
    /// call for the batch): exactly one run per attempt — see [`Claim`]. The bool is false when
    /// the worker's registration is gone (register again).
    ///
    /// # Errors
    /// Redis unreachable or slow ([`crate::store::CALL_TIMEOUT`]).
    pub async fn claim(&self, worker: &str, group: &str, instance: &str, run_lease: Duration, status_ttl: Duration, tasks: &[ClaimRequest]) -> Result<(bool, Vec<Claim>)> {
        let mut inv = self.scripts.start.prepare_invoke();
        inv.key(self.names.prefix())
            .arg(worker)
            .arg(group)
            .arg(instance)
            .arg(millis(run_lease))
            .arg(millis(status_ttl))
            .arg(tasks.len());
        for t in tasks {
            inv.arg(t.lane.as_str()).arg(&t.id).arg(t.base).arg(t.max_attempts).arg(if t.isolated { 1 } else { 0 });
        }
        // 'ok' | 'gone', then (word, attempt) per task.
        let raw: Vec<redis::Value> = self.invoke(&inv).await?;
        let registered = raw.first().is_some_and(|v| redis::from_redis_value_ref::<String>(v).is_ok_and(|s| s == "ok"));
        let mut claims = Vec::with_capacity(tasks.len());
        for pair in raw.get(1..).unwrap_or_default().chunks(2) {
            let answer = match pair {
                [w, n] => redis::from_redis_value_ref::<String>(w).ok().zip(redis::from_redis_value_ref::<u32>(n).ok()).and_then(|(w, n)| Claim::from_answer(&w, n)),
                _ => None,
            };
            match answer {
                Some(c) => claims.push(c),
                None => return Err(crate::Error::Other(format!("start answered {pair:?}, not a claim"))),
            }
        }
        if claims.len() != tasks.len() {
            return Err(crate::Error::Other(format!("start returned {} answers for {} tasks", claims.len(), tasks.len())));
        }
        Ok((registered, claims))
    }

    /// Releases attempts and records their outcomes (a [`Finished`] with an empty `state` only
    /// releases: the attempt ended without an outcome and went back to the broker).
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn finish(&self, worker: &str, group: &str, instance: &str, status_ttl: Duration, tasks: &[Finished]) -> Result<()> {
        let mut inv = self.scripts.finish.prepare_invoke();
        inv.key(self.names.prefix()).arg(worker).arg(group).arg(instance).arg(millis(status_ttl)).arg(tasks.len());
        for f in tasks {
            inv.arg(f.lane.as_str())
                .arg(&f.id)
                .arg(f.attempt)
                .arg(f.state.map(TaskState::as_str).unwrap_or(""))
                .arg(if f.success { "result" } else { "error" })
                .arg(truncate(&f.text, MAX_STATUS_TEXT))
                .arg(if f.success { 1 } else { 0 })
                .arg(f.reason.map(DeadReason::as_str).unwrap_or(""));
        }
        // Outcomes are what a failover must not lose (see `invoke_replicated`).
        let _: i64 = self.invoke_replicated(&inv).await?;
        Ok(())
    }
}
