//! Benchmarks that print figures (not timed tests: this machine is shared and noisy, so
//! compare ratios measured in the same run).
//!
//! * `bench throughput [N]` — raw RabbitMQ over one and two durable, confirmed hops (the
//!   ceiling), then fleet moving N no-op tasks producer → scheduler → worker, all in one run.
//! * `bench critical [N]` — critical-lane submit→start wait, p50/p99, idle and under a 10×
//!   normal-lane overload, side by side.
//!
//! Run: `cargo run --release -p fleet-tests --bin bench -- throughput 20000`

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use fleet::{amqp, Envelope, Lane};
use fleet_tests::*;
use fleet_worker::executor::handler_fn;
use futures::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use serde_json::json;

#[tokio::main]
async fn main() -> Result<()> {
    fleet::telemetry::init("text");
    let args: Vec<String> = std::env::args().collect();
    let what = args.get(1).map(String::as_str).unwrap_or("throughput");
    let n: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(20_000);
    match what {
        "throughput" => throughput(n).await,
        "critical" => critical(n.min(1000)).await,
        "stages" => stages(n).await,
        other => anyhow::bail!("unknown benchmark {other} (throughput | critical)"),
    }
}

fn quorum() -> FieldTable {
    let mut t = FieldTable::default();
    t.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    t
}

/// Raw broker: producer → q1 (→ consumer re-publishes → q2) → consumer acks.
/// The raw client's prefetch per consumer and its `multiple` ack run: tuned on this machine
/// (prefetch 500 → 2000 and single acks → runs of 64 raised the two-hop figure).
const RAW_PREFETCH: u16 = 2000;
const RAW_ACK_EVERY: usize = 64;

