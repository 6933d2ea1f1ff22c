//! Attention on caller-owned device memory: the entry points of the Python binding.
//!
//! Q, K, V, O, dO, dQ, dK, dV are raw device addresses of contiguous BF16 `[B, H, N, d]` tensors that
//! the caller owns (PyTorch tensors of the same primary context); the work is queued on the
//! caller's stream, with no host synchronization and no host copy.
//!
//! - **Borrowed inputs.** Q, K, V, O and dO are wrapped as `CudaSlice`s for the length of one call
//!   and leaked afterwards ([`Borrowed`]), so the library never frees the caller's memory.
//! - **Streams.** The kernels run on the library's stream (the context's legacy default stream).
//!   When the caller's stream is another one, an event recorded on the caller's stream makes the
//!   kernels' stream wait before the first launch, and an event recorded after the last launch
//!   makes the caller's stream wait: two event records and two stream waits per call, no host wait.
//!   The caller's default (legacy) stream is the kernels' stream itself, and needs neither.
//! - **Outputs.** The kernels write O, dQ, dK, dV straight into the caller's tensors (no copy). The
//!   workspaces (quantized operands, FP32 accumulators) come from the library's stream-ordered memory
//!   pool, outside the caller's allocator.
//! - **Saved state.** [`ExternalForward`] keeps what the backward reads besides Q, K, V, O (the
//!   quantized operands and scales, K mean, row offsets, both LSEs); the caller keeps O.

use crate::runtime::drv;
use crate::{check_supported, DeviceForward, DeviceInputs, Gpu, SavedForBackward};
use cudarc::driver::sys::{CUdeviceptr, CUstream};
use cudarc::driver::CudaSlice;
use sagebwd::{Config, Error, Result, Shape};
use std::mem::ManuallyDrop;

/// Opens the GPU with this ordinal for callers that own their memory: the primary context (the one
/// the CUDA runtime, hence PyTorch, uses), unchecked mode (no poison fills, [`Gpu::set_poison`]),
/// the memory pool keeping freed memory, and no cudarc per-buffer event tracking (the library runs on one cudarc stream, so the events
/// would never be waited on; without tracking a wrapped buffer costs no event creation).
pub fn open(ordinal: usize) -> Result<Gpu> {
    let gpu = Gpu::open(ordinal)?;
    gpu.set_poison(false);
    // SAFETY: every buffer of this context is used on the one cudarc stream `gpu.dev.stream`; the
    // library's second stream is raw and ordered explicitly (`Gpu::order`).
    unsafe { gpu.dev.ctx.disable_event_tracking() };
    // Freed workspaces stay in the pool between calls (as in PyTorch's caching allocator): with the
    // driver's default release threshold every synchronization would unmap them, and every call map
    // them afresh. The pool then holds up to the library's peak working set.
    if let Some(pool) = crate::pool::Pool::of(&gpu)? {
        pool.keep_freed_memory()?;
    }
    Ok(gpu)
}

/// The forward's saved state (besides Q, K, V and O, which the caller keeps).
pub struct ExternalForward {
    pub shape: Shape,
    pub causal: bool,
    /// `[B, H_q, N_q]` base-2 LSE of the true scores.
    lse2: Option<CudaSlice<f32>>,
    /// `[B, H_q, N_q]` natural LSE of the true scores.
    lse: Option<CudaSlice<f32>>,
    saved: SavedForBackward,
}

impl ExternalForward {
    /// Device address of the natural LSE `[B, H_q, N_q]` (FP32), valid while `self` lives.
    pub fn lse_ptr(&self, gpu: &Gpu) -> u64 {
        self.lse.as_ref().map_or(0, |l| gpu.ptr(l))
    }

    pub fn config(&self) -> &Config {
        &self.saved.cfg
    }
}

/// A caller's buffer wrapped as a `CudaSlice` for one call; leaked (never freed) when dropped.
struct Borrowed(ManuallyDrop<CudaSlice<u16>>);

