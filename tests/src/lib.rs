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

pub mod servers;

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
        Self::on(&amqp_url(), &redis_url(), qt, &[]).await
    }

    /// A fresh namespace on the given servers; `extra` settings (TLS files, ...) join the base
    /// every component starts from and serve the test's own connections too.
    pub async fn on(amqp_url: &str, redis_url: &str, qt: &str, extra: &[(String, String)]) -> Result<Self> {
        let name = format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..10]);
        let names = Names::new(&name);
        let mut base = vec![
            ("namespace".to_string(), name.clone()),
            ("amqp_url".to_string(), amqp_url.to_string()),
            ("redis_url".to_string(), redis_url.to_string()),
            ("queue_type".to_string(), qt.to_string()),
            ("http_addr".to_string(), "127.0.0.1:0".to_string()),
        ];
        base.extend_from_slice(extra);
        let s = Settings::from_pairs(base.iter().map(|(k, v)| (k.as_str(), v.clone())));
        let store = Store::with_tls(redis_url, names.clone(), &tls_config(&s, "redis_tls")?)?;
        let amqp_tls = tls_config(&s, "amqp_tls")?;
        let conn = amqp::connect_with(amqp_url, "fleet-tests", &amqp_tls).await.context("connect to RabbitMQ")?;
        let publisher = amqp::confirm_channel(&conn).await?;
        // The topology is declared by the scheduler and workers a test starts (with the
        // test's own bounds), not here.
        Ok(Ns { name, names, store, conn, publisher, base })
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
            let reason = amqp::header_str(&m.delivery.properties, fleet::headers::REASON);
            out.push((m.delivery.data, reason));
        }
        Ok(out)
    }

    /// Depth of a queue (0 if missing).
    pub async fn depth(&self, queue: &str) -> u32 {
        topology::depth(&self.conn, queue).await.unwrap_or(0)
    }

    /// Depth of a queue by passive declare, `None` when it does not exist.
    pub async fn depth_of(&self, queue: &str) -> Option<u32> {
        topology::depth(&self.conn, queue).await
    }

    /// Status fields of a task.
    pub async fn status(&self, id: &str) -> Result<Option<BTreeMap<String, String>>> {
        Ok(self.store.task_status(id).await?)
    }

    /// Normal-lane shard queues of the namespace's most sharded group: shard queues
    /// `<ns>.group.<g>.normal.<i>` are numbered from 0, so the first `i` of any group whose
    /// queue does not exist (passive declare) is its count; 1 when no group is sharded.
    async fn shard_count(&self, groups: &[String]) -> u32 {
        let mut most = 1;
        for g in groups {
            let mut n = 0;
            while n < 1024 && topology::depth(&self.conn, &self.names.group_shard_queue(g, Lane::Normal, n, 2)).await.is_some() {
                n += 1;
            }
            most = most.max(n);
        }
        most
    }

    /// Deletes every queue, exchange and key of the namespace: every shard queue of every
    /// group (however many shards the test used) and the waiting-for-worker park queues too.
    pub async fn cleanup(self) -> Result<()> {
        let groups = self.store.group_names().await.unwrap_or_default();
        let shards = self.shard_count(&groups).await;
        let ch = self.conn.create_channel().await?;
        topology::delete_all_sharded(&ch, &self.names, &groups, shards).await?;
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
/// Logs of in-process fleets to stderr when `FLEET_TEST_LOG` is set (an env filter, e.g. `info`).
pub fn test_log() {
    if let Ok(f) = std::env::var("FLEET_TEST_LOG") {
        let _ = tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::new(f)).with_test_writer().try_init();
    }
}

pub async fn start_scheduler(ns: &Ns, extra: &[(&str, &str)]) -> Result<SchedulerHandle> {
    let mut all: Vec<(&str, &str)> = vec![
        ("health_interval_ms", "500"),
        ("heartbeat_timeout_ms", "3000"),
        ("pressure_interval_ms", "100"),
        ("stats_interval_ms", "500"),
        ("probe_interval_ms", "1000"),
        ("red_recheck_ms", "200"),
    ];
    all.extend_from_slice(extra);
    start_scheduler_exactly(ns, &all).await
}

/// Starts a scheduler in-process with exactly these settings (the product defaults for the
/// rest; benchmarks use it to measure the defaults).
pub async fn start_scheduler_exactly(ns: &Ns, all: &[(&str, &str)]) -> Result<SchedulerHandle> {
    test_log();
    let cfg = fleet_scheduler::SchedulerConfig::from_settings(&ns.settings(all))?;
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

// ---------------------------------------------------------------- workers

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use fleet_worker::executor::{handler_fn, Handler, TaskError};
use fleet_worker::{Worker, WorkerConfig};

/// A worker running in this process.
pub struct WorkerHandle {
    pub id: String,
    pub addr: SocketAddr,
    pub shutdown: CancellationToken,
    pub force: CancellationToken,
    pub join: JoinHandle<Result<()>>,
}

impl WorkerHandle {
    /// Drains (like SIGTERM) and waits for the worker to return.
    pub async fn stop(self) -> Result<()> {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(30), self.join).await.context("worker stop timed out")??
    }
}

