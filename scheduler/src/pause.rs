//! Pause and resume on the scheduler: the pauses in force in this process ([`Pauses`]), what
//! each dispatching loop reads before it acts.
//!
//! # Where a pause is in force
//!
//! The pauses live in the durable control stream ([`fleet::control`], records `pause` and
//! `resume`); every replica folds them into a [`PauseSet`] ([`crate::control`]). Nothing of a
//! pause is in Redis, so a Redis loss (FLUSHALL, a failover) changes nothing, and a restarted
//! scheduler reads the stream from its first record, up to a barrier record of its own, before
//! any of its loops dispatches (see [`crate::control`]): a restart never dispatches paused
//! work, not even for a moment.
//!
//! # What a pause does (and costs)
//!
//! * **Group or lane** — the reservation script is told the paused (group, lane) pairs with the
//!   batch (arguments, no command): a paused lane is never chosen, and a task that only paused
//!   lanes could take parks behind one of them (`<ns>.park.<group>.<lane>`), in order, with
//!   nothing reserved. That park queue's release loop consumes nothing while its lane is
//!   paused ([`crate::park::Release`]), so the tasks stay in the broker. A task that another,
//!   unpaused group can take goes there. A resume sets the lane's parked flag before the
//!   lane opens, so new work queues behind what waited.
//! * **Kind or batch** (a *hold*: [`hold_group`]) — a task of a paused kind, or a member of
//!   a paused batch, is published, before any reservation, to the hold's queue
//!   (`<ns>.park._kind.<kind>.<lane>`, `<ns>.park._batch.<batch>.<lane>`) instead of a
//!   group's park queue, so it blocks no other kind or batch (no head-of-line blocking); the
//!   kind's hold comes first when both are paused ([`PauseSet::held`]). The hold queue's
//!   release loop consumes nothing while its hold is paused; after the resume it offers each
//!   task to the reservation again (once: the queue's ack follows its dispatch). Extra broker
//!   hops per held task: two (into the hold queue, out of it), plus one more if its group is
//!   full then (it parks there as any task would). A paused batch also releases none of its
//!   waiting members and fires no callback until the resume ([`crate::batch`]).
//! * **Already dispatched** — tasks in a group's queue before the pause (at most the room the
//!   group holds ahead of its workers) still run, as in a drain, and so do their retries
//!   (a retry goes back to its group queue through a delay tier, not through dispatch).
//!   Health probes still run: they are published to the group's critical queue directly.
//! * **Nothing paused** — [`Pauses::snapshot`] is `None` and every check is skipped: no Redis
//!   command, no argument more than a `0`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use fleet::control::{KeyOverrides, PauseSet, Record};
use fleet::Lane;
use tokio::sync::{oneshot, watch};

use fleet::control::Target;

/// The prefix of the pseudo-groups whose park queues hold the tasks of paused kinds.
pub const HELD_KIND: &str = "_kind.";
/// The prefix of the pseudo-groups whose park queues hold the members of paused batches.
pub const HELD_BATCH: &str = "_batch.";

/// The pseudo-group whose park queues hold the tasks of hold `t` while it is paused — a kind:
/// `_kind.<kind>`, a batch: `_batch.<batch>` (queues `<ns>.park.<pseudo-group>.<lane>`); `None`
/// for a target that holds nothing of its own ([`Target::holds`]). Group names are label sets
/// (`k=v,...`): none starts with `_kind.` or `_batch.`.
pub fn hold_group(t: &Target) -> Option<String> {
    match t {
        Target::Kind { kind } => Some(format!("{HELD_KIND}{kind}")),
        Target::Batch { batch } => Some(format!("{HELD_BATCH}{batch}")),
        _ => None,
    }
}

/// The hold whose queue `group` is, if it is one ([`hold_group`]).
pub fn hold_target(group: &str) -> Option<Target> {
    if let Some(kind) = group.strip_prefix(HELD_KIND) {
        return Some(Target::Kind {
            kind: kind.to_string(),
        });
    }
    group.strip_prefix(HELD_BATCH).map(|b| Target::Batch {
        batch: b.to_string(),
    })
}

/// The pauses in force in this process: shared by the control loop (which writes them), the
/// dispatcher, the park release loops, the stats and the API (which read them). Cheap to
/// clone.
#[derive(Clone)]
pub struct Pauses {
    inner: Arc<Inner>,
}

