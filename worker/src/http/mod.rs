//! KServe v2 / Triton HTTP front end: translates HTTP requests into [`Server`] calls and renders
//! the results the way Triton's HTTP endpoint does (same paths, JSON shapes, status codes and
//! binary tensor extension), so `tritonclient.http` and `perf_analyzer` work unchanged.
//!
//! Every error response is `{"error": "..."}` with the status of its [`nereid_common::Code`].
//! Health and readiness answer 200 / 400 with an empty body, as Triton does.
//! Request bodies may be gzip / deflate compressed (`Content-Encoding`; the request limit
//! applies to the inflated size), and infer responses are compressed for clients that send
//! `Accept-Encoding: gzip|deflate`, as Triton does.

pub mod infer;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{DefaultBodyLimit, FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Json, Router};
use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::{Frame, SizeHint};
use nereid_common::config::config_to_json;
use nereid_common::{DataType, Status};
use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;

pub use self::infer::{
    HEADER_CONTENT_LENGTH, OutputFormat, ParsedInfer, RenderedResponse, fmt_shape, parse_infer_request,
    parse_raw_binary_request, render_infer_response,
};
use crate::server::{self, IndexEntry, ModelMetadata, ModelStats, SERVER_VERSION, Server, parse_version};
use crate::shm::RegionStatus;

/// JSON parts (request or response) larger than this are parsed / rendered on the blocking
/// pool instead of the async worker threads.
const OFFLOAD_JSON_BYTES: usize = 256 << 10;

/// A binary-extension request whose binary part is larger than this is parsed on the blocking
/// pool too: a BYTES input's elements are walked there (16 million empty ones in 64 MiB, tens
/// of milliseconds). Below it, the walk takes about a millisecond at most.
const OFFLOAD_BINARY_BYTES: usize = 4 << 20;

/// The KServe v2 HTTP API of `server`.
pub fn router(server: Server) -> Router {
    let limit = server.limits.max_request_bytes;
    Router::new()
        .route("/v2", get(server_metadata))
        .route("/v2/health/live", get(health_live))
        .route("/v2/health/ready", get(health_ready))
        .route("/v2/models/stats", get(all_model_stats))
        .route("/v2/models/{model}", get(model_metadata))
        .route("/v2/models/{model}/versions/{version}", get(model_metadata))
        .route("/v2/models/{model}/ready", get(model_ready))
        .route("/v2/models/{model}/versions/{version}/ready", get(model_ready))
        .route("/v2/models/{model}/config", get(model_config))
        .route("/v2/models/{model}/versions/{version}/config", get(model_config))
        .route("/v2/models/{model}/stats", get(model_stats))
        .route("/v2/models/{model}/versions/{version}/stats", get(model_stats))
        .route("/v2/models/{model}/infer", post(infer))
        .route("/v2/models/{model}/versions/{version}/infer", post(infer))
        .route("/v2/repository/index", post(repository_index))
        .route("/v2/repository/models/{model}/load", post(load_model))
        .route("/v2/repository/models/{model}/unload", post(unload_model))
        .route("/v2/systemsharedmemory/status", get(shm_status_all))
        .route("/v2/systemsharedmemory/region/{region}/status", get(shm_status_one))
        .route("/v2/systemsharedmemory/region/{region}/register", post(shm_register))
        .route("/v2/systemsharedmemory/unregister", post(shm_unregister_all))
        .route("/v2/systemsharedmemory/region/{region}/unregister", post(shm_unregister_one))
        .route("/v2/cudasharedmemory/status", get(cuda_shm_status_all))
        .route("/v2/cudasharedmemory/region/{region}/status", get(cuda_shm_status_one))
        .route("/v2/cudasharedmemory/region/{region}/register", post(cuda_shm_register))
        .route("/v2/cudasharedmemory/unregister", post(cuda_shm_unregister))
        .route("/v2/cudasharedmemory/region/{region}/unregister", post(cuda_shm_unregister))
        .route("/v2/cudasharedmemory/{*rest}", any(cuda_shm))
        .route("/v2/logging", get(get_logging).post(post_logging))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(server)
}

/// `router` with `rules` applied (`--http-restricted-api`): a request to a restricted API
/// without the group's header and value is answered 403 before any handler runs.
pub fn restricted(router: Router, rules: std::sync::Arc<crate::restrict::Restrictions>) -> Router {
    if rules.is_empty() {
        return router;
    }
    router.layer(axum::middleware::from_fn(move |request: axum::extract::Request, next: axum::middleware::Next| {
        let refusal =
            rules.refusal(crate::restrict::Api::of_http(request.method(), request.uri().path()), request.headers());
        async move {
            match refusal {
                Some(message) => (StatusCode::FORBIDDEN, Json(json!({ "error": message }))).into_response(),
                None => next.run(request).await,
            }
        }
    }))
}

/// `GET /metrics`: the Prometheus text exposition (served on its own port, as Triton does).
pub fn metrics_router(server: Server) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(server)
}

/// How long a client has to send a request's head (HTTP/1: request line and headers) on a
/// connection it opened or kept alive: one that sends nothing, or trickles its headers in, is
/// closed then instead of holding its connection (a descriptor, a task) for ever. It is also
/// the idle timeout of a kept-alive connection (hyper starts the clock when it waits for the
/// next request): generous, as load balancers' idle timeouts go (nginx 75 s, AWS 60 s), so
/// that a client's pooled connection is rarely closed under it.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(300);

/// How long a request body may go without a byte arriving before it is refused (504, as a
/// deadline that passed while the gateway waited for a body): a
/// client that stalled mid-upload, or a peer that vanished without a FIN, frees its buffer.
pub const BODY_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a connection closed for silence (see [`serve`]) has to go after it was told to:
/// an HTTP/2 GOAWAY and the close. Past it the socket is dropped.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// Pause after a failed accept that is not one connection's own failure (out of descriptors):
/// the loop would otherwise spin on it (and log it) until descriptors are freed.
const ACCEPT_BACKOFF: Duration = Duration::from_secs(1);

/// HTTP/2 connections are pinged after this long without a frame, and closed when no answer
/// comes within [`H2_KEEPALIVE_TIMEOUT`]: a peer that vanished without a FIN frees its
/// connection. (An idle HTTP/2 client that answers pings keeps it, as pooled clients do.)
const H2_KEEPALIVE_INTERVAL: Duration = Duration::from_secs(60);
const H2_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// Serves `router` on `listener` (HTTP/1.1 with keep-alive, and HTTP/2) until `shutdown` is
/// cancelled, then finishes the requests in flight and returns. A connection whose first
/// request head has not arrived within [`HEADER_READ_TIMEOUT`] (it sent nothing, or part of
/// the HTTP/2 preface or of a head) is closed, as is an HTTP/1 one idle that long between
/// requests, and an HTTP/2 one whose peer stops answering pings.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
    use hyper_util::server::conn::auto;
    use hyper_util::service::TowerToHyperService;
    use tower::ServiceExt as _;

    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(HEADER_READ_TIMEOUT);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(H2_KEEPALIVE_INTERVAL)
        .keep_alive_timeout(H2_KEEPALIVE_TIMEOUT);
    let connections = tokio_util::task::TaskTracker::new();
    loop {
        let tcp = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                // One connection's failure (reset before it was accepted): the next one.
                Err(e) if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionAborted
                        | std::io::ErrorKind::ConnectionReset
                        | std::io::ErrorKind::ConnectionRefused
                ) => continue,
                Err(e) => {
                    tracing::warn!("accepting an HTTP connection failed: {e}");
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = tokio::time::sleep(ACCEPT_BACKOFF) => continue,
                    }
                }
            },
        };
        // Small request/response pairs on kept-alive connections: Nagle's algorithm would add
        // delayed-ACK latency to every response written in more than one segment.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!("set_nodelay failed: {e}");
        }
        // Until its first request arrives, nothing bounds a connection's wait: hyper reads the
        // first bytes to pick HTTP/1 or HTTP/2 with no clock, and its head timeout starts only
        // once HTTP/1 is picked. One that has sent no whole request head when the head timeout
        // passes (nothing, part of the HTTP/2 preface, part of a head; or an HTTP/2 client
        // that opened a connection and never used it) is closed — gracefully (an HTTP/2 GOAWAY
        // tells its client no request was taken), then at once if that does not end it within
        // CLOSE_GRACE; from its first request on, hyper's own timeouts hold.
        let spoke = Arc::new(AtomicBool::new(false));
        let first_request = spoke.clone();
        let service = TowerToHyperService::new(router.clone().map_request(
            move |request: http::Request<hyper::body::Incoming>| {
                first_request.store(true, Ordering::Relaxed);
                request.map(Body::new)
            },
        ));
        let connection = builder.serve_connection(TokioIo::new(tcp), service).into_owned();
        let stop = shutdown.clone();
        connections.spawn(async move {
            tokio::pin!(connection);
            let first_request_by = tokio::time::sleep(HEADER_READ_TIMEOUT);
            tokio::pin!(first_request_by);
            let (mut waiting_first, mut stopping) = (true, false);
            // When a connection closed for silence must be gone by.
            let mut gone_by: Option<tokio::time::Instant> = None;
            loop {
                let deadline = gone_by.unwrap_or_else(tokio::time::Instant::now);
                tokio::select! {
                    _ = &mut connection => return,
                    _ = &mut first_request_by, if waiting_first => {
                        waiting_first = false;
                        // A first request that began in time is served on, under hyper's timeouts.
                        if !spoke.load(Ordering::Relaxed) {
                            connection.as_mut().graceful_shutdown();
                            gone_by = Some(tokio::time::Instant::now() + CLOSE_GRACE);
                        }
                    }
                    // Shutdown: its requests finish (the caller bounds the wait).
                    _ = stop.cancelled(), if !stopping => {
                        stopping = true;
                        connection.as_mut().graceful_shutdown();
                    }
                    _ = tokio::time::sleep_until(deadline), if gone_by.is_some() => return,
                }
            }
        });
    }
    // No new connections; those open finish their requests (idle ones close at once).
    drop(listener);
    connections.close();
    connections.wait().await;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Errors.
