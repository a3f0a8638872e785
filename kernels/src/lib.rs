//! CUDA kernel sources for strata, embedded as text and compiled at worker start with NVRTC.
//!
//! Nothing here touches CUDA: the crate only carries the `.cu` sources, the shared header and
//! the list of entry points, so it builds and tests on CPU-only machines. The CUDA backend
//! compiles each [`KernelModule`] for the device's compute capability (registering
//! [`COMMON_HEADER`] as the include `common.cuh`), caches the result on disk, and resolves
//! every name in [`KernelModule::functions`] once at start (skipping bf16 names on devices where
//! [`requires_sm80`] is true and the device is older).
//!
//! # ABI conventions
//!
//! * Every kernel is `extern "C"`, named `<op>_<dtype>` with dtype `f32`, `f16` or `bf16`
//!   (for casts `cast_<src>_<dst>`; for quantized ops `<op>_<format>_<dtype>` where the dtype is
//!   the activation dtype). bf16 kernels exist only on sm_80 and newer.
//! * Activations are row-major `[tokens, dim]`; weights row-major `[out_features, in_features]`.
//! * Device pointers first (inputs, then outputs), then sizes, then scalars, then strides.
//!   Sizes are `i32` except the element counts of the 1-D element-wise kernels, which are `i64`.
//!   Strides are in elements. 8-element vector paths need 16-byte aligned rows; the quantized
//!   matmuls and attention require it (see `docs/kernels.md`), the rest fall back to scalar code.
//! * Accumulation is f32 everywhere; outputs are rounded to the output dtype once.
//!
//! | kernel | arguments | launch (grid; block) |
//! |---|---|---|
//! | `embedding_<t>` | ids i32, table, out, n_tokens, dim, vocab | (n_tokens); 128 |
//! | `embedding_<q>_<t>` | ids i32, table blocks, out, n_tokens, dim, vocab | (n_tokens); 128 |
//! | `rmsnorm_<t>` | x, w, y, n_rows, dim, eps | (n_rows); 256 |
//! | `add_rmsnorm_<t>` | x, residual (in/out), w, y, n_rows, dim, eps | (n_rows); 256 |
//! | `rope_<t>` | q, k (in place), pos i32, inv_freq f32, n_tokens, n_heads, n_kv_heads, head_dim, q_stride, k_stride | (n_tokens); 256 |
//! | `silu_mul_<t>` | gate, up, out, n i64 | grid-stride; 256 |
//! | `add_<t>` | a, b, out, n i64 | grid-stride; 256 |
//! | `add_bias_<t>` | x (in place), bias, n_rows, dim | (n_rows); 256 |
//! | `kv_write_<t>` | k, v, k_cache, v_cache, slot_mapping i32, n_tokens, n_kv_heads, head_dim, k_stride, v_stride | (n_tokens); 128 |
//! | `attention_prefill_<t>` | q, k, v, out, cu_seqlens i32, n_heads, n_kv_heads, head_dim, scale, q_stride, kv_stride | (ceil(max_len/32), n_heads, num_seqs); 256 |
//! | `paged_attention_decode_<t>` | q, k_cache, v_cache, block_tables i32, context_lens i32, part_out f32, part_ml f32, out, n_heads, n_kv_heads, head_dim, block_size, max_blocks_per_seq, partition_size, scale, q_stride | (num_partitions, n_heads / G, num_seqs); 256 |
//! | `kv_write_q8_0_<t>`, `paged_attention_decode_q8_0_<t>` | as `kv_write_<t>` / `paged_attention_decode_<t>` with Q8_0 `k_cache`/`v_cache` blocks | as those |
//! | `paged_attention_reduce_<t>` | part_out f32, part_ml f32, context_lens i32, out, n_heads, head_dim, num_partitions, partition_size | (n_heads, num_seqs); 128 |
//! | `gemv_<q>_<t>` | w, x, y, m, n, k | (ceil(n/8)); 128 |
//! | `gemm_<q>_<t>` | w, x, y, m, n, k | (ceil(n/64), ceil(m/64)); 256 |
//! | `dequantize_<q>_<t>` | w, out, n, k | grid-stride; 256 |
//! | `gemv_i8_<t>`, `gemm_i8_<t>` | w, scale f32, x, y, m, n, k | as above |
//! | `dequantize_i8_<t>` | w, scale f32, out, n, k | grid-stride; 256 |
//! | `argmax_f32` | logits, out i32, n_rows, vocab | (n_rows); 1024 |
//! | `sample_f32` | logits, uniform f32, temperature f32, top_k i32, top_p f32, out i32, n_rows, vocab | (n_rows); 1024 |
//! | `cast_<s>_<d>` | in, out, n i64 | grid-stride; 256 |
//!
//! `<q>` is one of `q8_0`, `q4_0`, `q4_1`, `q5_0`, `q5_1` (32-element blocks) or `q2_k`, `q3_k`, `q4_k`, `q5_k`,
//! `q6_k` (256-element K-quant super-blocks): GGML block formats in GGUF byte layout, named as the engine's
//! `BlockFormat::name`. A format missing here has no CUDA kernels (the backend refuses it at upload).

