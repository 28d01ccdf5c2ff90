//! The Rust writers of status records, one function per transition decided outside the
//! scripts (the scripts' writers are the `status_*` functions of `names/keys.lua`). Nothing else
//! in Rust writes a task's `state`.
//!
//! The scheduler decides a batch's fates together, so its transitions are collected in a
//! [`Writes`] and written in one round trip ([`Store::write_statuses`]).

use std::time::Duration;

use chrono::{DateTime, Utc};

use super::{DeadReason, TaskState};
use crate::error::Result;
use crate::redis::{millis, Store};
use crate::task::Lane;

/// Status transitions of a batch, written together by [`Store::write_statuses`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Writes {
    records: Vec<(String, Vec<(&'static str, String)>)>,
}

impl Writes {
    /// No transitions yet.
    pub fn new() -> Self {
        Writes::default()
    }

    /// No transition collected.
    pub fn is_empty(&self) -> bool {
        self.records.is_empty()
    }

    /// Collected transitions: (task id, fields in the order written).
    pub fn records(&self) -> &[(String, Vec<(&'static str, String)>)] {
        &self.records
    }

    /// → [`TaskState::Dead`] (or [`TaskState::Expired`] for [`DeadReason::Expired`]): the
    /// scheduler dead-lettered the task itself (refused, expired before dispatch, no matching
    /// worker), with `reason` and `detail` (the dead letter's `x-fleet-reason` and detail).
    pub fn ended(&mut self, id: &str, lane: Lane, reason: DeadReason, detail: &str) {
        let state = if reason == DeadReason::Expired {
            TaskState::Expired
        } else {
            TaskState::Dead
        };
        self.push(
            id,
            state,
            vec![
                ("reason", reason.to_string()),
                ("error", detail.to_string()),
                ("lane", lane.to_string()),
            ],
        );
    }

    /// → [`TaskState::Waiting`]: a batch member held until the members `after` (ids) succeed
    /// (stored as a JSON array), in batch `batch`.
    pub fn waiting(&mut self, id: &str, lane: Lane, after: &[String], batch: &str) {
        let after = serde_json::to_string(after).unwrap_or_default();
        self.push(
            id,
            TaskState::Waiting,
            vec![
                ("after", after),
                ("batch", batch.to_string()),
                ("lane", lane.to_string()),
            ],
        );
    }

    /// → [`TaskState::WaitingForWorker`]: no live group matches the task yet.
    pub fn waiting_for_worker(&mut self, id: &str, lane: Lane) {
        self.push(
            id,
            TaskState::WaitingForWorker,
            vec![("lane", lane.to_string())],
        );
    }

    /// → [`TaskState::Parked`] behind `group`: held for a paused kind, in that kind's hold
    /// queue (`group` is its pseudo-group, `_kind.<kind>`: the scheduler's `pause` module).
    pub fn held(&mut self, id: &str, lane: Lane, group: &str) {
        self.push(
            id,
            TaskState::Parked,
            vec![("group", group.to_string()), ("lane", lane.to_string())],
        );
    }

    /// → [`TaskState::Delayed`]: waits in a delay tier for `not_before` (stored as RFC 3339;
    /// empty when unknown).
    pub fn delayed(&mut self, id: &str, lane: Lane, not_before: Option<DateTime<Utc>>) {
        let at = not_before.map(|t| t.to_rfc3339()).unwrap_or_default();
        self.push(
            id,
            TaskState::Delayed,
            vec![("not_before", at), ("lane", lane.to_string())],
        );
    }

    /// Adds what the task is (`kind`, `selector` as `k=v,k2=v2`, `submitted_at` as Unix ms) to
    /// the transition collected last for `id` (written in the same HSET); nothing when the
    /// last one is another task's.
    pub fn describe(
        &mut self,
        id: &str,
        kind: &str,
        selector: &str,
        submitted_at: Option<DateTime<Utc>>,
    ) {
        if let Some((last, fields)) = self.records.last_mut() {
            if last == id {
                fields.push(("kind", kind.to_string()));
                fields.push(("selector", selector.to_string()));
                if let Some(t) = submitted_at {
                    fields.push(("submitted_at", t.timestamp_millis().to_string()));
                }
            }
        }
    }

    fn push(&mut self, id: &str, state: TaskState, mut fields: Vec<(&'static str, String)>) {
        fields.insert(0, ("state", state.to_string()));
        self.records.push((id.to_string(), fields));
    }
}

impl Store {
    /// Writes a batch's status transitions ([`Writes`]) in one round trip (`status/decided.lua`,
    /// through keys.lua's `status_decided`); each record then lives `ttl` (the status TTL). A
    /// record whose state is final (succeeded, dead, expired, cancelled) is left as it is —
    /// a cancelled task whose deadline passes while it waits stays cancelled, a delayed
    /// submission handled again after a scheduler crash does not revive a cancel — and so is
    /// a [`Writes::waiting`] over any other state than `waiting` (a batch's close read again
    /// never puts a member released since back to waiting); each is returned as
    /// `(id, its state)`. A record created here indexes its run (the task list,
    /// [`crate::status::index`]) under its `submitted_at`.
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn write_statuses(
        &self,
        writes: &Writes,
        ttl: Duration,
    ) -> Result<Vec<(String, String)>> {
        if writes.is_empty() {
            return Ok(Vec::new());
        }
        let mut inv = self.scripts.decided.prepare_invoke();
        inv.key(self.names.prefix())
            .arg(millis(ttl))
            .arg(writes.records.len());
        for (id, fields) in &writes.records {
            let score = fields
                .iter()
                .find(|(k, _)| *k == "submitted_at")
                .map(|(_, v)| v.as_str())
                .unwrap_or("");
            inv.arg(id).arg(score).arg(fields.len());
            for (k, v) in fields {
                inv.arg(*k).arg(v);
            }
        }
        let flat: Vec<String> = self.invoke(&inv).await?;
        Ok(flat
            .chunks_exact(2)
            .map(|p| (p[0].clone(), p[1].clone()))
            .collect())
    }

    /// → [`TaskState::Dead`]: the broker dead-lettered task `id` itself (see
    /// `status/broker_dead.lua`): releases its reservation and running records in `group` (`None`:
    /// the group its status names) and `lane`, and sets it dead with `reason` (the broker's
    /// word, e.g. [`DeadReason::DeliveryLimit`]; kept as given, the broker's set is open) and
    /// `error` — unless its attempt had already ended with a final state. Returns true when
    /// the status was written, false when it was already final (the broker's copy was a stale
    /// duplicate).
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn record_broker_dead(
        &self,
        id: &str,
        group: Option<&str>,
        lane: Lane,
        reason: &str,
        error: &str,
        ttl: Duration,
    ) -> Result<bool> {
        let mut inv = self.scripts.broker_dead.prepare_invoke();
        inv.key(self.names.prefix())
            .arg(id)
            .arg(group.unwrap_or(""))
            .arg(lane.as_str())
            .arg(reason)
            .arg(truncate(error, MAX_STATUS_TEXT))
            .arg(millis(ttl));
        let answer: String = self.invoke(&inv).await?;
        Ok(answer == TaskState::Dead.as_str())
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scheduler_transitions_write_their_state_first() {
        let mut w = Writes::new();
        w.ended("a", Lane::Normal, DeadReason::NoMatchingWorker, "none");
        w.ended("b", Lane::Critical, DeadReason::Expired, "late");
        w.waiting_for_worker("c", Lane::Normal);
        w.delayed("d", Lane::Normal, None);
        let states: Vec<(&str, &str)> = w
            .records()
            .iter()
            .map(|(id, f)| (id.as_str(), f[0].1.as_str()))
            .collect();
        assert_eq!(
            states,
            [
                ("a", "dead"),
                ("b", "expired"),
                ("c", "waiting_for_worker"),
                ("d", "delayed")
            ]
        );
        assert_eq!(
            w.records()[0].1[1],
            ("reason", "no_matching_worker".to_string())
        );
        assert!(w.records().iter().all(|(_, f)| f[0].0 == "state"));
    }
}
