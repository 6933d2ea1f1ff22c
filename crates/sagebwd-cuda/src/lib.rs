//! # sagebwd-cuda — the CUDA backend of sagebwd
//!
//! Kernels for the SageBwd method of `docs/ALGORITHM.md` (forward + backward, each of the seven
//! products INT8 or BF16), compiled at run time by NVRTC for the GPU at hand and cached on disk.
//! The crate builds without CUDA; the driver and NVRTC are loaded when [`Gpu::new`] runs.
//!
//! - [`Gpu::new`], [`Gpu::run`]: the whole method on host inputs, results in the simulator's
//!   [`SimOutput`] so they compare value by value;
//! - [`Gpu::upload`], [`Gpu::forward`], [`Gpu::backward`]: the stages on device tensors
//!   ([`DeviceInputs`], [`DeviceForward`], [`SavedForBackward`], [`DeviceGradients`]);
//! - [`KernelPlan`] ([`Gpu::plan`], `sagebwd plan`): which kernels run for a configuration, shape and
//!   architecture; [`Tuning`] ([`Gpu::set_tuning`]): every override of that choice.
//!
//! Kernels: on sm_90a (H100, H200) warp-specialized `wgmma` forwards fed by TMA (INT8 for `sagebwd`, BF16 for
//! `fpa`) and `wgmma` backwards; on every other sm_80+ GPU `mma.sync` kernels (m16n8k32 INT8, m16n8k16 BF16) with
//! fragments gathered from strided views of the operands; scalar versions (dp4a / FP32) as references
//! ([`Gpu::set_tensor_cores`]). `docs/ARCHITECTURE.md` has the kernel map.
//!
//! ```no_run
//! use sagebwd::{inputs::random, Config, Shape};
//! use sagebwd_cuda::Gpu;
//!
//! # fn main() -> sagebwd::Result<()> {
//! let gpu = Gpu::new()?; // an Error, not a panic, without a driver, a GPU or NVRTC
//! let shape = Shape { batch: 2, heads_q: 8, heads_kv: 2, n_q: 1024, n_k: 1024, head_dim: 128 };
//! let cfg = Config::sagebwd();
//! println!("{}", gpu.plan(&cfg, &shape, true)); // the kernels that will run
//! let x = gpu.upload(&random(shape, true, 1.0, 0, true))?;
//! let (fwd, saved) = gpu.forward(&x, &cfg)?; // O, LSE on the device
//! let grads = gpu.backward(&x, &fwd, &saved, x.d_o.as_ref().expect("dO"))?; // dQ, dK, dV on the device
//! # let _ = grads;
//! # Ok(())
//! # }
//! ```

pub mod backward;
pub mod energy;
pub mod external;
pub mod forward;
pub mod plan;
pub mod pool;
pub mod quantize;
pub mod runtime;
mod tma;

pub use backward::DeviceGradients;
pub use forward::{DeviceForward, SavedForBackward};
pub use plan::{GroupPolicy, KernelPlan, Tuning};
pub use quantize::{QuantizedDev, QuantizedDo};

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig, PushKernelArg};
use runtime::{drv, Device, Kernels, BLOCK_KV, BLOCK_Q, HEAD_DIMS};
use sagebwd::sim::{Forward, Gradients, Quantized, SimOutput};
use sagebwd::{Config, Error, Inputs, Result, Shape};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

pub(crate) use plan::{flags, F_DQ_CORR, F_SMOOTH_K, F_TMA_KQ};

// Poison patterns: NaN for floats and BF16; −128 for INT8, which the quantizer never produces.
const POISON_F32: u32 = 0x7fc0_0000;
const POISON_BF16X2: u32 = 0x7fc0_7fc0;
const POISON_I8X4: u32 = 0x8080_8080;

/// Q, K, V (and dO) on the device as BF16 bits, `[B, H, N, d]`.
pub struct DeviceInputs {
    pub shape: Shape,
    pub causal: bool,
    pub q: CudaSlice<u16>,
    pub k: CudaSlice<u16>,
    pub v: CudaSlice<u16>,
    pub d_o: Option<CudaSlice<u16>>,
}

/// A CUDA device with the sagebwd kernels (compiled per head dimension on first use).
pub struct Gpu {
    pub dev: Device,
    kernels: Mutex<Vec<Arc<Kernels>>>,
    /// The plan's overrides ([`Tuning`]): from the `SAGEBWD_*` variables at [`Gpu::open`], or set by the caller.
    tuning: Mutex<Tuning>,
    poison: AtomicBool,
    /// The backward's second stream, made on first use ([`Gpu::side_stream`]).
    side: Mutex<Option<SideStream>>,
}

/// A second stream for the backward's head groups: a raw, non-blocking driver stream. Non-blocking
/// because the kernels' stream is the context's default (legacy) stream, with which a blocking
/// stream would serialize; raw because a second cudarc stream would switch the whole context to
/// cudarc's per-buffer event tracking (extra driver calls on every buffer access, for every user
/// of the context). Ordering with the kernels' stream is explicit ([`Gpu::order`]).
struct SideStream(cudarc::driver::sys::CUstream);

