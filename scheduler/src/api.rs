//! The scheduler's HTTP API.
//!
//! * `POST /v1/tasks` — one envelope or an array → 202 `{"ids": [...]}`; 400 with the reason
//!   (and the index in an array). Admission is the AMQP producers' rule: every task is
//!   published to the bounded ingress with confirms, and only a broker refusal (ingress at its
//!   bound) refuses it — 429 + `Retry-After` when the intake gate is Red (the fleet is behind),
//!   503 + `Retry-After` otherwise; the body lists `accepted` and `refused` ids. The published
//!   pressure state (which counts the ingress backlog) never refuses by itself. The optional
//!   submission rate limit (`FLEET_SUBMIT_RATE`) also answers 429.
//! * `GET /v1/tasks/{id}`, `GET /v1/workers`, `GET /v1/groups`, `GET /v1/pressure`,
//!   `POST /v1/workers/{id}/drain` (404 for an unknown worker).
//! * `POST /v1/tasks/{id}/cancel` (`cancel`): 202 a promise, 200 again, 409 ended, 404.
//! * Pauses (`pause`): `GET /v1/pauses`, `POST /v1/pauses`, `POST /v1/pauses/resume`.
//! * Fairness keys (`keys`): `GET /v1/keys`, `GET /v1/keys/{key}`, `PUT /v1/keys/{key}/limits`
//!   (`*` for the default spec). A submit token bound to a key (`key=K` in
//!   `FLEET_API_TOKENS`) sets every task's `key` it submits.
//! * Dead letters (`dead`): `GET /v1/dead`, `GET /v1/dead/{id}`, `POST /v1/dead/replay`.
//! * The task list and bulk actions (`tasks`): `GET /v1/tasks?state=&group=&kind=&label=&since=&until=&cursor=&limit=`,
//!   `POST /v1/tasks/bulk` (cancel, retry, delete by ids or query, with a dry run).
//! * `GET /v1/series`: the last 15 minutes of throughput and wait time ([`crate::series`]).
//! * `GET /v1/scaling`: the autoscaling figures, mounted beside these routes with their own
//!   state ([`crate::scaling::routes`]).
//! * Batches (`batches`): `POST /v1/batches`, `GET /v1/batches/{id}` ([`fleet::batch`]);
//!   a batch as a whole (`batch_control`): `POST /v1/batches/{id}/cancel`.
//! * The web console at `/ui` ([`crate::console`]).
//!
//! Roles ([`fleet::settings`], when tokens are configured): see [`routes`]. A POST without
//! `Content-Type: application/json` gets 415.

mod audit_log;
mod batch_control;
mod batches;
mod cancel;
mod dead;
mod keys;
mod pause;
mod tasks;

pub(crate) use audit_log::{audit, audit_to, caller, caller_of};

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use fleet::registry::WorkerState;
use fleet::settings::{ApiAuth, Role};
use fleet::{broker::amqp, metrics as m, Envelope, Lane, Store};
use serde_json::{json, Value};
use tokio::sync::{watch, RwLock};

use crate::backpressure::{Pressure, Sample};
use crate::config::SchedulerConfig;
use crate::probe::ProbeBoard;
use crate::series::Series;
use crate::stats::GroupBoard;

/// The current session's AMQP connection (None while reconnecting).
pub type ConnectionSlot = Arc<RwLock<Option<Arc<lapin::Connection>>>>;

#[derive(Clone)]
pub struct AppState {
    pub cfg: Arc<SchedulerConfig>,
    pub store: Store,
    /// The current session's confirm channel (None while reconnecting).
    pub publisher: Arc<RwLock<Option<fleet::broker::amqp::Publisher>>>,
    pub pressure: watch::Receiver<Sample>,
    pub probes: ProbeBoard,
    /// Backlog, parked and oldest age per group, from the stats loop.
    pub groups: GroupBoard,
    pub connection: ConnectionSlot,
    pub series: Series,
    /// One dead-queue reader at a time: a listing holds the letters it reads until it ends,
    /// and a replay running beside it would not see them.
    pub dead_reader: Arc<tokio::sync::Semaphore>,
    /// Renews the API's publishing channel after [`amqp::RENEW_AFTER`] of submissions nacked
    /// below the ingress bound ([`amqp::Renewal`], the dispatcher's mechanism too).
    pub renewal: Arc<amqp::Renewal>,
    /// The pauses in force in this process ([`crate::pause`]).
    pub pauses: crate::pause::Pauses,
    /// The audit log as this replica read it from the control stream ([`fleet::control`]).
    pub audit: fleet::control::AuditLog,
    /// The batches as this replica read them from the control stream ([`fleet::batch`]).
    pub batches: fleet::batch::Batches,
    /// The process's prober, which the sessions share: the API asks it a nacked submission's
    /// queue depth ([`fleet::broker::probe`]).
    pub probe: Arc<fleet::broker::probe::Prober>,
}

