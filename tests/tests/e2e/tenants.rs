//! Tenants (issue 33): fairness keys on real RabbitMQ and Redis — weighted fair dispatch inside a
//! full group, per-key `max_running` exact across scheduler replicas and groups, `min_running`,
//! a per-key rate, and the key's slots after a Redis FLUSHALL. Every figure is measured from the
//! workers' own start and finish times (never from Redis) and printed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::ensure;
use deadpool_redis::redis;
use fleet::Envelope;
use fleet_tests::*;
use fleet_worker::executor::{handler_fn, Handler};
use serde_json::{json, Value};

/// One run as its worker saw it: task id, key, start and end.
#[derive(Clone)]
struct Run {
    id: String,
    key: String,
    start: Instant,
    end: Option<Instant>,
}

/// Every run of the test's handler.
#[derive(Clone, Default)]
struct Runs {
    all: Arc<Mutex<Vec<Run>>>,
}

impl Runs {
    /// A handler that records its run and sleeps `payload.ms`.
    fn handler(&self) -> Arc<dyn Handler> {
        let s = self.clone();
        handler_fn(move |ctx| {
            let s = s.clone();
            async move {
                let i = s
                    .all
                    .lock()
                    .map(|mut a| {
                        a.push(Run {
                            id: ctx.envelope.id.clone(),
                            key: ctx.envelope.key.clone().unwrap_or_default(),
                            start: Instant::now(),
                            end: None,
                        });
                        a.len() - 1
                    })
                    .unwrap_or(0);
                let ms = ctx.envelope.payload.get("ms").and_then(Value::as_u64);
                tokio::time::sleep(Duration::from_millis(ms.unwrap_or(0))).await;
                if let Ok(mut a) = s.all.lock() {
                    if let Some(r) = a.get_mut(i) {
                        r.end = Some(Instant::now());
                    }
                }
                Ok(json!({"ok": true}))
            }
        })
    }

    fn snapshot(&self) -> Vec<Run> {
        self.all.lock().map(|a| a.clone()).unwrap_or_default()
    }

    /// Finished runs of `key`.
    fn done(&self, key: &str) -> usize {
        self.snapshot()
            .iter()
            .filter(|r| r.key == key && r.end.is_some())
            .count()
    }

    /// Runs of each id.
    fn per_id(&self) -> HashMap<String, usize> {
        let mut m = HashMap::new();
        for r in self.snapshot() {
            *m.entry(r.id).or_default() += 1;
        }
        m
    }

    /// Most runs of `key` at once (from start and end times; a run not ended counts to now).
    fn peak(&self, key: &str, since: Option<Instant>) -> usize {
        let mut ev: Vec<(Instant, i32)> = Vec::new();
        for r in self.snapshot().into_iter().filter(|r| r.key == key) {
            let end = r.end.unwrap_or_else(Instant::now);
            if since.is_some_and(|s| end < s) {
                continue;
            }
            ev.push((r.start, 1));
            ev.push((end, -1));
        }
        // Ends before starts at the same instant.
        ev.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)));
        let (mut cur, mut max) = (0i32, 0i32);
        for (_, d) in ev {
            cur += d;
            max = max.max(cur);
        }
        max as usize
    }
}

fn keyed(key: &str, ms: u64, labels: &str) -> Envelope {
    let mut e = task(JOB, json!({ "ms": ms }), labels);
    e.key = Some(key.to_string());
    e
}

