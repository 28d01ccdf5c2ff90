//! The scheduler process: HTTP server for its whole life, and AMQP *sessions* — a connection
//! with every loop that needs it — restarted with backoff whenever the connection or any loop
//! fails. Redis failures inside a loop are retried there; only AMQP failures end a session.
//! A session's loops share a [`Session`] (connection, publishing channel, store, names,
//! config); those that dispatch share a [`Dispatcher`] over it, and those that look at every
//! group read the session's [fleet view](crate::view).
//!
//! Two shutdown stages ([`fleet::process`]): the process's (HTTP, Redis watch, series), built
//! first and stopped last, and each session's (every AMQP loop), stopped when the session
//! ends. Every loop is a struct with `async fn run(self, shutdown)`, spawned on its stage in a
//! span of its name.

use std::sync::Arc;
use std::time::Duration;

use backon::BackoffBuilder;
use fleet::http::Readiness;
use fleet::process::Stage;
use fleet::process::Ticker;
use fleet::{broker::amqp, broker::topology, metrics as m, Lane, Store};
use tokio::net::TcpListener;
use tokio::sync::{watch, RwLock};
use tokio_util::sync::CancellationToken;

use crate::api::{self, AppState, ConnectionSlot};
use crate::backpressure::{Controller, Sample};
use crate::config::SchedulerConfig;
use crate::dispatch::{Dispatcher, Source};
use crate::ingress::IngressLoop;
use crate::probe::ProbeBoard;
use crate::series::{self, Series};
use crate::session::Session;
use crate::stats::GroupBoard;
use crate::{backstop, health, park, probe, reclaim, schedule, stats, view};

/// How long the loops of a stage get to stop before the scheduler goes on without them.
const STOP_WAIT: Duration = Duration::from_secs(10);
/// How long a connection close is awaited: a broker that does not answer (paused,
/// partitioned) must not keep the scheduler from exiting or reconnecting.
const CLOSE_WAIT: Duration = Duration::from_secs(5);
/// How often Redis is checked for taking writes.
const REDIS_WATCH: Duration = Duration::from_secs(1);
use fleet::settings::Role;

