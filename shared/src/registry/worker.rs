//! Registration: a worker joins its group (its capacity counted while `active`), moves
//! between states, publishes its figures and leaves; and the read side of `/v1/workers`.

use std::collections::BTreeMap;
use std::time::Duration;

use deadpool_redis::redis;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::redis::{millis, Store};
use crate::task::Labels;

/// What `register.lua` answers: its status word, then what goes with it.
#[derive(Debug, Clone, PartialEq, Eq)]
enum RegisterAnswer {
    /// `{'registered'}`: the worker is in the registry.
    Registered,
    /// `{'duplicate', ms}`: another instance holds the id and heartbeated `ms` ago.
    Duplicate {
        /// How long ago the holder's last heartbeat was (Redis time, ms).
        heartbeat_ms_ago: i64,
    },
    /// `{'reclaiming', why}`: the group is being reclaimed, or was after the worker declared
    /// its queues.
    Reclaiming(String),
}

impl RegisterAnswer {
    /// The answer in `v`.
    ///
    /// # Errors
    /// [`Error::BadAnswer`] for any other shape (a script of another version).
    fn parse(v: &redis::Value) -> Result<Self> {
        let bad = || Error::BadAnswer {
            from: "register.lua",
            detail: format!("{v:?}"),
        };
        let redis::Value::Array(items) = v else {
            return Err(bad());
        };
        let word = items
            .first()
            .and_then(|w| redis::from_redis_value_ref::<String>(w).ok())
            .ok_or_else(bad)?;
        let second = items.get(1);
        match (word.as_str(), second) {
            ("registered", None) => Ok(RegisterAnswer::Registered),
            ("duplicate", Some(ms)) => redis::from_redis_value_ref::<i64>(ms)
                .map(|heartbeat_ms_ago| RegisterAnswer::Duplicate { heartbeat_ms_ago })
                .map_err(|_| bad()),
            ("reclaiming", Some(why)) => redis::from_redis_value_ref::<String>(why)
                .map(RegisterAnswer::Reclaiming)
                .map_err(|_| bad()),
            _ => Err(bad()),
        }
    }
}

/// A worker's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerState {
    /// Takes work; its capacity counts in its group.
    Active,
    /// Finishing what it runs before it leaves; takes no new work.
    Draining,
    /// Took itself out of rotation as an outlier (its error ratio); back after a cool-down.
    Ejected,
}

impl WorkerState {
    /// The state's word as stored and shown: `active`, `draining` or `ejected`.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerState::Active => "active",
            WorkerState::Draining => "draining",
            WorkerState::Ejected => "ejected",
        }
    }
    /// The state [`as_str`](Self::as_str) names; `None` for any other word.
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
    /// The worker id (`FLEET_WORKER_ID`), unique among live workers.
    pub id: String,
    /// A random token of this process: only the instance that registered may heartbeat or
    /// deregister under the id.
    pub instance: String,
    /// The worker's labels (its group is their label set).
    pub labels: Labels,
    /// Normal-lane slots.
    pub capacity: u32,
    /// Critical-lane slots.
    pub critical_capacity: u32,
    /// Its executor: `builtin`, `http` or `exec`.
    pub executor: String,
    /// The state it registers in.
    pub state: WorkerState,
    /// The task kinds this worker handles (routing input: see [`super::Kinds`]).
    pub kinds: super::Kinds,
}

impl Registration {
    /// The group it joins: its labels' group name ([`Labels::group_name`]).
    pub fn group(&self) -> String {
        self.labels.group_name()
    }
}

