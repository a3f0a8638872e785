// RMSNorm over the last dimension: y = x / sqrt(mean(x^2) + eps) * w.
// Sum of squares in f32 (fixed reduction tree), scale applied in f32, one rounding to T.
// Launch: grid (n_rows), block 256 (a multiple of 32, <= 1024). 128-bit path when dim % 8 == 0
// and the pointers are 16-byte aligned.
#include "common.cuh"

template <typename T>
__device__ __forceinline__ void rmsnorm_impl(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                                             int n_rows, int dim, float eps) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= n_rows) return;
    const T* xr = x + (i64)row * dim;
    T* yr = y + (i64)row * dim;
    const bool vec = dim % 8 == 0 && aligned16(xr) && aligned16(yr) && aligned16(w);
    float ss = 0.0f;
    if (vec) {
        for (int i = threadIdx.x * 8; i < dim; i += blockDim.x * 8) {
            float v[8];
            load8(xr + i, v);
#pragma unroll
            for (int j = 0; j < 8; ++j) ss = fmaf(v[j], v[j], ss);
        }
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            const float v = to_f32(xr[i]);
            ss = fmaf(v, v, ss);
        }
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)dim + eps);
    if (vec) {
        for (int i = threadIdx.x * 8; i < dim; i += blockDim.x * 8) {
            float v[8], g[8];
            load8(xr + i, v);
            load8(w + i, g);
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = v[j] * inv * g[j];
            store8(yr + i, v);
        }
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = from_f32<T>(to_f32(xr[i]) * inv * to_f32(w[i]));
    }
}

// residual <- residual + x (rounded to T); y <- rmsnorm(residual) * w, computed from the rounded
// sum so the result equals running `add` then `rmsnorm` separately.
template <typename T>
__device__ __forceinline__ void add_rmsnorm_impl(const T* __restrict__ x, T* __restrict__ residual,
                                                 const T* __restrict__ w, T* __restrict__ y, int n_rows, int dim,
                                                 float eps) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= n_rows) return;
    const T* xr = x + (i64)row * dim;
    T* rr = residual + (i64)row * dim;
    T* yr = y + (i64)row * dim;
    const bool vec = dim % 8 == 0 && aligned16(xr) && aligned16(rr) && aligned16(yr) && aligned16(w);
    float ss = 0.0f;
    if (vec) {
        for (int i = threadIdx.x * 8; i < dim; i += blockDim.x * 8) {
            float a[8], b[8];
            load8(xr + i, a);
            load8(rr + i, b);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                a[j] = to_f32(from_f32<T>(a[j] + b[j]));
                ss = fmaf(a[j], a[j], ss);
            }
            store8(rr + i, a);
        }
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            const T r = from_f32<T>(to_f32(xr[i]) + to_f32(rr[i]));
            rr[i] = r;
            const float v = to_f32(r);
            ss = fmaf(v, v, ss);
        }
    }
    // Each thread re-reads only the elements it wrote itself, so no barrier is needed for `rr`
    // beyond the one inside block_sum.
    const float inv = rsqrtf(block_sum(ss, scratch) / (float)dim + eps);
    if (vec) {
        for (int i = threadIdx.x * 8; i < dim; i += blockDim.x * 8) {
            float v[8], g[8];
            load8(rr + i, v);
            load8(w + i, g);
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = v[j] * inv * g[j];
            store8(yr + i, v);
        }
    } else {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) yr[i] = from_f32<T>(to_f32(rr[i]) * inv * to_f32(w[i]));
    }
}

// args: (x [n_rows, dim], w [dim], y [n_rows, dim], n_rows, dim, eps)
extern "C" __global__ void rmsnorm_f32(const float* x, const float* w, float* y, int n_rows, int dim, float eps) { rmsnorm_impl(x, w, y, n_rows, dim, eps); }
extern "C" __global__ void rmsnorm_f16(const __half* x, const __half* w, __half* y, int n_rows, int dim, float eps) { rmsnorm_impl(x, w, y, n_rows, dim, eps); }
// args: (x [n_rows, dim], residual [n_rows, dim] in/out, w [dim], y [n_rows, dim], n_rows, dim, eps)
extern "C" __global__ void add_rmsnorm_f32(const float* x, float* residual, const float* w, float* y, int n_rows, int dim, float eps) { add_rmsnorm_impl(x, residual, w, y, n_rows, dim, eps); }
extern "C" __global__ void add_rmsnorm_f16(const __half* x, __half* residual, const __half* w, __half* y, int n_rows, int dim, float eps) { add_rmsnorm_impl(x, residual, w, y, n_rows, dim, eps); }

#if STRATA_HAS_BF16
extern "C" __global__ void rmsnorm_bf16(const __nv_bfloat16* x, const __nv_bfloat16* w, __nv_bfloat16* y, int n_rows, int dim, float eps) { rmsnorm_impl(x, w, y, n_rows, dim, eps); }
extern "C" __global__ void add_rmsnorm_bf16(const __nv_bfloat16* x, __nv_bfloat16* residual, const __nv_bfloat16* w, __nv_bfloat16* y, int n_rows, int dim, float eps) { add_rmsnorm_impl(x, residual, w, y, n_rows, dim, eps); }
#endif
