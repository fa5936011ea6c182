//! Forward: sends an [`InferCall`] to the worker the balancer picked, over that worker's pooled
//! HTTP/2 channel, with the call's remaining time as the outgoing `grpc-timeout`. The request's
//! tensors are not touched: the bytes received at ingress are sent as they are, and the
//! worker's answer comes back as bytes too ([`crate::wire`]).
//!
//! Each failure is classified once ([`FailureKind`]) by what it proves about the request — the
//! basis of both retry safety and outlier ejection — and the outcome is fed to the worker's
//! outlier detector. While the call is in flight it counts as outstanding on the worker.

pub mod client;

use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use nereid_common::Code;
use nereid_common::status::{is_ensemble_step_failure, is_queue_refusal};
use nereid_worker::grpc::convert::deadline_margin;
use prometheus::{IntCounter, IntCounterVec};
use tower::Service;

use crate::call::InferCall;
use crate::error::GatewayError;
use crate::outlier::Outcome;
use crate::upstream::{Upstream, UpstreamId};
use crate::wire::InferResponse;

const MODEL_INFER_PATH: &str = "/inference.GRPCInferenceService/ModelInfer";

/// What a failed call proves about whether the worker ran the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// It never reached the worker: the connection could not be made, refused the new stream,
    /// or failed with nothing written after the request was queued or without the worker ever
    /// speaking on it ([`client::CallError::Connect`]), or HTTP/2 says the worker did not
    /// process the stream (REFUSED_STREAM, or above the last stream id of a graceful GOAWAY — a
    /// worker shutting down). Safe to retry.
    NotSent,
    /// The worker answered UNAVAILABLE: draining, or the model is unloading — it did not run
    /// the request. Safe to retry elsewhere.
    Unavailable,
    /// The worker answered RESOURCE_EXHAUSTED (its queue is full) or UNAVAILABLE "Request
    /// timeout expired" (its queue policy timed the request out): it never ran the request.
    /// Safe to retry elsewhere; the worker is up (overloaded), so no mark against it.
    Refused,
    /// The connection broke while the request was in flight: the worker may have run it.
    Broken,
    /// The outgoing `grpc-timeout` expired on the client side.
    TimedOut,
    /// The worker answered with another error (the request's own problem). Passed through.
    Answered,
}

impl FailureKind {
    pub fn classify(status: &tonic::Status) -> FailureKind {
        let mut source = std::error::Error::source(status);
        let transport = source.is_some();
        while let Some(e) = source {
            if e.is::<tonic::ConnectError>() {
                return FailureKind::NotSent;
            }
            if e.is::<tonic::TimeoutExpired>() {
                return FailureKind::TimedOut;
            }
            if let Some(h2) = e.downcast_ref::<h2::Error>()
                && never_processed(h2)
            {
                return FailureKind::NotSent;
            }
            // hyper's client (tonic's Channel, used by control calls) fails a request as
            // *canceled* only when it was never written.
            if e.downcast_ref::<hyper::Error>().is_some_and(hyper::Error::is_canceled) {
                return FailureKind::NotSent;
            }
            source = e.source();
        }
        match status.code() {
            // A status tonic made from a transport error carries its cause; one the worker sent
            // in its trailers does not.
            _ if transport => FailureKind::Broken,
            // A queue-policy timeout (Triton's answer, and the worker's) or a full queue: the
            // request never ran in an overloaded worker — retry elsewhere, but it is no mark
            // against the worker's health. Only the scheduler's own refusals, by their exact
            // text: an ensemble's step refusal comes prefixed (earlier steps ran: not retried),
            // and any other RESOURCE_EXHAUSTED (an oversized message) would fail alike anywhere.
            tonic::Code::Unavailable if is_queue_refusal(Code::Unavailable, status.message()) => FailureKind::Refused,
            tonic::Code::ResourceExhausted if is_queue_refusal(Code::ResourceExhausted, status.message()) => {
                FailureKind::Refused
            }
            // An ensemble's failure in a step (a queue timeout, a composing model not ready):
            // earlier steps, and the step's siblings in its wave, may have run — answered as
            // it is, never run again elsewhere.
            tonic::Code::Unavailable if is_ensemble_step_failure(status.message()) => FailureKind::Answered,
            // The model not ready there (being unloaded, moved, or its load failed), the
            // worker itself healthy: retried elsewhere, no mark against the worker — whose
            // other models an ejection would take out of routing too.
            tonic::Code::Unavailable if is_model_not_ready(status.message()) => FailureKind::Refused,
            tonic::Code::Unavailable => FailureKind::Unavailable,
            _ => FailureKind::Answered,
        }
    }

