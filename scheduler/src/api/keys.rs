//! Fairness keys (tenants, [`fleet::control::KeyLimits`]): their limits and figures.
//!
//! * `GET /v1/keys` (role `read`): every key known — with a recent activity in Redis (the
//!   `kf` hash; a key idle for `FLEET_KEY_FORGET_MS` is forgotten), a lease not lapsed (the
//!   `ka` set), limits of its own (settings or runtime) or paused — sorted by tasks
//!   waiting (most first), then name:
//!   `{"keys": [K...], "default": D, "as_of", "as_of_ms"}`, each
//!   `K = {"key", "running", "reserved", "waiting", "dispatched", "max_running", "min_running",
//!   "rate", "burst", "weight", "paused", "source", "last_activity"?, "set_by"?, "set_at"?,
//!   "reason"?}` — the limits in force (merged: the key's spec over the default spec;
//!   `max_running`/`rate`/`burst` `null`: no limit), `source` where the key's own spec comes
//!   from (`runtime`: a `PUT` in force, `settings`: `FLEET_KEY_LIMITS`, `default`: none of its
//!   own), `running`/`reserved` counted from the leases not lapsed at `as_of` (Redis time),
//!   `waiting` parked now, `dispatched` in all. `D` = the default spec in force with its
//!   `source` (`runtime` or `settings`).
//! * `GET /v1/keys/{key}` (role `read`): one key's `K` (a key never seen: zeros); `*`: `D`.
//! * `PUT /v1/keys/{key}/limits` (role `admin`), body a spec `{"max_running", "min_running",
//!   "rate", "burst", "weight"}` (each optional; `null` = unset) with an optional `"reason"`;
//!   `{}` clears the runtime spec (the key gets its settings' spec again). Key `*` sets the
//!   **default spec** (every key's fields it leaves unset; `*` is no valid key, so it names
//!   nothing else; `_default` is the key of the tasks that carry none). A runtime spec
//!   *replaces* the settings' spec of its key.
//!   * **202** `{"key", "spec", "limits": K}` — a promise: the `key_limit` record is in the
//!     durable control stream (confirmed by the broker) and this replica applied it; other
//!     replicas follow within milliseconds. The record is the audit entry (`key_limit`).
//!   * **200** `{..., "already": true}` — that spec is in force already (nothing appended).
//!   * **400** `bad_key` (1-64 bytes of `[A-Za-z0-9_.:@/-]`) or `bad_body` naming the field;
//!     **503** `broker_unavailable` / `not_applied` as for pauses ([`super::pause`]).

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, put};
use axum::{Json, Router};
use fleet::control::{KeyFigures, KeyLimitSpec, KeyLimits, KeyOverrides, PauseSet, Record};
use serde_json::{json, Value};

use super::{error, AppState};

/// The key of the default spec in paths: no valid key is `*`.
pub const DEFAULT_PATH: &str = "*";

/// The routes that read (role `read`).
pub fn read_routes() -> Router<AppState> {
    Router::new()
        .route("/v1/keys", get(list))
        .route("/v1/keys/{key}", get(one))
}

/// The routes that act (role `admin`).
pub fn admin_routes() -> Router<AppState> {
    Router::new().route("/v1/keys/{key}/limits", put(set))
}

/// What a row is made of besides the figures.
struct Limits<'a> {
    limits: &'a KeyLimits,
    settings: &'a KeyLimits,
    overrides: &'a KeyOverrides,
    paused: &'a PauseSet,
}

impl Limits<'_> {
    /// The row of `key`.
    fn row(&self, key: &str, f: &KeyFigures) -> Value {
        let l = self.limits.for_key(key);
        let mut v = json!({
            "key": key,
            "running": f.running,
            "reserved": f.reserved,
            "waiting": f.waiting,
            "dispatched": f.dispatched,
            "max_running": l.max_running,
            "min_running": l.min_running,
            "rate": l.rate.map(|r| r.0),
            "burst": l.rate.map(|r| r.1),
            "weight": l.weight,
            "paused": self.paused.key_paused(key),
        });
        if f.last_ms > 0 {
            v["last_activity"] = json!(fleet::status::rfc3339_ms(f.last_ms));
        }
        self.source(Some(key), &mut v);
        v
    }

    /// The default spec in force.
    fn default(&self) -> Value {
        let mut v = serde_json::to_value(&self.limits.default).unwrap_or_default();
        self.source(None, &mut v);
        v
    }

    /// Adds where the spec of `key` (`None`: the default) comes from, and who set it.
    fn source(&self, key: Option<&str>, v: &mut Value) {
        let source = match (self.overrides.get(key), key) {
            (Some(o), _) => {
                v["set_by"] = json!(o.by);
                v["set_at"] = json!(fleet::status::rfc3339_ms(o.since_ms));
                v["reason"] = json!(o.reason);
                "runtime"
            }
            (None, None) => "settings",
            (None, Some(k)) if self.settings.keys.contains_key(k) => "settings",
            (None, Some(_)) => "default",
        };
        v["source"] = json!(source);
    }
}