// ---------------------------------------------------------------------------------------------

/// A [`Status`] as an HTTP response: its code's HTTP status and `{"error": "..."}`.
#[derive(Debug)]
pub struct ApiError(pub Status);

impl From<Status> for ApiError {
    fn from(s: Status) -> Self {
        ApiError(s)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        error_response(self.0.code.http_status(), &self.0)
    }
}

fn error_response(code: StatusCode, status: &Status) -> Response {
    if code.is_server_error() {
        tracing::warn!(status = code.as_u16(), "{}", status.message);
    } else {
        tracing::debug!(status = code.as_u16(), "{}", status.message);
    }
    (code, [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))], status.json_body()).into_response()
}

async fn not_found(uri: Uri) -> ApiError {
    ApiError(Status::not_found(format!("no endpoint at '{}'", uri.path())))
}

/// 405 (no [`nereid_common::Code`] maps to it), still with the JSON error body.
async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    let status = Status::invalid(format!("method {method} is not allowed for '{}'", uri.path()));
    error_response(StatusCode::METHOD_NOT_ALLOWED, &status)
}

// ---------------------------------------------------------------------------------------------
// Extractors and body reading.
// ---------------------------------------------------------------------------------------------

/// The `{model}` and optional `{version}` path segments.
struct ModelRef {
    name: String,
    version: Option<i64>,
}

impl<S: Send + Sync> FromRequestParts<S> for ModelRef {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let Path(params) = Path::<Vec<(String, String)>>::from_request_parts(parts, state)
            .await
            .map_err(|e| ApiError(Status::invalid(e.body_text())))?;
        let mut name = String::new();
        let mut version = String::new();
        for (key, value) in params {
            match key.as_str() {
                "model" => name = value,
                "version" => version = value,
                _ => {}
            }
        }
        let version = parse_version(&name, &version)?;
        Ok(ModelRef { name, version })
    }
}

/// The one path segment a route names (a model to load, a shared-memory region). One that
/// does not decode (not UTF-8) is answered in JSON, as every other error is: tritonclient
/// reads the error from the body.
struct Segment(String);

impl<S: Send + Sync> FromRequestParts<S> for Segment {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        let Path(value) = Path::<String>::from_request_parts(parts, state)
            .await
            .map_err(|e| ApiError(Status::invalid(e.body_text())))?;
        Ok(Segment(value))
    }
}

/// A `Content-Encoding` the HTTP front end reads (request bodies) and writes (infer responses
/// to clients that send `Accept-Encoding`), as tritonserver does. `deflate` is the zlib format
/// (RFC 9110 §8.4.1.2), which is what tritonclient's `"deflate"` sends (`zlib.compress`) and
/// expects back (`zlib.decompress`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Coding {
    Gzip,
    Deflate,
}

impl Coding {
    pub(crate) fn from_name(name: &str) -> Option<Coding> {
        if name.eq_ignore_ascii_case("gzip") || name.eq_ignore_ascii_case("x-gzip") {
            Some(Coding::Gzip)
        } else if name.eq_ignore_ascii_case("deflate") {
            Some(Coding::Deflate)
        } else {
            None
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Coding::Gzip => "gzip",
            Coding::Deflate => "deflate",
        }
    }
}

/// Compressed request bodies larger than this are inflated on the blocking pool. Decided on the
/// compressed size (the inflated one is known only after): deflate expands at most ~1032:1, so
/// a body inflated inline stays near a megabyte — a 62 KB gzip of zeros is 64 MB, too long to
/// inflate on a thread serving every connection.
pub(crate) const OFFLOAD_INFLATE_BYTES: usize = 1 << 10;

/// The most a request body that is only a few settings may take (repository index and unload,
/// shared-memory registration, log settings), inflated or not: such a request holds no tensors,
/// so it does not get --max-request-bytes to fill.
pub const SMALL_BODY_BYTES: usize = 64 << 10;

/// [`SMALL_BODY_BYTES`], or the request limit where that is lower.
fn small_body_limit(server: &Server) -> usize {
    SMALL_BODY_BYTES.min(server.limits.max_request_bytes)
}

/// Inflating reads at most this much at a time, and stops between reads once its request is gone.
const INFLATE_CHUNK_BYTES: usize = 1 << 20;

/// Infer responses are compressed (when the client accepts it) only above this size.
const COMPRESS_MIN_BYTES: usize = 1 << 10;

/// The request body's `Content-Encoding`: `None` for none / `identity`; 501 for one that is
/// not understood.
fn request_coding(headers: &HeaderMap) -> Result<Option<Coding>, Status> {
    let Some(v) = headers.get(header::CONTENT_ENCODING) else {
        return Ok(None);
    };
    let v = v.to_str().unwrap_or("?").trim();
    if v.is_empty() || v.eq_ignore_ascii_case("identity") {
        return Ok(None);
    }
    Coding::from_name(v).map(Some).ok_or_else(|| {
        Status::unimplemented(format!(
            "Content-Encoding '{v}' is not supported; send the request uncompressed, or as gzip or deflate"
        ))
    })
}

/// The coding to compress an infer response with, from `Accept-Encoding`: the accepted one
/// (q > 0) of gzip and deflate with the highest q, gzip on a tie; `None` when neither is named.
pub fn response_coding(headers: &HeaderMap) -> Option<Coding> {
    let mut best: Option<(Coding, f32)> = None;
    for value in headers.get_all(header::ACCEPT_ENCODING) {
        let Ok(value) = value.to_str() else {
            continue;
        };
        for item in value.split(',') {
            let mut params = item.split(';');
            let Some(coding) = Coding::from_name(params.next().unwrap_or("").trim()) else {
                continue;
            };
            let mut q = 1.0f32;
            for p in params {
                let (key, val) = p.split_once('=').unwrap_or((p, ""));
                if key.trim().eq_ignore_ascii_case("q") {
                    q = val.trim().parse().unwrap_or(0.0);
                }
            }
            let better = match best {
                None => true,
                Some((b, bq)) => q > bq || (q == bq && coding == Coding::Gzip && b != Coding::Gzip),
            };
            if q > 0.0 && better {
                best = Some((coding, q));
            }
        }
    }
    best.map(|(c, _)| c)
}

/// Reads a request body into one buffer, refusing (before reading it) a declared
/// `Content-Length` over `max` and stopping as soon as the bytes received pass `max`.
/// A body that arrives in one chunk is returned as that chunk, without copying.
///
/// A `gzip` or `deflate` body (`Content-Encoding`) is inflated, and `max` then bounds the
/// inflated size too: inflation stops (400) as soon as it would pass `max`, so a small body
/// that expands hugely never takes more than `max` bytes of memory.
pub async fn read_body(headers: &HeaderMap, body: Body, max: usize) -> Result<Bytes, Status> {
    let coding = request_coding(headers)?;
    let raw = read_raw_body(headers, body, max).await?;
    match coding {
        Some(coding) if !raw.is_empty() => {
            // A request that goes away (this future dropped: the client disconnected, or its
            // deadline passed) stops its inflating too, rather than leave a detached task to
            // inflate up to `max` bytes for nobody.
            let gone = CancelOnDrop::default();
            let cancelled = gone.0.clone();
            let heavy = raw.len() > OFFLOAD_INFLATE_BYTES;
            // Offloaded inflations are few at a time (each may grow to `max`), the permit
            // held until the blocking task itself ends.
            let permit = if heavy { Some(inflation_permit().await) } else { None };
            maybe_offload(heavy, move || {
                let _permit = permit;
                inflate(coding, &raw, max, &cancelled).map(Bytes::from)
            })
            .await
        }
        _ => Ok(raw),
    }
}