impl Borrowed {
    /// SAFETY: `ptr` must address at least `len` BF16 values of the context of `gpu`, alive for the call.
    unsafe fn new(gpu: &Gpu, ptr: CUdeviceptr, len: usize, what: &str) -> Result<Borrowed> {
        if ptr == 0 {
            return Err(Error::Shape(format!("{what}: null device address")));
        }
        Ok(Borrowed(ManuallyDrop::new(unsafe {
            gpu.dev.stream.upgrade_device_ptr::<u16>(ptr, len)
        })))
    }

    fn take(mut self) -> CudaSlice<u16> {
        let s = unsafe { ManuallyDrop::take(&mut self.0) };
        std::mem::forget(self);
        s
    }
}

impl Drop for Borrowed {
    fn drop(&mut self) {
        let s = unsafe { ManuallyDrop::take(&mut self.0) };
        s.leak();
    }
}

/// `DeviceInputs` whose tensors are borrowed: leaked on drop.
struct BorrowedInputs(ManuallyDrop<DeviceInputs>);

impl BorrowedInputs {
    /// SAFETY: as [`Borrowed::new`] for each of Q (`B·H_q·N_q·d`), K and V (`B·H_kv·N_k·d`).
    unsafe fn new(
        gpu: &Gpu,
        shape: Shape,
        causal: bool,
        q: CUdeviceptr,
        k: CUdeviceptr,
        v: CUdeviceptr,
    ) -> Result<BorrowedInputs> {
        let q = unsafe { Borrowed::new(gpu, q, shape.q_len(), "Q")? };
        let k = unsafe { Borrowed::new(gpu, k, shape.kv_len(), "K")? };
        let v = unsafe { Borrowed::new(gpu, v, shape.kv_len(), "V")? };
        Ok(BorrowedInputs(ManuallyDrop::new(DeviceInputs {
            shape,
            causal,
            q: q.take(),
            k: k.take(),
            v: v.take(),
            d_o: None,
        })))
    }
}

impl std::ops::Deref for BorrowedInputs {
    type Target = DeviceInputs;
    fn deref(&self) -> &DeviceInputs {
        &self.0
    }
}

impl Drop for BorrowedInputs {
    fn drop(&mut self) {
        let x = unsafe { ManuallyDrop::take(&mut self.0) };
        x.q.leak();
        x.k.leak();
        x.v.leak();
        if let Some(d) = x.d_o {
            d.leak();
        }
    }
}

/// A `DeviceForward` whose O is the caller's: O is leaked, never freed, whichever way this goes.
struct BorrowedForward(Option<DeviceForward>);

impl BorrowedForward {
    fn get(&self) -> &DeviceForward {
        self.0.as_ref().expect("present until finish")
    }

    /// The library's own buffers back (O leaked).
    fn finish(mut self) -> (CudaSlice<f32>, CudaSlice<f32>) {
        let DeviceForward { o, lse2, lse } = self.0.take().expect("present until finish");
        o.leak();
        (lse2, lse)
    }
}

impl Drop for BorrowedForward {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f.o.leak();
        }
    }
}

/// Runs `body` on the kernels' stream, ordered after the work queued so far on `caller` and before
/// the work queued on it later (events, no host wait); nothing to order when `caller` is the
/// kernels' stream. The caller's stream is made to wait even when `body` fails, so that buffers the
/// body freed or wrote stay ordered.
fn on_stream<T>(gpu: &Gpu, caller: CUstream, body: impl FnOnce() -> Result<T>) -> Result<T> {
    drv("bind context", gpu.dev.ctx.bind_to_thread())?;
    let main = gpu.main_stream();
    if caller == main {
        return body();
    }
    gpu.order(caller, main)?;
    let out = body();
    let back = gpu.order(main, caller);
    let out = out?;
    back?;
    Ok(out)
}

