//! The [`Worker`]: start-up, the loops that make it up, and its end.
//!
//! ```text
//! start-up:  HTTP up (healthz) → RabbitMQ (retrying; topology) → Redis registration (retrying;
//!            a live duplicate id is fatal) → ready
//! running:   lane normal ┐                  ┌ ledger (batched start/finish to Redis)
//!            lane critical┴─ task attempts ─┤ heartbeat (+ state poll, re-registration)
//!                                           └ ejector (outlier cool-down)
//! the end:   drain (see [`crate::drain`]) → loops stopped → ledger flushed → deregistered →
//!            connection closed
//! ```

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::{anyhow, Context as _};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use fleet::http::Readiness;
use fleet::registry::WorkerState;
use fleet::store::Store;
use fleet::Lane;

use crate::api;
use crate::attempt::Shared;
use crate::broker::Broker;
use crate::config::WorkerConfig;
use crate::drain::{self, Control, Finish};
use crate::eject::Ejector;
use crate::executor::{Handler, Handlers};
use crate::heartbeat::Heartbeat;
use crate::lane::LaneConsumer;
use crate::ledger::Ledger;
use crate::registry::{set_state_logged, Registrar};
use crate::retry::Backoff;
use crate::shards::ShardWatch;
use crate::stats::Stats;

/// How long attempts get to notice a hard stop before the worker returns anyway.
const ABORT_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// A worker process (or an in-process worker in tests). Build with [`Worker::builder`].
pub struct Worker {
    cfg: WorkerConfig,
    custom: Handlers,
    listener: Option<TcpListener>,
    ready: Option<oneshot::Sender<SocketAddr>>,
    force: CancellationToken,
}

/// Builds a [`Worker`].
pub struct WorkerBuilder {
    worker: Worker,
}

impl WorkerBuilder {
    /// Registers a handler for a task kind. It takes precedence over the executor's own.
    pub fn handler(mut self, kind: impl Into<String>, handler: Arc<dyn Handler>) -> Self {
        self.worker.custom.insert(kind, handler);
        self
    }

    /// Serves HTTP on this listener instead of binding `http_addr` (tests bind port 0).
    pub fn listener(mut self, listener: TcpListener) -> Self {
        self.worker.listener = Some(listener);
        self
    }

    /// Told the HTTP address once the worker is registered and its queues are declared.
    pub fn on_ready(mut self, tx: oneshot::Sender<SocketAddr>) -> Self {
        self.worker.ready = Some(tx);
        self
    }

    /// Cancelling this token ends a drain at once (a second signal): the AMQP connection is
    /// closed, unacked tasks go back to the broker, and `run` fails.
    pub fn force_shutdown(mut self, force: CancellationToken) -> Self {
        self.worker.force = force;
        self
    }

    pub fn build(self) -> Worker {
        self.worker
    }

    /// Builds and runs (see [`Worker::run`]).
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        self.build().run(shutdown).await
    }
}

impl Worker {
    pub fn builder(cfg: WorkerConfig) -> WorkerBuilder {
        WorkerBuilder {
            worker: Worker { cfg, custom: Handlers::default(), listener: None, ready: None, force: CancellationToken::new() },
        }
    }

    /// Runs until drained. Cancelling `shutdown` drains, like SIGTERM. `Ok` after a clean
    /// drain; an error for a start-up failure (unreachable config, duplicate id), a drain cut
    /// short (grace exceeded, forced) or a fatal conflict.
    pub async fn run(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let span = tracing::info_span!("worker", worker = %self.cfg.worker_id);
        self.run_inner(shutdown).instrument(span).await
    }

