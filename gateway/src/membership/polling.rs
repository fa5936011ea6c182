//! [`StaticMembership`]: a fixed set of workers, each asked every `interval` for `ServerReady`
//! and its `RepositoryIndex`, over the same pooled channel requests use. Every poll of every
//! worker is bounded by `timeout`; the polls of one round run concurrently, so one slow worker
//! delays no one else's update by more than `timeout`. A worker that fails a poll is
//! Unreachable (nothing routes to it) until it answers again.

use std::sync::Arc;
use std::time::Instant;

use futures::future::{BoxFuture, join_all};
use nereid_proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
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

    /// Polls every member once (concurrently, each bounded by the timeout).
    async fn poll_round(&self) -> Vec<WorkerView> {
        join_all(self.upstreams.iter().map(|u| poll_worker(u.clone(), self.config))).await
    }
}

async fn poll_worker(upstream: Arc<Upstream>, config: DiscoveryConfig) -> WorkerView {
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
            (WorkerState::Unreachable, Vec::new())
        }
        Err(_) => {
            tracing::debug!(worker = %upstream.id, "discovery poll timed out");
            (WorkerState::Unreachable, Vec::new())
        }
    };
    WorkerView { upstream, state, models }
}

impl Membership for StaticMembership {
    fn run(self: Box<Self>, publisher: RoutesPublisher, shutdown: CancellationToken) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            let mut ticks = tokio::time::interval(self.config.interval);
            ticks.set_missed_tick_behavior(MissedTickBehavior::Delay);
            let mut last: Vec<Option<WorkerState>> = vec![None; self.upstreams.len()];
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = ticks.tick() => {}
                }
                let views = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    views = self.poll_round() => views,
                };
                for (view, last) in views.iter().zip(last.iter_mut()) {
                    if *last != Some(view.state) {
                        let ready = view.models.iter().filter(|m| m.state == "READY").count();
                        tracing::info!(worker = %view.upstream.id, state = view.state.label(), ready_models = ready, "worker state");
                        *last = Some(view.state);
                    }
                }
                publisher.publish(RoutingTable::build(views, Instant::now()));
            }
        })
    }
}
