//! Why a run stopped before measuring, and the process exit codes.

use crate::client::ClientError;
use crate::workload::WorkloadError;

/// Process exit codes of `nereid-perf` (also listed in `--help`).
pub mod exit {
    /// Every load level measured; the SLO (if any) was met at some level.
    pub const OK: i32 = 0;
    /// Internal error, or an output file could not be written.
    pub const INTERNAL: i32 = 1;
    /// Bad input: invalid flags, workload or trace file, unknown model, or unreachable server.
    pub const BAD_INPUT: i32 = 2;
    /// The server stopped answering mid-run; partial results were reported.
    pub const SERVER_LOST: i32 = 3;
    /// Results reported, but no load level met the SLO.
    pub const SLO_NOT_MET: i32 = 4;
    /// Results reported, but they cannot be trusted: no stable measurement within
    /// `--max-trials`, more than 1% of open-loop sends late, or no request succeeded.
    pub const UNTRUSTWORTHY: i32 = 5;
    /// The server's outputs differ from the input data file's `validation_data`; nothing was
    /// measured.
    pub const WRONG_OUTPUT: i32 = 6;
    /// Interrupted (Ctrl-C); results so far were reported.
    pub const INTERRUPTED: i32 = 130;
}

/// The run could not start measuring.
#[derive(Debug, thiserror::Error)]
pub enum PerfError {
    #[error("{0}")]
    Usage(String),
    #[error(transparent)]
    Workload(#[from] WorkloadError),
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error("writing {path}: {source}")]
    Output { path: String, source: std::io::Error },
    #[error("output validation failed: {0}")]
    WrongOutput(String),
}

impl PerfError {
    pub fn exit_code(&self) -> i32 {
        match self {
            PerfError::Usage(_) | PerfError::Workload(_) | PerfError::Client(_) => exit::BAD_INPUT,
            PerfError::Output { .. } => exit::INTERNAL,
            PerfError::WrongOutput(_) => exit::WRONG_OUTPUT,
        }
    }
}
