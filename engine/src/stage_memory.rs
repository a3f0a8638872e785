//! What a stage holds besides its weights, KV cache and measured peak, counted the same way by the stage worker
//! (which measures the rest after loading) and by placement (which estimates it before); and the process's resident
//! memory that peak is read from.

use crate::config::ModelConfig;

/// Bytes a stage keeps free besides what it accounts for: allocator slack, gRPC buffers and tracing.
pub const MARGIN_BYTES: u64 = 16 << 20;

/// Hidden-state messages a stage may hold at once besides the batch it computes (queued on the way in, encoded
/// on the way out).
const MESSAGES_IN_TRANSIT: u64 = 4;

/// Bytes of f32 hidden states in transit for micro-batches of `batch_tokens` tokens of `hidden` features.
pub fn transit_bytes(batch_tokens: usize, hidden: usize) -> u64 {
    (batch_tokens as u64).saturating_mul(hidden as u64).saturating_mul(4).saturating_mul(MESSAGES_IN_TRANSIT)
}

/// Resident memory of a stage worker before any weights: its code, the async runtime, gRPC, the compute threads'
/// stacks and the allocator's arenas (an idle worker measured 26 MiB here, 44 MiB at its peak with one layer).
pub const RUNTIME_BYTES: u64 = 32 << 20;

/// What a stage of `cfg` holds besides weights and KV cache with micro-batches of `batch_tokens` tokens: the
/// runtime, the f32 activations one layer keeps alive at once (residual, norm, q/k/v, attention output, the
/// MLP's gate, up and product, its output), twice over for the allocator's slack, hidden states in transit and
/// the margin.
pub fn stage_overhead_bytes(cfg: &ModelConfig, batch_tokens: usize) -> u64 {
    let row = 4 * cfg.hidden_size + cfg.q_dim() + 2 * cfg.kv_dim() + 3 * cfg.intermediate_size;
    let tokens = batch_tokens as u64;
    let activations = tokens.saturating_mul(row as u64).saturating_mul(4 * 2);
    let transit = transit_bytes(batch_tokens, cfg.hidden_size);
    RUNTIME_BYTES.saturating_add(MARGIN_BYTES).saturating_add(activations).saturating_add(transit)
}

/// Bytes the last stage holds for f32 logits: a row of the vocabulary for each of up to `batch_tokens` sequences.
pub fn logits_bytes(cfg: &ModelConfig, batch_tokens: usize) -> u64 {
    (batch_tokens as u64).saturating_mul(cfg.vocab_size as u64 * 4)
}

/// A process's resident memory, from `/proc/<pid>/status`: what the stage worker measures its peak with, the
/// benchmarks report and the memory tests check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProcessMemory {
    /// Resident bytes now (`VmRSS`), mapped file pages included.
    pub resident: u64,
    /// Peak resident bytes (`VmHWM`) since the start or the last reset (`5` written to `/proc/self/clear_refs`).
    pub peak: u64,
}

impl ProcessMemory {
    /// This process's; `None` where `/proc` is not available.
    pub fn of_self() -> Option<Self> {
        Self::read("/proc/self/status")
    }

    /// Process `pid`'s; `None` where it has gone or `/proc` is not available.
    pub fn of(pid: u32) -> Option<Self> {
        Self::read(&format!("/proc/{pid}/status"))
    }

    fn read(path: &str) -> Option<Self> {
        Self::parse(&std::fs::read_to_string(path).ok()?)
    }

    fn parse(text: &str) -> Option<Self> {
        let kib = |key: &str| -> Option<u64> {
            let line = text.lines().find(|l| l.starts_with(key))?;
            line[key.len()..].split_whitespace().next()?.parse::<u64>().ok()?.checked_mul(1024)
        };
        Some(ProcessMemory { resident: kib("VmRSS:")?, peak: kib("VmHWM:")? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transit_is_four_batches_of_f32_hidden_states() {
        assert_eq!(transit_bytes(512, 1024), 4 * 512 * 1024 * 4);
        assert_eq!(transit_bytes(usize::MAX, usize::MAX), u64::MAX);
    }

    #[test]
    fn status_fields_are_read_in_bytes() {
        let text = "Name:\tstage-worker\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n";
        assert_eq!(ProcessMemory::parse(text), Some(ProcessMemory { resident: 1 << 20, peak: 2 << 20 }));
        assert_eq!(ProcessMemory::parse("VmRSS: 1 kB\n"), None);
        let now = ProcessMemory::of_self().expect("/proc/self/status");
        assert!(now.resident > 0 && now.peak >= now.resident, "{now:?}");
        assert_eq!(ProcessMemory::of(std::process::id()).map(|m| m.resident > 0), Some(true));
        assert_eq!(ProcessMemory::of(u32::MAX), None);
    }
}
