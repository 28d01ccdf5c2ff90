//! Periodic schedules end to end, against the real RabbitMQ and Redis: every tick fired once
//! across scheduler replicas (one of them a process killed mid-way), `skip` vs `catch_up`
//! after every scheduler stopped for 5 s, pause/resume and fire-now through `fleetctl`, and
//! definitions surviving a Redis FLUSHALL (on a private `redis-server`); the first tick after
//! a creation, real-time pace through a DST fall-back and the `catch_up_max` bound after a 6 h
//! outage (on a private `redis-server` whose `TIME` libfaketime shifts), and creation racing
//! on two replicas (issue 30 items 1-4).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use chrono::{DateTime, Datelike, SecondsFormat, Timelike, Utc};
use fleet_tests::*;
use fleet_worker::executor::{handler_fn, Handler, TaskError};
use serde_json::{json, Value};

/// Kind of the scheduled tasks; the recording handler below runs it.
const KIND: &str = "tick";
const LABELS: &str = "role=cron";

/// Every run of a scheduled task: id → (attempts seen, `submitted_at` of the first).
#[derive(Clone, Default)]
struct Runs(Arc<Mutex<BTreeMap<String, RunsOf>>>);

/// One task's runs: (attempts seen, `submitted_at` of the first).
type RunsOf = (u32, DateTime<Utc>);

impl Runs {
    fn handler(&self) -> Arc<dyn Handler> {
        let runs = self.clone();
        handler_fn(move |ctx| {
            let runs = runs.clone();
            async move {
                let at = ctx.envelope.submitted_at.unwrap_or_else(Utc::now);
                let mut m = runs
                    .0
                    .lock()
                    .map_err(|_| TaskError::retryable("poisoned"))?;
                m.entry(ctx.envelope.id.clone()).or_insert((0, at)).0 += 1;
                Ok(json!({}))
            }
        })
    }

    fn snapshot(&self) -> BTreeMap<String, (u32, DateTime<Utc>)> {
        self.0.lock().map(|m| m.clone()).unwrap_or_default()
    }

    /// Ticks of schedule `name` that ran: tick → (runs, submitted_at).
    fn ticks(&self, name: &str) -> BTreeMap<DateTime<Utc>, (u32, DateTime<Utc>)> {
        let prefix = format!("{name}@");
        self.snapshot()
            .into_iter()
            .filter_map(|(id, v)| {
                let t = DateTime::parse_from_rfc3339(id.strip_prefix(&prefix)?)
                    .ok()?
                    .with_timezone(&Utc);
                Some((t, v))
            })
            .collect()
    }

    fn count(&self, name: &str) -> usize {
        self.ticks(name).len()
    }
}

fn id(name: &str, tick: DateTime<Utc>) -> String {
    format!("{name}@{}", tick.to_rfc3339_opts(SecondsFormat::Secs, true))
}

fn spec(name: &str, cron: &str, extra: Value) -> Value {
    let mut v = json!({"name": name, "cron": cron, "task": {"kind": KIND, "labels": {"role": "cron"}, "payload": {"from": name}}});
    if let (Value::Object(o), Value::Object(e)) = (&mut v, extra) {
        o.extend(e);
    }
    v
}

async fn post(url: &str, body: Option<&Value>) -> Result<(u16, Value)> {
    let c = reqwest::Client::new();
    let r = match body {
        Some(b) => c.post(url).json(b).send().await?,
        // The API takes only JSON bodies on POST (415 otherwise).
        None => c.post(url).json(&serde_json::json!({})).send().await?,
    };
    let status = r.status().as_u16();
    Ok((status, r.json().await.unwrap_or(Value::Null)))
}

async fn add(s: &SchedulerHandle, spec: &Value) -> Result<()> {
    let (status, body) = post(&s.url("/v1/schedules"), Some(spec)).await?;
    ensure!(status == 201, "POST /v1/schedules: {status} {body}");
    Ok(())
}

/// Waits until the replica at `url` lists schedule `name` (it applies the stream on its own).
async fn wait_listed(base: &str, name: &str) -> Result<Value> {
    let url = format!("{base}/v1/schedules/{name}");
    wait_for(
        &format!("schedule {name} at {base}"),
        Duration::from_secs(10),
        || {
            let u = url.clone();
            async move { get_json(&u).await.ok() }
        },
    )
    .await
}

async fn metrics_page(s: &SchedulerHandle) -> Result<String> {
    Ok(reqwest::get(s.url("/metrics")).await?.text().await?)
}

