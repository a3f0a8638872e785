use super::super::kv::KvStore;
use super::super::pages::Pages;
use super::*;
use crate::KvDtype;
use half::{bf16, f16};
use rand::{Rng, SeedableRng};

/// A cache of `blocks` blocks of random keys/values and a shuffled block table covering all of them.
fn setup(rng: &mut rand::rngs::StdRng, shape: AttnShape, blocks: usize) -> (CpuKvLayer, Vec<u32>) {
    let kv_dim = shape.num_kv_heads * shape.head_dim;
    let n = blocks * shape.block_size * kv_dim;
    let mut rand = |n| (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect::<Vec<f32>>();
    let mut store = || KvStore::F32(Pages::from_slice(&rand(n)).expect("KV pages"));
    let cache = CpuKvLayer { k: store(), v: store(), kv_dim, block_size: shape.block_size };
    let mut table: Vec<u32> = (0..blocks as u32).collect();
    table.reverse();
    table.swap(0, blocks / 2);
    (cache, table)
}

fn queries(rng: &mut rand::rngs::StdRng, rows: usize, shape: AttnShape) -> CpuTensor {
    let cols = shape.num_heads * shape.head_dim;
    CpuTensor { data: (0..rows * cols).map(|_| rng.random_range(-2.0f32..2.0)).collect(), rows, cols }
}

#[test]
fn simd_attention_matches_scalar() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    // 64 (SmolLM2), 128 (two column passes), 24 (a partial pass); GQA groups of 3 and 1.
    for (heads, kv_heads, head_dim) in [(9, 3, 64), (4, 2, 128), (2, 2, 24)] {
        let shape = AttnShape { num_heads: heads, num_kv_heads: kv_heads, head_dim, block_size: 16 };
        let (cache, table) = setup(&mut rng, shape, 6);
        // A 37-token prefill (three row runs) after 20 cached positions, and a one-token decode step.
        let seqs = [
            AttnSeq { row: 0, len: 37, start_pos: 20, blocks: &table[..4] },
            AttnSeq { row: 37, len: 1, start_pos: 90, blocks: &table },
        ];
        let q = queries(&mut rng, 38, shape);
        let fast = attend(Isa::detect(), &q, &cache, &seqs, shape);
        let slow = attend(Isa::Scalar, &q, &cache, &seqs, shape);
        for (i, (a, b)) in fast.data.iter().zip(&slow.data).enumerate() {
            assert!((a - b).abs() < 1e-5, "head_dim {head_dim}, element {i}: {a} vs {b}");
        }
    }
}

#[test]
fn query_heads_split_over_threads_give_the_bits_of_whole_groups() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(14);
    let shape = AttnShape { num_heads: 9, num_kv_heads: 3, head_dim: 64, block_size: 16 };
    let (cache, table) = setup(&mut rng, shape, 6);
    let q = queries(&mut rng, 2, shape);
    // Two decode rows: 6 (sequence, KV head) tasks, fewer than twice 4 threads (split), not than twice 1.
    let seqs = [
        AttnSeq { row: 0, len: 1, start_pos: 40, blocks: &table },
        AttnSeq { row: 1, len: 1, start_pos: 70, blocks: &table },
    ];
    let on = |threads| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
        pool.install(|| attend(Isa::detect(), &q, &cache, &seqs, shape))
    };
    assert!(on(4).data == on(1).data, "splitting a KV head's query heads changed the output");
}

#[test]
fn a_row_does_not_depend_on_batch_or_chunking() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(12);
    let shape = AttnShape { num_heads: 9, num_kv_heads: 3, head_dim: 64, block_size: 16 };
    let (cache, table) = setup(&mut rng, shape, 4);
    let q = queries(&mut rng, 43, shape);
    let isa = Isa::detect();
    let width = q.cols;
    // Rows 0..40 as one prefill beside another sequence...
    let other = AttnSeq { row: 40, len: 3, start_pos: 5, blocks: &table[2..] };
    let prefill = attend(isa, &q, &cache, &[AttnSeq { row: 0, len: 40, start_pos: 0, blocks: &table }, other], shape);
    // ...equal each row computed alone as a decode step at its position.
    for t in [0usize, 7, 15, 16, 31, 39] {
        let one = CpuTensor { data: q.data[t * width..(t + 1) * width].to_vec(), rows: 1, cols: width };
        let alone = attend(isa, &one, &cache, &[AttnSeq { row: 0, len: 1, start_pos: t, blocks: &table }], shape);
        assert!(alone.data == prefill.data[t * width..(t + 1) * width], "row {t} differs");
    }
}

