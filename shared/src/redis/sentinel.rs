//! Where the fleet's Redis is, and the connection pool for it: one server (`redis://`,
//! `rediss://`), a master behind Sentinel (the `redis+sentinel://` form of `FLEET_REDIS_URL`, or
//! `FLEET_REDIS_SENTINELS` + `FLEET_REDIS_MASTER`), or a Redis Cluster (`redis+cluster://`).
//!
//! ```text
//! redis+sentinel://[[user]:password@]host1:port1,host2:port2,…/<master name>[/<db>]
//! redis+cluster://[[user]:password@]host1:port1,host2:port2,…
//! ```
//!
//! **Sentinel.** The password (and user, db) are the data nodes' (master and replicas); Sentinels
//! are asked without credentials. A new connection asks the Sentinels in turn for the master of
//! `<master name>` and checks its `ROLE` (the `redis` crate's `SentinelClient`), so after a
//! failover new connections go to the promoted replica.
//!
//! Connections already open are dropped **when Sentinel announces the switch**: each process
//! subscribes to `+failover-state-send-slaveof-noone` and `+switch-master` on every Sentinel
//! ([`watch_switches`], started with the store's first call). When the first names its master
//! (the replica is being promoted) the store holds new calls back (at most
//! `store::SWITCH_PAUSE`) and drops its connections; at `+switch-master` it lets them go,
//! connecting through the Sentinels to the new master (pooled connections made before the
//! switch are dropped too). Waiting for the old connections to break is not enough: in a
//! planned failover (`SENTINEL FAILOVER`, the old master alive) the old master keeps accepting
//! writes for seconds after the replica was promoted, until Sentinel reconfigures it as a
//! replica — and its resync with the new master then throws those writes away (statuses of
//! tasks published meanwhile vanished, and `/readyz` stayed 503 until the connections broke).
//! The fallbacks stay: a closed socket fails the pool's `PING` on recycle; a demoted master
//! still answers `PING` but refuses writes with `READONLY`, and [`crate::Store`] then empties
//! the pool ([`Pool::drop_idle`]). Holding calls between the two announcements (about a second:
//! Sentinel confirms the promotion by its next `INFO` of the replica) is what keeps writes off
//! the old master while the new one already runs; `/readyz` may be 503 for that long.
//!
//! **Cluster.** The hosts are seed nodes (any of the cluster's masters or replicas; one is
//! enough, more survive a seed being down); the `redis` crate's cluster client (`cluster-async`)
//! reads the slot map from them, sends each command and script to the master of its first
//! key's slot and follows `MOVED`/`ASK` redirections itself. Every key of a namespace carries the
//! hash tag `{<namespace>}` ([`crate::Names`]), so a namespace lives in **one hash slot**, on one
//! master: the scripts may touch keys they build from the prefix (`KEYS[1]`), and a namespace's
//! Redis work is bounded by that one master's core (see the README, "Redis Cluster"). Redis
//! Cluster has database 0 only; credentials apply to every node.

use deadpool_redis::redis::{self, aio::ConnectionLike};

use crate::error::{Error, Result};

/// Where the fleet's Redis is: one address, or a master name behind Sentinels.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A `redis://` URL.
    Direct(String),
    /// `redis+sentinel://`: the Sentinels' `host:port`s, the master's name, and the data
    /// nodes' credentials and db.
    Sentinel {
        /// The Sentinels, `host:port` each.
        sentinels: Vec<String>,
        /// The name they monitor the master under.
        master: String,
        /// The data nodes' user (ACL), if any.
        username: Option<String>,
        /// The data nodes' password, if any (never printed).
        password: Option<String>,
        /// The database number.
        db: i64,
    },
    /// `redis+cluster://`: seed nodes' `host:port`s and the credentials of every node.
    Cluster {
        /// Seed nodes, `host:port` each (the rest are discovered).
        nodes: Vec<String>,
        /// Every node's user (ACL), if any.
        username: Option<String>,
        /// Every node's password, if any (never printed).
        password: Option<String>,
    },
}

/// The URL scheme of the Sentinel form.
pub const SCHEME: &str = "redis+sentinel://";

/// The URL scheme of the Redis Cluster form.
pub const CLUSTER_SCHEME: &str = "redis+cluster://";

