//! End to end: the `nereid-analyze` binary sweeping `identity_fp32` on a real `nereid-worker`
//! (started by nereid-analyze itself, or by the test in explicit mode for `--url`), on real
//! ONNX Runtime: results.json, the frontier, the recommended config.pbtxt parsing back,
//! `--resume` skipping measured variants, quick search's bound, a load failure recorded, a
//! queue-policy sweep the worker accepts, a `--url` sweep over TLS (gRPC, HTTPS with a client
//! certificate, `/metrics` over HTTPS) through a TLS-terminating proxy, and the failure exits
//! (unreachable server, worker that cannot start, server killed mid-sweep, untrusted CA).
//! Tiny spaces and short windows; nothing asserts on speed.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nereid_common::config::{dynamic_batching, parse_model_config};
use serde_json::Value;

const ANALYZE: &str = env!("CARGO_BIN_EXE_nereid-analyze");
/// Longest any single nereid-analyze run may take before the test kills it.
const RUN_LIMIT: Duration = Duration::from_secs(180);
const WORKER_START_LIMIT: Duration = Duration::from_secs(90);
/// Short bounded windows: 2 × 250 ms after 150 ms of warm-up, a wide stability band.
const SHORT: [&str; 8] = ["-p", "250", "-r", "2", "-s", "1000", "--warmup-ms", "150"];

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("loadtests/ is inside the workspace").to_path_buf()
}

/// The worker binary next to nereid-analyze (same target dir), else `<workspace>/target/debug`.
/// Missing: the test is skipped (a plain `cargo test`), or fails with `NEREID_REQUIRE_WORKER`.
fn worker_binary() -> Option<PathBuf> {
    let sibling = Path::new(ANALYZE).with_file_name("nereid-worker");
    let fallback = workspace().join("target/debug/nereid-worker");
    let found = [sibling, fallback].into_iter().find(|p| p.exists());
    if found.is_none() {
        let why = format!(
            "nereid-worker is not built (looked next to {ANALYZE} and in {}); run `cargo build --workspace \
             --all-targets` first",
            workspace().join("target/debug").display()
        );
        common::worker_not_built(&why);
    }
    found
}

#[test]
fn a_missing_worker_fails_instead_of_skipping_when_required() {
    use common::worker_required;
    assert!(!worker_required(None), "a plain cargo test skips");
    assert!(!worker_required(Some("")) && !worker_required(Some("0")));
    assert!(worker_required(Some("1")) && worker_required(Some("yes")));
}

fn ort_lib() -> PathBuf {
    workspace().join(".deps/onnxruntime/libonnxruntime.so")
}

fn models() -> PathBuf {
    workspace().join("examples/models")
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl std::fmt::Display for Run {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "exit {}\nstdout:\n{}\nstderr:\n{}", self.code, self.stdout, self.stderr)
    }
}

/// Starts nereid-analyze with `args`; `on_wait` is called while it runs (every 20 ms).
fn analyze_with(args: &[&str], on_wait: impl FnMut()) -> Run {
    let mut cmd = Command::new(ANALYZE);
    cmd.args(args).env("NEREID_ORT_LIB", ort_lib());
    let o = common::run_bounded(cmd, &format!("nereid-analyze {args:?}"), RUN_LIMIT, on_wait);
    Run { code: o.status.code().unwrap_or(-1), stdout: o.stdout, stderr: o.stderr }
}

fn analyze(args: &[&str]) -> Run {
    analyze_with(args, || {})
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("JSON parses")
}

fn rows(report: &Value) -> &Vec<Value> {
    report["rows"].as_array().expect("rows")
}

/// The cells of a CSV line, quotes undone (RFC 4180: a reason may hold commas).
fn csv_cells(line: &str) -> Vec<String> {
    let (mut cells, mut cell, mut quoted, mut chars) = (Vec::new(), String::new(), false, line.chars().peekable());
    while let Some(c) = chars.next() {
        match (c, quoted) {
            ('"', true) if chars.peek() == Some(&'"') => {
                cell.push('"');
                chars.next();
            }
            ('"', _) => quoted = !quoted,
            (',', false) => cells.push(std::mem::take(&mut cell)),
            _ => cell.push(c),
        }
    }
    cells.push(cell);
    cells
}

/// The cell of `column` in line `row` (0 is the header) of a results.csv `text`.
fn csv_cell(text: &str, row: usize, column: &str) -> String {
    let header = csv_cells(text.lines().next().expect("a header"));
    let i = header.iter().position(|c| c == column).unwrap_or_else(|| panic!("no column {column}: {header:?}"));
    let cells = csv_cells(text.lines().nth(row).unwrap_or_else(|| panic!("no row {row}: {text}")));
    assert_eq!(cells.len(), header.len(), "row {row}: {text}");
    cells[i].clone()
}

