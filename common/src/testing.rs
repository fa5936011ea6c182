//! Helpers for the crates' tests (integration tests cannot share a module across crates):
//! running a binary with a hard time limit.

use std::io::Read;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// What a bounded run printed, and how it ended.
pub struct Output {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Output {
    /// The exit code (-1 when a signal ended it) and everything it printed, stderr first.
    pub fn code_and_text(&self) -> (i32, String) {
        (self.status.code().unwrap_or(-1), self.stderr.clone() + &self.stdout)
    }
}

/// Runs `cmd` with its output captured; `on_wait` is called every 20 ms while it runs. Past
/// `limit` the process is killed and the test fails, naming `what`.
pub fn run_bounded(mut cmd: Command, what: &str, limit: Duration, mut on_wait: impl FnMut()) -> Output {
    let mut child =
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap_or_else(|e| panic!("start {what}: {e}"));
    let mut stdout = child.stdout.take().expect("piped");
    let mut stderr = child.stderr.take().expect("piped");
    let out = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stdout.read_to_string(&mut s);
        s
    });
    let err = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let deadline = Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap_or_else(|e| panic!("wait on {what}: {e}")) {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} ran past {limit:?}");
        }
        on_wait();
        std::thread::sleep(Duration::from_millis(20));
    };
    Output { status, stdout: out.join().unwrap_or_default(), stderr: err.join().unwrap_or_default() }
}

/// `args` with `--http-port 0 --grpc-port 0 --metrics-port 0` added where they do not name
/// that port already: a server started by a test never binds a fixed port, even one that
/// should have refused its flags and did not.
pub fn with_free_ports<'a>(args: &[&'a str]) -> Vec<&'a str> {
    let mut out = args.to_vec();
    for flag in ["--http-port", "--grpc-port", "--metrics-port"] {
        let named = args.iter().any(|a| *a == flag || a.strip_prefix(flag).is_some_and(|rest| rest.starts_with('=')));
        if !named {
            out.extend([flag, "0"]);
        }
    }
    out
}