/// Ten consecutive whole seconds starting 3 to 15 s from now, inside one minute (so one cron
/// expression names exactly them): the first of them.
fn ten_second_window() -> DateTime<Utc> {
    let mut start = (Utc::now() + chrono::Duration::seconds(3))
        .with_nanosecond(0)
        .unwrap_or_else(Utc::now);
    if start.second() > 50 {
        start += chrono::Duration::seconds(i64::from(60 - start.second()));
    }
    start
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_fire_each_of_ten_ticks_once_while_one_is_killed() -> Result<()> {
    own_process!();
    let ns = Ns::new().await?;
    let runs = Runs::default();
    let w = start_worker(&ns, "w1", LABELS, 8, &[], &[(KIND, runs.handler())]).await?;
    // Tolerance above the claim lease: a tick claimed by the killed replica is taken over.
    let settings = [
        ("schedule_tolerance_ms", "5000"),
        ("schedule_poll_ms", "100"),
    ];
    // The killed replica runs as a process (the harness's); no probes from it.
    let mut a = SchedulerProcess::spawn(
        &ns,
        &[settings[0], settings[1], ("probe_interval_ms", "600000")],
    )
    .await?;
    let b = start_scheduler(&ns, &settings).await?;

    let start = ten_second_window();
    let cron = format!(
        "{}-{} {} {} {} {} *",
        start.second(),
        start.second() + 9,
        start.minute(),
        start.hour(),
        start.day(),
        start.month()
    );
    let name = format!("ten-{}", ns.name);
    let (status, body) = post(
        &format!("{}/v1/schedules", a.base),
        Some(&spec(&name, &cron, json!({}))),
    )
    .await?;
    ensure!(
        status == 201,
        "POST to the process replica: {status} {body}"
    );
    // The other replica learns it from the stream.
    let listed = wait_listed(&b.url(""), &name).await?;
    assert_eq!(
        listed["next_tick"],
        json!(start.to_rfc3339_opts(SecondsFormat::Secs, true))
    );

    wait_for(
        "5 of the 10 ticks fired",
        Duration::from_secs(30),
        || async { (runs.count(&name) >= 5).then_some(()) },
    )
    .await?;
    a.kill9()?;
    let end = start + chrono::Duration::seconds(9);
    wait_for("all 10 ticks fired", Duration::from_secs(30), || async {
        (runs.count(&name) >= 10).then_some(())
    })
    .await?;
    // Nothing more may come: until the window plus the tolerance has passed.
    let quiet = (end + chrono::Duration::seconds(6) - Utc::now())
        .to_std()
        .unwrap_or_default();
    quiet_for(quiet, "no 11th fire within the window and its tolerance").await;

    let expected: BTreeSet<String> = (0..10)
        .map(|i| id(&name, start + chrono::Duration::seconds(i)))
        .collect();
    let got = runs.snapshot();
    let ids: BTreeSet<String> = got.keys().cloned().collect();
    assert_eq!(
        ids, expected,
        "exactly the 10 ticks of the window, no gap, nothing else"
    );
    for (id, (n, _)) in &got {
        assert_eq!(*n, 1, "{id} ran {n} times");
    }
    let page = metrics_page(&b).await?;
    assert_eq!(
        metric_sum(&page, "fleet_schedule_misses_total", &[("schedule", &name)]),
        0.0
    );
    let by_b = metric_sum(&page, "fleet_schedule_fires_total", &[("schedule", &name)]);
    assert!(
        (1.0..=10.0).contains(&by_b),
        "the surviving replica fired {by_b} of the ticks"
    );
    let lag = metric_sum(
        &page,
        "fleet_schedule_lag_seconds_sum",
        &[("schedule", &name)],
    ) / by_b;
    eprintln!(
        "replica b fired {by_b} of 10 ticks, mean lag tick -> confirmed submission {:.1} ms",
        lag * 1000.0
    );

    b.stop().await?;
    w.stop().await?;
    ns.cleanup().await
}

/// For one schedule, from its first to its last fired tick: every tick fired exactly once or
/// counted missed exactly once. Returns (fired, missed-in-between, fired late = caught up).
fn account(runs: &Runs, name: &str, tolerance: chrono::Duration) -> Result<(usize, usize, usize)> {
    let ticks = runs.ticks(name);
    let (Some(first), Some(last)) = (ticks.keys().next().copied(), ticks.keys().last().copied())
    else {
        bail!("{name} never fired")
    };
    for (t, (n, _)) in &ticks {
        ensure!(*n == 1, "{} ran {n} times", id(name, *t));
    }
    let span = (last - first).num_seconds() as usize + 1;
    let late = ticks
        .iter()
        .filter(|(t, (_, at))| *at - **t > tolerance)
        .count();
    Ok((ticks.len(), span - ticks.len(), late))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn skip_and_catch_up_after_every_scheduler_stopped_for_5_s() -> Result<()> {
    own_process!();
    let ns = Ns::new().await?;
    let runs = Runs::default();
    let w = start_worker(&ns, "w1", LABELS, 8, &[], &[(KIND, runs.handler())]).await?;
    let settings = [
        ("schedule_tolerance_ms", "2000"),
        ("schedule_poll_ms", "100"),
    ];
    let s1 = start_scheduler(&ns, &settings).await?;
    let s2 = start_scheduler(&ns, &settings).await?;
    let skip = format!("skip-{}", ns.name);
    let catch = format!("catch-{}", ns.name);
    add(&s1, &spec(&skip, "* * * * * *", json!({}))).await?;
    add(
        &s1,
        &spec(
            &catch,
            "* * * * * *",
            json!({"missed": "catch_up", "catch_up_max": 2}),
        ),
    )
    .await?;
    wait_for("3 fires of each", Duration::from_secs(20), || async {
        (runs.count(&skip) >= 3 && runs.count(&catch) >= 3).then_some(())
    })
    .await?;

    s1.stop().await?;
    s2.stop().await?;
    let before = (runs.count(&skip), runs.count(&catch));
    scenario_pause(
        Duration::from_secs(5),
        "the outage under test: no scheduler",
    )
    .await;
    let s3 = start_scheduler(&ns, &settings).await?;
    wait_for(
        "3 more fires of each after the restart",
        Duration::from_secs(20),
        || async {
            (runs.count(&skip) >= before.0 + 3 && runs.count(&catch) >= before.1 + 3).then_some(())
        },
    )
    .await?;
    s3.stop().await?;

    let page = metrics_page_of_process().await;
    let tol = chrono::Duration::seconds(2);
    let (_, skip_gap, skip_late) = account(&runs, &skip, tol)?;
    let skipped = metric_sum(
        &page,
        "fleet_schedule_misses_total",
        &[("schedule", &skip), ("reason", "skipped")],
    ) as usize;
    assert_eq!(skip_late, 0, "skip fires nothing late");
    assert!(
        skip_gap >= 3,
        "a 5 s outage with a 2 s tolerance leaves at least 3 ticks unfired, got {skip_gap}"
    );
    assert_eq!(
        skipped, skip_gap,
        "every unfired tick of `skip` is counted missed (skipped) exactly once"
    );
    assert_eq!(
        metric_sum(&page, "fleet_schedule_misses_total", &[("schedule", &skip)]) as usize,
        skipped
    );

    // Every fire counted once, with its lag (all three replicas ran in this process).
    let fired = runs.count(&skip) as f64;
    assert_eq!(
        metric_sum(
            &page,
            "fleet_schedule_fires_total",
            &[("schedule", &skip), ("trigger", "cron")]
        ),
        fired
    );
    assert_eq!(
        metric_sum(
            &page,
            "fleet_schedule_lag_seconds_count",
            &[("schedule", &skip)]
        ),
        fired
    );
    let lag = metric_sum(
        &page,
        "fleet_schedule_lag_seconds_sum",
        &[("schedule", &skip)],
    ) / fired;
    eprintln!(
        "mean lag tick -> confirmed submission: {:.1} ms over {fired} fires",
        lag * 1000.0
    );
    assert!(
        lag < 2.0,
        "on-time fires are submitted within the tolerance, mean lag {lag} s"
    );

    let (_, catch_gap, catch_late) = account(&runs, &catch, tol)?;
    let limited = metric_sum(
        &page,
        "fleet_schedule_misses_total",
        &[("schedule", &catch), ("reason", "catch_up_limit")],
    ) as usize;
    assert_eq!(
        catch_late, 2,
        "catch_up fires exactly catch_up_max = 2 missed ticks late"
    );
    assert!(
        catch_gap >= 1,
        "the older missed ticks beyond the bound stay unfired"
    );
    assert_eq!(
        limited, catch_gap,
        "every unfired tick of `catch_up` is counted missed (catch_up_limit) exactly once"
    );
    // The caught-up ticks are the most recent missed ones: after the first fire following the
    // outage, no tick is missing.
    let ticks: Vec<DateTime<Utc>> = runs.ticks(&catch).into_keys().collect();
    let holes: Vec<_> = ticks
        .windows(2)
        .filter(|w| (w[1] - w[0]).num_seconds() > 1)
        .collect();
    assert_eq!(
        holes.len(),
        1,
        "one hole, before the caught-up ticks: {holes:?}"
    );

    w.stop().await?;
    ns.cleanup().await
}

/// The process-wide metrics (every in-process scheduler shares one recorder).
async fn metrics_page_of_process() -> String {
    fleet::metrics::install().render()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn paused_fires_nothing_and_fleetctl_manages_schedules() -> Result<()> {
    let ns = Ns::new().await?;
    let runs = Runs::default();
    let w = start_worker(&ns, "w1", LABELS, 8, &[], &[(KIND, runs.handler())]).await?;
    let s = start_scheduler(
        &ns,
        &[
            ("schedule_tolerance_ms", "2000"),
            ("schedule_poll_ms", "100"),
        ],
    )
    .await?;
    let api = s.url("");
    let name = format!("p-{}", ns.name);

    // Refusals name the problem; nothing is recorded.
    let (st, body) = post(
        &s.url("/v1/schedules"),
        Some(&spec(&name, "61 * * * * *", json!({}))),
    )
    .await?;
    assert_eq!(
        (st, body["error"].as_str()),
        (400, Some("bad_schedule")),
        "{body}"
    );
    let (code, _, err) = fleetctl(
        &ns,
        &api,
        &[
            "schedule",
            "add",
            &name,
            "--cron",
            "* * * * * *",
            "--kind",
            KIND,
            "--timezone",
            "Mars/Olympus",
        ],
    )
    .await?;
    assert_eq!(code, 1);
    assert!(err.contains("Mars/Olympus"), "{err}");

    // Added paused: nothing fires.
    let (code, out, err) = fleetctl(
        &ns,
        &api,
        &[
            "schedule",
            "add",
            &name,
            "--cron",
            "* * * * * *",
            "--kind",
            KIND,
            "--labels",
            LABELS,
            "--payload",
            r#"{"x":1}"#,
            "--paused",
        ],
    )
    .await?;
    assert_eq!(code, 0, "{out}{err}");
    let (code, _, err) = fleetctl(
        &ns,
        &api,
        &[
            "schedule",
            "add",
            &name,
            "--cron",
            "* * * * * *",
            "--kind",
            KIND,
        ],
    )
    .await?;
    assert_eq!(code, 1);
    assert!(err.contains("exists"), "{err}");
    quiet_for(Duration::from_secs(3), "a paused schedule stays silent").await;
    assert_eq!(runs.count(&name), 0, "a paused schedule fired");
    let (code, out, _) = fleetctl(&ns, &api, &["schedule", "list"]).await?;
    assert_eq!(code, 0);
    let row = out
        .lines()
        .find(|l| l.contains(&name))
        .context("schedule list row")?;
    assert!(row.contains("paused"), "{row}");

    // Fire now works while paused (an operator's explicit action), through admission.
    let (code, out, err) = fleetctl(&ns, &api, &["schedule", "fire-now", &name]).await?;
    assert_eq!(code, 0, "{err}");
    let manual = out.trim().to_string();
    assert!(manual.starts_with(&format!("{name}@")), "{out}");
    wait_for("the manual fire ran", Duration::from_secs(10), || async {
        runs.snapshot().contains_key(&manual).then_some(())
    })
    .await?;

    // Resumed: fires from now on, nothing of the paused time.
    let resumed_at = Utc::now();
    let (code, _, err) = fleetctl(&ns, &api, &["schedule", "resume", &name]).await?;
    assert_eq!(code, 0, "{err}");
    wait_for("2 fires after resume", Duration::from_secs(10), || async {
        (runs.count(&name) >= 2).then_some(())
    })
    .await?;
    let (code, _, err) = fleetctl(&ns, &api, &["schedule", "pause", &name]).await?;
    assert_eq!(code, 0, "{err}");
    let paused_at = Utc::now();
    let n = runs.count(&name);
    quiet_for(Duration::from_secs(3), "paused again: silent").await;
    let ticks = runs.ticks(&name);
    assert!(
        ticks.len() <= n + 1,
        "at most a tick in flight at the pause may land: {} then {}",
        n,
        ticks.len()
    );
    for t in ticks.keys() {
        assert!(
            *t >= resumed_at - chrono::Duration::seconds(1)
                && *t <= paused_at + chrono::Duration::seconds(1),
            "tick {t} outside the enabled window"
        );
    }

    // Remove: gone from the list, and unknown afterwards.
    let (code, _, err) = fleetctl(&ns, &api, &["schedule", "rm", &name]).await?;
    assert_eq!(code, 0, "{err}");
    let list = get_json(&s.url("/v1/schedules")).await?;
    assert_eq!(list, json!([]));
    let (code, _, err) = fleetctl(&ns, &api, &["schedule", "pause", &name]).await?;
    assert_eq!(code, 1);
    assert!(err.contains("no schedule"), "{err}");

    s.stop().await?;
    w.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_flushall_loses_no_schedule() -> Result<()> {
    let redis = PrivateRedis::start(None, None).await?;
    let ns = Ns::on_redis(&redis.url(None)).await?;
    let runs = Runs::default();
    let w = start_worker(&ns, "w1", LABELS, 8, WORKER, &[(KIND, runs.handler())]).await?;
    let settings = [
        ("schedule_tolerance_ms", "3000"),
        ("schedule_poll_ms", "100"),
    ];
    let s = start_scheduler(&ns, &settings).await?;
    let name = format!("f-{}", ns.name);
    add(&s, &spec(&name, "* * * * * *", json!({}))).await?;
    let other = format!("g-{}", ns.name);
    add(
        &s,
        &spec(
            &other,
            "0 0 0 1 1 * 2099",
            json!({"timezone": "Europe/Berlin"}),
        ),
    )
    .await?;
    wait_for("2 fires", Duration::from_secs(15), || async {
        (runs.count(&name) >= 2).then_some(())
    })
    .await?;

    redis.flushall().await?;
    let n = runs.count(&name);
    wait_for(
        "fires go on after FLUSHALL",
        Duration::from_secs(20),
        || async { (runs.count(&name) >= n + 2).then_some(()) },
    )
    .await?;
    s.stop().await?;

    // A scheduler started after the loss reads every definition back from the broker.
    redis.flushall().await?;
    let s2 = start_scheduler(&ns, &settings).await?;
    let list = get_json(&s2.url("/v1/schedules")).await?;
    let names: BTreeSet<&str> = list
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v["name"].as_str())
        .collect();
    assert_eq!(names, BTreeSet::from([name.as_str(), other.as_str()]));
    let g = list
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["name"] == json!(other))
        .context("g")?;
    assert_eq!(g["timezone"], "Europe/Berlin");
    assert_eq!(g["next_tick"], "2098-12-31T23:00:00Z");
    let n = runs.count(&name);
    wait_for(
        "fires from the new scheduler",
        Duration::from_secs(20),
        || async { (runs.count(&name) >= n + 2).then_some(()) },
    )
    .await?;
    s2.stop().await?;
    for (id, (k, _)) in runs.snapshot() {
        assert_eq!(k, 1, "{id} ran {k} times");
    }

    w.stop().await?;
    ns.cleanup().await
}

/// Redis fails the schedule's calls while ticks are due: for 3 s every script call is refused
/// (ACL), while `TIME` is still answered — so each poll reads the time, moves past the due
/// ticks, and its tick claim fails. Those ticks stay pending and fire once Redis answers,
/// within their tolerance, each once — before, a failed call dropped them (neither fired nor
/// counted missed).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failed_tick_claims_lose_no_tick() -> Result<()> {
    let redis = PrivateRedis::start(None, None).await?;
    let ns = Ns::on_redis(&redis.url(None)).await?;
    let runs = Runs::default();
    let w = start_worker(&ns, "w1", LABELS, 8, WORKER, &[(KIND, runs.handler())]).await?;
    let s = start_scheduler(
        &ns,
        &[
            ("schedule_tolerance_ms", "15000"),
            ("schedule_poll_ms", "100"),
        ],
    )
    .await?;
    let name = format!("p-{}", ns.name);
    add(&s, &spec(&name, "* * * * * *", json!({}))).await?;
    wait_for("2 fires", Duration::from_secs(15), || async {
        (runs.count(&name) >= 2).then_some(())
    })
    .await?;
    redis.deny_scripts(true).await?;
    scenario_pause(
        Duration::from_secs(3),
        "the outage under test: Redis refuses scripts",
    )
    .await;
    redis.deny_scripts(false).await?;
    let n = runs.count(&name);
    wait_for(
        "4 fires after the outage",
        Duration::from_secs(40),
        || async { (runs.count(&name) >= n + 4).then_some(()) },
    )
    .await?;
    s.stop().await?;
    let (fired, missed, _) = account(&runs, &name, chrono::Duration::seconds(15))?;
    println!("script outage: {fired} ticks fired, {missed} between the first and the last did not");
    ensure!(
        missed == 0,
        "{missed} ticks between the first and the last fired tick never ran"
    );
    w.stop().await?;
    ns.cleanup().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_red_fleet_refuses_fires_which_are_counted_missed_then_fire_again() -> Result<()> {
    own_process!();
    let ns = Ns::new().await?;
    let runs = Runs::default();
    let (release, released) = tokio::sync::watch::channel(false);
    let block = handler_fn(move |_ctx| {
        let mut r = released.clone();
        async move {
            let _ = tokio::time::timeout(Duration::from_secs(60), r.wait_for(|v| *v)).await;
            Ok(json!({}))
        }
    });
    // One normal slot held by blocking tasks, and work beyond the group's room (seeded at
    // 1 × 2 × 4 = 8): 21 tasks put 13 beyond it, at max_pending 10 the fleet is Red (intake
    // closed). A full slot alone is a busy fleet, Green (issue 29 item 3).
    let w = start_worker(
        &ns,
        "w1",
        LABELS,
        1,
        &[],
        &[(KIND, runs.handler()), ("block", block)],
    )
    .await?;
    let s = start_scheduler(
        &ns,
        &[
            ("schedule_tolerance_ms", "1000"),
            ("schedule_poll_ms", "100"),
            ("max_pending", "10"),
        ],
    )
    .await?;
    let blocks: Vec<_> = (0..21)
        .map(|_| fleet_tests::task("block", json!({}), LABELS))
        .collect();
    ns.submit(&blocks).await?;
    wait_for("pressure red", Duration::from_secs(10), || async {
        let p = get_json(&s.url("/v1/pressure")).await.ok()?;
        (p["state"] == "red").then_some(())
    })
    .await?;

    let name = format!("red-{}", ns.name);
    add(&s, &spec(&name, "* * * * * *", json!({}))).await?;
    let missed = |page: &str| {
        metric_sum(
            page,
            "fleet_schedule_misses_total",
            &[("schedule", &name), ("reason", "pressure_red")],
        )
    };
    wait_for(
        "2 ticks missed as pressure_red",
        Duration::from_secs(15),
        || async {
            let page = metrics_page(&s).await.ok()?;
            (missed(&page) >= 2.0).then_some(())
        },
    )
    .await?;
    // Fire-now is refused the same way, with Retry-After.
    let r = reqwest::Client::new()
        .post(s.url(&format!("/v1/schedules/{name}/fire")))
        .json(&serde_json::json!({}))
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 429);
    assert!(r.headers().get("retry-after").is_some());
    assert_eq!(runs.count(&name), 0, "nothing fired while Red");

    release.send_replace(true);
    wait_for(
        "fires after the fleet turned green",
        Duration::from_secs(15),
        || async { (runs.count(&name) >= 2).then_some(()) },
    )
    .await?;
    s.stop().await?;
    // Every tick from the schedule's first to its last fire was either fired once or counted
    // missed once, and before the first fire only misses.
    let page = metrics_page_of_process().await;
    let (fired, gap, late) = account(&runs, &name, chrono::Duration::seconds(1))?;
    assert_eq!(gap, 0, "no tick missing once the fleet was green again");
    assert_eq!(late, 0);
    assert_eq!(
        metric_sum(
            &page,
            "fleet_schedule_fires_total",
            &[("schedule", &name), ("trigger", "cron")]
        ) as usize,
        fired
    );
    assert_eq!(
        metric_sum(&page, "fleet_schedule_misses_total", &[("schedule", &name)]),
        missed(&page),
        "misses are all pressure_red"
    );
    assert!(missed(&page) >= 2.0);

    w.stop().await?;
    ns.cleanup().await
}

const LIBFAKETIME: &[&str] = &[
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketime.so.1",
    "/usr/lib/faketime/libfaketime.so.1",
];

/// Routes `redis-server`'s allocations to glibc's: Debian's redis-server is linked with
/// jemalloc, which reads the clock while libfaketime initialises ("Unexpected recursive calls
/// to clock_gettime()" and the server never starts). Built with `cc` into the test's directory.
const GLIBC_MALLOC_SHIM: &str = r#"#define _GNU_SOURCE
#include <stddef.h>
#include <errno.h>
#include <dlfcn.h>
extern void *__libc_malloc(size_t);
extern void __libc_free(void *);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);
extern void *__libc_valloc(size_t);
extern void *__libc_pvalloc(size_t);
void *malloc(size_t n) { return __libc_malloc(n); }
void free(void *p) { __libc_free(p); }
void *calloc(size_t a, size_t b) { return __libc_calloc(a, b); }
void *realloc(void *p, size_t n) { return __libc_realloc(p, n); }
void *memalign(size_t a, size_t n) { return __libc_memalign(a, n); }
void *aligned_alloc(size_t a, size_t n) { return __libc_memalign(a, n); }
void *valloc(size_t n) { return __libc_valloc(n); }
void *pvalloc(size_t n) { return __libc_pvalloc(n); }
int posix_memalign(void **r, size_t a, size_t n) { void *p = __libc_memalign(a, n); if (!p) return ENOMEM; *r = p; return 0; }
size_t malloc_usable_size(void *p) {
  static size_t (*f)(void *);
  if (!f) { void *h = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD); if (h) f = (size_t (*)(void *))dlsym(h, "malloc_usable_size"); }
  return f ? f(p) : 0;
}
"#;

