//! Deadlines end to end: a task whose deadline has passed never runs — whether it is found
//! expired by the scheduler (at dispatch) or by the worker (after waiting in its group queue) —
//! and a run still going at its deadline is cut (the handler is cancelled and dropped) and ends
//! `expired`, not retried.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fleet_tests::*;
use fleet_worker::executor::handler_fn;
use serde_json::json;
use tokio_util::sync::CancellationToken;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn expired_tasks_never_run() -> anyhow::Result<()> {
    own_process!();
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let h = [("record", rec.handler())];
    let sched = start_scheduler(&ns, &[]).await?;
    // One slot in the group under test; an idle group beside it keeps the fleet's load (and
    // so the pressure) low while that slot is busy.
    let slow = "pool=slow";
    let w = start_worker(&ns, "w-slow", slow, 1, &[], &h).await?;
    let idle = start_worker(&ns, "w-idle", "pool=idle", 8, &[], &h).await?;

    // Expired on arrival: the scheduler dead-letters it at dispatch.
    let mut late = task("record", json!({}), slow);
    late.deadline = Some(chrono::Utc::now() - chrono::Duration::seconds(1));
    ns.submit(std::slice::from_ref(&late)).await?;
    let st = ns
        .wait_state(&late.id, "expired", Duration::from_secs(15))
        .await?;
    assert_eq!(
        st.get("reason").map(String::as_str),
        Some("expired"),
        "{st:?}"
    );
    assert_eq!(
        st.get("error").map(String::as_str),
        Some("deadline passed before dispatch")
    );

    // Expires while queued behind a 3 s task on the only slot: the worker drops it unrun.
    let blocker = task("record", json!({"ms": 3000}), slow);
    ns.submit(std::slice::from_ref(&blocker)).await?;
    wait_for("the blocker to start", Duration::from_secs(15), || async {
        (rec.count() == 1).then_some(())
    })
    .await?;
    let mut queued = task("record", json!({}), slow);
    queued.timeout_ms = Some(1000);
    ns.submit(std::slice::from_ref(&queued)).await?;
    let st = ns
        .wait_state(&queued.id, "expired", Duration::from_secs(15))
        .await?;
    assert_eq!(
        st.get("worker").map(String::as_str),
        Some("w-slow"),
        "expired at the worker: {st:?}"
    );
    assert_eq!(
        st.get("error").map(String::as_str),
        Some("deadline passed before the task started")
    );
    assert_eq!(st.get("reason").map(String::as_str), Some("expired"));
    ns.wait_state(&blocker.id, "succeeded", Duration::from_secs(10))
        .await?;

    let runs = rec.runs();
    assert_eq!(runs.len(), 1, "only the blocker ran: {runs:?}");
    assert_eq!(runs[0].0, blocker.id);
    let dead = wait_dead(&ns, 2, Duration::from_secs(10)).await?;
    for d in &dead {
        assert_eq!(
            d.header("x-fleet-reason"),
            Some("expired"),
            "{}: {:?}",
            d.env.id,
            d.headers
        );
    }
    let ids: std::collections::BTreeSet<_> = dead.iter().map(|d| d.env.id.clone()).collect();
    assert_eq!(
        ids,
        [late.id.clone(), queued.id.clone()].into_iter().collect()
    );

    // Counted as expired: once by the scheduler (group "none"), once in the worker's group.
    let b = sched.url("");
    assert_eq!(completed_at_least(&b, "none", "expired", 1).await?, 1);
    assert_eq!(
        completed_at_least(&b, &group_of(slow, "builtin"), "expired", 1).await?,
        1
    );
    assert_eq!(
        completed(&b, &group_of(slow, "builtin"), "succeeded").await?,
        1
    );

    // A copy of the succeeded blocker (same id) that arrives past its deadline is a duplicate:
    // its status stays `succeeded` and nothing is dead-lettered for it.
    let mut copy = blocker.clone();
    copy.deadline = Some(chrono::Utc::now() - chrono::Duration::seconds(1));
    ns.submit(std::slice::from_ref(&copy)).await?;
    wait_for(
        "the late copy dropped as a duplicate",
        Duration::from_secs(15),
        || async {
            let page = reqwest::get(format!("{}/metrics", sched.url("")))
                .await
                .ok()?
                .text()
                .await
                .ok()?;
            (metric_sum(&page, "fleet_tasks_duplicate_total", &[]) >= 1.0).then_some(())
        },
    )
    .await?;
    let st = ns.status(&blocker.id).await?.unwrap_or_default();
    assert_eq!(
        st.get("state").map(String::as_str),
        Some("succeeded"),
        "{st:?}"
    );
    assert_eq!(
        completed(&b, "none", "expired").await?,
        1,
        "the copy is not counted expired"
    );
    assert_eq!(
        ns.depth(&ns.names.dead_queue()).await,
        2,
        "the two expired letters only; the copy made none"
    );
    assert_eq!(rec.runs().len(), 1);

    w.stop().await?;
    idle.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// Records, when a run's future is dropped before it completed, whether its cancellation
/// token had fired by then.
struct DropWatch {
    log: Arc<Mutex<Vec<String>>>,
    cancel: CancellationToken,
    completed: bool,
}

impl Drop for DropWatch {
    fn drop(&mut self) {
        if !self.completed {
            if let Ok(mut l) = self.log.lock() {
                l.push(format!("dropped, cancelled={}", self.cancel.is_cancelled()));
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_past_its_deadline_is_cut_and_expires() -> anyhow::Result<()> {
    own_process!();
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let log: Arc<Mutex<Vec<String>>> = Arc::default();
    let starts = Attempts::default();
    let (l, s) = (log.clone(), starts.clone());
    let watch = handler_fn(move |ctx| {
        let (log, starts) = (l.clone(), s.clone());
        async move {
            starts.record(&ctx.envelope.id, ctx.attempt);
            let mut guard = DropWatch {
                log: log.clone(),
                cancel: ctx.cancel.clone(),
                completed: false,
            };
            tokio::time::sleep(Duration::from_secs(20)).await;
            guard.completed = true;
            if let Ok(mut l) = log.lock() {
                l.push("completed".into());
            }
            Ok(json!("slept 20 s"))
        }
    });
    let labels = "case=cut";
    let group = group_of(labels, "builtin");
    let w = start_worker(&ns, "w-cut", labels, 4, &[], &[("watch", watch)]).await?;

    let mut builtin = task("sleep", json!({"ms": 20_000}), labels);
    builtin.timeout_ms = Some(700);
    builtin.max_attempts = Some(3);
    let mut custom = task("watch", json!({}), labels);
    custom.timeout_ms = Some(700);
    custom.max_attempts = Some(3);
    let submitted = Instant::now();
    ns.submit(&[builtin.clone(), custom.clone()]).await?;

    for t in [&builtin, &custom] {
        let st = ns
            .wait_state(&t.id, "expired", Duration::from_secs(10))
            .await?;
        assert_eq!(
            st.get("error").map(String::as_str),
            Some("deadline reached during the run"),
            "{st:?}"
        );
        assert_eq!(
            st.get("attempt").map(String::as_str),
            Some("1"),
            "not retried: {st:?}"
        );
        assert_eq!(st.get("reason").map(String::as_str), Some("expired"));
        let ran_ms = st["finished_at"].parse::<i64>()? - st["started_at"].parse::<i64>()?;
        println!(
            "{}: ran {ran_ms} ms of a 20 s sleep before the 700 ms deadline cut it",
            t.kind
        );
        assert!(
            ran_ms < 2_000,
            "{} ran {ran_ms} ms: not cut at its deadline",
            t.kind
        );
    }
    let took = submitted.elapsed();
    println!("both expired {} ms after submission", took.as_millis());
    assert!(took < Duration::from_secs(8), "expiry took {took:?}");

    // The custom handler was cancelled, then dropped, and never got past its sleep.
    wait_for(
        "the cut run to be dropped",
        Duration::from_secs(5),
        || async { (!log.lock().ok()?.is_empty()).then_some(()) },
    )
    .await?;
    assert_eq!(
        *log.lock().map_err(|_| anyhow::anyhow!("poisoned"))?,
        vec!["dropped, cancelled=true".to_string()]
    );
    assert_eq!(
        starts.of(&custom.id),
        vec![1],
        "started once, never retried"
    );

    let dead = wait_dead(&ns, 2, Duration::from_secs(10)).await?;
    assert!(
        dead.iter()
            .all(|d| d.header("x-fleet-reason") == Some("expired")),
        "{dead:?}"
    );
    let b = format!("http://{}", w.addr);
    assert_eq!(completed_at_least(&b, &group, "expired", 2).await?, 2);
    assert_eq!(completed(&b, &group, "retried").await?, 0);
    assert_eq!(completed(&b, &group, "succeeded").await?, 0);

    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// A handler that blocks its thread (an embedder's synchronous code, not on `spawn_blocking`)
/// is still cut at its deadline: the handler runs in a task of its own, so the attempt's timer
/// fires on another thread while the handler's is blocked, and the task ends `expired` on time
/// — the cap that keeps every run under RabbitMQ's consumer timeout. (Run inside the attempt's
/// own task, the cut would wait for the handler to return.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_blocking_handler_is_cut_at_its_deadline() -> anyhow::Result<()> {
    const BLOCKS: Duration = Duration::from_secs(4);
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let blocking = handler_fn(|_ctx| async move {
        std::thread::sleep(BLOCKS);
        Ok(json!("blocked"))
    });
    let labels = "case=blocking";
    let w = start_worker(&ns, "w-blocking", labels, 2, &[], &[("block", blocking)]).await?;
    let mut t = task("block", json!({}), labels);
    t.timeout_ms = Some(500);
    t.max_attempts = Some(3);
    ns.submit(std::slice::from_ref(&t)).await?;
    let st = ns
        .wait_state(&t.id, "expired", Duration::from_secs(10))
        .await?;
    let ran_ms = st["finished_at"].parse::<i64>()? - st["started_at"].parse::<i64>()?;
    println!(
        "a handler blocking its thread for {} ms was cut after {ran_ms} ms (deadline 500 ms)",
        BLOCKS.as_millis()
    );
    assert!(
        ran_ms < 2_000,
        "ran {ran_ms} ms: the cut waited for the blocked handler"
    );
    assert_eq!(
        st.get("attempt").map(String::as_str),
        Some("1"),
        "not retried: {st:?}"
    );
    // The stop waits for the blocked thread to come back (an aborted task ends at its next
    // await, and this one has none until the sleep returns).
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
