//! Trace context end to end (issue 35 item 1): a producer's W3C `traceparent` travels with
//! its task through ingress, a pause (the task parked in its kind's hold queue), a failed
//! attempt and its retry (a delay tier) to the handler, and the scheduler and the worker export
//! the task's spans over OTLP into the producer's trace.
//!
//! The OTLP receiver is a real one, in the test: an HTTP server accepting `POST /v1/traces`
//! (`application/x-protobuf`) and decoding `ExportTraceServiceRequest` with the
//! `opentelemetry-proto` types.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use axum::body::Bytes;
use fleet::broker::amqp;
use fleet_tests::*;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use serde_json::json;

/// Every span received, with its service name.
type Received = Arc<Mutex<Vec<(String, Span)>>>;

/// An OTLP/HTTP receiver on a free port: its base URL and what it received.
async fn receiver() -> Result<(String, Received)> {
    let got: Received = Arc::default();
    let keep = got.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: Bytes| {
            let keep = keep.clone();
            async move {
                let Ok(req) = ExportTraceServiceRequest::decode(body) else {
                    return axum::http::StatusCode::BAD_REQUEST;
                };
                let mut all = keep.lock().unwrap_or_else(|e| e.into_inner());
                for rs in req.resource_spans {
                    let service = rs
                        .resource
                        .iter()
                        .flat_map(|r| &r.attributes)
                        .find(|a| a.key == "service.name")
                        .and_then(|a| match a.value.as_ref()?.value.as_ref()? {
                            AnyValue::StringValue(s) => Some(s.clone()),
                            _ => None,
                        })
                        .unwrap_or_default();
                    for ss in rs.scope_spans {
                        all.extend(ss.spans.into_iter().map(|s| (service.clone(), s)));
                    }
                }
                axum::http::StatusCode::OK
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok((url, got))
}

fn attr<'a>(s: &'a Span, key: &str) -> Option<&'a AnyValue> {
    s.attributes
        .iter()
        .find(|a| a.key == key)
        .and_then(|a| a.value.as_ref()?.value.as_ref())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|b| format!("{b:02x}")).collect()
}

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_ID: &str = "00f067aa0ba902b7";

