//! What a worker's config asks of its device: the [`DeviceSpec`] to open (the engine opens it, see
//! [`strata_engine::on_device`]), the GPU memory its KV cache takes, and the load options that go with it.

use std::ops::Range;

use strata_engine::backend::Backend;
use strata_engine::config::ModelConfig;
use strata_engine::model::LoadOptions;
use strata_engine::offload::OffloadBudget;
use strata_engine::stage_memory::{logits_bytes, stage_overhead_bytes};
use strata_engine::{DeviceSpec, KvDtype};

use crate::config::WorkerConfig;
use crate::error::Result;
use crate::memory::{budget, total_ram};

/// GPU memory reserved besides weights and KV cache before a stage is measured: activations of the largest batch,
/// attention partials, dequantized weight scratch and cuBLAS workspace. Offload planning reserves it before
/// loading; after loading, the KV cache is sized from the measured peak instead (see `memory`), where the driver
/// keeps count.
pub const GPU_WORKSPACE_BYTES: usize = 512 << 20;

/// cuBLAS's own workspace, which it allocates outside the memory pool the measured peak covers (32 MiB on Hopper,
/// less on older GPUs).
pub const CUBLAS_WORKSPACE_BYTES: usize = 32 << 20;

impl From<&WorkerConfig> for DeviceSpec {
    fn from(c: &WorkerConfig) -> Self {
        DeviceSpec {
            device: c.device,
            threads: c.threads,
            cpu_isa: c.cpu_isa,
            dtype: c.dtype,
            gpu_memory_limit: c.gpu_memory_limit,
        }
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

/// Load options for a stage of `layers` on `backend`: the weight type and the offload budget. On a GPU that is
/// `--gpu-memory-limit` with the KV cache and [`GPU_WORKSPACE_BYTES`] reserved first; on the CPU the memory budget
/// (`--memory-limit`, else `--memory-fraction` of the RAM) with the KV cache and what a stage holds besides
/// ([`stage_overhead_bytes`], logits on the last stage) reserved, so that layers beyond it page in from the model
/// file rather than outgrow the budget, the same rule placement counts with. `--resident-layers` caps the
/// resident layers on either. Fails when the KV type does not fit the model's rows.
pub fn load_options<B: Backend>(
    config: &WorkerConfig,
    model: &ModelConfig,
    layers: Range<usize>,
    backend: &B,
) -> Result<LoadOptions<'static>> {
    let kv_bytes = kv_cache_bytes(config, model, layers.len(), kv_dtype(config, backend))?;
    let offload = offload_budget(config, model, &layers, kv_bytes, backend.device_memory_capacity().is_some());
    Ok(LoadOptions {
        dtype: config.dtype.map(|d| d.to_engine()),
        progress: None,
        offload,
        resident_layers: config.resident_layers,
        quantize: config.quantize.map(|q| q.to_engine()),
    })
}

/// The offload budget of [`load_options`] for a stage whose KV cache takes `kv_bytes`, on a device with memory
/// of its own (`on_device`) or on the CPU.
fn offload_budget(
    config: &WorkerConfig,
    model: &ModelConfig,
    layers: &Range<usize>,
    kv_bytes: usize,
    on_device: bool,
) -> Option<OffloadBudget> {
    let to_usize = |b: u64| usize::try_from(b).unwrap_or(usize::MAX);
    if on_device {
        return config.gpu_memory_limit.map(|limit| OffloadBudget {
            limit_bytes: to_usize(limit),
            reserve_bytes: kv_bytes + GPU_WORKSPACE_BYTES,
        });
    }
    let logits = if layers.end == model.num_layers { logits_bytes(model, config.max_batch_tokens) } else { 0 };
    let held = stage_overhead_bytes(model, config.max_batch_tokens).saturating_add(logits);
    budget(config.memory_limit, config.memory_fraction, total_ram()).map(|limit| OffloadBudget {
        limit_bytes: to_usize(limit),
        reserve_bytes: kv_bytes.saturating_add(to_usize(held)),
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
        let gpu = WorkerConfig { gpu_memory_limit: Some(8 << 30), dtype: Some(FloatDtype::Bf16), ..base.clone() };
        let opts = load_options(&gpu, &model, 0..2, &be)?;
        let budget = offload_budget(&gpu, &model, &(0..2), kv_cache_bytes(&base, &model, 2, KvDtype::F32)?, true)
            .map(|b| (b.limit_bytes, b.reserve_bytes));
        assert_eq!(budget, Some((8 << 30, kv_cache_bytes(&base, &model, 2, KvDtype::F32)? + GPU_WORKSPACE_BYTES)));
        // An asked-for KV type sizes the reservation; the CPU's own is f32.
        let q8 = WorkerConfig { kv_dtype: Some(KvDtype::Q8_0), ..gpu.clone() };
        assert_eq!((kv_dtype(&gpu, &be), kv_dtype(&q8, &be)), (KvDtype::F32, KvDtype::Q8_0));
        let q8_kv = kv_cache_bytes(&q8, &model, 2, kv_dtype(&q8, &be))?;
        assert_eq!(q8_kv, 10 * 4 * 2 * 2 * model.kv_dim() / 32 * 34);
        let odd = ModelConfig { head_dim: 24, ..model.clone() };
        assert!(load_options(&q8, &odd, 0..2, &be).is_err(), "q8_0 needs rows of whole blocks");
        assert_eq!(opts.dtype, Some(strata_engine::tensor::DType::BF16));
        // Sized from the budget: room for the plan's tokens (at least one block) is reserved before offloading.
        let auto = WorkerConfig { kv_blocks: None, ..base.clone() };
        assert_eq!(kv_cache_bytes(&auto, &model, 2, KvDtype::F16)?, 4 * 2 * 2 * model.kv_dim() * 2);
        let planned = WorkerConfig { min_kv_tokens: 100, ..auto };
        assert_eq!(kv_cache_bytes(&planned, &model, 2, KvDtype::F16)?, 100 * 2 * 2 * model.kv_dim() * 2);
        Ok(())
    }

    #[test]
    fn the_cpu_budget_reserves_kv_overhead_and_the_last_stages_logits() -> Result<()> {
        let model = strata_engine::testing::tiny_config();
        let limited = WorkerConfig { memory_limit: Some(1 << 30), ..WorkerConfig::new("n", "/m", None) };
        let overhead = stage_overhead_bytes(&model, limited.max_batch_tokens) as usize;
        let logits = logits_bytes(&model, limited.max_batch_tokens) as usize;
        let first = offload_budget(&limited, &model, &(0..2), 1000, false);
        assert_eq!(first, Some(OffloadBudget { limit_bytes: 1 << 30, reserve_bytes: 1000 + overhead }));
        let last = offload_budget(&limited, &model, &(2..model.num_layers), 1000, false);
        assert_eq!(last.map(|b| b.reserve_bytes), Some(1000 + overhead + logits));
        // Without a limit, the fraction of the RAM the worker offers.
        let unlimited = offload_budget(&WorkerConfig::new("n", "/m", None), &model, &(0..2), 0, false);
        assert!(unlimited.is_some_and(|b| b.limit_bytes > 0));
        // A GPU without a limit offloads nothing; the CPU's --memory-limit is not a GPU budget.
        assert_eq!(offload_budget(&limited, &model, &(0..2), 0, true), None);
        let resident = WorkerConfig { resident_layers: Some(1), ..limited };
        assert_eq!(load_options(&resident, &model, 0..2, &CpuBackend::new(1)?)?.resident_layers, Some(1));
        Ok(())
    }
}
