//! strata's cluster membership, shared by the coordinator and the stage workers: node records under leases, the
//! plan with its epoch compare-and-swap, watches, the coordinator's leader election, and where a cluster lives
//! (its name, and the etcd endpoints with their TLS and user, checked once here).
//!
//! [`Registry`] has two parts. Its required methods are the few store primitives a backend provides (leases,
//! revisions, conditional puts, prefix watches): [`EtcdRegistry`] maps them onto etcd, [`EmbeddedRegistry`]
//! implements them on an in-process map for `strata local`. Everything strata-specific (records, event diffing,
//! keep-alive with backoff, plan CAS, election) is written once as provided methods, so both backends have the
//! same semantics.

mod cluster;
mod embedded;
mod error;
mod etcd;
mod etcd_options;
mod lease;
mod records;
mod watch;

use std::future::Future;
use std::time::Duration;

use strata_proto::{NodeId, PlanEpoch};
use tokio::sync::mpsc;

pub use cluster::check_cluster_name;
pub use embedded::EmbeddedRegistry;
pub use error::{Error, Result};
pub use etcd::EtcdRegistry;
pub use etcd_options::{EtcdArgs, EtcdOptions, EtcdPassword, EtcdTls, EtcdUser, PASSWORD_ENV};
pub use lease::{Leadership, NodeRegistration};
pub use records::{Keys, NodeEvent, NodeRecord, NodeState, Plan, PlanStage};
pub use watch::NodeWatch;

/// Id of a lease (etcd's lease id; the embedded store numbers its own).
pub type LeaseId = i64;

/// A stored key with its revisions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    /// The key.
    pub key: String,
    /// The value bytes.
    pub value: Vec<u8>,
    /// Store revision at which the key was created.
    pub create_revision: i64,
    /// Store revision of the key's last modification.
    pub mod_revision: i64,
    /// The lease the key is attached to (0: none).
    pub lease: LeaseId,
}

/// The condition of a conditional put.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Condition {
    /// The key must not exist.
    Absent,
    /// The key must exist with this modification revision.
    ModRevision(i64),
}

/// A second guard on a conditional put: `key` must exist with this create revision. It fences writes by a
/// leader: its election key is created once per election, so a deposed leader's fence can never hold again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fence {
    /// The guarding key (the leader key).
    pub key: String,
    /// The create revision it must still have.
    pub create_revision: i64,
}

/// What a put does with the key's lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseMode {
    /// No lease: the key lives until deleted.
    None,
    /// Attach the key to this lease.
    Attach(LeaseId),
    /// Keep the lease the key already has (the key must exist).
    Keep,
}

/// One change seen by a prefix watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchEvent {
    /// A key was created or modified.
    Put(KeyValue),
    /// A key was deleted (or its lease expired).
    Delete {
        /// The key.
        key: String,
        /// Revision of the deletion.
        mod_revision: i64,
    },
}

/// Bound of every watch channel; a watcher that falls this far behind is dropped and re-lists.
pub(crate) const WATCH_CHANNEL: usize = 256;

/// Retries of a read-modify-write before giving up with [`Error::Contention`].
const CAS_RETRIES: usize = 16;

