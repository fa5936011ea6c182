//! GPU execution with real models: KIND_GPU and KIND_AUTO instances run on ONNX Runtime's CUDA
//! execution provider and answer what the same model answers on CPU; a GPU the host lacks
//! fails the load with a reason; the worker process exports `nv_gpu_*` series.
//!
//! These need a build with the `cuda` feature, a CUDA device, and onnxruntime-gpu's library
//! (`NEREID_ORT_LIB`, with its CUDA/cuDNN libraries on `LD_LIBRARY_PATH`). Elsewhere each test
//! prints why it skips and passes; with `NEREID_REQUIRE_GPU=1` (GPU hosts) a missing GPU fails
//! them instead.
//!
//! ```sh
//! cargo nextest run -p nereid-worker --features cuda --test gpu
//! ```

mod common;

use bytes::Bytes;
use common::{TestModel, process::WorkerProcess, repo, repository, unavailable_reason as reason};
use nereid_common::DataType;
use nereid_proto::inference::model_instance_group::Kind;
use nereid_worker::backend;
use nereid_worker::repository::{ControlMode, Repository};
use nereid_worker::tensor::{InferRequest, InputTensor};

/// The number of usable GPUs, or `None` (after saying why) where this host or build has none.
fn gpus() -> Option<usize> {
    common::init_ort();
    match backend::gpu_devices() {
        Ok(n) => Some(n),
        Err(why) if std::env::var("NEREID_REQUIRE_GPU").is_ok_and(|v| v == "1") => {
            panic!("NEREID_REQUIRE_GPU=1 but no GPU can be used: {why}")
        }
        Err(why) => {
            eprintln!("skipped: no GPU can be used here ({why})");
            None
        }
    }
}

/// `model`'s example config with its instance groups replaced by `groups`, renamed `name`.
fn config_with(model: &str, name: &str, groups: &str) -> String {
    let text = std::fs::read_to_string(common::example_models().join(model).join("config.pbtxt")).unwrap();
    let start = text.find("instance_group").unwrap_or(text.len());
    // The list ends at its matching bracket (one line or several).
    let mut depth = 0;
    let mut end = start;
    for (i, c) in text[start..].char_indices() {
        match c {
            '[' => depth += 1,
            ']' if depth == 1 => {
                end = start + i + 1;
                break;
            }
            ']' => depth -= 1,
            _ => {}
        }
    }
    let body = format!("{}{}", &text[..start], &text[end..])
        .replace(&format!("name: \"{model}\""), &format!("name: \"{name}\""));
    // Labels are not copied into the test repository; classification is not what this tests.
    let body = body.lines().filter(|l| !l.contains("label_filename")).collect::<Vec<_>>().join("\n");
    format!("{body}\n{groups}\n")
}

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(2_654_435_761) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state >> 8) as f32 / (1u32 << 24) as f32 * 2.0 - 1.0
        })
        .collect()
}

fn request(model: &str, shape: &[i64], data: &[f32]) -> InferRequest {
    InferRequest {
        model_name: model.into(),
        inputs: vec![InputTensor {
            name: "INPUT0".into(),
            datatype: DataType::Fp32,
            shape: shape.to_vec(),
            data: Bytes::copy_from_slice(bytemuck::cast_slice(data)),
        }],
        ..Default::default()
    }
}

async fn infer(repo: &Repository, model: &str, shape: &[i64], data: &[f32]) -> (Vec<i64>, Vec<f32>) {
    let answer = repo.infer(request(model, shape, data)).await.unwrap_or_else(|e| panic!("{model}: {e}"));
    let out = &answer.outputs[0];
    (out.shape.clone(), bytemuck::pod_collect_to_vec(&out.data))
}

