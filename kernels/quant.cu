// Quantized matmuls with the weight dequantized in registers: y[m, n] = sum_k x[m, k] * W[n, k].
//   W: GGML blocks Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1, row-major [n, k / 32] blocks, or K-quant
//      super-blocks Q2_K / Q3_K / Q4_K / Q5_K / Q6_K, [n, k / 256] (GGUF layout, byte-exact; the structs and
//      their dequant8 live in common.cuh), or weight-only int8 (i8 [n, k] row-major + f32
//      per-output-row scale [n]).
//   x: activations T [m, k] row-major, y: T [m, n] row-major. Accumulation in f32.
// Requirements (checked by the host): k a multiple of the block (32, or 256 for the K-quants);
// x and y 16-byte aligned; for int8, W 16-byte aligned. Kernel suffix = activation dtype.
//
// gemv_*: decode path, 1 <= m <= 8 (GEMV_MAX_ROWS). Memory-bound: each warp streams R weight rows
//   (R = 2, so each activation load serves two rows), lanes take consecutive
//   8- or 16-element units so a warp reads a contiguous run of blocks, quants are dequantized in
//   registers and the block scale is applied once per unit. Launch: block 128 (4 warps),
//   grid ceil(n / 8).
//   Registers are capped at 128 (4 CTAs = 16 warps per SM) so m = 1 keeps enough loads in flight.
// gemm_*: prefill path (any m). 64x64 output tile per CTA, k-step 32 (a block or sub-block), operands
//   dequantized into shared memory as f32, 4x4 register tile per thread. Launch: block 256,
//   grid (ceil(n / 64), ceil(m / 64)). For large m the faster route is dequantize_* into a scratch
//   f16/bf16 matrix plus a cuBLAS GEMM; see docs/kernels.md.
// dequantize_*: W -> dense T [n, k]. Launch: 256 threads, grid ceil(n * k / 8 / 256) (grid-stride).
#include "common.cuh"

#define GEMV_MAX_M 8
#define GEMV_WARPS 4
// Launch bounds live on a forward declaration so each definition keeps the plain
// `extern "C" __global__ void <name>(` form the Rust crate checks for.
#define GEMV_BOUNDS __launch_bounds__(32 * GEMV_WARPS, 4)
#define GEMV_R 2  // weight rows per warp: activations loaded once are used for GEMV_R rows

// One "unit" is the slice of a weight row a lane handles per step. `load` returns the raw quant
// values q[i] (as f32), the scale d and min mn such that w = d * q + mn; `load_x` fetches the
// matching activations.
struct FmtQ8_0 {
    static constexpr int UNIT = 8;  // 4 lanes per block
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ i64 row_bytes(int k) { return (i64)(k / QK) * sizeof(block_q8_0); }
    static __device__ __forceinline__ void load(const u8* row, int u, float (&q)[UNIT], float& d, float& mn) {
        const block_q8_0* b = reinterpret_cast<const block_q8_0*>(row) + (u >> 2);
        const int off = (u & 3) * 8;
        d = half_bits_to_f32(b->d);
        mn = 0.0f;
        const u32 lo = ld_u32_a2(b->qs + off), hi = ld_u32_a2(b->qs + off + 4);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[i] = (float)(i8)(lo >> (8 * i));
            q[4 + i] = (float)(i8)(hi >> (8 * i));
        }
    }
    template <typename T>
    static __device__ __forceinline__ void load_x(const T* xr, int u, float (&xv)[UNIT]) { load8(xr + u * 8, xv); }
};