/// One `.cu` translation unit and the entry points it defines.
#[derive(Debug, Clone, Copy)]
pub struct KernelModule {
    /// Module name, also the source file stem (`norm` for `norm.cu`).
    pub name: &'static str,
    /// Full CUDA source text, compiled with [`COMMON_HEADER`] available as `common.cuh`.
    pub source: &'static str,
    /// Every `extern "C" __global__` entry point in the source.
    pub functions: &'static [&'static str],
}

/// Include name under which [`COMMON_HEADER`] must be registered with NVRTC.
pub const COMMON_HEADER_NAME: &str = "common.cuh";

/// Text of the shared header (conversions, vector loads, reductions, block-quant structs).
pub const COMMON_HEADER: &str = include_str!("../common.cuh");

/// Lowest compute capability the kernels are written for (bf16 needs 80, see [`requires_sm80`]).
pub const MIN_COMPUTE_CAPABILITY: u32 = 70;

/// Compute capability the kernels are tuned for (H100 / H200).
pub const TARGET_COMPUTE_CAPABILITY: u32 = 90;

/// Head dimensions the attention kernels support; the host must reject others.
pub const SUPPORTED_HEAD_DIMS: &[usize] = &[64, 128];

/// Largest `m` (activation rows) the `gemv_*` kernels accept; larger batches use `gemm_*`.
pub const GEMV_MAX_ROWS: usize = 8;

/// Output rows handled by one `gemv_*` CTA (4 warps x 2 rows): grid = ceil(n / this).
pub const GEMV_ROWS_PER_BLOCK: usize = 8;

/// Output tile edge of `gemm_*` (both m and n): grid = (ceil(n / 64), ceil(m / 64)).
pub const GEMM_TILE: usize = 64;

/// Query rows per CTA of `attention_prefill_*`: grid.x = ceil(max_seq_len / this).
pub const PREFILL_QUERY_TILE: usize = 32;

/// Upper bound on `partition_size` for `paged_attention_decode_*`.
pub const DECODE_MAX_PARTITION: usize = 512;

/// Elements per quantization block of the 32-element formats (Q8_0 / Q4_x / Q5_x); `k` must be a multiple
/// of it (of 256 for the K-quants: the host checks `k` against the engine's block table).
pub const QUANT_BLOCK: usize = 32;

/// Query heads one `paged_attention_decode_*` CTA handles: the largest of 8, 4, 2, 1 dividing
/// the GQA group size. grid.y = n_heads / this. Returns `None` if n_heads is not a multiple of
/// n_kv_heads (or either is zero).
pub fn decode_heads_per_cta(n_heads: usize, n_kv_heads: usize) -> Option<usize> {
    if n_heads == 0 || n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
        return None;
    }
    let group = n_heads / n_kv_heads;
    [8, 4, 2, 1].into_iter().find(|g| group.is_multiple_of(*g))
}

/// True for kernels that only exist when compiled for sm_80 or newer (anything touching bf16).
pub fn requires_sm80(function: &str) -> bool {
    function.split('_').any(|part| part == "bf16")
}

