//! RabbitMQ plumbing: connecting with retry, confirmed publishing, message properties.

use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use lapin::{Confirmation, PublisherConfirm};
use tokio_util::sync::CancellationToken;

use crate::error::{Error, Result};
use crate::tls::TlsConfig;

// The header names moved to `crate::task::headers` (one place for every `x-fleet-*` name); these
// aliases keep `fleet::broker::amqp::*_HEADER` working for code written against the old path.
pub use crate::task::headers::{
    ATTEMPTS as ATTEMPTS_HEADER, DETAIL as DETAIL_HEADER, PROBE as PROBE_HEADER,
    REASON as REASON_HEADER, REPLAY as REPLAY_HEADER, SUBMITTED_AT as SUBMITTED_AT_HEADER,
    TIER as TIER_HEADER, WORKER as WORKER_HEADER,
};

/// Connects once, trusting the system roots for `amqps://`.
pub async fn connect(url: &str, name: &str) -> Result<Connection> {
    connect_with(url, name, &TlsConfig::default()).await
}

/// How long one connection attempt may take, TCP connect, TLS and the AMQP handshake
/// (`Connection.Start` to `Connection.Open-Ok`) together: what RabbitMQ itself allows a client
/// after TCP (`ssl_handshake_timeout` 5 s + `handshake_timeout` 10 s). lapin bounds none of
/// it, so a node that accepts the socket but never answers — a frozen (SIGSTOP) or wedged node,
/// a proxy with no backend — would hold the attempt, and with it every reconnect loop, forever.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

/// Connects once; an `amqps://` URL uses `tls` (extra CA, client certificate) and verifies the
/// server's name against the URL's host. A failed TLS handshake is an `Amqp` error whose text
/// says why (for example `invalid peer certificate: UnknownIssuer` for a wrong CA).
///
/// # Errors
/// [`Error::Timeout`] (transient: retried by [`connect_retrying`]) when the attempt takes longer
/// than [`CONNECT_TIMEOUT`]. The abandoned attempt's socket and lapin I/O thread stay until
/// the peer closes the socket or the TCP connection fails: at once for a node that comes back
/// (it finishes the handshake, then closes), after the node's own handshake timeout for a
/// slow RabbitMQ, and never for a peer that holds the socket open in silence — one thread and
/// one socket per attempt then, about one per 15-20 s per reconnecting process (a frozen node
/// stops accepting once its listen backlog is full, which ends the growth).
pub async fn connect_with(url: &str, name: &str, tls: &TlsConfig) -> Result<Connection> {
    let props = ConnectionProperties::default().with_connection_name(name.into());
    let attempt = async {
        if tls.is_default() {
            Connection::connect(url, props).await
        } else {
            match lapin::runtime::default_runtime() {
                Ok(rt) => Connection::connect_with_config(url, props, tls.to_lapin(), rt).await,
                Err(e) => Err(e),
            }
        }
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, attempt).await {
        Ok(conn) => conn.map_err(|e| classify(e, "FLEET_AMQP_URL", url)),
        Err(_) => Err(Error::Timeout {
            what: format!(
                "RabbitMQ at {} (TCP, TLS and the AMQP handshake)",
                crate::process::redact(url)
            ),
            after: CONNECT_TIMEOUT,
        }),
    }
}

/// Backoff of every connection retry: exponential from 100 ms, capped at 5 s, with jitter
/// (so a fleet restarted together does not reconnect in lock-step), never giving up.
pub fn reconnect_backoff() -> backon::ExponentialBuilder {
    backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(100))
        .with_max_delay(Duration::from_secs(5))
        .with_jitter()
        .without_max_times()
}

