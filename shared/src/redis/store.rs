//! Redis: the pool, the scripts and the namespace, with a timeout on every call so one slow
//! reply cannot stall a worker or a scheduler; callers retry, log and keep going.

use std::sync::Arc;
use std::time::Duration;

use deadpool_redis::redis::{self, FromRedisValue, ScriptInvocation};

use super::sentinel::{self, Conn, Pool, Shared};
use crate::error::{Error, Result};
use crate::names::Names;
use crate::redis::Scripts;
use crate::tls::TlsConfig;

/// Longest a single Redis call may take before it counts as failed.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(3);

/// Longest [`Store::invoke_replicated`] waits for a replica to acknowledge a write.
pub const REPLICA_WAIT: Duration = Duration::from_millis(500);

/// How long [`Store::invoke_replicated`] trusts its last count of online replicas before it
/// asks the master again (`INFO replication`, on the connection it already holds).
pub const REPLICA_RECHECK: Duration = Duration::from_secs(1);

/// Handle on the fleet's Redis state. Cheap to clone.
#[derive(Clone)]
pub struct Store {
    pool: Pool,
    /// The shared connection every call clones (see [`Shared`]); `None` until the first call
    /// and after a failure.
    shared: Arc<std::sync::Mutex<Option<Shared>>>,
    /// The namespace's keys.
    pub names: Names,
    /// The Lua scripts (shared by every clone).
    pub scripts: Arc<Scripts>,
    /// The fleet's one clock (Redis server time), shared by every clone.
    pub clock: Clock,
    /// Whether the master had an online replica when last asked (see
    /// [`Store::invoke_replicated`]), shared by every clone.
    replicas: Arc<ReplicaCheck>,
    /// Behind Sentinel: the master switches this process has heard of ([`Switches`]).
    switches: Option<Arc<Switches>>,
}

/// The last answer to "has the master an online replica?" and when it was taken.
#[derive(Debug, Default)]
struct ReplicaCheck {
    /// Process clock (ms since the epoch) of the last check; 0: never asked.
    checked_ms: std::sync::atomic::AtomicI64,
    /// The last check found no online replica: `WAIT` would only run out its timeout.
    none: std::sync::atomic::AtomicBool,
}

/// What a Sentinel-backed store knows of master switches: the Sentinels and master name to
/// watch (`sentinel::watch_switches`, started by the first call), a generation bumped
/// at each switch (a connection made under an older one is not shared), and when the last
/// switch was heard (older pooled connections are dropped).
struct Switches {
    sentinels: Vec<String>,
    master: String,
    started: std::sync::atomic::AtomicBool,
    generation: std::sync::atomic::AtomicU64,
    last: std::sync::Mutex<Option<std::time::Instant>>,
    /// Until when new calls wait (a promotion announced, the switch not yet).
    paused_until: std::sync::Mutex<Option<tokio::time::Instant>>,
    /// Woken at the switch.
    resumed: tokio::sync::Notify,
}

/// Longest new calls are held between a promotion's start and `+switch-master` (a failover
/// that aborts after the first announcement costs this much; Sentinel's own promotion check
/// takes about a second).
pub const SWITCH_PAUSE: Duration = Duration::from_secs(5);