/// A place among the inflations running on the blocking pool at once, HTTP bodies and gRPC
/// messages together: one per CPU (at least two). Each may grow its output to the request
/// limit, so without a bound many small compressed uploads at once would take that much
/// memory each (and hold the pool the conversions and loads also run on).
pub(crate) async fn inflation_permit() -> tokio::sync::OwnedSemaphorePermit {
    static PERMITS: std::sync::LazyLock<std::sync::Arc<tokio::sync::Semaphore>> =
        std::sync::LazyLock::new(|| std::sync::Arc::new(tokio::sync::Semaphore::new(inflation_permits())));
    PERMITS.clone().acquire_owned().await.expect("the inflation semaphore is never closed")
}

/// How many inflations run at once (see [`inflation_permit`]).
pub(crate) fn inflation_permits() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get()).max(2)
}

/// Sets its flag when dropped.
#[derive(Default)]
pub(crate) struct CancelOnDrop(pub(crate) std::sync::Arc<AtomicBool>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

async fn read_raw_body(headers: &HeaderMap, mut body: Body, max: usize) -> Result<Bytes, Status> {
    let declared =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.trim().parse::<u64>().ok());
    if let Some(n) = declared
        && n > max as u64
    {
        return Err(Status::invalid(format!("request body of {n} bytes exceeds the limit of {max} bytes")));
    }

    let mut first: Option<Bytes> = None;
    let mut buf = BytesMut::new();
    loop {
        let Ok(frame) = tokio::time::timeout(BODY_IDLE_TIMEOUT, body.frame()).await else {
            let secs = BODY_IDLE_TIMEOUT.as_secs();
            return Err(Status::new(
                nereid_common::Code::DeadlineExceeded,
                format!("no byte of the request body arrived for {secs} s: the upload stalled"),
            ));
        };
        let Some(frame) = frame else { break };
        let frame = frame.map_err(|e| Status::invalid(format!("failed to read the request body: {e}")))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if data.is_empty() {
            continue;
        }
        let received = first.as_ref().map_or(0, Bytes::len) + buf.len() + data.len();
        if received > max {
            return Err(Status::invalid(format!("request body exceeds the limit of {max} bytes")));
        }
        match first.take() {
            None if buf.is_empty() => first = Some(data),
            Some(f) => {
                buf.reserve(declared.map_or(received, |n| (n as usize).max(received)));
                buf.extend_from_slice(&f);
                buf.extend_from_slice(&data);
            }
            None => buf.extend_from_slice(&data),
        }
    }
    Ok(first.unwrap_or_else(|| buf.freeze()))
}

/// Inflates a `coding` body, failing as soon as the output would pass `max` bytes.
/// `deflate` is the zlib format; a raw deflate stream (no zlib header, as some clients send)
/// is accepted too.
fn inflate(coding: Coding, data: &[u8], max: usize, cancelled: &AtomicBool) -> Result<Vec<u8>, Status> {
    match inflate_bounded(coding, data, max, cancelled) {
        Ok(Some(out)) => Ok(out),
        Ok(None) => Err(Status::invalid(format!(
            "decompressed ({}) request body exceeds the limit of {max} bytes",
            coding.name()
        ))),
        Err(e) => Err(Status::invalid(format!("failed to decompress the {} request body: {e}", coding.name()))),
    }
}

/// `data` inflated, failing as soon as the output would pass `max` bytes (`None`), and between
/// two reads of [`INFLATE_CHUNK_BYTES`] once `cancelled` is set. `deflate` is the zlib format; a
/// raw deflate stream (no zlib header) is accepted too.
fn inflate_bounded(
    coding: Coding,
    data: &[u8],
    max: usize,
    cancelled: &AtomicBool,
) -> std::io::Result<Option<Vec<u8>>> {
    use flate2::bufread::{DeflateDecoder, MultiGzDecoder, ZlibDecoder};
    match coding {
        Coding::Gzip => read_bounded(MultiGzDecoder::new(data), data.len(), max, cancelled),
        Coding::Deflate if has_zlib_header(data) => read_bounded(ZlibDecoder::new(data), data.len(), max, cancelled),
        Coding::Deflate => read_bounded(DeflateDecoder::new(data), data.len(), max, cancelled),
    }
}

/// Whether `data` starts with a zlib header (RFC 1950): deflate method, a window of at most
/// 32 KiB, and a header checksum that holds.
fn has_zlib_header(data: &[u8]) -> bool {
    match data {
        [cmf, flg, ..] => cmf & 0x0f == 8 && cmf >> 4 <= 7 && ((*cmf as u16) << 8 | *flg as u16).is_multiple_of(31),
        _ => false,
    }
}

/// Reads `reader` to its end into a buffer that never grows past `max + 1` bytes; `None` when
/// there are more than `max` bytes (reading stops there). Reads [`INFLATE_CHUNK_BYTES`] at a
/// time, and fails between two once `cancelled` is set.
pub(crate) fn read_bounded(
    mut reader: impl std::io::Read,
    compressed_len: usize,
    max: usize,
    cancelled: &AtomicBool,
) -> std::io::Result<Option<Vec<u8>>> {
    let cap = max.saturating_add(1);
    let mut buf = vec![0u8; compressed_len.saturating_mul(4).max(16 << 10).min(cap)];
    let mut filled = 0;
    loop {
        if filled == buf.len() {
            if buf.len() >= cap {
                return Ok(None);
            }
            let grown = buf.len().saturating_mul(2).min(cap);
            buf.reserve_exact(grown - buf.len());
            buf.resize(grown, 0);
        }
        if cancelled.load(Ordering::Relaxed) {
            return Err(std::io::Error::other("the request went away"));
        }
        let end = filled.saturating_add(INFLATE_CHUNK_BYTES).min(buf.len());
        match reader.read(&mut buf[filled..end]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    if filled > max {
        return Ok(None);
    }
    buf.truncate(filled);
    Ok(Some(buf))
}

/// Compresses `parts` (in order) as one `coding` stream.
fn deflate_parts<'a>(
    coding: Coding,
    parts: impl IntoIterator<Item = &'a [u8]>,
    total: usize,
) -> std::io::Result<Vec<u8>> {
    use flate2::Compression;
    use flate2::write::{GzEncoder, ZlibEncoder};
    use std::io::Write;
    // Level 1: most of the size gain of the default level at a fraction of its CPU time, in
    // the request's latency path.
    let out = Vec::with_capacity(total / 2 + 64);
    match coding {
        Coding::Gzip => {
            let mut e = GzEncoder::new(out, Compression::fast());
            for p in parts {
                e.write_all(p)?;
            }
            e.finish()
        }
        Coding::Deflate => {
            let mut e = ZlibEncoder::new(out, Compression::fast());
            for p in parts {
                e.write_all(p)?;
            }
            e.finish()
        }
    }
}

fn inference_header_length(headers: &HeaderMap) -> Result<Option<usize>, Status> {
    let Some(v) = headers.get(HEADER_CONTENT_LENGTH) else {
        return Ok(None);
    };
    v.to_str().ok().and_then(|s| s.trim().parse::<usize>().ok()).map(Some).ok_or_else(|| {
        Status::invalid(format!("Inference-Header-Content-Length must be a non-negative integer, got {v:?}"))
    })
}

/// Runs `f` on the blocking pool when `heavy`, inline otherwise.
async fn maybe_offload<T: Send + 'static>(
    heavy: bool,
    f: impl FnOnce() -> Result<T, Status> + Send + 'static,
) -> Result<T, Status> {
    if heavy {
        tokio::task::spawn_blocking(f)
            .await
            .map_err(|e| Status::internal(format!("request conversion task failed: {e}")))?
    } else {
        f()
    }
}

// ---------------------------------------------------------------------------------------------
// Handlers.
// ---------------------------------------------------------------------------------------------

fn ok_or_400(ok: bool) -> StatusCode {
    if ok { StatusCode::OK } else { StatusCode::BAD_REQUEST }
}

async fn server_metadata(State(server): State<Server>) -> Json<Value> {
    Json(server_metadata_json(&server.name, &server.extensions()))
}

async fn health_live(State(server): State<Server>) -> StatusCode {
    ok_or_400(server.live())
}

async fn health_ready(State(server): State<Server>) -> StatusCode {
    ok_or_400(server.ready())
}

async fn model_ready(State(server): State<Server>, model: ModelRef) -> StatusCode {
    ok_or_400(server.model_ready(&model.name, model.version))
}

async fn model_metadata(State(server): State<Server>, model: ModelRef) -> Result<Json<Value>, ApiError> {
    Ok(Json(model_metadata_json(&server.model_metadata(&model.name, model.version)?)))
}

async fn model_config(State(server): State<Server>, model: ModelRef) -> Result<Json<Value>, ApiError> {
    Ok(Json(config_to_json(&server.model_config(&model.name, model.version)?)))
}

async fn model_stats(State(server): State<Server>, model: ModelRef) -> Result<Json<Value>, ApiError> {
    Ok(Json(stats_json(&server.model_statistics(Some(&model.name), model.version)?)))
}

async fn all_model_stats(State(server): State<Server>) -> Result<Json<Value>, ApiError> {
    Ok(Json(stats_json(&server.model_statistics(None, None)?)))
}

