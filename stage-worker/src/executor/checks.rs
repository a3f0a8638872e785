//! A batch checked against the stage before anything runs: its chunks against the KV cache (positions, cached
//! prefixes, the context length) and its token ids against the chunks, so a bad batch is refused and changes
//! nothing.

use std::collections::HashSet;

use strata_engine::backend::Backend;
use strata_engine::model::SeqChunk;
use strata_proto::{ServiceError, pb};

use super::Executor;
use crate::error::engine_to_service;

impl<B: Backend> Executor<B> {
    /// Checks a batch against the KV cache before anything is reserved, so a bad batch changes nothing.
    pub(super) fn check_chunks(&self, batch: &pb::ForwardRequest) -> Result<(Vec<SeqChunk>, usize), ServiceError> {
        if batch.chunks.is_empty() {
            return Err(ServiceError::invalid_argument("batch has no chunks"));
        }
        let context = self.model.config().max_position_embeddings;
        let mut seen = HashSet::with_capacity(batch.chunks.len());
        let mut chunks = Vec::with_capacity(batch.chunks.len());
        let mut n_tokens = 0usize;
        for c in &batch.chunks {
            let (seq, start, len) = (c.seq_id, c.start_pos as usize, c.len as usize);
            if len == 0 {
                return Err(ServiceError::invalid_argument(format!("sequence {seq}: chunk has no tokens")));
            }
            if !seen.insert(seq) {
                return Err(ServiceError::invalid_argument(format!("sequence {seq} appears twice in the batch")));
            }
            if start + len > context {
                return Err(ServiceError::invalid_argument(format!(
                    "sequence {seq}: positions up to {} exceed the context length {context}",
                    start + len
                )));
            }
            let known = self.kv.table(seq).is_some();
            if !c.cached_blocks.is_empty() {
                self.check_cached(c, known)?;
            }
            let cached = if known { self.kv.seq_len(seq) } else { c.cached_blocks.len() * self.kv.block_size() };
            if start > 0 && !known && c.cached_blocks.is_empty() {
                return Err(ServiceError::not_found(format!(
                    "unknown sequence {seq}: chunk starts at position {start} but the sequence has no KV cache here"
                )));
            }
            if start != cached {
                return Err(ServiceError::invalid_argument(format!(
                    "sequence {seq}: chunk starts at position {start} but {cached} positions are cached"
                )));
            }
            n_tokens += len;
            chunks.push(SeqChunk { seq_id: seq, start_pos: start, len });
        }
        let needs_ids = self.model.is_first() || self.model.is_last();
        if needs_ids && batch.token_ids.len() != n_tokens {
            return Err(ServiceError::invalid_argument(format!(
                "{} token ids for {n_tokens} tokens in the chunks",
                batch.token_ids.len()
            )));
        }
        Ok((chunks, n_tokens))
    }

    /// A chunk that starts a sequence on cached blocks: the sequence is new here and every block is cached.
    fn check_cached(&self, c: &pb::SeqChunk, known: bool) -> Result<(), ServiceError> {
        let seq = c.seq_id;
        if known || c.start_pos as usize != c.cached_blocks.len() * self.kv.block_size() {
            return Err(ServiceError::invalid_argument(format!(
                "sequence {seq}: {} cached blocks of {} tokens start a new sequence at their end, not at position {}",
                c.cached_blocks.len(),
                self.kv.block_size(),
                c.start_pos
            )));
        }
        if c.cached_token_ids.len() != c.start_pos as usize {
            return Err(ServiceError::invalid_argument(format!(
                "sequence {seq}: {} cached token ids for {} cached positions",
                c.cached_token_ids.len(),
                c.start_pos
            )));
        }
        if !self.kv.has_cached(&c.cached_blocks) {
            let err = strata_engine::Error::PrefixCache(format!("sequence {seq} starts on blocks not cached here"));
            return Err(engine_to_service(&err));
        }
        Ok(())
    }
}
