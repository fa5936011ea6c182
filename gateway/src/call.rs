//! [`InferCall`]: one inference request as it travels down the gateway's stack. Cloning it is
//! cheap (the encoded bytes are shared), so retries re-send the same bytes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::deadline::Deadlined;
use crate::upstream::{Upstream, UpstreamId};
use crate::wire::InferRequest;

#[derive(Clone, Debug)]
pub struct InferCall {
    pub request: InferRequest,
    /// `request.model_version` parsed (`None`: the latest ready version).
    pub version: Option<i64>,
    /// When the gateway gives up: the client's deadline capped by `--request-timeout-ms`.
    pub deadline: Instant,
    /// Workers this call already failed on; a retry goes elsewhere.
    pub excluded: Vec<UpstreamId>,
    /// The worker the balancer picked for this attempt.
    pub target: Option<Arc<Upstream>>,
}

impl InferCall {
    pub fn new(request: InferRequest, version: Option<i64>, deadline: Instant) -> Self {
        InferCall { request, version, deadline, excluded: Vec::new(), target: None }
    }

    pub fn model(&self) -> &str {
        &self.request.header.model_name
    }
}

impl Deadlined for InferCall {
    fn deadline(&self) -> Option<Instant> {
        Some(self.deadline)
    }
}

/// The deadline of a request arriving at `now`: the earliest of the client's own deadline and
/// `now + cap`.
pub fn effective_deadline(client: Option<Instant>, cap: Duration, now: Instant) -> Instant {
    let capped = now + cap;
    client.map_or(capped, |c| c.min(capped))
}

/// `x-nereid-deadline-ms`: a relative deadline in milliseconds, for clients that cannot set
/// `grpc-timeout` (HTTP). Malformed values are ignored, as tonic ignores a malformed
/// `grpc-timeout`.
pub const DEADLINE_HEADER: &str = "x-nereid-deadline-ms";

pub fn parse_deadline_ms(value: &str, now: Instant) -> Option<Instant> {
    value.trim().parse::<u64>().ok().map(|ms| now + Duration::from_millis(ms))
}
