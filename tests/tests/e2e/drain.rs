//! Lame-duck drain: asked by SIGTERM, by `POST /v1/workers/{id}/drain` or by `fleetctl drain`,
//! a worker finishes the tasks it is running, starts none, deregisters and exits 0, while the
//! rest of the queue completes on its peers — each task exactly once.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use anyhow::Context;
use fleet_tests::*;
use serde_json::json;

/// Waits until `worker` runs `n` tasks at the endpoint, all started within the last 300 ms
/// (so none of them ends while the drain is being asked for); returns their ids.
async fn busy(ep: &Endpoint, worker: &str, n: usize) -> anyhow::Result<HashSet<String>> {
    wait_for(
        &format!("{worker} running {n} fresh tasks"),
        Duration::from_secs(30),
        || async {
            let running = ep.running(worker);
            let fresh = running
                .iter()
                .all(|c| c.at.elapsed() < Duration::from_millis(300));
            (running.len() == n && fresh).then(|| running.into_iter().map(|c| c.id).collect())
        },
    )
    .await
}

/// The common end of a drain: the drained worker ran exactly `in_flight` (all completed), the
/// peer ran the rest, every task once and `succeeded`.
async fn assert_drained(
    ns: &Ns,
    ep: &Endpoint,
    ids: &[String],
    drained: &str,
    in_flight: &HashSet<String>,
) -> anyhow::Result<()> {
    wait_succeeded(ns, ids, Duration::from_secs(60)).await?;
    let per = ep.per_task();
    for id in ids {
        let calls = per
            .get(id)
            .with_context(|| format!("task {id} never ran"))?;
        assert_eq!(calls.len(), 1, "task {id} ran {} times", calls.len());
        assert!(calls[0].answered.is_some());
    }
    let on_drained: HashSet<String> = ep.calls_of(drained).into_iter().map(|c| c.id).collect();
    assert_eq!(
        &on_drained, in_flight,
        "the drained worker ran exactly what it was running when asked"
    );
    for id in in_flight {
        let st = ns.status(id).await?.unwrap_or_default();
        assert_eq!(
            st.get("worker").map(String::as_str),
            Some(drained),
            "task {id} finished on {drained}: {st:?}"
        );
    }
    assert!(ns.drain_dead().await?.is_empty(), "no task dead-lettered");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_finishes_running_tasks_and_exits_0() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let ep = Endpoint::start(1000).await?;
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let mut w = WorkerProcess::start(
        &ns,
        &ProcessSpec {
            id: "w-term",
            labels: "",
            capacity: 3,
            endpoint: &ep.url,
            extra: &[],
        },
    )
    .await?;
    let cfg = ep.worker_settings();
    let peer = start_worker(&ns, "w-peer", "", 3, &cfg, &[]).await?;
    let gname = "protocol=http";
    wait_for("group capacity 6", Duration::from_secs(10), || async {
        group(&ns.store, gname).await.filter(|g| g.capacity == 6)
    })
    .await?;

    let envs = jobs(18, "", None);
    let ids: Vec<String> = envs.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ns.submit(&envs).await?, (18, 0));
    let in_flight = busy(&ep, "w-term", 3).await?;
    let asked = Instant::now();
    w.signal("TERM")?;

    // Lame duck: still registered, state draining, its capacity out of the group.
    let view = w
        .wait_state(&ns.store, "draining", Duration::from_secs(5))
        .await?;
    assert_eq!(view.capacity, 3);
    let g = group(&ns.store, gname).await.context("group")?;
    assert_eq!(
        (g.workers, g.capacity),
        (2, 3),
        "a draining worker keeps its registration, not its capacity"
    );

    let st = w.wait_exit(Duration::from_secs(20)).await?;
    println!(
        "drain: SIGTERM to exit {} ms (tasks of 1000 ms)",
        asked.elapsed().as_millis()
    );
    assert_eq!(st.code(), Some(0), "log:\n{}", w.log_tail());
    // Deregistered by the worker itself (not evicted later).
    assert!(
        worker(&ns.store, "w-term").await.is_none(),
        "deregistered at exit"
    );
    let g = group(&ns.store, gname).await.context("group")?;
    assert_eq!((g.workers, g.capacity), (1, 3));

    assert_drained(&ns, &ep, &ids, "w-term", &in_flight).await?;
    assert!(w.log_tail().contains("drained"), "log:\n{}", w.log_tail());
    peer.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn drain_through_the_scheduler_api() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let ep = Endpoint::start(1500).await?;
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let mut w = WorkerProcess::start(
        &ns,
        &ProcessSpec {
            id: "w-api",
            labels: "",
            capacity: 3,
            endpoint: &ep.url,
            extra: &[],
        },
    )
    .await?;
    let cfg = ep.worker_settings();
    let peer = start_worker(&ns, "w-peer", "", 3, &cfg, &[]).await?;
    wait_for("group capacity 6", Duration::from_secs(10), || async {
        group(&ns.store, "protocol=http")
            .await
            .filter(|g| g.capacity == 6)
    })
    .await?;

    let client = reqwest::Client::new();
    let r = client
        .post(sched.url("/v1/workers/nope/drain"))
        .json(&serde_json::json!({}))
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 404);
    let body: serde_json::Value = r.json().await?;
    assert_eq!(
        body,
        json!({"error": "unknown_worker", "detail": "no registered worker with id nope"})
    );

    let envs = jobs(18, "", None);
    let ids: Vec<String> = envs.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ns.submit(&envs).await?, (18, 0));
    // (The worker learns of the drain at its next heartbeat; tasks of 1.5 s outlast that.)
    let in_flight = busy(&ep, "w-api", 3).await?;
    let r = client
        .post(sched.url("/v1/workers/w-api/drain"))
        .json(&serde_json::json!({}))
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 202);
    let body: serde_json::Value = r.json().await?;
    assert_eq!(
        body,
        json!({"id": "w-api", "previous_state": "active", "state": "draining"})
    );
    let st = w.wait_exit(Duration::from_secs(20)).await?;
    assert_eq!(st.code(), Some(0), "log:\n{}", w.log_tail());
    assert!(
        worker(&ns.store, "w-api").await.is_none(),
        "deregistered at exit"
    );

    assert_drained(&ns, &ep, &ids, "w-api", &in_flight).await?;
    // Asking again: the worker is gone.
    let r = client
        .post(sched.url("/v1/workers/w-api/drain"))
        .json(&serde_json::json!({}))
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 404);
    peer.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fleetctl_drain() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let h = [(JOB, rec.handler())];
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let api = format!("http://{}", sched.addr);
    let w = start_worker(&ns, "w-ctl", "pool=ctl", 2, WORKER, &h).await?;
    let peer = start_worker(&ns, "w-ctl-peer", "pool=ctl", 2, WORKER, &h).await?;

    let (code, _, err) = fleetctl(&ns, &api, &["drain", "ghost"]).await?;
    assert_eq!(code, 1);
    assert!(
        err.contains("no registered worker with id ghost"),
        "stderr: {err}"
    );

    // Runs of 5 s: the drain (a fleetctl process, an API call, the worker noticing) must take
    // effect before w-ctl's first two runs end, or it would rightly start more. At 1.5 s a
    // loaded CI machine once took longer than that and the test failed.
    let envs: Vec<_> = (0..8)
        .map(|i| task(JOB, json!({"i": i, "ms": 5000}), "pool=ctl"))
        .collect();
    let ids: HashSet<String> = envs.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ns.submit(&envs).await?, (8, 0));
    let mine = |rec: &Recorder| {
        rec.runs()
            .into_iter()
            .filter(|r| r.1 == "w-ctl")
            .map(|r| r.0)
            .collect::<HashSet<String>>()
    };
    let in_flight = wait_for("w-ctl running 2", Duration::from_secs(20), || async {
        Some(mine(&rec)).filter(|m| m.len() == 2)
    })
    .await?;

    let (code, out, err) = fleetctl(&ns, &api, &["drain", "w-ctl"]).await?;
    assert_eq!(code, 0, "stderr: {err}");
    assert_eq!(out.trim(), "worker w-ctl: draining (was active)");
    // The in-process worker's `run` returns Ok: a clean drain.
    tokio::time::timeout(Duration::from_secs(20), w.join)
        .await
        .context("w-ctl did not finish draining")???;
    assert!(worker(&ns.store, "w-ctl").await.is_none(), "deregistered");

    wait_for("8 runs", Duration::from_secs(30), || async {
        (rec.count() >= 8).then_some(())
    })
    .await?;
    let per = rec.per_task();
    assert_eq!(per.keys().cloned().collect::<HashSet<_>>(), ids);
    assert!(
        per.values().all(|w| w.len() == 1),
        "each task once: {per:?}"
    );
    assert_eq!(
        mine(&rec),
        in_flight,
        "w-ctl started nothing after the drain"
    );
    peer.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// A worker and a scheduler told to stop while their broker does not answer — frozen with
