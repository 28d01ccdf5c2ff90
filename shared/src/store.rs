//! Redis: the pool, the scripts and the namespace, with a timeout on every call so one slow
//! reply cannot stall a worker or a scheduler; callers retry, log and keep going.

use std::sync::Arc;
use std::time::Duration;

use deadpool_redis::redis::{self, FromRedisValue, ScriptInvocation};
use deadpool_redis::{Connection, Pool, Runtime};

use crate::error::{Error, Result};
use crate::tls::TlsConfig;
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
    /// The fleet's one clock (Redis server time), shared by every clone.
    pub clock: Clock,
}

/// Skew of this process's clock against Redis above which a warning is logged.
pub const SKEW_WARN: Duration = Duration::from_secs(1);

/// The fleet's one clock: the Redis server's time, as estimated in this process (its own clock
/// plus the offset last measured by [`Store::measure_clock`]). Heartbeat ages, leases, eviction
/// and the rate limiter are computed inside Redis with `TIME`; deadlines and ages that a process
/// checks itself use this, so a process whose clock is off by a minute neither expires work
/// early nor evicts its peers. Cheap to clone (one shared offset).
#[derive(Debug, Clone, Default)]
pub struct Clock {
    offset_ms: Arc<std::sync::atomic::AtomicI64>,
}

impl Clock {
    /// Redis time now, in milliseconds since the Unix epoch.
    pub fn now_ms(&self) -> i64 {
        chrono::Utc::now().timestamp_millis() + self.offset_ms.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Redis time now.
    pub fn now(&self) -> chrono::DateTime<chrono::Utc> {
        chrono::Utc::now() + chrono::Duration::milliseconds(self.offset_ms.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// This process's clock minus Redis's, in milliseconds (positive: this clock is ahead).
    pub fn skew_ms(&self) -> i64 {
        -self.offset_ms.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Store {
    /// Builds the pool (no connection is made until first use), trusting the system roots
    /// for `rediss://`.
    pub fn new(url: &str, names: Names) -> Result<Self> {
        Self::with_tls(url, names, &TlsConfig::default())
    }

    /// Builds the pool; a `rediss://` URL uses `tls` (extra CA, client certificate) and
    /// verifies the server's name against the URL's host. User and password in the URL
    /// (`rediss://user:pass@host`) authenticate an ACL user. A failed handshake shows up as a
    /// `Pool` error at the first call.
    pub fn with_tls(url: &str, names: Names, tls: &TlsConfig) -> Result<Self> {
        let url_error = |e: deadpool_redis::redis::RedisError| Error::config("FLEET_REDIS_URL", format!("{}: {e}", crate::redact::redact(url)));
        let info = if url.trim().get(..9).is_some_and(|p| p.eq_ignore_ascii_case("rediss://")) {
            crate::tls::install_crypto_provider();
            redis::Client::build_with_tls(url, tls.to_redis()).map_err(url_error)?.get_connection_info().clone()
        } else {
            redis::IntoConnectionInfo::into_connection_info(url).map_err(url_error)?
        };
        let manager = deadpool_redis::Manager::new(info).map_err(url_error)?;
        let pool = Pool::builder(manager)
            .max_size(32)
            .wait_timeout(Some(CALL_TIMEOUT))
            .create_timeout(Some(CALL_TIMEOUT))
            .recycle_timeout(Some(CALL_TIMEOUT))
            .runtime(Runtime::Tokio1)
            .build()
            .map_err(|e| Error::config("FLEET_REDIS_URL", e.to_string()))?;
        Ok(Store { pool, names, scripts: Arc::new(Scripts::load()), clock: Clock::default() })
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

    /// Measures this process's clock against Redis (`TIME`, halfway through the round trip),
    /// updates [`Store::clock`] and the `fleet_clock_skew_seconds` gauge, and warns when the
    /// skew passes [`SKEW_WARN`]. Returns the skew in ms (local − Redis).
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn measure_clock(&self) -> Result<i64> {
        let t0 = chrono::Utc::now().timestamp_millis();
        let (secs, micros): (i64, i64) = self.query(&redis::cmd("TIME")).await?;
        let t1 = chrono::Utc::now().timestamp_millis();
        let redis_ms = secs * 1000 + micros / 1000;
        let offset = redis_ms - (t0 + t1) / 2;
        let before = self.clock.offset_ms.swap(offset, std::sync::atomic::Ordering::Relaxed);
        let skew = -offset;
        metrics::gauge!(crate::metrics::CLOCK_SKEW).set(skew as f64 / 1000.0);
        let warn = SKEW_WARN.as_millis() as i64;
        if skew.abs() > warn && ((-before).abs() <= warn || before == 0) {
            tracing::warn!(skew_ms = skew, "this process's clock differs from Redis's by more than {} s; fleet uses Redis time, but check NTP", SKEW_WARN.as_secs());
        }
        Ok(skew)
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
