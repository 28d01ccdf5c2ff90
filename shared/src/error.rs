//! The library's error type.

/// Errors of the shared library. Binaries wrap these with `anyhow` at their edges.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A setting has a bad value; the message names the setting.
    #[error("config: {setting}: {message}")]
    Config {
        /// The setting, as its variable (`FLEET_…`) or file key.
        setting: String,
        /// What is wrong with it (secrets redacted).
        message: String,
    },
    /// A RabbitMQ call failed (connection, channel, declare, publish).
    #[error("amqp: {0}")]
    Amqp(#[from] lapin::Error),
    /// A Redis call failed (see `store::Failure` for its kind).
    #[error("redis: {0}")]
    Redis(#[from] deadpool_redis::redis::RedisError),
    /// No Redis connection could be had from the pool (timeout or connect error).
    #[error("redis pool: {0}")]
    Pool(#[from] deadpool_redis::PoolError),
    /// JSON that does not parse or encode.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
    /// The broker refused a publish (queue full: `reject-publish`, or unroutable).
    #[error("publish refused by the broker: {0}")]
    Refused(String),
    /// Another live process holds this worker id (refused at registration).
    #[error("{0}")]
    DuplicateWorker(String),
    /// The worker's group is being reclaimed, or was reclaimed after the worker declared its
    /// queues (refused at registration): declare the group's queues again, then retry.
    #[error("group being reclaimed: {0}")]
    Reclaiming(String),
    /// A shared resource is held by another process past the wait (the dead-queue reader
    /// lease, `fleet::broker::dead::ReaderLease`).
    #[error("busy: {0}")]
    Busy(String),
    /// Something did not answer within its limit: a Redis call ([`CALL_TIMEOUT`]), a RabbitMQ
    /// connection attempt or publisher confirm, a stream replay. Transient: retried.
    ///
    /// [`CALL_TIMEOUT`]: crate::redis::CALL_TIMEOUT
    #[error("{what}: no answer within {after:?}")]
    Timeout {
        /// What was waited for ("a Redis call", "RabbitMQ at amqp://host (…)"; secrets hidden).
        what: String,
        /// The limit that ran out.
        after: std::time::Duration,
    },
    /// No RabbitMQ connection at the moment (it is being re-established).
    #[error("not connected to RabbitMQ")]
    NotConnected,
    /// A publishing channel is closed while its connection may stay up (the broker closed it
    /// alone, e.g. a 404 on a deleted exchange): every later publish on it would fail too.
    #[error("{what}: the publishing channel is closed")]
    ChannelClosed {
        /// Whose channel ("dispatch", "schedules").
        what: &'static str,
    },
    /// A consumer's stream of deliveries ended (its channel or connection closed).
    #[error("consumer of {queue} ended")]
    ConsumerEnded {
        /// The queue (or stream) it consumed.
        queue: String,
    },
    /// A long-lived loop another one depends on has ended (the session is ending).
    #[error("the {name} loop ended")]
    LoopEnded {
        /// The loop ("fleet view").
        name: &'static str,
    },
    /// A broker session ended without a shutdown being asked for (its connection was lost or
    /// a loop failed): the caller opens a new one.
    #[error("session ended")]
    SessionEnded,
    /// A script or call answered in a shape it never should (a bug or a version mismatch
    /// between the Rust and the Lua).
    #[error("{from} answered unexpectedly: {detail}")]
    BadAnswer {
        /// The script or call ("start.lua").
        from: &'static str,
        /// What it answered, or what was missing.
        detail: String,
    },
    /// A broker or Redis error no retry can fix (login refused, unknown vhost, a queue that
    /// exists with other arguments): reported once, naming the setting; the binaries exit 2.
    #[error("{setting}: {message}")]
    Permanent {
        /// The setting to fix (`FLEET_AMQP_URL`, ...).
        setting: String,
        /// The server's refusal.
        message: String,
    },
}

impl Error {
    /// An [`Error::Config`] for `setting`, its message redacted (no password or token).
    pub fn config(setting: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Config {
            setting: setting.into(),
            message: crate::process::redact(&message.into()).into_owned(),
        }
    }
}

/// The library's result: [`Error`] unless said otherwise.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The exit code for an error that ends a binary: 2 for a bad setting or a permanent broker /
/// Redis error (what an operator must fix), 1 for anything else.
pub fn exit_code(e: &anyhow::Error) -> u8 {
    match e.downcast_ref::<Error>() {
        Some(Error::Config { .. } | Error::Permanent { .. }) => 2,
        _ => 1,
    }
}

/// Prints why a binary stops — one line on stderr, passwords hidden, control characters
/// escaped, a closed stderr ignored — and returns its exit code ([`exit_code`]).
pub fn report(program: &str, e: &anyhow::Error) -> std::process::ExitCode {
    use std::io::Write;
    let text = crate::process::redact(&format!("{e:#}")).into_owned();
    let _ = writeln!(
        std::io::stderr(),
        "{program}: {}",
        crate::process::escape_controls(&text)
    );
    std::process::ExitCode::from(exit_code(e))
}

/// The end of a daemon's `main`: an error is logged, the log flushed, the error reported
/// ([`report`]); `Ok` exits 0.
pub fn finish(program: &str, result: anyhow::Result<()>) -> std::process::ExitCode {
    match result {
        Ok(()) => {
            crate::process::telemetry::flush();
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            tracing::error!(error = %format!("{e:#}"), "{program} stopped with an error");
            crate::process::telemetry::flush();
            report(program, &e)
        }
    }
}
