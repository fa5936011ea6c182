//! `POST .../infer` on the wire: the KServe v2 JSON request (with Triton's binary tensor
//! extension) parsed into an [`InferRequest`], and an [`InferResponse`] rendered back.
//!
//! Both directions are pure functions of bytes, so they are tested without a repository.
//!
//! Parsing streams the JSON once: tensor `data` arrays are written straight into the
//! little-endian buffer of the declared datatype (no `serde_json::Value` per element). When a
//! client puts `data` before `datatype` in an input object, the elements are kept in a compact
//! tagged form and converted once the datatype is known. Every size a client claims is checked
//! with checked arithmetic against the request limit before anything of that size is allocated.
//!
//! Non-finite floats travel as the bare tokens `NaN`, `Infinity` and `-Infinity` in both
//! directions, as in tritonserver (rapidjson) and Python's json module.

use std::cell::Cell;
use std::fmt;

use bytes::Bytes;
use nereid_common::dtype::{byte_size, element_count};
use nereid_common::{DataType, Status};
use serde::Deserialize;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::ser::{self, Serialize, SerializeMap, SerializeSeq, Serializer};
use serde_json::{Map, Value};

use nereid_proto::codec::too_many_tensors;
use nereid_proto::inference::ModelConfig;

use crate::shm::{self, SharedMemory, ShmRef, ShmWritten};
use crate::tensor::{
    InferRequest, InferResponse, InputTensor, MAX_PARAMETERS, MAX_RANK, MAX_REQUEST_TENSORS, OutputTensor,
    RequestedOutput, split_bytes_elements,
};

/// The binary tensor extension's header: length of the JSON part at the start of the body.
pub const HEADER_CONTENT_LENGTH: &str = "inference-header-content-length";

/// How the outputs of one request are to be rendered: in the JSON `data` field or in the
/// binary section.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OutputFormat {
    /// The request's `parameters.binary_data_output`: the choice for the outputs the request
    /// does not list (every output when it lists none).
    pub binary_default: bool,
    /// The outputs the request lists, binary where their `parameters.binary_data` is true.
    pub explicit: Vec<(String, bool)>,
    /// Outputs written into shared memory: rendered with their region and size, no data.
    pub shm: Vec<ShmWritten>,
}

impl OutputFormat {
    pub fn is_binary(&self, output: &str) -> bool {
        if self.shm_output(output).is_some() {
            return false;
        }
        self.explicit.iter().find(|(name, _)| name == output).map_or(self.binary_default, |(_, binary)| *binary)
    }

    fn shm_output(&self, output: &str) -> Option<&ShmWritten> {
        self.shm.iter().find(|w| w.name == output)
    }
}

/// A parsed `POST .../infer` body.
#[derive(Debug)]
pub struct ParsedInfer {
    pub request: InferRequest,
    pub format: OutputFormat,
}

/// Parses an infer request body.
///
/// `header_length` is the value of `Inference-Header-Content-Length` (binary tensor
/// extension): the first `header_length` bytes are the JSON, the rest is the binary section,
/// sliced (zero-copy) into the inputs that carry `parameters.binary_data_size`, in order.
/// `max_bytes` bounds every tensor's byte size (checked before its buffer is allocated).
pub fn parse_infer_request(
    model_name: &str,
    model_version: Option<i64>,
    body: Bytes,
    header_length: Option<usize>,
    max_bytes: usize,
    shm: Option<&SharedMemory>,
) -> Result<ParsedInfer, Status> {
    let (json, binary) = match header_length {
        Some(n) if n > body.len() => {
            return Err(Status::invalid(format!(
                "Inference-Header-Content-Length is {n} but the request body has only {} bytes",
                body.len()
            )));
        }
        Some(n) => (body.slice(..n), body.slice(n..)),
        None => (body, Bytes::new()),
    };

    let raw = parse_json(&json, max_bytes)?;
    drop(json);

    let mut request = InferRequest {
        model_name: model_name.to_string(),
        model_version,
        id: raw.id.unwrap_or_default(),
        ..InferRequest::default()
    };
    let mut format = OutputFormat::default();

    for (key, value) in raw.parameters.iter().flatten() {
        match key.as_str() {
            "priority" => {
                request.priority = value.as_u64().ok_or_else(|| {
                    Status::invalid(format!("parameters.priority must be a non-negative integer, got {value}"))
                })?;
            }
            "timeout" => {
                request.timeout_us = value.as_u64().ok_or_else(|| {
                    Status::invalid(format!(
                        "parameters.timeout must be a non-negative integer (microseconds), got {value}"
                    ))
                })?;
            }
            "binary_data_output" => {
                format.binary_default = value.as_bool().ok_or_else(|| {
                    Status::invalid(format!("parameters.binary_data_output must be a boolean, got {value}"))
                })?;
            }
            // Anything else (sequence_id, custom parameters, ...) is accepted and ignored.
            _ => {}
        }
    }

    let inputs = raw.inputs.ok_or_else(|| Status::invalid("inference request has no 'inputs'"))?;
    let mut binary_offset = 0usize;
    let mut shm_budget = shm.map_or(0, SharedMemory::request_budget);
    // The tensors sent in the body (JSON or binary), all together, stay within the limit, as
    // in a gRPC request (one message): the same request is accepted over either protocol,
    // and through a gateway that forwards it as one message.
    let mut in_body = 0usize;
    request.inputs.reserve_exact(inputs.len());
    for (i, input) in inputs.into_iter().enumerate() {
        let source = Sections { binary: &binary, binary_offset: &mut binary_offset, shm, shm_budget: &mut shm_budget };
        let (tensor, from_body) = finish_input(i, input, source, max_bytes)?;
        if from_body {
            in_body = in_body.saturating_add(tensor.data.len());
            if in_body > max_bytes {
                return Err(Status::invalid(format!(
                    "inputs[{i}] ('{}'): the inputs up to this one take {in_body} bytes, more than the request limit of {max_bytes} bytes",
                    tensor.name
                )));
            }
        }
        request.inputs.push(tensor);
    }
    if binary_offset != binary.len() {
        return Err(Status::invalid(format!(
            "the binary section has {} bytes but the inputs' binary_data_size add up to {binary_offset}",
            binary.len()
        )));
    }

    for (j, output) in raw.outputs.into_iter().flatten().enumerate() {
        let ctx = || format!("outputs[{j}] ('{}')", output.name);
        let shm_region = shm_parameters(&ctx, output.parameters.as_ref())?;
        let mut binary_data = None;
        let mut classification = 0;
        for (key, value) in output.parameters.iter().flatten() {
            match key.as_str() {
                "binary_data" => {
                    let b = value.as_bool().ok_or_else(|| {
                        Status::invalid(format!("{}: binary_data must be a boolean, got {value}", ctx()))
                    })?;
                    binary_data = Some(b);
                }
                // A class count of 0 (or null) means "not requested".
                "classification" if !value.is_null() => {
                    classification = value.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| {
                        Status::invalid(format!(
                            "{}: classification must be a class count from 0 to {}, got {value}",
                            ctx(),
                            u32::MAX
                        ))
                    })?;
                }
                _ => {}
            }
        }
        if let Some(r) = shm_region {
            // Regions cannot be named here (the gateway), or none are allowed: that first.
            let shm = shm.ok_or_else(|| shm_unsupported(&ctx()))?;
            if let Some(refused) = shm.refusal(&ctx(), &r.region) {
                return Err(refused);
            }
            // Triton's refusals: an output in shared memory is neither rendered nor reshaped.
            if classification > 0 {
                return Err(Status::invalid(format!(
                    "{}: output can't set both 'shared_memory_region' and 'classification'",
                    ctx()
                )));
            }
            if binary_data == Some(true) {
                return Err(Status::invalid(format!(
                    "{}: output can't set both 'shared_memory_region' and 'binary_data'",
                    ctx()
                )));
            }
            request.shm_outputs.push((output.name.clone(), shm.target(&ctx(), &r)?));
        }
        // A listed output without `binary_data` comes back in JSON, as in Triton: the request's
        // `binary_data_output` is the choice for the outputs it does not list.
        format.explicit.push((output.name.clone(), binary_data.unwrap_or(false)));
        request.outputs.push(RequestedOutput { name: output.name, binary_data, classification });
    }

    Ok(ParsedInfer { request, format })
}

/// Triton's raw binary request (`Inference-Header-Content-Length: 0`, no JSON at all): the
/// whole body is the data of the model's only input, as one request — of batch 1 for a model
/// that batches — shaped by the model's config: a dim the config leaves free (-1) takes what
/// the byte count gives (at most one may be free); a BYTES input is one element, the body.
/// Every output comes back, in the binary section.
pub fn parse_raw_binary_request(
    model_name: &str,
    model_version: Option<i64>,
    body: Bytes,
    config: &ModelConfig,
) -> Result<ParsedInfer, Status> {
    let refuse =
        |why: String| Status::invalid(format!("raw binary request (Inference-Header-Content-Length: 0): {why}"));
    let [input] = &config.input[..] else {
        return Err(refuse(format!(
            "model '{model_name}' has {} inputs; a raw request carries the data of a model with exactly one",
            config.input.len()
        )));
    };
    let datatype = DataType::from_config_value(input.data_type)
        .ok_or_else(|| refuse(format!("input '{}' has no datatype a request can carry", input.name)))?;
    let batch = (config.max_batch_size > 0).then_some(1i64);
    let mut dims: Vec<i64> = batch.into_iter().chain(input.dims.iter().copied()).collect();
    let free = dims.iter().filter(|&&d| d < 0).count();
    let data = if datatype == DataType::Bytes {
        // One element: the body, with the 4-byte length every BYTES element carries.
        dims.iter_mut().filter(|d| **d < 0).for_each(|d| *d = 1);
        if dims.iter().product::<i64>() != 1 {
            return Err(refuse(format!(
                "input '{}' holds {dims:?} BYTES elements; a raw request carries one",
                input.name
            )));
        }
        let length =
            u32::try_from(body.len()).map_err(|_| refuse("the body is too large for one BYTES element".into()))?;
        let mut data = Vec::with_capacity(4 + body.len());
        data.extend_from_slice(&length.to_le_bytes());
        data.extend_from_slice(&body);
        Bytes::from(data)
    } else {
        let size = datatype.element_size().unwrap_or(1) as i64;
        let elements = body.len() as i64 / size;
        if body.len() as i64 % size != 0 {
            return Err(refuse(format!(
                "{} bytes are not a whole number of {} elements",
                body.len(),
                datatype.wire_name()
            )));
        }
        let fixed: i64 = dims.iter().filter(|&&d| d >= 0).product();
        match free {
            0 => {}
            1 if fixed > 0 && elements % fixed == 0 => {
                dims.iter_mut().filter(|d| **d < 0).for_each(|d| *d = elements / fixed);
            }
            1 => {
                return Err(refuse(format!(
                    "{elements} {} elements do not fill input '{}' of dims {:?}",
                    datatype.wire_name(),
                    input.name,
                    input.dims
                )));
            }
            _ => {
                return Err(refuse(format!(
                    "input '{}' has {free} variable dims {:?}; a raw request's shape can fill in one",
                    input.name, input.dims
                )));
            }
        }
        body
    };
    let request = InferRequest {
        model_name: model_name.to_string(),
        model_version,
        inputs: vec![InputTensor { name: input.name.clone(), datatype, shape: dims, data }],
        ..InferRequest::default()
    };
    Ok(ParsedInfer { request, format: OutputFormat { binary_default: true, ..OutputFormat::default() } })
}

fn parse_json(json: &[u8], max_bytes: usize) -> Result<RawRequest, Status> {
    let malformed = |e: serde_json::Error| Status::invalid(format!("malformed inference request JSON: {e}"));
    match parse_json_with(json, max_bytes, false) {
        Ok(raw) => Ok(raw),
        // Not standard JSON, but what tritonserver (rapidjson's kParseNanAndInfFlag) and
        // Python's json module accept: bare NaN / Infinity / -Infinity. Only looked for once
        // the strict parse failed, so well-formed requests pay nothing for it.
        Err(e) => match rewrite_non_finite(json) {
            None => Err(malformed(e)),
            Some(rewritten) => {
                let mut raw = parse_json_with(&rewritten, max_bytes, true).map_err(malformed)?;
                raw.settle_markers()?;
                Ok(raw)
            }
        },
    }
}

/// `non_finite`: `json` went through [`rewrite_non_finite`], so its marker strings in `data`
/// arrays stand for non-finite numbers.
fn parse_json_with(json: &[u8], max_bytes: usize, non_finite: bool) -> Result<RawRequest, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(json);
    // What the inputs' buffers may reserve in advance, all together: a claimed shape is only a
    // claim until its elements arrive.
    let budget = Budget { reserve: Cell::new(max_bytes), spent: Cell::new(0) };
    let raw = RequestSeed { max_bytes, non_finite, budget: &budget }.deserialize(&mut de)?;
    de.end()?;
    Ok(raw)
}

/// Strings that stand for the bare tokens `NaN`, `Infinity` and `-Infinity` once
/// [`rewrite_non_finite`] has turned them into strings: Unicode noncharacters (U+FDD0..2),
/// which are reserved for a program's internal use and never occur in real tensor data.
const MARK_NAN: &str = "\u{FDD0}";
const MARK_INF: &str = "\u{FDD1}";
const MARK_NEG_INF: &str = "\u{FDD2}";

/// The number a [`MARK_NAN`]-style marker string stands for.
fn non_finite_marker(s: &str) -> Option<f64> {
    match s {
        MARK_NAN => Some(f64::NAN),
        MARK_INF => Some(f64::INFINITY),
        MARK_NEG_INF => Some(f64::NEG_INFINITY),
        _ => None,
    }
}

/// `json` with each bare `NaN`, `Infinity` and `-Infinity` token (outside strings) replaced by
/// its marker string (quoted), so serde_json reads it; `None` when there is no such token.
fn rewrite_non_finite(json: &[u8]) -> Option<Vec<u8>> {
    let mut out: Option<Vec<u8>> = None;
    let mut copied = 0;
    let mut i = 0;
    let mut in_string = false;
    while i < json.len() {
        let b = json[i];
        if in_string {
            match b {
                // An escape: the next byte (`"`, `\\`, `u`, ...) is never the string's end.
                b'\\' => i += 2,
                b'"' => {
                    in_string = false;
                    i += 1;
                }
                _ => i += 1,
            }
            continue;
        }
        let (len, marker) = match b {
            b'"' => {
                in_string = true;
                i += 1;
                continue;
            }
            b'N' if json[i..].starts_with(b"NaN") => (3, MARK_NAN),
            b'I' if json[i..].starts_with(b"Infinity") => (8, MARK_INF),
            b'-' if json[i..].starts_with(b"-Infinity") => (9, MARK_NEG_INF),
            _ => {
                i += 1;
                continue;
            }
        };
        // A marker takes 5 bytes: at most 2 more than the token it replaces.
        let o = out.get_or_insert_with(|| Vec::with_capacity(json.len() + json.len() / 2 + 8));
        o.extend_from_slice(&json[copied..i]);
        o.push(b'"');
        o.extend_from_slice(marker.as_bytes());
        o.push(b'"');
        i += len;
        copied = i;
    }
    let mut out = out?;
    out.extend_from_slice(&json[copied..]);
    Some(out)
}

