//! Pause and resume (issue 32 item 2): `POST /v1/pauses`, `POST /v1/pauses/resume`,
//! `GET /v1/pauses` (and `fleetctl pause`, `resume`, `pauses`).
//!
//! A paused group starts nothing once what was dispatched before the pause has run, while
//! another group keeps its throughput; a paused kind waits in its hold queue while other
//! kinds of the same group run (no head-of-line blocking); a paused lane stops that lane only;
//! a pause survives a scheduler restart and a Redis FLUSHALL (it lives in the control stream).
//! After the resume every task runs exactly once (identities checked).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure};
use fleet_tests::*;
use fleet_worker::executor::{handler_fn, Handler};
use serde_json::{json, Value};

/// POSTs `body` to `path`; (status, body).
async fn post(sched: &SchedulerHandle, path: &str, body: Value) -> anyhow::Result<(u16, Value)> {
    let r = reqwest::Client::new()
        .post(sched.url(path))
        .json(&body)
        .send()
        .await?;
    let status = r.status().as_u16();
    Ok((status, r.json().await.unwrap_or(Value::Null)))
}

/// Every start: (task id, worker id, when), and runs going on per worker.
#[derive(Clone, Default)]
struct Starts {
    all: Arc<Mutex<Vec<(String, String, Instant)>>>,
    running: Arc<Mutex<HashMap<String, i64>>>,
}

impl Starts {
    /// A handler that records the start, sleeps `payload.ms` and succeeds.
    fn handler(&self) -> Arc<dyn Handler> {
        let s = self.clone();
        handler_fn(move |ctx| {
            let s = s.clone();
            async move {
                let w = ctx.worker_id.to_string();
                if let Ok(mut a) = s.all.lock() {
                    a.push((ctx.envelope.id.clone(), w.clone(), Instant::now()));
                }
                if let Ok(mut r) = s.running.lock() {
                    *r.entry(w.clone()).or_default() += 1;
                }
                let ms = ctx.envelope.payload.get("ms").and_then(Value::as_u64);
                tokio::time::sleep(Duration::from_millis(ms.unwrap_or(0))).await;
                if let Ok(mut r) = s.running.lock() {
                    *r.entry(w).or_default() -= 1;
                }
                Ok(json!({"ok": true}))
            }
        })
    }

    /// Starts on worker `w` (all of them when `None`) at or after `since`.
    fn on(&self, w: Option<&str>, since: Option<Instant>) -> usize {
        self.all
            .lock()
            .map(|a| {
                a.iter()
                    .filter(|(_, wk, at)| {
                        w.is_none_or(|w| wk == w) && since.is_none_or(|s| *at >= s)
                    })
                    .count()
            })
            .unwrap_or(0)
    }

    fn running(&self, w: &str) -> i64 {
        self.running
            .lock()
            .map(|r| r.get(w).copied().unwrap_or(0))
            .unwrap_or(0)
    }

    /// Runs per task id.
    fn per_task(&self) -> HashMap<String, usize> {
        let mut m = HashMap::new();
        if let Ok(a) = self.all.lock() {
            for (id, _, _) in a.iter() {
                *m.entry(id.clone()).or_default() += 1;
            }
        }
        m
    }
}

/// Checks that each of `ids` ran exactly once (and names the first that did not).
fn each_once(starts: &Starts, ids: &[String], what: &str) -> anyhow::Result<()> {
    let per = starts.per_task();
    let runs: Vec<usize> = ids
        .iter()
        .map(|id| per.get(id).copied().unwrap_or(0))
        .collect();
    if let Some((id, n)) = ids.iter().zip(&runs).find(|(_, n)| **n != 1) {
        bail!(
            "{what}: task {id} ran {n} times ({} of {} ran once)",
            runs.iter().filter(|n| **n == 1).count(),
            ids.len()
        );
    }
    Ok(())
}

