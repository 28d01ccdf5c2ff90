//! Pauses in the control stream: what an operator paused ([`Target`]) and the fold of the
//! stream's pause and resume records into the set in force ([`PauseSet`]).
//!
//! # The fold
//!
//! Records are applied in stream order; for each target the last record wins — a pause
//! after a pause keeps the first one's `since_ms`, `by` and `reason` (the target was paused
//! all along; a renewal, below, is such a record), a resume removes it. Resuming a group
//! resumes its lanes too (the whole group runs again); resuming one lane leaves a pause of
//! its whole group in force.
//!
//! # What a pause stops
//!
//! * a **group** ([`Target::Group`]): both lanes of the group take no new work
//!   ([`PauseSet::lane_paused`]);
//! * a **lane** of a group ([`Target::Lane`]): that lane only;
//! * a **kind** ([`Target::Kind`]): no task of the kind is dispatched to any group
//!   ([`PauseSet::kind_paused`]);
//! * a **batch** ([`Target::Batch`], [`crate::batch`]): no member of the batch is dispatched
//!   to any group, none of its waiting members is released and its callbacks wait
//!   ([`PauseSet::batch_paused`]).
//!
//! A kind's and a batch's tasks wait in a hold queue of their own (the scheduler's
//! `pause::hold_group`): [`PauseSet::held`] names the hold a task goes to, and
//! [`PauseSet::holds`] every hold a record named (their queues are drained after a resume).
//!
//! # Retention
//!
//! The stream keeps a record for [`super::MAX_AGE`] (7 days). A pause must not expire with its
//! record: the scheduler appends its record again ([`PauseSet::due_for_renewal`]) once it is
//! older than [`RENEW_AFTER`] (half the retention), keeping the first record's `since_ms`,
//! `by` and `reason`. Resumed targets are remembered only while their record is in the stream.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::{Op, Record, MAX_TEXT};
use crate::task::Lane;

/// Age after which the record of a pause in force is appended again (half the stream's
/// retention, so a renewal that fails is tried for days before the record could age out).
pub const RENEW_AFTER: Duration = Duration::from_secs(super::MAX_AGE.as_secs() / 2);

/// What is paused. On the wire (inside a record's `target`):
/// `{"scope": "group", "group": G}`, `{"scope": "lane", "group": G, "lane": "normal"}`,
/// `{"scope": "kind", "kind": K}`, `{"scope": "key", "key": K}`, `{"scope": "batch", "batch": B}`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(tag = "scope", rename_all = "snake_case")]
pub enum Target {
    /// Both lanes of a group (its name: its label set, as `GET /v1/groups` shows it).
    Group {
        /// The group name.
        group: String,
    },
    /// One lane of a group.
    Lane {
        /// The group name.
        group: String,
        /// The lane.
        lane: Lane,
    },
    /// A task kind, on every group.
    Kind {
        /// The kind.
        kind: String,
    },
    /// A fairness key (tenant), on every group: its tasks wait as if over their limit.
    Key {
        /// The key.
        key: String,
    },
    /// A batch ([`crate::batch`]): its members wait in its hold queue, its waiting members
    /// are not released, its callbacks wait.
    Batch {
        /// The batch id.
        batch: String,
    },
}

impl Target {
    /// The target with its names cut at [`MAX_TEXT`] bytes.
    pub fn bounded(self) -> Target {
        let cut = |s: String| crate::status::truncate(&s, MAX_TEXT);
        match self {
            Target::Group { group } => Target::Group { group: cut(group) },
            Target::Lane { group, lane } => Target::Lane {
                group: cut(group),
                lane,
            },
            Target::Kind { kind } => Target::Kind { kind: cut(kind) },
            Target::Key { key } => Target::Key { key: cut(key) },
            Target::Batch { batch } => Target::Batch { batch: cut(batch) },
        }
    }

    /// Whether the target's tasks wait in a hold queue of their own when paused (a kind, a
    /// batch) rather than behind their group or key.
    pub fn holds(&self) -> bool {
        matches!(self, Target::Kind { .. } | Target::Batch { .. })
    }

    /// The scope's word: `group`, `lane`, `kind`, `key` or `batch`.
    pub fn scope(&self) -> &'static str {
        match self {
            Target::Group { .. } => "group",
            Target::Lane { .. } => "lane",
            Target::Kind { .. } => "kind",
            Target::Key { .. } => "key",
            Target::Batch { .. } => "batch",
        }
    }
}

/// A pause in force.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Pause {
    /// What is paused.
    pub target: Target,
    /// When it was first paused (Unix ms, the fleet's clock).
    pub since_ms: i64,
    /// When its latest record was accepted (Unix ms): a renewal moves it, not `since_ms`.
    pub record_ms: i64,
    /// Who paused it.
    pub by: String,
    /// Why (may be empty).
    pub reason: String,
}

