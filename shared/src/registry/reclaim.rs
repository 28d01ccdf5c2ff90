//! Reclaim of departed groups (`reclaim.lua`): a group with no worker and no running,
//! reserved or parked record for a grace loses its keys, atomically against a worker
//! registering; the scheduler deletes its queues between the claim and `done`.

use std::time::Duration;

use crate::error::Result;
use crate::redis::{millis, Store};

/// What the claim step of the reclaim script answered for a group (see `registry/reclaim.lua`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReclaimClaim {
    /// Its keys are gone and its tombstone says `pending`: delete its queues, then call
    /// [`Store::reclaim_done`] (or [`Store::reclaim_restore`] when a queue holds a task).
    Reclaimed {
        /// The group's labels as JSON, for a restore.
        labels: String,
    },
    /// Empty, but not for the whole grace yet: this much of it is left.
    Wait(Duration),
    /// Not departed: a worker, or running, reserved or parked work (the reason).
    Busy(String),
    /// Not a group (any more): reclaimed by another replica, or never registered.
    Absent,
}

impl Store {
    /// Claims a departed group for reclaim, atomically against a worker registering: its keys
    /// go only when it has had no worker and no running, reserved or parked record for
    /// `grace` (Redis time). `hold`: life of the tombstone that keeps workers of the group
    /// from registering until its queues are deleted.
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn reclaim_claim(
        &self,
        group: &str,
        grace: Duration,
        hold: Duration,
    ) -> Result<ReclaimClaim> {
        let (step, detail) = self
            .reclaim_step("claim", group, &millis(grace).to_string(), hold)
            .await?;
        Ok(match step.as_str() {
            "reclaimed" => ReclaimClaim::Reclaimed { labels: detail },
            "wait" => ReclaimClaim::Wait(
                detail
                    .parse::<u64>()
                    .map(Duration::from_millis)
                    .unwrap_or(grace),
            ),
            "absent" => ReclaimClaim::Absent,
            _ => ReclaimClaim::Busy(detail),
        })
    }

    /// Ends a reclaim whose queues are deleted: the tombstone becomes the deletion's time and
    /// lives `hold` (a worker that declared its queues before it declares them again).
    ///
    /// # Errors
    /// Redis unreachable or slow (the `pending` tombstone then expires after its life).
    pub async fn reclaim_done(&self, group: &str, hold: Duration) -> Result<()> {
        self.reclaim_step("done", group, "", hold).await.map(|_| ())
    }

    /// Undoes a claim whose group turned out to hold work (a queue was not empty): the group
    /// is back with its labels (JSON, as the claim returned them), its grace starting again.
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn reclaim_restore(&self, group: &str, labels: &str, hold: Duration) -> Result<()> {
        self.reclaim_step("restore", group, labels, hold)
            .await
            .map(|_| ())
    }

    /// [`Store::reclaim_restore`] for a group whose queues the scheduler could not declare
    /// again (some may be unbound or deleted): the group is back, and its tombstone becomes
    /// the time of now for `hold`, so a worker of the group declares — and binds — its queues
    /// again before it registers.
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn reclaim_restore_undeclared(
        &self,
        group: &str,
        labels: &str,
        hold: Duration,
    ) -> Result<()> {
        self.reclaim_step("restore_undeclared", group, labels, hold)
            .await
            .map(|_| ())
    }

    async fn reclaim_step(
        &self,
        step: &str,
        group: &str,
        arg: &str,
        hold: Duration,
    ) -> Result<(String, String)> {
        let mut inv = self.scripts.reclaim.prepare_invoke();
        inv.key(self.names.prefix())
            .arg(step)
            .arg(group)
            .arg(arg)
            .arg(millis(hold).max(1));
        let r: Vec<String> = self.invoke(&inv).await?;
        let mut it = r.into_iter();
        Ok((it.next().unwrap_or_default(), it.next().unwrap_or_default()))
    }
}
