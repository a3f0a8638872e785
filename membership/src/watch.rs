//! Watches built on the store's prefix watch: node events by diffing (stale revisions ignored), and the newest
//! plan. A broken watch is resumed after a fresh listing, whose differences are reported as events.

use std::collections::BTreeMap;
use std::time::Duration;

use strata_proto::NodeId;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::{CancellationToken, DropGuard};

use crate::{Backoff, KeyValue, NodeEvent, NodeRecord, Plan, Registry, Result, WATCH_CHANNEL, WatchEvent, decode};

/// A live view of the node set: the nodes at the start, then every change as a [`NodeEvent`].
pub struct NodeWatch {
    initial: Vec<NodeRecord>,
    events: mpsc::Receiver<NodeEvent>,
    _stop: DropGuard,
}

impl NodeWatch {
    /// The nodes registered when the watch started, sorted by id.
    pub fn initial(&self) -> &[NodeRecord] {
        &self.initial
    }

    /// The next change; `None` only if the watch task ended.
    pub async fn next(&mut self) -> Option<NodeEvent> {
        self.events.recv().await
    }
}

/// The events that turn `old` into `new`, in node id order.
pub(crate) fn diff_nodes(old: &BTreeMap<NodeId, NodeRecord>, new: &BTreeMap<NodeId, NodeRecord>) -> Vec<NodeEvent> {
    let mut events = Vec::new();
    for (id, rec) in new {
        match old.get(id) {
            None => events.push(NodeEvent::Added(rec.clone())),
            Some(prev) if prev != rec => events.push(NodeEvent::Updated(rec.clone())),
            Some(_) => {}
        }
    }
    events.extend(old.keys().filter(|id| !new.contains_key(*id)).map(|id| NodeEvent::Removed(id.clone())));
    events
}

type Known = BTreeMap<NodeId, (NodeRecord, i64)>;

fn parse_nodes(kvs: &[KeyValue]) -> Known {
    let mut known = Known::new();
    for kv in kvs {
        match decode::<NodeRecord>(kv) {
            Ok(rec) => {
                known.insert(rec.node_id.clone(), (rec, kv.mod_revision));
            }
            Err(e) => tracing::warn!(error = %e, "ignoring undecodable node record"),
        }
    }
    known
}

pub(super) async fn watch_nodes<R: Registry>(registry: R) -> Result<NodeWatch> {
    let (kvs, revision) = registry.list(&registry.keys().nodes_prefix()).await?;
    let known = parse_nodes(&kvs);
    let initial = known.values().map(|(r, _)| r.clone()).collect();
    let (tx, events) = mpsc::channel(WATCH_CHANNEL);
    let stop = CancellationToken::new();
    tokio::spawn(node_watch_task(registry, known, revision, tx, stop.clone()));
    Ok(NodeWatch { initial, events, _stop: stop.drop_guard() })
}

/// Applies one store event; returns the node event it means, if any.
fn apply(known: &mut Known, prefix: &str, event: WatchEvent) -> Option<NodeEvent> {
    match event {
        WatchEvent::Put(kv) => {
            let rec = match decode::<NodeRecord>(&kv) {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(error = %e, "ignoring undecodable node record");
                    return None;
                }
            };
            match known.get(&rec.node_id) {
                Some((_, rev)) if *rev >= kv.mod_revision => None,
                Some((prev, _)) if *prev == rec => {
                    known.insert(rec.node_id.clone(), (rec, kv.mod_revision));
                    None
                }
                Some(_) => {
                    known.insert(rec.node_id.clone(), (rec.clone(), kv.mod_revision));
                    Some(NodeEvent::Updated(rec))
                }
                None => {
                    known.insert(rec.node_id.clone(), (rec.clone(), kv.mod_revision));
                    Some(NodeEvent::Added(rec))
                }
            }
        }
        WatchEvent::Delete { key, mod_revision } => {
            let id = NodeId::new(key.strip_prefix(prefix)?);
            match known.get(&id) {
                Some((_, rev)) if *rev < mod_revision => {
                    known.remove(&id);
                    Some(NodeEvent::Removed(id))
                }
                _ => None,
            }
        }
    }
}