async fn raw_broker(n: usize, hops: usize) -> Result<f64> {
    let conn = amqp::connect(&amqp_url(), "bench-raw").await?;
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let queues: Vec<String> = (0..hops).map(|i| format!("bench.{tag}.{i}")).collect();
    let setup = conn.create_channel().await?;
    for q in &queues {
        setup.queue_declare(q.as_str().into(), QueueDeclareOptions { durable: true, ..Default::default() }, quorum()).await?;
    }
    let done = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for (i, q) in queues.iter().enumerate() {
        let ch = conn.create_channel().await?;
        ch.basic_qos(RAW_PREFETCH, BasicQosOptions::default()).await?;
        let next = queues.get(i + 1).cloned();
        let pubch = amqp::confirm_channel(&conn).await?;
        let mut consumer = ch.basic_consume(q.as_str().into(), "".into(), BasicConsumeOptions::default(), FieldTable::default()).await?;
        let done = done.clone();
        tasks.push(tokio::spawn(async move {
            // Forwarding hop: publish, and let a second task await confirms in order and ack
            // (pipelined, as fleet's scheduler does).
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(lapin::PublisherConfirm, lapin::message::Delivery)>();
            // Confirms come back in order; ack what is confirmed with one `multiple` ack per
            // run of deliveries (whatever has been confirmed when the queue of confirms is
            // momentarily empty, at most RAW_ACK_EVERY at a time).
            let acker = tokio::spawn(async move {
                let mut last: Option<lapin::message::Delivery> = None;
                let mut pending = 0;
                while let Some((c, d)) = rx.recv().await {
                    let _ = amqp::confirmed(c).await;
                    last = Some(d);
                    pending += 1;
                    if pending >= RAW_ACK_EVERY || rx.is_empty() {
                        if let Some(d) = last.take() {
                            let _ = d.acker.ack(BasicAckOptions { multiple: true }).await;
                        }
                        pending = 0;
                    }
                }
            });
            let mut unacked = 0;
            while let Some(Ok(d)) = consumer.next().await {
                if let Some(nq) = &next {
                    if let Ok(c) = amqp::publish(&pubch, "", nq, &d.data, amqp::task_properties("x", None)).await {
                        let _ = tx.send((c, d));
                    }
                } else {
                    unacked += 1;
                    let finished = done.fetch_add(1, Ordering::Relaxed) + 1 >= n;
                    if unacked >= RAW_ACK_EVERY || finished {
                        let _ = d.acker.ack(BasicAckOptions { multiple: true }).await;
                        unacked = 0;
                    }
                    if finished {
                        break;
                    }
                }
            }
            acker.abort();
        }));
    }
    let pubch = amqp::confirm_channel(&conn).await?;
    let body = Envelope::new("noop", json!(null)).to_bytes();
    let start = Instant::now();
    let mut confirms = Vec::with_capacity(1000);
    for _ in 0..n {
        confirms.push(amqp::publish(&pubch, "", &queues[0], &body, amqp::task_properties("x", None)).await?);
        if confirms.len() >= 1000 {
            for c in confirms.drain(..) {
                amqp::confirmed(c).await?;
            }
        }
    }
    for c in confirms.drain(..) {
        amqp::confirmed(c).await?;
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while done.load(Ordering::Relaxed) < n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let rate = done.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64();
    for t in tasks {
        t.abort();
    }
    for q in &queues {
        let _ = setup.queue_delete(q.as_str().into(), QueueDeleteOptions::default()).await;
    }
    let _ = conn.close(200, "bye".into()).await;
    Ok(rate)
}

async fn throughput(n: usize) -> Result<()> {
    println!("# throughput: {n} messages/tasks, quorum queues, publisher confirms");
    // fleet first: deleting the raw stage's full quorum queues keeps the broker's quorum
    // machinery busy for a while, which skews (and can redeliver in) whatever runs next.
    let qt = std::env::var("BENCH_QUEUE_TYPE").unwrap_or_else(|_| "quorum".into());
    let ns = Ns::with_queue_type(&qt).await?;
    let done = Arc::new(AtomicUsize::new(0));
    let ids: Arc<Mutex<std::collections::HashSet<String>>> = Arc::default();
    let (d2, i2) = (done.clone(), ids.clone());
    let count = handler_fn(move |ctx| {
        let (d, i) = (d2.clone(), i2.clone());
        async move {
            d.fetch_add(1, Ordering::Relaxed);
            if let Ok(mut s) = i.lock() {
                s.insert(ctx.envelope.id.clone());
            }
            Ok(serde_json::Value::Null)
        }
    });
    let h = [("count", count)];
    // The product's defaults, but for an ingress bound that holds the whole burst.
    let bound = n.max(10_000).to_string();
    let settings = [("ingress_max_normal", bound.as_str()), ("queue_type", qt.as_str())];
    println!("scheduler settings: {settings:?}; everything else (admission included) at its default");
    println!("workers: 2 × capacity 128 (no-op tasks), settings {:?}", fleet_tests::WORKER_DEFAULTS);
    let sched = start_scheduler_exactly(&ns, &settings).await?;
    let w1 = start_worker(&ns, "bench-w1", "", 128, &[], &h).await?;
    let w2 = start_worker(&ns, "bench-w2", "", 128, &[], &h).await?;
    let envs: Vec<Envelope> = (0..n).map(|_| Envelope::new("count", json!(null))).collect();
    // Sample the pressure state during the run (how often the fleet throttled itself).
    let purl = sched.url("/v1/pressure");
    let sampling = tokio_util::sync::CancellationToken::new();
    let sampler = {
        let stop = sampling.clone();
        tokio::spawn(async move {
            let mut seen: std::collections::BTreeMap<String, usize> = Default::default();
            while !stop.is_cancelled() {
                if let Ok(p) = get_json(&purl).await {
                    *seen.entry(format!("gate={} load={:.2}", p["gate"].as_str().unwrap_or("?"), (p["load"].as_f64().unwrap_or(0.0) * 10.0).floor() / 10.0)).or_default() += 1;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            seen
        })
    };
    let start = Instant::now();
    for chunk in envs.chunks(1000) {
        ns.submit(chunk).await?;
    }
    let published = start.elapsed();
    let deadline = Instant::now() + Duration::from_secs(300);
    while done.load(Ordering::Relaxed) < n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = start.elapsed();
    let rate = done.load(Ordering::Relaxed) as f64 / elapsed.as_secs_f64();
    println!("fleet end to end  : {rate:>8.0} tasks/s ({} of {n} done in {:.2} s; publishing took {:.2} s)", done.load(Ordering::Relaxed), elapsed.as_secs_f64(), published.as_secs_f64());
    let two = if std::env::var("BENCH_SKIP_RAW").is_ok() {
        f64::NAN
    } else {
        let one = raw_broker(n, 1).await?;
        println!("raw broker, 1 hop : {one:>8.0} msg/s");
        let two = raw_broker(n, 2).await?;
        println!("raw broker, 2 hops: {two:>8.0} msg/s");
        two
    };
    println!("ratio fleet / raw 2-hop: {:.2}", rate / two);
    let distinct = ids.lock().map(|s| s.len()).unwrap_or(0);
    println!("runs {} distinct tasks {distinct} (runs beyond distinct = at-least-once redeliveries)", done.load(Ordering::Relaxed));
    sampling.cancel();
    println!("pressure samples (every 100 ms): {:?}", sampler.await?);
    let page = reqwest::get(sched.url("/metrics")).await?.text().await?;
    println!(
        "dispatched {} parked {} throttled {} rerouted {}",
        metric_sum(&page, "fleet_tasks_dispatched_total", &[]),
        metric_sum(&page, "fleet_tasks_parked_total", &[]),
        metric_sum(&page, "fleet_dispatch_throttled_total", &[]),
        metric_sum(&page, "fleet_tasks_rerouted_total", &[])
    );
    w1.stop().await?;
    w2.stop().await?;
    sched.stop().await?;
    ns.cleanup().await
}

/// Each half on its own: the scheduler draining ingress into a group queue (no consumer),
/// then a worker draining that group queue.
async fn stages(n: usize) -> Result<()> {
    use fleet::registry::{Registration, WorkerState};
    println!("# stages: {n} tasks, quorum queues");
    let ns = Ns::with_queue_type("quorum").await?;
    let done = Arc::new(AtomicUsize::new(0));
    let d2 = done.clone();
    let count = handler_fn(move |_ctx| {
        let d = d2.clone();
        async move {
            d.fetch_add(1, Ordering::Relaxed);
            Ok(serde_json::Value::Null)
        }
    });
    // Declare the group's queues and register a placeholder with room for everything.
    let cfg = ns.common(&[])?;
    let ch = ns.conn.create_channel().await?;
    fleet::topology::declare_core(&ch, &cfg).await?;
    let labels = fleet::Labels::parse("stage=x,protocol=builtin")?;
    fleet::topology::declare_group(&ch, &cfg, &labels.group_name()).await?;
    let reg = Registration { id: "placeholder".into(), instance: "p".into(), labels, capacity: n as u32, critical_capacity: 1, executor: "builtin".into(), state: WorkerState::Active };
    ns.store.register(&reg, 1).await?;
    let consumers = std::env::var("BENCH_INGRESS_CONSUMERS").unwrap_or_else(|_| "4".into());
    let sched = start_scheduler(&ns, &[("rate", "1000000"), ("burst", "1000000"), ("ingress_max_normal", "1000000"), ("max_pending", "10000000"), ("load_red", "1"), ("load_yellow", "1"), ("heartbeat_timeout_ms", "600000"), ("ingress_consumers", consumers.as_str())]).await?;
    let envs: Vec<Envelope> = (0..n).map(|_| { let mut e = Envelope::new("count", json!(null)); e.labels = fleet::Labels::parse("stage=x").unwrap_or_default(); e }).collect();
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
    println!("scheduler: ingress → group queue: {:>8.0} tasks/s ({:.2} s)", n as f64 / t, t);
    ns.store.deregister("placeholder", "p").await?;
    let h = [("count", count)];
    let start = Instant::now();
    let w = start_worker(&ns, "stage-w", "stage=x", 256, &[], &h).await?;
    while done.load(Ordering::Relaxed) < n && Instant::now() < deadline + Duration::from_secs(120) {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let t = start.elapsed().as_secs_f64();
    println!("worker   : group queue → done    : {:>8.0} tasks/s ({:.2} s, incl. start-up)", done.load(Ordering::Relaxed) as f64 / t, t);
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
    println!("# critical lane: submit→start wait of {n} critical tasks, idle vs 10× normal overload");
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
    let sched = start_scheduler(&ns, &[("ingress_max_normal", "200"), ("max_pending", "100")]).await?;
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
            println!("{label:<22}: n={:<4} p50 {p50:>7.2} ms   p99 {p99:>7.2} ms", v.len());
            anyhow::Ok(p99)
        }
    };
    let idle = run_critical("critical, idle").await?;

    // 10× overload of the normal lane: 4 slots × 200 ms = 20 tasks/s; offer 200/s.
    let stop = tokio_util::sync::CancellationToken::new();
    let flood = {
        let stop = stop.clone();
        let ns2 = Ns { name: ns.name.clone(), names: ns.names.clone(), store: ns.store.clone(), conn: amqp::connect(&amqp_url(), "bench-flood").await?, publisher: amqp::confirm_channel(&amqp::connect(&amqp_url(), "bench-flood2").await?).await?, base: ns.base.clone() };
        tokio::spawn(async move {
            let (mut ok, mut refused) = (0usize, 0usize);
            while !stop.is_cancelled() {
                let envs: Vec<Envelope> = (0..20).map(|_| Envelope::new("record", json!({"ms": 200}))).collect();
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
    println!("under flood: pressure {} (gate {}), normal ingress depth {}", p["state"], p["gate"], ns.depth(&ns.names.ingress_queue(Lane::Normal)).await);
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
