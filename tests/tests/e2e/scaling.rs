//! The autoscaling API (issue 35 item 2): `GET /v1/scaling`, its `?group=&lane=` flat form
//! and the `fleet_scaling_*` gauges. A paused group's backlog is blocked `paused`, not ready;
//! an over-limit key's backlog is blocked `over_key_limit`, not ready; a group with more work
//! than slots reports exactly that work ready with a positive age. Every count is exact: the
//! tasks wait in queues whose depth the stats loop reads, and the test waits for a sample that
//! shows them.

use std::time::Duration;

use anyhow::ensure;
use fleet_tests::*;
use serde_json::{json, Value};

/// The name of the group whose labels contain `label` (from `GET /v1/groups`).
async fn group_name(sched: &SchedulerHandle, label: &str) -> anyhow::Result<String> {
    wait_for("the group registered", Duration::from_secs(20), || async {
        let v = get_json(&sched.url("/v1/groups")).await.ok()?;
        v.as_array()?
            .iter()
            .filter_map(|g| g["group"].as_str())
            .find(|n| n.contains(label))
            .map(str::to_string)
    })
    .await
}

/// `GET /v1/scaling?group=G&lane=L` (percent-encoded).
async fn flat(sched: &SchedulerHandle, group: &str, lane: &str) -> anyhow::Result<Value> {
    let url = reqwest::Url::parse_with_params(
        &sched.url("/v1/scaling"),
        &[("group", group), ("lane", lane)],
    )?;
    get_json(url.as_str()).await
}

