//! Shared by the end-to-end tests: running a binary with a hard time limit.

use std::io::Read;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// What a bounded run printed, and how it ended.
pub struct Output {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
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
            panic!("{what} ran past {limit:?}");
        }
        on_wait();
        std::thread::sleep(Duration::from_millis(20));
    };
    Output { status, stdout: out.join().unwrap_or_default(), stderr: err.join().unwrap_or_default() }
}
