use std::sync::Arc;
use std::task::{Context, Poll};

use futures::future::BoxFuture;
use tokio::sync::Semaphore;
use tower::Service;

use super::Overloaded;

#[derive(Clone, Debug)]
pub struct Admission<S> {
    inner: S,
    permits: Arc<Semaphore>,
    limit: usize,
}

impl<S> Admission<S> {
    pub(super) fn new(inner: S, permits: Arc<Semaphore>, limit: usize) -> Self {
        Admission { inner, permits, limit }
    }

    /// Requests holding a permit now.
    pub fn in_flight(&self) -> usize {
        self.limit - self.permits.available_permits()
    }
}

impl<S, Req> Service<Req> for Admission<S>
where
    S: Service<Req>,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
    S::Error: Send + 'static,
    S::Error: From<Overloaded>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        match self.permits.clone().try_acquire_owned() {
            Ok(permit) => {
                let fut = self.inner.call(req);
                Box::pin(async move {
                    let result = fut.await;
                    drop(permit);
                    result
                })
            }
            Err(_) => {
                let limit = self.limit;
                Box::pin(futures::future::ready(Err(Overloaded { limit }.into())))
            }
        }
    }
}
