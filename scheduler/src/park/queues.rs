//! The park queues one session declared ([`Queues`]): each is declared on a channel of its
//! own ([`Queues::declare`]), once per session and (group, lane) before a task is first parked
//! there ([`Queues::ensure`]); a reclaimed group's are forgotten ([`Queues::forget`]) so the
//! next task parked there declares them again. The fleet view reads the depth of every queue
//! declared here on every tick ([`crate::view::Declared`]).

use std::collections::HashSet;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use fleet::{broker::topology, Lane};
use futures::future::BoxFuture;
use futures::FutureExt;

use crate::dispatch::ParkQueues;
use crate::session::Session;
use crate::view::Declared;

/// The park queues of one session, by (group, lane).
pub struct Queues {
    session: Arc<Session>,
    declared: Mutex<HashSet<(String, Lane)>>,
    /// Bumped when a fair park queue is first declared ([`ParkQueues::fair_declared`]).
    fair: tokio::sync::watch::Sender<u64>,
}

impl Queues {
    /// No park queue declared yet, on `session`'s connection.
    pub fn new(session: Arc<Session>) -> Self {
        Queues {
            session,
            declared: Mutex::new(HashSet::new()),
            fair: tokio::sync::watch::channel(0).0,
        }
    }

    fn declared_set(&self) -> MutexGuard<'_, HashSet<(String, Lane)>> {
        self.declared.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Declares a group's park queue on a channel of its own — a declare the broker refuses (a
    /// queue left with other arguments) closes its channel, and on the publishing channel that
    /// would fail every publish awaiting its confirm — without recording it as declared (see
    /// [`Queues::ensure`]).
    ///
    /// # Errors
    /// The channel cannot be opened, or the broker refuses the declare (the setting to fix is
    /// named, see [`topology::declare_park`]).
    pub async fn declare(&self, group: &str, lane: Lane) -> fleet::Result<()> {
        let s = &self.session;
        let ch = s.conn.create_channel().await?;
        let declared = topology::declare_park(&ch, &s.cfg.common, group, lane).await;
        if ch.status().connected() {
            let _ = ch.close(200, "declared".into()).await;
        }
        declared
    }

    /// Declares a group's park queue once per session (until [`Queues::forget`]).
    ///
    /// # Errors
    /// As [`Queues::declare`]; the queue is not recorded then, so the next call tries again.
    pub async fn ensure(&self, group: &str, lane: Lane) -> fleet::Result<()> {
        let key = (group.to_string(), lane);
        if self.declared_set().contains(&key) {
            return Ok(());
        }
        self.declare(group, lane).await?;
        self.declared_set().insert(key);
        if fleet::Names::fair_of(group).is_some() {
            self.fair.send_modify(|n| *n += 1);
        }
        Ok(())
    }

    /// The names of the park queues this session declared (as [`fleet::Names::park_queue`]
    /// gives them).
    pub fn names(&self) -> HashSet<String> {
        let names = &self.session.names;
        self.declared_set()
            .iter()
            .map(|(g, l)| names.park_queue(g, *l))
            .collect()
    }

    /// Forgets that a group's park queues were declared: the group was reclaimed and they
    /// are deleted (the next task parked there declares them again).
    pub fn forget(&self, group: &str) {
        self.declared_set().retain(|(g, _)| g != group);
    }
}

impl ParkQueues for Queues {
    fn ensure<'a>(&'a self, group: &'a str, lane: Lane) -> BoxFuture<'a, fleet::Result<()>> {
        Queues::ensure(self, group, lane).boxed()
    }

    fn fair_declared(&self) -> tokio::sync::watch::Receiver<u64> {
        self.fair.subscribe()
    }
}

impl Declared for Queues {
    fn declared(&self) -> HashSet<String> {
        self.names()
    }
}