/// Waits until the flat form of `group`'s `lane` satisfies `ok`; returns it.
async fn wait_flat(
    sched: &SchedulerHandle,
    group: &str,
    lane: &str,
    what: &str,
    ok: impl Fn(&Value) -> bool,
) -> anyhow::Result<Value> {
    let last = std::sync::Mutex::new(Value::Null);
    let got = wait_for(what, Duration::from_secs(30), || async {
        let v = flat(sched, group, lane).await.ok()?;
        if let Ok(mut l) = last.lock() {
            *l = v.clone();
        }
        ok(&v).then_some(v)
    })
    .await;
    let last = last.lock().map(|l| l.clone()).unwrap_or_default();
    got.map_err(|e| anyhow::anyhow!("{e}; last answer {last}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_group_reports_its_backlog_blocked_not_ready() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let _w = start_worker(&ns, "w-sp", "pool=sp", 4, WORKER, &[]).await?;
    let group = group_name(&sched, "pool=sp").await?;
    let r = http()
        .post(sched.url("/v1/pauses"))
        .json(&json!({"scope": "group", "group": group, "reason": "e2e scaling"}))
        .send()
        .await?;
    ensure!(r.status().as_u16() == 202, "pause answered {}", r.status());
    let envs: Vec<_> = (0..1000)
        .map(|i| task("noop", json!({ "i": i }), "pool=sp"))
        .collect();
    let (ok, refused) = ns.submit(&envs).await?;
    ensure!(
        (ok, refused) == (1000, 0),
        "submitted {ok}, refused {refused}"
    );
    let v = wait_flat(&sched, &group, "normal", "1,000 blocked paused", |v| {
        v["blocked_by"]["paused"] == 1000
    })
    .await?;
    println!("scaling, paused group: {v}");
    ensure!(
        v["known"] == true && v["ready"] == 0 && v["blocked"] == 1000,
        "{v}"
    );
    ensure!(v["oldest_ready_age_seconds"] == 0.0, "{v}");
    ensure!(v["capacity"] == 4 && v["running"] == 0, "{v}");
    for c in ["over_key_limit", "not_yet_due", "rate_limited"] {
        ensure!(v["blocked_by"][c] == 0, "{c}: {v}");
    }
    ensure!(v["as_of"].as_str().is_some_and(|s| s.ends_with('Z')), "{v}");
    // The whole answer: a KEDA path `groups.<group>.ready` is there.
    let all = get_json(&sched.url("/v1/scaling")).await?;
    let g = &all["groups"][&group];
    ensure!(
        g["ready"] == 0 && g["blocked_by"]["paused"] == 1000,
        "{all}"
    );
    ensure!(g["lanes"]["normal"]["blocked"] == 1000, "{all}");
    // The gauges say the same.
    let page = metrics_page(&sched.url("")).await?;
    let lbl = |lane| [("group", group.as_str()), ("lane", lane)];
    ensure!(
        metric_sum(&page, "fleet_scaling_ready", &lbl("normal")) == 0.0,
        "fleet_scaling_ready"
    );
    let mut paused = lbl("normal").to_vec();
    paused.push(("cause", "paused"));
    ensure!(
        metric_sum(&page, "fleet_scaling_blocked", &paused) == 1000.0,
        "fleet_scaling_blocked paused: {}",
        metric_sum(&page, "fleet_scaling_blocked", &paused)
    );
    ensure!(
        page.contains("fleet_scaling_oldest_ready_age_seconds{"),
        "age gauge"
    );
    // A lane that is not a lane is refused; a group that is not there reads zeros, unknown.
    let bad = http()
        .get(format!("{}?group=x&lane=bulk", sched.url("/v1/scaling")))
        .send()
        .await?;
    ensure!(bad.status().as_u16() == 400, "bad lane: {}", bad.status());
    let none = flat(&sched, "pool=nowhere", "normal").await?;
    ensure!(none["known"] == false && none["ready"] == 0, "{none}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_over_limit_keys_backlog_is_blocked_not_ready() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let mut cfg = SCHEDULER.to_vec();
    cfg.push(("key_limits", "k:max_running=1"));
    let sched = start_scheduler(&ns, &cfg).await?;
    let _w = start_worker(&ns, "w-sk", "pool=sk", 4, WORKER, &[]).await?;
    let group = group_name(&sched, "pool=sk").await?;
    // 11 tasks of key k, each 60 s: one runs, ten wait for the key's slot.
    let envs: Vec<_> = (0..11)
        .map(|_| {
            let mut e = task("sleep", json!({ "ms": 60_000 }), "pool=sk");
            e.key = Some("k".into());
            e
        })
        .collect();
    let (ok, _) = ns.submit(&envs).await?;
    ensure!(ok == 11, "submitted {ok}");
    let v = wait_flat(
        &sched,
        &group,
        "normal",
        "ten blocked over the key limit",
        |v| v["blocked_by"]["over_key_limit"] == 10 && v["running"] == 1 && v["ready"] == 0,
    )
    .await?;
    println!("scaling, over-limit key: {v}");
    ensure!(v["blocked"] == 10 && v["capacity"] == 4, "{v}");
    ensure!(v["blocked_by"]["paused"] == 0, "{v}");
    let all = get_json(&sched.url("/v1/scaling")).await?;
    let k = &all["keys"]["k"];
    ensure!(
        k["cause"] == "over_key_limit" && k["blocked"] == 10 && k["ready"] == 0,
        "{all}"
    );
    ensure!(k["running"] == 1 && k["max_running"] == 1, "{all}");
    let page = metrics_page(&sched.url("")).await?;
    let labels = [
        ("group", group.as_str()),
        ("lane", "normal"),
        ("cause", "over_key_limit"),
    ];
    ensure!(
        metric_sum(&page, "fleet_scaling_blocked", &labels) == 10.0,
        "fleet_scaling_blocked over_key_limit"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_group_with_more_work_than_slots_reports_it_ready_with_its_age() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let _w = start_worker(&ns, "w-sr", "pool=sr", 2, WORKER, &[]).await?;
    let group = group_name(&sched, "pool=sr").await?;
    // 20 tasks of 60 s on 2 slots: 2 run, 18 are ready (could run if there were room).
    let envs: Vec<_> = (0..20)
        .map(|_| task("sleep", json!({ "ms": 60_000 }), "pool=sr"))
        .collect();
    let (ok, _) = ns.submit(&envs).await?;
    ensure!(ok == 20, "submitted {ok}");
    let v = wait_flat(&sched, &group, "normal", "18 ready, aging", |v| {
        v["ready"] == 18
            && v["running"] == 2
            && v["oldest_ready_age_seconds"]
                .as_f64()
                .is_some_and(|a| a > 0.0)
    })
    .await?;
    println!("scaling, ready work: {v}");
    ensure!(v["blocked"] == 0 && v["capacity"] == 2, "{v}");
    ensure!(
        v["dispatch_rate"].as_f64().is_some_and(|r| r > 0.0),
        "dispatch rate: {v}"
    );
    ensure!(
        v["submit_rate"].as_f64().is_some_and(|r| r > 0.0),
        "submit rate: {v}"
    );
    // The group's total (both lanes) and the gauges agree.
    let g = flat_group(&sched, &group).await?;
    ensure!(g["ready"] == 18 && g["running"] == 2, "{g}");
    let all = get_json(&sched.url("/v1/scaling")).await?;
    ensure!(
        all["submit_rate"].as_f64().is_some_and(|r| r > 0.0),
        "{all}"
    );
    let page = metrics_page(&sched.url("")).await?;
    let lbl = [("group", group.as_str()), ("lane", "normal")];
    ensure!(
        metric_sum(&page, "fleet_scaling_ready", &lbl) == 18.0,
        "fleet_scaling_ready {}",
        metric_sum(&page, "fleet_scaling_ready", &lbl)
    );
    ensure!(
        metric_sum(&page, "fleet_scaling_oldest_ready_age_seconds", &lbl) > 0.0,
        "fleet_scaling_oldest_ready_age_seconds"
    );
    Ok(())
}

/// `GET /v1/scaling?group=G`: the group's lanes summed.
async fn flat_group(sched: &SchedulerHandle, group: &str) -> anyhow::Result<Value> {
    let url = reqwest::Url::parse_with_params(&sched.url("/v1/scaling"), &[("group", group)])?;
    get_json(url.as_str()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn delayed_tasks_are_not_yet_due_and_a_rate_limited_keys_backlog_is_blocked(
) -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let mut cfg = SCHEDULER.to_vec();
    // One task per 100 s for key r: its first token goes to the first task, the rest wait.
    cfg.push(("key_limits", "r:rate=0.01,burst=1"));
    let sched = start_scheduler(&ns, &cfg).await?;
    let _w = start_worker(&ns, "w-sd", "pool=sd", 4, WORKER, &[]).await?;
    let group = group_name(&sched, "pool=sd").await?;
    // 7 tasks due in 10 minutes wait in the delay tiers (one scheduler: exact).
    let due = chrono::Utc::now() + chrono::Duration::minutes(10);
    let delayed: Vec<_> = (0..7)
        .map(|_| {
            let mut e = task("noop", json!({}), "pool=sd");
            e.not_before = Some(due);
            e
        })
        .collect();
    // 6 tasks of the rate-limited key: one runs (60 s), five wait for tokens.
    let keyed: Vec<_> = (0..6)
        .map(|_| {
            let mut e = task("sleep", json!({ "ms": 60_000 }), "pool=sd");
            e.key = Some("r".into());
            e
        })
        .collect();
    let (ok, _) = ns.submit(&delayed).await?;
    ensure!(ok == 7, "submitted {ok} delayed");
    let (ok, _) = ns.submit(&keyed).await?;
    ensure!(ok == 6, "submitted {ok} keyed");
    let seen = std::sync::Mutex::new(Value::Null);
    let all = wait_for("7 not yet due", Duration::from_secs(30), || async {
        let v = get_json(&sched.url("/v1/scaling")).await.ok()?;
        if let Ok(mut s) = seen.lock() {
            *s = v["unrouted"].clone();
        }
        (v["unrouted"]["not_yet_due"] == 7).then_some(v)
    })
    .await
    .map_err(|e| anyhow::anyhow!("{e}: last {:?}", seen.lock().map(|s| s.clone())))?;
    println!("scaling, delayed: {}", all["unrouted"]);
    // The gauge says the same (read while the 7 are still not due: the stats tick may lag
    // the API by one sample).
    let labels = [("group", "_unrouted"), ("cause", "not_yet_due")];
    wait_for(
        "the gauge shows 7 not yet due",
        Duration::from_secs(10),
        || async {
            let page = metrics_page(&sched.url("")).await.ok()?;
            (metric_sum(&page, "fleet_scaling_blocked", &labels) == 7.0).then_some(())
        },
    )
    .await?;
    let v = wait_flat(&sched, &group, "normal", "five rate limited", |v| {
        v["blocked_by"]["rate_limited"] == 5 && v["running"] == 1 && v["ready"] == 0
    })
    .await?;
    println!("scaling, rate-limited key: {v}");
    ensure!(v["blocked"] == 5, "{v}");
    let k = get_json(&format!("{}?key=r", sched.url("/v1/scaling"))).await?;
    ensure!(
        k["known"] == true && k["cause"] == "rate_limited" && k["blocked"] == 5,
        "{k}"
    );
    Ok(())
}
