//! ONNX Runtime backend through `ort`: one process-wide environment (the official runtime
//! library loaded dynamically), one `Session` per model instance, each driven by its own OS
//! thread (see `scheduler`). Also introspects models for config validation and auto-complete.
//!
//! Batches arrive as per-request input bytes; [`InstanceSession::run`] copies each input once
//! into a buffer the instance reuses across batches (or borrows the request's bytes directly for
//! a single aligned request), runs the session, and splits each output back per request.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use bytes::Bytes;
use nereid_common::{DataType, Status};
use ort::session::Session;
use ort::session::builder::GraphOptimizationLevel;
use ort::value::{DynValue, TensorElementType, TensorRef, ValueType};

use crate::tensor::{OutputTensor, serialize_bytes_elements, split_bytes_elements};

static ENVIRONMENT: OnceLock<ort::environment::Environment> = OnceLock::new();

/// Loads the ONNX Runtime library at `path` and creates the process-wide environment.
/// Idempotent: later calls return `Ok` without loading again.
pub fn init_runtime(path: &Path) -> Result<(), String> {
    if ENVIRONMENT.get().is_some() {
        return Ok(());
    }
    static INIT: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = INIT.lock().unwrap_or_else(|e| e.into_inner());
    if ENVIRONMENT.get().is_some() {
        return Ok(());
    }
    if !path.is_file() {
        return Err(format!(
            "ONNX Runtime library not found at '{}' (run scripts/setup.sh, or pass --onnxruntime-lib)",
            path.display()
        ));
    }
    let env = ort::init_from(path)
        .map_err(|e| format!("cannot load ONNX Runtime from '{}': {e}", path.display()))?
        .with_name("nereid")
        .build()
        .map_err(|e| format!("cannot create the ONNX Runtime environment: {e}"))?;
    let _ = ENVIRONMENT.set(env);
    Ok(())
}

/// The library path used when none is given: `$NEREID_ORT_LIB`, else the project-local copy
/// that `scripts/setup.sh` installs next to the workspace.
pub fn default_runtime_path() -> PathBuf {
    if let Some(p) = std::env::var_os("NEREID_ORT_LIB") {
        return PathBuf::from(p);
    }
    let candidates = [
        PathBuf::from(".deps/onnxruntime/libonnxruntime.so"),
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../.deps/onnxruntime/libonnxruntime.so"),
    ];
    candidates.iter().find(|p| p.is_file()).cloned().unwrap_or_else(|| candidates[0].clone())
}

fn environment() -> Result<&'static ort::environment::Environment, Status> {
    ENVIRONMENT.get().ok_or_else(|| Status::internal("ONNX Runtime is not initialised"))
}

/// Where an instance runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Gpu(i32),
}

/// Most bytes one input of a batch padded to `max_batch_size` rows (`nereid.pad_batch`) may
/// take: the load refuses a config whose fixed shapes pass it, and a batch of variable-size
/// rows that would is refused rather than allocated.
pub const MAX_PADDED_INPUT_BYTES: usize = 4 << 30;

/// Per-instance session options, from the model config's `parameters` and instance group.
#[derive(Clone, Debug)]
pub struct SessionOptions {
    pub device: Device,
    pub intra_op_threads: usize,
    pub inter_op_threads: usize,
    pub intra_op_spinning: bool,
    /// ONNX Runtime's graph optimization level: 0 none, 1 basic, 2 extended, 3 all.
    pub optimization_level: u8,
    /// ORT_PARALLEL execution mode (Triton's onnxruntime `execution_mode` parameter "1"):
    /// independent branches of the graph run concurrently on the inter-op threads.
    pub parallel_execution: bool,
    /// Flush subnormal floats to zero (FTZ/DAZ) on every thread that runs the session: the
    /// instance thread and ONNX Runtime's own pool. Arithmetic on subnormals takes the CPU's slow
    /// path: random-bytes inputs (perf_analyzer's default) made the example convnet 40 % slower.
    pub denormal_as_zero: bool,
    /// CUDA execution provider options (KIND_GPU instances only).
    pub cuda: CudaOptions,
    /// Run every batch at `max_batch_size` rows, the rows past the batch's own zeros whose
    /// outputs are dropped (Nereid's `nereid.pad_batch` parameter): the model sees one input
    /// shape. For GPU models with convolutions: ONNX Runtime's CUDA convolution redoes its
    /// set-up whenever the shape differs from the previous run's, which cost an H100 2.5–25 ms
    /// per run with varying batch sizes against 0.1–0.4 ms at one size
    /// (bench/results/worker-gpu-mixed-shapes.txt, worker-gpu-padded.md).
    pub pad_batch: bool,
}

