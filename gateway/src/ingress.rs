//! What the two ingresses (gRPC and HTTP) share: the inference stack, the control-plane
//! forwarding, the routing table, and the gateway's own readiness.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nereid_worker::server::parse_version;
use tower::ServiceExt;

use crate::admission::{AdmissionGate, Permit};
use crate::call::{CallDeadline, InferCall, effective_deadline};
use crate::control::Control;
use crate::error::GatewayError;
use crate::metrics::Refusals;
use crate::routing::Routes;
use crate::stack::InferService;
use crate::wire::{InferRequest, InferResponse};

/// Room left under --max-request-bytes for what the forward path appends to a request (a
/// version pin, a retry's remaining timeout), so that a worker with the same limit never
/// refuses, as too large, a request this gateway let through.
pub const FORWARD_APPEND_BYTES: usize = 64;

/// What both ingresses share. Cloned per request (by each ingress, and by axum's state):
/// one reference count.
#[derive(Clone)]
pub struct Ingress(Arc<IngressState>);

impl Ingress {
    pub fn new(state: IngressState) -> Self {
        Ingress(Arc::new(state))
    }
}

impl std::ops::Deref for Ingress {
    type Target = IngressState;

    fn deref(&self) -> &IngressState {
        &self.0
    }
}

/// The parts of an [`Ingress`].
pub struct IngressState {
    pub infer: InferService,
    pub control: Control,
    pub routes: Routes,
    pub request_timeout: Duration,
    pub max_request_bytes: usize,
    /// The gateway's concurrency limit, also enforced in the stack.
    pub admission: AdmissionGate,
    /// Counts what is refused before it reaches the stack (and its metrics layer).
    pub refusals: Refusals,
    /// Set once shutdown begins: readiness turns false so load balancers stop sending.
    pub draining: Arc<AtomicBool>,
}

impl IngressState {
    pub fn ready(&self) -> bool {
        !self.draining.load(Ordering::Relaxed) && self.routes.snapshot().ready()
    }

    /// The deadline of a request that arrived at `now` with `client`'s own deadline.
    pub fn deadline(&self, client: Option<Instant>, now: Instant) -> Instant {
        self.call_deadline(client, now).at
    }

    /// [`Self::deadline`], saying whether the gateway's own limit set it.
    pub fn call_deadline(&self, client: Option<Instant>, now: Instant) -> CallDeadline {
        effective_deadline(client, self.request_timeout, now)
    }

    /// A place under the concurrency limit for an inference whose body is not read yet, or
    /// RESOURCE_EXHAUSTED at once — counted in the request metrics under the model and version
    /// the request's path names (HTTP), or [`crate::metrics::UNREAD_MODEL_LABEL`] when the
    /// model is only in the unread body (gRPC).
    pub fn admit(&self, model: Option<(&str, Option<i64>)>, arrived: Instant) -> Result<Permit, GatewayError> {
        self.admission.try_admit().map_err(|overloaded| {
            let e = GatewayError::from(overloaded);
            self.refusals.count(model, e.grpc_code(), arrived);
            e
        })
    }

    /// Runs one (encoded) inference down the stack, holding `permit` (when its ingress admitted
    /// it) until it completes.
    pub async fn infer(
        &self,
        request: InferRequest,
        deadline: CallDeadline,
        permit: Option<Permit>,
    ) -> Result<InferResponse, GatewayError> {
        let version = parse_version(&request.header.model_name, &request.header.model_version).inspect_err(|e| {
            self.refusals.count(Some((&request.header.model_name, None)), e.code.grpc_code(), Instant::now());
        })?;
        let deadline = after_upload(deadline, self.request_timeout, Instant::now());
        self.infer.clone().oneshot(InferCall::new(request, version, deadline).admitted(permit)).await
    }
}

/// `deadline` once the request is in, at `now`: a client that took a real share of the
/// gateway's limit (`--request-timeout-ms`) to send it leaves the worker less than that limit,
/// and running into what is left says nothing about the worker's health — as with a client's
/// own deadline, it no longer counts as the gateway's.
fn after_upload(mut deadline: CallDeadline, limit: Duration, now: Instant) -> CallDeadline {
    let used = limit.saturating_sub(deadline.at.saturating_duration_since(now));
    if used > (limit / 10).max(Duration::from_secs(1)) {
        deadline.is_gateways = false;
    }
    deadline
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_upload_makes_the_deadline_the_clients() {
        let (limit, arrived) = (Duration::from_secs(60), Instant::now());
        let deadline = CallDeadline { at: arrived + limit, is_gateways: true };
        // In at once, or within a tenth of the limit: still the gateway's own.
        assert!(after_upload(deadline, limit, arrived).is_gateways);
        assert!(after_upload(deadline, limit, arrived + Duration::from_secs(5)).is_gateways);
        // Most of it spent uploading: a timeout is the client's doing.
        assert!(!after_upload(deadline, limit, arrived + Duration::from_secs(50)).is_gateways);
        // Short limits keep a second's grace.
        let short = Duration::from_millis(800);
        let deadline = CallDeadline { at: arrived + short, is_gateways: true };
        assert!(after_upload(deadline, short, arrived + Duration::from_millis(500)).is_gateways);
        // A client's deadline stays the client's.
        let theirs = CallDeadline { at: arrived + Duration::from_secs(1), is_gateways: false };
        assert!(!after_upload(theirs, limit, arrived).is_gateways);
    }
}
