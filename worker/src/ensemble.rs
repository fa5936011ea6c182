//! Ensembles (`platform: "ensemble"`): a DAG of steps, each an inference on another model of
//! the repository, wired together by tensor names (Triton's `ensemble_scheduling`).
//!
//! [`plan`] checks a config's steps without looking at any other model — every step input
//! comes from an ensemble input or exactly one step output, every ensemble output is produced,
//! nothing is produced twice, no cycle — and orders the steps in waves: the steps of a wave
//! depend only on earlier waves, so they run concurrently. [`check_composing`] then checks the
//! plan against the composing models' own specs (tensor names and datatypes) once they are
//! loaded. Execution lives in the repository: each step is an ordinary request to its model, so
//! composing models batch ensemble traffic together with their direct traffic.

use std::collections::{BTreeMap, HashMap};

use nereid_common::DataType;
use nereid_proto::inference::ModelConfig;
use nereid_proto::inference::model_config::SchedulingChoice;

use crate::validate::ModelSpec;

/// Most nested ensemble levels one request may go through (a guard against a cycle formed
/// by reloading a composing ensemble after its parent was checked).
pub const MAX_DEPTH: usize = 8;

/// One step: which model runs, and how its tensors map to the ensemble's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    pub model: String,
    /// `None`: the model's latest ready version (`model_version: -1`).
    pub version: Option<i64>,
    /// (model input, ensemble tensor), sorted by model input.
    pub inputs: Vec<(String, String)>,
    /// (model output, ensemble tensor), sorted by model output.
    pub outputs: Vec<(String, String)>,
}

/// A checked ensemble: its steps and the order they run in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub steps: Vec<Step>,
    /// Indices into `steps`; each wave depends only on the ensemble inputs and earlier waves.
    pub waves: Vec<Vec<usize>>,
}

impl Plan {
    /// Which steps a request asking for the ensemble outputs `wanted` needs: those producing a
    /// wanted output or a tensor a needed step reads. As Triton prunes an ensemble, a step
    /// whose outputs nobody asked for does not run (its time and failures are not the
    /// request's).
    pub fn needed_steps(&self, wanted: &[&str]) -> Vec<bool> {
        let mut tensors: std::collections::HashSet<&str> = wanted.iter().copied().collect();
        let mut needed = vec![false; self.steps.len()];
        for wave in self.waves.iter().rev() {
            for &i in wave {
                let step = &self.steps[i];
                if step.outputs.iter().any(|(_, t)| tensors.contains(t.as_str())) {
                    needed[i] = true;
                    tensors.extend(step.inputs.iter().map(|(_, t)| t.as_str()));
                }
            }
        }
        needed
    }

    /// Distinct composing model names, in step order.
    pub fn models(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        for s in &self.steps {
            if !out.contains(&s.model.as_str()) {
                out.push(&s.model);
            }
        }
        out
    }
}

/// Whether `config` declares an ensemble.
pub fn is_ensemble(config: &ModelConfig) -> bool {
    config.platform == "ensemble" || matches!(config.scheduling_choice, Some(SchedulingChoice::EnsembleScheduling(_)))
}