    /// Whether the worker provably did not run the request.
    pub fn safe_to_retry(self) -> bool {
        matches!(self, FailureKind::NotSent | FailureKind::Unavailable | FailureKind::Refused)
    }

    /// What the failure says about the worker's health. A timeout — the gateway's, or the
    /// worker's DEADLINE_EXCEEDED — is the worker's failure when the gateway's own limit set the
    /// deadline (`deadline_is_gateways`: `--request-timeout-ms`, which no healthy worker should
    /// reach); when a client's tighter deadline did, a client timeout, which only many in a row
    /// turn into an ejection (see [`crate::outlier`]).
    pub fn outcome(self, code: tonic::Code, deadline_is_gateways: bool) -> Outcome {
        let timeout = if deadline_is_gateways { Outcome::Failure } else { Outcome::ClientTimeout };
        match self {
            FailureKind::NotSent | FailureKind::Unavailable | FailureKind::Broken => Outcome::Failure,
            FailureKind::TimedOut => timeout,
            FailureKind::Answered if code == tonic::Code::DeadlineExceeded => timeout,
            FailureKind::Answered if code == tonic::Code::Cancelled => Outcome::Neutral,
            FailureKind::Answered
                if matches!(code, tonic::Code::Internal | tonic::Code::Unknown | tonic::Code::DataLoss) =>
            {
                Outcome::ServerError
            }
            FailureKind::Answered | FailureKind::Refused => Outcome::Success,
        }
    }
}

/// A worker's answer that the model a request names is not ready there (the repository's own
/// words, never an ensemble step's, which come prefixed).
fn is_model_not_ready(message: &str) -> bool {
    message.starts_with("model '") && (message.contains("' is not ready") || message.contains("' has no ready version"))
}

/// Whether HTTP/2 guarantees the peer did not process the stream (RFC 9113 §8.7): it refused it
/// (REFUSED_STREAM), or it was above the last stream id of the peer's graceful GOAWAY (h2
/// reports those, and only those, as a *remote* GOAWAY with NO_ERROR; a connection that dies
/// afterwards fails the streams it did process with an I/O error instead).
fn never_processed(e: &h2::Error) -> bool {
    e.reason() == Some(h2::Reason::REFUSED_STREAM)
        || (e.is_go_away() && e.is_remote() && e.reason() == Some(h2::Reason::NO_ERROR))
}

/// A worker failed the call or answered with an error.
#[derive(Debug, thiserror::Error)]
#[error("{}", self.message())]
pub struct UpstreamError {
    pub worker: UpstreamId,
    pub status: tonic::Status,
    pub kind: FailureKind,
}

impl UpstreamError {
    /// The worker answered that `model` itself has no such version (its own NOT_FOUND, not an
    /// ensemble step's: those come prefixed, and earlier steps ran).
    pub fn is_version_gone(&self, model: &str) -> bool {
        self.kind == FailureKind::Answered
            && self.status.code() == tonic::Code::NotFound
            && self
                .status
                .message()
                .strip_prefix("model '")
                .and_then(|m| m.strip_prefix(model))
                .is_some_and(|m| m.starts_with("' has no version "))
    }

    pub fn new(worker: UpstreamId, status: tonic::Status) -> Self {
        let kind = FailureKind::classify(&status);
        UpstreamError { worker, status, kind }
    }

    /// The code the client gets: the worker's own answer as it is; a failed connection is
    /// UNAVAILABLE and an expired timeout DEADLINE_EXCEEDED, whatever tonic made of them.
    pub fn code(&self) -> tonic::Code {
        match self.kind {
            FailureKind::Answered | FailureKind::Unavailable | FailureKind::Refused => self.status.code(),
            FailureKind::NotSent | FailureKind::Broken => tonic::Code::Unavailable,
            FailureKind::TimedOut => tonic::Code::DeadlineExceeded,
        }
    }

