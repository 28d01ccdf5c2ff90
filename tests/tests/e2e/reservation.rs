//! The reservation script under concurrency: many concurrent reservations (as from several
//! scheduler replicas) against a small capacity never exceed it, read from Redis throughout.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;

use fleet::registry::WorkerState;
use fleet::route::Dedupe;
use fleet::route::Reservation;
use fleet::route::{ReserveParams, ReserveRequest};
use fleet::task::Strategy;
use fleet::{Labels, Lane, Store};
use fleet_tests::{redis_url, register_worker, Ns};

fn params() -> ReserveParams {
    ReserveParams {
        lease_ms: 60_000,
        backlog_factor: 0.0,
        strategy: Strategy::LeastLoaded,
        dedupe_window_ms: 60_000,
        status_ttl_ms: 60_000,
        token: rand::random(),
        direct: false,
        park_flag_ttl_ms: 3000,
    }
}

fn req(id: String, dedupe: Dedupe) -> ReserveRequest {
    ReserveRequest {
        id,
        lane: Lane::Normal,
        selector: Labels::parse("gpu=true").unwrap(),
        kind: "echo".into(),
        strategy: None,
        dedupe,
        from_park: false,
        dedupe_only: false,
        key: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_reservations_never_exceed_capacity() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    // Capacity 10 in one group (two workers, 6 + 4).
    register_worker(&ns.store, "w1", "gpu=true,protocol=builtin", 6).await?;
    register_worker(&ns.store, "w2", "gpu=true,protocol=builtin", 4).await?;
    let group = "gpu=true,protocol=builtin".to_string();

    // A watcher reads the outstanding count from Redis throughout.
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU32::new(0));
    let watcher = {
        let (stop, peak) = (stop.clone(), peak.clone());
        let store = ns.store.clone();
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                if let Ok(g) = store.groups().await {
                    let n = g.iter().map(|g| g.reserved + g.load).sum::<u32>();
                    peak.fetch_max(n, Ordering::Relaxed);
                }
            }
        })
    };

    // 4 "schedulers" (separate stores = separate connection pools) × 200 concurrent calls.
    let mut handles = Vec::new();
    for s in 0..4 {
        let store = Store::new(&redis_url(), ns.names.clone())?;
        for k in 0..200 {
            let store = store.clone();
            handles.push(tokio::spawn(async move {
                store
                    .reserve(&[req(format!("s{s}-t{k}"), Dedupe::Check)], params())
                    .await
            }));
        }
    }
    let mut reserved = 0;
    let mut full = 0;
    for h in handles {
        match h.await??.pop() {
            Some(Reservation::Reserved(g)) => {
                assert_eq!(g, group);
                reserved += 1
            }
            Some(Reservation::Full(_)) => full += 1,
            other => anyhow::bail!("unexpected answer {other:?}"),
        }
    }
    stop.store(true, Ordering::Relaxed);
    watcher.await?;
    assert_eq!(reserved, 10, "exactly the capacity is reserved");
    assert_eq!(full, 790);
    assert!(
        peak.load(Ordering::Relaxed) <= 10,
        "outstanding peaked at {}",
        peak.load(Ordering::Relaxed)
    );
    let g = ns.store.groups().await?;
    assert_eq!(g[0].reserved, 10);
    assert_eq!(g[0].capacity, 10);

    // A batch call is atomic too: with no room left, nothing more is reserved.
    let batch: Vec<_> = (0..50)
        .map(|k| req(format!("b{k}"), Dedupe::Skip))
        .collect();
    let answers = ns.store.reserve(&batch, params()).await?;
    assert!(answers.iter().all(|a| matches!(a, Reservation::Full(_))));
    ns.cleanup().await
}

#[tokio::test]
async fn dedupe_and_no_match() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    register_worker(&ns.store, "w1", "gpu=true,protocol=builtin", 5).await?;
    let a = ns
        .store
        .reserve(&[req("same".into(), Dedupe::Check)], params())
        .await?;
    assert!(matches!(a[0], Reservation::Reserved(_)));
    let b = ns
        .store
        .reserve(&[req("same".into(), Dedupe::Check)], params())
        .await?;
    assert_eq!(b[0], Reservation::Duplicate);
    // A redelivered message whose first handling never finished goes ahead...
    let r = ns
        .store
        .reserve(&[req("same".into(), Dedupe::Mark)], params())
        .await?;
    assert!(matches!(r[0], Reservation::Reserved(_)), "{r:?}");
    // ...but once handed on (confirmed, about to be acked), a redelivery is a duplicate.
    ns.store.mark_handed_on(None, &["same"], 3_600_000).await?;
    let r = ns
        .store
        .reserve(&[req("same".into(), Dedupe::Mark)], params())
        .await?;
    assert_eq!(r[0], Reservation::Duplicate);
    // A batch whose every submission was handed on says so with one flag for all its marks:
    // a redelivery of any of them is a duplicate; a batch without the flag goes ahead.
    let (flagged, unflagged) = (params(), params());
    let ids = ["b1", "b2", "b3"];
    let first = |p| {
        let reqs: Vec<_> = ids
            .iter()
            .map(|i| req((*i).into(), Dedupe::Check))
            .collect();
        let store = ns.store.clone();
        async move { store.reserve(&reqs, p).await }
    };
    first(flagged).await?;
    ns.store
        .mark_handed_on(Some(flagged.token), &[], 3_600_000)
        .await?;
    let again: Vec<_> = ids.iter().map(|i| req((*i).into(), Dedupe::Mark)).collect();
    let r = ns.store.reserve(&again, params()).await?;
    assert_eq!(
        r,
        vec![Reservation::Duplicate; 3],
        "the flagged batch's redeliveries"
    );
    let others: Vec<_> = ["c1", "c2"]
        .iter()
        .map(|i| req((*i).into(), Dedupe::Check))
        .collect();
    ns.store.reserve(&others, unflagged).await?;
    let again: Vec<_> = ["c1", "c2"]
        .iter()
        .map(|i| req((*i).into(), Dedupe::Mark))
        .collect();
    let r = ns.store.reserve(&again, params()).await?;
    assert!(
        r.iter()
            .all(|a| matches!(a, Reservation::Reserved(_) | Reservation::Full(_))),
        "a batch never handed on is dispatched again: {r:?}"
    );
    let none = ReserveRequest {
        selector: Labels::parse("gpu=false")?,
        ..req("x".into(), Dedupe::Skip)
    };
    let c = ns.store.reserve(&[none], params()).await?;
    assert_eq!(c[0], Reservation::NoMatch);
    ns.cleanup().await
}

