//! Fairness keys, the operator's side (issue 33): the limits of every key from the settings
//! (`FLEET_KEY_DEFAULT`, `FLEET_KEY_LIMITS`) and changed at runtime (`PUT
//! /v1/keys/{key}/limits`, `*` for the default spec) — durable in the control stream, audited,
//! kept across a scheduler restart on a Redis that lost everything; `GET /v1/keys` with the
//! figures Redis holds; `fleetctl keys`, `key-limit`, `pause key`; a bad setting stops
//! start-up naming it (exit 2); a submit token bound to a key sets its tasks' key.
//! Dispatch by key (limits enforced, fair shares) is tested with the dispatcher.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{ensure, Result};
use deadpool_redis::redis;
use fleet_tests::*;
use fleet_worker::executor::handler_fn;
use serde_json::{json, Value};

const OPS: &str = "ops-admin-0123456789abcdef";
const VIEWER: &str = "viewer-read-0123456789abcdef";
const ACME_BOT: &str = "acme-submit-0123456789abcdef";

async fn send(
    method: reqwest::Method,
    url: &str,
    token: &str,
    body: Option<Value>,
) -> Result<(u16, Value)> {
    let mut r = reqwest::Client::new()
        .request(method, url)
        .bearer_auth(token);
    if let Some(b) = body {
        r = r.json(&b);
    }
    let r = r.send().await?;
    let status = r.status().as_u16();
    Ok((status, r.json().await.unwrap_or(Value::Null)))
}

async fn get(sched: &SchedulerHandle, path: &str) -> Result<Value> {
    let (status, v) = send(reqwest::Method::GET, &sched.url(path), VIEWER, None).await?;
    ensure!(status == 200, "GET {path}: {status} {v}");
    Ok(v)
}

async fn put(sched: &SchedulerHandle, key: &str, body: Value) -> Result<(u16, Value)> {
    send(
        reqwest::Method::PUT,
        &sched.url(&format!("/v1/keys/{key}/limits")),
        OPS,
        Some(body),
    )
    .await
}

/// The limits of a row: (max_running, min_running, rate, burst, weight, source).
fn limits(row: &Value) -> (Value, Value, Value, Value, Value, Value) {
    (
        row["max_running"].clone(),
        row["min_running"].clone(),
        row["rate"].clone(),
        row["burst"].clone(),
        row["weight"].clone(),
        row["source"].clone(),
    )
}

fn row<'a>(list: &'a Value, key: &str) -> Option<&'a Value> {
    list["keys"].as_array()?.iter().find(|k| k["key"] == key)
}