impl Record {
    /// A pause of `target` by `by` for `reason` (cut at [`MAX_TEXT`] bytes) at `at_ms`,
    /// paused since `at_ms`.
    pub fn pause(target: Target, reason: &str, by: &str, at_ms: i64) -> Self {
        Record {
            id: uuid::Uuid::new_v4().simple().to_string(),
            at_ms,
            op: Op::Pause {
                target: target.bounded(),
                reason: crate::status::truncate(reason, MAX_TEXT),
                by: crate::status::truncate(by, MAX_TEXT),
                since_ms: None,
            },
        }
    }

    /// The record of `p` appended again at `at_ms` (its renewal: same target, `since_ms`,
    /// `by` and `reason`).
    pub fn renewal(p: &Pause, at_ms: i64) -> Self {
        Record {
            id: uuid::Uuid::new_v4().simple().to_string(),
            at_ms,
            op: Op::Pause {
                target: p.target.clone(),
                reason: p.reason.clone(),
                by: p.by.clone(),
                since_ms: Some(p.since_ms),
            },
        }
    }

    /// A resume of `target` by `by` at `at_ms`.
    pub fn resume(target: Target, by: &str, at_ms: i64) -> Self {
        Record {
            id: uuid::Uuid::new_v4().simple().to_string(),
            at_ms,
            op: Op::Resume {
                target: target.bounded(),
                by: crate::status::truncate(by, MAX_TEXT),
            },
        }
    }
}

/// The pauses in force, folded from the control stream's records in order ([`PauseSet::apply`]).
/// A plain value: the scheduler keeps one behind a lock and swaps in a fresh one rebuilt from
/// the first record after each reconnect.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PauseSet {
    paused: BTreeMap<Target, Pause>,
    /// Every kind and batch named by a pause or resume record read: the holds whose queues
    /// may hold tasks (drained after a resume).
    holds: BTreeSet<Target>,
}

impl PauseSet {
    /// Applies `rec` (records other than pause and resume change nothing); `true` when the set
    /// in force changed.
    pub fn apply(&mut self, rec: &Record) -> bool {
        match &rec.op {
            Op::Pause {
                target,
                reason,
                by,
                since_ms,
            } => {
                if target.holds() {
                    self.holds.insert(target.clone());
                }
                match self.paused.get_mut(target) {
                    // Paused already: the first record's who, why and since stand; a renewal
                    // moves its record time.
                    Some(p) => {
                        p.record_ms = p.record_ms.max(rec.at_ms);
                        false
                    }
                    None => {
                        self.paused.insert(
                            target.clone(),
                            Pause {
                                target: target.clone(),
                                since_ms: since_ms.unwrap_or(rec.at_ms),
                                record_ms: rec.at_ms,
                                by: by.clone(),
                                reason: reason.clone(),
                            },
                        );
                        true
                    }
                }
            }
            Op::Resume { target, .. } => {
                if target.holds() {
                    self.holds.insert(target.clone());
                }
                let mut changed = self.paused.remove(target).is_some();
                if let Target::Group { group } = target {
                    let before = self.paused.len();
                    self.paused
                        .retain(|t, _| !matches!(t, Target::Lane { group: g, .. } if g == group));
                    changed |= self.paused.len() != before;
                }
                changed
            }
            _ => false,
        }
    }

    /// Whether nothing is paused.
    pub fn is_empty(&self) -> bool {
        self.paused.is_empty()
    }

    /// The pause of exactly `target`, if in force.
    pub fn get(&self, target: &Target) -> Option<&Pause> {
        self.paused.get(target)
    }

    /// Whether `group`'s `lane` takes no new work: its group or that lane is paused.
    pub fn lane_paused(&self, group: &str, lane: Lane) -> bool {
        if self.paused.is_empty() {
            return false;
        }
        self.paused.contains_key(&Target::Group {
            group: group.to_string(),
        }) || self.paused.contains_key(&Target::Lane {
            group: group.to_string(),
            lane,
        })
    }

    /// The lanes of `group` that take no new work, normal first.
    pub fn paused_lanes(&self, group: &str) -> Vec<Lane> {
        Lane::ALL
            .into_iter()
            .filter(|l| self.lane_paused(group, *l))
            .collect()
    }

    /// Whether tasks of `kind` are held (dispatched nowhere).
    pub fn kind_paused(&self, kind: &str) -> bool {
        !self.paused.is_empty()
            && self.paused.contains_key(&Target::Kind {
                kind: kind.to_string(),
            })
    }

    /// Whether batch `batch` is paused.
    pub fn batch_paused(&self, batch: &str) -> bool {
        !self.paused.is_empty()
            && self.paused.contains_key(&Target::Batch {
                batch: batch.to_string(),
            })
    }

