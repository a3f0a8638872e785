//! The actor's link to the stages of its plan: connection attempts in the background (with backoff after a
//! failure) whenever work waits without a stream, and what a finished attempt brings: the stream, the stages'
//! clients and KV budget, or suspects for the control loop.

use std::time::Instant;

use super::Actor;
use crate::pipeline::kv_budget::KvBudget;
use crate::pipeline::link::{Connected, Failed};
use crate::stage_client::{ForwardStream, TracedStageClient};

impl Actor {
    /// Starts a connection attempt when work waits without a pipeline and the backoff allows.
    pub(super) fn drive_link(&mut self, now: Instant) {
        let work = self.scheduler.has_waiting() || !self.pending.is_empty();
        if self.stream.is_some() || !work {
            if self.stream.is_some() {
                self.stalled_since = None;
            }
            return;
        }
        self.stalled_since.get_or_insert(now);
        if self.connecting
            || self.deposed.is_some()
            || self.plan.stages.is_empty()
            || self.retry_at.is_some_and(|t| t > now)
        {
            return;
        }
        self.attempt += 1;
        self.connecting = true;
        let (attempt, dialer, plan, tx) =
            (self.attempt, self.dialer.clone(), self.plan.clone(), self.attempts_tx.clone());
        tokio::spawn(async move {
            let result = dialer.connect(&plan).await;
            let _ = tx.send((attempt, result)).await;
        });
    }

    pub(super) fn on_attempt(&mut self, attempt: u64, result: Result<Connected, Failed>) {
        if attempt != self.attempt {
            return; // made for a plan that has been replaced since
        }
        self.connecting = false;
        match result {
            Ok(Connected { clients, stream, budget, memory }) => {
                tracing::info!(
                    epoch = %self.plan.epoch,
                    kv_blocks = budget.total(),
                    block_size = budget.block_size(),
                    "Forward stream to stage 0 open"
                );
                self.metrics.set_stage_memory(&memory);
                self.on_connected(clients, stream, budget);
            }
            Err(Failed { error, deposed: true, .. }) => {
                // The stages fence this coordinator's batches off: its callers should go to the leader now rather
                // than wait for a plan it will not get.
                tracing::warn!(error = %error, "deposed: failing every request so that callers retry on the leader");
                self.fail_everything(error.clone());
                self.deposed = Some(error);
            }
            Err(Failed { error, suspects, .. }) => {
                let delay = self.backoff.next_delay();
                tracing::warn!(error = %error, suspects = suspects.len(), retry_in = ?delay, "cannot reach the stages");
                for s in suspects {
                    if let Some(tx) = &self.suspects {
                        let _ = tx.try_send(s);
                    }
                }
                self.last_error = Some(error);
                self.retry_at = Some(Instant::now() + delay);
            }
        }
    }

    fn on_connected(&mut self, clients: Vec<TracedStageClient>, stream: ForwardStream, budget: KvBudget) {
        self.clients = clients;
        self.stream = Some(stream);
        self.scheduler.set_budget(budget);
        self.backoff.reset();
        self.retry_at = None;
        self.stalled_since = None;
        self.last_error = None;
        while let Some(p) = self.pending.pop_front() {
            let result = self.admit(p.req, p.span);
            let _ = p.reply.send(result);
        }
    }
}
