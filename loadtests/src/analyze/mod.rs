//! nereid-analyze: config sweeps with a Pareto frontier (Model Analyzer's job).
//!
//! The hot path, from `main`: [`cli::AnalyzeArgs::into_config`] → [`run`] (start or reach the
//! server, read the checkpoint) → [`sweep::run`] (per variant: [`config::variant_config`],
//! load through [`server::RepositoryClient`], measure with nereid-perf's
//! [`driver`](crate::driver) while [`server::RssSampler`] samples memory, checkpoint) →
//! [`report`] (frontier, recommendation, table, JSON, CSV, config.pbtxt) and [`html`].
//! The pure parts: the space in [`space`], quick search in [`quick`], the frontier and the
//! recommendation in [`frontier`], the checkpoint in [`checkpoint`].

pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod frontier;
pub mod html;
pub mod quick;
pub mod report;
pub mod result;
pub mod server;
pub mod space;
pub mod sweep;

use tokio_util::sync::CancellationToken;

use self::checkpoint::Checkpoint;
use self::cli::{AnalyzeConfig, ServerChoice};
use self::report::{AnalyzeReport, ReportContext};
use self::server::{RepositoryClient, WorkerProcess};
use self::sweep::{ServerHandle, Sweep};
use crate::client::Protocol;
use crate::error::exit;
use crate::report::Progress;

/// Why a sweep could not start (exit 2), or its outputs could not be written (exit 1).
#[derive(Debug, thiserror::Error)]
pub enum AnalyzeError {
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Checkpoint(#[from] checkpoint::CheckpointError),
    #[error(transparent)]
    Start(#[from] server::StartError),
    #[error("cannot reach {url}: {reason}")]
    Unreachable { url: String, reason: String },
    #[error("{0}")]
    Internal(String),
}

impl AnalyzeError {
    pub fn exit_code(&self) -> i32 {
        match self {
            AnalyzeError::Internal(_) => exit::INTERNAL,
            _ => exit::BAD_INPUT,
        }
    }
}

/// Runs a whole analysis: returns the exit code after printing the table and writing the
/// outputs, or an error when the sweep could not start.
pub fn run(config: AnalyzeConfig) -> Result<i32, AnalyzeError> {
    std::fs::create_dir_all(&config.output_dir)
        .map_err(|e| AnalyzeError::Usage(format!("--output-dir {}: {e}", config.output_dir.display())))?;
    let progress = Progress::new(!config.quiet);
    let resume_from = if config.resume {
        let c = Checkpoint::read(&config.checkpoint, &config.model)?;
        match &c {
            Some(c) => progress.note(&format!(
                "resuming from {} ({} variants recorded)",
                config.checkpoint.display(),
                c.results.len()
            )),
            None => progress.note(&format!("no checkpoint at {}; starting afresh", config.checkpoint.display())),
        }
        c
    } else {
        None
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.threads)
        .enable_all()
        .build()
        .map_err(|e| AnalyzeError::Internal(format!("cannot start the runtime: {e}")))?;
    runtime.block_on(async move {
        let interrupt = CancellationToken::new();
        let on_signal = interrupt.clone();
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                on_signal.cancel();
            }
        });
        let mut server = connect(&config, &progress).await?;
        let sweep = Sweep {
            model: config.model.clone(),
            base: config.base.clone(),
            space: config.space.clone(),
            strategy: config.strategy,
            constraints: config.constraints,
            objective: config.objective,
            load: config.load.clone(),
            checkpoint_path: config.checkpoint.clone(),
            resume_from,
        };
        let outcome = sweep::run(&sweep, &mut server, &progress, &interrupt).await;
        if let Some(worker) = server.worker.take() {
            worker.stop().await;
        }
        // Reports name the server as it was reached: https:// when over TLS.
        let url = if server.tls.is_some() { format!("https://{}", server.url) } else { server.url.clone() };
        let ctx = ReportContext {
            model: &config.model,
            url: &url,
            load: &config.load,
            space: &config.space,
            search: config.strategy,
            constraints: config.constraints,
            objective: config.objective,
        };
        let mut report = AnalyzeReport::new(ctx, outcome);
        let errors = report::write_all(&mut report, &config.output_dir);
        print!("{}", report::table(&report));
        let mut code = report.verdict.exit_code;
        for e in &errors {
            eprintln!("nereid-analyze: {e}");
        }
        if !errors.is_empty() && code == exit::OK {
            code = exit::INTERNAL;
        }
        eprintln!("nereid-analyze: results in {}", config.output_dir.display());
        if let Some(first) = report.verdict.problems.first() {
            eprintln!("nereid-analyze: exit {code}: {first}");
        }
        Ok(code)
    })
}

/// Starts the worker or checks the given server answers.
async fn connect(config: &AnalyzeConfig, progress: &Progress) -> Result<ServerHandle, AnalyzeError> {
    let protocol = config.load.protocol;
    match &config.server {
        ServerChoice::Start { bin, args, start_timeout } => {
            progress.note(&format!(
                "starting {} (log: {})",
                bin.display(),
                config.output_dir.join("worker.log").display()
            ));
            let worker =
                WorkerProcess::start(bin, &config.model_repository, args, &config.output_dir, *start_timeout).await?;
            let url = if protocol == Protocol::Grpc { worker.grpc_url() } else { worker.http_url() };
            let metrics_url = (config.scrape_metrics && worker.metrics_port > 0)
                .then(|| format!("http://127.0.0.1:{}/metrics", worker.metrics_port).parse().ok())
                .flatten();
            let repository = RepositoryClient::new(protocol, &url, config.load_timeout, None)
                .with_api_key(config.load.api_key.as_deref())
                .map_err(AnalyzeError::Usage)?;
            Ok(ServerHandle { repository, url, tls: None, metrics_url, pid: Some(worker.pid), worker: Some(worker) })
        }
        ServerChoice::External { url, pid, metrics_url, tls } => {
            let repository = RepositoryClient::new(protocol, url, config.load_timeout, tls.as_ref())
                .with_api_key(config.load.api_key.as_deref())
                .map_err(AnalyzeError::Usage)?;
            repository.check_live().await.map_err(|reason| AnalyzeError::Unreachable {
                url: url.clone(),
                reason: format!(
                    "it does not answer its liveness check (is it a KServe v2 server, on the port of the \
                     --protocol{}?): {reason}",
                    if tls.is_some() { ", speaking TLS" } else { "" }
                ),
            })?;
            let metrics_url = if config.scrape_metrics {
                Some(
                    crate::cli::metrics_uri(metrics_url.as_deref(), url)
                        .map_err(|e| AnalyzeError::Usage(e.to_string()))?,
                )
            } else {
                None
            };
            if pid.is_none() {
                progress.note("no --worker-pid: memory will be reported as unknown");
            }
            Ok(ServerHandle { url: url.clone(), tls: tls.clone(), repository, metrics_url, pid: *pid, worker: None })
        }
    }
}
