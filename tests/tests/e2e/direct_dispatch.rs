//! Direct dispatch (issue 11): a task that only one live group can take goes straight to that
//! group's queue, reserved there beyond its room — no park hop — unless tasks already park for
//! that group; a real routing choice (several candidates) still needs room. End to end, a burst
//! for one group parks nothing, and an overload of it still closes the intake gate.

use std::time::Duration;

use fleet::route::Dedupe;
use fleet::route::Reservation;
use fleet::route::{ReserveParams, ReserveRequest};
use fleet::task::Strategy;
use fleet::{Labels, Lane};
use fleet_tests::*;
use serde_json::json;

fn params(direct: bool) -> ReserveParams {
    ReserveParams {
        lease_ms: 60_000,
        backlog_factor: 0.0,
        strategy: Strategy::LeastLoaded,
        dedupe_window_ms: 60_000,
        status_ttl_ms: 60_000,
        token: rand::random(),
        direct,
        park_flag_ttl_ms: 3000,
    }
}

fn req(id: String, selector: &str) -> ReserveRequest {
    ReserveRequest {
        id,
        lane: Lane::Normal,
        selector: Labels::parse(selector).unwrap_or_default(),
        kind: "echo".into(),
        strategy: None,
        dedupe: Dedupe::Skip,
        from_park: false,
        dedupe_only: false,
        key: None,
    }
}

#[tokio::test]
async fn one_candidate_is_reserved_beyond_room_a_choice_is_not() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    register_worker(&ns.store, "a", "pool=x,zone=a,protocol=builtin", 2).await?;
    register_worker(&ns.store, "b", "pool=x,zone=b,protocol=builtin", 2).await?;
    let a = "pool=x,protocol=builtin,zone=a".to_string();

    // One candidate (zone=a), room 2 (backlog factor 0): all 10 reserved there with direct
    // dispatch, only 2 without it.
    let batch: Vec<_> = (0..10).map(|k| req(format!("d{k}"), "zone=a")).collect();
    let got = ns.store.reserve(&batch, params(true)).await?;
    assert_eq!(got, vec![Reservation::Reserved(a.clone()); 10]);
    let g = ns.store.groups().await?;
    let ga = g.iter().find(|g| g.group == a).map(|g| g.reserved);
    assert_eq!(ga, Some(10), "counted as reserved there");

    // A routing choice (pool=x: both groups) still needs room: zone=b has 2 free, zone=a none.
    let batch: Vec<_> = (0..4).map(|k| req(format!("c{k}"), "pool=x")).collect();
    let got = ns.store.reserve(&batch, params(true)).await?;
    let b = "pool=x,protocol=builtin,zone=b".to_string();
    assert_eq!(
        got[..2],
        [
            Reservation::Reserved(b.clone()),
            Reservation::Reserved(b.clone())
        ]
    );
    assert!(
        matches!(got[2], Reservation::Full(_)) && matches!(got[3], Reservation::Full(_)),
        "{got:?}"
    );

    // Tasks parked for a group keep their place: a single-candidate task parks behind them.
    ns.store.mark_parked(&b, Lane::Normal, 3000).await?;
    let got = ns
        .store
        .reserve(&[req("behind".into(), "zone=b")], params(true))
        .await?;
    assert_eq!(got, vec![Reservation::Full(b.clone())]);
    // ...and a task released from that park queue goes direct.
    let released = ReserveRequest {
        from_park: true,
        ..req("released".into(), "zone=b")
    };
    let got = ns.store.reserve(&[released], params(true)).await?;
    assert_eq!(got, vec![Reservation::Reserved(b)]);
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_for_one_group_parks_nothing_and_an_overload_still_closes_the_gate(
) -> anyhow::Result<()> {
    own_process!();
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let h = [("record", rec.handler())];
    let sched = start_scheduler(
        &ns,
        &[("ingress_max_normal", "2000"), ("max_pending", "100")],
    )
    .await?;
    let w = start_worker(&ns, "w1", "", 8, &[], &h).await?;
    // 1,000 no-op tasks for the only group: none takes the park hop.
    let burst: Vec<_> = (0..1000).map(|_| task("record", json!({}), "")).collect();
    ns.submit(&burst).await?;
    wait_for("the burst", Duration::from_secs(60), || async {
        (rec.count() >= 1000).then_some(())
    })
    .await?;
    let page = reqwest::get(sched.url("/metrics")).await?.text().await?;
    assert_eq!(
        metric_sum(&page, "fleet_tasks_parked_total", &[]),
        0.0,
        "no park hop for a single candidate"
    );
    assert_eq!(
        metric_sum(&page, "fleet_tasks_dispatched_total", &[]),
        1000.0
    );
    assert_eq!(rec.per_task().len(), 1000);

    // 400 tasks of 500 ms on 8 slots: what waits in the group queue beyond its room (the
    // gate's `behind`) closes the gate (max_pending 100 → Red at 90).
    let slow: Vec<_> = (0..400)
        .map(|_| task("record", json!({"ms": 500}), ""))
        .collect();
    ns.submit(&slow).await?;
    let p = wait_for(
        "gate red from the group queue",
        Duration::from_secs(20),
        || async {
            // The burst above may have closed the gate for a moment (held its minimum time,
            // `pressure_hold_ms`): wait for the Red that the group queue makes.
            let p = get_json(&sched.url("/v1/pressure")).await.ok()?;
            (p["gate"] == "red" && p["behind"].as_u64()? >= 90).then_some(p)
        },
    )
    .await?;
    assert!(p["behind"].as_u64().unwrap_or(0) >= 90, "{p}");
    assert_eq!(p["parked"].as_u64(), Some(0), "{p}");
    w.force.cancel();
    let _ = w.stop().await;
    sched.stop().await?;
    ns.cleanup().await
}
