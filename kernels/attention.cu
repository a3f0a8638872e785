// Attention: causal prefill over packed variable-length sequences, paged-KV decode
// (flash-decoding: partitions of the context in parallel, then a reduce), and the KV-cache write.
// All softmax math in f32 and base 2 (scores pre-multiplied by scale * log2(e)); GQA maps query
// head h to kv head h / (n_heads / n_kv_heads). Supported head_dim: 64 and 128 (host checks).
//
// Paged KV layout, per layer: k_cache / v_cache [num_blocks, block_size, n_kv_heads, head_dim];
// token t of sequence s lives in block block_tables[s * max_blocks_per_seq + t / block_size],
// slot t % block_size. A "slot" index is block * block_size + offset. The cache holds the
// activation type, or GGML Q8_0 blocks (`*_q8_0_<t>` kernels): a row of n_kv_heads * head_dim
// elements is that many / 32 blocks, so a head (64 or 128 wide) is whole blocks.
#include "common.cuh"

// ---------------------------------------------------------------------------------------------
// kv_write: scatter new k/v rows into the paged cache. slot < 0 marks padding (skipped).
// Launch: grid (n_tokens), block 128.
// ---------------------------------------------------------------------------------------------
template <typename T>
__device__ __forceinline__ void kv_write_impl(const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ k_cache,
                                              T* __restrict__ v_cache, const int* __restrict__ slot_mapping,
                                              int n_tokens, int n_kv_heads, int head_dim, int k_stride, int v_stride) {
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    const int slot = slot_mapping[t];
    if (slot < 0) return;
    const int row = n_kv_heads * head_dim;
    const T* ks = k + (i64)t * k_stride;
    const T* vs = v + (i64)t * v_stride;
    T* kd = k_cache + (i64)slot * row;
    T* vd = v_cache + (i64)slot * row;
    if (row % 8 == 0 && aligned16(ks) && aligned16(vs) && aligned16(kd) && aligned16(vd)) {
        for (int i = threadIdx.x * 8; i < row; i += blockDim.x * 8) {
            float a[8];
            load8(ks + i, a);
            store8(kd + i, a);
            load8(vs + i, a);
            store8(vd + i, a);
        }
    } else {
        for (int i = threadIdx.x; i < row; i += blockDim.x) {
            kd[i] = ks[i];
            vd[i] = vs[i];
        }
    }
}

// kv_write_q8_0: the same scatter into a Q8_0 cache. Each 32 elements become one block with
// scale amax / 127 (stored as f16) and values round(x / scale), ggml's reference rounding, which
// the CPU backend's q8_0 KV uses too. One warp per block, lane = element.
// Launch: grid (n_tokens), block 128.
template <typename T>
__device__ __forceinline__ void kv_write_q8_0_impl(const T* __restrict__ k, const T* __restrict__ v,
                                                   block_q8_0* __restrict__ k_cache, block_q8_0* __restrict__ v_cache,
                                                   const int* __restrict__ slot_mapping, int n_tokens, int n_kv_heads,
                                                   int head_dim, int k_stride, int v_stride) {
    const int t = blockIdx.x;
    if (t >= n_tokens) return;
    const int slot = slot_mapping[t];
    if (slot < 0) return;
    const int nb = n_kv_heads * head_dim / QK;  // the host checks rows are whole blocks
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int b = warp; b < 2 * nb; b += warps) {  // blocks of k, then of v; uniform per warp
        const bool is_v = b >= nb;
        const int blk = is_v ? b - nb : b;
        const T* src = is_v ? v + (i64)t * v_stride : k + (i64)t * k_stride;
        const float x = to_f32(src[blk * QK + lane]);
        const float d = warp_max(fabsf(x)) / 127.0f;
        const float id = d > 0.0f ? 1.0f / d : 0.0f;
        block_q8_0* dst = (is_v ? v_cache : k_cache) + (i64)slot * nb + blk;
        dst->qs[lane] = (i8)roundf(x * id);
        if (lane == 0) dst->d = __half_as_ushort(__float2half_rn(d));
    }
}

// Eight cached elements as f32: columns col..col+8 (col a multiple of 8) of the row at `slot`,
// rows `row` elements wide.
template <typename C>
__device__ __forceinline__ void kv_load8(const C* cache, i64 slot, i64 row, i64 col, float (&o)[8]) {
    load8(cache + slot * row + col, o);
}
__device__ __forceinline__ void kv_load8(const block_q8_0* cache, i64 slot, i64 row, i64 col, float (&o)[8]) {
    dequant8(cache + slot * (row / QK), (int)(col / 8), o);
}

