//! The half-open range of transformer layers a stage holds, written `START..END`: parsed once here, and
//! built from other integer types only through checked conversions.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::Error;

/// Layers `start..end` of a model; never empty when built through [`LayerRange::new`], parsing or serde.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct LayerRange {
    /// First layer (inclusive).
    pub start: usize,
    /// One past the last layer.
    pub end: usize,
}

impl LayerRange {
    /// The range `start..end`; an error when it is empty.
    pub fn new(start: usize, end: usize) -> Result<Self, Error> {
        if start >= end {
            return Err(Error::InvalidValue {
                what: "layer range",
                value: format!("{start}..{end}"),
                expected: "a non-empty range START..END with START < END",
            });
        }
        Ok(LayerRange { start, end })
    }

    /// The range as `start..end`.
    pub fn to_range(self) -> Range<usize> {
        self.start..self.end
    }

    /// Number of layers.
    pub fn len(self) -> usize {
        self.end.saturating_sub(self.start)
    }

    /// Whether the range holds no layer (only possible for a value built field by field).
    pub fn is_empty(self) -> bool {
        self.start >= self.end
    }
}

impl TryFrom<Range<usize>> for LayerRange {
    type Error = Error;

    fn try_from(r: Range<usize>) -> Result<Self, Error> {
        LayerRange::new(r.start, r.end)
    }
}

impl TryFrom<Range<u32>> for LayerRange {
    type Error = Error;

    /// From the wire's `layer_start`/`layer_end` fields.
    fn try_from(r: Range<u32>) -> Result<Self, Error> {
        let index = |n: u32| {
            usize::try_from(n).map_err(|_| Error::InvalidValue {
                what: "layer index",
                value: n.to_string(),
                expected: "an index this platform can address",
            })
        };
        LayerRange::new(index(r.start)?, index(r.end)?)
    }
}

impl FromStr for LayerRange {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Error> {
        let bad = || Error::InvalidValue { what: "layer range", value: s.into(), expected: "START..END (e.g. 0..12)" };
        let (a, b) = s.trim().split_once("..").ok_or_else(bad)?;
        let start = a.trim().parse().map_err(|_| bad())?;
        let end = b.trim().parse().map_err(|_| bad())?;
        LayerRange::new(start, end)
    }
}

impl TryFrom<String> for LayerRange {
    type Error = Error;

    fn try_from(s: String) -> Result<Self, Error> {
        s.parse()
    }
}

impl From<LayerRange> for String {
    fn from(r: LayerRange) -> Self {
        r.to_string()
    }
}

impl fmt::Display for LayerRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}..{}", self.start, self.end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_ranges_parse_print_and_serialize() -> Result<(), Box<dyn std::error::Error>> {
        let r: LayerRange = " 2 .. 5".parse()?;
        assert_eq!((r.start, r.end, r.len(), r.to_range()), (2, 5, 3, 2..5));
        assert_eq!(r.to_string(), "2..5");
        assert_eq!(serde_json::to_string(&r)?, "\"2..5\"");
        assert_eq!(serde_json::from_str::<LayerRange>("\"2..5\"")?, r);
        for bad in ["5..2", "3..3", "3", "a..b", "-1..2", ""] {
            assert!(bad.parse::<LayerRange>().is_err(), "{bad:?}");
        }
        assert!(serde_json::from_str::<LayerRange>("\"4..1\"").is_err());
        let err = "3".parse::<LayerRange>().err().map(|e| e.to_string()).unwrap_or_default();
        assert_eq!(err, "invalid layer range \"3\": expected START..END (e.g. 0..12)");
        Ok(())
    }

    #[test]
    fn conversions_refuse_empty_ranges() -> Result<(), Error> {
        assert_eq!(LayerRange::try_from(1..4usize)?, LayerRange { start: 1, end: 4 });
        assert_eq!(LayerRange::try_from(0..u32::MAX)?.end, u32::MAX as usize);
        assert!(LayerRange::try_from(4..4usize).is_err());
        let (hi, lo) = (7u32, 2u32);
        assert!(LayerRange::try_from(hi..lo).is_err(), "a reversed range is refused");
        assert!(LayerRange { start: 3, end: 3 }.is_empty());
        Ok(())
    }
}
