//! Metrics with exact values: a workload with known outcomes (successes, failures ending in
//! the dead-letter queue, expired tasks, refused envelopes) must show exactly those counts.
//! (One test in this file: the scheduler and worker run in-process and share the recorder.)

use std::time::Duration;

use fleet::Lane;
use fleet_tests::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_match_a_known_workload_exactly() -> anyhow::Result<()> {
    own_process!();
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &[("probe_interval_ms", "600000")]).await?;
    let w = start_worker(&ns, "w-metrics", "zone=m", 4, &[], &[]).await?;
    let group = "protocol=builtin,zone=m";

    let (n_ok, n_fail, n_expired, n_bad) = (30usize, 4usize, 3usize, 2usize);
    let mut envs = Vec::new();
    for _ in 0..n_ok {
        envs.push(task("noop", json!(null), "zone=m"));
    }
    for _ in 0..n_fail {
        let mut e = task("fail", json!({"times": 9}), "zone=m");
        e.max_attempts = Some(2);
        envs.push(e);
    }
    for _ in 0..n_expired {
        let mut e = task("noop", json!(null), "zone=m");
        e.deadline = Some(chrono::Utc::now() - chrono::Duration::seconds(5));
        envs.push(e);
    }
    assert_eq!(ns.submit(&envs).await?, (envs.len(), 0));
    for _ in 0..n_bad {
        ns.submit_raw(Lane::Normal, b"{broken").await?;
    }

    let url = format!("http://{}/metrics", w.addr);
    let page = wait_for("all outcomes", Duration::from_secs(30), || {
        let url = url.clone();
        async move {
            let p = reqwest::get(&url).await.ok()?.text().await.ok()?;
            let done = metric_sum(
                &p,
                "fleet_tasks_completed_total",
                &[("lane", "normal"), ("outcome", "succeeded")],
            ) as usize
                == n_ok
                && metric_sum(
                    &p,
                    "fleet_tasks_completed_total",
                    &[("lane", "normal"), ("outcome", "dead")],
                ) as usize
                    == n_fail
                && metric_sum(
                    &p,
                    "fleet_tasks_rejected_total",
                    &[("reason", "malformed_json")],
                ) as usize
                    == n_bad;
            done.then_some(p)
        }
    })
    .await?;
    // Barriers instead of a quiet period: the work has settled, every dead letter (failed,
    // refused, expired) is in the dead-letter queue, and the scheduler has counted the expired
    // ones (it counts after the dead letter's confirm); then the page is read again.
    ns.wait_settled(Duration::from_secs(30)).await?;
    let dead_queue = ns.names.dead_queue();
    let n_dead = u32::try_from(n_fail + n_bad + n_expired)?;
    wait_for(
        "every dead letter queued",
        Duration::from_secs(30),
        || async { (ns.depth(&dead_queue).await >= n_dead).then_some(()) },
    )
    .await?;
    let page = wait_for("the expired tasks counted", Duration::from_secs(30), || {
        let url = url.clone();
        async move {
            let p = reqwest::get(&url).await.ok()?.text().await.ok()?;
            let expired = metric_sum(
                &p,
                "fleet_tasks_completed_total",
                &[("lane", "normal"), ("outcome", "expired")],
            ) as usize;
            (expired >= n_expired).then_some(p)
        }
    })
    .await
    .unwrap_or(page);
    let c = |outcome: &str| {
        metric_sum(
            &page,
            "fleet_tasks_completed_total",
            &[("lane", "normal"), ("outcome", outcome)],
        ) as usize
    };
    assert_eq!(c("succeeded"), n_ok);
    assert_eq!(c("retried"), n_fail, "one retry each (max_attempts 2)");
    assert_eq!(c("dead"), n_fail);
    assert_eq!(
        c("expired"),
        n_expired,
        "expired at the scheduler, never run"
    );
    assert_eq!(c("failed"), 0);
    let runs = n_ok + 2 * n_fail;
    assert_eq!(
        metric_sum(
            &page,
            "fleet_task_run_seconds_count",
            &[("group", group), ("lane", "normal")]
        ) as usize,
        runs
    );
    assert_eq!(
        metric_sum(
            &page,
            "fleet_task_wait_seconds_count",
            &[("lane", "normal")]
        ) as usize,
        runs
    );
    assert_eq!(
        metric_sum(
            &page,
            "fleet_tasks_dispatched_total",
            &[("group", group), ("lane", "normal")]
        ) as usize,
        runs
    );
    assert_eq!(
        metric_sum(&page, "fleet_tasks_submitted_total", &[("lane", "normal")]) as usize,
        n_ok + n_fail + n_expired
    );
    assert_eq!(
        metric_sum(
            &page,
            "fleet_tasks_rejected_total",
            &[("reason", "malformed_json")]
        ) as usize,
        n_bad
    );
    assert_eq!(
        metric_sum(
            &page,
            "fleet_worker_info",
            &[("worker", "w-metrics"), ("group", group)]
        ),
        1.0
    );
    // Dead letters: the failed tasks plus the refused envelopes, each with its reason.
    let dead = ns.drain_dead().await?;
    let reasons: Vec<_> = dead.iter().filter_map(|(_, r)| r.clone()).collect();
    assert_eq!(
        reasons.iter().filter(|r| *r == "max_attempts").count(),
        n_fail
    );
    assert_eq!(
        reasons.iter().filter(|r| *r == "malformed_json").count(),
        n_bad
    );
    assert_eq!(
        reasons.iter().filter(|r| *r == "expired").count(),
        n_expired
    );
    // Gauges sampled by the scheduler: its stats loop sets them on its next tick.
    let metrics_url = sched.url("/metrics");
    let sp = wait_for("the group gauges sampled", Duration::from_secs(30), || {
        let url = metrics_url.clone();
        async move {
            let p = reqwest::get(&url).await.ok()?.text().await.ok()?;
            let sampled = metric_sum(&p, "fleet_group_capacity", &[("group", group)]) > 0.0
                && metric_sum(&p, "fleet_workers", &[("state", "active")]) > 0.0;
            sampled.then_some(p)
        }
    })
    .await?;
    assert_eq!(
        metric_sum(&sp, "fleet_group_capacity", &[("group", group)]),
        4.0
    );
    assert_eq!(
        metric_sum(&sp, "fleet_workers", &[("state", "active")]),
        1.0
    );
    assert_eq!(metric_sum(&sp, "fleet_pressure_state", &[]), 0.0);
    assert!(sp.contains("# HELP fleet_tasks_completed_total"));
    let r = reqwest::get(sched.url("/readyz")).await?;
    assert_eq!(r.status().as_u16(), 200);
    let r = reqwest::get(format!("http://{}/readyz", w.addr)).await?;
    assert_eq!(r.status().as_u16(), 200);
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
