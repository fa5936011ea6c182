//! The KServe v2 gRPC front end (`inference.GRPCInferenceService`): translates the protocol
//! into [`Server`] calls and renders their results. Where this worker lacks a feature, it
//! answers as a Triton built without it does: CUDA shared memory as a CPU-only build (no
//! regions, registration refused), `TraceSetting` as a build without tracing (UNAVAILABLE).
//!
//! Unary `ModelInfer` runs inside the handler future, never on a detached task: when the client
//! cancels (or its `grpc-timeout` passes) tonic drops that future and the core takes the request
//! off its queue. `ModelStreamInfer` runs the requests of one stream concurrently inside the
//! response stream itself (see [`InferStream`]), so dropping the stream cancels them all.

pub mod convert;
pub mod inflate;

use nereid_common::fleet::QUEUE_REPORT_HEADER;
use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::stream::{FuturesOrdered, Stream, StreamExt};
use nereid_common::Status;
use nereid_proto::health::health_check_response::ServingStatus;
use nereid_proto::health::health_server::HealthServer;
use nereid_proto::health::{HealthCheckRequest, HealthCheckResponse};
use nereid_proto::inference::grpc_inference_service_server::{GrpcInferenceService, GrpcInferenceServiceServer};
use nereid_proto::inference::*;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::codec::CompressionEncoding;
use tonic::codegen::BoxStream;
use tonic::{Request, Response};

use crate::restrict::{Api, Restrictions};
use crate::server::{SERVER_VERSION, Server, parse_version};
use crate::shm;
use convert::{
    conversion_bytes, grpc_deadline, index_entry_to_proto, infer_request_from_proto, infer_response_to_proto,
    load_config_parameter, mark_shm_outputs, model_metadata_to_proto, model_stats_to_proto, shm_input_bytes,
    unload_dependents_parameter,
};

/// A `ModelStreamInfer` stream stops reading requests while those it read and has not answered
/// yet, and the replies it has not handed over, take this many times the request limit: by
/// count alone ([`MAX_STREAM_IN_FLIGHT`]), a client that reads no replies could make it hold
/// that many requests (or replies) of the largest size.
pub const STREAM_REQUEST_LIMITS: usize = 4;

/// Most requests of one `ModelStreamInfer` stream in flight at once. Past it the stream stops
/// reading requests until one completes, so HTTP/2 flow control pushes back on the client.
pub const MAX_STREAM_IN_FLIGHT: usize = 1024;

/// Most requests a weighed stream runs before it has seen any reply: until then it cannot
/// tell what a reply weighs, and a first burst of [`MAX_STREAM_IN_FLIGHT`] requests to a model
/// with large outputs would make it hold that many large replies for a client that reads
/// none. Once a reply has been seen, the weight bound takes over.
pub const STREAM_FIRST_BURST: usize = 64;

/// Most concurrent HTTP/2 streams (RPCs) per connection.
const MAX_CONCURRENT_STREAMS: u32 = 4096;

type TonicResult<T> = Result<Response<T>, tonic::Status>;

/// The `GRPCInferenceService` implementation. Cheap to clone.
#[derive(Clone)]
pub struct GrpcFrontend {
    server: Server,
    /// When cancelled, open `ModelStreamInfer` streams stop reading requests, finish the ones
    /// in flight and end, so that a graceful shutdown does not wait on idle streams forever.
    shutdown: Option<CancellationToken>,
}

impl GrpcFrontend {
    pub fn new(server: Server) -> Self {
        // The codec weighs typed contents against the request limit before decoding them.
        nereid_proto::codec::raise_contents_limit(server.limits.max_request_bytes);
        GrpcFrontend { server, shutdown: None }
    }

    /// Like [`GrpcFrontend::new`]; streams end once `shutdown` is cancelled.
    pub fn with_shutdown(server: Server, shutdown: CancellationToken) -> Self {
        GrpcFrontend { shutdown: Some(shutdown), ..GrpcFrontend::new(server) }
    }
}

/// The service, ready for `tonic::transport::Server::add_service` (or any tower stack):
/// messages up to `limits.max_request_bytes` (after decompression) are accepted; gzip-compressed
/// requests are accepted, responses are sent uncompressed.
pub fn service(server: Server) -> GrpcInferenceServiceServer<GrpcFrontend> {
    configure(GrpcFrontend::new(server))
}

/// [`service`] whose open `ModelStreamInfer` streams end (after finishing their in-flight
/// requests) once `shutdown` is cancelled. [`serve`] uses it.
pub fn service_with_shutdown(server: Server, shutdown: CancellationToken) -> GrpcInferenceServiceServer<GrpcFrontend> {
    configure(GrpcFrontend::with_shutdown(server, shutdown))
}

fn configure(frontend: GrpcFrontend) -> GrpcInferenceServiceServer<GrpcFrontend> {
    let max_request = frontend.server.limits.max_request_bytes;
    GrpcInferenceServiceServer::new(frontend)
        .max_decoding_message_size(max_request)
        .max_encoding_message_size(usize::MAX)
        .accept_compressed(CompressionEncoding::Gzip)
        .accept_compressed(CompressionEncoding::Deflate)
}

/// How [`serve`] runs the gRPC front end.
#[derive(Clone, Debug, Default)]
pub struct ServeOptions {
    pub keepalive: KeepAlive,
    /// `--grpc-restricted-protocol`.
    pub restrictions: Arc<Restrictions>,
    /// `--grpc-infer-response-compression-level` other than `none`: responses are gzipped for
    /// clients that accept gzip (tritonserver's levels are not graded here).
    pub compress_responses: bool,
}

/// The pings the gRPC server sends on a connection (`--grpc-keepalive-time` /
/// `--grpc-keepalive-timeout`): every `interval`, closing the connection when one is not
/// acknowledged within `timeout`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeepAlive {
    pub interval: Duration,
    pub timeout: Duration,
}

impl Default for KeepAlive {
    fn default() -> Self {
        KeepAlive { interval: Duration::from_secs(60), timeout: Duration::from_secs(20) }
    }
}

/// Serves the gRPC front end on `listener` until `shutdown` is cancelled, then stops accepting
/// and waits for open connections to finish their in-flight RPCs (graceful HTTP/2 GOAWAY);
/// open streams stop taking requests and end once theirs have been answered. A client that
/// never finishes a unary upload can still hold it up: bound the wait in the caller.
pub async fn serve(
    listener: TcpListener,
    server: Server,
    options: ServeOptions,
    shutdown: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let ServeOptions { keepalive, restrictions, compress_responses } = options;
    let server_for_health = server.clone();
    let max_request = server.limits.max_request_bytes;
    let mut service = service_with_shutdown(server, shutdown.clone());
    if compress_responses {
        service = service.send_compressed(CompressionEncoding::Gzip);
    }
    tonic::transport::Server::builder()
        // Only applies to sockets tonic binds itself; `incoming` below sets it on ours.
        .tcp_nodelay(true)
        .http2_keepalive_interval(Some(keepalive.interval))
        .http2_keepalive_timeout(Some(keepalive.timeout))
        // Large fixed windows: with small (adaptive) ones, bursts of small requests trip h2's
        // flood guard ("too_many_data_frames" GOAWAY), failing every call on the connection.
        .initial_connection_window_size(Some(HTTP2_CONNECTION_WINDOW))
        .initial_stream_window_size(Some(HTTP2_STREAM_WINDOW))
        .max_concurrent_streams(Some(MAX_CONCURRENT_STREAMS))
        .layer(tower::util::MapResponseLayer::new(remap_transport_errors))
        .layer(tower::layer::layer_fn(move |inner| Restricted { inner, rules: restrictions.clone() }))
        // Compressed messages inflate on the blocking pool, not in tonic's decoder inline.
        .layer(tower::util::MapRequestLayer::new(move |request: http::Request<tonic::body::Body>| {
            // The inference service's limit; the health service's messages are a name.
            let limit = if request.uri().path().starts_with(INFERENCE_SERVICE_PREFIX) {
                max_request
            } else {
                crate::http::SMALL_BODY_BYTES.min(max_request)
            };
            inflate::inflate_off_loop(stamped(request), limit)
        }))
        .add_service(HealthServer::new(Health::new(Arc::new(move || server_for_health.ready()))))
        .add_service(service)
        .serve_with_incoming_shutdown(incoming(listener), shutdown.cancelled_owned())
        .await
}

