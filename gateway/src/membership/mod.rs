//! Membership: who the workers are and what each serves, published as routing tables.
//!
//! [`Membership`] is the seam between the routing core and where membership comes from. This
//! increment has [`StaticMembership`]: a fixed list of workers (`--worker-grpc`), each polled for
//! its readiness and repository index. The etcd implementation (next increment) will build the
//! same [`crate::routing::WorkerView`]s from `workers/` and `status/` watches instead, and reuse
//! [`crate::routing::RoutingTable::build`] and the [`crate::upstream::Upstream`] registry, so
//! nothing downstream changes.

mod polling;

use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use crate::routing::RoutesPublisher;

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
