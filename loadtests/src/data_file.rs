//! Input data from a JSON file in perf_analyzer's format (`--input-data FILE.json`, or `"data":
//! "FILE.json"` on a workload entry): the exact values each request carries.
//!
//! ```json
//! { "data": [
//!     { "INPUT0": [0.5, 1.5, 2.5, 3.5] },
//!     { "INPUT0": { "content": [1, 2, 3, 4], "shape": [4] } },
//!     { "INPUT0": { "b64": "AACAPwAAAEAAAEBAAACAQA==" } }
//! ] }
//! ```
//!
//! Each element of `data` gives every input of the model for one batch-1 request: a flat array
//! of values (the shape from `shapes` / `--shape` or the model's metadata), an object with
//! `content` and `shape` (the shape without the batch dimension), or `b64`, the raw
//! little-endian bytes (for `BYTES`, each element a 4-byte length then its bytes), optionally
//! with a `shape`. `BYTES` inputs take strings, `BOOL` inputs `true`/`false` (or 0/1).
//!
//! Requests cycle through the entries in order. With a batch size B on a batching model, a
//! request's B rows are B consecutive entries (as perf_analyzer does), so an entry list of N
//! makes N / gcd(N, B) distinct requests.
//!
//! Reading a file checks its structure and base64 ([`DataFile::from_json`]); once the server's
//! metadata is known, [`DataFile::requests`] checks every value against its input (name, count
//! for the shape, datatype range) before the run starts. Errors name the file, the entry
//! (`data[2]`) and the input.

use std::collections::BTreeMap;
use std::fmt;

use base64::Engine;
use nereid_common::dtype::DataType;
use serde_json::Value;

use crate::workload::{Entry, InputTensor, MAX_INPUT_BYTES, ModelInfo, TensorSpec, WorkloadError};

/// Most entries a data file may hold.
pub const MAX_DATA_ENTRIES: usize = 10_000;

/// A parsed input data file: per entry, per input name, the values as given.
#[derive(Clone, PartialEq)]
pub struct DataFile {
    /// As given, for messages.
    pub path: String,
    pub entries: Vec<BTreeMap<String, DataValue>>,
    /// `validation_data`: the outputs expected for each entry of `data` (same length), by
    /// output name; empty when the file has none.
    pub validation: Vec<BTreeMap<String, DataValue>>,
}

impl fmt::Debug for DataFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DataFile").field("path", &self.path).field("entries", &self.entries.len()).finish()
    }
}

/// One input's values in one entry.
#[derive(Clone, Debug, PartialEq)]
pub struct DataValue {
    pub values: Values,
    /// Dims without the batch dimension, when the file gives them.
    pub shape: Option<Vec<i64>>,
}

/// Values as written in the file.
#[derive(Clone, Debug, PartialEq)]
pub enum Values {
    /// A flat array of JSON scalars, converted to the input's datatype once it is known.
    Json(Vec<Value>),
    /// Raw bytes from `b64`.
    Raw(Vec<u8>),
}

/// The tensors of one distinct request, and which entries they came from (for messages).
#[derive(Clone, Debug, PartialEq)]
pub struct DataRequest {
    /// `data[3]`, or `data[3]+data[4]` for a batched request's rows.
    pub source: String,
    pub inputs: Vec<InputTensor>,
    /// From `validation_data`: what the server must answer, per output (rows in order).
    pub expected: Vec<ExpectedOutput>,
}

/// One output a request must produce: its bytes as the server sends them (row-major,
/// little-endian; `BYTES` elements length-prefixed).
#[derive(Clone, Debug, PartialEq)]
pub struct ExpectedOutput {
    pub name: String,
    pub datatype: DataType,
    pub data: Vec<u8>,
    /// `validation_data[3]+validation_data[4]`, for messages.
    pub source: String,
}

