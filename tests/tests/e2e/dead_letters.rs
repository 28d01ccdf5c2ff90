//! Dead letters end to end: a task that runs out of attempts (or fails permanently) lands in
//! `<ns>.dead` with its reason, last error, attempt count and worker; its status says `dead`;
//! `fleetctl dead list` shows it and `fleetctl dead replay` sends it back with its attempts
//! reset.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fleet_tests::*;
use fleet_worker::executor::{handler_fn, TaskError};
use serde_json::json;

const FAST_RETRY: [(&str, &str); 3] = [("retry_base_ms", "50"), ("retry_cap_ms", "200"), NO_EJECT];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exhausted_and_permanent_failures_are_dead_lettered_with_headers() -> anyhow::Result<()> {
    own_process!();
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let labels = "case=dead";
    let group = group_of(labels, "builtin");
    let w = start_worker(&ns, "w-dead", labels, 4, &FAST_RETRY, &[]).await?;

    let mut exhausted = task("fail", json!({"times": 9}), labels);
    exhausted.max_attempts = Some(3);
    let mut permanent = task("fail", json!({"times": 1, "permanent": true}), labels);
    permanent.max_attempts = Some(3);
    ns.submit(&[exhausted.clone(), permanent.clone()]).await?;

    let dead = wait_dead(&ns, 2, Duration::from_secs(30)).await?;
    let find = |id: &str| dead.iter().find(|d| d.env.id == id).cloned();
    let d = find(&exhausted.id)
        .ok_or_else(|| anyhow::anyhow!("exhausted task not in the dead queue"))?;
    let last_error = "fail: attempt 3 of the first 9 that fail";
    assert_eq!(
        d.header("x-fleet-reason"),
        Some("max_attempts"),
        "{:?}",
        d.headers
    );
    assert_eq!(d.header("x-fleet-detail"), Some(last_error));
    assert_eq!(d.header("x-fleet-attempts"), Some("3"));
    assert_eq!(d.header("x-fleet-worker"), Some("w-dead"));
    assert_eq!(d.env.attempt, 3);
    assert_eq!(
        d.env.payload,
        json!({"times": 9}),
        "the dead letter keeps the envelope"
    );
    let p = find(&permanent.id)
        .ok_or_else(|| anyhow::anyhow!("permanent failure not in the dead queue"))?;
    assert_eq!(
        p.header("x-fleet-reason"),
        Some("permanent_error"),
        "{:?}",
        p.headers
    );
    assert_eq!(
        p.header("x-fleet-detail"),
        Some("fail: attempt 1 of the first 1 that fail")
    );
    assert_eq!(
        p.header("x-fleet-attempts"),
        Some("1"),
        "a permanent error is not retried"
    );

    let st = ns
        .wait_state(&exhausted.id, "dead", Duration::from_secs(10))
        .await?;
    assert_eq!(
        st.get("error").map(String::as_str),
        Some(last_error),
        "{st:?}"
    );
    assert_eq!(st.get("attempt").map(String::as_str), Some("3"));
    assert_eq!(st.get("reason").map(String::as_str), Some("max_attempts"));
    assert_eq!(st.get("worker").map(String::as_str), Some("w-dead"));
    let st = ns
        .wait_state(&permanent.id, "dead", Duration::from_secs(10))
        .await?;
    assert_eq!(st.get("attempt").map(String::as_str), Some("1"), "{st:?}");
    assert_eq!(
        st.get("reason").map(String::as_str),
        Some("permanent_error")
    );

    let b = format!("http://{}", w.addr);
    assert_eq!(completed_at_least(&b, &group, "dead", 2).await?, 2);
    assert_eq!(
        completed(&b, &group, "retried").await?,
        2,
        "only the exhausted task was retried (twice)"
    );
    assert_eq!(completed(&b, &group, "succeeded").await?, 0);

    // A replay starts the count again: the task gets three fresh attempts (fails them all,
    // `times` is 9) and dies again at attempt 3, not at 4.
    let api = sched.url("");
    let (code, out, err) = fleetctl(&ns, &api, &["dead", "replay", &exhausted.id]).await?;
    assert_eq!(code, 0, "stdout: {out} stderr: {err}");
    assert_eq!(out.trim(), "replayed=1");
    assert_eq!(completed_at_least(&b, &group, "dead", 3).await?, 3);
    assert_eq!(completed(&b, &group, "retried").await?, 4);
    let dead = wait_dead(&ns, 2, Duration::from_secs(10)).await?;
    let again = dead
        .iter()
        .find(|d| d.env.id == exhausted.id)
        .ok_or_else(|| anyhow::anyhow!("replayed task not dead again"))?;
    assert_eq!(
        again.header("x-fleet-attempts"),
        Some("3"),
        "attempts were reset by the replay"
    );
    assert_eq!(again.header("x-fleet-reason"), Some("max_attempts"));
    // ... and as a new submission: its wait is measured from the replay, not the first try.
    assert!(
        again.env.submitted_at > d.env.submitted_at,
        "{:?} vs {:?}",
        again.env.submitted_at,
        d.env.submitted_at
    );

    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fleetctl_lists_and_replays_dead_letters() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &[]).await?;
    // Fails while the "upstream" is down; the test brings it back before replaying.
    let healed = Arc::new(AtomicBool::new(false));
    let attempts = Attempts::default();
    let (h, a) = (healed.clone(), attempts.clone());
    let heal = handler_fn(move |ctx| {
        let (h, a) = (h.clone(), a.clone());
        async move {
            a.record(&ctx.envelope.id, ctx.attempt);
            if !h.load(Ordering::SeqCst) {
                return Err(TaskError::retryable(format!(
                    "upstream down (attempt {})",
                    ctx.attempt
                )));
            }
            Ok(json!({"healed_on_attempt": ctx.attempt}))
        }
    });
    let w = start_worker(
        &ns,
        "w-heal",
        "case=heal",
        4,
        &FAST_RETRY,
        &[("heal", heal)],
    )
    .await?;
    let envs: Vec<_> = (1..=3)
        .map(|i| {
            let mut t = task("heal", json!({"n": i}), "");
            t.id = format!("heal-{i}-{}", ns.name);
            t.max_attempts = Some(2);
            t
        })
        .collect();
    ns.submit(&envs).await?;
    wait_dead(&ns, 3, Duration::from_secs(30)).await?;
    for e in &envs {
        assert_eq!(attempts.of(&e.id), vec![1, 2], "task {}", e.id);
    }

    let api = sched.url("");
    let (code, out, err) = fleetctl(&ns, &api, &["dead", "list"]).await?;
    assert_eq!(code, 0, "stderr: {err}");
    println!("{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert!(
        lines[0].starts_with("ID") && lines[0].contains("REASON"),
        "{out}"
    );
    assert_eq!(
        lines.len(),
        4,
        "a header and one row per dead letter:\n{out}"
    );
    for e in &envs {
        let row = lines
            .iter()
            .find(|l| l.starts_with(&e.id))
            .ok_or_else(|| anyhow::anyhow!("{} not listed:\n{out}", e.id))?;
        let cols: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(
            &cols[..5],
            &[e.id.as_str(), "heal", "max_attempts", "2", "w-heal"],
            "{row}"
        );
        assert!(row.contains("upstream down (attempt 2)"), "{row}");
    }
    // Listing does not consume.
    assert_eq!(ns.depth(&ns.names.dead_queue()).await, 3);
    let (code, out, err) = fleetctl(&ns, &api, &["dead", "list", "--limit", "1"]).await?;
    assert_eq!(code, 0);
    assert_eq!(out.lines().count(), 2, "{out}");
    assert!(err.contains("1 of 3 dead letters shown"), "{err}");

    // Upstream back: replay one task; it runs again from attempt 1 and succeeds.
    healed.store(true, Ordering::SeqCst);
    let (code, out, err) = fleetctl(&ns, &api, &["dead", "replay", &envs[0].id]).await?;
    assert_eq!((code, out.trim()), (0, "replayed=1"), "stderr: {err}");
    let st = ns
        .wait_state(&envs[0].id, "succeeded", Duration::from_secs(20))
        .await?;
    assert_eq!(st.get("attempt").map(String::as_str), Some("1"), "{st:?}");
    assert_eq!(
        st.get("result").map(String::as_str),
        Some(r#"{"healed_on_attempt":1}"#)
    );
    assert!(
        !st.contains_key("reason") && !st.contains_key("error"),
        "nothing left of the first life: {st:?}"
    );
    assert_eq!(attempts.of(&envs[0].id), vec![1, 2, 1]);
    let left: BTreeSet<String> = peek_dead(&ns)
        .await?
        .into_iter()
        .map(|d| d.env.id)
        .collect();
    assert_eq!(
        left,
        envs[1..]
            .iter()
            .map(|e| e.id.clone())
            .collect::<BTreeSet<_>>(),
        "the others stay dead"
    );

    // An id that is not there: exit 1, nothing replayed, nothing lost.
    let (code, out, err) = fleetctl(&ns, &api, &["dead", "replay", "no-such-task"]).await?;
    assert_eq!((code, out.trim()), (1, "replayed=0"));
    assert!(err.contains("no dead letter with id no-such-task"), "{err}");
    assert_eq!(ns.depth(&ns.names.dead_queue()).await, 2);

    // Replay the rest at once.
    let (code, out, err) = fleetctl(&ns, &api, &["dead", "replay", "--all"]).await?;
    assert_eq!((code, out.trim()), (0, "replayed=2"), "stderr: {err}");
    for e in &envs[1..] {
        ns.wait_state(&e.id, "succeeded", Duration::from_secs(20))
            .await?;
        assert_eq!(attempts.of(&e.id), vec![1, 2, 1], "task {}", e.id);
    }
    assert_eq!(
        ns.depth(&ns.names.dead_queue()).await,
        0,
        "the dead queue is empty"
    );
    let (code, out, _) = fleetctl(&ns, &api, &["dead", "list"]).await?;
    assert_eq!(
        (code, out.lines().count()),
        (0, 1),
        "only the header:\n{out}"
    );
    // Every task ran exactly its two failed attempts and one successful replay.
    assert_eq!(attempts.count(), 9);

    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
