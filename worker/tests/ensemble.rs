//! Ensembles with real ONNX Runtime: the example `scale_ensemble` (two chained steps and one in
//! parallel over two versions of `versioned_scale`), composing models loaded on demand in
//! EXPLICIT mode and unloaded with `unload_dependents`, and ensembles that fail to load (each
//! with a reason naming the step or tensor) or fail at run time (naming the step).

mod common;

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use common::{example_models, example_onnx, unavailable_reason as reason};
use nereid_common::{Code, DataType};
use nereid_worker::repository::{ControlMode, Repository};
use nereid_worker::tensor::{InferRequest, InputTensor, RequestedOutput};

fn repository(dir: &Path, mode: ControlMode) -> Arc<Repository> {
    common::repository(dir, mode, false)
}

fn f32_bytes(values: &[f32]) -> Bytes {
    Bytes::from(values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())
}

fn floats(data: &[u8]) -> Vec<f32> {
    data.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
}

fn request(model: &str, rows: &[[f32; 4]], outputs: &[&str]) -> InferRequest {
    let flat: Vec<f32> = rows.iter().flatten().copied().collect();
    InferRequest {
        model_name: model.into(),
        inputs: vec![InputTensor {
            name: "INPUT0".into(),
            datatype: DataType::Fp32,
            shape: vec![rows.len() as i64, 4],
            data: f32_bytes(&flat),
        }],
        outputs: outputs.iter().map(|n| RequestedOutput { name: n.to_string(), ..Default::default() }).collect(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_ensemble_chains_and_parallels_its_steps() {
    let repo = repository(&example_models(), ControlMode::None);
    let failed = repo.load_startup_models().await;
    assert!(failed.is_empty(), "{failed:?}");
    assert!(repo.model_ready("scale_ensemble", None));
    let md = repo.model_metadata("scale_ensemble", None).unwrap();
    assert_eq!(md.platform, "ensemble");
    assert_eq!(md.inputs[0].shape, vec![-1, 4]);

    let rows = [[1.0, 2.0, 3.0, 4.0], [-0.5, 0.0, 0.25, 10.0]];
    let answer = repo.infer(request("scale_ensemble", &rows, &[])).await.unwrap();
    assert_eq!(answer.model_version, 1);
    let names: Vec<&str> = answer.outputs.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(names, ["SCALED6", "SCALED3"], "every output, in config order");
    let flat: Vec<f32> = rows.iter().flatten().copied().collect();
    assert_eq!(answer.outputs[0].shape, vec![2, 4]);
    assert_eq!(floats(&answer.outputs[0].data), flat.iter().map(|x| x * 6.0).collect::<Vec<_>>(), "x2 then x3");
    assert_eq!(floats(&answer.outputs[1].data), flat.iter().map(|x| x * 3.0).collect::<Vec<_>>());
    assert_eq!(answer.outputs[1].datatype, DataType::Fp32);

    // One output asked for: only it comes back.
    let answer = repo.infer(request("scale_ensemble", &rows[..1], &["SCALED3"])).await.unwrap();
    assert_eq!(answer.outputs.len(), 1);
    assert_eq!(floats(&answer.outputs[0].data), vec![3.0, 6.0, 9.0, 12.0]);

    // Statistics: the ensemble and each composing version count their requests.
    let stats = |m: &str, v: i64| repo.model_statistics(Some(m), Some(v)).unwrap()[0].clone();
    assert_eq!(stats("scale_ensemble", 1).success.count, 2);
    assert_eq!(stats("scale_ensemble", 1).inference_count, 3, "rows: 2 + 1");
    assert_eq!(stats("scale_ensemble", 1).execution_count, 2);
    assert_eq!(stats("scale_ensemble", 1).queue.count, 2, "the queue figures count every success");
    // The first request ran every step (one on version 1, two on version 2); the second,
    // asking for SCALED3 only, ran only the step producing it (Triton's pruning).
    assert_eq!(stats("versioned_scale", 1).success.count, 1, "version 1 only feeds SCALED6");
    assert_eq!(stats("versioned_scale", 2).success.count, 3, "two steps, then the SCALED3 one alone");

    // The ensemble checks its own inputs first, naming itself.
    let mut bad = request("scale_ensemble", &rows, &[]);
    bad.inputs[0].shape = vec![2, 3];
    let e = repo.infer(bad).await.unwrap_err();
    assert_eq!(e.code, Code::InvalidArgument);
    assert!(e.message.contains("model 'scale_ensemble' expects [batch, 4]"), "{e}");
    let e = repo.infer(request("scale_ensemble", &rows, &["OUTPUT0"])).await.unwrap_err();
    assert!(e.message.contains("unexpected inference output 'OUTPUT0'"), "{e}");
    assert_eq!(stats("scale_ensemble", 1).fail.count, 2);
}

/// Under `--max-queued-bytes`, an ensemble's request holds its own inputs' place and its steps
/// none: with a budget of exactly one request's inputs, the example ensemble (whose steps fan
/// one tensor out to two models) runs; a second request while the first is held would not
/// fit, but steps never count against their own ensemble.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ensembles_steps_take_no_memory_budget_of_their_own() {
    common::init_ort();
    let options = common::options(&example_models(), ControlMode::None, false);
    let rows = [[1.0, 2.0, 3.0, 4.0], [-0.5, 0.0, 0.25, 10.0]];
    let repo =
        Arc::new(Repository::new(options, Arc::new(nereid_worker::metrics::Metrics::new())).with_max_queued_bytes(32));
    assert!(repo.load_startup_models().await.is_empty());
    for _ in 0..3 {
        let answer = repo.infer(request("scale_ensemble", &rows, &[])).await.expect("fits: 32 bytes of input");
        assert_eq!(floats(&answer.outputs[1].data)[..4], [3.0, 6.0, 9.0, 12.0]);
    }
}

/// A repository holding `versioned_scale` (versions 1 and 2) and the given ensembles.
fn ensemble_repo(ensembles: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let src = example_models().join("versioned_scale");
    for v in [1, 2] {
        let vdir = dir.path().join("versioned_scale").join(v.to_string());
        std::fs::create_dir_all(&vdir).unwrap();
        std::fs::copy(example_onnx("versioned_scale", v), vdir.join("model.onnx")).unwrap();
    }
    std::fs::copy(src.join("config.pbtxt"), dir.path().join("versioned_scale/config.pbtxt")).unwrap();
    for (name, config) in ensembles {
        std::fs::create_dir_all(dir.path().join(name).join("1")).unwrap();
        std::fs::write(dir.path().join(name).join("config.pbtxt"), config).unwrap();
    }
    dir
}

/// An ensemble `name` of one step on `model` mapping `input` → `output`.
fn one_step(name: &str, model: &str, input: &str, output: &str) -> String {
    format!(
        r#"name: "{name}"
platform: "ensemble"
max_batch_size: 16
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] }} ]
ensemble_scheduling {{ step [ {{ model_name: "{model}" model_version: -1
  input_map {{ key: "{input}" value: "INPUT0" }} output_map {{ key: "{output}" value: "OUT" }} }} ] }}
