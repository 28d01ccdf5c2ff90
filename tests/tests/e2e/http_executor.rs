//! The `http` executor end to end: a worker with `executor=http` POSTs each task to a small
//! endpoint served by this test; the answer decides the task's fate — 2xx succeeded with the
//! body as result, 4xx dead at once, 5xx (and 429) retried until max_attempts, and an endpoint
//! slower than the deadline is cut there and the task expires.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use fleet_tests::*;
use serde_json::{json, Value};

/// One request the endpoint received: task id and attempt (from the headers), worker, body.
#[derive(Debug, Clone)]
struct Hit {
    id: String,
    attempt: u32,
    worker: String,
    body: Value,
}

/// The endpoint: behaves as `payload.mode` says and records every request.
#[derive(Clone, Default)]
struct Endpoint {
    hits: Arc<Mutex<Vec<Hit>>>,
}

impl Endpoint {
    fn hits(&self, id: &str) -> Vec<Hit> {
        self.hits
            .lock()
            .map(|h| h.iter().filter(|h| h.id == id).cloned().collect())
            .unwrap_or_default()
    }

    fn all(&self) -> Vec<Hit> {
        self.hits.lock().map(|h| h.clone()).unwrap_or_default()
    }

    fn attempts(&self, id: &str) -> Vec<u32> {
        self.hits(id).into_iter().map(|h| h.attempt).collect()
    }

    async fn serve(self) -> anyhow::Result<String> {
        let app = Router::new().route("/run", post(handle)).with_state(self);
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = l.local_addr()?;
        tokio::spawn(async move { axum::serve(l, app).await });
        Ok(format!("http://{addr}/run"))
    }
}

async fn handle(
    State(ep): State<Endpoint>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let h = |k: &str| {
        headers
            .get(k)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    };
    let hit = Hit {
        id: h("x-fleet-task-id"),
        attempt: h("x-fleet-attempt").parse().unwrap_or(0),
        worker: h("x-fleet-worker"),
        body: body.clone(),
    };
    let attempt = hit.attempt;
    if let Ok(mut hits) = ep.hits.lock() {
        hits.push(hit.clone());
    }
    let payload = &body["payload"];
    match payload["mode"].as_str().unwrap_or("") {
        "ok" => Json(json!({"echo": payload, "attempt": body["attempt"], "worker": hit.worker}))
            .into_response(),
        "text" => "plain words".into_response(),
        "bad" => (StatusCode::BAD_REQUEST, "no such image").into_response(),
        "busy" => (StatusCode::TOO_MANY_REQUESTS, "later").into_response(),
        "boom" => (StatusCode::INTERNAL_SERVER_ERROR, "kaput").into_response(),
        "flaky" if attempt < 3 => (StatusCode::SERVICE_UNAVAILABLE, "warming up").into_response(),
        "flaky" => Json(json!({"ok_on": attempt})).into_response(),
        "endless" => {
            let chunks = futures::stream::repeat_with(|| {
                Ok::<_, std::io::Error>(axum::body::Bytes::from(vec![b'x'; 64 * 1024]))
            });
            axum::body::Body::from_stream(chunks).into_response()
        }
        "slow" => {
            tokio::time::sleep(Duration::from_secs(30)).await;
            "too late".into_response()
        }
        _ => Json(Value::Null).into_response(),
    }
}

/// A scheduler and one `http` worker calling the test's recording endpoint.
async fn http_fleet(case: &str) -> anyhow::Result<(Fleet, Endpoint)> {
    let endpoint = Endpoint::default();
    let url = endpoint.clone().serve().await?;
    let labels = format!("case={case}");
    let id = format!("w-http-{case}");
    let settings = [
        ("executor", "http"),
        ("http_url", url.as_str()),
        ("retry_base_ms", "50"),
        ("retry_cap_ms", "200"),
        NO_EJECT,
    ];
    Ok((
        Fleet::start(&id, &labels, 4, &settings, &[]).await?,
        endpoint,
    ))
}

