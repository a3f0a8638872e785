//! The CUDA backend against the CPU reference. These need an NVIDIA GPU, so they are `#[ignore]`d and run by
//! `scripts/gpu-check.sh` (`cargo test --features cuda -- --ignored`, or the test binary of a bundle from
//! `scripts/gpu-bundle.sh`). Every op runs on random inputs in each activation type with per-type tolerances;
//! whole models must agree too (greedy tokens exactly). The block formats' own checks are in `cuda/quant.rs`.
//!
//! Environment: `STRATA_TEST_MODEL`, a real model (SmolLM2, or the bundle's slice of it); `STRATA_GPU_EXPECT`,
//! a folder of CPU results for that model: `write_cpu_expectations` (no GPU needed) writes `expect.json` and
//! `cpu-logits.f32` there, `bundle_model_matches_the_cpu_expectations` compares the GPU with them;
//! `STRATA_TEST_KQUANT_MODEL`, that model as llama.cpp's Q4_K_M (the bundle's `model-q4_k_m.gguf`; without it
//! `quant::q4_k_m_model_greedy_tokens_match_the_cpu` makes one from `STRATA_TEST_MODEL` with `llama-quantize`).
#![cfg(feature = "cuda")]

#[path = "cuda/quant.rs"]
mod quant;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail, ensure};
use rand::{Rng, SeedableRng, rngs::StdRng};
use strata_engine::KvDtype;
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::backend::cuda::{CudaBackend, CudaOptions};
use strata_engine::backend::{AttnSeq, AttnShape, Backend};
use strata_engine::config::{Architecture, ModelConfig};
use strata_engine::generate::Engine;
use strata_engine::layout::ModelLayout;
use strata_engine::loader::ModelFiles;
use strata_engine::model::{LoadOptions, LogitRows, SeqChunk, StageInput, StageModel};
use strata_engine::offload::OffloadBudget;
use strata_engine::sampling::argmax;
use strata_engine::tensor::{DType, HostTensor};
use strata_engine::testing;

fn cuda(act: DType) -> Result<CudaBackend> {
    let opts = CudaOptions { act_dtype: Some(act), ..CudaOptions::from_env(0, |k| std::env::var(k).ok()) };
    Ok(CudaBackend::new(opts)?)
}

/// `max |a - b| <= atol + rtol * max |b|`, per activation type: f32 differs by reduction order and FMA only,
/// f16/bf16 by one rounding of each stored intermediate.
fn close(what: &str, act: DType, got: &[f32], want: &[f32]) -> Result<()> {
    let (atol, rtol) = match act {
        DType::F32 => (1e-5, 1e-4),
        DType::F16 => (1e-3, 4e-3),
        _ => (1e-2, 2e-2),
    };
    ensure!(got.len() == want.len(), "{what}: {} values, expected {}", got.len(), want.len());
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    let (i, err) = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .enumerate()
        .fold((0, 0f32), |m, (i, e)| if e > m.1 || e.is_nan() { (i, e) } else { m });
    ensure!(
        err <= atol + rtol * scale,
        "{what} ({act}): |diff| {err} at {i} (got {}, want {}), scale {scale}",
        got[i],
        want[i]
    );
    Ok(())
}

fn rand_vec(rng: &mut StdRng, n: usize, amp: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-amp..amp)).collect()
}

/// Values rounded to the activation type, so both backends start from the same inputs.
fn rounded(act: DType, v: Vec<f32>) -> Vec<f32> {
    HostTensor::from_f32(vec![v.len()], &v).convert(act).to_f32()
}

