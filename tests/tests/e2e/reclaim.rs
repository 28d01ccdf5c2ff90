//! Departed groups are reclaimed (issue 12, point 3): a group (label set) with no worker and no
//! task for `FLEET_GROUP_RECLAIM_AFTER_MS` loses its Redis keys, its lane and park queues and
//! the scheduler's park consumers; `fleet_groups` counts groups. A group whose queue holds a
//! task is kept and the task runs when a worker returns; a worker registering with a reclaimed
//! label set recreates the group and runs its tasks; a worker cannot register while its
//! group's queues are being deleted, nor with a queue declaration older than the deletion.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context};
use deadpool_redis::redis;
use fleet::broker::probe::Prober;
use fleet::registry::{ReclaimClaim, Registration, WorkerState};
use fleet::{Labels, Lane};
use fleet_tests::*;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use serde_json::json;

/// The tests of this file read `fleet_groups`, one gauge per process: they take turns.
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The grace of these tests.
const GRACE_MS: &str = "2000";

fn scheduler_cfg() -> Vec<(&'static str, &'static str)> {
    let mut c = SCHEDULER.to_vec();
    c.extend_from_slice(&[
        ("group_reclaim_after_ms", GRACE_MS),
        ("stats_interval_ms", "500"),
    ]);
    c
}

/// Keys of the namespace by kind (the part after `{ns}:` up to the next `:`), leaving out the
/// per-task keys (status `t:`, dedupe mark `dd:` of earlier versions, a dispatch batch's
/// handed-on flag `ho:`): those belong to tasks, with their own expiry (the dedupe window).
async fn keys(ns: &Ns) -> anyhow::Result<BTreeMap<String, usize>> {
    let all: Vec<String> = ns
        .store
        .query(redis::cmd("KEYS").arg(ns.names.all_keys_pattern()))
        .await?;
    let mut by: BTreeMap<String, usize> = BTreeMap::new();
    for k in all {
        let rest = &k[ns.names.prefix().len()..];
        let kind = rest.split(':').next().unwrap_or("").to_string();
        // Task state outlives its group: status records, dedupe marks and the task index
        // (`tix`: the ids of those records, fleet::status::index).
        if kind == "t" || kind == "dd" || kind == "ho" || kind == "tix" {
            continue;
        }
        *by.entry(kind).or_default() += 1;
    }
    Ok(by)
}

/// The prober [`queue_info`] asks through: the scheduler's own kind (a connection of its own,
/// replaced before lapin runs it out of channel ids — the waits below probe 160 deleted
/// queues a pass, and CI ran a shared connection out that way), one per test: its connection
/// is driven by the test's own runtime (a static one shared by tests outlived the runtime
/// that drove it and hung a probe in CI of 91c9422).
fn test_prober() -> Prober {
    Prober::new(&amqp_url(), "reclaim test", &Default::default())
}

/// A queue's (ready messages, consumers), `None` when it does not exist (passive declare).
async fn queue_info(probe: &Prober, q: &str) -> anyhow::Result<Option<(u32, u32)>> {
    Ok(probe.queue(q).await?.map(|s| (s.ready, s.consumers)))
}

/// The lane and park queues of a group.
fn group_queues(ns: &Ns, g: &str) -> Vec<String> {
    Lane::ALL
        .iter()
        .flat_map(|l| [ns.names.group_queue(g, *l), ns.names.park_queue(g, *l)])
        .collect()
}

async fn groups_gauge(sched: &SchedulerHandle) -> anyhow::Result<f64> {
    let page = reqwest::get(sched.url("/metrics")).await?.text().await?;
    Ok(metric_sum(&page, "fleet_groups", &[]))
}

/// The tasks `ids` of a kept group all succeed once a worker returns: every task recorded ran
/// exactly once, `on_returning` of them on the returning `worker`; nothing dead-lettered.
async fn each_ran_once(
    ns: &Ns,
    rec: &Recorder,
    ids: &[String],
    worker: &str,
    on_returning: usize,
) -> anyhow::Result<()> {
    wait_succeeded(ns, ids, Duration::from_secs(30)).await?;
    let per = rec.per_task();
    assert!(
        per.values().all(|w| w.len() == 1),
        "each task once: {per:?}"
    );
    assert_eq!(
        per.values().filter(|w| w[0] == worker).count(),
        on_returning
    );
    assert!(ns.drain_dead().await?.is_empty());
    Ok(())
}

