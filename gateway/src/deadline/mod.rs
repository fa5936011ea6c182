//! Deadline: a request carries an absolute deadline ([`Deadlined`]); the layers below get until
//! then, after which their future is dropped (cancelling the forwarded call, which the worker
//! sees as a cancelled RPC) and [`DeadlineExceeded`] answers (DEADLINE_EXCEEDED / HTTP 504).
//! A request whose deadline has already passed is refused without running.
//!
//! Generic over the request (`Req: Deadlined`) and the error type (`E: From<DeadlineExceeded>`).

mod layer;
mod service;

use std::time::Instant;

pub use layer::DeadlineLayer;
pub use service::Deadline;

/// A request with an absolute deadline (`None`: none).
pub trait Deadlined {
    fn deadline(&self) -> Option<Instant>;
}

/// The request's deadline passed before it completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the request's deadline passed before a worker answered")]
pub struct DeadlineExceeded;

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tower::{Layer, ServiceExt};

    struct Req(Option<Instant>);
    impl Deadlined for Req {
        fn deadline(&self) -> Option<Instant> {
            self.0
        }
    }

    #[derive(Debug, PartialEq)]
    struct E;
    impl From<DeadlineExceeded> for E {
        fn from(_: DeadlineExceeded) -> E {
            E
        }
    }

    #[tokio::test(start_paused = true)]
    async fn gives_up_at_the_deadline() {
        let slow = tower::service_fn(|_: Req| async {
            tokio::time::sleep(Duration::from_secs(10)).await;
            Ok::<_, E>(1)
        });
        let svc = DeadlineLayer.layer(slow);
        let start = tokio::time::Instant::now();
        let now = Instant::now();
        assert_eq!(svc.clone().oneshot(Req(Some(now + Duration::from_secs(2)))).await, Err(E));
        assert!(start.elapsed() >= Duration::from_secs(2) && start.elapsed() < Duration::from_secs(3));
        assert_eq!(svc.clone().oneshot(Req(None)).await, Ok(1));
        assert_eq!(svc.clone().oneshot(Req(Some(Instant::now() + Duration::from_secs(60)))).await, Ok(1));
    }

    #[tokio::test]
    async fn refuses_a_request_already_late() {
        let svc = DeadlineLayer.layer(tower::service_fn(|_: Req| async { Ok::<_, E>(1) }));
        let past = Instant::now().checked_sub(Duration::from_millis(1)).unwrap();
        assert_eq!(svc.oneshot(Req(Some(past))).await, Err(E));
    }
}
