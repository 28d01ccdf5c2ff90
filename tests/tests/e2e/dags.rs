//! Chains and DAGs inside a batch (issue 36, [`fleet::batch::dag`]): `after` runs a task only
//! when every task it names succeeded — a diamond's join runs once after both branches, a
//! chain of 100 runs in order — a cycle is refused at submission with nothing recorded, a
//! failing parent ends its descendants `dead` / `dependency_failed` (and `on_complete` counts
//! them once), and `payload_from` hands a parent's result to its child.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fleet_tests::*;
use fleet_worker::executor::{handler_fn, Handler, TaskError};
use serde_json::{json, Value};

/// Kind of a step: records its run, sleeps `payload.ms`, succeeds with `{"id", "out"}`
/// where `out` is `payload.n + 1` (or 1), or `payload.parent_result.out + 1` when given.
const STEP: &str = "step";
/// Kind of a member that fails for good (dead at its first attempt).
const BOOM: &str = "boom";
/// Kind of the callbacks.
const CALLBACK: &str = "callback";

/// One run of a step: task id, start, end, payload.
#[derive(Debug, Clone)]
struct Run {
    id: String,
    start: Instant,
    end: Instant,
    payload: Value,
}

type Runs = Arc<Mutex<Vec<Run>>>;

fn steps() -> (Runs, Arc<dyn Handler>) {
    let runs: Runs = Arc::default();
    let r = runs.clone();
    let h = handler_fn(move |ctx| {
        let r = r.clone();
        async move {
            let start = Instant::now();
            let p = ctx.envelope.payload.clone();
            let ms = p["ms"].as_u64().unwrap_or(0);
            if ms > 0 {
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            let base = p["parent_result"]["out"]
                .as_u64()
                .or(p["n"].as_u64())
                .unwrap_or(0);
            if let Ok(mut v) = r.lock() {
                v.push(Run {
                    id: ctx.envelope.id.clone(),
                    start,
                    end: Instant::now(),
                    payload: p,
                });
            }
            Ok(json!({"id": ctx.envelope.id, "out": base + 1}))
        }
    });
    (runs, h)
}

fn runs_of(runs: &Runs) -> Vec<Run> {
    runs.lock().map(|v| v.clone()).unwrap_or_default()
}

/// The one run of `id` (fails when it ran other than once).
fn once(runs: &[Run], id: &str) -> anyhow::Result<Run> {
    let of: Vec<&Run> = runs.iter().filter(|r| r.id == id).collect();
    anyhow::ensure!(of.len() == 1, "{id} ran {} times", of.len());
    Ok(of[0].clone())
}

fn boom() -> Arc<dyn Handler> {
    handler_fn(|_ctx| async move { Err::<Value, _>(TaskError::permanent("boom")) })
}

type Seen = Arc<Mutex<Vec<(String, Value)>>>;

fn callbacks() -> (Seen, Arc<dyn Handler>) {
    let seen: Seen = Arc::default();
    let s = seen.clone();
    let h = handler_fn(move |ctx| {
        let s = s.clone();
        async move {
            if let Ok(mut v) = s.lock() {
                v.push((ctx.envelope.id.clone(), ctx.envelope.payload.clone()));
            }
            Ok(json!({}))
        }
    });
    (seen, h)
}

/// Waits until batch `id` is complete on `s`; its progress.
async fn complete(s: &SchedulerHandle, id: &str, within: Duration) -> anyhow::Result<Value> {
    wait_for(&format!("batch {id} complete"), within, || async {
        let (code, p) = api_get(s.url(&format!("/v1/batches/{id}"))).await.ok()?;
        (code == 200 && p["complete"] == true).then_some(p)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_diamond_runs_its_join_once_after_both_branches_across_two_replicas_and_fleetctl_shows_the_waiting(
) -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let (runs, h) = steps();
    let h = [(STEP, h)];
    let s1 = start_scheduler(&ns, SCHEDULER).await?;
    let s2 = start_scheduler(&ns, SCHEDULER).await?;
    let w = start_worker(&ns, "w-1", "", 8, WORKER, &h).await?;
    scheduler_ready(&s1).await?;
    scheduler_ready(&s2).await?;
    // B is slower than C: D must wait for the slower branch, not the first one to end.
    let body = json!({
        "id": "diamond",
        "tasks": [
            {"id": "D", "kind": STEP, "after": ["B", "C"]},
            {"id": "A", "kind": STEP, "payload": {"ms": 1500}},
            {"id": "B", "kind": STEP, "after": ["A"], "payload": {"ms": 400}},
            {"id": "C", "kind": STEP, "after": ["A"], "payload": {"ms": 50}},
        ],
    });
    let (code, answer) = api_post(s1.url("/v1/batches"), &body).await?;
    assert_eq!(code, 202, "{answer}");
    assert_eq!(answer["waiting"], json!(["D", "B", "C"]));

    // While A runs, D waits: its own status and the batch (through the other replica) say so.
    let (code, d) = api_get(s1.url("/v1/tasks/D")).await?;
    assert_eq!(code, 200, "{d}");
    assert_eq!(d["state"], "waiting", "{d}");
    assert_eq!(d["after"], json!(["B", "C"]));
    let p = wait_for(
        "the other replica read the batch",
        Duration::from_secs(5),
        || async {
            let (code, p) = api_get(s2.url("/v1/batches/diamond")).await.ok()?;
            (code == 200).then_some(p)
        },
    )
    .await?;
    assert_eq!(p["waiting"], json!(["D", "B", "C"]), "{p}");
    let (code, list) = api_get(s1.url("/v1/tasks?state=waiting")).await?;
    assert_eq!(code, 200, "{list}");
    let mut listed: Vec<&str> = list["tasks"]
        .as_array()
        .map(|a| a.iter().filter_map(|t| t["id"].as_str()).collect())
        .unwrap_or_default();
    listed.sort();
    assert_eq!(listed, vec!["B", "C", "D"], "{list}");
    let (code, out, err) = fleetctl(
        &ns,
        &format!("http://{}", s1.addr),
        &["batch", "status", "diamond"],
    )
    .await?;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("pending=4"), "{out}");
    assert!(out.contains("waiting: D B C"), "{out}");

    let p = complete(&s1, "diamond", Duration::from_secs(30)).await?;
    assert_eq!(p["succeeded"], 4, "{p}");
    quiet_for(Duration::from_secs(2), "a second run of D would come now").await;
    let all = runs_of(&runs);
    assert_eq!(all.len(), 4, "{all:?}");
    let (a, b, c, d) = (
        once(&all, "A")?,
        once(&all, "B")?,
        once(&all, "C")?,
        once(&all, "D")?,
    );
    assert!(b.start >= a.end && c.start >= a.end, "B and C after A");
    assert!(d.start >= b.end, "D started before B ended");
    assert!(d.start >= c.end, "D started before C ended");
    let (_, d) = api_get(s2.url("/v1/tasks/D")).await?;
    assert_eq!(d["state"], "succeeded", "{d}");

    w.stop().await?;
    s1.stop().await?;
    s2.stop().await?;
    ns.cleanup().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cycle_is_refused_at_submission_and_nothing_of_it_exists() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let (runs, h) = steps();
    let h = [(STEP, h)];
    let s = start_scheduler(&ns, SCHEDULER).await?;
    let w = start_worker(&ns, "w-1", "", 4, WORKER, &h).await?;
    scheduler_ready(&s).await?;
    let body = json!({
        "id": "loop",
        "tasks": [
            {"id": "X", "kind": STEP},
            {"id": "A", "kind": STEP, "after": ["C"]},
            {"id": "B", "kind": STEP, "after": ["A"]},
            {"id": "C", "kind": STEP, "after": ["B"]},
        ],
        "on_complete": {"kind": STEP},
    });
    let (code, e) = api_post(s.url("/v1/batches"), &body).await?;
    assert_eq!(code, 400, "{e}");
    assert_eq!(e["error"], "cycle", "{e}");
    let detail = e["detail"].as_str().unwrap_or_default();
    for id in ["A", "B", "C"] {
        assert!(detail.contains(id), "{detail}");
    }
    assert!(!detail.contains('X'), "{detail}");
    let cycle: Vec<&str> = e["cycle"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    assert_eq!(cycle.len(), 4, "{e}");
    assert_eq!(cycle.first(), cycle.last());
    let mut around = cycle[..3].to_vec();
    around.sort();
    assert_eq!(around, vec!["A", "B", "C"]);

    // An unknown id and a self-reference are refused too.
    let (code, e) = api_post(
        s.url("/v1/batches"),
        &json!({"tasks": [{"id": "P", "kind": STEP, "after": ["nope"]}]}),
    )
    .await?;
    assert_eq!(
        (code, e["error"].as_str()),
        (400, Some("unknown_dependency"))
    );
    let (code, e) = api_post(
        s.url("/v1/batches"),
        &json!({"tasks": [{"id": "P", "kind": STEP, "after": ["P"]}]}),
    )
    .await?;
    assert_eq!((code, e["error"].as_str()), (400, Some("self_dependency")));

    // Nothing of the refused batch ran or exists: not the batch, not a task, not a run.
    quiet_for(
        Duration::from_secs(2),
        "a member of the refused batch would run now",
    )
    .await;
    assert!(runs_of(&runs).is_empty());
    let (code, _) = api_get(s.url("/v1/batches/loop")).await?;
    assert_eq!(code, 404);
    for id in ["X", "A", "B", "C", "P"] {
        let (code, t) = api_get(s.url(&format!("/v1/tasks/{id}"))).await?;
        assert_eq!(code, 404, "{id}: {t}");
    }

    w.stop().await?;
    s.stop().await?;
    ns.cleanup().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_chain_of_100_runs_in_order_each_once() -> anyhow::Result<()> {
    const N: usize = 100;
    let ns = Ns::new().await?;
    let (runs, h) = steps();
    let h = [(STEP, h)];
    let s = start_scheduler(&ns, SCHEDULER).await?;
    let w = start_worker(&ns, "w-1", "", 8, WORKER, &h).await?;
    scheduler_ready(&s).await?;
    // Submitted last link first: the order comes from `after`, not from the array.
    let tasks: Vec<Value> = (1..=N)
        .rev()
        .map(|i| {
            let mut t = json!({"id": format!("t{i}"), "kind": STEP});
            if i > 1 {
                t["after"] = json!([format!("t{}", i - 1)]);
            }
            t
        })
        .collect();
    let started = Instant::now();
    let (code, answer) = api_post(
        s.url("/v1/batches"),
        &json!({"id": "chain", "tasks": tasks}),
    )
    .await?;
    assert_eq!(code, 202, "{answer}");
    assert_eq!(answer["waiting"].as_array().map(Vec::len), Some(N - 1));
    let p = complete(&s, "chain", Duration::from_secs(180)).await?;
    println!("chain of {N} done in {:?}", started.elapsed());
    assert_eq!(p["succeeded"], N, "{p}");
    quiet_for(Duration::from_secs(1), "a repeated link would run now").await;
    let all = runs_of(&runs);
    assert_eq!(all.len(), N);
    let mut prev: Option<Run> = None;
    for i in 1..=N {
        let r = once(&all, &format!("t{i}"))?;
        if let Some(p) = &prev {
            assert!(r.start >= p.end, "t{i} started before t{} ended", i - 1);
        }
        prev = Some(r);
    }
    // The run order is the chain's order.
    let order: Vec<String> = all.iter().map(|r| r.id.clone()).collect();
    let want: Vec<String> = (1..=N).map(|i| format!("t{i}")).collect();
    assert_eq!(order, want);

    w.stop().await?;
    s.stop().await?;
    ns.cleanup().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failing_parent_ends_its_descendants_dependency_failed_and_on_complete_counts_once(
) -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let (runs, h) = steps();
    let (seen, cb) = callbacks();
    let h = [(STEP, h), (BOOM, boom()), (CALLBACK, cb)];
    let s = start_scheduler(&ns, SCHEDULER).await?;
    let w = start_worker(&ns, "w-1", "", 4, WORKER, &h).await?;
    scheduler_ready(&s).await?;
    // P fails for good: its child C and grandchild G never run; S (no link) and T (after S)
    // succeed.
    let body = json!({
        "id": "fails",
        "tasks": [
            {"id": "P", "kind": BOOM, "max_attempts": 1},
            {"id": "C", "kind": STEP, "after": ["P"]},
            {"id": "G", "kind": STEP, "after": ["C"]},
            {"id": "S", "kind": STEP},
            {"id": "T", "kind": STEP, "after": ["S"]},
        ],
        "on_success": {"kind": CALLBACK, "payload": {"which": "success"}},
        "on_complete": {"kind": CALLBACK, "payload": {"which": "complete"}},
    });
    let (code, answer) = api_post(s.url("/v1/batches"), &body).await?;
    assert_eq!(code, 202, "{answer}");
    let fired = wait_for("on_complete fired", Duration::from_secs(30), || async {
        let v = seen.lock().map(|v| v.clone()).unwrap_or_default();
        (!v.is_empty()).then_some(v)
    })
    .await?;
    quiet_for(Duration::from_secs(2), "a second callback would arrive now").await;
    let all_cb = seen.lock().map(|v| v.clone()).unwrap_or_default();
    assert_eq!(all_cb.len(), 1, "{all_cb:?}");
    let (id, payload) = &fired[0];
    assert_eq!(id, "fails:on_complete");
    let b = &payload["batch"];
    assert_eq!(b["total"], 5, "{b}");
    assert_eq!(b["succeeded"], 2, "{b}");
    assert_eq!(b["dead"], 3, "{b}");
    assert_eq!(b["failed"], json!(["P", "C", "G"]), "{b}");

    let ran: HashMap<String, usize> = runs_of(&runs).iter().fold(HashMap::new(), |mut m, r| {
        *m.entry(r.id.clone()).or_default() += 1;
        m
    });
    assert_eq!(ran, HashMap::from([("S".into(), 1), ("T".into(), 1)]));
    for id in ["C", "G"] {
        let (code, t) = api_get(s.url(&format!("/v1/tasks/{id}"))).await?;
        assert_eq!(code, 200, "{t}");
        assert_eq!(t["state"], "dead", "{t}");
        assert_eq!(t["reason"], "dependency_failed", "{t}");
    }
    let (_, c) = api_get(s.url("/v1/tasks/C")).await?;
    assert!(
        c["error"].as_str().unwrap_or_default().contains("`P`"),
        "{c}"
    );
    let (_, p) = api_get(s.url("/v1/tasks/P")).await?;
    assert_eq!(p["reason"], "permanent_error", "{p}");

    w.stop().await?;
    s.stop().await?;
    ns.cleanup().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn payload_from_passes_the_parents_result_into_the_childs_payload() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let (runs, h) = steps();
    let h = [(STEP, h)];
    let s = start_scheduler(&ns, SCHEDULER).await?;
    let w = start_worker(&ns, "w-1", "", 4, WORKER, &h).await?;
    scheduler_ready(&s).await?;
    // A → B → C, each handing its result on: out = 41 + 1, then 42 + 1, then 43 + 1. D waits
    // for A without taking its result.
    let body = json!({
        "id": "pipe",
        "tasks": [
            {"id": "A", "kind": STEP, "payload": {"n": 41}},
            {"id": "B", "kind": STEP, "after": ["A"], "payload_from": "A", "payload": {"tag": "b"}},
            {"id": "C", "kind": STEP, "after": ["B"], "payload_from": "B"},
            {"id": "D", "kind": STEP, "after": ["A"], "payload": {"tag": "d"}},
        ],
    });
    let (code, answer) = api_post(s.url("/v1/batches"), &body).await?;
    assert_eq!(code, 202, "{answer}");
    complete(&s, "pipe", Duration::from_secs(30)).await?;
    let all = runs_of(&runs);
    assert_eq!(all.len(), 4);
    let b = once(&all, "B")?;
    assert_eq!(
        b.payload,
        json!({"tag": "b", "parent_result": {"id": "A", "out": 42}})
    );
    let c = once(&all, "C")?;
    assert_eq!(c.payload, json!({"parent_result": {"id": "B", "out": 43}}));
    let d = once(&all, "D")?;
    assert_eq!(d.payload, json!({"tag": "d"}));
    let (_, t) = api_get(s.url("/v1/tasks/C")).await?;
    assert_eq!(t["result"], json!({"id": "C", "out": 44}), "{t}");

    w.stop().await?;
    s.stop().await?;
    ns.cleanup().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_parents_result_and_a_waiting_member_survive_a_redis_flushall_and_a_cancel_fails_its_dependents(
) -> anyhow::Result<()> {
    let redis = PrivateRedis::start(None, None).await?;
    let ns = Ns::on_redis(&redis.url(None)).await?;
    let (runs, h) = steps();
    let h = [(STEP, h)];
    let s = start_scheduler(&ns, SCHEDULER).await?;
    let w = start_worker(&ns, "w-1", "", 4, WORKER, &h).await?;
    scheduler_ready(&s).await?;
    // A ends at once; W runs 2 s. J waits for both and takes A's result, which must come from
    // A's end record: Redis is flushed after A ended, before J is released. X waits for W and
    // is cancelled while it waits: it never runs, and Y (after X) ends dependency_failed.
    let body = json!({
        "id": "flush",
        "tasks": [
            {"id": "A", "kind": STEP, "payload": {"n": 6}},
            {"id": "W", "kind": STEP, "payload": {"ms": 2000}},
            {"id": "J", "kind": STEP, "after": ["A", "W"], "payload_from": "A"},
            {"id": "X", "kind": STEP, "after": ["W"]},
            {"id": "Y", "kind": STEP, "after": ["X"]},
        ],
    });
    let (code, answer) = api_post(s.url("/v1/batches"), &body).await?;
    assert_eq!(code, 202, "{answer}");
    wait_for("A ran", Duration::from_secs(10), || async {
        runs_of(&runs).iter().any(|r| r.id == "A").then_some(())
    })
    .await?;
    let r = reqwest::Client::new()
        .post(s.url("/v1/tasks/X/cancel"))
        .json(&json!({"reason": "not needed"}))
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 202, "{}", r.text().await?);
    // The cancel ends X in the fold at once, and Y with it (its status written).
    let y = wait_for("Y dependency_failed", Duration::from_secs(10), || async {
        let (_, y) = api_get(s.url("/v1/tasks/Y")).await.ok()?;
        (y["state"] == "dead").then_some(y)
    })
    .await?;
    assert_eq!(y["reason"], "dependency_failed", "{y}");
    assert!(
        y["error"]
            .as_str()
            .unwrap_or_default()
            .contains("`X` ended cancelled"),
        "{y}"
    );
    // A's end record is in the stream (appended before its outcome and ack): Redis may go.
    redis.flushall().await?;

    let p = complete(&s, "flush", Duration::from_secs(60)).await?;
    assert_eq!(p["succeeded"], 3, "{p}");
    assert_eq!(p["cancelled"], 1, "{p}");
    assert_eq!(p["dead"], 1, "{p}");
    assert_eq!(p["failed"], json!(["X", "Y"]), "{p}");
    let all = runs_of(&runs);
    let j = once(&all, "J")?;
    assert_eq!(j.payload, json!({"parent_result": {"id": "A", "out": 7}}));
    assert!(j.start >= once(&all, "W")?.end, "J before W ended");
    assert!(all.iter().all(|r| r.id != "X" && r.id != "Y"), "{all:?}");
    assert_eq!(all.len(), 3, "{all:?}");

    w.stop().await?;
    s.stop().await?;
    ns.cleanup().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fan_out_of_200_and_its_fan_in_run_once_each() -> anyhow::Result<()> {
    const N: usize = 200;
    let ns = Ns::new().await?;
    let (runs, h) = steps();
    let h = [(STEP, h)];
    let s = start_scheduler(&ns, SCHEDULER).await?;
    let w = start_worker(&ns, "w-1", "", 16, WORKER, &h).await?;
    scheduler_ready(&s).await?;
    let mut tasks = vec![json!({"id": "root", "kind": STEP})];
    let kids: Vec<String> = (0..N).map(|i| format!("k{i}")).collect();
    tasks.extend(
        kids.iter()
            .map(|k| json!({"id": k, "kind": STEP, "after": ["root"]})),
    );
    tasks.push(json!({"id": "join", "kind": STEP, "after": kids}));
    let (code, answer) =
        api_post(s.url("/v1/batches"), &json!({"id": "fan", "tasks": tasks})).await?;
    assert_eq!(code, 202, "{answer}");
    let p = complete(&s, "fan", Duration::from_secs(60)).await?;
    assert_eq!(p["succeeded"], N + 2, "{p}");
    quiet_for(Duration::from_secs(1), "a repeated run would come now").await;
    let all = runs_of(&runs);
    assert_eq!(all.len(), N + 2);
    let root = once(&all, "root")?;
    let join = once(&all, "join")?;
    for k in &kids {
        let r = once(&all, k)?;
        assert!(r.start >= root.end, "{k} before root ended");
        assert!(join.start >= r.end, "join before {k} ended");
    }
    w.stop().await?;
    s.stop().await?;
    ns.cleanup().await?;
    Ok(())
}

/// The README's JSON examples ("Chains and DAGs"), as written, with `echo` (returns its
/// payload) and `sleep` handlers like the built-in ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_readme_json_examples_answer_as_documented() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let (runs, _) = steps();
    let r = runs.clone();
    let echo = handler_fn(move |ctx| {
        let r = r.clone();
        async move {
            let now = Instant::now();
            if let Ok(mut v) = r.lock() {
                v.push(Run {
                    id: ctx.envelope.id.clone(),
                    start: now,
                    end: now,
                    payload: ctx.envelope.payload.clone(),
                });
            }
            Ok(ctx.envelope.payload.clone())
        }
    });
    let sleep = handler_fn(|ctx| async move {
        let ms = ctx.envelope.payload["ms"].as_u64().unwrap_or(0);
        tokio::time::sleep(Duration::from_millis(ms)).await;
        Ok(Value::Null)
    });
    let h = [("echo", echo), ("sleep", sleep)];
    let s = start_scheduler(&ns, SCHEDULER).await?;
    let w = start_worker(&ns, "w-1", "", 8, WORKER, &h).await?;
    scheduler_ready(&s).await?;
    let body = json!({"id": "etl-7",
     "tasks": [
       {"id": "extract", "kind": "echo", "payload": {"rows": 3}},
       {"id": "clean",   "kind": "echo", "after": ["extract"], "payload_from": "extract"},
       {"id": "stats",   "kind": "sleep", "payload": {"ms": 200}, "after": ["extract"]},
       {"id": "load",    "kind": "echo", "after": ["clean", "stats"], "payload_from": "clean"}],
     "on_complete": {"kind": "echo"}});
    let (code, answer) = api_post(s.url("/v1/batches"), &body).await?;
    assert_eq!(code, 202, "{answer}");
    assert_eq!(
        answer,
        json!({"batch": "etl-7", "ids": ["extract", "clean", "stats", "load"],
               "waiting": ["clean", "stats", "load"]})
    );
    let (_, load) = api_get(s.url("/v1/tasks/load")).await?;
    assert_eq!(load["state"], "waiting", "{load}");
    assert_eq!(load["after"], json!(["clean", "stats"]));
    wait_for("on_complete ran", Duration::from_secs(30), || async {
        runs_of(&runs)
            .iter()
            .any(|r| r.id == "etl-7:on_complete")
            .then_some(())
    })
    .await?;
    let all = runs_of(&runs);
    assert_eq!(
        once(&all, "clean")?.payload,
        json!({"parent_result": {"rows": 3}})
    );
    assert_eq!(
        once(&all, "load")?.payload,
        json!({"parent_result": {"parent_result": {"rows": 3}}})
    );
    assert_eq!(
        once(&all, "etl-7:on_complete")?.payload["batch"]["succeeded"],
        4
    );

    let cycle = json!({"tasks": [{"id": "a", "kind": "echo", "after": ["c"]}, {"id": "b", "kind": "echo", "after": ["a"]},
               {"id": "c", "kind": "echo", "after": ["b"]}]});
    let (code, e) = api_post(s.url("/v1/batches"), &cycle).await?;
    assert_eq!(code, 400);
    assert_eq!(
        e,
        json!({"error": "cycle", "cycle": ["a", "b", "c", "a"], "index": 0,
               "detail": "the `after` links make a cycle: a → b → c → a (each would have to run before the next)"})
    );
    w.stop().await?;
    s.stop().await?;
    ns.cleanup().await?;
    Ok(())
}
