//! The web console (`/ui`) in a real browser: Debian's `chromium` driven by `playwright-core`
//! (`tests/ui/console.test.mjs`; installed by `ops/services.sh --browser`).
//!
//! This test starts a fleet with two groups — `alpha` (two idle workers) and `beta` (one
//! worker of capacity 1 held busy, so it has a backlog) — sends work that succeeds, work that
//! dies (permanent errors and exhausted attempts), and hands the browser script the scheduler's
//! address, two tokens (admin and read) and the ids it must find. The script checks every view
//! against the API, drains a worker with the button, replays dead letters (one by its button,
//! one by selection), looks tasks up, checks the prompt-only page without a token, a phone-width
//! and a dark rendering, and — after this test stops the scheduler on its request — the
//! "unreachable" banner, and then the page of a scheduler without tokens (no prompt at all).
//! Task lookups show the attempt log (every attempt: worker, times, outcome, error) exactly as
//! the API has it; the schedules page shows each schedule's definition, next and last tick and
//! last run as the API has them, and runs, pauses and resumes one with its buttons.
//! Screenshots go to `target/ui-screenshots/`. Afterwards this test checks
//! the same facts on the servers: the drained worker left, each replayed task ran exactly once
//! more and succeeded, the other dead letter is still dead.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use fleet_tests::*;
use fleet_worker::executor::{handler_fn, TaskError};
use serde_json::json;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio_util::sync::CancellationToken;

const ADMIN_TOKEN: &str = "console-admin-0123456789";
const READ_TOKEN: &str = "console-read-0123456789ab";

