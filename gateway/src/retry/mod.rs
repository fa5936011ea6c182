//! Retry: re-sends a failed request when — and only when — a [`Policy`] says it is safe, while
//! the [`RetryBudget`] allows it, at most [`MAX_ATTEMPTS`] times in all, and never past the
//! request's deadline. Otherwise the last error goes back to the caller unchanged.
//!
//! What is *safe* is the policy's call: for inference the gateway retries only requests a
//! worker provably did not run ([`SafeRetry`]). The layer itself is generic over the request
//! (`Clone + Deadlined`), the error and the policy.

mod budget;
mod layer;
mod safe;
mod service;

pub use budget::RetryBudget;
pub use layer::RetryLayer;
pub use safe::SafeRetry;
pub use service::Retry;

/// Attempts per request, the first included.
pub const MAX_ATTEMPTS: u32 = 3;

/// Decides whether a failed attempt may be retried.
pub trait Policy<Req, E>: Clone + Send + Sync + 'static {
    /// The request for the next attempt after `req` failed with `error`, or `None` when a
    /// retry is unsafe or pointless (e.g. no other worker could take it).
    fn retry(&self, req: &Req, error: &E) -> Option<Req>;

    /// Called once for each retry sent (`req` is the retried request), e.g. to count it.
    fn retried(&self, _req: &Req) {}
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use tower::{Layer, ServiceExt};

    use super::*;
    use crate::deadline::Deadlined;

    /// A request: its attempt number and deadline.
    #[derive(Clone, Debug)]
    struct Req(u32, Option<Instant>);
    impl Deadlined for Req {
        fn deadline(&self) -> Option<Instant> {
            self.1
        }
    }

    /// Retries errors marked retryable, numbering the attempts; records what it retried.
    #[derive(Clone, Default)]
    struct Marked(Arc<Mutex<Vec<u32>>>);
    impl Policy<Req, &'static str> for Marked {
        fn retry(&self, req: &Req, error: &&'static str) -> Option<Req> {
            (*error == "retryable").then(|| Req(req.0 + 1, req.1))
        }
        fn retried(&self, req: &Req) {
            self.0.lock().unwrap().push(req.0);
        }
    }

    /// A service that fails its first `failures` calls with `error`, then answers the attempt.
    fn flaky(
        failures: u32,
        error: &'static str,
    ) -> (
        impl tower::Service<Req, Response = u32, Error = &'static str, Future = impl Send> + Clone + Send,
        Arc<AtomicU32>,
    ) {
        let calls = Arc::new(AtomicU32::new(0));
        let c = calls.clone();
        let svc = tower::service_fn(move |req: Req| {
            let n = c.fetch_add(1, Ordering::SeqCst);
            async move { if n < failures { Err(error) } else { Ok(req.0) } }
        });
        (svc, calls)
    }

    fn generous() -> Arc<RetryBudget> {
        Arc::new(RetryBudget::new(100, 100, Instant::now()))
    }

    #[tokio::test]
    async fn retries_what_the_policy_allows_up_to_the_attempt_limit() {
        let policy = Marked::default();
        let (svc, calls) = flaky(1, "retryable");
        let retry = RetryLayer::new(policy.clone(), generous()).layer(svc);
        assert_eq!(retry.oneshot(Req(1, None)).await, Ok(2));
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        assert_eq!(*policy.0.lock().unwrap(), vec![2], "the retry is reported once, as sent");

        let policy = Marked::default();
        let (svc, calls) = flaky(10, "retryable");
        let retry = RetryLayer::new(policy.clone(), generous()).layer(svc);
        assert_eq!(retry.oneshot(Req(1, None)).await, Err("retryable"));
        assert_eq!(calls.load(Ordering::SeqCst), MAX_ATTEMPTS);
        assert_eq!(*policy.0.lock().unwrap(), vec![2, 3]);
    }

    #[tokio::test]
    async fn no_retry_when_unsafe_spent_or_late() {
        // The policy refuses.
        let policy = Marked::default();
        let (svc, calls) = flaky(1, "ran");
        assert_eq!(RetryLayer::new(policy.clone(), generous()).layer(svc).oneshot(Req(1, None)).await, Err("ran"));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        // No budget.
        let (svc, calls) = flaky(1, "retryable");
        let none = Arc::new(RetryBudget::new(0, 0, Instant::now()));
        assert_eq!(RetryLayer::new(policy.clone(), none).layer(svc).oneshot(Req(1, None)).await, Err("retryable"));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        // The deadline has passed.
        let (svc, calls) = flaky(1, "retryable");
        let past = Instant::now().checked_sub(Duration::from_millis(1));
        let late = RetryLayer::new(policy.clone(), generous()).layer(svc).oneshot(Req(1, past)).await;
        assert_eq!(late, Err("retryable"));
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert!(policy.0.lock().unwrap().is_empty());
    }
}
