//! Task status end to end: `GET /v1/tasks/{id}` on the scheduler follows a task through
//! queued → running → retrying → (queued →) running → succeeded, and `fleetctl status ID`
//! (`--wait`) prints the same record as JSON with meaningful exit codes. Each state is held
//! by the test (gated handler runs, a full worker slot) until the API showed it, so it is
//! observed, not raced. The record's `attempts` lists every attempt that ended (worker, times,
//! outcome, error); the attempt log behind it is capped and expires with the status.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fleet_tests::*;
use fleet_worker::executor::{handler_fn, TaskError};
use serde_json::{json, Value};

/// Polls a task's status through the API and keeps every change of (state, attempt).
struct Watcher {
    seen: Arc<Mutex<Vec<(String, String)>>>,
    stop: Arc<AtomicBool>,
    join: tokio::task::JoinHandle<()>,
}

impl Watcher {
    fn start(url: String) -> Watcher {
        let seen: Arc<Mutex<Vec<(String, String)>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (s, st) = (seen.clone(), stop.clone());
        let join = tokio::spawn(async move {
            let client = reqwest::Client::new();
            while !st.load(Ordering::SeqCst) {
                if let Ok(r) = client.get(&url).send().await {
                    if let Ok(v) = r.json::<Value>().await {
                        let state = v["state"].as_str().unwrap_or("").to_string();
                        let attempt = v["attempt"]
                            .as_u64()
                            .map(|a| a.to_string())
                            .unwrap_or_default();
                        if let Ok(mut seen) = s.lock() {
                            if !state.is_empty()
                                && seen.last() != Some(&(state.clone(), attempt.clone()))
                            {
                                seen.push((state, attempt));
                            }
                        }
                    }
                }
                scenario_pause(Duration::from_millis(5), "the watcher's pace").await;
            }
        });
        Watcher { seen, stop, join }
    }

    /// Waits until the watcher has seen (state, attempt) through the API: a state the test
    /// holds is released only once the API showed it, so no poll can miss it.
    async fn saw(&self, state: &str, attempt: &str) -> anyhow::Result<()> {
        wait_for(
            &format!("the API to show {state} (attempt {attempt})"),
            Duration::from_secs(15),
            || async {
                self.seen
                    .lock()
                    .ok()?
                    .iter()
                    .any(|(s, a)| s == state && a == attempt)
                    .then_some(())
            },
        )
        .await
    }

