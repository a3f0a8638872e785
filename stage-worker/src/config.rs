//! The worker's configuration: one struct, deserializable, validated before anything is loaded.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use strata_engine::{CpuIsa, Device, FloatDtype, HiddenDtype, KvDtype, LayerRange, QuantDtype};
use strata_proto::{Keepalive, Tls, TlsFiles};

use crate::error::{Error, Result};
use crate::memory::{DEFAULT_MEMORY_FRACTION, DEFAULT_PROFILE_TOKENS};

fn default_memory_fraction() -> f64 {
    DEFAULT_MEMORY_FRACTION
}

fn default_max_batch_tokens() -> usize {
    DEFAULT_PROFILE_TOKENS
}

fn default_block_size() -> usize {
    16
}

fn default_keepalive_interval_ms() -> u64 {
    Keepalive::DEFAULT_INTERVAL_MS
}

fn default_keepalive_timeout_ms() -> u64 {
    Keepalive::DEFAULT_TIMEOUT_MS
}

/// Everything a stage worker needs to serve.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    /// Unique, stable node id.
    pub node_id: String,
    /// Model path: a Hugging Face directory or a `.gguf` file.
    pub model: PathBuf,
    /// The layers to load; `None` when a registry's plan assigns them (see `registration`).
    #[serde(default)]
    pub layers: Option<LayerRange>,
    /// Address (`host:port` or `http://host:port`) of the next stage; `None` makes this the last stage.
    #[serde(default)]
    pub next: Option<String>,
    /// This stage's position in the pipeline, reported in `StageTiming`; defaults to 0 for the first stage
    /// and is required for the others.
    #[serde(default)]
    pub stage_index: Option<u32>,
    /// When set, batches scheduled under another plan epoch are refused with `FAILED_PRECONDITION`.
    #[serde(default)]
    pub plan_epoch: Option<u64>,
    /// CPU threads for compute (0: one per core).
    #[serde(default)]
    pub threads: usize,
    /// Instruction set of the CPU kernels (`auto`: the best this CPU has).
    #[serde(default)]
    pub cpu_isa: CpuIsa,
    /// KV cache capacity in blocks; `None`: whatever the memory budget leaves after the weights and a profiling
    /// batch (see `crate::memory`).
    #[serde(default)]
    pub kv_blocks: Option<usize>,
    /// Memory the worker may hold on the CPU, in bytes: resident pages of the whole process, mapped weights
    /// included. `None`: `memory_fraction` of the RAM. Set, it also makes a plan change free the old layers
    /// before loading new ones, so two copies never coexist.
    #[serde(default)]
    pub memory_limit: Option<u64>,
    /// Keep at most this many of the stage's layers resident; the rest are offloaded (on the CPU paged in from
    /// the model file as they run, on a GPU streamed from host memory). `None`: as many as the budget holds.
    #[serde(default)]
    pub resident_layers: Option<usize>,
    /// Share of the RAM (CPU) or of the device's memory (GPU) the worker offers when no limit is given.
    #[serde(default = "default_memory_fraction")]
    pub memory_fraction: f64,
    /// Tokens of KV cache the stage must hold, or its load fails (from the plan: the coordinator's
    /// `--min-kv-tokens`).
    #[serde(default)]
    pub min_kv_tokens: u64,
    /// Largest batch the coordinator schedules, in tokens: the size of the profiling batch (from the plan).
    #[serde(default = "default_max_batch_tokens")]
    pub max_batch_tokens: usize,
    /// Tokens per KV block.
    #[serde(default = "default_block_size")]
    pub block_size: usize,
    /// Element type of the KV cache; `None`: the backend's own (f32 on the CPU, the activation type on a GPU).
    #[serde(default)]
    pub kv_dtype: Option<KvDtype>,
    /// Element type of hidden states sent downstream.
    #[serde(default)]
    pub hidden_dtype: HiddenDtype,
    /// Compute device.
    #[serde(default)]
    pub device: Device,
    /// Storage type of float weights (and, on a GPU, of activations); `None`: the file's type on the CPU,
    /// bf16 on a GPU (f16 before sm_80). Quantized weights stay quantized.
    #[serde(default)]
    pub dtype: Option<FloatDtype>,
    /// Block format float weight matrices are quantized to as they load; `None`: kept as floats.
    #[serde(default)]
    pub quantize: Option<QuantDtype>,
    /// Device memory the stage may use on a GPU, in bytes; layers beyond it are streamed from host memory.
    #[serde(default)]
    pub gpu_memory_limit: Option<u64>,
    /// TLS for the Stage server and the link to the next stage; with a CA, peers must present a certificate it
    /// signed. `None`: plaintext.
    #[serde(default)]
    pub tls: Option<TlsFiles>,
    /// Milliseconds between HTTP/2 keepalive PINGs on the Stage server's connections and on the link to the next
    /// stage.
    #[serde(default = "default_keepalive_interval_ms")]
    pub keepalive_interval_ms: u64,
    /// Milliseconds a PING may go unanswered before the connection is closed (a hung peer's streams then fail
    /// with `UNAVAILABLE`).
    #[serde(default = "default_keepalive_timeout_ms")]
    pub keepalive_timeout_ms: u64,
    /// Address (`host:port`) to serve Prometheus metrics on at `GET /metrics`; `None`: no metrics endpoint.
    #[serde(default)]
    pub metrics_listen: Option<String>,
    /// Testing hook: the executor panics when it is about to run a batch after this many, to exercise how a
    /// worker takes itself out of service. Never set in production.
    #[serde(default)]
    pub fault_panic_after_batches: Option<u64>,
}

