//! The client against small real servers on 127.0.0.1 (an HTTP/1.1 server, over TLS too, and a
//! gRPC server) that answer the KServe calls nereid-perf makes for a tiny FP32 model:
//!
//! - every call carries `authorization: Bearer <key>`: the run's key on health, metadata,
//!   config and shared-memory calls, the entry's own key on inference; servers that refuse a
//!   call without it (401 / `UNAUTHENTICATED`) let a keyed run through and stop a keyless one
//!   at connect with a clear error;
//! - HTTP opens exactly `--connections` connections (TLS sessions), all before the first
//!   request, however many requests follow and however many senders wait for them, and
//!   reopens one that breaks.

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use clap::Parser;
use http::header::AUTHORIZATION;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use nereid_loadtests::cli::Args;
use nereid_loadtests::client::{Client, ClientError};
use nereid_loadtests::driver::{RunConfig, prepare};
use nereid_loadtests::measure::Failure;
use nereid_proto::inference::grpc_inference_service_server::{GrpcInferenceService, GrpcInferenceServiceServer};
use nereid_proto::inference::model_infer_response::InferOutputTensor;
use nereid_proto::inference::model_metadata_response::TensorMetadata;
use nereid_proto::inference::{
    ModelConfig, ModelConfigRequest, ModelConfigResponse, ModelInferRequest, ModelInferResponse, ModelMetadataRequest,
    ModelMetadataResponse, ServerLiveRequest, ServerLiveResponse, ServerReadyRequest, ServerReadyResponse,
    SystemSharedMemoryRegisterRequest, SystemSharedMemoryRegisterResponse, SystemSharedMemoryUnregisterRequest,
    SystemSharedMemoryUnregisterResponse,
};
use serde_json::json;

const PERF: &str = env!("CARGO_BIN_EXE_nereid-perf");
/// The run's key (`--api-key`) and a workload entry's own key.
const RUN_KEY: &str = "run-key";
const ENTRY_KEY: &str = "entry-key";
const SEND_TIMEOUT: Duration = Duration::from_secs(5);

/// What a test server saw.
#[derive(Default)]
struct Log {
    /// Accepted connections (over TLS: completed handshakes).
    connections: AtomicUsize,
    /// Each request, in arrival order: `("METHOD path" or the gRPC method, authorization)`.
    requests: Mutex<Vec<(String, Option<String>)>>,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    /// How long an inference request takes to answer, in milliseconds.
    infer_delay_ms: AtomicU64,
}

impl Log {
    fn requests(&self) -> Vec<(String, Option<String>)> {
        self.requests.lock().unwrap().clone()
    }

    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    fn count(&self, call: &str) -> usize {
        self.requests().iter().filter(|(c, _)| c == call).count()
    }

    /// Records a request; whether its authorization is one of `keys` (`None`: no auth needed).
    fn admit(&self, call: String, auth: Option<String>, keys: Option<&[&str]>) -> bool {
        let ok = match keys {
            None => true,
            Some(keys) => auth.as_deref().is_some_and(|a| keys.iter().any(|k| a == format!("Bearer {k}"))),
        };
        self.requests.lock().unwrap().push((call, auth));
        ok
    }

    async fn infer_delay(&self) {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        let ms = self.infer_delay_ms.load(Ordering::SeqCst);
        if ms > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How a test HTTP server behaves.
#[derive(Clone, Default)]
struct HttpBehavior {
    /// Keys accepted (`Bearer <key>`); `None`: no authorization needed.
    keys: Option<&'static [&'static str]>,
    /// Answer with `connection: close` (and close) after this many requests on a connection.
    close_after: Option<usize>,
}

/// A KServe v2 HTTP/1.1 server for the model `tiny` (FP32 `X` [-1, 2] → `Y` [-1, 2], batching
/// up to 8) on 127.0.0.1, over TLS with `tls`.
async fn http_server(behavior: HttpBehavior, tls: Option<rustls::ServerConfig>) -> (SocketAddr, Arc<Log>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let log = Arc::new(Log::default());
    let acceptor = tls.map(|c| tokio_rustls::TlsAcceptor::from(Arc::new(c)));
    let server_log = log.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (log, behavior, acceptor) = (server_log.clone(), behavior.clone(), acceptor.clone());
            tokio::spawn(async move {
                match acceptor {
                    None => {
                        log.connections.fetch_add(1, Ordering::SeqCst);
                        serve_http(TokioIo::new(tcp), log, behavior).await;
                    }
                    Some(acceptor) => {
                        let Ok(tls) = acceptor.accept(tcp).await else { return };
                        log.connections.fetch_add(1, Ordering::SeqCst);
                        serve_http(TokioIo::new(tls), log, behavior).await;
                    }
                }
            });
        }
    });
    (addr, log)
}