/// Embedding gathers (dense tables and every block format of [`QUANT`]).
pub const EMBEDDING: KernelModule = KernelModule {
    name: "embedding",
    source: include_str!("../embedding.cu"),
    functions: &[
        "embedding_f32",
        "embedding_f16",
        "embedding_bf16",
        "embedding_q8_0_f32",
        "embedding_q8_0_f16",
        "embedding_q8_0_bf16",
        "embedding_q4_0_f32",
        "embedding_q4_0_f16",
        "embedding_q4_0_bf16",
        "embedding_q4_1_f32",
        "embedding_q4_1_f16",
        "embedding_q4_1_bf16",
        "embedding_q5_0_f32",
        "embedding_q5_0_f16",
        "embedding_q5_0_bf16",
        "embedding_q5_1_f32",
        "embedding_q5_1_f16",
        "embedding_q5_1_bf16",
        "embedding_q4_k_f32",
        "embedding_q4_k_f16",
        "embedding_q4_k_bf16",
        "embedding_q5_k_f32",
        "embedding_q5_k_f16",
        "embedding_q5_k_bf16",
        "embedding_q6_k_f32",
        "embedding_q2_k_f32",
        "embedding_q3_k_f32",
        "embedding_q6_k_f16",
        "embedding_q2_k_f16",
        "embedding_q3_k_f16",
        "embedding_q6_k_bf16",
        "embedding_q2_k_bf16",
        "embedding_q3_k_bf16",
    ],
};

/// RMSNorm and fused residual-add + RMSNorm.
pub const NORM: KernelModule = KernelModule {
    name: "norm",
    source: include_str!("../norm.cu"),
    functions: &[
        "rmsnorm_f32",
        "rmsnorm_f16",
        "rmsnorm_bf16",
        "add_rmsnorm_f32",
        "add_rmsnorm_f16",
        "add_rmsnorm_bf16",
    ],
};

/// Rotary position embedding (HF rotate_half layout), in place on q and k.
pub const ROPE: KernelModule = KernelModule {
    name: "rope",
    source: include_str!("../rope.cu"),
    functions: &["rope_f32", "rope_f16", "rope_bf16"],
};

/// SiLU-gated product, residual add and bias add.
pub const ACTIVATION: KernelModule = KernelModule {
    name: "activation",
    source: include_str!("../activation.cu"),
    functions: &[
        "silu_mul_f32",
        "silu_mul_f16",
        "silu_mul_bf16",
        "add_f32",
        "add_f16",
        "add_bf16",
        "add_bias_f32",
        "add_bias_f16",
        "add_bias_bf16",
    ],
};

/// Prefill attention, paged-KV decode attention (+ reduce) and the KV-cache write, with the cache in the
/// activation type or Q8_0.
pub const ATTENTION: KernelModule = KernelModule {
    name: "attention",
    source: include_str!("../attention.cu"),
    functions: &[
        "kv_write_f32",
        "kv_write_f16",
        "kv_write_bf16",
        "kv_write_q8_0_f32",
        "kv_write_q8_0_f16",
        "kv_write_q8_0_bf16",
        "attention_prefill_f32",
        "attention_prefill_f16",
        "attention_prefill_bf16",
        "paged_attention_decode_f32",
        "paged_attention_decode_f16",
        "paged_attention_decode_bf16",
        "paged_attention_decode_q8_0_f32",
        "paged_attention_decode_q8_0_f16",
        "paged_attention_decode_q8_0_bf16",
        "paged_attention_reduce_f32",
        "paged_attention_reduce_f16",
        "paged_attention_reduce_bf16",
    ],
};