/// SIGSTOP: connections stay open and nothing replies, neither `basic.cancel` nor
/// `connection.close` — still return: the worker drains and deregisters, every step that
/// waits on a server bounded (worker/src/drain.rs `STEP_LIMIT`), and the scheduler's session
/// stop and connection close are bounded too. A private node: the test freezes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_and_scheduler_stop_while_their_broker_is_frozen() -> anyhow::Result<()> {
    let rabbit = PrivateRabbit::start("", "[].\n").await?;
    let ns = Ns::on_broker(&rabbit.url()).await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let w = start_worker(&ns, "w-frozen", "pool=frozen", 2, &[], &[]).await?;
    wait_for("w-frozen registered", Duration::from_secs(15), || async {
        ns.store
            .workers()
            .await
            .ok()?
            .iter()
            .any(|w| w.id == "w-frozen")
            .then_some(())
    })
    .await?;

    rabbit.signal_group("STOP")?;
    let asked = Instant::now();
    let worker = tokio::time::timeout(Duration::from_secs(40), w.stop()).await;
    let worker_took = asked.elapsed();
    let asked = Instant::now();
    let scheduler = tokio::time::timeout(Duration::from_secs(40), sched.stop()).await;
    let scheduler_took = asked.elapsed();
    rabbit.signal_group("CONT")?;
    println!(
        "with a frozen broker: the worker returned after {} ms, the scheduler after {} ms",
        worker_took.as_millis(),
        scheduler_took.as_millis()
    );
    worker.context("the worker did not return within 40 s")??;
    scheduler.context("the scheduler did not return within 40 s")??;
    // The worker waits on its cancels (2 s, both lanes at once) and its connection close (5 s);
    // the scheduler on its session's loops (at most 10 s) and its connection close (5 s).
    assert!(
        worker_took < Duration::from_secs(20),
        "worker drain took {worker_took:?}"
    );
    assert!(
        scheduler_took < Duration::from_secs(20),
        "scheduler stop took {scheduler_took:?}"
    );
    let left = ns.store.workers().await?;
    assert!(
        left.iter().all(|w| w.id != "w-frozen"),
        "still registered: {:?}",
        left.iter().map(|w| &w.id).collect::<Vec<_>>()
    );
    ns.cleanup().await
}
