//! The OTLP exporter: HTTP/protobuf to `<FLEET_OTLP_ENDPOINT>/v1/traces`, batched.
//!
//! HTTP/protobuf rather than gRPC: it needs no tonic stack, and the request goes out on the
//! workspace's `reqwest` 0.12 client (TLS with the system roots for `https://`). The SDK's
//! batch processor exports from a thread of its own that runs no tokio runtime, so each request
//! is spawned on the process's runtime ([`TokioClient`]) and awaited from there.

use std::time::Duration;

use bytes::Bytes;
use opentelemetry_http::{HttpClient, HttpError};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider};
use opentelemetry_sdk::Resource;

use crate::error::{Error, Result};

/// How long a finished span waits at most before it is sent.
pub const BATCH_DELAY: Duration = Duration::from_millis(500);
/// Spans queued for export at most; past it new spans are dropped (a collector that is down
/// must not grow the process).
pub const QUEUE: usize = 65_536;
/// Spans per export request at most.
const BATCH: usize = 2_048;
/// How long one export request, and the flush on shutdown, may take.
const TIMEOUT: Duration = Duration::from_secs(5);

/// An HTTP client for the exporter: `reqwest` requests run on the tokio runtime of `rt`.
#[derive(Debug)]
struct TokioClient {
    client: reqwest::Client,
    rt: tokio::runtime::Handle,
}

#[async_trait::async_trait]
impl HttpClient for TokioClient {
    async fn send_bytes(
        &self,
        request: http::Request<Bytes>,
    ) -> std::result::Result<http::Response<Bytes>, HttpError> {
        let client = self.client.clone();
        let sent = self.rt.spawn(async move {
            let req = reqwest::Request::try_from(request)?;
            let resp = client.execute(req).await?;
            let mut out = http::Response::builder().status(resp.status());
            if let Some(h) = out.headers_mut() {
                *h = resp.headers().clone();
            }
            let body = resp.bytes().await?;
            Ok::<_, HttpError>(out.body(body)?)
        });
        sent.await?
    }
}

/// The export pipeline of a process; [`Exporter::shutdown`] flushes it.
pub struct Exporter {
    provider: SdkTracerProvider,
}

/// Starts exporting the spans of [`crate::trace`] to `endpoint` (`http(s)://host:port`, the
/// OTLP/HTTP base URL: spans go to `<endpoint>/v1/traces` as `application/x-protobuf`) as
/// service `service` (`fleet-scheduler`, `fleet-worker`). `None` endpoint: nothing is started
/// and [`crate::trace::tracer`] stays `None`. Call once, from `main`, inside the tokio runtime.
///
/// # Errors
/// [`Error::Config`] naming `FLEET_OTLP_ENDPOINT` when the exporter cannot be built from it (a
/// URL the HTTP stack refuses), or when called twice.
pub fn init(endpoint: Option<&str>, service: &'static str) -> Result<Option<Exporter>> {
    let Some(endpoint) = endpoint else {
        return Ok(None);
    };
    let bad = |m: String| Error::config("FLEET_OTLP_ENDPOINT", m);
    let rt = tokio::runtime::Handle::try_current().map_err(|e| bad(e.to_string()))?;
    let client = reqwest::Client::builder()
        .timeout(TIMEOUT)
        .build()
        .map_err(|e| bad(e.to_string()))?;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(TokioClient { client, rt })
        .with_protocol(Protocol::HttpBinary)
        .with_endpoint(traces_url(endpoint))
        .with_timeout(TIMEOUT)
        .build()
        .map_err(|e| bad(e.to_string()))?;
    let batch = BatchSpanProcessor::builder(exporter)
        .with_batch_config(
            BatchConfigBuilder::default()
                .with_scheduled_delay(BATCH_DELAY)
                .with_max_queue_size(QUEUE)
                .with_max_export_batch_size(BATCH)
                .build(),
        )
        .build();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(batch)
        .with_resource(Resource::builder().with_service_name(service).build())
        .build();
    use opentelemetry::trace::TracerProvider as _;
    super::TRACER
        .set(provider.tracer("fleet"))
        .map_err(|_| bad("span export started twice".into()))?;
    Ok(Some(Exporter { provider }))
}

/// `<endpoint>/v1/traces`, without a doubled slash.
fn traces_url(endpoint: &str) -> String {
    format!("{}/v1/traces", endpoint.trim_end_matches('/'))
}

impl Exporter {
    /// Sends what is queued and stops the export (at most a few seconds; what cannot be sent by
    /// then is dropped and logged). Spans recorded afterwards are dropped.
    pub async fn shutdown(self) {
        let provider = self.provider;
        let done = tokio::task::spawn_blocking(move || provider.shutdown_with_timeout(TIMEOUT));
        match tokio::time::timeout(TIMEOUT + Duration::from_secs(1), done).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "span export did not flush"),
            Ok(Err(e)) => tracing::warn!(error = %e, "span export did not flush"),
            Err(_) => tracing::warn!("span export did not flush in time"),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_traces_path_is_appended_once() {
        assert_eq!(
            super::traces_url("http://c:4318/"),
            "http://c:4318/v1/traces"
        );
        assert_eq!(
            super::traces_url("http://c:4318"),
            "http://c:4318/v1/traces"
        );
    }
}