impl DataFile {
    /// Reads and checks a file's structure. `path` is only used in messages.
    pub fn from_json(path: &str, text: &str) -> Result<DataFile, WorkloadError> {
        let fail = |msg: String| WorkloadError(format!("input data file {path}: {msg}"));
        let root: Value = serde_json::from_str(text).map_err(|e| fail(e.to_string()))?;
        let Value::Object(root) = root else {
            return Err(fail("expected an object with a \"data\" array".into()));
        };
        for key in root.keys() {
            match key.as_str() {
                "data" | "validation_data" => {}
                other => return Err(fail(format!("unknown key `{other}`, expected `data` or `validation_data`"))),
            }
        }
        let Some(data) = root.get("data") else {
            return Err(fail("missing key `data`".into()));
        };
        let Value::Array(list) = data else {
            return Err(fail("data: expected an array of entries, one per request".into()));
        };
        if list.is_empty() {
            return Err(fail("data: must list at least one entry".into()));
        }
        if list.len() > MAX_DATA_ENTRIES {
            return Err(fail(format!("data: at most {MAX_DATA_ENTRIES} entries, got {}", list.len())));
        }
        let entries = parse_entries(list, "data", "input").map_err(fail)?;
        let validation = match root.get("validation_data") {
            None => Vec::new(),
            Some(Value::Array(list)) => {
                if list.len() != entries.len() {
                    return Err(fail(format!(
                        "validation_data: {} entries, but data has {}; give the expected outputs of every entry",
                        list.len(),
                        entries.len()
                    )));
                }
                let validation = parse_entries(list, "validation_data", "output").map_err(fail)?;
                let first: Vec<&String> = validation[0].keys().collect();
                if let Some((i, e)) = validation.iter().enumerate().find(|(_, e)| e.keys().collect::<Vec<_>>() != first)
                {
                    return Err(fail(format!(
                        "validation_data[{i}]: gives outputs {:?} but validation_data[0] gives {first:?}; every \
                         entry must give the same outputs",
                        e.keys().collect::<Vec<_>>()
                    )));
                }
                validation
            }
            Some(_) => return Err(fail("validation_data: expected an array of entries, one per data entry".into())),
        };
        Ok(DataFile { path: path.to_string(), entries, validation })
    }

    /// The distinct requests of `entry` for `model`: every entry's inputs checked against the
    /// model and converted to its datatypes, rows grouped by the entry's batch size.
    pub fn requests(&self, entry: &Entry, model: &ModelInfo) -> Result<Vec<DataRequest>, WorkloadError> {
        let fail = |msg: String| WorkloadError(format!("input data file {}: {msg}", self.path));
        let mut specs = Vec::with_capacity(model.inputs.len());
        for input in &model.inputs {
            let dtype = DataType::from_wire_name(&input.datatype).ok_or_else(|| {
                fail(format!(
                    "model '{}' input '{}' has datatype '{}', which the generator does not know",
                    model.name, input.name, input.datatype
                ))
            })?;
            specs.push((input, dtype));
        }
        let known = || model.inputs.iter().map(|i| i.name.as_str()).collect::<Vec<_>>().join(", ");

        // Every entry's rows: per input, (dims, bytes).
        let mut rows: Vec<Vec<(Vec<i64>, Vec<u8>)>> = Vec::with_capacity(self.entries.len());
        for (i, given) in self.entries.iter().enumerate() {
            if let Some(name) = given.keys().find(|n| !model.inputs.iter().any(|m| &m.name == *n)) {
                return Err(fail(format!(
                    "data[{i}].{name}: model '{}' has no input '{name}' (inputs: {})",
                    model.name,
                    known()
                )));
            }
            let mut row = Vec::with_capacity(specs.len());
            for (input, dtype) in &specs {
                let Some(value) = given.get(&input.name) else {
                    return Err(fail(format!(
                        "data[{i}]: input '{}' of model '{}' is missing (every entry gives every input: {})",
                        input.name,
                        model.name,
                        known()
                    )));
                };
                let at = |msg: String| fail(format!("data[{i}].{}: {msg}", input.name));
                let dims = row_dims(entry, model, input, value.shape.as_deref()).map_err(at)?;
                let bytes = encode(*dtype, &dims, &value.values).map_err(at)?;
                row.push((dims, bytes));
            }
            rows.push(row);
        }

        let batch = if model.max_batch_size > 0 { entry.batch_size.max(1) as usize } else { 1 };
        let n = rows.len();
        let distinct = n / gcd(n, batch);
        let mut out = Vec::with_capacity(distinct);
        let mut total_bytes = 0u64;
        for k in 0..distinct {
            let members: Vec<usize> = (0..batch).map(|j| (k * batch + j) % n).collect();
            let source = members.iter().map(|m| format!("data[{m}]")).collect::<Vec<_>>().join("+");
            let mut inputs = Vec::with_capacity(specs.len());
            for (slot, (input, dtype)) in specs.iter().enumerate() {
                let first = &rows[members[0]][slot].0;
                let mut data = Vec::new();
                for m in &members {
                    let (dims, bytes) = &rows[*m][slot];
                    if dims != first {
                        return Err(fail(format!(
                            "data[{}].{name} has shape {first:?} but data[{m}].{name} has {dims:?}; the rows \
                             of one batched request (batch size {batch}) must agree",
                            members[0],
                            name = input.name
                        )));
                    }
                    data.extend_from_slice(bytes);
                }
                total_bytes = total_bytes.saturating_add(data.len() as u64);
                if total_bytes > MAX_INPUT_BYTES {
                    return Err(fail(format!(
                        "the requests need more than the generator's limit of {MAX_INPUT_BYTES} bytes of inputs"
                    )));
                }
                let mut shape = Vec::with_capacity(first.len() + 1);
                if model.max_batch_size > 0 {
                    shape.push(batch as i64);
                }
                shape.extend_from_slice(first);
                inputs.push(InputTensor { name: input.name.clone(), datatype: *dtype, shape, data });
            }
            let expected = self.expected_outputs(model, &members).map_err(fail)?;
            out.push(DataRequest { source, inputs, expected });
        }
        Ok(out)
    }

