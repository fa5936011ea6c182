//! Triton's dynamic batcher semantics end to end, with real ONNX Runtime: queue timeouts fire
//! while every instance is busy, queue-policy rejections are UNAVAILABLE / REJECTED (not
//! DEADLINE_EXCEEDED / CANCELED), the largest *reachable* preferred batch size dispatches at
//! once, and a request's `timeout` may only shorten the queue policy's default.
//!
//! No wall-clock thresholds: each test asserts an outcome or an ordering, and waits are
//! bounded only so a regression fails instead of hanging.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{TestModel, eventually, repo, start, workspace};
use nereid_common::{Code, DataType};
use nereid_worker::repository::{ControlMode, Repository};
use nereid_worker::tensor::{InferRequest, InputTensor};

/// Far longer than any test here needs; reached only when the behaviour under test is broken
/// (e.g. a batch that waits for a 60 s delay it should not wait for).
const BOUND: Duration = Duration::from_secs(30);

fn identity_config(max_batch_size: usize, batching: &str) -> String {
    format!(
        r#"name: "m"
backend: "onnxruntime"
max_batch_size: {max_batch_size}
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
{batching}
"#
    )
}

fn request(width: usize, rows: usize, timeout_us: u64) -> InferRequest {
    let data: Vec<u8> = std::iter::repeat_n(0.5f32, width * rows).flat_map(f32::to_le_bytes).collect();
    InferRequest {
        model_name: "m".into(),
        inputs: vec![InputTensor {
            name: "INPUT0".into(),
            datatype: DataType::Fp32,
            shape: vec![rows as i64, width as i64],
            data: Bytes::from(data),
        }],
        timeout_us,
        ..Default::default()
    }
}

fn stats(repo: &Repository) -> nereid_worker::server::ModelStats {
    repo.model_statistics(Some("m"), None).expect("statistics").remove(0)
}

/// The value of the failure counter for `reason` in /metrics (0 when absent).
fn failures(repo: &Repository, reason: &str) -> f64 {
    let series = format!("nv_inference_request_failure{{model=\"m\",version=\"1\",reason=\"{reason}\"}}");
    repo.metrics()
        .render()
        .lines()
        .find(|l| l.starts_with(&series))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

async fn infer(
    repo: &Arc<Repository>,
    r: InferRequest,
) -> Result<nereid_worker::tensor::InferResponse, nereid_common::Status> {
    tokio::time::timeout(BOUND, repo.infer(r)).await.expect("the request was answered within the bound")
}

/// Writes `<dir>/m/1/model.onnx`: `layers` × (MatMul 512×512 + Tanh) on `[-1, 512]`, slow
/// enough at 512 rows (hundreds of milliseconds per 100 layers on one core) to keep the only
/// instance busy far longer than a 100 ms queue timeout. Generated with the `onnx` Python
/// package of the project venv (`scripts/setup.sh` installs it), fixed seed.
fn write_slow_model(dir: &Path, layers: usize) {
    const SCRIPT: &str = r#"
import sys, numpy as np, onnx
from onnx import helper, TensorProto, numpy_helper
out, n = sys.argv[1], int(sys.argv[2])
w = numpy_helper.from_array((np.random.default_rng(0).standard_normal((512, 512)) * 0.05).astype(np.float32), "W")
nodes, x = [], "INPUT0"
for i in range(n):
    nodes.append(helper.make_node("MatMul", [x, "W"], [f"m{i}"]))
    y = "OUTPUT0" if i == n - 1 else f"t{i}"
    nodes.append(helper.make_node("Tanh", [f"m{i}"], [y]))
    x = y
g = helper.make_graph(nodes, "slow", [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, [-1, 512])],
    [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, [-1, 512])], [w])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
m.ir_version = 8
onnx.checker.check_model(m)
onnx.save(m, out)
"#;
    let python = std::env::var_os("NEREID_PYTHON").map_or_else(|| workspace().join(".venv/bin/python"), Into::into);
    let vdir = dir.join("m").join("1");
    std::fs::create_dir_all(&vdir).expect("version folder");
    let status = std::process::Command::new(&python)
        .arg("-c")
        .arg(SCRIPT)
        .arg(vdir.join("model.onnx"))
        .arg(layers.to_string())
        .status()
        .unwrap_or_else(|e| panic!("cannot run {}: {e} — run `bash scripts/setup.sh` first", python.display()));
    assert!(status.success(), "generating the slow model failed — run `bash scripts/setup.sh` first");
}

/// The audit's case: the only instance is busy with a long batch; a request queued behind it
/// with a 100 ms queue timeout is rejected by the timer while that batch still runs, not
/// when the instance frees up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_timeout_fires_while_the_only_instance_is_busy() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_slow_model(dir.path(), 300);
    let config = r#"name: "m"