/// Options of ONNX Runtime's CUDA execution provider that Triton's onnxruntime backend reads
/// from a model's `parameters`; `None` leaves ONNX Runtime's default. They matter only to
/// KIND_GPU instances.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CudaOptions {
    /// `cudnn_conv_algo_search`: 0 EXHAUSTIVE (ONNX Runtime's default), 1 HEURISTIC, 2 DEFAULT.
    /// ONNX Runtime redoes a convolution's cuDNN set-up whenever the input shape differs from
    /// the previous run's, and a dynamic batcher's batch sizes vary: on an H100 the example
    /// convnet took 25 ms a run with EXHAUSTIVE, 6.5 ms with HEURISTIC and 2.5 ms with DEFAULT
    /// when batch sizes alternated, against 0.1–0.4 ms at one size
    /// (bench/results/worker-gpu-mixed-shapes.txt; see also `SessionOptions::pad_batch`).
    pub conv_algo_search: Option<u8>,
    /// `gpu_mem_limit`: the most bytes the provider's memory arena takes on the device.
    pub gpu_mem_limit: Option<usize>,
    /// `arena_extend_strategy`: 0 next power of two (the default), 1 what is requested.
    pub arena_extend_strategy: Option<u8>,
    /// `do_copy_in_default_stream`: copies on the compute stream (the default) or their own.
    pub copy_in_default_stream: Option<bool>,
    /// Why a value of these keys was refused: the load fails with it where the model has a
    /// GPU instance, and only warns otherwise (Triton reads the keys for GPU instances only).
    pub rejected: Vec<String>,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            device: Device::Cpu,
            intra_op_threads: 1,
            inter_op_threads: 1,
            intra_op_spinning: false,
            optimization_level: 3,
            parallel_execution: false,
            denormal_as_zero: true,
            cuda: CudaOptions::default(),
            pad_batch: false,
        }
    }
}

/// CUDA devices this worker can run models on (KIND_GPU instances), or why there are none:
/// the build lacks the `cuda` feature, no driver or device is found (probed through `cudarc`,
/// without panicking where there is no driver), or the loaded ONNX Runtime library has no CUDA
/// execution provider (the CPU wheel's library; onnxruntime-gpu's has it). Call it after
/// [`init_runtime`].
pub fn gpu_devices() -> Result<usize, String> {
    #[cfg(feature = "cuda")]
    {
        use ort::ep::ExecutionProvider;
        // SAFETY: only checks whether the driver library can be opened.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err("no CUDA driver (libcuda.so.1) could be loaded".into());
        }
        let n = cudarc::driver::CudaContext::device_count()
            .map_err(|e| format!("the CUDA driver reports no device ({e:?})"))?;
        if n <= 0 {
            return Err("the CUDA driver reports no device".into());
        }
        match ort::ep::CUDA::is_available() {
            Ok(true) => Ok(n as usize),
            Ok(false) => Err(format!(
                "{n} CUDA device(s), but the ONNX Runtime library has no CUDA execution provider (use onnxruntime-gpu's)"
            )),
            Err(e) => Err(format!("{n} CUDA device(s), but ONNX Runtime's providers could not be listed: {e}")),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err("this build has no CUDA support (cargo feature `cuda`)".into())
    }
}

/// Number of CUDA devices models can run on ([`gpu_devices`]; 0 where there are none).
pub fn gpu_count() -> usize {
    gpu_devices().unwrap_or(0)
}

/// Creates one session for `model_path`.
pub fn create_session(model_path: &Path, options: &SessionOptions) -> Result<Session, String> {
    let env = environment().map_err(|e| e.message)?;
    // ONNX Runtime's pool threads start with this thread's setting (its own option sets it on
    // them only on x86), and the option also turns it on for the thread creating the first
    // session that asks for it: set it as the session wants, and put it back afterwards.
    let _fp = DenormalScope::enter(options.denormal_as_zero);
    build_session(env, model_path, options).map_err(|e| format!("{e}"))
}

/// Sets the calling thread's subnormal flushing for a scope (a session's creation, its warm-up
/// on a loader thread) and restores the previous setting when dropped.
pub struct DenormalScope(u64);

impl DenormalScope {
    pub fn enter(on: bool) -> Self {
        let saved = DenormalScope(fp_control());
        set_denormals_as_zero(on);
        saved
    }
}

impl Drop for DenormalScope {
    fn drop(&mut self) {
        set_fp_control(self.0);
    }
}

fn build_session(
    env: &ort::environment::Environment,
    model_path: &Path,
    options: &SessionOptions,
) -> ort::Result<Session> {
    let level = match options.optimization_level {
        0 => GraphOptimizationLevel::Disable,
        1 => GraphOptimizationLevel::Level1,
        2 => GraphOptimizationLevel::Level2,
        _ => GraphOptimizationLevel::All,
    };
    tracing::debug!(
        model = %model_path.display(),
        ?level,
        parallel_execution = options.parallel_execution,
        intra_op_threads = options.intra_op_threads,
        inter_op_threads = options.inter_op_threads,
        "creating an ONNX Runtime session"
    );
    let mut builder = Session::builder(env)?;
    builder = builder.with_optimization_level(level)?;
    builder = builder.with_parallel_execution(options.parallel_execution)?;
    builder = builder.with_intra_threads(options.intra_op_threads)?;
    builder = builder.with_inter_threads(options.inter_op_threads)?;
    builder = builder.with_intra_op_spinning(options.intra_op_spinning)?;
    if options.denormal_as_zero {
        // Covers ONNX Runtime's pool threads; the instance thread sets its own flags
        // (`InstanceSession::prepare_thread`).
        builder = builder.with_flush_to_zero()?;
    }
    if let Device::Gpu(_id) = options.device {
        #[cfg(feature = "cuda")]
        {
            builder =
                builder.with_execution_providers([cuda_provider(_id, &options.cuda).build().error_on_failure()])?;
        }
        #[cfg(not(feature = "cuda"))]
        {
            return Err(ort::Error::new("this build has no CUDA support (cargo feature `cuda`)"));
        }
    }
    builder.commit_from_file(model_path)
}

