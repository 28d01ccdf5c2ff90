//! The worker's HTTP endpoints: `/metrics`, `/healthz`, `/readyz` (shared with every binary),
//! `GET /status` (this worker as it sees itself) and `POST /drain` (lame duck now: the same
//! drain as SIGTERM, and the process exits when it is done). With API tokens configured
//! `/status` needs `read` and `/drain` needs `admin` ([`fleet::settings`]).

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use metrics_exporter_prometheus::PrometheusHandle;
use serde_json::{json, Value};

use fleet::http::Readiness;
use fleet::settings::{ApiAuth, Role};

use crate::drain::Control;
use crate::stats::Stats;

/// What `/status` shows besides the live figures.
#[derive(Debug, Clone)]
pub struct Identity {
    pub worker_id: String,
    pub group: String,
    pub labels: fleet::Labels,
    pub executor: &'static str,
    /// Each lane's capacity (shown as `capacity` and `critical_capacity`).
    pub capacity: fleet::PerLane<u32>,
}

#[derive(Clone)]
struct Api {
    identity: Arc<Identity>,
    control: Control,
    stats: Arc<Stats>,
}

/// The worker's router: `GET /status` needs role `read`, `POST /drain` role `admin` (see
/// [`fleet::settings`]); POST bodies must be JSON.
pub fn router(
    prom: PrometheusHandle,
    ready: Readiness,
    identity: Identity,
    control: Control,
    stats: Arc<Stats>,
    auth: &ApiAuth,
) -> Router {
    let api = Api {
        identity: Arc::new(identity),
        control,
        stats,
    };
    let read = auth.require(Router::new().route("/status", get(status)), Role::Read);
    let admin = auth.require(Router::new().route("/drain", post(drain)), Role::Admin);
    // Without tokens `/status` and `/drain` answer only to localhost, IP addresses and the
    // names of FLEET_API_ALLOWED_HOSTS (DNS-rebinding defence, fleet::settings).
    auth.host_check(read.merge(admin).with_state(api))
        .merge(fleet::http::common_routes(prom, ready, auth))
}

/// `GET /status`. Figures, one definition each (the same words as `GET /v1/workers`):
/// `running` — tasks running here now; `succeeded`; `failed` — user task attempts whose
/// handler failed (`retried + dead`); `unrecorded` — attempts whose outcome could not be
/// recorded (the `failed` label of `fleet_tasks_completed_total`); `outcomes` — every outcome
/// by the views' names (`succeeded`, `retried`, `dead`, `expired`, `unrecorded`).
async fn status(State(api): State<Api>) -> Json<Value> {
    let (running, _) = api.stats.running();
    let outcomes: Vec<(&str, u64)> = api
        .stats
        .outcomes()
        .into_iter()
        .map(|(o, n)| (crate::stats::view_name(o), n))
        .collect();
    let of = |name: &str| {
        outcomes
            .iter()
            .find(|(o, _)| *o == name)
            .map_or(0, |(_, n)| *n)
    };
    let id = &api.identity;
    Json(json!({
        "id": id.worker_id,
        "group": id.group,
        "labels": id.labels,
        "executor": id.executor,
        "state": api.control.mode().state().as_str(),
        "capacity": id.capacity.normal,
        "critical_capacity": id.capacity.critical,
        "running": running.normal,
        "running_critical": running.critical,
        "succeeded": of("succeeded"),
        "failed": of("retried") + of("dead"),
        "unrecorded": of("unrecorded"),
        "latency_ewma_ms": api.stats.latency_ewma_ms(),
        "outcomes": outcomes.iter().map(|(o, n)| (o.to_string(), Value::from(*n))).collect::<serde_json::Map<_, _>>(),
        // The queues each lane consumes now: one, or this worker's shard subset.
        "consuming": {
            "normal": api.stats.consuming(fleet::Lane::Normal),
            "critical": api.stats.consuming(fleet::Lane::Critical),
        },
    }))
}

async fn drain(State(api): State<Api>) -> (StatusCode, Json<Value>) {
    api.control.request_drain("POST /drain");
    (
        StatusCode::ACCEPTED,
        Json(json!({ "id": api.identity.worker_id, "state": "draining" })),
    )
}
