//! Eviction of silent workers: a worker process frozen with SIGSTOP is evicted by the health
//! checker within the heartbeat timeout plus one tick (never before the timeout), its capacity
//! leaves its group and `fleet_worker_evictions_total` counts it; resumed with SIGCONT it finds
//! its registration gone and registers again, and no task it held is lost. Eviction releases
//! only the evicted worker's own running records.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;

use fleet::redis::now_ms;
use fleet::registry::{Beat, Registration, WorkerState};
use fleet::run::{Claim, ClaimRequest, Finished};
use fleet::{Labels, Lane};
use fleet_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn silent_worker_is_evicted_and_comes_back_when_it_wakes() -> anyhow::Result<()> {
    own_process!();
    let ns = Ns::new().await?;
    let ep = Endpoint::start(100).await?;
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let mut silent = WorkerProcess::start(
        &ns,
        &ProcessSpec {
            id: "w-silent",
            labels: "pool=ev",
            capacity: 3,
            endpoint: &ep.url,
            extra: &[],
        },
    )
    .await?;
    let cfg = ep.worker_settings();
    let awake = start_worker(&ns, "w-awake", "pool=ev", 2, &cfg, &[]).await?;
    let gname = "pool=ev,protocol=http";
    wait_for("group capacity 5", Duration::from_secs(10), || async {
        group(&ns.store, gname).await.filter(|g| g.capacity == 5)
    })
    .await?;
    let metrics_url = sched.url("/metrics");
    let evictions_before = metric(&metrics_url, "fleet_worker_evictions_total", &[]).await?;

    silent.signal("STOP")?;
    let stopped_at = Instant::now();
    // The last heartbeat as Redis recorded it (a beat already sent when the process froze
    // still lands, so keep reading until the worker is gone).
    let last_hb = AtomicI64::new(0);
    let evicted_ms = wait_for("w-silent evicted", Duration::from_secs(15), || async {
        let ws = ns.store.workers().await.ok()?;
        let now = now_ms();
        match ws.iter().find(|w| w.id == "w-silent") {
            Some(w) => {
                last_hb.store(now - w.last_heartbeat_ms_ago, Ordering::Relaxed);
                None
            }
            None => Some(now),
        }
    })
    .await?;
    let last_hb_ms = last_hb.load(Ordering::Relaxed);
    let silence = evicted_ms - last_hb_ms;
    println!("eviction: {silence} ms after the last heartbeat (timeout {HEARTBEAT_TIMEOUT_MS} ms, tick {HEALTH_MS} ms); {} ms after SIGSTOP", stopped_at.elapsed().as_millis());
    assert!(last_hb_ms > 0, "the worker was seen heartbeating");
    assert!(
        silence >= HEARTBEAT_TIMEOUT_MS as i64,
        "evicted early: {silence} ms"
    );
    // Timeout + one tick, plus slack for a busy test machine.
    assert!(
        silence <= (HEARTBEAT_TIMEOUT_MS + HEALTH_MS + 1000) as i64,
        "evicted late: {silence} ms"
    );

    // Its capacity left the group (registry and API agree) and the counter moved by one.
    let g = group(&ns.store, gname).await.context("group still known")?;
    assert_eq!((g.workers, g.capacity), (1, 2));
    let api: Vec<serde_json::Value> =
        serde_json::from_value(get_json(&sched.url("/v1/groups")).await?)?;
    let row = api
        .iter()
        .find(|r| r["group"] == gname)
        .context("group in /v1/groups")?;
    assert_eq!(
        (row["workers"].as_u64(), row["capacity"].as_u64()),
        (Some(1), Some(2))
    );
    let ws = get_json(&sched.url("/v1/workers")).await?;
    assert_eq!(ws.as_array().map(Vec::len), Some(1), "{ws}");
    let evictions = wait_for("eviction counted", Duration::from_secs(5), || async {
        let n = metric(&metrics_url, "fleet_worker_evictions_total", &[])
            .await
            .ok()?;
        (n > evictions_before).then_some(n)
    })
    .await?;
    assert_eq!(evictions - evictions_before, 1.0);

    // Work submitted while it is frozen: the broker may push some of it to the frozen
    // process (its connection is alive); none may be lost.
    let envs = jobs(8, "pool=ev", None);
    let ids: Vec<String> = envs.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ns.submit(&envs).await?, (8, 0));
    // Barrier: the scheduler has taken all eight in (each has a status) while the worker is
    // still frozen.
    wait_for("every task admitted", Duration::from_secs(15), || async {
        states(&ns, &ids)
            .await
            .ok()?
            .values()
            .all(|s| s != "-")
            .then_some(())
    })
    .await?;

    silent.signal("CONT")?;
    let resumed = Instant::now();
    let w = silent
        .wait_state(&ns.store, "active", Duration::from_secs(10))
        .await?;
    println!(
        "eviction: re-registered {} ms after SIGCONT",
        resumed.elapsed().as_millis()
    );
    assert_eq!(w.capacity, 3);
    let g = wait_for("capacity back to 5", Duration::from_secs(10), || async {
        group(&ns.store, gname).await.filter(|g| g.capacity == 5)
    })
    .await?;
    assert_eq!(g.workers, 2);

    wait_succeeded(&ns, &ids, Duration::from_secs(30)).await?;
    let per = ep.per_task();
    for id in &ids {
        assert_eq!(
            per.get(id).map(Vec::len),
            Some(1),
            "task {id} ran once: {:?}",
            per.get(id)
        );
    }
    assert_eq!(
        metric(&metrics_url, "fleet_worker_evictions_total", &[]).await? - evictions_before,
        1.0,
        "evicted once"
    );

    silent.signal("TERM")?;
    let st = silent.wait_exit(Duration::from_secs(20)).await?;
    assert_eq!(st.code(), Some(0), "log:\n{}", silent.log_tail());
    awake.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// A task redelivered from a dead worker to a live one: the live worker's copy waits while