fn check(shape: &Shape, cfg: &Config) -> Result<()> {
    cfg.validate()?;
    check_supported(shape, cfg)
}

/// The forward on caller-owned Q, K, V (`[B, H_q, N_q, d]`, `[B, H_kv, N_k, d]` ×2, contiguous
/// BF16), O written into `o` (`[B, H_q, N_q, d]`), queued on `stream` ([module docs](self)).
///
/// # Safety
/// The addresses must be device memory of `gpu`'s context holding the tensors of `shape`, alive
/// until the work queued on `stream` has run; `o` must not overlap the inputs.
#[allow(clippy::too_many_arguments)] // the five tensors, the stream, the shape, the mask and the method
pub unsafe fn forward(
    gpu: &Gpu,
    stream: CUstream,
    shape: Shape,
    causal: bool,
    cfg: &Config,
    q: CUdeviceptr,
    k: CUdeviceptr,
    v: CUdeviceptr,
    o: CUdeviceptr,
) -> Result<ExternalForward> {
    check(&shape, cfg)?;
    on_stream(gpu, stream, || {
        let x = unsafe { BorrowedInputs::new(gpu, shape, causal, q, k, v)? };
        if o == 0 {
            return Err(Error::Shape("O: null device address".into()));
        }
        let (fwd, saved) = unsafe { gpu.forward_into(&x, cfg, o)? };
        let DeviceForward { o: o_caller, lse2, lse } = fwd;
        o_caller.leak(); // the caller's tensor
        Ok(ExternalForward {
            shape,
            causal,
            lse2: Some(lse2),
            lse: Some(lse),
            saved,
        })
    })
}

/// The backward of [`forward`]: dQ, dK, dV written into `dq`, `dk`, `dv` from the caller's Q, K, V,
/// O (the forward's output) and dO (`[B, H_q, N_q, d]`, contiguous BF16), queued on `stream`.
/// May run more than once on the same state.
///
/// # Safety
/// As [`forward`], for every address; Q, K, V must hold the values the forward read.
#[allow(clippy::too_many_arguments)]
pub unsafe fn backward(
    gpu: &Gpu,
    stream: CUstream,
    state: &mut ExternalForward,
    q: CUdeviceptr,
    k: CUdeviceptr,
    v: CUdeviceptr,
    o: CUdeviceptr,
    d_o: CUdeviceptr,
    dq: CUdeviceptr,
    dk: CUdeviceptr,
    dv: CUdeviceptr,
) -> Result<()> {
    let shape = state.shape;
    check(&shape, &state.saved.cfg)?;
    on_stream(gpu, stream, || {
        let x = unsafe { BorrowedInputs::new(gpu, shape, state.causal, q, k, v)? };
        let o = unsafe { Borrowed::new(gpu, o, shape.q_len(), "O")? };
        let d_o = unsafe { Borrowed::new(gpu, d_o, shape.q_len(), "dO")? };
        let (Some(lse2), Some(lse)) = (state.lse2.take(), state.lse.take()) else {
            return Err(Error::Backend(
                "the forward's saved LSE is missing (an earlier backward failed)".into(),
            ));
        };
        let fwd = BorrowedForward(Some(DeviceForward { o: o.take(), lse2, lse }));
        for (ptr, what) in [(dq, "dQ"), (dk, "dK"), (dv, "dV")] {
            if ptr == 0 {
                return Err(Error::Shape(format!("{what}: null device address")));
            }
        }
        let into = crate::backward::GradientsInto::Caller { dq, dk, dv };
        let grads = gpu.backward_to(&x, fwd.get(), &state.saved, &d_o.0, into);
        let (lse2, lse) = fwd.finish();
        state.lse2 = Some(lse2);
        state.lse = Some(lse);
        let g = grads?;
        // The caller's tensors; D and the dO quantization are the library's, freed stream-ordered.
        g.dq.leak();
        g.dk.leak();
        g.dv.leak();
        Ok(())
    })
}