/// How long after a switch pooled connections are checked for their age before use.
const SWITCH_RECENT: Duration = Duration::from_secs(30);

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
        chrono::Utc::now().timestamp_millis()
            + self.offset_ms.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Redis time now.
    pub fn now(&self) -> chrono::DateTime<chrono::Utc> {
        chrono::Utc::now()
            + chrono::Duration::milliseconds(
                self.offset_ms.load(std::sync::atomic::Ordering::Relaxed),
            )
    }

    /// This process's clock minus Redis's, in milliseconds (positive: this clock is ahead).
    pub fn skew_ms(&self) -> i64 {
        -self.offset_ms.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Store {
    /// Builds the pool (no connection is made until first use), trusting the system roots
    /// for `rediss://`. `url` is `redis://…`, `rediss://…`, the Sentinel form
    /// `redis+sentinel://…` or the Redis Cluster form `redis+cluster://…` (see
    /// [`crate::redis`]).
    pub fn new(url: &str, names: Names) -> Result<Self> {
        Self::with_tls(url, names, &TlsConfig::default())
    }

    /// Builds the pool; a `rediss://` URL uses `tls` (extra CA, client certificate) and
    /// verifies the server's name against the URL's host. User and password in the URL
    /// (`rediss://user:pass@host`) authenticate an ACL user. A failed handshake shows up as a
    /// `Pool` error at the first call.
    pub fn with_tls(url: &str, names: Names, tls: &TlsConfig) -> Result<Self> {
        let mut pc = deadpool_redis::PoolConfig::new(32);
        pc.timeouts.wait = Some(CALL_TIMEOUT);
        pc.timeouts.create = Some(CALL_TIMEOUT);
        pc.timeouts.recycle = Some(CALL_TIMEOUT);
        let pool = Pool::new(url, pc, tls)?;
        let switches = match crate::redis::Target::parse(url) {
            Ok(crate::redis::Target::Sentinel {
                sentinels, master, ..
            }) => Some(Arc::new(Switches {
                sentinels,
                master,
                started: Default::default(),
                generation: Default::default(),
                last: Default::default(),
                paused_until: Default::default(),
                resumed: Default::default(),
            })),
            _ => None,
        };
        Ok(Store {
            pool,
            shared: Arc::default(),
            names,
            scripts: Arc::new(Scripts::load()),
            clock: Clock::default(),
            replicas: Arc::default(),
            switches,
        })
    }

    /// Behind Sentinel, starts watching every Sentinel for `+switch-master` (once per store
    /// and its clones; see [`crate::redis`]): on a switch of its master the shared
    /// connection and the idle pooled ones are dropped. Each loop ends within a second of the
    /// last clone of this store being dropped.
    fn watch_switches(&self) {
        let Some(sw) = &self.switches else { return };
        if sw.started.swap(true, std::sync::atomic::Ordering::AcqRel) {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            sw.started
                .store(false, std::sync::atomic::Ordering::Release);
            return;
        };
        for sentinel in sw.sentinels.clone() {
            let shared = Arc::downgrade(&self.shared);
            let alive_shared = shared.clone();
            let sw_weak = Arc::downgrade(sw);
            let pool = self.pool.clone();
            let master = sw.master.clone();
            rt.spawn(async move {
                sentinel::watch_switches(
                    sentinel,
                    master,
                    move || alive_shared.strong_count() > 0,
                    move |a| {
                        let Some(sw) = sw_weak.upgrade() else { return };
                        sw.generation
                            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
                        if let Some(s) = shared.upgrade() {
                            if let Ok(mut g) = s.lock() {
                                *g = None;
                            }
                        }
                        pool.drop_idle();
                        if let Ok(mut g) = sw.last.lock() {
                            *g = Some(std::time::Instant::now());
                        }
                        match a {
                            sentinel::Announcement::Promoting => {
                                if let Ok(mut g) = sw.paused_until.lock() {
                                    *g = Some(tokio::time::Instant::now() + SWITCH_PAUSE);
                                }
                                tracing::warn!("Sentinel is promoting a replica of the Redis master; holding Redis calls until the switch");
                            }
                            sentinel::Announcement::Switched(to) => {
                                if let Ok(mut g) = sw.paused_until.lock() {
                                    *g = None;
                                }
                                sw.resumed.notify_waiters();
                                metrics::counter!(crate::metrics::REDIS_MASTER_SWITCHES)
                                    .increment(1);
                                tracing::warn!(new_master = %to, "Sentinel switched the Redis master; reconnecting to the new one");
                            }
                        }
                    },
                )
                .await;
            });
        }
    }

    /// Waits while a promotion is announced and the switch is not (at most [`SWITCH_PAUSE`]).
    async fn hold_during_switch(&self) {
        let Some(sw) = &self.switches else { return };
        loop {
            // Created before the check: a switch announced in between still wakes it.
            let woken = sw.resumed.notified();
            let until = sw.paused_until.lock().ok().and_then(|g| *g);
            let Some(until) = until.filter(|u| *u > tokio::time::Instant::now()) else {
                return;
            };
            let _ = tokio::time::timeout_at(until, woken).await;
        }
    }

    /// The switch generation now (0 without Sentinel).
    fn generation(&self) -> u64 {
        self.switches.as_ref().map_or(0, |s| {
            s.generation.load(std::sync::atomic::Ordering::Acquire)
        })
    }

    /// A pooled connection, none made before a recent master switch.
    async fn pooled(&self) -> Result<Conn> {
        if let Some(last) = self
            .switches
            .as_ref()
            .and_then(|s| s.last.lock().ok().and_then(|g| *g))
            .filter(|t| t.elapsed() < SWITCH_RECENT)
        {
            self.pool.drop_older(last);
        }
        // Boxed: the pool's future carries the whole connect (Sentinel discovery included,
        // ≈ 10 KB), and without the box every future that awaits a Redis call would be that
        // large — copied and allocated once per call and per task attempt that embeds one,
        // though a call almost always takes the shared connection and never gets here (only
        // a replicated call behind Sentinel takes a pooled connection every time).
        Box::pin(self.pool.get()).await
    }

    /// A clone of the shared connection, connecting it first if there is none.
    ///
    /// # Errors
    /// Redis unreachable (or every Sentinel), or the connect timed out.
    pub async fn conn(&self) -> Result<Conn> {
        self.watch_switches();
        self.hold_during_switch().await;
        if let Some(s) = self.shared.lock().ok().and_then(|g| g.clone()) {
            return Ok(Conn::Shared(s));
        }
        let generation = self.generation();
        let s = self.pooled().await?.into_shared();
        if generation != self.generation() {
            // The master switched while this one connected: use it once, share none of it.
            return Ok(Conn::Shared(s));
        }
        if let Ok(mut g) = self.shared.lock() {
            // Another call may have connected meanwhile: keep the first, so every call shares one.
            return Ok(Conn::Shared(g.get_or_insert(s).clone()));
        }
        Ok(Conn::Shared(s))
    }

    /// Forgets the shared connection: the next call connects anew.
    fn reset(&self) {
        if let Ok(mut g) = self.shared.lock() {
            *g = None;
        }
    }

    /// The answer of one call on `c`, with a connection that found Redis read-only (a
    /// demoted master) taken out of the pool together with every idle one, so the next call
    /// reconnects (through Sentinel: to the new master).
    fn settle<T>(
        &self,
        c: Conn,
        r: std::result::Result<redis::RedisResult<T>, tokio::time::error::Elapsed>,
    ) -> Result<T> {
        match r {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => {
                if Failure::of_redis(&e) == Failure::ReadOnly {
                    c.discard();
                    self.reset();
                    self.pool.drop_idle();
                    metrics::counter!(crate::metrics::REDIS_READ_ONLY).increment(1);
                    tracing::warn!(
                        sentinel = self.pool.is_sentinel(),
                        "Redis answered READONLY (a demoted master); reconnecting"
                    );
                } else if e.is_io_error()
                    || e.is_connection_dropped()
                    || e.is_connection_refusal()
                    || e.is_timeout()
                    || e.is_unrecoverable_error()
                {
                    // The connection, not the call, failed: the next call connects anew.
                    self.reset();
                }
                Err(e.into())
            }
            Err(_) => {
                // A connection that stopped answering (a half-open socket) would time out
                // every later call too.
                self.reset();
                Err(Error::Timeout {
                    what: "a Redis call".into(),
                    after: CALL_TIMEOUT,
                })
            }
        }
    }

    /// Runs a script invocation with the call timeout.
    pub async fn invoke<T: FromRedisValue>(&self, inv: &ScriptInvocation<'_>) -> Result<T> {
        let mut c = self.conn().await?;
        let r = tokio::time::timeout(CALL_TIMEOUT, inv.invoke_async(&mut c)).await;
        self.settle(c, r)
    }

    /// [`Store::invoke`], then — behind Sentinel — `WAIT 1 <REPLICA_WAIT>` on the same
    /// connection: the call returns once a replica has every write so far (or the wait ran
    /// out: best effort, a replica that is down does not stop the fleet). Redis replication is
    /// asynchronous, so without it a write the master answered in the moment before it died
    /// is lost with it; used for task outcomes (a status `succeeded` that reverted to
    /// `queued` after a failover). Direct and Cluster URLs skip the wait (a plain [`Store::invoke`]).
    ///
    /// A best-effort wait must not become a rate limit (issue 37 item 2: after a failover with
    /// no replica left, `WAIT` ran out its 500 ms on every outcome batch and completions fell
    /// to 16/s): the master's online replicas are counted at most every [`REPLICA_RECHECK`]
    /// (`INFO replication`, `slaveN:…state=online`), and with none the wait is skipped; a
    /// `WAIT` that no replica answers marks them absent until the next count.
    pub async fn invoke_replicated<T: FromRedisValue>(
        &self,
        inv: &ScriptInvocation<'_>,
    ) -> Result<T> {
        if !self.pool.is_sentinel() {
            return self.invoke(inv).await;
        }
        // `WAIT` blocks its connection: a pooled one of its own, not the shared one.
        self.watch_switches();
        self.hold_during_switch().await;
        let mut c = self.pooled().await?;
        let r = tokio::time::timeout(CALL_TIMEOUT, inv.invoke_async(&mut c)).await;
        if !matches!(r, Ok(Ok(_))) {
            return self.settle(c, r);
        }
        use std::sync::atomic::Ordering::Relaxed;
        let now = chrono::Utc::now().timestamp_millis();
        let checked = self.replicas.checked_ms.load(Relaxed);
        if now - checked >= REPLICA_RECHECK.as_millis() as i64 {
            let info = redis::cmd("INFO").arg("replication").to_owned();
            if let Ok(Ok(text)) =
                tokio::time::timeout(CALL_TIMEOUT, info.query_async::<String>(&mut c)).await
            {
                let online = online_replicas(&text);
                self.replicas.none.store(online == 0, Relaxed);
                self.replicas.checked_ms.store(now, Relaxed);
            }
        }
        if self.replicas.none.load(Relaxed) {
            return self.settle(c, r);
        }
        let wait = redis::cmd("WAIT")
            .arg(1)
            .arg(REPLICA_WAIT.as_millis() as u64)
            .to_owned();
        let acked = tokio::time::timeout(CALL_TIMEOUT, wait.query_async::<i64>(&mut c)).await;
        if !matches!(acked, Ok(Ok(n)) if n >= 1) {
            tracing::debug!(?acked, "no replica acknowledged the write in time");
            self.replicas.none.store(true, Relaxed);
            self.replicas.checked_ms.store(now, Relaxed);
        }
        self.settle(c, r)
    }

    /// Runs a command with the call timeout.
    pub async fn query<T: FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T> {
        let mut c = self.conn().await?;
        let r = tokio::time::timeout(CALL_TIMEOUT, cmd.query_async(&mut c)).await;
        self.settle(c, r)
    }

    /// Runs a pipeline with the call timeout.
    pub async fn pipe<T: FromRedisValue>(&self, p: &redis::Pipeline) -> Result<T> {
        let mut c = self.conn().await?;
        let r = tokio::time::timeout(CALL_TIMEOUT, p.query_async(&mut c)).await;
        self.settle(c, r)
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
        let before = self
            .clock
            .offset_ms
            .swap(offset, std::sync::atomic::Ordering::Relaxed);
        let skew = -offset;
        metrics::gauge!(crate::metrics::CLOCK_SKEW).set(skew as f64 / 1000.0);
        let warn = SKEW_WARN.as_millis() as i64;
        if skew.abs() > warn && ((-before).abs() <= warn || before == 0) {
            tracing::warn!(skew_ms = skew, "this process's clock differs from Redis's by more than {} s; fleet uses Redis time, but check NTP", SKEW_WARN.as_secs());
        }
        Ok(skew)
    }

    /// The latest tick of a schedule that was fired or counted missed (Redis-clock ms), `None`
    /// before its first (or after Redis lost the marks).
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn schedule_last(&self, schedule: &str) -> Result<Option<i64>> {
        self.query(redis::cmd("GET").arg(self.names.schedule_last(schedule)))
            .await
    }

    /// What became of one tick of a schedule (`fired` or `missed`; `None`: not decided, or its
    /// mark expired).
    ///
    /// # Errors
    /// Redis unreachable or slow.
    pub async fn schedule_tick(&self, schedule: &str, tick_ms: i64) -> Result<Option<String>> {
        self.query(redis::cmd("GET").arg(self.names.schedule_tick(schedule, tick_ms)))
            .await
    }

    /// PING, for readiness.
    pub async fn ping(&self) -> bool {
        self.query::<String>(&redis::cmd("PING")).await.is_ok()
    }

    /// A write that expires by itself, for readiness: fails while Redis refuses writes
    /// (`READONLY` replica, out of memory, a closed port).
    pub async fn write_probe(&self) -> Result<()> {
        let mut cmd = redis::cmd("SET");
        cmd.arg(self.names.ready_probe_key())
            .arg(now_ms())
            .arg("PX")
            .arg(10_000);
        self.query::<()>(&cmd).await
    }

    /// Deletes every key of the namespace (tests' clean-up).
    pub async fn delete_namespace(&self) -> Result<()> {
        let mut c = self.conn().await?;
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(self.names.all_keys_pattern())
            .query_async(&mut c)
            .await?;
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
            crate::process::redact(url),
            crate::process::redact(&redis_error.to_string())
        ),
    })
}

