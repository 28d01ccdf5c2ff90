//! Plain calls of a scheduler's HTTP API for tests that read answers as JSON (no token).

use std::time::Duration;

use serde_json::Value;

use crate::{wait_for, SchedulerHandle};

/// `POST url` with JSON `body`: the status code and the answer's JSON (`Null` when it has
/// none). Errors: the request could not be sent.
pub async fn api_post(url: String, body: &Value) -> anyhow::Result<(u16, Value)> {
    let r = reqwest::Client::new().post(url).json(body).send().await?;
    let status = r.status().as_u16();
    Ok((status, r.json().await.unwrap_or(Value::Null)))
}

/// `GET url`: the status code and the answer's JSON (`Null` when it has none).
/// Errors: the request could not be sent.
pub async fn api_get(url: String) -> anyhow::Result<(u16, Value)> {
    let r = reqwest::get(url).await?;
    let status = r.status().as_u16();
    Ok((status, r.json().await.unwrap_or(Value::Null)))
}

/// Waits (30 s at most) until scheduler `s` answers `/readyz` 200: its publisher and control
/// stream are ready. Errors: the timeout.
pub async fn scheduler_ready(s: &SchedulerHandle) -> anyhow::Result<()> {
    wait_for("scheduler ready", Duration::from_secs(30), || async {
        let r = reqwest::get(s.url("/readyz")).await.ok()?;
        r.status().is_success().then_some(())
    })
    .await
}
