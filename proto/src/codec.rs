//! The codec of every generated service: prost's, plus a walk over an inference request's wire
//! bytes before prost decodes it.
//!
//! prost builds each repeated entry in full before a handler sees the message, and an entry
//! can cost far more decoded than on the wire: an empty `inputs` entry is 2 bytes on the wire
//! and a few hundred decoded (two strings, a shape, a parameter map, eight content vectors).
//! One 64 MiB `ModelInferRequest` of empty entries would decode into gigabytes. The walk counts
//! entries without allocating and refuses the request (INVALID_ARGUMENT) when it lists more
//! tensors, parameters or dimensions than any model needs — the same bounds the HTTP parser
//! applies — or typed `contents` that would take more than the server's request limit once
//! converted (see [`raise_contents_limit`]), so that what prost then builds stays a small
//! multiple of that limit.

use std::any::TypeId;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Buf;
use prost::Message;
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

use crate::inference::ModelInferRequest;

/// Most input tensors, and most requested outputs (and raw input contents), one request may
/// list (HTTP and gRPC). No model has nearly as many; the bound keeps a request of many tiny (or
/// empty) tensor entries — a few bytes each on the wire, a few hundred bytes each once parsed —
/// from costing the server a hundred times its size before it is refused.
pub const MAX_REQUEST_TENSORS: usize = 4096;
/// Most dimensions one tensor's shape may have: a request's shape is refused above it before
/// anything is done with it (ONNX models rarely exceed 8).
pub const MAX_RANK: usize = 64;
/// Most entries one `parameters` map (of a request, an input or an output) may have.
pub const MAX_PARAMETERS: usize = 256;

/// The most bytes typed `contents` may take once converted (see [`raise_contents_limit`]);
/// 0: not set, no bound.
static CONTENTS_LIMIT: AtomicUsize = AtomicUsize::new(0);

/// The parameter of a request the codec refused, in place of the request (see
/// [`CheckedDecoder`]): its value is why. A server answers such a request with that reason
/// (INVALID_ARGUMENT) before anything else.
pub const REFUSED_PARAMETER: &str = "nereid_decode_refused";

/// Raises the bound on what a request's typed `contents` take once converted to raw bytes
/// (their elements at the least size a datatype gives them, a string its length and 4-byte
/// prefix) to `limit`, the request limit of a server this process runs: the converter refuses
/// more anyway, and prost would build up to six times that (an empty string decodes into 24
/// bytes) first. The codec is shared by every server in the process, so the largest limit
/// wins; each server's own limit still applies when it converts.
pub fn raise_contents_limit(limit: usize) {
    CONTENTS_LIMIT.fetch_max(limit, Ordering::AcqRel);
}

fn contents_limit() -> usize {
    match CONTENTS_LIMIT.load(Ordering::Acquire) {
        0 => usize::MAX,
        limit => limit,
    }
}

/// prost's codec, with [`check_infer_request`] run on each `ModelInferRequest` received.
#[derive(Debug, Clone)]
pub struct CheckedCodec<T, U>(ProstCodec<T, U>);

impl<T, U> Default for CheckedCodec<T, U> {
    fn default() -> Self {
        CheckedCodec(ProstCodec::default())
    }
}

impl<T, U> Codec for CheckedCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = CheckedDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        self.0.encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        CheckedDecoder(self.0.decoder())
    }
}

/// prost's decoder, checking inference requests first. A request the check refuses is not
/// decoded: the decoder yields, in its place, a request with only its model name, version and
/// id and [`REFUSED_PARAMETER`] saying why — so that the refusal is that request's answer,
/// and a `ModelStreamInfer` stream goes on (a decoding error would end the stream).
///
/// A server implementing the generated `GrpcInferenceService` must therefore answer a request
/// for which [`refusal`] says why with that reason (INVALID_ARGUMENT) before anything else.
/// The marker cannot come from a client: [`check_infer_request`] refuses a request that
/// carries the parameter itself.
#[derive(Debug, Clone)]
pub struct CheckedDecoder<U>(ProstDecoder<U>);