/// Fails its first attempt; then prints the `TRACEPARENT` it was given as its result.
const SCRIPT: &str = r#"cat >/dev/null
if [ "$FLEET_TASK_KIND" = traced ] && [ "$FLEET_TASK_ATTEMPT" -lt 2 ]; then echo "not yet" >&2; exit 3; fi
printf '%s' "$TRACEPARENT""#;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_parked_retried_task_is_one_trace_from_producer_to_handler() -> Result<()> {
    let ns = Ns::new().await?;
    let (otlp, got) = receiver().await?;
    let mut sched = SchedulerProcess::spawn(&ns, &[("otlp_endpoint", otlp.as_str())]).await?;
    let command = serde_json::to_string(&["sh", "-c", SCRIPT])?;
    let spec = ProcessSpec {
        id: "w-trace",
        labels: "case=trace",
        capacity: 1,
        endpoint: "",
        extra: &[
            ("executor", "exec"),
            ("exec_command", command.as_str()),
            ("otlp_endpoint", otlp.as_str()),
            ("retry_base_ms", "50"),
            ("retry_cap_ms", "200"),
        ],
    };
    let mut worker = WorkerProcess::spawn(&ns, &spec)?;
    worker
        .wait_state(&ns.store, "active", Duration::from_secs(20))
        .await?;

    // Its kind paused: the task is parked at ingress until resumed.
    let http = reqwest::Client::new();
    let pause = http
        .post(format!("{}/v1/pauses", sched.base))
        .json(&json!({"scope": "kind", "kind": "traced"}))
        .send()
        .await?;
    ensure!(pause.status().as_u16() == 202, "pause: {}", pause.status());

    let mut t = task("traced", json!({}), "case=trace");
    t.max_attempts = Some(3);
    t.key = Some("tenant-a".into());
    let traceparent = format!("00-{TRACE_ID}-{PARENT_ID}-01");
    let publisher = amqp::confirm_channel(&ns.conn).await?;
    amqp::publish_confirmed(
        &publisher,
        &ns.names.submit_exchange(),
        "normal",
        &t.to_bytes(),
        amqp::task_properties(
            &t.id,
            Some(amqp::headers([
                ("traceparent", traceparent.clone()),
                ("tracestate", "vendor=abc".to_string()),
            ])),
        ),
    )
    .await?;
    ns.wait_state(&t.id, "parked", Duration::from_secs(20))
        .await
        .context("parked behind the paused kind")?;
    let resume = http
        .post(format!("{}/v1/pauses/resume", sched.base))
        .json(&json!({"scope": "kind", "kind": "traced"}))
        .send()
        .await?;
    ensure!(
        resume.status().as_u16() == 202,
        "resume: {}",
        resume.status()
    );
    let st = ns
        .wait_state(&t.id, "succeeded", Duration::from_secs(30))
        .await?;
    ensure!(st.get("attempt").map(String::as_str) == Some("2"), "{st:?}");

    // A clean stop flushes the batched spans.
    worker.signal("TERM")?;
    worker.wait_exit(Duration::from_secs(30)).await?;
    sched.stop(Duration::from_secs(30)).await?;

    let spans: Vec<(String, Span)> = got.lock().map(|g| g.clone()).unwrap_or_default();
    let ours: Vec<&(String, Span)> = spans
        .iter()
        .filter(|(_, s)| attr(s, "fleet.task.id") == Some(&AnyValue::StringValue(t.id.clone())))
        .collect();
    let names: Vec<String> = ours
        .iter()
        .map(|(svc, s)| format!("{svc}:{}", s.name))
        .collect();
    println!("spans of the task: {names:?}");
    for (_, s) in &ours {
        ensure!(hex(&s.trace_id) == TRACE_ID, "{} in another trace", s.name);
        ensure!(
            hex(&s.parent_span_id) == PARENT_ID,
            "{} not a child of the producer's span",
            s.name
        );
        ensure!(
            attr(s, "fleet.task.kind") == Some(&AnyValue::StringValue("traced".into())),
            "{}: kind",
            s.name
        );
        ensure!(
            attr(s, "fleet.task.key") == Some(&AnyValue::StringValue("tenant-a".into())),
            "{}: key",
            s.name
        );
    }
    let count = |name: &str| ours.iter().filter(|(_, s)| s.name == name).count();
    ensure!(count("admit") == 1, "one admit: {names:?}");
    ensure!(count("reserve") >= 1, "a reserve: {names:?}");
    ensure!(count("queue wait") == 1, "one queue wait: {names:?}");
    ensure!(count("ack") == 2, "an ack per attempt: {names:?}");
    let runs: Vec<&Span> = ours
        .iter()
        .filter(|(_, s)| s.name == "run")
        .map(|(_, s)| s)
        .collect();
    let mut attempts: Vec<i64> = runs
        .iter()
        .filter_map(|s| match attr(s, "fleet.task.attempt") {
            Some(AnyValue::IntValue(n)) => Some(*n),
            _ => None,
        })
        .collect();
    attempts.sort_unstable();
    ensure!(attempts == [1, 2], "runs of attempts 1 and 2: {attempts:?}");
    let reserve = ours
        .iter()
        .find(|(_, s)| s.name == "reserve")
        .map(|(_, s)| s)
        .context("reserve")?;
    ensure!(
        attr(reserve, "fleet.group").is_some(),
        "reserve names the group"
    );
    // The handler saw the trace, under the second run's span.
    let second = runs
        .iter()
        .find(|s| attr(s, "fleet.task.attempt") == Some(&AnyValue::IntValue(2)))
        .context("run 2")?;
    let seen = format!("\"00-{TRACE_ID}-{}-01\"", hex(&second.span_id));
    ensure!(
        st.get("result") == Some(&seen),
        "the handler's TRACEPARENT: {:?}, expected {seen}",
        st.get("result")
    );
    Ok(())
}
