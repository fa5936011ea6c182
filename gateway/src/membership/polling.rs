//! [`StaticMembership`]: a fixed set of workers, each asked every `interval` for `ServerReady`
//! and its `RepositoryIndex`, over the same pooled channel requests use. Every poll of every
//! worker is bounded by `timeout`; the polls of one round run concurrently, so one slow worker
//! delays no one else's update by more than `timeout`. A worker that fails a poll is
//! Unreachable (nothing routes to it) until it answers again; the models it last listed stay
//! known meanwhile, so that a request for one is UNAVAILABLE (retry), not NOT_FOUND (final),
//! through one slow poll.

use std::sync::Arc;
use std::time::Instant;

use futures::future::{BoxFuture, join_all};
use nereid_proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
use nereid_proto::inference::repository_index_response::ModelIndex;
use nereid_proto::inference::{RepositoryIndexRequest, ServerReadyRequest};
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;

use super::Membership;
use crate::config::DiscoveryConfig;
use crate::routing::{RoutesPublisher, RoutingTable, WorkerState, WorkerView};
use crate::upstream::{Upstream, UpstreamOptions};

pub struct StaticMembership {
    upstreams: Vec<Arc<Upstream>>,
    config: DiscoveryConfig,
}

impl StaticMembership {
    /// One member per address; channels are created (not connected) here.
    pub fn new(addresses: &[String], upstream: UpstreamOptions, config: DiscoveryConfig) -> Result<Self, String> {
        let upstreams = addresses
            .iter()
            .map(|a| Upstream::new(a, upstream).map(Arc::new).map_err(|e| format!("--worker-grpc '{a}': {e}")))
            .collect::<Result<_, _>>()?;
        Ok(StaticMembership { upstreams, config })
    }

    /// Polls every member once (concurrently, each bounded by the timeout). A member that
    /// does not answer is listed with `known`'s models for it (what it answered last), which an
    /// answer replaces.
    async fn poll_round(&self, known: &mut [Vec<ModelIndex>]) -> Vec<WorkerView> {
        let views = join_all(self.upstreams.iter().map(|u| poll_worker(u.clone(), self.config))).await;
        views
            .into_iter()
            .zip(known.iter_mut())
            .map(|(view, known)| match view {
                Ok(view) => {
                    known.clone_from(&view.models);
                    view
                }
                Err(upstream) => WorkerView { upstream, state: WorkerState::Unreachable, models: known.clone() },
            })
            .collect()
    }
}

/// The member's view, or (the member back) when it did not answer in time.
async fn poll_worker(upstream: Arc<Upstream>, config: DiscoveryConfig) -> Result<WorkerView, Arc<Upstream>> {
    let mut client = GrpcInferenceServiceClient::new(upstream.channel());
    let poll = async {
        let ready = client.server_ready(ServerReadyRequest {}).await?.into_inner().ready;
        let index = client
            .repository_index(RepositoryIndexRequest { repository_name: String::new(), ready: false })
            .await?
            .into_inner();
        Ok::<_, tonic::Status>((ready, index.models))
    };
    let (state, models) = match tokio::time::timeout(config.timeout, poll).await {
        Ok(Ok((true, models))) => (WorkerState::Ready, models),
        Ok(Ok((false, models))) => (WorkerState::NotReady, models),
        Ok(Err(e)) => {
            tracing::debug!(worker = %upstream.id, "discovery poll failed: {}", e.message());
            return Err(upstream);
        }
        Err(_) => {
            tracing::debug!(worker = %upstream.id, "discovery poll timed out");
            return Err(upstream);
        }
    };
    Ok(WorkerView { upstream, state, models })
}

impl Membership for StaticMembership {
    fn run(self: Box<Self>, publisher: RoutesPublisher, shutdown: CancellationToken) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            let mut ticks = tokio::time::interval(self.config.interval);
            ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
            let mut last: Vec<Option<WorkerState>> = vec![None; self.upstreams.len()];
            let mut known: Vec<Vec<ModelIndex>> = vec![Vec::new(); self.upstreams.len()];
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = ticks.tick() => {}
                }
                let views = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    views = self.poll_round(&mut known) => views,
                };
                for (view, last) in views.iter().zip(last.iter_mut()) {
                    if *last != Some(view.state) {
                        let ready = match view.state {
                            WorkerState::Unreachable => 0,
                            _ => view.models.iter().filter(|m| m.state == "READY").count(),
                        };
                        tracing::info!(worker = %view.upstream.id, state = view.state.label(), ready_models = ready, "worker state");
                        *last = Some(view.state);
                    }
                }
                publisher.publish(RoutingTable::build(views, Instant::now()));
            }
        })
    }
}
