// Shared device helpers for strata's kernels: fixed-width integer aliases, dtype conversions,
// 128-bit vector loads/stores, warp/block reductions and GGML block-quant structs.
// Included by every kernel family; NVRTC callers register it under the name "common.cuh".
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

// NVRTC has no <stdint.h>; spell the widths out.
typedef signed char i8;
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

// bf16 kernels are compiled only for sm_80+ (native bf16 conversions); below that the symbols are
// absent and the loader must not ask for them (see `requires_sm80` in the Rust crate).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define STRATA_HAS_BF16 1
#else
#define STRATA_HAS_BF16 0
#endif

#define STRATA_WARP 32
#define STRATA_FULL_MASK 0xffffffffu
#define STRATA_LOG2E 1.4426950408889634f
#define STRATA_NEG_INF (__int_as_float(0xff800000))

// ---------------------------------------------------------------------------------------------
// dtype conversion
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

__device__ __forceinline__ float half_bits_to_f32(u16 bits) { return __half2float(__ushort_as_half(bits)); }

// ---------------------------------------------------------------------------------------------
// 8-element vector access (one 128-bit transaction for f16/bf16, two for f32).
// Callers guarantee the pointer is 16-byte aligned (element index a multiple of 8 on a
// 16-byte-aligned base, or of 4 for f32).
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ void load8(const float* p, float (&o)[8]) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    o[0] = a.x; o[1] = a.y; o[2] = a.z; o[3] = a.w;
    o[4] = b.x; o[5] = b.y; o[6] = b.z; o[7] = b.w;
}
__device__ __forceinline__ void load8(const __half* p, float (&o)[8]) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __half22float2(h[i]);
        o[2 * i] = f.x; o[2 * i + 1] = f.y;
    }
}
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&o)[8]) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        o[2 * i] = f.x; o[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ void store8(float* p, const float (&v)[8]) {
    *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    *reinterpret_cast<float4*>(p + 4) = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void store8(__half* p, const float (&v)[8]) {
    uint4 u;
    __half2* h = reinterpret_cast<__half2*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = u;
}
__device__ __forceinline__ void store8(__nv_bfloat16* p, const float (&v)[8]) {
    uint4 u;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = u;
}

// True when every pointer is 16-byte aligned, so the vector paths above may be used.
__device__ __forceinline__ bool aligned16(const void* a) { return (reinterpret_cast<u64>(a) & 15) == 0; }

// ---------------------------------------------------------------------------------------------
// reductions (fixed shuffle trees: results are deterministic run to run)
// ---------------------------------------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(STRATA_FULL_MASK, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(STRATA_FULL_MASK, v, o));
    return v;
}

// Block-wide sum; every thread gets the result. `scratch` holds >= 32 floats. blockDim.x must
// be a multiple of 32.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : STRATA_NEG_INF;
    return warp_max(v);
}

// ---------------------------------------------------------------------------------------------
// GGML block-quant formats (byte-exact with GGUF; blocks are packed, only 2-byte aligned)
// ---------------------------------------------------------------------------------------------
#define QK 32  // elements per block for Q8_0 / Q4_0 / Q4_1

struct block_q8_0 {
    u16 d;        // f16 scale bits
    i8 qs[QK];    // value = d * q
};
struct block_q4_0 {
    u16 d;            // f16 scale bits
    u8 qs[QK / 2];    // element j (j < 16) = low nibble of qs[j], element j + 16 = high nibble
};                    // value = d * (q - 8)
struct block_q4_1 {
    u16 d;            // f16 scale bits
    u16 m;            // f16 min bits
    u8 qs[QK / 2];    // same nibble order as Q4_0; value = d * q + m
};
static_assert(sizeof(block_q8_0) == 34, "block_q8_0 must be 34 bytes");
static_assert(sizeof(block_q4_0) == 18, "block_q4_0 must be 18 bytes");
static_assert(sizeof(block_q4_1) == 20, "block_q4_1 must be 20 bytes");

// Load 4 bytes from a 2-byte aligned address as two u16 pieces.
__device__ __forceinline__ u32 ld_u32_a2(const void* p) {
    const u16* q = reinterpret_cast<const u16*>(p);
    return static_cast<u32>(q[0]) | (static_cast<u32>(q[1]) << 16);
}

