//! API authentication: bearer tokens with a role, checked by an axum layer.
//!
//! A caller sends `Authorization: Bearer <token>`. Tokens come from `FLEET_API_TOKENS`
//! (entries `NAME:TOKEN ROLE` separated by commas or newlines, each optionally followed by
//! `key=KEY`: a submit or admin token **bound to a fairness key** — every task it submits
//! through `POST /v1/tasks` gets that key, whatever its envelope says; AMQP producers hold
//! broker credentials and are trusted with their envelopes' keys as before) and `FLEET_API_TOKENS_FILE` (one
//! `NAME:TOKEN ROLE` per line, `#` starts a comment); both may be set and add up. The **name**
//! (`[A-Za-z0-9._-]`, at most 64 bytes, unique) is who the audit log says acted
//! ([`Caller`]); it may be left out (`TOKEN ROLE`), and the token is then named
//! `<role>-<n>` after its entry's position (`admin-1`). The secret itself never appears in any
//! record, log or answer. Roles:
//!
//! * `read` — task status, workers, groups, pressure, the console's views;
//! * `submit` — `POST /v1/tasks`;
//! * `admin` — drain workers and every other operator action; **admin implies read and
//!   submit**, so one operator token does everything. `submit` does not imply `read`: a
//!   producer's token cannot list the fleet.
//!
//! Answers: no or unknown token → 401 with `WWW-Authenticate: Bearer`; a known token without
//! the role → 403. `/healthz` and `/readyz` are always open; `/metrics` is open unless
//! `FLEET_METRICS_AUTH=read`. With no token configured the API is open — allowed only on a
//! loopback `FLEET_HTTP_ADDR` unless `FLEET_ALLOW_UNAUTHENTICATED=true` (checked at start-up).
//!
//! Tokens are compared in constant time (`subtle`) against every configured token, so the
//! time taken does not tell how many leading bytes matched or which entry did; it does
//! depend on the lengths. Tokens never appear in `Debug` output, logs or error messages.
//!
//! Every `POST` must carry `Content-Type: application/json` ([`json_only`], 415 otherwise): a
//! browser sends `text/plain` or form bodies cross-site without a CORS preflight, JSON never.

use std::fmt;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::Json;
use subtle::ConstantTimeEq;

use crate::error::{Error, Result};

/// Shortest accepted token, in bytes: 128 bits of hex or base64 fit.
pub const MIN_TOKEN_LEN: usize = 16;

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Reads: statuses, lists, metrics when guarded.
    Read,
    /// Submits tasks.
    Submit,
    /// Everything, the operator's actions included.
    Admin,
}

impl Role {
    /// The role [`as_str`](Self::as_str) names; `None` for any other word.
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "read" => Some(Role::Read),
            "submit" => Some(Role::Submit),
            "admin" => Some(Role::Admin),
            _ => None,
        }
    }

    /// The role's word: `read`, `submit` or `admin`.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Read => "read",
            Role::Submit => "submit",
            Role::Admin => "admin",
        }
    }

    /// Whether a token with this role may do what `needed` guards (admin may do everything).
    pub fn grants(self, needed: Role) -> bool {
        self == Role::Admin || self == needed
    }
}

/// Longest token name, in bytes.
pub const MAX_NAME_LEN: usize = 64;

/// Who made a request: the token's name and role (for the audit log and `cancelled_by`), or
/// `anonymous` with no role on an open API. Never holds the secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    /// The token's name (`FLEET_API_TOKENS`), or `anonymous` on an open API.
    pub name: String,
    /// The token's role; `None` on an open API.
    pub role: Option<Role>,
}

impl Caller {
    /// The caller of an open API (no token configured).
    pub fn anonymous() -> Self {
        Caller {
            name: "anonymous".into(),
            role: None,
        }
    }

    /// The role's word, or `open` on an open API.
    pub fn role_str(&self) -> &'static str {
        self.role.map(Role::as_str).unwrap_or("open")
    }
}

/// One configured token.
#[derive(Clone)]
struct Entry {
    name: String,
    /// The entry gave its name (else it is `<role>-<n>`).
    named: bool,
    secret: Vec<u8>,
    role: Role,
    /// The fairness key every task this token submits gets (`key=K`).
    key: Option<String>,
}

/// The configured tokens. `Debug` shows only how many there are.
#[derive(Clone, Default)]
pub struct Tokens(Vec<Entry>);

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tokens({} configured)", self.0.len())
    }
}

