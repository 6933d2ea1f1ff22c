//! Host side of `kernels/backward_{pre,main,post}.cu` (ALGORITHM.md §5, §7).

use crate::forward::{scales, DeviceForward, SavedForBackward, ScoreOperands, Transposed};
use crate::plan::BackwardMain;
use crate::quantize::{quantize_do_delta, QuantNeeds, QuantizedDo};
use crate::runtime::{drv, Dims, Kernels, BLOCK_Q, THREADS};
use crate::{DeviceInputs, Gpu};
use cudarc::driver::{sys, CudaSlice, LaunchConfig, PushKernelArg};
use sagebwd::{Error, Result};

/// Mirror of `BackwardParams` in backward_main.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct BackwardParams {
    op: ScoreOperands,
    tr: Transposed,
    v_hat: u64,
    v_scale: u64,
    v: u64,
    do_hat: u64,
    do_scale: u64,
    d_o: u64,
    lse2: u64,
    delta: u64,
    dq_acc: u64,
    ds_rowsum: u64,
    dk_acc: u64,
    dv_acc: u64,
    dk_out: u64,
    dv_out: u64,
    dims: Dims,
    flags: i32,
    c_lambda: f32,
    c: f32,
}
unsafe impl cudarc::driver::DeviceRepr for BackwardParams {}
// Layout contract with backward_main.cu, which static_asserts the same size.
const _: () = assert!(std::mem::size_of::<BackwardParams>() == 304);

pub use crate::plan::{
    backward_smem_bytes, bf16_bulk_staging_bytes, choose_groups, free_groups, peak_budget_bytes, sage_peak_bytes,
    sage_staging_bytes, staged_backward, staged_backward_smem_bytes, GroupPlan, GroupPolicy, StagedBackward,
    FREE_GROUP_BLOCKS, MAX_GROUPS,
};

/// The main kernel's launch: with PDL after its preprocess (the delta / dO kernels, the transposes or a fill,
/// each triggering at its start; `pdl_wait` first in every tensor-core main kernel) when `pdl`, else plain.
#[allow(clippy::too_many_arguments)]
fn launch_main(
    gpu: &Gpu,
    func: sys::CUfunction,
    grid: (u32, u32, u32),
    threads: u32,
    smem: u32,
    stream: sys::CUstream,
    args: &mut [*mut std::ffi::c_void],
    pdl: bool,
) -> Result<()> {
    if pdl {
        crate::quantize::launch_pdl(gpu, func, grid, threads, smem, stream, args)
    } else {
        gpu.launch_raw(func, grid, threads, smem, stream, args)
    }
}

/// The kernel parameter of `sage_bwd_main_sm90_bf16_persistent_tma_dq` and `sage_bwd_main_sm90_int8_tma_dq` (`BwdParamsDqMap`):
/// the dQ accumulator's tensor map, then the parameters.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct BackwardParamsDqMap {
    map: crate::tma::TensorMap,
    p: BackwardParams,
}
const _: () = assert!(std::mem::size_of::<BackwardParamsDqMap>() == 448);

/// The FP32 dQ accumulator `[rows][n_q][d]` as a 4-D map for the warps' TMA reduce-adds: 32 columns, d/32
/// column blocks, n_q rows, `rows` heads; boxes of 32 × `col_blocks` × `box_rows` × 1, 128-byte swizzled: a query
/// block's 64 rows × 64 columns, a warpgroup's four warp boxes, for the d = 128 fpa kernel (2, 64); a query block's
/// 64 rows × 32 columns, four warps' boxes, for the d = 64 sage kernel (1, 64). Rows past n_q are outside the map (not
/// written).
fn dq_acc_map(
    addr: u64,
    rows: usize,
    n_q: usize,
    head_dim: usize,
    col_blocks: u32,
    box_rows: u32,
) -> Result<crate::tma::TensorMap> {
    let row_bytes = (head_dim * 4) as u64;
    crate::tma::encode_tiled(
        crate::tma::TmaElem::F32,
        addr,
        &[32, (head_dim / 32) as u64, n_q as u64, rows as u64],
        &[128, row_bytes, row_bytes * n_q as u64],
        &[32, col_blocks, box_rows, 1],
        crate::tma::TmaSwizzle::B128,
    )
}

/// The kernel parameter of `sage_bwd_main_sm90_int8_tma_stage` (`BwdParamsStageMaps`): the maps of
/// [`sage128_stage_maps`], then the parameters.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct BackwardParamsStageMaps {
    maps: [crate::tma::TensorMap; 4],
    p: BackwardParams,
}
const _: () = assert!(std::mem::size_of::<BackwardParamsStageMaps>() == 832);

