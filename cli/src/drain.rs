//! `strata nodes drain ID` waiting for the drain to finish: the node CORDONED, out of the current plan's stages,
//! and holding no KV blocks. What is still pending is computed from one `ClusterStatus` (no I/O), so progress
//! lines and the timeout message name it exactly.

use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use strata_proto::pb;

use crate::connect::Client;

/// How often the coordinator is asked.
const POLL: Duration = Duration::from_millis(500);

/// Where a drain stands in one `ClusterStatus`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DrainProgress {
    /// Nothing left; `note` says anything unusual (the node is no longer registered at all).
    Done {
        /// Why it counts as done, when that is not the plain case.
        note: Option<String>,
    },
    /// What is still in the way, one sentence each.
    Pending(Vec<String>),
}

/// What keeps node `id` from being drained in `status`.
pub fn progress(status: &pb::ClusterStatusResponse, id: &str) -> DrainProgress {
    let mut pending = Vec::new();
    for st in status.stages.iter().filter(|st| st.node_id == id) {
        pending.push(format!(
            "{id} still holds layers {}..{} (stage {}) in plan epoch {}",
            st.layer_start, st.layer_end, st.index, status.plan_epoch
        ));
    }
    let Some(node) = status.nodes.iter().find(|n| n.node_id == id) else {
        return if pending.is_empty() {
            DrainProgress::Done { note: Some(format!("{id} is no longer registered (its lease ended)")) }
        } else {
            pending.push(format!("{id} is no longer registered, but the plan still routes through it"));
            DrainProgress::Pending(pending)
        };
    };
    if node.state != pb::NodeState::Cordoned as i32 {
        pending.push(format!("{id} is {}, not CORDONED yet", crate::cluster::state_name(node.state)));
    }
    // No KV reported (total 0): the stage did not answer the coordinator's status call, or holds no cache.
    if node.kv_total_blocks > 0 && node.kv_free_blocks < node.kv_total_blocks {
        pending.push(format!(
            "{id} still has {} of {} KV blocks in use",
            node.kv_total_blocks - node.kv_free_blocks,
            node.kv_total_blocks
        ));
    }
    if pending.is_empty() { DrainProgress::Done { note: None } } else { DrainProgress::Pending(pending) }
}

/// Polls `ClusterStatus` until node `id` is drained, calling `report` with each new pending state; fails after
/// `timeout` naming what is still pending. Returns how long it took.
pub async fn wait_drained(
    client: &mut Client,
    id: &str,
    timeout: Duration,
    mut report: impl FnMut(&str),
) -> Result<Duration> {
    let start = Instant::now();
    let mut last = String::new();
    loop {
        let now = match client.cluster_status(pb::ClusterStatusRequest {}).await {
            Ok(s) => match progress(&s.into_inner(), id) {
                DrainProgress::Done { note } => {
                    if let Some(note) = note {
                        report(&note);
                    }
                    return Ok(start.elapsed());
                }
                DrainProgress::Pending(p) => p.join("; "),
            },
            // A coordinator restarting or failing over: keep asking until the timeout.
            Err(e) => format!("the coordinator did not answer ClusterStatus: {}: {}", code_name(e.code()), e.message()),
        };
        if now != last {
            report(&format!("[{:>5.1} s] {now}", start.elapsed().as_secs_f64()));
            last = now;
        }
        if start.elapsed() >= timeout {
            bail!("drain of {id} did not finish within {} s: {last}", timeout.as_secs());
        }
        tokio::time::sleep(POLL.min(timeout.saturating_sub(start.elapsed()))).await;
    }
}

/// A gRPC code as its canonical upper-case name (`UNAVAILABLE`), as strata's docs write them.
pub fn code_name(code: tonic::Code) -> String {
    let name = format!("{code:?}");
    let mut out = String::new();
    for (i, ch) in name.chars().enumerate() {
        if ch.is_ascii_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(ch.to_ascii_uppercase());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str, state: pb::NodeState, free: u64, total: u64) -> pb::NodeInfo {
        pb::NodeInfo {
            node_id: id.into(),
            state: state as i32,
            kv_free_blocks: free,
            kv_total_blocks: total,
            ..Default::default()
        }
    }

    fn stage(index: u32, id: &str, start: u32, end: u32) -> pb::StageInfo {
        pb::StageInfo { index, node_id: id.into(), layer_start: start, layer_end: end, ..Default::default() }
    }

    fn status(nodes: Vec<pb::NodeInfo>, stages: Vec<pb::StageInfo>) -> pb::ClusterStatusResponse {
        pb::ClusterStatusResponse { nodes, stages, plan_epoch: 7, num_layers: 30, ..Default::default() }
    }

    #[test]
    fn every_pending_condition_is_named() {
        let s = status(
            vec![node("w0", pb::NodeState::Ready, 64, 64), node("w1", pb::NodeState::Draining, 60, 64)],
            vec![stage(0, "w0", 0, 10), stage(1, "w1", 10, 20)],
        );
        assert_eq!(
            progress(&s, "w1"),
            DrainProgress::Pending(vec![
                "w1 still holds layers 10..20 (stage 1) in plan epoch 7".into(),
                "w1 is DRAINING, not CORDONED yet".into(),
                "w1 still has 4 of 64 KV blocks in use".into(),
            ])
        );
    }

    #[test]
    fn cordoned_out_of_the_plan_with_free_kv_is_done() {
        let cordoned = node("w1", pb::NodeState::Cordoned, 64, 64);
        let s = status(vec![cordoned.clone()], vec![stage(0, "w0", 0, 30)]);
        assert_eq!(progress(&s, "w1"), DrainProgress::Done { note: None });
        // A stage that reported no KV (it did not answer in time, or has none) does not block the drain.
        let s = status(vec![node("w1", pb::NodeState::Cordoned, 0, 0)], vec![stage(0, "w0", 0, 30)]);
        assert_eq!(progress(&s, "w1"), DrainProgress::Done { note: None });
        // Cordoned but its KV still in use: not yet.
        let s = status(vec![node("w1", pb::NodeState::Cordoned, 10, 64)], vec![]);
        assert!(matches!(progress(&s, "w1"), DrainProgress::Pending(p) if p.len() == 1));
    }

    #[test]
    fn a_node_that_left_is_done_unless_the_plan_still_uses_it() {
        let s = status(vec![], vec![stage(0, "w0", 0, 30)]);
        assert!(
            matches!(progress(&s, "w1"), DrainProgress::Done { note: Some(n) } if n.contains("no longer registered"))
        );
        let s = status(vec![], vec![stage(0, "w1", 0, 30)]);
        assert!(matches!(progress(&s, "w1"), DrainProgress::Pending(p) if p.len() == 2));
    }

    #[test]
    fn codes_are_named_as_in_the_docs() {
        assert_eq!(code_name(tonic::Code::Unavailable), "UNAVAILABLE");
        assert_eq!(code_name(tonic::Code::FailedPrecondition), "FAILED_PRECONDITION");
    }
}
