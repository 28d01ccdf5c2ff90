//! The endpoints every binary serves: `/metrics`, `/healthz` (process alive) and `/readyz`
//! (connected to Redis and RabbitMQ, topology declared).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio_util::sync::CancellationToken;

/// Readiness flags a binary sets as it connects.
#[derive(Debug, Default, Clone)]
pub struct Readiness {
    /// Redis takes writes (false until the first success).
    pub redis: Arc<AtomicBool>,
    /// RabbitMQ is connected with the topology declared (false until then).
    pub amqp: Arc<AtomicBool>,
}

impl Readiness {
    /// Both Redis and RabbitMQ are up: what `/readyz` answers 200 for.
    pub fn ready(&self) -> bool {
        self.redis.load(Ordering::Relaxed) && self.amqp.load(Ordering::Relaxed)
    }
    /// Sets whether Redis takes writes.
    pub fn set_redis(&self, v: bool) {
        self.redis.store(v, Ordering::Relaxed);
    }
    /// Sets whether RabbitMQ is connected.
    pub fn set_amqp(&self, v: bool) {
        self.amqp.store(v, Ordering::Relaxed);
    }
}

/// Router with the three common endpoints: `/healthz` and `/readyz` always open, `/metrics`
/// behind role `read` when `FLEET_METRICS_AUTH=read` (and tokens are configured).
pub fn common_routes(
    handle: PrometheusHandle,
    ready: Readiness,
    auth: &crate::settings::ApiAuth,
) -> Router {
    let metrics = Router::new().route(
        "/metrics",
        get(move || {
            let h = handle.clone();
            async move { ([("content-type", "text/plain; version=0.0.4")], h.render()) }
        }),
    );
    if let Some(w) = auth.open_bind_warning() {
        tracing::warn!(setting = "FLEET_ALLOW_UNAUTHENTICATED", "{w}");
    }
    let metrics = if auth.metrics_need_read() {
        auth.require(metrics, crate::settings::Role::Read)
    } else {
        metrics
    };
    metrics.route("/healthz", get(|| async { "ok" })).route(
        "/readyz",
        get(move || {
            let r = ready.clone();
            async move {
                if r.ready() {
                    (StatusCode::OK, "ready")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not ready")
                }
            }
        }),
    )
}

/// Binds `addr` (an error names `FLEET_HTTP_ADDR`) and returns the listener, so callers learn
/// the port before serving (port 0 picks a free one).
pub async fn bind(addr: &str) -> crate::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        crate::Error::config("FLEET_HTTP_ADDR", format!("cannot listen on {addr}: {e}"))
    })
}

/// Serves until `shutdown` fires.
pub async fn serve(listener: tokio::net::TcpListener, router: Router, shutdown: CancellationToken) {
    let r = axum::serve(listener, router)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await;
    if let Err(e) = r {
        tracing::error!(error = %e, "http server failed");
    }
}