// Q4 units are 16 elements: bytes [8s, 8s+8) of a block, low nibbles = elements 8s.., high
// nibbles = elements 16+8s.. (2 lanes per block).
template <bool MIN>
struct FmtQ4 {
    static constexpr int UNIT = 16;
    static constexpr bool HAS_MIN = MIN;
    typedef typename select_type<MIN, block_q4_1, block_q4_0>::type Block;
    static __device__ __forceinline__ i64 row_bytes(int k) { return (i64)(k / QK) * sizeof(Block); }
    static __device__ __forceinline__ void load(const u8* row, int u, float (&q)[UNIT], float& d, float& mn) {
        const Block* b = reinterpret_cast<const Block*>(row) + (u >> 1);
        const int s = u & 1;
        d = half_bits_to_f32(b->d);
        if constexpr (MIN) {
            mn = half_bits_to_f32(reinterpret_cast<const block_q4_1*>(b)->m);
        } else {
            mn = 0.0f;
        }
        const u32 lo = ld_u32_a2(b->qs + 8 * s), hi = ld_u32_a2(b->qs + 8 * s + 4);
        const float bias = MIN ? 0.0f : -8.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            q[i] = (float)((lo >> (8 * i)) & 15) + bias;
            q[4 + i] = (float)((hi >> (8 * i)) & 15) + bias;
            q[8 + i] = (float)((lo >> (8 * i + 4)) & 15) + bias;
            q[12 + i] = (float)((hi >> (8 * i + 4)) & 15) + bias;
        }
    }
    template <typename T>
    static __device__ __forceinline__ void load_x(const T* xr, int u, float (&xv)[UNIT]) {
        const T* base = xr + (u >> 1) * QK + (u & 1) * 8;
        float a[8], b[8];
        load8(base, a);
        load8(base + 16, b);
#pragma unroll
        for (int i = 0; i < 8; ++i) { xv[i] = a[i]; xv[8 + i] = b[i]; }
    }
};

// Weight-only int8: 16 contiguous i8 per unit (one 128-bit load); row scale applied at the end.
struct FmtI8 {
    static constexpr int UNIT = 16;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ i64 row_bytes(int k) { return (i64)k; }
    static __device__ __forceinline__ void load(const u8* row, int u, float (&q)[UNIT], float& d, float& mn) {
        const uint4 v = *reinterpret_cast<const uint4*>(row + u * 16);
        const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) q[4 * j + i] = (float)(i8)(w[j] >> (8 * i));
        d = 1.0f;
        mn = 0.0f;
    }
    template <typename T>
    static __device__ __forceinline__ void load_x(const T* xr, int u, float (&xv)[UNIT]) {
        float a[8], b[8];
        load8(xr + u * 16, a);
        load8(xr + u * 16 + 8, b);
#pragma unroll
        for (int i = 0; i < 8; ++i) { xv[i] = a[i]; xv[8 + i] = b[i]; }
    }
};

// Formats read through their common.cuh dequant8 (Q5_0, Q5_1 and the K-quants), so each layout
// is written once. A unit is two groups of 8 that share their quant bytes (low and high nibbles of
// the same 8 bytes), so consecutive lanes read consecutive bytes of a block and each byte is loaded
// by one lane. DeqUnits<B> maps unit u to its first group (counted in 8s from the row start) and
// the distance to the second.
template <typename B>
struct DeqUnits {  // 32-element blocks, 2 units each: elements 8s.. and 16 + 8s.., s = 0, 1
    static constexpr int SECOND = 2;
    static __device__ __forceinline__ int first(int u) { return (u >> 1) * 4 + (u & 1); }
};
template <>
struct DeqUnits<block_q4_K> {  // 16 units: sub-block pair p = w / 4, run s = w % 4; sub-blocks 2p, 2p + 1
    static constexpr int SECOND = 4;
    static __device__ __forceinline__ int first(int u) { return (u >> 4) * 32 + ((u & 15) >> 2) * 8 + (u & 3); }
};
template <>
struct DeqUnits<block_q5_K> : DeqUnits<block_q4_K> {};
template <>
struct DeqUnits<block_q6_K> {  // 16 units: half n = w / 8, quarter h = w / 4 % 2, run s; quarters h, h + 2
    static constexpr int SECOND = 8;
    static __device__ __forceinline__ int first(int u) {
        const int w = u & 15;
        return (u >> 4) * 32 + (w >> 3) * 16 + ((w >> 2) & 1) * 4 + (w & 3);
    }
};
// Q2_K and Q3_K keep quarters c of a half in bits 2c of the same 32 bytes (Q3_K's third bits likewise in one
// hmask byte per element position), so Q6_K's walk pairs quarters h and h + 2 of the same bytes.
template <>
struct DeqUnits<block_q2_K> : DeqUnits<block_q6_K> {};
template <>
struct DeqUnits<block_q3_K> : DeqUnits<block_q6_K> {};

