//! The outcome after a run: `finish.lua` (beside this file) records it in the task's status, or
//! releases an attempt that ended without one ([`Finished`]).

use std::time::Duration;

use crate::error::Result;
use crate::redis::{millis, Store};
use crate::status::{truncate, DeadReason, TaskState, MAX_STATUS_TEXT};
use crate::task::Lane;

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

impl Store {
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

#[cfg(test)]
mod tests {
    use deadpool_redis::redis;

    use super::*;
    use crate::names::Names;

    /// The real Redis (127.0.0.1:6379), keys under a random namespace, deleted at the end.
    async fn store() -> Store {
        let ns = format!("finish-test-{}", uuid::Uuid::new_v4().simple());
        Store::new("redis://127.0.0.1:6379", Names::new(&ns)).unwrap()
    }

    async fn set(store: &Store, id: &str, state: &str) {
        let t = store.names.task(id);
        store
            .query::<()>(
                redis::cmd("HSET")
                    .arg(&t)
                    .arg("state")
                    .arg(state)
                    .arg("attempt")
                    .arg(1),
            )
            .await
            .unwrap();
    }

    async fn state(store: &Store, id: &str) -> Option<String> {
        store
            .query(redis::cmd("HGET").arg(store.names.task(id)).arg("state"))
            .await
            .unwrap()
    }

    async fn clean(store: &Store) {
        store.delete_namespace().await.unwrap();
    }

    /// A late `retrying` of attempt 1 (a ledger batch that landed after the retry copy was
    /// dispatched) leaves the copy's `queued`; over this attempt's `running` it is written.
    /// Before: `retrying` over `queued` (review of the cancel change, finding 2).
    #[tokio::test]
    async fn a_late_retrying_never_overwrites_the_retry_copys_state() {
        let store = store().await;
        let retrying = |id: &str| Finished {
            lane: Lane::Normal,
            id: id.into(),
            attempt: 1,
            state: Some(TaskState::Retrying),
            text: "boom".into(),
            success: false,
            reason: None,
        };
        set(&store, "copied", "queued").await;
        set(&store, "running", "running").await;
        let ttl = Duration::from_secs(60);
        store
            .finish(
                "w",
                "g",
                "i",
                ttl,
                &[retrying("copied"), retrying("running")],
                &[],
            )
            .await
            .unwrap();
        assert_eq!(state(&store, "copied").await.as_deref(), Some("queued"));
        assert_eq!(state(&store, "running").await.as_deref(), Some("retrying"));
        // The broker's own dead-lettering leaves a cancelled task cancelled (finding 6).
        set(&store, "cancelled", "cancelled").await;
        let dead = store
            .record_broker_dead(
                "cancelled",
                Some("g"),
                Lane::Normal,
                "delivery_limit",
                "x",
                ttl,
            )
            .await
            .unwrap();
        assert!(!dead);
        assert_eq!(
            state(&store, "cancelled").await.as_deref(),
            Some("cancelled")
        );
        clean(&store).await;
    }
}