impl Target {
    /// Parses `FLEET_REDIS_URL`.
    ///
    /// # Errors
    /// A message naming what is wrong (password hidden): no Sentinel or cluster node, an empty
    /// or port-less address, no master name, a db that is not a number (Sentinel) or not 0
    /// (Cluster).
    pub fn parse(url: &str) -> std::result::Result<Self, String> {
        if let Some(rest) = strip_prefix_ci(url, CLUSTER_SCHEME) {
            let shown = crate::process::redact(url).into_owned();
            let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
            let (username, password, nodes) = split_authority(authority, &shown, "cluster node")?;
            if !matches!(path, "" | "0") {
                return Err(format!(
                    "`{shown}`: a Redis Cluster has database 0 only (no /<db> in {CLUSTER_SCHEME})"
                ));
            }
            return Ok(Target::Cluster {
                nodes,
                username,
                password,
            });
        }
        let Some(rest) = strip_prefix_ci(url, SCHEME) else {
            return Ok(Target::Direct(url.to_string()));
        };
        let shown = crate::process::redact(url).into_owned();
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (username, password, sentinels) = split_authority(authority, &shown, "Sentinel")?;
        let mut parts = path.split('/');
        let master = parts.next().unwrap_or("").to_string();
        if master.is_empty() {
            return Err(format!(
                "`{shown}`: no master name (use {SCHEME}host:26379,…/<master name>)"
            ));
        }
        let db = match parts.next() {
            None | Some("") => 0,
            Some(d) => d
                .parse::<i64>()
                .map_err(|_| format!("`{shown}`: db `{d}` is not a number"))?,
        };
        Ok(Target::Sentinel {
            sentinels,
            master,
            username,
            password,
            db,
        })
    }

    /// The Sentinel form built from `FLEET_REDIS_SENTINELS` (`host:port,host:port`) and
    /// `FLEET_REDIS_MASTER`, with the credentials and db of `base` (a `redis://` URL).
    pub fn from_settings(sentinels: &str, master: &str, base: &str) -> String {
        let rest = strip_prefix_ci(base, "redis://").unwrap_or("");
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let userinfo = authority
            .rfind('@')
            .map(|at| &authority[..=at])
            .unwrap_or("");
        let hosts: Vec<&str> = sentinels.split(',').map(str::trim).collect();
        let db = path
            .split('/')
            .next()
            .filter(|d| !d.is_empty())
            .map(|d| format!("/{d}"))
            .unwrap_or_default();
        format!("{SCHEME}{userinfo}{}/{master}{db}", hosts.join(","))
    }
}

/// The parts of a URL's authority: user, password and the `host:port`s.
type Authority = (Option<String>, Option<String>, Vec<String>);

/// `[[user]:password@]host:port,host:port,…` → (user, password, the `host:port`s), each
/// address checked; `what` names an address in the message (`shown`: the URL, password hidden).
fn split_authority(
    authority: &str,
    shown: &str,
    what: &str,
) -> std::result::Result<Authority, String> {
    let (userinfo, hosts) = match authority.rfind('@') {
        Some(at) => (Some(&authority[..at]), &authority[at + 1..]),
        None => (None, authority),
    };
    let (username, password) = match userinfo {
        None => (None, None),
        Some(u) => match u.split_once(':') {
            Some((user, pass)) => ((!user.is_empty()).then(|| decode(user)), Some(decode(pass))),
            None => (None, Some(decode(u))),
        },
    };
    let mut addrs = Vec::new();
    for (i, h) in hosts.split(',').enumerate() {
        let h = h.trim();
        let port_ok = h
            .rsplit_once(':')
            .is_some_and(|(host, p)| !host.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
        if !port_ok {
            return Err(format!(
                "`{shown}`: {what} {} `{h}` is not host:port",
                i + 1
            ));
        }
        addrs.push(h.to_string());
    }
    Ok((username, password, addrs))
}

fn strip_prefix_ci<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    (s.len() >= prefix.len()
        && s.is_char_boundary(prefix.len())
        && s[..prefix.len()].eq_ignore_ascii_case(prefix))
    .then(|| &s[prefix.len()..])
}

/// Percent-decoding of a URL's user or password (`%40` → `@`); text that is not valid
/// percent-encoding is kept as it is.
fn decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() && s.is_char_boundary(i + 3) {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8(out).unwrap_or_else(|_| s.to_string())
}