#[cfg(feature = "cuda")]
fn cuda_provider(device: i32, options: &CudaOptions) -> ort::ep::CUDA {
    use ort::ep::{ArbitrarilyConfigurableExecutionProvider, ArenaExtendStrategy, cuda::ConvAlgorithmSearch};
    let mut ep = ort::ep::CUDA::default().with_device_id(device);
    if let Some(search) = options.conv_algo_search {
        ep = ep.with_conv_algorithm_search(match search {
            1 => ConvAlgorithmSearch::Heuristic,
            2 => ConvAlgorithmSearch::Default,
            _ => ConvAlgorithmSearch::Exhaustive,
        });
    }
    if let Some(limit) = options.gpu_mem_limit {
        ep = ep.with_memory_limit(limit);
    }
    if let Some(strategy) = options.arena_extend_strategy {
        ep = ep.with_arena_extend_strategy(if strategy == 1 {
            ArenaExtendStrategy::SameAsRequested
        } else {
            ArenaExtendStrategy::NextPowerOfTwo
        });
    }
    if let Some(same) = options.copy_in_default_stream {
        ep = ep.with_arbitrary_config("do_copy_in_default_stream", if same { "1" } else { "0" });
    }
    ep
}

/// A tensor the model declares: name, element type, dims (-1 where dynamic).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelTensor {
    pub name: String,
    /// `None` when the element type has no KServe equivalent (or is not a tensor).
    pub datatype: Option<DataType>,
    pub type_name: String,
    pub dims: Vec<i64>,
}

/// The inputs and outputs an ONNX model declares.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelIo {
    pub inputs: Vec<ModelTensor>,
    pub outputs: Vec<ModelTensor>,
    /// Inputs the model gives a default to (initializers that are also graph inputs, which
    /// ONNX Runtime lists apart from the required inputs): a request may override or omit them.
    pub defaults: Vec<ModelTensor>,
}

pub fn model_io(session: &Session) -> ModelIo {
    let tensor = |name: &str, dtype: &ValueType| match dtype {
        ValueType::Tensor { ty, shape, .. } => ModelTensor {
            name: name.to_string(),
            datatype: from_ort_type(*ty),
            type_name: format!("{ty:?}"),
            dims: shape.iter().copied().collect(),
        },
        other => ModelTensor { name: name.to_string(), datatype: None, type_name: format!("{other:?}"), dims: vec![] },
    };
    let convert = |outlets: &[ort::value::Outlet]| outlets.iter().map(|o| tensor(o.name(), o.dtype())).collect();
    ModelIo {
        inputs: convert(session.inputs()),
        outputs: convert(session.outputs()),
        defaults: session.overridable_initializers().iter().map(|i| tensor(i.name(), i.dtype())).collect(),
    }
}

fn from_ort_type(ty: TensorElementType) -> Option<DataType> {
    use TensorElementType as T;
    Some(match ty {
        T::Bool => DataType::Bool,
        T::Uint8 => DataType::Uint8,
        T::Uint16 => DataType::Uint16,
        T::Uint32 => DataType::Uint32,
        T::Uint64 => DataType::Uint64,
        T::Int8 => DataType::Int8,
        T::Int16 => DataType::Int16,
        T::Int32 => DataType::Int32,
        T::Int64 => DataType::Int64,
        T::Float16 => DataType::Fp16,
        T::Float32 => DataType::Fp32,
        T::Float64 => DataType::Fp64,
        T::String => DataType::Bytes,
        T::Bfloat16 => DataType::Bf16,
        _ => return None,
    })
}

/// One tensor of the model as the scheduler and validator use it (config view).
#[derive(Clone, Debug)]
pub struct TensorSpec {
    pub name: String,
    pub datatype: DataType,
    /// Dims without the batch dimension (-1 = any).
    pub dims: Vec<i64>,
    /// Config `reshape`: the model's own dims for this tensor (without the batch dimension),
    /// when they differ from `dims`, the shape clients see. The data is the same.
    pub reshape: Option<Vec<i64>>,
    /// Inputs only: requests may leave it out (config `optional: true`, and the model gives it
    /// a default: an initializer that is also a graph input, which ONNX Runtime then uses).
    pub optional: bool,
}