/// Connects (with `tls` for `amqps://`, see [`connect_with`]), retrying transient failures
/// (refused, reset, timed out, a failed TLS handshake) with [`reconnect_backoff`] until it
/// works or `shutdown` fires (then `Ok(None)`). `url` may list several cluster nodes: each
/// attempt is one pass over them from a random node ([`crate::broker::connect_any`], which
/// logs each node's failure and the node it is on); the backoff runs between failed passes.
/// One warning per failed pass, naming `FLEET_AMQP_URL` with the password hidden. A permanent
/// failure (login refused, unknown vhost) is returned at once as [`Error::Permanent`]. Cancel
/// safe.
pub async fn connect_retrying(
    url: &str,
    name: &str,
    tls: &TlsConfig,
    shutdown: &CancellationToken,
) -> Result<Option<Connection>> {
    use backon::Retryable;
    let shown = crate::process::redact(url).into_owned();
    let attempt = (|| crate::broker::connect_any(url, name, tls))
        .retry(reconnect_backoff())
        .sleep(tokio::time::sleep)
        .when(|e| !matches!(e, Error::Permanent { .. }))
        .notify(|e, wait| {
            tracing::warn!(setting = "FLEET_AMQP_URL", url = %shown, error = %e, retry_in_ms = wait.as_millis() as u64, "cannot connect to RabbitMQ; retrying");
        });
    tokio::select! {
        _ = shutdown.cancelled() => Ok(None),
        r = attempt => r.map(Some),
    }
}

/// An AMQP error as a fleet error: the ones no retry can fix become [`Error::Permanent`]
/// naming `setting` (the login refused: 403 ACCESS_REFUSED; an unknown vhost or a missing
/// permission: 530 NOT_ALLOWED; 406 PRECONDITION_FAILED), the rest stay [`Error::Amqp`].
pub fn classify(e: lapin::Error, setting: &str, url: &str) -> Error {
    let lapin::ErrorKind::ProtocolError(amqp) = e.kind() else {
        return Error::Amqp(e);
    };
    let url = crate::process::redact(url);
    let text = amqp.get_message().to_string();
    let message = match amqp.get_id() {
        403 => format!("RabbitMQ refused the login at {url} ({text}): check the user name and password"),
        530 => format!("RabbitMQ does not allow this connection to {url} ({text}): check that the vhost exists and the user has permissions on it"),
        406 => text.to_string(),
        _ => return Error::Amqp(e),
    };
    Error::Permanent {
        setting: setting.to_string(),
        message,
    }
}

/// The reply code of a broker's refusal that closed a channel or connection (404 NOT_FOUND,
/// 406 PRECONDITION_FAILED, 540 NOT_IMPLEMENTED, ... — AMQP 0-9-1 §1.2), `None` for any other
/// error (I/O, a channel already closed).
pub fn reply_code(e: &lapin::Error) -> Option<u16> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(a) => Some(a.get_id()),
        _ => None,
    }
}

/// The argument a broker's 406 PRECONDITION_FAILED names when a queue exists with other
/// arguments (`inequivalent arg 'x-max-length' for queue …`): `Some("x-max-length")`; `None`
/// for any other error. The one place that reads the refusal's text (its code says only
/// "precondition failed").
pub fn inequivalent_arg(e: &lapin::Error) -> Option<&str> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(a) if a.get_id() == 406 => {
            inequivalent_arg_in(a.get_message().as_str())
        }
        _ => None,
    }
}

/// [`inequivalent_arg`] of a reply text.
fn inequivalent_arg_in(text: &str) -> Option<&str> {
    let rest = text.split_once("inequivalent arg '")?.1;
    rest.split_once('\'').map(|(arg, _)| arg)
}

