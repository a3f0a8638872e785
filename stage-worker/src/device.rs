//! Opening the compute device a worker config names (`cpu` or `cuda:N`) and the load options that go with it.
//! Model code is generic over the backend, so callers pass a [`OnBackend`] visitor that runs with whichever
//! backend was opened.

use std::sync::Arc;

use strata_engine::backend::Backend;
use strata_engine::backend::cpu::CpuBackend;
use strata_engine::config::ModelConfig;
use strata_engine::model::LoadOptions;
use strata_engine::offload::OffloadBudget;

use crate::config::{Device, FloatDtype, WorkerConfig};
use crate::error::{Error, Result};

/// GPU memory kept free besides weights and KV cache: activations of the largest batch, attention partials,
/// dequantized weight scratch and cuBLAS workspace.
pub const GPU_WORKSPACE_BYTES: usize = 512 << 20;

/// Work to run with an opened backend, whatever its type.
pub trait OnBackend {
    /// What the work produces.
    type Out;
    /// Runs the work on `backend`.
    fn run<B: Backend>(self, backend: Arc<B>) -> Result<Self::Out>;
}

/// What opening a device needs (a worker takes it from its config; `strata generate`/`bench` from flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeviceSpec {
    /// The device.
    pub device: Device,
    /// CPU threads (0: one per core); CPU only.
    pub threads: usize,
    /// Float weight type; on a GPU also the activation type (default bf16, f16 before sm_80).
    pub dtype: Option<FloatDtype>,
    /// Device memory limit in bytes; GPU only.
    pub gpu_memory_limit: Option<u64>,
}

impl From<&WorkerConfig> for DeviceSpec {
    fn from(c: &WorkerConfig) -> Self {
        DeviceSpec { device: c.device, threads: c.threads, dtype: c.dtype, gpu_memory_limit: c.gpu_memory_limit }
    }
}

/// Opens the device `spec` names and runs `work` on it. A `cuda:N` device in a build without the `cuda`
/// feature is an error, as is a machine without an NVIDIA driver.
pub fn on_device<W: OnBackend>(spec: &DeviceSpec, work: W) -> Result<W::Out> {
    match spec.device {
        Device::Cpu => work.run(Arc::new(CpuBackend::new(spec.threads)?)),
        Device::Cuda(n) => run_cuda(spec, n, work),
    }
}

#[cfg(feature = "cuda")]
fn run_cuda<W: OnBackend>(config: &DeviceSpec, ordinal: u32, work: W) -> Result<W::Out> {
    use strata_engine::backend::cuda::{CudaBackend, CudaOptions};
    let memory_limit = config
        .gpu_memory_limit
        .map(usize::try_from)
        .transpose()
        .map_err(|_| Error::Config("gpu_memory_limit does not fit this platform's address space".into()))?;
    // The kernel cache and CUDA header locations follow the usual variables (XDG_CACHE_HOME, CUDA_HOME, ...).
    let opts = CudaOptions {
        act_dtype: config.dtype.map(|d| d.to_engine()),
        memory_limit,
        ..CudaOptions::from_env(ordinal as usize, |k| std::env::var(k).ok())
    };
    work.run(Arc::new(CudaBackend::new(opts)?))
}

#[cfg(not(feature = "cuda"))]
fn run_cuda<W: OnBackend>(_config: &DeviceSpec, ordinal: u32, _work: W) -> Result<W::Out> {
    Err(Error::CudaNotCompiled { device: format!("cuda:{ordinal}") })
}

/// Device bytes the KV cache of `layers` layers takes with `config`'s capacity.
pub fn kv_cache_bytes(config: &WorkerConfig, model: &ModelConfig, layers: usize, elem_bytes: usize) -> usize {
    config.kv_blocks * config.block_size * layers * 2 * model.kv_dim() * elem_bytes
}

/// Load options for a stage of `layers` layers on `backend`: the weight type and, with a GPU memory limit,
/// the offload budget (the KV cache and [`GPU_WORKSPACE_BYTES`] are reserved from the limit first).
pub fn load_options<B: Backend>(
    config: &WorkerConfig,
    model: &ModelConfig,
    layers: usize,
    backend: &B,
) -> LoadOptions<'static> {
    let offload = config.gpu_memory_limit.map(|limit| OffloadBudget {
        limit_bytes: usize::try_from(limit).unwrap_or(usize::MAX),
        reserve_bytes: kv_cache_bytes(config, model, layers, backend.kv_elem_bytes()) + GPU_WORKSPACE_BYTES,
    });
    LoadOptions { dtype: config.dtype.map(|d| d.to_engine()), progress: None, offload }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{FloatDtype, LayerRange};

    struct Name;
    impl OnBackend for Name {
        type Out = String;
        fn run<B: Backend>(self, backend: Arc<B>) -> Result<String> {
            Ok(backend.name())
        }
    }

    #[test]
    fn cpu_opens_and_cuda_needs_a_build_and_a_driver() -> Result<()> {
        let cpu = WorkerConfig { threads: 1, ..WorkerConfig::new("n", "/m", Some(LayerRange { start: 0, end: 1 })) };
        assert!(on_device(&(&cpu).into(), Name)?.starts_with("cpu"));
        let gpu = WorkerConfig { device: Device::Cuda(0), ..cpu };
        match on_device(&(&gpu).into(), Name) {
            // A machine with a GPU and a cuda build opens it.
            Ok(name) => assert!(name.starts_with("cuda:0")),
            Err(e) if cfg!(feature = "cuda") => {
                assert!(e.to_string().contains("CUDA"), "{e}");
            }
            Err(e) => {
                assert_eq!(e.to_string(), "device cuda:0: this build has no CUDA support (build with --features cuda)")
            }
        }
        Ok(())
    }

    #[test]
    fn the_gpu_budget_reserves_kv_and_workspace() -> Result<()> {
        let model = strata_engine::testing::tiny_config();
        let base = WorkerConfig { kv_blocks: 10, block_size: 4, ..WorkerConfig::new("n", "/m", None) };
        let be = CpuBackend::new(1)?;
        assert_eq!(kv_cache_bytes(&base, &model, 2, 2), 10 * 4 * 2 * 2 * model.kv_dim() * 2);
        assert!(load_options(&base, &model, 2, &be).offload.is_none());
        let gpu = WorkerConfig { gpu_memory_limit: Some(8 << 30), dtype: Some(FloatDtype::Bf16), ..base.clone() };
        let opts = load_options(&gpu, &model, 2, &be);
        let budget = opts.offload.map(|b| (b.limit_bytes, b.reserve_bytes));
        assert_eq!(budget, Some((8 << 30, kv_cache_bytes(&base, &model, 2, 4) + GPU_WORKSPACE_BYTES)));
        assert_eq!(opts.dtype, Some(strata_engine::tensor::DType::BF16));
        Ok(())
    }
}