/// Validates one input and attaches its data (from JSON or the binary section).
/// Where an HTTP request's input bytes can come from besides its JSON: the binary section
/// (consumed in order) and registered shared-memory regions (within the request's budget).
struct Sections<'a> {
    binary: &'a Bytes,
    binary_offset: &'a mut usize,
    shm: Option<&'a SharedMemory>,
    shm_budget: &'a mut u64,
}

/// One input tensor, and whether its data came in the body (not from shared memory).
fn finish_input(
    i: usize,
    input: RawInput,
    sections: Sections<'_>,
    max_bytes: usize,
) -> Result<(InputTensor, bool), Status> {
    let Sections { binary, binary_offset, shm, shm_budget } = sections;
    let name = input.name.ok_or_else(|| Status::invalid(format!("inputs[{i}]: missing 'name'")))?;
    let ctx = format!("inputs[{i}] ('{name}')");
    let err = |m: String| Status::invalid(format!("{ctx}: {m}"));

    let datatype = input.datatype.ok_or_else(|| err("missing 'datatype'".into()))?;
    let dtype = DataType::from_wire_name(&datatype).ok_or_else(|| err(format!("unknown datatype '{datatype}'")))?;
    let shape = match input.shape {
        None => return Err(err("missing 'shape'".into())),
        Some(Err(m)) => return Err(err(m)),
        Some(Ok(shape)) => shape,
    };
    let shm_region = shm_parameters(&|| ctx.clone(), input.parameters.as_ref())?;
    // Where no regions can be named (the gateway), or none are allowed, that is the error,
    // whatever the shape.
    if let Some(r) = &shm_region {
        let shm = shm.ok_or_else(|| shm_unsupported(&ctx))?;
        if let Some(refused) = shm.refusal(&ctx, &r.region) {
            return Err(refused);
        }
    }
    // A tensor in shared memory is not in the body: what bounds it is the shared-memory
    // budget of a request (what the worker copies), not the body limit
    // (--http-max-input-size), which may be smaller.
    let limit = match (&shm_region, shm) {
        (Some(_), Some(shm)) if shm.enabled() => usize::try_from(shm.request_budget()).unwrap_or(usize::MAX),
        _ => max_bytes,
    };
    let count = check_shape(dtype, &shape, limit).map_err(err)?;

    let binary_size = match input.parameters.as_ref().and_then(|p| p.get("binary_data_size")) {
        None => None,
        Some(value) => Some(
            value
                .as_u64()
                .ok_or_else(|| err(format!("binary_data_size must be a non-negative integer, got {value}")))?,
        ),
    };

    if let Some(r) = shm_region {
        let shm = shm.ok_or_else(|| shm_unsupported(&ctx))?;
        if input.data.is_some() || binary_size.is_some() {
            return Err(err(
                "has shared memory parameters and also 'data' or binary_data_size; send one of them".into()
            ));
        }
        if let Some(expected) = byte_size(dtype, &shape)
            && r.byte_size != expected
        {
            return Err(err(format!(
                "{} is {} but shape {} of {dtype} needs {expected} bytes",
                shm::BYTE_SIZE,
                r.byte_size,
                fmt_shape(&shape)
            )));
        }
        let data = shm.read(&ctx, &r, shm_budget)?;
        if dtype == DataType::Bytes {
            let n = count_bytes_elements(&data).map_err(err)?;
            if n != count {
                return Err(err(format!(
                    "expected {count} BYTES elements for shape {}, its shared memory holds {n}",
                    fmt_shape(&shape)
                )));
            }
        }
        return Ok((InputTensor { name, datatype: dtype, shape, data }, false));
    }

    let data = match (binary_size, input.data) {
        (Some(_), Some(_)) => {
            return Err(err("has both 'data' and parameters.binary_data_size".into()));
        }
        (None, None) => {
            return Err(err("has neither 'data' nor parameters.binary_data_size".into()));
        }
        (Some(size), None) => {
            if let Some(expected) = byte_size(dtype, &shape)
                && size != expected
            {
                return Err(err(format!(
                    "binary_data_size is {size} but shape {} of {dtype} needs {expected} bytes",
                    fmt_shape(&shape)
                )));
            }
            let available = binary.len() - *binary_offset;
            if size > available as u64 {
                return Err(err(format!(
                    "binary_data_size is {size} but only {available} bytes of the binary section remain"
                )));
            }
            let start = *binary_offset;
            let end = start + size as usize;
            *binary_offset = end;
            let data = binary.slice(start..end);
            if dtype == DataType::Bytes {
                let n = count_bytes_elements(&data).map_err(err)?;
                if n != count {
                    return Err(err(format!(
                        "expected {count} BYTES elements for shape {}, the binary data holds {n}",
                        fmt_shape(&shape)
                    )));
                }
            }
            data
        }
        (None, Some(RawData::Skipped)) => {
            // Only skipped when the datatype or shape is invalid, which was reported above.
            return Err(err("'data' could not be read for this datatype and shape".into()));
        }
        (None, Some(RawData::Buf(mut buf))) => {
            if let Mode::Deferred = buf.mode {
                buf = buf.replay(dtype, max_bytes);
            }
            if let Some(m) = buf.error {
                return Err(err(m));
            }
            if buf.count != count {
                return Err(err(format!(
                    "expected {count} elements for shape {}, got {}",
                    fmt_shape(&shape),
                    buf.count
                )));
            }
            Bytes::from(buf.out)
        }
    };

    Ok((InputTensor { name, datatype: dtype, shape, data }, true))
}

/// A tensor's shared-memory parameters (`None` when it has none): the region a string, offset
/// and byte size integers.
fn shm_parameters(ctx: &dyn Fn() -> String, parameters: Option<&Map<String, Value>>) -> Result<Option<ShmRef>, Status> {
    let Some(p) = parameters.filter(|p| p.keys().any(|k| k.starts_with("shared_memory_"))) else {
        return Ok(None);
    };
    let region = match p.get(shm::REGION) {
        None => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(v) => {
            return Err(Status::invalid(format!("{}: parameter '{}' must be a string, got {v}", ctx(), shm::REGION)));
        }
    };
    let int = |key: &str| match p.get(key) {
        None => Ok(None),
        Some(v) if v.is_u64() => Ok(Some(v.as_i64().unwrap_or(i64::MAX))),
        Some(v) => v
            .as_i64()
            .map(Some)
            .ok_or_else(|| Status::invalid(format!("{}: parameter '{key}' must be an integer, got {v}", ctx()))),
    };
    ShmRef::from_parameters(&ctx(), region, int(shm::OFFSET)?, int(shm::BYTE_SIZE)?)
}

/// The error for shared-memory parameters where there are no regions to name (the gateway).
fn shm_unsupported(ctx: &str) -> Status {
    Status::invalid(format!(
        "{ctx}: system shared memory is not supported here; register regions with a worker and send the request to it"
    ))
}

/// Checks a claimed shape before anything of its size is allocated; returns its element count.
fn check_shape(dtype: DataType, shape: &[i64], max_bytes: usize) -> Result<u64, String> {
    if shape.iter().any(|d| *d < 0) {
        return Err(format!("shape {} has a negative dimension", fmt_shape(shape)));
    }
    let count =
        element_count(shape).ok_or_else(|| format!("shape {} overflows the element count", fmt_shape(shape)))?;
    match dtype.element_size() {
        Some(_) => {
            let bytes = byte_size(dtype, shape)
                .ok_or_else(|| format!("shape {} of {dtype} overflows the byte size", fmt_shape(shape)))?;
            if bytes > max_bytes as u64 {
                return Err(format!(
                    "shape {} of {dtype} needs {bytes} bytes, more than the request limit of {max_bytes} bytes",
                    fmt_shape(shape)
                ));
            }
        }
        None => {
            // Each BYTES element takes at least its 4-byte length prefix.
            let least = count.saturating_mul(4);
            if least > max_bytes as u64 {
                return Err(format!(
                    "shape {} of BYTES needs at least {least} bytes, more than the request limit of {max_bytes} bytes",
                    fmt_shape(shape)
                ));
            }
        }
    }
    Ok(count)
}

fn count_bytes_elements(mut data: &[u8]) -> Result<u64, String> {
    let mut n = 0u64;
    while !data.is_empty() {
        if data.len() < 4 {
            return Err(format!("BYTES element {n} has a truncated 4-byte length prefix"));
        }
        let len = u32::from_le_bytes([data[0], data[1], data[2], data[3]]) as usize;
        data = &data[4..];
        if data.len() < len {
            return Err(format!("BYTES element {n} claims {len} bytes but only {} remain", data.len()));
        }
        data = &data[len..];
        n += 1;
    }
    Ok(n)
}

/// `[1,16]`, as error messages show shapes.
pub fn fmt_shape(shape: &[i64]) -> String {
    let mut s = String::with_capacity(2 + shape.len() * 4);
    s.push('[');
    for (i, d) in shape.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&d.to_string());
    }
    s.push(']');
    s
}

// ---------------------------------------------------------------------------------------------
// Streaming deserialization of the request JSON.
// ---------------------------------------------------------------------------------------------

#[derive(Default)]
struct RawRequest {
    id: Option<String>,
    parameters: Option<Map<String, Value>>,
    inputs: Option<Vec<RawInput>>,
    outputs: Option<Vec<RawOutput>>,
}

impl RawRequest {
    /// Where a bare `NaN` / `Infinity` stood outside a tensor's `data`, it was read as a marker
    /// string, which must not pass for text: as a parameter's value it is a number JSON cannot
    /// hold (null here: no parameter Nereid reads takes a non-finite value; tritonserver keeps
    /// it as a double); as an id, a name, a datatype or a key, the request is malformed.
    fn settle_markers(&mut self) -> Result<(), Status> {
        let marker = |s: &str| non_finite_marker(s).is_some();
        let settle = |p: &mut Option<Map<String, Value>>| -> bool {
            let Some(map) = p else { return true };
            if map.keys().any(|k| marker(k)) {
                return false;
            }
            for value in map.values_mut() {
                if value.as_str().is_some_and(marker) {
                    *value = Value::Null;
                }
            }
            true
        };
        let mut fine = !self.id.as_deref().is_some_and(marker) && settle(&mut self.parameters);
        for i in self.inputs.iter_mut().flatten() {
            fine &= !i.name.as_deref().is_some_and(marker)
                && !i.datatype.as_deref().is_some_and(marker)
                && settle(&mut i.parameters);
        }
        for o in self.outputs.iter_mut().flatten() {
            fine &= !marker(&o.name) && settle(&mut o.parameters);
        }
        if fine {
            Ok(())
        } else {
            Err(Status::invalid(
                "malformed inference request JSON: NaN and Infinity are numbers, not names, ids or keys",
            ))
        }
    }
}

#[derive(Default)]
struct RawInput {
    name: Option<String>,
    /// Err: a message about a malformed shape (reported once the input's name is known).
    shape: Option<Result<Vec<i64>, String>>,
    datatype: Option<String>,
    parameters: Option<Map<String, Value>>,
    data: Option<RawData>,
}

enum RawData {
    /// Not read because the datatype or shape (seen before it) is invalid.
    Skipped,
    Buf(DataBuf),
}

#[derive(Deserialize)]
struct RawOutput {
    name: String,
    #[serde(default, deserialize_with = "optional_parameters")]
    parameters: Option<Map<String, Value>>,
}

#[derive(Deserialize)]
#[serde(field_identifier, rename_all = "snake_case")]
enum RequestField {
    Id,
    Parameters,
    Inputs,
    Outputs,
    #[serde(other)]
    Other,
}

#[derive(Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(field_identifier, rename_all = "snake_case")]
enum InputField {
    Name,
    Shape,
    Datatype,
    Parameters,
    Data,
    #[serde(other)]
    Other,
}

struct RequestSeed<'r> {
    max_bytes: usize,
    non_finite: bool,
    budget: &'r Budget,
}

impl<'de> DeserializeSeed<'de> for RequestSeed<'_> {
    type Value = RawRequest;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<RawRequest, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for RequestSeed<'_> {
    type Value = RawRequest;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an inference request object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawRequest, A::Error> {
        let mut r = RawRequest::default();
        while let Some(key) = map.next_key::<RequestField>()? {
            match key {
                RequestField::Id => r.id = Some(map.next_value()?),
                RequestField::Parameters => r.parameters = map.next_value::<Option<Parameters>>()?.map(|p| p.0),
                RequestField::Inputs => {
                    r.inputs = Some(map.next_value_seed(InputsSeed {
                        max_bytes: self.max_bytes,
                        non_finite: self.non_finite,
                        budget: self.budget,
                    })?)
                }
                RequestField::Outputs => r.outputs = map.next_value::<Option<Outputs>>()?.map(|o| o.0),
                RequestField::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(r)
    }
}

struct InputsSeed<'r> {
    max_bytes: usize,
    non_finite: bool,
    budget: &'r Budget,
}

impl<'de> DeserializeSeed<'de> for InputsSeed<'_> {
    type Value = Vec<RawInput>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Vec<RawInput>, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for InputsSeed<'_> {
    type Value = Vec<RawInput>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of input tensors")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<RawInput>, A::Error> {
        let mut inputs = Vec::with_capacity(seq.size_hint().unwrap_or(1).min(64));
        while let Some(input) = seq.next_element_seed(InputSeed {
            max_bytes: self.max_bytes,
            non_finite: self.non_finite,
            budget: self.budget,
        })? {
            if inputs.len() == MAX_REQUEST_TENSORS {
                return Err(de::Error::custom(too_many_tensors("inputs")));
            }
            inputs.push(input);
        }
        Ok(inputs)
    }
}

struct InputSeed<'r> {
    max_bytes: usize,
    non_finite: bool,
    budget: &'r Budget,
}