async fn infer(
    State(server): State<Server>,
    model: ModelRef,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let max = server.limits.max_request_bytes;
    // Refers to the request body once inflated, when it is compressed.
    let header_length = inference_header_length(&headers)?;
    let accept = response_coding(&headers);
    let body = read_body(&headers, body, max).await?;

    let json_len = header_length.unwrap_or(body.len()).min(body.len());
    let ModelRef { name, version } = model;
    let shm = server.shm.clone();
    // Inputs read from shared memory are copied during the parse: off the async threads too.
    let heavy = json_len > OFFLOAD_JSON_BYTES
        || body.len() - json_len > OFFLOAD_BINARY_BYTES
        || (shm.enabled() && mentions_shared_memory(&body[..json_len]));
    let ParsedInfer { request, mut format } = if header_length == Some(0) {
        // No JSON: Triton's raw binary request, shaped by the model's config.
        // (A BYTES input copies the body, behind its length prefix: large ones off the async
        // threads.)
        let config = server.model_config(&name, version)?;
        let copies = config.input.first().is_some_and(|i| i.data_type == DataType::Bytes.config_value());
        maybe_offload(copies && body.len() > OFFLOAD_JSON_BYTES, move || {
            parse_raw_binary_request(&name, version, body, &config)
        })
        .await?
    } else {
        maybe_offload(heavy, move || parse_infer_request(&name, version, body, header_length, max, Some(&shm))).await?
    };

    // Awaited here, not spawned: if the client goes away this future is dropped and the core
    // takes the request out of its queue.
    let mut response = server.infer(request).await?;
    format.shm = std::mem::take(&mut response.shm_written);

    let json_bytes: usize = response.outputs.iter().filter(|o| !format.is_binary(&o.name)).map(|o| o.data.len()).sum();
    let rendered =
        maybe_offload(json_bytes > OFFLOAD_JSON_BYTES / 4, move || render_infer_response(&response, &format)).await?;
    let mut response = match accept {
        Some(coding) if rendered.total_len() > COMPRESS_MIN_BYTES => {
            let heavy = rendered.total_len() > OFFLOAD_JSON_BYTES;
            maybe_offload(heavy, move || compressed_infer_response(rendered, coding)).await?
        }
        _ => infer_response(rendered),
    };
    // The in-band load report gateways balance on.
    response
        .headers_mut()
        .insert(nereid_common::fleet::QUEUE_REPORT_HEADER, HeaderValue::from(server.metrics.pending_total()));
    Ok(response)
}

/// Whether a (small) infer request's JSON may name a shared-memory region: it has the key, or
/// a `\u` escape, which could spell the key without its letters (JSON decodes escapes in keys).
fn mentions_shared_memory(json: &[u8]) -> bool {
    const KEY: &[u8] = b"shared_memory_region";
    json.windows(KEY.len()).any(|w| w == KEY) || json.windows(2).any(|w| w == b"\\u")
}

/// [`infer_response`] compressed as one `coding` stream (`Content-Encoding`);
/// `Inference-Header-Content-Length` still gives the JSON part's length in the inflated body,
/// as tritonserver sends it and tritonclient reads it.
pub fn compressed_infer_response(rendered: RenderedResponse, coding: Coding) -> Result<Response, Status> {
    let header_length = rendered.header_length();
    let total = rendered.total_len();
    let parts = std::iter::once(rendered.json.as_slice()).chain(rendered.binary.iter().map(|b| &b[..]));
    let body = deflate_parts(coding, parts, total)
        .map_err(|e| Status::internal(format!("failed to compress the inference response: {e}")))?;
    let mut response = Response::new(Body::from(body));
    let h = response.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(if header_length.is_some() { "application/octet-stream" } else { "application/json" }),
    );
    h.insert(header::CONTENT_ENCODING, HeaderValue::from_static(coding.name()));
    h.insert(header::VARY, HeaderValue::from_static("accept-encoding"));
    if let Some(n) = header_length {
        h.insert(HEADER_CONTENT_LENGTH, HeaderValue::from(n));
    }
    Ok(response)
}

/// The HTTP response for a rendered inference: plain JSON, or JSON + binary section with
/// `Inference-Header-Content-Length`; binary outputs are sent from their own buffers.
pub fn infer_response(rendered: RenderedResponse) -> Response {
    let Some(header_length) = rendered.header_length() else {
        return ([(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))], rendered.json).into_response();
    };
    let mut chunks = VecDeque::with_capacity(1 + rendered.binary.len());
    chunks.push_back(Bytes::from(rendered.json));
    chunks.extend(rendered.binary);
    let mut response = Response::new(Body::new(ChunkedBody::new(chunks)));
    let h = response.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
    h.insert(HEADER_CONTENT_LENGTH, HeaderValue::from(header_length));
    response
}

