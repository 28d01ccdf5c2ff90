//! The worker's link to RabbitMQ: one connection, re-established on loss (with the topology
//! declared again), and one publishing channel in confirm mode shared by every task attempt
//! (retries and dead letters). Each lane consumes on a channel of its own (see [`crate::lane`]).
//!
//! Only the lanes wait for a reconnect; a publish never does: with the connection down it
//! fails at once, the attempt's outcome is `failed` and the task goes back to the broker
//! (its delivery cannot be acked on a dead connection anyway).

use std::sync::Arc;
use std::time::Duration;

use fleet::broker::amqp::Publisher;
use lapin::types::ShortString;
use lapin::{BasicProperties, Connection};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use fleet::settings::CommonConfig;

/// Longest wait for a publish's confirm ([`Broker::publish`]): far above a confirm's normal
/// milliseconds (a quorum queue commits in its Raft log first) and a leader election's few
/// seconds, and well inside the default 30 s drain grace, so a run whose outcome cannot be
/// published still ends — requeued, its attempt spent — before its worker's stop gives up.
pub const CONFIRM_WAIT: Duration = Duration::from_secs(10);
use fleet::http::Readiness;

/// The connection and the publishing channel.
pub struct Broker {
    cfg: CommonConfig,
    group: String,
    worker_id: String,
    name: String,
    readiness: Readiness,
    /// Stops reconnecting (hard stop, end of the worker).
    stop: CancellationToken,
    /// Held across a reconnect on purpose: it serialises reconnects, so two lanes noticing
    /// the same loss connect once.
    reconnect: Mutex<()>,
    /// The latest connection, read without waiting (never held across an await).
    conn: std::sync::Mutex<Option<Arc<Connection>>>,
    publisher: Mutex<Option<Publisher>>,
    /// A connection error no retry can fix (login refused, queue arguments that differ).
    permanent: std::sync::Mutex<Option<fleet::Error>>,
    /// When the group's queues were last declared (this process's clock, ms since the epoch,
    /// taken before the declaration; 0: never). A registration carries it: a group reclaimed
    /// after it has had its queues deleted (see `registry/register.lua` in the library).
    declared_at_ms: std::sync::atomic::AtomicI64,
    /// How many lane sessions have started consuming (any lane). A lane pausing after a lost
    /// channel watches it: once another lane consumes again the broker is back, and the pause
    /// ends at once instead of running out its own backoff (issue 37 item 5: the critical lane
    /// used to come back up to 10 s after the normal one).
    consuming: tokio::sync::watch::Sender<u64>,
}

impl Broker {
    pub fn new(
        cfg: CommonConfig,
        group: String,
        worker_id: &str,
        readiness: Readiness,
        stop: CancellationToken,
    ) -> Self {
        Broker {
            cfg,
            group,
            worker_id: worker_id.to_string(),
            name: format!("fleet-worker {worker_id}"),
            readiness,
            stop,
            reconnect: Mutex::new(()),
            conn: std::sync::Mutex::new(None),
            publisher: Mutex::new(None),
            permanent: std::sync::Mutex::new(None),
            declared_at_ms: std::sync::atomic::AtomicI64::new(0),
            consuming: tokio::sync::watch::Sender::new(0),
        }
    }

    /// Tells the lanes pausing after a loss that a lane consumes again (see `consuming`).
    pub fn lane_consuming(&self) {
        self.consuming.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// A receiver that changes each time a lane starts consuming ([`Broker::lane_consuming`]).
    pub fn consuming_watch(&self) -> tokio::sync::watch::Receiver<u64> {
        self.consuming.subscribe()
    }

    /// A live connection: the current one, or a new one with the topology declared. Retries
    /// with backoff until it works; `None` once the broker is stopped.
    ///
    /// # Cancel safety
    /// Cancel safe: dropped mid-reconnect, the connection being made is dropped with it
    /// (never stored), readiness stays "AMQP down" and the reconnect lock is released; the
    /// next call starts over.
    pub async fn connection(&self) -> Option<Arc<Connection>> {
        let _one_at_a_time = self.reconnect.lock().await;
        let last = self.latest();
        if let Some(c) = last {
            if c.status().connected() {
                return Some(c);
            }
            tracing::warn!("connection to RabbitMQ lost; reconnecting");
            metrics::counter!(fleet::metrics::AMQP_RECONNECTS).increment(1);
        }
        self.readiness.set_amqp(false);
        use backon::Retryable;
        let attempt = || async {
            let Some(c) = fleet::broker::amqp::connect_retrying(
                &self.cfg.amqp_url,
                &self.name,
                &self.cfg.amqp_tls,
                &self.stop,
            )
            .await?
            else {
                return Ok(None);
            };
            match self.declare(&c).await {
                Ok(()) => Ok(Some(c)),
                Err(e) => {
                    let _ = c.close(200, ShortString::from("declare failed")).await;
                    Err(e)
                }
            }
        };
        let connected = attempt
            .retry(fleet::broker::amqp::reconnect_backoff())
            .sleep(tokio::time::sleep)
            .when(|e: &fleet::Error| !matches!(e, fleet::Error::Permanent { .. }) && !self.stop.is_cancelled())
            .notify(|e, wait| tracing::warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "cannot declare the topology; retrying"))
            .await;
        let conn = match connected {
            Ok(Some(c)) => c,
            Ok(None) => return None,
            Err(e) => {
                // No retry can fix it: the worker stops and reports it once (see
                // `take_permanent`).
                if let Ok(mut slot) = self.permanent.lock() {
                    *slot = Some(e);
                }
                self.stop.cancel();
                return None;
            }
        };
        if self.stop.is_cancelled() {
            let _ = conn.close(200, ShortString::from("stopping")).await;
            return None;
        }
        tracing::info!(group = %self.group, "connected to RabbitMQ, topology declared");
        self.readiness.set_amqp(true);
        let conn = Arc::new(conn);
        if let Ok(mut slot) = self.conn.lock() {
            *slot = Some(conn.clone());
        }
        Some(conn)
    }