/// `shape` (with the batch dimension first when `batching`) with its other dims replaced by
/// `dims`, a `-1` there taking whatever element count is left: how a tensor looks on the other
/// side of a config `reshape`. Elements and rows are unchanged.
pub fn reshaped(dims: &[i64], shape: &[i64], batching: bool) -> Vec<i64> {
    let (batch, rest) = match (batching, shape.split_first()) {
        (true, Some((b, rest))) => (Some(*b), rest),
        _ => (None, shape),
    };
    let elements: i64 = rest.iter().product();
    let known: i64 = dims.iter().filter(|&&d| d >= 0).product();
    let fill = if known > 0 { elements / known } else { 0 };
    batch.into_iter().chain(dims.iter().map(|&d| if d < 0 { fill } else { d })).collect()
}

/// What a request of one job carries into a batch.
pub struct JobInputs<'a> {
    /// Rows this request contributes (1 for models without batching).
    pub rows: usize,
    /// One entry per model input, in the spec's order: full shape and raw bytes, or `None` for
    /// an optional input left out (the same ones in every job of a batch: the shape key says).
    pub inputs: &'a [Option<(Vec<i64>, Bytes)>],
}

/// Time spent in each phase of one batch.
#[derive(Clone, Copy, Debug, Default)]
pub struct PhaseTimes {
    pub input: Duration,
    pub infer: Duration,
    pub output: Duration,
    /// Rows the model ran: the batch's, or more where the batch was padded.
    pub rows: usize,
}

/// A session plus the buffers it reuses from batch to batch.
pub struct InstanceSession {
    session: Session,
    inputs: Vec<TensorSpec>,
    outputs: Vec<TensorSpec>,
    batching: bool,
    buffers: Vec<AlignedBuf>,
    denormal_as_zero: bool,
    /// Rows every batch is padded to (see `SessionOptions::pad_batch`).
    pad_to: Option<usize>,
}

/// A byte buffer aligned to 8 bytes, so it can be viewed as any element type.
#[derive(Default)]
struct AlignedBuf {
    words: Vec<u64>,
    len: usize,
}

/// A batch buffer holding more than this, and more than [`SHRINK_FACTOR`] times what the
/// batch at hand needs, is given back: one burst of large batches does not keep an instance
/// holding its largest batch for ever.
const SHRINK_ABOVE_BYTES: usize = 16 << 20;
const SHRINK_FACTOR: usize = 4;

impl AlignedBuf {
    fn reset(&mut self, len: usize) -> &mut [u8] {
        let words = len.div_ceil(8);
        let held = self.words.len() * 8;
        if held > SHRINK_ABOVE_BYTES && held > len.saturating_mul(SHRINK_FACTOR) {
            self.words = Vec::new();
        }
        if self.words.len() < words {
            self.words.resize(words, 0);
        }
        self.len = len;
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[..len]
    }
    fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice::<u64, u8>(&self.words)[..self.len]
    }
}

#[cfg(test)]
mod buffer_tests {
    use super::*;

    #[test]
    fn a_batch_buffer_grows_is_reused_and_gives_back_a_burst() {
        let mut b = AlignedBuf::default();
        b.reset(64 << 20).fill(7);
        assert_eq!(b.bytes().len(), 64 << 20);
        // Reused for anything within a quarter of it.
        b.reset(20 << 20);
        assert_eq!(b.words.len() * 8, 64 << 20);
        // Given back for a small batch after the burst.
        assert_eq!(b.reset(1 << 20).len(), 1 << 20);
        assert_eq!(b.words.len() * 8, 1 << 20);
        // Small buffers are never worth shrinking.
        b.reset(8 << 20);
        b.reset(8);
        assert_eq!(b.words.len() * 8, 8 << 20);
        assert_eq!(b.bytes().len(), 8);
    }
}

impl InstanceSession {
    pub fn new(session: Session, inputs: Vec<TensorSpec>, outputs: Vec<TensorSpec>, batching: bool) -> Self {
        let buffers = inputs.iter().map(|_| AlignedBuf::default()).collect();
        InstanceSession { session, inputs, outputs, batching, buffers, denormal_as_zero: false, pad_to: None }
    }

    /// Pads each batch to `rows` rows with zeros (a batching model without BYTES inputs only;
    /// otherwise, or with `None`, batches run at their own size). The padding rows' outputs are
    /// dropped.
    pub fn with_padded_batch(mut self, rows: Option<usize>) -> Self {
        let paddable = self.batching && self.inputs.iter().all(|s| s.datatype != DataType::Bytes);
        self.pad_to = rows.filter(|_| paddable);
        self
    }

    /// Whether the thread that runs this session flushes subnormals to zero
    /// (`SessionOptions::denormal_as_zero`); applied (or cleared) by `prepare_thread`.
    pub fn with_denormal_as_zero(mut self, on: bool) -> Self {
        self.denormal_as_zero = on;
        self
    }

    /// Sets up the calling thread to run this session: its floating point unit flushes
    /// subnormals to zero exactly when `denormal_as_zero` says so. ONNX Runtime runs a
    /// single-threaded session on the caller's thread, so its own option alone does not reach
    /// it.
    pub fn prepare_thread(&self) {
        set_denormals_as_zero(self.denormal_as_zero);
    }