/// The scenario: 40 workers with a unique label each run a task and drain. After the
/// grace: 0 groups, their 160 queues gone (with the scheduler's 80 park consumers), the
/// namespace's keys back to the count before the first worker, `fleet_groups` 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forty_departed_pods_are_reclaimed() -> anyhow::Result<()> {
    let probe = test_prober();
    let _turn = TURN.lock().await;
    own_process!();
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &scheduler_cfg()).await?;
    // Baseline: the scheduler alone — the keys it writes by itself, nothing of a group: its
    // readiness probe key and the control stream's marker (`ctl`, whose loss tells the
    // replicas that Redis lost the cancel marks).
    let baseline = wait_for(
        "the scheduler's readiness probe key and control marker",
        Duration::from_secs(10),
        || async {
            keys(&ns)
                .await
                .ok()
                .filter(|k| k.contains_key("readyz") && k.contains_key("ctl"))
        },
    )
    .await?;
    println!("reclaim: baseline keys {baseline:?}");

    let pods = 40;
    let starts = (0..pods).map(|i| {
        let (id, labels) = (format!("w-pod{i}"), format!("pod=p{i}"));
        let ns = &ns;
        async move { start_worker(ns, &id, &labels, 1, WORKER, &[]).await }
    });
    let workers = futures::future::try_join_all(starts).await?;
    let names: Vec<String> = (0..pods)
        .map(|i| format!("pod=p{i},protocol=builtin"))
        .collect();
    let envs: Vec<_> = (0..pods)
        .map(|i| task("noop", json!({}), &format!("pod=p{i}")))
        .collect();
    assert_eq!(ns.submit(&envs).await?, (pods, 0));
    wait_succeeded(
        &ns,
        &envs.iter().map(|e| e.id.clone()).collect::<Vec<_>>(),
        Duration::from_secs(60),
    )
    .await?;
    for e in &envs {
        let st = ns.status(&e.id).await?.unwrap_or_default();
        assert_eq!(
            st.get("group").map(String::as_str),
            Some(format!("pod={},protocol=builtin", e.labels.0["pod"]).as_str())
        );
    }
    // Every group has its 4 queues and the scheduler a consumer on each of its 2 park queues.
    wait_for("80 park consumers", Duration::from_secs(30), || async {
        let mut n = 0;
        for g in &names {
            for l in Lane::ALL {
                if let Ok(Some((_, c))) = queue_info(&probe, &ns.names.park_queue(g, l)).await {
                    n += c;
                }
            }
        }
        (n == 80).then_some(())
    })
    .await?;
    for g in &names {
        for q in group_queues(&ns, g) {
            ensure!(
                queue_info(&probe, &q).await?.is_some(),
                "{q} exists while its worker runs"
            );
        }
    }
    wait_for("fleet_groups 40", Duration::from_secs(10), || async {
        (groups_gauge(&sched).await.ok()? == 40.0).then_some(())
    })
    .await?;
    let during = keys(&ns).await?;
    println!("reclaim: keys with 40 workers {during:?}");

    let reclaimed_before = metric_sum(
        &reqwest::get(sched.url("/metrics")).await?.text().await?,
        "fleet_groups_reclaimed_total",
        &[],
    );
    let drained = Instant::now();
    futures::future::try_join_all(workers.into_iter().map(|w| w.stop())).await?;
    // Right after the drain the groups are still there (the grace).
    assert_eq!(ns.store.group_names().await?.len(), pods);
    // Generous: under the whole suite's load, deleting 160 quorum queues can keep a RabbitMQ
    // node busy for a minute (a deletion that is too slow is undone and tried again after
    // another grace).
    wait_for("0 groups", Duration::from_secs(120), || async {
        ns.store.group_names().await.ok()?.is_empty().then_some(())
    })
    .await?;
    let took = drained.elapsed();
    assert!(
        took >= Duration::from_millis(2000),
        "reclaimed before the grace: {took:?}"
    );
    // A pass deletes the claimed groups' queues one by one, each a few broker round trips:
    // on a quiet machine 160 go in seconds, under the whole suite's load a group took ≈ 8 s
    // (CI, session 15: 84 of 160 gone at 180 s). What must not happen is a stall: the wait
    // lasts while the count left falls at least once a minute (10 minutes at most).
    let count_left = || async {
        let mut n = 0usize;
        for g in &names {
            for q in group_queues(&ns, g) {
                if queue_info(&probe, &q).await.ok().flatten().is_some() {
                    n += 1;
                }
            }
        }
        n
    };
    let (mut left_now, mut progressed, began) = (usize::MAX, Instant::now(), Instant::now());
    let gone = loop {
        let n = count_left().await;
        if n == 0 {
            break true;
        }
        if n < left_now {
            (left_now, progressed) = (n, Instant::now());
        }
        if progressed.elapsed() > Duration::from_secs(60)
            || began.elapsed() > Duration::from_secs(600)
        {
            break false;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    if !gone {
        let mut left = Vec::new();
        for g in &names {
            for q in group_queues(&ns, g) {
                // A diagnosis: a channel error here must not hide the queues left.
                if let Ok(Some(info)) = queue_info(&probe, &q).await {
                    left.push((q, info));
                }
            }
        }
        anyhow::bail!(
            "{} queues left (name, (ready, consumers)): {left:?}",
            left.len()
        );
    }
    let back = wait_for(
        "keys back to the baseline",
        Duration::from_secs(30),
        || async { (keys(&ns).await.ok()? == baseline).then_some(()) },
    )
    .await;
    if back.is_err() {
        anyhow::bail!(
            "keys not back to the baseline: {:?}, baseline {baseline:?}",
            keys(&ns).await?
        );
    }
    wait_for("fleet_groups 0", Duration::from_secs(10), || async {
        (groups_gauge(&sched).await.ok()? == 0.0).then_some(())
    })
    .await?;
    let page = reqwest::get(sched.url("/metrics")).await?.text().await?;
    assert_eq!(
        metric_sum(&page, "fleet_groups_reclaimed_total", &[]) - reclaimed_before,
        40.0
    );
    // The waiting-for-worker queues keep their consumers (they belong to no group).
    for l in Lane::ALL {
        assert_eq!(
            queue_info(&probe, &ns.names.park_queue("_unmatched", l))
                .await?
                .map(|q| q.1),
            Some(1)
        );
    }
    println!(
        "reclaim: 40 groups reclaimed {} ms after the drain (grace {GRACE_MS} ms)",
        took.as_millis()
    );

    sched.stop().await?;
    ns.cleanup().await
}

/// The race: a group whose workers left while its queue holds tasks is not reclaimed, however
/// long it waits; the tasks run, each once, when a worker of the group returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_group_with_queued_tasks_is_kept_and_they_run() -> anyhow::Result<()> {
    let _turn = TURN.lock().await;
    own_process!();
    let ns = Ns::new().await?;
    let mut cfg = scheduler_cfg();
    // Every task goes to the group's queue (none parked).
    cfg.push(("backlog_factor", "20"));
    let sched = start_scheduler(&ns, &cfg).await?;
    let rec = Recorder::default();
    let h = [(JOB, rec.handler())];
    let g = "pod=kept,protocol=builtin";
    let q = ns.names.group_queue(g, Lane::Normal);
    let a = start_worker(&ns, "w-kept-1", "pod=kept", 1, WORKER, &h).await?;
    let envs: Vec<_> = (0..6)
        .map(|i| task(JOB, json!({"i": i, "ms": 300}), "pod=kept"))
        .collect();
    let ids: Vec<String> = envs.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ns.submit(&envs).await?, (6, 0));
    wait_for(
        "tasks queued for the group",
        Duration::from_secs(20),
        || async { (ns.depth(&q).await >= 4).then_some(()) },
    )
    .await?;
    a.stop().await?;
    let queued = ns.depth(&q).await;
    assert!(queued >= 3, "tasks left in the queue: {queued}");
    let ran_before = rec.count();

    // Three graces with no worker: kept, queue and tasks intact, nothing ran.
    quiet_for(
        Duration::from_millis(3 * 2000 + 1000),
        "three graces: the group with queued tasks is not reclaimed",
    )
    .await;
    assert_eq!(
        ns.store.group_names().await?,
        vec![g.to_string()],
        "the group is kept"
    );
    assert_eq!(ns.depth(&q).await, queued, "its tasks are still queued");
    assert_eq!(rec.count(), ran_before);
    assert_eq!(groups_gauge(&sched).await?, 1.0);

    let b = start_worker(&ns, "w-kept-2", "pod=kept", 2, WORKER, &h).await?;
    each_ran_once(&ns, &rec, &ids, "w-kept-2", 6 - ran_before).await?;
    assert_eq!(rec.per_task().len(), 6);

    b.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// A worker registering with the label set of a reclaimed group recreates it and runs its tasks.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_returning_to_a_reclaimed_label_set_runs_its_tasks() -> anyhow::Result<()> {
    let probe = test_prober();
    let _turn = TURN.lock().await;
    own_process!();
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &scheduler_cfg()).await?;
    let rec = Recorder::default();
    let h = [(JOB, rec.handler())];
    let g = "pod=back,protocol=builtin";
    let first = start_worker(&ns, "w-back-1", "pod=back", 1, WORKER, &h).await?;
    first.stop().await?;
    wait_for("group reclaimed", Duration::from_secs(30), || async {
        ns.store.group_names().await.ok()?.is_empty().then_some(())
    })
    .await?;
    wait_for("its queues gone", Duration::from_secs(30), || async {
        for q in group_queues(&ns, g) {
            if queue_info(&probe, &q).await.ok()?.is_some() {
                return None;
            }
        }
        Some(())
    })
    .await?;

    let again = start_worker(&ns, "w-back-2", "pod=back", 2, WORKER, &h).await?;
    assert_eq!(ns.store.group_names().await?, vec![g.to_string()]);
    let envs: Vec<_> = (0..4)
        .map(|i| task(JOB, json!({"i": i, "ms": 50}), "pod=back"))
        .collect();
    let ids: Vec<String> = envs.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ns.submit(&envs).await?, (4, 0));
    wait_succeeded(&ns, &ids, Duration::from_secs(30)).await?;
    let per = rec.per_task();
    assert_eq!(per.len(), 4);
    assert!(
        per.values().all(|w| w == &vec!["w-back-2".to_string()]),
        "{per:?}"
    );
    // The scheduler consumes the group's park queues again.
    wait_for("park consumers back", Duration::from_secs(30), || async {
        for l in Lane::ALL {
            if queue_info(&probe, &ns.names.park_queue(g, l))
                .await
                .ok()?
                .map(|q| q.1)
                != Some(1)
            {
                return None;
            }
        }
        Some(())
    })
    .await?;
    wait_for("fleet_groups 1", Duration::from_secs(10), || async {
        (groups_gauge(&sched).await.ok()? == 1.0).then_some(())
    })
    .await?;

    again.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// The reclaim script against registration (no scheduler): a group with a worker is never
