//! Host side of `kernels/forward.cu` (ALGORITHM.md §4).

use crate::quantize::{quantize_inputs, QuantizedDev};
use crate::runtime::{drv, Dims, Kernels, THREADS};
use crate::{flags, DeviceInputs, Gpu};
use cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use sagebwd::{Config, Product, Result};

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
}

/// Softmax scale `c = 1/sqrt(d)` and `cλ = fl(c · log2 e)`, both FP32.
pub fn scales(head_dim: usize) -> (f32, f32) {
    let c = (1.0 / (head_dim as f64).sqrt()) as f32;
    (c, c * std::f32::consts::LOG2_E)
}

/// Which path `sage_forward_mma` takes for these flags (the dispatch at the end of forward.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ForwardPath {
    /// #1 and #2 INT8 (sagebwd, int8-all): K̂ and V̂ᵀ staged in shared memory, P̂ in registers.
    StagedInt8,
    /// #1 and #2 BF16 (fpa, isolations of the backward products): K and V staged, bf16(P) in
    /// registers. Smoothing flags do not matter: BF16 products take the unsmoothed inputs.
    StagedBf16,
    /// Any other mix: fragments gathered from global memory, P staged per warp.
    Gather,
}

pub(crate) fn forward_path(flags: i32) -> ForwardPath {
    let both = (1 << Product::QkFwd.index()) | (1 << Product::Pv.index());
    let fwd = flags & both;
    if fwd == both {
        ForwardPath::StagedInt8
    } else if fwd == 0 {
        ForwardPath::StagedBf16
    } else {
        ForwardPath::Gather
    }
}

/// How a kernel of the warp-specialized BF16 forward walks the work: `Pairs`, one block per
/// query-block pair and (batch·head) (`sage_forward_ws_bf16`); `Persistent`, min(tiles,
/// SMs) blocks that each walk tiles (`sage_forward_ws_bf16_p*`, fpafwd2), heaviest first over the
/// grid (query-block pairs in decreasing order, batch·heads inside).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Bf16WsGrid {
    Pairs,
    Persistent,
}