    /// The outputs `validation_data` gives for the rows `members`, concatenated in order.
    fn expected_outputs(&self, model: &ModelInfo, members: &[usize]) -> Result<Vec<ExpectedOutput>, String> {
        let Some(first) = self.validation.first() else { return Ok(Vec::new()) };
        let source = members.iter().map(|m| format!("validation_data[{m}]")).collect::<Vec<_>>().join("+");
        let mut out = Vec::with_capacity(first.len());
        for name in first.keys() {
            let Some(spec) = model.outputs.iter().find(|o| &o.name == name) else {
                return Err(format!(
                    "validation_data[0].{name}: model '{}' has no output '{name}' (outputs: {})",
                    model.name,
                    model.outputs.iter().map(|o| o.name.as_str()).collect::<Vec<_>>().join(", ")
                ));
            };
            let dtype = DataType::from_wire_name(&spec.datatype).ok_or_else(|| {
                format!(
                    "model '{}' output '{name}' has datatype '{}', which nereid-perf does not know",
                    model.name, spec.datatype
                )
            })?;
            let mut data = Vec::new();
            for &m in members {
                let value = &self.validation[m][name];
                // The expected values define the element count; a given shape must agree with it.
                let dims = match (&value.shape, &value.values) {
                    (Some(shape), _) => shape.clone(),
                    (None, Values::Json(items)) => vec![items.len() as i64],
                    (None, Values::Raw(bytes)) => match dtype.element_size() {
                        Some(width) => vec![(bytes.len() / width) as i64],
                        None => vec![bytes_elements(bytes).unwrap_or(0) as i64],
                    },
                };
                data.extend(
                    encode(dtype, &dims, &value.values).map_err(|e| format!("validation_data[{m}].{name}: {e}"))?,
                );
            }
            out.push(ExpectedOutput { name: name.clone(), datatype: dtype, data, source: source.clone() });
        }
        Ok(out)
    }
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 { a.max(1) } else { gcd(b, a % b) }
}

/// The entries of `data` or `validation_data` (`key`, in messages): objects mapping tensor
/// names (`what`: input or output) to values.
fn parse_entries(list: &[Value], key: &str, what: &str) -> Result<Vec<BTreeMap<String, DataValue>>, String> {
    let mut entries = Vec::with_capacity(list.len());
    for (i, item) in list.iter().enumerate() {
        let map = match item {
            Value::Object(m) => m,
            Value::Array(_) => {
                return Err(format!(
                    "{key}[{i}]: nested arrays (streams, for sequence models) are not supported; \
                     list one object per request"
                ));
            }
            _ => return Err(format!("{key}[{i}]: expected an object mapping {what} names to values")),
        };
        if map.is_empty() {
            return Err(format!("{key}[{i}]: no {what}s given"));
        }
        let mut values = BTreeMap::new();
        for (name, v) in map {
            let value = parse_value(v).map_err(|e| format!("{key}[{i}].{name}{e}"))?;
            values.insert(name.clone(), value);
        }
        entries.push(values);
    }
    Ok(entries)
}

