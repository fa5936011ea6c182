//! [`InferCall`]: one inference request as it travels down the gateway's stack. Cloning it is
//! cheap (the encoded bytes are shared), so retries re-send the same bytes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::admission::{Admissible, Permit};
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
    /// Whether the gateway's own limit (`--request-timeout-ms`) set `deadline`, rather than the
    /// client's: a worker that runs into the gateway's limit is failing, while one that runs
    /// into a client's tight deadline says nothing about its health.
    pub deadline_is_gateways: bool,
    /// Workers this call already failed on; a retry goes elsewhere.
    pub excluded: Vec<UpstreamId>,
    /// The worker the balancer picked for this attempt.
    pub target: Option<Arc<Upstream>>,
    /// The version the balancer resolved the call to (see `RoutingTable::resolve` when
    /// `version` is `None`): the version it is forwarded for.
    pub resolved_version: Option<i64>,
    /// The place under the admission limit its ingress took before reading it (none: the
    /// stack's admission layer takes one).
    pub permit: Option<Permit>,
    /// When the call entered the stack.
    pub arrived: Instant,
    /// The request as the client sent it, with its KServe `timeout` (µs), once a retry has
    /// rewritten that parameter: each later retry counts from the client's own figure.
    pub client_timeout: Option<(InferRequest, u64)>,
}

impl InferCall {
    pub fn new(request: InferRequest, version: Option<i64>, deadline: CallDeadline) -> Self {
        InferCall {
            request,
            version,
            deadline: deadline.at,
            deadline_is_gateways: deadline.is_gateways,
            excluded: Vec::new(),
            target: None,
            resolved_version: None,
            permit: None,
            arrived: Instant::now(),
            client_timeout: None,
        }
    }

    /// The call, admitted by its ingress.
    pub fn admitted(mut self, permit: Option<Permit>) -> Self {
        self.permit = permit;
        self
    }

    pub fn model(&self) -> &str {
        &self.request.header.model_name
    }
}

impl Admissible for InferCall {
    fn take_permit(&mut self) -> Option<Permit> {
        self.permit.take()
    }
}

impl Deadlined for InferCall {
    fn deadline(&self) -> Option<Instant> {
        Some(self.deadline)
    }
}

/// When the gateway gives up on a request, and whether its own limit set that time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallDeadline {
    pub at: Instant,
    /// The cap (`--request-timeout-ms`) set it: the client gave no deadline, or a later one.
    pub is_gateways: bool,
}

/// The deadline of a request arriving at `now`: the earliest of the client's own deadline and
/// `now + cap`.
pub fn effective_deadline(client: Option<Instant>, cap: Duration, now: Instant) -> CallDeadline {
    let capped = now + cap;
    match client {
        Some(c) if c < capped => CallDeadline { at: c, is_gateways: false },
        _ => CallDeadline { at: capped, is_gateways: true },
    }
}

/// `x-nereid-deadline-ms`: a relative deadline in milliseconds, for clients that cannot set
/// `grpc-timeout` (HTTP). Malformed values are ignored, as tonic ignores a malformed
/// `grpc-timeout`.
pub const DEADLINE_HEADER: &str = "x-nereid-deadline-ms";

pub fn parse_deadline_ms(value: &str, now: Instant) -> Option<Instant> {
    // A deadline past what the clock can hold is no deadline (the gateway's cap applies).
    value.trim().parse::<u64>().ok().and_then(|ms| now.checked_add(Duration::from_millis(ms)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_earlier_deadline_wins_and_says_who_set_it() {
        let now = Instant::now();
        let cap = Duration::from_secs(60);
        let own = CallDeadline { at: now + cap, is_gateways: true };
        assert_eq!(effective_deadline(None, cap, now), own);
        assert_eq!(effective_deadline(Some(now + Duration::from_secs(90)), cap, now), own);
        let client = now + Duration::from_millis(200);
        assert_eq!(effective_deadline(Some(client), cap, now), CallDeadline { at: client, is_gateways: false });
        assert_eq!(parse_deadline_ms(" 250 ", now), Some(now + Duration::from_millis(250)));
        let far = parse_deadline_ms(&u64::MAX.to_string(), now);
        assert!(far.is_none_or(|at| at > now + cap), "u64::MAX ms is at least as late as the cap");
        assert_eq!(effective_deadline(far, cap, now), own);
        assert_eq!(parse_deadline_ms("soon", now), None);
    }
}
