//! A broker that holds publishes back (a memory alarm: RabbitMQ blocks every publishing
//! connection) must not hold the scheduler's stop. On a private RabbitMQ node: a scheduler is
//! ready, the node's memory watermark is set to 1 byte, a schedule is added over the API (its
//! record's publish then waits on a confirm that never comes), and the scheduler is stopped.
//! Before the fix the API handler held the session's publisher lock across that confirm and
//! the stop waited for the lock forever.

use std::time::{Duration, Instant};

use fleet_tests::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_publish_held_by_a_memory_alarm_does_not_hold_the_stop() -> anyhow::Result<()> {
    let rabbit = PrivateRabbit::start("", "[].\n").await?;
    let ns = Ns::on_broker(&rabbit.url()).await?;
    let sched = start_scheduler(&ns, &[]).await?;

    rabbit
        .ctl(&["set_vm_memory_high_watermark", "absolute", "1"])
        .await?;
    let url = sched.url("/v1/schedules");
    let spec =
        json!({"name": "alarm", "cron": "0 0 * * * *", "task": {"kind": "noop", "payload": {}}});
    // A client that waits as long as the server does (the harness's gives up after 30 s, and
    // its leaving would end the handler and free what it holds).
    let patient = reqwest::Client::new();
    let add = tokio::spawn(async move {
        patient
            .post(&url)
            .json(&spec)
            .send()
            .await
            .map(|r| r.status().as_u16())
    });
    // The API's publish is in flight once the broker has blocked the scheduler's connection.
    wait_for(
        "the scheduler's connection blocked by the alarm",
        Duration::from_secs(30),
        || async {
            // The scheduler's is the one connection here that publishes ("blocking" until then).
            let conns = rabbit.ctl(&["list_connections", "state"]).await.ok()?;
            conns.lines().any(|l| l.trim() == "blocked").then_some(())
        },
    )
    .await?;
    assert!(
        !add.is_finished(),
        "the schedule's record was published under the alarm"
    );

    let asked = Instant::now();
    sched.shutdown.cancel();
    let stopped = tokio::time::timeout(Duration::from_secs(60), sched.join).await;
    let took = asked.elapsed();
    println!(
        "scheduler stop under a memory alarm, with an API publish in flight: {:.1} s",
        took.as_secs_f64()
    );
    let Ok(joined) = stopped else {
        panic!("the scheduler did not stop within 60 s under the alarm")
    };
    joined??;
    // Each stop stage is bounded (the session's loops 10 s, the connection close 5 s, the
    // HTTP server 10 s): what the alarm holds waits out those limits, no longer.
    assert!(took < Duration::from_secs(45), "the stop took {took:?}");
    add.abort();

    rabbit.ctl(&["set_vm_memory_high_watermark", "0.4"]).await?;
    ns.cleanup().await?;
    drop(rabbit);
    Ok(())
}

/// A frozen broker (SIGSTOP: connections stay open, nothing answers): the scheduler cannot
/// sample the fleet, and `GET /v1/pressure` says its figures are stale instead of serving the
/// last ones as current (the console shows "stale" from it); once the node wakes, fresh again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pressure_says_stale_while_the_broker_is_frozen() -> anyhow::Result<()> {
    let rabbit = PrivateRabbit::start("", "[].\n").await?;
    let ns = Ns::on_broker(&rabbit.url()).await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let url = sched.url("/v1/pressure");
    let fresh = |p: &serde_json::Value| {
        p["stale"] == false && p["age_ms"].as_i64().is_some_and(|a| a < 5_000)
    };
    wait_for(
        "a fresh pressure sample",
        Duration::from_secs(20),
        || async { get_json(&url).await.ok().filter(|p| fresh(p)) },
    )
    .await?;

    rabbit.signal_group("STOP")?;
    let frozen = Instant::now();
    // Stale after five pressure intervals, at least 5 s (`fleet_scheduler::api::stale_after`).
    let p = wait_for(
        "the sample called stale",
        Duration::from_secs(20),
        || async { get_json(&url).await.ok().filter(|p| p["stale"] == true) },
    )
    .await;
    rabbit.signal_group("CONT")?;
    let p = p?;
    println!(
        "frozen broker: stale after {:.1} s, age_ms {}",
        frozen.elapsed().as_secs_f64(),
        p["age_ms"]
    );
    assert!(p["age_ms"].as_i64().is_some_and(|a| a >= 5_000), "{p}");

    wait_for(
        "a fresh sample after the node woke",
        Duration::from_secs(60),
        || async { get_json(&url).await.ok().filter(|p| fresh(p)) },
    )
    .await?;
    sched.stop().await?;
    ns.cleanup().await?;
    drop(rabbit);
    Ok(())
}
