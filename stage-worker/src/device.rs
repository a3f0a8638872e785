//! What a worker's config asks of its device: the [`DeviceSpec`] to open (the engine opens it, see
//! [`strata_engine::on_device`]), the GPU memory its KV cache takes, and the load options that go with it.

use strata_engine::backend::Backend;
use strata_engine::config::ModelConfig;
use strata_engine::model::LoadOptions;
use strata_engine::offload::OffloadBudget;
use strata_engine::{DeviceSpec, KvDtype};

use crate::config::WorkerConfig;
use crate::error::Result;

/// GPU memory kept free besides weights and KV cache: activations of the largest batch, attention partials,
/// dequantized weight scratch and cuBLAS workspace.
pub const GPU_WORKSPACE_BYTES: usize = 512 << 20;

impl From<&WorkerConfig> for DeviceSpec {
    fn from(c: &WorkerConfig) -> Self {
        DeviceSpec { device: c.device, threads: c.threads, dtype: c.dtype, gpu_memory_limit: c.gpu_memory_limit }
    }
}

/// The KV cache type `config` asks for on `backend` (the backend's own when it names none).
pub fn kv_dtype<B: Backend>(config: &WorkerConfig, backend: &B) -> KvDtype {
    config.kv_dtype.unwrap_or_else(|| backend.default_kv_dtype())
}

/// Device bytes the KV cache of `layers` layers must have room for with `config`, stored as `kv_dtype`: its fixed
/// capacity, or, when the budget sizes it after loading, the tokens the plan asks for (at least one block), so
/// that offload keeps as many layers resident as that allows and the KV cache gets the rest.
pub fn kv_cache_bytes(config: &WorkerConfig, model: &ModelConfig, layers: usize, kv_dtype: KvDtype) -> Result<usize> {
    let tokens = match config.kv_blocks {
        Some(blocks) => blocks * config.block_size,
        None => usize::try_from(config.min_kv_tokens).unwrap_or(usize::MAX).max(config.block_size),
    };
    Ok(tokens.saturating_mul(layers * kv_dtype.bytes_per_token_layer(model.kv_dim())?))
}

/// Load options for a stage of `layers` layers on `backend`: the weight type and, with a GPU memory limit,
/// the offload budget (the KV cache and [`GPU_WORKSPACE_BYTES`] are reserved from the limit first). Fails when
/// the KV type does not fit the model's rows.
pub fn load_options<B: Backend>(
    config: &WorkerConfig,
    model: &ModelConfig,
    layers: usize,
    backend: &B,
) -> Result<LoadOptions<'static>> {
    let kv_bytes = kv_cache_bytes(config, model, layers, kv_dtype(config, backend))?;
    let offload = config.gpu_memory_limit.map(|limit| OffloadBudget {
        limit_bytes: usize::try_from(limit).unwrap_or(usize::MAX),
        reserve_bytes: kv_bytes + GPU_WORKSPACE_BYTES,
    });
    Ok(LoadOptions {
        dtype: config.dtype.map(|d| d.to_engine()),
        progress: None,
        offload,
        quantize: config.quantize.map(|q| q.to_engine()),
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use strata_engine::backend::cpu::CpuBackend;
    use strata_engine::{Device, FloatDtype, LayerRange, OnBackend, on_device};

    use super::*;
    use crate::error::{Error, Result};

    struct Name;
    impl OnBackend for Name {
        type Out = String;
        type Error = Error;
        fn run<B: Backend>(self, backend: Arc<B>) -> Result<String> {
            Ok(backend.name())
        }
    }

    #[test]
    fn a_worker_config_names_the_device_to_open() -> Result<()> {
        let cpu = WorkerConfig { threads: 1, ..WorkerConfig::new("n", "/m", Some(LayerRange { start: 0, end: 1 })) };
        assert!(on_device(&(&cpu).into(), Name)?.starts_with("cpu"));
        let gpu = WorkerConfig { device: Device::Cuda(0), dtype: Some(FloatDtype::F16), ..cpu };
        let spec = DeviceSpec::from(&gpu);
        assert_eq!((spec.device, spec.threads, spec.dtype), (Device::Cuda(0), 1, Some(FloatDtype::F16)));
        if !cfg!(feature = "cuda") {
            let err = on_device(&spec, Name).err().map(|e| e.to_string()).unwrap_or_default();
            assert_eq!(err, "engine: device cuda:0: this build has no CUDA support (build with --features cuda)");
        }
        Ok(())
    }

    #[test]
    fn the_gpu_budget_reserves_kv_and_workspace() -> Result<()> {
        let model = strata_engine::testing::tiny_config();
        let base = WorkerConfig { kv_blocks: Some(10), block_size: 4, ..WorkerConfig::new("n", "/m", None) };
        let be = CpuBackend::new(1)?;
        assert_eq!(kv_cache_bytes(&base, &model, 2, KvDtype::F16)?, 10 * 4 * 2 * 2 * model.kv_dim() * 2);
        assert!(load_options(&base, &model, 2, &be)?.offload.is_none());
        let gpu = WorkerConfig { gpu_memory_limit: Some(8 << 30), dtype: Some(FloatDtype::Bf16), ..base.clone() };
        let opts = load_options(&gpu, &model, 2, &be)?;
        let budget = opts.offload.map(|b| (b.limit_bytes, b.reserve_bytes));
        assert_eq!(budget, Some((8 << 30, kv_cache_bytes(&base, &model, 2, KvDtype::F32)? + GPU_WORKSPACE_BYTES)));
        // An asked-for KV type sizes the reservation; the CPU's own is f32.
        let q8 = WorkerConfig { kv_dtype: Some(KvDtype::Q8_0), ..gpu.clone() };
        assert_eq!((kv_dtype(&gpu, &be), kv_dtype(&q8, &be)), (KvDtype::F32, KvDtype::Q8_0));
        let reserved = load_options(&q8, &model, 2, &be)?.offload.map(|b| b.reserve_bytes - GPU_WORKSPACE_BYTES);
        assert_eq!(reserved, Some(10 * 4 * 2 * 2 * model.kv_dim() / 32 * 34));
        let odd = ModelConfig { head_dim: 24, ..model.clone() };
        assert!(load_options(&q8, &odd, 2, &be).is_err(), "q8_0 needs rows of whole blocks");
        assert_eq!(opts.dtype, Some(strata_engine::tensor::DType::BF16));
        // Sized from the budget: room for the plan's tokens (at least one block) is reserved before offloading.
        let auto = WorkerConfig { kv_blocks: None, ..base.clone() };
        assert_eq!(kv_cache_bytes(&auto, &model, 2, KvDtype::F16)?, 4 * 2 * 2 * model.kv_dim() * 2);
        let planned = WorkerConfig { min_kv_tokens: 100, ..auto };
        assert_eq!(kv_cache_bytes(&planned, &model, 2, KvDtype::F16)?, 100 * 2 * 2 * model.kv_dim() * 2);
        Ok(())
    }
}