/// A worker as the API shows it.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq)]
pub struct WorkerView {
    /// The worker id.
    pub id: String,
    /// Its group name.
    pub group: String,
    /// Its labels, as a JSON object of strings.
    pub labels: serde_json::Value,
    /// Its executor: `builtin`, `http` or `exec`.
    pub executor: String,
    /// Its state word ([`WorkerState::as_str`]).
    pub state: String,
    /// The task kinds it handles: `*` (every kind) or `a,b` (see [`super::Kinds`]).
    #[serde(default = "any_kind")]
    pub kinds: String,
    /// Normal-lane slots.
    pub capacity: u32,
    /// Critical-lane slots.
    pub critical_capacity: u32,
    /// Tasks running on the worker now (normal lane): the runs `start.lua` recorded for it and
    /// `finish.lua` has not ended — the same records a group's `load` counts, read live (not
    /// the worker's last heartbeat).
    pub running: u32,
    /// The same for the critical lane.
    pub running_critical: u32,
    /// User task attempts that succeeded (health probes are not counted).
    pub succeeded: u64,
    /// User task attempts whose handler failed: `retried + dead` (one definition in every
    /// view: the attempt log's `failed` and `dead` outcomes, the worker's `/status` `failed`).
    #[serde(default)]
    pub failed: u64,
    /// User task attempts whose outcome could not be recorded (sent back to the broker) —
    /// the `failed` outcome label of `fleet_tasks_completed_total`.
    #[serde(default)]
    pub unrecorded: u64,
    /// Attempts that failed and were sent to a retry delay.
    #[serde(default)]
    pub retried: u64,
    /// Attempts that ended the task in the dead-letter queue.
    #[serde(default)]
    pub dead: u64,
    /// Attempts dropped because the deadline had passed.
    #[serde(default)]
    pub expired: u64,
    /// As of the last heartbeat (`heartbeat_at`).
    pub latency_ewma_ms: f64,
    /// As of the last heartbeat (`heartbeat_at`).
    pub cpu: f64,
    /// Milliseconds since its last heartbeat (Redis time).
    pub last_heartbeat_ms_ago: i64,
    /// When the last heartbeat was recorded (Redis time, RFC 3339 UTC): the time the sampled
    /// figures (`latency_ewma_ms`, `cpu`, clock skew) are as of.
    #[serde(default)]
    pub heartbeat_at: String,
}

fn any_kind() -> String {
    "*".to_string()
}

impl Store {
    /// Registers a worker. A live process holding the same id (one that heartbeated within
    /// `liveness`) makes this fail with a message.
    pub async fn register(&self, r: &Registration, liveness: Duration) -> Result<()> {
        self.register_with(r, liveness, false).await
    }

    /// Registers a worker; with `takeover` the previous holder of the id is known to be gone
    /// (this process holds the id's broker lock, see `Names::worker_lock_queue`) and its
    /// registration is replaced at once instead of after its heartbeat window.
    pub async fn register_with(
        &self,
        r: &Registration,
        liveness: Duration,
        takeover: bool,
    ) -> Result<()> {
        self.register_declared(r, liveness, takeover, 0).await
    }

    /// Registers a worker whose group queues were last declared at `declared_at_ms` (Redis
    /// time, ms since the epoch; 0: the caller declares no queues).
    ///
    /// # Errors
    /// [`Error::DuplicateWorker`] (a live process holds the id), [`Error::Reclaiming`] (the
    /// group is being reclaimed, or was reclaimed after `declared_at_ms`: declare the queues
    /// again and retry), Redis errors.
    pub async fn register_declared(
        &self,
        r: &Registration,
        liveness: Duration,
        takeover: bool,
        declared_at_ms: i64,
    ) -> Result<()> {
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
            .arg(millis(liveness))
            .arg(r.state.as_str())
            .arg(declared_at_ms)
            .arg(r.kinds.wire())
            .arg(r.labels.pairs());
        let answer = self.invoke::<redis::Value>(&inv).await?;
        match RegisterAnswer::parse(&answer)? {
            RegisterAnswer::Registered => Ok(()),
            RegisterAnswer::Duplicate { heartbeat_ms_ago } => Err(Error::DuplicateWorker(format!(
                "worker id `{}` is already registered by a live worker (last heartbeat \
                 {heartbeat_ms_ago} ms ago)",
                r.id
            ))),
            RegisterAnswer::Reclaiming(why) => {
                Err(Error::Reclaiming(format!("group `{}`: {why}", r.group())))
            }
        }
    }

    /// Who holds a worker id: its instance token and last heartbeat (ms); `None` when the id is
    /// not registered.
    pub async fn worker_holder(&self, id: &str) -> Result<Option<(String, i64)>> {
        let (instance, hb): (Option<String>, Option<i64>) = self
            .query(
                redis::cmd("HMGET")
                    .arg(self.names.worker(id))
                    .arg("instance")
                    .arg("hb"),
            )
            .await?;
        Ok(instance.zip(hb))
    }