// Dequantize elements [8*j8, 8*j8 + 8) of a row of blocks (j8 counts groups of 8 from the row
// start). Loads are 2-byte aligned pieces since packed blocks are only 2-byte aligned.
__device__ __forceinline__ void dequant8(const block_q8_0* __restrict__ row, int j8, float (&o)[8]) {
    const block_q8_0* b = row + j8 / 4;
    const int off = (j8 % 4) * 8;
    const float d = half_bits_to_f32(b->d);
    const u32 lo = ld_u32_a2(b->qs + off), hi = ld_u32_a2(b->qs + off + 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        o[i] = d * (float)(i8)(lo >> (8 * i));
        o[4 + i] = d * (float)(i8)(hi >> (8 * i));
    }
}
__device__ __forceinline__ void dequant8(const block_q4_0* __restrict__ row, int j8, float (&o)[8]) {
    const block_q4_0* b = row + j8 / 4;
    const int e0 = (j8 % 4) * 8;  // first element of this group of 8 within the block
    const float d = half_bits_to_f32(b->d);
    const int byte0 = e0 & 15, shift = e0 >= 16 ? 4 : 0;
    const u32 lo = ld_u32_a2(b->qs + byte0), hi = ld_u32_a2(b->qs + byte0 + 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        o[i] = d * (float)((int)((lo >> (8 * i + shift)) & 15) - 8);
        o[4 + i] = d * (float)((int)((hi >> (8 * i + shift)) & 15) - 8);
    }
}
__device__ __forceinline__ void dequant8(const block_q4_1* __restrict__ row, int j8, float (&o)[8]) {
    const block_q4_1* b = row + j8 / 4;
    const int e0 = (j8 % 4) * 8;
    const float d = half_bits_to_f32(b->d), m = half_bits_to_f32(b->m);
    const int byte0 = e0 & 15, shift = e0 >= 16 ? 4 : 0;
    const u32 lo = ld_u32_a2(b->qs + byte0), hi = ld_u32_a2(b->qs + byte0 + 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        o[i] = fmaf(d, (float)((lo >> (8 * i + shift)) & 15), m);
        o[4 + i] = fmaf(d, (float)((hi >> (8 * i + shift)) & 15), m);
    }
}

// Q5_0 / Q5_1: Q4's nibbles plus a fifth bit per element, bit i of the little-endian u32 `qh`.
struct block_q5_0 {
    u16 d;            // f16 scale bits
    u8 qh[4];         // bit i = bit 4 of element i
    u8 qs[QK / 2];    // low 4 bits, nibble order as Q4_0; value = d * (q - 16)
};
struct block_q5_1 {
    u16 d;            // f16 scale bits
    u16 m;            // f16 min bits
    u8 qh[4];
    u8 qs[QK / 2];    // value = d * q + m
};
static_assert(sizeof(block_q5_0) == 22, "block_q5_0 must be 22 bytes");
static_assert(sizeof(block_q5_1) == 24, "block_q5_1 must be 24 bytes");

__device__ __forceinline__ void dequant8(const block_q5_0* __restrict__ row, int j8, float (&o)[8]) {
    const block_q5_0* b = row + j8 / 4;
    const int e0 = (j8 % 4) * 8;
    const float d = half_bits_to_f32(b->d);
    const int byte0 = e0 & 15, shift = e0 >= 16 ? 4 : 0;
    const u32 qh = ld_u32_a2(b->qh) >> e0;
    const u32 lo = ld_u32_a2(b->qs + byte0), hi = ld_u32_a2(b->qs + byte0 + 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        o[i] = d * (float)((int)(((lo >> (8 * i + shift)) & 15) | (((qh >> i) & 1) << 4)) - 16);
        o[4 + i] = d * (float)((int)(((hi >> (8 * i + shift)) & 15) | (((qh >> (4 + i)) & 1) << 4)) - 16);
    }
}
__device__ __forceinline__ void dequant8(const block_q5_1* __restrict__ row, int j8, float (&o)[8]) {
    const block_q5_1* b = row + j8 / 4;
    const int e0 = (j8 % 4) * 8;
    const float d = half_bits_to_f32(b->d), m = half_bits_to_f32(b->m);
    const int byte0 = e0 & 15, shift = e0 >= 16 ? 4 : 0;
    const u32 qh = ld_u32_a2(b->qh) >> e0;
    const u32 lo = ld_u32_a2(b->qs + byte0), hi = ld_u32_a2(b->qs + byte0 + 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        o[i] = fmaf(d, (float)(((lo >> (8 * i + shift)) & 15) | (((qh >> i) & 1) << 4)), m);
        o[4 + i] = fmaf(d, (float)(((hi >> (8 * i + shift)) & 15) | (((qh >> (4 + i)) & 1) << 4)), m);
    }
}

// ---------------------------------------------------------------------------------------------
// K-quants: 256-element super-blocks (ggml-common.h; engine/src/quant/kquant.rs documents the
// same layouts with scalar accessors, the reference these are tested against).
// ---------------------------------------------------------------------------------------------
#define QK_K 256

