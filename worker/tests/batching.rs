//! The dynamic batcher end to end with real ONNX Runtime: batch formation, queue limits,
//! timeouts, deadlines and cancellation, each observed through results and statistics.

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{TestModel, eventually, repo, start};
use nereid_common::{Code, DataType};
use nereid_worker::repository::{ControlMode, Repository};
use nereid_worker::tensor::{InferRequest, InputTensor};

fn identity_config(batching: &str) -> String {
    format!(
        r#"name: "m"
backend: "onnxruntime"
max_batch_size: 4
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
    let data: Vec<u8> = std::iter::repeat_n(value, 16 * rows).flat_map(f32::to_le_bytes).collect();
    InferRequest {
        model_name: "m".into(),
        inputs: vec![InputTensor {
            name: "INPUT0".into(),
            datatype: DataType::Fp32,
            shape: vec![rows as i64, 16],
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
        config: Some(&identity_config("dynamic_batching { max_queue_delay_microseconds: 10000000 }")),
    }]);
    let repo = start(dir.path(), ControlMode::None).await;
    let started = Instant::now();
    let calls = (0..4).map(|i| {
        let repo = repo.clone();
        tokio::spawn(async move { repo.infer(request(i as f32, 0, 0)).await })
    });
    let results = futures::future::join_all(calls).await;
    for (i, r) in results.into_iter().enumerate() {
        let r = r.unwrap().unwrap();
        assert_eq!(first_value(&r), i as f32, "row {i} came back to the wrong caller");
        assert_eq!(r.outputs[0].shape, vec![1, 16]);
    }
    assert!(started.elapsed() < Duration::from_secs(5), "a full batch must not wait for the delay");
    let s = stats(&repo);
    assert_eq!((s.execution_count, s.inference_count, s.success.count), (1, 4, 4));
    assert_eq!(s.batch_stats.len(), 1);
    assert_eq!(s.batch_stats[0].batch_size, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_queue_size_rejects_at_once() {
    let dir = repo(&[TestModel {
        name: "m",
        source: "identity_fp32",
        config: Some(&identity_config(
            "dynamic_batching { max_queue_delay_microseconds: 10000000 default_queue_policy { max_queue_size: 2 } }",
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
    let e = repo.infer(request(9.0, 0, 0)).await.unwrap_err();
    assert_eq!(e.code, Code::ResourceExhausted, "{e}");
    assert!(e.message.contains("max_queue_size"), "{e}");
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
            "dynamic_batching { max_queue_delay_microseconds: 10000000 default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 20000 } }",
        )),
    }]);
    let repo = start(dir.path(), ControlMode::None).await;
    let started = Instant::now();
    let e = repo.infer(request(1.0, 0, 0)).await.unwrap_err();
    // As Triton: UNAVAILABLE "Request timeout expired", counted as REJECTED.
    assert_eq!((e.code, e.message.as_str()), (Code::Unavailable, nereid_common::status::QUEUE_TIMEOUT_MESSAGE));
    // The timer fires at the timeout, not when the 10 s batch delay ends.
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(stats(&repo).fail.count, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_requests_still_run() {
    let dir = repo(&[TestModel {
        name: "m",
        source: "identity_fp32",
        config: Some(&identity_config(
            "dynamic_batching { max_queue_delay_microseconds: 50000 default_queue_policy { timeout_action: DELAY default_timeout_microseconds: 1000 } }",
        )),
    }]);
    let repo = start(dir.path(), ControlMode::None).await;
    let r = repo.infer(request(3.0, 0, 0)).await.unwrap();
    assert_eq!(first_value(&r), 3.0);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn priority_levels_serve_the_higher_level_first() {
    // max_batch_size 4. Queue A (level 2, 2 rows) and B (level 2, 1 row): 3 rows, waiting for
    // the delay. Then C (level 1, 2 rows) arrives: by priority the batch is C + A = 4 rows,
    // full, and runs at once; B is left for a second batch. First-come-first-served would have
    // run A + B and left C.
    let cfg = identity_config(
        "dynamic_batching { max_queue_delay_microseconds: 100000 priority_levels: 2 default_priority_level: 2 }",
    );
    let dir = repo(&[TestModel { name: "m", source: "identity_fp32", config: Some(&cfg) }]);
    let repo = start(dir.path(), ControlMode::None).await;
    let order = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut calls = Vec::new();
    for (queued, (name, rows, prio)) in [('A', 2usize, 2u64), ('B', 1, 2), ('C', 2, 1)].into_iter().enumerate() {
        let (repo2, order) = (repo.clone(), order.clone());
        calls.push(tokio::spawn(async move {
            repo2.infer(request_rows(1.0, rows, prio, 0)).await.unwrap();
            order.lock().unwrap().push(name);
        }));
        if queued < 2 {
            eventually("queued", || pending(&repo) == queued as i64 + 1).await;
        }
    }
    futures::future::join_all(calls).await;
    let s = stats(&repo);
    assert_eq!(s.execution_count, 2);
    assert_eq!(s.batch_stats.iter().map(|b| b.batch_size).collect::<Vec<_>>(), vec![1, 4]);
    let order = order.lock().unwrap().clone();
    assert_eq!(order.last(), Some(&'B'), "completion order: {order:?}");
}