impl WorkerConfig {
    /// A config with defaults for everything but the node id, model and layer range.
    pub fn new(node_id: impl Into<String>, model: impl Into<PathBuf>, layers: Option<LayerRange>) -> Self {
        WorkerConfig {
            node_id: node_id.into(),
            model: model.into(),
            layers,
            next: None,
            stage_index: None,
            plan_epoch: None,
            threads: 0,
            cpu_isa: CpuIsa::Auto,
            kv_blocks: None,
            memory_limit: None,
            memory_fraction: default_memory_fraction(),
            resident_layers: None,
            min_kv_tokens: 0,
            max_batch_tokens: default_max_batch_tokens(),
            block_size: default_block_size(),
            kv_dtype: None,
            hidden_dtype: HiddenDtype::default(),
            device: Device::default(),
            dtype: None,
            quantize: None,
            gpu_memory_limit: None,
            tls: None,
            keepalive_interval_ms: default_keepalive_interval_ms(),
            keepalive_timeout_ms: default_keepalive_timeout_ms(),
            metrics_listen: None,
            fault_panic_after_batches: None,
        }
    }

    /// Checks what can be checked without opening the model; returns the layer range to load.
    pub fn validate(&self) -> Result<LayerRange> {
        self.validate_common()?;
        let layers = self.layers.ok_or(Error::NoLayers)?;
        if layers.is_empty() {
            return Err(Error::Config(format!("layer range {layers} is empty")));
        }
        if layers.start > 0 && self.stage_index.is_none() {
            return Err(Error::Config(format!(
                "stage_index is required for a stage that does not start at layer 0 (layers {layers})"
            )));
        }
        Ok(layers)
    }

    /// Checks everything but the layer range (which a plan may supply later).
    pub fn validate_common(&self) -> Result<()> {
        if self.node_id.trim().is_empty() {
            return Err(Error::Config("node_id must not be empty".into()));
        }
        self.device.check_compiled()?;
        match (self.gpu_memory_limit, self.device) {
            (Some(0), _) => return Err(Error::Config("gpu_memory_limit must be more than 0 bytes".into())),
            (Some(_), Device::Cpu) => {
                return Err(Error::Config("gpu_memory_limit applies to a cuda:N device, not cpu".into()));
            }
            _ => {}
        }
        match (self.cpu_isa, self.device) {
            (CpuIsa::Auto, _) => {}
            // A level this CPU lacks is refused here, before anything is loaded.
            (isa, Device::Cpu) => _ = isa.resolve()?,
            (_, Device::Cuda(_)) => {
                return Err(Error::Config("cpu_isa applies to the cpu device, not cuda:N".into()));
            }
        }
        if self.kv_blocks == Some(0) {
            return Err(Error::Config("kv_blocks must be at least 1".into()));
        }
        if self.memory_limit == Some(0) {
            return Err(Error::Config("memory_limit must be more than 0 bytes".into()));
        }
        if !(self.memory_fraction > 0.0 && self.memory_fraction <= 1.0) {
            return Err(Error::Config(format!("memory_fraction must be in (0, 1], not {}", self.memory_fraction)));
        }
        if self.max_batch_tokens == 0 {
            return Err(Error::Config("max_batch_tokens must be at least 1".into()));
        }
        if self.block_size == 0 {
            return Err(Error::Config("block_size must be at least 1".into()));
        }
        if let Some(next) = &self.next
            && next.trim().is_empty()
        {
            return Err(Error::Config("next must be an address, or absent on the last stage".into()));
        }
        self.keepalive()?;
        Ok(())
    }