const INFERENCE_SERVICE_PREFIX: &str = "/inference.GRPCInferenceService/";

/// When a call's headers arrived: stamped on it before its message is read, the start of its
/// `grpc-timeout` as tonic's own timer counts it (a large or slow upload uses up the client's
/// time too).
#[derive(Clone, Copy, Debug)]
pub struct Arrived(pub Instant);

fn stamped<B>(mut request: http::Request<B>) -> http::Request<B> {
    request.extensions_mut().insert(Arrived(Instant::now()));
    request
}

/// When `request`'s headers arrived ([`Arrived`]), or now where it was not stamped (a service
/// run outside [`serve`]).
fn arrival<T>(request: &Request<T>) -> Instant {
    request.extensions().get::<Arrived>().map_or_else(Instant::now, |a| a.0)
}

/// Refuses calls to APIs restricted by `--grpc-restricted-protocol` that lack the group's
/// header and value, with UNAVAILABLE (tritonserver's answer), before any handler runs.
#[derive(Clone)]
struct Restricted<S> {
    inner: S,
    rules: Arc<Restrictions>,
}

impl<S, B> tower::Service<http::Request<B>> for Restricted<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = futures::future::Either<S::Future, std::future::Ready<Result<Self::Response, S::Error>>>;

    fn poll_ready(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if self.rules.is_empty() {
            return futures::future::Either::Left(self.inner.call(request));
        }
        match self.rules.refusal(Api::of_grpc(request.uri().path()), request.headers()) {
            Some(message) => {
                futures::future::Either::Right(std::future::ready(Ok(tonic::Status::unavailable(message).into_http())))
            }
            None => futures::future::Either::Left(self.inner.call(request)),
        }
    }
}

const HTTP2_CONNECTION_WINDOW: u32 = 64 << 20;
const HTTP2_STREAM_WINDOW: u32 = 8 << 20;

/// tonic answers a request it cannot decode or inflate with INTERNAL and one over the size limit
/// with OUT_OF_RANGE, before any handler runs. Clients act on INVALID_ARGUMENT (malformed protobuf:
/// the request is wrong, do not retry) and RESOURCE_EXHAUSTED (too large), so rewrite those
/// codes in trailers-only error responses; the message is kept.
pub fn remap_transport_errors<B>(mut response: http::Response<B>) -> http::Response<B> {
    let headers = response.headers_mut();
    let (Some(status), Some(message)) = (headers.get("grpc-status"), headers.get("grpc-message")) else {
        return response;
    };
    let message = message.to_str().unwrap_or("").replace("%20", " ");
    let Some(code) = transport_code(tonic::Code::from_bytes(status.as_bytes()), &message) else {
        return response;
    };
    headers.insert("grpc-status", http::HeaderValue::from(code as i32));
    response
}

/// The code a client should see for tonic's own decoding failure `code` (see
/// [`remap_transport_errors`]), if it is one.
fn transport_code(code: tonic::Code, message: &str) -> Option<tonic::Code> {
    match code {
        tonic::Code::Internal if message.contains("failed to decode Protobuf message") => {
            Some(tonic::Code::InvalidArgument)
        }
        // A compressed message that does not inflate (corrupt gzip/deflate data).
        tonic::Code::Internal if message.starts_with("Error decompressing") => Some(tonic::Code::InvalidArgument),
        tonic::Code::OutOfRange if message.contains("decoded message length too large") => {
            Some(tonic::Code::ResourceExhausted)
        }
        _ => None,
    }
}

/// [`transport_code`] for a message of a stream, whose error ends the stream in its trailers
/// (where [`remap_transport_errors`] does not look): the same code as a unary call gets.
fn stream_transport_error(status: tonic::Status) -> tonic::Status {
    match transport_code(status.code(), status.message()) {
        Some(code) => tonic::Status::new(code, status.message().to_string()),
        None => status,
    }
}