/// A channel in confirm mode, for publishing from any number of tasks at once.
///
/// Publisher confirms (RabbitMQ's extension to AMQP 0-9-1) number a channel's messages in the
/// order the broker receives them, and lapin takes a publish's number (its delivery tag) and
/// queues its frames under two different locks: two tasks publishing on one channel from
/// different threads can interleave between the two, and a confirm — an ack, or the nack of a
/// full queue — is then handed to the other message (`tests/tests/e2e/publish_order.rs` saw 54 of
/// 5,400 so misnamed with 8 publishers). A `Publisher` holds an order lock from taking a
/// publish's tag until its frames are written ([`publish`], [`publish_batch`]), so tag order is
/// wire order; confirms are still awaited without it. It derefs to its [`Channel`] for
/// everything else (status, close). Cheap to clone (the clones share the lock).
#[derive(Clone)]
pub struct Publisher {
    channel: Channel,
    order: std::sync::Arc<tokio::sync::Mutex<()>>,
}

impl Publisher {
    /// The channel (which must be in confirm mode for confirms to mean anything).
    pub fn new(channel: Channel) -> Self {
        Publisher {
            channel,
            order: Default::default(),
        }
    }
}

impl std::ops::Deref for Publisher {
    type Target = Channel;
    fn deref(&self) -> &Channel {
        &self.channel
    }
}

/// A channel in confirm mode. Errors: the channel could not be opened or put in confirm mode.
pub async fn confirm_channel(conn: &Connection) -> Result<Publisher> {
    let ch = conn.create_channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default()).await?;
    Ok(Publisher::new(ch))
}

/// How long a spell of publishes nacked with their queue nowhere near full lasts before
/// [`Renewal`] opens a fresh publishing channel. Seen after the scheduler's node died: a
/// channel opened on a surviving node while a quorum queue's leader was being elected had every
/// publish nacked for minutes (150 s and counting in one CI run, 20 s in issue 37's runs), while
/// a connection opened before the kill published to the same queue unhindered — the stuck
/// state is the channel's, not the queue's.
pub const RENEW_AFTER: Duration = Duration::from_secs(2);

/// Replaces a publishing channel stuck nacking (issue 37 item 3): its user reports each
/// publish (or batch) to a target queue as taken ([`Renewal::taken`]) or nacked while that
/// queue was nowhere near its bound ([`Renewal::refused`]); once one target's refusals have
/// lasted [`RENEW_AFTER`] with none of its publishes taken, `refused` says so and
/// [`Renewal::renew`] opens the fresh channel the user then publishes on. Spells are kept per
/// target: a channel can be stuck for one queue (whose leader moved) while it publishes to
/// others, and their confirms must not hide it. A spell that goes on renews once per
/// [`RENEW_AFTER`], and each renewal closes the channel the previous one opened: one spare
/// channel at a time, not one per renewal. The channel the user started with is never closed
/// here (others may publish on it; it goes with its connection). Shared by the scheduler's API
/// (submissions) and its dispatcher.
#[derive(Debug, Default)]
pub struct Renewal {
    /// Since when every report for a target has been a refusal (no entry: its last publish
    /// was taken, or none was refused).
    since: std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>,
    /// The last channel [`Renewal::renew`] opened.
    opened: tokio::sync::Mutex<Option<Publisher>>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("channel", &self.channel.id())
            .finish()
    }
}

impl Renewal {
    /// A publish to `target` was taken: its spell of refusals (if any) ends.
    pub fn taken(&self, target: &str) {
        if let Ok(mut since) = self.since.lock() {
            since.remove(target);
        }
    }

    /// A publish to `target` was nacked with the queue nowhere near its bound. `true` when
    /// its refusals, none taken between, have lasted [`RENEW_AFTER`]: the caller renews its
    /// channel (the spell starts again from now).
    pub fn refused(&self, target: &str) -> bool {
        self.refused_at(target, std::time::Instant::now())
    }

    /// [`Renewal::refused`] at `now`.
    pub fn refused_at(&self, target: &str, now: std::time::Instant) -> bool {
        let Ok(mut since) = self.since.lock() else {
            return false;
        };
        match since.get_mut(target) {
            Some(t) if now.saturating_duration_since(*t) >= RENEW_AFTER => {
                *t = now;
                true
            }
            Some(_) => false,
            None => {
                since.insert(target.to_string(), now);
                false
            }
        }
    }

