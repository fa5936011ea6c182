//! nereid-gateway: parse and validate flags, serve until SIGTERM/SIGINT, then drain.

/// mimalloc, as in the worker (no measurable change in the gateway benchmark).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::process::ExitCode;

use clap::Parser;
use nereid_gateway::app;
use nereid_gateway::cli::Args;

fn main() -> ExitCode {
    let args = Args::parse();
    nereid_common::telemetry::init_tracing(args.log_verbose);
    if let Err(e) = nereid_common::limits::raise_open_files_limit() {
        tracing::warn!("cannot raise the open files limit to its hard limit: {e}");
    }
    let io_threads = args.io_threads;
    let config = match args.into_config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("nereid-gateway: {e}");
            return ExitCode::from(2);
        }
    };
    // One event-loop thread (the default) or a work-stealing pool: see --io-threads.
    let mut builder = match io_threads {
        1 => tokio::runtime::Builder::new_current_thread(),
        n => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            if n > 1 {
                b.worker_threads(n as usize);
            }
            b
        }
    };
    let runtime = match builder.enable_all().thread_name("nereid-gw").build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("nereid-gateway: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        // Installed before anything else: a signal during start-up also shuts down cleanly.
        let shutdown = nereid_worker::server::shutdown_signal()?;
        app::run(config, shutdown).await
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("nereid-gateway: {e:#}");
            ExitCode::FAILURE
        }
    }
}