    /// Runs one batch. Returns, per job, the outputs selected by `wanted(job, output_index)`.
    pub fn run(
        &mut self,
        jobs: &[JobInputs<'_>],
        wanted: &dyn Fn(usize, usize) -> bool,
    ) -> Result<(Vec<Vec<OutputTensor>>, PhaseTimes), Status> {
        let t0 = Instant::now();
        let total_rows: usize = jobs.iter().map(|j| j.rows).sum();
        // The rows the model runs: the batch's, or the padded size.
        let run_rows = self.pad_to.map_or(total_rows, |p| p.max(total_rows));
        let single = jobs.len() == 1 && run_rows == total_rows;

        // The inputs this batch carries: the same in every job (the shape key includes which
        // optional inputs are present), each job's part in order.
        let present: Vec<bool> =
            (0..self.inputs.len()).map(|i| jobs[0].inputs.get(i).is_some_and(Option::is_some)).collect();
        let mut parts: Vec<Vec<&(Vec<i64>, Bytes)>> = vec![Vec::with_capacity(jobs.len()); self.inputs.len()];
        for job in jobs {
            for (i, &here) in present.iter().enumerate() {
                match (job.inputs.get(i).and_then(Option::as_ref), here) {
                    (Some(part), true) => parts[i].push(part),
                    (None, false) => {}
                    _ => return Err(Status::internal("a batch mixed requests with different optional inputs")),
                }
            }
        }

        // Gather inputs: borrow a single request's bytes when they are aligned for the element
        // type, else copy every request's bytes once into the instance's reused buffer.
        let mut direct = vec![false; self.inputs.len()];
        let mut strings: Vec<Vec<String>> = vec![Vec::new(); self.inputs.len()];
        for (i, spec) in self.inputs.iter().enumerate() {
            if !present[i] {
                continue;
            }
            if spec.datatype == DataType::Bytes {
                for part in &parts[i] {
                    for e in split_bytes_elements(&spec.name, &part.1)? {
                        strings[i].push(String::from_utf8(e.to_vec()).map_err(|_| {
                            Status::invalid(format!(
                                "input '{}': BYTES elements must be UTF-8 for ONNX string tensors",
                                spec.name
                            ))
                        })?);
                    }
                }
            } else if single
                && (parts[i][0].1.as_ptr() as usize).is_multiple_of(spec.datatype.element_size().unwrap_or(8))
            {
                direct[i] = true;
            } else {
                let total: usize = parts[i].iter().map(|p| p.1.len()).sum();
                // Padding rows: as many bytes per row as the batch's own rows hold, zeroed.
                let padded = if run_rows > total_rows {
                    (total / total_rows.max(1))
                        .checked_mul(run_rows)
                        .filter(|&bytes| bytes <= MAX_PADDED_INPUT_BYTES)
                        .ok_or_else(|| {
                        // The rows' size decides it: no retry would fare better.
                        Status::invalid(format!(
                            "input '{}': padding the batch to {run_rows} rows (nereid.pad_batch) would take \
                                 more than {MAX_PADDED_INPUT_BYTES} bytes",
                            spec.name
                        ))
                    })?
                } else {
                    total
                };
                let buf = self.buffers[i].reset(padded);
                let mut at = 0;
                for part in &parts[i] {
                    let src = &part.1;
                    buf[at..at + src.len()].copy_from_slice(src);
                    at += src.len();
                }
                buf[at..].fill(0);
            }
        }
        // ONNX Runtime wants `bool` elements; the wire has 0/1 bytes (validated).
        let bools: Vec<Vec<bool>> = self
            .inputs
            .iter()
            .enumerate()
            .filter(|(i, spec)| present[*i] && spec.datatype == DataType::Bool)
            .map(|(i, _)| {
                let bytes: &[u8] = if direct[i] { &parts[i][0].1 } else { self.buffers[i].bytes() };
                bytes.iter().map(|&b| b != 0).collect()
            })
            .collect();
        let mut bool_iter = bools.iter();
        let mut values: Vec<(&str, ort::session::SessionInputValue<'_>)> = Vec::with_capacity(self.inputs.len());
        for (i, spec) in self.inputs.iter().enumerate() {
            // An optional input left out: ONNX Runtime uses the model's default.
            if !present[i] {
                continue;
            }
            let mut shape = batch_shape(&parts[i][0].0, run_rows, self.batching);
            if let Some(model_dims) = &spec.reshape {
                shape = reshaped(model_dims, &shape, self.batching);
            }
            let value = if spec.datatype == DataType::Bytes {
                ort::value::Tensor::from_string_array((shape, strings[i].as_slice()))
                    .map(Into::into)
                    .map_err(|e| e.to_string())
            } else {
                let bytes: &[u8] = if direct[i] { &parts[i][0].1 } else { self.buffers[i].bytes() };
                tensor_view(spec.datatype, &shape, bytes, &mut bool_iter)
            };
            values
                .push((spec.name.as_str(), value.map_err(|e| Status::invalid(format!("input '{}': {e}", spec.name)))?));
        }
        let t1 = Instant::now();

        let outputs = self
            .session
            .run(values)
            .map_err(|e| Status::internal(format!("onnxruntime failed to execute the batch: {e}")))?;
        let t2 = Instant::now();

        let mut per_job: Vec<Vec<OutputTensor>> = (0..jobs.len()).map(|_| Vec::new()).collect();
        for (o, spec) in self.outputs.iter().enumerate() {
            if !(0..jobs.len()).any(|j| wanted(j, o)) {
                continue;
            }
            let value = outputs
                .get(spec.name.as_str())
                .ok_or_else(|| Status::internal(format!("model did not produce output '{}'", spec.name)))?;
            split_output(value, spec, jobs, self.batching, run_rows, o, wanted, &mut per_job)?;
        }
        let t3 = Instant::now();
        Ok((per_job, PhaseTimes { input: t1 - t0, infer: t2 - t1, output: t3 - t2, rows: run_rows }))
    }
}

fn batch_shape(first: &[i64], total_rows: usize, batching: bool) -> Vec<i64> {
    let mut shape = first.to_vec();
    if batching && !shape.is_empty() {
        shape[0] = total_rows as i64;
    }
    shape
}

fn tensor_view<'a>(
    dtype: DataType,
    shape: &[i64],
    bytes: &'a [u8],
    bools: &mut std::slice::Iter<'a, Vec<bool>>,
) -> Result<ort::session::SessionInputValue<'a>, String> {
    fn view<'a, T>(shape: &[i64], bytes: &'a [u8]) -> Result<ort::session::SessionInputValue<'a>, String>
    where
        T: ort::value::PrimitiveTensorElementType + bytemuck::Pod + std::fmt::Debug,
    {
        let data: &'a [T] = bytemuck::try_cast_slice(bytes).map_err(|e| format!("{e:?}"))?;
        TensorRef::from_array_view((shape.to_vec(), data)).map(Into::into).map_err(|e| e.to_string())
    }
    match dtype {
        DataType::Fp32 => view::<f32>(shape, bytes),
        DataType::Fp64 => view::<f64>(shape, bytes),
        DataType::Fp16 => view::<half::f16>(shape, bytes),
        DataType::Bf16 => view::<half::bf16>(shape, bytes),
        DataType::Int8 => view::<i8>(shape, bytes),
        DataType::Int16 => view::<i16>(shape, bytes),
        DataType::Int32 => view::<i32>(shape, bytes),
        DataType::Int64 => view::<i64>(shape, bytes),
        DataType::Uint8 => view::<u8>(shape, bytes),
        DataType::Uint16 => view::<u16>(shape, bytes),
        DataType::Uint32 => view::<u32>(shape, bytes),
        DataType::Uint64 => view::<u64>(shape, bytes),
        DataType::Bool => {
            let data = bools.next().ok_or("internal: missing bool buffer")?;
            TensorRef::from_array_view((shape.to_vec(), data.as_slice())).map(Into::into).map_err(|e| e.to_string())
        }
        DataType::Bytes => Err("internal: BYTES handled separately".into()),
    }
}