    /// Sets a worker's state; `None` when the worker is unknown.
    pub async fn set_state(&self, id: &str, state: WorkerState) -> Result<Option<WorkerState>> {
        let mut inv = self.scripts.set_state.prepare_invoke();
        inv.key(self.names.prefix()).arg(id).arg(state.as_str());
        let old: Option<String> = self.invoke(&inv).await?;
        Ok(old.and_then(|s| WorkerState::parse(&s)))
    }

    /// A worker's current state, `None` when not registered.
    pub async fn worker_state(&self, id: &str) -> Result<Option<WorkerState>> {
        let s: Option<String> = self
            .query(redis::cmd("HGET").arg(self.names.worker(id)).arg("state"))
            .await?;
        Ok(s.and_then(|s| WorkerState::parse(&s)))
    }

    /// Publishes a worker's task figures (user task attempts by outcome, as totals) on its
    /// registration; `false` when this instance does not hold the registration.
    pub async fn set_outcomes(
        &self,
        id: &str,
        instance: &str,
        totals: &[(&str, u64)],
    ) -> Result<bool> {
        let mut inv = self.scripts.outcomes.prepare_invoke();
        inv.key(self.names.worker(id)).arg(id).arg(instance);
        for (outcome, n) in totals {
            inv.arg(*outcome).arg(*n);
        }
        let written: i64 = self.invoke(&inv).await?;
        Ok(written == 1)
    }

    /// Removes worker `id`'s registration (its runs released, its capacity gone from the
    /// group) when `instance` owns it; `false` when it is not registered or another
    /// instance holds the id.
    ///
    /// # Errors
    /// Redis errors.
    pub async fn deregister(&self, id: &str, instance: &str) -> Result<bool> {
        let mut inv = self.scripts.deregister.prepare_invoke();
        inv.key(self.names.prefix()).arg(id).arg(instance);
        let n: i64 = self.invoke(&inv).await?;
        Ok(n == 1)
    }