/// The four query-block operands of the d = 128 sage tile as `StagedSage128T` copies them (backward_main.cu has the
/// derivation): Q̂ and dO (`rows`·n_q rows of d = 128) as 5-D views {d, e: 2, b: 4, c: 2, a} of row 16a + 4b + 2c + e,
/// so that a box lands in the tile's permuted row order (128-byte swizzle; dO in two boxes of 64 columns); dÔᵀ and
/// Q̂ᵀ ([rows][d][n_qpad] bytes) as 3-D, box {64, d, 1}, 64-byte swizzle.
fn sage128_stage_maps(
    p: &BackwardParams,
    rows: usize,
    n_q: usize,
    n_qpad: usize,
) -> Result<[crate::tma::TensorMap; 4]> {
    use crate::tma::{encode_tiled, permuted_rows_map, TmaElem, TmaSwizzle};
    const D: u64 = 128;
    let groups = (rows * n_q / 16) as u64;
    let permuted = |elem, addr, box0| permuted_rows_map(elem, addr, D, groups, box0, 4, TmaSwizzle::B128);
    let transposed = |addr| {
        let pad = n_qpad as u64;
        encode_tiled(
            TmaElem::I8,
            addr,
            &[pad, D, rows as u64],
            &[pad, D * pad],
            &[BLOCK_Q as u32, D as u32, 1],
            TmaSwizzle::B64,
        )
    };
    Ok([
        permuted(TmaElem::I8, p.op.q_hat, 128)?,
        permuted(TmaElem::U16, p.d_o, 64)?,
        transposed(p.tr.do_hat_t)?,
        transposed(p.tr.q_hat_t)?,
    ])
}

