//! Acting on a batch as a whole ([`fleet::batch`]; issue 36).
//!
//! # `POST /v1/batches/{id}/cancel` (role `admin`)
//!
//! Body optional: `{"reason"?: string}`. Answers:
//!
//! * **202** `{"batch", "total", "cancelled", "already_ended", "failed", "cancel": {"record",
//!   "at_ms", "by", "role", "reason"}}` — `cancelled`: members this request cancelled (not yet
//!   ended, waiting DAG members included); `already_ended`: members that had ended (any final
//!   state, an earlier cancel included) — a member running as the cancel comes may still end
//!   `succeeded` when its handler returned before its worker read the cancel, so the batch's
//!   figures may then count it succeeded; `failed`: members whose own cancel record the broker
//!   refused — the batch's cancel still covers them (see below); `cancelled + already_ended +
//!   failed = total`. With `"already": true` when the batch was cancelled before: the members
//!   not yet ended are cancelled again (idempotent; it finishes a cancel a crash cut short), no
//!   new record, no new audit entry.
//! * **409** `{"error": "finished"}`: every member ended before (its callbacks fire, or did).
//! * **404** `unknown_batch`: no definition of it read by this replica.
//! * **400** a body that is not a JSON object with an optional string `reason`.
//! * **503** the broker did not take the batch's cancel record (nothing promised).
//!
//! # The promise, and why its record comes first
//!
//! The batch's cancel record ([`fleet::control::Op::BatchCancel`]) is appended to the control
//! stream (confirmed) **before** any member is touched: that record is the promise. Every
//! replica folds the stream in order, and a folded cancel makes the batch fire nothing
//! ([`fleet::batch::Batches::due`]) and release nothing. Had a member's cancel come first, a
//! replica could read the last pending member end `cancelled`, see the batch complete and fire
//! `on_complete` before it read the batch's cancel.
//!
//! Then every member not yet ended is cancelled exactly as `POST /v1/tasks/bulk` does it, in
//! paced batches of [`super::tasks::BATCH`]: one [`fleet::control::Op::Cancel`] per member
//! (its `bulk` naming the batch's record, so the audit log has one entry, `batch_cancel`,
//! for the whole batch), confirms awaited, then the Redis marks (`cancel.lua`). Those records
//! are what makes each member's cancel hold like a single cancel: every worker stops or
//! refuses the member from its memory of the stream, every scheduler replica writes the marks
//! again after a Redis loss, a restarted process reads them again. A waiting DAG member
//! (`after`) is never released (the fold of the batch's cancel ends it) and its status is
//! marked `cancelled` by its record. A replica that stops between the batch's record and the
//! last member's leaves the rest to the workers: a member copy of a batch cancelled as a
//! whole is refused like a cancelled task ([`fleet::control::Cancels::get_batch`]) — and a
//! second request finishes the marks.

use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use fleet::control;
use fleet::status::TaskState;
use serde_json::json;

use super::{error, AppState};

/// How long a batch-cancel request waits for this replica's control loop to fold its record.
const FOLD_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// The routes that act on a batch (role `admin`).
pub fn admin_routes() -> Router<AppState> {
    Router::new().route("/v1/batches/{id}/cancel", post(cancel_batch))
}

/// What cancelling the members did.
#[derive(Default, Debug)]
struct Count {
    cancelled: u64,
    already_ended: u64,
    failed: u64,
}

