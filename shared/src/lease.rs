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
use crate::status::{DeadReason, TaskState};
use crate::store::Store;

/// A finished task's outcome as recorded in its status.
#[derive(Debug, Clone)]
pub struct Finished {
    /// The lane it ran in (its run record is released there).
    pub lane: Lane,
    /// The task id.
    pub id: String,
    /// The attempt that ended: a late write from an older attempt never overwrites the status
    /// of a newer one (ledger batches of different workers may land out of order).
    pub attempt: u32,
    /// `Succeeded`, `Retrying`, `Dead` or `Expired`; `None` for a release (no outcome);
    /// `Queued` for a spent attempt ([`Finished::spent`]).
    pub state: Option<TaskState>,
    /// The result (success) or the error text, truncated.
    pub text: String,
    /// Whether `text` is the result (stored as `result`) rather than the error (`error`).
    pub success: bool,
    /// Why a task ended `dead` or `expired` (`max_attempts`, `permanent_error`, `expired`: the
    /// dead letter's `x-fleet-reason`), as the scheduler records for the states it decides;
    /// `None` otherwise.
    pub reason: Option<DeadReason>,
}

impl Finished {
    /// An attempt whose handler ran to its end but whose outcome the broker did not confirm
    /// (its retry or dead-letter copy unconfirmed: the channel died mid-publish, or a nack):
    /// its delivery went back to the broker, and the attempt counts as used — the next copy
    /// runs as attempt `attempt + 1` (or is dead-lettered, `max_attempts`, past the last),
    /// never as this attempt again (issue 37 item 1: two runs of one attempt number).
    pub fn spent(lane: Lane, id: String, attempt: u32) -> Self {
        Finished {
            state: Some(TaskState::Queued),
            ..Finished::release(lane, id, attempt)
        }
    }

    /// The attempt an operator's cancel stopped (state `cancelled`: never retried, never
    /// dead-lettered), with who cancelled it and why — carried in `text` as `by`, a newline,
    /// then `reason` (a newline in `by` is replaced by a space); [`crate::Store::finish`] splits it.
    pub fn cancelled(lane: Lane, id: String, attempt: u32, by: &str, reason: &str) -> Self {
        Finished {
            state: Some(TaskState::Cancelled),
            text: format!("{}\n{reason}", by.replace('\n', " ")),
            ..Finished::release(lane, id, attempt)
        }
    }

    /// An attempt that ended without an outcome (hard stop): its delivery went back to the
    /// broker and the next copy runs the same attempt again.
    pub fn release(lane: Lane, id: String, attempt: u32) -> Self {
        Finished {
            lane,
            id,
            attempt,
            state: None,
            text: String::new(),
            success: false,
            reason: None,
        }
    }
}

/// One attempt a worker asks to run.
#[derive(Debug, Clone)]
pub struct ClaimRequest {
    /// The lane of the delivery.
    pub lane: Lane,
    /// The task id.
    pub id: String,
    /// The envelope's `attempt` + 1: the same for every copy of one delivery.
    pub base: u32,
    /// The task's attempts in all ([`crate::Envelope::max_attempts_or`]).
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
    /// Its last attempt ran, but the broker never confirmed that attempt's outcome (a retry or
    /// dead-letter copy published as its channel died, or nacked): dead-letter it
    /// (`max_attempts`) with this attempt count, without running it again.
    Spent(u32),
    /// An operator cancelled the task: ack it without running (its reservation was released
    /// by the claim); never retried, never dead-lettered.
    Cancelled,
}

