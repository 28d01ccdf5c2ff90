//! The last worker of a group leaves while the group's queue holds tasks. None is lost: the
//! health checker reroutes them to another group whose labels satisfy them
//! (`fleet_tasks_rerouted_total`), or, when no other group matches, they wait in the queue
//! until a worker of the group returns.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use anyhow::Context;
use fleet::Lane;
use fleet_tests::*;
use serde_json::json;

/// Tests that reroute take turns: `fleet_tasks_rerouted_total` is one counter per process.
static REROUTING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn drained_groups_tasks_are_rerouted_to_a_matching_group() -> anyhow::Result<()> {
    let _turn = REROUTING.lock().await;
    own_process!();
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let h = [(JOB, rec.handler())];
    // A large backlog factor puts every task in group a's queue (none parked).
    let mut sched_cfg = SCHEDULER.to_vec();
    sched_cfg.push(("backlog_factor", "20"));
    let sched = start_scheduler(&ns, &sched_cfg).await?;
    let a = start_worker(&ns, "w-a", "pool=a,tier=x", 2, WORKER, &h).await?;
    let (ga, gb) = (
        "pool=a,protocol=builtin,tier=x",
        "pool=b,protocol=builtin,tier=x",
    );

    let envs: Vec<_> = (0..16)
        .map(|i| task(JOB, json!({"i": i, "ms": 400}), "tier=x"))
        .collect();
    let ids: HashSet<String> = envs.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ns.submit(&envs).await?, (16, 0));
    let qa = ns.names.group_queue(ga, Lane::Normal);
    wait_for(
        "14 tasks queued for group a",
        Duration::from_secs(20),
        || async { (ns.depth(&qa).await == 14).then_some(()) },
    )
    .await?;

    // Another group that satisfies the selector, then group a's only worker drains.
    let b = start_worker(&ns, "w-b", "pool=b,tier=x", 4, WORKER, &h).await?;
    let metrics_url = sched.url("/metrics");
    let rerouted_before = metric(&metrics_url, "fleet_tasks_rerouted_total", &[]).await?;
    let stopped = Instant::now();
    a.stop().await?;
    assert!(worker(&ns.store, "w-a").await.is_none());
    let g = group(&ns.store, ga).await.context("group a")?;
    assert_eq!((g.workers, g.capacity), (0, 0));

    wait_succeeded(
        &ns,
        &envs.iter().map(|e| e.id.clone()).collect::<Vec<_>>(),
        Duration::from_secs(30),
    )
    .await?;
    println!(
        "orphans: group a emptied {} ms after its worker started draining",
        stopped.elapsed().as_millis()
    );
    let per = rec.per_task();
    assert_eq!(per.keys().cloned().collect::<HashSet<_>>(), ids);
    assert!(per.values().all(|w| w.len() == 1), "each task once");
    let on_a = per.values().filter(|w| w[0] == "w-a").count();
    let on_b = per.values().filter(|w| w[0] == "w-b").count();
    assert_eq!(on_a + on_b, 16);
    assert!(
        on_b >= 10,
        "most tasks were still queued for group a: on_b = {on_b}"
    );
    let rerouted = metric(&metrics_url, "fleet_tasks_rerouted_total", &[]).await? - rerouted_before;
    assert_eq!(
        rerouted as usize, on_b,
        "every task that ran on b was rerouted there, and only those"
    );
    for (id, w) in &per {
        let st = ns.status(id).await?.unwrap_or_default();
        assert_eq!(st.get("state").map(String::as_str), Some("succeeded"));
        let want_group = if w[0] == "w-b" { gb } else { ga };
        assert_eq!(
            st.get("group").map(String::as_str),
            Some(want_group),
            "task {id}: {st:?}"
        );
    }
    assert_eq!(ns.depth(&qa).await, 0);
    assert!(ns.drain_dead().await?.is_empty(), "none dead-lettered");

    b.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// On quorum queues (the default type), which dead-letter a message redelivered more than
