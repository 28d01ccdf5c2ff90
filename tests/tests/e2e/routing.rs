//! Walking skeleton end to end: tasks travel from the broker through the scheduler to a worker
//! whose labels satisfy their selector, each exactly once.

use std::time::Duration;

use fleet::Envelope;
use fleet_tests::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thousand_tasks_run_once_on_matching_workers() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let h = [("record", rec.handler())];
    let sched = start_scheduler(&ns, &[]).await?;
    let gpu = start_worker(&ns, "w-gpu", "gpu=true", 8, &[], &h).await?;
    let cpu = start_worker(&ns, "w-cpu", "gpu=false", 8, &[], &h).await?;

    let mut envs = Vec::new();
    let mut want = std::collections::HashMap::new();
    for i in 0..1000 {
        let sel = ["gpu=true", "gpu=false", ""][i % 3];
        let e = task("record", json!({"i": i}), sel);
        want.insert(e.id.clone(), sel);
        envs.push(e);
    }
    let (ok, refused) = ns.submit(&envs).await?;
    assert_eq!((ok, refused), (1000, 0));
    wait_for("1000 runs", Duration::from_secs(60), || async {
        (rec.count() >= 1000).then_some(())
    })
    .await?;
    ns.wait_settled(Duration::from_secs(30)).await?;

    let per = rec.per_task();
    assert_eq!(per.len(), 1000, "every task ran");
    assert_eq!(rec.count(), 1000, "no task ran twice");
    let mut on = std::collections::HashMap::new();
    for (id, workers) in &per {
        let sel = want[id];
        let w = &workers[0];
        match sel {
            "gpu=true" => assert_eq!(w, "w-gpu", "task {id} ({sel}) ran on {w}"),
            "gpu=false" => assert_eq!(w, "w-cpu", "task {id} ({sel}) ran on {w}"),
            _ => {}
        }
        *on.entry(w.clone()).or_insert(0) += 1;
    }
    // Tasks without a selector went to both groups (least-loaded choice).
    assert!(on["w-gpu"] > 333 && on["w-cpu"] > 333, "spread: {on:?}");
    // Status records show the outcome.
    let any = envs[0].id.clone();
    let st = ns.status(&any).await?.unwrap_or_default();
    assert_eq!(st.get("state").map(String::as_str), Some("succeeded"));

    gpu.stop().await?;
    cpu.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unmatched_selector_never_runs_on_a_wrong_worker() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let h = [("record", rec.handler())];
    let sched = start_scheduler(&ns, &[("no_match_grace_ms", "1500")]).await?;
    let w = start_worker(&ns, "w-cpu", "gpu=false", 4, &[], &h).await?;
    let stray = task("record", json!({}), "gpu=quantum");
    let fine = task("record", json!({}), "gpu=false");
    ns.submit(&[stray.clone(), fine.clone()]).await?;
    let dead = wait_for(
        "the unmatched task to be dead-lettered",
        Duration::from_secs(20),
        || async {
            let d = ns.drain_dead().await.ok()?;
            (!d.is_empty()).then_some(d)
        },
    )
    .await?;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].1.as_deref(), Some("no_matching_worker"));
    let e = Envelope::from_slice(&dead[0].0, usize::MAX)?;
    assert_eq!(e.id, stray.id);
    let runs = rec.runs();
    assert_eq!(runs.len(), 1, "runs: {:?}", &runs[..runs.len().min(5)]);
    assert_eq!(runs[0].0, fine.id);
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn worker_never_exceeds_its_capacity() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let h = [("record", rec.handler())];
    let sched = start_scheduler(&ns, &[]).await?;
    let w = start_worker(&ns, "w-two", "", 2, &[], &h).await?;
    let envs: Vec<_> = (0..30)
        .map(|_| task("record", json!({"ms": 50}), ""))
        .collect();
    ns.submit(&envs).await?;
    wait_for("30 runs", Duration::from_secs(30), || async {
        (rec.count() >= 30).then_some(())
    })
    .await?;
    assert_eq!(rec.count(), 30);
    assert_eq!(
        rec.peak("w-two"),
        2,
        "peak concurrency must be exactly the capacity"
    );
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_scheduler_replicas_dispatch_each_task_once() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let h = [("record", rec.handler())];
    let s1 = start_scheduler(&ns, &[]).await?;
    let s2 = start_scheduler(&ns, &[]).await?;
    let a = start_worker(&ns, "w-a", "zone=a", 4, &[], &h).await?;
    let b = start_worker(&ns, "w-b", "zone=b", 4, &[], &h).await?;
    let envs: Vec<_> = (0..600)
        .map(|i| task("record", json!({"ms": 2}), ["zone=a", "zone=b", ""][i % 3]))
        .collect();
    assert_eq!(ns.submit(&envs).await?, (600, 0));
    wait_for("600 runs", Duration::from_secs(60), || async {
        (rec.count() >= 600).then_some(())
    })
    .await?;
    ns.wait_settled(Duration::from_secs(30)).await?;
    assert_eq!(rec.count(), 600, "no task dispatched twice");
    assert_eq!(rec.per_task().len(), 600);
    assert!(
        rec.peak("w-a") <= 4 && rec.peak("w-b") <= 4,
        "capacity never exceeded"
    );
    a.stop().await?;
    b.stop().await?;
    s1.stop().await?;
    s2.stop().await?;
    ns.cleanup().await
}
