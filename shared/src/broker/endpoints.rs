//! Several RabbitMQ nodes in one setting: `FLEET_AMQP_URL` is a comma-separated list of
//! `amqp://` / `amqps://` URLs, one per node of a cluster (a single URL is a list of one).
//!
//! A connection tries the nodes in turn from a random start (so a fleet's processes spread
//! over the cluster instead of all dialling the first node), and after a lost connection the
//! next attempt again starts at a random node: a dead node refuses at once and the next one is
//! tried, with capped exponential backoff with jitter only after a full pass failed (see
//! [`crate::broker::amqp::connect_retrying`]). Logs name the node with its password hidden
//! ([`crate::process::redact`]).

use rand::Rng;

use crate::error::{Error, Result};
use crate::process::redact;

/// The parsed node list of `FLEET_AMQP_URL`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoints {
    nodes: Vec<String>,
}

impl Endpoints {
    /// Parses a comma-separated list of AMQP URLs.
    ///
    /// # Errors
    /// A message naming the bad entry (password hidden): an empty entry, a scheme other than
    /// `amqp`/`amqps`, or a URL lapin cannot parse.
    pub fn parse(list: &str) -> Result<Self, String> {
        let mut nodes = Vec::new();
        for (i, raw) in list.split(',').enumerate() {
            let url = raw.trim();
            let n = i + 1;
            if url.is_empty() {
                return Err(format!(
                    "node {n} of the list is empty (use `amqp://…,amqp://…`)"
                ));
            }
            let scheme = url.split("://").next().unwrap_or("").to_ascii_lowercase();
            if !url.contains("://") || !matches!(scheme.as_str(), "amqp" | "amqps") {
                return Err(format!(
                    "node {n} `{}` is not an amqp:// or amqps:// URL",
                    redact(url)
                ));
            }
            match url.parse::<lapin::uri::AMQPUri>() {
                Err(e) => {
                    // The parser's message may quote the URL: never show its password.
                    let e = e.replace(url, &redact(url));
                    return Err(format!(
                        "node {n} `{}` is not a valid AMQP URL: {e}",
                        redact(url)
                    ));
                }
                // Two URLs joined by something else than a comma parse as one with the second
                // in its vhost (`/;amqp://…`): refused rather than retried forever.
                Ok(u) if u.vhost.contains("://") => {
                    return Err(format!(
                        "node {n} `{}` holds several URLs: separate the nodes with commas",
                        redact(url)
                    ));
                }
                Ok(_) => {}
            }
            nodes.push(url.to_string());
        }
        Ok(Endpoints { nodes })
    }

    /// The node URLs, in the order given.
    pub fn nodes(&self) -> &[String] {
        &self.nodes
    }

    /// Every node once, starting at a random one and wrapping around.
    pub fn rotation(&self) -> Vec<&str> {
        let n = self.nodes.len();
        let start = if n > 1 {
            rand::rng().random_range(0..n)
        } else {
            0
        };
        (0..n)
            .map(|j| self.nodes[(start + j) % n].as_str())
            .collect()
    }
}

/// Connects once to the first node of `list` (one URL or a comma-separated list) that
/// answers, trying every node in turn from a random one ([`Endpoints::rotation`]). Each
/// failure is logged with the node (password hidden by [`crate::process::redact`]), and so is
/// the node connected to.
///
/// # Errors
/// A malformed list ([`Error::Config`] naming `FLEET_AMQP_URL`); a permanent refusal (login,
/// vhost) at once as [`Error::Permanent`] (every node of a cluster shares users and vhosts);
/// otherwise, when no node answered, the last node's error.
pub async fn connect_any(
    list: &str,
    name: &str,
    tls: &crate::tls::TlsConfig,
) -> Result<lapin::Connection> {
    let nodes = Endpoints::parse(list).map_err(|e| Error::config("FLEET_AMQP_URL", e))?;
    let many = nodes.nodes().len() > 1;
    let mut last = Error::config("FLEET_AMQP_URL", "no RabbitMQ node given");
    for node in nodes.rotation() {
        let shown = redact(node);
        match crate::broker::amqp::connect_with(node, name, tls).await {
            Ok(c) => {
                if many {
                    tracing::info!(node = %shown, connection = name, "connected to RabbitMQ node");
                }
                return Ok(c);
            }
            Err(e @ Error::Permanent { .. }) => return Err(e),
            Err(e) => {
                if many {
                    tracing::warn!(node = %shown, connection = name, error = %e, "cannot connect to RabbitMQ node; trying the next");
                }
                last = e;
            }
        }
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_of_nodes() {
        let e = Endpoints::parse("amqp://u:p@h1:5672/%2f, amqp://u:p@h2:5673/%2f,amqps://u:p@h3/v")
            .unwrap();
        assert_eq!(
            e.nodes(),
            [
                "amqp://u:p@h1:5672/%2f",
                "amqp://u:p@h2:5673/%2f",
                "amqps://u:p@h3/v"
            ]
        );
        let mut r = e.rotation();
        assert_eq!(r.len(), 3);
        r.sort_unstable();
        assert_eq!(
            r,
            [
                "amqp://u:p@h1:5672/%2f",
                "amqp://u:p@h2:5673/%2f",
                "amqps://u:p@h3/v"
            ]
        );
        assert_eq!(
            Endpoints::parse("amqp://127.0.0.1").unwrap().rotation(),
            ["amqp://127.0.0.1"]
        );
    }

    #[test]
    fn a_malformed_list_is_refused_without_its_password() {
        let e = Endpoints::parse("amqp://u:s3cret@h1/%2f,,amqp://u:s3cret@h2").unwrap_err();
        assert!(e.contains("node 2") && e.contains("empty"), "{e}");
        let e = Endpoints::parse("amqp://u:s3cret@h1/%2f;amqp://u:s3cret@h2").unwrap_err();
        assert!(!e.contains("s3cret"), "{e}");
        let e = Endpoints::parse("amqp://u:s3cret@h1/%2f,http://u:s3cret@h2").unwrap_err();
        assert!(e.contains("node 2") && !e.contains("s3cret"), "{e}");
        let e = Endpoints::parse("amqp://u:s3cret@h1:99999/%2f").unwrap_err();
        assert!(e.contains("node 1") && !e.contains("s3cret"), "{e}");
    }

    #[test]
    fn the_scheme_is_case_insensitive() {
        assert!(Endpoints::parse("AMQP://u:p@127.0.0.1:5672/%2f,amqps://h2").is_ok());
        let e = Endpoints::parse("AMQPX://u:hunter2@h/").unwrap_err();
        assert!(e.contains("node 1") && !e.contains("hunter2"), "{e}");
    }
}
