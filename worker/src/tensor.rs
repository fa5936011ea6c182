//! The worker's internal request and response: tensors as raw little-endian bytes, the form
//! both front ends produce (HTTP JSON is converted once, gRPC raw contents pass as they are).
//!
//! `BYTES` tensors use Triton's serialization: each element is a 4-byte little-endian length
//! followed by that many bytes.

use std::time::Instant;

use bytes::Bytes;
use nereid_common::{DataType, Status};

use crate::shm::ShmTarget;

/// The bounds on a request's entries (tensors, dimensions, parameters), shared with the gRPC
/// codec that applies them before decoding.
pub use nereid_proto::codec::{MAX_PARAMETERS, MAX_RANK, MAX_REQUEST_TENSORS};

/// One inference request, front-end independent.
#[derive(Debug, Default)]
pub struct InferRequest {
    pub model_name: String,
    /// `None`: the latest ready version.
    pub model_version: Option<i64>,
    pub id: String,
    pub inputs: Vec<InputTensor>,
    /// Requested outputs; empty means every output of the model.
    pub outputs: Vec<RequestedOutput>,
    /// KServe `priority` parameter (1 is highest; 0 = the model's default level).
    pub priority: u64,
    /// KServe `timeout` parameter in microseconds (0 = none).
    pub timeout_us: u64,
    /// Absolute deadline from the transport (`grpc-timeout`), if any.
    pub deadline: Option<Instant>,
    /// Requested outputs to be written into registered shared-memory regions, resolved by the
    /// front end when it decoded the request and written by it after inference (see
    /// [`crate::shm::write_outputs`]); the core never looks at them.
    pub shm_outputs: Vec<(String, ShmTarget)>,
}

#[derive(Clone, Debug)]
pub struct InputTensor {
    pub name: String,
    pub datatype: DataType,
    pub shape: Vec<i64>,
    pub data: Bytes,
}

#[derive(Clone, Debug, Default)]
pub struct RequestedOutput {
    pub name: String,
    /// HTTP only: return this output in the binary section (`parameters.binary_data`).
    pub binary_data: Option<bool>,
    /// The classification extension: return the top this many classes of each batch row
    /// instead of the tensor (0: the tensor itself). See [`crate::classify`].
    pub classification: u32,
}

#[derive(Debug, Default)]
pub struct InferResponse {
    pub model_name: String,
    pub model_version: i64,
    pub id: String,
    /// What is not written into shared memory (the request's `shm_outputs`).
    pub outputs: Vec<OutputTensor>,
    /// The outputs written into shared-memory regions instead.
    pub shm_written: Vec<crate::shm::ShmWritten>,
}

#[derive(Clone, Debug)]
pub struct OutputTensor {
    pub name: String,
    pub datatype: DataType,
    pub shape: Vec<i64>,
    pub data: Bytes,
}

/// Splits a serialized `BYTES` tensor into its elements. Fails, naming `tensor`, on a truncated
/// length prefix or element.
pub fn split_bytes_elements<'a>(tensor: &str, data: &'a [u8]) -> Result<Vec<&'a [u8]>, Status> {
    let mut out = Vec::new();
    visit_bytes_elements(tensor, data, |_, e| {
        out.push(e);
        Ok(())
    })?;
    Ok(out)
}

/// The number of elements of a `BYTES` tensor, checking the layout, without collecting them
/// (a payload of empty elements has one per 4 bytes).
pub fn count_bytes_elements(tensor: &str, data: &[u8]) -> Result<u64, Status> {
    visit_bytes_elements(tensor, data, |_, _| Ok(()))
}

/// Walks a `BYTES` tensor's elements in order (`visit(index, element)`); returns how many there
/// are. Fails on a truncated length prefix or element, or when `visit` fails.
pub fn visit_bytes_elements<'a>(
    tensor: &str,
    mut data: &'a [u8],
    mut visit: impl FnMut(u64, &'a [u8]) -> Result<(), Status>,
) -> Result<u64, Status> {
    let mut n = 0u64;
    while !data.is_empty() {
        if data.len() < 4 {
            return Err(Status::invalid(format!(
                "input '{tensor}': BYTES element {n} has a truncated 4-byte length prefix ({} bytes left)",
                data.len()
            )));
        }
        let len = u32::from_le_bytes([data[0], data[1], data[2], data[3]]) as usize;
        data = &data[4..];
        if data.len() < len {
            return Err(Status::invalid(format!(
                "input '{tensor}': BYTES element {n} claims {len} bytes but only {} remain",
                data.len()
            )));
        }
        visit(n, &data[..len])?;
        data = &data[len..];
        n += 1;
    }
    Ok(n)
}

/// Checks that a `BYTES` tensor can become an ONNX string tensor: every element UTF-8 text
/// without NUL. Returns the element count.
pub fn check_onnx_strings(tensor: &str, data: &[u8]) -> Result<u64, Status> {
    visit_bytes_elements(tensor, data, |i, e| {
        let text = std::str::from_utf8(e).map_err(|_| {
            Status::invalid(format!("input '{tensor}': BYTES element {i} is not UTF-8 (ONNX string tensors hold text)"))
        })?;
        if text.contains('\0') {
            return Err(Status::invalid(format!(
                "input '{tensor}': BYTES element {i} contains a NUL character (ONNX Runtime strings cannot)"
            )));
        }
        Ok(())
    })
}

/// Serializes elements in Triton's `BYTES` layout.
pub fn serialize_bytes_elements<I, T>(elements: I) -> Vec<u8>
where
    I: IntoIterator<Item = T>,
    T: AsRef<[u8]>,
{
    let mut out = Vec::new();
    for e in elements {
        let e = e.as_ref();
        out.extend_from_slice(&(e.len() as u32).to_le_bytes());
        out.extend_from_slice(e);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_and_truncation() {
        let s = serialize_bytes_elements(["ab", "", "xyz"]);
        let e = split_bytes_elements("t", &s).unwrap();
        assert_eq!(e, vec![&b"ab"[..], b"", b"xyz"]);
        assert!(split_bytes_elements("t", &s[..s.len() - 1]).unwrap_err().message.contains("claims"));
        assert!(split_bytes_elements("t", &[1, 0]).unwrap_err().message.contains("prefix"));
    }
}