    /// The hold a task of `kind` in `batch` (if any) waits in now: its kind's when the kind
    /// is paused, else its batch's when the batch is; `None` when neither is.
    pub fn held(&self, kind: &str, batch: Option<&str>) -> Option<Target> {
        if self.paused.is_empty() {
            return None;
        }
        if self.kind_paused(kind) {
            return Some(Target::Kind {
                kind: kind.to_string(),
            });
        }
        batch
            .filter(|b| self.batch_paused(b))
            .map(|b| Target::Batch {
                batch: b.to_string(),
            })
    }

    /// Whether fairness key `key` is paused.
    pub fn key_paused(&self, key: &str) -> bool {
        !self.paused.is_empty()
            && self.paused.contains_key(&Target::Key {
                key: key.to_string(),
            })
    }

    /// Every paused (group, lane), a group's pause as both its lanes: what the reservation
    /// script is told, in order.
    pub fn group_lanes(&self) -> Vec<(String, Lane)> {
        let mut out: BTreeSet<(String, Lane)> = BTreeSet::new();
        for t in self.paused.keys() {
            match t {
                Target::Group { group } => {
                    for l in Lane::ALL {
                        out.insert((group.clone(), l));
                    }
                }
                Target::Lane { group, lane } => {
                    out.insert((group.clone(), *lane));
                }
                Target::Kind { .. } | Target::Key { .. } | Target::Batch { .. } => {}
            }
        }
        out.into_iter().collect()
    }

    /// Every hold (kind or batch) a pause or resume record named, paused now or not: the
    /// holds whose queues a scheduler drains.
    pub fn holds(&self) -> impl Iterator<Item = &Target> {
        self.holds.iter()
    }

    /// Every pause in force, by target.
    pub fn all(&self) -> impl Iterator<Item = &Pause> {
        self.paused.values()
    }

    /// Pauses in force whose latest record is older than `after` at `now_ms` (Unix ms): their
    /// record is to be appended again before the stream's retention drops it.
    pub fn due_for_renewal(&self, now_ms: i64, after: Duration) -> Vec<Pause> {
        let limit = now_ms - after.as_millis() as i64;
        self.paused
            .values()
            .filter(|p| p.record_ms < limit)
            .cloned()
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(g: &str) -> Target {
        Target::Group { group: g.into() }
    }
    fn lane(g: &str, l: Lane) -> Target {
        Target::Lane {
            group: g.into(),
            lane: l,
        }
    }
    fn kind(k: &str) -> Target {
        Target::Kind { kind: k.into() }
    }

    #[test]
    fn pause_records_round_trip_as_tagged_json() {
        let r = Record::pause(lane("gpu=true", Lane::Critical), "maint", "ops", 7);
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["op"], "pause");
        assert_eq!(v["target"]["scope"], "lane");
        assert_eq!(v["target"]["group"], "gpu=true");
        assert_eq!(v["target"]["lane"], "critical");
        assert_eq!(v["by"], "ops");
        assert_eq!(serde_json::from_value::<Record>(v).unwrap(), r);
        let r = Record::resume(kind("resize"), "ops", 8);
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(
            (v["op"].as_str(), v["target"]["kind"].as_str()),
            (Some("resume"), Some("resize"))
        );
        assert_eq!(serde_json::from_value::<Record>(v).unwrap(), r);
    }

    #[test]
    fn the_last_record_per_target_wins_in_stream_order() {
        let mut s = PauseSet::default();
        assert!(s.apply(&Record::pause(group("a"), "why", "ops", 10)));
        assert!(s.lane_paused("a", Lane::Normal) && s.lane_paused("a", Lane::Critical));
        assert!(!s.lane_paused("b", Lane::Normal));
        // A second pause keeps the first's who, why and since.
        assert!(!s.apply(&Record::pause(group("a"), "again", "other", 20)));
        let p = s.get(&group("a")).unwrap();
        assert_eq!(
            (p.since_ms, p.record_ms, p.by.as_str(), p.reason.as_str()),
            (10, 20, "ops", "why")
        );
        assert!(s.apply(&Record::resume(group("a"), "ops", 30)));
        assert!(s.is_empty() && !s.lane_paused("a", Lane::Normal));
        assert!(
            !s.apply(&Record::resume(group("a"), "ops", 31)),
            "resumed twice"
        );
        assert!(s.apply(&Record::pause(group("a"), "", "ops", 40)));
        assert_eq!(s.get(&group("a")).unwrap().since_ms, 40, "a new pause");
        // Other records change nothing.
        assert!(!s.apply(&Record::barrier("r", 50)));
    }

