//! The [`Registry`] primitives on etcd (v3 API, etcd 3.4+).

use std::time::{Duration, Instant};

use etcd_client::{Client, Compare, CompareOp, EventType, GetOptions, PutOptions, Txn, TxnOp, WatchOptions};
use tokio::sync::mpsc;

use crate::{
    Backoff, Condition, Error, EtcdOptions, Fence, KeyValue, Keys, LeaseId, LeaseMode, Registry, Result, WATCH_CHANNEL,
    WatchEvent,
};

/// A registry stored in etcd. Cheap to clone (one shared connection pool).
#[derive(Clone)]
pub struct EtcdRegistry {
    client: Client,
    keys: Keys,
}

impl std::fmt::Debug for EtcdRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdRegistry").field("keys", &self.keys).finish_non_exhaustive()
    }
}

fn kv_of(kv: &etcd_client::KeyValue) -> KeyValue {
    KeyValue {
        key: String::from_utf8_lossy(kv.key()).into_owned(),
        value: kv.value().to_vec(),
        create_revision: kv.create_revision(),
        mod_revision: kv.mod_revision(),
        lease: kv.lease(),
    }
}

impl EtcdRegistry {
    /// Connects to etcd as `etcd` says (TLS, user) and checks that it answers, retrying with backoff for up to
    /// `wait`; after that fails with [`Error::EtcdUnreachable`]. Settings that do not fit together fail at once,
    /// and so does an etcd that refuses us for good ([`Error::EtcdRefused`]: wrong password, no user given to an
    /// etcd with auth, a certificate one side does not trust).
    pub async fn connect(etcd: &EtcdOptions, cluster: &str, wait: Duration) -> Result<Self> {
        let options = etcd.connect_options()?;
        let endpoints = &etcd.endpoints;
        let described = etcd.describe();
        let start = Instant::now();
        let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let mut attempts = 0;
        let mut closed = 0u32;
        loop {
            attempts += 1;
            let attempt = async {
                let mut client = Client::connect(endpoints, Some(options.clone())).await?;
                client.get("/strata/", Some(GetOptions::new().with_count_only())).await?;
                Ok::<_, etcd_client::Error>(client)
            };
            let budget = wait.saturating_sub(start.elapsed()).clamp(Duration::from_millis(100), Duration::from_secs(2));
            let last_error = match tokio::time::timeout(budget, attempt).await {
                Ok(Ok(client)) => {
                    tracing::info!(etcd = %described, attempts, "connected to etcd");
                    return Ok(Self { client, keys: Keys::new(cluster) });
                }
                Ok(Err(e)) => match refusal(&e) {
                    Some(reason) => return Err(Error::EtcdRefused { endpoints: endpoints.join(","), reason }),
                    None => error_chain(&e),
                },
                Err(_) => format!("no answer within {budget:?}"),
            };
            closed += u32::from(last_error.contains(CLOSED));
            let remaining = wait.saturating_sub(start.elapsed());
            if remaining.is_zero() {
                if let Some(reason) = closed_for_want_of_a_certificate(etcd, closed == attempts, &last_error) {
                    return Err(Error::EtcdRefused { endpoints: endpoints.join(","), reason });
                }
                return Err(Error::EtcdUnreachable {
                    endpoints: endpoints.join(","),
                    waited: start.elapsed(),
                    attempts,
                    last_error,
                });
            }
            let delay = backoff.next_delay().min(remaining);
            tracing::warn!(etcd = %described, error = %last_error, retry_in = ?delay, "etcd not reachable yet");
            tokio::time::sleep(delay).await;
        }
    }

    /// Turns on etcd's auth with `etcd`'s user, which must be `root` (etcd enables auth only with a root user
    /// holding the root role): adds the user and role, grants it, enables auth. Safe to run again, as a Helm hook
    /// does on every upgrade: with auth already on it only checks that the user's password works. Returns whether
    /// it enabled auth now.
    pub async fn enable_auth(etcd: &EtcdOptions, wait: Duration) -> Result<bool> {
        let user =
            etcd.user.as_ref().ok_or_else(|| Error::EtcdCredentials("enabling auth needs --etcd-user root".into()))?;
        if user.name != "root" {
            return Err(Error::EtcdCredentials(format!("etcd enables auth only for user root, not {:?}", user.name)));
        }
        let anonymous = EtcdOptions { user: None, ..etcd.clone() };
        let mut client = match Self::connect(&anonymous, "auth", wait).await {
            Ok(registry) => registry.client,
            // Refused without a user: auth is on already. The password must work.
            Err(Error::EtcdRefused { .. }) => return Self::connect(etcd, "auth", wait).await.map(|_| false),
            Err(e) => return Err(e),
        };
        let tolerate = |op: &'static str, already: &'static str| {
            move |e: etcd_client::Error| if e.to_string().contains(already) { Ok(()) } else { Err(Error::etcd(op)(e)) }
        };
        let password = user.password.expose();
        client.user_add("root", password, None).await.map(drop).or_else(tolerate("user add root", "already exists"))?;
        client.role_add("root").await.map(drop).or_else(tolerate("role add root", "already exists"))?;
        client.user_grant_role("root", "root").await.map_err(Error::etcd("grant root the root role"))?;
        client.auth_enable().await.map_err(Error::etcd("auth enable"))?;
        tracing::info!(etcd = %etcd.describe(), "etcd auth enabled for user root");
        Ok(true)
    }
}