#[test]
fn brute_sweep_writes_results_frontier_and_a_config_that_parses_then_resumes() {
    let Some(worker) = worker_binary() else { return };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let (w, o, m) = (worker.to_str().unwrap(), out.to_str().unwrap(), models());
    let base = [
        "--model-repository",
        m.to_str().unwrap(),
        "-m",
        "identity_fp32",
        "--worker-bin",
        w,
        "-o",
        o,
        "--instance-counts",
        "1,2",
        "--max-batch-sizes",
        "8",
        "--max-p99-ms",
        "5000",
        "--concurrency",
        "2",
    ];
    // 2 × 2 variants.
    let mut args: Vec<&str> = base.to_vec();
    args.extend(["--max-queue-delays-us", "0,100"]);
    args.extend(SHORT);
    let run = analyze(&args);
    assert_eq!(run.code, 0, "{run}");
    assert!(run.stdout.contains("Pareto frontier") && run.stdout.contains("recommended by goodput"), "{run}");

    let report = read_json(&out.join("results.json"));
    let rs = rows(&report);
    assert_eq!(rs.len(), 4);
    let keys: Vec<&str> = rs.iter().map(|r| r["key"].as_str().unwrap()).collect();
    assert_eq!(keys, ["i1_b8_p0_d0", "i1_b8_p0_d100", "i2_b8_p0_d0", "i2_b8_p0_d100"]);
    for r in rs {
        assert_eq!(r["status"], "measured", "{r}");
        let m = &r["measured"];
        assert!(m["throughput_infer_per_sec"].as_f64().unwrap() > 0.0);
        assert!(m["p50_ms"].as_f64().unwrap() <= m["p99_ms"].as_f64().unwrap());
        assert!(m["memory_mb"].as_f64().unwrap() > 0.0, "the started worker's RSS is known: {r}");
        assert_eq!(r["config"]["instance_group"][0]["count"], r["variant"]["instance_count"]);
        assert_eq!(r["meets_constraints"], true);
        assert_eq!(r["trusted"], true, "stable, closed loop: {r}");
        // The percentiles and the server's queue vs compute time (scraped from /metrics).
        let p = |k: &str| m[k].as_f64().unwrap_or_else(|| panic!("no {k}: {r}"));
        assert!(p("p50_ms") <= p("p90_ms") && p("p90_ms") <= p("p99_ms") && p("p99_ms") <= p("p999_ms"), "{r}");
        let server = &m["server_time"];
        assert!(server["compute_infer_us"].as_f64().unwrap_or(0.0) > 0.0, "{r}");
        assert!(server["queue_us"].as_f64().is_some_and(|q| q >= 0.0), "{r}");
        // Every variant's config as a ready config.pbtxt, exactly the config that was loaded.
        let key = r["key"].as_str().unwrap();
        let path = out.join("variants").join(key).join("config.pbtxt");
        assert_eq!(r["config_pbtxt"].as_str(), path.to_str(), "{r}");
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let config = parse_model_config(&text).unwrap_or_else(|e| panic!("{}: {e}\n{text}", path.display()));
        let sent = nereid_common::config::parse_model_config_json(&r["config"].to_string()).unwrap();
        assert_eq!(config, sent, "{}", path.display());
        assert_eq!(i64::from(config.instance_group[0].count), r["variant"]["instance_count"].as_i64().unwrap());
        assert_eq!(
            dynamic_batching(&config).unwrap().max_queue_delay_microseconds,
            r["variant"]["max_queue_delay_us"].as_u64().unwrap()
        );
    }
    // The frontier: non-empty, made of measured variants, flagged on their rows.
    let frontier: Vec<&str> = report["frontier"].as_array().unwrap().iter().map(|k| k.as_str().unwrap()).collect();
    assert!(!frontier.is_empty());
    for r in rs {
        assert_eq!(r["on_frontier"].as_bool().unwrap(), frontier.contains(&r["key"].as_str().unwrap()));
    }
    // The recommendation: on the frontier's side of things, written as a config that parses.
    let rec = report["recommended"]["key"].as_str().expect("a recommendation");
    assert!(keys.contains(&rec));
    let text = std::fs::read_to_string(out.join("recommended/config.pbtxt")).expect("config.pbtxt written");
    let config = parse_model_config(&text).expect("the recommended config parses back");
    let row = rs.iter().find(|r| r["key"] == rec).unwrap();
    assert_eq!(config.name, "identity_fp32");
    assert_eq!(config.max_batch_size, 8);
    assert_eq!(i64::from(config.instance_group[0].count), row["variant"]["instance_count"].as_i64().unwrap());
    let csv = std::fs::read_to_string(out.join("results.csv")).unwrap();
    assert_eq!(csv.lines().count(), 1 + 4);
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(html.contains("Pareto frontier") && html.contains("<svg"));
    assert!(html.contains("Latency percentiles vs throughput") && html.contains("<title>p99.9: "), "percentiles");
    assert!(html.contains("queue vs compute") && html.contains("i2_b8_p0_d100: compute infer = "), "server time");
    let checkpoint = read_json(&out.join("checkpoint.json"));
    assert_eq!(checkpoint["results"].as_array().unwrap().len(), 4);

    // Resume over a wider space: the 4 measured variants come from the checkpoint, only the
    // 2 new ones are measured.
    let mut args: Vec<&str> = base.to_vec();
    args.extend(["--max-queue-delays-us", "0,100,500", "--resume"]);
    args.extend(SHORT);
    let run = analyze(&args);
    assert_eq!(run.code, 0, "{run}");
    assert_eq!(run.stderr.matches("(from the checkpoint)").count(), 4, "{run}");
    let resumed = read_json(&out.join("results.json"));
    assert_eq!(resumed["reused"], 4);
    let rs2 = rows(&resumed);
    assert_eq!(rs2.len(), 6);
    for r in rs {
        let again = rs2.iter().find(|x| x["key"] == r["key"]).expect("kept");
        assert_eq!(again["measured"], r["measured"], "reused, not re-measured");
    }
    assert_eq!(read_json(&out.join("checkpoint.json"))["results"].as_array().unwrap().len(), 6);
}

