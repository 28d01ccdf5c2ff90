//! The priority lane: critical tasks and probes keep flowing while the normal lane is
//! saturated and Red, and a critical flood beyond its small bound is refused.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fleet::{Envelope, Lane};
use fleet_tests::*;
use fleet_worker::executor::handler_fn;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn critical_work_and_probes_flow_while_normal_lane_is_saturated() -> anyhow::Result<()> {
    own_process!();
    let ns = Ns::new().await?;
    let starts: Arc<Mutex<HashMap<String, chrono::DateTime<chrono::Utc>>>> = Arc::default();
    let s2 = starts.clone();
    let stamp = handler_fn(move |ctx| {
        let s = s2.clone();
        async move {
            if let Ok(mut m) = s.lock() {
                m.insert(ctx.envelope.id.clone(), chrono::Utc::now());
            }
            let ms = ctx
                .envelope
                .payload
                .get("ms")
                .and_then(|v| v.as_u64())
                .unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Ok(serde_json::Value::Null)
        }
    });
    let h = [("stamp", stamp)];
    let sched = start_scheduler(
        &ns,
        &[
            ("ingress_max_normal", "20"),
            ("max_pending", "10"),
            ("probe_interval_ms", "300"),
        ],
    )
    .await?;
    let w = start_worker(&ns, "w1", "", 2, &[("critical_capacity", "1")], &h).await?;

    // Fill both normal slots with long tasks and queue 30 more behind them: the only group
    // takes them straight into its queue (one candidate: no park hop), past its room (no
    // completion measured yet: 2 slots × 2 × the seed factor 4 = 16), so 2 + 30 - 16 = 16
    // wait beyond it (max_pending 10: the workers are behind, the gate turns Red); then
    // flood the normal lane far past its bound.
    let long: Vec<Envelope> = (0..2)
        .map(|_| task("stamp", json!({"ms": 4000}), ""))
        .collect();
    ns.submit(&long).await?;
    wait_for("normal slots busy", Duration::from_secs(10), || async {
        (starts.lock().ok()?.len() == 2).then_some(())
    })
    .await?;
    let behind: Vec<Envelope> = (0..30)
        .map(|_| task("stamp", json!({"ms": 10}), ""))
        .collect();
    ns.submit(&behind).await?;
    wait_for("pressure red", Duration::from_secs(10), || async {
        let p = get_json(&sched.url("/v1/pressure")).await.ok()?;
        (p["gate"] == "red").then_some(())
    })
    .await?;
    // The ingress loops act on that sample once their current batch is done (the behind tasks
    // now go straight to the group queue, so a loop may still be publishing them): the flood
    // must find intake closed — no consumer left on the normal ingress queue.
    let ingress = ns.names.ingress_queue(Lane::Normal);
    // What the paused loops handed back (prefetched, not yet dispatched) waits in the ingress
    // queue and takes its share of the bound.
    let waiting = wait_for("normal intake paused", Duration::from_secs(10), || async {
        let ch = ns.conn.create_channel().await.ok()?;
        let q = ch
            .queue_declare(
                ingress.as_str().into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .ok()?;
        let _ = ch.close(200, "ok".into()).await;
        (q.consumer_count() == 0).then_some(q.message_count() as usize)
    })
    .await?;
    let flood: Vec<Envelope> = (0..60)
        .map(|_| task("stamp", json!({"ms": 10}), ""))
        .collect();
    let accepted = ns.submit_each(&flood).await?;
    let refused = accepted.iter().filter(|a| !**a).count();
    assert_eq!(
        refused,
        60 - (20 - waiting),
        "the normal flood is refused past the ingress bound of 20 ({waiting} already waiting)"
    );

    // Critical tasks start and finish while the long normal tasks still run.
    let mut crit = Vec::new();
    for _ in 0..5 {
        let mut e = task("stamp", json!({"ms": 10}), "");
        e.lane = Lane::Critical;
        crit.push(e);
    }
    ns.submit(&crit).await?;
    let done = wait_for("critical tasks", Duration::from_secs(3), || async {
        let mut out = Vec::new();
        for e in &crit {
            let st = ns.status(&e.id).await.ok()??;
            (st.get("state")? == "succeeded").then_some(())?;
            out.push(st);
        }
        Some(out)
    })
    .await?;
    assert_eq!(done.len(), 5);
    let m = starts.lock().map(|m| m.clone()).unwrap_or_default();
    let first_flood_start = flood.iter().filter_map(|e| m.get(&e.id)).min().copied();
    let last_crit_start = crit.iter().filter_map(|e| m.get(&e.id)).max().copied();
    assert!(last_crit_start.is_some());
    if let (Some(f), Some(c)) = (first_flood_start, last_crit_start) {
        assert!(
            c < f,
            "every critical task starts before any queued normal task"
        );
    }
    // The long tasks are still running: the critical work got through during the flood.
    let long_running = long.iter().all(|e| m.contains_key(&e.id));
    assert!(long_running);
    for e in &long {
        let st = ns.status(&e.id).await?.unwrap_or_default();
        assert_eq!(st.get("state").map(String::as_str), Some("running"));
    }
    // Probes keep succeeding through the critical lane.
    let groups = wait_for("a probe result", Duration::from_secs(5), || async {
        let g = get_json(&sched.url("/v1/groups")).await.ok()?;
        g.as_array()?.first()?.get("probe_ok")?.as_bool().map(|_| g)
    })
    .await?;
    assert_eq!(groups[0]["probe_ok"], true, "{groups}");
    let page = reqwest::get(sched.url("/metrics")).await?.text().await?;
    assert!(metric_sum(&page, "fleet_probe_seconds_count", &[]) >= 1.0);
    assert_eq!(metric_sum(&page, "fleet_probe_failures_total", &[]), 0.0);

    w.force.cancel();
    let _ = w.stop().await;
    sched.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn critical_flood_beyond_its_bound_is_refused() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let h = [("record", rec.handler())];
    let sched = start_scheduler(
        &ns,
        &[
            ("ingress_max_critical", "5"),
            ("park_max_critical", "5"),
            ("probe_interval_ms", "60000"),
        ],
    )
    .await?;
    let w = start_worker(&ns, "w1", "", 2, &[("critical_capacity", "1")], &h).await?;
    let flood: Vec<Envelope> = (0..200)
        .map(|_| {
            let mut e = task("record", json!({"ms": 200}), "");
            e.lane = Lane::Critical;
            e
        })
        .collect();
    let mut accepted = Vec::new();
    let mut refused = 0;
    for chunk in flood.chunks(20) {
        for (e, ok) in chunk.iter().zip(ns.submit_each(chunk).await?) {
            if ok {
                accepted.push(e.id.clone());
            } else {
                refused += 1;
            }
        }
        scenario_pause(Duration::from_millis(50), "the pace of the flood").await;
    }
    println!(
        "critical flood: {} accepted, {refused} refused",
        accepted.len()
    );
    assert!(
        refused > 100,
        "a critical flood must be refused, not queued without limit ({refused} refused)"
    );
    // What was accepted still runs.
    let n = accepted.len();
    wait_for(
        "accepted critical tasks",
        Duration::from_secs(60),
        || async { (rec.count() >= n).then_some(()) },
    )
    .await?;
    assert_eq!(rec.count(), n);
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
