use std::task::{Context, Poll};
use std::time::Instant;

use futures::future::BoxFuture;
use tower::Service;

use super::{DeadlineExceeded, Deadlined};

#[derive(Clone, Debug)]
pub struct Deadline<S> {
    inner: S,
}

impl<S> Deadline<S> {
    pub(super) fn new(inner: S) -> Self {
        Deadline { inner }
    }
}

impl<S, Req> Service<Req> for Deadline<S>
where
    Req: Deadlined,
    S: Service<Req>,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
    S::Error: Send + 'static,
    S::Error: From<DeadlineExceeded>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let Some(deadline) = req.deadline() else {
            return Box::pin(self.inner.call(req));
        };
        let now = Instant::now();
        if deadline <= now {
            return Box::pin(futures::future::ready(Err(DeadlineExceeded.into())));
        }
        // Measured on tokio's clock (so paused-time tests drive it) from the same instant.
        let until = tokio::time::Instant::now() + (deadline - now);
        let fut = self.inner.call(req);
        Box::pin(async move {
            match tokio::time::timeout_at(until, fut).await {
                Ok(result) => result,
                Err(_) => Err(DeadlineExceeded.into()),
            }
        })
    }
}