/// One input's value: a flat array, `{content, shape}` or `{b64[, shape]}`. Errors start with
/// the key below the input (`.shape: ...`) or `: `.
fn parse_value(v: &Value) -> Result<DataValue, String> {
    match v {
        Value::Array(items) => Ok(DataValue { values: Values::Json(flat(items)?), shape: None }),
        Value::Object(m) => {
            for key in m.keys() {
                if !matches!(key.as_str(), "content" | "shape" | "b64") {
                    return Err(format!(": unknown key `{key}`, expected `content`, `b64` or `shape`"));
                }
            }
            let shape = match m.get("shape") {
                None => None,
                Some(Value::Array(dims)) => {
                    Some(dims.iter().map(|d| d.as_i64().filter(|d| *d >= 0)).collect::<Option<Vec<i64>>>().ok_or_else(
                        || format!(".shape: dims must be non-negative integers, got {}", Value::from(dims.clone())),
                    )?)
                }
                Some(other) => return Err(format!(".shape: expected an array of dims, got {other}")),
            };
            let values = match (m.get("content"), m.get("b64")) {
                (Some(_), Some(_)) => return Err(": give either `content` or `b64`, not both".into()),
                (Some(Value::Array(items)), None) => {
                    if shape.is_none() {
                        return Err(": `content` needs a `shape` (or give the values as a plain array)".into());
                    }
                    Values::Json(flat(items).map_err(|e| format!(".content{e}"))?)
                }
                (Some(_), None) => return Err(".content: expected a flat array of values".into()),
                (None, Some(Value::String(s))) => Values::Raw(
                    base64::engine::general_purpose::STANDARD
                        .decode(s.trim())
                        .map_err(|e| format!(".b64: not valid base64: {e}"))?,
                ),
                (None, Some(_)) => return Err(".b64: expected a base64 string".into()),
                (None, None) => return Err(": expected `content` (with `shape`) or `b64`".into()),
            };
            Ok(DataValue { values, shape })
        }
        _ => Err(format!(": expected an array of values, or an object with `content` and `shape` or `b64`; got {v}")),
    }
}

/// The values of a flat array; nested arrays and objects are refused.
fn flat(items: &[Value]) -> Result<Vec<Value>, String> {
    if let Some((j, v)) = items.iter().enumerate().find(|(_, v)| v.is_array() || v.is_object() || v.is_null()) {
        return Err(format!("[{j}]: values must be a flat array of numbers, booleans or strings, got {v}"));
    }
    Ok(items.to_vec())
}

/// The non-batch dims of `input` in one entry: the file's `shape` (checked against the model),
/// else the entry's `shapes` / `--shape`, else the model's (which must be concrete).
fn row_dims(entry: &Entry, model: &ModelInfo, input: &TensorSpec, given: Option<&[i64]>) -> Result<Vec<i64>, String> {
    let model_dims: &[i64] = if model.max_batch_size > 0 { input.shape.get(1..).unwrap_or(&[]) } else { &input.shape };
    let dims = match given.map(<[i64]>::to_vec).or_else(|| entry.shapes.get(&input.name).cloned()) {
        Some(dims) => dims,
        None if model_dims.iter().any(|d| *d < 0) => {
            return Err(format!(
                "the input has variable dims {model_dims:?}; give a \"shape\" with the values, --shape {}:<d1,d2,...> \
                 or \"shapes\" in the workload file",
                input.name
            ));
        }
        None => return Ok(model_dims.to_vec()),
    };
    let fits = dims.len() == model_dims.len() && dims.iter().zip(model_dims).all(|(d, m)| *m < 0 || d == m);
    if !fits {
        return Err(format!(
            "shape {dims:?} does not fit the model's dims {model_dims:?} (without the batch dimension)"
        ));
    }
    Ok(dims)
}

/// Row-major little-endian bytes of `values` for `dims` elements of `dtype`.
fn encode(dtype: DataType, dims: &[i64], values: &Values) -> Result<Vec<u8>, String> {
    let count = nereid_common::dtype::element_count(dims).ok_or_else(|| format!("shape {dims:?} is too large"))?;
    if count > MAX_INPUT_BYTES {
        return Err(format!("shape {dims:?} has more elements than the generator's limit"));
    }
    let count = count as usize;
    match values {
        Values::Json(items) => {
            if items.len() != count {
                return Err(format!("{} values given, but shape {dims:?} needs {count}", items.len()));
            }
            let mut out = Vec::with_capacity(count * dtype.element_size().unwrap_or(8));
            for (j, v) in items.iter().enumerate() {
                push_value(dtype, v, &mut out).map_err(|e| format!("value [{j}] {v}: {e}"))?;
            }
            Ok(out)
        }
        Values::Raw(bytes) => match dtype.element_size() {
            Some(width) => {
                if bytes.len() != count * width {
                    return Err(format!(
                        "b64 holds {} bytes, but shape {dims:?} of {} needs {} ({count} × {width})",
                        bytes.len(),
                        dtype.wire_name(),
                        count * width
                    ));
                }
                Ok(bytes.clone())
            }
            None => {
                let elements = bytes_elements(bytes)
                    .ok_or("b64 is not a BYTES tensor (each element a 4-byte little-endian length, then its bytes)")?;
                if elements != count {
                    return Err(format!("b64 holds {elements} BYTES elements, but shape {dims:?} needs {count}"));
                }
                Ok(bytes.clone())
            }
        },
    }
}

