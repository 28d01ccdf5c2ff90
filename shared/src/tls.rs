//! TLS client settings for one peer (RabbitMQ, Redis, the http executor's endpoint), with rustls.
//!
//! Each peer has three settings, `FLEET_<PEER>_TLS_CA_FILE` (PEM certificates trusted in
//! addition to the system roots: a private CA), `FLEET_<PEER>_TLS_CERT_FILE` and
//! `FLEET_<PEER>_TLS_KEY_FILE` (PEM client certificate chain and private key, for mutual TLS;
//! both or neither). The files are read and parsed once at start-up, so an unreadable file or
//! a file with no certificate / no key stops start-up with an error naming the setting
//! (exit 2) instead of failing at the first connection. TLS itself is chosen by the URL
//! (`amqps://`, `rediss://`, `https://`); server names are always verified against the URL's
//! host. Every client uses ring (lapin and reqwest choose it by their features); the `redis`
//! crate takes the process default, which [`install_crypto_provider`] sets. One provider is
//! compiled in (aws-lc-rs left out: its CMake build was a fifth of a fresh build, issue 29).

use std::fmt;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::error::{Error, Result};

/// PEM client identity for mutual TLS. `Debug` never shows the key.
#[derive(Clone)]
pub struct ClientIdentity {
    /// PEM certificate chain, leaf first.
    pub cert_pem: Vec<u8>,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key_pem: Vec<u8>,
}

impl fmt::Debug for ClientIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientIdentity")
            .field("cert_pem_bytes", &self.cert_pem.len())
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

/// Validated TLS client settings of one peer. The default trusts the system roots only and
/// presents no client certificate.
#[derive(Debug, Clone, Default)]
pub struct TlsConfig {
    /// Extra trusted CA certificates (PEM), checked to hold at least one certificate.
    pub ca_pem: Option<Vec<u8>>,
    /// Client certificate and key, checked to parse.
    pub identity: Option<ClientIdentity>,
}

impl TlsConfig {
    /// Builds the settings of one peer from its three file settings, as declared in
    /// [`crate::settings`] (`var_prefix` `FLEET_AMQP_TLS` → `FLEET_AMQP_TLS_CA_FILE`, …).
    ///
    /// # Errors
    /// [`crate::Error::Config`] naming the setting when a file cannot be read, holds no PEM
    /// certificate (CA, cert) or no private key (key), or when only one of cert and key is set.
    pub fn from_files(
        var_prefix: &str,
        ca: Option<&str>,
        cert: Option<&str>,
        key: Option<&str>,
    ) -> Result<Self> {
        let name = |what: &str| format!("{var_prefix}_{what}_FILE");
        let ca_pem = match ca {
            Some(path) => Some(read_certificates(path).map_err(|e| Error::config(name("CA"), e))?),
            None => None,
        };
        let identity = match (cert, key) {
            (None, None) => None,
            (Some(_), None) => {
                return Err(Error::config(
                    name("KEY"),
                    format!("is required when {} is set", name("CERT")),
                ))
            }
            (None, Some(_)) => {
                return Err(Error::config(
                    name("CERT"),
                    format!("is required when {} is set", name("KEY")),
                ))
            }
            (Some(cert), Some(key)) => Some(ClientIdentity {
                cert_pem: read_certificates(cert).map_err(|e| Error::config(name("CERT"), e))?,
                key_pem: read_private_key(key).map_err(|e| Error::config(name("KEY"), e))?,
            }),
        };
        Ok(TlsConfig { ca_pem, identity })
    }

    /// True when neither a CA nor a client identity is configured.
    pub fn is_default(&self) -> bool {
        self.ca_pem.is_none() && self.identity.is_none()
    }

    /// The settings as lapin (amq-protocol-tcp) takes them.
    pub fn to_lapin(&self) -> lapin::tcp::OwnedTLSConfig {
        lapin::tcp::OwnedTLSConfig {
            identity: self
                .identity
                .as_ref()
                .map(|i| lapin::tcp::OwnedIdentity::PKCS8 {
                    pem: i.cert_pem.clone(),
                    key: i.key_pem.clone(),
                }),
            cert_chain: self
                .ca_pem
                .as_ref()
                .map(|c| String::from_utf8_lossy(c).into_owned()),
        }
    }