/// Why a Redis command failed, in the terms an operator and a caller act on: [`Failure::of`]
/// classifies the error (redis-rs's kinds and the server's error code), [`Failure::describe`]
/// says it. The one place a Redis error is read: dispatch retries a batch task by task only on
/// [`Failure::Script`], the store reconnects on [`Failure::ReadOnly`] (a demoted master,
/// behind Sentinel), the scheduler's readiness log says what failed.
///
/// "Redis refuses writes" is only the server's own refusal (`READONLY` of a replica, `OOM`
/// past `maxmemory`, `MISCONF` after a failed snapshot, `NOREPLICAS`), never a connection
/// that was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// No connection: refused, reset, dropped, no route (I/O errors).
    Unreachable,
    /// Connected, but no answer in time (the call timeout, [`Error::Timeout`], or the pool's).
    Timeout,
    /// The server is a replica (`READONLY`, also when a script's write met it): the master it
    /// was has been demoted; the next call reconnects (through Sentinel: to the new master).
    ReadOnly,
    /// The server answered and refused the write for a reason of its own (`OOM`, `MISCONF`,
    /// `NOREPLICAS`).
    RefusesWrites,
    /// The server refused the credentials.
    Auth,
    /// The server ran the command and answered an error of the command itself: a script that
    /// failed (`ERR … user_script…`, an error reply of its own), a wrong type, a script not
    /// loaded. Retrying the same call gives the same answer.
    Script,
    /// Anything else: a reply that does not parse, a server that cannot serve yet (`LOADING`,
    /// `TRYAGAIN`, `CLUSTERDOWN`, a redirect), an error that is not Redis's.
    Other,
}

