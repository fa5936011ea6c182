//! Checks one request against its model's configuration before it is queued: names, data
//! types, shapes (with the batch dimension), byte sizes, requested outputs. Every error names
//! the field. Produces the scheduler's [`Job`] parts: inputs in model order and the shape key.

use std::collections::HashSet;

use bytes::Bytes;
use nereid_common::{DataType, Status, dtype};

use crate::backend::TensorSpec;
use crate::tensor::{InferRequest, check_onnx_strings};

/// A model version's tensors as requests must match them.
#[derive(Clone, Debug)]
pub struct ModelSpec {
    /// 0 = the model does not batch; shapes are the full dims.
    pub max_batch_size: usize,
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<TensorSpec>,
}

/// A request that passed validation, in scheduler terms.
#[derive(Debug)]
pub struct Validated {
    pub rows: usize,
    pub shape_key: Vec<i64>,
    /// One entry per model input, in the spec's order; `None` for an optional input the
    /// request left out.
    pub inputs: Vec<Option<(Vec<i64>, Bytes)>>,
    pub wanted: Vec<bool>,
}

pub fn validate(spec: &ModelSpec, request: &mut InferRequest) -> Result<Validated, Status> {
    let model = &request.model_name;
    let mut slots: Vec<Option<(Vec<i64>, Bytes)>> = vec![None; spec.inputs.len()];
    let mut rows: Option<usize> = None;
    for input in std::mem::take(&mut request.inputs) {
        let Some(index) = spec.inputs.iter().position(|s| s.name == input.name) else {
            return Err(Status::invalid(format!(
                "unexpected inference input '{}' for model '{model}' (expected: {})",
                input.name,
                names(&spec.inputs)
            )));
        };
        let expected = &spec.inputs[index];
        if slots[index].is_some() {
            return Err(Status::invalid(format!("input '{}' is given twice", input.name)));
        }
        if input.datatype != expected.datatype {
            return Err(Status::invalid(format!(
                "input '{}' has datatype {}, but model '{model}' expects {}",
                input.name, input.datatype, expected.datatype
            )));
        }
        // Shape: [batch] + dims when the model batches, else dims.
        let dims: &[i64] = if spec.max_batch_size > 0 {
            let Some((&batch, rest)) = input.shape.split_first() else {
                return Err(Status::invalid(format!(
                    "input '{}' has shape [] but model '{model}' batches: expected [batch, {}]",
                    input.name,
                    fmt_dims(&expected.dims)
                )));
            };
            if batch < 1 || batch as usize > spec.max_batch_size {
                return Err(Status::invalid(format!(
                    "input '{}': batch size {batch} is outside 1..={} (max_batch_size of model '{model}')",
                    input.name, spec.max_batch_size
                )));
            }
            match rows {
                None => rows = Some(batch as usize),
                Some(r) if r != batch as usize => {
                    return Err(Status::invalid(format!(
                        "input '{}' has batch size {batch}, but other inputs have {r}",
                        input.name
                    )));
                }
                _ => {}
            }
            rest
        } else {
            &input.shape
        };
        let shape_ok = dims.len() == expected.dims.len()
            && dims.iter().zip(&expected.dims).all(|(&d, &e)| d >= 0 && (e == -1 || d == e));
        if !shape_ok {
            let batch_prefix = if spec.max_batch_size > 0 { "batch, " } else { "" };
            return Err(Status::invalid(format!(
                "input '{}' has shape {}, but model '{model}' expects [{batch_prefix}{}]",
                input.name,
                fmt_shape(&input.shape),
                fmt_dims(&expected.dims)
            )));
        }
        // Sizes first: the element count below cannot overflow once the byte size is known.
        check_byte_size(&input.name, input.datatype, &input.shape, &input.data)?;
        if let Some(model_dims) = &expected.reshape {
            // A -1 in the reshape takes what is left: the rest must divide evenly.
            // (An empty batch passes the byte-size check with any other dims: count checked.)
            let elements = dims.iter().try_fold(1i64, |n, &d| n.checked_mul(d)).ok_or_else(|| {
                Status::invalid(format!("input '{}': shape {} overflows", input.name, fmt_shape(&input.shape)))
            })?;
            let known: i64 = model_dims.iter().filter(|&&d| d > 0).product();
            if known > 0 && elements % known != 0 {
                return Err(Status::invalid(format!(
                    "input '{}' has shape {}, whose {elements} elements per row cannot take model '{model}''s \
                     reshape {model_dims:?}",
                    input.name,
                    fmt_shape(&input.shape)
                )));
            }
        }
        slots[index] = Some((input.shape, input.data));
    }
    let missing: Vec<&str> = spec
        .inputs
        .iter()
        .zip(&slots)
        .filter(|(t, s)| s.is_none() && !t.optional)
        .map(|(t, _)| t.name.as_str())
        .collect();
    if !missing.is_empty() {
        return Err(Status::invalid(format!(
            "model '{model}' expects inputs {} but the request lacks {}",
            names(&spec.inputs),
            missing.iter().map(|m| format!("'{m}'")).collect::<Vec<_>>().join(", ")
        )));
    }
    if rows.is_none() && spec.max_batch_size > 0 && slots.iter().all(Option::is_none) {
        return Err(Status::invalid(format!(
            "the request gives none of model '{model}''s inputs ({}); its batch size is unknown",
            names(&spec.inputs)
        )));
    }
    let inputs = slots;

    let mut wanted = vec![request.outputs.is_empty(); spec.outputs.len()];
    let mut seen = HashSet::new();
    for out in &request.outputs {
        let Some(index) = spec.outputs.iter().position(|s| s.name == out.name) else {
            return Err(Status::invalid(format!(
                "unexpected inference output '{}' for model '{model}' (outputs: {})",
                out.name,
                names(&spec.outputs)
            )));
        };
        if !seen.insert(out.name.as_str()) {
            return Err(Status::invalid(format!("output '{}' is requested twice", out.name)));
        }
        wanted[index] = true;
    }

    // Requests batch together only with the same non-batch shapes and the same optional
    // inputs present (-2 marks one left out; dims are non-negative, -1 separates inputs).
    let mut shape_key = Vec::new();
    let skip = usize::from(spec.max_batch_size > 0);
    for input in &inputs {
        match input {
            Some((shape, _)) => {
                shape_key.extend_from_slice(&shape[skip.min(shape.len())..]);
                shape_key.push(-1);
            }
            None => shape_key.push(-2),
        }
    }
    Ok(Validated { rows: rows.unwrap_or(1), shape_key, inputs, wanted })
}