impl<U: Message + Default + 'static> Decoder for CheckedDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        if TypeId::of::<U>() == TypeId::of::<ModelInferRequest>() {
            // tonic holds the whole message in one buffer; a split one is walked from a copy.
            let chunk = buf.chunk();
            let refused = if chunk.len() == buf.remaining() {
                check_infer_request(chunk, contents_limit()).err().map(|why| refused_request(chunk, why))
            } else {
                let mut whole = vec![0; buf.remaining()];
                buf.copy_to_slice(&mut whole);
                match check_infer_request(&whole, contents_limit()) {
                    Ok(()) => {
                        return Ok(Some(U::decode(whole.as_slice()).map_err(|e| Status::internal(e.to_string()))?));
                    }
                    Err(why) => Some(refused_request(&whole, why)),
                }
            };
            if let Some(request) = refused {
                // The frame is consumed: tonic reads the next frame's header after it.
                buf.advance(buf.remaining());
                let request: Box<dyn std::any::Any> = Box::new(request);
                let request = request.downcast::<U>().expect("U is ModelInferRequest (its TypeId was compared)");
                return Ok(Some(*request));
            }
        }
        self.0.decode(buf)
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

/// Refuses an encoded `ModelInferRequest` that lists more than [`MAX_REQUEST_TENSORS`] inputs,
/// outputs or raw contents, more than [`MAX_PARAMETERS`] entries in a parameter map, a shape
/// of more than [`MAX_RANK`] dimensions, or typed contents that take more than
/// `contents_limit` bytes once converted (at the least). Allocates nothing. A malformed
/// message passes: prost then reports it as it decodes.
pub fn check_infer_request(message: &[u8], contents_limit: usize) -> Result<(), Status> {
    let refuse = |what: String| Err(Status::invalid_argument(what));
    let (mut inputs, mut outputs, mut raw, mut parameters) = (0usize, 0usize, 0usize, 0usize);
    let mut contents = 0usize;
    for field in Fields(message) {
        let Ok((number, value)) = field else { return Ok(()) };
        match (number, value) {
            (4, Value::Bytes(entry)) => {
                parameters += 1;
                if map_key(entry) == Some(REFUSED_PARAMETER.as_bytes()) {
                    return refuse(format!("parameter '{REFUSED_PARAMETER}' is reserved"));
                }
            }
            (5, Value::Bytes(input)) => {
                if inputs == MAX_REQUEST_TENSORS {
                    return refuse(too_many_tensors("inputs"));
                }
                contents = contents.saturating_add(check_input(inputs, input)?);
                if contents > contents_limit {
                    return refuse(format!(
                        "the inputs' typed contents up to inputs[{inputs}] take at least {contents} bytes once \
                         converted, more than the request limit of {contents_limit} bytes"
                    ));
                }
                inputs += 1;
            }
            (6, Value::Bytes(output)) => {
                if outputs == MAX_REQUEST_TENSORS {
                    return refuse(too_many_tensors("outputs"));
                }
                let entries = Fields(output).filter(|f| matches!(f, Ok((2, Value::Bytes(_))))).count();
                if entries > MAX_PARAMETERS {
                    return refuse(format!("outputs[{outputs}]: {}", too_many_parameters()));
                }
                outputs += 1;
            }
            (7, Value::Bytes(_)) => {
                raw += 1;
                if raw > MAX_REQUEST_TENSORS {
                    return refuse(format!("a request may carry at most {MAX_REQUEST_TENSORS} raw_input_contents"));
                }
            }
            _ => {}
        }
        if parameters > MAX_PARAMETERS {
            return refuse(too_many_parameters());
        }
    }
    Ok(())
}