struct block_q4_K {
    u16 d;            // f16 super-scale of the sub-block scales
    u16 dmin;         // f16 super-scale of the sub-block minimums
    u8 scales[12];    // eight 6-bit scales and minimums, packed (k4_scale_min)
    u8 qs[QK_K / 2];  // 32 bytes per sub-block pair: low nibbles sub-block 2p, high 2p + 1
};                    // value = d * sc_j * q - dmin * m_j
struct block_q5_K {
    u16 d;
    u16 dmin;
    u8 scales[12];
    u8 qh[QK_K / 8];  // bit j of qh[l] = bit 4 of element l of sub-block j
    u8 qs[QK_K / 2];  // as Q4_K
};
struct block_q6_K {
    u8 ql[QK_K / 2];  // per half of 128: 64 bytes, quarters 0/1 in low nibbles, 2/3 in high
    u8 qh[QK_K / 4];  // per half: 32 bytes, quarter c at bits 2c
    i8 scales[QK_K / 16];  // one per 16 elements
    u16 d;            // f16, stored last
};                    // value = d * sc * (q - 32)
struct block_q2_K {
    u8 scales[QK_K / 16];  // sub-block k (16 elements): low nibble its scale, high nibble its minimum
    u8 qs[QK_K / 4];  // per half of 128: 32 bytes, quarter c at bits 2c (as Q6_K's qh)
    u16 d;            // f16 super-scale of the scales, stored after the quants
    u16 dmin;         // f16 super-scale of the minimums
};                    // value = d * sc_k * q - dmin * m_k
struct block_q3_K {
    u8 hmask[QK_K / 8];  // bit i / 32 of hmask[i % 32] set: element i's third bit (no offset)
    u8 qs[QK_K / 4];  // low 2 bits, as Q2_K's
    u8 scales[12];    // sixteen 6-bit scales, packed (k3_scale), offset 32
    u16 d;            // f16, stored last
};                    // value = d * (sc_k - 32) * (q - (hbit ? 0 : 4))
static_assert(sizeof(block_q2_K) == 84, "block_q2_K must be 84 bytes");
static_assert(sizeof(block_q3_K) == 110, "block_q3_K must be 110 bytes");
static_assert(sizeof(block_q4_K) == 144, "block_q4_K must be 144 bytes");
static_assert(sizeof(block_q5_K) == 176, "block_q5_K must be 176 bytes");
static_assert(sizeof(block_q6_K) == 210, "block_q6_K must be 210 bytes");