/// claimed; while a claim's queues are being deleted a worker of the group is refused; after
/// the deletion one whose queue declaration is older is refused, a newer one registers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registration_waits_for_a_reclaim_and_its_deleted_queues() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let labels = Labels::parse("pod=race,protocol=builtin").context("labels")?;
    let reg = |id: &str| Registration {
        id: id.into(),
        instance: format!("i-{id}"),
        labels: labels.clone(),
        capacity: 1,
        critical_capacity: 1,
        executor: "builtin".into(),
        state: WorkerState::Active,
        kinds: Default::default(),
    };
    let g = labels.group_name();
    let s = &ns.store;
    let now = || s.clock.now_ms();
    s.measure_clock().await?;
    s.register_declared(&reg("w1"), Duration::from_secs(30), false, now())
        .await?;
    assert!(
        matches!(
            s.reclaim_claim(&g, Duration::from_millis(0), Duration::from_secs(60))
                .await?,
            ReclaimClaim::Busy(_)
        ),
        "a group with a worker is kept"
    );
    assert!(s.deregister("w1", "i-w1").await?);
    // Grace not over.
    assert!(matches!(
        s.reclaim_claim(&g, Duration::from_secs(60), Duration::from_secs(60))
            .await?,
        ReclaimClaim::Wait(_)
    ));
    let ReclaimClaim::Reclaimed { labels: json } = s
        .reclaim_claim(&g, Duration::from_millis(0), Duration::from_secs(60))
        .await?
    else {
        anyhow::bail!("not reclaimed")
    };
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&json)?,
        json!({"pod": "race", "protocol": "builtin"})
    );
    assert!(s.group_names().await?.is_empty());
    let declared_before = now();
    let r = s
        .register_declared(&reg("w2"), Duration::from_secs(30), false, declared_before)
        .await;
    assert!(
        matches!(r, Err(fleet::Error::Reclaiming(_))),
        "refused while the queues are deleted: {r:?}"
    );
    assert!(
        s.group_names().await?.is_empty(),
        "a refused registration recreates nothing"
    );
    s.reclaim_done(&g, Duration::from_secs(60)).await?;
    let r = s
        .register_declared(&reg("w2"), Duration::from_secs(30), false, declared_before)
        .await;
    assert!(
        matches!(r, Err(fleet::Error::Reclaiming(_))),
        "its queues were deleted after it declared them: {r:?}"
    );
    scenario_pause(
        Duration::from_millis(1100),
        "the clock past the deletion + register.lua's RECLAIM_MARGIN_MS (1 s)",
    )
    .await;
    s.register_declared(&reg("w2"), Duration::from_secs(30), false, now())
        .await?;
    assert_eq!(s.group_names().await?, vec![g.clone()]);
    assert_eq!(
        group(s, &g).await.map(|v| (v.workers, v.capacity)),
        Some((1, 1))
    );
    // A claim undone (work arrived): the group is back with its label index.
    assert!(s.deregister("w2", "i-w2").await?);
    let ReclaimClaim::Reclaimed { labels: json } = s
        .reclaim_claim(&g, Duration::from_millis(0), Duration::from_secs(60))
        .await?
    else {
        anyhow::bail!("not reclaimed")
    };
    s.reclaim_restore(&g, &json, Duration::from_secs(60))
        .await?;
    assert_eq!(s.group_names().await?, vec![g.clone()]);
    let idx: Vec<String> = s
        .query(redis::cmd("SMEMBERS").arg(format!("{}idx:pod=race", ns.names.prefix())))
        .await?;
    assert_eq!(idx, vec![g.clone()]);
    assert!(
        matches!(
            s.reclaim_claim(&g, Duration::from_secs(60), Duration::from_secs(60))
                .await?,
            ReclaimClaim::Wait(_)
        ),
        "its grace starts again"
    );
    // A claim undone whose queues could not be declared again: the group is back, and a worker
    // whose queue declaration is older must declare them (and so bind them) again first.
    let ReclaimClaim::Reclaimed { labels: json } = s
        .reclaim_claim(&g, Duration::from_millis(0), Duration::from_secs(60))
        .await?
    else {
        anyhow::bail!("not reclaimed")
    };
    let declared_before = now();
    scenario_pause(
        Duration::from_millis(20),
        "the restore's clock reading after `declared_before`",
    )
    .await;
    s.reclaim_restore_undeclared(&g, &json, Duration::from_secs(60))
        .await?;
    assert_eq!(s.group_names().await?, vec![g.clone()]);
    let r = s
        .register_declared(&reg("w3"), Duration::from_secs(30), false, declared_before)
        .await;
    assert!(
        matches!(r, Err(fleet::Error::Reclaiming(_))),
        "its queues may be unbound: declare them again: {r:?}"
    );
    scenario_pause(
        Duration::from_millis(1100),
        "the clock past the deletion + register.lua's RECLAIM_MARGIN_MS (1 s)",
    )
    .await;
    s.register_declared(&reg("w3"), Duration::from_secs(30), false, now())
        .await?;
    assert_eq!(
        group(s, &g).await.map(|v| (v.workers, v.capacity)),
        Some((1, 1))
    );
    ns.cleanup().await
}