/// Quantized GEMV / GEMM / dequantize for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and weight-only
/// int8.
pub const QUANT: KernelModule = KernelModule {
    name: "quant",
    source: include_str!("../quant.cu"),
    functions: &[
        "gemv_q8_0_f32",
        "gemv_q8_0_f16",
        "gemv_q8_0_bf16",
        "gemv_q4_0_f32",
        "gemv_q4_0_f16",
        "gemv_q4_0_bf16",
        "gemv_q4_1_f32",
        "gemv_q4_1_f16",
        "gemv_q4_1_bf16",
        "gemv_i8_f32",
        "gemv_i8_f16",
        "gemv_i8_bf16",
        "gemm_q8_0_f32",
        "gemm_q8_0_f16",
        "gemm_q8_0_bf16",
        "gemm_q4_0_f32",
        "gemm_q4_0_f16",
        "gemm_q4_0_bf16",
        "gemm_q4_1_f32",
        "gemm_q4_1_f16",
        "gemm_q4_1_bf16",
        "gemm_i8_f32",
        "gemm_i8_f16",
        "gemm_i8_bf16",
        "dequantize_q8_0_f32",
        "dequantize_q8_0_f16",
        "dequantize_q8_0_bf16",
        "dequantize_q4_0_f32",
        "dequantize_q4_0_f16",
        "dequantize_q4_0_bf16",
        "dequantize_q4_1_f32",
        "dequantize_q4_1_f16",
        "dequantize_q4_1_bf16",
        "dequantize_i8_f32",
        "dequantize_i8_f16",
        "dequantize_i8_bf16",
        "gemv_q5_0_f32",
        "gemv_q5_0_f16",
        "gemv_q5_0_bf16",
        "gemv_q5_1_f32",
        "gemv_q5_1_f16",
        "gemv_q5_1_bf16",
        "gemv_q4_k_f32",
        "gemv_q4_k_f16",
        "gemv_q4_k_bf16",
        "gemv_q5_k_f32",
        "gemv_q5_k_f16",
        "gemv_q5_k_bf16",
        "gemv_q6_k_f32",
        "gemv_q2_k_f32",
        "gemv_q3_k_f32",
        "gemv_q6_k_f16",
        "gemv_q2_k_f16",
        "gemv_q3_k_f16",
        "gemv_q6_k_bf16",
        "gemv_q2_k_bf16",
        "gemv_q3_k_bf16",
        "gemm_q5_0_f32",
        "gemm_q5_0_f16",
        "gemm_q5_0_bf16",
        "gemm_q5_1_f32",
        "gemm_q5_1_f16",
        "gemm_q5_1_bf16",
        "gemm_q4_k_f32",
        "gemm_q4_k_f16",
        "gemm_q4_k_bf16",
        "gemm_q5_k_f32",
        "gemm_q5_k_f16",
        "gemm_q5_k_bf16",
        "gemm_q6_k_f32",
        "gemm_q2_k_f32",
        "gemm_q3_k_f32",
        "gemm_q6_k_f16",
        "gemm_q2_k_f16",
        "gemm_q3_k_f16",
        "gemm_q6_k_bf16",
        "gemm_q2_k_bf16",
        "gemm_q3_k_bf16",
        "dequantize_q5_0_f32",
        "dequantize_q5_0_f16",
        "dequantize_q5_0_bf16",
        "dequantize_q5_1_f32",
        "dequantize_q5_1_f16",
        "dequantize_q5_1_bf16",
        "dequantize_q4_k_f32",
        "dequantize_q4_k_f16",
        "dequantize_q4_k_bf16",
        "dequantize_q5_k_f32",
        "dequantize_q5_k_f16",
        "dequantize_q5_k_bf16",
        "dequantize_q6_k_f32",
        "dequantize_q2_k_f32",
        "dequantize_q3_k_f32",
        "dequantize_q6_k_f16",
        "dequantize_q2_k_f16",
        "dequantize_q3_k_f16",
        "dequantize_q6_k_bf16",
        "dequantize_q2_k_bf16",
        "dequantize_q3_k_bf16",
    ],
};

/// Argmax and temperature / top-k / top-p sampling over f32 logits.
pub const SAMPLING: KernelModule =
    KernelModule { name: "sampling", source: include_str!("../sampling.cu"), functions: &["argmax_f32", "sample_f32"] };

/// dtype conversions between f32, f16 and bf16.
pub const CAST: KernelModule = KernelModule {
    name: "cast",
    source: include_str!("../cast.cu"),
    functions: &["cast_f32_f16", "cast_f16_f32", "cast_f32_bf16", "cast_bf16_f32", "cast_f16_bf16", "cast_bf16_f16"],
};

/// Every kernel module, in the order the worker compiles them.
pub const MODULES: &[KernelModule] = &[EMBEDDING, NORM, ROPE, ACTIVATION, ATTENTION, QUANT, SAMPLING, CAST];

