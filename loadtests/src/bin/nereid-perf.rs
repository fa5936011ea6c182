//! nereid-perf: measures what a KServe v2 server sustains (throughput, latency percentiles,
//! goodput under an SLO). See `nereid-perf --help` for flags and exit codes.

use std::process::ExitCode;

use clap::Parser;
use nereid_loadtests::cli::Args;
use nereid_loadtests::html;
use nereid_loadtests::report::{self, Progress};
use nereid_loadtests::{PerfError, exit};

fn main() -> ExitCode {
    let args = Args::parse();
    let code = match run(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("nereid-perf: {e}");
            e.exit_code()
        }
    };
    ExitCode::from(code as u8)
}

fn run(args: Args) -> Result<i32, PerfError> {
    let threads = args.threads;
    let progress = Progress::new(!args.quiet);
    let (csv_path, json_path, html_path) = (args.csv.clone(), args.json.clone(), args.html.clone());
    let config = args.into_config()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .map_err(|e| PerfError::Usage(format!("cannot start the runtime: {e}")))?;
    let report = runtime.block_on(async {
        // Ctrl-C ends the run early but still reports what was measured.
        let interrupt = tokio_util::sync::CancellationToken::new();
        let on_signal = interrupt.clone();
        tokio::spawn(async move {
            if tokio::signal::ctrl_c().await.is_ok() {
                on_signal.cancel();
            }
        });
        nereid_loadtests::run(config, &progress, interrupt).await
    })?;

    print!("{}", report::table(&report));
    // Partial results are written too: a run that lost its server still keeps what it measured.
    let mut code = report.verdict.exit_code;
    let outputs: [(_, fn(&_) -> String); 3] =
        [(csv_path, report::csv), (json_path, report::json), (html_path, html::report)];
    for (path, render) in outputs {
        if let Some(path) = path
            && let Err(e) = report::write_file(&path, &render(&report))
        {
            eprintln!("nereid-perf: {e}");
            if code == exit::OK {
                code = exit::INTERNAL;
            }
        }
    }
    if let Some(first) = report.verdict.problems.first() {
        eprintln!("nereid-perf: exit {code}: {first}");
    }
    Ok(code)
}
