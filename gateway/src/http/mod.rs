//! HTTP ingress: the KServe v2 REST API on the same paths, JSON shapes and status codes as a
//! worker (and tritonserver). An infer body (JSON, or JSON + binary tensor extension) is parsed
//! once by the worker's own parser, converted into a gRPC `ModelInferRequest` with raw tensors,
//! sent down the [`crate::stack`], and the worker's answer rendered back by the worker's own
//! renderer — so HTTP through the gateway answers byte for byte what a worker would.
//!
//! Errors are `{"error": "..."}` with the status of their code; 429 carries `Retry-After`.
//! Request bodies may be gzip / deflate (`Content-Encoding`, inflated with the size limit on the
//! inflated bytes); responses are compressed when the client's `Accept-Encoding` asks for it.

mod convert;

use std::collections::HashMap;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Json, Router};
use bytes::Bytes;
use nereid_common::Status;
use nereid_common::config::config_to_json;
use nereid_worker::http::SMALL_BODY_BYTES;
use nereid_worker::http::{
    HEADER_CONTENT_LENGTH, ParsedInfer, index_json, infer_response, model_metadata_json, parse_index_request,
    parse_infer_request, parse_raw_binary_request, render_infer_response, stats_json,
};
use nereid_worker::server::parse_version;
use serde_json::{Value, json};

use self::convert::{
    index_entry_from_proto, infer_request_to_proto, infer_response_from_proto, metadata_from_proto, stats_from_proto,
};
use crate::admission::Permit;
use crate::call::{CallDeadline, DEADLINE_HEADER, parse_deadline_ms};
use crate::error::GatewayError;
use crate::grpc::{EXTENSIONS, SERVER_NAME, SERVER_VERSION};
use crate::ingress::FORWARD_APPEND_BYTES;
use crate::ingress::Ingress;
use crate::metrics::GatewayMetrics;
use crate::routing::Routes;
use crate::wire::InferRequest;

/// Bodies larger than this are parsed / rendered on the blocking pool.
const OFFLOAD_JSON_BYTES: usize = 256 << 10;
/// Requests larger than this are converted on the blocking pool even when their JSON part is
/// small: encoding copies the binary section once.
const OFFLOAD_COPY_BYTES: usize = 4 << 20;

/// The `{model}` / `{version}` path segments. A path that does not decode (not UTF-8) is
/// answered in JSON, as every other error is.
struct ModelPath(HashMap<String, String>);

impl<S: Send + Sync> axum::extract::FromRequestParts<S> for ModelPath {
    type Rejection = GatewayError;

    async fn from_request_parts(parts: &mut axum::http::request::Parts, state: &S) -> Result<Self, GatewayError> {
        Path::<HashMap<String, String>>::from_request_parts(parts, state)
            .await
            .map(|Path(params)| ModelPath(params))
            .map_err(|e| Status::invalid(e.body_text()).into())
    }
}

/// The KServe v2 HTTP API of the gateway.
pub fn router(ingress: Ingress) -> Router {
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
        .route("/v2/repository/models/{model}/load", post(repository_control))
        .route("/v2/repository/models/{model}/unload", post(repository_control))
        .route("/v2/systemsharedmemory/{*rest}", any(shared_memory))
        .route("/v2/cudasharedmemory/{*rest}", any(shared_memory))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(ingress)
}

/// Largest `POST /v2/logging` body.
const MAX_LOG_SETTINGS_BYTES: usize = 64 << 10;

async fn get_logging() -> Json<Value> {
    Json(nereid_worker::http::log_settings_json())
}

/// The gateway's own log settings (each worker has its own).
async fn post_logging(headers: HeaderMap, body: Body) -> Result<Json<Value>, GatewayError> {
    let body = read_body(&headers, body, MAX_LOG_SETTINGS_BYTES).await?;
    nereid_common::telemetry::log_settings().apply(&nereid_worker::http::parse_log_settings(&body)?)?;
    Ok(Json(nereid_worker::http::log_settings_json()))
}

