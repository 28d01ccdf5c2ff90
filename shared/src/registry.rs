//! The worker registry in Redis: registration, heartbeats, states, eviction, and the
//! read side used by the API (`/v1/workers`, `/v1/groups`).
//!
//! A group's capacity is kept as a counter per lane that every state change adjusts by the
//! worker's contribution (its capacity while `active`, else 0), so routing reads one hash
//! field instead of summing workers. Running and reserved counts are *not* counters but
//! leased sorted-set members, so they can never drift: an expired lease simply stops counting.

use std::collections::BTreeMap;

use deadpool_redis::redis;
use serde::Serialize;

use crate::envelope::Lane;
use crate::error::{Error, Result};
use crate::selector::Labels;
use crate::store::Store;

/// A worker's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerState {
    Active,
    Draining,
    Ejected,
}

impl WorkerState {
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerState::Active => "active",
            WorkerState::Draining => "draining",
            WorkerState::Ejected => "ejected",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "active" => Some(WorkerState::Active),
            "draining" => Some(WorkerState::Draining),
            "ejected" => Some(WorkerState::Ejected),
            _ => None,
        }
    }
}

/// What a worker registers.
#[derive(Debug, Clone)]
pub struct Registration {
    pub id: String,
    pub instance: String,
    pub labels: Labels,
    pub capacity: u32,
    pub critical_capacity: u32,
    pub executor: String,
    pub state: WorkerState,
}

impl Registration {
    pub fn group(&self) -> String {
        self.labels.group_name()
    }
}

/// What a heartbeat carries.
#[derive(Debug, Clone, Default)]
pub struct Beat {
    pub running_normal: u32,
    pub running_critical: u32,
    pub succeeded: u64,
    pub failed: u64,
    pub latency_ewma_ms: f64,
    pub cpu: f64,
    pub health: f64,
    /// Running tasks: (lane, task id); their leases are renewed.
    pub running: Vec<(Lane, String)>,
}

/// The answer to a heartbeat.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BeatReply {
    State(WorkerState),
    /// The registration is gone (evicted, or Redis lost its data): register again.
    Gone,
    /// Another process holds this worker id.
    Conflict,
}

/// A worker as the API shows it.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct WorkerView {
    pub id: String,
    pub group: String,
    pub labels: serde_json::Value,
    pub executor: String,
    pub state: String,
    pub capacity: u32,
    pub critical_capacity: u32,
    pub running: u32,
    pub running_critical: u32,
    /// User task attempts that succeeded (health probes are not counted).
    pub succeeded: u64,
    /// User task attempts whose outcome could not be recorded (sent back to the broker) —
    /// the `failed` outcome of `fleet_tasks_completed_total`, not failed handler runs (those
    /// are `retried` or `dead`).
    pub failed: u64,
    /// Attempts that failed and were sent to a retry delay.
    #[serde(default)]
    pub retried: u64,
    /// Attempts that ended the task in the dead-letter queue.
    #[serde(default)]
    pub dead: u64,
    /// Attempts dropped because the deadline had passed.
    #[serde(default)]
    pub expired: u64,
    pub latency_ewma_ms: f64,
    pub cpu: f64,
    pub last_heartbeat_ms_ago: i64,
}

/// A group as the API shows it.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct GroupView {
    pub group: String,
    pub labels: serde_json::Value,
    pub workers: u32,
    pub capacity: u32,
    pub critical_capacity: u32,
    pub load: u32,
    pub reserved: u32,
    pub critical_load: u32,
    pub critical_reserved: u32,
}

impl Store {
    /// Registers a worker. A live process holding the same id makes this fail with a message.
    pub async fn register(&self, r: &Registration, liveness_ms: i64) -> Result<()> {
        self.register_with(r, liveness_ms, false).await
    }

    /// Registers a worker; with `takeover` the previous holder of the id is known to be gone
    /// (this process holds the id's broker lock, see `Names::worker_lock_queue`) and its
    /// registration is replaced at once instead of after its heartbeat window.
    pub async fn register_with(&self, r: &Registration, liveness_ms: i64, takeover: bool) -> Result<()> {
        self.register_declared(r, liveness_ms, takeover, 0).await
    }