#[test]
fn quick_search_is_bounded_and_load_failures_are_recorded() {
    let Some(worker) = worker_binary() else { return };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let m = models();
    // max_batch_size 0 does not match the model's batch dim: the server refuses that load.
    let mut args = vec![
        "--model-repository",
        m.to_str().unwrap(),
        "-m",
        "identity_fp32",
        "--worker-bin",
        worker.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "-i",
        "http",
        "--search",
        "quick",
        "--max-variants",
        "3",
        "--instance-counts",
        "1,2,3",
        "--max-batch-sizes",
        "0,8",
        "--max-queue-delays-us",
        "0,100",
        "--objective",
        "throughput",
    ];
    args.extend(SHORT);
    let run = analyze(&args);
    assert_eq!(run.code, 0, "{run}");
    let report = read_json(&out.join("results.json"));
    let rs = rows(&report);
    let measured_or_failed = rs.iter().filter(|r| r["status"] != "skipped").count();
    assert!(measured_or_failed <= 3, "quick search measured more than --max-variants: {rs:?}");
    let start = &rs[0];
    assert_eq!(start["key"], "i1_b0_p0_d0", "the climb starts at the smallest values");
    assert_eq!(start["status"], "load_failed", "{start}");
    assert!(start["reason"].as_str().unwrap().contains("dims"), "the server's reason is kept: {start}");
    assert!(report["recommended"]["key"].is_string());
}

#[test]
fn a_queue_policy_sweep_loads_each_policy_and_writes_it_where_it_wins() {
    let Some(worker) = worker_binary() else { return };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let m = models();
    // 2 × 2: max_batch_size 0 does not match the model (the server refuses it) and cannot take
    // a queue policy (skipped); max_batch_size 8 is measured with and without one. Two
    // requests in flight never fill a queue of 4, so nothing is rejected for it.
    let mut args = vec![
        "--model-repository",
        m.to_str().unwrap(),
        "-m",
        "identity_fp32",
        "--worker-bin",
        worker.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--instance-counts",
        "1",
        "--max-batch-sizes",
        "0,8",
        "--max-queue-delays-us",
        "0",
        "--max-queue-sizes",
        "0,4",
        "--max-p99-ms",
        "5000",
        "--concurrency",
        "2",
    ];
    args.extend(SHORT);
    let run = analyze(&args);
    assert_eq!(run.code, 0, "{run}");

    let report = read_json(&out.join("results.json"));
    let rs = rows(&report);
    let keys: Vec<&str> = rs.iter().map(|r| r["key"].as_str().unwrap()).collect();
    assert_eq!(keys, ["i1_b0_p0_d0", "i1_b0_p0_d0_q4", "i1_b8_p0_d0", "i1_b8_p0_d0_q4"]);
    let status: Vec<&str> = rs.iter().map(|r| r["status"].as_str().unwrap()).collect();
    assert_eq!(status, ["load_failed", "skipped", "measured", "measured"], "{rs:?}");
    assert!(rs[1]["reason"].as_str().unwrap().contains("queue policy"), "{}", rs[1]);
    assert_eq!(report["space"]["max_queue_sizes"], serde_json::json!([0, 4]));
    for r in &rs[2..] {
        let q = r["variant"]["max_queue_size"].as_u64().unwrap_or(0);
        let sent = r["config"]["dynamic_batching"]["default_queue_policy"]["max_queue_size"].as_u64().unwrap_or(0);
        assert_eq!(sent, q, "the loaded config carries the variant's queue size: {r}");
        assert!(r["measured"]["throughput_infer_per_sec"].as_f64().unwrap() > 0.0, "{r}");
    }
    assert_eq!(rs[3]["variant"]["max_queue_size"], 4);
    assert!(rs[2]["variant"].get("max_queue_size").is_none(), "no policy: the variant reads as before");

    // Whichever wins, its config.pbtxt parses and has a queue policy exactly when it should.
    let rec = report["recommended"]["key"].as_str().expect("a recommendation");
    assert!(keys[2..].contains(&rec), "{rec}");
    let text = std::fs::read_to_string(out.join("recommended/config.pbtxt")).expect("config.pbtxt written");
    let config = parse_model_config(&text).expect("the recommended config parses back");
    let policy = dynamic_batching(&config).and_then(|db| db.default_queue_policy);
    assert_eq!(policy.map(|p| p.max_queue_size), rec.ends_with("_q4").then_some(4), "{text}");
    assert_eq!(text.contains("default_queue_policy"), rec.ends_with("_q4"), "{text}");

    let csv = std::fs::read_to_string(out.join("results.csv")).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert!(lines[4].starts_with("i1_b8_p0_d0_q4,"), "{}", lines[4]);
    let policy = ["max_queue_size", "queue_timeout_us", "concurrency", "request_rate", "priority_levels"];
    assert_eq!(policy.map(|c| csv_cell(&csv, 4, c)), ["4", "0", "2", "", "0"], "{}", lines[4]);
    assert_eq!(csv_cell(&csv, 4, "gpu_memory_mb"), "", "no GPU here: {}", lines[4]);
    let checkpoint = read_json(&out.join("checkpoint.json"));
    assert_eq!(checkpoint["results"].as_array().unwrap().len(), 4);
}