    fn message(&self) -> String {
        match self.kind {
            // The worker's message names the offending field: pass it through unchanged.
            FailureKind::Answered | FailureKind::Unavailable | FailureKind::Refused => {
                self.status.message().to_string()
            }
            FailureKind::NotSent => format!("worker {} could not be reached: {}", self.worker, self.status.message()),
            FailureKind::Broken => format!("connection to worker {} failed: {}", self.worker, self.status.message()),
            FailureKind::TimedOut => {
                format!("worker {} did not answer before the deadline", self.worker)
            }
        }
    }
}

/// Records the outcome of a call on `worker`'s outlier detector; counts ejections.
/// `deadline_is_gateways`: see [`FailureKind::outcome`].
pub fn record_outcome(
    worker: &Upstream,
    result: Result<(), &UpstreamError>,
    deadline_is_gateways: bool,
    started: Instant,
    ejections: &IntCounter,
) {
    let outcome = match result {
        Ok(()) => Outcome::Success,
        // The attempt it waited on is counted by the call that made it.
        Err(e) if e.kind == FailureKind::NotSent && client::is_shared_connect_failure(&e.status) => Outcome::Neutral,
        Err(e) => e.kind.outcome(e.status.code(), deadline_is_gateways),
    };
    if worker.record(outcome, started, Instant::now()) {
        ejections.inc();
    }
}

/// The innermost service of the infer stack.
#[derive(Clone)]
pub struct Forward {
    ejections: IntCounter,
    connects: IntCounterVec,
}

impl Forward {
    /// `connects`: connection attempts by `result` (`ok` / `failed`).
    pub fn new(ejections: IntCounter, connects: IntCounterVec) -> Self {
        Forward { ejections, connects }
    }
}

impl Service<InferCall> for Forward {
    type Response = InferResponse;
    type Error = GatewayError;
    type Future = BoxFuture<'static, Result<InferResponse, GatewayError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), GatewayError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut call: InferCall) -> Self::Future {
        let ejections = self.ejections.clone();
        let connects = self.connects.clone();
        Box::pin(async move {
            let worker = call.target.clone().expect("the balancer sets the target before forwarding");
            let _outstanding = worker.start_request();
            let started = Instant::now();
            let timeout = outgoing_timeout(call.deadline, started);
            let on_connect = |ok: bool| connects.with_label_values(&[if ok { "ok" } else { "failed" }]).inc();
            // A call naming no version goes to the version the balancer resolved (and chose the
            // worker for), not to whatever the worker takes as its latest: they differ while a
            // new version is loading on some workers and not yet seen on others.
            let pin = match (call.version, call.resolved_version) {
                (None, Some(v)) => version_field(v),
                _ => bytes::Bytes::new(),
            };
            // Kept (a reference, no copy) only where a resend may need it.
            let unpinned = (!pin.is_empty()).then(|| call.request.bytes.clone());
            let body = std::mem::take(&mut call.request.bytes);
            let mut result = unary_bytes(&worker, MODEL_INFER_PATH, [body, pin], timeout, &on_connect).await;
            if let Some(body) = unpinned
                && result.as_ref().is_err_and(|e| e.is_version_gone(call.model()))
            {
                // The worker replaced the version the table still shows (a rollout the table
                // has not caught up with): without the pin it serves its latest, which is what
                // a request naming no version asks for.
                let timeout = outgoing_timeout(call.deadline, Instant::now());
                result =
                    unary_bytes(&worker, MODEL_INFER_PATH, [body, bytes::Bytes::new()], timeout, &on_connect).await;
            }
            record_outcome(&worker, result.as_ref().map(|_| ()), call.deadline_is_gateways, started, &ejections);
            let bytes = result?;
            // A worker's answer is well-formed; one that is not is the worker's failure.
            InferResponse::from_bytes(bytes).map_err(|e| {
                GatewayError::from(UpstreamError::new(worker.id.clone(), tonic::Status::internal(e.to_string())))
            })
        })
    }
}

/// `ModelInferRequest.model_version` (field 2, a string) set to `version`, encoded as a field
/// to append to an encoded request: protobuf takes the last occurrence of a field.
pub fn version_field(version: i64) -> bytes::Bytes {
    const MODEL_VERSION_KEY: u8 = (2 << 3) | 2;
    let digits = version.to_string();
    let mut out = Vec::with_capacity(2 + digits.len());
    out.push(MODEL_VERSION_KEY);
    out.push(digits.len() as u8); // at most 20 digits: a one-byte length
    out.extend_from_slice(digits.as_bytes());
    bytes::Bytes::from(out)
}