fn check_ops(act: DType) -> Result<()> {
    let (cpu, gpu) = (CpuBackend::new(2)?, cuda(act)?);
    let mut rng = StdRng::seed_from_u64(7);
    let (rows, cols) = (9, 256);
    let x = rounded(act, rand_vec(&mut rng, rows * cols, 1.0));
    let (xc, xg) = (cpu.act_from_host(&x, rows, cols)?, gpu.act_from_host(&x, rows, cols)?);
    close("round trip", act, &gpu.act_to_host(&xg)?, &x)?;

    let w = rounded(act, rand_vec(&mut rng, cols, 1.0));
    let (wc, wg) = (cpu.upload_vector(&w)?, gpu.upload_vector(&w)?);
    close("rms_norm", act, &gpu.act_to_host(&gpu.rms_norm(&xg, &wg, 1e-5)?)?, &cpu.rms_norm(&xc, &wc, 1e-5)?.data)?;
    // Qwen3's q/k norms: each 64-wide head of a row on its own.
    let (hc, hg) = (cpu.upload_vector(&w[..64])?, gpu.upload_vector(&w[..64])?);
    let want = cpu.rms_norm_heads(&xc, &hc, 1e-6)?.data;
    close("rms_norm_heads", act, &gpu.act_to_host(&gpu.rms_norm_heads(&xg, &hg, 1e-6)?)?, &want)?;

    let y = rounded(act, rand_vec(&mut rng, rows * cols, 1.0));
    let (yc, yg) = (cpu.act_from_host(&y, rows, cols)?, gpu.act_from_host(&y, rows, cols)?);
    close("silu_mul", act, &gpu.act_to_host(&gpu.silu_mul(&xg, &yg)?)?, &cpu.silu_mul(&xc, &yc)?.data)?;
    let (mut sc, mut sg) = (xc.clone(), gpu.act_from_host(&x, rows, cols)?);
    cpu.add_assign(&mut sc, &yc)?;
    gpu.add_assign(&mut sg, &yg)?;
    close("add_assign", act, &gpu.act_to_host(&sg)?, &sc.data)?;
    let pick = [8, 0, 3, 3];
    close("select_rows", act, &gpu.act_to_host(&gpu.select_rows(&xg, &pick)?)?, &cpu.select_rows(&xc, &pick)?.data)?;

    let head_dim = 64;
    let inv: Vec<f32> = (0..head_dim / 2).map(|i| 10000f32.powf(-2.0 * i as f32 / head_dim as f32)).collect();
    let pos: Vec<u32> = (0..rows as u32).map(|p| p * 37 + 3).collect();
    let (mut rc, mut rg) = (xc.clone(), gpu.act_from_host(&x, rows, cols)?);
    cpu.rope(&mut rc, &pos, &inv, head_dim)?;
    gpu.rope(&mut rg, &pos, &inv, head_dim)?;
    close("rope", act, &gpu.act_to_host(&rg)?, &rc.data)?;

    for dtype in std::iter::once(act).chain(strata_engine::quant::FORMATS.map(|f| f.dtype)) {
        quant::check_matmuls(&cpu, &gpu, act, dtype, &mut rng)?;
    }
    check_attention(&cpu, &gpu, act, gpu.default_kv_dtype(), &mut rng)
}

