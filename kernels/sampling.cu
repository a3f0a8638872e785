// Token selection over f32 logits [n_rows, vocab]. One CTA per row, block 1024 (a multiple of 32).
//
// argmax_f32: index of the largest logit; ties go to the lowest index; NaN never wins.
// sample_f32: temperature, then top-k, then top-p (nucleus) on the renormalised top-k mass, then
//   inverse-CDF sampling with the caller's uniform number u in [0, 1). No sorting: both cut-offs
//   are thresholds found by radix select over order-preserving 32-bit keys of the logits, and
//   probability mass is summed as 64-bit fixed point (exp(z - z_max) * 2^40) with integer atomics,
//   so the result is bit-for-bit deterministic given u (no float-atomic ordering). Ties at a
//   threshold are all kept (top-k may keep more than k tokens when logits tie exactly).
//   The CDF is walked in vocabulary order over the kept tokens, which samples the same
//   distribution as walking it in probability order.
//   temperature <= 0 or top_k == 1 -> argmax. top_k <= 0 or >= vocab -> no top-k.
//   top_p <= 0 or >= 1 -> no top-p.
#include "common.cuh"

#define MASS_SHIFT 40  // fixed-point fraction bits; vocab * 2^40 < 2^64 for vocab < 2^24

// Order-preserving map f32 -> u32 (larger float -> larger key). NaN -> 0 (below -inf).
__device__ __forceinline__ u32 float_key(float x) {
    const u32 u = __float_as_uint(x);
    if (x != x) return 0u;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// (key, lowest index) packed so the u64 maximum is the argmax with ties to the lowest index.
__device__ __forceinline__ u64 pack_best(u32 key, int idx) {
    return ((u64)key << 32) | (u64)(0xffffffffu - (u32)idx);
}
__device__ __forceinline__ int unpack_idx(u64 p) { return (int)(0xffffffffu - (u32)(p & 0xffffffffu)); }

__device__ __forceinline__ u64 block_max_u64(u64 v, u64* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 w = __shfl_xor_sync(STRATA_FULL_MASK, v, o);
        v = w > v ? w : v;
    }
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0ull;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 w = __shfl_xor_sync(STRATA_FULL_MASK, v, o);
        v = w > v ? w : v;
    }
    return v;
}

__device__ __forceinline__ u64 block_sum_u64(u64 v, u64* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(STRATA_FULL_MASK, v, o);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0ull;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(STRATA_FULL_MASK, v, o);
    return v;
}

// Exclusive prefix sum over threads (thread order); every thread gets its own prefix.
__device__ __forceinline__ u64 block_exclusive_scan_u64(u64 v, u64* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    u64 incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 w = __shfl_up_sync(STRATA_FULL_MASK, incl, o);
        if (lane >= o) incl += w;
    }
    __syncthreads();
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    u64 before = 0;
    for (int w = 0; w < warp && w < nwarps; ++w) before += scratch[w];
    return before + incl - v;
}

__device__ __forceinline__ u64 best_of_row(const float* __restrict__ row, int vocab, u64* scratch) {
    u64 best = 0;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const u64 c = pack_best(float_key(row[i]), i);
        best = c > best ? c : best;
    }
    return block_max_u64(best, scratch);
}

__device__ __forceinline__ u64 mass_of(float x, float xmax, float inv_temp) {
    if (x != x) return 0ull;
    const float e = expf((x - xmax) * inv_temp);  // in [0, 1]
    return __float2ull_rn(e * (float)(1ull << MASS_SHIFT));
}

// args: (logits f32 [n_rows, vocab], out i32 [n_rows], n_rows, vocab)
extern "C" __global__ void argmax_f32(const float* logits, int* out, int n_rows, int vocab) {
    __shared__ u64 scratch[32];
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    const u64 best = best_of_row(logits + (i64)r * vocab, vocab, scratch);
    if (threadIdx.x == 0) out[r] = unpack_idx(best);
}