/// Most elements one BYTES input may hold: each becomes a string of its own (ours, then a C
/// string and ONNX Runtime's), some 60 bytes apiece whatever its length, so a request of 64 MiB
/// of empty elements (16.7 million) would take a gigabyte or more to run.
pub const MAX_BYTES_ELEMENTS: u64 = 1 << 22;

/// Fixed-size types: bytes must equal elements × element size (computed without overflow).
/// BYTES: the serialized elements must parse and number exactly the shape's elements.
pub fn check_byte_size(name: &str, datatype: DataType, shape: &[i64], data: &[u8]) -> Result<(), Status> {
    let elements = dtype::element_count(shape)
        .ok_or_else(|| Status::invalid(format!("input '{name}': shape {} overflows", fmt_shape(shape))))?;
    match datatype.element_size() {
        Some(size) => {
            let expected = elements
                .checked_mul(size as u64)
                .ok_or_else(|| Status::invalid(format!("input '{name}': shape {} overflows", fmt_shape(shape))))?;
            if expected != data.len() as u64 {
                return Err(Status::invalid(format!(
                    "input '{name}': got {} bytes of data, but shape {} of {datatype} needs {expected}",
                    data.len(),
                    fmt_shape(shape)
                )));
            }
            // Folded a block at a time (vectorised): a 64 MiB tensor is checked in milliseconds.
            if datatype == DataType::Bool && data.chunks(4096).any(|block| block.iter().fold(0u8, |a, &b| a | b) > 1) {
                return Err(Status::invalid(format!("input '{name}': BOOL elements must be 0 or 1")));
            }
        }
        None if elements > MAX_BYTES_ELEMENTS => {
            return Err(Status::invalid(format!(
                "input '{name}': shape {} holds {elements} BYTES elements, more than the {MAX_BYTES_ELEMENTS} one \
                 input may hold (each becomes a string of its own in ONNX Runtime, tens of bytes apiece)",
                fmt_shape(shape)
            )));
        }
        None => {
            // Checked here, before queueing: in the backend a bad element would fail the whole
            // batch, other clients' requests included.
            let count = check_onnx_strings(name, data)?;
            if count != elements {
                return Err(Status::invalid(format!(
                    "input '{name}': got {count} BYTES elements, but shape {} needs {elements}",
                    fmt_shape(shape)
                )));
            }
        }
    }
    Ok(())
}