/// Submits `envs` in chunks of 500, each confirmed; what the full ingress refuses ("not now")
/// is submitted again after 50 ms, for at most 60 s.
async fn submit_all(ns: &Ns, envs: &[Envelope]) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    for c in envs.chunks(500) {
        let mut left: Vec<Envelope> = c.to_vec();
        while !left.is_empty() {
            ensure!(
                Instant::now() < deadline,
                "{} still refused after 60 s",
                left.len()
            );
            let took = ns.submit_each(&left).await?;
            left = left
                .into_iter()
                .zip(took)
                .filter(|(_, ok)| !ok)
                .map(|(e, _)| e)
                .collect();
            if !left.is_empty() {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
    Ok(())
}

/// The per-key limits setting (`FLEET_KEY_LIMITS`, config key `key_limits`).
fn limits(spec: &str) -> (&'static str, &str) {
    ("key_limits", spec)
}

/// Key A floods a group of 8 slots with 20,000 tasks of 20 ms; 2 s later key B submits 100.
/// B's tasks finish within twice the time they take with half the group to themselves
/// (measured first, on a group of 4 slots), and A keeps ≥ 90 % of what the group runs
/// beside B's share.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flooding_key_does_not_delay_another_beyond_its_share() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let runs = Runs::default();
    let h = [(JOB, runs.handler())];
    // The ingress queue is first in first out for every key: its bound is the most of another
    // key's flood a new key can wait behind (README, "Tenants"): sized for tenants, 1,000.
    let mut cfg = SCHEDULER.to_vec();
    cfg.push(("ingress_max_normal", "1000"));
    let _sched = start_scheduler(&ns, &cfg).await?;
    // The baseline: B's 100 tasks alone on half the group (a group of 4 slots of its own),
    // submitted at the same moment as B's own (the same ingress, the same machine load).
    let _half = start_worker(&ns, "w-half", "pool=half", 4, WORKER, &h).await?;
    let b0: Vec<_> = (0..100).map(|_| keyed("b0", 20, "pool=half")).collect();

    let _w1 = start_worker(&ns, "w-f1", "pool=flood", 4, WORKER, &h).await?;
    let _w2 = start_worker(&ns, "w-f2", "pool=flood", 4, WORKER, &h).await?;
    let a: Vec<_> = (0..20_000).map(|_| keyed("a", 20, "pool=flood")).collect();
    let flood_at = Instant::now();
    // A's producer submits its 20,000 (told "not now" while the ingress is full, and trying
    // again) while B's comes 2 s later.
    let ns = Arc::new(ns);
    let flood = {
        let ns = ns.clone();
        tokio::spawn(async move { submit_all(&ns, &a).await })
    };
    scenario_pause(
        (flood_at + Duration::from_secs(2)).saturating_duration_since(Instant::now()),
        "A floods alone",
    )
    .await;
    let a_before = runs.done("a");
    let before_secs = flood_at.elapsed().as_secs_f64();
    let b: Vec<_> = (0..100).map(|_| keyed("b", 20, "pool=flood")).collect();
    let t1 = Instant::now();
    let a_at_b = runs.done("a");
    let (r0, r1) = tokio::join!(submit_all(&ns, &b0), submit_all(&ns, &b));
    r0?;
    r1?;
    let alone = wait_for("the baseline ran", Duration::from_secs(120), || async {
        (runs.done("b0") == 100).then(|| t1.elapsed())
    })
    .await?;
    wait_for("B ran", Duration::from_secs(120), || async {
        (runs.done("b") == 100).then_some(())
    })
    .await?;
    let b_took = t1.elapsed();
    let a_during = runs.done("a") - a_at_b;
    flood.abort();
    let cap_rate = a_before as f64 / before_secs;
    let a_rate = a_during as f64 / b_took.as_secs_f64();
    let b_rate = 100.0 / b_took.as_secs_f64();
    println!(
        "tenants flood: B alone on half the group {:.0} ms; B beside A's flood {:.0} ms (bound {:.0} ms); group alone {cap_rate:.0}/s, during B: A {a_rate:.0}/s + B {b_rate:.0}/s",
        alone.as_secs_f64() * 1e3,
        b_took.as_secs_f64() * 1e3,
        2.0 * alone.as_secs_f64() * 1e3
    );
    ensure!(
        b_took <= alone * 2,
        "B took {b_took:?} beside the flood, {alone:?} alone on half the group"
    );
    ensure!(
        a_rate + b_rate >= 0.9 * cap_rate,
        "the group ran {a_rate:.0}/s of A and {b_rate:.0}/s of B, {cap_rate:.0}/s before B"
    );
    // Nothing of B ran twice; nothing of A ran twice so far.
    let per = runs.per_id();
    ensure!(per.values().all(|n| *n == 1), "a task ran twice");
    // The group's fair queue assignments (A's queue and B's) live an hour from their last use:
    // renewed once per hash per reservation batch, after the keys of the batch were assigned.
    let hashes: Vec<String> = ns
        .store
        .query(
            deadpool_redis::redis::cmd("KEYS").arg(
                ns.names
                    .fair_assignments("*pool=flood*", fleet::Lane::Normal),
            ),
        )
        .await?;
    ensure!(hashes.len() == 1, "fair assignment hashes {hashes:?}");
    for h in hashes {
        let ttl: i64 = ns
            .store
            .query(deadpool_redis::redis::cmd("PTTL").arg(&h))
            .await?;
        ensure!(
            (3_000_000..=3_600_000).contains(&ttl),
            "{h}: TTL {ttl} ms, want an hour from the last batch"
        );
        // Both keys waited, each in a queue of its own, assigned round robin as it first
        // waited (a key only read with the batch's others is not assigned).
        let assigned: HashMap<String, String> = ns
            .store
            .query(deadpool_redis::redis::cmd("HGETALL").arg(&h))
            .await?;
        ensure!(
            assigned.get("#").map(String::as_str) == Some("2")
                && assigned.len() == 3
                && assigned.get("a") != assigned.get("b")
                && assigned.get("a").is_some_and(|q| q == "0" || q == "1")
                && assigned.get("b").is_some_and(|q| q == "0" || q == "1"),
            "{h}: {assigned:?}"
        );
    }
    Ok(())
}

/// Keys with weights 3:2:1, each with a backlog far beyond what the group runs in 60 s, get
/// completed-task shares within ±10 % of 3:2:1.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn weights_share_a_full_group_three_two_one() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let runs = Runs::default();
    let h = [(JOB, runs.handler())];
    let mut cfg = SCHEDULER.to_vec();
    cfg.push(limits("x:weight=3;y:weight=2;z:weight=1"));
    let _sched = start_scheduler(&ns, &cfg).await?;
    let _w = start_worker(&ns, "w-wt", "pool=wt", 4, WORKER, &h).await?;
    // 4 slots × 50 ms = 80/s: 4,800 in 60 s, x's share 2,400. 3,000 each, interleaved.
    let mut envs = Vec::new();
    for _ in 0..3000 {
        for k in ["x", "y", "z"] {
            envs.push(keyed(k, 50, "pool=wt"));
        }
    }
    submit_all(&ns, &envs).await?;
    scenario_pause(Duration::from_secs(3), "every key waits in the group").await;
    let from: HashMap<&str, usize> = ["x", "y", "z"].iter().map(|k| (*k, runs.done(k))).collect();
    scenario_pause(Duration::from_secs(60), "the weights measured").await;
    let got: Vec<usize> = ["x", "y", "z"]
        .iter()
        .map(|k| runs.done(k) - from[k])
        .collect();
    let total: usize = got.iter().sum();
    println!(
        "tenants weights 3:2:1 over 60 s: x {} y {} z {} of {total}",
        got[0], got[1], got[2]
    );
    ensure!(total > 1000, "only {total} tasks ran in 60 s");
    for (n, want) in got.iter().zip([3.0, 2.0, 1.0]) {
        let share = *n as f64 / total as f64;
        let target = want / 6.0;
        ensure!(
            (share - target).abs() <= 0.1 * target,
            "share {share:.3} against {target:.3} (x {} y {} z {})",
            got[0],
            got[1],
            got[2]
        );
    }
    Ok(())
}