/// The figures of `want` (every known key when `None`), the rows sorted by waiting then name,
/// and the time they are as of (Redis ms).
async fn rows(st: &AppState, want: Option<&str>) -> Result<(Vec<Value>, Value, i64), Response> {
    let limits = st.pauses.key_limits();
    let settings = st.pauses.key_settings();
    let overrides = st.pauses.key_overrides();
    let paused = st.pauses.current();
    let mut also: Vec<String> = limits.keys.keys().cloned().collect();
    also.extend(paused.all().filter_map(|p| match &p.target {
        fleet::control::Target::Key { key } => Some(key.clone()),
        _ => None,
    }));
    let now = st.store.clock.now_ms();
    let redis = |e: fleet::Error| error(StatusCode::SERVICE_UNAVAILABLE, "redis", e.to_string());
    let figures: std::collections::BTreeMap<String, KeyFigures> = match want {
        Some(k) => [(
            k.to_string(),
            st.store.key_figure(k, now).await.map_err(redis)?,
        )]
        .into_iter()
        .collect(),
        None => st.store.key_figures(also, now).await.map_err(redis)?,
    };
    let l = Limits {
        limits: &limits,
        settings: &settings,
        overrides: &overrides,
        paused: &paused,
    };
    let mut out: Vec<(u64, String, Value)> = figures
        .iter()
        .map(|(k, f)| (f.waiting, k.clone(), l.row(k, f)))
        .collect();
    out.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
    Ok((out.into_iter().map(|r| r.2).collect(), l.default(), now))
}

async fn list(State(st): State<AppState>) -> Response {
    match rows(&st, None).await {
        Ok((keys, default, now)) => Json(json!({
            "keys": keys,
            "default": default,
            "as_of": fleet::status::rfc3339_ms(now),
            "as_of_ms": now,
        }))
        .into_response(),
        Err(r) => r,
    }
}

/// The key of a path (`Ok(None)`: the default spec); `Err` the 400 answer.
#[allow(clippy::result_large_err)]
fn path_key(key: &str) -> Result<Option<&str>, Response> {
    if key == DEFAULT_PATH {
        return Ok(None);
    }
    fleet::task::check_key(key)
        .map(|()| Some(key))
        .map_err(|e| error(StatusCode::BAD_REQUEST, "bad_key", e.to_string()))
}

async fn one(State(st): State<AppState>, Path(key): Path<String>) -> Response {
    let want = match path_key(&key) {
        Ok(k) => k,
        Err(r) => return r,
    };
    match rows(&st, want).await {
        Ok((rows, default, now)) => {
            let mut v = match want {
                Some(_) => rows.into_iter().next().unwrap_or_default(),
                None => default,
            };
            v["as_of"] = json!(fleet::status::rfc3339_ms(now));
            Json(v).into_response()
        }
        Err(r) => r,
    }
}

/// The spec and reason of a body; `Err` names the bad field.
fn parse(body: &[u8]) -> Result<(KeyLimitSpec, String), String> {
    let mut v: Value = serde_json::from_slice(body).map_err(|e| format!("malformed JSON: {e}"))?;
    let reason = match v.as_object_mut().and_then(|m| m.remove("reason")) {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s,
        Some(_) => return Err("`reason` must be a string".into()),
    };
    Ok((KeyLimitSpec::from_json(&v)?, reason))
}

async fn set(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(key): Path<String>,
    body: Bytes,
) -> Response {
    let key = match path_key(&key) {
        Ok(k) => k.map(str::to_string),
        Err(r) => return r,
    };
    let (spec, reason) = match parse(&body) {
        Ok(s) => s,
        Err(e) => return error(StatusCode::BAD_REQUEST, "bad_body", e),
    };
    let shown = key.as_deref().unwrap_or(DEFAULT_PATH).to_string();
    let answer = |st: &AppState, status: StatusCode, already: bool| {
        let limits = st.pauses.key_limits();
        let l = Limits {
            limits: &limits,
            settings: &st.pauses.key_settings(),
            overrides: &st.pauses.key_overrides(),
            paused: &st.pauses.current(),
        };
        let in_force = match key.as_deref() {
            Some(k) => l.row(k, &KeyFigures::default()),
            None => l.default(),
        };
        let mut v = json!({"key": shown, "spec": spec, "limits": in_force});
        if already {
            v["already"] = json!(true);
        }
        (status, Json(v)).into_response()
    };
    let current = st.pauses.key_overrides();
    let same = match current.get(key.as_deref()) {
        Some(o) => o.spec == spec,
        None => spec.is_empty(),
    };
    if same {
        return answer(&st, StatusCode::OK, true);
    }
    let who = super::caller(&st, &headers);
    let rec = Record::key_limit(
        key.as_deref(),
        Some(spec.clone()),
        &who,
        &reason,
        st.store.clock.now_ms(),
    );
    if let Err(r) = super::pause::record(&st, &rec).await {
        return r;
    }
    tracing::info!(key = %shown, spec = ?spec, by = %who.name, "key limits recorded");
    answer(&st, StatusCode::ACCEPTED, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_is_a_spec_and_a_reason() {
        let (s, r) = parse(br#"{"max_running":5,"weight":2,"reason":"vip"}"#).unwrap();
        assert_eq!(s.to_pairs(), "max_running=5,weight=2");
        assert_eq!(r, "vip");
        assert!(parse(b"{}").unwrap().0.is_empty());
        assert!(parse(br#"{"rate":-1}"#).unwrap_err().contains("rate"));
        assert!(parse(br#"{"reason":1}"#).unwrap_err().contains("reason"));
        assert!(parse(b"{").is_err());
        assert!(path_key("*").unwrap().is_none());
        assert_eq!(path_key("acme").ok().flatten(), Some("acme"));
        assert!(path_key("a b").is_err());
    }
}
