//! Hidden states on the wire: a 2-D `[rows, cols]` tensor of f32, f16 or bf16, row-major, little-endian.
//!
//! Stages compute in f32 on the host side of the wire; the wire dtype is normally the model's compute dtype, so
//! f16/bf16 models send half the bytes. Decoding validates dtype, shape and length and never panics.

use half::{bf16, f16};
use prost::bytes::Bytes;

use crate::error::{ProtoError, Result};
use crate::pb::{Dtype, HiddenStates};

/// Bytes per element of `dtype`; `UnsupportedDtype` for `Unspecified`.
pub fn dtype_size(dtype: Dtype) -> Result<usize> {
    match dtype {
        Dtype::F32 => Ok(4),
        Dtype::F16 | Dtype::Bf16 => Ok(2),
        Dtype::Unspecified => Err(ProtoError::UnsupportedDtype(dtype as i32)),
    }
}

/// Encodes `rows * cols` row-major f32 values as `dtype` (rounding to nearest-even for f16/bf16).
pub fn encode_f32(data: &[f32], rows: usize, cols: usize, dtype: Dtype) -> Result<HiddenStates> {
    let too_large = || ProtoError::TooLarge { rows: rows as u64, cols: cols as u64 };
    let elem = dtype_size(dtype)?;
    let expected = rows.checked_mul(cols).ok_or_else(too_large)?;
    if data.len() != expected {
        return Err(ProtoError::ValueCount { rows, cols, expected, actual: data.len() });
    }
    let shape = vec![u32::try_from(rows).map_err(|_| too_large())?, u32::try_from(cols).map_err(|_| too_large())?];
    let mut bytes = Vec::with_capacity(expected.checked_mul(elem).ok_or_else(too_large)?);
    match dtype {
        Dtype::F32 => data.iter().for_each(|v| bytes.extend_from_slice(&v.to_le_bytes())),
        Dtype::F16 => data.iter().for_each(|v| bytes.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
        Dtype::Bf16 => data.iter().for_each(|v| bytes.extend_from_slice(&bf16::from_f32(*v).to_le_bytes())),
        Dtype::Unspecified => return Err(ProtoError::UnsupportedDtype(dtype as i32)),
    }
    Ok(HiddenStates { dtype: dtype as i32, shape, data: Bytes::from(bytes) })
}

/// Validates a hidden-state message and returns its dtype, rows and cols.
pub fn validate_hidden(hidden: &HiddenStates) -> Result<(Dtype, usize, usize)> {
    let dtype = Dtype::try_from(hidden.dtype).map_err(|_| ProtoError::UnsupportedDtype(hidden.dtype))?;
    let elem = dtype_size(dtype)?;
    let &[rows, cols] = hidden.shape.as_slice() else {
        return Err(ProtoError::BadShape { shape: hidden.shape.clone() });
    };
    let too_large = || ProtoError::TooLarge { rows: u64::from(rows), cols: u64::from(cols) };
    let rows_us = usize::try_from(rows).map_err(|_| too_large())?;
    let cols_us = usize::try_from(cols).map_err(|_| too_large())?;
    let expected = rows_us.checked_mul(cols_us).and_then(|n| n.checked_mul(elem)).ok_or_else(too_large)?;
    if hidden.data.len() != expected {
        return Err(ProtoError::DataLength {
            rows: rows_us,
            cols: cols_us,
            dtype,
            expected,
            actual: hidden.data.len(),
        });
    }
    Ok((dtype, rows_us, cols_us))
}

/// Decodes a hidden-state message to row-major f32 values, returning `(values, rows, cols)`.
pub fn decode_to_f32(hidden: &HiddenStates) -> Result<(Vec<f32>, usize, usize)> {
    let (dtype, rows, cols) = validate_hidden(hidden)?;
    let bytes = hidden.data.as_ref();
    let values = match dtype {
        Dtype::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        Dtype::F16 => bytes.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        Dtype::Bf16 => bytes.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        Dtype::Unspecified => return Err(ProtoError::UnsupportedDtype(hidden.dtype)),
    };
    Ok((values, rows, cols))
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Row/column counts plus matching values, any f32 bit pattern except NaN (NaN != NaN).
    fn tensor() -> impl Strategy<Value = (usize, usize, Vec<f32>)> {
        (0usize..8, 0usize..16).prop_flat_map(|(rows, cols)| {
            let values = proptest::collection::vec(any::<f32>().prop_filter("not NaN", |v| !v.is_nan()), rows * cols);
            (Just(rows), Just(cols), values)
        })
    }

    proptest! {
        #[test]
        fn f32_round_trip_is_exact((rows, cols, values) in tensor()) {
            let hidden = encode_f32(&values, rows, cols, Dtype::F32)?;
            prop_assert_eq!(hidden.data.len(), rows * cols * 4);
            let (back, r, c) = decode_to_f32(&hidden)?;
            prop_assert_eq!((r, c), (rows, cols));
            prop_assert_eq!(back.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                            values.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }

        #[test]
        fn f16_round_trip_of_rounded_values_is_exact((rows, cols, values) in tensor()) {
            let rounded: Vec<f32> = values.iter().map(|v| f16::from_f32(*v).to_f32()).collect();
            let hidden = encode_f32(&rounded, rows, cols, Dtype::F16)?;
            prop_assert_eq!(hidden.data.len(), rows * cols * 2);
            let (back, r, c) = decode_to_f32(&hidden)?;
            prop_assert_eq!((r, c), (rows, cols));
            prop_assert_eq!(back, rounded);
        }

        #[test]
        fn bf16_round_trip_of_rounded_values_is_exact((rows, cols, values) in tensor()) {
            let rounded: Vec<f32> = values.iter().map(|v| bf16::from_f32(*v).to_f32()).collect();
            let hidden = encode_f32(&rounded, rows, cols, Dtype::Bf16)?;
            prop_assert_eq!(hidden.data.len(), rows * cols * 2);
            let (back, r, c) = decode_to_f32(&hidden)?;
            prop_assert_eq!((r, c), (rows, cols));
            prop_assert_eq!(back, rounded);
        }

        #[test]
        fn decoding_arbitrary_messages_never_panics(
            dtype in -2i32..6,
            shape in proptest::collection::vec(any::<u32>(), 0..4),
            data in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let hidden = HiddenStates { dtype, shape, data: Bytes::from(data) };
            if let Ok((values, rows, cols)) = decode_to_f32(&hidden) {
                prop_assert_eq!(values.len(), rows * cols);
            }
        }
    }

    #[test]
    fn wire_bytes_are_little_endian() -> Result<()> {
        let hidden = encode_f32(&[1.0, -2.0], 1, 2, Dtype::F32)?;
        assert_eq!(hidden.shape, vec![1, 2]);
        assert_eq!(hidden.data.as_ref(), &[0, 0, 0x80, 0x3f, 0, 0, 0, 0xc0]);
        let hidden = encode_f32(&[1.0], 1, 1, Dtype::F16)?;
        assert_eq!(hidden.data.as_ref(), &[0x00, 0x3c]);
        let hidden = encode_f32(&[1.0], 1, 1, Dtype::Bf16)?;
        assert_eq!(hidden.data.as_ref(), &[0x80, 0x3f]);
        Ok(())
    }

    #[test]
    fn bad_inputs_are_typed_errors() {
        assert!(matches!(
            encode_f32(&[1.0; 5], 2, 3, Dtype::F32),
            Err(ProtoError::ValueCount { expected: 6, actual: 5, .. })
        ));
        assert!(matches!(encode_f32(&[], 0, 0, Dtype::Unspecified), Err(ProtoError::UnsupportedDtype(0))));
        assert!(matches!(encode_f32(&[], usize::MAX, 2, Dtype::F32), Err(ProtoError::TooLarge { .. })));

        let ok = HiddenStates { dtype: Dtype::F16 as i32, shape: vec![2, 3], data: Bytes::from(vec![0u8; 12]) };
        assert!(decode_to_f32(&ok).is_ok());
        let short = HiddenStates { data: Bytes::from(vec![0u8; 11]), ..ok.clone() };
        assert!(matches!(decode_to_f32(&short), Err(ProtoError::DataLength { expected: 12, actual: 11, .. })));
        let three_d = HiddenStates { shape: vec![1, 2, 3], ..ok.clone() };
        assert!(matches!(decode_to_f32(&three_d), Err(ProtoError::BadShape { .. })));
        let unknown = HiddenStates { dtype: 42, ..ok.clone() };
        assert!(matches!(decode_to_f32(&unknown), Err(ProtoError::UnsupportedDtype(42))));
        let unspecified = HiddenStates { dtype: 0, ..ok.clone() };
        assert!(matches!(decode_to_f32(&unspecified), Err(ProtoError::UnsupportedDtype(0))));
        let huge = HiddenStates { shape: vec![u32::MAX, u32::MAX], ..ok };
        assert!(matches!(decode_to_f32(&huge), Err(ProtoError::DataLength { .. } | ProtoError::TooLarge { .. })));
    }
}
