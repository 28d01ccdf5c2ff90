//! What one AMQP session of the scheduler shares: its connection, its publishing channel, the
//! Redis store, the namespace's names and the configuration — the context every session loop
//! borrows (as an `Arc<Session>`), dispatching or not.
//!
//! * `publisher` is a confirm channel used only to publish (dispatch, orphan moves, probes,
//!   the backstop's dead letters). Nothing is ever declared on it: a declare the broker refuses
//!   closes its channel, which would fail every publish awaiting its confirm.
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
    /// The publishing confirm channel: publishes only, never a declare.
    pub publisher: fleet::broker::amqp::Publisher,
}

impl Session {
    /// The context of a session on `conn`, publishing on `publisher` (a confirm channel of
    /// `conn`); the names are `cfg`'s namespace's.
    pub fn new(
        cfg: Arc<SchedulerConfig>,
        store: Store,
        conn: Arc<lapin::Connection>,
        publisher: fleet::broker::amqp::Publisher,
    ) -> Self {
        let names = cfg.common.names();
        Session {
            cfg,
            store,
            names,
            conn,
            publisher,
        }
    }
}