/// A key with `max_running` 5, spread over 2 scheduler replicas and 3 groups of 4 workers,
/// never has more than 5 running at once and reaches 5; every task runs exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn max_running_holds_across_replicas_and_groups() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let runs = Runs::default();
    let h = [(JOB, runs.handler())];
    let mut cfg = SCHEDULER.to_vec();
    cfg.push(limits("lim:max_running=5"));
    let _s1 = start_scheduler(&ns, &cfg).await?;
    let _s2 = start_scheduler(&ns, &cfg).await?;
    let mut workers = Vec::new();
    for g in 0..3 {
        for w in 0..4 {
            workers.push(
                start_worker(
                    &ns,
                    &format!("w-{g}-{w}"),
                    &format!("pool=m,zone=z{g}"),
                    1,
                    WORKER,
                    &h,
                )
                .await?,
            );
        }
    }
    // 120 tasks of key `lim`, 100 ms each, any zone.
    let lim: Vec<_> = (0..120).map(|_| keyed("lim", 100, "pool=m")).collect();
    submit_all(&ns, &lim).await?;
    wait_for("lim ran", Duration::from_secs(90), || async {
        (runs.done("lim") == 120).then_some(())
    })
    .await?;
    let peak = runs.peak("lim", None);
    println!("tenants max_running 5 over 2 replicas × 3 groups of 4: peak {peak} running at once");
    ensure!(peak == 5, "peak {peak}, want exactly 5");

    let per = runs.per_id();
    for e in &lim {
        ensure!(
            per.get(&e.id) == Some(&1),
            "{} ran {:?} times",
            e.id,
            per.get(&e.id)
        );
    }
    Ok(())
}

/// A key with `min_running` 2 and weight 1 keeps 2 running while a key of weight 20 floods its
/// group (6 slots, 2 scheduler replicas): its weighted share alone would be 6/21 of a slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn min_running_is_served_beside_a_flood() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let runs = Runs::default();
    let h = [(JOB, runs.handler())];
    let mut cfg = SCHEDULER.to_vec();
    cfg.push(limits("guar:min_running=2,weight=1;big:weight=20"));
    let _s1 = start_scheduler(&ns, &cfg).await?;
    let _s2 = start_scheduler(&ns, &cfg).await?;
    let _w1 = start_worker(&ns, "w-g1", "pool=g", 3, WORKER, &h).await?;
    let _w2 = start_worker(&ns, "w-g2", "pool=g", 3, WORKER, &h).await?;
    let big: Vec<_> = (0..3000).map(|_| keyed("big", 30, "pool=g")).collect();
    submit_all(&ns, &big).await?;
    scenario_pause(Duration::from_secs(2), "the flood fills the slots").await;
    let guar: Vec<_> = (0..40).map(|_| keyed("guar", 600, "pool=g")).collect();
    let g_at = Instant::now();
    submit_all(&ns, &guar).await?;
    // The scheduler's count of the key (running + reserved, what min_running guarantees),
    // sampled every 50 ms while the key has work.
    let mut counted: Vec<u32> = Vec::new();
    while runs.done("guar") < 40 {
        ensure!(
            g_at.elapsed() < Duration::from_secs(90),
            "guar did not finish in 90 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        let started = runs.snapshot().iter().filter(|r| r.key == "guar").count();
        if (1..=37).contains(&started) {
            let now = ns.store.clock.now_ms();
            if let Ok(v) = ns.store.key_used(&["guar"], now).await {
                counted.extend(v);
            }
        }
    }
    let under = counted.iter().filter(|n| **n < 2).count();
    // While it had work it held 2 slots: running + reserved (the scheduler's count) at least 2
    // at three samples in four at worst (the suite shares the cores: a release cycle then
    // takes longer to hand a freed slot back; without the floor it would hold 2 almost never). Its workers see a reserved task start once the tasks queued
    // ahead of it in the group queue (the room ahead of the workers) have, so what they see
    // lags: at least 1.5 of 2 running on average from its first start to its last end —
    // against the 6/21 of a slot its weight alone would give it.
    let all = runs.snapshot();
    let g_runs: Vec<&Run> = all.iter().filter(|r| r.key == "guar").collect();
    let first_start = g_runs.iter().map(|r| r.start).min().unwrap_or(g_at);
    let last_end = g_runs
        .iter()
        .filter_map(|r| r.end)
        .max()
        .unwrap_or(first_start);
    let busy: f64 = g_runs
        .iter()
        .filter_map(|r| r.end.map(|e| (e - r.start).as_secs_f64()))
        .sum();
    let span = (last_end - first_start).as_secs_f64();
    let avg = busy / span.max(0.001);
    println!(
        "tenants min_running 2 (weight 1 beside weight 20): first start {} ms after submit; held 2+ slots at {} of {} samples; {avg:.2} running on average over {span:.1} s (its weighted share alone: {:.2})",
        (first_start - g_at).as_millis(),
        counted.len() - under,
        counted.len(),
        6.0 / 21.0
    );
    ensure!(
        counted.len() >= 40 && under * 4 <= counted.len(),
        "guar held fewer than 2 slots at {under} of {} samples",
        counted.len()
    );
    ensure!(
        avg >= 2.0 * 6.0 / 21.0,
        "guar ran {avg:.2} on average, not above twice its weighted share (0.29)"
    );
    let per = runs.per_id();
    for e in &guar {
        ensure!(
            per.get(&e.id) == Some(&1),
            "{} ran {:?} times",
            e.id,
            per.get(&e.id)
        );
    }
    Ok(())
}

