//! Passive declares of queues that may not exist, on a connection of their own.
//!
//! A passive `queue.declare` of a missing queue is answered by the broker closing the channel
//! (AMQP 404). lapin (4.12) never frees the id of a channel the broker closed, so every such
//! answer costs its connection one of its 2,047 channel ids for good: measured, 2,600 probes of
//! a missing queue on one connection — every `create_channel` from the 2,048th on failed (first
//! with the last 404 again, then "the maximum number of channels for this connection has been
//! reached"), whether or not the client closed the channel too. A scheduler probes queues that
//! may be missing (a departed group's, a park queue not declared yet, a queue just deleted):
//! on its session connection, a fleet whose pods come and go would run that connection out of
//! channels and restart the session. [`Prober`] asks on a connection of its own, replaced
//! after [`Prober::CLOSES`] broker-closed channels.

use std::sync::Arc;

use lapin::options::QueueDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Channel, Connection};

use crate::error::Result;
use crate::tls::TlsConfig;

/// A queue's state as a passive declare reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueState {
    /// Ready messages (not those a consumer holds unacked).
    pub ready: u32,
    /// Consumers.
    pub consumers: u32,
}

/// Passive declares on a connection of their own (see the module docs), one question at a
/// time on one channel, reopened after a 404 closed it.
pub struct Prober {
    url: String,
    name: String,
    tls: TlsConfig,
    state: tokio::sync::Mutex<Option<Probe>>,
}

/// The prober's connection, its open channel, and the channels the broker closed on it.
struct Probe {
    conn: Arc<Connection>,
    ch: Option<Channel>,
    closes: u32,
}

impl Prober {
    /// Broker-closed channels after which the connection is replaced (of 2,047 ids).
    pub const CLOSES: u32 = 1000;

    /// A prober connecting to `url` (named `<name> probe`) with `tls`; no connection is made
    /// until the first question.
    pub fn new(url: &str, name: &str, tls: &TlsConfig) -> Self {
        Prober {
            url: url.to_string(),
            name: format!("{name} probe"),
            tls: tls.clone(),
            state: tokio::sync::Mutex::new(None),
        }
    }

    /// How long a question may take once connected (the channel and the declare): a broker
    /// that accepts and never answers (frozen, wedged) must not hold the prober — and every
    /// loop that asks it — for good. The connect has its own bound
    /// ([`crate::broker::amqp::CONNECT_TIMEOUT`] per node).
    pub const QUESTION_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

    /// The state of `queue`, `None` when it does not exist (404).
    ///
    /// # Errors
    /// No connection or channel could be had, the broker answered the declare with another
    /// error than 404, or did not answer within [`Prober::QUESTION_LIMIT`] (the connection is
    /// then replaced at the next question).
    pub async fn queue(&self, queue: &str) -> Result<Option<QueueState>> {
        let mut state = self.state.lock().await;
        Self::ask(&mut state, self, queue).await
    }

    /// The error of a channel open or declare that did not answer within
    /// [`Prober::QUESTION_LIMIT`]; the connection is marked for replacement.
    fn unanswered(state: &mut Option<Probe>, queue: &str) -> crate::error::Error {
        if let Some(p) = state.as_mut() {
            p.closes = Self::CLOSES;
            p.ch = None;
        }
        crate::error::Error::Timeout {
            what: format!("RabbitMQ's answer to a passive declare of {queue}"),
            after: Self::QUESTION_LIMIT,
        }
    }