    /// A fresh confirm channel on `conn`, for the caller to publish on from now; the channel
    /// the previous renewal opened is closed. Counted in `fleet_publisher_renewals_total{user}`
    /// and logged.
    ///
    /// # Errors
    /// The channel cannot be opened (the caller keeps its old one).
    pub async fn renew(&self, conn: &Connection, user: &'static str) -> Result<Publisher> {
        let p = confirm_channel(conn).await?;
        tracing::warn!(
            user,
            after_s = RENEW_AFTER.as_secs(),
            "publishes to a queue far below any bound nacked for 2 s: publishing on a fresh channel"
        );
        metrics::counter!(crate::metrics::PUBLISHER_RENEWALS, "user" => user).increment(1);
        if let Some(old) = self.opened.lock().await.replace(p.clone()) {
            let _ = old.close(200, "renewed".into()).await;
        }
        Ok(p)
    }
}

/// A header's value as text (long or short string, or an integer).
pub fn header_text(props: &BasicProperties, name: &str) -> Option<String> {
    let h = props.headers().as_ref()?;
    match h.inner().get(name)? {
        AMQPValue::LongString(s) => Some(s.to_string()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        AMQPValue::LongLongInt(i) => Some(i.to_string()),
        AMQPValue::LongInt(i) => Some(i.to_string()),
        _ => None,
    }
}

/// Properties of a task message: JSON, persistent, id, publish time (AMQP `timestamp`, whole
/// seconds: a dead letter's age), optional headers.
pub fn task_properties(id: &str, headers: Option<FieldTable>) -> BasicProperties {
    let now = chrono::Utc::now().timestamp().max(0) as u64;
    let p = BasicProperties::default()
        .with_content_type("application/json".into())
        .with_delivery_mode(2)
        .with_message_id(id.into())
        .with_timestamp(now);
    match headers {
        Some(h) => p.with_headers(h),
        None => p,
    }
}

/// Builds a header table from string pairs.
pub fn headers<'a>(pairs: impl IntoIterator<Item = (&'a str, String)>) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in pairs {
        t.insert(k.into(), AMQPValue::LongString(v.into()));
    }
    t
}

/// Reads a string header.
pub fn header_str(props: &BasicProperties, key: &str) -> Option<String> {
    let h = props.headers().as_ref()?;
    match h.inner().get(key)? {
        AMQPValue::LongString(s) => Some(s.to_string()),
        AMQPValue::ShortString(s) => Some(s.to_string()),
        other => Some(format!("{other:?}")),
    }
}

/// Publishes a mandatory message: returns once its frames are written, with its confirm to
/// await later (pipelining). Ordered with every other publish on `p` (see [`Publisher`]).
pub async fn publish(
    p: &Publisher,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    props: BasicProperties,
) -> Result<PublisherConfirm> {
    let _order = p.order.lock().await;
    start_publish(&p.channel, exchange, routing_key, body, props).await
}

/// `basic.publish`, mandatory. Callers hold the publisher's order lock.
async fn start_publish(
    ch: &Channel,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    props: BasicProperties,
) -> Result<PublisherConfirm> {
    Ok(ch
        .basic_publish(
            ShortString::from(exchange),
            ShortString::from(routing_key),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            body,
            props,
        )
        .await?)
}

/// One message for [`publish_batch`].
pub struct Outgoing<'a> {
    /// The exchange to publish to.
    pub exchange: &'a str,
    /// Its routing key.
    pub routing_key: &'a str,
    /// The message body.
    pub body: &'a [u8],
    /// Its properties (id, headers, persistence).
    pub props: BasicProperties,
}

