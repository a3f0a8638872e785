//! Lease holders: a node's registration and the coordinator's leadership. Both keep their lease alive in a
//! background task; failures are retried with backoff and logged, never fatal to the holder.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use strata_proto::NodeId;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::{Backoff, Condition, LeaseId, LeaseMode, NodeRecord, Registry, Result, WatchEvent, encode};

/// How often a lease of `ttl` is refreshed.
fn refresh_period(ttl: Duration) -> Duration {
    (ttl / 3).max(Duration::from_millis(100))
}

/// A node's registration: its record stays in the registry while the lease is kept alive. Dropping the handle
/// stops the keep-alive (the record then expires with the lease, as if the node had crashed); call
/// [`NodeRegistration::deregister`] to leave at once.
pub struct NodeRegistration<R: Registry> {
    registry: R,
    node_id: NodeId,
    lease: Arc<AtomicI64>,
    record: Arc<Mutex<NodeRecord>>,
    stop: CancellationToken,
    task: Option<JoinHandle<()>>,
}

pub(super) async fn register_node<R: Registry>(
    registry: R,
    record: NodeRecord,
    ttl: Duration,
) -> Result<NodeRegistration<R>> {
    let lease = put_record(&registry, &record, ttl).await?;
    let node_id = record.node_id.clone();
    let lease = Arc::new(AtomicI64::new(lease));
    let record = Arc::new(Mutex::new(record));
    let stop = CancellationToken::new();
    let task = tokio::spawn(keep_node_alive(registry.clone(), lease.clone(), record.clone(), ttl, stop.clone()));
    tracing::info!(node = %node_id, "node registered");
    Ok(NodeRegistration { registry, node_id, lease, record, stop, task: Some(task) })
}

async fn put_record<R: Registry>(registry: &R, record: &NodeRecord, ttl: Duration) -> Result<LeaseId> {
    let key = registry.keys().node(&record.node_id);
    let value = encode(&key, record)?;
    let lease = registry.grant_lease(ttl).await?;
    registry.put(&key, value, None, LeaseMode::Attach(lease), None).await?;
    Ok(lease)
}

async fn keep_node_alive<R: Registry>(
    registry: R,
    lease: Arc<AtomicI64>,
    record: Arc<Mutex<NodeRecord>>,
    ttl: Duration,
    stop: CancellationToken,
) {
    let period = refresh_period(ttl);
    let mut backoff = Backoff::new(Duration::from_millis(50), period);
    let mut delay = period;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
        let id = lease.load(Ordering::Acquire);
        let outcome = tokio::time::timeout(period, registry.refresh_lease(id)).await;
        match outcome {
            Ok(Ok(true)) => {
                backoff.reset();
                delay = period;
            }
            Ok(Ok(false)) => {
                let rec = record.lock().map(|r| r.clone()).unwrap_or_else(|p| p.into_inner().clone());
                tracing::warn!(node = %rec.node_id, lease = id, "lease expired; registering again");
                match put_record(&registry, &rec, ttl).await {
                    Ok(new) => {
                        lease.store(new, Ordering::Release);
                        backoff.reset();
                        delay = period;
                    }
                    Err(e) => {
                        delay = backoff.next_delay();
                        tracing::warn!(node = %rec.node_id, error = %e, retry_in = ?delay, "re-registration failed");
                    }
                }
            }
            Ok(Err(e)) => {
                delay = backoff.next_delay();
                tracing::warn!(lease = id, error = %e, retry_in = ?delay, "lease keep-alive failed; retrying");
            }
            Err(_) => {
                delay = backoff.next_delay();
                tracing::warn!(lease = id, retry_in = ?delay, "lease keep-alive timed out; retrying");
            }
        }
    }
}

impl<R: Registry> NodeRegistration<R> {
    /// The registered node.
    pub fn node_id(&self) -> &NodeId {
        &self.node_id
    }

    /// The lease the record is attached to now (it changes if the lease expired and the node re-registered).
    pub fn lease_id(&self) -> LeaseId {
        self.lease.load(Ordering::Acquire)
    }

    /// Changes the node's record in the registry (and the copy used to re-register).
    pub async fn update(&self, change: impl FnMut(&mut NodeRecord) + Send) -> Result<NodeRecord> {
        let updated = self.registry.update_node(&self.node_id, change).await?;
        match self.record.lock() {
            Ok(mut r) => *r = updated.clone(),
            Err(p) => *p.into_inner() = updated.clone(),
        }
        Ok(updated)
    }

    /// Stops the keep-alive without deleting anything: the record disappears when the lease expires.
    pub fn abandon(mut self) {
        self.stop.cancel();
        self.task.take();
    }

