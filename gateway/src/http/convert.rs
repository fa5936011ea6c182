//! Pure conversions between the HTTP side (the worker's parsed [`InferRequest`] / rendered
//! [`InferResponse`] and JSON renderers' input types) and the gRPC messages forwarded to
//! workers. HTTP JSON is converted once into raw little-endian tensors here, at ingress.

use nereid_common::{DataType, Status};
use nereid_proto::inference::infer_parameter::ParameterChoice;
use nereid_proto::inference::model_infer_request::{InferInputTensor, InferRequestedOutputTensor};
use nereid_proto::inference::repository_index_response::ModelIndex;
use nereid_proto::inference::{
    InferParameter, ModelInferRequest, ModelInferResponse, ModelMetadataResponse, ModelStatistics, StatisticDuration,
};
use nereid_worker::server::{self, BatchStats, IndexEntry, ModelMetadata, ModelStats, TensorMetadata};
use nereid_worker::tensor::{InferRequest, InferResponse, OutputTensor};

fn uint64(v: u64) -> InferParameter {
    InferParameter { parameter_choice: Some(ParameterChoice::Uint64Param(v)) }
}

fn int64(v: i64) -> InferParameter {
    InferParameter { parameter_choice: Some(ParameterChoice::Int64Param(v)) }
}

/// An HTTP inference request as the gRPC message a worker gets: tensors in
/// `raw_input_contents`, `priority` / `timeout` as request parameters, an output's
/// `classification` as its parameter. The HTTP-only output choices (`binary_data`) stay at the
/// gateway, which renders the response.
pub fn infer_request_to_proto(r: InferRequest) -> ModelInferRequest {
    let mut parameters = std::collections::HashMap::new();
    if r.priority != 0 {
        parameters.insert("priority".to_string(), uint64(r.priority));
    }
    if r.timeout_us != 0 {
        parameters.insert("timeout".to_string(), uint64(r.timeout_us));
    }
    let mut inputs = Vec::with_capacity(r.inputs.len());
    let mut raw_input_contents = Vec::with_capacity(r.inputs.len());
    for t in r.inputs {
        inputs.push(InferInputTensor {
            name: t.name,
            datatype: t.datatype.wire_name().to_string(),
            shape: t.shape,
            parameters: Default::default(),
            contents: None,
        });
        raw_input_contents.push(t.data);
    }
    ModelInferRequest {
        model_name: r.model_name,
        model_version: r.model_version.map(|v| v.to_string()).unwrap_or_default(),
        id: r.id,
        parameters,
        inputs,
        outputs: r
            .outputs
            .into_iter()
            .map(|o| {
                let mut parameters = std::collections::HashMap::new();
                if o.classification > 0 {
                    parameters.insert("classification".to_string(), int64(i64::from(o.classification)));
                }
                InferRequestedOutputTensor { name: o.name, parameters }
            })
            .collect(),
        raw_input_contents,
    }
}

/// A worker's gRPC response as the HTTP renderer's input. Workers always answer with
/// `raw_output_contents`, one per output; anything else is an INTERNAL error.
pub fn infer_response_from_proto(r: ModelInferResponse) -> Result<InferResponse, Status> {
    if r.raw_output_contents.len() != r.outputs.len() {
        return Err(Status::internal(format!(
            "the worker answered with {} outputs but {} raw_output_contents",
            r.outputs.len(),
            r.raw_output_contents.len()
        )));
    }
    let outputs = r
        .outputs
        .into_iter()
        .zip(r.raw_output_contents)
        .map(|(o, data)| {
            let datatype = DataType::from_wire_name(&o.datatype).ok_or_else(|| {
                Status::internal(format!(
                    "the worker answered output '{}' with unknown datatype '{}'",
                    o.name, o.datatype
                ))
            })?;
            Ok(OutputTensor { name: o.name, datatype, shape: o.shape, data })
        })
        .collect::<Result<_, Status>>()?;
    Ok(InferResponse {
        model_version: r.model_version.parse().unwrap_or_default(),
        model_name: r.model_name,
        id: r.id,
        shm_written: Vec::new(),
        outputs,
    })
}

pub fn metadata_from_proto(m: ModelMetadataResponse) -> ModelMetadata {
    let tensors = |ts: Vec<nereid_proto::inference::model_metadata_response::TensorMetadata>| {
        ts.into_iter().map(|t| TensorMetadata { name: t.name, datatype: t.datatype, shape: t.shape }).collect()
    };
    ModelMetadata {
        name: m.name,
        versions: m.versions,
        platform: m.platform,
        inputs: tensors(m.inputs),
        outputs: tensors(m.outputs),
    }
}

