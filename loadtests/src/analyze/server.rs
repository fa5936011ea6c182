//! The server under test: a `nereid-worker` process this tool starts (explicit model control,
//! OS-assigned ports read from `--port-file`), or one already running; its repository API
//! (load with a config override, unload) over gRPC or HTTP, over TLS when `--url` asks for it,
//! with `authorization: Bearer <key>` when given `--api-key`; and its memory (VmRSS from
//! `/proc/PID/status`, sampled while a variant is measured).
//!
//! Every wait is bounded: the worker's start by `start_timeout`, each repository call by
//! `load_timeout`. A call that gets no answer at all is [`RepositoryError::Unreachable`] (the
//! server may be gone); an answer with an error is [`RepositoryError::Refused`] (that variant
//! failed, the sweep goes on).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use nereid_proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
use nereid_proto::inference::model_repository_parameter::ParameterChoice;
use nereid_proto::inference::{ModelRepositoryParameter, RepositoryModelLoadRequest, RepositoryModelUnloadRequest};
use tokio::process::{Child, Command};
use tokio::time::Instant;
use tonic::metadata::AsciiMetadataValue;
use tonic::transport::Endpoint;

use crate::client::tls::{ALPN_H2, ALPN_HTTP1, Connector};
use crate::client::{CONNECT_TIMEOUT, Protocol, Tls, error_chain};

/// How often the port file and the worker's health are polled while it starts.
const START_POLL: Duration = Duration::from_millis(50);
/// How often RSS is sampled during a measurement.
pub const RSS_SAMPLE_INTERVAL: Duration = Duration::from_millis(100);
/// Largest repository API response read.
const MAX_RESPONSE_BYTES: usize = 1 << 20;

/// The worker could not be started.
#[derive(Debug, thiserror::Error)]
#[error("cannot start the worker {bin}: {reason}")]
pub struct StartError {
    pub bin: String,
    pub reason: String,
}

/// A `nereid-worker` this tool started; killed when dropped.
pub struct WorkerProcess {
    child: Child,
    pub pid: u32,
    pub http_port: u16,
    pub grpc_port: u16,
    pub metrics_port: u16,
    pub log: PathBuf,
}

impl WorkerProcess {
    /// Starts `bin` serving `repository` in explicit model-control mode on 127.0.0.1 with
    /// OS-assigned ports, logging to `dir/worker.log`, and waits (at most `start_timeout`)
    /// until it has written its ports and answers its liveness check.
    pub async fn start(
        bin: &Path,
        repository: &Path,
        extra_args: &[String],
        dir: &Path,
        start_timeout: Duration,
    ) -> Result<WorkerProcess, StartError> {
        let fail = |reason: String| StartError { bin: bin.display().to_string(), reason };
        let port_file = dir.join("worker-ports.json");
        let _ = std::fs::remove_file(&port_file);
        let log = dir.join("worker.log");
        let log_file =
            std::fs::File::create(&log).map_err(|e| fail(format!("cannot create {}: {e}", log.display())))?;
        let log_err = log_file.try_clone().map_err(|e| fail(format!("{}: {e}", log.display())))?;
        let mut child = Command::new(bin)
            .arg("--model-repository")
            .arg(repository)
            .args(["--model-control-mode", "explicit", "--address", "127.0.0.1"])
            .args(["--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"])
            .arg("--port-file")
            .arg(&port_file)
            .args(extra_args)
            .stdin(Stdio::null())
            .stdout(log_file)
            .stderr(log_err)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| fail(e.to_string()))?;
        let pid = child.id().unwrap_or(0);
        let deadline = Instant::now() + start_timeout;
        let ports: serde_json::Value = loop {
            if let Ok(text) = std::fs::read_to_string(&port_file)
                && let Ok(v) = serde_json::from_str(&text)
            {
                break v;
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(fail(format!("it exited ({status}) before listening; see {}", log.display())));
            }
            if Instant::now() > deadline {
                return Err(fail(format!("it wrote no port file within {start_timeout:?}; see {}", log.display())));
            }
            tokio::time::sleep(START_POLL).await;
        };
        let port = |k: &str| ports[k].as_u64().and_then(|p| u16::try_from(p).ok()).unwrap_or(0);
        let mut worker = WorkerProcess {
            child,
            pid,
            http_port: port("http"),
            grpc_port: port("grpc"),
            metrics_port: port("metrics"),
            log,
        };
        if worker.http_port == 0 || worker.grpc_port == 0 {
            return Err(fail(format!("its port file lacks the http or grpc port: {ports}")));
        }
        let repo = RepositoryClient::new(Protocol::Http { binary: false }, &worker.http_url(), start_timeout, None);
        while !repo.is_live().await {
            if !worker.is_running() {
                return Err(fail(format!("it exited while starting; see {}", worker.log.display())));
            }
            if Instant::now() > deadline {
                return Err(fail(format!("it was not live within {start_timeout:?}; see {}", worker.log.display())));
            }
            tokio::time::sleep(START_POLL).await;
        }
        Ok(worker)
    }

    pub fn http_url(&self) -> String {
        format!("127.0.0.1:{}", self.http_port)
    }

    pub fn grpc_url(&self) -> String {
        format!("127.0.0.1:{}", self.grpc_port)
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// How it exited, if it did.
    pub fn exit_status(&mut self) -> Option<String> {
        self.child.try_wait().ok().flatten().map(|s| s.to_string())
    }

    /// Stops the worker (SIGKILL) and reaps it.
    pub async fn stop(mut self) {
        let _ = self.child.kill().await;
    }
}

