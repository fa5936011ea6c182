use std::task::{Context, Poll};
use std::time::Instant;

use futures::future::BoxFuture;
use tower::Service;

use super::pick;
use crate::call::InferCall;
use crate::routing::{RouteError, Routes};

#[derive(Clone)]
pub struct Balance<S> {
    inner: S,
    routes: Routes,
}

impl<S> Balance<S> {
    pub(super) fn new(inner: S, routes: Routes) -> Self {
        Balance { inner, routes }
    }
}

impl<S> Service<InferCall> for Balance<S>
where
    S: Service<InferCall> + Send,
    S::Error: From<RouteError> + Send + 'static,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut call: InferCall) -> Self::Future {
        match pick(&self.routes, &call, Instant::now()) {
            Ok((target, version)) => {
                call.target = Some(target);
                call.resolved_version = Some(version);
                Box::pin(self.inner.call(call))
            }
            Err(e) => Box::pin(futures::future::ready(Err(e.into()))),
        }
    }
}