/// The API routes, each behind its role when tokens are configured ([`fleet::settings`]): submit
/// needs `submit`; status, workers, groups, pressure, series and dead-letter reads need `read`;
/// drain, replay, cancel, pause and resume need `admin` (`GET /v1/pauses`: `read`); every POST must be JSON (415 otherwise, checked after the
/// token: [`ApiAuth::require`]). The console's assets are public (they hold no data). Without
/// tokens, a request whose `Host` is not `localhost`, an IP address or a name of
/// `FLEET_API_ALLOWED_HOSTS` gets 421, API and console alike ([`fleet::settings`]).
pub fn routes(state: AppState) -> Router {
    let auth: ApiAuth = state.cfg.common.auth.clone();
    let submit_routes = auth.require(
        Router::new()
            .route("/v1/tasks", post(submit))
            .merge(batches::submit_routes()),
        Role::Submit,
    );
    let read_routes = auth.require(
        Router::new()
            .route("/v1/tasks/{id}", get(task_status))
            .route("/v1/workers", get(workers))
            .route("/v1/groups", get(groups))
            .route("/v1/pressure", get(pressure))
            .route("/v1/series", get(series))
            .merge(dead::read_routes())
            .merge(pause::read_routes())
            .merge(keys::read_routes())
            .merge(tasks::read_routes())
            .merge(audit_log::read_routes())
            .merge(batches::read_routes()),
        Role::Read,
    );
    let admin_routes = auth.require(
        Router::new()
            .route("/v1/workers/{id}/drain", post(drain))
            .merge(dead::admin_routes())
            .merge(cancel::admin_routes())
            .merge(batch_control::admin_routes())
            .merge(pause::admin_routes())
            .merge(keys::admin_routes())
            .merge(tasks::admin_routes()),
        Role::Admin,
    );
    let api = submit_routes
        .merge(read_routes)
        .merge(admin_routes)
        .with_state(state)
        .merge(crate::console::routes());
    // Outermost: a DNS-rebinding page reaches neither the API nor the console (fleet::settings).
    auth.host_check(api)
}

/// A JSON error answer `{"error": code, "detail": ...}`.
pub(crate) fn error(status: StatusCode, code: &str, detail: impl Into<String>) -> Response {
    (
        status,
        Json(json!({"error": code, "detail": detail.into()})),
    )
        .into_response()
}

fn refuse(status: StatusCode, retry_after_s: u64, body: Value) -> Response {
    (
        status,
        [(header::RETRY_AFTER, retry_after_s.max(1).to_string())],
        Json(body),
    )
        .into_response()
}

