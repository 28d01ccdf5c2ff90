//! The scheduler's health probes are never a user's task (issue 10 §11). Probes are `noop`
//! tasks the worker answers itself (under every executor), so a worker is made too slow for
//! them by stopping it: SIGSTOP while probes keep coming (the scheduler's probe timeout, 1 s,
//! passes and the worker is evicted), then kill -9 with those probes delivered and unacked, and
//! a restart with the same id. The restarted worker gets the stale probes back past their
//! deadline: they expire — and none reaches the dead-letter queue, none is counted in the
//! user-task figures (`fleet_tasks_completed_total`, `GET /v1/workers`).

use std::time::{Duration, Instant};

use fleet::broker::amqp;
use fleet_tests::*;
use lapin::options::BasicGetOptions;
use serde_json::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn probes_never_reach_the_dead_letter_queue_nor_user_counters() -> anyhow::Result<()> {
    own_process!();
    let ns = Ns::new().await?;
    let ep = Endpoint::start(50).await?;
    let sched = start_scheduler(
        &ns,
        &[
            ("health_interval_ms", "300"),
            ("heartbeat_timeout_ms", "1500"),
            ("probe_interval_ms", "300"),
            ("probe_timeout_ms", "1000"),
        ],
    )
    .await?;
    let sched_metrics = sched.url("/metrics");
    let port = free_port()?;
    let addr = format!("127.0.0.1:{port}");
    let extra: &[(&str, &str)] = &[("http_addr", addr.as_str()), ("critical_capacity", "4")];
    let spec = ProcessSpec {
        id: "w-slow",
        labels: "",
        capacity: 4,
        endpoint: &ep.url,
        extra,
    };
    let mut w = WorkerProcess::spawn(&ns, &spec)?;
    w.wait_state(&ns.store, "active", Duration::from_secs(30))
        .await?;
    let probes_ok = || async {
        metric(&sched_metrics, "fleet_probe_seconds_count", &[])
            .await
            .unwrap_or(0.0)
    };
    wait_for(
        "2 probes through the worker",
        Duration::from_secs(30),
        || async { (probes_ok().await >= 2.0).then_some(()) },
    )
    .await?;

    let before = jobs(10, "", None);
    let before_ids: Vec<String> = before.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ns.submit(&before).await?, (10, 0));
    wait_succeeded(&ns, &before_ids, Duration::from_secs(30)).await?;

    // Too slow for its probes: stopped while they keep coming, then killed with them unacked.
    w.signal("STOP")?;
    let failures_before = metric(&sched_metrics, "fleet_probe_failures_total", &[]).await? + 0.0;
    wait_gone(&ns.store, "w-slow", Duration::from_secs(15)).await?;
    wait_for("2 probes failed", Duration::from_secs(15), || async {
        let f = metric(&sched_metrics, "fleet_probe_failures_total", &[])
            .await
            .ok()?;
        (f >= failures_before + 2.0).then_some(())
    })
    .await?;
    let critical = ns.names.group_queue("protocol=http", fleet::Lane::Critical);
    w.kill9()?;
    ep.mark_dead("w-slow");
    let restarted = Instant::now();
    let mut w = WorkerProcess::spawn(&ns, &spec)?;
    w.wait_state(&ns.store, "active", Duration::from_secs(30))
        .await?;
    let after = jobs(10, "", None);
    let after_ids: Vec<String> = after.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ns.submit(&after).await?, (10, 0));
    wait_succeeded(&ns, &after_ids, Duration::from_secs(60)).await?;
    // Probes pass again, and the stale ones are gone from the critical queue.
    let ok_now = probes_ok().await;
    wait_for(
        "a probe through the restarted worker",
        Duration::from_secs(30),
        || async { (probes_ok().await >= ok_now + 1.0).then_some(()) },
    )
    .await?;
    wait_for(
        "the critical queue empty",
        Duration::from_secs(15),
        || async { (ns.depth(&critical).await == 0).then_some(()) },
    )
    .await?;

    let page = reqwest::get(format!("http://{addr}/metrics"))
        .await?
        .text()
        .await?;
    let user_completed = metric_sum(&page, "fleet_tasks_completed_total", &[]) + 0.0;
    let probes_expired = metric_sum(
        &page,
        "fleet_probes_completed_total",
        &[("outcome", "expired")],
    ) + 0.0;
    let probes_completed = metric_sum(&page, "fleet_probes_completed_total", &[]) + 0.0;
    let probe_failures = metric(&sched_metrics, "fleet_probe_failures_total", &[]).await? + 0.0;
    let view = wait_for(
        "the restarted worker's figures",
        Duration::from_secs(10),
        || async {
            worker(&ns.store, "w-slow")
                .await
                .filter(|v| v.succeeded >= 10)
        },
    )
    .await?;
    let ch = ns.conn.create_channel().await?;
    let mut letters = Vec::new();
    while let Some(m) = ch
        .basic_get(
            ns.names.dead_queue().as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await?
    {
        letters.push(m.delivery);
    }
    let probe_letters = letters
        .iter()
        .filter(|d| {
            let id = serde_json::from_slice::<Value>(&d.data)
                .ok()
                .and_then(|v| v.get("id").and_then(Value::as_str).map(str::to_string))
                .unwrap_or_default();
            amqp::header_text(&d.properties, amqp::PROBE_HEADER).is_some()
                || id.starts_with("probe-")
        })
        .count();
    let restarted_user = ep
        .calls_of("w-slow")
        .iter()
        .filter(|c| c.at >= restarted && c.answered.is_some())
        .count();
    println!(
        "probes: scheduler probe failures {probe_failures}; restarted worker: probes completed {probes_completed} (expired {probes_expired}), \
         user tasks completed (metric) {user_completed} = user calls {restarted_user}; GET /v1/workers succeeded {} dead {} expired {}; \
         dead letters {} of which probes {probe_letters}",
        view.succeeded,
        view.dead,
        view.expired,
        letters.len()
    );
    assert_eq!(probe_letters, 0, "no probe in the dead-letter queue");
    assert!(letters.is_empty(), "nothing at all dead-lettered");
    assert!(
        probe_failures >= 2.0,
        "probes did fail while the worker was stopped"
    );
    assert!(
        probes_expired >= 1.0,
        "the restarted worker got stale probes back and let them expire"
    );
    assert_eq!(
        user_completed, restarted_user as f64,
        "user-task counter = the user tasks it ran"
    );
    assert_eq!(view.succeeded, restarted_user as u64);
    assert_eq!(
        (view.dead, view.expired),
        (0, 0),
        "no probe counted as a user's dead or expired task"
    );

    w.signal("TERM")?;
    w.wait_exit(Duration::from_secs(30)).await?;
    sched.stop().await?;
    ns.cleanup().await
}
