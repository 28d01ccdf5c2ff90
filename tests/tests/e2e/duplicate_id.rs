//! A second worker started with the id of a live one refuses to start, with a message that
//! says why, and leaves the live one alone; once the first has gone, the id is free again. A
//! worker restarted with its id right after a crash takes over its silent predecessor's
//! registration once the liveness window has passed, instead of being refused.

use std::time::{Duration, Instant};

use anyhow::Context;
use deadpool_redis::redis;
use fleet_tests::*;
use serde_json::json;

async fn instance(ns: &Ns, id: &str) -> anyhow::Result<Option<String>> {
    Ok(ns
        .store
        .query(redis::cmd("HGET").arg(ns.names.worker(id)).arg("instance"))
        .await?)
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
    let mut second = WorkerProcess::spawn(
        &ns,
        &ProcessSpec {
            id: "w-dup",
            labels: "pool=d",
            capacity: 2,
            endpoint: &ep.url,
            extra: &[],
        },
    )?;
    let spawned = Instant::now();
    let st = second.wait_exit(Duration::from_secs(20)).await?;
    println!(
        "duplicate id: refused {} ms after start",
        spawned.elapsed().as_millis()
    );
    assert_eq!(st.code(), Some(1), "log:\n{}", second.log_tail());
    let log = std::fs::read_to_string(&second.log)?;
    let msg = log
        .lines()
        .find(|l| l.starts_with("fleet-worker: "))
        .with_context(|| format!("no error line in:\n{log}"))?;
    println!("duplicate id: {msg}");
    assert!(
        msg.contains("worker id `w-dup` is already registered by a live worker"),
        "{msg}"
    );
    assert!(
        msg.contains("FLEET_WORKER_ID"),
        "the message says what to change: {msg}"
    );

    // In-process: the same refusal.
    let err = match start_worker(&ns, "w-dup", "pool=d", 2, WORKER, &h).await {
        Ok(_) => anyhow::bail!("a second in-process w-dup started"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("already registered by a live worker"), "{err}");

    // The live worker is untouched: same registration, still working.
    assert_eq!(
        instance(&ns, "w-dup").await?.as_deref(),
        Some(owner.as_str())
    );
    let w = worker(&ns.store, "w-dup").await.context("w-dup")?;
    assert_eq!((w.state.as_str(), w.capacity), ("active", 2));
    let t = task(JOB, json!({}), "pool=d");
    ns.submit(std::slice::from_ref(&t)).await?;
    wait_for(
        "task on the live w-dup",
        Duration::from_secs(20),
        || async { rec.per_task().get(&t.id).cloned() },
    )
    .await?;
    assert_eq!(rec.per_task()[&t.id], vec!["w-dup".to_string()]);
    assert_eq!(
        group(&ns.store, "pool=d,protocol=builtin")
            .await
            .map(|g| (g.workers, g.capacity)),
        Some((1, 2))
    );

    // Once the first has drained and deregistered, the id may be used again.
    first.stop().await?;
    let mut third = WorkerProcess::spawn(
        &ns,
        &ProcessSpec {
            id: "w-dup",
            labels: "pool=d",
            capacity: 2,
            endpoint: &ep.url,
            extra: &[],
        },
    )?;
    let w = third
        .wait_state(&ns.store, "active", Duration::from_secs(20))
        .await?;
    assert_eq!(w.executor, "http");
    assert_ne!(
        instance(&ns, "w-dup").await?.as_deref(),
        Some(owner.as_str())
    );
    third.signal("TERM")?;
    assert_eq!(
        third.wait_exit(Duration::from_secs(20)).await?.code(),
        Some(0)
    );

    sched.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn worker_restarted_after_a_crash_takes_over_its_id() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let ep = Endpoint::start(50).await?;
    // A scheduler that does not evict within the test: only the registration's silence
    // frees the id.
    let mut sched_cfg = SCHEDULER.to_vec();
    sched_cfg.push(("heartbeat_timeout_ms", "60000"));
    let sched = start_scheduler(&ns, &sched_cfg).await?;
    let spec = ProcessSpec {
        id: "w-phoenix",
        labels: "pool=p",
        capacity: 2,
        endpoint: &ep.url,
        extra: &[],
    };
    let mut first = WorkerProcess::start(&ns, &spec).await?;
    let old = instance(&ns, "w-phoenix").await?.context("registered")?;
    first.kill9()?;
    let (_, last_hb) = ns
        .store
        .worker_holder("w-phoenix")
        .await?
        .context("still registered")?;

    let mut second = WorkerProcess::spawn(&ns, &spec)?;
    let took_over = wait_for(
        "the restarted w-phoenix registered",
        Duration::from_secs(15),
        || async {
            let now = instance(&ns, "w-phoenix").await.ok()??;
            (now != old).then(fleet::redis::now_ms)
        },
    )
    .await?;
    let silence = took_over - last_hb;
    println!("duplicate id: restarted worker took over {silence} ms after its predecessor's last heartbeat (window {HEARTBEAT_TIMEOUT_MS} ms)");
    // The predecessor's broker connection died with it, so its id lock (an exclusive queue) is
    // free: the restart takes over at once instead of waiting out the heartbeat window.
    assert!(
        silence < 5000,
        "took over {silence} ms after the last heartbeat (must be within 5 s)"
    );
    assert!(
        second.child.try_wait()?.is_none(),
        "the restarted worker is running; log:\n{}",
        second.log_tail()
    );
    let w = second
        .wait_state(&ns.store, "active", Duration::from_secs(5))
        .await?;
    assert_eq!(w.capacity, 2);
    let g = group(&ns.store, "pool=p,protocol=http")
        .await
        .context("group")?;
    assert_eq!(
        (g.workers, g.capacity),
        (1, 2),
        "the predecessor's capacity is not counted twice"
    );

    let t = jobs(1, "pool=p", None);
    ns.submit(&t).await?;
    wait_succeeded(&ns, &[t[0].id.clone()], Duration::from_secs(20)).await?;
    assert_eq!(ep.calls_of("w-phoenix").len(), 1);

    second.signal("TERM")?;
    assert_eq!(
        second.wait_exit(Duration::from_secs(20)).await?.code(),
        Some(0)
    );
    sched.stop().await?;
    ns.cleanup().await
}
