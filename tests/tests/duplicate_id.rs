//! A second worker started with the id of a live one refuses to start, with a message that
//! says why, and leaves the live one alone; once the first has gone, the id is free again.

mod harness;

use std::time::Duration;

use anyhow::Context;
use deadpool_redis::redis;
use fleet_tests::*;
use harness::*;
use serde_json::json;

async fn instance(ns: &Ns, id: &str) -> anyhow::Result<Option<String>> {
    Ok(ns.store.query(redis::cmd("HGET").arg(ns.names.worker(id)).arg("instance")).await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicate_live_worker_id_refuses_to_start() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let ep = Endpoint::start(50).await?;
    let rec = Recorder::default();
    let h = [(JOB, rec.handler())];
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let first = start_worker(&ns, "w-dup", "pool=d", 2, WORKER, &h).await?;
    let owner = instance(&ns, "w-dup").await?.context("w-dup registered")?;

    // As a process: exit code 1 and a message naming the id and the cause.
    let mut second = WorkerProcess::spawn(&ns, &ProcessSpec { id: "w-dup", labels: "pool=d", capacity: 2, endpoint: &ep.url, extra: &[] })?;
    let st = second.wait_exit(Duration::from_secs(20)).await?;
    assert_eq!(st.code(), Some(1), "log:\n{}", second.log_tail());
    let log = std::fs::read_to_string(&second.log)?;
    let msg = log.lines().find(|l| l.starts_with("fleet-worker: ")).with_context(|| format!("no error line in:\n{log}"))?;
    println!("duplicate id: {msg}");
    assert!(msg.contains("worker id `w-dup` is already registered by a live worker"), "{msg}");
    assert!(msg.contains("FLEET_WORKER_ID"), "the message says what to change: {msg}");

    // In-process: the same refusal.
    let err = match start_worker(&ns, "w-dup", "pool=d", 2, WORKER, &h).await {
        Ok(_) => anyhow::bail!("a second in-process w-dup started"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("already registered by a live worker"), "{err}");

    // The live worker is untouched: same registration, still working.
    assert_eq!(instance(&ns, "w-dup").await?.as_deref(), Some(owner.as_str()));
    let w = worker(&ns.store, "w-dup").await.context("w-dup")?;
    assert_eq!((w.state.as_str(), w.capacity), ("active", 2));
    let t = task(JOB, json!({}), "pool=d");
    ns.submit(std::slice::from_ref(&t)).await?;
    wait_for("task on the live w-dup", Duration::from_secs(20), || async { rec.per_task().get(&t.id).cloned() }).await?;
    assert_eq!(rec.per_task()[&t.id], vec!["w-dup".to_string()]);
    assert_eq!(group(&ns.store, "pool=d,protocol=builtin").await.map(|g| (g.workers, g.capacity)), Some((1, 2)));

    // Once the first has drained and deregistered, the id may be used again.
    first.stop().await?;
    let mut third = WorkerProcess::spawn(&ns, &ProcessSpec { id: "w-dup", labels: "pool=d", capacity: 2, endpoint: &ep.url, extra: &[] })?;
    let w = third.wait_state(&ns.store, "active", Duration::from_secs(20)).await?;
    assert_eq!(w.executor, "http");
    assert_ne!(instance(&ns, "w-dup").await?.as_deref(), Some(owner.as_str()));
    third.signal("TERM")?;
    assert_eq!(third.wait_exit(Duration::from_secs(20)).await?.code(), Some(0));

    sched.stop().await?;
    ns.cleanup().await
}