/// Starts a batch of mandatory publishes on one channel together; their confirms (to await
/// later), in input order.
///
/// lapin's `basic_publish` returns once the connection's I/O loop — a thread of its own —
/// has written the message's frames, so publishes awaited one by one cost a round trip to
/// that thread each (two thread wake-ups when both sides are idle, which on a busy machine is
/// more than the message itself costs). Started together, every message's frames are queued
/// before the loop runs and it writes them in one go. Publish order (and so delivery-tag and
/// confirm order) is the input order: each publish queues its frames on its first poll, and
/// `join_all` polls them first in order — and no other publish on `p` comes between them (see
/// [`Publisher`]).
pub async fn publish_batch<'a>(
    p: &Publisher,
    msgs: impl IntoIterator<Item = Outgoing<'a>>,
) -> Vec<Result<PublisherConfirm>> {
    let _order = p.order.lock().await;
    futures::future::join_all(
        msgs.into_iter()
            .map(|m| start_publish(&p.channel, m.exchange, m.routing_key, m.body, m.props)),
    )
    .await
}

/// Awaits a confirm: `Ok` only for an ack of a routed message.
pub async fn confirmed(confirm: PublisherConfirm) -> Result<()> {
    match confirm.await? {
        Confirmation::Ack(None) | Confirmation::NotRequested => Ok(()),
        Confirmation::Ack(Some(ret)) => {
            Err(Error::Refused(format!("unroutable: {}", ret.reply_text)))
        }
        Confirmation::Nack(_) => Err(Error::Refused(NACK_TEXT.into())),
    }
}

/// The text of a nacked publish ([`Error::Refused`]). A `basic.nack` carries no reason: a
/// bounded queue at its `x-max-length` (`reject-publish`) nacks, and so does a quorum queue
/// that cannot take the message now — its leader lost and a new one not yet elected, seen for
/// ~20 s after a node loss with every queue far below its bound (issue 37 item 3). Who must
/// tell the two apart asks the queue's depth: [`nack_cause`].
pub const NACK_TEXT: &str = "nack (the queue is full, or has no leader now)";

/// Whether `e` is a nacked publish ([`confirmed`]'s answer to a `basic.nack`).
pub fn is_nack(e: &Error) -> bool {
    matches!(e, Error::Refused(t) if t == NACK_TEXT)
}

/// Why the broker nacked a publish to a bounded queue, as its depth tells (see [`nack_cause`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NackCause {
    /// The queue holds (about) its bound: `reject-publish` refused it.
    Full {
        /// The queue's depth read after the nack (messages).
        depth: u32,
        /// Its bound (messages).
        bound: u32,
    },
    /// The queue is well below its bound: the broker could not take the message now (a
    /// quorum queue mid-election, a node going down); the same publish succeeds shortly.
    Unavailable {
        /// The queue's depth read after the nack (messages).
        depth: u32,
        /// Its bound (messages).
        bound: u32,
    },
    /// The depth could not be read (no answer within [`DEPTH_WAIT`], the queue missing):
    /// the broker is not answering, which is not a full queue either.
    Unknown,
}

impl NackCause {
    /// Reads a depth against its bound: full when within `max(1, bound / 10)` of it — the
    /// depth is read an instant after the nack, and the queue's consumers take a batch from a
    /// queue at its bound meanwhile. Pure: the table of [`nack_cause`].
    pub fn from_depth(depth: Option<u32>, bound: u32) -> Self {
        let Some(depth) = depth else {
            return NackCause::Unknown;
        };
        let margin = (bound / 10).max(1);
        if depth.saturating_add(margin) >= bound {
            NackCause::Full { depth, bound }
        } else {
            NackCause::Unavailable { depth, bound }
        }
    }

    /// The queue was at its bound ([`NackCause::Full`]).
    pub fn is_full(self) -> bool {
        matches!(self, NackCause::Full { .. })
    }
}

/// How long [`nack_cause`] waits for the queue's depth.
pub const DEPTH_WAIT: Duration = Duration::from_secs(1);

