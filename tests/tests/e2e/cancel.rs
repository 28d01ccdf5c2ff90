//! Cancel (issue 32 item 1): `POST /v1/tasks/{id}/cancel` and `fleetctl cancel`.
//!
//! A task not yet running never runs (queued or parked: its message is moved to
//! `<ns>.cancelled` where it is next reached); a running one is stopped on its worker at once — a builtin future dropped, an
//! exec run's whole process group (grandchildren too) SIGTERMed, then SIGKILLed after the
//! grace; either way it ends `cancelled`, is never retried and never dead-lettered. The cancel
//! holds when the worker running the task is killed -9 (its redelivered copy never runs on a
//! peer) and when Redis loses everything (the control stream `<ns>.control` brings it back).
//! An ended task answers 409, a second cancel 200, an unknown id 404. A cancel made through
//! one scheduler replica holds on another (the FLUSHALL test: the replica that took the
//! cancel stops, the other writes its mark back from the stream).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fleet_tests::*;
use fleet_worker::executor::{handler_fn, Handler};
use serde_json::{json, Value};

/// POSTs a cancel; (status, body).
async fn cancel(
    sched: &SchedulerHandle,
    id: &str,
    reason: Option<&str>,
) -> anyhow::Result<(u16, Value)> {
    let body = match reason {
        Some(r) => json!({ "reason": r }),
        None => json!({}),
    };
    let r = reqwest::Client::new()
        .post(sched.url(&format!("/v1/tasks/{id}/cancel")))
        .json(&body)
        .send()
        .await?;
    let status = r.status().as_u16();
    Ok((status, r.json().await.unwrap_or(Value::Null)))
}

/// What ran: every start per task id, and when a run's future was dropped or ended.
#[derive(Clone, Default)]
struct Runs {
    starts: Arc<Mutex<HashMap<String, usize>>>,
    ended: Arc<Mutex<HashMap<String, Instant>>>,
}

impl Runs {
    fn count(&self, id: &str) -> usize {
        self.starts
            .lock()
            .map(|m| m.get(id).copied().unwrap_or(0))
            .unwrap_or(0)
    }
    fn total(&self) -> usize {
        self.starts.lock().map(|m| m.values().sum()).unwrap_or(0)
    }
    fn ended(&self, id: &str) -> Option<Instant> {
        self.ended.lock().ok().and_then(|m| m.get(id).copied())
    }
}

/// Notes when the run that holds it ends (its future dropped too).
struct EndGuard(Runs, String);

impl Drop for EndGuard {
    fn drop(&mut self) {
        if let Ok(mut m) = self.0.ended.lock() {
            m.insert(self.1.clone(), Instant::now());
        }
    }
}

/// A handler that records the run, then waits for `gate` when `payload.gated`, or sleeps
/// `payload.ms`.
fn recording(runs: &Runs, gate: &Gate) -> Arc<dyn Handler> {
    let (runs, gate) = (runs.clone(), gate.clone());
    handler_fn(move |ctx| {
        let (runs, gate) = (runs.clone(), gate.clone());
        async move {
            let id = ctx.envelope.id.clone();
            if let Ok(mut m) = runs.starts.lock() {
                *m.entry(id.clone()).or_default() += 1;
            }
            let _end = EndGuard(runs.clone(), id.clone());
            if ctx.envelope.payload.get("gated").is_some() {
                gate.pass(&id).await;
            }
            if ctx.envelope.payload.get("fail").is_some() {
                return Err(fleet_worker::executor::TaskError::retryable(
                    "fails on purpose",
                ));
            }
            let ms = ctx
                .envelope
                .payload
                .get("ms")
                .and_then(Value::as_u64)
                .unwrap_or(0);
            tokio::time::sleep(Duration::from_millis(ms)).await;
            Ok(json!({"ok": true}))
        }
    })
}

