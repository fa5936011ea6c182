//! nereid-ort-bench: what ONNX Runtime itself achieves in-process, through the exact code path
//! a worker instance thread uses for one batch ([`InstanceSession::run`] with one
//! [`JobInputs`] of `rows = batch`, i.e. the single-request path: the request's bytes are
//! borrowed, the session runs, the outputs are copied out). No network, no batcher, no tokio:
//! the baseline the served numbers (`bench/worker_bench.py`) are compared with.
//!
//! ```sh
//! target/release/nereid-ort-bench --model-dir examples/models/convnet_fp32 \
//!     --batch-sizes 1,2,4,8,16,32,64 --intra-op-threads 1,2 --seconds 2 --json
//! ```
//!
//! One line per (intra-op threads, batch size): rows/s, runs/s and per-run latency
//! percentiles (µs), plus the mean time of each phase `InstanceSession::run` reports.

/// The worker's allocator, so that the baseline runs the same code.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use nereid_common::DataType;
use nereid_worker::backend::{
    CudaOptions, Device, InstanceSession, JobInputs, ModelTensor, SessionOptions, TensorSpec, create_session,
    default_runtime_path, init_runtime, model_io,
};

/// One request's inputs, as a batch job borrows them.
type JobData = Vec<Option<(Vec<i64>, Bytes)>>;

/// Longest allowed measurement per point, whatever --seconds says.
const MAX_SECONDS: f64 = 60.0;
/// Latency samples kept per point (runs beyond it are counted but not sampled).
const MAX_SAMPLES: usize = 4_000_000;

/// In-process ONNX Runtime baseline, through the worker's own batch path (InstanceSession::run).
#[derive(Debug, Parser)]
#[command(name = "nereid-ort-bench", version, about, long_about = None)]
struct Args {
    /// Model folder in a Triton repository (`<repo>/<model>`); runs `<version>/model.onnx`.
    #[arg(long, value_name = "DIR")]
    model_dir: PathBuf,

    /// Version folder to take the model from.
    #[arg(long, default_value_t = 1)]
    model_version: u64,

    /// File name inside the version folder.
    #[arg(long, default_value = "model.onnx")]
    model_filename: String,

    /// Batch sizes to measure (comma-separated). Ignored (only 1) for models without a
    /// dynamic batch dimension.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    batch_sizes: Vec<usize>,

    /// ONNX Runtime intra-op threads; a comma-separated list sweeps them (one session each).
    #[arg(long, value_delimiter = ',', default_value = "1")]
    intra_op_threads: Vec<usize>,

    /// ONNX Runtime inter-op threads.
    #[arg(long, default_value_t = 1)]
    inter_op_threads: usize,

    /// Flush subnormals to zero on the running threads, as the worker does by default
    /// (its --denormal-as-zero).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    denormal_as_zero: bool,

    /// Measurement time per point, in seconds (bounded to 60).
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,

    /// Warm-up time per point, in seconds (at least one run; bounded to --seconds).
    #[arg(long, default_value_t = 0.3)]
    warmup_seconds: f64,

    /// One extra point whose runs take the --batch-sizes in turn (batch = 0 in the output), as
    /// a dynamic batcher's batches vary: what changing input shapes cost the provider.
    #[arg(long)]
    mixed_batches: bool,

    /// Print one JSON object per line instead of a table.
    #[arg(long)]
    json: bool,

    /// Run on this CUDA device (ONNX Runtime's CUDA execution provider; needs a build with
    /// the `cuda` feature and onnxruntime-gpu's library), as a KIND_GPU instance would.
    #[arg(long, value_name = "ID")]
    gpu: Option<i32>,

    /// With --gpu: Triton's onnxruntime `cudnn_conv_algo_search` (0 EXHAUSTIVE, ONNX Runtime's
    /// default; 1 HEURISTIC; 2 DEFAULT).
    #[arg(long, value_name = "0|1|2", value_parser = clap::value_parser!(u8).range(0..=2))]
    cudnn_conv_algo_search: Option<u8>,

