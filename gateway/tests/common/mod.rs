//! Harness for the gateway's integration tests: real `nereid-worker` processes on the example
//! models (real ONNX Runtime) and a real `nereid-gateway` process, all on loopback with
//! ephemeral ports reported through `--port-file`. Every wait is on a condition, bounded.
//!
//! The worker binary is the workspace's `target/debug/nereid-worker` (next to this test's own
//! binary; `NEREID_WORKER_BIN` overrides): build it first with `cargo build -p nereid-worker`
//! (CI builds the whole workspace before testing).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nereid_proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
use nereid_proto::inference::model_infer_request::InferInputTensor;
use nereid_proto::inference::{ModelInferRequest, ModelStatisticsRequest};
use tonic::transport::Channel;

pub const START_TIMEOUT: Duration = Duration::from_secs(60);

pub fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

pub fn example_models() -> PathBuf {
    workspace().join("examples/models")
}

fn worker_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("NEREID_WORKER_BIN") {
        return p.into();
    }
    // target/<profile>/deps/<this test> → target/<profile>/nereid-worker
    let exe = std::env::current_exe().expect("current_exe");
    let beside = exe.parent().and_then(Path::parent).map(|d| d.join("nereid-worker"));
    match beside {
        Some(p) if p.is_file() => p,
        _ => workspace().join("target/debug/nereid-worker"),
    }
}

fn ort_lib() -> PathBuf {
    std::env::var_os("NEREID_ORT_LIB")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace().join(".deps/onnxruntime/libonnxruntime.so"))
}

/// A child process with ephemeral ports, killed (SIGKILL) on drop.
pub struct Proc {
    pub name: &'static str,
    pub child: Child,
    pub http: u16,
    pub grpc: u16,
    pub metrics: u16,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Proc {
    pub fn spawn(name: &'static str, bin: &Path, args: &[String], env: &[(&str, PathBuf)]) -> Proc {
        assert!(
            bin.is_file(),
            "{} is missing — build it first (`cargo build --workspace`, or `cargo build -p nereid-worker`)",
            bin.display()
        );
        let dir = tempfile::tempdir().unwrap();
        let port_file = dir.path().join("ports.json");
        let log = dir.path().join(format!("{name}.log"));
        // Log lines go to stdout, start-up failures to stderr: both land in one file, so a
        // failing test can show what the process said.
        let log_file = std::fs::File::create(&log).unwrap();
        let mut cmd = Command::new(bin);
        cmd.args(args)
            .args(["--address", "127.0.0.1", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"])
            .arg("--port-file")
            .arg(&port_file)
            .stdout(log_file.try_clone().unwrap())
            .stderr(log_file);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {}: {e}", bin.display()));
        let deadline = Instant::now() + START_TIMEOUT;
        let ports: serde_json::Value = loop {
            if let Ok(text) = std::fs::read_to_string(&port_file) {
                break serde_json::from_str(&text).unwrap();
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("{name} exited with {status}: {}", std::fs::read_to_string(&log).unwrap_or_default());
            }
            assert!(Instant::now() < deadline, "{name} did not write its port file");
            std::thread::sleep(Duration::from_millis(10));
        };
        let port = |k: &str| ports[k].as_u64().unwrap() as u16;
        Proc { name, child, http: port("http"), grpc: port("grpc"), metrics: port("metrics"), log, _dir: dir }
    }

    /// What the process wrote so far (plain text: its log is not a terminal).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn grpc_addr(&self) -> String {
        format!("127.0.0.1:{}", self.grpc)
    }

    pub fn http_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.http)
    }

    pub async fn client(&self) -> GrpcInferenceServiceClient<Channel> {
        GrpcInferenceServiceClient::connect(format!("http://127.0.0.1:{}", self.grpc)).await.unwrap()
    }

