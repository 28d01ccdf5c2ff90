//! A scheduler crash mid-batch (issue 10 §2): two `fleet-scheduler` processes share one
//! ingress; 5,000 tasks are published with confirms over ~3.5 s (35 chunks 100 ms apart) and one scheduler is killed
//! with kill -9 about 3 s in, while it holds a batch. Every task must succeed exactly once:
//! 0 lost, 0 ran twice within one attempt (the claim in `start.lua` turns the survivor's second
//! dispatch of the dead scheduler's batch into duplicates that are acked without running).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use fleet_tests::*;
use serde_json::json;

const KIND: &str = "rec";
const TOTAL: usize = 5_000;
/// Chunks published 100 ms apart: 35 chunks ≈ 3.5 s.
const CHUNKS: usize = 35;
/// The chunk after which one scheduler is killed (≈ 3 s in).
const KILL_AFTER: usize = 30;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scheduler_killed_mid_batch_runs_every_task_once() -> anyhow::Result<()> {
    own_process!();
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let h = [(KIND, rec.handler())];
    let w1 = start_worker(&ns, "w-1", "", 64, WORKER, &h).await?;
    let w2 = start_worker(&ns, "w-2", "", 64, WORKER, &h).await?;
    let settings: &[(&str, &str)] = &[
        ("health_interval_ms", "300"),
        ("heartbeat_timeout_ms", "1500"),
        ("probe_interval_ms", "600000"),
        ("ingress_max_normal", "10000"),
    ];
    let mut doomed = SchedulerProcess::spawn(&ns, settings).await?;
    let mut survivor = SchedulerProcess::spawn(&ns, settings).await?;

    let envs: Vec<fleet::Envelope> = (0..TOTAL)
        .map(|i| task(KIND, json!({"i": i, "ms": 20}), ""))
        .collect();
    let ids: Vec<String> = envs.iter().map(|e| e.id.clone()).collect();
    let per_chunk = TOTAL.div_ceil(CHUNKS);
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    let (mut accepted, mut refused) = (0, 0);
    let mut killed_at = None;
    let mut ran_before_kill = 0;
    // Confirms are awaited after the last chunk, so a loaded machine does not stretch the pace.
    let mut confirms = Vec::with_capacity(TOTAL);
    for (k, chunk) in envs.chunks(per_chunk).enumerate() {
        tick.tick().await;
        for e in chunk {
            let props = fleet::broker::amqp::task_properties(&e.id, None);
            confirms.push(
                fleet::broker::amqp::publish(
                    &ns.publisher,
                    &ns.names.submit_exchange(),
                    e.lane.as_str(),
                    &e.to_bytes(),
                    props,
                )
                .await?,
            );
        }
        if k + 1 == KILL_AFTER {
            ran_before_kill = rec.count();
            doomed.kill9()?;
            killed_at = Some(started.elapsed());
        }
    }
    let published_in = started.elapsed();
    for c in confirms {
        match fleet::broker::amqp::confirmed(c).await {
            Ok(()) => accepted += 1,
            Err(_) => refused += 1,
        }
    }
    assert_eq!((accepted, refused), (TOTAL, 0), "every task accepted");

    wait_for(
        &format!("{TOTAL} distinct tasks run"),
        Duration::from_secs(90),
        || async { (rec.per_task().len() >= TOTAL).then_some(()) },
    )
    .await
    .with_context_log(&survivor)?;
    // Every status succeeded (the outcome is written before the ack).
    let (settled, last) = wait_all_in(&ns, &ids, "succeeded", Duration::from_secs(30)).await?;
    let mut by_state: BTreeMap<&str, usize> = BTreeMap::new();
    for s in last.values() {
        *by_state.entry(s.as_str()).or_default() += 1;
    }

    // Runs per (id, attempt) and per id.
    let runs = rec.runs();
    let mut per_attempt: HashMap<(&str, u32), usize> = HashMap::new();
    let mut per_id: HashMap<&str, usize> = HashMap::new();
    for (id, _, attempt) in &runs {
        *per_attempt.entry((id.as_str(), *attempt)).or_default() += 1;
        *per_id.entry(id.as_str()).or_default() += 1;
    }
    let twice_in_attempt = per_attempt.values().filter(|n| **n > 1).count();
    let ran_twice = per_id.values().filter(|n| **n > 1).count();
    let lost = ids
        .iter()
        .filter(|id| !per_id.contains_key(id.as_str()))
        .count();
    let dup_deliveries = metric(
        &format!("http://{}/metrics", w1.addr),
        "fleet_tasks_duplicate_deliveries_total",
        &[],
    )
    .await?;
    let dropped_as_handed_on = metric(
        &format!("{}/metrics", survivor.base),
        "fleet_tasks_duplicate_total",
        &[],
    )
    .await?
        + 0.0;
    let dead = ns.drain_dead().await?;
    println!(
        "scheduler kill -9 mid-batch: {TOTAL} published in {:.2} s, scheduler killed at {:.2} s with {ran_before_kill} runs done; \
         runs {}, distinct {}, lost {lost}, ran twice in one attempt {twice_in_attempt}, ran more than once {ran_twice}; \
         statuses {by_state:?}; duplicate deliveries absorbed by workers (fleet_tasks_duplicate_deliveries_total) {}; \
         redelivered submissions the survivor dropped as already handed on (fleet_tasks_duplicate_total) {dropped_as_handed_on}; dead letters {}",
        published_in.as_secs_f64(),
        killed_at.map(|d| d.as_secs_f64()).unwrap_or_default(),
        runs.len(),
        per_id.len(),
        dup_deliveries + 0.0,
        dead.len()
    );
    assert!(settled, "every status succeeded: {:?}", count_states(&last));
    assert_eq!(lost, 0, "nothing lost");
    assert_eq!(twice_in_attempt, 0, "no attempt ran twice");
    assert_eq!(ran_twice, 0, "no task failed, so each ran exactly once");
    assert_eq!(runs.len(), TOTAL);
    assert_eq!(by_state.get("succeeded").copied(), Some(TOTAL));
    assert!(dead.is_empty(), "nothing dead-lettered");
    assert!(
        ran_before_kill < TOTAL,
        "the kill came while work was outstanding"
    );

    w1.stop().await?;
    w2.stop().await?;
    survivor.stop(Duration::from_secs(20)).await?;
    ns.cleanup().await
}

trait LogContext<T> {
    fn with_context_log(self, s: &SchedulerProcess) -> anyhow::Result<T>;
}

impl<T> LogContext<T> for anyhow::Result<T> {
    fn with_context_log(self, s: &SchedulerProcess) -> anyhow::Result<T> {
        self.map_err(|e| {
            let text = std::fs::read_to_string(&s.log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            anyhow::anyhow!(
                "{e}; survivor log tail:\n{}",
                lines[lines.len().saturating_sub(30)..].join("\n")
            )
        })
    }
}
