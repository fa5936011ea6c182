//! Inference messages as they travel through the gateway: the encoded protobuf bytes, passed
//! through untouched, plus the few top-level fields routing needs (`model_name`,
//! `model_version`, `id`), read by a scan that skips every other field — tensors included —
//! without decoding or copying it.
//!
//! A gRPC request arrives as one contiguous buffer; [`BytesCodec`] hands it over as [`Bytes`]
//! (a reference-counted slice of the receive buffer) and writes it to the worker as it is; the
//! worker's answer comes back the same way. The worker alone decodes the tensors, and answers
//! INVALID_ARGUMENT for a malformed one. Only the top level is checked here: a request whose
//! framing is broken never leaves the gateway.

use bytes::{BufMut, Bytes};
use prost::Message;
use tonic::Status;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

/// The top-level fields of a `ModelInferRequest` / `ModelInferResponse` the gateway reads:
/// field numbers 1, 2 and 3 in both messages.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Header {
    pub model_name: String,
    pub model_version: String,
    pub id: String,
}

const MODEL_NAME: u64 = 1;
const MODEL_VERSION: u64 = 2;
const ID: u64 = 3;

/// Why [`scan`] refused a message: which field, and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed {message}: {reason}")]
pub struct WireError {
    message: &'static str,
    reason: String,
}

/// Reads the [`Header`] of an encoded `message` (named in errors), checking the framing of
/// every top-level field and skipping the contents of all but the header's. Later occurrences
/// of a field win, as in protobuf decoding.
pub fn scan(buf: &[u8], message: &'static str) -> Result<Header, WireError> {
    let err = |reason: String| WireError { message, reason };
    let mut header = Header::default();
    let mut pos = 0;
    while pos < buf.len() {
        let key = varint(buf, &mut pos).ok_or_else(|| err(format!("truncated field key at byte {pos}")))?;
        let (field, wire_type) = (key >> 3, key & 7);
        if field == 0 {
            return Err(err(format!("field number 0 at byte {pos}")));
        }
        let slot = match field {
            MODEL_NAME => &mut header.model_name,
            MODEL_VERSION => &mut header.model_version,
            ID => &mut header.id,
            _ => {
                pos = value_end(buf, pos, field, wire_type, 0).map_err(err)?;
                continue;
            }
        };
        if wire_type != 2 {
            return Err(err(format!("field {} has wire type {wire_type}, expected 2 (string)", field_name(field))));
        }
        let end = value_end(buf, pos, field, 2, 0).map_err(err)?;
        let mut start = pos;
        varint(buf, &mut start); // past the length prefix (value_end checked it)
        let value = std::str::from_utf8(&buf[start..end])
            .map_err(|_| err(format!("field {} is not valid UTF-8", field_name(field))))?;
        value.clone_into(slot);
        pos = end;
    }
    Ok(header)
}

/// `ModelInferRequest.inputs` / `.outputs`, and the `parameters` map in each of their messages.
const INPUTS: u64 = 5;
const OUTPUTS: u64 = 6;
const INPUT_PARAMETERS: u64 = 4;
const OUTPUT_PARAMETERS: u64 = 2;

/// Whether an encoded `ModelInferRequest` names a shared-memory region: a `shared_memory_*`
/// key in an input's or requested output's parameters. Walks the `inputs` and `outputs`
/// messages (tensor contents are skipped by length). Framing it cannot follow there is an
/// error, never a "no": the check fails closed, so no encoding trick gets a region name past it.
pub fn uses_shared_memory(request: &[u8]) -> Result<bool, String> {
    let names_region = |tensor: &[u8], parameters: u64| -> Result<bool, String> {
        for field in length_delimited(tensor) {
            let (field, entry) = field?;
            if field == parameters {
                for key in length_delimited(entry) {
                    if matches!(key?, (1, key) if key.starts_with(b"shared_memory_")) {
                        return Ok(true);
                    }
                }
            }
        }
        Ok(false)
    };
    for field in length_delimited(request) {
        let found = match field? {
            (INPUTS, value) => names_region(value, INPUT_PARAMETERS)?,
            (OUTPUTS, value) => names_region(value, OUTPUT_PARAMETERS)?,
            _ => false,
        };
        if found {
            return Ok(true);
        }
    }
    Ok(false)
}