    async fn finish(self) -> Vec<(String, String)> {
        self.stop.store(true, Ordering::SeqCst);
        let _ = tokio::time::timeout(Duration::from_secs(5), self.join).await;
        self.seen.lock().map(|s| s.clone()).unwrap_or_default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn status_follows_a_task_through_its_life() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let gate = Gate::default();
    let g = gate.clone();
    // Each run waits for the test to open its gate; `fail_first` fails attempt 1.
    let gated = handler_fn(move |ctx| {
        let g = g.clone();
        async move {
            g.pass(&ctx.envelope.id).await;
            if ctx.envelope.payload["fail_first"] == true && ctx.attempt == 1 {
                return Err(TaskError::retryable("first attempt fails"));
            }
            Ok(json!({"attempt": ctx.attempt}))
        }
    });
    let h = [("gated", gated)];
    // One slot under test; the idle group keeps the fleet's load, and so the pressure, low.
    // A long backoff keeps `retrying` visible (the wait is at least one 100 ms delay tier).
    let w = start_worker(
        &ns,
        "w-status",
        "pool=status",
        1,
        &[("retry_base_ms", "2000"), ("retry_cap_ms", "2000")],
        &h,
    )
    .await?;
    let idle = start_worker(&ns, "w-idle", "pool=idle", 8, &[], &h).await?;
    let api = sched.url("");

    // A holds the only slot.
    let a = task("gated", json!({}), "pool=status");
    ns.submit(std::slice::from_ref(&a)).await?;
    ns.wait_state(&a.id, "running", Duration::from_secs(15))
        .await?;

    // B waits in the group queue behind it: queued.
    let mut b = task("gated", json!({"fail_first": true}), "pool=status");
    b.max_attempts = Some(3);
    let watcher = Watcher::start(sched.url(&format!("/v1/tasks/{}", b.id)));
    ns.submit(std::slice::from_ref(&b)).await?;
    ns.wait_state(&b.id, "queued", Duration::from_secs(15))
        .await?;
    let st = get_json(&sched.url(&format!("/v1/tasks/{}", b.id))).await?;
    assert_eq!(
        (st["id"].as_str(), st["state"].as_str(), st["lane"].as_str()),
        (Some(b.id.as_str()), Some("queued"), Some("normal")),
        "{st}"
    );
    assert_eq!(st["group"], group_of("pool=status", "builtin"));
    assert_eq!(
        (st.get("attempt"), st.get("worker"), st.get("result")),
        (None, None, None),
        "absent fields absent: {st}"
    );
    assert_eq!(st["attempts"], json!([]), "no attempt ended yet: {st}");
    assert_valid_status(&st)?;

    // fleetctl status: the same record as JSON; exit 0.
    let (code, out, err) = fleetctl(&ns, &api, &["status", &b.id]).await?;
    assert_eq!(code, 0, "stderr: {err}");
    let printed: Value = serde_json::from_str(&out)?;
    assert_eq!(printed["state"], "queued");
    assert_eq!(printed["id"], b.id.as_str());
    // --wait on a task that does not finish in time: prints the last record, exit 1.
    let (code, out, err) =
        fleetctl(&ns, &api, &["status", &b.id, "--wait", "--timeout-s", "1"]).await?;
    assert_eq!(code, 1, "stdout: {out}");
    assert_eq!(serde_json::from_str::<Value>(&out)?["state"], "queued");
    assert!(err.contains("timed out"), "{err}");

    // A finishes; B runs (held), fails its first attempt (retrying), comes back and runs
    // again (held).
    gate.open(&a.id);
    ns.wait_state(&a.id, "succeeded", Duration::from_secs(15))
        .await?;
    ns.wait_state(&b.id, "running", Duration::from_secs(15))
        .await?;
    watcher.saw("running", "1").await?;
    gate.open(&b.id);
    let st = ns
        .wait_state(&b.id, "retrying", Duration::from_secs(15))
        .await?;
    assert_eq!(
        st.get("error").map(String::as_str),
        Some("first attempt fails"),
        "{st:?}"
    );
    assert_eq!(st.get("attempt").map(String::as_str), Some("1"));
    wait_for("attempt 2 to run", Duration::from_secs(15), || async {
        let s = ns.status(&b.id).await.ok().flatten()?;
        (s.get("state").map(String::as_str) == Some("running")
            && s.get("attempt").map(String::as_str) == Some("2"))
        .then_some(())
    })
    .await?;

    // fleetctl status --wait returns once the task is finished: exit 0 with the final record.
    // It asks through a tap, and the held run is let go only once fleetctl got an answer
    // (the task still running), so --wait really waits.
    let tap = ApiTap::start(&api).await?;
    let before = tap.answered();
    let args = ["status", b.id.as_str(), "--wait", "--timeout-s", "30"];
    let waiting = fleetctl(&ns, &tap.url, &args);
    let release = async {
        tap.wait_answered(before + 1, Duration::from_secs(30))
            .await?;
        watcher.saw("running", "2").await?;
        gate.open(&b.id);
        anyhow::Ok(())
    };
    let (out, released) = tokio::join!(waiting, release);
    released?;
    let (code, stdout, stderr) = out?;
    assert_eq!(code, 0, "stderr: {stderr}");
    let fin: Value = serde_json::from_str(&stdout)?;
    assert_eq!(fin["state"], "succeeded", "{fin}");
    // Typed JSON (shared/schema/status.schema.json): numbers, RFC 3339 UTC times, the result
    // as JSON, absent fields absent.
    assert_eq!(fin["attempt"], 2);
    assert_eq!(fin["worker"], "w-status");
    assert_eq!(fin["result"], json!({"attempt": 2}));
    assert!(
        fin.get("error").is_none(),
        "the first attempt's error is gone: {fin}"
    );
    assert!(
        fin.get("reason").is_none() && fin.get("result_truncated").is_none(),
        "{fin}"
    );
    let mut times = Vec::new();
    for k in ["queued_at", "started_at", "finished_at"] {
        let t = fin[k].as_str().unwrap_or_default();
        assert!(t.ends_with('Z'), "{k} is not UTC: {fin}");
        times.push(
            chrono::DateTime::parse_from_rfc3339(t)
                .map_err(|e| anyhow::anyhow!("{k}: {t}: {e}"))?,
        );
    }
    assert!(
        times[0] <= times[1] && times[1] <= times[2],
        "queued ≤ started ≤ finished: {times:?}"
    );
    let age = chrono::Utc::now() - times[2].with_timezone(&chrono::Utc);
    assert!(
        age >= chrono::Duration::zero() && age < chrono::Duration::seconds(60),
        "finished_at is now-ish: {fin}"
    );
    // The attempt log: both attempts, each with its worker, times, outcome and error; the
    // latest entry is the record's own attempt.
    let log = fin["attempts"].as_array().cloned().unwrap_or_default();
    let shape: Vec<_> = log
        .iter()
        .map(|a| {
            (
                a["attempt"].clone(),
                a["worker"].clone(),
                a["outcome"].clone(),
                a.get("error").cloned(),
                a.get("reason").cloned(),
            )
        })
        .collect();
    assert_eq!(
        shape,
        vec![
            (
                json!(1),
                json!("w-status"),
                json!("failed"),
                Some(json!("first attempt fails")),
                None
            ),
            (json!(2), json!("w-status"), json!("succeeded"), None, None),
        ],
        "{fin}"
    );
    assert_eq!(
        (&log[1]["started_at"], &log[1]["finished_at"]),
        (&fin["started_at"], &fin["finished_at"]),
        "the last entry is the record's attempt: {fin}"
    );
    let t = |v: &Value| chrono::DateTime::parse_from_rfc3339(v.as_str().unwrap_or_default()).ok();
    assert!(
        t(&log[0]["started_at"]) <= t(&log[0]["finished_at"])
            && t(&log[0]["finished_at"]) <= t(&log[1]["started_at"]),
        "attempt 1 ends before attempt 2 starts: {fin}"
    );
    assert!(t(&log[0]["started_at"]).is_some(), "{fin}");
    // Stored: B's log holds its failed attempt only (the record keeps the success); A, which
    // succeeded at once, has no log key at all.
    let len = |id: &str| {
        let (store, key) = (ns.store.clone(), ns.names.attempts(id));
        async move {
            store
                .query::<i64>(deadpool_redis::redis::cmd("LLEN").arg(key))
                .await
        }
    };
    assert_eq!(
        (len(&b.id).await?, len(&a.id).await?),
        (1, 0),
        "log lengths of B and A"
    );
    assert_eq!(
        ns.store
            .task_attempts(&a.id)
            .await?
            .iter()
            .map(|e| e["outcome"].clone())
            .collect::<Vec<_>>(),
        vec![json!("succeeded")],
        "A's one attempt, from its record"
    );
    assert_valid_status(&fin)?;

    // Every state the API showed for B, in order. The `queued` between the retry's return and
    // attempt 2 lasts milliseconds and may slip between two polls.
    let seen = watcher.finish().await;
    println!("B as seen through the API: {seen:?}");
    let mut states: Vec<(String, String)> = seen.clone();
    if states.get(3).is_some_and(|(s, _)| s == "queued") {
        states.remove(3);
    }
    let want: Vec<(String, String)> = [
        ("queued", ""),
        ("running", "1"),
        ("retrying", "1"),
        ("running", "2"),
        ("succeeded", "2"),
    ]
    .iter()
    .map(|(s, a)| (s.to_string(), a.to_string()))
    .collect();
    assert_eq!(states, want, "seen: {seen:?}");

    w.stop().await?;
    idle.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unknown_tasks_are_404_and_fleetctl_exits_1() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let r = reqwest::get(sched.url("/v1/tasks/no-such-task")).await?;
    assert_eq!(r.status().as_u16(), 404);
    let body: Value = r.json().await?;
    assert_eq!(body["error"], "unknown_task");
    let api = sched.url("");
    for args in [
        vec!["status", "no-such-task"],
        vec!["status", "no-such-task", "--wait", "--timeout-s", "1"],
    ] {
        let (code, out, err) = fleetctl(&ns, &api, &args).await?;
        assert_eq!(code, 1, "{args:?}: stdout {out}");
        assert!(out.is_empty(), "{args:?}: {out}");
        assert!(
            err.contains("task no-such-task not found"),
            "{args:?}: {err}"
        );
    }
    // No scheduler to ask: an error, exit 1.
    let (code, _, err) = fleetctl(&ns, "http://127.0.0.1:9", &["status", "x"]).await?;
    assert_eq!(code, 1);
    assert!(err.contains("GET http://127.0.0.1:9/v1/tasks/x"), "{err}");
    sched.stop().await?;
    ns.cleanup().await
}

/// Validates a status answer against the published schema (shared/schema/status.schema.json).
fn assert_valid_status(v: &Value) -> anyhow::Result<()> {
    let schema: Value =
        serde_json::from_str(include_str!("../../../shared/schema/status.schema.json"))?;
    let validator = jsonschema::options()
        .should_validate_formats(true)
        .build(&schema)
        .map_err(|e| anyhow::anyhow!("status schema: {e}"))?;
    let errors: Vec<String> = validator
        .iter_errors(v)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect();
    anyhow::ensure!(
        errors.is_empty(),
        "status {v} does not match the schema: {errors:?}"
    );
    Ok(())
}

#[test]
fn status_schema_refuses_strings_for_numbers_and_epoch_times() -> anyhow::Result<()> {
    // The schema must be able to fail: the old all-strings shape is refused.
    let old = json!({"id": "t", "state": "succeeded", "attempt": "1", "queued_at": "1796028370236", "result": "{\"a\":1}"});
    assert!(assert_valid_status(&old).is_err());
    assert!(
        assert_valid_status(&json!({"state": "queued"})).is_err(),
        "id is required"
    );
    assert_valid_status(
        &json!({"id": "t", "state": "waiting_for_worker", "attempt": 1, "queued_at": "2026-11-30T08:46:10.236Z", "result": {"a": 1}}),
    )
}

/// The attempt log at the Redis level: capped at `ATTEMPT_LOG_MAX` (the oldest dropped) and
/// living as long as the status record (the same TTL, renewed with each outcome).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempt_log_is_capped_and_expires_with_the_status() -> anyhow::Result<()> {
    use fleet::run::Finished;
    use fleet::status::ATTEMPT_LOG_MAX;
    let ns = Ns::new().await?;
    let ttl = Duration::from_secs(600);
    let n = ATTEMPT_LOG_MAX as u32 + 5;
    for attempt in 1..=n {
        let f = Finished {
            lane: fleet::Lane::Normal,
            id: "capped".into(),
            attempt,
            state: Some(fleet::status::TaskState::Retrying),
            text: format!("failure {attempt}"),
            success: false,
            reason: None,
        };
        ns.store
            .finish("w-cap", "g-cap", "i-cap", ttl, &[f], &[])
            .await?;
    }
    let log = ns.store.task_attempts("capped").await?;
    let attempts: Vec<u64> = log.iter().filter_map(|a| a["attempt"].as_u64()).collect();
    assert_eq!(
        attempts,
        (6..=u64::from(n)).collect::<Vec<_>>(),
        "the latest {ATTEMPT_LOG_MAX} attempts, oldest first"
    );
    assert!(
        log.iter()
            .all(|a| a["outcome"] == "failed" && a["error"] == format!("failure {}", a["attempt"])),
        "{log:?}"
    );
    let pttl = |key: String| {
        let store = ns.store.clone();
        async move {
            store
                .query::<i64>(deadpool_redis::redis::cmd("PTTL").arg(key))
                .await
        }
    };
    let (log_ttl, status_ttl) = (
        pttl(ns.names.attempts("capped")).await?,
        pttl(ns.names.task("capped")).await?,
    );
    assert!(
        log_ttl > 590_000 && log_ttl <= 600_000 && (log_ttl - status_ttl).abs() < 5_000,
        "log TTL {log_ttl} ms, status TTL {status_ttl} ms"
    );
    ns.cleanup().await
}

