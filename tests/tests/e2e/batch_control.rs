//! A batch as a whole (issue 36, `scheduler::api::batch_control`, pause scope `batch`).
//!
//! * Cancelled: its members not yet started never run, the running ones are stopped, its
//!   waiting DAG members are never released, its callbacks never fire, one audit entry — and
//!   the cancel holds across a Redis FLUSHALL and a scheduler restart.
//! * Paused: its members wait in its hold queue (the held count exact) while other work runs,
//!   no DAG member is released and no callback fires — across a FLUSHALL and a restart too —
//!   and after the resume each member runs exactly once, each callback fires once.
//! * The console's Batches view does both with its buttons (headless Chromium,
//!   `tests/ui/batch_control.test.mjs`).

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fleet_tests::*;
use fleet_worker::executor::{handler_fn, Handler};
use serde_json::{json, Value};

/// Kind of the callbacks.
const CALLBACK: &str = "callback";

/// What ran: every start per task id (with when), and the runs that ran to their end.
#[derive(Clone, Default)]
struct Runs {
    starts: Arc<Mutex<Vec<(String, Instant)>>>,
    done: Arc<Mutex<Vec<String>>>,
}

impl Runs {
    fn starts(&self) -> Vec<(String, Instant)> {
        self.starts.lock().map(|v| v.clone()).unwrap_or_default()
    }
    fn done(&self) -> Vec<String> {
        self.done.lock().map(|v| v.clone()).unwrap_or_default()
    }
    fn per_id(&self) -> HashMap<String, usize> {
        let mut m = HashMap::new();
        for (id, _) in self.starts() {
            *m.entry(id).or_default() += 1;
        }
        m
    }
}

