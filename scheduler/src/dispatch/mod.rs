//! Dispatch: turns a batch of deliveries into routed, parked, delayed or dead-lettered tasks.
//!
//! One batch = one reservation script call + pipelined publishes + one wait for all publisher
//! confirms + pipelined acks. A source message is acked only after everything it became is
//! confirmed by the broker; if any publish fails its reservation is given back and the source
//! message is requeued, so a task is never lost between two queues (at-least-once).
//!
//! A batch goes through four steps, each in a file of its own, over one [`Item`] per delivery
//! (the delivery, its envelope, its [`Fate`]):
//!
//! 1. **Read** ([`item`]): parse and screen each delivery — refused, expired, delayed, or to
//!    be asked of the reservation.
//! 2. **Reserve** ([`reserve`]): rate-limit tokens for what is to be routed, then one
//!    `reserve.lua` call for the batch (dedupe, choose a group, take leased room).
//! 3. **Decide** ([`fate`]): each answer becomes a fate — a pure function of the answer and
//!    the [`Source`], table-tested over every pair.
//! 4. **Publish and settle** ([`publish`]): publish every fate, wait for the confirms, then ack
//!    what is safely elsewhere, requeue what is not (giving its reservation back), keep what is
//!    held, and write the statuses decided here.
//!
//! What differs between the loops that feed it — ingress lanes, the delayed queue, park
//! release, waiting-for-worker release, the orphan rescue ([`rescue`]) — is asked of the
//! [`Source`] at each step, never branched on in the steps themselves.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fleet::route::ReserveParams;
use fleet::Lane;
use futures::future::BoxFuture;
use lapin::message::Delivery;
use tokio_util::sync::CancellationToken;

use crate::session::Session;

pub mod fate;
pub mod item;
pub mod publish;
pub mod rescue;
pub mod reserve;
pub mod source;
pub mod spans;

pub use fate::{decide, Fate};
pub use item::Item;
pub use source::{Orphan, ReserveMode, Source};

/// Makes sure a group's park queue exists before a task is published to it. The dispatcher is
/// given one (the session's declared set, [`crate::park::Queues`]) instead of reaching into
/// the park module, whose release loops run their batches through the dispatcher.
pub trait ParkQueues: Send + Sync {
    /// Declares `group`'s park queue of `lane` unless this session declared it already.
    ///
    /// # Errors
    /// The broker refuses the declare (a queue left with other arguments: the setting to fix
    /// is named) or no channel can be opened. The dispatcher logs it and publishes anyway: a
    /// queue that does not exist makes the publish unroutable, and its source is requeued.
    fn ensure<'a>(&'a self, group: &'a str, lane: Lane) -> BoxFuture<'a, fleet::Result<()>>;

    /// A receiver that sees every first declare of a fair park queue by this session
    /// ([`fleet::Names::fair_group`]): its group's release loop starts consuming it at once
    /// instead of at its next look-up.
    fn fair_declared(&self) -> tokio::sync::watch::Receiver<u64>;
}

/// The result of a batch: deliveries the caller keeps (park source), whether a park queue
/// refused a task (its bound reached: the ingress loop should pause), and whether publishes
/// failed (their sources were requeued).
#[derive(Default)]
pub struct Outcome {
    /// Deliveries whose fate is [`Fate::Hold`], unacked, in batch order: the caller keeps
    /// them (a park release loop offers them again; the orphan rescue puts them back).
    pub held: Vec<Delivery>,
    /// A publish to a park queue was not confirmed (its bound reached, most likely).
    pub park_full: bool,
    /// Tasks decided [`Fate::Dispatch`] (decisions, whether or not their publish was
    /// confirmed).
    pub dispatched: usize,
    /// Tasks confirmed in a group queue ([`Fate::Dispatch`] with a confirmed publish).
    pub routed: usize,
    /// Publishes not confirmed in this batch (their sources went back to their queue).
    pub failed: usize,
    /// The batch's first failure — a publish not confirmed, an ack refused, or (for a source
    /// whose reservation is tried once, [`Source::retries_reserve`]) the reservation call —
    /// for a caller that stops at one (the orphan rescue). Consuming loops read `failed`.
    pub error: Option<fleet::Error>,
    /// Per fairness key of the batch: its running + reserved after the reservation call
    /// (cluster-wide, from Redis), for the fair release's `min_running`, and whether the key
    /// itself held a task back (paused, at its limit, out of tokens).
    pub key_used: Vec<(String, Option<u32>, bool)>,
}

impl Outcome {
    /// Ends a consuming loop when its batch failed because the session's publishing channel
    /// is closed (the broker closed it alone, e.g. a 404 on a deleted exchange, while the
    /// connection stays up): every later publish would fail too and each requeued source
    /// would come straight back, a loop that dispatches nothing forever. The error ends the
    /// session, which opens a new publisher.
    ///
    /// # Errors
    /// [`fleet::Error::ChannelClosed`] naming the publisher, when `failed > 0` and it is closed.
    pub fn check_publisher(&self, session: &Session) -> fleet::Result<()> {
        if self.failed > 0 && !session.publisher().status().connected() {
            return Err(fleet::Error::ChannelClosed { what: "dispatch" });
        }
        Ok(())
    }
}

/// The pause a consuming loop takes after a batch whose publishes the broker refused (a nack,
/// unroutable, not confirmed), so their requeued sources are not taken straight back: 100 ms,
/// doubling per refused batch in a row to 5 s, reset by a batch with none refused. A nack
/// carries no reason — a queue at its bound and a quorum queue without a leader (mid-election,
/// for seconds after a node loss) look alike — and either way the same publish a moment later
/// fares no better (issue 37 item 3: ~400 refusals a second for 20 s in a tight requeue loop).
#[derive(Debug, Default)]
pub struct RefusalBackoff {
    next: Option<Duration>,
}