async fn node_watch_task<R: Registry>(
    registry: R,
    mut known: Known,
    mut revision: i64,
    tx: mpsc::Sender<NodeEvent>,
    stop: CancellationToken,
) {
    let prefix = registry.keys().nodes_prefix();
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    loop {
        match registry.watch(&prefix, revision + 1).await {
            Ok(mut rx) => loop {
                let event = tokio::select! {
                    () = stop.cancelled() => return,
                    e = rx.recv() => e,
                };
                let Some(event) = event else { break };
                backoff.reset();
                revision = revision.max(match &event {
                    WatchEvent::Put(kv) => kv.mod_revision,
                    WatchEvent::Delete { mod_revision, .. } => *mod_revision,
                });
                if let Some(ev) = apply(&mut known, &prefix, event)
                    && tx.send(ev).await.is_err()
                {
                    return;
                }
            },
            Err(e) => tracing::warn!(error = %e, "node watch failed"),
        }
        let delay = backoff.next_delay();
        tracing::debug!(retry_in = ?delay, "node watch broke; re-listing");
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
        match registry.list(&prefix).await {
            Ok((kvs, rev)) => {
                let fresh = parse_nodes(&kvs);
                let old: BTreeMap<_, _> = known.iter().map(|(k, (r, _))| (k.clone(), r.clone())).collect();
                let new: BTreeMap<_, _> = fresh.iter().map(|(k, (r, _))| (k.clone(), r.clone())).collect();
                known = fresh;
                revision = rev;
                for ev in diff_nodes(&old, &new) {
                    if tx.send(ev).await.is_err() {
                        return;
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "node re-list failed"),
        }
    }
}

pub(super) async fn watch_plan<R: Registry>(registry: R) -> Result<watch::Receiver<Option<Plan>>> {
    let key = registry.keys().plan();
    let (kvs, revision) = registry.list(&key).await?;
    let current = kvs.iter().find(|kv| kv.key == key).map(decode::<Plan>).transpose()?;
    let (tx, rx) = watch::channel(current);
    tokio::spawn(plan_watch_task(registry, key, revision, tx));
    Ok(rx)
}

fn offer(tx: &watch::Sender<Option<Plan>>, kv: &KeyValue) {
    match decode::<Plan>(kv) {
        Ok(plan) => {
            tx.send_if_modified(|cur| {
                let newer = cur.as_ref().is_none_or(|c| plan.epoch > c.epoch);
                if newer {
                    *cur = Some(plan);
                }
                newer
            });
        }
        Err(e) => tracing::warn!(error = %e, "ignoring undecodable plan"),
    }
}

async fn plan_watch_task<R: Registry>(registry: R, key: String, mut revision: i64, tx: watch::Sender<Option<Plan>>) {
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    loop {
        match registry.watch(&key, revision + 1).await {
            Ok(mut rx) => loop {
                let event = tokio::select! {
                    () = tx.closed() => return,
                    e = rx.recv() => e,
                };
                match event {
                    Some(WatchEvent::Put(kv)) if kv.key == key => {
                        backoff.reset();
                        revision = revision.max(kv.mod_revision);
                        offer(&tx, &kv);
                    }
                    Some(WatchEvent::Put(kv)) => revision = revision.max(kv.mod_revision),
                    Some(WatchEvent::Delete { mod_revision, .. }) => revision = revision.max(mod_revision),
                    None => break,
                }
            },
            Err(e) => tracing::warn!(error = %e, "plan watch failed"),
        }
        let delay = backoff.next_delay();
        tokio::select! {
            () = tx.closed() => return,
            () = tokio::time::sleep(delay) => {}
        }
        match registry.list(&key).await {
            Ok((kvs, rev)) => {
                revision = rev;
                if let Some(kv) = kvs.iter().find(|kv| kv.key == key) {
                    offer(&tx, kv);
                }
            }
            Err(e) => tracing::warn!(error = %e, "plan re-read failed"),
        }
    }
}

#[cfg(test)]
mod tests {
    use strata_proto::PlanEpoch;

    use super::*;
    use crate::NodeState;

    fn rec(id: &str, state: NodeState) -> NodeRecord {
        NodeRecord {
            node_id: NodeId::new(id),
            address: format!("{id}:1"),
            device: "cpu".into(),
            memory_bytes: 1,
            layer_seconds: 1.0,
            offload_layer_seconds: 0.0,
            head_seconds: 0.0,
            state,
            plan_epoch_loaded: PlanEpoch(0),
            load_failed_epoch: PlanEpoch(0),
        }
    }

    #[test]
    fn diff_reports_adds_updates_and_removes() {
        let old: BTreeMap<_, _> = [rec("a", NodeState::Ready), rec("b", NodeState::Ready)]
            .into_iter()
            .map(|r| (r.node_id.clone(), r))
            .collect();
        let new: BTreeMap<_, _> = [rec("b", NodeState::Draining), rec("c", NodeState::Joining)]
            .into_iter()
            .map(|r| (r.node_id.clone(), r))
            .collect();
        assert_eq!(
            diff_nodes(&old, &new),
            vec![
                NodeEvent::Updated(rec("b", NodeState::Draining)),
                NodeEvent::Added(rec("c", NodeState::Joining)),
                NodeEvent::Removed(NodeId::new("a")),
            ]
        );
        assert!(diff_nodes(&new, &new).is_empty());
    }

    #[test]
    fn stale_puts_and_deletes_are_ignored() -> Result<()> {
        let prefix = "/strata/c/nodes/";
        let kv = |r: &NodeRecord, rev| -> Result<WatchEvent> {
            Ok(WatchEvent::Put(KeyValue {
                key: format!("{prefix}{}", r.node_id),
                value: crate::encode("k", r)?,
                create_revision: 1,
                mod_revision: rev,
                lease: 0,
            }))
        };
        let mut known = Known::new();
        assert_eq!(
            apply(&mut known, prefix, kv(&rec("a", NodeState::Joining), 5)?),
            Some(NodeEvent::Added(rec("a", NodeState::Joining)))
        );
        // An older revision of the record arriving late changes nothing.
        assert_eq!(apply(&mut known, prefix, kv(&rec("a", NodeState::Cordoned), 4)?), None);
        assert_eq!(
            apply(&mut known, prefix, kv(&rec("a", NodeState::Ready), 6)?),
            Some(NodeEvent::Updated(rec("a", NodeState::Ready)))
        );
        let del = |rev| WatchEvent::Delete { key: format!("{prefix}a"), mod_revision: rev };
        assert_eq!(apply(&mut known, prefix, del(6)), None);
        assert_eq!(apply(&mut known, prefix, del(7)), Some(NodeEvent::Removed(NodeId::new("a"))));
        assert_eq!(apply(&mut known, prefix, del(8)), None);
        Ok(())
    }
}