/// Reclaim with quorum queues (the default `FLEET_QUEUE_TYPE`). RabbitMQ refuses
/// `queue.delete` with `if-empty` on a quorum queue with a connection-level error (540
/// NOT_IMPLEMENTED), which closed the scheduler's whole connection at every reclaim attempt and
/// never reclaimed the group. Now: a departed group's queues are unbound, found empty and
/// deleted with the scheduler's connection intact; a group whose quorum queue holds a task is
/// kept, and the task runs once when a worker returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn quorum_groups_are_reclaimed_without_closing_the_connection() -> anyhow::Result<()> {
    let probe = test_prober();
    let _turn = TURN.lock().await;
    own_process!();
    let ns = Ns::with_queue_type("quorum").await?;
    let mut cfg = scheduler_cfg();
    cfg.push(("backlog_factor", "20"));
    let sched = start_scheduler(&ns, &cfg).await?;
    let rec = Recorder::default();
    let h = [(JOB, rec.handler())];
    let reconnects = || async {
        Ok::<f64, anyhow::Error>(metric_sum(
            &reqwest::get(sched.url("/metrics")).await?.text().await?,
            "fleet_amqp_reconnects_total",
            &[],
        ))
    };
    let before = reconnects().await?;

    // A departed group with empty queues: reclaimed, its quorum queues gone.
    let gone = "pod=qgone,protocol=builtin";
    let w = start_worker(&ns, "w-qgone", "pod=qgone", 1, WORKER, &h).await?;
    let env = task(JOB, json!({"ms": 10}), "pod=qgone");
    assert_eq!(ns.submit(std::slice::from_ref(&env)).await?, (1, 0));
    wait_succeeded(&ns, std::slice::from_ref(&env.id), Duration::from_secs(30)).await?;

    // A departed group whose quorum queue holds tasks: kept.
    let kept = "pod=qkept,protocol=builtin";
    let q = ns.names.group_queue(kept, Lane::Normal);
    let a = start_worker(&ns, "w-qkept-1", "pod=qkept", 1, WORKER, &h).await?;
    let envs: Vec<_> = (0..5)
        .map(|i| task(JOB, json!({"i": i, "ms": 300}), "pod=qkept"))
        .collect();
    let ids: Vec<String> = envs.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ns.submit(&envs).await?, (5, 0));
    wait_for(
        "tasks queued for the kept group",
        Duration::from_secs(20),
        || async { (ns.depth(&q).await >= 3).then_some(()) },
    )
    .await?;
    w.stop().await?;
    a.stop().await?;
    let queued = ns.depth(&q).await;
    assert!(queued >= 2, "tasks left in the queue: {queued}");
    let ran_before = rec.count();
    let kept_ran = rec.per_task().keys().filter(|id| ids.contains(id)).count();

    wait_for(
        "the empty group reclaimed",
        Duration::from_secs(30),
        || async { (ns.store.group_names().await.ok()? == vec![kept.to_string()]).then_some(()) },
    )
    .await?;
    wait_for("its queues gone", Duration::from_secs(30), || async {
        for q in group_queues(&ns, gone) {
            if queue_info(&probe, &q).await.ok()?.is_some() {
                return None;
            }
        }
        Some(())
    })
    .await?;
    // Two more graces: the kept group stays with its tasks, nothing ran, no reconnection.
    quiet_for(
        Duration::from_millis(2 * 2000 + 1000),
        "two more graces: the group with tasks is not reclaimed",
    )
    .await;
    assert_eq!(
        ns.store.group_names().await?,
        vec![kept.to_string()],
        "the group with tasks is kept"
    );
    assert_eq!(ns.depth(&q).await, queued, "its tasks are still queued");
    assert_eq!(rec.count(), ran_before);
    assert_eq!(
        reconnects().await? - before,
        0.0,
        "the scheduler's connection was never closed"
    );

    let b = start_worker(&ns, "w-qkept-2", "pod=qkept", 2, WORKER, &h).await?;
    each_ran_once(&ns, &rec, &ids, "w-qkept-2", 5 - kept_ran).await?;

    b.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// The race inside a reclaim, on quorum queues: a task reaches a claimed group's queue after
