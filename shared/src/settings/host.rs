//! DNS-rebinding defence: an API without tokens answers only requests whose `Host` names it.
//!
//! A page on `http://rebind.example:8080` whose name the attacker re-points at 127.0.0.1 is,
//! for the browser, same-origin with fleet's loopback API: it may send any request (JSON
//! included) and read the answers — drain workers, replay dead letters, submit tasks — on an
//! open default install. What the browser cannot change is the `Host` header: it names the
//! attacker's domain. So an open API (no `FLEET_API_TOKENS`; with tokens a rebound page has
//! no token to send) answers only when `Host` is
//!
//! * an IP address (any: a literal address cannot be rebound — there is no name to re-point),
//!   which covers the bind address and every loopback address;
//! * `localhost` or a name under `.localhost` (RFC 6761: always loopback, never looked up);
//! * a name listed in `FLEET_API_ALLOWED_HOSTS` (comma-separated, compared without port and
//!   case; `*` admits every name and turns the check off);
//! * absent (HTTP/1.0 without `Host`: no browser sends that).
//!
//! Everything else gets `421 Misdirected Request` with a JSON body naming the setting. The
//! check runs before routing and before the token guard. Health endpoints (`/healthz`,
//! `/readyz`) and `/metrics` are outside it. The same defence as Jupyter's
//! `allow_remote_access` / `local_hostnames` and Vite's `server.allowedHosts`.

use std::net::IpAddr;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;

/// The names an open API answers to besides IP addresses and `localhost`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowedHosts {
    /// Lower-case names without a trailing dot.
    names: Vec<String>,
    /// `*` was configured: every name is admitted.
    any: bool,
}

impl AllowedHosts {
    /// Parses `FLEET_API_ALLOWED_HOSTS`: names separated by commas (blanks ignored), `*` for
    /// any. A port after a name is ignored (`api.internal:8080` = `api.internal`).
    pub fn parse(list: &str) -> AllowedHosts {
        let mut hosts = AllowedHosts::default();
        for entry in list.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            if entry == "*" {
                hosts.any = true;
            } else {
                hosts.names.push(normalise(split_port(entry)));
            }
        }
        hosts
    }

    /// Whether a request with this `Host` header value (`name[:port]`, `[v6]:port`, `v4:port`)
    /// may reach an open API.
    pub fn admits(&self, host: &str) -> bool {
        if self.any {
            return true;
        }
        let name = split_port(host.trim());
        let bare = name.trim_start_matches('[').trim_end_matches(']');
        if bare.parse::<IpAddr>().is_ok() {
            return true;
        }
        let name = normalise(name);
        name == "localhost" || name.ends_with(".localhost") || self.names.contains(&name)
    }
}

/// `host[:port]` without the port (an IPv6 literal keeps its brackets).
fn split_port(host: &str) -> &str {
    if host.starts_with('[') {
        return match host.find(']') {
            Some(end) => &host[..=end],
            None => host,
        };
    }
    match host.rsplit_once(':') {
        // One colon: name or v4 with a port. More: a bare IPv6 address.
        Some((name, port)) if !name.contains(':') && port.bytes().all(|b| b.is_ascii_digit()) => {
            name
        }
        _ => host,
    }
}

fn normalise(name: &str) -> String {
    name.trim_end_matches('.').to_ascii_lowercase()
}

/// Middleware: refuses (421) a request whose `Host` an open API does not answer to; does
/// nothing when `open` is false (tokens are configured). Apply with
/// `Router::layer(axum::middleware::from_fn_with_state((open, hosts), check_host))`.
pub async fn check_host(
    State((open, hosts)): State<(bool, std::sync::Arc<AllowedHosts>)>,
    req: Request,
    next: Next,
) -> Response {
    if open {
        let host = req
            .headers()
            .get(header::HOST)
            .map(|v| v.to_str().unwrap_or("\u{fffd}").to_string())
            .or_else(|| req.uri().authority().map(|a| a.as_str().to_string()));
        if let Some(host) = host.filter(|h| !hosts.admits(h)) {
            return misdirected(&host);
        }
    }
    next.run(req).await
}

fn misdirected(host: &str) -> Response {
    let shown: String = split_port(host).chars().take(100).collect();
    (
        StatusCode::MISDIRECTED_REQUEST,
        Json(serde_json::json!({
            "error": "misdirected",
            "detail": format!("Host {shown:?} is not a name of this server: an API without tokens answers only to localhost, IP addresses and the names in FLEET_API_ALLOWED_HOSTS (DNS-rebinding defence)"),
        })),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_localhost_and_configured_names_only() {
        let h = AllowedHosts::parse(" fleet.internal, API.Example.com:8080 ,");
        for ok in [
            "127.0.0.1:8080",
            "127.0.0.1",
            "10.1.2.3:9100",
            "[::1]:8080",
            "::1",
            "localhost:8080",
            "LOCALHOST",
            "localhost.",
            "app.localhost:3000",
            "fleet.internal:8080",
            "api.example.com",
            "Fleet.Internal.",
        ] {
            assert!(h.admits(ok), "{ok}");
        }
        for bad in [
            "rebind.example:8080",
            "rebind.example",
            "localhost.rebind.example",
            "127.0.0.1.nip.io:8080",
            "fleet.internal.evil.com",
            "",
        ] {
            assert!(!h.admits(bad), "{bad}");
        }
        assert!(AllowedHosts::parse("*").admits("anything.example:1"));
        assert!(!AllowedHosts::parse("").admits("x.example"));
    }
}
