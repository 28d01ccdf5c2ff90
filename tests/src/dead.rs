//! The namespace's dead-letter queue as tests read it: every message with its envelope and
//! every header as text.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{bail, Result};
use fleet::Envelope;
use lapin::options::{BasicAckOptions, BasicGetOptions};
use lapin::types::AMQPValue;

use crate::{wait_for, Ns};

/// One message of `<ns>.dead`: its envelope and every header as text.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    pub env: Envelope,
    pub headers: BTreeMap<String, String>,
}

impl DeadLetter {
    pub fn header(&self, k: &str) -> Option<&str> {
        self.headers.get(k).map(String::as_str)
    }
}

fn to_dead_letter(d: &lapin::message::Delivery) -> Result<DeadLetter> {
    let env = Envelope::from_slice(&d.data, usize::MAX)
        .map_err(|r| anyhow::anyhow!("dead letter is not an envelope: {r}"))?;
    let mut headers = BTreeMap::new();
    if let Some(h) = d.properties.headers().as_ref() {
        for (k, v) in h.inner() {
            let v = match v {
                AMQPValue::LongString(s) => s.to_string(),
                AMQPValue::ShortString(s) => s.to_string(),
                other => format!("{other:?}"),
            };
            headers.insert(k.to_string(), v);
        }
    }
    Ok(DeadLetter { env, headers })
}

/// Every dead letter, left in the queue (read unacked, then the channel is closed so the
/// broker puts them back). Returns once they are all ready in the queue again: the close is
/// answered before a quorum queue has taken them back, and a replay or a take right after
/// the peek found a letter missing (a CI run, three tests at a time).
///
/// # Errors
/// The broker failed, a letter is not an envelope, or the letters were not ready again
/// within 10 s.
pub async fn peek_dead(ns: &Ns) -> Result<Vec<DeadLetter>> {
    let queue = ns.names.dead_queue();
    let ch = ns.conn.create_channel().await?;
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: false })
        .await?
    {
        out.push(to_dead_letter(&m.delivery)?);
    }
    ch.close(200, "peeked".into()).await?;
    let n = out.len();
    wait_for(
        &format!("the {n} peeked dead letter(s) ready again"),
        Duration::from_secs(10),
        || {
            let queue = queue.clone();
            async move { (ns.depth(&queue).await as usize >= n).then_some(()) }
        },
    )
    .await?;
    Ok(out)
}

/// Takes every dead letter out of the queue.
pub async fn take_dead(ns: &Ns) -> Result<Vec<DeadLetter>> {
    let ch = ns.conn.create_channel().await?;
    let mut out = Vec::new();
    while let Some(m) = ch
        .basic_get(
            ns.names.dead_queue().as_str().into(),
            BasicGetOptions { no_ack: false },
        )
        .await?
    {
        out.push(to_dead_letter(&m.delivery)?);
        m.delivery.acker.ack(BasicAckOptions::default()).await?;
    }
    ch.close(200, "taken".into()).await?;
    Ok(out)
}

/// Waits until the dead queue holds exactly `n` messages, then returns them (left in place).
pub async fn wait_dead(ns: &Ns, n: usize, timeout: Duration) -> Result<Vec<DeadLetter>> {
    let queue = ns.names.dead_queue();
    wait_for(&format!("{n} dead letter(s)"), timeout, || {
        let queue = queue.clone();
        async move { (ns.depth(&queue).await as usize >= n).then_some(()) }
    })
    .await?;
    let d = peek_dead(ns).await?;
    if d.len() != n {
        bail!(
            "expected {n} dead letters, found {}: {:?}",
            d.len(),
            d.iter().map(|d| &d.env.id).collect::<Vec<_>>()
        );
    }
    Ok(d)
}
