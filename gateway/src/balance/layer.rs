use tower::Layer;

use super::Balance;
use crate::routing::Routes;

#[derive(Clone)]
pub struct BalanceLayer {
    routes: Routes,
}

impl BalanceLayer {
    pub fn new(routes: Routes) -> Self {
        BalanceLayer { routes }
    }
}

impl<S> Layer<S> for BalanceLayer {
    type Service = Balance<S>;
    fn layer(&self, inner: S) -> Balance<S> {
        Balance::new(inner, self.routes.clone())
    }
}