/// `GET /metrics` on the metrics port, and the gateway's log settings (Triton's `/v2/logging`):
/// an operator's port, not the clients' ingress, where any tenant could turn on TRACE.
pub fn metrics_router(metrics: GatewayMetrics, routes: Routes) -> Router {
    Router::new()
        .route("/v2/logging", get(get_logging).post(post_logging))
        .route(
            "/metrics",
            get(move || {
                let text = metrics.render(&routes.snapshot(), Instant::now());
                async move {
                    (
                        [(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"))],
                        text,
                    )
                }
            }),
        )
        .fallback(not_found)
}

impl IntoResponse for GatewayError {
    fn into_response(self) -> Response {
        let mut response = (
            self.http_status(),
            [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))],
            self.json_body(),
        )
            .into_response();
        if let Some(after) = self.retry_after() {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(after.as_secs().max(1)));
        }
        response
    }
}

async fn not_found(uri: Uri) -> GatewayError {
    Status::not_found(format!("no endpoint at '{}'", uri.path())).into()
}

async fn method_not_allowed(method: Method, uri: Uri) -> Response {
    let body = json!({ "error": format!("method {method} is not allowed for '{}'", uri.path()) }).to_string();
    (StatusCode::METHOD_NOT_ALLOWED, [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))], body)
        .into_response()
}

/// The `{model}` and optional `{version}` path segments.
fn model_ref(params: &HashMap<String, String>) -> Result<(String, Option<i64>), GatewayError> {
    let name = params.get("model").cloned().unwrap_or_default();
    let version = parse_version(&name, params.get("version").map_or("", String::as_str))?;
    Ok((name, version))
}

/// The deadline of an HTTP request: `x-nereid-deadline-ms`, capped by the gateway's limit.
fn deadline(ingress: &Ingress, headers: &HeaderMap, now: Instant) -> Instant {
    call_deadline(ingress, headers, now).at
}

fn call_deadline(ingress: &Ingress, headers: &HeaderMap, now: Instant) -> CallDeadline {
    let client = headers.get(DEADLINE_HEADER).and_then(|v| v.to_str().ok()).and_then(|v| parse_deadline_ms(v, now));
    ingress.call_deadline(client, now)
}

fn ok_or_400(ok: bool) -> StatusCode {
    if ok { StatusCode::OK } else { StatusCode::BAD_REQUEST }
}

async fn server_metadata() -> Json<Value> {
    Json(json!({ "name": SERVER_NAME, "version": SERVER_VERSION, "extensions": EXTENSIONS }))
}

async fn health_live() -> StatusCode {
    StatusCode::OK
}

async fn health_ready(State(ingress): State<Ingress>) -> StatusCode {
    ok_or_400(ingress.ready())
}

async fn model_ready(
    State(ingress): State<Ingress>,
    ModelPath(params): ModelPath,
    headers: HeaderMap,
) -> Result<StatusCode, GatewayError> {
    let (name, version) = model_ref(&params)?;
    let ready = ingress.control.model_ready(&name, version, deadline(&ingress, &headers, Instant::now())).await?;
    Ok(ok_or_400(ready))
}

async fn model_metadata(
    State(ingress): State<Ingress>,
    ModelPath(params): ModelPath,
    headers: HeaderMap,
) -> Result<Json<Value>, GatewayError> {
    let (name, version) = model_ref(&params)?;
    let m = ingress.control.model_metadata(&name, version, deadline(&ingress, &headers, Instant::now())).await?;
    Ok(Json(model_metadata_json(&metadata_from_proto(m))))
}

async fn model_config(
    State(ingress): State<Ingress>,
    ModelPath(params): ModelPath,
    headers: HeaderMap,
) -> Result<Json<Value>, GatewayError> {
    let (name, version) = model_ref(&params)?;
    let c = ingress.control.model_config(&name, version, deadline(&ingress, &headers, Instant::now())).await?;
    Ok(Json(c.config.as_ref().map(config_to_json).unwrap_or_else(|| json!({}))))
}

async fn model_stats(
    State(ingress): State<Ingress>,
    ModelPath(params): ModelPath,
    headers: HeaderMap,
) -> Result<Json<Value>, GatewayError> {
    let (name, version) = model_ref(&params)?;
    let s =
        ingress.control.model_statistics(Some(&name), version, deadline(&ingress, &headers, Instant::now())).await?;
    let stats: Vec<_> = s.model_stats.into_iter().map(stats_from_proto).collect();
    Ok(Json(stats_json(&stats)))
}