async fn repository_index(
    State(server): State<Server>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, ApiError> {
    let body = read_body(&headers, body, small_body_limit(&server)).await?;
    let ready = parse_index_request(&body)?;
    Ok(Json(index_json(&server.repository_index(ready))))
}

async fn load_model(
    State(server): State<Server>,
    Segment(model): Segment,
    headers: HeaderMap,
    body: Body,
) -> Result<StatusCode, ApiError> {
    let body = read_body(&headers, body, server.limits.max_request_bytes).await?;
    let config = parse_load_request(&body)?;
    server.load_model(&model, config).await?;
    Ok(StatusCode::OK)
}

async fn unload_model(
    State(server): State<Server>,
    Segment(model): Segment,
    headers: HeaderMap,
    body: Body,
) -> Result<StatusCode, ApiError> {
    let body = read_body(&headers, body, small_body_limit(&server)).await?;
    let dependents = parse_unload_request(&body)?;
    server.unload_model(&model, dependents).await?;
    Ok(StatusCode::OK)
}

async fn shm_status_all(State(server): State<Server>) -> Result<Json<Value>, ApiError> {
    Ok(Json(shm_status_json(&server.shm.status(None)?)))
}

async fn shm_status_one(State(server): State<Server>, Segment(region): Segment) -> Result<Json<Value>, ApiError> {
    Ok(Json(shm_status_json(&server.shm.status(Some(&region))?)))
}

async fn shm_register(
    State(server): State<Server>,
    Segment(region): Segment,
    headers: HeaderMap,
    body: Body,
) -> Result<StatusCode, ApiError> {
    let body = read_body(&headers, body, small_body_limit(&server)).await?;
    let (key, offset, byte_size) = parse_shm_register_request(&body)?;
    server.shm.register(&region, &key, offset, byte_size)?;
    Ok(StatusCode::OK)
}

async fn get_logging() -> Json<Value> {
    Json(log_settings_json())
}

async fn post_logging(State(server): State<Server>, headers: HeaderMap, body: Body) -> Result<Json<Value>, ApiError> {
    let body = read_body(&headers, body, small_body_limit(&server)).await?;
    nereid_common::telemetry::log_settings().apply(&parse_log_settings(&body)?)?;
    Ok(Json(log_settings_json()))
}

// CUDA shared memory, answered as a Triton built without GPUs answers it (see
// `SharedMemory::cuda_register`): no regions, registration refused, unregistering succeeds.

async fn cuda_shm_status_all(State(server): State<Server>) -> Result<Json<Value>, ApiError> {
    server.shm.cuda_status(None)?;
    Ok(Json(json!([])))
}

async fn cuda_shm_status_one(State(server): State<Server>, Segment(region): Segment) -> Result<Json<Value>, ApiError> {
    server.shm.cuda_status(Some(&region))?;
    Ok(Json(json!([])))
}

async fn cuda_shm_register(State(server): State<Server>, Segment(region): Segment) -> Result<StatusCode, ApiError> {
    server.shm.cuda_register(&region)?;
    Ok(StatusCode::OK)
}

async fn cuda_shm_unregister(State(server): State<Server>) -> Result<StatusCode, ApiError> {
    server.shm.cuda_unregister(None)?;
    Ok(StatusCode::OK)
}

async fn cuda_shm() -> ApiError {
    ApiError(Status::not_found("unknown CUDA shared memory endpoint"))
}

async fn shm_unregister_all(State(server): State<Server>) -> Result<StatusCode, ApiError> {
    server.shm.unregister(None)?;
    Ok(StatusCode::OK)
}

async fn shm_unregister_one(State(server): State<Server>, Segment(region): Segment) -> Result<StatusCode, ApiError> {
    server.shm.unregister(Some(&region))?;
    Ok(StatusCode::OK)
}

async fn metrics(State(server): State<Server>) -> Response {
    (
        [(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"))],
        server.metrics_text(),
    )
        .into_response()
}

// ---------------------------------------------------------------------------------------------
// Pure request parsing and response rendering of the non-infer endpoints.
// ---------------------------------------------------------------------------------------------

/// `GET /v2`.
pub fn server_metadata_json(name: &str, extensions: &[String]) -> Value {
    json!({ "name": name, "version": SERVER_VERSION, "extensions": extensions })
}

/// `GET /v2/logging`: every log setting, by Triton's names.
pub fn log_settings_json() -> Value {
    use nereid_common::telemetry::LogValue;
    let settings = nereid_common::telemetry::log_settings().current();
    settings
        .into_iter()
        .map(|(k, v)| {
            let v = match v {
                LogValue::Bool(b) => json!(b),
                LogValue::Uint(n) => json!(n),
                LogValue::Str(s) => json!(s),
            };
            (k.to_string(), v)
        })
        .collect::<Map<String, Value>>()
        .into()
}

/// The body of `POST /v2/logging`: a JSON object of the settings to change.
pub fn parse_log_settings(body: &[u8]) -> Result<Vec<(String, nereid_common::telemetry::LogValue)>, Status> {
    use nereid_common::telemetry::LogValue;
    let v: Value =
        serde_json::from_slice(body).map_err(|e| Status::invalid(format!("malformed log settings JSON: {e}")))?;
    let Value::Object(map) = v else {
        return Err(Status::invalid("log settings must be a JSON object"));
    };
    map.into_iter()
        .map(|(k, v)| {
            let value = match &v {
                Value::Bool(b) => LogValue::Bool(*b),
                Value::String(s) => LogValue::Str(s.clone()),
                Value::Number(n) => match n.as_u64().and_then(|n| u32::try_from(n).ok()) {
                    Some(n) => LogValue::Uint(n),
                    None => {
                        return Err(Status::invalid(format!(
                            "log setting '{k}': {n} is not a 32-bit unsigned integer"
                        )));
                    }
                },
                other => return Err(Status::invalid(format!("log setting '{k}': unsupported value {other}"))),
            };
            Ok((k, value))
        })
        .collect()
}

/// `GET /v2/systemsharedmemory[/region/{r}]/status`: `[{"name","key","offset","byte_size"}]`.
pub fn shm_status_json(regions: &[RegionStatus]) -> Value {
    regions
        .iter()
        .map(|r| json!({ "name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size }))
        .collect()
}

/// The body of `POST /v2/systemsharedmemory/region/{r}/register`:
/// `{"key": string, "offset": number, "byte_size": number}` (`offset` defaults to 0).
pub fn parse_shm_register_request(body: &[u8]) -> Result<(String, u64, u64), Status> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| Status::invalid(format!("malformed shared memory register request JSON: {e}")))?;
    let obj = v.as_object().ok_or_else(|| Status::invalid("a shared memory register request must be a JSON object"))?;
    let key = match obj.get("key") {
        Some(Value::String(k)) => k.clone(),
        Some(other) => return Err(Status::invalid(format!("'key' must be a string, got {other}"))),
        None => return Err(Status::invalid("a shared memory register request needs 'key'")),
    };
    let number = |field: &str, default: Option<u64>| match (obj.get(field), default) {
        (Some(v), _) => {
            v.as_u64().ok_or_else(|| Status::invalid(format!("'{field}' must be a non-negative integer, got {v}")))
        }
        (None, Some(d)) => Ok(d),
        (None, None) => Err(Status::invalid(format!("a shared memory register request needs '{field}'"))),
    };
    Ok((key, number("offset", Some(0))?, number("byte_size", None)?))
}

/// `GET /v2/models/{m}[/versions/{v}]`.
pub fn model_metadata_json(m: &ModelMetadata) -> Value {
    let tensors = |ts: &[server::TensorMetadata]| -> Value {
        ts.iter().map(|t| json!({ "name": t.name, "datatype": t.datatype, "shape": t.shape })).collect()
    };
    json!({
        "name": m.name,
        "versions": m.versions,
        "platform": m.platform,
        "inputs": tensors(&m.inputs),
        "outputs": tensors(&m.outputs),
    })
}

fn duration_json(d: &server::Duration) -> Value {
    json!({ "count": d.count, "ns": d.ns })
}

/// `GET /v2/models[/{m}[/versions/{v}]]/stats`, in Triton's layout.
pub fn stats_json(stats: &[ModelStats]) -> Value {
    let model_stats: Vec<Value> = stats
        .iter()
        .map(|s| {
            let batch_stats: Vec<Value> = s
                .batch_stats
                .iter()
                .map(|b| {
                    json!({
                        "batch_size": b.batch_size,
                        "compute_input": duration_json(&b.compute_input),
                        "compute_infer": duration_json(&b.compute_infer),
                        "compute_output": duration_json(&b.compute_output),
                    })
                })
                .collect();
            json!({
                "name": s.name,
                "version": s.version,
                "last_inference": s.last_inference_ms,
                "inference_count": s.inference_count,
                "execution_count": s.execution_count,
                "inference_stats": {
                    "success": duration_json(&s.success),
                    "fail": duration_json(&s.fail),
                    "queue": duration_json(&s.queue),
                    "compute_input": duration_json(&s.compute_input),
                    "compute_infer": duration_json(&s.compute_infer),
                    "compute_output": duration_json(&s.compute_output),
                    "cache_hit": duration_json(&s.cache_hit),
                    "cache_miss": duration_json(&s.cache_miss),
                },
                "response_stats": {},
                "batch_stats": batch_stats,
                "memory_usage": [],
            })
        })
        .collect();
    json!({ "model_stats": model_stats })
}

/// `POST /v2/repository/index`: `version` is left out when empty (no version loaded).
pub fn index_json(entries: &[IndexEntry]) -> Value {
    entries
        .iter()
        .map(|e| {
            let mut m = Map::new();
            m.insert("name".into(), Value::from(e.name.as_str()));
            if !e.version.is_empty() {
                m.insert("version".into(), Value::from(e.version.as_str()));
            }
            m.insert("state".into(), Value::from(e.state.as_str()));
            m.insert("reason".into(), Value::from(e.reason.as_str()));
            Value::Object(m)
        })
        .collect()
}

/// A JSON object body, or `None` for an empty one.
fn parse_optional_object(body: &[u8], what: &str) -> Result<Option<Map<String, Value>>, Status> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(Some(m)),
        Ok(_) => Err(Status::invalid(format!("{what} must be a JSON object"))),
        Err(e) => Err(Status::invalid(format!("malformed {what} JSON: {e}"))),
    }
}

fn parameters_of<'a>(obj: &'a Map<String, Value>, what: &str) -> Result<Option<&'a Map<String, Value>>, Status> {
    match obj.get("parameters") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(p)) => Ok(Some(p)),
        Some(other) => Err(Status::invalid(format!("{what}: 'parameters' must be an object, got {other}"))),
    }
}

/// The `ready` flag of a repository index request (an empty body means `false`).
pub fn parse_index_request(body: &[u8]) -> Result<bool, Status> {
    let Some(obj) = parse_optional_object(body, "repository index request")? else {
        return Ok(false);
    };
    match obj.get("ready") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => {
            Err(Status::invalid(format!("repository index request: 'ready' must be a boolean, got {other}")))
        }
    }
}

/// The `parameters.config` override (JSON text of a ModelConfig) of a load request.
pub fn parse_load_request(body: &[u8]) -> Result<Option<String>, Status> {
    let what = "model load request";
    let Some(obj) = parse_optional_object(body, what)? else {
        return Ok(None);
    };
    let Some(params) = parameters_of(&obj, what)? else {
        return Ok(None);
    };
    // An unknown key is refused before anything else, whatever the order (as over gRPC).
    if let Some(key) = params.keys().find(|k| *k != "config" && !k.starts_with("file:")) {
        return Err(Status::invalid(format!("unrecognized load parameter '{key}'.")));
    }
    let mut config = None;
    for (key, value) in params {
        if key == "config" {
            let text = value.as_str().ok_or_else(|| {
                Status::invalid(format!(
                    "{what}: parameters.config must be a string holding the model configuration as JSON, got {value}"
                ))
            })?;
            config = Some(text.to_string());
        } else if key.starts_with("file:") {
            return Err(Status::unimplemented(format!(
                "{what}: parameters.{key}: supplying model files in the load request is not supported"
            )));
        }
    }
    Ok(config)
}

