//! The [`Worker`]: build → start (spawn) → drain, the shape of linkerd2-proxy's `main.rs`
//! (`let drain = app.spawn(); … drain.drain().await`).
//!
//! ```text
//! start:   HTTP up (healthz) → RabbitMQ (retrying; topology) → Redis registration (retrying;
//!          a live duplicate id is fatal) → loops spawned on their stages → ready → [`Running`]
//! running: lane normal ┐                  ┌ ledger (batched start/finish to Redis)
//!          lane critical┴─ task attempts ─┤ heartbeat (+ state poll, re-registration)
//!                                         ├ ejection (outlier cool-down)
//!                                         └ shard watch (sharded groups)
//! drain:   [`Running::drain`]: the sequence in [`crate::drain`] — consumers cancelled →
//!          running tasks finished within the grace → loops stopped → ledger flushed →
//!          deregistered → connection closed → HTTP stopped
//! ```

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use fleet::http::Readiness;
use fleet::process::Stage;
use fleet::redis::Store;
use fleet::{Lane, PerLane};

use crate::api;
use crate::attempt::{Meters, Shared};
use crate::broker::Broker;
use crate::config::WorkerConfig;
use crate::drain::{Control, Drain, Stages};
use crate::eject::{Ejection, Ejector};
use crate::executor::{Handler, Handlers};
use crate::heartbeat::Heartbeat;
use crate::lane::LaneConsumer;
use crate::ledger::Ledger;
use crate::registry::Registrar;
use crate::retry::Backoff;
use crate::shards::ShardWatch;
use crate::stats::Stats;

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
    ///
    /// # Errors
    /// As [`Worker::run`].
    pub async fn run(self, shutdown: CancellationToken) -> crate::Result<()> {
        self.build().run(shutdown).await
    }

    /// Builds and starts (see [`Worker::start`]).
    ///
    /// # Errors
    /// As [`Worker::start`].
    pub async fn start(self, shutdown: CancellationToken) -> crate::Result<Option<Running>> {
        self.build().start(shutdown).await
    }
}

impl Worker {
    pub fn builder(cfg: WorkerConfig) -> WorkerBuilder {
        WorkerBuilder {
            worker: Worker {
                cfg,
                custom: Handlers::default(),
                listener: None,
                ready: None,
                force: CancellationToken::new(),
            },
        }
    }

    /// Starts, waits for a drain to be requested, and drains with `drain_grace_ms`: cancelling
    /// `shutdown` drains, like SIGTERM. `Ok` after a clean drain (or a stop during start-up).
    ///
    /// # Errors
    /// A start-up failure (as [`Worker::start`]) or a drain that was not clean (as
    /// [`Running::drain`]).
    pub async fn run(self, shutdown: CancellationToken) -> crate::Result<()> {
        let grace = self.cfg.drain_grace;
        let Some(running) = self.start(shutdown).await? else {
            return Ok(());
        };
        running.draining().await;
        running.drain(grace).await
    }

    /// Starts the worker: HTTP, RabbitMQ, registration, then every loop spawned on its stage
    /// (see [`crate::drain`]). Returns once it consumes, or `Ok(None)` when a drain was asked
    /// for during start-up (nothing is left running then). Cancelling `shutdown` later asks for
    /// a drain, like `POST /drain`.
    ///
    /// # Errors
    /// [`Error::Executor`](crate::Error::Executor) for a bad executor setting;
    /// [`Error::Fleet`](crate::Error::Fleet) for an HTTP address that cannot be bound
    /// (`fleet::Error::Config`) or a permanent broker or Redis refusal
    /// (`fleet::Error::Permanent`); [`Error::DuplicateId`](crate::Error::DuplicateId) when
    /// another live process holds the id.
    pub async fn start(self, shutdown: CancellationToken) -> crate::Result<Option<Running>> {
        let span = tracing::info_span!("worker", worker = %self.cfg.worker_id);
        let drain = self.start_inner(shutdown).instrument(span.clone()).await?;
        Ok(drain.map(|drain| Running { span, drain }))
    }