/// The error and its causes, `: `-separated (tonic's transport errors say only "transport error" at the top; the
/// TLS or socket failure is in the sources).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Why etcd refused us, when retrying cannot help: credentials it rejects or a TLS peer that is not trusted.
fn refusal(e: &etcd_client::Error) -> Option<String> {
    let text = error_chain(e);
    let hint = if text.contains("authentication failed") {
        "wrong etcd user or password (--etcd-user, --etcd-password-file)"
    } else if text.contains("user name is empty") || text.contains("invalid auth token") {
        "etcd has auth enabled: give --etcd-user and its password (--etcd-password-file or STRATA_ETCD_PASSWORD)"
    } else if text.contains("permission denied") {
        // Also what an etcd with auth enabled answers a caller with no user but a client certificate.
        "etcd denied access to /strata/: with auth enabled give --etcd-user and its password, and grant the user's \
         role readwrite on the /strata/ prefix"
    } else if text.contains("invalid peer certificate") {
        "TLS: etcd's certificate does not chain to --etcd-ca or does not name the endpoint's host"
    } else if text.contains("alert: BadCertificate") || text.contains("alert: CertificateRequired") {
        "TLS: etcd did not accept our client certificate: give --etcd-cert and --etcd-key, signed by a CA etcd trusts"
    } else if text.contains("certificate") || text.contains("Certificate") {
        "TLS: a certificate was refused (check --etcd-ca, --etcd-cert, --etcd-key)"
    } else {
        return None;
    };
    Some(format!("{hint}: {text}"))
}

/// How a request fails on a connection the server closed.
const CLOSED: &str = "connection closed";

/// Why etcd refused us, inferred where every attempt over TLS without a client certificate ended with the
/// connection closed: with TLS 1.3 etcd rejects a missing client certificate after the client has finished its
/// handshake, and whether the request then sees etcd's alert (which [`refusal`] names at once) or only the closed
/// connection is a race the request can lose every time on a loaded machine.
fn closed_for_want_of_a_certificate(etcd: &EtcdOptions, always_closed: bool, last_error: &str) -> Option<String> {
    let without_cert = etcd.tls.as_ref().is_some_and(|tls| tls.cert.is_none());
    (without_cert && always_closed).then(|| {
        format!(
            "TLS: etcd closed every connection after the handshake, as it does when it did not accept our client \
             certificate (none given): give --etcd-cert and --etcd-key, signed by a CA etcd trusts: {last_error}"
        )
    })
}

impl Registry for EtcdRegistry {
    fn keys(&self) -> &Keys {
        &self.keys
    }

    async fn grant_lease(&self, ttl: Duration) -> Result<LeaseId> {
        let secs = i64::try_from(ttl.as_secs().max(1)).unwrap_or(i64::MAX);
        let resp = self.client.clone().lease_grant(secs, None).await.map_err(Error::etcd("lease grant"))?;
        Ok(resp.id())
    }

    async fn refresh_lease(&self, lease: LeaseId) -> Result<bool> {
        match self.client.clone().lease_keep_alive(lease).await {
            Ok(_) => Ok(true),
            // etcd-client reports a keep-alive answered with TTL 0 this way.
            Err(etcd_client::Error::LeaseKeepAliveError(m)) if m.contains("not found") => Ok(false),
            Err(e) => Err(Error::etcd(format!("lease keep-alive {lease:x}"))(e)),
        }
    }

    async fn revoke_lease(&self, lease: LeaseId) -> Result<()> {
        match self.client.clone().lease_revoke(lease).await {
            Ok(_) => Ok(()),
            Err(etcd_client::Error::GRpcStatus(s)) if s.message().contains("not found") => Ok(()),
            Err(e) => Err(Error::etcd(format!("lease revoke {lease:x}"))(e)),
        }
    }

    async fn get(&self, key: &str) -> Result<Option<KeyValue>> {
        let resp = self.client.clone().get(key, None).await.map_err(Error::etcd(format!("get {key}")))?;
        Ok(resp.kvs().first().map(kv_of))
    }

