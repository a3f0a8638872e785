//! Single-threaded timings of the quantized dot-product kernels (`strata bench --kernels`): every block format on
//! every path (one-token decode as the matmul runs it, with the weights in cache and streamed from memory as in a
//! real decode step; the 8-token tile of batched decode; 64 tokens, as prefill) at every x86 instruction-set level this CPU
//! has (the others reported as not run), and the scalar oracle, over one random matrix; and one decode step's
//! attention at a short and a long context. The 32-element formats are timed in the layout the backend keeps them in
//! (`interleaved`).
//! docs/performance.md's kernel numbers.

use std::hint::black_box;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use serde::Serialize;

use super::arena::WeightArena;
use super::attention::attend;
use super::kernels::kernels;
use super::qgemm::{GROUP, PackedActs};
use super::simd::{self, Isa, Q8Block, quantize_row_spans};
use super::{CpuKvLayer, CpuTensor, interleaved};
use crate::backend::{AttnSeq, AttnShape};
use crate::quant::{self, BlockFormat, QK};
use crate::tensor::{Bytes, DType};
use crate::{Error, KvDtype, Result};

/// What to measure.
#[derive(Debug, Clone)]
pub struct Config {
    /// Formats to time, in this order; empty: all of [`quant::FORMATS`].
    pub formats: Vec<DType>,
    /// Weight rows.
    pub rows: usize,
    /// Weight columns: whole blocks of every timed format (a multiple of 256 for the K-quants).
    pub cols: usize,
    /// Timings per format and path; the fastest is reported.
    pub samples: usize,
    /// About how long one timing lasts: its count of whole-matrix passes is sized to it.
    pub sample_time: Duration,
    /// Bytes of weights the streamed decode path reads per pass (copies of the matrix, in huge pages where the
    /// system has them): far more than a last-level cache holds, so each pass reads them from memory.
    pub streamed_bytes: usize,
}

impl Default for Config {
    /// SmolLM2-135M's down projection (576 × 1536), best of 15 timings of ~2 ms; 256 MiB streamed.
    fn default() -> Self {
        Self {
            formats: Vec::new(),
            rows: 576,
            cols: 1536,
            samples: 15,
            sample_time: Duration::from_millis(2),
            streamed_bytes: 256 << 20,
        }
    }
}

/// A way through the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KernelPath {
    /// `simd::dot_quant_rows` over the matrix, as one-token decode runs it, the matrix in cache after the
    /// first pass.
    Decode,
    /// The same over [`Config::streamed_bytes`] of copies of the matrix: weights read from memory, as every
    /// decode step of a model larger than the cache reads them.
    Streamed,
    /// `qgemm::rows_by_tokens` with 8 tokens: batched decode.
    Tile,
    /// The same with [`PREFILL_TOKENS`] tokens: prefill (which some formats and levels run on a path of its own).
    Prefill,
    /// The portable scalar reference the other kernels are tested against.
    Scalar,
}

/// Every path, in the order a run reports them.
pub const PATHS: [KernelPath; 5] =
    [KernelPath::Decode, KernelPath::Streamed, KernelPath::Tile, KernelPath::Prefill, KernelPath::Scalar];

/// Tokens of the [`KernelPath::Prefill`] path.
pub const PREFILL_TOKENS: usize = 64;

/// One format on one path at one instruction-set level.
#[derive(Debug, Clone, Serialize)]
pub struct KernelTiming {
    /// The format's name (`q4_k`).
    pub format: &'static str,
    /// The instruction-set level ([`Isa::name`]): `scalar` for the scalar path, else an x86 level.
    pub isa: &'static str,
    /// The path timed.
    pub path: KernelPath,
    /// Tokens each weight row meets per pass: 8 for `tile`, [`PREFILL_TOKENS`] for `prefill`, else 1.
    pub tokens: usize,
    /// The time, or why there is none.
    #[serde(flatten)]
    pub outcome: Outcome,
}

/// A timing, or the reason a path cannot run on this CPU.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Outcome {
    /// The best timing.
    Ran {
        /// Nanoseconds per (weight row, 32-element sub-block, token).
        ns_per_block: f64,
        /// Weight bytes per second, in GB/s (each weight read once per pass, whatever the tokens).
        weight_gb_per_s: f64,
    },
    /// Not timed.
    NotRun {
        /// Why.
        reason: String,
    },
}

