//! Producers under refusal: the library's `Producer` and `fleetctl submit` (plain: refusals
//! reported; `--paced`: every task accepted at the fleet's pace, each run exactly once), and
//! HTTP and AMQP producers admitted by the same rule under the same flood.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use fleet::broker::{Pacing, Producer, Submitted};
use fleet_tests::*;
use serde_json::json;

/// A small fleet that is easy to overload: a 10-deep ingress, Red at 9 pending, and one
/// worker with 2 slots running 20 ms tasks (about 100 tasks/s).
const SMALL: &[(&str, &str)] = &[("ingress_max_normal", "10"), ("max_pending", "10")];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn paced_submit_gets_every_task_accepted_and_run_once() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let h = [("record", rec.handler())];
    let sched = start_scheduler(&ns, SMALL).await?;
    let w = start_worker(&ns, "w1", "", 2, &[], &h).await?;
    let api = sched.url("");
    let payload = json!({"ms": 20}).to_string();

    // Plain submit: 150 tasks at once against a 10-deep ingress; refusals are reported.
    let plain_id = format!("plain-{}", ns.name);
    let (code, out, err) = fleetctl(
        &ns,
        &api,
        &[
            "submit",
            "--kind",
            "record",
            "--payload",
            &payload,
            "--count",
            "150",
            "--id",
            &plain_id,
        ],
    )
    .await?;
    let summary = out.lines().last().unwrap_or_default().to_string();
    let count = |key: &str| -> usize {
        summary
            .split_whitespace()
            .find_map(|kv| kv.strip_prefix(key))
            .and_then(|n| n.parse().ok())
            .unwrap_or(usize::MAX)
    };
    let (plain_ok, plain_refused) = (count("accepted="), count("refused="));
    println!("plain submit: {summary}");
    assert_eq!(code, 1, "refusals make plain submit exit 1: {out} {err}");
    assert!(plain_refused > 0 && plain_refused < 150, "{summary}");
    assert_eq!(plain_ok + plain_refused, 150, "{summary}");
    assert_eq!(
        err.matches("refused: ").count(),
        plain_refused,
        "one line per refused task: {err}"
    );

    // Paced: the same 150 tasks (other ids), all accepted; exit 0.
    let paced_id = format!("paced-{}", ns.name);
    let (code, out, err) = fleetctl(
        &ns,
        &api,
        &[
            "submit",
            "--kind",
            "record",
            "--payload",
            &payload,
            "--count",
            "150",
            "--id",
            &paced_id,
            "--paced",
            "--within",
            "50s",
        ],
    )
    .await?;
    println!("paced submit: {}", out.trim());
    assert_eq!(code, 0, "stdout: {out} stderr: {err}");
    assert_eq!(out.trim(), "accepted=150 refused=0");

    // Every accepted task runs exactly once: the plain ones accepted and all 150 paced ones.
    let want = plain_ok + 150;
    wait_for(
        "every accepted task to run",
        Duration::from_secs(60),
        || async { (rec.count() >= want).then_some(()) },
    )
    .await?;
    // Barrier: queues empty and nothing reserved or running, so no further run can start.
    ns.wait_settled(Duration::from_secs(30)).await?;
    let runs = rec.per_task();
    let paced: HashSet<String> = (1..=150).map(|i| format!("{paced_id}-{i}")).collect();
    let ran_paced: HashSet<String> = runs
        .keys()
        .filter(|id| id.starts_with(&paced_id))
        .cloned()
        .collect();
    assert_eq!(ran_paced, paced, "every paced task ran");
    assert_eq!(
        runs.keys().filter(|id| id.starts_with(&plain_id)).count(),
        plain_ok,
        "the accepted plain tasks ran, no refused one"
    );
    assert!(runs.values().all(|w| w.len() == 1), "none ran twice");
    assert_eq!(rec.count(), want);
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn producer_paced_reports_what_is_still_refused_at_the_deadline() -> anyhow::Result<()> {
    // The scheduler declares the topology and stops: nothing drains the 5-deep ingress, so
    // exactly 5 tasks get in and the other 35 stay refused however often they are offered.
    let ns = Ns::new().await?;
    start_scheduler(&ns, &[("ingress_max_normal", "5")])
        .await?
        .stop()
        .await?;
    let p = Producer::connect(&amqp_url(), ns.names.clone(), "producer-test").await?;
    let envs: Vec<_> = (0..40).map(|_| task("record", json!({}), "")).collect();
    let mut seen = Vec::new();
    let started = std::time::Instant::now();
    let report = p
        .submit_paced(&envs, Duration::from_millis(800), Pacing::default(), |pr| {
            seen.push(pr)
        })
        .await?;
    let took = started.elapsed();
    assert_eq!(report.accepted.len(), 5, "{report:?}");
    assert_eq!(report.refused.len(), 35);
    assert!(
        report.refused.iter().all(|(_, why)| why.contains("nack")),
        "{:?}",
        report.refused
    );
    let accepted: HashSet<&String> = report.accepted.iter().collect();
    assert!(report.refused.iter().all(|(id, _)| !accepted.contains(id)));
    assert_eq!(
        accepted.len() + report.refused.len(),
        40,
        "every task accounted for once"
    );
    assert!(
        report.rounds >= 3,
        "refused tasks are offered again with backoff: {} rounds",
        report.rounds
    );
    assert_eq!(seen.len() as u32, report.rounds);
    assert!(
        seen.iter().all(|pr| pr.total == 40 && pr.accepted == 5),
        "{seen:?}"
    );
    assert!(
        took >= Duration::from_millis(800) && took < Duration::from_secs(5),
        "gives up at the deadline: {took:?}"
    );
    assert_eq!(
        ns.depth(&ns.names.ingress_queue(fleet::Lane::Normal)).await,
        5
    );
    // Plain submit of one more: refused at once, with the reason.
    let one = p.submit(&[task("record", json!({}), "")]).await?;
    assert!(
        matches!(&one[..], [Submitted::Refused(why)] if why.contains("nack")),
        "{one:?}"
    );
    p.close().await;
    ns.cleanup().await
}