"#
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explicit_loading_brings_composing_models_and_unload_dependents_takes_them() {
    let nested = one_step("outer", "inner", "INPUT0", "OUT");
    let inner = one_step("inner", "versioned_scale", "INPUT0", "OUTPUT0");
    let dir = ensemble_repo(&[("inner", &inner), ("outer", &nested)]);
    let repo = repository(dir.path(), ControlMode::Explicit);
    assert!(repo.load_startup_models().await.is_empty());
    assert!(!repo.model_ready("versioned_scale", None));

    // Loading the outer ensemble loads the inner one, which loads versioned_scale.
    repo.load("outer", None).await.unwrap();
    for m in ["outer", "inner", "versioned_scale"] {
        assert!(repo.model_ready(m, None), "{m} ready");
    }
    let answer = repo.infer(request("outer", &[[1.0, 1.0, 1.0, 1.0]], &[])).await.unwrap();
    assert_eq!(floats(&answer.outputs[0].data), vec![3.0; 4], "latest versioned_scale (x3) through two ensembles");

    // A composing model unloaded under a loaded ensemble: the ensemble fails naming the step.
    repo.unload("versioned_scale").await.unwrap();
    let e = repo.infer(request("outer", &[[1.0; 4]], &[])).await.unwrap_err();
    assert_eq!(e.code, Code::Unavailable, "{e}");
    assert!(e.message.contains("ensemble 'outer' step 0 (model 'inner')"), "{e}");
    assert!(e.message.contains("ensemble 'inner' step 0 (model 'versioned_scale')"), "{e}");
    assert!(e.message.contains("model 'versioned_scale' is not ready"), "{e}");
    // Nor is it ready, or READY in the index (as in Triton), naming what is missing.
    for (m, step) in [("outer", "inner"), ("inner", "versioned_scale")] {
        assert!(!repo.model_ready(m, None), "{m} is not ready without '{step}'");
        assert!(reason(&repo, m).contains(&format!("composing model '{step}'")), "{}", reason(&repo, m));
    }
    // Under strict readiness they hold the server not ready.
    assert_eq!(repo.not_ready_models(), ["inner", "outer"]);

    // Reloading the outer one loads what is missing again; unload_dependents takes all three.
    repo.load("outer", None).await.unwrap();
    assert!(repo.model_ready("versioned_scale", None));
    assert!(repo.model_ready("outer", None) && repo.model_ready("inner", None));
    assert!(repo.not_ready_models().is_empty());
    repo.unload_with("outer", true).await.unwrap();
    for m in ["outer", "inner", "versioned_scale"] {
        assert!(!repo.model_ready(m, None), "{m} unloaded");
    }
    // Without unload_dependents only the ensemble goes.
    repo.load("inner", None).await.unwrap();
    repo.unload_with("inner", false).await.unwrap();
    assert!(!repo.model_ready("inner", None) && repo.model_ready("versioned_scale", None));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_the_steps_name_are_kept_when_placement_narrows_a_composing_model() {
    let config = std::fs::read_to_string(example_models().join("scale_ensemble/config.pbtxt")).unwrap();
    let dir = ensemble_repo(&[("scale_ensemble", &config)]);
    let repo = repository(dir.path(), ControlMode::Explicit);
    assert!(repo.load_startup_models().await.is_empty());
    let held = |repo: &Repository| -> Vec<String> {
        repo.model_metadata("versioned_scale", None).map(|m| m.versions).unwrap_or_default()
    };

    // Placement put only version 1 here; the ensemble's steps name 1 and 2: 2 is loaded beside.
    repo.load_versions("versioned_scale", vec![1]).await.unwrap();
    assert_eq!(held(&repo), ["1"]);
    repo.load("scale_ensemble", None).await.unwrap();
    assert_eq!(held(&repo), ["1", "2"]);
    repo.unload("scale_ensemble").await.unwrap();

    // The same when versioned_scale was loaded with a config override: the override stays.
    let mut config = repo.model_config("versioned_scale", None).unwrap();
    config
        .parameters
        .insert("intra_op_thread_count".into(), nereid_proto::inference::ModelParameter { string_value: "1".into() });
    config.version_policy = Some(nereid_proto::inference::ModelVersionPolicy {
        policy_choice: Some(nereid_proto::inference::model_version_policy::PolicyChoice::Specific(
            nereid_proto::inference::model_version_policy::Specific { versions: vec![1] },
        )),
    });
    let json = nereid_common::config::config_to_json(&config).to_string();
    repo.load("versioned_scale", Some(json)).await.unwrap();
    assert_eq!(held(&repo), ["1"]);
    repo.load("scale_ensemble", None).await.unwrap();
    assert_eq!(held(&repo), ["1", "2"]);
    assert!(
        repo.model_config("versioned_scale", None).unwrap().parameters.contains_key("intra_op_thread_count"),
        "the reload for the ensemble kept the override"
    );
    // A later placement of version 1 only keeps 2 while the ensemble needs it.
    repo.load_versions("versioned_scale", vec![1]).await.unwrap();
    assert_eq!(held(&repo), ["1", "2"]);
    let answer = repo.infer(request("scale_ensemble", &[[1.0, 2.0, 3.0, 4.0]], &["SCALED6"])).await.unwrap();
    assert_eq!(floats(&answer.outputs[0].data), vec![6.0, 12.0, 18.0, 24.0]);
    // Without the ensemble, placement decides alone.
    repo.unload("scale_ensemble").await.unwrap();
    repo.load_versions("versioned_scale", vec![1]).await.unwrap();
    assert_eq!(held(&repo), ["1"]);

    // The same for the version policy: with `latest { 1 }` versioned_scale serves version 2
    // alone, but while the ensemble is loaded a reload keeps version 1 too.
    let config = std::fs::read_to_string(dir.path().join("versioned_scale/config.pbtxt")).unwrap();
    let latest = config.replace("version_policy: { all: { } }", "version_policy: { latest: { num_versions: 1 } }");
    assert_ne!(latest, config);
    std::fs::write(dir.path().join("versioned_scale/config.pbtxt"), latest).unwrap();
    repo.load("versioned_scale", None).await.unwrap();
    assert_eq!(held(&repo), ["2"]);
    repo.load("scale_ensemble", None).await.unwrap();
    assert_eq!(held(&repo), ["1", "2"]);
    repo.load("versioned_scale", None).await.unwrap();
    assert_eq!(held(&repo), ["1", "2"], "a reload keeps what the ensemble names");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_inflight_requests_lets_one_request_through_the_pipeline_at_a_time() {
    // A composing model that waits up to 200 ms to fill a batch: requests that reach it
    // together run as one batch, requests let through one at a time run alone.
    let dir = tempfile::tempdir().unwrap();
    let vdir = dir.path().join("slow_identity/1");
    std::fs::create_dir_all(&vdir).unwrap();
    std::fs::copy(example_onnx("identity_fp32", 1), vdir.join("model.onnx")).unwrap();
    std::fs::write(
        dir.path().join("slow_identity/config.pbtxt"),
        "name: \"slow_identity\"\nmax_batch_size: 8\n\
         input [ { name: \"INPUT0\" data_type: TYPE_FP32 dims: [ 16 ] } ]\n\
         output [ { name: \"OUTPUT0\" data_type: TYPE_FP32 dims: [ 16 ] } ]\n\
         dynamic_batching { max_queue_delay_microseconds: 200000 }\n",
    )
    .unwrap();
    for (name, limit) in [("limited", 1), ("unlimited", 0)] {
        std::fs::create_dir_all(dir.path().join(name).join("1")).unwrap();
        let config = format!(
            r#"name: "{name}"
platform: "ensemble"
max_batch_size: 8
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 16 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 16 ] }} ]
ensemble_scheduling {{ max_inflight_requests: {limit} step [ {{ model_name: "slow_identity" model_version: -1
  input_map {{ key: "INPUT0" value: "X" }} output_map {{ key: "OUTPUT0" value: "Y" }} }} ] }}
"#
        );
        std::fs::write(dir.path().join(name).join("config.pbtxt"), config).unwrap();
    }
    let repo = repository(dir.path(), ControlMode::None);
    let failed = repo.load_startup_models().await;
    assert!(failed.is_empty(), "{failed:?}");
    assert!(
        repo.index(false).iter().all(|e| e.reason.is_empty()),
        "max_inflight_requests is implemented, not warned about: {:?}",
        repo.index(false)
    );
    let four = |model: &'static str| {
        let repo = repo.clone();
        async move {
            let calls = (0..4).map(|i| {
                let input = InputTensor {
                    name: "X".into(),
                    datatype: DataType::Fp32,
                    shape: vec![1, 16],
                    data: f32_bytes(&[i as f32; 16]),
                };
                repo.infer(InferRequest { model_name: model.into(), inputs: vec![input], ..Default::default() })
            });
            for (i, answer) in futures::future::join_all(calls).await.into_iter().enumerate() {
                assert_eq!(floats(&answer.unwrap().outputs[0].data), vec![i as f32; 16], "{model} request {i}");
            }
        }
    };
    let executions = || repo.model_statistics(Some("slow_identity"), None).unwrap()[0].execution_count;
    four("limited").await;
    assert_eq!(executions(), 4, "one request in the pipeline at a time: four batches of one");

    // A request waiting for its turn gives up at its KServe timeout (20 ms), while the one
    // ahead of it waits out the composing model's 200 ms batch window and succeeds.
    let input =
        || InputTensor { name: "X".into(), datatype: DataType::Fp32, shape: vec![1, 16], data: f32_bytes(&[1.0; 16]) };
    let ahead = repo.infer(InferRequest { model_name: "limited".into(), inputs: vec![input()], ..Default::default() });
    let behind = repo.infer(InferRequest {
        model_name: "limited".into(),
        inputs: vec![input()],
        timeout_us: 20_000,
        ..Default::default()
    });
    let (ahead, behind) = tokio::join!(ahead, behind);
    assert_eq!(floats(&ahead.unwrap().outputs[0].data), vec![1.0; 16]);
    let e = behind.unwrap_err();
    assert_eq!(e.code, nereid_common::Code::DeadlineExceeded, "{}", e.message);
    assert!(e.message.contains("waiting for the ensemble's turn"), "{}", e.message);
    assert_eq!(executions(), 5, "the request that timed out never reached the composing model");
    four("unlimited").await;
    assert!(executions() < 4 + 4, "without the limit the four requests share a batch");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn composing_models_stay_while_a_loaded_ensemble_uses_them() {
    let one = one_step("one", "versioned_scale", "INPUT0", "OUTPUT0");
    let two = one_step("two", "versioned_scale", "INPUT0", "OUTPUT0") + "response_cache { enable: true }\n";
    let dir = ensemble_repo(&[("one", &one), ("two", &two)]);
    let repo = {
        let r = Arc::try_unwrap(repository(dir.path(), ControlMode::Explicit)).ok().unwrap();
        Arc::new(r.with_response_cache(Some(1 << 20)))
    };
    assert!(repo.load_startup_models().await.is_empty());
    // Placement (which knows nothing of ensembles) takes versioned_scale away: it stays.
    repo.load_versions("one", vec![1]).await.unwrap();
    repo.unload_placed("versioned_scale").await.unwrap();
    assert!(repo.model_ready("versioned_scale", None));
    repo.infer(request("one", &[[1.0; 4]], &[])).await.unwrap();

    // unload_dependents leaves a composing model another loaded ensemble uses.
    repo.load("two", None).await.unwrap();
    repo.unload_with("one", true).await.unwrap();
    assert!(!repo.model_ready("one", None) && repo.model_ready("versioned_scale", None));
    // Once nothing uses it, placement may take it.
    let cached = |repo: &Repository| repo.model_statistics(Some("two"), Some(1)).unwrap()[0].cache_hit.count;
    for _ in 0..2 {
        repo.infer(request("two", &[[1.0; 4]], &[])).await.unwrap();
    }
    assert_eq!(cached(&repo), 1, "the repeat came from the cache");
    // An ensemble's cached answers go stale when a composing model reloads.
    repo.load("versioned_scale", None).await.unwrap();
    repo.infer(request("two", &[[1.0; 4]], &[])).await.unwrap();
    assert_eq!(cached(&repo), 1, "after the reload the ensemble ran again");
    repo.unload("two").await.unwrap();
    repo.unload_placed("versioned_scale").await.unwrap();
    assert!(!repo.model_ready("versioned_scale", None));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_ensembles_fail_to_load_with_the_reason_and_others_keep_serving() {
    let unknown = one_step("unknown", "no_such_model", "INPUT0", "OUTPUT0");
    let wrong_input = one_step("wrong_input", "versioned_scale", "X", "OUTPUT0");
    let wrong_output = one_step("wrong_output", "versioned_scale", "INPUT0", "Y");
    let wrong_type = one_step("wrong_type", "versioned_scale", "INPUT0", "OUTPUT0")
        .replace("output [ { name: \"OUT\" data_type: TYPE_FP32", "output [ { name: \"OUT\" data_type: TYPE_FP16");
    let cycle_a = one_step("cycle_a", "cycle_b", "INPUT0", "OUT");
    let cycle_b = one_step("cycle_b", "cycle_a", "INPUT0", "OUT");
    let dangling = one_step("dangling", "versioned_scale", "INPUT0", "OUTPUT0")
        .replace("value: \"INPUT0\" }", "value: \"nowhere\" }");
    let namespace = one_step("namespace", "versioned_scale", "INPUT0", "OUTPUT0")
        .replace("model_version: -1", "model_version: -1 model_namespace: \"ns\"");
    let missing_version = one_step("missing_version", "versioned_scale", "INPUT0", "OUTPUT0")
        .replace("model_version: -1", "model_version: 7");
    let good = one_step("good", "versioned_scale", "INPUT0", "OUTPUT0");
    let dir = ensemble_repo(&[
        ("unknown", &unknown),
        ("wrong_input", &wrong_input),
        ("wrong_output", &wrong_output),
        ("wrong_type", &wrong_type),
        ("cycle_a", &cycle_a),
        ("cycle_b", &cycle_b),
        ("dangling", &dangling),
        ("namespace", &namespace),
        ("missing_version", &missing_version),
        ("good", &good),
    ]);
    let repo = repository(dir.path(), ControlMode::None);
    let failed = repo.load_startup_models().await;
    let mut names: Vec<&str> = failed.iter().map(|(n, _)| n.as_str()).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "cycle_a",
            "cycle_b",
            "dangling",
            "missing_version",
            "namespace",
            "unknown",
            "wrong_input",
            "wrong_output",
            "wrong_type"
        ],
        "{failed:?}"
    );
    let r = reason(&repo, "unknown");
    assert!(r.contains("composing model 'no_such_model' could not be loaded"), "{r}");
    let r = reason(&repo, "wrong_input");
    assert!(r.contains("step[0] ('versioned_scale').input_map: 'versioned_scale' has no input 'X'"), "{r}");
    assert!(reason(&repo, "wrong_output").contains("has no output 'Y'"));
    let r = reason(&repo, "wrong_type");
    assert!(r.contains("output 'OUT': declared FP16, but the step producing it gives FP32"), "{r}");
    for (a, b) in [("cycle_a", "cycle_b"), ("cycle_b", "cycle_a")] {
        let r = reason(&repo, a);
        assert!(r.contains("ensembles form a cycle: ") && r.contains(&format!("{a} → {b}")), "{r}");
    }
    assert!(reason(&repo, "dangling").contains("reads tensor 'nowhere'"));
    assert!(reason(&repo, "namespace").contains("'ensemble_scheduling.step.model_namespace' is not supported"));
    assert!(reason(&repo, "missing_version").contains("has no version 7"));

    // The good ensemble and its composing model serve; a broken one answers UNAVAILABLE.
    let answer = repo.infer(request("good", &[[2.0; 4]], &[])).await.unwrap();
    assert_eq!(floats(&answer.outputs[0].data), vec![6.0; 4]);
    let e = repo.infer(request("wrong_type", &[[2.0; 4]], &[])).await.unwrap_err();
    assert_eq!(e.code, Code::Unavailable);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ensemble_whose_composing_model_changed_its_tensors_is_unavailable() {
    let dir = tempfile::tempdir().unwrap();
    for model in ["scale_ensemble", "versioned_scale"] {
        let from = example_models().join(model);
        for entry in walk(&from) {
            let to = dir.path().join(model).join(entry.strip_prefix(&from).unwrap());
            std::fs::create_dir_all(to.parent().unwrap()).unwrap();
            std::fs::copy(&entry, &to).unwrap();
        }
    }
    let repo = repository(dir.path(), ControlMode::Explicit);
    repo.load("scale_ensemble", None).await.unwrap();
    assert!(repo.model_ready("scale_ensemble", None));

    // versioned_scale reloaded as a model of 16-wide rows: the ensemble's 4-wide tensors no
    // longer fit its steps.
    let config = std::fs::read_to_string(dir.path().join("versioned_scale/config.pbtxt")).unwrap();
    std::fs::write(dir.path().join("versioned_scale/config.pbtxt"), config.replace("dims: [ 4 ]", "dims: [ 16 ]"))
        .unwrap();
    for v in [1, 2] {
        std::fs::copy(example_onnx("identity_fp32", 1), dir.path().join(format!("versioned_scale/{v}/model.onnx")))
            .unwrap();
    }
    repo.load("versioned_scale", None).await.unwrap();
    assert!(repo.model_ready("versioned_scale", None));
    assert!(!repo.model_ready("scale_ensemble", None), "the ensemble's steps no longer fit");
    let why = reason(&repo, "scale_ensemble");
    assert!(why.contains("no longer fits") && why.contains("versioned_scale"), "{why}");
    assert!(repo.not_ready_models().contains(&"scale_ensemble".to_string()));
    // Its requests are refused as not ready, not run into a step that no longer fits.
    let e = repo.infer(request("scale_ensemble", &[[1.0; 4]], &[])).await.unwrap_err();
    assert_eq!(e.code, Code::Unavailable, "{e}");
    assert!(e.message.contains("is not ready") && e.message.contains("no longer fits"), "{e}");
}