async fn serve_http<I>(io: I, log: Arc<Log>, behavior: HttpBehavior)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let served = Arc::new(AtomicUsize::new(0));
    let service = hyper::service::service_fn(move |req| {
        let n = served.fetch_add(1, Ordering::SeqCst) + 1;
        let close = behavior.close_after.is_some_and(|k| n >= k);
        answer_http(req, log.clone(), behavior.keys, close)
    });
    let _ = hyper::server::conn::http1::Builder::new().serve_connection(io, service).await;
}

async fn answer_http(
    req: Request<Incoming>,
    log: Arc<Log>,
    keys: Option<&'static [&'static str]>,
    close: bool,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let auth = req.headers().get(AUTHORIZATION).map(|v| v.to_str().unwrap_or("<not text>").to_string());
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let _body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    let (status, body) = if !log.admit(format!("{method} {path}"), auth, keys) {
        (StatusCode::UNAUTHORIZED, json!({ "error": "missing or unknown API key" }))
    } else {
        match (&method, path.as_str()) {
            (&Method::GET, "/v2/health/live") => (StatusCode::OK, json!({ "live": true })),
            (&Method::GET, "/v2/health/ready") => (StatusCode::OK, json!({ "ready": true })),
            (&Method::GET, "/v2/models/tiny") => (
                StatusCode::OK,
                json!({ "name": "tiny", "versions": ["1"], "platform": "test",
                        "inputs": [{ "name": "X", "datatype": "FP32", "shape": [-1, 2] }],
                        "outputs": [{ "name": "Y", "datatype": "FP32", "shape": [-1, 2] }] }),
            ),
            (&Method::GET, "/v2/models/tiny/config") => {
                (StatusCode::OK, json!({ "name": "tiny", "max_batch_size": 8 }))
            }
            (&Method::POST, "/v2/models/tiny/infer") => {
                log.infer_delay().await;
                let outputs = json!([{ "name": "Y", "datatype": "FP32", "shape": [1, 2], "data": [0.0, 0.0] }]);
                (StatusCode::OK, json!({ "model_name": "tiny", "outputs": outputs }))
            }
            (&Method::POST, p)
                if p.starts_with("/v2/systemsharedmemory/region/")
                    && (p.ends_with("/register") || p.ends_with("/unregister")) =>
            {
                (StatusCode::OK, json!({}))
            }
            _ => (StatusCode::NOT_FOUND, json!({ "error": "not found" })),
        }
    };
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    if close {
        response.headers_mut().insert(http::header::CONNECTION, http::HeaderValue::from_static("close"));
    }
    Ok(response)
}

/// A KServe v2 gRPC server for `tiny` that refuses (`UNAUTHENTICATED`) any call without one of
/// its keys.
struct GrpcServer {
    keys: &'static [&'static str],
    log: Arc<Log>,
}

impl GrpcServer {
    fn admit<T>(&self, call: &str, request: &tonic::Request<T>) -> Result<(), tonic::Status> {
        let auth = request.metadata().get("authorization").map(|v| v.to_str().unwrap_or("<not text>").to_string());
        if self.log.admit(call.to_string(), auth, Some(self.keys)) {
            Ok(())
        } else {
            Err(tonic::Status::unauthenticated("missing or unknown API key"))
        }
    }
}

type Answer<T> = Result<tonic::Response<T>, tonic::Status>;

#[tonic::async_trait]
impl GrpcInferenceService for GrpcServer {
    async fn server_live(&self, r: tonic::Request<ServerLiveRequest>) -> Answer<ServerLiveResponse> {
        self.admit("ServerLive", &r)?;
        Ok(tonic::Response::new(ServerLiveResponse { live: true }))
    }

