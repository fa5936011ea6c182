use nereid_proto::FILE_DESCRIPTOR_SET;
use nereid_proto::inference::{
    InferParameter, ModelInferRequest,
    infer_parameter::ParameterChoice,
    model_infer_request::{InferInputTensor, InferRequestedOutputTensor},
};
use prost::Message;
use prost_types::FileDescriptorSet;

#[test]
fn model_infer_request_roundtrip() {
    let data: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut req = ModelInferRequest {
        model_name: "simple".into(),
        model_version: "1".into(),
        id: "req-1".into(),
        inputs: vec![InferInputTensor {
            name: "INPUT0".into(),
            datatype: "FP32".into(),
            shape: vec![1, 4],
            ..Default::default()
        }],
        outputs: vec![InferRequestedOutputTensor { name: "OUTPUT0".into(), ..Default::default() }],
        raw_input_contents: vec![data.clone().into()],
        ..Default::default()
    };
    req.parameters.insert("priority".into(), InferParameter { parameter_choice: Some(ParameterChoice::Int64Param(3)) });

    let bytes = req.encode_to_vec();
    let back = ModelInferRequest::decode(bytes.as_slice()).expect("decode");
    assert_eq!(back, req);
    assert_eq!(back.raw_input_contents[0], data);
    assert_eq!(back.inputs[0].shape, vec![1, 4]);
}

#[test]
fn descriptor_set_has_model_config_numbers() {
    let set = FileDescriptorSet::decode(FILE_DESCRIPTOR_SET).expect("descriptor set decodes");
    let mc = set
        .file
        .iter()
        .filter(|f| f.package() == "inference")
        .flat_map(|f| f.message_type.iter())
        .find(|m| m.name() == "ModelConfig")
        .expect("inference.ModelConfig present");
    let number = |name: &str| {
        mc.field.iter().find(|f| f.name() == name).unwrap_or_else(|| panic!("field {name} missing")).number()
    };
    assert_eq!(number("dynamic_batching"), 11);
    assert_eq!(number("instance_group"), 7);
    assert_eq!(number("sequence_batching"), 13);
    assert_eq!(number("model_metrics"), 26);

    let svc = set
        .file
        .iter()
        .flat_map(|f| f.service.iter())
        .find(|s| s.name() == "GRPCInferenceService")
        .expect("service present");
    assert_eq!(svc.method.len(), 20);
}