/// the claim and before the deletion (published straight to the queue, past the unbind). The
/// queue is found holding it: the claim is undone, the queue is bound to `<ns>.tasks` again
/// and the group is back; the task runs once when a worker of the group returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_task_arriving_during_a_reclaim_keeps_the_group_bound() -> anyhow::Result<()> {
    let _turn = TURN.lock().await;
    let ns = Ns::with_queue_type("quorum").await?;
    let sched = start_scheduler(&ns, &scheduler_cfg()).await?;
    let rec = Recorder::default();
    let h = [(JOB, rec.handler())];
    let g = "pod=race,protocol=builtin";
    let q = ns.names.group_queue(g, Lane::Normal);
    let w = start_worker(&ns, "w-race-1", "pod=race", 1, WORKER, &h).await?;
    w.stop().await?;
    // The claim removes the group's keys; its queues are deleted a settle time (≥ 1 s) later.
    wait_for("the group claimed", Duration::from_secs(30), || async {
        (!ns.store.group_names().await.ok()?.contains(&g.to_string())).then_some(())
    })
    .await?;
    let env = task(JOB, json!({"ms": 10}), "pod=race");
    fleet::broker::amqp::publish_confirmed(
        &ns.publisher,
        "",
        &q,
        &env.to_bytes(),
        fleet::broker::amqp::task_properties(&env.id, None),
    )
    .await
    .context("the task reaches the group's queue before its deletion")?;
    wait_for("the group restored", Duration::from_secs(30), || async {
        ns.store
            .group_names()
            .await
            .ok()?
            .contains(&g.to_string())
            .then_some(())
    })
    .await?;
    assert_eq!(ns.depth(&q).await, 1, "the task is still queued");
    // Bound again: a mandatory publish through `<ns>.tasks` with the group's key is routed.
    let probe = task(JOB, json!({"ms": 10}), "pod=race");
    fleet::broker::amqp::publish_confirmed(
        &ns.publisher,
        &ns.names.tasks_exchange(),
        &ns.names.group_key(g, Lane::Normal),
        &probe.to_bytes(),
        fleet::broker::amqp::task_properties(&probe.id, None),
    )
    .await
    .context("the group's queue is bound to the tasks exchange again")?;
    assert_eq!(rec.count(), 0);

    let back = start_worker(&ns, "w-race-2", "pod=race", 2, WORKER, &h).await?;
    wait_succeeded(
        &ns,
        &[env.id.clone(), probe.id.clone()],
        Duration::from_secs(30),
    )
    .await?;
    let per = rec.per_task();
    assert_eq!(per.len(), 2);
    for id in [&env.id, &probe.id] {
        assert_eq!(
            per.get(id),
            Some(&vec!["w-race-2".to_string()]),
            "{id} ran once on the returning worker: {per:?}"
        );
    }
    assert!(ns.drain_dead().await?.is_empty());
    back.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// A prober keeps answering past the 2,047 channel ids lapin has per connection: 2,100
