//! Smoke tests of an in-process worker against the real RabbitMQ and Redis (URLs from
//! `AMQP_ADDR` / `REDIS_URL`, loopback by default). No scheduler: tasks are published
//! straight to the worker's group queue, outcomes read from Redis status and the dead queue.
//! Each test runs under its own namespace with classic queues and cleans up after itself.
//! (Moved from worker/tests/smoke.rs onto the shared harness.)

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use lapin::BasicProperties;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use fleet::registry::WorkerState;
use fleet::{Envelope, Lane};
use fleet_tests::*;
use fleet_worker::{handler_fn, TaskError, Worker, WorkerBuilder, WorkerConfig};

const WAIT: Duration = Duration::from_secs(15);

/// The smoke worker's settings: four slots, fast heartbeats, quick retries, three attempts.
const SMOKE: &[(&str, &str)] = &[
    ("capacity", "4"),
    ("heartbeat_interval_ms", "200"),
    ("heartbeat_timeout_ms", "1000"),
    ("retry_base_ms", "50"),
    ("retry_cap_ms", "80"),
    ("max_attempts", "3"),
    ("drain_grace_ms", "5000"),
];

/// A namespace and the one group its smoke worker serves (labels `labels`, builtin executor).
struct Smoke {
    ns: Ns,
    labels: String,
    group: String,
}

impl Smoke {
    async fn new(labels: &str) -> Result<Self> {
        Ok(Smoke {
            ns: Ns::new().await?,
            labels: labels.to_string(),
            group: group_of(labels, "builtin"),
        })
    }

    /// Worker `id`'s config: the namespace's settings, [`SMOKE`], then `extra`.
    fn config(&self, id: &str, extra: &[(&str, &str)]) -> Result<WorkerConfig> {
        let mut all: Vec<(&str, &str)> = SMOKE.to_vec();
        all.extend_from_slice(&[("worker_id", id), ("labels", self.labels.as_str())]);
        all.extend_from_slice(extra);
        Ok(WorkerConfig::from_settings(&self.ns.settings(&all))?)
    }

    async fn start(&self, id: &str, builder: WorkerBuilder) -> Result<WorkerHandle> {
        spawn_worker(id, builder).await
    }

    /// Publishes an envelope straight to the group queue.
    async fn publish(&self, env: &Envelope) -> Result<()> {
        self.ns
            .publish_to_group(&self.group, env.lane, &env.id, &env.to_bytes())
            .await
    }

    async fn status(&self, id: &str) -> Result<BTreeMap<String, String>> {
        Ok(self.ns.status(id).await?.unwrap_or_default())
    }

    async fn wait_state(&self, id: &str, state: &str) -> Result<BTreeMap<String, String>> {
        self.ns.wait_state(id, state, WAIT).await
    }

    /// Takes (and acks) `n` messages from a queue: properties and body as JSON (a body that
    /// is not JSON as a JSON string).
    async fn take(&self, queue: &str, n: usize) -> Result<Vec<(BasicProperties, Value)>> {
        let got = self.ns.take(queue, n, WAIT).await?;
        Ok(got
            .into_iter()
            .map(|(p, data)| {
                let body = serde_json::from_slice(&data)
                    .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&data).into_owned()));
                (p, body)
            })
            .collect())
    }

    /// Ready messages in the group's normal queue (`None` when it does not exist).
    async fn depth(&self) -> Option<u32> {
        self.ns
            .depth_of(&self.ns.names.group_queue(&self.group, Lane::Normal))
            .await
    }

    async fn worker_state(&self, id: &str) -> Option<WorkerState> {
        self.ns.store.worker_state(id).await.ok().flatten()
    }

    async fn cleanup(self) -> Result<()> {
        self.ns.cleanup().await
    }
}

fn env(kind: &str, payload: Value) -> Envelope {
    let mut e = task(kind, payload, "");
    e.submitted_at = Some(chrono::Utc::now());
    e
}

fn header(p: &BasicProperties, k: &str) -> String {
    fleet::broker::amqp::header_str(p, k).unwrap_or_default()
}

