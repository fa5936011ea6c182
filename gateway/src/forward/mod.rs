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
    /// It never reached the worker: the connection could not be made or refused the new stream
    /// before the request was queued on it ([`client::CallError::Connect`]), or HTTP/2 says the
    /// worker did not process the stream (REFUSED_STREAM, or above the last stream id of a
    /// graceful GOAWAY — a worker shutting down). Safe to retry. (A connection that dies while
    /// a queued request still waits to be written fails it as Broken: h2 does not say whether
    /// it was written, so it is not retried.)
    NotSent,
    /// The worker answered UNAVAILABLE: draining, or the model is unloading — it did not run
    /// the request. Safe to retry elsewhere.
    Unavailable,
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
            tonic::Code::Unavailable => FailureKind::Unavailable,
            _ => FailureKind::Answered,
        }
    }

    /// Whether the worker provably did not run the request.
    pub fn safe_to_retry(self) -> bool {
        matches!(self, FailureKind::NotSent | FailureKind::Unavailable)
    }

    /// What the failure says about the worker's health.
    pub fn outcome(self, code: tonic::Code) -> Outcome {
        match self {
            FailureKind::NotSent | FailureKind::Unavailable | FailureKind::Broken => Outcome::Failure,
            FailureKind::TimedOut => Outcome::Neutral,
            FailureKind::Answered if matches!(code, tonic::Code::DeadlineExceeded | tonic::Code::Cancelled) => {
                Outcome::Neutral
            }
            FailureKind::Answered => Outcome::Success,
        }
    }
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
    pub fn new(worker: UpstreamId, status: tonic::Status) -> Self {
        let kind = FailureKind::classify(&status);
        UpstreamError { worker, status, kind }
    }

    /// The code the client gets: the worker's own answer as it is; a failed connection is
    /// UNAVAILABLE and an expired timeout DEADLINE_EXCEEDED, whatever tonic made of them.
    pub fn code(&self) -> tonic::Code {
        match self.kind {
            FailureKind::Answered | FailureKind::Unavailable => self.status.code(),
            FailureKind::NotSent | FailureKind::Broken => tonic::Code::Unavailable,
            FailureKind::TimedOut => tonic::Code::DeadlineExceeded,
        }
    }

    fn message(&self) -> String {
        match self.kind {
            // The worker's message names the offending field: pass it through unchanged.
            FailureKind::Answered | FailureKind::Unavailable => self.status.message().to_string(),
            FailureKind::NotSent => format!("worker {} could not be reached: {}", self.worker, self.status.message()),
            FailureKind::Broken => format!("connection to worker {} failed: {}", self.worker, self.status.message()),
            FailureKind::TimedOut => {
                format!("worker {} did not answer before the deadline", self.worker)
            }
        }
    }
}

/// Records the outcome of a call on `worker`'s outlier detector; counts ejections.
pub fn record_outcome(worker: &Upstream, result: Result<(), &UpstreamError>, ejections: &IntCounter) {
    let outcome = match result {
        Ok(()) => Outcome::Success,
        Err(e) => e.kind.outcome(e.status.code()),
    };
    if worker.record(outcome, Instant::now()) {
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

    fn call(&mut self, call: InferCall) -> Self::Future {
        let ejections = self.ejections.clone();
        let connects = self.connects.clone();
        Box::pin(async move {
            let worker = call.target.clone().expect("the balancer sets the target before forwarding");
            let _outstanding = worker.start_request();
            let timeout = outgoing_timeout(call.deadline, Instant::now());
            let on_connect = |ok: bool| connects.with_label_values(&[if ok { "ok" } else { "failed" }]).inc();
            let result = unary_bytes(&worker, MODEL_INFER_PATH, call.request.bytes, timeout, &on_connect).await;
            record_outcome(&worker, result.as_ref().map(|_| ()), &ejections);
            let bytes = result?;
            // A worker's answer is well-formed; one that is not is the worker's failure.
            InferResponse::from_bytes(bytes).map_err(|e| {
                GatewayError::from(UpstreamError::new(worker.id.clone(), tonic::Status::internal(e.to_string())))
            })
        })
    }
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
    message: bytes::Bytes,
    timeout: Duration,
    on_connect: &(dyn Fn(bool) + Sync),
) -> Result<bytes::Bytes, UpstreamError> {
    let err = |status| UpstreamError::new(worker.id.clone(), status);
    let call = worker.infer_channel().unary(path, message, timeout, on_connect);
    let (headers, response) = match tokio::time::timeout(timeout, call).await {
        Ok(result) => result.map_err(|e| err(e.into_status()))?,
        Err(_) => return Err(err(tonic::Status::from_error(Box::new(tonic::TimeoutExpired(()))))),
    };
    if let Some(queue) = headers
        .get(nereid_common::fleet::QUEUE_REPORT_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
    {
        worker.report_queue(queue);
    }
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_answers_are_classified_by_code() {
        assert_eq!(FailureKind::classify(&tonic::Status::unavailable("draining")), FailureKind::Unavailable);
        assert_eq!(FailureKind::classify(&tonic::Status::invalid_argument("bad")), FailureKind::Answered);
        assert!(FailureKind::Unavailable.safe_to_retry());
        assert!(FailureKind::NotSent.safe_to_retry());
        assert!(!FailureKind::Broken.safe_to_retry());
        assert!(!FailureKind::Answered.safe_to_retry());
        assert_eq!(FailureKind::Answered.outcome(tonic::Code::InvalidArgument), Outcome::Success);
        assert_eq!(FailureKind::Answered.outcome(tonic::Code::DeadlineExceeded), Outcome::Neutral);
        assert_eq!(FailureKind::Broken.outcome(tonic::Code::Unknown), Outcome::Failure);
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