/// Why a publish to `queue` (bounded at `bound` messages) was nacked: its depth now (a passive
/// declare through `probe`, awaited at most [`DEPTH_WAIT`]) against the bound
/// ([`NackCause::from_depth`]). The question runs in a task of its own, bounded by the
/// prober's limits: one that outlasts the wait — the prober's first connect, say — still
/// finishes, and its connection serves the next nack.
///
/// # Cancel safety
/// Cancel safe: it only reads.
pub async fn nack_cause(
    probe: &std::sync::Arc<crate::broker::probe::Prober>,
    queue: &str,
    bound: u32,
) -> NackCause {
    let (probe, q) = (probe.clone(), queue.to_string());
    let asked = tokio::spawn(async move { probe.queue(&q).await });
    let depth = tokio::time::timeout(DEPTH_WAIT, asked)
        .await
        .ok()
        .and_then(|joined| joined.ok())
        .and_then(|r| r.ok())
        .flatten()
        .map(|q| q.ready);
    NackCause::from_depth(depth, bound)
}

/// Publishes and waits for the confirm.
pub async fn publish_confirmed(
    ch: &Publisher,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    props: BasicProperties,
) -> Result<()> {
    confirmed(publish(ch, exchange, routing_key, body, props).await?).await
}

#[cfg(test)]
mod tests {
    use super::NackCause;

    #[test]
    fn a_target_refused_for_renew_after_with_none_taken_renews() {
        use super::{Renewal, RENEW_AFTER};
        use std::time::{Duration, Instant};
        let r = Renewal::default();
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        // A spell starts, and renews once it has lasted RENEW_AFTER; then it starts again.
        assert!(!r.refused_at("q1", at(0)));
        assert!(!r.refused_at("q1", at(1_999)));
        assert!(r.refused_at("q1", at(2_000)));
        assert!(!r.refused_at("q1", at(3_000)));
        assert!(r.refused_at("q1", at(4_000)));
        // Another target's confirms do not end q1's spell; q1's own do.
        r.taken("q2");
        assert!(r.refused_at("q1", at(6_000)));
        r.taken("q1");
        assert!(!r.refused_at("q1", at(6_000) + RENEW_AFTER));
        // Spells are per target.
        assert!(!r.refused_at("q2", at(10_000)));
        assert!(r.refused_at("q1", at(10_000)));
    }

    #[test]
    fn the_inequivalent_argument_is_read_from_the_refusal() {
        let text = "PRECONDITION_FAILED - inequivalent arg 'x-queue-leader-locator' for queue \
                    'ns.g.normal' in vhost '/': received the value 'balanced' of type \
                    'longstr' but current is none";
        assert_eq!(
            super::inequivalent_arg_in(text),
            Some("x-queue-leader-locator")
        );
        assert_eq!(
            super::inequivalent_arg_in("PRECONDITION_FAILED - unknown delivery tag 1"),
            None
        );
    }

    #[test]
    fn a_nack_is_a_full_queue_only_near_its_bound() {
        use NackCause::*;
        let cases = [
            (
                Some(10_000),
                10_000,
                Full {
                    depth: 10_000,
                    bound: 10_000,
                },
            ),
            (
                Some(9_000),
                10_000,
                Full {
                    depth: 9_000,
                    bound: 10_000,
                },
            ),
            (
                Some(8_999),
                10_000,
                Unavailable {
                    depth: 8_999,
                    bound: 10_000,
                },
            ),
            // The case: 300 held against 10,000 while every publish was nacked.
            (
                Some(300),
                10_000,
                Unavailable {
                    depth: 300,
                    bound: 10_000,
                },
            ),
            (Some(5), 5, Full { depth: 5, bound: 5 }),
            (Some(4), 5, Full { depth: 4, bound: 5 }),
            (Some(3), 5, Unavailable { depth: 3, bound: 5 }),
            (None, 10_000, Unknown),
        ];
        for (depth, bound, want) in cases {
            assert_eq!(
                NackCause::from_depth(depth, bound),
                want,
                "{depth:?} of {bound}"
            );
        }
    }
}
