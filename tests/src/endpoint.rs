//! An HTTP task endpoint in the test process for workers with the `http` executor: records
//! every call of kind [`JOB`] (task id, worker, attempt, start and answer times), so tests
//! assert on what actually ran and wait on calls answered instead of sleeping.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::{wait_for, Ns};

/// The task kind the recording endpoint records (others, e.g. probes, are answered at once).
pub const JOB: &str = "job";

/// One call the endpoint received.
#[derive(Debug, Clone)]
pub struct Call {
    pub id: String,
    pub worker: String,
    pub attempt: u32,
    pub at: Instant,
    /// When the answer (200) was produced; `None` while running or when the caller went away.
    pub answered: Option<Instant>,
}

#[derive(Default)]
struct EndpointState {
    calls: Vec<Call>,
    /// Workers the test killed: their unanswered calls will never be answered.
    dead: std::collections::HashSet<String>,
}

/// An HTTP endpoint for the `http` executor: records every `job` call (task id, worker,
/// attempt, start and answer times), sleeps `payload.ms` (default given at start) and answers
/// 200. Any other kind gets 200 at once and is not recorded.
pub struct Endpoint {
    pub url: String,
    state: Arc<Mutex<EndpointState>>,
    stop: CancellationToken,
}

#[derive(Clone)]
struct EndpointCtx {
    state: Arc<Mutex<EndpointState>>,
    default_ms: u64,
}

/// Marks a call answered, or leaves it unanswered when the request is dropped.
struct CallGuard {
    state: Arc<Mutex<EndpointState>>,
    index: usize,
}

impl CallGuard {
    fn answered(self) {
        if let Ok(mut s) = self.state.lock() {
            if let Some(c) = s.calls.get_mut(self.index) {
                c.answered = Some(Instant::now());
            }
        }
    }
}

async fn endpoint_call(
    State(ctx): State<EndpointCtx>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    if body.get("kind").and_then(Value::as_str) != Some(JOB) {
        return (StatusCode::OK, Json(json!({"ok": true})));
    }
    let id = body
        .get("id")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let attempt = body.get("attempt").and_then(Value::as_u64).unwrap_or(0) as u32;
    let worker = headers
        .get("x-fleet-worker")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let ms = body
        .pointer("/payload/ms")
        .and_then(Value::as_u64)
        .unwrap_or(ctx.default_ms);
    let guard = {
        let Ok(mut s) = ctx.state.lock() else {
            return (StatusCode::INTERNAL_SERVER_ERROR, Json(json!({})));
        };
        s.calls.push(Call {
            id,
            worker: worker.clone(),
            attempt,
            at: Instant::now(),
            answered: None,
        });
        CallGuard {
            state: ctx.state.clone(),
            index: s.calls.len() - 1,
        }
    };
    tokio::time::sleep(Duration::from_millis(ms)).await;
    guard.answered();
    (StatusCode::OK, Json(json!({"worker": worker})))
}

