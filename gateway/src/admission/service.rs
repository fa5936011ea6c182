use std::task::{Context, Poll};

use futures::future::BoxFuture;
use tower::Service;

use super::{Admissible, AdmissionGate, Overloaded};

#[derive(Clone, Debug)]
pub struct Admission<S> {
    inner: S,
    gate: AdmissionGate,
}

impl<S> Admission<S> {
    pub(super) fn new(inner: S, gate: AdmissionGate) -> Self {
        Admission { inner, gate }
    }

    /// Requests holding a permit now.
    pub fn in_flight(&self) -> usize {
        self.gate.in_flight()
    }
}

impl<S, Req> Service<Req> for Admission<S>
where
    Req: Admissible,
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

    fn call(&mut self, mut req: Req) -> Self::Future {
        // Admitted at ingress, or here.
        let permit = match req.take_permit().map_or_else(|| self.gate.try_admit(), Ok) {
            Ok(permit) => permit,
            Err(overloaded) => return Box::pin(futures::future::ready(Err(overloaded.into()))),
        };
        let fut = self.inner.call(req);
        Box::pin(async move {
            let result = fut.await;
            drop(permit);
            result
        })
    }
}