/// A key with a rate of 20/s dispatches 200 ± 4 tasks in 10 s (of steady state).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_rate_paces_its_tasks() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let runs = Runs::default();
    let h = [(JOB, runs.handler())];
    let mut cfg = SCHEDULER.to_vec();
    cfg.push(limits("paced:rate=20"));
    let _sched = start_scheduler(&ns, &cfg).await?;
    let _w = start_worker(&ns, "w-rate", "pool=rate", 8, WORKER, &h).await?;
    let envs: Vec<_> = (0..600).map(|_| keyed("paced", 1, "pool=rate")).collect();
    submit_all(&ns, &envs).await?;
    wait_for("the first started", Duration::from_secs(20), || async {
        runs.snapshot().iter().map(|r| r.start).min()
    })
    .await?;
    let first = runs
        .snapshot()
        .iter()
        .map(|r| r.start)
        .min()
        .unwrap_or_else(Instant::now);
    // Ten seconds of steady state, from 2 s after the first start (the first second holds the
    // key's first bucket and the release loop's start), 600 tasks being far more than it
    // lets through.
    let from = first + Duration::from_secs(2);
    let to = from + Duration::from_secs(10);
    scenario_pause(
        (to + Duration::from_secs(1)).saturating_duration_since(Instant::now()),
        "10 s of the rate",
    )
    .await;
    let starts: Vec<Instant> = runs.snapshot().iter().map(|r| r.start).collect();
    let n = starts.iter().filter(|s| **s >= from && **s < to).count();
    let mut per_sec = [0usize; 12];
    for s in &starts {
        if let Some(i) = s
            .checked_duration_since(first)
            .map(|d| d.as_secs() as usize)
        {
            if i < 12 {
                per_sec[i] += 1;
            }
        }
    }
    // The rate paces dispatch: counted by each dispatched task's `queued_at` (the Redis clock,
    // ms, written by the reservation that took its token), ten seconds from 2 s after the
    // first dispatch. Worker start times (printed) follow it, but a loaded machine can clump
    // starts across the window's edges: CI once saw 205 started with starts per second
    // [2, 16, 25, 20, …] — a slow first second caught up in the window's first.
    let mut dispatched: Vec<i64> = Vec::new();
    for e in &envs {
        let Some(st) = ns.status(&e.id).await? else {
            continue;
        };
        if st.get("state").map(String::as_str) == Some("parked") {
            continue;
        }
        if let Some(q) = st.get("queued_at").and_then(|v| v.parse::<i64>().ok()) {
            dispatched.push(q);
        }
    }
    dispatched.sort_unstable();
    let d0 = dispatched.first().copied().unwrap_or(0);
    let (w0, w1) = (d0 + 2_000, d0 + 12_000);
    let nd = dispatched.iter().filter(|q| (w0..w1).contains(q)).count();
    let b = rate_bounds(&dispatched, w0, w1, 20.0, 20);
    println!("tenants rate 20/s: {nd} dispatched in 10 s (want {}..={}: dispatch gap at the window's start {} ms, {} ms of gaps beyond a refill in it; worst span {:.2} beyond rate × span + burst); {n} started in the 10 s from 2 s after the first start, per second from it {per_sec:?}", b.low, b.high, b.gap_at_start_ms, b.lost_ms, b.worst_excess);
    ensure!(
        (b.low..=b.high).contains(&nd),
        "{nd} dispatched in 10 s, want {}..={}",
        b.low,
        b.high
    );
    ensure!(
        b.worst_excess <= 1.0,
        "the token bucket's bound broken: {:.1} dispatches beyond rate × span + burst in one span",
        b.worst_excess
    );
    Ok(())
}

/// What a token bucket of `rate` per second and `burst` tokens, with work always waiting,
/// allows in the window `[w0, w1)` of dispatch times `d` (ms, sorted). Steady, it is
/// `rate × window ± 4`. A stalled dispatcher (a loaded machine; CI once saw dispatches per
/// second [3, 0, 38, 20, …] and 218 in the window) moves that by what the bucket did
/// meanwhile, and by nothing else:
/// - above: the tokens the bucket held at `w0`, saved since the last dispatch before it
///   (`min(burst, rate × (w0 − last))`; a backlogged dispatcher leaves < 1 token behind);
/// - below: the tokens a full bucket threw away, the part of each gap in the window beyond
///   `burst / rate`.
///
/// `worst_excess` is the largest `count − (rate × span + burst)` over every span between two
/// dispatches: the bucket's own bound (RFC 2697's committed burst), never above 1 (ms
/// rounding of the times).
struct RateBounds {
    low: usize,
    high: usize,
    /// From the last dispatch before the window to its start, ms.
    gap_at_start_ms: i64,
    /// Summed over the gaps in the window, the part of each beyond `burst / rate`, ms.
    lost_ms: i64,
    worst_excess: f64,
}