/// A sweep of identity_fp32 by a started `worker` into `out`: the example repository, the
/// flags in `parts`, then short windows.
fn identity_sweep(worker: &Path, out: &Path, parts: &[&[&str]]) -> Vec<String> {
    let m = models();
    let mut args: Vec<String> = ["--model-repository", m.to_str().unwrap(), "-m", "identity_fp32"]
        .into_iter()
        .chain(["--worker-bin", worker.to_str().unwrap(), "-o", out.to_str().unwrap()])
        .map(String::from)
        .collect();
    args.extend(parts.iter().flat_map(|p| p.iter().map(|a| a.to_string())));
    args.extend(SHORT.iter().map(|a| a.to_string()));
    args
}

fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

#[test]
fn a_concurrency_range_credits_each_variant_with_its_best_level() {
    let Some(worker) = worker_binary() else { return };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let space = ["--instance-counts", "1", "--max-batch-sizes", "8", "--max-queue-delays-us", "0,100"];
    let args = identity_sweep(&worker, &out, &[&space[..], &["--max-p99-ms", "5000", "--concurrency-range", "1:4:3"]]);
    let run = analyze(&strs(&args));
    assert_eq!(run.code, 0, "{run}");
    assert!(run.stdout.contains("best level") && run.stdout.contains(" at c="), "{run}");

    let report = read_json(&out.join("results.json"));
    assert_eq!(report["load_description"], "concurrency 1, 4 (each variant at its best level)");
    let rs = rows(&report);
    assert_eq!(rs.len(), 2);
    for r in rs {
        assert_eq!(r["status"], "measured", "{r}");
        let levels = r["levels"].as_array().expect("every level kept");
        let measured_at: Vec<u64> = levels.iter().map(|l| l["concurrency"].as_u64().unwrap()).collect();
        assert_eq!(measured_at, [1, 4], "{r}");
        // Both levels meet p99 ≤ 5 s, so the credited one is the level with the most goodput.
        let goodput = |l: &Value| l["goodput_infer_per_sec"].as_f64().unwrap();
        let best = levels.iter().max_by(|a, b| goodput(a).total_cmp(&goodput(b))).unwrap();
        assert_eq!(&r["measured"], best, "{r}");
    }
    let csv = std::fs::read_to_string(out.join("results.csv")).unwrap();
    let lines: Vec<&str> = csv.lines().collect();
    assert_eq!(lines.len(), 1 + rs.len());
    for (i, r) in rs.iter().enumerate() {
        assert_eq!(csv_cell(&csv, i + 1, "concurrency"), r["measured"]["concurrency"].to_string(), "{csv}");
        assert_eq!(csv_cell(&csv, i + 1, "request_rate"), "", "{csv}");
    }
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(html.contains("across load levels") && html.contains("<th>best level</th>"), "levels chart and column");

    // A resume under another load reuses nothing: its variants are measured again.
    let args =
        identity_sweep(&worker, &out, &[&space[..], &["--max-p99-ms", "5000", "--concurrency", "2", "--resume"]]);
    let run = analyze(&strs(&args));
    assert_eq!(run.code, 0, "{run}");
    assert!(run.stdout.contains("nothing reused, every variant measured again"), "{run}");
    assert_eq!(read_json(&out.join("results.json"))["reused"], 0);
}

