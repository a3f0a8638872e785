use super::*;
use crate::backend::cpu::simd::{quantize_row_spans, report_not_run};
use rand::{Rng, SeedableRng};

const FORMATS: [Format; 10] = [
    Format::Q8_0,
    Format::Q4_0,
    Format::Q4_1,
    Format::Q5_0,
    Format::Q5_1,
    Format::Q4_K,
    Format::Q5_K,
    Format::Q6_K,
    Format::Q2_K,
    Format::Q3_K,
];

/// Columns of `n` of format `f`'s blocks.
fn cols_of(f: Format, n: usize) -> usize {
    n * elems(f as u8)
}

/// `tokens` rows of `blocks` 8-bit blocks from random values, as format `f`'s kernels take them.
fn acts(rng: &mut rand::rngs::StdRng, f: Format, tokens: usize, blocks: usize) -> Vec<Q8Block> {
    let x: Vec<f32> = (0..tokens * blocks * QK).map(|_| rng.random_range(-2.0f32..2.0)).collect();
    let mut xq = vec![Q8Block { d: 0.0, s: 0.0, qs: [0; QK] }; tokens * blocks];
    for (src, dst) in x.chunks(blocks * QK).zip(xq.chunks_mut(blocks)) {
        quantize_row_spans(Isa::Scalar, src, dst, f.act_span());
    }
    xq
}

/// Row group `r / 16`'s bytes, `cols` columns.
fn group_of(f: Format, packed: &[u8], cols: usize, r: usize) -> &[u8] {
    let bytes = packed_len(f, ROWS, cols);
    &packed[(r / ROWS) * bytes..][..bytes]
}

/// Packing keeps every bit: each row comes back as the file's bytes, and dequantizes as they do.
#[test]
fn packed_rows_give_back_the_file_rows() -> Result<()> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    for f in FORMATS {
        let fb = f.dtype().block_bytes();
        for (rows, n) in [(1, 1), (16, 2), (37, 3), (48, 1)] {
            let cols = cols_of(f, n);
            let file = quant::random_blocks(f.dtype(), rows * n, &mut rng);
            let packed = pack(f, &file, rows, cols)?;
            assert_eq!(packed.len(), packed_len(f, rows, cols));
            assert_eq!(packed.len(), rows.div_ceil(ROWS) * ROWS * n * fb, "{f:?}: the file's size");
            let mut want = vec![0f32; rows * cols];
            quant::dequantize(f.dtype(), &file, &mut want);
            let mut got = vec![0f32; cols];
            for r in 0..rows {
                let row = file_row(f, &packed, cols, r);
                assert!(row == file[r * row.len()..(r + 1) * row.len()], "{f:?} {rows}x{cols}: row {r}");
                dequantize_row(f, &packed, cols, r, &mut got);
                assert!(got == want[r * cols..(r + 1) * cols], "{f:?} {rows}x{cols}: row {r} dequantized");
            }
        }
        assert!(pack(f, &vec![0; fb - 1], 1, cols_of(f, 1)).is_err(), "{f:?}: a short block is refused");
        assert!(pack(f, &vec![0; fb], 1, cols_of(f, 1) / 2).is_err(), "{f:?}: half a block is refused");
    }
    Ok(())
}

/// The reference is the dot product of the dequantized weights and activations, to float rounding (its integer
/// sums are exact; each block adds one or two rounded products).
#[test]
fn scalar_is_the_dequantized_dot() -> Result<()> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(4);
    let rows = 20;
    for f in FORMATS {
        let n = if is_k(f as u8) { 2 } else { 6 };
        let cols = cols_of(f, n);
        let file = quant::random_blocks(f.dtype(), rows * n, &mut rng);
        let packed = pack(f, &file, rows, cols)?;
        let a = acts(&mut rng, f, 1, cols / QK);
        let mut w = vec![0f32; cols];
        for r in 0..rows {
            dequantize_row(f, &packed, cols, r, &mut w);
            let got = scalar(f, group_of(f, &packed, cols, r), &a)[r % ROWS];
            let x = |l: usize| f64::from(a[l / QK].d) * f64::from(a[l / QK].qs[l % QK]);
            let want: f64 = w.iter().enumerate().map(|(l, &v)| f64::from(v) * x(l)).sum();
            let mass: f64 = w.iter().enumerate().map(|(l, &v)| (f64::from(v) * x(l)).abs()).sum();
            assert!((f64::from(got) - want).abs() <= 1e-5 * mass + 1e-6, "{f:?} row {r}: {got} vs {want}");
        }
    }
    Ok(())
}