    async fn start_inner(self, shutdown: CancellationToken) -> crate::Result<Option<Drain>> {
        let Worker {
            cfg,
            custom,
            listener,
            ready,
            force,
        } = self;
        let group = cfg.group();
        let handlers =
            Handlers::for_config(&cfg, custom).map_err(|message| crate::Error::Executor {
                executor: cfg.executor.as_str(),
                message,
            })?;
        let prom = fleet::metrics::install();
        metrics::describe_counter!(
            crate::ledger::LEDGER_DROPPED,
            "Task start/finish records dropped because Redis was unreachable for too long."
        );
        metrics::gauge!(fleet::metrics::WORKER_INFO, "worker" => cfg.worker_id.clone(), "group" => group.clone()).set(1.0);

        let readiness = Readiness::default();
        let control = Control::new(force.clone());
        let stats = Arc::new(Stats::new());
        let ejector = Ejector::new(&cfg.eject);
        let stages = Stages::new();

        // Serve: HTTP, and the shutdown token turned into a drain request.
        let listener = match listener {
            Some(l) => l,
            None => fleet::http::bind(&cfg.common.http_addr).await?,
        };
        let http_addr = listener.local_addr().map_err(crate::Error::Listener)?;
        let identity = api::Identity {
            worker_id: cfg.worker_id.clone(),
            group: group.clone(),
            labels: cfg.labels.clone(),
            executor: cfg.executor.as_str(),
            capacity: cfg.capacity,
        };
        let router = api::router(
            prom,
            readiness.clone(),
            identity,
            control.clone(),
            stats.clone(),
            &cfg.common.auth,
        );
        stages.serve.spawn(
            tracing::info_span!("http", addr = %http_addr),
            fleet::http::serve(listener, router, stages.serve.token()),
        );
        tracing::info!(group = %group, http = %http_addr, capacity = cfg.capacity.normal, critical_capacity = cfg.capacity.critical, executor = cfg.executor.as_str(), "starting");
        let requests = DrainRequests {
            shutdown,
            control: control.clone(),
        };
        stages
            .serve
            .spawn(tracing::Span::current(), requests.run(stages.serve.token()));

        // RabbitMQ (the force token ends its reconnecting).
        let broker = Arc::new(Broker::new(
            cfg.common.clone(),
            group.clone(),
            &cfg.worker_id,
            readiness.clone(),
            force.child_token(),
        ));
        let connected = tokio::select! {
            biased;
            _ = control.draining() => false,
            c = broker.connection() => c.is_some(),
        };
        if !connected {
            broker.close("shutdown during start-up").await;
            stages.all.stop().await;
            if let Some(e) = broker.take_permanent() {
                return Err(e.into());
            }
            tracing::info!("stopped before start-up completed");
            return Ok(None);
        }

        // Redis registration.
        let store = Store::with_tls(
            &cfg.common.redis_url,
            cfg.common.names(),
            &cfg.common.redis_tls,
        )?;
        let kinds = handlers.kinds();
        tracing::info!(kinds = %kinds, "task kinds advertised (FLEET_KINDS)");
        let registrar = Registrar::new(&cfg, store.clone(), kinds).with_broker(broker.clone());
        // A predecessor with this id whose connection is closed (crashed) is provably gone:
        // take its place now rather than after its heartbeat window.
        registrar.set_takeover(broker.lock_id().await);
        if let Err(e) = store.measure_clock().await {
            tracing::debug!(error = %e, "cannot measure the clock against Redis yet");
        }
        let stop = stages.background.token();
        let registered = tokio::select! {
            biased;
            _ = control.draining() => Ok(false),
            r = registrar.register_at_startup(&stop) => r,
        };
        let failed = match registered {
            Ok(true) => None,
            Ok(false) => Some(("shutdown during start-up", None)),
            Err(crate::registry::RegisterError::Permanent(p)) => {
                Some(("start-up failed", Some(crate::Error::Fleet(p))))
            }
            Err(crate::registry::RegisterError::Duplicate(m)) => {
                Some(("start-up failed", Some(crate::Error::DuplicateId(m))))
            }
        };
        if let Some((why, error)) = failed {
            broker.close(why).await;
            stages.all.stop().await;
            return error.map_or(Ok(None), Err);
        }
        readiness.set_redis(true);
        tracing::info!(worker = %cfg.worker_id, instance = registrar.instance(), "registered");

        // Ledger.
        let (ledger, batcher) = Ledger::new(
            store.clone(),
            cfg.worker_id.clone(),
            registrar.instance().to_string(),
            group.clone(),
            cfg.run_lease,
            cfg.common.status_ttl,
        );
        let batcher = batcher.with_figures(stats.clone());
        let gone = batcher.gone_signal();
        stages.ledger.spawn(
            tracing::info_span!("ledger"),
            batcher.run(stages.ledger.token()),
        );

        // Background: heartbeat, ejection, shard watch.
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
        stages.background.spawn(
            tracing::info_span!("heartbeat"),
            heartbeat.run(stages.background.token()),
        );
        let ejection = Ejection {
            ejector: ejector.clone(),
            cfg: cfg.eject,
            control: control.clone(),
            store: store.clone(),
            worker_id: cfg.worker_id.clone(),
        };
        stages.background.spawn(
            tracing::info_span!("eject"),
            ejection.run(stages.background.token()),
        );
        let sharded = shard_watch(&cfg, &store, &group, &stages.background).await;

        // Cancels: the control stream, followed for as long as the worker runs anything.
        let cancels = Arc::new(crate::cancel::CancelBoard::default());
        let follower = crate::cancel::Follower {
            broker: broker.clone(),
            names: cfg.common.names(),
            board: cancels.clone(),
            drain: Some((cfg.worker_id.clone(), store.clock.now_ms(), control.clone())),
        };
        stages.background.spawn(
            tracing::info_span!("cancels"),
            follower.run(stages.background.token()),
        );

        // Work and intake: the lanes and the attempts they spawn.
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
            max_task_bytes: fleet::task::internal_limit(cfg.common.max_task_bytes),
            default_max_attempts: cfg.common.default_max_attempts,
            clock: store.clock.clone(),
            isolation: Arc::new(tokio::sync::RwLock::new(())),
            work: stages.work.clone(),
            meters: PerLane {
                normal: Meters::new(&group, Lane::Normal),
                critical: Meters::new(&group, Lane::Critical),
            },
            nudge: crate::nudge::Nudge::start(),
            cancels: cancels.clone(),
            cancel_grace: cfg.cancel_grace,
        });
        let names = cfg.common.names();
        for lane in Lane::ALL {
            let queues = match (&sharded, lane) {
                (Some(rx), Lane::Normal) => rx.clone(),
                _ => tokio::sync::watch::channel(vec![names.group_queue(&group, lane)]).1,
            };
            let consumer = LaneConsumer {
                lane,
                capacity: cfg.capacity[lane],
                queues,
                shared: shared.clone(),
                broker: broker.clone(),
                control: control.clone(),
                work: stages.work.clone(),
            };
            stages.intake.spawn(
                tracing::info_span!("lane", lane = %lane),
                consumer.run(stages.intake.token()),
            );
        }
        drop(shared);
        if let Some(tx) = ready {
            let _ = tx.send(http_addr);
        }
        Ok(Some(Drain {
            control,
            stages,
            store,
            worker_id: cfg.worker_id.clone(),
            registrar,
            broker,
            stats,
        }))
    }
}

