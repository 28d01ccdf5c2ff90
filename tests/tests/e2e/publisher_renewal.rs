//! A publishing channel stuck nacking is renewed (issue 37 item 3): after a node loss a
//! channel of the scheduler had every publish nacked for minutes with its queue far below any
//! bound, while a channel opened later published unhindered. One mechanism,
//! `fleet::amqp::Renewal`, serves the API (submissions) and the dispatcher (the session's
//! publisher, shared by every dispatching loop): after `RENEW_AFTER` (2 s) of such nacks with
//! none taken, a fresh confirm channel replaces the one the last renewal opened.
//!
//! A stuck channel cannot be made on one node; the nacks can. A policy on a private node gives
//! the namespace's group queues (then its ingress queues) `max-length-bytes` 10 with
//! `reject-publish`: every publish to them is nacked while they hold nothing — the nack a
//! quorum queue without a leader gives. Asserted: the dispatcher renews
//! (`fleet_publisher_renewals_total{user="dispatch"}`), one spare channel at a time (the
//! scheduler connection's channel count does not grow with each renewal); the API answers
//! `broker_unavailable` (not `ingress_full`) and renews (`{user="api"}`); with the policy gone
//! every task runs, none lost and none twice.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use fleet_tests::*;
use serde_json::json;

const RENEWALS: &str = "fleet_publisher_renewals_total";

async fn renewals(base: &str, user: &str) -> f64 {
    metrics_page(base)
        .await
        .map(|p| metric_sum(&p, RENEWALS, &[("user", user)]))
        .unwrap_or(0.0)
}

/// The channels open on the scheduler's connection (`list_connections channels
/// client_properties`: its line names it).
async fn scheduler_channels(rabbit: &PrivateRabbit, ns: &str) -> Option<u64> {
    let out = rabbit
        .ctl(&["list_connections", "channels", "client_properties"])
        .await
        .ok()?;
    out.lines()
        // The exact name, closing quote included: the prober's is "fleet-scheduler <ns> probe".
        .find(|l| l.contains(&format!("fleet-scheduler {ns}\"")))
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_channel_nacked_below_every_bound_is_renewed() -> anyhow::Result<()> {
    // Reads the renewal counters of `/metrics`: the registry is the process's.
    own_process!();
    let rabbit = PrivateRabbit::start("", "[].\n").await?;
    let ns = Ns::on_broker(&rabbit.url()).await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let base = sched.url("");
    let labels = "case=renewal";
    let attempts = Attempts::default();
    let a = attempts.clone();
    let handler = fleet_worker::executor::handler_fn(move |ctx| {
        let a = a.clone();
        async move {
            a.record(&ctx.envelope.id, ctx.attempt);
            Ok(json!({}))
        }
    });
    let w = start_worker(&ns, "w-renew", labels, 4, &[], &[("work", handler)]).await?;
    let escaped = ns.name.replace('.', "\\.");
    let nack_all = r#"{"max-length-bytes":10,"overflow":"reject-publish"}"#;

    // 1. Dispatch: every publish to the group queue nacked, the queue empty.
    let group_pattern = format!("^{escaped}\\.group\\.");
    rabbit
        .ctl(&[
            "set_policy",
            "--apply-to",
            "queues",
            "fleet-nack-groups",
            &group_pattern,
            nack_all,
        ])
        .await?;
    let dispatch_before = renewals(&base, "dispatch").await;
    let tasks: Vec<fleet::Envelope> = (0..20).map(|_| task("work", json!({}), labels)).collect();
    let (ok, refused) = ns.submit(&tasks).await?;
    assert_eq!((ok, refused), (tasks.len(), 0));
    let first = wait_for(
        "the dispatcher's first renewal",
        Duration::from_secs(30),
        || async { (renewals(&base, "dispatch").await > dispatch_before).then(Instant::now) },
    )
    .await?;
    let channels_first = scheduler_channels(&rabbit, &ns.name).await;
    wait_for(
        "two more renewals of the dispatcher",
        Duration::from_secs(40),
        || async { (renewals(&base, "dispatch").await >= dispatch_before + 3.0).then_some(()) },
    )
    .await?;
    let channels_third = scheduler_channels(&rabbit, &ns.name).await;
    let dispatch_renewals = renewals(&base, "dispatch").await - dispatch_before;
    println!(
        "dispatch: {dispatch_renewals} renewals ({:?} from the first to now); the scheduler's channels after the first {channels_first:?}, after the third {channels_third:?}; runs meanwhile {}",
        first.elapsed(),
        attempts.count()
    );
    assert_eq!(attempts.count(), 0, "a task ran past a nacking group queue");
    if let (Some(a), Some(b)) = (channels_first, channels_third) {
        // Each renewal closes the channel the one before opened: two more renewals, no more
        // channels (one of slack for a loop's own channel opening meanwhile).
        assert!(
            b <= a + 1,
            "channels grew from {a} to {b} over two renewals"
        );
    }

    // 2. The API: every submission nacked by an empty ingress queue.
    let ingress_pattern = format!("^{escaped}\\.ingress\\.");
    rabbit
        .ctl(&[
            "set_policy",
            "--apply-to",
            "queues",
            "fleet-nack-ingress",
            &ingress_pattern,
            nack_all,
        ])
        .await?;
    let api_before = renewals(&base, "api").await;
    let url = sched.url("/v1/tasks");
    let mut answers: BTreeMap<String, usize> = BTreeMap::new();
    let spell = Instant::now();
    let api_tasks: Vec<fleet::Envelope> = (0..5).map(|_| task("work", json!({}), labels)).collect();
    let body: Vec<serde_json::Value> = api_tasks
        .iter()
        .filter_map(|e| serde_json::from_slice(&e.to_bytes()).ok())
        .collect();
    while renewals(&base, "api").await <= api_before && spell.elapsed() < Duration::from_secs(20) {
        let r = http().post(&url).json(&body).send().await?;
        let status = r.status().as_u16();
        let code = r.json::<serde_json::Value>().await.unwrap_or_default()["error"]
            .as_str()
            .unwrap_or("")
            .to_string();
        *answers.entry(format!("{status} {code}")).or_default() += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let api_renewals = renewals(&base, "api").await - api_before;
    println!(
        "API: answers {answers:?}; {api_renewals} renewals after {:?} of refusals",
        spell.elapsed()
    );
    assert!(api_renewals >= 1.0, "the API never renewed its channel");
    assert!(
        answers.keys().all(|k| k == "503 broker_unavailable"),
        "a nack from an empty ingress queue answered otherwise: {answers:?}"
    );

    // 3. The policies gone: the fresh channels publish; every task runs once.
    for p in ["fleet-nack-groups", "fleet-nack-ingress"] {
        rabbit.ctl(&["clear_policy", p]).await?;
    }
    let r = http().post(&url).json(&body).send().await?;
    assert_eq!(r.status().as_u16(), 202, "submission after the policy went");
    let all: Vec<String> = tasks
        .iter()
        .chain(api_tasks.iter())
        .map(|t| t.id.clone())
        .collect();
    wait_for("every task ran", Duration::from_secs(60), || async {
        all.iter()
            .all(|id| !attempts.of(id).is_empty())
            .then_some(())
    })
    .await?;
    // A redelivered copy would run late: give it the time to show.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let twice: Vec<&String> = all.iter().filter(|id| attempts.of(id) != vec![1]).collect();
    println!(
        "tasks {}, run {}, run other than once {}",
        all.len(),
        attempts.count(),
        twice.len()
    );
    assert!(twice.is_empty(), "run other than once: {twice:?}");
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
