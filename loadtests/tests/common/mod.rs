//! Shared by the end-to-end tests: running a binary with a hard time limit, and TLS in front
//! of a worker (a test PKI and a TLS-terminating proxy).

// Each test crate uses its own subset.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

#[allow(unused_imports)]
pub use nereid_common::testing::{Output, run_bounded};

/// A test CA, a server certificate for `localhost` and a client certificate it signed, and a
/// second, unrelated CA; PEM files in `dir`.
pub struct TestPki {
    pub ca: PathBuf,
    pub rogue_ca: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    ca_der: rustls::pki_types::CertificateDer<'static>,
    server_cert: rustls::pki_types::CertificateDer<'static>,
    server_key: Vec<u8>,
}

impl TestPki {
    pub fn new(dir: &Path) -> TestPki {
        use rcgen::{
            BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
        };
        let new_ca = |name: &str| {
            let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
            params.distinguished_name.push(rcgen::DnType::CommonName, name);
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::DigitalSignature];
            let key = KeyPair::generate().unwrap();
            let cert = params.self_signed(&key).unwrap();
            (cert, Issuer::new(params, key))
        };
        let (ca_cert, issuer) = new_ca("nereid test CA");
        let (rogue_cert, _) = new_ca("another CA");
        let leaf = |name: &str, purpose: ExtendedKeyUsagePurpose| {
            let mut params = CertificateParams::new(vec![name.to_string()]).unwrap();
            params.extended_key_usages = vec![purpose];
            let key = KeyPair::generate().unwrap();
            (params.signed_by(&key, &issuer).unwrap(), key)
        };
        let (server_cert, server_key) = leaf("localhost", ExtendedKeyUsagePurpose::ServerAuth);
        let (client_cert, client_key) = leaf("client", ExtendedKeyUsagePurpose::ClientAuth);
        let write = |name: &str, text: String| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        TestPki {
            ca: write("ca.pem", ca_cert.pem()),
            rogue_ca: write("rogue-ca.pem", rogue_cert.pem()),
            client_cert: write("client.pem", client_cert.pem()),
            client_key: write("client.key", client_key.serialize_pem()),
            ca_der: ca_cert.der().clone(),
            server_cert: server_cert.der().clone(),
            server_key: server_key.serialize_der(),
        }
    }

    /// The proxy's config: ALPN h2 and http/1.1; with `mutual`, a client certificate signed by
    /// the CA is required.
    pub fn server_config(&self, mutual: bool) -> rustls::ServerConfig {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap();
        let builder = if mutual {
            let mut roots = rustls::RootCertStore::empty();
            roots.add(self.ca_der.clone()).unwrap();
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider).build().unwrap();
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let key = rustls::pki_types::PrivatePkcs8KeyDer::from(self.server_key.clone());
        let mut config = builder.with_single_cert(vec![self.server_cert.clone()], key.into()).unwrap();
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        config
    }
}

/// A TLS-terminating proxy on 127.0.0.1 (OS-assigned port) in front of a plain worker port:
/// each accepted TLS session is piped to a new connection upstream. Stops when dropped.
pub struct TlsProxy {
    pub port: u16,
    _runtime: tokio::runtime::Runtime,
}

impl TlsProxy {
    pub fn start(upstream: u16, config: rustls::ServerConfig) -> TlsProxy {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let port = listener.local_addr().unwrap().port();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        runtime.spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    // A refused handshake (no or an unknown client certificate) just closes.
                    let Ok(mut tls) = acceptor.accept(tcp).await else { return };
                    let Ok(mut up) = tokio::net::TcpStream::connect(("127.0.0.1", upstream)).await else { return };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut up).await;
                });
            }
        });
        TlsProxy { port, _runtime: runtime }
    }
}

/// Set (non-empty, not "0") to make a missing worker binary a failure instead of a skip: the
/// suite script sets it, so that the end-to-end tests cannot pass by not running.
pub const REQUIRE_WORKER: &str = "NEREID_REQUIRE_WORKER";

/// Whether `REQUIRE_WORKER`'s value asks for the worker.
pub fn worker_required(value: Option<&str>) -> bool {
    value.is_some_and(|v| !v.is_empty() && v != "0")
}

/// Called when the worker binary has not been built: the test is skipped after saying why (a
/// plain `cargo test`), or fails when [`REQUIRE_WORKER`] is set.
pub fn worker_not_built(why: &str) {
    if worker_required(std::env::var(REQUIRE_WORKER).ok().as_deref()) {
        panic!("{REQUIRE_WORKER} is set, so this test may not be skipped: {why}");
    }
    eprintln!("SKIPPED: {why} (set {REQUIRE_WORKER}=1 to fail instead)");
}