pub(crate) async fn submit(
    State(st): State<AppState>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    // Each envelope is checked on the producer's bytes, with the same limits as the AMQP
    // path, and published unchanged: the id (generated when absent) travels as `message_id`
    // and the submission time as a header, so nothing fleet adds can push it over a limit.
    let now = st.store.clock.now();
    // A token bound to a fairness key sets every task's key (the envelopes are rewritten
    // with it; AMQP producers, holding broker credentials, are trusted with their keys).
    let bound = st.cfg.common.auth.bound_key(&headers);
    let parsed = fleet::task::parse_body(
        &body,
        &st.cfg.common.limits,
        st.cfg.common.default_max_attempts,
        now,
    )
    .and_then(|mut p| match &bound {
        Some(k) => fleet::task::bind_key(&mut p, k, &st.cfg.common.limits).map(|()| p),
        None => Ok(p),
    });
    let parsed = match parsed {
        Ok(p) => p,
        Err(b) => match b.index {
            Some(i) => return bad(i, b.code, b.detail),
            None => return error(StatusCode::BAD_REQUEST, b.code, b.detail),
        },
    };
    let envs: Vec<_> = parsed
        .iter()
        .map(|p| (&p.envelope, p.raw.get().as_bytes(), p.stamped))
        .collect();
    if st.cfg.submit_rate > 0.0 {
        let want = envs.len() as u32;
        let burst = (st.cfg.submit_rate as u32).max(want);
        match st
            .store
            .take_from(
                &st.store.names.submit_rate_limit(),
                st.cfg.submit_rate,
                burst,
                want,
            )
            .await
        {
            Ok(g) if g.granted < want => {
                metrics::counter!(m::TASKS_REFUSED, "reason" => "rate_limited")
                    .increment(u64::from(want));
                let secs = g.wait_ms.div_ceil(1000);
                return refuse(
                    StatusCode::TOO_MANY_REQUESTS,
                    secs,
                    json!({"error": "rate_limited", "detail": "submission rate limit reached"}),
                );
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "submission limiter unavailable; admitting"),
        }
    }
    // The W3C Trace Context request headers go on as AMQP headers, read at ingress like an
    // AMQP producer's (checked there: an invalid one is ignored).
    let trace: Vec<(&str, String)> = [
        fleet::task::trace::TRACEPARENT,
        fleet::task::trace::TRACESTATE,
    ]
    .into_iter()
    .filter_map(|name| {
        let v = headers.get(name)?.to_str().ok()?;
        Some((name, v.to_string()))
    })
    .collect();
    let (accepted, refused) = match publish_all(&st, &envs, now, &trace).await {
        Ok(r) => r,
        Err(Unfinished {
            accepted,
            refused,
            unknown,
        }) => {
            // What was confirmed before the connection went is said too: those tasks run. The
            // `unknown` ones may or may not have reached the broker; submitting them again with
            // these ids is safe (a copy is dropped as a duplicate), with new ids it is not.
            // With the connection still up, only the publishing channel went (a renewal of a
            // channel stuck nacking closed it mid-publish): the broker is unavailable for the
            // moment, the scheduler is not reconnecting.
            let connected = st
                .connection
                .read()
                .await
                .as_ref()
                .is_some_and(|c| c.status().connected());
            let (code, detail) = if connected {
                ("broker_unavailable", "RabbitMQ did not take the tasks (the publishing channel was replaced mid-publish); retry shortly")
            } else {
                ("not_connected", "the scheduler is reconnecting to RabbitMQ")
            };
            return refuse(
                StatusCode::SERVICE_UNAVAILABLE,
                1,
                json!({"error": code, "detail": detail, "accepted": accepted, "refused": refused, "unknown": unknown}),
            );
        }
    };
    if refused.is_empty() {
        st.renewal.taken(INGRESS);
        return (StatusCode::ACCEPTED, Json(json!({"ids": accepted}))).into_response();
    }
    // The broker nacked: a nack carries no reason, and a quorum queue mid-election nacks too
    // (issue 37 item 3), so the ingress queue's depth says whether it is full. Not full (or
    // not answering): 503 `broker_unavailable`, retry in a second — never `ingress_full`.
    let cause = refusal_cause(&st, &envs, &refused).await;
    if !cause.is_full() {
        let (depth, bound) = match cause {
            amqp::NackCause::Unavailable { depth, bound } => (Some(depth), Some(bound)),
            _ => (None, None),
        };
        tracing::warn!(tasks = refused.len(), ?depth, ?bound, "RabbitMQ nacked submissions to an ingress queue below its bound (no queue leader now?); answered 503 broker_unavailable");
        metrics::counter!(m::TASKS_REFUSED, "reason" => "broker_unavailable")
            .increment(refused.len() as u64);
        renew_if_stuck(&st).await;
        return refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            1,
            json!({"error": "broker_unavailable", "detail": "RabbitMQ could not take the tasks now (the ingress queue is not full: a queue without a leader after a node loss?); retry shortly", "depth": depth, "bound": bound, "accepted": accepted, "refused": refused}),
        );
    }
    // The broker refused at its ingress bound: the same rule AMQP producers meet. The status
    // says why the queue is full — the fleet's intake gate is closed (429, retry after the
    // gate's recheck) or producers simply outpace intake (503).
    let (status, code, detail, retry_s) = if st.pressure.borrow().gate == Pressure::Red {
        (
            StatusCode::TOO_MANY_REQUESTS,
            "pressure_red",
            "the fleet is overloaded (intake gate Red) and the ingress queue is full; retry later",
            st.cfg.red_recheck.as_secs(),
        )
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "ingress_full",
            "the ingress queue is full; retry later",
            1,
        )
    };
    metrics::counter!(m::TASKS_REFUSED, "reason" => code).increment(refused.len() as u64);
    refuse(
        status,
        retry_s,
        json!({"error": code, "detail": detail, "accepted": accepted, "refused": refused}),
    )
}