/// A private `redis-server` under libfaketime whose clock is this machine's plus an offset
/// read from a file on every call (`FAKETIME_TIMESTAMP_FILE`, `FAKETIME_NO_CACHE`), so a test
/// moves Redis `TIME` — fleet's one clock, also inside scripts and for key expiry — while
/// everything runs. The monotonic clock is left alone.
struct ShiftedRedis {
    redis: PrivateRedis,
    dir: TempDir,
}

impl ShiftedRedis {
    async fn start(offset_s: i64) -> Result<Self> {
        let lib = LIBFAKETIME
            .iter()
            .find(|p| std::path::Path::new(p).exists())
            .context("libfaketime not found (apt-get install faketime; ops/services.sh does)")?;
        let dir = TempDir::new("shifted-redis")?;
        let file = dir.write("faketime", &format!("{offset_s:+}"))?;
        let src = dir.write("shim.c", GLIBC_MALLOC_SHIM)?;
        let shim = dir.path("shim.so");
        let built = std::process::Command::new("cc")
            .args(["-shared", "-fPIC", "-O2", "-o", &shim, &src, "-ldl"])
            .status()
            .context("cc (to build the malloc shim for redis-server under libfaketime)")?;
        ensure!(
            built.success(),
            "cc failed to build the malloc shim: {built}"
        );
        let preload = format!("{lib} {shim}");
        let env = [
            ("LD_PRELOAD", preload.as_str()),
            ("FAKETIME_TIMESTAMP_FILE", file.as_str()),
            ("FAKETIME_NO_CACHE", "1"),
            ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
        ];
        let redis = PrivateRedis::start_with_env(None, None, &env).await?;
        Ok(ShiftedRedis { redis, dir })
    }