/// Packed prefill, then decode with cached context, then a mixed batch (chunked prefill + decode), with the GPU's
/// cache stored as `kv`. The CPU's is f32 against a float GPU cache (the GPU's rounding is the activations'), and
/// q8_0 against a q8_0 one.
fn check_attention(cpu: &CpuBackend, gpu: &CudaBackend, act: DType, kv: KvDtype, rng: &mut StdRng) -> Result<()> {
    let cpu_kv = if kv == KvDtype::Q8_0 { kv } else { KvDtype::F32 };
    for (heads, kv_heads, head_dim) in [(4, 2, 64), (8, 1, 128), (9, 3, 64)] {
        let shape = AttnShape { num_heads: heads, num_kv_heads: kv_heads, head_dim, block_size: 16 };
        let (q_dim, kv_dim) = (heads * head_dim, kv_heads * head_dim);
        let kc = cpu.alloc_kv_layer(64, 16, kv_dim, cpu_kv)?;
        let (mut kc, mut kg) = (kc, gpu.alloc_kv_layer(64, 16, kv_dim, kv)?);
        let (b0, b1): (Vec<u32>, Vec<u32>) = ((0..40).collect(), (40..64).collect());
        let steps: Vec<Vec<AttnSeq<'_>>> = vec![
            vec![
                AttnSeq { row: 0, len: 37, start_pos: 0, blocks: &b0 },
                AttnSeq { row: 37, len: 5, start_pos: 0, blocks: &b1 },
            ],
            vec![
                AttnSeq { row: 0, len: 1, start_pos: 37, blocks: &b0 },
                AttnSeq { row: 1, len: 1, start_pos: 5, blocks: &b1 },
            ],
            vec![
                AttnSeq { row: 0, len: 600, start_pos: 38, blocks: &b0 },
                AttnSeq { row: 600, len: 1, start_pos: 6, blocks: &b1 },
            ],
        ];
        for (i, seqs) in steps.iter().enumerate() {
            let rows: usize = seqs.iter().map(|s| s.len).sum();
            let mk = |rng: &mut StdRng, w| rounded(act, rand_vec(rng, rows * w, 1.0));
            let (q, k, v) = (mk(rng, q_dim), mk(rng, kv_dim), mk(rng, kv_dim));
            let want = cpu.attention(
                &cpu.act_from_host(&q, rows, q_dim)?,
                &cpu.act_from_host(&k, rows, kv_dim)?,
                &cpu.act_from_host(&v, rows, kv_dim)?,
                &mut kc,
                seqs,
                shape,
            )?;
            let got = gpu.attention(
                &gpu.act_from_host(&q, rows, q_dim)?,
                &gpu.act_from_host(&k, rows, kv_dim)?,
                &gpu.act_from_host(&v, rows, kv_dim)?,
                &mut kg,
                seqs,
                shape,
            )?;
            let what = format!("attention {heads}/{kv_heads}x{head_dim} {kv} KV step {i}");
            let got = gpu.act_to_host(&got)?;
            if kv == KvDtype::Q8_0 && i == 0 {
                // The GPU's packed prefill reads the fresh k/v, the CPU's the quantized cache: they differ by
                // q8_0's rounding (the CPU's own bound against f32 is 6e-3 on similar inputs).
                let worst = got.iter().zip(&want.data).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                ensure!(worst <= 1e-2, "{what}: |diff| {worst}");
            } else {
                // Both read the same quantized blocks (the same rounding of the same f32 inputs).
                close(&what, act, &got, &want.data)?;
            }
        }
    }
    Ok(())
}

#[test]
#[ignore = "needs an NVIDIA GPU; scripts/gpu-check.sh runs it"]
fn every_op_matches_the_cpu_in_f32() -> Result<()> {
    check_ops(DType::F32)
}

#[test]
#[ignore = "needs an NVIDIA GPU; scripts/gpu-check.sh runs it"]
fn every_op_matches_the_cpu_in_f16() -> Result<()> {
    check_ops(DType::F16)
}

#[test]
#[ignore = "needs an NVIDIA GPU; scripts/gpu-check.sh runs it"]
fn every_op_matches_the_cpu_in_bf16() -> Result<()> {
    check_ops(DType::BF16)
}

#[test]
#[ignore = "needs an NVIDIA GPU; scripts/gpu-check.sh runs it"]
fn q8_0_kv_attention_matches_the_cpus_q8_0_kv() -> Result<()> {
    let (cpu, gpu) = (CpuBackend::new(2)?, cuda(DType::F32)?);
    check_attention(&cpu, &gpu, DType::F32, KvDtype::Q8_0, &mut StdRng::seed_from_u64(8))
}

#[test]
#[ignore = "needs an NVIDIA GPU; scripts/gpu-check.sh runs it"]
fn the_kv_cache_is_the_activation_type_or_q8_0() -> Result<()> {
    let gpu = cuda(DType::BF16)?;
    assert_eq!(gpu.default_kv_dtype(), KvDtype::Bf16);
    assert!(gpu.alloc_kv_layer(4, 16, 128, KvDtype::Bf16).is_ok());
    assert!(gpu.alloc_kv_layer(4, 16, 128, KvDtype::Q8_0).is_ok());
    for dtype in [KvDtype::F16, KvDtype::F32] {
        let err = gpu.alloc_kv_layer(4, 16, 128, dtype).err().map(|e| e.to_string()).unwrap_or_default();
        ensure!(err.contains(&format!("cannot keep its KV cache as {dtype}")), "{err}");
        ensure!(err.contains("use --kv-dtype bf16 or q8_0") && err.contains(&format!("--dtype {dtype}")), "{err}");
    }
    Ok(())
}

