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
//! * Chains and DAGs ([`fleet::batch::dag`]): a task may carry `after: [ids]` (members of the
//!   same batch) and `payload_from: id` (one of them). Such a task is not published: its
//!   envelope (with `submitted_at` stamped) goes into the definition record, its status is
//!   written `waiting` (with `after`), and a batch loop releases it when every one of them
//!   succeeded. The answer then has `waiting: [ids]` too. **400** before anything is recorded
//!   for an `after` naming a task not in the batch, itself or one id twice, a `payload_from`
//!   not among its `after`, duplicate task ids, or a cycle (`error: cycle`, `cycle: [ids]`
//!   around it, the detail spelling it `a → b → c → a`).
//! * `GET /v1/batches/{id}` (role `read`) → **200** [`fleet::batch::Progress`] (total,
//!   succeeded, dead, expired, cancelled, pending, waiting ids, failed ids, callbacks fired);
//!   **404** for a batch this replica has not read.

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
    let waiting = match fleet::batch::dag::check(&mut tasks) {
        Ok(w) => w,
        Err(e) => {
            let mut body = json!({"error": e.code, "detail": e.detail, "index": e.index.map_or(-1, |i| i as i64)});
            if !e.cycle.is_empty() {
                body["cycle"] = json!(e.cycle);
            }
            return (StatusCode::BAD_REQUEST, Json(body)).into_response();
        }
    };
    let tasks_body = match serde_json::to_vec(&tasks) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_body", e.to_string()),
    };
    // Checked before the definition is recorded: an invalid task refuses the whole batch.
    let now = st.store.clock.now();
    let limits = &st.cfg.common.limits;
    let max_attempts = st.cfg.common.default_max_attempts;
    let mut parsed = match fleet::task::parse_body(&tasks_body, limits, max_attempts, now) {
        Ok(p) => p,
        Err(b) => return bad(b.index.map(|i| i as i64).unwrap_or(-1), b.code, b.detail),
    };
    // The waiting members are published later by a batch loop, not by `submit`: they get what
    // `submit` would give them now — the token's fairness key and `submitted_at` (their
    // deadline counts from the batch's submission).
    if let Some(k) = st.cfg.common.auth.bound_key(&headers) {
        if let Err(b) = fleet::task::bind_key(&mut parsed, &k, limits) {
            return bad(b.index.map(|i| i as i64).unwrap_or(-1), b.code, b.detail);
        }
    }
    let mut held = Vec::with_capacity(waiting.len());
    let mut statuses = fleet::status::Writes::new();
    for &i in &waiting {
        let p = &parsed[i];
        let Ok(Value::Object(mut env)) = serde_json::from_str::<Value>(p.raw.get()) else {
            return bad(i as i64, "bad_envelope", "a task must be a JSON object");
        };
        if p.stamped {
            env.insert(
                "submitted_at".into(),
                Value::String(now.to_rfc3339_opts(chrono::SecondsFormat::Micros, true)),
            );
        }
        let after: Vec<String> = env
            .get(fleet::batch::dag::AFTER)
            .and_then(|a| serde_json::from_value(a.clone()).ok())
            .unwrap_or_default();
        let e = &p.envelope;
        statuses.waiting(&e.id, e.lane, &after, &batch);
        statuses.describe(
            &e.id,
            &e.kind,
            &e.selector().pairs().join(","),
            e.submitted_at,
        );
        held.push(Value::Object(env));
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
            waiting: Vec::new(),
            complete: false,
            at_ms: 0,
            cancel: None,
        };
        let env = fleet::batch::callback_envelope(cb, name, &probe);
        let bytes = serde_json::to_vec(&env).unwrap_or_default();
        if let Err(b) = fleet::task::parse_body(&bytes, limits, max_attempts, now) {
            return bad(-1, b.code, format!("`{name}`: {}", b.detail));
        }
    }
    let [on_success, on_complete] = callbacks;
    let known = st.batches.progress(&batch).is_some();
    let rec = fleet::batch::def_record(
        &batch,
        ids.clone(),
        (on_success, on_complete),
        held,
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
    // The waiting members' statuses, before any parent is published (so never written over a
    // released member's); not again for a batch submitted again after a refusal. Only a
    // cache of the definition: a failure is logged, not refused.
    if !known && !statuses.is_empty() {
        if let Err(e) = st
            .store
            .write_statuses(&statuses, st.cfg.common.status_ttl)
            .await
        {
            tracing::warn!(error = %e, batch = %batch, "cannot write the waiting members' statuses");
        }
    }
    let waiting_ids: Vec<String> = waiting.iter().map(|&i| ids[i].clone()).collect();
    let body = if waiting.is_empty() {
        tasks_body
    } else {
        let mut held = vec![false; tasks.len()];
        for &i in &waiting {
            held[i] = true;
        }
        let now_tasks: Vec<&Value> = tasks
            .iter()
            .zip(&held)
            .filter(|(_, held)| !**held)
            .map(|(t, _)| t)
            .collect();
        match serde_json::to_vec(&now_tasks) {
            Ok(b) => b,
            Err(e) => return error(StatusCode::BAD_REQUEST, "bad_body", e.to_string()),
        }
    };
    let answer = super::submit(State(st), headers, Bytes::from(body)).await;
    if answer.status() != StatusCode::ACCEPTED {
        return answer;
    }
    let mut out = json!({"batch": batch, "ids": ids});
    if !waiting_ids.is_empty() {
        out["waiting"] = json!(waiting_ids);
    }
    (StatusCode::ACCEPTED, Json(out)).into_response()
}
