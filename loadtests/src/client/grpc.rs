//! gRPC: `inference.GRPCInferenceService/ModelInfer` over a few shared HTTP/2 channels, with
//! request bodies encoded once and responses drained without decoding.

use std::collections::HashMap;

use bytes::{BufMut, Bytes, BytesMut};
use http::header::{AUTHORIZATION, CONTENT_TYPE, HeaderMap, HeaderValue, TE};
use http_body_util::{BodyExt, Full};
use nereid_proto::inference::grpc_inference_service_client::GrpcInferenceServiceClient;
use nereid_proto::inference::infer_parameter::ParameterChoice;
use nereid_proto::inference::model_infer_request::{InferInputTensor, InferRequestedOutputTensor};
use nereid_proto::inference::{
    InferParameter, ModelConfigRequest, ModelInferRequest, ModelMetadataRequest, ServerLiveRequest,
    SystemSharedMemoryRegisterRequest, SystemSharedMemoryUnregisterRequest,
};
use prost::Message;
use tonic::codegen::Service;
use tonic::metadata::AsciiMetadataValue;
use tonic::transport::{Channel, Endpoint};

use super::shm::{ShmRequest, ShmSlice};
use super::tls::ALPN_H2;
use super::{CONNECT_TIMEOUT, CONTROL_TIMEOUT, ClientError, Target, bearer, unauthorized_hint};
use crate::measure::Failure;
use crate::workload::{Entry, InputTensor, ModelInfo, TensorSpec};

const MODEL_INFER: &str = "/inference.GRPCInferenceService/ModelInfer";
/// HTTP/2 receive windows of each channel.
pub const GRPC_CONNECTION_WINDOW: u32 = 64 << 20;
pub const GRPC_STREAM_WINDOW: u32 = 4 << 20;

/// gRPC channels to one server.
#[derive(Clone)]
pub struct GrpcClient {
    url: String,
    channels: Vec<Channel>,
    /// `Bearer <key>` of non-inference calls.
    auth: Option<AsciiMetadataValue>,
}

/// Headers of one prepared request.
#[derive(Clone, Debug)]
pub struct GrpcParts {
    headers: HeaderMap,
}

impl GrpcParts {
    pub fn new(entry: &Entry) -> Result<Self, ClientError> {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
        headers.insert(TE, HeaderValue::from_static("trailers"));
        if let Some(k) = &entry.api_key {
            headers.insert(AUTHORIZATION, bearer(k)?);
        }
        Ok(GrpcParts { headers })
    }
}

impl GrpcClient {
    /// Opens `target.connections` channels (at least one); fails if the first cannot connect.
    /// `api_key` goes on every non-inference call.
    pub async fn connect(target: &Target, api_key: Option<&str>) -> Result<Self, ClientError> {
        let unreachable = |reason: String| ClientError::Unreachable { url: target.url.clone(), reason };
        let auth = match api_key {
            None => None,
            Some(k) => Some(
                AsciiMetadataValue::try_from(bearer(k)?.as_bytes())
                    .map_err(|_| ClientError::Invalid("the API key is not a valid header value".into()))?,
            ),
        };
        let scheme = if target.tls.is_some() { "https" } else { "http" };
        let endpoint = Endpoint::from_shared(format!("{scheme}://{}", target.url))
            .map_err(|e| ClientError::Invalid(format!("--url '{}': {e}", target.url)))?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            // h2 closes a connection (GOAWAY ENHANCE_YOUR_CALM, "too_many_data_frames") when
            // small DATA frames pile up unread beyond a budget of half the connection window
            // (at least 25 KiB). Thousands of small responses in flight are normal here, so the
            // window is large and fixed (adaptive sizing would start it small).
            .http2_adaptive_window(false)
            .initial_connection_window_size(GRPC_CONNECTION_WINDOW)
            .initial_stream_window_size(GRPC_STREAM_WINDOW);
        let mut channels = Vec::with_capacity(target.connections.max(1));
        for _ in 0..target.connections.max(1) {
            // With TLS our connector does TCP and the handshake (tonic is built without its own
            // TLS, so an https:// endpoint reaches the connector as is).
            let channel = match &target.tls {
                None => endpoint.connect().await,
                Some(tls) => endpoint.connect_with_connector(tls.connector(ALPN_H2)).await,
            };
            channels.push(channel.map_err(|e| unreachable(error_chain(&e)))?);
        }
        let client = GrpcClient { url: target.url.clone(), channels, auth };
        // A TCP listener that is not a KServe gRPC server fails here rather than mid-run.
        let mut probe = GrpcInferenceServiceClient::new(client.channels[0].clone());
        match tokio::time::timeout(CONTROL_TIMEOUT, probe.server_live(client.request(ServerLiveRequest {}))).await {
            Ok(Ok(_)) => Ok(client),
            Ok(Err(status)) => Err(client
                .unauthorized("ServerLive", &status)
                .unwrap_or_else(|| unreachable(format!("ServerLive failed: {} {}", status.code(), status.message())))),
            Err(_) => Err(unreachable(format!("ServerLive did not answer within {CONTROL_TIMEOUT:?}"))),
        }
    }

