//! The gateway process: bind the listeners, start membership, assemble the stack, serve, and
//! on shutdown stop intake → finish in-flight requests within the grace period → stop
//! membership and the metrics endpoint → return.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::Context;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::admission::AdmissionGate;
use crate::config::GatewayConfig;
use crate::control::Control;
use crate::ingress::{Ingress, IngressState};
use crate::membership::{EtcdMembership, Membership, StaticMembership};
use crate::metrics::{GatewayMetrics, Refusals};
use crate::placement::PlacementController;
use crate::stack::infer_stack;
use crate::upstream::UpstreamOptions;
use crate::{grpc, http, routing};

/// How long the gateway waits before starting a failed placement controller again; doubled
/// after each failure that came soon after a start, up to the maximum.
const PLACEMENT_RESTART_PAUSE: std::time::Duration = std::time::Duration::from_secs(1);
const PLACEMENT_RESTART_PAUSE_MAX: std::time::Duration = std::time::Duration::from_secs(60);
/// Most time, after requests have drained, that membership and placement get to stop.
const BACKGROUND_STOP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

async fn bind(addr: std::net::IpAddr, port: u16, what: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(SocketAddr::new(addr, port))
        .await
        .with_context(|| format!("cannot bind the {what} port {addr}:{port} (--{what}-port)"))
}

/// Runs the gateway until `shutdown_requested` resolves (or a server fails), then drains.
pub async fn run(config: GatewayConfig, shutdown_requested: impl Future<Output = ()>) -> anyhow::Result<()> {
    let listen = &config.listen;
    let http_listener = bind(listen.address, listen.http_port, "http").await?;
    let grpc_listener = bind(listen.address, listen.grpc_port, "grpc").await?;
    let metrics_listener = bind(listen.address, listen.metrics_port, "metrics").await?;
    let port = |l: &TcpListener| l.local_addr().map(|a| a.port()).ok();
    let ports = serde_json::json!({
        "http": port(&http_listener),
        "grpc": port(&grpc_listener),
        "metrics": port(&metrics_listener),
    });

    // Membership publishes routing tables; everything else reads them.
    let (publisher, routes) = routing::routes(Instant::now());
    let metrics = GatewayMetrics::new();
    let upstream = UpstreamOptions {
        outlier: config.outlier,
        connections: config.upstream_connections,
        connect_timeout: config.connect_timeout,
    };
    let membership: Box<dyn Membership> = match &config.etcd {
        Some(etcd) => {
            Box::new(EtcdMembership::new(etcd.endpoints.clone(), etcd.keys.clone(), upstream, metrics.clone()))
        }
        None => Box::new(
            StaticMembership::new(&config.workers, upstream, config.discovery).map_err(|e| anyhow::anyhow!(e))?,
        ),
    };
    let background = CancellationToken::new();
    // Membership and placement run until shutdown; either ending earlier ends the gateway,
    // rather than leaving it routing on a table nothing updates any more — membership's panic
    // included. A panic of the placement controller (a bug, on a control path) is not: every
    // gateway plans the same fleet, so each new leader would crash its ingress in turn. It is
    // logged, counted and the controller started again after a pause (its leadership lapses
    // meanwhile: the term's keep-alive goes with it).
    let mut background_tasks = tokio::task::JoinSet::new();
    let token = background.child_token();
    background_tasks.spawn(async move {
        membership.run(publisher, token).await;
        "membership"
    });
    if let Some(etcd) = &config.etcd
        && etcd.placement
    {
        let (etcd, metrics, token) = (etcd.clone(), metrics.clone(), background.child_token());
        background_tasks.spawn(async move {
            let start = || PlacementController::new(etcd.clone(), metrics.clone()).run(token.clone());
            let failed = || {
                metrics.placement_restarts.inc();
                metrics.placement_leader.set(0);
            };
            restart_on_panic("the placement controller", start, failed, &token).await;
            "placement controller"
        });
    }

    let draining = Arc::new(AtomicBool::new(false));
    let admission = AdmissionGate::new(config.admission.max_concurrent_requests);
    let ingress = Ingress::new(IngressState {
        infer: infer_stack(&config, &routes, &metrics, &admission),
        control: Control::new(routes.clone()),
        routes: routes.clone(),
        request_timeout: config.request_timeout,
        max_request_bytes: config.max_request_bytes,
        admission,
        refusals: Refusals::new(&metrics, routes.clone()),
        draining: draining.clone(),
    });

    let intake = CancellationToken::new();
    let mut servers = tokio::task::JoinSet::new();
    {
        let (router, token) = (http::router(ingress.clone()), intake.clone());
        servers.spawn(async move { http::serve(http_listener, router, token).await.context("HTTP server") });
        let (ingress, token) = (ingress.clone(), intake.clone());
        servers.spawn(async move { grpc::serve(grpc_listener, ingress, token).await.context("gRPC server") });
    }
    // The metrics endpoint outlives intake: Prometheus scrapes the drain (in-flight requests
    // finishing, their latencies) as Envoy's admin endpoint lets it. It stops with membership.
    let metrics_stop = CancellationToken::new();
    let mut metrics_server = {
        let (router, token) = (http::metrics_router(metrics.clone(), routes.clone()), metrics_stop.clone());
        tokio::spawn(async move { http::serve(metrics_listener, router, token).await.context("metrics server") })
    };
    if let Some(path) = &listen.port_file {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, ports.to_string()).with_context(|| format!("--port-file {}", path.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("--port-file {}", path.display()))?;
    }
    tracing::info!(%ports, static_workers = config.workers.len(), etcd = config.etcd.is_some(), "gateway listening");

    let result = tokio::select! {
        _ = shutdown_requested => {
            tracing::info!("shutdown requested: draining");
            Ok(())
        }
        Some(result) = servers.join_next() => {
            match result {
                Ok(Err(e)) => Err(e),
                Err(e) => Err(anyhow::Error::from(e).context("server task")),
                Ok(Ok(())) => Err(anyhow::anyhow!("a server stopped unexpectedly")),
            }
        }
        ended = &mut metrics_server => {
            match ended {
                Ok(Err(e)) => Err(e),
                Err(e) => Err(anyhow::Error::from(e).context("metrics server task")),
                Ok(Ok(())) => Err(anyhow::anyhow!("the metrics server stopped unexpectedly")),
            }
        }
        Some(ended) = background_tasks.join_next() => {
            match ended {
                Ok(task) => Err(anyhow::anyhow!("the {task} task stopped unexpectedly")),
                Err(e) => Err(anyhow::Error::from(e).context("the membership or placement task failed")),
            }
        }
    };

    // Stop intake: not ready any more, listeners closed; in-flight requests finish (they still
    // route on the live table) within the grace period.
    draining.store(true, Ordering::Relaxed);
    intake.cancel();
    let drain = async { while servers.join_next().await.is_some() {} };
    // Cut short, the drain failed some requests: the exit status says so (as a worker's does).
    let result = match tokio::time::timeout(config.exit_timeout, drain).await {
        Ok(()) => result,
        Err(_) => {
            let cut = anyhow::anyhow!(
                "in-flight requests did not finish within --exit-timeout-secs ({} s): exiting with them unanswered",
                config.exit_timeout.as_secs()
            );
            match result {
                Ok(()) => Err(cut),
                Err(e) => {
                    tracing::error!("{cut:#}");
                    Err(e)
                }
            }
        }
    };
    background.cancel();
    // Bounded: against a slow etcd, stepping down (resign, revoke) could otherwise hold the
    // exit past a supervisor's kill. Cut short (the tasks aborted), the leadership lapses with
    // its lease's TTL.
    let stop = async { while background_tasks.join_next().await.is_some() {} };
    if tokio::time::timeout(BACKGROUND_STOP_TIMEOUT, stop).await.is_err() {
        tracing::warn!("membership or placement did not stop within {BACKGROUND_STOP_TIMEOUT:?}; exiting anyway");
        background_tasks.abort_all();
    }
    metrics_stop.cancel();
    if !metrics_server.is_finished() {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), &mut metrics_server).await;
    }
    result
}