struct Inner {
    set: RwLock<Arc<PauseSet>>,
    /// The per-key limits in force (settings, then the control stream's `key_limit` records).
    limits: RwLock<Arc<fleet::control::KeyLimits>>,
    /// The settings' limits and the stream's overrides the limits in force are made of.
    keys: Mutex<(fleet::control::KeyLimits, Arc<KeyOverrides>)>,
    /// Bumped on every change of the set: release loops wait on it.
    version: watch::Sender<u64>,
    /// API requests waiting for their record to be applied here, by record id.
    waiters: Mutex<HashMap<String, oneshot::Sender<()>>>,
    /// Tasks in each hold's queues (kind or batch) at the last stats sample.
    held: Mutex<HashMap<Target, u64>>,
}

impl Default for Pauses {
    fn default() -> Self {
        Pauses {
            inner: Arc::new(Inner {
                set: RwLock::new(Arc::new(PauseSet::default())),
                limits: RwLock::new(Arc::new(fleet::control::KeyLimits::default())),
                keys: Mutex::new(Default::default()),
                version: watch::channel(0).0,
                waiters: Mutex::new(HashMap::new()),
                held: Mutex::new(HashMap::new()),
            }),
        }
    }
}

impl Pauses {
    /// The set in force.
    pub fn current(&self) -> Arc<PauseSet> {
        match self.inner.set.read() {
            Ok(s) => s.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// The per-key limits in force (tenants: `max_running`, `min_running`, rate, weight).
    pub fn key_limits(&self) -> Arc<fleet::control::KeyLimits> {
        match self.inner.limits.read() {
            Ok(s) => s.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// Replaces the per-key limits in force; subscribers see the change (a release loop holding
    /// tasks of a key whose limit was raised offers them at once).
    pub fn set_key_limits(&self, limits: fleet::control::KeyLimits) {
        let changed = {
            let mut slot = match self.inner.limits.write() {
                Ok(s) => s,
                Err(p) => p.into_inner(),
            };
            let changed = **slot != limits;
            *slot = Arc::new(limits);
            changed
        };
        if changed {
            self.inner.version.send_modify(|v| *v += 1);
        }
    }

    /// Sets the settings' key limits (at start): the base the stream's overrides replace
    /// per key; the limits in force are recomputed.
    pub fn set_key_settings(&self, settings: fleet::control::KeyLimits) {
        let merged = {
            let mut k = match self.inner.keys.lock() {
                Ok(k) => k,
                Err(p) => p.into_inner(),
            };
            k.0 = settings;
            k.1.over(&k.0)
        };
        self.set_key_limits(merged);
    }

    /// The settings' key limits ([`Pauses::set_key_settings`]).
    pub fn key_settings(&self) -> fleet::control::KeyLimits {
        match self.inner.keys.lock() {
            Ok(k) => k.0.clone(),
            Err(p) => p.into_inner().0.clone(),
        }
    }

    /// The control stream's key-limit overrides in force.
    pub fn key_overrides(&self) -> Arc<KeyOverrides> {
        match self.inner.keys.lock() {
            Ok(k) => k.1.clone(),
            Err(p) => p.into_inner().1.clone(),
        }
    }

    /// Replaces the overrides (a fold of the stream from its first record, caught up, or one
    /// record applied live) and recomputes the limits in force. Call it before the pause
    /// set's [`Pauses::replace`] / [`Pauses::apply`] of the same records: those answer the
    /// records' waiters.
    pub fn replace_key_overrides(&self, overrides: KeyOverrides) {
        let merged = {
            let mut k = match self.inner.keys.lock() {
                Ok(k) => k,
                Err(p) => p.into_inner(),
            };
            k.1 = Arc::new(overrides);
            k.1.over(&k.0)
        };
        self.set_key_limits(merged);
    }

    /// Applies one `key_limit` record read live (other records change nothing); `true` when
    /// an override changed.
    pub fn apply_key_record(&self, rec: &Record) -> bool {
        if !matches!(rec.op, fleet::control::Op::KeyLimit { .. }) {
            return false;
        }
        let mut next = (*self.key_overrides()).clone();
        let changed = next.apply(rec);
        if changed {
            self.replace_key_overrides(next);
        }
        changed
    }

    /// The set in force, `None` when nothing is paused (the hot path's one check).
    pub fn snapshot(&self) -> Option<Arc<PauseSet>> {
        let s = self.current();
        (!s.is_empty()).then_some(s)
    }

    /// Whether `group`'s `lane` is paused now.
    pub fn lane_paused(&self, group: &str, lane: Lane) -> bool {
        self.current().lane_paused(group, lane)
    }

    /// A receiver that sees every change of the set (its value: a change counter).
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.inner.version.subscribe()
    }

    /// Replaces the whole set (a fold of the stream from its first record, caught up) and
    /// tells the waiters of `applied` (the ids of the records it folded).
    pub fn replace<'a>(&self, set: PauseSet, applied: impl IntoIterator<Item = &'a str>) {
        let changed = {
            let mut slot = match self.inner.set.write() {
                Ok(s) => s,
                Err(p) => p.into_inner(),
            };
            let changed = **slot != set;
            *slot = Arc::new(set);
            changed
        };
        if changed {
            self.inner.version.send_modify(|v| *v += 1);
        }
        for id in applied {
            self.done(id);
        }
    }

    /// The set `rec` would make, and whether it differs from the set in force.
    pub fn with(&self, rec: &Record) -> (PauseSet, bool) {
        let mut next = (*self.current()).clone();
        let changed = next.apply(rec);
        (next, changed)
    }

    /// Applies one record read live, and tells its waiter.
    pub fn apply(&self, rec: &Record) {
        let (next, changed) = self.with(rec);
        if changed {
            self.replace(next, [rec.id.as_str()]);
        } else {
            self.done(&rec.id);
        }
    }

    /// A receiver that fires once record `id` is applied here ([`Pauses::forget`] it when
    /// giving up). Register it before the record is appended.
    pub fn wait_for(&self, id: &str) -> oneshot::Receiver<()> {
        let (tx, rx) = oneshot::channel();
        if let Ok(mut w) = self.inner.waiters.lock() {
            w.insert(id.to_string(), tx);
        }
        rx
    }

    /// Tasks in each hold's queues (both lanes) at the last stats sample, by hold (a kind or
    /// a batch target).
    pub fn held(&self) -> HashMap<Target, u64> {
        self.inner
            .held
            .lock()
            .map(|h| h.clone())
            .unwrap_or_default()
    }

    /// Sets what [`Pauses::held`] answers (the stats loop, every sample).
    pub fn set_held(&self, held: HashMap<Target, u64>) {
        if let Ok(mut h) = self.inner.held.lock() {
            *h = held;
        }
    }

    /// Forgets the waiter of record `id`.
    pub fn forget(&self, id: &str) {
        if let Ok(mut w) = self.inner.waiters.lock() {
            w.remove(id);
        }
    }

    fn done(&self, id: &str) {
        let tx = self
            .inner
            .waiters
            .lock()
            .ok()
            .and_then(|mut w| w.remove(id));
        if let Some(tx) = tx {
            let _ = tx.send(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hold_group_names_its_kind_or_batch() {
        let kind = Target::Kind {
            kind: "resize".into(),
        };
        let batch = Target::Batch {
            batch: "nightly".into(),
        };
        assert_eq!(hold_group(&kind).as_deref(), Some("_kind.resize"));
        assert_eq!(hold_group(&batch).as_deref(), Some("_batch.nightly"));
        assert_eq!(hold_group(&Target::Key { key: "k".into() }), None);
        assert_eq!(hold_target("_kind.resize"), Some(kind));
        assert_eq!(hold_target("_batch.nightly"), Some(batch));
        assert_eq!(hold_target("pool=a"), None);
        assert_eq!(hold_target(fleet::Names::UNMATCHED_GROUP), None);
    }

    #[tokio::test]
    async fn a_waiter_fires_when_its_record_is_applied_and_watchers_see_changes() {
        let p = Pauses::default();
        assert!(p.snapshot().is_none());
        let mut changes = p.subscribe();
        let rec = Record::pause(Target::Group { group: "a".into() }, "", "ops", 1);
        let w = p.wait_for(&rec.id);
        p.apply(&rec);
        w.await.unwrap();
        assert!(changes.has_changed().unwrap());
        changes.borrow_and_update();
        assert!(p.lane_paused("a", Lane::Critical));
        assert!(p.snapshot().is_some());
        // The same pause again changes nothing, and still answers its waiter.
        let again = Record::pause(Target::Group { group: "a".into() }, "", "ops", 2);
        let w = p.wait_for(&again.id);
        p.apply(&again);
        w.await.unwrap();
        assert!(!changes.has_changed().unwrap());
        // A rebuilt set replaces it whole.
        p.replace(PauseSet::default(), ["x"]);
        assert!(p.snapshot().is_none() && changes.has_changed().unwrap());
    }
}