fn rate_bounds(d: &[i64], w0: i64, w1: i64, rate: f64, burst: u32) -> RateBounds {
    let refill_ms = (f64::from(burst) / rate * 1000.0) as i64;
    let gap_at_start_ms = d
        .iter()
        .rev()
        .find(|&&t| t < w0)
        .map_or(0, |&last| w0 - last);
    let saved = (rate * gap_at_start_ms as f64 / 1000.0).min(f64::from(burst));
    let lost_ms: i64 = d
        .windows(2)
        .map(|p| (p[0].max(w0), p[1].min(w1)))
        .filter(|(a, b)| b > a)
        .map(|(a, b)| (b - a - refill_ms).max(0))
        .sum();
    let steady = rate * (w1 - w0) as f64 / 1000.0;
    let low = (steady - rate * lost_ms as f64 / 1000.0 - 4.0).max(0.0) as usize;
    let high = (steady + saved.ceil() + 4.0) as usize;
    let mut worst_excess = f64::MIN;
    for i in 0..d.len() {
        for j in i..d.len() {
            let allowed = rate * (d[j] - d[i]) as f64 / 1000.0 + f64::from(burst);
            worst_excess = worst_excess.max((j - i + 1) as f64 - allowed);
        }
    }
    RateBounds {
        low,
        high,
        gap_at_start_ms,
        lost_ms,
        worst_excess,
    }
}

/// A FLUSHALL in the middle of a keyed flood (private Redis): the key's running count is back
/// under its limit within a lease (the workers' heartbeats rebuild its running set), no slot
/// stays leaked, and every task runs exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_loss_leaves_no_key_over_its_limit_for_longer_than_a_lease() -> anyhow::Result<()> {
    // Alone in a process of its own: in the suite's shared process it timed out in two CI
    // runs of three (passing alone every time) — its scheduler and workers then share one
    // runtime with the other tests' under the suite's load.
    own_process!();
    let redis = PrivateRedis::start(None, None).await?;
    let ns = Ns::on_redis(&redis.url(None)).await?;
    let runs = Runs::default();
    let h = [(JOB, runs.handler())];
    let mut cfg = SCHEDULER.to_vec();
    cfg.push(limits("k:max_running=3"));
    let _sched = start_scheduler(&ns, &cfg).await?;
    let _w1 = start_worker(&ns, "w-r1", "pool=rl", 4, WORKER, &h).await?;
    let _w2 = start_worker(&ns, "w-r2", "pool=rl", 4, WORKER, &h).await?;
    let envs: Vec<_> = (0..150).map(|_| keyed("k", 100, "pool=rl")).collect();
    submit_all(&ns, &envs).await?;
    wait_for("a third ran", Duration::from_secs(60), || async {
        (runs.done("k") >= 50).then_some(())
    })
    .await?;
    let before = runs.peak("k", None);
    redis.flushall().await?;
    let flushed = Instant::now();
    wait_for("every task ran", Duration::from_secs(120), || async {
        (runs.done("k") == 150).then_some(())
    })
    .await?;
    // The worker's heartbeat (300 ms) puts its running tasks back in the key's set: after a
    // heartbeat window the limit holds again.
    let after = runs.peak("k", Some(flushed + Duration::from_millis(1500)));
    println!(
        "tenants FLUSHALL: peak {before} before, {after} from 1.5 s after the FLUSHALL (limit 3)"
    );
    ensure!(
        before <= 3 && after <= 3,
        "peak {before} before, {after} after"
    );
    let per = runs.per_id();
    for e in &envs {
        ensure!(
            per.get(&e.id) == Some(&1),
            "{} ran {:?} times",
            e.id,
            per.get(&e.id)
        );
    }
    // No slot leaked: the key holds no live lease once everything ran (an entry a heartbeat
    // put back for a run whose record the FLUSHALL took lapses with its lease and is dropped
    // at the key's next use, as the API's figures count: live leases only).
    let used = wait_for(
        "the key's slots given back",
        Duration::from_secs(25),
        || async {
            let now = ns.store.clock.now_ms();
            let card = |k: String| {
                let mut c = deadpool_redis::redis::cmd("ZCOUNT");
                c.arg(k).arg(now).arg("+inf");
                c
            };
            let q: i64 = ns
                .store
                .query(&card(ns.names.key_reserved("k")))
                .await
                .ok()?;
            let r: i64 = ns
                .store
                .query(&card(ns.names.key_running("k")))
                .await
                .ok()?;
            (q + r == 0).then_some(())
        },
    )
    .await;
    ensure!(used.is_ok(), "the key still holds slots");
    Ok(())
}