/// A kernel of the warp-specialized BF16 forward and its grid.
type Bf16WsKernel = (&'static std::ffi::CStr, Bf16WsGrid);

/// The kernel of the warp-specialized BF16 forward (`fpa`, both forward products BF16) that
/// `SAGEBWD_FORWARD_WGMMA` asks for, or None for the mma.sync staged path (`off`): `fpp3s`
/// (`sage_forward_ws_bf16_p3s`) persistent, P·V accumulated onto the rescaled O with softmax(kb + 1)
/// overlapping P·V(kb) in each warpgroup, ping-pong, the tiles dealt to the blocks in a snake (rounds
/// alternate direction: the static balance of a causal grid, fpafwd3); `fpp3g` `fpp3s` with the tiles in
/// groups of heads (the pairs of a head side by side: K, V read from DRAM about once, fpaf14; default at
/// d = 128, `bf16_grouped_pays`); `fws3` (fpafwd's kernel, a block per query-block pair) the INT8 kernels'
/// schedule (S(kb + 1) runs during the O update; ping-pong). Other values (the INT8 kernels' names) give
/// the default, by shape: the fastest measured (RESULTS-gpu.md, fpafwd3; the variants measured slower,
/// `fws1`, `fws0`, `fws3s`, `fpp3`, `fpp1`, are in the history before session 21).
fn bf16_ws_kernel(head_dim: usize, n_q: usize, causal: bool) -> Option<Bf16WsKernel> {
    use Bf16WsGrid::{Pairs, Persistent};
    let fpp3s = (c"sage_forward_ws_bf16_p3s", Persistent);
    let fpp3g = (c"sage_forward_ws_bf16_p3g", Persistent);
    let fws3 = (c"sage_forward_ws_bf16", Pairs);
    match std::env::var("SAGEBWD_FORWARD_WGMMA").as_deref() {
        Ok("off") => None,
        Ok("fws3") => Some(fws3),
        Ok("fpp3s") => Some(fpp3s),
        Ok("fpp3g") => Some(fpp3g),
        _ => Some(if bf16_grouped_pays(head_dim, n_q, causal) {
            fpp3g
        } else if bf16_persistent_pays(head_dim, n_q, causal) {
            fpp3s
        } else {
            fws3
        }),
    }
}

/// Where the persistent kernel (`fpp3s`) beat `fws3` (fpafwd3's calls, H200, both with `exp2_ftz`):
/// every causal shape measured (d = 64 and 128, N = 1k–16k: +0.5–24 %; the snake order balances the
/// heaviest-first tiles), and non-causal d = 64 up to N = 4k, d = 128 at N = 1k. Non-causal at
/// N = 16k `fws3`'s grid (the pairs of one head side by side: K, V reused in L2) is 4–7 % ahead, and
/// at d = 128 N = 4k the two are within 1 % (RESULTS-gpu.md, fpafwd3). At d = 64 non-causal N 8k and 16k
/// `fpp3s` is now the faster one (session 19's tune20, two rounds: −5.1 / −6.1 % and −6.2 / −4.9 % forward
/// against `fws3`): the persistent kernel at every d = 64 shape.
fn bf16_persistent_pays(head_dim: usize, n_q: usize, causal: bool) -> bool {
    causal || head_dim == 64 || n_q <= 1024
}

/// Where the head-grouped persistent kernel (`fpp3g`) is the default (fpaf14's call, H200, fwd ms
/// against main's choice in the same call): d = 128 N = 1k −7.9 % / −3.0 % (non-causal / causal,
/// vs `fpp3s`), N = 2k −12.5 % (vs `fws3`) / −4.6 % (vs `fpp3s`), N = 4k non-causal −5.0 % (vs `fws3`).
/// Not at d = 128 N = 4k causal (+1.1 %: there B·H = 64 already gives `fpp3s`'s rounds several pairs
/// per head) nor at d = 64, where it was 2–11 % slower on every shape measured (ptxas schedules its
/// issue-bound key loop differently: 0.82 similarity of the loop's SASS to `fpp3s`'s, against 0.97
/// at d = 128).
fn bf16_grouped_pays(head_dim: usize, n_q: usize, causal: bool) -> bool {
    head_dim == 128 && n_q <= if causal { 2048 } else { 4096 }
}

/// The persistent INT8 forward (sm_90a; a producer warpgroup, two consumer warpgroups, min(tiles, SMs) blocks in
/// the snake tile order, sfwd12) that `SAGEBWD_FORWARD_WGMMA` asks for: `wsp3s-x` (`sage_forward_ws_p3s_x`,
/// ping-pong turns between the consumer warpgroups and fwd17's changes) or `wsp3s-sx` (`sage_forward_ws_p3s_sx`,
/// fwd18's once-per-tile stagger instead of the turns); `off` gives None, the mma.sync path of sm_80
/// (`sage_forward_mma`); anything else the default (`int8_persistent_default`). The earlier wgmma kernels
/// (`pipe`, `pipe2`, `simple`, the pairs kernel `ws1` / `ws3` / `ws13`, the persistent `wsp3s`, `wsp3s-0`,
/// `wsp3s-nopp`, `wsp3s-stagger`), each measured slower at every shape than these defaults, are in the history
/// before session 21.
fn int8_persistent_kernel(head_dim: usize) -> Option<&'static std::ffi::CStr> {
    match std::env::var("SAGEBWD_FORWARD_WGMMA").as_deref() {
        Ok("off") => None,
        Ok("wsp3s-x") => Some(c"sage_forward_ws_p3s_x"),
        Ok("wsp3s-sx") => Some(c"sage_forward_ws_p3s_sx"),
        _ => Some(int8_persistent_default(head_dim)),
    }
}