/// A handler that records its start, sleeps `payload.ms`, waits for its gate when
/// `payload.gated`, and records that it ran to its end (a run stopped by a cancel is dropped
/// before).
fn recording(runs: &Runs, gate: &Gate) -> Arc<dyn Handler> {
    let (runs, gate) = (runs.clone(), gate.clone());
    handler_fn(move |ctx| {
        let (runs, gate) = (runs.clone(), gate.clone());
        async move {
            let id = ctx.envelope.id.clone();
            if let Ok(mut v) = runs.starts.lock() {
                v.push((id.clone(), Instant::now()));
            }
            let p = &ctx.envelope.payload;
            if let Some(ms) = p.get("ms").and_then(Value::as_u64) {
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            if p.get("gated").and_then(Value::as_bool) == Some(true) {
                gate.pass(&id).await;
            }
            if let Ok(mut v) = runs.done.lock() {
                v.push(id);
            }
            Ok(json!({}))
        }
    })
}

/// Every callback run (task id).
type Seen = Arc<Mutex<Vec<String>>>;

fn callbacks() -> (Seen, Arc<dyn Handler>) {
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let h = handler_fn(move |ctx| {
        let s = s.clone();
        async move {
            if let Ok(mut v) = s.lock() {
                v.push(ctx.envelope.id.clone());
            }
            Ok(json!({}))
        }
    });
    (seen, h)
}

fn seen_of(seen: &Seen) -> Vec<String> {
    seen.lock().map(|v| v.clone()).unwrap_or_default()
}

/// Waits until batch `id` has no member pending; its figures then.
async fn settled(s: &SchedulerHandle, id: &str, timeout: Duration) -> anyhow::Result<Value> {
    wait_for("every member ended", timeout, || async {
        let (code, p) = api_get(s.url(&format!("/v1/batches/{id}"))).await.ok()?;
        (code == 200 && p["pending"] == 0).then_some(p)
    })
    .await
}

/// The `batch_cancel` entries of the audit log.
async fn batch_cancels(s: &SchedulerHandle) -> anyhow::Result<Vec<Value>> {
    let (code, v) = api_get(s.url("/v1/audit?action=batch_cancel&limit=1000")).await?;
    anyhow::ensure!(code == 200, "GET /v1/audit: {code} {v}");
    Ok(v["entries"].as_array().cloned().unwrap_or_default())
}

/// The `cancel` entries of the audit log (a batch's member cancels must add none).
async fn single_cancels(s: &SchedulerHandle) -> anyhow::Result<usize> {
    let (_, v) = api_get(s.url("/v1/audit?action=cancel&limit=1000")).await?;
    Ok(v["entries"].as_array().map(Vec::len).unwrap_or(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_cancelled_midway_runs_no_more_members_and_fires_no_callback() -> anyhow::Result<()>
{
    const TOTAL: usize = 300;
    const CAPACITY: u32 = 4;
    let ns = Ns::new().await?;
    let (runs, gate) = (Runs::default(), Gate::default());
    let (seen, cb) = callbacks();
    let h = [(JOB, recording(&runs, &gate)), (CALLBACK, cb)];
    let s = start_scheduler(&ns, SCHEDULER).await?;
    let w = start_worker(&ns, "w-1", "", CAPACITY, WORKER, &h).await?;
    scheduler_ready(&s).await?;

    let ids: Vec<String> = (0..TOTAL).map(|i| format!("m-{i}")).collect();
    let body = json!({
        "id": "nightly",
        "tasks": ids.iter().map(|id| json!({"id": id, "kind": JOB, "payload": {"ms": 60}})).collect::<Vec<_>>(),
        "on_success": {"kind": CALLBACK},
        "on_complete": {"kind": CALLBACK},
    });
    let (code, answer) = api_post(s.url("/v1/batches"), &body).await?;
    assert_eq!(code, 202, "{answer}");
    wait_for("some members ran", Duration::from_secs(60), || async {
        (runs.done().len() >= 20).then_some(())
    })
    .await?;

    let (code, c) = api_post(
        s.url("/v1/batches/nightly/cancel"),
        &json!({"reason": "bad input file"}),
    )
    .await?;
    let answered = Instant::now();
    assert_eq!(code, 202, "{c}");
    assert_eq!(c["batch"], "nightly");
    assert_eq!(c["total"], TOTAL);
    assert_eq!(c["failed"], 0);
    assert!(c.get("already").is_none(), "{c}");
    let cancelled = c["cancelled"].as_u64().unwrap_or(0) as usize;
    let already_ended = c["already_ended"].as_u64().unwrap_or(0) as usize;
    assert_eq!(cancelled + already_ended, TOTAL, "{c}");
    assert!(cancelled > 0 && already_ended >= 20, "{c}");

    let p = settled(&s, "nightly", Duration::from_secs(60)).await?;
    // Quiet period that is the point: a callback would be published within a few ticks.
    quiet_for(Duration::from_secs(3), "a callback would fire now").await;
    let starts = runs.starts();
    let done: BTreeSet<String> = runs.done().into_iter().collect();
    let failed: BTreeSet<String> = p["failed"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    let succeeded: BTreeSet<String> = ids
        .iter()
        .filter(|i| !failed.contains(*i))
        .cloned()
        .collect();
    let late: Vec<&String> = starts
        .iter()
        .filter(|(_, at)| *at > answered)
        .map(|(id, _)| id)
        .collect();
    println!(
        "batch of {TOTAL} cancelled: answer {c}; figures succeeded {} cancelled {}; started {}, ran to the end {}, started after the answer {late:?}",
        p["succeeded"], p["cancelled"], starts.len(), done.len()
    );
    // Figures: exact. The answer's `already_ended` succeeded; a member running as the cancel
    // came may still have ended `succeeded` (its handler returned before its worker read the
    // cancel): at most one per slot.
    let (ok, gone) = (
        p["succeeded"].as_u64().unwrap_or(0) as usize,
        p["cancelled"].as_u64().unwrap_or(0) as usize,
    );
    assert_eq!(p["total"], TOTAL);
    assert_eq!(ok + gone, TOTAL, "{p}");
    assert!(
        ok >= already_ended && ok - already_ended <= CAPACITY as usize,
        "succeeded {ok}, already ended at the cancel {already_ended}"
    );
    assert_eq!(ok, succeeded.len());
    assert_eq!(
        (p["dead"].as_u64(), p["expired"].as_u64()),
        (Some(0), Some(0))
    );
    assert_eq!(p["complete"], true);
    assert_eq!(p["fired"], json!([]));
    assert_eq!(p["cancel"]["by"], "anonymous");
    assert_eq!(p["cancel"]["reason"], "bad input file");
    assert!(p["cancel"]["at_ms"].as_i64().unwrap_or(0) > 0, "{p}");
    // Runs: at most one per id; no member started once the cancel was answered; every
    // succeeded member ran to its end, and a member that ran to its end without succeeding
    // is one that was running as the cancel came (its outcome came after the mark).
    let per = runs.per_id();
    assert!(per.values().all(|n| *n == 1), "a member ran twice: {per:?}");
    assert!(
        late.is_empty(),
        "members started after the cancel: {late:?}"
    );
    assert!(
        succeeded.is_subset(&done),
        "a succeeded member never ran to its end"
    );
    let stopped_late: Vec<&String> = done.difference(&succeeded).collect();
    assert!(
        stopped_late.len() <= CAPACITY as usize,
        "ran to the end yet cancelled: {stopped_late:?}"
    );
    let started: BTreeSet<String> = per.keys().cloned().collect();
    assert!(
        started.len() <= succeeded.len() + CAPACITY as usize,
        "started {} for {} succeeded",
        started.len(),
        succeeded.len()
    );
    // No callback.
    assert_eq!(seen_of(&seen), Vec::<String>::new());
    // One audit entry, for the batch; none per member.
    let audit = batch_cancels(&s).await?;
    assert_eq!(audit.len(), 1, "{audit:?}");
    assert_eq!(audit[0]["target"], json!({"batch": "nightly"}));
    assert_eq!(audit[0]["reason"], "bad input file");
    assert_eq!(single_cancels(&s).await?, 0);

    // Again: 202, already; no second audit entry. Unknown: 404.
    let (code, again) = api_post(s.url("/v1/batches/nightly/cancel"), &json!({})).await?;
    assert_eq!(code, 202, "{again}");
    assert_eq!(again["already"], true);
    assert_eq!(again["cancelled"], 0, "{again}");
    assert_eq!(again["already_ended"], TOTAL);
    assert_eq!(batch_cancels(&s).await?.len(), 1);
    let (code, _) = api_post(s.url("/v1/batches/nope/cancel"), &json!({})).await?;
    assert_eq!(code, 404);
    assert_eq!(seen_of(&seen), Vec::<String>::new());

    w.stop().await?;
    s.stop().await?;
    ns.cleanup().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dag_batch_cancelled_while_members_wait_never_releases_them() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let (runs, gate) = (Runs::default(), Gate::default());
    let (seen, cb) = callbacks();
    let h = [(JOB, recording(&runs, &gate)), (CALLBACK, cb)];
    let s = start_scheduler(&ns, SCHEDULER).await?;
    let w = start_worker(&ns, "w-1", "", 4, WORKER, &h).await?;
    scheduler_ready(&s).await?;
    let body = json!({
        "id": "chain",
        "tasks": [
            {"id": "A", "kind": JOB, "payload": {"gated": true}},
            {"id": "B", "kind": JOB, "after": ["A"]},
            {"id": "C", "kind": JOB, "after": ["B"]},
            {"id": "D", "kind": JOB, "after": ["A"]},
            {"id": "E", "kind": JOB},
        ],
        "on_complete": {"kind": CALLBACK},
    });
    let (code, answer) = api_post(s.url("/v1/batches"), &body).await?;
    assert_eq!(code, 202, "{answer}");
    wait_for("A running and E done", Duration::from_secs(30), || async {
        let per = runs.per_id();
        (per.contains_key("A") && runs.done().contains(&"E".to_string())).then_some(())
    })
    .await?;
    // Through fleetctl: cancelled, then already; an unknown batch exits 1.
    let api = format!("http://{}", s.addr);
    let (code, out, err) =
        fleetctl(&ns, &api, &["batch", "cancel", "chain", "--reason", "dag"]).await?;
    assert_eq!(code, 0, "{err}");
    // A (running) and B, C, D (waiting) cancelled; E had succeeded.
    assert!(
        out.contains(
            "batch chain: cancelled (members: cancelled=4 already_ended=1 failed=0 total=5)"
        ),
        "{out}"
    );
    let (code, out, err) = fleetctl(&ns, &api, &["batch", "cancel", "chain"]).await?;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("batch chain: already cancelled"), "{out}");
    let (code, _, err) = fleetctl(&ns, &api, &["batch", "cancel", "nope"]).await?;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("unknown batch nope"), "{err}");
    // A's gate opens now: a run the cancel did not stop would succeed and release B and D.
    gate.open("A");
    let p = settled(&s, "chain", Duration::from_secs(30)).await?;
    for id in ["A", "B", "C", "D"] {
        ns.wait_state(id, "cancelled", Duration::from_secs(15))
            .await?;
    }
    quiet_for(
        Duration::from_secs(2),
        "a released member or a callback would run now",
    )
    .await;
    println!("DAG batch cancelled: {p}; runs {:?}", runs.per_id());
    assert_eq!(
        (p["succeeded"].as_u64(), p["cancelled"].as_u64()),
        (Some(1), Some(4)),
        "{p}"
    );
    assert_eq!(p["waiting"], json!([]));
    assert_eq!(p["failed"], json!(["A", "B", "C", "D"]));
    assert_eq!(p["fired"], json!([]));
    let per = runs.per_id();
    assert_eq!(per.get("A"), Some(&1));
    assert_eq!(per.get("E"), Some(&1));
    assert_eq!(per.len(), 2, "a waiting member ran: {per:?}");
    assert!(
        !runs.done().contains(&"A".to_string()),
        "A's run was not stopped"
    );
    assert_eq!(seen_of(&seen), Vec::<String>::new());
    w.stop().await?;
    s.stop().await?;
    ns.cleanup().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_cancel_holds_across_a_flushall_and_a_scheduler_restart() -> anyhow::Result<()> {
    const TOTAL: usize = 40;
    let redis = PrivateRedis::start(None, None).await?;
    let ns = Ns::on_redis(&redis.url(None)).await?;
    let (runs, gate) = (Runs::default(), Gate::default());
    let (seen, cb) = callbacks();
    let h = [(JOB, recording(&runs, &gate)), (CALLBACK, cb)];
    let s1 = start_scheduler(&ns, SCHEDULER).await?;
    let w1 = start_worker(&ns, "w-1", "", 2, WORKER, &h).await?;
    scheduler_ready(&s1).await?;
    let ids: Vec<String> = (0..TOTAL).map(|i| format!("q-{i}")).collect();
    let body = json!({
        "id": "held",
        "tasks": ids.iter().map(|id| json!({"id": id, "kind": JOB, "payload": {"gated": true}})).collect::<Vec<_>>(),
        "on_complete": {"kind": CALLBACK},
    });
    let (code, answer) = api_post(s1.url("/v1/batches"), &body).await?;
    assert_eq!(code, 202, "{answer}");
    wait_for("two members running", Duration::from_secs(30), || async {
        (runs.starts().len() == 2).then_some(())
    })
    .await?;
    // The worker stops hard: its two runs cut, every member back in (or still in) the queue.
    w1.force.cancel();
    w1.shutdown.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(30), w1.join).await;
    let (code, c) = api_post(s1.url("/v1/batches/held/cancel"), &json!({"reason": "r"})).await?;
    assert_eq!(code, 202, "{c}");
    assert_eq!(c["cancelled"], TOTAL, "{c}");
    // Redis loses every mark, and the scheduler that took the cancel goes away.
    redis.flushall().await?;
    s1.stop().await?;
    let s2 = start_scheduler(&ns, SCHEDULER).await?;
    scheduler_ready(&s2).await?;
    for id in &ids {
        gate.open(id);
    }
    let w2 = start_worker(&ns, "w-2", "", 2, WORKER, &h).await?;
    let p = settled(&s2, "held", Duration::from_secs(60)).await?;
    quiet_for(
        Duration::from_secs(2),
        "a member or a callback would run now",
    )
    .await;
    println!(
        "cancel across FLUSHALL and restart: {p}; starts {}",
        runs.starts().len()
    );
    assert_eq!(p["cancelled"], TOTAL, "{p}");
    assert_eq!(p["succeeded"], 0);
    assert_eq!(p["cancel"]["reason"], "r");
    assert_eq!(runs.starts().len(), 2, "a member started after the cancel");
    assert!(runs.done().is_empty(), "a member ran to its end");
    assert_eq!(seen_of(&seen), Vec::<String>::new());
    assert_eq!(batch_cancels(&s2).await?.len(), 1);
    w2.stop().await?;
    s2.stop().await?;
    ns.cleanup().await?;
    Ok(())
}

/// The pause of batch `batch` as `GET /v1/pauses` lists it.
async fn batch_pause(s: &SchedulerHandle, batch: &str) -> anyhow::Result<Option<Value>> {
    let (code, v) = api_get(s.url("/v1/pauses")).await?;
    anyhow::ensure!(code == 200, "GET /v1/pauses: {code} {v}");
    Ok(v["pauses"].as_array().and_then(|a| {
        a.iter()
            .find(|p| p["scope"] == "batch" && p["batch"] == batch)
            .cloned()
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_batch_holds_its_members_while_other_work_runs_and_runs_each_once_after_resume(
) -> anyhow::Result<()> {
    const HELD: usize = 200;
    const OTHERS: usize = 25;
    let ns = Ns::new().await?;
    let (runs, gate) = (Runs::default(), Gate::default());
    let (seen, cb) = callbacks();
    let h = [(JOB, recording(&runs, &gate)), (CALLBACK, cb)];
    let s = start_scheduler(&ns, SCHEDULER).await?;
    let w = start_worker(&ns, "w-1", "", 8, WORKER, &h).await?;
    scheduler_ready(&s).await?;

    let (code, p) = api_post(
        s.url("/v1/pauses"),
        &json!({"scope": "batch", "batch": "B", "reason": "hold"}),
    )
    .await?;
    assert_eq!(code, 202, "{p}");
    let (code, _) = api_post(
        s.url("/v1/pauses"),
        &json!({"scope": "batch", "batch": "B"}),
    )
    .await?;
    assert_eq!(code, 200, "paused already");
    let (code, e) = api_post(s.url("/v1/pauses"), &json!({"scope": "batch", "batch": ""})).await?;
    assert_eq!(code, 400, "{e}");

    // Batch B (paused, with a chain: `tail` waits for `b-0`), batch O and lone tasks.
    let mut b_tasks: Vec<Value> = (0..HELD)
        .map(|i| json!({"id": format!("b-{i}"), "kind": JOB}))
        .collect();
    b_tasks.push(json!({"id": "tail", "kind": JOB, "after": ["b-0"]}));
    let b_body = json!({
        "id": "B",
        "tasks": b_tasks,
        "on_success": {"kind": CALLBACK},
        "on_complete": {"kind": CALLBACK},
    });
    let (code, a) = api_post(s.url("/v1/batches"), &b_body).await?;
    assert_eq!(code, 202, "{a}");
    let o_body = json!({
        "id": "O",
        "tasks": (0..OTHERS).map(|i| json!({"id": format!("o-{i}"), "kind": JOB})).collect::<Vec<_>>(),
        "on_complete": {"kind": CALLBACK},
    });
    let (code, a) = api_post(s.url("/v1/batches"), &o_body).await?;
    assert_eq!(code, 202, "{a}");
    let lone: Vec<Value> = (0..OTHERS)
        .map(|i| json!({"id": format!("l-{i}"), "kind": JOB}))
        .collect();
    let (code, a) = api_post(s.url("/v1/tasks"), &json!(lone)).await?;
    assert_eq!(code, 202, "{a}");

    let is_b = |id: &str| id.starts_with("b-") || id == "tail";
    wait_for("the other work ran", Duration::from_secs(60), || async {
        let n = runs.done().iter().filter(|id| !is_b(id)).count();
        (n == 2 * OTHERS).then_some(())
    })
    .await?;
    wait_for("O's callback", Duration::from_secs(30), || async {
        seen_of(&seen)
            .contains(&"O:on_complete".to_string())
            .then_some(())
    })
    .await?;
    let held = wait_for("B's members held", Duration::from_secs(30), || async {
        let p = batch_pause(&s, "B").await.ok()??;
        (p["held"] == HELD).then_some(p)
    })
    .await?;
    assert_eq!(held["reason"], "hold");
    // B: nothing runs, nothing is released, no callback, for a while; its count stays exact.
    always_for(
        "B held",
        Duration::from_secs(3),
        Duration::from_millis(250),
        || async {
            let ran: Vec<String> = runs
                .starts()
                .into_iter()
                .map(|(id, _)| id)
                .filter(|id| is_b(id))
                .collect();
            anyhow::ensure!(ran.is_empty(), "B's members ran: {ran:?}");
            let p = batch_pause(&s, "B").await?.unwrap_or_default();
            anyhow::ensure!(p["held"] == HELD, "held {}", p["held"]);
            Ok(())
        },
    )
    .await?;
    let (_, prog) = api_get(s.url("/v1/batches/B")).await?;
    assert_eq!(prog["pending"], HELD + 1, "{prog}");
    assert_eq!(prog["waiting"], json!(["tail"]));
    assert_eq!(seen_of(&seen), vec!["O:on_complete".to_string()]);

    let (code, r) = api_post(
        s.url("/v1/pauses/resume"),
        &json!({"scope": "batch", "batch": "B"}),
    )
    .await?;
    assert_eq!(code, 202, "{r}");
    wait_for(
        "B ran and its callbacks fired",
        Duration::from_secs(60),
        || async { (seen_of(&seen).len() == 3).then_some(()) },
    )
    .await?;
    quiet_for(
        Duration::from_secs(2),
        "a second run or callback would come now",
    )
    .await;
    let per = runs.per_id();
    let b_runs: usize = per.iter().filter(|(id, _)| is_b(id)).map(|(_, n)| n).sum();
    println!(
        "paused batch: held {held}; after resume B ran {b_runs}; callbacks {:?}",
        seen_of(&seen)
    );
    assert!(per.values().all(|n| *n == 1), "a task ran twice: {per:?}");
    assert_eq!(per.len(), HELD + 1 + 2 * OTHERS);
    let mut cbs = seen_of(&seen);
    cbs.sort();
    assert_eq!(cbs, vec!["B:on_complete", "B:on_success", "O:on_complete"]);
    let (_, prog) = api_get(s.url("/v1/batches/B")).await?;
    assert_eq!(prog["succeeded"], HELD + 1, "{prog}");
    assert!(batch_pause(&s, "B").await?.is_none());
    // Each pause and resume is audited.
    let (_, audit) = api_get(s.url("/v1/audit?limit=1000")).await?;
    let of = |action: &str| {
        audit["entries"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter(|e| e["action"] == action && e["target"]["batch"] == "B")
                    .count()
            })
            .unwrap_or(0)
    };
    assert_eq!((of("pause"), of("resume")), (1, 1));
    w.stop().await?;
    s.stop().await?;
    ns.cleanup().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_batch_cancelled_counts_its_held_members_cancelled_and_its_resume_drops_them(
) -> anyhow::Result<()> {
    const N: usize = 10;
    let ns = Ns::new().await?;
    let (runs, gate) = (Runs::default(), Gate::default());
    let (seen, cb) = callbacks();
    let h = [(JOB, recording(&runs, &gate)), (CALLBACK, cb)];
    let s = start_scheduler(&ns, SCHEDULER).await?;
    let w = start_worker(&ns, "w-1", "", 4, WORKER, &h).await?;
    scheduler_ready(&s).await?;
    let api = format!("http://{}", s.addr);
    let (code, out, err) = fleetctl(&ns, &api, &["pause", "batch", "X", "--reason", "r"]).await?;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("batch X"), "{out}");
    let body = json!({
        "id": "X",
        "tasks": (0..N).map(|i| json!({"id": format!("x-{i}"), "kind": JOB})).collect::<Vec<_>>(),
        "on_complete": {"kind": CALLBACK},
    });
    let (code, a) = api_post(s.url("/v1/batches"), &body).await?;
    assert_eq!(code, 202, "{a}");
    wait_for("X held", Duration::from_secs(30), || async {
        let p = batch_pause(&s, "X").await.ok()??;
        (p["held"] == N).then_some(())
    })
    .await?;
    let (code, c) = api_post(s.url("/v1/batches/X/cancel"), &json!({})).await?;
    assert_eq!(code, 202, "{c}");
    assert_eq!(c["cancelled"], N, "{c}");
    let p = settled(&s, "X", Duration::from_secs(30)).await?;
    assert_eq!(p["cancelled"], N, "{p}");
    let (code, out, err) = fleetctl(&ns, &api, &["pauses"]).await?;
    assert_eq!(code, 0, "{err}");
    let row = out
        .lines()
        .find(|l| l.starts_with("batch"))
        .unwrap_or_default()
        .to_string();
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cols.get(..3), Some(&["batch", "X", "10"][..]), "{out}");
    // Still in its hold queue (the batch is paused), counted cancelled.
    let hold = ns.names.park_queue("_batch.X", fleet::Lane::Normal);
    assert_eq!(ns.depth_of(&hold).await, Some(N as u32));
    let (code, _, err) = fleetctl(&ns, &api, &["resume", "batch", "X"]).await?;
    assert_eq!(code, 0, "{err}");
    let depth = wait_for(
        "X's hold queue drained",
        Duration::from_secs(30),
        || async {
            let n = ns.depth_of(&hold).await?;
            (n == 0).then_some(n)
        },
    )
    .await?;
    ns.wait_settled(Duration::from_secs(30)).await?;
    quiet_for(Duration::from_secs(2), "a dropped member would run now").await;
    println!(
        "paused batch cancelled, then resumed: hold depth {depth}, runs {:?}",
        runs.per_id()
    );
    assert!(runs.starts().is_empty(), "a cancelled member ran");
    assert_eq!(seen_of(&seen), Vec::<String>::new());
    w.stop().await?;
    s.stop().await?;
    ns.cleanup().await?;
    Ok(())
}

const OPS: &str = "ops-admin-batch-control-0123456789";

/// The console's Batches view pauses, resumes and cancels a batch with its buttons (each
/// after its confirm dialog) in headless Chromium (`tests/ui/batch_control.test.mjs`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_console_pauses_resumes_and_cancels_a_batch_with_its_buttons() -> anyhow::Result<()> {
    let ui = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("ui");
    anyhow::ensure!(
        ui.join("node_modules/playwright-core").exists(),
        "playwright-core is not installed in {}: run `bash ops/services.sh --browser`",
        ui.display()
    );
    let ns = Ns::new().await?;
    let tokens = format!("ops:{OPS} admin");
    let mut settings: Vec<(&str, &str)> = SCHEDULER.to_vec();
    settings.push(("api_tokens", tokens.as_str()));
    let s = start_scheduler(&ns, &settings).await?;
    let (runs, gate) = (Runs::default(), Gate::default());
    let w = start_worker(&ns, "w-1", "", 1, WORKER, &[(JOB, recording(&runs, &gate))]).await?;
    scheduler_ready(&s).await?;
    let batch = format!("ui-{}", ns.name);
    let body = json!({
        "id": batch,
        "tasks": (0..3).map(|i| json!({"id": format!("{batch}-{i}"), "kind": JOB, "payload": {"gated": true}})).collect::<Vec<_>>(),
    });
    let r = reqwest::Client::new()
        .post(s.url("/v1/batches"))
        .bearer_auth(OPS)
        .json(&body)
        .send()
        .await?;
    anyhow::ensure!(r.status().as_u16() == 202, "submit: {}", r.status());
    wait_for("one member running", Duration::from_secs(30), || async {
        (runs.starts().len() == 1).then_some(())
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
            .arg(ui.join("batch_control.test.mjs"))
            .current_dir(&ui)
            .env("FLEET_UI_BASE", format!("http://{}", s.addr))
            .env("FLEET_ADMIN_TOKEN", OPS)
            .env("FLEET_BATCH", &batch)
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
    anyhow::ensure!(
        out.status.success(),
        "the browser script failed: {}",
        out.status
    );
    // The servers agree: every member ends cancelled, the running one stopped; one entry.
    for i in 0..3 {
        ns.wait_state(
            &format!("{batch}-{i}"),
            "cancelled",
            Duration::from_secs(20),
        )
        .await?;
    }
    assert_eq!(runs.starts().len(), 1, "a member started after the cancel");
    assert!(runs.done().is_empty());
    let r = reqwest::Client::new()
        .get(s.url("/v1/audit?action=batch_cancel"))
        .bearer_auth(OPS)
        .send()
        .await?;
    let v: Value = r.json().await?;
    assert_eq!(v["entries"].as_array().map(Vec::len), Some(1), "{v}");
    assert_eq!(v["entries"][0]["by"], "ops");
    w.stop().await?;
    s.stop().await?;
    ns.cleanup().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_pause_holds_across_a_flushall_and_a_restart_and_releases_no_dag_member(
) -> anyhow::Result<()> {
    const HELD: usize = 30;
    let redis = PrivateRedis::start(None, None).await?;
    let ns = Ns::on_redis(&redis.url(None)).await?;
    let (runs, gate) = (Runs::default(), Gate::default());
    let (seen, cb) = callbacks();
    let h = [(JOB, recording(&runs, &gate)), (CALLBACK, cb)];
    let s1 = start_scheduler(&ns, SCHEDULER).await?;
    let w = start_worker(&ns, "w-1", "", 4, WORKER, &h).await?;
    scheduler_ready(&s1).await?;
    // The parent runs (held by its gate) before the pause; its child waits for it.
    let mut tasks = vec![
        json!({"id": "p", "kind": JOB, "payload": {"gated": true}}),
        json!({"id": "c", "kind": JOB, "after": ["p"]}),
    ];
    tasks.extend((0..HELD).map(|i| json!({"id": format!("h-{i}"), "kind": JOB})));
    // The others (`h-*`) make batch D2, paused before it is submitted.
    let first = json!({"id": "D", "tasks": tasks[..2], "on_complete": {"kind": CALLBACK}});
    let (code, a) = api_post(s1.url("/v1/batches"), &first).await?;
    assert_eq!(code, 202, "{a}");
    wait_for("p running", Duration::from_secs(30), || async {
        runs.per_id().contains_key("p").then_some(())
    })
    .await?;
    let (code, p) = api_post(
        s1.url("/v1/pauses"),
        &json!({"scope": "batch", "batch": "D"}),
    )
    .await?;
    assert_eq!(code, 202, "{p}");
    gate.open("p");
    wait_for("p succeeded", Duration::from_secs(30), || async {
        let (_, b) = api_get(s1.url("/v1/batches/D")).await.ok()?;
        (b["succeeded"] == 1).then_some(())
    })
    .await?;
    // A batch paused before its submission (D2): its members wait in its hold.
    let second = json!({"id": "D2", "tasks": tasks[2..]});
    let (code, p) = api_post(
        s1.url("/v1/pauses"),
        &json!({"scope": "batch", "batch": "D2"}),
    )
    .await?;
    assert_eq!(code, 202, "{p}");
    let (code, a) = api_post(s1.url("/v1/batches"), &second).await?;
    assert_eq!(code, 202, "{a}");
    wait_for("D2 held", Duration::from_secs(30), || async {
        let p = batch_pause(&s1, "D2").await.ok()??;
        (p["held"] == HELD).then_some(())
    })
    .await?;
    // Redis loses everything and the scheduler restarts: both pauses still hold.
    redis.flushall().await?;
    s1.stop().await?;
    let s2 = start_scheduler(&ns, SCHEDULER).await?;
    scheduler_ready(&s2).await?;
    always_for(
        "D and D2 paused",
        Duration::from_secs(3),
        Duration::from_millis(250),
        || async {
            let per = runs.per_id();
            anyhow::ensure!(!per.contains_key("c"), "c was released while D was paused");
            let h = per.keys().filter(|id| id.starts_with("h-")).count();
            anyhow::ensure!(h == 0, "{h} of D2 ran while paused");
            let (_, b) = api_get(s2.url("/v1/batches/D")).await?;
            anyhow::ensure!(b["waiting"] == json!(["c"]), "D: {b}");
            anyhow::ensure!(b["fired"] == json!([]), "D fired while paused: {b}");
            Ok(())
        },
    )
    .await?;
    let p = batch_pause(&s2, "D2").await?.unwrap_or_default();
    assert_eq!(p["held"], HELD, "{p}");
    for b in ["D", "D2"] {
        let (code, r) = api_post(
            s2.url("/v1/pauses/resume"),
            &json!({"scope": "batch", "batch": b}),
        )
        .await?;
        assert_eq!(code, 202, "{r}");
    }
    wait_for("everything ran", Duration::from_secs(60), || async {
        let (_, d) = api_get(s2.url("/v1/batches/D")).await.ok()?;
        let (_, d2) = api_get(s2.url("/v1/batches/D2")).await.ok()?;
        (d["succeeded"] == 2 && d2["succeeded"] == HELD && d["fired"] == json!(["on_complete"]))
            .then_some(())
    })
    .await?;
    quiet_for(Duration::from_secs(2), "a second run would come now").await;
    let per = runs.per_id();
    println!(
        "batch pause across FLUSHALL and restart: runs {}",
        per.len()
    );
    assert_eq!(per.len(), HELD + 2);
    assert!(per.values().all(|n| *n == 1), "a task ran twice: {per:?}");
    assert_eq!(seen_of(&seen), vec!["D:on_complete".to_string()]);
    w.stop().await?;
    s2.stop().await?;
    ns.cleanup().await?;
    Ok(())
}

/// A replica that stops right after appending a batch's cancel record, before any member's
/// own cancel record (modelled by appending the batch's record alone): the workers refuse
/// the members from their memory of the stream — and each refused member's status says
/// `cancelled` (it said `queued` until a second cancel of the batch), it never runs, the
/// batch counts it cancelled and no callback fires.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn members_refused_for_their_batch_s_cancel_alone_are_marked_cancelled() -> anyhow::Result<()>
{
    use fleet::broker::amqp;
    const TOTAL: usize = 12;
    const BATCH: &str = "lone-record";
    let ns = Ns::new().await?;
    let (runs, gate) = (Runs::default(), Gate::default());
    let (seen, cb) = callbacks();
    let h = [(JOB, recording(&runs, &gate)), (CALLBACK, cb)];
    let s = start_scheduler(&ns, SCHEDULER).await?;
    let w = start_worker(&ns, "w-lone", "", 1, WORKER, &h).await?;
    scheduler_ready(&s).await?;
    let ids: Vec<String> = (0..TOTAL).map(|i| format!("m-{i}")).collect();
    let body = json!({
        "id": BATCH,
        "tasks": ids.iter().map(|id| json!({"id": id, "kind": JOB, "payload": {"gated": true}})).collect::<Vec<_>>(),
        "on_complete": {"kind": CALLBACK},
    });
    let (code, answer) = api_post(s.url("/v1/batches"), &body).await?;
    assert_eq!(code, 202, "{answer}");
    wait_for("one member running", Duration::from_secs(30), || async {
        (runs.starts().len() == 1).then_some(())
    })
    .await?;

    // The batch's record alone, confirmed.
    let conn = amqp::connect(&amqp_url(), "batch-control-lone-record").await?;
    let publisher = amqp::confirm_channel(&conn).await?;
    let rec = fleet::batch::cancel_record(
        BATCH,
        "replica stopped",
        &fleet::settings::Caller::anonymous(),
        TOTAL as u64,
        ns.store.clock.now_ms(),
    );
    fleet::control::append(&publisher, &ns.names, &rec).await?;
    let _ = conn.close(200, "done".into()).await;
    wait_for(
        "the scheduler folded the cancel",
        Duration::from_secs(15),
        || async {
            let (code, p) = api_get(s.url(&format!("/v1/batches/{BATCH}"))).await.ok()?;
            (code == 200 && p["cancel"].is_object()).then_some(())
        },
    )
    .await?;
    for id in &ids {
        gate.open(id);
    }
    let p = settled(&s, BATCH, Duration::from_secs(60)).await?;
    quiet_for(
        Duration::from_secs(1),
        "a member or a callback would run now",
    )
    .await;
    let per = runs.per_id();
    let mut refused = 0;
    for id in &ids {
        let st = ns.status(id).await?.unwrap_or_default();
        let state = st.get("state").map(String::as_str).unwrap_or("-");
        match per.get(id) {
            Some(1) => assert_eq!(state, "succeeded", "{id} ran once: {st:?}"),
            None => {
                assert_eq!(state, "cancelled", "{id} was refused: {st:?}");
                refused += 1;
            }
            Some(n) => panic!("{id} ran {n} times"),
        }
    }
    println!("a batch's record alone: {refused} of {TOTAL} refused and marked cancelled; {p}");
    assert!(refused >= 1, "no member was refused: {per:?}");
    assert_eq!(p["cancelled"], refused, "{p}");
    assert_eq!(seen_of(&seen), Vec::<String>::new(), "no callback fires");
    w.stop().await?;
    s.stop().await?;
    ns.cleanup().await
}
