//! TLS for both protocols (rustls with the ring provider): the client configuration built once
//! from the `--ssl*` flags, and a connector that opens TCP and then a TLS session, used by the
//! gRPC channels (ALPN `h2`) and the HTTP/1.1 pool (ALPN `http/1.1`) alike.
//!
//! The server's certificate is verified against `--ssl-ca` (PEM), else the system's CA
//! bundle, for the host name of `--url` (an IP address must be in the certificate's SANs).
//! `--ssl-cert`/`--ssl-key` present a client certificate (mutual TLS). A handshake that fails
//! (unknown issuer, wrong name, client certificate refused) fails the connection: at start-up
//! that is "cannot reach" and exit 2, naming the TLS error.

use std::fmt;
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper::rt::{Read, ReadBufCursor, Write};
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;
use tonic::codegen::Service;

use super::CONNECT_TIMEOUT;

/// ALPN protocol ids offered: gRPC needs HTTP/2, the HTTP pool speaks HTTP/1.1.
pub const ALPN_H2: &[u8] = b"h2";
pub const ALPN_HTTP1: &[u8] = b"http/1.1";

/// CA bundles tried, in order, when `--ssl-ca` is not given (Debian/Ubuntu/Alpine, Fedora/RHEL,
/// openSUSE, macOS/BSD).
pub const SYSTEM_CA_BUNDLES: [&str; 4] = [
    "/etc/ssl/certs/ca-certificates.crt",
    "/etc/pki/tls/certs/ca-bundle.crt",
    "/etc/ssl/ca-bundle.pem",
    "/etc/ssl/cert.pem",
];

/// What the `--ssl*` flags asked for.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TlsSettings {
    /// PEM CA certificates to trust instead of the system's.
    pub ca_file: Option<PathBuf>,
    /// PEM certificate chain and private key presented to the server.
    pub client_auth: Option<(PathBuf, PathBuf)>,
}

/// A validated TLS client configuration (certificates read and parsed). Cheap to clone.
#[derive(Clone)]
pub struct Tls {
    config: Arc<rustls::ClientConfig>,
    /// Where the trusted roots came from, for messages.
    roots_from: String,
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tls").field("roots_from", &self.roots_from).finish_non_exhaustive()
    }
}

impl Tls {
    /// Reads the certificate and key files. Errors name the file and what is wrong with it.
    pub fn new(settings: &TlsSettings) -> Result<Tls, String> {
        let (roots_path, flag) = match &settings.ca_file {
            Some(p) => (p.clone(), "--ssl-ca"),
            None => {
                let found = SYSTEM_CA_BUNDLES.iter().map(Path::new).find(|p| p.exists()).ok_or_else(|| {
                    format!(
                        "--ssl: no system CA bundle found (looked for {}); give the server's CA with --ssl-ca FILE",
                        SYSTEM_CA_BUNDLES.join(", ")
                    )
                })?;
                (found.to_path_buf(), "CA bundle")
            }
        };
        let mut roots = rustls::RootCertStore::empty();
        let certs = read_certs(&roots_path).map_err(|e| format!("{flag} {e}"))?;
        let (added, _ignored) = roots.add_parsable_certificates(certs);
        if added == 0 {
            return Err(format!("{flag} {}: no usable CA certificate in it", roots_path.display()));
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS: {e}"))?
            .with_root_certificates(roots);
        let config = match &settings.client_auth {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let chain = read_certs(cert).map_err(|e| format!("--ssl-cert {e}"))?;
                let pem =
                    std::fs::read(key).map_err(|e| format!("--ssl-key {}: cannot read it: {e}", key.display()))?;
                let key_der = PrivateKeyDer::from_pem_slice(&pem).map_err(|e| {
                    format!("--ssl-key {}: no PEM private key (PKCS#8, PKCS#1 or SEC1) in it: {e}", key.display())
                })?;
                builder
                    .with_client_auth_cert(chain, key_der)
                    .map_err(|e| format!("--ssl-cert/--ssl-key: the key does not fit the certificate: {e}"))?
            }
        };
        Ok(Tls { config: Arc::new(config), roots_from: roots_path.display().to_string() })
    }

    /// A connector for one protocol: `alpn` is `h2` for gRPC, `http/1.1` for HTTP.
    pub fn connector(&self, alpn: &[u8]) -> Connector {
        let mut config = (*self.config).clone();
        config.alpn_protocols = vec![alpn.to_vec()];
        Connector::new(Some(tokio_rustls::TlsConnector::from(Arc::new(config))))
    }
}

/// Every certificate in a PEM file; at least one.
fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem = std::fs::read(path).map_err(|e| format!("{}: cannot read it: {e}", path.display()))?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: not a PEM certificate file: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: no PEM certificate in it", path.display()));
    }
    Ok(certs)
}

