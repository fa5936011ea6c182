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
use crate::ingress::Ingress;
use crate::membership::{EtcdMembership, Membership, StaticMembership};
use crate::metrics::{GatewayMetrics, Refusals};
use crate::placement::PlacementController;
use crate::stack::infer_stack;
use crate::upstream::UpstreamOptions;
use crate::{grpc, http, routing};

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
    let upstream = UpstreamOptions { outlier: config.outlier, connections: config.upstream_connections };
    let membership: Box<dyn Membership> = match &config.etcd {
        Some(etcd) => {
            Box::new(EtcdMembership::new(etcd.endpoints.clone(), etcd.keys.clone(), upstream, metrics.clone()))
        }
        None => Box::new(
            StaticMembership::new(&config.workers, upstream, config.discovery).map_err(|e| anyhow::anyhow!(e))?,
        ),
    };
    let background = CancellationToken::new();
    // Membership and placement run until shutdown; either ending earlier (a panic included)
    // ends the gateway, rather than leaving it routing on a table nothing updates any more.
    let mut background_tasks = tokio::task::JoinSet::new();
    let token = background.child_token();
    background_tasks.spawn(async move {
        membership.run(publisher, token).await;
        "membership"
    });
    if let Some(etcd) = &config.etcd
        && etcd.placement
    {
        let controller = PlacementController::new(etcd.clone(), metrics.clone());
        let token = background.child_token();
        background_tasks.spawn(async move {
            controller.run(token).await;
            "placement controller"
        });
    }

    let draining = Arc::new(AtomicBool::new(false));
    let admission = AdmissionGate::new(config.admission.max_concurrent_requests);
    let ingress = Ingress {
        infer: infer_stack(&config, &routes, &metrics, &admission),
        control: Control::new(routes.clone()),
        routes: routes.clone(),
        request_timeout: config.request_timeout,
        max_request_bytes: config.max_request_bytes,
        admission,
        refusals: Refusals::new(&metrics, routes.clone()),
        draining: draining.clone(),
    };

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
    if tokio::time::timeout(config.exit_timeout, drain).await.is_err() {
        tracing::warn!("in-flight requests did not finish within --exit-timeout-secs; exiting anyway");
    }
    background.cancel();
    while background_tasks.join_next().await.is_some() {}
    metrics_stop.cancel();
    if !metrics_server.is_finished() {
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), &mut metrics_server).await;
    }
    result
}
