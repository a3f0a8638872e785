//! The element types a user names: [`FloatDtype`] (`f32`, `f16`, `bf16`) for the weights a stage stores, the
//! activations on a GPU and the hidden states sent downstream; [`KvDtype`] (those and `q8_0`) for the KV cache,
//! with its sizing. The one parser for each.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::Error;
use crate::tensor::DType;

/// A float element type.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum FloatDtype {
    /// 32-bit floats: exact, the default.
    #[default]
    F32,
    /// IEEE half precision: half the traffic.
    F16,
    /// bfloat16: half the traffic, f32's range.
    Bf16,
}

/// The element type of hidden states sent downstream.
pub type HiddenDtype = FloatDtype;

impl FloatDtype {
    /// The same type as a tensor element type.
    pub fn to_engine(self) -> DType {
        match self {
            FloatDtype::F32 => DType::F32,
            FloatDtype::F16 => DType::F16,
            FloatDtype::Bf16 => DType::BF16,
        }
    }
}

impl FromStr for FloatDtype {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" => Ok(FloatDtype::F32),
            "f16" => Ok(FloatDtype::F16),
            "bf16" => Ok(FloatDtype::Bf16),
            _ => Err(Error::InvalidValue { what: "dtype", value: s.into(), expected: "f32, f16 or bf16" }),
        }
    }
}

impl TryFrom<String> for FloatDtype {
    type Error = Error;

    fn try_from(s: String) -> Result<Self, Error> {
        s.parse()
    }
}

impl From<FloatDtype> for String {
    fn from(d: FloatDtype) -> Self {
        d.to_string()
    }
}

impl fmt::Display for FloatDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FloatDtype::F32 => "f32",
            FloatDtype::F16 => "f16",
            FloatDtype::Bf16 => "bf16",
        })
    }
}

/// The element type of the KV cache. A smaller type trades accuracy for room: f16/bf16 take half of f32, q8_0
/// (GGML's Q8_0: 32 × i8 and an f16 scale per 32 elements) 34/128 of it. The error each adds against f32 is
/// bounded by `engine/tests/kv_dtype.rs`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum KvDtype {
    /// 32-bit floats: exact, the CPU default.
    #[default]
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
    /// GGML Q8_0 blocks, quantized as each key/value row is written.
    Q8_0,
}

impl KvDtype {
    /// Every KV type, for tests and help texts.
    pub const ALL: [KvDtype; 4] = [KvDtype::F32, KvDtype::F16, KvDtype::Bf16, KvDtype::Q8_0];

    /// The same type as a tensor element type (its block geometry sizes the cache).
    pub fn to_engine(self) -> DType {
        match self {
            KvDtype::F32 => DType::F32,
            KvDtype::F16 => DType::F16,
            KvDtype::Bf16 => DType::BF16,
            KvDtype::Q8_0 => DType::Q8_0,
        }
    }

    /// Bytes of one cached key (or value) row of `kv_dim` elements. A block type needs `kv_dim` to be a whole
    /// number of its blocks (real models' `num_kv_heads × head_dim` are multiples of 32).
    pub fn row_bytes(self, kv_dim: usize) -> Result<usize, Error> {
        let dtype = self.to_engine();
        dtype.bytes_for(kv_dim).ok_or(Error::KvDim { dtype: self, kv_dim, block: dtype.block_elems() })
    }

    /// KV cache bytes one token takes in one layer (its key and value rows): the one sizing rule of the cache,
    /// used by the backends' allocations, the stage worker's budget and placement.
    pub fn bytes_per_token_layer(self, kv_dim: usize) -> Result<usize, Error> {
        Ok(2 * self.row_bytes(kv_dim)?)
    }
}

impl From<FloatDtype> for KvDtype {
    fn from(d: FloatDtype) -> Self {
        match d {
            FloatDtype::F32 => KvDtype::F32,
            FloatDtype::F16 => KvDtype::F16,
            FloatDtype::Bf16 => KvDtype::Bf16,
        }
    }
}

impl FromStr for KvDtype {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        let lower = s.trim().to_ascii_lowercase();
        KvDtype::ALL.into_iter().find(|d| d.to_string() == lower).ok_or_else(|| Error::InvalidValue {
            what: "KV dtype",
            value: s.into(),
            expected: "f32, f16, bf16 or q8_0",
        })
    }
}

impl TryFrom<String> for KvDtype {
    type Error = Error;

    fn try_from(s: String) -> Result<Self, Error> {
        s.parse()
    }
}

impl From<KvDtype> for String {
    fn from(d: KvDtype) -> Self {
        d.to_string()
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The tensor type's name: `f32`, `f16`, `bf16`, `q8_0`.
        self.to_engine().fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant;

    #[test]
    fn dtypes_parse_print_and_serialize_the_same_way() -> Result<(), Box<dyn std::error::Error>> {
        for d in [FloatDtype::F32, FloatDtype::F16, FloatDtype::Bf16] {
            assert_eq!(d.to_string().parse::<FloatDtype>()?, d);
            assert_eq!(serde_json::to_string(&d)?, format!("\"{d}\""));
            assert_eq!(serde_json::from_str::<FloatDtype>(&format!("\"{d}\""))?, d);
        }
        assert_eq!("BF16".parse::<FloatDtype>()?, FloatDtype::Bf16);
        assert_eq!(FloatDtype::Bf16.to_engine(), DType::BF16);
        let err = "q4_0".parse::<FloatDtype>().err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(err, "invalid dtype \"q4_0\": expected f32, f16 or bf16");
        assert!(serde_json::from_str::<FloatDtype>("\"f64\"").is_err());
        Ok(())
    }

    #[test]
    fn kv_dtypes_parse_print_serialize_and_size() -> Result<(), Box<dyn std::error::Error>> {
        for d in KvDtype::ALL {
            assert_eq!(d.to_string().parse::<KvDtype>()?, d);
            assert_eq!(serde_json::to_string(&d)?, format!("\"{d}\""));
            assert_eq!(serde_json::from_str::<KvDtype>(&format!("\"{d}\""))?, d);
        }
        assert_eq!(" Q8_0 ".parse::<KvDtype>()?, KvDtype::Q8_0);
        assert_eq!(KvDtype::from(FloatDtype::Bf16), KvDtype::Bf16);
        let err = "q4_0".parse::<KvDtype>().err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(err, "invalid KV dtype \"q4_0\": expected f32, f16, bf16 or q8_0");
        // SmolLM2's kv_dim: 3 KV heads of 64.
        let f32_bytes = KvDtype::F32.bytes_per_token_layer(192)?;
        assert_eq!(f32_bytes, 2 * 192 * 4);
        assert_eq!(KvDtype::F16.bytes_per_token_layer(192)? * 2, f32_bytes);
        assert_eq!(KvDtype::Bf16.bytes_per_token_layer(192)? * 2, f32_bytes);
        assert_eq!(KvDtype::Q8_0.bytes_per_token_layer(192)? * 128, f32_bytes * 34);
        assert_eq!(KvDtype::Q8_0.row_bytes(32)?, quant::Q8_0.block_bytes);
        let err = KvDtype::Q8_0.bytes_per_token_layer(48).err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(err, "a q8_0 KV cache needs kv_dim (KV heads × head width) to be a multiple of 32, got 48");
        assert_eq!(KvDtype::F16.bytes_per_token_layer(48)?, 2 * 48 * 2);
        Ok(())
    }
}