    /// A JSON inference of one zero row of 16 FP32 (`INPUT0`) to `model`, with
    /// `x-nereid-deadline-ms` when given.
    pub async fn json_infer(&self, model: &str, deadline_ms: Option<u64>) -> reqwest::Response {
        let mut request = reqwest::Client::new().post(self.http_url(&format!("/v2/models/{model}/infer")));
        if let Some(ms) = deadline_ms {
            request = request.header("x-nereid-deadline-ms", ms.to_string());
        }
        let body = serde_json::json!({"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": vec![0.0f32; 16]}]});
        request.json(&body).send().await.unwrap()
    }

    pub async fn metrics_text(&self) -> String {
        match reqwest::get(format!("http://127.0.0.1:{}/metrics", self.metrics)).await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }

    /// The value of one series (exact name + labels as rendered), if present.
    pub async fn metric(&self, series: &str) -> Option<f64> {
        self.metrics_text()
            .await
            .lines()
            .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }

    /// The sum of every series of metric `name` (whatever its labels); 0 when there is none.
    pub async fn metric_sum(&self, name: &str) -> f64 {
        self.metrics_text()
            .await
            .lines()
            .filter(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' ')))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Waits (bounded by `within`) until the process's log has `needle`; the log's tail in the
    /// failure otherwise.
    pub async fn wait_log(&self, what: &str, needle: &str, within: Duration) {
        let deadline = Instant::now() + within;
        while !self.log().contains(needle) {
            if Instant::now() >= deadline {
                let log = self.log();
                let tail: Vec<&str> = log.lines().rev().take(40).collect::<Vec<_>>().into_iter().rev().collect();
                panic!("timed out after {within:?} waiting for {what} ({needle:?}); log tail:\n{}", tail.join("\n"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) {
        self.signal("TERM");
    }

    /// Sends `signal` (a name `kill` takes: TERM, STOP, CONT, ...).
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill").args([&format!("-{signal}"), &self.child.id().to_string()]).status().unwrap();
        assert!(status.success());
    }

    /// Waits (bounded) for the process to exit; its exit code.
    pub fn wait_exit(&mut self, within: Duration) -> Option<i32> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            assert!(Instant::now() < deadline, "{} did not exit in {within:?}: {}", self.name, self.log());
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits (bounded) until `cond` holds.
pub async fn wait_until<F, Fut>(what: &str, within: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while !cond().await {
        assert!(Instant::now() < deadline, "timed out after {within:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn http_status(url: &str) -> u16 {
    reqwest::get(url).await.map(|r| r.status().as_u16()).unwrap_or(0)
}

/// A worker on `repo` (loading `models` explicitly, or everything when empty), ready.
pub async fn start_worker(repo: &Path, models: &[&str]) -> Proc {
    start_worker_with(repo, models, &[]).await
}

/// [`start_worker`] with `extra` flags.
pub async fn start_worker_with(repo: &Path, models: &[&str], extra: &[&str]) -> Proc {
    let mut args = vec!["--model-repository".to_string(), repo.display().to_string()];
    args.extend(extra.iter().map(|a| a.to_string()));
    if !models.is_empty() {
        args.extend(["--model-control-mode".into(), "explicit".into()]);
        for m in models {
            args.extend(["--load-model".into(), m.to_string()]);
        }
    }
    let worker = Proc::spawn("worker", &worker_bin(), &args, &[("NEREID_ORT_LIB", ort_lib())]);
    let url = worker.http_url("/v2/health/ready");
    wait_until("the worker to be ready", START_TIMEOUT, || async { http_status(&url).await == 200 }).await;
    worker
}

/// A gateway in front of `workers`, waited on until every worker is ready in its table.
pub async fn start_gateway(workers: &[&Proc], extra: &[&str]) -> Proc {
    let mut args: Vec<String> = Vec::new();
    for w in workers {
        args.extend(["--worker-grpc".into(), w.grpc_addr()]);
    }
    if !extra.contains(&"--discovery-interval-ms") {
        args.extend(["--discovery-interval-ms".into(), "100".into()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    let gateway = Proc::spawn("gateway", Path::new(env!("CARGO_BIN_EXE_nereid-gateway")), &args, &[]);
    let n = workers.len() as f64;
    wait_until("the gateway to route to every worker", START_TIMEOUT, || async {
        gateway.metric("nereid_gateway_workers{state=\"ready\"}").await == Some(n)
    })
    .await;
    assert_eq!(http_status(&gateway.http_url("/v2/health/ready")).await, 200);
    gateway
}

/// A temporary repository with `identity_fp32`'s ONNX file served as each `(name, config)`.
pub fn identity_repo(models: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let onnx = example_models().join("identity_fp32/1/model.onnx");
    assert!(onnx.is_file(), "{} is missing — run `bash scripts/setup.sh`", onnx.display());
    for (name, config) in models {
        let v = dir.path().join(name).join("1");
        std::fs::create_dir_all(&v).unwrap();
        std::fs::copy(&onnx, v.join("model.onnx")).unwrap();
        std::fs::write(dir.path().join(name).join("config.pbtxt"), config).unwrap();
    }
    dir
}

/// An FP32 request with one input `INPUT0` of `shape`, values `f(i)`.
pub fn fp32_request(model: &str, version: &str, shape: &[i64], f: impl Fn(usize) -> f32) -> ModelInferRequest {
    let n: i64 = shape.iter().product();
    let data: Vec<u8> = (0..n as usize).flat_map(|i| f(i).to_le_bytes()).collect();
    ModelInferRequest {
        model_name: model.into(),
        model_version: version.into(),
        inputs: vec![InferInputTensor {
            name: "INPUT0".into(),
            datatype: "FP32".into(),
            shape: shape.to_vec(),
            ..Default::default()
        }],
        raw_input_contents: vec![data.into()],
        ..Default::default()
    }
}

/// `inference_count` of `model` as the worker's own statistics report it.
pub async fn inference_count(worker: &Proc, model: &str) -> u64 {
    let stats = worker
        .client()
        .await
        .model_statistics(ModelStatisticsRequest { name: model.into(), version: String::new() })
        .await
        .unwrap()
        .into_inner();
    stats.model_stats.iter().map(|s| s.inference_count).sum()
}

/// A real etcd server (Debian's `etcd`, installed by scripts/setup.sh; `NEREID_ETCD_BIN`
/// overrides) on free loopback ports with its own data directory; SIGKILLed on drop.
pub struct Etcd {
    child: Option<Child>,
    pub client_port: u16,
    peer_port: u16,
    dir: tempfile::TempDir,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl Etcd {
    /// Ports are picked free but then released before etcd binds them, so another process may
    /// take one meanwhile: etcd then exits at once ("address already in use") and is started
    /// again on other ports.
    pub async fn start() -> Etcd {
        let dir = tempfile::tempdir().unwrap();
        let mut etcd = Etcd { child: None, client_port: 0, peer_port: 0, dir };
        for attempt in 1.. {
            (etcd.client_port, etcd.peer_port) = (free_port(), free_port());
            match etcd.try_launch(etcd.client_port).await {
                Ok(()) => break,
                Err(e) if e.contains("address already in use") && attempt < 5 => {
                    eprintln!("etcd could not bind its ports (attempt {attempt}), trying others: {e}");
                    let _ = std::fs::remove_dir_all(etcd.dir.path().join("data"));
                }
                Err(e) => panic!("etcd did not start: {e}"),
            }
        }
        etcd
    }

    async fn launch(&mut self, client_port: u16) {
        if let Err(e) = self.try_launch(client_port).await {
            panic!("etcd did not start: {e}");
        }
    }

    /// Starts etcd and waits until it is healthy; `Err(log)` when it exits first.
    async fn try_launch(&mut self, client_port: u16) -> Result<(), String> {
        let bin = std::env::var_os("NEREID_ETCD_BIN").map(PathBuf::from).unwrap_or_else(|| "etcd".into());
        let client = format!("http://127.0.0.1:{client_port}");
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let log_path = self.dir.path().join("etcd.log");
        let log_start = std::fs::metadata(&log_path).map_or(0, |m| m.len() as usize);
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&log_path).unwrap();
        let child = Command::new(&bin)
            .args(["--name", "test", "--data-dir"])
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("test={peer}")])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start etcd ({}): {e} — run `bash scripts/setup.sh`", bin.display()));
        self.child = Some(child);
        let url = format!("{client}/health");
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(r) = reqwest::get(&url).await
                && r.text().await.unwrap_or_default().contains("\"health\":\"true\"")
            {
                return Ok(());
            }
            if let Some(Ok(Some(status))) = self.child.as_mut().map(Child::try_wait) {
                self.child = None;
                let log = std::fs::read(&log_path).unwrap_or_default();
                let tail = String::from_utf8_lossy(&log[log_start.min(log.len())..]).into_owned();
                return Err(format!("etcd exited with {status}: {tail}"));
            }
            assert!(Instant::now() < deadline, "timed out after {START_TIMEOUT:?} waiting for etcd to be healthy");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    pub async fn client(&self) -> nereid_common::fleet::etcd_client::Client {
        nereid_common::fleet::connect(&[self.endpoint()]).await.unwrap()
    }

    /// Kills the server (SIGKILL); its data stays for [`Etcd::restart`].
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same ports and data.
    pub async fn restart(&mut self) {
        self.stop();
        self.launch(self.client_port).await;
    }

    /// Starts it again on the same data but on another client port, which no worker or gateway
    /// was given: only the test reaches it, through the returned client, while everything else
    /// sees etcd down. [`Etcd::restart`] brings it back on the usual port.
    pub async fn restart_isolated(&mut self) -> nereid_common::fleet::etcd_client::Client {
        self.stop();
        let port = free_port();
        self.launch(port).await;
        nereid_common::fleet::connect(&[format!("http://127.0.0.1:{port}")]).await.unwrap()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A worker in the fleet: explicit mode, registered in `etcd` as `id`, models from placement
/// (`extra` may set its own `--drain-delay-ms` and `--etcd-lease-ttl-secs`; 300 ms and 2 s
/// otherwise), out of the example repository (and any `--model-repository` in `extra`).
pub fn spawn_fleet_worker(etcd: &Etcd, id: &str, extra: &[&str]) -> Proc {
    spawn_fleet_worker_on(etcd, id, &example_models(), extra)
}

/// [`spawn_fleet_worker`] on `repository` instead of the example repository.
pub fn spawn_fleet_worker_on(etcd: &Etcd, id: &str, repository: &std::path::Path, extra: &[&str]) -> Proc {
    let mut args: Vec<String> = vec![
        "--model-repository".into(),
        repository.display().to_string(),
        "--model-control-mode".into(),
        "explicit".into(),
        "--etcd-endpoints".into(),
        etcd.endpoint(),
        "--worker-id".into(),
        id.into(),
    ];
    if !extra.contains(&"--etcd-lease-ttl-secs") {
        args.extend(["--etcd-lease-ttl-secs".into(), "2".into()]);
    }
    if !extra.contains(&"--drain-delay-ms") {
        args.extend(["--drain-delay-ms".into(), "300".into()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    Proc::spawn("worker", &worker_bin(), &args, &[("NEREID_ORT_LIB", ort_lib())])
}

/// A gateway following `etcd` (and running for placement leader).
pub fn spawn_fleet_gateway(etcd: &Etcd, id: &str, extra: &[&str]) -> Proc {
    let mut args: Vec<String> = vec![
        "--etcd-endpoints".into(),
        etcd.endpoint(),
        "--gateway-id".into(),
        id.into(),
        "--election-ttl-secs".into(),
        "2".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    Proc::spawn("gateway", Path::new(env!("CARGO_BIN_EXE_nereid-gateway")), &args, &[])
}

/// The key prefix of the fleet's etcd schema.
pub const PREFIX: &str = "/nereid/v1";

/// Writes `{PREFIX}/{key}`.
pub async fn put(client: &mut nereid_common::fleet::etcd_client::Client, key: &str, value: &str) {
    client.put(format!("{PREFIX}/{key}"), value, None).await.unwrap();
}

/// Keys (without [`PREFIX`]) under `{PREFIX}/{prefix}`; none while etcd is unreachable.
pub async fn keys_under(client: &mut nereid_common::fleet::etcd_client::Client, prefix: &str) -> Vec<String> {
    let options = nereid_common::fleet::etcd_client::GetOptions::new().with_prefix().with_keys_only();
    match client.get(format!("{PREFIX}/{prefix}"), Some(options)).await {
        Ok(r) => r.kvs().iter().map(|kv| kv.key_str().unwrap().trim_start_matches(PREFIX).to_string()).collect(),
        Err(_) => Vec::new(),
    }
}

/// `(kind, worker, model, version)` of a `placement/…` or `status/…` key.
pub fn parse_key(key: &str) -> Option<(String, String, String, i64)> {
    let parts: Vec<&str> = key.strip_prefix(PREFIX)?.trim_start_matches('/').split('/').collect();
    match parts[..] {
        [kind @ ("placement" | "status"), w, m, v] => Some((kind.into(), w.into(), m.into(), v.parse().ok()?)),
        _ => None,
    }
}

/// Whether a status value says READY.
pub fn is_ready(value: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(value).is_ok_and(|v| v["state"] == "READY")
}

/// Workers holding `model`/`version` READY per their status keys, sorted; none while etcd is
/// unreachable.
pub async fn ready_on(
    client: &mut nereid_common::fleet::etcd_client::Client,
    model: &str,
    version: i64,
) -> Vec<String> {
    let options = nereid_common::fleet::etcd_client::GetOptions::new().with_prefix();
    let Ok(resp) = client.get(format!("{PREFIX}/status/"), Some(options)).await else {
        return Vec::new();
    };
    let mut out: Vec<String> = resp
        .kvs()
        .iter()
        .filter_map(|kv| Some((parse_key(kv.key_str().ok()?)?, kv.value())))
        .filter(|((_, _, m, v), value)| m == model && *v == version && is_ready(value))
        .map(|((_, w, _, _), _)| w)
        .collect();
    out.sort();
    out
}
