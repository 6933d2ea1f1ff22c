//! Host side of `kernels/forward.cu` (ALGORITHM.md §4).

use crate::plan::{Bf16WsGrid, ForwardKernel, ForwardPath, KernelPlan};
use crate::quantize::{quantize_planned, QuantizedDev};
use crate::runtime::{drv, Dims, Kernels, THREADS};
use crate::{DeviceInputs, Gpu};
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use sagebwd::{Config, Result};

/// Mirror of `ScoreOperands` in common.cuh.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct ScoreOperands {
    pub q_hat: u64,
    pub q_scale: u64,
    pub q: u64,
    pub k_hat: u64,
    pub k_scale: u64,
    pub k: u64,
    pub k_mean: u64,
    pub q_mean: u64,
    pub row_offset: u64,
}

impl ScoreOperands {
    pub(crate) fn of(gpu: &Gpu, x: &DeviceInputs, qd: &QuantizedDev) -> ScoreOperands {
        ScoreOperands {
            q_hat: gpu.ptr(&qd.q_hat),
            q_scale: gpu.ptr(&qd.q_scale),
            q: gpu.ptr(&x.q),
            k_hat: gpu.ptr(&qd.k_hat),
            k_scale: gpu.ptr(&qd.k_scale),
            k: gpu.ptr(&x.k),
            k_mean: gpu.ptr(&qd.k_mean),
            q_mean: gpu.ptr(&qd.q_mean),
            row_offset: gpu.ptr(&qd.row_offset),
        }
    }
}

/// Mirror of `Transposed` in common.cuh.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct Transposed {
    pub q_hat_t: u64,
    pub q_t: u64,
    pub k_hat_t: u64,
    pub k_t: u64,
    pub v_hat_t: u64,
    pub v_t: u64,
    pub do_hat_t: u64,
    pub do_t: u64,
}

impl Transposed {
    pub(crate) fn of(gpu: &Gpu, qd: &QuantizedDev, dq: Option<&crate::QuantizedDo>) -> Transposed {
        Transposed {
            q_hat_t: gpu.ptr(&qd.q_hat_t),
            q_t: gpu.ptr(&qd.q_t),
            k_hat_t: gpu.ptr(&qd.k_hat_t),
            k_t: gpu.ptr(&qd.k_t),
            v_hat_t: gpu.ptr(&qd.v_hat_t),
            v_t: gpu.ptr(&qd.v_t),
            do_hat_t: dq.map_or(0, |d| gpu.ptr(&d.do_hat_t)),
            do_t: dq.map_or(0, |d| gpu.ptr(&d.do_t)),
        }
    }
}

/// Mirror of `ForwardParams` in forward.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct ForwardParams {
    op: ScoreOperands,
    tr: Transposed,
    v_hat: u64,
    v_scale: u64,
    v: u64,
    o: u64,
    lse2: u64,
    lse: u64,
    dims: Dims,
    flags: i32,
    c_lambda: f32,
    ln2: f32,
}
unsafe impl cudarc::driver::DeviceRepr for ForwardParams {}
// Layout contract with forward.cu, which static_asserts the same size.
const _: () = assert!(std::mem::size_of::<ForwardParams>() == 240);

/// The forward's outputs on the device.
pub struct DeviceForward {
    /// `[B, H_q, N_q, d]` BF16 bits.
    pub o: CudaSlice<u16>,
    /// `[B, H_q, N_q]` base-2 LSE of the true scores.
    pub lse2: CudaSlice<f32>,
    /// `[B, H_q, N_q]` natural LSE of the true scores (the exported one).
    pub lse: CudaSlice<f32>,
}

/// What the backward needs from the forward (ALGORITHM.md §4, last paragraph): the quantized
/// operands and scales, the smoothing means and row offsets; Q, K, V are read from the
/// [`DeviceInputs`], O and lse2 from the [`DeviceForward`] passed alongside.
pub struct SavedForBackward {
    pub quant: QuantizedDev,
    pub cfg: Config,
    /// The plan the forward ran; the backward runs its backward half, so that the two passes agree (e.g. on
    /// whether the forward kept Q̂ᵀ, K̂ᵀ for the backward).
    pub plan: KernelPlan,
}

/// Softmax scale `c = 1/sqrt(d)` and `cλ = fl(c · log2 e)`, both FP32.
pub fn scales(head_dim: usize) -> (f32, f32) {
    let c = (1.0 / (head_dim as f64).sqrt()) as f32;
    (c, c * std::f32::consts::LOG2_E)
}

