//! The one wait of the harness: poll a condition until it holds, or fail after a timeout.
//! Tests wait on an event or a counter reached this way, never on a quiet period.

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

/// Polls `check` every 20 ms until it returns `Some`, or fails after `timeout` naming `what`.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    wait_for_every(what, timeout, Duration::from_millis(20), check).await
}

/// [`wait_for`] polling every `every` (for checks that read many keys at a time).
pub async fn wait_for_every<T, F, Fut>(what: &str, timeout: Duration, every: Duration, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = check().await {
            return Ok(v);
        }
        if start.elapsed() > timeout {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(every).await;
    }
}
