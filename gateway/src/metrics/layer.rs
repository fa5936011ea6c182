//! The outermost layer of the infer stack: counts every request by model and final code and
//! records its latency — rejections included. A request whose caller goes away before it
//! completes is counted as CANCELLED.

use std::task::{Context, Poll};
use std::time::Instant;

use futures::future::BoxFuture;
use tower::{Layer, Service};

use super::GatewayMetrics;
use crate::call::InferCall;
use crate::error::{GatewayError, code_label};
use crate::routing::Routes;

#[derive(Clone)]
pub struct RequestMetricsLayer {
    metrics: GatewayMetrics,
    routes: Routes,
}

impl RequestMetricsLayer {
    pub fn new(metrics: GatewayMetrics, routes: Routes) -> Self {
        RequestMetricsLayer { metrics, routes }
    }
}

impl<S> Layer<S> for RequestMetricsLayer {
    type Service = RequestMetrics<S>;
    fn layer(&self, inner: S) -> RequestMetrics<S> {
        RequestMetrics { inner, metrics: self.metrics.clone(), routes: self.routes.clone() }
    }
}

#[derive(Clone)]
pub struct RequestMetrics<S> {
    inner: S,
    metrics: GatewayMetrics,
    routes: Routes,
}

impl<S> Service<InferCall> for RequestMetrics<S>
where
    S: Service<InferCall, Error = GatewayError>,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
{
    type Response = S::Response;
    type Error = GatewayError;
    type Future = BoxFuture<'static, Result<S::Response, GatewayError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), GatewayError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, call: InferCall) -> Self::Future {
        let model = self.routes.snapshot().model_label(call.model()).to_string();
        let record = Record { metrics: self.metrics.clone(), model, start: Instant::now(), code: None };
        let fut = self.inner.call(call);
        Box::pin(async move {
            // Moved in whole: dropping the future drops (and records) it.
            let mut record = record;
            let result = fut.await;
            record.code = Some(match &result {
                Ok(_) => tonic::Code::Ok,
                Err(e) => e.grpc_code(),
            });
            result
        })
    }
}

/// Records on drop, so that a dropped (cancelled) request is counted too.
struct Record {
    metrics: GatewayMetrics,
    model: String,
    start: Instant,
    code: Option<tonic::Code>,
}

impl Drop for Record {
    fn drop(&mut self) {
        let code = code_label(self.code.unwrap_or(tonic::Code::Cancelled));
        self.metrics.requests.with_label_values(&[self.model.as_str(), code]).inc();
        self.metrics
            .duration_us
            .with_label_values(&[self.model.as_str()])
            .observe(self.start.elapsed().as_micros() as f64);
    }
}