impl Failure {
    /// The kind of Redis failure `e` is; [`Failure::Other`] for an error that is not Redis's
    /// ([`Error::Timeout`] reads as [`Failure::Timeout`]: a store's call timeout).
    pub fn of(e: &Error) -> Self {
        match e {
            Error::Redis(r) | Error::Pool(deadpool_redis::PoolError::Backend(r)) => {
                Failure::of_redis(r)
            }
            Error::Pool(deadpool_redis::PoolError::Timeout(_)) | Error::Timeout { .. } => {
                Failure::Timeout
            }
            _ => Failure::Other,
        }
    }

    /// The kind of failure a Redis error is (see [`Failure`]).
    pub fn of_redis(r: &redis::RedisError) -> Self {
        use redis::{ErrorKind, ServerErrorKind};
        if r.kind() == ErrorKind::AuthenticationFailed
            || matches!(r.code(), Some("WRONGPASS" | "NOAUTH" | "NOPERM"))
        {
            Failure::Auth
        } else if read_only(r) {
            Failure::ReadOnly
        } else if matches!(r.code(), Some("OOM" | "MISCONF" | "NOREPLICAS")) {
            Failure::RefusesWrites
        } else if r.is_timeout() {
            Failure::Timeout
        } else if r.is_connection_refusal() || r.is_io_error() || r.is_connection_dropped() {
            Failure::Unreachable
        } else if matches!(
            r.kind(),
            ErrorKind::Extension
                | ErrorKind::UnexpectedReturnType
                | ErrorKind::Server(
                    ServerErrorKind::ResponseError
                        | ServerErrorKind::ExecAbort
                        | ServerErrorKind::NoScript
                        | ServerErrorKind::CrossSlot
                        | ServerErrorKind::NotBusy
                        | ServerErrorKind::NoSub
                )
        ) {
            Failure::Script
        } else {
            Failure::Other
        }
    }