    /// Path of libonnxruntime.so. Default: $NEREID_ORT_LIB, else .deps/onnxruntime/.
    #[arg(long, value_name = "FILE")]
    onnxruntime_lib: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nereid-ort-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The spec a worker would derive: dims without the batch dimension.
fn to_spec(t: &ModelTensor, batching: bool) -> Result<TensorSpec, String> {
    let datatype = t
        .datatype
        .ok_or_else(|| format!("tensor '{}' has type {} which the worker cannot serve", t.name, t.type_name))?;
    let dims = if batching { t.dims[1..].to_vec() } else { t.dims.clone() };
    Ok(TensorSpec { name: t.name.clone(), datatype, dims, reshape: None, optional: false })
}

/// Deterministic pseudo-random fp32 values in [-1, 1) (xorshift64*), as little-endian bytes in
/// an 8-byte-aligned allocation (as a decoded request's tensor would normally be).
fn random_f32_bytes(elements: usize, seed: u64) -> Bytes {
    let mut state = seed | 1;
    let mut values = Vec::with_capacity(elements);
    for _ in 0..elements {
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        let r = state.wrapping_mul(0x2545_F491_4F6C_DD1D);
        values.push(((r >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0);
    }
    Bytes::from(bytemuck::cast_slice::<f32, u8>(&values).to_vec())
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let idx = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[idx.min(sorted.len() - 1)].as_secs_f64() * 1e6
}

fn run(args: &Args) -> Result<(), String> {
    let seconds = args.seconds.clamp(0.01, MAX_SECONDS);
    let warmup = args.warmup_seconds.clamp(0.0, seconds);
    let model_path = args.model_dir.join(args.model_version.to_string()).join(&args.model_filename);
    if !model_path.is_file() {
        return Err(format!("--model-dir: '{}' does not exist", model_path.display()));
    }
    let model_name = args
        .model_dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| args.model_dir.display().to_string());
    let lib = args.onnxruntime_lib.clone().unwrap_or_else(default_runtime_path);
    init_runtime(&lib)?;
    if args.batch_sizes.is_empty() || args.batch_sizes.contains(&0) {
        return Err("--batch-sizes: give positive batch sizes".into());
    }
    if args.intra_op_threads.is_empty() {
        return Err("--intra-op-threads: give at least one value".into());
    }

    if !args.json {
        println!(
            "{:<16} {:>7} {:>6} {:>9} {:>12} {:>11} {:>10} {:>10} {:>10}",
            "model", "threads", "batch", "runs", "rows/s", "runs/s", "p50 µs", "p99 µs", "infer µs"
        );
    }
    for &threads in &args.intra_op_threads {
        let options = SessionOptions {
            intra_op_threads: threads,
            inter_op_threads: args.inter_op_threads,
            denormal_as_zero: args.denormal_as_zero,
            device: args.gpu.map_or(Device::Cpu, Device::Gpu),
            cuda: CudaOptions { conv_algo_search: args.cudnn_conv_algo_search, ..Default::default() },
            ..Default::default()
        };
        let session = create_session(&model_path, &options)?;
        let io = model_io(&session);
        // Batching exactly when the worker's auto-complete would: every tensor's first dim dynamic.
        let batching = io.inputs.iter().chain(io.outputs.iter()).all(|t| t.dims.first() == Some(&-1));
        let inputs: Vec<TensorSpec> = io.inputs.iter().map(|t| to_spec(t, batching)).collect::<Result<_, _>>()?;
        let outputs: Vec<TensorSpec> = io.outputs.iter().map(|t| to_spec(t, batching)).collect::<Result<_, _>>()?;
        for spec in &inputs {
            if spec.datatype != DataType::Fp32 {
                return Err(format!(
                    "input '{}' is {:?}; this benchmark generates FP32 inputs only",
                    spec.name, spec.datatype
                ));
            }
            if spec.dims.iter().any(|&d| d < 0) {
                return Err(format!("input '{}' has dynamic non-batch dims {:?}", spec.name, spec.dims));
            }
        }
        let mut instance = InstanceSession::new(session, inputs.clone(), outputs, batching)
            .with_denormal_as_zero(options.denormal_as_zero);
        instance.prepare_thread();
        let batch_sizes: Vec<usize> = if batching { args.batch_sizes.clone() } else { vec![1] };
        // Each point: the batch sizes its runs take in turn (one, except the mixed point).
        let mut points: Vec<Vec<usize>> = batch_sizes.iter().map(|&b| vec![b]).collect();
        if args.mixed_batches && batch_sizes.len() > 1 {
            points.push(batch_sizes.clone());
        }

        for sizes in &points {
            let batch = if sizes.len() == 1 { sizes[0] } else { 0 };
            let data: Vec<JobData> = sizes
                .iter()
                .map(|&rows| {
                    inputs
                        .iter()
                        .enumerate()
                        .map(|(i, spec)| {
                            let mut shape: Vec<i64> = if batching { vec![rows as i64] } else { vec![] };
                            shape.extend(spec.dims.iter().copied());
                            let elements: i64 = shape.iter().product();
                            Some((shape, random_f32_bytes(elements as usize, 0x9E37_79B9_7F4A_7C15 ^ (i as u64 + 1))))
                        })
                        .collect()
                })
                .collect();
            let jobs: Vec<[JobInputs<'_>; 1]> =
                sizes.iter().zip(&data).map(|(&rows, data)| [JobInputs { rows, inputs: data }]).collect();
            let all = |_: usize, _: usize| true;

            // Warm-up: at least one run of each size, then until the warm-up time is spent.
            let start = Instant::now();
            let mut i = 0usize;
            loop {
                instance.run(&jobs[i % jobs.len()], &all).map_err(|e| format!("batch {batch}: {}", e.message))?;
                i += 1;
                if i >= jobs.len() && start.elapsed().as_secs_f64() >= warmup {
                    break;
                }
            }

            let budget = Duration::from_secs_f64(seconds);
            let mut samples: Vec<Duration> = Vec::with_capacity(4096);
            let (mut input_t, mut infer_t, mut output_t) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
            let mut runs: u64 = 0;
            let mut rows_done: u64 = 0;
            let start = Instant::now();
            let mut now = start;
            while now - start < budget {
                let t = now;
                let job = &jobs[runs as usize % jobs.len()];
                rows_done += job[0].rows as u64;
                let (out, phases) = instance.run(job, &all).map_err(|e| format!("batch {batch}: {}", e.message))?;
                std::hint::black_box(&out);
                drop(out);
                now = Instant::now();
                if samples.len() < MAX_SAMPLES {
                    samples.push(now - t);
                }
                input_t += phases.input;
                infer_t += phases.infer;
                output_t += phases.output;
                runs += 1;
            }
            let elapsed = (now - start).as_secs_f64();
            samples.sort_unstable();
            let per_run = |d: Duration| d.as_secs_f64() * 1e6 / runs.max(1) as f64;
            let rows_per_s = rows_done as f64 / elapsed;
            let runs_per_s = runs as f64 / elapsed;
            let line = serde_json::json!({
                "model": model_name,
                "model_path": model_path.display().to_string(),
                "intra_op_threads": threads,
                "inter_op_threads": args.inter_op_threads,
                "batch": batch,
                "batch_sizes": sizes,
                "batching": batching,
                "device": args.gpu.map_or_else(|| "cpu".to_string(), |id| format!("gpu:{id}")),
                "runs": runs,
                "seconds": elapsed,
                "rows_per_s": rows_per_s,
                "runs_per_s": runs_per_s,
                "latency_us": {
                    "mean": per_run(now - start),
                    "p50": percentile(&samples, 50.0),
                    "p90": percentile(&samples, 90.0),
                    "p99": percentile(&samples, 99.0),
                    "max": samples.last().map(|d| d.as_secs_f64() * 1e6).unwrap_or(0.0),
                },
                "phase_mean_us": {
                    "input": per_run(input_t),
                    "infer": per_run(infer_t),
                    "output": per_run(output_t),
                },
            });
            if args.json {
                println!("{line}");
            } else {
                println!(
                    "{:<16} {:>7} {:>6} {:>9} {:>12.0} {:>11.0} {:>10.1} {:>10.1} {:>10.1}",
                    model_name,
                    threads,
                    batch,
                    runs,
                    rows_per_s,
                    runs_per_s,
                    percentile(&samples, 50.0),
                    percentile(&samples, 99.0),
                    per_run(infer_t)
                );
            }
        }
    }
    Ok(())
}
