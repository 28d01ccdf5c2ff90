//! Benchmarks that print figures (not timed tests: this machine is shared and noisy, so
//! compare ratios measured in the same run).
//!
//! * `bench throughput [N]` — fleet at the product defaults, then the raw RabbitMQ ceiling
//!   (one and two durable, confirmed hops; two hops both on one connection and with a
//!   connection per hop, the better of the two is the ceiling; two-hop bursts follow each of
//!   the rounds of fleet's, `BENCH_BURST_ROUNDS`, 3), all in one run: a burst of N no-op tasks, 1,000
//!   tasks/s offered steadily, idle submit→start latency (fleet vs raw two-hop), a burst over
//!   10 groups with mixed selectors, the split of 200 ms tasks over two groups of different
//!   speed, and RSS samples under a 10x overload (`BENCH_RSS_SECS`, 60; 0 skips it).
//! * `bench rss [SECONDS]` — the RSS stage alone (needs `cargo build --release --bins`).
//! * `bench critical [N]` — critical-lane submit→start wait, p50/p99, idle and under a 10×
//!   normal-lane overload, side by side.
//! * `bench scripts [N]` — each hot-path script (reserve, start, finish) alone against Redis:
//!   commands and Redis CPU per task, per script.
//!
//! Run: `cargo run --release -p fleet-tests --bin bench -- throughput 20000`

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use fleet::{broker::amqp, Envelope, Lane};
use fleet_tests::*;
use fleet_worker::executor::handler_fn;
use futures::{FutureExt, StreamExt};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use serde_json::json;

#[tokio::main]
async fn main() -> Result<()> {
    // A benchmark runs as long as it is asked to: the test binaries' watchdog is not for it.
    fleet_tests::no_watchdog();
    fleet::process::telemetry::init("text");
    // `BENCH_OTLP=1`: span export on (issue 35), to an OTLP sink in this process that reads
    // and drops every request; the in-process scheduler and workers share the exporter.
    let _spans = if std::env::var("BENCH_OTLP").is_ok_and(|v| v == "1") {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let sink = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(|_body: axum::body::Bytes| async { "" }),
        );
        tokio::spawn(async move {
            let _ = axum::serve(listener, sink).await;
        });
        println!("span export on, to an OTLP sink at {url}");
        fleet::trace::init(Some(&url), "fleet-bench")?
    } else {
        None
    };
    let args: Vec<String> = std::env::args().collect();
    let what = args.get(1).map(String::as_str).unwrap_or("throughput");
    let n: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(20_000);
    match what {
        "throughput" => throughput(n).await,
        "critical" => critical(n.min(1000)).await,
        "stages" => stages(n).await,
        "rss" => rss(n as u64).await,
        "scripts" => scripts(n).await,
        other => anyhow::bail!(
            "unknown benchmark {other} (throughput | critical | stages | scripts | rss SECONDS)"
        ),
    }
}

fn quorum() -> FieldTable {
    let mut t = FieldTable::default();
    t.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    t
}

/// Raw broker: producer → q1 (→ consumer re-publishes → q2) → consumer acks.
/// The raw client's prefetch per consumer and its `multiple` ack run: tuned on this machine
/// (prefetch 500 → 2000 and single acks → runs of 64 raised the two-hop figure).
const RAW_PREFETCH: u16 = 2000;
const RAW_ACK_EVERY: usize = 64;

/// fleet's Redis work per task — the same calls, in batches at least as large — done by the
/// raw two-hop client (the "floor" stage): the forwarder reserves each batch it holds
/// (`reserve.lua`: dedupe mark, leased reservation, status `queued`) and marks a run handed on
/// before acking it, as fleet's scheduler does; the consumer claims each batch (`start.lua`:
/// run record, status `running`) and records its outcome (`finish.lua`), as fleet's worker
/// does — the same `Store` calls with the product's default settings, and nothing else of
/// fleet (no envelope parsing, no tasks spawned). fleet does all of this and more, so on a
/// machine where the broker, Redis and the clients share the cores (every stage here is
/// CPU-bound) its rate is a ceiling for fleet's burst.
struct Floor {
    store: fleet::Store,
    worker: String,
    group: String,
    instance: String,
    selector: fleet::Labels,
    params: fleet::route::ReserveParams,
    run_lease: Duration,
    status_ttl: Duration,
    batch_max: usize,
    next_id: AtomicUsize,
    /// Answers other than reserved / run (none expected: the group has room for every task).
    anomalies: AtomicUsize,
}

impl Floor {
    /// Registers one worker (its group the only candidate, capacity for the whole run) in a
    /// fresh namespace; the scheduler's settings are the ones fleet ran with (`settings`: the
    /// ingress bound and any `BENCH_SCHEDULER` experiment), the worker's its defaults.
    async fn start(ns: &Ns, settings: &[(&str, &str)], n: usize) -> Result<Floor> {
        let sched = fleet_scheduler::SchedulerConfig::from_settings(&ns.settings(settings))?;
        let labels = fleet::Labels::parse("bench=floor")?;
        let wcfg = fleet_worker::config::WorkerConfig::from_settings(
            &ns.settings(&[("worker_id", "floor"), ("labels", "bench=floor")]),
        )?;
        let reg = fleet::registry::Registration {
            id: "floor".into(),
            instance: uuid::Uuid::new_v4().simple().to_string(),
            labels: labels.clone(),
            capacity: u32::try_from(n).unwrap_or(u32::MAX),
            critical_capacity: 1,
            executor: "builtin".into(),
            state: fleet::registry::WorkerState::Active,
            kinds: Default::default(),
        };
        ns.store.register(&reg, Duration::from_secs(600)).await?;
        Ok(Floor {
            store: ns.store.clone(),
            worker: reg.id.clone(),
            group: reg.group(),
            instance: reg.instance.clone(),
            selector: labels,
            params: sched.reserve_params(),
            run_lease: wcfg.run_lease,
            status_ttl: wcfg.common.status_ttl,
            batch_max: usize::from(sched.batch_max),
            next_id: AtomicUsize::new(0),
            anomalies: AtomicUsize::new(0),
        })
    }

    /// Reserves `k` new tasks; their ids, in order.
    async fn reserve(&self, k: usize) -> Vec<String> {
        let first = self.next_id.fetch_add(k, Ordering::Relaxed);
        let ids: Vec<String> = (first..first + k).map(|i| format!("floor-{i}")).collect();
        let reqs: Vec<fleet::route::ReserveRequest> = ids
            .iter()
            .map(|id| fleet::route::ReserveRequest {
                id: id.clone(),
                lane: Lane::Normal,
                selector: self.selector.clone(),
                kind: "echo".into(),
                strategy: None,
                dedupe: fleet::route::Dedupe::Check,
                from_park: false,
                dedupe_only: false,
                key: None,
            })
            .collect();
        let reserved = match self
            .store
            .reserve(
                &reqs,
                fleet::route::ReserveParams {
                    token: rand::random(),
                    ..self.params
                },
            )
            .await
        {
            Ok(answers) => answers
                .iter()
                .filter(|a| matches!(a, fleet::route::Reservation::Reserved(_)))
                .count(),
            Err(_) => 0,
        };
        self.anomalies.fetch_add(k - reserved, Ordering::Relaxed);
        ids
    }

    /// One batch flag per run of confirmed submissions, as fleet's scheduler writes one per
    /// dispatch batch (the floor's cost: its token is not the marks' own, nothing reads it).
    async fn handed_on(&self, ids: &[String]) {
        if self
            .store
            .mark_handed_on(Some(rand::random()), &[], 3_600_000)
            .await
            .is_err()
        {
            self.anomalies.fetch_add(ids.len(), Ordering::Relaxed);
        }
    }

    /// Claims a batch (the worker's claim, before a task starts); how many may run.
    async fn claim(&self, batch: &[lapin::message::Delivery]) -> usize {
        let ids: Vec<String> = batch.iter().map(Self::id).collect();
        self.claim_ids(&ids).await
    }

    /// Claims tasks by id; how many may run.
    async fn claim_ids(&self, ids: &[String]) -> usize {
        let reqs: Vec<fleet::run::ClaimRequest> = ids
            .iter()
            .map(|id| fleet::run::ClaimRequest {
                lane: Lane::Normal,
                id: id.clone(),
                base: 1,
                max_attempts: 5,
                isolated: false,
                key: None,
            })
            .collect();
        match self
            .store
            .claim(
                &self.worker,
                &self.group,
                &self.instance,
                self.run_lease,
                self.status_ttl,
                &reqs,
            )
            .await
        {
            Ok((true, answers)) => answers
                .iter()
                .filter(|a| **a == fleet::run::Claim::Run(1))
                .count(),
            _ => 0,
        }
    }

    /// Records a claimed batch succeeded (`runs`: what its claim granted).
    async fn finish(&self, batch: &[lapin::message::Delivery], runs: usize) {
        let ids: Vec<String> = batch.iter().map(Self::id).collect();
        self.finish_ids(&ids, runs).await;
    }

    /// Records tasks succeeded by id (`runs`: what their claim granted).
    async fn finish_ids(&self, ids: &[String], runs: usize) {
        let fins: Vec<fleet::run::Finished> = ids
            .iter()
            .map(|id| fleet::run::Finished {
                lane: Lane::Normal,
                id: id.clone(),
                attempt: 1,
                state: Some(fleet::status::TaskState::Succeeded),
                text: "null".into(),
                success: true,
                reason: None,
            })
            .collect();
        let finished = self
            .store
            .finish(
                &self.worker,
                &self.group,
                &self.instance,
                self.status_ttl,
                &fins,
                &[],
            )
            .await
            .is_ok();
        self.anomalies.fetch_add(
            ids.len() - if finished { runs } else { 0 },
            Ordering::Relaxed,
        );
    }

    fn id(d: &lapin::message::Delivery) -> String {
        d.properties
            .message_id()
            .as_ref()
            .map(|m| m.to_string())
            .unwrap_or_default()
    }
}

/// How a benchmark offers its messages.
#[derive(Clone, Copy, Debug)]
enum Offer {
    /// All at once (windows of 1,000 confirms).
    Burst,
    /// `rate` per second, in slices of 10 ms (each slice published, then its confirms awaited).
    Steady(f64),
    /// One at a time: publish, await the confirm, wait this long (idle latency).
    OneEvery(Duration),
}