/// the dead worker still counts as alive (its run record is its own); eviction releases only
/// the evicted worker's records, moves its tasks back to `queued`, and the live copy's next
/// claim counts the crash and runs the task alone (a crash suspect).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_releases_only_the_evicted_workers_records() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let labels = Labels::parse("pool=lua")?;
    let g = labels.group_name();
    let reg = |id: &str, instance: &str| Registration {
        id: id.into(),
        instance: instance.into(),
        labels: labels.clone(),
        capacity: 2,
        critical_capacity: 1,
        executor: "builtin".into(),
        state: WorkerState::Active,
        kinds: Default::default(),
    };
    ns.store
        .register(&reg("w-dead", "i-dead"), Duration::from_millis(1500))
        .await?;
    ns.store
        .register(&reg("w-live", "i-live"), Duration::from_millis(1500))
        .await?;
    let t = |id: &str, isolated: bool| ClaimRequest {
        lane: Lane::Normal,
        id: id.to_string(),
        base: 1,
        max_attempts: 3,
        isolated,
        key: None,
    };
    let lease = Duration::from_secs(60);
    let (_, c) = ns
        .store
        .claim(
            "w-dead",
            &g,
            "i-dead",
            lease,
            lease,
            &[t("t1", false), t("t2", false)],
        )
        .await?;
    assert_eq!(c, vec![Claim::Run(1), Claim::Run(1)]);
    // w-dead dies; the broker hands t1 to w-live, whose copy must wait: w-dead still counts.
    let (_, c) = ns
        .store
        .claim("w-live", &g, "i-live", lease, lease, &[t("t1", false)])
        .await?;
    assert_eq!(c, vec![Claim::Wait]);
    let before = group(&ns.store, &g).await.context("group")?;
    assert_eq!((before.capacity, before.load), (4, 2));

    // w-dead stays silent past the timeout (1 s here), w-live beats: the first sweep that
    // evicts anyone evicts w-dead alone.
    let evicted = wait_for(
        "a stale worker evicted",
        Duration::from_secs(10),
        || async {
            ns.store
                .heartbeat(
                    "w-live",
                    "i-live",
                    Duration::from_secs(60),
                    &Beat::default(),
                )
                .await
                .ok()?;
            ns.store
                .evict_stale(Duration::from_secs(1))
                .await
                .ok()
                .filter(|v| !v.is_empty())
        },
    )
    .await?;
    assert_eq!(evicted, vec!["w-dead".to_string()]);
    let after = group(&ns.store, &g).await.context("group")?;
    assert_eq!((after.workers, after.capacity, after.load), (1, 2, 0));
    for id in ["t1", "t2"] {
        let st = ns.store.task_status(id).await?.context("status")?;
        assert_eq!(
            st.get("state").map(String::as_str),
            Some("queued"),
            "{id}: {st:?}"
        );
        assert_eq!(st.get("worker"), None, "{id} names no dead worker: {st:?}");
    }
    // The attempt log keeps what the status no longer says: attempt 1 ran on w-dead and was
    // lost with it (one entry per task, written by the eviction).
    let lost = |id: &'static str| {
        let store = ns.store.clone();
        async move {
            let log = store.task_attempts(id).await?;
            let shape: Vec<_> = log
                .iter()
                .map(|a| {
                    (
                        a["attempt"].clone(),
                        a["worker"].clone(),
                        a["outcome"].clone(),
                        a["reason"].clone(),
                        a["started_at"].is_string(),
                    )
                })
                .collect();
            anyhow::Ok(shape)
        }
    };
    let one_lost = vec![(
        serde_json::json!(1),
        serde_json::json!("w-dead"),
        serde_json::json!("lost"),
        serde_json::json!("worker_lost"),
        true,
    )];
    assert_eq!(lost("t1").await?, one_lost);
    assert_eq!(lost("t2").await?, one_lost);
    // The waiting copy now finds its owner gone: the crash counts (attempt 2), run alone.
    let (_, c) = ns
        .store
        .claim("w-live", &g, "i-live", lease, lease, &[t("t1", false)])
        .await?;
    assert_eq!(c, vec![Claim::Isolate(2)]);
    let (_, c) = ns
        .store
        .claim("w-live", &g, "i-live", lease, lease, &[t("t1", true)])
        .await?;
    assert_eq!(c, vec![Claim::Run(2)]);
    assert_eq!(
        group(&ns.store, &g).await.map(|g| (g.capacity, g.load)),
        Some((2, 1))
    );
    // w-dead wakes (it was frozen, not dead), its run of attempt 1 fails, and it publishes a
    // retry: a copy with base 2 over run_base 1. Attempt 2 is w-live's, running: the late copy
    // is a duplicate, never a second run of attempt 2 (it was granted Run(2) before).
    let late = |id: &str| ClaimRequest {
        lane: Lane::Normal,
        id: id.to_string(),
        base: 2,
        max_attempts: 3,
        isolated: false,
        key: None,
    };
    let (_, c) = ns
        .store
        .claim("w-live", &g, "i-live", lease, lease, &[late("t1")])
        .await?;
    assert_eq!(
        c,
        vec![Claim::Duplicate],
        "a late retry of attempt 1 ran beside attempt 2"
    );
    assert_eq!(
        group(&ns.store, &g).await.map(|g| (g.capacity, g.load)),
        Some((2, 1))
    );
    // A retry nobody overtook still runs: t2 is queued at attempt 1, and its retry is attempt 2.
    let (_, c) = ns
        .store
        .claim("w-live", &g, "i-live", lease, lease, &[late("t2")])
        .await?;
    assert_eq!(c, vec![Claim::Run(2)]);
    let t2_done = Finished {
        lane: Lane::Normal,
        id: "t2".into(),
        attempt: 2,
        state: Some(fleet::status::TaskState::Succeeded),
        text: "{}".into(),
        success: true,
        reason: None,
    };
    ns.store
        .finish("w-live", &g, "i-live", lease, &[t2_done], &[])
        .await?;
    assert_eq!(
        group(&ns.store, &g).await.map(|g| (g.capacity, g.load)),
        Some((2, 1))
    );
    // The claim that counted the crash did not log it a second time.
    assert_eq!(lost("t1").await?, one_lost);
    // Idempotent: a second checker finds nothing to do.
    assert!(ns
        .store
        .evict_stale(Duration::from_secs(1))
        .await?
        .is_empty());
    assert_eq!(
        group(&ns.store, &g).await.map(|g| (g.capacity, g.load)),
        Some((2, 1))
    );
    // Attempt 2's outcome is appended by the finish that records it.
    let done = Finished {
        lane: Lane::Normal,
        id: "t1".into(),
        attempt: 2,
        state: Some(fleet::status::TaskState::Succeeded),
        text: "{}".into(),
        success: true,
        reason: None,
    };
    ns.store
        .finish("w-live", &g, "i-live", lease, &[done], &[])
        .await?;
    // After attempt 2's success, the late copy is still a duplicate (it ran again before).
    let (_, c) = ns
        .store
        .claim("w-live", &g, "i-live", lease, lease, &[late("t1")])
        .await?;
    assert_eq!(
        c,
        vec![Claim::Duplicate],
        "a late retry ran a task that had succeeded"
    );
    let log = ns.store.task_attempts("t1").await?;
    assert_eq!(log.len(), 2, "{log:?}");
    assert_eq!(
        (&log[1]["attempt"], &log[1]["worker"], &log[1]["outcome"]),
        (
            &serde_json::json!(2),
            &serde_json::json!("w-live"),
            &serde_json::json!("succeeded")
        ),
        "{log:?}"
    );
    assert!(
        log[1].get("error").is_none()
            && log[1].get("reason").is_none()
            && log[1]["started_at"].is_string(),
        "{log:?}"
    );
    ns.cleanup().await
}

