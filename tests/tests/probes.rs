//! Health probes never reach the user's dead-letter queue (issue 10 §11): a worker that
//! answers every probe too late (its deadline passes) or with a permanent error.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fleet_tests::*;
use fleet_worker::executor::{handler_fn, TaskError};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failed_and_expired_probes_are_not_dead_lettered() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &[("probe_interval_ms", "300"), ("probe_timeout_ms", "1500")]).await?;
    let (started, finished) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
    let (s, f) = (started.clone(), finished.clone());
    // Every probe runs 2 s (past its 1.5 s deadline), every other one then fails for good.
    let slow = handler_fn(move |_ctx| {
        let (s, f) = (s.clone(), f.clone());
        async move {
            let n = s.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(2000)).await;
            f.fetch_add(1, Ordering::SeqCst);
            if n % 2 == 0 {
                Err(TaskError::permanent("probe refused"))
            } else {
                Ok(serde_json::json!({}))
            }
        }
    });
    let w = start_worker(&ns, "w1", "", 2, &[], &[("noop", slow)]).await?;
    wait_for("3 probes run", Duration::from_secs(60), || async { (finished.load(Ordering::SeqCst) >= 3).then_some(()) }).await?;
    let page = reqwest::get(sched.url("/metrics")).await?.text().await?;
    let failures = metric_sum(&page, "fleet_probe_failures_total", &[]);
    w.stop().await?;
    sched.stop().await?;
    let dead = ns.drain_dead().await?;
    println!("probes: {} run, {failures} probe failures counted, {} dead letters", finished.load(Ordering::SeqCst), dead.len());
    assert!(failures >= 1.0, "the probes failed (timed out)");
    assert!(dead.is_empty(), "no probe in the dead-letter queue: {:?}", dead.iter().map(|d| &d.1).collect::<Vec<_>>());
    ns.cleanup().await
}
