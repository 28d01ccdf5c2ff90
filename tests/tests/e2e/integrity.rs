//! Task integrity at the door and in the reserve script (issue 10): a hostile envelope in the
//! middle of a batch, a reserve script that fails on one task mid-batch, the size limit counted
//! on the producer's bytes only, and `timeout_ms` counted from submission. Each asserts the
//! accepted set = succeeded ∪ dead-with-reason, nothing lost, nothing run twice.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use deadpool_redis::redis;
use fleet::{Envelope, Lane};
use fleet_tests::*;
use serde_json::{json, Value};

const KIND: &str = "rec";

fn goods(n: usize) -> Vec<Envelope> {
    (0..n).map(|i| task(KIND, json!({"i": i}), "")).collect()
}

/// Every id ran exactly once (by the recorder), and nothing else ran.
fn assert_ran_once(rec: &Recorder, ids: &[String]) {
    let per = rec.per_task();
    let twice: Vec<_> = per
        .iter()
        .filter(|(_, w)| w.len() > 1)
        .map(|(id, w)| (id.clone(), w.len()))
        .collect();
    assert!(twice.is_empty(), "tasks ran more than once: {twice:?}");
    let want: HashSet<&str> = ids.iter().map(String::as_str).collect();
    let got: HashSet<&str> = per.keys().map(String::as_str).collect();
    assert_eq!(got, want, "the set of tasks that ran");
}

async fn wait_runs(rec: &Recorder, n: usize, timeout: Duration) -> anyhow::Result<()> {
    wait_for(&format!("{n} distinct tasks run"), timeout, || async {
        (rec.per_task().len() >= n).then_some(())
    })
    .await
}

async fn wait_all_succeeded(ns: &Ns, ids: &[String], timeout: Duration) -> anyhow::Result<()> {
    wait_for(
        &format!("{} tasks succeeded", ids.len()),
        timeout,
        || async {
            for id in ids {
                let st = ns.status(id).await.ok()??;
                if st.get("state").map(String::as_str) != Some("succeeded") {
                    return None;
                }
            }
            Some(())
        },
    )
    .await
}

/// Waits for the first dead letters and takes them all.
async fn wait_dead(ns: &Ns) -> anyhow::Result<Vec<(Vec<u8>, Option<String>)>> {
    wait_for("a dead letter", Duration::from_secs(15), || async {
        let d = ns.drain_dead().await.ok()?;
        (!d.is_empty()).then_some(d)
    })
    .await
}

fn dead_id(body: &[u8]) -> String {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| v.get("id").and_then(Value::as_str).map(str::to_string))
        .unwrap_or_default()
}

/// Issue 10 §1: 60 good, one envelope with 10,000 label pairs, 60 good, published while no
/// scheduler runs. The hostile one is dead-lettered `over_limit` before any state is written;
/// the 120 good ones run exactly once; no reservation leaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hostile_envelope_mid_batch_loses_nothing() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    ns.declare_ingress(&[]).await?;
    let rec = Recorder::default();
    let w = start_worker(&ns, "w1", "", 8, &[], &[(KIND, rec.handler())]).await?;

    let good = goods(120);
    let ids: Vec<String> = good.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ns.submit(&good[..60]).await?, (60, 0));
    let hostile_id = format!("hostile-{}", ns.name);
    let labels: serde_json::Map<String, Value> =
        (0..10_000).map(|i| (format!("k{i}"), json!("v"))).collect();
    ns.submit_raw(
        Lane::Normal,
        &serde_json::to_vec(&json!({"id": hostile_id, "kind": KIND, "labels": labels}))?,
    )
    .await?;
    assert_eq!(ns.submit(&good[60..]).await?, (60, 0));

    let sched = start_scheduler(&ns, &[]).await?;
    wait_runs(&rec, 120, Duration::from_secs(60)).await?;
    wait_all_succeeded(&ns, &ids, Duration::from_secs(30)).await?;
    ns.wait_groups_idle(Duration::from_secs(15)).await?;
    assert_ran_once(&rec, &ids);
    assert_eq!(rec.count(), 120, "120 runs in all");

    let dead = wait_dead(&ns).await?;
    assert_eq!(dead.len(), 1, "exactly one dead letter");
    assert_eq!(dead_id(&dead[0].0), hostile_id);
    assert_eq!(dead[0].1.as_deref(), Some("over_limit"));
    assert_eq!(
        ns.status(&hostile_id).await?,
        None,
        "no state written for a task refused at the door"
    );
    println!("hostile: 120 of 120 good ran once, 1 dead over_limit, 0 lost, reserved 0");

    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// Issue 10 "script error": the reserve script fails on one task in the middle of a batch (its
