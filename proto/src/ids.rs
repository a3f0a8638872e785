//! Newtypes for the ids that cross the wire, so a node id, a sequence id and a plan epoch cannot be confused.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Stable id of a stage worker node (the `node_id` string of the wire messages).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NodeId(String);

impl NodeId {
    /// Wraps a node id.
    pub fn new(id: impl Into<String>) -> Self {
        Self(id.into())
    }

    /// The id as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Unwraps the id, e.g. to put it in a wire message.
    pub fn into_inner(self) -> String {
        self.0
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<String> for NodeId {
    fn from(id: String) -> Self {
        Self(id)
    }
}

impl From<&str> for NodeId {
    fn from(id: &str) -> Self {
        Self(id.to_owned())
    }
}

impl From<NodeId> for String {
    fn from(id: NodeId) -> Self {
        id.0
    }
}

impl AsRef<str> for NodeId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

/// Id of one sequence (one generation request) across every stage's KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SeqId(pub u64);

impl fmt::Display for SeqId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "seq-{}", self.0)
    }
}

impl From<u64> for SeqId {
    fn from(id: u64) -> Self {
        Self(id)
    }
}

impl From<SeqId> for u64 {
    fn from(id: SeqId) -> Self {
        id.0
    }
}

/// Generation number of the coordinator's layer plan; it grows by one with each new plan, so stale messages
/// (and stale rejoins) can be recognised and refused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PlanEpoch(pub u64);

impl PlanEpoch {
    /// The epoch that follows this one.
    #[must_use]
    pub fn next(self) -> Self {
        Self(self.0.saturating_add(1))
    }
}

impl fmt::Display for PlanEpoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "epoch-{}", self.0)
    }
}

impl From<u64> for PlanEpoch {
    fn from(epoch: u64) -> Self {
        Self(epoch)
    }
}

impl From<PlanEpoch> for u64 {
    fn from(epoch: PlanEpoch) -> Self {
        epoch.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_and_serde_are_transparent() -> Result<(), serde_json::Error> {
        let node = NodeId::new("gpu-a");
        assert_eq!(node.to_string(), "gpu-a");
        assert_eq!(serde_json::to_string(&node)?, "\"gpu-a\"");
        assert_eq!(serde_json::from_str::<NodeId>("\"gpu-a\"")?, node);

        assert_eq!(SeqId(7).to_string(), "seq-7");
        assert_eq!(serde_json::to_string(&SeqId(7))?, "7");
        assert_eq!(serde_json::from_str::<SeqId>("7")?, SeqId(7));

        assert_eq!(PlanEpoch(3).to_string(), "epoch-3");
        assert_eq!(serde_json::to_string(&PlanEpoch(3))?, "3");
        assert_eq!(serde_json::from_str::<PlanEpoch>("3")?, PlanEpoch(3));
        Ok(())
    }

    #[test]
    fn epochs_order_and_advance() {
        assert!(PlanEpoch(1) < PlanEpoch(2));
        assert_eq!(PlanEpoch(1).next(), PlanEpoch(2));
        assert_eq!(PlanEpoch(u64::MAX).next(), PlanEpoch(u64::MAX));
    }
}