/// Accepted connections with `TCP_NODELAY` set (small responses must not wait on Nagle), and a
/// short pause after an accept error (e.g. EMFILE) instead of spinning on it.
fn incoming(listener: TcpListener) -> impl Stream<Item = Result<tokio::net::TcpStream, std::io::Error>> + Send {
    async_stream::stream! {
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    if let Err(e) = stream.set_nodelay(true) {
                        tracing::debug!("grpc: cannot set TCP_NODELAY: {e}");
                    }
                    yield Ok(stream);
                }
                Err(e) => {
                    tracing::warn!("grpc: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }
}

#[tonic::async_trait]
impl GrpcInferenceService for GrpcFrontend {
    async fn server_live(&self, _request: Request<ServerLiveRequest>) -> TonicResult<ServerLiveResponse> {
        Ok(Response::new(ServerLiveResponse { live: self.server.live() }))
    }

    async fn server_ready(&self, _request: Request<ServerReadyRequest>) -> TonicResult<ServerReadyResponse> {
        Ok(Response::new(ServerReadyResponse { ready: self.server.ready() }))
    }

    async fn model_ready(&self, request: Request<ModelReadyRequest>) -> TonicResult<ModelReadyResponse> {
        let r = request.into_inner();
        let version = parse_version(&r.name, &r.version)?;
        Ok(Response::new(ModelReadyResponse { ready: self.server.model_ready(&r.name, version) }))
    }

    async fn server_metadata(&self, _request: Request<ServerMetadataRequest>) -> TonicResult<ServerMetadataResponse> {
        Ok(Response::new(ServerMetadataResponse {
            name: self.server.name.to_string(),
            version: SERVER_VERSION.to_string(),
            extensions: self.server.extensions(),
        }))
    }

    async fn model_metadata(&self, request: Request<ModelMetadataRequest>) -> TonicResult<ModelMetadataResponse> {
        let r = request.into_inner();
        let version = parse_version(&r.name, &r.version)?;
        let metadata = self.server.model_metadata(&r.name, version)?;
        Ok(Response::new(model_metadata_to_proto(metadata)))
    }

    async fn model_infer(&self, request: Request<ModelInferRequest>) -> TonicResult<ModelInferResponse> {
        let deadline = grpc_deadline(request.metadata(), arrival(&request));
        // Awaited in place: if the client goes away tonic drops this future, cancelling it.
        // The queue report rides on refusals and errors too: a worker answering mostly those
        // must not look idle to the gateways' balancers once its last success is old.
        let queue = || self.server.metrics.pending_total();
        match infer_one(&self.server, request.into_inner(), deadline).await {
            Ok(resp) => {
                let mut response = Response::new(resp);
                response.metadata_mut().insert(QUEUE_REPORT_HEADER, queue().into());
                Ok(response)
            }
            Err(status) => {
                let mut status = tonic::Status::from(status);
                status.metadata_mut().insert(QUEUE_REPORT_HEADER, queue().into());
                Err(status)
            }
        }
    }

    async fn model_stream_infer(
        &self,
        request: Request<tonic::Streaming<ModelInferRequest>>,
    ) -> TonicResult<BoxStream<ModelStreamInferResponse>> {
        // A stream's grpc-timeout bounds the whole stream, hence every request on it.
        let deadline = grpc_deadline(request.metadata(), arrival(&request));
        let server = self.server.clone();
        let run = move |req: ModelInferRequest| -> BoxFuture<'static, ModelStreamInferResponse> {
            let server = server.clone();
            Box::pin(async move { stream_infer_one(&server, req, deadline).await })
        };
        let weight_limit = self.server.limits.max_request_bytes.saturating_mul(STREAM_REQUEST_LIMITS);
        let mut stream = InferStream::new(request.into_inner(), run, MAX_STREAM_IN_FLIGHT).weighed(
            weight_limit,
            prost::Message::encoded_len,
            prost::Message::encoded_len,
        );
        if let Some(shutdown) = &self.shutdown {
            stream = stream.stop_on(shutdown.clone().cancelled_owned());
        }
        Ok(Response::new(Box::pin(stream)))
    }

    async fn model_config(&self, request: Request<ModelConfigRequest>) -> TonicResult<ModelConfigResponse> {
        let r = request.into_inner();
        let version = parse_version(&r.name, &r.version)?;
        let config = self.server.model_config(&r.name, version)?;
        Ok(Response::new(ModelConfigResponse { config: Some(config) }))
    }

    async fn model_statistics(&self, request: Request<ModelStatisticsRequest>) -> TonicResult<ModelStatisticsResponse> {
        let r = request.into_inner();
        let version = parse_version(&r.name, &r.version)?;
        let name = (!r.name.is_empty()).then_some(r.name.as_str());
        let stats = self.server.model_statistics(name, version)?;
        Ok(Response::new(ModelStatisticsResponse {
            model_stats: stats.into_iter().map(model_stats_to_proto).collect(),
        }))
    }

    async fn repository_index(&self, request: Request<RepositoryIndexRequest>) -> TonicResult<RepositoryIndexResponse> {
        let r = request.into_inner();
        check_repository_name(&r.repository_name)?;
        let models = self.server.repository_index(r.ready).into_iter().map(index_entry_to_proto).collect();
        Ok(Response::new(RepositoryIndexResponse { models }))
    }

    async fn repository_model_load(
        &self,
        request: Request<RepositoryModelLoadRequest>,
    ) -> TonicResult<RepositoryModelLoadResponse> {
        let r = request.into_inner();
        check_repository_name(&r.repository_name)?;
        let config = load_config_parameter(&r.parameters)?;
        self.server.load_model(&r.model_name, config).await?;
        Ok(Response::new(RepositoryModelLoadResponse {}))
    }

    async fn repository_model_unload(
        &self,
        request: Request<RepositoryModelUnloadRequest>,
    ) -> TonicResult<RepositoryModelUnloadResponse> {
        let r = request.into_inner();
        check_repository_name(&r.repository_name)?;
        let dependents = unload_dependents_parameter(&r.parameters)?;
        self.server.unload_model(&r.model_name, dependents).await?;
        Ok(Response::new(RepositoryModelUnloadResponse {}))
    }

    async fn log_settings(&self, request: Request<LogSettingsRequest>) -> TonicResult<LogSettingsResponse> {
        Ok(Response::new(convert::log_settings(request.into_inner())?))
    }

    /// What Triton built without tracing answers: tritonclient reports it as a server error
    /// rather than as a missing RPC.
    async fn trace_setting(&self, _request: Request<TraceSettingRequest>) -> TonicResult<TraceSettingResponse> {
        Err(tonic::Status::unavailable(TRACE_UNSUPPORTED))
    }

    async fn cuda_shared_memory_status(
        &self,
        request: Request<CudaSharedMemoryStatusRequest>,
    ) -> TonicResult<CudaSharedMemoryStatusResponse> {
        let r = request.into_inner();
        self.server.shm.cuda_status((!r.name.is_empty()).then_some(r.name.as_str()))?;
        Ok(Response::new(CudaSharedMemoryStatusResponse { regions: Default::default() }))
    }

    async fn cuda_shared_memory_register(
        &self,
        request: Request<CudaSharedMemoryRegisterRequest>,
    ) -> TonicResult<CudaSharedMemoryRegisterResponse> {
        self.server.shm.cuda_register(&request.into_inner().name)?;
        Ok(Response::new(CudaSharedMemoryRegisterResponse {}))
    }

    async fn cuda_shared_memory_unregister(
        &self,
        request: Request<CudaSharedMemoryUnregisterRequest>,
    ) -> TonicResult<CudaSharedMemoryUnregisterResponse> {
        let r = request.into_inner();
        self.server.shm.cuda_unregister((!r.name.is_empty()).then_some(r.name.as_str()))?;
        Ok(Response::new(CudaSharedMemoryUnregisterResponse {}))
    }

    async fn system_shared_memory_status(
        &self,
        request: Request<SystemSharedMemoryStatusRequest>,
    ) -> TonicResult<SystemSharedMemoryStatusResponse> {
        let r = request.into_inner();
        let name = (!r.name.is_empty()).then_some(r.name.as_str());
        let regions = self.server.shm.status(name)?;
        Ok(Response::new(SystemSharedMemoryStatusResponse {
            regions: regions
                .into_iter()
                .map(|r| {
                    let status = system_shared_memory_status_response::RegionStatus {
                        name: r.name.clone(),
                        key: r.key,
                        offset: r.offset,
                        byte_size: r.byte_size,
                    };
                    (r.name, status)
                })
                .collect(),
        }))
    }

    async fn system_shared_memory_register(
        &self,
        request: Request<SystemSharedMemoryRegisterRequest>,
    ) -> TonicResult<SystemSharedMemoryRegisterResponse> {
        let r = request.into_inner();
        self.server.shm.register(&r.name, &r.key, r.offset, r.byte_size)?;
        Ok(Response::new(SystemSharedMemoryRegisterResponse {}))
    }

    async fn system_shared_memory_unregister(
        &self,
        request: Request<SystemSharedMemoryUnregisterRequest>,
    ) -> TonicResult<SystemSharedMemoryUnregisterResponse> {
        let r = request.into_inner();
        self.server.shm.unregister((!r.name.is_empty()).then_some(r.name.as_str()))?;
        Ok(Response::new(SystemSharedMemoryUnregisterResponse {}))
    }
}

/// `grpc.health.v1.Health`, the standard gRPC health check (Kubernetes' `grpc` probes,
/// grpc_health_probe), as Triton serves it: `Check` answers SERVING while `ready` says so
/// (the server's readiness, as `ServerReady`), NOT_SERVING otherwise; for the whole server
/// (`service` empty) or the inference service by name, NOT_FOUND for any other service (the
/// protocol's rule). `Watch` is not implemented (UNIMPLEMENTED), as in Triton.
#[derive(Clone)]
pub struct Health {
    ready: Arc<dyn Fn() -> bool + Send + Sync>,
}

impl Health {
    pub fn new(ready: Arc<dyn Fn() -> bool + Send + Sync>) -> Self {
        Health { ready }
    }
}

/// The service names [`Health`] answers for.
pub const HEALTH_SERVICES: [&str; 2] = ["", "inference.GRPCInferenceService"];

#[tonic::async_trait]
impl nereid_proto::health::health_server::Health for Health {
    async fn check(&self, request: Request<HealthCheckRequest>) -> TonicResult<HealthCheckResponse> {
        let service = request.into_inner().service;
        if !HEALTH_SERVICES.contains(&service.as_str()) {
            return Err(tonic::Status::not_found(format!("unknown service '{service}'")));
        }
        let status = if (self.ready)() { ServingStatus::Serving } else { ServingStatus::NotServing };
        Ok(Response::new(HealthCheckResponse { status: status as i32 }))
    }

    // `Watch`: the generated default (UNIMPLEMENTED).
}

/// The message of `TraceSetting`, Triton's when built without tracing.
pub const TRACE_UNSUPPORTED: &str = "the server does not support trace";

/// Refuses a named repository (the worker serves its one repository set), as Triton does.
pub fn check_repository_name(name: &str) -> Result<(), Status> {
    if name.is_empty() {
        return Ok(());
    }
    Err(Status::unimplemented("'repository_name' specification is not supported"))
}

/// The parameter Triton sets on every stream response: true on the last (here the only)
/// response to a request.
pub const FINAL_RESPONSE_PARAMETER: &str = "triton_final_response";

/// Decodes, runs and encodes one request; outputs the client asked for in shared memory are
/// written there, and the response names their regions.
async fn infer_one(
    server: &Server,
    req: ModelInferRequest,
    deadline: Option<Instant>,
) -> Result<ModelInferResponse, Status> {
    // Inputs read from shared memory are copied, typed contents re-encoded and strings walked
    // while decoding: large ones off the async threads.
    let max_bytes = server.limits.max_request_bytes as u64;
    let converts = shm_input_bytes(&req).saturating_add(conversion_bytes(&req));
    let mut request = if converts > shm::OFFLOAD_BYTES {
        let registry = server.shm.clone();
        tokio::task::spawn_blocking(move || infer_request_from_proto(req, &registry, max_bytes))
            .await
            .map_err(|e| Status::internal(format!("request conversion task failed: {e}")))??
    } else {
        infer_request_from_proto(req, &server.shm, max_bytes)?
    };
    request.deadline = deadline;
    let mut response = server.infer(request).await?;
    let written = std::mem::take(&mut response.shm_written);
    let mut proto = infer_response_to_proto(response);
    mark_shm_outputs(&mut proto, &written);
    Ok(proto)
}

/// Runs one request of a stream; errors become `error_message` (with the request's id in an
/// otherwise empty `infer_response`, as Triton does, so the client can tell which one failed).
async fn stream_infer_one(
    server: &Server,
    req: ModelInferRequest,
    deadline: Option<Instant>,
) -> ModelStreamInferResponse {
    let (id, model_name, model_version) = (req.id.clone(), req.model_name.clone(), req.model_version.clone());
    stream_answer(infer_one(server, req, deadline), id, model_name, model_version).await
}

/// The stream reply to one request: its answer, or its error (or its panic's) under its id,
/// model and version — clients match stream replies to requests by id (perf_analyzer's async
/// mode waits for each id), so a reply without one would leave its request unanswered.
async fn stream_answer(
    answer: impl std::future::Future<Output = Result<ModelInferResponse, Status>>,
    id: String,
    model_name: String,
    model_version: String,
) -> ModelStreamInferResponse {
    use futures::FutureExt as _;
    match std::panic::AssertUnwindSafe(answer).catch_unwind().await {
        Ok(Ok(resp)) => {
            ModelStreamInferResponse { error_message: String::new(), infer_response: Some(final_response(resp)) }
        }
        Ok(Err(e)) => stream_error(e, id, model_name, model_version),
        Err(panic) => {
            let what = crate::scheduler::panic_text(panic.as_ref());
            tracing::error!(error = %what, model = %model_name, "a stream request panicked; answered with an error message");
            let mut reply = ModelStreamInferResponse::from(StreamPanic(what));
            reply.infer_response = Some(ModelInferResponse { model_name, model_version, id, ..Default::default() });
            reply
        }
    }
}

/// Marks a stream's response as the last one to its request (`triton_final_response`), as
/// Triton marks every response on a stream, decoupled model or not: clients written for
/// decoupled models wait for it.
fn final_response(mut resp: ModelInferResponse) -> ModelInferResponse {
    let flag = InferParameter { parameter_choice: Some(infer_parameter::ParameterChoice::BoolParam(true)) };
    resp.parameters.insert(FINAL_RESPONSE_PARAMETER.to_string(), flag);
    resp
}

fn stream_error(e: Status, id: String, model_name: String, model_version: String) -> ModelStreamInferResponse {
    ModelStreamInferResponse {
        error_message: e.message,
        infer_response: Some(ModelInferResponse { model_name, model_version, id, ..Default::default() }),
    }
}

/// The response side of `ModelStreamInfer`: reads requests from `incoming`, runs up to `limit`
/// of them concurrently through `run`, and yields their responses in request order (as Triton
/// answers a stream to a model that is not decoupled: clients may match answers by position).
///
/// Each request runs as its own task, so it progresses (and its deadline, its admission permit
/// and the upstream flow-control window it holds are released) even while the client reads no
/// replies; a finished reply not yet read still counts against `limit`. Dropping the stream —
/// the client cancelled or the connection closed — aborts the tasks, which cancels their
/// requests. A failed request yields an error *message*; only a broken request stream (e.g. an
/// undecodable or oversized message) ends the RPC, with that status, after the requests already
/// read finish. [`InferStream::weighed`] bounds the requests read and not yet answered, and
/// the replies not yet taken, by their size as well.
pub struct InferStream<S, F, R: From<StreamPanic> = ModelStreamInferResponse, W = Unweighed> {
    incoming: Option<S>,
    run: F,
    in_flight: FuturesOrdered<AbortOnDrop<R>>,
    limit: usize,
    /// What each request in `in_flight` weighs, in order, their sum, and the most that sum,
    /// the finished replies not yet taken and the replies still to come may weigh before no
    /// more are read (at least one request always is).
    weigh: W,
    weights: VecDeque<usize>,
    weight: usize,
    weight_limit: usize,
    /// Most requests in flight before any reply was seen (see [`STREAM_FIRST_BURST`]).
    first_burst: usize,
    /// The replies finished and not yet taken, kept by the requests' tasks.
    replies: Arc<Replies>,
    /// Set when the request stream failed; reported once the in-flight requests drained.
    error: Option<tonic::Status>,
    /// Once this completes, no more requests are read (see [`InferStream::stop_on`]).
    stop: Option<BoxFuture<'static, ()>>,
}

impl<S, F, Q, R> InferStream<S, F, R>
where
    S: Stream<Item = Result<Q, tonic::Status>> + Unpin + Send,
    F: FnMut(Q) -> BoxFuture<'static, R> + Unpin + Send,
    R: From<StreamPanic>,
{
    pub fn new(incoming: S, run: F, limit: usize) -> Self {
        InferStream {
            incoming: Some(incoming),
            run,
            in_flight: FuturesOrdered::new(),
            limit: limit.max(1),
            weigh: Unweighed,
            weights: VecDeque::new(),
            weight: 0,
            weight_limit: usize::MAX,
            first_burst: usize::MAX,
            replies: Arc::default(),
            error: None,
            stop: None,
        }
    }

    /// Stops reading requests while those read and not yet answered (by `request`, e.g. their
    /// encoded size), the replies finished and not yet taken (by `reply`) and, for each request
    /// still running, the largest reply seen so far on the stream weigh `limit` or more: a
    /// client that reads no replies then makes the stream hold about `limit` bytes (plus one
    /// request, and the replies of a first burst read before any reply was seen), not the
    /// count limit's worth of requests or replies of any size.
    pub fn weighed(
        self,
        limit: usize,
        request: fn(&Q) -> usize,
        reply: fn(&R) -> usize,
    ) -> InferStream<S, F, R, Weights<Q, R>> {
        InferStream {
            incoming: self.incoming,
            run: self.run,
            in_flight: self.in_flight,
            limit: self.limit,
            weigh: Weights { request, reply },
            weights: self.weights,
            weight: self.weight,
            weight_limit: limit,
            first_burst: STREAM_FIRST_BURST,
            replies: self.replies,
            error: self.error,
            stop: self.stop,
        }
    }
}

impl<S, F, R: From<StreamPanic>, W> InferStream<S, F, R, W> {
    /// When `stop` completes, the stream reads no more requests, answers those in flight and
    /// ends — with UNAVAILABLE when the client had not finished sending (used for graceful
    /// shutdown).
    pub fn stop_on(mut self, stop: impl std::future::Future<Output = ()> + Send + 'static) -> Self {
        self.stop = Some(Box::pin(stop));
        self
    }
}

/// How much of an [`InferStream`]'s weight limit a request and its reply take.
pub trait Weigh<Q, R> {
    fn request(&self, request: &Q) -> usize;
    /// Weighs a reply on its request's task, as it is ready.
    fn reply(&self) -> fn(&R) -> usize;
}

/// No weight limit: requests and replies are bounded by count only.
pub struct Unweighed;

impl<Q, R> Weigh<Q, R> for Unweighed {
    fn request(&self, _: &Q) -> usize {
        0
    }

    fn reply(&self) -> fn(&R) -> usize {
        |_| 0
    }
}

/// The weights of [`InferStream::weighed`].
pub struct Weights<Q, R> {
    request: fn(&Q) -> usize,
    reply: fn(&R) -> usize,
}

impl<Q, R> Weigh<Q, R> for Weights<Q, R> {
    fn request(&self, request: &Q) -> usize {
        (self.request)(request)
    }

    fn reply(&self) -> fn(&R) -> usize {
        self.reply
    }
}

/// What an [`InferStream`]'s finished replies not yet taken weigh, how many they are, and the
/// largest reply it has seen lately: kept by the requests' tasks as their replies are ready.
#[derive(Default)]
struct Replies {
    weight: AtomicUsize,
    finished: AtomicUsize,
    /// Whether any reply has finished yet.
    seen: AtomicBool,
    /// The largest reply seen lately: decaying by an eighth (rounded up) with each smaller
    /// one, so that a single large reply early in a long stream does not hold it to a few
    /// requests in flight for the rest of its life — but never below an eighth of the largest
    /// ever seen ([`Replies::peak`]), so that the weight bound loosens at most eightfold.
    largest: AtomicUsize,
    /// The largest reply ever seen on the stream.
    peak: AtomicUsize,
}

impl Replies {
    fn finished(&self, weight: usize) {
        self.weight.fetch_add(weight, Ordering::AcqRel);
        let peak = self.peak.fetch_max(weight, Ordering::AcqRel).max(weight);
        let decayed = |largest: usize| Some(weight.max(largest - largest.div_ceil(8)).max(peak / 8));
        // The closure always answers Some: the update cannot fail.
        let _ = self.largest.fetch_update(Ordering::AcqRel, Ordering::Acquire, decayed);
        self.finished.fetch_add(1, Ordering::AcqRel);
        self.seen.store(true, Ordering::Release);
    }

    fn taken(&self, weight: usize) {
        self.weight.fetch_sub(weight, Ordering::AcqRel);
        self.finished.fetch_sub(1, Ordering::AcqRel);
    }

    /// What `in_flight` requests' replies weigh: those finished, and the largest seen for each
    /// still running.
    fn load(&self, in_flight: usize) -> usize {
        let running = in_flight.saturating_sub(self.finished.load(Ordering::Acquire));
        let reserve = running.saturating_mul(self.largest.load(Ordering::Acquire));
        self.weight.load(Ordering::Acquire).saturating_add(reserve)
    }
}

/// A request of an [`InferStream`] that panicked: what went wrong, for the error message that
/// answers it in its place (the stream and its other requests go on, as Triton's do when one
/// request fails).
pub struct StreamPanic(pub String);

impl From<StreamPanic> for ModelStreamInferResponse {
    fn from(p: StreamPanic) -> Self {
        ModelStreamInferResponse {
            error_message: format!("the request failed unexpectedly: {}", p.0),
            infer_response: Some(ModelInferResponse::default()),
        }
    }
}

/// A spawned request of an [`InferStream`]: aborted when dropped; yields its reply and what
/// the reply weighs (counted in [`Replies`]), or a reply made from its panic (not counted).
struct AbortOnDrop<R>(tokio::task::JoinHandle<(R, Option<usize>)>);

impl<R: From<StreamPanic>> std::future::Future for AbortOnDrop<R> {
    type Output = (R, Option<usize>);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<(R, Option<usize>)> {
        match Pin::new(&mut self.0).poll(cx) {
            Poll::Ready(Ok(reply)) => Poll::Ready(reply),
            Poll::Ready(Err(e)) if e.is_panic() => {
                let what = crate::scheduler::panic_text(e.into_panic().as_ref());
                tracing::error!(error = %what, "a stream request panicked; answered with an error message");
                Poll::Ready((R::from(StreamPanic(what)), None))
            }
            // Only `drop` aborts the task, and nothing polls it after that.
            Poll::Ready(Err(_)) => Poll::Pending,
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<R> Drop for AbortOnDrop<R> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl<S, F, Q, R, W> Stream for InferStream<S, F, R, W>
where
    S: Stream<Item = Result<Q, tonic::Status>> + Unpin + Send,
    F: FnMut(Q) -> BoxFuture<'static, R> + Unpin + Send,
    R: From<StreamPanic> + Send + 'static,
    W: Weigh<Q, R> + Unpin,
{
    type Item = Result<R, tonic::Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();

        if let Some(stop) = this.stop.as_mut()
            && stop.as_mut().poll(cx).is_ready()
        {
            this.stop = None;
            // The client had not finished sending: whatever it sends next is never read, so
            // the RPC must not end OK (a client counting its answers would wait for ever).
            if this.incoming.take().is_some() && this.error.is_none() {
                this.error = Some(tonic::Status::unavailable(
                    "the server is shutting down: the stream's requests after those answered were not read",
                ));
            }
        }

        loop {
            // Admit new requests while there is room. When full, the in-flight set (non-empty)
            // holds the waker; otherwise `incoming` does (it returned Pending) or has ended.
            // A request finishing wakes the in-flight set, so a reply's weight added on its
            // task is seen here by the next poll.
            let mut incoming_waits = false;
            while this.has_room() {
                let Some(incoming) = this.incoming.as_mut() else { break };
                match incoming.poll_next_unpin(cx) {
                    Poll::Ready(Some(Ok(req))) => {
                        let weight = this.weigh.request(&req);
                        this.weights.push_back(weight);
                        this.weight = this.weight.saturating_add(weight);
                        let fut = (this.run)(req);
                        let (weigh, replies) = (this.weigh.reply(), this.replies.clone());
                        this.in_flight.push_back(AbortOnDrop(tokio::spawn(async move {
                            let reply = fut.await;
                            let weight = weigh(&reply);
                            replies.finished(weight);
                            (reply, Some(weight))
                        })));
                    }
                    Poll::Ready(Some(Err(status))) => {
                        this.incoming = None;
                        this.error = Some(stream_transport_error(status));
                    }
                    Poll::Ready(None) => this.incoming = None,
                    Poll::Pending => {
                        incoming_waits = true;
                        break;
                    }
                }
            }

            match this.in_flight.poll_next_unpin(cx) {
                Poll::Ready(Some((resp, reply_weight))) => {
                    // Answers come in request order: the first weight is this one's.
                    let weight = this.weights.pop_front().unwrap_or(0);
                    this.weight = this.weight.saturating_sub(weight);
                    if let Some(reply_weight) = reply_weight {
                        this.replies.taken(reply_weight);
                    }
                    return Poll::Ready(Some(Ok(resp)));
                }
                // Empty: done once the requests ended too, else `incoming` holds the waker.
                Poll::Ready(None) if this.incoming.is_none() => return Poll::Ready(this.error.take().map(Err)),
                Poll::Ready(None) | Poll::Pending => {
                    // A request that finished within this poll (its output taken at once, no
                    // wake-up) may have brought the load under the limit — its reply weighing
                    // less than the reserve it held: admit again, unless `incoming` already
                    // holds the waker. Each round reads a request or ends, so this is bounded.
                    if incoming_waits || !this.has_room() {
                        return Poll::Pending;
                    }
                }
            }
        }
    }
}

impl<S, F, R: From<StreamPanic>, W> InferStream<S, F, R, W> {
    /// Whether another request may be read now: under the count limit and, unless none is in
    /// flight, under the weight limit.
    fn has_room(&self) -> bool {
        let count_limit = if self.replies.seen.load(Ordering::Acquire) { self.limit } else { self.first_burst };
        self.incoming.is_some()
            && self.in_flight.len() < self.limit.min(count_limit)
            && (self.in_flight.is_empty()
                || self.weight.saturating_add(self.replies.load(self.in_flight.len())) < self.weight_limit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::sync::mpsc;
    use tokio_stream::wrappers::UnboundedReceiverStream;

    #[test]
    fn a_calls_deadline_counts_from_when_its_headers_arrived() {
        let arrived = Instant::now() - Duration::from_millis(400);
        let mut request = Request::new(());
        assert!(arrival(&request) > arrived, "unstamped: now");
        request.extensions_mut().insert(Arrived(arrived));
        request.metadata_mut().insert("grpc-timeout", "1000m".parse().unwrap());
        let deadline = grpc_deadline(request.metadata(), arrival(&request)).unwrap();
        assert_eq!(deadline, arrived + Duration::from_millis(995));
        let http = stamped(http::Request::new(()));
        assert!(http.extensions().get::<Arrived>().is_some_and(|a| a.0 > arrived));
    }

    fn req(id: &str) -> ModelInferRequest {
        ModelInferRequest { model_name: "m".into(), id: id.into(), ..Default::default() }
    }

    fn ok(id: &str) -> ModelStreamInferResponse {
        ModelStreamInferResponse {
            error_message: String::new(),
            infer_response: Some(ModelInferResponse { id: id.into(), ..Default::default() }),
        }
    }

    /// Requests named "sleep-<ms>" finish after that long; "fail" fails; others at once.
    fn runner(
        active: Arc<AtomicUsize>,
        peak: Arc<AtomicUsize>,
    ) -> impl FnMut(ModelInferRequest) -> BoxFuture<'static, ModelStreamInferResponse> + Unpin + Send {
        move |r: ModelInferRequest| {
            let (active, peak) = (active.clone(), peak.clone());
            Box::pin(async move {
                let now = active.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(now, Ordering::SeqCst);
                let _guard = Guard(active);
                if let Some(ms) = r.id.strip_prefix("sleep-") {
                    tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
                    ok(&r.id)
                } else if r.id == "fail" {
                    stream_error(Status::invalid("input 'x': bad"), r.id, r.model_name, r.model_version)
                } else if r.id == "panic" {
                    panic!("index out of bounds")
                } else {
                    ok(&r.id)
                }
            })
        }
    }

    /// Counts a request as active until its future completes or is dropped.
    struct Guard(Arc<AtomicUsize>);
    impl Drop for Guard {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn counters() -> (Arc<AtomicUsize>, Arc<AtomicUsize>) {
        (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)))
    }

    /// Waits (at most 30 s, else fails with `what`) until at most `n` requests are running.
    async fn wait_active_at_most(active: &AtomicUsize, n: usize, what: &str) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while active.load(Ordering::SeqCst) > n {
            assert!(tokio::time::Instant::now() < deadline, "{what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn stream_runs_concurrently_answers_in_order_and_survives_errors() {
        let (active, peak) = counters();
        let incoming =
            futures::stream::iter(vec![Ok(req("sleep-200")), Ok(req("fail")), Ok(req("sleep-20")), Ok(req("now"))]);
        let out: Vec<_> = InferStream::new(incoming, runner(active, peak.clone()), 16).collect().await;
        let ids: Vec<String> =
            out.iter().map(|r| r.as_ref().unwrap().infer_response.as_ref().unwrap().id.clone()).collect();
        // The slow first request finishes last, yet its answer comes first: request order.
        assert_eq!(ids, ["sleep-200", "fail", "sleep-20", "now"]);
        let fail = out.iter().map(|r| r.as_ref().unwrap()).find(|r| !r.error_message.is_empty()).unwrap();
        assert_eq!(fail.error_message, "input 'x': bad");
        assert_eq!(fail.infer_response.as_ref().unwrap().id, "fail");
        assert!(peak.load(Ordering::SeqCst) >= 2, "requests ran concurrently");
    }

    /// A weighed stream stops reading while the requests it read and has not answered weigh
    /// its limit or more, and reads on once a reply is taken.
    #[tokio::test]
    async fn a_weight_limit_stops_reading_until_replies_are_taken() {
        let (active, peak) = counters();
        let (tx, rx) = mpsc::unbounded_channel();
        let mut s = InferStream::new(UnboundedReceiverStream::new(rx), runner(active.clone(), peak.clone()), 8)
            .weighed(25, |_: &ModelInferRequest| 10, |_: &ModelStreamInferResponse| 0);
        for id in ["sleep-20", "sleep-600000", "sleep-600000", "sleep-600000"] {
            tx.send(Ok(req(id))).unwrap();
        }
        // 10, 20, 30: the third takes it past 25, the fourth waits.
        assert!(tokio::time::timeout(Duration::from_millis(1), s.next()).await.is_err());
        assert_eq!(peak.load(Ordering::SeqCst), 3);
        let first = s.next().await.unwrap().unwrap();
        assert_eq!(first.infer_response.unwrap().id, "sleep-20");
        assert_eq!(active.load(Ordering::SeqCst), 2);
        // Its weight given back: the fourth is read.
        assert!(tokio::time::timeout(Duration::from_millis(1), s.next()).await.is_err());
        assert_eq!(active.load(Ordering::SeqCst), 3);
    }

    /// A stream fed through a channel of 16, whose requests weigh nothing and whose replies
    /// weigh 10 each, against a limit of 25.
    #[allow(clippy::type_complexity)] // the concrete stream: the tests read its counters
    fn replies_of_ten_limit_twenty_five() -> (
        mpsc::Sender<Result<ModelInferRequest, tonic::Status>>,
        InferStream<
            tokio_stream::wrappers::ReceiverStream<Result<ModelInferRequest, tonic::Status>>,
            impl FnMut(ModelInferRequest) -> BoxFuture<'static, ModelStreamInferResponse> + Unpin + Send,
            ModelStreamInferResponse,
            Weights<ModelInferRequest, ModelStreamInferResponse>,
        >,
    ) {
        let (active, peak) = counters();
        let (tx, rx) = mpsc::channel(16);
        let s = InferStream::new(tokio_stream::wrappers::ReceiverStream::new(rx), runner(active, peak), 8).weighed(
            25,
            |_: &ModelInferRequest| 0,
            |_: &ModelStreamInferResponse| 10,
        );
        (tx, s)
    }

    /// A weighed stream runs at most STREAM_FIRST_BURST requests before it has seen a reply;
    /// once one is seen, the rest are read (their weight allowing).
    #[tokio::test]
    async fn a_first_burst_is_bounded_until_a_reply_is_seen() {
        let (active, peak) = counters();
        let (tx, rx) = mpsc::unbounded_channel();
        let mut s = InferStream::new(UnboundedReceiverStream::new(rx), runner(active, peak), MAX_STREAM_IN_FLIGHT)
            .weighed(1 << 30, |_: &ModelInferRequest| 1, |_: &ModelStreamInferResponse| 1);
        tx.send(Ok(req("now"))).unwrap();
        for _ in 0..99 {
            tx.send(Ok(req("sleep-600000"))).unwrap();
        }
        // One poll: the stream reads what it may (the tasks have not run yet).
        assert!(futures::FutureExt::now_or_never(s.next()).is_none());
        assert_eq!(s.in_flight.len(), STREAM_FIRST_BURST);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !s.replies.seen.load(Ordering::SeqCst) {
            assert!(tokio::time::Instant::now() < deadline, "the first request never finished");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(s.next().await.unwrap().unwrap().infer_response.unwrap().id, "now");
        assert_eq!(s.in_flight.len(), 99, "the rest read once a reply was seen");
    }

    /// Replies finished behind a slower one and not yet taken weigh too: while they weigh the
    /// limit, no more requests are read; taking them reads on. (Paused time: the slow request's
    /// 300 ms pass only as the test's own short waits advance the clock.)
    #[tokio::test(start_paused = true)]
    async fn unread_replies_count_against_the_weight_limit() {
        let (tx, mut s) = replies_of_ten_limit_twenty_five();
        for id in ["sleep-300", "a", "b", "c"] {
            tx.send(Ok(req(id))).await.unwrap();
        }
        // All four are read (requests weigh nothing here); three replies finish behind the first.
        assert!(tokio::time::timeout(Duration::from_millis(1), s.next()).await.is_err());
        assert_eq!(tx.capacity(), 16);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while s.replies.weight.load(Ordering::SeqCst) < 30 {
            assert!(tokio::time::Instant::now() < deadline, "the fast requests never finished");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        tx.send(Ok(req("d"))).await.unwrap();
        assert!(tokio::time::timeout(Duration::from_millis(1), s.next()).await.is_err());
        assert_eq!(tx.capacity(), 15, "the fifth request is not read while 30 of 25 wait unread");
        // The first, then "a" taken: 20 left unread, so the next poll reads the fifth.
        let ids: Vec<String> = [s.next().await, s.next().await]
            .into_iter()
            .map(|r| r.unwrap().unwrap().infer_response.unwrap().id)
            .collect();
        assert_eq!(ids, ["sleep-300", "a"]);
        assert_eq!(tx.capacity(), 15, "still 30 unread when \"a\" was taken");
        assert_eq!(s.next().await.unwrap().unwrap().infer_response.unwrap().id, "b");
        assert_eq!(tx.capacity(), 16, "read once the replies weighed less than the limit");
        drop(tx);
        let rest: Vec<String> = s.map(|r| r.unwrap().infer_response.unwrap().id).collect().await;
        assert_eq!(rest, ["c", "d"]);
    }

    /// Requests still running count as the largest reply seen so far on the stream: with
    /// replies of 10 and a limit of 25, three slow requests are read and the fourth waits.
    #[tokio::test]
    async fn running_requests_count_as_the_largest_reply_seen() {
        let (tx, mut s) = replies_of_ten_limit_twenty_five();
        tx.send(Ok(req("first"))).await.unwrap();
        assert_eq!(s.next().await.unwrap().unwrap().infer_response.unwrap().id, "first");
        for _ in 0..4 {
            tx.send(Ok(req("sleep-600000"))).await.unwrap();
        }
        assert!(tokio::time::timeout(Duration::from_millis(1), s.next()).await.is_err());
        assert_eq!(s.in_flight.len(), 3);
        assert_eq!(tx.capacity(), 15, "the fourth is not read while three may reply 30 of 25");
    }

    /// The largest reply seen decays with each smaller one, down to an eighth of the largest
    /// ever seen: after one reply of 20 against a limit of 25, one slow request more is read;
    /// after a run of empty replies, twelve more.
    #[tokio::test]
    async fn a_large_reply_long_ago_stops_limiting_the_stream() {
        let (active, peak) = counters();
        let (tx, rx) = mpsc::channel(64);
        // Replies weigh what their id says after "w" ("w20": 20), others nothing.
        let weight = |r: &ModelStreamInferResponse| {
            let id = r.infer_response.as_ref().map_or("", |i| i.id.as_str());
            id.strip_prefix('w').and_then(|n| n.parse().ok()).unwrap_or(0)
        };
        let mut s = InferStream::new(tokio_stream::wrappers::ReceiverStream::new(rx), runner(active, peak), 64)
            .weighed(25, |_: &ModelInferRequest| 0, weight);
        tx.send(Ok(req("w20"))).await.unwrap();
        assert_eq!(s.next().await.unwrap().unwrap().infer_response.unwrap().id, "w20");
        assert_eq!(s.replies.largest.load(Ordering::SeqCst), 20);
        for _ in 0..24 {
            tx.send(Ok(req("w0"))).await.unwrap();
            assert_eq!(s.next().await.unwrap().unwrap().infer_response.unwrap().id, "w0");
        }
        assert_eq!(s.replies.largest.load(Ordering::SeqCst), 2, "down to an eighth of the peak (20 / 8)");
        for _ in 0..16 {
            tx.send(Ok(req("sleep-600000"))).await.unwrap();
        }
        assert!(tokio::time::timeout(Duration::from_millis(1), s.next()).await.is_err());
        // 2 each: the thirteenth running request takes the reserve to 26, past 25.
        assert_eq!(s.in_flight.len(), 13, "running requests reserve an eighth of the largest reply ever seen");
    }

    /// A request that panics is answered with an error message in its place; the stream and
    /// the requests around it go on.
    #[tokio::test]
    async fn a_panicking_request_is_answered_with_an_error_and_the_stream_goes_on() {
        let (active, peak) = counters();
        let incoming = futures::stream::iter(vec![Ok(req("now")), Ok(req("panic")), Ok(req("sleep-10"))]);
        let out: Vec<_> = InferStream::new(incoming, runner(active, peak), 8).collect().await;
        assert_eq!(out.len(), 3);
        let out: Vec<_> = out.into_iter().map(Result::unwrap).collect();
        assert_eq!(out[0].infer_response.as_ref().unwrap().id, "now");
        assert!(out[1].error_message.contains("index out of bounds"), "{:?}", out[1]);
        assert_eq!(out[2].infer_response.as_ref().unwrap().id, "sleep-10");
    }

    /// The worker's own stream requests answer a panic with their id, model and version.
    #[tokio::test]
    async fn a_panicking_worker_request_is_answered_under_its_id() {
        let panics = async {
            let empty: Vec<ModelInferResponse> = Vec::new();
            Ok(empty[0].clone())
        };
        let reply = stream_answer(panics, "r7".into(), "m".into(), "2".into()).await;
        assert!(reply.error_message.contains("index out of bounds"), "{reply:?}");
        let labelled = reply.infer_response.unwrap();
        assert_eq!(
            (labelled.id.as_str(), labelled.model_name.as_str(), labelled.model_version.as_str()),
            ("r7", "m", "2")
        );
    }

    /// A client that stops reading replies does not stop its requests: they run to the end
    /// (releasing what they hold) while the replies wait; dropping the stream cancels the rest.
    #[tokio::test]
    async fn requests_run_while_the_client_reads_nothing_and_stop_when_it_goes() {
        let (active, peak) = counters();
        let (tx, rx) = mpsc::unbounded_channel();
        let mut s = InferStream::new(UnboundedReceiverStream::new(rx), runner(active.clone(), peak.clone()), 8);
        for id in ["sleep-10", "sleep-20", "sleep-600000"] {
            tx.send(Ok(req(id))).unwrap();
        }
        // One poll admits the three; then nothing polls the stream.
        assert!(tokio::time::timeout(Duration::from_millis(1), s.next()).await.is_err());
        assert_eq!(peak.load(Ordering::SeqCst), 3);
        wait_active_at_most(&active, 1, "the unread requests did not finish").await;
        // Their replies wait for the reader.
        let first = s.next().await.unwrap().unwrap();
        assert_eq!(first.infer_response.unwrap().id, "sleep-10");
        // Gone: the long request is cancelled, not left running.
        drop(s);
        wait_active_at_most(&active, 0, "the dropped stream's request kept running").await;
    }

    #[test]
    fn stream_responses_are_final_and_repository_names_refused() {
        let resp = final_response(ModelInferResponse { id: "r".into(), ..Default::default() });
        assert_eq!(
            resp.parameters[FINAL_RESPONSE_PARAMETER].parameter_choice,
            Some(infer_parameter::ParameterChoice::BoolParam(true))
        );
        assert_eq!(resp.id, "r");
        check_repository_name("").unwrap();
        let e = check_repository_name("models").unwrap_err();
        assert_eq!(e.code, nereid_common::Code::Unimplemented);
        assert_eq!(e.message, "'repository_name' specification is not supported");
    }

    #[test]
    fn transport_errors_about_the_request_become_client_errors() {
        let answer = |status: &str, message: &str| {
            let mut response = http::Response::new(());
            response.headers_mut().insert("grpc-status", http::HeaderValue::from_str(status).unwrap());
            response.headers_mut().insert("grpc-message", http::HeaderValue::from_str(message).unwrap());
            remap_transport_errors(response).headers()["grpc-status"].to_str().unwrap().to_string()
        };
        let invalid = (tonic::Code::InvalidArgument as i32).to_string();
        let exhausted = (tonic::Code::ResourceExhausted as i32).to_string();
        assert_eq!(answer("13", "failed to decode Protobuf message: invalid wire type"), invalid);
        assert_eq!(
            answer("13", "Error%20decompressing:%20corrupt%20deflate%20stream,%20while%20sending%20request"),
            invalid
        );
        assert_eq!(answer("11", "decoded message length too large: found 9 bytes, the limit is: 4 bytes"), exhausted);
        assert_eq!(answer("13", "something else broke"), "13", "other internal errors stay internal");
    }

    #[tokio::test]
    async fn stream_bounds_in_flight_requests() {
        let (active, peak) = counters();
        let incoming = futures::stream::iter((0..50).map(|_| Ok(req("sleep-5"))).collect::<Vec<_>>());
        let out: Vec<_> = InferStream::new(incoming, runner(active, peak.clone()), 4).collect().await;
        assert_eq!(out.len(), 50);
        assert!(out.iter().all(|r| r.is_ok()));
        assert_eq!(peak.load(Ordering::SeqCst), 4);
    }

    #[tokio::test]
    async fn stream_error_ends_after_in_flight_drain() {
        let (active, peak) = counters();
        let incoming = futures::stream::iter(vec![
            Ok(req("sleep-10")),
            Err(tonic::Status::resource_exhausted("message too large")),
            Ok(req("never")),
        ]);
        let out: Vec<_> = InferStream::new(incoming, runner(active, peak), 8).collect().await;
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].as_ref().unwrap().infer_response.as_ref().unwrap().id, "sleep-10");
        assert_eq!(out[1].as_ref().unwrap_err().code(), tonic::Code::ResourceExhausted);
    }

    #[tokio::test]
    async fn stream_stops_reading_on_shutdown_and_drains() {
        let (active, peak) = counters();
        let (tx, rx) = mpsc::unbounded_channel();
        let token = CancellationToken::new();
        let mut s = InferStream::new(UnboundedReceiverStream::new(rx), runner(active, peak), 8)
            .stop_on(token.clone().cancelled_owned());
        tx.send(Ok(req("sleep-30"))).unwrap();
        assert!(tokio::time::timeout(Duration::from_millis(5), s.next()).await.is_err());
        token.cancel();
        tx.send(Ok(req("late"))).unwrap();
        // The in-flight request is still answered, then the stream ends — UNAVAILABLE, not
        // OK: the client had not finished sending, and "late" was never read.
        assert_eq!(s.next().await.unwrap().unwrap().infer_response.unwrap().id, "sleep-30");
        assert_eq!(s.next().await.unwrap().unwrap_err().code(), tonic::Code::Unavailable);
        assert!(s.next().await.is_none());
        drop(tx);
    }

    /// A client that had finished sending when shutdown began gets every answer and OK.
    #[tokio::test]
    async fn a_finished_stream_ends_ok_on_shutdown() {
        let (active, peak) = counters();
        let token = CancellationToken::new();
        let incoming = futures::stream::iter(vec![Ok(req("sleep-30"))]);
        let mut s = InferStream::new(incoming, runner(active, peak), 8).stop_on(token.clone().cancelled_owned());
        assert!(tokio::time::timeout(Duration::from_millis(5), s.next()).await.is_err());
        token.cancel();
        assert_eq!(s.next().await.unwrap().unwrap().infer_response.unwrap().id, "sleep-30");
        assert!(s.next().await.is_none());
    }

    #[tokio::test]
    async fn stream_waits_for_more_requests_and_drop_cancels() {
        let (active, peak) = counters();
        let (tx, rx) = mpsc::unbounded_channel();
        let mut s = InferStream::new(UnboundedReceiverStream::new(rx), runner(active.clone(), peak), 8);
        tx.send(Ok(req("a"))).unwrap();
        assert_eq!(s.next().await.unwrap().unwrap().infer_response.unwrap().id, "a");
        // Nothing in flight and the client still connected: the stream must pend, then wake.
        let sender = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            tx.send(Ok(req("b"))).unwrap();
            tx.send(Ok(req("sleep-60000"))).unwrap();
            tx
        });
        assert_eq!(s.next().await.unwrap().unwrap().infer_response.unwrap().id, "b");
        let _tx = sender.await.unwrap();
        // The long request is in flight; dropping the stream drops (cancels) it.
        assert!(tokio::time::timeout(Duration::from_millis(50), s.next()).await.is_err());
        assert_eq!(active.load(Ordering::SeqCst), 1);
        drop(s);
        // Aborted: the task's future is dropped when the runtime next runs it.
        wait_active_at_most(&active, 0, "dropping the stream left the in-flight request running").await;
    }
}