    async fn declare(&self, conn: &Connection) -> fleet::Result<()> {
        let started = fleet::redis::now_ms();
        fleet::broker::topology::probe_leader_locator(conn, &self.cfg).await?;
        let ch = conn.create_channel().await?;
        fleet::broker::topology::declare_core(&ch, &self.cfg).await?;
        fleet::broker::topology::declare_group(&ch, &self.cfg, &self.group).await?;
        let _ = ch.close(200, ShortString::from("declared")).await;
        self.declared_at_ms
            .store(started, std::sync::atomic::Ordering::Relaxed);
        // Hold the id's lock on every connection (a no-op failure when another process took
        // the id over meanwhile: its registration then answers our heartbeat with `conflict`).
        self.lock_on(conn).await;
        Ok(())
    }

    /// The permanent error that stopped [`Broker::connection`], if one did.
    pub fn take_permanent(&self) -> Option<fleet::Error> {
        self.permanent.lock().ok()?.take()
    }

    /// Declares this worker id's exclusive lock queue on the current connection (see
    /// `Names::worker_lock_queue`). True when this process holds it — any earlier process
    /// with this id is gone, its registration may be taken over at once; false when a live
    /// connection of another process holds it (`RESOURCE_LOCKED`) or the broker is away.
    pub async fn lock_id(&self) -> bool {
        match self.current() {
            Some(c) => self.lock_on(&c).await,
            None => false,
        }
    }

    async fn lock_on(&self, conn: &Connection) -> bool {
        use lapin::options::QueueDeclareOptions;
        let Ok(ch) = conn.create_channel().await else {
            return false;
        };
        let q = self.cfg.names().worker_lock_queue(&self.worker_id);
        let opts = QueueDeclareOptions {
            exclusive: true,
            auto_delete: true,
            ..Default::default()
        };
        match ch
            .queue_declare(
                ShortString::from(q.as_str()),
                opts,
                lapin::types::FieldTable::default(),
            )
            .await
        {
            Ok(_) => {
                let _ = ch.close(200, ShortString::from("locked")).await;
                true
            }
            Err(e) => {
                tracing::debug!(error = %e, "worker id lock held by another connection");
                false
            }
        }
    }

    fn latest(&self) -> Option<Arc<Connection>> {
        self.conn.lock().ok()?.clone()
    }

    /// The current connection if it is up; never waits for a reconnect.
    fn current(&self) -> Option<Arc<Connection>> {
        self.latest().filter(|c| c.status().connected())
    }

    /// The publishing channel (confirm mode), opened again if it died.
    async fn publisher(&self) -> fleet::Result<Publisher> {
        let mut slot = self.publisher.lock().await;
        if let Some(ch) = slot.as_ref() {
            if ch.status().connected() {
                return Ok(ch.clone());
            }
        }
        let conn = self.current().ok_or(fleet::Error::NotConnected)?;
        let ch = fleet::broker::amqp::confirm_channel(&conn).await?;
        *slot = Some(ch.clone());
        Ok(ch)
    }

    /// Publishes (mandatory, persistent per `props`) and waits for the broker's confirm, at
    /// most [`CONFIRM_WAIT`].
    ///
    /// # Errors
    /// The publish refused (nack, unroutable), the channel lost, or no confirm within
    /// [`CONFIRM_WAIT`] ([`fleet::Error::Timeout`]): a broker that blocks publishing (a memory or disk alarm) or
    /// a channel whose connection died without failing its pending confirms would otherwise
    /// hold the attempt — its delivery, its lane slot and its `running` count — forever.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        props: BasicProperties,
    ) -> fleet::Result<()> {
        let publish = async {
            let ch = self.publisher().await?;
            fleet::broker::amqp::publish_confirmed(&ch, exchange, routing_key, body, props).await
        };
        match tokio::time::timeout(CONFIRM_WAIT, publish).await {
            Ok(r) => r,
            Err(_) => Err(fleet::Error::Timeout {
                what: "RabbitMQ's confirm of a publish".into(),
                after: CONFIRM_WAIT,
            }),
        }
    }

    /// Closes the connection: the broker requeues every unacknowledged delivery. No reconnect
    /// follows (stop the broker first).
    pub async fn close(&self, reason: &str) {
        self.stop.cancel();
        let conn = self.conn.lock().ok().and_then(|mut c| c.take());
        self.readiness.set_amqp(false);
        if let Some(c) = conn {
            if c.status().connected() {
                // Bounded: a broker that does not answer (paused, partitioned) must not keep
                // the worker from exiting; the socket closes with the process.
                match tokio::time::timeout(
                    crate::drain::STEP_LIMIT,
                    c.close(200, ShortString::from(reason)),
                )
                .await
                {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::debug!(error = %e, "closing the AMQP connection"),
                    Err(_) => tracing::warn!(
                        limit_ms = crate::drain::STEP_LIMIT.as_millis() as u64,
                        "RabbitMQ did not answer the connection close; going on without it"
                    ),
                }
            }
        }
    }

    /// Declares the topology again on the current connection (after a consumer found its
    /// queue missing, e.g. deleted by an operator).
    /// When the group's queues were last declared: this process's clock, ms since the epoch,
    /// taken before the declaration (0: never).
    pub fn declared_at_ms(&self) -> i64 {
        self.declared_at_ms
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    pub async fn redeclare(&self) -> fleet::Result<()> {
        let conn = self.current().ok_or(fleet::Error::NotConnected)?;
        self.declare(&conn).await
    }
}