    async fn server_ready(&self, r: tonic::Request<ServerReadyRequest>) -> Answer<ServerReadyResponse> {
        self.admit("ServerReady", &r)?;
        Ok(tonic::Response::new(ServerReadyResponse { ready: true }))
    }

    async fn model_metadata(&self, r: tonic::Request<ModelMetadataRequest>) -> Answer<ModelMetadataResponse> {
        self.admit("ModelMetadata", &r)?;
        let tensor = |name: &str| TensorMetadata { name: name.into(), datatype: "FP32".into(), shape: vec![-1, 2] };
        Ok(tonic::Response::new(ModelMetadataResponse {
            name: "tiny".into(),
            versions: vec!["1".into()],
            platform: "test".into(),
            inputs: vec![tensor("X")],
            outputs: vec![tensor("Y")],
        }))
    }

    async fn model_config(&self, r: tonic::Request<ModelConfigRequest>) -> Answer<ModelConfigResponse> {
        self.admit("ModelConfig", &r)?;
        let config = ModelConfig { name: "tiny".into(), max_batch_size: 8, ..Default::default() };
        Ok(tonic::Response::new(ModelConfigResponse { config: Some(config) }))
    }

    async fn model_infer(&self, r: tonic::Request<ModelInferRequest>) -> Answer<ModelInferResponse> {
        self.admit("ModelInfer", &r)?;
        let output =
            InferOutputTensor { name: "Y".into(), datatype: "FP32".into(), shape: vec![1, 2], ..Default::default() };
        Ok(tonic::Response::new(ModelInferResponse {
            model_name: "tiny".into(),
            outputs: vec![output],
            raw_output_contents: vec![vec![0; 8].into()],
            ..Default::default()
        }))
    }

    async fn system_shared_memory_register(
        &self,
        r: tonic::Request<SystemSharedMemoryRegisterRequest>,
    ) -> Answer<SystemSharedMemoryRegisterResponse> {
        self.admit("SystemSharedMemoryRegister", &r)?;
        Ok(tonic::Response::new(SystemSharedMemoryRegisterResponse {}))
    }

    async fn system_shared_memory_unregister(
        &self,
        r: tonic::Request<SystemSharedMemoryUnregisterRequest>,
    ) -> Answer<SystemSharedMemoryUnregisterResponse> {
        self.admit("SystemSharedMemoryUnregister", &r)?;
        Ok(tonic::Response::new(SystemSharedMemoryUnregisterResponse {}))
    }
}

async fn grpc_server(keys: &'static [&'static str]) -> (SocketAddr, Arc<Log>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let log = Arc::new(Log::default());
    let service = GrpcInferenceServiceServer::new(GrpcServer { keys, log: log.clone() });
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    (addr, log)
}

/// A run's configuration from nereid-perf flags.
fn config(args: &[&str]) -> RunConfig {
    let argv = std::iter::once("nereid-perf").chain(args.iter().copied());
    Args::try_parse_from(argv).unwrap().into_config().unwrap()
}

/// A workload file of one entry for `tiny` with its own key.
fn entry_with_own_key(dir: &Path) -> String {
    let path = dir.join("workload.json");
    let workload = json!({ "entries": [{ "model": "tiny", "api_key": ENTRY_KEY }] });
    std::fs::write(&path, workload.to_string()).unwrap();
    path.display().to_string()
}

/// Connects with the run's key, prepares the workload (metadata, config, shared-memory
/// registration), sends `n` inference requests, checks liveness and unregisters.
async fn keyed_session(config: &RunConfig, n: usize) {
    let client = match Client::connect_with_key(&config.target, Some(RUN_KEY)).await {
        Ok(c) => c,
        Err(e) => panic!("connect with the key: {e}"),
    };
    let prepared = match prepare(&client, config).await {
        Ok(p) => p,
        Err(e) => panic!("prepare with the key: {e}"),
    };
    let mut lane = client.lane(0);
    for _ in 0..n {
        lane.send(&prepared.requests[0].variants()[0], SEND_TIMEOUT).await.unwrap();
    }
    assert!(client.is_live().await);
    let shm = prepared.shm.expect("--shared-memory system");
    assert_eq!(shm.release(&client).await, Vec::<String>::new());
}

