//! A producer of tasks: the two faces of backpressure for code that submits work.
//!
//! * [`Producer::submit`] is for a producer with a user waiting: each task is published to
//!   `<ns>.submit` (routing key = lane, persistent) with publisher confirms, and comes back
//!   [`Submitted::Accepted`] (the broker holds it) or [`Submitted::Refused`] with the reason
//!   (a nack: the bounded ingress queue is full; or the publish failed). The caller decides.
//! * [`Producer::submit_paced`] is for an internal batch loader that should instead slow down
//!   to the fleet's pace: refused tasks are offered again after a backoff with jitter until
//!   every one is accepted or the deadline passes, and nothing is ever dropped silently — the
//!   report lists what is still refused at the deadline.
//!
//! The pacing is exponential backoff with full jitter (AWS Architecture Blog, "Exponential
//! Backoff And Jitter", 2015), from `backon`: a refusal means the ingress queue is at its
//! bound, which drains at the rate workers finish, so retrying at once would only be refused
//! again; jitter keeps many paced producers from retrying in lockstep. The delay starts again
//! from its minimum whenever a round gets tasks accepted (the fleet has room again). AMQP
//! carries no `Retry-After`; a round that makes progress is the signal instead.

use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use lapin::types::ShortString;
use lapin::Connection;
use tokio::time::Instant;

use crate::broker::amqp;
use crate::error::{Error, Result};
use crate::names::Names;
use crate::task::Envelope;

/// Publishes in flight at once, at most (one confirm round trip per window).
pub const CONFIRM_WINDOW: usize = 1000;

/// What became of one submitted task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Submitted {
    /// The broker confirmed it: the task is in the ingress queue and will run.
    Accepted,
    /// The broker refused it (or it could not be published); it was not taken. The text says
    /// why (e.g. `nack (queue full)`).
    Refused(String),
}

/// Progress of a paced submission, reported after each round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Progress {
    /// Tasks accepted so far.
    pub accepted: usize,
    /// Tasks in the submission.
    pub total: usize,
    /// Rounds of publishing so far (1 = no task was ever refused).
    pub rounds: u32,
}

/// The end of a paced submission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PacedReport {
    /// Ids accepted, in the order they were accepted.
    pub accepted: Vec<String>,
    /// Tasks still refused when the deadline passed (empty when every one was accepted),
    /// with the last refusal's reason.
    pub refused: Vec<(String, String)>,
    /// Publishing rounds made.
    pub rounds: u32,
}

/// Pacing of [`Producer::submit_paced`]: delays between rounds grow from `min_delay` by ×2 up
/// to `max_delay`, each drawn with full jitter.
#[derive(Debug, Clone, Copy)]
pub struct Pacing {
    /// Ceiling of the first delay between rounds (each delay is drawn below its ceiling).
    pub min_delay: Duration,
    /// Largest ceiling: the doubling stops here.
    pub max_delay: Duration,
}

impl Default for Pacing {
    /// 50 ms to 2 s: a full ingress queue frees room as fast as workers finish, often within
    /// milliseconds; two seconds bounds how late a paced producer notices room.
    fn default() -> Self {
        Pacing {
            min_delay: Duration::from_millis(50),
            max_delay: Duration::from_secs(2),
        }
    }
}

/// Publishes envelopes to a namespace's submit exchange (`exchange`, routing key = lane), all
/// together ([`amqp::publish_batch`]); their confirms to await, in order.
pub async fn publish_envelopes(
    p: &amqp::Publisher,
    exchange: &str,
    envs: &[Envelope],
) -> Vec<Result<lapin::PublisherConfirm>> {
    let bodies: Vec<Vec<u8>> = envs.iter().map(Envelope::to_bytes).collect();
    let msgs = envs.iter().zip(&bodies).map(|(env, body)| amqp::Outgoing {
        exchange,
        routing_key: env.lane.as_str(),
        body,
        props: amqp::task_properties(&env.id, None),
    });
    amqp::publish_batch(p, msgs).await
}

/// A connection to RabbitMQ with a confirm channel, publishing to one namespace.
pub struct Producer {
    conn: Connection,
    ch: amqp::Publisher,
    names: Names,
}

impl Producer {
    /// Connects to `amqp_url` (one URL, or a cluster's node list tried from a random node: see
    /// [`crate::broker`]) without client TLS settings (an `amqps://` URL then trusts the
    /// system roots only) and opens a confirm channel: [`Producer::connect_with`] with
    /// [`TlsConfig::default`](crate::tls::TlsConfig). Errors: the connection or channel failed
    /// ([`Error::Amqp`]), no node answered within [`amqp::CONNECT_TIMEOUT`] ([`Error::Timeout`]),
    /// the login or vhost was refused ([`Error::Permanent`]).
    pub async fn connect(amqp_url: &str, names: Names, connection_name: &str) -> Result<Self> {
        Self::connect_with(
            amqp_url,
            names,
            connection_name,
            &crate::tls::TlsConfig::default(),
        )
        .await
    }

