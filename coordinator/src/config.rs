//! The coordinator's configuration: one struct, unknown fields rejected, validated before anything starts.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use strata_engine::{KvDtype, QuantDtype};
use strata_membership::{EtcdOptions, check_cluster_name};
use strata_proto::{Keepalive, Tls, TlsFiles};

use crate::auth::{ApiKey, ApiKeys, check_identities, check_keys};
use crate::pipeline::{MAX_MICRO_BATCHES_PER_STAGE, PipelineOptions, PrefixCaching, SchedulerLimits, Timeouts};
use crate::sizing::{SizeOptions, context_limits};
use crate::{Error, Result};

/// Everything the coordinator needs to start.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CoordinatorConfig {
    /// etcd: endpoints, TLS and user; `None` runs an embedded in-process registry.
    #[serde(default)]
    pub etcd: Option<EtcdOptions>,
    /// Cluster name: every key lives under `/strata/<cluster>/`.
    #[serde(default = "default_cluster")]
    pub cluster: String,
    /// The model: a Hugging Face directory or a `.gguf` file.
    pub model: PathBuf,
    /// The name the APIs serve the model under; defaults to its file or directory name less `.gguf`.
    #[serde(default)]
    pub model_name: Option<String>,
    /// Address of the public gRPC API (`Coordinator`, health, reflection).
    pub grpc_addr: SocketAddr,
    /// Address of the HTTP API (served by a later issue; validated now).
    pub http_addr: SocketAddr,
    /// READY nodes to wait for before the cluster's first plan; later plans use whatever nodes are usable.
    #[serde(default = "default_min_stages")]
    pub min_stages: usize,
    /// Name this coordinator campaigns under; defaults to `coordinator-<pid>`.
    #[serde(default)]
    pub candidate: Option<String>,
    /// TTL of the leader lease, in seconds.
    #[serde(default = "default_lease_ttl")]
    pub lease_ttl_secs: u64,
    /// How long to keep trying to reach etcd at start, in milliseconds.
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout_ms: u64,
    /// Longest sequence served (prompt + generated tokens); longer requests are refused. `None`: the model's
    /// context length.
    #[serde(default)]
    pub max_model_len: Option<usize>,
    /// Tokens of KV cache every stage must hold: placement reserves memory for them and a stage that cannot
    /// fails its load. `None`: `max_model_len`, so one sequence of the longest length always fits.
    #[serde(default)]
    pub min_kv_tokens: Option<u64>,
    /// Block format every stage quantizes float weights into as it loads (carried in the plan; placement sizes
    /// layers in it). `None`: each worker's own `--quantize`, and placement sizes layers as the file stores them.
    #[serde(default)]
    pub quantize: Option<QuantDtype>,
    /// Element type of every stage's KV cache (carried in the plan; placement sizes the KV reservation in it).
    /// `None`: each worker's own `--kv-dtype`, and placement sizes KV as f32.
    #[serde(default)]
    pub kv_dtype: Option<KvDtype>,
    /// Requests running or queued at once; more are refused with `RESOURCE_EXHAUSTED` (HTTP 429).
    #[serde(default = "default_max_concurrent")]
    pub max_concurrent_requests: usize,
    /// Tokens per micro-batch; longer prompts are prefilled in chunks of this size.
    #[serde(default = "default_max_batch_tokens")]
    pub max_batch_tokens: usize,
    /// Keep prompts' KV blocks on the stages and reuse them for later prompts that start with the same tokens.
    #[serde(default)]
    pub enable_prefix_caching: PrefixCaching,
    /// Micro-batches kept in flight per stage (1 to 16): fewer make bigger batches and a steadier inter-token
    /// latency, more a lower time to first token under bursts and more overlap of wire time with compute.
    #[serde(default = "default_micro_batches_per_stage")]
    pub micro_batches_per_stage: usize,
    /// The most micro-batches in flight through the whole pipeline, 0 for no cap: for stages that share a host's
    /// cores, which cannot all compute at once.
    #[serde(default)]
    pub max_batches_in_flight: usize,
    /// A micro-batch unanswered this long means a stage hangs: its sequences are recomputed elsewhere.
    #[serde(default = "default_batch_timeout")]
    pub batch_timeout_ms: u64,
    /// How long requests wait for a working pipeline (a new plan, a leader) before they fail with `UNAVAILABLE`.
    #[serde(default = "default_recovery_timeout")]
    pub recovery_timeout_ms: u64,
    /// How long a stage may take to answer `Status` when the pipeline connects before it is a suspect.
    #[serde(default = "default_probe_timeout")]
    pub probe_timeout_ms: u64,
    /// How long a stage the pipeline could not reach stays out of placement (unless it registers again).
    #[serde(default = "default_suspect")]
    pub suspect_ms: u64,
    /// HTTP/2 keep-alive ping interval towards the stages.
    #[serde(default = "default_keepalive_interval")]
    pub keepalive_interval_ms: u64,
    /// How long a keep-alive ping may go unanswered before the stage's connection is closed.
    #[serde(default = "default_keepalive_timeout")]
    pub keepalive_timeout_ms: u64,
    /// On SIGTERM, how long in-flight requests get to finish (new ones are refused) before the rest fail.
    #[serde(default = "default_shutdown_grace")]
    pub shutdown_grace_ms: u64,
    /// TLS for both APIs and for the connections to the stages. With a CA, gRPC callers must present a certificate
    /// it signed and stages must present one too (mutual TLS); the HTTP API never asks for a client certificate.
    #[serde(default)]
    pub tls: Option<TlsFiles>,
    /// API keys: with any key set (here or in `admin_api_keys`), calls to both APIs must carry
    /// `Authorization: Bearer <key>` (the probes, `/metrics`, gRPC health and reflection stay open).
    #[serde(default)]
    pub api_keys: Vec<ApiKey>,
    /// Admin API keys: they also work as plain keys, and only they may drain, cordon or uncordon nodes.
    #[serde(default)]
    pub admin_api_keys: Vec<ApiKey>,
    /// Names that make a gRPC caller an administrator under mutual TLS: its client certificate (signed by the CA
    /// in `tls`) carries one as subject common name or DNS/URI alternative name. Needs `tls` with a CA.
    #[serde(default)]
    pub admin_cert_identities: Vec<String>,
    /// Largest HTTP request body accepted, in bytes; larger ones get 413.
    #[serde(default = "default_max_body_bytes")]
    pub max_body_bytes: usize,
}

