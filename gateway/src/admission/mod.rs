//! Admission: at most `limit` requests in flight through the layers below; one more is refused
//! *at once* with [`Overloaded`] (RESOURCE_EXHAUSTED / HTTP 429 with `Retry-After`), never
//! queued — a gateway that queues past its capacity only turns overload into timeouts
//! (after tower's `ConcurrencyLimit` + `LoadShed`, fused: the permit is taken in `call`).
//!
//! Generic over the request and the error type (`E: From<Overloaded>`).

mod layer;
mod service;

pub use layer::AdmissionLayer;
pub use service::Admission;

/// The concurrency limit is reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the gateway is at its limit of {limit} concurrent requests; retry later")]
pub struct Overloaded {
    pub limit: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::convert::Infallible;
    use tower::{Layer, ServiceExt};

    #[derive(Debug, PartialEq)]
    enum E {
        Overloaded,
    }
    impl From<Overloaded> for E {
        fn from(_: Overloaded) -> E {
            E::Overloaded
        }
    }
    impl From<Infallible> for E {
        fn from(e: Infallible) -> E {
            match e {}
        }
    }

    #[tokio::test]
    async fn refuses_beyond_the_limit_at_once_and_admits_again_after() {
        let (release_tx, release_rx) = tokio::sync::watch::channel(false);
        let inner = tower::service_fn(move |_: ()| {
            let mut rx = release_rx.clone();
            async move {
                let _ = rx.wait_for(|v| *v).await;
                Ok::<_, E>("done")
            }
        });
        let svc = AdmissionLayer::new(2).layer(inner);
        let a = tokio::spawn(svc.clone().oneshot(()));
        let b = tokio::spawn(svc.clone().oneshot(()));
        // Wait (bounded) until both hold a permit.
        let limit = svc.clone();
        tokio::time::timeout(std::time::Duration::from_secs(5), async {
            while limit.in_flight() < 2 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .unwrap();
        assert_eq!(svc.clone().oneshot(()).await, Err(E::Overloaded));
        release_tx.send(true).unwrap();
        assert_eq!(a.await.unwrap(), Ok("done"));
        assert_eq!(b.await.unwrap(), Ok("done"));
        assert_eq!(svc.in_flight(), 0);
        assert_eq!(svc.clone().oneshot(()).await, Ok("done"));
    }
}
