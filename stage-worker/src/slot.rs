//! What a worker serves right now: the loaded stage (replaceable between batches) and the highest coordinator
//! term seen, which outlives any one stage. Shared by the gRPC service, the health monitor and registration.

use std::sync::Arc;

use tokio::sync::watch;

use crate::downstream::Downstream;
use crate::executor::ExecutorHandle;
use crate::io_runtime::IoRuntime;
use crate::term::TermFence;

/// A loaded stage as the service runs it: its executor, its link to the next stage and its place in the plan.
pub struct ActiveStage {
    /// Runs the stage's layers.
    pub executor: ExecutorHandle,
    /// The next stage; `None` on the last stage.
    pub downstream: Option<Downstream>,
    /// Position in the pipeline, reported in `StageTiming`.
    pub stage_index: u32,
    /// Plan epoch served: batches of any other epoch are refused with `FAILED_PRECONDITION`. `None`: no
    /// check (a static stage started without an epoch), reported as 0.
    pub plan_epoch: Option<u64>,
}

/// The stage a service serves now, replaceable while it serves: a batch runs on the stage current when it
/// arrives and keeps it (and its weights) alive until answered, so a swap never cuts a batch in half.
#[derive(Clone)]
pub struct StageSlot {
    stage: Arc<watch::Sender<Option<Arc<ActiveStage>>>>,
    term: TermFence,
    io: IoRuntime,
}

impl StageSlot {
    /// A slot with no stage yet, under `term`, served on `io`.
    pub fn empty(term: TermFence, io: IoRuntime) -> Self {
        StageSlot { stage: Arc::new(watch::Sender::new(None)), term, io }
    }

    /// A slot serving `stage`, under `term` and on `io` (those its executor was started with).
    pub fn new(stage: ActiveStage, term: TermFence, io: IoRuntime) -> Self {
        let slot = Self::empty(term, io);
        slot.replace(Some(stage));
        slot
    }

    /// The stage served now, if any.
    pub fn current(&self) -> Option<Arc<ActiveStage>> {
        self.stage.borrow().clone()
    }

    /// Serves `stage` from the next batch on (`None`: no layers; batches are refused). Returns the old stage,
    /// which stops once its in-flight batches are answered and the returned handle is dropped.
    pub fn replace(&self, stage: Option<ActiveStage>) -> Option<Arc<ActiveStage>> {
        self.stage.send_replace(stage.map(Arc::new))
    }

    /// Changes of the served stage.
    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<ActiveStage>>> {
        self.stage.subscribe()
    }

    /// The worker's network runtime, which serves its connections and which its executors drive.
    pub fn io(&self) -> &IoRuntime {
        &self.io
    }

    /// The worker's highest coordinator term.
    pub fn term(&self) -> &TermFence {
        &self.term
    }

    /// Raises the term (from a plan); if it rose, waits until the executor has freed the older terms'
    /// sequences (a release of nothing: releases run before any queued batch).
    pub async fn raise_term(&self, term: u64) {
        if !self.term.raise(term) {
            return;
        }
        tracing::info!(term, "new coordinator term from the plan");
        if let Some(stage) = self.current()
            && let Err(e) = stage.executor.release(Vec::new()).await
        {
            tracing::debug!(error = %e, "the stage's executor is gone; nothing to free");
        }
    }
}