    /// The settings as the `redis` crate takes them. With a CA set, the redis client trusts
    /// that CA only (the crate's behaviour); without, the system roots.
    pub fn to_redis(&self) -> deadpool_redis::redis::TlsCertificates {
        deadpool_redis::redis::TlsCertificates {
            client_tls: self
                .identity
                .as_ref()
                .map(|i| deadpool_redis::redis::ClientTlsConfig {
                    client_cert: i.cert_pem.clone(),
                    client_key: i.key_pem.clone(),
                }),
            root_cert: self.ca_pem.clone(),
        }
    }
}

/// The bytes of a PEM file holding at least one certificate.
///
/// # Errors
/// A message naming the path: unreadable, no certificate, or an invalid PEM block.
pub fn read_certificates(path: &str) -> std::result::Result<Vec<u8>, String> {
    let pem = std::fs::read(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    let certs: std::result::Result<Vec<CertificateDer<'_>>, _> =
        CertificateDer::pem_slice_iter(&pem).collect();
    match certs {
        Ok(c) if !c.is_empty() => Ok(pem),
        Ok(_) => Err(format!("{path}: no PEM certificate in the file")),
        Err(e) => Err(format!("{path}: invalid PEM certificate ({e})")),
    }
}

/// The bytes of a PEM file holding a private key (PKCS#8, PKCS#1 or SEC1).
///
/// # Errors
/// A message naming the path (never the key): unreadable, or no private key.
pub fn read_private_key(path: &str) -> std::result::Result<Vec<u8>, String> {
    let pem = std::fs::read(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    match PrivateKeyDer::from_pem_slice(&pem) {
        Ok(_) => Ok(pem),
        Err(e) => Err(format!("{path}: no PEM private key ({e})")),
    }
}

/// Installs ring as the process's rustls crypto provider; a no-op when one is installed.
/// Called before building any TLS client.
pub fn install_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Losing a race with another thread installing the same provider is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CERT: &str = "-----BEGIN CERTIFICATE-----\nMIIBdzCCAR2gAwIB\n-----END CERTIFICATE-----\n";

    fn tmp(name: &str, text: &str) -> String {
        let p = std::env::temp_dir().join(format!("fleet-tls-{}-{name}", std::process::id()));
        std::fs::write(&p, text).unwrap();
        p.to_string_lossy().into_owned()
    }

    #[test]
    fn bad_files_name_the_setting() {
        let e = TlsConfig::from_files("FLEET_AMQP_TLS", Some("/nonexistent/ca.pem"), None, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("FLEET_AMQP_TLS_CA_FILE") && e.contains("cannot read"),
            "{e}"
        );

        let not_pem = tmp("notpem", "hello\n");
        let e = TlsConfig::from_files("FLEET_REDIS_TLS", Some(&not_pem), None, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("FLEET_REDIS_TLS_CA_FILE") && e.contains("no PEM certificate"),
            "{e}"
        );

        let e = TlsConfig::from_files("FLEET_REDIS_TLS", None, Some(&not_pem), None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("FLEET_REDIS_TLS_KEY_FILE") && e.contains("required"),
            "{e}"
        );

        let cert = tmp("cert", CERT);
        let e = TlsConfig::from_files("FLEET_AMQP_TLS", None, Some(&cert), Some(&not_pem))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("FLEET_AMQP_TLS_KEY_FILE") && e.contains("no PEM private key"),
            "{e}"
        );

        assert!(TlsConfig::from_files("FLEET_AMQP_TLS", None, None, None)
            .unwrap()
            .is_default());
    }

    #[test]
    fn settings_check_the_files_at_parse_time() {
        let s = crate::settings::Settings::from_pairs([(
            "amqp_tls_ca_file",
            "/nonexistent/ca.pem".to_string(),
        )]);
        let e = crate::settings::parse::<crate::settings::CommonOnly>(&s)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("FLEET_AMQP_TLS_CA_FILE") && e.contains("cannot read"),
            "{e}"
        );
    }

    #[test]
    fn debug_hides_the_key() {
        let i = ClientIdentity {
            cert_pem: b"c".to_vec(),
            key_pem: b"-----BEGIN PRIVATE KEY-----SECRET".to_vec(),
        };
        assert!(!format!("{i:?}").contains("SECRET"));
    }
}
