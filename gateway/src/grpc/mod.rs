//! gRPC ingress: `inference.GRPCInferenceService`, so tritonclient and perf_analyzer point at
//! the gateway unchanged. Inference goes down the [`crate::stack`] as encoded bytes (the
//! tensors are never decoded: [`crate::wire`]); the other model calls to [`Control`]. The
//! repository load/unload and shared-memory RPCs answer UNIMPLEMENTED (the generated default
//! stubs): placement, not clients, decides what workers load.
//!
//! Deadlines: `grpc-timeout` (brought forward by the worker's margin, so the gateway answers
//! DEADLINE_EXCEEDED before tonic's own timer cancels the RPC) or `x-nereid-deadline-ms`,
//! capped by `--request-timeout-ms`. `ModelStreamInfer` forwards each request of a stream on
//! its own, at most [`MAX_STREAM_IN_FLIGHT`] at once per stream (then the stream stops reading,
//! and HTTP/2 flow control pushes back on the client), and answers in request order.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::Stream;
use futures::future::BoxFuture;
use nereid_proto::inference::grpc_inference_service_server::{GrpcInferenceService, GrpcInferenceServiceServer};
use nereid_proto::inference::*;
use nereid_worker::grpc::InferStream;
use nereid_worker::grpc::convert::grpc_timeout_deadline;
use nereid_worker::server::parse_version;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::codec::CompressionEncoding;
use tonic::codegen::BoxStream;
use tonic::{Request, Response};

use crate::admission::Permit;
use crate::call::{CallDeadline, DEADLINE_HEADER, parse_deadline_ms};
use crate::error::GatewayError;
use crate::ingress::{FORWARD_APPEND_BYTES, Ingress};
use crate::upstream::{HTTP2_CONNECTION_WINDOW, HTTP2_STREAM_WINDOW};
use crate::wire::{BytesCodec, InferRequest, StreamReply, WireEncode};

/// Most requests of one `ModelStreamInfer` stream in flight at once.
pub const MAX_STREAM_IN_FLIGHT: usize = 1024;
/// Most concurrent HTTP/2 streams (RPCs) per client connection.
const MAX_CONCURRENT_STREAMS: u32 = 4096;

pub const SERVER_NAME: &str = "nereid-gateway";
pub const SERVER_VERSION: &str = env!("CARGO_PKG_VERSION");
/// The KServe v2 / Triton protocol extensions the gateway implements.
pub const EXTENSIONS: &[&str] =
    &["binary_tensor_data", "classification", "model_configuration", "parameters", "statistics"];

type TonicResult<T> = Result<Response<T>, tonic::Status>;

#[derive(Clone)]
pub struct GatewayGrpc {
    ingress: Ingress,
}

/// The client's deadline from `grpc-timeout` or `x-nereid-deadline-ms`, the earlier of both.
fn client_deadline(metadata: &tonic::metadata::MetadataMap, now: Instant) -> Option<Instant> {
    deadline_from(|name| metadata.get(name)?.to_str().ok(), now)
}

/// [`client_deadline`] from a call's HTTP/2 headers, before tonic has made them metadata.
fn header_deadline(headers: &http::HeaderMap, now: Instant) -> Option<Instant> {
    deadline_from(|name| headers.get(name)?.to_str().ok(), now)
}

