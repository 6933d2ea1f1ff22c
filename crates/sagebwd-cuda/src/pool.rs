//! The device's stream-ordered memory pool: peak-memory measurement for the bench and the trainer.

use crate::runtime::drv;
use crate::Gpu;
use cudarc::driver::sys;
use sagebwd::Result;

/// The device's current memory pool, which cudarc's stream-ordered allocations (cuMemAllocAsync)
/// draw from. Its used-memory high-water mark is the exact peak of live allocations, the
/// counterpart of `torch.cuda.max_memory_allocated`.
pub struct Pool(sys::CUmemoryPool);

impl Pool {
    /// None when the context allocates synchronously (no memory pools on this device).
    pub fn of(gpu: &Gpu) -> Result<Option<Pool>> {
        if !gpu.dev.ctx.has_async_alloc() {
            return Ok(None);
        }
        let mut pool = std::ptr::null_mut();
        drv("cuDeviceGetMemPool", unsafe {
            sys::cuDeviceGetMemPool(&mut pool, gpu.dev.ctx.cu_device()).result()
        })?;
        Ok(Some(Pool(pool)))
    }

    pub fn get(&self, attr: sys::CUmemPool_attribute) -> Result<u64> {
        let mut v: u64 = 0;
        drv("cuMemPoolGetAttribute", unsafe {
            sys::cuMemPoolGetAttribute(self.0, attr, &mut v as *mut u64 as *mut _).result()
        })?;
        Ok(v)
    }

    /// Bytes in use now; resets the high-water mark to it (0 is the only value the driver accepts).
    pub fn reset_high(&self) -> Result<u64> {
        let mut zero: u64 = 0;
        drv("cuMemPoolSetAttribute", unsafe {
            sys::cuMemPoolSetAttribute(
                self.0,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
                &mut zero as *mut u64 as *mut _,
            )
            .result()
        })?;
        self.get(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
    }

    /// Keeps freed memory in the pool instead of returning it to the driver at every
    /// synchronization (release threshold 0, the default), as PyTorch's caching allocator does:
    /// otherwise each repetition would map its buffers afresh, a cost no training loop pays.
    pub fn keep_freed_memory(&self) -> Result<()> {
        let mut max = u64::MAX;
        drv("cuMemPoolSetAttribute", unsafe {
            sys::cuMemPoolSetAttribute(
                self.0,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                &mut max as *mut u64 as *mut _,
            )
            .result()
        })
    }

    /// Returns the pool's unused memory to the driver (after a synchronization).
    pub fn trim(&self) -> Result<()> {
        drv("cuMemPoolTrimTo", unsafe { sys::cuMemPoolTrimTo(self.0, 0).result() })
    }

    /// Waits for the work queued on `gpu` (so that its stream-ordered frees have happened), then returns the
    /// pool's unused memory to the driver; nothing to do without memory pools.
    pub fn release_unused(gpu: &Gpu) -> Result<()> {
        let Some(pool) = Pool::of(gpu)? else {
            return Ok(());
        };
        drv("synchronize", gpu.dev.ctx.synchronize())?;
        pool.trim()
    }

    pub fn high(&self) -> Result<u64> {
        self.get(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)
    }
}

// The pool handle is a driver object usable from any thread of the context.
unsafe impl Send for Pool {}
unsafe impl Sync for Pool {}