/// Checks an ensemble config's steps and orders them; the error names the step or tensor.
pub fn plan(config: &ModelConfig) -> Result<Plan, String> {
    if config.platform != "ensemble" {
        return Err(format!(
            "ensemble_scheduling needs platform: \"ensemble\" (got platform '{}', backend '{}')",
            config.platform, config.backend
        ));
    }
    if !config.backend.is_empty() {
        return Err(format!("an ensemble has no backend, got backend '{}'", config.backend));
    }
    let Some(SchedulingChoice::EnsembleScheduling(ensemble)) = &config.scheduling_choice else {
        return Err("platform \"ensemble\" needs ensemble_scheduling { step [ ... ] }".into());
    };
    if ensemble.step.is_empty() {
        return Err("ensemble_scheduling: needs at least one step".into());
    }
    if config.input.is_empty() || config.output.is_empty() {
        return Err("an ensemble's config must declare its inputs and outputs (it cannot be auto-completed)".into());
    }

    // Who produces each ensemble tensor: `None` for an ensemble input, `Some(i)` for step i.
    let mut producer: HashMap<&str, Option<usize>> = HashMap::new();
    for input in &config.input {
        producer.insert(&input.name, None);
    }
    let mut steps = Vec::with_capacity(ensemble.step.len());
    for (i, s) in ensemble.step.iter().enumerate() {
        let at = format!("ensemble_scheduling.step[{i}]");
        if s.model_name.is_empty() {
            return Err(format!("{at}.model_name: must name a model"));
        }
        if s.model_name == config.name {
            return Err(format!("{at}.model_name: an ensemble cannot be a step of itself"));
        }
        if s.input_map.is_empty() {
            return Err(format!("{at}.input_map: must map at least one input of '{}'", s.model_name));
        }
        if s.output_map.is_empty() {
            return Err(format!("{at}.output_map: must map at least one output of '{}'", s.model_name));
        }
        for (map, pairs) in [("input_map", &s.input_map), ("output_map", &s.output_map)] {
            if let Some((k, v)) = pairs.iter().find(|(k, v)| k.is_empty() || v.is_empty()) {
                return Err(format!("{at}.{map}: empty tensor name in '{k}' → '{v}'"));
            }
        }
        // Two model outputs mapped to one ensemble tensor: caught below as a double producer.
        for tensor in s.output_map.values() {
            if let Some(previous) = producer.insert(tensor, Some(i)) {
                let by = match previous {
                    None => "it is an ensemble input".to_string(),
                    Some(j) => format!("step[{j}] produces it too"),
                };
                return Err(format!("{at}.output_map: tensor '{tensor}' is produced twice ({by})"));
            }
        }
        let sorted = |m: &std::collections::HashMap<String, String>| {
            let mut v: Vec<(String, String)> = m.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
            v.sort();
            v
        };
        steps.push(Step {
            model: s.model_name.clone(),
            version: (s.model_version >= 0).then_some(s.model_version),
            inputs: sorted(&s.input_map),
            outputs: sorted(&s.output_map),
        });
    }
    for (i, step) in steps.iter().enumerate() {
        for (model_input, tensor) in &step.inputs {
            if !producer.contains_key(tensor.as_str()) {
                return Err(format!(
                    "ensemble_scheduling.step[{i}].input_map: '{model_input}' reads tensor '{tensor}', which is \
                     neither an ensemble input nor any step's output"
                ));
            }
        }
    }
    for output in &config.output {
        match producer.get(output.name.as_str()) {
            Some(Some(_)) => {}
            Some(None) => {
                return Err(format!("output '{}': an ensemble input cannot be an ensemble output", output.name));
            }
            None => return Err(format!("output '{}': no step's output_map produces it", output.name)),
        }
    }
    let consumed: std::collections::HashSet<&str> =
        steps.iter().flat_map(|s| s.inputs.iter().map(|(_, t)| t.as_str())).collect();
    if let Some(unused) = config.input.iter().find(|i| !consumed.contains(i.name.as_str())) {
        return Err(format!("input '{}': no step's input_map reads it", unused.name));
    }

    // Waves (Kahn's algorithm over the step graph).
    let deps: Vec<Vec<usize>> = steps
        .iter()
        .map(|s| {
            let mut d: Vec<usize> = s.inputs.iter().filter_map(|(_, t)| producer[t.as_str()]).collect();
            d.sort_unstable();
            d.dedup();
            d
        })
        .collect();
    let mut done = vec![false; steps.len()];
    let mut waves = Vec::new();
    while done.iter().any(|d| !d) {
        let wave: Vec<usize> = (0..steps.len()).filter(|&i| !done[i] && deps[i].iter().all(|&d| done[d])).collect();
        if wave.is_empty() {
            let stuck: Vec<String> =
                (0..steps.len()).filter(|&i| !done[i]).map(|i| format!("step[{i}] ('{}')", steps[i].model)).collect();
            return Err(format!("ensemble_scheduling: the steps form a cycle among {}", stuck.join(", ")));
        }
        for &i in &wave {
            done[i] = true;
        }
        waves.push(wave);
    }
    Ok(Plan { steps, waves })
}