/// Relative tolerance on the two paths' acceptance ratios: both see the same queue, task for
/// task, so they differ only by the moments at which a slot frees between the two publishes.
const PARITY_TOLERANCE: f64 = 0.10;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn http_and_amqp_producers_are_admitted_alike() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let h = [("record", rec.handler())];
    let sched = start_scheduler(&ns, SMALL).await?;
    let w = start_worker(&ns, "w1", "", 2, &[], &h).await?;
    let amqp = Producer::connect(&amqp_url(), ns.names.clone(), "parity-test").await?;
    let http = reqwest::Client::new();
    let url = sched.url("/v1/tasks");
    // The same flood over both paths, interleaved task by task: ~10x what the fleet runs.
    let (mut amqp_ok, mut http_ok) = (Vec::new(), Vec::new());
    let mut http_codes: HashMap<u16, usize> = HashMap::new();
    let n = 300;
    for _ in 0..n {
        let a = task("record", json!({"ms": 20}), "");
        if amqp.submit(std::slice::from_ref(&a)).await?.first() == Some(&Submitted::Accepted) {
            amqp_ok.push(a.id.clone());
        }
        let b = task("record", json!({"ms": 20}), "");
        let r = http.post(&url).json(&b.to_value()).send().await?;
        let code = r.status().as_u16();
        *http_codes.entry(code).or_default() += 1;
        match code {
            202 => http_ok.push(b.id.clone()),
            429 | 503 => {
                assert!(
                    r.headers().get("retry-after").is_some(),
                    "a refusal carries Retry-After"
                );
                let body: serde_json::Value = r.json().await?;
                assert_eq!(body["refused"], json!([b.id]), "{body}");
            }
            other => anyhow::bail!("unexpected HTTP {other}"),
        }
    }
    let (ra, rh) = (
        amqp_ok.len() as f64 / n as f64,
        http_ok.len() as f64 / n as f64,
    );
    println!(
        "same flood of {n}: AMQP accepted {:.1}%, HTTP accepted {:.1}% (codes {http_codes:?})",
        ra * 100.0,
        rh * 100.0
    );
    assert!(
        ra < 0.9 && rh < 0.9,
        "the flood must overload the fleet (AMQP {ra}, HTTP {rh})"
    );
    assert!(
        ra > 0.0 && rh > 0.0,
        "both paths get work in (AMQP {ra}, HTTP {rh})"
    );
    assert!(
        (ra - rh).abs() <= PARITY_TOLERANCE * ra.max(rh) + 0.02,
        "AMQP {ra:.3} vs HTTP {rh:.3}: not the same rule"
    );

    // Everything accepted on either path runs, once.
    let want: HashSet<String> = amqp_ok.iter().chain(&http_ok).cloned().collect();
    wait_for(
        "every accepted task to run",
        Duration::from_secs(60),
        || async { (rec.count() >= want.len()).then_some(()) },
    )
    .await?;
    // Barrier: queues empty and nothing reserved or running, so no further run can start.
    ns.wait_settled(Duration::from_secs(30)).await?;
    let runs = rec.per_task();
    assert_eq!(runs.keys().cloned().collect::<HashSet<_>>(), want);
    assert!(runs.values().all(|w| w.len() == 1), "none ran twice");
    amqp.close().await;
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