/// The default persistent INT8 forward, at every N and both head dims since session 22: `wsp3s-sx` (no turns,
/// the once-per-tile stagger, fwd17's bits); until then d = 128 took `wsp3s-x` (the turns and fwd17's bits): the
/// sequence length and the mask do not decide (session 19's measurements below). Measured
/// (H200; RESULTS-gpu.md "Lead, session 16" and "Lead, session 17"): against the pairs kernel `ws3`,
/// which was the default at non-causal d = 64 N ≥ 2k and d = 128 N ≥ 8k, `wsp3s-nopp` is −14 to
/// −18.5 % (d 64 non-causal N 2k–16k) and −6 to −17 % (d 128 N 8k, 16k, both masks), with `wsp3s`
/// 0.2–4 % behind it at each of those shapes; at the training shape (d 64 causal, H·D 768)
/// `wsp3s-nopp` is +1.6 % at N 1k, level at 2k, −2.6 % at 4k and −3 % at 8k against `wsp3s`
/// (session 15); at d 128 N 2k and 4k (both masks, H·D 2048) it was 0.2–3 % slower than `wsp3s` (the
/// forward kernel's time, quantization excluded, in session 16's two sweeps: same cubins, two calls).
/// `wsp3s-x` (session 17's first call, same binary, alternated): −1.8 to −2.5 % against `wsp3s` at
/// d 64 N 1k (both masks, H·D 2048 and the training shape) and −0.8 % against `wsp3s-nopp` at the
/// training shape N 2k; fwd17 measured its changes slower than `wsp3s-nopp` at N 4k–8k.
/// `wsp3s-stagger` (`wsp3s-nopp` with fwd18's once-per-tile stagger: warpgroup 1 starts each tile once
/// warpgroup 0's first S is done) at d = 64 causal up to N 4k (fwd18's call, same binary, two
/// alternated rounds, forward ms incl. quantization): training shape (H·D 768) −3.1 % at N 1k and
/// −2.3 % at N 2k against `wsp3s-x`, −2.0 % at N 4k against `wsp3s-nopp`; causal N 4k at H·D 2048
/// −2.0 %. Not taken: causal N 8k (−0.3 %), 16k (+0.9 %), non-causal N 4k (+0.3 %), 16k (+1.9 %).
/// Session 19's tune20 (every variant at every sweep shape, two rounds, forward ms incl. quantization):
/// `wsp3s-stagger` also at d = 64 non-causal N 1k and 2k (−2.5 / −1.9 % and −2.5 / −1.7 % against
/// `wsp3s-x`; non-causal N 4k −0.5 / −0.1 %, left to `wsp3s-nopp`). At d = 128, where fwd17's bits had
/// never been compiled in (call20e, two rounds): `wsp3s-x` −1.0 to −2.6 % against the previous default
/// (`wsp3s` below N 8k, `wsp3s-nopp` from 8k) at every sweep shape; `wsp3s-nopp` + the bits (an entry of
/// that call, removed since) and the stagger within ±1 %. `wsp3s-sx` (call20g, two rounds, against session 19's rule then: `wsp3s-stagger`
/// up to N 4k causal / 2k non-causal, `wsp3s-nopp` above): −0.8 to −3.0 % at every d = 64 sweep shape, −1.1 to
/// −3.2 % at the training shape (N 1k–8k); at d = 128 +0.2 to +1.4 % against `wsp3s-x`.
/// Session 22, after fwd22 took the producer's cp.async copies off the schedulers (call c5, `8ae8c96`, three rounds,
/// forced by `SAGEBWD_FORWARD_WGMMA`): at d = 128 `wsp3s-sx` **−1.7 to −4.8 % at every sweep shape, geometric mean
/// −3.29 %** against `wsp3s-x` (the turns' barriers had grown to ~16 % of the consumers' samples); at d = 64 `wsp3s-x`
/// +6.6 % (training shape +5.9 %) against `wsp3s-sx`. So `wsp3s-sx` at both head dimensions.
fn int8_persistent_default(_head_dim: usize) -> &'static std::ffi::CStr {
    c"sage_forward_ws_p3s_sx"
}

/// Whether the forward takes a warp-specialized INT8 kernel: staged INT8 products without Q-smoothing (that variant
/// keeps the mma.sync path), on a device compiled for sm_90a.
fn int8_ws_eligible(gpu: &Gpu, flags: i32) -> bool {
    gpu.dev.arch == "sm_90a" && forward_path(flags) == ForwardPath::StagedInt8 && flags & crate::F_SMOOTH_Q == 0
}

