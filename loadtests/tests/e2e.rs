//! End to end: the `nereid-perf` binary against a real `nereid-worker` serving the example
//! models on real ONNX Runtime, over gRPC and HTTP (JSON and binary tensors), closed and open
//! loop, the HTML report and `--binary-search`, input data files (checked value by value against
//! what the server answers), TLS and mutual TLS through a TLS-terminating proxy in front of the
//! worker, plus the failure exits (unreachable server,
//! bad workload file, server lost mid-run, SLO nothing meets). Runs are short and bounded;
//! nothing asserts on speed.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use clap::Parser;
use nereid_loadtests::cli::Args;
use nereid_loadtests::client::Client;
use nereid_loadtests::driver::prepare;
use nereid_proto::inference::ModelInferResponse;
use prost::Message;
use serde_json::{Value, json};

const PERF: &str = env!("CARGO_BIN_EXE_nereid-perf");
/// Longest any single nereid-perf run may take before the test kills it.
const RUN_LIMIT: Duration = Duration::from_secs(120);
const WORKER_START_LIMIT: Duration = Duration::from_secs(90);

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("loadtests/ is inside the workspace").to_path_buf()
}

/// The worker binary next to nereid-perf (same target dir), else `<workspace>/target/debug`.
fn worker_binary() -> Option<PathBuf> {
    let sibling = Path::new(PERF).with_file_name("nereid-worker");
    let fallback = workspace().join("target/debug/nereid-worker");
    [sibling, fallback].into_iter().find(|p| p.exists())
}

/// A worker process on 127.0.0.1 with OS-assigned ports, killed on drop.
struct Worker {
    child: Child,
    _dir: tempfile::TempDir,
    http: u16,
    grpc: u16,
    metrics: u16,
}

impl Worker {
    /// `None` (after saying why) when the worker binary has not been built.
    fn start() -> Option<Worker> {
        Self::start_with(&[])
    }

