//! Layer ranges and counts as the wire carries them: `uint32` fields (`layer_start`/`layer_end` of
//! `PlanStage`, `NodeStatus` and `StageStatus`, `offloaded_layers`, ...) where the code holds `usize`. Into
//! the wire only through these checked conversions, so a value that does not fit is an error, never a
//! silently saturated number.

use std::ops::Range;

use crate::error::{ProtoError, Result};

/// A non-empty layer range `start..end` in the wire's integer type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct WireLayers {
    /// First layer (inclusive): a message's `layer_start`.
    pub start: u32,
    /// One past the last layer: a message's `layer_end`.
    pub end: u32,
}

impl TryFrom<Range<usize>> for WireLayers {
    type Error = ProtoError;

    fn try_from(r: Range<usize>) -> Result<Self> {
        if r.start >= r.end {
            return Err(ProtoError::WireValue {
                what: "layer range",
                value: format!("{}..{}", r.start, r.end),
                reason: "it is empty",
            });
        }
        Ok(WireLayers { start: wire_u32("layer index", r.start)?, end: wire_u32("layer index", r.end)? })
    }
}

impl From<WireLayers> for Range<u32> {
    fn from(w: WireLayers) -> Self {
        w.start..w.end
    }
}

/// A duration as the wire's `uint64` of whole microseconds (`StageTiming`, `Usage`), saturating.
pub fn wire_micros(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// `n` (a layer index or count, named by `what` in the error) as a wire `uint32`.
pub fn wire_u32(what: &'static str, n: usize) -> Result<u32> {
    u32::try_from(n).map_err(|_| ProtoError::WireValue { what, value: n.to_string(), reason: "it exceeds u32" })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_go_on_the_wire_only_when_they_fit_and_hold_a_layer() -> Result<()> {
        assert_eq!(WireLayers::try_from(2..5)?, WireLayers { start: 2, end: 5 });
        assert_eq!(Range::<u32>::from(WireLayers::try_from(0..1)?), 0..1);
        assert!(WireLayers::try_from(3..3).is_err());
        let (hi, lo) = (4, 1);
        assert!(WireLayers::try_from(hi..lo).is_err(), "a reversed range is refused");
        let max = u32::MAX as usize;
        assert_eq!(WireLayers::try_from(0..max)?.end, u32::MAX);
        assert_eq!(wire_u32("n", max)?, u32::MAX);
        if let Some(over) = max.checked_add(1) {
            let err = WireLayers::try_from(0..over).err().map(|e| e.to_string()).unwrap_or_default();
            assert_eq!(err, format!("layer index {over} cannot go on the wire: it exceeds u32"));
            assert!(wire_u32("n", over).is_err());
        }
        Ok(())
    }
}
