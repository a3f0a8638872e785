// Token-embedding gather. out[t, :] = table[ids[t], :]. Ids outside [0, vocab) give a zero row
// (the host validates ids; this only keeps a bad id from reading out of bounds).
// Launch: grid (n_tokens), block 128 (any multiple of 32 works).
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void embedding_impl(const int* __restrict__ ids, const T* __restrict__ table,
                                               T* __restrict__ out, int n_tokens, int dim, int vocab) {
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    const int id = ids[t];
    T* dst = out + (i64)t * dim;
    if (id < 0 || id >= vocab) {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = from_f32<T>(0.0f);
        return;
    }
    const T* src = table + (i64)id * dim;
    // Rows are copied as raw 16-byte words when the row start is 16-byte aligned.
    if (aligned16(src) && aligned16(dst) && (dim * sizeof(T)) % 16 == 0) {
        const int nv = dim * (int)sizeof(T) / 16;
        const uint4* s = reinterpret_cast<const uint4*>(src);
        uint4* d = reinterpret_cast<uint4*>(dst);
        for (int i = threadIdx.x; i < nv; i += blockDim.x) d[i] = s[i];
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) dst[i] = src[i];
    }
}

// Dequantizing gather from a GGML block table; dim a multiple of the block (32, 256 for the
// K-quants). One thread per 8 outputs.
template <typename B, typename T>
__device__ __forceinline__ void embedding_quant_impl(const int* __restrict__ ids, const void* __restrict__ table,
                                                     T* __restrict__ out, int n_tokens, int dim, int vocab) {
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    const int id = ids[t];
    T* dst = out + (i64)t * dim;
    const int n8 = dim / 8;
    const B* row = reinterpret_cast<const B*>(table) + (i64)id * (dim / qk_of<B>::value);
    const bool vec = aligned16(dst);
    for (int j8 = threadIdx.x; j8 < n8; j8 += blockDim.x) {
        float o[8];
        if (id < 0 || id >= vocab) {
#pragma unroll
            for (int i = 0; i < 8; ++i) o[i] = 0.0f;
        } else {
            dequant8(row, j8, o);
        }
        if (vec) {
            store8(dst + j8 * 8, o);
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) dst[j8 * 8 + i] = from_f32<T>(o[i]);
        }
    }
}

// args: (ids i32 [n_tokens], table [vocab, dim], out [n_tokens, dim], n_tokens, dim, vocab)
extern "C" __global__ void embedding_f32(const int* ids, const float* table, float* out, int n_tokens, int dim, int vocab) { embedding_impl(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_f16(const int* ids, const __half* table, __half* out, int n_tokens, int dim, int vocab) { embedding_impl(ids, table, out, n_tokens, dim, vocab); }

// args: (ids i32 [n_tokens], table blocks [vocab, dim / block], out [n_tokens, dim], n_tokens, dim, vocab)
// The suffix names the output dtype.
extern "C" __global__ void embedding_q8_0_f32(const int* ids, const void* table, float* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q8_0>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q8_0_f16(const int* ids, const void* table, __half* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q8_0>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q4_0_f32(const int* ids, const void* table, float* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q4_0>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q4_0_f16(const int* ids, const void* table, __half* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q4_0>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q4_1_f32(const int* ids, const void* table, float* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q4_1>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q4_1_f16(const int* ids, const void* table, __half* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q4_1>(ids, table, out, n_tokens, dim, vocab); }

extern "C" __global__ void embedding_q5_0_f32(const int* ids, const void* table, float* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q5_0>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q5_1_f32(const int* ids, const void* table, float* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q5_1>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q4_k_f32(const int* ids, const void* table, float* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q4_K>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q5_k_f32(const int* ids, const void* table, float* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q5_K>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q6_k_f32(const int* ids, const void* table, float* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q6_K>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q2_k_f32(const int* ids, const void* table, float* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q2_K>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q3_k_f32(const int* ids, const void* table, float* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q3_K>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q5_0_f16(const int* ids, const void* table, __half* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q5_0>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q5_1_f16(const int* ids, const void* table, __half* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q5_1>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q4_k_f16(const int* ids, const void* table, __half* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q4_K>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q5_k_f16(const int* ids, const void* table, __half* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q5_K>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q6_k_f16(const int* ids, const void* table, __half* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q6_K>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q2_k_f16(const int* ids, const void* table, __half* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q2_K>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q3_k_f16(const int* ids, const void* table, __half* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q3_K>(ids, table, out, n_tokens, dim, vocab); }
#if STRATA_HAS_BF16
extern "C" __global__ void embedding_bf16(const int* ids, const __nv_bfloat16* table, __nv_bfloat16* out, int n_tokens, int dim, int vocab) { embedding_impl(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q8_0_bf16(const int* ids, const void* table, __nv_bfloat16* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q8_0>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q4_0_bf16(const int* ids, const void* table, __nv_bfloat16* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q4_0>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q4_1_bf16(const int* ids, const void* table, __nv_bfloat16* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q4_1>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q5_0_bf16(const int* ids, const void* table, __nv_bfloat16* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q5_0>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q5_1_bf16(const int* ids, const void* table, __nv_bfloat16* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q5_1>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q4_k_bf16(const int* ids, const void* table, __nv_bfloat16* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q4_K>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q5_k_bf16(const int* ids, const void* table, __nv_bfloat16* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q5_K>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q6_k_bf16(const int* ids, const void* table, __nv_bfloat16* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q6_K>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q2_k_bf16(const int* ids, const void* table, __nv_bfloat16* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q2_K>(ids, table, out, n_tokens, dim, vocab); }
extern "C" __global__ void embedding_q3_k_bf16(const int* ids, const void* table, __nv_bfloat16* out, int n_tokens, int dim, int vocab) { embedding_quant_impl<block_q3_K>(ids, table, out, n_tokens, dim, vocab); }
#endif
