//! What the two ingresses (gRPC and HTTP) share: the inference stack, the control-plane
//! forwarding, the routing table, and the gateway's own readiness.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nereid_worker::server::parse_version;
use tower::ServiceExt;

use crate::call::{CallDeadline, InferCall, effective_deadline};
use crate::control::Control;
use crate::error::GatewayError;
use crate::routing::Routes;
use crate::stack::InferService;
use crate::wire::{InferRequest, InferResponse};

/// What both ingresses share. Cheap to clone.
#[derive(Clone)]
pub struct Ingress {
    pub infer: InferService,
    pub control: Control,
    pub routes: Routes,
    pub request_timeout: Duration,
    pub max_request_bytes: usize,
    /// Set once shutdown begins: readiness turns false so load balancers stop sending.
    pub draining: Arc<AtomicBool>,
}

impl Ingress {
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

    /// Runs one (encoded) inference down the stack.
    pub async fn infer(&self, request: InferRequest, deadline: CallDeadline) -> Result<InferResponse, GatewayError> {
        let version = parse_version(&request.header.model_name, &request.header.model_version)?;
        self.infer.clone().oneshot(InferCall::new(request, version, deadline)).await
    }
}
