//! `/v1/schedules`: list and inspect (role `read`), add, delete, pause, resume and fire now
//! (role `admin`). [`read_routes`] and [`admin_routes`] are separate routers so an auth layer
//! can require a different role on each.
//!
//! * `GET /v1/schedules` → 200 `[view]`; `GET /v1/schedules/{name}` → 200 view or 404. A view
//!   is the definition plus `next_tick` and `last_tick` (RFC 3339; the latest tick fired or
//!   counted missed, `null` if none or Redis lost it), `last_outcome` (`fired` | `missed`;
//!   `null` when unknown: the tick's record is kept for the tolerance + 1 h) and `last_task`
//!   (`{"id": "<name>@<last_tick>", "state": <its status state or null>}` when fired, else
//!   `null`). A fire-now's task is not a tick: it is not in the view.
//! * `POST /v1/schedules` (a definition, see [`ScheduleSpec`]) → 201 view; 400 with the
//!   reason; 409 when the name exists — also when another replica created the same name at
//!   the same moment: the definitions log is first-put-wins ([`super::log`]), and a replica
//!   answers 201 only when the schedule it applied is its own record. A schedule created
//!   again after a delete starts with `last_tick`, `last_outcome` and `last_task` `null`
//!   (marks older than its creation are its predecessor's). Its first due tick is the first
//!   after its creation time (Redis server time), see [`super::fire`].
//! * `DELETE /v1/schedules/{name}` → 200; `POST /v1/schedules/{name}/pause|resume` → 200 view;
//!   404 for an unknown name.
//! * `POST /v1/schedules/{name}/fire` → 202 `{"id": "<name>@<now, ms>"}` through admission:
//!   429 + `Retry-After` while the fleet is Red, 503 when the ingress is full.
//!
//! Changes are appended to the definitions stream and answered once this replica applied them;
//! every answer is 503 while the replica is reconnecting or has not read the stream yet.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use chrono::SecondsFormat;
use fleet::{metrics as m, Store};
use serde_json::{json, Value};
use tokio::sync::{watch, RwLock};

use super::definition::{tick_label, Schedule, ScheduleSpec};
use super::fire::{self, Refusal};
use super::log::{self, Board, Change, Entry, Record};
use crate::api::error;
use crate::backpressure::Sample;
use crate::config::SchedulerConfig;

/// Longest a change waits for this replica to apply it.
const APPLY_TIMEOUT: Duration = Duration::from_secs(5);

/// What the schedule routes need.
#[derive(Clone)]
pub struct ScheduleApi {
    pub cfg: Arc<SchedulerConfig>,
    pub store: Store,
    pub board: Board,
    /// The current session's confirm channel (None while reconnecting).
    pub publisher: Arc<RwLock<Option<fleet::broker::amqp::Publisher>>>,
    pub pressure: watch::Receiver<Sample>,
}

/// Reads: role `read`.
pub fn read_routes(st: ScheduleApi) -> Router {
    Router::new()
        .route("/v1/schedules", get(list))
        .route("/v1/schedules/{name}", get(show))
        .with_state(st)
}

/// Changes: role `admin`.
pub fn admin_routes(st: ScheduleApi) -> Router {
    Router::new()
        .route("/v1/schedules", post(add))
        .route("/v1/schedules/{name}", axum::routing::delete(remove))
        .route("/v1/schedules/{name}/pause", post(pause))
        .route("/v1/schedules/{name}/resume", post(resume))
        .route("/v1/schedules/{name}/fire", post(fire_now))
        .with_state(st)
}

fn loading() -> Response {
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        "schedules_loading",
        "this scheduler has not read the schedule definitions yet; retry shortly",
    )
}

fn unknown(name: &str) -> Response {
    error(
        StatusCode::NOT_FOUND,
        "unknown_schedule",
        format!("no schedule named {name}"),
    )
}

async fn view(st: &ScheduleApi, e: &Entry) -> Value {
    let s = &e.schedule;
    let mut v = serde_json::to_value(&s.spec).unwrap_or_default();
    // A mark from before this schedule was created is a deleted namesake's.
    let last_ms = st
        .store
        .schedule_last(s.name())
        .await
        .ok()
        .flatten()
        .filter(|ms| *ms > e.created_at_ms);
    let last = last_ms.and_then(chrono::DateTime::from_timestamp_millis);
    // The last tick's run: its outcome (kept for the tolerance + 1 h) and, when fired, its task
    // (id `<name>@<tick>`) with the task's current state from its status record.
    let mut outcome: Option<String> = None;
    let mut task = Value::Null;
    if let (Some(ms), Some(tick)) = (last_ms, last) {
        outcome = st
            .store
            .schedule_tick(s.name(), ms)
            .await
            .ok()
            .flatten()
            .filter(|o| o == "fired" || o == "missed");
        if outcome.as_deref() == Some("fired") {
            let id = format!("{}@{}", s.name(), tick_label(tick));
            let state = st.store.task_state(&id).await.ok().flatten();
            task = json!({"id": id, "state": state});
        }
    }
    let next = if s.spec.enabled {
        s.next_after(st.store.clock.now()).map(tick_label)
    } else {
        None
    };
    if let Value::Object(o) = &mut v {
        o.insert("next_tick".into(), json!(next));
        o.insert("last_tick".into(), json!(last.map(tick_label)));
        o.insert("last_outcome".into(), json!(outcome));
        o.insert("last_task".into(), task);
    }
    v
}