/// `ModelInferRequest.parameters`: map entries, key in field 1.
const REQUEST_PARAMETERS: u64 = 4;

/// The request parameter `key` of an encoded `ModelInferRequest` (e.g. `timeout`, in µs) when
/// it holds a non-negative integer (`int64_param` or `uint64_param`); the last entry wins, as in
/// protobuf maps. `None` when absent, of another type, or past framing it cannot follow.
pub fn request_parameter_u64(request: &[u8], key: &str) -> Option<u64> {
    use nereid_proto::inference::infer_parameter::ParameterChoice;
    let mut found = None;
    for field in length_delimited(request) {
        let (REQUEST_PARAMETERS, entry) = field.ok()? else { continue };
        let (mut name, mut value) = (None, None);
        for f in length_delimited(entry) {
            match f.ok()? {
                (1, k) => name = Some(k),
                (2, v) => value = Some(v),
                _ => {}
            }
        }
        if name == Some(key.as_bytes()) {
            let parameter = nereid_proto::inference::InferParameter::decode(value.unwrap_or_default()).ok()?;
            found = match parameter.parameter_choice {
                Some(ParameterChoice::Int64Param(v)) => u64::try_from(v).ok(),
                Some(ParameterChoice::Uint64Param(v)) => Some(v),
                _ => None,
            };
        }
    }
    found
}

/// The length-delimited fields of an encoded message, as (field number, contents), skipping
/// the others (per request, so nothing is allocated); an error for framing it cannot follow
/// ends the walk.
fn length_delimited(buf: &[u8]) -> impl Iterator<Item = Result<(u64, &[u8]), String>> {
    let mut pos = 0;
    let mut failed = false;
    std::iter::from_fn(move || {
        while !failed && pos < buf.len() {
            let step = (|| {
                let key = varint(buf, &mut pos).ok_or_else(|| format!("truncated field key at byte {pos}"))?;
                let (field, wire_type) = (key >> 3, key & 7);
                if field == 0 {
                    return Err(format!("field number 0 at byte {pos}"));
                }
                let start = pos;
                let end = value_end(buf, start, field, wire_type, 0)?;
                pos = end;
                if wire_type != 2 {
                    return Ok(None);
                }
                let mut data = start;
                varint(buf, &mut data);
                Ok(Some((field, &buf[data..end])))
            })();
            match step {
                Ok(None) => continue,
                Ok(Some(item)) => return Some(Ok(item)),
                Err(e) => {
                    failed = true;
                    return Some(Err(e));
                }
            }
        }
        None
    })
}

/// Groups (deprecated, proto2) nest at most this deep, as prost's recursion limit bounds them.
const MAX_GROUP_DEPTH: u32 = 100;

/// Where the value of `field` (of `wire_type`) that starts at `pos` ends; a group is skipped
/// whole, as protobuf decoders skip unknown fields.
fn value_end(buf: &[u8], mut pos: usize, field: u64, wire_type: u64, depth: u32) -> Result<usize, String> {
    let end = match wire_type {
        0 => {
            varint(buf, &mut pos).ok_or_else(|| format!("truncated varint in field {}", field_name(field)))?;
            pos
        }
        1 => pos.saturating_add(8),
        5 => pos.saturating_add(4),
        2 => {
            let len =
                varint(buf, &mut pos).ok_or_else(|| format!("truncated length of field {}", field_name(field)))?;
            usize::try_from(len).ok().and_then(|len| pos.checked_add(len)).unwrap_or(usize::MAX)
        }
        3 => {
            if depth >= MAX_GROUP_DEPTH {
                return Err(format!("groups nested deeper than {MAX_GROUP_DEPTH}"));
            }
            loop {
                let key = varint(buf, &mut pos).ok_or_else(|| format!("group {field} is not closed"))?;
                let (inner, inner_type) = (key >> 3, key & 7);
                match (inner, inner_type) {
                    (0, _) => return Err(format!("field number 0 in group {field}")),
                    (f, 4) if f == field => break pos,
                    (f, 4) => return Err(format!("group {field} closed as group {f}")),
                    (f, t) => pos = value_end(buf, pos, f, t, depth + 1)?,
                }
            }
        }
        4 => return Err(format!("field {field} ends a group that was not started")),
        other => return Err(format!("field {field} has unsupported wire type {other}")),
    };
    if end > buf.len() {
        return Err(format!("field {} runs past the end of the message ({} bytes)", field_name(field), buf.len()));
    }
    Ok(end)
}

