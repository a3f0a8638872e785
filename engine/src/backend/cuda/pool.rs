//! The most device memory this process has held allocated, from the driver's memory pool. cudarc allocates
//! stream-ordered (`cuMemAllocAsync`) from the device's default pool wherever the driver supports it, and the
//! pool keeps a high-water mark of the bytes in use (`CU_MEMPOOL_ATTR_USED_MEM_HIGH`) that can be reset. That is
//! what the stage worker sizes the KV cache from after a profiling batch: weights, staging slots and the
//! activations of the largest batch, measured instead of estimated. The CUDA context and cuBLAS's own workspace
//! are not pool allocations and are not counted.

use std::ffi::c_void;

use cudarc::driver::CudaContext;
use cudarc::driver::sys::{self, CUmemPool_attribute, CUmemoryPool, CUresult};

use crate::{Error, Result};

fn check(what: &str, r: CUresult) -> Result<()> {
    if r == CUresult::CUDA_SUCCESS { Ok(()) } else { Err(Error::Device(format!("{what}: {r:?}"))) }
}

/// The device's default pool; `None` when the driver does not allocate from pools.
fn default_pool(ctx: &CudaContext) -> Result<Option<CUmemoryPool>> {
    if !ctx.has_async_alloc() {
        return Ok(None);
    }
    let mut pool: CUmemoryPool = std::ptr::null_mut();
    // SAFETY: writes one pool handle for a device the context has open.
    check("finding the default memory pool", unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) })?;
    Ok(Some(pool))
}

/// Restarts the high-water mark at the bytes in use now.
pub(super) fn reset_peak(ctx: &CudaContext) -> Result<()> {
    let Some(pool) = default_pool(ctx)? else {
        return Ok(());
    };
    // The driver only accepts 0 here, meaning "reset to the current use".
    let mut zero: u64 = 0;
    let attr = CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
    // SAFETY: `pool` is the device's default pool and the value is the u64 this attribute takes.
    check("resetting the memory pool's peak", unsafe {
        sys::cuMemPoolSetAttribute(pool, attr, (&mut zero as *mut u64).cast::<c_void>())
    })
}

/// Bytes in use at the high-water mark since the last [`reset_peak`]; `None` without pools.
pub(super) fn peak(ctx: &CudaContext) -> Result<Option<usize>> {
    let Some(pool) = default_pool(ctx)? else {
        return Ok(None);
    };
    let mut high: u64 = 0;
    let attr = CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
    // SAFETY: as above; the attribute is read into a u64.
    check("reading the memory pool's peak", unsafe {
        sys::cuMemPoolGetAttribute(pool, attr, (&mut high as *mut u64).cast::<c_void>())
    })?;
    Ok(Some(usize::try_from(high).unwrap_or(usize::MAX)))
}