impl<'de> DeserializeSeed<'de> for InputSeed<'_> {
    type Value = RawInput;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<RawInput, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for InputSeed<'_> {
    type Value = RawInput;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an input tensor object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<RawInput, A::Error> {
        let mut input = RawInput::default();
        let mut seen: Vec<InputField> = Vec::with_capacity(5);
        while let Some(key) = map.next_key::<InputField>()? {
            // A field given twice is refused: which one counts is a guess (the data may have
            // been read under a datatype a later "datatype" then relabels).
            if key != InputField::Other {
                if seen.contains(&key) {
                    let field = match key {
                        InputField::Name => "name",
                        InputField::Shape => "shape",
                        InputField::Datatype => "datatype",
                        InputField::Parameters => "parameters",
                        InputField::Data | InputField::Other => "data",
                    };
                    return Err(serde::de::Error::custom(format!("an input object gives '{field}' twice")));
                }
                seen.push(key);
            }
            match key {
                InputField::Name => input.name = Some(map.next_value()?),
                InputField::Datatype => input.datatype = Some(map.next_value()?),
                InputField::Parameters => input.parameters = map.next_value::<Option<Parameters>>()?.map(|p| p.0),
                InputField::Shape => input.shape = Some(map.next_value::<Shape>()?.0),
                InputField::Data => {
                    let plan = DataPlan::new(
                        input.datatype.as_deref(),
                        input.shape.as_ref(),
                        self.max_bytes,
                        &self.budget.reserve,
                    );
                    input.data = Some(map.next_value_seed(DataSeed {
                        plan,
                        max_bytes: self.max_bytes,
                        left: self.max_bytes.saturating_sub(self.budget.spent.get()),
                        non_finite: self.non_finite,
                    })?);
                }
                InputField::Other => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        // What the array holds counts against the next ones, in its tensor's layout: an array
        // read before its "datatype" is laid out now that the datatype is known (exactly: the
        // tagged form's size is only a bound).
        if let Some(RawData::Buf(buf)) = &mut input.data {
            if let (Mode::Deferred, Some(dtype)) =
                (buf.mode, input.datatype.as_deref().and_then(DataType::from_wire_name))
            {
                let left = self.max_bytes.saturating_sub(self.budget.spent.get());
                let mut typed =
                    std::mem::replace(buf, DataBuf::typed(dtype, 0, self.max_bytes)).replay(dtype, self.max_bytes);
                if typed.error.is_none() && typed.out.len() > left {
                    typed.error = Some(over_what_is_left(left, self.max_bytes));
                    typed.out = Vec::new();
                }
                *buf = typed;
            }
            self.budget.spent.set(self.budget.spent.get().saturating_add(buf.typed_len()));
        }
        Ok(input)
    }
}

/// A `parameters` object, read as Triton reads one: each value a boolean, a number or a string
/// (or null; an array or an object is refused, naming the key), at most [`MAX_PARAMETERS`] of
/// them. Nothing is built for a value that is refused.
struct Parameters(Map<String, Value>);

impl<'de> Deserialize<'de> for Parameters {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_map(ParametersVisitor)
    }
}

struct ParametersVisitor;

impl<'de> Visitor<'de> for ParametersVisitor {
    type Value = Parameters;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a parameters object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Parameters, A::Error> {
        let mut parameters = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if parameters.len() == MAX_PARAMETERS {
                return Err(de::Error::custom(format!(
                    "a parameters object may have at most {MAX_PARAMETERS} entries"
                )));
            }
            let value = map.next_value_seed(ParameterValue(&key))?;
            parameters.insert(key, value);
        }
        Ok(Parameters(parameters))
    }
}

/// One parameter's value (its key, for the error).
struct ParameterValue<'k>(&'k str);

impl ParameterValue<'_> {
    fn refuse<E: de::Error>(&self, what: &str) -> E {
        E::custom(format!("parameter '{}' is {what}: a parameter must be a boolean, a number or a string", self.0))
    }
}

impl<'de> DeserializeSeed<'de> for ParameterValue<'_> {
    type Value = Value;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ParameterValue<'_> {
    type Value = Value;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a boolean, a number or a string")
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Value, E> {
        // NaN and the infinities (accepted as tokens in tensor data) have no JSON number.
        serde_json::Number::from_f64(v).map(Value::Number).ok_or_else(|| self.refuse("not a finite number"))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E: de::Error>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }
    /// Null, as for an absent parameter where the key gives it that meaning (`classification`).
    fn visit_unit<E: de::Error>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<Value, A::Error> {
        Err(self.refuse("an array"))
    }
    fn visit_map<A: MapAccess<'de>>(self, _: A) -> Result<Value, A::Error> {
        Err(self.refuse("an object"))
    }
}

fn optional_parameters<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Map<String, Value>>, D::Error> {
    Ok(Option::<Parameters>::deserialize(d)?.map(|p| p.0))
}

/// The `outputs` array, at most [`MAX_REQUEST_TENSORS`] long.
struct Outputs(Vec<RawOutput>);

impl<'de> Deserialize<'de> for Outputs {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct OutputsVisitor;
        impl<'de> Visitor<'de> for OutputsVisitor {
            type Value = Outputs;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an array of requested outputs")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Outputs, A::Error> {
                let mut outputs = Vec::new();
                while let Some(output) = seq.next_element::<RawOutput>()? {
                    if outputs.len() == MAX_REQUEST_TENSORS {
                        return Err(de::Error::custom(too_many_tensors("outputs")));
                    }
                    outputs.push(output);
                }
                Ok(Outputs(outputs))
            }
        }
        d.deserialize_seq(OutputsVisitor)
    }
}

/// An input's `shape`: integer dimensions, at most [`MAX_RANK`] of them. Anything else is an
/// `Err` with the reason, reported once the input's name is known; the array is read to its
/// end without being stored.
struct Shape(Result<Vec<i64>, String>);

impl<'de> Deserialize<'de> for Shape {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ShapeVisitor;
        impl<'de> Visitor<'de> for ShapeVisitor {
            type Value = Shape;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an array of integers")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Shape, A::Error> {
                let mut dims = Ok(Vec::new());
                let mut i = 0usize;
                while let Some(dim) = seq.next_element::<Dim>()? {
                    if let Ok(kept) = &mut dims {
                        match dim.0 {
                            _ if i == MAX_RANK => {
                                dims = Err(format!("shape has more than {MAX_RANK} dimensions"));
                            }
                            Some(d) => kept.push(d),
                            None => {
                                dims = Err(format!("shape must be an array of integers (dimension {i} is not one)"))
                            }
                        }
                    }
                    i += 1;
                }
                Ok(Shape(dims))
            }
        }
        d.deserialize_seq(ShapeVisitor)
    }
}

/// One element of a shape array: `None` when it is not an integer (what it was is skipped).
struct Dim(Option<i64>);

impl<'de> Deserialize<'de> for Dim {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct DimVisitor;
        impl<'de> Visitor<'de> for DimVisitor {
            type Value = Dim;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("an integer")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Dim, E> {
                Ok(Dim(Some(v)))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Dim, E> {
                Ok(Dim(i64::try_from(v).ok()))
            }
            fn visit_f64<E: de::Error>(self, _: f64) -> Result<Dim, E> {
                Ok(Dim(None))
            }
            fn visit_bool<E: de::Error>(self, _: bool) -> Result<Dim, E> {
                Ok(Dim(None))
            }
            fn visit_str<E: de::Error>(self, _: &str) -> Result<Dim, E> {
                Ok(Dim(None))
            }
            fn visit_unit<E: de::Error>(self) -> Result<Dim, E> {
                Ok(Dim(None))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Dim, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Dim(None))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Dim, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Dim(None))
            }
        }
        d.deserialize_any(DimVisitor)
    }
}

/// What to do with a `data` array, decided from what the input object said before it.
enum DataPlan {
    /// Write elements straight into `dtype`'s little-endian layout.
    Typed { dtype: DataType, capacity: usize },
    /// The datatype comes later: keep elements in a compact tagged form.
    Deferred,
    /// The datatype or shape seen so far is invalid (reported later): skip without storing.
    Skip,
}

impl DataPlan {
    /// `reserve`: what may still be reserved in advance for this request (taken from it).
    fn new(
        datatype: Option<&str>,
        shape: Option<&Result<Vec<i64>, String>>,
        max_bytes: usize,
        reserve: &Cell<usize>,
    ) -> DataPlan {
        let Some(datatype) = datatype else {
            return DataPlan::Deferred;
        };
        let Some(dtype) = DataType::from_wire_name(datatype) else {
            return DataPlan::Skip;
        };
        let capacity = match shape {
            Some(Ok(shape)) => match check_shape(dtype, shape, max_bytes) {
                // Sizes were checked against max_bytes, so these fit in usize.
                Ok(count) => match byte_size(dtype, shape) {
                    Some(bytes) => bytes as usize,
                    None => (count as usize).saturating_mul(4).min(max_bytes),
                },
                Err(_) => return DataPlan::Skip,
            },
            Some(Err(_)) => return DataPlan::Skip,
            None => 0,
        };
        let capacity = capacity.min(reserve.get());
        reserve.set(reserve.get() - capacity);
        DataPlan::Typed { dtype, capacity }
    }
}

/// What a request's `data` arrays may take, all together, while the JSON is read.
struct Budget {
    /// What the inputs' buffers may still reserve in advance (a claimed shape is only a claim
    /// until its elements arrive).
    reserve: Cell<usize>,
    /// What the arrays read so far hold (typed size).
    spent: Cell<usize>,
}

struct DataSeed {
    plan: DataPlan,
    /// The request limit, and what is left of it after the arrays before this one.
    max_bytes: usize,
    left: usize,
    non_finite: bool,
}

impl<'de> DeserializeSeed<'de> for DataSeed {
    type Value = RawData;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<RawData, D::Error> {
        let mut buf = match self.plan {
            DataPlan::Skip => {
                IgnoredAny::deserialize(d)?;
                return Ok(RawData::Skipped);
            }
            DataPlan::Typed { dtype, capacity } => {
                let mut buf = DataBuf::typed(dtype, capacity.min(self.left), self.max_bytes);
                buf.left = self.left;
                buf
            }
            // The tagged form takes at most twice the typed size (see TAG_FALSE).
            DataPlan::Deferred => DataBuf {
                mode: Mode::Deferred,
                out: Vec::new(),
                count: 0,
                max_bytes: self.max_bytes.saturating_mul(2),
                left: self.left.saturating_mul(2),
                error: None,
            },
        };
        ElementSeed { buf: &mut buf, non_finite: self.non_finite }.deserialize(d)?;
        Ok(RawData::Buf(buf))
    }
}

#[derive(Clone, Copy, Debug)]
enum Scalar<'a> {
    Bool(bool),
    I64(i64),
    U64(u64),
    F64(f64),
    Str(&'a str),
    Null,
}

impl Scalar<'_> {
    fn kind(&self) -> &'static str {
        match self {
            Scalar::Bool(_) => "a boolean",
            Scalar::I64(_) | Scalar::U64(_) => "an integer",
            Scalar::F64(_) => "a number",
            Scalar::Str(_) => "a string",
            Scalar::Null => "null",
        }
    }
}

impl fmt::Display for Scalar<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scalar::Bool(v) => write!(f, "{v}"),
            Scalar::I64(v) => write!(f, "{v}"),
            Scalar::U64(v) => write!(f, "{v}"),
            Scalar::F64(v) if v.is_nan() => f.write_str("NaN"),
            Scalar::F64(v) if v.is_infinite() => f.write_str(if *v > 0.0 { "Infinity" } else { "-Infinity" }),
            Scalar::F64(v) => write!(f, "{v}"),
            Scalar::Str(v) => write!(f, "{v:?}"),
            Scalar::Null => f.write_str("null"),
        }
    }
}

#[derive(Clone, Copy)]
enum Mode {
    Typed(DataType),
    Deferred,
}

/// The error of a `data` array larger than what is `left` of the request limit `max`.
fn over_what_is_left(left: usize, max: usize) -> String {
    if left == max {
        format!("'data' is larger than the request limit of {max} bytes")
    } else {
        format!("'data' is larger than the {left} bytes the inputs before it leave of the request limit of {max} bytes")
    }
}

/// Elements of one `data` array as they are read: the tensor's bytes (or the tagged form).
struct DataBuf {
    mode: Mode,
    out: Vec<u8>,
    count: u64,
    max_bytes: usize,
    /// What is left of `max_bytes` after the arrays read before this one: all of a request's
    /// tensors together stay within the limit.
    left: usize,
    /// The first problem found; later elements are then only skipped.
    error: Option<String>,
}

// The tagged form of an element whose tensor's datatype is not known yet ("data" before
// "datatype" in the JSON): a tag, then the value in the fewest bytes that hold it exactly (the
// replay restores the same scalar). An element then takes at most twice its typed size (a
// small integer 2 bytes where INT8 takes 1; a float exact in f32 — what a client serializing a
// float32 array writes — 5 bytes where FP32 takes 4; 5 + len bytes for a string where BYTES
// takes 4 + len), so the deferred buffer, bounded at twice the request limit, refuses no
// tensor the typed path accepts. Only decimals that are exact in no narrower type ("0.1")
// take 9 bytes: such an FP32/FP16 tensor near the limit needs "datatype" first.
const TAG_FALSE: u8 = 0;
const TAG_TRUE: u8 = 1;
const TAG_I64: u8 = 2;
const TAG_U64: u8 = 3;
const TAG_F64: u8 = 4;
const TAG_STR: u8 = 5;
const TAG_NULL: u8 = 6;
const TAG_I8: u8 = 7;
const TAG_I16: u8 = 8;
const TAG_I32: u8 = 9;
const TAG_U8: u8 = 10;
const TAG_U16: u8 = 11;
const TAG_U32: u8 = 12;
const TAG_F16: u8 = 13;
const TAG_F32: u8 = 14;

impl DataBuf {
    fn typed(dtype: DataType, capacity: usize, max_bytes: usize) -> DataBuf {
        DataBuf {
            mode: Mode::Typed(dtype),
            out: Vec::with_capacity(capacity),
            count: 0,
            max_bytes,
            left: max_bytes,
            error: None,
        }
    }

    #[inline]
    fn push(&mut self, s: Scalar<'_>) {
        if self.error.is_some() {
            return;
        }
        match self.mode {
            Mode::Typed(dtype) => {
                if let Err(m) = encode(dtype, s, &mut self.out) {
                    self.error = Some(format!("data element {}: {m}", self.count));
                    return;
                }
            }
            Mode::Deferred => encode_tagged(s, &mut self.out),
        }
        self.count += 1;
        if self.out.len() > self.left {
            // The tagged form is bounded at twice the limits (see TAG_FALSE): said in the
            // tensor's own terms.
            let (left, max) = match self.mode {
                Mode::Typed(_) => (self.left, self.max_bytes),
                Mode::Deferred => (self.left / 2, self.max_bytes / 2),
            };
            self.error = Some(over_what_is_left(left, max));
            self.out = Vec::new();
        }
    }

