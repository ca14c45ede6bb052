//! Element types, named as safetensors names them, and the plain numbers that hold
//! them viewed as bytes.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The element type of a tensor. The string forms (`F32`, `BF16`, `F8_E4M3`, …) are
/// the safetensors names, used in files and manifests alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[allow(non_camel_case_types)]
pub enum DType {
    /// Boolean, one byte.
    BOOL,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 8-bit integer.
    I8,
    /// 8-bit float, 5 exponent bits and 2 mantissa bits.
    F8_E5M2,
    /// 8-bit float, 4 exponent bits and 3 mantissa bits.
    F8_E4M3,
    /// 8-bit exponent-only scale (microscaling formats).
    F8_E8M0,
    /// Signed 16-bit integer.
    I16,
    /// Unsigned 16-bit integer.
    U16,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// Signed 32-bit integer.
    I32,
    /// Unsigned 32-bit integer.
    U32,
    /// IEEE single precision.
    F32,
    /// IEEE double precision.
    F64,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 64-bit integer.
    U64,
}

impl DType {
    /// True for the floating-point types, whose elements can be NaN or infinite.
    pub fn is_float(self) -> bool {
        matches!(
            self,
            DType::F8_E4M3
                | DType::F8_E5M2
                | DType::F8_E8M0
                | DType::F16
                | DType::BF16
                | DType::F32
                | DType::F64
        )
    }

    /// Every element type, smallest first.
    pub const ALL: [DType; 16] = [
        DType::BOOL,
        DType::U8,
        DType::I8,
        DType::F8_E5M2,
        DType::F8_E4M3,
        DType::F8_E8M0,
        DType::I16,
        DType::U16,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::U32,
        DType::F32,
        DType::F64,
        DType::I64,
        DType::U64,
    ];

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::BOOL
            | DType::U8
            | DType::I8
            | DType::F8_E5M2
            | DType::F8_E4M3
            | DType::F8_E8M0 => 1,
            DType::I16 | DType::U16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::F64 | DType::I64 | DType::U64 => 8,
        }
    }

    /// The safetensors name.
    pub fn name(self) -> &'static str {
        match self {
            DType::BOOL => "BOOL",
            DType::U8 => "U8",
            DType::I8 => "I8",
            DType::F8_E5M2 => "F8_E5M2",
            DType::F8_E4M3 => "F8_E4M3",
            DType::F8_E8M0 => "F8_E8M0",
            DType::I16 => "I16",
            DType::U16 => "U16",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::I32 => "I32",
            DType::U32 => "U32",
            DType::F32 => "F32",
            DType::F64 => "F64",
            DType::I64 => "I64",
            DType::U64 => "U64",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Parses the exact safetensors name (`F32`, not `f32`), as safetensors readers do.
impl FromStr for DType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DType::ALL
            .iter()
            .copied()
            .find(|d| d.name() == s)
            .ok_or_else(|| format!("unknown dtype {s:?}"))
    }
}

/// Plain old data element types, viewable as bytes: bytemuck's [`Pod`](bytemuck::Pod)
/// (no padding, every bit pattern a valid value), under the name ckpt's API uses.
/// The primitive numbers implement it, and so does any type that derives or
/// implements `bytemuck::Pod` (`half::f16` and `half::bf16` with half's `bytemuck`
/// feature, for instance).
pub use bytemuck::Pod as Element;

/// Views a slice of numbers as its bytes (native, i.e. little-endian on every
/// platform ckpt supports).
pub fn as_bytes<T: Element>(data: &[T]) -> &[u8] {
    bytemuck::must_cast_slice(data)
}

/// Views a slice of numbers as its bytes, for writing: the destination of an in-place
/// load ([`CheckpointReader::load_into`](crate::CheckpointReader::load_into)).
pub fn as_bytes_mut<T: Element>(data: &mut [T]) -> &mut [u8] {
    bytemuck::must_cast_slice_mut(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for dtype in DType::ALL {
            assert_eq!(dtype.name().parse::<DType>().unwrap(), dtype);
            let json = serde_json::to_string(&dtype).unwrap();
            assert_eq!(json, format!("\"{}\"", dtype.name()));
        }
        assert!("F33".parse::<DType>().is_err());
        assert!(
            "f32".parse::<DType>().is_err(),
            "names are exact, as in safetensors"
        );
    }
}