/// Every request the server saw carried a key: the entry's on `inference`, the run's on
/// everything else; and each of `calls` was made.
fn assert_keys(log: &Log, inference: &str, calls: &[&str]) {
    let seen = log.requests();
    for (call, auth) in &seen {
        let key = if call == inference { ENTRY_KEY } else { RUN_KEY };
        assert_eq!(auth.as_deref(), Some(format!("Bearer {key}").as_str()), "{call} in {seen:?}");
    }
    for call in calls {
        assert!(seen.iter().any(|(c, _)| c.starts_with(call)), "no {call} in {seen:?}");
    }
}

/// The error of a connect that must fail.
async fn connect_error(config: &RunConfig, key: Option<&str>) -> ClientError {
    match Client::connect_with_key(&config.target, key).await {
        Ok(_) => panic!("connected with key {key:?}"),
        Err(e) => e,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_calls_all_carry_the_key_and_a_keyless_run_is_refused_clearly() {
    let (addr, log) = http_server(HttpBehavior { keys: Some(&[RUN_KEY, ENTRY_KEY]), close_after: None }, None).await;
    let dir = tempfile::tempdir().unwrap();
    let workload = entry_with_own_key(dir.path());
    let url = addr.to_string();
    let args = ["--workload", &workload, "-i", "http", "-u", &url, "--api-key", RUN_KEY, "--shared-memory", "system"];
    let config = config(&args);
    keyed_session(&config, 5).await;
    let infer = "POST /v2/models/tiny/infer";
    assert_keys(&log, infer, &["GET /v2/health/live", "GET /v2/models/tiny", "GET /v2/models/tiny/config", infer]);
    assert_eq!(log.count(infer), 5);
    let shm_calls = |suffix: &str| log.requests().iter().filter(|(c, _)| c.ends_with(suffix)).count();
    assert_eq!((shm_calls("/register"), shm_calls("/unregister")), (2, 2), "{:?}", log.requests());

    let before = log.requests().len();
    let e = connect_error(&config, None).await;
    let text = e.to_string();
    assert!(matches!(e, ClientError::Unauthorized { .. }), "{text}");
    assert!(text.contains("401") && text.contains("--api-key") && text.contains("/v2/health/live"), "{text}");
    let e = connect_error(&config, Some("wrong")).await.to_string();
    assert!(e.contains("401") && e.contains("API key was refused"), "{e}");
    // Refused for want of the key (not retried), and the refusals really happened.
    let refused: Vec<_> = log.requests()[before..].to_vec();
    assert_eq!(refused.len(), 2, "{refused:?}");
    assert_eq!(refused[0].1, None);
    assert_eq!(refused[1].1.as_deref(), Some("Bearer wrong"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_all_carry_the_key_and_a_keyless_run_is_refused_clearly() {
    let (addr, log) = grpc_server(&[RUN_KEY, ENTRY_KEY]).await;
    let dir = tempfile::tempdir().unwrap();
    let workload = entry_with_own_key(dir.path());
    let url = addr.to_string();
    let args = ["--workload", &workload, "-i", "grpc", "-u", &url, "--api-key", RUN_KEY, "--shared-memory", "system"];
    let config = config(&args);
    keyed_session(&config, 5).await;
    let calls = ["ServerLive", "ModelMetadata", "ModelConfig", "ModelInfer", "SystemSharedMemoryRegister"];
    assert_keys(&log, "ModelInfer", &calls);
    assert_eq!(log.count("ModelInfer"), 5);
    assert_eq!((log.count("SystemSharedMemoryRegister"), log.count("SystemSharedMemoryUnregister")), (2, 2));

    let before = log.requests().len();
    let e = connect_error(&config, None).await;
    let text = e.to_string();
    assert!(matches!(e, ClientError::Unauthorized { .. }), "{text}");
    assert!(text.contains("ServerLive") && text.contains("Unauthenticated") && text.contains("--api-key"), "{text}");
    let e = connect_error(&config, Some("wrong")).await.to_string();
    assert!(e.contains("Unauthenticated") && e.contains("API key was refused"), "{e}");
    let refused: Vec<_> = log.requests()[before..].to_vec();
    assert_eq!(refused.len(), 2, "{refused:?}");
    assert_eq!(refused[0].1, None);
    assert_eq!(refused[1].1.as_deref(), Some("Bearer wrong"));
}

/// Runs nereid-perf against `url` for two short windows, 8 closed-loop senders over
/// `--connections 3`; `extra` flags appended.
async fn perf_over_three_connections(url: &str, extra: &[&str]) -> common::Output {
    let mut cmd = Command::new(PERF);
    cmd.args(["-m", "tiny", "-i", "http", "-u", url, "--connections", "3", "--concurrency-range", "8"])
        .args(["-p", "200", "-r", "2", "-s", "1000", "--warmup-ms", "0", "--no-server-stats", "-q"])
        .args(extra)
        .env_remove("NEREID_API_KEY");
    let run =
        tokio::task::spawn_blocking(move || common::run_bounded(cmd, "nereid-perf", Duration::from_secs(60), || {}));
    let out = run.await.unwrap();
    assert_eq!(out.status.code(), Some(0), "stdout:\n{}\nstderr:\n{}", out.stdout, out.stderr);
    out
}

fn assert_three_connections_carried_it_all(log: &Log) {
    let infers = log.count("POST /v2/models/tiny/infer");
    assert!(infers >= 30, "only {infers} requests");
    assert_eq!(log.connections(), 3, "{infers} requests over {} connections", log.connections());
    // 8 senders share 3 connections: at most 3 requests at the server at once, and it got 3.
    assert_eq!(log.max_in_flight.load(Ordering::SeqCst), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_run_opens_exactly_its_connections_whatever_the_concurrency() {
    let (addr, log) = http_server(HttpBehavior::default(), None).await;
    log.infer_delay_ms.store(2, Ordering::SeqCst);
    perf_over_three_connections(&addr.to_string(), &[]).await;
    assert_three_connections_carried_it_all(&log);

    // Over TLS: three handshakes for the whole run.
    let dir = tempfile::tempdir().unwrap();
    let pki = common::TestPki::new(dir.path());
    let (addr, log) = http_server(HttpBehavior::default(), Some(pki.server_config(false))).await;
    log.infer_delay_ms.store(2, Ordering::SeqCst);
    let url = format!("https://localhost:{}", addr.port());
    perf_over_three_connections(&url, &["--ssl-ca", pki.ca.to_str().unwrap()]).await;
    assert_three_connections_carried_it_all(&log);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_connections_are_open_before_the_first_request_and_reopened_when_they_break() {
    // Opened up front: after connect (one health check), all 4 are open.
    let (addr, log) = http_server(HttpBehavior::default(), None).await;
    let url = addr.to_string();
    let config = config(&["-m", "tiny", "-i", "http", "-u", &url, "--connections", "4"]);
    let Ok(client) = Client::connect(&config.target).await else { panic!("connect") };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while log.connections() < 4 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!((log.connections(), log.requests().len()), (4, 1));

    // A request abandoned at its timeout closes its connection; the next request on that
    // slot opens a new one, and nothing else does.
    let prepared = prepare(&client, &config).await.unwrap_or_else(|e| panic!("{e}"));
    let request = &prepared.requests[0].variants()[0];
    let mut lanes: Vec<_> = (0..4).map(|i| client.lane(i)).collect();
    for lane in &mut lanes {
        lane.send(request, SEND_TIMEOUT).await.unwrap();
    }
    assert_eq!(log.connections(), 4);
    log.infer_delay_ms.store(2_000, Ordering::SeqCst);
    assert_eq!(lanes[0].send(request, Duration::from_millis(100)).await, Err(Failure::Timeout));
    log.infer_delay_ms.store(0, Ordering::SeqCst);
    let sends = lanes.iter_mut().map(|lane| lane.send(request, SEND_TIMEOUT));
    for result in futures::future::join_all(sends).await {
        result.unwrap();
    }
    assert_eq!(log.connections(), 5);

    // A server that closes each connection after 3 requests: every request still succeeds.
    let (addr, log) = http_server(HttpBehavior { keys: None, close_after: Some(3) }, None).await;
    let url = addr.to_string();
    let config = crate::config(&["-m", "tiny", "-i", "http", "-u", &url, "--connections", "2"]);
    let Ok(client) = Client::connect(&config.target).await else { panic!("connect") };
    let prepared = prepare(&client, &config).await.unwrap_or_else(|e| panic!("{e}"));
    let request = &prepared.requests[0].variants()[0];
    let sends = (0..4).map(|i| {
        let mut lane = client.lane(i);
        async move {
            for _ in 0..10 {
                lane.send(request, SEND_TIMEOUT).await.unwrap();
            }
        }
    });
    futures::future::join_all(sends).await;
    assert_eq!(log.count("POST /v2/models/tiny/infer"), 40);
    // 43 requests, 3 per connection.
    assert!(log.connections() >= 15, "{} connections", log.connections());
}

/// The `nereid-perf` binary with `--api-key`: every call of a whole run carries the key, over
/// HTTP and gRPC; without it the run stops at start with exit 2, naming the flag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn perf_runs_carry_the_api_key_on_every_call() {
    let (http, http_log) = http_server(HttpBehavior { keys: Some(&[RUN_KEY]), close_after: None }, None).await;
    let (grpc, grpc_log) = grpc_server(&[RUN_KEY]).await;
    for (protocol, addr, log, infer) in
        [("http", http, &http_log, "POST /v2/models/tiny/infer"), ("grpc", grpc, &grpc_log, "ModelInfer")]
    {
        let url = addr.to_string();
        let run = |key: Option<&'static str>| {
            let mut cmd = Command::new(PERF);
            cmd.args(["-m", "tiny", "-i", protocol, "-u", &url, "--concurrency-range", "2"])
                .args(["-p", "200", "-r", "2", "-s", "1000", "--warmup-ms", "0", "--no-server-stats", "-q"])
                .env_remove("NEREID_API_KEY");
            if let Some(k) = key {
                cmd.args(["--api-key", k]);
            }
            tokio::task::spawn_blocking(move || common::run_bounded(cmd, "nereid-perf", Duration::from_secs(60), || {}))
        };
        let out = run(Some(RUN_KEY)).await.unwrap();
        assert_eq!(out.status.code(), Some(0), "{protocol}: stdout:\n{}\nstderr:\n{}", out.stdout, out.stderr);
        let seen = log.requests();
        assert!(log.count(infer) >= 10, "{protocol}: {seen:?}");
        let want = format!("Bearer {RUN_KEY}");
        assert!(seen.iter().all(|(_, auth)| auth.as_deref() == Some(want.as_str())), "{protocol}: {seen:?}");

        let out = run(None).await.unwrap();
        assert_eq!(out.status.code(), Some(2), "{protocol}: stdout:\n{}\nstderr:\n{}", out.stdout, out.stderr);
        assert!(out.stderr.contains("--api-key"), "{protocol}: {}", out.stderr);
    }
}

/// A server whose inference hangs but whose health endpoint answers is slow, not gone: the
/// liveness check made when a window's requests all fail goes over a connection of its own,
/// not behind the hung requests holding every pooled connection, so the run ends with "no
/// request succeeded" (exit 5), not "server lost" (exit 3). Open and closed loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_server_that_answers_health_is_not_reported_lost() {
    let (addr, log) = http_server(HttpBehavior::default(), None).await;
    log.infer_delay_ms.store(30_000, Ordering::SeqCst);
    let url = addr.to_string();
    for load in [["--concurrency-range", "4"], ["--request-rate-range", "200"]] {
        let mut cmd = Command::new(PERF);
        cmd.args(["-m", "tiny", "-i", "http", "-u", &url, "--connections", "2"])
            .args(load)
            .args(["-p", "300", "-r", "1", "--warmup-ms", "0", "--request-timeout-ms", "200", "--no-server-stats"])
            .env_remove("NEREID_API_KEY");
        let run = tokio::task::spawn_blocking(move || {
            common::run_bounded(cmd, "nereid-perf", Duration::from_secs(60), || {})
        });
        let out = run.await.unwrap();
        assert_eq!(out.status.code(), Some(5), "{load:?}: stdout:\n{}\nstderr:\n{}", out.stdout, out.stderr);
        assert!(!out.stdout.contains("server was lost"), "{load:?}: {}", out.stdout);
    }
    // Per run: one at connect, then at least one liveness probe once a window failed whole.
    assert!(log.count("GET /v2/health/live") >= 4, "the liveness checks were made: {:?}", log.requests());
}
