//! Support for the worker-lifecycle tests (crash, eviction, drain, Redis loss, ejection,
//! orphans, duplicates): workers as separate *processes* (so a test can SIGKILL, SIGSTOP or
//! SIGTERM them), an HTTP task endpoint in the test process that records every call it gets,
//! a private `redis-server` a test may flush, and the short timings these tests share.
//!
//! Included with `mod harness;` by each test file that needs it; not every file uses every
//! item.

#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use fleet::registry::WorkerView;
use deadpool_redis::redis;
use fleet::Store;
use fleet_tests::{amqp_url, bin_path, redis_url, wait_for, Ns};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

// ------------------------------------------------------------------ timings

/// Worker heartbeat period in these tests.
pub const HEARTBEAT_MS: u64 = 300;
/// Silence after which a worker is evicted (scheduler) / an id counts as live (worker).
pub const HEARTBEAT_TIMEOUT_MS: u64 = 1500;
/// The scheduler's health tick (eviction + orphan rescue).
pub const HEALTH_MS: u64 = 300;

/// Scheduler settings of these tests: fast health checks, no probe traffic after the first
/// tick (probe tasks would otherwise show up at the recording endpoint and in eject windows).
pub const SCHEDULER: &[(&str, &str)] = &[
    ("health_interval_ms", "300"),
    ("heartbeat_timeout_ms", "1500"),
    ("probe_interval_ms", "600000"),
];

/// In-process worker settings matching [`SCHEDULER`].
pub const WORKER: &[(&str, &str)] = &[
    ("heartbeat_interval_ms", "300"),
    ("heartbeat_timeout_ms", "1500"),
];

/// The task kind the recording endpoint records (others, e.g. probes, are answered at once).
pub const JOB: &str = "job";

// ------------------------------------------------------------------ recording endpoint

/// One call the endpoint received.
#[derive(Debug, Clone)]
pub struct Call {
    pub id: String,
    pub worker: String,
    pub attempt: u32,
    pub at: Instant,
    /// When the answer (200) was produced; `None` while running or when the caller went away.
    pub answered: Option<Instant>,
}

#[derive(Default)]
struct EndpointState {
    calls: Vec<Call>,
    /// Workers the test killed: their unanswered calls will never be answered.
    dead: std::collections::HashSet<String>,
}

/// An HTTP endpoint for the `http` executor: records every `job` call (task id, worker,
/// attempt, start and answer times), sleeps `payload.ms` (default given at start) and answers
/// 200. Any other kind gets 200 at once and is not recorded.
pub struct Endpoint {
    pub url: String,
    state: Arc<Mutex<EndpointState>>,
    stop: CancellationToken,
    default_ms: u64,
}

#[derive(Clone)]
struct EndpointCtx {
    state: Arc<Mutex<EndpointState>>,
    default_ms: u64,
}

/// Marks a call answered, or leaves it unanswered when the request is dropped.
struct CallGuard {
    state: Arc<Mutex<EndpointState>>,
    index: usize,
}

impl CallGuard {
    fn answered(self) {
        if let Ok(mut s) = self.state.lock() {
            if let Some(c) = s.calls.get_mut(self.index) {
                c.answered = Some(Instant::now());
            }
        }
    }
}

async fn endpoint_call(State(ctx): State<EndpointCtx>, headers: HeaderMap, Json(body): Json<Value>) -> (StatusCode, Json<Value>) {
    if body.get("kind").and_then(Value::as_str) != Some(JOB) {
        return (StatusCode::OK, Json(json!({"ok": true})));
    }
    let id = body.get("id").and_then(Value::as_str).unwrap_or_default().to_string();
    let attempt = body.get("attempt").and_then(Value::as_u64).unwrap_or(0) as u32;
    let worker = headers.get("x-fleet-worker").and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    let ms = body.pointer("/payload/ms").and_then(Value::as_u64).unwrap_or(ctx.default_ms);
    let guard = {
        let Ok(mut s) = ctx.state.lock() else { return (StatusCode::INTERNAL_SERVER_ERROR, Json(json!({}))) };
        s.calls.push(Call { id, worker: worker.clone(), attempt, at: Instant::now(), answered: None });
        CallGuard { state: ctx.state.clone(), index: s.calls.len() - 1 }
    };
    tokio::time::sleep(Duration::from_millis(ms)).await;
    guard.answered();
    (StatusCode::OK, Json(json!({"worker": worker})))
}