/// Test defaults for workers: fast heartbeats and leases.
pub const WORKER_DEFAULTS: &[(&str, &str)] = &[
    ("heartbeat_interval_ms", "500"),
    ("heartbeat_timeout_ms", "3000"),
    ("drain_grace_ms", "10000"),
    ("retry_base_ms", "100"),
    ("retry_cap_ms", "2000"),
    // Leases far longer than the heartbeat: a test machine under load may delay a heartbeat,
    // and an expiring lease would make load (and pressure) flicker.
    ("run_lease_ms", "10000"),
];

/// Starts a worker in-process with `id`, `labels`, `capacity`, extra settings and handlers.
pub async fn start_worker(
    ns: &Ns,
    id: &str,
    labels: &str,
    capacity: u32,
    extra: &[(&str, &str)],
    handlers: &[(&str, Arc<dyn Handler>)],
) -> Result<WorkerHandle> {
    let cap = capacity.to_string();
    let mut all: Vec<(&str, &str)> = WORKER_DEFAULTS.to_vec();
    all.extend_from_slice(&[("worker_id", id), ("labels", labels), ("capacity", cap.as_str())]);
    all.extend_from_slice(extra);
    let cfg = WorkerConfig::from_settings(&ns.settings(&all))?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let mut b = Worker::builder(cfg).listener(listener).on_ready(tx);
    for (k, h) in handlers {
        b = b.handler(*k, h.clone());
    }
    let force = CancellationToken::new();
    b = b.force_shutdown(force.clone());
    let shutdown = CancellationToken::new();
    let sd = shutdown.clone();
    let join = tokio::spawn(async move { b.run(sd).await });
    match tokio::time::timeout(Duration::from_secs(20), rx).await {
        Ok(Ok(_)) => {}
        Ok(Err(_)) => {
            let r = tokio::time::timeout(Duration::from_secs(5), join).await;
            bail!("worker {id} failed to start: {r:?}");
        }
        Err(_) => bail!("worker {id} not ready within 20 s"),
    }
    Ok(WorkerHandle { id: id.to_string(), addr, shutdown, force, join })
}

/// Records which task ran where, how often, and the peak concurrency per worker.
#[derive(Clone, Default)]
pub struct Recorder {
    inner: Arc<Mutex<RecState>>,
}

#[derive(Default)]
struct RecState {
    runs: Vec<(String, String, u32)>,
    running: HashMap<String, u32>,
    peak: HashMap<String, u32>,
}

impl Recorder {
    /// A handler that records (task id, worker id, attempt), sleeps `payload.ms` (default 0)
    /// and succeeds with the worker id.
    pub fn handler(&self) -> Arc<dyn Handler> {
        let rec = self.clone();
        handler_fn(move |ctx| {
            let rec = rec.clone();
            async move {
                let w = ctx.worker_id.to_string();
                {
                    let mut s = rec.inner.lock().map_err(|_| TaskError::retryable("poisoned"))?;
                    s.runs.push((ctx.envelope.id.clone(), w.clone(), ctx.attempt));
                    let r = s.running.entry(w.clone()).or_default();
                    *r += 1;
                    let now = *r;
                    let p = s.peak.entry(w.clone()).or_default();
                    *p = (*p).max(now);
                }
                let ms = ctx.envelope.payload.get("ms").and_then(|v| v.as_u64()).unwrap_or(0);
                if ms > 0 {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                if let Ok(mut s) = rec.inner.lock() {
                    if let Some(r) = s.running.get_mut(&w) {
                        *r -= 1;
                    }
                }
                Ok(serde_json::json!({"worker": w}))
            }
        })
    }

    /// Every run so far: (task id, worker id, attempt).
    pub fn runs(&self) -> Vec<(String, String, u32)> {
        self.inner.lock().map(|s| s.runs.clone()).unwrap_or_default()
    }

    pub fn count(&self) -> usize {
        self.inner.lock().map(|s| s.runs.len()).unwrap_or(0)
    }

    pub fn peak(&self, worker: &str) -> u32 {
        self.inner.lock().ok().and_then(|s| s.peak.get(worker).copied()).unwrap_or(0)
    }

    /// Runs per task id.
    pub fn per_task(&self) -> HashMap<String, Vec<String>> {
        let mut m: HashMap<String, Vec<String>> = HashMap::new();
        for (t, w, _) in self.runs() {
            m.entry(t).or_default().push(w);
        }
        m
    }
}

/// Path of a workspace binary next to the test executable (built by `cargo build --bins`).
pub fn bin_path(name: &str) -> Result<std::path::PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().and_then(|p| p.parent()).context("no target dir")?;
    let p = dir.join(name);
    if !p.exists() {
        bail!("{} not found: build the binaries first (cargo build --bins)", p.display());
    }
    Ok(p)
}

