//! The claim before a run: `start.lua` (beside this file) gives a worker process exactly one
//! run per attempt ([`Claim`]).

use std::time::Duration;

use deadpool_redis::redis;

use crate::error::Result;
use crate::redis::{millis, Store};
use crate::task::Lane;

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
    /// The task's fairness key: a granted run moves it from the key's reserved set to its
    /// running set.
    pub key: Option<String>,
}

/// The answer to a claim (see `run/start.lua`).
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

impl Store {
    /// Claims task attempts for this worker process before it runs them (one `start` script
    /// call for the batch): exactly one run per attempt — see [`Claim`]. The bool is false when
    /// the worker's registration is gone (register again).
    ///
    /// # Errors
    /// Redis unreachable or slow ([`crate::redis::CALL_TIMEOUT`]).
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
                .arg(if t.isolated { 1 } else { 0 })
                .arg(t.key.as_deref().unwrap_or(""));
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
                    return Err(crate::Error::BadAnswer {
                        from: "start.lua",
                        detail: format!("{pair:?}, not a claim"),
                    })
                }
            }
        }
        if claims.len() != tasks.len() {
            return Err(crate::Error::BadAnswer {
                from: "start.lua",
                detail: format!("{} answers for {} tasks", claims.len(), tasks.len()),
            });
        }
        Ok((registered, claims))
    }
}