    /// From now on Redis's clock is this machine's plus `offset_s`.
    fn shift(&self, offset_s: i64) -> Result<()> {
        self.dir.write("faketime", &format!("{offset_s:+}"))?;
        Ok(())
    }
}

/// Redis server time of `store`.
async fn redis_time(store: &fleet::Store) -> Result<DateTime<Utc>> {
    let (secs, micros): (i64, i64) = store.query(&deadpool_redis::redis::cmd("TIME")).await?;
    DateTime::from_timestamp(secs, (micros * 1000) as u32).context("TIME")
}

fn utc(s: &str) -> DateTime<Utc> {
    DateTime::parse_from_rfc3339(s)
        .map(|t| t.with_timezone(&Utc))
        .unwrap_or_default()
}

/// Issue 30.1: a tick between a schedule's creation and the first poll that sees it is due
/// like any other. The firing loop polls every 10 s; a probe schedule's first fire shows when
/// a poll ran, and a daily schedule whose one tick lies 5-6 s after that poll is created at
/// once: the next poll comes after its tick. Before, the first poll started the
/// schedule from its own time and the tick was lost (neither fired nor counted missed).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_tick_between_creation_and_the_first_poll_fires() -> Result<()> {
    own_process!();
    let ns = Ns::new().await?;
    let runs = Runs::default();
    let w = start_worker(&ns, "w1", LABELS, 8, &[], &[(KIND, runs.handler())]).await?;
    let s = start_scheduler(
        &ns,
        &[
            ("schedule_tolerance_ms", "30000"),
            ("schedule_poll_ms", "10000"),
        ],
    )
    .await?;
    let probe = format!("probe-{}", ns.name);
    add(&s, &spec(&probe, "* * * * * *", json!({}))).await?;
    // The probe's first fire was submitted at a poll (its `submitted_at`, Redis time).
    let polled = wait_for(
        "the probe's first fire",
        Duration::from_secs(30),
        || async { runs.ticks(&probe).values().map(|(_, at)| *at).min() },
    )
    .await?;
    // Created as soon as the fire is seen, before its tick; the next poll is 10 s after the
    // probe's, after the tick.
    let tick = (polled + chrono::Duration::seconds(6))
        .with_nanosecond(0)
        .unwrap_or(polled);
    let name = format!("daily-{}", ns.name);
    let cron = format!("{} {} {} * * *", tick.second(), tick.minute(), tick.hour());
    let (status, body) = post(
        &s.url("/v1/schedules"),
        Some(&spec(&name, &cron, json!({}))),
    )
    .await?;
    let created = redis_time(&ns.store).await?;
    ensure!(status == 201, "POST: {status} {body}");
    ensure!(
        created < tick,
        "precondition: created at {created}, after its tick {tick}"
    );
    assert_eq!(
        body["next_tick"],
        json!(tick.to_rfc3339_opts(SecondsFormat::Secs, true))
    );
    wait_for(
        "the daily schedule's first tick ran",
        Duration::from_secs(25),
        || async { runs.snapshot().contains_key(&id(&name, tick)).then_some(()) },
    )
    .await?;
    s.stop().await?;
    assert_eq!(
        runs.ticks(&name).keys().copied().collect::<Vec<_>>(),
        [tick],
        "exactly the one tick, once"
    );
    assert_eq!(runs.ticks(&name)[&tick].0, 1);
    let page = metrics_page_of_process().await;
    assert_eq!(
        metric_sum(&page, "fleet_schedule_misses_total", &[("schedule", &name)]),
        0.0
    );
    // The probe, created the same way, lost nothing between its creation and first poll
    // either: its fires start at the first second after its creation.
    let first = runs.ticks(&probe).keys().next().copied().context("probe")?;
    let (fired, gap, _) = account(&runs, &probe, chrono::Duration::seconds(30))?;
    eprintln!("probe: first tick {first}, {fired} fired, {gap} unfired in between");
    assert_eq!(gap, 0);
    w.stop().await?;
    ns.cleanup().await
}

