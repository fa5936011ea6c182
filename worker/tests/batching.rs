//! The dynamic batcher end to end with real ONNX Runtime: batch formation, queue limits,
//! timeouts, deadlines and cancellation, each observed through results and statistics; and
//! Triton's semantics in detail: queue timeouts fire while every instance is busy, queue-policy
//! rejections are UNAVAILABLE / REJECTED (not DEADLINE_EXCEEDED / CANCELED), the largest
//! *reachable* preferred batch size dispatches at once, and a request's `timeout` may only
//! shorten the queue policy's default.
//!
//! No wall-clock thresholds beyond "did not wait for a multi-second delay": tests assert
//! outcomes or orderings, and waits are bounded only so a regression fails instead of hanging.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{TestModel, eventually, repo, start, workspace};
use nereid_common::{Code, DataType};
use nereid_worker::repository::{ControlMode, Repository};
use nereid_worker::tensor::{InferRequest, InputTensor};

/// Far longer than any test here needs; reached only when the behaviour under test is broken
/// (e.g. a batch that waits for a 60 s delay it should not wait for).
const BOUND: Duration = Duration::from_secs(30);

/// Awaits `answers` that must not wait for a batching delay of 600 s: a test configured with
/// that delay fails here, at [`BOUND`], when they do. (A bound, not a timing assertion.)
async fn before_the_delay<T>(what: &str, answers: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(BOUND, answers).await {
        Ok(answers) => answers,
        Err(_) => panic!("{what} waited for the batching delay (no answer within {BOUND:?})"),
    }
}

fn identity_config(batching: &str) -> String {
    identity_config_max(4, batching)
}

