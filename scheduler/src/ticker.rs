//! The shape every periodic loop of the scheduler shares: `while ticker.tick(&shutdown).await`.

use std::time::Duration;

use tokio::time::{Interval, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

/// A periodic tick that ends with shutdown. Missed ticks are delayed, not bunched up.
pub struct Ticker(Interval);

impl Ticker {
    pub fn new(period: Duration) -> Self {
        let mut i = tokio::time::interval(period);
        i.set_missed_tick_behavior(MissedTickBehavior::Delay);
        Ticker(i)
    }

    /// Waits for the next tick: `true`, or `false` once `shutdown` fires (shutdown wins ties).
    /// Cancel safe.
    pub async fn tick(&mut self, shutdown: &CancellationToken) -> bool {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => false,
            _ = self.0.tick() => true,
        }
    }
}