    /// The bytes the elements take in their tensor's layout: the tagged form (at most twice
    /// as large, see [`TAG_FALSE`]) counts half.
    fn typed_len(&self) -> usize {
        match self.mode {
            Mode::Typed(_) => self.out.len(),
            Mode::Deferred => self.out.len() / 2,
        }
    }

    fn fail(&mut self, message: impl Into<String>) {
        if self.error.is_none() {
            self.error = Some(format!("data element {}: {}", self.count, message.into()));
        }
    }

    /// Converts the tagged form into `dtype`'s layout.
    fn replay(self, dtype: DataType, max_bytes: usize) -> DataBuf {
        let mut typed = DataBuf::typed(dtype, self.out.len().min(max_bytes), max_bytes);
        if let Some(e) = self.error {
            typed.error = Some(e);
            return typed;
        }
        fn take<'a>(p: &mut &'a [u8], n: usize) -> &'a [u8] {
            let (head, tail) = p.split_at(n.min(p.len()));
            *p = tail;
            head
        }
        fn word<const N: usize>(p: &mut &[u8]) -> [u8; N] {
            take(p, N).try_into().unwrap_or([0; N])
        }
        let mut p = self.out.as_slice();
        while let Some((&tag, rest)) = p.split_first() {
            p = rest;
            let s = match tag {
                TAG_FALSE => Scalar::Bool(false),
                TAG_TRUE => Scalar::Bool(true),
                TAG_I8 => Scalar::I64(i8::from_le_bytes(word(&mut p)).into()),
                TAG_I16 => Scalar::I64(i16::from_le_bytes(word(&mut p)).into()),
                TAG_I32 => Scalar::I64(i32::from_le_bytes(word(&mut p)).into()),
                TAG_I64 => Scalar::I64(i64::from_le_bytes(word(&mut p))),
                TAG_U8 => Scalar::U64(u8::from_le_bytes(word(&mut p)).into()),
                TAG_U16 => Scalar::U64(u16::from_le_bytes(word(&mut p)).into()),
                TAG_U32 => Scalar::U64(u32::from_le_bytes(word(&mut p)).into()),
                TAG_U64 => Scalar::U64(u64::from_le_bytes(word(&mut p))),
                TAG_F16 => Scalar::F64(half::f16::from_le_bytes(word(&mut p)).to_f64()),
                TAG_F32 => Scalar::F64(f32::from_le_bytes(word(&mut p)).into()),
                TAG_F64 => Scalar::F64(f64::from_le_bytes(word(&mut p))),
                TAG_STR => {
                    let len = u32::from_le_bytes(word(&mut p)) as usize;
                    Scalar::Str(std::str::from_utf8(take(&mut p, len)).unwrap_or(""))
                }
                _ => Scalar::Null,
            };
            typed.push(s);
            if typed.error.is_some() {
                break;
            }
        }
        typed
    }
}

fn encode_tagged(s: Scalar<'_>, out: &mut Vec<u8>) {
    match s {
        Scalar::Bool(false) => out.push(TAG_FALSE),
        Scalar::Bool(true) => out.push(TAG_TRUE),
        Scalar::I64(v) => {
            if let Ok(v) = i8::try_from(v) {
                out.push(TAG_I8);
                out.extend_from_slice(&v.to_le_bytes());
            } else if let Ok(v) = i16::try_from(v) {
                out.push(TAG_I16);
                out.extend_from_slice(&v.to_le_bytes());
            } else if let Ok(v) = i32::try_from(v) {
                out.push(TAG_I32);
                out.extend_from_slice(&v.to_le_bytes());
            } else {
                out.push(TAG_I64);
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        Scalar::U64(v) => {
            if let Ok(v) = u8::try_from(v) {
                out.push(TAG_U8);
                out.push(v);
            } else if let Ok(v) = u16::try_from(v) {
                out.push(TAG_U16);
                out.extend_from_slice(&v.to_le_bytes());
            } else if let Ok(v) = u32::try_from(v) {
                out.push(TAG_U32);
                out.extend_from_slice(&v.to_le_bytes());
            } else {
                out.push(TAG_U64);
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        Scalar::F64(v) => {
            let half = half::f16::from_f64(v);
            if half.to_f64() == v || (v.is_nan() && half.is_nan()) {
                out.push(TAG_F16);
                out.extend_from_slice(&half.to_le_bytes());
            } else if f64::from(v as f32) == v {
                out.push(TAG_F32);
                out.extend_from_slice(&(v as f32).to_le_bytes());
            } else {
                out.push(TAG_F64);
                out.extend_from_slice(&v.to_le_bytes());
            }
        }
        Scalar::Str(t) => {
            out.push(TAG_STR);
            out.extend_from_slice(&(t.len() as u32).to_le_bytes());
            out.extend_from_slice(t.as_bytes());
        }
        Scalar::Null => out.push(TAG_NULL),
    }
}

/// Appends one JSON scalar to a tensor of `dtype` in its little-endian layout.
#[inline]
fn encode(dtype: DataType, s: Scalar<'_>, out: &mut Vec<u8>) -> Result<(), String> {
    let mismatch = |expected: &str| format!("expected {expected} for {dtype}, got {} ({s})", s.kind());
    macro_rules! int {
        ($t:ty) => {{
            let v: Option<$t> = match s {
                Scalar::I64(v) => <$t>::try_from(v).ok(),
                Scalar::U64(v) => <$t>::try_from(v).ok(),
                _ => return Err(mismatch("an integer")),
            };
            match v {
                Some(v) => out.extend_from_slice(&v.to_le_bytes()),
                None => return Err(format!("{s} is out of range for {dtype}")),
            }
        }};
    }
    macro_rules! float {
        ($conv:expr) => {{
            let v: f64 = match s {
                Scalar::F64(v) => v,
                Scalar::I64(v) => v as f64,
                Scalar::U64(v) => v as f64,
                _ => return Err(mismatch("a number")),
            };
            out.extend_from_slice(&($conv)(v).to_le_bytes());
        }};
    }
    match dtype {
        DataType::Bool => match s {
            Scalar::Bool(b) => out.push(b as u8),
            _ => return Err(mismatch("a boolean")),
        },
        DataType::Uint8 => int!(u8),
        DataType::Uint16 => int!(u16),
        DataType::Uint32 => int!(u32),
        DataType::Uint64 => int!(u64),
        DataType::Int8 => int!(i8),
        DataType::Int16 => int!(i16),
        DataType::Int32 => int!(i32),
        DataType::Int64 => int!(i64),
        DataType::Fp16 => float!(half::f16::from_f64),
        DataType::Bf16 => float!(half::bf16::from_f64),
        DataType::Fp32 => float!(|v: f64| v as f32),
        DataType::Fp64 => float!(|v: f64| v),
        DataType::Bytes => match s {
            Scalar::Str(t) => {
                let len = u32::try_from(t.len()).map_err(|_| format!("a string of {} bytes is too long", t.len()))?;
                out.extend_from_slice(&len.to_le_bytes());
                out.extend_from_slice(t.as_bytes());
            }
            _ => return Err(mismatch("a string")),
        },
    }
    Ok(())
}

/// Reads one element of a (possibly nested) `data` array into the buffer.
struct ElementSeed<'b> {
    buf: &'b mut DataBuf,
    /// Marker strings stand for non-finite numbers (see [`rewrite_non_finite`]).
    non_finite: bool,
}

impl<'de> DeserializeSeed<'de> for ElementSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for ElementSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("tensor data: an array (possibly nested) of scalars")
    }
    fn visit_bool<E: de::Error>(self, v: bool) -> Result<(), E> {
        self.buf.push(Scalar::Bool(v));
        Ok(())
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        self.buf.push(Scalar::I64(v));
        Ok(())
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        self.buf.push(Scalar::U64(v));
        Ok(())
    }
    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        self.buf.push(Scalar::F64(v));
        Ok(())
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        match self.non_finite.then(|| non_finite_marker(v)).flatten() {
            Some(f) => self.buf.push(Scalar::F64(f)),
            None => self.buf.push(Scalar::Str(v)),
        }
        Ok(())
    }
    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.buf.push(Scalar::Null);
        Ok(())
    }
    fn visit_none<E: de::Error>(self) -> Result<(), E> {
        self.buf.push(Scalar::Null);
        Ok(())
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let buf = self.buf;
        while seq.next_element_seed(ElementSeed { buf: &mut *buf, non_finite: self.non_finite })?.is_some() {}
        Ok(())
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        self.buf.fail("a JSON object is not a tensor element");
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Response rendering.
// ---------------------------------------------------------------------------------------------

/// An infer response ready to send: the JSON header and, when any output goes in the binary
/// section, those outputs' bytes in order (shared with the response, not copied).
#[derive(Debug)]
pub struct RenderedResponse {
    pub json: Vec<u8>,
    pub binary: Vec<Bytes>,
    /// Whether any output is in the binary section (then `Inference-Header-Content-Length` is
    /// sent, even when every binary output is empty).
    pub has_binary: bool,
}

impl RenderedResponse {
    /// The `Inference-Header-Content-Length` value, when the response has a binary section.
    pub fn header_length(&self) -> Option<usize> {
        self.has_binary.then_some(self.json.len())
    }

    pub fn total_len(&self) -> usize {
        self.json.len() + self.binary.iter().map(Bytes::len).sum::<usize>()
    }
}

/// Renders a response: `{"model_name","model_version","id"?,"outputs":[...]}` with each output's
/// `data` (flat, row-major) or, for binary outputs, `parameters.binary_data_size`.
pub fn render_infer_response(response: &InferResponse, format: &OutputFormat) -> Result<RenderedResponse, Status> {
    // A BYTES output that is not UTF-8 text cannot go in JSON as it is: it goes in the binary
    // section (its `binary_data_size` says so; tritonclient reads either form), rather than
    // reaching the client altered.
    let binary_flags: Vec<bool> =
        response.outputs.iter().map(|o| format.is_binary(&o.name) || !is_json_text(o)).collect();
    let mut binary = Vec::new();
    let mut estimate = 256usize;
    for (o, &is_binary) in response.outputs.iter().zip(&binary_flags) {
        estimate += 96 + o.name.len() + o.shape.len() * 8;
        if is_binary {
            if !o.data.is_empty() {
                binary.push(o.data.clone());
            }
        } else {
            // Roughly 12 characters per 4-byte number; strings are about their own length.
            estimate = estimate.saturating_add(o.data.len().saturating_mul(3));
        }
    }
    let mut json = Vec::with_capacity(estimate.min(64 << 20));
    ResponseJson { response, binary: &binary_flags, shm: &format.shm }
        .serialize(&mut serde_json::Serializer::with_formatter(&mut json, NonFiniteFormatter))
        .map_err(|e| Status::internal(format!("failed to render the inference response: {e}")))?;
    Ok(RenderedResponse { json, binary, has_binary: binary_flags.contains(&true) })
}

/// Whether every element of a BYTES output is UTF-8 text (other types always render).
fn is_json_text(output: &OutputTensor) -> bool {
    output.datatype != DataType::Bytes
        || split_bytes_elements(&output.name, &output.data)
            .is_ok_and(|elements| elements.iter().all(|e| std::str::from_utf8(e).is_ok()))
}

struct ResponseJson<'a> {
    response: &'a InferResponse,
    binary: &'a [bool],
    shm: &'a [ShmWritten],
}

impl Serialize for ResponseJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let r = self.response;
        let mut m = s.serialize_map(None)?;
        if !r.id.is_empty() {
            m.serialize_entry("id", &r.id)?;
        }
        m.serialize_entry("model_name", &r.model_name)?;
        m.serialize_entry("model_version", &r.model_version.to_string())?;
        m.serialize_entry("outputs", &OutputsJson { outputs: &r.outputs, binary: self.binary, shm: self.shm })?;
        m.end()
    }
}

struct OutputsJson<'a> {
    outputs: &'a [OutputTensor],
    binary: &'a [bool],
    shm: &'a [ShmWritten],
}

impl Serialize for OutputsJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut q = s.serialize_seq(Some(self.outputs.len()))?;
        for (o, &binary) in self.outputs.iter().zip(self.binary) {
            let shm = self.shm.iter().find(|w| w.name == o.name);
            q.serialize_element(&OutputJson { output: o, binary, shm })?;
        }
        q.end()
    }
}

struct OutputJson<'a> {
    output: &'a OutputTensor,
    binary: bool,
    shm: Option<&'a ShmWritten>,
}

struct BinaryParameters(usize);

struct ShmParameters<'a>(&'a ShmWritten);

impl Serialize for ShmParameters<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(2))?;
        m.serialize_entry(shm::REGION, &self.0.region)?;
        m.serialize_entry(shm::BYTE_SIZE, &self.0.byte_size)?;
        m.end()
    }
}

impl Serialize for BinaryParameters {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(1))?;
        m.serialize_entry("binary_data_size", &self.0)?;
        m.end()
    }
}

impl Serialize for OutputJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let o = self.output;
        let mut m = s.serialize_map(None)?;
        m.serialize_entry("name", &o.name)?;
        m.serialize_entry("datatype", o.datatype.wire_name())?;
        m.serialize_entry("shape", &o.shape)?;
        if let Some(w) = self.shm {
            m.serialize_entry("parameters", &ShmParameters(w))?;
        } else if self.binary {
            m.serialize_entry("parameters", &BinaryParameters(o.data.len()))?;
        } else {
            m.serialize_entry("data", &DataJson { name: &o.name, dtype: o.datatype, data: &o.data })?;
        }
        m.end()
    }
}

/// One floating-point output element. Finite values are JSON numbers; NaN, +inf and -inf are
/// written as the bare tokens `NaN`, `Infinity` and `-Infinity`, as tritonserver does
/// (rapidjson's kWriteNanAndInfFlag) and Python's json module reads. serde_json turns
/// non-finite floats into `null` before its [`Formatter`](serde_json::ser::Formatter) sees
/// them, so they reach [`NonFiniteFormatter`] as reserved `u128` values instead (a response
/// serializes no other `u128`).
#[derive(Clone, Copy)]
enum Float {
    F32(f32),
    F64(f64),
}

const U128_NAN: u128 = u128::MAX;
const U128_INF: u128 = u128::MAX - 1;
const U128_NEG_INF: u128 = u128::MAX - 2;

impl Serialize for Float {
    #[inline]
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let v = match *self {
            Float::F32(v) if v.is_finite() => return s.serialize_f32(v),
            Float::F64(v) if v.is_finite() => return s.serialize_f64(v),
            Float::F32(v) => v as f64,
            Float::F64(v) => v,
        };
        s.serialize_u128(if v.is_nan() {
            U128_NAN
        } else if v > 0.0 {
            U128_INF
        } else {
            U128_NEG_INF
        })
    }
}

/// serde_json's compact output, but with [`Float`]'s reserved values written as `NaN`,
/// `Infinity` and `-Infinity`.
struct NonFiniteFormatter;

