//! What fleet shows is one truth (issue 29 items 3-6): the pressure state says what intake
//! does (a fully busy fleet is Green) and holds its minimum time; a group's load and its
//! workers' running are the same figure from the same records, in the API and in fleetctl;
//! `failed` means one thing in every view; `fleetctl groups` shows the backlog and the oldest
//! task with stable columns.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use anyhow::Context;

use fleet_tests::*;
use fleet_worker::executor::{handler_fn, TaskError};
use serde_json::{json, Value};

/// 60 tasks of 1 s on one worker of capacity 4 (the case): the fleet runs at 100 %
/// utilisation with nothing waiting beyond its room, so the state is Green and the gate open
/// in every sample — before, the state was Red (load 1.0 ≥ 0.85) beside an open gate.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fully_busy_fleet_is_green_with_its_intake_open() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let sched = start_scheduler(&ns, &[]).await?;
    let w = start_worker(&ns, "w1", "", 4, &[], &[("record", rec.handler())]).await?;
    let envs: Vec<_> = (0..60)
        .map(|_| task("record", json!({"ms": 1000}), ""))
        .collect();
    ns.submit(&envs).await?;
    let url = sched.url("/v1/pressure");
    // A sample every 100 ms until the 60 tasks are done.
    let seen = std::sync::Mutex::new((0usize, 0usize, HashSet::new()));
    wait_for_every(
        "60 tasks done",
        Duration::from_secs(60),
        Duration::from_millis(100),
        || async {
            if rec.count() >= 60 {
                return Some(());
            }
            let p = get_json(&url).await.ok()?;
            let mut seen = seen.lock().ok()?;
            seen.0 += 1;
            if p["load"].as_f64() == Some(1.0) {
                seen.1 += 1;
                assert_eq!(p["load_level"], "full", "{p}");
            }
            assert_eq!(p["state"], p["gate"], "one state: {p}");
            seen.2.insert(p["state"].as_str().unwrap_or("").to_string());
            None
        },
    )
    .await
    .with_context(|| format!("{} ran", rec.count()))?;
    let (samples, full, states) = seen.into_inner().map_err(|_| anyhow::anyhow!("poisoned"))?;
    println!("busy fleet: {samples} samples, {full} at load 1.0, states {states:?}");
    assert!(
        full >= 10,
        "the worker ran full for a while ({full} samples)"
    );
    assert_eq!(
        states,
        HashSet::from(["green".to_string()]),
        "a fully busy fleet with nothing beyond its room is Green"
    );
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// Work beyond the room turns the state Red at once; while work is queued beyond the room it
/// gives way to a lower state only after it has held `pressure_hold_ms`, and every state change
/// the API reports (`since_ms`) is at least that far from the one before when it goes down. (A
/// fleet that has run dry — nothing waiting, parked or queued beyond a room, load below
/// `load_yellow` — reopens at once: `backpressure::tests`. Here the queue stays beyond the room,
/// at most 20 tasks once a completion rate is measured, for 4 s.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pressure_state_holds_its_minimum_time() -> anyhow::Result<()> {
    const HOLD_MS: i64 = 1500;
    let ns = Ns::new().await?;
    let rec = Recorder::default();
    let sched =
        start_scheduler(&ns, &[("max_pending", "10"), ("pressure_hold_ms", "1500")]).await?;
    let p = get_json(&sched.url("/v1/pressure")).await?;
    assert_eq!(p["thresholds"]["hold_ms"], HOLD_MS, "{p}");
    let w = start_worker(&ns, "w1", "", 1, &[], &[("record", rec.handler())]).await?;
    // One slot; room seeded at 4 × 1 × (1 + 1) = 8, then 20 (20 completions a second × 1 s):
    // 100 tasks of 50 ms keep the queue beyond it for 4 s, more than twice the hold.
    let envs: Vec<_> = (0..100)
        .map(|_| task("record", json!({"ms": 50}), ""))
        .collect();
    ns.submit(&envs).await?;
    let url = sched.url("/v1/pressure");
    // Every state change, sampled every 50 ms, until the work is done and green again: the
    // state, when it was entered, how many tasks had run when the test saw it, and (when the
    // test saw the very sample that made the change) its waiting, parked and load figures.
    type Change = (String, i64, usize, Option<(u64, u64, f64)>);
    let seen: std::sync::Mutex<Vec<Change>> = std::sync::Mutex::new(Vec::new());
    let back = wait_for_every(
        "a return to green after red",
        Duration::from_secs(60),
        Duration::from_millis(50),
        || async {
            let p = get_json(&url).await.ok()?;
            let state = p["state"].as_str().unwrap_or("").to_string();
            let Some(since) = p["since_ms"].as_i64() else {
                return Some(Err(anyhow::anyhow!("no since_ms: {p}")));
            };
            let mut changes = seen.lock().ok()?;
            if changes.last().map(|c| (c.0.as_str(), c.1)) != Some((state.as_str(), since)) {
                let figures = (p["sampled_at_ms"].as_i64() == Some(since)).then(|| {
                    (
                        p["waiting"].as_u64().unwrap_or(u64::MAX),
                        p["parked"].as_u64().unwrap_or(u64::MAX),
                        p["load"].as_f64().unwrap_or(1.0),
                    )
                });
                changes.push((state.clone(), since, rec.count(), figures));
            }
            (rec.count() == 100 && state == "green" && changes.iter().any(|c| c.0 == "red"))
                .then_some(Ok(()))
        },
    )
    .await;
    let changes = seen.into_inner().map_err(|_| anyhow::anyhow!("poisoned"))?;
    back.with_context(|| format!("no return to green: {changes:?}"))??;
    println!("pressure changes: {changes:?}");
    let rank = |s: &str| ["green", "yellow", "red"].iter().position(|x| *x == s);
    let (mut downs, mut held) = (0, 0);
    for pair in changes.windows(2) {
        let ((a, ta, _, _), (b, tb, done, figures)) = (&pair[0], &pair[1]);
        if rank(b) < rank(a) {
            downs += 1;
            if *done < 80 {
                // More than a room (20 tasks) still queued: the queue is beyond the room, so the
                // fleet has not run dry and the dwell holds.
                held += 1;
                assert!(
                    tb - ta >= HOLD_MS,
                    "{a} gave way to {b} after {} ms (< {HOLD_MS}) with {done} of 100 run: {changes:?}",
                    tb - ta
                );
            } else if tb - ta < HOLD_MS {
                // Early only when run dry: nothing waiting or parked, the slot not busy.
                let Some((waiting, parked, load)) = figures else {
                    anyhow::bail!("an early {a} to {b} whose sample the test missed: {changes:?}");
                };
                assert!(
                    *waiting == 0 && *parked == 0 && *load < 0.68,
                    "{a} gave way to {b} after {} ms, not dry: {changes:?}",
                    tb - ta
                );
            }
        }
    }
    assert!(downs >= 1, "the state came down at least once: {changes:?}");
    assert!(
        held >= 1,
        "the state came down at least once while work was queued beyond the room: {changes:?}"
    );
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// A handler that holds each run until the test opens its task's gate.
fn held(gate: &Gate) -> std::sync::Arc<dyn fleet_worker::executor::Handler> {
    let gate = gate.clone();
    handler_fn(move |ctx| {
        let gate = gate.clone();
        async move {
            gate.pass(&ctx.envelope.id).await;
            Ok(json!({}))
        }
    })
}