    async fn list(&self, prefix: &str) -> Result<(Vec<KeyValue>, i64)> {
        let resp = self
            .client
            .clone()
            .get(prefix, Some(GetOptions::new().with_prefix()))
            .await
            .map_err(Error::etcd(format!("list {prefix}")))?;
        let revision = resp.header().map_or(0, |h| h.revision());
        Ok((resp.kvs().iter().map(kv_of).collect(), revision))
    }

    async fn put(
        &self,
        key: &str,
        value: Vec<u8>,
        condition: Option<Condition>,
        lease: LeaseMode,
        fence: Option<&Fence>,
    ) -> Result<bool> {
        let options = match lease {
            LeaseMode::None => None,
            LeaseMode::Attach(id) => Some(PutOptions::new().with_lease(id)),
            LeaseMode::Keep => Some(PutOptions::new().with_ignore_lease()),
        };
        let mut client = self.client.clone();
        let op = || format!("put {key}");
        let mut compares = Vec::with_capacity(2);
        match condition {
            None => {}
            Some(Condition::Absent) => compares.push(Compare::version(key, CompareOp::Equal, 0)),
            Some(Condition::ModRevision(rev)) => compares.push(Compare::mod_revision(key, CompareOp::Equal, rev)),
        }
        // A missing key compares with create revision 0, which no fence names: the fence fails.
        if let Some(f) = fence {
            compares.push(Compare::create_revision(f.key.as_str(), CompareOp::Equal, f.create_revision));
        }
        if compares.is_empty() {
            client.put(key, value, options).await.map_err(Error::etcd(op()))?;
            return Ok(true);
        }
        let txn = Txn::new().when(compares).and_then(vec![TxnOp::put(key, value, options)]);
        let resp = client.txn(txn).await.map_err(Error::etcd(op()))?;
        Ok(resp.succeeded())
    }

    async fn delete(&self, key: &str) -> Result<()> {
        self.client.clone().delete(key, None).await.map_err(Error::etcd(format!("delete {key}")))?;
        Ok(())
    }

    async fn watch(&self, prefix: &str, from_revision: i64) -> Result<mpsc::Receiver<WatchEvent>> {
        let options = WatchOptions::new().with_prefix().with_start_revision(from_revision);
        let mut stream =
            self.client.clone().watch(prefix, Some(options)).await.map_err(Error::etcd(format!("watch {prefix}")))?;
        let (tx, rx) = mpsc::channel(WATCH_CHANNEL);
        let prefix = prefix.to_owned();
        tokio::spawn(async move {
            loop {
                let msg = tokio::select! {
                    () = tx.closed() => return,
                    m = stream.message() => m,
                };
                let resp = match msg {
                    Ok(Some(resp)) => resp,
                    Ok(None) => return,
                    Err(e) => {
                        tracing::warn!(prefix, error = %e, "etcd watch broke");
                        return;
                    }
                };
                if resp.canceled() {
                    tracing::warn!(
                        prefix,
                        compact_revision = resp.compact_revision(),
                        reason = resp.cancel_reason(),
                        "etcd watch cancelled"
                    );
                    return;
                }
                for event in resp.events() {
                    let Some(kv) = event.kv() else { continue };
                    let ev = match event.event_type() {
                        EventType::Put => WatchEvent::Put(kv_of(kv)),
                        EventType::Delete => WatchEvent::Delete {
                            key: String::from_utf8_lossy(kv.key()).into_owned(),
                            mod_revision: kv.mod_revision(),
                        },
                    };
                    // A full channel means the consumer is stuck: drop the watch so it re-lists.
                    if tx.try_send(ev).is_err() {
                        tracing::warn!(prefix, "watch consumer too slow or gone; closing the watch");
                        return;
                    }
                }
            }
        });
        Ok(rx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EtcdTls;

    #[test]
    fn connections_closed_over_tls_without_a_client_certificate_name_the_certificate() {
        let tls = |cert: Option<&str>| EtcdTls {
            ca: "ca.crt".into(),
            cert: cert.map(Into::into),
            key: cert.map(|_| "client.key".into()),
        };
        let with = |tls| EtcdOptions { tls, ..EtcdOptions::new(vec!["https://127.0.0.1:2379".into()]) };
        let closed = "transport error: connection closed";
        let reason = closed_for_want_of_a_certificate(&with(Some(tls(None))), true, closed);
        assert!(reason.is_some_and(|r| r.contains("did not accept our client certificate") && r.contains(closed)));
        // Some attempt failed otherwise (etcd starting, unreachable): keep calling it unreachable.
        assert_eq!(closed_for_want_of_a_certificate(&with(Some(tls(None))), false, closed), None);
        // A certificate was given, or no TLS: a closed connection says nothing about certificates.
        assert_eq!(closed_for_want_of_a_certificate(&with(Some(tls(Some("client.crt")))), true, closed), None);
        assert_eq!(closed_for_want_of_a_certificate(&with(None), true, closed), None);
    }
}
