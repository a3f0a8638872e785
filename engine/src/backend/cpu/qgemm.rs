//! Quantized weights times several tokens (batched decode, prefill): one weight row against up to 8 tokens, so
//! each weight block is unpacked once for all of them, the 8 accumulators stay in registers and the per-block
//! scales come from memory through load-port broadcasts (no ALU slot). Each output is computed with exactly the
//! float operations of the one-token kernels in `simd` (same order, same roundings), so how tokens are grouped
//! never changes a result.

use super::simd::{Isa, Q8Block};
use crate::quant::QK;
use crate::tensor::DType;

/// Tokens interleaved in one activation group (the tile's token dimension).
pub const GROUP: usize = 8;

/// The 8-bit blocks of up to [`GROUP`] tokens at one block index, side by side; unused slots are zero.
#[derive(Debug, Clone, Copy)]
#[repr(C, align(32))]
pub struct Q8x8 {
    d: [f32; GROUP],
    qs: [[i8; QK]; GROUP],
}

/// For the same tokens and block as a [`Q8x8`]: `-128 ·` the sum of each 4-byte group of a token's block, lane by
/// lane as `vpdpbusd` sums them. Lets the AVX-512 tile take signed weights as unsigned (`w + 128`) and start each
/// lane from this offset, instead of moving every weight's sign onto the activations: the same integers, one
/// instruction less per pair of tokens and block (see `x86::pairs`).
#[derive(Debug, Clone, Copy)]
#[repr(C, align(64))]
pub struct LaneSums([[i32; GROUP]; GROUP]);

/// Where the tile reads one token group: its [`Q8x8`]s and [`LaneSums`] from the same block on.
#[derive(Debug, Clone, Copy)]
pub struct GroupPtr {
    q: *const Q8x8,
    sums: *const LaneSums,
}

/// Quantized activations of `tokens` rows, regrouped as `[group][block]` for [`rows_by_tokens`].
#[derive(Debug)]
pub struct PackedActs {
    groups: Vec<Q8x8>,
    /// Beside `groups`, one for one.
    sums: Vec<LaneSums>,
    blocks: usize,
    tokens: usize,
}

impl PackedActs {
    /// Regroups `xq` (`tokens` rows of `blocks` blocks, back to back), with their [`LaneSums`] if `lane_sums`
    /// (some weight they meet is read by a tile that needs them: [`reads_lane_sums`]).
    pub fn pack(xq: &[Q8Block], tokens: usize, blocks: usize, lane_sums: bool) -> Self {
        let zero = Q8x8 { d: [0.0; GROUP], qs: [[0; QK]; GROUP] };
        let mut groups = vec![zero; tokens.div_ceil(GROUP) * blocks];
        let mut sums = vec![LaneSums([[0; GROUP]; GROUP]); if lane_sums { groups.len() } else { 0 }];
        for (t, row) in xq.chunks_exact(blocks).take(tokens).enumerate() {
            let (g, slot) = (t / GROUP, t % GROUP);
            for (b, blk) in row.iter().enumerate() {
                let dst = &mut groups[g * blocks + b];
                dst.d[slot] = blk.d;
                dst.qs[slot] = blk.qs;
                if let Some(sum) = sums.get_mut(g * blocks + b) {
                    for (lane, four) in sum.0[slot].iter_mut().zip(blk.qs.chunks_exact(4)) {
                        *lane = -128 * four.iter().map(|&q| i32::from(q)).sum::<i32>();
                    }
                }
            }
        }
        Self { groups, sums, blocks, tokens }
    }
}

/// Whether [`rows_by_tokens`] needs the activations' [`LaneSums`] for weights of `dtype` at level `isa`.
#[cfg(target_arch = "x86_64")]
pub fn reads_lane_sums(isa: Isa, dtype: DType) -> bool {
    dtype.is_quantized() && super::kernels::kernels(dtype).x86(isa).is_some_and(|k| k.lane_sums)
}