/// Kill -9 of a worker process and of a scheduler replica's process in the middle of a keyed
/// flood (key `f`, `max_running` 3, over an in-process replica and a process replica, an
/// in-process worker and a process worker, http executor): the key never has more than 3
/// running (from the endpoint's own call times; a killed worker's calls end at its kill), every
/// slot is given back, every task succeeds, and only a task in flight on the killed worker
/// runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killed_workers_and_replicas_leave_no_key_over_its_limit() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let ep = Endpoint::start(150).await?;
    let lim = [limits("f:max_running=3")];
    let mut cfg = SCHEDULER.to_vec();
    cfg.extend_from_slice(&lim);
    let _s1 = start_scheduler(&ns, &cfg).await?;
    let mut s2 = SchedulerProcess::spawn(&ns, &lim).await?;
    let mut victim = WorkerProcess::start(
        &ns,
        &ProcessSpec {
            id: "w-kv",
            labels: "",
            capacity: 4,
            endpoint: &ep.url,
            extra: &[],
        },
    )
    .await?;
    let peer_cfg = ep.worker_settings();
    let _peer = start_worker(&ns, "w-kp", "", 4, &peer_cfg, &[]).await?;
    wait_for("group capacity 8", Duration::from_secs(15), || async {
        group(&ns.store, "protocol=http")
            .await
            .filter(|g| g.capacity == 8)
    })
    .await?;
    let mut envs = jobs(150, "", Some(150));
    for e in &mut envs {
        e.key = Some("f".into());
    }
    submit_all(&ns, &envs).await?;
    wait_for("the victim mid-flight", Duration::from_secs(60), || async {
        let calls = ep.calls_of("w-kv");
        let done = calls.iter().filter(|c| c.answered.is_some()).count();
        let running = calls.iter().filter(|c| c.answered.is_none()).count();
        (done >= 3 && running >= 1).then_some(())
    })
    .await?;
    let killed_at = Instant::now();
    victim.kill9()?;
    ep.mark_dead("w-kv");
    s2.kill9()?;
    let ids: Vec<String> = envs.iter().map(|e| e.id.clone()).collect();
    for id in &ids {
        ns.wait_state(id, "succeeded", Duration::from_secs(120))
            .await?;
    }
    // Concurrency of the key from the endpoint's call times.
    let mut ev: Vec<(Instant, i32)> = Vec::new();
    for c in ep.calls() {
        let end = match c.answered {
            Some(a) => a,
            // A request the dead worker left in its socket may be read after the kill.
            None if c.worker == "w-kv" => killed_at.max(c.at),
            None => Instant::now(),
        };
        ev.push((c.at, 1));
        ev.push((end, -1));
    }
    ev.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut cur, mut peak) = (0i32, 0i32);
    for (_, d) in ev {
        cur += d;
        peak = peak.max(cur);
    }
    let mut per: HashMap<String, usize> = HashMap::new();
    for c in ep.calls() {
        *per.entry(c.id).or_default() += 1;
    }
    // In flight on the killed worker: its run there was not yet recorded and acked — an
    // answered call counts too (its outcome batch can take over a second under the suite's
    // load, and a 1 s slack once failed in CI) — so a second run is the redelivery: on another
    // worker, after the kill, and the id's only other run. The killed worker's run itself is
    // not compared with the kill's time: it was sent before the kill, but the endpoint can
    // read a request the dead process left in its socket after `killed_at` (CI of 8f0696e).
    // An answered run counts only if its answer came at most OUTCOME_SLACK before the kill:
    // one answered long before had its outcome written and acked, and a second run is a bug.
    const OUTCOME_SLACK: Duration = Duration::from_secs(10);
    let calls = ep.calls();
    let in_flight: std::collections::HashSet<String> = ep
        .calls_of("w-kv")
        .into_iter()
        .filter(|c| {
            let mut runs: Vec<&Call> = calls.iter().filter(|o| o.id == c.id).collect();
            runs.sort_by_key(|o| o.at);
            runs.len() == 2
                && runs[0].at == c.at
                && c.answered.is_none_or(|a| a + OUTCOME_SLACK >= killed_at)
                && runs[1].worker != "w-kv"
                && runs[1].at > killed_at
        })
        .map(|c| c.id)
        .collect();
    let twice: Vec<&String> = per
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(id, _)| id)
        .collect();
    println!(
        "tenants kill -9 (worker + replica) mid-flood: peak {peak} running of key f (limit 3); {} ran twice, {} in flight on the killed worker",
        twice.len(),
        in_flight.len()
    );
    ensure!(peak <= 3, "key f had {peak} running at once");
    ensure!(
        ids.iter().all(|id| per.contains_key(id)),
        "a task never ran"
    );
    let unexplained: Vec<String> = twice
        .iter()
        .filter(|id| !in_flight.contains(**id))
        .map(|id| {
            let runs: Vec<String> = calls
                .iter()
                .filter(|c| &c.id == *id)
                .map(|c| {
                    let rel = |t: Instant| {
                        if t >= killed_at {
                            format!("+{}ms", (t - killed_at).as_millis())
                        } else {
                            format!("-{}ms", (killed_at - t).as_millis())
                        }
                    };
                    format!(
                        "{} attempt {} at {} answered {}",
                        c.worker,
                        c.attempt,
                        rel(c.at),
                        c.answered.map(rel).unwrap_or_else(|| "never".into())
                    )
                })
                .collect();
            format!("{id}: {}", runs.join("; "))
        })
        .collect();
    ensure!(
        unexplained.is_empty(),
        "a task ran twice that was not in flight on the killed worker (times from the kill): {unexplained:?}"
    );
    let used = wait_for(
        "the key's slots given back",
        Duration::from_secs(15),
        || async {
            let now = ns.store.clock.now_ms();
            let u = ns.store.key_used(&["f"], now).await.ok()?;
            (u == vec![0]).then_some(())
        },
    )
    .await;
    ensure!(used.is_ok(), "key f still holds slots");
    Ok(())
}

