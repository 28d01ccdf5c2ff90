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
    own_process!();
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
    // The exact name (followed by its closing quote in client_properties): the scheduler's
    // prober connection is named "<name> probe".
    let exact = format!("{name}\"");
    let pids: Vec<String> = list
        .lines()
        .filter(|l| l.contains(&exact))
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

/// After its broker restarts, a worker's two lanes consume again together: a lane whose
/// channel went with the connection adds no backoff of its own (the connection's reconnect
/// is shared), and a lane pausing after a channel error resumes as soon as the other lane
/// consumes (issue 37 item 5: the critical lane — health probes and critical work — came back
/// up to ~10 s after the normal lane). Three restarts of a private node; the gap between the
/// lanes' first consume after each restart is printed and must stay under 1.5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_lanes_consume_again_together_after_a_broker_restart() -> anyhow::Result<()> {
    let rabbit = PrivateRabbit::start("", "[].\n").await?;
    let ns = Ns::on_broker(&rabbit.url()).await?;
    let w = start_worker(&ns, "w-lanes", "pool=lanes", 2, &[], &[]).await?;
    let status = format!("http://{}/status", w.addr);
    let lanes = |v: &serde_json::Value| {
        let on = |lane: &str| {
            v["consuming"][lane]
                .as_array()
                .is_some_and(|q| !q.is_empty())
        };
        (on("normal"), on("critical"))
    };
    let mut gaps = Vec::new();
    for round in 1..=3 {
        rabbit.ctl(&["stop_app"]).await?;
        wait_for("both lanes lost", Duration::from_secs(20), || async {
            let v = get_json(&status).await.ok()?;
            (lanes(&v) == (false, false)).then_some(())
        })
        .await?;
        rabbit.ctl(&["start_app"]).await?;
        // When each lane first consumes, polled every 20 ms within a 60 s bound.
        let first = std::sync::Mutex::new((None, None));
        let t0 = std::time::Instant::now();
        let both = wait_for_every(
            &format!("restart {round}: both lanes consuming"),
            Duration::from_secs(60),
            Duration::from_millis(20),
            || async {
                let v = tokio::time::timeout(Duration::from_secs(2), get_json(&status))
                    .await
                    .ok()?
                    .ok()?;
                let (n, c) = lanes(&v);
                let mut seen = first.lock().ok()?;
                if n && seen.0.is_none() {
                    seen.0 = Some(t0.elapsed());
                }
                if c && seen.1.is_none() {
                    seen.1 = Some(t0.elapsed());
                }
                seen.0.zip(seen.1)
            },
        )
        .await;
        let (n, c) = both.with_context(|| {
            format!(
                "lanes first consuming (normal, critical): {:?}",
                first.lock().map(|s| *s).ok()
            )
        })?;
        let gap = n.abs_diff(c);
        println!(
            "restart {round}: normal lane consuming after {} ms, critical after {} ms (gap {} ms)",
            n.as_millis(),
            c.as_millis(),
            gap.as_millis()
        );
        gaps.push(gap);
    }
    w.stop().await?;
    // The fixture's own connection went with the restarts; the private node (and its queues)
    // goes with the test: only the namespace's Redis keys are left to delete.
    ns.store.delete_namespace().await?;
    for g in gaps {
        assert!(
            g < Duration::from_millis(1500),
            "lanes came back {g:?} apart"
        );
    }
    Ok(())
}