/// An f16 or bf16 cache read in place gives, bit for bit, what an f32 cache holding the same (rounded) values
/// gives: the in-register conversion is exact and the arithmetic is the f32 path's. Prefill rows and decode
/// rows, with query heads split over threads and kept whole.
#[test]
fn a_half_cache_read_in_place_gives_the_bits_of_its_values_in_f32() -> crate::Result<()> {
    let isa = Isa::detect();
    if !half_in_place(isa, 64) {
        simd::report_not_run(Isa::Avx2, "a_half_cache_read_in_place_gives_the_bits_of_its_values_in_f32");
        return Ok(());
    }
    let shape = AttnShape { num_heads: 9, num_kv_heads: 3, head_dim: 64, block_size: 16 };
    let (kv_dim, positions) = (3 * 64, 6 * 16);
    let round_f16 = |x: f32| f16::from_f32(x).to_f32();
    let round_bf16 = |x: f32| bf16::from_f32(x).to_f32();
    for (dtype, round) in [(KvDtype::F16, &round_f16 as &dyn Fn(f32) -> f32), (KvDtype::Bf16, &round_bf16)] {
        let mut rng = rand::rngs::StdRng::seed_from_u64(15);
        let mut rand = || {
            let data = (0..positions * kv_dim).map(|_| round(rng.random_range(-1.0f32..1.0))).collect();
            CpuTensor { data, rows: positions, cols: kv_dim }
        };
        let (k, v) = (rand(), rand());
        let mut table: Vec<u32> = (0..6).rev().collect();
        table.swap(0, 3);
        let all = [AttnSeq { row: 0, len: positions, start_pos: 0, blocks: &table }];
        let q = queries(&mut rng, 38, shape);
        let cache = |dtype| -> crate::Result<CpuKvLayer> {
            let mut cache = CpuKvLayer::new(6, 16, kv_dim, dtype)?;
            cache.write(&k, &v, &all)?;
            Ok(cache)
        };
        let (half, full) = (cache(dtype)?, cache(KvDtype::F32)?);
        assert!(half.as_f16().is_some() || half.as_bf16().is_some());
        let prefill_and_decode = [
            AttnSeq { row: 0, len: 37, start_pos: 20, blocks: &table[..4] },
            AttnSeq { row: 37, len: 1, start_pos: 90, blocks: &table },
        ];
        let decode = [AttnSeq { row: 0, len: 1, start_pos: 70, blocks: &table }];
        for seqs in [&prefill_and_decode[..], &decode[..]] {
            for threads in [1, 4] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
                let (a, b) =
                    pool.install(|| (attend(isa, &q, &half, seqs, shape), attend(isa, &q, &full, seqs, shape)));
                assert!(a.data == b.data, "{dtype}, {} rows on {threads} threads: {}", seqs.len(), max_diff(&a, &b));
            }
        }
    }
    Ok(())
}

