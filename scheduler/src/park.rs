//! Park queues: where a group's tasks wait, durably and in order, while no matching group
//! has room — without blocking tasks bound for other groups (no head-of-line blocking).
//!
//! One loop per (group, lane) consumes the park queue and offers what it holds to the
//! reservation script again every `RETRY` until room frees (the reference design's trigger
//! loop). Held tasks stay unacked, so a scheduler crash returns them to the park queue.
//! While it holds tasks the loop keeps the group's "parked" flag alive, so new submissions
//! queue behind parked ones rather than overtaking them.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use fleet::{topology, Lane};
use futures::{FutureExt, StreamExt};
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::dispatch::{Dispatcher, Source};

/// How often held tasks are offered again.
pub const RETRY: Duration = Duration::from_millis(50);
/// Lifetime of the parked flag; renewed while tasks are held.
pub const FLAG_TTL_MS: i64 = 3000;
/// Most tasks a release loop holds out of its park queue. Held tasks are unacked and do not
/// count against the queue's bound, so this stays small: the bound must mean what it says.
pub const HOLD_MAX: u16 = 32;

/// Consumes one park queue.
pub async fn release_loop(d: Arc<Dispatcher>, group: String, lane: Lane, shutdown: CancellationToken) -> fleet::Result<()> {
    let queue = d.names.park_queue(&group, lane);
    let ch = d.conn.create_channel().await?;
    let hold_max = d.cfg.batch_max.min(HOLD_MAX);
    ch.basic_qos(hold_max, BasicQosOptions::default()).await?;
    let mut consumer = ch.basic_consume(queue.as_str().into(), "".into(), BasicConsumeOptions::default(), FieldTable::default()).await?;
    let mut held = Vec::new();
    loop {
        if held.is_empty() {
            let next = tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                n = consumer.next() => n,
            };
            match next {
                Some(Ok(dl)) => held.push(dl),
                Some(Err(e)) => return Err(e.into()),
                None => return Err(fleet::Error::Other(format!("consumer of {queue} ended"))),
            }
        }
        while held.len() < usize::from(hold_max) {
            match consumer.next().now_or_never() {
                Some(Some(Ok(dl))) => held.push(dl),
                Some(Some(Err(e))) => return Err(e.into()),
                _ => break,
            }
        }
        let out = d.process(std::mem::take(&mut held), &Source::Park, &shutdown).await;
        held = out.held;
        if !held.is_empty() {
            if let Err(e) = d.store.mark_parked(&group, lane, FLAG_TTL_MS).await {
                tracing::debug!(error = %e, "cannot renew parked flag");
            }
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(()),
                _ = tokio::time::sleep(RETRY) => {}
            }
        }
    }
}

/// Finds groups (from Redis, every 2 s) and starts a release loop for each group and lane.
pub async fn discover(d: Arc<Dispatcher>, tracker: TaskTracker, shutdown: CancellationToken) -> fleet::Result<()> {
    let mut running: HashSet<(String, Lane)> = HashSet::new();
    let mut tick = tokio::time::interval(Duration::from_secs(2));
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return Ok(()),
            _ = tick.tick() => {}
        }
        let groups = match d.store.group_names().await {
            Ok(g) => g,
            Err(e) => {
                tracing::warn!(error = %e, "park discovery: cannot list groups");
                continue;
            }
        };
        for g in groups {
            for lane in Lane::ALL {
                if running.contains(&(g.clone(), lane)) {
                    continue;
                }
                if let Err(e) = topology::declare_park(&d.publisher, &d.cfg.common, &g, lane).await {
                    tracing::warn!(error = %e, group = %g, "cannot declare park queue");
                    return Err(e);
                }
                running.insert((g.clone(), lane));
                let (d2, g2, sd) = (d.clone(), g.clone(), shutdown.clone());
                let span = tracing::info_span!("park", group = %g, lane = %lane);
                tracker.spawn(tracing::Instrument::instrument(
                    async move {
                        if let Err(e) = release_loop(d2, g2, lane, sd.clone()).await {
                            tracing::warn!(error = %e, "park loop failed; the session restarts");
                            sd.cancel();
                        }
                    },
                    span,
                ));
            }
        }
    }
}
