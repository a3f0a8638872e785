//! The worker's memory budget and what the KV cache gets of it.
//!
//! Like vLLM's `gpu_memory_utilization`, a worker offers a budget (`--memory-limit`, or on a GPU
//! `--gpu-memory-limit`, else `--memory-fraction` of the RAM or device memory) and, after its weights are loaded,
//! runs one profiling batch of the largest size the coordinator schedules. Whatever the process then holds at its
//! peak (on the CPU: resident pages, mapped weight pages included, read from `/proc/self/status`) plus a margin
//! for the hidden states in transit is taken from the budget; the rest becomes KV blocks, unless `--kv-blocks`
//! fixes their number. The arithmetic is [`kv_blocks_that_fit`], a pure function.

use std::path::Path;

use strata_engine::KvDtype;
use strata_engine::backend::Backend;
use strata_engine::model::{LogitRows, SeqChunk, StageInput, StageModel};
use strata_engine::stage_memory::{MARGIN_BYTES, ProcessMemory, transit_bytes};

use crate::config::WorkerConfig;
use crate::device::{CUBLAS_WORKSPACE_BYTES, GPU_WORKSPACE_BYTES};
use crate::error::{Error, Result};

/// Share of the RAM (or device memory) a worker offers when no limit is given.
pub const DEFAULT_MEMORY_FRACTION: f64 = 0.9;

/// Tokens of the profiling batch when the plan does not say how large batches get (the coordinator's default
/// `--max-batch-tokens`).
pub const DEFAULT_PROFILE_TOKENS: usize = 512;

/// Restarts the peak (`VmHWM`) at the current resident size; false where the kernel does not allow it.
pub fn reset_peak() -> bool {
    // Writing 5 to clear_refs resets the peak RSS (Linux 4.0+).
    std::fs::write(Path::new("/proc/self/clear_refs"), "5").is_ok()
}

/// Total RAM from `/proc/meminfo` (`MemTotal`), in bytes.
pub fn total_ram() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The budget: an explicit limit, else `fraction` of `capacity` (the RAM, or the device's memory).
pub fn budget(limit: Option<u64>, fraction: f64, capacity: Option<u64>) -> Option<u64> {
    limit.or_else(|| capacity.map(|c| (c as f64 * fraction) as u64))
}

/// What a stage holds besides its KV cache, as measured after loading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Bytes the process (or device) held at the peak of the profiling batch: runtime, weights, workspace.
    pub peak: u64,
    /// Bytes of hidden states a stage may hold in transit besides that batch.
    pub transit: u64,
}

impl Usage {
    /// Usage at `peak` for batches of `tokens` tokens of `hidden` f32 features.
    pub fn new(peak: u64, tokens: usize, hidden: usize) -> Self {
        Usage { peak, transit: transit_bytes(tokens, hidden) }
    }

    /// Everything that is not KV cache, margin included.
    pub fn total(&self) -> u64 {
        self.peak.saturating_add(self.transit).saturating_add(MARGIN_BYTES)
    }
}

/// KV blocks of `block_bytes` each that fit in `budget` after `usage`; an error naming the shortfall when not
/// even `min_blocks` fit.
pub fn kv_blocks_that_fit(budget: u64, usage: Usage, block_bytes: u64, min_blocks: u64) -> Result<usize> {
    let block_bytes = block_bytes.max(1);
    let used = usage.total();
    let free = budget.saturating_sub(used);
    let blocks = free / block_bytes;
    let min_blocks = min_blocks.max(1);
    if blocks < min_blocks {
        let short = min_blocks.saturating_mul(block_bytes).saturating_sub(free);
        return Err(Error::Config(format!(
            "memory budget of {} leaves room for {blocks} KV blocks, {min_blocks} needed: the stage holds {} at \
             its peak (weights, runtime and a profiling batch) plus {} for hidden states in transit and {} of \
             margin; {} more memory needed (raise --memory-limit, or give this worker fewer layers)",
            mib(budget),
            mib(usage.peak),
            mib(usage.transit),
            mib(MARGIN_BYTES),
            mib(short)
        )));
    }
    usize::try_from(blocks).map_err(|_| Error::Config(format!("{blocks} KV blocks do not fit in memory addresses")))
}

/// How a stage's KV cache was sized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvSizing {
    /// KV blocks to allocate.
    pub blocks: usize,
    /// The memory budget, when the blocks were sized from it (`None`: `--kv-blocks` fixed them).
    pub budget: Option<u64>,
    /// What the stage holds besides its KV cache, when measured.
    pub usage: Option<Usage>,
}

/// Sizes `model`'s KV cache for `config`: `kv_blocks` when given, else what the budget leaves after the weights
/// and a profiling batch of `max_batch_tokens` tokens. Fails, naming the shortfall, when fewer than
/// `min_kv_tokens` tokens fit. Blocking: runs a forward pass on the CPU.
pub fn size_kv_cache<B: Backend>(model: &StageModel<B>, config: &WorkerConfig) -> Result<KvSizing> {
    let block_size = config.block_size.max(1);
    let kv_dtype = crate::device::kv_dtype(config, &**model.backend());
    let block_bytes = (model.kv_bytes_per_token(kv_dtype)? as u64).saturating_mul(block_size as u64);
    let min_blocks = config.min_kv_tokens.div_ceil(block_size as u64);
    if let Some(blocks) = config.kv_blocks {
        if (blocks as u64) < min_blocks {
            return Err(Error::Config(format!(
                "--kv-blocks {blocks} holds {} tokens, fewer than the {} the plan asks every stage to hold",
                blocks * block_size,
                config.min_kv_tokens
            )));
        }
        return Ok(KvSizing { blocks, budget: None, usage: None });
    }
    let hidden = model.config().hidden_size;
    let tokens = config.max_batch_tokens;
    let (budget, peak) = match model.backend().device_memory_capacity() {
        Some(capacity) => (
            budget(config.gpu_memory_limit, config.memory_fraction, Some(capacity as u64)),
            device_peak(model, tokens, kv_dtype)?,
        ),
        None => {
            (budget(config.memory_limit, config.memory_fraction, total_ram()), profile_peak(model, tokens, kv_dtype)?)
        }
    };
    let usage = Usage::new(peak, tokens, hidden);
    let budget = budget.ok_or_else(|| {
        Error::Config("cannot tell how much memory this machine has; pass --memory-limit or --kv-blocks".into())
    })?;
    let blocks = kv_blocks_that_fit(budget, usage, block_bytes, min_blocks)?;
    Ok(KvSizing { blocks, budget: Some(budget), usage: Some(usage) })
}

