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
}

impl Error {
    pub fn config(setting: impl Into<String>, message: impl Into<String>) -> Self {
        Error::Config { setting: setting.into(), message: message.into() }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
