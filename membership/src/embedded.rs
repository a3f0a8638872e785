//! The [`Registry`] primitives on an in-process map, for `strata local` without etcd (the way k3s embeds its
//! store): revisions, leases with TTLs, conditional puts and prefix watches with a bounded history, so the
//! provided registry operations behave exactly as they do on etcd.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use crate::{Condition, Error, Fence, KeyValue, Keys, LeaseId, LeaseMode, Registry, Result, WATCH_CHANNEL, WatchEvent};

/// Events kept for watches that start in the past.
const HISTORY: usize = 4096;
/// How often expired leases are swept (they are also expired lazily by every operation).
const SWEEP: Duration = Duration::from_millis(50);

/// A registry held in this process. Clones share the same store.
#[derive(Clone)]
pub struct EmbeddedRegistry {
    store: Arc<Mutex<Store>>,
    keys: Keys,
}

impl std::fmt::Debug for EmbeddedRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmbeddedRegistry").field("keys", &self.keys).finish_non_exhaustive()
    }
}

struct Entry {
    value: Vec<u8>,
    create_revision: i64,
    mod_revision: i64,
    lease: Option<LeaseId>,
}

struct Lease {
    ttl: Duration,
    deadline: Instant,
}

struct Watcher {
    prefix: String,
    tx: mpsc::Sender<WatchEvent>,
}

#[derive(Default)]
struct Store {
    revision: i64,
    kvs: BTreeMap<String, Entry>,
    leases: HashMap<LeaseId, Lease>,
    next_lease: LeaseId,
    history: VecDeque<(i64, WatchEvent)>,
    compacted: i64,
    watchers: Vec<Watcher>,
}

impl Store {
    fn kv(&self, key: &str) -> Option<KeyValue> {
        self.kvs.get(key).map(|e| KeyValue {
            key: key.to_owned(),
            value: e.value.clone(),
            create_revision: e.create_revision,
            mod_revision: e.mod_revision,
            lease: e.lease.unwrap_or(0),
        })
    }

    fn emit(&mut self, event: WatchEvent) {
        if self.history.len() == HISTORY
            && let Some((rev, _)) = self.history.pop_front()
        {
            self.compacted = rev;
        }
        self.history.push_back((self.revision, event.clone()));
        let key = match &event {
            WatchEvent::Put(kv) => kv.key.as_str(),
            WatchEvent::Delete { key, .. } => key.as_str(),
        };
        // A watcher that is gone or too slow is dropped; its consumer re-lists (as with etcd).
        self.watchers.retain(|w| !key.starts_with(&w.prefix) || w.tx.try_send(event.clone()).is_ok());
    }

    fn put(&mut self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) {
        self.revision += 1;
        let rev = self.revision;
        let create_revision = self.kvs.get(key).map_or(rev, |e| e.create_revision);
        self.kvs.insert(key.to_owned(), Entry { value, create_revision, mod_revision: rev, lease });
        if let Some(kv) = self.kv(key) {
            self.emit(WatchEvent::Put(kv));
        }
    }

    fn delete(&mut self, key: &str) {
        if self.kvs.remove(key).is_some() {
            self.revision += 1;
            let mod_revision = self.revision;
            self.emit(WatchEvent::Delete { key: key.to_owned(), mod_revision });
        }
    }

    fn drop_lease(&mut self, lease: LeaseId) {
        self.leases.remove(&lease);
        let keys: Vec<String> =
            self.kvs.iter().filter(|(_, e)| e.lease == Some(lease)).map(|(k, _)| k.clone()).collect();
        for k in keys {
            self.delete(&k);
        }
    }

    fn expire(&mut self, now: Instant) {
        let dead: Vec<LeaseId> = self.leases.iter().filter(|(_, l)| l.deadline <= now).map(|(id, _)| *id).collect();
        for id in dead {
            tracing::debug!(lease = id, "embedded lease expired");
            self.drop_lease(id);
        }
    }
}

