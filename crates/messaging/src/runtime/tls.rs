//! TLS for every connection that leaves the process, through rustls (no OpenSSL): Postgres (sqlx
//! reads `sslmode`, `sslrootcert`, `sslcert` and `sslkey` from the URL, as libpq does), AMQPS
//! (lapin), and `https://` to the management API and to an OTLP collector ([`crate::runtime::http`]).
//!
//! Trust is the system's roots (`/etc/ssl/certs`; `SSL_CERT_FILE` or `SSL_CERT_DIR` replace them)
//! plus the CA file a connection names. A broker or management URL names its files in its query,
//! with the keys of RabbitMQ's own URI spec: `amqps://user:password@host:5671/vhost?cacertfile=
//! /run/ca.pem&certfile=/run/client.pem&keyfile=/run/client.key`. They are read at every connect, so
//! a rotated certificate is picked up by the next reconnect.
//!
//! A certificate that does not verify is not an outage: `messaging_core::outage::verification_failure`
//! tells it apart,
//! and the binaries stop at start-up with one line that names the server and rustls' reason
//! ([`crate::runtime::startup::StartupError`]).

use std::{path::PathBuf, sync::Arc};

use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use messaging_core::outage::UnreadableFile;
#[cfg(test)]
use messaging_core::outage::verification_failure;

/// The query keys (RabbitMQ's URI spec) that name TLS files, removed from a URL before it is used.
pub(crate) const QUERY_KEYS: [&str; 3] = ["cacertfile", "certfile", "keyfile"];

/// The files a connection's TLS uses, beside the system's roots.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM CA certificates trusted for this server, beside the system's.
    pub ca: Option<PathBuf>,
    /// PEM client certificate (chain), for servers that ask for one.
    pub cert: Option<PathBuf>,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1) of the client certificate.
    pub key: Option<PathBuf>,
}

impl TlsFiles {
    /// The files named in `url`'s query (`cacertfile`, `certfile`, `keyfile`).
    pub(crate) fn of_url(url: &url::Url) -> Self {
        let named = |key: &str| url.query_pairs().find(|(k, _)| k == key).map(|(_, v)| PathBuf::from(v.as_ref()));
        Self { ca: named("cacertfile"), cert: named("certfile"), key: named("keyfile") }
    }

    /// `url` without the TLS keys in its query (the rest of the query is kept).
    pub fn strip(url: &url::Url) -> url::Url {
        let mut bare = url.clone();
        let kept: Vec<(String, String)> = url
            .query_pairs()
            .filter(|(key, _)| !QUERY_KEYS.contains(&key.as_ref()))
            .map(|(k, v)| (k.into_owned(), v.into_owned()))
            .collect();
        if kept.is_empty() {
            bare.set_query(None);
        } else {
            bare.query_pairs_mut().clear().extend_pairs(kept);
        }
        bare
    }

    fn read(path: &PathBuf, what: &str) -> std::io::Result<Vec<u8>> {
        std::fs::read(path).map_err(|error| {
            let message = format!("cannot read the {what} {}: {error}", path.display());
            std::io::Error::new(error.kind(), UnreadableFile(message))
        })
    }

