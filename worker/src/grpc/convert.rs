//! Pure conversions between the KServe v2 gRPC messages and the worker's front-end independent
//! types. Nothing here touches the repository; every function is unit-tested on its own.
//!
//! Checks on what a client claims (shapes, sizes, counts) happen before anything is allocated
//! from them: raw contents are already allocated by the decoder and are only wrapped (zero
//! copy), typed contents are counted against the shape before they are re-encoded.

use std::time::{Duration, Instant};

use bytes::Bytes;
use nereid_common::dtype::{byte_size, element_count};
use nereid_common::{DataType, Status};
use nereid_proto::inference::infer_parameter::ParameterChoice;
use nereid_proto::inference::model_infer_request::InferInputTensor;
use nereid_proto::inference::model_metadata_response::TensorMetadata as ProtoTensorMetadata;
use nereid_proto::inference::model_repository_parameter::ParameterChoice as RepoParameterChoice;
use nereid_proto::inference::repository_index_response::ModelIndex;
use nereid_proto::inference::{
    InferBatchStatistics, InferParameter, InferStatistics, InferTensorContents, LogSettingsRequest,
    LogSettingsResponse, ModelInferRequest, ModelInferResponse, ModelMetadataResponse, ModelRepositoryParameter,
    ModelStatistics, StatisticDuration, model_infer_response::InferOutputTensor,
};

use crate::server::{self, IndexEntry, ModelMetadata, ModelStats, TensorMetadata, parse_version};
use crate::shm::{self, SharedMemory, ShmRef, ShmWritten};
use crate::tensor::{InferRequest, InferResponse, InputTensor, OutputTensor, RequestedOutput, count_bytes_elements};

// ---------------------------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------------------------

/// Converts a `ModelInferRequest` into the worker's [`InferRequest`], validating everything the
/// wire format alone can check (datatype names, shapes, byte sizes, element counts, ranges).
/// The tensors the message carries (raw or typed contents) may take `max_bytes` in all once
/// converted — typed contents are checked before they are re-encoded: packed varints grow up
/// to eightfold, so a message within the size limit could otherwise become tensors far over it
/// (as the same tensors sent over HTTP would be refused). `deadline` is left `None`; the caller
/// sets it from the transport.
pub fn infer_request_from_proto(
    mut req: ModelInferRequest,
    shm: &SharedMemory,
    max_bytes: u64,
) -> Result<InferRequest, Status> {
    // Refused by the codec before it was decoded: what it said is this request's answer.
    if let Some(why) = nereid_proto::codec::refusal(&req) {
        return Err(Status::invalid(why));
    }
    let model_version = parse_version(&req.model_name, &req.model_version)?;
    // The codec refuses these before decoding; a request built in the process is checked here.
    for (what, n) in [("inputs", req.inputs.len()), ("outputs", req.outputs.len())] {
        if n > crate::tensor::MAX_REQUEST_TENSORS {
            return Err(Status::invalid(nereid_proto::codec::too_many_tensors(what)));
        }
    }

    let mut priority = 0u64;
    let mut timeout_us = 0u64;
    for (key, value) in &req.parameters {
        match key.as_str() {
            "priority" => priority = unsigned_parameter("priority", value)?,
            "timeout" => timeout_us = unsigned_parameter("timeout", value)?,
            _ => {}
        }
    }

    // Inputs in shared memory have no raw_input_contents entry: the entries belong to the
    // other inputs, in order (as tritonclient sends them when it mixes the two).
    let shm_inputs = req
        .inputs
        .iter()
        .map(|i| shm_parameters(|| format!("input '{}'", i.name), &i.parameters))
        .collect::<Result<Vec<_>, _>>()?;
    let in_shm = shm_inputs.iter().filter(|r| r.is_some()).count();
    let raw = std::mem::take(&mut req.raw_input_contents);
    if !raw.is_empty() && raw.len() != req.inputs.len() - in_shm {
        let which = if in_shm == 0 { String::new() } else { format!(" not in shared memory ({in_shm} are)") };
        return Err(Status::invalid(format!(
            "raw_input_contents has {} entries but the request has {} inputs{which}; send exactly one \
             raw_input_contents entry per such input, in input order, or none",
            raw.len(),
            req.inputs.len() - in_shm
        )));
    }
    let mut raw = raw.into_iter();

    let mut inputs = Vec::with_capacity(req.inputs.len());
    let mut budget = shm.request_budget();
    let mut wire_budget = max_bytes;
    for (input, shm_ref) in std::mem::take(&mut req.inputs).into_iter().zip(shm_inputs) {
        let source = match shm_ref {
            Some(r) => Source::Shm(r, shm, &mut budget),
            None => Source::Wire(raw.next(), &mut wire_budget),
        };
        inputs.push(input_from_proto(input, source)?);
    }

    let mut outputs = Vec::with_capacity(req.outputs.len());
    let mut shm_outputs = Vec::new();
    for output in std::mem::take(&mut req.outputs) {
        let ctx = || format!("output '{}'", output.name);
        let classification = match output.parameters.get("classification").map(|p| &p.parameter_choice) {
            None => 0,
            Some(Some(ParameterChoice::Int64Param(n))) => classification_count(ctx, *n)?,
            Some(Some(ParameterChoice::Uint64Param(n))) => classification_count(ctx, i64::try_from(*n).unwrap_or(-1))?,
            Some(_) => {
                return Err(Status::invalid(format!("{}: parameter 'classification' must be an int64_param", ctx())));
            }
        };
        if let Some(r) = shm_parameters(ctx, &output.parameters)? {
            // Triton's check, before the region is looked up: a classification's strings have
            // no agreed layout in a region.
            if classification != 0 {
                return Err(Status::invalid(format!(
                    "output can't set both '{}' and 'classification' ({})",
                    shm::REGION,
                    ctx()
                )));
            }
            shm_outputs.push((output.name.clone(), shm.target(&ctx(), &r)?));
        }
        outputs.push(RequestedOutput { name: output.name, binary_data: None, classification });
    }

    Ok(InferRequest {
        model_name: req.model_name,
        model_version,
        id: req.id,
        inputs,
        outputs,
        priority,
        timeout_us,
        deadline: None,
        shm_outputs,
    })
}

/// `LogSettings`: applies the request's settings (all or none; an empty request changes
/// nothing) and answers every setting as it now is.
pub fn log_settings(request: LogSettingsRequest) -> Result<LogSettingsResponse, Status> {
    use nereid_common::telemetry::{LogValue, log_settings};
    use nereid_proto::inference::log_settings_request::setting_value::ParameterChoice as In;
    use nereid_proto::inference::log_settings_response::{SettingValue, setting_value::ParameterChoice as Out};
    let mut changes = Vec::with_capacity(request.settings.len());
    for (key, value) in request.settings {
        let value = match value.parameter_choice {
            Some(In::BoolParam(b)) => LogValue::Bool(b),
            Some(In::Uint32Param(n)) => LogValue::Uint(n),
            Some(In::StringParam(s)) => LogValue::Str(s),
            None => return Err(Status::invalid(format!("log setting '{key}' has no value"))),
        };
        changes.push((key, value));
    }
    log_settings().apply(&changes)?;
    let settings = log_settings()
        .current()
        .into_iter()
        .map(|(k, v)| {
            let choice = match v {
                LogValue::Bool(b) => Out::BoolParam(b),
                LogValue::Uint(n) => Out::Uint32Param(n),
                LogValue::Str(s) => Out::StringParam(s),
            };
            (k.to_string(), SettingValue { parameter_choice: Some(choice) })
        })
        .collect();
    Ok(LogSettingsResponse { settings })
}