/// Dynamic shared memory of `sage_fwd_sm80` on each path (`FAST_SMEM_BYTES`, `BF16_SMEM_BYTES`,
/// `GATHER_SMEM_BYTES` in forward.cu; the kernel traps when launched with less): staged INT8: two
/// K̂ and two V̂ᵀ tiles of 128 × d bytes, β and Q_m as FP32; staged BF16: two K and one V tile of
/// 128 × d BF16; gathering: `ForwardMmaShared` (P̂ and bf16(P) per warp, Q_m, β).
pub(crate) fn forward_mma_smem_bytes(head_dim: usize, path: ForwardPath) -> u32 {
    (match path {
        ForwardPath::StagedInt8 => 4 * 128 * head_dim + 4 * (128 + head_dim),
        ForwardPath::StagedBf16 => 3 * 128 * head_dim * 2,
        ForwardPath::Gather => 4 * 16 * 128 + 4 * 16 * 128 * 2 + 4 * (head_dim + 128),
    }) as u32
}

/// Quantization and the forward kernel the plan chooses. O is written into `o_into` when given (a caller's buffer of
/// `q_len` BF16, [`crate::external`]), else into a buffer allocated here; a caller's buffer is never freed by this
/// function, on success (the caller leaks the returned slice) or on error.
pub(crate) fn forward(
    gpu: &Gpu,
    k: &Kernels,
    x: &DeviceInputs,
    cfg: &Config,
    o_into: Option<CUdeviceptr>,
) -> Result<(DeviceForward, SavedForBackward)> {
    let plan = gpu.plan(cfg, &x.shape, x.causal);
    if plan.prepare.v_e4m3 && plan.forward.name() != crate::plan::FP8_PV_FORWARD.to_str().unwrap_or("") {
        return Err(sagebwd::Error::Config(format!(
            "{}: the FP8 P·V forward runs on sm_90a (Hopper) only, with its tensor-core kernels (this GPU: {}, forward \
             kernel {})",
            cfg.label(),
            plan.arch,
            plan.forward.name()
        )));
    }
    let quant = quantize_planned(gpu, k, x, cfg, &plan)?;
    let s = &x.shape;
    let rows = s.batch * s.heads_q * s.n_q;
    let (lse2, lse) = (gpu.alloc_poisoned_f32(rows)?, gpu.alloc_poisoned_f32(rows)?);
    let o = match o_into {
        // SAFETY: the caller's buffer (external::forward's contract); leaked below on error.
        Some(ptr) => unsafe { gpu.dev.stream.upgrade_device_ptr::<u16>(ptr, s.q_len()) },
        None => gpu.alloc_poisoned_u16(s.q_len())?,
    };
    let out = DeviceForward { o, lse2, lse };
    match launch_forward(gpu, k, x, &plan, &quant, &out) {
        Ok(()) => Ok((
            out,
            SavedForBackward {
                quant,
                cfg: cfg.clone(),
                plan,
            },
        )),
        Err(e) => {
            if o_into.is_some() {
                out.o.leak();
            }
            Err(e)
        }
    }
}

