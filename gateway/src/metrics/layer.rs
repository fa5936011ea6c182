//! The outermost layer of the infer stack: counts every request by model, version and final
//! code and records its latency — rejections included. The version is the one that served the
//! request (the worker's answer names it), else the one it was for: the one asked for when the
//! table knows it, or — none asked for — the one it resolved to, as the worker
//! counts its failures; empty only when no version could be resolved. A request whose caller
//! goes away before it completes is counted as CANCELLED.

use std::task::{Context, Poll};
use std::time::Instant;

use futures::future::BoxFuture;
use tower::{Layer, Service};

use super::GatewayMetrics;
use crate::call::InferCall;
use crate::error::{GatewayError, code_label};
use crate::routing::Routes;
use crate::wire::InferResponse;

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
        RequestMetrics {
            inner,
            requests: self.metrics.requests.clone(),
            duration_us: self.metrics.duration_us.clone(),
            routes: self.routes.clone(),
        }
    }
}

#[derive(Clone)]
pub struct RequestMetrics<S> {
    inner: S,
    // The two vectors only: the stack is cloned per request, and all of GatewayMetrics is a
    // dozen reference counts.
    requests: prometheus::IntCounterVec,
    duration_us: prometheus::HistogramVec,
    routes: Routes,
}

impl<S> Service<InferCall> for RequestMetrics<S>
where
    S: Service<InferCall, Response = InferResponse, Error = GatewayError>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = GatewayError;
    type Future = BoxFuture<'static, Result<S::Response, GatewayError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), GatewayError>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, call: InferCall) -> Self::Future {
        // One snapshot per request, kept for labelling the served version too.
        let table = self.routes.snapshot();
        let model = table.model_label(call.model()).to_string();
        let version = table.version_label(call.model(), call.version);
        let record = Record {
            requests: self.requests.clone(),
            duration_us: self.duration_us.clone(),
            model,
            version,
            start: Instant::now(),
            code: None,
        };
        let fut = self.inner.call(call);
        Box::pin(async move {
            // Moved in whole: dropping the future drops (and records) it.
            let mut record = record;
            let result = fut.await;
            record.code = Some(match &result {
                Ok(response) => {
                    if let Ok(served) = response.header.model_version.parse::<i64>() {
                        let label = table.version_label(&response.header.model_name, Some(served));
                        if !label.is_empty() {
                            record.version = label;
                        }
                    }
                    tonic::Code::Ok
                }
                Err(e) => e.grpc_code(),
            });
            result
        })
    }
}

/// The `model` label of a gRPC inference refused before its message (which names the model)
/// was read.
pub const UNREAD_MODEL_LABEL: &str = "_unread";

/// Counts the inferences an ingress refuses before they reach the stack (admission, before the
/// body is read), labelled as [`RequestMetrics`] labels what reaches it.
#[derive(Clone)]
pub struct Refusals {
    requests: prometheus::IntCounterVec,
    duration_us: prometheus::HistogramVec,
    routes: Routes,
}

impl Refusals {
    pub fn new(metrics: &GatewayMetrics, routes: Routes) -> Self {
        Refusals { requests: metrics.requests.clone(), duration_us: metrics.duration_us.clone(), routes }
    }

    /// One refusal with `code`, of a request for `model` (name, version asked for) when known.
    pub fn count(&self, model: Option<(&str, Option<i64>)>, code: tonic::Code, start: Instant) {
        let table = self.routes.snapshot();
        let (model, version) = match model {
            Some((name, version)) => (table.model_label(name).to_string(), table.version_label(name, version)),
            None => (UNREAD_MODEL_LABEL.to_string(), String::new()),
        };
        drop(Record {
            requests: self.requests.clone(),
            duration_us: self.duration_us.clone(),
            model,
            version,
            start,
            code: Some(code),
        });
    }
}

/// Records on drop, so that a dropped (cancelled) request is counted too.
struct Record {
    requests: prometheus::IntCounterVec,
    duration_us: prometheus::HistogramVec,
    model: String,
    version: String,
    start: Instant,
    code: Option<tonic::Code>,
}

impl Drop for Record {
    fn drop(&mut self) {
        let code = code_label(self.code.unwrap_or(tonic::Code::Cancelled));
        let (model, version) = (self.model.as_str(), self.version.as_str());
        self.requests.with_label_values(&[model, version, code]).inc();
        self.duration_us.with_label_values(&[model, version]).observe(self.start.elapsed().as_micros() as f64);
    }
}