/// About how many bytes converting a request's inputs copies or walks, before anything is
/// checked: for deciding where to decode it. Typed contents are re-encoded (up to 8 bytes an
/// element; a string its length and a 4-byte prefix), and raw BYTES inputs are walked element
/// by element (their raw contents are counted whole when any input is BYTES).
pub fn conversion_bytes(req: &ModelInferRequest) -> u64 {
    let typed = req
        .inputs
        .iter()
        .filter_map(|i| i.contents.as_ref())
        .map(|c| {
            let fixed = (c.bool_contents.len()
                + c.int_contents.len()
                + c.int64_contents.len()
                + c.uint_contents.len()
                + c.uint64_contents.len()
                + c.fp32_contents.len()
                + c.fp64_contents.len()) as u64;
            let strings = c.bytes_contents.iter().map(|b| 4 + b.len() as u64).fold(0, u64::saturating_add);
            fixed.saturating_mul(8).saturating_add(strings)
        })
        .fold(0, u64::saturating_add);
    let raw_strings = if req.inputs.iter().any(|i| i.datatype == "BYTES") {
        req.raw_input_contents.iter().map(|r| r.len() as u64).fold(0, u64::saturating_add)
    } else {
        0
    };
    typed.saturating_add(raw_strings)
}

/// What a request's inputs claim to read from shared memory (`shared_memory_byte_size`), before
/// anything is checked: for deciding where to decode it.
pub fn shm_input_bytes(req: &ModelInferRequest) -> u64 {
    req.inputs
        .iter()
        .filter_map(|i| i.parameters.get(shm::BYTE_SIZE))
        .map(|p| match p.parameter_choice {
            Some(ParameterChoice::Int64Param(n)) => n.max(0) as u64,
            Some(ParameterChoice::Uint64Param(n)) => n,
            _ => 0,
        })
        .fold(0, u64::saturating_add)
}

/// A requested output's `classification` class count (0: not requested).
pub fn classification_count(ctx: impl Fn() -> String, n: i64) -> Result<u32, Status> {
    u32::try_from(n).map_err(|_| {
        Status::invalid(format!("{}: classification must be a class count from 0 to {}, got {n}", ctx(), u32::MAX))
    })
}

/// A tensor's shared-memory parameters (`None` when it has none): the region as a
/// `string_param`, offset and byte size as `int64_param` (or `uint64_param`).
fn shm_parameters(
    ctx: impl Fn() -> String,
    parameters: &std::collections::HashMap<String, InferParameter>,
) -> Result<Option<ShmRef>, Status> {
    if parameters.is_empty() || !parameters.keys().any(|k| k.starts_with("shared_memory_")) {
        return Ok(None);
    }
    let region = match parameters.get(shm::REGION).map(|p| &p.parameter_choice) {
        None => None,
        Some(Some(ParameterChoice::StringParam(s))) => Some(s.clone()),
        Some(_) => {
            return Err(Status::invalid(format!("{}: parameter '{}' must be a string_param", ctx(), shm::REGION)));
        }
    };
    let int = |key: &str| match parameters.get(key).map(|p| &p.parameter_choice) {
        None => Ok(None),
        Some(Some(ParameterChoice::Int64Param(v))) => Ok(Some(*v)),
        Some(Some(ParameterChoice::Uint64Param(v))) => Ok(Some(i64::try_from(*v).unwrap_or(i64::MAX))),
        Some(_) => Err(Status::invalid(format!("{}: parameter '{key}' must be an int64_param", ctx()))),
    };
    ShmRef::from_parameters(&ctx(), region, int(shm::OFFSET)?, int(shm::BYTE_SIZE)?)
}

/// Where an input's bytes come from: the message (its raw entry, if the request uses raw
/// contents, else its typed contents) or a shared-memory region.
enum Source<'a, R> {
    /// With what the request's tensors in the message may still take once converted.
    Wire(Option<R>, &'a mut u64),
    /// With what the request may still copy out of regions.
    Shm(ShmRef, &'a SharedMemory, &'a mut u64),
}

/// A non-negative integer request parameter (`int64_param` or `uint64_param`).
fn unsigned_parameter(name: &str, value: &InferParameter) -> Result<u64, Status> {
    match value.parameter_choice {
        Some(ParameterChoice::Uint64Param(v)) => Ok(v),
        Some(ParameterChoice::Int64Param(v)) if v >= 0 => Ok(v as u64),
        Some(ParameterChoice::Int64Param(v)) => {
            Err(Status::invalid(format!("parameter '{name}' must be non-negative, got {v}")))
        }
        _ => Err(Status::invalid(format!("parameter '{name}' must be an int64_param or uint64_param"))),
    }
}

fn shape_text(shape: &[i64]) -> String {
    format!("{shape:?}")
}

