//! nereid-worker: parse flags, load ONNX Runtime, bind the HTTP / gRPC / metrics listeners,
//! load the model repository, serve until SIGTERM/SIGINT, then drain.

/// mimalloc instead of glibc's malloc: glibc's malloc and free were ~10 % of the I/O threads'
/// time; with mimalloc identity over gRPC at concurrency 16 served 26.7-27.5k infer/s against
/// 24.6-25.2k (back-to-back runs on a 2-core host).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use nereid_common::fleet::records::{self, Capacity, WorkerRecord, WorkerState};
use nereid_common::fleet::{self, Keys};
use nereid_common::telemetry::{LogFormat, LogValue};
use nereid_worker::backend::{self, SessionOptions};
use nereid_worker::cli::Args;
use nereid_worker::fleet::{FleetAgent, FleetOptions};
use nereid_worker::metrics::Metrics;
use nereid_worker::repository::{AUTOCOMPLETE_MAX_BATCH_SIZE, ControlMode, Repository, RepositoryOptions};
use nereid_worker::restrict::Restrictions;
use nereid_worker::server::{Limits, Server};
use nereid_worker::shm::SharedMemory;
use nereid_worker::{grpc, http};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    let args = Args::parse();
    let format = LogFormat::from_name(&args.log_format).expect("--log-format takes only tritonserver's names");
    if let Err(e) = nereid_common::telemetry::init_tracing_to(args.log_verbose, format, args.log_file.as_deref()) {
        let file = args.log_file.as_deref().unwrap_or(std::path::Path::new("")).display();
        eprintln!("nereid-worker: --log-file {file}: {e}");
        return ExitCode::from(2);
    }
    let levels = [("log_info", args.log_info), ("log_warning", args.log_warning), ("log_error", args.log_error)];
    let levels: Vec<_> = levels.iter().map(|(k, on)| (k.to_string(), LogValue::Bool(*on))).collect();
    nereid_common::telemetry::log_settings().apply(&levels).expect("booleans are valid log settings");
    if let Err(e) = nereid_common::limits::raise_open_files_limit() {
        tracing::warn!("cannot raise the open files limit to its hard limit: {e}");
    }
    match args.triton.check() {
        Ok(warnings) => warnings.iter().for_each(|w| tracing::warn!("{w}")),
        Err(e) => {
            eprintln!("nereid-worker: {e}");
            return ExitCode::from(2);
        }
    }
    // A budget below the largest request would let such requests run only on an idle worker.
    if args.max_queued_bytes != 0 && args.max_queued_bytes < args.max_request_bytes {
        eprintln!(
            "nereid-worker: --max-queued-bytes {} is below --max-request-bytes {}: raise it (or 0 for no bound)",
            args.max_queued_bytes, args.max_request_bytes
        );
        return ExitCode::from(2);
    }
    // Parsed before anything starts, so that a malformed value exits 2 like every other flag
    // error.
    let parsed = nereid_worker::cli::backend_settings(&args.backend_config).and_then(|(backend, warnings)| {
        Ok(Parsed {
            backend,
            http_rules: Arc::new(Restrictions::http(&args.http_restricted_api)?),
            grpc_rules: Arc::new(Restrictions::grpc(&args.grpc_restricted_protocol)?),
        })
        .inspect(|_| warnings.iter().for_each(|w| tracing::warn!("{w}")))
    });
    let parsed = match parsed {
        Ok(parsed) => parsed,
        Err(e) => {
            eprintln!("nereid-worker: {e}");
            return ExitCode::from(2);
        }
    };
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = args.http_thread_count {
        runtime.worker_threads(n as usize);
    }
    let runtime = match runtime.enable_all().thread_name("nereid-io").build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("nereid-worker: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(run(args, parsed));
    // A model build still running on a blocking thread cannot be interrupted, only its warm-up
    // (between runs); dropping the runtime would wait for the rest, past --exit-timeout-secs.
    nereid_worker::repository::begin_shutdown();
    // (deploy/k8s/validate.py counts these 2 s in the pods' termination grace period.)
    runtime.shutdown_timeout(Duration::from_secs(2));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("nereid-worker: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn bind(enabled: bool, addr: std::net::IpAddr, port: u16, what: &str) -> anyhow::Result<Option<TcpListener>> {
    if !enabled {
        return Ok(None);
    }
    let listener = TcpListener::bind(SocketAddr::new(addr, port))
        .await
        .with_context(|| format!("cannot bind the {what} port {addr}:{port} (--{what}-address / --{what}-port)"))?;
    Ok(Some(listener))
}

/// Flag values parsed beyond what clap checks.
struct Parsed {
    backend: nereid_worker::cli::BackendSettings,
    http_rules: Arc<Restrictions>,
    grpc_rules: Arc<Restrictions>,
}

async fn run(args: Args, parsed: Parsed) -> anyhow::Result<()> {
    let Parsed { backend, http_rules, grpc_rules } = parsed;
    // Register for SIGTERM/SIGINT first: a signal during start-up must also shut down cleanly.
    let mut shutdown_requested = std::pin::pin!(nereid_worker::server::shutdown_signal()?);
    for repo in &args.model_repository {
        anyhow::ensure!(repo.is_dir(), "--model-repository '{}' is not a directory", repo.display());
        // One that cannot be listed (its permissions, another user's folder in a container)
        // would serve as empty, and report ready.
        std::fs::read_dir(repo).with_context(|| format!("--model-repository '{}' cannot be read", repo.display()))?;
    }
    let lib = args.onnxruntime_lib.clone().unwrap_or_else(backend::default_runtime_path);
    backend::init_runtime(&lib).map_err(|e| anyhow::anyhow!("--onnxruntime-lib: {e}"))?;
    // The fleet flags checked before any port is bound (the ports are known only once bound:
    // placeholders here), so that a bad --label or --etcd-endpoints fails before a port file
    // says the worker is up. After ONNX Runtime is loaded: the record's devices ask CUDA,
    // through it.
    fleet_options(&args, args.allow_grpc.then_some(1), args.allow_http.then_some(1))?;

    let interval = Duration::from_millis(args.metrics_interval_ms);
    let gpu = args.allow_gpu_metrics.then(nereid_worker::gpu::GpuMonitor::new).flatten();
    let cpu = args.allow_cpu_metrics.then(|| nereid_worker::cpu::CpuMonitor::new(interval)).flatten();
    let metrics = Arc::new(Metrics::with_gpu(gpu.map(|g| g.with_interval(interval))).with_cpu(cpu));
    let options = RepositoryOptions {
        paths: args.model_repository.clone(),
        mode: args.model_control_mode.into(),
        strict_config: args.strict_model_config || args.disable_auto_complete_config,
        startup_models: args.load_model.clone(),
        load_threads: args.model_load_thread_count as usize,
        default_max_batch_size: backend.default_max_batch_size.unwrap_or(AUTOCOMPLETE_MAX_BATCH_SIZE),
        config_name: args.model_config_name.clone(),
        session_defaults: SessionOptions {
            intra_op_threads: args.intra_op_threads,
            denormal_as_zero: args.denormal_as_zero,
            ..Default::default()
        },
    };
    if options.mode != ControlMode::Explicit && !args.load_model.is_empty() {
        anyhow::bail!("--load-model requires --model-control-mode=explicit");
    }
    if options.mode != ControlMode::Explicit && args.etcd_endpoints.is_some() {
        anyhow::bail!("--etcd-endpoints requires --model-control-mode=explicit (placement decides what is loaded)");
    }
    let cache_bytes = nereid_worker::cache::parse_cache_config(&args.cache_config).map_err(anyhow::Error::msg)?;
    // tritonserver's older flag, where --cache-config does not say otherwise.
    let cache_bytes = cache_bytes.or(args.triton.response_cache_byte_size.filter(|&n| n > 0).map(|n| n as usize));
    let repository = Arc::new(
        Repository::new(options, metrics.clone())
            .with_response_cache(cache_bytes)
            .with_strict_readiness(args.strict_readiness())
            .with_max_queued_bytes(args.max_queued_bytes),
    );
    let server = Server {
        name: args.id.as_deref().unwrap_or(nereid_worker::server::SERVER_NAME).into(),
        repository: repository.clone(),
        metrics,
        limits: Limits { max_request_bytes: args.max_request_bytes as usize },
        shm: Arc::new(if args.allow_client_shm {
            SharedMemory::allowed(args.max_request_bytes)
        } else {
            SharedMemory::disabled()
        }),
    };

    let http_address = args.http_address.unwrap_or(args.address);
    let http_listener = bind(args.allow_http, http_address, args.http_port, "http").await?;
    let grpc_address = args.grpc_address.unwrap_or(args.address);
    let grpc_listener = bind(args.allow_grpc, grpc_address, args.grpc_port, "grpc").await?;
    let metrics_address = args.metrics_address.unwrap_or(args.address);
    let metrics_listener = bind(args.allow_metrics, metrics_address, args.metrics_port, "metrics").await?;
    let port = |l: &Option<TcpListener>| l.as_ref().and_then(|l| l.local_addr().ok()).map(|a| a.port());
    let (grpc_listener_port, http_listener_port) = (port(&grpc_listener), port(&http_listener));
    let ports = serde_json::json!({
        "http": port(&http_listener),
        "grpc": port(&grpc_listener),
        "metrics": port(&metrics_listener),
    });
    tracing::info!(%ports, "listening");

    let shutdown = CancellationToken::new();
    let mut servers = tokio::task::JoinSet::new();
    if let Some(listener) = http_listener {
        // --http-max-input-size bounds HTTP bodies alone.
        let limit = args.http_max_input_size.unwrap_or(args.max_request_bytes) as usize;
        let http_server = Server { limits: Limits { max_request_bytes: limit }, ..server.clone() };
        let (router, token) = (http::restricted(http::router(http_server), http_rules), shutdown.clone());
        servers.spawn(async move { http::serve(listener, router, token).await.context("HTTP server") });
    }
    if let Some(listener) = grpc_listener {
        let (server, token) = (server.clone(), shutdown.clone());
        let options = grpc::ServeOptions {
            keepalive: grpc::KeepAlive {
                interval: Duration::from_millis(args.grpc_keepalive_time),
                timeout: Duration::from_millis(args.grpc_keepalive_timeout),
            },
            restrictions: grpc_rules,
            compress_responses: !args.grpc_infer_response_compression_level.eq_ignore_ascii_case("none"),
        };
        servers.spawn(async move { grpc::serve(listener, server, options, token).await.context("gRPC server") });
    }
    // The metrics endpoint outlives intake: Prometheus scrapes the drain (requests pending and
    // finishing, their failures). It stops once the drain is over.
    let metrics_stop = CancellationToken::new();
    let mut metrics_server = tokio::task::JoinSet::new();
    if let Some(listener) = metrics_listener {
        let (router, token) = (http::metrics_router(server.clone()), metrics_stop.clone());
        metrics_server.spawn(async move { http::serve(listener, router, token).await.context("metrics server") });
    }
    if let Some(path) = &args.port_file {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, ports.to_string()).with_context(|| format!("--port-file {}", path.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("--port-file {}", path.display()))?;
    }

    let mut fleet = match fleet_options(&args, grpc_listener_port, http_listener_port)? {
        Some(options) => Some(
            FleetAgent::start(options, repository.clone(), server.metrics.fleet())
                .context("cannot start the etcd agent")?,
        ),
        None => None,
    };

    let started = tokio::select! {
        failed = repository.load_startup_models() => Some(failed),
        // The servers already answer (models loaded so far serve): drain them as below.
        _ = &mut shutdown_requested => {
            tracing::info!("shutdown requested during start-up: draining");
            None
        }
    };
    if let Some(failed) = started {
        if !failed.is_empty() && args.exit_on_error {
            shutdown.cancel();
            if let Some(fleet) = fleet.take() {
                fleet.stop(Duration::from_secs(5)).await;
            }
            anyhow::bail!(
                "models failed to load (--exit-on-error=true): {}",
                failed.iter().map(|(m, e)| format!("{m}: {e}")).collect::<Vec<_>>().join("; ")
            );
        }
        tracing::info!(ready = repository.server_ready(), "model repository loaded");
        if repository.options().mode == ControlMode::Poll {
            let interval = Duration::from_secs(args.repository_poll_secs);
            tokio::spawn(repository.clone().poll_task(interval, shutdown.child_token()));
        }

        // A server stopped on its own: that is an error worth exiting for.
        let stopped = tokio::select! {
            _ = &mut shutdown_requested => {
                tracing::info!("shutdown requested: draining");
                None
            }
            Some(result) = servers.join_next() => Some(stopped_unexpectedly(result, "server")),
            Some(result) = metrics_server.join_next() => Some(stopped_unexpectedly(result, "metrics server")),
        };
        if let Some(e) = stopped {
            shutdown.cancel();
            metrics_stop.cancel();
            // Out of the fleet before exiting: the lease revoked, not left to expire while
            // gateways still route here.
            if let Some(fleet) = fleet {
                fleet.stop(Duration::from_secs(5)).await;
            }
            return Err(e);
        }
    }
    // Not ready any more; in the fleet, tell the gateways first and give them --drain-delay-ms
    // to stop sending while this worker still accepts.
    repository.set_draining();
    if let Some(fleet) = fleet.as_mut() {
        fleet.drain(Duration::from_secs(3)).await;
        tokio::time::sleep(Duration::from_millis(args.drain_delay_ms)).await;
    }
    // Stop intake (servers stop accepting and finish in-flight requests), bounded in time.
    shutdown.cancel();
    // A server that failed while draining (rather than finishing its requests) makes the exit
    // status non-zero; the drain goes on for the others.
    let mut failed: Option<anyhow::Error> = None;
    let drain = async {
        while let Some(result) = servers.join_next().await {
            let result = result.context("server task").and_then(|r| r);
            if let Err(e) = result {
                tracing::error!("a server failed while draining: {e:#}");
                failed.get_or_insert(e);
            }
        }
    };
    // Cut short, the drain failed some requests: the exit status says so (tritonserver exits 1
    // when its exit timeout expires), after the worker has left the fleet as usual.
    if tokio::time::timeout(Duration::from_secs(args.exit_timeout_secs), drain).await.is_err() {
        failed.get_or_insert(anyhow::anyhow!(
            "in-flight requests did not finish within --exit-timeout-secs ({} s): exiting with them unanswered",
            args.exit_timeout_secs
        ));
    }
    metrics_stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(1), async { while metrics_server.join_next().await.is_some() {} })
        .await;
    // Leave the fleet: the lease's revocation removes the registration and statuses at once.
    if let Some(fleet) = fleet {
        fleet.stop(Duration::from_secs(5)).await;
    }
    failed.map_or(Ok(()), Err)
}