impl RefusalBackoff {
    const FIRST: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_secs(5);

    /// The pause to take after `out`, `None` when nothing was refused (which resets it).
    pub fn after(&mut self, out: &Outcome) -> Option<Duration> {
        if out.failed == 0 {
            self.next = None;
            return None;
        }
        let wait = self.next.unwrap_or(Self::FIRST);
        self.next = Some((wait * 2).min(Self::MAX));
        Some(wait)
    }
}

/// The dispatch logic of one AMQP session, shared by every dispatching loop (ingress, delayed,
/// park release, orphan rescue): what it publishes on and reads from is the [`Session`].
pub struct Dispatcher {
    /// The session it publishes on and reads from.
    pub session: Arc<Session>,
    /// Park queues, declared before a task is first parked in one.
    parks: Arc<dyn ParkQueues>,
    /// Round-robin position over a sharded lane's shard queues (see [`Dispatcher::group_key`]).
    shard_rr: AtomicU32,
}

impl Dispatcher {
    /// A dispatcher over `session`, declaring park queues through `parks`.
    pub fn new(session: Arc<Session>, parks: Arc<dyn ParkQueues>) -> Self {
        Dispatcher {
            session,
            parks,
            shard_rr: AtomicU32::new(rand::random()),
        }
    }

    /// Routing key of the queue a task for `group`'s `lane` is published to. A sharded lane
    /// (`FLEET_SHARDS` > 1) takes its shards in turn (round robin, from a random start per
    /// process): every shard has a consumer while the group has a registered worker (see
    /// [`fleet::broker`]), so any shard will do, and turns spread the load evenly without
    /// reading queue depths on the hot path.
    pub fn group_key(&self, group: &str, lane: Lane) -> String {
        let shards = self.session.cfg.common.shards(lane);
        let shard = if shards > 1 {
            self.shard_rr.fetch_add(1, Ordering::Relaxed) % shards
        } else {
            0
        };
        self.session
            .names
            .group_shard_key(group, lane, shard, shards)
    }

    /// The park queues it declares (a release loop declares a group's fair queues here too).
    pub fn parks(&self) -> &dyn ParkQueues {
        self.parks.as_ref()
    }

    /// The reservation parameters of one batch (a fresh batch token each call).
    pub fn params(&self) -> ReserveParams {
        self.session.cfg.reserve_params()
    }

    /// Processes one batch from `source`: read, reserve, decide, publish and settle (see the
    /// module docs). Every delivery of `batch` ends acked, requeued or in
    /// [`Outcome::held`] — except at shutdown, when a batch still waiting for Redis is
    /// dropped unacked (the broker redelivers it) and the outcome is empty.
    ///
    /// Cancel safe only in the sense that unacked deliveries return to the broker; callers do
    /// not cancel it mid-way except at shutdown.
    pub async fn process(
        &self,
        batch: Vec<Delivery>,
        source: &Source,
        shutdown: &CancellationToken,
    ) -> Outcome {
        let now = self.session.store.clock.now();
        // Span times are read only when spans are exported (one atomic load otherwise).
        let traced = fleet::trace::enabled().then(std::time::SystemTime::now);
        let cfg = &self.session.cfg;
        // The pauses in force (`None`: nothing paused, no check at all).
        let pauses = self.session.pauses.snapshot();
        let mut items: Vec<Item> = batch
            .into_iter()
            .map(|d| Item::read(d, source, cfg, now, pauses.as_deref()))
            .collect();
        let admitted = traced.map(|_| std::time::SystemTime::now());
        if source.rate_limited() {
            self.take_tokens_for(&items, shutdown).await;
        }
        // Shutting down while Redis is unreachable: leave everything unacked.
        // One token names the batch's dedupe marks and, once every publish is confirmed, its
        // handed-on flag (`fleet::route::dedupe`).
        let params = self.params();
        let Some((reserve_error, key_used)) = self
            .reserve_and_decide(&mut items, source, now, params, shutdown)
            .await
        else {
            return Outcome::default();
        };
        if let (Some(read), Some(admitted)) = (traced, admitted) {
            let reserved = std::time::SystemTime::now();
            let times = spans::Times {
                read,
                admitted,
                reserved,
            };
            spans::record(&items, source, &times);
        }
        let mut out = self.publish_and_settle(items, source, params.token).await;
        if out.error.is_none() {
            out.error = reserve_error;
        }
        out.key_used = key_used;
        out
    }
}

#[cfg(test)]
mod refusal_tests {
    use super::{Outcome, RefusalBackoff};
    use std::time::Duration;

    fn failed(n: usize) -> Outcome {
        Outcome {
            failed: n,
            ..Default::default()
        }
    }

    #[test]
    fn refused_batches_back_off_and_a_clean_batch_resets() {
        let mut b = RefusalBackoff::default();
        assert_eq!(b.after(&failed(0)), None);
        let waits: Vec<_> = (0..8)
            .map(|_| b.after(&failed(3)).unwrap_or_default())
            .collect();
        let ms: Vec<u128> = waits.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, vec![100, 200, 400, 800, 1600, 3200, 5000, 5000]);
        assert_eq!(b.after(&failed(0)), None);
        assert_eq!(b.after(&failed(1)), Some(Duration::from_millis(100)));
    }
}
