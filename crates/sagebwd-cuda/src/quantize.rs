//! Host side of `kernels/quantize.cu`: the K token mean, the row offsets b_r (fused into the Q
//! quantization), and the per-block INT8 quantization of Q, K, V (forward preparation) and dO (backward preprocess), ALGORITHM.md §3.

use crate::plan::KernelPlan;
use crate::runtime::{drv, padded_k, padded_q, Dims, Kernels, BLOCK_KV, BLOCK_Q, THREADS};
use crate::{flags, DeviceInputs, Gpu};
use cudarc::driver::{sys, CudaSlice, LaunchConfig, PushKernelArg};
use sagebwd::{Config, Result};

/// Mirror of `QuantRowsParams` in quantize.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct QuantRowsParams {
    x: u64,
    head_mean: u64,
    block_mean: u64,
    x_hat: u64,
    scale: u64,
    x_hat_t: u64,
    x_t: u64,
    k_mean: u64,
    row_offset: u64,
    n: i32,
    rows_per_block: i32,
    n_blk: i32,
    mean_group: i32,
    n_pad: i32,
    heads_q: i32,
    heads_kv: i32,
    c_lambda: f32,
}
unsafe impl cudarc::driver::DeviceRepr for QuantRowsParams {}
// Layout contract with quantize.cu, which static_asserts the same size.
const _: () = assert!(std::mem::size_of::<QuantRowsParams>() == 104);

pub use crate::plan::QuantNeeds;

impl QuantNeeds {
    /// What the kernels the plan picks for `cfg` on `gpu` read (the shape does not matter).
    pub fn of(gpu: &Gpu, cfg: &Config) -> QuantNeeds {
        QuantNeeds::for_paths(gpu.tensor_cores(), flags(cfg))
    }
}

/// The quantized operands on the device (layouts of `sagebwd::sim::Quantized`). BF16 products
/// read the original inputs, so no smoothed BF16 copies exist. `None`: not needed by the kernel
/// paths in use ([`QuantNeeds`]).
pub struct QuantizedDev {
    pub needs: QuantNeeds,
    pub q_hat: Option<CudaSlice<i8>>,
    pub q_scale: Option<CudaSlice<f32>>,
    /// `[B, H_q, ⌈N_q/B_q⌉, d]`, written only with Q-smoothing.
    pub q_mean: Option<CudaSlice<f32>>,
    pub k_hat: Option<CudaSlice<i8>>,
    pub k_scale: Option<CudaSlice<f32>>,
    /// `[B, H_kv, d]`; always allocated (the dQ postprocess takes it), computed when `needs.quantized`.
    pub k_mean: CudaSlice<f32>,
    /// `[B, H_q, N_q]` b_r = fl(cλ·q_r·K_m), the base-2 score offset K-smoothing removes (§3.5).
    pub row_offset: Option<CudaSlice<f32>>,
    /// Transposed copies `[B, H, d, N_pad]` (Q̂ᵀ, Qᵀ, K̂ᵀ, Kᵀ, V̂ᵀ, Vᵀ) for the tensor-core products
    /// that reduce over tokens. Q̂ᵀ and K̂ᵀ are read by backward products only: the forward's
    /// quantization writes them when the staged sagebwd backward runs in one head group (the plan's
    /// `qk_hat_t_in_forward`), else leaves them `None` and the backward byte-transposes the saved Q̂,
    /// K̂ per head group (`transpose_qk_hat`), so that no full copy is kept between the passes.
    pub q_hat_t: Option<CudaSlice<i8>>,
    pub q_t: Option<CudaSlice<u16>>,
    pub k_hat_t: Option<CudaSlice<i8>>,
    pub k_t: Option<CudaSlice<u16>>,
    pub v_hat_t: Option<CudaSlice<i8>>,
    pub v_t: Option<CudaSlice<u16>>,
    /// `[B, H_kv, N_k, d]`, computed when `needs.natural_v_do`.
    pub v_hat: Option<CudaSlice<i8>>,
    pub v_scale: Option<CudaSlice<f32>>,
}

impl QuantizedDev {
    /// Frees what only the forward reads, once the forward kernel is queued (stream-ordered: the
    /// memory returns to the pool after the kernel has run): V̂ᵀ, the B operand of P̂·V̂, a product
    /// that reduces over keys. No backward product does (#5, dO·Vᵀ, reduces over d and reads V̂ in
    /// its natural layout), so no backward kernel reads V̂ᵀ; its address becomes null, and a kernel
    /// that read it would fault rather than read stale data.
    pub fn release_forward_only(&mut self) {
        self.v_hat_t = None;
    }
}

/// dO quantized per B_q block (`None` as in [`QuantizedDev`]).
pub struct QuantizedDo {
    /// `[B, H_q, N_q, d]`, computed when `needs.natural_v_do`.
    pub do_hat: Option<CudaSlice<i8>>,
    pub do_scale: Option<CudaSlice<f32>>,
    /// `[B, H_q, d, N_q,pad]` dÔᵀ and dOᵀ. dÔᵀ is `None` after a backward in several head groups
    /// (each quantized its rows into one reused buffer; `do_scale` is whole).
    pub do_hat_t: Option<CudaSlice<i8>>,
    pub do_t: Option<CudaSlice<u16>>,
}

/// One call of `sage_quantize_rows` over a `[bh, n, d]` tensor.
struct RowsJob<'a> {
    x: &'a CudaSlice<u16>,
    bh: usize,
    n: usize,
    rows_per_block: usize,
    head_mean: Option<(&'a CudaSlice<f32>, usize)>,
    block_mean: Option<&'a CudaSlice<f32>>,
    /// x̂ in the natural layout, if needed.
    x_hat: &'a Option<CudaSlice<i8>>,
    scale: &'a CudaSlice<f32>,
    /// Transposed x̂ and x (either may be absent), rows of `n_pad`.
    transposed: (&'a Option<CudaSlice<i8>>, &'a Option<CudaSlice<u16>>, usize),
    /// The row offsets b_r of x = Q.
    row_offset: Option<RowOffsets<'a>>,
}

