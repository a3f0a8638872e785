//! What a stage holds besides its weights, KV cache and measured peak, counted the same way by the stage worker
//! (which measures the rest after loading) and by placement (which estimates it before).

/// Bytes a stage keeps free besides what it accounts for: allocator slack, gRPC buffers and tracing.
pub const MARGIN_BYTES: u64 = 16 << 20;

/// Hidden-state messages a stage may hold at once besides the batch it computes (queued on the way in, encoded
/// on the way out).
const MESSAGES_IN_TRANSIT: u64 = 4;

/// Bytes of f32 hidden states in transit for micro-batches of `batch_tokens` tokens of `hidden` features.
pub fn transit_bytes(batch_tokens: usize, hidden: usize) -> u64 {
    (batch_tokens as u64).saturating_mul(hidden as u64).saturating_mul(4).saturating_mul(MESSAGES_IN_TRANSIT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transit_is_four_batches_of_f32_hidden_states() {
        assert_eq!(transit_bytes(512, 1024), 4 * 512 * 1024 * 4);
        assert_eq!(transit_bytes(usize::MAX, usize::MAX), u64::MAX);
    }
}
