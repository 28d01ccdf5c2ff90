//! kill -9 of a worker process in the middle of 5,000 short tasks, restarted at once with the
//! same id (issue 10 §5b): afterwards every task's status is `succeeded` (none left `running`:
//! outcomes are written before their acks), each attempt ran once, nothing was lost. Tasks in
//! flight on the killed worker count that crash as an attempt and run again as the next one.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use fleet_tests::*;

const TOTAL: usize = 5_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_during_5000_short_tasks_leaves_every_status_true() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let ep = Endpoint::start(5).await?;
    let sched = start_scheduler(
        &ns,
        &[
            ("health_interval_ms", "300"),
            ("heartbeat_timeout_ms", "1500"),
            ("probe_interval_ms", "600000"),
        ],
    )
    .await?;
    let victim_spec = ProcessSpec {
        id: "w-victim",
        labels: "",
        capacity: 16,
        endpoint: &ep.url,
        extra: &[],
    };
    let mut victim = WorkerProcess::spawn(&ns, &victim_spec)?;
    let mut peer = WorkerProcess::spawn(
        &ns,
        &ProcessSpec {
            id: "w-peer",
            labels: "",
            capacity: 16,
            endpoint: &ep.url,
            extra: &[],
        },
    )?;
    victim
        .wait_state(&ns.store, "active", Duration::from_secs(30))
        .await?;
    peer.wait_state(&ns.store, "active", Duration::from_secs(30))
        .await?;

    let envs = jobs(TOTAL, "", None);
    let ids: Vec<String> = envs.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ns.submit(&envs).await?, (TOTAL, 0));
    wait_for(
        "the victim 1,000 tasks in",
        Duration::from_secs(60),
        || async { (ep.calls_of("w-victim").len() >= 1_000).then_some(()) },
    )
    .await?;
    let killed = Instant::now();
    victim.kill9()?;
    let running_at_kill = ep.running("w-victim").len();
    let done_at_kill = ep.answered_ids().len();
    ep.mark_dead("w-victim");
    let restarted = WorkerProcess::spawn(&ns, &victim_spec)?;

    let (settled, last) = wait_all_in(&ns, &ids, "succeeded", Duration::from_secs(100)).await?;
    let took = killed.elapsed();
    let calls = ep.calls();
    let mut per_attempt: HashMap<(&str, u32), usize> = HashMap::new();
    let mut per_id: HashMap<&str, usize> = HashMap::new();
    for c in &calls {
        *per_attempt.entry((c.id.as_str(), c.attempt)).or_default() += 1;
        *per_id.entry(c.id.as_str()).or_default() += 1;
    }
    let twice_in_attempt: Vec<_> = per_attempt
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(k, n)| (k.0.to_string(), k.1, *n))
        .collect();
    let ran_again = per_id.values().filter(|n| **n > 1).count();
    let lost = ids
        .iter()
        .filter(|id| !per_id.contains_key(id.as_str()))
        .count();
    let dead = ns.drain_dead().await?;
    println!(
        "worker kill -9 during {TOTAL} tasks: {done_at_kill} done and {running_at_kill} running on the victim at the kill; all settled {:.1} s later; \
         statuses {:?}; calls {}, lost {lost}, an attempt run twice {}, tasks run again as a later attempt {ran_again}; dead letters {}",
        took.as_secs_f64(),
        count_states(&last),
        calls.len(),
        twice_in_attempt.len(),
        dead.len()
    );
    assert!(settled, "every status succeeded: {:?}", count_states(&last));
    assert_eq!(lost, 0, "nothing lost");
    assert!(
        twice_in_attempt.is_empty(),
        "attempts that ran twice: {twice_in_attempt:?}"
    );
    assert!(
        ran_again <= 16,
        "only what the victim had in flight (its capacity) runs again: {ran_again}"
    );
    assert!(dead.is_empty(), "nothing dead-lettered");
    let mut restarted = restarted;
    restarted
        .wait_state(&ns.store, "active", Duration::from_secs(10))
        .await?;
    let g = wait_for("group load back to 0", Duration::from_secs(10), || async {
        group(&ns.store, "protocol=http")
            .await
            .filter(|g| g.load == 0 && g.reserved == 0)
    })
    .await?;
    assert_eq!(g.workers, 2);

    restarted.signal("TERM")?;
    peer.signal("TERM")?;
    restarted.wait_exit(Duration::from_secs(30)).await?;
    peer.wait_exit(Duration::from_secs(30)).await?;
    sched.stop().await?;
    ns.cleanup().await
}