// The two groups of a unit can have different scales (two sub-blocks of a K-quant), so `load`
// returns dequantized weights (d = 1): one FMA per weight and row, once per step however many
// tokens the step has.
template <typename B>
struct FmtDeq {
    static constexpr int UNIT = 16;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ i64 row_bytes(int k) { return (i64)(k / qk_of<B>::value) * sizeof(B); }
    static __device__ __forceinline__ void load(const u8* row, int u, float (&q)[UNIT], float& d, float& mn) {
        const B* r = reinterpret_cast<const B*>(row);
        const int g = DeqUnits<B>::first(u);
        float a[8], b[8];
        dequant8(r, g, a);
        dequant8(r, g + DeqUnits<B>::SECOND, b);
#pragma unroll
        for (int i = 0; i < 8; ++i) { q[i] = a[i]; q[8 + i] = b[i]; }
        d = 1.0f;
        mn = 0.0f;
    }
    template <typename T>
    static __device__ __forceinline__ void load_x(const T* xr, int u, float (&xv)[UNIT]) {
        const int g = DeqUnits<B>::first(u);
        float a[8], b[8];
        load8(xr + g * 8, a);
        load8(xr + (g + DeqUnits<B>::SECOND) * 8, b);
#pragma unroll
        for (int i = 0; i < 8; ++i) { xv[i] = a[i]; xv[8 + i] = b[i]; }
    }
};

template <typename F, int M, int R, typename T>
__device__ __forceinline__ void gemv_rows(const void* __restrict__ w, const float* __restrict__ scale,
                                         const T* __restrict__ x, T* __restrict__ y, int n, int k) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row0 = (blockIdx.x * GEMV_WARPS + warp) * R;
    if (row0 >= n) return;  // warp-uniform; no block barrier below
    const i64 rb = F::row_bytes(k);
    const u8* wr[R];
#pragma unroll
    for (int r = 0; r < R; ++r) wr[r] = reinterpret_cast<const u8*>(w) + (i64)min(row0 + r, n - 1) * rb;
    float acc[R][M];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;

    const int units = k / F::UNIT;
