//! The worker's error type: what [`crate::Worker::start`], [`crate::Worker::run`] and
//! [`crate::Running::drain`] fail with. `anyhow` stays in `main.rs`, which keeps a library
//! error ([`Error::Fleet`]) as itself so its exit code is read from it.

use std::time::Duration;

/// Why a worker could not start, or why its drain was not clean.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A library error: a bad setting (an HTTP address that cannot be bound), a permanent
    /// broker or Redis refusal (login, vhost, a queue with other arguments, the password).
    #[error(transparent)]
    Fleet(#[from] fleet::Error),
    /// The executor cannot be built from its settings (`FLEET_EXECUTOR` and its own).
    #[error("executor {executor}: {message}")]
    Executor {
        /// The executor (`builtin`, `http`, `exec`).
        executor: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The bound HTTP listener has no local address.
    #[error("http listener address")]
    Listener(#[source] std::io::Error),
    /// Another live process holds this worker id (refused at start-up, after its heartbeat
    /// window showed it alive).
    #[error("{0}; is another worker running with FLEET_WORKER_ID set to the same id?")]
    DuplicateId(String),
    /// A fatal conflict ended the worker while it ran (its id taken by another instance):
    /// the reason.
    #[error("{0}")]
    Fatal(String),
    /// The drain's grace ran out with tasks still running: they went back to the broker.
    #[error(
        "drain grace of {} ms exceeded: {left} running task(s) returned to the broker",
        grace.as_millis()
    )]
    GraceExceeded {
        /// The grace (`FLEET_DRAIN_GRACE_MS`).
        grace: Duration,
        /// Tasks running when it ran out.
        left: u32,
    },
    /// The drain was forced (a second signal, the force token): running tasks went back to
    /// the broker.
    #[error("drain interrupted: {left} running task(s) returned to the broker")]
    Interrupted {
        /// Tasks running when it was forced.
        left: u32,
    },
}

/// The worker's result: [`Error`] unless said otherwise.
pub type Result<T, E = Error> = std::result::Result<T, E>;
