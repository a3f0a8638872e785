//! Weight offload on the GPU: offloaded matrices live in pinned host memory and are copied, one layer at a
//! time, into one of two device staging slots on the copy stream. While the compute stream runs layer `i` from
//! one slot, layer `i + 1` is copied into the other. Events order the two streams:
//! - `filled[s]`, recorded on the copy stream after a layer's copies, is waited on by the compute stream before
//!   the layer's first op;
//! - `released[s]`, recorded on the compute stream when slot `s` is about to be refilled (after every op that
//!   read the previous layer from it has been enqueued), is waited on by the copy stream before the copies.

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, CudaView, PinnedHostSlice};

use super::dev_err;
use crate::{Error, Result};

/// Byte alignment of each matrix inside a slot (cuBLAS and the 128-bit kernel loads want at least 16).
pub const SLOT_ALIGN: usize = 256;

/// An offloaded matrix's host copy and its identity.
pub struct HostWeight {
    /// Unique id within the backend.
    pub id: u64,
    /// The bytes, pinned so the copy engine reads them directly.
    pub bytes: PinnedHostSlice<u8>,
}

/// Where each matrix of a layer goes inside a slot: `(offset, len)` per matrix, and the bytes needed.
pub fn slot_layout(lens: &[usize]) -> (Vec<(usize, usize)>, usize) {
    let mut at = 0;
    let places = lens
        .iter()
        .map(|&len| {
            let place = (at, len);
            at += len.div_ceil(SLOT_ALIGN) * SLOT_ALIGN;
            place
        })
        .collect();
    (places, at)
}

struct Slot {
    buf: Option<CudaSlice<u8>>,
    /// Matrix ids held, with their `(offset, len)`.
    holds: Vec<(u64, usize, usize)>,
    filled: CudaEvent,
    released: CudaEvent,
    /// When the slot was last filled or used (to pick the one to refill).
    stamp: u64,
}

/// The two staging slots and the streams they sit between.
pub struct Staging {
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    slots: [Slot; 2],
    clock: u64,
}

impl Staging {
    /// Two empty slots; buffers are allocated on first use, sized to the first layer staged.
    pub fn new(compute: Arc<CudaStream>, copy: Arc<CudaStream>) -> Result<Self> {
        let ctx = compute.context().clone();
        let slot = || -> Result<Slot> {
            Ok(Slot {
                buf: None,
                holds: Vec::new(),
                filled: ctx.new_event(None).map_err(dev_err("creating a staging event"))?,
                released: ctx.new_event(None).map_err(dev_err("creating a staging event"))?,
                stamp: 0,
            })
        };
        Ok(Staging { slots: [slot()?, slot()?], compute, copy, clock: 0 })
    }

    fn find(&self, ids: &[u64]) -> Option<usize> {
        (0..2).find(|&s| {
            let held = &self.slots[s].holds;
            held.len() == ids.len() && held.iter().zip(ids).all(|((h, _, _), id)| h == id)
        })
    }

    /// Makes `now` readable by the compute stream's next ops, and starts copying `next` into the other slot.
    pub fn stage(&mut self, now: &[&HostWeight], next: &[&HostWeight]) -> Result<()> {
        let now_ids: Vec<u64> = now.iter().map(|w| w.id).collect();
        let next_ids: Vec<u64> = next.iter().map(|w| w.id).collect();
        let mut current = None;
        if !now.is_empty() {
            let s = match self.find(&now_ids) {
                Some(s) => s,
                None => {
                    // Refill the slot that does not hold `next` (or the older one).
                    let victim = self.victim(&next_ids);
                    self.fill(victim, now)?;
                    victim
                }
            };
            self.compute.wait(&self.slots[s].filled).map_err(dev_err("waiting for a weight copy"))?;
            self.clock += 1;
            self.slots[s].stamp = self.clock;
            current = Some(s);
        }
        if !next.is_empty() && next_ids != now_ids && self.find(&next_ids).is_none() {
            let victim = match current {
                Some(s) => 1 - s,
                None => self.victim(&[]),
            };
            self.fill(victim, next)?;
        }
        Ok(())
    }

    fn victim(&self, keep: &[u64]) -> usize {
        match self.find(keep) {
            Some(s) if !keep.is_empty() => 1 - s,
            _ => usize::from(self.slots[1].stamp < self.slots[0].stamp),
        }
    }

    /// Enqueues the copies of `weights` into slot `s` on the copy stream, after the compute stream is done
    /// with what the slot held.
    fn fill(&mut self, s: usize, weights: &[&HostWeight]) -> Result<()> {
        let lens: Vec<usize> = weights.iter().map(|w| w.bytes.len()).collect();
        let (places, need) = slot_layout(&lens);
        if self.slots[s].buf.as_ref().is_none_or(|b| b.len() < need) {
            // Growing: let both streams drain so no copy or op still touches the old buffer, then allocate on
            // the compute stream and wait for it before the copy stream writes into it.
            self.compute.synchronize().map_err(dev_err("synchronizing before growing a staging slot"))?;
            self.copy.synchronize().map_err(dev_err("synchronizing before growing a staging slot"))?;
            self.slots[s].buf = None;
            self.slots[s].holds.clear();
            let buf = self.compute.alloc_zeros::<u8>(need.max(1)).map_err(dev_err("allocating a staging slot"))?;
            self.compute.synchronize().map_err(dev_err("allocating a staging slot"))?;
            self.slots[s].buf = Some(buf);
        }
        let slot = &mut self.slots[s];
        let buf = slot.buf.as_mut().ok_or_else(|| Error::Device("staging slot has no buffer".into()))?;
        slot.released.record(&self.compute).map_err(dev_err("recording a staging event"))?;
        self.copy.wait(&slot.released).map_err(dev_err("ordering a weight copy"))?;
        slot.holds.clear();
        for (w, &(off, len)) in weights.iter().zip(&places) {
            let mut dst = buf.slice_mut(off..off + len);
            self.copy.memcpy_htod(&w.bytes, &mut dst).map_err(dev_err("copying offloaded weights"))?;
            slot.holds.push((w.id, off, len));
        }
        slot.filled.record(&self.copy).map_err(dev_err("recording a staging event"))?;
        self.clock += 1;
        slot.stamp = self.clock;
        Ok(())
    }

    /// The device copy of matrix `id`, if a slot holds it.
    pub fn view(&self, id: u64) -> Option<CudaView<'_, u8>> {
        self.slots.iter().find_map(|slot| {
            let &(_, off, len) = slot.holds.iter().find(|(h, _, _)| *h == id)?;
            slot.buf.as_ref().map(|b| b.slice(off..off + len))
        })
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        // Copies may still read pinned memory or write a slot that is about to be freed.
        if let Err(e) = self.copy.synchronize().and(self.compute.synchronize()) {
            tracing::warn!(error = %e, "synchronizing the staging streams on drop failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_aligns_every_matrix() {
        let (places, need) = slot_layout(&[100, 256, 1]);
        assert_eq!(places, [(0, 100), (256, 256), (512, 1)]);
        assert_eq!(need, 768);
        assert_eq!(slot_layout(&[]), (vec![], 0));
    }
}
