//! Host side of `kernels/backward_{pre,main,post}.cu` (ALGORITHM.md §5, §7).

use crate::forward::{scales, DeviceForward, SavedForBackward, ScoreOperands, Transposed};
use crate::quantize::{quantize_do, QuantNeeds, QuantizedDo};
use crate::runtime::{drv, Dims, Kernels, BLOCK_KV, BLOCK_Q, THREADS};
use crate::{flags, DeviceInputs, Gpu};
use cudarc::driver::{sys, CudaSlice, LaunchConfig, PushKernelArg};
use sagebwd::{Error, Product, Result};

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

/// Bytes of `BackwardShared` (backward_main.cu): the P and dS tiles, per-row lse2 and D, Q_m, β,
/// the dS column sums and the reduction scratch. The kernel traps if it is given less.
pub fn backward_smem_bytes(head_dim: usize) -> usize {
    4 * (2 * BLOCK_Q * BLOCK_KV + 2 * BLOCK_Q + head_dim + 2 * BLOCK_KV + THREADS as usize / 32)
}

/// The staged paths of `sage_bwd_main_mma` (`bwd_fast_path` in backward_main.cu); other product
/// mixes take the gathering path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StagedBackward {
    /// #3, #4, #6, #7 INT8 and #5 BF16 (the sagebwd preset), no Q-smoothing, no dQ correction.
    Sage,
    /// #3 to #7 all BF16 (the fpa preset); the switches act on INT8 products only.
    Bf16,
}

/// Which staged path `sage_bwd_main_mma` takes for these flags, if any.
pub fn staged_backward(flags: i32) -> Option<StagedBackward> {
    let bit = |p: Product| 1 << p.index();
    let products = bit(Product::QkBwd) | bit(Product::Dv) | bit(Product::Dp) | bit(Product::Dq) | bit(Product::Dk);
    let sage = bit(Product::QkBwd) | bit(Product::Dv) | bit(Product::Dq) | bit(Product::Dk);
    if flags & (products | crate::F_SMOOTH_Q | crate::F_DQ_CORR) == sage {
        Some(StagedBackward::Sage)
    } else if flags & products == 0 {
        Some(StagedBackward::Bf16)
    } else {
        None
    }
}

/// Dynamic shared memory of a staged path (`StagedLayout<…>::bytes`): the key block's tiles (sage:
/// K̂, K̂ᵀ of 128 × d bytes and BF16 V; bf16: BF16 K and V; 4 · 128 · d bytes either way); two
/// query-block stages of operand tiles (sage: Q̂, BF16 dO, dÔᵀ, Q̂ᵀ, 5 · 64 · d bytes; bf16: BF16 Q
/// and dO, 4 · 64 · d); two blocks of 64 L and D values; two dS tiles (sage: dŜ, 64 × 128 bytes;
/// bf16: bf16(dS)ᵀ, twice that); the amax scratch; 1024 bytes of slack, so that the kernel can
/// round its start up to the 1024-byte boundary wgmma's swizzled tiles need.
pub fn staged_backward_smem_bytes(head_dim: usize, path: StagedBackward) -> usize {
    let (stage_operands, ds_tile) = match path {
        StagedBackward::Sage => (5 * BLOCK_Q * head_dim, BLOCK_Q * BLOCK_KV),
        StagedBackward::Bf16 => (4 * BLOCK_Q * head_dim, 2 * BLOCK_Q * BLOCK_KV),
    };
    let rows = 2 * BLOCK_Q * 4;
    let align_slack = 1024;
    4 * BLOCK_KV * head_dim + 2 * (stage_operands + rows) + 2 * ds_tile + 2 * (THREADS as usize / 32) * 4 + align_slack
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
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (THREADS, 1, 1), shared_mem_bytes: 0 }
}

/// What the preprocess leaves for the main kernel.
struct Preprocessed {
    do_quant: QuantizedDo,
    /// D = rowsum(dO ∘ O), `[B, H_q, N_q]`.
    delta: CudaSlice<f32>,
    /// Zeroed FP32 dQ accumulator, `[B, H_q, N_q, d]`.
    dq_acc: CudaSlice<f32>,
    /// Zeroed per-row Σ_j dS (for the optional dQ correction), `[B, H_q, N_q]`.
    ds_rowsum: CudaSlice<f32>,
}