    /// Registers a worker whose group queues were last declared at `declared_at_ms` (Redis
    /// time, ms since the epoch; 0: the caller declares no queues).
    ///
    /// # Errors
    /// [`Error::DuplicateWorker`] (a live process holds the id), [`Error::Reclaiming`] (the
    /// group is being reclaimed, or was reclaimed after `declared_at_ms`: declare the queues
    /// again and retry), Redis errors.
    pub async fn register_declared(&self, r: &Registration, liveness_ms: i64, takeover: bool, declared_at_ms: i64) -> Result<()> {
        let labels_json = serde_json::to_string(&r.labels)?;
        let mut inv = self.scripts.register.prepare_invoke();
        inv.key(self.names.prefix())
            .arg(&r.id)
            .arg(&r.instance)
            .arg(r.group())
            .arg(labels_json)
            .arg(r.capacity)
            .arg(r.critical_capacity)
            .arg(&r.executor)
            .arg(if takeover { 1 } else { 0 })
            .arg(liveness_ms)
            .arg(r.state.as_str())
            .arg(declared_at_ms)
            .arg(r.labels.pairs());
        match self.invoke::<String>(&inv).await {
            Ok(_) => Ok(()),
            Err(Error::Redis(e)) if e.to_string().contains("DUPLICATE") => Err(Error::DuplicateWorker(format!(
                "worker id `{}` is already registered by a live worker ({})",
                r.id,
                e.detail().unwrap_or("recent heartbeat")
            ))),
            Err(Error::Redis(e)) if e.to_string().contains("RECLAIMING") => {
                Err(Error::Reclaiming(format!("group `{}`: {}", r.group(), e.detail().unwrap_or("being reclaimed"))))
            }
            Err(e) => Err(e),
        }
    }

    pub async fn heartbeat(&self, id: &str, instance: &str, lease_ms: i64, b: &Beat) -> Result<BeatReply> {
        let mut inv = self.scripts.heartbeat.prepare_invoke();
        inv.key(self.names.prefix())
            .arg(id)
            .arg(instance)
            .arg(lease_ms)
            .arg(b.running_normal)
            .arg(b.running_critical)
            .arg(b.succeeded)
            .arg(b.failed)
            .arg(format!("{:.3}", b.latency_ewma_ms))
            .arg(format!("{:.3}", b.cpu))
            .arg(format!("{:.3}", b.health));
        for (lane, task) in &b.running {
            inv.arg(format!("{lane}|{task}"));
        }
        let reply: String = self.invoke(&inv).await?;
        Ok(match reply.as_str() {
            "gone" => BeatReply::Gone,
            "conflict" => BeatReply::Conflict,
            s => BeatReply::State(WorkerState::parse(s).unwrap_or(WorkerState::Active)),
        })
    }

    /// Who holds a worker id: its instance token and last heartbeat (ms); `None` when the id is
    /// not registered.
    pub async fn worker_holder(&self, id: &str) -> Result<Option<(String, i64)>> {
        let (instance, hb): (Option<String>, Option<i64>) =
            self.query(redis::cmd("HMGET").arg(self.names.worker(id)).arg("instance").arg("hb")).await?;
        Ok(instance.zip(hb))
    }

    /// Sets a worker's state; `None` when the worker is unknown.
    pub async fn set_state(&self, id: &str, state: WorkerState) -> Result<Option<WorkerState>> {
        let mut inv = self.scripts.set_state.prepare_invoke();
        inv.key(self.names.prefix()).arg(id).arg(state.as_str());
        let old: Option<String> = self.invoke(&inv).await?;
        Ok(old.and_then(|s| WorkerState::parse(&s)))
    }

    /// Ejects an active worker unless it is the last active capacity of its group.
    /// `Some(true)` ejected, `Some(false)` refused (last one), `None` unknown or not active.
    pub async fn try_eject(&self, id: &str) -> Result<Option<bool>> {
        let mut inv = self.scripts.eject.prepare_invoke();
        inv.key(self.names.prefix()).arg(id);
        let r: i64 = self.invoke(&inv).await?;
        Ok(match r {
            1 => Some(true),
            0 => Some(false),
            _ => None,
        })
    }

    /// A worker's current state, `None` when not registered.
    pub async fn worker_state(&self, id: &str) -> Result<Option<WorkerState>> {
        let s: Option<String> = self.query(redis::cmd("HGET").arg(self.names.worker(id)).arg("state")).await?;
        Ok(s.and_then(|s| WorkerState::parse(&s)))
    }

    /// Evicts workers silent for longer than `timeout_ms`; returns their ids.
    pub async fn evict_stale(&self, timeout_ms: i64) -> Result<Vec<String>> {
        let mut inv = self.scripts.evict.prepare_invoke();
        inv.key(self.names.prefix()).arg(timeout_ms);
        self.invoke(&inv).await
    }

