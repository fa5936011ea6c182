//! A real `nereid-worker` process on loopback with ephemeral ports, killed on drop.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct WorkerProcess {
    pub child: Child,
    pub http: u16,
    pub grpc: u16,
    pub metrics: u16,
    log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl WorkerProcess {
    /// Starts the worker on `repo` and waits (bounded) until it reports ready.
    pub fn start(repo: &Path, extra: &[&str]) -> WorkerProcess {
        let dir = tempfile::tempdir().unwrap();
        let port_file = dir.path().join("ports.json");
        let log = dir.path().join("worker.log");
        let child = Command::new(env!("CARGO_BIN_EXE_nereid-worker"))
            .arg("--model-repository")
            .arg(repo)
            .args(["--address", "127.0.0.1", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"])
            .arg("--port-file")
            .arg(&port_file)
            .args(extra)
            .env("NEREID_ORT_LIB", nereid_worker::backend::default_runtime_path())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("spawn nereid-worker");
        let deadline = Instant::now() + Duration::from_secs(30);
        let ports: serde_json::Value = loop {
            if let Ok(text) = std::fs::read_to_string(&port_file) {
                break serde_json::from_str(&text).unwrap();
            }
            assert!(Instant::now() < deadline, "worker did not write its port file");
            std::thread::sleep(Duration::from_millis(10));
        };
        let port = |k: &str| ports[k].as_u64().unwrap() as u16;
        let mut worker =
            WorkerProcess { child, http: port("http"), grpc: port("grpc"), metrics: port("metrics"), log, _dir: dir };
        let deadline = Instant::now() + Duration::from_secs(30);
        while worker.http_get("/v2/health/ready").0 != 200 {
            if let Ok(Some(status)) = worker.child.try_wait() {
                panic!("worker exited with {status}: {}", worker.log());
            }
            assert!(Instant::now() < deadline, "worker never became ready: {}", worker.log());
            std::thread::sleep(Duration::from_millis(10));
        }
        worker
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A minimal blocking HTTP/1.1 GET/POST over a fresh connection: (status, body).
    pub fn http_request(&self, port: u16, method: &str, path: &str, body: &[u8]) -> (u16, String) {
        use std::io::{Read, Write};
        let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else { return (0, String::new()) };
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        // A server may answer (and close) before reading a body it refuses: the answer is read
        // even when the body could not be written whole.
        let _ = s.write_all(head.as_bytes()).and_then(|_| s.write_all(body));
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        let text = String::from_utf8_lossy(&out).to_string();
        let status = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
        (status, body)
    }

    pub fn http_get(&self, path: &str) -> (u16, String) {
        self.http_request(self.http, "GET", path, b"")
    }

    pub fn metrics_text(&self) -> String {
        self.http_request(self.metrics, "GET", "/metrics", b"").1
    }

    /// The value of one metric line (exact name + labels), if present.
    pub fn metric(&self, series: &str) -> Option<f64> {
        self.metrics_text()
            .lines()
            .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }
}

impl Drop for WorkerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
