//! Tasks with no matching worker (issue 10 §6): they wait in a bounded place, count as
//! pending (so producers are refused once it is full), say `waiting_for_worker`, start within
//! 1 s of a matching worker registering, and are dead-lettered `no_matching_worker` after the
//! grace.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use anyhow::Context;
use fleet::Envelope;
use fleet_tests::*;
use serde_json::{json, Value};

const KIND: &str = "rec";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_worker_backlog_is_bounded_and_released() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let sched =
        start_scheduler(&ns, &[("ingress_max_normal", "100"), ("max_pending", "60")]).await?;

    // Offer 2,000 tasks for a worker that does not exist, 100 at a time.
    let mut accepted: Vec<String> = Vec::new();
    let mut refused = 0usize;
    for _ in 0..20 {
        let envs: Vec<Envelope> = (0..100)
            .map(|i| task(KIND, json!({"i": i}), "zone=x"))
            .collect();
        for (e, ok) in envs.iter().zip(ns.submit_each(&envs).await?) {
            if ok {
                accepted.push(e.id.clone());
            } else {
                refused += 1;
            }
        }
        scenario_pause(Duration::from_millis(100), "the pace of the offered load").await;
    }
    let waiting_q = format!("{}.park._unmatched.normal", ns.name);
    let waiting = ns.depth(&waiting_q).await;
    let ingress = ns.depth(&ns.names.ingress_queue(fleet::Lane::Normal)).await;
    println!("no worker: offered 2000, accepted {}, refused {refused}; waiting queue {waiting}, ingress {ingress}", accepted.len());
    assert!(
        refused > 0,
        "producers are refused once the backlog is full"
    );
    // Pending bound 60 (Red at 90% = 54 waiting) + the ingress bound 100 + what a paused
    // intake returns to it (4 loops × at most 100 prefetched) + what the waiting queue's
    // release loop holds unacked (at most one batch, 256) + one sampling interval's slack.
    assert!(
        accepted.len() <= 54 + 100 + 400 + 256 + 100,
        "backlog bounded: {} accepted",
        accepted.len()
    );
    assert!(waiting > 0, "tasks wait in {waiting_q}");
    let mut states: std::collections::BTreeMap<String, usize> = Default::default();
    for id in &accepted {
        let st = ns.status(id).await?.unwrap_or_default();
        *states
            .entry(st.get("state").cloned().unwrap_or_else(|| "(none)".into()))
            .or_default() += 1;
    }
    println!("no worker: statuses {states:?}");
    assert!(
        states.get("waiting_for_worker").copied().unwrap_or(0) >= waiting as usize,
        "every waiting task says so: {states:?}"
    );
    assert!(!states.contains_key("delayed"), "not `delayed`: {states:?}");
    // Every accepted task is accounted for, exactly: waiting for a worker (in the waiting
    // queue, or held by its release loop: at most one batch of 256) or still in ingress,
    // unread and without a status (the intake stopped at Red).
    let waiting_for_worker = states.get("waiting_for_worker").copied().unwrap_or(0);
    let unread = states.get("(none)").copied().unwrap_or(0);
    assert_eq!(
        states.len(),
        [waiting_for_worker, unread]
            .iter()
            .filter(|n| **n > 0)
            .count(),
        "no other state: {states:?}"
    );
    assert_eq!(waiting_for_worker + unread, accepted.len(), "{states:?}");
    assert_eq!(
        unread, ingress as usize,
        "the unread ones are the ingress queue's"
    );
    assert!(
        waiting_for_worker <= waiting as usize + 256,
        "waiting {waiting_for_worker}: {waiting} in {waiting_q} + at most 256 held"
    );
    let p = get_json(&sched.url("/v1/pressure")).await?;
    println!("no worker: pressure {p}");
    // The backlog is pending work (60 allowed): Red, and the intake gate shut.
    assert_eq!(p["state"], "red", "{p}");
    assert_eq!(p["gate"], "red", "{p}");
    assert_eq!(
        p["pending"].as_u64(),
        Some(p["parked"].as_u64().unwrap_or(0) + p["ingress_backlog"].as_u64().unwrap_or(0)),
        "{p}"
    );
    assert!(
        p["pending"].as_u64().unwrap_or(0) >= 54,
        "pending at or past Red (0.9 × 60): {p}"
    );

    // A matching worker registers: the waiting tasks start within 1 s.
    let rec = Recorder::default();
    let w = start_worker(&ns, "w-x", "zone=x", 8, &[], &[(KIND, rec.handler())]).await?;
    let registered = Instant::now();
    wait_for(
        "a waiting task started",
        Duration::from_secs(10),
        || async { (rec.count() > 0).then_some(()) },
    )
    .await?;
    let took = registered.elapsed();
    println!("no worker: first waiting task started {} ms after the matching worker was registered and ready", took.as_millis());
    assert!(
        took <= Duration::from_secs(1),
        "released within 1 s, took {took:?}"
    );
    let n = accepted.len();
    wait_for(
        "every accepted task ran",
        Duration::from_secs(120),
        || async { (rec.per_task().len() >= n).then_some(()) },
    )
    .await?;
    let ran: HashSet<String> = rec.per_task().into_keys().collect();
    assert_eq!(
        ran,
        accepted.iter().cloned().collect::<HashSet<_>>(),
        "accepted = ran"
    );
    assert_eq!(rec.count(), n, "none ran twice");
    assert!(ns.drain_dead().await?.is_empty());
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_worker_after_the_grace_is_dead_lettered() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &[("no_match_grace_ms", "2000")]).await?;
    let envs: Vec<Envelope> = (0..5)
        .map(|i| task(KIND, json!({"i": i}), "zone=x"))
        .collect();
    let ids: HashSet<String> = envs.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ns.submit(&envs).await?, (5, 0));
    for id in &ids {
        ns.wait_state(id, "waiting_for_worker", Duration::from_secs(10))
            .await?;
    }
    let taken = std::sync::Mutex::new(Vec::new());
    wait_for_every(
        "5 tasks dead-lettered",
        Duration::from_secs(30),
        Duration::from_millis(50),
        || async {
            let more = ns.drain_dead().await.ok()?;
            let mut taken = taken.lock().ok()?;
            taken.extend(more);
            (taken.len() >= 5).then_some(())
        },
    )
    .await
    .with_context(|| format!("got {}", taken.lock().map(|t| t.len()).unwrap_or(0)))?;
    let dead = taken
        .into_inner()
        .map_err(|_| anyhow::anyhow!("poisoned"))?;
    assert_eq!(dead.len(), 5);
    let got: HashSet<String> = dead
        .iter()
        .filter_map(|(b, _)| {
            serde_json::from_slice::<Value>(b)
                .ok()?
                .get("id")?
                .as_str()
                .map(str::to_string)
        })
        .collect();
    assert_eq!(got, ids);
    assert!(
        dead.iter()
            .all(|(_, r)| r.as_deref() == Some("no_matching_worker")),
        "{:?}",
        dead.iter().map(|d| &d.1).collect::<Vec<_>>()
    );
    for id in &ids {
        let st = ns.wait_state(id, "dead", Duration::from_secs(5)).await?;
        assert_eq!(
            st.get("reason").map(String::as_str),
            Some("no_matching_worker")
        );
    }
    println!("no worker: 5 of 5 dead-lettered no_matching_worker after a 2 s grace");
    sched.stop().await?;
    ns.cleanup().await
}