    /// Publishes a worker's task figures (user task attempts by outcome, as totals) on its
    /// registration; `false` when this instance does not hold the registration.
    pub async fn set_outcomes(&self, id: &str, instance: &str, totals: &[(&str, u64)]) -> Result<bool> {
        let mut inv = self.scripts.outcomes.prepare_invoke();
        inv.key(self.names.prefix()).arg(id).arg(instance);
        for (outcome, n) in totals {
            inv.arg(*outcome).arg(*n);
        }
        let written: i64 = self.invoke(&inv).await?;
        Ok(written == 1)
    }

    pub async fn deregister(&self, id: &str, instance: &str) -> Result<bool> {
        let mut inv = self.scripts.deregister.prepare_invoke();
        inv.key(self.names.prefix()).arg(id).arg(instance);
        let n: i64 = self.invoke(&inv).await?;
        Ok(n == 1)
    }

    /// All registered workers.
    pub async fn workers(&self) -> Result<Vec<WorkerView>> {
        let ids: Vec<String> = self.query(redis::cmd("ZRANGE").arg(self.names.workers()).arg(0).arg(-1)).await?;
        if ids.is_empty() {
            return Ok(vec![]);
        }
        let mut p = redis::pipe();
        for id in &ids {
            p.cmd("HGETALL").arg(self.names.worker(id));
        }
        let rows: Vec<BTreeMap<String, String>> = self.pipe(&p).await?;
        let now = self.clock.now_ms();
        let num = |m: &BTreeMap<String, String>, k: &str| m.get(k).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
        Ok(rows
            .into_iter()
            .filter(|m| m.contains_key("id"))
            .map(|m| WorkerView {
                id: m.get("id").cloned().unwrap_or_default(),
                group: m.get("group").cloned().unwrap_or_default(),
                labels: m.get("labels").and_then(|l| serde_json::from_str(l).ok()).unwrap_or_default(),
                executor: m.get("executor").cloned().unwrap_or_default(),
                state: m.get("state").cloned().unwrap_or_default(),
                capacity: num(&m, "cap") as u32,
                critical_capacity: num(&m, "ccap") as u32,
                running: num(&m, "load") as u32,
                running_critical: num(&m, "cload") as u32,
                succeeded: num(&m, "n:succeeded") as u64,
                failed: num(&m, "n:failed") as u64,
                retried: num(&m, "n:retried") as u64,
                dead: num(&m, "n:dead") as u64,
                expired: num(&m, "n:expired") as u64,
                latency_ewma_ms: num(&m, "ewma_ms"),
                cpu: num(&m, "cpu"),
                last_heartbeat_ms_ago: now - num(&m, "hb") as i64,
            })
            .collect())
    }

    /// Completed attempts so far of each group, per lane in [`Lane::ALL`] order (counters kept
    /// by the `finish` script), for measuring completion rates.
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn group_completions(&self, groups: &[String]) -> Result<Vec<[u64; 2]>> {
        if groups.is_empty() {
            return Ok(vec![]);
        }
        let mut p = redis::pipe();
        for g in groups {
            p.cmd("HMGET").arg(self.names.group(g)).arg("done:normal").arg("done:critical");
        }
        let raw: Vec<(Option<u64>, Option<u64>)> = self.pipe(&p).await?;
        Ok(raw.into_iter().map(|(n, c)| [n.unwrap_or(0), c.unwrap_or(0)]).collect())
    }

    /// Sets each group's room ahead of its workers per lane (tasks; see the `reserve` script).
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn set_rooms(&self, rooms: &[(String, Lane, u64)]) -> Result<()> {
        if rooms.is_empty() {
            return Ok(());
        }
        // Only groups that exist: a reclaimed group's hash must not come back (`lua/rooms.lua`).
        let mut inv = self.scripts.rooms.prepare_invoke();
        inv.key(self.names.prefix());
        for (g, lane, room) in rooms {
            inv.arg(g).arg(lane.as_str()).arg(*room);
        }
        self.invoke::<i64>(&inv).await.map(|_| ())
    }

    /// A group's worker ordinals (deterministic subsetting): ordinal → worker id. Taken by
    /// `register.lua` (lowest free), freed by deregistration and eviction.
    pub async fn group_ordinals(&self, group: &str) -> Result<BTreeMap<u32, String>> {
        let raw: BTreeMap<String, String> = self.query(redis::cmd("HGETALL").arg(self.names.group_ordinals(group))).await?;
        Ok(raw.into_iter().filter_map(|(o, id)| Some((o.parse().ok()?, id))).collect())
    }

    /// Names of all groups ever registered in this namespace.
    pub async fn group_names(&self) -> Result<Vec<String>> {
        let mut g: Vec<String> = self.query(redis::cmd("SMEMBERS").arg(self.names.groups())).await?;
        g.sort();
        Ok(g)
    }