    /// What to say in a log line: "Redis cannot be reached", "Redis does not answer in time",
    /// "Redis refuses writes" (also for [`Failure::ReadOnly`]), "Redis refuses the
    /// credentials", "a Redis command failed" (also for [`Failure::Script`]).
    pub fn describe(self) -> &'static str {
        match self {
            Failure::Unreachable => "Redis cannot be reached",
            Failure::Timeout => "Redis does not answer in time",
            Failure::ReadOnly | Failure::RefusesWrites => "Redis refuses writes",
            Failure::Auth => "Redis refuses the credentials",
            Failure::Script | Failure::Other => "a Redis command failed",
        }
    }
}

/// Whether a Redis error says the server is a replica (`READONLY You can't write against a
/// read only replica`). Inside a script the refusal may come wrapped in the script's error
/// (Redis 6: `ERR Error running script … -READONLY You can't write …`), so the detail is read
/// too — here and nowhere else.
fn read_only(r: &redis::RedisError) -> bool {
    r.code() == Some("READONLY")
        || r.detail().is_some_and(|d| {
            d.contains("-READONLY") || d.contains("READONLY You") || d.contains("read only replica")
        })
}

/// Milliseconds since the Unix epoch, the clock of every lease and heartbeat.
pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}

/// A duration in whole milliseconds, as scripts and `PX`/`PEXPIRE` take it (saturating): the
/// one conversion from the `Duration`s of the Store API.
pub fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Online replicas in an `INFO replication` answer: the `slaveN:` lines with `state=online`
/// (a replica still loading its first sync, `wait_bgsave` / `send_bulk`, cannot acknowledge).
fn online_replicas(info: &str) -> usize {
    info.lines()
        .filter(|l| l.starts_with("slave") && l.contains("state=online"))
        .count()
}

