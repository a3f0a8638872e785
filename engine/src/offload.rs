//! Weight offload planning: which of a stage's layers stay in device memory and which stay in a slower tier and
//! are brought in one layer at a time: on a GPU, pinned host memory streamed to the device; on the CPU, the
//! memory-mapped model file (or a spill file for converted weights) paged in on use and out after. Pure
//! arithmetic, so it is tested on any machine.
//!
//! The first layers of the stage stay resident; the rest are offloaded. Offloaded layers are double-buffered on
//! the device (one staging slot computes while the next layer is copied into the other), so offloading costs
//! two staging slots of the largest offloaded layer on top of the resident layers.

use crate::{Error, Result};

/// Device memory a stage may use, and what must fit besides its layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffloadBudget {
    /// Device bytes the stage may use in total (`--gpu-memory-limit`).
    pub limit_bytes: usize,
    /// Bytes reserved for the KV cache and activation workspace.
    pub reserve_bytes: usize,
}

/// How a stage's layers are placed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OffloadPlan {
    /// Layers (counted from the stage's first) kept in device memory.
    pub resident: usize,
    /// Layers after those, kept in host memory and streamed in per layer.
    pub offloaded: usize,
    /// Device bytes of the two staging slots (0 without offload).
    pub staging_bytes: usize,
}

impl OffloadPlan {
    /// Everything resident.
    pub fn all_resident(layers: usize) -> Self {
        OffloadPlan { resident: layers, offloaded: 0, staging_bytes: 0 }
    }

    /// Whether stage layer `i` (0-based within the stage) is offloaded.
    pub fn is_offloaded(&self, i: usize) -> bool {
        i >= self.resident
    }
}

/// Splits layers of `layer_bytes[i]` bytes each between memory and the slower tier so that the resident layers,
/// the staging slots, `fixed_bytes` (embeddings, head, norms) and the budget's reserve fit in its limit, keeping at
/// most `max_resident` layers resident (`--resident-layers`). Without a budget or a cap every layer is resident.
pub fn plan_offload(
    layer_bytes: &[usize],
    fixed_bytes: usize,
    budget: Option<OffloadBudget>,
    max_resident: Option<usize>,
) -> Result<OffloadPlan> {
    let n = layer_bytes.len();
    let capped = |plan: OffloadPlan| match max_resident {
        Some(cap) if cap < plan.resident => with_resident(layer_bytes, cap),
        _ => plan,
    };
    let Some(b) = budget else {
        return Ok(capped(OffloadPlan::all_resident(n)));
    };
    let overhead = fixed_bytes.saturating_add(b.reserve_bytes);
    let Some(avail) = b.limit_bytes.checked_sub(overhead) else {
        return Err(Error::Config(format!(
            "memory limit of {} bytes is below the {overhead} bytes this stage needs besides its layers \
             ({fixed_bytes} of embeddings/head/norms, {} of KV cache and workspace)",
            b.limit_bytes, b.reserve_bytes
        )));
    };
    let total: usize = layer_bytes.iter().sum();
    if total <= avail {
        return Ok(capped(OffloadPlan::all_resident(n)));
    }
    // Keep the longest prefix that leaves room for two slots of the largest layer after it.
    let mut best = None;
    let mut prefix = 0usize;
    for resident in 0..n {
        let plan = with_resident(layer_bytes, resident);
        if prefix.saturating_add(plan.staging_bytes) <= avail {
            best = Some(plan);
        }
        prefix = prefix.saturating_add(layer_bytes[resident]);
    }
    best.map(capped).ok_or_else(|| {
        let slot = layer_bytes.iter().copied().max().unwrap_or(0);
        Error::Config(format!(
            "memory limit of {} bytes leaves {avail} bytes for layers, less than the {} bytes of two staging \
             slots needed to stream layers of {slot} bytes",
            b.limit_bytes,
            slot.saturating_mul(2)
        ))
    })
}