/// Dynamic shared memory of `sage_forward_mma` on each path (`FAST_SMEM_BYTES`, `BF16_SMEM_BYTES`,
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

/// Every value `SAGEBWD_FORWARD_WGMMA` may take (the comparisons' knob, read by [`bf16_ws_kernel`] and
/// [`int8_persistent_kernel`]; each ignores the other's names).
const FORWARD_VARIANTS: &[&str] = &["off", "wsp3s-x", "wsp3s-sx", "fws3", "fpp3s", "fpp3g"];

/// An error for a `SAGEBWD_FORWARD_WGMMA` that names no variant (a typo, or a variant since removed),
/// which would otherwise run the default silently.
fn check_forward_variant(v: Option<&str>) -> std::result::Result<(), String> {
    match v {
        Some(v) if !v.is_empty() && !FORWARD_VARIANTS.contains(&v) => Err(format!(
            "SAGEBWD_FORWARD_WGMMA={v}: no such forward variant; expected one of {} (or unset: the default)",
            FORWARD_VARIANTS.join(", "))),
        _ => Ok(()),
    }
}

pub fn forward(gpu: &Gpu, k: &Kernels, x: &DeviceInputs, cfg: &Config) -> Result<(DeviceForward, SavedForBackward)> {
    static VARIANT: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    VARIANT.get_or_init(|| check_forward_variant(std::env::var("SAGEBWD_FORWARD_WGMMA").ok().as_deref()))
        .clone()
        .map_err(sagebwd::Error::Backend)?;
    let quant = quantize_inputs(gpu, k, x, cfg)?;
    let s = &x.shape;
    let dims = Dims::of(s, x.causal);
    let rows = s.batch * s.heads_q * s.n_q;
    let out = DeviceForward {
        o: gpu.alloc_poisoned_u16(s.q_len())?,
        lse2: gpu.alloc_poisoned_f32(rows)?,
        lse: gpu.alloc_poisoned_f32(rows)?,
    };
    let (_, c_lambda) = scales(s.head_dim);
    let p = ForwardParams {
        op: ScoreOperands::of(gpu, x, &quant),
        tr: Transposed::of(gpu, &quant, None),
        v_hat: gpu.ptr(&quant.v_hat),
        v_scale: gpu.ptr(&quant.v_scale),
        v: gpu.ptr(&x.v),
        o: gpu.ptr(&out.o),
        lse2: gpu.ptr(&out.lse2),
        lse: gpu.ptr(&out.lse),
        dims,
        flags: flags(cfg),
        c_lambda,
        ln2: std::f32::consts::LN_2,
    };
    // Tensor cores: 4 warps of 16 query rows, shared memory allocated dynamically, the size of the
    // path the flags select (the staged paths double-buffer tiles: more than the 48 KiB of a
    // static allocation);
    // scalar: 256 threads over the 64 × 128 tile, static shared memory.
    if gpu.tensor_cores() && gpu.dev.arch == "sm_90a" && forward_path(p.flags) == ForwardPath::StagedBf16 {
        if let Some((kernel, grid)) = bf16_ws_kernel(s.head_dim, s.n_q, x.causal) {
            launch_ws_bf16(gpu, k, kernel, grid, &p, s.head_dim)?;
            return Ok((out, SavedForBackward { quant, cfg: cfg.clone() }));
        }
    }
    if gpu.tensor_cores() && int8_ws_eligible(gpu, p.flags) {
        if let Some(kernel) = int8_persistent_kernel(s.head_dim) {
            launch_wsp(gpu, k, kernel, &p, &quant, s.head_dim)?;
            return Ok((out, SavedForBackward { quant, cfg: cfg.clone() }));
        }
    }
    let (func, threads, smem) = if gpu.tensor_cores() {
        let smem = forward_mma_smem_bytes(s.head_dim, forward_path(p.flags));
        drv(
            "set forward shared memory",
            k.forward_mma.set_attribute(
                cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            ),
        )?;
        (&k.forward_mma, 128, smem)
    } else {
        (&k.forward, THREADS, 0)
    };
    let launch = LaunchConfig {
        grid_dim: (dims.n_qblk as u32, (s.batch * s.heads_q) as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: smem,
    };
    drv("launch forward", unsafe { gpu.dev.stream.launch_builder(func).arg(&p).launch(launch) })?;
    Ok((out, SavedForBackward { quant, cfg: cfg.clone() }))
}

/// Dynamic shared memory of `sage_forward_ws_bf16` (`WsBf16Ring::kSmemBytes`): BF16 Q of two query
/// blocks, rings of `FW_STAGES` (2 at d = 128, 4 at d = 64) K and V tiles of 128 × d BF16, the
/// mbarriers, 1 KiB of alignment slack.
fn ws_bf16_smem_bytes(head_dim: usize) -> u32 {
    let stages = if head_dim == 128 { 2 } else { 4 };
    (128 * head_dim * 2 + 2 * stages * 128 * head_dim * 2 + 16 * stages + 1024) as u32
}

/// Dynamic shared memory of the persistent INT8 kernels (`WspSmem::kSmemBytes`): two slots of Q̂ of
/// two query blocks, rings of `WSP_STAGES` (4 at d = 128, 8 at d = 64) K̂ and V̂ᵀ tiles of 128 × d
/// bytes, at d = 128 the 8 consumer warps' O staging (16 rows × d BF16 each, fwd22s), the full / empty mbarriers
/// of the stages and the two Q-empty ones, 1 KiB of alignment slack.
fn wsp_smem_bytes(head_dim: usize) -> u32 {
    let stages = if head_dim == 128 { 4 } else { 8 };
    let o_staging = if wsp_tma_o(head_dim) { 8 * 16 * head_dim * 2 } else { 0 };
    (2 * 2 * 64 * head_dim + 2 * stages * 128 * head_dim + o_staging + 8 * (2 * stages + 2) + 1024) as u32
}

/// Launches a persistent INT8 kernel (`sage_forward_ws_p*`): min(tiles, SMs) blocks of 384 threads,
/// the tensor maps of V̂ᵀ, K̂, Q̂ and O as its first parameters (`WspMaps`); K̂ and Q̂ are copied by TMA where
/// [`use_tma_kq`] says so (`F_TMA_KQ`), O where [`wsp_tma_o`] does (otherwise their maps are V̂ᵀ's, unused).
fn launch_wsp(gpu: &Gpu, k: &Kernels, kernel: &std::ffi::CStr, p: &ForwardParams, quant: &QuantizedDev, head_dim: usize) -> Result<()> {
    let vmap = int8_v_map(gpu, p, quant, head_dim)?;
    let mut p = *p;
    let omap = if wsp_tma_o(head_dim) { o_map(&p, head_dim)? } else { vmap };  // unused at d = 64
    let mut maps = [vmap, vmap, vmap, omap];
    if use_tma_kq(&p.dims) {
        [maps[1], maps[2]] = int8_kq_maps(&p, head_dim)?;
        p.flags |= crate::F_TMA_KQ;
    }
    // Programmatic dependent launch after sage_quantize_qkv (which triggers at its start): the blocks
    // start on the SMs its last wave frees and wait (pdl_wait in wsp_main) for it to complete.
    let pdl = crate::quantize::pdl_main(gpu, crate::quantize::PdlMain::Forward);
    let shape = WsShape { smem: wsp_smem_bytes(head_dim), grid: persistent_grid(gpu, &p), threads: WS_THREADS, pdl };
    launch_ws_kernel(gpu, k, kernel, &mut maps, &p, shape)
}

/// fwd22: whether the persistent INT8 forward copies K̂ and Q̂ by TMA from one producer thread (`wsp_producer_tma`)
/// instead of every producer thread's 16-byte cp.async chunks (~40 address instructions each; ~18 % of the kernel's
/// issued instructions at d 128, session 22's profile): where n_k is a non-zero multiple of 16 (K̂'s permuted view
/// folds the heads' 16-key groups together) and the rows fit the kernel's 32-bit row arithmetic.
/// `SAGEBWD_FWD_TMA_KQ=0` keeps the cp.async copies (read once per process, like the other knobs, not per launch).
fn use_tma_kq(d: &Dims) -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    tma_kq_fits(d) && !*OFF.get_or_init(|| std::env::var("SAGEBWD_FWD_TMA_KQ").is_ok_and(|v| v == "0"))
}
fn tma_kq_fits(d: &Dims) -> bool {
    let rows = |heads: i32, n: i32| heads as i64 * d.batch as i64 * n as i64;
    d.n_k % 16 == 0 && d.n_k > 0 && d.n_q > 0 && rows(d.heads_q, d.n_q) + 2 * 64 < 1 << 31 && rows(d.heads_kv, d.n_k) < 1 << 31
}