/// Checks the plan against its composing models' specs: every mapped input and output exists,
/// and each ensemble tensor has one datatype — the producer's (an ensemble input's is the
/// config's), which every consumer and the ensemble output must expect. `spec_of(step)` is the
/// composing model's spec (the version the step names, else its latest).
pub fn check_composing(
    config: &ModelConfig,
    plan: &Plan,
    spec_of: impl Fn(&Step) -> Result<std::sync::Arc<ModelSpec>, String>,
) -> Result<(), String> {
    let mut dtype: BTreeMap<String, DataType> = BTreeMap::new();
    // Each ensemble tensor's full shape (batch dimension included, as -1, where its producer
    // batches), as its producer declares it.
    let mut shape: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    let ensemble_batches = config.max_batch_size > 0;
    for input in &config.input {
        if let Some(dt) = DataType::from_config_value(input.data_type) {
            dtype.insert(input.name.clone(), dt);
        }
        shape.insert(input.name.clone(), full_shape(ensemble_batches, &input.dims));
    }
    let specs: Vec<std::sync::Arc<ModelSpec>> = plan
        .steps
        .iter()
        .enumerate()
        .map(|(i, s)| spec_of(s).map_err(|e| format!("ensemble_scheduling.step[{i}] ('{}'): {e}", s.model)))
        .collect::<Result<_, _>>()?;
    for wave in &plan.waves {
        for &i in wave {
            let (step, spec) = (&plan.steps[i], &specs[i]);
            let at = format!("ensemble_scheduling.step[{i}] ('{}')", step.model);
            if config.max_batch_size > 0
                && spec.max_batch_size > 0
                && spec.max_batch_size < config.max_batch_size as usize
            {
                return Err(format!(
                    "{at}: max_batch_size {} of '{}' is below the ensemble's {}: larger requests would fail at \
                     this step",
                    spec.max_batch_size, step.model, config.max_batch_size
                ));
            }
            for (name, tensor) in &step.inputs {
                let Some(t) = spec.inputs.iter().find(|t| &t.name == name) else {
                    return Err(format!(
                        "{at}.input_map: '{}' has no input '{name}' (inputs: {})",
                        step.model,
                        list(spec.inputs.iter().map(|t| t.name.as_str()))
                    ));
                };
                if let Some(&have) = dtype.get(tensor)
                    && have != t.datatype
                {
                    return Err(format!(
                        "{at}.input_map: tensor '{tensor}' is {have}, but input '{name}' of '{}' expects {}",
                        step.model, t.datatype
                    ));
                }
                let want = full_shape(spec.max_batch_size > 0, &t.dims);
                if let Some(have) = shape.get(tensor)
                    && !compatible(have, &want)
                {
                    return Err(format!(
                        "{at}.input_map: tensor '{tensor}' has shape {}, but input '{name}' of '{}' expects {} \
                         (-1: any size; the first dimension is the batch where the model batches)",
                        dims_text(have),
                        step.model,
                        dims_text(&want)
                    ));
                }
                // A request may leave an optional ensemble input out; the step it feeds then
                // goes without it, which only an optional input of the composing model allows.
                if !t.optional && config.input.iter().any(|i| &i.name == tensor && i.optional) {
                    return Err(format!(
                        "{at}.input_map: ensemble input '{tensor}' is optional, but input '{name}' of '{}' is \
                         required (optional, with a default in the model, is what allows leaving it out); \
                         make '{tensor}' required",
                        step.model
                    ));
                }
            }
            // Every input the composing model requires must be mapped (as Triton checks): left
            // out, the ensemble would load and fail every request at this step.
            if let Some(unmapped) =
                spec.inputs.iter().find(|t| !t.optional && !step.inputs.iter().any(|(name, _)| name == &t.name))
            {
                return Err(format!(
                    "{at}.input_map: input '{}' of '{}' is not mapped to any ensemble tensor",
                    unmapped.name, step.model
                ));
            }
            for (name, tensor) in &step.outputs {
                let Some(t) = spec.outputs.iter().find(|t| &t.name == name) else {
                    return Err(format!(
                        "{at}.output_map: '{}' has no output '{name}' (outputs: {})",
                        step.model,
                        list(spec.outputs.iter().map(|t| t.name.as_str()))
                    ));
                };
                dtype.insert(tensor.clone(), t.datatype);
                shape.insert(tensor.clone(), full_shape(spec.max_batch_size > 0, &t.dims));
            }
        }
    }
    for output in &config.output {
        if let (Some(&have), Some(want)) = (dtype.get(&output.name), DataType::from_config_value(output.data_type))
            && have != want
        {
            return Err(format!("output '{}': declared {want}, but the step producing it gives {have}", output.name));
        }
        let want = full_shape(ensemble_batches, &output.dims);
        if let Some(have) = shape.get(&output.name)
            && !compatible(have, &want)
        {
            return Err(format!(
                "output '{}': declared shape {}, but the step producing it gives {} (-1: any size; the first \
                 dimension is the batch where the model batches)",
                output.name,
                dims_text(&want),
                dims_text(have)
            ));
        }
    }
    Ok(())
}