/// The key of an encoded map entry (field 1).
fn map_key(entry: &[u8]) -> Option<&[u8]> {
    Fields(entry).find_map(|f| match f {
        Ok((1, Value::Bytes(key))) => Some(key),
        _ => None,
    })
}

/// What stands in for a refused request: its model name, version and id (for the answer:
/// a stream's error reply names them), and why.
fn refused_request(message: &[u8], why: Status) -> ModelInferRequest {
    let mut request = ModelInferRequest::default();
    for field in Fields(message) {
        let Ok((number, Value::Bytes(text))) = field else { continue };
        let text = || String::from_utf8_lossy(text).into_owned();
        match number {
            1 => request.model_name = text(),
            2 => request.model_version = text(),
            3 => request.id = text(),
            _ => {}
        }
    }
    let reason = crate::inference::InferParameter {
        parameter_choice: Some(crate::inference::infer_parameter::ParameterChoice::StringParam(
            why.message().to_string(),
        )),
    };
    request.parameters.insert(REFUSED_PARAMETER.to_string(), reason);
    request
}

/// Why the codec refused `request` (see [`CheckedDecoder`]), if it did.
pub fn refusal(request: &ModelInferRequest) -> Option<&str> {
    match request.parameters.get(REFUSED_PARAMETER)?.parameter_choice.as_ref()? {
        crate::inference::infer_parameter::ParameterChoice::StringParam(why) => Some(why),
        _ => Some("refused"),
    }
}

/// The refusal of a request listing more than [`MAX_REQUEST_TENSORS`] `what` (inputs,
/// outputs), worded alike over HTTP and gRPC.
pub fn too_many_tensors(what: &str) -> String {
    format!("a request may list at most {MAX_REQUEST_TENSORS} {what}")
}

fn too_many_parameters() -> String {
    format!("a parameters map may have at most {MAX_PARAMETERS} entries")
}

/// One `InferInputTensor`'s shape and parameters; what its typed contents take converted.
fn check_input(index: usize, input: &[u8]) -> Result<usize, Status> {
    let (mut rank, mut parameters, mut contents) = (0usize, 0usize, 0usize);
    for field in Fields(input) {
        let Ok((number, value)) = field else { return Ok(contents) };
        match (number, value) {
            (3, Value::Bytes(packed)) => rank += varints(packed),
            (3, Value::Varint) => rank += 1,
            (4, Value::Bytes(_)) => parameters += 1,
            (5, Value::Bytes(typed)) => contents = contents.saturating_add(converted_size(typed)),
            _ => {}
        }
        if rank > MAX_RANK {
            return Err(Status::invalid_argument(format!(
                "inputs[{index}]: shape has more than {MAX_RANK} dimensions"
            )));
        }
        if parameters > MAX_PARAMETERS {
            return Err(Status::invalid_argument(format!("inputs[{index}]: {}", too_many_parameters())));
        }
    }
    Ok(contents)
}

/// The varints of a packed field: each ends in a byte below 0x80.
fn varints(packed: &[u8]) -> usize {
    packed.iter().filter(|b| **b < 0x80).count()
}

/// The least an `InferTensorContents` takes converted to raw bytes: each element at the
/// smallest size a datatype sent in its field has (INT8 in `int_contents`: one byte), each
/// string its length and a 4-byte prefix.
fn converted_size(contents: &[u8]) -> usize {
    let mut size = 0usize;
    for field in Fields(contents) {
        let Ok((number, value)) = field else { break };
        let element = match number {
            // bool, int32, uint32 (INT8/UINT8 at the least)
            1 | 2 | 4 => 1,
            // int64, uint64, fp64
            3 | 5 | 7 => 8,
            // fp32
            6 => 4,
            _ => 0,
        };
        let bytes = match (number, value) {
            (8, Value::Bytes(string)) => 4 + string.len(),
            // Packed: varints (bool, int32, int64, uint32, uint64), or fixed 4 / 8 bytes.
            (1..=5, Value::Bytes(packed)) => varints(packed) * element,
            (6 | 7, Value::Bytes(packed)) => packed.len(),
            // One unpacked element.
            (1..=7, Value::Varint | Value::Fixed) => element,
            _ => 0,
        };
        size = size.saturating_add(bytes);
    }
    size
}