/// A started worker: its loops run until [`Running::drain`].
pub struct Running {
    span: tracing::Span,
    drain: Drain,
}

impl Running {
    /// Resolves once a drain has been asked for: the `shutdown` token of [`Worker::start`],
    /// `POST /drain`, the state `draining` set in Redis, or a fatal conflict.
    ///
    /// # Cancel safety
    /// Cancel safe: it only waits; dropped, it has changed nothing.
    pub async fn draining(&self) {
        self.drain.control.draining().await
    }

    /// Asks for a drain (idempotent: the first reason is kept and logged).
    pub fn request_drain(&self, reason: &str) {
        self.drain.control.request_drain(reason)
    }

    /// Drains as a lame duck (asking for it first if nobody did; see [`crate::drain`]), running
    /// tasks getting `grace` to finish. `Ok` after a clean drain.
    ///
    /// # Errors
    /// Running tasks returned to the broker: [`Error::GraceExceeded`](crate::Error::GraceExceeded)
    /// or, for the force token, [`Error::Interrupted`](crate::Error::Interrupted); a fatal
    /// conflict while it ran: [`Error::Fatal`](crate::Error::Fatal).
    pub async fn drain(self, grace: Duration) -> crate::Result<()> {
        self.drain.control.request_drain("drain requested");
        self.drain.run(grace).instrument(self.span).await
    }
}

/// Turns the `shutdown` token (signals, tests) into a drain request, like `POST /drain`.
struct DrainRequests {
    shutdown: CancellationToken,
    control: Control,
}

impl DrainRequests {
    async fn run(self, stop: CancellationToken) {
        tokio::select! {
            biased;
            _ = stop.cancelled() => {}
            _ = self.shutdown.cancelled() => self.control.request_drain("shutdown requested (signal)"),
        }
    }
}

/// For a sharded group, this worker's normal-lane shard queues (read once now, then kept up to
/// date by a [`ShardWatch`] loop on `stage`); `None` when the lane is unsharded.
async fn shard_watch(
    cfg: &WorkerConfig,
    store: &Store,
    group: &str,
    stage: &Stage,
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
    stage.spawn(tracing::info_span!("shards"), watch.run(tx, stage.token()));
    Some(rx)
}
