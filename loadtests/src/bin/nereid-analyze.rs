//! nereid-analyze: sweeps a model's config (instances × max batch × preferred batch × queue
//! delay) on a KServe v2 server, reports the Pareto frontier and writes the recommended
//! config.pbtxt. See `nereid-analyze --help` for flags and exit codes.

use std::process::ExitCode;

use clap::Parser;
use nereid_loadtests::analyze::{self, AnalyzeError, cli::AnalyzeArgs};

fn main() -> ExitCode {
    let args = AnalyzeArgs::parse();
    let code = match args.into_config().map_err(AnalyzeError::Usage).and_then(analyze::run) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("nereid-analyze: {e}");
            e.exit_code()
        }
    };
    ExitCode::from(code as u8)
}