    /// All registered workers.
    pub async fn workers(&self) -> Result<Vec<WorkerView>> {
        let ids: Vec<String> = self
            .query(
                redis::cmd("ZRANGE")
                    .arg(self.names.workers())
                    .arg(0)
                    .arg(-1),
            )
            .await?;
        if ids.is_empty() {
            return Ok(vec![]);
        }
        // Each worker's hash and its running tasks (`lane|task id`, kept by start.lua and
        // finish.lua) in one pipeline: `running` is live, from the same records as a group's
        // load, not the heartbeat's copy.
        let mut p = redis::pipe();
        for id in &ids {
            p.cmd("HGETALL").arg(self.names.worker(id));
            p.cmd("SMEMBERS").arg(self.names.worker_running(id));
        }
        let raw: Vec<redis::Value> = self.pipe(&p).await?;
        let rows: Vec<(BTreeMap<String, String>, Vec<String>)> = raw
            .chunks(2)
            .map(|c| {
                (
                    redis::from_redis_value(c[0].clone()).unwrap_or_default(),
                    c.get(1)
                        .and_then(|v| redis::from_redis_value(v.clone()).ok())
                        .unwrap_or_default(),
                )
            })
            .collect();
        let now = self.clock.now_ms();
        let count = |runs: &[String], lane: &str| {
            runs.iter()
                .filter(|r| r.split_once('|').is_some_and(|(l, _)| l == lane))
                .count() as u32
        };
        let num = |m: &BTreeMap<String, String>, k: &str| {
            m.get(k).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0)
        };
        Ok(rows
            .into_iter()
            .filter(|(m, _)| m.contains_key("id"))
            .map(|(m, runs)| WorkerView {
                id: m.get("id").cloned().unwrap_or_default(),
                group: m.get("group").cloned().unwrap_or_default(),
                labels: m
                    .get("labels")
                    .and_then(|l| serde_json::from_str(l).ok())
                    .unwrap_or_default(),
                executor: m.get("executor").cloned().unwrap_or_default(),
                state: m.get("state").cloned().unwrap_or_default(),
                kinds: m.get("kinds").cloned().unwrap_or_else(any_kind),
                capacity: num(&m, "cap") as u32,
                critical_capacity: num(&m, "ccap") as u32,
                running: count(&runs, "normal"),
                running_critical: count(&runs, "critical"),
                succeeded: num(&m, "n:succeeded") as u64,
                failed: (num(&m, "n:retried") + num(&m, "n:dead")) as u64,
                unrecorded: num(&m, "n:failed") as u64,
                retried: num(&m, "n:retried") as u64,
                dead: num(&m, "n:dead") as u64,
                expired: num(&m, "n:expired") as u64,
                latency_ewma_ms: num(&m, "ewma_ms"),
                cpu: num(&m, "cpu"),
                last_heartbeat_ms_ago: now - num(&m, "hb") as i64,
                heartbeat_at: crate::status::rfc3339_ms(num(&m, "hb") as i64),
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::Value;

    fn words(items: Vec<Value>) -> Value {
        Value::Array(items)
    }

    fn text(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn register_answers_are_status_words() {
        assert_eq!(
            RegisterAnswer::parse(&words(vec![text("registered")])).unwrap(),
            RegisterAnswer::Registered
        );
        assert_eq!(
            RegisterAnswer::parse(&words(vec![text("duplicate"), Value::Int(1234)])).unwrap(),
            RegisterAnswer::Duplicate {
                heartbeat_ms_ago: 1234
            }
        );
        assert_eq!(
            RegisterAnswer::parse(&words(vec![
                text("reclaiming"),
                text("the group is being reclaimed")
            ]))
            .unwrap(),
            RegisterAnswer::Reclaiming("the group is being reclaimed".into())
        );
    }

    #[test]
    fn any_other_register_answer_is_a_bad_answer() {
        for v in [
            text("registered"),
            words(vec![]),
            words(vec![text("registered"), Value::Int(1)]),
            words(vec![text("duplicate")]),
            words(vec![text("duplicate"), text("soon")]),
            words(vec![text("reclaiming")]),
            words(vec![text("DUPLICATE"), Value::Int(1)]),
            Value::Nil,
        ] {
            assert!(
                matches!(
                    RegisterAnswer::parse(&v),
                    Err(Error::BadAnswer {
                        from: "register.lua",
                        ..
                    })
                ),
                "{v:?}"
            );
        }
    }

    /// The script's own answers, from the real Redis (127.0.0.1:6379, a random namespace):
    /// a second instance under a live id is `duplicate`, a group being reclaimed `reclaiming`.
    #[tokio::test]
    async fn register_lua_answers_in_words() {
        let ns = format!("register-words-{}", uuid::Uuid::new_v4().simple());
        let store = Store::new("redis://127.0.0.1:6379", crate::Names::new(&ns)).unwrap();
        let mut reg = Registration {
            id: "w1".into(),
            instance: "a".into(),
            labels: Labels::default(),
            capacity: 1,
            critical_capacity: 0,
            executor: "builtin".into(),
            state: WorkerState::Active,
            kinds: crate::registry::Kinds::default(),
        };
        let window = Duration::from_secs(30);
        store.register(&reg, window).await.unwrap();
        reg.instance = "b".into();
        let e = store.register(&reg, window).await.unwrap_err();
        assert!(
            matches!(&e, Error::DuplicateWorker(m) if m.contains("already registered") && m.contains("ms ago")),
            "{e}"
        );
        let mut c = store.conn().await.unwrap();
        let _: () = redis::cmd("SET")
            .arg(store.names.reclaimed(&reg.group()))
            .arg("pending")
            .arg("PX")
            .arg(60_000)
            .query_async(&mut c)
            .await
            .unwrap();
        let e = store.register_with(&reg, window, true).await.unwrap_err();
        assert!(
            matches!(&e, Error::Reclaiming(m) if m.contains("being reclaimed")),
            "{e}"
        );
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{ns}*"))
            .query_async(&mut c)
            .await
            .unwrap();
        if !keys.is_empty() {
            let _: () = redis::cmd("DEL")
                .arg(keys)
                .query_async(&mut c)
                .await
                .unwrap();
        }
    }
}