    #[test]
    fn a_lane_pause_stops_one_lane_and_a_group_resume_clears_it() {
        let mut s = PauseSet::default();
        s.apply(&Record::pause(lane("a", Lane::Critical), "", "ops", 1));
        assert!(s.lane_paused("a", Lane::Critical) && !s.lane_paused("a", Lane::Normal));
        assert_eq!(s.paused_lanes("a"), vec![Lane::Critical]);
        s.apply(&Record::pause(group("a"), "", "ops", 2));
        // Resuming the lane leaves the group's pause in force.
        s.apply(&Record::resume(lane("a", Lane::Critical), "ops", 3));
        assert!(s.lane_paused("a", Lane::Critical));
        s.apply(&Record::pause(lane("a", Lane::Normal), "", "ops", 4));
        s.apply(&Record::pause(lane("b", Lane::Normal), "", "ops", 4));
        assert_eq!(
            s.group_lanes(),
            vec![
                ("a".into(), Lane::Normal),
                ("a".into(), Lane::Critical),
                ("b".into(), Lane::Normal)
            ]
        );
        // Resuming the group resumes its lanes too, not another group's.
        assert!(s.apply(&Record::resume(group("a"), "ops", 5)));
        assert_eq!(s.group_lanes(), vec![("b".into(), Lane::Normal)]);
    }

    #[test]
    fn kinds_are_paused_fleet_wide_and_remembered_after_a_resume() {
        let mut s = PauseSet::default();
        s.apply(&Record::pause(kind("resize"), "", "ops", 1));
        assert!(s.kind_paused("resize") && !s.kind_paused("noop"));
        assert!(s.group_lanes().is_empty(), "a kind pauses no group");
        s.apply(&Record::resume(kind("resize"), "ops", 2));
        assert!(!s.kind_paused("resize"));
        assert_eq!(
            s.holds().collect::<Vec<_>>(),
            vec![&kind("resize")],
            "its hold queue is drained"
        );
    }

    #[test]
    fn a_batch_pause_holds_its_members_behind_a_kind_pause() {
        let mut s = PauseSet::default();
        let b = Target::Batch { batch: "b1".into() };
        s.apply(&Record::pause(b.clone(), "", "ops", 1));
        assert!(s.batch_paused("b1") && !s.batch_paused("b2"));
        assert_eq!(s.held("k", Some("b1")), Some(b.clone()));
        assert_eq!(s.held("k", Some("b2")), None);
        assert_eq!(s.held("k", None), None);
        s.apply(&Record::pause(kind("k"), "", "ops", 2));
        assert_eq!(
            s.held("k", Some("b1")),
            Some(kind("k")),
            "the kind's hold first"
        );
        s.apply(&Record::resume(b.clone(), "ops", 3));
        assert_eq!(s.held("j", Some("b1")), None);
        assert_eq!(s.holds().cloned().collect::<Vec<_>>(), vec![kind("k"), b]);
    }

    #[test]
    fn a_rebuilt_set_equals_the_live_one() {
        let recs = vec![
            Record::pause(group("a"), "", "ops", 1),
            Record::resume(group("a"), "ops", 2),
            Record::pause(kind("k"), "", "ops", 3),
            Record::pause(lane("b", Lane::Normal), "", "ops", 4),
            Record::resume(lane("b", Lane::Normal), "ops", 5),
            Record::pause(group("a"), "", "ops", 6),
        ];
        let mut live = PauseSet::default();
        for r in &recs {
            live.apply(r);
        }
        // Folding the stream again from its first record (a restart) ends in the same set.
        let mut again = PauseSet::default();
        for r in &recs {
            again.apply(r);
        }
        assert_eq!(live, again);
        assert!(live.lane_paused("a", Lane::Normal) && live.kind_paused("k"));
        assert!(!live.lane_paused("b", Lane::Normal));
    }

    #[test]
    fn old_pauses_are_due_for_renewal_and_a_renewal_keeps_their_history() {
        let day = 86_400_000i64;
        let mut s = PauseSet::default();
        s.apply(&Record::pause(group("a"), "maint", "ops", 0));
        s.apply(&Record::pause(kind("k"), "", "ops", 3 * day));
        let due = s.due_for_renewal(4 * day, RENEW_AFTER);
        assert_eq!(due.len(), 1, "only the pause older than half the retention");
        assert_eq!(due[0].target, group("a"));
        let r = Record::renewal(&due[0], 4 * day);
        // A scheduler that starts after the first record aged out folds the renewal alone.
        let mut fresh = PauseSet::default();
        fresh.apply(&r);
        let p = fresh.get(&group("a")).unwrap();
        assert_eq!(
            (p.since_ms, p.by.as_str(), p.reason.as_str()),
            (0, "ops", "maint")
        );
        s.apply(&r);
        assert!(s.due_for_renewal(4 * day, RENEW_AFTER).is_empty());
    }
}
