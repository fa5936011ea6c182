use std::sync::Arc;

use tower::Layer;

use super::{Retry, RetryBudget};

#[derive(Clone)]
pub struct RetryLayer<P> {
    policy: P,
    budget: Arc<RetryBudget>,
}

impl<P> RetryLayer<P> {
    pub fn new(policy: P, budget: Arc<RetryBudget>) -> Self {
        RetryLayer { policy, budget }
    }
}

impl<P: Clone, S> Layer<S> for RetryLayer<P> {
    type Service = Retry<S, P>;
    fn layer(&self, inner: S) -> Retry<S, P> {
        Retry::new(inner, self.policy.clone(), self.budget.clone())
    }
}