/// A field's value on the wire (only length-delimited contents are kept).
enum Value<'a> {
    Varint,
    Fixed,
    Bytes(&'a [u8]),
}

/// The top-level fields of an encoded message, in order; an `Err` ends a malformed one.
struct Fields<'a>(&'a [u8]);

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u32, Value<'a>), ()>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.0.is_empty() {
            return None;
        }
        let field = self.read();
        if field.is_err() {
            self.0 = &[];
        }
        Some(field)
    }
}

impl<'a> Fields<'a> {
    fn varint(&mut self) -> Result<u64, ()> {
        let mut value = 0u64;
        for (i, byte) in self.0.iter().take(10).enumerate() {
            value |= u64::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                self.0 = &self.0[i + 1..];
                return Ok(value);
            }
        }
        Err(())
    }

    fn skip(&mut self, n: usize) -> Result<&'a [u8], ()> {
        if n > self.0.len() {
            return Err(());
        }
        let (taken, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(taken)
    }

    fn read(&mut self) -> Result<(u32, Value<'a>), ()> {
        let key = self.varint()?;
        let number = u32::try_from(key >> 3).map_err(|_| ())?;
        let value = match key & 7 {
            0 => self.varint().map(|_| Value::Varint)?,
            1 => self.skip(8).map(|_| Value::Fixed)?,
            2 => {
                let len = usize::try_from(self.varint()?).map_err(|_| ())?;
                Value::Bytes(self.skip(len)?)
            }
            5 => self.skip(4).map(|_| Value::Fixed)?,
            // A group (deprecated, never in this protocol, but valid: prost skips one under an
            // unknown field number), skipped to its end so that the walk goes on after it.
            3 => self.skip_group(number, 0).map(|()| Value::Fixed)?,
            _ => return Err(()),
        };
        Ok((number, value))
    }

    /// Skips the fields of group `number` up to its end, nested groups included (as deep as
    /// prost's recursion limit).
    fn skip_group(&mut self, number: u32, depth: u32) -> Result<(), ()> {
        if depth >= 100 {
            return Err(());
        }
        loop {
            let key = self.varint()?;
            let inner = u32::try_from(key >> 3).map_err(|_| ())?;
            match key & 7 {
                0 => {
                    self.varint()?;
                }
                1 => {
                    self.skip(8)?;
                }
                2 => {
                    let len = usize::try_from(self.varint()?).map_err(|_| ())?;
                    self.skip(len)?;
                }
                3 => self.skip_group(inner, depth + 1)?,
                4 if inner == number => return Ok(()),
                5 => {
                    self.skip(4)?;
                }
                _ => return Err(()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::inference::model_infer_request::{InferInputTensor, InferRequestedOutputTensor};
    use crate::inference::{InferParameter, InferTensorContents};

    fn encoded(request: &ModelInferRequest) -> Vec<u8> {
        request.encode_to_vec()
    }

    fn refused(request: &ModelInferRequest) -> String {
        let e = check_infer_request(&encoded(request), usize::MAX).expect_err("refused");
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        e.message().to_string()
    }

    fn input(shape: Vec<i64>) -> InferInputTensor {
        InferInputTensor { name: "x".into(), datatype: "FP32".into(), shape, ..Default::default() }
    }

    fn parameters(n: usize) -> HashMap<String, InferParameter> {
        (0..n).map(|i| (format!("k{i}"), InferParameter::default())).collect()
    }

    #[test]
    fn a_request_within_the_bounds_passes() {
        let request = ModelInferRequest {
            model_name: "m".into(),
            parameters: parameters(MAX_PARAMETERS),
            inputs: vec![
                InferInputTensor {
                    parameters: parameters(MAX_PARAMETERS),
                    contents: Some(InferTensorContents { int64_contents: vec![1; 100], ..Default::default() }),
                    ..input(vec![i64::MAX, -1, 300].into_iter().cycle().take(MAX_RANK).collect())
                };
                MAX_REQUEST_TENSORS
            ],
            outputs: vec![
                InferRequestedOutputTensor { name: "y".into(), parameters: parameters(MAX_PARAMETERS) };
                MAX_REQUEST_TENSORS
            ],
            raw_input_contents: vec![bytes::Bytes::from_static(b"abcd"); MAX_REQUEST_TENSORS],
            ..Default::default()
        };
        check_infer_request(&encoded(&request), usize::MAX).unwrap();
    }

    #[test]
    fn counts_past_the_bounds_are_refused() {
        let many_inputs = ModelInferRequest { inputs: vec![InferInputTensor::default(); 4097], ..Default::default() };
        assert!(refused(&many_inputs).contains("at most 4096 inputs"));
        let many_outputs =
            ModelInferRequest { outputs: vec![InferRequestedOutputTensor::default(); 4097], ..Default::default() };
        assert!(refused(&many_outputs).contains("at most 4096 outputs"));
        let many_raw = ModelInferRequest { raw_input_contents: vec![bytes::Bytes::new(); 4097], ..Default::default() };
        assert!(refused(&many_raw).contains("at most 4096 raw_input_contents"));
        let request_parameters = ModelInferRequest { parameters: parameters(257), ..Default::default() };
        assert!(refused(&request_parameters).contains("at most 256 entries"));
        let input_parameters = ModelInferRequest {
            inputs: vec![input(vec![1]), InferInputTensor { parameters: parameters(257), ..input(vec![1]) }],
            ..Default::default()
        };
        assert!(refused(&input_parameters).contains("inputs[1]: a parameters map may have at most 256"));
        let output_parameters = ModelInferRequest {
            outputs: vec![InferRequestedOutputTensor { name: "y".into(), parameters: parameters(257) }],
            ..Default::default()
        };
        assert!(refused(&output_parameters).contains("outputs[0]: a parameters map"));
    }

    #[test]
    fn ranks_past_the_bound_are_refused_packed_or_not() {
        let deep = ModelInferRequest { inputs: vec![input(vec![-1; 65])], ..Default::default() };
        assert!(refused(&deep).contains("inputs[0]: shape has more than 64 dimensions"));
        // Unpacked: one field per dimension (a valid encoding prost also reads).
        let mut unpacked = Vec::new();
        for _ in 0..65 {
            unpacked.extend_from_slice(&[3 << 3, 1]);
        }
        let input = |dims: &[u8]| {
            let mut message = vec![5 << 3 | 2];
            prost::encoding::encode_varint(dims.len() as u64, &mut message);
            message.extend_from_slice(dims);
            message
        };
        let e = check_infer_request(&input(&unpacked), usize::MAX).unwrap_err();
        assert!(e.message().contains("more than 64 dimensions"), "{}", e.message());
        assert_eq!(ModelInferRequest::decode(input(&unpacked).as_slice()).unwrap().inputs[0].shape.len(), 65);
        // 64 unpacked is fine.
        check_infer_request(&input(&unpacked[..128]), usize::MAX).unwrap();
    }

    /// A group (valid protobuf that prost skips) does not end the walk: what follows is
    /// counted.
    #[test]
    fn entries_after_a_group_are_counted() {
        let mut message = vec![8 << 3 | 3, 1 << 3, 7, 9 << 3 | 3, 9 << 3 | 4, 8 << 3 | 4];
        for _ in 0..4097 {
            message.extend_from_slice(&[5 << 3 | 2, 0]);
        }
        assert_eq!(ModelInferRequest::decode(message.as_slice()).unwrap().inputs.len(), 4097);
        let e = check_infer_request(&message, usize::MAX).unwrap_err();
        assert!(e.message().contains("at most 4096 inputs"), "{}", e.message());
    }

    /// Typed contents are weighed at their least converted size against the limit: strings
    /// at their length and prefix, varints by count, fixed-size elements by their bytes.
    #[test]
    fn typed_contents_are_bounded_once_converted() {
        let with = |contents: InferTensorContents| ModelInferRequest {
            inputs: vec![InferInputTensor { contents: Some(contents), ..input(vec![1]) }],
            ..Default::default()
        };
        let strings = with(InferTensorContents { bytes_contents: vec![vec![]; 1000], ..Default::default() });
        check_infer_request(&encoded(&strings), 4000).unwrap();
        let e = check_infer_request(&encoded(&strings), 3999).unwrap_err();
        assert!(
            e.message().contains("at least 4000 bytes") && e.message().contains("limit of 3999"),
            "{}",
            e.message()
        );
        let int64 = with(InferTensorContents { int64_contents: vec![0; 100], ..Default::default() });
        check_infer_request(&encoded(&int64), 800).unwrap();
        assert!(check_infer_request(&encoded(&int64), 799).is_err());
        // int32 elements may be INT8s: a byte each at the least.
        let int32 = with(InferTensorContents { int_contents: vec![-1; 100], ..Default::default() });
        check_infer_request(&encoded(&int32), 100).unwrap();
        assert!(check_infer_request(&encoded(&int32), 99).is_err());
        let floats = with(InferTensorContents { fp32_contents: vec![1.5; 100], ..Default::default() });
        check_infer_request(&encoded(&floats), 400).unwrap();
        assert!(check_infer_request(&encoded(&floats), 399).is_err());
        // Two inputs add up.
        let two = ModelInferRequest {
            inputs: vec![strings.inputs[0].clone(), int64.inputs[0].clone()],
            ..Default::default()
        };
        check_infer_request(&encoded(&two), 4800).unwrap();
        let e = check_infer_request(&encoded(&two), 4799).unwrap_err();
        assert!(e.message().contains("up to inputs[1]"), "{}", e.message());
    }

    /// What stands in for a refused request carries its name, version and id, and why.
    #[test]
    fn a_refused_request_keeps_its_names_and_says_why() {
        let request = ModelInferRequest {
            model_name: "m".into(),
            model_version: "2".into(),
            id: "r1".into(),
            inputs: vec![InferInputTensor::default(); 4097],
            ..Default::default()
        };
        let message = encoded(&request);
        let why = check_infer_request(&message, usize::MAX).unwrap_err();
        let stand_in = refused_request(&message, why);
        assert_eq!(
            (stand_in.model_name.as_str(), stand_in.model_version.as_str(), stand_in.id.as_str()),
            ("m", "2", "r1")
        );
        assert!(stand_in.inputs.is_empty());
        assert!(refusal(&stand_in).is_some_and(|why| why.contains("at most 4096 inputs")), "{stand_in:?}");
        assert_eq!(refusal(&request), None);
        // A client cannot send the marker itself: refused, as reserved.
        let forged = ModelInferRequest {
            parameters: HashMap::from([(REFUSED_PARAMETER.to_string(), InferParameter::default())]),
            ..Default::default()
        };
        let e = check_infer_request(&encoded(&forged), usize::MAX).unwrap_err();
        assert!(e.message().contains("is reserved"), "{}", e.message());
    }

    #[test]
    fn malformed_messages_are_left_to_prost() {
        for message in [&[0x2a, 0x05, 0x01][..], &[0xff; 12], &[0x0b], &[0x2a]] {
            check_infer_request(message, usize::MAX).unwrap();
            assert!(ModelInferRequest::decode(message).is_err());
        }
    }
}