/// Splits `value` between `jobs` by rows; `total_rows` is the rows the model ran (the jobs'
/// rows, then any padding rows, whose part is dropped).
#[allow(clippy::too_many_arguments)]
fn split_output(
    value: &DynValue,
    spec: &TensorSpec,
    jobs: &[JobInputs<'_>],
    batching: bool,
    total_rows: usize,
    output_index: usize,
    wanted: &dyn Fn(usize, usize) -> bool,
    per_job: &mut [Vec<OutputTensor>],
) -> Result<(), Status> {
    let internal = |e: ort::Error| Status::internal(format!("output '{}': {e}", spec.name));
    // With a config `reshape`, the model's shape is turned into the one clients see.
    let client_shape = |shape: Vec<i64>| match &spec.reshape {
        Some(_) => reshaped(&spec.dims, &shape, batching),
        None => shape,
    };
    let (shape, bytes): (Vec<i64>, Bytes) = match spec.datatype {
        DataType::Bytes => {
            let (shape, strings) = value.try_extract_strings().map_err(internal)?;
            // Serialize per job below; keep the element list.
            let shape: Vec<i64> = client_shape(shape.iter().copied().collect());
            check_output_shape(spec, &shape, strings.len(), batching, total_rows)?;
            let per_row = row_elements(&shape, batching, total_rows);
            let mut at = 0;
            for (j, job) in jobs.iter().enumerate() {
                let n = if batching { job.rows * per_row } else { strings.len() };
                if wanted(j, output_index) {
                    let mut s = shape.clone();
                    if batching && !s.is_empty() {
                        s[0] = job.rows as i64;
                    }
                    let data = serialize_bytes_elements(&strings[at..at + n]);
                    per_job[j].push(OutputTensor {
                        name: spec.name.clone(),
                        datatype: DataType::Bytes,
                        shape: s,
                        data: Bytes::from(data),
                    });
                }
                at += n;
            }
            return Ok(());
        }
        DataType::Bool => {
            let (shape, data) = value.try_extract_tensor::<bool>().map_err(internal)?;
            (
                client_shape(shape.iter().copied().collect()),
                Bytes::from(data.iter().map(|&b| b as u8).collect::<Vec<u8>>()),
            )
        }
        _ => {
            let (shape, data) = extract_bytes(value, spec.datatype).map_err(internal)?;
            (client_shape(shape), Bytes::copy_from_slice(data))
        }
    };
    let width = spec.datatype.element_size().unwrap_or(1).max(1);
    check_output_shape(spec, &shape, bytes.len() / width, batching, total_rows)?;
    if jobs.len() == 1 && (!batching || jobs[0].rows == total_rows) {
        if wanted(0, output_index) {
            per_job[0].push(OutputTensor { name: spec.name.clone(), datatype: spec.datatype, shape, data: bytes });
        }
        return Ok(());
    }
    let per_row_bytes = bytes.len() / total_rows.max(1);
    let mut at = 0;
    for (j, job) in jobs.iter().enumerate() {
        let n = job.rows * per_row_bytes;
        if wanted(j, output_index) {
            let mut s = shape.clone();
            if !s.is_empty() {
                s[0] = job.rows as i64;
            }
            per_job[j].push(OutputTensor {
                name: spec.name.clone(),
                datatype: spec.datatype,
                shape: s,
                data: bytes.slice(at..at + n),
            });
        }
        at += n;
    }
    Ok(())
}

/// An output is split between a batch's requests by rows: its shape must hold exactly the
/// elements the model answered and, for a batching model, start with the batch's row count —
/// otherwise one request's slice would hold another's data (Triton fails such a batch too).
fn check_output_shape(
    spec: &TensorSpec,
    shape: &[i64],
    elements: usize,
    batching: bool,
    total_rows: usize,
) -> Result<(), Status> {
    let counted = shape.iter().try_fold(1usize, |n, &d| usize::try_from(d).ok().and_then(|d| n.checked_mul(d)));
    if counted != Some(elements) {
        return Err(Status::internal(format!(
            "output '{}': the model answered {elements} elements, which do not fill its shape {shape:?}",
            spec.name
        )));
    }
    if batching && shape.first().and_then(|&d| usize::try_from(d).ok()) != Some(total_rows) {
        return Err(Status::internal(format!(
            "output '{}': the model answered shape {shape:?} for a batch of {total_rows} rows (the first dimension \
             must be the batch)",
            spec.name
        )));
    }
    Ok(())
}

fn row_elements(shape: &[i64], batching: bool, total_rows: usize) -> usize {
    let total: i64 = shape.iter().product();
    if batching { (total as usize) / total_rows.max(1) } else { total as usize }
}

fn extract_bytes(value: &DynValue, dtype: DataType) -> ort::Result<(Vec<i64>, &[u8])> {
    fn ex<T: ort::value::PrimitiveTensorElementType + bytemuck::Pod>(
        value: &DynValue,
    ) -> ort::Result<(Vec<i64>, &[u8])> {
        let (shape, data) = value.try_extract_tensor::<T>()?;
        Ok((shape.iter().copied().collect(), bytemuck::cast_slice(data)))
    }
    match dtype {
        DataType::Fp32 => ex::<f32>(value),
        DataType::Fp64 => ex::<f64>(value),
        DataType::Fp16 => ex::<half::f16>(value),
        DataType::Bf16 => ex::<half::bf16>(value),
        DataType::Int8 => ex::<i8>(value),
        DataType::Int16 => ex::<i16>(value),
        DataType::Int32 => ex::<i32>(value),
        DataType::Int64 => ex::<i64>(value),
        DataType::Uint8 => ex::<u8>(value),
        DataType::Uint16 => ex::<u16>(value),
        DataType::Uint32 => ex::<u32>(value),
        DataType::Uint64 => ex::<u64>(value),
        DataType::Bool | DataType::Bytes => Err(ort::Error::new("internal: handled separately")),
    }
}

#[cfg(test)]
mod tests {
    use super::{TensorSpec, check_output_shape, reshaped};
    use nereid_common::{Code, DataType};

    /// What a model answered is split between a batch's requests only when its shape holds
    /// exactly its elements and starts with the batch's rows.
    #[test]
    fn outputs_that_cannot_be_split_by_rows_fail_the_batch() {
        let spec =
            TensorSpec { name: "Y".into(), datatype: DataType::Fp32, dims: vec![4], reshape: None, optional: false };
        check_output_shape(&spec, &[3, 4], 12, true, 3).unwrap();
        check_output_shape(&spec, &[2, 3], 6, false, 1).unwrap();
        // A batch of 3 answered with one row: slicing by rows would hand out another's data.
        let e = check_output_shape(&spec, &[1, 12], 12, true, 3).unwrap_err();
        assert_eq!(e.code, Code::Internal);
        assert!(e.message.contains("output 'Y'") && e.message.contains("batch of 3 rows"), "{}", e.message);
        // A shape (after a config reshape) that does not hold what the model answered.
        let e = check_output_shape(&spec, &[3, 2], 5, true, 3).unwrap_err();
        assert!(e.message.contains("5 elements"), "{}", e.message);
        assert!(check_output_shape(&spec, &[3, -1], 6, true, 3).is_err());
        assert!(check_output_shape(&spec, &[i64::MAX, 4], 8, true, 2).is_err(), "no overflow");
    }

    #[test]
    fn reshape_keeps_rows_and_elements() {
        assert_eq!(reshaped(&[16], &[3, 4, 4], true), vec![3, 16]);
        assert_eq!(reshaped(&[4, 4], &[3, 16], true), vec![3, 4, 4]);
        assert_eq!(reshaped(&[2, -1], &[5, 4, 4], true), vec![5, 2, 8], "-1 takes what is left");
        assert_eq!(reshaped(&[-1], &[2, 3], false), vec![6], "no batch dimension");
        assert_eq!(reshaped(&[], &[7, 1], true), vec![7], "[batch, 1] to [batch]");
        assert_eq!(reshaped(&[1], &[7], true), vec![7, 1]);
    }
}

/// Flush-to-zero and denormals-are-zero on (`true`) or off for the calling thread's floating
/// point unit (MXCSR on x86-64, FPCR.FZ on aarch64; elsewhere nothing). New threads inherit the
/// setting of the thread that starts them. Rust and LLVM assume the default floating point
/// environment: with the flags on, code on this thread sees subnormal values as zero (what the
/// setting is for) and nothing else changes; threads that run Rust code of their own (tokio)
/// must not keep it, hence [`DenormalScope`].
pub fn set_denormals_as_zero(on: bool) {
    #[cfg(target_arch = "x86_64")]
    {
        const FTZ_DAZ: u64 = (1 << 15) | (1 << 6);
        let csr = fp_control();
        set_fp_control(if on { csr | FTZ_DAZ } else { csr & !FTZ_DAZ });
    }
    #[cfg(target_arch = "aarch64")]
    {
        const FZ: u64 = 1 << 24;
        let fpcr = fp_control();
        set_fp_control(if on { fpcr | FZ } else { fpcr & !FZ });
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = on;
}

/// The calling thread's floating point control register (0 where not read).
fn fp_control() -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        let mut csr: u32 = 0;
        // SAFETY: stores this thread's SSE control register into a local (SSE is part of x86-64).
        unsafe { std::arch::asm!("stmxcsr [{}]", in(reg) &mut csr, options(nostack, preserves_flags)) };
        u64::from(csr)
    }
    #[cfg(target_arch = "aarch64")]
    {
        let fpcr: u64;
        // SAFETY: reads this thread's floating point control register.
        unsafe { std::arch::asm!("mrs {}, fpcr", out(reg) fpcr, options(nomem, nostack, preserves_flags)) };
        fpcr
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        0
    }
}

