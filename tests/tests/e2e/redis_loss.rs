//! Redis loses all its data in the middle of a run (FLUSHALL on a `redis-server` of this test's
//! own — never the shared one): every worker registers again within about one heartbeat, the
//! group's capacity comes back, and every task completes exactly once.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use fleet_tests::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn workers_register_again_and_every_task_completes() -> anyhow::Result<()> {
    let redis = PrivateRedis::start(None, None).await?;
    let ns = Ns::on_redis(&redis.url(None)).await?;
    let rec = Recorder::default();
    let h = [(JOB, rec.handler())];
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let w1 = start_worker(&ns, "w-1", "pool=r", 3, WORKER, &h).await?;
    let w2 = start_worker(&ns, "w-2", "pool=r", 3, WORKER, &h).await?;
    let gname = "pool=r,protocol=builtin";
    wait_for("group capacity 6", Duration::from_secs(10), || async {
        group(&ns.store, gname).await.filter(|g| g.capacity == 6)
    })
    .await?;

    let first: Vec<_> = (0..60)
        .map(|i| task(JOB, json!({"i": i, "ms": 100}), "pool=r"))
        .collect();
    assert_eq!(ns.submit(&first).await?, (60, 0));
    wait_for(
        "a third of the tasks run",
        Duration::from_secs(30),
        || async { (rec.count() >= 20).then_some(()) },
    )
    .await?;

    redis.flushall().await?;
    let flushed = Instant::now();
    let back = wait_for(
        "both workers registered again",
        Duration::from_secs(10),
        || async {
            let ws = ns.store.workers().await.ok()?;
            let ids: HashSet<&str> = ws
                .iter()
                .filter(|w| w.state == "active")
                .map(|w| w.id.as_str())
                .collect();
            (ids == HashSet::from(["w-1", "w-2"])).then(|| flushed.elapsed())
        },
    )
    .await?;
    println!("redis loss: both workers registered again {} ms after FLUSHALL (heartbeat {HEARTBEAT_MS} ms)", back.as_millis());
    // Within one heartbeat, plus slack for a busy test machine.
    assert!(
        back <= Duration::from_millis(HEARTBEAT_MS + 700),
        "took {back:?}"
    );
    let g = wait_for(
        "group capacity back to 6",
        Duration::from_secs(5),
        || async { group(&ns.store, gname).await.filter(|g| g.capacity == 6) },
    )
    .await?;
    assert_eq!(g.workers, 2);

    // Tasks submitted after the loss route as before.
    let second: Vec<_> = (0..20)
        .map(|i| task(JOB, json!({"i": 100 + i, "ms": 50}), "pool=r"))
        .collect();
    assert_eq!(ns.submit(&second).await?, (20, 0));

    let want: HashSet<String> = first.iter().chain(&second).map(|e| e.id.clone()).collect();
    wait_for("80 runs", Duration::from_secs(60), || async {
        (rec.count() >= 80).then_some(())
    })
    .await?;
    let per = rec.per_task();
    assert_eq!(
        per.keys().cloned().collect::<HashSet<_>>(),
        want,
        "every task ran"
    );
    assert!(per.values().all(|w| w.len() == 1), "each exactly once");
    assert!(ns.drain_dead().await?.is_empty(), "none dead-lettered");
    // Redis state rebuilt from the workers: no load left over, the second batch's statuses.
    let g = wait_for("group idle", Duration::from_secs(10), || async {
        group(&ns.store, gname).await.filter(|g| g.load == 0)
    })
    .await?;
    assert_eq!((g.workers, g.capacity), (2, 6));
    wait_succeeded(
        &ns,
        &second.iter().map(|e| e.id.clone()).collect::<Vec<_>>(),
        Duration::from_secs(10),
    )
    .await?;

    w1.stop().await?;
    w2.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