/// The status record says what the task was: `kind` and `submitted_at` are written with its
/// first state by the script call that writes it (reserve.lua for queued/parked, the
/// scheduler's batch write for waiting_for_worker), shown by the API and by `fleetctl status`
/// from the first lookup to the end — before, a lookup had neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_status_record_says_what_the_task_was() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let rec = Recorder::default();
    let w = start_worker(
        &ns,
        "w-kind",
        "zone=a",
        1,
        &[],
        &[("record", rec.handler())],
    )
    .await?;
    let c = reqwest::Client::new();
    let submitted_at = "2026-12-01T10:00:00.000Z";
    // One that runs, one no live worker matches (waiting_for_worker).
    let r = c
        .post(sched.url("/v1/tasks"))
        .json(&json!([
            {"id": format!("{}-runs", ns.name), "kind": "record", "labels": {"zone": "a"}, "submitted_at": submitted_at},
            {"id": format!("{}-waits", ns.name), "kind": "resize", "labels": {"zone": "b"}},
        ]))
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 202, "{:?}", r.text().await?);
    let runs = format!("{}-runs", ns.name);
    let waits = format!("{}-waits", ns.name);
    ns.wait_state(&runs, "succeeded", Duration::from_secs(20))
        .await?;
    let v = get_json(&sched.url(&format!("/v1/tasks/{runs}"))).await?;
    assert_eq!(
        (v["kind"].as_str(), v["submitted_at"].as_str()),
        (Some("record"), Some(submitted_at)),
        "{v}"
    );
    let v = wait_for("waiting for a worker", Duration::from_secs(10), || async {
        let v = get_json(&sched.url(&format!("/v1/tasks/{waits}")))
            .await
            .ok()?;
        (v["state"] == "waiting_for_worker").then_some(v)
    })
    .await?;
    assert_eq!(v["kind"], "resize", "{v}");
    // Stamped by the API at submission: a time, at most a minute old.
    let at = v["submitted_at"]
        .as_str()
        .and_then(|t| chrono::DateTime::parse_from_rfc3339(t).ok())
        .ok_or_else(|| anyhow::anyhow!("no submitted_at: {v}"))?;
    let age = chrono::Utc::now().signed_duration_since(at);
    assert!(
        age >= chrono::Duration::zero() - chrono::Duration::seconds(5)
            && age < chrono::Duration::seconds(60),
        "{v}"
    );
    let api = format!("http://{}", sched.addr);
    let (code, out, err) = fleetctl(&ns, &api, &["status", &runs]).await?;
    assert_eq!(code, 0, "{err}");
    let shown: Value = serde_json::from_str(&out)?;
    assert_eq!(
        (shown["kind"].as_str(), shown["submitted_at"].as_str()),
        (Some("record"), Some(submitted_at)),
        "{out}"
    );
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