/// The `grpc-timeout` sent to the worker: the time left, less the worker's own margin
/// ([`deadline_margin`]), so that the worker — which alone knows whether the request ran —
/// answers DEADLINE_EXCEEDED (and counts it) before the gateway's own deadline cancels the call.
pub fn outgoing_timeout(deadline: Instant, now: Instant) -> std::time::Duration {
    let left = deadline.saturating_duration_since(now);
    left - deadline_margin(left)
}

/// One unary call on `worker`'s inference connection with an encoded request, bounded by
/// `timeout` (sent as `grpc-timeout` too); the answer stays encoded. The worker's in-band queue
/// report is recorded.
pub async fn unary_bytes(
    worker: &Upstream,
    path: &'static str,
    message: [bytes::Bytes; 2],
    timeout: Duration,
    on_connect: &(dyn Fn(bool) + Sync),
) -> Result<bytes::Bytes, UpstreamError> {
    let err = |status| UpstreamError::new(worker.id.clone(), status);
    let report = |headers: &http::HeaderMap| {
        if let Some(queue) = headers
            .get(nereid_common::fleet::QUEUE_REPORT_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
        {
            worker.report_queue(queue);
        }
    };
    let call = worker.infer_channel().unary_parts(path, message, timeout, on_connect);
    let (headers, response) = match tokio::time::timeout(timeout, call).await {
        Ok(Ok(answer)) => answer,
        // A worker's error answer carries its queue report too.
        Ok(Err(e)) => {
            let status = e.into_status();
            report(status.metadata().as_ref());
            return Err(err(status));
        }
        Err(_) => return Err(err(tonic::Status::from_error(Box::new(tonic::TimeoutExpired(()))))),
    };
    report(&headers);
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_answers_are_classified_by_code() {
        assert_eq!(FailureKind::classify(&tonic::Status::unavailable("draining")), FailureKind::Unavailable);
        assert_eq!(FailureKind::classify(&tonic::Status::invalid_argument("bad")), FailureKind::Answered);
        let full = tonic::Status::resource_exhausted("the model's request queue is full");
        assert_eq!(FailureKind::classify(&full), FailureKind::Refused);
        let timed_out = tonic::Status::unavailable(nereid_common::status::QUEUE_TIMEOUT_MESSAGE);
        assert_eq!(FailureKind::classify(&timed_out), FailureKind::Refused);
        assert_eq!(UpstreamError::new("w:1".into(), timed_out).code(), tonic::Code::Unavailable);
        // Not the scheduler's refusals: an ensemble step's (earlier steps ran) and an
        // oversized message (every worker would refuse it).
        let step = format!("ensemble 'e' step 1 (model 'm'): {}", nereid_common::status::QUEUE_TIMEOUT_MESSAGE);
        assert_eq!(FailureKind::classify(&tonic::Status::unavailable(step)), FailureKind::Answered);
        let step_full = tonic::Status::resource_exhausted("ensemble 'e' step 1 (model 'm'): the model's request queue");
        assert_eq!(FailureKind::classify(&step_full), FailureKind::Answered);
        // A step whose composing model is not ready: the steps before it ran; not run again.
        let step_unready = nereid_common::status::ensemble_step_message("e", 1, "m", "model 'm' is not ready");
        assert_eq!(FailureKind::classify(&tonic::Status::unavailable(step_unready)), FailureKind::Answered);
        // The ensemble itself not ready: nothing ran.
        // The model not ready on that worker (being moved off it): nothing ran, retried
        // elsewhere, and no mark against the worker's health (its other models serve on).
        let unready = tonic::Status::unavailable("model 'e' is not ready (UNAVAILABLE)");
        assert_eq!(FailureKind::classify(&unready), FailureKind::Refused);
        assert_eq!(FailureKind::Refused.outcome(tonic::Code::Unavailable, true), Outcome::Success);
        let no_version = tonic::Status::unavailable("model 'e' has no ready version");
        assert_eq!(FailureKind::classify(&no_version), FailureKind::Refused);
        let too_large = tonic::Status::resource_exhausted("decoded message length too large");
        assert_eq!(FailureKind::classify(&too_large), FailureKind::Answered);
        // Only the model's own "no such version", not an ensemble step's.
        let gone = |m: &str| UpstreamError::new("w:1".into(), tonic::Status::not_found(m.to_string()));
        assert!(gone("model 'm' has no version 2 (ready versions: 3)").is_version_gone("m"));
        assert!(!gone("model 'mm' has no version 2 (ready versions: 3)").is_version_gone("m"));
        assert!(!gone("ensemble 'm' step 1 (model 's'): model 's' has no version 2").is_version_gone("m"));
        let level = tonic::Status::resource_exhausted(nereid_common::status::LEVEL_QUEUE_FULL_MESSAGE);
        assert_eq!(FailureKind::classify(&level), FailureKind::Refused);
        assert!(FailureKind::Refused.safe_to_retry());
        assert_eq!(FailureKind::Refused.outcome(tonic::Code::ResourceExhausted, true), Outcome::Success);
        assert_eq!(UpstreamError::new("w:1".into(), full).code(), tonic::Code::ResourceExhausted);
        assert!(FailureKind::Unavailable.safe_to_retry());
        assert!(FailureKind::NotSent.safe_to_retry());
        assert!(!FailureKind::Broken.safe_to_retry());
        assert!(!FailureKind::Answered.safe_to_retry());
        for own in [false, true] {
            assert_eq!(FailureKind::Answered.outcome(tonic::Code::InvalidArgument, own), Outcome::Success);
            assert_eq!(FailureKind::Answered.outcome(tonic::Code::Cancelled, own), Outcome::Neutral);
            assert_eq!(FailureKind::Answered.outcome(tonic::Code::Internal, own), Outcome::ServerError);
            assert_eq!(FailureKind::Broken.outcome(tonic::Code::Unknown, own), Outcome::Failure);
            assert_eq!(FailureKind::NotSent.outcome(tonic::Code::Unavailable, own), Outcome::Failure);
        }
        // Timeouts count against the worker only when the gateway's own limit set the deadline.
        assert_eq!(FailureKind::Answered.outcome(tonic::Code::DeadlineExceeded, false), Outcome::ClientTimeout);
        assert_eq!(FailureKind::TimedOut.outcome(tonic::Code::DeadlineExceeded, false), Outcome::ClientTimeout);
        assert_eq!(FailureKind::Answered.outcome(tonic::Code::DeadlineExceeded, true), Outcome::Failure);
        assert_eq!(FailureKind::TimedOut.outcome(tonic::Code::DeadlineExceeded, true), Outcome::Failure);
    }

    #[test]
    fn an_appended_version_field_overrides_the_request_s() {
        use nereid_proto::inference::ModelInferRequest;
        use prost::Message;
        for (named, pinned) in [("", 3i64), ("7", 12345678901234)] {
            let mut bytes =
                ModelInferRequest { model_name: "m".into(), model_version: named.into(), ..Default::default() }
                    .encode_to_vec();
            bytes.extend_from_slice(&version_field(pinned));
            let decoded = ModelInferRequest::decode(bytes.as_slice()).unwrap();
            assert_eq!((decoded.model_name.as_str(), decoded.model_version), ("m", pinned.to_string()));
        }
    }

    #[test]
    fn the_worker_gets_slightly_less_time_than_the_gateway() {
        let now = Instant::now();
        let t = |ms| outgoing_timeout(now + std::time::Duration::from_millis(ms), now).as_micros();
        assert_eq!(t(1000), 995_000);
        assert_eq!(t(16), 14_000);
        assert_eq!(t(0), 0);
    }

    #[test]
    fn transport_errors_are_classified_by_cause() {
        let connect = tonic::Status::from_error(Box::new(tonic::ConnectError(Box::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionRefused,
        )))));
        assert_eq!(connect.code(), tonic::Code::Unavailable);
        assert_eq!(FailureKind::classify(&connect), FailureKind::NotSent);
        let refused = tonic::Status::from_error(Box::new(h2::Error::from(h2::Reason::REFUSED_STREAM)));
        assert_eq!(FailureKind::classify(&refused), FailureKind::NotSent);
        let reset = tonic::Status::from_error(Box::new(h2::Error::from(h2::Reason::INTERNAL_ERROR)));
        assert_eq!(FailureKind::classify(&reset), FailureKind::Broken);
        let e = UpstreamError::new("w:1".into(), reset);
        assert_eq!(e.code(), tonic::Code::Unavailable);
        assert!(e.to_string().contains("worker w:1"), "{e}");
    }
}