/// A membership store: primitives per backend, strata's operations provided on top.
pub trait Registry: Clone + Send + Sync + 'static {
    /// The key layout of this registry's cluster.
    fn keys(&self) -> &Keys;

    /// Grants a lease that expires `ttl` after its last refresh (whole seconds, at least 1).
    fn grant_lease(&self, ttl: Duration) -> impl Future<Output = Result<LeaseId>> + Send;

    /// Refreshes a lease once; `Ok(false)` means it no longer exists.
    fn refresh_lease(&self, lease: LeaseId) -> impl Future<Output = Result<bool>> + Send;

    /// Revokes a lease, deleting every key attached to it.
    fn revoke_lease(&self, lease: LeaseId) -> impl Future<Output = Result<()>> + Send;

    /// Reads one key.
    fn get(&self, key: &str) -> impl Future<Output = Result<Option<KeyValue>>> + Send;

    /// Reads every key under `prefix`, sorted by key, and the store revision of the read.
    fn list(&self, prefix: &str) -> impl Future<Output = Result<(Vec<KeyValue>, i64)>> + Send;

    /// Writes `key` if `condition` holds (always, when `None`) and, in the same transaction, `fence` holds
    /// (when given); returns whether it was written.
    fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        condition: Option<Condition>,
        lease: LeaseMode,
        fence: Option<&Fence>,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Deletes a key (absent keys are fine).
    fn delete(&self, key: &str) -> impl Future<Output = Result<()>> + Send;

    /// Streams changes under `prefix` from `from_revision` (inclusive). The channel closes when the watch breaks
    /// (connection lost, history compacted, receiver too slow); callers re-list and watch again.
    fn watch(
        &self,
        prefix: &str,
        from_revision: i64,
    ) -> impl Future<Output = Result<mpsc::Receiver<WatchEvent>>> + Send;

    /// Registers a node under a fresh lease of `ttl` and keeps the lease alive until the handle is dropped.
    fn register_node(
        &self,
        record: NodeRecord,
        ttl: Duration,
    ) -> impl Future<Output = Result<NodeRegistration<Self>>> + Send {
        lease::register_node(self.clone(), record, ttl)
    }

    /// Every registered node, sorted by id.
    fn list_nodes(&self) -> impl Future<Output = Result<Vec<NodeRecord>>> + Send {
        async move {
            let (kvs, _) = self.list(&self.keys().nodes_prefix()).await?;
            kvs.iter().map(decode::<NodeRecord>).collect()
        }
    }

    /// One node's record.
    fn get_node(&self, id: &NodeId) -> impl Future<Output = Result<Option<NodeRecord>>> + Send {
        async move {
            match self.get(&self.keys().node(id)).await? {
                Some(kv) => decode(&kv).map(Some),
                None => Ok(None),
            }
        }
    }

    /// Changes a node's record in place (keeping its lease) with a compare-and-swap on its revision.
    fn update_node<F>(&self, id: &NodeId, mut change: F) -> impl Future<Output = Result<NodeRecord>> + Send
    where
        F: FnMut(&mut NodeRecord) + Send,
    {
        async move {
            let key = self.keys().node(id);
            for _ in 0..CAS_RETRIES {
                let kv = self.get(&key).await?.ok_or_else(|| Error::NodeNotFound(id.clone()))?;
                let mut record: NodeRecord = decode(&kv)?;
                change(&mut record);
                let value = encode(&key, &record)?;
                if self.put(&key, value, Some(Condition::ModRevision(kv.mod_revision)), LeaseMode::Keep, None).await? {
                    return Ok(record);
                }
            }
            Err(Error::Contention { key })
        }
    }

    /// Sets a node's state.
    fn set_node_state(&self, id: &NodeId, state: NodeState) -> impl Future<Output = Result<NodeRecord>> + Send {
        self.update_node(id, move |r| r.state = state)
    }

    /// Watches the node set: the current nodes, then [`NodeEvent`]s computed by diffing, stale updates ignored.
    fn watch_nodes(&self) -> impl Future<Output = Result<NodeWatch>> + Send {
        watch::watch_nodes(self.clone())
    }

    /// The stored plan, if any.
    fn get_plan(&self) -> impl Future<Output = Result<Option<Plan>>> + Send {
        async move {
            match self.get(&self.keys().plan()).await? {
                Some(kv) => decode(&kv).map(Some),
                None => Ok(None),
            }
        }
    }

    /// Stores `plan` only if the stored epoch is `expected` (0: no plan yet) and `plan.epoch` is the next one.
    /// A concurrent writer makes it fail with [`Error::StaleEpoch`].
    ///
    /// A plan with a term (`plan.term > 0`, the writer's [`Leadership::term`]) is also fenced: it is written
    /// only if the leader key still exists with that create revision, checked in the same transaction as the
    /// epoch. A leader that lost its key (another candidate won since) gets [`Error::Deposed`] and must not
    /// write again under that term. Term 0 writes are not fenced.
    fn write_plan(&self, plan: &Plan, expected: PlanEpoch) -> impl Future<Output = Result<()>> + Send {
        async move {
            if plan.epoch != expected.next() {
                return Err(Error::EpochNotNext { previous: expected, new: plan.epoch });
            }
            let fence = match plan.term {
                0 => None,
                term => Some(Fence {
                    key: self.keys().leader(),
                    // No leader key can have a create revision past i64::MAX: such a term is never current.
                    create_revision: i64::try_from(term).map_err(|_| Error::Deposed { term })?,
                }),
            };
            let key = self.keys().plan();
            let value = encode(&key, plan)?;
            let current = self.get(&key).await?;
            let (found, condition) = match &current {
                Some(kv) => (decode::<Plan>(kv)?.epoch, Condition::ModRevision(kv.mod_revision)),
                None => (PlanEpoch(0), Condition::Absent),
            };
            // A deposed writer is told so first: it must stop, not re-read and replan.
            if found != expected {
                check_fence(self, fence.as_ref(), plan.term).await?;
                return Err(Error::StaleEpoch { expected, found });
            }
            if self.put(&key, value, Some(condition), LeaseMode::None, fence.as_ref()).await? {
                return Ok(());
            }
            // Which compare failed: a key with that create revision exists over one unbroken interval, so if
            // it exists now it also did at the transaction, and the epoch compare failed.
            check_fence(self, fence.as_ref(), plan.term).await?;
            let found = self.get_plan().await?.map_or(PlanEpoch(0), |p| p.epoch);
            Err(Error::StaleEpoch { expected, found })
        }
    }

    /// Watches the plan: the receiver always holds the newest plan seen; older epochs are ignored.
    fn watch_plan(&self) -> impl Future<Output = Result<tokio::sync::watch::Receiver<Option<Plan>>>> + Send {
        watch::watch_plan(self.clone())
    }

    /// Campaigns for `/strata/<cluster>/leader` until this candidate holds it (the future can be dropped to give
    /// up). Leadership lasts while its lease, of `ttl`, is kept alive.
    fn campaign(&self, candidate: &str, ttl: Duration) -> impl Future<Output = Result<Leadership<Self>>> + Send {
        lease::campaign(self.clone(), candidate.to_owned(), ttl)
    }

    /// The current leader's candidate name, if any.
    fn leader(&self) -> impl Future<Output = Result<Option<String>>> + Send {
        async move { Ok(self.get(&self.keys().leader()).await?.map(|kv| String::from_utf8_lossy(&kv.value).into_owned())) }
    }
}