fn field_name(field: u64) -> String {
    match field {
        MODEL_NAME => "model_name".to_string(),
        MODEL_VERSION => "model_version".to_string(),
        ID => "id".to_string(),
        n => n.to_string(),
    }
}

/// A base-128 varint at `*pos`, advancing past it; `None` when truncated or longer than 10 bytes.
fn varint(buf: &[u8], pos: &mut usize) -> Option<u64> {
    let mut value = 0u64;
    for shift in 0..10 {
        let byte = *buf.get(*pos)?;
        *pos += 1;
        value |= u64::from(byte & 0x7f) << (7 * shift);
        if byte < 0x80 {
            return Some(value);
        }
    }
    None
}

/// An encoded `ModelInferRequest` and its header. Cloning it (a retry) shares the bytes.
#[derive(Clone, Debug)]
pub struct InferRequest {
    pub bytes: Bytes,
    pub header: std::sync::Arc<Header>,
}

impl InferRequest {
    /// A request received in encoded form (gRPC ingress).
    pub fn from_bytes(bytes: Bytes) -> Result<Self, WireError> {
        let header = scan(&bytes, "ModelInferRequest")?;
        Ok(InferRequest { bytes, header: std::sync::Arc::new(header) })
    }

    /// A request built by the gateway (HTTP ingress), encoded once here.
    /// The request with its parameter `key` set to `value` (an appended `parameters` entry:
    /// protobuf keeps a map's last entry for a key). Copies the message.
    pub fn with_parameter_u64(&self, key: &str, value: u64) -> Self {
        use nereid_proto::inference::{InferParameter, ModelInferRequest, infer_parameter::ParameterChoice};
        let parameter = InferParameter { parameter_choice: Some(ParameterChoice::Uint64Param(value)) };
        let entry = ModelInferRequest { parameters: [(key.to_string(), parameter)].into(), ..Default::default() };
        let mut bytes = Vec::with_capacity(self.bytes.len() + 32);
        bytes.extend_from_slice(&self.bytes);
        entry.encode(&mut bytes).expect("a Vec grows");
        InferRequest { bytes: bytes.into(), header: self.header.clone() }
    }

    pub fn encode(request: &nereid_proto::inference::ModelInferRequest) -> Self {
        let header = Header {
            model_name: request.model_name.clone(),
            model_version: request.model_version.clone(),
            id: request.id.clone(),
        };
        InferRequest { bytes: request.encode_to_vec().into(), header: std::sync::Arc::new(header) }
    }
}

/// An encoded `ModelInferResponse` from a worker and its header.
#[derive(Clone, Debug)]
pub struct InferResponse {
    pub bytes: Bytes,
    pub header: Header,
}

impl InferResponse {
    pub fn from_bytes(bytes: Bytes) -> Result<Self, WireError> {
        let header = scan(&bytes, "ModelInferResponse")?;
        Ok(InferResponse { bytes, header })
    }

    /// Decodes the whole message (HTTP egress renders it as JSON).
    pub fn decode(&self) -> Result<nereid_proto::inference::ModelInferResponse, prost::DecodeError> {
        nereid_proto::inference::ModelInferResponse::decode(self.bytes.clone())
    }
}

/// A `ModelStreamInferResponse` to send: a worker's answer wrapped as its `infer_response`
/// (field 2) without re-encoding it, or an error.
#[derive(Debug)]
pub enum StreamReply {
    Ok(Bytes),
    Err(nereid_proto::inference::ModelStreamInferResponse),
}

impl StreamReply {
    /// About what the reply takes in memory: its bytes (a stream weighs its unread replies).
    pub fn weight(&self) -> usize {
        match self {
            StreamReply::Ok(bytes) => bytes.len(),
            StreamReply::Err(e) => e.encoded_len(),
        }
    }
}

impl From<nereid_worker::grpc::StreamPanic> for StreamReply {
    fn from(p: nereid_worker::grpc::StreamPanic) -> Self {
        StreamReply::Err(p.into())
    }
}

/// `ModelStreamInferResponse.infer_response`: field 2, length-delimited.
const INFER_RESPONSE_KEY: u8 = (2 << 3) | 2;

