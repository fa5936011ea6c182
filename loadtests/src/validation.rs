//! perf_analyzer's `validation_data`: before any load, every distinct request whose expected
//! outputs the input data file gives is sent once, its response decoded (gRPC raw contents,
//! HTTP JSON or binary, or the output's shared-memory slot) and each expected output compared
//! byte for byte. A mismatch stops the run before anything is measured: a capacity figure for
//! a server that answers wrongly is worth nothing. The measured requests themselves are still
//! drained without decoding.

use std::time::Duration;

use nereid_common::dtype::DataType;
use nereid_proto::inference::ModelInferResponse;
use nereid_proto::inference::infer_parameter::ParameterChoice;
use prost::Message;
use serde_json::Value;

use crate::client::shm::ShmRun;
use crate::client::{Client, Prepared, Protocol};
use crate::data_file::{ExpectedOutput, push_value};

/// Time allowed for each checked request.
const CHECK_TIMEOUT: Duration = Duration::from_secs(30);

/// One output of a decoded response.
#[derive(Debug, PartialEq)]
pub struct Output {
    pub name: String,
    /// `None`: written to a shared-memory region, not carried in the response.
    pub data: Option<Vec<u8>>,
    /// For an output in shared memory: the bytes written there, as the response says.
    pub shm_byte_size: Option<u64>,
}

/// The outputs of an infer response body: a gRPC message frame, or an HTTP body (JSON, maybe
/// followed by binary tensors).
pub fn response_outputs(protocol: Protocol, body: &[u8]) -> Result<Vec<Output>, String> {
    match protocol {
        Protocol::Grpc => grpc_outputs(body),
        Protocol::Http { .. } => http_outputs(body),
    }
}

fn grpc_outputs(body: &[u8]) -> Result<Vec<Output>, String> {
    let len = body.get(1..5).map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize);
    let message = len.and_then(|n| body.get(5..5 + n)).ok_or("the gRPC response is not one whole message")?;
    let response =
        ModelInferResponse::decode(message).map_err(|e| format!("the gRPC response does not decode: {e}"))?;
    let mut out = Vec::with_capacity(response.outputs.len());
    for (i, o) in response.outputs.iter().enumerate() {
        let shm_byte_size = o.parameters.get("shared_memory_byte_size").and_then(|p| match p.parameter_choice {
            Some(ParameterChoice::Int64Param(n)) => u64::try_from(n).ok(),
            Some(ParameterChoice::Uint64Param(n)) => Some(n),
            _ => None,
        });
        let data = if o.parameters.contains_key("shared_memory_region") {
            None
        } else {
            let raw = response
                .raw_output_contents
                .get(i)
                .ok_or_else(|| format!("output '{}' has no raw_output_contents entry", o.name))?;
            Some(raw.to_vec())
        };
        out.push(Output { name: o.name.clone(), data, shm_byte_size });
    }
    Ok(out)
}

fn http_outputs(body: &[u8]) -> Result<Vec<Output>, String> {
    let mut stream = serde_json::Deserializer::from_slice(body).into_iter::<Value>();
    let header = stream
        .next()
        .ok_or("the HTTP response is empty")?
        .map_err(|e| format!("the HTTP response is not KServe v2 JSON: {e}"))?;
    let mut binary = &body[stream.byte_offset()..];
    let outputs = header.get("outputs").and_then(Value::as_array).ok_or("the HTTP response has no `outputs`")?;
    let mut out = Vec::with_capacity(outputs.len());
    for o in outputs {
        let name = o.get("name").and_then(Value::as_str).ok_or("an output has no `name`")?.to_string();
        let params = o.get("parameters");
        let param = |k: &str| params.and_then(|p| p.get(k));
        let shm_byte_size = param("shared_memory_byte_size").and_then(Value::as_u64);
        let data = if param("shared_memory_region").is_some() {
            None
        } else if let Some(n) = param("binary_data_size").and_then(Value::as_u64) {
            let n = usize::try_from(n).ok().filter(|n| *n <= binary.len()).ok_or_else(|| {
                format!("output '{name}': binary_data_size {n} runs past the {} bytes left", binary.len())
            })?;
            let (head, rest) = binary.split_at(n);
            binary = rest;
            Some(head.to_vec())
        } else {
            let datatype = o.get("datatype").and_then(Value::as_str).unwrap_or_default();
            let dtype = DataType::from_wire_name(datatype)
                .ok_or_else(|| format!("output '{name}': unknown datatype '{datatype}'"))?;
            let values =
                o.get("data").and_then(Value::as_array).ok_or_else(|| format!("output '{name}' has no `data`"))?;
            let mut bytes = Vec::new();
            for (j, v) in values.iter().enumerate() {
                push_value(dtype, v, &mut bytes).map_err(|e| format!("output '{name}' data[{j}] {v}: {e}"))?;
            }
            Some(bytes)
        };
        out.push(Output { name, data, shm_byte_size });
    }
    Ok(out)
}

