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

    /// The state of `queue`, `None` when it does not exist (404).
    ///
    /// # Errors
    /// No connection or channel could be had, or the broker answered the declare with another
    /// error than 404.
    pub async fn queue(&self, queue: &str) -> Result<Option<QueueState>> {
        let mut state = self.state.lock().await;
        let mut fresh = false;
        let ch = loop {
            let stale = state
                .as_ref()
                .is_none_or(|p| p.closes >= Self::CLOSES || !p.conn.status().connected());
            if stale {
                if let Some(old) = state.take() {
                    let _ = old.conn.close(200, "replaced".into()).await;
                }
                let conn = crate::broker::connect_any(&self.url, &self.name, &self.tls).await?;
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
            match p.conn.create_channel().await {
                Ok(ch) => {
                    p.ch = Some(ch.clone());
                    break ch;
                }
                // lapin may hand an earlier 404 to the next channel: a new connection, once.
                Err(_) if !fresh => p.closes = Self::CLOSES,
                Err(e) => return Err(e.into()),
            }
        };
        let r = ch
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await;
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
    use std::path::{Path, PathBuf};

    /// Every `.rs` file under `dir`.
    fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                sources(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }

    /// The kind, not one instance: a passive declare in product code goes through a
    /// [`super::Prober`]. The exceptions ask queues that exist by construction, on channels
    /// of their own: `fleetctl delete-namespace`'s catalog read (a short-lived connection of
    /// the CLI) and the dead-letter listing's depth (the dead-letter queue is declared with
    /// the namespace's core topology before any listing can run).
    #[test]
    fn passive_declares_go_through_the_prober() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let allowed = [
            "shared/src/broker/probe.rs",
            "shared/src/broker/topology.rs",
            "shared/src/broker/dead.rs",
        ];
        let mut files = Vec::new();
        for crate_dir in ["shared/src", "scheduler/src", "worker/src"] {
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
