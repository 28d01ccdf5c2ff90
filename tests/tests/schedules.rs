//! Periodic schedules end to end, against the real RabbitMQ and Redis: every tick fired once
//! across scheduler replicas (one of them a process killed mid-way), `skip` vs `catch_up`
//! after every scheduler stopped for 5 s, pause/resume and fire-now through `fleetctl`, and
//! definitions surviving a Redis FLUSHALL (on a private `redis-server`).

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
    // Nothing more may come: wait until the window plus the tolerance has passed.
    let quiet = (end + chrono::Duration::seconds(6) - Utc::now())
        .to_std()
        .unwrap_or_default();
    tokio::time::sleep(quiet).await;

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
    tokio::time::sleep(Duration::from_secs(5)).await; // the outage under test
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
    tokio::time::sleep(Duration::from_secs(3)).await; // a paused schedule must stay silent this long
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
    tokio::time::sleep(Duration::from_secs(3)).await; // silence again
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
    tokio::time::sleep(Duration::from_secs(3)).await;
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