/// The `key_limit` entries of the audit log, newest first: (by, role, target, reason).
async fn audited(sched: &SchedulerHandle) -> Result<Vec<(String, String, Value, String)>> {
    let v = get(sched, "/v1/audit?action=key_limit").await?;
    Ok(v["entries"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|e| {
            let s = |k: &str| e[k].as_str().unwrap_or("").to_string();
            (s("by"), s("role"), e["target"].clone(), s("reason"))
        })
        .collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn runtime_limits_are_audited_and_survive_a_restart_and_flushall() -> Result<()> {
    let redis = PrivateRedis::start(None, None).await?;
    let ns = Ns::on_redis(&redis.url(None)).await?;
    let tokens = format!("ops:{OPS} admin, viewer:{VIEWER} read");
    let mut settings: Vec<(&str, &str)> = SCHEDULER.to_vec();
    settings.extend([
        ("api_tokens", tokens.as_str()),
        ("key_default", "max_running=10,rate=20,weight=1"),
        (
            "key_limits",
            "acme:max_running=5,weight=3;beta:min_running=2",
        ),
    ]);
    let sched = start_scheduler(&ns, &settings).await?;

    // The settings' limits, merged over the default spec.
    let list = get(&sched, "/v1/keys").await?;
    let keys: Vec<&str> = list["keys"]
        .as_array()
        .map(|a| a.iter().filter_map(|k| k["key"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(keys, ["acme", "beta"], "{list}");
    let acme = row(&list, "acme").cloned().unwrap_or_default();
    assert_eq!(
        limits(&acme),
        (
            json!(5),
            json!(0),
            json!(20.0),
            json!(20),
            json!(3.0),
            json!("settings")
        )
    );
    assert_eq!(
        (
            &acme["running"],
            &acme["reserved"],
            &acme["waiting"],
            &acme["dispatched"],
            &acme["paused"]
        ),
        (&json!(0), &json!(0), &json!(0), &json!(0), &json!(false))
    );
    let beta = row(&list, "beta").cloned().unwrap_or_default();
    assert_eq!(
        limits(&beta),
        (
            json!(10),
            json!(2),
            json!(20.0),
            json!(20),
            json!(1.0),
            json!("settings")
        )
    );
    assert_eq!(
        list["default"],
        json!({"max_running": 10, "rate": 20.0, "weight": 1.0, "source": "settings"})
    );
    ensure!(list["as_of"].as_str().is_some(), "{list}");

    // The figures Redis holds (written by the dispatcher; here by hand): zeta has 3 waiting,
    // one running, one reserved and one reservation lapsed (not counted).
    let now = ns.store.clock.now_ms();
    let n = &ns.store.names;
    let mut p = redis::pipe();
    p.cmd("HSET")
        .arg(n.key_figures())
        .arg("t:zeta")
        .arg(now)
        .arg("w:zeta")
        .arg(3)
        .arg("d:zeta")
        .arg(9)
        .ignore();
    p.cmd("ZADD")
        .arg(n.key_running("zeta"))
        .arg(now + 60_000)
        .arg("t1")
        .ignore();
    p.cmd("ZADD")
        .arg(n.key_reserved("zeta"))
        .arg(now + 60_000)
        .arg("t2")
        .arg(now - 1_000)
        .arg("t3")
        .ignore();
    // ... and, beside every lease, its latest expiry in the keys that may hold one.
    p.cmd("ZADD")
        .arg(n.key_active())
        .arg(now + 60_000)
        .arg("zeta")
        .ignore();
    ns.store.pipe::<()>(&p).await?;
    let list = get(&sched, "/v1/keys").await?;
    let zeta = &list["keys"][0];
    assert_eq!(zeta["key"], "zeta", "most waiting first: {list}");
    assert_eq!(
        (
            &zeta["running"],
            &zeta["reserved"],
            &zeta["waiting"],
            &zeta["dispatched"],
            &zeta["source"]
        ),
        (
            &json!(1),
            &json!(1),
            &json!(3),
            &json!(9),
            &json!("default")
        )
    );
    assert_eq!(zeta["max_running"], 10);

    // A runtime spec replaces acme's settings spec (its weight falls back to the default's).
    let (code, body) = put(&sched, "acme", json!({"max_running": 7, "reason": "vip"})).await?;
    ensure!(code == 202, "PUT acme: {code} {body}");
    assert_eq!(body["limits"]["max_running"], 7);
    let (code, body) = put(&sched, "acme", json!({"max_running": 7})).await?;
    ensure!(
        code == 200 && body["already"] == true,
        "again: {code} {body}"
    );
    let (code, body) = put(&sched, "*", json!({"max_running": 4, "weight": 2})).await?;
    ensure!(code == 202, "PUT *: {code} {body}");
    let acme = get(&sched, "/v1/keys/acme").await?;
    assert_eq!(
        limits(&acme),
        (
            json!(7),
            json!(0),
            json!(null),
            json!(null),
            json!(2.0),
            json!("runtime")
        ),
        "{acme}"
    );
    assert_eq!(
        (&acme["set_by"], &acme["reason"]),
        (&json!("ops"), &json!("vip"))
    );
    let beta = get(&sched, "/v1/keys/beta").await?;
    assert_eq!(
        limits(&beta),
        (
            json!(4),
            json!(2),
            json!(null),
            json!(null),
            json!(2.0),
            json!("settings")
        )
    );
    let default = get(&sched, "/v1/keys/*").await?;
    assert_eq!(
        (
            &default["max_running"],
            &default["weight"],
            &default["source"]
        ),
        (&json!(4), &json!(2.0), &json!("runtime"))
    );
    // Refusals name what is wrong; a read token cannot change limits.
    let (code, body) = put(&sched, "gamma", json!({"rate": "fast"})).await?;
    ensure!(
        code == 400 && body["detail"].as_str().unwrap_or("").contains("rate"),
        "{code} {body}"
    );
    let (code, body) = put(&sched, "gamma", json!({"min_running": 3, "max_running": 1})).await?;
    ensure!(
        code == 400
            && body["detail"]
                .as_str()
                .unwrap_or("")
                .contains("min_running"),
        "{code} {body}"
    );
    let (code, body) = put(&sched, "bad%20key", json!({})).await?;
    ensure!(code == 400 && body["error"] == "bad_key", "{code} {body}");
    let (code, _) = send(
        reqwest::Method::PUT,
        &sched.url("/v1/keys/acme/limits"),
        VIEWER,
        Some(json!({"max_running": 1})),
    )
    .await?;
    assert_eq!(code, 403);

    // Pause a key: shown in /v1/keys and /v1/pauses.
    let (code, body) = send(
        reqwest::Method::POST,
        &sched.url("/v1/pauses"),
        OPS,
        Some(json!({"scope": "key", "key": "acme", "reason": "abuse"})),
    )
    .await?;
    ensure!(code == 202, "pause key: {code} {body}");
    let pauses = get(&sched, "/v1/pauses").await?;
    assert_eq!(
        (&pauses["pauses"][0]["scope"], &pauses["pauses"][0]["key"]),
        (&json!("key"), &json!("acme"))
    );
    assert_eq!(get(&sched, "/v1/keys/acme").await?["paused"], true);

    // The audit log: one entry per change, newest first (the repeated PUT appended nothing).
    let want = vec![
        (
            "ops".to_string(),
            "admin".to_string(),
            json!({"key": "*", "spec": {"max_running": 4, "weight": 2.0}}),
            String::new(),
        ),
        (
            "ops".to_string(),
            "admin".to_string(),
            json!({"key": "acme", "spec": {"max_running": 7}}),
            "vip".to_string(),
        ),
    ];
    assert_eq!(audited(&sched).await?, want);

    // The scheduler stops, Redis loses everything, a new scheduler starts: the runtime specs
    // and the audit entries come back from the control stream; zeta's figures are gone.
    sched.stop().await?;
    redis.flushall().await?;
    let sched = start_scheduler(&ns, &settings).await?;
    let list = get(&sched, "/v1/keys").await?;
    let keys: Vec<&str> = list["keys"]
        .as_array()
        .map(|a| a.iter().filter_map(|k| k["key"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(keys, ["acme", "beta"], "{list}");
    let acme = row(&list, "acme").cloned().unwrap_or_default();
    assert_eq!(
        (
            &acme["max_running"],
            &acme["weight"],
            &acme["source"],
            &acme["paused"]
        ),
        (&json!(7), &json!(2.0), &json!("runtime"), &json!(true))
    );
    assert_eq!(
        (&list["default"]["max_running"], &list["default"]["source"]),
        (&json!(4), &json!("runtime"))
    );
    assert_eq!(audited(&sched).await?, want);

    // fleetctl: key-limit, keys, pause/resume key.
    let tok = [("FLEET_API_TOKEN", OPS)];
    let api = sched.url("");
    let (code, out, err) = fleetctl_with(
        &ns,
        &api,
        &tok,
        &[
            "key-limit",
            "beta",
            "--max-running",
            "3",
            "--rate",
            "5",
            "--reason",
            "quota",
        ],
    )
    .await?;
    ensure!(code == 0, "fleetctl key-limit: {code} {out} {err}");
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [
            "key beta: set",
            "in force: max_running=3,min_running=0,rate=5.0,burst=5,weight=2.0"
        ],
        "{out}"
    );
    let (code, out, err) = fleetctl_with(&ns, &api, &tok, &["resume", "key", "acme"]).await?;
    ensure!(
        code == 0 && out.trim() == "key acme: resumed",
        "{code} {out} {err}"
    );
    let (code, out, err) =
        fleetctl_with(&ns, &api, &tok, &["key-limit", "acme", "--clear"]).await?;
    ensure!(
        code == 0 && out.starts_with("key acme: cleared"),
        "{code} {out} {err}"
    );
    let (code, out, err) = fleetctl_with(&ns, &api, &tok, &["keys"]).await?;
    ensure!(code == 0, "fleetctl keys: {code} {out} {err}");
    let lines: Vec<Vec<&str>> = out
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(
        lines[0],
        [
            "KEY",
            "RUNNING",
            "RESERVED",
            "WAITING",
            "DISPATCHED",
            "MAX",
            "MIN",
            "RATE",
            "WEIGHT",
            "PAUSED"
        ],
        "{out}"
    );
    // acme has its settings spec again (max 5, weight 3); beta its runtime one.
    assert_eq!(
        lines[1],
        ["acme", "0", "0", "0", "0", "5", "0", "-", "3.0", "no"],
        "{out}"
    );
    assert_eq!(
        lines[2],
        ["beta", "0", "0", "0", "0", "3", "0", "5.0", "2.0", "no"],
        "{out}"
    );
    ensure!(
        lines.len() == 4
            && out.lines().nth(3).is_some_and(
                |l| l.starts_with("2 keys, default spec: max_running=4,weight=2.0, as of ")
            ),
        "{out}"
    );
    let entries = audited(&sched).await?;
    assert_eq!(entries.len(), 4, "{entries:?}");
    assert_eq!(
        (&entries[0].2, &entries[1].2, entries[1].3.as_str()),
        (
            &json!({"key": "acme", "spec": null}),
            &json!({"key": "beta", "spec": {"max_running": 3, "rate": 5.0}}),
            "quota"
        )
    );
    // fleetctl audit lists them like any operator action.
    let (code, out, err) =
        fleetctl_with(&ns, &api, &tok, &["audit", "--action", "key_limit"]).await?;
    ensure!(code == 0, "fleetctl audit: {code} {out} {err}");
    let rows: Vec<Vec<&str>> = out
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect())
        .filter(|r: &Vec<&str>| r.get(1) == Some(&"key_limit"))
        .collect();
    assert_eq!(rows.len(), 4, "{out}");
    assert_eq!(
        (rows[1][2], rows[1][3], rows[1][4]),
        ("ops", "admin", "1"),
        "{out}"
    );
    ensure!(
        out.lines().any(|l| l.starts_with("4 of 4 entries")),
        "{out}"
    );
    sched.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_key_settings_stop_start_up_naming_the_setting() -> Result<()> {
    for (name, value, word) in [
        ("FLEET_KEY_DEFAULT", "max_running=ten", "max_running"),
        ("FLEET_KEY_DEFAULT", "speed=3", "speed"),
        ("FLEET_KEY_LIMITS", "acme:weight=0", "weight"),
        (
            "FLEET_KEY_LIMITS",
            "acme:min_running=3,max_running=2",
            "min_running",
        ),
        ("FLEET_KEY_LIMITS", "no colon here", "KEY:"),
        ("FLEET_KEY_METRICS_TOP", "0", "FLEET_KEY_METRICS_TOP"),
    ] {
        let (code, err) = run_to_exit("fleet-scheduler", &[(name, value)]).await?;
        assert_eq!(code, 2, "{name}={value}: {err}");
        ensure!(
            err.contains(name) && err.contains(word),
            "{name}={value}: {err}"
        );
    }
    Ok(())
}

/// Every run a handler saw: (task id, the envelope's key).
type Seen = Arc<Mutex<Vec<(String, Option<String>)>>>;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_token_bound_to_a_key_sets_its_tasks_key() -> Result<()> {
    let ns = Ns::new().await?;
    let tokens = format!("acme-bot:{ACME_BOT} submit key=tenant:acme, ops:{OPS} admin");
    let mut settings: Vec<(&str, &str)> = SCHEDULER.to_vec();
    settings.push(("api_tokens", tokens.as_str()));
    let sched = start_scheduler(&ns, &settings).await?;
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let h = handler_fn(move |ctx| {
        let s = s.clone();
        async move {
            if let Ok(mut v) = s.lock() {
                v.push((ctx.envelope.id.clone(), ctx.envelope.key.clone()));
            }
            Ok(json!({}))
        }
    });
    let w = start_worker(&ns, "w-kb", "pool=kb", 2, WORKER, &[("keyed", h)]).await?;
    let submit = |token: &'static str, body: Value| {
        let url = sched.url("/v1/tasks");
        async move { send(reqwest::Method::POST, &url, token, Some(body)).await }
    };
    let (code, body) = submit(
        ACME_BOT,
        json!([
            {"id": "kb-1", "kind": "keyed", "labels": {"pool": "kb"}, "key": "other"},
            {"id": "kb-2", "kind": "keyed", "labels": {"pool": "kb"}}
        ]),
    )
    .await?;
    ensure!(code == 202, "bound submit: {code} {body}");
    let (code, body) = submit(
        OPS,
        json!({"id": "kb-3", "kind": "keyed", "labels": {"pool": "kb"}, "key": "beta"}),
    )
    .await?;
    ensure!(code == 202, "unbound submit: {code} {body}");
    for id in ["kb-1", "kb-2", "kb-3"] {
        ns.wait_state(id, "succeeded", Duration::from_secs(30))
            .await?;
    }
    let mut got = seen.lock().map(|v| v.clone()).unwrap_or_default();
    got.sort();
    assert_eq!(
        got,
        vec![
            ("kb-1".to_string(), Some("tenant:acme".to_string())),
            ("kb-2".to_string(), Some("tenant:acme".to_string())),
            ("kb-3".to_string(), Some("beta".to_string())),
        ],
        "the bound token's tasks carry its key whatever they said; others keep theirs"
    );
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_console_sets_a_key_limit_with_its_form() -> Result<()> {
    let ui = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("ui");
    ensure!(
        ui.join("node_modules/playwright-core").exists(),
        "playwright-core is not installed in {}: run `bash ops/services.sh --browser`",
        ui.display()
    );
    let ns = Ns::new().await?;
    let tokens = format!("ops:{OPS} admin");
    let mut settings: Vec<(&str, &str)> = SCHEDULER.to_vec();
    settings.extend([
        ("api_tokens", tokens.as_str()),
        ("key_default", "max_running=10"),
        ("key_limits", "acme:max_running=5,weight=3"),
    ]);
    let sched = start_scheduler(&ns, &settings).await?;
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let shots = target.join("ui-screenshots");
    std::fs::create_dir_all(&shots)?;
    let out = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new("node")
            .arg(ui.join("keys.test.mjs"))
            .current_dir(&ui)
            .env("FLEET_UI_BASE", format!("http://{}", sched.addr))
            .env("FLEET_ADMIN_TOKEN", OPS)
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
    // The servers agree: beta's runtime spec is in force, and the change is audited.
    let beta = get_with(&sched, "/v1/keys/beta", OPS).await?;
    assert_eq!(
        (&beta["max_running"], &beta["weight"], &beta["paused"]),
        (&json!(4), &json!(2.5), &json!(true))
    );
    let audit = get_with(&sched, "/v1/audit?action=key_limit", OPS).await?;
    assert_eq!(
        (&audit["total"], &audit["entries"][0]["target"]),
        (
            &json!(1),
            &json!({"key": "beta", "spec": {"max_running": 4, "weight": 2.5}})
        )
    );
    sched.stop().await?;
    ns.cleanup().await
}

async fn get_with(sched: &SchedulerHandle, path: &str, token: &str) -> Result<Value> {
    let (status, v) = send(reqwest::Method::GET, &sched.url(path), token, None).await?;
    ensure!(status == 200, "GET {path}: {status} {v}");
    Ok(v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn key_gauges_show_the_top_keys_and_sum_the_rest() -> Result<()> {
    own_process!();
    let ns = Ns::new().await?;
    let sched = start_scheduler(
        &ns,
        &[
            ("probe_interval_ms", "600000"),
            ("key_metrics_top", "2"),
            ("key_limits", "a:max_running=3;c:max_running=9"),
        ],
    )
    .await?;
    // Figures as the dispatcher writes them: waiting b 7, a 5, d 2, c 1; running a 2, c 1, d 4.
    let now = ns.store.clock.now_ms();
    let n = &ns.store.names;
    let mut p = redis::pipe();
    for (k, waiting, running) in [("a", 5, 2), ("b", 7, 0), ("c", 1, 1), ("d", 2, 4)] {
        p.cmd("HSET")
            .arg(n.key_figures())
            .arg(format!("t:{k}"))
            .arg(now)
            .arg(format!("w:{k}"))
            .arg(waiting)
            .ignore();
        for i in 0..running {
            p.cmd("ZADD")
                .arg(n.key_running(k))
                .arg(now + 60_000)
                .arg(format!("{k}-{i}"))
                .ignore();
            p.cmd("ZADD")
                .arg(n.key_active())
                .arg(now + 60_000)
                .arg(k)
                .ignore();
        }
    }
    ns.store.pipe::<()>(&p).await?;
    let url = sched.url("/metrics");
    let page = wait_for("the key gauges", Duration::from_secs(20), || {
        let url = url.clone();
        async move {
            let p = reqwest::get(&url).await.ok()?.text().await.ok()?;
            (metric_sum(&p, "fleet_key_waiting", &[("key", "other")]) == 3.0).then_some(p)
        }
    })
    .await?;
    let g = |name: &str, key: &str| metric_sum(&page, name, &[("key", key)]);
    assert_eq!(
        [
            g("fleet_key_waiting", "b"),
            g("fleet_key_waiting", "a"),
            g("fleet_key_waiting", "other"),
        ],
        [7.0, 5.0, 3.0]
    );
    assert_eq!(
        [
            g("fleet_key_running", "b"),
            g("fleet_key_running", "a"),
            g("fleet_key_running", "other"),
        ],
        [0.0, 2.0, 5.0]
    );
    assert_eq!(g("fleet_key_max_running", "a"), 3.0);
    // c and d are summed under other: a series of theirs (c was in the top at the first
    // sample, before the figures were written) reads 0.
    for hidden in ["c", "d"] {
        assert_eq!(
            (
                g("fleet_key_running", hidden),
                g("fleet_key_waiting", hidden)
            ),
            (0.0, 0.0),
            "{hidden}"
        );
    }
    sched.stop().await?;
    ns.cleanup().await
}