/// The API's one publishing target for [`amqp::Renewal`]: the ingress queues.
const INGRESS: &str = "ingress";

/// Opens a fresh publishing channel for the API once submissions have been nacked below the
/// ingress bound for [`amqp::RENEW_AFTER`] ([`amqp::Renewal`]). A channel that cannot be
/// opened leaves the old one (logged); the session's next start replaces both.
async fn renew_if_stuck(st: &AppState) {
    if !st.renewal.refused(INGRESS) {
        return;
    }
    let Some(conn) = st.connection.read().await.clone() else {
        return;
    };
    match st.renewal.renew(&conn, "api").await {
        Ok(p) => *st.publisher.write().await = Some(p),
        Err(e) => tracing::warn!(error = %e, "cannot open a fresh publishing channel"),
    }
}

/// Why the broker refused `refused` (ids of `envs`): full when the ingress queue of any lane
/// they went to is at its bound ([`amqp::nack_cause`]); the first other answer otherwise.
async fn refusal_cause(
    st: &AppState,
    envs: &[(&Envelope, &[u8], bool)],
    refused: &[String],
) -> amqp::NackCause {
    let lanes: std::collections::BTreeSet<Lane> = envs
        .iter()
        .filter(|(e, ..)| refused.contains(&e.id))
        .map(|(e, ..)| e.lane)
        .collect();
    let mut cause = amqp::NackCause::Unknown;
    for lane in lanes {
        let q = st.store.names.ingress_queue(lane);
        let c = amqp::nack_cause(&st.probe, &q, st.cfg.common.ingress_max[lane]).await;
        if c.is_full() {
            return c;
        }
        if cause == amqp::NackCause::Unknown {
            cause = c;
        }
    }
    cause
}

/// A submission [`publish_all`] could not finish: ids confirmed, refused by the broker, and
/// of unknown fate (published on a connection that went before its confirm, or never published).
struct Unfinished {
    accepted: Vec<String>,
    refused: Vec<String>,
    unknown: Vec<String>,
}

/// How long a submission whose confirms were lost with the connection waits for the next
/// session's publisher before it gives up (503): covers a failover to another cluster node.
const REPUBLISH_WITHIN: Duration = Duration::from_secs(15);

/// How long a submission waits for the successor of a publishing channel that closed (a
/// renewal replaces it within milliseconds; a lost connection takes longer and is answered
/// `not_connected`).
const RENEWAL_WAIT: Duration = Duration::from_secs(2);

/// Publishes `envs` to the ingress with confirms and sorts their ids into (accepted, refused
/// by the broker). A publish whose confirm was lost with the connection (node loss: neither
/// ack nor nack) is published again on the next session's channel, until confirmed or
/// [`REPUBLISH_WITHIN`] has passed; a copy the broker had already taken is absorbed by the
/// dedupe protocol (same id). `Err` when no publisher came back in time for what is left:
/// what was settled so far and the ids whose fate is unknown.
async fn publish_all(
    st: &AppState,
    envs: &[(&Envelope, &[u8], bool)],
    now: chrono::DateTime<chrono::Utc>,
    trace: &[(&str, String)],
) -> Result<(Vec<String>, Vec<String>), Unfinished> {
    let names = st.store.names.clone();
    let deadline = tokio::time::Instant::now() + REPUBLISH_WITHIN;
    let mut accepted = Vec::new();
    let mut refused = Vec::new();
    let mut todo: Vec<usize> = (0..envs.len()).collect();
    let mut round = 0u32;
    while !todo.is_empty() {
        round += 1;
        // A clone of the session's publisher, the lock released at once: a publish the broker
        // holds back (a memory alarm) must not hold the scheduler's stop, which takes the
        // write lock.
        // The first round waits at most RENEWAL_WAIT for a replaced channel's successor (a
        // submission during an outage is answered quickly); a republish round, the deadline.
        let give_up = if round == 1 {
            (tokio::time::Instant::now() + RENEWAL_WAIT).min(deadline)
        } else {
            deadline
        };
        let publisher = loop {
            let p = st.publisher.read().await.clone();
            if p.as_ref().is_some_and(|ch| ch.status().connected()) {
                break p;
            }
            // No channel at all in the first round: not connected, answered at once. A channel
            // that is there but closed is being replaced (a reconnect, or the renewal of a
            // channel stuck nacking): its successor is waited for, up to the deadline.
            if (round == 1 && p.is_none()) || tokio::time::Instant::now() >= give_up {
                break None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let Some(ch) = publisher.as_ref() else {
            let unknown = todo.iter().map(|&i| envs[i].0.id.clone()).collect();
            return Err(Unfinished {
                accepted,
                refused,
                unknown,
            });
        };
        let exchange = names.submit_exchange();
        let msgs = todo.iter().map(|&i| {
            let (e, bytes, stamped) = &envs[i];
            let stamp = stamped.then(|| {
                (
                    fleet::task::headers::SUBMITTED_AT,
                    fleet::task::headers::submitted_at_value(now),
                )
            });
            let h = (stamp.is_some() || !trace.is_empty())
                .then(|| amqp::headers(stamp.into_iter().chain(trace.iter().cloned())));
            amqp::Outgoing {
                exchange: &exchange,
                routing_key: e.lane.as_str(),
                body: bytes,
                props: amqp::task_properties(&e.id, h),
            }
        });
        let confirms = amqp::publish_batch(ch, msgs).await;
        let mut lost = Vec::new();
        for (&i, c) in todo.iter().zip(confirms) {
            let id = envs[i].0.id.clone();
            match c {
                Ok(c) => match amqp::confirmed(c).await {
                    Ok(()) => accepted.push(id),
                    Err(fleet::Error::Refused(_)) => refused.push(id),
                    Err(_) => lost.push(i),
                },
                Err(_) => lost.push(i),
            }
        }
        if !lost.is_empty() {
            metrics::counter!(m::TASKS_REPUBLISHED).increment(lost.len() as u64);
            tracing::warn!(
                tasks = lost.len(),
                round,
                "publisher confirms lost with the connection; publishing again on the next channel"
            );
        }
        todo = lost;
    }
    Ok((accepted, refused))
}

fn bad(index: usize, code: &str, detail: String) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(json!({"error": code, "detail": detail, "index": index})),
    )
        .into_response()
}