/// Awaits `answer`, failing after 30 s rather than waiting out a batching delay of 600 s (a
/// bound, not a timing assertion).
async fn within<T>(what: &str, answer: impl std::future::Future<Output = T>) -> T {
    match tokio::time::timeout(std::time::Duration::from_secs(30), answer).await {
        Ok(answer) => answer,
        Err(_) => panic!("{what}: no answer within 30 s"),
    }
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() { out.extend(walk(&path)) } else { out.push(path) }
    }
    out
}

/// A request that has begun runs every step on the composing models it began with: one
/// unloaded while the request waits in an earlier step's queue still answers its step (the
/// request holds it until it ends); the next request is refused, the ensemble not ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_composing_model_unloaded_mid_request_still_serves_that_request() {
    let chain = r#"name: "chain"
platform: "ensemble"
max_batch_size: 16
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [
  { model_name: "slow_scale" model_version: -1
    input_map { key: "INPUT0" value: "INPUT0" } output_map { key: "OUTPUT0" value: "mid" } },
  { model_name: "versioned_scale" model_version: -1
    input_map { key: "INPUT0" value: "mid" } output_map { key: "OUTPUT0" value: "OUT" } } ] }
"#;
    let dir = ensemble_repo(&[("chain", chain)]);
    // versioned_scale's version 2 (x3) behind a batcher that holds a lone request for 600 s:
    // until the test completes its batch (16 rows).
    let slow = dir.path().join("slow_scale");
    std::fs::create_dir_all(slow.join("1")).unwrap();
    std::fs::copy(example_onnx("versioned_scale", 2), slow.join("1/model.onnx")).unwrap();
    let config = std::fs::read_to_string(dir.path().join("versioned_scale/config.pbtxt"))
        .unwrap()
        .replace("name: \"versioned_scale\"", "name: \"slow_scale\"")
        + "dynamic_batching { preferred_batch_size: [ 16 ] max_queue_delay_microseconds: 600000000 }\n";
    std::fs::write(slow.join("config.pbtxt"), config).unwrap();
    common::init_ort();
    let metrics = Arc::new(nereid_worker::metrics::Metrics::new());
    let repo = Arc::new(Repository::new(common::options(dir.path(), ControlMode::Explicit, false), metrics.clone()));
    repo.load("chain", None).await.unwrap();
    assert!(repo.model_ready("slow_scale", None) && repo.model_ready("versioned_scale", None));

    let running = tokio::spawn({
        let repo = repo.clone();
        async move { repo.infer(request("chain", &[[1.0; 4]], &[])).await }
    });
    // Wait (bounded) until the request sits in slow_scale's queue: it has begun.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while metrics.pending_total() == 0 {
        assert!(std::time::Instant::now() < deadline, "the request never reached slow_scale's queue");
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
    repo.unload("versioned_scale").await.unwrap();
    assert!(!repo.model_ready("versioned_scale", None));
    // The unload happened while the request was still in its first step.
    assert_eq!(metrics.version("slow_scale", 1).pending(), 1, "the request left slow_scale's queue before the unload");
    assert!(!running.is_finished());
    // Fifteen more rows complete slow_scale's batch: the request goes on to its second step.
    let rows = request("slow_scale", &[[1.0; 4]; 15], &[]);
    let filler = within("the rows completing slow_scale's batch", repo.infer(rows)).await.unwrap();
    assert_eq!(floats(&filler.outputs[0].data), vec![3.0; 60]);
    let answer =
        within("the request that had begun", running).await.unwrap().expect("the request that had begun is answered");
    assert_eq!(floats(&answer.outputs[0].data), vec![9.0; 4], "x3 in slow_scale, then x3 in versioned_scale 2");
    let e = repo.infer(request("chain", &[[1.0; 4]], &[])).await.unwrap_err();
    assert_eq!(e.code, Code::Unavailable, "{e}");
}