/// How many length-prefixed elements `raw` holds exactly, or `None` if it does not parse.
fn bytes_elements(mut raw: &[u8]) -> Option<usize> {
    let mut n = 0;
    while !raw.is_empty() {
        let len = u32::from_le_bytes(raw.get(..4)?.try_into().ok()?) as usize;
        raw = raw.get(4 + len..)?;
        n += 1;
    }
    Some(n)
}

/// Appends one JSON scalar as an element of `dtype`, or says why it does not fit.
pub(crate) fn push_value(dtype: DataType, v: &Value, out: &mut Vec<u8>) -> Result<(), String> {
    fn int<T: TryFrom<i128>>(v: &Value, name: &str) -> Result<T, String> {
        let n: i128 = if let Some(i) = v.as_i64() {
            i as i128
        } else if let Some(u) = v.as_u64() {
            u as i128
        } else if let Some(f) = v.as_f64() {
            if f.fract() != 0.0 || !f.is_finite() || f.abs() > 1.9e19 {
                return Err(format!("not an integer, as {name} needs"));
            }
            f as i128
        } else {
            return Err(format!("{name} takes numbers"));
        };
        T::try_from(n).map_err(|_| format!("out of the range of {name}"))
    }
    let float = |v: &Value, name: &str| v.as_f64().ok_or_else(|| format!("{name} takes numbers"));
    let finite = |ok: bool, name: &str| if ok { Ok(()) } else { Err(format!("out of the range of {name}")) };
    let name = dtype.wire_name();
    match dtype {
        DataType::Bool => match v {
            Value::Bool(b) => out.push(*b as u8),
            Value::Number(n) if matches!(n.as_u64(), Some(0 | 1)) => out.push(n.as_u64().unwrap_or(0) as u8),
            _ => return Err("BOOL takes true or false (or 0 or 1)".into()),
        },
        DataType::Uint8 => out.push(int::<u8>(v, name)?),
        DataType::Int8 => out.extend_from_slice(&int::<i8>(v, name)?.to_le_bytes()),
        DataType::Uint16 => out.extend_from_slice(&int::<u16>(v, name)?.to_le_bytes()),
        DataType::Int16 => out.extend_from_slice(&int::<i16>(v, name)?.to_le_bytes()),
        DataType::Uint32 => out.extend_from_slice(&int::<u32>(v, name)?.to_le_bytes()),
        DataType::Int32 => out.extend_from_slice(&int::<i32>(v, name)?.to_le_bytes()),
        DataType::Uint64 => out.extend_from_slice(&int::<u64>(v, name)?.to_le_bytes()),
        DataType::Int64 => out.extend_from_slice(&int::<i64>(v, name)?.to_le_bytes()),
        DataType::Fp64 => out.extend_from_slice(&float(v, name)?.to_le_bytes()),
        DataType::Fp32 => {
            let f = float(v, name)? as f32;
            finite(f.is_finite(), name)?;
            out.extend_from_slice(&f.to_le_bytes());
        }
        DataType::Fp16 => {
            let h = half::f16::from_f64(float(v, name)?);
            finite(h.is_finite(), name)?;
            out.extend_from_slice(&h.to_bits().to_le_bytes());
        }
        DataType::Bf16 => {
            let h = half::bf16::from_f64(float(v, name)?);
            finite(h.is_finite(), name)?;
            out.extend_from_slice(&h.to_bits().to_le_bytes());
        }
        DataType::Bytes => {
            let Value::String(s) = v else {
                return Err("BYTES takes strings".into());
            };
            let len = u32::try_from(s.len()).map_err(|_| "string too long".to_string())?;
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(s.as_bytes());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(max_batch_size: u32, inputs: &[(&str, &str, &[i64])]) -> ModelInfo {
        ModelInfo {
            name: "m".into(),
            versions: vec!["1".into()],
            max_batch_size,
            inputs: inputs
                .iter()
                .map(|(n, d, s)| TensorSpec { name: (*n).into(), datatype: (*d).into(), shape: s.to_vec() })
                .collect(),
            outputs: vec![],
        }
    }

    fn identity() -> ModelInfo {
        model(64, &[("INPUT0", "FP32", &[-1, 4])])
    }

    fn f32s(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|f| f.to_le_bytes()).collect()
    }

    fn parse(text: &str) -> Result<DataFile, String> {
        DataFile::from_json("d.json", text).map_err(|e| e.0)
    }

    fn requests(text: &str, entry: &Entry, m: &ModelInfo) -> Result<Vec<DataRequest>, String> {
        parse(text)?.requests(entry, m).map_err(|e| e.0)
    }

    #[test]
    fn the_three_forms_give_the_same_bytes() {
        let b64 = base64::engine::general_purpose::STANDARD.encode(f32s(&[0.5, -1.0, 2.25, 1e-3]));
        let text = format!(
            r#"{{"data": [
                {{"INPUT0": [0.5, -1, 2.25, 0.001]}},
                {{"INPUT0": {{"content": [0.5, -1, 2.25, 0.001], "shape": [4]}}}},
                {{"INPUT0": {{"b64": "{b64}"}}}}
            ]}}"#
        );
        let r = requests(&text, &Entry::for_model("m"), &identity()).unwrap();
        assert_eq!(r.len(), 3, "one request per entry at batch size 1");
        for (k, req) in r.iter().enumerate() {
            assert_eq!(req.source, format!("data[{k}]"));
            assert_eq!(req.inputs[0].shape, vec![1, 4]);
            assert_eq!(req.inputs[0].datatype, DataType::Fp32);
            assert_eq!(req.inputs[0].data, f32s(&[0.5, -1.0, 2.25, 1e-3]));
        }
    }

    #[test]
    fn batched_requests_take_consecutive_entries_as_rows() {
        let m = model(8, &[("X", "INT32", &[-1, 2])]);
        let text = r#"{"data": [{"X": [1, 2]}, {"X": [3, 4]}, {"X": [5, 6]}]}"#;
        let mut e = Entry::for_model("m");
        e.batch_size = 2;
        let r = requests(text, &e, &m).unwrap();
        let rows = |r: &DataRequest| -> Vec<i32> {
            r.inputs[0].data.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().unwrap())).collect()
        };
        assert_eq!(r.len(), 3, "3 entries at batch 2 cycle through 3 distinct requests");
        assert_eq!(r[0].inputs[0].shape, vec![2, 2]);
        assert_eq!(rows(&r[0]), vec![1, 2, 3, 4]);
        assert_eq!(rows(&r[1]), vec![5, 6, 1, 2]);
        assert_eq!(rows(&r[2]), vec![3, 4, 5, 6]);
        assert_eq!(r[1].source, "data[2]+data[0]");
        e.batch_size = 3;
        assert_eq!(requests(text, &e, &m).unwrap().len(), 1);

        // A model without batching: the shape is the whole shape, one entry per request.
        let nb = model(0, &[("X", "INT32", &[2])]);
        let r = requests(text, &Entry::for_model("m"), &nb).unwrap();
        assert_eq!((r.len(), r[0].inputs[0].shape.clone()), (3, vec![2]));
    }

    #[test]
    fn variable_dims_come_from_the_file_or_the_flags() {
        let m = model(0, &[("S", "BYTES", &[-1])]);
        let text =
            r#"{"data": [{"S": {"content": ["ab", "", "ü"], "shape": [3]}}, {"S": {"content": ["x"], "shape": [1]}}]}"#;
        let r = requests(text, &Entry::for_model("m"), &m).unwrap();
        assert_eq!(r[0].inputs[0].shape, vec![3]);
        let mut want = 2u32.to_le_bytes().to_vec();
        want.extend_from_slice(b"ab");
        want.extend_from_slice(&0u32.to_le_bytes());
        want.extend_from_slice(&2u32.to_le_bytes());
        want.extend_from_slice("ü".as_bytes());
        assert_eq!(r[0].inputs[0].data, want);
        assert_eq!(r[1].inputs[0].shape, vec![1]);

        let flat = r#"{"data": [{"S": ["a", "b"]}]}"#;
        let err = requests(flat, &Entry::for_model("m"), &m).unwrap_err();
        assert!(err.contains("data[0].S") && err.contains("variable dims") && err.contains("--shape S:"), "{err}");
        let mut e = Entry::for_model("m");
        e.shapes.insert("S".into(), vec![2]);
        assert_eq!(requests(flat, &e, &m).unwrap()[0].inputs[0].shape, vec![2]);

        // Rows of one batched request must share a shape; the rank is checked.
        let mut e = Entry::for_model("m");
        e.batch_size = 2;
        let err = requests(text, &e, &model(4, &[("S", "BYTES", &[-1, -1])])).unwrap_err();
        assert!(err.contains("data[0].S has shape [3] but data[1].S has [1]") && err.contains("batch size 2"), "{err}");
        let err = requests(text, &e, &model(4, &[("S", "BYTES", &[-1, -1, -1])])).unwrap_err();
        assert!(err.contains("data[0].S") && err.contains("does not fit"), "{err}");
    }

    #[test]
    fn every_datatype_converts_and_checks_its_range() {
        let one = |dtype: &str, v: &str| -> Result<Vec<u8>, String> {
            let m = model(0, &[("X", dtype, &[1])]);
            requests(&format!(r#"{{"data": [{{"X": [{v}]}}]}}"#), &Entry::for_model("m"), &m)
                .map(|r| r[0].inputs[0].data.clone())
        };
        assert_eq!(one("BOOL", "true").unwrap(), vec![1]);
        assert_eq!(one("BOOL", "0").unwrap(), vec![0]);
        assert_eq!(one("UINT8", "255").unwrap(), vec![255]);
        assert_eq!(one("INT8", "-128").unwrap(), vec![0x80]);
        assert_eq!(one("UINT16", "65535").unwrap(), vec![0xff, 0xff]);
        assert_eq!(one("INT16", "-2").unwrap(), (-2i16).to_le_bytes());
        assert_eq!(one("UINT32", "4294967295").unwrap(), u32::MAX.to_le_bytes());
        assert_eq!(one("INT32", "7.0").unwrap(), 7i32.to_le_bytes(), "an integral float is an integer");
        assert_eq!(one("UINT64", "18446744073709551615").unwrap(), u64::MAX.to_le_bytes());
        assert_eq!(one("INT64", "-9223372036854775808").unwrap(), i64::MIN.to_le_bytes());
        assert_eq!(one("FP64", "0.1").unwrap(), 0.1f64.to_le_bytes());
        assert_eq!(one("FP32", "0.1").unwrap(), 0.1f32.to_le_bytes());
        assert_eq!(one("FP16", "1.5").unwrap(), 0x3e00u16.to_le_bytes());
        assert_eq!(one("BF16", "1.5").unwrap(), 0x3fc0u16.to_le_bytes());
        assert_eq!(one("BYTES", r#""hi""#).unwrap(), [&2u32.to_le_bytes()[..], b"hi"].concat());

        let err = |dtype: &str, v: &str, want: &str| {
            let e = one(dtype, v).unwrap_err();
            assert!(e.contains("data[0].X: value [0]") && e.contains(want), "{dtype} {v}: {e}");
        };
        err("UINT8", "256", "out of the range of UINT8");
        err("UINT8", "-1", "out of the range of UINT8");
        err("INT8", "128", "out of the range of INT8");
        err("UINT64", "-1", "out of the range of UINT64");
        err("INT32", "1.5", "not an integer");
        err("INT32", r#""3""#, "INT32 takes numbers");
        err("FP32", "1e39", "out of the range of FP32");
        err("FP16", "70000", "out of the range of FP16");
        err("BF16", "1e39", "out of the range of BF16");
        err("FP32", "true", "FP32 takes numbers");
        err("BOOL", "2", "BOOL takes true or false");
        err("BYTES", "1", "BYTES takes strings");
    }

    #[test]
    fn model_mismatches_name_the_entry_and_the_input() {
        let m = model(64, &[("A", "FP32", &[-1, 2]), ("B", "INT64", &[-1, 1])]);
        let e = Entry::for_model("m");
        let r = |text: &str| requests(text, &e, &m).unwrap_err();

        let unknown = r(r#"{"data": [{"A": [1, 2], "B": [1]}, {"A": [1, 2], "B": [1], "C": [0]}]}"#);
        assert!(
            unknown.contains("data[1].C") && unknown.contains("no input 'C'") && unknown.contains("A, B"),
            "{unknown}"
        );
        let missing = r(r#"{"data": [{"A": [1, 2], "B": [1]}, {"A": [1, 2]}]}"#);
        assert!(
            missing.contains("data[1]") && missing.contains("input 'B'") && missing.contains("missing"),
            "{missing}"
        );
        let count = r(r#"{"data": [{"A": [1, 2, 3], "B": [1]}]}"#);
        assert!(count.contains("data[0].A: 3 values given, but shape [2] needs 2"), "{count}");
        let shape = r(r#"{"data": [{"A": {"content": [1, 2, 3], "shape": [3]}, "B": [1]}]}"#);
        assert!(shape.contains("data[0].A") && shape.contains("does not fit the model's dims [2]"), "{shape}");
        let content = r(r#"{"data": [{"A": {"content": [1, 2, 3], "shape": [2]}, "B": [1]}]}"#);
        assert!(content.contains("data[0].A: 3 values given, but shape [2] needs 2"), "{content}");
        let raw = r(r#"{"data": [{"A": {"b64": "AAAAAA=="}, "B": [1]}]}"#);
        assert!(raw.contains("data[0].A: b64 holds 4 bytes, but shape [2] of FP32 needs 8"), "{raw}");
        let value = r(r#"{"data": [{"A": [1, 2], "B": [0.5]}]}"#);
        assert!(value.contains("data[0].B: value [0] 0.5: not an integer"), "{value}");
        assert!(requests(r#"{"data": [{"A": [1, 2], "B": [1]}]}"#, &e, &m).is_ok());

        let s = model(0, &[("S", "BYTES", &[2])]);
        let two = [&1u32.to_le_bytes()[..], b"a", &0u32.to_le_bytes()[..]].concat();
        let b64 = |raw: &[u8]| base64::engine::general_purpose::STANDARD.encode(raw);
        let ok = format!(r#"{{"data": [{{"S": {{"b64": "{}"}}}}]}}"#, b64(&two));
        assert_eq!(requests(&ok, &e, &s).unwrap()[0].inputs[0].data, two);
        let short = format!(r#"{{"data": [{{"S": {{"b64": "{}"}}}}]}}"#, b64(&two[..5]));
        assert!(requests(&short, &e, &s).unwrap_err().contains("b64 holds 1 BYTES elements"));
        let torn = format!(r#"{{"data": [{{"S": {{"b64": "{}"}}}}]}}"#, b64(&two[..7]));
        assert!(requests(&torn, &e, &s).unwrap_err().contains("not a BYTES tensor"));
    }

    #[test]
    fn structure_errors_name_the_key() {
        let e = |text: &str| parse(text).unwrap_err();
        assert!(e("{").contains("d.json") && e("{").contains("EOF"));
        assert!(e("[]").contains("expected an object"));
        assert!(e(r#"{}"#).contains("missing key `data`"));
        assert!(e(r#"{"data": {}}"#).contains("data: expected an array"));
        assert!(e(r#"{"data": []}"#).contains("at least one entry"));
        assert!(e(r#"{"data": [{"X": [1]}], "extra": 1}"#).contains("unknown key `extra`"));
        assert!(
            e(r#"{"data": [{"X": [1]}], "validation_data": []}"#)
                .contains("validation_data: 0 entries, but data has 1")
        );
        assert!(e(r#"{"data": [{"X": [1]}], "validation_data": {}}"#).contains("validation_data: expected an array"));
        assert!(
            e(r#"{"data": [{"X": [1]}], "validation_data": [{}]}"#).contains("validation_data[0]: no outputs given")
        );
        assert!(
            e(r#"{"data": [{"X": [1]}, {"X": [2]}], "validation_data": [{"Y": [1]}, {"Z": [2]}]}"#)
                .contains("validation_data[1]: gives outputs [\"Z\"] but validation_data[0] gives [\"Y\"]")
        );
        assert!(e(r#"{"data": [{"X": [1]}], "validation_data": [{"Y": [[1]]}]}"#).contains("validation_data[0].Y[0]"));
        assert!(e(r#"{"data": [[{"X": [1]}]]}"#).contains("data[0]: nested arrays"));
        assert!(e(r#"{"data": [1]}"#).contains("data[0]: expected an object"));
        assert!(e(r#"{"data": [{}]}"#).contains("data[0]: no inputs"));
        assert!(e(r#"{"data": [{"X": [1]}, {"X": 5}]}"#).contains("data[1].X: expected an array of values"));
        assert!(e(r#"{"data": [{"X": [[1, 2]]}]}"#).contains("data[0].X[0]: values must be a flat array"));
        assert!(e(r#"{"data": [{"X": [null]}]}"#).contains("data[0].X[0]"));
        assert!(e(r#"{"data": [{"X": {"content": [1]}}]}"#).contains("data[0].X: `content` needs a `shape`"));
        assert!(e(r#"{"data": [{"X": {"content": 1, "shape": [1]}}]}"#).contains("data[0].X.content"));
        assert!(e(r#"{"data": [{"X": {"content": [[1]], "shape": [1]}}]}"#).contains("data[0].X.content[0]"));
        assert!(e(r#"{"data": [{"X": {"content": [1], "shape": [-1]}}]}"#).contains("data[0].X.shape"));
        assert!(e(r#"{"data": [{"X": {"content": [1], "shape": 1}}]}"#).contains("data[0].X.shape"));
        assert!(e(r#"{"data": [{"X": {"b64": "AA==", "content": [1]}}]}"#).contains("not both"));
        assert!(e(r#"{"data": [{"X": {"b64": 1}}]}"#).contains("data[0].X.b64: expected a base64 string"));
        assert!(e(r#"{"data": [{"X": {"b64": "not base64!"}}]}"#).contains("data[0].X.b64: not valid base64"));
        assert!(e(r#"{"data": [{"X": {"shape": [1]}}]}"#).contains("data[0].X: expected `content`"));
        assert!(e(r#"{"data": [{"X": {"contents": [1]}}]}"#).contains("unknown key `contents`"));
        let many = format!(r#"{{"data": [{}]}}"#, vec![r#"{"X": [1]}"#; MAX_DATA_ENTRIES + 1].join(","));
        assert!(e(&many).contains("at most"));
    }
}