/// Every level this CPU has gives the reference's bits, for every format, tile width and partial row group, with
/// the extreme Q8_0 weights (-128, 127) against ±127 activations that could overflow a 16-bit pair, the extreme
/// Q6_K scales (-128, 127), and Q3_K's and Q2_K's largest half sums (every value -4 or 3 against activations all
/// -127 or all 127: ±8,128 and ±6,096, and Q3_K's sums of the stored `q + 4`, ±14,224, which the 512-bit kernels
/// hold in 16-bit words; a start of Q3_K's sums at 2^13 instead of 2^14 fails here).
#[test]
fn every_level_gives_the_scalar_bits() -> Result<()> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    #[cfg(target_arch = "x86_64")]
    let gfni = std::arch::is_x86_feature_detected!("gfni");
    #[cfg(not(target_arch = "x86_64"))]
    let gfni = false;
    if !gfni {
        eprintln!("not run: every_level_gives_the_scalar_bits with GFNI: this CPU lacks it");
    }
    for (isa, gfni) in
        Isa::X86.into_iter().map(|isa| (isa, false)).chain([(Isa::Avx512Vnni, true)].into_iter().filter(|_| gfni))
    {
        if !isa.supported() {
            report_not_run(isa, "every_level_gives_the_scalar_bits");
            continue;
        }
        for f in FORMATS {
            let n = if is_k(f as u8) { 2 } else { 5 };
            let (cols, blocks) = (cols_of(f, n), cols_of(f, n) / QK);
            for rows in [1, 7, 8, 9, 16, 21, 40] {
                let mut file = quant::random_blocks(f.dtype(), rows * n, &mut rng);
                if f == Format::Q8_0 {
                    for (l, q) in file[2..2 + QK].iter_mut().enumerate() {
                        *q = if l % 2 == 0 { 0x80 } else { 0x7f };
                    }
                }
                if f == Format::Q6_K {
                    for (l, s) in file[192..208].iter_mut().enumerate() {
                        *s = if l % 2 == 0 { 0x80 } else { 0x7f };
                    }
                }
                match f {
                    // Row 0's first super-block: every value -4 (no high bit, low bits 0) or 3.
                    Format::Q3_K => file[..96].fill(0),
                    Format::Q2_K => file[16..80].fill(0xff),
                    _ => {}
                }
                let packed = pack(f, &file, rows, cols)?;
                for tokens in [1, 2, 3, 4, 5, 8, 9, 17, 18, 19] {
                    let mut a = acts(&mut rng, f, tokens, blocks);
                    a[0].qs = std::array::from_fn(|l| if l % 4 < 2 { 127 } else { -127 });
                    for (t, q) in [(1, -127), (2, 127)] {
                        if t < tokens {
                            a[t * blocks].qs = [q; QK];
                        }
                    }
                    let sums = Acts::new(&a, tokens, blocks);
                    let stride = rows + 3;
                    let mut out = vec![f32::NAN; tokens * stride];
                    // SAFETY: tokens × stride outputs, rows of them per token.
                    unsafe { rows_by_tokens_with(isa, gfni, f, &packed, rows, &sums, out.as_mut_ptr(), stride) };
                    for t in 0..tokens {
                        for r in 0..rows {
                            let want = scalar(f, group_of(f, &packed, cols, r), &a[t * blocks..(t + 1) * blocks]);
                            let got = out[t * stride + r];
                            let at = format!("{} (gfni {gfni}) {f:?} {rows}x{tokens} at ({r},{t})", isa.name());
                            assert_eq!(got.to_bits(), want[r % ROWS].to_bits(), "{at}");
                        }
                        let past = &out[t * stride + rows..(t + 1) * stride];
                        assert!(past.iter().all(|v| v.is_nan()), "{f:?}: wrote past row {rows}");
                    }
                }
            }
        }
    }
    Ok(())
}

/// The K-quants' kernels read each super-block's scale from its first block: activations scaled per block (whose
/// scales differ) are refused rather than summed under the wrong scale.
#[test]
#[should_panic(expected = "row-group operands do not match")]
fn k_quants_refuse_activations_scaled_per_block() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(6);
    let (f, rows) = (Format::Q4_K, 16);
    let cols = cols_of(f, 1);
    let packed = pack(f, &quant::random_blocks(f.dtype(), rows, &mut rng), rows, cols).expect("whole blocks");
    let a = acts(&mut rng, Format::Q8_0, 1, cols / QK);
    let mut out = vec![0f32; rows];
    // SAFETY: one token of `rows` outputs.
    unsafe { rows_by_tokens(Isa::Scalar, f, &packed, rows, &Acts::new(&a, 1, cols / QK), out.as_mut_ptr(), rows) };
}

/// A prompt's activations are made by the pool's threads together (from `PARALLEL_BLOCKS`): the same values, in
/// the same places, as one thread makes for a few tokens.
#[test]
fn a_prompts_activations_made_in_parallel_match_the_serial_ones() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let (tokens, blocks) = (64, 18);
    assert!(tokens * blocks >= PARALLEL_BLOCKS, "the parallel path");
    let a = acts(&mut rng, Format::Q8_0, tokens, blocks);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("a pool");
    let all = pool.install(|| {
        let all = Acts::new(&a, tokens, blocks);
        #[cfg(target_arch = "x86_64")]
        if Isa::Avx2.supported() {
            all.prepare(Isa::Avx2, Format::Q8_0);
            assert!(all.words.get().is_some(), "prepared before the tiles");
        }
        all
    });
    // Each token alone is below the threshold: made serially.
    for t in 0..tokens {
        let one = Acts::new(&a[t * blocks..(t + 1) * blocks], 1, blocks);
        let at = t * blocks..(t + 1) * blocks;
        assert_eq!(all.sums[at.clone()], one.sums[..], "sums of token {t}");
        assert_eq!(all.pairs[at.clone()], one.pairs[..], "pairs of token {t}");
        assert_eq!(all.sub_pairs[at.clone()], one.sub_pairs[..], "sub-pairs of token {t}");
        assert_eq!(all.q3k_starts[at.clone()], one.q3k_starts[..], "Q3_K starts of token {t}");
        assert_eq!(all.q6k_starts[at.clone()], one.q6k_starts[..], "Q6_K starts of token {t}");
        #[cfg(target_arch = "x86_64")]
        if let Some(words) = all.words.get() {
            assert_eq!(words[at.start * QK..at.end * QK], one.words()[..], "words of token {t}");
        }
    }
}
