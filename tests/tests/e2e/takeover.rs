//! Worker crashes and the truth of statuses (issue 10 §5a, §10): a worker killed mid-task with
//! no replacement leaves its task `queued` with no worker once evicted; a worker killed with
//! kill -9 and restarted with the same id takes work again within 5 s, although its
//! predecessor's heartbeat window is 30 s.

use std::time::{Duration, Instant};

use fleet_tests::*;

/// Issue 10 §5a: a worker running a 20 s task is killed and not replaced; once it is evicted
/// (within one heartbeat window) the task's status is `queued` and names no worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn evicted_workers_task_is_queued_again() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let ep = Endpoint::start(20_000).await?;
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let mut victim = WorkerProcess::start(
        &ns,
        &ProcessSpec {
            id: "w-victim",
            labels: "",
            capacity: 1,
            endpoint: &ep.url,
            extra: &[],
        },
    )
    .await?;
    let envs = jobs(1, "", None);
    let id = envs[0].id.clone();
    assert_eq!(ns.submit(&envs).await?, (1, 0));
    wait_for(
        "the 20 s task running on the victim",
        Duration::from_secs(20),
        || async { (ep.running("w-victim").len() == 1).then_some(()) },
    )
    .await?;
    let st = ns
        .wait_state(&id, "running", Duration::from_secs(10))
        .await?;
    assert_eq!(st.get("worker").map(String::as_str), Some("w-victim"));

    let killed = Instant::now();
    victim.kill9()?;
    ep.mark_dead("w-victim");
    let gone = wait_gone(&ns.store, "w-victim", Duration::from_secs(15)).await?;
    // True within one heartbeat window of the eviction.
    let st = ns
        .wait_state(&id, "queued", Duration::from_millis(HEARTBEAT_TIMEOUT_MS))
        .await?;
    assert!(
        !st.contains_key("worker"),
        "a queued task names no worker: {st:?}"
    );
    println!(
        "eviction: evicted {} ms after the kill; status queued (no worker) {} ms after the eviction",
        (gone - killed).as_millis(),
        gone.elapsed().as_millis()
    );
    assert_eq!(ep.calls().len(), 1, "no replacement, no second run");
    sched.stop().await?;
    ns.cleanup().await
}

/// Issue 10 §10: kill -9 a worker and restart it with the same `FLEET_WORKER_ID`: it runs
/// tasks again within 5 s of the restart, with a 30 s heartbeat window.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn restarted_worker_takes_over_within_5_s() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let ep = Endpoint::start(50).await?;
    let slow: &[(&str, &str)] = &[
        ("heartbeat_timeout_ms", "30000"),
        ("health_interval_ms", "300"),
        ("probe_interval_ms", "600000"),
    ];
    let sched = start_scheduler(&ns, slow).await?;
    let spec = ProcessSpec {
        id: "w-t",
        labels: "",
        capacity: 2,
        endpoint: &ep.url,
        extra: &[("heartbeat_timeout_ms", "30000")],
    };
    let mut first = WorkerProcess::start(&ns, &spec).await?;
    let warm = jobs(2, "", None);
    let warm_ids: Vec<String> = warm.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ns.submit(&warm).await?, (2, 0));
    wait_succeeded(&ns, &warm_ids, Duration::from_secs(20)).await?;

    first.kill9()?;
    let restarted = Instant::now();
    let mut second = WorkerProcess::spawn(&ns, &spec)?;
    let envs = jobs(5, "", None);
    let ids: Vec<String> = envs.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ns.submit(&envs).await?, (5, 0));
    let first_run = wait_for(
        "a task run by the restarted worker",
        Duration::from_secs(30),
        || async {
            ep.calls()
                .iter()
                .filter(|c| ids.contains(&c.id))
                .map(|c| c.at)
                .min()
        },
    )
    .await?;
    let took = first_run.saturating_duration_since(restarted);
    wait_succeeded(&ns, &ids, Duration::from_secs(30)).await?;
    second
        .wait_state(&ns.store, "active", Duration::from_secs(5))
        .await?;
    println!(
        "takeover: restarted worker ran its first task {} ms after the restart",
        took.as_millis()
    );
    assert!(
        took <= Duration::from_secs(5),
        "takeover took {took:?}; log:\n{}",
        second.log_tail()
    );
    let per = ep.per_task();
    for id in &ids {
        assert_eq!(per.get(id).map(Vec::len), Some(1), "task {id} ran once");
    }
    second.signal("TERM")?;
    second.wait_exit(Duration::from_secs(30)).await?;
    sched.stop().await?;
    ns.cleanup().await
}