/// The pool behind [`crate::Store`]: direct, through Sentinel, or to a Redis Cluster.
#[derive(Clone)]
pub enum Pool {
    /// One server (`redis://`, `rediss://`).
    Direct(deadpool_redis::Pool),
    /// The master Sentinel names (`redis+sentinel://`), asked again after a failover.
    Sentinel(deadpool_redis::sentinel::Pool),
    /// Each pooled connection is a cluster client's: one multiplexed connection per node,
    /// commands routed by slot.
    Cluster(deadpool_redis::cluster::Pool),
}

/// A pooled connection of any kind; returned to its pool when dropped — or a clone of the
/// process's shared connection ([`Shared`]).
pub enum Conn {
    /// From a [`Pool::Direct`].
    Direct(deadpool_redis::Connection),
    /// From a [`Pool::Sentinel`].
    Sentinel(deadpool_redis::sentinel::Connection),
    /// From a [`Pool::Cluster`].
    Cluster(deadpool_redis::cluster::Connection),
    /// A clone of the shared connection.
    Shared(Shared),
}

/// The connection every call of a process goes through: one multiplexed connection taken out
/// of the pool (or a cluster client's, one per node), cloned per call. The `redis` crate
/// pipelines concurrent requests on it and matches replies in order, so it needs no checkout:
/// a pooled connection costs an `UNWATCH` + `PING` round trip on every checkout (deadpool's
/// recycle check), which doubled the Redis commands and round trips of every call. A shared
/// connection that fails (closed socket, timeout, `READONLY`) is dropped by
/// [`crate::Store`] and the next call takes a fresh one from the pool. Not for commands that
/// block their connection (`WAIT`, `BLPOP`): those take a pooled connection of their own.
#[derive(Clone)]
pub enum Shared {
    /// One server's, or the Sentinel-named master's.
    Multiplexed(redis::aio::MultiplexedConnection),
    /// A Redis Cluster client's.
    Cluster(redis::cluster_async::ClusterConnection),
}

/// Connection settings of a direct connection: the `redis` crate's own response timeout
/// (500 ms by default) would fail a call that [`crate::redis::CALL_TIMEOUT`] still allows.
fn connection_config() -> redis::AsyncConnectionConfig {
    redis::AsyncConnectionConfig::new()
        .set_response_timeout(Some(crate::redis::CALL_TIMEOUT))
        .set_connection_timeout(Some(crate::redis::CALL_TIMEOUT))
}

/// `TCP_NODELAY` on a direct connection (the `redis` crate leaves Nagle's algorithm on by
/// default). The shared connection pipelines the concurrent calls of a whole process: with
/// Nagle (RFC 896) a request written while an earlier one is unanswered waits in the kernel
/// until that reply's ACK arrives, so pipelined calls went out one round trip apart. Redis
/// sets `TCP_NODELAY` on its side of every connection for the same reason.
fn no_delay(info: redis::ConnectionInfo) -> redis::ConnectionInfo {
    info.set_tcp_settings(redis::io::tcp::TcpSettings::default().set_nodelay(true))
}