/// status record, which holds its dedupe mark, is pre-created as a Redis string, so `HMGET`
/// raises WRONGTYPE). That task alone is
/// dead-lettered `internal_error`; the others run exactly once; nothing leaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reserve_script_error_mid_batch_loses_nothing() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    ns.declare_ingress(&[]).await?;
    let rec = Recorder::default();
    let w = start_worker(&ns, "w1", "", 8, &[], &[(KIND, rec.handler())]).await?;

    let all = goods(101);
    let bad = all[50].id.clone();
    ns.store
        .query::<()>(redis::cmd("SET").arg(ns.names.task(&bad)).arg("x"))
        .await?;
    let ids: Vec<String> = all
        .iter()
        .map(|e| e.id.clone())
        .filter(|id| *id != bad)
        .collect();
    assert_eq!(ns.submit(&all).await?, (101, 0));

    let sched = start_scheduler(&ns, &[]).await?;
    wait_runs(&rec, 100, Duration::from_secs(60)).await?;
    wait_all_succeeded(&ns, &ids, Duration::from_secs(30)).await?;
    let dead = wait_dead(&ns).await?;
    ns.wait_groups_idle(Duration::from_secs(15)).await?;
    assert_ran_once(&rec, &ids);
    assert_eq!(rec.count(), 100);
    assert_eq!(dead.len(), 1, "exactly one dead letter");
    assert_eq!(dead_id(&dead[0].0), bad);
    assert_eq!(dead[0].1.as_deref(), Some("internal_error"));
    // Every run is in the task index (the task list): those whose status the failed call
    // wrote before its error were indexed again by the retry (the first call's deferred
    // index writes went with the error).
    let mut unindexed = Vec::new();
    for id in &ids {
        let score: Option<f64> = ns
            .store
            .query(redis::cmd("ZSCORE").arg(ns.names.task_index()).arg(id))
            .await?;
        if score.is_none() {
            unindexed.push(id.clone());
        }
    }
    assert_eq!(
        unindexed,
        Vec::<String>::new(),
        "runs missing from the task index"
    );
    println!("script error: 100 of 100 ran once, 1 dead internal_error, 0 lost, 100 indexed");

    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// An envelope of exactly `size` bytes (padding its payload).
fn sized(size: usize) -> Vec<u8> {
    let mut e = task(KIND, json!({"pad": ""}), "");
    let base = e.to_bytes().len();
    e.payload = json!({"pad": "x".repeat(size - base)});
    let b = e.to_bytes();
    assert_eq!(b.len(), size);
    b
}

/// Issue 10 §7: with `FLEET_MAX_TASK_BYTES=4096`, a 4,096-byte envelope over AMQP and a
/// 4,050-byte one over HTTP both run once and succeed (what fleet adds never counts), while a
/// 4,097-byte one is refused at the door (dead `oversized` / 400).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn size_limit_counts_the_producers_bytes_only() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let limit = [("max_task_bytes", "4096")];
    let rec = Recorder::default();
    let w = start_worker(&ns, "w1", "", 4, &limit, &[(KIND, rec.handler())]).await?;
    let sched = start_scheduler(&ns, &limit).await?;

    let amqp_body = sized(4096);
    let amqp_id = dead_id(&amqp_body);
    ns.submit_raw(Lane::Normal, &amqp_body).await?;
    let http_body = sized(4050);
    let http_id = dead_id(&http_body);
    let client = reqwest::Client::new();
    let r = client
        .post(sched.url("/v1/tasks"))
        .header("content-type", "application/json")
        .body(http_body)
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 202, "{:?}", r.text().await);
    let over = sized(4097);
    let r = client
        .post(sched.url("/v1/tasks"))
        .header("content-type", "application/json")
        .body(over.clone())
        .send()
        .await?;
    assert_eq!(
        r.status().as_u16(),
        400,
        "one byte over is refused over HTTP"
    );
    // The same 4,097 bytes over AMQP: dead-lettered `oversized`, byte for byte, never run.
    let over_id = dead_id(&over);
    ns.submit_raw(Lane::Normal, &over).await?;

    let ids = vec![amqp_id.clone(), http_id.clone()];
    wait_all_succeeded(&ns, &ids, Duration::from_secs(30)).await?;
    assert_ran_once(&rec, &ids);
    let dead = wait_for(
        "the 4,097-byte AMQP envelope dead-lettered",
        Duration::from_secs(30),
        || async {
            let d = ns.drain_dead().await.ok()?;
            (!d.is_empty()).then_some(d)
        },
    )
    .await?;
    assert_eq!(dead.len(), 1, "only the oversized one is dead-lettered");
    assert_eq!(dead[0].1.as_deref(), Some("oversized"));
    assert_eq!(dead[0].0, over, "the dead letter is the producer's bytes");
    assert!(
        !rec.per_task().contains_key(&over_id),
        "the oversized task never ran"
    );
    println!("size: 4096-byte (AMQP) and 4050-byte (HTTP) envelopes succeeded, 1 run each; 4097 bytes refused 400 (HTTP) and dead oversized (AMQP)");

    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// Issue 10 §8: a task with `timeout_ms: 1500` published while no scheduler runs, the
/// scheduler started 2.5 s later: it never runs and ends `expired`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn timeout_runs_from_submission() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    ns.declare_ingress(&[]).await?;
    let rec = Recorder::default();
    let w = start_worker(&ns, "w1", "", 4, &[], &[(KIND, rec.handler())]).await?;
    let mut late = task(KIND, json!({}), "");
    late.timeout_ms = Some(1500);
    let mut control = task(KIND, json!({}), "");
    control.timeout_ms = Some(60_000);
    // The producer stamps its submission time (the documented source of a deadline).
    let now = chrono::Utc::now();
    late.submitted_at = Some(now);
    control.submitted_at = Some(now);
    let published = Instant::now();
    assert_eq!(ns.submit(&[late.clone(), control.clone()]).await?, (2, 0));
    scenario_pause(
        Duration::from_millis(2500).saturating_sub(published.elapsed()),
        "the late task's 1.5 s deadline well past before a scheduler reads it",
    )
    .await;
    let sched = start_scheduler(&ns, &[]).await?;

    let st = ns
        .wait_state(&late.id, "expired", Duration::from_secs(30))
        .await?;
    assert_eq!(
        st.get("reason").map(String::as_str),
        Some("expired"),
        "{st:?}"
    );
    ns.wait_state(&control.id, "succeeded", Duration::from_secs(30))
        .await?;
    assert_ran_once(&rec, std::slice::from_ref(&control.id));
    println!(
        "timeout from submission: 1500 ms task started {} ms after publication: expired, 0 runs",
        published.elapsed().as_millis()
    );

    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