impl Endpoint {
    /// Starts the endpoint on a free loopback port; `default_ms` is the run time of a call
    /// whose payload has no `ms`.
    pub async fn start(default_ms: u64) -> Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr: SocketAddr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(EndpointState::default()));
        let ctx = EndpointCtx {
            state: state.clone(),
            default_ms,
        };
        let router = Router::new()
            .route("/run", post(endpoint_call))
            .with_state(ctx);
        let stop = CancellationToken::new();
        let sd = stop.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, router)
                .with_graceful_shutdown(async move { sd.cancelled().await })
                .await;
        });
        Ok(Endpoint {
            url: format!("http://{addr}/run"),
            state,
            stop,
        })
    }

    /// Settings of an in-process worker that calls this endpoint with the `http` executor
    /// and the lifecycle tests' short heartbeats ([`crate::WORKER`]).
    pub fn worker_settings(&self) -> Vec<(&'static str, &str)> {
        let mut cfg: Vec<(&'static str, &str)> = crate::WORKER.to_vec();
        cfg.extend_from_slice(&[("executor", "http"), ("http_url", self.url.as_str())]);
        cfg
    }

    /// Every recorded call, in arrival order.
    pub fn calls(&self) -> Vec<Call> {
        self.state
            .lock()
            .map(|s| s.calls.clone())
            .unwrap_or_default()
    }

    /// Calls of one worker.
    pub fn calls_of(&self, worker: &str) -> Vec<Call> {
        self.calls()
            .into_iter()
            .filter(|c| c.worker == worker)
            .collect()
    }

    /// Calls per task id, in arrival order.
    pub fn per_task(&self) -> HashMap<String, Vec<Call>> {
        let mut m: HashMap<String, Vec<Call>> = HashMap::new();
        for c in self.calls() {
            m.entry(c.id.clone()).or_default().push(c);
        }
        m
    }

    /// Calls of `worker` started and not yet answered.
    pub fn running(&self, worker: &str) -> Vec<Call> {
        self.calls_of(worker)
            .into_iter()
            .filter(|c| c.answered.is_none())
            .collect()
    }

    /// Marks a worker killed (its open calls no longer count as running).
    pub fn mark_dead(&self, worker: &str) {
        if let Ok(mut s) = self.state.lock() {
            s.dead.insert(worker.to_string());
        }
    }

    /// False for a worker marked dead.
    pub fn is_live(&self, worker: &str) -> bool {
        self.state
            .lock()
            .map(|s| !s.dead.contains(worker))
            .unwrap_or(true)
    }

    /// Distinct task ids answered at least once.
    pub fn answered_ids(&self) -> std::collections::HashSet<String> {
        self.calls()
            .into_iter()
            .filter(|c| c.answered.is_some())
            .map(|c| c.id)
            .collect()
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// `n` tasks of kind [`JOB`] with a selector; `ms` overrides the endpoint's run time.
pub fn jobs(n: usize, selector: &str, ms: Option<u64>) -> Vec<fleet::Envelope> {
    (0..n)
        .map(|i| {
            let payload = match ms {
                Some(ms) => json!({"i": i, "ms": ms}),
                None => json!({"i": i}),
            };
            crate::task(JOB, payload, selector)
        })
        .collect()
}

/// Waits until every task id was answered by the endpoint at least once, no call is running
/// and `queue` holds nothing ready: every task done as far as the worker side can tell.
/// (Statuses in Redis may lag: a task a killed worker finished and acked just before the kill
/// may never have had its `succeeded` written — the ledger writes after the ack, batched.)
pub async fn wait_settled(
    ns: &Ns,
    ep: &Endpoint,
    ids: &[String],
    queue: &str,
    timeout: Duration,
) -> Result<()> {
    let n = ids.len();
    wait_for(
        &format!("{n} tasks answered by the endpoint, none running, {queue} empty"),
        timeout,
        || async {
            let calls = ep.calls();
            let done: std::collections::HashSet<&str> = calls
                .iter()
                .filter(|c| c.answered.is_some())
                .map(|c| c.id.as_str())
                .collect();
            let running = calls
                .iter()
                .any(|c| c.answered.is_none() && ep.is_live(&c.worker));
            (ids.iter().all(|id| done.contains(id.as_str()))
                && !running
                && ns.depth(queue).await == 0)
                .then_some(())
        },
    )
    .await
}

/// A pass-through in front of a scheduler API that counts the requests it answered, so a
/// test can wait until a client (e.g. `fleetctl status --wait`) has really asked before it
/// moves on: the barrier instead of a pause. It forwards `GET`s only.
pub struct ApiTap {
    /// `http://127.0.0.1:<port>`: use it as the client's API URL.
    pub url: String,
    answered: Arc<std::sync::atomic::AtomicUsize>,
    stop: CancellationToken,
}

impl ApiTap {
    /// Starts the tap on a free loopback port in front of `upstream` (`http://host:port`).
    pub async fn start(upstream: &str) -> Result<Self> {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr: SocketAddr = listener.local_addr()?;
        let answered = Arc::new(AtomicUsize::new(0));
        let (n, up, client) = (
            answered.clone(),
            upstream.trim_end_matches('/').to_string(),
            reqwest::Client::new(),
        );
        let router = Router::new().fallback(move |uri: axum::http::Uri| {
            let (n, up, client) = (n.clone(), up.clone(), client.clone());
            async move {
                let path = uri
                    .path_and_query()
                    .map(|p| p.as_str().to_string())
                    .unwrap_or_else(|| "/".into());
                let answer = match client.get(format!("{up}{path}")).send().await {
                    Ok(r) => {
                        let status = StatusCode::from_u16(r.status().as_u16())
                            .unwrap_or(StatusCode::BAD_GATEWAY);
                        (status, r.bytes().await.unwrap_or_default())
                    }
                    Err(_) => (StatusCode::BAD_GATEWAY, Default::default()),
                };
                n.fetch_add(1, Ordering::SeqCst);
                answer
            }
        });
        let stop = CancellationToken::new();
        let sd = stop.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, router)
                .with_graceful_shutdown(async move { sd.cancelled().await })
                .await;
        });
        Ok(ApiTap {
            url: format!("http://{addr}"),
            answered,
            stop,
        })
    }

    /// How many requests were answered so far.
    pub fn answered(&self) -> usize {
        self.answered.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Waits until at least `n` requests were answered.
    pub async fn wait_answered(&self, n: usize, timeout: Duration) -> Result<()> {
        wait_for(
            &format!("{n} request(s) through the API tap"),
            timeout,
            || async { (self.answered() >= n).then_some(()) },
        )
        .await
    }
}

impl Drop for ApiTap {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