    /// Leaves the cluster now: stops the keep-alive and revokes the lease, deleting the record.
    pub async fn deregister(mut self) -> Result<()> {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
        self.registry.revoke_lease(self.lease_id()).await
    }
}

impl<R: Registry> Drop for NodeRegistration<R> {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The coordinator's leadership: held while the lease on `/strata/<cluster>/leader` lives.
pub struct Leadership<R: Registry> {
    registry: R,
    candidate: String,
    lease: LeaseId,
    term: u64,
    lost: CancellationToken,
    stop: CancellationToken,
}

pub(super) async fn campaign<R: Registry>(registry: R, candidate: String, ttl: Duration) -> Result<Leadership<R>> {
    let key = registry.keys().leader();
    loop {
        let lease = registry.grant_lease(ttl).await?;
        let put =
            registry.put(&key, candidate.clone().into_bytes(), Some(Condition::Absent), LeaseMode::Attach(lease), None);
        if put.await? {
            // The term is the key's create revision; the key may already be gone again (lease lost in between),
            // in which case this election does not count.
            match registry.get(&key).await? {
                Some(kv) if kv.lease == lease && kv.create_revision > 0 => {
                    let term = kv.create_revision.unsigned_abs();
                    let lost = CancellationToken::new();
                    let stop = CancellationToken::new();
                    tokio::spawn(keep_leader_alive(registry.clone(), lease, ttl, lost.clone(), stop.clone()));
                    tracing::info!(candidate, term, "elected leader");
                    return Ok(Leadership { registry, candidate, lease, term, lost, stop });
                }
                _ => tracing::warn!(candidate, "the leader key was lost right after the election; campaigning again"),
            }
        }
        let _ = registry.revoke_lease(lease).await;
        let Some(current) = registry.get(&key).await? else { continue };
        tracing::info!(candidate, leader = %String::from_utf8_lossy(&current.value), "waiting for leadership");
        let mut events = registry.watch(&key, current.mod_revision + 1).await?;
        loop {
            match events.recv().await {
                Some(WatchEvent::Delete { .. }) => break,
                Some(WatchEvent::Put(_)) => {}
                None => {
                    // The watch broke (store unreachable); look again shortly.
                    tokio::time::sleep(refresh_period(ttl)).await;
                    break;
                }
            }
        }
    }
}

async fn keep_leader_alive<R: Registry>(
    registry: R,
    lease: LeaseId,
    ttl: Duration,
    lost: CancellationToken,
    stop: CancellationToken,
) {
    let period = refresh_period(ttl);
    let mut backoff = Backoff::new(Duration::from_millis(50), period);
    let mut delay = period;
    let mut last_ok = Instant::now();
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
        match tokio::time::timeout(period, registry.refresh_lease(lease)).await {
            Ok(Ok(true)) => {
                last_ok = Instant::now();
                backoff.reset();
                delay = period;
            }
            Ok(Ok(false)) => {
                tracing::warn!(lease, "leader lease expired; stepping down");
                lost.cancel();
                return;
            }
            Ok(Err(e)) => {
                delay = backoff.next_delay();
                tracing::warn!(lease, error = %e, retry_in = ?delay, "leader keep-alive failed; retrying");
            }
            Err(_) => {
                delay = backoff.next_delay();
                tracing::warn!(lease, retry_in = ?delay, "leader keep-alive timed out; retrying");
            }
        }
        // Without a refresh for a whole TTL the lease may be gone and another coordinator may lead.
        if last_ok.elapsed() >= ttl {
            tracing::warn!(lease, "leader lease not refreshed for a TTL; stepping down");
            lost.cancel();
            return;
        }
    }
}

impl<R: Registry> Leadership<R> {
    /// This leader's candidate name.
    pub fn candidate(&self) -> &str {
        &self.candidate
    }

    /// This leadership's term: the create revision of the leader key this candidate created. It grows with
    /// every election, so stages and fenced plan writes ([`Registry::write_plan`] with `Plan::term`) can tell
    /// a newer leader from a deposed one.
    pub fn term(&self) -> u64 {
        self.term
    }

    /// Whether the leadership has been lost (lease expired or unrefreshable for a TTL).
    pub fn is_lost(&self) -> bool {
        self.lost.is_cancelled()
    }

    /// Resolves when the leadership is lost.
    pub async fn lost(&self) {
        self.lost.cancelled().await;
    }

    /// Gives the leadership up now: the lease is revoked, so another candidate takes over at once.
    pub async fn resign(self) -> Result<()> {
        self.stop.cancel();
        self.registry.revoke_lease(self.lease).await
    }
}

impl<R: Registry> Drop for Leadership<R> {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}
