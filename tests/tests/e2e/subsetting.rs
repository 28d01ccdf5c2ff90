//! Sharded groups with deterministic subsetting (`FLEET_SHARDS`, `FLEET_SHARDS_PER_WORKER`):
//! ordinals are the lowest free in a group and reused, each worker consumes exactly the shards
//! the algorithm gives it, every shard keeps a consumer, and tasks run exactly once.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{Context, Result};
use fleet::broker::Subsetting;
use fleet::registry::{Registration, WorkerState};
use fleet::{Labels, Lane};
use fleet_tests::*;
use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use serde_json::json;

const SHARDS: &[(&str, &str)] = &[("shards", "12"), ("shards_per_worker", "3")];

/// Consumers of a queue right now (passive declare on a channel of its own).
async fn consumers(ns: &Ns, queue: &str) -> Result<u32> {
    let ch = ns.conn.create_channel().await?;
    let q = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .with_context(|| format!("queue {queue}"))?;
    let _ = ch.close(200, "ok".into()).await;
    Ok(q.consumer_count())
}

/// Consumers per shard queue, in shard order.
async fn consumers_per_shard(ns: &Ns, group: &str, shards: u32) -> Result<Vec<u32>> {
    let mut out = Vec::new();
    for q in ns.names.group_shard_queues(group, Lane::Normal, shards) {
        out.push(consumers(ns, &q).await?);
    }
    Ok(out)
}

/// The normal-lane queues a worker says it consumes (`GET /status`), sorted.
async fn consuming(w: &WorkerHandle) -> Option<Vec<String>> {
    let st = get_json(&format!("http://{}/status", w.addr)).await.ok()?;
    let mut q: Vec<String> = serde_json::from_value(st["consuming"]["normal"].clone()).ok()?;
    q.sort();
    Some(q)
}

/// Queue names of shards, sorted like [`consuming`].
fn queue_names(ns: &Ns, group: &str, shards: &[u32], of: u32) -> Vec<String> {
    let mut q: Vec<String> = shards
        .iter()
        .map(|&s| ns.names.group_shard_queue(group, Lane::Normal, s, of))
        .collect();
    q.sort();
    q
}