/// Checks an unload request's body; returns its `parameters.unload_dependents` (an ensemble's
/// composing models are unloaded too; false when absent).
pub fn parse_unload_request(body: &[u8]) -> Result<bool, Status> {
    let what = "model unload request";
    let Some(obj) = parse_optional_object(body, what)? else { return Ok(false) };
    match parameters_of(&obj, what)?.and_then(|p| p.get("unload_dependents")) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => {
            Err(Status::invalid(format!("{what}: parameters.unload_dependents must be a boolean, got {other}")))
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A response body made of several shared buffers, with an exact length (so Content-Length is
// sent and nothing is concatenated).
// ---------------------------------------------------------------------------------------------

struct ChunkedBody {
    chunks: VecDeque<Bytes>,
    remaining: u64,
}

impl ChunkedBody {
    fn new(chunks: VecDeque<Bytes>) -> Self {
        let chunks: VecDeque<Bytes> = chunks.into_iter().filter(|c| !c.is_empty()).collect();
        let remaining = chunks.iter().map(|c| c.len() as u64).sum();
        ChunkedBody { chunks, remaining }
    }
}

impl hyper::body::Body for ChunkedBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match self.chunks.pop_front() {
            Some(chunk) => {
                self.remaining -= chunk.len() as u64;
                Poll::Ready(Some(Ok(Frame::data(chunk))))
            }
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.chunks.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.remaining)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A router whose one route reads its body (as infer does) and says how long it was.
    fn body_reader() -> Router {
        Router::new().route(
            "/",
            post(|headers: HeaderMap, body: Body| async move {
                read_body(&headers, body, 1 << 20).await.map(|b| b.len().to_string()).map_err(ApiError)
            }),
        )
    }

    /// Serves `body_reader` on a loopback port until the token is cancelled.
    async fn serve_body_reader() -> (std::net::SocketAddr, CancellationToken) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        tokio::spawn(serve(listener, body_reader(), stop.clone()));
        (address, stop)
    }

    /// A connection that sends nothing, or half a request head, is closed after
    /// HEADER_READ_TIMEOUT; one
    /// whose body stalls is answered 504 after BODY_IDLE_TIMEOUT, naming the stall; a whole
    /// request is served. (Paused time: the timeouts pass as soon as everything waits.)
    #[tokio::test(start_paused = true)]
    async fn stalled_heads_and_bodies_are_given_up_on() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let (address, stop) = serve_body_reader().await;
        let exchange = |request: &'static [u8]| async move {
            let mut tcp = tokio::net::TcpStream::connect(address).await.unwrap();
            tcp.write_all(request).await.unwrap();
            let mut answer = Vec::new();
            let started = tokio::time::Instant::now();
            tokio::time::timeout(std::time::Duration::from_secs(600), tcp.read_to_end(&mut answer))
                .await
                .unwrap_or_else(|_| panic!("the server never gave up on {:?}", String::from_utf8_lossy(request)))
                .unwrap();
            (String::from_utf8_lossy(&answer).into_owned(), started.elapsed())
        };
        // Silent: not even the first byte (which picks HTTP/1 or HTTP/2).
        // Silent after part of the HTTP/2 preface, which hyper reads with no clock.
        for request in [&b""[..], b"PRI * HTTP/2"] {
            let (answer, waited) = exchange(request).await;
            assert!(answer.is_empty(), "{answer}");
            assert!(waited >= HEADER_READ_TIMEOUT, "{waited:?}");
        }
        let (answer, waited) = exchange(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Le").await;
        assert!(!answer.contains("200 OK"), "{answer}");
        assert!(waited >= HEADER_READ_TIMEOUT, "{waited:?}");
        let (answer, waited) =
            exchange(b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 100\r\n\r\nabc").await;
        assert!(answer.starts_with("HTTP/1.1 504"), "{answer}");
        assert!(answer.contains("the upload stalled"), "{answer}");
        assert!(waited >= BODY_IDLE_TIMEOUT, "{waited:?}");
        // A request that began in time is served past the head timeout: its body trickles in
        // for 320 s, a byte every 20 s (under the body's idle timeout).
        let mut tcp = tokio::net::TcpStream::connect(address).await.unwrap();
        tcp.write_all(b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 16\r\n\r\n").await.unwrap();
        for _ in 0..16 {
            tokio::time::sleep(std::time::Duration::from_secs(20)).await;
            tcp.write_all(b"x").await.unwrap();
        }
        let mut answer = Vec::new();
        tcp.read_to_end(&mut answer).await.unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("\r\n\r\n16"), "{answer}");
        let (answer, _) =
            exchange(b"POST / HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 3\r\n\r\nabc").await;
        assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("\r\n\r\n3"), "{answer}");
        stop.cancel();
    }

    /// Requests that may read shared memory (copied during the parse) are parsed off the async
    /// threads: those naming the key, and those whose escapes could spell it.
    #[test]
    fn a_shared_memory_key_is_found_even_when_escaped() {
        assert!(mentions_shared_memory(br#"{"parameters":{"shared_memory_region":"r"}}"#));
        assert!(mentions_shared_memory(br#"{"parameters":{"shared\u005fmemory_region":"r"}}"#));
        assert!(!mentions_shared_memory(br#"{"inputs":[{"name":"x","data":[1,2]}]}"#));
    }
    use crate::server::{BatchStats, Duration, EXTENSIONS, TensorMetadata};
    use crate::tensor::{InferResponse, OutputTensor};
    use nereid_common::{Code, DataType};

    #[test]
    fn shm_register_request_parsing() {
        assert_eq!(
            parse_shm_register_request(br#"{"key":"/k","offset":8,"byte_size":64}"#).unwrap(),
            ("/k".to_string(), 8, 64)
        );
        assert_eq!(parse_shm_register_request(br#"{"key":"/k","byte_size":64}"#).unwrap(), ("/k".to_string(), 0, 64));
        for (body, needle) in [
            (&b"{"[..], "malformed shared memory register request JSON"),
            (b"[1]", "must be a JSON object"),
            (br#"{"byte_size":64}"#, "needs 'key'"),
            (br#"{"key":5,"byte_size":64}"#, "'key' must be a string"),
            (br#"{"key":"/k"}"#, "needs 'byte_size'"),
            (br#"{"key":"/k","byte_size":-1}"#, "'byte_size' must be a non-negative integer"),
            (br#"{"key":"/k","offset":"0","byte_size":1}"#, "'offset' must be a non-negative integer"),
        ] {
            let e = parse_shm_register_request(body).unwrap_err();
            assert_eq!(e.code, Code::InvalidArgument);
            assert!(e.message.contains(needle), "{needle}: {}", e.message);
        }
        let status = shm_status_json(&[RegionStatus { name: "r".into(), key: "/k".into(), offset: 4, byte_size: 8 }]);
        assert_eq!(status, json!([{"name":"r","key":"/k","offset":4,"byte_size":8}]));
    }

    #[test]
    fn server_metadata_lists_extensions() {
        let extensions: Vec<String> = EXTENSIONS.iter().map(|e| e.to_string()).collect();
        let v = server_metadata_json(crate::server::SERVER_NAME, &extensions);
        assert_eq!(v["name"], crate::server::SERVER_NAME);
        assert_eq!(v["version"], SERVER_VERSION);
        assert_eq!(v["extensions"].as_array().unwrap().len(), EXTENSIONS.len());
        assert!(v["extensions"].as_array().unwrap().contains(&json!("binary_tensor_data")));
    }

    #[test]
    fn model_metadata_layout() {
        let m = ModelMetadata {
            name: "simple".into(),
            versions: vec!["1".into(), "2".into()],
            platform: "onnxruntime_onnx".into(),
            inputs: vec![TensorMetadata { name: "INPUT0".into(), datatype: "FP32".into(), shape: vec![-1, 16] }],
            outputs: vec![TensorMetadata { name: "OUTPUT0".into(), datatype: "FP32".into(), shape: vec![-1, 16] }],
        };
        assert_eq!(
            model_metadata_json(&m),
            json!({
                "name": "simple", "versions": ["1", "2"], "platform": "onnxruntime_onnx",
                "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, 16]}],
                "outputs": [{"name": "OUTPUT0", "datatype": "FP32", "shape": [-1, 16]}],
            })
        );
    }

    #[test]
    fn stats_layout_matches_triton() {
        let d = |count, ns| Duration { count, ns };
        let s = ModelStats {
            name: "m".into(),
            version: "1".into(),
            last_inference_ms: 1700,
            inference_count: 10,
            execution_count: 4,
            success: d(10, 1000),
            fail: d(1, 5),
            queue: d(10, 100),
            compute_input: d(4, 10),
            compute_infer: d(4, 800),
            compute_output: d(4, 20),
            cache_hit: d(2, 70),
            cache_miss: d(3, 90),
            batch_stats: vec![BatchStats {
                batch_size: 2,
                compute_input: d(2, 4),
                compute_infer: d(2, 300),
                compute_output: d(2, 6),
            }],
        };
        let v = stats_json(&[s]);
        let m = &v["model_stats"][0];
        assert_eq!(m["name"], "m");
        assert_eq!(m["version"], "1");
        assert_eq!(m["last_inference"], 1700);
        assert_eq!(m["inference_count"], 10);
        assert_eq!(m["execution_count"], 4);
        assert_eq!(m["inference_stats"]["success"], json!({"count": 10, "ns": 1000}));
        assert_eq!(m["inference_stats"]["fail"], json!({"count": 1, "ns": 5}));
        assert_eq!(m["inference_stats"]["compute_infer"], json!({"count": 4, "ns": 800}));
        assert_eq!(m["inference_stats"]["cache_hit"], json!({"count": 2, "ns": 70}));
        assert_eq!(m["inference_stats"]["cache_miss"], json!({"count": 3, "ns": 90}));
        assert_eq!(
            m["batch_stats"],
            json!([{
                "batch_size": 2,
                "compute_input": {"count": 2, "ns": 4},
                "compute_infer": {"count": 2, "ns": 300},
                "compute_output": {"count": 2, "ns": 6},
            }])
        );
        assert_eq!(stats_json(&[]), json!({"model_stats": []}));
    }

    #[test]
    fn index_layout() {
        let entries = [
            IndexEntry { name: "a".into(), version: "1".into(), state: "READY".into(), reason: String::new() },
            IndexEntry {
                name: "b".into(),
                version: String::new(),
                state: "UNAVAILABLE".into(),
                reason: "unloaded".into(),
            },
        ];
        assert_eq!(
            index_json(&entries),
            json!([
                {"name": "a", "version": "1", "state": "READY", "reason": ""},
                {"name": "b", "state": "UNAVAILABLE", "reason": "unloaded"},
            ])
        );
    }

    #[test]
    fn repository_request_bodies() {
        assert!(!parse_index_request(b"").unwrap());
        assert!(!parse_index_request(b" \n").unwrap());
        assert!(parse_index_request(br#"{"ready": true}"#).unwrap());
        assert!(!parse_index_request(br#"{"ready": false, "x": 1}"#).unwrap());
        assert!(parse_index_request(br#"{"ready": "yes"}"#).unwrap_err().message.contains("'ready'"));
        assert!(parse_index_request(b"{").unwrap_err().message.contains("column"));

        assert_eq!(parse_load_request(b"").unwrap(), None);
        assert_eq!(parse_load_request(br#"{"parameters": {}}"#).unwrap(), None);
        let cfg = r#"{"name":"m","max_batch_size":4}"#;
        let body = json!({"parameters": {"config": cfg}}).to_string();
        assert_eq!(parse_load_request(body.as_bytes()).unwrap().as_deref(), Some(cfg));
        let e = parse_load_request(br#"{"parameters": {"config": {"name": "m"}}}"#).unwrap_err();
        assert!(e.message.contains("parameters.config must be a string"), "{}", e.message);
        let e = parse_load_request(br#"{"parameters": {"file:1/model.onnx": "AAAA"}}"#).unwrap_err();
        assert_eq!(e.code, Code::Unimplemented);
        let e = parse_load_request(br#"{"parameters": 3}"#).unwrap_err();
        assert!(e.message.contains("'parameters' must be an object"), "{}", e.message);
        assert!(parse_load_request(b"[1]").unwrap_err().message.contains("JSON object"));

        assert!(!parse_unload_request(b"").unwrap());
        assert!(parse_unload_request(br#"{"parameters": {"unload_dependents": true}}"#).unwrap());
        assert!(!parse_unload_request(br#"{"parameters": {"unload_dependents": false}}"#).unwrap());
        assert!(!parse_unload_request(br#"{"parameters": {}}"#).unwrap());
        let e = parse_unload_request(br#"{"parameters": {"unload_dependents": "yes"}}"#).unwrap_err();
        assert!(e.message.contains("unload_dependents must be a boolean"), "{}", e.message);
        assert!(parse_unload_request(b"nope").is_err());
    }

    async fn body_bytes(response: Response) -> Bytes {
        response.into_body().collect().await.unwrap().to_bytes()
    }

    #[tokio::test]
    async fn error_responses_are_json() {
        let r = ApiError(Status::not_found("model 'x' is not found")).into_response();
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
        assert_eq!(r.headers()[header::CONTENT_TYPE], "application/json");
        let v: Value = serde_json::from_slice(&body_bytes(r).await).unwrap();
        assert_eq!(v, json!({"error": "model 'x' is not found"}));

        let r = ApiError(Status::invalid("bad")).into_response();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);

        let r = not_found("/v2/nope".parse().unwrap()).await.into_response();
        assert_eq!(r.status(), StatusCode::NOT_FOUND);
        let v: Value = serde_json::from_slice(&body_bytes(r).await).unwrap();
        assert_eq!(v["error"], "no endpoint at '/v2/nope'");

        let r = method_not_allowed(Method::GET, "/v2/models/m/infer".parse().unwrap()).await;
        assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
        let v: Value = serde_json::from_slice(&body_bytes(r).await).unwrap();
        assert!(v["error"].as_str().unwrap().contains("GET"));
    }

    fn response_with(binary: bool) -> (InferResponse, OutputFormat) {
        let data: Vec<u8> = [1.0f32, 2.0, 3.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let response = InferResponse {
            model_name: "m".into(),
            model_version: 2,
            id: String::new(),
            shm_written: Vec::new(),
            outputs: vec![
                OutputTensor { name: "A".into(), datatype: DataType::Fp32, shape: vec![3], data: Bytes::from(data) },
                OutputTensor {
                    name: "B".into(),
                    datatype: DataType::Uint8,
                    shape: vec![2],
                    data: Bytes::from_static(&[7, 9]),
                },
            ],
        };
        (response, OutputFormat { binary_default: binary, explicit: vec![], ..Default::default() })
    }

    #[tokio::test]
    async fn infer_response_json_form() {
        let (resp, format) = response_with(false);
        let r = infer_response(render_infer_response(&resp, &format).unwrap());
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(r.headers()[header::CONTENT_TYPE], "application/json");
        assert!(r.headers().get(HEADER_CONTENT_LENGTH).is_none());
        let v: Value = serde_json::from_slice(&body_bytes(r).await).unwrap();
        assert_eq!(v["model_version"], "2");
        assert_eq!(v["outputs"][0]["data"], json!([1.0, 2.0, 3.0]));
        assert_eq!(v["outputs"][1]["data"], json!([7, 9]));
    }

    #[tokio::test]
    async fn infer_response_binary_form() {
        let (resp, format) = response_with(true);
        let r = infer_response(render_infer_response(&resp, &format).unwrap());
        assert_eq!(r.headers()[header::CONTENT_TYPE], "application/octet-stream");
        let n: usize = r.headers()[HEADER_CONTENT_LENGTH].to_str().unwrap().parse().unwrap();
        assert_eq!(hyper::body::Body::size_hint(r.body()).exact(), Some((n + 12 + 2) as u64));
        let body = body_bytes(r).await;
        assert_eq!(body.len(), n + 14);
        let v: Value = serde_json::from_slice(&body[..n]).unwrap();
        assert_eq!(v["outputs"][0]["parameters"]["binary_data_size"], 12);
        assert_eq!(v["outputs"][1]["parameters"]["binary_data_size"], 2);
        assert_eq!(&body[n..n + 12], &resp.outputs[0].data[..]);
        assert_eq!(&body[n + 12..], &[7, 9]);
    }

    #[tokio::test]
    async fn body_reading_limits() {
        let mut headers = HeaderMap::new();
        let b = read_body(&headers, Body::from("hello"), 10).await.unwrap();
        assert_eq!(&b[..], b"hello");
        let e = read_body(&headers, Body::from("hello world!"), 10).await.unwrap_err();
        assert!(e.message.contains("limit of 10 bytes"), "{}", e.message);
        // Several chunks are joined.
        let chunks =
            futures::stream::iter(["ab", "cd", "ef"].map(|s| Ok::<_, Infallible>(Bytes::from_static(s.as_bytes()))));
        let b = read_body(&headers, Body::from_stream(chunks), 10).await.unwrap();
        assert_eq!(&b[..], b"abcdef");
        let chunks = futures::stream::iter(
            ["abcd", "efgh", "ijkl"].map(|s| Ok::<_, Infallible>(Bytes::from_static(s.as_bytes()))),
        );
        assert!(read_body(&headers, Body::from_stream(chunks), 10).await.is_err());
        // A declared Content-Length over the limit is refused before reading.
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("1000"));
        let e = read_body(&headers, Body::from("x"), 10).await.unwrap_err();
        assert!(e.message.contains("1000 bytes exceeds the limit of 10"), "{}", e.message);
        headers.remove(header::CONTENT_LENGTH);
        headers.insert(header::CONTENT_ENCODING, HeaderValue::from_static("br"));
        let e = read_body(&headers, Body::from("x"), 10).await.unwrap_err();
        assert_eq!(e.code, Code::Unimplemented);
        assert!(e.message.contains("'br'"), "{}", e.message);
        headers.insert(header::CONTENT_ENCODING, HeaderValue::from_static("identity"));
        let b = read_body(&headers, Body::from("hello"), 10).await.unwrap();
        assert_eq!(&b[..], b"hello");
    }

    fn gzip(data: &[u8]) -> Vec<u8> {
        deflate_parts(Coding::Gzip, [data], data.len()).unwrap()
    }

    fn zlib(data: &[u8]) -> Vec<u8> {
        deflate_parts(Coding::Deflate, [data], data.len()).unwrap()
    }

    fn raw_deflate(data: &[u8]) -> Vec<u8> {
        use std::io::Write;
        let mut e = flate2::write::DeflateEncoder::new(Vec::new(), flate2::Compression::default());
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    fn encoded(coding: &'static str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_ENCODING, HeaderValue::from_static(coding));
        h
    }

    #[tokio::test]
    async fn compressed_request_bodies_are_inflated() {
        // A binary-extension infer body: JSON header + the tensor's bytes.
        let values = [1.5f32, -2.0, 3.25, 0.0];
        let tensor: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let json = br#"{"inputs":[{"name":"A","shape":[4],"datatype":"FP32","parameters":{"binary_data_size":16}},{"name":"J","shape":[2],"datatype":"INT32","data":[7,8]}]}"#;
        let mut plain = json.to_vec();
        plain.extend_from_slice(&tensor);
        for (name, body) in [
            ("gzip", gzip(&plain)),
            ("x-gzip", gzip(&plain)),
            ("deflate", zlib(&plain)),
            ("DEFLATE", raw_deflate(&plain)),
        ] {
            assert_ne!(body, plain);
            let headers = encoded(name);
            let b = read_body(&headers, Body::from(body), 1 << 20).await.unwrap();
            assert_eq!(&b[..], &plain[..], "{name}");
            // Inference-Header-Content-Length counts in the inflated body.
            let p = parse_infer_request("m", None, b, Some(json.len()), 1 << 20, None).unwrap();
            assert_eq!(&p.request.inputs[0].data[..], &tensor[..], "{name}");
            assert_eq!(&p.request.inputs[1].data[..], &[7, 0, 0, 0, 8, 0, 0, 0], "{name}");
        }
        // A JSON body in several chunks.
        let body = gzip(br#"{"inputs":[]}"#);
        let (a, b) = body.split_at(body.len() / 2);
        let chunks = futures::stream::iter([a.to_vec(), b.to_vec()].map(|c| Ok::<_, Infallible>(Bytes::from(c))));
        let b = read_body(&encoded("gzip"), Body::from_stream(chunks), 100).await.unwrap();
        assert_eq!(&b[..], br#"{"inputs":[]}"#);
        // An empty body stays empty.
        let b = read_body(&encoded("gzip"), Body::empty(), 100).await.unwrap();
        assert!(b.is_empty());
        // Corrupt data is a 400 naming the coding.
        let e = read_body(&encoded("gzip"), Body::from("not gzip at all"), 100).await.unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(e.message.contains("gzip"), "{}", e.message);
        let mut truncated = zlib(&plain);
        truncated.truncate(truncated.len() / 2);
        let e = read_body(&encoded("deflate"), Body::from(truncated), 1 << 20).await.unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(e.message.contains("deflate"), "{}", e.message);
    }

    #[tokio::test]
    async fn compressed_bodies_are_limited_by_their_inflated_size() {
        const MAX: usize = 1 << 20;
        // A "zip bomb": a few KiB on the wire, 8 MiB inflated.
        let mut inflated = br#"{"inputs": [], "pad": ""#.to_vec();
        inflated.resize(8 * MAX, b' ');
        inflated.extend_from_slice(br#""}"#);
        for (name, body) in [("gzip", gzip(&inflated)), ("deflate", zlib(&inflated))] {
            assert!(body.len() < MAX / 4, "{}", body.len());
            let e = read_body(&encoded(name), Body::from(body), MAX).await.unwrap_err();
            assert_eq!(e.code, Code::InvalidArgument);
            assert!(e.message.contains("exceeds the limit of 1048576 bytes"), "{}", e.message);
        }
        // Exactly the limit inflated is fine; one byte more is not.
        let exact = vec![b'x'; MAX];
        assert_eq!(inflate(Coding::Gzip, &gzip(&exact), MAX, &AtomicBool::new(false)).unwrap().len(), MAX);
        assert!(inflate(Coding::Gzip, &gzip(&exact), MAX - 1, &AtomicBool::new(false)).is_err());
        // The inflating buffer never grows past max + 1 bytes.
        let bomb = gzip(&inflated);
        let reader = flate2::bufread::GzDecoder::new(&bomb[..]);
        let mut counting = CapturingReader { inner: reader, largest_read: 0 };
        assert!(read_bounded(&mut counting, 100, MAX, &AtomicBool::new(false)).unwrap().is_none());
        assert!(counting.largest_read <= MAX + 1);
        let out = read_bounded(&exact[..], 10, MAX, &AtomicBool::new(false)).unwrap().unwrap();
        assert!(out.capacity() <= MAX + 1, "{}", out.capacity());
    }

    /// Inflating reads a chunk at a time and stops between two once its request is gone (the
    /// future reading the body dropped), instead of inflating up to the limit for nobody.
    #[test]
    fn inflating_stops_once_its_request_is_gone() {
        let zeros = vec![0u8; 4 * INFLATE_CHUNK_BYTES];
        let bomb = gzip(&zeros);
        let mut counting = CapturingReader { inner: flate2::bufread::GzDecoder::new(&bomb[..]), largest_read: 0 };
        let out = read_bounded(&mut counting, bomb.len(), usize::MAX >> 1, &AtomicBool::new(false)).unwrap();
        assert_eq!(out.map(|o| o.len()), Some(zeros.len()));
        assert!(counting.largest_read <= INFLATE_CHUNK_BYTES, "{}", counting.largest_read);
        let e = inflate(Coding::Gzip, &bomb, usize::MAX >> 1, &AtomicBool::new(true)).unwrap_err();
        assert!(e.message.contains("went away"), "{}", e.message);
        // What read_body holds across its await: dropped with the request, it sets the flag.
        let gone = CancelOnDrop::default();
        let flag = gone.0.clone();
        assert!(!flag.load(Ordering::Relaxed));
        drop(gone);
        assert!(flag.load(Ordering::Relaxed));
    }

    struct CapturingReader<R> {
        inner: R,
        largest_read: usize,
    }

    impl<R: std::io::Read> std::io::Read for CapturingReader<R> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            self.largest_read = self.largest_read.max(buf.len());
            self.inner.read(buf)
        }
    }

    #[test]
    fn accept_encoding_choice() {
        let coding = |v: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(header::ACCEPT_ENCODING, HeaderValue::from_static(v));
            response_coding(&h)
        };
        assert_eq!(response_coding(&HeaderMap::new()), None);
        assert_eq!(coding("gzip"), Some(Coding::Gzip));
        assert_eq!(coding("deflate"), Some(Coding::Deflate));
        assert_eq!(coding("deflate, gzip"), Some(Coding::Gzip));
        assert_eq!(coding("gzip;q=0.5, deflate"), Some(Coding::Deflate));
        assert_eq!(coding("gzip; q=0, deflate;q=0.1"), Some(Coding::Deflate));
        assert_eq!(coding("gzip;q=0"), None);
        assert_eq!(coding("br, identity"), None);
        assert_eq!(coding("*"), None);
    }

    fn inflate_all(coding: Coding, body: &[u8]) -> Vec<u8> {
        inflate(coding, body, usize::MAX >> 1, &AtomicBool::new(false)).unwrap()
    }

    #[tokio::test]
    async fn compressed_infer_responses() {
        let values: Vec<f32> = (0..1000).map(|i| i as f32).collect();
        let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let response = InferResponse {
            model_name: "m".into(),
            model_version: 1,
            id: String::new(),
            shm_written: Vec::new(),
            outputs: vec![OutputTensor {
                name: "A".into(),
                datatype: DataType::Fp32,
                shape: vec![1000],
                data: Bytes::from(data.clone()),
            }],
        };
        for coding in [Coding::Gzip, Coding::Deflate] {
            // Binary form: the header length counts in the inflated body.
            let format = OutputFormat { binary_default: true, explicit: vec![], ..Default::default() };
            let rendered = render_infer_response(&response, &format).unwrap();
            let json_len = rendered.json.len();
            let r = compressed_infer_response(rendered, coding).unwrap();
            assert_eq!(r.headers()[header::CONTENT_ENCODING], coding.name());
            assert_eq!(r.headers()[header::CONTENT_TYPE], "application/octet-stream");
            assert_eq!(r.headers()[HEADER_CONTENT_LENGTH].to_str().unwrap(), json_len.to_string());
            let body = inflate_all(coding, &body_bytes(r).await);
            let v: Value = serde_json::from_slice(&body[..json_len]).unwrap();
            assert_eq!(v["outputs"][0]["parameters"]["binary_data_size"], 4000);
            assert_eq!(&body[json_len..], &data[..]);

            // JSON form.
            let rendered = render_infer_response(&response, &OutputFormat::default()).unwrap();
            let plain = rendered.json.clone();
            let r = compressed_infer_response(rendered, coding).unwrap();
            assert_eq!(r.headers()[header::CONTENT_TYPE], "application/json");
            assert!(r.headers().get(HEADER_CONTENT_LENGTH).is_none());
            let body = body_bytes(r).await;
            assert!(body.len() < plain.len());
            assert_eq!(inflate_all(coding, &body), plain);
        }
    }

    #[test]
    fn header_length_parsing() {
        let mut h = HeaderMap::new();
        assert_eq!(inference_header_length(&h).unwrap(), None);
        h.insert(HEADER_CONTENT_LENGTH, HeaderValue::from_static("42"));
        assert_eq!(inference_header_length(&h).unwrap(), Some(42));
        h.insert(HEADER_CONTENT_LENGTH, HeaderValue::from_static("-1"));
        assert!(inference_header_length(&h).is_err());
    }
}
