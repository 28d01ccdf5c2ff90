//! A handler that panics: the attempt counts as a (retryable) failure with the panic message
//! as its error, the task is retried and then dead-lettered, and the worker keeps running —
//! later tasks on the same worker succeed. Covers a panic inside the handler's future and one
//! raised by the handler before it even returns its future.

use std::time::Duration;

use fleet_tests::*;
use fleet_worker::executor::{handler_fn, TaskError};
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_panicking_handler_fails_its_task_and_the_worker_carries_on() -> anyhow::Result<()> {
    own_process!();
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let attempts = Attempts::default();
    let a = attempts.clone();
    // Panics inside its future.
    let in_future = handler_fn(move |ctx| {
        let a = a.clone();
        async move {
            a.record(&ctx.envelope.id, ctx.attempt);
            if ctx.attempt > 0 {
                panic!("kaboom in attempt {}", ctx.attempt);
            }
            Ok::<Value, TaskError>(Value::Null)
        }
    });
    let b = attempts.clone();
    // Panics while building its future (a `Handler::call` that panics before returning).
    let before_future = handler_fn(move |ctx: fleet_worker::TaskContext| {
        b.record(&ctx.envelope.id, ctx.attempt);
        if ctx.attempt > 0 {
            panic!("kaboom before the future, attempt {}", ctx.attempt);
        }
        async { Ok::<Value, TaskError>(Value::Null) }
    });
    let labels = "case=panic";
    let group = group_of(labels, "builtin");
    let w = start_worker(
        &ns,
        "w-panic",
        labels,
        2,
        &[("retry_base_ms", "50"), ("retry_cap_ms", "200"), NO_EJECT],
        &[
            ("panic_in_future", in_future),
            ("panic_before_future", before_future),
        ],
    )
    .await?;

    let mut p1 = task("panic_in_future", json!({}), labels);
    p1.max_attempts = Some(2);
    let mut p2 = task("panic_before_future", json!({}), labels);
    p2.max_attempts = Some(2);
    ns.submit(&[p1.clone(), p2.clone()]).await?;

    let dead = wait_dead(&ns, 2, Duration::from_secs(30)).await?;
    for (t, msg) in [
        (&p1, "handler panicked: kaboom in attempt 2"),
        (&p2, "handler panicked: kaboom before the future, attempt 2"),
    ] {
        let d = dead
            .iter()
            .find(|d| d.env.id == t.id)
            .ok_or_else(|| anyhow::anyhow!("{} not dead", t.kind))?;
        assert_eq!(
            d.header("x-fleet-reason"),
            Some("max_attempts"),
            "{}: {:?}",
            t.kind,
            d.headers
        );
        assert_eq!(d.header("x-fleet-detail"), Some(msg));
        assert_eq!(d.header("x-fleet-attempts"), Some("2"));
        let st = ns
            .wait_state(&t.id, "dead", Duration::from_secs(10))
            .await?;
        assert_eq!(st.get("error").map(String::as_str), Some(msg));
        assert_eq!(
            attempts.of(&t.id),
            vec![1, 2],
            "{}: retried once after the panic",
            t.kind
        );
    }
    let m = format!("http://{}", w.addr);
    assert_eq!(completed_at_least(&m, &group, "retried", 2).await?, 2);
    assert_eq!(completed_at_least(&m, &group, "dead", 2).await?, 2);

    // The same worker goes on: 20 tasks after the panics all succeed there, and the worker
    // holds no phantom running task.
    let envs: Vec<_> = (0..20)
        .map(|i| task("echo", json!({"i": i}), labels))
        .collect();
    ns.submit(&envs).await?;
    for e in &envs {
        let st = ns
            .wait_state(&e.id, "succeeded", Duration::from_secs(20))
            .await?;
        assert_eq!(st.get("worker").map(String::as_str), Some("w-panic"));
    }
    assert_eq!(completed_at_least(&m, &group, "succeeded", 20).await?, 20);
    let status = wait_for(
        "the worker to report 4 failures and nothing running",
        Duration::from_secs(10),
        || async {
            let s = get_json(&format!("{m}/status")).await.ok()?;
            (s["running"] == 0 && s["failed"] == 4).then_some(s)
        },
    )
    .await?;
    assert_eq!(status["state"], "active", "{status}");
    assert!(status["succeeded"].as_u64() >= Some(20), "{status}");
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