/// Waits until every worker consumes exactly what the algorithm assigns to the live ordinals.
async fn wait_for_assignment(
    ns: &Ns,
    group: &str,
    s: &Subsetting,
    workers: &[(&WorkerHandle, u32)],
) -> Result<()> {
    let live: Vec<u32> = workers.iter().map(|(_, o)| *o).collect();
    let assigned = s.assign(&live);
    for (w, ord) in workers {
        let want = queue_names(ns, group, &assigned[ord], s.shards());
        wait_for(
            &format!("{} (ordinal {ord}) to consume {want:?}", w.id),
            Duration::from_secs(20),
            || {
                let want = want.clone();
                async move { (consuming(w).await? == want).then_some(()) }
            },
        )
        .await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_workers_on_twelve_shards_run_5000_tasks_exactly_once() -> Result<()> {
    let ns = Ns::new().await?;
    let s = Subsetting::new(12, 3)?;
    let labels = "pool=hot";
    let group = "pool=hot,protocol=builtin";
    let rec = Recorder::default();
    let h = [("record", rec.handler())];
    let sched = start_scheduler(&ns, SHARDS).await?;
    let mut workers = Vec::new();
    for i in 0..10u32 {
        // One at a time: each takes the lowest free ordinal, so w00 → 0 … w09 → 9.
        workers.push(start_worker(&ns, &format!("w{i:02}"), labels, 8, SHARDS, &h).await?);
    }
    let table = ns.store.group_ordinals(group).await?;
    let want: BTreeMap<u32, String> = (0..10).map(|i| (i, format!("w{i:02}"))).collect();
    assert_eq!(
        table, want,
        "ordinals are the lowest free, in order of registration"
    );

    // Each worker consumes exactly its subset (ten workers cover every shard: no extra shards).
    let with_ord: Vec<(&WorkerHandle, u32)> = workers.iter().zip(0..).collect();
    wait_for_assignment(&ns, group, &s, &with_ord).await?;
    for (w, i) in &with_ord {
        let mut sub = s.subset(*i);
        sub.sort_unstable();
        assert_eq!(
            consuming(w).await,
            Some(queue_names(&ns, group, &sub, 12)),
            "{} consumes its subset",
            w.id
        );
    }
    // The broker agrees: consumers per shard are exactly the algorithm's (the book's 2 or 3).
    let mut expected = vec![0u32; 12];
    for i in 0..10 {
        for sh in s.subset(i) {
            expected[sh as usize] += 1;
        }
    }
    assert!(expected.iter().all(|&c| c == 2 || c == 3), "{expected:?}");
    assert_eq!(
        consumers_per_shard(&ns, group, 12).await?,
        expected,
        "consumers per shard"
    );
    // The unsharded queue name is not used by a sharded group.
    assert_eq!(
        ns.depth(&ns.names.group_queue(group, Lane::Normal)).await,
        0
    );

    let envs: Vec<_> = (0..5000)
        .map(|i| task("record", json!({"i": i}), labels))
        .collect();
    let (ok, refused) = ns.submit(&envs).await?;
    assert_eq!((ok, refused), (5000, 0));
    wait_for("5000 runs", Duration::from_secs(180), || async {
        (rec.count() >= 5000).then_some(())
    })
    .await?;
    // Every shard drained: nothing is stranded on a shard.
    wait_for(
        "every shard queue empty",
        Duration::from_secs(20),
        || async {
            for q in ns.names.group_shard_queues(group, Lane::Normal, 12) {
                if ns.depth(&q).await != 0 {
                    return None;
                }
            }
            Some(())
        },
    )
    .await?;
    // Barrier: queues empty and nothing reserved or running, so no further run can start.
    ns.wait_settled(Duration::from_secs(30)).await?;

    let per = rec.per_task();
    let ids: BTreeSet<&String> = envs.iter().map(|e| &e.id).collect();
    assert_eq!(per.len(), 5000, "every task ran");
    assert!(
        per.keys().all(|id| ids.contains(id)),
        "only submitted tasks ran"
    );
    assert_eq!(rec.count(), 5000, "no task ran twice");
    let mut by_worker: BTreeMap<String, usize> = BTreeMap::new();
    for runs in per.values() {
        *by_worker.entry(runs[0].clone()).or_default() += 1;
    }
    assert_eq!(by_worker.len(), 10, "every worker ran tasks: {by_worker:?}");

    for w in workers {
        w.stop().await?;
    }
    sched.stop().await?;
    // No worker left: every ordinal is free again.
    assert!(ns.store.group_ordinals(group).await?.is_empty());
    delete_shards(&ns, group).await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leavers_ordinal_goes_to_the_next_worker_and_no_shard_is_left_unconsumed() -> Result<()> {
    let ns = Ns::new().await?;
    let s = Subsetting::new(12, 3)?;
    let labels = "pool=few";
    let group = "pool=few,protocol=builtin";
    let rec = Recorder::default();
    let h = [("record", rec.handler())];
    let sched = start_scheduler(&ns, SHARDS).await?;
    let a = start_worker(&ns, "a", labels, 4, SHARDS, &h).await?;
    let b = start_worker(&ns, "b", labels, 4, SHARDS, &h).await?;
    let c = start_worker(&ns, "c", labels, 4, SHARDS, &h).await?;
    // Three workers, four subsets per round: the fourth subset is dealt out among them.
    wait_for_assignment(&ns, group, &s, &[(&a, 0), (&b, 1), (&c, 2)]).await?;
    assert_eq!(consumers_per_shard(&ns, group, 12).await?, vec![1; 12]);

    // b leaves: its ordinal is freed, a and c cover its shards.
    b.stop().await?;
    let table = ns.store.group_ordinals(group).await?;
    assert_eq!(
        table,
        BTreeMap::from([(0, "a".to_string()), (2, "c".to_string())])
    );
    wait_for_assignment(&ns, group, &s, &[(&a, 0), (&c, 2)]).await?;
    assert_eq!(consumers_per_shard(&ns, group, 12).await?, vec![1; 12]);

    // The next to join takes ordinal 1 again, and with it b's subset.
    let d = start_worker(&ns, "d", labels, 4, SHARDS, &h).await?;
    assert_eq!(
        ns.store
            .group_ordinals(group)
            .await?
            .get(&1)
            .map(String::as_str),
        Some("d")
    );
    wait_for_assignment(&ns, group, &s, &[(&a, 0), (&d, 1), (&c, 2)]).await?;
    let d_has: BTreeSet<String> = consuming(&d)
        .await
        .unwrap_or_default()
        .into_iter()
        .collect();
    for q in queue_names(&ns, group, &s.subset(1), 12) {
        assert!(
            d_has.contains(&q),
            "d consumes b's old subset shard {q}: {d_has:?}"
        );
    }

    let envs: Vec<_> = (0..300)
        .map(|i| task("record", json!({"i": i}), labels))
        .collect();
    assert_eq!(ns.submit(&envs).await?, (300, 0));
    wait_for("300 runs", Duration::from_secs(60), || async {
        (rec.count() >= 300).then_some(())
    })
    .await?;
    // Barrier: queues empty and nothing reserved or running, so no further run can start.
    ns.wait_settled(Duration::from_secs(30)).await?;
    assert_eq!(rec.per_task().len(), 300);
    assert_eq!(rec.count(), 300, "no task ran twice");
    for q in ns.names.group_shard_queues(group, Lane::Normal, 12) {
        assert_eq!(ns.depth(&q).await, 0, "{q} drained");
    }

    for w in [a, c, d] {
        w.stop().await?;
    }
    sched.stop().await?;
    delete_shards(&ns, group).await?;
    ns.cleanup().await
}

/// Ordinals straight through the registry scripts: lowest free, reused, freed by eviction too.
#[tokio::test]
async fn ordinals_are_lowest_free_and_freed_by_deregistration_and_eviction() -> Result<()> {
    let ns = Ns::new().await?;
    let labels = Labels::parse("pool=x")?;
    let reg = |id: &str| Registration {
        id: id.to_string(),
        instance: format!("inst-{id}"),
        labels: labels.clone(),
        capacity: 1,
        critical_capacity: 1,
        executor: "builtin".into(),
        state: WorkerState::Active,
        kinds: Default::default(),
    };
    let group = labels.group_name();
    for id in ["a", "b", "c"] {
        ns.store.register(&reg(id), Duration::from_secs(60)).await?;
    }
    let ord = |m: BTreeMap<u32, String>| {
        m.into_iter()
            .map(|(o, id)| (id, o))
            .collect::<BTreeMap<String, u32>>()
    };
    let want = |p: &[(&str, u32)]| {
        p.iter()
            .map(|(id, o)| (id.to_string(), *o))
            .collect::<BTreeMap<String, u32>>()
    };
    assert_eq!(
        ord(ns.store.group_ordinals(&group).await?),
        want(&[("a", 0), ("b", 1), ("c", 2)])
    );
    // Registering again (e.g. after a lost heartbeat) keeps the ordinal.
    ns.store
        .register(&reg("a"), Duration::from_secs(60))
        .await?;
    assert_eq!(
        ord(ns.store.group_ordinals(&group).await?),
        want(&[("a", 0), ("b", 1), ("c", 2)])
    );
    assert!(ns.store.deregister("b", "inst-b").await?);
    assert_eq!(
        ord(ns.store.group_ordinals(&group).await?),
        want(&[("a", 0), ("c", 2)])
    );
    ns.store
        .register(&reg("d"), Duration::from_secs(60))
        .await?;
    ns.store
        .register(&reg("e"), Duration::from_secs(60))
        .await?;
    assert_eq!(
        ord(ns.store.group_ordinals(&group).await?),
        want(&[("a", 0), ("c", 2), ("d", 1), ("e", 3)])
    );
    // Eviction (every worker silent past a 1 ms timeout) frees every ordinal.
    scenario_pause(
        Duration::from_millis(5),
        "every worker silent past the 1 ms timeout",
    )
    .await;
    let mut evicted = ns.store.evict_stale(Duration::from_millis(1)).await?;
    evicted.sort();
    assert_eq!(evicted, vec!["a", "c", "d", "e"]);
    assert!(ns.store.group_ordinals(&group).await?.is_empty());
    ns.store
        .register(&reg("f"), Duration::from_secs(60))
        .await?;
    assert_eq!(
        ord(ns.store.group_ordinals(&group).await?),
        want(&[("f", 0)])
    );
    ns.cleanup().await
}

/// Deletes a sharded group's shard queues (`Ns::cleanup` knows only unsharded names).
async fn delete_shards(ns: &Ns, group: &str) -> Result<()> {
    let ch = ns.conn.create_channel().await?;
    fleet::broker::topology::delete_all_sharded(&ch, &ns.names, &[group.to_string()], 12).await?;
    Ok(())
}

/// Issue 30 item 8: a draining worker hands its shards on at once. `FLEET_SHARDS=4`,
/// `FLEET_SHARDS_PER_WORKER=2`, two workers; one is told to drain (as SIGTERM) while it runs a
/// long task (held by a gate). Its ordinal is freed when it stops consuming — not when it
/// deregisters after the task — so its peer takes all four shards and 12 short tasks submitted
/// then all run on the peer while the long task still runs on the draining worker. (Before: 6
/// of them sat in the draining worker's two shards until it left.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_draining_worker_hands_its_shards_to_its_peers_at_once() -> Result<()> {
    const FOUR: &[(&str, &str)] = &[
        ("shards", "4"),
        ("shards_per_worker", "2"),
        ("drain_grace_ms", "60000"),
    ];
    let ns = Ns::new().await?;
    let s = Subsetting::new(4, 2)?;
    let labels = "pool=drain";
    let group = "pool=drain,protocol=builtin";
    let rec = Recorder::default();
    let gate = Gate::default();
    let (ran_on_tx, mut ran_on) = tokio::sync::mpsc::unbounded_channel::<String>();
    let hold = {
        let gate = gate.clone();
        fleet_worker::executor::handler_fn(move |ctx| {
            let (gate, tx) = (gate.clone(), ran_on_tx.clone());
            async move {
                let _ = tx.send(ctx.worker_id.to_string());
                gate.pass(&ctx.envelope.id).await;
                Ok(json!({}))
            }
        })
    };
    let h = [("record", rec.handler()), ("hold", hold)];
    let sched = start_scheduler(&ns, FOUR).await?;
    let a = start_worker(&ns, "a", labels, 2, FOUR, &h).await?;
    let b = start_worker(&ns, "b", labels, 2, FOUR, &h).await?;
    wait_for_assignment(&ns, group, &s, &[(&a, 0), (&b, 1)]).await?;

    let long = task("hold", json!({}), labels);
    ns.submit(std::slice::from_ref(&long)).await?;
    let on = tokio::time::timeout(Duration::from_secs(20), ran_on.recv())
        .await
        .context("the long task did not start")?
        .context("handler gone")?;
    let (draining, peer) = if on == "a" { (a, b) } else { (b, a) };
    let peer_ord = if peer.id == "a" { 0 } else { 1 };
    draining.shutdown.cancel();
    wait_for("the worker draining", Duration::from_secs(10), || async {
        worker(&ns.store, &draining.id)
            .await
            .filter(|w| w.state == "draining")
    })
    .await?;
    let short: Vec<_> = (0..12)
        .map(|i| task("record", json!({"i": i}), labels))
        .collect();
    assert_eq!(ns.submit(&short).await?, (12, 0));
    let ids: Vec<String> = short.iter().map(|t| t.id.clone()).collect();
    let (all, last) = wait_all_in(&ns, &ids, "succeeded", Duration::from_secs(15)).await?;
    let waiting: Vec<_> = last.iter().filter(|(_, s)| *s != "succeeded").collect();
    assert!(
        all,
        "short tasks still waiting while the draining worker finishes: {waiting:?}"
    );
    // The long task still runs on the draining worker: nothing waited for it to leave.
    let st = ns.status(&long.id).await?.unwrap_or_default();
    assert_eq!(
        st.get("state").map(String::as_str),
        Some("running"),
        "{st:?}"
    );
    assert_eq!(
        st.get("worker").map(String::as_str),
        Some(draining.id.as_str())
    );
    let runs = rec.runs();
    assert_eq!(runs.len(), 12, "each short task ran once: {runs:?}");
    assert!(
        runs.iter().all(|(_, w, _)| *w == peer.id),
        "every short task ran on the peer: {runs:?}"
    );
    // How: its ordinal went when it stopped consuming, and the peer consumes every shard.
    let table = ns.store.group_ordinals(group).await?;
    assert_eq!(table, BTreeMap::from([(peer_ord, peer.id.clone())]));
    wait_for_assignment(&ns, group, &s, &[(&peer, peer_ord)]).await?;

    gate.open(&long.id);
    tokio::time::timeout(Duration::from_secs(30), draining.join)
        .await
        .context("the drain did not end")???;
    ns.wait_state(&long.id, "succeeded", Duration::from_secs(10))
        .await?;
    peer.stop().await?;
    sched.stop().await?;
    delete_shards_of(&ns, group, 4).await?;
    ns.cleanup().await
}

/// Deletes a sharded group's `shards` shard queues.
async fn delete_shards_of(ns: &Ns, group: &str, shards: u32) -> Result<()> {
    let ch = ns.conn.create_channel().await?;
    fleet::broker::topology::delete_all_sharded(&ch, &ns.names, &[group.to_string()], shards)
        .await?;
    Ok(())
}