impl Endpoint {
    /// Starts the endpoint on a free loopback port; `default_ms` is the run time of a call
    /// whose payload has no `ms`.
    pub async fn start(default_ms: u64) -> Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr: SocketAddr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(EndpointState::default()));
        let ctx = EndpointCtx { state: state.clone(), default_ms };
        let router = Router::new().route("/run", post(endpoint_call)).with_state(ctx);
        let stop = CancellationToken::new();
        let sd = stop.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, router).with_graceful_shutdown(async move { sd.cancelled().await }).await;
        });
        Ok(Endpoint { url: format!("http://{addr}/run"), state, stop, default_ms })
    }

    /// Every recorded call, in arrival order.
    pub fn calls(&self) -> Vec<Call> {
        self.state.lock().map(|s| s.calls.clone()).unwrap_or_default()
    }

    /// Calls of one worker.
    pub fn calls_of(&self, worker: &str) -> Vec<Call> {
        self.calls().into_iter().filter(|c| c.worker == worker).collect()
    }

    /// Calls per task id, in arrival order.
    pub fn per_task(&self) -> HashMap<String, Vec<Call>> {
        let mut m: HashMap<String, Vec<Call>> = HashMap::new();
        for c in self.calls() {
            m.entry(c.id.clone()).or_default().push(c);
        }
        m
    }

    /// Calls of `worker` started and not yet answered.
    pub fn running(&self, worker: &str) -> Vec<Call> {
        self.calls_of(worker).into_iter().filter(|c| c.answered.is_none()).collect()
    }

    /// Marks a worker killed (its open calls no longer count as running).
    pub fn mark_dead(&self, worker: &str) {
        if let Ok(mut s) = self.state.lock() {
            s.dead.insert(worker.to_string());
        }
    }

    /// False for a worker marked dead.
    pub fn is_live(&self, worker: &str) -> bool {
        self.state.lock().map(|s| !s.dead.contains(worker)).unwrap_or(true)
    }

    /// Distinct task ids answered at least once.
    pub fn answered_ids(&self) -> std::collections::HashSet<String> {
        self.calls().into_iter().filter(|c| c.answered.is_some()).map(|c| c.id).collect()
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// `n` tasks of kind [`JOB`] with a selector; `ms` overrides the endpoint's run time.
pub fn jobs(n: usize, selector: &str, ms: Option<u64>) -> Vec<fleet::Envelope> {
    (0..n)
        .map(|i| {
            let payload = match ms {
                Some(ms) => json!({"i": i, "ms": ms}),
                None => json!({"i": i}),
            };
            fleet_tests::task(JOB, payload, selector)
        })
        .collect()
}

// ------------------------------------------------------------------ worker processes

/// A `fleet-worker` process with the `http` executor, logging to a file (removed on drop
/// unless the test is panicking). Killed on drop if still running.
pub struct WorkerProcess {
    pub id: String,
    pub child: Child,
    pub log: PathBuf,
}

/// What a worker process is started with.
pub struct ProcessSpec<'a> {
    pub id: &'a str,
    pub labels: &'a str,
    pub capacity: u32,
    pub endpoint: &'a str,
    /// More settings, keys as in the config file (`drain_grace_ms`, ...).
    pub extra: &'a [(&'a str, &'a str)],
}

impl WorkerProcess {
    /// Starts `fleet-worker` in `ns` (its Redis URL taken from the namespace's settings).
    pub fn spawn(ns: &Ns, spec: &ProcessSpec<'_>) -> Result<Self> {
        Self::spawn_with_env(ns, spec, &[])
    }

