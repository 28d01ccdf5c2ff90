//! Helpers shared by the task-lifecycle tests (retry, dead letters, deadlines, executors,
//! status, panics): reading dead letters with all their headers, task status polling, metric
//! pages, running `fleetctl`, and a gate that holds a handler until the test lets it go.
//!
//! Each test file includes this with `mod lifecycle;` and uses what it needs.
#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use fleet::Envelope;
use fleet_tests::*;
use lapin::options::{BasicAckOptions, BasicGetOptions};
use lapin::types::AMQPValue;
use tokio::sync::Semaphore;

/// Worker setting that turns outlier ejection off. Tests that fail many tasks on purpose
/// use it: with every attempt failing, a worker would otherwise take itself out of rotation
/// (see `worker/src/eject.rs`) and the retries would find no worker.
pub const NO_EJECT: (&str, &str) = ("eject_error_ratio", "1");

/// One message of `<ns>.dead`: its envelope and every header as text.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    pub env: Envelope,
    pub headers: BTreeMap<String, String>,
}

impl DeadLetter {
    pub fn header(&self, k: &str) -> Option<&str> {
        self.headers.get(k).map(String::as_str)
    }
}

fn to_dead_letter(d: &lapin::message::Delivery) -> Result<DeadLetter> {
    let env = Envelope::from_slice(&d.data, usize::MAX).map_err(|r| anyhow::anyhow!("dead letter is not an envelope: {r}"))?;
    let mut headers = BTreeMap::new();
    if let Some(h) = d.properties.headers().as_ref() {
        for (k, v) in h.inner() {
            let v = match v {
                AMQPValue::LongString(s) => s.to_string(),
                AMQPValue::ShortString(s) => s.to_string(),
                other => format!("{other:?}"),
            };
            headers.insert(k.to_string(), v);
        }
    }
    Ok(DeadLetter { env, headers })
}

/// Every dead letter, left in the queue (read unacked, then the channel is closed so the
/// broker puts them back).
pub async fn peek_dead(ns: &Ns) -> Result<Vec<DeadLetter>> {
    let ch = ns.conn.create_channel().await?;
    let mut out = Vec::new();
    while let Some(m) = ch.basic_get(ns.names.dead_queue().as_str().into(), BasicGetOptions { no_ack: false }).await? {
        out.push(to_dead_letter(&m.delivery)?);
    }
    ch.close(200, "peeked".into()).await?;
    Ok(out)
}

/// Takes every dead letter out of the queue.
pub async fn take_dead(ns: &Ns) -> Result<Vec<DeadLetter>> {
    let ch = ns.conn.create_channel().await?;
    let mut out = Vec::new();
    while let Some(m) = ch.basic_get(ns.names.dead_queue().as_str().into(), BasicGetOptions { no_ack: false }).await? {
        out.push(to_dead_letter(&m.delivery)?);
        m.delivery.acker.ack(BasicAckOptions::default()).await?;
    }
    ch.close(200, "taken".into()).await?;
    Ok(out)
}

/// Waits until the dead queue holds exactly `n` messages, then returns them (left in place).
pub async fn wait_dead(ns: &Ns, n: usize, timeout: Duration) -> Result<Vec<DeadLetter>> {
    let queue = ns.names.dead_queue();
    wait_for(&format!("{n} dead letter(s)"), timeout, || {
        let queue = queue.clone();
        async move { (ns.depth(&queue).await as usize >= n).then_some(()) }
    })
    .await?;
    let d = peek_dead(ns).await?;
    if d.len() != n {
        bail!("expected {n} dead letters, found {}: {:?}", d.len(), d.iter().map(|d| &d.env.id).collect::<Vec<_>>());
    }
    Ok(d)
}

/// A task's status field.
pub async fn state_of(ns: &Ns, id: &str) -> Option<String> {
    ns.status(id).await.ok().flatten().and_then(|s| s.get("state").cloned())
}

/// Waits until a task's status is `state`; returns every status field then.
pub async fn wait_state(ns: &Ns, id: &str, state: &str, timeout: Duration) -> Result<BTreeMap<String, String>> {
    let r = wait_for(&format!("task {id} to be {state}"), timeout, || async move {
        let s = ns.status(id).await.ok().flatten()?;
        (s.get("state").map(String::as_str) == Some(state)).then_some(s)
    })
    .await;
    match r {
        Ok(s) => Ok(s),
        Err(e) => {
            let last = ns.status(id).await.ok().flatten();
            Err(e.context(format!("last status of {id}: {last:?}")))
        }
    }
}

