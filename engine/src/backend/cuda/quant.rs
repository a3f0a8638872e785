//! Which kernel runs a block-quantized weight: kernel names from the format's [`BlockFormat::name`] and the
//! activation type, the route a matmul takes by its number of rows with its launch geometry, and the upload check
//! that refuses a format the kernel list lacks. Plain functions, so they are tested without a GPU.
//!
//! [`BlockFormat::name`]: crate::quant::BlockFormat::name

use strata_kernels::{GEMM_TILE, GEMV_MAX_ROWS, GEMV_ROWS_PER_BLOCK};

use crate::tensor::DType;
use crate::{Error, Result, quant};

/// From this many rows on, a quantized matmul dequantizes the weight into a scratch matrix and runs cuBLAS
/// (tensor cores) instead of the SIMT `gemm_*` kernel (docs/kernels.md, "Quantized matmul").
pub const DEQUANT_GEMM_MIN_ROWS: usize = 64;

/// Block size of `dequantize_*` (grid-stride, 8 elements per thread).
const DEQUANT_BLOCK: u32 = 256;

/// The kernels each block format needs on the CUDA backend: matmuls of every batch size and embedding rows.
const OPS: [&str; 4] = ["gemv", "gemm", "dequantize", "embedding"];

/// `<op>_<format>_<act>`, the name of a quantized kernel (kernels/src/lib.rs); `None` for a float `dtype`.
pub(super) fn kernel_name(op: &str, dtype: DType, act: DType) -> Option<String> {
    quant::format(dtype).map(|f| format!("{op}_{}_{act}", f.name))
}

/// Whether a `dtype` weight of `cols` columns can live on the CUDA backend with `act` activations: its format has
/// every kernel of [`OPS`] and its rows are whole blocks. The refusal names the format.
pub(super) fn check_upload(dtype: DType, cols: usize, act: DType) -> Result<()> {
    let Some(format) = quant::format(dtype) else {
        return Ok(());
    };
    for op in OPS {
        let name = format!("{op}_{}_{act}", format.name);
        if strata_kernels::module_of(&name).is_none() {
            return Err(Error::Shape {
                op: "upload_matrix",
                reason: format!(
                    "the CUDA backend has no {} kernels (no {name}); the CPU backend runs {} weights",
                    format.name, format.name
                ),
            });
        }
    }
    if !cols.is_multiple_of(format.block_elems) {
        return Err(Error::Shape {
            op: "upload_matrix",
            reason: format!("{} weights need a multiple of {} columns, got {cols}", format.name, format.block_elems),
        });
    }
    Ok(())
}

/// How a quantized matmul runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Route {
    /// `gemv_*`: each warp streams weight rows once for all `m <= GEMV_MAX_ROWS` tokens.
    Gemv,
    /// `gemm_*`: tiles dequantized into shared memory, each weight tile once per 64 tokens.
    Gemm,
    /// `dequantize_*` into a dense scratch matrix (once for all rows), then cuBLAS.
    DequantizeThenCublas,
}

/// The first kernel of a quantized matmul `y [m, n] = x [m, k] · w [n, k]ᵀ`, with its launch geometry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct QuantLaunch {
    pub route: Route,
    pub name: String,
    pub grid: (usize, usize, usize),
    pub block: u32,
}