/// The typed status record plus `attempts`: every attempt that ended, oldest first (see
/// [`fleet::Store::task_attempts`]; schema `shared/schema/status.schema.json`).
async fn task_status(State(st): State<AppState>, Path(id): Path<String>) -> Response {
    match st.store.task_status_with_attempts(&id).await {
        Ok(Some((fields, attempts))) => {
            let mut v = fleet::status::typed(&id, fields);
            if let Value::Object(o) = &mut v {
                o.insert("attempts".into(), Value::Array(attempts));
            }
            Json(v).into_response()
        }
        Ok(None) => error(
            StatusCode::NOT_FOUND,
            "unknown_task",
            format!("no status for task {id} (never seen, or older than the status TTL)"),
        ),
        Err(e) => error(StatusCode::SERVICE_UNAVAILABLE, "redis", e.to_string()),
    }
}

async fn workers(State(st): State<AppState>) -> Response {
    let workers = match st.store.workers().await {
        Ok(w) => w,
        Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, "redis", e.to_string()),
    };
    // Each worker's clock skew against Redis, as it reported at its last heartbeat (absent
    // when not reported yet).
    let ids: Vec<String> = workers.iter().map(|w| w.id.clone()).collect();
    let shared = st.store.worker_stats(&ids).await.unwrap_or_default();
    let out: Vec<Value> = workers
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let mut v = serde_json::to_value(w).unwrap_or_default();
            if let (Value::Object(o), Some(skew)) = (&mut v, shared.get(i).and_then(|s| s.skew_ms))
            {
                o.insert("clock_skew_ms".into(), skew.into());
            }
            v
        })
        .collect();
    Json(out).into_response()
}

async fn groups(State(st): State<AppState>) -> Response {
    let groups = match st.store.groups().await {
        Ok(g) => g,
        Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, "redis", e.to_string()),
    };
    let probes = st.probes.read().await;
    let samples = st.groups.read().await;
    let out: Vec<Value> = groups
        .into_iter()
        .map(|g| {
            let p = probes.get(&g.group).cloned();
            let sample = samples.get(&g.group).cloned();
            let mut v = serde_json::to_value(&g).unwrap_or_default();
            if let (Value::Object(o), Some(p)) = (&mut v, p) {
                o.insert("probe_ok".into(), p.ok.into());
                o.insert("probe_seconds".into(), json!(p.seconds));
                o.insert(
                    "probe_consecutive_failures".into(),
                    p.consecutive_failures.into(),
                );
            }
            if let (Value::Object(o), Some(Value::Object(s))) = (
                &mut v,
                sample.map(|s| serde_json::to_value(s).unwrap_or_default()),
            ) {
                o.extend(s);
            }
            v
        })
        .collect();
    Json(out).into_response()
}