/// The query heads of a KV head computed together give, bit for bit, what computing them one at a time gives:
/// groups of 2 to 5 and 8 (two passes of heads); head widths of one, two and a partial column pass; every cache type (q8_0 through its
/// converted rows); prefill and decode rows with contexts that are not a multiple of four keys; one and four
/// threads.
#[test]
fn query_heads_together_give_the_bits_of_one_at_a_time() -> crate::Result<()> {
    let isa = Isa::detect();
    if !half_in_place(isa, 64) {
        simd::report_not_run(Isa::Avx2, "query_heads_together_give_the_bits_of_one_at_a_time");
        return Ok(());
    }
    let mut rng = rand::rngs::StdRng::seed_from_u64(16);
    for (heads, kv_heads, head_dim) in
        [(9, 3, 64), (4, 2, 128), (8, 2, 40), (12, 3, 24), (6, 3, 64), (10, 2, 64), (16, 2, 40)]
    {
        let shape = AttnShape { num_heads: heads, num_kv_heads: kv_heads, head_dim, block_size: 16 };
        let kv_dim = kv_heads * head_dim;
        let positions = 8 * 16;
        let mut rand = || {
            let data = (0..positions * kv_dim).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            CpuTensor { data, rows: positions, cols: kv_dim }
        };
        let (k, v) = (rand(), rand());
        let mut table: Vec<u32> = (0..8).rev().collect();
        table.swap(1, 5);
        let all = [AttnSeq { row: 0, len: positions, start_pos: 0, blocks: &table }];
        let q = queries(&mut rng, 40, shape);
        let seqs = [
            AttnSeq { row: 0, len: 37, start_pos: 20, blocks: &table[..4] },
            AttnSeq { row: 37, len: 1, start_pos: 90, blocks: &table },
            AttnSeq { row: 38, len: 1, start_pos: 0, blocks: &table },
            AttnSeq { row: 39, len: 1, start_pos: 125, blocks: &table },
        ];
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16, KvDtype::Q8_0] {
            if dtype == KvDtype::Q8_0 && !kv_dim.is_multiple_of(32) {
                continue; // q8_0 rows are whole 32-element blocks
            }
            let mut cache = CpuKvLayer::new(8, 16, kv_dim, dtype)?;
            cache.write(&k, &v, &all)?;
            // Prompt and decode rows (spreading does not apply), decode rows only (it does).
            for (threads, seqs) in [(1, &seqs[..]), (4, &seqs[..]), (4, &seqs[1..]), (2, &seqs[3..])] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
                let run = |grouping| pool.install(|| attend_grouped(isa, &q, &cache, seqs, shape, grouping));
                let alone = run(Grouping::Apart);
                // Runs of 32 positions (two blocks): several per context, and a last one cut short.
                for grouping in [Grouping::Together, Grouping::Spread { positions: 32 }, Grouping::Auto] {
                    let got = run(grouping);
                    assert!(
                        got.data == alone.data,
                        "{grouping:?}: {heads}/{kv_heads} heads of {head_dim}, {dtype}, {} sequences on {threads} \
                         threads: {}",
                        seqs.len(),
                        max_diff(&got, &alone)
                    );
                }
            }
        }
    }
    Ok(())
}

/// Largest |a - b| over two outputs.
fn max_diff(a: &CpuTensor, b: &CpuTensor) -> f32 {
    a.data.iter().zip(&b.data).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

#[test]
fn each_kv_dtype_stays_within_its_bound_of_f32() -> crate::Result<()> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(13);
    // Heads of 64 (one Q8_0 block pair each) and of 16 (four heads share a block).
    for (heads, kv_heads, head_dim) in [(9, 3, 64), (4, 2, 16)] {
        let shape = AttnShape { num_heads: heads, num_kv_heads: kv_heads, head_dim, block_size: 16 };
        let kv_dim = kv_heads * head_dim;
        let positions = 6 * shape.block_size;
        let rand = |rng: &mut rand::rngs::StdRng| {
            let data = (0..positions * kv_dim).map(|_| rng.random_range(-1.0f32..1.0)).collect();
            CpuTensor { data, rows: positions, cols: kv_dim }
        };
        let (k, v) = (rand(&mut rng), rand(&mut rng));
        let mut table: Vec<u32> = (0..6).rev().collect();
        table.swap(0, 3);
        let seqs = [
            AttnSeq { row: 0, len: 37, start_pos: 20, blocks: &table[..4] },
            AttnSeq { row: 37, len: 1, start_pos: 90, blocks: &table },
        ];
        let q = queries(&mut rng, 38, shape);
        let all = [AttnSeq { row: 0, len: positions, start_pos: 0, blocks: &table }];
        let run = |dtype: KvDtype, isa: Isa| -> crate::Result<CpuTensor> {
            let mut cache = CpuKvLayer::new(6, shape.block_size, kv_dim, dtype)?;
            cache.write(&k, &v, &all)?;
            Ok(attend(isa, &q, &cache, &seqs, shape))
        };
        let exact = run(KvDtype::F32, Isa::detect())?;
        // Measured 1.3e-4, 1.3e-3 and 2.4e-3 (head widths 64 and 16 alike) on outputs within ±1.
        for (dtype, bound) in [(KvDtype::F32, 0.0), (KvDtype::F16, 4e-4), (KvDtype::Bf16, 4e-3), (KvDtype::Q8_0, 6e-3)]
        {
            let got = run(dtype, Isa::detect())?;
            let d = max_diff(&got, &exact);
            eprintln!("head_dim {head_dim} {dtype}: max |diff| {d}");
            assert!(d <= bound, "head_dim {head_dim}, {dtype}: {d} > {bound}");
            assert!(max_diff(&got, &run(dtype, Isa::Scalar)?) < 1e-5, "{dtype}: SIMD and scalar agree");
        }
    }
    Ok(())
}