/// Logits of a prefill of two sequences and three batched decode steps through `stages`.
fn run<B: Backend>(stages: &[StageModel<B>]) -> Result<Vec<Vec<f32>>> {
    let mut caches =
        stages.iter().map(|s| s.new_kv_cache(64, 16, s.backend().default_kv_dtype())).collect::<Result<Vec<_>, _>>()?;
    let mut steps = vec![(
        vec![SeqChunk { seq_id: 1, start_pos: 0, len: 7 }, SeqChunk { seq_id: 2, start_pos: 0, len: 3 }],
        vec![5u32, 17, 2, 99, 42, 7, 8, 250, 3, 1],
    )];
    for i in 0..3 {
        steps.push((
            vec![SeqChunk { seq_id: 1, start_pos: 7 + i, len: 1 }, SeqChunk { seq_id: 2, start_pos: 3 + i, len: 1 }],
            vec![11 + i as u32, 200 - i as u32],
        ));
    }
    let mut out = Vec::new();
    for (chunks, ids) in &steps {
        let mut hidden = None;
        for (stage, kv) in stages.iter().zip(caches.iter_mut()) {
            let input = match hidden.take() {
                None => StageInput::Tokens(ids),
                Some(h) => StageInput::Hidden(h),
            };
            hidden = Some(stage.forward(kv, chunks, input, LogitRows::All)?);
        }
        let last = stages.last().context("no stages")?;
        out.push(last.backend().act_to_host(&hidden.context("no output")?)?);
    }
    Ok(out)
}

fn load<B: Backend>(
    files: &ModelFiles,
    cuts: &[usize],
    be: &Arc<B>,
    opts: &LoadOptions<'_>,
) -> Result<Vec<StageModel<B>>> {
    let mut bounds = vec![0];
    bounds.extend_from_slice(cuts);
    bounds.push(files.config().num_layers);
    Ok(bounds.windows(2).map(|w| StageModel::load(files, w[0]..w[1], be.clone(), opts)).collect::<Result<_, _>>()?)
}

#[test]
#[ignore = "needs an NVIDIA GPU; scripts/gpu-check.sh runs it"]
fn tiny_model_matches_cpu_and_splits_and_offload_change_nothing() -> Result<()> {
    let files = ModelFiles::open(Path::new("random:tiny"))?;
    let cpu = Arc::new(CpuBackend::new(2)?);
    let want = run(&load(&files, &[], &cpu, &LoadOptions::default())?)?;
    let gpu = Arc::new(cuda(DType::F32)?);
    let one = run(&load(&files, &[], &gpu, &LoadOptions::default())?)?;
    for (i, (g, c)) in one.iter().zip(&want).enumerate() {
        close(&format!("tiny model step {i}"), DType::F32, g, c)?;
    }
    // Same GPU, same kernels: a split or offloaded layers must give the very same bits.
    ensure!(run(&load(&files, &[1, 3], &gpu, &LoadOptions::default())?)? == one, "2 stages differ from 1 stage");
    // random:tiny in f32: ~590 kB per layer, ~530 kB of embeddings/head/norms; 2.5 MB keeps one layer resident
    // and streams three through two staging slots.
    let budget = OffloadBudget { limit_bytes: 2_500_000, reserve_bytes: 0 };
    let opts = LoadOptions { offload: Some(budget), ..LoadOptions::default() };
    let offloaded = load(&files, &[], &gpu, &opts)?;
    ensure!(
        !offloaded[0].offloaded_layers().is_empty(),
        "budget should force offload: {:?}",
        offloaded[0].offload_plan()
    );
    ensure!(run(&offloaded)? == one, "offloaded layers change the logits");
    Ok(())
}