/// Whether the persistent INT8 kernel stores O by TMA from its staging boxes (forward.cu `WSP_TMA_O`, fwd22s): d = 128.
fn wsp_tma_o(head_dim: usize) -> bool {
    head_dim == 128
}

/// O (`[B·H_q][n_q][d]` BF16) for fwd22s's tensor stores at d = 128 (forward.cu `wsp_store`; unused at d = 64):
/// boxes of 64 columns × 16 rows (half a consumer warp's tile), 128-byte swizzled; rows past n_q are outside the map
/// (not written).
fn o_map(p: &ForwardParams, head_dim: usize) -> Result<crate::tma::TensorMap> {
    use crate::tma::{encode_tiled, TmaElem, TmaSwizzle};
    let d = &p.dims;
    let row_bytes = head_dim as u64 * 2;
    let dims = [head_dim as u64, d.n_q as u64, (d.batch * d.heads_q) as u64];
    encode_tiled(TmaElem::U16, p.o, &dims, &[row_bytes, row_bytes * d.n_q as u64], &[64, 16, 1], TmaSwizzle::B128)
}

/// fwd22's maps (`wsp_producer_tma`): K̂ (`[B·H_kv·n_k][d]` i8) as the permuted 5-D view whose box is one key block
/// of 128 keys, Q̂ (`[B·H_q·n_q][d]` i8) as rows, boxes of two query blocks (128 rows); the swizzle of the tiles'
/// wgmma descriptors (128-byte rows at d = 128, 64-byte at d = 64).
fn int8_kq_maps(p: &ForwardParams, head_dim: usize) -> Result<[crate::tma::TensorMap; 2]> {
    use crate::tma::{encode_tiled, permuted_rows_map, TmaElem, TmaSwizzle};
    let d = &p.dims;
    let row = head_dim as u64;
    let swizzle = if head_dim == 128 { TmaSwizzle::B128 } else { TmaSwizzle::B64 };
    let key_groups = (d.batch * d.heads_kv) as u64 * d.n_k as u64 / 16;
    let q_rows = (d.batch * d.heads_q) as u64 * d.n_q as u64;
    Ok([
        permuted_rows_map(TmaElem::I8, p.op.k_hat, row, key_groups, head_dim as u32, 8, swizzle)?,
        encode_tiled(TmaElem::I8, p.op.q_hat, &[row, q_rows], &[row], &[head_dim as u32, 128], swizzle)?,
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
/// swizzled (one panel of the K-major / N-major tiles of `sage_forward_ws_bf16`); rows past `rows`
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

/// Launches a kernel of the warp-specialized BF16 forward (`sage_forward_ws_bf16*`): 384 threads
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
        Bf16WsGrid::Pairs => launch_ws_kernel(gpu, k, kernel, &mut maps, p, WsShape { smem: ws_bf16_smem_bytes(head_dim), grid: pairs_grid(p), threads: WS_THREADS, pdl: false }),
        Bf16WsGrid::Persistent => {
            launch_ws_kernel(gpu, k, kernel, &mut maps, p, WsShape { smem: ws_bf16_persistent_smem_bytes(head_dim), grid: persistent_grid(gpu, p), threads: WS_THREADS, pdl: false })
        }
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
    let WsShape { smem, grid, threads, pdl } = shape;
    use cudarc::driver::sys;
    drv("bind context", gpu.dev.ctx.bind_to_thread())?;
    let func = k.forward_function(name)?;
    let attr = sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
    drv("set forward shared memory", unsafe { sys::cuFuncSetAttribute(func, attr, smem as i32).result() })?;
    let mut params = *p;
    let mut args: Vec<*mut std::ffi::c_void> = maps.iter_mut().map(|m| (m as *mut crate::tma::TensorMap).cast()).collect();
    args.push((&mut params as *mut ForwardParams).cast());
    let stream = gpu.dev.stream.cu_stream();
    if pdl {
        return crate::quantize::launch_pdl(gpu, func, (grid.0, grid.1, 1), threads, smem, stream, &mut args);
    }
    drv("launch forward (warp-specialized)", unsafe {
        sys::cuLaunchKernel(func, grid.0, grid.1, 1, threads, 1, 1, smem, stream, args.as_mut_ptr(), std::ptr::null_mut()).result()
    })
}

/// The grid of the non-persistent warp-specialized kernels: (query-block pairs, B·H_q).
fn pairs_grid(p: &ForwardParams) -> (u32, u32) {
    ((p.dims.n_qblk as u32).div_ceil(2), (p.dims.batch * p.dims.heads_q) as u32)
}

/// The persistent forward kernels' grid: one block per SM (`Device::persistent_sms`), fewer when
/// there are fewer tiles (query-block pairs × heads); the blocks walk the tiles.
fn persistent_grid(gpu: &Gpu, p: &ForwardParams) -> (u32, u32) {
    let (pairs, heads) = pairs_grid(p);
    ((pairs * heads).min(gpu.dev.persistent_sms).max(1), 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_forward_variants_are_errors() {
        for ok in [None, Some(""), Some("wsp3s-sx"), Some("fpp3g"), Some("off")] {
            assert!(check_forward_variant(ok).is_ok(), "{ok:?}");
        }
        let err = check_forward_variant(Some("wsp3s-nx")).unwrap_err();
        assert!(err.contains("wsp3s-nx") && err.contains("wsp3s-sx"), "{err}");
        // Variants removed in session 21 name no kernel any more: an error, not a silent default.
        for gone in ["wsp3s-nopp", "ws3", "pipe2", "fws1", "fpp1"] {
            assert!(check_forward_variant(Some(gone)).is_err(), "{gone}");
        }
    }

    #[test]
    fn tma_copies_only_where_the_folded_key_view_holds() {
        let dims = |n_q, n_k| {
            let s = sagebwd::Shape { batch: 2, heads_q: 4, heads_kv: 2, n_q, n_k, head_dim: 128 };
            Dims::of(&s, false)
        };
        for (n_q, n_k) in [(1024, 1024), (1, 16), (4097, 4096), (100, 48)] {
            assert!(tma_kq_fits(&dims(n_q, n_k)), "{n_q} {n_k}");
        }
        // A head's keys must be whole 16-key groups of the folded view; rows must fit the kernel's 32-bit arithmetic.
        for (n_q, n_k) in [(1024, 1023), (64, 4097), (16, 8)] {
            assert!(!tma_kq_fits(&dims(n_q, n_k)), "{n_q} {n_k}");
        }
        assert!(!tma_kq_fits(&dims(1 << 28, 1024)));
    }

    #[test]
    fn forward_kernel_rules_follow_the_measurements() {
        // Every N, both masks, both head dims (call20g; session 22's c5 at d = 128): the stagger with fwd17's bits.
        assert_eq!(int8_persistent_default(64).to_str().unwrap(), "sage_forward_ws_p3s_sx");
        assert_eq!(int8_persistent_default(128).to_str().unwrap(), "sage_forward_ws_p3s_sx");
        // fpa: persistent at every d = 64 shape (tune20) and where fpafwd3 measured it at d = 128.
        for n in [1024, 4096, 16384] {
            assert!(bf16_persistent_pays(64, n, false) && bf16_persistent_pays(128, n, true));
        }
        assert!(bf16_persistent_pays(128, 1024, false) && !bf16_persistent_pays(128, 16384, false));
    }
}