fn table(out: &str) -> Vec<Vec<String>> {
    out.lines()
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

/// Right after tasks start, a group's load and its worker's running are the same figure in
/// the API and in fleetctl (one source: the run records) — before, the worker's figure was its
/// last heartbeat's (here every 5 s) and read 0 while the group's load read 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn groups_and_workers_show_the_same_running_figure() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let hold = Gate::default();
    let sched = start_scheduler(&ns, &[]).await?;
    let w = start_worker(
        &ns,
        "w-run",
        "",
        3,
        &[
            ("heartbeat_interval_ms", "5000"),
            ("heartbeat_timeout_ms", "20000"),
        ],
        &[("hold", held(&hold))],
    )
    .await?;
    // The first heartbeat (it carries running 0) written: the worker's `hb` is past the
    // `started` its registration wrote.
    let key = ns.names.worker("w-run");
    wait_for(
        "the first heartbeat of w-run",
        Duration::from_secs(10),
        || async {
            let cmd = deadpool_redis::redis::cmd("HMGET")
                .arg(&key)
                .arg("hb")
                .arg("started")
                .to_owned();
            let at: Vec<Option<i64>> = ns.store.query(&cmd).await.ok()?;
            matches!(at.as_slice(), [Some(hb), Some(started)] if hb > started).then_some(())
        },
    )
    .await?;
    let envs: Vec<_> = (0..3).map(|_| task("hold", json!({}), "")).collect();
    ns.submit(&envs).await?;
    let groups = wait_for("group load 3", Duration::from_secs(10), || async {
        let g = get_json(&sched.url("/v1/groups")).await.ok()?;
        (g[0]["load"] == 3).then_some(g)
    })
    .await?;
    let workers = get_json(&sched.url("/v1/workers")).await?;
    assert_eq!(
        (workers[0]["running"].as_u64(), groups[0]["load"].as_u64()),
        (Some(3), Some(3)),
        "workers: {workers}\ngroups: {groups}"
    );
    assert!(
        workers[0]["heartbeat_at"]
            .as_str()
            .is_some_and(|t| t.ends_with('Z')),
        "the sampled figures say as of when: {workers}"
    );
    let api = format!("http://{}", sched.addr);
    let (code, gout, err) = fleetctl(&ns, &api, &["groups"]).await?;
    assert_eq!(code, 0, "{err}");
    let (code, wout, err) = fleetctl(&ns, &api, &["workers"]).await?;
    assert_eq!(code, 0, "{err}");
    println!("fleetctl groups:\n{gout}\nfleetctl workers:\n{wout}");
    let (g, wt) = (table(&gout), table(&wout));
    assert_eq!(g[0][3], "LOAD");
    assert_eq!(wt[0][4], "RUNNING(N+C)");
    assert_eq!(
        (g[1][3].as_str(), wt[1][4].as_str()),
        ("3", "3+0"),
        "fleetctl groups LOAD = fleetctl workers RUNNING"
    );
    for e in &envs {
        hold.open(&e.id);
    }
    ns.wait_settled(Duration::from_secs(20)).await?;
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// `failed` is one figure: attempts whose handler failed (retried + dead) — in the API, in
/// the worker's `/status` and in fleetctl; the outcome that could not be recorded is
/// `unrecorded` everywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failed_means_retried_plus_dead_in_every_view() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &[]).await?;
    let flaky = handler_fn(|ctx| async move {
        if ctx.envelope.payload["die"] == true {
            Err(TaskError::permanent("no"))
        } else if ctx.attempt == 1 {
            Err(TaskError::retryable("once"))
        } else {
            Ok(json!({}))
        }
    });
    let w = start_worker(&ns, "w-fail", "", 2, &[], &[("flaky", flaky)]).await?;
    let retried = task("flaky", json!({}), "");
    let dead = task("flaky", json!({"die": true}), "");
    ns.submit(&[retried.clone(), dead.clone()]).await?;
    ns.wait_state(&retried.id, "succeeded", Duration::from_secs(20))
        .await?;
    ns.wait_state(&dead.id, "dead", Duration::from_secs(20))
        .await?;
    let wv = wait_for("the worker's figures", Duration::from_secs(10), || async {
        let ws = get_json(&sched.url("/v1/workers")).await.ok()?;
        let w = ws.as_array()?.first()?.clone();
        (w["succeeded"] == 1 && w["retried"] == 1 && w["dead"] == 1).then_some(w)
    })
    .await?;
    assert_eq!(
        (wv["failed"].as_u64(), wv["unrecorded"].as_u64()),
        (Some(2), Some(0)),
        "{wv}"
    );
    let st = get_json(&format!("http://{}/status", w.addr)).await?;
    assert_eq!(
        (
            st["failed"].as_u64(),
            st["unrecorded"].as_u64(),
            st["outcomes"]["retried"].as_u64(),
            st["outcomes"]["dead"].as_u64(),
            st["outcomes"]["unrecorded"].as_u64(),
            st["outcomes"].get("failed"),
        ),
        (Some(2), Some(0), Some(1), Some(1), Some(0), None),
        "{st}"
    );
    let api = format!("http://{}", sched.addr);
    let (code, out, err) = fleetctl(&ns, &api, &["workers"]).await?;
    assert_eq!(code, 0, "{err}");
    let t = table(&out);
    assert_eq!(
        t[0][5..10],
        ["SUCCEEDED", "RETRIED", "DEAD", "EXPIRED", "UNRECORDED"],
        "{out}"
    );
    assert_eq!(t[1][5..10], ["1", "1", "1", "0", "0"], "{out}");
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// Tasks no group holds (no live worker matches their selector) are not under any group's
/// BACKLOG: `fleetctl groups` names them on a line of their own, the figure `GET /v1/scaling`
/// has (`unrouted.unmatched`) for the same sample.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fleetctl_groups_names_the_tasks_waiting_for_a_worker() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let sched = start_scheduler(&ns, &[("stats_interval_ms", "200")]).await?;
    let envs: Vec<_> = (0..2)
        .map(|_| task("echo", json!({}), "zone=nowhere"))
        .collect();
    ns.submit(&envs).await?;
    let sc = wait_for(
        "2 waiting for a worker",
        Duration::from_secs(15),
        || async {
            let sc = get_json(&sched.url("/v1/scaling")).await.ok()?;
            (sc["unrouted"]["unmatched"] == 2).then_some(sc)
        },
    )
    .await?;
    let api = format!("http://{}", sched.addr);
    let (code, out, err) = fleetctl(&ns, &api, &["groups"]).await?;
    assert_eq!(code, 0, "{err}");
    println!("fleetctl groups:\n{out}\nscaling: {}", sc["unrouted"]);
    let line = out
        .lines()
        .find(|l| l.starts_with("not in any group:"))
        .unwrap_or_default();
    assert!(
        line.starts_with("not in any group: 2 waiting for a worker, 0 held by a kind pause, 0 not yet due (as of "),
        "{out}"
    );
    sched.stop().await?;
    ns.cleanup().await
}