/// Opens TCP (no delay, bounded by [`CONNECT_TIMEOUT`]) and, with TLS, a TLS session for the
/// URI's host.
#[derive(Clone)]
pub struct Connector {
    tcp: HttpConnector,
    tls: Option<tokio_rustls::TlsConnector>,
}

impl Connector {
    /// Plain TCP when `tls` is `None`.
    pub fn new(tls: Option<tokio_rustls::TlsConnector>) -> Self {
        let mut tcp = HttpConnector::new();
        tcp.set_nodelay(true);
        tcp.set_connect_timeout(Some(CONNECT_TIMEOUT));
        // The scheme is ours to handle: https:// URIs reach this connector.
        tcp.enforce_http(false);
        Connector { tcp, tls }
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl Service<http::Uri> for Connector {
    type Response = Stream;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Stream, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.tcp.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: http::Uri) -> Self::Future {
        let tls = self.tls.clone();
        let host = uri.host().unwrap_or_default().trim_start_matches('[').trim_end_matches(']').to_string();
        let connect = self.tcp.call(uri);
        Box::pin(async move {
            let tcp = connect.await?;
            let Some(tls) = tls else {
                return Ok(Stream::Plain(tcp));
            };
            let name =
                ServerName::try_from(host.clone()).map_err(|e| format!("'{host}' is not a TLS server name: {e}"))?;
            let session = tokio::time::timeout(CONNECT_TIMEOUT, tls.connect(name, tcp.into_inner()))
                .await
                .map_err(|_| format!("TLS handshake did not finish within {CONNECT_TIMEOUT:?}"))?
                .map_err(|e| format!("TLS handshake failed: {e}"))?;
            Ok(Stream::Tls(Box::new(TokioIo::new(session))))
        })
    }
}

/// A connection made by [`Connector`].
pub enum Stream {
    Plain(TokioIo<TcpStream>),
    Tls(Box<TokioIo<tokio_rustls::client::TlsStream<TcpStream>>>),
}

impl Connection for Stream {
    fn connected(&self) -> Connected {
        match self {
            Stream::Plain(s) => s.connected(),
            Stream::Tls(s) => {
                let (_, session) = s.inner().get_ref();
                if session.alpn_protocol() == Some(b"h2") { Connected::new().negotiated_h2() } else { Connected::new() }
            }
        }
    }
}

impl Read for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: ReadBufCursor<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl Write for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }
}

/// Writes a self-signed certificate for `localhost` (`ca.pem`) and its key (`k.pem`) into
/// `dir`, for the flag-parsing unit tests.
#[cfg(test)]
pub(crate) fn write_test_cert(dir: &Path) -> (PathBuf, PathBuf) {
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".into()]).unwrap().self_signed(&key).unwrap();
    let (ca, k) = (dir.join("ca.pem"), dir.join("k.pem"));
    std::fs::write(&ca, cert.pem()).unwrap();
    std::fs::write(&k, key.serialize_pem()).unwrap();
    (ca, k)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_errors_name_the_flag_and_file() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.pem");
        let e = Tls::new(&TlsSettings { ca_file: Some(missing.clone()), client_auth: None }).unwrap_err();
        assert!(e.starts_with("--ssl-ca") && e.contains("nope.pem") && e.contains("cannot read"), "{e}");
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, "not pem at all").unwrap();
        let e = Tls::new(&TlsSettings { ca_file: Some(junk.clone()), client_auth: None }).unwrap_err();
        assert!(e.contains("junk.pem") && e.contains("no PEM certificate"), "{e}");

        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".into()]).unwrap().self_signed(&key).unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, cert.pem()).unwrap();
        let tls = Tls::new(&TlsSettings { ca_file: Some(ca.clone()), client_auth: None }).unwrap();
        assert!(format!("{tls:?}").contains("ca.pem"));

        let e = Tls::new(&TlsSettings { ca_file: Some(ca.clone()), client_auth: Some((ca.clone(), junk.clone())) })
            .unwrap_err();
        assert!(e.starts_with("--ssl-key") && e.contains("junk.pem"), "{e}");
        let other = rcgen::KeyPair::generate().unwrap();
        let other_key = dir.path().join("other.key");
        std::fs::write(&other_key, other.serialize_pem()).unwrap();
        let e = Tls::new(&TlsSettings { ca_file: Some(ca.clone()), client_auth: Some((ca.clone(), other_key)) })
            .unwrap_err();
        assert!(e.contains("does not fit"), "{e}");
        let own_key = dir.path().join("own.key");
        std::fs::write(&own_key, key.serialize_pem()).unwrap();
        Tls::new(&TlsSettings { ca_file: Some(ca.clone()), client_auth: Some((ca, own_key)) }).unwrap();
    }
}