/// `parameters["triton_final_response"] = bool_param true`, encoded as a `ModelInferResponse`
/// field: appended to a worker's unary answer (fields may come in any order, a map entry is a
/// repeated field), it marks a stream response as its request's last, as Triton (and a worker's
/// own stream) marks every one.
static FINAL_RESPONSE_FIELD: std::sync::LazyLock<Bytes> = std::sync::LazyLock::new(|| {
    use nereid_proto::inference::{InferParameter, infer_parameter::ParameterChoice};
    let mut marker = nereid_proto::inference::ModelInferResponse::default();
    let flag = InferParameter { parameter_choice: Some(ParameterChoice::BoolParam(true)) };
    marker.parameters.insert(nereid_worker::grpc::FINAL_RESPONSE_PARAMETER.to_string(), flag);
    Bytes::from(marker.encode_to_vec())
});

/// A codec that decodes a message to its bytes (zero-copy: a slice of the receive buffer) and
/// encodes `E` by [`WireEncode`].
pub struct BytesCodec<E>(std::marker::PhantomData<E>);

impl<E> Default for BytesCodec<E> {
    fn default() -> Self {
        BytesCodec(std::marker::PhantomData)
    }
}

/// How an outgoing item becomes a message body.
pub trait WireEncode: Send + 'static {
    /// Writes the message body; `buf` grows as needed (tonic's `EncodeBuf` does), so writing
    /// cannot fail.
    fn encode_to(self, buf: &mut impl BufMut);
}

impl WireEncode for Bytes {
    fn encode_to(self, buf: &mut impl BufMut) {
        buf.put(self);
    }
}

impl WireEncode for StreamReply {
    fn encode_to(self, buf: &mut impl BufMut) {
        match self {
            StreamReply::Ok(bytes) => {
                let marker = &*FINAL_RESPONSE_FIELD;
                buf.put_u8(INFER_RESPONSE_KEY);
                prost::encoding::encode_varint((bytes.len() + marker.len()) as u64, buf);
                buf.put(bytes);
                buf.put_slice(marker);
            }
            StreamReply::Err(message) => message.encode_raw(buf),
        }
    }
}

impl<E: WireEncode> Codec for BytesCodec<E> {
    type Encode = E;
    type Decode = Bytes;
    type Encoder = WireEncoder<E>;
    type Decoder = BytesDecoder;

    fn encoder(&mut self) -> WireEncoder<E> {
        WireEncoder(std::marker::PhantomData)
    }

    fn decoder(&mut self) -> BytesDecoder {
        BytesDecoder
    }
}

pub struct WireEncoder<E>(std::marker::PhantomData<E>);

impl<E: WireEncode> Encoder for WireEncoder<E> {
    type Item = E;
    type Error = Status;

    fn encode(&mut self, item: E, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.encode_to(buf);
        Ok(())
    }
}

pub struct BytesDecoder;