/// A repository call that did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum RepositoryError {
    /// The server answered with an error: the variant failed (the message is the server's).
    #[error("{0}")]
    Refused(String),
    /// No answer: connection refused or broken, or the call timed out.
    #[error("{0}")]
    Unreachable(String),
}

/// The KServe v2 repository extension over gRPC or HTTP, over TLS when given one.
#[derive(Clone)]
pub enum RepositoryClient {
    Grpc {
        url: String,
        timeout: Duration,
        tls: Option<Tls>,
        /// `Bearer <key>` on every call (`--api-key`).
        auth: Option<AsciiMetadataValue>,
    },
    Http {
        url: String,
        timeout: Duration,
        /// `https` with TLS.
        scheme: &'static str,
        pool: Arc<HyperClient<Connector, Full<Bytes>>>,
        /// `Bearer <key>` on every call (`--api-key`).
        auth: Option<http::HeaderValue>,
    },
}

impl RepositoryClient {
    /// A client for the server at `url` (`host:port`), over TLS with `tls` (gRPC: ALPN `h2`;
    /// HTTP: `https://`, ALPN `http/1.1`); each call is bounded by `timeout`.
    pub fn new(protocol: Protocol, url: &str, timeout: Duration, tls: Option<&Tls>) -> RepositoryClient {
        match protocol {
            Protocol::Grpc => RepositoryClient::Grpc { url: url.into(), timeout, tls: tls.cloned(), auth: None },
            Protocol::Http { .. } => {
                // TCP (bounded by CONNECT_TIMEOUT) and, with TLS, the handshake (bounded too).
                let connector = match tls {
                    Some(tls) => tls.connector(ALPN_HTTP1),
                    None => Connector::new(None),
                };
                let pool = HyperClient::builder(TokioExecutor::new()).build(connector);
                let scheme = if tls.is_some() { "https" } else { "http" };
                RepositoryClient::Http { url: url.into(), timeout, scheme, pool: Arc::new(pool), auth: None }
            }
        }
    }

    /// The same client sending `authorization: Bearer <key>` on every call (load, unload,
    /// liveness), as the measurement does with `--api-key`. Fails on a key that cannot be a
    /// header value.
    pub fn with_api_key(mut self, key: Option<&str>) -> Result<RepositoryClient, String> {
        let Some(key) = key else { return Ok(self) };
        let bad = || "--api-key: not a valid header value (visible ASCII characters only)".to_string();
        let value = http::HeaderValue::try_from(format!("Bearer {key}")).map_err(|_| bad())?;
        match &mut self {
            RepositoryClient::Grpc { auth, .. } => {
                *auth = Some(AsciiMetadataValue::try_from(value.as_bytes()).map_err(|_| bad())?)
            }
            RepositoryClient::Http { auth, .. } => *auth = Some(value),
        }
        Ok(self)
    }