#[test]
fn a_priority_sweep_with_a_workload_sheds_only_the_lower_level() {
    let Some(worker) = worker_binary() else { return };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let workload = dir.path().join("workload.json");
    std::fs::write(
        &workload,
        r#"{"entries": [
            {"model": "identity_fp32", "weight": 1, "priority": 1, "class": "gold", "slo_ms": 5000},
            {"model": "identity_fp32", "weight": 3, "priority": 2, "class": "bronze", "slo_ms": 5000,
             "mix": [{"batch_size": 1}, {"batch_size": 4}]}
        ]}"#,
    )
    .unwrap();
    let sweep = [
        "--workload",
        workload.to_str().unwrap(),
        "--instance-counts",
        "1",
        "--max-batch-sizes",
        "8",
        "--max-queue-delays-us",
        "0",
        "--max-queue-sizes",
        "0,1",
        "--priority-levels",
        "0,2",
        "--concurrency",
        "8",
    ];
    let args = identity_sweep(&worker, &out, &[&sweep[..]]);
    let args = strs(&args);
    let run = analyze(&args);
    assert_eq!(run.code, 0, "{run}");
    assert!(run.stdout.contains("  gold: ") && run.stdout.contains("  bronze: "), "per-class lines: {run}");

    let report = read_json(&out.join("results.json"));
    assert!(report["load_description"].as_str().unwrap().ends_with("workload.json"), "{}", report["load_description"]);
    let rs = rows(&report);
    let keys: Vec<&str> = rs.iter().map(|r| r["key"].as_str().unwrap()).collect();
    assert_eq!(keys, ["i1_b8_p0_d0", "i1_b8_p0_d0_l2", "i1_b8_p0_d0_q1", "i1_b8_p0_d0_q1_l2"]);
    for r in rs {
        assert_eq!(r["status"], "measured", "{r}");
        let series: Vec<&str> =
            r["measured"]["series"].as_array().unwrap().iter().map(|s| s["name"].as_str().unwrap()).collect();
        assert_eq!(series, ["gold", "bronze"], "{r}");
    }
    let db = |i: usize| &rs[i]["config"]["dynamic_batching"];
    assert_eq!(db(1)["priority_levels"], 2, "{}", db(1));
    assert_eq!(db(1)["default_priority_level"], 2);
    assert!(db(3)["default_queue_policy"].is_null(), "the top level keeps no policy: {}", db(3));
    assert_eq!(db(3)["priority_queue_policy"]["2"]["max_queue_size"], 1, "{}", db(3));
    assert!(db(3)["priority_queue_policy"].get("1").is_none());
    // Gold (priority 1) has no queue limit there: none of its requests is refused.
    let gold = &rs[3]["measured"]["series"][0];
    assert_eq!((gold["name"].as_str(), gold["errors"].as_u64()), (Some("gold"), Some(0)), "{gold}");
    assert!(gold["requests"].as_u64().unwrap() > 0);
    let text = std::fs::read_to_string(out.join("results.csv")).unwrap();
    assert_eq!(csv_cell(&text, 4, "priority_levels"), "2", "{text}");

    // A workload entry for another model is refused before anything starts.
    std::fs::write(&workload, r#"{"entries": [{"model": "mlp_fp32"}]}"#).unwrap();
    let run = analyze(&args);
    assert_eq!(run.code, 2, "{run}");
    assert!(run.stderr.contains("entries[0].model") && run.stderr.contains("not the swept model"), "{run}");
}

