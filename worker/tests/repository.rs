//! The model repository with real ONNX Runtime: configs that fail to load (each with a reason
//! naming the problem, without affecting other models), auto-complete, version policies,
//! instance kinds, and POLL / EXPLICIT control modes.

mod common;

use bytes::Bytes;
use common::{TestModel, example_onnx, gated_repo, repo, repository, unavailable_reason as reason};
use nereid_common::{Code, DataType};
use nereid_worker::repository::{ControlMode, Repository, RepositoryOptions};
use nereid_worker::tensor::{InferRequest, InputTensor};
use std::sync::Arc;

const GOOD: &str = common::IDENTITY_CONFIG;

fn identity_request(model: &str, version: Option<i64>) -> InferRequest {
    InferRequest {
        model_name: model.into(),
        model_version: version,
        inputs: vec![InputTensor {
            name: "INPUT0".into(),
            datatype: DataType::Fp32,
            shape: vec![1, 16],
            data: Bytes::from(vec![0u8; 64]),
        }],
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_models_fail_alone_with_a_reason() {
    let syntax = GOOD
        .replace("name: \"good\"", "name: \"syntax\"")
        .replace("dims: [ 16 ] } ]\noutput", "dims: [ 16 } ]\noutput");
    let unknown = format!("{}\nbogus_field: 1\n", GOOD.replace("good", "unknown"));
    let dtype = GOOD.replace("good", "dtype").replacen("TYPE_FP32", "TYPE_INT32", 1);
    let dims = GOOD.replace("good", "dims").replacen("dims: [ 16 ]", "dims: [ 15 ]", 1);
    let unsupported = format!("{}\nsequence_batching {{ }}\n", GOOD.replace("good", "unsupported"));
    let wrong_name = GOOD.replace("good", "other_name");
    let gpu = format!("{}\ninstance_group [ {{ kind: KIND_GPU }} ]\n", GOOD.replace("good", "gpu"));
    let dir = repo(&[
        TestModel { name: "good", source: "identity_fp32", config: Some(GOOD) },
        TestModel { name: "syntax", source: "identity_fp32", config: Some(&syntax) },
        TestModel { name: "unknown", source: "identity_fp32", config: Some(&unknown) },
        TestModel { name: "dtype", source: "identity_fp32", config: Some(&dtype) },
        TestModel { name: "dims", source: "identity_fp32", config: Some(&dims) },
        TestModel { name: "unsupported", source: "identity_fp32", config: Some(&unsupported) },
        TestModel { name: "wrong_name", source: "identity_fp32", config: Some(&wrong_name) },
        TestModel { name: "gpu", source: "identity_fp32", config: Some(&gpu) },
        TestModel { name: "not_onnx", source: "identity_fp32", config: Some(&GOOD.replace("good", "not_onnx")) },
        TestModel { name: "no_file", source: "identity_fp32", config: Some(&GOOD.replace("good", "no_file")) },
    ]);
    std::fs::write(dir.path().join("not_onnx/1/model.onnx"), b"this is not a protobuf").unwrap();
    std::fs::remove_file(dir.path().join("no_file/1/model.onnx")).unwrap();
    std::fs::create_dir_all(dir.path().join("no_versions")).unwrap();
    std::fs::write(dir.path().join("no_versions/config.pbtxt"), GOOD.replace("good", "no_versions")).unwrap();

    let repo = repository(dir.path(), ControlMode::None, false);
    let failed = repo.load_startup_models().await;
    // On a GPU host (a `cuda` build with onnxruntime-gpu) the KIND_GPU model loads.
    let gpu_host = nereid_worker::backend::gpu_count() > 0;
    assert_eq!(failed.len(), if gpu_host { 9 } else { 10 }, "{failed:?}");
    // Strict readiness (Triton's default): models that failed to load make the server not ready.
    assert!(!repo.server_ready());

    let line_of = |text: &str, needle: &str| text.lines().position(|l| l.contains(needle)).unwrap() + 1;
    let r = reason(&repo, "syntax");
    let expected = format!("line {}", line_of(&syntax, "dims: [ 16 }"));
    assert!(r.contains("config.pbtxt") && r.contains(&expected), "{r} (expected {expected})");
    let r = reason(&repo, "unknown");
    let expected = format!("line {}", line_of(&unknown, "bogus_field"));
    assert!(r.contains("bogus_field") && r.contains(&expected), "{r} (expected {expected})");
    assert!(reason(&repo, "dtype").contains("TYPE_INT32"));
    assert!(reason(&repo, "dims").contains("dims"));
    assert!(reason(&repo, "unsupported").contains("'sequence_batching' is not supported"));
    assert!(reason(&repo, "wrong_name").contains("does not match"));
    if gpu_host {
        assert!(repo.model_ready("gpu", None));
    } else {
        let r = reason(&repo, "gpu");
        assert!(r.contains("KIND_GPU") && r.contains("no GPU is available: "), "{r}");
    }
    assert!(reason(&repo, "not_onnx").contains("cannot load"), "{}", reason(&repo, "not_onnx"));
    assert!(reason(&repo, "no_file").contains("missing"));
    assert!(reason(&repo, "no_versions").contains("version"));

    // The good model serves; the broken ones answer UNAVAILABLE naming the reason.
    repo.infer(identity_request("good", None)).await.unwrap();
    let e = repo.infer(identity_request("dtype", None)).await.unwrap_err();
    assert_eq!(e.code, Code::Unavailable);
    assert!(e.message.contains("TYPE_INT32"), "{e}");
    let e = repo.infer(identity_request("nope", None)).await.unwrap_err();
    assert_eq!(e.code, Code::NotFound);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reshape_serves_the_config_shape_over_the_model_shape() {
    // identity_fp32 takes and gives [batch, 16]; clients of this config send [batch, 4, 4] and
    // get [batch, 2, 8].
    let config = r#"
name: "square"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4, 4 ] reshape: { shape: [ 16 ] } } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 2, 8 ] reshape: { shape: [ 16 ] } } ]
dynamic_batching { max_queue_delay_microseconds: 2000 }
"#;
    let dir = repo(&[TestModel { name: "square", source: "identity_fp32", config: Some(config) }]);
    let repo = repository(dir.path(), ControlMode::None, false);
    let failed = repo.load_startup_models().await;
    assert!(failed.is_empty(), "{failed:?}");
    let md = repo.model_metadata("square", None).unwrap();
    assert_eq!(md.inputs[0].shape, vec![-1, 4, 4], "clients see the config's dims");
    let request = |rows: usize, base: f32| {
        let values: Vec<f32> = (0..rows * 16).map(|i| base + i as f32).collect();
        InferRequest {
            model_name: "square".into(),
            inputs: vec![InputTensor {
                name: "INPUT0".into(),
                datatype: DataType::Fp32,
                shape: vec![rows as i64, 4, 4],
                data: Bytes::from(values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()),
            }],
            ..Default::default()
        }
    };
    // Two requests batched together, each answered in its own [rows, 2, 8].
    let (a, b) = tokio::join!(repo.infer(request(2, 0.0)), repo.infer(request(1, 100.0)));
    for (answer, rows, base) in [(a.unwrap(), 2usize, 0.0f32), (b.unwrap(), 1, 100.0)] {
        let out = &answer.outputs[0];
        assert_eq!(out.shape, vec![rows as i64, 2, 8]);
        let got: Vec<f32> = out.data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
        assert_eq!(got, (0..rows * 16).map(|i| base + i as f32).collect::<Vec<_>>());
    }
    // The config's dims are what requests are checked against.
    let mut flat = request(1, 0.0);
    flat.inputs[0].shape = vec![1, 16];
    let e = repo.infer(flat).await.unwrap_err();
    assert!(e.message.contains("expects [batch, 4, 4]"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_response_cache_answers_identical_requests_of_models_that_enable_it() {
    let cached = GOOD.replace("good", "cached") + "response_cache { enable: true }\n";
    let plain = GOOD.replace("good", "plain");
    // Without batching, any number of rows: requests large enough for the cache to hash (and
    // copy) them off the I/O threads.
    let large = GOOD
        .replace("good", "large")
        .replace("max_batch_size: 8", "max_batch_size: 0")
        .replace("dims: [ 16 ]", "dims: [ -1, 16 ]")
        + "response_cache { enable: true }\n";
    let dir = repo(&[
        TestModel { name: "cached", source: "identity_fp32", config: Some(&cached) },
        TestModel { name: "plain", source: "identity_fp32", config: Some(&plain) },
        TestModel { name: "large", source: "identity_fp32", config: Some(&large) },
    ]);
    let with = |bytes: Option<usize>| {
        let repo = Arc::try_unwrap(repository(dir.path(), ControlMode::None, false)).ok().unwrap();
        Arc::new(repo.with_response_cache(bytes))
    };
    let request = |model: &str, fill: u8| {
        let mut r = identity_request(model, None);
        r.inputs[0].data = Bytes::from(vec![fill; 64]);
        r
    };
    let stats = |repo: &Repository, m: &str| repo.model_statistics(Some(m), Some(1)).unwrap()[0].clone();

    let repo = with(Some(1 << 20));
    assert!(repo.load_startup_models().await.is_empty());
    let first = repo.infer(request("cached", 1)).await.unwrap();
    let second = repo.infer(request("cached", 1)).await.unwrap();
    assert_eq!(first.outputs[0].data, second.outputs[0].data);
    assert_eq!(second.outputs[0].shape, vec![1, 16]);
    repo.infer(request("cached", 2)).await.unwrap();
    let s = stats(&repo, "cached");
    assert_eq!((s.cache_hit.count, s.cache_miss.count), (1, 2), "hit on the repeat, miss on the two new inputs");
    assert_eq!((s.execution_count, s.inference_count, s.success.count), (2, 2, 3), "a hit runs nothing");
    // A model without response_cache is never cached.
    for _ in 0..2 {
        repo.infer(request("plain", 1)).await.unwrap();
    }
    let s = stats(&repo, "plain");
    assert_eq!((s.cache_hit.count, s.cache_miss.count, s.execution_count), (0, 0, 2));
    // A request of 320 KB: keyed and kept the same way.
    let big = |fill: u8| {
        let mut r = identity_request("large", None);
        r.inputs[0].shape = vec![5000, 16];
        r.inputs[0].data = Bytes::from(vec![fill; 5000 * 64]);
        r
    };
    let first = repo.infer(big(3)).await.unwrap();
    let again = repo.infer(big(3)).await.unwrap();
    assert_eq!(first.outputs[0].data, again.outputs[0].data);
    assert_eq!(again.outputs[0].data.len(), 5000 * 64);
    repo.infer(big(4)).await.unwrap();
    let s = stats(&repo, "large");
    assert_eq!((s.cache_hit.count, s.cache_miss.count, s.execution_count), (1, 2, 2));
    let text = repo.metrics().render();
    assert!(text.contains("nv_cache_num_hits_per_model{model=\"cached\",version=\"1\"} 1"), "{text}");
    assert!(text.contains("nv_cache_num_misses_per_model{model=\"cached\",version=\"1\"} 2"), "{text}");

    // Without --cache-config the model loads and runs every request.
    let repo = with(None);
    assert!(repo.load_startup_models().await.is_empty());
    for _ in 0..2 {
        repo.infer(request("cached", 1)).await.unwrap();
    }
    assert_eq!(stats(&repo, "cached").execution_count, 2);
    // A reload (new weights may sit under the same version) never answers from before it.
    let explicit = {
        let r = Arc::try_unwrap(repository(dir.path(), ControlMode::Explicit, false)).ok().unwrap();
        Arc::new(r.with_response_cache(Some(1 << 20)))
    };
    explicit.load("cached", None).await.unwrap();
    for _ in 0..2 {
        explicit.infer(request("cached", 1)).await.unwrap();
    }
    explicit.load("cached", None).await.unwrap();
    explicit.infer(request("cached", 1)).await.unwrap();
    let s = stats(&explicit, "cached");
    assert_eq!((s.cache_hit.count, s.cache_miss.count), (1, 2), "the request after the reload ran again");
    // A cache smaller than one response keeps nothing.
    let repo = with(Some(100));
    assert!(repo.load_startup_models().await.is_empty());
    for _ in 0..2 {
        repo.infer(request("cached", 1)).await.unwrap();
    }
    let s = stats(&repo, "cached");
    assert_eq!((s.cache_hit.count, s.cache_miss.count, s.execution_count), (0, 2, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_config_is_auto_completed_unless_strict() {
    let dir = repo(&[TestModel { name: "auto", source: "identity_fp32", config: None }]);
    let repo = repository(dir.path(), ControlMode::None, false);
    assert!(repo.load_startup_models().await.is_empty());
    let c = repo.model_config("auto", None).unwrap();
    assert_eq!(c.max_batch_size, 4);
    assert_eq!(c.input[0].name, "INPUT0");
    assert_eq!(c.input[0].dims, vec![16]);
    assert_eq!(c.output[0].name, "OUTPUT0");
    assert!(nereid_common::config::dynamic_batching(&c).is_some());
    repo.infer(identity_request("auto", None)).await.unwrap();

    let strict = repository(dir.path(), ControlMode::None, true);
    let failed = strict.load_startup_models().await;
    assert!(failed[0].1.contains("strict-model-config"), "{failed:?}");

    // Partial config: batching declared, tensors completed from the model.
    std::fs::write(dir.path().join("auto/config.pbtxt"), "max_batch_size: 2\n").unwrap();
    let partial = repository(dir.path(), ControlMode::None, false);
    assert!(partial.load_startup_models().await.is_empty());
    let c = partial.model_config("auto", None).unwrap();
    assert_eq!((c.max_batch_size, c.input[0].dims.clone()), (2, vec![16]));
}

fn versioned_repo(policy: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for v in [1u32, 2] {
        let vdir = dir.path().join("scale").join(v.to_string());
        std::fs::create_dir_all(&vdir).unwrap();
        std::fs::copy(example_onnx("versioned_scale", v), vdir.join("model.onnx")).unwrap();
    }
    let cfg = format!(
        "name: \"scale\"\nmax_batch_size: 16\ninput [ {{ name: \"INPUT0\" data_type: TYPE_FP32 dims: [ 4 ] }} ]\n\
         output [ {{ name: \"OUTPUT0\" data_type: TYPE_FP32 dims: [ 4 ] }} ]\n{policy}\n"
    );
    std::fs::write(dir.path().join("scale/config.pbtxt"), cfg).unwrap();
    dir
}

async fn scale(repo: &Repository, version: Option<i64>) -> Result<(i64, f32), nereid_common::Status> {
    let data: Vec<u8> = [1.0f32; 4].iter().flat_map(|v| v.to_le_bytes()).collect();
    let r = repo
        .infer(InferRequest {
            model_name: "scale".into(),
            model_version: version,
            inputs: vec![InputTensor {
                name: "INPUT0".into(),
                datatype: DataType::Fp32,
                shape: vec![1, 4],
                data: Bytes::from(data),
            }],
            ..Default::default()
        })
        .await?;
    Ok((r.model_version, f32::from_le_bytes(r.outputs[0].data[..4].try_into().unwrap())))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn version_policies() {
    let cases: [(&str, Vec<i64>); 4] = [
        ("", vec![2]),
        ("version_policy: { latest: { num_versions: 2 } }", vec![1, 2]),
        ("version_policy: { all: { } }", vec![1, 2]),
        ("version_policy: { specific: { versions: [ 1 ] } }", vec![1]),
    ];
    for (policy, expected) in cases {
        let dir = versioned_repo(policy);
        let repo = repository(dir.path(), ControlMode::None, false);
        assert!(repo.load_startup_models().await.is_empty(), "{policy}");
        let meta = repo.model_metadata("scale", None).unwrap();
        assert_eq!(meta.versions, expected.iter().map(|v| v.to_string()).collect::<Vec<_>>(), "{policy}");
        // No version: the latest ready one.
        let latest = *expected.last().unwrap();
        assert_eq!(scale(&repo, None).await.unwrap(), (latest, if latest == 1 { 2.0 } else { 3.0 }));
        for v in [1, 2] {
            let r = scale(&repo, Some(v)).await;
            if expected.contains(&v) {
                assert_eq!(r.unwrap(), (v, if v == 1 { 2.0 } else { 3.0 }));
            } else {
                assert_eq!(r.unwrap_err().code, Code::NotFound, "{policy} v{v}");
            }
        }
    }
    let dir = versioned_repo("version_policy: { specific: { versions: [ 7 ] } }");
    let repo = repository(dir.path(), ControlMode::None, false);
    let failed = repo.load_startup_models().await;
    assert!(failed[0].1.contains("version 7"), "{failed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explicit_mode_loads_only_on_request() {
    let dir = versioned_repo("");
    let repo = repository(dir.path(), ControlMode::Explicit, false);
    assert!(repo.load_startup_models().await.is_empty());
    assert!(!repo.model_ready("scale", None));
    assert_eq!(repo.index(false)[0].state, "", "{:?}", repo.index(false));
    repo.load("scale", None).await.unwrap();
    assert!(repo.model_ready("scale", Some(2)));
    assert_eq!(scale(&repo, None).await.unwrap(), (2, 3.0));
    // A config override (JSON, as Triton's load API takes it) replaces config.pbtxt.
    let cfg = r#"{"name":"scale","max_batch_size":2,"version_policy":{"specific":{"versions":["1"]}},
        "input":[{"name":"INPUT0","data_type":"TYPE_FP32","dims":[4]}],
        "output":[{"name":"OUTPUT0","data_type":"TYPE_FP32","dims":[4]}]}"#;
    repo.load("scale", Some(cfg.to_string())).await.unwrap();
    assert_eq!(repo.model_config("scale", None).unwrap().max_batch_size, 2);
    assert_eq!(scale(&repo, None).await.unwrap(), (1, 2.0));
    let e = repo.load("scale", Some("{not json".into())).await.unwrap_err();
    assert_eq!(e.code, Code::InvalidArgument);
    assert!(e.message.contains("JSON"), "{e}");
    assert_eq!(scale(&repo, None).await.unwrap(), (1, 2.0), "a failed reload keeps the old model");
    repo.unload("scale").await.unwrap();
    assert!(!repo.model_ready("scale", None));
    assert_eq!(repo.index(false)[0].reason, "unloaded");
    assert_eq!(repo.load("missing", None).await.unwrap_err().code, Code::NotFound);
    assert_eq!(repo.unload("missing").await.unwrap_err().code, Code::NotFound);

    let none = repository(dir.path(), ControlMode::None, false);
    assert_eq!(none.load("scale", None).await.unwrap_err().code, Code::FailedPrecondition);
}

/// A `scale` request sent in the background, once it waits in version 2's queue (held there by
/// the test's batching delay).
async fn queued_scale_request(
    repo: &Arc<Repository>,
) -> tokio::task::JoinHandle<Result<(i64, f32), nereid_common::Status>> {
    let in_flight = {
        let repo = repo.clone();
        tokio::spawn(async move { scale(&repo, None).await })
    };
    common::eventually("request queued", || {
        repo.metrics().render().contains("nv_inference_pending_request_count{model=\"scale\",version=\"2\"} 1")
    })
    .await;
    in_flight
}

/// Gives the `scale` model of `versioned_repo` a batching delay of `delay_us`, which keeps a
/// request queued that long: its config's path and new text.
fn hold_in_queue(repo: &std::path::Path, delay_us: u64) -> (std::path::PathBuf, String) {
    let cfg_path = repo.join("scale/config.pbtxt");
    let held = std::fs::read_to_string(&cfg_path).unwrap()
        + &format!("dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}\n");
    std::fs::write(&cfg_path, &held).unwrap();
    (cfg_path, held)
}

/// A batching delay that outlasts any test: a request held by it leaves the queue only when
/// the test completes its batch (`max_batch_size` 16 rows), through [`add_release`].
const HOLD_US: u64 = 600_000_000;

/// Adds to a `versioned_repo` a way to complete a batch of `scale` that no new request can
/// reach any more (the model reloaded or unloaded while a request waits in its queue): an
/// ensemble `release` of two steps, `release_gate` (versioned_scale version 1, x2, holding a
/// lone request for [`HOLD_US`]) then `scale`. An ensemble request looks its composing models
/// up as it begins: sent before the change ([`queued_release`]), it waits at the gate and,
/// once the test completes the gate's batch ([`open_release`]), brings its 15 rows to the
/// `scale` it began with — a full batch with the held request's one.
fn add_release(repo: &std::path::Path) {
    let gate = repo.join("release_gate");
    std::fs::create_dir_all(gate.join("1")).unwrap();
    std::fs::copy(example_onnx("versioned_scale", 1), gate.join("1/model.onnx")).unwrap();
    let gate_config = format!(
        "name: \"release_gate\"\nmax_batch_size: 16\n\
         input [ {{ name: \"INPUT0\" data_type: TYPE_FP32 dims: [ 4 ] }} ]\n\
         output [ {{ name: \"OUTPUT0\" data_type: TYPE_FP32 dims: [ 4 ] }} ]\n\
         dynamic_batching {{ max_queue_delay_microseconds: {HOLD_US} }}\n"
    );
    std::fs::write(gate.join("config.pbtxt"), gate_config).unwrap();
    let ensemble = r#"name: "release"
platform: "ensemble"
max_batch_size: 16
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "release_gate" model_version: -1
    input_map { key: "INPUT0" value: "INPUT0" } output_map { key: "OUTPUT0" value: "gated" } },
  { model_name: "scale" model_version: -1
    input_map { key: "INPUT0" value: "gated" } output_map { key: "OUTPUT0" value: "OUT" } } ] }
"#;
    std::fs::create_dir_all(repo.join("release/1")).unwrap();
    std::fs::write(repo.join("release/config.pbtxt"), ensemble).unwrap();
}

/// `rows` rows of four 1.0 for `model` (a model of `scale`'s tensors).
fn ones(model: &str, rows: usize) -> InferRequest {
    InferRequest {
        model_name: model.into(),
        inputs: vec![InputTensor {
            name: "INPUT0".into(),
            datatype: DataType::Fp32,
            shape: vec![rows as i64, 4],
            data: f32s(&vec![1.0; rows * 4]),
        }],
        ..Default::default()
    }
}

/// A `release` request of 15 rows sent in the background, once it waits at the gate.
async fn queued_release(
    repo: &Arc<Repository>,
) -> tokio::task::JoinHandle<Result<nereid_worker::tensor::InferResponse, nereid_common::Status>> {
    let release = {
        let repo = repo.clone();
        tokio::spawn(async move { repo.infer(ones("release", 15)).await })
    };
    common::eventually("release request at the gate", || {
        repo.metrics().render().contains("nv_inference_pending_request_count{model=\"release_gate\",version=\"1\"} 1")
    })
    .await;
    release
}

/// Completes the gate's batch (one row beside the 15 of [`queued_release`]): the release
/// request goes on to the `scale` it began with.
async fn open_release(repo: &Repository) {
    let answer = within("the row completing the gate's batch", repo.infer(ones("release_gate", 1))).await;
    assert_eq!(floats(&answer.unwrap().outputs[0].data), vec![2.0; 4]);
}

/// Awaits `answer`, failing after 30 s rather than waiting out a batching delay of
/// [`HOLD_US`] (a bound, not a timing assertion).
async fn within<T>(what: &str, answer: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(std::time::Duration::from_secs(30), answer).await {
        Ok(answer) => answer,
        Err(_) => panic!("{what}: no answer within 30 s"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_mode_reloads_changes_without_dropping_in_flight_requests() {
    let dir = versioned_repo("");
    // A request held in the old version's queue across the reload, until `release` completes
    // its batch.
    let (cfg_path, held_cfg) = hold_in_queue(dir.path(), HOLD_US);
    add_release(dir.path());
    let repo = repository(dir.path(), ControlMode::Poll, false);
    assert!(repo.load_startup_models().await.is_empty());
    let release = queued_release(&repo).await;
    let in_flight = queued_scale_request(&repo).await;

    // Change the version policy: both versions should serve after the next poll.
    std::fs::write(&cfg_path, held_cfg.replace("dynamic_batching", "version_policy: { all: { } }\ndynamic_batching"))
        .unwrap();
    repo.poll_once().await;
    assert!(repo.model_ready("scale", Some(1)));
    assert!(!in_flight.is_finished(), "the request was answered before the reload: it did not test it");
    open_release(&repo).await;
    let answer = within("the in-flight request", in_flight).await.unwrap();
    assert_eq!(answer.unwrap(), (2, 3.0), "the in-flight request finished on the old model");
    let answer = within("the release request", release).await.unwrap().unwrap();
    assert_eq!(floats(&answer.outputs[0].data), vec![6.0; 60], "x2 at the gate, x3 in the old version 2");
}

/// POLL mode follows the repository: a broken change keeps the old model serving (and is
/// forgotten once the good files are back), removed models unload, new ones load, and a
/// repository that cannot be listed unloads nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_mode_follows_the_repository_and_keeps_serving_through_broken_changes() {
    let dir = versioned_repo("version_policy: { all: { } }");
    let cfg_path = dir.path().join("scale/config.pbtxt");
    let repo = repository(dir.path(), ControlMode::Poll, false);
    assert!(repo.load_startup_models().await.is_empty());
    assert!(repo.model_ready("scale", Some(1)));

    // A broken change keeps the old model serving.
    let good = std::fs::read(&cfg_path).unwrap();
    let good_mtime = std::fs::metadata(&cfg_path).unwrap().modified().unwrap();
    std::fs::write(&cfg_path, "this is { not a config").unwrap();
    repo.poll_once().await;
    assert!(repo.model_ready("scale", Some(1)));
    let index = repo.index(false);
    assert!(index.iter().all(|e| e.state == "READY" && e.reason.starts_with("reload failed")), "{index:?}");
    // The good config put back as it was (as `cp -a` does, its mtime too): the failure is
    // history, without a reload.
    std::fs::write(&cfg_path, &good).unwrap();
    std::fs::File::options().write(true).open(&cfg_path).unwrap().set_modified(good_mtime).unwrap();
    repo.poll_once().await;
    let index = repo.index(false);
    assert!(index.iter().all(|e| e.state == "READY" && e.reason.is_empty()), "{index:?}");
    // Broken again, for what follows.
    std::fs::write(&cfg_path, "this is { not a config").unwrap();
    repo.poll_once().await;
    let index = repo.index(false);
    assert!(index.iter().all(|e| e.state == "READY" && e.reason.starts_with("reload failed")), "{index:?}");
    // Removing the model unloads it.
    std::fs::remove_dir_all(dir.path().join("scale")).unwrap();
    repo.poll_once().await;
    assert!(!repo.model_ready("scale", None));
    // A new model appears.
    let vdir = dir.path().join("fresh/1");
    std::fs::create_dir_all(&vdir).unwrap();
    std::fs::copy(example_onnx("identity_fp32", 1), vdir.join("model.onnx")).unwrap();
    repo.poll_once().await;
    assert!(repo.model_ready("fresh", None));
    assert!(repo.server_ready());
    // Moved out of the repository, it is unloaded; moved back unchanged (a rename keeps the
    // files' mtimes), it loads again.
    let aside = dir.path().with_extension("aside");
    std::fs::rename(dir.path().join("fresh"), &aside).unwrap();
    repo.poll_once().await;
    assert!(!repo.model_ready("fresh", None));
    std::fs::rename(&aside, dir.path().join("fresh")).unwrap();
    repo.poll_once().await;
    assert!(repo.model_ready("fresh", None), "{:?}", repo.index(false));

    // A model that fails to load makes the server not ready (strict readiness) until it is
    // fixed or, as here, removed from the repository.
    std::fs::create_dir_all(dir.path().join("broken/1")).unwrap();
    std::fs::write(dir.path().join("broken/1/model.onnx"), b"not a model").unwrap();
    repo.poll_once().await;
    assert!(!repo.server_ready(), "{:?}", repo.index(false));
    std::fs::remove_dir_all(dir.path().join("broken")).unwrap();
    repo.poll_once().await;
    assert!(repo.server_ready(), "{:?}", repo.index(false));

    // A repository that cannot be listed (here: its directory gone for a moment, as a mount
    // point between unmount and remount) unloads nothing: its models keep serving.
    let away = dir.path().with_extension("away");
    std::fs::rename(dir.path(), &away).unwrap();
    repo.poll_once().await;
    let back = std::fs::rename(&away, dir.path());
    back.unwrap();
    assert!(repo.model_ready("fresh", None), "{:?}", repo.index(false));
    repo.poll_once().await;
    assert!(repo.model_ready("fresh", None), "{:?}", repo.index(false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warmup_runs_before_ready() {
    let cfg = format!(
        "{GOOD}\nmodel_warmup [ {{ name: \"zeros\" batch_size: 2 count: 3 inputs {{ key: \"INPUT0\" value: {{ data_type: TYPE_FP32 dims: [ 16 ] zero_data: true }} }} }} ]\n"
    );
    let bad = format!(
        "{}\nmodel_warmup [ {{ name: \"bad\" batch_size: 1 inputs {{ key: \"INPUT0\" value: {{ data_type: TYPE_FP32 dims: [ 15 ] random_data: true }} }} }} ]\n",
        GOOD.replace("good", "bad")
    );
    let dir = repo(&[
        TestModel { name: "good", source: "identity_fp32", config: Some(&cfg) },
        TestModel { name: "bad", source: "identity_fp32", config: Some(&bad) },
    ]);
    let repo = repository(dir.path(), ControlMode::None, false);
    let failed = repo.load_startup_models().await;
    assert_eq!(failed.len(), 1);
    assert!(failed[0].1.contains("warmup"), "{failed:?}");
    // Warmup runs on the instance directly: it is not counted as inference traffic.
    repo.infer(identity_request("good", None)).await.unwrap();
    assert_eq!(repo.model_statistics(Some("good"), None).unwrap()[0].success.count, 1);
}

const OPTIONAL_BIAS: &str = r#"
name: "optional_bias"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "BIAS" data_type: TYPE_FP32 dims: [ 4 ] optional: true }
]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
dynamic_batching { max_queue_delay_microseconds: 100000 }
"#;

fn f32s(v: &[f32]) -> Bytes {
    Bytes::from(v.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>())
}

fn floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn optional_inputs_take_the_models_default_and_batch_apart() {
    // BIAS has a default in the model (0.5, an initializer that is also a graph input); in
    // `no_default`, INPUT0 is marked optional but the model has none, so it stays required.
    let no_default = GOOD.replace("good", "no_default").replacen("dims: [ 16 ] }", "dims: [ 16 ] optional: true }", 1);
    let bias_only = OPTIONAL_BIAS.replace("optional_bias", "bias_required").replace(" optional: true", "");
    let dir = repo(&[
        TestModel { name: "optional_bias", source: "optional_bias", config: Some(OPTIONAL_BIAS) },
        TestModel { name: "bias_required", source: "optional_bias", config: Some(&bias_only) },
        TestModel { name: "no_default", source: "identity_fp32", config: Some(&no_default) },
    ]);
    let repo = repository(dir.path(), ControlMode::None, false);
    let failed = repo.load_startup_models().await;
    assert!(failed.is_empty(), "{failed:?}");

    let request = |model: &str, x: f32, bias: Option<f32>| {
        let mut inputs = vec![InputTensor {
            name: "INPUT0".into(),
            datatype: DataType::Fp32,
            shape: vec![1, 4],
            data: f32s(&[x; 4]),
        }];
        if let Some(b) = bias {
            inputs.push(InputTensor {
                name: "BIAS".into(),
                datatype: DataType::Fp32,
                shape: vec![1, 4],
                data: f32s(&[b; 4]),
            });
        }
        InferRequest { model_name: model.into(), inputs, ..Default::default() }
    };
    // Four requests at once, two with BIAS and two without: each gets its own answer, and
    // requests with and without BIAS never share a batch (at least two executions).
    let cases = [(1.0, None), (2.0, Some(10.0)), (3.0, None), (4.0, Some(20.0))];
    let answers =
        futures::future::join_all(cases.iter().map(|&(x, b)| repo.infer(request("optional_bias", x, b)))).await;
    for ((x, b), answer) in cases.iter().zip(answers) {
        let got = floats(&answer.unwrap().outputs[0].data);
        assert_eq!(got, vec![x + b.unwrap_or(0.5); 4], "x={x} bias={b:?}");
    }
    let stats = &repo.model_statistics(Some("optional_bias"), None).unwrap()[0];
    assert_eq!(stats.inference_count, 4);
    assert!(stats.execution_count >= 2, "with and without BIAS batch apart: {stats:?}");

    // Without `optional: true` the same model requires BIAS (it overrides the default).
    let e = repo.infer(request("bias_required", 1.0, None)).await.unwrap_err();
    assert_eq!(e.code, Code::InvalidArgument);
    assert!(e.message.contains("lacks 'BIAS'"), "{}", e.message);
    let answer = repo.infer(request("bias_required", 1.0, Some(2.0))).await.unwrap();
    assert_eq!(floats(&answer.outputs[0].data), vec![3.0; 4]);

    // Optional without a default in the model: loads (with a warning), and stays required —
    // as its served config says.
    assert!(!repo.model_config("no_default", None).unwrap().input[0].optional);
    assert!(repo.model_config("optional_bias", None).unwrap().input[1].optional);
    let e = repo.infer(InferRequest { model_name: "no_default".into(), ..Default::default() }).await.unwrap_err();
    assert!(e.message.contains("lacks 'INPUT0'"), "{}", e.message);
    repo.infer(identity_request("no_default", None)).await.unwrap();
}

fn state(repo: &Repository, name: &str) -> Option<String> {
    repo.index(false).into_iter().find(|e| e.name == name).map(|e| e.state)
}

/// An unload answers at once (as Triton's does); while requests still run on the unloaded
/// model, the index shows it UNLOADING, then UNAVAILABLE "unloaded" once they are done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unloaded_model_shows_unloading_until_its_last_request_finishes() {
    let dir = versioned_repo("");
    // A request held in `scale`'s queue across the unload, until `release` completes its batch.
    hold_in_queue(dir.path(), HOLD_US);
    add_release(dir.path());
    let repo = repository(dir.path(), ControlMode::Explicit, false);
    // The ensemble brings `scale` and the gate with it.
    repo.load("release", None).await.unwrap();
    assert!(repo.model_ready("scale", None));
    let release = queued_release(&repo).await;
    let in_flight = queued_scale_request(&repo).await;
    repo.unload("scale").await.unwrap();
    assert!(!repo.model_ready("scale", None));
    assert_eq!(state(&repo, "scale").as_deref(), Some("UNLOADING"), "{:?}", repo.index(false));
    assert!(!in_flight.is_finished(), "the request was answered before the unload: it did not test it");
    open_release(&repo).await;
    let answer = within("the request in flight", in_flight).await.unwrap();
    assert_eq!(answer.unwrap(), (2, 3.0), "the request in flight finished");
    let answer = within("the release request", release).await.unwrap().unwrap();
    assert_eq!(floats(&answer.outputs[0].data), vec![6.0; 60], "x2 at the gate, x3 in the unloaded version 2");
    common::eventually("UNAVAILABLE once the requests are done", || {
        state(&repo, "scale").as_deref() == Some("UNAVAILABLE")
    })
    .await;
    let index = repo.index(false);
    let row = index.iter().find(|e| e.name == "scale").unwrap();
    assert_eq!(row.reason, "unloaded", "{index:?}");
}

/// Start-up loads run side by side (`--model-load-thread-count`, 4 here): `b_free`, after the
/// gated model in name order, is READY while that one still loads only because loads run at
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_loads_run_side_by_side() {
    let (dir, mut gate) = gated_repo();
    let repo = repository(dir.path(), ControlMode::None, false);
    let startup = tokio::spawn({
        let repo = repo.clone();
        async move { repo.load_startup_models().await }
    });
    common::eventually("b_free READY while a_gated waits for its warm-up data", || {
        state(&repo, "b_free").as_deref() == Some("READY")
    })
    .await;
    assert_eq!(state(&repo, "a_gated").as_deref(), Some("LOADING"));
    assert!(!repo.server_ready(), "start-up loading is not done");
    gate.open();
    let failed = startup.await.unwrap();
    assert!(failed.is_empty(), "{failed:?}");
    assert_eq!(state(&repo, "a_gated").as_deref(), Some("READY"));
    assert!(repo.server_ready());
}

/// A model unloaded (repository API) while start-up is still building it stays unloaded: the
/// finished build is dropped, not put in place over the unload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_unloaded_while_it_is_built_at_start_stays_unloaded() {
    let (dir, mut gate) = gated_repo();
    let options = common::options(dir.path(), ControlMode::Explicit, false);
    let repo = common::repository_with(RepositoryOptions { startup_models: vec!["*".into()], ..options });
    let startup = tokio::spawn({
        let repo = repo.clone();
        async move { repo.load_startup_models().await }
    });
    common::eventually("a_gated LOADING", || state(&repo, "a_gated").as_deref() == Some("LOADING")).await;
    repo.unload("a_gated").await.unwrap();
    gate.open();
    assert!(startup.await.unwrap().is_empty());
    assert_ne!(state(&repo, "a_gated").as_deref(), Some("READY"), "{:?}", repo.index(false));
    assert!(repo.infer(identity_request("a_gated", None)).await.is_err(), "still serving");
    assert!(repo.infer(identity_request("b_free", None)).await.is_ok());
}

/// Loads through the repository API build side by side (outside the change lock): `b_free`
/// loads and serves while `a_gated` is still being built. One model's changes still run in
/// order: an unload of `a_gated` issued during its build waits for the load, then stands.
#[tokio::test(flavor = "current_thread")]
async fn api_loads_build_side_by_side_and_one_models_changes_run_in_order() {
    let (dir, mut gate) = gated_repo();
    let repo = repository(dir.path(), ControlMode::Explicit, false);
    let gated = tokio::spawn({
        let repo = repo.clone();
        async move { repo.load("a_gated", None).await }
    });
    common::eventually("a_gated LOADING", || state(&repo, "a_gated").as_deref() == Some("LOADING")).await;
    tokio::time::timeout(std::time::Duration::from_secs(60), repo.load("b_free", None))
        .await
        .expect("b_free's load waited for a_gated's build")
        .unwrap();
    repo.infer(identity_request("b_free", None)).await.unwrap();
    assert_eq!(state(&repo, "a_gated").as_deref(), Some("LOADING"));

    let unload = tokio::spawn({
        let repo = repo.clone();
        async move { repo.unload("a_gated").await }
    });
    // On this one-thread runtime the unload task runs at each yield: it would finish at its
    // first run if it did not wait for the load.
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    assert!(!unload.is_finished(), "the unload ran in the middle of the load");
    assert_eq!(state(&repo, "a_gated").as_deref(), Some("LOADING"));
    gate.open();
    gated.await.unwrap().unwrap();
    unload.await.unwrap().unwrap();
    assert_eq!(state(&repo, "a_gated").as_deref(), Some("UNAVAILABLE"), "{:?}", repo.index(false));
    assert!(repo.infer(identity_request("a_gated", None)).await.is_err(), "still serving");
    assert!(repo.infer(identity_request("b_free", None)).await.is_ok());
}

/// tritonserver's `--model-config-name`: a model with `configs/<name>.pbtxt` loads with it, one
/// without falls back to its config.pbtxt; `--backend-config=default-max-batch-size` is what
/// auto-complete gives a model that can batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn custom_config_names_and_the_default_max_batch_size_apply() {
    let dir = repo(&[
        TestModel { name: "custom", source: "identity_fp32", config: Some(&GOOD.replace("good", "custom")) },
        TestModel { name: "plain", source: "identity_fp32", config: Some(&GOOD.replace("good", "plain")) },
        TestModel { name: "auto", source: "identity_fp32", config: None },
    ]);
    std::fs::create_dir_all(dir.path().join("custom/configs")).unwrap();
    let h100 = GOOD.replace("good", "custom").replace("max_batch_size: 8", "max_batch_size: 2");
    std::fs::write(dir.path().join("custom/configs/h100.pbtxt"), h100).unwrap();
    let options = common::options(dir.path(), ControlMode::Explicit, false);
    let repo = common::repository_with(RepositoryOptions {
        config_name: Some("h100".into()),
        default_max_batch_size: 32,
        ..options
    });
    for name in ["custom", "plain", "auto"] {
        repo.load(name, None).await.unwrap();
    }
    assert_eq!(repo.model_config("custom", None).unwrap().max_batch_size, 2, "configs/h100.pbtxt");
    assert_eq!(repo.model_config("plain", None).unwrap().max_batch_size, 8, "config.pbtxt");
    assert_eq!(repo.model_config("auto", None).unwrap().max_batch_size, 32, "auto-completed");

    // A broken custom config fails its model, naming the file.
    std::fs::write(dir.path().join("custom/configs/h100.pbtxt"), "max_batch_size: [").unwrap();
    let e = repo.load("custom", None).await.unwrap_err();
    assert!(e.message.contains("configs/h100.pbtxt"), "{}", e.message);
}

/// A POLL pass loads the models it finds new or changed side by side: `b_free` is READY while
/// `a_gated`, first in name order, is still being built.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poll_pass_loads_changed_models_side_by_side() {
    let (dir, mut gate) = gated_repo();
    let repo = repository(dir.path(), ControlMode::Poll, false);
    let pass = tokio::spawn({
        let repo = repo.clone();
        async move { repo.poll_once().await }
    });
    common::eventually("b_free READY while a_gated is built", || state(&repo, "b_free").as_deref() == Some("READY"))
        .await;
    assert_eq!(state(&repo, "a_gated").as_deref(), Some("LOADING"));
    gate.open();
    pass.await.unwrap();
    assert_eq!(state(&repo, "a_gated").as_deref(), Some("READY"));
}

/// Identical loads waiting for one model's turn share one build (a client retrying a slow load
/// does not pile up reloads); a different request — another config — still gets its own.
#[tokio::test(flavor = "current_thread")]
async fn identical_queued_loads_share_one_build() {
    let (dir, mut gate) = gated_repo();
    let repo = repository(dir.path(), ControlMode::Explicit, false);
    let load = |config: Option<String>| {
        let repo = repo.clone();
        tokio::spawn(async move { repo.load("a_gated", config).await })
    };
    let first = load(None);
    common::eventually("a_gated LOADING", || state(&repo, "a_gated").as_deref() == Some("LOADING")).await;
    let before = repo.builds_started();
    let retries: Vec<_> = (0..3).map(|_| load(None)).collect();
    let other = load(Some(r#"{"max_batch_size": 4}"#.to_string()));
    // On this one-thread runtime each task runs to where it waits, at these yields.
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    gate.open();
    first.await.unwrap().unwrap();
    for retry in retries {
        retry.await.unwrap().unwrap();
    }
    other.await.unwrap().unwrap();
    // The first load's build was under way already; then one for the three retries, one for
    // the other config.
    assert_eq!(repo.builds_started() - before, 2);
    assert_eq!(repo.model_config("a_gated", None).unwrap().max_batch_size, 4, "the other config, last");
}

/// A load queued behind an unload runs after it: it does not join an identical load queued
/// before the unload (which would answer it, and the unload then leave the model unloaded
/// although the last request was a successful load).
#[tokio::test(flavor = "current_thread")]
async fn a_load_after_a_queued_unload_does_not_join_the_load_before_it() {
    let (dir, mut gate) = gated_repo();
    let repo = repository(dir.path(), ControlMode::Explicit, false);
    let settle = || async {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    };
    let load = || {
        let repo = repo.clone();
        tokio::spawn(async move { repo.load("a_gated", None).await })
    };
    let first = load();
    common::eventually("a_gated LOADING", || state(&repo, "a_gated").as_deref() == Some("LOADING")).await;
    let queued = load();
    settle().await;
    let unload = tokio::spawn({
        let repo = repo.clone();
        async move { repo.unload("a_gated").await }
    });
    settle().await;
    let last = load();
    settle().await;
    gate.open();
    first.await.unwrap().unwrap();
    queued.await.unwrap().unwrap();
    unload.await.unwrap().unwrap();
    last.await.unwrap().unwrap();
    assert_eq!(state(&repo, "a_gated").as_deref(), Some("READY"), "the last request was a load");
}

/// An ensemble over `a_gated` and `b_free` (the models of [`gated_repo`]), named `ens`.
fn add_gated_ensemble(dir: &std::path::Path) {
    let config = r#"
name: "ens"
platform: "ensemble"
max_batch_size: 8
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUT_A" data_type: TYPE_FP32 dims: [ 16 ] }, { name: "OUT_B" data_type: TYPE_FP32 dims: [ 16 ] } ]
ensemble_scheduling { step [
  { model_name: "a_gated" model_version: -1 input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "OUT_A" } },
  { model_name: "b_free" model_version: -1 input_map { key: "INPUT0" value: "IN" } output_map { key: "OUTPUT0" value: "OUT_B" } }
] }
"#;
    std::fs::create_dir_all(dir.join("ens/1")).unwrap();
    std::fs::write(dir.join("ens/config.pbtxt"), config).unwrap();
}

/// Starts loading `ens`; returns once its load is building `a_gated` (held at the gate).
async fn start_gated_ensemble_load(
    repo: &Arc<Repository>,
) -> tokio::task::JoinHandle<Result<(), nereid_common::Status>> {
    let load = tokio::spawn({
        let repo = repo.clone();
        async move { repo.load("ens", None).await }
    });
    common::eventually("a_gated LOADING for the ensemble", || state(repo, "a_gated").as_deref() == Some("LOADING"))
        .await;
    load
}

fn ensemble_request() -> InferRequest {
    let mut request = identity_request("ens", None);
    request.inputs[0].name = "IN".into();
    request
}

/// Placement takes a model away while an ensemble composing it is still loading: whether an
/// ensemble composes it is decided when the unload's turn comes (where ensembles are put in
/// place), so the ensemble that finished meanwhile keeps it — it was not left READY over a
/// composing model that is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placement_keeps_a_model_an_ensemble_finishing_its_load_composes() {
    let (dir, mut gate) = gated_repo();
    add_gated_ensemble(dir.path());
    let repo = repository(dir.path(), ControlMode::Explicit, false);
    repo.load("b_free", None).await.unwrap();
    // The ensemble's load builds `a_gated` (which it composes) and waits at the gate.
    let load = start_gated_ensemble_load(&repo).await;
    let unload = tokio::spawn({
        let repo = repo.clone();
        async move { repo.unload_placed("b_free").await }
    });
    gate.open();
    load.await.unwrap().unwrap();
    unload.await.unwrap().unwrap();
    assert_eq!(state(&repo, "b_free").as_deref(), Some("READY"), "{:?}", repo.index(false));
    let answer = repo.infer(ensemble_request()).await.unwrap();
    assert_eq!(answer.outputs.len(), 2);
}

/// Unloading an ensemble with its dependents while its load still runs unloads the composing
/// models that load brought in: they are read from the ensemble actually removed, once the
/// load is done, not from the state when the unload was asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unloading_dependents_of_an_ensemble_still_loading_takes_its_composing_models() {
    let (dir, mut gate) = gated_repo();
    add_gated_ensemble(dir.path());
    let repo = repository(dir.path(), ControlMode::Explicit, false);
    let load = start_gated_ensemble_load(&repo).await;
    let unload = tokio::spawn({
        let repo = repo.clone();
        async move { repo.unload_with("ens", true).await }
    });
    gate.open();
    load.await.unwrap().unwrap();
    unload.await.unwrap().unwrap();
    for model in ["ens", "a_gated", "b_free"] {
        assert_ne!(state(&repo, model).as_deref(), Some("READY"), "{model}: {:?}", repo.index(false));
    }
}

/// Warm-up data from `input_data_file`, as Triton reads it: the file holds one row (a longer
/// file gives its first bytes), repeated for each of `batch_size` rows; a file shorter than a
/// row fails the load naming both sizes; a sample of batch size 0 is skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warmup_data_files_hold_one_row() {
    let config = |name: &str, file: &str, batch: u32| {
        format!(
            r#"name: "{name}"
backend: "onnxruntime"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] }} ]
model_warmup [
  {{ name: "skipped" batch_size: 0 inputs {{ key: "INPUT0" value: {{ data_type: TYPE_FP32 dims: [ 16 ] input_data_file: "missing" }} }} }},
  {{ name: "w" batch_size: {batch} inputs {{ key: "INPUT0" value: {{ data_type: TYPE_FP32 dims: [ 16 ] input_data_file: "{file}" }} }} }}
]
"#
        )
    };
    let (one_row, long, short) = (config("one_row", "row", 4), config("long", "long", 8), config("short", "short", 1));
    let dir = repo(&[
        TestModel { name: "one_row", source: "identity_fp32", config: Some(&one_row) },
        TestModel { name: "long", source: "identity_fp32", config: Some(&long) },
        TestModel { name: "short", source: "identity_fp32", config: Some(&short) },
    ]);
    for (model, file, bytes) in [("one_row", "row", 64), ("long", "long", 1000), ("short", "short", 60)] {
        let warmup = dir.path().join(model).join("warmup");
        std::fs::create_dir_all(&warmup).unwrap();
        std::fs::write(warmup.join(file), vec![0u8; bytes]).unwrap();
    }
    let repo = repository(dir.path(), ControlMode::Explicit, false);
    repo.load("one_row", None).await.expect("one row, repeated for the batch");
    repo.load("long", None).await.expect("a longer file gives its first row");
    let e = repo.load("short", None).await.unwrap_err();
    assert!(e.message.contains("holds 60 bytes, but one row of the input takes 64"), "{}", e.message);
    assert_eq!(state(&repo, "one_row").as_deref(), Some("READY"));
}