fn default_cluster() -> String {
    "default".into()
}
fn default_min_stages() -> usize {
    1
}
fn default_lease_ttl() -> u64 {
    5
}
fn default_connect_timeout() -> u64 {
    10_000
}
fn default_batch_timeout() -> u64 {
    30_000
}
fn default_recovery_timeout() -> u64 {
    120_000
}
fn default_probe_timeout() -> u64 {
    2_000
}
fn default_suspect() -> u64 {
    30_000
}
fn default_keepalive_interval() -> u64 {
    Keepalive::DEFAULT_INTERVAL_MS
}
fn default_keepalive_timeout() -> u64 {
    Keepalive::DEFAULT_TIMEOUT_MS
}
fn default_shutdown_grace() -> u64 {
    30_000
}
/// The default HTTP body limit, 2 MiB (axum's): a prompt of the longest context in any model fits many times over.
pub const DEFAULT_MAX_BODY_BYTES: usize = 2 << 20;

fn default_max_body_bytes() -> usize {
    DEFAULT_MAX_BODY_BYTES
}
fn default_max_concurrent() -> usize {
    SchedulerLimits::default().max_concurrent_requests
}
fn default_max_batch_tokens() -> usize {
    SchedulerLimits::default().max_batch_tokens
}
fn default_micro_batches_per_stage() -> usize {
    SchedulerLimits::default().micro_batches_per_stage
}

