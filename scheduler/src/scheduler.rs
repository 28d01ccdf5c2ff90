//! The scheduler process: HTTP server for its whole life, and AMQP *sessions* — a connection
//! with every loop that needs it — restarted with backoff whenever the connection or any loop
//! fails. Redis failures inside a loop are retried there; only AMQP failures end a session.

use std::sync::Arc;
use std::time::Duration;

use fleet::http::Readiness;
use backon::BackoffBuilder;
use fleet::{amqp, metrics as m, topology, Lane, Store};
use tokio::net::TcpListener;
use tokio::sync::{watch, RwLock};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::api::{self, AppState, ConnectionSlot};
use crate::backpressure::{Controller, Sample};
use crate::config::SchedulerConfig;
use crate::dispatch::{Dispatcher, Source};
use crate::ingress::IngressLoop;
use crate::probe::ProbeBoard;
use crate::series::{self, Series};
use crate::stats::GroupBoard;
use crate::{backstop, health, park, probe, reclaim, schedule, stats};
use fleet::auth::Role;

/// Runs the scheduler until `shutdown` fires. `listener` serves the API and `/metrics`.
/// A [`fleet::Error::Permanent`] (login refused, a queue declared with other arguments) ends
/// it with that error.
pub async fn run(cfg: SchedulerConfig, listener: TcpListener, shutdown: CancellationToken) -> anyhow::Result<()> {
    let shutdown = shutdown.child_token();
    let cfg = Arc::new(cfg);
    let handle = m::install();
    let store = Store::with_tls(&cfg.common.redis_url, cfg.common.names(), &cfg.common.redis_tls)?;
    let ready = Readiness::default();
    let (ptx, prx) = watch::channel(Sample::default());
    let publisher: Arc<RwLock<Option<lapin::Channel>>> = Arc::new(RwLock::new(None));
    let probes: ProbeBoard = Arc::default();
    let group_board: GroupBoard = Arc::default();
    let connection: ConnectionSlot = Arc::default();
    let history = Series::default();
    let state = AppState {
        cfg: cfg.clone(),
        store: store.clone(),
        publisher: publisher.clone(),
        pressure: prx.clone(),
        probes: probes.clone(),
        groups: group_board.clone(),
        connection: connection.clone(),
        series: history.clone(),
        dead_reader: Arc::new(tokio::sync::Semaphore::new(1)),
    };
    let board = schedule::Board::default();
    let sched_api = schedule::api::ScheduleApi { cfg: cfg.clone(), store: store.clone(), board: board.clone(), publisher: publisher.clone(), pressure: prx.clone() };
    let auth = &cfg.common.auth;
    let schedule_routes = auth
        .require(schedule::api::read_routes(sched_api.clone()), Role::Read)
        .merge(auth.require(schedule::api::admin_routes(sched_api), Role::Admin))
        .layer(axum::middleware::from_fn(fleet::auth::json_only));
    let router = fleet::http::common_routes(handle.clone(), ready.clone(), auth).merge(api::routes(state)).merge(schedule_routes);
    let tracker = TaskTracker::new();
    tracker.spawn(fleet::http::serve(listener, router, shutdown.clone()));
    tracker.spawn(redis_watch(store.clone(), ready.clone(), shutdown.clone()));
    tracker.spawn(series::run(history, handle, store.clone(), cfg.series_interval, shutdown.clone()).instrument(tracing::info_span!("series")));

    let ptx = Arc::new(ptx);
    let mut result = Ok(());
    let mut backoff = amqp::reconnect_backoff().build();
    while !shutdown.is_cancelled() {
        let name = format!("fleet-scheduler {}", cfg.common.namespace);
        let conn = match amqp::connect_retrying(&cfg.common.amqp_url, &name, &cfg.common.amqp_tls, &shutdown).await {
            Ok(Some(conn)) => Arc::new(conn),
            Ok(None) => break,
            Err(e) => {
                result = Err(e);
                break;
            }
        };
        *connection.write().await = Some(conn.clone());
        let boards = (probes.clone(), group_board.clone());
        match session(cfg.clone(), store.clone(), conn.clone(), ptx.clone(), prx.clone(), publisher.clone(), boards, board.clone(), &ready, &shutdown).await {
            Ok(()) => backoff = amqp::reconnect_backoff().build(),
            Err(e @ fleet::Error::Permanent { .. }) => result = Err(e),
            Err(e) => tracing::warn!(error = %e, "AMQP session ended"),
        }
        ready.set_amqp(false);
        *publisher.write().await = None;
        *connection.write().await = None;
        let _ = conn.close(200, "bye".into()).await;
        if shutdown.is_cancelled() || result.is_err() {
            break;
        }
        metrics::counter!(m::AMQP_RECONNECTS).increment(1);
        let wait = backoff.next().unwrap_or(Duration::from_secs(5));
        tracing::warn!(retry_in_ms = wait.as_millis() as u64, "reconnecting to RabbitMQ");
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(wait) => {}
        }
    }
    // A permanent error ends the process: stop the HTTP server and the Redis watch too.
    shutdown.cancel();
    tracker.close();
    if tokio::time::timeout(Duration::from_secs(10), tracker.wait()).await.is_err() {
        tracing::warn!("some tasks did not stop within 10 s");
    }
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
async fn redis_watch(store: Store, ready: Readiness, shutdown: CancellationToken) {
    let mut was = None;
    loop {
        let probe = store.write_probe().await;
        let ok = probe.is_ok();
        ready.set_redis(ok);
        if was != Some(ok) {
            match probe {
                Ok(()) => tracing::info!("Redis takes writes"),
                Err(e) => tracing::warn!(setting = "FLEET_REDIS_URL", error = %e, "Redis refuses writes; not ready, retrying every second"),
            }
            was = Some(ok);
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
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
    publisher_slot: Arc<RwLock<Option<lapin::Channel>>>,
    (probes, group_board): (ProbeBoard, GroupBoard),
    board: schedule::Board,
    ready: &Readiness,
    shutdown: &CancellationToken,
) -> fleet::Result<()> {
    topology::probe_leader_locator(&conn, &cfg.common).await?;
    let setup = conn.create_channel().await?;
    topology::declare_core(&setup, &cfg.common).await?;
    topology::declare_ingress(&setup, &cfg.common).await?;
    let _ = setup.close(200, "ok".into()).await;
    let publisher = amqp::confirm_channel(&conn).await?;
    let api_publisher = amqp::confirm_channel(&conn).await?;
    let names = cfg.common.names();
    let schedules = schedule::log::open(&conn, &api_publisher, &names, board.clone()).await?;
    *publisher_slot.write().await = Some(api_publisher);
    ready.set_amqp(true);
    tracing::info!(namespace = %cfg.common.namespace, "connected to RabbitMQ; topology declared");

    let d = Arc::new(Dispatcher::new(cfg.clone(), store.clone(), conn.clone(), publisher));
    let session = shutdown.child_token();
    let tracker = TaskTracker::new();

    // Every loop: on error, log and end the session (the supervisor reconnects).
    macro_rules! spawn_loop {
        ($name:expr, $fut:expr) => {{
            let sd = session.clone();
            let fut = $fut;
            tracker.spawn(
                async move {
                    if let Err(e) = fut.await {
                        tracing::warn!(error = %e, "loop failed; restarting the session");
                        sd.cancel();
                    }
                }
                .instrument(tracing::info_span!("loop", name = $name)),
            );
        }};
    }

    let controller = Controller { cfg: cfg.clone(), store: store.clone(), conn: conn.clone(), tx: (*ptx).clone() };
    let sd = session.clone();
    tracker.spawn(async move { controller.run(sd).await }.instrument(tracing::info_span!("pressure")));
    for lane in Lane::ALL {
        let loops = if lane == Lane::Normal { cfg.ingress_consumers } else { 1 };
        for k in 0..loops {
            let l = IngressLoop { dispatcher: d.clone(), source: Source::Ingress(lane), queue: names.ingress_queue(lane), pressure: prx.clone() };
            spawn_loop!(format!("ingress.{lane}.{k}"), l.run(session.clone()));
        }
    }
    let delayed = IngressLoop { dispatcher: d.clone(), source: Source::Delayed, queue: names.delayed_queue(), pressure: prx.clone() };
    spawn_loop!("delayed", delayed.run(session.clone()));
    let park_loops = Arc::new(park::ParkLoops::default());
    spawn_loop!("park-discovery", park::discover(d.clone(), park_loops.clone(), tracker.clone(), session.clone()));
    spawn_loop!("reclaim", reclaim::run(d.clone(), park_loops, probes.clone(), session.clone()));
    spawn_loop!("health", health::run(d.clone(), session.clone()));
    spawn_loop!("backstop", backstop::run(d.clone(), session.clone()));
    spawn_loop!("stats", stats::run(d.clone(), group_board, session.clone()));
    spawn_loop!("probe", probe::run(d.clone(), probes, session.clone()));
    spawn_loop!("schedule-log", schedules.run(session.clone()));
    let firing = schedule::fire::Firing {
        cfg: cfg.clone(),
        store: store.clone(),
        board,
        publisher: amqp::confirm_channel(&conn).await?,
        pressure: prx.clone(),
        replica: uuid::Uuid::new_v4().simple().to_string(),
    };
    spawn_loop!("schedule-fire", firing.run(session.clone()));

    session.cancelled().await;
    tracker.close();
    if tokio::time::timeout(Duration::from_secs(10), tracker.wait()).await.is_err() {
        tracing::warn!("session loops did not stop within 10 s");
    }
    if shutdown.is_cancelled() {
        Ok(())
    } else {
        Err(fleet::Error::Other("session ended".into()))
    }
}
