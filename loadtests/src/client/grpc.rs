//! gRPC: `inference.GRPCInferenceService/ModelInfer` over a few shared HTTP/2 channels, with
//! request bodies encoded once and responses drained without decoding.

use std::collections::HashMap;

use bytes::{Buf, BufMut, Bytes};
use nereid_proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
use nereid_proto::inference::infer_parameter::ParameterChoice;
use nereid_proto::inference::model_infer_request::InferInputTensor;
use nereid_proto::inference::{
    InferParameter, ModelConfigRequest, ModelInferRequest, ModelMetadataRequest, ServerLiveRequest,
};
use prost::Message;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::metadata::{AsciiMetadataValue, MetadataValue};
use tonic::transport::{Channel, Endpoint};

use super::{CONNECT_TIMEOUT, CONTROL_TIMEOUT, ClientError, Target};
use crate::measure::Failure;
use crate::workload::{Entry, InputTensor, ModelInfo, TensorSpec};

const MODEL_INFER: &str = "/inference.GRPCInferenceService/ModelInfer";

/// gRPC channels to one server.
#[derive(Clone)]
pub struct GrpcClient {
    url: String,
    channels: Vec<Channel>,
}

/// Headers of one prepared request.
#[derive(Clone, Debug)]
pub struct GrpcParts {
    authorization: Option<AsciiMetadataValue>,
}

impl GrpcParts {
    pub fn new(entry: &Entry) -> Result<Self, ClientError> {
        let authorization = entry
            .api_key
            .as_ref()
            .map(|k| {
                MetadataValue::try_from(format!("Bearer {k}"))
                    .map_err(|_| ClientError::Invalid("the API key is not a valid header value".into()))
            })
            .transpose()?;
        Ok(GrpcParts { authorization })
    }
}

impl GrpcClient {
    /// Opens `target.connections` channels (at least one); fails if the first cannot connect.
    pub async fn connect(target: &Target) -> Result<Self, ClientError> {
        let unreachable = |reason: String| ClientError::Unreachable { url: target.url.clone(), reason };
        let endpoint = Endpoint::from_shared(format!("http://{}", target.url))
            .map_err(|e| ClientError::Invalid(format!("--url '{}': {e}", target.url)))?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            .http2_adaptive_window(true);
        let mut channels = Vec::with_capacity(target.connections.max(1));
        for _ in 0..target.connections.max(1) {
            let channel = endpoint.connect().await.map_err(|e| unreachable(error_chain(&e)))?;
            channels.push(channel);
        }
        let client = GrpcClient { url: target.url.clone(), channels };
        // A TCP listener that is not a KServe gRPC server fails here rather than mid-run.
        let mut probe = GrpcInferenceServiceClient::new(client.channels[0].clone());
        match tokio::time::timeout(CONTROL_TIMEOUT, probe.server_live(ServerLiveRequest {})).await {
            Ok(Ok(_)) => Ok(client),
            Ok(Err(status)) => Err(unreachable(format!("ServerLive failed: {} {}", status.code(), status.message()))),
            Err(_) => Err(unreachable(format!("ServerLive did not answer within {CONTROL_TIMEOUT:?}"))),
        }
    }

    pub fn lane(&self, index: usize) -> GrpcLane {
        GrpcLane { grpc: tonic::client::Grpc::new(self.channels[index % self.channels.len()].clone()) }
    }

    pub async fn is_live(&self) -> bool {
        let mut c = GrpcInferenceServiceClient::new(self.channels[0].clone());
        c.server_live(ServerLiveRequest {}).await.map(|r| r.into_inner().live).unwrap_or(false)
    }

    pub async fn model_info(&self, model: &str, version: Option<&str>) -> Result<ModelInfo, ClientError> {
        let mut c = GrpcInferenceServiceClient::new(self.channels[0].clone());
        let version = version.unwrap_or("").to_string();
        let fail = |status: tonic::Status| self.model_error(model, status);
        let meta = tokio::time::timeout(
            CONTROL_TIMEOUT,
            c.model_metadata(ModelMetadataRequest { name: model.to_string(), version: version.clone() }),
        )
        .await
        .map_err(|_| self.timeout())?
        .map_err(fail)?
        .into_inner();
        let config =
            tokio::time::timeout(CONTROL_TIMEOUT, c.model_config(ModelConfigRequest { name: model.to_string(), version }))
                .await
                .map_err(|_| self.timeout())?
                .map_err(fail)?
                .into_inner();
        let spec = |t: &nereid_proto::inference::model_metadata_response::TensorMetadata| TensorSpec {
            name: t.name.clone(),
            datatype: t.datatype.clone(),
            shape: t.shape.clone(),
        };
        Ok(ModelInfo {
            name: meta.name.clone(),
            versions: meta.versions.clone(),
            max_batch_size: config.config.map(|c| c.max_batch_size.max(0) as u32).unwrap_or(0),
            inputs: meta.inputs.iter().map(spec).collect(),
            outputs: meta.outputs.iter().map(spec).collect(),
        })
    }