/// `DELIVERY_LIMIT` times, and beside a live group the tasks do not match: the health checker
/// looks at the orphans every tick for longer than that limit, and still none dies.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_groups_tasks_wait_for_a_worker_of_the_group() -> anyhow::Result<()> {
    let ns = Ns::with_queue_type("quorum").await?;
    let ep = Endpoint::start(300).await?;
    let health_ms: u64 = 100;
    let health = health_ms.to_string();
    let mut sched_cfg = SCHEDULER.to_vec();
    sched_cfg.extend_from_slice(&[
        ("backlog_factor", "20"),
        ("health_interval_ms", health.as_str()),
    ]);
    let sched = start_scheduler(&ns, &sched_cfg).await?;
    let mut solo = WorkerProcess::start(
        &ns,
        &ProcessSpec {
            id: "w-solo",
            labels: "pool=solo",
            capacity: 2,
            endpoint: &ep.url,
            extra: &[],
        },
    )
    .await?;
    let cfg = ep.worker_settings();
    let other = start_worker(&ns, "w-other", "pool=other", 2, &cfg, &[]).await?;
    let gname = "pool=solo,protocol=http";
    let q = ns.names.group_queue(gname, Lane::Normal);

    let envs = jobs(10, "pool=solo", None);
    let ids: Vec<String> = envs.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ns.submit(&envs).await?, (10, 0));
    wait_for("w-solo mid-flight", Duration::from_secs(30), || async {
        let done = ep
            .calls_of("w-solo")
            .iter()
            .filter(|c| c.answered.is_some())
            .count();
        (done >= 2 && ep.running("w-solo").len() == 2).then_some(())
    })
    .await?;
    let killed_at = Instant::now();
    solo.kill9()?;
    ep.mark_dead("w-solo");
    let done_before: HashSet<String> = ep
        .calls()
        .into_iter()
        .filter(|c| c.answered.is_some_and(|a| a <= killed_at))
        .map(|c| c.id)
        .collect();
    wait_gone(&ns.store, "w-solo", Duration::from_secs(15)).await?;
    let g = group(&ns.store, gname).await.context("group")?;
    assert_eq!((g.workers, g.capacity), (0, 0));

    // No worker and no matching group: the tasks wait in the group queue through more health
    // ticks than the delivery limit, none run, none dead-lettered.
    let calls = ep.calls().len();
    // A tick takes its interval plus its own work; allow 100 ms for that.
    let ticks = fleet::broker::topology::DELIVERY_LIMIT as u64 + 10;
    let highest = std::sync::atomic::AtomicU32::new(0);
    always_for(
        "the orphaned queue keeps its tasks",
        Duration::from_millis(ticks * (health_ms + 100)),
        Duration::from_millis(50),
        || async {
            // (one task may be in the health checker's hands for a moment)
            let d = ns.depth(&q).await;
            let most = highest
                .fetch_max(d, std::sync::atomic::Ordering::Relaxed)
                .max(d);
            anyhow::ensure!(d + 1 >= most, "the orphaned queue went from {most} to {d}");
            anyhow::Ok(())
        },
    )
    .await?;
    let most = highest.into_inner();
    assert!(
        most as usize >= 10 - done_before.len(),
        "queued {most}, done {}",
        done_before.len()
    );
    assert_eq!(
        ep.calls().len(),
        calls,
        "nothing ran without a worker of the group"
    );
    let dead = ns.drain_dead().await?;
    assert!(
        dead.is_empty(),
        "{} task(s) dead-lettered while waiting for their group",
        dead.len()
    );

    // A worker of the group returns: everything completes.
    let back = start_worker(&ns, "w-solo-2", "pool=solo", 2, &cfg, &[]).await?;
    wait_settled(&ns, &ep, &ids, &q, Duration::from_secs(30)).await?;
    let per = ep.per_task();
    let redone: Vec<String> = ids
        .iter()
        .filter(|id| per[*id].last().is_some_and(|c| c.worker == "w-solo-2"))
        .cloned()
        .collect();
    assert!(
        redone.len() >= 10 - done_before.len(),
        "the returned worker ran what waited"
    );
    wait_succeeded(&ns, &redone, Duration::from_secs(10)).await?;
    for id in &ids {
        let calls = per
            .get(id)
            .with_context(|| format!("task {id} never ran"))?;
        assert!(calls.len() <= 2, "task {id} ran {} times", calls.len());
        assert!(
            calls.iter().all(|c| c.worker.starts_with("w-solo")),
            "task {id} ran outside its group: {calls:?}"
        );
        if calls.len() == 2 {
            assert!(
                calls[0].worker == "w-solo" && calls[0].at <= killed_at,
                "only a task in flight at the kill runs twice: {calls:?}"
            );
        }
    }
    let twice = per.values().filter(|c| c.len() == 2).count();
    assert!(
        twice <= 2,
        "at most the killed worker's capacity ran twice: {twice}"
    );
    assert_eq!(ns.depth(&q).await, 0);
    assert!(ns.drain_dead().await?.is_empty(), "none dead-lettered");

    back.stop().await?;
    other.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// A full group's waiting tasks (queued, or parked behind parked ones). Its last worker drains