/// b_r = fl(cλ·q_r·K_m) for the rows of Q (§3.5), written by the Q quantization.
struct RowOffsets<'a> {
    k_mean: &'a CudaSlice<f32>,
    out: &'a CudaSlice<f32>,
    heads_q: usize,
    heads_kv: usize,
    c_lambda: f32,
}

/// Block size and dynamic shared memory of `sage_quantize_rows` for a job (the kernel takes the
/// layout from the job's outputs): without Q-smoothing and BF16 transposed copy, register tiles of
/// 8 rows × 8 columns per thread, shared memory only for the Q rows of b_r (`ROW_TILE_STRIDE`);
/// otherwise THREADS threads and the padded shared tile of a B_kv group (`TILE_STRIDE`).
fn rows_launch(job: &RowsJob, head_dim: usize) -> (u32, u32) {
    let tiles = job.block_mean.is_none() && job.transposed.1.is_none();
    if tiles {
        let row_tile = if job.row_offset.is_some() {
            job.rows_per_block * (head_dim + 8) * 2
        } else {
            0
        };
        (tile_threads(job.rows_per_block, head_dim), row_tile as u32)
    } else {
        (THREADS, (BLOCK_KV * (head_dim + 2) * 2) as u32)
    }
}

fn quantize_rows(gpu: &Gpu, k: &Kernels, job: RowsJob) -> Result<()> {
    let launch = rows_launch(&job, k.head_dim);
    launch_rows(gpu, k, &rows_params(gpu, &job), job.bh, launch)
}

/// The kernel's parameters for a job.
fn rows_params(gpu: &Gpu, job: &RowsJob) -> QuantRowsParams {
    let n_blk = job.n.div_ceil(job.rows_per_block);
    QuantRowsParams {
        x: gpu.ptr(job.x),
        head_mean: job.head_mean.map_or(0, |(m, _)| gpu.ptr(m)),
        block_mean: job.block_mean.map_or(0, |m| gpu.ptr(m)),
        x_hat: gpu.ptr(job.x_hat),
        scale: gpu.ptr(job.scale),
        x_hat_t: gpu.ptr(job.transposed.0),
        x_t: gpu.ptr(job.transposed.1),
        k_mean: job.row_offset.as_ref().map_or(0, |r| gpu.ptr(r.k_mean)),
        row_offset: job.row_offset.as_ref().map_or(0, |r| gpu.ptr(r.out)),
        n: job.n as i32,
        rows_per_block: job.rows_per_block as i32,
        n_blk: n_blk as i32,
        mean_group: job.head_mean.map_or(1, |(_, g)| g as i32),
        n_pad: job.transposed.2 as i32,
        heads_q: job.row_offset.as_ref().map_or(1, |r| r.heads_q as i32),
        heads_kv: job.row_offset.as_ref().map_or(1, |r| r.heads_kv as i32),
        c_lambda: job.row_offset.as_ref().map_or(0.0, |r| r.c_lambda),
    }
}

/// Mirror of `QuantQkvParams` in quantize.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct QuantQkvParams {
    k: QuantRowsParams,
    v: QuantRowsParams,
    q: QuantRowsParams,
    k_blocks: i32,
    v_blocks: i32,
    v_first: i32,
    pad: i32,
}
const _: () = assert!(std::mem::size_of::<QuantQkvParams>() == 3 * 104 + 16);

/// Whether `sage_quantize_qkv` can take the K, V and Q jobs: all three on the register-tile layout
/// (no Q-smoothing, no BF16 transposed copy), every group full with Q's groups in pairs of one
/// (batch, head), 16-byte aligned inputs. Otherwise the three `sage_quantize_rows` launches.
fn fused_qkv_applies(gpu: &Gpu, jobs: [&RowsJob; 3]) -> bool {
    let [kj, vj, qj] = jobs;
    let tiles = jobs.iter().all(|j| j.block_mean.is_none() && j.transposed.1.is_none());
    let full = kj.n % kj.rows_per_block == 0 && qj.n % (2 * qj.rows_per_block) == 0 && vj.n == kj.n;
    let same_threads = kj.rows_per_block == vj.rows_per_block && kj.rows_per_block == 2 * qj.rows_per_block;
    let aligned = jobs.iter().all(|j| {
        gpu.ptr(j.x).is_multiple_of(16)
            && gpu.ptr(j.x_hat).is_multiple_of(8)
            && gpu.ptr(j.transposed.0).is_multiple_of(8)
    });
    tiles
        && full
        && same_threads
        && aligned
        && qj.row_offset.is_some()
        && kj.transposed.2 % 8 == 0
        && qj.transposed.2 % 8 == 0
}