#[test]
#[ignore = "needs an NVIDIA GPU; scripts/gpu-check.sh runs it"]
fn tiny_qwen3_matches_cpu_and_splits_change_nothing() -> Result<()> {
    // Per-head q/k norms, head_dim 64 (a width the kernels support) != hidden 128 / 4 heads, GQA, untied head.
    let config =
        ModelConfig { architecture: Architecture::Qwen3, hidden_size: 128, head_dim: 64, ..testing::tiny_config() };
    let spec = testing::TinySpec { config, dtype: DType::F32, seed: 21 };
    let dir = tempfile::tempdir()?;
    testing::write_hf(dir.path(), &spec, &testing::random_weights(&spec))?;
    let files = ModelFiles::open(dir.path())?;
    let cpu = Arc::new(CpuBackend::new(2)?);
    let want = run(&load(&files, &[], &cpu, &LoadOptions::default())?)?;
    let gpu = Arc::new(cuda(DType::F32)?);
    let one = run(&load(&files, &[], &gpu, &LoadOptions::default())?)?;
    for (i, (g, c)) in one.iter().zip(&want).enumerate() {
        close(&format!("tiny qwen3 step {i}"), DType::F32, g, c)?;
    }
    ensure!(run(&load(&files, &[1, 3], &gpu, &LoadOptions::default())?)? == one, "2 stages differ from 1 stage");
    Ok(())
}

/// Greedy continuation of `prompt` for `steps` tokens.
fn greedy<B: Backend>(model: StageModel<B>, prompt: &[u32], steps: usize) -> Result<Vec<u32>> {
    Ok(greedy_logits(model, prompt, steps)?.into_iter().map(|l| argmax(&l)).collect())
}

/// The logits of every step of a greedy continuation of `prompt` (`steps + 1` rows: the prompt's last token,
/// then each generated one).
fn greedy_logits<B: Backend>(model: StageModel<B>, prompt: &[u32], steps: usize) -> Result<Vec<Vec<f32>>> {
    let mut e = Engine::new(model, None, 256)?;
    let chunk = SeqChunk { seq_id: 0, start_pos: 0, len: prompt.len() };
    let mut out = vec![e.step(&[chunk], prompt)?.swap_remove(0)];
    for i in 0..steps {
        let next = argmax(out.last().context("no logits")?);
        out.push(e.step(&[SeqChunk { seq_id: 0, start_pos: prompt.len() + i, len: 1 }], &[next])?.swap_remove(0));
    }
    Ok(out)
}

/// Greedy tokens of the real model on the GPU (f32 activations) equal the CPU's.
#[test]
#[ignore = "needs an NVIDIA GPU and STRATA_TEST_MODEL=$(scripts/fetch-model.sh); scripts/gpu-check.sh runs it"]
fn smollm2_greedy_tokens_match_the_cpu() -> Result<()> {
    let Ok(path) = std::env::var("STRATA_TEST_MODEL") else {
        bail!("set STRATA_TEST_MODEL=$(scripts/fetch-model.sh)");
    };
    let files = ModelFiles::open(Path::new(&path))?;
    let n = files.config().num_layers;
    let prompt = [504u32, 3575, 282, 4649, 314];
    let cpu = StageModel::load(&files, 0..n, Arc::new(CpuBackend::new(0)?), &LoadOptions::default())?;
    let gpu = StageModel::load(&files, 0..n, Arc::new(cuda(DType::F32)?), &LoadOptions::default())?;
    let (want, got) = (greedy(cpu, &prompt, 24)?, greedy(gpu, &prompt, 24)?);
    ensure!(want == got, "cpu  {want:?}\ncuda {got:?}");
    Ok(())
}

/// How far token `t`'s logit is ahead of the best other one.
fn top2_margin(logits: &[f32], t: u32) -> f32 {
    let second = logits.iter().enumerate().filter(|&(i, _)| i != t as usize).fold(f32::MIN, |m, (_, &x)| m.max(x));
    logits[t as usize] - second
}

/// The prompt of the real-model checks ("The capital of France is" in SmolLM2's tokenizer; every id is below
/// 8192, so it fits the bundle's slice of the vocabulary) and the tokens generated after it.
const PROMPT: [u32; 5] = [504, 3575, 282, 4649, 314];
const STEPS: usize = 16;