async fn all_model_stats(State(ingress): State<Ingress>, headers: HeaderMap) -> Result<Json<Value>, GatewayError> {
    let s = ingress.control.model_statistics(None, None, deadline(&ingress, &headers, Instant::now())).await?;
    let stats: Vec<_> = s.model_stats.into_iter().map(stats_from_proto).collect();
    Ok(Json(stats_json(&stats)))
}

async fn repository_index(
    State(ingress): State<Ingress>,
    headers: HeaderMap,
    body: Body,
) -> Result<Json<Value>, GatewayError> {
    // Only a setting: a small body, read within the request's deadline.
    let deadline = deadline(&ingress, &headers, Instant::now());
    let body = read_body_by(deadline, &headers, body, SMALL_BODY_BYTES.min(ingress.max_request_bytes)).await?;
    let ready = parse_index_request(&body)?;
    let rows: Vec<_> = ingress.control.repository_index(ready).into_iter().map(index_entry_from_proto).collect();
    Ok(Json(index_json(&rows)))
}

async fn shared_memory(uri: Uri) -> GatewayError {
    Status::unimplemented(format!(
        "'{}': shared memory is not supported through the gateway (its workers may run on other hosts); \
         register regions with a worker on your host and send to it directly",
        uri.path()
    ))
    .into()
}

async fn repository_control(uri: Uri) -> GatewayError {
    Status::unimplemented(format!(
        "'{}': the gateway does not load or unload models; placement decides what workers serve",
        uri.path()
    ))
    .into()
}

/// Reads a request body exactly as a worker does (the worker's reader): a declared or actual
/// size over `max` is refused before it is buffered, and a gzip / deflate body is inflated with
/// `max` bounding the inflated size too.
async fn read_body(headers: &HeaderMap, body: Body, max: usize) -> Result<Bytes, GatewayError> {
    Ok(nereid_worker::http::read_body(headers, body, max).await?)
}

/// [`read_body`] within `deadline`: a body trickled in slowly holds its buffer no longer.
async fn read_body_by(deadline: Instant, headers: &HeaderMap, body: Body, max: usize) -> Result<Bytes, GatewayError> {
    tokio::time::timeout_at(deadline.into(), read_body(headers, body, max)).await.map_err(|_| {
        GatewayError::from(Status::new(
            nereid_common::Code::DeadlineExceeded,
            "the request's deadline passed before its body was received",
        ))
    })?
}

/// Infer responses are compressed (when the client accepts it) only above this size, as a
/// worker does.
const COMPRESS_MIN_BYTES: usize = 1 << 10;

/// Runs `f` on the blocking pool when `heavy`, inline otherwise. The request's admission place
/// goes with it: work left running on the blocking pool by a request that went away (its
/// client disconnected, or its deadline passed) still counts against --max-concurrent-requests
/// until it ends, so requests that leave cannot pile up work outside the limit.
async fn maybe_offload<T: Send + 'static>(
    heavy: bool,
    admitted: &Permit,
    f: impl FnOnce() -> Result<T, Status> + Send + 'static,
) -> Result<T, GatewayError> {
    if heavy {
        let admitted = admitted.clone();
        Ok(tokio::task::spawn_blocking(move || {
            let _admitted = admitted;
            f()
        })
        .await
        .map_err(|e| Status::internal(format!("request conversion task failed: {e}")))??)
    } else {
        Ok(f()?)
    }
}

