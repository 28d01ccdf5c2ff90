//! `POST /v1/tasks/{id}/cancel` (role `admin`), body optional `{"reason": "..."}`:
//!
//! * **202** `{"id", "state": "cancelled", "previous_state", "cancelled_by", "reason"}`: the
//!   cancel is a promise — its record is in the durable control stream (`<ns>.control`, see
//!   [`fleet::control`]) before this answer, and the task's status is marked `cancelled`. A
//!   task not yet running never runs (where its message is next reached it is moved to
//!   `<ns>.cancelled`, confirmed, then acked); a running one is stopped on its worker at once
//!   (its message moved the same way when the run ends); neither is retried nor
//!   dead-lettered. A bulk retry (`POST /v1/tasks/bulk`) runs it again from `<ns>.cancelled`
//!   as a new run.
//! * **200** the same body with `"already": true`: it was cancelled before (idempotent).
//! * **409** `{"error": "finished", "state"}`: it ended already (succeeded, dead, expired).
//! * **404** `unknown_task`: no status record (never seen, or older than the status TTL).
//! * **400** a body that is not a JSON object with an optional string `reason`.
//! * **503** the broker did not take the record (nothing promised), or Redis could not be read.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use fleet::control::{self, Mode, Record};
use fleet::status::TaskState;
use serde_json::{json, Value};

use super::{error, AppState};

/// The routes that act (role `admin`).
pub fn admin_routes() -> Router<AppState> {
    Router::new().route("/v1/tasks/{id}/cancel", post(cancel))
}

/// The request's `reason` (empty when absent); `Err` for a body that is not an object with an
/// optional string `reason`.
pub(super) fn reason_of(body: &[u8]) -> Result<String, String> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(String::new());
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => match m.get("reason") {
            None | Some(Value::Null) => Ok(String::new()),
            Some(Value::String(s)) => Ok(s.clone()),
            Some(_) => Err("`reason` must be a string".into()),
        },
        Ok(_) => Err("the body must be a JSON object".into()),
        Err(e) => Err(format!("malformed JSON: {e}")),
    }
}

async fn cancel(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    // Cut once, here: the stream's record, the Redis mark and the answer say the same.
    let reason = match reason_of(&body) {
        Ok(r) => fleet::status::truncate(&r, control::MAX_TEXT),
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_body", e),
    };
    let who = super::caller(&st, &headers);
    let by = who.name.clone();
    let answer = |status: StatusCode, previous: Option<&str>, already: bool| {
        let mut v =
            json!({"id": id, "state": TaskState::Cancelled, "cancelled_by": by, "reason": reason});
        if let Some(p) = previous {
            v["previous_state"] = json!(p);
        }
        if already {
            v["already"] = json!(true);
        }
        (status, Json(v)).into_response()
    };
    let state = match st.store.task_status(&id).await {
        Ok(Some(f)) => f.get("state").cloned().unwrap_or_default(),
        Ok(None) => {
            return error(
                StatusCode::NOT_FOUND,
                "unknown_task",
                format!("no status for task {id} (never seen, or older than the status TTL)"),
            )
        }
        Err(e) => return error(StatusCode::SERVICE_UNAVAILABLE, "redis", e.to_string()),
    };
    let finished = |state: &str| {
        (
            StatusCode::CONFLICT,
            Json(json!({"error": "finished", "id": id, "state": state, "detail": format!("task {id} has ended ({state}): nothing to cancel")})),
        )
            .into_response()
    };
    if state == TaskState::Cancelled.as_str() {
        return answer(StatusCode::OK, None, true);
    }
    if TaskState::is_terminal_word(&state) {
        return finished(&state);
    }
    // The promise first: the record in the durable stream, confirmed by the broker.
    let rec = Record::cancel(&id, &reason, &who, st.store.clock.now_ms());
    let appended = match st.publisher.read().await.as_ref() {
        Some(p) => control::append(p, &st.store.names, &rec).await,
        None => Err(fleet::Error::NotConnected),
    };
    if let Err(e) = appended {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "broker_unavailable",
            format!("the cancel was not recorded (nothing promised; try again): {e}"),
        );
    }
    // Then the fast copy. A Redis failure here does not undo the promise: every scheduler
    // replica writes the mark from the stream too (crate::control).
    let mark = [(id.clone(), rec.at_ms, by.clone(), reason.clone())];
    match st
        .store
        .cancel(Mode::Api, &mark, st.cfg.common.status_ttl)
        .await
        .map(|v| v.into_iter().next().flatten())
    {
        // This replica's (or another's) control loop applied this very record first: the
        // cancel is this request's, and the script kept the state it replaced.
        Ok(Some(prev)) if prev.starts_with("same:") => {
            metrics::counter!(fleet::metrics::TASKS_CANCELLED).increment(1);
            let replaced = prev.trim_start_matches("same:");
            answer(
                StatusCode::ACCEPTED,
                Some(if replaced.is_empty() {
                    &state
                } else {
                    replaced
                }),
                false,
            )
        }
        // Cancelled by another request between the read above and this one.
        Ok(Some(prev)) if prev == TaskState::Cancelled.as_str() => {
            answer(StatusCode::OK, None, true)
        }
        Ok(Some(prev)) if TaskState::is_terminal_word(&prev) => finished(&prev),
        Ok(prev) => {
            tracing::info!(task.id = %fleet::task::escape(&id), by = %by, previous = prev.as_deref().unwrap_or(""), "task cancelled");
            metrics::counter!(fleet::metrics::TASKS_CANCELLED).increment(1);
            answer(
                StatusCode::ACCEPTED,
                prev.as_deref().or(Some(&state)),
                false,
            )
        }
        Err(e) => {
            tracing::warn!(task.id = %fleet::task::escape(&id), error = %e, "cancel recorded in the control stream; its Redis mark follows from there");
            answer(StatusCode::ACCEPTED, Some(&state), false)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_is_optional_and_holds_a_reason() {
        assert_eq!(reason_of(b""), Ok(String::new()));
        assert_eq!(reason_of(b"  \n"), Ok(String::new()));
        assert_eq!(reason_of(b"{}"), Ok(String::new()));
        assert_eq!(reason_of(br#"{"reason": null}"#), Ok(String::new()));
        assert_eq!(
            reason_of(br#"{"reason": "bad deploy"}"#),
            Ok("bad deploy".into())
        );
        assert!(reason_of(br#"{"reason": 3}"#).is_err());
        assert!(reason_of(b"[]").is_err());
        assert!(reason_of(b"{").is_err());
    }
}