/// A paused key dispatches nothing while another key of the same group runs (no head-of-line
/// blocking); after the resume each of its tasks runs exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_key_waits_without_blocking_another() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let runs = Runs::default();
    let h = [(JOB, runs.handler())];
    let sched = start_scheduler(&ns, SCHEDULER).await?;
    let _w = start_worker(&ns, "w-pk", "pool=pk", 4, WORKER, &h).await?;
    let post = |path: &'static str, body: Value| {
        let url = sched.url(path);
        async move {
            let r = reqwest::Client::new().post(url).json(&body).send().await?;
            anyhow::Ok(r.status().as_u16())
        }
    };
    ensure!(post("/v1/pauses", json!({"scope": "key", "key": "held"})).await? == 202);
    let held: Vec<_> = (0..30).map(|_| keyed("held", 10, "pool=pk")).collect();
    let free: Vec<_> = (0..30).map(|_| keyed("free", 10, "pool=pk")).collect();
    submit_all(&ns, &held).await?;
    submit_all(&ns, &free).await?;
    wait_for("the other key ran", Duration::from_secs(30), || async {
        (runs.done("free") == 30).then_some(())
    })
    .await?;
    scenario_pause(Duration::from_secs(2), "the paused key stays held").await;
    let while_paused = runs.done("held");
    println!("tenants key pause: {while_paused} of 30 ran while paused; the other key's 30 ran");
    ensure!(
        while_paused == 0,
        "{while_paused} tasks of the paused key ran"
    );
    ensure!(post("/v1/pauses/resume", json!({"scope": "key", "key": "held"})).await? == 202);
    wait_for("the held key ran", Duration::from_secs(30), || async {
        (runs.done("held") == 30).then_some(())
    })
    .await?;
    let per = runs.per_id();
    for e in held.iter().chain(&free) {
        ensure!(
            per.get(&e.id) == Some(&1),
            "{} ran {:?} times",
            e.id,
            per.get(&e.id)
        );
    }
    Ok(())
}

/// Keyed tasks waiting in a fair park queue when Redis loses everything and the scheduler
/// restarts (private Redis): Redis's count of the group's fair queues is gone, and the new
/// release loop finds the queue in the broker (it asks the broker which exist at its start) —
/// every task runs exactly once. Before that it read the count from Redis only, and the
/// tasks stayed in the queue for good (seen as a 1-in-5 timeout of the FLUSHALL test above).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keyed_tasks_parked_in_a_fair_queue_survive_a_flushall_and_a_restart() -> anyhow::Result<()>
{
    const N: usize = 12;
    let redis = PrivateRedis::start(None, None).await?;
    let ns = Ns::on_redis(&redis.url(None)).await?;
    let runs = Runs::default();
    let h = [(JOB, runs.handler())];
    let mut cfg = SCHEDULER.to_vec();
    cfg.push(limits("kf:max_running=1"));
    let s1 = start_scheduler(&ns, &cfg).await?;
    let w = start_worker(&ns, "w-f", "pool=fq", 2, WORKER, &h).await?;
    let envs: Vec<_> = (0..N).map(|_| keyed("kf", 200, "pool=fq")).collect();
    submit_all(&ns, &envs).await?;
    let fair = ns.names.park_queue(
        &fleet::Names::fair_group("pool=fq,protocol=builtin", 0),
        fleet::Lane::Normal,
    );
    wait_for(
        "a run, and the rest in the fair queue",
        Duration::from_secs(30),
        || async { (runs.done("kf") >= 1 && ns.depth_of(&fair).await.is_some()).then_some(()) },
    )
    .await?;
    redis.flushall().await?;
    s1.stop().await?;
    let s2 = start_scheduler(&ns, &cfg).await?;
    wait_for("every task ran", Duration::from_secs(60), || async {
        (runs.done("kf") == N).then_some(())
    })
    .await?;
    let per = runs.per_id();
    for e in &envs {
        ensure!(
            per.get(&e.id) == Some(&1),
            "{} ran {:?} times",
            e.id,
            per.get(&e.id)
        );
    }
    w.stop().await?;
    s2.stop().await?;
    ns.cleanup().await
}

/// The row of `key` in `GET /v1/keys`, if listed.
async fn key_row(sched: &SchedulerHandle, key: &str) -> anyhow::Result<Option<Value>> {
    let list = get_json(&sched.url("/v1/keys")).await?;
    Ok(list["keys"]
        .as_array()
        .and_then(|a| a.iter().find(|r| r["key"] == key))
        .cloned())
}

