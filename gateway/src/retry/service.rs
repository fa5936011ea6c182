use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use futures::future::BoxFuture;
use tower::{Service, ServiceExt};

use super::{MAX_ATTEMPTS, Policy, RetryBudget};
use crate::deadline::Deadlined;

#[derive(Clone)]
pub struct Retry<S, P> {
    inner: S,
    policy: P,
    budget: Arc<RetryBudget>,
}

impl<S, P> Retry<S, P> {
    pub(super) fn new(inner: S, policy: P, budget: Arc<RetryBudget>) -> Self {
        Retry { inner, policy, budget }
    }
}

impl<S, P, Req> Service<Req> for Retry<S, P>
where
    Req: Clone + Deadlined + Send + 'static,
    S: Service<Req> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
    S::Error: Send + 'static,
    P: Policy<Req, S::Error>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        // The first attempt uses the service that was polled ready; retries wait for readiness
        // of a clone.
        let first = self.inner.call(req.clone());
        let (inner, policy, budget) = (self.inner.clone(), self.policy.clone(), self.budget.clone());
        Box::pin(async move {
            budget.deposit(Instant::now());
            let mut req = req;
            let mut result = first.await;
            let mut attempts = 1;
            while let Err(error) = &result {
                if attempts >= MAX_ATTEMPTS || req.deadline().is_some_and(|d| d <= Instant::now()) {
                    break;
                }
                let Some(next) = policy.retry(&req, error) else {
                    break;
                };
                if !budget.try_withdraw(Instant::now()) {
                    tracing::debug!("retry budget spent; not retrying");
                    break;
                }
                policy.retried(&next);
                attempts += 1;
                req = next;
                result = inner.clone().oneshot(req.clone()).await;
            }
            result
        })
    }
}
