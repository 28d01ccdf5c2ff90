//! The web console at `/ui`: one page (overview, groups, workers, dead letters, schedules, task
//! lookup with the attempt log) that reads and acts through the scheduler's own HTTP API, like
//! Flower, Asynqmon or Sidekiq's Web UI.
//!
//! The assets (`assets/`: one HTML page, one stylesheet, one ES module — no framework, no build
//! step) are compiled into the binary with `include_str!`, so the console works offline and
//! always matches the API it talks to. The page itself is public: it holds no data. Everything
//! it shows comes from `/v1/...` with the operator's bearer token (kept in the browser's
//! session storage), so the API's roles apply — `read` to look, `admin` to drain, replay and
//! run, pause or resume schedules — and without a valid token the page shows only the token
//! prompt.
//!
//! The page refreshes every 2 s by polling (one request per view and tick, no server state per
//! client), shows a banner while the scheduler does not answer, and fits a phone-width screen;
//! its colours follow `prefers-color-scheme`.

use axum::http::header;
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;

const INDEX: &str = include_str!("assets/index.html");
const STYLE: &str = include_str!("assets/style.css");
const APP: &str = include_str!("assets/app.js");

/// Nothing but these assets and the API on the same origin may run or load.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The console's routes (no state, no auth: see the module docs).
pub fn routes() -> Router {
    Router::new()
        .route(
            "/ui",
            get(|| async { asset("text/html; charset=utf-8", INDEX) }),
        )
        .route("/ui/", get(|| async { Redirect::permanent("/ui") }))
        .route(
            "/ui/style.css",
            get(|| async { asset("text/css; charset=utf-8", STYLE) }),
        )
        .route(
            "/ui/app.js",
            get(|| async { asset("text/javascript; charset=utf-8", APP) }),
        )
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}