    /// A gRPC call's request, with the key.
    fn grpc_request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        if let RepositoryClient::Grpc { auth: Some(auth), .. } = self {
            request.metadata_mut().insert("authorization", auth.clone());
        }
        request
    }

    /// An HTTP request to `path` on the server, with the key.
    fn http_request(&self, method: Method, path: &str) -> http::request::Builder {
        let RepositoryClient::Http { url, scheme, auth, .. } = self else { unreachable!("an HTTP client") };
        let builder = Request::builder().method(method).uri(format!("{scheme}://{url}{path}"));
        match auth {
            Some(auth) => builder.header(http::header::AUTHORIZATION, auth.clone()),
            None => builder,
        }
    }

    /// Loads (or reloads) `model` with `config_json` (a ModelConfig as protobuf JSON) in
    /// place of its config.pbtxt: Triton's `parameters.config`.
    pub async fn load(&self, model: &str, config_json: &str) -> Result<(), RepositoryError> {
        match self {
            RepositoryClient::Grpc { url, timeout, tls, .. } => {
                let mut client = grpc_client(url, tls.as_ref()).await?;
                let parameters = HashMap::from([(
                    "config".to_string(),
                    ModelRepositoryParameter {
                        parameter_choice: Some(ParameterChoice::StringParam(config_json.into())),
                    },
                )]);
                let call = client.repository_model_load(self.grpc_request(RepositoryModelLoadRequest {
                    repository_name: String::new(),
                    model_name: model.into(),
                    parameters,
                }));
                grpc_outcome(tokio::time::timeout(*timeout, call).await, *timeout)
            }
            RepositoryClient::Http { .. } => {
                let body = serde_json::json!({ "parameters": { "config": config_json } }).to_string();
                self.http_post(&format!("/v2/repository/models/{model}/load"), body).await
            }
        }
    }

    /// Unloads `model` (so the next variant's memory is not measured on top of this one's).
    pub async fn unload(&self, model: &str) -> Result<(), RepositoryError> {
        match self {
            RepositoryClient::Grpc { url, timeout, tls, .. } => {
                let mut client = grpc_client(url, tls.as_ref()).await?;
                let call = client.repository_model_unload(self.grpc_request(RepositoryModelUnloadRequest {
                    repository_name: String::new(),
                    model_name: model.into(),
                    parameters: HashMap::new(),
                }));
                grpc_outcome(tokio::time::timeout(*timeout, call).await, *timeout)
            }
            RepositoryClient::Http { .. } => {
                self.http_post(&format!("/v2/repository/models/{model}/unload"), "{}".into()).await
            }
        }
    }

    /// Whether the server answers `GET /v2/health/live` (HTTP) or `ServerLive` (gRPC).
    pub async fn is_live(&self) -> bool {
        self.check_live().await.is_ok()
    }

    /// [`is_live`](Self::is_live), saying why not (e.g. the TLS handshake failed). The
    /// connection is bounded by [`CONNECT_TIMEOUT`] (and the handshake by as much again), the
    /// call by [`CONNECT_TIMEOUT`].
    pub async fn check_live(&self) -> Result<(), String> {
        let no_answer = || format!("no answer within {CONNECT_TIMEOUT:?}");
        match self {
            RepositoryClient::Grpc { url, tls, .. } => {
                let mut client = grpc_client(url, tls.as_ref()).await.map_err(|e| e.to_string())?;
                let call = client.server_live(self.grpc_request(nereid_proto::inference::ServerLiveRequest {}));
                match tokio::time::timeout(CONNECT_TIMEOUT, call).await {
                    Ok(Ok(r)) if r.get_ref().live => Ok(()),
                    Ok(Ok(_)) => Err("ServerLive: not live".into()),
                    Ok(Err(s)) => Err(format!("ServerLive failed: {}: {}", s.code(), s.message())),
                    Err(_) => Err(no_answer()),
                }
            }
            RepositoryClient::Http { pool, .. } => {
                let req = self
                    .http_request(Method::GET, "/v2/health/live")
                    .body(Full::new(Bytes::new()))
                    .map_err(|e| format!("bad request: {e}"))?;
                match tokio::time::timeout(CONNECT_TIMEOUT, pool.request(req)).await {
                    Ok(Ok(r)) if r.status() == 200 => Ok(()),
                    Ok(Ok(r)) => Err(format!("GET /v2/health/live answered HTTP {}", r.status())),
                    Ok(Err(e)) => Err(format!("GET /v2/health/live: {}", error_chain(&e))),
                    Err(_) => Err(no_answer()),
                }
            }
        }
    }

    async fn http_post(&self, path: &str, body: String) -> Result<(), RepositoryError> {
        let RepositoryClient::Http { timeout, pool, .. } = self else { unreachable!("an HTTP client") };
        let req = self
            .http_request(Method::POST, path)
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| RepositoryError::Refused(format!("bad request: {e}")))?;
        let call = async {
            let resp = pool
                .request(req)
                .await
                .map_err(|e| RepositoryError::Unreachable(format!("POST {path}: {}", error_chain(&e))))?;
            let status = resp.status();
            let body = http_body_util::Limited::new(resp.into_body(), MAX_RESPONSE_BYTES)
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            if status.is_success() {
                return Ok(());
            }
            // KServe errors are {"error": "..."}; show the message, else the raw body.
            let text = String::from_utf8_lossy(&body);
            let message = serde_json::from_str::<serde_json::Value>(&text)
                .ok()
                .and_then(|v| v["error"].as_str().map(str::to_string))
                .unwrap_or_else(|| text.trim().to_string());
            Err(RepositoryError::Refused(format!("HTTP {status}: {message}")))
        };
        tokio::time::timeout(*timeout, call)
            .await
            .unwrap_or_else(|_| Err(RepositoryError::Unreachable(format!("POST {path}: no answer within {timeout:?}"))))
    }
}