/// Preprocess: dO quantization, D = rowsum(dO ∘ O), zeroed FP32 accumulators.
fn preprocess(gpu: &Gpu, k: &Kernels, x: &DeviceInputs, o: &CudaSlice<u16>, d_o: &CudaSlice<u16>, needs: QuantNeeds) -> Result<Preprocessed> {
    let s = &x.shape;
    let rows = s.batch * s.heads_q * s.n_q;
    let do_quant = quantize_do(gpu, k, x, d_o, needs)?;
    let delta = gpu.alloc_poisoned_f32(rows)?;
    let warps_per_block = THREADS as usize / 32;
    let launch = LaunchConfig {
        grid_dim: (rows.div_ceil(warps_per_block) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let rows_i = rows as i64;
    drv("launch sage_bwd_delta", unsafe {
        gpu.dev.stream.launch_builder(&k.bwd_delta).arg(o).arg(d_o).arg(&delta).arg(&rows_i).launch(launch)
    })?;
    let dq_acc = gpu.alloc_f32(s.q_len())?;
    gpu.fill(k, &dq_acc, 0)?;
    let ds_rowsum = gpu.alloc_f32(rows)?;
    gpu.fill(k, &ds_rowsum, 0)?;
    Ok(Preprocessed { do_quant, delta, dq_acc, ds_rowsum })
}

pub fn backward(gpu: &Gpu, k: &Kernels, x: &DeviceInputs, fwd: &DeviceForward, saved: &SavedForBackward,
                d_o: &CudaSlice<u16>) -> Result<DeviceGradients> {
    let s = &x.shape;
    let dims = Dims::of(s, x.causal);
    let (c, c_lambda) = scales(s.head_dim);
    let cfg = &saved.cfg;
    let fl = flags(cfg);
    let Preprocessed { do_quant, delta, dq_acc, ds_rowsum } = preprocess(gpu, k, x, &fwd.o, d_o, saved.quant.needs)?;
    let staged = if gpu.tensor_cores() { staged_backward(fl) } else { None };
    // Without GQA a staged block holds the whole dK, dV of its keys and writes them in BF16 itself;
    // otherwise per-query-head FP32 partials are summed over each group by the postprocess.
    let direct = staged.is_some() && s.heads_q == s.heads_kv;
    let per_q_head_kv = s.batch * s.heads_q * s.n_k * s.head_dim;
    let partials = || if direct { Ok(None) } else { gpu.alloc_poisoned_f32(per_q_head_kv).map(Some) };
    let (dk_acc, dv_acc) = (partials()?, partials()?);
    let dk = gpu.alloc_poisoned_u16(s.kv_len())?;
    let dv = gpu.alloc_poisoned_u16(s.kv_len())?;

    let qd = &saved.quant;
    let p = BackwardParams {
        op: ScoreOperands::of(gpu, x, qd),
        tr: Transposed::of(gpu, qd, Some(&do_quant)),
        v_hat: gpu.ptr(&qd.v_hat),
        v_scale: gpu.ptr(&qd.v_scale),
        v: gpu.ptr(&x.v),
        do_hat: gpu.ptr(&do_quant.do_hat),
        do_scale: gpu.ptr(&do_quant.do_scale),
        d_o: gpu.ptr(d_o),
        lse2: gpu.ptr(&fwd.lse2),
        delta: gpu.ptr(&delta),
        dq_acc: gpu.ptr(&dq_acc),
        ds_rowsum: gpu.ptr(&ds_rowsum),
        dk_acc: gpu.ptr(&dk_acc),
        dv_acc: gpu.ptr(&dv_acc),
        dk_out: if direct { gpu.ptr(&dk) } else { 0 },
        dv_out: if direct { gpu.ptr(&dv) } else { 0 },
        dims,
        flags: fl,
        c_lambda,
        c,
    };
    let smem = match staged {
        Some(path) => staged_backward_smem_bytes(s.head_dim, path),
        None => backward_smem_bytes(s.head_dim),
    };
    let optin = gpu.dev.smem_optin;
    if smem > optin {
        return Err(Error::Backend(format!("backward kernel needs {smem} B of shared memory per block, the GPU allows {optin}")));
    }
    let func = if gpu.tensor_cores() { &k.bwd_main_mma } else { &k.bwd_main };
    drv("set smem attribute", func.set_attribute(
        sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32))?;
    let launch = LaunchConfig {
        grid_dim: (dims.n_kblk as u32, (s.batch * s.heads_q) as u32, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    drv("launch backward main", unsafe { gpu.dev.stream.launch_builder(func).arg(&p).launch(launch) })?;

    let dq = gpu.alloc_poisoned_u16(s.q_len())?;
    let stream = &gpu.dev.stream;
    drv("launch sage_bwd_post_dq", unsafe {
        stream.launch_builder(&k.post_dq).arg(&dq_acc).arg(&ds_rowsum).arg(&qd.k_mean).arg(&dq)
            .arg(&dims).arg(&c).arg(&fl).launch(grid_stride(s.q_len()))
    })?;
    if let (Some(dk_acc), Some(dv_acc)) = (&dk_acc, &dv_acc) {
        drv("launch sage_bwd_post_dkdv", unsafe {
            stream.launch_builder(&k.post_dkdv).arg(dk_acc).arg(dv_acc).arg(&dk).arg(&dv)
                .arg(&dims).arg(&c).launch(grid_stride(s.kv_len()))
        })?;
    }
    Ok(DeviceGradients { dq, dk, dv, delta, do_quant })
}

/// Device bytes the backward allocates beyond the forward's (for the up-front memory check).
pub fn backward_bytes(s: &sagebwd::Shape) -> usize {
    let rows = s.batch * s.heads_q * s.n_q;
    let per_q_head_kv = s.batch * s.heads_q * s.n_k * s.head_dim;
    let do_t = 3 * s.batch * s.heads_q * s.head_dim * crate::runtime::padded_q(s.n_q);
    s.q_len() * (1 + 4 + 2) + rows * 4 * 2 + s.q_len().div_ceil(BLOCK_Q) * 4 + per_q_head_kv * 8 + s.kv_len() * 4
        + s.q_len() * 2 /* dO upload */ + do_t
}

#[cfg(test)]
mod tests {
    use super::*;
    use sagebwd::Config;

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

    #[test]
    fn staged_smem_fits_one_block_on_ampere_and_hopper() {
        for path in [StagedBackward::Sage, StagedBackward::Bf16] {
            assert_eq!(staged_backward_smem_bytes(128, path), 165_952, "{path:?}");
            assert!(staged_backward_smem_bytes(64, path) < 100 * 1024, "{path:?}");
        }
    }
}