/// `out[t · token_stride + r] = w_r · x_t` for every row `r` of `w` (raw GGML blocks of `dtype`, `row_bytes`
/// apart) and every token `t` of `acts`, with the kernels of `isa`, an x86 instruction set this CPU has
/// (checked).
///
/// # Safety
/// Those output elements must be valid for writes and not accessed by anyone else during the call.
#[cfg(target_arch = "x86_64")]
pub unsafe fn rows_by_tokens(
    isa: Isa,
    dtype: DType,
    w: &[u8],
    row_bytes: usize,
    acts: &PackedActs,
    out: *mut f32,
    token_stride: usize,
) {
    let (m, blocks) = (acts.tokens, acts.blocks);
    let n = w.len() / row_bytes.max(1);
    // These bounds are what every raw-pointer access below relies on.
    let k = dtype.is_quantized().then(|| super::kernels::kernels(dtype).x86(isa)).flatten();
    let Some(k) = k else { panic!("qgemm has no {} kernels for {dtype}", isa.name()) };
    assert!(
        dtype.bytes_for(blocks * QK).is_some_and(|b| row_bytes >= b)
            && acts.groups.len() == m.div_ceil(GROUP) * blocks
            && (!k.lane_sums || acts.sums.len() == acts.groups.len())
            && isa.supported(),
        "qgemm operands do not match"
    );
    // Per-block scales of one row × one group, rewritten by every tile (aligned for 256-bit stores): `d_w·d_a`.
    let mut scales = vec![Align32([0f32; GROUP]); blocks];
    let sc = scales.as_mut_ptr() as *mut f32;
    // Token groups are visited in runs that fit in L1 (with room for the weight rows), all rows per run: with
    // long prompts every row would otherwise stream all activations from L2.
    let groups = m.div_ceil(GROUP);
    let group_bytes = std::mem::size_of::<Q8x8>() + if k.lane_sums { std::mem::size_of::<LaneSums>() } else { 0 };
    let run = (L1_ACT_BYTES / (blocks * group_bytes).max(1)).clamp(1, groups);
    for g0 in (0..groups).step_by(run) {
        for r in 0..n {
            let wp = w[r * row_bytes..].as_ptr();
            for g in g0..(g0 + run).min(groups) {
                let tokens = (m - g * GROUP).min(GROUP);
                // The sums pointer is only read by tiles that need them, and then `sums` is full (asserted above).
                let ap = GroupPtr {
                    q: acts.groups[g * blocks..].as_ptr(),
                    sums: acts.sums.as_ptr().wrapping_add(g * blocks),
                };
                let op = out.wrapping_add(g * GROUP * token_stride + r);
                // SAFETY: `isa`'s features were detected; row r lies in `w`, the group's blocks in `acts` (groups
                // and sums), `scales` holds `blocks` aligned groups of floats (asserted above), and the caller
                // vouches for outputs (g·8 + t, r) for t < tokens.
                unsafe { (k.tile)(tokens, wp, ap, blocks, sc, op, token_stride) }
            }
        }
    }
}

/// Activation bytes one run of token groups may occupy: half of a 32 KiB L1 data cache.
const L1_ACT_BYTES: usize = 16 * 1024;

/// Eight floats on a 32-byte boundary.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct Align32([f32; GROUP]);

#[cfg(target_arch = "x86_64")]
pub(super) mod x86 {
    use super::{GROUP, GroupPtr, LaneSums, Q8x8};
    use crate::backend::cpu::simd::x86::{AVX_VNNI, AVX2, AVX512_VNNI, accumulate, hsum};
    use crate::backend::cpu::unpack::{Sub, scale, sub_offset, unpack};
    use std::arch::x86_64::*;

    /// How far ahead in the weight row to prefetch.
    const PREFETCH_BYTES: usize = 1024;

    /// The tile's entry points at one instruction-set level (see `simd::x86`'s `level!`).
    macro_rules! level {
        ($module:ident, $level:expr, $features:literal) => {
            pub mod $module {
                use super::*;

                /// Whether this level's tile reads the activations' [`LaneSums`] for layout `Q` (see `pairs`).
                pub const fn reads_lane_sums<const Q: u8>() -> bool {
                    $level == AVX512_VNNI
                }

                /// Picks the tile instance for `tokens` (1..=8).
                ///
                /// # Safety
                /// The CPU has this level's features; otherwise as for `tile`.
                pub unsafe fn dispatch<const Q: u8>(
                    tokens: usize,
                    w: *const u8,
                    group: GroupPtr,
                    blocks: usize,
                    sc: *mut f32,
                    out: *mut f32,
                    stride: usize,
                ) {
                    let (a, sums) = (group.q, group.sums);
                    // SAFETY: forwarded from the caller.
                    unsafe {
                        match tokens {
                            8 => entry::<8, Q>(w, a, sums, blocks, sc, out, stride),
                            7 => entry::<7, Q>(w, a, sums, blocks, sc, out, stride),
                            6 => entry::<6, Q>(w, a, sums, blocks, sc, out, stride),
                            5 => entry::<5, Q>(w, a, sums, blocks, sc, out, stride),
                            4 => entry::<4, Q>(w, a, sums, blocks, sc, out, stride),
                            3 => entry::<3, Q>(w, a, sums, blocks, sc, out, stride),
                            2 => entry::<2, Q>(w, a, sums, blocks, sc, out, stride),
                            _ => entry::<1, Q>(w, a, sums, blocks, sc, out, stride),
                        }
                    }
                }

                /// `tile` under this level's features.
                #[target_feature(enable = $features)]
                unsafe fn entry<const T: usize, const Q: u8>(
                    w: *const u8,
                    a: *const Q8x8,
                    sums: *const LaneSums,
                    blocks: usize,
                    sc: *mut f32,
                    out: *mut f32,
                    stride: usize,
                ) {
                    // SAFETY: forwarded; this function's features are the level's.
                    unsafe { tile::<{ $level }, T, Q>(w, a, sums, blocks, sc, out, stride) }
                }
            }
        };
    }