// args: (logits f32 [n_rows, vocab], uniform f32 [n_rows], temperature f32 [n_rows], top_k i32 [n_rows],
//        top_p f32 [n_rows], out i32 [n_rows], n_rows, vocab)
extern "C" __global__ void sample_f32(const float* logits, const float* uniform, const float* temperature,
                                      const int* top_k, const float* top_p, int* out, int n_rows, int vocab) {
    __shared__ u64 scratch[32];
    __shared__ u32 hist_n[256];
    __shared__ u64 hist_m[256];
    __shared__ u32 sel_prefix;
    __shared__ u64 sel_rest;
    const int r = blockIdx.x;
    if (r >= n_rows) return;
    const float* row = logits + (i64)r * vocab;
    const int tid = threadIdx.x, lane = tid & 31;

    const u64 best = best_of_row(row, vocab, scratch);
    const float temp = temperature[r];
    const int k = top_k[r];
    const float xmax = row[unpack_idx(best)];
    // Greedy, or a row whose maximum is not finite (all NaN, +inf or all -inf): take the argmax.
    if (!(temp > 0.0f) || k == 1 || !isfinite(xmax)) {
        if (tid == 0) out[r] = unpack_idx(best);
        return;
    }
    const float inv_temp = 1.0f / temp;

    // ---- top-k: key of the k-th largest logit (radix select, 8 bits per pass) ----
    u32 tau = 0;
    if (k > 0 && k < vocab) {
        u32 prefix = 0, mask = 0;
        u64 rest = (u64)k;
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = tid; b < 256; b += blockDim.x) hist_n[b] = 0;
            __syncthreads();
            // warp-uniform trip count so __match_any_sync sees whole warps
            for (int base = 0; base < vocab; base += blockDim.x) {
                const int i = base + tid;
                u32 bin = 256;
                if (i < vocab) {
                    const u32 key = float_key(row[i]);
                    if ((key & mask) == prefix) bin = (key >> shift) & 255u;
                }
                const u32 peers = __match_any_sync(STRATA_FULL_MASK, bin);
                if (bin < 256 && lane == __ffs(peers) - 1) atomicAdd(&hist_n[bin], (u32)__popc(peers));
            }
            __syncthreads();
            if (tid == 0) {
                u64 cum = 0;
                int b = 255;
                for (; b > 0; --b) {
                    if (cum + hist_n[b] >= rest) break;
                    cum += hist_n[b];
                }
                sel_prefix = (u32)b;
                sel_rest = rest - cum;
            }
            __syncthreads();
            prefix |= sel_prefix << shift;
            mask |= 255u << shift;
            rest = sel_rest;
        }
        tau = prefix;
    }

    // ---- top-p: largest key threshold whose kept mass reaches top_p of the top-k mass ----
    const float p = top_p[r];
    if (p > 0.0f && p < 1.0f) {
        u64 zk = 0;
        for (int i = tid; i < vocab; i += blockDim.x) {
            const float x = row[i];
            if (float_key(x) >= tau) zk += mass_of(x, xmax, inv_temp);
        }
        zk = block_sum_u64(zk, scratch);
        u64 target = (u64)((double)p * (double)zk);
        if (target == 0) target = 1;
        u32 prefix = 0, mask = 0;
        u64 above = 0;  // mass of kept tokens with keys above the current prefix range
        for (int shift = 24; shift >= 0; shift -= 8) {
            for (int b = tid; b < 256; b += blockDim.x) hist_m[b] = 0;
            __syncthreads();
            for (int i = tid; i < vocab; i += blockDim.x) {
                const float x = row[i];
                const u32 key = float_key(x);
                if (key < tau || (key & mask) != prefix) continue;
                const u64 m = mass_of(x, xmax, inv_temp);
                if (m != 0) atomicAdd(&hist_m[(key >> shift) & 255u], m);
            }
            __syncthreads();
            if (tid == 0) {
                u64 cum = 0;
                int b = 255;
                for (; b > 0; --b) {
                    if (above + cum + hist_m[b] >= target) break;
                    cum += hist_m[b];
                }
                sel_prefix = (u32)b;
                sel_rest = above + cum;
            }
            __syncthreads();
            prefix |= sel_prefix << shift;
            mask |= 255u << shift;
            above = sel_rest;
        }
        tau = prefix > tau ? prefix : tau;
    }

    // ---- inverse CDF over kept tokens, vocabulary order ----
    // Each thread owns a contiguous slice, so one exclusive scan over threads orders the mass.
    const int per = (vocab + blockDim.x - 1) / blockDim.x;
    const int lo = tid * per, hi = min(vocab, lo + per);
    u64 mine = 0;
    for (int i = lo; i < hi; ++i) {
        const float x = row[i];
        if (float_key(x) >= tau) mine += mass_of(x, xmax, inv_temp);
    }
    const u64 before = block_exclusive_scan_u64(mine, scratch);
    const u64 total = block_sum_u64(mine, scratch);
    float u = uniform[r];
    u = fminf(fmaxf(u, 0.0f), 1.0f);
    u64 target = (u64)((double)u * (double)total);
    if (target >= total) target = total - 1;  // total >= 1: the argmax token has mass 2^40
    if (mine != 0 && before <= target && target < before + mine) {
        u64 cum = before;
        for (int i = lo; i < hi; ++i) {
            const float x = row[i];
            if (float_key(x) < tau) continue;
            cum += mass_of(x, xmax, inv_temp);
            if (target < cum) {
                out[r] = i;
                break;
            }
        }
    }
}