/// The attempt log entries of a task (`GET /v1/tasks/{id}`).
async fn attempts(sched: &SchedulerHandle, id: &str) -> anyhow::Result<Vec<Value>> {
    let v = get_json(&sched.url(&format!("/v1/tasks/{id}"))).await?;
    Ok(v["attempts"].as_array().cloned().unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queued_and_parked_tasks_cancelled_never_run() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let (runs, gate) = (Runs::default(), Gate::default());
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let h = [(JOB, recording(&runs, &gate))];
    // Two groups match `pool=c1` (so no direct dispatch: past their room, tasks park), each
    // with one slot held by a gated run; 200 tasks wait behind them, queued or parked.
    let wa = start_worker(&ns, "w-c1a", "pool=c1,n=a", 1, WORKER, &h).await?;
    let wb = start_worker(&ns, "w-c1b", "pool=c1,n=b", 1, WORKER, &h).await?;
    let blockers = [
        task(JOB, json!({"gated": true}), "pool=c1,n=a"),
        task(JOB, json!({"gated": true}), "pool=c1,n=b"),
    ];
    ns.submit(&blockers).await?;
    for b in &blockers {
        ns.wait_state(&b.id, "running", Duration::from_secs(20))
            .await?;
    }
    let envs: Vec<_> = (0..200)
        .map(|i| task(JOB, json!({"i": i}), "pool=c1"))
        .collect();
    assert_eq!(ns.submit(&envs).await?, (200, 0));
    let mut waiting: HashMap<String, usize> = HashMap::new();
    for e in &envs {
        let st = wait_for("a waiting status", Duration::from_secs(30), || async {
            ns.state_of(&e.id)
                .await
                .filter(|s| s == "queued" || s == "parked")
        })
        .await?;
        *waiting.entry(st).or_default() += 1;
    }
    for e in &envs {
        let (code, body) = cancel(&sched, &e.id, Some("wrong deploy")).await?;
        let before = ns.status(&e.id).await?;
        assert_eq!(code, 202, "{body} (status now {before:?})");
        assert_eq!(body["state"], "cancelled");
    }
    for b in &blockers {
        gate.open(&b.id);
        ns.wait_state(&b.id, "succeeded", Duration::from_secs(20))
            .await?;
    }
    ns.wait_settled(Duration::from_secs(60)).await?;
    // Parked tasks are reached by the park release: wait until the park queues are empty too.
    let groups: Vec<String> = ns
        .store
        .groups()
        .await?
        .into_iter()
        .map(|g| g.group)
        .collect();
    assert_eq!(groups.len(), 2, "{groups:?}");
    let parks: Vec<String> = groups
        .iter()
        .map(|g| ns.names.park_queue(g, fleet::Lane::Normal))
        .collect();
    wait_for(
        "the park queues drained",
        Duration::from_secs(30),
        || async {
            for p in &parks {
                if ns.depth(p).await > 0 {
                    return None;
                }
            }
            Some(())
        },
    )
    .await?;
    let mut states: HashMap<String, usize> = HashMap::new();
    for e in &envs {
        *states
            .entry(ns.state_of(&e.id).await.unwrap_or_default())
            .or_default() += 1;
    }
    let ran: usize = envs.iter().map(|e| runs.count(&e.id)).sum();
    let dead = ns.drain_dead().await?;
    println!("cancel 200 waiting tasks: groups {groups:?}, waiting {waiting:?}, ran {ran}, states {states:?}, dead letters {}", dead.len());
    assert_eq!(ran, 0, "a cancelled task ran");
    assert_eq!(runs.total(), 2, "only the blockers ran");
    assert_eq!(states.get("cancelled"), Some(&200), "{states:?}");
    assert!(dead.is_empty(), "nothing dead-lettered");
    for g in &groups {
        let v = group(&ns.store, g).await;
        assert_eq!(
            v.map(|g| (g.reserved, g.load)),
            Some((0, 0)),
            "{g}: no reservation left"
        );
    }
    wa.stop().await?;
    wb.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_running_builtin_task_stops_at_once_and_is_never_retried() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let (runs, gate) = (Runs::default(), Gate::default());
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let settings = [WORKER, &[("retry_base_ms", "100"), ("retry_cap_ms", "300")]].concat();
    let w = start_worker(
        &ns,
        "w-c3",
        "pool=c3",
        2,
        &settings,
        &[(JOB, recording(&runs, &gate))],
    )
    .await?;
    let mut t = task(JOB, json!({"ms": 300_000}), "pool=c3");
    t.max_attempts = Some(5);
    ns.submit(std::slice::from_ref(&t)).await?;
    ns.wait_state(&t.id, "running", Duration::from_secs(20))
        .await?;
    let asked = Instant::now();
    let (code, body) = cancel(&sched, &t.id, Some("stop it")).await?;
    assert_eq!(code, 202, "{body}");
    assert_eq!(body["previous_state"], "running");
    let ended = wait_for("the run dropped", Duration::from_secs(5), || async {
        runs.ended(&t.id)
    })
    .await?;
    let took = ended.saturating_duration_since(asked);
    let log = wait_for("the attempt logged", Duration::from_secs(5), || async {
        let a = attempts(&sched, &t.id).await.ok()?;
        (!a.is_empty()).then_some(a)
    })
    .await?;
    // Past several retry backoffs: nothing runs again.
    scenario_pause(
        Duration::from_secs(2),
        "longer than the retry backoff (cap 300 ms)",
    )
    .await;
    let st = ns.status(&t.id).await?.unwrap_or_default();
    println!(
        "running builtin task cancelled: stopped {} ms after the request; runs {}; log {log:?}",
        took.as_millis(),
        runs.count(&t.id)
    );
    assert!(took < Duration::from_secs(1), "stopped in {took:?}");
    assert_eq!(runs.count(&t.id), 1, "never retried");
    assert_eq!(
        st.get("state").map(String::as_str),
        Some("cancelled"),
        "{st:?}"
    );
    assert_eq!(st.get("attempt").map(String::as_str), Some("1"), "{st:?}");
    assert_eq!(log.len(), 1, "{log:?}");
    assert_eq!(log[0]["outcome"], "cancelled");
    assert_eq!(log[0]["cancelled_by"], "anonymous");
    assert_eq!(log[0]["cancel_reason"], "stop it");
    assert!(ns.drain_dead().await?.is_empty(), "nothing dead-lettered");
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn delayed_and_retrying_tasks_cancelled_never_run_again() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let (runs, gate) = (Runs::default(), Gate::default());
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    // A retry waits 4 s (base = cap): time to cancel it while it is `retrying`, even on a
    // loaded machine (with 1.5 s, a run beside a full build once saw the retry start before
    // the cancel: the attempt's `retrying` record had come late).
    let settings = [
        WORKER,
        &[
            ("retry_base_ms", "4000"),
            ("retry_cap_ms", "4000"),
            NO_EJECT,
        ][..],
    ]
    .concat();
    let w = start_worker(
        &ns,
        "w-c7",
        "pool=c7",
        2,
        &settings,
        &[(JOB, recording(&runs, &gate))],
    )
    .await?;
    let mut delayed = task(JOB, json!({}), "pool=c7");
    delayed.not_before = Some(chrono::Utc::now() + chrono::Duration::seconds(3));
    let mut retrying = task(JOB, json!({"fail": true}), "pool=c7");
    retrying.max_attempts = Some(5);
    ns.submit(&[delayed.clone(), retrying.clone()]).await?;
    ns.wait_state(&delayed.id, "delayed", Duration::from_secs(10))
        .await?;
    ns.wait_state(&retrying.id, "retrying", Duration::from_secs(10))
        .await?;
    for (t, was) in [(&delayed, "delayed"), (&retrying, "retrying")] {
        let (code, body) = cancel(&sched, &t.id, None).await?;
        assert_eq!(
            (code, body["previous_state"].as_str()),
            (202, Some(was)),
            "{body}"
        );
    }
    // Past the not_before and the backoff: both copies have come back and were dropped.
    scenario_pause(
        Duration::from_secs(6),
        "past the not_before (3 s) and the backoff (4 s)",
    )
    .await;
    ns.wait_settled(Duration::from_secs(30)).await?;
    println!(
        "delayed and retrying tasks cancelled: runs {} and {}",
        runs.count(&delayed.id),
        runs.count(&retrying.id)
    );
    assert_eq!(runs.count(&delayed.id), 0, "the delayed task never ran");
    assert_eq!(
        runs.count(&retrying.id),
        1,
        "the retrying task never ran again"
    );
    for t in [&delayed, &retrying] {
        assert_eq!(ns.state_of(&t.id).await.as_deref(), Some("cancelled"));
    }
    assert!(ns.drain_dead().await?.is_empty(), "nothing dead-lettered");
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// Whether process `pid` runs (a zombie does not).
fn alive(pid: &str) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rsplit(')').next().map(|r| r.trim_start().to_string()))
        .is_some_and(|rest| !rest.starts_with('Z'))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_running_exec_task_and_its_grandchild_die_within_the_grace() -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("fleet-cancel-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir)?;
    // The operator's program: a shell that starts a grandchild and waits for it.
    let script = format!(
        "cat >/dev/null; case \"$FLEET_TASK_KIND\" in long) sleep 300 & echo $! > {d}/$FLEET_TASK_ID.gc; echo $$ > {d}/$FLEET_TASK_ID.pid; wait ;; esac",
        d = dir.display()
    );
    let argv = serde_json::to_string(&["sh", "-c", &script])?;
    let grace_ms = 2000;
    let grace = grace_ms.to_string();
    let settings = [
        ("executor", "exec"),
        ("exec_command", argv.as_str()),
        ("retry_base_ms", "100"),
        ("retry_cap_ms", "300"),
        ("cancel_grace_ms", grace.as_str()),
        NO_EJECT,
    ];
    let f = Fleet::start("w-c2", "case=cancel", 2, &settings, &[]).await?;
    let mut t = task("long", json!({}), "case=cancel");
    t.max_attempts = Some(5);
    f.ns.submit(std::slice::from_ref(&t)).await?;
    let read = |ext: &str| {
        std::fs::read_to_string(dir.join(format!("{}.{ext}", t.id))).unwrap_or_default()
    };
    let (shell, grandchild) = wait_for(
        "both processes started",
        Duration::from_secs(20),
        || async {
            let (p, g) = (read("pid"), read("gc"));
            (p.ends_with('\n') && g.ends_with('\n'))
                .then(|| (p.trim().to_string(), g.trim().to_string()))
        },
    )
    .await?;
    assert!(alive(&shell) && alive(&grandchild));
    let asked = Instant::now();
    let (code, body) = cancel(&f.sched, &t.id, Some("runaway")).await?;
    assert_eq!(code, 202, "{body}");
    wait_for(
        "shell and grandchild gone",
        Duration::from_millis(grace_ms),
        || async { (!alive(&shell) && !alive(&grandchild)).then_some(()) },
    )
    .await?;
    let gone = asked.elapsed();
    let log = wait_for("the attempt logged", Duration::from_secs(5), || async {
        let a = attempts(&f.sched, &t.id).await.ok()?;
        (!a.is_empty()).then_some(a)
    })
    .await?;
    scenario_pause(
        Duration::from_secs(2),
        "longer than the retry backoff (cap 300 ms)",
    )
    .await;
    let st = f.ns.status(&t.id).await?.unwrap_or_default();
    let log_after = attempts(&f.sched, &t.id).await?;
    println!("running exec task cancelled: shell {shell} and grandchild {grandchild} gone {} ms after the request (grace {grace_ms} ms); log {log:?}", gone.as_millis());
    assert_eq!(
        st.get("state").map(String::as_str),
        Some("cancelled"),
        "{st:?}"
    );
    assert_eq!(
        st.get("attempt").map(String::as_str),
        Some("1"),
        "not retried: {st:?}"
    );
    assert_eq!(log_after.len(), 1, "one attempt: {log_after:?}");
    assert_eq!(log_after[0]["outcome"], "cancelled");
    assert!(
        !dir.join(format!("{}.again", t.id)).exists() && read("pid").trim() == shell,
        "the program did not start again"
    );
    assert!(f.ns.drain_dead().await?.is_empty(), "nothing dead-lettered");
    let _ = std::fs::remove_dir_all(&dir);
    f.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ended_tasks_answer_409_a_second_cancel_200_an_unknown_id_404() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let (runs, gate) = (Runs::default(), Gate::default());
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let w = start_worker(
        &ns,
        "w-c4",
        "pool=c4",
        1,
        WORKER,
        &[(JOB, recording(&runs, &gate))],
    )
    .await?;
    let done = task(JOB, json!({}), "pool=c4");
    let held = task(JOB, json!({"gated": true}), "pool=c4");
    let later = task(JOB, json!({}), "pool=c4");
    ns.submit(std::slice::from_ref(&done)).await?;
    ns.wait_state(&done.id, "succeeded", Duration::from_secs(20))
        .await?;
    let (code, body) = cancel(&sched, &done.id, None).await?;
    assert_eq!(
        (code, body["state"].as_str()),
        (409, Some("succeeded")),
        "{body}"
    );
    assert_eq!(ns.state_of(&done.id).await.as_deref(), Some("succeeded"));

    ns.submit(std::slice::from_ref(&held)).await?;
    ns.wait_state(&held.id, "running", Duration::from_secs(20))
        .await?;
    ns.submit(std::slice::from_ref(&later)).await?;
    wait_for("the later task waits", Duration::from_secs(20), || async {
        ns.state_of(&later.id)
            .await
            .filter(|s| s == "queued" || s == "parked")
    })
    .await?;
    // fleetctl first (202, exit 0), then the API again (200, idempotent), then fleetctl again.
    let (rc, out, err) = fleetctl(
        &ns,
        &sched.url(""),
        &["cancel", &later.id, "--reason", "dup"],
    )
    .await?;
    assert_eq!(rc, 0, "{out} {err}");
    assert!(out.contains("cancelled (was "), "{out}");
    let (code, body) = cancel(&sched, &later.id, None).await?;
    assert_eq!((code, &body["already"]), (200, &json!(true)), "{body}");
    let (rc, out, _) = fleetctl(&ns, &sched.url(""), &["cancel", &later.id]).await?;
    assert_eq!(rc, 0);
    assert!(out.contains("already cancelled"), "{out}");
    let (code, body) = cancel(&sched, "no-such-task", None).await?;
    assert_eq!(
        (code, body["error"].as_str()),
        (404, Some("unknown_task")),
        "{body}"
    );
    let (code, _) = reqwest::Client::new()
        .post(sched.url(&format!("/v1/tasks/{}/cancel", held.id)))
        .body("{\"reason\": 3}")
        .header("content-type", "application/json")
        .send()
        .await
        .map(|r| (r.status().as_u16(), ()))?;
    assert_eq!(code, 400);

    gate.open(&held.id);
    ns.wait_state(&held.id, "succeeded", Duration::from_secs(20))
        .await?;
    ns.wait_settled(Duration::from_secs(30)).await?;
    assert_eq!(runs.count(&later.id), 0, "the cancelled task never ran");
    assert_eq!(ns.state_of(&later.id).await.as_deref(), Some("cancelled"));
    let st = ns.status(&later.id).await?.unwrap_or_default();
    assert_eq!(
        st.get("cancel_reason").map(String::as_str),
        Some("dup"),
        "the first cancel's reason stays: {st:?}"
    );
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancel_while_its_worker_is_killed_9_never_runs_it_again() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let ep = Endpoint::start(5).await?;
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let spec = |id| ProcessSpec {
        id,
        labels: "",
        capacity: 2,
        endpoint: &ep.url,
        extra: &[],
    };
    let mut victim = WorkerProcess::spawn(&ns, &spec("w-victim"))?;
    victim
        .wait_state(&ns.store, "active", Duration::from_secs(30))
        .await?;
    let t = jobs(1, "", Some(120_000)).remove(0);
    ns.submit(std::slice::from_ref(&t)).await?;
    wait_for("the victim runs it", Duration::from_secs(20), || async {
        (ep.running("w-victim").len() == 1).then_some(())
    })
    .await?;
    // The peer joins now, so the redelivered copy has a live worker to go to.
    let mut peer = WorkerProcess::spawn(&ns, &spec("w-peer"))?;
    peer.wait_state(&ns.store, "active", Duration::from_secs(30))
        .await?;
    victim.kill9()?;
    ep.mark_dead("w-victim");
    let (code, body) = cancel(&sched, &t.id, Some("kill -9 meanwhile")).await?;
    assert_eq!(code, 202, "{body}");
    // The victim is evicted (its run counted lost) and its copy redelivered to the peer.
    ns.wait_settled(Duration::from_secs(60)).await?;
    let g = wait_for("the victim evicted", Duration::from_secs(30), || async {
        group(&ns.store, "protocol=http")
            .await
            .filter(|g| g.workers == 1 && g.load == 0)
    })
    .await?;
    scenario_pause(
        Duration::from_secs(2),
        "a copy that would run on the peer starts within this",
    )
    .await;
    let calls = ep.per_task().get(&t.id).cloned().unwrap_or_default();
    let st = ns.status(&t.id).await?.unwrap_or_default();
    println!(
        "cancel while its worker is killed -9: calls {:?}; status {st:?}; group {g:?}",
        calls.iter().map(|c| c.worker.clone()).collect::<Vec<_>>()
    );
    assert_eq!(calls.len(), 1, "ran once, on the victim: {calls:?}");
    assert_eq!(
        st.get("state").map(String::as_str),
        Some("cancelled"),
        "{st:?}"
    );
    assert!(ns.drain_dead().await?.is_empty(), "nothing dead-lettered");
    peer.signal("TERM")?;
    peer.wait_exit(Duration::from_secs(30)).await?;
    sched.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancel_through_one_replica_survives_flushall_on_another() -> anyhow::Result<()> {
    let redis = PrivateRedis::start(None, None).await?;
    let ns = Ns::on_redis(&redis.url(None)).await?;
    let (runs, gate) = (Runs::default(), Gate::default());
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    // A second replica: the cancel goes through it, the first must honour it too.
    let other = start_scheduler(&ns, SCHEDULER).await?;
    let w = start_worker(
        &ns,
        "w-c6",
        "pool=c6",
        1,
        WORKER,
        &[(JOB, recording(&runs, &gate))],
    )
    .await?;
    let blocker = task(JOB, json!({"gated": true}), "pool=c6");
    let target = task(JOB, json!({}), "pool=c6");
    ns.submit(std::slice::from_ref(&blocker)).await?;
    ns.wait_state(&blocker.id, "running", Duration::from_secs(20))
        .await?;
    ns.submit(std::slice::from_ref(&target)).await?;
    wait_for("the target waits", Duration::from_secs(20), || async {
        ns.state_of(&target.id)
            .await
            .filter(|s| s == "queued" || s == "parked")
    })
    .await?;
    let (code, body) = cancel(&other, &target.id, Some("before the flush")).await?;
    assert_eq!(code, 202, "{body}");
    other.stop().await?;
    redis.flushall().await?;
    let flushed = Instant::now();
    // The scheduler writes the mark again from the control stream.
    let st = ns
        .wait_state(&target.id, "cancelled", Duration::from_secs(10))
        .await?;
    let back = flushed.elapsed();
    gate.open(&blocker.id);
    wait_for("the blocker ended", Duration::from_secs(20), || async {
        runs.ended(&blocker.id)
    })
    .await?;
    ns.wait_settled(Duration::from_secs(60)).await?;
    scenario_pause(
        Duration::from_secs(1),
        "a run of the target would start within this",
    )
    .await;
    println!(
        "cancel then FLUSHALL: mark back {} ms after the flush; target runs {}; status {st:?}",
        back.as_millis(),
        runs.count(&target.id)
    );
    assert_eq!(
        runs.count(&target.id),
        0,
        "the cancelled task ran after the Redis loss"
    );
    assert_eq!(
        st.get("cancelled_by").map(String::as_str),
        Some("anonymous")
    );
    assert_eq!(
        st.get("cancel_reason").map(String::as_str),
        Some("before the flush")
    );
    assert_eq!(ns.state_of(&target.id).await.as_deref(), Some("cancelled"));
    assert!(ns.drain_dead().await?.is_empty(), "nothing dead-lettered");
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
