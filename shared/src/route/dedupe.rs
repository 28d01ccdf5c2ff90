//! Dedupe: a task id is dispatched once within the dedupe window (`FLEET_DEDUPE_WINDOW`), even
//! when a producer publishes it twice or the broker redelivers a submission whose ack was lost.
//!
//! The protocol is one mark per id, a field of its status record (`dd`, lapsing at `ddx`, Redis
//! ms: the record, [`crate::Names::task`], lives at least that long), written in the same
//! script call that routes the task (`route/reserve.lua`, so the check and the reservation are
//! atomic — and in the same `HSET` as its first status: the mark costs no command of its own)
//! and then advanced by the scheduler:
//!
//! * `p:<token>` — being handled by the batch with this token (set if absent; a retry of the same
//!   batch recognises its own marks and never takes them for duplicates);
//! * handed on: every publish the submission became is confirmed by the broker
//!   ([`Store::mark_handed_on`], just before the ingress message is acked) — said for a whole
//!   batch by one flag `ho:<token>` ([`crate::Names::handed_on`]) when every submission of the
//!   batch was handed on, else by the mark becoming `a`, id by id.
//!
//! A fresh submission ([`Dedupe::Check`]) is a duplicate when any mark of another batch exists.
//! A redelivered one ([`Dedupe::Mark`]) is a duplicate only once handed on — or when a worker
//! has already claimed it under another batch's mark (a scheduler that crashed after
//! publishing): otherwise it is dispatched again, and the worker's run record (`start.lua`)
//! makes sure the attempt runs once.

use deadpool_redis::redis;

use crate::error::Result;
use crate::redis::Store;

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

impl Store {
    /// Marks ingress submissions as handed on (their publishes are confirmed), just before
    /// their ingress messages are acked: a redelivery after a lost ack is then a duplicate.
    /// `batch`: the token of a batch every submission of which is handed on — one flag
    /// (`ho:<token>`, the dedupe window as TTL) says it for all their `p:<token>` marks, one
    /// command per batch; `ids`: submissions handed on one by one (their marks become `a`).
    ///
    /// # Errors
    /// Redis unreachable or refusing the writes.
    pub async fn mark_handed_on(
        &self,
        batch: Option<u64>,
        ids: &[&str],
        window_ms: u64,
    ) -> Result<()> {
        if ids.is_empty() && batch.is_none() {
            return Ok(());
        }
        // MULTI/EXEC: a mark's HSET never lands without its PEXPIRE (a record Redis lost would
        // otherwise stay, mark only, with no TTL).
        let mut p = redis::pipe();
        p.atomic();
        if let Some(token) = batch {
            p.cmd("SET")
                .arg(self.names.handed_on(&token.to_string()))
                .arg("1")
                .arg("PX")
                .arg(window_ms.max(1))
                .ignore();
        }
        for id in ids {
            // The mark is a field of the status record; a record Redis lost meanwhile is not
            // brought back without a TTL (NX: only a key that has none gets the window).
            let t = self.names.task(id);
            p.cmd("HSET").arg(&t).arg("dd").arg("a").ignore();
            p.cmd("PEXPIRE")
                .arg(&t)
                .arg(window_ms.max(1))
                .arg("NX")
                .ignore();
        }
        self.pipe::<()>(&p).await
    }
}