/// `Err(Deposed { term })` unless `fence` (if any) holds now.
async fn check_fence<R: Registry>(registry: &R, fence: Option<&Fence>, term: u64) -> Result<()> {
    let Some(fence) = fence else { return Ok(()) };
    match registry.get(&fence.key).await? {
        Some(kv) if kv.create_revision == fence.create_revision => Ok(()),
        _ => Err(Error::Deposed { term }),
    }
}

/// Parses a stored JSON record.
pub(crate) fn decode<T: serde::de::DeserializeOwned>(kv: &KeyValue) -> Result<T> {
    serde_json::from_slice(&kv.value).map_err(|source| Error::Decode { key: kv.key.clone(), source })
}

/// Encodes a record as JSON.
pub(crate) fn encode<T: serde::Serialize>(key: &str, value: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(value).map_err(|source| Error::Encode { key: key.to_owned(), source })
}

/// Exponential backoff used by every retry loop of the registry and of its users: starts at `base`, doubles,
/// stops at `max`.
#[derive(Debug, Clone)]
pub struct Backoff {
    next: Duration,
    base: Duration,
    max: Duration,
}

impl Backoff {
    /// A backoff whose first delay is `base`.
    pub fn new(base: Duration, max: Duration) -> Self {
        Self { next: base, base, max }
    }

    /// The delay to wait now; the following one is twice as long.
    pub fn next_delay(&mut self) -> Duration {
        let d = self.next;
        self.next = (self.next * 2).min(self.max);
        d
    }

    /// Starts again from `base` (after a success).
    pub fn reset(&mut self) {
        self.next = self.base;
    }
}
