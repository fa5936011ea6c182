//! Membership: who the workers are and what each serves, published as routing tables.
//!
//! [`Membership`] is the seam between the routing core and where membership comes from:
//! [`EtcdMembership`] follows the fleet's `workers/`, `status/` and `drain/` keys in etcd
//! (`--etcd-endpoints`); [`StaticMembership`] polls a fixed list of workers (`--worker-grpc`)
//! for their readiness and repository index. Both build the same
//! [`crate::routing::WorkerView`]s and keep each worker's [`crate::upstream::Upstream`] across
//! tables, so nothing downstream depends on which one runs.

mod etcd;
mod polling;

use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use crate::routing::RoutesPublisher;

pub use etcd::EtcdMembership;
pub use polling::StaticMembership;

/// A source of routing tables. Implementations own their state in one task ([`Membership::run`])
/// and publish complete snapshots; readers never wait on them. A source that loses its backing
/// store keeps the last good table published (and says so in its metrics) rather than
/// publishing an empty one.
pub trait Membership: Send + 'static {
    /// Runs until `shutdown` is cancelled, publishing a table whenever it learns something
    /// (and at least once per poll or watch period, so the table's age stays meaningful).
    fn run(self: Box<Self>, publisher: RoutesPublisher, shutdown: CancellationToken) -> BoxFuture<'static, ()>;
}