    /// [`Worker::start`] with extra worker flags.
    fn start_with(extra: &[&str]) -> Option<Worker> {
        let Some(bin) = worker_binary() else {
            common::worker_not_built(&format!(
                "nereid-worker is not built (looked next to {PERF} and in target/debug); \
                 run `cargo build --workspace --all-targets` first"
            ));
            return None;
        };
        let dir = tempfile::tempdir().expect("temp dir");
        let ports_file = dir.path().join("ports.json");
        let ws = workspace();
        let child = Command::new(bin)
            .arg("--model-repository")
            .arg(ws.join("examples/models"))
            .args(["--address", "127.0.0.1", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"])
            .arg("--port-file")
            .arg(&ports_file)
            .args(extra)
            .env("NEREID_ORT_LIB", ws.join(".deps/onnxruntime/libonnxruntime.so"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nereid-worker");
        let mut worker = Worker { child, _dir: dir, http: 0, grpc: 0, metrics: 0 };
        let deadline = Instant::now() + WORKER_START_LIMIT;
        let ports: Value = loop {
            if let Ok(text) = std::fs::read_to_string(&ports_file)
                && let Ok(v) = serde_json::from_str(&text)
            {
                break v;
            }
            if let Ok(Some(status)) = worker.child.try_wait() {
                panic!("nereid-worker exited before writing its ports: {status}");
            }
            assert!(Instant::now() < deadline, "nereid-worker wrote no port file within {WORKER_START_LIMIT:?}");
            std::thread::sleep(Duration::from_millis(50));
        };
        let port = |k: &str| ports[k].as_u64().unwrap_or_else(|| panic!("port file lacks {k}: {ports}")) as u16;
        (worker.http, worker.grpc, worker.metrics) = (port("http"), port("grpc"), port("metrics"));
        while http_status(worker.http, "/v2/health/ready") != Some(200) {
            assert!(Instant::now() < deadline, "nereid-worker not ready within {WORKER_START_LIMIT:?}");
            std::thread::sleep(Duration::from_millis(100));
        }
        Some(worker)
    }

    fn grpc_url(&self) -> String {
        format!("127.0.0.1:{}", self.grpc)
    }

    fn http_url(&self) -> String {
        format!("127.0.0.1:{}", self.http)
    }

    fn metrics_url(&self) -> String {
        format!("127.0.0.1:{}", self.metrics)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The status of `GET path` on 127.0.0.1:port, or `None` if nothing answered.
fn http_status(port: u16, path: &str) -> Option<u16> {
    let mut s = TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(1)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").ok()?;
    let mut line = String::new();
    BufReader::new(s).read_line(&mut line).ok()?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// The body of `GET path` on 127.0.0.1:port (HTTP/1.1, `Connection: close`).
fn http_get(port: u16, path: &str) -> String {
    let mut s = TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(1)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text.split_once("\r\n\r\n").map(|(_, body)| body.to_string()).unwrap_or_default()
}

struct Run {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

impl Run {
    fn code(&self) -> i32 {
        self.status.code().unwrap_or(-1)
    }
}

/// Runs nereid-perf with `args` (quiet), killing it after [`RUN_LIMIT`].
fn perf(args: &[&str]) -> Run {
    let mut cmd = Command::new(PERF);
    cmd.args(args).arg("-q").env_remove("NEREID_API_KEY");
    let o = common::run_bounded(cmd, &format!("nereid-perf {args:?}"), RUN_LIMIT, || {});
    Run { status: o.status, stdout: o.stdout, stderr: o.stderr }
}

/// Exit 0, or 5 only because the open-loop generator fell behind on a busy machine.
fn assert_measured(run: &Run, open_loop: bool) {
    let late_only = open_loop
        && run.code() == 5
        && run.stdout.lines().filter(|l| l.starts_with("PROBLEM:")).all(|l| l.contains("could not keep the schedule"));
    assert!(run.code() == 0 || late_only, "exit {}\nstdout:\n{}\nstderr:\n{}", run.code(), run.stdout, run.stderr);
}

/// Short bounded windows: 2 × 300 ms after 200 ms of warm-up, a wide stability band.
const SHORT: [&str; 8] = ["-p", "300", "-r", "2", "-s", "1000", "--warmup-ms", "200"];

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("JSON report written")).expect("JSON report parses")
}

/// Checks one level of a JSON report: successes, throughput, ordered percentiles, goodput
/// within throughput, and the server-side breakdown of `model`.
fn check_level(level: &Value, model: &str) {
    let total = &level["total"];
    assert!(total["ok"].as_u64().unwrap() > 0, "no success: {level}");
    assert_eq!(total["errors"].as_u64(), Some(0), "errors: {level}");
    let infer = total["infer_per_sec"].as_f64().unwrap();
    assert!(infer > 0.0);
    assert!(total["goodput_infer_per_sec"].as_f64().unwrap() <= infer + 1e-9);
    assert!(total["goodput_requests_per_sec"].as_f64().unwrap() <= total["requests_per_sec"].as_f64().unwrap() + 1e-9);
    let l = &total["latency"];
    let p: Vec<u64> = ["min_us", "p50_us", "p90_us", "p95_us", "p99_us", "p999_us", "max_us"]
        .iter()
        .map(|k| l[*k].as_u64().unwrap())
        .collect();
    assert!(p.windows(2).all(|w| w[0] <= w[1]), "percentiles out of order: {l}");
    assert!(p[1] > 0);
    let server = &level["server"][model];
    assert!(server["requests"].as_u64().unwrap_or(0) > 0, "no server-side breakdown for {model}: {level}");
    for k in ["avg_queue_us", "avg_compute_input_us", "avg_compute_infer_us", "avg_compute_output_us"] {
        assert!(server[k].as_f64().is_some(), "{k} missing: {server}");
    }
    assert!(server["avg_batch_size"].as_f64().unwrap() >= 1.0);
}

fn csv_rows(path: &Path) -> (Vec<String>, Vec<Vec<String>>) {
    let text = std::fs::read_to_string(path).expect("CSV written");
    let mut lines = text.lines();
    let header = lines.next().expect("CSV header").split(',').map(String::from).collect();
    let rows = lines.map(|l| l.split(',').map(String::from).collect()).collect();
    (header, rows)
}

#[test]
fn grpc_closed_loop_sweep_writes_csv_and_json() {
    let Some(w) = Worker::start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (csv, json) = (dir.path().join("out.csv"), dir.path().join("out.json"));
    for model in ["identity_fp32", "mlp_fp32"] {
        let (u, m) = (w.grpc_url(), w.metrics_url());
        let mut args = vec!["-m", model, "-u", &u, "--metrics-url", &m, "--concurrency-range", "1:3:2", "-b", "2"];
        args.extend(SHORT);
        args.extend(["--slo-p99-ms", "10000", "--api-key", "tenant-key"]);
        args.extend(["-f", csv.to_str().unwrap(), "--json", json.to_str().unwrap()]);
        let run = perf(&args);
        assert_measured(&run, false);
        assert!(
            run.stdout.contains("concurrency 3") && run.stdout.contains("highest load meeting the SLO"),
            "{}",
            run.stdout
        );

        let report = read_json(&json);
        let levels = report["levels"].as_array().unwrap();
        assert_eq!(levels.len(), 2);
        for level in levels {
            check_level(level, model);
        }
        assert_eq!(report["models"][0]["max_batch_size"].as_u64(), Some(64));

        let (header, rows) = csv_rows(&csv);
        let expected = "Concurrency,Inferences/Second,Client Send,Network+Server Send/Recv,Server Queue,Server Compute Input,\
            Server Compute Infer,Server Compute Output,Client Recv,p50 latency,p90 latency,p95 latency,p99 latency,\
            Avg latency,request/response,response wait";
        assert_eq!(header[..16].join(","), expected);
        for extra in ["p99.9 latency", "Goodput Inferences/Second", "Errors", "Late Sends", "Stable", "SLO Met"] {
            assert!(header.iter().any(|h| h == extra), "CSV lacks {extra}: {header:?}");
        }
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0][0], "1");
        assert_eq!(rows[1][0], "3");
        let col = |name: &str| header.iter().position(|h| h == name).unwrap();
        for row in &rows {
            assert!(row[col("Inferences/Second")].parse::<f64>().unwrap() > 0.0);
            assert!(!row[col("Server Compute Infer")].is_empty(), "server breakdown missing in CSV: {row:?}");
            let p50: u64 = row[col("p50 latency")].parse().unwrap();
            let p99: u64 = row[col("p99 latency")].parse().unwrap();
            assert!(p50 <= p99);
            assert_eq!(row[col("SLO Met")], "true");
        }
    }
}

#[test]
fn http_json_and_binary_closed_and_open_loop() {
    let Some(w) = Worker::start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let (u, m, j) = (w.http_url(), w.metrics_url(), json.to_str().unwrap().to_string());
    let cases: [(&str, &[&str], bool); 4] = [
        ("mlp_fp32", &["--concurrency-range", "2"], false),
        ("identity_fp32", &["--http-binary", "--concurrency-range", "2"], false),
        ("mlp_fp32", &["--http-binary", "--request-rate-range", "100", "--request-distribution", "poisson"], true),
        ("identity_fp32", &["--request-rate-range", "100"], true),
    ];
    for (model, extra, open_loop) in cases {
        let mut args =
            vec!["-m", model, "-i", "http", "-u", &u, "--metrics-url", &m, "--json", &j, "--input-data", "zero"];
        args.extend(extra);
        args.extend(SHORT);
        let run = perf(&args);
        assert_measured(&run, open_loop);
        let report = read_json(&json);
        let level = &report["levels"][0];
        check_level(level, model);
        if open_loop {
            assert!(level["level"]["request_rate"]["rate"].as_f64().is_some(), "{level}");
            assert!(level["total"]["sends"].as_u64().unwrap() > 0);
        }
    }
}

#[test]
fn grpc_open_loop_and_a_mixed_workload_file() {
    let Some(w) = Worker::start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let (u, m, j) = (w.grpc_url(), w.metrics_url(), json.to_str().unwrap().to_string());

    // Open loop at a constant rate.
    let mut args =
        vec!["-m", "identity_fp32", "-u", &u, "--metrics-url", &m, "--json", &j, "--request-rate-range", "50:150:100"];
    args.extend(SHORT);
    let run = perf(&args);
    assert_measured(&run, true);
    let report = read_json(&json);
    assert_eq!(report["levels"].as_array().unwrap().len(), 2);
    for level in report["levels"].as_array().unwrap() {
        check_level(level, "identity_fp32");
    }

    // A trace of arrival offsets.
    let trace = dir.path().join("trace.txt");
    let offsets: String = (0..60).map(|i| format!("{}\n", i * 10)).collect();
    std::fs::write(&trace, format!("# 100 req/s for 0.6 s\n{offsets}")).unwrap();
    let args = ["-m", "mlp_fp32", "-u", &u, "--metrics-url", &m, "--json", &j, "--trace-file", trace.to_str().unwrap()];
    // No --warmup-ms: a trace is measured whole by default.
    let run = perf(&args);
    assert_measured(&run, true);
    let report = read_json(&json);
    let level = &report["levels"][0];
    assert_eq!(level["level"]["trace"]["arrivals"].as_u64(), Some(60));
    assert_eq!(level["total"]["ok"].as_u64(), Some(60), "every trace arrival answered: {level}");

    // Two models, two classes with their own SLOs, tenant keys, priority and timeout; the
    // second entry mixes two batch sizes; class "small" mixes two models and two tenants, so
    // only the per-model and per-tenant breakdowns can tell them apart.
    let workload = dir.path().join("workload.json");
    std::fs::write(
        &workload,
        r#"{"entries": [
            {"model": "identity_fp32", "weight": 3, "batch_size": 4, "class": "small", "slo_ms": 10000,
             "tenant": "acme", "api_key": "k-acme", "priority": 1, "timeout_us": 5000000},
            {"model": "mlp_fp32", "version": 1, "weight": 1, "class": "large", "slo_ms": 10000, "data": "zero",
             "mix": [{"batch_size": 1}, {"batch_size": 8}]},
            {"model": "mlp_fp32", "weight": 1, "class": "small", "slo_ms": 10000, "tenant": "globex",
             "api_key": "k-globex"}
        ]}"#,
    )
    .unwrap();
    let mut args = vec![
        "--workload",
        workload.to_str().unwrap(),
        "-u",
        &u,
        "--metrics-url",
        &m,
        "--json",
        &j,
        "--concurrency-range",
        "4",
    ];
    args.extend(SHORT);
    let run = perf(&args);
    assert_measured(&run, false);
    assert!(run.stdout.contains("  small") && run.stdout.contains("  large"), "per-class rows: {}", run.stdout);
    let report = read_json(&json);
    let level = &report["levels"][0];
    let series = level["series"].as_array().unwrap();
    assert_eq!(series.len(), 2);
    for s in series {
        assert!(s["summary"]["ok"].as_u64().unwrap() > 0, "{s}");
        assert_eq!(s["slo_met"].as_bool(), Some(true));
    }
    let large = series.iter().find(|s| s["name"] == "large").expect("the mixed entry's series");
    let rows_per_request =
        large["summary"]["infer_per_sec"].as_f64().unwrap() / large["summary"]["requests_per_sec"].as_f64().unwrap();
    assert!(
        (1.5..7.5).contains(&rows_per_request),
        "batches of 1 and 8 in equal parts average about 4.5 rows a request, got {rows_per_request}: {large}"
    );
    assert!(level["server"]["identity_fp32"]["requests"].as_u64().unwrap() > 0);
    assert!(level["server"]["mlp_fp32:1"]["requests"].as_u64().unwrap() > 0);

    // Goodput per model and per tenant, whatever the class: each grouping covers every request.
    let ok = |rs: &Value| -> Vec<(String, u64)> {
        rs.as_array()
            .unwrap()
            .iter()
            .map(|r| (r["name"].as_str().unwrap().to_string(), r["summary"]["ok"].as_u64().unwrap()))
            .collect()
    };
    let total_ok = level["total"]["ok"].as_u64().unwrap();
    let (models, tenants) = (ok(&level["by_model"]), ok(&level["by_tenant"]));
    let names = |v: &[(String, u64)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&models), ["identity_fp32", "mlp_fp32:1", "mlp_fp32"], "{level}");
    assert_eq!(names(&tenants), ["acme", "(no tenant)", "globex"], "{level}");
    for grouping in [&models, &tenants] {
        assert!(grouping.iter().all(|(_, n)| *n > 0), "every group was measured: {grouping:?}");
        assert_eq!(grouping.iter().map(|(_, n)| n).sum::<u64>(), total_ok, "{grouping:?}");
    }
    for r in level["by_model"].as_array().unwrap().iter().chain(level["by_tenant"].as_array().unwrap()) {
        assert_eq!(r["slo_met"].as_bool(), Some(true), "{r}");
        assert!(r["summary"]["goodput_infer_per_sec"].as_f64().unwrap() > 0.0, "{r}");
    }
    assert!(
        run.stdout.contains("  model identity_fp32") && run.stdout.contains("  tenant globex"),
        "per-model and per-tenant rows: {}",
        run.stdout
    );
}

#[test]
fn open_loop_latency_counts_from_the_schedule_when_the_server_falls_behind() {
    let Some(w) = Worker::start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("late.json");
    let (u, m, j) = (w.grpc_url(), w.metrics_url(), json.to_str().unwrap().to_string());
    // One request in flight at a time cannot keep 20 000 req/s (that needs a 50 µs round trip):
    // sends fall ever further behind their schedule. Measured from the scheduled time, latency
    // grows with the backlog; measured from the send (coordinated omission) it would stay near
    // the server's own time.
    let args = [
        "-m",
        "convnet_fp32",
        "-u",
        &u,
        "--metrics-url",
        &m,
        "--json",
        &j,
        "--request-rate-range",
        "20000",
        "--max-inflight",
        "1",
        "-p",
        "400",
        "-r",
        "1",
        "--warmup-ms",
        "0",
    ];
    let run = perf(&args);
    assert_eq!(run.code(), 5, "the run says it could not keep the schedule: {}\n{}", run.stdout, run.stderr);
    assert!(run.stdout.contains("could not keep the schedule"), "{}", run.stdout);
    let report = read_json(&json);
    let level = &report["levels"][0];
    let total = &level["total"];
    let (sends, late) = (total["sends"].as_u64().unwrap(), total["late_sends"].as_u64().unwrap());
    assert!(sends > 10 && late * 2 > sends, "most sends late: {sends} sent, {late} late: {level}");
    let p50_us = total["latency"]["p50_us"].as_u64().unwrap();
    let server = &level["server"]["convnet_fp32"];
    let server_us: f64 = ["avg_queue_us", "avg_compute_input_us", "avg_compute_infer_us", "avg_compute_output_us"]
        .iter()
        .map(|k| server[*k].as_f64().unwrap())
        .sum();
    assert!(
        p50_us > 50_000 && p50_us as f64 > 10.0 * server_us,
        "p50 {p50_us} µs should include the wait behind the schedule (server time {server_us:.0} µs): {level}"
    );
}

#[test]
fn count_windows_close_after_the_requested_responses() {
    let Some(w) = Worker::start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("count.json");
    let (u, j) = (w.grpc_url(), json.to_str().unwrap().to_string());
    // A 60 s time window alongside: if the count were ignored the run would outlast RUN_LIMIT.
    let args = [
        "-m",
        "identity_fp32",
        "-u",
        &u,
        "--no-server-stats",
        "--json",
        &j,
        "--concurrency-range",
        "2",
        "-p",
        "60000",
        "--measurement-request-count",
        "150",
        "-r",
        "3",
        "-s",
        "1000",
        "--warmup-ms",
        "50",
    ];
    let run = perf(&args);
    assert_measured(&run, false);
    let report = read_json(&json);
    let level = &report["levels"][0];
    let windows = level["windows"].as_array().unwrap();
    assert_eq!(windows.len(), 3, "{level}");
    for w in windows {
        let requests = w["requests"].as_u64().unwrap();
        assert!(requests >= 150, "a count window closes only after 150 responses: {w}");
    }
}

/// `127.0.0.1:<port>` where nothing listens: a port bound, then freed.
fn closed_port() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    format!("127.0.0.1:{port}")
}