/// GPU memory a stage worker of the bundle check gives itself besides weights and KV: the stage worker's
/// `GPU_WORKSPACE_BYTES`, repeated here because the engine's tests cannot see the worker. If the two drift the
/// cluster offload step of `scripts/gpu-check.sh` fails (it checks that layers were offloaded), not passes.
const WORKER_WORKSPACE_BYTES: usize = 512 << 20;
/// KV blocks (of 16 tokens) of each stage worker in the bundle check's clusters (`strata local --kv-blocks`).
const WORKER_KV_BLOCKS: usize = 64;

fn env_path(var: &str, what: &str) -> Result<PathBuf> {
    std::env::var_os(var).map(PathBuf::from).with_context(|| format!("set {var} to {what}"))
}

fn test_model() -> Result<ModelFiles> {
    let path = env_path("STRATA_TEST_MODEL", "a real model (scripts/fetch-model.sh, or the bundle's model.gguf)")?;
    Ok(ModelFiles::open(&path)?)
}

/// A device budget for the whole of `files` with f32 activations that keeps its first layer resident and
/// streams the rest through two staging slots, with `reserve` bytes besides: the first layer, two slots of the
/// largest other layer, half a layer to spare, the embeddings, head and norms.
fn one_resident_layer_limit(files: &ModelFiles, reserve: usize) -> Result<usize> {
    let cfg = files.config();
    ensure!(cfg.num_layers >= 3, "the offload check needs at least 3 layers, the model has {}", cfg.num_layers);
    let storage = |d: DType| if d.is_quantized() { d } else { DType::F32 };
    let bytes = ModelLayout::new(cfg).stage_bytes(files, &(0..cfg.num_layers), &storage)?;
    let slot = bytes.layers[1..].iter().copied().max().context("no layers")?;
    Ok(reserve + bytes.fixed() + bytes.layers[0] + 2 * slot + bytes.layers[1] / 2)
}

/// The CPU side of the bundle: greedy tokens and logits of `STRATA_TEST_MODEL` on the CPU backend, written to
/// `$STRATA_GPU_EXPECT/expect.json` and `cpu-logits.f32` (little-endian f32, one row of `vocab` per step), with
/// the GPU memory limit that makes a stage worker of the bundle check offload all but one layer. Needs no GPU;
/// `scripts/gpu-bundle.sh` runs it.
#[test]
#[ignore = "writes the CPU expectations of a GPU bundle; scripts/gpu-bundle.sh runs it"]
fn write_cpu_expectations() -> Result<()> {
    let dir = env_path("STRATA_GPU_EXPECT", "the folder to write the expectations into")?;
    let files = test_model()?;
    let cfg = files.config().clone();
    let cpu = StageModel::load(&files, 0..cfg.num_layers, Arc::new(CpuBackend::new(0)?), &LoadOptions::default())?;
    let logits = greedy_logits(cpu, &PROMPT, STEPS)?;
    let tokens: Vec<u32> = logits.iter().map(|l| argmax(l)).collect();
    // How far the chosen token is ahead of the next best: a mismatch on a step with a tiny margin is a near tie,
    // not necessarily a bug.
    let margins: Vec<f32> = logits.iter().zip(&tokens).map(|(l, &t)| top2_margin(l, t)).collect();
    let kv_bytes = WORKER_KV_BLOCKS * 16 * cfg.num_layers * 2 * cfg.kv_dim() * 4;
    let expect = serde_json::json!({
        "prompt_ids": PROMPT,
        "tokens": tokens,
        "top2_margins": margins,
        "vocab_size": cfg.vocab_size,
        "num_layers": cfg.num_layers,
        "logits": "cpu-logits.f32",
        "worker": {
            "dtype": "f32",
            "kv_blocks": WORKER_KV_BLOCKS,
            "offload_gpu_memory_limit": one_resident_layer_limit(&files, kv_bytes + WORKER_WORKSPACE_BYTES)?,
        },
    });
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("expect.json"), serde_json::to_string_pretty(&expect)?)?;
    let raw: Vec<u8> = logits.iter().flatten().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(dir.join("cpu-logits.f32"), raw)?;
    println!("tokens {tokens:?}\nsmallest top-2 margin {:?}", margins.iter().copied().reduce(f32::min));
    Ok(())
}