/// The first `resident` layers resident, the rest offloaded through two slots of the largest of them.
fn with_resident(layer_bytes: &[usize], resident: usize) -> OffloadPlan {
    let resident = resident.min(layer_bytes.len());
    let offloaded = &layer_bytes[resident..];
    if offloaded.is_empty() {
        return OffloadPlan::all_resident(resident);
    }
    let slot = offloaded.iter().copied().max().unwrap_or(0);
    OffloadPlan { resident, offloaded: offloaded.len(), staging_bytes: slot.saturating_mul(2) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(limit: usize, reserve: usize) -> Option<OffloadBudget> {
        Some(OffloadBudget { limit_bytes: limit, reserve_bytes: reserve })
    }

    #[test]
    fn no_budget_or_enough_room_keeps_everything_resident() -> Result<()> {
        assert_eq!(plan_offload(&[10; 4], 5, None, None)?, OffloadPlan::all_resident(4));
        assert_eq!(plan_offload(&[10; 4], 5, budget(60, 15), None)?, OffloadPlan::all_resident(4));
        Ok(())
    }

    #[test]
    fn offloads_the_tail_and_pays_for_two_slots() -> Result<()> {
        // 8 layers of 10, fixed 5, reserve 15: 100 - 20 = 80 bytes for layers, exactly the total.
        assert_eq!(plan_offload(&[10; 8], 5, budget(100, 15), None)?, OffloadPlan::all_resident(8));
        // 79 available: 5 resident (50) + 2 slots (20) = 70 fits, 6 resident + 20 = 80 does not.
        let p = plan_offload(&[10; 8], 5, budget(99, 15), None)?;
        assert_eq!(p, OffloadPlan { resident: 5, offloaded: 3, staging_bytes: 20 });
        assert!(!p.is_offloaded(4) && p.is_offloaded(5));
        Ok(())
    }

    #[test]
    fn slots_are_sized_by_the_largest_offloaded_layer() -> Result<()> {
        // Layer 0 is big; keeping it resident means the slots only need the small layers' size.
        let p = plan_offload(&[50, 10, 10, 10], 0, budget(75, 0), None)?;
        assert_eq!(p, OffloadPlan { resident: 1, offloaded: 3, staging_bytes: 20 });
        // Too little for the big layer's slots while it is offloaded, and for it plus the small slots.
        assert!(plan_offload(&[50, 10, 10, 10], 0, budget(60, 0), None).is_err());
        // Everything offloaded when even the first layer does not fit beside its slots.
        let p = plan_offload(&[10, 10, 10], 0, budget(25, 0), None)?;
        assert_eq!(p, OffloadPlan { resident: 0, offloaded: 3, staging_bytes: 20 });
        Ok(())
    }

    #[test]
    fn impossible_budgets_are_errors_that_say_why() {
        let e = plan_offload(&[10; 4], 50, budget(40, 0), None).expect_err("below fixed");
        assert!(e.to_string().contains("besides its layers"), "{e}");
        let e = plan_offload(&[10; 4], 0, budget(19, 0), None).expect_err("no room for two slots");
        assert!(e.to_string().contains("two staging slots"), "{e}");
    }

    #[test]
    fn resident_layers_cap_what_stays_resident() -> Result<()> {
        // Without a budget the cap alone decides; slots fit the largest offloaded layer.
        let p = plan_offload(&[10, 30, 20], 0, None, Some(1))?;
        assert_eq!(p, OffloadPlan { resident: 1, offloaded: 2, staging_bytes: 60 });
        assert_eq!(plan_offload(&[10; 3], 0, None, Some(5))?, OffloadPlan::all_resident(3));
        // With a budget, the smaller of the two.
        assert_eq!(plan_offload(&[10; 8], 5, budget(99, 15), Some(7))?.resident, 5);
        assert_eq!(plan_offload(&[10; 8], 5, budget(99, 15), Some(2))?.resident, 2);
        assert_eq!(plan_offload(&[10; 8], 5, budget(100, 15), Some(0))?.offloaded, 8);
        Ok(())
    }
}