/// Largest |a - b| relative to max(1, |b|).
fn max_error(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs() / y.abs().max(1.0)).fold(0.0, f32::max)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gpu_instances_answer_what_cpu_instances_answer() {
    let Some(_) = gpus() else { return };
    let cases = [("identity_fp32", vec![16i64]), ("mlp_fp32", vec![256]), ("convnet_fp32", vec![3, 64, 64])];
    let configs: Vec<(String, String, String)> = cases
        .iter()
        .map(|(m, _)| {
            // The convnet also takes Triton's cuDNN search parameter (HEURISTIC).
            let search = if *m == "convnet_fp32" {
                "\nparameters { key: \"cudnn_conv_algo_search\" value: { string_value: \"1\" } }"
            } else {
                ""
            };
            (
                m.to_string(),
                config_with(
                    m,
                    &format!("{m}_gpu"),
                    &format!("instance_group [ {{ count: 1 kind: KIND_GPU gpus: [ 0 ] }} ]{search}"),
                ),
                config_with(m, &format!("{m}_cpu"), "instance_group [ { count: 1 kind: KIND_CPU } ]"),
            )
        })
        .collect();
    let names: Vec<(String, String)> = cases.iter().map(|(m, _)| (format!("{m}_gpu"), format!("{m}_cpu"))).collect();
    let mut models = Vec::new();
    for ((m, gpu, cpu), (gpu_name, cpu_name)) in configs.iter().zip(&names) {
        models.push(TestModel { name: gpu_name, source: m, config: Some(gpu) });
        models.push(TestModel { name: cpu_name, source: m, config: Some(cpu) });
    }
    let dir = repo(&models);
    let repo = repository(dir.path(), ControlMode::None, true);
    let failed = repo.load_startup_models().await;
    assert!(failed.is_empty(), "{failed:?}");

    for ((model, dims), (gpu_name, cpu_name)) in cases.iter().zip(&names) {
        let config = repo.model_config(gpu_name, None).unwrap();
        assert_eq!(config.instance_group[0].kind, Kind::Gpu as i32, "{config:?}");
        assert_eq!(config.instance_group[0].gpus, vec![0]);
        for rows in [1i64, 4] {
            let mut shape = vec![rows];
            shape.extend(dims);
            let n = shape.iter().product::<i64>() as usize;
            let input = values(n, rows as u32 + 7);
            let (gpu_shape, on_gpu) = infer(&repo, gpu_name, &shape, &input).await;
            let (cpu_shape, on_cpu) = infer(&repo, cpu_name, &shape, &input).await;
            assert_eq!(gpu_shape, cpu_shape, "{model}");
            assert!(on_gpu.iter().all(|v| v.is_finite()), "{model}: {on_gpu:?}");
            // cuDNN/cuBLAS may sum in another order (or in TF32): close, not bit-equal.
            let err = max_error(&on_gpu, &on_cpu);
            let bound = if *model == "identity_fp32" { 0.0 } else { 2e-2 };
            assert!(err <= bound, "{model} rows {rows}: GPU and CPU differ by {err} (bound {bound})");
        }
    }

    // Under concurrency the GPU instance batches and every caller gets its own rows back.
    let mlp = "mlp_fp32_gpu";
    let inputs: Vec<Vec<f32>> = (0..64).map(|i| values(256, 1000 + i)).collect();
    let answers = futures::future::join_all(inputs.iter().map(|x| infer(&repo, mlp, &[1, 256], x))).await;
    for (x, (_, on_gpu)) in inputs.iter().zip(&answers) {
        let (_, on_cpu) = infer(&repo, "mlp_fp32_cpu", &[1, 256], x).await;
        assert!(max_error(on_gpu, &on_cpu) <= 2e-2, "a batched GPU answer is another caller's rows");
    }
    let stats = repo.model_statistics(Some(mlp), None).unwrap();
    let s = &stats[0];
    // 1 + 4 rows above, then 64 one-row requests.
    assert_eq!(s.inference_count, 5 + 64, "{s:?}");
    assert!(s.execution_count < 2 + 64, "64 callers at once, and no batch held two of them: {s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kind_auto_runs_on_every_gpu_and_a_missing_gpu_fails_the_load() {
    let Some(n) = gpus() else { return };
    let auto = config_with("identity_fp32", "auto", "");
    let missing = config_with(
        "identity_fp32",
        "missing",
        &format!("instance_group [ {{ count: 1 kind: KIND_GPU gpus: [ {n} ] }} ]"),
    );
    // On a GPU instance an invalid CUDA provider key fails the load (a CPU one ignores it).
    let bad_key = config_with(
        "identity_fp32",
        "bad_key",
        "instance_group [ { count: 1 kind: KIND_GPU } ]\n\
         parameters { key: \"cudnn_conv_algo_search\" value: { string_value: \"HEURISTIC\" } }",
    );
    let dir = repo(&[
        TestModel { name: "auto", source: "identity_fp32", config: Some(&auto) },
        TestModel { name: "missing", source: "identity_fp32", config: Some(&missing) },
        TestModel { name: "bad_key", source: "identity_fp32", config: Some(&bad_key) },
    ]);
    let repo = repository(dir.path(), ControlMode::None, true);
    let failed = repo.load_startup_models().await;
    assert_eq!(failed.len(), 2, "{failed:?}");
    let group = &repo.model_config("auto", None).unwrap().instance_group[0];
    assert_eq!(group.kind, Kind::Gpu as i32, "KIND_AUTO takes the GPUs where there are some: {group:?}");
    assert_eq!(group.gpus, (0..n as i32).collect::<Vec<_>>());
    let (_, out) = infer(&repo, "auto", &[2, 16], &values(32, 3)).await;
    assert_eq!(out, values(32, 3));
    let why = reason(&repo, "missing");
    assert!(why.contains(&format!("names GPU {n}")), "{why}");
    let why = reason(&repo, "bad_key");
    assert!(why.contains("cudnn_conv_algo_search") && why.contains("HEURISTIC"), "{why}");
}

#[test]
fn the_worker_exports_gpu_metrics() {
    if gpus().is_none() {
        return;
    }
    let dir = repo(&[TestModel {
        name: "identity_fp32",
        source: "identity_fp32",
        config: Some(&config_with("identity_fp32", "identity_fp32", "instance_group [ { count: 1 kind: KIND_GPU } ]")),
    }]);
    let worker = WorkerProcess::start(dir.path(), &[]);
    let body = serde_json::json!({"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16],
        "data": values(16, 5)}]});
    let (status, text) =
        worker.http_request(worker.http, "POST", "/v2/models/identity_fp32/infer", body.to_string().as_bytes());
    assert_eq!(status, 200, "{text}");
    let (status, metrics) = worker.http_request(worker.metrics, "GET", "/metrics", b"");
    assert_eq!(status, 200);
    for family in ["nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes"] {
        let line = metrics
            .lines()
            .find(|l| l.starts_with(family) && l.contains("gpu_uuid=\"GPU-"))
            .unwrap_or_else(|| panic!("no {family} series with a GPU uuid:\n{metrics}"));
        let value: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(value >= 0.0, "{line}");
    }
    let total = metrics.lines().find(|l| l.starts_with("nv_gpu_memory_total_bytes")).unwrap();
    assert!(total.rsplit(' ').next().unwrap().parse::<f64>().unwrap() > 1e9, "{total}");
}
