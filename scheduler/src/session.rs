//! What one AMQP session of the scheduler shares: its connection, its publishing channel, the
//! Redis store, the namespace's names and the configuration — the context every session loop
//! borrows (as an `Arc<Session>`), dispatching or not.
//!
//! * `publisher` is a confirm channel used only to publish (dispatch, orphan moves, probes,
//!   the backstop's dead letters). Nothing is ever declared on it: a declare the broker refuses
//!   closes its channel, which would fail every publish awaiting its confirm.
//! * Park queues are declared on a channel of their own ([`Session::declare_park`]), once per
//!   session and (group, lane) ([`Session::ensure_park`]); a reclaimed group's are forgotten
//!   ([`Session::forget_parks`]) so the next task parked there declares them again.
//!
//! The session lives as long as its connection: the supervisor in [`crate::scheduler`] builds
//! a new one on every reconnect.

use std::collections::HashSet;
use std::sync::Arc;

use fleet::{topology, Lane, Names, Store};
use tokio::sync::Mutex;

use crate::config::SchedulerConfig;

/// The shared context of one AMQP session.
pub struct Session {
    pub cfg: Arc<SchedulerConfig>,
    pub store: Store,
    pub names: Names,
    /// The connection of the session (loops open their own channels on it).
    pub conn: Arc<lapin::Connection>,
    /// The publishing confirm channel: publishes only, never a declare.
    pub publisher: fleet::amqp::Publisher,
    /// Park queues declared in this session, by (group, lane).
    parks: Mutex<HashSet<(String, Lane)>>,
}

impl Session {
    pub fn new(
        cfg: Arc<SchedulerConfig>,
        store: Store,
        conn: Arc<lapin::Connection>,
        publisher: fleet::amqp::Publisher,
    ) -> Self {
        let names = cfg.common.names();
        Session {
            cfg,
            store,
            names,
            conn,
            publisher,
            parks: Mutex::new(HashSet::new()),
        }
    }

    /// Declares a group's park queue on a channel of its own: a declare the broker refuses (a
    /// queue left with other arguments) closes its channel, and on the publishing channel
    /// that would fail every publish awaiting its confirm.
    ///
    /// # Errors
    /// The channel cannot be opened, or the broker refuses the declare (the setting to fix is
    /// named, see [`topology::declare_park`]).
    pub async fn declare_park(&self, group: &str, lane: Lane) -> fleet::Result<()> {
        let ch = self.conn.create_channel().await?;
        let declared = topology::declare_park(&ch, &self.cfg.common, group, lane).await;
        if ch.status().connected() {
            let _ = ch.close(200, "declared".into()).await;
        }
        declared
    }

    /// Declares a group's park queue once per session.
    ///
    /// # Errors
    /// As [`Session::declare_park`].
    pub async fn ensure_park(&self, group: &str, lane: Lane) -> fleet::Result<()> {
        let key = (group.to_string(), lane);
        if self.parks.lock().await.contains(&key) {
            return Ok(());
        }
        self.declare_park(group, lane).await?;
        self.parks.lock().await.insert(key);
        Ok(())
    }

    /// The names of the park queues this session declared (as [`fleet::Names::park_queue`]
    /// gives them).
    pub async fn declared_parks(&self) -> std::collections::HashSet<String> {
        self.parks
            .lock()
            .await
            .iter()
            .map(|(g, l)| self.names.park_queue(g, *l))
            .collect()
    }

    /// Forgets that a group's park queues were declared: the group was reclaimed and they
    /// are deleted (the next task parked there declares them again).
    pub async fn forget_parks(&self, group: &str) {
        self.parks.lock().await.retain(|(g, _)| g != group);
    }
}
