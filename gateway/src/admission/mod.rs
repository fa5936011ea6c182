//! Admission: at most `limit` requests in flight; one more is refused *at once* with
//! [`Overloaded`] (RESOURCE_EXHAUSTED / HTTP 429 with `Retry-After`), never queued — a gateway
//! that queues past its capacity only turns overload into timeouts (after tower's
//! `ConcurrencyLimit` + `LoadShed`, fused: the permit is taken in `call`).
//!
//! One [`AdmissionGate`] holds the limit. The ingresses take a [`Permit`] from it when a
//! request's headers arrive, *before* they read its body: an overloaded gateway refuses without
//! buffering anything, so its memory stays bounded by the limit × `--max-request-bytes`. The
//! request carries its permit down the stack, where the [`Admission`] layer takes one only for
//! requests that arrive without (each request of a `ModelStreamInfer` stream).
//!
//! Generic over the request ([`Admissible`]) and the error type (`E: From<Overloaded>`).

mod layer;
mod service;

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

pub use layer::AdmissionLayer;
pub use service::Admission;

/// The gateway's one concurrency limit, shared by the ingresses and the stack. Cheap to clone.
#[derive(Clone, Debug)]
pub struct AdmissionGate {
    permits: Arc<Semaphore>,
    limit: usize,
}

impl AdmissionGate {
    pub fn new(limit: usize) -> Self {
        AdmissionGate { permits: Arc::new(Semaphore::new(limit)), limit }
    }

    /// A place under the limit, or [`Overloaded`] at once.
    pub fn try_admit(&self) -> Result<Permit, Overloaded> {
        match self.permits.clone().try_acquire_owned() {
            Ok(permit) => Ok(Permit(Arc::new(permit))),
            Err(_) => Err(Overloaded { limit: self.limit }),
        }
    }

    /// Requests holding a permit now.
    pub fn in_flight(&self) -> usize {
        self.limit - self.permits.available_permits()
    }
}

/// A place under the limit, given back when the last clone is dropped: a request and the
/// copies its retries send hold one place together.
#[derive(Clone, Debug)]
pub struct Permit(#[allow(dead_code)] Arc<OwnedSemaphorePermit>);

/// A request that may arrive already admitted (its ingress took the permit).
pub trait Admissible {
    /// The permit the request carries, taken out of it.
    fn take_permit(&mut self) -> Option<Permit>;
}

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

    impl Admissible for () {
        fn take_permit(&mut self) -> Option<Permit> {
            None
        }
    }

    /// A request admitted by its ingress.
    struct Carried(Option<Permit>);
    impl Admissible for Carried {
        fn take_permit(&mut self) -> Option<Permit> {
            self.0.take()
        }
    }

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
        let svc = AdmissionLayer::new(AdmissionGate::new(2)).layer(inner);
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

    #[tokio::test]
    async fn a_request_admitted_at_ingress_keeps_its_place_and_gives_it_back_once() {
        let gate = AdmissionGate::new(1);
        let (release_tx, release_rx) = tokio::sync::watch::channel(false);
        let inner = tower::service_fn(move |_: Carried| {
            let mut rx = release_rx.clone();
            async move {
                let _ = rx.wait_for(|v| *v).await;
                Ok::<_, E>("done")
            }
        });
        let svc = AdmissionLayer::new(gate.clone()).layer(inner);
        // The ingress took the only place: the stack does not take a second one.
        let permit = gate.try_admit().unwrap();
        assert_eq!(gate.try_admit().unwrap_err(), Overloaded { limit: 1 });
        let admitted = tokio::spawn(svc.clone().oneshot(Carried(Some(permit))));
        // One arriving without a permit is refused: the place is held by the first.
        assert_eq!(svc.clone().oneshot(Carried(None)).await, Err(E::Overloaded));
        assert_eq!(gate.in_flight(), 1);
        release_tx.send(true).unwrap();
        assert_eq!(admitted.await.unwrap(), Ok("done"));
        // Given back when the request completed, not before and not twice.
        assert_eq!(gate.in_flight(), 0);
        assert_eq!(svc.clone().oneshot(Carried(None)).await, Ok("done"));
        assert_eq!(gate.in_flight(), 0);
    }
}