fn deadline_from<'a>(text: impl Fn(&str) -> Option<&'a str>, now: Instant) -> Option<Instant> {
    let grpc = text("grpc-timeout").and_then(|v| grpc_timeout_deadline(v, now));
    let header = text(DEADLINE_HEADER).and_then(|v| parse_deadline_ms(v, now));
    match (grpc, header) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

fn version_of(name: &str, version: &str) -> Result<Option<i64>, tonic::Status> {
    parse_version(name, version).map_err(|e| GatewayError::from(e).to_grpc())
}

#[tonic::async_trait]
impl GrpcInferenceService for GatewayGrpc {
    async fn server_live(&self, _: Request<ServerLiveRequest>) -> TonicResult<ServerLiveResponse> {
        Ok(Response::new(ServerLiveResponse { live: true }))
    }

    async fn server_ready(&self, _: Request<ServerReadyRequest>) -> TonicResult<ServerReadyResponse> {
        Ok(Response::new(ServerReadyResponse { ready: self.ingress.ready() }))
    }

    async fn model_ready(&self, request: Request<ModelReadyRequest>) -> TonicResult<ModelReadyResponse> {
        let deadline = self.ingress.deadline(client_deadline(request.metadata(), Instant::now()), Instant::now());
        let r = request.into_inner();
        let version = version_of(&r.name, &r.version)?;
        let ready = self.ingress.control.model_ready(&r.name, version, deadline).await.map_err(|e| e.to_grpc())?;
        Ok(Response::new(ModelReadyResponse { ready }))
    }

    async fn server_metadata(&self, _: Request<ServerMetadataRequest>) -> TonicResult<ServerMetadataResponse> {
        Ok(Response::new(ServerMetadataResponse {
            name: SERVER_NAME.to_string(),
            version: SERVER_VERSION.to_string(),
            extensions: EXTENSIONS.iter().map(|e| e.to_string()).collect(),
        }))
    }

    async fn model_metadata(&self, request: Request<ModelMetadataRequest>) -> TonicResult<ModelMetadataResponse> {
        let deadline = self.ingress.deadline(client_deadline(request.metadata(), Instant::now()), Instant::now());
        let r = request.into_inner();
        let version = version_of(&r.name, &r.version)?;
        let m = self.ingress.control.model_metadata(&r.name, version, deadline).await.map_err(|e| e.to_grpc())?;
        Ok(Response::new(m))
    }

    async fn model_config(&self, request: Request<ModelConfigRequest>) -> TonicResult<ModelConfigResponse> {
        let deadline = self.ingress.deadline(client_deadline(request.metadata(), Instant::now()), Instant::now());
        let r = request.into_inner();
        let version = version_of(&r.name, &r.version)?;
        let c = self.ingress.control.model_config(&r.name, version, deadline).await.map_err(|e| e.to_grpc())?;
        Ok(Response::new(c))
    }

    async fn model_statistics(&self, request: Request<ModelStatisticsRequest>) -> TonicResult<ModelStatisticsResponse> {
        let deadline = self.ingress.deadline(client_deadline(request.metadata(), Instant::now()), Instant::now());
        let r = request.into_inner();
        let version = version_of(&r.name, &r.version)?;
        let name = (!r.name.is_empty()).then_some(r.name.as_str());
        let s = self.ingress.control.model_statistics(name, version, deadline).await.map_err(|e| e.to_grpc())?;
        Ok(Response::new(s))
    }

    async fn repository_index(&self, request: Request<RepositoryIndexRequest>) -> TonicResult<RepositoryIndexResponse> {
        let r = request.into_inner();
        // As a worker (and Triton) answers a named repository.
        nereid_worker::grpc::check_repository_name(&r.repository_name)?;
        let models = self.ingress.control.repository_index(r.ready);
        Ok(Response::new(RepositoryIndexResponse { models }))
    }

    /// As a worker (a Triton built without tracing) answers.
    async fn trace_setting(&self, _: Request<TraceSettingRequest>) -> TonicResult<TraceSettingResponse> {
        Err(tonic::Status::unavailable(nereid_worker::grpc::TRACE_UNSUPPORTED))
    }
}

/// Serves the gRPC ingress on `listener` until `shutdown` is cancelled, then stops accepting
/// and lets open RPCs finish (open streams stop reading and end once answered). The caller
/// bounds the wait.
pub async fn serve(
    listener: TcpListener,
    ingress: Ingress,
    shutdown: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let max_request = ingress.max_request_bytes;
    // Every other method carries a few names and settings: held to the small bound HTTP holds
    // such bodies to, inflated included (they run with no admission place, on the event loop:
    // a compressed 64 MiB config request would stall every connection while it inflated).
    // Compressed ones are accepted: clients that compress on the whole channel say so on every
    // call.
    let control_limit = nereid_worker::http::SMALL_BODY_BYTES.min(max_request);
    let generated = GrpcInferenceServiceServer::new(GatewayGrpc { ingress: ingress.clone() })
        .max_decoding_message_size(control_limit)
        .max_encoding_message_size(usize::MAX)
        .accept_compressed(CompressionEncoding::Gzip)
        .accept_compressed(CompressionEncoding::Deflate);
    // grpc.health.v1 as a worker serves it: SERVING while the gateway is ready (not draining).
    let health = {
        let ingress = ingress.clone();
        nereid_proto::health::health_server::HealthServer::new(nereid_worker::grpc::Health::new(std::sync::Arc::new(
            move || ingress.ready(),
        )))
    };
    let service = InferenceService { generated, infer: InferHandler { ingress, shutdown: Arc::new(shutdown.clone()) } };
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(60)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        // Large fixed windows (as the worker's): bursts of small requests on small adaptive
        // windows trip h2's flood guard, failing every call on the connection.
        .initial_connection_window_size(Some(HTTP2_CONNECTION_WINDOW))
        .initial_stream_window_size(Some(HTTP2_STREAM_WINDOW))
        .max_concurrent_streams(Some(MAX_CONCURRENT_STREAMS))
        // tonic's own refusals (undecodable, too large, corrupt compression) get the codes a
        // worker answers them with, so a client sees the same through the gateway.
        .layer(tower::util::MapResponseLayer::new(nereid_worker::grpc::remap_transport_errors))
        // Compressed messages inflate on the blocking pool, not on the event loop (tonic would
        // inflate them inline, up to the limit, stalling every connection meanwhile).
        .layer(tower::util::MapRequestLayer::new(move |request: http::Request<tonic::body::Body>| {
            let limit = match request.uri().path() {
                MODEL_INFER_PATH | MODEL_STREAM_INFER_PATH => max_request,
                _ => control_limit,
            };
            nereid_worker::grpc::inflate::inflate_off_loop(request, limit)
        }))
        .add_service(health)
        .add_service(service)
        .serve_with_incoming_shutdown(incoming(listener), shutdown.cancelled_owned())
        .await
}

const MODEL_INFER_PATH: &str = "/inference.GRPCInferenceService/ModelInfer";
const MODEL_STREAM_INFER_PATH: &str = "/inference.GRPCInferenceService/ModelStreamInfer";

/// `inference.GRPCInferenceService`: `ModelInfer` and `ModelStreamInfer` are served on encoded
/// messages ([`BytesCodec`]: the tensors pass through undecoded), every other method by the
/// generated server (which answers UNIMPLEMENTED for the two infer methods, never reached).
#[derive(Clone)]
struct InferenceService {
    generated: GrpcInferenceServiceServer<GatewayGrpc>,
    infer: InferHandler,
}

impl tonic::server::NamedService for InferenceService {
    const NAME: &'static str = <GrpcInferenceServiceServer<GatewayGrpc> as tonic::server::NamedService>::NAME;
}

impl tower::Service<http::Request<tonic::body::Body>> for InferenceService {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, _cx: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut request: http::Request<tonic::body::Body>) -> Self::Future {
        let max_request = self.infer.ingress.max_request_bytes;
        match request.uri().path() {
            MODEL_INFER_PATH => {
                // Admitted before tonic reads (and buffers) the message; refused, it is never
                // read (the model it names is not known yet). The deadline runs from now.
                let arrived = Instant::now();
                let permit = match self.infer.ingress.admit(None, arrived) {
                    Ok(permit) => permit,
                    Err(e) => return Box::pin(futures::future::ready(Ok(e.to_grpc().into_http()))),
                };
                let client = header_deadline(request.headers(), arrived);
                let deadline = self.infer.ingress.call_deadline(client, arrived);
                let received = Arc::new(AtomicBool::new(false));
                request.extensions_mut().insert(Admitted { permit, deadline, received: received.clone() });
                let ingress = self.infer.ingress.clone();
                let handler = self.infer.clone();
                Box::pin(async move {
                    let mut grpc = bytes_server::<Bytes>(max_request);
                    let call = grpc.unary(handler, request);
                    tokio::pin!(call);
                    tokio::select! {
                        response = &mut call => {
                            // Refused by tonic before the handler saw the message (too large,
                            // compressed or not, or undecodable): counted as the handler counts
                            // its own refusals.
                            if !received.load(Ordering::Acquire) {
                                // Counted under the code the client gets (the server's layer
                                // remaps tonic's codes too; remapping twice changes nothing).
                                let response = nereid_worker::grpc::remap_transport_errors(response);
                                let code = response
                                    .headers()
                                    .get("grpc-status")
                                    .and_then(|v| v.to_str().ok()?.parse::<i32>().ok())
                                    .map_or(tonic::Code::Unknown, tonic::Code::from_i32);
                                ingress.refusals.count(None, code, arrived);
                                return Ok(response);
                            }
                            Ok(response)
                        }
                        // A client that sends its headers and then stalls holds its admission
                        // place until its deadline, no longer. (Once the message is in, the
                        // stack answers at the deadline itself.)
                        _ = tokio::time::sleep_until(deadline.at.into()) => {
                            if received.load(Ordering::Acquire) {
                                Ok(call.await)
                            } else {
                                ingress.refusals.count(None, tonic::Code::DeadlineExceeded, arrived);
                                let status = tonic::Status::deadline_exceeded(
                                    "the request's deadline passed before its message was received",
                                );
                                Ok(status.into_http())
                            }
                        }
                    }
                })
            }
            MODEL_STREAM_INFER_PATH => {
                let handler = self.infer.clone();
                Box::pin(async move { Ok(bytes_server::<StreamReply>(max_request).streaming(handler, request).await) })
            }
            _ => Box::pin(tower::Service::call(&mut self.generated, request)),
        }
    }
}

