//! Every way a gateway request fails, typed where it happens, and rendered to a status here
//! and only here: [`GatewayError::to_grpc`] for gRPC, [`GatewayError::http_status`] +
//! [`GatewayError::json_body`] (+ `Retry-After`) for HTTP. Metrics label failures by
//! [`code_label`], a closed set — never by message text.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::StatusCode;

use crate::admission::Overloaded;
use crate::deadline::DeadlineExceeded;
use crate::forward::UpstreamError;
use crate::routing::RouteError;

/// What an overloaded client is told to wait before retrying.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// No worker can serve the model (version): NOT_FOUND or UNAVAILABLE.
    #[error(transparent)]
    Route(#[from] RouteError),
    /// Admission refused the request: RESOURCE_EXHAUSTED / 429 + Retry-After.
    #[error(transparent)]
    Overloaded(#[from] Overloaded),
    /// The deadline passed: DEADLINE_EXCEEDED / 504.
    #[error(transparent)]
    DeadlineExceeded(#[from] DeadlineExceeded),
    /// The worker failed or answered with an error.
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    /// The client's request is malformed (refused before any worker saw it), with the code the
    /// parser chose (INVALID_ARGUMENT, NOT_FOUND for a bad version, UNIMPLEMENTED, ...).
    #[error("{}", .0.message)]
    BadRequest(nereid_common::Status),
}

impl From<nereid_common::Status> for GatewayError {
    fn from(s: nereid_common::Status) -> Self {
        GatewayError::BadRequest(s)
    }
}

impl GatewayError {
    pub fn grpc_code(&self) -> tonic::Code {
        match self {
            GatewayError::Route(RouteError::ModelNotFound { .. } | RouteError::VersionNotFound { .. }) => {
                tonic::Code::NotFound
            }
            GatewayError::Route(RouteError::NoReadyWorker { .. }) => tonic::Code::Unavailable,
            GatewayError::Overloaded(_) => tonic::Code::ResourceExhausted,
            GatewayError::DeadlineExceeded(_) => tonic::Code::DeadlineExceeded,
            GatewayError::Upstream(e) => e.code(),
            GatewayError::BadRequest(s) => s.code.grpc_code(),
        }
    }

    pub fn http_status(&self) -> StatusCode {
        http_status(self.grpc_code())
    }

    /// How long the client should wait before trying again, where that helps: on every 429
    /// (the gateway's admission, or a worker's full queue passed through).
    pub fn retry_after(&self) -> Option<Duration> {
        (self.grpc_code() == tonic::Code::ResourceExhausted).then_some(RETRY_AFTER)
    }

    pub fn to_grpc(&self) -> tonic::Status {
        self.log();
        tonic::Status::new(self.grpc_code(), self.message())
    }

    /// The KServe v2 HTTP error body, `{"error": "..."}`.
    pub fn json_body(&self) -> String {
        self.log();
        serde_json::json!({ "error": self.message() }).to_string()
    }

    /// The message, cut as a worker cuts its own (it may quote a client's model name of any
    /// length, which a gRPC trailer must not carry whole).
    fn message(&self) -> String {
        nereid_common::Status::new(nereid_common::Code::Internal, self.to_string()).message
    }

    /// Server-side failures are logged at WARN, at most one line a second (with how many were
    /// left out since the last): during an outage every request fails, and a line per request
    /// would flood the log on the request path. The rest, and the ones left out, at DEBUG.
    fn log(&self) {
        let code = code_label(self.grpc_code());
        if self.http_status().is_server_error() && WARN_LIMIT.admit(Instant::now()) {
            let suppressed = WARN_LIMIT.take_suppressed();
            tracing::warn!(code, suppressed, "{self}");
        } else {
            tracing::debug!(code, "{self}");
        }
    }
}

static WARN_LIMIT: LogLimit = LogLimit::new();

/// Admits one event per second of a process-wide clock; counts the others.
struct LogLimit {
    /// The second (since `epoch`) of the last admitted event, plus one; 0: none yet.
    last: AtomicU64,
    suppressed: AtomicU64,
    epoch: OnceLock<Instant>,
}

impl LogLimit {
    const fn new() -> Self {
        LogLimit { last: AtomicU64::new(0), suppressed: AtomicU64::new(0), epoch: OnceLock::new() }
    }

    fn admit(&self, now: Instant) -> bool {
        let epoch = *self.epoch.get_or_init(|| now);
        let second = now.saturating_duration_since(epoch).as_secs() + 1;
        let last = self.last.load(Ordering::Relaxed);
        if second > last && self.last.compare_exchange(last, second, Ordering::Relaxed, Ordering::Relaxed).is_ok() {
            return true;
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        false
    }

    /// Events left out since the last call.
    fn take_suppressed(&self) -> u64 {
        self.suppressed.swap(0, Ordering::Relaxed)
    }
}

/// The HTTP status of a gRPC code, as Triton's HTTP endpoint answers the same condition.
pub fn http_status(code: tonic::Code) -> StatusCode {
    use tonic::Code as C;
    match code {
        C::Ok => StatusCode::OK,
        C::InvalidArgument | C::OutOfRange | C::AlreadyExists => StatusCode::BAD_REQUEST,
        C::NotFound => StatusCode::NOT_FOUND,
        C::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        C::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        C::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        C::Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
        C::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        C::FailedPrecondition | C::Aborted => StatusCode::CONFLICT,
        C::PermissionDenied => StatusCode::FORBIDDEN,
        C::Unauthenticated => StatusCode::UNAUTHORIZED,
        C::Internal | C::Unknown | C::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// The metrics label of a gRPC code (the closed set of canonical names).
pub fn code_label(code: tonic::Code) -> &'static str {
    use tonic::Code as C;
    match code {
        C::Ok => "OK",
        C::Cancelled => "CANCELLED",
        C::Unknown => "UNKNOWN",
        C::InvalidArgument => "INVALID_ARGUMENT",
        C::DeadlineExceeded => "DEADLINE_EXCEEDED",
        C::NotFound => "NOT_FOUND",
        C::AlreadyExists => "ALREADY_EXISTS",
        C::PermissionDenied => "PERMISSION_DENIED",
        C::ResourceExhausted => "RESOURCE_EXHAUSTED",
        C::FailedPrecondition => "FAILED_PRECONDITION",
        C::Aborted => "ABORTED",
        C::OutOfRange => "OUT_OF_RANGE",
        C::Unimplemented => "UNIMPLEMENTED",
        C::Internal => "INTERNAL",
        C::Unavailable => "UNAVAILABLE",
        C::DataLoss => "DATA_LOSS",
        C::Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A model name of any length (the gRPC ingress takes one up to the request limit) comes
    /// back cut, as the workers cut theirs: whole, it would not fit a gRPC trailer.
    #[test]
    fn messages_quoting_a_huge_model_name_are_cut() {
        let e = GatewayError::Route(RouteError::ModelNotFound { model: "m".repeat(100_000) });
        let status = e.to_grpc();
        assert_eq!(status.code(), tonic::Code::NotFound);
        assert!(status.message().len() < nereid_common::status::MAX_STATUS_MESSAGE_BYTES + 64);
        assert!(status.message().starts_with("model 'mmm") && status.message().contains("message cut"));
        let body: serde_json::Value = serde_json::from_str(&e.json_body()).unwrap();
        assert!(body["error"].as_str().unwrap().len() < nereid_common::status::MAX_STATUS_MESSAGE_BYTES + 64);
    }

    #[test]
    fn server_error_lines_are_limited_to_one_a_second() {
        let limit = LogLimit::new();
        let t0 = Instant::now();
        assert!(limit.admit(t0));
        assert!(!limit.admit(t0 + Duration::from_millis(10)));
        assert!(!limit.admit(t0 + Duration::from_millis(999)));
        assert_eq!(limit.take_suppressed(), 2);
        assert!(limit.admit(t0 + Duration::from_millis(1000)));
        assert!(!limit.admit(t0 + Duration::from_millis(1500)));
        assert!(limit.admit(t0 + Duration::from_secs(5)));
        assert_eq!(limit.take_suppressed(), 1);
    }

    #[test]
    fn every_429_says_when_to_retry() {
        let worker_full = UpstreamError::new("w:1".into(), tonic::Status::resource_exhausted("queue is full"));
        assert_eq!(GatewayError::from(worker_full).retry_after(), Some(RETRY_AFTER));
        let unavailable = GatewayError::from(RouteError::NoReadyWorker { model: "m".into(), version: None });
        assert_eq!(unavailable.retry_after(), None);
    }

    #[test]
    fn rendering() {
        let e = GatewayError::from(RouteError::ModelNotFound { model: "m".into() });
        assert_eq!(e.grpc_code(), tonic::Code::NotFound);
        assert_eq!(e.http_status(), StatusCode::NOT_FOUND);
        assert_eq!(e.json_body(), r#"{"error":"model 'm' is not found on any worker"}"#);
        let e = GatewayError::from(RouteError::NoReadyWorker { model: "m".into(), version: Some(2) });
        assert_eq!(e.http_status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(e.to_string(), "no worker has model 'm' version 2 ready");
        let e = GatewayError::from(Overloaded { limit: 4 });
        assert_eq!(e.http_status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(e.retry_after(), Some(RETRY_AFTER));
        assert_eq!(e.to_grpc().code(), tonic::Code::ResourceExhausted);
        let e = GatewayError::from(DeadlineExceeded);
        assert_eq!(e.http_status(), StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(e.retry_after(), None);
        let e = GatewayError::from(nereid_common::Status::invalid("bad"));
        assert_eq!((e.grpc_code(), e.http_status()), (tonic::Code::InvalidArgument, StatusCode::BAD_REQUEST));
    }
}