/// Publishes `n` messages as `offer` says; `publish(k)` sends `k` of them and awaits their
/// confirms.
async fn offer<F, Fut>(n: usize, offer: Offer, mut publish: F) -> Result<()>
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    match offer {
        Offer::Burst => {
            let mut left = n;
            while left > 0 {
                let k = left.min(1000);
                publish(k).await?;
                left -= k;
            }
        }
        Offer::Steady(rate) => {
            let mut tick = tokio::time::interval(Duration::from_millis(10));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
            let start = Instant::now();
            let mut sent = 0usize;
            while sent < n {
                tick.tick().await;
                let due = ((start.elapsed().as_secs_f64() * rate) as usize + 1).min(n);
                if due > sent {
                    publish(due - sent).await?;
                    sent = due;
                }
            }
        }
        Offer::OneEvery(gap) => {
            for _ in 0..n {
                publish(1).await?;
                tokio::time::sleep(gap).await;
            }
        }
    }
    Ok(())
}

/// Microseconds since the Unix epoch (the clock both fleet's `submitted_at` and the raw
/// client's bodies use).
fn now_us() -> i64 {
    chrono::Utc::now().timestamp_micros()
}

/// CPU time of the processes a run loads: the RabbitMQ node (beam.smp on :5672), Redis (on
/// :6379) and this process (the scheduler, the workers and the producer all run here). On a
/// machine of two cores the busiest of them sets the pace, so CPU per task says where a run's
/// time goes even when other work shares the machine (wall-clock rates do not).
struct CpuMeter {
    pids: [(&'static str, Option<u32>); 3],
}

impl CpuMeter {
    fn new() -> Self {
        let listener = |port: u16| -> Option<u32> {
            let out = std::process::Command::new("ss")
                .args(["-ltnpH", &format!("sport = :{port}")])
                .output()
                .ok()?;
            let text = String::from_utf8_lossy(&out.stdout);
            let at = text.find("pid=")? + 4;
            text[at..]
                .split(|c: char| !c.is_ascii_digit())
                .next()?
                .parse()
                .ok()
        };
        CpuMeter {
            pids: [
                ("rabbitmq", listener(5672)),
                ("redis", listener(6379)),
                ("fleet+bench", Some(std::process::id())),
            ],
        }
    }

    /// utime + stime of each process, seconds (`/proc/<pid>/stat` fields 14 and 15, in
    /// clock ticks of 1/100 s).
    fn read(&self) -> [f64; 3] {
        let mut out = [f64::NAN; 3];
        for (k, (_, pid)) in self.pids.iter().enumerate() {
            let Some(pid) = pid else { continue };
            let Ok(s) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            // The command name (field 2) may hold spaces: count fields after its ')'.
            let Some(rest) = s.rfind(')').map(|i| &s[i + 2..]) else {
                continue;
            };
            let f: Vec<&str> = rest.split_whitespace().collect();
            if let (Some(u), Some(st)) = (
                f.get(11).and_then(|v| v.parse::<f64>().ok()),
                f.get(12).and_then(|v| v.parse::<f64>().ok()),
            ) {
                out[k] = (u + st) / 100.0;
            }
        }
        out
    }

    /// CPU ms per 1,000 tasks of each process between `before` and now (RabbitMQ, Redis, this
    /// process; NaN where a process was not found).
    fn per_task(&self, before: [f64; 3], n: usize) -> [f64; 3] {
        let after = self.read();
        std::array::from_fn(|k| (after[k] - before[k]) * 1000.0 * 1000.0 / n.max(1) as f64)
    }

    /// [`CpuMeter::per_task`] as a line, with the figures.
    fn report_with(&self, label: &str, before: [f64; 3], n: usize) -> (String, [f64; 3]) {
        let per = self.per_task(before, n);
        (self.line(label, per), per)
    }

    /// CPU seconds of each process spent since `before` (see [`CpuMeter::read`]).
    fn spent(&self, before: [f64; 3]) -> [f64; 3] {
        let after = self.read();
        std::array::from_fn(|k| after[k] - before[k])
    }

    /// CPU ms per 1,000 tasks of `secs` (CPU seconds per process, summed over runs of `n`
    /// tasks in all), as a line, with the figures.
    fn report_spent(&self, label: &str, secs: [f64; 3], n: usize) -> (String, [f64; 3]) {
        let per = secs.map(|s| s * 1000.0 * 1000.0 / n.max(1) as f64);
        (self.line(label, per), per)
    }

    /// A line of CPU ms per 1,000 tasks per process.
    fn line(&self, label: &str, per: [f64; 3]) -> String {
        let parts: Vec<String> = self
            .pids
            .iter()
            .zip(per)
            .map(|((name, _), v)| format!("{name} {v:.0}"))
            .collect();
        let total: f64 = per.iter().filter(|v| v.is_finite()).sum();
        format!(
            "{label:<18}: CPU ms per 1,000 tasks: {} (total {total:.0})",
            parts.join(", ")
        )
    }

    /// CPU ms per 1,000 tasks of each process between `before` and now, as a line.
    fn report(&self, label: &str, before: [f64; 3], n: usize) -> String {
        self.report_with(label, before, n).0
    }
}

/// Redis's own account of a stage (`INFO commandstats`: calls and µs of CPU per command),
/// read with `redis-cli` so the bench adds no connection of its own to the pool it measures.
struct RedisCalls(std::collections::BTreeMap<String, (u64, u64)>);

impl RedisCalls {
    fn read() -> Self {
        let mut m = std::collections::BTreeMap::new();
        let out = std::process::Command::new("redis-cli")
            .args(["INFO", "commandstats"])
            .output();
        if let Ok(out) = out {
            for line in String::from_utf8_lossy(&out.stdout).lines() {
                let Some((name, rest)) = line
                    .strip_prefix("cmdstat_")
                    .and_then(|l| l.split_once(':'))
                else {
                    continue;
                };
                let field = |k: &str| {
                    rest.split(',')
                        .find_map(|kv| kv.strip_prefix(k)?.strip_prefix('=')?.parse::<u64>().ok())
                        .unwrap_or(0)
                };
                m.insert(name.to_string(), (field("calls"), field("usec")));
            }
        }
        RedisCalls(m)
    }

    /// Commands and Redis CPU per task since `self`, the busiest commands first.
    fn report(&self, label: &str, n: usize) -> String {
        self.report_with(label, n).0
    }

    /// [`RedisCalls::report`] with its commands per task.
    fn report_with(&self, label: &str, n: usize) -> (String, f64) {
        self.since().lines(label, n)
    }

    /// The calls and µs per command since `self` (a snapshot), as a map of the differences.
    fn since(&self) -> RedisCalls {
        let now = RedisCalls::read();
        RedisCalls(
            now.0
                .into_iter()
                .map(|(k, (c, u))| {
                    let (c0, u0) = self.0.get(&k).copied().unwrap_or((0, 0));
                    (k, (c.saturating_sub(c0), u.saturating_sub(u0)))
                })
                .collect(),
        )
    }

    /// Adds the differences `d` (from [`RedisCalls::since`]) to these.
    fn add(&mut self, d: &RedisCalls) {
        for (k, &(c, u)) in &d.0 {
            let e = self.0.entry(k.clone()).or_default();
            e.0 += c;
            e.1 += u;
        }
    }

    /// Differences (from [`RedisCalls::since`], summed over runs of `n` tasks in all) as a
    /// line, with the commands per task.
    fn lines(&self, label: &str, n: usize) -> (String, f64) {
        let mut rows: Vec<(String, f64, f64)> = self
            .0
            .iter()
            .map(|(k, &(c, u))| {
                (
                    k.clone(),
                    c as f64 / n.max(1) as f64,
                    u as f64 / n.max(1) as f64,
                )
            })
            .filter(|r| r.1 > 0.0)
            .collect();
        rows.sort_by(|a, b| b.2.total_cmp(&a.2));
        // Commands a script runs are counted under their own names too, and their time is in
        // the script's: the total counts commands (not script calls) and sums the time of
        // scripts and of commands sent on their own, which Redis does not tell apart.
        let script = |k: &str| k.starts_with("eval") || k.starts_with("fcall");
        let calls: f64 = rows.iter().filter(|r| !script(&r.0)).map(|r| r.1).sum();
        let top: Vec<String> = rows
            .iter()
            .take(10)
            .map(|(k, c, u)| format!("{k} {c:.2}×{u:.1}µs"))
            .collect();
        (format!("{label:<18}: Redis per task: {calls:.2} commands; by command (calls × µs of CPU, a script's µs include its commands): {}", top.join(", ")), calls)
    }
}

/// A raw run's figures: delivery rate over the whole run, and submit→delivery at the last hop.
struct Raw {
    rate: f64,
    lat_ms: Vec<f64>,
}

/// How the raw client spreads its hops over AMQP connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Conns {
    /// One connection for the producer and every hop (one lapin I/O thread: the thread that
    /// just wrote a publish is awake when the broker's delivery comes back).
    Shared,
    /// A connection of its own for the producer and for each hop, as a producer, a forwarding
    /// service and a consumer in three processes have (fleet's producer, scheduler and worker
    /// each hold their own).
    PerHop,
}

async fn raw_broker(n: usize, hops: usize, conns: Conns) -> Result<f64> {
    Ok(raw_run(n, hops, Offer::Burst, conns, None, Fan::ONE)
        .await?
        .rate)
}

/// The raw client's last hop: how many queues it spreads over (round robin) and each one's
/// consumer prefetch. [`Fan::ONE`]: one queue at [`RAW_PREFETCH`]; the 10-group stage's topology
/// is ten queues, a consumer each on a connection of its own, prefetch 26 (a worker of capacity
/// 26 prefetches its capacity).
#[derive(Clone, Copy, Debug)]
struct Fan {
    queues: usize,
    prefetch: u16,
}

impl Fan {
    const ONE: Fan = Fan {
        queues: 1,
        prefetch: RAW_PREFETCH,
    };
}

/// The floor ([`Floor`]) in a namespace of its own, `n` messages offered `how` over a
/// connection per hop; its figures and how many answers were not reserved / run.
async fn floor_run(
    qt: &str,
    settings: &[(&str, &str)],
    n: usize,
    how: Offer,
) -> Result<(Raw, usize)> {
    let ns = Ns::with_queue_type(qt).await?;
    let floor = Arc::new(Floor::start(&ns, settings, n).await?);
    let raw = raw_run(n, 2, how, Conns::PerHop, Some(floor.clone()), Fan::ONE).await?;
    ns.cleanup().await?;
    Ok((raw, floor.anomalies.load(Ordering::Relaxed)))
}

/// The raw client; with `floor`, a two-hop client that also does fleet's Redis work per task
/// (see [`Floor`]).
async fn raw_run(
    n: usize,
    hops: usize,
    how: Offer,
    conns: Conns,
    floor: Option<Arc<Floor>>,
    fan: Fan,
) -> Result<Raw> {
    let conn = Arc::new(amqp::connect(&amqp_url(), "bench-raw").await?);
    let tag = uuid::Uuid::new_v4().simple().to_string();
    // The queues of each hop (one, but for the last hop's fan) and each queue's connection.
    let mut stages: Vec<Vec<String>> = Vec::new();
    let mut hop_conns: Vec<Vec<Arc<lapin::Connection>>> = Vec::new();
    for i in 0..hops {
        let width = if i + 1 == hops { fan.queues.max(1) } else { 1 };
        let mut qs = Vec::new();
        let mut cs = Vec::new();
        for j in 0..width {
            qs.push(format!("bench.{tag}.{i}.{j}"));
            cs.push(match conns {
                Conns::Shared => conn.clone(),
                Conns::PerHop => {
                    Arc::new(amqp::connect(&amqp_url(), &format!("bench-raw-hop{i}.{j}")).await?)
                }
            });
        }
        stages.push(qs);
        hop_conns.push(cs);
    }
    let queues: Vec<String> = stages.iter().flatten().cloned().collect();
    let setup = conn.create_channel().await?;
    for q in &queues {
        setup
            .queue_declare(
                q.as_str().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                quorum(),
            )
            .await?;
    }
    let done = Arc::new(AtomicUsize::new(0));
    let lat: Arc<Mutex<Vec<f64>>> = Arc::default();
    let mut tasks = Vec::new();
    let consumers = stages
        .iter()
        .enumerate()
        .flat_map(|(i, qs)| qs.iter().enumerate().map(move |(j, q)| (i, j, q.clone())));
    for (i, j, q) in consumers {
        let hop = &hop_conns[i][j];
        let ch = hop.create_channel().await?;
        let last = i + 1 == stages.len();
        let prefetch = if last { fan.prefetch } else { RAW_PREFETCH };
        // A consumer acks at most half its prefetch at a time (as a worker's ack window does
        // when its prefetch is small), else every RAW_ACK_EVERY.
        let ack_every = RAW_ACK_EVERY.min(usize::from(prefetch / 2).max(1));
        ch.basic_qos(prefetch, BasicQosOptions::default()).await?;
        let next = stages.get(i + 1).cloned();
        let pubch = amqp::confirm_channel(hop).await?;
        let mut consumer = ch
            .basic_consume(
                q.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let (done, lat) = (done.clone(), lat.clone());
        let floor = floor.clone();
        tasks.push(tokio::spawn(async move {
            // Forwarding hop: publish, and let a second task await confirms in order and ack
            // (pipelined, as fleet's scheduler does).
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(
                lapin::PublisherConfirm,
                lapin::message::Delivery,
                String,
            )>();
            // Confirms come back in order; ack what is confirmed with one `multiple` ack per
            // run of deliveries (whatever has been confirmed when the queue of confirms is
            // momentarily empty, at most RAW_ACK_EVERY at a time). With `floor`, the run's
            // submissions are marked handed on first, as fleet's scheduler does.
            let marks = floor.clone();
            let acker = tokio::spawn(async move {
                let mut run: Vec<String> = Vec::new();
                while let Some((c, d, id)) = rx.recv().await {
                    let _ = amqp::confirmed(c).await;
                    run.push(id);
                    if run.len() >= RAW_ACK_EVERY || rx.is_empty() {
                        if let Some(f) = &marks {
                            f.handed_on(&run).await;
                        }
                        let _ = d.acker.ack(BasicAckOptions { multiple: true }).await;
                        run.clear();
                    }
                }
            });
            let mut unacked = 0;
            let mut rr = 0usize;
            while let Some(Ok(first)) = consumer.next().await {
                // Without `floor` one delivery at a time; with it, what the broker has already
                // pushed too (as fleet's dispatch loops and worker ledger batch their Redis calls).
                let mut batch = vec![first];
                if let Some(f) = &floor {
                    let most = if next.is_some() {
                        f.batch_max
                    } else {
                        ack_every
                    };
                    while batch.len() < most {
                        match consumer.next().now_or_never() {
                            Some(Some(Ok(d))) => batch.push(d),
                            _ => break,
                        }
                    }
                }
                if let Some(nq) = &next {
                    let ids = match &floor {
                        Some(f) => f.reserve(batch.len()).await,
                        None => vec!["x".to_string()],
                    };
                    // The next hop's queues in turn (one but for a fan).
                    let keys: Vec<&String> = batch
                        .iter()
                        .map(|_| {
                            rr = rr.wrapping_add(1);
                            &nq[rr % nq.len()]
                        })
                        .collect();
                    // Started together, as fleet's dispatch does (`amqp::publish_batch`).
                    let msgs =
                        batch
                            .iter()
                            .zip(&ids)
                            .zip(&keys)
                            .map(|((d, id), key)| amqp::Outgoing {
                                exchange: "",
                                routing_key: key.as_str(),
                                body: &d.data,
                                props: amqp::task_properties(id, None),
                            });
                    let sent = amqp::publish_batch(&pubch, msgs).await;
                    for ((d, id), c) in batch.into_iter().zip(ids).zip(sent) {
                        if let Ok(c) = c {
                            let _ = tx.send((c, d, id));
                        }
                    }
                    continue;
                }
                // Latency is taken once a task may start (after its claim), as fleet's is.
                let runs = match &floor {
                    Some(f) => f.claim(&batch).await,
                    None => 0,
                };
                for d in &batch {
                    if let Some(sent) = std::str::from_utf8(&d.data)
                        .ok()
                        .and_then(|b| b.split(' ').next())
                        .and_then(|b| b.parse::<i64>().ok())
                    {
                        if let Ok(mut v) = lat.lock() {
                            v.push((now_us() - sent) as f64 / 1000.0);
                        }
                    }
                }
                if let Some(f) = &floor {
                    f.finish(&batch, runs).await;
                }
                let mut finished = false;
                for d in batch {
                    unacked += 1;
                    finished = done.fetch_add(1, Ordering::Relaxed) + 1 >= n;
                    if unacked >= ack_every || finished {
                        let _ = d.acker.ack(BasicAckOptions { multiple: true }).await;
                        unacked = 0;
                    }
                }
                if finished {
                    break;
                }
            }
            acker.abort();
        }));
    }
    let pubch = amqp::confirm_channel(&conn).await?;
    let start = Instant::now();
    let first = stages[0][0].clone();
    offer(n, how, |k| {
        let (pubch, first) = (pubch.clone(), first.clone());
        async move {
            // The body: the submission time (µs; the last hop measures submit→delivery), then
            // an envelope, so raw messages weigh what fleet's do. Published together, as
            // fleet's producer does (`amqp::publish_batch`).
            let bodies: Vec<String> = (0..k)
                .map(|_| {
                    format!(
                        "{} {}",
                        now_us(),
                        String::from_utf8_lossy(&Envelope::new("noop", json!(null)).to_bytes())
                    )
                })
                .collect();
            let msgs = bodies.iter().map(|b| amqp::Outgoing {
                exchange: "",
                routing_key: &first,
                body: b.as_bytes(),
                props: amqp::task_properties("x", None),
            });
            for c in amqp::publish_batch(&pubch, msgs).await {
                amqp::confirmed(c?).await?;
            }
            Ok(())
        }
    })
    .await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    while done.load(Ordering::Relaxed) < n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let rate = done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64();
    let lat_ms = lat.lock().map(|v| v.clone()).unwrap_or_default();
    for t in tasks {
        t.abort();
    }
    // The queues go on a connection of their own: deleted on the one its consumers share
    // (Conns::Shared), the broker's cancel of the consumer just dropped made lapin close that
    // connection ("unexpected basic cancel-ok"), and the queue after the first was left behind.
    let cleanup = amqp::connect(&amqp_url(), "bench-raw-cleanup").await?;
    let deleter = cleanup.create_channel().await?;
    for q in &queues {
        if let Err(e) = deleter
            .queue_delete(q.as_str().into(), QueueDeleteOptions::default())
            .await
        {
            eprintln!("raw client: deleting {q}: {e}");
        }
    }
    let _ = cleanup.close(200, "bye".into()).await;
    if conns == Conns::PerHop {
        for c in hop_conns.iter().flatten() {
            let _ = c.close(200, "bye".into()).await;
        }
    }
    let _ = conn.close(200, "bye".into()).await;
    Ok(Raw { rate, lat_ms })
}

/// A fleet for one benchmark: a scheduler and workers in this process, a handler `count`
/// that records every run (count, distinct ids, submit→start wait, which worker) and sleeps
/// `payload.ms` if given.
struct Rig {
    ns: Ns,
    sched: SchedulerHandle,
    workers: Vec<WorkerHandle>,
    done: Arc<AtomicUsize>,
    ids: Arc<Mutex<std::collections::HashSet<String>>>,
    lat_ms: Arc<Mutex<Vec<f64>>>,
    by_worker: Arc<Mutex<std::collections::BTreeMap<String, usize>>>,
}

impl Rig {
    async fn start(
        qt: &str,
        settings: &[(&str, &str)],
        workers: &[(&str, &str, u32)],
    ) -> Result<Rig> {
        let ns = Ns::with_queue_type(qt).await?;
        let done = Arc::new(AtomicUsize::new(0));
        let ids: Arc<Mutex<std::collections::HashSet<String>>> = Arc::default();
        let lat_ms: Arc<Mutex<Vec<f64>>> = Arc::default();
        let by_worker: Arc<Mutex<std::collections::BTreeMap<String, usize>>> = Arc::default();
        let (d2, i2, l2, b2) = (done.clone(), ids.clone(), lat_ms.clone(), by_worker.clone());
        let count = handler_fn(move |ctx| {
            let (d, i, l, b) = (d2.clone(), i2.clone(), l2.clone(), b2.clone());
            async move {
                if let Some(s) = ctx.envelope.submitted_at {
                    if let Ok(mut v) = l.lock() {
                        v.push((now_us() - s.timestamp_micros()) as f64 / 1000.0);
                    }
                }
                if let Ok(mut m) = b.lock() {
                    *m.entry(ctx.worker_id.to_string()).or_default() += 1;
                }
                if let Ok(mut s) = i.lock() {
                    s.insert(ctx.envelope.id.clone());
                }
                if let Some(ms) = ctx.envelope.payload.get("ms").and_then(|v| v.as_u64()) {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                d.fetch_add(1, Ordering::Relaxed);
                Ok(serde_json::Value::Null)
            }
        });
        let h = [("count", count)];
        let sched = start_scheduler_exactly(&ns, settings).await?;
        let mut ws = Vec::new();
        for (id, labels, cap) in workers {
            ws.push(start_worker(&ns, id, labels, *cap, &[], &h).await?);
        }
        Ok(Rig {
            ns,
            sched,
            workers: ws,
            done,
            ids,
            lat_ms,
            by_worker,
        })
    }

    /// Offers `n` envelopes made by `mk(k)` (k = 0..n; `submitted_at` set as each is
    /// published), waits until they have all run (at most `within`); the rate over the whole
    /// run, from the first publish to the last completion, and the elapsed time.
    async fn run(
        &self,
        n: usize,
        how: Offer,
        within: Duration,
        mk: impl Fn(usize) -> Envelope,
    ) -> Result<(f64, f64)> {
        let base = self.done.load(Ordering::Relaxed);
        if let Ok(mut v) = self.lat_ms.lock() {
            v.clear();
        }
        let next = std::cell::Cell::new(0usize);
        let (ns, mk, next) = (&self.ns, &mk, &next);
        let start = Instant::now();
        offer(n, how, |k| async move {
            let envs: Vec<Envelope> = (0..k)
                .map(|_| {
                    let i = next.get();
                    next.set(i + 1);
                    let mut e = mk(i);
                    e.submitted_at = Some(chrono::Utc::now());
                    e
                })
                .collect();
            ns.submit(&envs).await.map(|_| ())
        })
        .await?;
        let deadline = Instant::now() + within;
        while self.done.load(Ordering::Relaxed) < base + n && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        let t = start.elapsed().as_secs_f64();
        Ok(((self.done.load(Ordering::Relaxed) - base) as f64 / t, t))
    }

    fn latencies(&self) -> Vec<f64> {
        self.lat_ms.lock().map(|v| v.clone()).unwrap_or_default()
    }

    fn once(&self) -> (usize, usize) {
        (
            self.done.load(Ordering::Relaxed),
            self.ids.lock().map(|s| s.len()).unwrap_or(0),
        )
    }

    /// Tasks parked since the scheduler started (`fleet_tasks_parked_total`): a stage's share
    /// is the difference across it.
    async fn parked(&self) -> Result<f64> {
        let page = self.metrics_page().await?;
        Ok(metric_sum(&page, "fleet_tasks_parked_total", &[]))
    }

    /// The scheduler's `/metrics` page.
    async fn metrics_page(&self) -> Result<String> {
        Ok(http()
            .get(self.sched.url("/metrics"))
            .send()
            .await?
            .text()
            .await?)
    }

    async fn metrics(&self) -> Result<String> {
        let page = self.metrics_page().await?;
        Ok(format!(
            "dispatched {} parked {} throttled {} rerouted {}",
            metric_sum(&page, "fleet_tasks_dispatched_total", &[]),
            metric_sum(&page, "fleet_tasks_parked_total", &[]),
            metric_sum(&page, "fleet_dispatch_throttled_total", &[]),
            metric_sum(&page, "fleet_tasks_rerouted_total", &[])
        ))
    }

    async fn stop(self) -> Result<()> {
        for w in self.workers {
            w.stop().await?;
        }
        self.sched.stop().await?;
        self.ns.cleanup().await
    }
}

/// Waits until Redis has seen no script call for 20 ms (at most 1 s): a fleet stage's last
/// outcomes are written, so its CPU and Redis figures end with it and not in what runs next.
/// (Not its last acks, nor an outcome retried after a failed write: small.)
/// Reads `redis-cli` on a blocking thread (not one of the runtime's, which the fleet in this
/// process runs on), each read bounded at 500 ms; a read that fails or finds no script count
/// ends the wait with a line saying so.
async fn settle() {
    async fn scripts() -> Option<u64> {
        let read = tokio::task::spawn_blocking(RedisCalls::read);
        let calls = tokio::time::timeout(Duration::from_millis(500), read)
            .await
            .ok()?
            .ok()?;
        calls.0.get("evalsha").map(|c| c.0)
    }
    let start = Instant::now();
    let mut last = None;
    loop {
        let Some(now) = scripts().await else {
            println!("settle: no script count from `redis-cli INFO commandstats`; not waited");
            return;
        };
        if last == Some(now) || start.elapsed() >= Duration::from_secs(1) {
            return;
        }
        last = Some(now);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The median of `v` (the mean of the middle two for an even count; NaN when empty or when any
/// value is NaN).
fn median(v: impl Iterator<Item = f64>) -> f64 {
    let mut v: Vec<f64> = v.collect();
    if v.is_empty() || v.iter().any(|x| x.is_nan()) {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

fn p50_p99(v: &[f64]) -> (f64, f64) {
    let mut v = v.to_vec();
    (pct(&mut v, 0.5), pct(&mut v, 0.99))
}

/// Everything issue 11 measures, in one run: fleet at the product defaults against the raw
/// broker's two-hop ceiling measured in the same run.
async fn throughput(n: usize) -> Result<()> {
    println!("# throughput: {n} messages/tasks, quorum queues, publisher confirms");
    let qt = std::env::var("BENCH_QUEUE_TYPE").unwrap_or_else(|_| "quorum".into());
    // The product's defaults, but for an ingress bound that holds the whole burst.
    let bound = n.max(10_000).to_string();
    // BENCH_SCHEDULER="k=v,k=v" adds scheduler settings, for experiments only (printed).
    let extra = std::env::var("BENCH_SCHEDULER").unwrap_or_default();
    let mut settings: Vec<(&str, &str)> = vec![
        ("ingress_max_normal", bound.as_str()),
        ("queue_type", qt.as_str()),
    ];
    settings.extend(extra.split(',').filter_map(|kv| kv.split_once('=')));
    let settings = settings.as_slice();
    println!(
        "scheduler settings: {settings:?}; everything else (admission included) at its default"
    );
    println!(
        "workers: settings {:?} (+ worker_id, labels, capacity as listed per stage)",
        fleet_tests::WORKER_DEFAULTS
    );
    let steady_n: usize = std::env::var("BENCH_STEADY_N")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let idle_n: usize = 200;
    /// Blocks the idle stage alternates between fleet and the raw client (stage 3).
    const IDLE_BLOCKS: usize = 10;

    // 1. Burst, one group (2 workers), no-op tasks, in rounds with the raw two-hop client's
    //    bursts between them (below). The raw client's queues are empty when it deletes them
    //    (it consumes every message it publishes), so its rounds leave the broker nothing to
    //    clean up behind fleet's (deleting *full* quorum queues keeps the quorum machinery busy
    //    for a while).
    let cap: u32 = std::env::var("BENCH_CAPACITY")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(128);
    println!("\n## 1. burst of {n} no-op tasks, 2 workers × capacity {cap} (one group)");
    let rig = Rig::start(
        &qt,
        settings,
        &[("bench-w1", "", cap), ("bench-w2", "", cap)],
    )
    .await?;
    // Sample the pressure state during the run (how often the fleet throttled itself).
    let purl = rig.sched.url("/v1/pressure");
    let sampling = tokio_util::sync::CancellationToken::new();
    let sampler = {
        let stop = sampling.clone();
        tokio::spawn(async move {
            let mut seen: std::collections::BTreeMap<String, usize> = Default::default();
            while !stop.is_cancelled() {
                if let Ok(p) = get_json(&purl).await {
                    *seen
                        .entry(format!(
                            "gate={} load={:.2}",
                            p["gate"].as_str().unwrap_or("?"),
                            (p["load"].as_f64().unwrap_or(0.0) * 10.0).floor() / 10.0
                        ))
                        .or_default() += 1;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            seen
        })
    };
    // The burst runs in rounds, each followed (not with BENCH_SKIP_RAW) by the raw two-hop
    // client's burst in each of its connection layouts: a slow spell of the machine then
    // weighs on both sides of the ratio, not on one (in runs minutes apart, the same binary's
    // CPU per 1,000 tasks in the burst was 72, 97 and 107 ms, BENCHMARKS.md round 27). The
    // ratio is the median of the rounds'; CPU and Redis figures are summed over all rounds of
    // a side.
    let skip_raw = std::env::var("BENCH_SKIP_RAW").is_ok();
    let rounds: usize = std::env::var("BENCH_BURST_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if skip_raw { 1 } else { 3 })
        .max(1);
    let cpu = CpuMeter::new();
    let mut fleet_secs = [0.0; 3];
    let mut fleet_calls = RedisCalls(Default::default());
    let (mut shared_secs, mut per_hop_secs) = ([0.0; 3], [0.0; 3]);
    // Per round: fleet's rate, the raw client's with one connection and with one per hop.
    let mut round_rates: Vec<(f64, f64, f64)> = Vec::new();
    for round in 1..=rounds {
        let (cpu0, calls0) = (cpu.read(), RedisCalls::read());
        let (rate, t) = rig
            .run(n, Offer::Burst, Duration::from_secs(300), |_| {
                Envelope::new("count", json!(null))
            })
            .await?;
        // The last outcomes and acks are written after the handlers ran: they are this
        // round's work, not the raw burst's that follows.
        settle().await;
        let spent = cpu.spent(cpu0);
        fleet_secs = std::array::from_fn(|k| fleet_secs[k] + spent[k]);
        fleet_calls.add(&calls0.since());
        if round == 1 {
            sampling.cancel();
        }
        println!(
            "fleet burst       : {rate:>8.0} tasks/s ({n} in {t:.2} s; round {round} of {rounds})"
        );
        let (mut shared, mut per_hop) = (f64::NAN, f64::NAN);
        if !skip_raw {
            for (conns, raw_rate, secs) in [
                (Conns::Shared, &mut shared, &mut shared_secs),
                (Conns::PerHop, &mut per_hop, &mut per_hop_secs),
            ] {
                let cpu0 = cpu.read();
                *raw_rate = raw_broker(n, 2, conns).await?;
                let spent = cpu.spent(cpu0);
                *secs = std::array::from_fn(|k| secs[k] + spent[k]);
            }
            println!(
                "raw broker, 2 hops: {shared:>8.0} msg/s (one connection), {per_hop:>8.0} (a connection per hop); fleet / the better = {:.2}",
                rate / shared.max(per_hop)
            );
        }
        round_rates.push((rate, shared, per_hop));
    }
    let burst = median(round_rates.iter().map(|r| r.0));
    // The raw client's median per layout (NaN with BENCH_SKIP_RAW).
    let shared_median = median(round_rates.iter().map(|r| r.1));
    let per_hop_median = median(round_rates.iter().map(|r| r.2));
    let (runs, distinct) = rig.once();
    println!("fleet burst       : {burst:>8.0} tasks/s (median of {rounds} rounds; {runs} runs of {} tasks)", n * rounds);
    println!(
        "runs {runs} distinct tasks {distinct} (runs beyond distinct = at-least-once redeliveries)"
    );
    println!(
        "pressure samples (every 100 ms, round 1): {:?}",
        sampler.await?
    );
    let (cpu_burst, fleet_cpu) = cpu.report_spent("fleet burst", fleet_secs, n * rounds);
    let (calls_burst, commands_burst) = fleet_calls.lines("fleet burst", n * rounds);
    println!("{cpu_burst}");
    println!("{calls_burst}");
    println!("{}", rig.metrics().await?);

    // 1b. The same burst with 1,000 distinct fairness keys (issue 33): each task counted
    // against its key in the reservation, waiting ones parked in the group's fair queues.
    println!("\n## 1b. burst of {n} no-op tasks over 1,000 distinct keys (no limits), same fleet");
    let cpu0 = cpu.read();
    let calls0 = RedisCalls::read();
    let parked0 = rig.parked().await?;
    let (burst_keys, t) = rig
        .run(n, Offer::Burst, Duration::from_secs(300), |k| {
            let mut e = Envelope::new("count", json!(null));
            e.key = Some(format!("k{}", k % 1000));
            e
        })
        .await?;
    // Against the no-key round nearest in time (the last of stage 1).
    let last_round = round_rates.last().map_or(burst, |r| r.0);
    println!(
        "fleet burst keyed : {burst_keys:>8.0} tasks/s ({t:.2} s) = {:.2} of the no-key burst (its last round, {last_round:.0} tasks/s)",
        burst_keys / last_round
    );
    println!("{}", cpu.report("fleet burst keyed", cpu0, n));
    println!("{}", calls0.report("fleet burst keyed", n));
    // Keyed tasks never go direct beyond a group's room (the fair park queues share what
    // frees between keys), so this stage's park hop is what sets it apart from the burst.
    println!(
        "fleet burst keyed : parked {:.0} of {n} (a third broker hop each)",
        rig.parked().await? - parked0
    );

    // 2. Steady 1,000 tasks/s offered, same fleet.
    println!("\n## 2. steady: {steady_n} no-op tasks offered at 1,000/s, same fleet");
    let (steady, t) = rig
        .run(
            steady_n,
            Offer::Steady(1000.0),
            Duration::from_secs(120),
            |_| Envelope::new("count", json!(null)),
        )
        .await?;
    let (s50, s99) = p50_p99(&rig.latencies());
    println!("fleet steady      : {steady:>8.0} tasks/s ({t:.2} s); submit→start p50 {s50:.2} ms p99 {s99:.2} ms");

    // 3. Idle latency, same fleet: one task at a time, in blocks that alternate with the raw
    //    two-hop client's two layouts (not with BENCH_SKIP_RAW), so that a slow spell of the
    //    machine weighs on both sides of the Δ and not on one (run minutes apart, the two
    //    sides' p99 once read 8.4 ms against 64.7 ms). Each raw block declares its queues and
    //    deletes them at its end (empty quorum queues), so fleet's blocks follow a deletion
    //    and the raw ones half the time: if anything, that weighs on fleet's side.
    let per_block = idle_n.div_ceil(IDLE_BLOCKS);
    println!(
        "\n## 3. idle submit→start latency: {idle_n} tasks, one every 10 ms, same fleet, in {IDLE_BLOCKS} blocks of {per_block}{}",
        if skip_raw { "" } else { ", each followed by a block of the raw two-hop client's (submit→delivery) in each connection layout" }
    );
    let (mut fleet_idle, mut raw_idle_per_hop, mut raw_idle_shared) = (vec![], vec![], vec![]);
    for _ in 0..IDLE_BLOCKS {
        rig.run(
            per_block,
            Offer::OneEvery(Duration::from_millis(10)),
            Duration::from_secs(30),
            |_| Envelope::new("count", json!(null)),
        )
        .await?;
        // Each block's first task comes after a second of other work (the raw blocks set up
        // connections and queues): a cold path on every side, so every side drops it.
        fleet_idle.extend(rig.latencies().into_iter().skip(1));
        if !skip_raw {
            for (conns, into) in [
                (Conns::PerHop, &mut raw_idle_per_hop),
                (Conns::Shared, &mut raw_idle_shared),
            ] {
                let r = raw_run(
                    per_block,
                    2,
                    Offer::OneEvery(Duration::from_millis(10)),
                    conns,
                    None,
                    Fan::ONE,
                )
                .await?;
                into.extend(r.lat_ms.into_iter().skip(1));
            }
        }
    }
    let (f50, f99) = p50_p99(&fleet_idle);
    println!(
        "fleet idle        : p50 {f50:.2} ms p99 {f99:.2} ms (n={})",
        fleet_idle.len()
    );
    for (lat, layout) in [
        (&raw_idle_per_hop, "a connection per hop"),
        (&raw_idle_shared, "one connection"),
    ] {
        if !lat.is_empty() {
            let (r50, r99) = p50_p99(lat);
            println!(
                "raw 2 hops idle   : submit→delivery p50 {r50:.2} ms p99 {r99:.2} ms (n={}, {layout})",
                lat.len()
            );
        }
    }
    let (runs, distinct) = rig.once();
    println!("runs {runs} distinct tasks {distinct} (stages 1-3)");
    rig.stop().await?;

    // 4. Ten groups, mixed selectors.
    println!("\n## 4. burst of {n} no-op tasks over 10 groups (10 workers × capacity 26): a third pinned to one zone (1 candidate), a third to a tier (5 candidates), a third anywhere (10)");
    let ws: Vec<(String, String)> = (0..10)
        .map(|i| {
            (
                format!("bench-g{i}"),
                format!("zone=z{i},tier={}", if i < 5 { "a" } else { "b" }),
            )
        })
        .collect();
    let wrefs: Vec<(&str, &str, u32)> = ws
        .iter()
        .map(|(id, l)| (id.as_str(), l.as_str(), 26))
        .collect();
    let rig = Rig::start(&qt, settings, &wrefs).await?;
    let cpu = CpuMeter::new();
    let cpu0 = cpu.read();
    let calls0 = RedisCalls::read();
    let timeline = pressure_timeline(rig.sched.url("/v1/pressure"));
    let (groups10, t) = rig
        .run(n, Offer::Burst, Duration::from_secs(300), |k| match k % 3 {
            0 => task("count", json!(null), &format!("zone=z{}", k % 10)),
            1 => task(
                "count",
                json!(null),
                if k % 2 == 0 { "tier=a" } else { "tier=b" },
            ),
            _ => task("count", json!(null), ""),
        })
        .await?;
    let (runs, distinct) = rig.once();
    println!(
        "fleet 10 groups   : {groups10:>8.0} tasks/s ({runs} runs, {distinct} distinct, {t:.2} s)"
    );
    println!("{}", cpu.report("fleet 10 groups", cpu0, n));
    println!("{}", calls0.report("fleet 10 groups", n));
    println!("{}", rig.metrics().await?);
    timeline.0.cancel();
    println!("pressure samples of the stage (ms from its start: state waiting load ingress parked behind):");
    for l in timeline.1.await? {
        println!("  {l}");
    }
    rig.stop().await?;

    // 5. 200 ms tasks on two groups of different speed (16 vs 4 slots).
    let long_n = 200;
    println!("\n## 5. split: a burst of {long_n} tasks of 200 ms that both groups can take; fast group 16 slots, slow group 4");
    let rig = Rig::start(
        &qt,
        settings,
        &[
            ("bench-fast", "pool=long,speed=fast", 16),
            ("bench-slow", "pool=long,speed=slow", 4),
        ],
    )
    .await?;
    let (_, t) = rig
        .run(long_n, Offer::Burst, Duration::from_secs(120), |_| {
            task("count", json!({"ms": 200}), "pool=long")
        })
        .await?;
    let split = rig.by_worker.lock().map(|m| m.clone()).unwrap_or_default();
    let fast = split.get("bench-fast").copied().unwrap_or(0);
    let slow = split.get("bench-slow").copied().unwrap_or(0);
    // What an ideal split would finish in: all 20 slots busy until the end.
    let ideal = (long_n as f64 / 20.0).ceil() * 0.2;
    println!(
        "split: fast {fast} ({:.0}%), slow {slow} ({:.0}%) — by capacity 80% / 20%; done in {t:.2} s (ideal {ideal:.2} s; everything on the fast group {:.2} s)",
        100.0 * fast as f64 / long_n as f64,
        100.0 * slow as f64 / long_n as f64,
        (long_n as f64 / 16.0).ceil() * 0.2
    );
    println!("{}", rig.metrics().await?);
    rig.stop().await?;

    // Raw broker, same run. `budget`: CPU per 1,000 tasks of the raw client (its faster layout)
    // and of the floor, for the summary's budget line.
    let mut budget: Option<([f64; 3], [f64; 3])> = None;
    let (one, two_here, fan10, floor_rate, raw_steady) = if skip_raw {
        let none = || Raw {
            rate: f64::NAN,
            lat_ms: vec![],
        };
        (f64::NAN, f64::NAN, f64::NAN, f64::NAN, none())
    } else {
        println!("\n## raw broker (this process, same run)");
        let one = raw_broker(n, 1, Conns::Shared).await?;
        println!("raw broker, 1 hop : {one:>8.0} msg/s");
        // The two-hop bursts beside fleet's (stage 1), then once more here, beside the floor
        // and the 10-queue topology measured next (and the 10-group stage just before): each
        // ratio is taken against the raw burst nearest in time.
        println!(
            "raw broker, 2 hops: {shared_median:>8.0} msg/s (one connection), {per_hop_median:>8.0} (a connection per hop): medians of the {rounds} rounds beside fleet's burst (stage 1)"
        );
        println!(
            "{}",
            cpu.report_spent("raw 2 hops", shared_secs, n * rounds).0
        );
        println!(
            "{}",
            cpu.report_spent("raw 2 hops, per hop", per_hop_secs, n * rounds)
                .0
        );
        let cpu0 = cpu.read();
        let shared = raw_broker(n, 2, Conns::Shared).await?;
        let (shared_line, shared_cpu) = cpu.report_with("raw 2 hops here", cpu0, n);
        let cpu0 = cpu.read();
        let per_hop = raw_broker(n, 2, Conns::PerHop).await?;
        let (per_hop_line, per_hop_cpu) = cpu.report_with("raw 2 hops here, per hop", cpu0, n);
        println!("raw broker, 2 hops: {shared:>8.0} msg/s (one connection), {per_hop:>8.0} (a connection per hop): here, beside the floor and the 10-queue topology");
        println!("{shared_line}");
        println!("{per_hop_line}");
        // The 10-group stage's topology without fleet: the second hop spread over ten queues,
        // each with one consumer on a connection of its own at prefetch 26 (ten workers of
        // capacity 26). What the broker alone costs in that shape.
        let cpu0 = cpu.read();
        let fan10 = raw_run(
            n,
            2,
            Offer::Burst,
            Conns::PerHop,
            None,
            Fan {
                queues: 10,
                prefetch: 26,
            },
        )
        .await?
        .rate;
        println!("raw broker, 2 hops: {fan10:>8.0} msg/s (second hop over 10 queues, a connection and prefetch 26 each: the 10-group stage's topology)");
        println!("{}", cpu.report("raw 2 hops, 10 q", cpu0, n));
        // The same client doing fleet's Redis work per task (a connection per hop).
        let cpu0 = cpu.read();
        let calls0 = RedisCalls::read();
        let (floor_burst, anomalies) = floor_run(&qt, settings, n, Offer::Burst).await?;
        let floor_rate = floor_burst.rate;
        println!("raw 2 hops + fleet's Redis work: {floor_rate:>8.0} msg/s ({anomalies} anomalies: answers other than reserved / run)");
        let (line, floor_cpu) = cpu.report_with("raw + fleet Redis", cpu0, n);
        println!("{line}");
        // The floor's budget is taken against the faster layout of the raw bursts just before it.
        budget = Some((
            if shared > per_hop {
                shared_cpu
            } else {
                per_hop_cpu
            },
            floor_cpu,
        ));
        println!("{}", calls0.report("raw + fleet Redis", n));
        // The broker's ceiling here: the better of the two.
        let two_here = shared.max(per_hop);
        let raw_steady = raw_run(
            steady_n,
            2,
            Offer::Steady(1000.0),
            Conns::PerHop,
            None,
            Fan::ONE,
        )
        .await?;
        let (r50, r99) = p50_p99(&raw_steady.lat_ms);
        println!("raw 2 hops steady : {:>8.0} msg/s; submit→delivery p50 {r50:.2} ms p99 {r99:.2} ms (a connection per hop)", raw_steady.rate);
        // The raw client's idle latency is measured beside fleet's (stage 3); the floor's is
        // compared with a raw run just before it.
        let raw_idle = raw_run(
            idle_n,
            2,
            Offer::OneEvery(Duration::from_millis(10)),
            Conns::PerHop,
            None,
            Fan::ONE,
        )
        .await?;
        let (r50, r99) = p50_p99(&raw_idle.lat_ms);
        println!("raw 2 hops idle   : submit→delivery p50 {r50:.2} ms p99 {r99:.2} ms (a connection per hop, before the floor)");
        // The floor at idle: reserve and claim on the path, as fleet has them.
        let (floor_idle, anomalies) = floor_run(
            &qt,
            settings,
            idle_n,
            Offer::OneEvery(Duration::from_millis(10)),
        )
        .await?;
        let (l50, l99) = p50_p99(&floor_idle.lat_ms);
        println!("raw + fleet Redis idle: submit→claimed p50 {l50:.2} ms p99 {l99:.2} ms ({anomalies} anomalies; Δp50 {:+.2} ms over the raw per-hop client)", l50 - r50);
        (one, two_here, fan10, floor_rate, raw_steady)
    };
    // The burst's raw ceiling: the better layout round by round, the median of the rounds.
    let two = median(round_rates.iter().map(|r| r.1.max(r.2)));
    // The raw client's CPU beside fleet's burst (stage 1), in the layout of the better median.
    let raw_cpu_burst = (!skip_raw).then(|| {
        let secs = if shared_median > per_hop_median {
            shared_secs
        } else {
            per_hop_secs
        };
        cpu.report_spent("raw 2 hops", secs, n * rounds).1
    });
    // 5. The peer: Celery on the same broker, the same count, settings of the same guarantee.
    let celery = if std::env::var("BENCH_CELERY").as_deref() == Ok("0") {
        None
    } else {
        println!("\n## 5. peer: Celery (prefork, quorum queue, acks_late, prefetch 1 × concurrency, publisher confirms), {n} no-op tasks + {idle_n} idle");
        match celery_run(n, idle_n) {
            Ok(c) => Some(c),
            Err(e) => {
                println!("celery: not measured: {e:#}");
                None
            }
        }
    };
    // The goal is measured against the raw client's better figure of its two layouts.
    let (p50h, p99h) = p50_p99(&raw_idle_per_hop);
    let (p50s, p99s) = p50_p99(&raw_idle_shared);
    let (r50, r99) = (p50h.min(p50s), p99h.min(p99s));
    let _ = one;
    println!("\n## summary (fleet / raw 2-hop, same run; goal ≥ 0.85; raw = the better of its two connection layouts)");
    // The median of the rounds' ratios (each against the raw client's better layout of its
    // own round).
    let burst_ratio = median(round_rates.iter().map(|r| r.0 / r.1.max(r.2)));
    println!(
        "burst {n}            : fleet {burst:>7.0}, raw {two:>7.0} (medians of {rounds} interleaved rounds); fleet / raw {burst_ratio:.2} (the median of the rounds' ratios {})",
        round_rates
            .iter()
            .map(|r| format!("{:.2}", r.0 / r.1.max(r.2)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "steady 1,000/s offered: fleet {steady:>7.0} / raw {:>7.0} = {:.2}",
        raw_steady.rate,
        steady / raw_steady.rate
    );
    println!(
        "10 groups, burst     : fleet {groups10:>7.0} / raw {two_here:>7.0} = {:.2} (goal ≥ 0.75; raw: its burst after the 10-group stage); the raw client in the same topology (10 queues, prefetch 26) {fan10:>7.0} = {:.2} of raw, fleet / it = {:.2}",
        groups10 / two_here,
        fan10 / two_here,
        groups10 / fan10
    );
    println!("idle submit→start    : fleet p50 {f50:.2} ms p99 {f99:.2} ms | raw 2-hop p50 {r50:.2} ms p99 {r99:.2} ms | Δp50 {:+.2} ms (goal ≤ +0.5) Δp99 {:+.2} ms (goal ≤ +1.5)", f50 - r50, f99 - r99);
    if let Some(c) = &celery {
        println!(
            "Celery {} (c={}) : {:>7.0} tasks/s, fleet / Celery = {:.1} (goal ≥ 5); idle p50 {:.2} ms p99 {:.2} ms against fleet's {f50:.2} / {f99:.2}",
            c.version, c.concurrency, c.rate, burst / c.rate, c.p50, c.p99
        );
    }
    println!("split of 200 × 200 ms: fast {fast} / slow {slow}");
    println!("floor: raw 2-hop + fleet's Redis work {floor_rate:>7.0} / raw {two_here:>7.0} = {:.2} (a ceiling for fleet on this machine; fleet / floor = {:.2}, each against the raw bursts beside it)", floor_rate / two_here, burst_ratio / (floor_rate / two_here));
    if let (Some((raw_here, floor_cpu)), Some(raw_burst)) = (budget, raw_cpu_burst) {
        // On a machine whose cores every process shares, a rate is about cores ÷ CPU per task:
        // 0.85 of the raw rate allows a total of raw ÷ 0.85, i.e. 17.6 % of the raw client's
        // own CPU for everything fleet adds — Redis's CPU for fleet's state included. Each
        // side is set against the raw bursts nearest it in time: fleet's beside its rounds,
        // the floor's just before it.
        let total = |c: [f64; 3]| c.iter().filter(|v| v.is_finite()).sum::<f64>();
        let allowance = total(raw_burst) / 0.85 - total(raw_burst);
        println!(
            "budget: 0.85 of raw allows {allowance:.0} CPU ms per 1,000 tasks beyond the raw client's {:.0}; fleet adds {:.0}; the floor adds {:.0} to the raw bursts just before it (Redis alone {:.0}, RabbitMQ {:+.0}, client {:+.0})",
            total(raw_burst),
            total(fleet_cpu) - total(raw_burst),
            total(floor_cpu) - total(raw_here),
            floor_cpu[1] - raw_here[1],
            floor_cpu[0] - raw_here[0],
            floor_cpu[2] - raw_here[2],
        );
    }
    goal_table(&Goals {
        commands: commands_burst,
        fleet_cpu,
        raw_cpu: raw_cpu_burst,
        burst,
        burst_ratio,
        two_here,
        groups10,
        fan10,
        keyed: burst_keys / last_round,
        idle: (f50 - r50, f99 - r99),
        celery: celery.as_ref().map(|c| (c.rate, c.p50, c.p99)),
        fleet_idle: (f50, f99),
    });

    let rss_secs: u64 = std::env::var("BENCH_RSS_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    if rss_secs > 0 {
        rss(rss_secs).await?;
    }
    Ok(())
}

/// The figures of one `throughput` run that issue 34's goal table is judged on.
struct Goals {
    /// Redis commands per task in the burst (`INFO commandstats`).
    commands: f64,
    /// CPU ms per 1,000 tasks in the burst: RabbitMQ, Redis, this process (scheduler, workers
    /// and the producer).
    fleet_cpu: [f64; 3],
    /// The raw two-hop client's, summed over its bursts beside fleet's (stage 1), in the layout
    /// whose median rate is the better (`None`: not measured).
    raw_cpu: Option<[f64; 3]>,
    /// Median fleet burst rate (tasks/s) of the interleaved rounds.
    burst: f64,
    /// Median of the rounds' fleet / raw two-hop ratios.
    burst_ratio: f64,
    /// The raw two-hop rate (better layout) of the bursts after the 10-group stage, msg/s.
    two_here: f64,
    groups10: f64,
    /// The raw client in the 10-group topology (10 queues, prefetch 26).
    fan10: f64,
    /// Burst with 1,000 keys / burst without.
    keyed: f64,
    /// Idle submit→start Δp50 / Δp99 against raw two-hop (ms).
    idle: (f64, f64),
    /// Celery's tasks/s and idle p50 / p99 (ms), when measured.
    celery: Option<(f64, f64, f64)>,
    fleet_idle: (f64, f64),
}

/// Prints issue 34's goal table from one run: each line's figure, its goal, and whether it is
/// met (`-` where the run did not measure it). RSS is the `rss` stage's (below, or
/// `bench rss 600`).
fn goal_table(g: &Goals) {
    let yes = |ok: bool| if ok { "met" } else { "NOT met" };
    let mut rows: Vec<(String, String, String, &str)> = Vec::new();
    rows.push((
        "Redis commands per task (burst)".into(),
        format!("{:.2}", g.commands),
        "≤ 6".into(),
        yes(g.commands <= 6.0),
    ));
    rows.push((
        "Redis CPU ms per 1,000 tasks (burst)".into(),
        format!("{:.0}", g.fleet_cpu[1]),
        "≤ 15".into(),
        yes(g.fleet_cpu[1] <= 15.0),
    ));
    match g.raw_cpu {
        Some(raw) => {
            let rabbit = g.fleet_cpu[0] / raw[0];
            let procs = g.fleet_cpu[2] / raw[2];
            rows.push((
                "RabbitMQ CPU, fleet / raw two-hop".into(),
                format!("{:.0} / {:.0} = {rabbit:.2}", g.fleet_cpu[0], raw[0]),
                "≤ 1.10".into(),
                yes(rabbit <= 1.10),
            ));
            rows.push((
                "fleet's processes / raw client (this process: + the producer)".into(),
                format!("{:.0} / {:.0} = {procs:.2}", g.fleet_cpu[2], raw[2]),
                "≤ 1.0".into(),
                yes(procs <= 1.0),
            ));
        }
        None => rows.push((
            "RabbitMQ and process CPU against raw".into(),
            "-".into(),
            "≤ 1.10, ≤ 1.0".into(),
            "-",
        )),
    }
    // A line against the raw client reads `-` when it was not run (BENCH_SKIP_RAW).
    let against_raw = |line: &str, v: f64, now: String, goal: &str, ok: bool| {
        if v.is_nan() {
            (line.to_string(), "-".to_string(), goal.to_string(), "-")
        } else {
            (line.to_string(), now, goal.to_string(), yes(ok))
        }
    };
    let burst = g.burst_ratio;
    rows.push(against_raw(
        "burst / raw two-hop",
        burst,
        format!("{burst:.2}"),
        "≥ 0.85",
        burst >= 0.85,
    ));
    let groups = g.groups10 / g.two_here;
    rows.push(against_raw(
        "10 groups / raw two-hop",
        groups,
        format!(
            "{groups:.2} (raw in the same topology {:.2}; fleet / it {:.2})",
            g.fan10 / g.two_here,
            g.groups10 / g.fan10
        ),
        "≥ 0.75",
        groups >= 0.75,
    ));
    rows.push((
        "burst with 1,000 keys / without".into(),
        format!("{:.2}", g.keyed),
        "≥ 0.90".into(),
        yes(g.keyed >= 0.90),
    ));
    rows.push(against_raw(
        "idle submit→start Δp50 / Δp99 vs raw",
        g.idle.0,
        format!("{:+.2} / {:+.2} ms", g.idle.0, g.idle.1),
        "≤ +0.5 / ≤ +1.5 ms",
        g.idle.0 <= 0.5 && g.idle.1 <= 1.5,
    ));
    match g.celery {
        Some((rate, p50, p99)) => rows.push((
            "Celery in the same run".into(),
            format!(
                "fleet / Celery {:.1}; idle p50/p99 fleet {:.2}/{:.2} vs Celery {p50:.2}/{p99:.2} ms",
                g.burst / rate,
                g.fleet_idle.0,
                g.fleet_idle.1
            ),
            "≥ 5×, below its latency".into(),
            yes(g.burst / rate >= 5.0 && g.fleet_idle.0 < p50 && g.fleet_idle.1 < p99),
        )),
        None => rows.push((
            "Celery in the same run".into(),
            "-".into(),
            "≥ 5×".into(),
            "-",
        )),
    }
    println!("\n## goal table (issue 34), this run");
    for (line, now, goal, met) in rows {
        println!("{line:<62} | {now:<58} | {goal:<24} | {met}");
    }
}

/// Celery's figures in the same run (`ops/bench/celery_bench.sh`).
struct Celery {
    version: String,
    concurrency: u64,
    /// Burst tasks/s.
    rate: f64,
    /// Idle submit→start, ms.
    p50: f64,
    p99: f64,
}

/// Runs the Celery peer benchmark (`ops/bench/celery_bench.sh`: a virtualenv with Celery 5.x,
/// one prefork worker of `BENCH_CELERY_CONCURRENCY` (default 8) processes) over `n` burst and
/// `idle` idle tasks, and reads its `CELERY_JSON` line.
///
/// # Errors
/// The script failed (no Python venv, broker unreachable) or printed no figures.
fn celery_run(n: usize, idle: usize) -> Result<Celery> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .ok_or_else(|| anyhow::anyhow!("no repository root"))?;
    let conc = std::env::var("BENCH_CELERY_CONCURRENCY").unwrap_or_else(|_| "8".into());
    let out = std::process::Command::new("bash")
        .arg(root.join("ops/bench/celery_bench.sh"))
        .args(["--n", &n.to_string(), "--idle", &idle.to_string()])
        .args(["--concurrency", &conc])
        .stderr(std::process::Stdio::inherit())
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    for line in text.lines().filter(|l| !l.starts_with("CELERY_JSON")) {
        println!("celery: {line}");
    }
    anyhow::ensure!(out.status.success(), "celery_bench.sh: {}", out.status);
    let json = text
        .lines()
        .find_map(|l| l.strip_prefix("CELERY_JSON "))
        .ok_or_else(|| anyhow::anyhow!("no CELERY_JSON line"))?;
    let v: serde_json::Value = serde_json::from_str(json)?;
    let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    Ok(Celery {
        version: v["celery_version"].as_str().unwrap_or("?").to_string(),
        concurrency: v["concurrency"].as_u64().unwrap_or(0),
        rate: f("tasks_per_s"),
        p50: f("idle_p50_ms"),
        p99: f("idle_p99_ms"),
    })
}

/// Resident set size of a process (kB), from `/proc/<pid>/status`.
fn rss_kb(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The release binaries next to this benchmark's executable.
fn sibling_bin(name: &str) -> Result<std::path::PathBuf> {
    let exe = std::env::current_exe()?;
    let p = exe
        .parent()
        .map(|d| d.join(name))
        .ok_or_else(|| anyhow::anyhow!("no directory"))?;
    anyhow::ensure!(
        p.exists(),
        "{} not found: cargo build --release --bins",
        p.display()
    );
    Ok(p)
}

/// RSS of a scheduler and two workers (separate processes, product defaults) while the normal
/// lane is offered 10× what the workers drain (2 × 4 slots × 200 ms tasks = 40/s; offered
/// 400/s) for `secs` seconds: a sample every 5 s.
async fn rss(secs: u64) -> Result<()> {
    println!("\n## RSS under a 10x overload for {secs} s (short version of the issue's 10 minutes): scheduler + 2 workers as processes, product defaults, capacity 4 each, `sleep` 200 ms tasks, 400/s offered");
    let ns = Ns::with_queue_type("quorum").await?;
    let env: Vec<(String, String)> = ns
        .base
        .iter()
        .filter(|(k, _)| k != "http_addr")
        .map(|(k, v)| (format!("FLEET_{}", k.to_uppercase()), v.clone()))
        .collect();
    let spawn = |bin: &str, extra: Vec<(String, String)>| -> Result<std::process::Child> {
        let mut c = std::process::Command::new(sibling_bin(bin)?);
        c.envs(env.iter().cloned())
            .envs(extra)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        Ok(c.spawn()?)
    };
    let sched_port = free_port()?;
    let mut procs = vec![(
        "scheduler",
        spawn(
            "fleet-scheduler",
            vec![("FLEET_HTTP_ADDR".into(), format!("127.0.0.1:{sched_port}"))],
        )?,
    )];
    for i in 0..2 {
        let port = free_port()?;
        procs.push((
            if i == 0 { "worker-1" } else { "worker-2" },
            spawn(
                "fleet-worker",
                vec![
                    ("FLEET_HTTP_ADDR".into(), format!("127.0.0.1:{port}")),
                    ("FLEET_CAPACITY".into(), "4".into()),
                    ("FLEET_WORKER_ID".into(), format!("rss-w{i}")),
                ],
            )?,
        ));
    }
    wait_for("scheduler ready", Duration::from_secs(30), || async move {
        http()
            .get(format!("http://127.0.0.1:{sched_port}/readyz"))
            .send()
            .await
            .ok()
            .filter(|r| r.status().is_success())
            .map(|_| ())
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let start = Instant::now();
    let (mut ok, mut refused) = (0usize, 0usize);
    let mut next_sample = Duration::ZERO;
    let mut peak: std::collections::BTreeMap<&str, u64> = Default::default();
    let mut first: std::collections::BTreeMap<&str, u64> = Default::default();
    // 40 every 100 ms = 400/s offered (an interval, so publishing time does not slow it).
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    while start.elapsed() < Duration::from_secs(secs) {
        tick.tick().await;
        let envs: Vec<Envelope> = (0..40)
            .map(|_| Envelope::new("sleep", json!({"ms": 200})))
            .collect();
        if let Ok(r) = ns.submit_each(&envs).await {
            ok += r.iter().filter(|b| **b).count();
            refused += r.iter().filter(|b| !**b).count();
        }
        if start.elapsed() >= next_sample {
            let mut line = format!("t={:>3}s", start.elapsed().as_secs());
            for (name, c) in &procs {
                let kb = rss_kb(c.id()).unwrap_or(0);
                line.push_str(&format!("  {name} {:.1} MB", kb as f64 / 1024.0));
                first.entry(name).or_insert(kb);
                let e = peak.entry(name).or_default();
                *e = (*e).max(kb);
            }
            let p = get_json(&format!("http://127.0.0.1:{sched_port}/v1/pressure"))
                .await
                .unwrap_or_default();
            line.push_str(&format!(
                "  (pressure {} gate {}, accepted {ok} refused {refused})",
                p["state"], p["gate"]
            ));
            println!("{line}");
            next_sample += Duration::from_secs(5);
        }
    }
    println!(
        "offered {} in {:.1} s ({:.0}/s; the workers drain 40/s)",
        ok + refused,
        start.elapsed().as_secs_f64(),
        (ok + refused) as f64 / start.elapsed().as_secs_f64()
    );
    for (name, kb) in &peak {
        println!(
            "peak RSS {name}: {:.1} MB (first sample {:.1} MB; goal < 64 MB and flat)",
            *kb as f64 / 1024.0,
            first.get(name).copied().unwrap_or(0) as f64 / 1024.0
        );
    }
    for (_, c) in &mut procs {
        let _ = std::process::Command::new("kill")
            .arg("-TERM")
            .arg(c.id().to_string())
            .status();
    }
    for (name, c) in &mut procs {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match c.try_wait() {
                Ok(Some(_)) => break,
                _ if Instant::now() > deadline => {
                    println!("{name} did not stop within 20 s; killing it");
                    let _ = c.kill();
                    let _ = c.wait();
                    break;
                }
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }
    ns.cleanup().await
}

/// Each hot-path script alone, against Redis only (no broker traffic, nothing else of fleet):
/// `reserve.lua` (dispatch: dedupe mark, leased reservation, status `queued`), `start.lua`
/// (claim: run record, status `running`) and `finish.lua` (outcome: `succeeded`) over `n` new
/// tasks in batches of [`SCRIPTS_BATCH`], one phase after the other, through the same `Store`
/// calls fleet makes (the floor's), and per phase Redis's own account: commands per task (`INFO
/// commandstats`) and Redis CPU per task (`/proc` of redis-server, µs: ms per 1,000). Redis is
/// the only busy process, so the figures say what each script costs with little of the noise
/// of a shared machine (the issue 34 way in: "commands per task per script").
async fn scripts(n: usize) -> Result<()> {
    // BENCH_SCRIPTS_BATCH: tasks per call (1: an idle fleet's calls, one task each).
    let batch: usize = std::env::var("BENCH_SCRIPTS_BATCH")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|b| *b > 0)
        .unwrap_or(SCRIPTS_BATCH);
    println!("# scripts: {n} tasks, batches of {batch}, Redis only (one phase per script)");
    let ns = Ns::new().await?;
    let floor = Floor::start(&ns, &[], n).await?;
    let cpu = CpuMeter::new();
    let ids: Vec<String> = {
        let (calls, c0, t0) = (RedisCalls::read(), cpu.read(), Instant::now());
        let mut ids = Vec::with_capacity(n);
        while ids.len() < n {
            let k = batch.min(n - ids.len());
            ids.extend(floor.reserve(k).await);
        }
        scripts_phase("reserve (dispatch)", &calls, &cpu, c0, t0, n);
        ids
    };
    let mut granted = Vec::with_capacity(ids.len() / batch + 1);
    let (calls, c0, t0) = (RedisCalls::read(), cpu.read(), Instant::now());
    for chunk in ids.chunks(batch) {
        granted.push(floor.claim_ids(chunk).await);
    }
    scripts_phase("start (claim)", &calls, &cpu, c0, t0, n);
    let (calls, c0, t0) = (RedisCalls::read(), cpu.read(), Instant::now());
    for (chunk, runs) in ids.chunks(batch).zip(granted) {
        floor.finish_ids(chunk, runs).await;
    }
    scripts_phase("finish (outcome)", &calls, &cpu, c0, t0, n);
    let anomalies = floor.anomalies.load(Ordering::Relaxed);
    println!("answers other than reserved / run / finished: {anomalies} (0 expected)");
    ns.cleanup().await?;
    if anomalies > 0 {
        anyhow::bail!("{anomalies} tasks were not reserved, run and finished");
    }
    Ok(())
}

/// The batch size of `bench scripts` unless `BENCH_SCRIPTS_BATCH` says: about the burst's (its
/// `EVALSHA`s cover ~40 tasks each).
const SCRIPTS_BATCH: usize = 40;

/// One phase of `bench scripts`: commands and Redis CPU per task since `calls` / `c0`.
fn scripts_phase(
    label: &str,
    calls: &RedisCalls,
    cpu: &CpuMeter,
    c0: [f64; 3],
    t0: Instant,
    n: usize,
) {
    let per = cpu.per_task(c0, n);
    println!("{}", calls.report(label, n));
    println!(
        "{label:<18}: Redis CPU {:.1} µs per task, this process {:.1} µs ({:.2} s)",
        per[1],
        per[2],
        t0.elapsed().as_secs_f64()
    );
}

/// Each half on its own: the scheduler draining ingress into a group queue (no consumer),
/// then a worker draining that group queue.
async fn stages(n: usize) -> Result<()> {
    use fleet::registry::{Registration, WorkerState};
    println!("# stages: {n} tasks, quorum queues");
    let ns = Ns::with_queue_type("quorum").await?;
    let (done, count) = counting();
    // Declare the group's queues and register a placeholder with room for everything.
    let cfg = ns.common(&[])?;
    let ch = ns.conn.create_channel().await?;
    fleet::broker::topology::declare_core(&ch, &cfg).await?;
    let labels = fleet::Labels::parse("stage=x,protocol=builtin")?;
    fleet::broker::topology::declare_group(&ch, &cfg, &labels.group_name()).await?;
    let reg = Registration {
        id: "placeholder".into(),
        instance: "p".into(),
        labels,
        capacity: n as u32,
        critical_capacity: 1,
        executor: "builtin".into(),
        state: WorkerState::Active,
        kinds: Default::default(),
    };
    ns.store.register(&reg, Duration::from_millis(1)).await?;
    let consumers = std::env::var("BENCH_INGRESS_CONSUMERS").unwrap_or_else(|_| "4".into());
    let sched = start_scheduler(
        &ns,
        &[
            ("rate", "1000000"),
            ("burst", "1000000"),
            ("ingress_max_normal", "1000000"),
            ("max_pending", "10000000"),
            ("load_red", "1"),
            ("load_yellow", "1"),
            ("heartbeat_timeout_ms", "600000"),
            ("ingress_consumers", consumers.as_str()),
        ],
    )
    .await?;
    let envs: Vec<Envelope> = (0..n)
        .map(|_| {
            let mut e = Envelope::new("count", json!(null));
            e.labels = fleet::Labels::parse("stage=x").unwrap_or_default();
            e
        })
        .collect();
    let start = Instant::now();
    for chunk in envs.chunks(1000) {
        ns.submit(chunk).await?;
    }
    let q = ns.names.group_queue(&reg.group(), Lane::Normal);
    let deadline = Instant::now() + Duration::from_secs(120);
    while (ns.depth(&q).await as usize) < n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let t = start.elapsed().as_secs_f64();
    println!(
        "scheduler: ingress → group queue: {:>8.0} tasks/s ({:.2} s)",
        n as f64 / t,
        t
    );
    ns.store.deregister("placeholder", "p").await?;
    let h = [("count", count)];
    let start = Instant::now();
    let w = start_worker(&ns, "stage-w", "stage=x", 256, &[], &h).await?;
    while done.load(Ordering::Relaxed) < n && Instant::now() < deadline + Duration::from_secs(120) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let t = start.elapsed().as_secs_f64();
    println!(
        "worker   : group queue → done    : {:>8.0} tasks/s ({:.2} s, incl. start-up)",
        done.load(Ordering::Relaxed) as f64 / t,
        t
    );
    w.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i]
}

async fn critical(n: usize) -> Result<()> {
    println!(
        "# critical lane: submit→start wait of {n} critical tasks, idle vs 10× normal overload"
    );
    let ns = Ns::new().await?;
    let waits: Arc<Mutex<Vec<f64>>> = Arc::default();
    let w2 = waits.clone();
    let stamp = handler_fn(move |ctx| {
        let w = w2.clone();
        async move {
            if let Some(s) = ctx.envelope.submitted_at {
                let ms = (chrono::Utc::now() - s).num_microseconds().unwrap_or(0) as f64 / 1000.0;
                if let Ok(mut v) = w.lock() {
                    v.push(ms);
                }
            }
            Ok(serde_json::Value::Null)
        }
    });
    let rec = Recorder::default();
    let h = [("stamp", stamp), ("record", rec.handler())];
    let sched = start_scheduler(
        &ns,
        &[("ingress_max_normal", "200"), ("max_pending", "100")],
    )
    .await?;
    let w = start_worker(&ns, "bench-crit", "", 4, &[("critical_capacity", "2")], &h).await?;

    let run_critical = |label: &'static str| {
        let (ns, waits) = (&ns, waits.clone());
        async move {
            if let Ok(mut v) = waits.lock() {
                v.clear();
            }
            for _ in 0..n {
                let mut e = Envelope::new("stamp", json!(null));
                e.lane = Lane::Critical;
                e.submitted_at = Some(chrono::Utc::now());
                ns.submit(&[e]).await?;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let deadline = Instant::now() + Duration::from_secs(30);
            while waits.lock().map(|v| v.len()).unwrap_or(0) < n && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let mut v = waits.lock().map(|v| v.clone()).unwrap_or_default();
            let (p50, p99) = (pct(&mut v, 0.5), pct(&mut v, 0.99));
            println!(
                "{label:<22}: n={:<4} p50 {p50:>7.2} ms   p99 {p99:>7.2} ms",
                v.len()
            );
            anyhow::Ok(p99)
        }
    };
    let idle = run_critical("critical, idle").await?;

    // 10× overload of the normal lane: 4 slots × 200 ms = 20 tasks/s; offer 200/s.
    let stop = tokio_util::sync::CancellationToken::new();
    let flood = {
        let stop = stop.clone();
        let ns2 = Ns {
            name: ns.name.clone(),
            names: ns.names.clone(),
            store: ns.store.clone(),
            conn: amqp::connect(&amqp_url(), "bench-flood").await?,
            publisher: amqp::confirm_channel(&amqp::connect(&amqp_url(), "bench-flood2").await?)
                .await?,
            base: ns.base.clone(),
            probe: Arc::new(fleet::broker::probe::Prober::new(
                &amqp_url(),
                "bench-flood",
                &Default::default(),
            )),
        };
        tokio::spawn(async move {
            let (mut ok, mut refused) = (0usize, 0usize);
            while !stop.is_cancelled() {
                let envs: Vec<Envelope> = (0..20)
                    .map(|_| Envelope::new("record", json!({"ms": 200})))
                    .collect();
                if let Ok(r) = ns2.submit_each(&envs).await {
                    ok += r.iter().filter(|b| **b).count();
                    refused += r.iter().filter(|b| !**b).count();
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            (ok, refused)
        })
    };
    tokio::time::sleep(Duration::from_secs(3)).await;
    let p = get_json(&sched.url("/v1/pressure")).await?;
    println!(
        "under flood: pressure {} (gate {}), normal ingress depth {}",
        p["state"],
        p["gate"],
        ns.depth(&ns.names.ingress_queue(Lane::Normal)).await
    );
    let loaded = run_critical("critical, 10x overload").await?;
    stop.cancel();
    let (ok, refused) = flood.await?;
    println!("flood: {ok} normal tasks accepted, {refused} refused");
    println!("p99 ratio overload / idle: {:.2} (goal ≤ 2)", loaded / idle);
    w.force.cancel();
    let _ = w.stop().await;
    sched.stop().await?;
    ns.cleanup().await
}

/// Every distinct pressure sample (`GET /v1/pressure`, polled every 20 ms) until cancelled, as
/// lines: ms since the start, state, waiting, load, ingress backlog, parked, behind.
fn pressure_timeline(
    url: String,
) -> (
    tokio_util::sync::CancellationToken,
    tokio::task::JoinHandle<Vec<String>>,
) {
    let stop = tokio_util::sync::CancellationToken::new();
    let s = stop.clone();
    let h = tokio::spawn(async move {
        let t0 = Instant::now();
        let mut out = Vec::new();
        let mut last = 0;
        while !s.is_cancelled() {
            if let Ok(p) = get_json(&url).await {
                let at = p["sampled_at_ms"].as_i64().unwrap_or(0);
                if at != last {
                    last = at;
                    out.push(format!(
                        "{:>5} {} {} {:.2} {} {} {}",
                        t0.elapsed().as_millis(),
                        p["state"].as_str().unwrap_or("?"),
                        p["waiting"],
                        p["load"].as_f64().unwrap_or(0.0),
                        p["ingress_backlog"],
                        p["parked"],
                        p["behind"]
                    ));
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        out
    });
    (stop, h)
}