    /// [`WorkerProcess::spawn`] with more environment variables for the process (e.g.
    /// `LD_PRELOAD` of libfaketime).
    pub fn spawn_with_env(ns: &Ns, spec: &ProcessSpec<'_>, env: &[(&str, &str)]) -> Result<Self> {
        let bin = bin_path("fleet-worker")?;
        let log = std::env::temp_dir().join(format!("fleet-{}-{}-{}.log", ns.name, spec.id, &uuid::Uuid::new_v4().simple().to_string()[..6]));
        let out = std::fs::File::create(&log).with_context(|| format!("create {}", log.display()))?;
        let err = out.try_clone()?;
        let base: HashMap<&str, &str> = ns.base.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let mut cmd = Command::new(bin);
        // Nothing of the test runner's own FLEET_* environment leaks in.
        for (k, _) in std::env::vars() {
            if k.starts_with("FLEET_") {
                cmd.env_remove(k);
            }
        }
        let capacity = spec.capacity.to_string();
        let mut settings: Vec<(&str, &str)> = vec![
            ("namespace", base.get("namespace").copied().unwrap_or_default()),
            ("amqp_url", base.get("amqp_url").copied().unwrap_or_default()),
            ("redis_url", base.get("redis_url").copied().unwrap_or_default()),
            ("queue_type", base.get("queue_type").copied().unwrap_or("classic")),
            ("http_addr", "127.0.0.1:0"),
            ("executor", "http"),
            ("http_url", spec.endpoint),
            ("worker_id", spec.id),
            ("labels", spec.labels),
            ("capacity", capacity.as_str()),
            ("heartbeat_interval_ms", "300"),
            ("heartbeat_timeout_ms", "1500"),
            ("drain_grace_ms", "15000"),
            ("retry_base_ms", "100"),
            ("retry_cap_ms", "1000"),
        ];
        settings.extend_from_slice(spec.extra);
        for (k, v) in settings {
            cmd.env(format!("FLEET_{}", k.to_ascii_uppercase()), v);
        }
        cmd.env("RUST_LOG", "info,lapin=warn");
        cmd.envs(env.iter().copied());
        let child = cmd.stdin(Stdio::null()).stdout(out).stderr(err).spawn().context("spawn fleet-worker")?;
        Ok(WorkerProcess { id: spec.id.to_string(), child, log })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal by name (`TERM`, `STOP`, `CONT`) with `kill(1)`.
    pub fn signal(&self, sig: &str) -> Result<()> {
        let st = Command::new("kill").arg(format!("-{sig}")).arg(self.pid().to_string()).status()?;
        if !st.success() {
            bail!("kill -{sig} {} failed: {st}", self.pid());
        }
        Ok(())
    }

    /// SIGKILL, and reaps the process.
    pub fn kill9(&mut self) -> Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }

    /// Waits for the process to exit.
    pub async fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let start = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait()? {
                return Ok(st);
            }
            if start.elapsed() > timeout {
                bail!("{} did not exit within {timeout:?}; log:\n{}", self.id, self.log_tail());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The last lines of the process's log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// Waits until the worker is registered in `state`.
    pub async fn wait_state(&mut self, store: &Store, state: &str, timeout: Duration) -> Result<WorkerView> {
        let start = Instant::now();
        loop {
            if let Some(w) = worker(store, &self.id).await {
                if w.state == state {
                    return Ok(w);
                }
            }
            if let Some(st) = self.child.try_wait()? {
                bail!("{} exited ({st}) before reaching state {state}; log:\n{}", self.id, self.log_tail());
            }
            if start.elapsed() > timeout {
                bail!("{} not {state} within {timeout:?}; log:\n{}", self.id, self.log_tail());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        // The log is kept when the test fails by panicking.
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

/// Runs `fleetctl` against a scheduler's API in `ns`: (exit code, stdout, stderr).
pub fn fleetctl(ns: &Ns, api: &str, args: &[&str]) -> Result<(i32, String, String)> {
    let mut cmd = Command::new(bin_path("fleetctl")?);
    for (k, _) in std::env::vars() {
        if k.starts_with("FLEET_") {
            cmd.env_remove(k);
        }
    }
    let out = cmd
        .env("FLEET_API_URL", api)
        .env("FLEET_NAMESPACE", &ns.name)
        .env("FLEET_AMQP_URL", amqp_url())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("run fleetctl")?;
    Ok((out.status.code().unwrap_or(-1), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned()))
}

// ------------------------------------------------------------------ registry reads

/// A worker as the registry shows it, `None` when not registered.
pub async fn worker(store: &Store, id: &str) -> Option<WorkerView> {
    store.workers().await.ok()?.into_iter().find(|w| w.id == id)
}

/// A group's view, `None` when unknown.
pub async fn group(store: &Store, name: &str) -> Option<fleet::registry::GroupView> {
    store.groups().await.ok()?.into_iter().find(|g| g.group == name)
}

/// Waits until no worker with `id` is registered; returns when that was seen.
pub async fn wait_gone(store: &Store, id: &str, timeout: Duration) -> Result<Instant> {
    wait_for(&format!("worker {id} gone from the registry"), timeout, || async {
        match store.workers().await {
            Ok(ws) if !ws.iter().any(|w| w.id == id) => Some(Instant::now()),
            _ => None,
        }
    })
    .await
}

/// Waits until every task id has status `succeeded`.
pub async fn wait_succeeded(ns: &Ns, ids: &[String], timeout: Duration) -> Result<()> {
    let mut left: Vec<String> = ids.to_vec();
    let start = Instant::now();
    loop {
        let mut still = Vec::new();
        for id in &left {
            let st = ns.status(id).await?.unwrap_or_default();
            if st.get("state").map(String::as_str) != Some("succeeded") {
                still.push(id.clone());
            }
        }
        left = still;
        if left.is_empty() {
            return Ok(());
        }
        if start.elapsed() > timeout {
            bail!("{} of {} tasks not succeeded within {timeout:?}, e.g. {:?}", left.len(), ids.len(), &left[..left.len().min(3)]);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Waits until every task id was answered by the endpoint at least once, no call is running
/// and `queue` holds nothing ready: every task done as far as the worker side can tell.
/// (Statuses in Redis may lag: a task a killed worker finished and acked just before the kill
/// may never have had its `succeeded` written — the ledger writes after the ack, batched.)
pub async fn wait_settled(ns: &Ns, ep: &Endpoint, ids: &[String], queue: &str, timeout: Duration) -> Result<()> {
    let n = ids.len();
    wait_for(&format!("{n} tasks answered by the endpoint, none running, {queue} empty"), timeout, || async {
        let calls = ep.calls();
        let done: std::collections::HashSet<&str> = calls.iter().filter(|c| c.answered.is_some()).map(|c| c.id.as_str()).collect();
        let running = calls.iter().any(|c| c.answered.is_none() && ep.is_live(&c.worker));
        (ids.iter().all(|id| done.contains(id.as_str())) && !running && ns.depth(queue).await == 0).then_some(())
    })
    .await
}

/// A counter or gauge from a `/metrics` page.
pub async fn metric(url: &str, name: &str, labels: &[(&str, &str)]) -> Result<f64> {
    let page = reqwest::get(url).await?.text().await?;
    Ok(fleet_tests::metric_sum(&page, name, labels))
}

// ------------------------------------------------------------------ a private Redis

/// A `redis-server` of this test alone (no persistence), so the test may FLUSHALL it without
/// touching the shared server. Killed on drop.
pub struct PrivateRedis {
    pub url: String,
    child: Child,
    store: Store,
}

impl PrivateRedis {
    pub async fn start() -> Result<Self> {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0")?;
            l.local_addr()?.port()
        };
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--daemonize", "no"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("start redis-server (is it installed?)")?;
        let url = format!("redis://127.0.0.1:{port}");
        let store = Store::new(&url, fleet::Names::new("private"))?;
        let r = PrivateRedis { url, child, store };
        wait_for("private redis-server up", Duration::from_secs(10), || async { r.store.ping().await.then_some(()) }).await?;
        Ok(r)
    }

    /// FLUSHALL on this server only.
    pub async fn flushall(&self) -> Result<()> {
        self.store.query::<()>(&redis::cmd("FLUSHALL")).await?;
        Ok(())
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A fresh namespace whose Redis is `url` (instead of the shared server).
pub async fn ns_on_redis(url: &str) -> Result<Ns> {
    let mut ns = Ns::new().await?;
    ns.store = Store::new(url, ns.names.clone())?;
    for (k, v) in ns.base.iter_mut() {
        if k == "redis_url" {
            *v = url.to_string();
        }
    }
    Ok(ns)
}

/// The shared Redis URL (for reading it in a message).
pub fn shared_redis() -> String {
    redis_url()
}

// ------------------------------------------------------------------ scheduler processes

/// A `fleet-scheduler` process (so a test can SIGKILL it), logging to a file (removed on drop
/// unless the test is panicking). Killed on drop if still running.
pub struct SchedulerProcess {
    pub child: Child,
    /// `http://127.0.0.1:<port>` of its API and `/metrics`.
    pub base: String,
    pub log: PathBuf,
}

impl SchedulerProcess {
    /// Starts `fleet-scheduler` with the namespace's settings plus `extra` (config-file keys)
    /// and waits (up to 30 s) until `/readyz` answers 200.
    pub async fn spawn(ns: &Ns, extra: &[(&str, &str)]) -> Result<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let log = std::env::temp_dir().join(format!("fleet-{}-scheduler-{port}.log", ns.name));
        let out = std::fs::File::create(&log)?;
        let mut cmd = Command::new(bin_path("fleet-scheduler")?);
        for (k, _) in std::env::vars() {
            if k.starts_with("FLEET_") {
                cmd.env_remove(k);
            }
        }
        let addr = format!("127.0.0.1:{port}");
        for (k, v) in ns.base.iter().map(|(k, v)| (k.as_str(), v.as_str())).chain([("http_addr", addr.as_str())]).chain(extra.iter().copied()) {
            cmd.env(format!("FLEET_{}", k.to_ascii_uppercase()), v);
        }
        cmd.env("RUST_LOG", "info,lapin=warn");
        let child = cmd.stdin(Stdio::null()).stdout(out.try_clone()?).stderr(out).spawn().context("spawn fleet-scheduler")?;
        let p = SchedulerProcess { child, base: format!("http://{addr}"), log };
        let ready = format!("{}/readyz", p.base);
        wait_for("scheduler process ready", Duration::from_secs(30), || {
            let u = ready.clone();
            async move { reqwest::get(&u).await.ok().filter(|r| r.status().is_success()).map(|_| ()) }
        })
        .await
        .with_context(|| std::fs::read_to_string(&p.log).unwrap_or_default())?;
        Ok(p)
    }

    /// SIGKILL, and reaps the process.
    pub fn kill9(&mut self) -> Result<()> {
        self.child.kill()?;
        self.child.wait()?;
        Ok(())
    }

    /// SIGTERM and waits (up to `timeout`) for the exit.
    pub async fn stop(&mut self, timeout: Duration) -> Result<()> {
        let _ = Command::new("kill").arg("-TERM").arg(self.child.id().to_string()).status();
        let start = Instant::now();
        while self.child.try_wait()?.is_none() {
            if start.elapsed() > timeout {
                bail!("scheduler did not exit within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }
}

impl Drop for SchedulerProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

// ------------------------------------------------------------------ a private RabbitMQ node

/// A free loopback TCP port.
pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A RabbitMQ node of this test alone: its own node name, AMQP and distribution ports, data and
/// log directories and config files (under a temporary directory removed on drop), no plugins.
/// Started as its own process group; stopped on drop by that group's id (SIGTERM, then SIGKILL).
pub struct PrivateRabbit {
    pub port: u16,
    child: Child,
    dir: PathBuf,
}

impl PrivateRabbit {
    /// Starts the node with `conf` (rabbitmq.conf lines) and `advanced` (an Erlang term list
    /// for advanced.config, e.g. `[{rabbit, [{channel_tick_interval, 1000}]}].`) and waits (up
    /// to 120 s) until it accepts AMQP connections.
    pub async fn start(conf: &str, advanced: &str) -> Result<Self> {
        use std::os::unix::process::CommandExt;
        let dir = std::env::temp_dir().join(format!("fleet-rabbit-{}", &uuid::Uuid::new_v4().simple().to_string()[..10]));
        std::fs::create_dir_all(&dir)?;
        let port = free_port()?;
        let dist = free_port()?;
        let conf = format!("listeners.tcp.default = 127.0.0.1:{port}\nloopback_users.guest = true\nlog.console = true\nlog.file = false\n{conf}\n");
        std::fs::write(dir.join("rabbitmq.conf"), conf)?;
        std::fs::write(dir.join("advanced.config"), advanced)?;
        std::fs::write(dir.join("enabled_plugins"), "[].\n")?;
        // The inner script runs the node as the calling user; the packaged wrapper would switch
        // to user `rabbitmq`.
        let bin = ["/usr/lib/rabbitmq/bin/rabbitmq-server", "/usr/sbin/rabbitmq-server"]
            .into_iter()
            .find(|p| std::path::Path::new(p).exists())
            .unwrap_or("rabbitmq-server");
        let node = format!("fleet-t{}@localhost", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let log = std::fs::File::create(dir.join("node.log"))?;
        let child = Command::new(bin)
            .env("RABBITMQ_NODENAME", &node)
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_NODE_PORT", port.to_string())
            .env("RABBITMQ_DIST_PORT", dist.to_string())
            .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", dir.join("log"))
            .env("RABBITMQ_CONFIG_FILE", dir.join("rabbitmq.conf"))
            .env("RABBITMQ_ADVANCED_CONFIG_FILE", dir.join("advanced.config"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", dir.join("enabled_plugins"))
            .env("RABBITMQ_PLUGINS_EXPAND_DIR", dir.join("plugins-expand"))
            .env("RABBITMQ_PID_FILE", dir.join("pid"))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .process_group(0)
            .spawn()
            .context("start rabbitmq-server (is it installed?)")?;
        let mut r = PrivateRabbit { port, child, dir };
        let start = Instant::now();
        loop {
            if fleet::amqp::connect(&r.url(), "fleet-tests-probe").await.is_ok() {
                return Ok(r);
            }
            if let Ok(Some(status)) = r.child.try_wait() {
                bail!("rabbitmq-server exited ({status}) before accepting connections: {}", r.log_tail());
            }
            if start.elapsed() > Duration::from_secs(120) {
                bail!("private rabbitmq not up within 120 s: {}", r.log_tail());
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }

    /// `amqp://guest:guest@127.0.0.1:<port>/%2f`.
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    /// The last lines of the node's console log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.join("node.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// The node's console log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("node.log")).unwrap_or_default()
    }
}

impl Drop for PrivateRabbit {
    fn drop(&mut self) {
        let group = format!("-{}", self.child.id());
        let _ = Command::new("kill").args(["-TERM", "--", &group]).status();
        for _ in 0..200 {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        if let Ok(None) = self.child.try_wait() {
            let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
            let _ = self.child.wait();
        }
        // The Erlang VM may outlive the script by a moment: kill what is left of the group.
        let _ = Command::new("kill").args(["-KILL", "--", &group]).stderr(Stdio::null()).status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A fresh namespace on another broker (`amqp`) and the shared Redis.
pub async fn ns_on_broker(amqp: &str) -> Result<Ns> {
    let name = format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..10]);
    let names = fleet::Names::new(&name);
    let store = Store::new(&redis_url(), names.clone())?;
    let conn = fleet::amqp::connect(amqp, "fleet-tests").await.context("connect to the private RabbitMQ")?;
    let publisher = fleet::amqp::confirm_channel(&conn).await?;
    let base = vec![
        ("namespace".to_string(), name.clone()),
        ("amqp_url".to_string(), amqp.to_string()),
        ("redis_url".to_string(), redis_url()),
        ("queue_type".to_string(), "classic".to_string()),
        ("http_addr".to_string(), "127.0.0.1:0".to_string()),
    ];
    Ok(Ns { name, names, store, conn, publisher, base })
}

/// `state` of each id (`-` when it has no status), read in pipelined rounds of 500.
pub async fn states(ns: &Ns, ids: &[String]) -> Result<HashMap<String, String>> {
    let mut out = HashMap::with_capacity(ids.len());
    for chunk in ids.chunks(500) {
        let mut p = redis::pipe();
        for id in chunk {
            p.cmd("HGET").arg(ns.names.task(id)).arg("state");
        }
        let got: Vec<Option<String>> = ns.store.pipe(&p).await?;
        for (id, st) in chunk.iter().zip(got) {
            out.insert(id.clone(), st.unwrap_or_else(|| "-".into()));
        }
    }
    Ok(out)
}

/// How many ids are in each state.
pub fn count_states(states: &HashMap<String, String>) -> std::collections::BTreeMap<String, usize> {
    let mut m = std::collections::BTreeMap::new();
    for s in states.values() {
        *m.entry(s.clone()).or_default() += 1;
    }
    m
}

/// Polls the states of `ids` until every one is `want` or `timeout` passes; returns whether
/// they all got there and the last states read.
pub async fn wait_all_in(ns: &Ns, ids: &[String], want: &str, timeout: Duration) -> Result<(bool, HashMap<String, String>)> {
    let start = Instant::now();
    loop {
        let last = states(ns, ids).await?;
        if last.values().all(|s| s == want) {
            return Ok((true, last));
        }
        if start.elapsed() > timeout {
            return Ok((false, last));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