impl EmbeddedRegistry {
    /// An empty store for `cluster`. Inside a Tokio runtime a background task also sweeps expired leases (they
    /// are expired lazily by every operation regardless).
    pub fn new(cluster: &str) -> Self {
        let store = Arc::new(Mutex::new(Store { next_lease: 1, ..Store::default() }));
        if let Ok(handle) = tokio::runtime::Handle::try_current() {
            handle.spawn(sweep(Arc::downgrade(&store)));
        }
        Self { store, keys: Keys::new(cluster) }
    }

    fn lock(&self) -> MutexGuard<'_, Store> {
        let mut guard = self.store.lock().unwrap_or_else(|p| p.into_inner());
        guard.expire(Instant::now());
        guard
    }
}

async fn sweep(store: Weak<Mutex<Store>>) {
    loop {
        tokio::time::sleep(SWEEP).await;
        let Some(store) = store.upgrade() else { return };
        store.lock().unwrap_or_else(|p| p.into_inner()).expire(Instant::now());
    }
}

impl Registry for EmbeddedRegistry {
    fn keys(&self) -> &Keys {
        &self.keys
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId> {
        let ttl = Duration::from_secs(ttl.as_secs().max(1));
        let mut s = self.lock();
        let id = s.next_lease;
        s.next_lease += 1;
        s.leases.insert(id, Lease { ttl, deadline: Instant::now() + ttl });
        Ok(id)
    }

    async fn refresh_lease(&self, lease: LeaseId) -> Result<bool> {
        let mut s = self.lock();
        Ok(match s.leases.get_mut(&lease) {
            Some(l) => {
                l.deadline = Instant::now() + l.ttl;
                true
            }
            None => false,
        })
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<()> {
        self.lock().drop_lease(lease);
        Ok(())
    }

    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        Ok(self.lock().kv(key))
    }

    async fn list(&self, prefix: &str) -> Result<(Vec<KeyValue>, i64)> {
        let s = self.lock();
        let kvs =
            s.kvs.range(prefix.to_owned()..).take_while(|(k, _)| k.starts_with(prefix)).filter_map(|(k, _)| s.kv(k));
        Ok((kvs.collect(), s.revision))
    }

    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        condition: Option<Condition>,
        lease: LeaseMode,
        fence: Option<&Fence>,
    ) -> Result<bool> {
        let mut s = self.lock();
        let current = s.kvs.get(key);
        let holds = match condition {
            None => true,
            Some(Condition::Absent) => current.is_none(),
            Some(Condition::ModRevision(rev)) => current.is_some_and(|e| e.mod_revision == rev),
        };
        let fenced = fence.is_none_or(|f| s.kvs.get(&f.key).is_some_and(|e| e.create_revision == f.create_revision));
        if !holds || !fenced {
            return Ok(false);
        }
        let lease = match lease {
            LeaseMode::None => None,
            LeaseMode::Attach(id) if s.leases.contains_key(&id) => Some(id),
            LeaseMode::Attach(id) => return Err(Error::LeaseExpired(id)),
            LeaseMode::Keep => match current {
                Some(e) => e.lease,
                None => return Ok(false),
            },
        };
        s.put(key, value, lease);
        Ok(true)
    }

    async fn delete(&self, key: &str) -> Result<()> {
        self.lock().delete(key);
        Ok(())
    }

    async fn watch(&self, prefix: &str, from_revision: i64) -> Result<mpsc::Receiver<WatchEvent>> {
        let mut s = self.lock();
        if from_revision > 0 && from_revision <= s.compacted {
            return Err(Error::Compacted { requested: from_revision, oldest: s.compacted + 1 });
        }
        let (tx, rx) = mpsc::channel(WATCH_CHANNEL);
        for (rev, event) in &s.history {
            let key = match event {
                WatchEvent::Put(kv) => &kv.key,
                WatchEvent::Delete { key, .. } => key,
            };
            if from_revision > 0
                && *rev >= from_revision
                && key.starts_with(prefix)
                && tx.try_send(event.clone()).is_err()
            {
                // More history than the channel holds: the caller should re-list instead.
                return Err(Error::Compacted { requested: from_revision, oldest: s.revision });
            }
        }
        s.watchers.push(Watcher { prefix: prefix.to_owned(), tx });
        Ok(rx)
    }
}