fn duration(d: Option<StatisticDuration>) -> server::Duration {
    d.map(|d| server::Duration { count: d.count, ns: d.ns }).unwrap_or_default()
}

pub fn stats_from_proto(s: ModelStatistics) -> ModelStats {
    let i = s.inference_stats.unwrap_or_default();
    ModelStats {
        name: s.name,
        version: s.version,
        last_inference_ms: s.last_inference,
        inference_count: s.inference_count,
        execution_count: s.execution_count,
        success: duration(i.success),
        fail: duration(i.fail),
        queue: duration(i.queue),
        compute_input: duration(i.compute_input),
        compute_infer: duration(i.compute_infer),
        compute_output: duration(i.compute_output),
        cache_hit: duration(i.cache_hit),
        cache_miss: duration(i.cache_miss),
        batch_stats: s
            .batch_stats
            .into_iter()
            .map(|b| BatchStats {
                batch_size: b.batch_size,
                compute_input: duration(b.compute_input),
                compute_infer: duration(b.compute_infer),
                compute_output: duration(b.compute_output),
            })
            .collect(),
    }
}

pub fn index_entry_from_proto(m: ModelIndex) -> IndexEntry {
    IndexEntry { name: m.name, version: m.version, state: m.state, reason: m.reason }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nereid_proto::inference::model_infer_response::InferOutputTensor;
    use nereid_worker::http::parse_infer_request;

    #[test]
    fn http_json_becomes_raw_contents() {
        let body = br#"{"id":"r1","parameters":{"priority":2,"timeout":500,"binary_data_output":true},
            "inputs":[{"name":"INPUT0","shape":[1,2],"datatype":"FP32","data":[1.5,-2]},
                      {"name":"S","shape":[1],"datatype":"BYTES","data":["ab"]}],
            "outputs":[{"name":"OUTPUT0"},{"name":"SCORES","parameters":{"classification":3,"binary_data":true}}]}"#;
        let parsed = parse_infer_request("m", Some(3), bytes::Bytes::from_static(body), None, 1 << 20, None).unwrap();
        let p = infer_request_to_proto(parsed.request);
        assert_eq!((p.model_name.as_str(), p.model_version.as_str(), p.id.as_str()), ("m", "3", "r1"));
        assert_eq!(p.parameters["priority"], uint64(2));
        assert_eq!(p.parameters["timeout"], uint64(500));
        assert_eq!(p.inputs[0].datatype, "FP32");
        assert_eq!(p.inputs[0].shape, vec![1, 2]);
        let expected: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(p.raw_input_contents[0], expected);
        assert_eq!(p.raw_input_contents[1], vec![2, 0, 0, 0, b'a', b'b']);
        assert_eq!(p.outputs[0].name, "OUTPUT0");
        assert!(p.outputs[0].parameters.is_empty());
        // The class count travels to the worker; binary_data stays here.
        assert_eq!(p.outputs[1].name, "SCORES");
        assert_eq!(p.outputs[1].parameters.len(), 1);
        assert_eq!(p.outputs[1].parameters["classification"], int64(3));
        assert!(parsed.format.binary_default);
    }

    #[test]
    fn responses_need_raw_contents_and_known_datatypes() {
        let out = |dt: &str| InferOutputTensor {
            name: "O".into(),
            datatype: dt.into(),
            shape: vec![1],
            ..Default::default()
        };
        let ok = ModelInferResponse {
            model_name: "m".into(),
            model_version: "2".into(),
            outputs: vec![out("INT32")],
            raw_output_contents: vec![vec![7, 0, 0, 0].into()],
            ..Default::default()
        };
        let r = infer_response_from_proto(ok.clone()).unwrap();
        assert_eq!((r.model_version, r.outputs[0].datatype), (2, DataType::Int32));
        assert_eq!(&r.outputs[0].data[..], &[7, 0, 0, 0]);
        let missing = ModelInferResponse { raw_output_contents: vec![], ..ok.clone() };
        assert!(infer_response_from_proto(missing).is_err());
        let bad = ModelInferResponse { outputs: vec![out("NOPE")], ..ok };
        assert!(infer_response_from_proto(bad).unwrap_err().message.contains("NOPE"));
    }
}