#pragma unroll 2
    for (int u = lane; u < units; u += 32) {
        float q[R][F::UNIT], d[R], mn[R];
#pragma unroll
        for (int r = 0; r < R; ++r) F::load(wr[r], u, q[r], d[r], mn[r]);
#pragma unroll
        for (int m = 0; m < M; ++m) {
            float xv[F::UNIT];
            F::load_x(x + (i64)m * k, u, xv);
            float sx = 0.0f;
            if constexpr (F::HAS_MIN) {
#pragma unroll
                for (int i = 0; i < F::UNIT; ++i) sx += xv[i];
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                float s = 0.0f;
#pragma unroll
                for (int i = 0; i < F::UNIT; ++i) s = fmaf(q[r][i], xv[i], s);
                acc[r][m] = fmaf(d[r], s, acc[r][m]);
                if constexpr (F::HAS_MIN) acc[r][m] = fmaf(mn[r], sx, acc[r][m]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float sc = (scale != nullptr && row0 + r < n) ? scale[row0 + r] : 1.0f;
#pragma unroll
        for (int m = 0; m < M; ++m) {
            const float v = warp_sum(acc[r][m]);
            if (lane == 0 && row0 + r < n) y[(i64)m * n + row0 + r] = from_f32<T>(v * sc);
        }
    }
}

template <typename F, typename T>
__device__ __forceinline__ void gemv_dispatch(const void* w, const float* scale, const T* x, T* y, int m, int n, int k) {
    switch (m) {
        case 1: gemv_rows<F, 1, GEMV_R>(w, scale, x, y, n, k); break;
        case 2: gemv_rows<F, 2, GEMV_R>(w, scale, x, y, n, k); break;
        case 3: gemv_rows<F, 3, GEMV_R>(w, scale, x, y, n, k); break;
        case 4: gemv_rows<F, 4, GEMV_R>(w, scale, x, y, n, k); break;
        case 5: gemv_rows<F, 5, GEMV_R>(w, scale, x, y, n, k); break;
        case 6: gemv_rows<F, 6, GEMV_R>(w, scale, x, y, n, k); break;
        case 7: gemv_rows<F, 7, GEMV_R>(w, scale, x, y, n, k); break;
        case 8: gemv_rows<F, 8, GEMV_R>(w, scale, x, y, n, k); break;
        default: break;  // host routes m > 8 to gemm_*
    }
}

// ---------------------------------------------------------------------------------------------
// Tiled GEMM (prefill)
// ---------------------------------------------------------------------------------------------
#define GEMM_BM 64
#define GEMM_BN 64
#define GEMM_BK 32

// Dequantize 8 weights of row `row`, k-group j8 (8 elements) into f32: W is a block type, or
// WeightI8 for int8, whose raw value is returned (the row scale is applied in the epilogue).
struct WeightI8 {};
template <typename W>
__device__ __forceinline__ void gemm_load_w8(const void* w, i64 row, int k, int j8, float (&o)[8]) {
    dequant8(reinterpret_cast<const W*>(w) + row * (k / qk_of<W>::value), j8, o);
}
template <>
__device__ __forceinline__ void gemm_load_w8<WeightI8>(const void* w, i64 row, int k, int j8, float (&o)[8]) {
    const uint2 v = *reinterpret_cast<const uint2*>(reinterpret_cast<const i8*>(w) + row * k + j8 * 8);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        o[i] = (float)(i8)(v.x >> (8 * i));
        o[4 + i] = (float)(i8)(v.y >> (8 * i));
    }
}

template <typename W, typename T>
__device__ __forceinline__ void gemm_impl(const void* __restrict__ w, const float* __restrict__ scale,
                                          const T* __restrict__ x, T* __restrict__ y, int m, int n, int k) {
    __shared__ float xs[GEMM_BK][GEMM_BM + 4];
    __shared__ float ws[GEMM_BK][GEMM_BN + 4];
    const int tid = threadIdx.x;
    const int n0 = blockIdx.x * GEMM_BN, m0 = blockIdx.y * GEMM_BM;
    const int tx = tid & 15, ty = tid >> 4;
    // loader mapping: 64 rows x 4 groups of 8 along k
    const int lrow = tid >> 2, lg = tid & 3;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

    for (int k0 = 0; k0 < k; k0 += GEMM_BK) {
        float xv[8], wv[8];
        if (m0 + lrow < m) {
            load8(x + (i64)(m0 + lrow) * k + k0 + lg * 8, xv);
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) xv[i] = 0.0f;
        }
        if (n0 + lrow < n) {
            gemm_load_w8<W>(w, n0 + lrow, k, k0 / 8 + lg, wv);
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) wv[i] = 0.0f;
        }
        __syncthreads();  // previous tile fully consumed
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            xs[lg * 8 + i][lrow] = xv[i];
            ws[lg * 8 + i][lrow] = wv[i];
        }
        __syncthreads();
#pragma unroll 8
        for (int kk = 0; kk < GEMM_BK; ++kk) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = xs[kk][ty + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; ++j) b[j] = ws[kk][tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int col = n0 + tx + 16 * j;
        if (col >= n) continue;
        const float sc = scale != nullptr ? scale[col] : 1.0f;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = m0 + ty + 16 * i;
            if (row < m) y[(i64)row * n + col] = from_f32<T>(acc[i][j] * sc);
        }
    }
}

// Dense dequantization W -> T [n, k] (for the dequantize + cuBLAS prefill route and for tests).
template <typename W, typename T>
__device__ __forceinline__ void dequantize_impl(const void* __restrict__ w, const float* __restrict__ scale,
                                                T* __restrict__ out, int n, int k) {
    const i64 groups = (i64)n * (k / 8);
    const i64 stride = (i64)gridDim.x * blockDim.x;
    for (i64 g = (i64)blockIdx.x * blockDim.x + threadIdx.x; g < groups; g += stride) {
        const i64 row = g / (k / 8);
        const int j8 = (int)(g - row * (k / 8));
        float v[8];
        gemm_load_w8<W>(w, row, k, j8, v);
        if (scale != nullptr) {
            const float sc = scale[row];
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] *= sc;
        }
        store8(out + row * k + j8 * 8, v);
    }
}