/// `Kernels::backward_main_function(name)` with its dynamic shared memory limit raised to `smem`.
fn bwd_main_function(k: &Kernels, name: &std::ffi::CStr, smem: usize) -> Result<sys::CUfunction> {
    let f = k.backward_main_function(name)?;
    drv("set smem attribute", unsafe {
        sys::cuFuncSetAttribute(
            f,
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .result()
    })?;
    Ok(f)
}

/// The gradients on the device, BF16 bits, plus the preprocess's D and dÔ.
pub struct DeviceGradients {
    pub dq: CudaSlice<u16>,
    pub dk: CudaSlice<u16>,
    pub dv: CudaSlice<u16>,
    pub delta: CudaSlice<f32>,
    pub do_quant: QuantizedDo,
}

pub(crate) fn grid_stride(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, 1 << 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// What the preprocess leaves for the head groups.
struct Preprocessed {
    /// dO quantized whole (one group), or only s_dO (several: each group quantizes its dÔᵀ rows).
    do_quant: QuantizedDo,
    /// D = rowsum(dO ∘ O), `[B, H_q, N_q]`.
    delta: CudaSlice<f32>,
}

/// Preprocess: D = rowsum(dO ∘ O) over all rows, and the dO quantization: whole for one group (the
/// layouts `needs` asks for), else only the s_dO buffer the groups fill. `one_group`: the FP32 dQ
/// accumulator of all rows when there is one group, zeroed by the same kernel; None for several
/// groups (each zeroes its own).
#[allow(clippy::too_many_arguments)]
fn preprocess(
    gpu: &Gpu,
    k: &Kernels,
    x: &DeviceInputs,
    o: &CudaSlice<u16>,
    d_o: &CudaSlice<u16>,
    needs: QuantNeeds,
    one_group: Option<u64>,
    allow_fused: bool,
) -> Result<Preprocessed> {
    let s = &x.shape;
    let rows = s.batch * s.heads_q * s.n_q;
    let dq_zero = one_group.unwrap_or(0); // the kernel skips the zeroing on a null address
    let delta = gpu.alloc_poisoned_f32(rows)?;
    // One group: D and the dQ zeroing in the dO quantization's pass where it can (quantize_do_delta).
    let (do_quant, fused) = if one_group.is_none() {
        let do_scale = gpu.alloc_poisoned_f32(s.batch * s.heads_q * s.n_q.div_ceil(BLOCK_Q))?;
        (
            QuantizedDo {
                do_hat: None,
                do_scale: Some(do_scale),
                do_hat_t: None,
                do_t: None,
            },
            false,
        )
    } else {
        quantize_do_delta(gpu, k, x, d_o, o, needs, &delta, dq_zero, allow_fused)?
    };
    if fused {
        return Ok(Preprocessed { do_quant, delta });
    }
    let rows_per_block = THREADS as usize / (s.head_dim / 8); // sage_bwd_delta: d/8 lanes per row
    let launch = LaunchConfig {
        grid_dim: (rows.div_ceil(rows_per_block) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let rows_i = rows as i64;
    drv("launch sage_bwd_delta", unsafe {
        gpu.dev
            .stream
            .launch_builder(&k.bwd_delta)
            .arg(o)
            .arg(d_o)
            .arg(&delta)
            .arg(&rows_i)
            .arg(&dq_zero)
            .launch(launch)
    })?;
    Ok(Preprocessed { do_quant, delta })
}

/// Buffers one head group uses and the next reuses (sized for the largest group; stream order
/// keeps a group from overwriting them before the previous one is done).
struct GroupBuffers {
    /// Q̂ᵀ, K̂ᵀ of the group's rows, when the path reads them and the forward did not write them.
    qk_hat_t: Option<(CudaSlice<i8>, CudaSlice<i8>)>,
    /// dÔᵀ of the group's rows (several groups; one group reads the preprocess's).
    do_hat_t: Option<CudaSlice<i8>>,
    /// FP32 dQ accumulator of the group's rows, zeroed per group.
    dq_acc: CudaSlice<f32>,
    /// Per-row Σ_j dS, zeroed per group; one element unless the dQ correction reads it.
    ds_rowsum: CudaSlice<f32>,
}

impl GroupBuffers {
    fn new(gpu: &Gpu, s: &sagebwd::Shape, plan: &GroupPlan, qk_hat_t: bool, dq_corr: bool) -> Result<GroupBuffers> {
        let (rows, d) = (plan.rows, s.head_dim);
        let kv_rows = if plan.count == 1 { s.batch * s.heads_kv } else { rows };
        let (pq, pk) = (crate::runtime::padded_q(s.n_q), crate::runtime::padded_k(s.n_k));
        let qk_hat_t = if qk_hat_t {
            Some((
                gpu.alloc_poisoned_i8(rows * d * pq)?,
                gpu.alloc_poisoned_i8(kv_rows * d * pk)?,
            ))
        } else {
            None
        };
        let do_hat_t = if plan.count > 1 {
            Some(gpu.alloc_poisoned_i8(rows * d * pq)?)
        } else {
            None
        };
        // + the persistent grid's work counter (and padding to 16 bytes) after the rows.
        let dq_acc = gpu.alloc_f32(rows * s.n_q * d + 4)?;
        let ds_rowsum = gpu.alloc_f32(if dq_corr { rows * s.n_q } else { 1 })?;
        Ok(GroupBuffers {
            qk_hat_t,
            do_hat_t,
            dq_acc,
            ds_rowsum,
        })
    }
}

/// A device address `elems` elements of `size` bytes further, or null for an absent buffer.
fn at(addr: u64, elems: usize, size: usize) -> u64 {
    if addr == 0 {
        0
    } else {
        addr + (elems * size) as u64
    }
}

/// Where the backward writes dQ, dK, dV (BF16): buffers it allocates, or the caller's ([`crate::external`]).
pub(crate) enum GradientsInto {
    Allocate,
    /// Device addresses of `q_len`, `kv_len`, `kv_len` BF16; never freed by the backward, on success (the caller
    /// leaks the returned slices) or on error.
    Caller {
        dq: sys::CUdeviceptr,
        dk: sys::CUdeviceptr,
        dv: sys::CUdeviceptr,
    },
}

/// The three output buffers of a backward.
struct GradientOutputs {
    dq: CudaSlice<u16>,
    dk: CudaSlice<u16>,
    dv: CudaSlice<u16>,
}

/// Preprocess, main kernel and postprocess as the forward's plan says; dQ, dK, dV go where `into` says.
pub(crate) fn backward(
    gpu: &Gpu,
    k: &Kernels,
    x: &DeviceInputs,
    fwd: &DeviceForward,
    saved: &SavedForBackward,
    d_o: &CudaSlice<u16>,
    into: GradientsInto,
) -> Result<DeviceGradients> {
    let s = &x.shape;
    let out = match into {
        GradientsInto::Allocate => GradientOutputs {
            dk: gpu.alloc_poisoned_u16(s.kv_len())?,
            dv: gpu.alloc_poisoned_u16(s.kv_len())?,
            dq: gpu.alloc_poisoned_u16(s.q_len())?,
        },
        // SAFETY: the caller's buffers (external::backward's contract); leaked below on error.
        GradientsInto::Caller { dq, dk, dv } => unsafe {
            GradientOutputs {
                dq: gpu.dev.stream.upgrade_device_ptr::<u16>(dq, s.q_len()),
                dk: gpu.dev.stream.upgrade_device_ptr::<u16>(dk, s.kv_len()),
                dv: gpu.dev.stream.upgrade_device_ptr::<u16>(dv, s.kv_len()),
            }
        },
    };
    match backward_into(gpu, k, x, fwd, saved, d_o, &out) {
        Ok((delta, do_quant)) => Ok(DeviceGradients {
            dq: out.dq,
            dk: out.dk,
            dv: out.dv,
            delta,
            do_quant,
        }),
        Err(e) => {
            if matches!(into, GradientsInto::Caller { .. }) {
                out.dq.leak();
                out.dk.leak();
                out.dv.leak();
            }
            Err(e)
        }
    }
}

/// [`backward`]'s work, writing `out`; returns D and the dO quantization.
fn backward_into(
    gpu: &Gpu,
    k: &Kernels,
    x: &DeviceInputs,
    fwd: &DeviceForward,
    saved: &SavedForBackward,
    d_o: &CudaSlice<u16>,
    out: &GradientOutputs,
) -> Result<(CudaSlice<f32>, QuantizedDo)> {
    let (dq, dk, dv) = (&out.dq, &out.dk, &out.dv);
    let s = &x.shape;
    let dims = Dims::of(s, x.causal);
    let (c, c_lambda) = scales(s.head_dim);
    let cfg = &saved.cfg;
    let fl = saved.plan.flags;
    let bp = saved.plan.backward;
    let staged = bp.staged;
    // Without GQA a staged block holds the whole dK, dV of its keys and writes them in BF16 itself;
    // otherwise per-query-head FP32 partials are summed over each group by the postprocess.
    let direct = bp.direct_dkdv;
    let (persist, bulk_dq, sage_tma_dq, sage_tma_stage) =
        (bp.persistent, bp.bf16_tma_dq, bp.sage_tma_dq, bp.sage_tma_stage);
    let smem = bp.main_smem;
    let optin = gpu.dev.smem_optin;
    if smem > optin {
        return Err(Error::Backend(format!(
            "backward kernel needs {smem} B of shared memory per block, the GPU allows {optin}"
        )));
    }
    let main_threads = THREADS;
    let main_fn = match bp.main {
        BackwardMain::Named(name) => bwd_main_function(k, name, smem)?,
        BackwardMain::Mma | BackwardMain::Scalar => {
            let func = if bp.main == BackwardMain::Mma {
                &k.bwd_main_mma
            } else {
                &k.bwd_main
            };
            drv(
                "set smem attribute",
                func.set_attribute(
                    sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                ),
            )?;
            func.cu_function()
        }
    };

    // The tensor-core main kernels wait for their predecessor first (pdl_wait in
    // backward_main.cu), so they may be launched with PDL.
    let main_pdl = bp.main_pdl;
    let bh = s.batch * s.heads_q;
    let plan = bp.groups;
    let qd = &saved.quant;
    // Q̂ᵀ, K̂ᵀ for every path that reads quantized operands but the staged BF16 one: the forward's
    // (the plan's `qk_hat_t_in_forward`: the whole tensors, addressed per group below), else
    // made here per group.
    let fwd_qk_t = match (&qd.q_hat_t, &qd.k_hat_t) {
        (Some(q_t), Some(k_t)) => Some((gpu.ptr(q_t), gpu.ptr(k_t))),
        _ => None,
    };
    let qk_hat_t = qd.needs.quantized && staged != Some(StagedBackward::Bf16) && fwd_qk_t.is_none();
    // Σ dS is read only with the dQ correction (by the kernels' flag checks): else one unused element.
    let dq_corr = fl & crate::F_DQ_CORR != 0;
    let sets = (0..plan.buffer_sets())
        .map(|_| GroupBuffers::new(gpu, s, &plan, qk_hat_t, dq_corr))
        .collect::<Result<Vec<_>>>()?;
    // The persistent grid: as many CTAs as fit at once (at most one per work item), and its work
    // counter, the word after the dQ accumulator's rows (zeroed with the accumulator per group when
    // there are several; here for one group, whose accumulator the preprocess zeroes by rows).
    let persist_ctas = if persist {
        let mut per_sm: std::ffi::c_int = 0;
        drv("occupancy", unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut per_sm, main_fn, main_threads as i32, smem).result()
        })?;
        if plan.count == 1 {
            gpu.fill_on(
                k,
                gpu.ptr(&sets[0].dq_acc) + (bh * s.n_q * s.head_dim * 4) as u64,
                16,
                0,
                gpu.main_stream(),
            )?;
        }
        per_sm.max(1) as usize * gpu.persistent_sms() as usize
    } else {
        0
    };
    // One group: its dQ accumulator covers every row and the preprocess zeroes it.
    let dq_zero = (plan.count == 1).then(|| gpu.ptr(&sets[0].dq_acc));
    let Preprocessed { do_quant, delta } = preprocess(gpu, k, x, &fwd.o, d_o, qd.needs, dq_zero, bp.fused_preprocess)?;
    let partials = || {
        if direct {
            Ok(None)
        } else {
            gpu.alloc_poisoned_f32(bh * s.n_k * s.head_dim).map(Some)
        }
    };
    let (dk_acc, dv_acc) = (partials()?, partials()?);
    // Groups alternate between two streams, each with its own buffers: one group's main kernel
    // fills the other's tail and hides its small kernels (transposes, dO quantization, zeroing,
    // dQ postprocess). Both streams start after everything queued so far (the allocations and their
    // poison fills, D); the kernels' stream waits for both before the buffers are freed.
    let streams = if plan.count > 1 {
        vec![gpu.main_stream(), gpu.side_stream()?]
    } else {
        vec![gpu.main_stream()]
    };
    for &side in &streams[1..] {
        gpu.order(streams[0], side)?;
    }

    let full = Transposed::of(gpu, qd, Some(&do_quant));
    let op0 = ScoreOperands::of(gpu, x, qd);
    let kv_rows_one = s.batch * s.heads_kv;
    for (g, first) in (0..bh).step_by(plan.rows).enumerate() {
        let (stream, bufs) = (streams[g % streams.len()], &sets[g % sets.len()]);
        let rows = plan.rows.min(bh - first);
        // One group: the problem's dims. Several (no GQA): the group's rows as a batch of
        // single-head problems, every per-(batch, head) buffer addressed from the group's first row.
        let (gd, r0) = if plan.count == 1 {
            (dims, 0)
        } else {
            (
                Dims {
                    batch: rows as i32,
                    heads_q: 1,
                    heads_kv: 1,
                    ..dims
                },
                first,
            )
        };
        let (n_q, n_k, d) = (s.n_q, s.n_k, s.head_dim);
        let (q_rows, k_rows) = (r0 * n_q * d, r0 * n_k * d);
        let (qblk, kblk) = (r0 * dims.n_qblk as usize, r0 * dims.n_kblk as usize);
        let op = ScoreOperands {
            q_hat: at(op0.q_hat, q_rows, 1),
            q_scale: at(op0.q_scale, qblk, 4),
            q: at(op0.q, q_rows, 2),
            k_hat: at(op0.k_hat, k_rows, 1),
            k_scale: at(op0.k_scale, kblk, 4),
            k: at(op0.k, k_rows, 2),
            k_mean: at(op0.k_mean, r0 * d, 4),
            q_mean: if cfg.smooth_q {
                at(op0.q_mean, qblk * d, 4)
            } else {
                op0.q_mean
            },
            row_offset: at(op0.row_offset, r0 * n_q, 4),
        };
        let mut tr = full;
        if let Some((q_hat_t, k_hat_t)) = fwd_qk_t {
            // [B·H, d, N_pad] whole (GQA: K̂ᵀ over B·H_kv; one group then): the group's rows
            let (pq, pk) = (crate::runtime::padded_q(n_q), crate::runtime::padded_k(n_k));
            (tr.q_hat_t, tr.k_hat_t) = (at(q_hat_t, r0 * d * pq, 1), at(k_hat_t, r0 * d * pk, 1));
        } else if let Some((q_hat_t, k_hat_t)) = &bufs.qk_hat_t {
            let kv_rows = if plan.count == 1 { kv_rows_one } else { rows };
            // one group: the 16 × 16 kernel, PDL right after the preprocess (safe by construction: quantize.cu)
            let one_group = plan.count == 1;
            crate::quantize::transpose_qk_hat(
                gpu,
                k,
                (op.q_hat, op.k_hat),
                (q_hat_t, k_hat_t),
                (rows, kv_rows),
                (n_q, n_k),
                stream,
                one_group,
            )?;
            (tr.q_hat_t, tr.k_hat_t) = (gpu.ptr(q_hat_t), gpu.ptr(k_hat_t));
        }
        let do_scale = at(gpu.ptr(&do_quant.do_scale), qblk, 4);
        if let Some(do_hat_t) = &bufs.do_hat_t {
            // the staged sagebwd path reads dÔᵀ alone of the dO quantization
            crate::quantize::quantize_do_rows(
                gpu,
                k,
                (at(gpu.ptr(d_o), q_rows, 2), do_scale),
                do_hat_t,
                rows,
                n_q,
                stream,
            )?;
            tr.do_hat_t = gpu.ptr(do_hat_t);
        }
        let (dq_acc, ds_rowsum) = (gpu.ptr(&bufs.dq_acc), gpu.ptr(&bufs.ds_rowsum));
        if dq_zero.is_none() {
            gpu.fill_on(k, dq_acc, bufs.dq_acc.len() * 4, 0, stream)?;
        }
        if dq_corr {
            gpu.fill_on(k, ds_rowsum, bufs.ds_rowsum.len() * 4, 0, stream)?;
        }
        let mut p = BackwardParams {
            op,
            tr,
            v_hat: at(gpu.ptr(&qd.v_hat), k_rows, 1),
            v_scale: at(gpu.ptr(&qd.v_scale), kblk, 4),
            v: at(gpu.ptr(&x.v), k_rows, 2),
            do_hat: at(gpu.ptr(&do_quant.do_hat), q_rows, 1),
            do_scale,
            d_o: at(gpu.ptr(d_o), q_rows, 2),
            lse2: at(gpu.ptr(&fwd.lse2), r0 * n_q, 4),
            delta: at(gpu.ptr(&delta), r0 * n_q, 4),
            dq_acc,
            ds_rowsum,
            dk_acc: gpu.ptr(&dk_acc),
            dv_acc: gpu.ptr(&dv_acc),
            dk_out: if direct { at(gpu.ptr(dk), k_rows, 2) } else { 0 },
            dv_out: if direct { at(gpu.ptr(dv), k_rows, 2) } else { 0 },
            dims: gd,
            flags: fl,
            c_lambda,
            c,
        };
        let items = dims.n_kblk as usize * rows;
        let grid = if persist {
            (items.min(persist_ctas).max(1) as u32, 1, 1)
        } else {
            (dims.n_kblk as u32, rows as u32, 1)
        };
        // The kernel's one parameter: BackwardParams, alone or after the tensor map(s) its path reads.
        let (mut stage_maps, mut dq_map);
        let arg: *mut std::ffi::c_void = if sage_tma_stage {
            let maps = sage128_stage_maps(&p, rows, n_q, crate::runtime::padded_q(n_q))?;
            stage_maps = BackwardParamsStageMaps { maps, p };
            (&mut stage_maps as *mut BackwardParamsStageMaps).cast()
        } else if bulk_dq || sage_tma_dq {
            // fpa: one group, the accumulator of every row, 64-row boxes of a column half; sage:
            // the group's accumulator, as p.dq_acc, 64-row boxes of a 32-column block.
            let halves = if bulk_dq { 2 } else { 1 };
            dq_map = BackwardParamsDqMap {
                map: dq_acc_map(dq_acc, rows, n_q, d, halves, 64)?,
                p,
            };
            (&mut dq_map as *mut BackwardParamsDqMap).cast()
        } else {
            (&mut p as *mut BackwardParams).cast()
        };
        launch_main(
            gpu,
            main_fn,
            grid,
            main_threads,
            smem as u32,
            stream,
            &mut [arg],
            main_pdl,
        )?;
        let (mut acc, mut rowsum, mut k_mean) = (dq_acc, ds_rowsum, op.k_mean);
        let (mut dq_rows, mut gd, mut c, mut fl) = (at(gpu.ptr(dq), q_rows, 2), gd, c, fl);
        let mut args: [*mut std::ffi::c_void; 7] = [
            (&mut acc as *mut u64).cast(),
            (&mut rowsum as *mut u64).cast(),
            (&mut k_mean as *mut u64).cast(),
            (&mut dq_rows as *mut u64).cast(),
            (&mut gd as *mut Dims).cast(),
            (&mut c as *mut f32).cast(),
            (&mut fl as *mut i32).cast(),
        ];
        let post = grid_stride(rows * n_q * d / 8); // eight elements per thread
        if bp.post_dq_sage {
            // sage_bwd_post_dq_int8 (4 × 8 elements per thread), PDL after the main kernel
            crate::quantize::post_dq_sage(gpu, k, rows * n_q * d / 8, stream, &mut args)?;
        } else {
            gpu.launch_raw(k.post_dq.cu_function(), post.grid_dim, THREADS, 0, stream, &mut args)?;
        }
    }
    for &side in &streams[1..] {
        gpu.order(side, streams[0])?;
    }
    drop(sets); // stream-ordered: returned to the pool once the last group has run
    if let (Some(dk_acc), Some(dv_acc)) = (&dk_acc, &dv_acc) {
        drv("launch sage_bwd_post_dkdv", unsafe {
            gpu.dev
                .stream
                .launch_builder(&k.post_dkdv)
                .arg(dk_acc)
                .arg(dv_acc)
                .arg(dk)
                .arg(dv)
                .arg(&dims)
                .arg(&c)
                .launch(grid_stride(s.kv_len()))
        })?;
    }
    Ok((delta, do_quant))
}

/// Device bytes the backward allocates beyond the forward's (for the up-front memory check): an
/// upper bound over the paths, i.e. one head group holding every row and the gathering path's
/// buffers (natural dÔ, dOᵀ, FP32 dK/dV partials, Σ dS), plus Q̂ᵀ and K̂ᵀ made here.
pub fn backward_bytes(s: &sagebwd::Shape) -> usize {
    let rows = s.batch * s.heads_q * s.n_q;
    let per_q_head_kv = s.batch * s.heads_q * s.n_k * s.head_dim;
    let (pq, pk) = (crate::runtime::padded_q(s.n_q), crate::runtime::padded_k(s.n_k));
    let do_t = 3 * s.batch * s.heads_q * s.head_dim * pq;
    let qk_hat_t = s.head_dim * (s.batch * s.heads_q * pq + s.batch * s.heads_kv * pk);
    s.q_len() * (1 + 4 + 2) + rows * 4 * 2 + s.q_len().div_ceil(BLOCK_Q) * 4 + per_q_head_kv * 8 + s.kv_len() * 4
        + s.q_len() * 2 /* dO upload */ + do_t + qk_hat_t
}

#[cfg(test)]
mod tests {
    use super::*;
    use sagebwd::{Config, Product};

    #[test]
    fn staged_paths_of_the_presets_and_isolations() {
        let path = |c: &Config| staged_backward(crate::flags(c));
        assert_eq!(path(&Config::fpa()), Some(StagedBackward::Bf16));
        assert_eq!(path(&Config::sagebwd()), Some(StagedBackward::Sage));
        assert_eq!(path(&Config::int8_all()), None);
        // The forward products' isolations have fpa's backward (smoothing on does not matter).
        assert_eq!(path(&Config::isolate(Product::QkFwd)), Some(StagedBackward::Bf16));
        assert_eq!(path(&Config::isolate(Product::Pv)), Some(StagedBackward::Bf16));
        for p in [Product::QkBwd, Product::Dv, Product::Dp, Product::Dq, Product::Dk] {
            assert_eq!(path(&Config::isolate(p)), None, "{p:?}");
        }
        let mut sage_q = Config::sagebwd();
        sage_q.smooth_q = true;
        assert_eq!(path(&sage_q), None);
    }

    fn mha(batch: usize, heads: usize, n: usize, head_dim: usize) -> sagebwd::Shape {
        sagebwd::Shape {
            batch,
            heads_q: heads,
            heads_kv: heads,
            n_q: n,
            n_k: n,
            head_dim,
        }
    }
    const MIB: usize = 1 << 20;

    #[test]
    fn splits_cover_every_row_once() {
        assert_eq!(GroupPlan::split(10, 4), GroupPlan { count: 4, rows: 3 });
        assert_eq!(GroupPlan::split(48, 5), GroupPlan { count: 5, rows: 10 });
        // 6 rows in 4 groups of 2 leave the 4th empty: 3 groups
        assert_eq!(GroupPlan::split(6, 4), GroupPlan { count: 3, rows: 2 });
        assert_eq!(GroupPlan::split(5, 16), GroupPlan { count: 5, rows: 1 });
        assert_eq!(GroupPlan::split(7, 0), GroupPlan::one(7));
        for bh in 1..60 {
            for n in 1..=MAX_GROUPS {
                let p = GroupPlan::split(bh, n);
                assert!(
                    p.count <= n && (p.count - 1) * p.rows < bh && p.count * p.rows >= bh,
                    "{bh} {n} {p:?}"
                );
            }
        }
    }

    #[test]
    fn budget_is_cudnns_measured_peak_at_the_bench_shapes() {
        // cuDNN SDPA measured 644 MiB (d = 64) and 642 MiB (d = 128) at B·N = 16384, H·d = 2048.
        assert_eq!(peak_budget_bytes(&mha(16, 32, 1024, 64)), 644 * MIB);
        assert_eq!(peak_budget_bytes(&mha(4, 16, 4096, 128)), 642 * MIB);
        // Unsplit, the model is within 2 MiB of main's measured 810 / 805 MiB (which also held the
        // forward's Q̂ᵀ, K̂ᵀ and allocated dQ after the main kernel: the same total).
        let one = |s: &sagebwd::Shape| sage_peak_bytes(s, GroupPlan::one(s.batch * s.heads_q)) as f64 / MIB as f64;
        assert!(
            (one(&mha(16, 32, 1024, 64)) - 810.0).abs() < 2.0,
            "{}",
            one(&mha(16, 32, 1024, 64))
        );
        assert!(
            (one(&mha(16, 16, 1024, 128)) - 805.0).abs() < 2.0,
            "{}",
            one(&mha(16, 16, 1024, 128))
        );
    }

    #[test]
    fn more_groups_never_need_more_memory_with_two_buffer_sets() {
        for s in [mha(16, 32, 1024, 64), mha(1, 3, 300, 128), mha(4, 12, 4096, 64)] {
            let bh = s.batch * s.heads_q;
            // from two groups on (one buffer set per stream: from one group to two, two sets of
            // half the rows, rounded up)
            let peaks: Vec<usize> = (2..=MAX_GROUPS)
                .map(|n| sage_peak_bytes(&s, GroupPlan::split(bh, n)))
                .collect();
            assert!(peaks.windows(2).all(|w| w[1] <= w[0]), "{s:?}: {peaks:?}");
        }
    }

    #[test]
    fn bench_and_training_shapes_fit_the_budget() {
        let shapes = [
            mha(16, 32, 1024, 64),
            mha(4, 32, 4096, 64),
            mha(16, 16, 1024, 128),
            mha(4, 16, 4096, 128),
            mha(16, 12, 1024, 64),
            mha(4, 12, 4096, 64),
        ];
        for s in shapes {
            let plan = choose_groups(&s);
            assert!(sage_peak_bytes(&s, plan) <= peak_budget_bytes(&s), "{s:?} {plan:?}");
            // the fewest: one group fewer would not fit
            let fewer = GroupPlan::split(s.batch * s.heads_q, plan.count - 1);
            assert!(sage_peak_bytes(&s, fewer) > peak_budget_bytes(&s), "{s:?} {plan:?}");
            assert_eq!(plan.buffer_sets(), 2);
        }
        // Two buffer sets of 1/8 each: the memory of one set of 1/4 (640.2 MiB at d = 64).
        assert_eq!(choose_groups(&mha(16, 32, 1024, 64)).count, 8);
        assert_eq!(choose_groups(&mha(4, 16, 4096, 128)).count, 8);
        let peak = sage_peak_bytes(&mha(16, 32, 1024, 64), choose_groups(&mha(16, 32, 1024, 64)));
        assert!((peak as f64 / MIB as f64 - 640.2).abs() < 0.1, "{peak}");
    }

    #[test]
    fn tiny_problems_take_the_most_groups_the_rule_allows() {
        // One head: nothing to split.
        assert_eq!(choose_groups(&mha(1, 1, 64, 64)), GroupPlan::one(1));
        assert!(choose_groups(&mha(1, 2, 64, 64)).count <= 2);
        assert_eq!(
            GroupPlan::of(&mha(1, 40, 64, 64), false, GroupPolicy::Count(1)),
            GroupPlan::one(40)
        );
        assert_eq!(
            GroupPlan::of(&mha(1, 40, 64, 64), false, GroupPolicy::Count(3)),
            GroupPlan { count: 3, rows: 14 }
        );
    }

    #[test]
    fn auto_groups_only_where_measured_free() {
        // The sweep shapes: lean (within cuDNN's peak) at non-causal N ≥ 8k, one group elsewhere.
        for (n, b) in [(8192, 2), (16384, 1)] {
            let s = mha(b, 16, n, 128);
            assert_eq!(GroupPlan::of(&s, false, GroupPolicy::Auto), choose_groups(&s));
            assert!(sage_peak_bytes(&s, GroupPlan::of(&s, false, GroupPolicy::Auto)) <= peak_budget_bytes(&s));
            assert_eq!(GroupPlan::of(&s, true, GroupPolicy::Auto), GroupPlan::one(b * 16));
        }
        let s = mha(4, 32, 4096, 64);
        assert_eq!(GroupPlan::of(&s, false, GroupPolicy::Auto), GroupPlan::one(128));
        // Two heads at 16k: groups of one head would give 128 blocks each, never measured: one group.
        let s = mha(1, 2, 16384, 128);
        assert_eq!(GroupPlan::of(&s, false, GroupPolicy::Auto), GroupPlan::one(2));
        assert_eq!(GroupPlan::of(&s, false, GroupPolicy::Lean), choose_groups(&s));
    }

    #[test]
    fn staged_smem_fits_one_block_on_ampere_and_hopper() {
        for path in [StagedBackward::Sage, StagedBackward::Bf16] {
            assert_eq!(staged_backward_smem_bytes(128, path), 165_952, "{path:?}");
        }
        // d = 64: sage's three stages (the pipelined query loop) 32 768 + 3 · 20 480 + 1 024 + 16 384 + 2 · 64 + 1 024; fpa's two.
        assert_eq!(staged_backward_smem_bytes(64, StagedBackward::Sage), 112_768);
        // The sage kernels' two dQ staging tiles on sm_90a, both grids: d = 64: 2 · 64 · 288;
        // d = 128: 2 · 64 · 512 + the second amax scratch's 64, the whole layout (231 552 B) plus the persistent kernel's 16 static bytes
        // within the H200's opt-in 232 448.
        assert_eq!(sage_staging_bytes(64, StagedBackward::Sage), 36_864);
        assert_eq!(sage_staging_bytes(128, StagedBackward::Sage), 65_536 + 64); // + the second amax scratch
        assert_eq!(
            sage_staging_bytes(128, StagedBackward::Bf16) + sage_staging_bytes(64, StagedBackward::Bf16),
            0
        );
        assert!(staged_backward_smem_bytes(128, StagedBackward::Sage) + 65_536 + 64 + 16 <= 232_448);
        assert!(staged_backward_smem_bytes(64, StagedBackward::Bf16) < 100 * 1024);
        // Bf16BulkLayout at d = 128: 165 888 (the staged layout's end rounded up to 1024) + 32 768 + 1 024.
        assert_eq!(
            staged_backward_smem_bytes(128, StagedBackward::Bf16) + bf16_bulk_staging_bytes(128),
            199_680
        );
    }
}