impl Tokens {
    /// Parses `NAME:TOKEN ROLE` (or `TOKEN ROLE`, named `<role>-<n>`) entries separated by
    /// newlines or commas; blank entries and `#` comments are skipped. Errors give the entry's
    /// number and, for a bad or repeated name, the name — never the token.
    pub fn parse(text: &str) -> std::result::Result<Tokens, String> {
        let mut out = Vec::new();
        let entries = text
            .lines()
            .map(|l| l.split('#').next().unwrap_or(""))
            .flat_map(|l| l.split(','));
        for (n, entry) in entries.map(str::trim).filter(|e| !e.is_empty()).enumerate() {
            let mut parts = entry.split_whitespace();
            let (Some(named), Some(role), bound, None) =
                (parts.next(), parts.next(), parts.next(), parts.next())
            else {
                return Err(format!(
                    "entry {}: expected `NAME:TOKEN ROLE` or `NAME:TOKEN ROLE key=KEY`",
                    n + 1
                ));
            };
            let key = match bound.map(|b| b.strip_prefix("key=")) {
                None => None,
                Some(None) => {
                    return Err(format!(
                        "entry {}: expected `key=KEY` after the role",
                        n + 1
                    ))
                }
                Some(Some(k)) => {
                    crate::task::check_key(k)
                        .map_err(|e| format!("entry {}: the bound key: {e}", n + 1))?;
                    if role == "read" {
                        return Err(format!(
                            "entry {}: a key binds the tasks a token submits: role submit or admin",
                            n + 1
                        ));
                    }
                    Some(k.to_string())
                }
            };
            let (name, token) = match named.split_once(':') {
                Some((name, token)) => (Some(name), token),
                None => (None, named),
            };
            let Some(role) = Role::parse(role) else {
                return Err(format!(
                    "entry {}: role must be read, submit or admin",
                    n + 1
                ));
            };
            if token.len() < MIN_TOKEN_LEN {
                return Err(format!(
                    "entry {}: token shorter than {MIN_TOKEN_LEN} characters",
                    n + 1
                ));
            }
            let named = name.is_some();
            let name = match name {
                Some(name) => {
                    let ok = !name.is_empty()
                        && name.len() <= MAX_NAME_LEN
                        && name
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
                    if !ok {
                        return Err(format!(
                            "entry {}: a token's name is 1-{MAX_NAME_LEN} characters of A-Z a-z 0-9 . _ -",
                            n + 1
                        ));
                    }
                    name.to_string()
                }
                None => format!("{}-{}", role.as_str(), n + 1),
            };
            out.push(Entry {
                name,
                named,
                secret: token.as_bytes().to_vec(),
                role,
                key,
            });
        }
        Ok(Tokens(out))
    }

    /// Adds `more` after these entries (the file's after the variable's); an unnamed entry
    /// of `more` is numbered after them. Errors: a name used twice (named in the message).
    fn extend(&mut self, more: Tokens) -> std::result::Result<(), String> {
        let base = self.0.len();
        for (i, mut e) in more.0.into_iter().enumerate() {
            if !e.named {
                e.name = format!("{}-{}", e.role.as_str(), base + i + 1);
            }
            self.0.push(e);
        }
        self.unique()
    }

    /// Errors when two entries share a name.
    fn unique(&self) -> std::result::Result<(), String> {
        let mut seen = std::collections::HashSet::new();
        for e in &self.0 {
            if !seen.insert(e.name.as_str()) {
                return Err(format!("the token name `{}` is used twice", e.name));
            }
        }
        Ok(())
    }

    /// No token is configured.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// How many tokens are configured.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// The role of a presented token: compares against every entry, in constant time per
    /// entry, without stopping at the first match.
    pub fn role_of(&self, presented: &[u8]) -> Option<Role> {
        self.caller_of(presented).and_then(|c| c.role)
    }

    /// The name and role of a presented token, compared like [`role_of`](Self::role_of).
    pub fn caller_of(&self, presented: &[u8]) -> Option<Caller> {
        let mut found = None;
        for e in &self.0 {
            if bool::from(e.secret.as_slice().ct_eq(presented)) {
                found = found.or(Some(e));
            }
        }
        found.map(|e| Caller {
            name: e.name.clone(),
            role: Some(e.role),
        })
    }