    /// The client identity, if both halves are named; an error if only one is.
    fn identity(&self) -> std::io::Result<Option<(Vec<u8>, Vec<u8>)>> {
        match (&self.cert, &self.key) {
            (Some(cert), Some(key)) => {
                Ok(Some((Self::read(cert, "client certificate")?, Self::read(key, "client key")?)))
            }
            (None, None) => Ok(None),
            _ => Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "a client certificate needs both certfile and keyfile",
            )),
        }
    }

    /// lapin's TLS settings: the CA file added to the system's roots, and the client identity.
    pub fn amqp(&self) -> std::io::Result<OwnedTLSConfig> {
        let cert_chain = match &self.ca {
            Some(ca) => Some(String::from_utf8_lossy(&Self::read(ca, "CA file")?).into_owned()),
            None => None,
        };
        let identity = self.identity()?.map(|(pem, key)| OwnedIdentity::PKCS8 { pem, key });
        Ok(OwnedTLSConfig { identity, cert_chain })
    }

    /// A rustls client configuration: the system's roots and the CA file, the client identity.
    pub(crate) fn client_config(&self) -> std::io::Result<rustls::ClientConfig> {
        use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
        let invalid = |what: &str, error: &dyn std::fmt::Display| {
            std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{what}: {error}"))
        };
        let mut roots = rustls::RootCertStore::empty();
        roots.add_parsable_certificates(system_roots().iter().cloned());
        if let Some(ca) = &self.ca {
            let pem = Self::read(ca, "CA file")?;
            let certs = CertificateDer::pem_slice_iter(&pem)
                .collect::<Result<Vec<_>, _>>()
                .map_err(|error| invalid(&format!("CA file {}", ca.display()), &error))?;
            if certs.is_empty() {
                return Err(invalid(&format!("CA file {}", ca.display()), &"no certificate in it"));
            }
            roots.add_parsable_certificates(certs);
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|error| invalid("TLS versions", &error))?
            .with_root_certificates(roots);
        match self.identity()? {
            None => Ok(builder.with_no_client_auth()),
            Some((pem, key)) => {
                let chain = CertificateDer::pem_slice_iter(&pem)
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|error| invalid("client certificate", &error))?;
                let key = PrivateKeyDer::from_pem_slice(&key).map_err(|error| invalid("client key", &error))?;
                builder.with_client_auth_cert(chain, key).map_err(|error| invalid("client certificate", &error))
            }
        }
    }
}

/// The first TLS file a Postgres URL names (`sslrootcert`, `sslcert`, `sslkey`, which sqlx reads
/// itself) that cannot be read, as a start-up refusal: sqlx reports a missing one as an I/O error,
/// which would otherwise be waited out as an outage for ever.
pub fn unreadable_postgres_file(url: &str) -> Option<String> {
    let parsed = url::Url::parse(url).ok()?;
    parsed.query_pairs().filter(|(key, _)| matches!(key.as_ref(), "sslrootcert" | "sslcert" | "sslkey")).find_map(
        |(key, path)| {
            std::fs::File::open(path.as_ref()).err().map(|error| format!("TLS: cannot read the {key} {path}: {error}"))
        },
    )
}

/// The system's CA certificates, read once per process (unreadable ones skipped, as every TLS
/// client does): an exporter or a page that sends a request every few seconds does not parse the
/// whole store each time. A connection's own CA file is still read at every connect.
fn system_roots() -> &'static [rustls::pki_types::CertificateDer<'static>] {
    static ROOTS: std::sync::OnceLock<Vec<rustls::pki_types::CertificateDer<'static>>> = std::sync::OnceLock::new();
    ROOTS.get_or_init(|| rustls_native_certs::load_native_certs().certs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tls_keys_are_read_from_the_query_and_removed_from_the_url() {
        let url =
            url::Url::parse("amqps://app:pw@mq:5671/shop?heartbeat=10&cacertfile=/run/ca.pem&keyfile=/k").expect("url");
        let files = TlsFiles::of_url(&url);
        assert_eq!(files.ca.as_deref(), Some(std::path::Path::new("/run/ca.pem")));
        assert_eq!(files.cert, None);
        assert_eq!(files.key.as_deref(), Some(std::path::Path::new("/k")));
        assert_eq!(TlsFiles::strip(&url).as_str(), "amqps://app:pw@mq:5671/shop?heartbeat=10");
        let only_tls = url::Url::parse("https://mq:15671?cacertfile=/ca.pem").expect("url");
        assert_eq!(TlsFiles::strip(&only_tls).as_str(), "https://mq:15671/");
        assert!(files.amqp().is_err(), "a key without its certificate is refused");
    }

    #[test]
    fn a_missing_ca_file_is_a_failure_that_names_it() {
        let files = TlsFiles { ca: Some("/nonexistent/ca.pem".into()), ..TlsFiles::default() };
        let error = files.client_config().expect_err("no such file");
        assert_eq!(
            verification_failure(&error).as_deref(),
            Some("cannot read the CA file /nonexistent/ca.pem: No such file or directory (os error 2)")
        );
        let postgres = "postgres://app@db/shop?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem";
        assert_eq!(
            unreadable_postgres_file(postgres).as_deref(),
            Some("TLS: cannot read the sslrootcert /nonexistent/ca.pem: No such file or directory (os error 2)")
        );
        assert_eq!(unreadable_postgres_file("postgres://app@db/shop?sslmode=require"), None);
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert_eq!(verification_failure(&refused), None, "an outage is worth retrying");
    }
}
