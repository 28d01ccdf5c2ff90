//! Reads of the registry and of task statuses in Redis, and waits on them.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use deadpool_redis::redis;
use fleet::registry::{GroupView, WorkerView};
use fleet::Store;

use crate::{wait_for, wait_for_every, Ns};

/// A worker as the registry shows it, `None` when not registered.
pub async fn worker(store: &Store, id: &str) -> Option<WorkerView> {
    store.workers().await.ok()?.into_iter().find(|w| w.id == id)
}

/// A group's view, `None` when unknown.
pub async fn group(store: &Store, name: &str) -> Option<GroupView> {
    store
        .groups()
        .await
        .ok()?
        .into_iter()
        .find(|g| g.group == name)
}

/// Waits until no worker with `id` is registered; returns when that was seen.
pub async fn wait_gone(store: &Store, id: &str, timeout: Duration) -> Result<Instant> {
    wait_for(
        &format!("worker {id} gone from the registry"),
        timeout,
        || async {
            match store.workers().await {
                Ok(ws) if !ws.iter().any(|w| w.id == id) => Some(Instant::now()),
                _ => None,
            }
        },
    )
    .await
}

/// Waits until every task id has status `succeeded`; the error counts the others and names
/// three of them.
pub async fn wait_succeeded(ns: &Ns, ids: &[String], timeout: Duration) -> Result<()> {
    let (all, last) = wait_all_in(ns, ids, "succeeded", timeout).await?;
    if !all {
        let left: Vec<&String> = ids
            .iter()
            .filter(|id| last.get(*id).map(String::as_str) != Some("succeeded"))
            .collect();
        bail!(
            "{} of {} tasks not succeeded within {timeout:?}, e.g. {:?}",
            left.len(),
            ids.len(),
            &left[..left.len().min(3)]
        );
    }
    Ok(())
}

/// `state` of each id (`-` when it has no status), read in pipelined rounds of 500.
pub async fn states(ns: &Ns, ids: &[String]) -> Result<HashMap<String, String>> {
    let mut out = HashMap::with_capacity(ids.len());
    for chunk in ids.chunks(500) {
        let mut p = redis::pipe();
        for id in chunk {
            p.cmd("HGET").arg(ns.names.task(id)).arg("state");
        }
        let got: Vec<Option<String>> = ns.store.pipe(&p).await?;
        for (id, st) in chunk.iter().zip(got) {
            out.insert(id.clone(), st.unwrap_or_else(|| "-".into()));
        }
    }
    Ok(out)
}

/// How many ids are in each state.
pub fn count_states(states: &HashMap<String, String>) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for s in states.values() {
        *m.entry(s.clone()).or_default() += 1;
    }
    m
}

/// Polls the states of `ids` (every 200 ms: a check reads them all) until every one is
/// `want` or `timeout` passes; returns whether they all got there and the last states read.
pub async fn wait_all_in(
    ns: &Ns,
    ids: &[String],
    want: &str,
    timeout: Duration,
) -> Result<(bool, HashMap<String, String>)> {
    let what = format!("{} tasks {want}", ids.len());
    let r = wait_for_every(&what, timeout, Duration::from_millis(200), || async {
        let last = states(ns, ids).await.ok()?;
        last.values().all(|s| s == want).then_some(last)
    })
    .await;
    match r {
        Ok(last) => Ok((true, last)),
        Err(_) => Ok((false, states(ns, ids).await?)),
    }
}

/// A worker's group name for its labels and executor (as the worker computes it).
pub fn group_of(labels: &str, executor: &str) -> String {
    fleet::Labels::parse(labels)
        .unwrap_or_default()
        .with("protocol", executor)
        .group_name()
}

/// Registers worker `id` straight in the store, as a worker process would (instance
/// `i-<id>`, `labels`, `capacity` normal slots and 1 critical, builtin executor, active, a
/// 30 s heartbeat timeout): for tests of the Redis side alone.
pub async fn register_worker(store: &Store, id: &str, labels: &str, capacity: u32) -> Result<()> {
    register_worker_for(store, id, labels, capacity, Duration::from_secs(30)).await
}

/// [`register_worker`] with its heartbeat timeout (`timeout`: short for eviction tests). The
/// same process registering again (after an eviction) is this call again.
pub async fn register_worker_for(
    store: &Store,
    id: &str,
    labels: &str,
    capacity: u32,
    timeout: Duration,
) -> Result<()> {
    let r = fleet::registry::Registration {
        id: id.into(),
        instance: format!("i-{id}"),
        labels: fleet::Labels::parse(labels)?,
        capacity,
        critical_capacity: 1,
        executor: "builtin".into(),
        state: fleet::registry::WorkerState::Active,
        kinds: Default::default(),
    };
    store.register(&r, timeout).await?;
    Ok(())
}