/// Issue 30.2: an interval schedule keeps its real-time pace through a DST fall-back (Vixie
/// cron's rule). Redis's clock is set 40 s before 2026-10-25 03:00 CEST (01:00:00Z), when
/// Europe/Berlin falls back to 02:00 CET: `*/10 * * * * *` fires every 10 s across the change —
/// before, it fired once and then nothing until the repeated hour had passed. A fixed local
/// time (daily at 02:00:05, whose first instant was an hour earlier) does not fire again in
/// the repeated hour.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_interval_schedule_keeps_its_pace_through_the_fall_back() -> Result<()> {
    own_process!();
    let change = utc("2026-10-25T01:00:00Z");
    let offset = (change - chrono::Duration::seconds(40) - Utc::now()).num_seconds();
    let redis = ShiftedRedis::start(offset).await?;
    let ns = Ns::on_redis(&redis.redis.url(None)).await?;
    let runs = Runs::default();
    let w = start_worker(&ns, "w1", LABELS, 8, WORKER, &[(KIND, runs.handler())]).await?;
    let s = start_scheduler(
        &ns,
        &[
            ("schedule_tolerance_ms", "3000"),
            ("schedule_poll_ms", "100"),
        ],
    )
    .await?;
    let every = format!("every10-{}", ns.name);
    let fixed = format!("fixed-{}", ns.name);
    let berlin = json!({"timezone": "Europe/Berlin"});
    add(&s, &spec(&every, "*/10 * * * * *", berlin.clone())).await?;
    add(&s, &spec(&fixed, "5 0 2 * * *", berlin)).await?;
    let created = redis_time(&ns.store).await?;
    ensure!(
        created < change - chrono::Duration::seconds(10),
        "precondition: created at {created} (Redis time), less than 10 s before the change"
    );
    let last = change + chrono::Duration::seconds(20);
    wait_for(
        "the tick 20 s after the fall-back ran",
        Duration::from_secs(90),
        || async {
            runs.snapshot()
                .contains_key(&id(&every, last))
                .then_some(())
        },
    )
    .await?;
    s.stop().await?;
    let got: Vec<DateTime<Utc>> = runs.ticks(&every).into_keys().collect();
    let first = *got.first().context("no tick")?;
    let expected: Vec<DateTime<Utc>> = (0..)
        .map(|i| first + chrono::Duration::seconds(10 * i))
        .take_while(|t| *t <= last)
        .collect();
    assert_eq!(got, expected, "every 10 s, no gap, across the change");
    assert!(first < change, "a tick before the change fired: {first}");
    assert!(
        expected.len() >= 4,
        "at least one tick before and three after the change: {expected:?}"
    );
    for (t, (n, _)) in runs.ticks(&every) {
        assert_eq!(n, 1, "{t} ran {n} times");
    }
    assert_eq!(
        runs.count(&fixed),
        0,
        "02:00:05 CET repeats 02:00:05 CEST (an hour earlier): a fixed time fires once"
    );
    let page = metrics_page_of_process().await;
    assert_eq!(
        metric_sum(
            &page,
            "fleet_schedule_misses_total",
            &[("schedule", &every)]
        ),
        0.0
    );
    w.stop().await?;
    ns.cleanup().await
}