    pub fn lane(&self, index: usize) -> GrpcLane {
        GrpcLane {
            channel: self.channels[index % self.channels.len()].clone(),
            path: http::Uri::from_static(MODEL_INFER),
        }
    }

    pub async fn is_live(&self) -> bool {
        let mut c = GrpcInferenceServiceClient::new(self.channels[0].clone());
        c.server_live(self.request(ServerLiveRequest {})).await.map(|r| r.into_inner().live).unwrap_or(false)
    }

    /// A non-inference call's request, with the run's key.
    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        if let Some(auth) = &self.auth {
            request.metadata_mut().insert("authorization", auth.clone());
        }
        request
    }

    /// [`ClientError::Unauthorized`] for a call (`what`) refused as unauthenticated or not
    /// permitted.
    fn unauthorized(&self, what: &str, status: &tonic::Status) -> Option<ClientError> {
        matches!(status.code(), tonic::Code::Unauthenticated | tonic::Code::PermissionDenied).then(|| {
            ClientError::Unauthorized {
                url: self.url.clone(),
                reason: format!(
                    "{what} answered {:?}: {}; {}",
                    status.code(),
                    status.message(),
                    unauthorized_hint(self.auth.is_some())
                ),
            }
        })
    }

    pub async fn model_info(&self, model: &str, version: Option<&str>) -> Result<ModelInfo, ClientError> {
        let mut c = GrpcInferenceServiceClient::new(self.channels[0].clone());
        let version = version.unwrap_or("").to_string();
        let fail = |what: &'static str| move |status: tonic::Status| self.model_error(what, model, status);
        let meta = tokio::time::timeout(
            CONTROL_TIMEOUT,
            c.model_metadata(self.request(ModelMetadataRequest { name: model.to_string(), version: version.clone() })),
        )
        .await
        .map_err(|_| self.timeout())?
        .map_err(fail("ModelMetadata"))?
        .into_inner();
        let config = tokio::time::timeout(
            CONTROL_TIMEOUT,
            c.model_config(self.request(ModelConfigRequest { name: model.to_string(), version })),
        )
        .await
        .map_err(|_| self.timeout())?
        .map_err(fail("ModelConfig"))?
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

    /// `SystemSharedMemoryRegister` (offset 0).
    pub async fn register_system_shm(&self, name: &str, key: &str, byte_size: u64) -> Result<(), ClientError> {
        let mut c = GrpcInferenceServiceClient::new(self.channels[0].clone());
        let request = SystemSharedMemoryRegisterRequest { name: name.into(), key: key.into(), offset: 0, byte_size };
        let call = tokio::time::timeout(CONTROL_TIMEOUT, c.system_shared_memory_register(self.request(request)));
        call.await.map_err(|_| self.timeout())?.map_err(|s| self.shm_error("registering", name, s))?;
        Ok(())
    }

    /// `SystemSharedMemoryUnregister`.
    pub async fn unregister_system_shm(&self, name: &str) -> Result<(), ClientError> {
        let mut c = GrpcInferenceServiceClient::new(self.channels[0].clone());
        let call = tokio::time::timeout(
            CONTROL_TIMEOUT,
            c.system_shared_memory_unregister(self.request(SystemSharedMemoryUnregisterRequest { name: name.into() })),
        );
        call.await.map_err(|_| self.timeout())?.map_err(|s| self.shm_error("unregistering", name, s))?;
        Ok(())
    }

    fn shm_error(&self, what: &str, name: &str, status: tonic::Status) -> ClientError {
        if let Some(e) = self.unauthorized(&format!("{what} shared memory region '{name}'"), &status) {
            return e;
        }
        if is_transport(&status) {
            return ClientError::Unreachable { url: self.url.clone(), reason: status.message().to_string() };
        }
        ClientError::Invalid(format!(
            "{what} shared memory region '{name}' on {}: {:?}: {}",
            self.url,
            status.code(),
            status.message()
        ))
    }

    fn model_error(&self, what: &str, model: &str, status: tonic::Status) -> ClientError {
        if let Some(e) = self.unauthorized(what, &status) {
            return e;
        }
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
///
/// A unary call done by hand over the channel: the request is one pre-framed gRPC message
/// sent as a single DATA frame with END_STREAM (tonic's own encoder sends the end of stream
/// as a second, empty frame, and a server's HTTP/2 layer counts such small unread frames
/// against its flood budget); the answer is the `grpc-status` of the trailers (or of the
/// headers, for a trailers-only response). The response message is drained, not decoded.
pub struct GrpcLane {
    channel: Channel,
    path: http::Uri,
}

impl GrpcLane {
    pub async fn send(&mut self, frame: &Bytes, parts: &GrpcParts) -> Result<(), Failure> {
        self.exchange(frame, parts, None).await
    }

    /// Sends one request and returns the response's gRPC message frames (5-byte prefix, then
    /// the protobuf `ModelInferResponse`), for checks; the load path never decodes.
    pub async fn fetch(&mut self, frame: &Bytes, parts: &GrpcParts) -> Result<Bytes, Failure> {
        let mut data = BytesMut::new();
        self.exchange(frame, parts, Some(&mut data)).await?;
        Ok(data.freeze())
    }

    /// One call: the response's status decides the outcome; its message frames are appended
    /// to `keep` when given, else drained.
    async fn exchange(
        &mut self,
        frame: &Bytes,
        parts: &GrpcParts,
        mut keep: Option<&mut BytesMut>,
    ) -> Result<(), Failure> {
        let mut request = http::Request::new(tonic::body::Body::new(Full::new(frame.clone())));
        *request.method_mut() = http::Method::POST;
        *request.uri_mut() = self.path.clone();
        *request.headers_mut() = parts.headers.clone();
        futures::future::poll_fn(|cx| self.channel.poll_ready(cx)).await.map_err(|_| Failure::Connection)?;
        let response = self.channel.call(request).await.map_err(|_| Failure::Connection)?;
        let (head, mut body) = response.into_parts();
        if head.status != http::StatusCode::OK {
            return Err(Failure::Http(head.status.as_u16()));
        }
        if let Some(code) = grpc_status(&head.headers) {
            return status_outcome(code);
        }
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|_| Failure::Connection)?;
            if let Some(trailers) = frame.trailers_ref() {
                return status_outcome(grpc_status(trailers).unwrap_or(tonic::Code::Unknown as i32));
            }
            if let (Some(keep), Some(chunk)) = (keep.as_deref_mut(), frame.data_ref()) {
                keep.extend_from_slice(chunk);
            }
        }
        // The stream ended without a status: a protocol violation by the server.
        Err(Failure::Grpc(tonic::Code::Internal as i32))
    }
}

