//! Bad input: each malformed envelope ends in the dead-letter queue with the right reason, is
//! counted, and good tasks sent after it still complete.

use std::collections::BTreeMap;
use std::time::Duration;

use fleet::Lane;
use fleet_tests::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_envelopes_are_dead_lettered_with_reasons() -> anyhow::Result<()> {
    own_process!();
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let h = [("record", rec.handler())];
    let sched = start_scheduler(&ns, &[("max_task_bytes", "4096")]).await?;
    let w = start_worker(&ns, "w1", "", 4, &[], &h).await?;

    let big = format!(r#"{{"kind":"record","payload":"{}"}}"#, "x".repeat(5000));
    let bad: Vec<(&str, Vec<u8>)> = vec![
        ("malformed_json", b"{not json".to_vec()),
        ("not_an_object", b"[1,2,3]".to_vec()),
        ("missing_kind", br#"{"payload":{}}"#.to_vec()),
        (
            "bad_field",
            br#"{"kind":"record","max_attempts":"many"}"#.to_vec(),
        ),
        (
            "unknown_lane",
            br#"{"kind":"record","lane":"bulk"}"#.to_vec(),
        ),
        ("oversized", big.into_bytes()),
        (
            "bad_selector",
            br#"{"kind":"record","labels":{"gpu":"t r u e"}}"#.to_vec(),
        ),
        (
            "bad_field",
            br#"{"kind":"record","deadline":"next tuesday"}"#.to_vec(),
        ),
    ];
    for (_, body) in &bad {
        ns.submit_raw(Lane::Normal, body).await?;
    }
    let good: Vec<_> = (0..20).map(|_| task("record", json!({}), "")).collect();
    ns.submit(&good).await?;
    wait_for("good tasks", Duration::from_secs(30), || async {
        (rec.count() >= 20).then_some(())
    })
    .await?;

    let dead = wait_for("dead letters", Duration::from_secs(10), || {
        let ns = &ns;
        async move {
            let d = ns.drain_dead().await.ok()?;
            (!d.is_empty()).then_some(d)
        }
    })
    .await?;
    let mut got: BTreeMap<String, usize> = BTreeMap::new();
    for (_, r) in &dead {
        *got.entry(r.clone().unwrap_or_default()).or_default() += 1;
    }
    let mut want: BTreeMap<String, usize> = BTreeMap::new();
    for (r, _) in &bad {
        *want.entry(r.to_string()).or_default() += 1;
    }
    assert_eq!(got, want);
    // The producer's bytes are kept for refused envelopes.
    assert!(dead.iter().any(|(b, _)| b == b"{not json"));
    assert_eq!(rec.count(), 20);

    let page = reqwest::get(sched.url("/metrics")).await?.text().await?;
    assert_eq!(
        metric_sum(
            &page,
            "fleet_tasks_rejected_total",
            &[("reason", "bad_field")]
        ) as usize,
        2
    );
    assert_eq!(
        metric_sum(
            &page,
            "fleet_tasks_rejected_total",
            &[("reason", "oversized")]
        ) as usize,
        1
    );
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