/// Runs a binary with only the given `FLEET_*` settings (the test's own are removed) and
/// returns (exit code, stderr) once it exits, failing after 20 s. For start-up refusals.
pub fn run_to_exit(name: &str, env: &[(&str, &str)]) -> Result<(i32, String)> {
    let mut cmd = std::process::Command::new(bin_path(name)?);
    for (k, _) in std::env::vars() {
        if k.starts_with("FLEET_") {
            cmd.env_remove(k);
        }
    }
    let mut child = cmd.envs(env.iter().copied()).stdin(std::process::Stdio::null()).stdout(std::process::Stdio::null()).stderr(std::process::Stdio::piped()).spawn()?;
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                std::io::Read::read_to_string(&mut e, &mut err)?;
            }
            return Ok((status.code().unwrap_or(-1), err));
        }
        if start.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{name} did not exit within 20 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sum of a counter/gauge in a Prometheus text page over the series whose labels contain
/// every `k="v"` given.
pub fn metric_sum(page: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| l.starts_with(name) && (l[name.len()..].starts_with('{') || l[name.len()..].starts_with(' ')))
        .filter(|l| labels.iter().all(|(k, v)| l.contains(&format!("{k}=\"{v}\""))))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

impl Ns {
    /// Publishes each envelope and reports, per envelope, whether the broker accepted it.
    pub async fn submit_each(&self, envs: &[Envelope]) -> Result<Vec<bool>> {
        let mut confirms = Vec::with_capacity(envs.len());
        for e in envs {
            confirms.push(amqp::publish(&self.publisher, &self.names.submit_exchange(), e.lane.as_str(), &e.to_bytes(), amqp::task_properties(&e.id, None)).await?);
        }
        let mut out = Vec::with_capacity(envs.len());
        for c in confirms {
            out.push(amqp::confirmed(c).await.is_ok());
        }
        Ok(out)
    }
}

/// GETs a JSON document.
pub async fn get_json(url: &str) -> Result<serde_json::Value> {
    Ok(reqwest::get(url).await?.error_for_status()?.json().await?)
}

impl Ns {
    /// Declares the submit exchange, the core queues and the ingress queues (as a scheduler
    /// would, with `extra` settings), so a test can publish while no scheduler runs.
    pub async fn declare_ingress(&self, extra: &[(&str, &str)]) -> Result<()> {
        let cfg = self.common(extra)?;
        let ch = self.conn.create_channel().await?;
        topology::declare_core(&ch, &cfg).await?;
        topology::declare_ingress(&ch, &cfg).await?;
        Ok(())
    }

    /// Waits until every group has nothing reserved and nothing running.
    pub async fn wait_groups_idle(&self, timeout: Duration) -> Result<()> {
        wait_for("every group's reserved and load back to 0", timeout, || async {
            let gs = self.store.groups().await.ok()?;
            gs.iter().all(|g| g.reserved == 0 && g.load == 0).then_some(())
        })
        .await
    }

    /// Waits until the work in this namespace has settled: both ingress queues and every
    /// registered group's queues hold no ready message, and every group has nothing reserved
    /// and nothing running. After it no further run can start (the barrier that replaces a
    /// quiet period before asserting that nothing ran twice).
    pub async fn wait_settled(&self, timeout: Duration) -> Result<()> {
        wait_for("queues empty and every group idle", timeout, || async {
            let gs = self.store.groups().await.ok()?;
            for lane in Lane::ALL {
                if self.depth(&self.names.ingress_queue(lane)).await > 0 {
                    return None;
                }
                for g in &gs {
                    if self.depth(&self.names.group_queue(&g.group, lane)).await > 0 {
                        return None;
                    }
                }
            }
            gs.iter().all(|g| g.reserved == 0 && g.load == 0).then_some(())
        })
        .await
    }

    /// Waits until `id`'s status has `state`; returns the status fields.
    pub async fn wait_state(&self, id: &str, state: &str, timeout: Duration) -> Result<BTreeMap<String, String>> {
        wait_for(&format!("task {id} {state}"), timeout, || async {
            let st = self.status(id).await.ok()??;
            (st.get("state").map(String::as_str) == Some(state)).then_some(st)
        })
        .await
    }
}

/// The TLS settings `<prefix>_ca_file`, `_cert_file`, `_key_file` of `s` (prefix `amqp_tls`,
/// `redis_tls`, `http_tls`) as the binaries build them, errors naming `FLEET_<PREFIX>_*_FILE`.
pub fn tls_config(s: &Settings, prefix: &str) -> Result<fleet::tls::TlsConfig> {
    let file = |what: &str| s.opt_string(&format!("{prefix}_{what}_file"));
    let (ca, cert, key) = (file("ca"), file("cert"), file("key"));
    let var_prefix = format!("FLEET_{}", prefix.to_ascii_uppercase());
    Ok(fleet::tls::TlsConfig::from_files(&var_prefix, ca.as_deref(), cert.as_deref(), key.as_deref())?)
}