/// Issue 30.3: after a 6 h outage of the only scheduler, `catch_up` with `catch_up_max: 3`
/// fires exactly 3 late ticks, the latest ones (no hole between them and the on-time fires
/// after), and counts every older tick missed once. Redis's clock jumps 6 h forward while no
/// scheduler runs. An every-second schedule has 21,600 ticks in the gap: before, each poll
/// handled at most 10,000 of them and applied the bound to its own batch (9 late fires, 6 of
/// them hours old).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn catch_up_max_holds_after_a_6_h_outage() -> Result<()> {
    own_process!();
    let redis = ShiftedRedis::start(0).await?;
    let ns = Ns::on_redis(&redis.redis.url(None)).await?;
    let runs = Runs::default();
    let settings = [
        ("schedule_tolerance_ms", "2000"),
        ("schedule_poll_ms", "100"),
    ];
    let w = start_worker(&ns, "w1", LABELS, 8, WORKER, &[(KIND, runs.handler())]).await?;
    let s1 = start_scheduler(&ns, &settings).await?;
    let name = format!("c-{}", ns.name);
    add(
        &s1,
        &spec(
            &name,
            "* * * * * *",
            json!({"missed": "catch_up", "catch_up_max": 3}),
        ),
    )
    .await?;
    wait_for("3 fires", Duration::from_secs(20), || async {
        (runs.count(&name) >= 3).then_some(())
    })
    .await?;
    s1.stop().await?;
    w.stop().await?;
    let before = runs.count(&name);
    redis.shift(6 * 3600)?; // the outage: 6 h pass while no scheduler runs
    let w = start_worker(&ns, "w2", LABELS, 8, WORKER, &[(KIND, runs.handler())]).await?;
    let s2 = start_scheduler(&ns, &settings).await?;
    wait_for(
        "the catch-up and 3 on-time fires",
        Duration::from_secs(30),
        || async { (runs.count(&name) >= before + 6).then_some(()) },
    )
    .await?;
    s2.stop().await?;
    let page = metrics_page_of_process().await;
    let (fired, gap, late) = account(&runs, &name, chrono::Duration::seconds(2))?;
    let limited = metric_sum(
        &page,
        "fleet_schedule_misses_total",
        &[("schedule", &name), ("reason", "catch_up_limit")],
    ) as usize;
    eprintln!("6 h outage: {fired} fired, {late} late, {gap} unfired, {limited} counted missed");
    assert_eq!(late, 3, "exactly catch_up_max = 3 ticks fired late");
    assert!(gap >= 6 * 3600 - 10, "the gap is 6 h of ticks: {gap}");
    assert_eq!(
        limited, gap,
        "every unfired tick counted missed exactly once"
    );
    assert_eq!(
        metric_sum(&page, "fleet_schedule_misses_total", &[("schedule", &name)]) as usize,
        limited
    );
    let ticks: Vec<DateTime<Utc>> = runs.ticks(&name).into_keys().collect();
    let holes: Vec<_> = ticks
        .windows(2)
        .filter(|w| (w[1] - w[0]).num_seconds() > 1)
        .collect();
    assert_eq!(
        holes.len(),
        1,
        "one hole, before the caught-up ticks, which are the latest: {holes:?}"
    );
    w.stop().await?;
    ns.cleanup().await
}

