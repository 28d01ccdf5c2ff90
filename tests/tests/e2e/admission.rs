//! Admission control end to end: pressure, bounded ingress with refusals, the cluster-wide
//! rate limit, delayed tasks, idempotent submission, HTTP status codes.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use fleet::{Envelope, Lane};
use fleet_tests::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn overload_is_refused_and_every_accepted_task_completes() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let h = [("record", rec.handler())];
    let bound = 100u32;
    let sched =
        start_scheduler(&ns, &[("ingress_max_normal", "100"), ("max_pending", "60")]).await?;
    let w = start_worker(&ns, "w1", "", 4, &[], &h).await?;
    // Fleet capacity: 4 slots × 100 ms = 40 tasks/s. Offer ~10× that for 3 s.
    let mut accepted: HashSet<String> = HashSet::new();
    let mut refused = 0usize;
    let mut max_depth = 0u32;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(3) {
        let envs: Vec<Envelope> = (0..40)
            .map(|_| task("record", json!({"ms": 100}), ""))
            .collect();
        for (e, ok) in envs.iter().zip(ns.submit_each(&envs).await?) {
            if ok {
                accepted.insert(e.id.clone());
            } else {
                refused += 1;
            }
        }
        max_depth = max_depth.max(ns.depth(&ns.names.ingress_queue(Lane::Normal)).await);
        scenario_pause(
            Duration::from_millis(100),
            "the pace of the offered load: 40 every ~100 ms",
        )
        .await;
    }
    println!(
        "overload: accepted {} refused {} max ingress depth {max_depth} (bound {bound})",
        accepted.len(),
        refused
    );
    assert!(refused > 0, "producers must be refused under 10x overload");
    // New publishes are refused at the bound. When Red pauses intake, the deliveries the
    // scheduler had prefetched (4 loops × at most `bound` each) return to the queue on top of
    // it: that, and no more, is the most the queue may hold.
    let returned = 4 * bound;
    assert!(
        max_depth <= bound + returned,
        "ingress depth {max_depth} passed its bound {bound} + {returned} returned"
    );
    let n = accepted.len();
    wait_for("every accepted task", Duration::from_secs(90), || async {
        (rec.count() >= n).then_some(())
    })
    .await?;
    // Barrier: queues empty and nothing reserved or running, so no further run can start.
    ns.wait_settled(Duration::from_secs(30)).await?;
    let ran: HashSet<String> = rec.per_task().into_keys().collect();
    assert_eq!(ran, accepted, "accepted = completed, exactly");
    assert_eq!(rec.count(), n, "none ran twice");
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn red_pressure_refuses_normal_work_but_not_critical() -> anyhow::Result<()> {
    own_process!();
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let h = [("record", rec.handler())];
    let sched = start_scheduler(&ns, &[("ingress_max_normal", "3"), ("max_pending", "10")]).await?;
    let w = start_worker(&ns, "w1", "", 1, &[("critical_capacity", "1")], &h).await?;
    // One long task fills the only normal slot: load 1.0, a busy fleet — Green, intake open
    // (issue 29 item 3). The state turns Red once work waits beyond the group's room
    // (parked or queued past it ≥ 0.9 × 10), which the submissions below make.
    ns.submit(&[task("record", json!({"ms": 4000}), "")])
        .await?;
    let p = wait_for("the only slot busy", Duration::from_secs(10), || async {
        let p = get_json(&sched.url("/v1/pressure")).await.ok()?;
        (p["load"].as_f64() == Some(1.0)).then_some(p)
    })
    .await?;
    assert_eq!(
        (p["state"].as_str(), p["gate"].as_str()),
        (Some("green"), Some("green")),
        "a fully busy fleet is Green: {p}"
    );

    // Red closes the intake gate; HTTP producers are admitted like AMQP ones — while the
    // ingress queue has room they are accepted, at its bound refused: 429 pressure_red.
    let c = reqwest::Client::new();
    let mut accepted = 0;
    let refusal = loop {
        let r = c
            .post(sched.url("/v1/tasks"))
            .json(&json!({"kind": "record"}))
            .send()
            .await?;
        match r.status().as_u16() {
            202 => accepted += 1,
            429 => break r,
            // The ingress filled before the pressure loop (every 250 ms) closed the intake
            // gate: a busy machine can lag one interval. Wait for the gate, then go on.
            503 => {
                wait_for("intake gate red", Duration::from_secs(10), || async {
                    get_json(&sched.url("/v1/pressure"))
                        .await
                        .ok()
                        .filter(|p| p["gate"] == "red")
                        .map(|_| ())
                })
                .await?;
            }
            other => anyhow::bail!("unexpected {other} while Red"),
        }
        anyhow::ensure!(
            accepted < 200,
            "no refusal after {accepted} tasks at an ingress bound of 3"
        );
    };
    assert!(
        accepted >= 3,
        "the ingress queue's room is used first ({accepted})"
    );
    assert!(refusal.headers().get("retry-after").is_some());
    let body: serde_json::Value = refusal.json().await?;
    assert_eq!(body["error"], "pressure_red");
    // Red in the API and the metric (one state).
    wait_for(
        "pressure red in the API and the metric",
        Duration::from_secs(10),
        || async {
            let p = get_json(&sched.url("/v1/pressure")).await.ok()?;
            let page = reqwest::get(sched.url("/metrics"))
                .await
                .ok()?
                .text()
                .await
                .ok()?;
            (p["state"] == "red"
                && p["gate"] == "red"
                && metric_sum(&page, "fleet_pressure_state", &[]) == 2.0)
                .then_some(())
        },
    )
    .await?;
    // An AMQP producer is refused at the same moment.
    assert_eq!(
        ns.submit_each(&[task("record", json!({}), "")]).await?,
        vec![false]
    );
    // The critical lane is not held back by normal-lane pressure.
    let r = c
        .post(sched.url("/v1/tasks"))
        .json(&json!({"kind": "record", "lane": "critical", "id": "crit-1"}))
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 202);
    wait_for("critical task done", Duration::from_secs(10), || async {
        rec.per_task().contains_key("crit-1").then_some(())
    })
    .await?;
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_submit_answers_202_400_429_503() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let h = [("record", rec.handler())];
    // A starved rate limit and a tiny ingress: intake stalls, so ingress fills.
    let sched = start_scheduler(
        &ns,
        &[
            ("rate", "0.01"),
            ("burst", "1"),
            ("batch_max", "1"),
            ("ingress_max_normal", "5"),
        ],
    )
    .await?;
    let w = start_worker(&ns, "w1", "", 4, &[], &h).await?;
    let c = reqwest::Client::new();
    let url = sched.url("/v1/tasks");

    let r = c
        .post(&url)
        .json(&json!([{"kind": "record"}, {"kind": "record", "id": "mine"}]))
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 202);
    let body: serde_json::Value = r.json().await?;
    assert_eq!(body["ids"].as_array().map(Vec::len), Some(2));
    assert_eq!(body["ids"][1], "mine");

    let r = c
        .post(&url)
        .json(&json!([{"kind": "record"}, {"kind": "record", "lane": "bulk"}]))
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 400);
    let body: serde_json::Value = r.json().await?;
    assert_eq!(body["error"], "unknown_lane");
    assert_eq!(body["index"], 1);
    let r = c
        .post(&url)
        .header("content-type", "application/json")
        .body("{oops")
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 400);
    let r = c
        .post(&url)
        .json(&json!({"kind": "x", "not_before": "2099-01-01T00:00:00Z"}))
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 400);

    let mut saw_503 = false;
    for _ in 0..30 {
        let r = c.post(&url).json(&json!({"kind": "record"})).send().await?;
        if r.status().as_u16() == 503 {
            assert!(r.headers().get("retry-after").is_some());
            let body: serde_json::Value = r.json().await?;
            assert_eq!(body["error"], "ingress_full");
            saw_503 = true;
            break;
        }
        assert_eq!(r.status().as_u16(), 202);
    }
    assert!(saw_503, "a full ingress must answer 503");
    w.stop().await?;
    sched.stop().await?;

    // The submission rate limit answers 429 with Retry-After. 0.1/s: the bucket refills in
    // 10 s, so a loaded machine's pause between the two calls cannot refill it.
    // A namespace of its own: the full ingress above must not answer for the limiter here.
    ns.cleanup().await?;
    let ns = Ns::new().await?;
    let sched =
        start_scheduler(&ns, &[("submit_rate", "0.1"), ("ingress_max_normal", "5")]).await?;
    let url = sched.url("/v1/tasks");
    let first = c.post(&url).json(&json!({"kind": "record"})).send().await?;
    assert_eq!(first.status().as_u16(), 202);
    let second = c.post(&url).json(&json!({"kind": "record"})).send().await?;
    assert_eq!(second.status().as_u16(), 429);
    assert!(second.headers().get("retry-after").is_some());
    sched.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rate_limit_holds_across_two_replicas() -> anyhow::Result<()> {
    own_process!();
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let h = [("record", rec.handler())];
    let limit = [("rate", "200"), ("burst", "20")];
    let s1 = start_scheduler(&ns, &limit).await?;
    let s2 = start_scheduler(&ns, &limit).await?;
    let w = start_worker(&ns, "w1", "", 64, &[], &h).await?;
    let envs: Vec<_> = (0..3000).map(|_| task("record", json!({}), "")).collect();
    ns.submit(&envs).await?;
    // Skip the first second (burst), then count 10 s of dispatches.
    scenario_pause(Duration::from_secs(1), "past the burst").await;
    let before = rec.count();
    scenario_pause(Duration::from_secs(10), "the measurement window").await;
    let rate = (rec.count() - before) as f64 / 10.0;
    println!("rate limit 200/s across 2 replicas: measured {rate:.1}/s");
    assert!(
        (170.0..=230.0).contains(&rate),
        "dispatched {rate}/s, limit 200/s ±15%"
    );
    let page = reqwest::get(s1.url("/metrics")).await?.text().await?;
    assert!(metric_sum(&page, "fleet_dispatch_throttled_total", &[]) > 0.0);
    w.force.cancel();
    let _ = w.stop().await;
    s1.stop().await?;
    s2.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn delayed_task_never_starts_early_and_duplicates_run_once() -> anyhow::Result<()> {
    own_process!();
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let starts = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let st2 = starts.clone();
    let stamp = fleet_worker::executor::handler_fn(move |ctx| {
        let st = st2.clone();
        async move {
            if let Ok(mut v) = st.lock() {
                v.push((ctx.envelope.id.clone(), chrono::Utc::now()));
            }
            Ok(serde_json::Value::Null)
        }
    });
    let h = [("record", rec.handler()), ("stamp", stamp)];
    let sched = start_scheduler(&ns, &[]).await?;
    let w = start_worker(&ns, "w1", "", 4, &[], &h).await?;

    let mut delayed = task("stamp", json!({}), "");
    let due = chrono::Utc::now() + chrono::Duration::milliseconds(1500);
    delayed.not_before = Some(due);
    ns.submit(&[delayed.clone()]).await?;
    let st = wait_for("delayed status", Duration::from_secs(5), || async {
        ns.status(&delayed.id).await.ok().flatten()
    })
    .await?;
    assert_eq!(st.get("state").map(String::as_str), Some("delayed"));

    let mut dup = task("record", json!({}), "");
    dup.id = format!("dup-{}", ns.name);
    ns.submit(&[dup.clone(), dup.clone(), dup.clone()]).await?;

    let started = wait_for("delayed task start", Duration::from_secs(15), || async {
        starts
            .lock()
            .ok()?
            .iter()
            .find(|(id, _)| *id == delayed.id)
            .map(|(_, t)| *t)
    })
    .await?;
    assert!(
        started >= due,
        "started {started} before its not_before {due}"
    );
    assert!(
        started - due < chrono::Duration::milliseconds(1500),
        "started too late: {started} vs {due}"
    );

    // Barriers: both duplicates counted, and nothing queued, reserved or running, so no
    // further run of the id can start.
    wait_for("2 duplicates counted", Duration::from_secs(15), || async {
        let page = metrics_page(&sched.url("")).await.ok()?;
        (metric_sum(&page, "fleet_tasks_duplicate_total", &[]) >= 2.0).then_some(())
    })
    .await?;
    ns.wait_settled(Duration::from_secs(15)).await?;
    let runs = rec.per_task();
    assert_eq!(
        runs.get(&dup.id).map(Vec::len),
        Some(1),
        "a duplicate id runs once"
    );
    let page = reqwest::get(sched.url("/metrics")).await?.text().await?;
    assert_eq!(metric_sum(&page, "fleet_tasks_duplicate_total", &[]), 2.0);
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
