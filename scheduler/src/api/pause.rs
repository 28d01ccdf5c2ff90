//! Pause and resume ([`crate::pause`]): durable, in the control stream.
//!
//! * `POST /v1/pauses` (role `admin`), body
//!   `{"scope": "group", "group": G}` | `{"scope": "lane", "group": G, "lane": "normal"|"critical"}`
//!   | `{"scope": "kind", "kind": K}` | `{"scope": "key", "key": K}` (a fairness key, see
//!   [`super::keys`]) | `{"scope": "batch", "batch": B}` (a batch, [`fleet::batch`]: its
//!   members wait in its hold queue, its waiting members are not released and its callbacks
//!   wait until the resume; members already in a group's queue still run), with an optional
//!   `"reason"`:
//!   * **202** `{"pause": P}` — a promise: the record is in the durable control stream
//!     (confirmed by the broker) **and** this replica applied it before answering, so this
//!     replica dispatches nothing paused from now on; other replicas follow within
//!     milliseconds. Tasks already in the group's queue still run (as in a drain).
//!   * **200** `{"pause": P, "already": true}` — it was paused already (nothing appended).
//! * `POST /v1/pauses/resume` (role `admin`), the same body (`reason` ignored):
//!   * **202** `{"resumed": T}` once recorded and applied here; resuming a group resumes its
//!     lanes too.
//!   * **200** `{"resumed": T, "already": true}` — it was not paused.
//!   * **409** `paused_by_group` — a lane whose whole group is paused (resume the group).
//! * `GET /v1/pauses` (role `read`): `{"pauses": [P...]}`, each
//!   `P = {"scope", "group"?, "lane"?, "kind"?, "key"?, "batch"?, "since", "since_ms", "by",
//!   "reason", "held"?}` (`since`: RFC 3339 UTC; `held`: for a kind or a batch, the tasks in
//!   its hold queues at the last stats sample, taken every second or so).
//!
//! Each pause and resume applied is also an entry of the audit log (`pause`, `resume`, with the
//! target and the token's name: [`super::audit`]).
//!
//! Errors: **400** a body that is not such an object (empty names, an unknown scope or lane);
//! **503** `broker_unavailable` (the broker did not take the record: nothing promised) or
//! `not_applied` (recorded — it will hold — but this replica had not applied it within
//! [`APPLY_WAIT`]; asking again answers 200 once it has).

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use fleet::control::{self, Pause, Record, Target};
use serde_json::{json, Value};

use super::{error, AppState};

/// How long a request waits for this replica's control loop to apply its record.
pub const APPLY_WAIT: Duration = Duration::from_secs(10);

/// The routes that read (role `read`).
pub fn read_routes() -> Router<AppState> {
    Router::new().route("/v1/pauses", get(list))
}

/// The routes that act (role `admin`).
pub fn admin_routes() -> Router<AppState> {
    Router::new()
        .route("/v1/pauses", post(pause))
        .route("/v1/pauses/resume", post(resume))
}

/// The target and reason of a request body; `Err` with why it is refused.
fn parse(body: &[u8]) -> Result<(Target, String), String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("malformed JSON: {e}"))?;
    let Value::Object(m) = &v else {
        return Err("the body must be a JSON object".into());
    };
    let reason = match m.get("reason") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err("`reason` must be a string".into()),
    };
    let target: Target = serde_json::from_value(v.clone()).map_err(|e| {
        format!("expected {{\"scope\": \"group\"|\"lane\"|\"kind\"|\"key\"|\"batch\", \"group\", \"lane\", \"kind\", \"key\", \"batch\"}}: {e}")
    })?;
    let empty = match &target {
        Target::Group { group } | Target::Lane { group, .. } => group.is_empty(),
        Target::Kind { kind } => kind.is_empty(),
        Target::Key { key } => fleet::task::check_key(key).is_err(),
        Target::Batch { batch } => {
            batch.is_empty() || batch.len() > 128 || batch.chars().any(char::is_control)
        }
    };
    if empty {
        return Err(
            "the group or kind must not be empty, a key 1-64 bytes of [A-Za-z0-9_.:@/-], a batch 1-128 bytes without control characters".into(),
        );
    }
    Ok((target.bounded(), reason))
}

/// A pause as the API shows it (`held`: tasks in a kind's hold queues, when known).
pub fn show(p: &Pause, held: Option<u64>) -> Value {
    let mut v = serde_json::to_value(&p.target).unwrap_or_default();
    if let Value::Object(o) = &mut v {
        o.insert("since".into(), json!(fleet::status::rfc3339_ms(p.since_ms)));
        o.insert("since_ms".into(), json!(p.since_ms));
        o.insert("by".into(), json!(p.by));
        o.insert("reason".into(), json!(p.reason));
        if let Some(h) = held {
            o.insert("held".into(), json!(h));
        }
    }
    v
}