/// Device bytes a GPU stage holds at its peak: the allocations measured over a profiling batch (weights, staging
/// slots, activations) plus cuBLAS's own workspace, or, where the driver keeps no count, the weights, staging
/// slots and a fixed [`GPU_WORKSPACE_BYTES`].
fn device_peak<B: Backend>(model: &StageModel<B>, tokens: usize, kv_dtype: KvDtype) -> Result<u64> {
    let backend = model.backend();
    backend.reset_allocation_peak()?;
    run_profile(model, tokens, kv_dtype)?;
    let held = match backend.allocation_peak()? {
        Some(peak) => {
            tracing::debug!(tokens, peak, "profiled a batch on the device");
            peak + CUBLAS_WORKSPACE_BYTES
        }
        None => model.weight_bytes() + model.offload_plan().staging_bytes + GPU_WORKSPACE_BYTES,
    };
    Ok(held as u64)
}

/// Peak resident bytes of the process while `model` runs the profiling batches ([`run_profile`]). Every weight
/// page is touched, so mapped weights count in full.
fn profile_peak<B: Backend>(model: &StageModel<B>, tokens: usize, kv_dtype: KvDtype) -> Result<u64> {
    // Without a reset the peak since the start counts (a reload's old stage too): safe, if wasteful.
    let reset = reset_peak();
    run_profile(model, tokens, kv_dtype)?;
    let memory = ProcessMemory::of_self()
        .ok_or_else(|| Error::Config("cannot read /proc/self/status to measure memory; pass --kv-blocks".into()))?;
    tracing::debug!(tokens, reset, peak = memory.peak, resident = memory.resident, "profiled a batch");
    Ok(memory.peak)
}

/// Runs the batches a stage's peak is measured over: one prompt of `tokens` tokens, and on the last stage also
/// that many one-token sequences (a logits row each).
fn run_profile<B: Backend>(model: &StageModel<B>, tokens: usize, kv_dtype: KvDtype) -> Result<()> {
    // One-token blocks, so the profile's own cache is no bigger than the batch.
    let mut kv = model.new_kv_cache(tokens, 1, kv_dtype)?;
    let vocab = model.config().vocab_size.max(1) as u32;
    let ids: Vec<u32> = (0..tokens as u32).map(|i| i % vocab).collect();
    let prompt = [SeqChunk { seq_id: 0, start_pos: 0, len: tokens }];
    let singles: Vec<SeqChunk> = (0..tokens as u64).map(|seq_id| SeqChunk { seq_id, start_pos: 0, len: 1 }).collect();
    let batches: &[&[SeqChunk]] = if model.is_last() { &[&prompt, &singles] } else { &[&prompt] };
    for chunks in batches {
        let input = if model.is_first() {
            StageInput::Tokens(&ids)
        } else {
            let hidden = model.config().hidden_size;
            StageInput::Hidden(model.backend().act_from_host(&vec![0.0; tokens * hidden], tokens, hidden)?)
        };
        model.forward(&mut kv, chunks, input, LogitRows::Last)?;
        for c in chunks.iter() {
            kv.release(c.seq_id);
        }
    }
    Ok(())
}

/// `bytes` as MiB for messages.
pub fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1 << 20) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_is_the_limit_or_a_fraction_of_the_capacity() {
        assert_eq!(budget(Some(100), 0.5, Some(1000)), Some(100));
        assert_eq!(budget(None, 0.5, Some(1000)), Some(500));
        assert_eq!(budget(None, 0.5, None), None);
        assert!(total_ram().is_some_and(|r| r > 0));
    }

    #[test]
    fn what_is_left_becomes_blocks() -> Result<()> {
        let usage = Usage::new(100 << 20, 512, 1024);
        assert_eq!(usage.transit, 8 << 20);
        // 200 MiB - (100 + 8 + 16) MiB = 76 MiB of 1 MiB blocks.
        assert_eq!(kv_blocks_that_fit(200 << 20, usage, 1 << 20, 1)?, 76);
        assert_eq!(kv_blocks_that_fit(200 << 20, usage, 1 << 20, 76)?, 76);
        let short = kv_blocks_that_fit(200 << 20, usage, 1 << 20, 80).map_err(|e| e.to_string());
        let msg = short.expect_err("80 blocks do not fit");
        assert!(msg.contains("76 KV blocks, 80 needed") && msg.contains("4.0 MiB more"), "{msg}");
        let none = kv_blocks_that_fit(100 << 20, usage, 1 << 20, 0).map_err(|e| e.to_string());
        assert!(none.expect_err("nothing fits").contains("0 KV blocks, 1 needed"));
        Ok(())
    }
}