/// Triton's onnxruntime layout for a model whose weights live in files beside it: the model
/// file is a directory, and its `model.onnx` is the model.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_file_that_is_a_directory_holds_model_onnx() {
    let dir = repo(&[TestModel { name: "identity_fp32", source: "identity_fp32", config: None }]);
    let version = dir.path().join("identity_fp32").join("1");
    std::fs::rename(version.join("model.onnx"), version.join("weights.onnx")).unwrap();
    std::fs::create_dir(version.join("model.onnx")).unwrap();
    std::fs::rename(version.join("weights.onnx"), version.join("model.onnx").join("model.onnx")).unwrap();
    let repo = repository(dir.path(), ControlMode::Explicit, false);
    repo.load("identity_fp32", None).await.expect("model.onnx/model.onnx loads");
    std::fs::remove_file(version.join("model.onnx").join("model.onnx")).unwrap();
    let e = repo.load("identity_fp32", None).await.unwrap_err();
    assert!(e.message.contains("model.onnx/model.onnx' is missing"), "{}", e.message);
}

/// POLL follows symbolic links, as Triton does: a version folder linked to a model store is
/// reloaded when the model file behind the link changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_sees_changes_behind_a_linked_version_folder() {
    let dir = repo(&[TestModel { name: "identity_fp32", source: "identity_fp32", config: None }]);
    let store = tempfile::tempdir().unwrap();
    let version = dir.path().join("identity_fp32").join("1");
    std::fs::rename(&version, store.path().join("v1")).unwrap();
    std::os::unix::fs::symlink(store.path().join("v1"), &version).unwrap();
    let repo = repository(dir.path(), ControlMode::Poll, false);
    assert!(repo.load_startup_models().await.is_empty());
    assert_eq!(state(&repo, "identity_fp32").as_deref(), Some("READY"));
    let before = repo.builds_started();
    repo.poll_once().await;
    assert_eq!(repo.builds_started(), before, "nothing changed");
    // A new model file behind the link (one byte more: its size changes whatever the clock).
    let model = store.path().join("v1").join("model.onnx");
    let mut bytes = std::fs::read(&model).unwrap();
    bytes.push(0);
    std::fs::write(&model, &bytes).unwrap();
    repo.poll_once().await;
    assert_eq!(repo.builds_started(), before + 1, "a reload was tried");
}