/// The route and first launch of a quantized matmul on a GPU of `sm_count` SMs; `None` for a float `dtype`.
pub(super) fn matmul_launch(
    dtype: DType,
    act: DType,
    (m, n, k): (usize, usize, usize),
    sm_count: usize,
) -> Option<QuantLaunch> {
    let (route, op, grid, block) = if m <= GEMV_MAX_ROWS {
        (Route::Gemv, "gemv", (n.div_ceil(GEMV_ROWS_PER_BLOCK), 1, 1), 128)
    } else if m < DEQUANT_GEMM_MIN_ROWS {
        (Route::Gemm, "gemm", (n.div_ceil(GEMM_TILE), m.div_ceil(GEMM_TILE), 1), 256)
    } else {
        // Grid-stride: enough CTAs to fill the GPU, never more than there are groups of 8 to dequantize.
        let grid = (n * k / 8).div_ceil(DEQUANT_BLOCK as usize).clamp(1, sm_count.max(1) * 32);
        (Route::DequantizeThenCublas, "dequantize", (grid, 1, 1), DEQUANT_BLOCK)
    };
    Some(QuantLaunch { route, name: kernel_name(op, dtype, act)?, grid, block })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::FORMATS;
    // The formats with CUDA kernels; every other block format must be refused by name.
    use crate::testing::CUDA_FORMATS as WITH_KERNELS;

    #[test]
    fn every_format_with_kernels_resolves_every_op_in_every_activation_type() {
        for dtype in WITH_KERNELS {
            for act in [DType::F32, DType::F16, DType::BF16] {
                for op in OPS {
                    let name = kernel_name(op, dtype, act).unwrap_or_default();
                    assert_eq!(name, format!("{op}_{dtype}_{act}"));
                    assert!(strata_kernels::module_of(&name).is_some(), "{name} is not in the kernel list");
                }
                let cols = dtype.block_elems() * 3;
                assert!(check_upload(dtype, cols, act).is_ok(), "{dtype} with {act}");
            }
        }
        assert_eq!(kernel_name("gemv", DType::Q4_K, DType::BF16).as_deref(), Some("gemv_q4_k_bf16"));
        assert_eq!(kernel_name("gemv", DType::F16, DType::F16), None, "float weights go to cuBLAS");
    }

    #[test]
    fn formats_without_kernels_are_refused_naming_the_format() {
        let refused: Vec<DType> = FORMATS.iter().map(|f| f.dtype).filter(|d| !WITH_KERNELS.contains(d)).collect();
        assert!(refused.contains(&DType::Q8_K), "{refused:?}");
        for dtype in refused {
            let err = check_upload(dtype, dtype.block_elems(), DType::F16).err().map(|e| e.to_string());
            let err = err.unwrap_or_default();
            assert!(err.contains(&format!("the CUDA backend has no {dtype} kernels")), "{dtype}: {err}");
            assert!(err.contains(&format!("the CPU backend runs {dtype} weights")), "{dtype}: {err}");
        }
        assert!(check_upload(DType::F32, 7, DType::F16).is_ok(), "float weights are converted, not checked");
    }

    #[test]
    fn rows_must_be_whole_blocks() {
        let err = check_upload(DType::Q6_K, 576, DType::F32).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("q6_k weights need a multiple of 256 columns, got 576"), "{err}");
        assert!(check_upload(DType::Q5_0, 576, DType::F32).is_ok());
        assert!(check_upload(DType::Q5_1, 48, DType::F32).is_err());
    }

    #[test]
    fn the_route_and_geometry_follow_the_number_of_rows() {
        let launch = |m| matmul_launch(DType::Q4_K, DType::BF16, (m, 1000, 2048), 132);
        let gemv = launch(1).unwrap_or_else(|| panic!("q4_k has kernels"));
        assert_eq!(
            (gemv.route, gemv.name.as_str(), gemv.grid, gemv.block),
            (Route::Gemv, "gemv_q4_k_bf16", (125, 1, 1), 128)
        );
        assert_eq!(launch(GEMV_MAX_ROWS).map(|l| l.route), Some(Route::Gemv));
        let gemm = launch(9).unwrap_or_else(|| panic!("q4_k has kernels"));
        assert_eq!(
            (gemm.route, gemm.name.as_str(), gemm.grid, gemm.block),
            (Route::Gemm, "gemm_q4_k_bf16", (16, 1, 1), 256)
        );
        assert_eq!(launch(63).map(|l| l.grid), Some((16, 1, 1)));
        let deq = launch(64).unwrap_or_else(|| panic!("q4_k has kernels"));
        // 1000 × 2048 / 8 groups in CTAs of 256 would be 1000; capped at 32 per SM.
        assert_eq!(
            (deq.route, deq.name.as_str(), deq.grid, deq.block),
            (Route::DequantizeThenCublas, "dequantize_q4_k_bf16", (1000, 1, 1), 256)
        );
        assert_eq!(matmul_launch(DType::Q6_K, DType::F32, (100, 1000, 2048), 8).map(|l| l.grid), Some((256, 1, 1)));
        assert_eq!(matmul_launch(DType::Q5_0, DType::F32, (100, 1, 32), 8).map(|l| l.grid), Some((1, 1, 1)));
        assert!(matmul_launch(DType::F32, DType::F32, (1, 8, 8), 8).is_none());
    }
}