/// The result of [`run`].
#[derive(Debug, Clone, Serialize)]
pub struct KernelBench {
    /// The instruction set the kernels dispatch to on this CPU ([`Isa::name`]).
    pub isa: &'static str,
    /// Weight rows.
    pub rows: usize,
    /// Weight columns.
    pub cols: usize,
    /// Timings per format and path (the best is kept).
    pub samples: usize,
    /// Bytes the streamed path reads per pass ([`Config::streamed_bytes`]).
    pub streamed_bytes: usize,
    /// Every selected format, format by format: the SIMD paths of [`PATHS`] at each level of [`Isa::X86`], level by
    /// level, then the scalar path.
    pub timings: Vec<KernelTiming>,
    /// Decode-step attention at each of [`ATTENTION_CONTEXTS`]: the dispatched level, then the scalar path.
    pub attention: Vec<AttentionTiming>,
}

/// Cached positions the decode-step attention is timed against.
pub const ATTENTION_CONTEXTS: [usize; 2] = [256, 1024];

/// One decode step's attention at one context length.
#[derive(Debug, Clone, Serialize)]
pub struct AttentionTiming {
    /// Cached positions the query attends to.
    pub context: usize,
    /// The instruction-set level ([`Isa::name`]).
    pub isa: &'static str,
    /// Nanoseconds per (position, query head).
    pub ns_per_position: f64,
}

/// Times every selected format on every path, on the calling thread.
///
/// # Errors
/// [`Error::Shape`] for a shape the kernels cannot take, a float type among the formats, or no samples.
pub fn run(cfg: &Config) -> Result<KernelBench> {
    let formats = selected(cfg)?;
    let (rows, cols, blocks) = (cfg.rows, cfg.cols, cfg.cols / QK);
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x6b62);
    // PREFILL_TOKENS tokens of activations, the first GROUP the tile's, the first alone the one-token paths'. A
    // scale per 256 where the columns allow, as the K-quants' kernels take them (the others read each block's, equal
    // or not).
    let span = if blocks.is_multiple_of(interleaved::SUPER_SPAN) { interleaved::SUPER_SPAN } else { 1 };
    let mut xq = vec![Q8Block { d: 0.0, s: 0.0, qs: [0; QK] }; PREFILL_TOKENS * blocks];
    for dst in xq.chunks_exact_mut(blocks) {
        let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        quantize_row_spans(Isa::Scalar, &x, dst, span);
    }
    // With the lane sums: one packing serves every format's tile (Q8_0's and Q8_K's AVX-512 tile reads them).
    let one = &xq[..blocks];
    let (packed, packed_prefill) = (
        PackedActs::pack(&xq[..GROUP * blocks], GROUP, blocks, true),
        PackedActs::pack(&xq, PREFILL_TOKENS, blocks, true),
    );
    let mut out = vec![0f32; PREFILL_TOKENS * rows];
    let mut timings = Vec::new();
    let arena = WeightArena::if_supported();
    // The streamed path runs only at an x86 level: without one, no copies (each format's would be discarded).
    let streams = Isa::X86.into_iter().any(Isa::supported);
    for f in formats {
        let w = quant::random_blocks(f.dtype, rows * cols / f.block_elems, &mut rng);
        let repacked = interleaved::Format::of(f.dtype);
        let w = match repacked {
            Some(f) => interleaved::pack(f, &w, rows, cols)?,
            None => w,
        };
        let copies = if streams { w.repeat(cfg.streamed_bytes.div_ceil(w.len())) } else { Vec::new() };
        let streamed = match &arena {
            Some(arena) => arena.copy(&copies)?,
            None => Bytes::owned(&copies),
        };
        drop(copies);
        let m = Operands {
            dtype: f.dtype,
            w: &w,
            streamed: streamed.as_slice(),
            row_bytes: w.len() / rows,
            rows,
            one,
            all: &xq,
            packed: &packed,
            packed_prefill: &packed_prefill,
            repacked,
        };
        let scalar = [(Isa::Scalar, KernelPath::Scalar)];
        let simd = Isa::X86.into_iter().flat_map(|isa| PATHS[..PATHS.len() - 1].iter().map(move |&p| (isa, p)));
        for (isa, path) in simd.chain(scalar) {
            let tokens = match path {
                KernelPath::Tile => GROUP,
                KernelPath::Prefill => PREFILL_TOKENS,
                _ => 1,
            };
            let bytes = if path == KernelPath::Streamed { m.streamed.len() } else { w.len() };
            let outcome = match pass_seconds(cfg, isa, path, &m, &mut out) {
                Ok(s) => Outcome::Ran {
                    ns_per_block: s * 1e9 / (bytes / m.row_bytes * blocks * tokens) as f64,
                    weight_gb_per_s: bytes as f64 / s / 1e9,
                },
                Err(reason) => Outcome::NotRun { reason },
            };
            timings.push(KernelTiming { format: f.name, isa: isa.name(), path, tokens, outcome });
        }
    }
    let attention = attention(cfg)?;
    Ok(KernelBench {
        isa: Isa::detect().name(),
        rows,
        cols,
        samples: cfg.samples,
        streamed_bytes: cfg.streamed_bytes,
        timings,
        attention,
    })
}

