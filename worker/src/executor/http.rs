//! The `http` executor: POSTs the envelope (JSON, with `attempt` set to this attempt's number
//! from 1) to one endpoint for every task.
//!
//! The answer decides the fate: 2xx → success with the body (JSON if it parses, else a
//! string); 4xx → permanent (the request itself is wrong and will stay wrong), except 408
//! and 429, which say "try later" and are retryable; 5xx, other statuses, connection errors
//! and timeouts → retryable. The request's timeout is the task's remaining time, bounded by
//! `http_timeout_ms`. Headers `x-fleet-task-id`, `x-fleet-attempt` and `x-fleet-worker` help
//! the endpoint deduplicate (delivery is at-least-once).
//!
//! `https://` endpoints are verified with rustls against the system roots plus
//! `FLEET_HTTP_TLS_CA_FILE`; redirects are not followed unless `FLEET_HTTP_FOLLOW_REDIRECTS=true`
//! (a 3xx is then an answer like any other: not 2xx, not 4xx → retryable).
//!
//! The body is read up to [`MAX_BODY`] and the connection dropped after that (like the `exec`
//! executor's output cap): an endpoint that answers with an endless or enormous body cannot
//! exhaust the worker's memory nor hold the task until its deadline. The result keeps the
//! first [`MAX_BODY`] bytes (the status record keeps less still).

use futures::future::BoxFuture;
use serde_json::Value;

use super::{json_or_string, Handler, TaskContext, TaskError};
use crate::config::HttpConfig;

/// Longest slice of an error body kept in the error text.
const ERROR_BODY: usize = 512;
/// Bytes of a response body read at most; the rest is never read.
pub const MAX_BODY: usize = 1 << 20;

pub struct HttpHandler {
    client: reqwest::Client,
    cfg: HttpConfig,
}

impl HttpHandler {
    /// The client: rustls with the system roots plus `cfg.tls`'s CA, the client certificate
    /// when set, and redirects only when `cfg.follow_redirects`.
    pub fn new(cfg: HttpConfig) -> Result<Self, String> {
        fleet::tls::install_crypto_provider();
        let redirects = if cfg.follow_redirects {
            reqwest::redirect::Policy::limited(10)
        } else {
            reqwest::redirect::Policy::none()
        };
        let mut builder = reqwest::Client::builder()
            .use_rustls_tls()
            .timeout(cfg.timeout)
            .redirect(redirects);
        if let Some(ca) = &cfg.tls.ca_pem {
            for cert in reqwest::Certificate::from_pem_bundle(ca)
                .map_err(|e| format!("FLEET_HTTP_TLS_CA_FILE: {e}"))?
            {
                builder = builder.add_root_certificate(cert);
            }
        }
        if let Some(id) = &cfg.tls.identity {
            let pem = [id.cert_pem.as_slice(), b"\n", id.key_pem.as_slice()].concat();
            builder = builder.identity(
                reqwest::Identity::from_pem(&pem)
                    .map_err(|e| format!("FLEET_HTTP_TLS_CERT_FILE: {e}"))?,
            );
        }
        let client = builder.build().map_err(|e| format!("http client: {e}"))?;
        Ok(HttpHandler { client, cfg })
    }
}

impl Handler for HttpHandler {
    fn call(&self, task: TaskContext) -> BoxFuture<'static, Result<Value, TaskError>> {
        let client = self.client.clone();
        let url = self.cfg.url.clone();
        let timeout = task.remaining().min(self.cfg.timeout);
        Box::pin(async move {
            let mut wire = task.envelope.to_value();
            if let Value::Object(m) = &mut wire {
                m.insert("attempt".into(), task.attempt.into());
            }
            let mut req = client
                .post(&url)
                .timeout(timeout)
                .header(fleet::task::headers::TASK_ID, task.envelope.id.as_str())
                .header(fleet::task::headers::ATTEMPT, task.attempt.to_string())
                .header(fleet::task::headers::WORKER, &*task.worker_id);
            // W3C Trace Context: the handler's request is a child of the run.
            if let Some(t) = &task.trace {
                req = req.header(fleet::task::trace::TRACEPARENT, t.traceparent());
                if let Some(state) = &t.state {
                    req = req.header(fleet::task::trace::TRACESTATE, state.as_str());
                }
            }
            let mut resp = req
                .json(&wire)
                .send()
                .await
                .map_err(|e| TaskError::retryable(format!("http: {}", describe(&e))))?;
            let status = resp.status();
            let keep = if status.is_success() {
                MAX_BODY
            } else {
                ERROR_BODY
            };
            let mut body = Vec::new();
            while body.len() < keep {
                match resp.chunk().await {
                    Ok(Some(chunk)) => {
                        body.extend_from_slice(&chunk[..chunk.len().min(keep - body.len())])
                    }
                    Ok(None) => break,
                    Err(e) => {
                        return Err(TaskError::retryable(format!(
                            "http: reading the body: {}",
                            describe(&e)
                        )))
                    }
                }
            }
            // Dropping `resp` here closes the connection on whatever was not read.
            drop(resp);
            if status.is_success() {
                return Ok(json_or_string(&body));
            }
            let text = String::from_utf8_lossy(&body[..body.len().min(ERROR_BODY)]).into_owned();
            let msg = format!("http: {status}: {text}");
            if status.is_client_error() && status.as_u16() != 408 && status.as_u16() != 429 {
                Err(TaskError::Permanent(msg))
            } else {
                Err(TaskError::Retryable(msg))
            }
        })
    }
}