impl Claim {
    /// One answer of `start.lua`: its word and attempt number. `None` for a word the script
    /// never says (a script and binary out of step: the claim fails as a whole).
    fn from_answer(word: &str, attempt: u32) -> Option<Claim> {
        Some(match word {
            "run" => Claim::Run(attempt),
            "iso" => Claim::Isolate(attempt),
            "dlq" => Claim::Dead(attempt),
            "spent" => Claim::Spent(attempt),
            "wait" => Claim::Wait,
            "dup" => Claim::Duplicate,
            "cancelled" => Claim::Cancelled,
            _ => return None,
        })
    }
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Longest result or error text kept in a status record.
pub const MAX_STATUS_TEXT: usize = 4096;

/// `s` cut to at most `max` bytes on a character boundary, with `…` appended when cut.
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
    /// Claims task attempts for this worker process before it runs them (one `start` script
    /// call for the batch): exactly one run per attempt — see [`Claim`]. The bool is false when
    /// the worker's registration is gone (register again).
    ///
    /// # Errors
    /// Redis unreachable or slow ([`crate::store::CALL_TIMEOUT`]).
    pub async fn claim(
        &self,
        worker: &str,
        group: &str,
        instance: &str,
        run_lease: Duration,
        status_ttl: Duration,
        tasks: &[ClaimRequest],
    ) -> Result<(bool, Vec<Claim>)> {
        let mut inv = self.scripts.start.prepare_invoke();
        inv.key(self.names.prefix())
            .arg(worker)
            .arg(group)
            .arg(instance)
            .arg(millis(run_lease))
            .arg(millis(status_ttl))
            .arg(tasks.len());
        for t in tasks {
            inv.arg(t.lane.as_str())
                .arg(&t.id)
                .arg(t.base)
                .arg(t.max_attempts)
                .arg(if t.isolated { 1 } else { 0 });
        }
        // 'ok' | 'gone', then (word, attempt) per task.
        let raw: Vec<redis::Value> = self.invoke(&inv).await?;
        let registered = raw
            .first()
            .is_some_and(|v| redis::from_redis_value_ref::<String>(v).is_ok_and(|s| s == "ok"));
        let mut claims = Vec::with_capacity(tasks.len());
        for pair in raw.get(1..).unwrap_or_default().chunks(2) {
            let answer = match pair {
                [w, n] => redis::from_redis_value_ref::<String>(w)
                    .ok()
                    .zip(redis::from_redis_value_ref::<u32>(n).ok())
                    .and_then(|(w, n)| Claim::from_answer(&w, n)),
                _ => None,
            };
            match answer {
                Some(c) => claims.push(c),
                None => {
                    return Err(crate::Error::Other(format!(
                        "start answered {pair:?}, not a claim"
                    )))
                }
            }
        }
        if claims.len() != tasks.len() {
            return Err(crate::Error::Other(format!(
                "start returned {} answers for {} tasks",
                claims.len(),
                tasks.len()
            )));
        }
        Ok((registered, claims))
    }

    /// Releases attempts and records their outcomes (a [`Finished`] with an empty `state` only
    /// releases: the attempt ended without an outcome and went back to the broker), and
    /// publishes the worker's task `figures` (pairs outcome, total; may be empty) in the same
    /// call, so `GET /v1/workers` is current without a round trip of its own.
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn finish(
        &self,
        worker: &str,
        group: &str,
        instance: &str,
        status_ttl: Duration,
        tasks: &[Finished],
        figures: &[(&str, u64)],
    ) -> Result<()> {
        let mut inv = self.scripts.finish.prepare_invoke();
        inv.key(self.names.prefix())
            .arg(worker)
            .arg(group)
            .arg(instance)
            .arg(millis(status_ttl))
            .arg(tasks.len());
        for f in tasks {
            // A cancelled attempt's `field` names who cancelled it (see Finished::cancelled).
            let (field, text) = match (f.state, f.text.split_once('\n')) {
                (Some(TaskState::Cancelled), Some((by, why))) => (by, why),
                _ => (if f.success { "result" } else { "error" }, f.text.as_str()),
            };
            inv.arg(f.lane.as_str())
                .arg(&f.id)
                .arg(f.attempt)
                .arg(f.state.map(TaskState::as_str).unwrap_or(""))
                .arg(field)
                .arg(truncate(text, MAX_STATUS_TEXT))
                .arg(if f.success { 1 } else { 0 })
                .arg(f.reason.map(DeadReason::as_str).unwrap_or(""));
        }
        for (outcome, n) in figures {
            inv.arg(*outcome).arg(*n);
        }
        // Outcomes are what a failover must not lose (see `invoke_replicated`).
        let _: i64 = self.invoke_replicated(&inv).await?;
        Ok(())
    }
}