/// Finds the module that defines `function`, if any.
pub fn module_of(function: &str) -> Option<&'static KernelModule> {
    MODULES.iter().find(|m| m.functions.contains(&function))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// Names of every `__global__` function in `source`, from definitions and declarations.
    fn globals_in(source: &str) -> Vec<String> {
        let mut names = Vec::new();
        for line in source.lines() {
            let Some(pos) = line.find("__global__") else {
                continue;
            };
            if line.trim_start().starts_with("//") {
                continue;
            }
            let mut rest = &line[pos..];
            // step over `__launch_bounds__(...)` so the name is the identifier before the
            // parameter list
            if let Some(lb) = rest.find("__launch_bounds__(") {
                let Some(close) = rest[lb..].find(')') else {
                    continue;
                };
                rest = &rest[lb + close + 1..];
            }
            let Some(paren) = rest.find('(') else {
                continue;
            };
            let name = rest[..paren].split_whitespace().last().unwrap_or_default();
            names.push(name.to_string());
        }
        names
    }

    #[test]
    fn every_listed_function_is_defined_with_the_plain_signature() {
        for m in MODULES {
            for f in m.functions {
                let needle = format!("extern \"C\" __global__ void {f}(");
                assert!(m.source.contains(&needle), "{}.cu does not define `{needle}`", m.name);
            }
        }
    }

    #[test]
    fn every_global_in_the_sources_is_listed() {
        for m in MODULES {
            let listed: BTreeSet<&str> = m.functions.iter().copied().collect();
            let found = globals_in(m.source);
            assert!(!found.is_empty(), "{}.cu defines no kernels", m.name);
            for name in &found {
                assert!(listed.contains(name.as_str()), "{}.cu defines `{name}` but it is not listed", m.name);
            }
        }
    }

    #[test]
    fn names_are_unique_and_follow_the_dtype_convention() {
        let mut seen = BTreeSet::new();
        for m in MODULES {
            for f in m.functions {
                assert!(seen.insert(*f), "`{f}` listed twice");
                let last = f.rsplit('_').next().unwrap_or_default();
                assert!(matches!(last, "f32" | "f16" | "bf16"), "`{f}` does not end in a dtype");
            }
        }
    }

    #[test]
    fn bf16_kernels_are_guarded_by_arch() {
        for m in MODULES {
            for f in m.functions.iter().filter(|f| requires_sm80(f)) {
                let def = format!("extern \"C\" __global__ void {f}(");
                let at = m.source.find(&def).expect("checked by another test");
                let guard = m.source[..at].rfind("#if STRATA_HAS_BF16");
                let end = m.source[..at].rfind("#endif");
                assert!(
                    matches!((guard, end), (Some(g), e) if e.is_none_or(|e| e < g)),
                    "`{f}` in {}.cu is not inside `#if STRATA_HAS_BF16`",
                    m.name
                );
            }
        }
    }

    #[test]
    fn sources_include_the_common_header() {
        for m in MODULES {
            assert!(m.source.contains("#include \"common.cuh\""), "{}.cu", m.name);
        }
        assert!(COMMON_HEADER.contains("#pragma once"));
    }

    #[test]
    fn globals_parser_sees_declarations_with_launch_bounds() {
        let src = "extern \"C\" __global__ void __launch_bounds__(128, 4) foo_f32(int a);\n\
                   extern \"C\" __global__ void GEMV_BOUNDS bar_f16(int a);\n\
                   extern \"C\" __global__ void baz_bf16(int a) {}\n";
        assert_eq!(globals_in(src), ["foo_f32", "bar_f16", "baz_bf16"]);
    }

    #[test]
    fn heads_per_cta_picks_the_largest_divisor() {
        assert_eq!(decode_heads_per_cta(32, 8), Some(4));
        assert_eq!(decode_heads_per_cta(64, 8), Some(8));
        assert_eq!(decode_heads_per_cta(128, 8), Some(8));
        assert_eq!(decode_heads_per_cta(24, 4), Some(2));
        assert_eq!(decode_heads_per_cta(32, 32), Some(1));
        assert_eq!(decode_heads_per_cta(30, 4), None);
        assert_eq!(decode_heads_per_cta(8, 0), None);
    }

    #[test]
    fn module_lookup_and_arch_requirements() {
        assert_eq!(module_of("paged_attention_decode_f16").map(|m| m.name), Some("attention"));
        assert!(module_of("nope_f32").is_none());
        assert!(requires_sm80("gemv_q8_0_bf16"));
        assert!(requires_sm80("cast_bf16_f32"));
        assert!(!requires_sm80("gemv_q8_0_f16"));
    }
}