/// A channel to `url` for one repository call: plain, or over TLS (ALPN `h2`) through our
/// connector (tonic is built without its own TLS; an `https://` endpoint reaches the connector
/// as is).
async fn grpc_client(
    url: &str,
    tls: Option<&Tls>,
) -> Result<GrpcInferenceServiceClient<tonic::transport::Channel>, RepositoryError> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let endpoint = Endpoint::from_shared(format!("{scheme}://{url}"))
        .map_err(|e| RepositoryError::Unreachable(format!("{url}: {e}")))?
        .connect_timeout(CONNECT_TIMEOUT);
    let channel = match tls {
        None => endpoint.connect().await,
        Some(tls) => endpoint.connect_with_connector(tls.connector(ALPN_H2)).await,
    };
    let channel =
        channel.map_err(|e| RepositoryError::Unreachable(format!("cannot connect to {url}: {}", error_chain(&e))))?;
    Ok(GrpcInferenceServiceClient::new(channel).max_decoding_message_size(MAX_RESPONSE_BYTES))
}

fn grpc_outcome<T>(
    result: Result<Result<tonic::Response<T>, tonic::Status>, tokio::time::error::Elapsed>,
    timeout: Duration,
) -> Result<(), RepositoryError> {
    match result {
        Err(_) => Err(RepositoryError::Unreachable(format!("no answer within {timeout:?}"))),
        Ok(Ok(_)) => Ok(()),
        Ok(Err(s)) if s.code() == tonic::Code::Unavailable => {
            Err(RepositoryError::Unreachable(format!("{}: {}", s.code(), s.message())))
        }
        Ok(Err(s)) => Err(RepositoryError::Refused(format!("{}: {}", s.code(), s.message()))),
    }
}

/// The `VmRSS` line of a `/proc/PID/status` text, in KiB.
pub fn parse_vm_rss_kib(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let mut parts = line["VmRSS:".len()..].split_whitespace();
    let value: u64 = parts.next()?.parse().ok()?;
    match parts.next() {
        Some("kB") | None => Some(value),
        Some(_) => None,
    }
}

/// The resident set size of process `pid` in MiB, or `None` if it cannot be read.
pub fn rss_mib(pid: u32) -> Option<f64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    parse_vm_rss_kib(&text).map(|kib| kib as f64 / 1024.0)
}

/// Samples a process's RSS every [`RSS_SAMPLE_INTERVAL`] on a background task, keeping the
/// maximum; stops when dropped or [`finish`](Self::finish)ed.
pub struct RssSampler {
    peak_kib: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl RssSampler {
    pub fn start(pid: u32) -> RssSampler {
        let peak_kib = Arc::new(AtomicU64::new(0));
        let peak = peak_kib.clone();
        let task = tokio::spawn(async move {
            let mut tick = tokio::time::interval(RSS_SAMPLE_INTERVAL);
            loop {
                tick.tick().await;
                if let Some(mib) = rss_mib(pid) {
                    peak.fetch_max((mib * 1024.0) as u64, Ordering::Relaxed);
                }
            }
        });
        RssSampler { peak_kib, task }
    }

    /// Takes one last sample and returns the peak in MiB (`None` if nothing could be read).
    pub fn finish(self, pid: u32) -> Option<f64> {
        self.task.abort();
        if let Some(mib) = rss_mib(pid) {
            self.peak_kib.fetch_max((mib * 1024.0) as u64, Ordering::Relaxed);
        }
        let kib = self.peak_kib.load(Ordering::Relaxed);
        (kib > 0).then(|| kib as f64 / 1024.0)
    }
}

impl Drop for RssSampler {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_vm_rss() {
        let status = "Name:\tnereid-worker\nVmPeak:\t  900000 kB\nVmRSS:\t   81234 kB\nThreads:\t9\n";
        assert_eq!(parse_vm_rss_kib(status), Some(81234));
        assert_eq!(parse_vm_rss_kib("Name: x\n"), None, "kernel threads have no VmRSS");
        assert_eq!(parse_vm_rss_kib("VmRSS: x kB\n"), None);
    }

