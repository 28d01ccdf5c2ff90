//! A stuck delay path is visible (issue 37 item 1): `fleet_delay_canary_age_seconds{tier}` stays near
//! the canary interval (5 s) while canaries come back from the delay tiers through
//! `<ns>.delayed`, grows past the stuck threshold (20 s: the scheduler logs a warning, the
//! `FleetDelayPathStuck` alert of ops/prometheus/failover.yml fires on it) while nothing comes
//! back — made here by unbinding `<ns>.delayed`, so every forward of the scheduler's tier loops
//! is unroutable and held, as a target without a leader refuses them — and falls back once the
//! path moves again. The canaries are never taken for tasks (nothing dead-lettered).

use std::time::Duration;

use fleet_tests::*;
use lapin::types::FieldTable;

const AGE: &str = "fleet_delay_canary_age_seconds";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_delay_canary_age_shows_a_stuck_delay_path() -> anyhow::Result<()> {
    own_process!();
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let url = sched.url("/metrics");
    // The shortest tier's; every tier's age moves alike when <ns>.delayed takes nothing.
    let age = || async { metric(&url, AGE, &[("tier", "100")]).await.ok() };

    wait_for("canaries coming back", Duration::from_secs(30), || async {
        age().await.filter(|a| *a > 0.0 && *a <= 7.0)
    })
    .await?;
    let ch = ns.conn.create_channel().await?;
    let (delayed, tasks) = (ns.names.delayed_queue(), ns.names.tasks_exchange());
    ch.queue_unbind(
        delayed.as_str().into(),
        tasks.as_str().into(),
        fleet::Names::DELAYED_KEY.into(),
        FieldTable::default(),
    )
    .await?;
    let stuck = wait_for(
        "the canary age past 20 s",
        Duration::from_secs(60),
        || async { age().await.filter(|a| *a > 20.0) },
    )
    .await?;
    println!("delay path cut: canary age {stuck:.1} s");
    ch.queue_bind(
        delayed.as_str().into(),
        tasks.as_str().into(),
        fleet::Names::DELAYED_KEY.into(),
        Default::default(),
        FieldTable::default(),
    )
    .await?;
    let back = wait_for(
        "the canary age back under 7 s",
        Duration::from_secs(30),
        || async { age().await.filter(|a| *a <= 7.0) },
    )
    .await?;
    println!("delay path back: canary age {back:.1} s");
    let page = metrics_page(&format!("http://{}", sched.addr)).await?;
    let tiers = page
        .lines()
        .filter(|l| l.starts_with(AGE) && l.contains("tier=\""))
        .count();
    assert_eq!(
        tiers, 8,
        "one age per canary tier (100 ms … 12.8 s):\n{page}"
    );
    assert_eq!(
        ns.depth(&ns.names.dead_queue()).await,
        0,
        "no canary dead-lettered"
    );
    let _ = ch.close(200, "ok".into()).await;
    sched.stop().await?;
    ns.cleanup().await
}