    /// The HTTP/2 keepalive of the server and of the link to the next stage.
    pub fn keepalive(&self) -> Result<Keepalive> {
        Keepalive::from_millis(self.keepalive_interval_ms, self.keepalive_timeout_ms).ok_or_else(|| {
            Error::Config(format!(
                "keepalive interval and timeout must be at least 1 ms (got {} and {})",
                self.keepalive_interval_ms, self.keepalive_timeout_ms
            ))
        })
    }

    /// Loads and checks the TLS files; `None` when TLS is off. Errors name the file.
    pub fn tls(&self) -> Result<Option<Tls>> {
        self.tls.as_ref().map(|files| files.load().map_err(Error::Tls)).transpose()
    }

    /// Checks the config against the model's layer count.
    pub fn validate_against_model(&self, layers: LayerRange, num_layers: usize) -> Result<()> {
        if layers.end > num_layers {
            return Err(Error::Config(format!("layer range {layers} is outside the model's {num_layers} layers")));
        }
        match (&self.next, layers.end == num_layers) {
            (Some(next), true) => Err(Error::Config(format!(
                "layers {layers} end at the model's last layer, so this is the last stage, but next = {next:?}"
            ))),
            (None, false) => Err(Error::Config(format!(
                "layers {layers} stop before the model's {num_layers} layers, so next (the next stage's address) is required"
            ))),
            _ => Ok(()),
        }
    }