/// A tensor's shape with the batch dimension (any size) in front when `batching`.
fn full_shape(batching: bool, dims: &[i64]) -> Vec<i64> {
    batching.then_some(-1).into_iter().chain(dims.iter().copied()).collect()
}

/// Whether two declared shapes can describe the same tensor: same rank, and each dimension
/// equal or -1 (any) on either side.
fn compatible(a: &[i64], b: &[i64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(&x, &y)| x == y || x == -1 || y == -1)
}

fn dims_text(dims: &[i64]) -> String {
    format!("[{}]", dims.iter().map(i64::to_string).collect::<Vec<_>>().join(", "))
}

fn list<'a>(names: impl Iterator<Item = &'a str>) -> String {
    names.map(|n| format!("'{n}'")).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use nereid_common::config::parse_model_config;

    const CHAIN: &str = r#"
name: "chain"
platform: "ensemble"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "Z" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling {
  step [
    { model_name: "b" model_version: -1 input_map { key: "IN" value: "t" } output_map { key: "OUT" value: "Y" } },
    { model_name: "a" model_version: 1 input_map { key: "IN" value: "X" } output_map { key: "OUT" value: "t" } },
    { model_name: "c" model_version: -1 input_map { key: "IN" value: "X" } output_map { key: "OUT" value: "Z" } }
  ]
}
"#;

    fn chain() -> ModelConfig {
        parse_model_config(CHAIN).unwrap()
    }

    #[test]
    fn steps_run_in_waves_of_their_dependencies() {
        let p = plan(&chain()).unwrap();
        assert_eq!(p.waves, vec![vec![1, 2], vec![0]], "a and c need only X; b needs a's t");
        assert_eq!(p.steps[1].version, Some(1));
        assert_eq!(p.steps[0].version, None, "-1 is the latest version");
        assert_eq!(p.steps[0].inputs, vec![("IN".to_string(), "t".to_string())]);
        assert_eq!(p.models(), vec!["b", "a", "c"]);
        assert!(is_ensemble(&chain()));
    }

    /// Only the steps producing what a request asks for (directly or through other steps)
    /// run: b needs a's t; c makes only Z.
    #[test]
    fn a_request_runs_only_the_steps_its_outputs_need() {
        let p = plan(&chain()).unwrap();
        let models = |wanted: &[&str]| {
            let needed = p.needed_steps(wanted);
            p.steps.iter().zip(needed).filter(|(_, n)| *n).map(|(s, _)| s.model.as_str()).collect::<Vec<_>>()
        };
        assert_eq!(models(&["Y", "Z"]), ["b", "a", "c"]);
        assert_eq!(models(&["Y"]), ["b", "a"]);
        assert_eq!(models(&["Z"]), ["c"]);
    }

    #[test]
    fn bad_graphs_are_refused_naming_the_step_or_tensor() {
        let e = |text: &str| plan(&parse_model_config(text).unwrap()).unwrap_err();
        let bad = |from: &str, to: &str| e(&CHAIN.replacen(from, to, 1));
        assert!(
            bad("value: \"t\" }", "value: \"nowhere\" }").contains("step[0].input_map: 'IN' reads tensor 'nowhere'")
        );
        assert!(bad("value: \"Z\"", "value: \"Y\"").contains("tensor 'Y' is produced twice (step[0] produces it too)"));
        assert!(bad("value: \"Z\"", "value: \"X\"").contains("'X' is produced twice (it is an ensemble input)"));
        assert!(
            bad("output_map { key: \"OUT\" value: \"Z\" }", "output_map { key: \"OUT\" value: \"W\" }")
                .contains("output 'Z': no step's output_map produces it")
        );
        assert!(bad("model_name: \"a\"", "model_name: \"chain\"").contains("cannot be a step of itself"));
        assert!(bad("model_name: \"a\"", "model_name: \"\"").contains("step[1].model_name"));
        assert!(bad("platform: \"ensemble\"", "").contains("needs platform: \"ensemble\""));
        assert!(
            bad("platform: \"ensemble\"", "platform: \"ensemble\" backend: \"onnxruntime\"").contains("no backend")
        );
        // A cycle: a reads Y, which b makes from a's t.
        let cycle = bad(
            "input_map { key: \"IN\" value: \"X\" } output_map { key: \"OUT\" value: \"t\" }",
            "input_map { key: \"IN\" value: \"Y\" } output_map { key: \"OUT\" value: \"t\" }",
        );
        assert!(
            cycle.contains("cycle") && cycle.contains("step[0] ('b')") && cycle.contains("step[1] ('a')"),
            "{cycle}"
        );
        let unused = e(&CHAIN.replace(
            "input [ { name: \"X\"",
            "input [ { name: \"U\" data_type: TYPE_FP32 dims: [ 1 ] }, { name: \"X\"",
        ));
        assert!(unused.contains("input 'U': no step's input_map reads it"), "{unused}");
        assert!(e("name: \"e\"\nplatform: \"ensemble\"\ninput [ { name: \"X\" data_type: TYPE_FP32 dims: [ 1 ] } ]\noutput [ { name: \"Y\" data_type: TYPE_FP32 dims: [ 1 ] } ]\n")
            .contains("needs ensemble_scheduling"));
        assert!(e("name: \"e\"\nplatform: \"ensemble\"\nensemble_scheduling { step [ { model_name: \"a\" input_map { key: \"I\" value: \"X\" } output_map { key: \"O\" value: \"Y\" } } ] }\n")
            .contains("must declare its inputs and outputs"));
    }

    fn spec(inputs: &[(&str, DataType)], outputs: &[(&str, DataType)]) -> std::sync::Arc<ModelSpec> {
        let t = |v: &[(&str, DataType)]| {
            v.iter()
                .map(|(n, d)| crate::backend::TensorSpec {
                    name: n.to_string(),
                    datatype: *d,
                    dims: vec![4],
                    reshape: None,
                    optional: false,
                })
                .collect()
        };
        std::sync::Arc::new(ModelSpec { max_batch_size: 8, inputs: t(inputs), outputs: t(outputs) })
    }

    #[test]
    fn composing_models_must_have_the_mapped_tensors_and_types() {
        let config = chain();
        let p = plan(&config).unwrap();
        let fp32 = spec(&[("IN", DataType::Fp32)], &[("OUT", DataType::Fp32)]);
        assert_eq!(check_composing(&config, &p, |_| Ok(fp32.clone())), Ok(()));
        let e = check_composing(&config, &p, |s| {
            Ok(if s.model == "a" { spec(&[("IN", DataType::Fp32)], &[("OUT", DataType::Fp16)]) } else { fp32.clone() })
        })
        .unwrap_err();
        assert!(e.contains("step[0] ('b').input_map: tensor 't' is FP16, but input 'IN' of 'b' expects FP32"), "{e}");
        let e = check_composing(&config, &p, |s| {
            Ok(if s.model == "c" { spec(&[("IN", DataType::Fp32)], &[("OUT", DataType::Int64)]) } else { fp32.clone() })
        })
        .unwrap_err();
        assert!(e.contains("output 'Z': declared FP32, but the step producing it gives INT64"), "{e}");
        let e = check_composing(&config, &p, |_| Ok(spec(&[("INPUT", DataType::Fp32)], &[("OUT", DataType::Fp32)])))
            .unwrap_err();
        assert!(e.contains("has no input 'IN' (inputs: 'INPUT')"), "{e}");
        let e = check_composing(&config, &p, |_| Ok(spec(&[("IN", DataType::Fp32)], &[("O", DataType::Fp32)])))
            .unwrap_err();
        assert!(e.contains("has no output 'OUT'"), "{e}");
        // A required input of a composing model that no input_map feeds (Triton refuses it).
        let e = check_composing(&config, &p, |_| {
            Ok(spec(&[("IN", DataType::Fp32), ("IN2", DataType::Fp32)], &[("OUT", DataType::Fp32)]))
        })
        .unwrap_err();
        assert!(e.contains("step[1] ('a').input_map: input 'IN2' of 'a' is not mapped to any ensemble tensor"), "{e}");
        let small = |s: &Step| {
            let mut m = (*fp32).clone();
            if s.model == "c" {
                m.max_batch_size = 4;
            }
            Ok(std::sync::Arc::new(m))
        };
        let e = check_composing(&config, &p, small).unwrap_err();
        assert!(e.contains("step[2] ('c'): max_batch_size 4 of 'c' is below the ensemble's 8"), "{e}");
        let e = check_composing(&config, &p, |s| Err(format!("model '{}' is not loaded", s.model))).unwrap_err();
        assert!(e.contains("step[0] ('b'): model 'b' is not loaded"), "{e}");

        // Shapes: a step's input must accept what feeds it, an output what its step gives.
        let dims = |model: &'static str, output_dims: Vec<i64>| {
            let fp32 = fp32.clone();
            move |s: &Step| {
                let mut m = (*fp32).clone();
                if s.model == model {
                    m.outputs[0].dims = output_dims.clone();
                }
                Ok(std::sync::Arc::new(m))
            }
        };
        let e = check_composing(&config, &p, dims("a", vec![5])).unwrap_err();
        assert!(
            e.contains("step[0] ('b').input_map: tensor 't' has shape [-1, 5], but input 'IN' of 'b' expects [-1, 4]"),
            "{e}"
        );
        let e = check_composing(&config, &p, dims("c", vec![2, 2])).unwrap_err();
        assert!(e.contains("output 'Z': declared shape [-1, 4], but the step producing it gives [-1, 2, 2]"), "{e}");
        assert_eq!(check_composing(&config, &p, dims("a", vec![-1])), Ok(()), "-1 fits any size");
        // An ensemble that does not batch, over models that do: its dims carry the batch.
        let unbatched = parse_model_config(&CHAIN.replace("max_batch_size: 8", "max_batch_size: 0")).unwrap();
        let p = plan(&unbatched).unwrap();
        let e = check_composing(&unbatched, &p, |_| Ok(fp32.clone())).unwrap_err();
        assert!(e.contains("tensor 'X' has shape [4], but input 'IN' of 'a' expects [-1, 4]"), "{e}");
        let unbatched =
            parse_model_config(&CHAIN.replace("max_batch_size: 8", "").replace("dims: [ 4 ]", "dims: [ 2, 4 ]"))
                .unwrap();
        let p = plan(&unbatched).unwrap();
        assert_eq!(check_composing(&unbatched, &p, |_| Ok(fp32.clone())), Ok(()));

        // An optional ensemble input may only feed optional inputs of its steps.
        let optional =
            parse_model_config(&CHAIN.replace("dims: [ 4 ] } ]\noutput", "dims: [ 4 ] optional: true } ]\noutput"))
                .unwrap();
        assert!(optional.input[0].optional);
        let p = plan(&optional).unwrap();
        let e = check_composing(&optional, &p, |_| Ok(fp32.clone())).unwrap_err();
        assert!(e.contains("input_map: ensemble input 'X' is optional, but input 'IN' of 'a' is required"), "{e}");
        let lenient = |_: &Step| {
            let mut m = (*fp32).clone();
            m.inputs[0].optional = true;
            Ok(std::sync::Arc::new(m))
        };
        assert_eq!(check_composing(&optional, &p, lenient), Ok(()));
    }
}