impl Drop for SideStream {
    fn drop(&mut self) {
        // queued work completes first (the driver defers the release)
        unsafe {
            let _ = cudarc::driver::sys::cuStreamDestroy_v2(self.0);
        }
    }
}

// A driver stream handle is usable from any thread of its context.
unsafe impl Send for SideStream {}

impl Drop for Gpu {
    /// The side stream goes while its context lives: the fields drop after this, `dev` (which may
    /// hold the last reference to the context) first, and destroying a stream of a released context
    /// crashed the driver (a segfault at the exit of `sagebwd bench --lean-memory`).
    fn drop(&mut self) {
        if let Ok(side) = self.side.get_mut() {
            if side.is_some() {
                let _ = self.dev.ctx.bind_to_thread();
                *side = None;
            }
        }
    }
}

/// What [`Gpu::ptr`] takes: a device buffer, or an optional one.
pub(crate) trait DeviceAddress {
    fn address(&self, stream: &Arc<cudarc::driver::CudaStream>) -> u64;
}

impl<T> DeviceAddress for CudaSlice<T> {
    fn address(&self, stream: &Arc<cudarc::driver::CudaStream>) -> u64 {
        let (p, _sync) = self.device_ptr(stream);
        p
    }
}

impl<T> DeviceAddress for Option<CudaSlice<T>> {
    fn address(&self, stream: &Arc<cudarc::driver::CudaStream>) -> u64 {
        self.as_ref().map_or(0, |s| s.address(stream))
    }
}

impl Gpu {
    /// Opens GPU 0. Errors (never panics) when the driver, a GPU or NVRTC is missing.
    pub fn new() -> Result<Gpu> {
        Gpu::open(0)
    }

    /// Opens the GPU with this ordinal (as `Gpu::new` does GPU 0).
    pub fn open(ordinal: usize) -> Result<Gpu> {
        let tuning = Tuning::from_env()?;
        let dev = Device::open(ordinal)?;
        runtime::nvrtc_available()?;
        Ok(Gpu {
            dev,
            kernels: Mutex::new(Vec::new()),
            tuning: Mutex::new(tuning),
            poison: AtomicBool::new(true),
            side: Mutex::new(None),
        })
    }

    /// The overrides in force ([`Tuning`]).
    pub fn tuning(&self) -> Tuning {
        self.tuning.lock().map_or_else(|e| *e.into_inner(), |t| *t)
    }

    /// Replaces the overrides (every later forward and backward plans with them).
    pub fn set_tuning(&self, tuning: Tuning) {
        match self.tuning.lock() {
            Ok(mut t) => *t = tuning,
            Err(e) => *e.into_inner() = tuning,
        }
    }

    fn update_tuning(&self, f: impl FnOnce(&mut Tuning)) {
        let mut t = self.tuning();
        f(&mut t);
        self.set_tuning(t);
    }

    /// The SM count the persistent grids (forward and backward) are sized by: the GPU's, or fewer where
    /// [`Tuning::persistent_sms`] asks (so that verification on small shapes runs blocks that walk many work
    /// items: with 132 SMs every verification shape has at most one item per block).
    pub fn persistent_sms(&self) -> u32 {
        self.tuning()
            .persistent_sms
            .map_or(self.dev.sms, |n| n.min(self.dev.sms))
    }

    /// The kernels that run for `cfg` on `shape` on this GPU, under the tuning in force.
    pub fn plan(&self, cfg: &Config, shape: &Shape, causal: bool) -> KernelPlan {
        KernelPlan::choose(&self.dev.arch, cfg, shape, causal, &self.tuning())
    }

    /// Selects the forward and backward-main kernels: `true` (the default) for the tensor-core
    /// (`mma.sync`) versions, `false` for the scalar reference versions. Both compute ALGORITHM.md
    /// and are checked against the simulator by `sagebwd-gpu-check`.
    pub fn set_tensor_cores(&self, on: bool) {
        self.update_tuning(|t| t.tensor_cores = on);
    }

    /// Checked mode (the default): every output and intermediate buffer is filled with a poison
    /// pattern (NaN, −128 for INT8) before the kernels write it, so a value a kernel forgets to write
    /// cannot pass for a result. The verification runs use it. Off, the fills are skipped (each is a
    /// pass over its buffer, timed with the stage that allocates it) — for timing and training,
    /// with kernels that were verified in checked mode.
    pub fn set_poison(&self, on: bool) {
        self.poison.store(on, Ordering::Relaxed);
    }

    pub fn tensor_cores(&self) -> bool {
        self.tuning().tensor_cores
    }