/// while no other group matches: they all wait; a matching group appears: they go there.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queued_and_parked_tasks_wait_then_move_to_a_new_matching_group() -> anyhow::Result<()> {
    let _turn = REROUTING.lock().await;
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let h = [(JOB, rec.handler())];
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let a = start_worker(&ns, "w-a", "pool=a,tier=y", 1, WORKER, &h).await?;
    let qa = ns
        .names
        .group_queue("pool=a,protocol=builtin,tier=y", Lane::Normal);

    let envs: Vec<_> = (0..10)
        .map(|i| task(JOB, json!({"i": i, "ms": 500}), "tier=y"))
        .collect();
    let ids: Vec<String> = envs.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ns.submit(&envs).await?, (10, 0));
    // Capacity 1: one runs, the other nine wait for it. The group is their only candidate, so
    // they go straight to its queue (direct dispatch, no park hop) — except behind tasks that
    // already park for it, which keep their place in line in the park queue. Either way they
    // wait in the group's own queues.
    let pa = ns
        .names
        .park_queue("pool=a,protocol=builtin,tier=y", Lane::Normal);
    wait_for(
        "one running, nine waiting in the group's queues",
        Duration::from_secs(20),
        || async {
            (rec.count() == 1 && ns.depth(&qa).await + ns.depth(&pa).await == 9).then_some(())
        },
    )
    .await?;
    let last = wait_for(
        "the last task's status",
        Duration::from_secs(10),
        || async { ns.status(&ids[9]).await.ok()? },
    )
    .await?;
    assert!(
        matches!(
            last.get("state").map(String::as_str),
            Some("queued" | "parked")
        ),
        "{last:?}"
    );
    a.stop().await?;
    let ran_on_a = rec.count();

    // Nowhere to go: everything waits.
    always_for(
        "nothing runs without a matching worker",
        Duration::from_millis(5 * HEALTH_MS),
        Duration::from_millis(50),
        || async {
            anyhow::ensure!(
                rec.count() == ran_on_a,
                "nothing runs without a matching worker: {} ran, {ran_on_a} before",
                rec.count()
            );
            anyhow::Ok(())
        },
    )
    .await?;
    assert!(ns.depth(&qa).await >= 1, "the queued task is still queued");
    assert!(
        ns.drain_dead().await?.is_empty(),
        "nothing dead-lettered while waiting"
    );

    // A matching group registers: queued and parked tasks all run there, each once.
    let b = start_worker(&ns, "w-b", "pool=b,tier=y", 4, WORKER, &h).await?;
    wait_succeeded(&ns, &ids, Duration::from_secs(30)).await?;
    let per = rec.per_task();
    assert_eq!(per.len(), 10);
    assert!(
        per.values().all(|w| w.len() == 1),
        "each task once: {per:?}"
    );
    assert_eq!(
        per.values().filter(|w| w[0] == "w-b").count(),
        10 - ran_on_a
    );
    assert_eq!(ns.depth(&qa).await, 0);
    assert!(ns.drain_dead().await?.is_empty(), "none dead-lettered");

    b.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
