use std::sync::Arc;

use tokio::sync::Semaphore;
use tower::Layer;

use super::Admission;

/// Shares one limit among every service it wraps.
#[derive(Clone, Debug)]
pub struct AdmissionLayer {
    permits: Arc<Semaphore>,
    limit: usize,
}

impl AdmissionLayer {
    pub fn new(limit: usize) -> Self {
        AdmissionLayer { permits: Arc::new(Semaphore::new(limit)), limit }
    }
}

impl<S> Layer<S> for AdmissionLayer {
    type Service = Admission<S>;
    fn layer(&self, inner: S) -> Admission<S> {
        Admission::new(inner, self.permits.clone(), self.limit)
    }
}