fn identity_config_max(max_batch_size: usize, batching: &str) -> String {
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

fn request(value: f32, priority: u64, timeout_us: u64) -> InferRequest {
    request_rows(value, 1, priority, timeout_us)
}

fn request_rows(value: f32, rows: usize, priority: u64, timeout_us: u64) -> InferRequest {
    wide_request(value, 16, rows, priority, timeout_us)
}

/// `rows` rows of `width` copies of `value`.
fn wide_request(value: f32, width: usize, rows: usize, priority: u64, timeout_us: u64) -> InferRequest {
    let data: Vec<u8> = std::iter::repeat_n(value, width * rows).flat_map(f32::to_le_bytes).collect();
    InferRequest {
        model_name: "m".into(),
        inputs: vec![InputTensor {
            name: "INPUT0".into(),
            datatype: DataType::Fp32,
            shape: vec![rows as i64, width as i64],
            data: Bytes::from(data),
        }],
        priority,
        timeout_us,
        ..Default::default()
    }
}

fn first_value(r: &nereid_worker::tensor::InferResponse) -> f32 {
    f32::from_le_bytes(r.outputs[0].data[..4].try_into().unwrap())
}

fn stats(repo: &Repository) -> nereid_worker::server::ModelStats {
    repo.model_statistics(Some("m"), None).unwrap().remove(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_batch_runs_once_and_rows_return_to_their_callers() {
    // A 10 s delay: only a full batch (4 rows) can dispatch before it.
    let dir = repo(&[TestModel {
        name: "m",
        source: "identity_fp32",
        config: Some(&identity_config("dynamic_batching { max_queue_delay_microseconds: 600000000 }")),
    }]);
    let repo = start(dir.path(), ControlMode::None).await;
    let calls = (0..4).map(|i| {
        let repo = repo.clone();
        tokio::spawn(async move { repo.infer(request(i as f32, 0, 0)).await })
    });
    let results = before_the_delay("a full batch", futures::future::join_all(calls)).await;
    for (i, r) in results.into_iter().enumerate() {
        let r = r.unwrap().unwrap();
        assert_eq!(first_value(&r), i as f32, "row {i} came back to the wrong caller");
        assert_eq!(r.outputs[0].shape, vec![1, 16]);
    }
    let s = stats(&repo);
    assert_eq!((s.execution_count, s.inference_count, s.success.count), (1, 4, 4));
    assert_eq!(s.batch_stats.len(), 1);
    assert_eq!(s.batch_stats[0].batch_size, 4);
}

/// A full queue refuses at once, when the request arrives — not when a batch would have taken
/// it: with a 600 s delay holding the queue, a refusal decided at dispatch would come only
/// after the delay, and the bound below fails first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_queue_size_rejects_at_once() {
    let dir = repo(&[TestModel {
        name: "m",
        source: "identity_fp32",
        config: Some(&identity_config(
            "dynamic_batching { max_queue_delay_microseconds: 600000000 default_queue_policy { max_queue_size: 2 } }",
        )),
    }]);
    let repo = start(dir.path(), ControlMode::None).await;
    let held: Vec<_> = (0..2)
        .map(|i| {
            let repo = repo.clone();
            tokio::spawn(async move { repo.infer(request(i as f32, 0, 0)).await })
        })
        .collect();
    eventually("two requests queued", || repo.model_statistics(Some("m"), None).is_ok() && pending(&repo) == 2).await;
    let e = before_the_delay("the refusal of a full queue", repo.infer(request(9.0, 0, 0))).await.unwrap_err();
    assert_eq!(e.code, Code::ResourceExhausted, "{e}");
    assert!(e.message.contains("max_queue_size"), "{e}");
    // Refused while the two ahead of it are still held: nothing was dispatched.
    assert_eq!(pending(&repo), 2);
    assert!(held.iter().all(|h| !h.is_finished()), "the held requests were answered");
    assert_eq!(stats(&repo).execution_count, 0);
    for h in held {
        h.abort();
    }
}

fn pending(repo: &Repository) -> i64 {
    // The pending gauge as /metrics shows it.
    let text = repo_metrics(repo);
    text.lines()
        .find(|l| l.starts_with("nv_inference_pending_request_count{model=\"m\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(-1)
}

fn repo_metrics(repo: &Repository) -> String {
    repo.metrics().render()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_timeout_rejects_when_it_expires() {
    let dir = repo(&[TestModel {
        name: "m",
        source: "identity_fp32",
        config: Some(&identity_config(
            "dynamic_batching { max_queue_delay_microseconds: 600000000 default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 20000 } }",
        )),
    }]);
    let repo = start(dir.path(), ControlMode::None).await;
    // The timer fires at the timeout, not when the batch delay ends.
    let e = before_the_delay("a timed-out request", repo.infer(request(1.0, 0, 0))).await.unwrap_err();
    // As Triton: UNAVAILABLE "Request timeout expired", counted as REJECTED.
    assert_eq!((e.code, e.message.as_str()), (Code::Unavailable, nereid_common::status::QUEUE_TIMEOUT_MESSAGE));
    assert_eq!(stats(&repo).fail.count, 1);
}

/// `DELAY`: a request whose queue timeout passes is neither rejected nor left where it was,
/// but moved behind the requests of its level that have not timed out — and still runs.
///
/// Max batch size 4, a 600 s delay holding every batch that is not full. X (2 rows) asks for a
/// 1 ms queue timeout (allowed to shorten the 600 s default) and waits past it; then Y (3 rows,
/// no timeout of its own) arrives. X and Y do not fit one batch, so whichever heads the queue
/// runs alone at once and the other is held: Y only if X was delayed behind it. (Timeouts
/// ignored: X runs and Y is held; `REJECT`'s behaviour: X fails and Y, alone, is held. Either
/// way the test fails.) X, held, is then released by Z's 2 rows, which complete its batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_requests_still_run() {
    let dir = repo(&[TestModel {
        name: "m",
        source: "identity_fp32",
        config: Some(&identity_config(
            "dynamic_batching { max_queue_delay_microseconds: 600000000 default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 600000000 allow_timeout_override: true } }",
        )),
    }]);
    let repo = start(dir.path(), ControlMode::None).await;
    let send = |r: InferRequest| {
        let repo = repo.clone();
        tokio::spawn(async move { repo.infer(r).await })
    };
    let x = send(request_rows(1.0, 2, 0, 1_000));
    eventually("X queued", || pending(&repo) == 1).await;
    // X arrived before it was counted as pending: 2 ms from now its 1 ms timeout has passed,
    // and whoever looks at the queue next (the timer, or the instance woken by Y) delays it.
    tokio::time::sleep_until((Instant::now() + Duration::from_millis(2)).into()).await;
    let y = send(request_rows(2.0, 3, 0, 0));
    let y = before_the_delay("Y, ahead of the delayed X", y).await.unwrap().unwrap();
    assert_eq!(first_value(&y), 2.0);
    assert!(!x.is_finished(), "X was answered before Y's batch left it behind");
    assert_eq!(pending(&repo), 1, "X waits in the queue");
    assert_eq!(failures(&repo, "REJECTED"), 0.0);
    let z = send(request_rows(3.0, 2, 0, 0));
    let (x, z) = before_the_delay("X with Z's rows", futures::future::join(x, z)).await;
    assert_eq!(first_value(&x.unwrap().expect("the delayed request runs")), 1.0);
    assert_eq!(first_value(&z.unwrap().unwrap()), 3.0);
    let s = stats(&repo);
    assert_eq!((s.execution_count, s.success.count, s.fail.count), (2, 3, 0));
    assert_eq!(s.batch_stats.iter().map(|b| b.batch_size).collect::<Vec<_>>(), vec![3, 4]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_timeout_parameter_overrides_when_allowed() {
    let dir = repo(&[TestModel {
        name: "m",
        source: "identity_fp32",
        config: Some(&identity_config(
            "dynamic_batching { max_queue_delay_microseconds: 10000000 default_queue_policy { allow_timeout_override: true default_timeout_microseconds: 60000000 } }",
        )),
    }]);
    let repo = start(dir.path(), ControlMode::None).await;
    let e = repo.infer(request(1.0, 0, 10_000)).await.unwrap_err();
    assert_eq!(e.code, Code::Unavailable, "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transport_deadline_is_honoured() {
    let dir = repo(&[TestModel {
        name: "m",
        source: "identity_fp32",
        config: Some(&identity_config("dynamic_batching { max_queue_delay_microseconds: 10000000 }")),
    }]);
    let repo = start(dir.path(), ControlMode::None).await;
    let mut r = request(1.0, 0, 0);
    r.deadline = Some(Instant::now() + Duration::from_millis(30));
    let e = repo.infer(r).await.unwrap_err();
    assert_eq!(e.code, Code::DeadlineExceeded, "{e}");
    eventually("the expired request left the queue", || pending(&repo) == 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_that_goes_away_is_removed_and_counted_cancelled() {
    let dir = repo(&[TestModel {
        name: "m",
        source: "identity_fp32",
        config: Some(&identity_config("dynamic_batching { max_queue_delay_microseconds: 10000000 }")),
    }]);
    let repo = start(dir.path(), ControlMode::None).await;
    let call = {
        let repo = repo.clone();
        tokio::spawn(async move { repo.infer(request(1.0, 0, 0)).await })
    };
    eventually("the request is queued", || pending(&repo) == 1).await;
    call.abort();
    eventually("the cancelled request left the queue", || pending(&repo) == 0).await;
    let text = repo_metrics(&repo);
    assert!(text.contains("nv_inference_request_failure{model=\"m\",version=\"1\",reason=\"CANCELED\"} 1"), "{text}");
    assert_eq!(stats(&repo).execution_count, 0, "a cancelled request must not run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_dynamic_batching_requests_run_one_at_a_time() {
    let dir = repo(&[TestModel { name: "m", source: "identity_fp32", config: Some(&identity_config("")) }]);
    let repo = start(dir.path(), ControlMode::None).await;
    let calls = (0..8).map(|i| {
        let repo = repo.clone();
        tokio::spawn(async move { repo.infer(request(i as f32, 0, 0)).await })
    });
    for (i, r) in futures::future::join_all(calls).await.into_iter().enumerate() {
        assert_eq!(first_value(&r.unwrap().unwrap()), i as f32);
    }
    let s = stats(&repo);
    assert_eq!((s.execution_count, s.inference_count), (8, 8));
}

/// `dynamic_batching` on a model that does not batch (max_batch_size 0), as Triton accepts it:
/// the model loads, its queue policy applies, and requests run one at a time without waiting
/// for the queue delay (no batch could grow).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamic_batching_without_batching_runs_requests_alone() {
    let config = identity_config_max(0, "dynamic_batching { max_queue_delay_microseconds: 600000000 }")
        .replace("dims: [ 16 ]", "dims: [ -1, 16 ]");
    let dir = repo(&[TestModel { name: "m", source: "identity_fp32", config: Some(&config) }]);
    let repo = start(dir.path(), ControlMode::None).await;
    let calls = (0..4).map(|i| {
        let repo = repo.clone();
        tokio::spawn(async move { repo.infer(request_rows(i as f32, 2, 0, 0)).await })
    });
    // No batch could grow, so nothing waits for the delay.
    for (i, r) in before_the_delay("unbatched requests", futures::future::join_all(calls)).await.into_iter().enumerate()
    {
        let r = r.unwrap().unwrap();
        assert_eq!(first_value(&r), i as f32);
        assert_eq!(r.outputs[0].shape, vec![2, 16]);
    }
    let s = stats(&repo);
    assert_eq!((s.execution_count, s.success.count), (4, 4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priority_levels_serve_the_higher_level_first() {
    // max_batch_size 4, a 600 s delay. Queue A (level 2, 2 rows) and B (level 2, 1 row): 3
    // rows, held. Then C (level 1, 2 rows) arrives: by priority the batch is C + A = 4 rows,
    // full, and runs at once; B is left, held, until D (level 2, 3 rows) completes its batch.
    // First-come-first-served would have run A + B (C does not fit beside them) and held C:
    // waiting for C then fails at the bound.
    let cfg = identity_config(
        "dynamic_batching { max_queue_delay_microseconds: 600000000 priority_levels: 2 default_priority_level: 2 }",
    );
    let dir = repo(&[TestModel { name: "m", source: "identity_fp32", config: Some(&cfg) }]);
    let repo = start(dir.path(), ControlMode::None).await;
    let send = |value: f32, rows: usize, priority: u64| {
        let repo = repo.clone();
        tokio::spawn(async move { repo.infer(request_rows(value, rows, priority, 0)).await })
    };
    let a = send(1.0, 2, 2);
    eventually("A queued", || pending(&repo) == 1).await;
    let b = send(2.0, 1, 2);
    eventually("B queued", || pending(&repo) == 2).await;
    let c = send(3.0, 2, 1);
    let (a, c) = before_the_delay("C and A, by priority", futures::future::join(a, c)).await;
    assert_eq!(first_value(&a.unwrap().unwrap()), 1.0);
    assert_eq!(first_value(&c.unwrap().unwrap()), 3.0);
    assert!(!b.is_finished(), "B, of the lower level and arrived before C, must wait");
    assert_eq!(pending(&repo), 1, "B is still queued");
    let d = send(4.0, 3, 2);
    let (b, d) = before_the_delay("B with D's rows", futures::future::join(b, d)).await;
    assert_eq!(first_value(&b.unwrap().unwrap()), 2.0);
    assert_eq!(first_value(&d.unwrap().unwrap()), 4.0);
    let s = stats(&repo);
    assert_eq!((s.execution_count, s.inference_count), (2, 8));
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

/// Writes `<dir>/m/1/model.onnx`: `layers` × (MatMul 512×512 + Tanh) on `[-1, 512]`: at 512
/// rows, 100 layers are 27 GFLOP, a quarter of a second on one core of an ordinary host, about
/// a tenth on the fastest (the worker runs a session on one intra-op thread by default, so more
/// cores do not shorten it). Generated with the `onnx` Python package of the project venv
/// (`scripts/setup.sh` installs it), fixed seed.
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
/// with a 20 ms queue timeout is rejected by the timer while that batch still runs, not
/// when the instance frees up.
///
/// ONNX Runtime offers no way to hold a run open until a test lets it go, so "busy" is a batch
/// of work, made large: 1000 layers at 512 rows (270 GFLOP on one thread), about 3 s on a
/// 2-core development host and close to 1 s on the fastest cores — some fifty times the 20 ms
/// timeout, so that neither a fast host nor a loaded one (whose timer thread waits for a core)
/// closes the gap. The test waits for that batch to end (with its answer checked) rather than
/// leave it running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_timeout_fires_while_the_only_instance_is_busy() {
    let dir = tempfile::tempdir().expect("tempdir");
    write_slow_model(dir.path(), 1000);
    let config = r#"name: "m"
backend: "onnxruntime"
max_batch_size: 512
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 512 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 512 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
dynamic_batching { max_queue_delay_microseconds: 0 default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 20000 } }
"#;
    std::fs::write(dir.path().join("m/config.pbtxt"), config).expect("config");
    let repo = start(dir.path(), ControlMode::None).await;
    // A full batch (512 rows): it runs alone, for seconds.
    let long = {
        let repo = repo.clone();
        tokio::spawn(async move { repo.infer(wide_request(0.5, 512, 512, 0, 0)).await })
    };
    eventually("the long request is running", || repo.metrics().version("m", 1).dispatched() == 1).await;
    let e = infer(&repo, wide_request(0.5, 512, 1, 0, 0)).await.expect_err("the queued request times out");
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
        config: Some(&identity_config_max(
            4,
            "dynamic_batching { max_queue_delay_microseconds: 10000000 default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 20000 } }",
        )),
    }]);
    let repo = start(dir.path(), ControlMode::None).await;
    let e = infer(&repo, wide_request(0.5, 16, 1, 0, 0)).await.expect_err("times out in the queue");
    assert_eq!(e.code, Code::Unavailable, "{e}");
    assert_eq!(e.message, "Request timeout expired");
    assert_eq!(e.code.http_status(), http::StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(failures(&repo, "REJECTED"), 1.0);
    assert_eq!(failures(&repo, "CANCELED"), 0.0);
    assert_eq!(stats(&repo).execution_count, 0);

    // A caller's own deadline is still DEADLINE_EXCEEDED, counted CANCELED.
    let mut r = wide_request(0.5, 16, 1, 0, 0);
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
        config: Some(&identity_config_max(
            8,
            "dynamic_batching { preferred_batch_size: [ 2, 8 ] max_queue_delay_microseconds: 60000000 }",
        )),
    }]);
    let repo = start(dir.path(), ControlMode::None).await;
    let calls = (0..2).map(|_| {
        let repo = repo.clone();
        tokio::spawn(async move { infer(&repo, wide_request(0.5, 16, 1, 0, 0)).await })
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
        config: Some(&identity_config_max(
            4,
            "dynamic_batching { max_queue_delay_microseconds: 10000000 default_queue_policy { allow_timeout_override: true default_timeout_microseconds: 20000 } }",
        )),
    }]);
    let repo = start(dir.path(), ControlMode::None).await;
    let e = infer(&repo, wide_request(0.5, 16, 1, 0, 60_000_000)).await.expect_err("the default applies");
    assert_eq!((e.code, e.message.as_str()), (Code::Unavailable, "Request timeout expired"));
}

/// Without `allow_timeout_override`, a request's `timeout` is ignored: with no default the
/// request waits out the batch delay and runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_timeout_is_ignored_without_override() {
    let dir = repo(&[TestModel {
        name: "m",
        source: "identity_fp32",
        config: Some(&identity_config_max(
            4,
            "dynamic_batching { max_queue_delay_microseconds: 300000 default_queue_policy { allow_timeout_override: false } }",
        )),
    }]);
    let repo = start(dir.path(), ControlMode::None).await;
    let r = infer(&repo, wide_request(0.5, 16, 1, 0, 1_000)).await.expect("runs despite its 1 ms timeout");
    assert_eq!(r.outputs[0].shape, vec![1, 16]);
    assert_eq!(failures(&repo, "REJECTED"), 0.0);
}

/// `--max-queued-bytes`: while a held request's inputs fill the worker's budget, another
/// request is refused at once — RESOURCE_EXHAUSTED, with the message the gateway retries
/// elsewhere; one that fits is taken. Once nothing is held, a request larger than the whole
/// budget still runs (the request limit, not this budget, bounds a single request).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_memory_budget_a_request_is_refused_at_once() {
    let dir = repo(&[TestModel {
        name: "m",
        source: "identity_fp32",
        config: Some(&identity_config("dynamic_batching { max_queue_delay_microseconds: 600000000 }")),
    }]);
    common::init_ort();
    let options = common::options(dir.path(), ControlMode::None, false);
    // Room for three rows of 64 bytes.
    let repo = Arc::new(
        Repository::new(options, Arc::new(nereid_worker::metrics::Metrics::new())).with_max_queued_bytes(3 * 64),
    );
    assert!(repo.load_startup_models().await.is_empty());
    let send = |r: InferRequest| {
        let repo = repo.clone();
        tokio::spawn(async move { repo.infer(r).await })
    };
    let held = send(request_rows(1.0, 2, 0, 0));
    eventually("the held request queued", || pending(&repo) == 1).await;
    let e = before_the_delay("a refusal", repo.infer(request_rows(2.0, 2, 0, 0))).await.unwrap_err();
    assert_eq!(e.code, Code::ResourceExhausted, "{e}");
    assert!(nereid_common::status::is_queue_refusal(e.code, &e.message), "the gateway retries it elsewhere: {e}");
    assert!(e.message.contains("--max-queued-bytes 192"), "{e}");
    assert!(!held.is_finished() && pending(&repo) == 1, "the held request is untouched");
    let text = repo_metrics(&repo);
    for series in
        ["nereid_queued_input_bytes 128", "nereid_queued_input_bytes_limit 192", "nereid_queued_input_refusals_total 1"]
    {
        assert!(text.lines().any(|l| l == series), "{series}:\n{text}");
    }
    // One row fits beside the two held.
    let fits = send(request_rows(3.0, 1, 0, 0));
    eventually("the request that fits queued", || pending(&repo) == 2).await;
    held.abort();
    fits.abort();
    // Nothing held once the scheduler has dropped the two: four rows (256 bytes), past the
    // whole budget, run alone (refused only while the dropped ones still hold their bytes).
    let mut alone = None;
    for _ in 0..1000 {
        match before_the_delay("a request past the budget", repo.infer(request_rows(5.0, 4, 0, 0))).await {
            Err(e) if e.code == Code::ResourceExhausted => tokio::time::sleep(Duration::from_millis(10)).await,
            other => {
                alone = Some(other);
                break;
            }
        }
    }
    let alone = alone.expect("the budget was never given back").expect("runs alone");
    assert_eq!(first_value(&alone), 5.0);
}
