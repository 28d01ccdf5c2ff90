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

use deadpool_redis::redis;

use crate::envelope::Lane;
use crate::error::Result;
use crate::route::{Reservation, Strategy};
use crate::selector::Labels;
use crate::store::{now_ms, Store};

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
}

/// Parameters of routing common to a batch.
#[derive(Debug, Clone, Copy)]
pub struct ReserveParams {
    pub lease_ms: i64,
    pub backlog_factor: f64,
    pub strategy: Strategy,
    pub dedupe_window_ms: i64,
    pub status_ttl_ms: i64,
}

/// A finished task's outcome as recorded in its status.
#[derive(Debug, Clone)]
pub struct Finished {
    pub lane: Lane,
    pub id: String,
    /// The attempt that ended: a late write from an older attempt never overwrites the status
    /// of a newer one (ledger batches of different workers may land out of order).
    pub attempt: u32,
    /// `succeeded`, `retrying`, `dead` or `expired`.
    pub state: &'static str,
    /// The result (success) or the error text, truncated.
    pub text: String,
    pub success: bool,
    /// Why a task ended `dead` or `expired` (`max_attempts`, `permanent_error`, `expired`: the
    /// dead letter's `x-fleet-reason`), as the scheduler records for the states it decides;
    /// empty otherwise.
    pub reason: &'static str,
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
        let mut inv = self.scripts.reserve.prepare_invoke();
        inv.key(self.names.prefix())
            .arg(now_ms())
            .arg(p.lease_ms)
            .arg(p.backlog_factor)
            .arg(p.strategy.as_str())
            .arg(p.dedupe_window_ms)
            .arg(p.status_ttl_ms)
            .arg(reqs.len());
        for r in reqs {
            let pairs = r.selector.pairs();
            inv.arg(&r.id)
                .arg(r.lane.as_str())
                .arg(r.strategy.map(Strategy::as_str).unwrap_or(""))
                .arg(match r.dedupe {
                    Dedupe::Skip => 0,
                    Dedupe::Check => 1,
                    Dedupe::Mark => 2,
                })
                .arg(if r.from_park { 1 } else { 0 })
                .arg(rand::random::<f64>())
                .arg(pairs.len())
                .arg(pairs);
        }
        let raw: Vec<String> = self.invoke(&inv).await?;
        Ok(raw
            .into_iter()
            .map(|s| {
                if let Some(g) = s.strip_prefix("ok:") {
                    Reservation::Reserved(g.to_string())
                } else if let Some(g) = s.strip_prefix("full:") {
                    Reservation::Full(g.to_string())
                } else if s == "dup" {
                    Reservation::Duplicate
                } else {
                    Reservation::NoMatch
                }
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

    /// Marks tasks started on a worker. Returns false when the worker's registration is gone.
    pub async fn start(
        &self,
        worker: &str,
        group: &str,
        lease_ms: i64,
        status_ttl_ms: i64,
        tasks: &[(Lane, String, u32)],
    ) -> Result<bool> {
        let mut inv = self.scripts.start.prepare_invoke();
        inv.key(self.names.prefix()).arg(worker).arg(group).arg(now_ms()).arg(lease_ms).arg(status_ttl_ms).arg(tasks.len());
        for (lane, id, attempt) in tasks {
            inv.arg(lane.as_str()).arg(id).arg(*attempt);
        }
        let r: String = self.invoke(&inv).await?;
        Ok(r == "ok")
    }

    /// Releases finished tasks and records their outcomes.
    pub async fn finish(&self, worker: &str, group: &str, status_ttl_ms: i64, tasks: &[Finished]) -> Result<()> {
        let mut inv = self.scripts.finish.prepare_invoke();
        inv.key(self.names.prefix()).arg(worker).arg(group).arg(now_ms()).arg(status_ttl_ms).arg(tasks.len());
        for f in tasks {
            inv.arg(f.lane.as_str())
                .arg(&f.id)
                .arg(f.attempt)
                .arg(f.state)
                .arg(if f.success { "result" } else { "error" })
                .arg(truncate(&f.text, MAX_STATUS_TEXT))
                .arg(if f.success { 1 } else { 0 })
                .arg(f.reason);
        }
        let _: i64 = self.invoke(&inv).await?;
        Ok(())
    }
}