#[tokio::test]
async fn strategies_choose_as_documented() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    register_worker(&ns.store, "a1", "pool=x,zone=a,protocol=builtin", 100).await?;
    register_worker(&ns.store, "b1", "pool=x,zone=b,protocol=builtin", 100).await?;
    let sel = Labels::parse("pool=x")?;
    let mk = |id: String, s: Strategy| ReserveRequest {
        id,
        lane: Lane::Normal,
        selector: sel.clone(),
        kind: "echo".into(),
        strategy: Some(s),
        dedupe: Dedupe::Skip,
        from_park: false,
        dedupe_only: false,
        key: None,
    };

    // round_robin alternates between the two groups.
    let batch: Vec<_> = (0..10)
        .map(|k| mk(format!("rr{k}"), Strategy::RoundRobin))
        .collect();
    let got: Vec<String> = ns
        .store
        .reserve(&batch, params())
        .await?
        .into_iter()
        .map(|r| match r {
            Reservation::Reserved(g) => g,
            other => format!("{other:?}"),
        })
        .collect();
    for w in got.windows(2) {
        assert_ne!(w[0], w[1], "round robin must alternate: {got:?}");
    }

    // least_loaded picks the emptier group: load zone=a with 30 more reservations first.
    let zone_a = Labels::parse("pool=x,zone=a")?;
    let fill: Vec<_> = (0..30)
        .map(|k| ReserveRequest {
            selector: zone_a.clone(),
            ..mk(format!("fill{k}"), Strategy::LeastLoaded)
        })
        .collect();
    ns.store.reserve(&fill, params()).await?;
    let r = ns
        .store
        .reserve(&[mk("ll".into(), Strategy::LeastLoaded)], params())
        .await?;
    assert_eq!(
        r[0],
        Reservation::Reserved("pool=x,protocol=builtin,zone=b".into())
    );

    // weighted: a group with poor health gets measurably less.
    use deadpool_redis::redis;
    ns.store
        .query::<()>(
            redis::cmd("HSET")
                .arg(ns.names.group("pool=x,protocol=builtin,zone=a"))
                .arg("h:a1")
                .arg("0.1"),
        )
        .await?;
    let batch: Vec<_> = (0..100)
        .map(|k| mk(format!("w{k}"), Strategy::Weighted))
        .collect();
    let mut wp = params();
    wp.backlog_factor = 10.0;
    let res = ns.store.reserve(&batch, wp).await?;
    let to_a = res
        .iter()
        .filter(|r| **r == Reservation::Reserved("pool=x,protocol=builtin,zone=a".into()))
        .count();
    let to_b = res
        .iter()
        .filter(|r| **r == Reservation::Reserved("pool=x,protocol=builtin,zone=b".into()))
        .count();
    println!("weighted: unhealthy zone=a got {to_a}, healthy zone=b got {to_b}");
    assert_eq!(to_a + to_b, 100);
    assert!(to_a * 3 < to_b, "unhealthy group got {to_a} vs {to_b}");
    ns.cleanup().await
}

#[tokio::test]
async fn the_last_active_worker_of_a_group_is_never_ejected() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    register_worker(&ns.store, "only", "pool=e,protocol=builtin", 3).await?;
    assert_eq!(
        ns.store.try_eject("only").await?,
        Some(false),
        "last active worker stays in"
    );
    assert_eq!(ns.store.groups().await?[0].capacity, 3);
    register_worker(&ns.store, "peer", "pool=e,protocol=builtin", 2).await?;
    assert_eq!(ns.store.try_eject("only").await?, Some(true));
    assert_eq!(ns.store.groups().await?[0].capacity, 2);
    assert_eq!(
        ns.store.worker_state("only").await?,
        Some(WorkerState::Ejected)
    );
    // With its peer the only active one left, the peer cannot be ejected too.
    assert_eq!(ns.store.try_eject("peer").await?, Some(false));
    assert_eq!(ns.store.try_eject("ghost").await?, None);
    ns.cleanup().await
}