impl serde_json::ser::Formatter for NonFiniteFormatter {
    fn write_u128<W: ?Sized + std::io::Write>(&mut self, writer: &mut W, value: u128) -> std::io::Result<()> {
        match value {
            U128_NAN => writer.write_all(b"NaN"),
            U128_INF => writer.write_all(b"Infinity"),
            U128_NEG_INF => writer.write_all(b"-Infinity"),
            _ => serde_json::ser::CompactFormatter.write_u128(writer, value),
        }
    }
}

/// A tensor's raw bytes as a flat JSON array of its elements.
struct DataJson<'a> {
    name: &'a str,
    dtype: DataType,
    data: &'a [u8],
}

impl Serialize for DataJson<'_> {
    #[allow(clippy::modulo_one)] // the element-size check is generic over 1-byte types too
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        macro_rules! elements {
            ($t:ty, $conv:expr) => {{
                const N: usize = std::mem::size_of::<$t>();
                if self.data.len() % N != 0 {
                    return Err(ser::Error::custom(format!(
                        "output '{}' has {} bytes, not a multiple of the {}-byte {} element",
                        self.name,
                        self.data.len(),
                        N,
                        self.dtype
                    )));
                }
                let mut q = s.serialize_seq(Some(self.data.len() / N))?;
                for c in self.data.chunks_exact(N) {
                    let mut a = [0u8; N];
                    a.copy_from_slice(c);
                    q.serialize_element(&($conv)(<$t>::from_le_bytes(a)))?;
                }
                q.end()
            }};
        }
        match self.dtype {
            DataType::Bool => {
                let mut q = s.serialize_seq(Some(self.data.len()))?;
                for &b in self.data {
                    q.serialize_element(&(b != 0))?;
                }
                q.end()
            }
            DataType::Uint8 => elements!(u8, |v| v),
            DataType::Uint16 => elements!(u16, |v| v),
            DataType::Uint32 => elements!(u32, |v| v),
            DataType::Uint64 => elements!(u64, |v| v),
            DataType::Int8 => elements!(i8, |v| v),
            DataType::Int16 => elements!(i16, |v| v),
            DataType::Int32 => elements!(i32, |v| v),
            DataType::Int64 => elements!(i64, |v| v),
            DataType::Fp16 => elements!(half::f16, |v: half::f16| Float::F32(v.to_f32())),
            DataType::Bf16 => elements!(half::bf16, |v: half::bf16| Float::F32(v.to_f32())),
            DataType::Fp32 => elements!(f32, Float::F32),
            DataType::Fp64 => elements!(f64, Float::F64),
            DataType::Bytes => {
                let elements = split_bytes_elements(self.name, self.data).map_err(|e| ser::Error::custom(e.message))?;
                let mut q = s.serialize_seq(Some(elements.len()))?;
                for e in elements {
                    // Outputs holding other bytes go in the binary section instead.
                    let text = std::str::from_utf8(e).map_err(|_| {
                        ser::Error::custom(format!("output '{}' holds bytes that are not UTF-8 text", self.name))
                    })?;
                    q.serialize_element(text)?;
                }
                q.end()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::serialize_bytes_elements;
    use nereid_common::Code;

    const MAX: usize = 64 << 20;

    fn parse(json: &str) -> Result<ParsedInfer, Status> {
        parse_infer_request("m", None, Bytes::copy_from_slice(json.as_bytes()), None, MAX, None)
    }

    fn one_input(datatype: &str, shape: &str, data: &str) -> Result<InputTensor, Status> {
        let json = format!(r#"{{"inputs":[{{"name":"x","datatype":"{datatype}","shape":{shape},"data":{data}}}]}}"#);
        parse(&json).map(|p| p.request.inputs.into_iter().next().unwrap())
    }

    fn le<T: Copy, const N: usize>(values: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
        values.iter().flat_map(|v| f(*v)).collect()
    }

    /// `binary_data_output` is the choice for the outputs a request does not list: a listed
    /// one without `binary_data` comes back in JSON, as in Triton.
    #[test]
    fn binary_data_output_leaves_listed_outputs_in_json_unless_they_ask() {
        let p = parse(
            r#"{"parameters":{"binary_data_output":true},"inputs":[],
                "outputs":[{"name":"A"},{"name":"B","parameters":{"binary_data":true}}]}"#,
        )
        .unwrap();
        assert_eq!([p.format.is_binary("A"), p.format.is_binary("B"), p.format.is_binary("C")], [false, true, true]);
    }

    /// An FP64 in JSON reaches the model as the exact double written.
    #[test]
    fn fp64_json_values_round_trip_exactly() {
        let x = one_input("FP64", "[2]", "[0.9999999999999999, 1e-310]").unwrap();
        assert_eq!(&x.data[..], &le(&[0.9999999999999999f64, 1e-310], f64::to_le_bytes)[..]);
    }

    fn raw_config(text: &str) -> ModelConfig {
        nereid_common::config::parse_model_config(text).expect("config")
    }

    /// Triton's raw binary request: the body is the only input's data, of batch 1, its free
    /// dim filled from the byte count; a BYTES input is one element; every output binary.
    #[test]
    fn a_raw_binary_request_carries_the_only_input() {
        let batching = raw_config(
            "max_batch_size: 8\ninput [ { name: \"X\" data_type: TYPE_FP32 dims: [ -1, 2 ] } ]\n\
             output [ { name: \"Y\" data_type: TYPE_FP32 dims: [ -1, 2 ] } ]",
        );
        let body = Bytes::from(le(&[1f32, 2., 3., 4., 5., 6.], f32::to_le_bytes));
        let p = parse_raw_binary_request("m", None, body.clone(), &batching).unwrap();
        let x = &p.request.inputs[0];
        assert_eq!(
            (x.name.as_str(), x.datatype, &x.shape[..], &x.data[..]),
            ("X", DataType::Fp32, &[1, 3, 2][..], &body[..])
        );
        assert!(p.request.outputs.is_empty() && p.format.is_binary("Y"));
        // Not a whole number of rows, or of elements: refused, saying why.
        let e = parse_raw_binary_request("m", None, body.slice(..4), &batching).unwrap_err();
        assert!(e.message.contains("do not fill input 'X'"), "{}", e.message);
        let e = parse_raw_binary_request("m", None, body.slice(..3), &batching).unwrap_err();
        assert!(e.message.contains("not a whole number of FP32 elements"), "{}", e.message);

        let text = raw_config("input [ { name: \"T\" data_type: TYPE_STRING dims: [ 1 ] } ]");
        let p = parse_raw_binary_request("m", Some(2), Bytes::from_static(b"hello"), &text).unwrap();
        let t = &p.request.inputs[0];
        assert_eq!((t.datatype, &t.shape[..], &t.data[..]), (DataType::Bytes, &[1][..], &b"\x05\0\0\0hello"[..]));

        let two = raw_config(
            "input [ { name: \"A\" data_type: TYPE_FP32 dims: [ 1 ] }, { name: \"B\" data_type: TYPE_FP32 dims: [ 1 ] } ]",
        );
        let e = parse_raw_binary_request("m", None, Bytes::from_static(&[0; 4]), &two).unwrap_err();
        assert!(e.message.contains("has 2 inputs"), "{}", e.message);
        let free = raw_config("input [ { name: \"X\" data_type: TYPE_FP32 dims: [ -1, -1 ] } ]");
        assert!(parse_raw_binary_request("m", None, Bytes::from_static(&[0; 8]), &free).is_err());
    }

    /// Each input's buffer is reserved from its claimed shape before any element arrives; all
    /// inputs together may not reserve more than the request limit, however many claim it.
    #[test]
    fn claimed_shapes_reserve_at_most_the_request_limit_in_all() {
        let one = r#"{"name":"x","datatype":"FP32","shape":[16777216],"data":[]}"#;
        let json = format!(r#"{{"inputs":[{}]}}"#, vec![one; 1000].join(","));
        let raw = parse_json(json.as_bytes(), MAX).expect("parses");
        let reserved: usize = raw
            .inputs
            .unwrap()
            .iter()
            .map(|i| match &i.data {
                Some(RawData::Buf(b)) => b.out.capacity(),
                _ => 0,
            })
            .sum();
        assert!(reserved <= MAX, "{reserved} bytes reserved for 1000 inputs of 64 MiB each");
        // A single input still gets its whole buffer up front.
        let raw = parse_json(br#"{"inputs":[{"name":"x","datatype":"FP32","shape":[4],"data":[1,2,3,4]}]}"#, MAX)
            .expect("parses");
        match &raw.inputs.unwrap()[0].data {
            Some(RawData::Buf(b)) => assert_eq!((b.out.len(), b.out.capacity()), (16, 16)),
            _ => panic!("typed data expected"),
        }
    }

    /// Without regions to name (the gateway), an input naming one is refused for that, before
    /// its shape is checked against the body limit (which it would not be sent in).
    #[test]
    fn shared_memory_where_none_can_be_named_is_the_error_whatever_the_shape() {
        let json = r#"{"inputs":[{"name":"x","datatype":"FP32","shape":[100000000],
            "parameters":{"shared_memory_region":"r","shared_memory_byte_size":400000000}}]}"#;
        let e = parse(json).unwrap_err();
        assert!(e.message.contains("system shared memory is not supported here"), "{}", e.message);
        // An output too, before what else it asks for is looked at.
        let json = r#"{"inputs":[],"outputs":[{"name":"Y","parameters":{"shared_memory_region":"r",
            "shared_memory_byte_size":8,"binary_data":true}}]}"#;
        let e = parse(json).unwrap_err();
        assert!(e.message.contains("system shared memory is not supported here"), "{}", e.message);
    }

    /// All of a request's tensors together stay within the limit, each checked as its
    /// elements arrive (JSON `0,` takes 2 bytes of body and 8 of INT64), so a body under the
    /// limit cannot make the parser hold several times the limit.
    #[test]
    fn the_inputs_together_stay_within_the_request_limit() {
        const LIMIT: usize = 64;
        let parse_with = |json: String, header: Option<usize>, binary: &[u8]| {
            let body = [json.as_bytes(), binary].concat();
            parse_infer_request("m", None, Bytes::from(body), header, LIMIT, None)
        };
        let input = |name: &str, n: usize| {
            format!(r#"{{"name":"{name}","datatype":"INT64","shape":[{n}],"data":{:?}}}"#, vec![0; n])
        };
        // 5 + 3 INT64 = 64 bytes: at the limit, accepted.
        let ok = parse_with(format!(r#"{{"inputs":[{},{}]}}"#, input("a", 5), input("b", 3)), None, &[]);
        assert_eq!(ok.unwrap().request.inputs.len(), 2);
        // 5 + 4: each alone fits, together 72 bytes do not; the second array stops growing at
        // what the first left.
        let e = parse_with(format!(r#"{{"inputs":[{},{}]}}"#, input("a", 5), input("b", 4)), None, &[]).unwrap_err();
        assert!(e.message.contains("24 bytes the inputs before it leave of the request limit of 64"), "{}", e.message);
        // "data" before "datatype" (the tagged form) counts too.
        let late = r#"{"name":"b","data":[0,0,0,0],"datatype":"INT64","shape":[4]}"#;
        let e = parse_with(format!(r#"{{"inputs":[{},{late}]}}"#, input("a", 5)), None, &[]).unwrap_err();
        assert!(e.message.contains("24 bytes the inputs before it leave of the request limit of 64"), "{}", e.message);
        // ...exactly: its tagged form (decimals take 9 bytes there, 4 as FP32) counts as FP32.
        let floats = |name: &str, n: usize| {
            format!(r#"{{"name":"{name}","data":{:?},"shape":[{n}],"datatype":"FP32"}}"#, vec![0.1; n])
        };
        let typed = r#"{"name":"c","datatype":"FP32","shape":[4],"data":[0.1,0.1,0.1,0.1]}"#;
        let ok = parse_with(format!(r#"{{"inputs":[{},{},{typed}]}}"#, floats("a", 6), floats("b", 6)), None, &[]);
        assert_eq!(ok.unwrap().request.inputs.len(), 3, "24 + 24 + 16 bytes of FP32: at the limit");
        // A binary tensor after a JSON one: 40 + 32 bytes.
        let json = format!(
            r#"{{"inputs":[{},{{"name":"b","datatype":"INT64","shape":[4],"parameters":{{"binary_data_size":32}}}}]}}"#,
            input("a", 5)
        );
        let e = parse_with(json.clone(), Some(json.len()), &[0; 32]).unwrap_err();
        assert!(e.message.contains("inputs[1] ('b'): the inputs up to this one take 72 bytes"), "{}", e.message);
    }

    #[test]
    fn parses_request_fields() {
        let p = parse(
            r#"{"id":"r1","parameters":{"priority":2,"timeout":1500,"sequence_id":7,"custom":"x"},
                "inputs":[{"name":"INPUT0","shape":[2],"datatype":"FP32","data":[1.5,-2]}],
                "outputs":[{"name":"OUT","parameters":{"binary_data":true}},{"name":"OUT2"}],
                "unknown":{"a":[1,2]}}"#,
        )
        .unwrap();
        let r = &p.request;
        assert_eq!(r.model_name, "m");
        assert_eq!(r.id, "r1");
        assert_eq!(r.priority, 2);
        assert_eq!(r.timeout_us, 1500);
        assert_eq!(r.inputs[0].name, "INPUT0");
        assert_eq!(r.inputs[0].shape, vec![2]);
        assert_eq!(r.inputs[0].datatype, DataType::Fp32);
        assert_eq!(&r.inputs[0].data[..], le(&[1.5f32, -2.0], f32::to_le_bytes).as_slice());
        assert_eq!(r.outputs.len(), 2);
        assert_eq!(r.outputs[0].binary_data, Some(true));
        assert_eq!(r.outputs[1].binary_data, None);
        assert!(p.format.is_binary("OUT"));
        assert!(!p.format.is_binary("OUT2"));
    }

    #[test]
    fn every_fixed_size_dtype() {
        let t = one_input("BOOL", "[3]", "[true,false,true]").unwrap();
        assert_eq!(&t.data[..], &[1, 0, 1]);
        let t = one_input("UINT8", "[2]", "[0,255]").unwrap();
        assert_eq!(&t.data[..], &[0, 255]);
        let t = one_input("INT8", "[2]", "[-128,127]").unwrap();
        assert_eq!(&t.data[..], &[0x80, 0x7f]);
        let t = one_input("UINT16", "[2]", "[1,65535]").unwrap();
        assert_eq!(&t.data[..], le(&[1u16, 65535], u16::to_le_bytes).as_slice());
        let t = one_input("INT16", "[2]", "[-1,300]").unwrap();
        assert_eq!(&t.data[..], le(&[-1i16, 300], i16::to_le_bytes).as_slice());
        let t = one_input("UINT32", "[1]", "[4294967295]").unwrap();
        assert_eq!(&t.data[..], le(&[u32::MAX], u32::to_le_bytes).as_slice());
        let t = one_input("INT32", "[2]", "[-5,7]").unwrap();
        assert_eq!(&t.data[..], le(&[-5i32, 7], i32::to_le_bytes).as_slice());
        let t = one_input("UINT64", "[1]", "[18446744073709551615]").unwrap();
        assert_eq!(&t.data[..], le(&[u64::MAX], u64::to_le_bytes).as_slice());
        let t = one_input("INT64", "[2]", "[-9223372036854775808,1]").unwrap();
        assert_eq!(&t.data[..], le(&[i64::MIN, 1], i64::to_le_bytes).as_slice());
        let t = one_input("FP64", "[2]", "[0.1,3]").unwrap();
        assert_eq!(&t.data[..], le(&[0.1f64, 3.0], f64::to_le_bytes).as_slice());
        let t = one_input("FP16", "[3]", "[1.5,-2,0.1]").unwrap();
        let expect = [half::f16::from_f32(1.5), half::f16::from_f32(-2.0), half::f16::from_f64(0.1)];
        assert_eq!(&t.data[..], le(&expect, half::f16::to_le_bytes).as_slice());
        let t = one_input("BF16", "[2]", "[1.5,-2]").unwrap();
        let expect = [half::bf16::from_f32(1.5), half::bf16::from_f32(-2.0)];
        assert_eq!(&t.data[..], le(&expect, half::bf16::to_le_bytes).as_slice());
    }

    #[test]
    fn nested_arrays_flatten_row_major() {
        let t = one_input("INT32", "[2,3]", "[[1,2,3],[4,5,6]]").unwrap();
        assert_eq!(t.shape, vec![2, 3]);
        assert_eq!(&t.data[..], le(&[1i32, 2, 3, 4, 5, 6], i32::to_le_bytes).as_slice());
        let t = one_input("FP32", "[1,2,2]", "[[[1,2],[3,4]]]").unwrap();
        assert_eq!(&t.data[..], le(&[1f32, 2., 3., 4.], f32::to_le_bytes).as_slice());
    }

    #[test]
    fn bytes_from_json_strings() {
        let t = one_input("BYTES", "[3]", r#"["ab","","h\u00e9"]"#).unwrap();
        assert_eq!(&t.data[..], serialize_bytes_elements(["ab", "", "hé"]).as_slice());
        let e = one_input("BYTES", "[1]", "[1]").unwrap_err();
        assert!(e.message.contains("inputs[0] ('x')") && e.message.contains("string"), "{}", e.message);
    }

    #[test]
    fn data_before_datatype_and_shape() {
        let p = parse(r#"{"inputs":[{"data":[[1,2],[3,4]],"name":"x","shape":[2,2],"datatype":"INT64"}]}"#).unwrap();
        assert_eq!(&p.request.inputs[0].data[..], le(&[1i64, 2, 3, 4], i64::to_le_bytes).as_slice());
        let p = parse(r#"{"inputs":[{"data":["a","bc"],"name":"s","shape":[2],"datatype":"BYTES"}]}"#).unwrap();
        assert_eq!(&p.request.inputs[0].data[..], serialize_bytes_elements(["a", "bc"]).as_slice());
        let p = parse(r#"{"inputs":[{"data":[true,false],"shape":[2],"datatype":"BOOL","name":"b"}]}"#).unwrap();
        assert_eq!(&p.request.inputs[0].data[..], &[1, 0]);
        let p = parse(r#"{"inputs":[{"data":[-1.5, 2],"shape":[2],"datatype":"FP32","name":"f"}]}"#).unwrap();
        assert_eq!(&p.request.inputs[0].data[..], le(&[-1.5f32, 2.0], f32::to_le_bytes).as_slice());
        let e = parse(r#"{"inputs":[{"data":[1, 300],"shape":[2],"datatype":"INT8","name":"i"}]}"#).unwrap_err();
        assert!(e.message.contains("inputs[0] ('i')") && e.message.contains("300 is out of range"), "{}", e.message);
    }

    /// A field given twice in an input object is refused: a later "datatype" would relabel
    /// data already read under the first (FP32 1.5 read back as INT32 1069547520).
    #[test]
    fn an_input_field_given_twice_is_refused() {
        let e = parse(r#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1.5],"datatype":"INT32"}]}"#)
            .unwrap_err();
        assert!(e.message.contains("gives 'datatype' twice"), "{}", e.message);
        let e =
            parse(r#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1.5],"data":[2.5]}]}"#).unwrap_err();
        assert!(e.message.contains("gives 'data' twice"), "{}", e.message);
        // Fields Nereid does not read may repeat.
        parse(r#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[1.5],"extra":1,"extra":2}]}"#).unwrap();
    }

    /// Whether "data" comes before "datatype" changes nothing: the same bytes, values kept
    /// exactly (the deferred form stores each in its narrowest exact width), and a tensor at
    /// the request limit is accepted either way.
    #[test]
    fn data_before_datatype_is_exact_and_fits_the_same_limit() {
        const LIMIT: usize = 4096;
        let both = |datatype: &str, shape: &str, data: &str| {
            let parse = |json: String| {
                parse_infer_request("m", None, Bytes::from(json), None, LIMIT, None)
                    .map(|p| p.request.inputs[0].data.clone())
            };
            let typed = parse(format!(
                r#"{{"inputs":[{{"name":"x","shape":{shape},"datatype":"{datatype}","data":{data}}}]}}"#
            ));
            let deferred = parse(format!(
                r#"{{"inputs":[{{"data":{data},"name":"x","shape":{shape},"datatype":"{datatype}"}}]}}"#
            ));
            let typed = typed.unwrap_or_else(|e| panic!("{datatype} typed: {}", e.message));
            let deferred = deferred.unwrap_or_else(|e| panic!("{datatype} deferred: {}", e.message));
            assert_eq!(typed, deferred, "{datatype}");
            typed
        };
        let join = |v: Vec<String>| format!("[{}]", v.join(","));
        // At the limit: LIMIT bytes of each type.
        both("INT8", &format!("[{LIMIT}]"), &join((0..LIMIT).map(|i| ((i % 256) as i64 - 128).to_string()).collect()));
        both("UINT8", &format!("[{LIMIT}]"), &join((0..LIMIT).map(|i| (i % 256).to_string()).collect()));
        both("BOOL", &format!("[{LIMIT}]"), &join((0..LIMIT).map(|i| (i % 2 == 0).to_string()).collect()));
        both(
            "INT16",
            &format!("[{}]", LIMIT / 2),
            &join((0..LIMIT / 2).map(|i| (i as i64 * 13 - 20000).to_string()).collect()),
        );
        both(
            "FP32",
            &format!("[{}]", LIMIT / 4),
            &join((0..LIMIT / 4).map(|i| f64::from(i as f32 * 0.37).to_string()).collect()),
        );
        both("INT64", &format!("[{}]", LIMIT / 8), &join((0..LIMIT / 8).map(|i| (i * 3).to_string()).collect()));
        both(
            "FP16",
            &format!("[{}]", LIMIT / 2),
            &join((0..LIMIT / 2).map(|i| (i as f64 / 8.0).to_string()).collect()),
        );
        // Extremes of every width come back exactly.
        let data = both("INT64", "[6]", &format!("[{},-129,-128,127,40000,{}]", i64::MIN, i64::MAX));
        assert_eq!(&data[..], le(&[i64::MIN, -129, -128, 127, 40000, i64::MAX], i64::to_le_bytes).as_slice());
        let data = both("UINT64", "[6]", &format!("[0,255,256,70000,4294967296,{}]", u64::MAX));
        assert_eq!(&data[..], le(&[0u64, 255, 256, 70000, 1 << 32, u64::MAX], u64::to_le_bytes).as_slice());
        let values = [0.1, 1e300, -0.0, 65504.0, 1e-9, 0.5, 16777217.0];
        let text = values.iter().map(|v: &f64| format!("{v:e}")).collect::<Vec<_>>().join(",");
        let data = both("FP64", "[7]", &format!("[{text}]"));
        assert_eq!(&data[..], le(&values, f64::to_le_bytes).as_slice());
    }

    #[test]
    fn wrong_json_types_name_the_input() {
        let cases = [
            ("FP32", "[2]", r#"[1,"x"]"#, "expected a number for FP32, got a string"),
            ("INT8", "[1]", "[128]", "128 is out of range for INT8"),
            ("UINT8", "[1]", "[-1]", "-1 is out of range for UINT8"),
            ("INT32", "[1]", "[1.5]", "expected an integer for INT32, got a number"),
            ("BOOL", "[1]", "[1]", "expected a boolean for BOOL"),
            ("FP32", "[1]", "[null]", "got null"),
            ("FP32", "[1]", r#"[{"a":1}]"#, "JSON object"),
        ];
        for (dt, shape, data, want) in cases {
            let e = one_input(dt, shape, data).unwrap_err();
            assert_eq!(e.code, Code::InvalidArgument);
            assert!(e.message.starts_with("inputs[0] ('x'): "), "{}", e.message);
            assert!(e.message.contains(want), "{dt} {data}: {}", e.message);
        }
        let e = one_input("FP32", "[2]", r#"[1,"x"]"#).unwrap_err();
        assert!(e.message.contains("data element 1"), "{}", e.message);
    }

    #[test]
    fn element_count_mismatch() {
        let data = format!("[{}]", vec!["1"; 15].join(","));
        let e = one_input("INT32", "[1,16]", &data).unwrap_err();
        assert_eq!(e.message, "inputs[0] ('x'): expected 16 elements for shape [1,16], got 15");
        let e = one_input("FP32", "[2,2]", "[[1,2],[3,4],[5]]").unwrap_err();
        assert!(e.message.contains("expected 4 elements for shape [2,2], got 5"), "{}", e.message);
    }

    #[test]
    fn field_errors() {
        let e = parse(r#"{"inputs":[{"shape":[1],"datatype":"FP32","data":[1]}]}"#).unwrap_err();
        assert_eq!(e.message, "inputs[0]: missing 'name'");
        let e = parse(r#"{"inputs":[{"name":"a","shape":[1],"datatype":"FLOAT","data":[1]}]}"#).unwrap_err();
        assert_eq!(e.message, "inputs[0] ('a'): unknown datatype 'FLOAT'");
        let e = parse(r#"{"inputs":[{"name":"a","datatype":"FP32","data":[1]}]}"#).unwrap_err();
        assert_eq!(e.message, "inputs[0] ('a'): missing 'shape'");
        let e = parse(r#"{"inputs":[{"name":"a","shape":[1.5],"datatype":"FP32","data":[1]}]}"#).unwrap_err();
        assert!(e.message.starts_with("inputs[0] ('a'): shape must be an array of integers"), "{}", e.message);
        let e = parse(r#"{"inputs":[{"name":"a","shape":[-1],"datatype":"FP32","data":[1]}]}"#).unwrap_err();
        assert!(e.message.contains("negative"), "{}", e.message);
        let e = parse(r#"{"inputs":[{"name":"a","shape":[1],"datatype":"FP32"}]}"#).unwrap_err();
        assert!(e.message.contains("has neither 'data' nor"), "{}", e.message);
        let e = parse(r#"{"outputs":[]}"#).unwrap_err();
        assert!(e.message.contains("no 'inputs'"), "{}", e.message);
        let e = parse(r#"{"inputs":[],"parameters":{"priority":-1}}"#).unwrap_err();
        assert!(e.message.contains("parameters.priority"), "{}", e.message);
        let e = parse(r#"{"inputs":[],"parameters":{"binary_data_output":"yes"}}"#).unwrap_err();
        assert!(e.message.contains("binary_data_output"), "{}", e.message);
        let e = parse(
            r#"{"inputs":[{"name":"a","shape":[1],"datatype":"FP32","data":[1],"parameters":{"shared_memory_region":"r"}}]}"#,
        )
        .unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(e.message.contains("'shared_memory_byte_size' is required"), "{}", e.message);
    }

    #[test]
    fn tensor_counts_ranks_and_parameters_are_bounded() {
        let many = |n: usize, item: &str| vec![item; n].join(",");
        // Inputs and outputs: at most MAX_REQUEST_TENSORS each, refused as the array is read.
        let e = parse(&format!(r#"{{"inputs":[{}]}}"#, many(MAX_REQUEST_TENSORS + 1, "{}"))).unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(e.message.contains("at most 4096 inputs"), "{}", e.message);
        let e = parse(&format!(r#"{{"inputs":[],"outputs":[{}]}}"#, many(MAX_REQUEST_TENSORS + 1, r#"{"name":"y"}"#)))
            .unwrap_err();
        assert!(e.message.contains("at most 4096 outputs"), "{}", e.message);
        assert_eq!(
            parse(&format!(r#"{{"inputs":[],"outputs":[{}]}}"#, many(MAX_REQUEST_TENSORS, r#"{"name":"y"}"#)))
                .unwrap()
                .request
                .outputs
                .len(),
            MAX_REQUEST_TENSORS
        );
        // A shape of more than MAX_RANK dimensions is refused, naming the input, in a short
        // message (the shape is not echoed back).
        let e = one_input("FP32", &format!("[{}]", many(1_000_000, "1")), "[1]").unwrap_err();
        assert!(e.message.contains("'x'") && e.message.contains("more than 64 dimensions"), "{}", e.message);
        assert!(e.message.len() < 300, "{} bytes", e.message.len());
        let rank_64 = one_input("FP32", &format!("[{}]", many(MAX_RANK, "1")), "[1]").unwrap();
        assert_eq!(rank_64.shape.len(), MAX_RANK);
        for (shape, bad) in
            [("[1,\"2\"]", 1), ("[2.5]", 0), ("[1,[2]]", 1), ("[1,{\"a\":1}]", 1), ("[18446744073709551615]", 0)]
        {
            let e = one_input("FP32", shape, "[1]").unwrap_err();
            let expected = format!("shape must be an array of integers (dimension {bad} is not one)");
            assert!(e.message.contains(&expected), "{shape}: {}", e.message);
        }
        // Parameters: scalars only (as Triton), naming the key; at most MAX_PARAMETERS.
        for (parameters, what) in
            [(r#"{"p":[1,2]}"#, "parameter 'p' is an array"), (r#"{"q":{"a":1}}"#, "parameter 'q' is an object")]
        {
            for json in [
                format!(r#"{{"inputs":[],"parameters":{parameters}}}"#),
                format!(
                    r#"{{"inputs":[{{"name":"x","datatype":"FP32","shape":[1],"data":[1],"parameters":{parameters}}}]}}"#
                ),
                format!(r#"{{"inputs":[],"outputs":[{{"name":"y","parameters":{parameters}}}]}}"#),
            ] {
                let e = parse(&json).unwrap_err();
                assert_eq!(e.code, Code::InvalidArgument);
                assert!(e.message.contains(what), "{json}: {}", e.message);
            }
        }
        let parameters = |n: usize| (0..n).map(|i| format!(r#""k{i}":{i}"#)).collect::<Vec<_>>().join(",");
        let e = parse(&format!(r#"{{"inputs":[],"parameters":{{{}}}}}"#, parameters(MAX_PARAMETERS + 1))).unwrap_err();
        assert!(e.message.contains("at most 256 entries"), "{}", e.message);
        parse(&format!(r#"{{"inputs":[],"parameters":{{{}}}}}"#, parameters(MAX_PARAMETERS))).unwrap();
        // Scalars of every kind are still accepted (and ignored where unknown).
        parse(r#"{"inputs":[],"parameters":{"a":true,"b":-1,"c":2.5,"d":"s","e":null,"sequence_id":7}}"#).unwrap();
    }

    #[test]
    fn classification_is_a_class_count() {
        let count = |v: &str| {
            parse(&format!(r#"{{"inputs":[],"outputs":[{{"name":"OUT0","parameters":{{"classification":{v}}}}}]}}"#))
                .map(|p| p.request.outputs[0].classification)
        };
        assert_eq!(count("3").unwrap(), 3);
        // 0 or null means "not requested".
        assert_eq!(count("0").unwrap(), 0);
        assert_eq!(count("null").unwrap(), 0);
        for bad in ["-1", "2.5", "\"3\"", "4294967296"] {
            let e = count(bad).unwrap_err();
            assert_eq!(e.code, Code::InvalidArgument);
            assert!(
                e.message.starts_with("outputs[0] ('OUT0'): classification must be a class count"),
                "{bad}: {}",
                e.message
            );
        }
    }

    #[test]
    fn malformed_json_says_where() {
        let e = parse("{\"inputs\": [\n  {\"name\": \"a\",, }]}").unwrap_err();
        assert_eq!(e.code, Code::InvalidArgument);
        assert!(e.message.contains("line 2 column"), "{}", e.message);
        let e = parse(r#"{"inputs":[]} trailing"#).unwrap_err();
        assert!(e.message.contains("line 1 column"), "{}", e.message);
        let e = parse(r#"{"inputs":[{"name":"a","shape":[1],"datatype":"FP32","data":[1,]}]}"#).unwrap_err();
        assert!(e.message.contains("column"), "{}", e.message);
    }

    #[test]
    fn overflowing_shape_is_rejected_before_allocating() {
        // The data would be skipped, never stored; the shape check names the problem.
        let e = one_input("FP32", "[9223372036854775807, 2]", "[1,2]").unwrap_err();
        assert_eq!(e.message, "inputs[0] ('x'): shape [9223372036854775807,2] of FP32 overflows the byte size");
        let e = one_input("FP32", "[9223372036854775807, 9223372036854775807]", "[1,2]").unwrap_err();
        assert!(e.message.contains("overflows the element count"), "{}", e.message);
        let e = one_input("INT8", "[9223372036854775807, 2]", "[1,2]").unwrap_err();
        assert!(e.message.contains("needs 18446744073709551614 bytes, more than the request limit"), "{}", e.message);
        let e = one_input("BYTES", "[9223372036854775807, 2]", r#"["a"]"#).unwrap_err();
        assert!(e.message.contains("more than the request limit"), "{}", e.message);
        // Fits u64 but not the limit.
        let e = one_input("FP64", "[1099511627776]", "[1]").unwrap_err();
        assert!(e.message.contains("more than the request limit"), "{}", e.message);
        // The binary path, with a binary_data_size that could never be honoured.
        let json = r#"{"inputs":[{"name":"x","shape":[9223372036854775807,2],"datatype":"FP32","parameters":{"binary_data_size":8}}]}"#;
        let mut body = json.as_bytes().to_vec();
        body.extend_from_slice(&[0; 8]);
        let e = parse_infer_request("m", None, Bytes::from(body), Some(json.len()), MAX, None).unwrap_err();
        assert!(e.message.contains("overflows"), "{}", e.message);
    }

    #[test]
    fn json_data_larger_than_the_limit_is_cut_off() {
        // Shape unknown when data is read: the running size check stops it.
        let json = r#"{"inputs":[{"name":"x","data":[1,2,3,4,5,6,7,8,9],"datatype":"INT64","shape":[9]}]}"#;
        let e = parse_infer_request("m", None, Bytes::from_static(json.as_bytes()), None, 32, None).unwrap_err();
        assert!(e.message.contains("limit"), "{}", e.message);
    }

    fn binary_body(json: &str, binary: &[u8]) -> (Bytes, usize) {
        let mut body = json.as_bytes().to_vec();
        body.extend_from_slice(binary);
        (Bytes::from(body), json.len())
    }

    #[test]
    fn binary_extension_good() {
        let a = le(&[1.0f32, 2.0, 3.0, 4.0], f32::to_le_bytes);
        let s = serialize_bytes_elements(["xy", "z"]);
        let json = format!(
            r#"{{"inputs":[{{"name":"A","shape":[2,2],"datatype":"FP32","parameters":{{"binary_data_size":{}}}}},
                {{"name":"J","shape":[1],"datatype":"INT32","data":[7]}},
                {{"name":"S","shape":[2],"datatype":"BYTES","parameters":{{"binary_data_size":{}}}}}],
              "parameters":{{"binary_data_output":true}}}}"#,
            a.len(),
            s.len()
        );
        let mut bin = a.clone();
        bin.extend_from_slice(&s);
        let (body, n) = binary_body(&json, &bin);
        let p = parse_infer_request("m", Some(3), body.clone(), Some(n), MAX, None).unwrap();
        let r = &p.request;
        assert_eq!(r.model_version, Some(3));
        assert_eq!(&r.inputs[0].data[..], a.as_slice());
        assert_eq!(&r.inputs[1].data[..], 7i32.to_le_bytes().as_slice());
        assert_eq!(&r.inputs[2].data[..], s.as_slice());
        // Zero-copy: the binary inputs point into the body.
        assert_eq!(r.inputs[0].data.as_ptr(), body[n..].as_ptr());
        assert!(p.format.binary_default);
        assert!(p.format.is_binary("anything"));
    }

    #[test]
    fn binary_extension_errors() {
        let json = r#"{"inputs":[{"name":"A","shape":[2],"datatype":"FP32","parameters":{"binary_data_size":8}}]}"#;
        // Header length larger than the body.
        let (body, n) = binary_body(json, &[0; 8]);
        let e = parse_infer_request("m", None, body.clone(), Some(body.len() + 1), MAX, None).unwrap_err();
        assert!(e.message.contains("Inference-Header-Content-Length"), "{}", e.message);
        // Too few bytes in the binary section.
        let (body, _) = binary_body(json, &[0; 4]);
        let e = parse_infer_request("m", None, body, Some(n), MAX, None).unwrap_err();
        assert!(e.message.starts_with("inputs[0] ('A'): binary_data_size is 8 but only 4 bytes"), "{}", e.message);
        // Extra bytes after the last binary input.
        let (body, _) = binary_body(json, &[0; 12]);
        let e = parse_infer_request("m", None, body, Some(n), MAX, None).unwrap_err();
        assert!(
            e.message.contains("binary section has 12 bytes") && e.message.contains("add up to 8"),
            "{}",
            e.message
        );
        // binary_data_size not matching shape x dtype.
        let bad = r#"{"inputs":[{"name":"A","shape":[3],"datatype":"FP32","parameters":{"binary_data_size":8}}]}"#;
        let (body, n2) = binary_body(bad, &[0; 8]);
        let e = parse_infer_request("m", None, body, Some(n2), MAX, None).unwrap_err();
        assert_eq!(e.message, "inputs[0] ('A'): binary_data_size is 8 but shape [3] of FP32 needs 12 bytes");
        // Both data and binary_data_size.
        let both = r#"{"inputs":[{"name":"A","shape":[2],"datatype":"FP32","data":[1,2],"parameters":{"binary_data_size":8}}]}"#;
        let (body, n3) = binary_body(both, &[0; 8]);
        let e = parse_infer_request("m", None, body, Some(n3), MAX, None).unwrap_err();
        assert!(e.message.contains("both"), "{}", e.message);
        // binary_data_size without the header: the binary section is empty.
        let e = parse_infer_request("m", None, Bytes::from_static(json.as_bytes()), None, MAX, None).unwrap_err();
        assert!(e.message.contains("only 0 bytes"), "{}", e.message);
        // BYTES element count not matching the shape.
        let s = serialize_bytes_elements(["a"]);
        let bj = format!(
            r#"{{"inputs":[{{"name":"S","shape":[2],"datatype":"BYTES","parameters":{{"binary_data_size":{}}}}}]}}"#,
            s.len()
        );
        let (body, n4) = binary_body(&bj, &s);
        let e = parse_infer_request("m", None, body, Some(n4), MAX, None).unwrap_err();
        assert!(e.message.contains("expected 2 BYTES elements"), "{}", e.message);
    }

    #[test]
    fn shared_memory_inputs_and_outputs() {
        let obj = crate::shm::testing::TestObject::new("http-infer", 4096);
        obj.write(8, &le(&[1.0f32, 2.0], f32::to_le_bytes));
        obj.write(100, &serialize_bytes_elements(["ab", "c"]));
        let shm = SharedMemory::allowed(1 << 20);
        shm.register("r", &obj.key, 0, 4096).unwrap();
        let with = |json: &str, shm: Option<&SharedMemory>| {
            parse_infer_request("m", None, Bytes::copy_from_slice(json.as_bytes()), None, MAX, shm)
        };

        let json = r#"{"inputs":[
            {"name":"A","datatype":"FP32","shape":[2],"parameters":{"shared_memory_region":"r","shared_memory_offset":8,"shared_memory_byte_size":8}},
            {"name":"S","datatype":"BYTES","shape":[2],"parameters":{"shared_memory_region":"r","shared_memory_offset":100,"shared_memory_byte_size":11}},
            {"name":"B","datatype":"INT32","shape":[1],"data":[7]}],
          "outputs":[{"name":"Y","parameters":{"shared_memory_region":"r","shared_memory_offset":512,"shared_memory_byte_size":64}},
                     {"name":"Z","parameters":{"binary_data":false}}],
          "parameters":{"binary_data_output":true}}"#;
        let ParsedInfer { request, mut format } = with(json, Some(&shm)).unwrap();
        assert_eq!(&request.inputs[0].data[..], &le(&[1.0f32, 2.0], f32::to_le_bytes)[..]);
        assert_eq!(&request.inputs[1].data[..], &serialize_bytes_elements(["ab", "c"])[..]);
        assert_eq!(&request.inputs[2].data[..], &7i32.to_le_bytes()[..]);
        assert_eq!(request.shm_outputs.len(), 1);

        let mut response = InferResponse {
            model_name: "m".into(),
            model_version: 1,
            id: String::new(),
            shm_written: Vec::new(),
            outputs: vec![
                output("Y", DataType::Fp32, vec![2], le(&[3.0f32, 4.0], f32::to_le_bytes)),
                output("Z", DataType::Fp32, vec![1], le(&[5.0f32], f32::to_le_bytes)),
            ],
        };
        format.shm = crate::shm::write_outputs(&mut response.outputs, &request.shm_outputs).unwrap();
        assert_eq!(obj.read(512, 8), le(&[3.0f32, 4.0], f32::to_le_bytes));
        let rendered = render_infer_response(&response, &format).unwrap();
        assert!(!rendered.has_binary, "a shared-memory output never goes in the binary section");
        let v: Value = serde_json::from_slice(&rendered.json).unwrap();
        assert_eq!(
            v["outputs"][0],
            serde_json::json!({"name":"Y","datatype":"FP32","shape":[2],
                "parameters":{"shared_memory_region":"r","shared_memory_byte_size":8}})
        );
        assert_eq!(v["outputs"][1]["data"], serde_json::json!([5.0]));

        for (json, needle) in [
            (
                r#"{"inputs":[{"name":"A","datatype":"FP32","shape":[2],"data":[1,2],"parameters":{"shared_memory_region":"r","shared_memory_byte_size":8}}]}"#,
                "also 'data'",
            ),
            (
                r#"{"inputs":[],"outputs":[{"name":"Y","parameters":{"shared_memory_region":"r","shared_memory_byte_size":8,"binary_data":true}}]}"#,
                "output can't set both 'shared_memory_region' and 'binary_data'",
            ),
            (
                r#"{"inputs":[],"outputs":[{"name":"Y","parameters":{"shared_memory_region":"r","shared_memory_byte_size":8,"classification":2}}]}"#,
                "output can't set both 'shared_memory_region' and 'classification'",
            ),
            (
                r#"{"inputs":[{"name":"A","datatype":"FP32","shape":[2],"parameters":{"shared_memory_region":"r","shared_memory_byte_size":4}}]}"#,
                "shared_memory_byte_size is 4 but shape [2] of FP32 needs 8 bytes",
            ),
            (
                r#"{"inputs":[{"name":"S","datatype":"BYTES","shape":[3],"parameters":{"shared_memory_region":"r","shared_memory_offset":100,"shared_memory_byte_size":11}}]}"#,
                "expected 3 BYTES elements for shape [3], its shared memory holds 2",
            ),
            (
                r#"{"inputs":[{"name":"A","datatype":"FP32","shape":[2],"parameters":{"shared_memory_region":7,"shared_memory_byte_size":8}}]}"#,
                "'shared_memory_region' must be a string",
            ),
            (
                r#"{"inputs":[{"name":"A","datatype":"FP32","shape":[2],"parameters":{"shared_memory_region":"r","shared_memory_byte_size":"8"}}]}"#,
                "'shared_memory_byte_size' must be an integer",
            ),
            (
                r#"{"inputs":[{"name":"A","datatype":"FP32","shape":[1],"data":[1]}],"outputs":[{"name":"Y","parameters":{"shared_memory_region":"r"}}]}"#,
                "outputs[0] ('Y'): parameter 'shared_memory_byte_size' is required",
            ),
        ] {
            let e = with(json, Some(&shm)).unwrap_err();
            assert_eq!(e.code, Code::InvalidArgument, "{}", e.message);
            assert!(e.message.contains(needle), "{needle}: {}", e.message);
        }
        // Where there are no regions (the gateway), shared memory parameters are refused.
        let e = with(json, None).unwrap_err();
        assert!(e.message.contains("system shared memory is not supported here"), "{}", e.message);
    }

    fn output(name: &str, datatype: DataType, shape: Vec<i64>, data: Vec<u8>) -> OutputTensor {
        OutputTensor { name: name.into(), datatype, shape, data: Bytes::from(data) }
    }

    fn sample_response() -> InferResponse {
        InferResponse {
            model_name: "m".into(),
            model_version: 1,
            id: "req-7".into(),
            shm_written: Vec::new(),
            outputs: vec![
                output("F", DataType::Fp32, vec![1, 2], le(&[1.5f32, -2.0], f32::to_le_bytes)),
                output("B", DataType::Bool, vec![2], vec![1, 0]),
                output("S", DataType::Bytes, vec![2], serialize_bytes_elements(["hi", "yo"])),
                output("H", DataType::Fp16, vec![1], half::f16::from_f32(0.5).to_le_bytes().to_vec()),
                output("I", DataType::Int64, vec![1], (-3i64).to_le_bytes().to_vec()),
            ],
        }
    }

    #[test]
    fn renders_json_response() {
        let r = render_infer_response(&sample_response(), &OutputFormat::default()).unwrap();
        assert_eq!(r.header_length(), None);
        assert!(r.binary.is_empty());
        let v: Value = serde_json::from_slice(&r.json).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "id": "req-7", "model_name": "m", "model_version": "1",
                "outputs": [
                    {"name": "F", "datatype": "FP32", "shape": [1, 2], "data": [1.5, -2.0]},
                    {"name": "B", "datatype": "BOOL", "shape": [2], "data": [true, false]},
                    {"name": "S", "datatype": "BYTES", "shape": [2], "data": ["hi", "yo"]},
                    {"name": "H", "datatype": "FP16", "shape": [1], "data": [0.5]},
                    {"name": "I", "datatype": "INT64", "shape": [1], "data": [-3]},
                ]
            })
        );
        // No id in the request: none in the response.
        let mut resp = sample_response();
        resp.id.clear();
        let r = render_infer_response(&resp, &OutputFormat::default()).unwrap();
        let v: Value = serde_json::from_slice(&r.json).unwrap();
        assert!(v.get("id").is_none());
    }

    /// A BYTES output that is not UTF-8 cannot be a JSON string as it is: it comes in the
    /// binary section, byte for byte, instead of altered.
    #[test]
    fn a_bytes_output_that_is_not_text_goes_in_the_binary_section() {
        let mut resp = sample_response();
        let raw = serialize_bytes_elements([&b"ok"[..], &[0xff, 0xfe][..]]);
        resp.outputs[2] = output("S", DataType::Bytes, vec![2], raw.clone());
        let r = render_infer_response(&resp, &OutputFormat::default()).unwrap();
        assert_eq!(r.header_length(), Some(r.json.len()));
        let v: Value = serde_json::from_slice(&r.json).unwrap();
        assert_eq!(v["outputs"][2]["parameters"]["binary_data_size"], raw.len());
        assert!(v["outputs"][2].get("data").is_none());
        assert_eq!(v["outputs"][0]["data"], serde_json::json!([1.5, -2.0]), "the others stay JSON");
        let binary: Vec<u8> = r.binary.iter().flat_map(|b| b.iter().copied()).collect();
        assert_eq!(binary, raw);
    }

    #[test]
    fn renders_binary_response() {
        let resp = sample_response();
        let format = OutputFormat {
            binary_default: false,
            explicit: vec![("F".into(), true), ("S".into(), true)],
            ..Default::default()
        };
        let r = render_infer_response(&resp, &format).unwrap();
        assert_eq!(r.header_length(), Some(r.json.len()));
        let v: Value = serde_json::from_slice(&r.json).unwrap();
        let outs = v["outputs"].as_array().unwrap();
        assert_eq!(outs[0]["parameters"]["binary_data_size"], 8);
        assert!(outs[0].get("data").is_none());
        assert_eq!(outs[1]["data"], serde_json::json!([true, false]));
        assert_eq!(outs[2]["parameters"]["binary_data_size"], resp.outputs[2].data.len());
        let binary: Vec<u8> = r.binary.iter().flat_map(|b| b.iter().copied()).collect();
        let mut want = resp.outputs[0].data.to_vec();
        want.extend_from_slice(&resp.outputs[2].data);
        assert_eq!(binary, want);
        assert_eq!(r.total_len(), r.json.len() + want.len());
        // Shared, not copied.
        assert_eq!(r.binary[0].as_ptr(), resp.outputs[0].data.as_ptr());

        // binary_data_output: every output binary unless it says otherwise.
        let format = OutputFormat { binary_default: true, explicit: vec![("B".into(), false)], ..Default::default() };
        let r = render_infer_response(&resp, &format).unwrap();
        let v: Value = serde_json::from_slice(&r.json).unwrap();
        let outs = v["outputs"].as_array().unwrap();
        assert!(outs[1].get("data").is_some());
        assert_eq!(outs.iter().filter(|o| o.get("parameters").is_some()).count(), 4);
        assert_eq!(r.binary.len(), 4);
    }

    #[test]
    fn round_trip_through_render_and_parse() {
        // What we render as JSON data parses back to the same bytes.
        let resp = sample_response();
        let r = render_infer_response(&resp, &OutputFormat::default()).unwrap();
        let v: Value = serde_json::from_slice(&r.json).unwrap();
        let inputs: Vec<Value> = v["outputs"].as_array().unwrap().clone();
        let req = serde_json::json!({ "inputs": inputs }).to_string();
        let p = parse(&req).unwrap();
        for (i, o) in p.request.inputs.iter().zip(&resp.outputs) {
            assert_eq!(i.data, o.data, "{}", o.name);
        }
    }

    fn non_finite_response() -> InferResponse {
        let f32s = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1.0, -0.5];
        let f64s = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 1.0, -0.5];
        InferResponse {
            model_name: "m".into(),
            model_version: 1,
            id: String::new(),
            shm_written: Vec::new(),
            outputs: vec![
                output("F32", DataType::Fp32, vec![5], le(&f32s, f32::to_le_bytes)),
                output("F64", DataType::Fp64, vec![5], le(&f64s, f64::to_le_bytes)),
                output("F16", DataType::Fp16, vec![5], le(&f32s.map(half::f16::from_f32), half::f16::to_le_bytes)),
                output("BF16", DataType::Bf16, vec![5], le(&f32s.map(half::bf16::from_f32), half::bf16::to_le_bytes)),
                output("S", DataType::Bytes, vec![1], serialize_bytes_elements(["NaN"])),
            ],
        }
    }

    #[test]
    fn renders_non_finite_floats_as_bare_tokens() {
        let r = render_infer_response(&non_finite_response(), &OutputFormat::default()).unwrap();
        let text = std::str::from_utf8(&r.json).unwrap();
        assert_eq!(text.matches(r#""data":[NaN,Infinity,-Infinity,1.0,-0.5]"#).count(), 4, "{text}");
        assert!(text.contains(r#""data":["NaN"]"#), "{text}");
        // Finite floats and other numbers are unchanged.
        let r = render_infer_response(&sample_response(), &OutputFormat::default()).unwrap();
        let text = std::str::from_utf8(&r.json).unwrap();
        assert!(text.contains(r#""data":[1.5,-2.0]"#), "{text}");
    }

    fn assert_same_floats(got: &[u8], want: &[f64], dtype: DataType) {
        let got: Vec<f64> = match dtype {
            DataType::Fp32 => got.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64).collect(),
            DataType::Fp64 => got.chunks_exact(8).map(|c| f64::from_le_bytes(c.try_into().unwrap())).collect(),
            DataType::Fp16 => {
                got.chunks_exact(2).map(|c| half::f16::from_le_bytes(c.try_into().unwrap()).to_f64()).collect()
            }
            DataType::Bf16 => {
                got.chunks_exact(2).map(|c| half::bf16::from_le_bytes(c.try_into().unwrap()).to_f64()).collect()
            }
            _ => unreachable!(),
        };
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert!((g.is_nan() && w.is_nan()) || g == w, "{dtype}: {got:?} != {want:?}");
        }
    }

    #[test]
    fn parses_bare_non_finite_tokens_in_float_data() {
        let want = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 2.0];
        for dtype in ["FP32", "FP64", "FP16", "BF16"] {
            // Flat, nested, and with whitespace as Python's json.dumps writes it.
            for data in ["[NaN, Infinity, -Infinity, 2.0]", "[[NaN,Infinity],[-Infinity,2]]"] {
                let t = one_input(dtype, "[2,2]", data).unwrap();
                let dt = DataType::from_wire_name(dtype).unwrap();
                assert_same_floats(&t.data, &want, dt);
            }
            // data before datatype (the deferred path).
            let json = format!(
                r#"{{"inputs":[{{"name":"x","data":[NaN,Infinity,-Infinity,2.0],"shape":[4],"datatype":"{dtype}"}}]}}"#
            );
            let t = parse(&json).unwrap().request.inputs.remove(0);
            assert_same_floats(&t.data, &want, t.datatype);
        }
        // Strings are left alone, escapes included: a BYTES input whose elements hold the
        // tokens, next to a float input with the bare tokens.
        let json = r#"{"id":"NaN \"Infinity\\","inputs":[
            {"name":"s","datatype":"BYTES","shape":[3],"data":["NaN","a\"-Infinity\\","\\"]},
            {"name":"f","datatype":"FP32","shape":[2],"data":[NaN,-Infinity]}]}"#;
        let p = parse(json).unwrap();
        assert_eq!(p.request.id, "NaN \"Infinity\\");
        assert_eq!(&p.request.inputs[0].data[..], &serialize_bytes_elements(["NaN", "a\"-Infinity\\", "\\"])[..]);
        assert_same_floats(&p.request.inputs[1].data, &[f64::NAN, f64::NEG_INFINITY], DataType::Fp32);
        // Bare tokens in a BYTES tensor are not strings.
        let e = one_input("BYTES", "[1]", "[NaN]").unwrap_err();
        assert!(e.message.starts_with("inputs[0] ('x'): "), "{}", e.message);
        // What we render parses back to the same values.
        let r = render_infer_response(&non_finite_response(), &OutputFormat::default()).unwrap();
        let v = std::str::from_utf8(&r.json).unwrap();
        let req = format!(r#"{{"inputs":{}}}"#, &v[v.find("[{").unwrap()..v.len() - 1]);
        let p = parse(&req).unwrap();
        for (i, o) in p.request.inputs.iter().zip(&non_finite_response().outputs) {
            if o.datatype == DataType::Bytes {
                assert_eq!(i.data, o.data);
            } else {
                assert_same_floats(&i.data, &[f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 1.0, -0.5], o.datatype);
            }
        }
    }

    #[test]
    fn non_finite_tokens_in_integer_data_name_the_input() {
        for (data, token) in [("[1, NaN]", "NaN"), ("[Infinity, 1]", "Infinity"), ("[-Infinity, 1]", "-Infinity")] {
            let e = parse(&format!(
                r#"{{"inputs":[{{"name":"f","datatype":"FP32","shape":[1],"data":[NaN]}},
                    {{"name":"IDX","datatype":"INT32","shape":[2],"data":{data}}}]}}"#
            ))
            .unwrap_err();
            assert_eq!(e.code, Code::InvalidArgument);
            assert!(e.message.starts_with("inputs[1] ('IDX'): data element"), "{}", e.message);
            assert!(e.message.contains("INT32"), "{}", e.message);
            assert!(e.message.contains(&format!("({token})")), "{}", e.message);
        }
        let e = one_input("BOOL", "[1]", "[NaN]").unwrap_err();
        assert!(e.message.starts_with("inputs[0] ('x')"), "{}", e.message);
        // Still malformed JSON: the error says where.
        let e = parse(r#"{"inputs":[{"name":"x","datatype":"FP32","shape":[1],"data":[NaN,]}]}"#).unwrap_err();
        assert!(e.message.contains("malformed inference request JSON"), "{}", e.message);
        // Other non-standard tokens are not accepted.
        let e = one_input("FP32", "[1]", "[nan]").unwrap_err();
        assert!(e.message.contains("malformed"), "{}", e.message);
        let e = one_input("FP32", "[1]", "[+Infinity]").unwrap_err();
        assert!(e.message.contains("malformed"), "{}", e.message);
        // The marker strings themselves mean nothing without the bare tokens.
        let e = one_input("FP32", "[1]", "[\"\u{FDD0}\"]").unwrap_err();
        assert!(e.message.contains("got a string"), "{}", e.message);
        // A bare token where text belongs is not text: refused, not read as a marker.
        for (id, parameters, name) in
            [("NaN", "{}", "\"f\""), ("\"a\"", r#"{NaN: 1}"#, "\"f\""), ("\"a\"", "{}", "Infinity")]
        {
            let e = parse(&format!(
                r#"{{"id":{id},"parameters":{parameters},"inputs":[{{"name":{name},"datatype":"FP32","shape":[1],"data":[NaN]}}]}}"#
            ))
            .unwrap_err();
            assert!(e.message.contains("not names, ids or keys"), "{id} {parameters} {name}: {}", e.message);
        }
        let ok = parse(r#"{"id":"a","inputs":[{"name":"f","datatype":"FP32","shape":[1],"data":[NaN]}]}"#);
        assert!(ok.is_ok(), "{:?}", ok.err());
        // As a parameter's value (Python's json.dumps writes it): a number JSON cannot hold.
        let ok = parse(r#"{"parameters":{"x":NaN},"inputs":[{"name":"f","datatype":"FP32","shape":[1],"data":[1]}]}"#);
        assert!(ok.is_ok(), "{:?}", ok.err());
    }

    #[test]
    fn non_finite_rewrite_skips_strings() {
        let rw = |s: &str| rewrite_non_finite(s.as_bytes()).map(|v| String::from_utf8(v).unwrap());
        assert_eq!(rw(r#"{"a":[1,2]}"#), None);
        assert_eq!(rw(r#"{"a":"NaN Infinity -Infinity"}"#), None);
        assert_eq!(rw(r#"{"a":"\"NaN\\"}"#), None);
        assert_eq!(rw(r#"{"a":"\\"}"#), None);
        assert_eq!(
            rw(r#"{"a\\":[NaN,-Infinity],"b":"\"x","c":Infinity}"#).unwrap(),
            format!(r#"{{"a\\":["{MARK_NAN}","{MARK_NEG_INF}"],"b":"\"x","c":"{MARK_INF}"}}"#)
        );
    }

    #[test]
    fn render_rejects_ragged_data() {
        let resp = InferResponse {
            outputs: vec![output("F", DataType::Fp32, vec![1], vec![0; 5])],
            ..InferResponse::default()
        };
        let e = render_infer_response(&resp, &OutputFormat::default()).unwrap_err();
        assert_eq!(e.code, Code::Internal);
        assert!(e.message.contains("'F'"), "{}", e.message);
    }
}