    /// The next stage's address as a URI.
    pub fn next_uri(&self) -> Option<String> {
        self.next.as_ref().map(|n| {
            let n = n.trim();
            if n.starts_with("http://") || n.starts_with("https://") { n.to_owned() } else { format!("http://{n}") }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_deserializes_with_defaults_and_rejects_unknown_fields() -> std::result::Result<(), serde_json::Error> {
        let cfg: WorkerConfig =
            serde_json::from_str(r#"{"node_id":"a","model":"/m","layers":"0..4","hidden_dtype":"bf16"}"#)?;
        assert_eq!(cfg.layers, Some(LayerRange { start: 0, end: 4 }));
        assert_eq!((cfg.block_size, cfg.hidden_dtype, cfg.device), (16, HiddenDtype::Bf16, Device::Cpu));
        assert_eq!((cfg.dtype, cfg.gpu_memory_limit, cfg.quantize, cfg.kv_dtype), (None, None, None, None));
        assert_eq!(cfg.keepalive().ok(), Some(Keepalive::DEFAULT));
        assert_eq!((cfg.fault_panic_after_batches, cfg.cpu_isa), (None, CpuIsa::Auto));
        let scalar: WorkerConfig = serde_json::from_str(r#"{"node_id":"a","model":"/m","cpu_isa":"scalar"}"#)?;
        assert_eq!(scalar.cpu_isa.to_string(), "scalar");
        assert!(serde_json::from_str::<WorkerConfig>(r#"{"node_id":"a","model":"/m","cpu_isa":"sse4"}"#).is_err());
        let gpu: WorkerConfig = serde_json::from_str(
            r#"{"node_id":"a","model":"/m","device":"cuda:1","dtype":"f16","gpu_memory_limit":1000,"quantize":"q8_0",
                "kv_dtype":"f16"}"#,
        )?;
        assert_eq!((gpu.device, gpu.dtype, gpu.gpu_memory_limit), (Device::Cuda(1), Some(FloatDtype::F16), Some(1000)));
        assert_eq!((gpu.quantize, gpu.kv_dtype), (Some(QuantDtype::Q8_0), Some(KvDtype::F16)));
        assert!(serde_json::from_str::<WorkerConfig>(r#"{"node_id":"a","model":"/m","colour":1}"#).is_err());
        assert!(serde_json::from_str::<WorkerConfig>(r#"{"node_id":"a","model":"/m","layers":"4..1"}"#).is_err());
        Ok(())
    }

    #[test]
    fn validation_catches_bad_configs() {
        let ok = WorkerConfig::new("n", "/m", Some(LayerRange { start: 0, end: 2 }));
        assert!(ok.validate().is_ok());
        let gpu = WorkerConfig { device: Device::Cuda(0), ..ok.clone() };
        if cfg!(feature = "cuda") {
            assert!(gpu.validate().is_ok(), "a cuda build accepts cuda:N (the device is opened at load)");
        } else {
            assert!(matches!(gpu.validate(), Err(Error::Engine(strata_engine::Error::CudaNotCompiled { .. }))));
        }
        assert!(WorkerConfig { gpu_memory_limit: Some(1 << 30), ..ok.clone() }.validate().is_err(), "cpu");
        assert!(WorkerConfig { gpu_memory_limit: Some(0), ..gpu.clone() }.validate().is_err());
        let scalar = "scalar".parse().ok().unwrap_or_default();
        assert!(WorkerConfig { cpu_isa: scalar, ..ok.clone() }.validate().is_ok());
        assert!(WorkerConfig { cpu_isa: scalar, ..gpu.clone() }.validate().is_err(), "a cuda device");
        // A level this CPU lacks is refused before loading; one it has is accepted.
        for level in ["avx2", "avx-vnni", "avx512-vnni"] {
            let isa: CpuIsa = level.parse().ok().unwrap_or_default();
            let has = isa.resolve().is_ok();
            assert_eq!(WorkerConfig { cpu_isa: isa, ..ok.clone() }.validate().is_ok(), has, "{level}");
        }
        assert!(matches!(WorkerConfig { layers: None, ..ok.clone() }.validate(), Err(Error::NoLayers)));
        assert!(WorkerConfig { node_id: " ".into(), ..ok.clone() }.validate().is_err());
        assert!(WorkerConfig { kv_blocks: Some(0), ..ok.clone() }.validate().is_err());
        assert!(WorkerConfig { memory_fraction: 0.0, ..ok.clone() }.validate().is_err());
        assert!(WorkerConfig { memory_fraction: 1.5, ..ok.clone() }.validate().is_err());
        assert!(WorkerConfig { memory_limit: Some(0), ..ok.clone() }.validate().is_err());
        assert!(WorkerConfig { keepalive_timeout_ms: 0, ..ok.clone() }.validate().is_err());
        let middle = WorkerConfig { layers: Some(LayerRange { start: 1, end: 2 }), ..ok.clone() };
        assert!(middle.validate().is_err(), "stage_index required");
        assert!(ok.validate_against_model(LayerRange { start: 0, end: 2 }, 4).is_err(), "next missing");
        let with_next = WorkerConfig { next: Some("h:1".into()), ..ok };
        assert!(with_next.validate_against_model(LayerRange { start: 0, end: 4 }, 4).is_err(), "next on last");
        assert!(with_next.validate_against_model(LayerRange { start: 0, end: 2 }, 4).is_ok());
        assert_eq!(with_next.next_uri().as_deref(), Some("http://h:1"));
    }

    #[test]
    fn tls_files_are_part_of_the_config_and_checked_at_load() -> std::result::Result<(), serde_json::Error> {
        let cfg: WorkerConfig =
            serde_json::from_str(r#"{"node_id":"a","model":"/m","tls":{"cert":"/c.pem","key":"/k.pem"}}"#)?;
        assert_eq!(cfg.tls.as_ref().map(|t| t.cert.clone()), Some(PathBuf::from("/c.pem")));
        assert!(serde_json::from_str::<WorkerConfig>(r#"{"node_id":"a","model":"/m","tls":{"cert":"/c"}}"#).is_err());
        let err = cfg.tls().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("/c.pem"), "a missing file is named: {err}");
        assert!(WorkerConfig::new("n", "/m", None).tls().is_ok_and(|t| t.is_none()));
        Ok(())
    }
}