/// A server-side call on encoded messages, configured as the generated server is.
fn bytes_server<E: WireEncode>(max_request: usize) -> tonic::server::Grpc<BytesCodec<E>> {
    tonic::server::Grpc::new(BytesCodec::default())
        .accept_compressed(CompressionEncoding::Gzip)
        .accept_compressed(CompressionEncoding::Deflate)
        .max_decoding_message_size(max_request)
        .max_encoding_message_size(usize::MAX)
}

/// What the service hands a `ModelInfer` call it admitted, through the request's extensions.
#[derive(Clone)]
struct Admitted {
    permit: Permit,
    /// From the call's arrival, not from when its message was read.
    deadline: CallDeadline,
    /// Set once the message is in (tonic decoded it and called the handler).
    received: Arc<AtomicBool>,
}

/// The two infer methods, on encoded messages. Cloned per call: reference counts only (a
/// `CancellationToken`'s clone takes a lock).
#[derive(Clone)]
struct InferHandler {
    ingress: Ingress,
    /// When cancelled, open streams stop reading requests, finish those in flight and end.
    shutdown: Arc<CancellationToken>,
}

/// A request whose top-level framing is broken is refused here, naming the field; so is one
/// naming a shared-memory region: regions are registered with one worker, on its host, and the
/// gateway neither registers them nor knows which worker has them. So is one without room
/// under `max` (--max-request-bytes) for what forwarding appends: a worker with the same limit
/// would refuse it as too large, which a client reads as overload and retries.
fn decode_request(bytes: Bytes, max: usize) -> Result<InferRequest, tonic::Status> {
    if bytes.len().saturating_add(FORWARD_APPEND_BYTES) > max {
        return Err(tonic::Status::invalid_argument(format!(
            "the request takes {} bytes, which with the {FORWARD_APPEND_BYTES} bytes forwarding \
             may add is over the limit of {max} bytes (--max-request-bytes): send fewer or smaller tensors",
            bytes.len()
        )));
    }
    let uses_shm = crate::wire::uses_shared_memory(&bytes)
        .map_err(|reason| tonic::Status::invalid_argument(format!("malformed ModelInferRequest: {reason}")))?;
    if uses_shm {
        return Err(tonic::Status::invalid_argument(
            "system shared memory is not supported through the gateway; send the tensors in the request, \
             or send the request to a worker on your host directly",
        ));
    }
    InferRequest::from_bytes(bytes).map_err(|e| tonic::Status::invalid_argument(e.to_string()))
}

