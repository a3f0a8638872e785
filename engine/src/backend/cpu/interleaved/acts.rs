//! The activations the tiles read, made once per product for every row group (see [`Acts`]).

use super::{Format, SUPER_SPAN};
use crate::backend::cpu::simd::{Isa, Q8Block};
#[cfg(target_arch = "x86_64")]
use crate::backend::cpu::written::{Split, written};
#[cfg(target_arch = "x86_64")]
use crate::quant::QK;
use rayon::prelude::*;

/// The activations [`super::rows_by_tokens`] reads: `tokens` rows of 8-bit blocks and each block's integer sum `Σ a`,
/// which turns the stored values back into weights (`Σ (q + bias)·a = Σ q·a + bias·Σ a`), and the forms of the
/// sums the K-quants' tiles broadcast from memory as they are: the sums of each block's halves as one pair of
/// 16-bit words (each `|h| ≤ 16 · 127`; Q2_K's minimums), Q3_K's and Q6_K's starts of each half's sum
/// ([`q3k_start`], `-32 · h`), and each block's sum paired with the next one's (Q4_K's and Q5_K's minimums). The
/// K-quants' kernels take the activations of each super-block (256 from the row's start) under one scale, as
/// [`crate::backend::cpu::simd::quantize_row_spans`] with spans of [`SUPER_SPAN`] makes them (`one_scale`).
#[derive(Debug)]
pub struct Acts<'a> {
    pub(super) q: &'a [Q8Block],
    pub(super) sums: Vec<i32>,
    pub(super) pairs: Vec<i32>,
    pub(super) sub_pairs: Vec<i32>,
    pub(super) q3k_starts: Vec<[i32; 2]>,
    pub(super) q6k_starts: Vec<[i32; 2]>,
    pub(super) blocks: usize,
    pub(super) tokens: usize,
    pub(super) one_scale: bool,
    /// The values as 16-bit words, made by [`Acts::prepare`] or else by the first tile that reads them (`words`).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) words: std::sync::OnceLock<Vec<i16>>,
}

/// Q3_K's start of a half's `vpdpbusd` sum whose activations sum to `h`: `-4·h - 2^14` in the high 16-bit word,
/// `2^14` in the low one, under which the sum of `(q + 4)·a` (at most 16 · 7 · 127 in magnitude) neither borrows nor
/// reaches the sign bit. One `madd` against the row's scale `sc` in both words then gives
/// `sc·(Σ (q + 4)·a + 2^14) + sc·(-4·h - 2^14) = sc·Σ q·a`.
fn q3k_start(h: i32) -> i32 {
    ((-4 * h - (1 << 14)) << 16) + (1 << 14)
}

/// Blocks from which [`Acts`] are made by the pool's threads together (a prompt's: 32 tokens of 576 columns), not
/// by the caller while the others wait.
pub(super) const PARALLEL_BLOCKS: usize = 32 * 18;

/// `f` of each block of `q`, in order: split among the current pool's threads from [`PARALLEL_BLOCKS`] blocks.
fn per_block<T: Send>(q: &[Q8Block], f: impl Fn(&Q8Block) -> T + Sync + Send) -> Vec<T> {
    if q.len() >= PARALLEL_BLOCKS { q.par_iter().with_min_len(64).map(f).collect() } else { q.iter().map(f).collect() }
}

impl<'a> Acts<'a> {
    /// `q` holds `tokens` rows of `blocks` blocks, back to back.
    pub fn new(q: &'a [Q8Block], tokens: usize, blocks: usize) -> Self {
        let q = &q[..tokens * blocks];
        let half = |b: &Q8Block, h: usize| b.qs[16 * h..16 * h + 16].iter().map(|&v| i32::from(v)).sum::<i32>();
        let halves: Vec<[i32; 2]> = per_block(q, |b| [half(b, 0), half(b, 1)]);
        let sums: Vec<i32> = halves.iter().map(|[a, b]| a + b).collect();
        let pairs = halves.iter().map(|&[h0, h1]| (h0 & 0xffff) | (h1 << 16)).collect();
        let next = |i: usize| if !(i + 1).is_multiple_of(blocks.max(1)) { sums[i + 1] } else { 0 };
        let sub_pairs = (0..sums.len()).map(|i| (sums[i] & 0xffff) | (next(i) << 16)).collect();
        let q3k_starts = halves.iter().map(|&[h0, h1]| [q3k_start(h0), q3k_start(h1)]).collect();
        let q6k_starts = halves.iter().map(|&[h0, h1]| [-32 * h0, -32 * h1]).collect();
        let one_scale = blocks.is_multiple_of(SUPER_SPAN)
            && q.chunks_exact(SUPER_SPAN).all(|run| run.iter().all(|b| b.d.to_bits() == run[0].d.to_bits()));
        Acts { q, sums, pairs, sub_pairs, q3k_starts, q6k_starts, blocks, tokens, one_scale, words: Default::default() }
    }

    /// Makes now what the tiles of `isa` for format `f` will read and [`Acts::new`] did not (the 16-bit words of
    /// Q8_0's prefill at the AVX2 level), with the pool's threads, before a parallel region whose first tile would
    /// otherwise make them while the other threads wait.
    pub fn prepare(&self, isa: Isa, f: Format) {
        #[cfg(target_arch = "x86_64")]
        if reads_words(isa, f, self.tokens) {
            self.words();
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (isa, f);
    }

    /// The values as 16-bit words, `QK` per block (made once, by the first caller; the others wait for it).
    #[cfg(target_arch = "x86_64")]
    pub(super) fn words(&self) -> &[i16] {
        // Written in place in runs of blocks, split as `Acts::new`'s sums are (collecting a flat_map pushed one word
        // at a time, ~2 % of an AVX2-level prefill while the other threads waited; collecting each block's words as
        // an array called a conversion the compiler did not inline, block by block, ~4 %).
        const RUN: usize = 64;
        self.words.get_or_init(|| {
            let split = if self.q.len() >= PARALLEL_BLOCKS { Split::Parallel { min_chunks: 1 } } else { Split::Serial };
            written(self.q.len() * QK, RUN * QK, split, 0, |i, run| {
                for (dst, b) in run.as_chunks_mut::<QK>().0.iter_mut().zip(&self.q[i * RUN..]) {
                    // Arrays of one length: a loop the compiler widens.
                    for (d, &v) in dst.iter_mut().zip(&b.qs) {
                        *d = v.into();
                    }
                }
            })
        })
    }
}

/// Whether the tiles of `isa` for `f` take the 16-bit words path ([`super::words`]) with `tokens` tokens.
#[cfg(target_arch = "x86_64")]
pub(super) fn reads_words(isa: Isa, f: Format, tokens: usize) -> bool {
    isa == Isa::Avx2 && f == Format::Q8_0 && tokens >= super::words::MIN_TOKENS
}