/// Why a server task that was to run until shutdown ended.
fn stopped_unexpectedly(result: Result<anyhow::Result<()>, tokio::task::JoinError>, what: &str) -> anyhow::Error {
    match result {
        Ok(Ok(())) => anyhow::anyhow!("the {what} stopped unexpectedly"),
        Ok(Err(e)) => e,
        Err(e) => anyhow::Error::from(e).context(format!("{what} task")),
    }
}

/// The fleet agent's options when --etcd-endpoints is given; errors name the flag.
fn fleet_options(args: &Args, grpc_port: Option<u16>, http_port: Option<u16>) -> anyhow::Result<Option<FleetOptions>> {
    let Some(endpoints) = &args.etcd_endpoints else { return Ok(None) };
    let endpoints = fleet::parse_endpoints(endpoints).map_err(|e| anyhow::anyhow!("--etcd-endpoints: {e}"))?;
    let keys = Keys::new(&args.etcd_prefix).map_err(|e| anyhow::anyhow!("--etcd-prefix: {e}"))?;
    let grpc_port = grpc_port.context("--etcd-endpoints requires the gRPC server (--allow-grpc=true)")?;
    // The host the gateway dials: --advertise-address, else where each server listens.
    let host_of = |bound: std::net::IpAddr| {
        let host = match &args.advertise_address {
            Some(h) => h.clone(),
            None if bound.is_unspecified() => "127.0.0.1".to_string(),
            None => bound.to_string(),
        };
        if host.contains(':') && !host.starts_with('[') { format!("[{host}]") } else { host }
    };
    let host = host_of(args.grpc_address.unwrap_or(args.address));
    let http_host = host_of(args.http_address.unwrap_or(args.address));
    let id = match &args.worker_id {
        Some(id) => id.clone(),
        None => format!("{}-{grpc_port}", fleet::hostname("worker")),
    };
    let mut labels = std::collections::BTreeMap::new();
    for l in &args.labels {
        let (k, v) = l.split_once('=').with_context(|| format!("--label '{l}': expected key=value"))?;
        // As nereidctl checks a model's --selector: every label can be selected.
        nereid_common::fleet::records::check_label(k, v).map_err(|e| anyhow::anyhow!("--label '{l}': {e}"))?;
        labels.insert(k.to_string(), v.to_string());
    }
    let mut devices = vec!["cpu".to_string()];
    devices.extend((0..backend::gpu_count()).map(|i| format!("gpu:{i}")));
    let record = WorkerRecord {
        schema: records::SCHEMA_VERSION,
        id,
        grpc: format!("{host}:{grpc_port}"),
        http: http_port.map(|p| format!("{http_host}:{p}")),
        state: WorkerState::Ready,
        capacity: Capacity {
            memory_mb: args.memory_capacity_mb.unwrap_or_else(host_memory_mb),
            max_models: args.max_models,
        },
        devices,
        labels,
        cost_classes: Vec::new(),
    };
    records::encode(&record).map_err(|e| anyhow::anyhow!("--worker-id / --advertise-address / --label: {e}"))?;
    Ok(Some(FleetOptions {
        endpoints,
        keys,
        record,
        lease_ttl: Duration::from_secs(args.etcd_lease_ttl_secs),
        // Long enough for one status update to be published (200 ms) and watched.
        unload_grace: Duration::from_millis(args.drain_delay_ms.max(500)),
    }))
}

/// MemTotal from /proc/meminfo, in MiB (0 when unknown).
fn host_memory_mb() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kb| kb / 1024)
}