    #[tokio::test]
    async fn samples_this_process() {
        let pid = std::process::id();
        let sampler = RssSampler::start(pid);
        let peak = sampler.finish(pid).expect("our own RSS is readable");
        assert!(peak > 0.0);
        assert!(rss_mib(u32::MAX).is_none());
    }

    /// An HTTP server on 127.0.0.1 answering `n` requests (one per connection) with 200,
    /// returning each request's head, lowercased.
    async fn capture_http(n: usize) -> (String, tokio::task::JoinHandle<Vec<String>>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = listener.local_addr().unwrap().to_string();
        let task = tokio::spawn(async move {
            let mut heads = Vec::new();
            for _ in 0..n {
                let (mut conn, _) = listener.accept().await.unwrap();
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                let head_end = loop {
                    let read = conn.read(&mut chunk).await.unwrap();
                    assert!(read > 0, "the client closed early: {}", String::from_utf8_lossy(&buf));
                    buf.extend_from_slice(&chunk[..read]);
                    if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        break i + 4;
                    }
                };
                let head = String::from_utf8_lossy(&buf[..head_end]).to_lowercase();
                let body_len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map(|v| v.trim().parse().unwrap())
                    .unwrap_or(0);
                while buf.len() < head_end + body_len {
                    let read = conn.read(&mut chunk).await.unwrap();
                    assert!(read > 0);
                    buf.extend_from_slice(&chunk[..read]);
                }
                conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n").await.unwrap();
                heads.push(head);
            }
            heads
        });
        (url, task)
    }

    #[tokio::test]
    async fn the_api_key_goes_on_every_repository_call() {
        let (url, server) = capture_http(3).await;
        let c = RepositoryClient::new(Protocol::Http { binary: false }, &url, Duration::from_secs(5), None)
            .with_api_key(Some("k-1"))
            .unwrap();
        assert!(c.is_live().await);
        c.unload("m").await.unwrap();
        c.load("m", "{}").await.unwrap();
        let heads = server.await.unwrap();
        let lines: Vec<&str> = heads.iter().map(|h| h.lines().next().unwrap()).collect();
        assert_eq!(
            lines,
            [
                "get /v2/health/live http/1.1",
                "post /v2/repository/models/m/unload http/1.1",
                "post /v2/repository/models/m/load http/1.1"
            ]
        );
        for head in &heads {
            assert!(head.contains("\r\nauthorization: bearer k-1\r\n"), "{head}");
        }
        // Without a key, none is sent.
        let (url, server) = capture_http(1).await;
        let c = RepositoryClient::new(Protocol::Http { binary: false }, &url, Duration::from_secs(5), None)
            .with_api_key(None)
            .unwrap();
        assert!(c.is_live().await);
        assert!(!server.await.unwrap()[0].contains("authorization"));
        // A key that cannot be a header value is refused up front, for either protocol.
        for protocol in [Protocol::Grpc, Protocol::Http { binary: false }] {
            let c = RepositoryClient::new(protocol, "127.0.0.1:9", Duration::from_secs(1), None);
            let Err(e) = c.with_api_key(Some("a\nb")) else { panic!("accepted a line break") };
            assert!(e.contains("--api-key"), "{e}");
        }
    }

    #[tokio::test]
    async fn unreachable_repository_calls_say_so() {
        // Port 9 (discard) on localhost: nothing listens there in a test sandbox; if
        // something does, it is not a KServe server and the call fails either way.
        for protocol in [Protocol::Grpc, Protocol::Http { binary: false }] {
            let c = RepositoryClient::new(protocol, "127.0.0.1:9", Duration::from_secs(2), None);
            assert!(c.load("m", "{}").await.is_err());
            assert!(!c.is_live().await);
        }
    }
}
