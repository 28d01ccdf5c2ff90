//! Retries with backoff, end to end: a failing attempt goes through a delay tier in the broker
//! and back through the scheduler to the group, until it succeeds or runs out of attempts; the
//! waits grow with the attempt number (capped exponential, full jitter).

use std::collections::HashMap;
use std::time::Duration;

use fleet_tests::*;
use fleet_worker::executor::{handler_fn, TaskError};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fail_twice_then_succeed_on_attempt_three() -> anyhow::Result<()> {
    own_process!();
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let labels = "case=fail-twice";
    let group = group_of(labels, "builtin");
    let w = start_worker(
        &ns,
        "w-retry",
        labels,
        4,
        &[("retry_base_ms", "200"), ("retry_cap_ms", "2000")],
        &[],
    )
    .await?;

    let mut t = task("fail", json!({"times": 2}), labels);
    t.max_attempts = Some(3);
    ns.submit(std::slice::from_ref(&t)).await?;

    let st = ns
        .wait_state(&t.id, "succeeded", Duration::from_secs(30))
        .await?;
    assert_eq!(st.get("attempt").map(String::as_str), Some("3"), "{st:?}");
    assert_eq!(st.get("worker").map(String::as_str), Some("w-retry"));
    let result: serde_json::Value =
        serde_json::from_str(st.get("result").map(String::as_str).unwrap_or("null"))?;
    assert_eq!(result, json!({"attempt": 3}));
    assert!(
        !st.contains_key("error"),
        "a success clears the earlier attempts' error: {st:?}"
    );

    // Two retried attempts, one success, nothing dead, in this worker's group.
    let b = format!("http://{}", w.addr);
    assert_eq!(completed_at_least(&b, &group, "retried", 2).await?, 2);
    assert_eq!(completed_at_least(&b, &group, "succeeded", 1).await?, 1);
    assert_eq!(completed(&b, &group, "dead").await?, 0);
    assert_eq!(ns.depth(&ns.names.dead_queue()).await, 0);

    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// The wait after failed attempt `k` is uniform in `[0, base × 2^(k−1)]` (full jitter), so a
/// single gap proves nothing; over 30 tasks the largest gap after attempt `k` must pass the
/// previous attempt's ceiling (all 30 staying under it has probability 2^−30), no gap may pass
/// its own ceiling by more than the delay tiers' granularity plus scheduling slack, and the
/// mean gap grows.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn backoff_gaps_grow_with_the_attempt_number() -> anyhow::Result<()> {
    own_process!();
    const TASKS: usize = 30;
    const BASE_MS: u64 = 300;
    // Delay tiers are 100 ms apart at the bottom and each hop passes the scheduler: on a busy
    // 2-core machine a gap may overshoot its ceiling by this much (seen: 630 ms with seven
    // test binaries running at once).
    const SLACK_MS: u64 = 1500;
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let attempts = Attempts::default();
    let a = attempts.clone();
    // Fails attempts 1..=3, succeeds on attempt 4; records when each attempt started.
    let flaky = handler_fn(move |ctx| {
        let a = a.clone();
        async move {
            a.record(&ctx.envelope.id, ctx.attempt);
            if ctx.attempt <= 3 {
                return Err(TaskError::retryable(format!(
                    "flaky: attempt {}",
                    ctx.attempt
                )));
            }
            Ok(json!({"attempt": ctx.attempt}))
        }
    });
    let labels = "case=gaps";
    let base_ms = BASE_MS.to_string();
    let w = start_worker(
        &ns,
        "w-gaps",
        labels,
        (TASKS + 2) as u32,
        &[
            ("retry_base_ms", base_ms.as_str()),
            ("retry_cap_ms", "60000"),
            NO_EJECT,
        ],
        &[("flaky", flaky)],
    )
    .await?;

    let envs: Vec<_> = (0..TASKS)
        .map(|_| {
            let mut t = task("flaky", json!({}), labels);
            t.max_attempts = Some(4);
            t
        })
        .collect();
    assert_eq!(ns.submit(&envs).await?, (TASKS, 0));
    for e in &envs {
        ns.wait_state(&e.id, "succeeded", Duration::from_secs(60))
            .await?;
    }

    // Per task: attempts 1, 2, 3, 4 exactly once each and in order.
    let mut starts: HashMap<String, Vec<(u32, std::time::Instant)>> = HashMap::new();
    for (id, attempt, at) in attempts.all() {
        starts.entry(id).or_default().push((attempt, at));
    }
    assert_eq!(starts.len(), TASKS);
    let mut gaps: [Vec<u64>; 3] = Default::default();
    for e in &envs {
        let s = &starts[&e.id];
        assert_eq!(
            s.iter().map(|(a, _)| *a).collect::<Vec<_>>(),
            vec![1, 2, 3, 4],
            "task {}",
            e.id
        );
        for k in 0..3 {
            gaps[k].push(s[k + 1].1.duration_since(s[k].1).as_millis() as u64);
        }
    }
    let ceiling = |k: usize| BASE_MS << k; // after attempt k+1
    for (k, g) in gaps.iter().enumerate() {
        let mut sorted = g.clone();
        sorted.sort_unstable();
        let mean = g.iter().sum::<u64>() as f64 / g.len() as f64;
        println!(
            "gap after attempt {}: ceiling {} ms, min {} ms, median {} ms, mean {mean:.0} ms, max {} ms",
            k + 1,
            ceiling(k),
            sorted[0],
            sorted[sorted.len() / 2],
            sorted[sorted.len() - 1]
        );
    }
    for (k, g) in gaps.iter().enumerate() {
        let max = *g.iter().max().unwrap_or(&0);
        assert!(
            max <= ceiling(k) + SLACK_MS,
            "gap after attempt {} was {max} ms, ceiling {} ms",
            k + 1,
            ceiling(k)
        );
        if k > 0 {
            assert!(
                max > ceiling(k - 1),
                "no gap after attempt {} passed the previous ceiling {} ms: the backoff does not grow ({g:?})",
                k + 1,
                ceiling(k - 1)
            );
        }
    }
    let mean = |g: &Vec<u64>| g.iter().sum::<u64>() as f64 / g.len() as f64;
    assert!(
        mean(&gaps[2]) > mean(&gaps[0]),
        "mean gaps must grow: {:?}",
        gaps.iter().map(mean).collect::<Vec<_>>()
    );

    let b = format!("http://{}", w.addr);
    let group = group_of(labels, "builtin");
    assert_eq!(
        completed_at_least(&b, &group, "retried", 3 * TASKS as u64).await?,
        3 * TASKS as u64
    );
    assert_eq!(
        completed_at_least(&b, &group, "succeeded", TASKS as u64).await?,
        TASKS as u64
    );
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// Retries never outlive the deadline: a task that keeps failing ends `expired` (not dead
/// after max_attempts, nor retried forever) once its time is up.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retries_stop_at_the_deadline() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let labels = "case=retry-deadline";
    let w = start_worker(
        &ns,
        "w-rd",
        labels,
        2,
        &[("retry_base_ms", "200"), ("retry_cap_ms", "400"), NO_EJECT],
        &[],
    )
    .await?;
    let mut t = task("fail", json!({}), labels);
    t.max_attempts = Some(50);
    t.timeout_ms = Some(1500);
    let submitted = std::time::Instant::now();
    ns.submit(std::slice::from_ref(&t)).await?;
    let st = ns
        .wait_state(&t.id, "expired", Duration::from_secs(20))
        .await?;
    println!(
        "expired after {} ms: {st:?}",
        submitted.elapsed().as_millis()
    );
    let dead = wait_dead(&ns, 1, Duration::from_secs(10)).await?;
    assert_eq!(dead[0].env.id, t.id);
    assert_eq!(
        dead[0].header("x-fleet-reason"),
        Some("expired"),
        "{:?}",
        dead[0].headers
    );
    let attempts = dead[0].env.attempt;
    assert!(
        (2..50).contains(&attempts),
        "retried within its 1.5 s, then expired: {attempts} attempts"
    );
    assert!(submitted.elapsed() < Duration::from_secs(10));
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
