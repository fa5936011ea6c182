//! Tensor element types under their three spellings: the KServe v2 wire name (`FP32`), the
//! model-config enum (`TYPE_FP32`) and the element width used for byte-size checks.

use std::fmt;

/// A tensor element type as KServe v2 and Triton know it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DataType {
    Bool,
    Uint8,
    Uint16,
    Uint32,
    Uint64,
    Int8,
    Int16,
    Int32,
    Int64,
    Fp16,
    Fp32,
    Fp64,
    /// Variable-length byte strings, serialized as a 4-byte little-endian length then the bytes.
    Bytes,
    Bf16,
}

impl DataType {
    pub const ALL: [DataType; 14] = [
        DataType::Bool,
        DataType::Uint8,
        DataType::Uint16,
        DataType::Uint32,
        DataType::Uint64,
        DataType::Int8,
        DataType::Int16,
        DataType::Int32,
        DataType::Int64,
        DataType::Fp16,
        DataType::Fp32,
        DataType::Fp64,
        DataType::Bytes,
        DataType::Bf16,
    ];

    /// The KServe v2 wire name (`"FP32"`).
    pub fn wire_name(self) -> &'static str {
        match self {
            DataType::Bool => "BOOL",
            DataType::Uint8 => "UINT8",
            DataType::Uint16 => "UINT16",
            DataType::Uint32 => "UINT32",
            DataType::Uint64 => "UINT64",
            DataType::Int8 => "INT8",
            DataType::Int16 => "INT16",
            DataType::Int32 => "INT32",
            DataType::Int64 => "INT64",
            DataType::Fp16 => "FP16",
            DataType::Fp32 => "FP32",
            DataType::Fp64 => "FP64",
            DataType::Bytes => "BYTES",
            DataType::Bf16 => "BF16",
        }
    }

    /// Parses a KServe v2 wire name.
    pub fn from_wire_name(name: &str) -> Option<DataType> {
        DataType::ALL.into_iter().find(|d| d.wire_name() == name)
    }

    /// The `inference.DataType` enum value used in `config.pbtxt` (`TYPE_FP32` = 11).
    pub fn config_value(self) -> i32 {
        match self {
            DataType::Bool => 1,
            DataType::Uint8 => 2,
            DataType::Uint16 => 3,
            DataType::Uint32 => 4,
            DataType::Uint64 => 5,
            DataType::Int8 => 6,
            DataType::Int16 => 7,
            DataType::Int32 => 8,
            DataType::Int64 => 9,
            DataType::Fp16 => 10,
            DataType::Fp32 => 11,
            DataType::Fp64 => 12,
            DataType::Bytes => 13,
            DataType::Bf16 => 14,
        }
    }

    /// From the `inference.DataType` enum value; `None` for `TYPE_INVALID` and unknown values.
    pub fn from_config_value(value: i32) -> Option<DataType> {
        DataType::ALL.into_iter().find(|d| d.config_value() == value)
    }

    /// The config spelling (`"TYPE_FP32"`).
    pub fn config_name(self) -> String {
        match self {
            DataType::Bytes => "TYPE_STRING".to_string(),
            other => format!("TYPE_{}", other.wire_name()),
        }
    }

    /// Bytes per element, or `None` for variable-size `BYTES`.
    pub fn element_size(self) -> Option<usize> {
        Some(match self {
            DataType::Bool | DataType::Uint8 | DataType::Int8 => 1,
            DataType::Uint16 | DataType::Int16 | DataType::Fp16 | DataType::Bf16 => 2,
            DataType::Uint32 | DataType::Int32 | DataType::Fp32 => 4,
            DataType::Uint64 | DataType::Int64 | DataType::Fp64 => 8,
            DataType::Bytes => return None,
        })
    }
}

impl fmt::Display for DataType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.wire_name())
    }
}

/// Number of elements in `shape`, or `None` when a dimension is negative or the product
/// overflows. Callers use it before allocating anything a client claimed.
pub fn element_count(shape: &[i64]) -> Option<u64> {
    shape.iter().try_fold(1u64, |acc, &d| if d < 0 { None } else { acc.checked_mul(d as u64) })
}

/// Byte size of a fixed-width tensor of `shape`, or `None` on overflow / negative dims / BYTES.
pub fn byte_size(dtype: DataType, shape: &[i64]) -> Option<u64> {
    element_count(shape)?.checked_mul(dtype.element_size()? as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for d in DataType::ALL {
            assert_eq!(DataType::from_wire_name(d.wire_name()), Some(d));
            assert_eq!(DataType::from_config_value(d.config_value()), Some(d));
        }
        assert_eq!(DataType::Bytes.config_name(), "TYPE_STRING");
        assert_eq!(DataType::Fp32.config_name(), "TYPE_FP32");
        assert_eq!(DataType::from_wire_name("FLOAT"), None);
        assert_eq!(DataType::from_config_value(0), None);
    }

    #[test]
    fn sizes_never_overflow() {
        assert_eq!(byte_size(DataType::Fp32, &[2, 3]), Some(24));
        assert_eq!(byte_size(DataType::Fp32, &[]), Some(4));
        assert_eq!(byte_size(DataType::Fp32, &[-1, 3]), None);
        assert_eq!(byte_size(DataType::Fp64, &[i64::MAX, i64::MAX]), None);
        assert_eq!(byte_size(DataType::Int64, &[1 << 61]), None);
        assert_eq!(byte_size(DataType::Bytes, &[1]), None);
    }
}
