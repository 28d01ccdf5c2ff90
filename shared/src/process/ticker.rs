//! The tick of every periodic loop of the fleet.
//!
//! Every loop has one shape (see [`crate::process`]): a struct with
//! `async fn run(self, shutdown: CancellationToken)`, its events in one `select!`, shutdown
//! first, the work of a tick in a method of its own:
//!
//! ```ignore
//! let mut ticker = Ticker::new(self.interval);
//! loop {
//!     tokio::select! {
//!         biased;
//!         _ = shutdown.cancelled() => break,
//!         _ = other_event => self.on_event().await,
//!         _ = ticker.next() => self.tick().await,
//!     }
//! }
//! ```
//!
//! A tick's work, once started, finishes before shutdown is seen (a `select!` arm's body is
//! not cancelled). [`Ticker::tick`] is the same wait as a plain call, for a bounded poll inside
//! a tick (`while ticker.tick(&shutdown).await { … }`).
//!
//! Both waits are cancel safe. Built on [`tokio::time::Interval`] with
//! [`MissedTickBehavior::Delay`]: the first tick completes at once, and a tick missed because
//! the loop body ran long is delayed (the next one comes `period` after it), never bunched up.

use std::time::Duration;

use tokio::time::{Instant, Interval, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

/// A periodic tick that ends with shutdown. Missed ticks are delayed, not bunched up.
#[derive(Debug)]
pub struct Ticker(Interval);

impl Ticker {
    /// A ticker every `period` (must be non-zero), the first tick at once.
    ///
    /// # Panics
    /// If `period` is zero (as [`tokio::time::interval`]); settings bound every period above 0.
    pub fn new(period: Duration) -> Self {
        let mut i = tokio::time::interval(period);
        i.set_missed_tick_behavior(MissedTickBehavior::Delay);
        Ticker(i)
    }

    /// Waits for the next tick: `true`, or `false` once `shutdown` fires (shutdown wins ties).
    ///
    /// # Cancel safety
    /// Cancel safe: dropped before it completes, it has consumed no tick (the next call gets
    /// the tick this one was waiting for), as [`tokio::time::Interval::tick`].
    pub async fn tick(&mut self, shutdown: &CancellationToken) -> bool {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => false,
            _ = self.0.tick() => true,
        }
    }

    /// Waits for the next tick and returns when it was due, for a `select!` that also waits on
    /// shutdown and other events (see the module docs).
    ///
    /// # Cancel safety
    /// Cancel safe: dropped before it completes (another `select!` arm won), it has consumed
    /// no tick, as [`tokio::time::Interval::tick`].
    pub async fn next(&mut self) -> Instant {
        self.0.tick().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Paused time: the first tick is immediate, the next ones one period apart, and a late
    /// loop body delays the following tick instead of bunching ticks up.
    #[tokio::test(start_paused = true)]
    async fn ticks_one_period_apart_and_delays_missed_ticks() {
        let shutdown = CancellationToken::new();
        let period = Duration::from_millis(100);
        let start = Instant::now();
        let mut t = Ticker::new(period);
        assert!(t.tick(&shutdown).await);
        assert_eq!(start.elapsed(), Duration::ZERO);
        assert!(t.tick(&shutdown).await);
        assert_eq!(start.elapsed(), period);
        // The body overruns by 2.5 periods: the next tick is at once, then one period later.
        tokio::time::sleep(period * 5 / 2).await;
        let late = t.next().await;
        assert_eq!(
            late - start,
            period * 2,
            "the missed tick is reported as due when it was"
        );
        assert_eq!(start.elapsed(), period * 7 / 2);
        t.next().await;
        assert_eq!(start.elapsed(), period * 9 / 2, "delayed, not bunched up");
    }

    #[tokio::test(start_paused = true)]
    async fn shutdown_wins() {
        let shutdown = CancellationToken::new();
        let mut t = Ticker::new(Duration::from_secs(3600));
        assert!(t.tick(&shutdown).await);
        shutdown.cancel();
        // A tick is ready too (time jumps forward while paused); shutdown is checked first.
        tokio::time::advance(Duration::from_secs(7200)).await;
        assert!(!t.tick(&shutdown).await);
    }
}
