//! How the actor gets the pipeline going again: a batch overdue, the stages failing, the scheduler stopped with
//! work left (the watchdog), and the recovery timeout after which waiting work fails.

use std::time::{Duration, Instant};

use strata_proto::ServiceError;

use super::Actor;
use crate::metrics::Reason;
use crate::pipeline::scheduler::StallCause;

/// How long the scheduler may hold work with nothing in flight and no release out before the actor recovers
/// ([`Actor::check_stopped`]). Nothing legitimate waits so; the grace only keeps a recovery from racing one.
pub(super) const STOPPED_AFTER: Duration = Duration::from_secs(5);

impl Actor {
    /// A batch unanswered for the batch timeout means a stage hangs (or its link does): treat it as a failure.
    pub(super) fn check_overdue(&mut self, now: Instant) {
        let Some(sent) = self.scheduler.oldest_batch_sent() else { return };
        if now.saturating_duration_since(sent) >= self.timeouts.batch {
            let error = ServiceError::deadline_exceeded(format!(
                "a micro-batch went unanswered for {:?} (--batch-timeout-ms)",
                self.timeouts.batch
            ));
            let effects = self.scheduler.stall(&error, StallCause::BatchOverdue);
            self.apply(effects);
        }
    }

    /// The scheduler's watchdog: work left with nothing in flight and no release out means no event will ever
    /// move it (a scheduler bug; one showed only as clients timing out). Past [`STOPPED_AFTER`] the actor says
    /// so with the gauges and recovers as from a stage failure: every sequence is requeued, the stream is
    /// dropped, and the reconnection brings a fresh budget and an empty prefix cache.
    pub(super) fn check_stopped(&mut self, now: Instant) {
        if !self.scheduler.stopped(self.releasing > 0) {
            self.stopped_since = None;
            return;
        }
        let since = *self.stopped_since.get_or_insert(now);
        if now.saturating_duration_since(since) < STOPPED_AFTER {
            return;
        }
        self.stopped_since = None;
        let g = self.scheduler.gauges();
        tracing::error!(
            running = g.running,
            waiting = g.waiting,
            kv_total = g.kv_total,
            kv_free = g.kv_free,
            kv_cached = g.kv_cached,
            "the scheduler holds work with nothing in flight and no release out (a bug): recomputing every \
             sequence through a new connection"
        );
        let error = ServiceError::internal(format!("the scheduler stopped with work left for {STOPPED_AFTER:?}"));
        let effects = self.scheduler.stall(&error, StallCause::SchedulerStopped);
        self.apply(effects);
    }

    /// Work that found no pipeline within the recovery timeout fails.
    pub(super) fn check_recovery(&mut self, now: Instant) {
        let Some(since) = self.stalled_since else { return };
        if now.saturating_duration_since(since) < self.timeouts.recovery {
            return;
        }
        let why = self.last_error.as_ref().map_or_else(|| "no plan".to_owned(), |e| e.message.clone());
        let error = ServiceError::unavailable(format!(
            "no stage pipeline to serve through for {:?} (--recovery-timeout-ms): {why}",
            self.timeouts.recovery
        ));
        tracing::error!(error = %error, "giving up on the waiting requests");
        self.fail_everything(error);
        self.stalled_since = None;
    }

    pub(super) fn fail_everything(&mut self, error: ServiceError) {
        let mut effects = self.scheduler.fail_all(&error);
        effects.extend(self.scheduler.reap());
        self.apply(effects);
        for p in self.pending.drain(..) {
            let _ = p.reply.send(Err(error.clone()));
        }
    }

    /// The stages failed (or the scheduler stopped): count it by `cause`, drop the stream to stage 0 and probe
    /// the stages again at once.
    pub(super) fn stalled(&mut self, error: ServiceError, cause: StallCause) {
        self.metrics.stage_failures.get_or_create(&Reason { reason: cause.label() }).inc();
        self.stream = None;
        self.last_error = Some(error);
        self.retry_at = None;
        self.stalled_since.get_or_insert_with(Instant::now);
    }
}