async fn cancel_batch(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> Response {
    let reason = match super::cancel::reason_of(&body) {
        Ok(r) => fleet::status::truncate(&r, control::MAX_TEXT),
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_body", e),
    };
    let (Some(progress), Some(members)) = (st.batches.progress(&id), st.batches.to_cancel(&id))
    else {
        return error(
            StatusCode::NOT_FOUND,
            "unknown_batch",
            format!(
                "no batch {id} (never submitted, or older than the control stream's retention)"
            ),
        );
    };
    let already = progress.cancel.is_some();
    if !already && progress.complete {
        return (
            StatusCode::CONFLICT,
            Json(json!({"error": "finished", "batch": id, "detail": format!("every member of batch {id} has ended: nothing to cancel")})),
        )
            .into_response();
    }
    let who = super::caller(&st, &headers);
    // The batch's cancel record, and the time every member's own record carries: the batch
    // record's on the first request, so that a member a worker already marked from the batch's
    // record alone (refused, `cancelled_at` the batch's) counts as cancelled by this request
    // (`cancel.lua`'s `same:`); this request's own on a repeat (`already`), so that what an
    // earlier request (or a worker) marked counts as already ended, not again.
    let (record, at_ms) = match &progress.cancel {
        Some(c) => (c.record.clone(), st.store.clock.now_ms()),
        None => {
            // The promise first: the batch's record, confirmed, before any member's.
            let rec = fleet::batch::cancel_record(
                &id,
                &reason,
                &who,
                members.len() as u64,
                st.store.clock.now_ms(),
            );
            let appended = match st.publisher.read().await.as_ref() {
                Some(p) => control::append(p, &st.store.names, &rec).await,
                None => Err(fleet::Error::NotConnected),
            };
            if let Err(e) = appended {
                return error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "broker_unavailable",
                    format!(
                        "the batch's cancel was not recorded (nothing promised; try again): {e}"
                    ),
                );
            }
            // Stream order decides whether it came before the last member's end: wait for this
            // replica's control loop to fold it (as every replica will), then answer by what
            // it did there. Not folded within FOLD_WAIT (the control loop behind): it is
            // applied here, as every reader will apply it.
            let waited = tokio::time::timeout(FOLD_WAIT, async {
                loop {
                    if let Some(o) = st.batches.cancel_outcome(&id, &rec.id) {
                        return o;
                    }
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                }
            })
            .await;
            match waited {
                Ok(fleet::batch::CancelOutcome::Late) => {
                    return (
                        StatusCode::CONFLICT,
                        Json(json!({"error": "finished", "batch": id, "detail": format!("every member of batch {id} had ended before the cancel was recorded: it completed, its callbacks fire, nothing was cancelled")})),
                    )
                        .into_response();
                }
                Ok(fleet::batch::CancelOutcome::Held) => {}
                Err(_) => {
                    st.batches.apply(&rec);
                }
            }
            (rec.id, rec.at_ms)
        }
    };
    let mut n = cancel_members(&st, &members, &who, &reason, (&record, at_ms)).await;
    n.already_ended += (progress.total as u64).saturating_sub(members.len() as u64);
    let cancel = st.batches.progress(&id).and_then(|p| p.cancel);
    tracing::info!(batch = %fleet::task::escape(&id), by = %who.name, cancelled = n.cancelled, already_ended = n.already_ended, failed = n.failed, already, "batch cancelled");
    let mut out = json!({
        "batch": id,
        "total": progress.total,
        "cancelled": n.cancelled,
        "already_ended": n.already_ended,
        "failed": n.failed,
        "cancel": cancel,
    });
    if already {
        out["already"] = json!(true);
    }
    (StatusCode::ACCEPTED, Json(out)).into_response()
}

/// Cancels `ids` as the bulk cancel does (paced batches: records appended together, confirms
/// awaited, then `cancel.lua`), each record naming `bulk` (the batch's cancel record) and
/// carrying the time `at_ms`. A member without a status record in Redis (lost with it) counts
/// as cancelled: its record is in the stream, which the workers and the replicas' mark replay
/// follow.
async fn cancel_members(
    st: &AppState,
    ids: &[String],
    who: &fleet::settings::Caller,
    reason: &str,
    (bulk, at_ms): (&str, i64),
) -> Count {
    let mut n = Count::default();
    let start = Instant::now();
    let mut done = 0;
    for chunk in ids.chunks(super::tasks::BATCH) {
        super::tasks::pace(start, done).await;
        done += chunk.len();
        let a = super::tasks::append_cancels(st, chunk, who, reason, bulk, at_ms).await;
        for (task, e) in a.refused {
            tracing::warn!(task.id = %fleet::task::escape(&task), error = %e, "a batch member's cancel was not recorded (the batch's cancel still covers it)");
            n.failed += 1;
        }
        match a.marks {
            Ok(prev) => {
                for p in prev {
                    match p {
                        Some(p) if p.starts_with("same:") => n.cancelled += 1,
                        Some(p) if TaskState::is_terminal_word(&p) => n.already_ended += 1,
                        _ => n.cancelled += 1,
                    }
                }
            }
            Err((k, e)) => {
                tracing::warn!(error = %e, n = k, "batch members' cancels recorded in the control stream; their Redis marks follow from there");
                n.cancelled += k;
            }
        }
    }
    metrics::counter!(fleet::metrics::TASKS_CANCELLED).increment(n.cancelled);
    n
}