/// Issue 30.4: the same name created on two replicas at once — exactly one 201 and one 409, in
/// each of 5 rounds, and both replicas hold the winner's definition. Before, both answered 201
/// and the later record silently replaced the earlier.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_same_name_created_on_two_replicas_at_once_gets_one_409() -> Result<()> {
    let ns = Ns::new().await?;
    let s1 = start_scheduler(&ns, &[]).await?;
    let s2 = start_scheduler(&ns, &[]).await?;
    for round in 0..5 {
        let name = format!("race{round}-{}", ns.name);
        let mk = |from: &str| {
            let mut v = spec(&name, "0 0 0 1 1 * 2099", json!({}));
            v["task"]["payload"] = json!({"replica": from});
            v
        };
        let (a, b) = (mk("a"), mk("b"));
        let (ua, ub) = (s1.url("/v1/schedules"), s2.url("/v1/schedules"));
        let (ra, rb) = tokio::join!(post(&ua, Some(&a)), post(&ub, Some(&b)));
        let (ra, rb) = (ra?, rb?);
        let mut codes = [ra.0, rb.0];
        codes.sort_unstable();
        assert_eq!(codes, [201, 409], "round {round}: {ra:?} {rb:?}");
        let winner = if ra.0 == 201 { "a" } else { "b" };
        let loser = if ra.0 == 201 { &rb.1 } else { &ra.1 };
        assert_eq!(loser["error"], "schedule_exists", "{loser}");
        for s in [&s1, &s2] {
            let v = wait_listed(&s.url(""), &name).await?;
            assert_eq!(
                v["task"]["payload"]["replica"], winner,
                "round {round}: a replica holds the loser's definition"
            );
        }
    }
    s2.stop().await?;
    s1.stop().await?;
    ns.cleanup().await
}