/// Sends each request that has expected outputs once and compares. `requests[i][k]` is entry
/// `i`'s `k`-th prepared request, `expected[i][k]` what it must produce, `models[i]` entry
/// `i`'s model (for shared-memory slots). Returns how many requests were checked.
pub async fn check(
    client: &Client,
    protocol: Protocol,
    requests: &[&[Prepared]],
    expected: &[Vec<Vec<ExpectedOutput>>],
    models: &[String],
    shm: Option<&ShmRun>,
) -> Result<usize, String> {
    let mut lane = client.lane(0);
    let mut checked = 0;
    for (i, (variants, wanted)) in requests.iter().zip(expected).enumerate() {
        for (request, wanted) in variants.iter().zip(wanted) {
            if wanted.is_empty() {
                continue;
            }
            let source = &wanted[0].source;
            // Outputs in shared memory land in a slot every request shares: clear it first, so
            // bytes left by an earlier request can never pass for this one's.
            if let Some(run) = shm {
                for want in wanted {
                    run.clear_output(&models[i], &want.name).map_err(|e| format!("{source}: {e}"))?;
                }
            }
            let body = lane
                .fetch(request, CHECK_TIMEOUT)
                .await
                .map_err(|f| format!("{source}: the request failed before its outputs could be checked: {f:?}"))?;
            let outputs = response_outputs(protocol, &body).map_err(|e| format!("{source}: {e}"))?;
            for want in wanted {
                let output = outputs
                    .iter()
                    .find(|o| o.name == want.name)
                    .ok_or_else(|| format!("{source}: the response has no output '{}'", want.name))?;
                let got = match &output.data {
                    Some(data) => data.clone(),
                    None => {
                        let run =
                            shm.ok_or_else(|| format!("{source}: output '{}' went to shared memory", want.name))?;
                        // As many bytes as the server says it wrote (a shorter answer must not
                        // be padded out with the slot's zeros).
                        let len = output.shm_byte_size.map_or(want.data.len(), |n| n as usize);
                        run.read_output(&models[i], &want.name, len).map_err(|e| format!("{source}: {e}"))?
                    }
                };
                compare(want, &got).map_err(|e| format!("{source}: output '{}': {e}", want.name))?;
            }
            checked += 1;
        }
    }
    Ok(checked)
}

/// Byte-for-byte equality, explained at the first differing element.
fn compare(want: &ExpectedOutput, got: &[u8]) -> Result<(), String> {
    if got == want.data.as_slice() {
        return Ok(());
    }
    let Some(width) = want.datatype.element_size() else {
        return Err(format!(
            "the BYTES elements differ from the expected ({} bytes vs {})",
            got.len(),
            want.data.len()
        ));
    };
    if got.len() != want.data.len() {
        return Err(format!(
            "the server answered {} elements, validation_data gives {}",
            got.len() / width,
            want.data.len() / width
        ));
    }
    let at = got.chunks(width).zip(want.data.chunks(width)).position(|(a, b)| a != b).unwrap_or(0);
    let show = |b: &[u8]| element(want.datatype, &b[at * width..(at + 1) * width]);
    Err(format!("element {at} is {}, expected {}", show(got), show(&want.data)))
}