/// A name in two repositories fails as ambiguous (as in Triton); once the extra copy is
/// removed — the first copy's files unchanged — the next poll loads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_loads_a_model_once_its_duplicate_in_another_repository_is_removed() {
    let first = repo(&[TestModel { name: "identity_fp32", source: "identity_fp32", config: None }]);
    let second = repo(&[TestModel { name: "identity_fp32", source: "identity_fp32", config: None }]);
    let mut options = common::options(first.path(), ControlMode::Poll, false);
    options.paths.push(second.path().to_path_buf());
    let repo = common::repository_with(options);
    let failed = repo.load_startup_models().await;
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(reason(&repo, "identity_fp32").contains("more than one model repository"));
    repo.poll_once().await;
    assert!(!repo.model_ready("identity_fp32", None), "still ambiguous");
    std::fs::remove_dir_all(second.path().join("identity_fp32")).unwrap();
    repo.poll_once().await;
    assert!(repo.model_ready("identity_fp32", None), "{:?}", repo.index(false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn padded_batches_answer_each_caller_its_own_rows() {
    // nereid.pad_batch: every batch runs at max_batch_size rows; the padding's outputs are
    // dropped, so callers get what the same model answers unpadded. On CPU both ways (on a GPU
    // host KIND_AUTO would take the GPU, whose GEMMs differ by more between batch sizes).
    let mlp = |name: &str, pad: bool| {
        format!(
            r#"
name: "{name}"
max_batch_size: 16
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 256 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 10 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 2000 }}
instance_group [ {{ kind: KIND_CPU }} ]
parameters {{ key: "nereid.pad_batch" value: {{ string_value: "{pad}" }} }}
"#
        )
    };
    let (padded, plain) = (mlp("padded", true), mlp("plain", false));
    // Padded to five million rows of 1 KiB: refused at load, not allocated per batch.
    let huge = mlp("huge", true).replace("max_batch_size: 16", "max_batch_size: 5000000");
    let pad = r#"parameters { key: "nereid.pad_batch" value: { string_value: "true" } }"#;
    let read = |m: &str| std::fs::read_to_string(common::example_models().join(m).join("config.pbtxt")).unwrap();
    let strings = format!("{}\n{pad}\n", read("string_len"));
    let unbatched = format!("{}\n{pad}\n", read("nobatch_add"));
    let dir = repo(&[
        TestModel { name: "padded", source: "mlp_fp32", config: Some(&padded) },
        TestModel { name: "plain", source: "mlp_fp32", config: Some(&plain) },
        TestModel { name: "string_len", source: "string_len", config: Some(&strings) },
        TestModel { name: "nobatch_add", source: "nobatch_add", config: Some(&unbatched) },
        TestModel { name: "huge", source: "mlp_fp32", config: Some(&huge) },
    ]);
    let repo = repository(dir.path(), ControlMode::None, false);
    let failed = repo.load_startup_models().await;
    assert_eq!(failed.len(), 3, "{failed:?}");
    let r = reason(&repo, "huge");
    assert!(r.contains("nereid.pad_batch") && r.contains("max_batch_size 5000000"), "{r}");
    let r = reason(&repo, "string_len");
    assert!(r.contains("nereid.pad_batch") && r.contains("TEXT"), "{r}");
    assert!(reason(&repo, "nobatch_add").contains("needs a batching model"));

    let request = |model: &str, rows: usize, seed: usize| {
        let values: Vec<f32> = (0..rows * 256).map(|i| (((i * 7 + seed * 13) % 101) as f32 - 50.0) / 50.0).collect();
        InferRequest {
            model_name: model.into(),
            inputs: vec![InputTensor {
                name: "INPUT0".into(),
                datatype: DataType::Fp32,
                shape: vec![rows as i64, 256],
                data: Bytes::copy_from_slice(bytemuck::cast_slice(&values)),
            }],
            ..Default::default()
        }
    };
    let run = |model: &'static str, sizes: Vec<usize>| {
        let repo = repo.clone();
        async move {
            let answers = futures::future::join_all(
                sizes.iter().enumerate().map(|(seed, &rows)| repo.infer(request(model, rows, seed))),
            )
            .await;
            answers
                .into_iter()
                .map(|a| {
                    let out = a.unwrap().outputs.remove(0);
                    (out.shape, bytemuck::pod_collect_to_vec::<u8, f32>(&out.data))
                })
                .collect::<Vec<_>>()
        }
    };
    // One request alone (padded from 1 and from 16 rows: none), then several batched together.
    for sizes in [vec![1], vec![16], vec![3], vec![1, 2, 3, 1, 4, 1]] {
        let (got, want) = (run("padded", sizes.clone()).await, run("plain", sizes.clone()).await);
        for ((rows, (shape, values)), (_, expected)) in sizes.iter().zip(&got).zip(&want) {
            assert_eq!(shape, &vec![*rows as i64, 10], "{sizes:?}");
            let err = values.iter().zip(expected).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(err <= 1e-4, "{sizes:?}: a padded answer differs by {err}");
        }
    }
    // Statistics count the callers' rows, not the padding.
    let stats = repo.model_statistics(Some("padded"), None).unwrap();
    assert_eq!(stats[0].inference_count, 1 + 16 + 3 + 12, "{:?}", stats[0]);
}