/// A worker evicted while frozen (its run going on) wakes, registers again with the same
/// process token and beats with the run listed: the task says `running` on it again, and a
/// copy of it (a redelivery) waits for that run instead of taking it over beside it as a crash
/// suspect (the eviction had dropped the task's worker, which is how a claim judges the owner
/// alive).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_woken_worker_that_registers_again_keeps_its_run() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let g = Labels::parse("pool=woken")?.group_name();
    let register = |id: &'static str| {
        register_worker_for(&ns.store, id, "pool=woken", 2, Duration::from_millis(1500))
    };
    register("w-frozen").await?;
    register("w-peer").await?;
    let t1 = ClaimRequest {
        lane: Lane::Normal,
        id: "t1".into(),
        base: 1,
        max_attempts: 3,
        isolated: false,
        key: None,
    };
    let lease = Duration::from_secs(60);
    let (_, c) = ns
        .store
        .claim(
            "w-frozen",
            &g,
            "i-w-frozen",
            lease,
            lease,
            std::slice::from_ref(&t1),
        )
        .await?;
    assert_eq!(c, vec![Claim::Run(1)]);
    let evicted = wait_for(
        "the frozen worker evicted",
        Duration::from_secs(10),
        || async {
            ns.store
                .heartbeat("w-peer", "i-w-peer", lease, &Beat::default())
                .await
                .ok()?;
            ns.store
                .evict_stale(Duration::from_secs(1))
                .await
                .ok()
                .filter(|v| !v.is_empty())
        },
    )
    .await?;
    assert_eq!(evicted, vec!["w-frozen".to_string()]);
    let st = ns.store.task_status("t1").await?.context("status")?;
    assert_eq!(
        (st.get("state").map(String::as_str), st.get("worker")),
        (Some("queued"), None),
        "{st:?}"
    );

    // It wakes: registers again (same process) and beats with its run.
    register("w-frozen").await?;
    let beat = Beat {
        running: vec![(Lane::Normal, "t1".to_string())],
        ..Beat::default()
    };
    ns.store
        .heartbeat("w-frozen", "i-w-frozen", lease, &beat)
        .await?;
    let st = ns.store.task_status("t1").await?.context("status")?;
    assert_eq!(
        (
            st.get("state").map(String::as_str),
            st.get("worker").map(String::as_str)
        ),
        (Some("running"), Some("w-frozen")),
        "{st:?}"
    );
    // A copy reaches the peer: the owner is alive and running it.
    let (_, c) = ns
        .store
        .claim(
            "w-peer",
            &g,
            "i-w-peer",
            lease,
            lease,
            std::slice::from_ref(&t1),
        )
        .await?;
    assert_eq!(
        c,
        vec![Claim::Wait],
        "a copy ran beside the woken worker's run"
    );
    ns.cleanup().await
}

