// Element-wise ops of the MLP and the residual stream. 1-D grid-stride, f32 math, one rounding
// to the output dtype. Intended launch: 256 threads x min(ceil(n / 2048), 65535) blocks.
// The 128-bit path is taken when every pointer is 16-byte aligned; otherwise scalar.
#include "common.cuh"

__device__ __forceinline__ float silu(float x) { return x / (1.0f + expf(-x)); }

// out[i] = silu(gate[i]) * up[i]
template <typename T>
__device__ __forceinline__ void silu_mul_impl(const T* __restrict__ gate, const T* __restrict__ up,
                                              T* __restrict__ out, i64 n) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    i64 done = 0;
    if (aligned16(gate) && aligned16(up) && aligned16(out)) {
        const i64 nv = n / 8;
        for (i64 v = tid; v < nv; v += stride) {
            float g[8], u[8];
            load8(gate + v * 8, g);
            load8(up + v * 8, u);
#pragma unroll
            for (int j = 0; j < 8; ++j) g[j] = silu(g[j]) * u[j];
            store8(out + v * 8, g);
        }
        done = nv * 8;
    }
    for (i64 i = done + tid; i < n; i += stride) out[i] = from_f32<T>(silu(to_f32(gate[i])) * to_f32(up[i]));
}

// out[i] = a[i] + b[i] (out may alias a or b)
template <typename T>
__device__ __forceinline__ void add_impl(const T* a, const T* b, T* out, i64 n) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    i64 done = 0;
    if (aligned16(a) && aligned16(b) && aligned16(out)) {
        const i64 nv = n / 8;
        for (i64 v = tid; v < nv; v += stride) {
            float x[8], y[8];
            load8(a + v * 8, x);
            load8(b + v * 8, y);
#pragma unroll
            for (int j = 0; j < 8; ++j) x[j] += y[j];
            store8(out + v * 8, x);
        }
        done = nv * 8;
    }
    for (i64 i = done + tid; i < n; i += stride) out[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i]));
}

// x[r, c] += bias[c], in place (the bias of a linear layer, broadcast over rows). One CTA per row.
// Launch: grid (n_rows), block 256.
template <typename T>
__device__ __forceinline__ void add_bias_impl(T* __restrict__ x, const T* __restrict__ bias, int n_rows, int dim) {
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    T* xr = x + (i64)r * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) xr[i] = from_f32<T>(to_f32(xr[i]) + to_f32(bias[i]));
}

extern "C" __global__ void silu_mul_f32(const float* gate, const float* up, float* out, i64 n) { silu_mul_impl(gate, up, out, n); }
extern "C" __global__ void silu_mul_f16(const __half* gate, const __half* up, __half* out, i64 n) { silu_mul_impl(gate, up, out, n); }
extern "C" __global__ void add_f32(const float* a, const float* b, float* out, i64 n) { add_impl(a, b, out, n); }
extern "C" __global__ void add_f16(const __half* a, const __half* b, __half* out, i64 n) { add_impl(a, b, out, n); }
// args: (x [n_rows, dim] in/out, bias [dim], n_rows, dim)
extern "C" __global__ void add_bias_f32(float* x, const float* bias, int n_rows, int dim) { add_bias_impl(x, bias, n_rows, dim); }
extern "C" __global__ void add_bias_f16(__half* x, const __half* bias, int n_rows, int dim) { add_bias_impl(x, bias, n_rows, dim); }

#if STRATA_HAS_BF16
extern "C" __global__ void silu_mul_bf16(const __nv_bfloat16* gate, const __nv_bfloat16* up, __nv_bfloat16* out, i64 n) { silu_mul_impl(gate, up, out, n); }
extern "C" __global__ void add_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, __nv_bfloat16* out, i64 n) { add_impl(a, b, out, n); }
extern "C" __global__ void add_bias_bf16(__nv_bfloat16* x, const __nv_bfloat16* bias, int n_rows, int dim) { add_bias_impl(x, bias, n_rows, dim); }
#endif