/// The GPU (f32 activations) gives the greedy tokens the CPU gave where the bundle was built, and logits
/// within the f32 tolerance of [`close`].
#[test]
#[ignore = "needs an NVIDIA GPU, STRATA_TEST_MODEL and STRATA_GPU_EXPECT; scripts/gpu-check.sh runs it"]
fn bundle_model_matches_the_cpu_expectations() -> Result<()> {
    let dir = env_path("STRATA_GPU_EXPECT", "the bundle's expect folder")?;
    let expect: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("expect.json"))?)?;
    let want_tokens: Vec<u32> = serde_json::from_value(expect["tokens"].clone())?;
    let margins: Vec<f32> = serde_json::from_value(expect["top2_margins"].clone())?;
    let prompt: Vec<u32> = serde_json::from_value(expect["prompt_ids"].clone())?;
    let raw = std::fs::read(dir.join("cpu-logits.f32"))?;
    let want: Vec<f32> = raw.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
    let files = test_model()?;
    let (n, vocab) = (files.config().num_layers, files.config().vocab_size);
    ensure!(want.len() == want_tokens.len() * vocab, "cpu-logits.f32 holds {} values, not {} rows", want.len(), vocab);
    let gpu = StageModel::load(&files, 0..n, Arc::new(cuda(DType::F32)?), &LoadOptions::default())?;
    let got = greedy_logits(gpu, &prompt, want_tokens.len() - 1)?;
    let tokens: Vec<u32> = got.iter().map(|l| argmax(l)).collect();
    if let Some(i) = tokens.iter().zip(&want_tokens).position(|(a, b)| a != b) {
        bail!(
            "greedy tokens differ from step {i} (CPU top-2 margin there {}):\ncpu  {want_tokens:?}\ncuda {tokens:?}",
            margins[i]
        );
    }
    let mut worst = 0f32;
    for (i, (g, w)) in got.iter().zip(want.chunks_exact(vocab)).enumerate() {
        close(&format!("logits of step {i}"), DType::F32, g, w)?;
        worst = g.iter().zip(w).fold(worst, |m, (a, b)| m.max((a - b).abs()));
    }
    println!("{} greedy tokens equal; largest |logit diff| {worst:e}", tokens.len());
    Ok(())
}

/// The real model on the GPU: two stages on two memory-limited backends of the one GPU give the very bits of one
/// stage, and so does a stage that streams all but its first layer from pinned host memory.
#[test]
#[ignore = "needs an NVIDIA GPU and STRATA_TEST_MODEL; scripts/gpu-check.sh runs it"]
fn bundle_model_splits_and_offload_change_nothing() -> Result<()> {
    let files = test_model()?;
    let n = files.config().num_layers;
    let gpu = Arc::new(cuda(DType::F32)?);
    let one = run(&load(&files, &[], &gpu, &LoadOptions::default())?)?;
    let limited = |bytes: usize| -> Result<Arc<CudaBackend>> {
        let opts = CudaOptions {
            act_dtype: Some(DType::F32),
            memory_limit: Some(bytes),
            ..CudaOptions::from_env(0, |k| std::env::var(k).ok())
        };
        Ok(Arc::new(CudaBackend::new(opts)?))
    };
    let (a, b) = (limited(1 << 30)?, limited(1 << 30)?);
    let cut = n / 2;
    let two = vec![
        StageModel::load(&files, 0..cut, a, &LoadOptions::default())?,
        StageModel::load(&files, cut..n, b, &LoadOptions::default())?,
    ];
    ensure!(run(&two)? == one, "2 stages on two backends differ from 1 stage");
    let budget = OffloadBudget { limit_bytes: one_resident_layer_limit(&files, 0)?, reserve_bytes: 0 };
    let offloaded = load(&files, &[], &gpu, &LoadOptions { offload: Some(budget), ..LoadOptions::default() })?;
    ensure!(
        offloaded[0].offloaded_layers() == (1..n),
        "expected layers 1..{n} offloaded: {:?}",
        offloaded[0].offload_plan()
    );
    ensure!(run(&offloaded)? == one, "offloaded layers change the logits");
    Ok(())
}