/// One input, with its bytes from `source`.
fn input_from_proto<R>(input: InferInputTensor, source: Source<'_, R>) -> Result<InputTensor, Status>
where
    R: Into<Bytes> + AsRef<[u8]>,
{
    let name = input.name;
    let datatype = DataType::from_wire_name(&input.datatype)
        .ok_or_else(|| Status::invalid(format!("input '{name}': unknown datatype '{}'", input.datatype)))?;
    let shape = input.shape;
    // The codec refuses these before decoding; a request built in the process is checked here.
    if shape.len() > crate::tensor::MAX_RANK {
        return Err(Status::invalid(format!(
            "input '{name}': shape has more than {} dimensions",
            crate::tensor::MAX_RANK
        )));
    }
    let count = element_count(&shape).ok_or_else(|| {
        Status::invalid(format!(
            "input '{name}': invalid shape {} (dimensions must be non-negative and the element count must fit in 64 bits)",
            shape_text(&shape)
        ))
    })?;
    // Fixed-size types: the byte size must be representable before anything else is looked at.
    let expected_bytes = match datatype.element_size() {
        Some(_) => Some(byte_size(datatype, &shape).ok_or_else(|| {
            Status::invalid(format!(
                "input '{name}': shape {} of {datatype} overflows the addressable byte size",
                shape_text(&shape)
            ))
        })?),
        None => None,
    };
    let typed = input.contents.filter(|c| !contents_empty(c));
    let (raw, wire_budget) = match source {
        Source::Wire(raw, budget) => (raw, budget),
        Source::Shm(r, shm, budget) => {
            if typed.is_some() {
                return Err(Status::invalid(format!(
                    "input '{name}': has both shared memory parameters and typed contents; send one of them"
                )));
            }
            let ctx = format!("input '{name}'");
            if let Some(expected) = expected_bytes
                && r.byte_size != expected
            {
                return Err(Status::invalid(format!(
                    "{ctx}: {} is {} but shape {} of {datatype} needs {expected} bytes",
                    shm::BYTE_SIZE,
                    r.byte_size,
                    shape_text(&shape)
                )));
            }
            let data = shm.read(&ctx, &r, budget)?;
            if expected_bytes.is_none() {
                let elements = count_bytes_elements(&name, &data)?;
                if elements != count {
                    return Err(Status::invalid(format!(
                        "{ctx}: its shared memory holds {elements} BYTES elements but shape {} needs {count}",
                        shape_text(&shape)
                    )));
                }
            }
            return Ok(InputTensor { name, datatype, shape, data });
        }
    };
    // Typed contents must hold the shape's element count: said first, so that a wrong count
    // under a huge shape is reported as the count it is, not as the size the shape claims.
    if let Some(c) = &typed {
        let (field, got) = typed_field(&name, datatype, c)?;
        check_count(&name, field, datatype, &shape, count, got)?;
    }
    // What the tensor takes once converted, from what the request's others left of the limit:
    // checked before typed contents are re-encoded.
    let converted = match (&raw, &typed) {
        (Some(raw), None) => raw.as_ref().len() as u64,
        (None, Some(c)) => expected_bytes
            .unwrap_or_else(|| c.bytes_contents.iter().map(|b| 4 + b.len() as u64).fold(0, u64::saturating_add)),
        _ => 0,
    };
    if converted > *wire_budget {
        return Err(Status::invalid(format!(
            "input '{name}': shape {} of {datatype} takes {converted} bytes once converted, more than the \
             {} bytes the request limit (--max-request-bytes) leaves after the inputs before it",
            shape_text(&shape),
            *wire_budget
        )));
    }
    *wire_budget -= converted;
    let data = match (raw, typed) {
        (Some(_), Some(_)) => {
            return Err(Status::invalid(format!(
                "input '{name}': has both raw_input_contents and typed contents; send one of them"
            )));
        }
        (Some(raw), None) => {
            let got = raw.as_ref().len() as u64;
            match expected_bytes {
                Some(expected) if got != expected => {
                    return Err(Status::invalid(format!(
                        "input '{name}': raw_input_contents has {got} bytes but shape {} of {datatype} needs {expected} bytes",
                        shape_text(&shape)
                    )));
                }
                Some(_) => {}
                None => {
                    let elements = count_bytes_elements(&name, raw.as_ref())?;
                    if elements != count {
                        return Err(Status::invalid(format!(
                            "input '{name}': raw_input_contents holds {elements} BYTES elements but shape {} needs {count}",
                            shape_text(&shape)
                        )));
                    }
                }
            }
            raw.into()
        }
        (None, Some(contents)) => typed_contents(&name, datatype, contents)?,
        (None, None) => {
            if count != 0 {
                return Err(Status::invalid(format!(
                    "input '{name}': no data; shape {} needs {count} elements in raw_input_contents or contents",
                    shape_text(&shape)
                )));
            }
            Bytes::new()
        }
    };

    Ok(InputTensor { name, datatype, shape, data })
}

fn contents_empty(c: &InferTensorContents) -> bool {
    c.bool_contents.is_empty()
        && c.int_contents.is_empty()
        && c.int64_contents.is_empty()
        && c.uint_contents.is_empty()
        && c.uint64_contents.is_empty()
        && c.fp32_contents.is_empty()
        && c.fp64_contents.is_empty()
        && c.bytes_contents.is_empty()
}

/// Checks a typed list's length against the shape's element count (before re-encoding it).
fn check_count(
    name: &str,
    field: &str,
    datatype: DataType,
    shape: &[i64],
    count: u64,
    got: usize,
) -> Result<(), Status> {
    if got as u64 != count {
        return Err(Status::invalid(format!(
            "input '{name}': contents.{field} has {got} elements but shape {} of {datatype} needs {count}",
            shape_text(shape)
        )));
    }
    Ok(())
}

fn encode<T: Copy, const N: usize>(values: &[T], to_le: impl Fn(T) -> [u8; N]) -> Bytes {
    let mut out = Vec::with_capacity(values.len() * N);
    for &v in values {
        out.extend_from_slice(&to_le(v));
    }
    Bytes::from(out)
}

/// Narrows 32-bit typed contents into a smaller integer type, naming the first out-of-range value.
fn narrow<T: Copy + std::fmt::Display, U: Copy + TryFrom<T>, const N: usize>(
    name: &str,
    datatype: DataType,
    values: &[T],
    to_le: impl Fn(U) -> [u8; N],
) -> Result<Bytes, Status> {
    let mut out = Vec::with_capacity(values.len() * N);
    for (i, &v) in values.iter().enumerate() {
        let n = U::try_from(v).map_err(|_| {
            Status::invalid(format!("input '{name}': element {i} value {v} is out of range for {datatype}"))
        })?;
        out.extend_from_slice(&to_le(n));
    }
    Ok(Bytes::from(out))
}

/// Re-encodes typed contents as raw little-endian bytes (Triton `BYTES` layout for strings).
/// Its element count has been checked ([`typed_field`], [`check_count`]).
fn typed_contents(name: &str, datatype: DataType, c: InferTensorContents) -> Result<Bytes, Status> {
    use DataType as D;
    Ok(match datatype {
        D::Bool => Bytes::from(c.bool_contents.iter().map(|&b| b as u8).collect::<Vec<u8>>()),
        D::Int8 => narrow(name, datatype, &c.int_contents, |v: i8| v.to_le_bytes())?,
        D::Int16 => narrow(name, datatype, &c.int_contents, |v: i16| v.to_le_bytes())?,
        D::Int32 => encode(&c.int_contents, i32::to_le_bytes),
        D::Int64 => encode(&c.int64_contents, i64::to_le_bytes),
        D::Uint8 => narrow(name, datatype, &c.uint_contents, |v: u8| v.to_le_bytes())?,
        D::Uint16 => narrow(name, datatype, &c.uint_contents, |v: u16| v.to_le_bytes())?,
        D::Uint32 => encode(&c.uint_contents, u32::to_le_bytes),
        D::Uint64 => encode(&c.uint64_contents, u64::to_le_bytes),
        D::Fp32 => encode(&c.fp32_contents, f32::to_le_bytes),
        D::Fp64 => encode(&c.fp64_contents, f64::to_le_bytes),
        D::Bytes => {
            let total: usize = c.bytes_contents.iter().map(|e| 4 + e.len()).sum();
            let mut out = Vec::with_capacity(total);
            for e in &c.bytes_contents {
                let e: &[u8] = e.as_ref();
                let len = u32::try_from(e.len())
                    .map_err(|_| Status::invalid(format!("input '{name}': a BYTES element is larger than 4 GiB")))?;
                out.extend_from_slice(&len.to_le_bytes());
                out.extend_from_slice(e);
            }
            Bytes::from(out)
        }
        D::Fp16 | D::Bf16 => return Err(no_typed_field(name, datatype)),
    })
}

/// The typed contents field that carries `datatype`, and how many elements it holds.
fn typed_field(name: &str, datatype: DataType, c: &InferTensorContents) -> Result<(&'static str, usize), Status> {
    use DataType as D;
    Ok(match datatype {
        D::Bool => ("bool_contents", c.bool_contents.len()),
        D::Int8 | D::Int16 | D::Int32 => ("int_contents", c.int_contents.len()),
        D::Int64 => ("int64_contents", c.int64_contents.len()),
        D::Uint8 | D::Uint16 | D::Uint32 => ("uint_contents", c.uint_contents.len()),
        D::Uint64 => ("uint64_contents", c.uint64_contents.len()),
        D::Fp32 => ("fp32_contents", c.fp32_contents.len()),
        D::Fp64 => ("fp64_contents", c.fp64_contents.len()),
        D::Bytes => ("bytes_contents", c.bytes_contents.len()),
        D::Fp16 | D::Bf16 => return Err(no_typed_field(name, datatype)),
    })
}

fn no_typed_field(name: &str, datatype: DataType) -> Status {
    Status::invalid(format!(
        "input '{name}': {datatype} data must be sent in raw_input_contents (there is no typed contents field for it)"
    ))
}

// ---------------------------------------------------------------------------------------------
// Deadlines
// ---------------------------------------------------------------------------------------------

/// Parses a `grpc-timeout` header value: at most 8 ASCII digits followed by a unit
/// (`H` hours, `M` minutes, `S` seconds, `m` milliseconds, `u` microseconds, `n` nanoseconds).
/// `None` when malformed (then, as tonic does, the request has no transport deadline).
pub fn parse_grpc_timeout(value: &str) -> Option<Duration> {
    if !value.is_ascii() {
        return None;
    }
    let unit = *value.as_bytes().last()?;
    let digits = &value[..value.len() - 1];
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        b'H' => Duration::from_secs(n * 3600),
        b'M' => Duration::from_secs(n * 60),
        b'S' => Duration::from_secs(n),
        b'm' => Duration::from_millis(n),
        b'u' => Duration::from_micros(n),
        b'n' => Duration::from_nanos(n),
        _ => return None,
    })
}

/// The deadline a request's `grpc-timeout` metadata asks for, measured from `now` (when its
/// headers arrived) and brought forward by [`deadline_margin`].
///
/// tonic's transport enforces the same timeout itself, timed from the same moment, by
/// dropping the handler and answering CANCELLED. Ending ours a little earlier lets the core
/// answer first, with DEADLINE_EXCEEDED (what Triton answers, and what the statistics count).
pub fn grpc_deadline(metadata: &tonic::metadata::MetadataMap, now: Instant) -> Option<Instant> {
    grpc_timeout_deadline(metadata.get("grpc-timeout")?.to_str().ok()?, now)
}

