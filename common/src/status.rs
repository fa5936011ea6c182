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
    /// The model exists but is not ready, the server is draining, or the request's queue
    /// timeout (the model's queue policy) expired under `REJECT` — see
    /// [`Status::queue_timeout`] (HTTP 503).
    Unavailable,
    /// The caller's own deadline (e.g. `grpc-timeout`) passed before the request ran (HTTP 504).
    /// Not used for queue-policy timeouts, which Triton answers UNAVAILABLE.
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

    /// A closed label for metrics (`nv_inference_request_failure{reason=...}`), Triton's:
    /// REJECTED for what the scheduler turned away (a full queue, a queue timeout, a model
    /// not ready to take it), OTHER for a request that was wrong in itself (so an alert on
    /// REJECTED means overload, not a client's bug).
    pub fn reason(self) -> &'static str {
        match self {
            Code::InvalidArgument | Code::NotFound | Code::AlreadyExists => "OTHER",
            Code::ResourceExhausted => "REJECTED",
            Code::Unavailable | Code::FailedPrecondition => "REJECTED",
            // The caller gave up (its deadline or a disconnect), as Triton counts cancellations.
            Code::DeadlineExceeded => "CANCELED",
            Code::Cancelled => "CANCELED",
            Code::Unimplemented | Code::Internal => "BACKEND",
        }
    }
}

/// The message of [`Status::queue_timeout`], Triton's own wording.
pub const QUEUE_TIMEOUT_MESSAGE: &str = "Request timeout expired";

/// [`LEVEL_QUEUE_FULL_MESSAGE`] as earlier releases wrote it.
const LEVEL_QUEUE_FULL_MESSAGE_BEFORE: &str = "the queue of this priority level is full (max_queue_size), retry later";

/// The message of the RESOURCE_EXHAUSTED a priority level's full queue (`max_queue_size`)
/// answers at once.
pub const LEVEL_QUEUE_FULL_MESSAGE: &str =
    "Exceeds maximum queue size: the queue of this priority level is full (max_queue_size), retry later";

/// How the message of the RESOURCE_EXHAUSTED a model's full request queue answers begins.
pub const QUEUE_FULL_MESSAGE_PREFIX: &str = "the model's request queue is full";

/// How the message of the RESOURCE_EXHAUSTED begins that a worker answers when the inputs of
/// the requests it holds (queued or running) would pass `--max-queued-bytes`.
pub const MEMORY_FULL_MESSAGE_PREFIX: &str = "the worker's request memory is full";

/// The message of an ensemble's failure in one of its steps: earlier steps (and the other
/// steps of the same wave) may have run.
pub fn ensemble_step_message(ensemble: &str, step: usize, model: &str, message: &str) -> String {
    format!("ensemble '{ensemble}' step {step} (model '{model}'): {message}")
}

/// Whether `message` is an ensemble step's failure ([`ensemble_step_message`]).
pub fn is_ensemble_step_failure(message: &str) -> bool {
    message.strip_prefix("ensemble '").is_some_and(|rest| rest.contains("' step "))
}

/// Whether a worker's answer says its scheduler refused the request before it ran: a full
/// queue, or a queue-policy timeout. Exact messages only: an ensemble prefixes its steps'
/// errors (an earlier step may have run), and other RESOURCE_EXHAUSTED answers (an oversized
/// message) would fail the same way anywhere.
pub fn is_queue_refusal(code: Code, message: &str) -> bool {
    match code {
        Code::Unavailable => message == QUEUE_TIMEOUT_MESSAGE,
        Code::ResourceExhausted => {
            // The level's message before it took Triton's wording too: workers of an earlier
            // release answer it during a rolling upgrade.
            message == LEVEL_QUEUE_FULL_MESSAGE
                || message == LEVEL_QUEUE_FULL_MESSAGE_BEFORE
                || message.starts_with(QUEUE_FULL_MESSAGE_PREFIX)
                || message.starts_with(MEMORY_FULL_MESSAGE_PREFIX)
        }
        _ => false,
    }
}

/// Longest status message, in bytes as a gRPC trailer carries it (`grpc-message` is
/// percent-encoded: every byte outside printable ASCII, and the ASCII that tonic encodes, takes
/// three). Messages quote
/// what clients sent (a tensor's name, a model name); a megabytes-long name would otherwise
/// come back in a trailer larger than HTTP/2 peers accept, failing the call or, past h2's
/// limits, the whole connection a gateway multiplexes other clients' calls on — and grpcio
/// clients (tritonclient) refuse metadata past 8 KiB.
pub const MAX_STATUS_MESSAGE_BYTES: usize = 4096;

/// What a character of a message takes in a `grpc-message` trailer, as tonic encodes it:
/// controls, non-ASCII bytes and ` "#%<>`?{}` take three bytes each.
fn encoded_len(c: char) -> usize {
    let plain = c.is_ascii() && !c.is_ascii_control() && !" \"#%<>`?{}".contains(c);
    if plain { 1 } else { 3 * c.len_utf8() }
}

/// An error with a code and a message that names the offending field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    pub code: Code,
    pub message: String,
}