/// Writes a value `fp_control` returned (changed in mode bits only) back.
fn set_fp_control(value: u64) {
    #[cfg(target_arch = "x86_64")]
    {
        let csr = value as u32;
        // SAFETY: loads this thread's SSE control register from a value read from it, with only
        // rounding/flush mode bits changed; no exception is unmasked.
        unsafe { std::arch::asm!("ldmxcsr [{}]", in(reg) &csr, options(nostack, preserves_flags)) };
    }
    #[cfg(target_arch = "aarch64")]
    {
        // SAFETY: as above, for the floating point control register.
        unsafe { std::arch::asm!("msr fpcr, {}", in(reg) value, options(nomem, nostack, preserves_flags)) };
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = value;
}

#[cfg(test)]
mod denormal_tests {
    use std::hint::black_box;

    use super::set_denormals_as_zero;

    #[test]
    fn flushing_subnormals_changes_only_the_calling_thread() {
        let tiny = f32::MIN_POSITIVE;
        let flushed = std::thread::spawn(move || {
            let before = black_box(black_box(tiny) / black_box(4.0f32));
            set_denormals_as_zero(true);
            // DAZ: a subnormal operand reads as zero; FTZ: a subnormal result becomes zero.
            let operand = black_box(tiny / 4.0) * black_box(1.0f32);
            let result = black_box(tiny) / black_box(4.0f32);
            (before, operand, result)
        })
        .join()
        .expect("thread");
        assert!(flushed.0 > 0.0, "subnormals exist before the flags are set");
        if cfg!(any(target_arch = "x86_64", target_arch = "aarch64")) {
            assert_eq!((flushed.1, flushed.2), (0.0, 0.0));
        }
        assert!(black_box(tiny) / black_box(4.0f32) > 0.0, "this thread still keeps subnormals");
        let cleared = std::thread::spawn(move || {
            set_denormals_as_zero(true);
            set_denormals_as_zero(false);
            black_box(tiny) / black_box(4.0f32)
        })
        .join()
        .expect("thread");
        assert!(cleared > 0.0, "turned off again");
    }

    #[test]
    fn a_scope_restores_the_previous_setting() {
        let tiny = f32::MIN_POSITIVE;
        let (inside, after) = std::thread::spawn(move || {
            let inside = {
                let _scope = super::DenormalScope::enter(true);
                black_box(black_box(tiny) / black_box(4.0f32))
            };
            (inside, black_box(black_box(tiny) / black_box(4.0f32)))
        })
        .join()
        .expect("thread");
        if cfg!(any(target_arch = "x86_64", target_arch = "aarch64")) {
            assert_eq!(inside, 0.0);
        }
        assert!(after > 0.0, "restored when the scope ended");
    }
}