/// Runs the scheduler until `shutdown` fires. `listener` serves the API and `/metrics`.
/// A [`fleet::Error::Permanent`] (login refused, a queue declared with other arguments) ends
/// it with that error.
pub async fn run(
    cfg: SchedulerConfig,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    // The process stage: its signal is a child of `shutdown`, so a permanent error can end the
    // process without touching the caller's token.
    let process = Stage::with_parent("process", &shutdown);
    let shutdown = process.token();
    let cfg = Arc::new(cfg);
    let handle = m::install();
    let store = Store::with_tls(
        &cfg.common.redis_url,
        cfg.common.names(),
        &cfg.common.redis_tls,
    )?;
    let ready = Readiness::default();
    let (ptx, prx) = watch::channel(Sample::default());
    let publisher: Arc<RwLock<Option<fleet::broker::amqp::Publisher>>> =
        Arc::new(RwLock::new(None));
    let probes: ProbeBoard = Arc::default();
    let group_board: GroupBoard = Arc::default();
    let scaling_board = crate::scaling::Board::new(Some(handle.clone()));
    let connection: ConnectionSlot = Arc::default();
    let history = Series::default();
    let pauses = crate::pause::Pauses::default();
    pauses.set_key_settings(cfg.key_limits.clone());
    let audit = fleet::control::AuditLog::default();
    let batches = fleet::batch::Batches::default();
    // The process's one prober (passive declares of queues that may be missing: the API's
    // and every session's), closed with the process.
    let prober = Arc::new(fleet::broker::probe::Prober::new(
        &cfg.common.amqp_url,
        &format!("fleet-scheduler {}", cfg.common.namespace),
        &cfg.common.amqp_tls,
    ));
    let state = AppState {
        pauses: pauses.clone(),
        cfg: cfg.clone(),
        store: store.clone(),
        publisher: publisher.clone(),
        pressure: prx.clone(),
        probes: probes.clone(),
        groups: group_board.clone(),
        connection: connection.clone(),
        series: history.clone(),
        dead_reader: Arc::new(tokio::sync::Semaphore::new(1)),
        renewal: Arc::default(),
        audit: audit.clone(),
        batches: batches.clone(),
        probe: prober.clone(),
    };
    let board = schedule::Board::default();
    let sched_api = schedule::api::ScheduleApi {
        cfg: cfg.clone(),
        store: store.clone(),
        board: board.clone(),
        publisher: publisher.clone(),
        pressure: prx.clone(),
    };
    let auth = &cfg.common.auth;
    let schedule_routes = auth
        .require(schedule::api::read_routes(sched_api.clone()), Role::Read)
        .merge(auth.require(schedule::api::admin_routes(sched_api), Role::Admin));
    // `GET /v1/scaling` keeps its own state (the stats loop's autoscaling figures).
    let scaling_routes =
        auth.host_check(auth.require(crate::scaling::routes(scaling_board.clone()), Role::Read));
    let router = fleet::http::common_routes(handle.clone(), ready.clone(), auth)
        .merge(api::routes(state))
        .merge(scaling_routes)
        .merge(schedule_routes);
    process.spawn(
        tracing::info_span!("http"),
        fleet::http::serve(listener, router, shutdown.clone()),
    );
    process.spawn(
        tracing::info_span!("redis-watch"),
        RedisWatch {
            store: store.clone(),
            ready: ready.clone(),
        }
        .run(shutdown.clone()),
    );
    let recorder = series::Recorder::new(history, handle, store.clone(), cfg.series_interval);
    process.spawn(
        tracing::info_span!("series"),
        recorder.run(shutdown.clone()),
    );

    let ptx = Arc::new(ptx);
    let mut result = Ok(());
    let mut backoff = amqp::reconnect_backoff().build();
    while !shutdown.is_cancelled() {
        let name = format!("fleet-scheduler {}", cfg.common.namespace);
        let conn = match amqp::connect_retrying(
            &cfg.common.amqp_url,
            &name,
            &cfg.common.amqp_tls,
            &shutdown,
        )
        .await
        {
            Ok(Some(conn)) => Arc::new(conn),
            Ok(None) => break,
            Err(e) => {
                result = Err(e);
                break;
            }
        };
        *connection.write().await = Some(conn.clone());
        let boards = (
            probes.clone(),
            group_board.clone(),
            pauses.clone(),
            scaling_board.clone(),
        );
        match session(
            cfg.clone(),
            store.clone(),
            conn.clone(),
            ptx.clone(),
            prx.clone(),
            publisher.clone(),
            boards,
            board.clone(),
            (audit.clone(), batches.clone()),
            prober.clone(),
            &ready,
            &shutdown,
        )
        .await
        {
            Ok(()) => backoff = amqp::reconnect_backoff().build(),
            Err(e @ fleet::Error::Permanent { .. }) => result = Err(e),
            Err(e) => tracing::warn!(error = %e, "AMQP session ended"),
        }
        ready.set_amqp(false);
        *publisher.write().await = None;
        *connection.write().await = None;
        if tokio::time::timeout(CLOSE_WAIT, conn.close(200, "bye".into()))
            .await
            .is_err()
        {
            tracing::warn!(
                limit_ms = CLOSE_WAIT.as_millis() as u64,
                "RabbitMQ did not answer the connection close; going on without it"
            );
        }
        if shutdown.is_cancelled() || result.is_err() {
            break;
        }
        metrics::counter!(m::AMQP_RECONNECTS).increment(1);
        let wait = backoff.next().unwrap_or(Duration::from_secs(5));
        tracing::warn!(
            retry_in_ms = wait.as_millis() as u64,
            "reconnecting to RabbitMQ"
        );
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(wait) => {}
        }
    }
    // A permanent error ends the process: stop the HTTP server and the Redis watch too.
    process.stop_within(STOP_WAIT).await;
    // After the HTTP server and every session: one that asked the prober again would have
    // reopened its connection.
    prober.close().await;
    match result {
        Ok(()) => {
            tracing::info!("scheduler stopped");
            Ok(())
        }
        Err(e) => Err(e.into()),
    }
}

/// Keeps the Redis readiness flag true while Redis takes writes (a write probe every second:
/// a read-only Redis answers PING but can do no work). Logs each change once.
struct RedisWatch {
    store: Store,
    ready: Readiness,
}