    /// [`Producer::connect`] with TLS client settings for `amqps://` (`FLEET_AMQP_TLS_*`: a
    /// private CA, a client certificate for mutual TLS). Errors: the connection (including the
    /// TLS handshake) or the channel failed ([`Error::Amqp`]); as [`Producer::connect`] for
    /// a silent node or a refused login.
    pub async fn connect_with(
        amqp_url: &str,
        names: Names,
        connection_name: &str,
        tls: &crate::tls::TlsConfig,
    ) -> Result<Self> {
        let conn = crate::broker::connect_any(amqp_url, connection_name, tls).await?;
        let ch = amqp::confirm_channel(&conn).await?;
        Ok(Producer { conn, ch, names })
    }

    /// Publishes every task and awaits its confirm, [`CONFIRM_WINDOW`] at a time; the answer
    /// has one entry per task, in order. Errors only when the channel is lost (then nothing
    /// can be said about the window in flight: treat it as refused and submit it again — ids
    /// make that idempotent); [`Error::Permanent`] naming FLEET_NAMESPACE when no scheduler has
    /// declared the namespace (the broker has no `<ns>.submit`).
    pub async fn submit(&self, envs: &[Envelope]) -> Result<Vec<Submitted>> {
        let exchange = self.names.submit_exchange();
        let mut out = Vec::with_capacity(envs.len());
        for window in envs.chunks(CONFIRM_WINDOW) {
            for p in publish_envelopes(&self.ch, &exchange, window).await {
                out.push(match p {
                    Ok(confirm) => match amqp::confirmed(confirm).await {
                        Ok(()) => Submitted::Accepted,
                        Err(Error::Refused(why)) => Submitted::Refused(why),
                        Err(e) => return Err(self.unknown_namespace(e)),
                    },
                    Err(Error::Amqp(e)) if !self.ch.status().connected() => {
                        return Err(self.unknown_namespace(Error::Amqp(e)))
                    }
                    Err(e) => Submitted::Refused(e.to_string()),
                });
            }
        }
        Ok(out)
    }

    /// Submits every task, offering refused ones again with backoff and jitter (see the
    /// module docs) until all are accepted or `within` has passed. `progress` is called after
    /// every round. Errors as [`Producer::submit`]; what was accepted before an error stays
    /// accepted.
    pub async fn submit_paced(
        &self,
        envs: &[Envelope],
        within: Duration,
        pacing: Pacing,
        mut progress: impl FnMut(Progress),
    ) -> Result<PacedReport> {
        let deadline = Instant::now() + within;
        let builder = ExponentialBuilder::new()
            .with_min_delay(pacing.min_delay)
            .with_max_delay(pacing.max_delay)
            .with_jitter()
            .without_max_times();
        let mut delays = builder.build();
        let mut todo: Vec<&Envelope> = envs.iter().collect();
        let mut report = PacedReport {
            accepted: Vec::with_capacity(envs.len()),
            refused: vec![],
            rounds: 0,
        };
        loop {
            report.rounds += 1;
            let batch: Vec<Envelope> = todo.iter().map(|e| (*e).clone()).collect();
            let answers = self.submit(&batch).await?;
            let before = report.accepted.len();
            let mut refused = Vec::new();
            let mut last_reason = Vec::new();
            for (env, a) in todo.into_iter().zip(answers) {
                match a {
                    Submitted::Accepted => report.accepted.push(env.id.clone()),
                    Submitted::Refused(why) => {
                        refused.push(env);
                        last_reason.push(why);
                    }
                }
            }
            progress(Progress {
                accepted: report.accepted.len(),
                total: envs.len(),
                rounds: report.rounds,
            });
            if refused.is_empty() {
                return Ok(report);
            }
            if report.accepted.len() > before {
                delays = builder.build();
            }
            let delay = delays.next().unwrap_or(pacing.max_delay);
            let now = Instant::now();
            if now >= deadline {
                report.refused = refused
                    .into_iter()
                    .zip(last_reason)
                    .map(|(e, why)| (e.id.clone(), why))
                    .collect();
                return Ok(report);
            }
            tokio::time::sleep(delay.min(deadline - now)).await;
            todo = refused;
        }
    }

    /// The broker's 404 for a publish to `<ns>.submit` means no scheduler ever declared the
    /// namespace (the scheduler declares the submit exchange and the ingress queues; a
    /// producer never does, so that a typo in FLEET_NAMESPACE cannot create a namespace no one
    /// serves): one [`Error::Permanent`] naming FLEET_NAMESPACE and the fix, instead of the
    /// channel-close text lapin repeats for each layer. Any other error is returned as is.
    fn unknown_namespace(&self, e: Error) -> Error {
        match &e {
            Error::Amqp(le) if amqp::reply_code(le) == Some(404) => Error::Permanent {
                setting: "FLEET_NAMESPACE".into(),
                message: format!(
                    "no scheduler has declared namespace {ns} (no exchange {x}): start fleet-scheduler with FLEET_NAMESPACE={ns}, or set FLEET_NAMESPACE to the namespace your scheduler serves",
                    ns = self.names.namespace(),
                    x = self.names.submit_exchange()
                ),
            },
            _ => e,
        }
    }

    /// Closes the channel and the connection.
    pub async fn close(self) {
        let _ = self.ch.close(200, ShortString::from("done")).await;
        let _ = self.conn.close(200, ShortString::from("done")).await;
    }
}
