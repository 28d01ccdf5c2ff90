//! A task that outlives RabbitMQ's `consumer_timeout` (issue 10 §4), on a private RabbitMQ node
//! (`consumer_timeout = 3000`; RabbitMQ 3.10 checks it on the channel tick, every
//! `channel_tick_interval` = 60 s by default, so the node also gets a 500 ms tick). An 8 s task
//! at the default `FLEET_MAX_TASK_MS`: the broker closes the worker's channel and redelivers
//! while the first run goes on; the redelivered copies wait on the run record and are acked as
//! duplicates. Exactly one start, status `succeeded` attempt 1, nothing dead-lettered, never
//! two runs at once.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fleet_tests::*;
use fleet_worker::executor::{handler_fn, Handler};
use serde_json::json;

#[derive(Default)]
struct Runs {
    running: AtomicU32,
    peak: AtomicU32,
    starts: Mutex<Vec<(String, String, u32, Instant)>>,
}

fn long_handler(runs: Arc<Runs>) -> Arc<dyn Handler> {
    handler_fn(move |ctx| {
        let runs = runs.clone();
        async move {
            if let Ok(mut s) = runs.starts.lock() {
                s.push((
                    ctx.envelope.id.clone(),
                    ctx.worker_id.to_string(),
                    ctx.attempt,
                    Instant::now(),
                ));
            }
            let now = runs.running.fetch_add(1, Ordering::SeqCst) + 1;
            runs.peak.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(8_000)).await;
            runs.running.fetch_sub(1, Ordering::SeqCst);
            Ok(json!({"slept_ms": 8000}))
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn task_longer_than_consumer_timeout_runs_once() -> anyhow::Result<()> {
    own_process!();
    let rabbit = PrivateRabbit::start(
        "consumer_timeout = 3000",
        "[{rabbit, [{channel_tick_interval, 500}]}].\n",
    )
    .await?;
    let ns = Ns::on_broker(&rabbit.url()).await?;
    let runs = Arc::new(Runs::default());
    let h = [("long", long_handler(runs.clone()))];
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    // Two workers with room for more than one run each: a redelivered copy could start at once.
    let w1 = start_worker(&ns, "w-1", "", 2, WORKER, &h).await?;
    let w2 = start_worker(&ns, "w-2", "", 2, WORKER, &h).await?;

    let env = task("long", json!({}), "");
    let id = env.id.clone();
    let published = Instant::now();
    assert_eq!(ns.submit(&[env]).await?, (1, 0));
    let st = ns
        .wait_state(&id, "succeeded", Duration::from_secs(40))
        .await?;
    let done_after = published.elapsed();
    // Watch a while longer: no copy may start after the success either. Longer than the
    // broker's 3 s consumer timeout, so a timeout fired by a copy still held would show.
    quiet_for(
        Duration::from_secs(4),
        "no copy starts after the success, past one more consumer timeout",
    )
    .await;
    let timeouts = rabbit
        .log()
        .matches("delivery acknowledgement on channel")
        .count();
    let starts = runs.starts.lock().map(|s| s.clone()).unwrap_or_default();
    let dead = ns.drain_dead().await?;
    let dups = metric(
        &format!("http://{}/metrics", w1.addr),
        "fleet_tasks_duplicate_deliveries_total",
        &[],
    )
    .await?;
    println!(
        "consumer timeout (3 s, 8 s task): succeeded after {:.1} s; broker consumer timeouts {timeouts}; starts {} {:?}; \
         peak concurrent runs {}; status {:?} attempt {:?}; duplicate deliveries acked {dups}; dead letters {}",
        done_after.as_secs_f64(),
        starts.len(),
        starts.iter().map(|(_, w, a, at)| (w.clone(), *a, at.duration_since(published).as_millis())).collect::<Vec<_>>(),
        runs.peak.load(Ordering::SeqCst),
        st.get("state"),
        st.get("attempt"),
        dead.len()
    );
    assert!(
        timeouts >= 1,
        "the broker's consumer timeout fired (else this test proves nothing); node log:\n{}",
        rabbit.log_tail()
    );
    assert_eq!(starts.len(), 1, "exactly one start");
    assert_eq!(starts[0].2, 1, "as attempt 1");
    assert_eq!(
        runs.peak.load(Ordering::SeqCst),
        1,
        "never two runs at once"
    );
    assert_eq!(st.get("attempt").map(String::as_str), Some("1"));
    assert!(dead.is_empty(), "nothing dead-lettered");
    assert!(dups >= 1.0, "the redelivered copy was acked as a duplicate");
    let q = ns
        .names
        .group_queue("protocol=builtin", fleet::Lane::Normal);
    wait_for("the group queue empty", Duration::from_secs(15), || async {
        (ns.depth(&q).await == 0).then_some(())
    })
    .await?;

    w1.stop().await?;
    w2.stop().await?;
    sched.stop().await?;
    ns.cleanup().await?;
    drop(rabbit);
    Ok(())
}
