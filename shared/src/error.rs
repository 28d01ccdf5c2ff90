//! The library's error type.

/// Errors of the shared library. Binaries wrap these with `anyhow` at their edges.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A setting has a bad value; the message names the setting.
    #[error("config: {setting}: {message}")]
    Config { setting: String, message: String },
    #[error("amqp: {0}")]
    Amqp(#[from] lapin::Error),
    #[error("redis: {0}")]
    Redis(#[from] deadpool_redis::redis::RedisError),
    #[error("redis pool: {0}")]
    Pool(#[from] deadpool_redis::PoolError),
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
    /// The broker refused a publish (queue full: `reject-publish`, or unroutable).
    #[error("publish refused by the broker: {0}")]
    Refused(String),
    /// Another live process holds this worker id (refused at registration).
    #[error("{0}")]
    DuplicateWorker(String),
    #[error("{0}")]
    Other(String),
    /// A broker or Redis error no retry can fix (login refused, unknown vhost, a queue that
    /// exists with other arguments): reported once, naming the setting; the binaries exit 2.
    #[error("{setting}: {message}")]
    Permanent { setting: String, message: String },
}

impl Error {
    pub fn config(setting: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Config { setting: setting.into(), message: crate::redact::redact(&message.into()).into_owned() }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The exit code for an error that ends a binary: 2 for a bad setting or a permanent broker /
/// Redis error (what an operator must fix), 1 for anything else.
pub fn exit_code(e: &anyhow::Error) -> u8 {
    match e.downcast_ref::<Error>() {
        Some(Error::Config { .. } | Error::Permanent { .. }) => 2,
        _ => 1,
    }
}
