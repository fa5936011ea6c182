use tower::Layer;

use super::{Admission, AdmissionGate};

/// Shares one gate's limit among every service it wraps.
#[derive(Clone, Debug)]
pub struct AdmissionLayer {
    gate: AdmissionGate,
}

impl AdmissionLayer {
    pub fn new(gate: AdmissionGate) -> Self {
        AdmissionLayer { gate }
    }
}

impl<S> Layer<S> for AdmissionLayer {
    type Service = Admission<S>;
    fn layer(&self, inner: S) -> Admission<S> {
        Admission::new(inner, self.gate.clone())
    }
}