// Sub-block j's scale and minimum from a Q4_K/Q5_K block's 12 packed bytes (ggml's
// get_scale_min_k4): j < 4 in the low 6 bits of bytes j and j + 4; j >= 4 in the nibbles of
// byte j + 4 with their top 2 bits in the spare top bits of bytes j - 4 and j.
__device__ __forceinline__ void k4_scale_min(const u8* s, int j, float& sc, float& mn) {
    if (j < 4) {
        sc = (float)(s[j] & 63);
        mn = (float)(s[j + 4] & 63);
    } else {
        sc = (float)((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
        mn = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

// Groups of 8 never straddle a sub-block (32 elements; 16 for Q6_K's scales), so each group has
// one scale. The scale products are rounded to f32 first, as ggml and the CPU reference do.
// Q4_K, and Q5_K with its fifth bits (FIFTH; `qh` exists only then).
template <bool FIFTH, typename B>
__device__ __forceinline__ void dequant8_k(const B* __restrict__ row, int j8, float (&o)[8]) {
    const B* b = row + j8 / 32;
    const int e0 = (j8 % 32) * 8, j = e0 / 32, l0 = e0 % 32, shift = 4 * (j & 1);
    float sc, mn;
    k4_scale_min(b->scales, j, sc, mn);
    const float d1 = half_bits_to_f32(b->d) * sc, m1 = half_bits_to_f32(b->dmin) * mn;
    const u8* q = b->qs + 32 * (j / 2) + l0;
    const u32 lo = ld_u32_a2(q), hi = ld_u32_a2(q + 4);
    u32 hlo = 0, hhi = 0;  // element i's fifth bit at bit 8i
    if constexpr (FIFTH) {
        hlo = ld_u32_a2(b->qh + l0) >> j;
        hhi = ld_u32_a2(b->qh + l0 + 4) >> j;
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        o[i] = d1 * (float)(((lo >> (8 * i + shift)) & 15) | (((hlo >> (8 * i)) & 1) << 4)) - m1;
        o[4 + i] = d1 * (float)(((hi >> (8 * i + shift)) & 15) | (((hhi >> (8 * i)) & 1) << 4)) - m1;
    }
}
__device__ __forceinline__ void dequant8(const block_q4_K* __restrict__ row, int j8, float (&o)[8]) {
    dequant8_k<false>(row, j8, o);
}
__device__ __forceinline__ void dequant8(const block_q5_K* __restrict__ row, int j8, float (&o)[8]) {
    dequant8_k<true>(row, j8, o);
}
__device__ __forceinline__ void dequant8(const block_q6_K* __restrict__ row, int j8, float (&o)[8]) {
    const block_q6_K* b = row + j8 / 32;
    const int e0 = (j8 % 32) * 8, n = e0 / 128, c = (e0 % 128) / 32, l0 = e0 % 32;
    const float d1 = half_bits_to_f32(b->d) * (float)b->scales[e0 / 16];
    const u8* ql = b->ql + 64 * n + 32 * (c & 1) + l0;
    const u8* qh = b->qh + 32 * n + l0;
    const int ls = 4 * (c >> 1), hs = 2 * c;
    const u32 lo = ld_u32_a2(ql), hi = ld_u32_a2(ql + 4), hlo = ld_u32_a2(qh), hhi = ld_u32_a2(qh + 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        o[i] = d1 * (float)((int)(((lo >> (8 * i + ls)) & 15) | (((hlo >> (8 * i + hs)) & 3) << 4)) - 32);
        o[4 + i] = d1 * (float)((int)(((hi >> (8 * i + ls)) & 15) | (((hhi >> (8 * i + hs)) & 3) << 4)) - 32);
    }
}

// Q2_K / Q3_K: elements 8s.. of quarter c of half n take bits 2c of the 8 bytes at qs + 32n + 8s; a group of 8
// lies in one 16-element sub-block k = e0 / 16.
// Q3_K's scale k: low 4 bits from byte k % 8 (low nibble for k < 8, high after), top 2 bits from byte
// 8 + k % 4, bits 2 * (k / 4); offset 32.
__device__ __forceinline__ int k3_scale(const u8* s, int k) {
    return (int)(((s[k % 8] >> (4 * (k / 8))) & 15) | (((s[8 + k % 4] >> (2 * (k / 4))) & 3) << 4)) - 32;
}
__device__ __forceinline__ void dequant8(const block_q2_K* __restrict__ row, int j8, float (&o)[8]) {
    const block_q2_K* b = row + j8 / 32;
    const int e0 = (j8 % 32) * 8, n = e0 / 128, c = (e0 % 128) / 32, l0 = e0 % 32;
    const u8 s = b->scales[e0 / 16];
    const float d1 = half_bits_to_f32(b->d) * (float)(s & 15), m1 = half_bits_to_f32(b->dmin) * (float)(s >> 4);
    const u8* q = b->qs + 32 * n + l0;
    const u32 lo = ld_u32_a2(q) >> (2 * c), hi = ld_u32_a2(q + 4) >> (2 * c);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        o[i] = d1 * (float)((lo >> (8 * i)) & 3) - m1;
        o[4 + i] = d1 * (float)((hi >> (8 * i)) & 3) - m1;
    }
}
__device__ __forceinline__ void dequant8(const block_q3_K* __restrict__ row, int j8, float (&o)[8]) {
    const block_q3_K* b = row + j8 / 32;
    const int e0 = (j8 % 32) * 8, n = e0 / 128, c = (e0 % 128) / 32, l0 = e0 % 32;
    const float d1 = half_bits_to_f32(b->d) * (float)k3_scale(b->scales, e0 / 16);
    const u8* q = b->qs + 32 * n + l0;
    const int hs = e0 / 32;  // the third bits of sub-block pair 4n + c
    const u32 lo = ld_u32_a2(q) >> (2 * c), hi = ld_u32_a2(q + 4) >> (2 * c);
    const u32 hlo = ld_u32_a2(b->hmask + l0) >> hs, hhi = ld_u32_a2(b->hmask + l0 + 4) >> hs;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        o[i] = d1 * (float)((int)(((lo >> (8 * i)) & 3) | (((hlo >> (8 * i)) & 1) << 2)) - 4);
        o[4 + i] = d1 * (float)((int)(((hi >> (8 * i)) & 3) | (((hhi >> (8 * i)) & 1) << 2)) - 4);
    }
}

// Elements per block of a block type: the row of a [n, k] weight is k / qk_of<B>::value blocks.
template <typename B> struct qk_of { static constexpr int value = QK; };
template <> struct qk_of<block_q2_K> { static constexpr int value = QK_K; };
template <> struct qk_of<block_q3_K> { static constexpr int value = QK_K; };
template <> struct qk_of<block_q4_K> { static constexpr int value = QK_K; };
template <> struct qk_of<block_q5_K> { static constexpr int value = QK_K; };
template <> struct qk_of<block_q6_K> { static constexpr int value = QK_K; };

// std::conditional without the standard library (NVRTC compiles without host headers).
template <bool B, typename A, typename C> struct select_type { typedef A type; };
template <typename A, typename C> struct select_type<false, A, C> { typedef C type; };
