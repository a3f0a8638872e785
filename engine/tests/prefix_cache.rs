//! Prefix caching on the engine: a sequence that starts on another sequence's cached blocks computes the same
//! logits, bit for bit, as one that computes its whole prompt, on random f16 and bf16 models and on the real
//! SmolLM2 Q4_1 file, for a suffix of one token and of several, at every split the block size allows, with the
//! blocks computed in one prefill or token by token as decoding computes them. (f32 weights are the exception: 4+
//! tokens go to the `gemm` crate, whose summation order depends on the token count, so a suffix of 1-3 tokens may
//! differ in the last bits, as chunked prefill does.)

use std::path::Path;
use std::sync::Arc;

use anyhow::{Result, ensure};
use strata_engine::KvDtype;
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::loader::ModelFiles;
use strata_engine::model::{LoadOptions, LogitRows, SeqChunk, StageInput, StageModel};

const BLOCK: usize = 4;

/// Logits of the last prompt token and of `decode` more tokens, computed whole and on cached blocks: blocks cached
/// by a sequence that prefilled the whole prompt, and by one that prefilled 5 tokens and decoded the rest one by
/// one (as the coordinator caches the blocks an answer fills, for a chat's next turn).
fn compare(model: &StageModel<CpuBackend>, prompt: &[u32], decode: &[u32], kv_dtype: KvDtype) -> Result<()> {
    let run = |kv: &mut strata_engine::kv_cache::KvCache<CpuBackend>, seq: u64, start: usize| -> Result<Vec<f32>> {
        let first = SeqChunk { seq_id: seq, start_pos: start, len: prompt.len() - start };
        let mut out = model.forward(kv, &[first], StageInput::Tokens(&prompt[start..]), LogitRows::Last)?.data;
        for (i, &t) in decode.iter().enumerate() {
            let step = SeqChunk { seq_id: seq, start_pos: prompt.len() + i, len: 1 };
            out.extend(model.forward(kv, &[step], StageInput::Tokens(&[t]), LogitRows::Last)?.data);
        }
        Ok(out)
    };
    let mut kv = model.new_kv_cache(64, BLOCK, kv_dtype)?;
    let whole = run(&mut kv, 1, 0)?;
    kv.release(1);
    for prefilled in [prompt.len(), 5] {
        // Fill the cache: one chunk of `prefilled` tokens, then one token per step.
        let first = SeqChunk { seq_id: 2, start_pos: 0, len: prefilled };
        model.forward(&mut kv, &[first], StageInput::Tokens(&prompt[..prefilled]), LogitRows::Last)?;
        for (pos, &t) in prompt.iter().enumerate().skip(prefilled) {
            let step = SeqChunk { seq_id: 2, start_pos: pos, len: 1 };
            model.forward(&mut kv, &[step], StageInput::Tokens(&[t]), LogitRows::Last)?;
        }
        // Publish every full block of the prompt, then drop the sequence: only the cache holds them.
        let keys: Vec<u64> = (0..prompt.len() / BLOCK).map(|i| 100 + i as u64).collect();
        for (i, &k) in keys.iter().enumerate() {
            kv.publish(2, i, k)?;
        }
        kv.release(2);
        // At least one prompt token is always computed: its logits are the first sampled.
        for blocks in 1..=(prompt.len() - 1) / BLOCK {
            let seq = 10 + blocks as u64;
            kv.attach(seq, &keys[..blocks])?;
            let reused = run(&mut kv, seq, blocks * BLOCK)?;
            ensure!(
                reused == whole,
                "{kv_dtype:?}: {blocks} cached blocks (of a sequence that prefilled {prefilled}) change the logits"
            );
            kv.release(seq);
        }
        kv.clear_prefix_cache();
        ensure!(kv.free_blocks() == kv.num_blocks(), "every block returns when the cache is cleared");
    }
    Ok(())
}

#[test]
fn cached_blocks_give_the_logits_of_a_whole_prefill_on_random_models() -> Result<()> {
    let prompt: Vec<u32> = (0..19).map(|i| (i * 37 + 11) % 256).collect();
    for weights in ["random:tiny:f16", "random:tiny:bf16"] {
        let files = ModelFiles::open(Path::new(weights))?;
        let model = StageModel::load(&files, 0..4, Arc::new(CpuBackend::new(2)?), &LoadOptions::default())?;
        ensure!(model.batch_invariant(), "{weights} says its results depend on the batch");
        for dtype in KvDtype::ALL {
            compare(&model, &prompt, &[3, 90, 17], dtype)?;
        }
    }
    // f32 weights are not: the stage says so, and the coordinator's default leaves prefix caching off for them.
    let files = ModelFiles::open(Path::new("random:tiny"))?;
    let model = StageModel::load(&files, 0..4, Arc::new(CpuBackend::new(2)?), &LoadOptions::default())?;
    ensure!(!model.batch_invariant());
    Ok(())
}

#[test]
fn cached_blocks_give_the_logits_of_a_whole_prefill_on_smollm2() -> Result<()> {
    let path = strata_testkit::smollm2();
    let files = ModelFiles::open(&path)?;
    let layers = files.config().num_layers;
    let model = StageModel::load(&files, 0..layers, Arc::new(CpuBackend::new(2)?), &LoadOptions::default())?;
    ensure!(model.batch_invariant());
    // 22 tokens: a prompt long enough for several blocks and for the batched (several-token) kernels.
    let prompt: Vec<u32> = (0..22).map(|i| 100 + i * 131).collect();
    compare(&model, &prompt, &[28, 1543], KvDtype::F16)
}
