//! The console's Batches view (issue 36, "the console shows a batch's progress"): a batch of
//! ten — five that succeed, three that fail for good, two held until the browser has checked
//! the running state — looked up in headless Chromium (`tests/ui/batch.test.mjs`): every
//! figure on the page equals `GET /v1/batches/{id}` for the same moment, while it runs and
//! once complete (its `on_complete` fired once), and a failed member opens its task.

use std::time::Duration;

use anyhow::{ensure, Result};
use fleet_tests::*;
use fleet_worker::executor::{handler_fn, TaskError};
use serde_json::{json, Value};

const OPS: &str = "ops-admin-batch-0123456789abcdef";

async fn send(method: reqwest::Method, url: &str, body: Option<&Value>) -> Result<(u16, Value)> {
    let mut req = reqwest::Client::new().request(method, url).bearer_auth(OPS);
    if let Some(b) = body {
        req = req.json(b);
    }
    let r = req.send().await?;
    let status = r.status().as_u16();
    Ok((status, r.json().await.unwrap_or(Value::Null)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_console_shows_a_batch_s_progress() -> Result<()> {
    let ui = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("ui");
    ensure!(
        ui.join("node_modules/playwright-core").exists(),
        "playwright-core is not installed in {}: run `bash ops/services.sh --browser`",
        ui.display()
    );
    let ns = Ns::new().await?;
    let tokens = format!("ops:{OPS} admin");
    let mut settings: Vec<(&str, &str)> = SCHEDULER.to_vec();
    settings.push(("api_tokens", tokens.as_str()));
    let sched = start_scheduler(&ns, &settings).await?;
    let gate = Gate::default();
    let held = {
        let gate = gate.clone();
        handler_fn(move |ctx| {
            let gate = gate.clone();
            async move {
                gate.pass(&ctx.envelope.id).await;
                Ok(json!({}))
            }
        })
    };
    let boom = handler_fn(|_ctx| async move { Err::<Value, _>(TaskError::permanent("boom")) });
    let done = Recorder::default();
    let callbacks = Recorder::default();
    let h = [
        (JOB, done.handler()),
        ("boom", boom),
        ("hold", held),
        ("callback", callbacks.handler()),
    ];
    let w = start_worker(&ns, "w-batch", "", 8, WORKER, &h).await?;
    wait_for("scheduler ready", Duration::from_secs(30), || async {
        let r = reqwest::get(sched.url("/readyz")).await.ok()?;
        r.status().is_success().then_some(())
    })
    .await?;

    let batch = format!("b-{}", ns.name);
    let kind = |i: usize| match i {
        0..=4 => JOB,
        5..=7 => "boom",
        _ => "hold",
    };
    let tasks: Vec<Value> = (0..10)
        .map(|i| json!({"id": format!("{batch}-m{i}"), "kind": kind(i), "payload": {"i": i}}))
        .collect();
    let body = json!({"id": batch, "tasks": tasks, "on_complete": {"kind": "callback"}});
    let (code, answer) = send(
        reqwest::Method::POST,
        &sched.url("/v1/batches"),
        Some(&body),
    )
    .await?;
    assert_eq!(code, 202, "{answer}");
    // Eight members ended, two held: the state the browser checks first.
    wait_for("8 of 10 ended", Duration::from_secs(30), || async {
        let (_, p) = send(
            reqwest::Method::GET,
            &sched.url(&format!("/v1/batches/{batch}")),
            None,
        )
        .await
        .ok()?;
        (p["pending"] == 2 && p["succeeded"] == 5 && p["dead"] == 3).then_some(())
    })
    .await?;

    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"));
    let shots = target.join("ui-screenshots");
    std::fs::create_dir_all(&shots)?;
    let phase = shots.join(format!("batch-phase-{}", ns.name));
    let _ = std::fs::remove_file(&phase);
    let child = tokio::process::Command::new("node")
        .arg(ui.join("batch.test.mjs"))
        .current_dir(&ui)
        .env("FLEET_UI_BASE", format!("http://{}", sched.addr))
        .env("FLEET_ADMIN_TOKEN", OPS)
        .env("FLEET_SCREENSHOTS", &shots)
        .env("FLEET_BATCH", &batch)
        .env("FLEET_PHASE_FILE", &phase)
        .kill_on_drop(true)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let script = tokio::spawn(child.wait_with_output());
    // The browser has checked the running state: the two held members may finish.
    let checked = wait_for(
        "the browser's running check",
        Duration::from_secs(90),
        || async { (phase.exists() || script.is_finished()).then_some(()) },
    )
    .await;
    gate.open(&format!("{batch}-m8"));
    gate.open(&format!("{batch}-m9"));
    let out = tokio::time::timeout(Duration::from_secs(120), script).await???;
    println!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let _ = std::fs::remove_file(&phase);
    checked?;
    ensure!(
        out.status.success(),
        "the browser script failed: {}",
        out.status
    );

    // The batch as the servers have it: every member ran once, on_complete fired once.
    let (_, p) = send(
        reqwest::Method::GET,
        &sched.url(&format!("/v1/batches/{batch}")),
        None,
    )
    .await?;
    assert_eq!(
        (&p["succeeded"], &p["dead"], &p["failed"], &p["fired"]),
        (
            &json!(7),
            &json!(3),
            &json!([
                format!("{batch}-m5"),
                format!("{batch}-m6"),
                format!("{batch}-m7")
            ]),
            &json!(["on_complete"])
        )
    );
    assert_eq!(done.count(), 5);
    assert_eq!(callbacks.count(), 1);
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