/// The error and its causes (a failed TLS handshake says why only in a cause), with any
/// password in the URL masked.
fn describe(e: &reqwest::Error) -> String {
    let mut text = if e.is_timeout() {
        "timed out".into()
    } else if e.is_connect() {
        format!("cannot connect: {e}")
    } else {
        e.to_string()
    };
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        let c_text = c.to_string();
        if !text.contains(&c_text) {
            text.push_str(": ");
            text.push_str(&c_text);
        }
        cause = c.source();
    }
    match e.url() {
        Some(u) => text.replace(u.as_str(), &fleet::process::redact(u.as_str())),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use axum::http::StatusCode;
    use axum::routing::post;
    use axum::Router;
    use serde_json::json;

    use super::super::test_support::ctx;
    use super::*;

    async fn server() -> String {
        let app = Router::new()
            .route(
                "/ok",
                post(|body: axum::Json<Value>| async move {
                    axum::Json(json!({"got": body.0["payload"]}))
                }),
            )
            .route("/text", post(|| async { "plain words" }))
            .route(
                "/bad",
                post(|| async { (StatusCode::UNPROCESSABLE_ENTITY, "no such image") }),
            )
            .route(
                "/busy",
                post(|| async { (StatusCode::TOO_MANY_REQUESTS, "later") }),
            )
            .route(
                "/boom",
                post(|| async { (StatusCode::BAD_GATEWAY, "upstream") }),
            )
            .route(
                "/endless",
                post(|| async {
                    let chunks = futures::stream::repeat_with(|| {
                        Ok::<_, std::io::Error>(axum::body::Bytes::from(vec![b'x'; 64 * 1024]))
                    });
                    axum::body::Body::from_stream(chunks)
                }),
            )
            .route(
                "/endless-error",
                post(|| async {
                    let chunks = futures::stream::repeat_with(|| {
                        Ok::<_, std::io::Error>(axum::body::Bytes::from(vec![b'e'; 64 * 1024]))
                    });
                    (
                        StatusCode::BAD_GATEWAY,
                        axum::body::Body::from_stream(chunks),
                    )
                }),
            )
            .route(
                "/slow",
                post(|| async {
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    "late"
                }),
            );
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(l, app).await });
        format!("http://{addr}")
    }

    fn handler(base: &str, path: &str) -> HttpHandler {
        HttpHandler::new(HttpConfig {
            url: format!("{base}{path}"),
            timeout: Duration::from_secs(10),
            tls: Default::default(),
            follow_redirects: false,
        })
        .unwrap()
    }

    #[tokio::test]
    async fn status_decides_the_fate() {
        let base = server().await;
        let t = || ctx("resize", json!({"src": "a.png"}), 1, Duration::from_secs(5));
        assert_eq!(
            handler(&base, "/ok").call(t()).await,
            Ok(json!({"got": {"src": "a.png"}}))
        );
        assert_eq!(
            handler(&base, "/text").call(t()).await,
            Ok(json!("plain words"))
        );
        let e = handler(&base, "/bad").call(t()).await.unwrap_err();
        assert!(
            matches!(&e, TaskError::Permanent(m) if m.contains("422") && m.contains("no such image")),
            "{e:?}"
        );
        assert!(matches!(
            handler(&base, "/busy").call(t()).await,
            Err(TaskError::Retryable(_))
        ));
        assert!(matches!(
            handler(&base, "/boom").call(t()).await,
            Err(TaskError::Retryable(_))
        ));
        let short = ctx("resize", json!({}), 1, Duration::from_millis(200));
        let e = handler(&base, "/slow").call(short).await.unwrap_err();
        assert!(
            matches!(&e, TaskError::Retryable(m) if m.contains("timed out")),
            "{e:?}"
        );
    }

    #[tokio::test]
    async fn an_endless_body_is_cut_at_the_cap() {
        let base = server().await;
        let t = || ctx("x", Value::Null, 1, Duration::from_secs(5));
        let started = std::time::Instant::now();
        let out = handler(&base, "/endless").call(t()).await.unwrap();
        assert_eq!(out.as_str().map(str::len), Some(MAX_BODY));
        let e = handler(&base, "/endless-error")
            .call(t())
            .await
            .unwrap_err();
        assert!(
            matches!(&e, TaskError::Retryable(m) if m.starts_with("http: 502") && m.len() < 600),
            "{e:?}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(4),
            "read until the timeout: {:?}",
            started.elapsed()
        );
    }

    #[tokio::test]
    async fn connection_refused_is_retryable() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        drop(l);
        let h = handler(&format!("http://{addr}"), "/");
        let e = h
            .call(ctx("x", Value::Null, 1, Duration::from_secs(2)))
            .await
            .unwrap_err();
        assert!(matches!(e, TaskError::Retryable(_)), "{e:?}");
    }
}