impl tonic::server::UnaryService<Bytes> for InferHandler {
    type Response = Bytes;
    type Future = BoxFuture<'static, TonicResult<Bytes>>;

    fn call(&mut self, request: Request<Bytes>) -> Self::Future {
        let ingress = self.ingress.clone();
        Box::pin(async move {
            let mut request = request;
            let (permit, deadline) = match request.extensions_mut().remove::<Admitted>() {
                Some(admitted) => {
                    admitted.received.store(true, Ordering::Release);
                    (Some(admitted.permit), admitted.deadline)
                }
                None => {
                    let now = Instant::now();
                    (None, ingress.call_deadline(client_deadline(request.metadata(), now), now))
                }
            };
            let request = decode_request(request.into_inner(), ingress.max_request_bytes).inspect_err(|status| {
                // Refused before the stack: counted as the stack counts its refusals.
                ingress.refusals.count(None, status.code(), Instant::now());
            })?;
            // Awaited in place: if the client goes away, tonic drops this future and with it the
            // forwarded call (the worker sees a cancelled RPC).
            let response = ingress.infer(request, deadline, permit).await.map_err(|e| e.to_grpc())?;
            Ok(Response::new(response.bytes))
        })
    }
}

impl tonic::server::StreamingService<Bytes> for InferHandler {
    type Response = StreamReply;
    type ResponseStream = BoxStream<StreamReply>;
    type Future = BoxFuture<'static, TonicResult<BoxStream<StreamReply>>>;

