//! Expected events are not errors (issue 37 item 6): a scheduler's start used to log
//! `ERROR … NOT_FOUND - no queue '<ns>.park.…'` (lapin, target `lapin::channel`, for the passive
//! declares of park queues not made yet) and its stop `ERROR Connection error … invalid channel
//! state: Closing` (`lapin::channels`), under the `RUST_LOG=info,lapin=warn` the harness (and
//! many operators) run with. A `fleet-scheduler` process with a worker group to look at is
//! started, samples the fleet, and is stopped with SIGTERM: its whole log has no ERROR line.

use std::time::Duration;

use fleet_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_start_and_stop_log_no_error() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let w = start_worker(&ns, "w-logs", "case=logs", 1, &[], &[]).await?;
    let mut sched = SchedulerProcess::spawn(&ns, &[]).await?;
    // Two fresh samples: the view has asked every queue it reads (the park queues of the
    // group and of unmatched tasks, none of them made yet) at least once.
    let pressure = format!("{}/v1/pressure", sched.base);
    let first = std::sync::atomic::AtomicI64::new(0);
    wait_for("two fleet samples", Duration::from_secs(30), || async {
        let p = get_json(&pressure).await.ok()?;
        let at = p["sampled_at_ms"].as_i64().filter(|a| *a > 0)?;
        let seen = first.load(std::sync::atomic::Ordering::Relaxed);
        if seen == 0 {
            first.store(at, std::sync::atomic::Ordering::Relaxed);
            return None;
        }
        (at > seen).then_some(())
    })
    .await?;
    sched.stop(Duration::from_secs(30)).await?;
    let log = std::fs::read_to_string(&sched.log)?;
    let errors: Vec<&str> = log.lines().filter(|l| l.contains(" ERROR ")).collect();
    println!(
        "scheduler log: {} lines, {} ERROR",
        log.lines().count(),
        errors.len()
    );
    assert!(
        log.lines().any(|l| l.contains(" INFO ")),
        "the log was captured:\n{log}"
    );
    assert!(errors.is_empty(), "ERROR lines:\n{}", errors.join("\n"));
    w.stop().await?;
    ns.cleanup().await
}
