//! The highest coordinator leadership term a worker has seen (`ForwardRequest.term`, `ReleaseRequest.term`,
//! `Plan::term`). A request from an older term comes from a deposed leader and is refused; the first request or
//! plan of a newer term raises it, and the executor then frees every sequence of the older terms before it runs
//! anything else. One value per worker, shared by all its streams and kept across stage swaps. Term 0 (no
//! election) never raises anything, so a cluster without terms behaves as if they did not exist.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use strata_proto::ServiceError;

/// The highest term seen, shared by clones.
#[derive(Debug, Clone, Default)]
pub struct TermFence(Arc<AtomicU64>);

impl TermFence {
    /// The highest term seen so far (0: none).
    pub fn current(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }

    /// Raises the term to `term` if it is higher; returns whether it rose.
    pub fn raise(&self, term: u64) -> bool {
        self.0.fetch_max(term, Ordering::AcqRel) < term
    }

    /// Admits a request of `term`: raises the fence to it, or refuses it if a newer term has been seen.
    pub fn admit(&self, term: u64, what: fmt::Arguments<'_>) -> Result<(), ServiceError> {
        self.raise(term);
        self.check(term, what)
    }

    /// Refuses a request of `term` if a newer term has been seen (without raising anything).
    pub fn check(&self, term: u64, what: fmt::Arguments<'_>) -> Result<(), ServiceError> {
        let highest = self.current();
        if term < highest {
            return Err(ServiceError::failed_precondition(format!(
                "{what}: stale coordinator term {term} < {highest} (sent by a deposed leader)"
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use strata_proto::ErrorCode;

    use super::*;

    #[test]
    fn older_terms_are_refused_and_newer_ones_raise() {
        let fence = TermFence::default();
        assert!(fence.admit(0, format_args!("batch 1")).is_ok(), "term 0 with no election");
        assert!(fence.raise(5));
        assert!(!fence.raise(5) && !fence.raise(3));
        let err = fence.admit(4, format_args!("batch {}", 2)).err().map(|e| (e.code, e.message));
        assert_eq!(
            err,
            Some((
                ErrorCode::FailedPrecondition,
                "batch 2: stale coordinator term 4 < 5 (sent by a deposed leader)".into()
            ))
        );
        assert!(fence.clone().admit(7, format_args!("release")).is_ok());
        assert_eq!(fence.current(), 7, "clones share the value");
        assert!(fence.check(5, format_args!("batch 3")).is_err());
    }
}
