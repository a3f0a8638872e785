//! What the scheduler tells the actor to do, and the names it uses for requests and requeues.

use std::time::Duration;

use strata_proto::{ErrorCode, ServiceError, pb};

use crate::pipeline::StepTiming;

/// A request for as long as it lives, across recomputes (which change its sequence id on the wire). Ordered by
/// admission: the oldest runs first and is preempted last.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(in crate::pipeline) struct RequestId(pub(super) u64);

/// Why a sequence goes back to the queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::pipeline) enum Requeue {
    /// The KV cache is full (a preemption).
    KvFull,
    /// A stage refused its batch for want of KV (it holds less than it reported).
    StageOutOfKv,
    /// The plan changed under it.
    PlanChanged,
    /// The stages failed (a batch error, a broken or hung stream) while it ran: its KV may be gone.
    StageFailed,
}

/// Why the stages were given up on (every sequence requeued): the `reason` of `strata_stage_failures_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::pipeline) enum StallCause {
    /// A stage, or the stream to one, is gone.
    Unavailable,
    /// A stage serves another plan epoch or coordinator term.
    StalePlan,
    /// A micro-batch went unanswered for the batch timeout.
    BatchOverdue,
    /// The scheduler held work with nothing in flight (its watchdog, `pipeline::actor::recovery`).
    SchedulerStopped,
}

impl StallCause {
    /// The cause a stage fault's error code names.
    pub(in crate::pipeline) fn of(code: ErrorCode) -> Self {
        match code {
            ErrorCode::DeadlineExceeded => StallCause::BatchOverdue,
            ErrorCode::FailedPrecondition => StallCause::StalePlan,
            _ => StallCause::Unavailable,
        }
    }

    /// The metric label.
    pub(in crate::pipeline) fn label(self) -> &'static str {
        match self {
            StallCause::Unavailable => "unavailable",
            StallCause::StalePlan => "stale_plan",
            StallCause::BatchOverdue => "batch_overdue",
            StallCause::SchedulerStopped => "scheduler_stopped",
        }
    }
}

/// What the actor must do after an input, in order.
#[derive(Debug, Clone, PartialEq)]
pub(in crate::pipeline) enum Effect {
    /// Send this micro-batch on the `Forward` stream.
    Send(pb::ForwardRequest),
    /// Free `seq_ids` on every stage; then report `blocks` of budget `generation` with `Scheduler::released`.
    Release {
        /// Wire sequence ids.
        seq_ids: Vec<u64>,
        /// Blocks they held in the budget.
        blocks: usize,
        /// Cached blocks they used (prefix caching): they lose a reference once the release returns.
        cached: Vec<u64>,
        /// The budget they belong to: a release of an older budget (plan) is ignored.
        generation: u64,
    },
    /// A token was sampled for `req`: hand it to the request's output, and call `Scheduler::finish` if that
    /// ends the sequence. Until then the sequence continues from this token.
    Token {
        /// The request.
        req: RequestId,
        /// The token as the last stage sampled it.
        token: pb::SampledToken,
        /// The request's step timing so far (for its final event).
        timing: StepTiming,
    },
    /// `req` failed; it is forgotten once [`Effect::Ended`] follows.
    Fail {
        /// The request.
        req: RequestId,
        /// What went wrong.
        error: ServiceError,
    },
    /// `req` went back to the queue.
    Requeued {
        /// The request.
        req: RequestId,
        /// Why.
        why: Requeue,
    },
    /// A micro-batch came back after `elapsed`.
    BatchReturned {
        /// Send-to-response time.
        elapsed: Duration,
        /// Each stage's compute time for it, as the stages reported.
        stages: Vec<pb::StageTiming>,
    },
    /// `req`'s first chunk went out: it left the queue.
    Started {
        /// The request.
        req: RequestId,
    },
    /// The stages failed: every sequence went back to the queue and the budget is gone. Drop the `Forward`
    /// stream and connect again (or wait for a new plan); nothing is scheduled until a new budget is set.
    Stalled {
        /// What failed.
        error: ServiceError,
        /// Why, for the metric.
        cause: StallCause,
    },
    /// `req` is forgotten: it ended (or its caller left) and nothing of it is in flight.
    Ended {
        /// The request.
        req: RequestId,
    },
}

/// Queue depth and KV use, for the gauges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::pipeline) struct Gauges {
    /// Sequences holding KV.
    pub(in crate::pipeline) running: i64,
    /// Sequences queued.
    pub(in crate::pipeline) waiting: i64,
    /// Blocks of the tightest stage (0 without a budget).
    pub(in crate::pipeline) kv_total: usize,
    /// Of those, blocks neither held nor being released (cached blocks no sequence uses count as free).
    pub(in crate::pipeline) kv_free: usize,
    /// Blocks in the prefix cache.
    pub(in crate::pipeline) kv_cached: usize,
    /// Prefix-cache lookups since the start.
    pub(in crate::pipeline) prefix: crate::pipeline::prefix_cache::PrefixStats,
}
