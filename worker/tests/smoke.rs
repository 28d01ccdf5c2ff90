//! Smoke tests of an in-process worker against the real RabbitMQ and Redis (URLs from
//! `AMQP_ADDR` / `REDIS_URL`, loopback by default). No scheduler: tasks are published
//! straight to the worker's group queue, outcomes read from Redis status and the dead queue.
//! Each test runs under its own namespace with classic queues and cleans up after itself.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use lapin::options::{BasicAckOptions, BasicGetOptions, QueueDeclareOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection};
use serde_json::{json, Value};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use fleet::config::Settings;
use fleet::registry::WorkerState;
use fleet::{Envelope, Lane, Names, Store};
use fleet_worker::{handler_fn, TaskError, Worker, WorkerConfig};

const WAIT: Duration = Duration::from_secs(15);

fn amqp_url() -> String {
    std::env::var("AMQP_ADDR").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}
fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// One namespace: its names, store, a confirm channel, and clean-up.
struct Fleet {
    ns: String,
    names: Names,
    store: Store,
    conn: Connection,
    ch: Channel,
    labels: String,
    group: String,
}

impl Fleet {
    async fn new(labels: &str) -> Result<Self> {
        let ns = format!("wt{}", &uuid::Uuid::new_v4().simple().to_string()[..10]);
        let names = Names::new(&ns);
        let store = Store::new(&redis_url(), names.clone())?;
        let conn = fleet::amqp::connect(&amqp_url(), "worker smoke test").await?;
        let ch = fleet::amqp::confirm_channel(&conn).await?;
        let group = fleet::Labels::parse(labels)?.with("protocol", "builtin").group_name();
        Ok(Fleet { ns, names, store, conn, ch, labels: labels.to_string(), group })
    }

    fn settings(&self, id: &str, extra: &[(&str, &str)]) -> WorkerConfig {
        let mut pairs: Vec<(&str, String)> = vec![
            ("namespace", self.ns.clone()),
            ("amqp_url", amqp_url()),
            ("redis_url", redis_url()),
            ("queue_type", "classic".into()),
            ("worker_id", id.into()),
            ("labels", self.labels.clone()),
            ("capacity", "4".into()),
            ("heartbeat_interval_ms", "200".into()),
            ("heartbeat_timeout_ms", "1000".into()),
            ("retry_base_ms", "50".into()),
            ("retry_cap_ms", "80".into()),
            ("max_attempts", "3".into()),
            ("drain_grace_ms", "5000".into()),
        ];
        for (k, v) in extra {
            pairs.retain(|(pk, _)| pk != k);
            pairs.push((k, v.to_string()));
        }
        WorkerConfig::from_settings(&Settings::from_pairs(pairs)).unwrap()
    }

    /// Publishes an envelope straight to the group queue.
    async fn publish(&self, env: &Envelope) -> Result<()> {
        self.publish_raw(&env.id, &env.to_bytes(), env.lane).await
    }

    async fn publish_raw(&self, id: &str, body: &[u8], lane: Lane) -> Result<()> {
        fleet::amqp::publish_confirmed(
            &self.ch,
            &self.names.tasks_exchange(),
            &self.names.group_key(&self.group, lane),
            body,
            fleet::amqp::task_properties(id, None),
        )
        .await?;
        Ok(())
    }

    async fn status(&self, id: &str) -> Result<BTreeMap<String, String>> {
        Ok(self.store.task_status(id).await?.unwrap_or_default())
    }

    /// Waits until the task's status is `state`.
    async fn wait_state(&self, id: &str, state: &str) -> Result<BTreeMap<String, String>> {
        eventually(&format!("task {id} {state}"), || async {
            let s = self.status(id).await?;
            Ok((s.get("state").map(String::as_str) == Some(state)).then_some(s))
        })
        .await
    }

