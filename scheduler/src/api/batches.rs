//! Batches ([`fleet::batch`]):
//!
//! * `POST /v1/batches` (role `submit`), body `{"id"?: string, "tasks": [envelope, ...],
//!   "on_success"?: envelope, "on_complete"?: envelope}` → **202** `{"batch": id, "ids": [task
//!   ids]}`. Each task gets the field `batch` (and an `id` when it has none); the batch's
//!   definition is appended to the durable control stream (confirmed) *before* any task is
//!   published, then the tasks go through the same path as `POST /v1/tasks`. **400** for an
//!   invalid envelope (`index` names it; `-1` for a callback or the body as a whole), an
//!   empty batch, more than
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
//! * The checks and the recording are [`crate::batch_def`]'s, shared with the AMQP form: a
//!   batch's closing message read by the ingress ([`crate::batch_close`]).
//! * `GET /v1/batches/{id}` (role `read`) → **200** [`fleet::batch::Progress`] (total,
//!   succeeded, dead, expired, cancelled, pending, waiting ids, failed ids, callbacks fired);
//!   **404** for a batch this replica has not read.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::json;

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

async fn submit_batch(State(st): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let key = st.cfg.common.auth.bound_key(&headers);
    let ctx = crate::batch_def::Ctx {
        limits: &st.cfg.common.limits,
        default_max_attempts: st.cfg.common.default_max_attempts,
        now: st.store.clock.now(),
        now_ms: st.store.clock.now_ms(),
        key: key.as_deref(),
    };
    // Checked before the definition is recorded: an invalid task refuses the whole batch.
    let def = match crate::batch_def::define(&body, crate::batch_def::Form::Api, &ctx) {
        Ok(d) => d,
        Err(r) => return (StatusCode::BAD_REQUEST, Json(r.to_json())).into_response(),
    };
    if let Some(detail) = crate::batch_def::conflict(&def, &st.batches) {
        return error(StatusCode::CONFLICT, "batch_exists", detail);
    }
    let committed = {
        let publisher = st.publisher.read().await;
        crate::batch_def::commit(
            &def,
            publisher.as_ref(),
            &st.store,
            &st.batches,
            st.cfg.common.status_ttl,
        )
        .await
    };
    if let Err(e) = committed {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "broker_unavailable",
            format!("the batch was not recorded (nothing submitted; try again): {e}"),
        );
    }
    if let Some(tasks) = def.publish {
        let answer = super::submit(State(st), headers, Bytes::from(tasks)).await;
        if answer.status() != StatusCode::ACCEPTED {
            return answer;
        }
    }
    let mut out = json!({"batch": def.batch, "ids": def.ids});
    if !def.waiting.is_empty() {
        out["waiting"] = json!(def.waiting);
    }
    (StatusCode::ACCEPTED, Json(out)).into_response()
}
