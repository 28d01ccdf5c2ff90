//! The audit log (issue 32 item 5): every operator action — cancel, drain, dead-letter replay,
//! schedule add/pause/resume/fire/remove — is recorded with the token's name and role, the
//! time, the target and the count; a read token cannot act and leaves no entry; no secret is
//! in the log; the log is the control stream's, so it is the same after the scheduler
//! restarts on a Redis that lost everything.

use std::time::Duration;

use anyhow::{ensure, Result};
use fleet_tests::*;
use fleet_worker::executor::{handler_fn, TaskError};
use serde_json::{json, Value};

const ALICE: &str = "alice-admin-0123456789abcdef";
const VIEWER: &str = "viewer-read-0123456789abcdef";
/// An unnamed admin token given through the file: named `admin-3` (its place after the two
/// entries of the setting).
const FILE_ADMIN: &str = "file-admin-0123456789abcdef";

async fn post(url: &str, token: &str, body: Value) -> Result<(u16, Value)> {
    let r = reqwest::Client::new()
        .post(url)
        .bearer_auth(token)
        .json(&body)
        .send()
        .await?;
    let status = r.status().as_u16();
    Ok((status, r.json().await.unwrap_or(Value::Null)))
}

async fn get(url: &str, token: &str) -> Result<(u16, Value)> {
    let r = reqwest::Client::new()
        .get(url)
        .bearer_auth(token)
        .send()
        .await?;
    let status = r.status().as_u16();
    Ok((status, r.json().await.unwrap_or(Value::Null)))
}