fn names(specs: &[TensorSpec]) -> String {
    specs.iter().map(|s| format!("'{}'", s.name)).collect::<Vec<_>>().join(", ")
}

fn fmt_dims(dims: &[i64]) -> String {
    dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")
}

pub fn fmt_shape(shape: &[i64]) -> String {
    format!("[{}]", fmt_dims(shape))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::{InputTensor, RequestedOutput, serialize_bytes_elements};

    fn spec() -> ModelSpec {
        ModelSpec {
            max_batch_size: 8,
            inputs: vec![
                TensorSpec {
                    name: "A".into(),
                    datatype: DataType::Fp32,
                    dims: vec![-1, 4],
                    reshape: None,
                    optional: false,
                },
                TensorSpec {
                    name: "S".into(),
                    datatype: DataType::Bytes,
                    dims: vec![1],
                    reshape: None,
                    optional: false,
                },
            ],
            outputs: vec![
                TensorSpec {
                    name: "X".into(),
                    datatype: DataType::Fp32,
                    dims: vec![4],
                    reshape: None,
                    optional: false,
                },
                TensorSpec {
                    name: "Y".into(),
                    datatype: DataType::Fp32,
                    dims: vec![4],
                    reshape: None,
                    optional: false,
                },
            ],
        }
    }

    fn request(a_shape: Vec<i64>, a_bytes: usize, strings: usize) -> InferRequest {
        InferRequest {
            model_name: "m".into(),
            inputs: vec![
                InputTensor {
                    name: "A".into(),
                    datatype: DataType::Fp32,
                    shape: a_shape,
                    data: Bytes::from(vec![0u8; a_bytes]),
                },
                InputTensor {
                    name: "S".into(),
                    datatype: DataType::Bytes,
                    shape: vec![2, 1],
                    data: Bytes::from(serialize_bytes_elements(vec!["x"; strings])),
                },
            ],
            ..Default::default()
        }
    }

    #[test]
    fn accepts_a_good_request() {
        let mut r = request(vec![2, 3, 4], 96, 2);
        r.outputs = vec![RequestedOutput { name: "Y".into(), ..Default::default() }];
        let v = validate(&spec(), &mut r).unwrap();
        assert_eq!(v.rows, 2);
        assert_eq!(v.wanted, vec![false, true]);
        assert_eq!(v.shape_key, vec![3, 4, -1, 1, -1]);
    }

    #[test]
    fn a_reshape_with_a_free_dim_needs_rows_that_divide_evenly() {
        let mut s = spec();
        s.inputs[0].reshape = Some(vec![8, -1]); // A's [-1, 4] rows become [8, n]
        assert!(validate(&s, &mut request(vec![2, 6, 4], 192, 2)).is_ok(), "24 elements: [8, 3]");
        let e = validate(&s, &mut request(vec![2, 3, 4], 96, 2)).unwrap_err();
        assert!(e.message.contains("12 elements per row cannot take model 'm''s reshape [8, -1]"), "{}", e.message);
        // An empty tensor with huge other dims: no bytes to check them against, and no
        // overflow either (a model that does not batch: its dims are the whole shape).
        s.max_batch_size = 0;
        s.inputs[0].dims = vec![-1, 4, -1];
        s.inputs[0].reshape = Some(vec![-1]);
        let e = validate(&s, &mut request(vec![1 << 62, 4, 0], 0, 2)).unwrap_err();
        assert!(e.message.contains("'A'") && e.message.contains("overflows"), "{}", e.message);
    }

    #[test]
    fn rejects_each_mismatch_naming_the_field() {
        let cases: Vec<(InferRequest, &str)> = vec![
            (request(vec![2, 3, 4], 95, 2), "bytes of data"),
            (request(vec![2, 3, 5], 120, 2), "expects [batch, -1, 4]"),
            (request(vec![9, 3, 4], 9 * 48, 9), "batch size 9"),
            (request(vec![2, 4], 32, 2), "has shape [2, 4]"),
            (request(vec![2, 3, 4], 96, 3), "BYTES elements"),
            (request(vec![i64::MAX / 2, 1 << 40, 4], 96, 2), "batch size"),
            (request(vec![2, i64::MAX, 4], 96, 2), "overflows"),
        ];
        for (mut r, needle) in cases {
            let e = validate(&spec(), &mut r).unwrap_err();
            assert!(e.message.contains(needle), "{needle}: {e}");
            assert!(e.message.contains("'A'") || e.message.contains("'S'"), "{e}");
        }
    }

    #[test]
    fn too_many_bytes_elements_and_bad_bools_are_refused_before_any_walk() {
        // Refused from the shape: the data (4 bytes short of 4 Mi empty elements) is never read.
        let too_many = MAX_BYTES_ELEMENTS as i64 + 1;
        let e = check_byte_size("S", DataType::Bytes, &[1, too_many], &[]).unwrap_err();
        assert!(e.message.contains("more than the 4194304 one input may hold"), "{}", e.message);
        let at_most = serialize_bytes_elements(vec![""; 1000]);
        assert!(check_byte_size("S", DataType::Bytes, &[1000], &at_most).is_ok());
        // BOOL: a stray value anywhere, in any block.
        let mut bools = vec![1u8; 10_000];
        assert!(check_byte_size("B", DataType::Bool, &[10_000], &bools).is_ok());
        bools[9_999] = 2;
        let e = check_byte_size("B", DataType::Bool, &[10_000], &bools).unwrap_err();
        assert!(e.message.contains("BOOL elements must be 0 or 1"), "{}", e.message);
    }

    #[test]
    fn missing_extra_and_wrong_type() {
        let mut r = request(vec![2, 3, 4], 96, 2);
        r.inputs.pop();
        assert!(validate(&spec(), &mut r).unwrap_err().message.contains("lacks 'S'"));
        let mut r = request(vec![2, 3, 4], 96, 2);
        r.inputs[1].name = "Z".into();
        assert!(validate(&spec(), &mut r).unwrap_err().message.contains("unexpected inference input 'Z'"));
        let mut r = request(vec![2, 3, 4], 96, 2);
        r.inputs[0].datatype = DataType::Int32;
        assert!(validate(&spec(), &mut r).unwrap_err().message.contains("datatype INT32"));
        let mut r = request(vec![2, 3, 4], 96, 2);
        r.outputs = vec![RequestedOutput { name: "NOPE".into(), ..Default::default() }];
        assert!(validate(&spec(), &mut r).unwrap_err().message.contains("output 'NOPE'"));
    }
}
