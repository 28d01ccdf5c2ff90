//! The scheduler and workers in this process: started with the namespace's settings, ready
//! when they say so (`/readyz`, the worker's ready signal), stopped by their shutdown token.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use fleet_worker::executor::Handler;
use fleet_worker::{Worker, WorkerConfig};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::{wait_for, Ns};

/// A scheduler running in this process.
pub struct SchedulerHandle {
    pub addr: SocketAddr,
    pub shutdown: CancellationToken,
    pub join: JoinHandle<Result<()>>,
}

impl SchedulerHandle {
    /// `http://addr<path>` of its API.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub async fn stop(self) -> Result<()> {
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(20), self.join)
            .await
            .context("scheduler stop timed out")??
    }
}

/// Logs of in-process fleets to stderr when `FLEET_TEST_LOG` is set (an env filter, e.g. `info`).
pub fn test_log() {
    crate::wait::watchdog();
    if let Ok(f) = std::env::var("FLEET_TEST_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(f))
            .with_test_writer()
            .try_init();
    }
}

/// Starts a scheduler in-process with the namespace's settings, fast test timings (health,
/// pressure, stats, probes) and then `extra`; returns once `/readyz` answers 200.
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
    let h = SchedulerHandle {
        addr,
        shutdown,
        join,
    };
    let client = reqwest::Client::new();
    let url = h.url("/readyz");
    // 40 s: a scheduler given a list of nodes may first spend `fleet::broker::amqp::CONNECT_TIMEOUT`
    // on one that never answers.
    wait_for("scheduler ready", Duration::from_secs(40), || {
        let (c, u) = (client.clone(), url.clone());
        async move {
            c.get(&u)
                .send()
                .await
                .ok()
                .filter(|r| r.status().is_success())
                .map(|_| ())
        }
    })
    .await?;
    Ok(h)
}

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
        tokio::time::timeout(Duration::from_secs(30), self.join)
            .await
            .context("worker stop timed out")??
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
    all.extend_from_slice(&[
        ("worker_id", id),
        ("labels", labels),
        ("capacity", cap.as_str()),
    ]);
    all.extend_from_slice(extra);
    let cfg = WorkerConfig::from_settings(&ns.settings(&all))?;
    let mut b = Worker::builder(cfg);
    for (k, h) in handlers {
        b = b.handler(*k, h.clone());
    }
    spawn_worker(id, b).await
}

/// Starts a worker from a builder (handlers added, config made by the caller) on a free
/// loopback port with its own shutdown and force tokens; returns once the worker is ready
/// (fails after 40 s, or with the worker's error when it ends before).
pub async fn spawn_worker(id: &str, builder: fleet_worker::WorkerBuilder) -> Result<WorkerHandle> {
    test_log();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let force = CancellationToken::new();
    let b = builder
        .listener(listener)
        .on_ready(tx)
        .force_shutdown(force.clone());
    let shutdown = CancellationToken::new();
    let sd = shutdown.clone();
    let join = tokio::spawn(async move { Ok(b.run(sd).await?) });
    // 40 s, as for a scheduler (a node that never answers may cost CONNECT_TIMEOUT first).
    match tokio::time::timeout(Duration::from_secs(40), rx).await {
        Ok(Ok(_)) => {}
        Ok(Err(_)) => {
            let r = tokio::time::timeout(Duration::from_secs(5), join).await;
            bail!("worker {id} failed to start: {r:?}");
        }
        Err(_) => bail!("worker {id} not ready within 40 s"),
    }
    Ok(WorkerHandle {
        id: id.to_string(),
        addr,
        shutdown,
        force,
        join,
    })
}

/// The fixture of tests about what one worker does with tasks: a namespace, a scheduler and
/// one worker in this process, and the worker's group name. Stopped (worker, scheduler) and
/// cleaned up by [`Fleet::stop`].
pub struct Fleet {
    pub ns: Ns,
    pub sched: SchedulerHandle,
    pub worker: WorkerHandle,
    /// The worker's group (its labels with `protocol=<executor>`).
    pub group: String,
}

impl Fleet {
    /// A fresh namespace, a scheduler with the test defaults, and worker `id` with `labels`,
    /// `capacity`, `extra` settings (its executor from `executor`, `builtin` by default) and
    /// `handlers`.
    pub async fn start(
        id: &str,
        labels: &str,
        capacity: u32,
        extra: &[(&str, &str)],
        handlers: &[(&str, Arc<dyn Handler>)],
    ) -> Result<Fleet> {
        let ns = Ns::new().await?;
        let sched = start_scheduler(&ns, &[]).await?;
        let worker = start_worker(&ns, id, labels, capacity, extra, handlers).await?;
        let executor = extra
            .iter()
            .rev()
            .find(|(k, _)| *k == "executor")
            .map(|(_, v)| *v)
            .unwrap_or("builtin");
        Ok(Fleet {
            group: crate::group_of(labels, executor),
            ns,
            sched,
            worker,
        })
    }

    /// `http://addr` of the worker (its `/metrics`, `/status`).
    pub fn worker_url(&self) -> String {
        format!("http://{}", self.worker.addr)
    }

    /// Stops the worker, then the scheduler, and deletes the namespace.
    pub async fn stop(self) -> Result<()> {
        self.worker.stop().await?;
        self.sched.stop().await?;
        self.ns.cleanup().await
    }
}