/// `(action, by, role, count, target)` of the audit log, newest first.
async fn entries(
    sched: &SchedulerHandle,
) -> Result<(Vec<(String, String, String, u64, Value)>, Value)> {
    let (status, v) = get(&sched.url("/v1/audit?limit=1000"), VIEWER).await?;
    ensure!(status == 200, "GET /v1/audit: {status} {v}");
    let s = |e: &Value, k: &str| e[k].as_str().unwrap_or("").to_string();
    let list = v["entries"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|e| {
            (
                s(e, "action"),
                s(e, "by"),
                s(e, "role"),
                e["count"].as_u64().unwrap_or(0),
                e["target"].clone(),
            )
        })
        .collect();
    Ok((list, v))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_operator_action_is_in_the_audit_log_with_its_token_name() -> Result<()> {
    let redis = PrivateRedis::start(None, None).await?;
    let ns = Ns::on_redis(&redis.url(None)).await?;
    let dir = fleet_tests::servers::TempDir::new("audit-tokens")?;
    let file = dir.write(
        "tokens",
        &format!("# unnamed: admin-3\n{FILE_ADMIN} admin\n"),
    )?;
    let tokens = format!("ops-alice:{ALICE} admin, viewer:{VIEWER} read");
    let mut settings: Vec<(&str, &str)> = SCHEDULER.to_vec();
    settings.extend([
        ("api_tokens", tokens.as_str()),
        ("api_tokens_file", file.as_str()),
    ]);
    let sched = start_scheduler(&ns, &settings).await?;
    let mut wsettings: Vec<(&str, &str)> = WORKER.to_vec();
    wsettings.push(("api_tokens", tokens.as_str()));
    // The drain (action 5) waits for the gated task the browser cancels later: however slow
    // the machine, the grace must outlast the browser's part.
    wsettings.push(("drain_grace_ms", "300000"));
    let gate = Gate::default();
    let g = gate.clone();
    let h = handler_fn(move |ctx| {
        let g = g.clone();
        async move {
            if ctx.envelope.payload.get("gated").is_some() {
                g.pass(&ctx.envelope.id).await;
            }
            if ctx.envelope.payload.get("die").is_some() {
                return Err(TaskError::permanent("dies on purpose"));
            }
            Ok(json!({}))
        }
    });
    let w = start_worker(
        &ns,
        "w-audit",
        "pool=audit",
        2,
        &wsettings,
        &[(JOB, h.clone())],
    )
    .await?;

    // 1. cancel (ops-alice, with a reason) of a running task.
    let long = task(JOB, json!({"gated": true}), "pool=audit");
    ns.submit(std::slice::from_ref(&long)).await?;
    ns.wait_state(&long.id, "running", Duration::from_secs(20))
        .await?;
    let (code, body) = post(
        &sched.url(&format!("/v1/tasks/{}/cancel", long.id)),
        ALICE,
        json!({"reason": "wrong deploy"}),
    )
    .await?;
    assert_eq!(code, 202, "{body}");
    assert_eq!(body["cancelled_by"], "ops-alice");
    ns.wait_state(&long.id, "cancelled", Duration::from_secs(20))
        .await?;

    // A running task the console cancels later (the worker drains at the end of the actions).
    let victim = task(JOB, json!({"gated": true}), "pool=audit");
    ns.submit(std::slice::from_ref(&victim)).await?;
    ns.wait_state(&victim.id, "running", Duration::from_secs(20))
        .await?;

    // 2. a read token cannot act (and leaves no entry).
    let (code, _) = post(
        &sched.url(&format!("/v1/tasks/{}/cancel", long.id)),
        VIEWER,
        json!({}),
    )
    .await?;
    assert_eq!(code, 403);
    let (code, _) = post(&sched.url("/v1/workers/w-audit/drain"), VIEWER, json!({})).await?;
    assert_eq!(code, 403);

    // 3. replay of a dead letter (the file's unnamed admin token).
    let dead = task(JOB, json!({"die": true}), "pool=audit");
    ns.submit(std::slice::from_ref(&dead)).await?;
    ns.wait_state(&dead.id, "dead", Duration::from_secs(20))
        .await?;
    wait_for(
        "the dead letter is listed",
        Duration::from_secs(20),
        || async {
            let (_, v) = get(&sched.url("/v1/dead"), VIEWER).await.ok()?;
            v.to_string().contains(&dead.id).then_some(())
        },
    )
    .await?;
    let (code, body) = post(
        &sched.url("/v1/dead/replay"),
        FILE_ADMIN,
        json!({"ids": [dead.id]}),
    )
    .await?;
    assert_eq!(code, 200, "{body}");

    // 3b. a replay by fleetctl straight on the broker (no token): by the login user, role broker.
    let dead2 = task(JOB, json!({"die": true}), "pool=audit");
    ns.submit(std::slice::from_ref(&dead2)).await?;
    ns.wait_state(&dead2.id, "dead", Duration::from_secs(20))
        .await?;
    let api = format!("http://{}", sched.addr);
    let (code, out, err) = fleetctl_with(
        &ns,
        &api,
        &[("USER", "tester")],
        &["dead", "replay", &dead2.id],
    )
    .await?;
    assert_eq!((code, out.trim()), (0, "replayed=1"), "{err}");

    // 4. schedules: add, pause, resume, fire, remove (ops-alice).
    let name = format!("audit-{}", ns.name);
    let spec = json!({"name": name, "cron": "0 0 1 1 *", "task": {"kind": JOB, "labels": {"pool": "audit"}, "payload": {}}});
    let (code, body) = post(&sched.url("/v1/schedules"), ALICE, spec).await?;
    assert_eq!(code, 201, "{body}");
    for action in ["pause", "resume", "fire"] {
        let (code, body) = post(
            &sched.url(&format!("/v1/schedules/{name}/{action}")),
            ALICE,
            json!({}),
        )
        .await?;
        assert!(code == 200 || code == 202, "{action}: {code} {body}");
    }
    let r = reqwest::Client::new()
        .delete(sched.url(&format!("/v1/schedules/{name}")))
        .bearer_auth(ALICE)
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 200);

    // 5. drain (ops-alice).
    let (code, body) = post(&sched.url("/v1/workers/w-audit/drain"), ALICE, json!({})).await?;
    assert_eq!(code, 202, "{body}");

    let alice = |a: &str, t: Value| {
        (
            a.to_string(),
            "ops-alice".to_string(),
            "admin".to_string(),
            1,
            t,
        )
    };
    let want = vec![
        alice("drain", json!({"worker": "w-audit"})),
        alice("schedule_remove", json!({"schedule": name})),
        // The fired task's id is the schedule's: checked below.
        alice("schedule_fire", Value::Null),
        alice("schedule_resume", json!({"schedule": name})),
        alice("schedule_pause", json!({"schedule": name})),
        alice("schedule_add", json!({"schedule": name})),
        (
            "replay".to_string(),
            "fleetctl:tester".to_string(),
            "broker".to_string(),
            1,
            json!({"ids": [dead2.id], "all": false}),
        ),
        (
            "replay".to_string(),
            "admin-3".to_string(),
            "admin".to_string(),
            1,
            json!({"ids": [dead.id], "all": false, "reason": null, "kind": null}),
        ),
        alice("cancel", json!({"task": long.id})),
    ];
    let same = |got: &[(String, String, String, u64, Value)]| {
        got.len() == want.len()
            && got.iter().zip(&want).all(|(g, w)| {
                (&g.0, &g.1, &g.2, g.3) == (&w.0, &w.1, &w.2, w.3) && (w.4.is_null() || g.4 == w.4)
            })
    };
    let waited = wait_for(
        "every action in the audit log",
        Duration::from_secs(10),
        || async {
            let (got, raw) = entries(&sched).await.ok()?;
            same(&got).then_some((got, raw))
        },
    )
    .await;
    let (got, raw) = match waited {
        Ok(v) => v,
        Err(e) => anyhow::bail!("{e}; the log holds {:?}", entries(&sched).await?.0),
    };
    assert_eq!(got[2].4["schedule"], json!(name));
    assert!(got[2].4["task"].as_str().is_some_and(|t| !t.is_empty()));
    let text = raw.to_string();
    for secret in [ALICE, VIEWER, FILE_ADMIN] {
        assert!(!text.contains(secret), "a token is in the audit log");
    }
    assert_eq!(raw["entries"][8]["reason"], "wrong deploy");
    // fleetctl audit shows the same (read token).
    let (code, out, err) =
        fleetctl_with(&ns, &api, &[("FLEET_API_TOKEN", VIEWER)], &["audit"]).await?;
    assert_eq!(code, 0, "{err}");
    let rows: Vec<Vec<&str>> = out
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 10, "9 entries and the count line:\n{out}");
    assert_eq!(rows[0][1..5], ["drain", "ops-alice", "admin", "1"], "{out}");
    assert_eq!(
        rows[6][1..5],
        ["replay", "fleetctl:tester", "broker", "1"],
        "{out}"
    );
    assert!(out.contains("9 of 9 entries"), "{out}");
    println!(
        "audit log: {} entries, newest first: {:?}",
        got.len(),
        got.iter().map(|g| &g.0).collect::<Vec<_>>()
    );

    // The console's Audit view shows the same entries, and its Cancel button cancels a
    // running task (a real Chromium).
    let actions: Vec<&str> = got.iter().map(|g| g.0.as_str()).collect();
    browser_check(
        &sched,
        &json!({"actions": actions, "by": "ops-alice", "cancel": victim.id}),
    )
    .await?;
    let st = ns
        .wait_state(&victim.id, "cancelled", Duration::from_secs(20))
        .await?;
    assert_eq!(
        st.get("cancelled_by").map(String::as_str),
        Some("ops-alice")
    );
    let (got, raw) = entries(&sched).await?;
    assert_eq!(got.len(), 10, "the button's cancel is the tenth entry");

    // The log is the control stream's: the same after a Redis loss and a new scheduler.
    let ids = |v: &Value| -> Vec<String> {
        v["entries"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| e["id"].as_str().unwrap_or("").to_string())
            .collect()
    };
    let before = ids(&raw);
    sched.stop().await?;
    redis.flushall().await?;
    let again = start_scheduler(&ns, &settings).await?;
    // Until it has read the stream it answers 503 audit_loading — never a partial log.
    let partial = std::sync::Mutex::new(Vec::new());
    let waited = wait_for(
        "the new scheduler read the log",
        Duration::from_secs(20),
        || async {
            let (status, raw) = get(&again.url("/v1/audit?limit=1000"), VIEWER).await.ok()?;
            if status == 503 {
                return (raw["error"] == "audit_loading").then_some(()).and(None);
            }
            if status == 200 && ids(&raw) != before {
                if let Ok(mut p) = partial.lock() {
                    p.push(ids(&raw).len());
                }
            }
            (status == 200 && ids(&raw) == before).then_some(raw)
        },
    )
    .await;
    let partial = partial.into_inner().unwrap_or_default();
    assert!(
        partial.is_empty(),
        "partial logs answered 200: {partial:?} entries"
    );
    let after = match waited {
        Ok(v) => v,
        Err(e) => anyhow::bail!("{e}; the log holds {:?}", entries(&again).await?.0),
    };
    assert_eq!(ids(&after), before, "the same entries, in the same order");
    gate.open(&long.id);
    gate.open(&victim.id);
    w.stop().await?;
    again.stop().await?;
    ns.cleanup().await
}

