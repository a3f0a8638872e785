// Rotary position embedding, HF "rotate_half" (non-interleaved) layout, applied in place to q and
// k. For pair i in [0, head_dim/2): a = x[i], b = x[i + head_dim/2], theta = pos * inv_freq[i];
// x[i] = a cos - b sin, x[i + half] = b cos + a sin. Angles and rotation in f32 (precise sincosf,
// positions can be large), one rounding to T. inv_freq (f32, [head_dim/2]) is computed on the
// host, so llama3 / linear / NTK scaling is the host's business.
// Launch: grid (n_tokens), block 256 (multiple of 32). Row strides let q and k live inside a
// fused qkv buffer: q row t starts at q + t * q_stride, k row t at k + t * k_stride (elements).
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void rope_impl(T* __restrict__ q, T* __restrict__ k, const int* __restrict__ pos,
                                          const float* __restrict__ inv_freq, int n_tokens, int n_heads,
                                          int n_kv_heads, int head_dim, int q_stride, int k_stride) {
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    const int half = head_dim / 2;
    const float p = (float)pos[t];
    T* qr = q + (i64)t * q_stride;
    T* kr = k + (i64)t * k_stride;
    const int total = (n_heads + n_kv_heads) * half;
    for (int idx = threadIdx.x; idx < total; idx += blockDim.x) {
        const int head = idx / half, i = idx - head * half;
        T* x = head < n_heads ? qr + head * head_dim : kr + (head - n_heads) * head_dim;
        float s, c;
        sincosf(p * inv_freq[i], &s, &c);
        const float a = to_f32(x[i]), b = to_f32(x[i + half]);
        x[i] = from_f32<T>(a * c - b * s);
        x[i + half] = from_f32<T>(b * c + a * s);
    }
}

// args: (q [n_tokens, n_heads, head_dim] in/out, k [n_tokens, n_kv_heads, head_dim] in/out,
//        pos i32 [n_tokens], inv_freq f32 [head_dim / 2], n_tokens, n_heads, n_kv_heads, head_dim,
//        q_stride, k_stride)
extern "C" __global__ void rope_f32(float* q, float* k, const int* pos, const float* inv_freq, int n_tokens, int n_heads, int n_kv_heads, int head_dim, int q_stride, int k_stride) { rope_impl(q, k, pos, inv_freq, n_tokens, n_heads, n_kv_heads, head_dim, q_stride, k_stride); }
extern "C" __global__ void rope_f16(__half* q, __half* k, const int* pos, const float* inv_freq, int n_tokens, int n_heads, int n_kv_heads, int head_dim, int q_stride, int k_stride) { rope_impl(q, k, pos, inv_freq, n_tokens, n_heads, n_kv_heads, head_dim, q_stride, k_stride); }

#if STRATA_HAS_BF16
extern "C" __global__ void rope_bf16(__nv_bfloat16* q, __nv_bfloat16* k, const int* pos, const float* inv_freq, int n_tokens, int n_heads, int n_kv_heads, int head_dim, int q_stride, int k_stride) { rope_impl(q, k, pos, inv_freq, n_tokens, n_heads, n_kv_heads, head_dim, q_stride, k_stride); }
#endif