/// Issue 30.4: a schedule deleted and created again shows none of the deleted one's
/// `last_tick`, `last_outcome`, `last_task`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_recreated_schedule_shows_nothing_of_the_deleted_one() -> Result<()> {
    let ns = Ns::new().await?;
    let runs = Runs::default();
    let w = start_worker(&ns, "w1", LABELS, 8, &[], &[(KIND, runs.handler())]).await?;
    let s = start_scheduler(&ns, &[("schedule_poll_ms", "100")]).await?;
    let name = format!("again-{}", ns.name);
    add(&s, &spec(&name, "* * * * * *", json!({}))).await?;
    let url = s.url(&format!("/v1/schedules/{name}"));
    let old = wait_for("a fired last tick", Duration::from_secs(15), || {
        let u = url.clone();
        async move {
            let v = get_json(&u).await.ok()?;
            (v["last_outcome"] == "fired").then_some(v)
        }
    })
    .await?;
    assert!(
        old["last_tick"].is_string() && old["last_task"].is_object(),
        "{old}"
    );
    let r = reqwest::Client::new().delete(&url).send().await?;
    assert_eq!(r.status().as_u16(), 200);
    add(&s, &spec(&name, "0 0 0 1 1 * 2099", json!({}))).await?;
    let v = get_json(&url).await?;
    assert_eq!(
        (&v["last_tick"], &v["last_outcome"], &v["last_task"]),
        (&Value::Null, &Value::Null, &Value::Null),
        "{v}"
    );
    assert_eq!(v["next_tick"], "2099-01-01T00:00:00Z");
    s.stop().await?;
    w.stop().await?;
    ns.cleanup().await
}