    /// All groups with capacity, running (load) and reserved counts per lane. Expired leases
    /// are not counted.
    pub async fn groups(&self) -> Result<Vec<GroupView>> {
        let names = self.group_names().await?;
        if names.is_empty() {
            return Ok(vec![]);
        }
        let now = self.clock.now_ms();
        let mut p = redis::pipe();
        for g in &names {
            p.cmd("HGETALL").arg(self.names.group(g));
            p.cmd("SCARD").arg(self.names.group_workers(g));
            for lane in Lane::ALL {
                p.cmd("ZCOUNT").arg(self.names.running(g, lane)).arg(now).arg("+inf");
                p.cmd("ZCOUNT").arg(self.names.reserved(g, lane)).arg(now).arg("+inf");
            }
        }
        let raw: Vec<redis::Value> = self.pipe(&p).await?;
        let mut out = Vec::with_capacity(names.len());
        for (i, g) in names.into_iter().enumerate() {
            let base = i * 6;
            let h: BTreeMap<String, String> = redis::from_redis_value(raw[base].clone()).unwrap_or_default();
            let n = |j: usize| -> u32 { redis::from_redis_value::<u32>(raw[base + j].clone()).unwrap_or(0) };
            let cap = |k: &str| h.get(k).and_then(|v| v.parse::<i64>().ok()).unwrap_or(0).max(0) as u32;
            out.push(GroupView {
                labels: h.get("labels").and_then(|l| serde_json::from_str(l).ok()).unwrap_or_default(),
                workers: n(1),
                capacity: cap("cap:normal"),
                critical_capacity: cap("cap:critical"),
                load: n(2),
                reserved: n(3),
                critical_load: n(4),
                critical_reserved: n(5),
                group: g,
            });
        }
        Ok(out)
    }
}

/// What the claim step of the reclaim script answered for a group (see `lua/reclaim.lua`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReclaimClaim {
    /// Its keys are gone and its tombstone says `pending`: delete its queues, then call
    /// [`Store::reclaim_done`] (or [`Store::reclaim_restore`] when a queue holds a task).
    /// `labels`: the group's labels as JSON, for a restore.
    Reclaimed { labels: String },
    /// Empty, but not for the whole grace yet: this many ms are left.
    Wait(i64),
    /// Not departed: a worker, or running, reserved or parked work (the reason).
    Busy(String),
    /// Not a group (any more): reclaimed by another replica, or never registered.
    Absent,
}

impl Store {
    /// Claims a departed group for reclaim, atomically against a worker registering: its keys
    /// go only when it has had no worker and no running, reserved or parked record for
    /// `grace_ms` (Redis time). `hold_ms`: life of the tombstone that keeps workers of the group
    /// from registering until its queues are deleted.
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn reclaim_claim(&self, group: &str, grace_ms: i64, hold_ms: i64) -> Result<ReclaimClaim> {
        let (step, detail) = self.reclaim_step("claim", group, &grace_ms.to_string(), hold_ms).await?;
        Ok(match step.as_str() {
            "reclaimed" => ReclaimClaim::Reclaimed { labels: detail },
            "wait" => ReclaimClaim::Wait(detail.parse().unwrap_or(grace_ms)),
            "absent" => ReclaimClaim::Absent,
            _ => ReclaimClaim::Busy(detail),
        })
    }

    /// Ends a reclaim whose queues are deleted: the tombstone becomes the deletion's time and
    /// lives `hold_ms` (a worker that declared its queues before it declares them again).
    ///
    /// # Errors
    /// Redis unreachable or slow (the `pending` tombstone then expires after its life).
    pub async fn reclaim_done(&self, group: &str, hold_ms: i64) -> Result<()> {
        self.reclaim_step("done", group, "", hold_ms).await.map(|_| ())
    }

    /// Undoes a claim whose group turned out to hold work (a queue was not empty): the group
    /// is back with its labels (JSON, as the claim returned them), its grace starting again.
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn reclaim_restore(&self, group: &str, labels: &str, hold_ms: i64) -> Result<()> {
        self.reclaim_step("restore", group, labels, hold_ms).await.map(|_| ())
    }

    async fn reclaim_step(&self, step: &str, group: &str, arg: &str, hold_ms: i64) -> Result<(String, String)> {
        let mut inv = self.scripts.reclaim.prepare_invoke();
        inv.key(self.names.prefix()).arg(step).arg(group).arg(arg).arg(hold_ms.max(1));
        let r: Vec<String> = self.invoke(&inv).await?;
        let mut it = r.into_iter();
        Ok((it.next().unwrap_or_default(), it.next().unwrap_or_default()))
    }
}