async fn list(State(st): State<ScheduleApi>) -> Response {
    if !st.board.loaded() {
        return loading();
    }
    let mut out = Vec::new();
    for e in st.board.entries() {
        out.push(view(&st, &e).await);
    }
    Json(out).into_response()
}

async fn show(State(st): State<ScheduleApi>, Path(name): Path<String>) -> Response {
    if !st.board.loaded() {
        return loading();
    }
    match st.board.get(&name) {
        Some(e) => Json(view(&st, &e).await).into_response(),
        None => unknown(&name),
    }
}

/// Appends `change` and waits until this replica applied it; returns its record's id. A
/// creation or resume first writes the schedule's born mark ([`fire::born_key`]) at the
/// change's time, so its first due tick is the first after that time.
async fn change(st: &ScheduleApi, change: Change) -> Result<String, Response> {
    let at = match fire::server_now(&st.store).await {
        Ok(t) => t.timestamp_millis(),
        Err(e) => {
            return Err(error(
                StatusCode::SERVICE_UNAVAILABLE,
                "redis",
                e.to_string(),
            ))
        }
    };
    let born = match &change {
        Change::Put { schedule } => Some(schedule.name.as_str()),
        Change::Resume { name } => Some(name.as_str()),
        _ => None,
    };
    if let Some(name) = born {
        let key = fire::born_key(&st.store.names, name);
        if let Err(e) = st
            .store
            .query::<()>(deadpool_redis::redis::cmd("SET").arg(&key).arg(at))
            .await
        {
            return Err(error(
                StatusCode::SERVICE_UNAVAILABLE,
                "redis",
                e.to_string(),
            ));
        }
    }
    let rec = Record::new(change, at);
    // A clone of the publisher, the lock released at once: a publish the broker holds back
    // (a memory alarm) must not hold the scheduler's stop, which takes the write lock.
    let Some(ch) = st.publisher.read().await.clone() else {
        return Err(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_connected",
            "the scheduler is reconnecting to RabbitMQ",
        ));
    };
    if let Err(e) = log::append(&ch, &st.store.names, &rec).await {
        return Err(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_recorded",
            format!("the broker did not take the change: {e}"),
        ));
    }
    if !st.board.wait_applied(&rec.id, APPLY_TIMEOUT).await {
        return Err(error(
            StatusCode::GATEWAY_TIMEOUT,
            "not_applied",
            "the change is recorded but this scheduler has not applied it yet",
        ));
    }
    Ok(rec.id)
}

/// Appends the audit record of a schedule action `who` applied to `name`.
async fn audit(st: &ScheduleApi, who: &HeaderMap, action: &str, name: &str, extra: Value) {
    let who = crate::api::caller_of(&st.cfg.common.auth, who);
    let mut target = json!({ "schedule": name });
    if let (Value::Object(t), Value::Object(x)) = (&mut target, extra) {
        t.extend(x);
    }
    let _ = crate::api::audit_to(&st.publisher, &st.store, &who, action, target, 1, "").await;
}