/// The Prometheus page of a scheduler or worker (`http://addr`).
pub async fn metrics_page(base: &str) -> Result<String> {
    Ok(reqwest::get(format!("{base}/metrics")).await?.error_for_status()?.text().await?)
}

/// `fleet_tasks_completed_total` of one group's normal lane and outcome, in this process.
pub async fn completed(base: &str, group: &str, outcome: &str) -> Result<u64> {
    let page = metrics_page(base).await?;
    Ok(metric_sum(&page, "fleet_tasks_completed_total", &[("group", group), ("lane", "normal"), ("outcome", outcome)]) as u64)
}

/// Waits until `completed(base, group, outcome)` reaches `n` (counters are bumped just after
/// the status is written), then returns its value, so callers can assert it is exactly `n`.
pub async fn completed_at_least(base: &str, group: &str, outcome: &str, n: u64) -> Result<u64> {
    let _ = wait_for(&format!("{n} {outcome} in {group}"), Duration::from_secs(10), || async move {
        completed(base, group, outcome).await.ok().filter(|v| *v >= n)
    })
    .await;
    completed(base, group, outcome).await
}

/// Runs `fleetctl` against this namespace and API; returns (exit code, stdout, stderr).
pub async fn fleetctl(ns: &Ns, api: &str, args: &[&str]) -> Result<(i32, String, String)> {
    let bin = bin_path("fleetctl")?;
    let run = tokio::process::Command::new(&bin)
        .args(args)
        .env("FLEET_AMQP_URL", amqp_url())
        .env("FLEET_REDIS_URL", redis_url())
        .env("FLEET_NAMESPACE", &ns.name)
        .env("FLEET_API_URL", api)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .with_context(|| format!("fleetctl {args:?} did not finish within 60 s"))??;
    let code = out.status.code().unwrap_or(-1);
    Ok((code, String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned()))
}

/// Holds gated handler runs until the test opens the gate of their task, one run per opening.
#[derive(Clone, Default)]
pub struct Gate {
    inner: Arc<Mutex<HashMap<String, Arc<Semaphore>>>>,
}

impl Gate {
    fn sem(&self, id: &str) -> Arc<Semaphore> {
        let mut m = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        m.entry(id.to_string()).or_insert_with(|| Arc::new(Semaphore::new(0))).clone()
    }

    /// Waits until the test lets one run of task `id` through.
    pub async fn pass(&self, id: &str) {
        if let Ok(p) = self.sem(id).acquire().await {
            p.forget();
        }
    }

    /// Lets one run of task `id` through.
    pub fn open(&self, id: &str) {
        self.sem(id).add_permits(1);
    }
}

/// Every non-probe `(task id, attempt)` a handler saw, in order, with when.
#[derive(Clone, Default)]
pub struct Attempts {
    inner: Arc<Mutex<Vec<(String, u32, std::time::Instant)>>>,
}

impl Attempts {
    pub fn record(&self, id: &str, attempt: u32) {
        if let Ok(mut v) = self.inner.lock() {
            v.push((id.to_string(), attempt, std::time::Instant::now()));
        }
    }

    pub fn all(&self) -> Vec<(String, u32, std::time::Instant)> {
        self.inner.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// The attempt numbers seen for a task, in order.
    pub fn of(&self, id: &str) -> Vec<u32> {
        self.all().into_iter().filter(|(t, _, _)| t == id).map(|(_, a, _)| a).collect()
    }

    pub fn count(&self) -> usize {
        self.inner.lock().map(|v| v.len()).unwrap_or(0)
    }
}

/// A worker's group name for its labels and executor (as the worker computes it).
pub fn group_of(labels: &str, executor: &str) -> String {
    fleet::Labels::parse(labels).unwrap_or_default().with("protocol", executor).group_name()
}

/// The API base of a scheduler (`http://addr`).
pub fn base(s: &SchedulerHandle) -> String {
    format!("http://{}", s.addr)
}