impl Pool {
    /// Builds the pool for `url` (no connection is made until first use), with `pc` as its
    /// size and timeouts; a `rediss://` URL uses `tls` (extra CA, client certificate) and
    /// verifies the server's name against the URL's host.
    ///
    /// # Errors
    /// [`Error::Config`] naming `FLEET_REDIS_URL` (password hidden).
    pub fn new(
        url: &str,
        pc: deadpool_redis::PoolConfig,
        tls: &crate::tls::TlsConfig,
    ) -> Result<Self> {
        let bad =
            |e: String| Error::config("FLEET_REDIS_URL", crate::process::redact(&e).into_owned());
        match Target::parse(url).map_err(bad)? {
            Target::Direct(u)
                if u.trim()
                    .get(..9)
                    .is_some_and(|p| p.eq_ignore_ascii_case("rediss://")) =>
            {
                crate::tls::install_crypto_provider();
                let info = redis::Client::build_with_tls(u.as_str(), tls.to_redis())
                    .map_err(|e| bad(e.to_string()))?
                    .get_connection_info()
                    .clone();
                let info = no_delay(info);
                let manager = deadpool_redis::Manager::new_with_config(info, connection_config())
                    .map_err(|e| bad(e.to_string()))?;
                let pool = deadpool_redis::Pool::builder(manager)
                    .config(pc)
                    .runtime(deadpool_redis::Runtime::Tokio1)
                    .build();
                Ok(Pool::Direct(pool.map_err(|e| bad(e.to_string()))?))
            }
            Target::Direct(u) => {
                let info = no_delay(
                    redis::IntoConnectionInfo::into_connection_info(u.as_str())
                        .map_err(|e| bad(e.to_string()))?,
                );
                let manager = deadpool_redis::Manager::new_with_config(info, connection_config())
                    .map_err(|e| bad(e.to_string()))?;
                let pool = deadpool_redis::Pool::builder(manager)
                    .config(pc)
                    .runtime(deadpool_redis::Runtime::Tokio1)
                    .build();
                Ok(Pool::Direct(pool.map_err(|e| bad(e.to_string()))?))
            }
            Target::Sentinel {
                sentinels,
                master,
                username,
                password,
                db,
            } => {
                use deadpool_redis::sentinel::{
                    Config, SentinelNodeConnectionInfo, SentinelServerType,
                };
                let urls: Vec<String> = sentinels.iter().map(|h| format!("redis://{h}")).collect();
                let node = SentinelNodeConnectionInfo {
                    tls_mode: None,
                    redis_connection_info: Some(deadpool_redis::RedisConnectionInfo {
                        db,
                        username,
                        password,
                        ..Default::default()
                    }),
                };
                let mut cfg = Config::from_urls(urls, master, SentinelServerType::Master)
                    .with_node_connection_info(Some(node));
                cfg.pool = Some(pc);
                Ok(Pool::Sentinel(
                    cfg.create_pool(Some(deadpool_redis::Runtime::Tokio1))
                        .map_err(|e| bad(e.to_string()))?,
                ))
            }
            Target::Cluster {
                nodes,
                username,
                password,
            } => {
                let redis_info = deadpool_redis::RedisConnectionInfo {
                    db: 0,
                    username,
                    password,
                    ..Default::default()
                };
                let mut seeds = Vec::with_capacity(nodes.len());
                for node in &nodes {
                    // `parse` checked `host:port`.
                    let (host, port) = node
                        .rsplit_once(':')
                        .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
                        .ok_or_else(|| bad(format!("cluster node `{node}` is not host:port")))?;
                    seeds.push(deadpool_redis::ConnectionInfo {
                        addr: deadpool_redis::ConnectionAddr::Tcp(host.to_string(), port),
                        redis: redis_info.clone(),
                    });
                }
                let cfg = deadpool_redis::cluster::Config {
                    urls: None,
                    connections: Some(seeds),
                    pool: Some(pc),
                    read_from_replicas: false,
                };
                Ok(Pool::Cluster(
                    cfg.create_pool(Some(deadpool_redis::Runtime::Tokio1))
                        .map_err(|e| bad(e.to_string()))?,
                ))
            }
        }
    }

    /// A connection from the pool (a new one when none is idle).
    ///
    /// # Errors
    /// Redis (or every Sentinel) unreachable, or the pool's wait timed out.
    pub async fn get(&self) -> Result<Conn> {
        match self {
            Pool::Direct(p) => Ok(Conn::Direct(p.get().await?)),
            Pool::Sentinel(p) => Ok(Conn::Sentinel(p.get().await?)),
            Pool::Cluster(p) => Ok(Conn::Cluster(p.get().await?)),
        }
    }

    /// Drops every idle connection, so the next calls connect anew (through the Sentinels:
    /// to the current master).
    pub fn drop_idle(&self) {
        // (How many were dropped is not needed: `RetainResult`s of different types.)
        match self {
            Pool::Direct(p) => drop(p.retain(|_, _| false)),
            Pool::Sentinel(p) => drop(p.retain(|_, _| false)),
            Pool::Cluster(p) => drop(p.retain(|_, _| false)),
        }
    }

    /// Drops the idle connections made before `t` (connections in use at a master switch
    /// come back to the pool afterwards: [`crate::Store`] calls this before taking one while a
    /// switch is recent).
    pub fn drop_older(&self, t: std::time::Instant) {
        match self {
            Pool::Direct(p) => drop(p.retain(|_, m| m.created > t)),
            Pool::Sentinel(p) => drop(p.retain(|_, m| m.created > t)),
            Pool::Cluster(p) => drop(p.retain(|_, m| m.created > t)),
        }
    }

    /// Whether this pool finds its master through Sentinel.
    pub fn is_sentinel(&self) -> bool {
        matches!(self, Pool::Sentinel(_))
    }
}