/// `POST /v1/workers/{id}/drain` (role admin): 202 `{"id", "previous_state", "state"}`, 404 for
/// an unknown worker, 503 when Redis or the broker cannot be reached (nothing promised).
///
/// The drain is a promise like a cancel: its record goes into the control stream (the audit
/// log) before the `draining` state is written, and the worker follows the stream too, so a
/// drain answered 202 reaches the worker even when Redis loses the state before its heartbeat
/// reads it ([`fleet::control`]).
async fn drain(
    State(st): State<AppState>,
    headers: axum::http::HeaderMap,
    Path(id): Path<String>,
) -> Response {
    // The state before this request, read before its record goes out: the worker follows the
    // control stream and may mark itself draining before this replica's own write below, which
    // would then read back `draining` (a loaded CI run saw "was draining" for an active worker).
    let before = match st.store.worker_state(&id).await {
        Ok(Some(s)) => s,
        Ok(None) => {
            return error(
                StatusCode::NOT_FOUND,
                "unknown_worker",
                format!("no registered worker with id {id}"),
            )
        }
        Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, "redis", e.to_string()),
    };
    let who = caller(&st, &headers);
    if let Err(e) = audit(&st, &who, "drain", json!({"worker": id}), 1).await {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "broker_unavailable",
            format!("the drain was not recorded (nothing promised; try again): {e}"),
        );
    }
    match st.store.set_state(&id, WorkerState::Draining).await {
        Ok(Some(_)) => {
            let prev = before;
            tracing::info!(worker = %id, previous = prev.as_str(), by = %who.name, "drain requested through the API");
            (
                StatusCode::ACCEPTED,
                Json(json!({"id": id, "previous_state": prev, "state": WorkerState::Draining})),
            )
                .into_response()
        }
        // Gone between the read and the write: the recorded drain reaches it from the stream
        // if it comes back in this process.
        Ok(None) => error(
            StatusCode::NOT_FOUND,
            "unknown_worker",
            format!("no registered worker with id {id}"),
        ),
        // Recorded: the worker drains from the stream.
        Err(e) => {
            tracing::warn!(worker = %id, error = %e, "drain recorded in the control stream; the worker reads it there (Redis failed)");
            (
                StatusCode::ACCEPTED,
                Json(json!({"id": id, "state": WorkerState::Draining})),
            )
                .into_response()
        }
    }
}

async fn series(State(st): State<AppState>) -> Response {
    Json(json!({
        "interval_seconds": st.cfg.series_interval.as_secs_f64(),
        "window_seconds": crate::series::WINDOW.as_secs(),
        "points": st.series.points(),
    }))
    .into_response()
}

/// `GET /v1/pressure`: the last sample of the signals, with `age_ms` (how old it is; `null`
/// before the first) and `stale`: true when no sample was taken for [`stale_after`] — the
/// scheduler cannot read the fleet (RabbitMQ or Redis lost, or not answering), so the figures
/// are the last it knew, not the fleet's now.
async fn pressure(State(st): State<AppState>) -> Response {
    let s = *st.pressure.borrow();
    let age_ms = (s.sampled_at_ms > 0).then(|| (fleet::redis::now_ms() - s.sampled_at_ms).max(0));
    let stale = age_ms.is_none_or(|a| a > stale_after(&st.cfg).as_millis() as i64);
    let mut v = serde_json::to_value(s).unwrap_or_default();
    if let Value::Object(o) = &mut v {
        let c = &st.cfg;
        o.insert(
            "thresholds".into(),
            json!({"max_pending": c.max_pending, "pending_yellow": c.pending_yellow, "pending_red": c.pending_red, "load_yellow": c.load_yellow, "load_red": c.load_red, "hold_ms": c.pressure_hold.as_millis() as u64}),
        );
        o.insert("age_ms".into(), json!(age_ms));
        o.insert("stale".into(), json!(stale));
    }
    Json(v).into_response()
}

/// How old the pressure sample may be before the API calls it stale: five pressure intervals,
/// at least 5 s (a sample follows each fleet view, which a loaded Redis may delay a little).
pub fn stale_after(cfg: &crate::config::SchedulerConfig) -> Duration {
    (cfg.pressure_interval * 5).max(Duration::from_secs(5))
}