impl Decoder for BytesDecoder {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        use bytes::Buf;
        Ok(Some(buf.copy_to_bytes(buf.remaining())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nereid_proto::inference::model_infer_request::InferInputTensor;
    use nereid_proto::inference::{InferParameter, ModelInferRequest, ModelInferResponse, ModelStreamInferResponse};
    use proptest::prelude::*;

    fn request() -> ModelInferRequest {
        ModelInferRequest {
            model_name: "mlp_fp32".into(),
            model_version: "2".into(),
            id: "req-7".into(),
            parameters: [("timeout".to_string(), InferParameter::default())].into(),
            inputs: vec![InferInputTensor {
                name: "INPUT0".into(),
                datatype: "FP32".into(),
                shape: vec![1, 4],
                ..Default::default()
            }],
            raw_input_contents: vec![vec![7u8; 16].into(), Default::default()],
            ..Default::default()
        }
    }

    #[test]
    fn the_header_is_read_and_everything_else_skipped() {
        let bytes = request().encode_to_vec();
        let h = scan(&bytes, "ModelInferRequest").unwrap();
        assert_eq!(h, Header { model_name: "mlp_fp32".into(), model_version: "2".into(), id: "req-7".into() });
        assert_eq!(scan(&[], "m").unwrap(), Header::default());
    }

    #[test]
    fn shared_memory_parameters_are_found_in_inputs_and_outputs() {
        use nereid_proto::inference::model_infer_request::InferRequestedOutputTensor;
        let shm = || [("shared_memory_region".to_string(), InferParameter::default())].into();
        let plain = request();
        assert_eq!(uses_shared_memory(&plain.encode_to_vec()), Ok(false));
        // Other parameters, and the key's text inside tensor data, are not a region.
        let mut other = request();
        other.inputs[0].parameters = [("binary_data_size".to_string(), InferParameter::default())].into();
        other.raw_input_contents = vec![bytes::Bytes::from_static(b"shared_memory_region")];
        assert_eq!(uses_shared_memory(&other.encode_to_vec()), Ok(false));
        let mut input = request();
        input.inputs[0].parameters = shm();
        assert_eq!(uses_shared_memory(&input.encode_to_vec()), Ok(true));
        let mut output = request();
        output.outputs = vec![InferRequestedOutputTensor { name: "Y".into(), parameters: shm() }];
        assert_eq!(uses_shared_memory(&output.encode_to_vec()), Ok(true));

        // Unknown fields of every wire type (here fixed32 and fixed64) ahead of the parameters,
        // as a protobuf decoder skips them, do not hide a region.
        let tensor = input.inputs[0].encode_to_vec();
        let mut padded = vec![(15 << 3) | 5, 1, 2, 3, 4, (14 << 3) | 1, 1, 2, 3, 4, 5, 6, 7, 8];
        padded.extend(&tensor);
        let mut bytes = vec![(INPUTS as u8) << 3 | 2, padded.len() as u8];
        bytes.extend(&padded);
        assert_eq!(ModelInferRequest::decode(bytes.as_slice()).unwrap().inputs[0].parameters.len(), 1);
        assert_eq!(uses_shared_memory(&bytes), Ok(true));
        // Framing it cannot follow inside an input is an error, not a "no".
        let broken = [(INPUTS as u8) << 3 | 2, 2, (4 << 3) | 2, 9];
        assert!(uses_shared_memory(&broken).is_err());
    }

    #[test]
    fn integer_request_parameters_are_read_by_key() {
        use nereid_proto::inference::infer_parameter::ParameterChoice;
        let with = |key: &str, choice: ParameterChoice| {
            let mut r = request();
            r.parameters = [(key.to_string(), InferParameter { parameter_choice: Some(choice) })].into();
            r.encode_to_vec()
        };
        assert_eq!(request_parameter_u64(&with("timeout", ParameterChoice::Uint64Param(500)), "timeout"), Some(500));
        assert_eq!(request_parameter_u64(&with("timeout", ParameterChoice::Int64Param(7)), "timeout"), Some(7));
        assert_eq!(request_parameter_u64(&with("timeout", ParameterChoice::Int64Param(-1)), "timeout"), None);
        assert_eq!(request_parameter_u64(&with("timeout", ParameterChoice::BoolParam(true)), "timeout"), None);
        assert_eq!(request_parameter_u64(&with("priority", ParameterChoice::Uint64Param(1)), "timeout"), None);
        // A tensor's parameter of that name is not the request's.
        let mut tensor = request();
        tensor.parameters.clear();
        let p = InferParameter { parameter_choice: Some(ParameterChoice::Uint64Param(9)) };
        tensor.inputs[0].parameters = [("timeout".to_string(), p)].into();
        assert_eq!(request_parameter_u64(&tensor.encode_to_vec(), "timeout"), None);
        // The last entry wins, as a protobuf decoder keeps it.
        let mut twice = with("timeout", ParameterChoice::Uint64Param(1));
        twice.extend(with("timeout", ParameterChoice::Uint64Param(2)));
        assert_eq!(request_parameter_u64(&twice, "timeout"), Some(2));
        // Framing it cannot follow: none.
        assert_eq!(request_parameter_u64(&[(REQUEST_PARAMETERS as u8) << 3 | 2, 9, 1], "timeout"), None);
    }

    #[test]
    fn a_later_occurrence_wins_as_in_protobuf() {
        let mut bytes = request().encode_to_vec();
        bytes.extend(ModelInferRequest { model_name: "other".into(), ..Default::default() }.encode_to_vec());
        assert_eq!(scan(&bytes, "m").unwrap().model_name, "other");
        assert_eq!(ModelInferRequest::decode(bytes.as_slice()).unwrap().model_name, "other");
    }

    #[test]
    fn broken_framing_is_refused_with_the_field_named() {
        let bytes = request().encode_to_vec();
        // Cut inside the tensor bytes: the last field runs past the end.
        let e = scan(&bytes[..bytes.len() - 3], "ModelInferRequest").unwrap_err();
        assert!(e.to_string().contains("malformed ModelInferRequest: field 7 runs past the end"), "{e}");
        // model_name as a varint.
        let e = scan(&[0x08, 0x01], "m").unwrap_err();
        assert!(e.to_string().contains("model_name has wire type 0"), "{e}");
        // A truncated length, model_name as a group, field 0, invalid UTF-8.
        assert!(scan(&[0x0a], "m").is_err());
        assert!(scan(&[0x0b], "m").unwrap_err().to_string().contains("wire type 3"));
        assert!(scan(&[0x00, 0x01], "m").unwrap_err().to_string().contains("field number 0"));
        assert!(scan(&[0x0a, 0x01, 0xff], "m").unwrap_err().to_string().contains("UTF-8"));
        // An over-long varint.
        assert!(scan(&[0x80; 11], "m").is_err());
    }

    #[test]
    fn groups_in_other_fields_are_skipped_as_prost_skips_them() {
        // Field 9 as a group holding a varint and a nested group 10, then model_name "m".
        let bytes = [0x4b, 0x08, 0x01, 0x53, 0x54, 0x4c, 0x0a, 0x01, b'm'];
        assert_eq!(scan(&bytes, "m").unwrap().model_name, "m");
        assert_eq!(ModelInferRequest::decode(&bytes[..]).unwrap().model_name, "m");
        // Not closed, closed as another group, an end without a start.
        assert!(scan(&[0x4b, 0x08, 0x01], "m").unwrap_err().to_string().contains("not closed"));
        assert!(scan(&[0x4b, 0x54], "m").unwrap_err().to_string().contains("closed as group 10"));
        assert!(scan(&[0x4c], "m").unwrap_err().to_string().contains("not started"));
        // Nesting is bounded, not a stack overflow.
        let deep: Vec<u8> = std::iter::repeat_n(0x4b, 200_000).collect();
        assert!(scan(&deep, "m").unwrap_err().to_string().contains("nested deeper"));
    }

    #[test]
    fn a_stream_reply_wraps_the_workers_bytes_unchanged_and_marks_them_final() {
        let response = ModelInferResponse {
            model_name: "m".into(),
            raw_output_contents: vec![vec![1; 300].into()],
            ..Default::default()
        };
        let bytes = Bytes::from(response.encode_to_vec());
        let mut out = bytes::BytesMut::new();
        StreamReply::Ok(bytes).encode_to(&mut out);
        let decoded = ModelStreamInferResponse::decode(out.freeze()).unwrap();
        assert_eq!(decoded.error_message, "");
        // ...marked as the request's final response, as a worker's own stream marks it.
        let mut marked = response.clone();
        marked.parameters.insert(
            "triton_final_response".into(),
            nereid_proto::inference::InferParameter {
                parameter_choice: Some(nereid_proto::inference::infer_parameter::ParameterChoice::BoolParam(true)),
            },
        );
        assert_eq!(decoded.infer_response, Some(marked));

        let err = ModelStreamInferResponse { error_message: "bad".into(), infer_response: None };
        let mut out = bytes::BytesMut::new();
        StreamReply::Err(err.clone()).encode_to(&mut out);
        assert_eq!(ModelStreamInferResponse::decode(out.freeze()).unwrap(), err);
    }

    proptest! {
        /// On any encoding of a request, the scan agrees with prost's decoding.
        #[test]
        fn scan_agrees_with_prost(
            name in ".{0,12}",
            version in "[0-9]{0,3}",
            id in ".{0,8}",
            raw in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..4),
        ) {
            let r = ModelInferRequest {
                model_name: name,
                model_version: version,
                id,
                raw_input_contents: raw.into_iter().map(Into::into).collect(),
                ..request()
            };
            let bytes = r.encode_to_vec();
            let h = scan(&bytes, "m").unwrap();
            prop_assert_eq!(&h.model_name, &r.model_name);
            prop_assert_eq!(&h.model_version, &r.model_version);
            prop_assert_eq!(&h.id, &r.id);
        }

        /// Arbitrary bytes never panic the scan.
        #[test]
        fn scan_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = scan(&bytes, "m");
            let _ = uses_shared_memory(&bytes);
        }
    }
}