    fn call(&mut self, request: Request<tonic::Streaming<Bytes>>) -> Self::Future {
        // A stream's deadline bounds every request on it.
        let stream_deadline = client_deadline(request.metadata(), Instant::now());
        let ingress = self.ingress.clone();
        let stop = CancellationToken::clone(&self.shutdown).cancelled_owned();
        let run = move |bytes: Bytes| -> BoxFuture<'static, StreamReply> {
            let ingress = ingress.clone();
            Box::pin(async move {
                let result = match decode_request(bytes.clone(), ingress.max_request_bytes) {
                    Ok(request) => {
                        let deadline = ingress.call_deadline(stream_deadline, Instant::now());
                        let header = request.header.clone();
                        ingress.infer(request, deadline, None).await.map_err(|e| (e.to_grpc(), header))
                    }
                    Err(status) => {
                        ingress.refusals.count(None, status.code(), Instant::now());
                        // The refusal names the request it answers where its header can be read
                        // (refused for shared memory or its size), as a worker's does.
                        let header = InferRequest::from_bytes(bytes).map(|r| r.header).unwrap_or_default();
                        Err((status, header))
                    }
                };
                match result {
                    Ok(response) => StreamReply::Ok(response.bytes),
                    Err((status, header)) => StreamReply::Err(ModelStreamInferResponse {
                        error_message: status.message().to_string(),
                        infer_response: Some(ModelInferResponse {
                            model_name: header.model_name.clone(),
                            model_version: header.model_version.clone(),
                            id: header.id.clone(),
                            ..Default::default()
                        }),
                    }),
                }
            })
        };
        let weight_limit = self.ingress.max_request_bytes.saturating_mul(nereid_worker::grpc::STREAM_REQUEST_LIMITS);
        let stream = InferStream::new(request.into_inner(), run, MAX_STREAM_IN_FLIGHT)
            .weighed(weight_limit, Bytes::len, StreamReply::weight)
            .stop_on(stop);
        Box::pin(async move { Ok(Response::new(Box::pin(stream) as BoxStream<StreamReply>)) })
    }
}

/// Accepted connections with `TCP_NODELAY`; a short pause after an accept error (e.g. EMFILE)
/// instead of spinning.
fn incoming(listener: TcpListener) -> impl Stream<Item = Result<tokio::net::TcpStream, std::io::Error>> + Send {
    futures::stream::unfold(listener, |listener| async move {
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    if let Err(e) = stream.set_nodelay(true) {
                        tracing::debug!("grpc: cannot set TCP_NODELAY: {e}");
                    }
                    return Some((Ok(stream), listener));
                }
                Err(e) => {
                    tracing::warn!("grpc: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    })
}