/// One query row of SmolLM2's attention (9 heads sharing 3 KV heads of 64) against each of [`ATTENTION_CONTEXTS`]
/// positions of an f32 cache in 16-token blocks, held in reverse order (a long-running cache's blocks are not in
/// order), on one thread: the level this CPU dispatches to, then the scalar path.
fn attention(cfg: &Config) -> Result<Vec<AttentionTiming>> {
    let shape = AttnShape { num_heads: 9, num_kv_heads: 3, head_dim: 64, block_size: 16 };
    let one_thread = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .map_err(|e| Error::Device(format!("cannot start a thread for the attention timing: {e}")))?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x6174);
    let width = shape.num_heads * shape.head_dim;
    let q = CpuTensor { data: (0..width).map(|_| rng.random_range(-1.0f32..1.0)).collect(), rows: 1, cols: width };
    let mut timings = Vec::new();
    for context in ATTENTION_CONTEXTS {
        let blocks = context.div_ceil(shape.block_size);
        let cache = CpuKvLayer::new(blocks, shape.block_size, shape.num_kv_heads * shape.head_dim, KvDtype::F32)?;
        let table: Vec<u32> = (0..blocks as u32).rev().collect();
        let seqs = [AttnSeq { row: 0, len: 1, start_pos: context - 1, blocks: &table }];
        for isa in [Isa::detect(), Isa::Scalar] {
            let s = one_thread.install(|| best_time(cfg, || drop(black_box(attend(isa, &q, &cache, &seqs, shape)))));
            let ns_per_position = s * 1e9 / (context * shape.num_heads) as f64;
            timings.push(AttentionTiming { context, isa: isa.name(), ns_per_position });
        }
    }
    Ok(timings)
}

/// The formats `cfg` names, once its shape is checked against each.
fn selected(cfg: &Config) -> Result<Vec<&'static BlockFormat>> {
    let bad = |reason: String| Error::Shape { op: "kernel benchmark", reason };
    if cfg.rows == 0 {
        return Err(bad("0 rows: at least one is needed".into()));
    }
    if cfg.samples == 0 {
        return Err(bad("0 samples: at least one timing is needed".into()));
    }
    let formats = if cfg.formats.is_empty() {
        quant::FORMATS.to_vec()
    } else {
        let format = |&d: &DType| quant::format(d).ok_or_else(|| bad(format!("{d} is not a block format")));
        cfg.formats.iter().map(format).collect::<Result<Vec<_>>>()?
    };
    match formats.iter().find(|f| cfg.cols == 0 || !cfg.cols.is_multiple_of(f.block_elems)) {
        Some(f) => Err(bad(format!("{} columns: not whole {} blocks of {}", cfg.cols, f.name, f.block_elems))),
        None => Ok(formats),
    }
}

/// One format's random weights and the activations every path multiplies them with.
struct Operands<'a> {
    dtype: DType,
    w: &'a [u8],
    /// Copies of `w`, back to back.
    streamed: &'a [u8],
    row_bytes: usize,
    rows: usize,
    /// One token's blocks and [`PREFILL_TOKENS`]' blocks (the tile's [`GROUP`] their first), and the tile's and
    /// the prefill's regrouped for `qgemm`'s tile.
    one: &'a [Q8Block],
    all: &'a [Q8Block],
    packed: &'a PackedActs,
    packed_prefill: &'a PackedActs,
    /// The backend's layout for this format, if not the file's: `w` from [`interleaved::pack`].
    repacked: Option<interleaved::Format>,
}