#[test]
fn an_unreachable_server_or_a_worker_that_cannot_start_is_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    let m = models();
    // A port nothing listens on: bind one, then free it.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let url = format!("127.0.0.1:{port}");
    let out = dir.path().join("out");
    let run = analyze(&[
        "--model-repository",
        m.to_str().unwrap(),
        "-m",
        "identity_fp32",
        "--url",
        &url,
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(run.code, 2, "{run}");
    assert!(run.stderr.contains("cannot reach") && run.stderr.contains(&url), "{run}");

    let run = analyze(&[
        "--model-repository",
        m.to_str().unwrap(),
        "-m",
        "identity_fp32",
        "--worker-bin",
        "/bin/false",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(run.code, 2, "{run}");
    assert!(run.stderr.contains("cannot start the worker"), "{run}");

    let run = analyze(&["--model-repository", m.to_str().unwrap(), "-m", "no_such_model", "--url", &url]);
    assert_eq!(run.code, 2, "{run}");
    assert!(run.stderr.contains("--model no_such_model"), "{run}");
}

/// A worker in explicit mode started by the test, killed on drop.
struct ExplicitWorker {
    child: Child,
    _dir: tempfile::TempDir,
    grpc: u16,
    http: u16,
    metrics: u16,
}

impl ExplicitWorker {
    fn start(bin: &Path) -> ExplicitWorker {
        let dir = tempfile::tempdir().unwrap();
        let ports_file = dir.path().join("ports.json");
        let child = Command::new(bin)
            .arg("--model-repository")
            .arg(models())
            .args(["--model-control-mode", "explicit", "--address", "127.0.0.1"])
            .args(["--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"])
            .arg("--port-file")
            .arg(&ports_file)
            .env("NEREID_ORT_LIB", ort_lib())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nereid-worker");
        let mut w = ExplicitWorker { child, _dir: dir, grpc: 0, http: 0, metrics: 0 };
        let deadline = Instant::now() + WORKER_START_LIMIT;
        let ports: Value = loop {
            if let Ok(text) = std::fs::read_to_string(&ports_file)
                && let Ok(v) = serde_json::from_str(&text)
            {
                break v;
            }
            if let Ok(Some(status)) = w.child.try_wait() {
                panic!("nereid-worker exited before writing its ports: {status}");
            }
            assert!(Instant::now() < deadline, "nereid-worker wrote no port file within {WORKER_START_LIMIT:?}");
            std::thread::sleep(Duration::from_millis(50));
        };
        let port = |k: &str| ports[k].as_u64().unwrap_or_else(|| panic!("no {k} port in {ports}")) as u16;
        (w.grpc, w.http, w.metrics) = (port("grpc"), port("http"), port("metrics"));
        w
    }
}

impl Drop for ExplicitWorker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn a_server_killed_mid_sweep_keeps_partial_results_and_exits_3() {
    let Some(bin) = worker_binary() else { return };
    let mut worker = ExplicitWorker::start(&bin);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let m = models();
    let (url, pid) = (format!("127.0.0.1:{}", worker.grpc), worker.child.id().to_string());
    let mut args = vec![
        "--model-repository",
        m.to_str().unwrap(),
        "-m",
        "identity_fp32",
        "--url",
        &url,
        "--worker-pid",
        &pid,
        "--no-server-stats",
        "-o",
        out.to_str().unwrap(),
        "--instance-counts",
        "1,2",
        "--max-batch-sizes",
        "8",
        "--max-queue-delays-us",
        "0,100,200,300",
    ];
    args.extend(SHORT);
    // Kill the worker as soon as the first variant is in the checkpoint.
    let checkpoint = out.join("checkpoint.json");
    let mut killed = false;
    let run = analyze_with(&args, || {
        if !killed
            && let Ok(text) = std::fs::read_to_string(&checkpoint)
            && let Ok(v) = serde_json::from_str::<Value>(&text)
            && v["results"].as_array().is_some_and(|r| !r.is_empty())
        {
            let _ = worker.child.kill();
            let _ = worker.child.wait();
            killed = true;
        }
    });
    assert!(killed, "the sweep ended before the first checkpoint was seen: {run}");
    assert_eq!(run.code, 3, "{run}");
    assert!(run.stdout.contains("the server was lost mid-sweep"), "{run}");
    let report = read_json(&out.join("results.json"));
    let first = &rows(&report)[0];
    assert_eq!(first["status"], "measured", "{first}");
    assert!(first["measured"]["memory_mb"].as_f64().unwrap() > 0.0, "--worker-pid gives memory: {first}");
    assert!(rows(&report).len() < 8, "the sweep stopped early");
    let kept = read_json(&checkpoint);
    let kept = kept["results"].as_array().unwrap().clone();
    assert!(!kept.is_empty());
    // What --resume reuses: every final, trusted result (a measurement cut short is retried,
    // and so is one that was not stable: closed loop, so no late sends).
    let reusable: Vec<&Value> =
        kept.iter().filter(|r| r["status"] != "failed" && r["measured"]["stable"] != false).collect();
    assert!(reusable.iter().all(|r| r["status"] == "measured"), "{kept:?}");

    // Resume on a new server: the variants measured before the kill come from the checkpoint,
    // the rest are loaded and measured, and the sweep completes.
    let worker = ExplicitWorker::start(&bin);
    let (url, pid) = (format!("127.0.0.1:{}", worker.grpc), worker.child.id().to_string());
    let mut resumed = args.clone();
    for (flag, value) in [("--url", url.as_str()), ("--worker-pid", pid.as_str())] {
        let i = resumed.iter().position(|a| *a == flag).unwrap();
        resumed[i + 1] = value;
    }
    resumed.push("--resume");
    let run = analyze(&resumed);
    assert_eq!(run.code, 0, "{run}");
    assert_eq!(run.stderr.matches("(from the checkpoint)").count(), reusable.len(), "{run}");
    for r in &reusable {
        let line = format!("{}: measured (from the checkpoint)", r["key"].as_str().unwrap());
        assert_eq!(run.stderr.matches(&line).count(), 1, "{line}: {run}");
    }
    let report = read_json(&out.join("results.json"));
    assert_eq!(report["reused"], reusable.len());
    assert_eq!(report["search_end"], "every variant visited");
    let rs = rows(&report);
    assert_eq!(rs.len(), 8, "the sweep completed: {report}");
    for r in rs {
        assert_eq!(r["status"], "measured", "{r}");
        match reusable.iter().find(|k| k["key"] == r["key"]) {
            // Not measured again: the very numbers of the first run (its worker's memory too).
            Some(before) => assert_eq!(r["measured"], before["measured"], "{r}"),
            None => {
                // Measured by this run: its progress lines, not a reuse.
                let key = r["key"].as_str().unwrap();
                assert!(run.stderr.contains(&format!("] {key}: ")), "{key} was measured: {run}");
                assert!(!run.stderr.contains(&format!("{key}: measured (from the checkpoint)")), "{run}");
            }
        }
    }
    let after = read_json(&checkpoint);
    assert_eq!(after["results"].as_array().unwrap().len(), 8);
    assert!(after["results"].as_array().unwrap().iter().all(|r| r["status"] == "measured"), "{after}");
}

#[test]
fn a_url_sweep_over_tls_and_an_untrusted_ca_is_exit_2() {
    let Some(bin) = worker_binary() else { return };
    let worker = ExplicitWorker::start(&bin);
    let dir = tempfile::tempdir().unwrap();
    let pki = common::TestPki::new(dir.path());
    let grpc = common::TlsProxy::start(worker.grpc, pki.server_config(false));
    let mutual_https = common::TlsProxy::start(worker.http, pki.server_config(true));
    let metrics = common::TlsProxy::start(worker.metrics, pki.server_config(false));
    let (grpc_out, https_out) = (dir.path().join("grpc"), dir.path().join("https"));
    let (m, ca) = (models(), pki.ca.to_str().unwrap().to_string());
    let base = ["--model-repository", m.to_str().unwrap(), "-m", "identity_fp32", "--concurrency", "2"];
    let space = ["--instance-counts", "1", "--max-batch-sizes", "8"];

    // gRPC over TLS (the repository API and the measurement, with perf_analyzer's flag name),
    // /metrics over HTTPS trusting the same CA: 2 variants, loaded and measured.
    let (u, mu) = (format!("localhost:{}", grpc.port), format!("https://localhost:{}/metrics", metrics.port));
    let mut args = base.to_vec();
    args.extend(["-o", grpc_out.to_str().unwrap(), "--url", &u, "--ssl-grpc-root-certifications-file", &ca]);
    args.extend(["--metrics-url", &mu]);
    args.extend(space);
    args.extend(["--max-queue-delays-us", "0,100"]);
    args.extend(SHORT);
    let run = analyze(&args);
    assert_eq!(run.code, 0, "{run}");
    let report = read_json(&grpc_out.join("results.json"));
    assert_eq!(report["url"], format!("https://localhost:{}", grpc.port), "the report says TLS was used");
    let rs = rows(&report);
    assert_eq!(rs.len(), 2, "{report}");
    for r in rs {
        assert_eq!(r["status"], "measured", "{r}");
        assert!(r["measured"]["throughput_infer_per_sec"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["measured"]["server_avg_batch_size"].as_f64().is_some(), "/metrics scraped over HTTPS: {r}");
    }

    // HTTPS from the https:// URL, with a client certificate (mutual TLS): the repository API
    // over HTTPS loads the variant.
    let u = format!("https://localhost:{}", mutual_https.port);
    let (cert, key) = (pki.client_cert.to_str().unwrap(), pki.client_key.to_str().unwrap());
    let mut args = base.to_vec();
    args.extend(["-o", https_out.to_str().unwrap(), "-i", "http", "--url", &u, "--ssl-ca", &ca]);
    args.extend(["--ssl-cert", cert, "--ssl-key", key]);
    args.extend(["--no-server-stats", "--max-queue-delays-us", "0"]);
    args.extend(space);
    args.extend(SHORT);
    let run = analyze(&args);
    assert_eq!(run.code, 0, "{run}");
    let report = read_json(&https_out.join("results.json"));
    assert_eq!(rows(&report).len(), 1, "{report}");
    assert_eq!(rows(&report)[0]["status"], "measured", "{report}");

    // A server certificate the client cannot trust: exit 2 before any variant, saying why.
    let u = format!("localhost:{}", grpc.port);
    let mut args = base.to_vec();
    args.extend(["-o", grpc_out.to_str().unwrap(), "--url", &u, "--ssl-ca", pki.rogue_ca.to_str().unwrap()]);
    let run = analyze(&args);
    assert_eq!(run.code, 2, "{run}");
    assert!(run.stderr.contains(&format!("cannot reach {u}")), "{run}");
    assert!(run.stderr.contains("TLS handshake failed") && run.stderr.contains("UnknownIssuer"), "{run}");
}

#[test]
fn a_sweep_through_shared_memory_starts_its_worker_allowing_it() {
    let Some(worker) = worker_binary() else { return };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let space = ["--instance-counts", "1", "--max-batch-sizes", "8", "--max-queue-delays-us", "0"];
    let args = identity_sweep(&worker, &out, &[&space[..], &["--concurrency", "2", "--shared-memory", "system"]]);
    let run = analyze(&strs(&args));
    assert_eq!(run.code, 0, "{run}");
    let report = read_json(&out.join("results.json"));
    assert_eq!(report["load_description"], "concurrency 2, through shared memory");
    let rs = rows(&report);
    assert_eq!(rs.len(), 1);
    assert_eq!(rs[0]["status"], "measured", "{}", rs[0]);
    assert!(rs[0]["measured"]["throughput_infer_per_sec"].as_f64().unwrap_or(0.0) > 0.0, "{}", rs[0]);
    assert_eq!(rs[0]["measured"]["errors"], 0, "{}", rs[0]);
}

#[test]
fn an_unstable_variant_is_listed_but_never_recommended() {
    let Some(worker) = worker_binary() else { return };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let m = models();
    // A stability band of ±0.0001% over 2 windows: two windows practically never agree that
    // closely, so the measurement is untrustworthy (nereid-perf's exit 5) on every variant.
    let args = [
        "--model-repository",
        m.to_str().unwrap(),
        "-m",
        "identity_fp32",
        "--worker-bin",
        worker.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--instance-counts",
        "1",
        "--max-batch-sizes",
        "8",
        "--max-queue-delays-us",
        "0",
        "--max-p99-ms",
        "5000",
        "--concurrency",
        "2",
        "-p",
        "250",
        "-r",
        "2",
        "-s",
        "0.0001",
        "--warmup-ms",
        "150",
    ];
    let run = analyze(&args);
    assert_eq!(run.code, 5, "it met the constraints, but cannot be trusted: {run}");
    assert!(run.stdout.contains("no trusted variant met the constraints"), "{run}");
    assert!(run.stdout.contains("untrusted: not recommended: no stable measurement"), "{run}");
    let report = read_json(&out.join("results.json"));
    let r = &rows(&report)[0];
    assert_eq!((r["status"].as_str(), r["trusted"].as_bool()), (Some("measured"), Some(false)), "{r}");
    assert_eq!(r["measured"]["stable"], false, "{r}");
    assert!(r["measured"]["throughput_infer_per_sec"].as_f64().unwrap() > 0.0, "its numbers are kept: {r}");
    assert_eq!(r["meets_constraints"], true);
    assert!(report["recommended"].is_null() && report["frontier"].as_array().unwrap().is_empty(), "{report}");
    assert!(!out.join("recommended/config.pbtxt").exists());
    // Still inspectable: its config is written like every variant's.
    parse_model_config(&std::fs::read_to_string(out.join("variants/i1_b8_p0_d0/config.pbtxt")).unwrap()).unwrap();
    // The checkpoint says so too, so a resume does not trust it either.
    let checkpoint = read_json(&out.join("checkpoint.json"));
    assert_eq!(checkpoint["results"][0]["measured"]["stable"], false);
    let csv = std::fs::read_to_string(out.join("results.csv")).unwrap();
    assert_eq!(csv_cell(&csv, 1, "trusted"), "false", "{csv}");

    // The remedy exit 5 suggests works on --resume: the untrusted variant is measured again
    // (here with a band wide enough to be stable), not reused.
    let mut again: Vec<&str> = args.iter().map(|a| if *a == "0.0001" { "1000" } else { a }).collect();
    again.push("--resume");
    let run = analyze(&again);
    assert_eq!(run.code, 0, "measured again, now trusted and recommended: {run}");
    assert!(!format!("{run}").contains("from the checkpoint"), "not reused: {run}");
    let report = read_json(&out.join("results.json"));
    assert_eq!(rows(&report)[0]["trusted"].as_bool(), Some(true), "{report}");
}

#[test]
fn an_open_loop_sweep_with_an_input_data_file_and_an_api_key() {
    let Some(worker) = worker_binary() else { return };
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let data = dir.path().join("data.json");
    let row = |k: f32| serde_json::json!({ "INPUT0": (0..16).map(|i| k + i as f32).collect::<Vec<f32>>() });
    std::fs::write(&data, serde_json::json!({ "data": [row(0.0), row(100.0)] }).to_string()).unwrap();
    let d = data.to_str().unwrap();
    let sweep = [
        "--instance-counts",
        "1",
        "--max-batch-sizes",
        "8",
        "--max-queue-delays-us",
        "0",
        "--request-rate",
        "100",
        "--input-data",
        d,
        "--api-key",
        "k-analyze",
    ];
    let args = identity_sweep(&worker, &out, &[&sweep[..]]);
    let run = analyze(&strs(&args));
    let report = read_json(&out.join("results.json"));
    assert_eq!(report["load"]["input_data"], d, "{}", report["load"]);
    assert!(!std::fs::read_to_string(out.join("results.json")).unwrap().contains("k-analyze"), "no secret written");
    let r = &rows(&report)[0];
    let m = &r["measured"];
    assert_eq!((r["status"].as_str(), &m["errors"]), (Some("measured"), &Value::from(0)), "{r}");
    // Open loop: the sends and how many were late are kept. 100 req/s is little, but a busy
    // (debug-built, shared) machine can still make more than 1% of sends late: then, and only
    // then, the variant is untrusted, not recommended, and the exit is nereid-perf's 5.
    let sends = m["sends"].as_u64().unwrap_or(0);
    assert!(sends > 0, "{r}");
    let late = m["late_sends"].as_u64().unwrap_or(0);
    let kept = late * 100 <= sends;
    assert_eq!(r["trusted"].as_bool(), Some(kept), "{late} of {sends} late: {r}");
    assert_eq!(run.code, if kept { 0 } else { 5 }, "{run}");
    assert_eq!(report["recommended"].is_object(), kept, "{report}");
    assert_eq!(run.stdout.contains("could not keep the schedule"), !kept, "{run}");

    // A file that does not fit the model is refused before the worker starts (exit 2).
    std::fs::write(&data, r#"{"data": [{"INPUT0": [1.0, 2.0]}]}"#).unwrap();
    let run = analyze(&strs(&args));
    assert_eq!(run.code, 2, "{run}");
    assert!(run.stderr.contains("--input-data") && run.stderr.contains("data[0].INPUT0"), "{run}");
    assert!(!run.stderr.contains("starting"), "nothing started: {run}");
    let args = identity_sweep(&worker, &out, &[&["--api-key", "two words"][..]]);
    let run = analyze(&strs(&args));
    assert_eq!(run.code, 2, "{run}");
    assert!(run.stderr.contains("--api-key"), "{run}");
}