    crate::backend::cpu::isa::for_each_level!(level);

    /// One weight row × `T` tokens. Per output: `acc += cvt(Σ w·a) · (d_w·d_a)` block by block, then
    /// `hsum(acc)`, the arithmetic of `simd::x86::dot_quant_one`.
    ///
    /// # Safety
    /// Level `V`'s features available; `w` points at one row of at least `blocks` sub-blocks of layout `Q`; `a`
    /// and `sums` at `blocks` groups; `sc` at `blocks · GROUP` writable floats, 32-byte aligned; `out + t·stride`
    /// writable for `t < T`.
    #[inline(always)]
    unsafe fn tile<const V: u8, const T: usize, const Q: u8>(
        w: *const u8,
        a: *const Q8x8,
        sums: *const LaneSums,
        blocks: usize,
        sc: *mut f32,
        out: *mut f32,
        stride: usize,
    ) {
        // SAFETY (whole body): every pointer stays inside the ranges the caller guarantees.
        unsafe {
            // First pass: the products d_w·d_a the one-token kernel forms (read back with load-port broadcasts in
            // the main loop, which costs no ALU slot) and the offset terms, lanes = tokens.
            for b in 0..blocks {
                let ab = &*a.add(b);
                _mm256_store_ps(
                    sc.add(b * GROUP),
                    _mm256_mul_ps(_mm256_set1_ps(scale::<Q>(w, b)), _mm256_load_ps(ab.d.as_ptr())),
                );
            }
            let mut acc = [_mm256_setzero_ps(); T];
            if V == AVX512_VNNI && T >= 2 {
                pairs::<T, Q>(w, a, sums, blocks, sc, &mut acc);
            } else {
                for b in 0..blocks {
                    _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(sub_offset::<Q>(b) + PREFETCH_BYTES) as *const i8);
                    // The scales come from `sc`: the sub-block's own are not needed here.
                    let sub = unpack::<Q>(w, b);
                    for (t, acc) in acc.iter_mut().enumerate() {
                        step::<V, Q>(&sub, &*a.add(b), sc, b, t, acc);
                    }
                }
            }
            for (t, acc) in acc.iter().enumerate() {
                *out.add(t * stride) = hsum(*acc);
            }
        }
    }

    /// Token `t`'s share of sub-block `b` in 256-bit lanes, with the first pass's scales: `simd::x86::accumulate`,
    /// as the one-token kernels run it.
    ///
    /// # Safety
    /// As for [`tile`]; `sc` holds the first pass's scales.
    #[inline(always)]
    unsafe fn step<const V: u8, const Q: u8>(
        sub: &Sub,
        ab: &Q8x8,
        sc: *const f32,
        b: usize,
        t: usize,
        acc: &mut __m256,
    ) {
        // SAFETY: forwarded; `sc` holds blocks · GROUP floats.
        unsafe {
            let av = _mm256_load_si256(ab.qs[t].as_ptr() as *const __m256i);
            let scale = _mm256_broadcast_ss(&*sc.add(b * GROUP + t));
            accumulate::<V, Q>(sub, av, scale, acc);
        }
    }

    /// The main loop of [`tile`] with AVX-512: tokens in pairs, one 512-bit register per pair (lanes 0..8 token
    /// `2p`, 8..16 token `2p + 1`), the sub-block's weights broadcast to both halves. Every lane meets the same
    /// integers, conversions and fused multiply-adds in the same order as in [`step`], so each token's
    /// accumulator, split back into 256-bit halves, holds the same bits; an odd last token takes [`step`].
    ///
    /// # Safety
    /// AVX-512 F/BW and VNNI available; otherwise as for [`tile`].
    #[inline(always)]
    unsafe fn pairs<const T: usize, const Q: u8>(
        w: *const u8,
        a: *const Q8x8,
        sums: *const LaneSums,
        blocks: usize,
        sc: *const f32,
        acc: &mut [__m256; T],
    ) {
        // SAFETY (whole body): the caller's features and ranges; a group's two adjacent token rows are 64 bytes.
        unsafe {
            // Lane l of pair p reads token 2p + l / 8's scale from the block's eight.
            let lanes: [__m512i; GROUP / 2] = std::array::from_fn(|p| {
                _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(_mm256_set1_epi32(2 * p as i32)),
                    _mm256_set1_epi32(2 * p as i32 + 1),
                )
            });
            let mut acc2 = [_mm512_setzero_ps(); GROUP / 2];
            for b in 0..blocks {
                _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(sub_offset::<Q>(b) + PREFETCH_BYTES) as *const i8);
                let sub = unpack::<Q>(w, b);
                let ab = &*a.add(b);
                // The signed weights go in as `w + 128`, each lane starting from `-128 · Σa` (`sums`):
                // Σ (w + 128)·a - 128·Σa = Σ w·a, the same integers as `step`'s.
                let wabs = _mm512_xor_si512(_mm512_broadcast_i64x4(sub.wq), _mm512_set1_epi8(i8::MIN));
                let scales = _mm512_castps256_ps512(_mm256_load_ps(sc.add(b * GROUP)));
                for p in 0..T / 2 {
                    let av = _mm512_loadu_si512(ab.qs[2 * p].as_ptr() as *const __m512i);
                    let from = _mm512_load_si512((*sums.add(b)).0[2 * p].as_ptr() as *const __m512i);
                    let p32 = _mm512_dpbusd_epi32(from, wabs, av);
                    let scale = _mm512_permutexvar_ps(lanes[p], scales);
                    acc2[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p32), scale, acc2[p]);
                }
                if T % 2 == 1 {
                    step::<AVX512_VNNI, Q>(&sub, ab, sc, b, T - 1, &mut acc[T - 1]);
                }
            }
            for p in 0..T / 2 {
                acc[2 * p] = _mm512_castps512_ps256(acc2[p]);
                acc[2 * p + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc2[p])));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::simd::{Isa, dot_quant_scalar, quantize_row};
    use rand::{Rng, SeedableRng};

    /// At every x86 level this CPU has, the tile gives the one-token kernel's bits, whatever the rows and tokens.
    #[test]
    fn tile_equals_one_token_kernel_bit_for_bit() {
        for isa in Isa::X86 {
            if isa.supported() {
                tile_equals_one_token_kernel(isa);
            } else {
                crate::backend::cpu::simd::report_not_run(isa, "tile_equals_one_token_kernel_bit_for_bit");
            }
        }
    }

    fn tile_equals_one_token_kernel(isa: Isa) {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        // One K-quant super-block.
        let blocks = 8;
        let k = blocks * QK;
        // Every tile width: tokens 1..=17 (whole and partial groups of 8).
        for f in crate::backend::cpu::kernels::formats() {
            let dtype = f.dtype;
            for rows in 1..=5 {
                let w = crate::quant::random_blocks(dtype, rows * k / f.block_elems, &mut rng);
                let row_bytes = w.len() / rows;
                for tokens in 1..=17 {
                    let x: Vec<f32> = (0..tokens * k).map(|_| rng.random_range(-2.0f32..2.0)).collect();
                    let mut xq = vec![Q8Block { d: 0.0, s: 0.0, qs: [0; QK] }; tokens * blocks];
                    for (src, dst) in x.chunks(k).zip(xq.chunks_mut(blocks)) {
                        quantize_row(isa, src, dst);
                    }
                    let acts = PackedActs::pack(&xq, tokens, blocks, reads_lane_sums(isa, dtype));
                    let mut out = vec![0f32; tokens * rows];
                    // SAFETY: tokens × rows outputs, stride rows.
                    unsafe { rows_by_tokens(isa, dtype, &w, row_bytes, &acts, out.as_mut_ptr(), rows) };
                    for r in 0..rows {
                        for t in 0..tokens {
                            let wr = &w[r * row_bytes..(r + 1) * row_bytes];
                            let mut one = [0f32];
                            super::super::simd::dot_quant(
                                isa,
                                dtype,
                                wr,
                                &xq[t * blocks..(t + 1) * blocks],
                                blocks,
                                &mut one,
                            );
                            let got = out[t * rows + r];
                            let at = format!("{} {dtype} {rows}x{tokens} at ({r},{t})", isa.name());
                            assert_eq!(got.to_bits(), one[0].to_bits(), "{at}");
                            let slow = dot_quant_scalar(dtype, wr, &xq[t * blocks..(t + 1) * blocks]);
                            assert!((got - slow).abs() < 1e-3 * slow.abs().max(1.0), "{at}: {got} vs {slow}");
                        }
                    }
                }
            }
        }
    }
}