/// Runs `tests/ui/audit.test.mjs` against `sched` (read token), screenshots in
/// `target/ui-screenshots/`.
async fn browser_check(sched: &SchedulerHandle, expect: &Value) -> Result<()> {
    let ui = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("ui");
    ensure!(
        ui.join("node_modules/playwright-core").exists(),
        "playwright-core is not installed in {}: run `bash ops/services.sh --browser`",
        ui.display()
    );
    let shots = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"))
        .join("ui-screenshots");
    std::fs::create_dir_all(&shots)?;
    let run = tokio::process::Command::new("node")
        .arg(ui.join("audit.test.mjs"))
        .current_dir(&ui)
        .env("FLEET_UI_BASE", format!("http://{}", sched.addr))
        .env("FLEET_READ_TOKEN", VIEWER)
        .env("FLEET_ADMIN_TOKEN", ALICE)
        .env("FLEET_EXPECT", expect.to_string())
        .env("FLEET_SCREENSHOTS", &shots)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .map_err(|_| anyhow::anyhow!("the browser script did not finish within 120 s"))??;
    print!("{}", String::from_utf8_lossy(&out.stdout));
    ensure!(
        out.status.success(),
        "the browser script failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// A drain answered 202 holds when Redis loses everything before the worker's heartbeat read
/// the `draining` state: the worker reads the drain in the control stream and drains. Before
/// (the drain only in Redis): the worker registered again as active and never drained.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_drain_survives_a_redis_loss_before_the_worker_reads_it() -> Result<()> {
    let redis = PrivateRedis::start(None, None).await?;
    let ns = Ns::on_redis(&redis.url(None)).await?;
    // The worker's slow heartbeat must not get it evicted meanwhile.
    let sched = start_scheduler(
        &ns,
        &[
            ("health_interval_ms", "300"),
            ("heartbeat_timeout_ms", "30000"),
        ],
    )
    .await?;
    // A slow heartbeat: it would read `draining` only seconds after the answer.
    let slow = [
        ("heartbeat_interval_ms", "5000"),
        ("heartbeat_timeout_ms", "30000"),
    ];
    let w = start_worker(&ns, "w-drain-durable", "pool=dd", 1, &slow, &[]).await?;
    let (code, body) = reqwest::Client::new()
        .post(sched.url("/v1/workers/w-drain-durable/drain"))
        .json(&json!({}))
        .send()
        .await
        .map(|r| (r.status().as_u16(), r))?;
    assert_eq!(code, 202, "{:?}", body.text().await);
    redis.flushall().await?;
    let ended = tokio::time::timeout(Duration::from_secs(20), w.join).await;
    assert!(
        matches!(ended, Ok(Ok(Ok(())))),
        "the worker did not drain and exit after the Redis loss: {ended:?}"
    );
    let (_, v) = get(&sched.url("/v1/audit"), "").await?;
    assert_eq!(v["entries"][0]["action"], "drain", "{v}");
    assert_eq!(v["entries"][0]["by"], "anonymous", "{v}");
    sched.stop().await?;
    ns.cleanup().await
}
