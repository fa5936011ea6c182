//! Logging set-up shared by every binary: `--log-verbose` picks the default level, `RUST_LOG`
//! overrides it.

/// Installs the global `tracing` subscriber (0 = info, 1 = debug, 2+ = trace). A second call
/// does nothing.
pub fn init_tracing(verbose: u8) {
    let default = match verbose {
        0 => "info",
        1 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_target(false).try_init();
}