impl CoordinatorConfig {
    /// A config with defaults for everything but the model and the API addresses.
    pub fn new(model: impl Into<PathBuf>, grpc_addr: SocketAddr, http_addr: SocketAddr) -> Self {
        Self {
            etcd: None,
            cluster: default_cluster(),
            model: model.into(),
            model_name: None,
            grpc_addr,
            http_addr,
            min_stages: default_min_stages(),
            candidate: None,
            lease_ttl_secs: default_lease_ttl(),
            connect_timeout_ms: default_connect_timeout(),
            max_model_len: None,
            min_kv_tokens: None,
            quantize: None,
            kv_dtype: None,
            max_concurrent_requests: default_max_concurrent(),
            max_batch_tokens: default_max_batch_tokens(),
            enable_prefix_caching: PrefixCaching::default(),
            micro_batches_per_stage: default_micro_batches_per_stage(),
            max_batches_in_flight: 0,
            batch_timeout_ms: default_batch_timeout(),
            recovery_timeout_ms: default_recovery_timeout(),
            probe_timeout_ms: default_probe_timeout(),
            suspect_ms: default_suspect(),
            keepalive_interval_ms: default_keepalive_interval(),
            keepalive_timeout_ms: default_keepalive_timeout(),
            shutdown_grace_ms: default_shutdown_grace(),
            tls: None,
            api_keys: Vec::new(),
            admin_api_keys: Vec::new(),
            admin_cert_identities: Vec::new(),
            max_body_bytes: default_max_body_bytes(),
        }
    }

