//! Shared support for fleet's end-to-end tests: every test gets its own random namespace on
//! the real RabbitMQ and Redis (URLs from `AMQP_ADDR` / `REDIS_URL`, defaulting to loopback),
//! runs the scheduler and workers in-process (or as processes where a test kills them), and
//! cleans its namespace up. Every wait has a timeout.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use fleet::config::{CommonConfig, Settings};
use fleet::{amqp, topology, Envelope, Lane, Names, Store};
use lapin::options::BasicGetOptions;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub fn amqp_url() -> String {
    std::env::var("AMQP_ADDR").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

pub fn redis_url() -> String {
    std::env::var("REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A test's namespace and its handles on the servers.
pub struct Ns {
    pub name: String,
    pub names: Names,
    pub store: Store,
    pub conn: lapin::Connection,
    pub publisher: lapin::Channel,
    /// Settings every component of this test starts from.
    pub base: Vec<(String, String)>,
}

impl Ns {
    /// A fresh namespace with classic queues (cheap to create and delete).
    pub async fn new() -> Result<Self> {
        Self::with_queue_type("classic").await
    }

    pub async fn with_queue_type(qt: &str) -> Result<Self> {
        let name = format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..10]);
        let names = Names::new(&name);
        let store = Store::new(&redis_url(), names.clone())?;
        let conn = amqp::connect(&amqp_url(), "fleet-tests").await.context("connect to RabbitMQ")?;
        let publisher = amqp::confirm_channel(&conn).await?;
        let base = vec![
            ("namespace".to_string(), name.clone()),
            ("amqp_url".to_string(), amqp_url()),
            ("redis_url".to_string(), redis_url()),
            ("queue_type".to_string(), qt.to_string()),
            ("http_addr".to_string(), "127.0.0.1:0".to_string()),
        ];
        let ns = Ns { name, names, store, conn, publisher, base };
        let ch = ns.conn.create_channel().await?;
        topology::declare_core(&ch, &ns.common(&[])?).await?;
        Ok(ns)
    }

    /// Settings = this namespace's base + the given overrides.
    pub fn settings(&self, extra: &[(&str, &str)]) -> Settings {
        let mut s = Settings::from_pairs(self.base.iter().map(|(k, v)| (k.as_str(), v.clone())));
        for (k, v) in extra {
            s.set(k, *v);
        }
        s
    }

    pub fn common(&self, extra: &[(&str, &str)]) -> Result<CommonConfig> {
        Ok(CommonConfig::from_settings(&self.settings(extra), "127.0.0.1:0")?)
    }

    /// Publishes envelopes to the submit exchange (routing key = lane) with confirms.
    /// Returns (accepted, refused).
    pub async fn submit(&self, envs: &[Envelope]) -> Result<(usize, usize)> {
        let mut confirms = Vec::with_capacity(envs.len());
        for e in envs {
            confirms.push(amqp::publish(&self.publisher, &self.names.submit_exchange(), e.lane.as_str(), &e.to_bytes(), amqp::task_properties(&e.id, None)).await?);
        }
        let (mut ok, mut refused) = (0, 0);
        for c in confirms {
            match amqp::confirmed(c).await {
                Ok(()) => ok += 1,
                Err(_) => refused += 1,
            }
        }
        Ok((ok, refused))
    }

    /// Publishes raw bytes to the submit exchange.
    pub async fn submit_raw(&self, lane: Lane, body: &[u8]) -> Result<()> {
        amqp::publish_confirmed(&self.publisher, &self.names.submit_exchange(), lane.as_str(), body, amqp::task_properties("raw", None)).await?;
        Ok(())
    }

    /// Takes every message in the dead-letter queue: (envelope bytes, reason header).
    pub async fn drain_dead(&self) -> Result<Vec<(Vec<u8>, Option<String>)>> {
        let ch = self.conn.create_channel().await?;
        let mut out = Vec::new();
        while let Some(m) = ch.basic_get(self.names.dead_queue().as_str().into(), BasicGetOptions { no_ack: true }).await? {
            let reason = amqp::header_str(&m.delivery.properties, amqp::REASON_HEADER);
            out.push((m.delivery.data, reason));
        }
        Ok(out)
    }

    /// Depth of a queue (0 if missing).
    pub async fn depth(&self, queue: &str) -> u32 {
        topology::depth(&self.conn, queue).await.unwrap_or(0)
    }

    /// Status fields of a task.
    pub async fn status(&self, id: &str) -> Result<Option<BTreeMap<String, String>>> {
        Ok(self.store.task_status(id).await?)
    }

    /// Deletes every queue, exchange and key of the namespace.
    pub async fn cleanup(self) -> Result<()> {
        let groups = self.store.group_names().await.unwrap_or_default();
        let ch = self.conn.create_channel().await?;
        topology::delete_all(&ch, &self.names, &groups).await?;
        self.store.delete_namespace().await?;
        let _ = self.conn.close(200, "bye".into()).await;
        Ok(())
    }
}

/// Polls `check` every 20 ms until it returns `Some`, or fails after `timeout`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = check().await {
            return Ok(v);
        }
        if start.elapsed() > timeout {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A scheduler running in this process.
pub struct SchedulerHandle {
    pub addr: SocketAddr,
    pub shutdown: CancellationToken,
    pub join: JoinHandle<Result<()>>,
}

impl SchedulerHandle {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub async fn stop(self) -> Result<()> {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(20), self.join).await.context("scheduler stop timed out")??
    }
}

/// Starts a scheduler in-process with the namespace's settings plus `extra`.
pub async fn start_scheduler(ns: &Ns, extra: &[(&str, &str)]) -> Result<SchedulerHandle> {
    let mut all: Vec<(&str, &str)> = vec![
        ("health_interval_ms", "500"),
        ("heartbeat_timeout_ms", "3000"),
        ("pressure_interval_ms", "100"),
        ("stats_interval_ms", "500"),
        ("probe_interval_ms", "1000"),
        ("red_recheck_ms", "200"),
        ("rate", "100000"),
        ("burst", "100000"),
    ];
    all.extend_from_slice(extra);
    let cfg = fleet_scheduler::SchedulerConfig::from_settings(&ns.settings(&all))?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let shutdown = CancellationToken::new();
    let sd = shutdown.clone();
    let join = tokio::spawn(async move { fleet_scheduler::run(cfg, listener, sd).await });
    let h = SchedulerHandle { addr, shutdown, join };
    let client = reqwest::Client::new();
    let url = h.url("/readyz");
    wait_for("scheduler ready", Duration::from_secs(20), || {
        let (c, u) = (client.clone(), url.clone());
        async move { c.get(&u).send().await.ok().filter(|r| r.status().is_success()).map(|_| ()) }
    })
    .await?;
    Ok(h)
}

/// An envelope of `kind` with a selector.
pub fn task(kind: &str, payload: serde_json::Value, labels: &str) -> Envelope {
    let mut e = Envelope::new(kind, payload);
    e.labels = fleet::Labels::parse(labels).unwrap_or_default();
    e
}