    /// Takes (and acks) messages from a queue until `n` are in hand.
    async fn take(&self, queue: &str, n: usize) -> Result<Vec<(BasicProperties, Value)>> {
        let mut out = Vec::new();
        tokio::time::timeout(WAIT, async {
            while out.len() < n {
                match self.ch.basic_get(ShortString::from(queue), BasicGetOptions::default()).await? {
                    Some(m) => {
                        let body: Value = serde_json::from_slice(&m.delivery.data).unwrap_or(Value::Null);
                        let raw = String::from_utf8_lossy(&m.delivery.data).into_owned();
                        m.delivery.acker.ack(BasicAckOptions::default()).await?;
                        let body = if body.is_null() { Value::String(raw) } else { body };
                        out.push((m.delivery.properties.clone(), body));
                    }
                    None => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            }
            anyhow::Ok(())
        })
        .await
        .map_err(|_| anyhow!("{queue}: {} of {n} messages in time", out.len()))??;
        Ok(out)
    }

    async fn depth(&self, queue: &str) -> Result<u32> {
        let q = self
            .ch
            .queue_declare(ShortString::from(queue), QueueDeclareOptions { passive: true, ..Default::default() }, FieldTable::default())
            .await?;
        Ok(q.message_count())
    }

    async fn cleanup(self) -> Result<()> {
        let ch = self.conn.create_channel().await?;
        fleet::topology::delete_all(&ch, &self.names, std::slice::from_ref(&self.group)).await?;
        self.store.delete_namespace().await?;
        let _ = self.conn.close(200, ShortString::from("bye")).await;
        Ok(())
    }
}

/// A running worker.
struct Running {
    shutdown: CancellationToken,
    force: CancellationToken,
    handle: JoinHandle<Result<()>>,
    #[allow(dead_code)]
    addr: SocketAddr,
}

async fn start(builder: fleet_worker::WorkerBuilder) -> Result<Running> {
    if std::env::var_os("RUST_LOG").is_some() {
        fleet::telemetry::init("text");
    }
    let shutdown = CancellationToken::new();
    let force = CancellationToken::new();
    let (tx, rx) = oneshot::channel();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let w = builder.listener(listener).on_ready(tx).force_shutdown(force.clone()).build();
    let handle = tokio::spawn(w.run(shutdown.clone()));
    let addr = tokio::time::timeout(WAIT, rx).await.context("worker not ready in time")?.context("worker ended before ready")?;
    Ok(Running { shutdown, force, handle, addr })
}

impl Running {
    async fn stop(self) -> Result<()> {
        self.shutdown.cancel();
        tokio::time::timeout(WAIT, self.handle).await.context("worker did not stop in time")??
    }
}

async fn eventually<T, F, Fut>(what: &str, mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Some(v) = f().await? {
            return Ok(v);
        }
        if tokio::time::Instant::now() > deadline {
            bail!("timed out waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn env(kind: &str, payload: Value) -> Envelope {
    let mut e = Envelope::new(kind, payload);
    e.submitted_at = Some(chrono::Utc::now());
    e
}

fn header(p: &BasicProperties, k: &str) -> String {
    fleet::amqp::header_str(p, k).unwrap_or_default()
}

#[tokio::test]
async fn outcomes_reach_redis_and_the_dead_queue() -> Result<()> {
    let f = Fleet::new("smoke=outcomes").await?;
    let w = start(Worker::builder(f.settings("w-outcomes", &[]))).await?;

    let ok = env("echo", json!({"hello": "world"}));
    let perm = env("fail", json!({"permanent": true}));
    let unknown = env("resize", json!({}));
    let mut expired = env("echo", json!(1));
    expired.deadline = Some(chrono::Utc::now() - chrono::Duration::seconds(1));
    let mut last = env("fail", json!({}));
    last.max_attempts = Some(1);
    let mut retry = env("fail", json!({"times": 1}));
    retry.max_attempts = Some(3);
    let mut critical = env("noop", Value::Null);
    critical.lane = Lane::Critical;
    for e in [&ok, &perm, &unknown, &expired, &last, &retry, &critical] {
        f.publish(e).await?;
    }
    f.publish_raw("garbage-1", b"{not json", Lane::Normal).await?;

    let s = f.wait_state(&ok.id, "succeeded").await?;
    assert_eq!(s["result"], r#"{"hello":"world"}"#);
    assert_eq!(s["worker"], "w-outcomes");
    assert_eq!(s["attempt"], "1");
    f.wait_state(&critical.id, "succeeded").await?;
    assert!(f.wait_state(&perm.id, "dead").await?["error"].contains("fail"));
    assert!(f.wait_state(&unknown.id, "dead").await?["error"].contains("unknown kind"));
    f.wait_state(&expired.id, "expired").await?;
    f.wait_state(&last.id, "dead").await?;
    f.wait_state(&retry.id, "retrying").await?;

    // Dead letters: one per dead/expired task, plus the garbage, with reasons.
    let dead = f.take(&f.names.dead_queue(), 5).await?;
    let mut reasons: BTreeMap<String, String> = BTreeMap::new();
    for (p, body) in &dead {
        let id = body.get("id").and_then(Value::as_str).unwrap_or("garbage-1").to_string();
        reasons.insert(id, header(p, "x-fleet-reason"));
        if body.get("id").is_some() {
            assert_eq!(header(p, "x-fleet-worker"), "w-outcomes");
            assert_eq!(header(p, "x-fleet-attempts"), "1");
        }
    }
    assert_eq!(reasons[&perm.id], "permanent_error");
    assert_eq!(reasons[&unknown.id], "permanent_error");
    assert_eq!(reasons[&expired.id], "expired");
    assert_eq!(reasons[&last.id], "max_attempts");
    assert_eq!(reasons["garbage-1"], "malformed_json");

    // The retry went back towards the scheduler with attempt 1 and a not_before.
    let delayed = f.take(&f.names.delayed_queue(), 1).await?;
    let back = Envelope::from_value(delayed[0].1.clone())?;
    assert_eq!(back.id, retry.id);
    assert_eq!(back.attempt, 1);
    assert!(back.not_before.is_some());
    // Run attempt 2 ourselves (the scheduler's job): it succeeds.
    f.publish(&back).await?;
    let s = f.wait_state(&retry.id, "succeeded").await?;
    assert_eq!(s["attempt"], "2");
    assert!(!s.contains_key("error"), "the first attempt's error is gone: {s:?}");

    // Registered while running; load released.
    let workers = f.store.workers().await?;
    assert_eq!(workers.iter().map(|w| w.id.as_str()).collect::<Vec<_>>(), vec!["w-outcomes"]);
    assert_eq!(f.depth(&f.names.group_queue(&f.group, Lane::Normal)).await?, 0);

    w.stop().await?;
    assert!(f.store.workers().await?.is_empty(), "deregistered after the drain");
    f.cleanup().await
}

#[tokio::test]
async fn drain_lets_running_tasks_finish() -> Result<()> {
    let f = Fleet::new("smoke=drain").await?;
    let w = start(Worker::builder(f.settings("w-drain", &[]))).await?;
    let slow = env("sleep", json!({"ms": 1200}));
    f.publish(&slow).await?;
    f.wait_state(&slow.id, "running").await?;
    w.shutdown.cancel();
    // Draining at once, in Redis too.
    eventually("state draining", || async {
        Ok((f.store.worker_state("w-drain").await? == Some(WorkerState::Draining)).then_some(()))
    })
    .await?;
    // Work published now is not taken.
    let late = env("noop", Value::Null);
    f.publish(&late).await?;
    tokio::time::timeout(WAIT, w.handle).await??.context("clean drain")?;
    assert_eq!(f.status(&slow.id).await?["state"], "succeeded");
    assert!(f.status(&late.id).await?.is_empty(), "never started");
    assert_eq!(f.depth(&f.names.group_queue(&f.group, Lane::Normal)).await?, 1);
    assert!(f.store.workers().await?.is_empty());
    f.cleanup().await
}

#[tokio::test]
async fn grace_exceeded_returns_tasks_to_the_broker() -> Result<()> {
    let f = Fleet::new("smoke=grace").await?;
    let w = start(Worker::builder(f.settings("w-grace", &[("drain_grace_ms", "300")]))).await?;
    let slow = env("sleep", json!({"ms": 20000}));
    f.publish(&slow).await?;
    f.wait_state(&slow.id, "running").await?;
    w.shutdown.cancel();
    let err = tokio::time::timeout(WAIT, w.handle).await??.expect_err("grace exceeded is an error");
    assert!(err.to_string().contains("grace"), "{err}");
    // The unacked task is back in its queue.
    eventually("task requeued", || async {
        Ok((f.depth(&f.names.group_queue(&f.group, Lane::Normal)).await? == 1).then_some(()))
    })
    .await?;
    f.cleanup().await
}

#[tokio::test]
async fn second_signal_forces_the_end() -> Result<()> {
    let f = Fleet::new("smoke=force").await?;
    let w = start(Worker::builder(f.settings("w-force", &[("drain_grace_ms", "60000")]))).await?;
    let slow = env("sleep", json!({"ms": 20000}));
    f.publish(&slow).await?;
    f.wait_state(&slow.id, "running").await?;
    w.shutdown.cancel();
    tokio::time::sleep(Duration::from_millis(300)).await;
    w.force.cancel();
    let err = tokio::time::timeout(Duration::from_secs(5), w.handle).await??.expect_err("forced");
    assert!(err.to_string().contains("interrupted"), "{err}");
    f.cleanup().await
}

#[tokio::test]
async fn duplicate_live_id_is_refused() -> Result<()> {
    let f = Fleet::new("smoke=dup").await?;
    let first = start(Worker::builder(f.settings("w-dup", &[]))).await?;
    let second = Worker::builder(f.settings("w-dup", &[]))
        .listener(tokio::net::TcpListener::bind("127.0.0.1:0").await?)
        .build()
        .run(CancellationToken::new());
    let err = tokio::time::timeout(WAIT, second).await?.expect_err("duplicate refused");
    assert!(err.to_string().contains("already registered"), "{err}");
    first.stop().await?;
    f.cleanup().await
}

#[tokio::test]
async fn drain_asked_in_redis_takes_effect_within_a_second() -> Result<()> {
    let f = Fleet::new("smoke=apidrain").await?;
    let w = start(Worker::builder(f.settings("w-api", &[("heartbeat_interval_ms", "5000"), ("heartbeat_timeout_ms", "15000")]))).await?;
    let asked = tokio::time::Instant::now();
    f.store.set_state("w-api", WorkerState::Draining).await?;
    tokio::time::timeout(WAIT, w.handle).await??.context("clean drain")?;
    assert!(asked.elapsed() < Duration::from_secs(3), "{:?}", asked.elapsed());
    f.cleanup().await
}

#[tokio::test]
async fn lost_registration_is_restored() -> Result<()> {
    let f = Fleet::new("smoke=gone").await?;
    let w = start(Worker::builder(f.settings("w-gone", &[]))).await?;
    let slow = env("sleep", json!({"ms": 1500}));
    f.publish(&slow).await?;
    f.wait_state(&slow.id, "running").await?;
    f.store.delete_namespace().await?; // Redis "restarted empty"
    eventually("registered again", || async {
        Ok(f.store.workers().await?.iter().any(|w| w.id == "w-gone" && w.running == 1).then_some(()))
    })
    .await?;
    f.wait_state(&slow.id, "succeeded").await?;
    w.stop().await?;
    f.cleanup().await
}

#[tokio::test]
async fn failing_worker_ejects_itself_and_comes_back() -> Result<()> {
    let f = Fleet::new("smoke=eject").await?;
    // A peer in the same group: the last active worker of a group is never ejected.
    let peer = fleet::registry::Registration {
        id: "w-eject-peer".into(),
        instance: "peer".into(),
        labels: fleet::Labels::parse("smoke=eject,protocol=builtin")?,
        capacity: 1,
        critical_capacity: 1,
        executor: "builtin".into(),
        state: fleet::registry::WorkerState::Active,
    };
    f.store.register(&peer, Duration::from_secs(30)).await?;
    let cfg = f.settings(
        "w-eject",
        &[("eject_window", "4"), ("eject_min_samples", "4"), ("eject_error_ratio", "0.5"), ("eject_cooldown_ms", "1500")],
    );
    let calls = Arc::new(AtomicU32::new(0));
    let counter = calls.clone();
    let flaky = handler_fn(move |_t| {
        counter.fetch_add(1, Ordering::SeqCst);
        async { Err::<Value, _>(TaskError::retryable("flaky")) }
    });
    let panicky = handler_fn(|_t| async { panic!("handler bug") });
    let w = start(Worker::builder(cfg).handler("flaky", flaky).handler("panicky", panicky)).await?;
    let mut ids = Vec::new();
    for kind in ["flaky", "flaky", "flaky", "panicky"] {
        let mut e = env(kind, Value::Null);
        e.max_attempts = Some(1);
        ids.push(e.id.clone());
        f.publish(&e).await?;
    }
    for id in &ids {
        f.wait_state(id, "dead").await?;
    }
    assert!(f.status(&ids[3]).await?["error"].contains("panicked"));
    eventually("ejected", || async {
        Ok((f.store.worker_state("w-eject").await? == Some(WorkerState::Ejected)).then_some(()))
    })
    .await?;
    // While ejected nothing is taken.
    let waiting = env("noop", Value::Null);
    f.publish(&waiting).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(f.status(&waiting.id).await?.is_empty());
    // After the cool-down it is active and consumes again.
    f.wait_state(&waiting.id, "succeeded").await?;
    assert_eq!(f.store.worker_state("w-eject").await?, Some(WorkerState::Active));
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    w.stop().await?;
    f.cleanup().await
}

/// Runs `rabbitmqctl` (skipping the test when it is not available here).
async fn rabbitmqctl(args: &[&str]) -> Option<String> {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let out = std::process::Command::new("rabbitmqctl").args(&args).output().ok()?;
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    })
    .await
    .ok()
    .flatten()
}

#[tokio::test]
async fn connection_loss_is_survived() -> Result<()> {
    if rabbitmqctl(&["status"]).await.is_none() {
        eprintln!("skipped: rabbitmqctl not available");
        return Ok(());
    }
    let f = Fleet::new("smoke=reconnect").await?;
    let calls = Arc::new(AtomicU32::new(0));
    let counter = calls.clone();
    let slow = handler_fn(move |_t| {
        counter.fetch_add(1, Ordering::SeqCst);
        async {
            tokio::time::sleep(Duration::from_millis(3000)).await;
            Ok(json!("done"))
        }
    });
    let w = start(Worker::builder(f.settings("w-reconnect", &[])).handler("slow", slow)).await?;
    let list = rabbitmqctl(&["list_connections", "pid", "client_properties"]).await.context("list_connections")?;
    let pid = list
        .lines()
        .find(|l| l.contains("fleet-worker w-reconnect"))
        .and_then(|l| l.split_whitespace().next())
        .context("the worker's connection")?
        .to_string();
    let task = env("slow", Value::Null);
    f.publish(&task).await?;
    f.wait_state(&task.id, "running").await?;
    rabbitmqctl(&["close_connection", &pid, "smoke test: simulated connection loss"]).await.context("close_connection")?;

    // The running attempt cannot be acked; the broker redelivers it to the reconnected worker,
    // whose copy waits on the attempt's run record while the first run goes on, and is acked
    // as a duplicate once that run's outcome is recorded: exactly one run.
    f.wait_state(&task.id, "succeeded").await?;
    let after = env("noop", Value::Null);
    f.publish(&after).await?;
    f.wait_state(&after.id, "succeeded").await?;
    eventually("the redelivered copy settled", || async { Ok((f.depth(&f.names.group_queue(&f.group, Lane::Normal)).await? == 0).then_some(())) }).await?;
    assert_eq!(calls.load(Ordering::SeqCst), 1, "one run: the redelivered copy of the running attempt never ran");
    assert_eq!(f.depth(&f.names.group_queue(&f.group, Lane::Normal)).await?, 0);
    w.stop().await?;
    f.cleanup().await
}