/// K, V and Q quantized in one launch (`sage_quantize_qkv`, the same bits as three
/// `sage_quantize_rows` launches), when [`fused_qkv_applies`]; else the three launches. With `v8_scale` (the
/// channel scales s_V of the e4m3 V̂ᵀ, written by `sage_k_mean_v8` before) the fused launch (`sage_quantize_qkv_v8`)
/// writes V̂ᵀ in e4m3 in place of the INT8 one; the three launches then write no V̂ᵀ (the caller runs `sage_quantize_v_e4m3`) and skip
/// V's job when nothing else of it is asked. Returns whether the fused launch ran.
fn quantize_qkv(
    gpu: &Gpu,
    k: &Kernels,
    jobs: [RowsJob; 3],
    v_first: bool,
    v8_scale: Option<&CudaSlice<f32>>,
) -> Result<bool> {
    if !fused_qkv_applies(gpu, [&jobs[0], &jobs[1], &jobs[2]]) {
        let none: Option<CudaSlice<i8>> = None;
        let [kj, mut vj, qj] = jobs;
        if v8_scale.is_some() {
            vj.transposed.0 = &none;
        }
        let v_asked = vj.x_hat.is_some() || vj.transposed.0.is_some() || vj.transposed.1.is_some();
        quantize_rows(gpu, k, kj)?;
        if v_asked {
            quantize_rows(gpu, k, vj)?;
        }
        quantize_rows(gpu, k, qj)?;
        return Ok(false);
    }
    let [kj, vj, qj] = &jobs;
    let (kp, vp, qp) = (rows_params(gpu, kj), rows_params(gpu, vj), rows_params(gpu, qj));
    let k_blocks = kp.n_blk * kj.bh as i32;
    let v_blocks = vp.n_blk * vj.bh as i32;
    let q_blocks = qp.n_blk * qj.bh as i32 / 2;
    // Grid order K, V, Q by default, also under PDL: K's first wave loads K and waits for the K mean,
    // then meets more of K in L2 right after its partial sums read it. `v_first` (with PDL) puts V's
    // groups first so that they run during the K mean: measured 2.2–2.5 µs slower per forward at the
    // training shape.
    let v_first = v_first as i32;
    let mut p = QuantQkvParams {
        k: kp,
        v: vp,
        q: qp,
        k_blocks,
        v_blocks,
        v_first,
        pad: 0,
    };
    if let Some(s_v) = v8_scale {
        // sage_quantize_qkv_v8: V's groups write the e4m3 V̂ᵀ with the channel scales sage_k_mean_v8 wrote
        p.v.scale = gpu.ptr(s_v); // (no natural V̂ on this path: x_hat is null)
    }
    let threads = tile_threads(kj.rows_per_block, k.head_dim);
    let smem = (2 * qj.rows_per_block * (k.head_dim + 8) * 2) as u32; // both Q groups' rows for b_r
    let func = k.quantize_function(if v8_scale.is_some() {
        c"sage_quantize_qkv_v8"
    } else {
        c"sage_quantize_qkv"
    })?;
    let mut args: [*mut std::ffi::c_void; 1] = [(&mut p as *mut QuantQkvParams).cast()];
    let grid = ((k_blocks + v_blocks + q_blocks) as u32, 1, 1);
    // PDL after sage_k_mean (it triggers at its start): the first wave's loads overlap the K mean
    // (quantize.cu, sage_quantize_qkv)
    launch_pdl(gpu, func, grid, threads, smem, gpu.dev.stream.cu_stream(), &mut args)?;
    Ok(true)
}

/// Whether the glue kernels may be launched with programmatic dependent launch ([`launch_pdl`]):
/// compute capability 9.0 or newer (the NVRTC target `sm_90a`, `sm_100`, …), unless the tuning turns it off.
pub(crate) fn pdl_enabled(gpu: &Gpu) -> bool {
    gpu.tuning().pdl_on(&gpu.dev.arch)
}

/// [`Gpu::launch_raw`] with programmatic stream serialization (PDL) where [`pdl_enabled`]: the
/// kernel may start while its predecessor in `stream` still runs, once every block of that
/// predecessor has executed `griddepcontrol.launch_dependents` or exited. Only for kernels written
/// for it: each reads before its `griddepcontrol.wait` only what was written before its predecessor
/// started, writes before it only buffers the predecessor does not touch, and executes it in every
/// thread before exiting (the rules in quantize.cu, `pdl_wait`). Without PDL the plain launch.
pub(crate) fn launch_pdl(
    gpu: &Gpu,
    func: sys::CUfunction,
    grid: (u32, u32, u32),
    block: u32,
    smem: u32,
    stream: sys::CUstream,
    args: &mut [*mut std::ffi::c_void],
) -> Result<()> {
    if !pdl_enabled(gpu) {
        return gpu.launch_raw(func, grid, block, smem, stream, args);
    }
    drv("bind context", gpu.dev.ctx.bind_to_thread())?;
    // SAFETY: a zeroed union is a valid value; the one field the attribute id selects is set.
    let mut value: sys::CUlaunchAttributeValue = unsafe { std::mem::zeroed() };
    value.programmaticStreamSerializationAllowed = 1;
    let mut attr = sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
        pad: [0; 4],
        value,
    };
    let cfg = sys::CUlaunchConfig {
        gridDimX: grid.0,
        gridDimY: grid.1,
        gridDimZ: grid.2,
        blockDimX: block,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: smem,
        hStream: stream,
        attrs: &mut attr,
        numAttrs: 1,
    };
    drv("cuLaunchKernelEx (PDL)", unsafe {
        sys::cuLaunchKernelEx(&cfg, func, args.as_mut_ptr(), std::ptr::null_mut()).result()
    })
}

/// The dQ postprocess of the sagebwd path, `sage_bwd_post_dq_int8` (backward_post.cu: the arithmetic of
/// `sage_bwd_post_dq`, four groups of eight elements per thread, loads first), over `groups8` groups
/// of eight elements, launched with PDL after the main kernel (it waits for it first). `args`: the
/// seven parameters of `sage_bwd_post_dq`.
pub(crate) fn post_dq_sage(
    gpu: &Gpu,
    k: &Kernels,
    groups8: usize,
    stream: sys::CUstream,
    args: &mut [*mut std::ffi::c_void],
) -> Result<()> {
    const UNROLL: usize = 4; // POST_UNROLL in backward_post.cu
    let func = k.backward_post_function(c"sage_bwd_post_dq_int8")?;
    let blocks = groups8.div_ceil(THREADS as usize * UNROLL).max(1) as u32;
    launch_pdl(gpu, func, (blocks, 1, 1), THREADS, 0, stream, args)
}

/// Threads of a register-tile `sage_quantize_rows` block: one per 8 × 8 tile of its rows.
fn tile_threads(rows_per_block: usize, head_dim: usize) -> u32 {
    (rows_per_block / 8 * head_dim / 8) as u32
}