/// Runs the task `start` makes until it returns or `stop` is cancelled, starting it again
/// after a pause each time it panics (`failed` is told first). The pause doubles with each
/// failure that came soon after a start, up to [`PLACEMENT_RESTART_PAUSE_MAX`].
async fn restart_on_panic<F, Fut>(what: &str, start: F, failed: impl Fn(), stop: &CancellationToken)
where
    F: Fn() -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    /// The task, aborted when this (the wrapper's future) is dropped: at a bounded exit.
    struct Task(tokio::task::JoinHandle<()>);
    impl Drop for Task {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    let mut pause = PLACEMENT_RESTART_PAUSE;
    loop {
        let started = tokio::time::Instant::now();
        let mut task = Task(tokio::spawn(start()));
        let Err(e) = (&mut task.0).await else { return };
        if started.elapsed() > PLACEMENT_RESTART_PAUSE_MAX * 5 {
            pause = PLACEMENT_RESTART_PAUSE;
        }
        failed();
        tracing::error!("{what} failed ({e}); starting it again in {pause:?}");
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
        pause = (pause * 2).min(PLACEMENT_RESTART_PAUSE_MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A task that panics is started again (after 1 s, then 2 s), each failure told; one that
    /// returns is not.
    #[tokio::test(start_paused = true)]
    async fn a_panicking_task_is_started_again_after_a_growing_pause() {
        let starts = Arc::new(AtomicUsize::new(0));
        let failures = AtomicUsize::new(0);
        let began = tokio::time::Instant::now();
        let start = || {
            let starts = starts.clone();
            async move {
                if starts.fetch_add(1, Ordering::SeqCst) < 2 {
                    panic!("a bug");
                }
            }
        };
        restart_on_panic(
            "test task",
            start,
            || {
                failures.fetch_add(1, Ordering::SeqCst);
            },
            &CancellationToken::new(),
        )
        .await;
        assert_eq!(starts.load(Ordering::SeqCst), 3);
        assert_eq!(failures.load(Ordering::SeqCst), 2);
        assert_eq!(began.elapsed(), std::time::Duration::from_secs(3), "paused 1 s, then 2 s");
        // Stopped while it pauses: it is not started again.
        let stop = CancellationToken::new();
        stop.cancel();
        let starts = AtomicUsize::new(0);
        let start = || {
            starts.fetch_add(1, Ordering::SeqCst);
            async { panic!("a bug") }
        };
        restart_on_panic("test task", start, || {}, &stop).await;
        assert_eq!(starts.load(Ordering::SeqCst), 1);
    }
}