#[tokio::test]
async fn outcomes_reach_redis_and_the_dead_queue() -> Result<()> {
    let f = Smoke::new("smoke=outcomes").await?;
    let w = f
        .start("w-outcomes", Worker::builder(f.config("w-outcomes", &[])?))
        .await?;

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
    f.ns.publish_to_group(&f.group, Lane::Normal, "garbage-1", b"{not json")
        .await?;

    let s = f.wait_state(&ok.id, "succeeded").await?;
    assert_eq!(s["result"], r#"{"hello":"world"}"#);
    assert_eq!(s["worker"], "w-outcomes");
    assert_eq!(s["attempt"], "1");
    f.wait_state(&critical.id, "succeeded").await?;
    assert!(f.wait_state(&perm.id, "dead").await?["error"].contains("fail"));
    f.wait_state(&expired.id, "expired").await?;
    f.wait_state(&last.id, "dead").await?;
    f.wait_state(&retry.id, "retrying").await?;

    // Dead letters: one per dead/expired task, plus the garbage, with reasons.
    let dead = f.take(&f.ns.names.dead_queue(), 4).await?;
    let mut reasons: BTreeMap<String, String> = BTreeMap::new();
    for (p, body) in &dead {
        let id = body
            .get("id")
            .and_then(Value::as_str)
            .unwrap_or("garbage-1")
            .to_string();
        reasons.insert(id, header(p, "x-fleet-reason"));
        if body.get("id").is_some() {
            assert_eq!(header(p, "x-fleet-worker"), "w-outcomes");
            assert_eq!(header(p, "x-fleet-attempts"), "1");
        }
    }
    assert_eq!(reasons[&perm.id], "permanent_error");
    assert!(!reasons.contains_key(&unknown.id), "{reasons:?}");
    assert_eq!(reasons[&expired.id], "expired");
    assert_eq!(reasons[&last.id], "max_attempts");
    assert_eq!(reasons["garbage-1"], "malformed_json");

    // Two went back towards the scheduler, into the delay tiers (which the scheduler holds;
    // none runs here): the retry with attempt 1 and a not_before, and the task of a kind this
    // worker does not handle, unclaimed (attempt 0), to be routed again.
    let tiers: Vec<String> = fleet::broker::delay::tiers()
        .map(|t| f.ns.names.delay_queue(t))
        .collect();
    let held = wait_for("two messages in the delay tiers", WAIT, || async {
        let mut n = 0;
        for q in &tiers {
            n += f.ns.depth(q).await;
        }
        (n == 2).then_some(())
    })
    .await;
    held?;
    let mut back_by_id: BTreeMap<String, Envelope> = BTreeMap::new();
    for q in &tiers {
        let n = f.ns.depth(q).await as usize;
        if n > 0 {
            for (_, body) in f.take(q, n).await? {
                let e = Envelope::from_value(body)?;
                back_by_id.insert(e.id.clone(), e);
            }
        }
    }
    let rerouted = &back_by_id[&unknown.id];
    assert_eq!(rerouted.attempt, 0, "sent back unclaimed");
    let back = back_by_id[&retry.id].clone();
    assert_eq!(back.attempt, 1);
    assert!(back.not_before.is_some());
    // Run attempt 2 ourselves (the scheduler's job): it succeeds.
    f.publish(&back).await?;
    let s = f.wait_state(&retry.id, "succeeded").await?;
    assert_eq!(s["attempt"], "2");
    assert!(
        !s.contains_key("error"),
        "the first attempt's error is gone: {s:?}"
    );

    // Registered while running; load released.
    let workers = f.ns.store.workers().await?;
    assert_eq!(
        workers.iter().map(|w| w.id.as_str()).collect::<Vec<_>>(),
        vec!["w-outcomes"]
    );
    assert_eq!(f.depth().await, Some(0));

    w.stop().await?;
    assert!(
        f.ns.store.workers().await?.is_empty(),
        "deregistered after the drain"
    );
    f.cleanup().await
}

#[tokio::test]
async fn drain_lets_running_tasks_finish() -> Result<()> {
    let f = Smoke::new("smoke=drain").await?;
    let w = f
        .start("w-drain", Worker::builder(f.config("w-drain", &[])?))
        .await?;
    let slow = env("sleep", json!({"ms": 1200}));
    f.publish(&slow).await?;
    f.wait_state(&slow.id, "running").await?;
    w.shutdown.cancel();
    // Draining at once, in Redis too.
    wait_for("state draining", WAIT, || async {
        (f.worker_state("w-drain").await == Some(WorkerState::Draining)).then_some(())
    })
    .await?;
    // Work published now is not taken.
    let late = env("noop", Value::Null);
    f.publish(&late).await?;
    tokio::time::timeout(WAIT, w.join)
        .await??
        .context("clean drain")?;
    assert_eq!(f.status(&slow.id).await?["state"], "succeeded");
    assert!(f.status(&late.id).await?.is_empty(), "never started");
    assert_eq!(f.depth().await, Some(1));
    assert!(f.ns.store.workers().await?.is_empty());
    f.cleanup().await
}

#[tokio::test]
async fn grace_exceeded_returns_tasks_to_the_broker() -> Result<()> {
    let f = Smoke::new("smoke=grace").await?;
    let w = f
        .start(
            "w-grace",
            Worker::builder(f.config("w-grace", &[("drain_grace_ms", "300")])?),
        )
        .await?;
    let slow = env("sleep", json!({"ms": 20000}));
    f.publish(&slow).await?;
    f.wait_state(&slow.id, "running").await?;
    w.shutdown.cancel();
    let err = tokio::time::timeout(WAIT, w.join)
        .await??
        .expect_err("grace exceeded is an error");
    assert!(err.to_string().contains("grace"), "{err}");
    // The unacked task is back in its queue.
    wait_for("task requeued", WAIT, || async {
        (f.depth().await == Some(1)).then_some(())
    })
    .await?;
    f.cleanup().await
}

#[tokio::test]
async fn second_signal_forces_the_end() -> Result<()> {
    let f = Smoke::new("smoke=force").await?;
    let w = f
        .start(
            "w-force",
            Worker::builder(f.config("w-force", &[("drain_grace_ms", "60000")])?),
        )
        .await?;
    let slow = env("sleep", json!({"ms": 20000}));
    f.publish(&slow).await?;
    f.wait_state(&slow.id, "running").await?;
    w.shutdown.cancel();
    // The second signal comes once the first has taken effect: the worker is draining.
    wait_for("state draining", WAIT, || async {
        (f.worker_state("w-force").await == Some(WorkerState::Draining)).then_some(())
    })
    .await?;
    w.force.cancel();
    let err = tokio::time::timeout(Duration::from_secs(5), w.join)
        .await??
        .expect_err("forced");
    assert!(err.to_string().contains("interrupted"), "{err}");
    f.cleanup().await
}

#[tokio::test]
async fn duplicate_live_id_is_refused() -> Result<()> {
    let f = Smoke::new("smoke=dup").await?;
    let first = f
        .start("w-dup", Worker::builder(f.config("w-dup", &[])?))
        .await?;
    let second = Worker::builder(f.config("w-dup", &[])?)
        .listener(tokio::net::TcpListener::bind("127.0.0.1:0").await?)
        .build()
        .run(CancellationToken::new());
    let err = tokio::time::timeout(WAIT, second)
        .await?
        .expect_err("duplicate refused");
    assert!(err.to_string().contains("already registered"), "{err}");
    first.stop().await?;
    f.cleanup().await
}

#[tokio::test]
async fn drain_asked_in_redis_takes_effect_within_a_second() -> Result<()> {
    let f = Smoke::new("smoke=apidrain").await?;
    let w = f
        .start(
            "w-api",
            Worker::builder(f.config(
                "w-api",
                &[
                    ("heartbeat_interval_ms", "5000"),
                    ("heartbeat_timeout_ms", "15000"),
                ],
            )?),
        )
        .await?;
    let asked = tokio::time::Instant::now();
    f.ns.store.set_state("w-api", WorkerState::Draining).await?;
    tokio::time::timeout(WAIT, w.join)
        .await??
        .context("clean drain")?;
    assert!(
        asked.elapsed() < Duration::from_secs(3),
        "{:?}",
        asked.elapsed()
    );
    f.cleanup().await
}

#[tokio::test]
async fn lost_registration_is_restored() -> Result<()> {
    let f = Smoke::new("smoke=gone").await?;
    let w = f
        .start("w-gone", Worker::builder(f.config("w-gone", &[])?))
        .await?;
    let slow = env("sleep", json!({"ms": 1500}));
    f.publish(&slow).await?;
    f.wait_state(&slow.id, "running").await?;
    f.ns.store.delete_namespace().await?; // Redis "restarted empty"
    wait_for("registered again", WAIT, || async {
        f.ns.store
            .workers()
            .await
            .ok()?
            .iter()
            .any(|w| w.id == "w-gone" && w.running == 1)
            .then_some(())
    })
    .await?;
    f.wait_state(&slow.id, "succeeded").await?;
    w.stop().await?;
    f.cleanup().await
}

#[tokio::test]
async fn failing_worker_ejects_itself_and_comes_back() -> Result<()> {
    let f = Smoke::new("smoke=eject").await?;
    // A peer in the same group: the last active worker of a group is never ejected.
    let peer = fleet::registry::Registration {
        id: "w-eject-peer".into(),
        instance: "peer".into(),
        labels: fleet::Labels::parse("smoke=eject,protocol=builtin")?,
        capacity: 1,
        critical_capacity: 1,
        executor: "builtin".into(),
        state: fleet::registry::WorkerState::Active,
        kinds: Default::default(),
    };
    f.ns.store.register(&peer, Duration::from_secs(30)).await?;
    let cfg = f.config(
        "w-eject",
        &[
            ("eject_window", "4"),
            ("eject_min_samples", "4"),
            ("eject_error_ratio", "0.5"),
            ("eject_cooldown_ms", "1500"),
        ],
    )?;
    let calls = Arc::new(AtomicU32::new(0));
    let counter = calls.clone();
    let flaky = handler_fn(move |_t| {
        counter.fetch_add(1, Ordering::SeqCst);
        async { Err::<Value, _>(TaskError::retryable("flaky")) }
    });
    let panicky = handler_fn(|_t| async { panic!("handler bug") });
    let w = f
        .start(
            "w-eject",
            Worker::builder(cfg)
                .handler("flaky", flaky)
                .handler("panicky", panicky),
        )
        .await?;
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
    wait_for("ejected", WAIT, || async {
        (f.worker_state("w-eject").await == Some(WorkerState::Ejected)).then_some(())
    })
    .await?;
    // While ejected nothing is taken: its consumers are cancelled, so the task lies ready in
    // the queue (not delivered to anyone) and has no status.
    let waiting = env("noop", Value::Null);
    f.publish(&waiting).await?;
    wait_for("the task ready in the queue", WAIT, || async {
        (f.depth().await == Some(1)).then_some(())
    })
    .await?;
    assert!(f.status(&waiting.id).await?.is_empty());
    // After the cool-down it is active and consumes again.
    f.wait_state(&waiting.id, "succeeded").await?;
    assert_eq!(f.worker_state("w-eject").await, Some(WorkerState::Active));
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    w.stop().await?;
    f.cleanup().await
}

/// Runs `rabbitmqctl` (skipping the test when it is not available here).
async fn rabbitmqctl(args: &[&str]) -> Option<String> {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        let out = std::process::Command::new("rabbitmqctl")
            .args(&args)
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    })
    .await
    .ok()
    .flatten()
}

