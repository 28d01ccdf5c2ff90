//! A run's slot is given back however its attempt ends (issue 37 item 4: after a node loss a
//! worker kept `running=1` with every task done, and SIGTERM waited its whole grace).
//!
//! The path made here: a run ends while the broker cannot take its outcome — a private node
//! under a memory alarm blocks the worker's connection, so the retry publish of a failed run
//! is never confirmed (nor failed), the same as a channel whose connection died mid-publish
//! without failing its pending confirms. Before the fix the attempt waited on that confirm
//! forever, holding its lane permit and its `running` count; now the confirm wait is bounded
//! (`fleet_worker::broker::CONFIRM_WAIT`), the attempt ends (requeued, its attempt spent) and
//! the count is released by a guard no way out of the attempt can skip.

use std::time::{Duration, Instant};

use fleet_tests::*;
use fleet_worker::executor::{handler_fn, TaskError};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_whose_outcome_cannot_be_published_gives_its_slot_back() -> anyhow::Result<()> {
    let rabbit = PrivateRabbit::start("", "[].\n").await?;
    let ns = Ns::on_broker(&rabbit.url()).await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let labels = "case=slot-release";
    let attempts = Attempts::default();
    let gate = Gate::default();
    let (a, g) = (attempts.clone(), gate.clone());
    let failing = handler_fn(move |ctx| {
        let (a, g) = (a.clone(), g.clone());
        async move {
            a.record(&ctx.envelope.id, ctx.attempt);
            g.pass(&ctx.envelope.id).await;
            Err::<serde_json::Value, _>(TaskError::retryable("fails"))
        }
    });
    let w = start_worker(&ns, "w-slot", labels, 2, &[], &[("gated_fail", failing)]).await?;
    let status = format!("http://{}/status", w.addr);
    let running = || async {
        get_json(&status)
            .await
            .ok()
            .and_then(|s| s["running"].as_u64())
    };

    let mut t = task("gated_fail", json!({}), labels);
    t.max_attempts = Some(3);
    ns.submit(std::slice::from_ref(&t)).await?;
    wait_for("attempt 1 running", Duration::from_secs(30), || async {
        (attempts.of(&t.id) == vec![1] && running().await == Some(1)).then_some(())
    })
    .await?;

    rabbit
        .ctl(&["set_vm_memory_high_watermark", "absolute", "1"])
        .await?;
    gate.open(&t.id);
    // The run has ended; its retry publish blocks the worker's connection.
    wait_for(
        "a connection blocked by the alarm",
        Duration::from_secs(30),
        || async {
            let conns = rabbit.ctl(&["list_connections", "state"]).await.ok()?;
            conns.lines().any(|l| l.trim() == "blocked").then_some(())
        },
    )
    .await?;
    let blocked = Instant::now();
    let r = wait_for(
        "the worker's running count back to 0",
        Duration::from_secs(30),
        || async { (running().await == Some(0)).then_some(()) },
    )
    .await;
    println!(
        "running back to 0 {:.1} s after the connection blocked (result: {})",
        blocked.elapsed().as_secs_f64(),
        if r.is_ok() { "ok" } else { "still 1" }
    );
    rabbit.ctl(&["set_vm_memory_high_watermark", "0.4"]).await?;
    r?;
    // Each attempt number runs once, the last ends the task.
    for n in [2, 3] {
        wait_for(
            "the next attempt running",
            Duration::from_secs(60),
            || async { attempts.of(&t.id).contains(&n).then_some(()) },
        )
        .await?;
        gate.open(&t.id);
    }
    ns.wait_state(&t.id, "dead", Duration::from_secs(60))
        .await?;
    ns.wait_settled(Duration::from_secs(30)).await?;
    assert_eq!(attempts.of(&t.id), vec![1, 2, 3]);
    assert_eq!(running().await, Some(0));

    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await?;
    drop(rabbit);
    Ok(())
}
