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
}