    /// Evaluates the kernels' `exp2_ftz` (ex2.approx.ftz) at every FP32 argument in [−∞, 16] and checks
    /// that it is monotone there, at most 1 on [−∞, 0], and 1 at 0: the INT8 forward takes P̂'s group
    /// amax as exp2(fma(a_max, sc, −m)) before the exponentials (ALGORITHM.md §4), whose argument may
    /// exceed 0 by the lazy running max's slack of 8 and two roundings; it is the max of the p's only if so. A few milliseconds.
    pub fn ex2_selftest(&self) -> Result<()> {
        let k = self.kernels(HEAD_DIMS[0])?;
        let st = &self.dev.stream;
        let counts = drv("alloc", st.alloc_zeros::<u64>(3))?;
        const CHUNK: u32 = 4096; // EX2_CHUNK in selftest.cu
                                 // The negative arguments [−∞, −0], then the positive ones [+0, 16] (selftest.cu).
        let threads = (0xff80_0000u32 - 0x8000_0000) / CHUNK + 0x4180_0000u32.div_ceil(CHUNK);
        let cfg = LaunchConfig {
            grid_dim: (threads.div_ceil(256), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        drv("launch sage_ex2_monotone", unsafe {
            st.launch_builder(&k.ex2_monotone).arg(&counts).launch(cfg)
        })?;
        let c = self.download(&counts, 3)?;
        if c == [0, 0, 0] {
            Ok(())
        } else {
            Err(Error::Backend(format!(
                "ex2.approx.ftz self-test failed: {} adjacent arguments out of order on [-inf, 16], {} values above 1 on [-inf, 0], exp2(0) = 1: {}",
                c[0], c[1], if c[2] == 0 { "yes" } else { "no" })))
        }
    }

    /// Evaluates `pack_bf16x2_nan` (common.cuh: `cvt.rn.bf16x2.f32` + a NaN flag; the INT8
    /// persistent forward packs O with it and takes `f32_to_bf16` where the flag is set) on every
    /// FP32 bit pattern as the low and as the high half, against `f32_to_bf16`: the cvt must give the
    /// same bits for every non-NaN input, the flag must be set exactly for NaN inputs. Returns the
    /// counts as text (with the NaN the cvt itself writes). A few milliseconds.
    pub fn bf16_pack_selftest(&self) -> Result<String> {
        let k = self.kernels(HEAD_DIMS[0])?;
        let st = &self.dev.stream;
        let counts = drv("alloc", st.alloc_zeros::<u64>(6))?;
        const CHUNK: u32 = 4096; // BF16_CHUNK in selftest.cu
        let threads = (1u64 << 32) / CHUNK as u64;
        let cfg = LaunchConfig {
            grid_dim: ((threads / 256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        drv("launch sage_bf16_pack_check", unsafe {
            st.launch_builder(&k.bf16_pack_check).arg(&counts).launch(cfg)
        })?;
        let c = self.download(&counts, 6)?;
        let text = format!(
            "2^32 patterns x 2 halves: cvt != f32_to_bf16 on non-NaN inputs {}, forward's rule != f32_to_bf16 {}, NaN flag wrong {}; \
             NaN halves where the cvt differs from 0x7fc0 {} (cvt NaN bits OR {:#06x}, AND {:#06x})",
            c[0], c[1], c[2], c[3], c[4], !c[5] & 0xffff);
        if c[0] == 0 && c[1] == 0 && c[2] == 0 {
            Ok(text)
        } else {
            Err(Error::Backend(format!("bf16 pack self-test failed: {text}")))
        }
    }

    /// Runs one INT8 (m16n8k32) and one BF16 (m16n8k16) `mma.sync` on small random integers and
    /// compares with the exact product: checks the fragment layouts the tensor-core kernels use.
    pub fn mma_selftest(&self) -> Result<()> {
        let k = self.kernels(HEAD_DIMS[0])?;
        let mut seed = 0x9e37_79b9_u32;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            (seed % 255) as i32 - 127
        };
        let a8: Vec<i8> = (0..16 * 32).map(|_| next() as i8).collect();
        let b8: Vec<i8> = (0..8 * 32).map(|_| next() as i8).collect();
        let a16: Vec<f32> = (0..16 * 16).map(|_| (next() % 16) as f32).collect();
        let b16: Vec<f32> = (0..8 * 16).map(|_| (next() % 16) as f32).collect();
        let bits = |v: &[f32]| {
            v.iter()
                .map(|&x| half::bf16::from_f32(x).to_bits())
                .collect::<Vec<u16>>()
        };
        let st = &self.dev.stream;
        let (da8, db8) = (drv("upload", st.clone_htod(&a8))?, drv("upload", st.clone_htod(&b8))?);
        let (da16, db16) = (
            drv("upload", st.clone_htod(&bits(&a16)))?,
            drv("upload", st.clone_htod(&bits(&b16)))?,
        );
        let c8 = self.alloc::<i32>(128)?;
        let c16 = self.alloc_poisoned_f32(128)?;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        drv("launch sage_mma_selftest", unsafe {
            st.launch_builder(&k.mma_selftest)
                .arg(&da8)
                .arg(&db8)
                .arg(&c8)
                .arg(&da16)
                .arg(&db16)
                .arg(&c16)
                .launch(cfg)
        })?;
        let (g8, g16) = (self.download(&c8, 128)?, self.download(&c16, 128)?);
        let mut bad = Vec::new();
        for m in 0..16 {
            for n in 0..8 {
                let e8: i32 = (0..32).map(|k| a8[m * 32 + k] as i32 * b8[n * 32 + k] as i32).sum();
                let e16: f32 = (0..16).map(|k| a16[m * 16 + k] * b16[n * 16 + k]).sum();
                if g8[m * 8 + n] != e8 {
                    bad.push(format!("s8 ({m},{n}): {} != {e8}", g8[m * 8 + n]));
                }
                if g16[m * 8 + n] != e16 {
                    bad.push(format!("bf16 ({m},{n}): {} != {e16}", g16[m * 8 + n]));
                }
            }
        }
        if bad.is_empty() {
            Ok(())
        } else {
            Err(Error::Backend(format!(
                "mma.sync fragment self-test failed at {} entries: {}",
                bad.len(),
                bad.iter().take(8).cloned().collect::<Vec<_>>().join("; ")
            )))
        }
    }

    /// "NVIDIA H200 (sm_90a)".
    pub fn describe(&self) -> String {
        format!("{} ({})", self.dev.name, self.dev.arch)
    }

    /// The kernels for `head_dim`, compiled (or read from the cache) on first use.
    pub fn kernels(&self, head_dim: usize) -> Result<Arc<Kernels>> {
        let mut loaded = self
            .kernels
            .lock()
            .map_err(|_| Error::Backend("kernel cache lock poisoned".into()))?;
        if let Some(k) = loaded.iter().find(|k| k.head_dim == head_dim) {
            return Ok(k.clone());
        }
        let k = Arc::new(Kernels::load(&self.dev, head_dim)?);
        loaded.push(k.clone());
        Ok(k)
    }

    // ----- small device helpers -----

    /// The buffer's device address; 0 for a buffer that was not allocated (`None`: an output the
    /// selected kernel paths do not read), so that a kernel reading it faults instead of reading garbage.
    pub(crate) fn ptr(&self, s: &impl DeviceAddress) -> u64 {
        s.address(&self.dev.stream)
    }

    fn alloc<T: cudarc::driver::DeviceRepr>(&self, n: usize) -> Result<CudaSlice<T>> {
        // Zero-length tensors never reach here (validated shapes); keep one element regardless.
        drv("allocation", unsafe { self.dev.stream.alloc::<T>(n.max(1)) })
    }

    pub(crate) fn alloc_f32(&self, n: usize) -> Result<CudaSlice<f32>> {
        self.alloc(n)
    }

    /// Fills a buffer of 4-byte-multiple size with a 32-bit pattern.
    pub(crate) fn fill<T>(&self, k: &Kernels, s: &CudaSlice<T>, pattern: u32) -> Result<()> {
        self.fill_on(
            k,
            self.ptr(s),
            s.len() * std::mem::size_of::<T>(),
            pattern,
            self.main_stream(),
        )
    }

    /// The kernels' stream (the context's default stream) as a driver handle.
    pub(crate) fn main_stream(&self) -> cudarc::driver::sys::CUstream {
        self.dev.stream.cu_stream()
    }

    /// The second stream of the backward's head groups ([`SideStream`]), made on first use.
    pub(crate) fn side_stream(&self) -> Result<cudarc::driver::sys::CUstream> {
        use cudarc::driver::sys;
        let mut side = self
            .side
            .lock()
            .map_err(|_| Error::Backend("side stream lock poisoned".into()))?;
        if let Some(s) = side.as_ref() {
            return Ok(s.0);
        }
        drv("bind context", self.dev.ctx.bind_to_thread())?;
        let mut stream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        drv("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut stream, flags).result()
        })?;
        *side = Some(SideStream(stream));
        Ok(stream)
    }

    /// Makes `to` wait for everything queued on `from` so far (an event recorded on `from`).
    pub(crate) fn order(&self, from: cudarc::driver::sys::CUstream, to: cudarc::driver::sys::CUstream) -> Result<()> {
        use cudarc::driver::sys;
        drv("bind context", self.dev.ctx.bind_to_thread())?;
        let mut event = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        unsafe {
            drv("cuEventCreate", sys::cuEventCreate(&mut event, flags).result())?;
            let waited = sys::cuEventRecord(event, from)
                .result()
                .and_then(|_| sys::cuStreamWaitEvent(to, event, 0).result());
            // released once the recorded work completes; the wait already holds its point
            let _ = sys::cuEventDestroy_v2(event);
            drv("stream order", waited)
        }
    }

    /// `sage_fill_u32` of `bytes` (a multiple of 4) at `addr` on `stream`: [`Gpu::fill`] for any stream.
    pub(crate) fn fill_on(
        &self,
        k: &Kernels,
        addr: u64,
        bytes: usize,
        pattern: u32,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<()> {
        let (mut addr, mut words, mut pattern) = (addr, (bytes / 4) as u64, pattern);
        let blocks = words.div_ceil(256).clamp(1, 1 << 16) as u32;
        let mut args: [*mut std::ffi::c_void; 3] = [
            (&mut addr as *mut u64).cast(),
            (&mut words as *mut u64).cast(),
            (&mut pattern as *mut u32).cast(),
        ];
        self.launch_raw(k.fill_u32.cu_function(), (blocks, 1, 1), 256, 0, stream, &mut args)
    }

    /// cuLaunchKernel on a driver stream (the side stream's launches, which cudarc's builder,
    /// bound to cudarc streams, cannot make). `args`: addresses of the kernel's parameters.
    pub(crate) fn launch_raw(
        &self,
        func: cudarc::driver::sys::CUfunction,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        stream: cudarc::driver::sys::CUstream,
        args: &mut [*mut std::ffi::c_void],
    ) -> Result<()> {
        use cudarc::driver::sys;
        drv("bind context", self.dev.ctx.bind_to_thread())?;
        drv("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                func,
                grid.0,
                grid.1,
                grid.2,
                block,
                1,
                1,
                smem,
                stream,
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
            .result()
        })
    }

    fn poisoned<T: cudarc::driver::DeviceRepr>(&self, n: usize, unit: usize, pattern: u32) -> Result<CudaSlice<T>> {
        // Round up to whole 4-byte words so the fill covers every element.
        let n = (n.max(1) * unit).div_ceil(4) * 4 / unit;
        let s = self.alloc::<T>(n)?;
        if self.poison.load(Ordering::Relaxed) {
            let k = self.any_kernels()?;
            self.fill(&k, &s, pattern)?;
        }
        Ok(s)
    }
    pub(crate) fn alloc_poisoned_f32(&self, n: usize) -> Result<CudaSlice<f32>> {
        self.poisoned(n, 4, POISON_F32)
    }
    pub(crate) fn alloc_poisoned_u16(&self, n: usize) -> Result<CudaSlice<u16>> {
        self.poisoned(n, 2, POISON_BF16X2)
    }
    pub(crate) fn alloc_poisoned_i8(&self, n: usize) -> Result<CudaSlice<i8>> {
        self.poisoned(n, 1, POISON_I8X4)
    }

    fn any_kernels(&self) -> Result<Arc<Kernels>> {
        let first = self.kernels.lock().ok().and_then(|k| k.first().cloned());
        match first {
            Some(k) => Ok(k),
            None => self.kernels(HEAD_DIMS[0]),
        }
    }

    fn download<T: cudarc::driver::DeviceRepr + Default + Clone>(&self, s: &CudaSlice<T>, n: usize) -> Result<Vec<T>> {
        let mut v = drv("download", self.dev.stream.clone_dtoh(s))?;
        v.truncate(n);
        Ok(v)
    }

    /// `download` of a buffer that may not exist (an empty vector then).
    fn download_some<T: cudarc::driver::DeviceRepr + Default + Clone>(
        &self,
        s: &Option<CudaSlice<T>>,
        n: usize,
    ) -> Result<Vec<T>> {
        s.as_ref().map_or(Ok(Vec::new()), |s| self.download(s, n))
    }

    // ----- public API -----

    /// Checks what the GPU path supports: shape, head dimension (64, 128), block sizes (64, 128),
    /// finite inputs (§9), grid limits, and that the problem fits in free device memory.
    pub fn check(&self, inp: &Inputs, cfg: &Config) -> Result<()> {
        inp.validate()?;
        cfg.validate()?;
        check_supported(&inp.shape, cfg)?;
        self.check_fits(&inp.shape, inp.d_o.is_some())
    }

    /// Errors when a problem of this shape would not fit in the device's free memory (checked
    /// with cuMemGetInfo before anything is allocated).
    pub fn check_fits(&self, shape: &Shape, with_backward: bool) -> Result<()> {
        let need = device_bytes(shape, with_backward);
        let free = self.dev.free_memory()?;
        // Leave headroom for the modules and the allocator's rounding.
        if need + (256 << 20) > free {
            return Err(Error::Backend(format!(
                "problem {shape:?} needs about {:.2} GiB of device memory, {:.2} GiB are free",
                need as f64 / (1u64 << 30) as f64,
                free as f64 / (1u64 << 30) as f64
            )));
        }
        Ok(())
    }

    /// Uploads the inputs as BF16 (after [`Gpu::check`]-style validation of shape and values).
    pub fn upload(&self, inp: &Inputs) -> Result<DeviceInputs> {
        inp.validate()?;
        let up = |t: &[f32]| -> Result<CudaSlice<u16>> {
            let bits: Vec<u16> = t.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect();
            drv("upload", self.dev.stream.clone_htod(&bits))
        };
        Ok(DeviceInputs {
            shape: inp.shape,
            causal: inp.causal,
            q: up(&inp.q)?,
            k: up(&inp.k)?,
            v: up(&inp.v)?,
            d_o: inp.d_o.as_deref().map(up).transpose()?,
        })
    }

    /// Quantization + forward kernel. What only the forward reads (V̂ᵀ) is freed once the kernel is
    /// queued, so the state kept for the backward holds only what the backward reads.
    pub fn forward(&self, x: &DeviceInputs, cfg: &Config) -> Result<(DeviceForward, SavedForBackward)> {
        let (fwd, mut saved) = self.forward_keep_all(x, cfg)?;
        saved.quant.release_forward_only();
        Ok((fwd, saved))
    }

    /// The forward, every quantized output still allocated (for the check in [`Gpu::run`]).
    fn forward_keep_all(&self, x: &DeviceInputs, cfg: &Config) -> Result<(DeviceForward, SavedForBackward)> {
        check_supported(&x.shape, cfg)?;
        let k = self.kernels(x.shape.head_dim)?;
        forward::forward(self, &k, x, cfg, None)
    }

    /// [`Gpu::forward`] writing O into the caller's buffer `o` (`q_len` BF16); the returned `DeviceForward::o`
    /// wraps that buffer and must be leaked, never dropped ([`external`]).
    ///
    /// # Safety
    /// `o` must address `x.shape.q_len()` BF16 values of this context, alive until the queued work has run.
    pub(crate) unsafe fn forward_into(
        &self,
        x: &DeviceInputs,
        cfg: &Config,
        o: cudarc::driver::sys::CUdeviceptr,
    ) -> Result<(DeviceForward, SavedForBackward)> {
        check_supported(&x.shape, cfg)?;
        let k = self.kernels(x.shape.head_dim)?;
        let (fwd, mut saved) = forward::forward(self, &k, x, cfg, Some(o))?;
        saved.quant.release_forward_only();
        Ok((fwd, saved))
    }

    /// How the staged sagebwd backward splits its heads ([`GroupPolicy::Auto`], the default: within
    /// cuDNN's peak memory where that costs no time, non-causal N ≥ 8k; [`GroupPolicy::Lean`]: within it
    /// everywhere, at up to ~20 % more time at N 1k on the H200; `Count(1)`: one group): the tuning's
    /// [`Tuning::backward_groups`] (which `SAGEBWD_BWD_GROUPS` sets when the `Gpu` opens).
    pub fn set_backward_groups(&self, policy: GroupPolicy) {
        self.update_tuning(|t| t.backward_groups = policy);
    }

    /// Preprocess, main and postprocess kernels. The staged sagebwd path (without GQA) may run in head
    /// groups ([`backward::GroupPolicy`], `SAGEBWD_BWD_GROUPS`) so that its peak memory stays within
    /// cuDNN's: by default where that is free (non-causal N ≥ 8k), everywhere with `lean`; then
    /// `DeviceGradients::do_quant` holds s_dO but no dÔ.
    pub fn backward(
        &self,
        x: &DeviceInputs,
        fwd: &DeviceForward,
        saved: &SavedForBackward,
        d_o: &CudaSlice<u16>,
    ) -> Result<DeviceGradients> {
        self.backward_to(x, fwd, saved, d_o, backward::GradientsInto::Allocate)
    }

    /// [`Gpu::backward`] with dQ, dK, dV written where `into` says (the caller's buffers: [`external`]).
    pub(crate) fn backward_to(
        &self,
        x: &DeviceInputs,
        fwd: &DeviceForward,
        saved: &SavedForBackward,
        d_o: &CudaSlice<u16>,
        into: backward::GradientsInto,
    ) -> Result<DeviceGradients> {
        check_supported(&x.shape, &saved.cfg)?;
        check_backward_supported(&saved.cfg)?;
        if d_o.len() != x.shape.q_len() {
            return Err(Error::Shape(format!(
                "dO has {} elements, expected {}",
                d_o.len(),
                x.shape.q_len()
            )));
        }
        let k = self.kernels(x.shape.head_dim)?;
        backward::backward(self, &k, x, fwd, saved, d_o, into)
    }

    /// The whole method on host inputs: upload (BF16), forward, backward when dO is present,
    /// download into the simulator's structure (`inter` is None). V̂ is read before the forward-only
    /// tensors are released (from V̂ᵀ when the kernel paths need no natural V̂), so the check
    /// compares it whichever layouts were computed.
    pub fn run(&self, inp: &Inputs, cfg: &Config) -> Result<SimOutput> {
        self.check(inp, cfg)?;
        let x = self.upload(inp)?;
        let (fwd, mut saved) = self.forward_keep_all(&x, cfg)?;
        let v_hat = self.v_hat_host(&x.shape, &saved.quant)?;
        saved.quant.release_forward_only();
        let grads = match &x.d_o {
            Some(d_o) => Some(self.backward(&x, &fwd, &saved, d_o)?),
            None => None,
        };
        let do_whole = self.do_quant_for_check(&x, &saved, grads.as_ref())?;
        drv("synchronize", self.dev.stream.synchronize())?;
        let grads = grads.as_ref().map(|g| (g, do_whole.as_ref().unwrap_or(&g.do_quant)));
        self.collect(&x.shape, cfg, &fwd, &saved, grads, v_hat)
    }

    /// dO quantized whole by the backward's own kernel, for the dÔ comparison, when the backward ran
    /// in several head groups: each quantized its rows into one reused dÔᵀ buffer, so no whole dÔ
    /// is left (s_dO is, and is compared as the backward wrote it; the gradients show that the groups
    /// read the same dÔ). `None` when the backward's dÔ is there or none was computed.
    fn do_quant_for_check(
        &self,
        x: &DeviceInputs,
        saved: &SavedForBackward,
        grads: Option<&DeviceGradients>,
    ) -> Result<Option<QuantizedDo>> {
        let (Some(g), Some(d_o)) = (grads, &x.d_o) else {
            return Ok(None);
        };
        let kept = g.do_quant.do_hat.is_some() || g.do_quant.do_hat_t.is_some();
        if kept || !saved.quant.needs.quantized {
            return Ok(None);
        }
        let k = self.kernels(x.shape.head_dim)?;
        quantize::quantize_do(self, &k, x, d_o, saved.quant.needs).map(Some)
    }

    /// V̂ `[B, H_kv, N_k, d]` on the host: the natural copy if it was computed, else V̂ᵀ
    /// `[B, H_kv, d, N_k,pad]` transposed back; empty if neither exists.
    fn v_hat_host(&self, s: &Shape, qd: &QuantizedDev) -> Result<Vec<i8>> {
        self.natural_host(
            &qd.v_hat,
            &qd.v_hat_t,
            s.batch * s.heads_kv,
            s.n_k,
            runtime::padded_k(s.n_k),
            s.head_dim,
        )
    }

    /// dÔ `[B, H_q, N_q, d]` on the host, from the natural copy or from dÔᵀ (as [`Gpu::v_hat_host`]).
    fn do_hat_host(&self, s: &Shape, dq: &QuantizedDo) -> Result<Vec<i8>> {
        self.natural_host(
            &dq.do_hat,
            &dq.do_hat_t,
            s.batch * s.heads_q,
            s.n_q,
            runtime::padded_q(s.n_q),
            s.head_dim,
        )
    }

    /// An INT8 `[bh, n, d]` tensor on the host from its natural copy if computed, else from its
    /// transposed copy `[bh, d, n_pad]`; empty if neither exists.
    fn natural_host(
        &self,
        natural: &Option<CudaSlice<i8>>,
        transposed: &Option<CudaSlice<i8>>,
        bh: usize,
        n: usize,
        n_pad: usize,
        d: usize,
    ) -> Result<Vec<i8>> {
        if natural.is_some() {
            return self.download_some(natural, bh * n * d);
        }
        let t = self.download_some(transposed, bh * d * n_pad)?;
        Ok(untranspose(&t, bh, n, n_pad, d))
    }

    /// `grads`: the gradients with the dO quantization to compare (the backward's own, or
    /// [`Gpu::do_quant_for_check`]'s dÔ with the backward's s_dO).
    fn collect(
        &self,
        s: &Shape,
        cfg: &Config,
        fwd: &DeviceForward,
        saved: &SavedForBackward,
        grads: Option<(&DeviceGradients, &QuantizedDo)>,
        v_hat: Vec<i8>,
    ) -> Result<SimOutput> {
        let bf = |v: Vec<u16>| -> Vec<f32> { v.into_iter().map(|b| half::bf16::from_bits(b).to_f32()).collect() };
        let (bh_q, bh_kv) = (s.batch * s.heads_q, s.batch * s.heads_kv);
        let (nqb, nkb) = (s.n_q.div_ceil(BLOCK_Q), s.n_k.div_ceil(BLOCK_KV));
        let rows = bh_q * s.n_q;
        let qd = &saved.quant;
        // Outputs the kernel paths did not need were not computed (`QuantNeeds`): empty here, and
        // `sagebwd-gpu-check` compares only what exists.
        let mut quant = Quantized {
            q_hat: self.download_some(&qd.q_hat, s.q_len())?,
            q_scale: self.download_some(&qd.q_scale, bh_q * nqb)?,
            k_hat: self.download_some(&qd.k_hat, s.kv_len())?,
            k_scale: self.download_some(&qd.k_scale, bh_kv * nkb)?,
            v_hat,
            // [B·H_kv, n_kblk] INT8 block scales, or the e4m3 V̂ᵀ's channel scales [B·H_kv, d] (§10.1)
            v_scale: self.download_some(&qd.v_scale, qd.v_scale.as_ref().map_or(0, |b| b.len()))?,
            k_mean: if qd.needs.quantized {
                self.download(&qd.k_mean, bh_kv * s.head_dim)?
            } else {
                Vec::new()
            },
            row_offset: self.download_some(&qd.row_offset, rows)?,
            q_mean: if cfg.smooth_q {
                self.download_some(&qd.q_mean, bh_q * nqb * s.head_dim)?
            } else {
                Vec::new()
            },
            do_hat: Vec::new(),
            do_scale: Vec::new(),
        };
        let fwd_host = Forward {
            o: bf(self.download(&fwd.o, s.q_len())?),
            lse2: self.download(&fwd.lse2, rows)?,
            lse: self.download(&fwd.lse, rows)?,
        };
        let grads_host = match grads {
            Some((g, do_quant)) => {
                quant.do_hat = self.do_hat_host(s, do_quant)?;
                quant.do_scale = self.download_some(&g.do_quant.do_scale, bh_q * nqb)?;
                Some(Gradients {
                    dq: bf(self.download(&g.dq, s.q_len())?),
                    dk: bf(self.download(&g.dk, s.kv_len())?),
                    dv: bf(self.download(&g.dv, s.kv_len())?),
                    delta: self.download(&g.delta, rows)?,
                })
            }
            None => None,
        };
        Ok(SimOutput {
            quant,
            fwd: fwd_host,
            grads: grads_host,
            inter: None,
        })
    }
}

/// `[bh, n, d]` from its transposed copy `[bh, d, n_pad]` (an empty input gives an empty output).
fn untranspose(t: &[i8], bh: usize, n: usize, n_pad: usize, d: usize) -> Vec<i8> {
    if t.is_empty() {
        return Vec::new();
    }
    let mut out = vec![0i8; bh * n * d];
    for (h, head) in out.chunks_exact_mut(n * d).enumerate() {
        for (r, row) in head.chunks_exact_mut(d).enumerate() {
            for (c, v) in row.iter_mut().enumerate() {
                *v = t[(h * d + c) * n_pad + r];
            }
        }
    }
    out
}

/// Shape and configuration limits of the GPU kernels.
pub fn check_supported(s: &Shape, cfg: &Config) -> Result<()> {
    s.validate()?;
    if !HEAD_DIMS.contains(&s.head_dim) {
        return Err(Error::HeadDim {
            got: s.head_dim,
            supported: "the CUDA kernels support 64 and 128".into(),
        });
    }
    if !cfg.has_kernels() && !cfg.has_fp8_forward_kernel() {
        return Err(Error::Config(format!(
            "{}: this P/dS quantization variant is simulated only (docs/ALGORITHM.md §10); no CUDA kernel implements it \
             yet (run it with --device cpu)",
            cfg.label()
        )));
    }
    if cfg.block_q != BLOCK_Q || cfg.block_kv != BLOCK_KV {
        return Err(Error::Config(format!(
            "the CUDA kernels tile B_q = {BLOCK_Q}, B_kv = {BLOCK_KV}; got B_q = {}, B_kv = {}",
            cfg.block_q, cfg.block_kv
        )));
    }
    let heads = s.batch * s.heads_q;
    if heads > 65_535 {
        return Err(Error::Shape(format!(
            "batch × query heads = {heads} exceeds the CUDA grid limit 65535"
        )));
    }
    Ok(())
}

/// The backward's limits beyond [`check_supported`]: the P/dS variants whose forward alone runs on the GPU.
pub fn check_backward_supported(cfg: &Config) -> Result<()> {
    if cfg.has_kernels() {
        return Ok(());
    }
    Err(Error::Config(format!(
        "{}: the GPU runs this variant's forward only (sm_90a, docs/ALGORITHM.md §10.2); its backward is simulated \
         only so far (run it with --device cpu)",
        cfg.label()
    )))
}

/// Device bytes one run allocates (inputs, quantized copies, forward outputs, backward buffers).
pub fn device_bytes(s: &Shape, with_backward: bool) -> usize {
    let (q, kv) = (s.q_len(), s.kv_len());
    let rows = s.batch * s.heads_q * s.n_q;
    let blocks =
        (s.batch * s.heads_q * s.n_q.div_ceil(BLOCK_Q) + s.batch * s.heads_kv * s.n_k.div_ceil(BLOCK_KV)) * 4 * 2;
    let inputs = 2 * (q + 2 * kv);
    // BF16 Qᵀ, Kᵀ, Vᵀ (gathering paths) and V̂ᵀ; Q̂ᵀ, K̂ᵀ are made by the backward (`backward_bytes`)
    let (pq, pk) = (runtime::padded_q(s.n_q), runtime::padded_k(s.n_k));
    let transposed = s.head_dim * (2 * s.batch * s.heads_q * pq + (2 * 2 + 1) * s.batch * s.heads_kv * pk);
    let quantized = q * (1 + 2 + 4) + kv * (1 + 2 + 1) + blocks + s.batch * s.heads_kv * s.head_dim * 4 + transposed;
    let forward = 2 * q + 8 * rows;
    let backward = if with_backward { backward::backward_bytes(s) } else { 0 };
    inputs + quantized + forward + backward
}