#[tokio::test]
async fn connection_loss_is_survived() -> Result<()> {
    if rabbitmqctl(&["status"]).await.is_none() {
        return missing_servers("rabbitmqctl not available");
    }
    let f = Smoke::new("smoke=reconnect").await?;
    let calls = Arc::new(AtomicU32::new(0));
    let counter = calls.clone();
    let slow = handler_fn(move |_t| {
        counter.fetch_add(1, Ordering::SeqCst);
        async {
            tokio::time::sleep(Duration::from_millis(3000)).await;
            Ok(json!("done"))
        }
    });
    let w = f
        .start(
            "w-reconnect",
            Worker::builder(f.config("w-reconnect", &[])?).handler("slow", slow),
        )
        .await?;
    let list = rabbitmqctl(&["list_connections", "pid", "client_properties"])
        .await
        .context("list_connections")?;
    let pid = list
        .lines()
        .find(|l| l.contains("fleet-worker w-reconnect"))
        .and_then(|l| l.split_whitespace().next())
        .context("the worker's connection")?
        .to_string();
    let task = env("slow", Value::Null);
    f.publish(&task).await?;
    f.wait_state(&task.id, "running").await?;
    rabbitmqctl(&[
        "close_connection",
        &pid,
        "smoke test: simulated connection loss",
    ])
    .await
    .context("close_connection")?;

    // The running attempt cannot be acked; the broker redelivers it to the reconnected worker,
    // whose copy waits on the attempt's run record while the first run goes on, and is acked
    // as a duplicate once that run's outcome is recorded: exactly one run.
    f.wait_state(&task.id, "succeeded").await?;
    let after = env("noop", Value::Null);
    f.publish(&after).await?;
    f.wait_state(&after.id, "succeeded").await?;
    wait_for("the redelivered copy settled", WAIT, || async {
        (f.depth().await == Some(0)).then_some(())
    })
    .await?;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "one run: the redelivered copy of the running attempt never ran"
    );
    assert_eq!(f.depth().await, Some(0));
    w.stop().await?;
    f.cleanup().await
}
