//! Batches ([`fleet::batch`]):
//!
//! * `POST /v1/batches` (role `submit`), body `{"id"?: string, "tasks": [envelope, ...],
//!   "on_success"?: envelope, "on_complete"?: envelope}` → **202** `{"batch": id, "ids": [task
//!   ids]}`. Each task gets the field `batch` (and an `id` when it has none); the batch's
//!   definition is appended to the durable control stream (confirmed) *before* any task is
//!   published, then the tasks go through the same path as `POST /v1/tasks`. **400** for an
//!   invalid envelope (`index` names it; `-1` for a callback), an empty batch, more than
//!   [`fleet::batch::MAX_TASKS`] tasks, or a callback without `kind`. **503** when the
//!   definition could not be recorded (nothing submitted); a 429/503 from the task submission
//!   passes through with its `accepted`/`refused` ids: submit the same body again (same batch
//!   id and task ids — the definition and the copies already taken are duplicates).
//! * `GET /v1/batches/{id}` (role `read`) → **200** [`fleet::batch::Progress`] (total,
//!   succeeded, dead, expired, cancelled, pending, failed ids, callbacks fired); **404** for a
//!   batch this replica has not read.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use super::{error, AppState};

/// The submitting route (role `submit`).
pub fn submit_routes() -> Router<AppState> {
    Router::new().route("/v1/batches", post(submit_batch))
}

/// The reading route (role `read`).
pub fn read_routes() -> Router<AppState> {
    Router::new().route("/v1/batches/{id}", get(batch_status))
}

async fn batch_status(State(st): State<AppState>, Path(id): Path<String>) -> Response {
    match st.batches.progress(&id) {
        Some(p) => (StatusCode::OK, Json(p)).into_response(),
        None => error(
            StatusCode::NOT_FOUND,
            "unknown_batch",
            format!(
                "no batch {id} (never submitted, or older than the control stream's retention)"
            ),
        ),
    }
}

/// A 400 naming the offending task (`-1`: a callback).
fn bad(index: i64, code: &str, detail: impl Into<String>) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(json!({"error": code, "detail": detail.into(), "index": index})),
    )
        .into_response()
}

async fn submit_batch(State(st): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let mut req = match serde_json::from_slice::<Value>(&body) {
        Ok(Value::Object(m)) => m,
        Ok(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                "bad_body",
                "the body must be a JSON object",
            )
        }
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "bad_body",
                format!("malformed JSON: {e}"),
            )
        }
    };
    let batch = match req.remove("id") {
        None | Some(Value::Null) => fleet::control::new_id(),
        Some(Value::String(s))
            if !s.is_empty() && s.len() <= 128 && !s.chars().any(char::is_control) =>
        {
            s
        }
        Some(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                "bad_batch_id",
                "`id` must be a string of 1 to 128 bytes without control characters",
            )
        }
    };
    let mut tasks = match req.remove("tasks") {
        Some(Value::Array(a)) if !a.is_empty() => a,
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                "no_tasks",
                "`tasks` must be a non-empty array of envelopes",
            )
        }
    };
    if tasks.len() > fleet::batch::MAX_TASKS {
        return error(
            StatusCode::BAD_REQUEST,
            "too_many_tasks",
            format!("a batch holds at most {} tasks", fleet::batch::MAX_TASKS),
        );
    }
    let mut callbacks = [None, None];
    for (slot, name) in callbacks.iter_mut().zip(fleet::batch::CALLBACKS) {
        match req.remove(name) {
            None | Some(Value::Null) => {}
            Some(Value::Object(o)) if o.get("kind").is_some_and(Value::is_string) => {
                *slot = Some(Value::Object(o))
            }
            Some(_) => {
                return bad(
                    -1,
                    "bad_callback",
                    format!("`{name}` must be an envelope (an object with a string `kind`)"),
                )
            }
        }
    }
    let mut ids = Vec::with_capacity(tasks.len());
    for (i, t) in tasks.iter_mut().enumerate() {
        let Value::Object(o) = t else {
            return bad(i as i64, "bad_envelope", "a task must be a JSON object");
        };
        let id = match o.get("id") {
            Some(Value::String(s)) => s.clone(),
            _ => {
                let id = uuid::Uuid::new_v4().to_string();
                o.insert("id".into(), Value::String(id.clone()));
                id
            }
        };
        o.insert("batch".into(), Value::String(batch.clone()));
        ids.push(id);
    }
    let tasks_body = match serde_json::to_vec(&tasks) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_body", e.to_string()),
    };
    // Checked before the definition is recorded: an invalid task refuses the whole batch.
    let now = st.store.clock.now();
    let limits = &st.cfg.common.limits;
    let max_attempts = st.cfg.common.default_max_attempts;
    if let Err(b) = fleet::task::parse_body(&tasks_body, limits, max_attempts, now) {
        return bad(b.index.map(|i| i as i64).unwrap_or(-1), b.code, b.detail);
    }
    for (name, cb) in fleet::batch::CALLBACKS.iter().zip(&callbacks) {
        let Some(cb) = cb else { continue };
        let probe = fleet::batch::Progress {
            id: batch.clone(),
            total: ids.len(),
            succeeded: 0,
            dead: 0,
            expired: 0,
            cancelled: 0,
            pending: ids.len(),
            failed: Vec::new(),
            fired: Vec::new(),
            callbacks: Vec::new(),
            complete: false,
            at_ms: 0,
        };
        let env = fleet::batch::callback_envelope(cb, name, &probe);
        let bytes = serde_json::to_vec(&env).unwrap_or_default();
        if let Err(b) = fleet::task::parse_body(&bytes, limits, max_attempts, now) {
            return bad(-1, b.code, format!("`{name}`: {}", b.detail));
        }
    }
    let [on_success, on_complete] = callbacks;
    let rec = fleet::batch::def_record(
        &batch,
        ids.clone(),
        on_success,
        on_complete,
        st.store.clock.now_ms(),
    );
    let appended = match st.publisher.read().await.as_ref() {
        Some(p) => fleet::control::append(p, &st.store.names, &rec).await,
        None => Err(fleet::Error::NotConnected),
    };
    if let Err(e) = appended {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "broker_unavailable",
            format!("the batch was not recorded (nothing submitted; try again): {e}"),
        );
    }
    // This replica knows it at once (its control loop reads the record too: idempotent).
    st.batches.apply(&rec);
    let answer = super::submit(State(st), headers, Bytes::from(tasks_body)).await;
    if answer.status() != StatusCode::ACCEPTED {
        return answer;
    }
    (
        StatusCode::ACCEPTED,
        Json(json!({"batch": batch, "ids": ids})),
    )
        .into_response()
}