/// A crash suspect whose claimer never heard the answer (a Redis timeout after the script ran)
/// was run unchecked under its old number; its retry must still run, not be taken for the late
/// retry of an evicted worker (a duplicate, acked: the task would be lost).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_an_unheard_suspect_claim_still_runs() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let g = Labels::parse("pool=unheard")?.group_name();
    register_worker(&ns.store, "w-b", "pool=unheard", 2).await?;
    let lease = Duration::from_secs(60);
    let copy = |base: u32| ClaimRequest {
        lane: Lane::Normal,
        id: "t9".into(),
        base,
        max_attempts: 5,
        isolated: false,
        key: None,
    };
    // A worker that is gone (never registered here) ran attempt 1.
    let (_, c) = ns
        .store
        .claim("w-gone", &g, "i-gone", lease, lease, &[copy(1)])
        .await?;
    assert_eq!(c, vec![Claim::Run(1)]);
    // w-b's claim of the redelivered copy makes it a suspect as attempt 2 — an answer w-b
    // does not hear: it runs the copy as attempt 1, which fails, and publishes the retry.
    let (_, c) = ns
        .store
        .claim("w-b", &g, "i-w-b", lease, lease, &[copy(1)])
        .await?;
    assert_eq!(c, vec![Claim::Isolate(2)]);
    let (_, c) = ns
        .store
        .claim("w-b", &g, "i-w-b", lease, lease, &[copy(2)])
        .await?;
    assert_eq!(
        c,
        vec![Claim::Run(2)],
        "the retry of an unheard suspect claim was dropped"
    );
    ns.cleanup().await
}
