//! Dead letters over HTTP, through `fleet::broker::dead` (the same code as `fleetctl dead`):
//!
//! * `GET /v1/dead?reason=R&kind=K&scan=N` → `{"depth", "scanned", "letters": [...],
//!   "reasons": {reason: count}, "kinds": {kind: count}}`: the first `N` letters of the dead
//!   queue (default 500, at most 5000) read without removing them; `letters` holds those
//!   matching the filters, `reasons`/`kinds` count all scanned ones (the filter's choices).
//! * `GET /v1/dead/{id}` → that letter (404 if not among the first 5000).
//! * `POST /v1/dead/replay` with `{"ids": [...]}` or `{"all": true}`, either optionally with
//!   `"reason"` and `"kind"` filters → 200 `{"replayed": [...], "failed": [[id, why]],
//!   "missing": [...]}`; 400 for a body that selects nothing. A letter is not replayed (it is
//!   in `failed`, with why, and stays in the dead queue) when it is still over the size limit
//!   without fleet's own fields (`oversized`: it would only die again), when its id is in
//!   flight (another letter of it was replayed, here or on another replica), or when it is no
//!   envelope.
//!
//! Every reader takes the namespace's dead-queue lease in Redis (`fleet::broker::dead::ReaderLease`),
//! so a listing is complete while other replicas list or replay. 503 while the scheduler has
//! no broker connection, Redis is unreachable, or the lease stays taken (`busy`).

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use fleet::broker::dead::{self, Selection};
use serde::Deserialize;
use serde_json::json;

use super::{error, AppState};

/// Default and largest number of letters a listing reads.
const SCAN_DEFAULT: u32 = 500;
const SCAN_MAX: u32 = 5000;

/// The routes that only read (role `read`).
pub fn read_routes() -> Router<AppState> {
    Router::new()
        .route("/v1/dead", get(list))
        .route("/v1/dead/{id}", get(one))
}

/// The routes that act (role `admin`).
pub fn admin_routes() -> Router<AppState> {
    Router::new().route("/v1/dead/replay", post(replay))
}

#[derive(Debug, Deserialize)]
struct ListQuery {
    reason: Option<String>,
    kind: Option<String>,
    scan: Option<u32>,
}

#[derive(Debug, Deserialize)]
struct ReplayBody {
    ids: Option<Vec<String>>,
    #[serde(default)]
    all: bool,
    reason: Option<String>,
    kind: Option<String>,
}

async fn connection(st: &AppState) -> Result<Arc<lapin::Connection>, Response> {
    st.connection.read().await.clone().ok_or_else(|| {
        error(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_connected",
            "the scheduler is reconnecting to RabbitMQ",
        )
    })
}

/// 503 with what failed: the broker, Redis (the reader lease and the per-id claims live
/// there), or the lease held elsewhere past `dead::LEASE_WAIT`.
fn broker_error(e: fleet::Error) -> Response {
    let code = match &e {
        fleet::Error::Busy(_) => "busy",
        fleet::Error::Redis(_) | fleet::Error::Pool(_) => "redis",
        _ => "amqp",
    };
    error(StatusCode::SERVICE_UNAVAILABLE, code, e.to_string())
}

fn blank(s: Option<String>) -> Option<String> {
    s.filter(|s| !s.is_empty())
}

async fn list(State(st): State<AppState>, Query(q): Query<ListQuery>) -> Response {
    let conn = match connection(&st).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    let scan = q.scan.unwrap_or(SCAN_DEFAULT).clamp(1, SCAN_MAX);
    let listing = {
        let Ok(_permit) = st.dead_reader.acquire().await else {
            return error(StatusCode::SERVICE_UNAVAILABLE, "closed", "shutting down");
        };
        match dead::list(&conn, Some(&st.store), &st.store.names, scan).await {
            Ok(l) => l,
            Err(e) => return broker_error(e),
        }
    };
    let mut reasons: BTreeMap<String, u32> = BTreeMap::new();
    let mut kinds: BTreeMap<String, u32> = BTreeMap::new();
    for d in &listing.letters {
        *reasons.entry(d.reason.clone()).or_default() += 1;
        *kinds.entry(d.kind.clone()).or_default() += 1;
    }
    let filter = Selection {
        ids: None,
        reason: blank(q.reason),
        kind: blank(q.kind),
    };
    let scanned = listing.letters.len();
    let letters: Vec<_> = listing
        .letters
        .into_iter()
        .filter(|d| filter.matches(d))
        .collect();
    Json(json!({"depth": listing.depth, "scanned": scanned, "letters": letters, "reasons": reasons, "kinds": kinds})).into_response()
}

async fn one(State(st): State<AppState>, Path(id): Path<String>) -> Response {
    let conn = match connection(&st).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    let Ok(_permit) = st.dead_reader.acquire().await else {
        return error(StatusCode::SERVICE_UNAVAILABLE, "closed", "shutting down");
    };
    match dead::list(&conn, Some(&st.store), &st.store.names, SCAN_MAX).await {
        Ok(l) => match l.letters.into_iter().find(|d| d.id == id) {
            Some(d) => Json(d).into_response(),
            None => error(
                StatusCode::NOT_FOUND,
                "unknown_dead_letter",
                format!("no dead letter with id {id} among the first {SCAN_MAX}"),
            ),
        },
        Err(e) => broker_error(e),
    }
}

async fn replay(
    State(st): State<AppState>,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let b: ReplayBody = match serde_json::from_slice(&body) {
        Ok(b) => b,
        Err(e) => return error(StatusCode::BAD_REQUEST, "malformed_json", e.to_string()),
    };
    let sel = match (b.ids, b.all) {
        (Some(ids), false) if !ids.is_empty() => Selection {
            ids: Some(ids.into_iter().collect()),
            reason: blank(b.reason),
            kind: blank(b.kind),
        },
        (None, true) => Selection {
            ids: None,
            reason: blank(b.reason),
            kind: blank(b.kind),
        },
        _ => {
            return error(
                StatusCode::BAD_REQUEST,
                "no_selection",
                "give a non-empty \"ids\" array or \"all\": true (not both)",
            )
        }
    };
    let conn = match connection(&st).await {
        Ok(c) => c,
        Err(r) => return r,
    };
    let Ok(_permit) = st.dead_reader.acquire().await else {
        return error(StatusCode::SERVICE_UNAVAILABLE, "closed", "shutting down");
    };
    let limits = dead::ReplayLimits {
        max_bytes: st.cfg.common.limits.max_bytes,
        status_ttl: st.cfg.common.status_ttl,
    };
    match dead::replay(&conn, Some(&st.store), &st.store.names, &sel, &limits).await {
        Ok(report) => {
            tracing::info!(
                replayed = report.replayed.len(),
                failed = report.failed.len(),
                missing = report.missing.len(),
                "dead letters replayed through the API"
            );
            let target = json!({
                "ids": sel.ids.as_ref().map(|ids| ids.iter().take(100).collect::<Vec<_>>()),
                "all": sel.ids.is_none(),
                "reason": sel.reason,
                "kind": sel.kind,
            });
            let who = super::caller(&st, &headers);
            let n = report.replayed.len() as u64;
            let _ = super::audit(&st, &who, "replay", target, n).await;
            Json(report).into_response()
        }
        Err(e) => broker_error(e),
    }
}