/// [`grpc_deadline`] from a `grpc-timeout` header's text.
pub fn grpc_timeout_deadline(value: &str, now: Instant) -> Option<Instant> {
    let timeout = parse_grpc_timeout(value)?;
    now.checked_add(timeout - deadline_margin(timeout))
}

/// How much earlier than the client's timeout the core gives up: an eighth of it, at most 5 ms.
pub fn deadline_margin(timeout: Duration) -> Duration {
    (timeout / 8).min(Duration::from_millis(5))
}

// ---------------------------------------------------------------------------------------------
// Responses
// ---------------------------------------------------------------------------------------------

/// Renders an inference response: every output's data in `raw_output_contents` (as Triton does
/// for raw requests and as tritonclient reads them), metadata in `outputs`, same order.
pub fn infer_response_to_proto(resp: InferResponse) -> ModelInferResponse {
    let mut outputs = Vec::with_capacity(resp.outputs.len());
    let mut raw_output_contents = Vec::with_capacity(resp.outputs.len());
    for OutputTensor { name, datatype, shape, data } in resp.outputs {
        outputs.push(InferOutputTensor {
            name,
            datatype: datatype.wire_name().to_string(),
            shape,
            parameters: Default::default(),
            contents: None,
        });
        raw_output_contents.push(data);
    }
    ModelInferResponse {
        model_name: resp.model_name,
        model_version: resp.model_version.to_string(),
        id: resp.id,
        parameters: Default::default(),
        outputs,
        raw_output_contents,
    }
}

fn tensor_metadata_to_proto(t: TensorMetadata) -> ProtoTensorMetadata {
    ProtoTensorMetadata { name: t.name, datatype: t.datatype, shape: t.shape }
}

/// Names the shared-memory region of each output in `written` (their bytes are there, and their
/// `raw_output_contents` entries empty, keeping the entries aligned with the outputs).
pub fn mark_shm_outputs(response: &mut ModelInferResponse, written: &[ShmWritten]) {
    for w in written {
        let Some(output) = response.outputs.iter_mut().find(|o| o.name == w.name) else {
            continue;
        };
        let param = |choice| InferParameter { parameter_choice: Some(choice) };
        output.parameters.insert(shm::REGION.to_string(), param(ParameterChoice::StringParam(w.region.clone())));
        output.parameters.insert(shm::BYTE_SIZE.to_string(), param(ParameterChoice::Int64Param(w.byte_size as i64)));
    }
}

pub fn model_metadata_to_proto(m: ModelMetadata) -> ModelMetadataResponse {
    ModelMetadataResponse {
        name: m.name,
        versions: m.versions,
        platform: m.platform,
        inputs: m.inputs.into_iter().map(tensor_metadata_to_proto).collect(),
        outputs: m.outputs.into_iter().map(tensor_metadata_to_proto).collect(),
    }
}

pub fn index_entry_to_proto(e: IndexEntry) -> ModelIndex {
    ModelIndex { name: e.name, version: e.version, state: e.state, reason: e.reason }
}

fn duration_to_proto(d: server::Duration) -> Option<StatisticDuration> {
    Some(StatisticDuration { count: d.count, ns: d.ns })
}

/// Maps one model version's statistics onto Triton's `ModelStatistics`.
pub fn model_stats_to_proto(s: ModelStats) -> ModelStatistics {
    ModelStatistics {
        name: s.name,
        version: s.version,
        last_inference: s.last_inference_ms,
        inference_count: s.inference_count,
        execution_count: s.execution_count,
        inference_stats: Some(InferStatistics {
            success: duration_to_proto(s.success),
            fail: duration_to_proto(s.fail),
            queue: duration_to_proto(s.queue),
            compute_input: duration_to_proto(s.compute_input),
            compute_infer: duration_to_proto(s.compute_infer),
            compute_output: duration_to_proto(s.compute_output),
            cache_hit: duration_to_proto(s.cache_hit),
            cache_miss: duration_to_proto(s.cache_miss),
        }),
        batch_stats: s
            .batch_stats
            .into_iter()
            .map(|b| InferBatchStatistics {
                batch_size: b.batch_size,
                compute_input: duration_to_proto(b.compute_input),
                compute_infer: duration_to_proto(b.compute_infer),
                compute_output: duration_to_proto(b.compute_output),
            })
            .collect(),
        memory_usage: Vec::new(),
        response_stats: Default::default(),
    }
}

/// The config override of a `RepositoryModelLoad` request: parameter `config` (a string of JSON
/// `ModelConfig`). `file:` parameters (uploaded model files) are UNIMPLEMENTED; any other key is
/// INVALID_ARGUMENT, as in Triton. Keys are looked at in order, so the answer to a request with
/// several bad ones does not depend on the map's order.
pub fn load_config_parameter<'a, I>(parameters: I) -> Result<Option<String>, Status>
where
    I: IntoIterator<Item = (&'a String, &'a ModelRepositoryParameter)>,
{
    let mut parameters: Vec<_> = parameters.into_iter().collect();
    parameters.sort_unstable_by_key(|(key, _)| *key);
    if let Some((key, _)) = parameters.iter().find(|(key, _)| *key != "config" && !key.starts_with("file:")) {
        return Err(Status::invalid(format!("unrecognized load parameter '{key}'.")));
    }
    let mut config = None;
    for (key, value) in parameters {
        if key.starts_with("file:") {
            // UNIMPLEMENTED, as over HTTP (501): a valid request this worker does not serve.
            return Err(Status::unimplemented(format!(
                "parameter '{key}': loading model files sent with the request is not supported"
            )));
        }
        if key == "config" {
            match &value.parameter_choice {
                Some(RepoParameterChoice::StringParam(s)) => config = Some(s.clone()),
                _ => return Err(Status::invalid("parameter 'config' must be a string_param holding JSON")),
            }
        }
    }
    Ok(config)
}