#[test]
fn an_instance_pads_a_batch_to_its_padded_size() {
    use nereid_worker::backend::{InstanceSession, JobInputs, SessionOptions, TensorSpec, create_session};
    common::init_ort();
    let spec = |name: &str, dims: Vec<i64>| TensorSpec {
        name: name.into(),
        datatype: DataType::Fp32,
        dims,
        reshape: None,
        optional: false,
    };
    let instance = |pad: Option<usize>| {
        let session = create_session(&example_onnx("mlp_fp32", 1), &SessionOptions::default()).unwrap();
        InstanceSession::new(session, vec![spec("INPUT0", vec![256])], vec![spec("OUTPUT0", vec![10])], true)
            .with_padded_batch(pad)
    };
    let (mut padded, mut plain) = (instance(Some(16)), instance(None));
    let rows_of = |rows: usize, seed: usize| -> Vec<Option<(Vec<i64>, Bytes)>> {
        let values: Vec<f32> = (0..rows * 256).map(|i| ((i + seed) % 17) as f32 / 17.0).collect();
        vec![Some((vec![rows as i64, 256], Bytes::copy_from_slice(bytemuck::cast_slice(&values))))]
    };
    let (a, b) = (rows_of(3, 1), rows_of(2, 2));
    let jobs = [JobInputs { rows: 3, inputs: &a }, JobInputs { rows: 2, inputs: &b }];
    let all = |_: usize, _: usize| true;
    for jobs in [&jobs[..1], &jobs[..]] {
        let (got, phases) = padded.run(jobs, &all).unwrap();
        let (want, plain_phases) = plain.run(jobs, &all).unwrap();
        assert_eq!(phases.rows, 16, "the model ran the padded batch");
        assert_eq!(plain_phases.rows, jobs.iter().map(|j| j.rows).sum::<usize>());
        for ((job, got), want) in jobs.iter().zip(&got).zip(&want) {
            assert_eq!(got[0].shape, vec![job.rows as i64, 10]);
            let (g, w): (Vec<f32>, Vec<f32>) =
                (bytemuck::pod_collect_to_vec(&got[0].data), bytemuck::pod_collect_to_vec(&want[0].data));
            assert!(g.iter().zip(&w).all(|(x, y)| (x - y).abs() <= 1e-4), "{g:?} vs {w:?}");
        }
    }
    // A batch already at (or past) the padded size runs as it is.
    let full = rows_of(16, 3);
    let (_, phases) = padded.run(&[JobInputs { rows: 16, inputs: &full }], &all).unwrap();
    assert_eq!(phases.rows, 16);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cuda_keys_are_checked_only_for_gpu_instances() {
    // Triton reads the CUDA provider's keys for GPU instances only: on a CPU model an invalid
    // value is ignored with a warning (tests/gpu.rs checks that a GPU model refuses it).
    let cpu = format!(
        "{}\ninstance_group [ {{ kind: KIND_CPU }} ]\n\
         parameters {{ key: \"cudnn_conv_algo_search\" value: {{ string_value: \"HEURISTIC\" }} }}\n",
        GOOD.replace("good", "cpu")
    );
    let dir = repo(&[TestModel { name: "cpu", source: "identity_fp32", config: Some(&cpu) }]);
    let repo = repository(dir.path(), ControlMode::None, false);
    let failed = repo.load_startup_models().await;
    assert!(failed.is_empty(), "{failed:?}");
    repo.infer(identity_request("cpu", None)).await.unwrap();
}