#[test]
fn bad_input_exits_2_with_a_clear_message() {
    let closed = closed_port();
    let run = perf(&["-m", "identity_fp32", "-u", &closed, "-p", "100"]);
    assert_eq!(run.code(), 2, "{}", run.stderr);
    assert!(run.stderr.contains(&format!("cannot reach {closed}")), "{}", run.stderr);
    let run = perf(&["-m", "identity_fp32", "-i", "http", "-u", &closed, "-p", "100"]);
    assert_eq!(run.code(), 2);
    assert!(run.stderr.contains(&format!("cannot reach {closed}")), "{}", run.stderr);

    let dir = tempfile::tempdir().unwrap();
    let workload = dir.path().join("bogus.json");
    std::fs::write(&workload, "{\"entries\": [\n  {\"model\": \"identity_fp32\", \"batchsize\": 4}\n]}").unwrap();
    let run = perf(&["--workload", workload.to_str().unwrap(), "-u", &closed]);
    assert_eq!(run.code(), 2);
    assert!(run.stderr.contains("unknown field `batchsize`") && run.stderr.contains("line 2"), "{}", run.stderr);
    std::fs::write(&workload, r#"{"entries": [{"model": "identity_fp32", "batch_size": 0}]}"#).unwrap();
    let run = perf(&["--workload", workload.to_str().unwrap(), "-u", &closed]);
    assert_eq!(run.code(), 2);
    assert!(run.stderr.contains("entries[0].batch_size"), "{}", run.stderr);

    let run = perf(&["-m", "identity_fp32", "-u", &closed, "--concurrency-range", "0"]);
    assert_eq!(run.code(), 2);
    assert!(run.stderr.contains("--concurrency-range"), "{}", run.stderr);

    let help = perf(&["--help"]);
    assert_eq!(help.code(), 0);
    assert!(help.stdout.contains("Exit codes:") && help.stdout.contains("no load level met the SLO"));
}

#[test]
fn unknown_model_and_unmeetable_slo() {
    let Some(w) = Worker::start() else { return };
    let u = w.grpc_url();
    let run = perf(&["-m", "no_such_model", "-u", &u]);
    assert_eq!(run.code(), 2);
    assert!(run.stderr.contains("no_such_model"), "{}", run.stderr);
    let run = perf(&["-m", "mlp_fp32", "-u", &u, "-b", "65"]);
    assert_eq!(run.code(), 2);
    assert!(run.stderr.contains("max_batch_size 64"), "{}", run.stderr);

    // 1 µs: nothing meets it. One window per level (-r 1) so the verdict is about the SLO alone.
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("out.csv");
    let m = w.metrics_url();
    let args = [
        "-m",
        "identity_fp32",
        "-u",
        &u,
        "--metrics-url",
        &m,
        "--concurrency-range",
        "1:2",
        "-p",
        "300",
        "-r",
        "1",
        "--warmup-ms",
        "100",
        "--slo-p99-ms",
        "0.001",
        "-f",
        csv.to_str().unwrap(),
    ];
    let run = perf(&args);
    assert_eq!(run.code(), 4, "stdout:\n{}\nstderr:\n{}", run.stdout, run.stderr);
    assert!(run.stdout.contains("no load level met the SLO"), "{}", run.stdout);
    assert!(
        run.stdout.contains("concurrency 1") && !run.stdout.contains("concurrency 2"),
        "the sweep stops at the first miss"
    );
    let (header, rows) = csv_rows(&csv);
    let col = |name: &str| header.iter().position(|h| h == name).unwrap();
    assert_eq!(rows[0][col("SLO Met")], "false");
    assert_eq!(rows[0][col("Goodput Inferences/Second")], "0");
}

#[test]
fn server_dying_mid_run_keeps_partial_results_and_exits_3() {
    let Some(mut w) = Worker::start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("out.json");
    let (u, m) = (w.grpc_url(), w.metrics_url());
    // Long enough that the worker is killed mid-run: 3 levels × up to 10 windows of 300 ms.
    let mut child = Command::new(PERF)
        .args([
            "-m",
            "identity_fp32",
            "-u",
            &u,
            "--metrics-url",
            &m,
            "--concurrency-range",
            "1:3",
            "-p",
            "300",
            "-r",
            "10",
        ])
        .args(["-s", "0.0001", "--warmup-ms", "100", "--json", json.to_str().unwrap()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start nereid-perf");
    // Kill the worker once the first window has been measured (progress goes to stderr).
    let stderr = child.stderr.take().expect("piped");
    let mut lines = BufReader::new(stderr).lines();
    let mut seen = String::new();
    for line in lines.by_ref() {
        let line = line.unwrap_or_default();
        seen.push_str(&line);
        seen.push('\n');
        if line.contains("window 2/") {
            break;
        }
    }
    assert!(seen.contains("window 2/"), "nereid-perf never measured a window: {seen}");
    let _ = w.child.kill();
    let _ = w.child.wait();
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let deadline = Instant::now() + RUN_LIMIT;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "nereid-perf did not stop after the server died");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut stdout = String::new();
    child.stdout.take().unwrap().read_to_string(&mut stdout).unwrap();
    assert_eq!(status.code(), Some(3), "stdout:\n{stdout}\nstderr:\n{seen}{}", rest.join("\n"));
    assert!(stdout.contains("the server stopped answering"), "{stdout}");
    let report = read_json(&json);
    assert_eq!(report["verdict"]["exit_code"].as_i64(), Some(3));
    let levels = report["levels"].as_array().unwrap();
    assert!(levels[0]["windows"].as_array().unwrap().len() >= 2, "windows measured before the death are kept");
    assert_eq!(levels.last().unwrap()["complete"].as_bool(), Some(false));
}

/// The parts of a report page that must be there, and nothing that loads from elsewhere.
fn check_html(path: &Path) -> String {
    let doc = std::fs::read_to_string(path).expect("HTML report written");
    assert!(doc.starts_with("<!DOCTYPE html>") && doc.trim_end().ends_with("</html>"), "not a whole page");
    for id in ["verdict", "latency", "goodput", "server", "levels", "parameters"] {
        assert!(doc.contains(&format!("<section id=\"{id}\">")), "section {id} missing");
    }
    for needle in ["<script", "<link", "src=", "href=", "url(", "@import"] {
        assert!(!doc.contains(needle), "the page refers out: {needle}");
    }
    doc
}

#[test]
fn html_report_of_a_sweep() {
    let Some(w) = Worker::start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let html = dir.path().join("report.html");
    let (u, m) = (w.grpc_url(), w.metrics_url());
    let mut args = vec!["-m", "mlp_fp32", "-u", &u, "--metrics-url", &m, "--concurrency-range", "1:3:2", "-b", "2"];
    args.extend(SHORT);
    args.extend(["--slo-p99-ms", "10000", "--html", html.to_str().unwrap()]);
    let run = perf(&args);
    assert_measured(&run, false);
    let doc = check_html(&html);
    // Latency, goodput and (with /metrics) the server breakdown: one plot each.
    assert_eq!(doc.matches("<svg").count(), 3, "three plots");
    assert!(doc.contains("concurrency 1") && doc.contains("concurrency 3"));
    assert!(doc.contains("Highest load meeting the SLO: concurrency 3"));
    assert!(doc.contains("p99 ≤ 10000 ms"), "the SLO is in the parameters");
    assert!(doc.contains("compute infer"), "the server breakdown is plotted");

    // Without /metrics the page still renders, and says why the breakdown is missing.
    let mut args = vec!["-m", "identity_fp32", "-u", &u, "--no-server-stats", "--concurrency-range", "2"];
    args.extend(SHORT);
    args.extend(["--html-report", html.to_str().unwrap()]);
    let run = perf(&args);
    assert_measured(&run, false);
    let doc = check_html(&html);
    assert_eq!(doc.matches("<svg").count(), 2);
    assert!(doc.contains("No server-side breakdown"));
}

#[test]
fn binary_search_closed_and_open_loop() {
    let Some(w) = Worker::start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let (json, html) = (dir.path().join("out.json"), dir.path().join("out.html"));
    let (u, m, j, h) = (w.grpc_url(), w.metrics_url(), json.to_str().unwrap(), html.to_str().unwrap());

    // A generous SLO: the lower and then the upper bound meet it, and the upper bound is the answer.
    let mut args = vec!["-m", "identity_fp32", "-u", &u, "--metrics-url", &m, "--binary-search"];
    args.extend(["--concurrency-range", "1:4", "--slo-p99-ms", "10000", "--json", j, "--html", h]);
    args.extend(SHORT);
    let run = perf(&args);
    assert_measured(&run, false);
    assert!(
        run.stdout.contains("binary search: highest load meeting the SLO: concurrency 4 — the upper bound"),
        "{}",
        run.stdout
    );
    let report = read_json(&json);
    let search = &report["binary_search"];
    assert_eq!(search["outcome"].as_str(), Some("found"), "{search}");
    assert_eq!(search["highest_meeting_slo"]["concurrency"].as_u64(), Some(4));
    assert!(search["lowest_missing_slo"].is_null());
    let probes: Vec<u64> =
        search["probes"].as_array().unwrap().iter().map(|p| p["level"]["concurrency"].as_u64().unwrap()).collect();
    assert_eq!(probes, vec![1, 4], "the bounds, in order");
    assert_eq!(report["levels"].as_array().unwrap().len(), 2, "every probe is a measured level");
    for level in report["levels"].as_array().unwrap() {
        check_level(level, "identity_fp32");
    }
    let doc = check_html(&html);
    assert!(doc.contains("<section id=\"search\">") && doc.contains("Binary search: highest load meeting the SLO"));

    // An SLO nothing meets: the lower bound misses, the search stops there, exit 4.
    let mut args = vec!["-m", "identity_fp32", "-u", &u, "--metrics-url", &m, "--binary-search"];
    args.extend(["--concurrency-range", "1:64", "--slo-p99-ms", "0.001", "--json", j]);
    args.extend(["-p", "300", "-r", "1", "--warmup-ms", "100"]);
    let run = perf(&args);
    assert_eq!(run.code(), 4, "stdout:\n{}\nstderr:\n{}", run.stdout, run.stderr);
    assert!(run.stdout.contains("no load level met the SLO"), "{}", run.stdout);
    assert!(run.stdout.contains("the lower bound concurrency 1 misses the SLO"), "{}", run.stdout);
    let report = read_json(&json);
    assert_eq!(report["binary_search"]["outcome"].as_str(), Some("nothing_meets"));
    assert_eq!(report["levels"].as_array().unwrap().len(), 1, "one probe is enough");
    assert_eq!(report["verdict"]["exit_code"].as_i64(), Some(4));

    // Open loop over a request-rate range.
    let hu = w.http_url();
    let mut args = vec!["-m", "mlp_fp32", "-i", "http", "-u", &hu, "--metrics-url", &m, "--binary-search"];
    args.extend(["--request-rate-range", "20:60:10", "--slo-p99-ms", "10000", "--json", j]);
    args.extend(SHORT);
    let run = perf(&args);
    assert_measured(&run, true);
    let report = read_json(&json);
    let search = &report["binary_search"];
    assert_eq!(search["outcome"].as_str(), Some("found"), "{search}");
    assert_eq!(search["highest_meeting_slo"]["request_rate"]["rate"].as_f64(), Some(60.0));
    assert_eq!(search["precision"].as_f64(), Some(10.0), "the range's step");
    assert!(run.stdout.contains("binary search probes, in order: 20 req/s (constant) met, 60 req/s (constant) met"));
}

/// Three distinct rows for identity_fp32 (INPUT0: 16 × FP32), values that are not round in
/// binary so a lossy path would show.
fn identity_rows() -> Vec<Vec<f32>> {
    (0..3).map(|k| (0..16).map(|j| (k * 16 + j) as f32 * 0.37 - 5.1).collect()).collect()
}

/// An input data file giving the rows in each of the three forms: a flat array, `content`
/// with `shape`, and `b64`.
fn write_identity_data(path: &Path) {
    let rows = identity_rows();
    let raw: Vec<u8> = rows[2].iter().flat_map(|f| f.to_le_bytes()).collect();
    let file = json!({"data": [
        {"INPUT0": rows[0]},
        {"INPUT0": {"content": rows[1], "shape": [16]}},
        {"INPUT0": {"b64": base64::engine::general_purpose::STANDARD.encode(raw)}},
    ]});
    std::fs::write(path, file.to_string()).unwrap();
}

/// OUTPUT0 of an infer response body as f32 values: a gRPC message frame, KServe JSON, or
/// JSON followed by binary tensors.
fn output_values(protocol: &str, body: &[u8]) -> Vec<f32> {
    let from_le = |raw: &[u8]| raw.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    if protocol == "grpc" {
        let len = u32::from_be_bytes(body[1..5].try_into().unwrap()) as usize;
        let response = ModelInferResponse::decode(&body[5..5 + len]).expect("a ModelInferResponse");
        return from_le(&response.raw_output_contents[0]);
    }
    let mut stream = serde_json::Deserializer::from_slice(body).into_iter::<Value>();
    let header = stream.next().expect("a JSON header").expect("valid JSON");
    let output = &header["outputs"][0];
    match output["parameters"]["binary_data_size"].as_u64() {
        Some(n) => {
            assert_eq!(protocol, "http-binary", "binary output only when asked for: {header}");
            let start = stream.byte_offset();
            from_le(&body[start..start + n as usize])
        }
        None => output["data"].as_array().expect("JSON data").iter().map(|v| v.as_f64().unwrap() as f32).collect(),
    }
}

#[test]
fn input_data_file_values_reach_the_server_exactly() {
    let Some(w) = Worker::start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("inputs.json");
    write_identity_data(&data);
    let d = data.to_str().unwrap();
    let rows = identity_rows();

    // Through the same preparation as a run: every distinct request, sent once, echoes its rows.
    // At batch size 2 the 3 entries make 3 requests: rows (0, 1), (2, 0), (1, 2).
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (gu, hu) = (w.grpc_url(), w.http_url());
    let cases: [(&str, &[&str]); 3] = [
        ("grpc", &["-u", &gu]),
        ("http-json", &["-u", &hu, "-i", "http"]),
        ("http-binary", &["-u", &hu, "-i", "http", "--http-binary"]),
    ];
    for (protocol, flags) in cases {
        let mut argv = vec!["nereid-perf", "-m", "identity_fp32", "--input-data", d, "-b", "2"];
        argv.extend(flags);
        let config = Args::try_parse_from(argv).unwrap().into_config().unwrap();
        runtime.block_on(async {
            let client = Client::connect(&config.target).await.unwrap();
            let prepared = prepare(&client, &config).await.unwrap();
            let variants = prepared.requests[0].variants();
            assert_eq!(variants.len(), 3, "{protocol}");
            let mut lane = client.lane(0);
            for (k, request) in variants.iter().enumerate() {
                let body =
                    lane.fetch(request, Duration::from_secs(10)).await.unwrap_or_else(|f| panic!("{protocol}: {f:?}"));
                let got = output_values(protocol, &body);
                let want: Vec<f32> = [(2 * k) % 3, (2 * k + 1) % 3].iter().flat_map(|r| rows[*r].clone()).collect();
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<u32>>();
                assert_eq!(bits(&got), bits(&want), "{protocol}: request {k} did not echo its rows");
            }
        });
    }

    // Measured runs with the file: over gRPC from the flag, over HTTP binary from a workload
    // entry whose "data" names the file relative to the workload file.
    let json = dir.path().join("out.json");
    let (m, j) = (w.metrics_url(), json.to_str().unwrap().to_string());
    let mut args = vec!["-m", "identity_fp32", "-u", &gu, "--metrics-url", &m, "--json", &j, "--input-data", d];
    args.extend(["-b", "2", "--concurrency-range", "2"]);
    args.extend(SHORT);
    let run = perf(&args);
    assert_measured(&run, false);
    check_level(&read_json(&json)["levels"][0], "identity_fp32");
    let workload = dir.path().join("workload.json");
    std::fs::write(&workload, r#"{"entries": [{"model": "identity_fp32", "batch_size": 3, "data": "inputs.json"}]}"#)
        .unwrap();
    let w_path = workload.to_str().unwrap().to_string();
    let mut args = vec!["--workload", &w_path, "-i", "http", "--http-binary", "-u", &hu, "--metrics-url", &m];
    args.extend(["--json", &j, "--concurrency-range", "2"]);
    args.extend(SHORT);
    let run = perf(&args);
    assert_measured(&run, false);
    check_level(&read_json(&json)["levels"][0], "identity_fp32");

    // A file that does not fit the model is refused before any load, naming the entry and input.
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, r#"{"data": [{"INPUT0": [0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15]}, {"INPUT0": [1, 2]}]}"#)
        .unwrap();
    let run = perf(&["-m", "identity_fp32", "-u", &gu, "--input-data", bad.to_str().unwrap()]);
    assert_eq!(run.code(), 2, "{}", run.stderr);
    assert!(run.stderr.contains("data[1].INPUT0: 2 values given, but shape [16] needs 16"), "{}", run.stderr);
    std::fs::write(&bad, r#"{"data": [{"INPUT1": [1]}]}"#).unwrap();
    let run = perf(&["-m", "identity_fp32", "-i", "http", "-u", &hu, "--input-data", bad.to_str().unwrap()]);
    assert_eq!(run.code(), 2, "{}", run.stderr);
    assert!(run.stderr.contains("data[0].INPUT1") && run.stderr.contains("no input 'INPUT1'"), "{}", run.stderr);
    // Bad base64 is caught when the file is read, before connecting.
    std::fs::write(&bad, r#"{"data": [{"INPUT0": {"b64": "%%%"}}]}"#).unwrap();
    let run = perf(&["-m", "identity_fp32", "-u", &closed_port(), "--input-data", bad.to_str().unwrap()]);
    assert_eq!(run.code(), 2, "{}", run.stderr);
    assert!(run.stderr.contains("data[0].INPUT0.b64: not valid base64"), "{}", run.stderr);
}

#[test]
fn tls_and_mutual_tls_through_a_terminating_proxy() {
    let Some(w) = Worker::start() else { return };
    let dir = tempfile::tempdir().unwrap();
    let pki = common::TestPki::new(dir.path());
    let grpc = common::TlsProxy::start(w.grpc, pki.server_config(false));
    let https = common::TlsProxy::start(w.http, pki.server_config(false));
    let mutual = common::TlsProxy::start(w.grpc, pki.server_config(true));
    let json = dir.path().join("out.json");
    let (m, j, ca) = (w.metrics_url(), json.to_str().unwrap().to_string(), pki.ca.to_str().unwrap().to_string());

    // gRPC over TLS, with perf_analyzer's flag names.
    let u = format!("localhost:{}", grpc.port);
    let mut args =
        vec!["-m", "identity_fp32", "-u", &u, "--ssl-grpc-use-ssl", "--ssl-grpc-root-certifications-file", &ca];
    args.extend(["--metrics-url", &m, "--json", &j, "--concurrency-range", "2"]);
    args.extend(SHORT);
    let run = perf(&args);
    assert_measured(&run, false);
    check_level(&read_json(&json)["levels"][0], "identity_fp32");

    // HTTPS with binary tensors, TLS from the https:// URL; /metrics over HTTPS too, trusting
    // the same CA.
    let u = format!("https://localhost:{}", https.port);
    let metrics_tls = common::TlsProxy::start(w.metrics, pki.server_config(false));
    let m_https = format!("https://localhost:{}/metrics", metrics_tls.port);
    let mut args = vec!["-m", "mlp_fp32", "-i", "http", "--http-binary", "-u", &u, "--ssl-ca", &ca];
    args.extend(["--metrics-url", &m_https, "--json", &j, "--request-rate-range", "100"]);
    args.extend(SHORT);
    let run = perf(&args);
    assert_measured(&run, true);
    assert!(!run.stderr.contains("breakdown unavailable"), "{}", run.stderr);
    let report = read_json(&json);
    // check_level also requires the server-side breakdown: scraped over HTTPS.
    check_level(&report["levels"][0], "mlp_fp32");
    assert_eq!(report["metrics_url"], m_https.as_str(), "{report}");

    // Mutual TLS: refused without a client certificate, measured with one.
    let u = format!("localhost:{}", mutual.port);
    let run = perf(&["-m", "identity_fp32", "-u", &u, "--ssl-ca", &ca, "-p", "100"]);
    assert_eq!(run.code(), 2, "{}", run.stderr);
    assert!(run.stderr.contains(&format!("cannot reach {u}")), "{}", run.stderr);
    let (cert, key) = (pki.client_cert.to_str().unwrap(), pki.client_key.to_str().unwrap());
    let mut args = vec!["-m", "identity_fp32", "-u", &u, "--ssl-ca", &ca, "--ssl-cert", cert, "--ssl-key", key];
    args.extend(["--metrics-url", &m, "--json", &j, "--concurrency-range", "2"]);
    args.extend(SHORT);
    let run = perf(&args);
    assert_measured(&run, false);
    check_level(&read_json(&json)["levels"][0], "identity_fp32");

    // A server certificate the client cannot trust, or for another name: exit 2, saying why.
    let u = format!("localhost:{}", grpc.port);
    let run = perf(&["-m", "identity_fp32", "-u", &u, "--ssl-ca", pki.rogue_ca.to_str().unwrap()]);
    assert_eq!(run.code(), 2, "{}", run.stderr);
    assert!(run.stderr.contains("TLS handshake failed") && run.stderr.contains("UnknownIssuer"), "{}", run.stderr);
    let u = format!("127.0.0.1:{}", https.port);
    let run = perf(&["-m", "identity_fp32", "-i", "http", "-u", &u, "--ssl-ca", &ca]);
    assert_eq!(run.code(), 2, "{}", run.stderr);
    assert!(run.stderr.contains("TLS handshake failed") && run.stderr.contains("not valid for name"), "{}", run.stderr);
}

#[test]
fn shared_memory_carries_exact_values_and_its_regions_are_unregistered() {
    let Some(w) = Worker::start_with(&["--allow-client-shm=true"]) else { return };
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("inputs.json");
    write_identity_data(&data);
    let d = data.to_str().unwrap();
    let rows = identity_rows();
    let regions = || serde_json::from_str::<Value>(&http_get(w.http, "/v2/systemsharedmemory/status")).unwrap();

    // Every distinct request, sent once through the run's preparation, has its rows echoed
    // into the output region, and its response names that region instead of carrying data.
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (gu, hu) = (w.grpc_url(), w.http_url());
    let cases: [(&str, &[&str]); 2] = [("grpc", &["-u", &gu]), ("http", &["-u", &hu, "-i", "http"])];
    for (protocol, flags) in cases {
        let mut argv = vec!["nereid-perf", "-m", "identity_fp32", "--input-data", d, "-b", "2"];
        argv.extend(["--shared-memory", "system"]);
        argv.extend(flags);
        let config = Args::try_parse_from(argv).unwrap().into_config().unwrap();
        runtime.block_on(async {
            let client = Client::connect(&config.target).await.unwrap();
            let prepared = prepare(&client, &config).await.unwrap();
            assert_eq!(regions().as_array().unwrap().len(), 2, "{protocol}: input and output regions registered");
            let shm = prepared.shm.as_ref().expect("shared memory prepared");
            let mut lane = client.lane(0);
            for (k, request) in prepared.requests[0].variants().iter().enumerate() {
                let body =
                    lane.fetch(request, Duration::from_secs(10)).await.unwrap_or_else(|f| panic!("{protocol}: {f:?}"));
                if protocol == "grpc" {
                    let len = u32::from_be_bytes(body[1..5].try_into().unwrap()) as usize;
                    let response = ModelInferResponse::decode(&body[5..5 + len]).unwrap();
                    assert!(response.outputs[0].parameters.contains_key("shared_memory_region"), "{response:?}");
                    assert!(response.raw_output_contents.iter().all(|r| r.is_empty()));
                } else {
                    let header: Value = serde_json::from_slice(&body).unwrap();
                    assert!(header["outputs"][0]["parameters"]["shared_memory_region"].is_string(), "{header}");
                    assert!(header["outputs"][0].get("data").is_none(), "{header}");
                }
                let raw = shm.read_output("identity_fp32", "OUTPUT0", 2 * 16 * 4).unwrap();
                let got: Vec<u32> = raw.chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().unwrap())).collect();
                let want: Vec<u32> =
                    [(2 * k) % 3, (2 * k + 1) % 3].iter().flat_map(|r| rows[*r].iter().map(|f| f.to_bits())).collect();
                assert_eq!(got, want, "{protocol}: request {k} did not echo its rows through shared memory");
            }
            let errors = prepared.shm.unwrap().release(&client).await;
            assert!(errors.is_empty(), "{errors:?}");
        });
        assert_eq!(regions(), json!([]), "{protocol}: regions unregistered");
    }

    // A measured run: no errors, the server-side breakdown, and nothing left registered.
    let json_path = dir.path().join("out.json");
    let (m, j) = (w.metrics_url(), json_path.to_str().unwrap().to_string());
    let mut args = vec!["-m", "mlp_fp32", "-u", &gu, "--metrics-url", &m, "--json", &j, "--shared-memory", "system"];
    args.extend(["--concurrency-range", "2"]);
    args.extend(SHORT);
    let run = perf(&args);
    assert_measured(&run, false);
    let report = read_json(&json_path);
    check_level(&report["levels"][0], "mlp_fp32");
    assert_eq!(report["shared_memory"], json!(true), "the report says how tensors travelled");
    assert_eq!(regions(), json!([]));

    // A worker that does not allow client shared memory: a clear error before any load.
    let Some(off) = Worker::start() else { return };
    let ou = off.grpc_url();
    let run = perf(&["-m", "identity_fp32", "-u", &ou, "--shared-memory", "system"]);
    assert_ne!(run.code(), 0, "{}", run.stdout);
    assert!(run.stderr.contains("--allow-client-shm=true"), "{}", run.stderr);
}

#[test]
fn validation_data_checks_every_distinct_request_before_any_load() {
    let Some(w) = Worker::start_with(&["--allow-client-shm=true"]) else { return };
    let dir = tempfile::tempdir().unwrap();
    let rows = identity_rows();
    // identity_fp32 echoes its input: the expected outputs are the rows themselves.
    let file = |expected: &[Vec<f32>]| {
        json!({
            "data": rows.iter().map(|r| json!({"INPUT0": r})).collect::<Vec<_>>(),
            "validation_data": expected.iter().map(|r| json!({"OUTPUT0": r})).collect::<Vec<_>>(),
        })
        .to_string()
    };
    let good = dir.path().join("good.json");
    std::fs::write(&good, file(&rows)).unwrap();
    let mut wrong_rows = rows.clone();
    wrong_rows[1][3] += 1.0;
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, file(&wrong_rows)).unwrap();

    let (gu, hu, m) = (w.grpc_url(), w.http_url(), w.metrics_url());
    let cases: [&[&str]; 4] = [
        &["-u", &gu],
        &["-u", &hu, "-i", "http"],
        &["-u", &hu, "-i", "http", "--http-binary"],
        &["-u", &gu, "--shared-memory", "system"],
    ];
    for flags in cases {
        // At batch size 2 the three entries make three requests: rows (0,1), (2,0), (1,2).
        let mut args = vec!["-m", "identity_fp32", "-b", "2", "--metrics-url", &m, "--concurrency-range", "1"];
        args.extend(flags);
        args.extend(SHORT);
        let mut ok = args.clone();
        ok.extend(["--input-data", good.to_str().unwrap()]);
        let run = perf(&ok);
        assert_measured(&run, false);

        let mut wrong = args.clone();
        wrong.extend(["--input-data", bad.to_str().unwrap()]);
        let run = perf(&wrong);
        assert_eq!(run.code(), 6, "{flags:?}\nstdout:\n{}\nstderr:\n{}", run.stdout, run.stderr);
        let want = format!(
            "validation_data[0]+validation_data[1]: output 'OUTPUT0': element 19 is {}, expected {}",
            rows[1][3], wrong_rows[1][3]
        );
        assert!(run.stderr.contains(&want), "{flags:?}: wanted {want:?} in\n{}", run.stderr);
        assert!(!run.stdout.contains("Inferences/Second"), "nothing measured: {}", run.stdout);
    }
    let status = http_get(w.http, "/v2/systemsharedmemory/status");
    assert_eq!(serde_json::from_str::<Value>(&status).unwrap(), json!([]), "regions released after a mismatch");

    // An expected output the model does not have is refused before any request.
    let unknown = dir.path().join("unknown.json");
    std::fs::write(
        &unknown,
        r#"{"data": [{"INPUT0": [0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15]}], "validation_data": [{"NOPE": [1]}]}"#,
    )
    .unwrap();
    let run = perf(&["-m", "identity_fp32", "-u", &gu, "--input-data", unknown.to_str().unwrap()]);
    assert_eq!(run.code(), 2, "{}", run.stderr);
    assert!(
        run.stderr.contains("validation_data[0].NOPE: model 'identity_fp32' has no output 'NOPE'"),
        "{}",
        run.stderr
    );
}