/// Seconds per pass of `path` with `isa`'s kernels over the matrix (over all its copies for
/// [`KernelPath::Streamed`]), best of `cfg.samples` timings, or why it cannot run here. `out` holds
/// [`PREFILL_TOKENS`] × rows floats.
fn pass_seconds(cfg: &Config, isa: Isa, path: KernelPath, m: &Operands<'_>, out: &mut [f32]) -> Result<f64, String> {
    let (w, rb, blocks) = (m.w, m.row_bytes, m.one.len());
    if !isa.supported() {
        return Err(format!("{}: this CPU lacks {}", isa.name(), isa.needs()));
    }
    if let Some(f) = m.repacked {
        return Ok(repacked_seconds(cfg, isa, path, f, m, out));
    }
    let k = kernels(m.dtype);
    if path == KernelPath::Scalar {
        return Ok(best_time(cfg, || {
            for (r, o) in out[..m.rows].iter_mut().enumerate() {
                *o = (k.scalar_dot)(&black_box(w)[r * rb..(r + 1) * rb], m.one);
            }
            black_box(&mut *out);
        }));
    }
    #[cfg(target_arch = "x86_64")]
    if k.x86(isa).is_none() {
        return Err(format!("{} has no {path:?} kernel", isa.name()));
    }
    Ok(match path {
        KernelPath::Decode => best_time(cfg, || {
            simd::dot_quant_rows(isa, m.dtype, black_box(w), rb, m.one, blocks, &mut out[..m.rows]);
            black_box(&mut *out);
        }),
        // Each copy's rows into the same outputs: a pass reads every byte once, as a decode step does.
        KernelPath::Streamed => best_time(cfg, || {
            for copy in black_box(m.streamed).chunks_exact(w.len()) {
                simd::dot_quant_rows(isa, m.dtype, copy, rb, m.one, blocks, &mut out[..m.rows]);
            }
            black_box(&mut *out);
        }),
        #[cfg(target_arch = "x86_64")]
        KernelPath::Tile | KernelPath::Prefill => {
            let acts = if path == KernelPath::Tile { m.packed } else { m.packed_prefill };
            best_time(cfg, || {
                // SAFETY: `out` holds PREFILL_TOKENS × rows floats: outputs t · rows + r for every token t and row r.
                unsafe { super::qgemm::rows_by_tokens(isa, m.dtype, black_box(w), rb, acts, out.as_mut_ptr(), m.rows) };
                black_box(&mut *out);
            })
        }
        #[cfg(target_arch = "x86_64")]
        KernelPath::Scalar => unreachable!("timed above"),
        #[cfg(not(target_arch = "x86_64"))]
        _ => return Err("the SIMD kernels are x86-64 only".into()),
    })
}

/// [`pass_seconds`] for a matrix repacked by [`interleaved::pack`] (format `f`): each path through that layout's
/// kernels, the scalar path being its reference ([`Isa::Scalar`]).
fn repacked_seconds(
    cfg: &Config,
    isa: Isa,
    path: KernelPath,
    f: interleaved::Format,
    m: &Operands<'_>,
    out: &mut [f32],
) -> f64 {
    let blocks = m.one.len();
    let acts = |q| interleaved::Acts::new(q, q.len() / blocks, blocks);
    let run = |isa: Isa, w: &[u8], acts: &interleaved::Acts<'_>, out: &mut [f32]| {
        // SAFETY: `out` holds PREFILL_TOKENS × rows floats: outputs t · rows + r for every token t and row r.
        unsafe { interleaved::rows_by_tokens(isa, f, black_box(w), m.rows, acts, out.as_mut_ptr(), m.rows) };
        black_box(&mut *out);
    };
    let one = acts(m.one);
    match path {
        KernelPath::Decode => best_time(cfg, || run(isa, m.w, &one, out)),
        KernelPath::Streamed => best_time(cfg, || {
            for copy in black_box(m.streamed).chunks_exact(m.w.len()) {
                run(isa, copy, &one, out);
            }
        }),
        KernelPath::Tile => {
            let group = acts(&m.all[..GROUP * blocks]);
            best_time(cfg, || run(isa, m.w, &group, out))
        }
        // Made once, as one matmul makes them for all its weights: the timing is the weights'.
        KernelPath::Prefill => {
            let all = acts(m.all);
            best_time(cfg, || run(isa, m.w, &all, out))
        }
        KernelPath::Scalar => best_time(cfg, || run(Isa::Scalar, m.w, &one, out)),
    }
}

