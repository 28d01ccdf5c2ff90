//! Where: a task waiting out its backoff waits in the broker, in the largest delay tier not past
//! its due time ([`fleet::broker::delay`]: powers of two from 100 ms, each held by the scheduler until
//! the hop ends, which then sends it on another hop or routes it again once due).

use std::time::Duration;

use fleet::broker::amqp::{headers, task_properties, DETAIL_HEADER};
use fleet::status::truncate;
use fleet::{Envelope, Names};

pub use fleet::broker::delay::{tier_for, tiers};

use crate::attempt::{Shared, MAX_HEADER_TEXT};

/// Sends the task to wait out its backoff `delay` in the broker (attempt `attempt` failed with
/// `error`), then back to the scheduler. `max_attempts`: written into the envelope (a retry
/// keeps the bound its attempts ran under); `None` leaves the envelope's own (a task sent back
/// unclaimed, whose next worker applies its own default). `extra`: more headers. Errors: the
/// publish was refused or not confirmed.
pub(crate) async fn publish(
    shared: &Shared,
    env: &Envelope,
    attempt: u32,
    max_attempts: Option<u32>,
    delay: Duration,
    error: &str,
    extra: &[(&'static str, String)],
) -> fleet::Result<()> {
    let mut next = env.clone();
    next.attempt = attempt;
    if let Some(m) = max_attempts {
        next.max_attempts = Some(m);
    }
    let now = shared.clock.now();
    next.not_before = Some(now + chrono::Duration::from_std(delay).unwrap_or_default());
    let body = next.to_bytes();
    let detail = (DETAIL_HEADER, truncate(error, MAX_HEADER_TEXT));
    match tier_for(delay) {
        Some(tier) => {
            let h = headers(
                fleet::broker::delay::hop(tier, now.timestamp_millis())
                    .into_iter()
                    .chain([detail]),
            );
            shared
                .broker
                .publish(
                    &shared.names.delay_exchange(),
                    "",
                    &body,
                    task_properties(&env.id, Some(h)),
                )
                .await
        }
        None => {
            let h = headers([detail].into_iter().chain(extra.iter().cloned()));
            shared
                .broker
                .publish(
                    &shared.names.tasks_exchange(),
                    Names::DELAYED_KEY,
                    &body,
                    task_properties(&env.id, Some(h)),
                )
                .await
        }
    }
}