/// POLL mode: an ensemble that failed to load for want of its composing model loads once that
/// model appears, its own files unchanged (as Triton reloads an ensemble when what it depends
/// on loads).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_loads_a_failed_ensemble_once_its_composing_model_appears() {
    let inner = one_step("inner", "versioned_scale", "INPUT0", "OUTPUT0");
    let dir = ensemble_repo(&[("inner", &inner)]);
    let aside = tempfile::tempdir().unwrap();
    std::fs::rename(dir.path().join("versioned_scale"), aside.path().join("versioned_scale")).unwrap();
    let repo = repository(dir.path(), ControlMode::Poll);
    let failed = repo.load_startup_models().await;
    assert_eq!(failed.iter().map(|(m, _)| m.as_str()).collect::<Vec<_>>(), ["inner"], "{failed:?}");
    // Nothing changed on disk: a pass leaves it failed.
    repo.poll_once().await;
    assert!(!repo.model_ready("inner", None));
    // The composing model appears: it loads, and so does the ensemble.
    std::fs::rename(aside.path().join("versioned_scale"), dir.path().join("versioned_scale")).unwrap();
    repo.poll_once().await;
    assert!(repo.model_ready("versioned_scale", None));
    assert!(repo.model_ready("inner", None), "{:?}", repo.index(false));
    let answer = repo.infer(request("inner", &[[1.0; 4]], &[])).await.unwrap();
    assert_eq!(floats(&answer.outputs[0].data), vec![3.0; 4]);
}