    /// The fairness key a presented token is bound to (`key=K` in its entry), compared like
    /// [`role_of`](Self::role_of).
    pub fn key_of(&self, presented: &[u8]) -> Option<String> {
        let mut found: Option<&Entry> = None;
        for e in &self.0 {
            if bool::from(e.secret.as_slice().ct_eq(presented)) {
                found = found.or(Some(e));
            }
        }
        found.and_then(|e| e.key.clone())
    }

    /// Every token (for the secret scrubbing of tests and diagnostics).
    pub fn secrets(&self) -> impl Iterator<Item = &[u8]> {
        self.0.iter().map(|e| e.secret.as_slice())
    }
}

/// Who may call the API: the tokens and the `/metrics` rule. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct ApiAuth {
    inner: Arc<AuthInner>,
}

#[derive(Debug, Default)]
struct AuthInner {
    tokens: Tokens,
    metrics_need_read: bool,
    allow_unauthenticated: bool,
    /// The non-loopback FLEET_HTTP_ADDR of an API served without tokens.
    open_bind: Option<String>,
    /// The names an open API answers to ([`crate::settings`]).
    hosts: Arc<crate::settings::AllowedHosts>,
}

impl ApiAuth {
    /// An API guarded by `tokens` (empty = open).
    pub fn new(tokens: Tokens, metrics_need_read: bool) -> Self {
        ApiAuth {
            inner: Arc::new(AuthInner {
                tokens,
                metrics_need_read,
                allow_unauthenticated: false,
                open_bind: None,
                hosts: Arc::default(),
            }),
        }
    }

    /// Builds the API's guard from the declared settings `FLEET_API_TOKENS`,
    /// `FLEET_API_TOKENS_FILE`, `FLEET_METRICS_AUTH` (`open` | `read`) and
    /// `FLEET_ALLOW_UNAUTHENTICATED`, and refuses an open API on a non-loopback `http_addr`.
    ///
    /// # Errors
    /// [`crate::Error::Config`] naming the setting (never a token): a malformed entry, an
    /// unreadable file, a non-loopback bind without tokens.
    pub fn from_args(a: &crate::settings::CommonArgs, http_addr: &str) -> Result<Self> {
        let mut tokens = Tokens::parse(&a.api_tokens)
            .and_then(|t| t.unique().map(|()| t))
            .map_err(|e| Error::config("FLEET_API_TOKENS", e))?;
        if let Some(path) = a
            .api_tokens_file
            .as_deref()
            .map(str::trim)
            .filter(|p| !p.is_empty())
        {
            let text = std::fs::read_to_string(path).map_err(|e| {
                Error::config("FLEET_API_TOKENS_FILE", format!("cannot read {path}: {e}"))
            })?;
            let more = Tokens::parse(&text)
                .map_err(|e| Error::config("FLEET_API_TOKENS_FILE", format!("{path}: {e}")))?;
            tokens
                .extend(more)
                .map_err(|e| Error::config("FLEET_API_TOKENS_FILE", format!("{path}: {e}")))?;
        }
        let metrics_need_read = a.metrics_auth == "read";
        let allow_unauthenticated = a.allow_unauthenticated;
        let loopback = http_addr
            .parse::<std::net::SocketAddr>()
            .map(|a| a.ip().is_loopback())
            .unwrap_or(false);
        if tokens.is_empty() && !loopback && !allow_unauthenticated {
            return Err(Error::config(
                "FLEET_API_TOKENS",
                format!("no API token configured while FLEET_HTTP_ADDR={http_addr} is reachable from other hosts; set FLEET_API_TOKENS or FLEET_API_TOKENS_FILE, or FLEET_ALLOW_UNAUTHENTICATED=true to serve an open API"),
            ));
        }
        let open_bind = (tokens.is_empty() && !loopback).then(|| http_addr.to_string());
        Ok(ApiAuth {
            inner: Arc::new(AuthInner {
                tokens,
                metrics_need_read,
                allow_unauthenticated,
                open_bind,
                hosts: Arc::new(crate::settings::AllowedHosts::parse(&a.api_allowed_hosts)),
            }),
        })
    }

    /// True when no token is configured (every caller is let in).
    pub fn is_open(&self) -> bool {
        self.inner.tokens.is_empty()
    }

    /// The configured tokens.
    pub fn tokens(&self) -> &Tokens {
        &self.inner.tokens
    }

    /// `/metrics` needs a token with role `read` (`FLEET_METRICS_AUTH=read`).
    pub fn metrics_need_read(&self) -> bool {
        self.inner.metrics_need_read
    }

