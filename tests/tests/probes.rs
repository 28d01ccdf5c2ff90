//! The scheduler's health probes are never a user's task (issue 10 §11): a worker too slow for
//! its probes (each probe call takes 3 s, the probe timeout is 1 s) is killed with kill -9 while
//! probes are in flight and restarted. The probes expire, die with their worker and are run
//! again by the restarted worker — and none reaches the dead-letter queue, none is counted in
//! the user-task figures (`fleet_tasks_completed_total`, `GET /v1/workers`).

mod harness;

use std::time::Duration;

use fleet::amqp;
use fleet_tests::*;
use harness::*;
use lapin::options::BasicGetOptions;
use serde_json::Value;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn probes_never_reach_the_dead_letter_queue_nor_user_counters() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let ep = Endpoint::start_with_probes(50, 3_000).await?;
    let sched = start_scheduler(&ns, &[("health_interval_ms", "300"), ("heartbeat_timeout_ms", "1500"), ("probe_interval_ms", "300"), ("probe_timeout_ms", "1000")]).await?;
    let port = free_port()?;
    let addr = format!("127.0.0.1:{port}");
    let extra: &[(&str, &str)] = &[("http_addr", addr.as_str()), ("critical_capacity", "4")];
    let spec = ProcessSpec { id: "w-slow", labels: "", capacity: 4, endpoint: &ep.url, extra };
    let mut w = WorkerProcess::spawn(&ns, &spec)?;
    w.wait_state(&ns.store, "active", Duration::from_secs(30)).await?;

    // Probes reach the slow handler and expire there.
    wait_for("3 probe calls at the slow endpoint", Duration::from_secs(30), || async { (ep.probes() >= 3).then_some(()) }).await?;
    let jobs_before = jobs(10, "", None);
    assert_eq!(ns.submit(&jobs_before).await?, (10, 0));
    wait_for("the first 10 tasks answered", Duration::from_secs(30), || async { (ep.answered_ids().len() >= 10).then_some(()) }).await?;
    // Killed with probes in flight (each takes 3 s at the endpoint).
    let probes_at_kill = ep.probes();
    w.kill9()?;
    ep.mark_dead("w-slow");
    let restarted = std::time::Instant::now();
    let mut w = WorkerProcess::spawn(&ns, &spec)?;
    w.wait_state(&ns.store, "active", Duration::from_secs(30)).await?;
    let jobs_after = jobs(10, "", None);
    let after_ids: Vec<String> = jobs_after.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ns.submit(&jobs_after).await?, (10, 0));
    wait_succeeded(&ns, &after_ids, Duration::from_secs(60)).await?;
    // Let the restarted worker meet more probes (and the redelivered ones) and let them expire.
    let p = ep.probes();
    wait_for("3 more probe calls", Duration::from_secs(30), || async { (ep.probes() >= p + 3).then_some(()) }).await?;
    tokio::time::sleep(Duration::from_millis(3_500)).await;

    let page = reqwest::get(format!("http://{addr}/metrics")).await?.text().await?;
    let user_completed = metric_sum(&page, "fleet_tasks_completed_total", &[]);
    let probes_completed = metric_sum(&page, "fleet_probes_completed_total", &[]);
    let probe_failures = metric(&sched.url("/metrics"), "fleet_probe_failures_total", &[]).await?;
    let view = worker(&ns.store, "w-slow").await.ok_or_else(|| anyhow::anyhow!("w-slow not registered"))?;
    let ch = ns.conn.create_channel().await?;
    let mut letters = Vec::new();
    while let Some(m) = ch.basic_get(ns.names.dead_queue().as_str().into(), BasicGetOptions { no_ack: true }).await? {
        letters.push(m.delivery);
    }
    let probe_letters = letters
        .iter()
        .filter(|d| {
            let id = serde_json::from_slice::<Value>(&d.data).ok().and_then(|v| v.get("id").and_then(Value::as_str).map(str::to_string)).unwrap_or_default();
            amqp::header_text(&d.properties, amqp::PROBE_HEADER).is_some() || id.starts_with("probe-")
        })
        .count();
    let restarted_user = ep.calls_of("w-slow").iter().filter(|c| c.at >= restarted && c.answered.is_some()).count();
    println!(
        "probes: {} probe calls at the slow endpoint ({probes_at_kill} before the kill); scheduler probe failures {probe_failures}; \
         restarted worker: user tasks completed (metric) {user_completed}, probes completed (metric) {probes_completed}, \
         GET /v1/workers succeeded {} dead {} expired {}; dead letters {} of which probes {probe_letters}",
        ep.probes(),
        view.succeeded,
        view.dead,
        view.expired,
        letters.len()
    );
    assert_eq!(probe_letters, 0, "no probe in the dead-letter queue");
    assert!(letters.is_empty(), "nothing at all dead-lettered");
    assert!(probe_failures >= 1.0, "probes did expire at the slow worker");
    assert!(probes_completed >= 1.0, "the restarted worker ran probes (counted apart)");
    assert_eq!(user_completed, restarted_user as f64, "user-task counter = the user tasks it ran");
    assert_eq!(view.succeeded, restarted_user as u64);
    assert_eq!((view.dead, view.expired), (0, 0), "no probe counted as a user's dead or expired task");

    w.signal("TERM")?;
    w.wait_exit(Duration::from_secs(30)).await?;
    sched.stop().await?;
    ns.cleanup().await
}