/// A `resize` task with `payload`.
fn resize(payload: Value, max_attempts: u32) -> fleet::Envelope {
    let mut t = task("resize", payload, "");
    t.max_attempts = Some(max_attempts);
    t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn success_body_is_the_result_in_the_status_api() -> anyhow::Result<()> {
    own_process!();
    let (f, endpoint) = http_fleet("ok").await?;
    let payload = json!({"mode": "ok", "src": "s3://bucket/a.png", "sizes": [64, 128]});
    let t = resize(payload.clone(), 3);
    let text = resize(json!({"mode": "text"}), 3);
    let mut endless = resize(json!({"mode": "endless"}), 1);
    endless.timeout_ms = Some(20_000);
    f.ns.submit(&[t.clone(), text.clone(), endless.clone()])
        .await?;

    f.ns.wait_state(&t.id, "succeeded", Duration::from_secs(20))
        .await?;
    let st = get_json(&f.sched.url(&format!("/v1/tasks/{}", t.id))).await?;
    assert_eq!(st["id"], t.id.as_str());
    assert_eq!(st["state"], "succeeded");
    assert_eq!(st["attempt"], 1);
    assert_eq!(st["worker"], "w-http-ok");
    // Typed status: the endpoint's JSON body is the result, as JSON.
    let result: Value = st["result"].clone();
    assert_eq!(
        result,
        json!({"echo": payload, "attempt": 1, "worker": "w-http-ok"}),
        "the endpoint's body is the result"
    );
    // A body that is not JSON is kept as a string.
    f.ns.wait_state(&text.id, "succeeded", Duration::from_secs(20))
        .await?;
    let st = get_json(&f.sched.url(&format!("/v1/tasks/{}", text.id))).await?;
    assert_eq!(
        st["result"], "plain words",
        "typed status: the result is the JSON string"
    );
    // An endless 200 body: the worker reads its cap, hangs up and succeeds (it neither fills
    // its memory nor waits out the 20 s deadline); the status keeps the first 4 KiB.
    let st =
        f.ns.wait_state(&endless.id, "succeeded", Duration::from_secs(10))
            .await?;
    let result = st.get("result").map(String::as_str).unwrap_or("");
    assert!(
        result.starts_with(r#""xxxx"#) && result.len() < 5000,
        "{} bytes",
        result.len()
    );
    let ran_ms = st["finished_at"].parse::<i64>()? - st["started_at"].parse::<i64>()?;
    assert!(ran_ms < 5_000, "read the endless body for {ran_ms} ms");

    // One request each, carrying the envelope and the attempt.
    let hits = endpoint.hits(&t.id);
    assert_eq!(hits.len(), 1, "{hits:?}");
    assert_eq!((hits[0].attempt, hits[0].worker.as_str()), (1, "w-http-ok"));
    assert_eq!(hits[0].body["id"], t.id.as_str());
    assert_eq!(hits[0].body["kind"], "resize");
    assert_eq!(hits[0].body["payload"], payload);
    assert_eq!(endpoint.attempts(&text.id), vec![1]);
    assert_eq!(
        completed_at_least(&f.worker_url(), &f.group, "succeeded", 3).await?,
        3
    );

    // The scheduler's health probes (noop tasks on the critical lane) succeed without ever
    // reaching the endpoint: it saw exactly the three tasks.
    let group = f.group.clone();
    wait_for(
        "a successful probe of the group",
        Duration::from_secs(15),
        || async {
            let groups = get_json(&f.sched.url("/v1/groups")).await.ok()?;
            groups
                .as_array()?
                .iter()
                .any(|g| g["group"] == group.as_str() && g["probe_ok"] == true)
                .then_some(())
        },
    )
    .await?;
    let ids: Vec<String> = endpoint.all().into_iter().map(|h| h.id).collect();
    assert_eq!(ids.len(), 3, "{ids:?}");
    assert!(
        ids.contains(&t.id) && ids.contains(&text.id) && ids.contains(&endless.id),
        "{ids:?}"
    );
    f.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn client_error_is_dead_without_a_retry() -> anyhow::Result<()> {
    own_process!();
    let (f, endpoint) = http_fleet("bad").await?;
    let t = resize(json!({"mode": "bad"}), 3);
    f.ns.submit(std::slice::from_ref(&t)).await?;
    let dead = wait_dead(&f.ns, 1, Duration::from_secs(20)).await?;
    assert_eq!(dead[0].env.id, t.id);
    assert_eq!(
        dead[0].header("x-fleet-reason"),
        Some("permanent_error"),
        "{:?}",
        dead[0].headers
    );
    assert_eq!(
        dead[0].header("x-fleet-detail"),
        Some("http: 400 Bad Request: no such image")
    );
    assert_eq!(dead[0].header("x-fleet-attempts"), Some("1"));
    let st =
        f.ns.wait_state(&t.id, "dead", Duration::from_secs(10))
            .await?;
    assert_eq!(
        st.get("error").map(String::as_str),
        Some("http: 400 Bad Request: no such image")
    );
    assert_eq!(
        st.get("reason").map(String::as_str),
        Some("permanent_error")
    );
    assert_eq!(endpoint.attempts(&t.id), vec![1], "exactly one request");
    assert_eq!(
        completed_at_least(&f.worker_url(), &f.group, "dead", 1).await?,
        1
    );
    assert_eq!(completed(&f.worker_url(), &f.group, "retried").await?, 0);
    f.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn server_errors_are_retried_up_to_max_attempts() -> anyhow::Result<()> {
    own_process!();
    let (f, endpoint) = http_fleet("boom").await?;
    let boom = resize(json!({"mode": "boom"}), 3);
    let busy = resize(json!({"mode": "busy"}), 2);
    let flaky = resize(json!({"mode": "flaky"}), 5);
    f.ns.submit(&[boom.clone(), busy.clone(), flaky.clone()])
        .await?;

    let dead = wait_dead(&f.ns, 2, Duration::from_secs(30)).await?;
    let find = |id: &str| {
        dead.iter()
            .find(|d| d.env.id == id)
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("{id} not dead"))
    };
    let d = find(&boom.id)?;
    assert_eq!(
        d.header("x-fleet-reason"),
        Some("max_attempts"),
        "{:?}",
        d.headers
    );
    assert_eq!(
        d.header("x-fleet-detail"),
        Some("http: 500 Internal Server Error: kaput")
    );
    assert_eq!(d.header("x-fleet-attempts"), Some("3"));
    assert_eq!(
        endpoint.attempts(&boom.id),
        vec![1, 2, 3],
        "requests = max_attempts"
    );
    // 429 says "later", not "wrong": retried like a 5xx.
    let d = find(&busy.id)?;
    assert_eq!(
        d.header("x-fleet-reason"),
        Some("max_attempts"),
        "{:?}",
        d.headers
    );
    assert_eq!(endpoint.attempts(&busy.id), vec![1, 2]);
    // A 503 that clears up: succeeded on the third attempt.
    let st =
        f.ns.wait_state(&flaky.id, "succeeded", Duration::from_secs(20))
            .await?;
    assert_eq!(
        st.get("result").map(String::as_str),
        Some(r#"{"ok_on":3}"#),
        "{st:?}"
    );
    assert_eq!(endpoint.attempts(&flaky.id), vec![1, 2, 3]);

    let m = f.worker_url();
    assert_eq!(
        completed_at_least(&m, &f.group, "retried", 2 + 1 + 2).await?,
        5
    );
    assert_eq!(completed_at_least(&m, &f.group, "dead", 2).await?, 2);
    assert_eq!(completed_at_least(&m, &f.group, "succeeded", 1).await?, 1);
    f.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slow_endpoint_is_cut_at_the_deadline() -> anyhow::Result<()> {
    own_process!();
    let (f, endpoint) = http_fleet("slow").await?;
    let mut t = resize(json!({"mode": "slow"}), 3);
    t.timeout_ms = Some(800);
    f.ns.submit(std::slice::from_ref(&t)).await?;
    let st =
        f.ns.wait_state(&t.id, "expired", Duration::from_secs(10))
            .await?;
    let ran_ms = st["finished_at"].parse::<i64>()? - st["started_at"].parse::<i64>()?;
    println!("request cut after {ran_ms} ms (deadline 800 ms after submission): {st:?}");
    assert!(
        ran_ms < 2_000,
        "the request ran {ran_ms} ms: not cut at the deadline"
    );
    assert_eq!(
        st.get("error").map(String::as_str),
        Some("deadline reached during the run")
    );
    assert_eq!(st.get("attempt").map(String::as_str), Some("1"));
    let dead = wait_dead(&f.ns, 1, Duration::from_secs(10)).await?;
    assert_eq!(dead[0].header("x-fleet-reason"), Some("expired"));
    assert_eq!(endpoint.attempts(&t.id), vec![1], "one request, no retry");
    assert_eq!(
        completed_at_least(&f.worker_url(), &f.group, "expired", 1).await?,
        1
    );
    assert_eq!(completed(&f.worker_url(), &f.group, "retried").await?, 0);
    f.stop().await
}