/// The group row of `GET /v1/groups` whose name contains `label`.
async fn group_row(sched: &SchedulerHandle, label: &str) -> anyhow::Result<Value> {
    let v = get_json(&sched.url("/v1/groups")).await?;
    v.as_array()
        .and_then(|a| {
            a.iter()
                .find(|g| g["group"].as_str().is_some_and(|n| n.contains(label)))
        })
        .cloned()
        .ok_or_else(|| anyhow::anyhow!("no group with {label} in {v}"))
}

/// Waits until every one of `ids` has run (`timeout`).
async fn wait_ran(starts: &Starts, ids: &[String], timeout: Duration) -> anyhow::Result<()> {
    wait_for("every task ran", timeout, || async {
        let per = starts.per_task();
        ids.iter().all(|id| per.contains_key(id)).then_some(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_group_runs_nothing_while_another_keeps_its_throughput() -> anyhow::Result<()> {
    let ns = Arc::new(Ns::new().await?);
    let starts = Starts::default();
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let h = [(JOB, starts.handler())];
    let wa = start_worker(&ns, "w-pa", "pool=pa", 4, WORKER, &h).await?;
    let wb = start_worker(&ns, "w-pb", "pool=pb", 4, WORKER, &h).await?;
    // A feeder submits 5 tasks of 50 ms for A and 10 for B every 250 ms (20/s and 40/s, each
    // half its group's 80/s) for the whole test (at most 60 s).
    let a_ids = Arc::new(Mutex::new(Vec::<String>::new()));
    let b_ids = Arc::new(Mutex::new(Vec::<String>::new()));
    let stop_feed = tokio_util::sync::CancellationToken::new();
    let feeder = {
        let (ns_feed, a, b, stop) = (ns.clone(), a_ids.clone(), b_ids.clone(), stop_feed.clone());
        tokio::spawn(async move {
            let mut i = 0u32;
            let mut tick = tokio::time::interval(Duration::from_millis(250));
            for _ in 0..240 {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tick.tick() => {}
                }
                for (ids, pool, n) in [(&a, "pool=pa", 5), (&b, "pool=pb", 10)] {
                    let envs: Vec<_> = (0..n)
                        .map(|_| {
                            i += 1;
                            task(JOB, json!({"ms": 50, "i": i}), pool)
                        })
                        .collect();
                    if matches!(ns_feed.submit(&envs).await, Ok((ok, 0)) if ok == envs.len()) {
                        if let Ok(mut v) = ids.lock() {
                            v.extend(envs.into_iter().map(|e| e.id));
                        }
                    }
                }
            }
        })
    };
    let ids_of = |v: &Arc<Mutex<Vec<String>>>| v.lock().map(|v| v.clone()).unwrap_or_default();
    // Both flow.
    wait_for("both groups run", Duration::from_secs(30), || async {
        (starts.on(Some("w-pa"), None) >= 20 && starts.on(Some("w-pb"), None) >= 20).then_some(())
    })
    .await?;
    let group_a = group_row(&sched, "pool=pa").await?["group"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let before_from = Instant::now();
    scenario_pause(Duration::from_secs(2), "B's throughput before the pause").await;
    let b_before =
        starts.on(Some("w-pb"), Some(before_from)) as f64 / before_from.elapsed().as_secs_f64();
    let (code, body) = post(
        &sched,
        "/v1/pauses",
        json!({"scope": "group", "group": group_a, "reason": "e2e"}),
    )
    .await?;
    ensure!(code == 202, "pause answered {code}: {body}");
    ensure!(
        body["pause"]["by"] == "anonymous" && body["pause"]["reason"] == "e2e",
        "{body}"
    );
    let (code, body) = post(
        &sched,
        "/v1/pauses",
        json!({"scope": "group", "group": group_a}),
    )
    .await?;
    ensure!(
        code == 200 && body["already"] == true,
        "a second pause: {code} {body}"
    );
    let paused_at = Instant::now();
    let a_at_pause = starts.on(Some("w-pa"), None);
    // What was dispatched to A before the pause still runs (like a drain): wait until its
    // queue is empty and nothing runs there.
    let a_queue = ns.names.group_queue(&group_a, fleet::Lane::Normal);
    wait_for(
        "A's dispatched work ended",
        Duration::from_secs(30),
        || async { (ns.depth(&a_queue).await == 0 && starts.running("w-pa") == 0).then_some(()) },
    )
    .await?;
    let quiet_from = Instant::now();
    let a_at_quiet = starts.on(Some("w-pa"), None);
    // 30 s: A starts nothing; B runs.
    let looks = always_for(
        "A starts nothing while paused",
        Duration::from_secs(30),
        Duration::from_secs(1),
        || async {
            let n = starts.on(Some("w-pa"), None);
            ensure!(
                n == a_at_quiet,
                "A started {} tasks while paused",
                n - a_at_quiet
            );
            Ok(())
        },
    )
    .await?;
    let b_during =
        starts.on(Some("w-pb"), Some(quiet_from)) as f64 / quiet_from.elapsed().as_secs_f64();
    // While paused: the API reports it, and A's waiting tasks (exactly those submitted and
    // not started, once the feeder stopped) as paused, not ready.
    stop_feed.cancel();
    feeder.await?;
    let (a_ids, b_all) = (ids_of(&a_ids), ids_of(&b_ids));
    let left = (a_ids.len() - a_at_quiet) as u64;
    let row = wait_for(
        "A's waiting tasks reported paused",
        Duration::from_secs(10),
        || async {
            let row = group_row(&sched, "pool=pa").await.ok()?;
            (row["backlog_paused"].as_u64() == Some(left)).then_some(row)
        },
    )
    .await?;
    let pauses = get_json(&sched.url("/v1/pauses")).await?;
    println!(
        "paused group: A started {} before the pause, {} more after it (dispatched before), then 0 in 30 s ({looks} looks) with {left} waiting; B {b_before:.1}/s before, {b_during:.1}/s during; row {row}; pauses {pauses}",
        a_at_pause,
        a_at_quiet - a_at_pause,
    );
    ensure!(row["paused"] == true, "{row}");
    ensure!(
        row["paused_lanes"] == json!(["normal", "critical"]),
        "{row}"
    );
    ensure!(
        row["backlog"].as_u64() == Some(0),
        "none of A's is ready: {row}"
    );
    ensure!(
        pauses["pauses"].as_array().map(Vec::len) == Some(1),
        "{pauses}"
    );
    ensure!(
        pauses["pauses"][0]["scope"] == "group" && pauses["pauses"][0]["group"] == group_a.as_str(),
        "{pauses}"
    );
    ensure!(
        b_during >= 0.6 * b_before,
        "B's throughput fell: {b_before:.1}/s before, {b_during:.1}/s during"
    );
    // Resume: A runs the rest; every task ran once.
    let (code, body) = post(
        &sched,
        "/v1/pauses/resume",
        json!({"scope": "group", "group": group_a}),
    )
    .await?;
    ensure!(code == 202, "resume answered {code}: {body}");
    let (code, body) = post(
        &sched,
        "/v1/pauses/resume",
        json!({"scope": "group", "group": group_a}),
    )
    .await?;
    ensure!(
        code == 200 && body["already"] == true,
        "a second resume: {code} {body}"
    );
    wait_ran(&starts, &a_ids, Duration::from_secs(60)).await?;
    wait_ran(&starts, &b_all, Duration::from_secs(60)).await?;
    ns.wait_settled(Duration::from_secs(60)).await?;
    each_once(&starts, &a_ids, "A")?;
    each_once(&starts, &b_all, "B")?;
    println!(
        "resumed: A {} tasks once each, B {} tasks once each; paused for {:?}",
        a_ids.len(),
        b_all.len(),
        paused_at.elapsed()
    );
    ensure!(get_json(&sched.url("/v1/pauses")).await?["pauses"] == json!([]));
    wa.stop().await?;
    wb.stop().await?;
    sched.stop().await?;
    match Arc::try_unwrap(ns) {
        Ok(ns) => ns.cleanup().await,
        Err(_) => bail!("the feeder still holds the namespace"),
    }
}

/// Another kind, for the kind pause (the builtin worker handles any kind it has a handler of).
const OTHER: &str = "other_job";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_kind_waits_while_other_kinds_of_its_group_run() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let starts = Starts::default();
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let h = [(JOB, starts.handler()), (OTHER, starts.handler())];
    let w = start_worker(&ns, "w-pk", "pool=pk", 2, WORKER, &h).await?;
    let (code, body) = post(
        &sched,
        "/v1/pauses",
        json!({"scope": "kind", "kind": OTHER}),
    )
    .await?;
    ensure!(code == 202, "pause answered {code}: {body}");
    // Interleaved: 60 of the paused kind, 60 of another, one group.
    let mut held: Vec<String> = Vec::new();
    let mut free = Vec::new();
    let mut envs = Vec::new();
    for i in 0..60 {
        let p = task(OTHER, json!({"ms": 20, "i": i}), "pool=pk");
        let f = task(JOB, json!({"ms": 20, "i": i}), "pool=pk");
        held.push(p.id.clone());
        free.push(f.id.clone());
        envs.extend([p, f]);
    }
    assert_eq!(ns.submit(&envs).await?, (120, 0));
    // The other kind runs, all of it, behind no held task.
    wait_ran(&starts, &free, Duration::from_secs(30)).await?;
    let pauses = wait_for(
        "the held tasks reported",
        Duration::from_secs(10),
        || async {
            let v = get_json(&sched.url("/v1/pauses")).await.ok()?;
            (v["pauses"][0]["held"].as_u64() == Some(60)).then_some(v)
        },
    )
    .await?;
    quiet_for(
        Duration::from_secs(3),
        "a held task would start within this",
    )
    .await;
    let ran_held = held
        .iter()
        .filter(|id| starts.per_task().contains_key(*id))
        .count();
    println!(
        "kind paused: {} of {} other-kind tasks ran, {ran_held} of {} held ran; pauses {pauses}",
        free.len(),
        free.len(),
        held.len()
    );
    ensure!(ran_held == 0, "{ran_held} tasks of the paused kind ran");
    // A held task has a status (parked behind the kind's hold queue) and can be cancelled.
    let st = ns.status(&held[0]).await?.unwrap_or_default();
    ensure!(
        st.get("state").map(String::as_str) == Some("parked")
            && st.get("group").map(String::as_str) == Some("_kind.other_job"),
        "a held task's status: {st:?}"
    );
    let (code, body) = post(&sched, &format!("/v1/tasks/{}/cancel", held[0]), json!({})).await?;
    ensure!(code == 202, "cancel of a held task: {code} {body}");
    let cancelled = held.remove(0);
    let (code, body) = post(
        &sched,
        "/v1/pauses/resume",
        json!({"scope": "kind", "kind": OTHER}),
    )
    .await?;
    ensure!(code == 202, "resume answered {code}: {body}");
    wait_ran(&starts, &held, Duration::from_secs(30)).await?;
    ns.wait_settled(Duration::from_secs(30)).await?;
    each_once(&starts, &held, "held kind")?;
    ensure!(
        !starts.per_task().contains_key(&cancelled),
        "the cancelled held task ran"
    );
    ensure!(ns.state_of(&cancelled).await.as_deref() == Some("cancelled"));
    each_once(&starts, &free, "other kind")?;
    for id in held.iter().chain(&free) {
        ensure!(
            ns.state_of(id).await.as_deref() == Some("succeeded"),
            "{id}"
        );
    }
    ensure!(ns.drain_dead().await?.is_empty(), "nothing dead-lettered");
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_lane_stops_that_lane_only() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let starts = Starts::default();
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let h = [(JOB, starts.handler())];
    let w = start_worker(
        &ns,
        "w-pl",
        "pool=pl",
        2,
        &[WORKER, &[("critical_capacity", "2")]].concat(),
        &h,
    )
    .await?;
    let group = wait_for("the group", Duration::from_secs(10), || async {
        group_row(&sched, "pool=pl").await.ok()?["group"]
            .as_str()
            .map(str::to_string)
    })
    .await?;
    // Through fleetctl this time.
    let api = format!("http://{}", sched.addr);
    let (code, out, err) = fleetctl(
        &ns,
        &api,
        &[
            "pause",
            "group",
            &group,
            "--lane",
            "critical",
            "--reason",
            "probe maint",
        ],
    )
    .await?;
    ensure!(
        code == 0 && out.contains("paused"),
        "fleetctl pause: {code} {out} {err}"
    );
    let mut critical = Vec::new();
    let mut normal = Vec::new();
    let mut envs = Vec::new();
    for i in 0..20 {
        let mut c = task(JOB, json!({"ms": 20, "i": i}), "pool=pl");
        c.lane = fleet::Lane::Critical;
        let n = task(JOB, json!({"ms": 20, "i": i}), "pool=pl");
        critical.push(c.id.clone());
        normal.push(n.id.clone());
        envs.extend([c, n]);
    }
    assert_eq!(ns.submit(&envs).await?, (40, 0));
    wait_ran(&starts, &normal, Duration::from_secs(30)).await?;
    let row = wait_for(
        "the critical lane reported paused",
        Duration::from_secs(10),
        || async {
            let row = group_row(&sched, "pool=pl").await.ok()?;
            (row["backlog_paused"].as_u64() == Some(20)).then_some(row)
        },
    )
    .await?;
    quiet_for(
        Duration::from_secs(3),
        "a critical task would start within this",
    )
    .await;
    let ran = critical
        .iter()
        .filter(|id| starts.per_task().contains_key(*id))
        .count();
    println!(
        "critical lane paused: normal {} ran, critical {ran} ran; row {row}",
        normal.len()
    );
    ensure!(ran == 0, "{ran} critical tasks ran");
    ensure!(row["paused_lanes"] == json!(["critical"]), "{row}");
    let (_, groups_out, _) = fleetctl(&ns, &api, &["groups"]).await?;
    let (_, pauses_out, _) = fleetctl(&ns, &api, &["pauses"]).await?;
    println!("fleetctl groups:\n{groups_out}\nfleetctl pauses:\n{pauses_out}");
    ensure!(groups_out.contains("critical:20"), "{groups_out}");
    ensure!(
        pauses_out.contains("lane") && pauses_out.contains("probe maint"),
        "{pauses_out}"
    );
    // Resuming the whole group resumes the lane.
    let (code, out, err) = fleetctl(&ns, &api, &["resume", "group", &group]).await?;
    ensure!(
        code == 0 && out.contains("resumed"),
        "fleetctl resume: {code} {out} {err}"
    );
    wait_ran(&starts, &critical, Duration::from_secs(30)).await?;
    ns.wait_settled(Duration::from_secs(30)).await?;
    each_once(&starts, &critical, "critical")?;
    each_once(&starts, &normal, "normal")?;
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pause_survives_a_scheduler_restart_and_flushall() -> anyhow::Result<()> {
    let redis = PrivateRedis::start(None, None).await?;
    let ns = Ns::on_redis(&redis.url(None)).await?;
    let starts = Starts::default();
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let h = [(JOB, starts.handler())];
    let w = start_worker(&ns, "w-pd", "pool=pd", 2, WORKER, &h).await?;
    let group = wait_for("the group", Duration::from_secs(10), || async {
        group_row(&sched, "pool=pd").await.ok()?["group"]
            .as_str()
            .map(str::to_string)
    })
    .await?;
    let (code, body) = post(
        &sched,
        "/v1/pauses",
        json!({"scope": "group", "group": group}),
    )
    .await?;
    ensure!(code == 202, "pause answered {code}: {body}");
    let before: Vec<_> = (0..20)
        .map(|i| task(JOB, json!({"i": i}), "pool=pd"))
        .collect();
    assert_eq!(ns.submit(&before).await?, (20, 0));
    wait_for("the tasks parked", Duration::from_secs(20), || async {
        let row = group_row(&sched, "pool=pd").await.ok()?;
        (row["backlog_paused"].as_u64() == Some(20)).then_some(())
    })
    .await?;
    // The scheduler stops, Redis loses everything, a new scheduler starts.
    sched.stop().await?;
    redis.flushall().await?;
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let after: Vec<_> = (0..20)
        .map(|i| task(JOB, json!({"j": i}), "pool=pd"))
        .collect();
    assert_eq!(ns.submit(&after).await?, (20, 0));
    let pauses = get_json(&sched.url("/v1/pauses")).await?;
    ensure!(
        pauses["pauses"][0]["group"] == group.as_str(),
        "the restarted scheduler knows the pause: {pauses}"
    );
    // The worker registers again (Redis lost it); its group is still paused.
    wait_for(
        "the group back and its 40 tasks paused",
        Duration::from_secs(30),
        || async {
            let row = group_row(&sched, "pool=pd").await.ok()?;
            (row["backlog_paused"].as_u64() == Some(40)).then_some(())
        },
    )
    .await?;
    let looks = always_for(
        "nothing runs while paused",
        Duration::from_secs(8),
        Duration::from_millis(500),
        || async {
            ensure!(
                starts.on(None, None) == 0,
                "{} tasks ran",
                starts.on(None, None)
            );
            Ok(())
        },
    )
    .await?;
    let (code, body) = post(
        &sched,
        "/v1/pauses/resume",
        json!({"scope": "group", "group": group}),
    )
    .await?;
    ensure!(code == 202, "resume answered {code}: {body}");
    let ids: Vec<String> = before.iter().chain(&after).map(|e| e.id.clone()).collect();
    wait_ran(&starts, &ids, Duration::from_secs(30)).await?;
    ns.wait_settled(Duration::from_secs(30)).await?;
    each_once(&starts, &ids, "paused across a restart and FLUSHALL")?;
    println!("pause across a scheduler restart and FLUSHALL: 0 ran in 8 s ({looks} looks), then {} ran once each", ids.len());
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_console_pauses_and_resumes_a_group_and_a_kind_with_its_buttons() -> anyhow::Result<()>
{
    let ui = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("ui");
    if !ui.join("node_modules/playwright-core").exists() {
        bail!(
            "playwright-core is not installed in {}: run `bash ops/services.sh --browser`",
            ui.display()
        );
    }
    const ADMIN: &str = "pause-admin-token";
    let ns = Ns::new().await?;
    let tokens = format!("{ADMIN} admin");
    let sched = start_scheduler(
        &ns,
        &[
            ("api_tokens", tokens.as_str()),
            ("probe_interval_ms", "600000"),
        ],
    )
    .await?;
    let starts = Starts::default();
    let w = start_worker(
        &ns,
        "w-pc",
        "pool=pc",
        1,
        WORKER,
        &[(JOB, starts.handler())],
    )
    .await?;
    let group = wait_for("the group", Duration::from_secs(10), || async {
        let gs = ns.store.groups().await.ok()?;
        gs.into_iter()
            .find(|g| g.group.contains("pool=pc"))
            .map(|g| g.group)
    })
    .await?;
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let shots = target.join("ui-screenshots");
    std::fs::create_dir_all(&shots)?;
    let out = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new("node")
            .arg(ui.join("pause.test.mjs"))
            .current_dir(&ui)
            .env("FLEET_UI_BASE", format!("http://{}", sched.addr))
            .env("FLEET_ADMIN_TOKEN", ADMIN)
            .env(
                "FLEET_EXPECT",
                json!({"group": group, "kind": "resize"}).to_string(),
            )
            .env("FLEET_SCREENSHOTS", &shots)
            .kill_on_drop(true)
            .output(),
    )
    .await??;
    println!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        out.status.success(),
        "the browser script failed: {}",
        out.status
    );
    for n in [
        "1-running",
        "2-confirm",
        "3-paused",
        "4-kind-paused",
        "5-resumed",
    ] {
        let p = shots.join(format!("pause-{n}.png"));
        ensure!(
            std::fs::metadata(&p).map(|m| m.len() > 0).unwrap_or(false),
            "no screenshot {}",
            p.display()
        );
    }
    // The servers agree: nothing paused, and a task of the group runs.
    let t = task(JOB, json!({}), "pool=pc");
    ns.submit(std::slice::from_ref(&t)).await?;
    ns.wait_state(&t.id, "succeeded", Duration::from_secs(20))
        .await?;
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
