//! The dedupe window (`FLEET_DEDUPE_WINDOW_MS`) is a window: a repeated id within it runs once;
//! after it, an id whose last run has ended (succeeded, dead, expired) runs again as a new run
//! — its status shows that run, from `queued` on, with a fresh attempt count.

use std::time::Duration;

use deadpool_redis::redis;
use fleet_tests::*;
use serde_json::json;

/// Waits until `id`'s dedupe mark has lapsed (the window has passed): its `ddx` field, on the
/// Redis clock (the record that holds it lives on).
async fn window_passed(ns: &Ns, id: &str) -> anyhow::Result<()> {
    let key = ns.names.task(id);
    wait_for(
        "the dedupe mark lapsed",
        Duration::from_secs(20),
        || async {
            let until: Option<i64> = ns
                .store
                .query(redis::cmd("HGET").arg(&key).arg("ddx"))
                .await
                .ok()?;
            let (secs, micros): (i64, i64) = ns.store.query(&redis::cmd("TIME")).await.ok()?;
            let now = secs * 1000 + micros / 1000;
            until.is_none_or(|u| u <= now).then_some(())
        },
    )
    .await
}

fn field(st: &std::collections::BTreeMap<String, String>, k: &str) -> String {
    st.get(k).cloned().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_id_submitted_again_after_the_window_runs_again() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let mut cfg = SCHEDULER.to_vec();
    cfg.push(("dedupe_window_ms", "1500"));
    let sched = start_scheduler(&ns, &cfg).await?;
    let rec = Recorder::default();
    let h = [(JOB, rec.handler())];
    let labels = "case=window";
    let w = start_worker(&ns, "w-window", labels, 2, WORKER, &h).await?;

    let x = task(JOB, json!({}), labels);
    ns.submit(std::slice::from_ref(&x)).await?;
    let first = ns
        .wait_state(&x.id, "succeeded", Duration::from_secs(20))
        .await?;

    // Within the window: a copy, acked without running.
    ns.submit(std::slice::from_ref(&x)).await?;
    ns.wait_settled(Duration::from_secs(20)).await?;
    assert_eq!(
        rec.per_task()[&x.id].len(),
        1,
        "a copy within the window ran"
    );

    // After it: a new run, and the status is that run's.
    window_passed(&ns, &x.id).await?;
    ns.submit(std::slice::from_ref(&x)).await?;
    wait_for(
        "the resubmitted id ran",
        Duration::from_secs(20),
        || async { (rec.per_task().get(&x.id).map(Vec::len) == Some(2)).then_some(()) },
    )
    .await?;
    let again = wait_for("the new run's status", Duration::from_secs(20), || async {
        let st = ns.status(&x.id).await.ok()??;
        (field(&st, "state") == "succeeded"
            && field(&st, "finished_at") != field(&first, "finished_at"))
        .then_some(st)
    })
    .await?;
    println!(
        "resubmitted after the window: first run finished at {}, second at {}, attempt {}",
        field(&first, "finished_at"),
        field(&again, "finished_at"),
        field(&again, "attempt")
    );
    assert_eq!(
        field(&again, "attempt"),
        "1",
        "a new run counts from 1: {again:?}"
    );
    ns.wait_settled(Duration::from_secs(20)).await?;
    assert_eq!(rec.per_task()[&x.id].len(), 2, "exactly one more run");

    // A dead id, resubmitted after the window once the producer fixed the cause, runs too.
    let mut d = task("fail", json!({"times": 1, "permanent": true}), labels);
    d.max_attempts = Some(3);
    ns.submit(std::slice::from_ref(&d)).await?;
    ns.wait_state(&d.id, "dead", Duration::from_secs(20))
        .await?;
    window_passed(&ns, &d.id).await?;
    let mut fixed = d.clone();
    fixed.payload = json!({"times": 0});
    ns.submit(std::slice::from_ref(&fixed)).await?;
    let st = ns
        .wait_state(&d.id, "succeeded", Duration::from_secs(20))
        .await?;
    assert_eq!(field(&st, "attempt"), "1", "{st:?}");
    assert_eq!(
        field(&st, "reason"),
        "",
        "the old run's reason is gone: {st:?}"
    );

    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// A resubmission after the window that reaches a scheduler as a *redelivery* (its first
/// scheduler took it and went away before acking: a rolling deploy, a lost channel) is a new
/// run too, not a copy of the run that ended. Redelivered ingress messages take the mark path
/// of `reserve.lua` (dedupe mode 2), which used to leave the old record final: the copy was
/// reserved, the worker acked it as a duplicate, and the id never ran again (review finding).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redelivered_resubmission_after_the_window_runs_again() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let mut cfg = SCHEDULER.to_vec();
    cfg.push(("dedupe_window_ms", "1500"));
    let sched = start_scheduler(&ns, &cfg).await?;
    let rec = Recorder::default();
    let h = [(JOB, rec.handler())];
    let labels = "case=redelivered";
    let w = start_worker(&ns, "w-redelivered", labels, 2, WORKER, &h).await?;

    let x = task(JOB, json!({}), labels);
    ns.submit(std::slice::from_ref(&x)).await?;
    ns.wait_state(&x.id, "succeeded", Duration::from_secs(20))
        .await?;
    window_passed(&ns, &x.id).await?;

    // No scheduler while the resubmission arrives; the test takes it from ingress without
    // acking and lets it go (channel closed): the broker requeues it, marked redelivered.
    sched.stop().await?;
    ns.submit(std::slice::from_ref(&x)).await?;
    let ch = ns.conn.create_channel().await?;
    let got = ch
        .basic_get(
            ns.names.ingress_queue(fleet::Lane::Normal).as_str().into(),
            lapin::options::BasicGetOptions { no_ack: false },
        )
        .await?;
    anyhow::ensure!(got.is_some(), "the resubmission is in ingress");
    ch.close(200, "let it go".into()).await?;

    let sched = start_scheduler(&ns, &cfg).await?;
    wait_for(
        "the redelivered resubmission ran",
        Duration::from_secs(20),
        || async { (rec.per_task().get(&x.id).map(Vec::len) == Some(2)).then_some(()) },
    )
    .await?;
    ns.wait_settled(Duration::from_secs(20)).await?;
    assert_eq!(rec.per_task()[&x.id].len(), 2, "exactly one more run");
    let st = ns
        .wait_state(&x.id, "succeeded", Duration::from_secs(20))
        .await?;
    assert_eq!(
        field(&st, "attempt"),
        "1",
        "a new run counts from 1: {st:?}"
    );

    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
