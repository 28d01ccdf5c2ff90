//! The cluster-wide dispatch rate limit: a GCRA token bucket in Redis (`ratelimit.lua`, beside this file; whole key through `KEYS`, no prelude),
//! shared by all scheduler replicas, so N replicas together stay under the configured rate.
//! Tokens are taken per dispatch batch (one call for many tasks); a batch that gets fewer
//! tokens than it wants dispatches what it got and waits the returned time for the rest —
//! throttled work waits, it is never failed.

use crate::error::Result;
use crate::redis::Store;
use crate::task::Lane;

/// What the bucket answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// Tokens taken, at most the number asked for.
    pub granted: u32,
    /// When not everything was granted: milliseconds until the next token.
    pub wait_ms: u64,
}

impl Store {
    /// Takes up to `want` tokens from the lane's bucket.
    pub async fn take_tokens(&self, lane: Lane, rate: f64, burst: u32, want: u32) -> Result<Grant> {
        self.take_from(&self.names.rate_limit(lane), rate, burst, want)
            .await
    }

    /// Takes up to `want` tokens from the bucket at `key`.
    pub async fn take_from(&self, key: &str, rate: f64, burst: u32, want: u32) -> Result<Grant> {
        let mut inv = self.scripts.ratelimit.prepare_invoke();
        inv.key(key).arg(rate).arg(burst).arg(want);
        let (granted, wait_ms): (u32, u64) = self.invoke(&inv).await?;
        Ok(Grant { granted, wait_ms })
    }
}
