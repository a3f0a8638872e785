// Host stand-ins for the CUDA types, qualifiers and intrinsics kernels/common.cuh and kernels/quant.cu use, so a
// C++ compiler builds them for the CPU (engine/tests/kernel_layouts.rs). Only what the layout check runs is real:
// f16 bits to f32, bf16 to f32, 128-bit vector structs; f16 stores return zero and warp/block primitives do
// nothing (the check runs one lane's code).
#pragma once
#include <cstdint>
#include <cstring>
#include <cmath>
#include <algorithm>
#define __device__
#define __global__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static
#define __launch_bounds__(a, b)
using std::min;
struct Dim3 { unsigned x = 0, y = 0, z = 0; };
extern Dim3 threadIdx, blockIdx, blockDim, gridDim;
inline void __syncthreads() {}
inline float __shfl_xor_sync(unsigned, float v, int) { return v; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
struct __half { unsigned short b; };
struct __half2 { __half x, y; };
inline float __half2float(__half h) {
    unsigned s = (h.b >> 15) & 1, e = (h.b >> 10) & 31, m = h.b & 1023;
    float v = e == 0 ? std::ldexp((float)m, -24) : e == 31 ? (m ? NAN : INFINITY) : std::ldexp((float)(m | 1024), (int)e - 25);
    return s ? -v : v;
}
inline __half __ushort_as_half(unsigned short b) { return __half{b}; }
inline __half __float2half_rn(float) { return __half{0}; }
inline float2 __half22float2(__half2 h) { return {__half2float(h.x), __half2float(h.y)}; }
inline __half2 __floats2half2_rn(float, float) { return {}; }