/// Keys that went idle are forgotten (`FLEET_KEY_FORGET_MS`): the stats loop reads the key
/// figures every second, and reads what the active keys hold, not every key ever seen. 2,000
/// keys routed an hour ago leave Redis (figures and lapsed leases), and so does a key idle for
/// the window, while a key whose task runs four times the window is kept and shown running at
/// every look where its lease lives. Its leases are 1 s (reservation) and 3 s (run): the
/// reservation's lapses before the first heartbeat and the run's before the task ends, so the
/// claim's and the heartbeats' writes of the key's lease expiry (the `ka` set, which the
/// figures trust) are what keeps it counted — checked directly too: at every look `ka` scores
/// the key at or above every lease it holds. A forgotten key that comes back starts from zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_keys_are_forgotten_and_a_long_running_one_is_not() -> anyhow::Result<()> {
    let ns = Ns::new().await?;
    let runs = Runs::default();
    let h = [(JOB, runs.handler())];
    let mut cfg = SCHEDULER.to_vec();
    cfg.extend([
        ("key_forget_ms", "2000"),
        ("reservation_lease_ms", "1000"),
        ("stats_interval_ms", "200"),
        ("heartbeat_timeout_ms", "8000"),
    ]);
    let sched = start_scheduler(&ns, &cfg).await?;
    let mut wcfg = WORKER.to_vec();
    wcfg.extend([
        ("heartbeat_interval_ms", "1000"),
        ("run_lease_ms", "3000"),
        ("heartbeat_timeout_ms", "8000"),
    ]);
    let _w = start_worker(&ns, "w-fg", "pool=fg", 4, &wcfg, &h).await?;
    // 2,000 keys routed an hour ago, as the dispatcher leaves them: figures, and a lapsed run
    // lease each.
    const OLD: usize = 2000;
    let n = &ns.store.names;
    let now = ns.store.clock.now_ms();
    let mut p = redis::pipe();
    for i in 0..OLD {
        let k = format!("old-{i}");
        p.cmd("HSET")
            .arg(n.key_figures())
            .arg(format!("t:{k}"))
            .arg(now - 3_600_000)
            .arg(format!("d:{k}"))
            .arg(1)
            .ignore();
        p.cmd("ZADD")
            .arg(n.key_running(&k))
            .arg(now - 3_599_000)
            .arg(format!("x-{i}"))
            .ignore();
    }
    ns.store.pipe::<()>(&p).await?;
    let short = keyed("short", 10, "pool=fg");
    let long = keyed("long", 8000, "pool=fg");
    submit_all(&ns, &[short.clone(), long.clone()]).await?;
    wait_for("the long task started", Duration::from_secs(20), || async {
        runs.snapshot()
            .iter()
            .any(|r| r.key == "long")
            .then_some(())
    })
    .await?;
    let live_leases = || async {
        let q: u64 = ns
            .store
            .query(
                redis::cmd("ZCOUNT")
                    .arg(n.key_running("long"))
                    .arg(ns.store.clock.now_ms())
                    .arg("+inf"),
            )
            .await?;
        anyhow::Ok(q)
    };
    let (mut looks, mut counted, mut forgot_at) = (0, 0, None);
    while runs.done("long") == 0 {
        // The invariant the figures rest on, read atomically: ka's score of the key is at or
        // above each of its leases.
        let mut p = redis::pipe();
        p.atomic()
            .cmd("ZSCORE")
            .arg(n.key_active())
            .arg("long")
            .cmd("ZRANGE")
            .arg(n.key_running("long"))
            .arg(-1)
            .arg(-1)
            .arg("WITHSCORES")
            .cmd("ZRANGE")
            .arg(n.key_reserved("long"))
            .arg(-1)
            .arg(-1)
            .arg("WITHSCORES");
        type Leases = Vec<(String, f64)>;
        let (ka, run, resv): (Option<f64>, Leases, Leases) = ns.store.pipe(&p).await?;
        for (id, lease) in run.iter().chain(&resv) {
            ensure!(
                ka.is_some_and(|k| k >= *lease),
                "look {looks}: {id}'s lease runs to {lease}, ka scores the key {ka:?}"
            );
        }
        // The figures against the leases themselves, when the lease lived through the look.
        let before = live_leases().await?;
        let row = key_row(&sched, "long").await?;
        let after = live_leases().await?;
        if runs.done("long") > 0 {
            break;
        }
        if (before, after) == (1, 1) {
            let got = row
                .as_ref()
                .map(|r| (r["running"].clone(), r["dispatched"].clone()));
            ensure!(
                got == Some((json!(1), json!(1))),
                "look {looks}: the running key shows {row:?}"
            );
            counted += 1;
        }
        // The short key's and the old keys' figures gone: only the long key's t: and d: left.
        if forgot_at.is_none() {
            let fields: u64 = ns
                .store
                .query(redis::cmd("HLEN").arg(n.key_figures()))
                .await?;
            if fields == 2 {
                forgot_at = Some(looks);
            }
        }
        looks += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ensure!(
        counted >= 20,
        "only {counted} of {looks} looks saw a live lease"
    );
    let forgot_at = forgot_at.ok_or_else(|| {
        anyhow::anyhow!("the short and old keys were not forgotten while the long key ran")
    })?;
    let mut p = redis::pipe();
    for i in 0..OLD {
        p.cmd("EXISTS").arg(n.key_running(&format!("old-{i}")));
    }
    let sets: u64 = ns.store.pipe::<Vec<u64>>(&p).await?.iter().sum();
    ensure!(sets == 0, "{sets} lease sets of old keys left");
    // Once the long task ended, it is forgotten too, and the set of keys with live leases
    // empties.
    wait_for(
        "the long key forgotten",
        Duration::from_secs(20),
        || async {
            let gone = key_row(&sched, "long").await.ok()?.is_none();
            let active: u64 = ns
                .store
                .query(redis::cmd("ZCARD").arg(n.key_active()))
                .await
                .ok()?;
            (gone && active == 0).then_some(())
        },
    )
    .await?;
    // A forgotten key that comes back starts from zero: listed again with 1 dispatched.
    submit_all(&ns, &[keyed("short", 10, "pool=fg")]).await?;
    let row = wait_for(
        "the short key listed again",
        Duration::from_secs(20),
        || async { key_row(&sched, "short").await.ok()? },
    )
    .await?;
    ensure!(row["dispatched"] == json!(1), "{row}");
    wait_for(
        "the short key's second task",
        Duration::from_secs(20),
        || async { (runs.done("short") == 2).then_some(()) },
    )
    .await?;
    let per = runs.per_id();
    ensure!(
        per.get(&short.id) == Some(&1) && per.get(&long.id) == Some(&1),
        "{per:?}"
    );
    println!(
        "tenants forget: {OLD} old keys and the short key forgotten by look {forgot_at} of \
         {looks} while the long key ran, shown running at {counted} looks with a live lease"
    );
    ns.cleanup().await
}
