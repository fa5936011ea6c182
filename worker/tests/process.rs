//! The `nereid-worker` binary as users run it: command-line errors, client disconnects over
//! HTTP and gRPC (removed from the queue, counted CANCELED), and graceful drain on SIGTERM.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::process::WorkerProcess;
use common::{TestModel, repo};

const HELD: &str = r#"
name: "m"
max_batch_size: 4
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
dynamic_batching { max_queue_delay_microseconds: 20000000 }
"#;

const INFER_BODY: &str =
    r#"{"inputs":[{"name":"INPUT0","shape":[1,16],"datatype":"FP32","data":[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15]}]}"#;

const PENDING: &str = "nv_inference_pending_request_count{model=\"m\",version=\"1\"}";
const CANCELED: &str = "nv_inference_request_failure{model=\"m\",version=\"1\",reason=\"CANCELED\"}";

fn wait_for(what: &str, worker: &WorkerProcess, mut cond: impl FnMut(&WorkerProcess) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !cond(worker) {
        assert!(Instant::now() < deadline, "timed out waiting for {what}; log:\n{}", worker.log());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `cmd` (the worker, or a shell that execs it) with what every worker started here takes:
/// `repo`, loopback with ephemeral ports written to `port_file`, stderr to `log`.
fn worker_command(
    mut cmd: Command,
    repo: &std::path::Path,
    port_file: &std::path::Path,
    log: &std::path::Path,
) -> Command {
    cmd.arg("--model-repository")
        .arg(repo)
        .args(["--address", "127.0.0.1", "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"])
        .arg("--port-file")
        .arg(port_file)
        .env("NEREID_ORT_LIB", nereid_worker::backend::default_runtime_path())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(log).unwrap());
    cmd
}

/// Runs the binary with `args` (and free ports), bounded: one that fails to refuse its flags
/// fails the test instead of serving on.
fn run_cli(args: &[&str]) -> (i32, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nereid-worker"));
    cmd.args(nereid_common::testing::with_free_ports(args));
    nereid_common::testing::run_bounded(cmd, &format!("nereid-worker {args:?}"), Duration::from_secs(60), || {})
        .code_and_text()
}

#[test]
fn invalid_flags_exit_non_zero_naming_the_flag() {
    let repo = common::example_models();
    let repo = repo.to_str().unwrap();
    let fleet = |extra: &[&'static str]| {
        let mut v = vec!["--model-repository", repo, "--model-control-mode", "explicit", "--http-port", "0"];
        v.extend(["--grpc-port", "0", "--metrics-port", "0", "--etcd-endpoints"]);
        v.extend(extra);
        v
    };
    for (args, flag) in [
        (fleet(&["127.0.0.1:2379"]), "--etcd-endpoints"),
        (fleet(&["http://127.0.0.1:9", "--etcd-prefix", "nereid"]), "--etcd-prefix"),
        (fleet(&["http://127.0.0.1:9", "--label", "novalue"]), "--label"),
        // A label no `nereidctl model declare --selector` could name.
        (fleet(&["http://127.0.0.1:9", "--label", "team=ml infra"]), "--label"),
        (fleet(&["http://127.0.0.1:9", "--worker-id", "a/b"]), "--worker-id"),
    ] {
        let (code, output) = run_cli(&args);
        assert_ne!(code, 0, "{args:?} should fail");
        assert!(output.contains(flag), "{args:?}: output does not name {flag}:\n{output}");
    }
    for (args, flag) in [
        (vec!["--model-repository", repo, "--http-port", "http"], "--http-port"),
        (vec!["--model-repository", repo, "--model-control-mode", "sometimes"], "--model-control-mode"),
        (vec!["--model-repository", repo, "--strict-model-config", "maybe"], "--strict-model-config"),
        (vec!["--model-repository", repo, "--repository-poll-secs", "0"], "--repository-poll-secs"),
        (vec!["--model-repository", repo, "--no-such-flag"], "--no-such-flag"),
        (vec!["--model-repository", repo, "--etcd-endpoints", "http://127.0.0.1:9"], "--etcd-endpoints"),
        (vec!["--model-repository", repo, "--etcd-lease-ttl-secs", "0"], "--etcd-lease-ttl-secs"),
        (vec!["--model-repository", repo, "--cache-config", "redis,host=x", "--http-port", "0"], "--cache-config"),
        (vec!["--model-repository", repo, "--cache-config", "local,size=big", "--http-port", "0"], "--cache-config"),
        (vec!["--http-port", "1"], "--model-repository"),
        (vec!["--model-repository", "/nonexistent/repo", "--http-port", "0"], "--model-repository"),
        (
            vec![
                "--model-repository",
                repo,
                "--load-model",
                "x",
                "--http-port",
                "0",
                "--grpc-port",
                "0",
                "--metrics-port",
                "0",
            ],
            "--load-model",
        ),
        (
            vec!["--model-repository", repo, "--onnxruntime-lib", "/nonexistent/libonnxruntime.so", "--http-port", "0"],
            "--onnxruntime-lib",
        ),
        // tritonserver flags asking for what Nereid lacks are refused, not ignored.
        (vec!["--model-repository", repo, "--grpc-use-ssl=true", "--http-port", "0"], "--grpc-use-ssl"),
        (vec!["--model-repository", repo, "--allow-sagemaker", "--http-port", "0"], "--allow-sagemaker"),
        (vec!["--model-repository", repo, "--model-namespacing=1", "--http-port", "0"], "--model-namespacing"),
        (vec!["--model-repository", repo, "--id="], "--id"),
        (vec!["--model-repository", repo, "--log-format=json"], "--log-format"),
        (vec!["--model-repository", repo, "--log-info=maybe"], "--log-info"),
        (vec!["--model-repository", repo, "--http-address=localhost"], "--http-address"),
        (vec!["--model-repository", repo, "--grpc-keepalive-time=0"], "--grpc-keepalive-time"),
        (vec!["--model-repository", repo, "--http-thread-count=0"], "--http-thread-count"),
        (vec!["--model-repository", repo, "--log-file=/nonexistent/dir/worker.log"], "--log-file"),
        (vec!["--model-repository", repo, "--backend-config=nonsense"], "--backend-config"),
        (vec!["--model-repository", repo, "--backend-config=default-max-batch-size=-1"], "--backend-config"),
        (vec!["--model-repository", repo, "--model-config-name=a/b"], "--model-config-name"),
        (vec!["--model-repository", repo, "--http-max-input-size=1"], "--http-max-input-size"),
        (vec!["--model-repository", repo, "--rate-limit=execution_count"], "--rate-limit"),
        (vec!["--model-repository", repo, "--trace-config=level=TIMESTAMPS"], "--trace-config"),
        (vec!["--model-repository", repo, "--trace-level=TENSORS"], "--trace-level"),
        (vec!["--model-repository", repo, "--http-restricted-api=inferense:k=v"], "--http-restricted-api"),
        (
            vec![
                "--model-repository",
                repo,
                "--grpc-restricted-protocol=health:k=v",
                "--grpc-restricted-protocol=health:j=w",
            ],
            "--grpc-restricted-protocol",
        ),
        (vec!["--model-repository", repo, "--grpc-infer-response-compression-level=max"], "compression-level"),
        (vec!["--model-repository", repo, "--max-queued-bytes=1048576"], "--max-queued-bytes"),
    ] {
        let (code, output) = run_cli(&args);
        assert_ne!(code, 0, "{args:?} should fail");
        assert!(output.contains(flag), "{args:?}: output does not name {flag}:\n{output}");
    }
    let (code, help) = run_cli(&["--help"]);
    assert_eq!(code, 0);
    for flag in [
        "--model-repository",
        "--http-port",
        "--grpc-port",
        "--metrics-port",
        "--model-control-mode",
        "--load-model",
        "--repository-poll-secs",
        "--strict-model-config",
        "--log-verbose",
        "--onnxruntime-lib",
        "--max-request-bytes",
    ] {
        assert!(help.contains(flag), "--help lacks {flag}");
    }
}

/// A tritonserver command line as deployments write it (KServe ModelMesh's Triton runtime
/// passes the keep-alive and SageMaker flags below; `True` as its spelling of a boolean) starts
/// the worker unchanged: the flags with a counterpart take effect, the others are named in a
/// warning.
#[test]
fn a_tritonserver_command_line_starts_the_worker() {
    let repo = common::example_models();
    let dir = tempfile::tempdir().unwrap();
    let log_file = dir.path().join("triton.log");
    let log_arg = format!("--log-file={}", log_file.display());
    let worker = WorkerProcess::start(
        &repo,
        &[
            // tritonserver lowercases these values: scripts write them either way.
            "--model-control-mode=EXPLICIT",
            "--load-model=identity_fp32",
            "--strict-model-config=false",
            "--strict-readiness=false",
            "--allow-http=true",
            "--allow-sagemaker=false",
            "--grpc-keepalive-time=10000",
            "--grpc-keepalive-timeout=999999999",
            "--grpc-keepalive-permit-without-calls=True",
            "--grpc-http2-max-pings-without-data=0",
            "--grpc-http2-min-recv-ping-interval-without-data=5000",
            "--grpc-http2-max-ping-strikes=0",
            "--model-load-thread-count=4",
            "--http-thread-count=2",
            "--pinned-memory-pool-byte-size=268435456",
            "--id=triton-a",
            "--log-info=false",
            "--log-format=ISO8601",
            &log_arg,
            "--http-address=127.0.0.1",
            "--backend-config=onnxruntime,default-max-batch-size=8",
            "--backend-config=python,shm-default-byte-size=1048576",
            "--model-config-name=h100",
            "--http-max-input-size=1048576",
            "--rate-limit=OFF",
            "--buffer-manager-thread-count=2",
            "--trace-config=rate=100",
            "--trace-level=false",
            "--grpc-infer-response-compression-level=NONE",
            "--metrics-config=summary_latencies=true",
            "--model-load-retry-count=2",
            "--response-cache-byte-size=1048576",
        ],
    );
    let (status, body) = worker.http_get("/v2");
    assert_eq!(status, 200, "{body}");
    let metadata: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(metadata["name"], "triton-a");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let url = format!("http://127.0.0.1:{}", worker.grpc);
    let name = rt.block_on(async move {
        use nereid_proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
        let mut client = GrpcInferenceServiceClient::connect(url).await.unwrap();
        client.server_metadata(nereid_proto::inference::ServerMetadataRequest {}).await.unwrap().into_inner().name
    });
    assert_eq!(name, "triton-a");
    assert_eq!(
        worker.http_request(worker.http, "POST", "/v2/models/identity_fp32/infer", INFER_BODY.as_bytes()).0,
        200
    );

    // The logging extension reports what the flags set.
    let (status, body) = worker.http_get("/v2/logging");
    assert_eq!(status, 200, "{body}");
    let settings: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(settings["log_file"], log_file.display().to_string());
    assert_eq!(settings["log_info"], false);
    // The log went to the file: the warnings naming each flag that changes nothing here (and
    // not those set to what Nereid does anyway), and no INFO line.
    let text = std::fs::read_to_string(&log_file).unwrap();
    for flag in [
        "--pinned-memory-pool-byte-size",
        "--grpc-http2-min-recv-ping-interval-without-data",
        "--backend-config python,shm-default-byte-size=1048576",
        "--buffer-manager-thread-count",
        "--trace-*",
        "--metrics-config",
        "--model-load-retry-count",
    ] {
        assert!(text.contains(&format!("{flag} has no effect")), "no warning for {flag}:\n{text}");
    }
    for flag in [
        "--grpc-http2-max-ping-strikes",
        "--grpc-keepalive-permit-without-calls",
        "--allow-sagemaker",
        "--model-load-thread-count",
        "--http-thread-count",
        "--rate-limit",
        "--grpc-infer-response-compression-level",
        "default-max-batch-size",
    ] {
        assert!(!text.contains(flag), "{flag} is what Nereid does:\n{text}");
    }
    // tritonserver's ISO8601 lines, and no INFO line (--log-info=false).
    let pid = worker.child.id();
    for line in text.lines() {
        let (stamp, rest) = line.split_at_checked(21).unwrap_or_else(|| panic!("{line}"));
        assert!(stamp.len() == 21 && &stamp[10..11] == "T" && stamp.ends_with("Z "), "{line}");
        assert!(rest.starts_with(&format!("W {pid} ")) || rest.starts_with(&format!("E {pid} ")), "{line}");
    }

    // --backend-config=onnxruntime,default-max-batch-size: what auto-complete gives a model
    // that can batch; --model-config-name falls back to config.pbtxt where configs/ lacks it.
    let load = worker.http_request(worker.http, "POST", "/v2/repository/models/autocomplete_add/load", b"{}");
    assert_eq!(load.0, 200, "{}", load.1);
    let (_, config) = worker.http_get("/v2/models/autocomplete_add/config");
    let config: serde_json::Value = serde_json::from_str(&config).unwrap();
    assert_eq!(config["max_batch_size"], 8, "{config}");
    let (_, config) = worker.http_get("/v2/models/identity_fp32/config");
    assert_eq!(serde_json::from_str::<serde_json::Value>(&config).unwrap()["max_batch_size"], 64, "config.pbtxt");
    // --http-max-input-size bounds HTTP bodies.
    let big = vec![b' '; 2 << 20];
    let (status, body) = worker.http_request(worker.http, "POST", "/v2/models/identity_fp32/infer", &big);
    assert!(status == 413 || status == 400, "{status}: {body}");
    assert!(body.contains("1048576"), "{body}");

    // log_format changes at run time: a load's INFO lines come in tritonserver's default format.
    let body = br#"{"log_format": "default", "log_info": true}"#;
    assert_eq!(worker.http_request(worker.http, "POST", "/v2/logging", body).0, 200);
    let load = worker.http_request(worker.http, "POST", "/v2/repository/models/mlp_fp32/load", b"{}");
    assert_eq!(load.0, 200, "{}", load.1);
    let text = std::fs::read_to_string(&log_file).unwrap();
    let ready = text.lines().find(|l| l.contains("model ready") && l.contains("mlp_fp32")).expect(&text);
    // I1124 02:31:44.123456 4242 repository.rs:NNN] model ready model=mlp_fp32
    let (stamp, rest) = ready.split_at_checked(22).unwrap_or_else(|| panic!("{ready}"));
    assert!(stamp.starts_with('I') && &stamp[5..6] == " " && &stamp[14..15] == ".", "{ready}");
    assert!(rest.starts_with(&format!("{pid} ")) && rest.contains(".rs:"), "{ready}");
}

/// Triton's host metrics: `nv_cpu_utilization` and the memory pair, sane on this host, and
/// gone with `--allow-cpu-metrics=false`.
#[test]
fn host_cpu_metrics_carry_tritons_names_and_can_be_turned_off() {
    let repo = common::example_models();
    let worker = WorkerProcess::start(&repo, &["--model-control-mode=explicit", "--metrics-interval-ms=1"]);
    let total = worker.metric("nv_cpu_memory_total_bytes").expect("nv_cpu_memory_total_bytes");
    let used = worker.metric("nv_cpu_memory_used_bytes").expect("nv_cpu_memory_used_bytes");
    assert!(total > 0.0 && used > 0.0 && used <= total, "{used} of {total}");
    // Utilization needs some CPU time to have passed between two readings.
    wait_for("nv_cpu_utilization", &worker, |w| w.metric("nv_cpu_utilization").is_some());
    let utilization = worker.metric("nv_cpu_utilization").unwrap();
    assert!((0.0..=1.0).contains(&utilization), "{utilization}");
    assert!(worker.metrics_text().contains("# TYPE nv_cpu_utilization gauge"));

    let off = WorkerProcess::start(
        &repo,
        &["--model-control-mode=explicit", "--allow-cpu-metrics=false", "--allow-gpu-metrics=false"],
    );
    let text = off.metrics_text();
    assert!(!text.contains("nv_cpu_") && !text.contains("nv_gpu_"), "{text}");
}

#[test]
fn http_client_disconnect_cancels_the_queued_request() {
    use std::io::Write;
    let dir = repo(&[TestModel { name: "m", source: "identity_fp32", config: Some(HELD) }]);
    let worker = WorkerProcess::start(dir.path(), &[]);
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", worker.http)).unwrap();
    write!(
        conn,
        "POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{INFER_BODY}",
        INFER_BODY.len()
    )
    .unwrap();
    wait_for("the request to queue", &worker, |w| w.metric(PENDING) == Some(1.0));
    drop(conn);
    wait_for("the cancelled request to leave the queue", &worker, |w| {
        w.metric(PENDING) == Some(0.0) && w.metric(CANCELED) == Some(1.0)
    });
    // The model still serves everyone else.
    let (status, body) = worker.http_request(worker.http, "POST", "/v2/models/m/infer", br#"{"inputs":[{"name":"INPUT0","shape":[4,16],"datatype":"FP32","data":[0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15]}]}"#);
    assert_eq!(status, 200, "{body}");
}

#[test]
fn grpc_client_cancel_removes_the_queued_request() {
    use nereid_proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
    use nereid_proto::inference::{ModelInferRequest, model_infer_request::InferInputTensor};
    let dir = repo(&[TestModel { name: "m", source: "identity_fp32", config: Some(HELD) }]);
    let worker = WorkerProcess::start(dir.path(), &[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let url = format!("http://127.0.0.1:{}", worker.grpc);
    let call = rt.spawn(async move {
        let mut client = GrpcInferenceServiceClient::connect(url).await.unwrap();
        client
            .model_infer(ModelInferRequest {
                model_name: "m".into(),
                inputs: vec![InferInputTensor {
                    name: "INPUT0".into(),
                    datatype: "FP32".into(),
                    shape: vec![1, 16],
                    ..Default::default()
                }],
                raw_input_contents: vec![vec![0u8; 64].into()],
                ..Default::default()
            })
            .await
    });
    wait_for("the request to queue", &worker, |w| w.metric(PENDING) == Some(1.0));
    call.abort();
    wait_for("the cancelled request to leave the queue", &worker, |w| {
        w.metric(PENDING) == Some(0.0) && w.metric(CANCELED) == Some(1.0)
    });
}

#[test]
fn sigterm_drains_in_flight_requests_then_exits() {
    let cfg = HELD.replace("20000000", "300000");
    let dir = repo(&[TestModel { name: "m", source: "identity_fp32", config: Some(&cfg) }]);
    let mut worker = WorkerProcess::start(dir.path(), &[]);
    let port = worker.http;
    let in_flight = std::thread::spawn(move || {
        let probe = WorkerProcessProbe { port };
        probe.post(INFER_BODY)
    });
    wait_for("the request to queue", &worker, |w| w.metric(PENDING) == Some(1.0));
    let status = Command::new("kill").args(["-TERM", &worker.child.id().to_string()]).status().unwrap();
    assert!(status.success());
    let (code, body) = in_flight.join().unwrap();
    assert_eq!(code, 200, "the in-flight request must complete during drain: {body}");
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(exit) = worker.child.try_wait().unwrap() {
            assert!(exit.success(), "worker exit status {exit}: {}", worker.log());
            break;
        }
        assert!(Instant::now() < deadline, "worker did not exit after SIGTERM: {}", worker.log());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// While the worker drains (its listeners closed, a request held in the queue), `/metrics`
/// still answers; a second SIGTERM then exits at once (status 143) instead of waiting for it.
#[test]
fn metrics_answer_while_draining_and_a_second_sigterm_exits_at_once() {
    let dir = repo(&[TestModel { name: "m", source: "identity_fp32", config: Some(HELD) }]);
    let mut worker = WorkerProcess::start(dir.path(), &[]);
    let port = worker.http;
    let _held = std::thread::spawn(move || WorkerProcessProbe { port }.post(INFER_BODY));
    wait_for("the request to queue", &worker, |w| w.metric(PENDING) == Some(1.0));
    let term = |pid: u32| assert!(Command::new("kill").args(["-TERM", &pid.to_string()]).status().unwrap().success());
    term(worker.child.id());
    // Intake stopped: the HTTP port refuses new connections.
    wait_for("the HTTP listener to close", &worker, |w| std::net::TcpStream::connect(("127.0.0.1", w.http)).is_err());
    assert_eq!(worker.metric(PENDING), Some(1.0), "metrics answer during the drain: {}", worker.log());
    term(worker.child.id());
    // Well before the request's 20 s hold (and the 30 s exit timeout) is over.
    let deadline = Instant::now() + Duration::from_secs(10);
    let exit = loop {
        if let Some(exit) = worker.child.try_wait().unwrap() {
            break exit;
        }
        assert!(Instant::now() < deadline, "a second SIGTERM did not end the drain: {}", worker.log());
        std::thread::sleep(Duration::from_millis(10));
    };
    assert_eq!(exit.code(), Some(143), "{}", worker.log());
}

/// SIGTERM while a model is still being built (its warm-up here takes minutes): the worker
/// exits within its exit timeout instead of waiting for the build, which cannot be interrupted.
#[test]
fn sigterm_during_a_long_start_up_build_exits_without_waiting_for_it() {
    let warmup = "model_warmup [ { name: \"slow\" batch_size: 32 count: 10000 inputs { key: \"INPUT0\" \
                  value: { data_type: TYPE_FP32 dims: [ 3, 64, 64 ] zero_data: true } } } ]";
    let config = format!(
        "name: \"slow\"\nmax_batch_size: 32\n\
         input [ {{ name: \"INPUT0\" data_type: TYPE_FP32 dims: [ 3, 64, 64 ] }} ]\n\
         output [ {{ name: \"OUTPUT0\" data_type: TYPE_FP32 dims: [ 10 ] }} ]\n\
         instance_group [ {{ count: 1 kind: KIND_CPU }} ]\n{}\n",
        [warmup; 3].join("\n")
    );
    let dir = repo(&[TestModel { name: "slow", source: "convnet_fp32", config: Some(&config) }]);
    let work = tempfile::tempdir().unwrap();
    let port_file = work.path().join("ports.json");
    let log = work.path().join("worker.log");
    let mut child = worker_command(Command::new(env!("CARGO_BIN_EXE_nereid-worker")), dir.path(), &port_file, &log)
        .args(["--exit-timeout-secs", "2"])
        .spawn()
        .unwrap();
    let log = || std::fs::read_to_string(&log).unwrap_or_default();
    // The ports are written before the models load; the build is under way once the index
    // says the model is loading.
    let loading = || {
        let Ok(text) = std::fs::read_to_string(&port_file) else { return false };
        let Ok(ports) = serde_json::from_str::<serde_json::Value>(&text) else { return false };
        let Some(port) = ports["http"].as_u64() else { return false };
        let (status, body) = http_post(port as u16, "/v2/repository/index");
        status == 200 && body.contains("LOADING")
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !loading() {
        assert!(child.try_wait().unwrap().is_none(), "worker exited: {}", log());
        assert!(Instant::now() < deadline, "worker never started loading: {}", log());
        std::thread::sleep(Duration::from_millis(10));
    }
    let status = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    assert!(status.success());
    // Far below the warm-up's minutes (30,000 runs of a batch of 32 convolutions).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Some(exit) = child.try_wait().unwrap() {
            assert!(exit.success(), "worker exit status {exit}: {}", log());
            assert!(!log().contains("model repository loaded"), "the warm-up finished first: {}", log());
            break;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            panic!("worker did not exit after SIGTERM while building: {}", log());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A POST without a body on a fresh connection: (status, body).
fn http_post(port: u16, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else { return (0, String::new()) };
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let head = format!("POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    let _ = s.write_all(head.as_bytes());
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    let status = out.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, out.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default())
}

/// Sends one request on its own connection (used from another thread).
struct WorkerProcessProbe {
    port: u16,
}

impl WorkerProcessProbe {
    fn post(&self, body: &str) -> (u16, String) {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(
            s,
            "POST /v2/models/m/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        let code = out.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        (code, out)
    }
}

#[test]
fn responses_report_the_queue_in_band() {
    use nereid_proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
    use nereid_proto::inference::{ModelInferRequest, model_infer_request::InferInputTensor};
    let fast = HELD.replace("\"m\"", "\"fast\"").replace("20000000", "0");
    let dir = repo(&[
        TestModel { name: "m", source: "identity_fp32", config: Some(HELD) },
        TestModel { name: "fast", source: "identity_fp32", config: Some(&fast) },
    ]);
    let worker = WorkerProcess::start(dir.path(), &[]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let request = |model: &str| ModelInferRequest {
        model_name: model.into(),
        inputs: vec![InferInputTensor {
            name: "INPUT0".into(),
            datatype: "FP32".into(),
            shape: vec![1, 16],
            ..Default::default()
        }],
        raw_input_contents: vec![vec![0u8; 64].into()],
        ..Default::default()
    };
    let url = format!("http://127.0.0.1:{}", worker.grpc);
    let queue_header = |url: String, req: ModelInferRequest| async move {
        let mut client = GrpcInferenceServiceClient::connect(url).await.unwrap();
        let resp = client.model_infer(req).await.unwrap();
        resp.metadata().get("nereid-queue").map(|v| v.to_str().unwrap().to_string())
    };
    assert_eq!(rt.block_on(queue_header(url.clone(), request("fast"))).as_deref(), Some("0"));

    // One request held in m's queue: every response now reports it.
    let held = rt.spawn(queue_header(url.clone(), request("m")));
    wait_for("the request to queue", &worker, |w| w.metric(PENDING) == Some(1.0));
    assert_eq!(rt.block_on(queue_header(url.clone(), request("fast"))).as_deref(), Some("1"));
    // An error answer reports it too (a worker answering mostly errors must not look idle).
    let error_queue = rt.block_on(async {
        let mut client = GrpcInferenceServiceClient::connect(url).await.unwrap();
        let mut bad = request("fast");
        bad.inputs[0].shape = vec![1, 15];
        let status = client.model_infer(bad).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        status.metadata().get("nereid-queue").map(|v| v.to_str().unwrap().to_string())
    });
    assert_eq!(error_queue.as_deref(), Some("1"));
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", worker.http)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let head = format!(
        "POST /v2/models/fast/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{INFER_BODY}",
        INFER_BODY.len()
    );
    s.write_all(head.as_bytes()).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    assert!(out.to_ascii_lowercase().contains("\r\nnereid-queue: 1\r\n"), "{out}");
    held.abort();
}

/// Failures are counted (in `/metrics` and the statistics alike) against the model version that
/// served — or, when the request named none, the latest READY version it resolved to — over
/// HTTP and gRPC alike. A request that fails before any version is resolved (unknown or
/// unloaded model, a version that does not exist, a malformed request) is counted against no
/// version, as Triton does: no series with an empty version, none for a model not loaded.
#[test]
fn failures_count_against_the_resolved_version_only() {
    use nereid_proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
    use nereid_proto::inference::{ModelInferRequest, ModelStatisticsRequest, model_infer_request::InferInputTensor};
    let config = |name: &str| {
        format!(
            "name: \"{name}\"\nmax_batch_size: 4\n\
             input [ {{ name: \"INPUT0\" data_type: TYPE_FP32 dims: [ 16 ] }} ]\n\
             output [ {{ name: \"OUTPUT0\" data_type: TYPE_FP32 dims: [ 16 ] }} ]\n"
        )
    };
    let (m, gone, never) = (config("m"), config("gone"), config("never"));
    let dir = repo(&[
        TestModel { name: "m", source: "identity_fp32", config: Some(&m) },
        TestModel { name: "gone", source: "identity_fp32", config: Some(&gone) },
        TestModel { name: "never", source: "identity_fp32", config: Some(&never) },
    ]);
    let explicit = ["--model-control-mode", "explicit", "--load-model", "m", "--load-model", "gone"];
    let worker = WorkerProcess::start(dir.path(), &explicit);
    let (status, body) = worker.http_request(worker.http, "POST", "/v2/repository/models/gone/unload", b"{}");
    assert_eq!(status, 200, "{body}");

    let rt = tokio::runtime::Runtime::new().unwrap();
    let url = format!("http://127.0.0.1:{}", worker.grpc);
    let grpc = |model: &str, version: &str, datatype: &str, raw: Vec<Vec<u8>>| {
        let request = ModelInferRequest {
            model_name: model.into(),
            model_version: version.into(),
            inputs: vec![InferInputTensor {
                name: "INPUT0".into(),
                datatype: datatype.into(),
                shape: vec![1, 16],
                ..Default::default()
            }],
            raw_input_contents: raw.into_iter().map(Into::into).collect(),
            ..Default::default()
        };
        let url = url.clone();
        rt.block_on(async move { GrpcInferenceServiceClient::connect(url).await.unwrap().model_infer(request).await })
    };
    let http = |path: &str, body: &str| worker.http_request(worker.http, "POST", path, body.as_bytes());
    let int32_body = INFER_BODY.replace("FP32", "INT32");

    // Resolved (m's latest version, 1), then rejected by the model's input check: counted.
    assert_eq!(http("/v2/models/m/infer", &int32_body).0, 400);
    assert_eq!(grpc("m", "", "INT32", vec![vec![0; 64]]).unwrap_err().code(), tonic::Code::InvalidArgument);
    // Malformed before any model is looked at, a version that does not exist, a model not
    // loaded (unloaded, or never loaded), an unknown one: counted nowhere.
    for (path, body) in [
        ("/v2/models/m/infer", "{not json"),
        ("/v2/models/m/versions/7/infer", INFER_BODY),
        ("/v2/models/gone/infer", INFER_BODY),
        ("/v2/models/never/infer", INFER_BODY),
        ("/v2/models/nope/infer", INFER_BODY),
    ] {
        let (status, answer) = http(path, body);
        assert!((400..500).contains(&status) || status == 503, "{path}: {status} {answer}");
    }
    assert!(grpc("m", "", "FP32", vec![vec![0; 64], vec![0; 64]]).is_err());
    for (model, version) in [("m", "7"), ("gone", ""), ("never", ""), ("nope", "")] {
        assert!(grpc(model, version, "FP32", vec![vec![0; 64]]).is_err(), "{model} {version}");
    }
    // And one success, counted against version 1 too.
    assert_eq!(http("/v2/models/m/infer", INFER_BODY).0, 200);

    let text = worker.metrics_text();
    let series: Vec<&str> = text.lines().filter(|l| l.starts_with("nv_inference_request_")).collect();
    assert!(series.contains(&"nv_inference_request_failure{model=\"m\",version=\"1\",reason=\"OTHER\"} 2"), "{text}");
    assert!(series.contains(&"nv_inference_request_success{model=\"m\",version=\"1\"} 1"), "{text}");
    assert!(
        series
            .iter()
            .all(|l| l.starts_with("nv_inference_request_duration_us") || l.contains("model=\"m\",version=\"1\"")),
        "{series:#?}"
    );
    assert!(!text.contains("version=\"\""), "{text}");
    for model in ["gone", "never", "nope"] {
        assert!(!text.contains(&format!("model=\"{model}\"")), "{text}");
    }

    // The statistics agree, over both protocols; a model not loaded has none.
    let (status, body) = worker.http_get("/v2/models/m/stats");
    assert_eq!(status, 200, "{body}");
    let stats: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(stats["model_stats"].as_array().unwrap().len(), 1, "{stats}");
    assert_eq!(stats["model_stats"][0]["version"], "1");
    assert_eq!(stats["model_stats"][0]["inference_stats"]["fail"]["count"], 2);
    assert_eq!(stats["model_stats"][0]["inference_stats"]["success"]["count"], 1);
    let all = rt.block_on(async {
        let mut client = GrpcInferenceServiceClient::connect(url.clone()).await.unwrap();
        client.model_statistics(ModelStatisticsRequest::default()).await.unwrap().into_inner()
    });
    let rows: Vec<(String, String, u64)> = all
        .model_stats
        .iter()
        .map(|s| (s.name.clone(), s.version.clone(), s.inference_stats.as_ref().unwrap().fail.as_ref().unwrap().count))
        .collect();
    assert_eq!(rows, vec![("m".to_string(), "1".to_string(), 2)]);
    assert_ne!(worker.http_get("/v2/models/gone/stats").0, 200);
}

/// A load whose caller goes away (here: its gRPC deadline passes, and the server drops the
/// call) still runs to its end: the model becomes READY instead of staying LOADING for good.
#[test]
fn a_load_whose_caller_goes_away_still_finishes() {
    let (dir, mut gate) = common::gated_repo();
    let worker = WorkerProcess::start(dir.path(), &["--model-control-mode=explicit"]);
    let state = |w: &WorkerProcess| {
        let (_, body) = w.http_request(w.http, "POST", "/v2/repository/index", b"{}");
        let index: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
        let row = index.as_array().and_then(|rows| rows.iter().find(|r| r["name"] == "a_gated").cloned());
        row.and_then(|r| r["state"].as_str().map(str::to_string)).unwrap_or_default()
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let url = format!("http://127.0.0.1:{}", worker.grpc);
    let status = rt.block_on(async move {
        use nereid_proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
        let mut client = GrpcInferenceServiceClient::connect(url).await.unwrap();
        let mut request = tonic::Request::new(nereid_proto::inference::RepositoryModelLoadRequest {
            model_name: "a_gated".into(),
            ..Default::default()
        });
        request.set_timeout(Duration::from_millis(300));
        client.repository_model_load(request).await.expect_err("the load cannot finish before the gate opens")
    });
    assert!(
        matches!(status.code(), tonic::Code::DeadlineExceeded | tonic::Code::Cancelled),
        "{status:?}; log:\n{}",
        worker.log()
    );
    assert_eq!(state(&worker), "LOADING");
    gate.open();
    wait_for("a_gated READY", &worker, |w| state(w) == "READY");
}

/// `--grpc-infer-response-compression-level` other than none: a client that accepts gzip gets
/// gzipped responses (and the same answer); without the flag, none is compressed.
#[test]
fn grpc_responses_are_compressed_when_asked() {
    let repo = common::example_models();
    let encoding = |extra: &[&str]| {
        let mut args = vec!["--model-control-mode=explicit", "--load-model=identity_fp32"];
        args.extend_from_slice(extra);
        let worker = WorkerProcess::start(&repo, &args);
        let url = format!("http://127.0.0.1:{}", worker.grpc);
        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async move {
            use nereid_proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
            let client = GrpcInferenceServiceClient::connect(url).await.unwrap();
            let mut client = client.accept_compressed(tonic::codec::CompressionEncoding::Gzip);
            let response = client
                .model_config(nereid_proto::inference::ModelConfigRequest {
                    name: "identity_fp32".into(),
                    ..Default::default()
                })
                .await
                .unwrap();
            let encoding = response.metadata().get("grpc-encoding").map(|v| v.to_str().unwrap().to_string());
            assert_eq!(response.into_inner().config.unwrap().name, "identity_fp32");
            encoding
        })
    };
    assert_eq!(encoding(&["--grpc-infer-response-compression-level=high"]).as_deref(), Some("gzip"));
    assert_eq!(encoding(&[]), None);
}

/// A worker started with a low soft limit on open files (1024 under systemd and many container
/// runtimes) raises it to the hard limit at start: every connection and shared-memory region
/// holds a descriptor.
#[test]
fn the_worker_raises_its_open_files_limit_to_the_hard_limit() {
    let (_, hard) = nereid_common::limits::open_files_limits_of(std::process::id()).expect("/proc/self/limits");
    if hard <= 256 {
        eprintln!("skipped: the hard open-files limit here is {hard}, no lower soft limit to start from");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let port_file = dir.path().join("ports.json");
    let log = dir.path().join("worker.log");
    /// Killed however the test ends.
    struct Killed(std::process::Child);
    impl Drop for Killed {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    // `exec`: the shell becomes the worker, so the child's pid is the worker's.
    let mut child = Killed(
        worker_command(
            {
                let mut shell = Command::new("sh");
                shell.args(["-c", "ulimit -S -n 256 && exec \"$0\" \"$@\"", env!("CARGO_BIN_EXE_nereid-worker")]);
                shell
            },
            dir.path(),
            &port_file,
            &log,
        )
        .spawn()
        .unwrap(),
    );
    let said = || std::fs::read_to_string(&log).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !port_file.is_file() {
        assert!(child.0.try_wait().unwrap().is_none(), "the worker exited before it listened: {}", said());
        assert!(Instant::now() < deadline, "the worker did not write its port file: {}", said());
        std::thread::sleep(Duration::from_millis(10));
    }
    let limits = nereid_common::limits::open_files_limits_of(child.0.id());
    assert_eq!(limits, Some((hard, hard)), "{}", said());
}

/// Bodies that are only settings (repository index, unload, log settings) are bounded by
/// `SMALL_BODY_BYTES`, not the request limit: 400, and the worker goes on serving.
#[test]
fn settings_bodies_are_bounded_small() {
    let repo = common::example_models();
    let worker = WorkerProcess::start(&repo, &["--model-control-mode=explicit", "--load-model=identity_fp32"]);
    let big = format!(r#"{{"ready": true, "pad": "{}"}}"#, "x".repeat(nereid_worker::http::SMALL_BODY_BYTES));
    for path in ["/v2/repository/index", "/v2/logging", "/v2/repository/models/identity_fp32/unload"] {
        let (status, body) = worker.http_request(worker.http, "POST", path, big.as_bytes());
        assert_eq!(status, 400, "{path}: {body}");
        assert!(body.contains("exceeds the limit of 65536 bytes"), "{path}: {body}");
    }
    let (status, body) = worker.http_request(worker.http, "POST", "/v2/repository/index", br#"{"ready": true}"#);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("identity_fp32"), "the refused unload unloaded nothing: {body}");
}

/// A request listing more tensors than any model has, or a shape of absurd rank, is refused
/// before it is built (gRPC: before prost decodes it), over both protocols, naming the bound;
/// the worker goes on serving.
#[test]
fn requests_past_the_entry_bounds_are_refused_over_both_protocols() {
    use nereid_proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
    use nereid_proto::inference::{ModelInferRequest, model_infer_request::InferInputTensor};
    let repo = common::example_models();
    let worker = WorkerProcess::start(&repo, &["--model-control-mode=explicit", "--load-model=identity_fp32"]);
    let input = |shape: Vec<i64>| InferInputTensor {
        name: "INPUT0".into(),
        datatype: "FP32".into(),
        shape,
        ..Default::default()
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let url = format!("http://127.0.0.1:{}", worker.grpc);
    let grpc = |inputs: Vec<InferInputTensor>, raw: Vec<Vec<u8>>| {
        let request = ModelInferRequest {
            model_name: "identity_fp32".into(),
            inputs,
            raw_input_contents: raw.into_iter().map(Into::into).collect(),
            ..Default::default()
        };
        let url = url.clone();
        rt.block_on(async move { GrpcInferenceServiceClient::connect(url).await.unwrap().model_infer(request).await })
    };
    for (inputs, reason) in [
        (vec![InferInputTensor::default(); 5000], "at most 4096 inputs"),
        (vec![input(vec![1; 100_000])], "inputs[0]: shape has more than 64 dimensions"),
    ] {
        let e = grpc(inputs, vec![]).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains(reason), "{e:?}");
    }
    let many = vec!["{}"; 5000].join(",");
    let (status, body) = worker.http_request(
        worker.http,
        "POST",
        "/v2/models/identity_fp32/infer",
        format!(r#"{{"inputs":[{many}]}}"#).as_bytes(),
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("at most 4096 inputs"), "{body}");
    // On a stream, a refused request is answered in its place and the stream goes on.
    let stream = vec![
        ModelInferRequest {
            model_name: "identity_fp32".into(),
            id: "too-many".into(),
            inputs: vec![InferInputTensor::default(); 5000],
            ..Default::default()
        },
        ModelInferRequest {
            model_name: "identity_fp32".into(),
            id: "good".into(),
            inputs: vec![input(vec![1, 16])],
            raw_input_contents: vec![vec![0u8; 64].into()],
            ..Default::default()
        },
    ];
    let replies: Vec<_> = rt.block_on(async {
        let mut client = GrpcInferenceServiceClient::connect(url.clone()).await.unwrap();
        let replies = client.model_stream_infer(futures::stream::iter(stream)).await.unwrap().into_inner();
        futures::StreamExt::collect::<Vec<_>>(replies).await
    });
    let replies: Vec<_> = replies.into_iter().map(|r| r.expect("the stream goes on")).collect();
    assert_eq!(replies.len(), 2, "{replies:?}");
    assert!(replies[0].error_message.contains("at most 4096 inputs"), "{:?}", replies[0]);
    assert_eq!(replies[0].infer_response.as_ref().unwrap().id, "too-many");
    assert_eq!(replies[1].error_message, "");
    assert_eq!(replies[1].infer_response.as_ref().unwrap().id, "good");
    // Still serving, over both.
    let reply = grpc(vec![input(vec![1, 16])], vec![vec![0; 64]]).expect("a good request after the refused ones");
    assert_eq!(reply.into_inner().raw_output_contents[0].len(), 64);
    let (status, body) =
        worker.http_request(worker.http, "POST", "/v2/models/identity_fp32/infer", INFER_BODY.as_bytes());
    assert_eq!(status, 200, "{body}");
}

/// Compressed gRPC requests (tritonclient's `compression_algorithm`), unary and on a stream:
/// answered as plain ones, bounded once inflated (RESOURCE_EXHAUSTED, and the worker serves
/// on). They inflate off the async threads (`grpc::inflate`, whose unit tests show that).
#[test]
fn compressed_grpc_requests_are_served_and_bounded_once_inflated() {
    use nereid_proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
    use nereid_proto::inference::{ModelInferRequest, model_infer_request::InferInputTensor};
    use tonic::codec::CompressionEncoding;
    let repo = common::example_models();
    let worker = WorkerProcess::start(
        &repo,
        &["--model-control-mode=explicit", "--load-model=identity_fp32", "--max-request-bytes=1048576"],
    );
    // `rows` of 16 distinct values from `first` (64 rows: a few KiB compressed, inflated on the
    // blocking pool).
    let values = |rows: usize, first: f32| -> Vec<u8> {
        (0..rows * 16).flat_map(|i| (first + i as f32).to_le_bytes()).collect()
    };
    let request = |id: &str, rows: usize, first: f32| ModelInferRequest {
        model_name: "identity_fp32".into(),
        id: id.into(),
        inputs: vec![InferInputTensor {
            name: "INPUT0".into(),
            datatype: "FP32".into(),
            shape: vec![rows as i64, 16],
            ..Default::default()
        }],
        raw_input_contents: vec![values(rows, first).into()],
        ..Default::default()
    };
    let url = format!("http://127.0.0.1:{}", worker.grpc);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async move {
        for encoding in [CompressionEncoding::Gzip, CompressionEncoding::Deflate] {
            let mut client = GrpcInferenceServiceClient::connect(url.clone()).await.unwrap().send_compressed(encoding);
            let reply = client.model_infer(request("small", 1, 1.5)).await.expect("a compressed request").into_inner();
            assert_eq!(reply.raw_output_contents[0], values(1, 1.5), "{encoding:?}");
            // 2 MiB of zeros: a few kilobytes compressed, twice the limit inflated.
            let mut bomb = request("bomb", 1, 0.0);
            bomb.raw_input_contents = vec![vec![0u8; 2 << 20].into()];
            let e = client.model_infer(bomb).await.expect_err("past the limit inflated");
            assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{encoding:?}: {e:?}");
            assert!(e.message().contains("limit of 1048576 bytes"), "{e:?}");
            // On a stream: answered in order, compressed.
            let stream = vec![request("s1", 1, 2.0), request("s2", 64, 3.0)];
            let replies = client.model_stream_infer(futures::stream::iter(stream)).await.unwrap().into_inner();
            let replies: Vec<_> = futures::StreamExt::collect::<Vec<_>>(replies).await;
            let replies: Vec<_> = replies.into_iter().map(|r| r.expect("a compressed stream request")).collect();
            assert_eq!(replies.len(), 2, "{replies:?}");
            for (reply, (id, rows, first)) in replies.iter().zip([("s1", 1, 2.0), ("s2", 64, 3.0)]) {
                assert_eq!(reply.error_message, "", "{reply:?}");
                let response = reply.infer_response.as_ref().unwrap();
                assert_eq!(response.id, id);
                assert_eq!(response.raw_output_contents[0], values(rows, first));
            }
        }
        // Still serving, plain.
        let mut plain = GrpcInferenceServiceClient::connect(url).await.unwrap();
        plain.model_infer(request("after", 1, 0.5)).await.expect("a plain request after the refused ones");
    });
}