/// Appends `rec` and waits until this replica applied it: `Ok` then, `Err` with the answer
/// otherwise.
pub(super) async fn record(st: &AppState, rec: &Record) -> Result<(), Response> {
    let applied = st.pauses.wait_for(&rec.id);
    let appended = match st.publisher.read().await.as_ref() {
        Some(p) => control::append(p, &st.store.names, rec).await,
        None => Err(fleet::Error::NotConnected),
    };
    if let Err(e) = appended {
        st.pauses.forget(&rec.id);
        return Err(error(
            StatusCode::SERVICE_UNAVAILABLE,
            "broker_unavailable",
            format!("not recorded (nothing promised; try again): {e}"),
        ));
    }
    match tokio::time::timeout(APPLY_WAIT, applied).await {
        Ok(Ok(())) => Ok(()),
        _ => {
            st.pauses.forget(&rec.id);
            Err(error(
                StatusCode::SERVICE_UNAVAILABLE,
                "not_applied",
                format!("recorded in the control stream (it will take effect), but this scheduler had not applied it within {} s (reconnecting?); ask again", APPLY_WAIT.as_secs()),
            ))
        }
    }
}

async fn pause(State(st): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let (target, reason) = match parse(&body) {
        Ok(t) => t,
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_body", e),
    };
    if let Some(p) = st.pauses.current().get(&target) {
        return (
            StatusCode::OK,
            Json(json!({"pause": show(p, None), "already": true})),
        )
            .into_response();
    }
    let who = super::caller(&st, &headers);
    let rec = Record::pause(target.clone(), &reason, &who.name, st.store.clock.now_ms());
    if let Err(answer) = record(&st, &rec).await {
        return answer;
    }
    // The audit log's entry (the pause holds whether or not it is written: logged there).
    let _ = super::audit_to(
        &st.publisher,
        &st.store,
        &who,
        "pause",
        json!(target),
        0,
        &reason,
    )
    .await;
    tracing::info!(target = ?target, by = %who.name, "pause recorded");
    let now = st.pauses.current();
    let shown = now
        .get(&target)
        .map(|p| show(p, None))
        .unwrap_or_else(|| json!(target));
    (StatusCode::ACCEPTED, Json(json!({"pause": shown}))).into_response()
}

async fn resume(State(st): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    let (target, _) = match parse(&body) {
        Ok(t) => t,
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_body", e),
    };
    let set = st.pauses.current();
    if let Target::Lane { group, .. } = &target {
        if set
            .get(&Target::Group {
                group: group.clone(),
            })
            .is_some()
        {
            return error(
                StatusCode::CONFLICT,
                "paused_by_group",
                format!("the whole group {group} is paused: resume the group"),
            );
        }
    }
    let paused = match &target {
        Target::Group { group } => set
            .all()
            .any(|p| matches!(&p.target, Target::Group { group: g } | Target::Lane { group: g, .. } if g == group)),
        t => set.get(t).is_some(),
    };
    if !paused {
        return (
            StatusCode::OK,
            Json(json!({"resumed": target, "already": true})),
        )
            .into_response();
    }
    let who = super::caller(&st, &headers);
    let rec = Record::resume(target.clone(), &who.name, st.store.clock.now_ms());
    if let Err(answer) = record(&st, &rec).await {
        return answer;
    }
    let _ = super::audit(&st, &who, "resume", json!(target), 0).await;
    tracing::info!(target = ?target, by = %who.name, "resume recorded");
    (StatusCode::ACCEPTED, Json(json!({"resumed": target}))).into_response()
}

async fn list(State(st): State<AppState>) -> Response {
    let set = st.pauses.current();
    let held = st.pauses.held();
    let out: Vec<Value> = set
        .all()
        .map(|p| {
            let h = p
                .target
                .holds()
                .then(|| held.get(&p.target).copied().unwrap_or(0));
            show(p, h)
        })
        .collect();
    Json(json!({"pauses": out})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use fleet::Lane;

    #[test]
    fn a_body_names_one_target() {
        assert_eq!(
            parse(br#"{"scope":"group","group":"pool=a","reason":"deploy"}"#),
            Ok((
                Target::Group {
                    group: "pool=a".into()
                },
                "deploy".into()
            ))
        );
        assert_eq!(
            parse(br#"{"scope":"lane","group":"g","lane":"critical"}"#),
            Ok((
                Target::Lane {
                    group: "g".into(),
                    lane: Lane::Critical
                },
                String::new()
            ))
        );
        assert_eq!(
            parse(br#"{"scope":"kind","kind":"resize"}"#).map(|t| t.0),
            Ok(Target::Kind {
                kind: "resize".into()
            })
        );
        for bad in [
            &br#"{"scope":"tenant","key":"x"}"#[..],
            br#"{"scope":"lane","group":"g","lane":"slow"}"#,
            br#"{"scope":"group","group":""}"#,
            br#"{"scope":"kind"}"#,
            br#"{"scope":"group","group":"g","reason":3}"#,
            b"[]",
            b"{",
        ] {
            assert!(parse(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }
}
