//! Outlier ejection: a worker whose handler fails every task ejects itself (state `ejected` in
//! `/v1/workers`, its capacity out of the group), its peer takes the work (retries included),
//! and after the cool-down it is `active` again and takes tasks again.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use fleet::Envelope;
use fleet_tests::*;
use fleet_worker::{handler_fn, TaskError};
use serde_json::{json, Value};

const COOLDOWN_MS: u64 = 4000;

fn worker_state(workers: &Value, id: &str) -> Option<Value> {
    workers.as_array()?.iter().find(|w| w["id"] == id).cloned()
}

fn batch(n: usize, from: usize) -> Vec<Envelope> {
    (0..n)
        .map(|i| {
            let mut e = task(JOB, json!({"i": from + i, "ms": 100}), "pool=ej");
            e.max_attempts = Some(20);
            e
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failing_worker_is_ejected_and_returns_after_the_cooldown() -> anyhow::Result<()> {
    own_process!();
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let broken = Arc::new(AtomicBool::new(true));
    let failed: Arc<Mutex<Vec<String>>> = Arc::default();
    let bad_handler = {
        let (ok, broken, failed) = (rec.handler(), broken.clone(), failed.clone());
        handler_fn(move |ctx| {
            let (ok, broken, failed) = (ok.clone(), broken.clone(), failed.clone());
            async move {
                if broken.load(Ordering::SeqCst) {
                    if let Ok(mut f) = failed.lock() {
                        f.push(ctx.envelope.id.clone());
                    }
                    return Err(TaskError::retryable("disk on fire"));
                }
                ok.call(ctx).await
            }
        })
    };
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let retry: &[(&str, &str)] = &[("retry_base_ms", "50"), ("retry_cap_ms", "200")];
    let mut bad_cfg: Vec<(&str, &str)> = WORKER.to_vec();
    bad_cfg.extend_from_slice(retry);
    let cooldown = COOLDOWN_MS.to_string();
    bad_cfg.extend_from_slice(&[
        ("eject_window", "4"),
        ("eject_min_samples", "4"),
        ("eject_error_ratio", "0.5"),
        ("eject_cooldown_ms", cooldown.as_str()),
    ]);
    let mut good_cfg: Vec<(&str, &str)> = WORKER.to_vec();
    good_cfg.extend_from_slice(retry);
    let bad = start_worker(&ns, "w-bad", "pool=ej", 2, &bad_cfg, &[(JOB, bad_handler)]).await?;
    let good = start_worker(
        &ns,
        "w-good",
        "pool=ej",
        2,
        &good_cfg,
        &[(JOB, rec.handler())],
    )
    .await?;
    let gname = "pool=ej,protocol=builtin";
    wait_for("group capacity 4", Duration::from_secs(10), || async {
        group(&ns.store, gname).await.filter(|g| g.capacity == 4)
    })
    .await?;
    let metrics_url = format!("http://{}/metrics", bad.addr);
    let ejections_before = metric(&metrics_url, "fleet_worker_ejections_total", &[]).await?;

    let first = batch(20, 0);
    assert_eq!(ns.submit(&first).await?, (20, 0));
    let workers_url = sched.url("/v1/workers");
    // `seen`: when the request that first answered "ejected" was sent (its answer may come
    // late on a loaded machine; the cool-down is measured from the ejection, not the answer).
    let seen = wait_for(
        "w-bad ejected in /v1/workers",
        Duration::from_secs(20),
        || async {
            let asked = Instant::now();
            let ws = get_json(&workers_url).await.ok()?;
            (worker_state(&ws, "w-bad")?["state"] == "ejected").then_some(asked)
        },
    )
    .await?;
    // Ejected: alive and registered, but its capacity is out of the group.
    let g = group(&ns.store, gname).await.context("group")?;
    assert_eq!((g.workers, g.capacity), (2, 2));
    let fails = failed.lock().map(|f| f.len()).unwrap_or(0);
    assert!(
        fails >= 4,
        "ejected after {fails} failures; needs the minimum of 4 samples"
    );

    // The peer does all the work, retries included; nothing dies.
    let want: HashSet<String> = first.iter().map(|e| e.id.clone()).collect();
    wait_succeeded(
        &ns,
        &first.iter().map(|e| e.id.clone()).collect::<Vec<_>>(),
        Duration::from_secs(30),
    )
    .await?;
    assert!(
        seen.elapsed() < Duration::from_millis(COOLDOWN_MS),
        "the work finished during the cool-down"
    );
    let per = rec.per_task();
    assert_eq!(per.keys().cloned().collect::<HashSet<_>>(), want);
    for (id, ws) in &per {
        assert_eq!(ws, &vec!["w-good".to_string()], "task {id}");
    }
    let failed_ids: HashSet<String> = failed
        .lock()
        .map(|f| f.iter().cloned().collect())
        .unwrap_or_default();
    assert!(failed_ids.is_subset(&want));
    let fails = failed.lock().map(|f| f.len()).unwrap_or(0);
    // The registry shows the failures (after a heartbeat).
    wait_for(
        "w-bad's failures in /v1/workers",
        Duration::from_secs(5),
        || async {
            let ws = get_json(&workers_url).await.ok()?;
            let w = worker_state(&ws, "w-bad")?;
            // Failed runs show as the outcome they had: retried (the peer then ran them).
            (w["retried"] == fails as u64 && w["succeeded"] == 0).then_some(())
        },
    )
    .await?;
    for id in &failed_ids {
        let st = ns.status(id).await?.unwrap_or_default();
        assert_eq!(
            st.get("state").map(String::as_str),
            Some("succeeded"),
            "{id}: {st:?}"
        );
        assert_eq!(st.get("worker").map(String::as_str), Some("w-good"));
    }

    // Back after the cool-down.
    let active = wait_for("w-bad active again", Duration::from_secs(15), || async {
        let ws = get_json(&workers_url).await.ok()?;
        (worker_state(&ws, "w-bad")?["state"] == "active").then(Instant::now)
    })
    .await?;
    let ejected_for = active - seen;
    println!(
        "ejection: after {fails} failures; ejected for {} ms (cool-down {COOLDOWN_MS} ms)",
        ejected_for.as_millis()
    );
    assert!(
        ejected_for + Duration::from_millis(300) >= Duration::from_millis(COOLDOWN_MS),
        "back early: {ejected_for:?}"
    );
    let g = wait_for("capacity back to 4", Duration::from_secs(5), || async {
        group(&ns.store, gname).await.filter(|g| g.capacity == 4)
    })
    .await?;
    assert_eq!(g.workers, 2);
    assert_eq!(
        metric(&metrics_url, "fleet_worker_ejections_total", &[]).await? - ejections_before,
        1.0,
        "ejected once"
    );

    // Healthy again, it takes its share of new work.
    broken.store(false, Ordering::SeqCst);
    let second = batch(12, 100);
    assert_eq!(ns.submit(&second).await?, (12, 0));
    wait_succeeded(
        &ns,
        &second.iter().map(|e| e.id.clone()).collect::<Vec<_>>(),
        Duration::from_secs(30),
    )
    .await?;
    let per = rec.per_task();
    assert_eq!(per.len(), 32);
    assert!(
        per.values().all(|w| w.len() == 1),
        "each task succeeded once"
    );
    let on_bad = second.iter().filter(|e| per[&e.id][0] == "w-bad").count();
    println!("ejection: w-bad ran {on_bad} of 12 tasks after coming back");
    assert!(on_bad >= 1, "the returned worker takes work");
    assert!(ns.drain_dead().await?.is_empty(), "no task dead-lettered");

    bad.stop().await?;
    good.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// `draining` is final in Redis: once an operator's drain is recorded, neither an ejection that
/// trips before the worker saw the drain nor a heartbeat correcting the state from an older
/// read can turn it back (the drain was lost: after the cool-down the worker went back to
/// `active`). The write answers `draining`, which makes the worker drain; the group's capacity
/// does not move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_in_redis_outlasts_ejection_and_state_corrections() -> anyhow::Result<()> {
    use fleet::registry::WorkerState;
    let ns = Ns::new().await?;
    let g = fleet::Labels::parse("pool=final")?.group_name();
    register_worker(&ns.store, "w-final", "pool=final", 2).await?;
    let capacity = || async { group(&ns.store, &g).await.map(|g| g.capacity) };
    assert_eq!(capacity().await, Some(2));
    assert_eq!(
        ns.store.set_state("w-final", WorkerState::Draining).await?,
        Some(WorkerState::Active)
    );
    assert_eq!(capacity().await, Some(0));
    // The worker's own writes, as the ejection and the heartbeat's correction make them.
    for own in [WorkerState::Ejected, WorkerState::Active] {
        assert_eq!(
            ns.store.set_state("w-final", own).await?,
            Some(WorkerState::Draining),
            "writing {own:?}"
        );
        assert_eq!(
            ns.store.worker_state("w-final").await?,
            Some(WorkerState::Draining),
            "after writing {own:?}"
        );
        assert_eq!(capacity().await, Some(0), "capacity after writing {own:?}");
    }
    // The ejection's own script refuses a worker that is not active.
    assert_eq!(ns.store.try_eject("w-final").await?, None);
    ns.cleanup().await
}
