//! [`SafeRetry`]: the gateway's retry policy for inference. A failed call is retried only when
//! the worker provably did not run it ([`crate::forward::FailureKind::safe_to_retry`]: the
//! connection could not be made or the stream was refused, or the worker answered UNAVAILABLE
//! because it is draining or unloading, or RESOURCE_EXHAUSTED because its queue is full, or
//! its queue policy timed the request out — unless that happened after the `timeout` the
//! request set itself) and another worker holding the model version is available. The retry excludes every worker the call already failed on. Each retry sent is
//! counted by model and version, labelled as the request metrics are.

use std::time::{Duration, Instant};

use prometheus::IntCounterVec;

use super::Policy;
use crate::balance::choose_route;
use crate::call::InferCall;
use crate::error::GatewayError;
use crate::forward::FailureKind;
use crate::routing::Routes;

#[derive(Clone)]
pub struct SafeRetry {
    routes: Routes,
    /// `nereid_gateway_retries_total{model, version}`.
    retries: IntCounterVec,
}

impl SafeRetry {
    pub fn new(routes: Routes, retries: IntCounterVec) -> Self {
        SafeRetry { routes, retries }
    }
}

impl Policy<InferCall, GatewayError> for SafeRetry {
    fn retry(&self, call: &InferCall, error: &GatewayError) -> Option<InferCall> {
        let GatewayError::Upstream(e) = error else {
            return None;
        };
        if !e.kind.safe_to_retry() {
            return None;
        }
        // A queue-policy timeout once the wait the client itself allowed (the KServe `timeout`
        // parameter, in µs, forwarded as it is) has passed: another wait elsewhere would outlast
        // it. Earlier, the worker's own (default) timeout fired: retried.
        if e.kind == FailureKind::Refused
            && e.status.code() == tonic::Code::Unavailable
            && let Some(us) = crate::wire::request_parameter_u64(&call.request.bytes, "timeout")
            && us > 0
            && call.arrived.elapsed() >= Duration::from_micros(us)
        {
            return None;
        }
        let mut next = call.clone();
        next.target = None;
        if !next.excluded.contains(&e.worker) {
            next.excluded.push(e.worker.clone());
        }
        // Pointless when no other worker could take it: the client gets the real error.
        let table = self.routes.snapshot();
        let route = table.resolve(call.model(), call.version).ok()?;
        choose_route(&table, &route, &next.excluded, Instant::now(), &mut rand::rng())?;
        Some(next)
    }

    fn retried(&self, call: &InferCall) {
        let table = self.routes.snapshot();
        let version = table.version_label(call.model(), call.version);
        self.retries.with_label_values(&[table.model_label(call.model()), &version]).inc();
    }
}
