//! The scheduler survives losing its RabbitMQ connection: it logs, reconnects with backoff,
//! declares its topology again and keeps dispatching; nothing accepted is lost.

use std::time::Duration;

use anyhow::Context;
use fleet_tests::*;
use serde_json::json;

fn rabbitmqctl(args: &[&str]) -> Option<String> {
    let out = std::process::Command::new("rabbitmqctl")
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scheduler_reconnects_after_losing_rabbitmq() -> anyhow::Result<()> {
    if rabbitmqctl(&["status"]).is_none() {
        return missing_servers("rabbitmqctl not available");
    }
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let h = [("record", rec.handler())];
    let sched = start_scheduler(&ns, &[]).await?;
    let w = start_worker(&ns, "w1", "", 8, &[], &h).await?;
    let first: Vec<_> = (0..100).map(|_| task("record", json!({}), "")).collect();
    ns.submit(&first).await?;
    wait_for("first 100", Duration::from_secs(30), || async {
        (rec.count() >= 100).then_some(())
    })
    .await?;

    let name = format!("fleet-scheduler {}", ns.name);
    let list = tokio::task::spawn_blocking(|| {
        rabbitmqctl(&["list_connections", "pid", "client_properties"])
    })
    .await?
    .context("list_connections")?;
    let pids: Vec<String> = list
        .lines()
        .filter(|l| l.contains(&name))
        .filter_map(|l| l.split_whitespace().next().map(String::from))
        .collect();
    assert_eq!(pids.len(), 1, "one scheduler connection named {name}");
    let pid = pids[0].clone();
    tokio::task::spawn_blocking(move || {
        rabbitmqctl(&["close_connection", &pid, "test: simulated connection loss"])
    })
    .await?
    .context("close_connection")?;

    // It comes back by itself (ready again) and dispatches new work.
    let client = reqwest::Client::new();
    wait_for("scheduler ready again", Duration::from_secs(30), || {
        let (c, u) = (client.clone(), sched.url("/readyz"));
        async move {
            c.get(&u)
                .send()
                .await
                .ok()
                .filter(|r| r.status().is_success())
                .map(|_| ())
        }
    })
    .await?;
    let second: Vec<_> = (0..100).map(|_| task("record", json!({}), "")).collect();
    assert_eq!(ns.submit(&second).await?, (100, 0));
    wait_for("second 100", Duration::from_secs(30), || async {
        let per = rec.per_task();
        second.iter().all(|e| per.contains_key(&e.id)).then_some(())
    })
    .await?;
    let per = rec.per_task();
    assert!(
        first
            .iter()
            .chain(second.iter())
            .all(|e| per.contains_key(&e.id)),
        "every accepted task ran"
    );
    let page = reqwest::get(sched.url("/metrics")).await?.text().await?;
    assert!(metric_sum(&page, "fleet_amqp_reconnects_total", &[]) >= 1.0);
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
