//! What operators see: `GET /v1/workers` and `GET /v1/groups` (state, labels, capacity, load,
//! reserved, last heartbeat) and the `fleetctl workers` / `fleetctl groups` tables.

use std::time::Duration;

use anyhow::Context;
use fleet_tests::*;
use serde_json::{json, Value};

fn find<'a>(rows: &'a Value, key: &str, value: &str) -> anyhow::Result<&'a Value> {
    rows.as_array()
        .and_then(|a| a.iter().find(|r| r[key] == value))
        .with_context(|| format!("no {key}={value} in {rows}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn workers_and_groups_api_and_fleetctl_tables() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let h = [(JOB, rec.handler())];
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let mut cfg_a = WORKER.to_vec();
    cfg_a.push(("critical_capacity", "1"));
    let a = start_worker(&ns, "w-a", "zone=a", 2, &cfg_a, &h).await?;
    let mut cfg_b = WORKER.to_vec();
    cfg_b.push(("critical_capacity", "2"));
    let b = start_worker(&ns, "w-b", "zone=b,gpu=true", 3, &cfg_b, &h).await?;
    let (ga, gb) = (
        "protocol=builtin,zone=a",
        "gpu=true,protocol=builtin,zone=b",
    );

    // Four long tasks for zone a (capacity 2): two run, two wait reserved in the queue.
    let envs: Vec<_> = (0..4)
        .map(|i| task(JOB, json!({"i": i, "ms": 2500}), "zone=a"))
        .collect();
    assert_eq!(ns.submit(&envs).await?, (4, 0));
    let workers_url = sched.url("/v1/workers");
    let ws = wait_for("w-a reports 2 running", Duration::from_secs(20), || async {
        let ws = get_json(&workers_url).await.ok()?;
        (find(&ws, "id", "w-a").ok()?["running"] == 2).then_some(ws)
    })
    .await?;

    assert_eq!(ws.as_array().map(Vec::len), Some(2));
    let wa = find(&ws, "id", "w-a")?;
    assert_eq!(wa["group"], ga);
    assert_eq!(wa["labels"], json!({"protocol": "builtin", "zone": "a"}));
    assert_eq!(wa["executor"], "builtin");
    assert_eq!(wa["state"], "active");
    assert_eq!(
        (wa["capacity"].as_u64(), wa["critical_capacity"].as_u64()),
        (Some(2), Some(1))
    );
    assert_eq!(
        (wa["running"].as_u64(), wa["running_critical"].as_u64()),
        (Some(2), Some(0))
    );
    let hb = wa["last_heartbeat_ms_ago"]
        .as_i64()
        .context("last_heartbeat_ms_ago")?;
    assert!(
        (0..=(HEARTBEAT_MS as i64 + 1000)).contains(&hb),
        "last heartbeat {hb} ms ago"
    );
    let wb = find(&ws, "id", "w-b")?;
    assert_eq!(wb["group"], gb);
    assert_eq!(
        wb["labels"],
        json!({"gpu": "true", "protocol": "builtin", "zone": "b"})
    );
    assert_eq!(
        (
            wb["capacity"].as_u64(),
            wb["critical_capacity"].as_u64(),
            wb["running"].as_u64()
        ),
        (Some(3), Some(2), Some(0))
    );
    assert_eq!(wb["state"], "active");

    let gs = get_json(&sched.url("/v1/groups")).await?;
    assert_eq!(gs.as_array().map(Vec::len), Some(2));
    let g = find(&gs, "group", ga)?;
    assert_eq!(g["labels"], json!({"protocol": "builtin", "zone": "a"}));
    let nums = |g: &Value| -> Vec<Option<u64>> {
        [
            "workers",
            "capacity",
            "critical_capacity",
            "load",
            "reserved",
            "critical_load",
            "critical_reserved",
        ]
        .iter()
        .map(|k| g[*k].as_u64())
        .collect()
    };
    assert_eq!(nums(g), [1, 2, 1, 2, 2, 0, 0].map(Some).to_vec(), "{g}");
    let g = find(&gs, "group", gb)?;
    assert_eq!(nums(g), [1, 3, 2, 0, 0, 0, 0].map(Some).to_vec(), "{g}");

    // The same through fleetctl.
    let api = format!("http://{}", sched.addr);
    let (code, out, err) = fleetctl(&ns, &api, &["workers"]).await?;
    assert_eq!(code, 0, "{err}");
    println!("fleetctl workers:\n{out}");
    let lines: Vec<Vec<&str>> = out
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(lines.len(), 3, "header + 2 rows:\n{out}");
    assert_eq!(
        lines[0][..10],
        [
            "ID",
            "GROUP",
            "STATE",
            "CAPACITY(N+C)",
            "RUNNING(N+C)",
            "SUCCEEDED",
            "RETRIED",
            "DEAD",
            "EXPIRED",
            "UNRECORDED"
        ]
    );
    assert!(out
        .lines()
        .next()
        .is_some_and(|h| h.ends_with("LAST HEARTBEAT")));
    let row_a = lines.iter().find(|l| l[0] == "w-a").context("w-a row")?;
    assert_eq!(
        row_a[..10],
        ["w-a", ga, "active", "2+1", "2+0", "0", "0", "0", "0", "0"]
    );
    // KINDS: what the API says the worker handles.
    let kinds_a = wa["kinds"].as_str().unwrap_or("?");
    assert!(!kinds_a.is_empty() && kinds_a != "?", "{wa}");
    assert_eq!(row_a[10], kinds_a, "{row_a:?}");
    assert!(row_a[11].ends_with("s") && row_a[12] == "ago", "{row_a:?}");
    let row_b = lines.iter().find(|l| l[0] == "w-b").context("w-b row")?;
    assert_eq!(
        row_b[..10],
        ["w-b", gb, "active", "3+2", "0+0", "0", "0", "0", "0", "0"]
    );

    let (code, out, err) = fleetctl(&ns, &api, &["groups"]).await?;
    assert_eq!(code, 0, "{err}");
    println!("fleetctl groups:\n{out}");
    let lines: Vec<Vec<&str>> = out
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    // The table, then the line for what no group holds.
    assert_eq!(
        lines.len(),
        4,
        "header + 2 rows + the unrouted line:\n{out}"
    );
    assert_eq!(
        lines[3][..6],
        ["not", "in", "any", "group:", "0", "waiting"],
        "{out}"
    );
    assert_eq!(
        lines[0][..5],
        ["GROUP", "WORKERS", "CAPACITY", "LOAD", "RESERVED"]
    );
    let row = lines.iter().find(|l| l[0] == ga).context("group a row")?;
    assert_eq!(row[..6], [ga, "1", "2", "2", "2", "1/0"]);
    let row = lines.iter().find(|l| l[0] == gb).context("group b row")?;
    assert_eq!(row[..6], [gb, "1", "3", "0", "0", "2/0"]);

    // Everything done: load and reserved back to zero, totals counted.
    wait_for("4 runs", Duration::from_secs(20), || async {
        (rec.count() >= 4).then_some(())
    })
    .await?;
    let g = wait_for("group a idle", Duration::from_secs(10), || async {
        group(&ns.store, ga)
            .await
            .filter(|g| g.load == 0 && g.reserved == 0)
    })
    .await?;
    assert_eq!(g.capacity, 2);
    let ws = wait_for("w-a's totals", Duration::from_secs(5), || async {
        let ws = get_json(&workers_url).await.ok()?;
        let w = find(&ws, "id", "w-a").ok()?;
        (w["succeeded"] == 4 && w["running"] == 0).then_some(ws.clone())
    })
    .await?;
    let wa = find(&ws, "id", "w-a")?;
    assert_eq!(
        (wa["running"].as_u64(), wa["failed"].as_u64()),
        (Some(0), Some(0))
    );
    assert!(
        wa["latency_ewma_ms"].as_f64().is_some_and(|l| l >= 2000.0),
        "{wa}"
    );

    a.stop().await?;
    b.stop().await?;
    assert_eq!(
        get_json(&workers_url).await?,
        json!([]),
        "both deregistered"
    );
    sched.stop().await?;
    ns.cleanup().await
}

/// `GET /v1/workers` and `fleetctl workers` show current figures (not as of the last
/// heartbeat, here 20 s away), by the outcomes of `fleet_tasks_completed_total`, and the
/// scheduler's health probes are counted apart (`fleet_probes_completed_total`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn worker_figures_are_current_and_leave_probes_out() -> anyhow::Result<()> {
    own_process!();
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let h = [(JOB, rec.handler())];
    let sched = start_scheduler(
        &ns,
        &[
            ("heartbeat_timeout_ms", "60000"),
            ("probe_interval_ms", "300"),
        ],
    )
    .await?;
    let labels = format!("figures={}", ns.name);
    let w = start_worker(
        &ns,
        "w-fig",
        &labels,
        2,
        &[
            ("heartbeat_interval_ms", "20000"),
            ("heartbeat_timeout_ms", "60000"),
            ("run_lease_ms", "60000"),
            ("critical_capacity", "1"),
        ],
        &h,
    )
    .await?;
    let group = fleet::Labels::parse(&format!("{labels},protocol=builtin"))
        .map_err(|e| anyhow::anyhow!("{e}"))?
        .group_name();
    let metrics_url = format!("http://{}/metrics", sched.addr);
    let probes = |page: &str| {
        metric_sum(
            page,
            "fleet_probes_completed_total",
            &[("group", group.as_str()), ("outcome", "succeeded")],
        )
    };
    wait_for(
        "two probes through the worker",
        Duration::from_secs(15),
        || async {
            let page = reqwest::get(&metrics_url).await.ok()?.text().await.ok()?;
            (probes(&page) >= 2.0).then_some(())
        },
    )
    .await?;
    let envs = jobs(5, &labels, Some(10));
    ns.submit(&envs).await?;
    wait_for("5 runs", Duration::from_secs(20), || async {
        (rec.count() >= 5).then_some(())
    })
    .await?;
    let workers_url = format!("http://{}/v1/workers", sched.addr);
    // Well before the next heartbeat: the figures went out with the outcomes.
    let ws = wait_for("current figures", Duration::from_secs(3), || async {
        let ws = get_json(&workers_url).await.ok()?;
        (find(&ws, "id", "w-fig").ok()?["succeeded"] == 5).then_some(ws)
    })
    .await?;
    let wf = find(&ws, "id", "w-fig")?;
    let n = |k: &str| wf[k].as_u64();
    assert_eq!(
        [
            n("succeeded"),
            n("retried"),
            n("dead"),
            n("expired"),
            n("failed")
        ],
        [5, 0, 0, 0, 0].map(Some),
        "probes not counted: {wf}"
    );
    let page = reqwest::get(&metrics_url).await?.text().await?;
    assert!(probes(&page) >= 2.0);
    assert_eq!(
        metric_sum(
            &page,
            "fleet_tasks_completed_total",
            &[("group", group.as_str())]
        ),
        5.0,
        "user tasks only"
    );
    assert_eq!(
        metric_sum(
            &page,
            "fleet_tasks_completed_total",
            &[("group", group.as_str()), ("lane", "critical")]
        ),
        0.0
    );
    let (code, out, err) = fleetctl(&ns, &format!("http://{}", sched.addr), &["workers"]).await?;
    assert_eq!(code, 0, "{err}");
    let row: Vec<&str> = out
        .lines()
        .find(|l| l.starts_with("w-fig"))
        .context("w-fig row")?
        .split_whitespace()
        .collect();
    assert_eq!(row[5..10], ["5", "0", "0", "0", "0"], "{out}");
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}