    async fn run_inner(self, shutdown: CancellationToken) -> anyhow::Result<()> {
        let Worker { cfg, custom, listener, ready, force } = self;
        let group = cfg.group();
        let handlers = Handlers::for_config(&cfg, custom).map_err(|e| anyhow!("executor {}: {e}", cfg.executor.as_str()))?;
        let prom = fleet::metrics::install();
        metrics::describe_counter!(crate::ledger::LEDGER_DROPPED, "Task start/finish records dropped because Redis was unreachable for too long.");
        metrics::gauge!(fleet::metrics::WORKER_INFO, "worker" => cfg.worker_id.clone(), "group" => group.clone()).set(1.0);

        let readiness = Readiness::default();
        let control = Control::new(force.clone());
        let stats = Arc::new(Stats::new());
        let ejector = Ejector::new(&cfg.eject);

        // Loops that live as long as the worker; stopped in order at the end.
        let http_stop = CancellationToken::new();
        let bg_stop = CancellationToken::new();
        let loops = TaskTracker::new();

        let listener = match listener {
            Some(l) => l,
            None => fleet::http::bind(&cfg.common.http_addr).await?,
        };
        let http_addr = listener.local_addr().context("http listener address")?;
        let identity = api::Identity {
            worker_id: cfg.worker_id.clone(),
            group: group.clone(),
            labels: cfg.labels.clone(),
            executor: cfg.executor.as_str(),
            capacity: cfg.capacity,
            critical_capacity: cfg.critical_capacity,
        };
        let router = api::router(prom, readiness.clone(), identity, control.clone(), stats.clone(), &cfg.common.auth);
        loops.spawn(fleet::http::serve(listener, router, http_stop.clone()).instrument(tracing::info_span!("http", addr = %http_addr)));
        tracing::info!(group = %group, http = %http_addr, capacity = cfg.capacity, critical_capacity = cfg.critical_capacity, executor = cfg.executor.as_str(), "starting");

        // The shutdown token (signals, tests) drains like the API does.
        {
            let control = control.clone();
            let stop = http_stop.clone();
            let shutdown = shutdown.clone();
            loops.spawn(
                async move {
                    tokio::select! {
                        _ = shutdown.cancelled() => control.request_drain("shutdown requested (signal)"),
                        _ = stop.cancelled() => {}
                    }
                }
                .in_current_span(),
            );
        }

        let amqp_stop = force.child_token();
        let broker = Arc::new(Broker::new(cfg.common.clone(), group.clone(), &cfg.worker_id, readiness.clone(), amqp_stop));
        let connected = tokio::select! {
            c = broker.connection() => c.is_some(),
            _ = control.draining() => false,
        };
        let end_early = |loops: TaskTracker, http_stop: CancellationToken| async move {
            http_stop.cancel();
            loops.close();
            loops.wait().await;
        };
        if !connected {
            broker.close("shutdown during start-up").await;
            end_early(loops, http_stop).await;
            if let Some(e) = broker.take_permanent() {
                return Err(anyhow!(e));
            }
            tracing::info!("stopped before start-up completed");
            return Ok(());
        }

        let store = Store::with_tls(&cfg.common.redis_url, cfg.common.names(), &cfg.common.redis_tls)?;
        let registrar = Registrar::new(&cfg, store.clone()).with_broker(broker.clone());
        // A predecessor with this id whose connection is closed (crashed) is provably gone:
        // take its place now rather than after its heartbeat window.
        registrar.set_takeover(broker.lock_id().await);
        if let Err(e) = store.measure_clock().await {
            tracing::debug!(error = %e, "cannot measure the clock against Redis yet");
        }
        let registered = tokio::select! {
            r = registrar.register_at_startup(&bg_stop) => r,
            _ = control.draining() => Ok(false),
        };
        match registered {
            Ok(true) => {}
            Ok(false) => {
                broker.close("shutdown during start-up").await;
                end_early(loops, http_stop).await;
                return Ok(());
            }
            Err(e) => {
                broker.close("start-up failed").await;
                end_early(loops, http_stop).await;
                return Err(match e {
                    crate::registry::RegisterError::Permanent(p) => anyhow!(p),
                    other => anyhow!(other),
                });
            }
        }
        readiness.set_redis(true);
        tracing::info!(worker = %cfg.worker_id, instance = registrar.instance(), "registered");

        // The running worker.
        let tasks = TaskTracker::new();
        let abort = CancellationToken::new();
        let (ledger, batcher) = Ledger::new(store.clone(), cfg.worker_id.clone(), registrar.instance().to_string(), group.clone(), cfg.run_lease, cfg.common.status_ttl);
        let batcher = batcher.with_figures(stats.clone());
        let gone = batcher.gone_signal();
        let ledger_stop = CancellationToken::new();
        let ledger_done = loops.spawn(batcher.run(ledger_stop.clone()).in_current_span());
        let heartbeat = Heartbeat {
            registrar: registrar.clone(),
            control: control.clone(),
            stats: stats.clone(),
            ejector: ejector.clone(),
            interval: cfg.heartbeat_interval,
            run_lease: cfg.run_lease,
            gone,
            readiness: readiness.clone(),
        };
        let heartbeat_done = loops.spawn(heartbeat.run(bg_stop.clone()).in_current_span());
        let ejector_done = loops.spawn(ejector.clone().run(cfg.eject, control.clone(), store.clone(), cfg.worker_id.clone(), bg_stop.clone()).in_current_span());

        let shared = Arc::new(Shared {
            worker_id: Arc::from(cfg.worker_id.as_str()),
            group: group.clone(),
            names: cfg.common.names(),
            handlers,
            broker: broker.clone(),
            ledger,
            stats: stats.clone(),
            ejector: ejector.clone(),
            backoff: Backoff::new(cfg.retry_base, cfg.retry_cap),
            max_task: cfg.max_task,
            max_task_bytes: fleet::envelope::internal_limit(cfg.common.max_task_bytes),
            default_max_attempts: cfg.common.default_max_attempts,
            clock: store.clock.clone(),
            isolation: Arc::new(tokio::sync::RwLock::new(())),
            tasks: tasks.clone(),
            abort: abort.clone(),
        });
        let names = cfg.common.names();
        let sharded = shard_watch(&cfg, &store, &group, &loops, &bg_stop).await;
        let mut lanes = Vec::new();
        for lane in Lane::ALL {
            let queues = match (&sharded, lane) {
                (Some(rx), Lane::Normal) => rx.clone(),
                _ => tokio::sync::watch::channel(vec![names.group_queue(&group, lane)]).1,
            };
            let consumer = LaneConsumer {
                lane,
                capacity: cfg.lane_capacity(lane),
                queues,
                shared: shared.clone(),
                broker: broker.clone(),
                control: control.clone(),
                tasks: tasks.clone(),
            };
            lanes.push(loops.spawn(consumer.run(bg_stop.clone()).in_current_span()));
        }
        drop(shared);
        if let Some(tx) = ready {
            let _ = tx.send(http_addr);
        }

        // Until a drain starts.
        control.draining().await;
        let fatal = control.fatal();
        if fatal.is_none() {
            set_state_logged(&store, &cfg.worker_id, WorkerState::Draining).await;
        }
        // The lanes see the mode change, cancel their consumers and end.
        for lane in lanes {
            let _ = lane.await;
        }
        let finish = drain::wait_for_tasks(&tasks, cfg.drain_grace, control.force()).await;
        let (n, c, _) = stats.running();
        let left = n + c;
        if finish != Finish::Clean {
            tracing::warn!(?finish, running = left, "drain cut short: closing the connection, unacked tasks go back to the broker");
            broker.close("drain cut short").await;
            abort.cancel();
            let _ = tokio::time::timeout(ABORT_WAIT, tasks.wait()).await;
        }

        // Heartbeat and ejector stop before deregistering (a late beat would register again).
        bg_stop.cancel();
        let _ = heartbeat_done.await;
        let _ = ejector_done.await;
        ledger_stop.cancel();
        let _ = ledger_done.await;
        if fatal.is_none() {
            registrar.deregister().await;
        }
        broker.close("drained").await;
        http_stop.cancel();
        loops.close();
        loops.wait().await;

        match (fatal, finish) {
            (Some(f), _) => Err(anyhow!(f)),
            (None, Finish::Clean) => {
                tracing::info!("drained");
                Ok(())
            }
            (None, Finish::GraceExceeded) => Err(anyhow!(
                "drain grace of {} ms exceeded: {left} running task(s) returned to the broker",
                cfg.drain_grace.as_millis()
            )),
            (None, Finish::Forced) => Err(anyhow!("drain interrupted: {left} running task(s) returned to the broker")),
        }
    }
}

/// For a sharded group, this worker's normal-lane shard queues (read once now, then kept up to
/// date by a [`ShardWatch`] loop on `loops` until `stop`); `None` when the lane is unsharded.
async fn shard_watch(
    cfg: &WorkerConfig,
    store: &Store,
    group: &str,
    loops: &TaskTracker,
    stop: &CancellationToken,
) -> Option<tokio::sync::watch::Receiver<Vec<String>>> {
    if cfg.common.subsetting.is_single() {
        return None;
    }
    let watch = ShardWatch {
        store: store.clone(),
        names: cfg.common.names(),
        group: group.to_string(),
        worker_id: cfg.worker_id.clone(),
        subsetting: cfg.common.subsetting,
        interval: cfg.heartbeat_interval,
    };
    let first = match watch.current().await {
        Some((ordinal, queues)) => {
            tracing::info!(ordinal, shards = ?queues, "consuming this worker's shard subset");
            queues
        }
        None => watch.all(),
    };
    let (tx, rx) = tokio::sync::watch::channel(first);
    loops.spawn(watch.run(tx, stop.clone()).instrument(tracing::info_span!("shards")));
    Some(rx)
}