/// `fleetctl groups` has the same columns before and after the first probe, and shows the
/// backlog and the oldest waiting task's age as the API has them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fleetctl_groups_shows_the_backlog_with_stable_columns() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let hold = Gate::default();
    // No probe before the first table; stats every 200 ms.
    let sched = start_scheduler(
        &ns,
        &[
            ("probe_interval_ms", "600000"),
            ("stats_interval_ms", "200"),
        ],
    )
    .await?;
    let w = start_worker(&ns, "w-b", "", 1, &[], &[("hold", held(&hold))]).await?;
    // One runs, two wait in the group's queue.
    let envs: Vec<_> = (0..3).map(|_| task("hold", json!({}), "")).collect();
    ns.submit(&envs).await?;
    let g = wait_for("backlog 2", Duration::from_secs(10), || async {
        let g = get_json(&sched.url("/v1/groups")).await.ok()?;
        let g: Value = g.as_array()?.first()?.clone();
        (g["backlog"] == 2 && g["oldest_task_age_seconds"].as_f64()? > 0.0).then_some(g)
    })
    .await?;
    let api = format!("http://{}", sched.addr);
    let (code, out, err) = fleetctl(&ns, &api, &["groups"]).await?;
    assert_eq!(code, 0, "{err}");
    println!("fleetctl groups:\n{out}\nAPI: {g}");
    let t = table(&out);
    // "CRITICAL CAP/LOAD" and "AS OF" are two words each.
    assert_eq!(
        t[0],
        [
            "GROUP", "WORKERS", "CAPACITY", "LOAD", "RESERVED", "CRITICAL", "CAP/LOAD", "BACKLOG",
            "OLDEST", "AS", "OF", "PROBE", "PAUSED"
        ],
        "{out}"
    );
    let row = &t[1];
    assert_eq!(row.len(), 11, "{out}");
    assert_eq!(row[6], "2", "backlog: {out}");
    assert!(row[7].ends_with('s') && row[7] != "-", "oldest: {out}");
    assert_eq!(row[9], "-", "no probe yet: {out}");
    assert_eq!(row[10], "-", "not paused: {out}");
    for e in &envs {
        hold.open(&e.id);
    }
    ns.wait_settled(Duration::from_secs(20)).await?;
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// Groups whose slots are free but take nothing — their one worker each frozen with SIGSTOP,
/// not evicted yet (heartbeat timeout 60 s) — do not drain: the choice tasks beyond their
/// rooms park, far fewer than four rooms, and once nothing has drained for the stall window
/// (2 s) the whole park counts and the intake gate closes (Red). A park of up to four rooms
/// ahead of free slots that drains does not count (the benchmark's 10-group burst); this is
/// the other side. Resumed with SIGCONT, every task runs exactly once and the state is Green
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_park_ahead_of_free_slots_that_does_not_drain_closes_the_intake() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let ep = Endpoint::start(5).await?;
    let sched = start_scheduler(
        &ns,
        &[
            ("max_pending", "20"),
            ("heartbeat_timeout_ms", "60000"),
            ("pressure_hold_ms", "500"),
            // The release loop holds at most a batch out of a park (unacked, not in its depth).
            ("batch_max", "16"),
        ],
    )
    .await?;
    let mut frozen = Vec::new();
    for zone in ["a", "b"] {
        let labels = format!("pool=fz,zone={zone}");
        frozen.push(
            WorkerProcess::start(
                &ns,
                &ProcessSpec {
                    id: &format!("w-fz-{zone}"),
                    labels: &labels,
                    capacity: 2,
                    endpoint: &ep.url,
                    extra: &[],
                },
            )
            .await?,
        );
    }
    let url = sched.url("/v1/pressure");
    let p = get_json(&url).await?;
    assert_eq!(p["state"], "green", "{p}");
    for w in &frozen {
        w.signal("STOP")?;
    }
    let stopped = std::time::Instant::now();
    // Two candidates each: rooms of 2 × (1 + 1) × 4 (seeded) = 16 per group fill, the rest
    // parks: 100 − 32 − the release loop's hold (16) wait in the park queues.
    let envs = jobs(100, "pool=fz", None);
    let ids: Vec<String> = envs.iter().map(|e| e.id.clone()).collect();
    assert_eq!(ns.submit(&envs).await?, (100, 0));
    let last = std::sync::Mutex::new(Value::Null);
    let red = wait_for(
        "the intake gate closed",
        Duration::from_secs(30),
        || async {
            let p = get_json(&url).await.ok()?;
            if let Ok(mut l) = last.lock() {
                *l = p.clone();
            }
            (p["state"] == "red").then_some(p)
        },
    )
    .await;
    let red = match red {
        Ok(r) => r,
        Err(e) => {
            let st = count_states(&states(&ns, &ids).await?);
            let depths = sched_depths(&ns).await;
            anyhow::bail!(
                "{e}: last sample {:?}; states {st:?}; {depths}",
                last.lock().map(|l| l.clone())
            )
        }
    };
    let after = stopped.elapsed();
    println!(
        "undrained park: Red {} ms after SIGSTOP: {red}",
        after.as_millis()
    );
    assert_eq!(red["gate"], "red", "{red}");
    assert!(
        red["parked"].as_u64() >= Some(18) && red["waiting"].as_u64() >= Some(18),
        "the park is what closed it: {red}"
    );
    // Not before the stall window (2 s from the last sample at which the groups drained,
    // which may precede the SIGSTOP by one pressure interval: 100 ms in tests).
    assert!(
        after >= Duration::from_millis(1800),
        "not before the stall: {} ms",
        after.as_millis()
    );
    for w in &frozen {
        w.signal("CONT")?;
    }
    wait_succeeded(&ns, &ids, Duration::from_secs(60)).await?;
    let calls = ep.calls();
    let mut per: HashMap<String, usize> = HashMap::new();
    for c in &calls {
        *per.entry(c.id.clone()).or_default() += 1;
    }
    assert_eq!(
        (per.len(), calls.len()),
        (100, 100),
        "every task ran exactly once"
    );
    wait_for("Green again", Duration::from_secs(20), || async {
        let p = get_json(&url).await.ok()?;
        (p["state"] == "green").then_some(())
    })
    .await?;
    for mut w in frozen {
        w.signal("TERM")?;
        w.wait_exit(Duration::from_secs(20)).await?;
    }
    sched.stop().await?;
    ns.cleanup().await
}

async fn sched_depths(ns: &Ns) -> String {
    let mut out = String::new();
    if let Ok(gs) = ns.store.groups().await {
        for g in gs {
            let park = ns.names.park_queue(&g.group, fleet::Lane::Normal);
            let q = ns.names.group_queue(&g.group, fleet::Lane::Normal);
            out += &format!(
                "{}: queue {} park {}; ",
                g.group,
                ns.depth(&q).await,
                ns.depth(&park).await
            );
        }
    }
    out
}
