//! What one AMQP session of the scheduler shares: its connection, its publishing channel, the
//! Redis store, the namespace's names and the configuration — the context every session loop
//! borrows (as an `Arc<Session>`), dispatching or not.
//!
//! * `publisher` is a confirm channel used only to publish (dispatch, orphan moves, probes,
//!   the backstop's dead letters). Nothing is ever declared on it: a declare the broker refuses
//!   closes its channel, which would fail every publish awaiting its confirm. A channel whose
//!   publishes are all nacked for [`fleet::broker::amqp::RENEW_AFTER`] with their queues far below any
//!   bound is replaced by a fresh one ([`Session::note_publishes`]).
//! * Park queues are declared on channels of their own, and the set this session declared is
//!   kept by the park module ([`crate::park::Queues`]).
//!
//! The session lives as long as its connection: the supervisor in [`crate::scheduler`] builds
//! a new one on every reconnect.

use std::sync::Arc;

use fleet::{Names, Store};

use crate::config::SchedulerConfig;

/// The shared context of one AMQP session.
pub struct Session {
    /// The scheduler's configuration.
    pub cfg: Arc<SchedulerConfig>,
    /// The Redis store.
    pub store: Store,
    /// The namespace's queue, exchange and key names.
    pub names: Names,
    /// The connection of the session (loops open their own channels on it).
    pub conn: Arc<lapin::Connection>,
    /// Passive declares of queues that may be missing, on a connection of their own (a 404
    /// costs lapin a channel id for good: [`fleet::broker::probe`]): the process's one
    /// prober, shared with the API, which replaces its connection when it is lost and is
    /// closed with the process.
    pub probe: Arc<fleet::broker::probe::Prober>,
    /// The pauses in force (the process's, kept by the control loop: [`crate::pause`]).
    pub pauses: crate::pause::Pauses,
    /// The publishing confirm channel: publishes only, never a declare ([`Session::publisher`]).
    publisher: std::sync::RwLock<fleet::broker::amqp::Publisher>,
    /// Replaces `publisher` when it is stuck nacking ([`Session::note_publishes`]).
    renewal: fleet::broker::amqp::Renewal,
    /// Deliveries this session's tier loops hold (unacked: not in the tiers' ready counts),
    /// for the autoscaling figures' `not_yet_due` ([`crate::scaling`]).
    pub tiers_held: crate::tiers::HeldCount,
    /// Deliveries this session's park release loops hold, per group and lane (unacked: not
    /// in the park queues' ready counts), for the backlog figures ([`crate::stats`],
    /// [`crate::scaling`]).
    pub parks_held: crate::park::HeldByQueue,
}

impl Session {
    /// The context of a session on `conn`, publishing on `publisher` (a confirm channel of
    /// `conn`); the names are `cfg`'s namespace's; `pauses` the process's.
    pub fn new(
        cfg: Arc<SchedulerConfig>,
        store: Store,
        conn: Arc<lapin::Connection>,
        publisher: fleet::broker::amqp::Publisher,
        pauses: crate::pause::Pauses,
        probe: Arc<fleet::broker::probe::Prober>,
    ) -> Self {
        let names = cfg.common.names();
        Session {
            cfg,
            store,
            names,
            conn,
            probe,
            pauses,
            publisher: std::sync::RwLock::new(publisher),
            renewal: fleet::broker::amqp::Renewal::default(),
            tiers_held: crate::tiers::HeldCount::default(),
            parks_held: crate::park::HeldByQueue::default(),
        }
    }

    /// The channel to publish on now (a clone: cheap, and it shares the channel's order lock).
    pub fn publisher(&self) -> fleet::broker::amqp::Publisher {
        match self.publisher.read() {
            Ok(p) => p.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// Reports a batch's publishes per target (`exchange/key`): `(target, taken, refused)`,
    /// `taken` confirmed, `refused` nacked by a queue with no bound to be at (group queues,
    /// `<ns>.delayed`, the tiers, the dead letters: every target of the session's publishes
    /// but the park queues). A target with refusals and none taken continues its spell; once a
    /// spell has lasted [`fleet::broker::amqp::RENEW_AFTER`] the session publishes on a fresh channel
    /// ([`fleet::broker::amqp::Renewal`], as the API does for submissions): after a node loss a
    /// channel can stay stuck nacking every publish to a queue whose new leader takes a fresh
    /// channel's publishes (issue 37 item 3). Not renewing leaves the loops in their refusal
    /// backoff for as long as the channel lives.
    pub async fn note_publishes<'a>(
        &self,
        batch: impl IntoIterator<Item = (&'a str, usize, usize)>,
    ) {
        let mut renew = false;
        for (target, taken, refused) in batch {
            if taken > 0 {
                self.renewal.taken(target);
            } else if refused > 0 && self.renewal.refused(target) {
                renew = true;
            }
        }
        if !renew {
            return;
        }
        match self.renewal.renew(&self.conn, "dispatch").await {
            Ok(p) => match self.publisher.write() {
                Ok(mut slot) => *slot = p,
                Err(poisoned) => *poisoned.into_inner() = p,
            },
            Err(e) => tracing::warn!(error = %e, "cannot open a fresh dispatch publishing channel"),
        }
    }
}