backend: "onnxruntime"
max_batch_size: 512
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 512 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 512 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
dynamic_batching { max_queue_delay_microseconds: 0 default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 100000 } }
"#;
    std::fs::write(dir.path().join("m/config.pbtxt"), config).expect("config");
    let repo = start(dir.path(), ControlMode::None).await;
    // A full batch (512 rows): it runs alone, for far longer than 100 ms.
    let long = {
        let repo = repo.clone();
        tokio::spawn(async move { repo.infer(request(512, 512, 0)).await })
    };
    // It has left the queue for the instance once its queue time is recorded.
    eventually("the long request is running", || stats(&repo).queue.count == 1).await;
    let e = infer(&repo, request(512, 1, 0)).await.expect_err("the queued request times out");
    // The instance counts a batch before answering it, and only then would it look at the
    // queue again: an execution already counted means the timeout waited for the instance.
    assert_eq!(stats(&repo).execution_count, 0, "the timeout fired only once the instance was free again");
    assert!(!long.is_finished());
    assert_eq!((e.code, e.message.as_str()), (Code::Unavailable, "Request timeout expired"));
    let answer = tokio::time::timeout(BOUND * 4, long).await.expect("the long request finishes");
    assert!(answer.expect("task").is_ok());
    assert_eq!(failures(&repo, "REJECTED"), 1.0);
    assert_eq!(failures(&repo, "CANCELED"), 0.0);
}

/// A queue-policy rejection is Triton's UNAVAILABLE "Request timeout expired", counted as
/// `reason="REJECTED"` — not DEADLINE_EXCEEDED / CANCELED, which stay for callers' deadlines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_timeout_is_unavailable_and_counted_rejected() {
    let dir = repo(&[TestModel {
        name: "m",
        source: "identity_fp32",
        config: Some(&identity_config(
            4,
            "dynamic_batching { max_queue_delay_microseconds: 10000000 default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 20000 } }",
        )),
    }]);
    let repo = start(dir.path(), ControlMode::None).await;
    let e = infer(&repo, request(16, 1, 0)).await.expect_err("times out in the queue");
    assert_eq!(e.code, Code::Unavailable, "{e}");
    assert_eq!(e.message, "Request timeout expired");
    assert_eq!(e.code.http_status(), http::StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(failures(&repo, "REJECTED"), 1.0);
    assert_eq!(failures(&repo, "CANCELED"), 0.0);
    assert_eq!(stats(&repo).execution_count, 0);

    // A caller's own deadline is still DEADLINE_EXCEEDED, counted CANCELED.
    let mut r = request(16, 1, 0);
    r.deadline = Some(std::time::Instant::now() + Duration::from_millis(5));
    let e = infer(&repo, r).await.expect_err("deadline passes in the queue");
    assert_eq!(e.code, Code::DeadlineExceeded, "{e}");
    eventually("the expired request is counted", || failures(&repo, "CANCELED") == 1.0).await;
    assert_eq!(failures(&repo, "REJECTED"), 1.0);
}

/// Preferred sizes [2, 8], a 60 s delay: two requests form a batch of 2 at once (the largest
/// preferred size the queue reaches), instead of waiting for 8 rows or the delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reachable_preferred_batch_size_dispatches_at_once() {
    let dir = repo(&[TestModel {
        name: "m",
        source: "identity_fp32",
        config: Some(&identity_config(
            8,
            "dynamic_batching { preferred_batch_size: [ 2, 8 ] max_queue_delay_microseconds: 60000000 }",
        )),
    }]);
    let repo = start(dir.path(), ControlMode::None).await;
    let calls = (0..2).map(|_| {
        let repo = repo.clone();
        tokio::spawn(async move { infer(&repo, request(16, 1, 0)).await })
    });
    for r in futures::future::join_all(calls).await {
        assert!(r.expect("task").is_ok());
    }
    let s = stats(&repo);
    assert_eq!((s.execution_count, s.inference_count), (1, 2));
    assert_eq!(s.batch_stats.iter().map(|b| b.batch_size).collect::<Vec<_>>(), vec![2]);
}

/// With `allow_timeout_override`, a request's `timeout` longer than the default does not
/// extend it: the 20 ms default still rejects the request long before the 10 s delay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_longer_request_timeout_does_not_extend_the_default() {
    let dir = repo(&[TestModel {
        name: "m",
        source: "identity_fp32",
        config: Some(&identity_config(
            4,
            "dynamic_batching { max_queue_delay_microseconds: 10000000 default_queue_policy { allow_timeout_override: true default_timeout_microseconds: 20000 } }",
        )),
    }]);
    let repo = start(dir.path(), ControlMode::None).await;
    let e = infer(&repo, request(16, 1, 60_000_000)).await.expect_err("the default applies");
    assert_eq!((e.code, e.message.as_str()), (Code::Unavailable, "Request timeout expired"));
}

/// Without `allow_timeout_override`, a request's `timeout` is ignored: with no default the
/// request waits out the batch delay and runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_timeout_is_ignored_without_override() {
    let dir = repo(&[TestModel {
        name: "m",
        source: "identity_fp32",
        config: Some(&identity_config(
            4,
            "dynamic_batching { max_queue_delay_microseconds: 300000 default_queue_policy { allow_timeout_override: false } }",
        )),
    }]);
    let repo = start(dir.path(), ControlMode::None).await;
    let r = infer(&repo, request(16, 1, 1_000)).await.expect("runs despite its 1 ms timeout");
    assert_eq!(r.outputs[0].shape, vec![1, 16]);
    assert_eq!(failures(&repo, "REJECTED"), 0.0);
}