    /// Checks the values make sense together.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Config(m));
        if self.min_stages == 0 {
            return bad("min_stages must be at least 1".into());
        }
        let membership = check_cluster_name(&self.cluster).and_then(|()| match &self.etcd {
            Some(etcd) => etcd.check(),
            None => Ok(()),
        });
        if let Err(e) = membership {
            return bad(e.to_string());
        }
        if self.grpc_addr == self.http_addr && self.grpc_addr.port() != 0 {
            return bad(format!("grpc_addr and http_addr are both {}", self.grpc_addr));
        }
        if self.lease_ttl_secs == 0 {
            return bad("lease_ttl_secs must be at least 1".into());
        }
        if self.connect_timeout_ms == 0 {
            return bad("connect_timeout_ms must be positive".into());
        }
        let timeouts = [
            ("batch_timeout_ms", self.batch_timeout_ms),
            ("recovery_timeout_ms", self.recovery_timeout_ms),
            ("probe_timeout_ms", self.probe_timeout_ms),
            ("keepalive_interval_ms", self.keepalive_interval_ms),
            ("keepalive_timeout_ms", self.keepalive_timeout_ms),
        ];
        if let Some((name, _)) = timeouts.iter().find(|(_, v)| *v == 0) {
            return bad(format!("{name} must be positive"));
        }
        if self.max_concurrent_requests == 0 || self.max_batch_tokens == 0 {
            return bad("max_concurrent_requests and max_batch_tokens must be at least 1".into());
        }
        if !(1..=MAX_MICRO_BATCHES_PER_STAGE).contains(&self.micro_batches_per_stage) {
            return bad(format!(
                "micro_batches_per_stage must be 1 to {MAX_MICRO_BATCHES_PER_STAGE}, not {}",
                self.micro_batches_per_stage
            ));
        }
        if self.model_name.as_deref().is_some_and(|n| n.trim().is_empty() || n.chars().any(char::is_control)) {
            return bad("model_name must be non-empty printable text".into());
        }
        if self.model.as_os_str().is_empty() {
            return bad("model path is empty".into());
        }
        if self.max_body_bytes == 0 {
            return bad("max_body_bytes must be positive".into());
        }
        check_keys("api_keys", &self.api_keys)?;
        check_keys("admin_api_keys", &self.admin_api_keys)?;
        check_identities(&self.admin_cert_identities)?;
        if !self.admin_cert_identities.is_empty() && self.tls.as_ref().is_none_or(|t| t.ca.is_none()) {
            return bad("admin_cert_identities need mutual TLS: set tls with a CA (--tls-ca, STRATA_TLS_CA), so \
                        client certificates are asked for and checked"
                .into());
        }
        Ok(())
    }

    /// The keys and admin certificate identities the APIs accept (none: the APIs are open).
    pub fn keys(&self) -> ApiKeys {
        ApiKeys::new(self.api_keys.clone(), self.admin_api_keys.clone())
            .with_admin_identities(self.admin_cert_identities.clone())
    }

    /// The longest sequence served and the KV tokens every stage must hold, for a model whose context is
    /// `model_context` tokens.
    pub fn context(&self, model_context: usize) -> Result<(usize, u64)> {
        context_limits(self.max_model_len, self.min_kv_tokens, model_context)
    }

    /// How placement sizes the model when every stage must hold `min_kv_tokens` tokens of KV cache.
    pub fn size_options(&self, min_kv_tokens: u64) -> SizeOptions {
        SizeOptions {
            min_kv_tokens,
            max_batch_tokens: self.max_batch_tokens,
            weights: self.quantize.map(QuantDtype::to_engine),
            kv_dtype: self.kv_dtype.unwrap_or_default(),
        }
    }

    /// Loads and checks the TLS files; `None` when TLS is off. Errors name the file.
    pub fn tls(&self) -> Result<Option<Tls>> {
        self.tls.as_ref().map(|files| files.load().map_err(Error::Tls)).transpose()
    }

    /// The scheduler's limits.
    pub fn scheduler_limits(&self) -> SchedulerLimits {
        SchedulerLimits {
            max_concurrent_requests: self.max_concurrent_requests,
            max_batch_tokens: self.max_batch_tokens,
            prefix_caching: self.enable_prefix_caching,
            micro_batches_per_stage: self.micro_batches_per_stage,
            max_batches_in_flight: self.max_batches_in_flight,
        }
    }

    /// How the pipeline runs (its suspects channel unset).
    pub fn pipeline_options(&self, tls: Option<Tls>) -> PipelineOptions {
        PipelineOptions {
            limits: self.scheduler_limits(),
            tls,
            timeouts: Timeouts {
                batch: Duration::from_millis(self.batch_timeout_ms),
                recovery: Duration::from_millis(self.recovery_timeout_ms),
                probe: Duration::from_millis(self.probe_timeout_ms),
            },
            // validate() refused zeros.
            keepalive: Keepalive::from_millis(self.keepalive_interval_ms, self.keepalive_timeout_ms)
                .unwrap_or_default(),
            suspects: None,
        }
    }

    /// How long an unreachable stage stays out of placement.
    pub fn suspect_for(&self) -> Duration {
        Duration::from_millis(self.suspect_ms)
    }

    /// How long in-flight requests get on SIGTERM.
    pub fn shutdown_grace(&self) -> Duration {
        Duration::from_millis(self.shutdown_grace_ms)
    }

    /// The leader lease TTL.
    pub fn lease_ttl(&self) -> Duration {
        Duration::from_secs(self.lease_ttl_secs)
    }

    /// How long to try reaching etcd at start.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }

    /// The name used in the leader election.
    pub fn candidate_name(&self) -> String {
        self.candidate.clone().unwrap_or_else(|| format!("coordinator-{}", std::process::id()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> CoordinatorConfig {
        let addr = |p| SocketAddr::from(([127, 0, 0, 1], p));
        CoordinatorConfig::new("/models/m", addr(50051), addr(8080))
    }

    #[test]
    fn defaults_validate_and_bad_values_are_named() {
        assert!(base().validate().is_ok());
        let mut c = base();
        c.min_stages = 0;
        assert!(c.validate().is_err_and(|e| e.to_string().contains("min_stages")));
        let mut c = base();
        c.http_addr = c.grpc_addr;
        assert!(c.validate().is_err_and(|e| e.to_string().contains("grpc_addr")));
        let mut c = base();
        c.cluster = "a/b".into();
        assert!(c.validate().is_err_and(|e| e.to_string().contains("cluster")));
        let mut c = base();
        c.etcd = Some(EtcdOptions::new(vec![]));
        assert!(c.validate().is_err_and(|e| e.to_string().contains("etcd")));
        let mut c = base();
        c.model_name = Some(" ".into());
        assert!(c.validate().is_err_and(|e| e.to_string().contains("model_name")));
        c.model_name = Some("llama-8b".into());
        assert!(c.validate().is_ok());
        let mut c = base();
        assert_eq!(c.context(4096).ok(), Some((4096, 4096)), "the model's context, all of it in KV");
        c.max_model_len = Some(1024);
        assert_eq!(c.context(4096).ok(), Some((1024, 1024)));
        c.min_kv_tokens = Some(64);
        assert_eq!(c.context(4096).ok(), Some((1024, 64)));
        c.max_model_len = Some(8192);
        assert!(c.context(4096).is_err_and(|e| e.to_string().contains("max_model_len 8192")));
        let mut c = base();
        c.max_batch_tokens = 0;
        assert!(c.validate().is_err_and(|e| e.to_string().contains("max_batch_tokens")));
        let mut c = base();
        assert_eq!(c.scheduler_limits().micro_batches_per_stage, 1);
        c.micro_batches_per_stage = 0;
        assert!(c.validate().is_err_and(|e| e.to_string().contains("micro_batches_per_stage must be 1 to 16, not 0")));
        c.micro_batches_per_stage = 17;
        assert!(c.validate().is_err_and(|e| e.to_string().contains("micro_batches_per_stage")));
        c.micro_batches_per_stage = 16;
        assert!(c.validate().is_ok() && c.scheduler_limits().micro_batches_per_stage == 16);
        assert_eq!(c.scheduler_limits().max_batches_in_flight, 0, "no cap unless set");
        c.max_batches_in_flight = 1;
        assert!(c.validate().is_ok() && c.scheduler_limits().max_batches_in_flight == 1);
        let mut c = base();
        c.max_body_bytes = 0;
        assert!(c.validate().is_err_and(|e| e.to_string().contains("max_body_bytes")));
        let mut c = base();
        assert!(!c.keys().enabled(), "no keys: open");
        c.admin_api_keys = vec![ApiKey::new("a b")];
        assert!(c.validate().is_err_and(|e| e.to_string().contains("admin_api_keys[0]")));
        c.admin_api_keys = vec![ApiKey::new("admin")];
        c.admin_cert_identities = vec!["ops-admin".into()];
        assert!(c.validate().is_err_and(|e| e.to_string().contains("--tls-ca")), "identities need mutual TLS");
        c.tls = Some(TlsFiles { cert: "/x/c.pem".into(), key: "/x/k.pem".into(), ca: Some("/x/ca.pem".into()) });
        assert!(c.validate().is_ok());
        c.admin_cert_identities = vec!["ops admin".into()];
        assert!(c.validate().is_err_and(|e| e.to_string().contains("admin_cert_identities[0]")));
        c.admin_cert_identities.clear();
        c.tls = None;
        assert!(c.validate().is_ok() && c.keys().enabled());
    }

    #[test]
    fn tls_files_are_optional_strict_and_loaded_with_their_names_in_errors() {
        assert!(base().tls().is_ok_and(|t| t.is_none()));
        let json = r#"{"model":"m","grpc_addr":"127.0.0.1:1","http_addr":"127.0.0.1:2","tls":{"cert":"/x/c.pem"}}"#;
        let err = serde_json::from_str::<CoordinatorConfig>(json).expect_err("a certificate without a key");
        assert!(err.to_string().contains("key"), "{err}");
        let mut c = base();
        c.tls = Some(TlsFiles { cert: "/x/c.pem".into(), key: "/x/k.pem".into(), ca: None });
        assert!(c.tls().is_err_and(|e| e.to_string().contains("/x/c.pem")));
    }

    #[test]
    fn unknown_fields_are_rejected() {
        let json = r#"{"model":"m","grpc_addr":"127.0.0.1:1","http_addr":"127.0.0.1:2","min_stage":2}"#;
        let err = serde_json::from_str::<CoordinatorConfig>(json).expect_err("typo must be rejected");
        assert!(err.to_string().contains("min_stage"), "{err}");
    }
}