    fn model_error(&self, model: &str, status: tonic::Status) -> ClientError {
        if is_transport(&status) {
            return ClientError::Unreachable { url: self.url.clone(), reason: status.message().to_string() };
        }
        ClientError::Model {
            model: model.to_string(),
            url: self.url.clone(),
            reason: format!("{:?}: {}", status.code(), status.message()),
        }
    }

    fn timeout(&self) -> ClientError {
        ClientError::Unreachable { url: self.url.clone(), reason: format!("no answer within {CONTROL_TIMEOUT:?}") }
    }
}

/// One sender's handle on a channel.
pub struct GrpcLane {
    grpc: tonic::client::Grpc<Channel>,
}

impl GrpcLane {
    pub async fn send(&mut self, body: &Bytes, parts: &GrpcParts) -> Result<(), Failure> {
        let mut request = tonic::Request::new(body.clone());
        if let Some(auth) = &parts.authorization {
            request.metadata_mut().insert("authorization", auth.clone());
        }
        self.grpc.ready().await.map_err(|_| Failure::Connection)?;
        let path = http::uri::PathAndQuery::from_static(MODEL_INFER);
        match self.grpc.unary::<Bytes, (), _>(request, path, RawCodec).await {
            Ok(_) => Ok(()),
            Err(status) if is_transport(&status) => Err(Failure::Connection),
            Err(status) => Err(Failure::Grpc(status.code() as i32)),
        }
    }
}

/// Whether a status came from the transport (connect failure, broken connection) rather
/// than from the server: tonic attaches the underlying error as the source.
fn is_transport(status: &tonic::Status) -> bool {
    use std::error::Error;
    status.source().is_some()
        && matches!(status.code(), tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Internal)
}

/// The message of an error and of each of its sources.
pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        let text = inner.to_string();
        if !s.contains(&text) {
            s.push_str(": ");
            s.push_str(&text);
        }
        cur = inner.source();
    }
    s
}

/// The protobuf encoding of `entry`'s `ModelInferRequest`, inputs in `raw_input_contents`.
pub fn encode(entry: &Entry, inputs: &[InputTensor]) -> Bytes {
    let mut parameters = HashMap::new();
    if let Some(p) = entry.priority {
        parameters.insert("priority".to_string(), InferParameter { parameter_choice: Some(ParameterChoice::Uint64Param(p)) });
    }
    if let Some(t) = entry.timeout_us {
        parameters.insert("timeout".to_string(), InferParameter { parameter_choice: Some(ParameterChoice::Uint64Param(t)) });
    }
    let request = ModelInferRequest {
        model_name: entry.model.clone(),
        model_version: entry.version.clone().unwrap_or_default(),
        id: String::new(),
        parameters,
        inputs: inputs
            .iter()
            .map(|i| InferInputTensor {
                name: i.name.clone(),
                datatype: i.datatype.wire_name().to_string(),
                shape: i.shape.clone(),
                parameters: HashMap::new(),
                contents: None,
            })
            .collect(),
        outputs: Vec::new(),
        raw_input_contents: inputs.iter().map(|i| i.data.clone()).collect(),
    };
    Bytes::from(request.encode_to_vec())
}

/// Sends pre-encoded request bytes; drains the response without decoding it.
#[derive(Clone, Copy, Default)]
struct RawCodec;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = ();
    type Encoder = RawCodec;
    type Decoder = RawCodec;

    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }

    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Bytes;
    type Error = tonic::Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Self::Error> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = ();
    type Error = tonic::Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<()>, Self::Error> {
        let n = src.remaining();
        src.advance(n);
        Ok(Some(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nereid_common::DataType;

    #[test]
    fn requests_round_trip_through_protobuf() {
        let mut entry = Entry::for_model("m");
        entry.version = Some("2".into());
        entry.priority = Some(1);
        entry.timeout_us = Some(5000);
        let inputs = vec![InputTensor { name: "X".into(), datatype: DataType::Fp32, shape: vec![1, 2], data: vec![0; 8] }];
        let decoded = ModelInferRequest::decode(encode(&entry, &inputs)).unwrap();
        assert_eq!(decoded.model_name, "m");
        assert_eq!(decoded.model_version, "2");
        assert_eq!(decoded.inputs[0].shape, vec![1, 2]);
        assert_eq!(decoded.inputs[0].datatype, "FP32");
        assert_eq!(decoded.raw_input_contents, vec![vec![0u8; 8]]);
        assert_eq!(decoded.parameters["priority"].parameter_choice, Some(ParameterChoice::Uint64Param(1)));
        assert_eq!(decoded.parameters["timeout"].parameter_choice, Some(ParameterChoice::Uint64Param(5000)));
    }
}
