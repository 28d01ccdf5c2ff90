//! Bearer tokens for the scheduler's API and console — a minimal stand-in, shaped like issue
//! 13's `fleet::auth` (`auth.require(router, Role::Read)`), to be replaced by it when it lands.
//!
//! `FLEET_API_TOKENS`: entries `TOKEN ROLE` separated by commas or newlines; roles `read`
//! (look), `submit` (POST /v1/tasks), `admin` (drain, replay; implies read and submit). With no
//! token configured the API is open, as before. A request without a known token gets 401 with
//! `WWW-Authenticate: Bearer`; a known token without the role gets 403. Tokens never appear in
//! `Debug` output or answers; they are compared without an early exit on the first differing
//! byte.

use std::fmt;
use std::sync::Arc;

use axum::extract::Request;
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::IntoResponse;
use axum::{Json, Router};
use serde_json::json;

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Read,
    Submit,
    Admin,
}

impl Role {
    fn parse(s: &str) -> Option<Role> {
        match s {
            "read" => Some(Role::Read),
            "submit" => Some(Role::Submit),
            "admin" => Some(Role::Admin),
            _ => None,
        }
    }

    /// Whether a token of role `self` may do what needs `need`.
    fn allows(self, need: Role) -> bool {
        self == need || self == Role::Admin
    }
}

/// The configured tokens (empty: the API is open).
#[derive(Clone, Default)]
pub struct ApiAuth {
    tokens: Arc<Vec<(Vec<u8>, Role)>>,
}

impl fmt::Debug for ApiAuth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ApiAuth({} tokens)", self.tokens.len())
    }
}

impl ApiAuth {
    /// Parses `FLEET_API_TOKENS` (`TOKEN ROLE` entries, comma- or line-separated); a bad entry
    /// names the setting (never the token).
    pub fn parse(raw: &str) -> fleet::Result<Self> {
        let mut tokens = Vec::new();
        for (i, entry) in raw.split([',', '\n']).map(str::trim).filter(|e| !e.is_empty()).enumerate() {
            let mut parts = entry.split_whitespace();
            let (Some(token), Some(role), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(fleet::Error::config("FLEET_API_TOKENS", format!("entry {} is not `TOKEN ROLE`", i + 1)));
            };
            let Some(role) = Role::parse(role) else {
                return Err(fleet::Error::config("FLEET_API_TOKENS", format!("entry {}: role `{role}` is not read, submit or admin", i + 1)));
            };
            if token.len() < 16 {
                return Err(fleet::Error::config("FLEET_API_TOKENS", format!("entry {}: a token needs at least 16 characters", i + 1)));
            }
            tokens.push((token.as_bytes().to_vec(), role));
        }
        Ok(ApiAuth { tokens: Arc::new(tokens) })
    }

    pub fn is_open(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The role of the request's bearer token, `None` if it has no known token. Every
    /// configured token is compared in full.
    fn role_of(&self, req: &Request) -> Option<Role> {
        let given = req.headers().get(header::AUTHORIZATION)?.to_str().ok()?.strip_prefix("Bearer ")?.trim().as_bytes();
        let mut found = None;
        for (t, role) in self.tokens.iter() {
            if same(t, given) {
                found = found.or(Some(*role));
            }
        }
        found
    }

    /// `router` with every route behind `role` (unchanged when the API is open).
    pub fn require<S: Clone + Send + Sync + 'static>(&self, router: Router<S>, role: Role) -> Router<S> {
        if self.is_open() {
            return router;
        }
        let auth = self.clone();
        router.route_layer(middleware::from_fn(move |req: Request, next: Next| {
            let auth = auth.clone();
            async move {
                match auth.role_of(&req) {
                    None => (
                        StatusCode::UNAUTHORIZED,
                        [(header::WWW_AUTHENTICATE, "Bearer")],
                        Json(json!({"error": "unauthorized", "detail": "send Authorization: Bearer <token>"})),
                    )
                        .into_response(),
                    Some(r) if !r.allows(role) => (
                        StatusCode::FORBIDDEN,
                        Json(json!({"error": "forbidden", "detail": "this token does not have the role this needs"})),
                    )
                        .into_response(),
                    Some(_) => next.run(req).await,
                }
            }
        }))
    }
}

/// Equality that looks at every byte (no early exit on the first difference).
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_entries_name_the_setting_not_the_token() {
        for bad in ["onlyonefield", "0123456789abcdef root", "short admin", "0123456789abcdef read extra"] {
            let e = ApiAuth::parse(bad).map(|_| ()).unwrap_err().to_string();
            assert!(e.contains("FLEET_API_TOKENS"), "{bad}: {e}");
            assert!(!e.contains("0123456789abcdef"), "{e}");
        }
        let a = ApiAuth::parse("0123456789abcdef read, fedcba9876543210 admin").unwrap_or_default();
        assert_eq!(a.tokens.len(), 2);
        assert!(!format!("{a:?}").contains("0123"));
    }

    #[test]
    fn admin_implies_the_others() {
        assert!(Role::Admin.allows(Role::Read) && Role::Admin.allows(Role::Submit));
        assert!(!Role::Read.allows(Role::Admin) && !Role::Submit.allows(Role::Read));
        assert!(same(b"abc", b"abc") && !same(b"abc", b"abd") && !same(b"abc", b"ab"));
    }
}
