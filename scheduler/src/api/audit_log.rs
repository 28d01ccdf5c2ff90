//! Who did what: the caller of a request, the audit records operator actions append, and
//! `GET /v1/audit` (role `read`).
//!
//! The log is the control stream ([`fleet::control`]): every action appends a record once it
//! was applied ([`audit`]), a cancel is its own record, and every replica folds the stream into
//! its [`AuditLog`] — so the log is the same through every replica and survives a Redis loss.
//!
//! `GET /v1/audit?action=&by=&since=&until=&limit=&cursor=` answers, newest first:
//! `{"entries": [{"id", "at", "at_ms", "action", "target", "count", "by", "role", "reason"}],
//! "total", "cursor", "as_of", "retention_seconds"}` — `total` counts every entry matching the
//! filters, `cursor` (absent on the last page) is passed back for the next page, `since` and
//! `until` are RFC 3339 times or Unix ms, `limit` is 1-1000 (default 100). 400 names a bad
//! parameter; 503 `audit_loading` until this replica has read the stream up to its own barrier
//! record (its log is complete from then on).

use std::collections::HashMap;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use fleet::control::{self, AuditQuery, Record};
use fleet::settings::Caller;
use serde_json::{json, Value};

use super::{error, AppState};

/// Tries an audit record gets before the failure is logged (the action stands either way).
const APPEND_TRIES: u32 = 3;
/// Pause between those tries.
const APPEND_BACKOFF: Duration = Duration::from_millis(250);
/// Largest page.
const MAX_LIMIT: usize = 1000;

/// The routes that read (role `read`).
pub fn read_routes() -> Router<AppState> {
    Router::new().route("/v1/audit", get(list))
}

/// Who makes the request: the token's name and role, or [`Caller::anonymous`] on an open API
/// (the route's guard has already let it through).
pub(crate) fn caller(st: &AppState, headers: &HeaderMap) -> Caller {
    caller_of(&st.cfg.common.auth, headers)
}

/// [`caller`] for handlers with another state (the schedules API).
pub(crate) fn caller_of(auth: &fleet::settings::ApiAuth, headers: &HeaderMap) -> Caller {
    auth.identify(headers)
}

/// Appends the audit record of an action that was applied: `who` did `action` on `target`,
/// touching `count`. Errors: the broker did not take it after [`APPEND_TRIES`] (logged here;
/// the action stands — callers answer as they would).
pub(crate) async fn audit(
    st: &AppState,
    who: &Caller,
    action: &str,
    target: Value,
    count: u64,
) -> fleet::Result<()> {
    audit_to(&st.publisher, &st.store, who, action, target, count, "").await
}

/// [`audit`] through a publisher slot and store of the caller's own (the schedules API).
pub(crate) async fn audit_to(
    publisher: &tokio::sync::RwLock<Option<fleet::broker::amqp::Publisher>>,
    store: &fleet::Store,
    who: &Caller,
    action: &str,
    target: Value,
    count: u64,
    reason: &str,
) -> fleet::Result<()> {
    let rec = Record::audit(action, target, count, who, reason, store.clock.now_ms());
    let mut last = fleet::Error::NotConnected;
    for n in 0..APPEND_TRIES {
        if n > 0 {
            tokio::time::sleep(APPEND_BACKOFF).await;
        }
        let r = match publisher.read().await.as_ref() {
            Some(p) => control::append(p, &store.names, &rec).await,
            None => Err(fleet::Error::NotConnected),
        };
        match r {
            Ok(()) => return Ok(()),
            Err(e) => last = e,
        }
    }
    tracing::error!(action, by = %who.name, error = %last, "an operator action was applied but its audit record was not written");
    Err(last)
}

/// A time parameter: RFC 3339 or Unix ms.
fn time_param(name: &str, v: &str) -> Result<i64, String> {
    if let Ok(ms) = v.parse::<i64>() {
        return Ok(ms);
    }
    chrono::DateTime::parse_from_rfc3339(v)
        .map(|t| t.timestamp_millis())
        .map_err(|_| format!("`{name}` must be an RFC 3339 time or Unix ms, not {v:?}"))
}

/// The query of a request; `Err` names the bad parameter.
fn query_of(p: &HashMap<String, String>) -> Result<AuditQuery, String> {
    let mut q = AuditQuery {
        limit: 100,
        ..AuditQuery::default()
    };
    for (k, v) in p {
        match k.as_str() {
            "action" => q.action = Some(v.clone()),
            "by" => q.by = Some(v.clone()),
            "since" => q.since_ms = Some(time_param(k, v)?),
            "until" => q.until_ms = Some(time_param(k, v)?),
            "limit" => {
                q.limit = v
                    .parse::<usize>()
                    .ok()
                    .filter(|n| (1..=MAX_LIMIT).contains(n))
                    .ok_or_else(|| format!("`limit` must be 1-{MAX_LIMIT}"))?
            }
            "cursor" => {
                let (at, id) = v
                    .split_once('_')
                    .and_then(|(at, id)| Some((at.parse::<i64>().ok()?, id.to_string())))
                    .ok_or("`cursor` is not one this API gave")?;
                q.before = Some((at, id));
            }
            other => return Err(format!("unknown parameter `{other}`")),
        }
    }
    Ok(q)
}

async fn list(State(st): State<AppState>, Query(p): Query<HashMap<String, String>>) -> Response {
    let q = match query_of(&p) {
        Ok(q) => q,
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_query", e),
    };
    // A replica that has not read the stream up to its barrier yet would show part of the log.
    if !st.audit.loaded() {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "audit_loading",
            "this scheduler has not read the control stream yet; ask again in a moment",
        );
    }
    let (page, total) = st.audit.list(&q);
    let cursor = (page.len() == q.limit)
        .then(|| page.last().map(|e| format!("{}_{}", e.at_ms, e.id)))
        .flatten();
    let entries: Vec<Value> = page
        .into_iter()
        .map(|e| {
            let mut v = serde_json::to_value(&e).unwrap_or_default();
            v["at"] = json!(fleet::status::rfc3339_ms(e.at_ms));
            v
        })
        .collect();
    let mut body = json!({
        "entries": entries,
        "total": total,
        "as_of": fleet::status::rfc3339_ms(st.store.clock.now_ms()),
        "retention_seconds": control::MAX_AGE.as_secs(),
    });
    if let Some(c) = cursor {
        body["cursor"] = json!(c);
    }
    Json(body).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(pairs: &[(&str, &str)]) -> Result<AuditQuery, String> {
        query_of(
            &pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    #[test]
    fn parameters_are_checked_and_named() {
        let ok = q(&[
            ("action", "drain"),
            ("since", "2026-12-03T10:00:00Z"),
            ("until", "5"),
            ("limit", "7"),
            ("cursor", "12_abc"),
        ])
        .unwrap();
        assert_eq!(ok.action.as_deref(), Some("drain"));
        assert_eq!(ok.since_ms, Some(1_796_292_000_000));
        assert_eq!((ok.until_ms, ok.limit), (Some(5), 7));
        assert_eq!(ok.before, Some((12, "abc".into())));
        assert!(q(&[("limit", "0")]).unwrap_err().contains("limit"));
        assert!(q(&[("since", "yesterday")]).unwrap_err().contains("since"));
        assert!(q(&[("cursor", "x")]).unwrap_err().contains("cursor"));
        assert!(q(&[("who", "x")]).unwrap_err().contains("who"));
    }
}