async fn add(State(st): State<ScheduleApi>, headers: HeaderMap, body: Bytes) -> Response {
    if !st.board.loaded() {
        return loading();
    }
    let spec: ScheduleSpec = match serde_json::from_slice(&body) {
        Ok(s) => s,
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_schedule", e.to_string()),
    };
    let s = match Schedule::new(spec) {
        Ok(s) => s,
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_schedule", e.to_string()),
    };
    // The fired task must pass the door's limits (as configured here), checked on the bytes
    // the ingress will see, with the longest id a fire can have (a fire-now's).
    let now = chrono::Utc::now();
    let longest = now.to_rfc3339_opts(SecondsFormat::Millis, true);
    if let Err(r) = s
        .envelope(now, &longest, st.cfg.common.default_max_attempts)
        .and_then(|e| {
            fleet::Envelope::parse(&e.to_bytes(), &st.cfg.common.limits).map_err(|r| r.to_string())
        })
    {
        return error(
            StatusCode::BAD_REQUEST,
            "bad_schedule",
            format!("task: {r}"),
        );
    }
    let name = s.name().to_string();
    if st.board.get(&name).is_some() {
        return error(
            StatusCode::CONFLICT,
            "schedule_exists",
            format!("a schedule named {name} exists; delete it first"),
        );
    }
    let id = match change(&st, Change::Put { schedule: s.spec }).await {
        Ok(id) => id,
        Err(r) => return r,
    };
    match st.board.get(&name) {
        Some(e) if e.put_id == id => {
            tracing::info!(schedule = %name, "schedule added through the API");
            audit(&st, &headers, "schedule_add", &name, json!({})).await;
            (StatusCode::CREATED, Json(view(&st, &e).await)).into_response()
        }
        // Another replica's put of the name came first in the log (first put wins).
        Some(_) => error(
            StatusCode::CONFLICT,
            "schedule_exists",
            format!("a schedule named {name} was created at the same time elsewhere"),
        ),
        None => unknown(&name),
    }
}

async fn remove(
    State(st): State<ScheduleApi>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Response {
    if !st.board.loaded() {
        return loading();
    }
    if st.board.get(&name).is_none() {
        return unknown(&name);
    }
    if let Err(r) = change(&st, Change::Delete { name: name.clone() }).await {
        return r;
    }
    tracing::info!(schedule = %name, "schedule deleted through the API");
    audit(&st, &headers, "schedule_remove", &name, json!({})).await;
    Json(json!({"deleted": name})).into_response()
}

async fn pause(
    State(st): State<ScheduleApi>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Response {
    set_enabled(st, headers, name, false).await
}

async fn resume(
    State(st): State<ScheduleApi>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Response {
    set_enabled(st, headers, name, true).await
}

async fn set_enabled(st: ScheduleApi, headers: HeaderMap, name: String, enabled: bool) -> Response {
    if !st.board.loaded() {
        return loading();
    }
    if st.board.get(&name).is_none() {
        return unknown(&name);
    }
    let c = if enabled {
        Change::Resume { name: name.clone() }
    } else {
        Change::Pause { name: name.clone() }
    };
    if let Err(r) = change(&st, c).await {
        return r;
    }
    tracing::info!(schedule = %name, enabled, "schedule paused or resumed through the API");
    let action = if enabled {
        "schedule_resume"
    } else {
        "schedule_pause"
    };
    audit(&st, &headers, action, &name, json!({})).await;
    match st.board.get(&name) {
        Some(e) => Json(view(&st, &e).await).into_response(),
        None => unknown(&name),
    }
}

async fn fire_now(
    State(st): State<ScheduleApi>,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> Response {
    if !st.board.loaded() {
        return loading();
    }
    let Some(e) = st.board.get(&name) else {
        return unknown(&name);
    };
    let now = match fire::server_now(&st.store).await {
        Ok(t) => t,
        Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, "redis", e.to_string()),
    };
    let env = match e.schedule.envelope(
        now,
        &now.to_rfc3339_opts(SecondsFormat::Millis, true),
        st.cfg.common.default_max_attempts,
    ) {
        Ok(env) => env,
        Err(detail) => return error(StatusCode::INTERNAL_SERVER_ERROR, "bad_template", detail),
    };
    // A clone, the lock released at once (see `change`).
    let Some(ch) = st.publisher.read().await.clone() else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_connected",
            "the scheduler is reconnecting to RabbitMQ",
        );
    };
    let r = fire::submit(&ch, &st.store.names, &st.pressure, &env).await;
    let retry = st.cfg.red_recheck.as_secs().max(1).to_string();
    match r {
        Ok(()) => {
            metrics::counter!(m::SCHEDULE_FIRES, "schedule" => name.clone(), "trigger" => "manual").increment(1);
            tracing::info!(schedule = %name, task.id = %env.id, "schedule fired by hand");
            audit(&st, &headers, "schedule_fire", &name, json!({ "task": env.id })).await;
            (StatusCode::ACCEPTED, Json(json!({"id": env.id}))).into_response()
        }
        Err(Refusal::PressureRed) => (StatusCode::TOO_MANY_REQUESTS, [(header::RETRY_AFTER, retry)], Json(json!({"error": "pressure_red", "detail": "the fleet is overloaded (pressure Red); retry later"}))).into_response(),
        Err(r) => (StatusCode::SERVICE_UNAVAILABLE, [(header::RETRY_AFTER, "1".to_string())], Json(json!({"error": r.reason(), "detail": "the broker did not accept the task; retry later"}))).into_response(),
    }
}
