//! The float element types a user names (`f32`, `f16`, `bf16`): of the weights a stage stores, of the
//! activations on a GPU and of the hidden states sent downstream. The one parser for them.

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