#[cfg(test)]
mod replica_tests {
    use super::online_replicas;

    #[test]
    fn counts_only_online_replicas() {
        let info = "# Replication\r\nrole:master\r\nconnected_slaves:2\r\n\
            slave0:ip=127.0.0.1,port=7001,state=online,offset=42,lag=0\r\n\
            slave1:ip=127.0.0.1,port=7002,state=wait_bgsave,offset=0,lag=0\r\n\
            master_failover_state:no-failover\r\n";
        assert_eq!(online_replicas(info), 1);
        assert_eq!(online_replicas("role:master\r\nconnected_slaves:0\r\n"), 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A refused connection is "cannot be reached", never "refuses writes" (the scheduler's
    /// readiness log said the latter for both).
    #[tokio::test]
    async fn a_refused_connection_is_unreachable_not_a_refused_write() {
        // Port 1 on loopback: nothing listens there.
        let store = Store::new("redis://127.0.0.1:1", Names::new("failure-test")).unwrap();
        let e = store.write_probe().await.unwrap_err();
        assert_eq!(Failure::of(&e), Failure::Unreachable, "{e}");
        assert_eq!(Failure::of(&e).describe(), "Redis cannot be reached");
        assert_eq!(
            Failure::of(&Error::NotConnected).describe(),
            "a Redis command failed"
        );
    }

    /// A call's future does not carry the pool's connect (Sentinel discovery included): the
    /// shared connection is almost always there, and every future that awaits a call — a
    /// worker's per-task attempt among them — was ≈ 11 KB for it, copied and allocated per
    /// task (issue 34, BENCHMARKS.md round 28). The bound is for this test's (debug) build;
    /// the connect alone is > 6 KB.
    #[test]
    fn a_calls_future_does_not_carry_the_connect() {
        let store = Store::new("redis://127.0.0.1:1", Names::new("size-test")).unwrap();
        let cmd = redis::cmd("PING");
        let query = store.query::<String>(&cmd);
        assert!(
            std::mem::size_of_val(&query) <= 2048,
            "Store::query's future is {} bytes",
            std::mem::size_of_val(&query)
        );
        let conn = store.conn();
        assert!(
            std::mem::size_of_val(&conn) <= 1024,
            "Store::conn's future is {} bytes",
            std::mem::size_of_val(&conn)
        );
    }

    fn server(code: &str, detail: &str) -> redis::RedisError {
        redis::make_extension_error(code.into(), Some(detail.into()))
    }

    /// Every kind a caller acts on, from errors built as redis-rs builds them.
    #[test]
    fn redis_errors_are_classified() {
        use redis::{ErrorKind, RedisError, ServerErrorKind};
        let cases: Vec<(RedisError, Failure)> = vec![
            (
                (ErrorKind::Server(ServerErrorKind::ReadOnly), "readonly").into(),
                Failure::ReadOnly,
            ),
            (
                server("READONLY", "You can't write against a read only replica."),
                Failure::ReadOnly,
            ),
            // Redis 6 wraps a write refused inside a script in the script's error.
            (
                (
                    ErrorKind::Server(ServerErrorKind::ResponseError),
                    "script",
                    "Error running script (call to f_1): @user_script:1: -READONLY You can't \
                     write against a read only replica."
                        .to_string(),
                )
                    .into(),
                Failure::ReadOnly,
            ),
            (
                server("OOM", "command not allowed when used memory > 'maxmemory'."),
                Failure::RefusesWrites,
            ),
            (
                server("MISCONF", "Redis is configured to save"),
                Failure::RefusesWrites,
            ),
            (
                server("NOREPLICAS", "Not enough good replicas"),
                Failure::RefusesWrites,
            ),
            (
                server("WRONGPASS", "invalid username-password pair"),
                Failure::Auth,
            ),
            (
                (ErrorKind::AuthenticationFailed, "auth").into(),
                Failure::Auth,
            ),
            (
                (
                    ErrorKind::Server(ServerErrorKind::ResponseError),
                    "script",
                    "user_script:1: attempt to compare nil with number".to_string(),
                )
                    .into(),
                Failure::Script,
            ),
            (
                server(
                    "WRONGTYPE",
                    "Operation against a key holding the wrong kind",
                ),
                Failure::Script,
            ),
            (
                server("DUPLICATE", "an error reply of a script's own"),
                Failure::Script,
            ),
            (
                (ErrorKind::Server(ServerErrorKind::NoScript), "noscript").into(),
                Failure::Script,
            ),
            (
                std::io::Error::from(std::io::ErrorKind::TimedOut).into(),
                Failure::Timeout,
            ),
            (
                std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into(),
                Failure::Unreachable,
            ),
            (
                std::io::Error::from(std::io::ErrorKind::ConnectionReset).into(),
                Failure::Unreachable,
            ),
            (
                (ErrorKind::Server(ServerErrorKind::BusyLoading), "loading").into(),
                Failure::Other,
            ),
            (
                (ErrorKind::Server(ServerErrorKind::TryAgain), "tryagain").into(),
                Failure::Other,
            ),
        ];
        for (e, want) in cases {
            assert_eq!(Failure::of_redis(&e), want, "{e}");
            assert_eq!(Failure::of(&Error::Redis(e)), want);
        }
        let timeout = Error::Timeout {
            what: "a Redis call".into(),
            after: CALL_TIMEOUT,
        };
        assert_eq!(Failure::of(&timeout), Failure::Timeout);
        assert_eq!(Failure::of(&Error::SessionEnded), Failure::Other);
    }

    /// The same kinds from the real Redis (127.0.0.1:6379): a script that fails, a script's
    /// own error reply, a wrong type. A key under a random name, deleted at the end.
    #[tokio::test]
    async fn real_script_errors_are_script_failures() {
        let ns = format!("failure-test-{}", uuid::Uuid::new_v4().simple());
        let store = Store::new("redis://127.0.0.1:6379", Names::new(&ns)).unwrap();
        let key = format!("{}s", store.names.prefix());
        let failing = [
            redis::cmd("EVAL").arg("return nil < 1").arg(0).to_owned(),
            redis::cmd("EVAL")
                .arg("return redis.error_reply('REFUSED no')")
                .arg(0)
                .to_owned(),
            redis::cmd("EVAL")
                .arg("redis.call('SET', KEYS[1], 'x'); return redis.call('LPUSH', KEYS[1], 'y')")
                .arg(1)
                .arg(&key)
                .to_owned(),
            redis::cmd("LPUSH").arg(&key).arg("y").to_owned(),
        ];
        for cmd in &failing {
            let e = store.query::<redis::Value>(cmd).await.unwrap_err();
            assert_eq!(Failure::of(&e), Failure::Script, "{e}");
        }
        let _: i64 = store.query(redis::cmd("DEL").arg(&key)).await.unwrap();
    }
}
