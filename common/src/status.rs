//! Error status shared by every front end: one closed set of codes, rendered once to a gRPC
//! `tonic::Status` or an HTTP status + KServe v2 `{"error": "..."}` body.

use std::fmt;

/// What went wrong, in the terms clients act on. Maps 1:1 onto gRPC codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Code {
    /// The request is malformed or does not match the model (HTTP 400).
    InvalidArgument,
    /// Unknown model, version or resource (HTTP 404).
    NotFound,
    /// A queue or size limit is full; retrying later may succeed (HTTP 429).
    ResourceExhausted,
    /// The model exists but is not ready, or the server is draining (HTTP 503).
    Unavailable,
    /// The request's deadline or queue timeout passed before it ran (HTTP 504).
    DeadlineExceeded,
    /// The caller went away before the request ran (HTTP 499 in logs; no one reads it).
    Cancelled,
    /// Not supported by this server (HTTP 501).
    Unimplemented,
    /// A server-side failure, e.g. the runtime failed to execute (HTTP 500).
    Internal,
    /// The operation conflicts with the current state (HTTP 409), e.g. loading while unloading.
    FailedPrecondition,
    /// Load of a model failed / already exists (HTTP 400 as Triton does).
    AlreadyExists,
}

impl Code {
    pub fn http_status(self) -> http::StatusCode {
        use http::StatusCode as S;
        match self {
            Code::InvalidArgument | Code::AlreadyExists => S::BAD_REQUEST,
            Code::NotFound => S::NOT_FOUND,
            Code::ResourceExhausted => S::TOO_MANY_REQUESTS,
            Code::Unavailable => S::SERVICE_UNAVAILABLE,
            Code::DeadlineExceeded => S::GATEWAY_TIMEOUT,
            Code::Cancelled => S::from_u16(499).unwrap_or(S::BAD_REQUEST),
            Code::Unimplemented => S::NOT_IMPLEMENTED,
            Code::Internal => S::INTERNAL_SERVER_ERROR,
            Code::FailedPrecondition => S::CONFLICT,
        }
    }

    pub fn grpc_code(self) -> tonic::Code {
        match self {
            Code::InvalidArgument => tonic::Code::InvalidArgument,
            Code::NotFound => tonic::Code::NotFound,
            Code::ResourceExhausted => tonic::Code::ResourceExhausted,
            Code::Unavailable => tonic::Code::Unavailable,
            Code::DeadlineExceeded => tonic::Code::DeadlineExceeded,
            Code::Cancelled => tonic::Code::Cancelled,
            Code::Unimplemented => tonic::Code::Unimplemented,
            Code::Internal => tonic::Code::Internal,
            Code::FailedPrecondition => tonic::Code::FailedPrecondition,
            Code::AlreadyExists => tonic::Code::AlreadyExists,
        }
    }

    /// A closed label for metrics (`nv_inference_request_failure{reason=...}`).
    pub fn reason(self) -> &'static str {
        match self {
            Code::InvalidArgument | Code::NotFound | Code::AlreadyExists => "REJECTED",
            Code::ResourceExhausted => "REJECTED",
            Code::Unavailable | Code::FailedPrecondition => "REJECTED",
            Code::DeadlineExceeded => "CANCELED",
            Code::Cancelled => "CANCELED",
            Code::Unimplemented | Code::Internal => "BACKEND",
        }
    }
}

/// An error with a code and a message that names the offending field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    pub code: Code,
    pub message: String,
}

impl Status {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Status { code, message: message.into() }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Status::new(Code::InvalidArgument, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Status::new(Code::NotFound, message)
    }
    pub fn unavailable(message: impl Into<String>) -> Self {
        Status::new(Code::Unavailable, message)
    }
    pub fn exhausted(message: impl Into<String>) -> Self {
        Status::new(Code::ResourceExhausted, message)
    }
    pub fn internal(message: impl Into<String>) -> Self {
        Status::new(Code::Internal, message)
    }
    pub fn unimplemented(message: impl Into<String>) -> Self {
        Status::new(Code::Unimplemented, message)
    }

    /// The KServe v2 HTTP error body.
    pub fn json_body(&self) -> String {
        serde_json::json!({ "error": self.message }).to_string()
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.message)
    }
}

impl std::error::Error for Status {}

impl From<Status> for tonic::Status {
    fn from(s: Status) -> Self {
        tonic::Status::new(s.code.grpc_code(), s.message)
    }
}