// ---------------------------------------------------------------------------------------------
// Prefill: causal attention within each packed sequence (no earlier context).
// One CTA = 32 query rows of one (sequence, head); 8 warps x 4 rows; key/value tiles of 32 rows
// staged in shared memory as f32 (K transposed so lane j reads key j conflict-free); each warp
// keeps an online softmax (running max / sum) per row and lane-sliced f32 output accumulators.
// Launch: grid (ceil(max_seq_len / 32), n_heads, num_seqs), block 256.
// ---------------------------------------------------------------------------------------------
#define PF_BR 32
#define PF_BC 32
#define PF_WARPS 8
#define PF_ROWS (PF_BR / PF_WARPS)

template <int D, typename T>
__device__ __forceinline__ void prefill_impl(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                                             T* __restrict__ out, const int* __restrict__ cu_seqlens, int n_heads,
                                             int n_kv_heads, float scale, int q_stride, int kv_stride, float* smem) {
    constexpr int DPL = D / 32;  // output elements per lane
    constexpr int CH = D / 8;    // 8-element chunks per row
    float (*qs)[D] = reinterpret_cast<float (*)[D]>(smem);                       // [PF_BR][D]
    float (*kt)[PF_BC] = reinterpret_cast<float (*)[PF_BC]>(smem + PF_BR * D);   // [D][PF_BC]
    float (*vs)[D] = reinterpret_cast<float (*)[D]>(smem + PF_BR * D + D * PF_BC);  // [PF_BC][D]

    const int seq = blockIdx.z, head = blockIdx.y, q0 = blockIdx.x * PF_BR;
    const int start = cu_seqlens[seq], len = cu_seqlens[seq + 1] - start;
    if (q0 >= len) return;
    const int kvh = head / (n_heads / n_kv_heads);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float qscale = scale * STRATA_LOG2E;

    // Q tile (pre-scaled); rows past the end are zero.
    for (int e = tid; e < PF_BR * CH; e += blockDim.x) {
        const int r = e / CH, c = e % CH;
        float f[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if (q0 + r < len) load8(q + (i64)(start + q0 + r) * q_stride + head * D + c * 8, f);
#pragma unroll
        for (int i = 0; i < 8; ++i) qs[r][c * 8 + i] = f[i] * qscale;
    }

    float o[PF_ROWS][DPL], mrow[PF_ROWS], lrow[PF_ROWS];
#pragma unroll
    for (int r = 0; r < PF_ROWS; ++r) {
        mrow[r] = STRATA_NEG_INF;
        lrow[r] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; ++i) o[r][i] = 0.0f;
    }

    const int kend = min(len, q0 + PF_BR);  // causal: keys beyond the tile's last query are never needed
    for (int k0 = 0; k0 < kend; k0 += PF_BC) {
        __syncthreads();  // previous K/V tile consumed (and Q tile written, first time round)
        for (int e = tid; e < PF_BC * CH; e += blockDim.x) {
            const int j = e % PF_BC, c = e / PF_BC;  // lane-consecutive j: conflict-free kt stores
            float fk[8] = {0, 0, 0, 0, 0, 0, 0, 0}, fv[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            if (k0 + j < len) {
                const i64 off = (i64)(start + k0 + j) * kv_stride + kvh * D + c * 8;
                load8(k + off, fk);
                load8(v + off, fv);
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                kt[c * 8 + i][j] = fk[i];
                vs[j][c * 8 + i] = fv[i];
            }
        }
        __syncthreads();

        // scores: lane = key j, 4 rows per warp
        float s[PF_ROWS];
#pragma unroll
        for (int r = 0; r < PF_ROWS; ++r) s[r] = 0.0f;
#pragma unroll 4
        for (int d = 0; d < D; d += 4) {
            const float k_0 = kt[d][lane], k_1 = kt[d + 1][lane], k_2 = kt[d + 2][lane], k_3 = kt[d + 3][lane];
#pragma unroll
            for (int r = 0; r < PF_ROWS; ++r) {
                const float4 qq = *reinterpret_cast<const float4*>(&qs[warp * PF_ROWS + r][d]);
                s[r] = fmaf(qq.x, k_0, fmaf(qq.y, k_1, fmaf(qq.z, k_2, fmaf(qq.w, k_3, s[r]))));
            }
        }
        const int kj = k0 + lane;
#pragma unroll
        for (int r = 0; r < PF_ROWS; ++r) {
            const int qi = q0 + warp * PF_ROWS + r;
            if (kj > qi || kj >= len) s[r] = STRATA_NEG_INF;
            const float mnew = fmaxf(mrow[r], warp_max(s[r]));
            // mnew is finite: key 0 of the first tile is always visible to every row
            const float p = exp2f(s[r] - mnew);
            const float corr = exp2f(mrow[r] - mnew);
            lrow[r] = lrow[r] * corr + warp_sum(p);
            mrow[r] = mnew;
#pragma unroll
            for (int i = 0; i < DPL; ++i) o[r][i] *= corr;
            s[r] = p;
        }
        // O += P V: broadcast p_j from lane j
        const int jmax = min(PF_BC, kend - k0);
        for (int j = 0; j < jmax; ++j) {
            float vv[DPL];
#pragma unroll
            for (int i = 0; i < DPL; ++i) vv[i] = vs[j][lane + 32 * i];
#pragma unroll
            for (int r = 0; r < PF_ROWS; ++r) {
                const float p = __shfl_sync(STRATA_FULL_MASK, s[r], j);
#pragma unroll
                for (int i = 0; i < DPL; ++i) o[r][i] = fmaf(p, vv[i], o[r][i]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < PF_ROWS; ++r) {
        const int qi = q0 + warp * PF_ROWS + r;
        if (qi >= len) continue;
        const float inv = 1.0f / lrow[r];
        T* dst = out + (i64)(start + qi) * n_heads * D + head * D;
#pragma unroll
        for (int i = 0; i < DPL; ++i) dst[lane + 32 * i] = from_f32<T>(o[r][i] * inv);
    }
}

template <typename T>
__device__ __forceinline__ void prefill_dispatch(const T* q, const T* k, const T* v, T* out, const int* cu_seqlens,
                                                 int n_heads, int n_kv_heads, int head_dim, float scale, int q_stride,
                                                 int kv_stride) {
    // One buffer for every instantiation (static __shared__ inside each would be summed).
    __shared__ __align__(16) float smem[3 * PF_BR * 128];
    if (head_dim == 128) prefill_impl<128>(q, k, v, out, cu_seqlens, n_heads, n_kv_heads, scale, q_stride, kv_stride, smem);
    else if (head_dim == 64) prefill_impl<64>(q, k, v, out, cu_seqlens, n_heads, n_kv_heads, scale, q_stride, kv_stride, smem);
}

// ---------------------------------------------------------------------------------------------
// Decode over the paged cache (one query token per sequence), flash-decoding style.
// CTA = (partition of `partition_size` context tokens, group of G query heads sharing one kv head,
// sequence), so each K/V row is read once for all G heads. 8 warps; D/8 lanes own one key (one
// 128-bit load each for f16/bf16), UNR keys per lane group in flight. Phase 1 writes base-2
// scores to shared memory, phase 2 takes the max / exp / sum per head, phase 3 accumulates P V
// in registers and reduces across warps through shared memory.
// Output: when gridDim.x == 1 the result goes straight to `out` (the reduce may be skipped);
// otherwise per-partition (o / l) into part_out and (max, sum) into part_ml for the reduce.
// Launch: grid (ceil(max_context_len / partition_size), n_heads / G, num_seqs), block 256,
// G = decode_heads_per_cta(n_heads, n_kv_heads) (largest of 8, 4, 2, 1 dividing the group size).
// ---------------------------------------------------------------------------------------------
#define PD_WARPS 8
#define PD_MAX_PARTITION 512
#define PD_UNR 4
#define PD_SCRATCH (PD_WARPS * 8 * 128 > 8 * PD_MAX_PARTITION ? PD_WARPS * 8 * 128 : 8 * PD_MAX_PARTITION)

__device__ __forceinline__ int heads_per_cta(int group) {
    return group % 8 == 0 ? 8 : group % 4 == 0 ? 4 : group % 2 == 0 ? 2 : 1;
}

template <int D, int G, typename T, typename C>
__device__ __forceinline__ void decode_impl(const T* __restrict__ q, const C* __restrict__ k_cache,
                                            const C* __restrict__ v_cache, const int* __restrict__ block_tables,
                                            const int* __restrict__ context_lens, float* __restrict__ part_out,
                                            float* __restrict__ part_ml, T* __restrict__ out, int n_heads,
                                            int n_kv_heads, int block_size, int max_blocks_per_seq,
                                            int partition_size, float scale, int q_stride, float* smem) {
    constexpr int LPK = D / 8;     // lanes per key
    constexpr int KPW = 32 / LPK;  // keys per warp per step (x PD_UNR)
    float (*qs)[D] = reinterpret_cast<float (*)[D]>(smem);  // [G][D]
    float* head_m = smem + G * D;                          // [G]
    float* head_l = head_m + G;                            // [G]
    float* buf = smem + G * D + 2 * 8;  // scores [G][P], later the cross-warp reduction [W][G][D]

    const int seq = blockIdx.z, part = blockIdx.x, nparts = gridDim.x;
    const int h0 = blockIdx.y * G;
    const int kvh = h0 / (n_heads / n_kv_heads);
    const int ctx = context_lens[seq];
    const int p0 = part * partition_size, p1 = min(ctx, p0 + partition_size);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

    if (p0 >= p1) {
        // Empty partition. With a single partition and ctx == 0 the output is defined as zero.
        if (nparts == 1)
            for (int e = tid; e < G * D; e += blockDim.x)
                out[(i64)seq * n_heads * D + (h0 + e / D) * D + e % D] = from_f32<T>(0.0f);
        return;
    }
    const float qscale = scale * STRATA_LOG2E;
    for (int e = tid; e < G * D; e += blockDim.x)
        qs[e / D][e % D] = to_f32(q[(i64)seq * q_stride + (h0 + e / D) * D + e % D]) * qscale;
    __syncthreads();

    const int chunk = lane % LPK, ksub = lane / LPK;
    const int* bt = block_tables + (i64)seq * max_blocks_per_seq;
    const i64 row = (i64)n_kv_heads * D;
    const i64 head_off = (i64)kvh * D + chunk * 8;
    float* scores = buf;

    // phase 1: scores
    for (int base = p0 + warp * KPW * PD_UNR; base < p1; base += PD_WARPS * KPW * PD_UNR) {
        float kv[PD_UNR][8];
#pragma unroll
        for (int u = 0; u < PD_UNR; ++u) {
            const int t = base + u * KPW + ksub;
            if (t < p1) {
                const i64 slot = (i64)bt[t / block_size] * block_size + t % block_size;
                kv_load8(k_cache, slot, row, head_off, kv[u]);
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) kv[u][i] = 0.0f;
            }
        }
        // head-outer order: each head's q slice is read from shared memory once per step
#pragma unroll
        for (int h = 0; h < G; ++h) {
            const float4 qa = *reinterpret_cast<const float4*>(&qs[h][chunk * 8]);
            const float4 qb = *reinterpret_cast<const float4*>(&qs[h][chunk * 8 + 4]);
#pragma unroll
            for (int u = 0; u < PD_UNR; ++u) {
                const int t = base + u * KPW + ksub;
                float s = qa.x * kv[u][0];
                s = fmaf(qa.y, kv[u][1], s);
                s = fmaf(qa.z, kv[u][2], s);
                s = fmaf(qa.w, kv[u][3], s);
                s = fmaf(qb.x, kv[u][4], s);
                s = fmaf(qb.y, kv[u][5], s);
                s = fmaf(qb.z, kv[u][6], s);
                s = fmaf(qb.w, kv[u][7], s);
#pragma unroll
                for (int o = LPK / 2; o > 0; o >>= 1) s += __shfl_xor_sync(STRATA_FULL_MASK, s, o);
                if (chunk == 0 && t < p1) scores[h * PD_MAX_PARTITION + (t - p0)] = s;
            }
        }
    }
    __syncthreads();

    // phase 2: softmax statistics per head (one warp per head)
    const int n = p1 - p0;
    for (int h = warp; h < G; h += PD_WARPS) {
        float* sh = scores + h * PD_MAX_PARTITION;
        float m = STRATA_NEG_INF;
        for (int i = lane; i < n; i += 32) m = fmaxf(m, sh[i]);
        m = warp_max(m);
        float l = 0.0f;
        for (int i = lane; i < n; i += 32) {
            const float p = exp2f(sh[i] - m);
            sh[i] = p;
            l += p;
        }
        l = warp_sum(l);
        if (lane == 0) {
            head_m[h] = m;
            head_l[h] = l;
        }
    }
    __syncthreads();

    // phase 3: P V
    float acc[G][8];
#pragma unroll
    for (int h = 0; h < G; ++h)
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[h][i] = 0.0f;
    for (int base = p0 + warp * KPW * PD_UNR; base < p1; base += PD_WARPS * KPW * PD_UNR) {
        float vv[PD_UNR][8];
#pragma unroll
        for (int u = 0; u < PD_UNR; ++u) {
            const int t = base + u * KPW + ksub;
            if (t < p1) {
                const i64 slot = (i64)bt[t / block_size] * block_size + t % block_size;
                kv_load8(v_cache, slot, row, head_off, vv[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < PD_UNR; ++u) {
            const int t = base + u * KPW + ksub;
            if (t < p1) {
#pragma unroll
                for (int h = 0; h < G; ++h) {
                    const float p = scores[h * PD_MAX_PARTITION + (t - p0)];
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[h][i] = fmaf(p, vv[u][i], acc[h][i]);
                }
            }
        }
    }
    // reduce across the key groups of a warp (lanes with the same chunk)
#pragma unroll
    for (int h = 0; h < G; ++h)
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int o = LPK; o < 32; o <<= 1) acc[h][i] += __shfl_xor_sync(STRATA_FULL_MASK, acc[h][i], o);
    __syncthreads();  // scores no longer read; buf becomes the reduction buffer
    if (lane < LPK) {
#pragma unroll
        for (int h = 0; h < G; ++h) {
            float* dst = buf + (warp * G + h) * D + chunk * 8;
            *reinterpret_cast<float4*>(dst) = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
            *reinterpret_cast<float4*>(dst + 4) = make_float4(acc[h][4], acc[h][5], acc[h][6], acc[h][7]);
        }
    }
    __syncthreads();
    for (int e = tid; e < G * D; e += blockDim.x) {
        const int h = e / D, d = e % D;
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < PD_WARPS; ++w) s += buf[(w * G + h) * D + d];
        const float val = s / head_l[h];
        if (nparts == 1) {
            out[(i64)seq * n_heads * D + (h0 + h) * D + d] = from_f32<T>(val);
        } else {
            const i64 idx = ((i64)seq * n_heads + h0 + h) * nparts + part;
            part_out[idx * D + d] = val;
            if (d == 0) {
                part_ml[idx * 2] = head_m[h];
                part_ml[idx * 2 + 1] = head_l[h];
            }
        }
    }
}

template <int D, typename T, typename C>
__device__ __forceinline__ void decode_by_group(const T* q, const C* kc, const C* vc, const int* bt, const int* cl,
                                                float* po, float* pml, T* out, int n_heads, int n_kv_heads, int bs,
                                                int mb, int ps, float scale, int q_stride, float* smem) {
    switch (heads_per_cta(n_heads / n_kv_heads)) {
        case 8: decode_impl<D, 8>(q, kc, vc, bt, cl, po, pml, out, n_heads, n_kv_heads, bs, mb, ps, scale, q_stride, smem); break;
        case 4: decode_impl<D, 4>(q, kc, vc, bt, cl, po, pml, out, n_heads, n_kv_heads, bs, mb, ps, scale, q_stride, smem); break;
        case 2: decode_impl<D, 2>(q, kc, vc, bt, cl, po, pml, out, n_heads, n_kv_heads, bs, mb, ps, scale, q_stride, smem); break;
        default: decode_impl<D, 1>(q, kc, vc, bt, cl, po, pml, out, n_heads, n_kv_heads, bs, mb, ps, scale, q_stride, smem); break;
    }
}

template <typename T, typename C>
__device__ __forceinline__ void decode_dispatch(const T* q, const C* kc, const C* vc, const int* bt, const int* cl,
                                                float* po, float* pml, T* out, int n_heads, int n_kv_heads,
                                                int head_dim, int bs, int mb, int ps, float scale, int q_stride) {
    // qs [G][D] + m/l [2][8] + max(scores [G][P], reduction [W][G][D]) at G = 8, D = 128.
    __shared__ __align__(16) float smem[8 * 128 + 16 + PD_SCRATCH];
    if (ps <= 0 || ps > PD_MAX_PARTITION) return;  // host contract; never index past the score buffer
    if (head_dim == 128) decode_by_group<128>(q, kc, vc, bt, cl, po, pml, out, n_heads, n_kv_heads, bs, mb, ps, scale, q_stride, smem);
    else if (head_dim == 64) decode_by_group<64>(q, kc, vc, bt, cl, po, pml, out, n_heads, n_kv_heads, bs, mb, ps, scale, q_stride, smem);
}

// Combine partitions: M = max m_p, w_p = l_p 2^(m_p - M), out = sum w_p o_p / sum w_p.
// Launch: grid (n_heads, num_seqs), block 128.
template <typename T>
__device__ __forceinline__ void reduce_impl(const float* __restrict__ part_out, const float* __restrict__ part_ml,
                                            const int* __restrict__ context_lens, T* __restrict__ out, int n_heads,
                                            int head_dim, int num_partitions, int partition_size) {
    const int head = blockIdx.x, seq = blockIdx.y;
    const int ctx = context_lens[seq];
    const int np = min(num_partitions, (ctx + partition_size - 1) / partition_size);
    const i64 base = ((i64)seq * n_heads + head) * num_partitions;
    T* dst = out + ((i64)seq * n_heads + head) * head_dim;
    float m = STRATA_NEG_INF;
    for (int p = 0; p < np; ++p) m = fmaxf(m, part_ml[(base + p) * 2]);
    float l = 0.0f;
    for (int p = 0; p < np; ++p) l += part_ml[(base + p) * 2 + 1] * exp2f(part_ml[(base + p) * 2] - m);
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int p = 0; p < np; ++p) {
            const float w = part_ml[(base + p) * 2 + 1] * exp2f(part_ml[(base + p) * 2] - m);
            acc = fmaf(w, part_out[(base + p) * head_dim + d], acc);
        }
        dst[d] = from_f32<T>(acc * inv);
    }
}

// Bounds live on forward declarations; definitions keep the plain form the Rust crate checks.
#define PD_BOUNDS __launch_bounds__(32 * PD_WARPS, 2)

// kv_write: (k [n_tokens, n_kv_heads * head_dim] (row stride k_stride), v (row stride v_stride),
//            k_cache, v_cache, slot_mapping i32 [n_tokens], n_tokens, n_kv_heads, head_dim, k_stride, v_stride);
// kv_write_q8_0_<t>: the same into Q8_0 caches (n_kv_heads * head_dim a multiple of 32)
extern "C" __global__ void kv_write_f32(const float* k, const float* v, float* k_cache, float* v_cache, const int* slot_mapping, int n_tokens, int n_kv_heads, int head_dim, int k_stride, int v_stride) { kv_write_impl(k, v, k_cache, v_cache, slot_mapping, n_tokens, n_kv_heads, head_dim, k_stride, v_stride); }
extern "C" __global__ void kv_write_q8_0_f32(const float* k, const float* v, block_q8_0* k_cache, block_q8_0* v_cache, const int* slot_mapping, int n_tokens, int n_kv_heads, int head_dim, int k_stride, int v_stride) { kv_write_q8_0_impl(k, v, k_cache, v_cache, slot_mapping, n_tokens, n_kv_heads, head_dim, k_stride, v_stride); }
extern "C" __global__ void kv_write_f16(const __half* k, const __half* v, __half* k_cache, __half* v_cache, const int* slot_mapping, int n_tokens, int n_kv_heads, int head_dim, int k_stride, int v_stride) { kv_write_impl(k, v, k_cache, v_cache, slot_mapping, n_tokens, n_kv_heads, head_dim, k_stride, v_stride); }
extern "C" __global__ void kv_write_q8_0_f16(const __half* k, const __half* v, block_q8_0* k_cache, block_q8_0* v_cache, const int* slot_mapping, int n_tokens, int n_kv_heads, int head_dim, int k_stride, int v_stride) { kv_write_q8_0_impl(k, v, k_cache, v_cache, slot_mapping, n_tokens, n_kv_heads, head_dim, k_stride, v_stride); }

// attention_prefill: (q [tokens, n_heads, head_dim] (row stride q_stride), k, v [tokens, n_kv_heads, head_dim]
//   (row stride kv_stride), out [tokens, n_heads * head_dim], cu_seqlens i32 [num_seqs + 1],
//   n_heads, n_kv_heads, head_dim, scale, q_stride, kv_stride)
extern "C" __global__ void attention_prefill_f32(const float* q, const float* k, const float* v, float* out, const int* cu_seqlens, int n_heads, int n_kv_heads, int head_dim, float scale, int q_stride, int kv_stride) { prefill_dispatch(q, k, v, out, cu_seqlens, n_heads, n_kv_heads, head_dim, scale, q_stride, kv_stride); }
extern "C" __global__ void attention_prefill_f16(const __half* q, const __half* k, const __half* v, __half* out, const int* cu_seqlens, int n_heads, int n_kv_heads, int head_dim, float scale, int q_stride, int kv_stride) { prefill_dispatch(q, k, v, out, cu_seqlens, n_heads, n_kv_heads, head_dim, scale, q_stride, kv_stride); }

// paged_attention_decode: (q [num_seqs, n_heads, head_dim] (row stride q_stride), k_cache, v_cache,
//   block_tables i32 [num_seqs, max_blocks_per_seq], context_lens i32 [num_seqs],
//   part_out f32 [num_seqs, n_heads, num_partitions, head_dim], part_ml f32 [num_seqs, n_heads, num_partitions, 2],
//   out [num_seqs, n_heads * head_dim], n_heads, n_kv_heads, head_dim, block_size, max_blocks_per_seq,
//   partition_size (<= 512), scale, q_stride); paged_attention_decode_q8_0_<t> reads Q8_0 caches
extern "C" __global__ void PD_BOUNDS paged_attention_decode_f32(const float* q, const float* k_cache, const float* v_cache, const int* block_tables, const int* context_lens, float* part_out, float* part_ml, float* out, int n_heads, int n_kv_heads, int head_dim, int block_size, int max_blocks_per_seq, int partition_size, float scale, int q_stride);
extern "C" __global__ void PD_BOUNDS paged_attention_decode_q8_0_f32(const float* q, const block_q8_0* k_cache, const block_q8_0* v_cache, const int* block_tables, const int* context_lens, float* part_out, float* part_ml, float* out, int n_heads, int n_kv_heads, int head_dim, int block_size, int max_blocks_per_seq, int partition_size, float scale, int q_stride);
extern "C" __global__ void paged_attention_decode_f32(const float* q, const float* k_cache, const float* v_cache, const int* block_tables, const int* context_lens, float* part_out, float* part_ml, float* out, int n_heads, int n_kv_heads, int head_dim, int block_size, int max_blocks_per_seq, int partition_size, float scale, int q_stride) { decode_dispatch(q, k_cache, v_cache, block_tables, context_lens, part_out, part_ml, out, n_heads, n_kv_heads, head_dim, block_size, max_blocks_per_seq, partition_size, scale, q_stride); }
extern "C" __global__ void paged_attention_decode_q8_0_f32(const float* q, const block_q8_0* k_cache, const block_q8_0* v_cache, const int* block_tables, const int* context_lens, float* part_out, float* part_ml, float* out, int n_heads, int n_kv_heads, int head_dim, int block_size, int max_blocks_per_seq, int partition_size, float scale, int q_stride) { decode_dispatch(q, k_cache, v_cache, block_tables, context_lens, part_out, part_ml, out, n_heads, n_kv_heads, head_dim, block_size, max_blocks_per_seq, partition_size, scale, q_stride); }
extern "C" __global__ void PD_BOUNDS paged_attention_decode_f16(const __half* q, const __half* k_cache, const __half* v_cache, const int* block_tables, const int* context_lens, float* part_out, float* part_ml, __half* out, int n_heads, int n_kv_heads, int head_dim, int block_size, int max_blocks_per_seq, int partition_size, float scale, int q_stride);
extern "C" __global__ void PD_BOUNDS paged_attention_decode_q8_0_f16(const __half* q, const block_q8_0* k_cache, const block_q8_0* v_cache, const int* block_tables, const int* context_lens, float* part_out, float* part_ml, __half* out, int n_heads, int n_kv_heads, int head_dim, int block_size, int max_blocks_per_seq, int partition_size, float scale, int q_stride);
extern "C" __global__ void paged_attention_decode_f16(const __half* q, const __half* k_cache, const __half* v_cache, const int* block_tables, const int* context_lens, float* part_out, float* part_ml, __half* out, int n_heads, int n_kv_heads, int head_dim, int block_size, int max_blocks_per_seq, int partition_size, float scale, int q_stride) { decode_dispatch(q, k_cache, v_cache, block_tables, context_lens, part_out, part_ml, out, n_heads, n_kv_heads, head_dim, block_size, max_blocks_per_seq, partition_size, scale, q_stride); }
extern "C" __global__ void paged_attention_decode_q8_0_f16(const __half* q, const block_q8_0* k_cache, const block_q8_0* v_cache, const int* block_tables, const int* context_lens, float* part_out, float* part_ml, __half* out, int n_heads, int n_kv_heads, int head_dim, int block_size, int max_blocks_per_seq, int partition_size, float scale, int q_stride) { decode_dispatch(q, k_cache, v_cache, block_tables, context_lens, part_out, part_ml, out, n_heads, n_kv_heads, head_dim, block_size, max_blocks_per_seq, partition_size, scale, q_stride); }

// paged_attention_reduce: (part_out, part_ml, context_lens, out [num_seqs, n_heads * head_dim],
//   n_heads, head_dim, num_partitions, partition_size)
extern "C" __global__ void paged_attention_reduce_f32(const float* part_out, const float* part_ml, const int* context_lens, float* out, int n_heads, int head_dim, int num_partitions, int partition_size) { reduce_impl(part_out, part_ml, context_lens, out, n_heads, head_dim, num_partitions, partition_size); }
extern "C" __global__ void paged_attention_reduce_f16(const float* part_out, const float* part_ml, const int* context_lens, __half* out, int n_heads, int head_dim, int num_partitions, int partition_size) { reduce_impl(part_out, part_ml, context_lens, out, n_heads, head_dim, num_partitions, partition_size); }

#if STRATA_HAS_BF16
extern "C" __global__ void kv_write_bf16(const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* k_cache, __nv_bfloat16* v_cache, const int* slot_mapping, int n_tokens, int n_kv_heads, int head_dim, int k_stride, int v_stride) { kv_write_impl(k, v, k_cache, v_cache, slot_mapping, n_tokens, n_kv_heads, head_dim, k_stride, v_stride); }
extern "C" __global__ void kv_write_q8_0_bf16(const __nv_bfloat16* k, const __nv_bfloat16* v, block_q8_0* k_cache, block_q8_0* v_cache, const int* slot_mapping, int n_tokens, int n_kv_heads, int head_dim, int k_stride, int v_stride) { kv_write_q8_0_impl(k, v, k_cache, v_cache, slot_mapping, n_tokens, n_kv_heads, head_dim, k_stride, v_stride); }
extern "C" __global__ void attention_prefill_bf16(const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* v, __nv_bfloat16* out, const int* cu_seqlens, int n_heads, int n_kv_heads, int head_dim, float scale, int q_stride, int kv_stride) { prefill_dispatch(q, k, v, out, cu_seqlens, n_heads, n_kv_heads, head_dim, scale, q_stride, kv_stride); }
extern "C" __global__ void PD_BOUNDS paged_attention_decode_bf16(const __nv_bfloat16* q, const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache, const int* block_tables, const int* context_lens, float* part_out, float* part_ml, __nv_bfloat16* out, int n_heads, int n_kv_heads, int head_dim, int block_size, int max_blocks_per_seq, int partition_size, float scale, int q_stride);
extern "C" __global__ void PD_BOUNDS paged_attention_decode_q8_0_bf16(const __nv_bfloat16* q, const block_q8_0* k_cache, const block_q8_0* v_cache, const int* block_tables, const int* context_lens, float* part_out, float* part_ml, __nv_bfloat16* out, int n_heads, int n_kv_heads, int head_dim, int block_size, int max_blocks_per_seq, int partition_size, float scale, int q_stride);
extern "C" __global__ void paged_attention_decode_bf16(const __nv_bfloat16* q, const __nv_bfloat16* k_cache, const __nv_bfloat16* v_cache, const int* block_tables, const int* context_lens, float* part_out, float* part_ml, __nv_bfloat16* out, int n_heads, int n_kv_heads, int head_dim, int block_size, int max_blocks_per_seq, int partition_size, float scale, int q_stride) { decode_dispatch(q, k_cache, v_cache, block_tables, context_lens, part_out, part_ml, out, n_heads, n_kv_heads, head_dim, block_size, max_blocks_per_seq, partition_size, scale, q_stride); }
extern "C" __global__ void paged_attention_decode_q8_0_bf16(const __nv_bfloat16* q, const block_q8_0* k_cache, const block_q8_0* v_cache, const int* block_tables, const int* context_lens, float* part_out, float* part_ml, __nv_bfloat16* out, int n_heads, int n_kv_heads, int head_dim, int block_size, int max_blocks_per_seq, int partition_size, float scale, int q_stride) { decode_dispatch(q, k_cache, v_cache, block_tables, context_lens, part_out, part_ml, out, n_heads, n_kv_heads, head_dim, block_size, max_blocks_per_seq, partition_size, scale, q_stride); }
extern "C" __global__ void paged_attention_reduce_bf16(const float* part_out, const float* part_ml, const int* context_lens, __nv_bfloat16* out, int n_heads, int head_dim, int num_partitions, int partition_size) { reduce_impl(part_out, part_ml, context_lens, out, n_heads, head_dim, num_partitions, partition_size); }
#endif