async fn infer(
    State(ingress): State<Ingress>,
    ModelPath(params): ModelPath,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, GatewayError> {
    let now = Instant::now();
    let deadline = call_deadline(&ingress, &headers, now);
    let (name, version) = model_ref(&params)?;
    // A model (version) no worker holds is answered before the body is read, converted and
    // handed to the stack only to be refused there.
    if let Err(e) = ingress.routes.snapshot().resolve(&name, version) {
        let e = GatewayError::from(e);
        ingress.refusals.count(Some((&name, version)), e.grpc_code(), now);
        return Err(e);
    }
    // Admitted before the body is read: an overloaded gateway buffers nothing.
    let permit = ingress.admit(Some((&name, version)), now)?;
    // Refused once admitted (a malformed header or body, a stalled upload, a request too large
    // once converted): counted in the request metrics, as the stack counts what it refuses.
    let prepared = async {
        let header_length = match headers.get(HEADER_CONTENT_LENGTH) {
            None => None,
            Some(v) => Some(v.to_str().ok().and_then(|s| s.trim().parse::<usize>().ok()).ok_or_else(|| {
                Status::invalid(format!("Inference-Header-Content-Length must be a non-negative integer, got {v:?}"))
            })?),
        };
        let max = ingress.max_request_bytes;
        // A body trickled in slowly holds its buffer: the request's deadline bounds the upload too.
        let body = read_body_by(deadline.at, &headers, body, max).await?;

        // Triton's raw binary request (no JSON: the body is the only input's data) is shaped
        // by the model's config, asked of a worker holding the model.
        let raw_config = match header_length {
            Some(0) => Some(ingress.control.shape_config(&name, version, deadline.at).await?),
            _ => None,
        };
        let heavy =
            header_length.unwrap_or(body.len()).min(body.len()) > OFFLOAD_JSON_BYTES || body.len() > OFFLOAD_COPY_BYTES;
        // Converted once, to the encoded gRPC request the stack forwards as it is.
        let model = name.clone();
        let (request, format) = maybe_offload(heavy, &permit, move || {
            let ParsedInfer { request, format } = match raw_config {
                Some(config) => parse_raw_binary_request(&model, version, body, &config)?,
                None => parse_infer_request(&model, version, body, header_length, max, None)?,
            };
            let proto = infer_request_to_proto(request);
            // The parser bounds the tensors together; the message adds names, shapes and what
            // forwarding appends, which can still take it past the limit — the worker would then
            // refuse it with a size the client never sent.
            let encoded = prost::Message::encoded_len(&proto);
            if encoded.saturating_add(FORWARD_APPEND_BYTES) > max {
                return Err(Status::invalid(format!(
                    "the request's tensors take {encoded} bytes once converted, which with the \
                     {FORWARD_APPEND_BYTES} bytes forwarding may add is over the limit of {max} bytes \
                     (--max-request-bytes): send fewer or smaller tensors, or binary data"
                )));
            }
            Ok((InferRequest::encode(&proto), format))
        })
        .await?;
        Ok::<_, GatewayError>((request, format))
    }
    .await;
    let (request, format) = match prepared {
        Ok(prepared) => prepared,
        Err(e) => {
            ingress.refusals.count(Some((&name, version)), e.grpc_code(), now);
            return Err(e);
        }
    };

    // Awaited here: if the client goes away, this future and the forwarded call are dropped.
    // (A clone stays for rendering the answer, which is part of the request too.)
    let response = ingress.infer(request, deadline, Some(permit.clone())).await?;

    let heavy = response.bytes.len() > OFFLOAD_JSON_BYTES / 4;
    let rendered = maybe_offload(heavy, &permit, move || {
        let response = response
            .decode()
            .map_err(|e| Status::internal(format!("the worker's answer could not be decoded: {e}")))?;
        let response = infer_response_from_proto(response)?;
        render_infer_response(&response, &format)
    })
    .await?;
    // Compressed like a worker compresses it, when the client accepts it and it is worth it.
    match nereid_worker::http::response_coding(&headers) {
        Some(coding) if rendered.total_len() > COMPRESS_MIN_BYTES => {
            let heavy = rendered.total_len() > OFFLOAD_JSON_BYTES;
            maybe_offload(heavy, &permit, move || nereid_worker::http::compressed_infer_response(rendered, coding))
                .await
        }
        _ => Ok(infer_response(rendered)),
    }
}

/// Serves `router` on `listener` until `shutdown` is cancelled, then finishes the requests in
/// flight (the worker's HTTP server loop: HTTP/1.1 keep-alive and h2, `TCP_NODELAY`).
pub use nereid_worker::http::serve;