/// Queues the planned forward kernel writing `out`.
fn launch_forward(
    gpu: &Gpu,
    k: &Kernels,
    x: &DeviceInputs,
    plan: &KernelPlan,
    quant: &QuantizedDev,
    out: &DeviceForward,
) -> Result<()> {
    let s = &x.shape;
    let dims = Dims::of(s, x.causal);
    let (_, c_lambda) = scales(s.head_dim);
    let p = ForwardParams {
        op: ScoreOperands::of(gpu, x, quant),
        tr: Transposed::of(gpu, quant, None),
        v_hat: gpu.ptr(&quant.v_hat),
        v_scale: gpu.ptr(&quant.v_scale),
        v: gpu.ptr(&x.v),
        o: gpu.ptr(&out.o),
        lse2: gpu.ptr(&out.lse2),
        lse: gpu.ptr(&out.lse),
        dims,
        flags: plan.flags,
        c_lambda,
        ln2: std::f32::consts::LN_2,
    };
    // Tensor cores: 4 warps of 16 query rows, shared memory allocated dynamically, the size of the
    // path the flags select (the staged paths double-buffer tiles: more than the 48 KiB of a
    // static allocation);
    // scalar: 256 threads over the 64 × 128 tile, static shared memory.
    let (func, threads, smem) = match plan.forward {
        ForwardKernel::Bf16Ws { name, grid } => {
            launch_ws_bf16(gpu, k, name, grid, &p, s.head_dim)?;
            return Ok(());
        }
        ForwardKernel::Int8Persistent {
            name,
            tma_kq,
            tma_o,
            pdl,
        } => {
            launch_wsp(gpu, k, name, &p, quant, s.head_dim, WspOptions { tma_kq, tma_o, pdl })?;
            return Ok(());
        }
        ForwardKernel::Mma(path) => {
            let smem = forward_mma_smem_bytes(s.head_dim, path);
            drv(
                "set forward shared memory",
                k.forward_mma.set_attribute(
                    cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                ),
            )?;
            (&k.forward_mma, 128, smem)
        }
        ForwardKernel::Scalar => (&k.forward, THREADS, 0),
    };
    let launch = LaunchConfig {
        grid_dim: (dims.n_qblk as u32, (s.batch * s.heads_q) as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem,
    };
    drv("launch forward", unsafe {
        gpu.dev.stream.launch_builder(func).arg(&p).launch(launch)
    })?;
    Ok(())
}

/// Dynamic shared memory of `sage_fwd_sm90_bf16_pairs` (`WsBf16Ring::kSmemBytes`): BF16 Q of two query
/// blocks, rings of `FW_STAGES` (2 at d = 128, 4 at d = 64) K and V tiles of 128 × d BF16, the
/// mbarriers, 1 KiB of alignment slack.
fn ws_bf16_smem_bytes(head_dim: usize) -> u32 {
    let stages = if head_dim == 128 { 2 } else { 4 };
    (128 * head_dim * 2 + 2 * stages * 128 * head_dim * 2 + 16 * stages + 1024) as u32
}

/// Dynamic shared memory of the persistent INT8 kernels (`WspSmem::kSmemBytes`): two slots of Q̂ of
/// two query blocks, rings of `WSP_STAGES` (4 at d = 128, 8 at d = 64) K̂ and V̂ᵀ tiles of 128 × d
/// bytes, at d = 128 the 8 consumer warps' O staging (16 rows × d BF16 each), the full / empty mbarriers
/// of the stages and the two Q-empty ones, 1 KiB of alignment slack.
fn wsp_smem_bytes(head_dim: usize) -> u32 {
    let stages = if head_dim == 128 { 4 } else { 8 };
    // the O staging of the TMA stores, compiled in at d = 128
    let o_staging = if head_dim == 128 { 8 * 16 * head_dim * 2 } else { 0 };
    (2 * 2 * 64 * head_dim + 2 * stages * 128 * head_dim + o_staging + 8 * (2 * stages + 2) + 1024) as u32
}

/// How the plan launches a persistent INT8 kernel ([`crate::plan::ForwardKernel::Int8Persistent`]).
struct WspOptions {
    tma_kq: bool,
    tma_o: bool,
    pdl: bool,
}

/// Launches a persistent INT8 kernel (`sage_forward_ws_p*`): min(tiles, SMs) blocks of 384 threads,
/// the tensor maps of V̂ᵀ, K̂, Q̂ and O as its first parameters (`WspMaps`); K̂ and Q̂ are copied by TMA where
/// the plan says so (`F_TMA_KQ`), O where it does (otherwise their maps are V̂ᵀ's, unused).
fn launch_wsp(
    gpu: &Gpu,
    k: &Kernels,
    kernel: &std::ffi::CStr,
    p: &ForwardParams,
    quant: &QuantizedDev,
    head_dim: usize,
    opt: WspOptions,
) -> Result<()> {
    let vmap = int8_v_map(gpu, p, quant, head_dim)?;
    let mut p = *p;
    let omap = if opt.tma_o { o_map(&p, head_dim)? } else { vmap }; // unused at d = 64
    let mut maps = [vmap, vmap, vmap, omap];
    if opt.tma_kq {
        [maps[1], maps[2]] = int8_kq_maps(&p, head_dim)?;
        p.flags |= crate::F_TMA_KQ;
    }
    // Programmatic dependent launch after sage_quantize_qkv (which triggers at its start): the blocks
    // start on the SMs its last wave frees and wait (pdl_wait in wsp_main) for it to complete.
    let shape = WsShape {
        smem: wsp_smem_bytes(head_dim),
        grid: persistent_grid(gpu, &p),
        threads: WS_THREADS,
        pdl: opt.pdl,
    };
    launch_ws_kernel(gpu, k, kernel, &mut maps, &p, shape)
}

/// O (`[B·H_q][n_q][d]` BF16) for the tensor stores at d = 128 (forward.cu `wsp_store`; unused at d = 64):
/// boxes of 64 columns × 16 rows (half a consumer warp's tile), 128-byte swizzled; rows past n_q are outside the map
/// (not written).
fn o_map(p: &ForwardParams, head_dim: usize) -> Result<crate::tma::TensorMap> {
    use crate::tma::{encode_tiled, TmaElem, TmaSwizzle};
    let d = &p.dims;
    let row_bytes = head_dim as u64 * 2;
    let dims = [head_dim as u64, d.n_q as u64, (d.batch * d.heads_q) as u64];
    encode_tiled(
        TmaElem::U16,
        p.o,
        &dims,
        &[row_bytes, row_bytes * d.n_q as u64],
        &[64, 16, 1],
        TmaSwizzle::B128,
    )
}

/// The K̂ and Q̂ maps of the TMA producer (`wsp_producer_tma`): K̂ (`[B·H_kv·n_k][d]` i8) as the permuted 5-D view whose box is one key block
/// of 128 keys, Q̂ (`[B·H_q·n_q][d]` i8) as rows, boxes of two query blocks (128 rows); the swizzle of the tiles'
/// wgmma descriptors (128-byte rows at d = 128, 64-byte at d = 64).
fn int8_kq_maps(p: &ForwardParams, head_dim: usize) -> Result<[crate::tma::TensorMap; 2]> {
    use crate::tma::{encode_tiled, permuted_rows_map, TmaElem, TmaSwizzle};
    let d = &p.dims;
    let row = head_dim as u64;
    let swizzle = if head_dim == 128 {
        TmaSwizzle::B128
    } else {
        TmaSwizzle::B64
    };
    let key_groups = (d.batch * d.heads_kv) as u64 * d.n_k as u64 / 16;
    let q_rows = (d.batch * d.heads_q) as u64 * d.n_q as u64;
    Ok([
        permuted_rows_map(TmaElem::I8, p.op.k_hat, row, key_groups, head_dim as u32, 8, swizzle)?,
        encode_tiled(
            TmaElem::I8,
            p.op.q_hat,
            &[row, q_rows],
            &[row],
            &[head_dim as u32, 128],
            swizzle,
        )?,
    ])
}

/// The V̂ᵀ tensor map of the INT8 warp-specialized kernels: `[B·H_kv·d rows][n_kpad keys]` i8, boxes
/// of one key block × d rows, 128-byte swizzled (the layout the P̂V wgmma descriptor reads).
fn int8_v_map(gpu: &Gpu, p: &ForwardParams, quant: &QuantizedDev, head_dim: usize) -> Result<crate::tma::TensorMap> {
    let d = &p.dims;
    let v_rows = (d.batch * d.heads_kv) as u64 * head_dim as u64;
    crate::tma::encode_tiled(
        crate::tma::TmaElem::I8,
        gpu.ptr(&quant.v_hat_t),
        &[d.n_kpad as u64, v_rows],
        &[d.n_kpad as u64],
        &[128, head_dim as u32],
        crate::tma::TmaSwizzle::B128,
    )
}

/// Threads of the 2-consumer warp-specialized forwards (INT8 and BF16): a producer and two consumer warpgroups.
const WS_THREADS: u32 = 384;

/// A BF16 `[heads][rows][head_dim]` tensor as TMA boxes of 64 columns × 128 rows, 128-byte
/// swizzled (one panel of the K-major / N-major tiles of `sage_fwd_sm90_bf16_pairs`); rows past `rows`
/// read as zero.
fn bf16_panel_map(addr: u64, heads: i32, rows: i32, head_dim: usize) -> Result<crate::tma::TensorMap> {
    let row_bytes = head_dim as u64 * 2;
    crate::tma::encode_tiled(
        crate::tma::TmaElem::U16,
        addr,
        &[head_dim as u64, rows as u64, heads as u64],
        &[row_bytes, row_bytes * rows as u64],
        &[64, 128, 1],
        crate::tma::TmaSwizzle::B128,
    )
}

/// Dynamic shared memory of the persistent BF16 kernels (`FpSmem::kSmemBytes`): `FP_Q_SLOTS` slots
/// (1 at d = 128, 2 at d = 64) of BF16 Q of two query blocks, rings of `FP_STAGES` (3 at d = 128,
/// 5 at d = 64) K and V tiles of 128 × d BF16, the full / empty mbarriers of the stages and of two Q
/// slots, 1 KiB of alignment slack (d = 128: 230 480 bytes of the 232 448 an H100/H200 block may opt into).
fn ws_bf16_persistent_smem_bytes(head_dim: usize) -> u32 {
    let (stages, q_slots) = if head_dim == 128 { (3, 1) } else { (5, 2) };
    (q_slots * 128 * head_dim * 2 + 2 * stages * 128 * head_dim * 2 + 8 * (2 * stages + 4) + 1024) as u32
}

/// Launches a kernel of the warp-specialized BF16 forward (`sage_fwd_sm90_bf16_pairs*`): 384 threads
/// per block of 128 query rows, the tensor maps of Q, K and V (the original BF16 inputs) before the
/// parameters; one block per query-block pair and (batch·head), or a persistent grid.
fn launch_ws_bf16(
    gpu: &Gpu,
    k: &Kernels,
    kernel: &std::ffi::CStr,
    grid: Bf16WsGrid,
    p: &ForwardParams,
    head_dim: usize,
) -> Result<()> {
    let d = &p.dims;
    let mut maps = [
        bf16_panel_map(p.op.q, d.batch * d.heads_q, d.n_q, head_dim)?,
        bf16_panel_map(p.op.k, d.batch * d.heads_kv, d.n_k, head_dim)?,
        bf16_panel_map(p.v, d.batch * d.heads_kv, d.n_k, head_dim)?,
    ];
    match grid {
        Bf16WsGrid::Pairs => launch_ws_kernel(
            gpu,
            k,
            kernel,
            &mut maps,
            p,
            WsShape {
                smem: ws_bf16_smem_bytes(head_dim),
                grid: pairs_grid(p),
                threads: WS_THREADS,
                pdl: false,
            },
        ),
        Bf16WsGrid::Persistent => launch_ws_kernel(
            gpu,
            k,
            kernel,
            &mut maps,
            p,
            WsShape {
                smem: ws_bf16_persistent_smem_bytes(head_dim),
                grid: persistent_grid(gpu, p),
                threads: WS_THREADS,
                pdl: false,
            },
        ),
    }
}

/// How a warp-specialized forward kernel is launched: bytes of dynamic shared memory, grid, threads per block.
#[derive(Clone, Copy)]
struct WsShape {
    smem: u32,
    grid: (u32, u32),
    threads: u32,
    /// launched with programmatic dependent launch (`crate::quantize::launch_pdl`; the kernel waits first)
    pdl: bool,
}

/// Launches a warp-specialized kernel of the forward module by name as `shape` says, with the
/// tensor maps then `p` as parameters.
fn launch_ws_kernel(
    gpu: &Gpu,
    k: &Kernels,
    name: &std::ffi::CStr,
    maps: &mut [crate::tma::TensorMap],
    p: &ForwardParams,
    shape: WsShape,
) -> Result<()> {
    let WsShape {
        smem,
        grid,
        threads,
        pdl,
    } = shape;
    use cudarc::driver::sys;
    drv("bind context", gpu.dev.ctx.bind_to_thread())?;
    let func = k.forward_function(name)?;
    let attr = sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
    drv("set forward shared memory", unsafe {
        sys::cuFuncSetAttribute(func, attr, smem as i32).result()
    })?;
    let mut params = *p;
    let mut args: Vec<*mut std::ffi::c_void> = maps
        .iter_mut()
        .map(|m| (m as *mut crate::tma::TensorMap).cast())
        .collect();
    args.push((&mut params as *mut ForwardParams).cast());
    let stream = gpu.dev.stream.cu_stream();
    if pdl {
        return crate::quantize::launch_pdl(gpu, func, (grid.0, grid.1, 1), threads, smem, stream, &mut args);
    }
    drv("launch forward (warp-specialized)", unsafe {
        sys::cuLaunchKernel(
            func,
            grid.0,
            grid.1,
            1,
            threads,
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

/// The grid of the non-persistent warp-specialized kernels: (query-block pairs, B·H_q).
fn pairs_grid(p: &ForwardParams) -> (u32, u32) {
    (
        (p.dims.n_qblk as u32).div_ceil(2),
        (p.dims.batch * p.dims.heads_q) as u32,
    )
}

/// The persistent forward kernels' grid: one block per SM (`Gpu::persistent_sms`), fewer when
/// there are fewer tiles (query-block pairs × heads); the blocks walk the tiles.
fn persistent_grid(gpu: &Gpu, p: &ForwardParams) -> (u32, u32) {
    let (pairs, heads) = pairs_grid(p);
    ((pairs * heads).min(gpu.persistent_sms()).max(1), 1)
}