impl Conn {
    /// Takes the connection out of its pool for good: it is closed when dropped instead of
    /// being reused (a connection to a demoted master).
    pub fn discard(self) {
        match self {
            Conn::Direct(c) => drop(deadpool_redis::Connection::take(c)),
            Conn::Sentinel(c) => drop(deadpool_redis::sentinel::Connection::take(c)),
            Conn::Cluster(c) => drop(deadpool_redis::cluster::Connection::take(c)),
            Conn::Shared(_) => {}
        }
    }

    /// Takes the connection out of its pool to share it (see [`Shared`]).
    pub fn into_shared(self) -> Shared {
        match self {
            Conn::Direct(c) => Shared::Multiplexed(deadpool_redis::Connection::take(c)),
            Conn::Sentinel(c) => Shared::Multiplexed(deadpool_redis::sentinel::Connection::take(c)),
            Conn::Cluster(c) => Shared::Cluster(deadpool_redis::cluster::Connection::take(c)),
            Conn::Shared(s) => s,
        }
    }
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        match self {
            Conn::Direct(c) => c.req_packed_command(cmd),
            Conn::Sentinel(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
            Conn::Shared(Shared::Multiplexed(c)) => c.req_packed_command(cmd),
            Conn::Shared(Shared::Cluster(c)) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        match self {
            Conn::Direct(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Sentinel(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Shared(Shared::Multiplexed(c)) => c.req_packed_commands(cmd, offset, count),
            Conn::Shared(Shared::Cluster(c)) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Direct(c) => c.get_db(),
            Conn::Sentinel(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
            Conn::Shared(Shared::Multiplexed(c)) => c.get_db(),
            Conn::Shared(Shared::Cluster(c)) => c.get_db(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sentinel_form() {
        assert_eq!(
            Target::parse("redis://127.0.0.1:6379").unwrap(),
            Target::Direct("redis://127.0.0.1:6379".into())
        );
        assert_eq!(
            Target::parse("redis+sentinel://:s%40cret@127.0.0.1:26379, 127.0.0.1:26380/fleet/2")
                .unwrap(),
            Target::Sentinel {
                sentinels: vec!["127.0.0.1:26379".into(), "127.0.0.1:26380".into()],
                master: "fleet".into(),
                username: None,
                password: Some("s@cret".into()),
                db: 2
            }
        );
        assert_eq!(
            Target::parse("REDIS+SENTINEL://h:1/m").unwrap(),
            Target::Sentinel {
                sentinels: vec!["h:1".into()],
                master: "m".into(),
                username: None,
                password: None,
                db: 0
            }
        );
        for bad in [
            "redis+sentinel://u:hunter2@h:1",
            "redis+sentinel://u:hunter2@h/m",
            "redis+sentinel://u:hunter2@h:1,,h:2/m",
            "redis+sentinel://u:hunter2@h:1/m/x",
        ] {
            let e = Target::parse(bad).unwrap_err();
            assert!(!e.contains("hunter2"), "{e}");
        }
    }

    #[test]
    fn the_cluster_form() {
        assert_eq!(
            Target::parse("redis+cluster://:s%40cret@127.0.0.1:7000, 127.0.0.1:7001").unwrap(),
            Target::Cluster {
                nodes: vec!["127.0.0.1:7000".into(), "127.0.0.1:7001".into()],
                username: None,
                password: Some("s@cret".into())
            }
        );
        assert_eq!(
            Target::parse("REDIS+CLUSTER://u:p@h:1/").unwrap(),
            Target::Cluster {
                nodes: vec!["h:1".into()],
                username: Some("u".into()),
                password: Some("p".into())
            }
        );
        for bad in [
            "redis+cluster://u:hunter2@h",
            "redis+cluster://u:hunter2@h:1/2",
            "redis+cluster://u:hunter2@h:1,,h:2",
            "redis+cluster://u:hunter2@",
        ] {
            let e = Target::parse(bad).unwrap_err();
            assert!(!e.contains("hunter2"), "{e}");
        }
    }

    #[test]
    fn from_the_two_settings() {
        assert_eq!(
            Target::from_settings("a:1, b:2", "m", "redis://:pw@127.0.0.1:6379/3"),
            "redis+sentinel://:pw@a:1,b:2/m/3"
        );
        assert_eq!(
            Target::from_settings("a:1", "m", "redis://127.0.0.1:6379"),
            "redis+sentinel://a:1/m"
        );
    }
}

/// What a Sentinel announced about a master, as [`watch_switches`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Announcement {
    /// `+failover-state-send-slaveof-noone`: the replica is being promoted — from now on a
    /// write to the old master may be thrown away by its resync with the new one.
    Promoting,
    /// `+switch-master`: the new master's `ip:port`; Sentinels now name it.
    Switched(String),
}

/// The channels [`watch_switches`] subscribes to.
pub const CHANNELS: [&str; 2] = ["+failover-state-send-slaveof-noone", "+switch-master"];

/// Reads an announcement about `master` from a Sentinel event: `+switch-master` has the payload
/// `<master> <old ip> <old port> <new ip> <new port>`; an instance event
/// (`+failover-state-send-slaveof-noone`) `<type> <name> <ip> <port> @ <master> <ip> <port>`
/// (the formats of Sentinel's `sentinelEvent`, redis `src/sentinel.c`).
pub fn announcement(channel: &str, payload: &str, master: &str) -> Option<Announcement> {
    let w: Vec<&str> = payload.split_whitespace().collect();
    match channel {
        "+switch-master" if w.len() == 5 && w[0] == master => {
            Some(Announcement::Switched(format!("{}:{}", w[3], w[4])))
        }
        "+failover-state-send-slaveof-noone" if w.len() == 8 && w[4] == "@" && w[5] == master => {
            Some(Announcement::Promoting)
        }
        _ => None,
    }
}

/// Listens to [`CHANNELS`] on one Sentinel (`host:port`) and calls `on(announcement)` for each
/// about `master`, until `alive()` turns false (checked at least every second; the caller's
/// store is gone). A lost or refused Sentinel connection is tried again every second; every
/// Sentinel of the set is watched by its own loop, so one Sentinel down loses no announcement
/// (each Sentinel publishes it).
///
/// # Cancel safety
/// Cancel safe: it holds nothing but its subscription.
pub async fn watch_switches(
    sentinel: String,
    master: String,
    alive: impl Fn() -> bool,
    on: impl Fn(Announcement),
) {
    use futures::StreamExt;
    const CHECK: std::time::Duration = std::time::Duration::from_secs(1);
    while alive() {
        let sub = async {
            let client = redis::Client::open(format!("redis://{sentinel}"))?;
            let mut ps = client.get_async_pubsub().await?;
            ps.subscribe(&CHANNELS[..]).await?;
            Ok::<_, redis::RedisError>(ps)
        };
        match tokio::time::timeout(crate::redis::CALL_TIMEOUT, sub).await {
            Ok(Ok(mut ps)) => {
                tracing::debug!(%sentinel, "watching Sentinel for master switches");
                let mut msgs = ps.on_message();
                loop {
                    match tokio::time::timeout(CHECK, msgs.next()).await {
                        Err(_) if alive() => continue,
                        Err(_) => return,
                        Ok(None) => break,
                        Ok(Some(m)) => {
                            let payload: String = m.get_payload().unwrap_or_default();
                            if let Some(a) = announcement(m.get_channel_name(), &payload, &master) {
                                on(a);
                            }
                        }
                    }
                }
            }
            Ok(Err(e)) => tracing::debug!(%sentinel, error = %e, "cannot subscribe to Sentinel"),
            Err(_) => tracing::debug!(%sentinel, "subscribing to Sentinel timed out"),
        }
        tokio::time::sleep(CHECK).await;
    }
}

#[cfg(test)]
mod switch_tests {
    use super::{announcement, Announcement};

    #[test]
    fn reads_the_announcements_about_its_own_master_only() {
        assert_eq!(
            announcement("+switch-master", "m 127.0.0.1 6380 127.0.0.1 6381", "m"),
            Some(Announcement::Switched("127.0.0.1:6381".into()))
        );
        assert_eq!(
            announcement(
                "+failover-state-send-slaveof-noone",
                "slave 127.0.0.1:6381 127.0.0.1 6381 @ m 127.0.0.1 6380",
                "m"
            ),
            Some(Announcement::Promoting)
        );
        assert_eq!(
            announcement("+switch-master", "other 1.1.1.1 1 2.2.2.2 2", "m"),
            None
        );
        assert_eq!(announcement("+switch-master", "m 1.1.1.1 1", "m"), None);
        assert_eq!(
            announcement(
                "+failover-state-send-slaveof-noone",
                "slave a 1.1.1.1 1 @ other 2.2.2.2 2",
                "m"
            ),
            None
        );
    }
}
