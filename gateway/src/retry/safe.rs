//! [`SafeRetry`]: the gateway's retry policy for inference. A failed call is retried only when
//! the worker provably did not run it ([`crate::forward::FailureKind::safe_to_retry`]: the
//! connection could not be made or the stream was refused, or the worker answered UNAVAILABLE
//! because it is draining or unloading, or RESOURCE_EXHAUSTED because its queue is full, or
//! its queue policy timed the request out, or it no longer has the version the request names),
//! another worker holding the model version is
//! available, and the queue `timeout` the request set itself (if any) has not passed. The retry excludes every worker the call already failed on. Each retry sent is
//! counted by model and version, labelled as the request metrics are.

use std::time::Instant;

use prometheus::IntCounterVec;

use super::Policy;
use crate::balance::choose_route;
use crate::call::InferCall;
use crate::error::GatewayError;
use crate::routing::Routes;

/// Least time left before the deadline for a retry to be sent.
pub const MIN_RETRY_TIME: std::time::Duration = std::time::Duration::from_millis(1);

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
        // A worker that no longer has the version a request names did not run it either: it
        // unloaded that version moments before the routing table saw it (a placement change),
        // and another holder may still serve it.
        let version_gone = call.version.is_some() && e.is_version_gone(call.model());
        if !e.kind.safe_to_retry() && !version_gone {
            return None;
        }
        // With next to no time left the retry could only time out, on a worker that did
        // nothing wrong: the client gets the real error instead.
        if call.deadline.saturating_duration_since(Instant::now()) < MIN_RETRY_TIME {
            return None;
        }
        let mut next = call.clone();
        next.target = None;
        // The retry has what the earlier attempts left of the deadline, not the gateway's whole
        // limit: a timeout of it is no failure of the worker it goes to (as a client's tight
        // deadline is not), only a long run of them is (see `crate::outlier`).
        next.deadline_is_gateways = false;
        // The client's own queue `timeout` (µs; the KServe parameter, forwarded as it is)
        // counts the time already spent: past it, nothing is retried — the client waited what
        // it allowed; before it, the retry carries what is left (an appended map entry: the
        // last one wins), so that all attempts together wait no longer than that.
        // Always from the client's own request and figure: an earlier retry's rewritten value
        // already had the time spent taken off (taking it off again would give up early), and
        // appending to it would grow the request with every retry.
        let client = call.client_timeout.clone().or_else(|| {
            let us = crate::wire::request_parameter_u64(&call.request.bytes, "timeout")?;
            (us > 0).then(|| (call.request.clone(), us))
        });
        if let Some((original, us)) = client {
            let spent = u64::try_from(call.arrived.elapsed().as_micros()).unwrap_or(u64::MAX);
            if spent >= us {
                return None;
            }
            next.request = original.with_parameter_u64("timeout", us - spent);
            next.client_timeout = Some((original, us));
        }
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use nereid_proto::inference::infer_parameter::ParameterChoice;
    use nereid_proto::inference::{InferParameter, ModelInferRequest};

    use super::*;
    use crate::call::{CallDeadline, InferCall};
    use crate::forward::UpstreamError;
    use crate::routing::tests::{row, view};
    use crate::routing::{RoutingTable, WorkerState, routes};
    use crate::wire::{InferRequest, request_parameter_u64};

    fn call_with_timeout(us: u64, spent: Duration) -> InferCall {
        let timeout = InferParameter { parameter_choice: Some(ParameterChoice::Uint64Param(us)) };
        let request = ModelInferRequest {
            model_name: "m".into(),
            parameters: [("timeout".to_string(), timeout)].into(),
            ..Default::default()
        };
        let deadline = CallDeadline { at: Instant::now() + Duration::from_secs(600), is_gateways: true };
        let mut call = InferCall::new(InferRequest::encode(&request), None, deadline);
        call.arrived = Instant::now() - spent;
        call
    }

    #[tokio::test]
    async fn a_retry_carries_what_is_left_of_the_clients_own_timeout() {
        let (publisher, routes) = routes(Instant::now());
        let holders = ["a:1", "b:1"].map(|w| view(w, WorkerState::Ready, vec![row("m", "1", "READY")]));
        publisher.publish(RoutingTable::build(holders.to_vec(), Instant::now()));
        let counter = prometheus::IntCounterVec::new(prometheus::Opts::new("r", "r"), &["model", "version"]).unwrap();
        let policy = SafeRetry::new(routes, counter);
        let timed_out = GatewayError::from(UpstreamError::new(
            "a:1".into(),
            tonic::Status::unavailable(nereid_common::status::QUEUE_TIMEOUT_MESSAGE),
        ));

        // 10 s allowed, 1 s spent: the retry goes elsewhere with at most 9 s left.
        let next = policy.retry(&call_with_timeout(10_000_000, Duration::from_secs(1)), &timed_out).expect("retried");
        let left = request_parameter_u64(&next.request.bytes, "timeout").unwrap();
        assert!((5_000_000..=9_000_000).contains(&left), "{left}");
        assert_eq!(next.excluded, ["a:1".into()]);
        assert_eq!(next.request.header.model_name, "m", "the request is otherwise the same");
        assert!(!next.deadline_is_gateways, "a retry's timeout is not the worker's failure");
        // With next to no time left before the deadline: not retried.
        let mut late = call_with_timeout(10_000_000, Duration::from_secs(1));
        late.deadline = Instant::now() + MIN_RETRY_TIME / 2;
        assert!(policy.retry(&late, &timed_out).is_none());
        // 500 ms allowed, 1 s spent: not retried.
        assert!(policy.retry(&call_with_timeout(500_000, Duration::from_secs(1)), &timed_out).is_none());

        // A second retry counts from the client's 10 s, not from the first retry's figure
        // (which already had the first second taken off), and rewrites the client's request,
        // not the first retry's (no growing chain of appended entries).
        let three = ["a:1", "b:1", "c:1"].map(|w| view(w, WorkerState::Ready, vec![row("m", "1", "READY")]));
        publisher.publish(RoutingTable::build(three.to_vec(), Instant::now()));
        let mut first = policy.retry(&call_with_timeout(10_000_000, Duration::from_secs(1)), &timed_out).unwrap();
        first.arrived -= Duration::from_secs(2); // 3 s spent in all by the second refusal
        let by_b = GatewayError::from(UpstreamError::new(
            "b:1".into(),
            tonic::Status::unavailable(nereid_common::status::QUEUE_TIMEOUT_MESSAGE),
        ));
        let second = policy.retry(&first, &by_b).expect("7 s are left");
        let left = request_parameter_u64(&second.request.bytes, "timeout").unwrap();
        // 10 s - 3 s; taking the first second off twice would leave 6 s.
        assert!((6_500_000..=7_000_000).contains(&left), "{left}: counted from the client's 10 s");
        assert_eq!(second.request.bytes.len(), first.request.bytes.len(), "one appended entry, not two");
    }

    /// A worker that unloaded the version a request names (before the routing table saw it)
    /// did not run it: the request goes to another holder rather than fail NOT_FOUND. A
    /// NOT_FOUND for a request naming no version, or of another kind, is final.
    #[tokio::test]
    async fn a_named_version_gone_from_its_worker_is_retried_on_another_holder() {
        let (publisher, routes) = routes(Instant::now());
        let holders = ["a:1", "b:1"].map(|w| view(w, WorkerState::Ready, vec![row("m", "1", "READY")]));
        publisher.publish(RoutingTable::build(holders.to_vec(), Instant::now()));
        let counter = prometheus::IntCounterVec::new(prometheus::Opts::new("r", "r"), &["model", "version"]).unwrap();
        let policy = SafeRetry::new(routes, counter);
        let gone = GatewayError::from(UpstreamError::new(
            "a:1".into(),
            tonic::Status::not_found("model 'm' has no version 1 (ready versions: 2)"),
        ));
        let deadline = CallDeadline { at: Instant::now() + Duration::from_secs(60), is_gateways: true };
        let request = InferRequest::encode(&ModelInferRequest { model_name: "m".into(), ..Default::default() });
        let named = InferCall::new(request.clone(), Some(1), deadline);
        assert_eq!(policy.retry(&named, &gone).expect("retried").excluded, ["a:1".into()]);
        assert!(policy.retry(&InferCall::new(request.clone(), None, deadline), &gone).is_none());
        let unknown = GatewayError::from(UpstreamError::new("a:1".into(), tonic::Status::not_found("no model 'm'")));
        assert!(policy.retry(&named, &unknown).is_none());
    }
}