fn screenshots_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    target.join("ui-screenshots")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn console_shows_the_fleet_and_acts_on_it() -> Result<()> {
    own_process!();
    let ui = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("ui");
    if !ui.join("node_modules/playwright-core").exists() {
        bail!(
            "playwright-core is not installed in {}: run `bash ops/services.sh --browser`",
            ui.display()
        );
    }
    let ns = Ns::new().await?;
    let tokens = format!("{ADMIN_TOKEN} admin, {READ_TOKEN} read");
    let sched = start_scheduler(
        &ns,
        &[
            ("api_tokens", tokens.as_str()),
            ("series_interval_ms", "500"),
            ("probe_interval_ms", "1000"),
        ],
    )
    .await?;

    // flaky: fails permanently while `broken`; records every run. block: holds until released.
    let broken = Arc::new(AtomicBool::new(true));
    let runs: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let flaky = {
        let (broken, runs) = (broken.clone(), runs.clone());
        handler_fn(move |ctx| {
            let (broken, runs) = (broken.clone(), runs.clone());
            async move {
                if let Ok(mut r) = runs.lock() {
                    *r.entry(ctx.envelope.id.clone()).or_default() += 1;
                }
                if broken.load(Ordering::SeqCst) {
                    Err(TaskError::permanent("downstream refused the request"))
                } else {
                    Ok(json!({"ok": true}))
                }
            }
        })
    };
    let release = CancellationToken::new();
    let block = {
        let release = release.clone();
        handler_fn(move |_ctx| {
            let release = release.clone();
            async move {
                release.cancelled().await;
                Ok(json!({}))
            }
        })
    };
    let handlers = [("flaky", flaky), ("block", block)];
    let opts = [
        ("eject_error_ratio", "1"),
        ("retry_base_ms", "50"),
        ("retry_cap_ms", "200"),
    ];
    let a1 = start_worker(&ns, "w-alpha-1", "pool=alpha", 4, &opts, &handlers).await?;
    let a2 = start_worker(&ns, "w-alpha-2", "pool=alpha", 2, &opts, &handlers).await?;
    let b1 = start_worker(&ns, "w-beta-1", "pool=beta", 1, &opts, &handlers).await?;
    let alpha = fleet::Labels::parse("pool=alpha")
        .unwrap_or_default()
        .with("protocol", "builtin")
        .group_name();
    let beta = fleet::Labels::parse("pool=beta")
        .unwrap_or_default()
        .with("protocol", "builtin")
        .group_name();

    // Work that succeeds on alpha, two tasks that die of a permanent error, one that runs out
    // of attempts.
    let ok: Vec<_> = (0..20)
        .map(|i| task("echo", json!({"i": i}), "pool=alpha"))
        .collect();
    let dead_a = task("flaky", json!({"n": 1}), "pool=alpha");
    let dead_b = task("flaky", json!({"n": 2}), "pool=alpha");
    let mut exhausted = task("fail", json!({"times": 9}), "pool=alpha");
    exhausted.max_attempts = Some(2);
    let mut all = ok.clone();
    all.extend([dead_a.clone(), dead_b.clone(), exhausted.clone()]);
    assert_eq!(ns.submit(&all).await?, (all.len(), 0));
    let queue = ns.names.dead_queue();
    wait_for("3 dead letters", Duration::from_secs(30), || {
        let (ns, queue) = (&ns, queue.clone());
        async move { (ns.depth(&queue).await == 3).then_some(()) }
    })
    .await?;
    for t in &ok {
        wait_for(
            &format!("{} succeeded", t.id),
            Duration::from_secs(20),
            || async {
                (ns.status(&t.id).await.ok().flatten()?.get("state")? == "succeeded").then_some(())
            },
        )
        .await?;
    }
    // Beta: one task running, the others waiting in its queue or held back by the scheduler
    // (parked tasks the park releaser holds unacked are not in the backlog).
    let blocked: Vec<_> = (0..4)
        .map(|i| task("block", json!({"i": i}), "pool=beta"))
        .collect();
    assert_eq!(ns.submit(&blocked).await?, (4, 0));
    let admin = reqwest::Client::new();
    wait_for("beta busy with a backlog", Duration::from_secs(20), || {
        let (admin, url, beta) = (admin.clone(), sched.url("/v1/groups"), beta.clone());
        async move {
            let g: serde_json::Value = admin
                .get(&url)
                .bearer_auth(ADMIN_TOKEN)
                .send()
                .await
                .ok()?
                .json()
                .await
                .ok()?;
            let b = g
                .as_array()?
                .iter()
                .find(|g| g["group"] == beta.as_str())?
                .clone();
            (b["backlog"].as_u64()? >= 1 && b["load"] == 1).then_some(())
        }
    })
    .await?;
    // The 15-minute history: every submission taken from ingress counted once (27), the four
    // failed attempts (two flaky, two of the exhausted task), no refusal, and a wait quantile
    // for every interval in which attempts started.
    let series = wait_for(
        "the series to count 27 submissions, 4 failures and 25 starts",
        Duration::from_secs(15),
        || {
            let (admin, url) = (admin.clone(), sched.url("/v1/series"));
            async move {
                let v: serde_json::Value = admin
                    .get(&url)
                    .bearer_auth(READ_TOKEN)
                    .send()
                    .await
                    .ok()?
                    .json()
                    .await
                    .ok()?;
                let sum = |k: &str| {
                    v["points"]
                        .as_array()
                        .map(|p| p.iter().filter_map(|p| p[k].as_u64()).sum::<u64>())
                        .unwrap_or(0)
                };
                // Starts reach the series with the workers' next heartbeats: wait for beta's too.
                (sum("submitted") == 27 && sum("failed") == 4 && sum("started") >= 25).then_some(v)
            }
        },
    )
    .await?;
    let points = series["points"].as_array().cloned().unwrap_or_default();
    let sum = |k: &str| points.iter().filter_map(|p| p[k].as_u64()).sum::<u64>();
    assert_eq!(sum("refused"), 0);
    let dispatched = sum("dispatched");
    // At most all 27 plus the exhausted task's second attempt (a retry is dispatched again).
    assert!(
        (24..=28).contains(&dispatched),
        "alpha's 23 and at least beta's running one, at most all 27 and one retry: {dispatched}"
    );
    assert!(
        sum("succeeded") >= 20 && sum("started") >= 25,
        "succeeded {} started {}",
        sum("succeeded"),
        sum("started")
    );
    for p in &points {
        assert_eq!(
            p["started"].as_u64().unwrap_or(0) > 0,
            p["wait_p50"].is_number() && p["wait_p99"].is_number(),
            "{p}"
        );
    }
    assert_eq!(
        reqwest::get(sched.url("/v1/series")).await?.status(),
        401,
        "the series need a token"
    );
    // Replays will succeed from now on.
    broken.store(false, Ordering::SeqCst);

    // Two schedules: `nightly` (03:00 Berlin, never due during the test) and `every-second`,
    // which fires until one of its ticks ran and succeeded, then is paused — so its last tick,
    // last run and task state hold still for the page. Adding needs admin, not read.
    let nightly = json!({"name": "nightly", "cron": "0 0 3 * * *", "timezone": "Europe/Berlin", "task": {"kind": "echo", "labels": {"pool": "alpha"}, "payload": {"from": "nightly"}}});
    let every = json!({"name": "every-second", "cron": "* * * * * *", "missed": "catch_up", "catch_up_max": 2, "task": {"kind": "echo", "labels": {"pool": "alpha"}}});
    let r = admin
        .post(sched.url("/v1/schedules"))
        .bearer_auth(READ_TOKEN)
        .json(&nightly)
        .send()
        .await?;
    assert_eq!(r.status(), 403, "a read token cannot add a schedule");
    for spec in [&nightly, &every] {
        let r = admin
            .post(sched.url("/v1/schedules"))
            .bearer_auth(ADMIN_TOKEN)
            .json(spec)
            .send()
            .await?;
        assert_eq!(
            r.status(),
            201,
            "POST /v1/schedules {spec}: {}",
            r.text().await.unwrap_or_default()
        );
    }
    wait_for(
        "a tick of every-second to run and succeed",
        Duration::from_secs(30),
        || {
            let (admin, url) = (admin.clone(), sched.url("/v1/schedules/every-second"));
            async move {
                let v: serde_json::Value = admin
                    .get(&url)
                    .bearer_auth(READ_TOKEN)
                    .send()
                    .await
                    .ok()?
                    .json()
                    .await
                    .ok()?;
                (v["last_outcome"] == "fired" && v["last_task"]["state"] == "succeeded")
                    .then_some(())
            }
        },
    )
    .await?;
    let r = admin
        .post(sched.url("/v1/schedules/every-second/fire"))
        .bearer_auth(READ_TOKEN)
        .json(&serde_json::json!({}))
        .send()
        .await?;
    assert_eq!(r.status(), 403, "a read token cannot run a schedule");
    let r = admin
        .post(sched.url("/v1/schedules/every-second/pause"))
        .bearer_auth(ADMIN_TOKEN)
        .json(&serde_json::json!({}))
        .send()
        .await?;
    assert_eq!(r.status(), 200);
    // A tick claimed just before the pause may still resolve: wait until its last run is settled.
    let every_view = wait_for(
        "every-second's last run to settle after the pause",
        Duration::from_secs(30),
        || {
            let (admin, url) = (admin.clone(), sched.url("/v1/schedules/every-second"));
            async move {
                let get = || async {
                    let v: serde_json::Value = admin
                        .get(&url)
                        .bearer_auth(READ_TOKEN)
                        .send()
                        .await
                        .ok()?
                        .json()
                        .await
                        .ok()?;
                    Some(v)
                };
                let a = get().await?;
                quiet_for(
                    Duration::from_millis(1500),
                    "the disabled schedule's view stays the same: no new fire",
                )
                .await;
                let b = get().await?;
                (a == b && b["enabled"] == false && b["last_task"]["state"] == "succeeded")
                    .then_some(b)
            }
        },
    )
    .await?;
    let every_task = every_view["last_task"]["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(every_task.starts_with("every-second@"), "{every_view}");
    assert_eq!(
        every_view["next_tick"],
        serde_json::Value::Null,
        "a paused schedule has no next tick: {every_view}"
    );

    let shots = screenshots_dir();
    std::fs::create_dir_all(&shots)?;
    let expect = json!({
        "busy_group": beta,
        "idle_group": alpha,
        "drain_worker": a2.id,
        "replay_one": dead_a.id,
        "replay_selected": dead_b.id,
        "stays_dead": exhausted.id,
        "succeeded_task": ok[0].id,
        "workers": [a1.id, a2.id, b1.id],
        "schedules": {"active": "nightly", "paused": "every-second", "paused_task": every_task},
    });
    let mut child = tokio::process::Command::new("node")
        .arg(ui.join("console.test.mjs"))
        .current_dir(&ui)
        .env("FLEET_UI_BASE", format!("http://{}", sched.addr))
        .env("FLEET_ADMIN_TOKEN", ADMIN_TOKEN)
        .env("FLEET_READ_TOKEN", READ_TOKEN)
        .env("FLEET_EXPECT", expect.to_string())
        .env("FLEET_SCREENSHOTS", &shots)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("starting node (install it with `bash ops/services.sh --browser`)")?;
    let mut stdin = child.stdin.take().context("node stdin")?;
    let mut lines = BufReader::new(child.stdout.take().context("node stdout")?).lines();
    let mut sched = Some(sched);
    let script = async {
        while let Some(line) = lines.next_line().await? {
            println!("[browser] {line}");
            if line.trim() == "@stop-scheduler" {
                if let Some(s) = sched.take() {
                    s.stop().await?;
                }
                // A scheduler without tokens (today's default): the page must work without one.
                let open = start_scheduler(&ns, &[("probe_interval_ms", "600000")]).await?;
                stdin
                    .write_all(format!("stopped http://{}\n", open.addr).as_bytes())
                    .await?;
                stdin.flush().await?;
                sched = Some(open);
            }
        }
        anyhow::Ok(child.wait().await?)
    };
    let status = tokio::time::timeout(Duration::from_secs(240), script)
        .await
        .context("the browser script did not finish within 240 s")??;
    assert!(status.success(), "the browser script failed: {status}");

    // The same facts on the servers.
    tokio::time::timeout(Duration::from_secs(20), a2.join)
        .await
        .context("drained worker did not exit")???;
    assert!(
        ns.store.workers().await?.iter().all(|w| w.id != a2.id),
        "the drained worker is still registered"
    );
    for id in [&dead_a.id, &dead_b.id] {
        let st = ns.status(id).await?.unwrap_or_default();
        assert_eq!(
            st.get("state").map(String::as_str),
            Some("succeeded"),
            "{id}: {st:?}"
        );
        assert_eq!(
            runs.lock().map(|r| r.get(id).copied()).ok().flatten(),
            Some(2),
            "{id}: one failing run, one replayed run"
        );
    }
    assert_eq!(
        ns.depth(&queue).await,
        1,
        "only the exhausted task is still dead"
    );
    assert_eq!(
        ns.status(&exhausted.id)
            .await?
            .unwrap_or_default()
            .get("state")
            .map(String::as_str),
        Some("dead")
    );
    // The attempt logs the page showed, on the servers: the replayed tasks died once and then
    // succeeded; the exhausted one failed and then died of max_attempts; all on alpha.
    let alpha_workers = [a1.id.as_str(), a2.id.as_str()];
    let outcomes = |id: String| {
        let store = ns.store.clone();
        async move {
            let log = store.task_attempts(&id).await?;
            anyhow::Ok(
                log.iter()
                    .map(|a| {
                        (
                            a["attempt"].as_u64().unwrap_or(0),
                            a["outcome"].as_str().unwrap_or("").to_string(),
                            a["reason"].as_str().unwrap_or("").to_string(),
                            a["worker"].as_str().unwrap_or("").to_string(),
                        )
                    })
                    .collect::<Vec<_>>(),
            )
        }
    };
    for id in [&dead_a.id, &dead_b.id] {
        let log = outcomes(id.clone()).await?;
        assert_eq!(
            log.iter()
                .map(|(a, o, r, _)| (*a, o.as_str(), r.as_str()))
                .collect::<Vec<_>>(),
            vec![(1, "dead", "permanent_error"), (1, "succeeded", "")],
            "{id}: {log:?}"
        );
        assert!(
            log.iter()
                .all(|(_, _, _, w)| alpha_workers.contains(&w.as_str())),
            "{id}: {log:?}"
        );
    }
    let log = outcomes(exhausted.id.clone()).await?;
    assert_eq!(
        log.iter()
            .map(|(a, o, r, _)| (*a, o.as_str(), r.as_str()))
            .collect::<Vec<_>>(),
        vec![(1, "failed", ""), (2, "dead", "max_attempts")],
        "{log:?}"
    );

    release.cancel();
    if let Some(s) = sched.take() {
        s.stop().await?;
    }
    a1.stop().await?;
    b1.stop().await?;
    ns.cleanup().await
}