fn grpc_status(headers: &HeaderMap) -> Option<i32> {
    headers
        .get("grpc-status")
        .map(|v| v.to_str().ok().and_then(|s| s.parse().ok()).unwrap_or(tonic::Code::Unknown as i32))
}

fn status_outcome(code: i32) -> Result<(), Failure> {
    if code == 0 { Ok(()) } else { Err(Failure::Grpc(code)) }
}

/// Whether a status was made up locally from a transport failure (connect error, broken or
/// reset connection, GOAWAY) rather than sent by the server: tonic attaches the underlying
/// error as the source only then.
fn is_transport(status: &tonic::Status) -> bool {
    use std::error::Error;
    status.source().is_some()
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

/// `entry`'s `ModelInferRequest` (inputs in `raw_input_contents`) as one gRPC message frame;
/// with `shm`, the tensors named by their shared-memory slices instead (no raw contents, every
/// output requested into its slot).
pub fn encode(entry: &Entry, inputs: &[InputTensor], shm: Option<&ShmRequest>) -> Bytes {
    let mut parameters = HashMap::new();
    if let Some(p) = entry.priority {
        parameters
            .insert("priority".to_string(), InferParameter { parameter_choice: Some(ParameterChoice::Uint64Param(p)) });
    }
    if let Some(t) = entry.timeout_us {
        parameters
            .insert("timeout".to_string(), InferParameter { parameter_choice: Some(ParameterChoice::Uint64Param(t)) });
    }
    let slice_parameters = |s: &ShmSlice| {
        let p = |c| InferParameter { parameter_choice: Some(c) };
        HashMap::from([
            ("shared_memory_region".to_string(), p(ParameterChoice::StringParam(s.region.clone()))),
            ("shared_memory_offset".to_string(), p(ParameterChoice::Int64Param(s.offset as i64))),
            ("shared_memory_byte_size".to_string(), p(ParameterChoice::Int64Param(s.byte_size as i64))),
        ])
    };
    let request = ModelInferRequest {
        model_name: entry.model.clone(),
        model_version: entry.version.clone().unwrap_or_default(),
        id: String::new(),
        parameters,
        inputs: inputs
            .iter()
            .enumerate()
            .map(|(k, i)| InferInputTensor {
                name: i.name.clone(),
                datatype: i.datatype.wire_name().to_string(),
                shape: i.shape.clone(),
                parameters: shm.and_then(|s| s.inputs.get(k)).map(slice_parameters).unwrap_or_default(),
                contents: None,
            })
            .collect(),
        outputs: shm
            .map(|s| {
                s.outputs
                    .iter()
                    .map(|(name, slice)| InferRequestedOutputTensor {
                        name: name.clone(),
                        parameters: slice_parameters(slice),
                    })
                    .collect()
            })
            .unwrap_or_default(),
        raw_input_contents: if shm.is_some() {
            Vec::new()
        } else {
            inputs.iter().map(|i| bytes::Bytes::copy_from_slice(&i.data)).collect()
        },
    };
    // gRPC length-prefixed message: uncompressed flag, big-endian length, protobuf.
    let len = request.encoded_len();
    let mut frame = BytesMut::with_capacity(5 + len);
    frame.put_u8(0);
    frame.put_u32(len as u32);
    request.encode(&mut frame).expect("capacity reserved above");
    frame.freeze()
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
        let inputs =
            vec![InputTensor { name: "X".into(), datatype: DataType::Fp32, shape: vec![1, 2], data: vec![0; 8] }];
        let frame = encode(&entry, &inputs, None);
        assert_eq!(frame[0], 0, "uncompressed");
        assert_eq!(u32::from_be_bytes(frame[1..5].try_into().unwrap()) as usize, frame.len() - 5);
        let decoded = ModelInferRequest::decode(&frame[5..]).unwrap();
        assert_eq!(decoded.model_name, "m");
        assert_eq!(decoded.model_version, "2");
        assert_eq!(decoded.inputs[0].shape, vec![1, 2]);
        assert_eq!(decoded.inputs[0].datatype, "FP32");
        assert_eq!(decoded.raw_input_contents, vec![vec![0u8; 8]]);
        assert_eq!(decoded.parameters["priority"].parameter_choice, Some(ParameterChoice::Uint64Param(1)));
        assert_eq!(decoded.parameters["timeout"].parameter_choice, Some(ParameterChoice::Uint64Param(5000)));
    }

    #[test]
    fn shared_memory_requests_name_slices_instead_of_raw_contents() {
        let entry = Entry::for_model("m");
        let inputs =
            vec![InputTensor { name: "X".into(), datatype: DataType::Fp32, shape: vec![1, 2], data: vec![0u8; 8] }];
        let slice = |offset| ShmSlice { region: "r".into(), offset, byte_size: 8 };
        let shm = ShmRequest { inputs: vec![slice(64)], outputs: vec![("Y".into(), slice(0))] };
        let frame = encode(&entry, &inputs, Some(&shm));
        let decoded = ModelInferRequest::decode(&frame[5..]).unwrap();
        assert!(decoded.raw_input_contents.is_empty());
        let p = &decoded.inputs[0].parameters;
        assert_eq!(p["shared_memory_region"].parameter_choice, Some(ParameterChoice::StringParam("r".into())));
        assert_eq!(p["shared_memory_offset"].parameter_choice, Some(ParameterChoice::Int64Param(64)));
        assert_eq!(p["shared_memory_byte_size"].parameter_choice, Some(ParameterChoice::Int64Param(8)));
        assert_eq!(decoded.outputs.len(), 1);
        assert_eq!(decoded.outputs[0].name, "Y");
        assert_eq!(
            decoded.outputs[0].parameters["shared_memory_offset"].parameter_choice,
            Some(ParameterChoice::Int64Param(0))
        );
    }
}