/// The `unload_dependents` parameter of an unload request (false when absent).
pub fn unload_dependents_parameter<'a, I>(parameters: I) -> Result<bool, Status>
where
    I: IntoIterator<Item = (&'a String, &'a ModelRepositoryParameter)>,
{
    for (key, value) in parameters {
        if key == "unload_dependents" {
            return match &value.parameter_choice {
                Some(RepoParameterChoice::BoolParam(b)) => Ok(*b),
                _ => Err(Status::invalid("parameter 'unload_dependents' must be a bool_param")),
            };
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use nereid_common::Code;
    use nereid_proto::inference::model_infer_request::InferRequestedOutputTensor;
    use std::collections::HashMap;

    /// [`infer_request_from_proto`] without a request size limit.
    fn from_proto(req: ModelInferRequest, shm: &SharedMemory) -> Result<InferRequest, Status> {
        infer_request_from_proto(req, shm, u64::MAX)
    }

    fn input(name: &str, dt: &str, shape: &[i64], contents: Option<InferTensorContents>) -> InferInputTensor {
        InferInputTensor {
            name: name.into(),
            datatype: dt.into(),
            shape: shape.to_vec(),
            parameters: HashMap::new(),
            contents,
        }
    }

    /// One large string, or a raw BYTES input, counts at its size (it is copied or walked),
    /// not as one element.
    #[test]
    fn conversion_bytes_weigh_strings_by_their_length() {
        let strings = Some(InferTensorContents { bytes_contents: vec![vec![b'x'; 2 << 20]], ..Default::default() });
        let one_string = request(vec![input("S", "BYTES", &[1], strings)], vec![]);
        assert_eq!(conversion_bytes(&one_string), 4 + (2 << 20));
        let ints = Some(InferTensorContents { int64_contents: vec![1; 10], ..Default::default() });
        assert_eq!(conversion_bytes(&request(vec![input("I", "INT64", &[10], ints)], vec![])), 80);
        let raw = request(vec![input("R", "BYTES", &[1], None)], vec![vec![0; 1000]]);
        assert_eq!(conversion_bytes(&raw), 1000);
        let raw_floats = request(vec![input("F", "FP32", &[250], None)], vec![vec![0; 1000]]);
        assert_eq!(conversion_bytes(&raw_floats), 0, "raw fixed-size inputs are moved, not converted");
    }

    /// The codec's bounds hold for a request built in the process too (it skips the codec).
    #[test]
    fn entry_bounds_hold_without_the_codec() {
        let shm = SharedMemory::disabled();
        let deep = input("D", "FP32", &[1; 65], None);
        let e = from_proto(request(vec![deep], vec![vec![0; 4]]), &shm).unwrap_err();
        assert!(e.message.contains("input 'D': shape has more than 64 dimensions"), "{}", e.message);
        let many = vec![input("X", "FP32", &[1], None); 4097];
        let e = from_proto(request(many, vec![]), &shm).unwrap_err();
        assert!(e.message.contains("at most 4096 inputs"), "{}", e.message);
    }

    /// Typed contents count at their converted size against the request limit, before they are
    /// re-encoded (packed varints grow up to eightfold), across all of a request's inputs with
    /// raw contents alike; exactly at the limit passes.
    #[test]
    fn typed_contents_are_bounded_by_the_request_limit_once_converted() {
        let shm = SharedMemory::disabled();
        let zeros = |n: usize| Some(InferTensorContents { int64_contents: vec![0; n], ..Default::default() });
        let a = || input("A", "INT64", &[100], zeros(100));
        // 100 INT64 zeros: about 100 bytes in the message, 800 once converted.
        assert!(infer_request_from_proto(request(vec![a()], vec![]), &shm, 800).is_ok());
        let e = infer_request_from_proto(request(vec![a()], vec![]), &shm, 799).unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(e.message.contains("input 'A'") && e.message.contains("800 bytes"), "{}", e.message);
        // Two inputs share the limit: the second is refused.
        let two = vec![a(), input("B", "INT64", &[100], zeros(100))];
        let e = infer_request_from_proto(request(two, vec![]), &shm, 1599).unwrap_err();
        assert!(e.message.contains("input 'B'") && e.message.contains("799 bytes"), "{}", e.message);
        // Raw contents count too.
        let raw = vec![input("R", "FP32", &[4], None)];
        let e = infer_request_from_proto(request(raw, vec![vec![0; 16]]), &shm, 15).unwrap_err();
        assert!(e.message.contains("input 'R'"), "{}", e.message);
        // BYTES: each element's 4-byte length and its bytes.
        let strings = || Some(InferTensorContents { bytes_contents: vec![b"abc".to_vec(); 2], ..Default::default() });
        assert!(
            infer_request_from_proto(request(vec![input("S", "BYTES", &[2], strings())], vec![]), &shm, 14).is_ok()
        );
        assert!(
            infer_request_from_proto(request(vec![input("S", "BYTES", &[2], strings())], vec![]), &shm, 13).is_err()
        );
    }

    fn request(inputs: Vec<InferInputTensor>, raw: Vec<Vec<u8>>) -> ModelInferRequest {
        ModelInferRequest {
            model_name: "m".into(),
            model_version: String::new(),
            id: "req-1".into(),
            parameters: HashMap::new(),
            inputs,
            outputs: vec![],
            raw_input_contents: raw.into_iter().map(Into::into).collect(),
        }
    }

    fn err(req: ModelInferRequest) -> Status {
        from_proto(req, &SharedMemory::disabled()).unwrap_err()
    }

    fn shm_params(region: &str, offset: Option<i64>, byte_size: i64) -> HashMap<String, InferParameter> {
        let p = |c| InferParameter { parameter_choice: Some(c) };
        let mut m = HashMap::new();
        m.insert(shm::REGION.to_string(), p(ParameterChoice::StringParam(region.into())));
        m.insert(shm::BYTE_SIZE.to_string(), p(ParameterChoice::Int64Param(byte_size)));
        if let Some(o) = offset {
            m.insert(shm::OFFSET.to_string(), p(ParameterChoice::Int64Param(o)));
        }
        m
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn shared_memory_inputs_and_outputs() {
        let obj = crate::shm::testing::TestObject::new("grpc-convert", 4096);
        obj.write(16, &f32_bytes(&[1.0, 2.0, 3.0, 4.0]));
        let shm = SharedMemory::allowed(1 << 20);
        shm.register("in", &obj.key, 0, 4096).unwrap();

        // A from shared memory, B from the one raw entry (the entries skip shm inputs).
        let mut a = input("A", "FP32", &[4], None);
        a.parameters = shm_params("in", Some(16), 16);
        let b = input("B", "FP32", &[1], None);
        let mut req = request(vec![a.clone(), b.clone()], vec![f32_bytes(&[9.0])]);
        req.outputs =
            vec![InferRequestedOutputTensor { name: "Y".into(), parameters: shm_params("in", Some(1024), 64) }];
        let r = from_proto(req, &shm).unwrap();
        assert_eq!(&r.inputs[0].data[..], &f32_bytes(&[1.0, 2.0, 3.0, 4.0])[..]);
        assert_eq!(&r.inputs[1].data[..], &f32_bytes(&[9.0])[..]);
        assert_eq!(r.shm_outputs.len(), 1);
        assert_eq!(r.shm_outputs[0].0, "Y");

        // The output goes to the region; the response names it and keeps an empty raw entry.
        let mut outputs = vec![
            OutputTensor { name: "X".into(), datatype: DataType::Fp32, shape: vec![1], data: f32_bytes(&[5.0]).into() },
            OutputTensor {
                name: "Y".into(),
                datatype: DataType::Fp32,
                shape: vec![2],
                data: f32_bytes(&[6.0, 7.0]).into(),
            },
        ];
        let written = shm::write_outputs(&mut outputs, &r.shm_outputs).unwrap();
        assert_eq!(obj.read(1024, 8), f32_bytes(&[6.0, 7.0]));
        let mut proto = infer_response_to_proto(InferResponse {
            model_name: "m".into(),
            model_version: 1,
            id: String::new(),
            shm_written: Vec::new(),
            outputs,
        });
        mark_shm_outputs(&mut proto, &written);
        assert_eq!(proto.raw_output_contents, vec![f32_bytes(&[5.0]), vec![]]);
        assert!(proto.outputs[0].parameters.is_empty());
        let y = &proto.outputs[1].parameters;
        assert_eq!(y[shm::REGION].parameter_choice, Some(ParameterChoice::StringParam("in".into())));
        assert_eq!(y[shm::BYTE_SIZE].parameter_choice, Some(ParameterChoice::Int64Param(8)));

        // An output larger than the room the request gave fails, naming it.
        let mut big = vec![OutputTensor {
            name: "Y".into(),
            datatype: DataType::Fp32,
            shape: vec![32],
            data: vec![0u8; 128].into(),
        }];
        let e = shm::write_outputs(&mut big, &r.shm_outputs).unwrap_err();
        assert!(e.message.contains("output 'Y': 128 bytes do not fit"), "{}", e.message);

        let check = |req: ModelInferRequest, needle: &str| {
            let e = from_proto(req, &shm).unwrap_err();
            assert_eq!(e.code, Code::InvalidArgument, "{}", e.message);
            assert!(e.message.contains(needle), "{needle}: {}", e.message);
        };
        // A raw entry for the shm input too.
        check(
            request(vec![a.clone(), b.clone()], vec![vec![0; 16], vec![0; 4]]),
            "inputs not in shared memory (1 are)",
        );
        // The byte size must match the shape.
        let mut wrong = a.clone();
        wrong.parameters = shm_params("in", Some(16), 12);
        check(request(vec![wrong], vec![]), "shared_memory_byte_size is 12 but shape [4] of FP32 needs 16 bytes");
        // Not both shared memory and contents.
        let mut both = a.clone();
        both.contents = Some(InferTensorContents { fp32_contents: vec![1.0; 4], ..Default::default() });
        check(request(vec![both], vec![]), "both shared memory parameters and typed contents");
        // Unknown region, out-of-bounds offset, wrong parameter type.
        let mut unknown = a.clone();
        unknown.parameters = shm_params("nope", None, 16);
        let e = from_proto(request(vec![unknown], vec![]), &shm).unwrap_err();
        assert_eq!(e.code, Code::NotFound, "{}", e.message);
        assert!(e.message.starts_with("Unable to find shared memory region: 'nope'"), "{}", e.message);
        let mut outside = a.clone();
        outside.parameters = shm_params("in", Some(4090), 16);
        check(request(vec![outside], vec![]), "does not fit in region 'in' of 4096 bytes");
        let mut typed = a.clone();
        typed.parameters.insert(
            shm::OFFSET.into(),
            InferParameter { parameter_choice: Some(ParameterChoice::StringParam("16".into())) },
        );
        check(request(vec![typed], vec![]), "'shared_memory_offset' must be an int64_param");
        let mut out_req = request(vec![b.clone()], vec![f32_bytes(&[9.0])]);
        out_req.outputs =
            vec![InferRequestedOutputTensor { name: "Y".into(), parameters: shm_params("gone", None, 8) }];
        let e = from_proto(out_req.clone(), &shm).unwrap_err();
        assert_eq!(e.code, Code::NotFound, "{}", e.message);
        assert_eq!(e.message, "Unable to find shared memory region: 'gone' (output 'Y')");
        // An output in shared memory cannot be a classification (checked before the region).
        for region in ["in", "gone"] {
            let mut params = shm_params(region, None, 64);
            params.insert(
                "classification".into(),
                InferParameter { parameter_choice: Some(ParameterChoice::Int64Param(2)) },
            );
            out_req.outputs = vec![InferRequestedOutputTensor { name: "Y".into(), parameters: params }];
            check(out_req.clone(), "output can't set both 'shared_memory_region' and 'classification' (output 'Y')");
        }
        // A class count of 0 is no classification.
        let mut params = shm_params("in", None, 64);
        params
            .insert("classification".into(), InferParameter { parameter_choice: Some(ParameterChoice::Int64Param(0)) });
        out_req.outputs = vec![InferRequestedOutputTensor { name: "Y".into(), parameters: params }];
        assert_eq!(from_proto(out_req, &shm).unwrap().shm_outputs.len(), 1);

        // A worker that does not allow client shared memory says how to allow it.
        let e = from_proto(request(vec![a], vec![]), &SharedMemory::disabled()).unwrap_err();
        assert!(e.message.contains("--allow-client-shm=true"), "{}", e.message);
    }

    #[test]
    fn raw_inputs_pass_through() {
        let a: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let b: Vec<u8> = vec![1, 2];
        let s = crate::tensor::serialize_bytes_elements(["ab", "c"]);
        let f16 = vec![0u8; 6];
        let mut req = request(
            vec![
                input("A", "FP32", &[2, 2], None),
                input("B", "UINT8", &[2], None),
                input("S", "BYTES", &[2], None),
                input("H", "FP16", &[3], None),
            ],
            vec![a.clone(), b.clone(), s.clone(), f16.clone()],
        );
        req.model_version = "3".into();
        req.outputs = vec![InferRequestedOutputTensor { name: "Y".into(), parameters: HashMap::new() }];
        req.parameters
            .insert("priority".into(), InferParameter { parameter_choice: Some(ParameterChoice::Int64Param(2)) });
        req.parameters
            .insert("timeout".into(), InferParameter { parameter_choice: Some(ParameterChoice::Uint64Param(5000)) });
        req.parameters.insert(
            "whatever".into(),
            InferParameter { parameter_choice: Some(ParameterChoice::StringParam("x".into())) },
        );
        let r = from_proto(req, &SharedMemory::disabled()).unwrap();
        assert_eq!(r.model_name, "m");
        assert_eq!(r.model_version, Some(3));
        assert_eq!(r.id, "req-1");
        assert_eq!(r.priority, 2);
        assert_eq!(r.timeout_us, 5000);
        assert!(r.deadline.is_none());
        assert_eq!(r.inputs.len(), 4);
        assert_eq!(r.inputs[0].name, "A");
        assert_eq!(r.inputs[0].datatype, DataType::Fp32);
        assert_eq!(r.inputs[0].shape, vec![2, 2]);
        assert_eq!(&r.inputs[0].data[..], &a[..]);
        assert_eq!(&r.inputs[1].data[..], &b[..]);
        assert_eq!(r.inputs[2].datatype, DataType::Bytes);
        assert_eq!(&r.inputs[2].data[..], &s[..]);
        assert_eq!(r.inputs[3].datatype, DataType::Fp16);
        assert_eq!(r.outputs.len(), 1);
        assert_eq!(r.outputs[0].name, "Y");
    }

    #[test]
    fn raw_input_is_not_copied() {
        let a = vec![0u8; 16];
        let ptr = a.as_ptr();
        let r = from_proto(request(vec![input("A", "FP32", &[4], None)], vec![a]), &SharedMemory::disabled()).unwrap();
        assert_eq!(r.inputs[0].data.as_ptr(), ptr);
    }

    #[test]
    fn typed_inputs_are_encoded_little_endian() {
        let c = |f: fn(&mut InferTensorContents)| {
            let mut c = InferTensorContents::default();
            f(&mut c);
            Some(c)
        };
        let req = request(
            vec![
                input("b", "BOOL", &[3], c(|c| c.bool_contents = vec![true, false, true])),
                input("i8", "INT8", &[2], c(|c| c.int_contents = vec![-128, 127])),
                input("i16", "INT16", &[1], c(|c| c.int_contents = vec![-2])),
                input("i32", "INT32", &[2], c(|c| c.int_contents = vec![1, -1])),
                input("i64", "INT64", &[1], c(|c| c.int64_contents = vec![-3])),
                input("u8", "UINT8", &[2], c(|c| c.uint_contents = vec![0, 255])),
                input("u16", "UINT16", &[1], c(|c| c.uint_contents = vec![65535])),
                input("u32", "UINT32", &[1], c(|c| c.uint_contents = vec![7])),
                input("u64", "UINT64", &[1], c(|c| c.uint64_contents = vec![u64::MAX])),
                input("f32", "FP32", &[1, 2], c(|c| c.fp32_contents = vec![1.5, -2.0])),
                input("f64", "FP64", &[1], c(|c| c.fp64_contents = vec![0.25])),
                input("s", "BYTES", &[2], c(|c| c.bytes_contents = vec![b"hi".to_vec(), vec![]])),
                input("empty", "FP32", &[0, 3], None),
            ],
            vec![],
        );
        let r = from_proto(req, &SharedMemory::disabled()).unwrap();
        let data: Vec<&[u8]> = r.inputs.iter().map(|t| &t.data[..]).collect();
        assert_eq!(data[0], &[1, 0, 1]);
        assert_eq!(data[1], &[0x80, 0x7f]);
        assert_eq!(data[2], &(-2i16).to_le_bytes());
        assert_eq!(data[3], &[1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]);
        assert_eq!(data[4], &(-3i64).to_le_bytes());
        assert_eq!(data[5], &[0, 255]);
        assert_eq!(data[6], &[0xff, 0xff]);
        assert_eq!(data[7], &7u32.to_le_bytes());
        assert_eq!(data[8], &[0xff; 8]);
        assert_eq!(data[9], &[1.5f32.to_le_bytes(), (-2.0f32).to_le_bytes()].concat()[..]);
        assert_eq!(data[10], &0.25f64.to_le_bytes());
        assert_eq!(data[11], &crate::tensor::serialize_bytes_elements([&b"hi"[..], b""])[..]);
        assert!(data[12].is_empty());
        assert_eq!(r.inputs[12].shape, vec![0, 3]);
    }

    #[test]
    fn typed_range_and_count_errors_name_the_input() {
        let c = InferTensorContents { int_contents: vec![1, 200], ..Default::default() };
        let e = err(request(vec![input("small", "INT8", &[2], Some(c))], vec![]));
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(e.message.contains("'small'") && e.message.contains("200"), "{}", e.message);

        let c = InferTensorContents { uint_contents: vec![70000], ..Default::default() };
        let e = err(request(vec![input("u", "UINT16", &[1], Some(c))], vec![]));
        assert!(e.message.contains("'u'") && e.message.contains("out of range"), "{}", e.message);

        let c = InferTensorContents { fp32_contents: vec![1.0, 2.0, 3.0], ..Default::default() };
        let e = err(request(vec![input("x", "FP32", &[2, 2], Some(c))], vec![]));
        assert!(
            e.message.contains("'x'") && e.message.contains("fp32_contents has 3") && e.message.contains("needs 4"),
            "{}",
            e.message
        );

        // A wrong count under a shape far past the request limit is reported as the count.
        let c = InferTensorContents { fp32_contents: vec![1.0; 4], ..Default::default() };
        let huge = request(vec![input("huge", "FP32", &[1 << 40], Some(c))], vec![]);
        let e = infer_request_from_proto(huge, &SharedMemory::disabled(), 1 << 20).unwrap_err();
        assert!(
            e.message.contains("'huge'") && e.message.contains("fp32_contents has 4") && !e.message.contains("limit"),
            "{}",
            e.message
        );

        // Data in the wrong list is a count mismatch on the right one.
        let c = InferTensorContents { int64_contents: vec![1], ..Default::default() };
        let e = err(request(vec![input("w", "INT32", &[1], Some(c))], vec![]));
        assert!(e.message.contains("int_contents has 0"), "{}", e.message);

        let c = InferTensorContents { uint_contents: vec![1], ..Default::default() };
        let e = err(request(vec![input("h", "FP16", &[1], Some(c))], vec![]));
        assert!(e.message.contains("'h'") && e.message.contains("raw_input_contents"), "{}", e.message);

        let e = err(request(vec![input("none", "FP32", &[2], None)], vec![]));
        assert!(e.message.contains("'none'") && e.message.contains("no data"), "{}", e.message);
    }

    #[test]
    fn raw_byte_size_mismatch_names_input_and_sizes() {
        let e = err(request(vec![input("INPUT0", "FP32", &[1, 4], None)], vec![vec![0; 15]]));
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(e.message.contains("'INPUT0'"), "{}", e.message);
        assert!(e.message.contains("15") && e.message.contains("16"), "{}", e.message);

        // BYTES: element count and framing are checked.
        let s = crate::tensor::serialize_bytes_elements(["a"]);
        let e = err(request(vec![input("S", "BYTES", &[2], None)], vec![s]));
        assert!(e.message.contains("'S'") && e.message.contains("1 BYTES elements"), "{}", e.message);
        let e = err(request(vec![input("T", "BYTES", &[1], None)], vec![vec![5, 0, 0, 0, 1]]));
        assert!(e.message.contains("'T'") && e.message.contains("claims"), "{}", e.message);
    }

    #[test]
    fn raw_count_mismatch_rejected() {
        let e = err(request(vec![input("A", "FP32", &[1], None), input("B", "FP32", &[1], None)], vec![vec![0; 4]]));
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(e.message.contains("1 entries") && e.message.contains("2 inputs"), "{}", e.message);
    }

    #[test]
    fn raw_and_typed_together_rejected() {
        let c = InferTensorContents { fp32_contents: vec![1.0], ..Default::default() };
        let e = err(request(vec![input("A", "FP32", &[1], Some(c))], vec![vec![0; 4]]));
        assert!(e.message.contains("'A'") && e.message.contains("both"), "{}", e.message);
        // An empty contents message next to raw data is tolerated.
        let ok = from_proto(
            request(vec![input("A", "FP32", &[1], Some(InferTensorContents::default()))], vec![vec![0; 4]]),
            &SharedMemory::disabled(),
        );
        assert!(ok.is_ok());
    }

    #[test]
    fn overflowing_or_negative_shapes_rejected_without_allocating() {
        // If these allocated what the shape claims, the test would abort on OOM.
        let c = InferTensorContents { fp32_contents: vec![1.0], ..Default::default() };
        let e = err(request(vec![input("big", "FP32", &[i64::MAX, i64::MAX], Some(c.clone()))], vec![]));
        assert!(e.message.contains("'big'") && e.message.contains("shape"), "{}", e.message);
        // Element count fits in u64, byte size does not.
        let e = err(request(vec![input("big8", "FP64", &[1 << 62], Some(c.clone()))], vec![]));
        assert!(e.message.contains("'big8'") && e.message.contains("overflows"), "{}", e.message);
        // A huge but representable claim is only compared, never allocated.
        let e = err(request(vec![input("huge", "FP32", &[1 << 40], Some(c.clone()))], vec![]));
        assert!(e.message.contains("'huge'") && e.message.contains("needs 1099511627776"), "{}", e.message);
        let e = err(request(vec![input("hraw", "UINT8", &[1 << 40], None)], vec![vec![0; 4]]));
        assert!(e.message.contains("'hraw'") && e.message.contains("1099511627776"), "{}", e.message);
        let e = err(request(vec![input("neg", "FP32", &[-1, 4], Some(c))], vec![]));
        assert!(e.message.contains("'neg'") && e.message.contains("non-negative"), "{}", e.message);
        let e = err(request(vec![input("sb", "BYTES", &[i64::MAX, 4], None)], vec![vec![]]));
        assert!(e.message.contains("'sb'"), "{}", e.message);
    }

    #[test]
    fn unknown_datatype_and_parameters() {
        let e = err(request(vec![input("X", "FLOAT32", &[1], None)], vec![vec![0; 4]]));
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(e.message.contains("'X'") && e.message.contains("FLOAT32"), "{}", e.message);

        let mut req = request(vec![], vec![]);
        req.parameters
            .insert("priority".into(), InferParameter { parameter_choice: Some(ParameterChoice::Int64Param(-1)) });
        assert!(err(req).message.contains("priority"));
        let mut req = request(vec![], vec![]);
        req.parameters.insert(
            "timeout".into(),
            InferParameter { parameter_choice: Some(ParameterChoice::StringParam("1".into())) },
        );
        assert!(err(req).message.contains("timeout"));

        let classify = |choice: ParameterChoice| {
            let mut req = request(vec![], vec![]);
            let mut params = HashMap::new();
            params.insert("classification".to_string(), InferParameter { parameter_choice: Some(choice) });
            req.outputs = vec![InferRequestedOutputTensor { name: "OUT".into(), parameters: params }];
            from_proto(req, &SharedMemory::disabled())
        };
        assert_eq!(classify(ParameterChoice::Int64Param(3)).unwrap().outputs[0].classification, 3);
        assert_eq!(classify(ParameterChoice::Uint64Param(2)).unwrap().outputs[0].classification, 2);
        for bad in [ParameterChoice::Int64Param(-1), ParameterChoice::Uint64Param(u64::MAX)] {
            let e = classify(bad).unwrap_err();
            assert!(e.message.contains("output 'OUT': classification must be a class count"), "{}", e.message);
        }
        let e = classify(ParameterChoice::StringParam("3".into())).unwrap_err();
        assert!(e.message.contains("'classification' must be an int64_param"), "{}", e.message);

        let mut inp = input("A", "FP32", &[1], None);
        inp.parameters.insert(
            "shared_memory_region".into(),
            InferParameter { parameter_choice: Some(ParameterChoice::StringParam("r".into())) },
        );
        let e = err(request(vec![inp], vec![]));
        assert!(
            e.message.contains("'A'") && e.message.contains("'shared_memory_byte_size' is required"),
            "{}",
            e.message
        );

        let mut req = request(vec![], vec![]);
        req.model_version = "abc".into();
        assert_eq!(err(req).code, Code::InvalidArgument, "a malformed version is a malformed request");
    }

    #[test]
    fn grpc_timeout_parsing() {
        assert_eq!(parse_grpc_timeout("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_grpc_timeout("2M"), Some(Duration::from_secs(120)));
        assert_eq!(parse_grpc_timeout("3S"), Some(Duration::from_secs(3)));
        assert_eq!(parse_grpc_timeout("100m"), Some(Duration::from_millis(100)));
        assert_eq!(parse_grpc_timeout("250u"), Some(Duration::from_micros(250)));
        assert_eq!(parse_grpc_timeout("99999999n"), Some(Duration::from_nanos(99_999_999)));
        assert_eq!(parse_grpc_timeout("99999999H"), Some(Duration::from_secs(99_999_999 * 3600)));
        assert_eq!(parse_grpc_timeout("0m"), Some(Duration::ZERO));
        for bad in ["", "m", "10", "10x", "123456789m", "-1S", "1.5S", "+1S", " 1S", "1é"] {
            assert_eq!(parse_grpc_timeout(bad), None, "{bad:?}");
        }

        let now = Instant::now();
        let mut md = tonic::metadata::MetadataMap::new();
        assert_eq!(grpc_deadline(&md, now), None);
        md.insert("grpc-timeout", "500m".parse().unwrap());
        assert_eq!(grpc_deadline(&md, now), Some(now + Duration::from_millis(495)));
        md.insert("grpc-timeout", "8000u".parse().unwrap());
        assert_eq!(grpc_deadline(&md, now), Some(now + Duration::from_millis(7)));
        md.insert("grpc-timeout", "0n".parse().unwrap());
        assert_eq!(grpc_deadline(&md, now), Some(now));
        md.insert("grpc-timeout", "junk".parse().unwrap());
        assert_eq!(grpc_deadline(&md, now), None);
    }

    #[test]
    fn response_conversion() {
        let y: Vec<u8> = [1.0f32, 2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        let y_data = Bytes::from(y.clone());
        let ptr = y_data.as_ptr();
        let resp = InferResponse {
            model_name: "m".into(),
            model_version: 7,
            id: "abc".into(),
            shm_written: Vec::new(),
            outputs: vec![
                OutputTensor { name: "Y".into(), datatype: DataType::Fp32, shape: vec![1, 2], data: y_data },
                OutputTensor {
                    name: "S".into(),
                    datatype: DataType::Bytes,
                    shape: vec![1],
                    data: Bytes::from_static(b"\x01\x00\x00\x00z"),
                },
            ],
        };
        let p = infer_response_to_proto(resp);
        assert_eq!(p.model_name, "m");
        assert_eq!(p.model_version, "7");
        assert_eq!(p.id, "abc");
        assert_eq!(p.outputs.len(), 2);
        assert_eq!(p.outputs[0].name, "Y");
        assert_eq!(p.outputs[0].datatype, "FP32");
        assert_eq!(p.outputs[0].shape, vec![1, 2]);
        assert!(p.outputs[0].contents.is_none());
        assert_eq!(p.outputs[1].datatype, "BYTES");
        assert_eq!(p.raw_output_contents.len(), 2);
        assert_eq!(&p.raw_output_contents[0][..], &y[..]);
        assert_eq!(p.raw_output_contents[0].as_ptr(), ptr, "the output buffer is moved, not copied");
        assert_eq!(&p.raw_output_contents[1][..], b"\x01\x00\x00\x00z");
    }

    #[test]
    fn statistics_conversion() {
        let d = |count, ns| server::Duration { count, ns };
        let s = ModelStats {
            name: "m".into(),
            version: "1".into(),
            last_inference_ms: 1234,
            inference_count: 10,
            execution_count: 4,
            success: d(10, 1000),
            fail: d(1, 5),
            queue: d(10, 200),
            compute_input: d(4, 30),
            compute_infer: d(4, 600),
            compute_output: d(4, 40),
            cache_hit: d(2, 70),
            cache_miss: d(3, 90),
            batch_stats: vec![server::BatchStats {
                batch_size: 2,
                compute_input: d(3, 9),
                compute_infer: d(3, 300),
                compute_output: d(3, 12),
            }],
        };
        let p = model_stats_to_proto(s);
        assert_eq!((p.name.as_str(), p.version.as_str()), ("m", "1"));
        assert_eq!(p.last_inference, 1234);
        assert_eq!(p.inference_count, 10);
        assert_eq!(p.execution_count, 4);
        let i = p.inference_stats.unwrap();
        let sd = |count, ns| Some(StatisticDuration { count, ns });
        assert_eq!(i.success, sd(10, 1000));
        assert_eq!(i.fail, sd(1, 5));
        assert_eq!(i.queue, sd(10, 200));
        assert_eq!(i.compute_input, sd(4, 30));
        assert_eq!(i.compute_infer, sd(4, 600));
        assert_eq!(i.compute_output, sd(4, 40));
        assert_eq!(i.cache_hit, sd(2, 70));
        assert_eq!(i.cache_miss, sd(3, 90));
        assert_eq!(p.batch_stats.len(), 1);
        assert_eq!(p.batch_stats[0].batch_size, 2);
        assert_eq!(p.batch_stats[0].compute_input, sd(3, 9));
        assert_eq!(p.batch_stats[0].compute_infer, sd(3, 300));
        assert_eq!(p.batch_stats[0].compute_output, sd(3, 12));
    }

    #[test]
    fn metadata_index_and_load_parameters() {
        let m = model_metadata_to_proto(ModelMetadata {
            name: "m".into(),
            versions: vec!["1".into(), "2".into()],
            platform: "onnxruntime_onnx".into(),
            inputs: vec![TensorMetadata { name: "X".into(), datatype: "FP32".into(), shape: vec![-1, 4] }],
            outputs: vec![TensorMetadata { name: "Y".into(), datatype: "INT64".into(), shape: vec![-1] }],
        });
        assert_eq!(m.versions, vec!["1", "2"]);
        assert_eq!(m.platform, "onnxruntime_onnx");
        assert_eq!(m.inputs[0].shape, vec![-1, 4]);
        assert_eq!(m.outputs[0].datatype, "INT64");

        let i = index_entry_to_proto(IndexEntry {
            name: "m".into(),
            version: "1".into(),
            state: "READY".into(),
            reason: String::new(),
        });
        assert_eq!((i.name.as_str(), i.version.as_str(), i.state.as_str()), ("m", "1", "READY"));

        let p = |c| ModelRepositoryParameter { parameter_choice: Some(c) };
        let mut params = HashMap::new();
        assert_eq!(load_config_parameter(&params).unwrap(), None);
        params.insert("config".to_string(), p(RepoParameterChoice::StringParam("{\"max_batch_size\":4}".into())));
        assert_eq!(load_config_parameter(&params).unwrap().as_deref(), Some("{\"max_batch_size\":4}"));
        params.insert("file:1/model.onnx".to_string(), p(RepoParameterChoice::BytesParam(vec![1])));
        let e = load_config_parameter(&params).unwrap_err();
        assert_eq!(e.code, Code::Unimplemented);
        assert!(e.message.contains("file:1/model.onnx") && e.message.contains("not supported"));
        // Any other key is refused, as Triton refuses it (before the files are looked at).
        params.insert("other".to_string(), p(RepoParameterChoice::BoolParam(true)));
        params.insert("zzz".to_string(), p(RepoParameterChoice::BoolParam(true)));
        let e = load_config_parameter(&params).unwrap_err();
        assert_eq!((e.code, e.message.as_str()), (Code::InvalidArgument, "unrecognized load parameter 'other'."));
        let mut params = HashMap::new();
        params.insert("config".to_string(), p(RepoParameterChoice::Int64Param(1)));
        assert!(load_config_parameter(&params).unwrap_err().message.contains("config"));
    }
}