    /// [`Prober::queue`]'s work under the lock.
    async fn ask(
        state: &mut Option<Probe>,
        prober: &Prober,
        queue: &str,
    ) -> Result<Option<QueueState>> {
        let mut fresh = false;
        let ch = loop {
            let stale = state
                .as_ref()
                .is_none_or(|p| p.closes >= Self::CLOSES || !p.conn.status().connected());
            if stale {
                if let Some(old) = state.take() {
                    let _ = tokio::time::timeout(
                        Self::CLOSE_WAIT,
                        old.conn.close(200, "replaced".into()),
                    )
                    .await;
                }
                let conn =
                    crate::broker::connect_any(&prober.url, &prober.name, &prober.tls).await?;
                *state = Some(Probe {
                    conn: Arc::new(conn),
                    ch: None,
                    closes: 0,
                });
                fresh = true;
            }
            let Some(p) = state.as_mut() else {
                continue;
            };
            if let Some(ch) = p.ch.as_ref().filter(|c| c.status().connected()) {
                break ch.clone();
            }
            let opened = tokio::time::timeout(Self::QUESTION_LIMIT, p.conn.create_channel()).await;
            let Ok(opened) = opened else {
                return Err(Self::unanswered(state, queue));
            };
            match opened {
                Ok(ch) => {
                    p.ch = Some(ch.clone());
                    break ch;
                }
                // lapin may hand an earlier 404 to the next channel: a new connection, once.
                Err(_) if !fresh => p.closes = Self::CLOSES,
                Err(e) => return Err(e.into()),
            }
        };
        let declared = ch.queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        );
        let Ok(r) = tokio::time::timeout(Self::QUESTION_LIMIT, declared).await else {
            return Err(Self::unanswered(state, queue));
        };
        match r {
            Ok(q) => Ok(Some(QueueState {
                ready: q.message_count(),
                consumers: q.consumer_count(),
            })),
            Err(e) => {
                // The broker closed the channel: its id is gone for good (module docs).
                if let Some(p) = state.as_mut() {
                    p.closes += 1;
                    p.ch = None;
                }
                if crate::broker::amqp::reply_code(&e) == Some(404) {
                    Ok(None)
                } else {
                    Err(e.into())
                }
            }
        }
    }

    /// How long [`Prober::close`] waits for the broker to answer (a frozen broker never does).
    pub const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

    /// Closes the connection, if one is open (the next question opens another), waiting at
    /// most [`Prober::CLOSE_WAIT`] for the lock and for the broker's answer: a stop never
    /// hangs on a frozen broker (its socket goes with the connection).
    pub async fn close(&self) {
        let _ = tokio::time::timeout(Self::CLOSE_WAIT, async {
            if let Some(p) = self.state.lock().await.take() {
                let _ = p.conn.close(200, "bye".into()).await;
            }
        })
        .await;
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::wings::rust_files as sources;

    /// The kind, not one instance: a passive declare in product code goes through a
    /// [`super::Prober`]. Two exceptions, each a 404 at most once per operator action, never
    /// in a loop: `fleetctl delete-namespace`'s catalog read (`topology::read_catalog`, on the
    /// CLI's short-lived connection; a missing catalog is a namespace never declared) and the
    /// dead-letter listing's depth (`dead::list`, on the connection it is given — the
    /// scheduler's session connection for `/v1/dead`; the dead-letter queue is declared with
    /// the namespace's core topology at every session start, so a 404 there needs an
    /// operator deleting it under a running scheduler).
    #[test]
    fn passive_declares_go_through_the_prober() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let allowed = [
            "shared/src/broker/probe.rs",
            "shared/src/broker/topology.rs",
            "shared/src/broker/dead.rs",
        ];
        let mut files = Vec::new();
        for crate_dir in ["shared/src", "scheduler/src", "worker/src", "fleetctl/src"] {
            sources(&root.join(crate_dir), &mut files);
        }
        assert!(
            files.len() > 50,
            "sources not found under {}",
            root.display()
        );
        let mut found = Vec::new();
        for f in files {
            let rel = f
                .strip_prefix(&root)
                .map(|p| p.to_string_lossy().replace('\\', "/"))
                .unwrap_or_default();
            let Ok(text) = std::fs::read_to_string(&f) else {
                continue;
            };
            // Spelt in two pieces so this test's own file counts only the prober's declare.
            let n = text.matches(concat!("passive", ": true")).count();
            match allowed.iter().position(|a| *a == rel) {
                // Each allowed file has exactly its one known declare.
                Some(_) if n <= 1 => {}
                _ if n == 0 => {}
                _ => found.push(format!("{rel}: {n}")),
            }
        }
        assert!(
            found.is_empty(),
            "passive declares outside fleet::broker::probe::Prober (a 404 costs a lapin connection a channel id for good): {found:?}"
        );
    }
}
