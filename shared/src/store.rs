//! Redis: the pool, the scripts and the namespace, with a timeout on every call so one slow
//! reply cannot stall a worker or a scheduler; callers retry, log and keep going.

use std::sync::Arc;
use std::time::Duration;

use deadpool_redis::redis::{self, FromRedisValue, ScriptInvocation};
use deadpool_redis::{Config, Connection, Pool, Runtime};

use crate::error::{Error, Result};
use crate::names::Names;
use crate::scripts::Scripts;

/// Longest a single Redis call may take before it counts as failed.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(3);

/// Handle on the fleet's Redis state. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    pool: Pool,
    pub names: Names,
    pub scripts: Arc<Scripts>,
}

impl Store {
    /// Builds the pool (no connection is made until first use).
    pub fn new(url: &str, names: Names) -> Result<Self> {
        let mut cfg = Config::from_url(url);
        let mut pc = deadpool_redis::PoolConfig::new(32);
        pc.timeouts.wait = Some(CALL_TIMEOUT);
        pc.timeouts.create = Some(CALL_TIMEOUT);
        pc.timeouts.recycle = Some(CALL_TIMEOUT);
        cfg.pool = Some(pc);
        let pool = cfg
            .create_pool(Some(Runtime::Tokio1))
            .map_err(|e| Error::config("FLEET_REDIS_URL", e.to_string()))?;
        Ok(Store { pool, names, scripts: Arc::new(Scripts::load()) })
    }

    pub async fn conn(&self) -> Result<Connection> {
        Ok(self.pool.get().await?)
    }

    /// Runs a script invocation with the call timeout.
    pub async fn invoke<T: FromRedisValue>(&self, inv: &ScriptInvocation<'_>) -> Result<T> {
        let mut c = self.conn().await?;
        match tokio::time::timeout(CALL_TIMEOUT, inv.invoke_async(&mut c)).await {
            Ok(r) => Ok(r?),
            Err(_) => Err(Error::Other("redis call timed out".into())),
        }
    }

    /// Runs a command with the call timeout.
    pub async fn query<T: FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T> {
        let mut c = self.conn().await?;
        match tokio::time::timeout(CALL_TIMEOUT, cmd.query_async(&mut c)).await {
            Ok(r) => Ok(r?),
            Err(_) => Err(Error::Other("redis call timed out".into())),
        }
    }

    /// Runs a pipeline with the call timeout.
    pub async fn pipe<T: FromRedisValue>(&self, p: &redis::Pipeline) -> Result<T> {
        let mut c = self.conn().await?;
        match tokio::time::timeout(CALL_TIMEOUT, p.query_async(&mut c)).await {
            Ok(r) => Ok(r?),
            Err(_) => Err(Error::Other("redis call timed out".into())),
        }
    }

    /// PING, for readiness.
    pub async fn ping(&self) -> bool {
        self.query::<String>(&redis::cmd("PING")).await.is_ok()
    }

    /// A write that expires by itself, for readiness: fails while Redis refuses writes
    /// (`READONLY` replica, out of memory, a closed port).
    pub async fn write_probe(&self) -> Result<()> {
        let mut cmd = redis::cmd("SET");
        cmd.arg(self.names.ready_probe_key()).arg(now_ms()).arg("PX").arg(10_000);
        self.query::<()>(&cmd).await
    }

    /// Deletes every key of the namespace (tests' clean-up).
    pub async fn delete_namespace(&self) -> Result<()> {
        let mut c = self.conn().await?;
        let keys: Vec<String> = redis::cmd("KEYS").arg(self.names.all_keys_pattern()).query_async(&mut c).await?;
        for chunk in keys.chunks(500) {
            let _: () = redis::cmd("DEL").arg(chunk).query_async(&mut c).await?;
        }
        Ok(())
    }
}

/// The permanent form of a Redis error no retry can fix — the password refused
/// (`WRONGPASS`, `NOAUTH`, authentication failed) — naming `FLEET_REDIS_URL` with the password
/// hidden; `None` for the rest (refused connection, `READONLY`, timeouts: retried).
pub fn permanent(e: &Error, url: &str) -> Option<Error> {
    let redis_error = match e {
        Error::Redis(r) => r,
        Error::Pool(deadpool_redis::PoolError::Backend(r)) => r,
        _ => return None,
    };
    let auth = redis_error.kind() == redis::ErrorKind::AuthenticationFailed
        || matches!(redis_error.code(), Some("WRONGPASS" | "NOAUTH" | "NOPERM"));
    auth.then(|| Error::Permanent {
        setting: "FLEET_REDIS_URL".into(),
        message: format!(
            "Redis refused {} ({}): check the user name and password in the URL",
            crate::redact::redact(url),
            crate::redact::redact(&redis_error.to_string())
        ),
    })
}

/// Milliseconds since the Unix epoch, the clock of every lease and heartbeat.
pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}
