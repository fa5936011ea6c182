//! nereidctl: the operator CLI — parse flags (invalid input exits 2), run one command against
//! etcd (unreachable exits 1), print its result.

use std::io::Write;
use std::process::ExitCode;

use clap::Parser;
use nereid_gateway::ctl::{self, Cli};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("nereidctl: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(ctl::run(cli)) {
        Ok(text) => {
            // A closed pipe (`nereidctl get | head`) is not an error worth a panic.
            let _ = std::io::stdout().lock().write_all(text.as_bytes());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("nereidctl: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