/// questions about a missing queue (each a 404 that costs its connection a channel id for
/// good, `fleet::broker::probe`), then an existing queue is still read — its depth exact, also
/// through a node list whose other node refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prober_outlives_the_channel_ids_its_404s_cost() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let probe = Prober::new(&amqp_url(), "prober test", &Default::default());
    let missing = format!("{}.no-such-queue", ns.names.tasks_exchange());
    for k in 0..2100 {
        ensure!(
            probe.queue(&missing).await?.is_none(),
            "question {k}: a missing queue reads as missing"
        );
    }
    let q = format!("{}.probe-test", ns.names.tasks_exchange());
    let ch = ns.conn.create_channel().await?;
    ch.queue_declare(
        q.as_str().into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await?;
    for _ in 0..3 {
        ch.basic_publish(
            "".into(),
            q.as_str().into(),
            lapin::options::BasicPublishOptions::default(),
            b"x",
            lapin::BasicProperties::default(),
        )
        .await?
        .await?;
    }
    let state = wait_for(
        "the probe queue's 3 messages",
        Duration::from_secs(10),
        || async {
            probe
                .queue(&q)
                .await
                .ok()
                .flatten()
                .filter(|s| s.ready == 3)
        },
    )
    .await?;
    assert_eq!((state.ready, state.consumers), (3, 0));
    // A cluster's node list (`FLEET_AMQP_URL=amqp://…,amqp://…`) with a node that refuses:
    // the prober connects to the other (it once took the whole list for one URL, and every
    // question of a clustered scheduler's prober failed).
    let dead = free_port()?;
    let list = format!("amqp://guest:guest@127.0.0.1:{dead}/%2f,{}", amqp_url());
    // A prober each: each connects from a random node of the list.
    for k in 0..6 {
        let listed = Prober::new(&list, "prober list test", &Default::default());
        let s = listed.queue(&q).await?;
        ensure!(
            s.map(|s| s.ready) == Some(3),
            "prober {k} through a node list: {s:?}"
        );
        listed.close().await;
    }
    ch.queue_delete(
        q.as_str().into(),
        lapin::options::QueueDeleteOptions::default(),
    )
    .await?;
    probe.close().await;
    ns.cleanup().await?;
    Ok(())
}