impl Status {
    /// A message that would take more than [`MAX_STATUS_MESSAGE_BYTES`] in a trailer is cut
    /// (at a character boundary) and says so; the result fits, so cutting it again changes
    /// nothing.
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        let mut message = message.into();
        // A character never takes fewer bytes encoded than in UTF-8: a long message is over
        // without a walk over all of it (it may echo a client's megabytes).
        if message.len() > MAX_STATUS_MESSAGE_BYTES
            || message.chars().map(encoded_len).sum::<usize>() > MAX_STATUS_MESSAGE_BYTES
        {
            let suffix = format!("... (message cut: {} bytes)", message.len());
            let room = MAX_STATUS_MESSAGE_BYTES - suffix.chars().map(encoded_len).sum::<usize>();
            let mut used = 0;
            let cut = message
                .char_indices()
                .find(|&(_, c)| {
                    used += encoded_len(c);
                    used > room
                })
                .map_or(message.len(), |(i, _)| i);
            message.truncate(cut);
            message.push_str(&suffix);
        }
        Status { code, message }
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

    /// A request whose queue timeout (`default_timeout_microseconds`, or its own shorter
    /// `timeout` where `allow_timeout_override`) expired under `timeout_action: REJECT`.
    ///
    /// Triton answers it UNAVAILABLE (HTTP 503) with this message and counts it as
    /// `nv_inference_request_failure{reason="REJECTED"}`: the server refused to keep it queued,
    /// unlike a caller's own deadline (DEADLINE_EXCEEDED, counted CANCELED). Clients and the
    /// gateway see the same code and text from Nereid and from Triton.
    pub fn queue_timeout() -> Self {
        Status::new(Code::Unavailable, QUEUE_TIMEOUT_MESSAGE)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_messages_are_cut_at_a_character_boundary() {
        let trailer_len = |m: &str| m.chars().map(encoded_len).sum::<usize>();
        let name = "é".repeat(10_000_000);
        let s = Status::invalid(format!("unexpected inference input '{name}'"));
        // Within the limit as a trailer carries it (each é: 2 bytes, 6 percent-encoded).
        assert!(trailer_len(&s.message) <= MAX_STATUS_MESSAGE_BYTES, "{}", trailer_len(&s.message));
        assert!(s.message.starts_with("unexpected inference input 'éé"));
        assert!(s.message.ends_with("... (message cut: 20000029 bytes)"), "{}", &s.message[s.message.len() - 60..]);
        // Cutting again (a gateway passing a worker's message on) changes nothing.
        assert_eq!(Status::invalid(s.message.clone()).message, s.message);
        let ascii = Status::invalid("x".repeat(10_000));
        assert!(
            ascii.message.len() <= MAX_STATUS_MESSAGE_BYTES && ascii.message.ends_with("(message cut: 10000 bytes)")
        );
        assert_eq!(Status::invalid(ascii.message.clone()).message, ascii.message);
        let short = Status::invalid("x".repeat(MAX_STATUS_MESSAGE_BYTES));
        assert_eq!(short.message.len(), MAX_STATUS_MESSAGE_BYTES);
        // As tonic itself writes the trailer (not as this module reckons it).
        let trailer = |m: &str| {
            let mut headers = http::HeaderMap::new();
            tonic::Status::new(tonic::Code::InvalidArgument, m.to_string()).add_header(&mut headers).unwrap();
            headers["grpc-message"].len()
        };
        assert!(trailer(&s.message) <= MAX_STATUS_MESSAGE_BYTES, "{}", trailer(&s.message));
        // The ASCII tonic percent-encodes counts three times too (spaces in the suffix included).
        let spaces = Status::invalid(" {?\"".repeat(5_000));
        assert!(trailer(&spaces.message) <= MAX_STATUS_MESSAGE_BYTES, "{}", trailer(&spaces.message));
        assert!(trailer(&spaces.message) > MAX_STATUS_MESSAGE_BYTES - 8, "the room is used");
        assert_eq!(trailer_len(" {?\"#%<>`}\n"), 33);
        assert_eq!(trailer_len("ab-_.~"), 6);
    }

    #[test]
    fn queue_timeouts_are_rejections_and_deadlines_are_cancellations() {
        let q = Status::queue_timeout();
        assert_eq!(q.message, "Request timeout expired");
        assert_eq!(q.code.http_status(), http::StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(q.code.grpc_code(), tonic::Code::Unavailable);
        assert_eq!(q.code.reason(), "REJECTED");
        assert_eq!(tonic::Status::from(q).code(), tonic::Code::Unavailable);

        let d = Code::DeadlineExceeded;
        assert_eq!(
            (d.http_status(), d.grpc_code(), d.reason()),
            (http::StatusCode::GATEWAY_TIMEOUT, tonic::Code::DeadlineExceeded, "CANCELED")
        );
        assert_eq!(Code::Cancelled.reason(), "CANCELED");
        assert_eq!(Code::InvalidArgument.reason(), "OTHER", "a bad request is no overload");
        assert_eq!(Code::ResourceExhausted.reason(), "REJECTED");
        // Both wordings of a full level are refusals (workers of mixed releases).
        assert!(is_queue_refusal(Code::ResourceExhausted, LEVEL_QUEUE_FULL_MESSAGE));
        assert!(is_queue_refusal(Code::ResourceExhausted, LEVEL_QUEUE_FULL_MESSAGE_BEFORE));
        let memory = format!("{MEMORY_FULL_MESSAGE_PREFIX} (2048 bytes of 4096), retry later");
        assert!(is_queue_refusal(Code::ResourceExhausted, &memory));
    }
}
