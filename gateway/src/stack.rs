//! The inference stack, assembled in one place, outside in. Both ingresses (gRPC and HTTP) hand
//! every inference to it as an [`InferCall`]; each policy is a tower `Layer` in its own module.

use std::sync::Arc;
use std::time::Instant;

use tower::ServiceBuilder;
use tower::util::BoxCloneSyncService;

use crate::admission::{AdmissionGate, AdmissionLayer};
use crate::balance::BalanceLayer;
use crate::call::InferCall;
use crate::config::GatewayConfig;
use crate::deadline::DeadlineLayer;
use crate::error::GatewayError;
use crate::forward::Forward;
use crate::metrics::{GatewayMetrics, RequestMetricsLayer};
use crate::retry::{RetryBudget, RetryLayer, SafeRetry};
use crate::routing::Routes;
use crate::wire::InferResponse;

/// The boxed stack: cheap to clone (one clone per request).
pub type InferService = BoxCloneSyncService<InferCall, InferResponse, GatewayError>;

/// The stack, sharing `admission` with the ingresses (which admit before reading a body).
pub fn infer_stack(
    config: &GatewayConfig,
    routes: &Routes,
    metrics: &GatewayMetrics,
    admission: &AdmissionGate,
) -> InferService {
    let budget = Arc::new(RetryBudget::new(config.retry.budget_percent, config.retry.min_per_sec, Instant::now()));
    let stack = ServiceBuilder::new()
        // Metrics: every request counted by model and final code, rejections included.
        .layer(RequestMetricsLayer::new(metrics.clone(), routes.clone()))
        // Admission: past --max-concurrent-requests, RESOURCE_EXHAUSTED / 429 at once (for
        // requests their ingress did not admit already).
        .layer(AdmissionLayer::new(admission.clone()))
        // Deadline: the client's deadline capped by --request-timeout-ms bounds all that follows.
        .layer(DeadlineLayer)
        // Retry: only what a worker provably did not run, elsewhere, within the budget.
        .layer(RetryLayer::new(SafeRetry::new(routes.clone(), metrics.retries.clone()), budget))
        // Balance: READY holders from the routing table, power of two choices on outstanding.
        .layer(BalanceLayer::new(routes.clone()))
        // Forward: the worker's pooled HTTP/2 channel; outcomes feed outlier ejection.
        .service(Forward::new(metrics.ejections.clone(), metrics.upstream_connects.clone()));
    BoxCloneSyncService::new(stack)
}