/// The fastest of `cfg.samples` timings of `pass`, in seconds per pass; each timing repeats `pass` as often as
/// fits in about `cfg.sample_time`.
fn best_time(cfg: &Config, mut pass: impl FnMut()) -> f64 {
    pass(); // warms the caches
    let t = Instant::now();
    pass();
    let reps = (cfg.sample_time.as_secs_f64() / t.elapsed().as_secs_f64().max(1e-9)).ceil().clamp(1.0, 1e6) as usize;
    let mut best = f64::INFINITY;
    for _ in 0..cfg.samples {
        let t = Instant::now();
        (0..reps).for_each(|_| pass());
        best = best.min(t.elapsed().as_secs_f64() / reps as f64);
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quick(rows: usize, cols: usize, formats: Vec<DType>) -> Config {
        Config { formats, rows, cols, samples: 1, sample_time: Duration::from_micros(20), streamed_bytes: 1 << 16 }
    }

    #[test]
    fn every_format_and_path_is_timed_or_says_why_not() -> Result<()> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (rows, cols) = (rng.random_range(1..=24), quant::QK_K * rng.random_range(1..=2));
        let bench = run(&quick(rows, cols, Vec::new()))?;
        // Per format: 3 SIMD paths at each of the 3 x86 levels, then the scalar one.
        let per_format = 3 * (PATHS.len() - 1) + 1;
        assert_eq!((bench.rows, bench.cols, bench.timings.len()), (rows, cols, quant::FORMATS.len() * per_format));
        assert_eq!(bench.isa, Isa::detect().name());
        let attention: Vec<_> = bench.attention.iter().map(|a| (a.context, a.isa)).collect();
        let levels = [Isa::detect().name(), Isa::Scalar.name()];
        assert_eq!(attention, ATTENTION_CONTEXTS.iter().flat_map(|&c| levels.map(|l| (c, l))).collect::<Vec<_>>());
        assert!(bench.attention.iter().all(|a| a.ns_per_position.is_finite() && a.ns_per_position > 0.0));
        for (i, t) in bench.timings.iter().enumerate() {
            // Format by format, level by level, every path once, in order.
            let (f, j) = (i / per_format, i % per_format);
            let (isa, path) = if j + 1 == per_format {
                (Isa::Scalar, KernelPath::Scalar)
            } else {
                (Isa::X86[j / (PATHS.len() - 1)], PATHS[j % (PATHS.len() - 1)])
            };
            assert_eq!((t.format, t.isa, t.path), (quant::FORMATS[f].name, isa.name(), path));
            match &t.outcome {
                Outcome::Ran { ns_per_block: ns, weight_gb_per_s: gb } => {
                    assert!(isa.supported() && ns.is_finite() && *ns > 0.0 && gb.is_finite() && *gb > 0.0, "{t:?}");
                }
                // Exactly the levels this CPU lacks are missing, saying which.
                Outcome::NotRun { reason } => {
                    assert!(!isa.supported() && reason.contains(isa.needs()), "{t:?}");
                }
            }
        }
        Ok(())
    }

    #[test]
    fn shapes_the_kernels_cannot_take_are_refused() -> Result<()> {
        assert!(run(&quick(0, 256, Vec::new())).is_err(), "no rows");
        assert!(run(&quick(8, 32, vec![DType::Q4_K])).is_err(), "a K-quant row of 32");
        assert!(run(&quick(8, 32, vec![DType::F16])).is_err(), "a float type");
        assert!(run(&Config { samples: 0, ..quick(8, 32, vec![DType::Q4_0]) }).is_err(), "no samples");
        // 32 columns are whole blocks of the 32-element formats; the filter keeps its order.
        let bench = run(&quick(8, 32, vec![DType::Q5_1, DType::Q4_0]))?;
        let names: Vec<_> = bench.timings.iter().map(|t| t.format).collect();
        let per_format = 3 * (PATHS.len() - 1) + 1;
        assert_eq!(names, [vec!["q5_1"; per_format], vec!["q4_0"; per_format]].concat());
        Ok(())
    }
}