/// Launches `sage_quantize_rows` over `bh` (batch, head) rows with (threads, shared bytes).
fn launch_rows(gpu: &Gpu, k: &Kernels, p: &QuantRowsParams, bh: usize, (threads, smem): (u32, u32)) -> Result<()> {
    let cfg = LaunchConfig {
        grid_dim: (p.n_blk as u32, bh as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem,
    };
    let stream = &gpu.dev.stream;
    drv("launch sage_quantize_rows", unsafe {
        stream.launch_builder(&k.quantize_rows).arg(p).launch(cfg)
    })
    .map(drop)
}

/// Rows per partial sum of the K mean (`K_MEAN_CHUNK` in quantize.cu).
const K_MEAN_CHUNK: usize = 512;

/// K_m, then K̂ (from K_s), V̂, Q̂ (from Q_s) and their transposed copies (ALGORITHM.md §3), as far
/// as the kernel paths for `cfg` read them ([`QuantNeeds`]).
pub fn quantize_inputs(gpu: &Gpu, k: &Kernels, x: &DeviceInputs, cfg: &Config) -> Result<QuantizedDev> {
    quantize_planned(gpu, k, x, cfg, &gpu.plan(cfg, &x.shape, x.causal))
}

/// [`quantize_inputs`] for the stages of `plan`.
pub(crate) fn quantize_planned(
    gpu: &Gpu,
    k: &Kernels,
    x: &DeviceInputs,
    cfg: &Config,
    plan: &KernelPlan,
) -> Result<QuantizedDev> {
    let s = &x.shape;
    let dims = Dims::of(s, x.causal);
    let (bh_q, bh_kv) = (s.batch * s.heads_q, s.batch * s.heads_kv);
    let d = s.head_dim;
    let needs = plan.prepare.needs;
    let k_mean = gpu.alloc_poisoned_f32(bh_kv * d)?;
    if !needs.quantized {
        return Ok(QuantizedDev {
            needs,
            q_hat: None,
            q_scale: None,
            q_mean: None,
            k_hat: None,
            k_scale: None,
            k_mean,
            row_offset: None,
            q_hat_t: None,
            q_t: None,
            k_hat_t: None,
            k_t: None,
            v_hat_t: None,
            v_t: None,
            v_hat: None,
            v_scale: None,
        });
    }
    let bf16_t = |n: usize| -> Result<Option<CudaSlice<u16>>> {
        if needs.bf16_transposed {
            Ok(Some(gpu.alloc_poisoned_u16(n)?))
        } else {
            Ok(None)
        }
    };
    let (q_t_len, kv_t_len) = (bh_q * d * padded_q(s.n_q), bh_kv * d * padded_k(s.n_k));
    let (q_hat, q_scale) = (
        gpu.alloc_poisoned_i8(s.q_len())?,
        gpu.alloc_poisoned_f32(bh_q * dims.n_qblk as usize)?,
    );
    let (k_hat, k_scale) = (
        gpu.alloc_poisoned_i8(s.kv_len())?,
        gpu.alloc_poisoned_f32(bh_kv * dims.n_kblk as usize)?,
    );
    // The e4m3 V̂ᵀ of the FP8 P·V forward (§10.1): by default written over the INT8 V̂ᵀ after the INT8 quantization;
    // fused (`v_e4m3_fused`), in the K mean's grids and the Q/K/V launch in place of the INT8 V̂ᵀ and V̂.
    let v8 = plan.prepare.v_e4m3_fused;
    let v_hat = if needs.natural_v_do && !v8 {
        Some(gpu.alloc_poisoned_i8(s.kv_len())?)
    } else {
        None
    };
    let v_scale = gpu.alloc_poisoned_f32(bh_kv * dims.n_kblk as usize)?;
    // its channel scales s_V [B·H_kv, d] and their partial amaxes over chunks of keys [B·H_kv, chunks, d]
    let n_chunks = s.n_k.div_ceil(K_MEAN_CHUNK);
    let v8_bufs = if v8 {
        Some((
            gpu.alloc_poisoned_f32(bh_kv * d)?,
            gpu.alloc_poisoned_f32(bh_kv * n_chunks * d)?,
        ))
    } else {
        None
    };
    let (q_hat, k_hat) = (Some(q_hat), Some(k_hat));
    let q_mean = gpu.alloc_poisoned_f32(if cfg.smooth_q {
        bh_q * dims.n_qblk as usize * d
    } else {
        1
    })?;
    let row_offset = gpu.alloc_poisoned_f32(bh_q * s.n_q)?;
    // Q̂ᵀ and K̂ᵀ: only backward products read them; written here when the plan says so (the staged sagebwd
    // backward in one head group: made from the same register tiles as Q̂, K̂, they are the bytes the backward's
    // transposes would write), else the backward transposes Q̂, K̂ per head group (`transpose_qk_hat`), so that no
    // full copy is kept between the passes.
    let qk_t = plan.prepare.qk_hat_t_in_forward;
    let hat_t = |n: usize| -> Result<Option<CudaSlice<i8>>> {
        if qk_t {
            Ok(Some(gpu.alloc_poisoned_i8(n)?))
        } else {
            Ok(None)
        }
    };
    let (q_hat_t, q_t) = (hat_t(q_t_len)?, bf16_t(q_t_len)?);
    let (k_hat_t, k_t) = (hat_t(kv_t_len)?, bf16_t(kv_t_len)?);
    let (v_hat_t, v_t) = (Some(gpu.alloc_poisoned_i8(kv_t_len)?), bf16_t(kv_t_len)?);
    let stream = &gpu.dev.stream;
    let smooth_k = flags(cfg) & crate::F_SMOOTH_K != 0;
    let (_, c_lambda) = crate::forward::scales(d);
    let jobs = [
        RowsJob {
            x: &x.k,
            bh: bh_kv,
            n: s.n_k,
            rows_per_block: BLOCK_KV,
            head_mean: Some((&k_mean, 1)),
            block_mean: None,
            x_hat: &k_hat,
            scale: &k_scale,
            transposed: (&k_hat_t, &k_t, padded_k(s.n_k)),
            row_offset: None,
        },
        RowsJob {
            x: &x.v,
            bh: bh_kv,
            n: s.n_k,
            rows_per_block: BLOCK_KV,
            head_mean: None,
            block_mean: None,
            x_hat: &v_hat,
            scale: &v_scale,
            transposed: (&v_hat_t, &v_t, padded_k(s.n_k)),
            row_offset: None,
        },
        RowsJob {
            x: &x.q,
            bh: bh_q,
            n: s.n_q,
            rows_per_block: BLOCK_Q,
            head_mean: None,
            block_mean: cfg.smooth_q.then_some(&q_mean),
            x_hat: &q_hat,
            scale: &q_scale,
            transposed: (&q_hat_t, &q_t, padded_q(s.n_q)),
            // b_r = fl(cλ·q_r·K_m) (§3.5) from the staged Q tile
            row_offset: Some(RowOffsets {
                k_mean: &k_mean,
                out: &row_offset,
                heads_q: s.heads_q,
                heads_kv: s.heads_kv,
                c_lambda,
            }),
        },
    ];
    // K_m: FP64 partial sums over chunks of K_MEAN_CHUNK rows (in parallel), then their sum; the e4m3 V̂ᵀ's channel
    // amaxes in the same two grids (chunks of keys, then over the chunks to s_V).
    let partial = gpu.alloc_f32(if smooth_k { 2 * bh_kv * n_chunks * d } else { 2 })?; // f64
    let (n_k, n_chunks_i) = (s.n_k as i32, n_chunks as i32);
    let ptr_of = |b: Option<&CudaSlice<f32>>| b.map_or(0, |b| gpu.ptr(b));
    let (v8_scale, v8_amax) = (v8_bufs.as_ref().map(|b| &b.0), v8_bufs.as_ref().map(|b| &b.1));
    if smooth_k || v8 {
        // a normal launch: the PDL chain after it (K mean, Q/K/V quantization) relies on everything
        // queued before it being complete once it runs. sage_k_mean_partial takes the first four
        // arguments; sage_k_mean_partial_v8 all six, its K sums only with K-smoothing (a null
        // `partial` skips them).
        let (mut k_ptr, mut part_ptr, mut n_k, mut n_chunks_i, mut v_ptr, mut amax_ptr) = (
            gpu.ptr(&x.k),
            if smooth_k { gpu.ptr(&partial) } else { 0 },
            n_k,
            n_chunks_i,
            gpu.ptr(&x.v),
            ptr_of(v8_amax),
        );
        let mut part_args: [*mut std::ffi::c_void; 6] = [
            (&mut k_ptr as *mut u64).cast(),
            (&mut part_ptr as *mut u64).cast(),
            (&mut n_k as *mut i32).cast(),
            (&mut n_chunks_i as *mut i32).cast(),
            (&mut v_ptr as *mut u64).cast(),
            (&mut amax_ptr as *mut u64).cast(),
        ];
        let (part_fn, part_args) = if v8 {
            (k.quantize_function(c"sage_k_mean_partial_v8")?, &mut part_args[..])
        } else {
            (k.k_mean_partial.cu_function(), &mut part_args[..4])
        };
        let grid = (n_chunks as u32, bh_kv as u32, 1);
        gpu.launch_raw(part_fn, grid, THREADS, 0, stream.cu_stream(), part_args)?;
    }
    // After sage_k_mean_partial (which triggers at its start and had a normal launch) sage_k_mean is launched with
    // PDL and waits for it; without it, normally (its predecessor is anything, and the Q/K/V quantization, PDL after
    // it, reads V before waiting).
    let pdl_mean = smooth_k || v8;
    let mut smooth_k = smooth_k as i32;
    let (mut partial_ptr, mut k_mean_ptr, mut n_k, mut n_chunks_i, mut amax_ptr, mut s_v_ptr) = (
        gpu.ptr(&partial),
        gpu.ptr(&k_mean),
        n_k,
        n_chunks_i,
        ptr_of(v8_amax),
        ptr_of(v8_scale),
    );
    let mut mean_args: [*mut std::ffi::c_void; 7] = [
        (&mut partial_ptr as *mut u64).cast(),
        (&mut k_mean_ptr as *mut u64).cast(),
        (&mut n_k as *mut i32).cast(),
        (&mut n_chunks_i as *mut i32).cast(),
        (&mut smooth_k as *mut i32).cast(),
        (&mut amax_ptr as *mut u64).cast(),
        (&mut s_v_ptr as *mut u64).cast(),
    ];
    // sage_k_mean takes the first five, sage_k_mean_v8 all seven
    let (mean_fn, mean_args) = if v8 {
        (k.quantize_function(c"sage_k_mean_v8")?, &mut mean_args[..])
    } else {
        (k.k_mean.cu_function(), &mut mean_args[..5])
    };
    if pdl_mean {
        launch_pdl(
            gpu,
            mean_fn,
            (bh_kv as u32, 1, 1),
            d as u32,
            0,
            stream.cu_stream(),
            mean_args,
        )?;
    } else {
        gpu.launch_raw(
            mean_fn,
            (bh_kv as u32, 1, 1),
            d as u32,
            0,
            stream.cu_stream(),
            mean_args,
        )?;
    }
    let fused = quantize_qkv(gpu, k, jobs, plan.prepare.v_first, v8_scale)?;
    let v_scale = match (&v_hat_t, v8_bufs) {
        (Some(v_hat_t), Some((s_v, _))) => {
            if !fused {
                quantize_v_e4m3(gpu, k, x, &dims, V8Scales::Given(&s_v), v_hat_t)?;
            }
            s_v
        }
        (Some(v_hat_t), None) if plan.prepare.v_e4m3 => {
            let s_v = gpu.alloc_poisoned_f32(bh_kv * d)?;
            quantize_v_e4m3(gpu, k, x, &dims, V8Scales::FromAmax(&s_v), v_hat_t)?;
            s_v
        }
        _ => v_scale,
    };
    Ok(QuantizedDev {
        needs,
        q_hat,
        q_scale: Some(q_scale),
        q_mean: Some(q_mean),
        k_hat,
        k_scale: Some(k_scale),
        k_mean,
        row_offset: Some(row_offset),
        q_hat_t,
        q_t,
        k_hat_t,
        k_t,
        v_hat_t,
        v_t,
        v_hat,
        v_scale: Some(v_scale),
    })
}

/// Keys per partial channel amax of the e4m3 V̂ᵀ (`V8_CHUNK` in quantize.cu).
const V8_CHUNK: usize = K_MEAN_CHUNK;
/// Keys per block of `sage_quantize_v_e4m3` (`V8_TILE`).
const V8_TILE: usize = 64;

/// Where `sage_quantize_v_e4m3` gets the channel scales s_V `[B, H_kv, d]`.
enum V8Scales<'a> {
    /// Computed here: `sage_v_amax_partial` first, then written into this buffer (the default path, over the INT8
    /// V̂ᵀ).
    FromAmax(&'a CudaSlice<f32>),
    /// Already written by `sage_k_mean_v8` (the fused path where its Q/K/V launch does not apply).
    Given(&'a CudaSlice<f32>),
}

/// V̂ᵀ in e4m3 with one power-of-two scale per channel (ALGORITHM.md §10.1) into `v_hat_t`: `sage_quantize_v_e4m3`
/// over (key tiles) × (batch, KV head), after `sage_v_amax_partial` over (key chunks) × (batch, KV head) where the
/// scales are not given.
fn quantize_v_e4m3(
    gpu: &Gpu,
    k: &Kernels,
    x: &DeviceInputs,
    dims: &Dims,
    scales: V8Scales,
    v_hat_t: &CudaSlice<i8>,
) -> Result<()> {
    let s = &x.shape;
    let bh_kv = s.batch * s.heads_kv;
    let stream = gpu.dev.stream.cu_stream();
    let (mut v, mut out, mut d) = (gpu.ptr(&x.v), gpu.ptr(v_hat_t), *dims);
    let (amax, s_v) = match scales {
        V8Scales::FromAmax(s_v) => {
            let chunks = s.n_k.div_ceil(V8_CHUNK);
            let amax = gpu.alloc_poisoned_f32(bh_kv * chunks * s.head_dim)?;
            let mut am = gpu.ptr(&amax);
            let mut partial: [*mut std::ffi::c_void; 3] = [
                (&mut v as *mut u64).cast(),
                (&mut am as *mut u64).cast(),
                (&mut d as *mut Dims).cast(),
            ];
            let func = k.quantize_function(c"sage_v_amax_partial")?;
            gpu.launch_raw(func, (chunks as u32, bh_kv as u32, 1), THREADS, 0, stream, &mut partial)?;
            (Some(amax), s_v)
        }
        V8Scales::Given(s_v) => (None, s_v),
    };
    let (mut am, mut sc) = (amax.as_ref().map_or(0, |a| gpu.ptr(a)), gpu.ptr(s_v));
    let mut args: [*mut std::ffi::c_void; 5] = [
        (&mut v as *mut u64).cast(),
        (&mut am as *mut u64).cast(),
        (&mut out as *mut u64).cast(),
        (&mut sc as *mut u64).cast(),
        (&mut d as *mut Dims).cast(),
    ];
    let tiles = (dims.n_kpad as usize).div_ceil(V8_TILE) as u32;
    let func = k.quantize_function(if amax.is_some() {
        c"sage_quantize_v_e4m3"
    } else {
        c"sage_quantize_v_e4m3_scaled"
    })?;
    gpu.launch_raw(func, (tiles, bh_kv as u32, 1), THREADS, 0, stream, &mut args)
}

/// dÔ and s_dO per B_q block (backward preprocess), and the transposed copies, as far as `needs`
/// (the forward's) asks.
pub fn quantize_do(
    gpu: &Gpu,
    k: &Kernels,
    x: &DeviceInputs,
    d_o: &CudaSlice<u16>,
    needs: QuantNeeds,
) -> Result<QuantizedDo> {
    let q = alloc_do(gpu, x, needs)?;
    if needs.quantized {
        quantize_rows(gpu, k, do_job(x, d_o, &q))?;
    }
    Ok(q)
}

/// The buffers of [`quantize_do`] (none without `needs.quantized`).
fn alloc_do(gpu: &Gpu, x: &DeviceInputs, needs: QuantNeeds) -> Result<QuantizedDo> {
    if !needs.quantized {
        return Ok(QuantizedDo {
            do_hat: None,
            do_scale: None,
            do_hat_t: None,
            do_t: None,
        });
    }
    let s = &x.shape;
    let bh_q = s.batch * s.heads_q;
    let t_len = bh_q * s.head_dim * padded_q(s.n_q);
    let do_hat = if needs.natural_v_do {
        Some(gpu.alloc_poisoned_i8(s.q_len())?)
    } else {
        None
    };
    let do_scale = gpu.alloc_poisoned_f32(bh_q * s.n_q.div_ceil(BLOCK_Q))?;
    let do_hat_t = Some(gpu.alloc_poisoned_i8(t_len)?);
    let do_t = if needs.bf16_transposed {
        Some(gpu.alloc_poisoned_u16(t_len)?)
    } else {
        None
    };
    Ok(QuantizedDo {
        do_hat,
        do_scale: Some(do_scale),
        do_hat_t,
        do_t,
    })
}

/// The `sage_quantize_rows` job of the dO quantization into `q`'s buffers.
fn do_job<'a>(x: &DeviceInputs, d_o: &'a CudaSlice<u16>, q: &'a QuantizedDo) -> RowsJob<'a> {
    let s = &x.shape;
    RowsJob {
        x: d_o,
        bh: s.batch * s.heads_q,
        n: s.n_q,
        rows_per_block: BLOCK_Q,
        head_mean: None,
        block_mean: None,
        x_hat: &q.do_hat,
        scale: q.do_scale.as_ref().expect("s_dO is allocated when quantized"),
        transposed: (&q.do_hat_t, &q.do_t, padded_q(s.n_q)),
        row_offset: None,
    }
}

/// [`quantize_do`] for the backward preprocess of one head group, with D in the same pass where it
/// can: `sage_bwd_pre_do` (quantize.cu) writes dÔ (as `needs` asks), dÔᵀ, s_dO, D = rowsum(O ∘ dO)
/// into `delta` and zeroes the FP32 dQ accumulator at `dq_zero` (all rows), reading dO once. It
/// takes every B_q group full, 16-byte aligned O, dO, dQ accumulator (8-byte aligned
/// dÔ, dÔᵀ) and no BF16 dOᵀ, where `allow_fused` (the plan's choice). Returns whether it did (else only the
/// quantization is queued and the caller runs `sage_bwd_delta`). The same bits either way: the
/// kernel repeats both kernels' arithmetic.
#[allow(clippy::too_many_arguments)] // the dO quantization's four plus D's O, D and dQ accumulator, and the plan's switch
pub(crate) fn quantize_do_delta(
    gpu: &Gpu,
    k: &Kernels,
    x: &DeviceInputs,
    d_o: &CudaSlice<u16>,
    o: &CudaSlice<u16>,
    needs: QuantNeeds,
    delta: &CudaSlice<f32>,
    dq_zero: u64,
    allow_fused: bool,
) -> Result<(QuantizedDo, bool)> {
    let s = &x.shape;
    let q = alloc_do(gpu, x, needs)?;
    if !needs.quantized {
        return Ok((q, false));
    }
    let mut p = rows_params(gpu, &do_job(x, d_o, &q));
    let off = !allow_fused;
    let fits = !needs.bf16_transposed
        && s.n_q.is_multiple_of(BLOCK_Q)
        && p.n_pad % 8 == 0
        && gpu.ptr(d_o).is_multiple_of(16)
        && gpu.ptr(o).is_multiple_of(16)
        && dq_zero != 0
        && dq_zero.is_multiple_of(16)
        && p.x_hat.is_multiple_of(8)
        && p.x_hat_t.is_multiple_of(8);
    if off || !fits {
        quantize_rows(gpu, k, do_job(x, d_o, &q))?;
        return Ok((q, false));
    }
    let (mut o_ptr, mut delta_ptr, mut dq) = (gpu.ptr(o), gpu.ptr(delta), dq_zero);
    let mut args: [*mut std::ffi::c_void; 4] = [
        (&mut p as *mut QuantRowsParams).cast(),
        (&mut o_ptr as *mut u64).cast(),
        (&mut delta_ptr as *mut u64).cast(),
        (&mut dq as *mut u64).cast(),
    ];
    let func = k.quantize_function(c"sage_bwd_pre_do")?;
    let grid = (p.n_blk as u32, (s.batch * s.heads_q) as u32, 1);
    gpu.launch_raw(
        func,
        grid,
        tile_threads(BLOCK_Q, k.head_dim),
        0,
        gpu.dev.stream.cu_stream(),
        &mut args,
    )?;
    Ok((q, true))
}

/// dÔᵀ `[rows, d, N_q,pad]` and s_dO of `rows` consecutive (batch, query head) rows: the
/// quantization of [`quantize_do`] restricted to one head group of the staged sagebwd backward
/// (which reads dÔᵀ alone). `d_o` and `scale` are the device addresses of the group's first row in
/// the full dO and s_dO; `do_hat_t` holds the group only. Same kernel and launch as the full
/// quantization, so the same bits.
pub(crate) fn quantize_do_rows(
    gpu: &Gpu,
    k: &Kernels,
    (d_o, scale): (u64, u64),
    do_hat_t: &CudaSlice<i8>,
    rows: usize,
    n_q: usize,
    stream: sys::CUstream,
) -> Result<()> {
    let d = k.head_dim;
    let n_blk = n_q.div_ceil(BLOCK_Q);
    let mut p = QuantRowsParams {
        x: d_o,
        head_mean: 0,
        block_mean: 0,
        x_hat: 0,
        scale,
        x_hat_t: gpu.ptr(do_hat_t),
        x_t: 0,
        k_mean: 0,
        row_offset: 0,
        n: n_q as i32,
        rows_per_block: BLOCK_Q as i32,
        n_blk: n_blk as i32,
        mean_group: 1,
        n_pad: padded_q(n_q) as i32,
        heads_q: 1,
        heads_kv: 1,
        c_lambda: 0.0,
    };
    // the register-tile layout of `rows_launch` (no smoothing, no BF16 copy, no row offsets)
    let threads = tile_threads(BLOCK_Q, d);
    let mut args: [*mut std::ffi::c_void; 1] = [(&mut p as *mut QuantRowsParams).cast()];
    gpu.launch_raw(
        k.quantize_rows.cu_function(),
        (n_blk as u32, rows as u32, 1),
        threads,
        0,
        stream,
        &mut args,
    )
}

/// Q̂ᵀ and K̂ᵀ `[rows, d, N_pad]` of `rows` consecutive (batch, head) rows, byte-transposed from the
/// saved Q̂, K̂ (device addresses of the group's first row): the bits the quantizer's transposed
/// output holds, made where the backward needs them. One launch (`sage_transpose_qk_hat` in
/// quantize.cu) for both. Without GQA the rows of Q and K coincide; with GQA the backward runs one
/// group, all rows (`rows` counts query rows for Q̂, `kv_rows` key rows for K̂).
///
/// `one_group` (the one-group backward, right after its preprocess; with `rows == kv_rows`):
/// `sage_transpose_qk_hat16` (16 × 16 bytes per thread, the same bytes), launched with programmatic
/// dependent launch: the transposes touch nothing the preprocess reads or writes, so they may
/// overlap its last wave (the kernel waits for its predecessor before exiting).
#[allow(clippy::too_many_arguments)]
pub(crate) fn transpose_qk_hat(
    gpu: &Gpu,
    k: &Kernels,
    (q_hat, k_hat): (u64, u64),
    (q_hat_t, k_hat_t): (&CudaSlice<i8>, &CudaSlice<i8>),
    (rows, kv_rows): (usize, usize),
    (n_q, n_k): (usize, usize),
    stream: sys::CUstream,
    one_group: bool,
) -> Result<()> {
    // Kernel arguments (x, x_t, n, n_pad) of the z = 0 and z = 1 slots.
    let q = (q_hat, gpu.ptr(q_hat_t), n_q as i32, padded_q(n_q) as i32);
    let k_ = (k_hat, gpu.ptr(k_hat_t), n_k as i32, padded_k(n_k) as i32);
    // `rows_per_block` rows of the longer tensor per block in x (blocks past a tensor's end return).
    let launch = |func: sys::CUfunction,
                  rows_per_block: usize,
                  pdl: bool,
                  slot0: (u64, u64, i32, i32),
                  slot1: (u64, u64, i32, i32),
                  grid_y: usize,
                  grid_z: u32|
     -> Result<()> {
        let (mut x0, mut t0, mut n0, mut p0) = slot0;
        let (mut x1, mut t1, mut n1, mut p1) = slot1;
        let mut args: [*mut std::ffi::c_void; 8] = [
            (&mut x0 as *mut u64).cast(),
            (&mut t0 as *mut u64).cast(),
            (&mut n0 as *mut i32).cast(),
            (&mut p0 as *mut i32).cast(),
            (&mut x1 as *mut u64).cast(),
            (&mut t1 as *mut u64).cast(),
            (&mut n1 as *mut i32).cast(),
            (&mut p1 as *mut i32).cast(),
        ];
        let grid = (n_q.max(n_k).div_ceil(rows_per_block) as u32, grid_y as u32, grid_z);
        if pdl {
            launch_pdl(gpu, func, grid, k.head_dim as u32, 0, stream, &mut args)
        } else {
            gpu.launch_raw(func, grid, k.head_dim as u32, 0, stream, &mut args)
        }
    };
    let func = k.transpose_qk_hat.cu_function();
    if rows == kv_rows {
        if one_group {
            // 16 × 16 bytes per thread, 256 rows per block; PDL after the preprocess
            let func16 = k.quantize_function(c"sage_transpose_qk_hat16")?;
            return launch(func16, 256, true, q, k_, rows, 2);
        }
        return launch(func, 64, false, q, k_, rows, 2); // z = 0: Q̂, z = 1: K̂
    }
    // GQA: Q̂ over the query rows, then K̂ over the key rows, each in slot z = 0.
    launch(func, 64, false, q, k_, rows, 1)?;
    launch(func, 64, false, k_, k_, kv_rows, 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{forward_path, staged_backward, ForwardPath, StagedBackward};
    use sagebwd::Product;

    fn needs(tensor_cores: bool, cfg: &Config) -> QuantNeeds {
        QuantNeeds::for_paths(tensor_cores, flags(cfg))
    }

    /// The quantization outputs the kernels dereference.
    #[derive(Clone, Copy, Debug)]
    enum Read {
        /// Q̂, K̂ (and their transposes, which the backward makes from them), V̂ᵀ, dÔᵀ, the scales, K_m, b_r.
        Quantized,
        /// V̂ and dÔ in the natural layout.
        NaturalVDo,
        /// Qᵀ, Kᵀ, Vᵀ, dOᵀ in BF16.
        Bf16Transposed,
    }
    const ALL: [Read; 3] = [Read::Quantized, Read::NaturalVDo, Read::Bf16Transposed];

    /// What each kernel path reads, written down from the kernels (forward.cu, backward_main.cu),
    /// not from `for_paths`: the staged INT8 forward reads Q̂, K̂, V̂ᵀ; the staged sagebwd backward
    /// Q̂, Q̂ᵀ, K̂, K̂ᵀ, dÔᵀ (and the BF16 V, dO inputs); the staged BF16 paths the BF16 inputs only;
    /// the gathering forward all but the natural V̂; the gathering backward and the scalar kernels
    /// everything.
    fn reads(tensor_cores: bool, f: i32) -> Vec<Read> {
        if !tensor_cores {
            return ALL.to_vec();
        }
        let mut r = match forward_path(f) {
            ForwardPath::StagedInt8 => vec![Read::Quantized],
            ForwardPath::StagedBf16 => vec![],
            // mma_pv reads V̂ᵀ and Vᵀ; only the scalar forward reads the natural V̂
            ForwardPath::Gather => vec![Read::Quantized, Read::Bf16Transposed],
        };
        r.extend(match staged_backward(f) {
            Some(StagedBackward::Sage) => vec![Read::Quantized],
            Some(StagedBackward::Bf16) => vec![],
            None => ALL.to_vec(),
        });
        r
    }

    fn provides(n: QuantNeeds, r: Read) -> bool {
        match r {
            Read::Quantized => n.quantized,
            Read::NaturalVDo => n.quantized && n.natural_v_do,
            Read::Bf16Transposed => n.quantized && n.bf16_transposed,
        }
    }

    #[test]
    fn every_tensor_a_selected_path_reads_is_computed() {
        // Every product mix with every switch, on the tensor-core and the scalar kernels.
        for bits in 0..(1 << 7) {
            for switches in 0..8 {
                let f = bits
                    | ((switches & 1) * crate::F_SMOOTH_K)
                    | (((switches >> 1) & 1) * crate::plan::F_SMOOTH_Q)
                    | ((switches >> 2) * crate::F_DQ_CORR);
                for tc in [true, false] {
                    let n = QuantNeeds::for_paths(tc, f);
                    for r in reads(tc, f) {
                        assert!(
                            provides(n, r),
                            "flags {f:#x}, tensor cores {tc}: {r:?} is read but {n:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn only_the_outputs_the_selected_paths_read() {
        let all = QuantNeeds {
            quantized: true,
            bf16_transposed: true,
            natural_v_do: true,
        };
        // Staged all-BF16 passes read no quantized operand; staged INT8 ones no BF16 transposes and
        // (sagebwd's staged backward) no natural V̂ or dÔ.
        assert!(!needs(true, &Config::fpa()).quantized);
        assert_eq!(
            needs(true, &Config::sagebwd()),
            QuantNeeds {
                quantized: true,
                bf16_transposed: false,
                natural_v_do: false
            }
        );
        // A gathering backward (int8-all's) reads everything, a gathering forward (one INT8
        // forward product) all but the natural V̂ (and its backward, fpa's, no dÔ).
        assert_eq!(needs(true, &Config::int8_all()), all);
        assert_eq!(
            needs(true, &Config::isolate(Product::QkFwd)),
            QuantNeeds {
                natural_v_do: false,
                ..all
            }
        );
        // INT8 in one backward product: staged BF16 forward, gathering backward.
        assert_eq!(needs(true, &Config::isolate(Product::Dq)), all);
        // The scalar kernels read everything, whatever the preset.
        for cfg in [Config::fpa(), Config::sagebwd(), Config::int8_all()] {
            assert_eq!(needs(false, &cfg), all);
        }
    }
}