// ---- GEMV: args (w, x [m, k], y [m, n], m, n, k); int8 adds `scale` f32 [n] after w ----
extern "C" __global__ void GEMV_BOUNDS gemv_q8_0_f32(const void* w, const float* x, float* y, int m, int n, int k);
extern "C" __global__ void gemv_q8_0_f32(const void* w, const float* x, float* y, int m, int n, int k) { gemv_dispatch<FmtQ8_0>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q8_0_f16(const void* w, const __half* x, __half* y, int m, int n, int k);
extern "C" __global__ void gemv_q8_0_f16(const void* w, const __half* x, __half* y, int m, int n, int k) { gemv_dispatch<FmtQ8_0>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q4_0_f32(const void* w, const float* x, float* y, int m, int n, int k);
extern "C" __global__ void gemv_q4_0_f32(const void* w, const float* x, float* y, int m, int n, int k) { gemv_dispatch<FmtQ4<false>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q4_0_f16(const void* w, const __half* x, __half* y, int m, int n, int k);
extern "C" __global__ void gemv_q4_0_f16(const void* w, const __half* x, __half* y, int m, int n, int k) { gemv_dispatch<FmtQ4<false>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q4_1_f32(const void* w, const float* x, float* y, int m, int n, int k);
extern "C" __global__ void gemv_q4_1_f32(const void* w, const float* x, float* y, int m, int n, int k) { gemv_dispatch<FmtQ4<true>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q4_1_f16(const void* w, const __half* x, __half* y, int m, int n, int k);
extern "C" __global__ void gemv_q4_1_f16(const void* w, const __half* x, __half* y, int m, int n, int k) { gemv_dispatch<FmtQ4<true>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_i8_f32(const void* w, const float* scale, const float* x, float* y, int m, int n, int k);
extern "C" __global__ void gemv_i8_f32(const void* w, const float* scale, const float* x, float* y, int m, int n, int k) { gemv_dispatch<FmtI8>(w, scale, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_i8_f16(const void* w, const float* scale, const __half* x, __half* y, int m, int n, int k);
extern "C" __global__ void gemv_i8_f16(const void* w, const float* scale, const __half* x, __half* y, int m, int n, int k) { gemv_dispatch<FmtI8>(w, scale, x, y, m, n, k); }

// ---- GEMM: same arguments as GEMV, any m ----
extern "C" __global__ void gemm_q8_0_f32(const void* w, const float* x, float* y, int m, int n, int k) { gemm_impl<block_q8_0>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q8_0_f16(const void* w, const __half* x, __half* y, int m, int n, int k) { gemm_impl<block_q8_0>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q4_0_f32(const void* w, const float* x, float* y, int m, int n, int k) { gemm_impl<block_q4_0>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q4_0_f16(const void* w, const __half* x, __half* y, int m, int n, int k) { gemm_impl<block_q4_0>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q4_1_f32(const void* w, const float* x, float* y, int m, int n, int k) { gemm_impl<block_q4_1>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q4_1_f16(const void* w, const __half* x, __half* y, int m, int n, int k) { gemm_impl<block_q4_1>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_i8_f32(const void* w, const float* scale, const float* x, float* y, int m, int n, int k) { gemm_impl<WeightI8>(w, scale, x, y, m, n, k); }
extern "C" __global__ void gemm_i8_f16(const void* w, const float* scale, const __half* x, __half* y, int m, int n, int k) { gemm_impl<WeightI8>(w, scale, x, y, m, n, k); }

// ---- dequantize: args (w, out [n, k], n, k); int8 adds `scale` f32 [n] after w ----
extern "C" __global__ void dequantize_q8_0_f32(const void* w, float* out, int n, int k) { dequantize_impl<block_q8_0>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q8_0_f16(const void* w, __half* out, int n, int k) { dequantize_impl<block_q8_0>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q4_0_f32(const void* w, float* out, int n, int k) { dequantize_impl<block_q4_0>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q4_0_f16(const void* w, __half* out, int n, int k) { dequantize_impl<block_q4_0>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q4_1_f32(const void* w, float* out, int n, int k) { dequantize_impl<block_q4_1>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q4_1_f16(const void* w, __half* out, int n, int k) { dequantize_impl<block_q4_1>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_i8_f32(const void* w, const float* scale, float* out, int n, int k) { dequantize_impl<WeightI8>(w, scale, out, n, k); }
extern "C" __global__ void dequantize_i8_f16(const void* w, const float* scale, __half* out, int n, int k) { dequantize_impl<WeightI8>(w, scale, out, n, k); }

#if STRATA_HAS_BF16
extern "C" __global__ void GEMV_BOUNDS gemv_q8_0_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k);
extern "C" __global__ void gemv_q8_0_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k) { gemv_dispatch<FmtQ8_0>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q4_0_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k);
extern "C" __global__ void gemv_q4_0_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k) { gemv_dispatch<FmtQ4<false>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q4_1_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k);
extern "C" __global__ void gemv_q4_1_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k) { gemv_dispatch<FmtQ4<true>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_i8_bf16(const void* w, const float* scale, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k);
extern "C" __global__ void gemv_i8_bf16(const void* w, const float* scale, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k) { gemv_dispatch<FmtI8>(w, scale, x, y, m, n, k); }
extern "C" __global__ void gemm_q8_0_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k) { gemm_impl<block_q8_0>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q4_0_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k) { gemm_impl<block_q4_0>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q4_1_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k) { gemm_impl<block_q4_1>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_i8_bf16(const void* w, const float* scale, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k) { gemm_impl<WeightI8>(w, scale, x, y, m, n, k); }
extern "C" __global__ void dequantize_q8_0_bf16(const void* w, __nv_bfloat16* out, int n, int k) { dequantize_impl<block_q8_0>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q4_0_bf16(const void* w, __nv_bfloat16* out, int n, int k) { dequantize_impl<block_q4_0>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q4_1_bf16(const void* w, __nv_bfloat16* out, int n, int k) { dequantize_impl<block_q4_1>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_i8_bf16(const void* w, const float* scale, __nv_bfloat16* out, int n, int k) { dequantize_impl<WeightI8>(w, scale, out, n, k); }
#endif

// ---- Q5_0, Q5_1 and the K-quants: the same three ops and arguments, through FmtDeq / dequant8 ----
extern "C" __global__ void GEMV_BOUNDS gemv_q5_0_f32(const void* w, const float* x, float* y, int m, int n, int k);
extern "C" __global__ void gemv_q5_0_f32(const void* w, const float* x, float* y, int m, int n, int k) { gemv_dispatch<FmtDeq<block_q5_0>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q5_1_f32(const void* w, const float* x, float* y, int m, int n, int k);
extern "C" __global__ void gemv_q5_1_f32(const void* w, const float* x, float* y, int m, int n, int k) { gemv_dispatch<FmtDeq<block_q5_1>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q4_k_f32(const void* w, const float* x, float* y, int m, int n, int k);
extern "C" __global__ void gemv_q4_k_f32(const void* w, const float* x, float* y, int m, int n, int k) { gemv_dispatch<FmtDeq<block_q4_K>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q5_k_f32(const void* w, const float* x, float* y, int m, int n, int k);
extern "C" __global__ void gemv_q5_k_f32(const void* w, const float* x, float* y, int m, int n, int k) { gemv_dispatch<FmtDeq<block_q5_K>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q6_k_f32(const void* w, const float* x, float* y, int m, int n, int k);
extern "C" __global__ void gemv_q6_k_f32(const void* w, const float* x, float* y, int m, int n, int k) { gemv_dispatch<FmtDeq<block_q6_K>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q2_k_f32(const void* w, const float* x, float* y, int m, int n, int k);
extern "C" __global__ void gemv_q2_k_f32(const void* w, const float* x, float* y, int m, int n, int k) { gemv_dispatch<FmtDeq<block_q2_K>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q3_k_f32(const void* w, const float* x, float* y, int m, int n, int k);
extern "C" __global__ void gemv_q3_k_f32(const void* w, const float* x, float* y, int m, int n, int k) { gemv_dispatch<FmtDeq<block_q3_K>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q5_0_f32(const void* w, const float* x, float* y, int m, int n, int k) { gemm_impl<block_q5_0>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q5_1_f32(const void* w, const float* x, float* y, int m, int n, int k) { gemm_impl<block_q5_1>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q4_k_f32(const void* w, const float* x, float* y, int m, int n, int k) { gemm_impl<block_q4_K>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q5_k_f32(const void* w, const float* x, float* y, int m, int n, int k) { gemm_impl<block_q5_K>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q6_k_f32(const void* w, const float* x, float* y, int m, int n, int k) { gemm_impl<block_q6_K>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q2_k_f32(const void* w, const float* x, float* y, int m, int n, int k) { gemm_impl<block_q2_K>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q3_k_f32(const void* w, const float* x, float* y, int m, int n, int k) { gemm_impl<block_q3_K>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void dequantize_q5_0_f32(const void* w, float* out, int n, int k) { dequantize_impl<block_q5_0>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q5_1_f32(const void* w, float* out, int n, int k) { dequantize_impl<block_q5_1>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q4_k_f32(const void* w, float* out, int n, int k) { dequantize_impl<block_q4_K>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q5_k_f32(const void* w, float* out, int n, int k) { dequantize_impl<block_q5_K>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q6_k_f32(const void* w, float* out, int n, int k) { dequantize_impl<block_q6_K>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q2_k_f32(const void* w, float* out, int n, int k) { dequantize_impl<block_q2_K>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q3_k_f32(const void* w, float* out, int n, int k) { dequantize_impl<block_q3_K>(w, nullptr, out, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q5_0_f16(const void* w, const __half* x, __half* y, int m, int n, int k);
extern "C" __global__ void gemv_q5_0_f16(const void* w, const __half* x, __half* y, int m, int n, int k) { gemv_dispatch<FmtDeq<block_q5_0>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q5_1_f16(const void* w, const __half* x, __half* y, int m, int n, int k);
extern "C" __global__ void gemv_q5_1_f16(const void* w, const __half* x, __half* y, int m, int n, int k) { gemv_dispatch<FmtDeq<block_q5_1>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q4_k_f16(const void* w, const __half* x, __half* y, int m, int n, int k);
extern "C" __global__ void gemv_q4_k_f16(const void* w, const __half* x, __half* y, int m, int n, int k) { gemv_dispatch<FmtDeq<block_q4_K>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q5_k_f16(const void* w, const __half* x, __half* y, int m, int n, int k);
extern "C" __global__ void gemv_q5_k_f16(const void* w, const __half* x, __half* y, int m, int n, int k) { gemv_dispatch<FmtDeq<block_q5_K>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q6_k_f16(const void* w, const __half* x, __half* y, int m, int n, int k);
extern "C" __global__ void gemv_q6_k_f16(const void* w, const __half* x, __half* y, int m, int n, int k) { gemv_dispatch<FmtDeq<block_q6_K>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q2_k_f16(const void* w, const __half* x, __half* y, int m, int n, int k);
extern "C" __global__ void gemv_q2_k_f16(const void* w, const __half* x, __half* y, int m, int n, int k) { gemv_dispatch<FmtDeq<block_q2_K>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q3_k_f16(const void* w, const __half* x, __half* y, int m, int n, int k);
extern "C" __global__ void gemv_q3_k_f16(const void* w, const __half* x, __half* y, int m, int n, int k) { gemv_dispatch<FmtDeq<block_q3_K>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q5_0_f16(const void* w, const __half* x, __half* y, int m, int n, int k) { gemm_impl<block_q5_0>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q5_1_f16(const void* w, const __half* x, __half* y, int m, int n, int k) { gemm_impl<block_q5_1>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q4_k_f16(const void* w, const __half* x, __half* y, int m, int n, int k) { gemm_impl<block_q4_K>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q5_k_f16(const void* w, const __half* x, __half* y, int m, int n, int k) { gemm_impl<block_q5_K>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q6_k_f16(const void* w, const __half* x, __half* y, int m, int n, int k) { gemm_impl<block_q6_K>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q2_k_f16(const void* w, const __half* x, __half* y, int m, int n, int k) { gemm_impl<block_q2_K>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q3_k_f16(const void* w, const __half* x, __half* y, int m, int n, int k) { gemm_impl<block_q3_K>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void dequantize_q5_0_f16(const void* w, __half* out, int n, int k) { dequantize_impl<block_q5_0>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q5_1_f16(const void* w, __half* out, int n, int k) { dequantize_impl<block_q5_1>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q4_k_f16(const void* w, __half* out, int n, int k) { dequantize_impl<block_q4_K>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q5_k_f16(const void* w, __half* out, int n, int k) { dequantize_impl<block_q5_K>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q6_k_f16(const void* w, __half* out, int n, int k) { dequantize_impl<block_q6_K>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q2_k_f16(const void* w, __half* out, int n, int k) { dequantize_impl<block_q2_K>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q3_k_f16(const void* w, __half* out, int n, int k) { dequantize_impl<block_q3_K>(w, nullptr, out, n, k); }
#if STRATA_HAS_BF16
extern "C" __global__ void GEMV_BOUNDS gemv_q5_0_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k);
extern "C" __global__ void gemv_q5_0_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k) { gemv_dispatch<FmtDeq<block_q5_0>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q5_1_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k);
extern "C" __global__ void gemv_q5_1_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k) { gemv_dispatch<FmtDeq<block_q5_1>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q4_k_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k);
extern "C" __global__ void gemv_q4_k_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k) { gemv_dispatch<FmtDeq<block_q4_K>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q5_k_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k);
extern "C" __global__ void gemv_q5_k_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k) { gemv_dispatch<FmtDeq<block_q5_K>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q6_k_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k);
extern "C" __global__ void gemv_q6_k_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k) { gemv_dispatch<FmtDeq<block_q6_K>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q2_k_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k);
extern "C" __global__ void gemv_q2_k_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k) { gemv_dispatch<FmtDeq<block_q2_K>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void GEMV_BOUNDS gemv_q3_k_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k);
extern "C" __global__ void gemv_q3_k_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k) { gemv_dispatch<FmtDeq<block_q3_K>>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q5_0_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k) { gemm_impl<block_q5_0>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q5_1_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k) { gemm_impl<block_q5_1>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q4_k_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k) { gemm_impl<block_q4_K>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q5_k_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k) { gemm_impl<block_q5_K>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q6_k_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k) { gemm_impl<block_q6_K>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q2_k_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k) { gemm_impl<block_q2_K>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void gemm_q3_k_bf16(const void* w, const __nv_bfloat16* x, __nv_bfloat16* y, int m, int n, int k) { gemm_impl<block_q3_K>(w, nullptr, x, y, m, n, k); }
extern "C" __global__ void dequantize_q5_0_bf16(const void* w, __nv_bfloat16* out, int n, int k) { dequantize_impl<block_q5_0>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q5_1_bf16(const void* w, __nv_bfloat16* out, int n, int k) { dequantize_impl<block_q5_1>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q4_k_bf16(const void* w, __nv_bfloat16* out, int n, int k) { dequantize_impl<block_q4_K>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q5_k_bf16(const void* w, __nv_bfloat16* out, int n, int k) { dequantize_impl<block_q5_K>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q6_k_bf16(const void* w, __nv_bfloat16* out, int n, int k) { dequantize_impl<block_q6_K>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q2_k_bf16(const void* w, __nv_bfloat16* out, int n, int k) { dequantize_impl<block_q2_K>(w, nullptr, out, n, k); }
extern "C" __global__ void dequantize_q3_k_bf16(const void* w, __nv_bfloat16* out, int n, int k) { dequantize_impl<block_q3_K>(w, nullptr, out, n, k); }
#endif
