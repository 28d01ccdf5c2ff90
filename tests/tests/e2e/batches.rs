//! Batches (issue 36, [`fleet::batch`]): a batch's callbacks fire exactly once with the
//! batch's figures — across two scheduler replicas, a worker killed and a Redis FLUSHALL in
//! the middle — and
//! `on_success` never fires when a member failed.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use fleet_tests::*;
use fleet_worker::executor::{handler_fn, Handler, TaskError};
use serde_json::{json, Value};

/// Kind of a member that fails for good (dead at its first attempt).
const BOOM: &str = "boom";
/// Kind of the callbacks.
const CALLBACK: &str = "callback";

/// Every callback run: (task id, payload).
type Seen = Arc<Mutex<Vec<(String, Value)>>>;

/// A handler that records every callback run.
fn callbacks() -> (Seen, Arc<dyn Handler>) {
    let seen: Arc<Mutex<Vec<(String, Value)>>> = Arc::default();
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

fn boom() -> Arc<dyn Handler> {
    handler_fn(|_ctx| async move { Err::<Value, _>(TaskError::permanent("boom")) })
}

fn seen_of(seen: &Seen) -> Vec<(String, Value)> {
    seen.lock().map(|v| v.clone()).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_of_5000_with_3_failing_fires_on_complete_once_across_replicas_and_redis_loss(
) -> anyhow::Result<()> {
    const TOTAL: usize = 5_000;
    let redis = PrivateRedis::start(None, None).await?;
    let ns = Ns::on_redis(&redis.url(None)).await?;
    let rec = Recorder::default();
    let (seen, cb) = callbacks();
    let h = [(JOB, rec.handler()), (BOOM, boom()), (CALLBACK, cb)];
    let s1 = start_scheduler(&ns, SCHEDULER).await?;
    let s2 = start_scheduler(&ns, SCHEDULER).await?;
    let w1 = start_worker(&ns, "w-1", "", 16, WORKER, &h).await?;
    let w2 = start_worker(&ns, "w-2", "", 16, WORKER, &h).await?;
    // Killed in the middle: a hard stop (runs cut, no outcome, no ack, its connection gone).
    let victim = start_worker(&ns, "w-victim", "", 16, WORKER, &h).await?;
    scheduler_ready(&s1).await?;
    scheduler_ready(&s2).await?;

    let failing = [7usize, 2_500, 4_990];
    let tasks: Vec<Value> = (0..TOTAL)
        .map(|i| {
            let id = format!("m-{i}");
            if failing.contains(&i) {
                json!({"id": id, "kind": BOOM, "max_attempts": 1})
            } else {
                json!({"id": id, "kind": JOB, "payload": {"i": i}})
            }
        })
        .collect();
    let body = json!({
        "id": "import-1",
        "tasks": tasks,
        "on_success": {"kind": CALLBACK, "payload": {"which": "success"}},
        "on_complete": {"kind": CALLBACK, "payload": {"which": "complete"}},
    });
    let (code, answer) = api_post(s1.url("/v1/batches"), &body).await?;
    assert_eq!(code, 202, "{answer}");
    assert_eq!(answer["batch"], "import-1");
    assert_eq!(answer["ids"].as_array().map(Vec::len), Some(TOTAL));

    wait_for(
        "a third of the batch run",
        Duration::from_secs(60),
        || async { (rec.count() >= TOTAL / 3).then_some(()) },
    )
    .await?;
    victim.force.cancel();
    victim.shutdown.cancel();
    let joined = tokio::time::timeout(Duration::from_secs(30), victim.join).await;
    println!(
        "worker killed after {} runs (joined: {})",
        rec.count(),
        joined.is_ok()
    );
    wait_for("half of the batch run", Duration::from_secs(60), || async {
        (rec.count() >= TOTAL / 2).then_some(())
    })
    .await?;
    redis.flushall().await?;
    println!("FLUSHALL after {} runs", rec.count());

    let fired = wait_for("on_complete fired", Duration::from_secs(120), || async {
        let v = seen_of(&seen);
        (!v.is_empty()).then_some(v)
    })
    .await?;
    // Quiet period that is the point: no second copy of a callback arrives.
    quiet_for(Duration::from_secs(3), "a second callback would arrive now").await;
    let all = seen_of(&seen);
    assert_eq!(all.len(), 1, "callbacks run: {all:?}");
    let (id, payload) = &fired[0];
    assert_eq!(id, "import-1:on_complete");
    assert_eq!(payload["which"], "complete");
    let b = &payload["batch"];
    assert_eq!(b["id"], "import-1");
    assert_eq!(b["callback"], "on_complete");
    assert_eq!(b["total"], TOTAL);
    assert_eq!(b["succeeded"], TOTAL - 3);
    assert_eq!(b["dead"], 3);
    assert_eq!(b["expired"], 0);
    assert_eq!(b["cancelled"], 0);
    assert_eq!(b["failed"], json!(["m-7", "m-2500", "m-4990"]));

    // Every member ran (those in flight at the FLUSHALL may have run twice: the dedupe marks
    // went with Redis); every succeeded member counted once.
    let per = rec.per_task();
    assert_eq!(per.len(), TOTAL - 3);

    // Both replicas give the same progress.
    for s in [&s1, &s2] {
        let (code, p) = api_get(s.url("/v1/batches/import-1")).await?;
        assert_eq!(code, 200, "{p}");
        assert_eq!(p["total"], TOTAL);
        assert_eq!(p["succeeded"], TOTAL - 3);
        assert_eq!(p["dead"], 3);
        assert_eq!(p["pending"], 0);
        assert_eq!(p["complete"], true);
        assert_eq!(p["fired"], json!(["on_complete"]));
        assert_eq!(p["failed"], json!(["m-7", "m-2500", "m-4990"]));
    }
    let (code, _) = api_get(s1.url("/v1/batches/nope")).await?;
    assert_eq!(code, 404);

    w1.stop().await?;
    w2.stop().await?;
    s1.stop().await?;
    s2.stop().await?;
    ns.cleanup().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_that_all_succeeds_fires_both_callbacks_once_and_a_restarted_replica_fires_none_again(
) -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let (seen, cb) = callbacks();
    let h = [(JOB, rec.handler()), (CALLBACK, cb)];
    let s1 = start_scheduler(&ns, SCHEDULER).await?;
    let w = start_worker(&ns, "w-1", "", 8, WORKER, &h).await?;
    scheduler_ready(&s1).await?;
    let body = json!({
        "tasks": (0..20).map(|i| json!({"kind": JOB, "payload": {"i": i}})).collect::<Vec<_>>(),
        "on_success": {"kind": CALLBACK, "payload": 42},
        "on_complete": {"kind": CALLBACK},
    });
    let (code, answer) = api_post(s1.url("/v1/batches"), &body).await?;
    assert_eq!(code, 202, "{answer}");
    let batch = answer["batch"].as_str().unwrap_or_default().to_string();
    wait_for("both callbacks", Duration::from_secs(30), || async {
        (seen_of(&seen).len() >= 2).then_some(())
    })
    .await?;
    let mut ids: Vec<String> = seen_of(&seen).into_iter().map(|(id, _)| id).collect();
    ids.sort();
    assert_eq!(
        ids,
        vec![
            format!("{batch}:on_complete"),
            format!("{batch}:on_success")
        ]
    );
    let success = seen_of(&seen)
        .into_iter()
        .find(|(id, _)| id.ends_with(":on_success"))
        .map(|(_, p)| p)
        .unwrap_or_default();
    assert_eq!(success["value"], 42);
    assert_eq!(success["batch"]["succeeded"], 20);
    assert_eq!(success["batch"]["failed"], json!([]));

    // A replica started later reads the stream: it knows the batch, and fires nothing again.
    let s2 = start_scheduler(&ns, SCHEDULER).await?;
    scheduler_ready(&s2).await?;
    let (code, p) = api_get(s2.url(&format!("/v1/batches/{batch}"))).await?;
    assert_eq!(code, 200, "{p}");
    assert_eq!(p["succeeded"], 20);
    assert_eq!(p["fired"], json!(["on_complete", "on_success"]));
    quiet_for(Duration::from_secs(2), "a second callback would arrive now").await;
    assert_eq!(seen_of(&seen).len(), 2);
    assert_eq!(rec.count(), 20);

    // Refusals: an empty batch, an invalid member (its index), a callback without kind.
    let (code, e) = api_post(s1.url("/v1/batches"), &json!({"tasks": []})).await?;
    assert_eq!((code, e["error"].as_str()), (400, Some("no_tasks")));
    let (code, e) = api_post(
        s1.url("/v1/batches"),
        &json!({"tasks": [{"kind": JOB}, {"payload": 1}]}),
    )
    .await?;
    assert_eq!((code, e["index"].as_i64()), (400, Some(1)), "{e}");
    let (code, e) = api_post(
        s1.url("/v1/batches"),
        &json!({"tasks": [{"kind": JOB}], "on_complete": {"payload": 1}}),
    )
    .await?;
    assert_eq!((code, e["error"].as_str()), (400, Some("bad_callback")));

    w.stop().await?;
    s1.stop().await?;
    s2.stop().await?;
    ns.cleanup().await?;
    Ok(())
}
