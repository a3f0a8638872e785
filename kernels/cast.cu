// dtype conversion: out[i] = (Dst) in[i], rounding to nearest even. 1-D grid-stride; any launch
// shape works, 256 threads x min(ceil(n / 2048), 65535) blocks is the intended one.
#include "common.cuh"

template <typename S, typename D>
__device__ __forceinline__ void cast_impl(const S* __restrict__ in, D* __restrict__ out, i64 n) {
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const i64 tid = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    i64 done = 0;
    if (aligned16(in) && aligned16(out)) {
        const i64 nv = n / 8;
        for (i64 v = tid; v < nv; v += stride) {
            float f[8];
            load8(in + v * 8, f);
            store8(out + v * 8, f);
        }
        done = nv * 8;
    }
    for (i64 i = done + tid; i < n; i += stride) out[i] = from_f32<D>(to_f32(in[i]));
}

extern "C" __global__ void cast_f32_f16(const float* in, __half* out, i64 n) { cast_impl(in, out, n); }
extern "C" __global__ void cast_f16_f32(const __half* in, float* out, i64 n) { cast_impl(in, out, n); }

#if STRATA_HAS_BF16
extern "C" __global__ void cast_f32_bf16(const float* in, __nv_bfloat16* out, i64 n) { cast_impl(in, out, n); }
extern "C" __global__ void cast_bf16_f32(const __nv_bfloat16* in, float* out, i64 n) { cast_impl(in, out, n); }
extern "C" __global__ void cast_f16_bf16(const __half* in, __nv_bfloat16* out, i64 n) { cast_impl(in, out, n); }
extern "C" __global__ void cast_bf16_f16(const __nv_bfloat16* in, __half* out, i64 n) { cast_impl(in, out, n); }
#endif