    /// An API without tokens may listen on a non-loopback address
    /// (`FLEET_ALLOW_UNAUTHENTICATED`).
    pub fn allow_unauthenticated(&self) -> bool {
        self.inner.allow_unauthenticated
    }

    /// Checks a request's headers for `needed`: `Ok(Some(role))` for a token that grants it,
    /// `Ok(None)` on an open API, `Err` with the 401/403 answer otherwise.
    #[allow(clippy::result_large_err)]
    pub fn check(
        &self,
        headers: &HeaderMap,
        needed: Role,
    ) -> std::result::Result<Option<Role>, Response> {
        self.caller(headers, needed).map(|c| c.role)
    }

    /// Who presents these headers, whatever the route needs: the token's [`Caller`],
    /// [`Caller::anonymous`] on an open API or for a missing or unknown token (a guarded route
    /// never lets those through).
    pub fn identify(&self, headers: &HeaderMap) -> Caller {
        headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .and_then(|(_, t)| self.inner.tokens.caller_of(t.trim().as_bytes()))
            .unwrap_or_else(Caller::anonymous)
    }

    /// The fairness key the presented token is bound to (`FLEET_API_TOKENS` entry
    /// `NAME:TOKEN ROLE key=K`): `POST /v1/tasks` sets every task's `key` to it.
    pub fn bound_key(&self, headers: &HeaderMap) -> Option<String> {
        headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .and_then(|(_, t)| self.inner.tokens.key_of(t.trim().as_bytes()))
    }

    /// Like [`check`](Self::check), answering who the caller is: the token's [`Caller`], or
    /// [`Caller::anonymous`] on an open API.
    #[allow(clippy::result_large_err)]
    pub fn caller(
        &self,
        headers: &HeaderMap,
        needed: Role,
    ) -> std::result::Result<Caller, Response> {
        if self.is_open() {
            return Ok(Caller::anonymous());
        }
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, t)| t.trim());
        let Some(token) = presented else {
            return Err(unauthorized(
                "missing bearer token (Authorization: Bearer <token>)",
            ));
        };
        match self.inner.tokens.caller_of(token.as_bytes()) {
            None | Some(Caller { role: None, .. }) => Err(unauthorized("unknown token")),
            Some(c @ Caller { role: Some(role), .. }) if role.grants(needed) => Ok(c),
            Some(Caller { role: Some(role), .. }) => Err((
                StatusCode::FORBIDDEN,
                Json(serde_json::json!({"error": "forbidden", "detail": format!("this token has role {}; this needs {}", role.as_str(), needed.as_str())})),
            )
                .into_response()),
        }
    }

    /// `router` refusing (421) requests whose `Host` an open API does not answer to — the
    /// DNS-rebinding defence of [`crate::settings`], with the names of `FLEET_API_ALLOWED_HOSTS`;
    /// with tokens configured it lets everything through. A layer: unmatched paths too.
    pub fn host_check<S: Clone + Send + Sync + 'static>(
        &self,
        router: axum::Router<S>,
    ) -> axum::Router<S> {
        router.layer(middleware::from_fn_with_state(
            (self.is_open(), self.inner.hosts.clone()),
            super::host::check_host,
        ))
    }

    /// `router` with every route admitting only callers whose token grants `needed` (a route
    /// layer: unmatched paths still answer 404), and taking only JSON on POST ([`json_only`])
    /// — checked after the token, so a caller without one learns it needs one (401), not
    /// what to send (415). Build one sub-router per role and merge them; do not add
    /// `json_only` outside (it would answer before the guard).
    pub fn require<S: Clone + Send + Sync + 'static>(
        &self,
        router: axum::Router<S>,
        needed: Role,
    ) -> axum::Router<S> {
        // The last route layer added is the outermost: the guard runs first.
        router
            .route_layer(middleware::from_fn(json_only))
            .route_layer(middleware::from_fn_with_state(
                (self.clone(), needed),
                guard,
            ))
    }

    /// A warning for an open API on an address other hosts reach (FLEET_HTTP_ADDR not
    /// loopback, no token, FLEET_ALLOW_UNAUTHENTICATED=true): the daemons log it at start-up
    /// ([`crate::http::common_routes`]). `None` when tokens are set or the bind is loopback.
    pub fn open_bind_warning(&self) -> Option<String> {
        self.inner.open_bind.as_ref().map(|addr| {
            format!("the API on FLEET_HTTP_ADDR={addr} is reachable from other hosts and has no token (FLEET_ALLOW_UNAUTHENTICATED=true): anyone who reaches it may submit, drain and replay; set FLEET_API_TOKENS or FLEET_API_TOKENS_FILE")
        })
    }
}