/// One little-endian element, as text.
fn element(dtype: DataType, b: &[u8]) -> String {
    macro_rules! le {
        ($t:ty) => {
            <$t>::from_le_bytes(b.try_into().unwrap_or_default()).to_string()
        };
    }
    match dtype {
        DataType::Bool => (b[0] != 0).to_string(),
        DataType::Uint8 => le!(u8),
        DataType::Uint16 => le!(u16),
        DataType::Uint32 => le!(u32),
        DataType::Uint64 => le!(u64),
        DataType::Int8 => le!(i8),
        DataType::Int16 => le!(i16),
        DataType::Int32 => le!(i32),
        DataType::Int64 => le!(i64),
        DataType::Fp16 => half::f16::from_le_bytes(b.try_into().unwrap_or_default()).to_string(),
        DataType::Bf16 => half::bf16::from_le_bytes(b.try_into().unwrap_or_default()).to_string(),
        DataType::Fp32 => le!(f32),
        DataType::Fp64 => le!(f64),
        _ => format!("{b:02x?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nereid_proto::inference::model_infer_response::InferOutputTensor;

    fn expected(v: &[f32]) -> ExpectedOutput {
        ExpectedOutput {
            name: "Y".into(),
            datatype: DataType::Fp32,
            data: v.iter().flat_map(|f| f.to_le_bytes()).collect(),
            source: "validation_data[0]".into(),
        }
    }

    #[test]
    fn grpc_and_http_responses_decode_to_bytes() {
        let response = ModelInferResponse {
            outputs: vec![
                InferOutputTensor { name: "Y".into(), datatype: "FP32".into(), ..Default::default() },
                InferOutputTensor {
                    name: "S".into(),
                    parameters: [("shared_memory_region".to_string(), Default::default())].into(),
                    ..Default::default()
                },
            ],
            raw_output_contents: vec![1.5f32.to_le_bytes().to_vec().into(), Default::default()],
            ..Default::default()
        };
        let message = response.encode_to_vec();
        let mut frame = vec![0u8];
        frame.extend((message.len() as u32).to_be_bytes());
        frame.extend(message);
        let got = response_outputs(Protocol::Grpc, &frame).unwrap();
        assert_eq!(got[0], Output { name: "Y".into(), data: Some(1.5f32.to_le_bytes().to_vec()), shm_byte_size: None });
        assert_eq!(got[1].data, None);

        let json = br#"{"outputs":[{"name":"Y","datatype":"FP32","shape":[2],"data":[1.5,-2]},
            {"name":"B","datatype":"INT32","shape":[1],"parameters":{"binary_data_size":4}}]}"#;
        let mut body = json.to_vec();
        body.extend(7i32.to_le_bytes());
        let got = response_outputs(Protocol::Http { binary: true }, &body).unwrap();
        assert_eq!(got[0].data.as_deref(), Some(&expected(&[1.5, -2.0]).data[..]));
        assert_eq!(got[1].data.as_deref(), Some(&7i32.to_le_bytes()[..]));
        assert!(response_outputs(Protocol::Grpc, b"\0\0\0").is_err());
        assert!(response_outputs(Protocol::Http { binary: false }, b"nope").is_err());
    }

    #[test]
    fn a_mismatch_names_the_first_differing_element() {
        let want = expected(&[1.0, 2.0, 3.0]);
        assert!(compare(&want, &want.data).is_ok());
        let got: Vec<u8> = [1.0f32, 2.5, 3.0].iter().flat_map(|f| f.to_le_bytes()).collect();
        assert_eq!(compare(&want, &got).unwrap_err(), "element 1 is 2.5, expected 2");
        assert!(compare(&want, &got[..8]).unwrap_err().contains("answered 2 elements, validation_data gives 3"));
    }
}