impl RedisWatch {
    async fn run(self, shutdown: CancellationToken) {
        let mut ticker = Ticker::new(REDIS_WATCH);
        let mut was = None;
        loop {
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => break,
                _ = ticker.next() => self.tick(&mut was).await,
            }
        }
    }

    /// One probe; `was` is the previous answer (a change is logged).
    async fn tick(&self, was: &mut Option<bool>) {
        let probe = self.store.write_probe().await;
        let ok = probe.is_ok();
        self.ready.set_redis(ok);
        if *was != Some(ok) {
            match probe {
                Ok(()) => tracing::info!("Redis takes writes"),
                Err(e) => {
                    // What failed decides the words: a refused connection is no refused write.
                    let what = fleet::redis::Failure::of(&e).describe();
                    tracing::warn!(setting = "FLEET_REDIS_URL", error = %e, "{what}; not ready, retrying every second")
                }
            }
            *was = Some(ok);
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn session(
    cfg: Arc<SchedulerConfig>,
    store: Store,
    conn: Arc<lapin::Connection>,
    ptx: Arc<watch::Sender<Sample>>,
    prx: watch::Receiver<Sample>,
    publisher_slot: Arc<RwLock<Option<fleet::broker::amqp::Publisher>>>,
    (probes, group_board, pauses, scaling): (
        ProbeBoard,
        GroupBoard,
        crate::pause::Pauses,
        crate::scaling::Board,
    ),
    board: schedule::Board,
    (audit, batches): (fleet::control::AuditLog, fleet::batch::Batches),
    prober: Arc<fleet::broker::probe::Prober>,
    ready: &Readiness,
    shutdown: &CancellationToken,
) -> fleet::Result<()> {
    let names = cfg.common.names();
    // The set-up waits on the broker (declares, a confirm on the schedules stream, whose
    // leader may be missing) on a live connection that heartbeats would never end: a stop
    // ends it instead.
    let setup = async {
        topology::probe_leader_locator(&conn, &cfg.common).await?;
        let setup = conn.create_channel().await?;
        topology::declare_core(&setup, &cfg.common).await?;
        topology::declare_ingress(&setup, &cfg.common).await?;
        let _ = setup.close(200, "ok".into()).await;
        let publisher = amqp::confirm_channel(&conn).await?;
        let api_publisher = amqp::confirm_channel(&conn).await?;
        let schedules = schedule::log::open(&conn, &api_publisher, &names, board.clone()).await?;
        // Opened before any loop is spawned: a failure here returns with nothing running.
        let tier_ch = crate::tiers::channel(&conn).await?;
        let fire_publisher = amqp::confirm_channel(&conn).await?;
        Ok::<_, fleet::Error>((publisher, api_publisher, schedules, tier_ch, fire_publisher))
    };
    let (publisher, api_publisher, schedules, tier_ch, fire_publisher) = tokio::select! {
        r = setup => r?,
        _ = shutdown.cancelled() => return Ok(()),
    };
    *publisher_slot.write().await = Some(api_publisher);
    tracing::info!(namespace = %cfg.common.namespace, "connected to RabbitMQ; topology declared");

    // What the session's loops share, and the dispatch logic over it.
    let shared = Arc::new(Session::new(
        cfg.clone(),
        store.clone(),
        conn.clone(),
        publisher,
        pauses.clone(),
        prober,
    ));
    // The park queues this session declares (the dispatcher parks tasks in them, the view
    // reads their depths, discovery and reclaim manage them), and the dispatch logic.
    let park_queues = Arc::new(park::Queues::new(shared.clone()));
    let d = Arc::new(Dispatcher::new(shared.clone(), park_queues.clone()));
    // The session's stage: ends with the process, or when any of its loops fails.
    let session = Stage::with_parent("session", shutdown);

    // Every loop: on error, log and end the session (the supervisor reconnects).
    macro_rules! spawn_loop {
        ($name:expr, $loop:expr) => {{
            let sd = session.token();
            let fut = $loop.run(session.token());
            session.spawn(tracing::info_span!("loop", name = $name), async move {
                if let Err(e) = fut.await {
                    tracing::warn!(error = %e, "loop failed; restarting the session");
                    sd.cancel();
                }
            });
        }};
    }

    // One view of the fleet (groups, queue depths) per tick, read by pressure, health, probes,
    // stats, park discovery and reclaim.
    let (view_tx, view) = view::channel();
    spawn_loop!(
        "view",
        view::ViewLoop {
            session: shared.clone(),
            tx: view_tx,
            declared: park_queues.clone(),
        }
    );
    let controller = Controller {
        session: shared.clone(),
        view: view.clone(),
        tx: (*ptx).clone(),
    };
    session.spawn(
        tracing::info_span!("pressure"),
        controller.run(session.token()),
    );
    // The control stream first: nothing dispatches before this session has read it up to its
    // own barrier (the pauses in force: a restart must not dispatch paused work).
    let (caught_tx, mut caught_rx) = watch::channel(false);
    spawn_loop!(
        "control",
        crate::control::ControlLoop {
            store: store.clone(),
            conn: conn.clone(),
            cancels: fleet::control::Cancels::default(),
            audit,
            status_ttl: cfg.common.status_ttl,
            pauses: pauses.clone(),
            caught_up: caught_tx,
            batches: batches.clone(),
        }
    );
    let closes = Arc::new(crate::batch_close::Closes {
        session: shared.clone(),
        batches: batches.clone(),
    });
    let stop = session.token();
    let caught_up = tokio::select! {
        r = caught_rx.wait_for(|c| *c) => r.is_ok(),
        _ = stop.cancelled() => false,
    };
    // Ready once the pauses in force are known: the API answers them, and dispatch starts.
    ready.set_amqp(caught_up);
    if !caught_up {
        session.stop_within(STOP_WAIT).await;
        return if shutdown.is_cancelled() {
            Ok(())
        } else {
            Err(fleet::Error::SessionEnded)
        };
    }
    for lane in Lane::ALL {
        let loops = if lane == Lane::Normal {
            cfg.ingress_consumers
        } else {
            1
        };
        for k in 0..loops {
            let l = IngressLoop {
                dispatcher: d.clone(),
                source: Source::Ingress(lane),
                queue: names.ingress_queue(lane),
                pressure: prx.clone(),
                canary: None,
                closes: Some(closes.clone()),
            };
            spawn_loop!(format!("ingress.{lane}.{k}"), l);
        }
    }
    // The delay canary (issue 37 item 1): a stuck delay path shows in a gauge and a warning.
    let canary = crate::canary::Canary::new();
    let delayed = IngressLoop {
        dispatcher: d.clone(),
        source: Source::Delayed,
        queue: names.delayed_queue(),
        pressure: prx.clone(),
        canary: Some(canary.clone()),
        closes: None,
    };
    spawn_loop!("delayed", delayed);
    for tier in fleet::broker::delay::tiers() {
        spawn_loop!(
            format!("tier.{tier}"),
            crate::tiers::TierLoop {
                session: shared.clone(),
                tier,
                ch: tier_ch.clone(),
            }
        );
    }
    spawn_loop!(
        "delay-canary",
        crate::canary::CanaryLoop {
            session: shared.clone(),
            canary,
        }
    );
    let park_loops = Arc::new(park::ParkLoops::default());
    let discovery = park::Discovery {
        queues: park_queues.clone(),
        dispatcher: d.clone(),
        loops: park_loops.clone(),
        stage: session.clone(),
        view: view.clone(),
    };
    spawn_loop!("park-discovery", discovery);
    spawn_loop!(
        "reclaim",
        reclaim::Reclaimer {
            session: shared.clone(),
            loops: park_loops,
            queues: park_queues,
            probes: probes.clone(),
            view: view.clone()
        }
    );
    spawn_loop!(
        "health",
        health::HealthCheck {
            session: shared.clone(),
            dispatcher: d.clone(),
            view: view.clone()
        }
    );
    spawn_loop!(
        "index-trim",
        crate::index_trim::IndexTrim {
            session: shared.clone()
        }
    );
    spawn_loop!(
        "backstop",
        backstop::Backstop {
            session: shared.clone()
        }
    );
    spawn_loop!(
        "stats",
        stats::Sampler {
            session: shared.clone(),
            board: group_board,
            view: view.clone(),
            scaling
        }
    );
    spawn_loop!(
        "probe",
        probe::Prober {
            session: shared.clone(),
            board: probes,
            view
        }
    );
    spawn_loop!("schedule-log", schedules);
    let firing = schedule::fire::Firing {
        cfg: cfg.clone(),
        store: store.clone(),
        board,
        publisher: fire_publisher,
        pressure: prx.clone(),
        replica: uuid::Uuid::new_v4().simple().to_string(),
    };
    spawn_loop!("schedule-fire", firing);
    // After the control stream's barrier (above): it knows every callback fired before.
    spawn_loop!(
        "batch",
        crate::batch::BatchLoop {
            store: store.clone(),
            conn: conn.clone(),
            batches,
            pressure: prx.clone(),
            status_ttl: cfg.common.status_ttl,
            pauses,
        }
    );

    session.stopping().await;
    session.stop_within(STOP_WAIT).await;
    if shutdown.is_cancelled() {
        Ok(())
    } else {
        Err(fleet::Error::SessionEnded)
    }
}