async fn guard(
    State((auth, needed)): State<(ApiAuth, Role)>,
    req: Request,
    next: Next,
) -> Response {
    match auth.check(req.headers(), needed) {
        Ok(_) => next.run(req).await,
        Err(resp) => resp,
    }
}

fn unauthorized(detail: &str) -> Response {
    (
        StatusCode::UNAUTHORIZED,
        [(header::WWW_AUTHENTICATE, "Bearer")],
        Json(serde_json::json!({"error": "unauthorized", "detail": detail})),
    )
        .into_response()
}

/// Middleware: a `POST` or `PUT` without `Content-Type: application/json` gets 415. [`ApiAuth::require`]
/// applies it behind the token check; apply it yourself only to routes with no guard.
pub async fn json_only(req: Request, next: Next) -> Response {
    if req.method() == Method::POST || req.method() == Method::PUT {
        let json = req
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"));
        if !json {
            return (
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                Json(serde_json::json!({"error": "unsupported_media_type", "detail": "POST and PUT bodies must be Content-Type: application/json"})),
            )
                .into_response();
        }
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auth_for(pairs: &[(&str, &str)]) -> Result<ApiAuth> {
        let s =
            crate::settings::Settings::from_pairs(pairs.iter().map(|(k, v)| (*k, v.to_string())));
        let a = crate::settings::parse::<crate::settings::SchedulerArgs>(&s)?;
        ApiAuth::from_args(&a.common, &a.http_addr)
    }

    /// An open API on a non-loopback address starts only with FLEET_ALLOW_UNAUTHENTICATED,
    /// and then with a warning naming the setting; loopback or a token: no warning.
    #[test]
    fn an_open_non_loopback_api_is_warned_about() {
        let open = auth_for(&[
            ("http_addr", "0.0.0.0:8080"),
            ("allow_unauthenticated", "true"),
        ])
        .unwrap();
        let w = open.open_bind_warning().expect("a warning");
        assert!(
            w.contains("FLEET_ALLOW_UNAUTHENTICATED") && w.contains("FLEET_HTTP_ADDR=0.0.0.0:8080"),
            "{w}"
        );
        assert!(auth_for(&[("http_addr", "0.0.0.0:8080")]).is_err());
        let local = auth_for(&[("http_addr", "127.0.0.1:8080")]).unwrap();
        assert_eq!(local.open_bind_warning(), None);
        let guarded = auth_for(&[
            ("http_addr", "0.0.0.0:8080"),
            ("api_tokens", "aaaaaaaaaaaaaaaa admin"),
        ])
        .unwrap();
        assert_eq!(guarded.open_bind_warning(), None);
    }

    #[test]
    fn parses_entries_and_roles() {
        let t = Tokens::parse("aaaaaaaaaaaaaaaa admin, bbbbbbbbbbbbbbbb read\n# comment\ncccccccccccccccc submit # trailing\n").unwrap();
        assert_eq!(t.len(), 3);
        assert_eq!(t.role_of(b"aaaaaaaaaaaaaaaa"), Some(Role::Admin));
        assert_eq!(t.role_of(b"bbbbbbbbbbbbbbbb"), Some(Role::Read));
        assert_eq!(t.role_of(b"cccccccccccccccc"), Some(Role::Submit));
        assert_eq!(t.role_of(b"cccccccccccccccd"), None);
        assert_eq!(t.role_of(b""), None);
        assert!(!format!("{t:?}").contains("aaaa"));
    }

    #[test]
    fn a_token_may_be_bound_to_a_key() {
        let t = Tokens::parse(
            "acme:aaaaaaaaaaaaaaaa submit key=acme, ops:bbbbbbbbbbbbbbbb admin key=t:x/y, cccccccccccccccc submit",
        )
        .unwrap();
        assert_eq!(t.key_of(b"aaaaaaaaaaaaaaaa").as_deref(), Some("acme"));
        assert_eq!(t.key_of(b"bbbbbbbbbbbbbbbb").as_deref(), Some("t:x/y"));
        assert_eq!(t.key_of(b"cccccccccccccccc"), None);
        assert_eq!(t.role_of(b"aaaaaaaaaaaaaaaa"), Some(Role::Submit));
        for bad in [
            "aaaaaaaaaaaaaaaa submit acme",
            "aaaaaaaaaaaaaaaa submit key=",
            "aaaaaaaaaaaaaaaa submit key=a b",
            "aaaaaaaaaaaaaaaa submit key=bad!",
            "aaaaaaaaaaaaaaaa read key=acme",
        ] {
            let e = Tokens::parse(bad).err().unwrap_or_default();
            assert!(e.contains("entry 1") && !e.contains("aaaa"), "{bad}: {e}");
        }
    }

    #[test]
    fn tokens_have_names_given_or_numbered() {
        let mut t = Tokens::parse(
            "ops-alice:aaaaaaaaaaaaaaaa admin, bbbbbbbbbbbbbbbb read\nci.bot_1:cc:cccccccccccccc submit",
        )
        .unwrap();
        let who = |t: &Tokens, s: &[u8]| t.caller_of(s).map(|c| (c.name, c.role));
        assert_eq!(
            who(&t, b"aaaaaaaaaaaaaaaa"),
            Some(("ops-alice".into(), Some(Role::Admin)))
        );
        assert_eq!(
            who(&t, b"bbbbbbbbbbbbbbbb"),
            Some(("read-2".into(), Some(Role::Read)))
        );
        // The name ends at the first colon: the token may hold more.
        assert_eq!(
            who(&t, b"cc:cccccccccccccc"),
            Some(("ci.bot_1".into(), Some(Role::Submit)))
        );
        assert_eq!(who(&t, b"ops-alice:aaaaaaaaaaaaaaaa"), None);
        // A file's unnamed entries are numbered after the variable's.
        t.extend(Tokens::parse("dddddddddddddddd read").unwrap())
            .unwrap();
        assert_eq!(
            who(&t, b"dddddddddddddddd"),
            Some(("read-4".into(), Some(Role::Read)))
        );
        let e = t
            .extend(Tokens::parse("ops-alice:eeeeeeeeeeeeeeee read").unwrap())
            .unwrap_err();
        assert!(e.contains("ops-alice") && !e.contains("eeee"), "{e}");
        for bad in [
            "bad name:ffffffffffffffff read",
            ":ffffffffffffffff read",
            "a/b:ffffffffffffffff read",
        ] {
            let e = Tokens::parse(bad).unwrap_err();
            assert!(!e.contains("ffff"), "{e}");
        }
    }

    #[test]
    fn errors_never_echo_the_token() {
        for bad in [
            "sekritsekritsekrit",
            "sekritsekritsekrit root",
            "sekrit admin",
            "a b c",
        ] {
            let e = Tokens::parse(bad).unwrap_err();
            assert!(!e.contains("sekrit"), "{e}");
        }
    }

    #[test]
    fn admin_implies_read_and_submit_only_admin_does() {
        assert!(
            Role::Admin.grants(Role::Read)
                && Role::Admin.grants(Role::Submit)
                && Role::Admin.grants(Role::Admin)
        );
        assert!(
            !Role::Submit.grants(Role::Read)
                && !Role::Read.grants(Role::Submit)
                && !Role::Read.grants(Role::Admin)
        );
    }

    #[test]
    fn open_api_only_on_loopback() {
        let args = |pairs: &[(&'static str, &str)]| {
            let s = crate::settings::Settings::from_pairs(
                pairs.iter().map(|(k, v)| (*k, v.to_string())),
            );
            crate::settings::parse::<crate::settings::CommonOnly>(&s)
                .unwrap()
                .common
        };
        let open = args(&[]);
        assert!(ApiAuth::from_args(&open, "127.0.0.1:8080")
            .unwrap()
            .is_open());
        assert!(ApiAuth::from_args(&open, "[::1]:8080").unwrap().is_open());
        let e = ApiAuth::from_args(&open, "0.0.0.0:8080")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("FLEET_API_TOKENS") && e.contains("FLEET_ALLOW_UNAUTHENTICATED"),
            "{e}"
        );
        assert!(
            ApiAuth::from_args(&args(&[("allow_unauthenticated", "true")]), "0.0.0.0:8080")
                .unwrap()
                .is_open()
        );
        assert!(!ApiAuth::from_args(
            &args(&[("api_tokens", "0123456789abcdef admin")]),
            "0.0.0.0:8080"
        )
        .unwrap()
        .is_open());
        let e = ApiAuth::from_args(
            &args(&[("api_tokens", "0123456789abcdef root")]),
            "127.0.0.1:1",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("FLEET_API_TOKENS") && !e.contains("0123456789abcdef"),
            "{e}"
        );
    }
}
