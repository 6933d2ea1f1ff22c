//! Which kernels run for a configuration: one decision, made here, printable and tested.
//!
//! [`KernelPlan::choose`] takes the GPU architecture, the method configuration, the shape, the mask and the
//! [`Tuning`] (every override a caller or a `SAGEBWD_*` environment variable may set) and returns every stage that
//! will run: the preparation (quantization), the forward kernel, the backward's preprocess, main kernel, head groups
//! and postprocess. `forward.rs`, `backward.rs` and `quantize.rs` launch what the plan says and decide nothing
//! themselves. `sagebwd plan` prints a plan; [`kernel_map_markdown`] renders the table of `docs/ARCHITECTURE.md`
//! (a test fails when that page is stale).
//!
//! The rules below are the fastest kernels measured at each shape (H100/H200, `docs/PERFORMANCE.md`); each rule's
//! comment says what it trades.

use crate::runtime::{BLOCK_KV, BLOCK_Q, THREADS};
use sagebwd::{Config, Error, Product, Result, Shape};
use std::ffi::CStr;
use std::fmt;

// ---------------------------------------------------------------------------------------------------------------
// Tuning: the overrides
// ---------------------------------------------------------------------------------------------------------------

/// A forward kernel forced by [`Tuning::forward`] (`SAGEBWD_FORWARD_WGMMA`). Each applies where its kind
/// (INT8 or BF16 forward products, sm_90a) runs; elsewhere the plan's default stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForwardOverride {
    /// `mma`: the `mma.sync` kernel of every sm_80+ GPU, also on sm_90a.
    Mma,
    /// `int8-persistent`: the persistent INT8 kernel (the default where it applies).
    Int8Persistent,
    /// `bf16-pairs`: the BF16 kernel with one block per pair of query blocks.
    Bf16Pairs,
    /// `bf16-persistent`: the persistent BF16 kernel, tiles in snake order.
    Bf16Persistent,
    /// `bf16-head-grouped`: the persistent BF16 kernel with the tiles of a head side by side.
    Bf16HeadGrouped,
}

impl ForwardOverride {
    const NAMES: [(&'static str, ForwardOverride); 5] = [
        ("mma", ForwardOverride::Mma),
        ("int8-persistent", ForwardOverride::Int8Persistent),
        ("bf16-pairs", ForwardOverride::Bf16Pairs),
        ("bf16-persistent", ForwardOverride::Bf16Persistent),
        ("bf16-head-grouped", ForwardOverride::Bf16HeadGrouped),
    ];

    pub fn parse(v: &str) -> Result<ForwardOverride> {
        Self::NAMES
            .iter()
            .find(|(n, _)| *n == v)
            .map(|&(_, o)| o)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::NAMES.iter().map(|(n, _)| *n).collect();
                Error::Backend(format!(
                "SAGEBWD_FORWARD_WGMMA={v}: no such forward kernel; expected one of {} (or unset: the plan's choice)",
                names.join(", ")
            ))
            })
    }

    pub fn name(self) -> &'static str {
        Self::NAMES.iter().find(|(_, o)| *o == self).map_or("?", |(n, _)| n)
    }
}

/// How many head groups the staged sagebwd backward runs in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupPolicy {
    /// The default: [`choose_groups`] (peak memory within cuDNN's) where it is free ([`free_groups`]),
    /// else one group (the fastest elsewhere; its peak is ~1.25× cuDNN's).
    Auto,
    /// This many (1: unsplit).
    Count(usize),
    /// [`choose_groups`] at every shape: peak memory within cuDNN's, at up to ~20 % more backward time at
    /// N 1k, where [`free_groups`] does not hold.
    Lean,
}

impl GroupPolicy {
    /// From `SAGEBWD_BWD_GROUPS`: unset or `auto` → [`GroupPolicy::Auto`]; `1` or `off` → unsplit;
    /// `lean` → [`GroupPolicy::Lean`]; `n` → n groups. Anything else is an error, not a silent default.
    pub fn parse(v: Option<&str>) -> Result<GroupPolicy> {
        match v.map(str::trim) {
            None | Some("") | Some("auto") => Ok(GroupPolicy::Auto),
            Some("off") => Ok(GroupPolicy::Count(1)),
            Some("lean") => Ok(GroupPolicy::Lean),
            Some(n) => match n.parse::<usize>() {
                Ok(n) if n >= 1 => Ok(GroupPolicy::Count(n)),
                _ => Err(Error::Backend(format!(
                    "SAGEBWD_BWD_GROUPS={n}: expected `auto` (the default), `off`, `lean` (peak memory within cuDNN's) or a number of head groups ≥ 1"))),
            },
        }
    }
}

/// Every override of the plan's choices and of how kernels are launched. [`Tuning::default`] is the plan as
/// measured fastest; [`Tuning::from_env`] reads the `SAGEBWD_*` variables below once (an invalid value is an
/// error naming the variable, never a silent default); a caller may also build one and pass it
/// ([`crate::Gpu::set_tuning`]). These exist for comparisons and tests: the defaults are the product.
///
/// | variable | field | values |
/// |---|---|---|
/// | `SAGEBWD_FORWARD_WGMMA` | [`forward`](Tuning::forward) | `mma`, `int8-persistent`, `bf16-pairs`, `bf16-persistent`, `bf16-head-grouped` |
/// | `SAGEBWD_BWD_GROUPS` | [`backward_groups`](Tuning::backward_groups) | `auto`, `off`, `lean`, n ≥ 1 |
/// | `SAGEBWD_BWD_PERSIST` | [`backward_persistent`](Tuning::backward_persistent) | `0`, `1` |
/// | `SAGEBWD_SAGE_TMA_DQ` | [`sage_d64_tma_dq`](Tuning::sage_d64_tma_dq) | `0`, `1` |
/// | `SAGEBWD_SAGE128_TMA_STAGE` | [`sage_d128_tma_stage`](Tuning::sage_d128_tma_stage) | `0`, `1` |
/// | `SAGEBWD_FPA_BULK_DQ` | [`bf16_d128_tma_dq`](Tuning::bf16_d128_tma_dq) | `0`, `1` |
/// | `SAGEBWD_FWD_TMA_KQ` | [`forward_tma_kq`](Tuning::forward_tma_kq) | `0`, `1` |
/// | `SAGEBWD_PDL` | [`pdl`](Tuning::pdl) | `0`, `1` |
/// | `SAGEBWD_PDL_FWD` | [`pdl_forward`](Tuning::pdl_forward) | `0`, `1` |
/// | `SAGEBWD_PDL_BWD` | [`pdl_backward`](Tuning::pdl_backward) | `0`, `1` |
/// | `SAGEBWD_QKV_VFIRST` | [`quantize_v_first`](Tuning::quantize_v_first) | `0`, `1` |
/// | `SAGEBWD_QKT_FWD` | [`qk_hat_t_in_forward`](Tuning::qk_hat_t_in_forward) | `0`, `1` |
/// | `SAGEBWD_BWD_PRE_FUSE` | [`fused_preprocess`](Tuning::fused_preprocess) | `0`, `1` |
/// | `SAGEBWD_V8_FUSED` | [`fused_v_e4m3`](Tuning::fused_v_e4m3) | `0`, `1` |
/// | `SAGEBWD_PERSISTENT_SMS` | [`persistent_sms`](Tuning::persistent_sms) | n ≥ 1 |
///
/// Other variables are not kernel choices: `SAGEBWD_CACHE_DIR` (the kernel cache), `SAGEBWD_REQUIRE_NVRTC` (tests),
/// `SAGEBWD_PROFILE` and `SAGEBWD_XENT_STREAM` (the training engine).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tuning {
    /// Tensor-core kernels (the default) or the scalar reference kernels (`Gpu::set_tensor_cores`).
    pub tensor_cores: bool,
    /// A forward kernel instead of the plan's (sm_90a).
    pub forward: Option<ForwardOverride>,
    /// Head groups of the staged sagebwd backward (peak memory against time).
    pub backward_groups: GroupPolicy,
    /// The staged backward on the persistent grid (`Some(true)`) or the plain grid (`Some(false)`) instead of the
    /// plan's choice (sm_90a).
    pub backward_persistent: Option<bool>,
    /// sagebwd, d 64: dQ added by TMA tensor reduces (else row bulk reduces).
    pub sage_d64_tma_dq: bool,
    /// sagebwd, d 128: the query blocks copied by TMA inside the loop (else cp.async by every thread).
    pub sage_d128_tma_stage: bool,
    /// fpa, d 128, persistent grid: dQ added by TMA reduces (else 16 reductions per thread and tile).
    pub bf16_d128_tma_dq: bool,
    /// The persistent INT8 forward copies K̂ and Q̂ by TMA where the shape allows (else cp.async).
    pub forward_tma_kq: bool,
    /// Programmatic dependent launch of the glue kernels on sm_90+.
    pub pdl: bool,
    /// ... and of the forward's main kernel after the quantization.
    pub pdl_forward: bool,
    /// ... and of the backward's main kernels after their preprocess.
    pub pdl_backward: bool,
    /// The fused Q/K/V quantization schedules V's groups before K's (with PDL).
    pub quantize_v_first: bool,
    /// Whether the forward's quantization writes Q̂ᵀ, K̂ᵀ for the staged sagebwd backward: `None` the plan's choice
    /// (where the backward runs in one head group), else forced.
    pub qk_hat_t_in_forward: Option<bool>,
    /// D, dÔ and the zeroed dQ accumulator in one preprocess pass where the buffers allow.
    pub fused_preprocess: bool,
    /// The FP8 P·V forward's e4m3 V̂ᵀ made in the K mean's grids and the Q/K/V launch instead of two grids of its own
    /// after the INT8 quantization (`PreparePlan::v_e4m3_fused`). Off by default until a GPU has checked it.
    pub fused_v_e4m3: bool,
    /// Size the persistent grids for this many SMs (at most the GPU's): a test hook, so that verification on small
    /// shapes runs blocks that walk several work items.
    pub persistent_sms: Option<u32>,
}

impl Default for Tuning {
    fn default() -> Tuning {
        Tuning {
            tensor_cores: true,
            forward: None,
            backward_groups: GroupPolicy::Auto,
            backward_persistent: None,
            sage_d64_tma_dq: true,
            sage_d128_tma_stage: true,
            bf16_d128_tma_dq: true,
            forward_tma_kq: true,
            pdl: true,
            pdl_forward: true,
            pdl_backward: true,
            quantize_v_first: false,
            qk_hat_t_in_forward: None,
            fused_preprocess: true,
            fused_v_e4m3: false,
            persistent_sms: None,
        }
    }
}

impl Tuning {
    /// The defaults with every `SAGEBWD_*` variable of the table applied.
    pub fn from_env() -> Result<Tuning> {
        Tuning::from_vars(|name| std::env::var(name).ok())
    }

    /// [`Tuning::from_env`] over any variable source (tests).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Tuning> {
        let switch = |name: &str, default: bool| -> Result<bool> {
            match var(name).as_deref().map(str::trim) {
                None | Some("") => Ok(default),
                Some("0") => Ok(false),
                Some("1") => Ok(true),
                Some(v) => Err(Error::Backend(format!("{name}={v}: expected 0 or 1 (or unset)"))),
            }
        };
        let forced = |name: &str| -> Result<Option<bool>> {
            Ok(match var(name).as_deref().map(str::trim) {
                None | Some("") => None,
                Some(_) => Some(switch(name, false)?),
            })
        };
        let d = Tuning::default();
        Ok(Tuning {
            tensor_cores: d.tensor_cores,
            forward: match var("SAGEBWD_FORWARD_WGMMA").as_deref().map(str::trim) {
                None | Some("") => None,
                Some(v) => Some(ForwardOverride::parse(v)?),
            },
            backward_groups: GroupPolicy::parse(var("SAGEBWD_BWD_GROUPS").as_deref())?,
            backward_persistent: forced("SAGEBWD_BWD_PERSIST")?,
            sage_d64_tma_dq: switch("SAGEBWD_SAGE_TMA_DQ", d.sage_d64_tma_dq)?,
            sage_d128_tma_stage: switch("SAGEBWD_SAGE128_TMA_STAGE", d.sage_d128_tma_stage)?,
            bf16_d128_tma_dq: switch("SAGEBWD_FPA_BULK_DQ", d.bf16_d128_tma_dq)?,
            forward_tma_kq: switch("SAGEBWD_FWD_TMA_KQ", d.forward_tma_kq)?,
            pdl: switch("SAGEBWD_PDL", d.pdl)?,
            pdl_forward: switch("SAGEBWD_PDL_FWD", d.pdl_forward)?,
            pdl_backward: switch("SAGEBWD_PDL_BWD", d.pdl_backward)?,
            quantize_v_first: switch("SAGEBWD_QKV_VFIRST", d.quantize_v_first)?,
            qk_hat_t_in_forward: forced("SAGEBWD_QKT_FWD")?,
            fused_preprocess: switch("SAGEBWD_BWD_PRE_FUSE", d.fused_preprocess)?,
            fused_v_e4m3: switch("SAGEBWD_V8_FUSED", d.fused_v_e4m3)?,
            persistent_sms: match var("SAGEBWD_PERSISTENT_SMS") {
                None => None,
                Some(v) => match v.trim().parse::<u32>() {
                    Ok(n) if n > 0 => Some(n),
                    _ => {
                        return Err(Error::Backend(format!(
                            "SAGEBWD_PERSISTENT_SMS must be a positive integer (got {v:?})"
                        )))
                    }
                },
            },
        })
    }

    /// Programmatic dependent launch of the glue kernels on `arch`: compute capability 9.0 or newer.
    pub fn pdl_on(&self, arch: &str) -> bool {
        self.pdl && arch_major(arch) >= 90
    }
}

fn arch_major(arch: &str) -> u32 {
    arch.trim_start_matches("sm_")
        .chars()
        .take_while(|c| c.is_ascii_digit())
        .collect::<String>()
        .parse()
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------------------------
// Kernel flags and the paths a product mix selects
// ---------------------------------------------------------------------------------------------------------------

/// Flag bits, mirror of common.cuh.
pub(crate) const F_SMOOTH_K: i32 = 256;
pub(crate) const F_SMOOTH_Q: i32 = 512;
pub(crate) const F_DQ_CORR: i32 = 1024;
/// Launch switch of the persistent INT8 forward: K̂ and Q̂ copied by TMA (forward.cu `wsp_producer_tma`).
pub(crate) const F_TMA_KQ: i32 = 2048;

/// Kernel flags of a configuration: bit p = product p is INT8, then the switches.
pub(crate) fn flags(cfg: &Config) -> i32 {
    let mut f = 0;
    for p in Product::ALL {
        if cfg.is_int8(p) {
            f |= 1 << p.index();
        }
    }
    if cfg.smooth_k {
        f |= F_SMOOTH_K;
    }
    if cfg.smooth_q {
        f |= F_SMOOTH_Q;
    }
    if cfg.dq_smooth_k_correction {
        f |= F_DQ_CORR;
    }
    f
}

/// The three paths of `sage_fwd_sm80` (`fwd_fast_path` in forward.cu).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForwardPath {
    /// #1 and #2 INT8: K̂ and V̂ᵀ tiles staged in shared memory (double-buffered), Q̂ fragments in registers.
    StagedInt8,
    /// #1 and #2 BF16 (the fpa forward): K and V tiles staged, Q fragments in registers. Smoothing flags do not
    /// matter: BF16 products take the unsmoothed inputs.
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

/// The staged paths of `sage_bwd_main_sm80` (`bwd_fast_path` in backward_main.cu); other product mixes take the
/// gathering path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StagedBackward {
    /// #3, #4, #6, #7 INT8 and #5 BF16 (the sagebwd preset), no Q-smoothing, no dQ correction.
    Sage,
    /// #3 to #7 all BF16 (the fpa preset); the switches act on INT8 products only.
    Bf16,
}

/// Which staged path `sage_bwd_main_sm80` takes for these flags, if any.
pub fn staged_backward(flags: i32) -> Option<StagedBackward> {
    let bit = |p: Product| 1 << p.index();
    let products = bit(Product::QkBwd) | bit(Product::Dv) | bit(Product::Dp) | bit(Product::Dq) | bit(Product::Dk);
    let sage = bit(Product::QkBwd) | bit(Product::Dv) | bit(Product::Dq) | bit(Product::Dk);
    if flags & (products | F_SMOOTH_Q | F_DQ_CORR) == sage {
        Some(StagedBackward::Sage)
    } else if flags & products == 0 {
        Some(StagedBackward::Bf16)
    } else {
        None
    }
}

/// Which outputs of the quantization the selected kernel paths read. The staged (tensor-core) paths read the
/// operands in their own layouts, so the others are neither allocated nor computed: less memory and fewer bytes
/// written. An output left out has a null device address, so a kernel that read it anyway would fault rather than
/// read stale data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantNeeds {
    /// Q̂, K̂, V̂, dÔ with their scales, the K mean and the row offsets: not when every product of both passes is
    /// BF16 on the staged paths (they read the BF16 inputs only).
    pub quantized: bool,
    /// The transposed BF16 copies Qᵀ, Kᵀ, Vᵀ, dOᵀ: only the gathering and scalar paths read them.
    pub bf16_transposed: bool,
    /// V̂ and dÔ in their natural layout: only the gathering and scalar backward (and the scalar forward) read them;
    /// the staged INT8 forward reads V̂ᵀ, the staged sagebwd backward dÔᵀ and the BF16 V and dO.
    pub natural_v_do: bool,
}

impl QuantNeeds {
    /// What the forward and backward paths for these kernel flags read, on the tensor-core or the scalar kernels
    /// (the scalar kernels and the gathering paths read everything).
    pub(crate) fn for_paths(tensor_cores: bool, f: i32) -> QuantNeeds {
        if !tensor_cores {
            return QuantNeeds {
                quantized: true,
                bf16_transposed: true,
                natural_v_do: true,
            };
        }
        let (fwd, bwd) = (forward_path(f), staged_backward(f));
        let staged = fwd != ForwardPath::Gather && bwd.is_some();
        let all_bf16 = fwd == ForwardPath::StagedBf16 && bwd == Some(StagedBackward::Bf16);
        QuantNeeds {
            quantized: !all_bf16,
            bf16_transposed: !staged,
            natural_v_do: bwd.is_none(),
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Head groups of the staged sagebwd backward
// ---------------------------------------------------------------------------------------------------------------

/// How the staged sagebwd backward splits the B·H (batch, head) rows: `count` groups of `rows` rows (the last may
/// hold fewer). Each group transposes its Q̂, K̂ rows, quantizes its dO rows, and runs the main kernel and the dQ
/// postprocess on them, reusing one set of group-sized buffers (Q̂ᵀ, K̂ᵀ, dÔᵀ, the FP32 dQ accumulator): the
/// backward's transient memory is 1/count of the unsplit one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupPlan {
    pub count: usize,
    pub rows: usize,
}

/// The most groups the rule considers: each adds six launches (and a tail of the main kernel).
pub const MAX_GROUPS: usize = 16;

impl GroupPlan {
    /// All rows in one group (every path other than the staged sagebwd one without GQA).
    pub fn one(bh: usize) -> GroupPlan {
        GroupPlan { count: 1, rows: bh }
    }

    /// `count` groups as even as whole rows allow (fewer if `count` does not divide B·H well).
    pub fn split(bh: usize, count: usize) -> GroupPlan {
        let rows = bh.div_ceil(count.clamp(1, bh));
        GroupPlan {
            count: bh.div_ceil(rows),
            rows,
        }
    }

    /// The plan for shape `s` (with or without the causal mask) under `policy`.
    pub fn of(s: &Shape, causal: bool, policy: GroupPolicy) -> GroupPlan {
        match policy {
            GroupPolicy::Count(n) => GroupPlan::split(s.batch * s.heads_q, n),
            GroupPolicy::Lean => choose_groups(s),
            GroupPolicy::Auto => free_groups(s, causal).unwrap_or(GroupPlan::one(s.batch * s.heads_q)),
        }
    }

    /// Sets of group buffers live at once: one per stream, two streams when split.
    pub fn buffer_sets(&self) -> usize {
        self.count.min(2)
    }
}

/// The head-grouped backward ([`choose_groups`]) where it costs no time against one group, so that
/// [`GroupPolicy::Auto`] takes it: without the causal mask from N = 8192 on, while each group still gives the main
/// kernel at least [`FREE_GROUP_BLOCKS`] blocks (None elsewhere; checked in that order, so the causal training path,
/// which runs this per layer, never builds the plans). Below N 8k and with the mask the groups' tails are no longer
/// hidden by long, evenly loaded main kernels (N 1k: +11 to +23 % backward time).
pub fn free_groups(s: &Shape, causal: bool) -> Option<GroupPlan> {
    if causal || s.n_q < 8192 {
        return None;
    }
    let plan = choose_groups(s);
    (plan.rows * s.n_k.div_ceil(BLOCK_KV) >= FREE_GROUP_BLOCKS).then_some(plan)
}

/// The fewest main-kernel blocks (key blocks × rows) per head group for [`free_groups`]: the least measured
/// (about two per SM of an H200).
pub const FREE_GROUP_BLOCKS: usize = 256;

/// Peak bytes of the staged sagebwd forward + backward without GQA, split into `plan`, counted as the bench counts
/// (one input set Q, K, V, dO + everything the passes allocate): the inputs; O and the two LSE vectors; the saved Q̂,
/// K̂ with their scales, K_m and b_r; D, dQ, dK, dV and s_dO; the group buffers, one set per stream. The backward's
/// peak is while the groups run: then all of these are live (the forward's peak, with V̂ᵀ, is lower).
pub fn sage_peak_bytes(s: &Shape, plan: GroupPlan) -> usize {
    let (q, kv, d) = (s.q_len(), s.kv_len(), s.head_dim);
    let bh = s.batch * s.heads_q;
    let rows = bh * s.n_q;
    let (nqb, nkb) = (s.n_q.div_ceil(BLOCK_Q), s.n_k.div_ceil(BLOCK_KV));
    let (pq, pk) = (crate::runtime::padded_q(s.n_q), crate::runtime::padded_k(s.n_k));
    let inputs = 2 * (2 * q + 2 * kv);
    let forward_out = 2 * q + 2 * 4 * rows;
    let saved = q + kv + 4 * bh * (nqb + 2 * nkb) + 4 * bh * d + 4 * rows + 4;
    let backward_full = 4 * rows + 2 * q + 2 * 2 * kv + 4 * bh * nqb;
    let group = plan.rows * d * (2 * pq + pk) + 4 * plan.rows * s.n_q * d + 4;
    inputs + forward_out + saved + backward_full + plan.buffer_sets() * group
}

/// The cuDNN-equivalent budget: the inputs, O, dQ, dK, dV, one FP32 dQ accumulator and two FP32 row vectors (LSE
/// and D): what cuDNN's SDPA holds at its peak (measured 642–644 MiB at B·N = 16384, H·d = 2048: 640 MiB of tensors
/// + 2 or 4 MiB of row vectors at d = 128 or 64).
pub fn peak_budget_bytes(s: &Shape) -> usize {
    let (q, kv) = (s.q_len(), s.kv_len());
    let rows = s.batch * s.heads_q * s.n_q;
    2 * (2 * q + 2 * kv) + 2 * q + (2 * q + 2 * 2 * kv) + 4 * q + 2 * 4 * rows
}

/// The rule: the fewest groups (at most [`MAX_GROUPS`]) whose peak ([`sage_peak_bytes`]) fits the
/// cuDNN-equivalent budget ([`peak_budget_bytes`]); if none does (tiny problems, where the row vectors weigh more),
/// the most. Fewest, because each group adds launches and a main-kernel tail; the two streams hide most of that.
pub fn choose_groups(s: &Shape) -> GroupPlan {
    let bh = s.batch * s.heads_q;
    let budget = peak_budget_bytes(s);
    let mut plans: Vec<GroupPlan> = (1..=MAX_GROUPS.min(bh)).map(|n| GroupPlan::split(bh, n)).collect();
    plans.dedup();
    let fits = plans.iter().copied().find(|&p| sage_peak_bytes(s, p) <= budget);
    fits.unwrap_or_else(|| plans.last().copied().unwrap_or(GroupPlan::one(bh)))
}

// ---------------------------------------------------------------------------------------------------------------
// The plan
// ---------------------------------------------------------------------------------------------------------------

/// How a warp-specialized BF16 forward kernel walks the work: one block per query-block pair and (batch·head), or
/// min(tiles, SMs) blocks that each walk tiles, heaviest first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16WsGrid {
    Pairs,
    Persistent,
}

/// The forward kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForwardKernel {
    /// `sage_fwd_reference`: the scalar reference kernel (dp4a / FP32).
    Scalar,
    /// `sage_fwd_sm80`: `mma.sync`, any sm_80+ GPU, on one of its three paths.
    Mma(ForwardPath),
    /// A warp-specialized `wgmma` BF16 kernel (sm_90a, both forward products BF16).
    Bf16Ws { name: &'static CStr, grid: Bf16WsGrid },
    /// A persistent warp-specialized `wgmma` INT8 kernel (sm_90a, both forward products INT8, no Q-smoothing):
    /// K̂ and Q̂ by TMA where `tma_kq` (else cp.async), O by TMA stores where `tma_o`, launched with PDL after the
    /// quantization where `pdl`.
    Int8Persistent {
        name: &'static CStr,
        tma_kq: bool,
        tma_o: bool,
        pdl: bool,
    },
}

impl ForwardKernel {
    pub fn name(&self) -> &'static str {
        match self {
            ForwardKernel::Scalar => "sage_fwd_reference",
            ForwardKernel::Mma(_) => "sage_fwd_sm80",
            ForwardKernel::Bf16Ws { name, .. } | ForwardKernel::Int8Persistent { name, .. } => {
                name.to_str().unwrap_or("?")
            }
        }
    }
}

/// The preparation: which quantized tensors are made and how.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PreparePlan {
    /// What the selected kernels read.
    pub needs: QuantNeeds,
    /// The forward's quantization also writes Q̂ᵀ, K̂ᵀ for the backward (which then skips its transposes).
    pub qk_hat_t_in_forward: bool,
    /// The fused Q/K/V quantization runs V's groups first.
    pub v_first: bool,
    /// V̂ᵀ in e4m3 with one scale per channel for the FP8 P·V forward: `sage_v_amax_partial` and
    /// `sage_quantize_v_e4m3` after the INT8 quantization, over its V̂ᵀ.
    pub v_e4m3: bool,
    /// ... made instead in the preparation's own grids, in place of the INT8 V̂ᵀ and V̂: the channel amaxes in
    /// `sage_k_mean_partial_v8`'s grid, the scales in `sage_k_mean_v8`'s, the bytes in `sage_quantize_qkv`'s V groups
    /// (or, where the fused launch does not apply, `sage_quantize_v_e4m3`). [`Tuning::fused_v_e4m3`].
    pub v_e4m3_fused: bool,
}

/// The backward's main kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackwardMain {
    /// `sage_bwd_main_reference`: the scalar reference kernel.
    Scalar,
    /// `sage_bwd_main_sm80`: `mma.sync`, any sm_80+ GPU (staged or gathering, by the product mix).
    Mma,
    /// A named sm_90a kernel of a staged path.
    Named(&'static CStr),
}

impl BackwardMain {
    pub fn name(&self) -> &'static str {
        match self {
            BackwardMain::Scalar => "sage_bwd_main_reference",
            BackwardMain::Mma => "sage_bwd_main_sm80",
            BackwardMain::Named(n) => n.to_str().unwrap_or("?"),
        }
    }
}

/// The backward: preprocess, main kernel (and how it is fed), head groups, postprocess.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackwardPlan {
    /// The staged path of the product mix (tensor cores only), or None: gathering / scalar.
    pub staged: Option<StagedBackward>,
    pub main: BackwardMain,
    /// Dynamic shared memory of the main kernel, bytes.
    pub main_smem: usize,
    /// The persistent grid (min(items, resident blocks)) instead of one block per key block and head.
    pub persistent: bool,
    /// The main kernel takes the dQ accumulator's tensor map (dQ by TMA reduces): fpa d 128 persistent.
    pub bf16_tma_dq: bool,
    /// The d 64 sage plain-grid kernel with dQ by TMA reduces.
    pub sage_tma_dq: bool,
    /// The d 128 sage plain-grid kernel with its query blocks copied by TMA.
    pub sage_tma_stage: bool,
    /// The main kernel writes BF16 dK, dV itself (staged, no GQA); else FP32 partials summed by `sage_bwd_post_dkdv`.
    pub direct_dkdv: bool,
    /// Launched with PDL after its preprocess.
    pub main_pdl: bool,
    /// Head groups (the staged sagebwd path without GQA; one group elsewhere).
    pub groups: GroupPlan,
    /// The dQ postprocess `sage_bwd_post_dq_int8` (PDL after the main kernel), else `sage_bwd_post_dq`.
    pub post_dq_sage: bool,
    /// D, dÔ and the zeroed dQ accumulator in one pass (`sage_bwd_pre_do`) where the buffers allow (one group, every
    /// query block full, aligned buffers; decided at launch from the addresses), else `sage_bwd_delta` + the dO
    /// quantization.
    pub fused_preprocess: bool,
}

/// Every stage that runs for one (architecture, configuration, shape, mask, tuning).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelPlan {
    pub arch: String,
    pub flags: i32,
    pub prepare: PreparePlan,
    pub forward: ForwardKernel,
    pub backward: BackwardPlan,
    /// The glue kernels launched with PDL.
    pub pdl: bool,
}

impl KernelPlan {
    /// The plan for `cfg` on `shape` (with the causal mask or not) on a GPU compiled for `arch` (`sm_90a` for
    /// Hopper, `sm_80`, `sm_86`, `sm_89`, … otherwise) under `tuning`.
    pub fn choose(arch: &str, cfg: &Config, shape: &Shape, causal: bool, tuning: &Tuning) -> KernelPlan {
        let fl = flags(cfg);
        let hopper = arch == "sm_90a";
        // §10.2's e4m3 P·V (the forward of the `p-e4m3*` variants): the persistent kernel with the FP8 product mix.
        let fp8_pv = cfg.has_fp8_forward_kernel() && !cfg.has_kernels();
        let tc = tuning.tensor_cores;
        let pdl = tuning.pdl_on(arch);
        let backward = choose_backward(hopper, fl, shape, causal, tuning, pdl);
        let forward = if !tc {
            ForwardKernel::Scalar
        } else {
            let path = forward_path(fl);
            let ws = match path {
                ForwardPath::StagedBf16 if hopper => bf16_ws_kernel(shape.head_dim, shape.n_q, causal, tuning.forward),
                ForwardPath::StagedInt8 if hopper && fl & F_SMOOTH_Q == 0 => {
                    int8_persistent_kernel(tuning.forward, fp8_pv).map(|name| ForwardKernel::Int8Persistent {
                        name,
                        tma_kq: tuning.forward_tma_kq && tma_kq_fits(shape),
                        tma_o: shape.head_dim == 128,
                        pdl: pdl && tuning.pdl_forward,
                    })
                }
                _ => None,
            };
            ws.unwrap_or(ForwardKernel::Mma(path))
        };
        let sage_backward = tc && backward.staged == Some(StagedBackward::Sage);
        let prepare = PreparePlan {
            needs: QuantNeeds::for_paths(tc, fl),
            qk_hat_t_in_forward: sage_backward && tuning.qk_hat_t_in_forward.unwrap_or(backward.groups.count == 1),
            v_first: pdl && tuning.quantize_v_first,
            v_e4m3: fp8_pv,
            v_e4m3_fused: fp8_pv && tuning.fused_v_e4m3,
        };
        KernelPlan {
            arch: arch.to_string(),
            flags: fl,
            prepare,
            forward,
            backward,
            pdl,
        }
    }
}

/// The warp-specialized BF16 forward (`fpa`): the head-grouped persistent kernel at d 128 up to N 4k (2k causal), where
/// reading each head's K, V from DRAM about once pays; the snake-order persistent kernel at every causal shape (its
/// order balances the heaviest-first tiles), at every d 64 shape and at N ≤ 1k; else the pairs grid, whose pairs of one
/// head side by side reuse K, V in L2 at long N. An INT8 override leaves the default; `mma` gives None.
fn bf16_ws_kernel(head_dim: usize, n_q: usize, causal: bool, forced: Option<ForwardOverride>) -> Option<ForwardKernel> {
    use Bf16WsGrid::{Pairs, Persistent};
    let persistent = ForwardKernel::Bf16Ws {
        name: c"sage_fwd_sm90_bf16_persistent",
        grid: Persistent,
    };
    let grouped = ForwardKernel::Bf16Ws {
        name: c"sage_fwd_sm90_bf16_persistent_grouped",
        grid: Persistent,
    };
    let pairs = ForwardKernel::Bf16Ws {
        name: c"sage_fwd_sm90_bf16_pairs",
        grid: Pairs,
    };
    Some(match forced {
        Some(ForwardOverride::Mma) => return None,
        Some(ForwardOverride::Bf16Pairs) => pairs,
        Some(ForwardOverride::Bf16Persistent) => persistent,
        Some(ForwardOverride::Bf16HeadGrouped) => grouped,
        _ if head_dim == 128 && n_q <= if causal { 2048 } else { 4096 } => grouped,
        _ if causal || head_dim == 64 || n_q <= 1024 => persistent,
        _ => pairs,
    })
}

/// The persistent INT8 forward at every shape where it applies (its second consumer warpgroup starts each tile once
/// the first one's scores are done: no ping-pong turns, whose barriers cost more than the overlap they bought once the
/// producer's copies moved to TMA). `mma` gives None; a BF16 override leaves the default.
fn int8_persistent_kernel(forced: Option<ForwardOverride>, fp8_pv: bool) -> Option<&'static CStr> {
    match forced {
        Some(ForwardOverride::Mma) => None,
        _ if fp8_pv => Some(FP8_PV_FORWARD),
        _ => Some(c"sage_fwd_sm90_int8_persistent"),
    }
}

/// The persistent forward with §10.2's e4m3 P·V (sm90/forward_fp8.cu).
pub const FP8_PV_FORWARD: &CStr = c"sage_fwd_sm90_fp8_pv_persistent";

/// Whether the persistent INT8 forward may copy K̂ and Q̂ by TMA: n_k a non-zero multiple of 16 (K̂'s permuted view
/// folds the heads' 16-key groups together) and rows that fit the kernel's 32-bit row arithmetic.
pub(crate) fn tma_kq_fits(s: &Shape) -> bool {
    let rows = |heads: usize, n: usize| heads as i64 * s.batch as i64 * n as i64;
    s.n_k.is_multiple_of(16)
        && s.n_k > 0
        && s.n_q > 0
        && rows(s.heads_q, s.n_q) + 2 * 64 < 1 << 31
        && rows(s.heads_kv, s.n_k) < 1 << 31
}

fn choose_backward(hopper: bool, fl: i32, s: &Shape, causal: bool, t: &Tuning, pdl: bool) -> BackwardPlan {
    let d = s.head_dim;
    let staged = if t.tensor_cores { staged_backward(fl) } else { None };
    let sage = staged == Some(StagedBackward::Sage);
    let bf16 = staged == Some(StagedBackward::Bf16);
    let sage_d64_tma_dq = d == 64 && t.sage_d64_tma_dq;
    // The persistent grid where it measured faster than the plain one: fpa at d 128 at every N (its dQ by TMA
    // reduces), fpa at d 64 up to N 4k; sagebwd at d 64 only without the TMA-dQ plain-grid kernel, at causal
    // N ≤ 1k; sagebwd at d 128 never (its plain-grid kernel is faster at every N).
    let persistent_default = match (staged, d) {
        (Some(StagedBackward::Bf16), 128) => true,
        (Some(StagedBackward::Bf16), 64) => s.n_q <= 4096,
        (Some(StagedBackward::Sage), 64) => !sage_d64_tma_dq && causal && s.n_q <= 1024,
        _ => false,
    };
    let persistent = hopper && staged.is_some() && t.backward_persistent.unwrap_or(persistent_default);
    let bf16_tma_dq = persistent && bf16 && d == 128 && t.bf16_d128_tma_dq;
    let sage_plain = !persistent && sage && hopper && (d == 64 || d == 128);
    let sage_tma_dq = sage_plain && sage_d64_tma_dq;
    let rows = s.batch * s.heads_q;
    let sage_tma_stage =
        sage_plain && d == 128 && s.n_q.is_multiple_of(BLOCK_Q) && rows * s.n_q < 1 << 31 && t.sage_d128_tma_stage;
    let main = if persistent {
        BackwardMain::Named(if sage {
            c"sage_bwd_main_sm90_int8_persistent"
        } else if bf16_tma_dq {
            c"sage_bwd_main_sm90_bf16_persistent_tma_dq"
        } else {
            c"sage_bwd_main_sm90_bf16_persistent"
        })
    } else if sage_tma_stage {
        BackwardMain::Named(c"sage_bwd_main_sm90_int8_tma_stage")
    } else if sage_tma_dq {
        BackwardMain::Named(c"sage_bwd_main_sm90_int8_tma_dq")
    } else if sage_plain {
        BackwardMain::Named(c"sage_bwd_main_sm90_int8")
    } else if t.tensor_cores {
        BackwardMain::Mma
    } else {
        BackwardMain::Scalar
    };
    let main_smem = match staged {
        Some(path) if bf16_tma_dq => staged_backward_smem_bytes(d, path) + bf16_bulk_staging_bytes(d),
        Some(path) if persistent || sage_plain => staged_backward_smem_bytes(d, path) + sage_staging_bytes(d, path),
        Some(path) => staged_backward_smem_bytes(d, path),
        None => backward_smem_bytes(d),
    };
    let groups = if sage && s.heads_q == s.heads_kv {
        GroupPlan::of(s, causal, t.backward_groups)
    } else {
        GroupPlan::one(rows)
    };
    BackwardPlan {
        staged,
        main,
        main_smem,
        persistent,
        bf16_tma_dq,
        sage_tma_dq,
        sage_tma_stage,
        direct_dkdv: staged.is_some() && s.heads_q == s.heads_kv,
        main_pdl: t.tensor_cores && pdl && t.pdl_backward,
        groups,
        post_dq_sage: sage,
        fused_preprocess: t.fused_preprocess,
    }
}

/// Bytes of `BackwardShared` (backward_main.cu): the P and dS tiles, per-row lse2 and D, Q_m, β, the dS column sums
/// and the reduction scratch. The kernel traps if it is given less.
pub fn backward_smem_bytes(head_dim: usize) -> usize {
    4 * (2 * BLOCK_Q * BLOCK_KV + 2 * BLOCK_Q + head_dim + 2 * BLOCK_KV + THREADS as usize / 32)
}

/// Dynamic shared memory of a staged path (`StagedLayout<…>::bytes`): the key block's tiles (sage: K̂, K̂ᵀ of 128 × d
/// bytes and BF16 V; bf16: BF16 K and V; 4 · 128 · d bytes either way); two query-block stages of operand tiles (sage:
/// Q̂, BF16 dO, dÔᵀ, Q̂ᵀ, 5 · 64 · d bytes; bf16: BF16 Q and dO, 4 · 64 · d); two blocks of 64 L and D values; two dS
/// tiles (sage: dŜ, 64 × 128 bytes; bf16: bf16(dS)ᵀ, twice that); the amax scratch; 1024 bytes of slack, so that the
/// kernel can round its start up to the 1024-byte boundary wgmma's swizzled tiles need. The sage path at d = 64 has a
/// third stage and a second amax scratch (its pipelined query loop on sm_90a; the sm_80 build uses two stages and
/// leaves the rest unused). Its sm_90a kernels need [`sage_staging_bytes`] more.
pub fn staged_backward_smem_bytes(head_dim: usize, path: StagedBackward) -> usize {
    let (stage_operands, ds_tile) = match path {
        StagedBackward::Sage => (5 * BLOCK_Q * head_dim, BLOCK_Q * BLOCK_KV),
        StagedBackward::Bf16 => (4 * BLOCK_Q * head_dim, 2 * BLOCK_Q * BLOCK_KV),
    };
    let stages = if path == StagedBackward::Sage && head_dim == 64 {
        3
    } else {
        2
    };
    let rows = 2 * BLOCK_Q * 4;
    let red = 2 * (THREADS as usize / 32) * 4;
    let align_slack = 1024;
    4 * BLOCK_KV * head_dim + stages * stage_operands + 2 * rows + 2 * ds_tile + (stages - 1) * red + align_slack
}

/// The two dQ staging tiles of the sage path's sm_90a kernels (persistent and plain grid), after the staged layout:
/// at d = 64, 64 rows of d FP32 + 32 bytes each; at d = 128, 64 rows of d FP32 each and the pipelined query loop's
/// second amax scratch (8 warps × 2 floats: its one block barrier per tile); else 0.
pub fn sage_staging_bytes(head_dim: usize, path: StagedBackward) -> usize {
    match (path, head_dim) {
        (StagedBackward::Sage, 64) => 2 * BLOCK_Q * (4 * head_dim + 32),
        (StagedBackward::Sage, 128) => 2 * BLOCK_Q * 4 * head_dim + 2 * (THREADS as usize / 32) * 4,
        _ => 0,
    }
}

/// The dQ staging area of `sage_bwd_main_sm90_bf16_persistent_tma_dq` (`Bf16BulkLayout` in backward_main.cu): the staged layout's
/// end rounded up to 1024 bytes, then 8 warps × 16 rows × 64 FP32, beyond the staged bytes.
pub fn bf16_bulk_staging_bytes(head_dim: usize) -> usize {
    let base = staged_backward_smem_bytes(head_dim, StagedBackward::Bf16) - 1024; // less the alignment slack
    base.next_multiple_of(1024) - base + (THREADS as usize / 32) * 16 * 64 * 4
}

// ---------------------------------------------------------------------------------------------------------------
// Printing
// ---------------------------------------------------------------------------------------------------------------

impl fmt::Display for KernelPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = &self.prepare;
        let yes = |b: bool, s: &'static str| if b { s } else { "" };
        if p.needs.quantized {
            let smooth = if p.v_e4m3_fused {
                "sage_k_mean_partial_v8 → sage_k_mean_v8 → "
            } else if self.flags & F_SMOOTH_K != 0 {
                "sage_k_mean_partial → sage_k_mean → "
            } else {
                ""
            };
            writeln!(
                f,
                "preparation    {smooth}sage_quantize_qkv{}{}{}{}",
                yes(p.v_e4m3_fused, "_v8"),
                yes(p.qk_hat_t_in_forward, " (+ Q̂ᵀ, K̂ᵀ for the backward)"),
                yes(p.needs.bf16_transposed, " (+ BF16 transposes)"),
                if p.v_e4m3_fused {
                    " (V̂ᵀ in e4m3 in place of the INT8 one; sage_quantize_v_e4m3_scaled where the groups are not full)"
                } else if p.v_e4m3 {
                    " → sage_v_amax_partial → sage_quantize_v_e4m3 (V̂ᵀ in e4m3)"
                } else {
                    ""
                }
            )?;
        } else {
            writeln!(f, "preparation    none (every product BF16)")?;
        }
        write!(f, "forward        {}", self.forward.name())?;
        match self.forward {
            ForwardKernel::Scalar => writeln!(f, " (scalar reference)")?,
            ForwardKernel::Mma(path) => writeln!(
                f,
                " (mma.sync, {} path)",
                match path {
                    ForwardPath::StagedInt8 => "staged INT8",
                    ForwardPath::StagedBf16 => "staged BF16",
                    ForwardPath::Gather => "gathering",
                }
            )?,
            ForwardKernel::Bf16Ws { grid, .. } => writeln!(
                f,
                " (wgmma, warp-specialized, {})",
                match grid {
                    Bf16WsGrid::Pairs => "a block per query-block pair",
                    Bf16WsGrid::Persistent => "persistent",
                }
            )?,
            ForwardKernel::Int8Persistent { tma_kq, tma_o, pdl, .. } => writeln!(
                f,
                " (wgmma, warp-specialized, persistent; K̂/Q̂ by {}{}{})",
                if tma_kq { "TMA" } else { "cp.async" },
                yes(tma_o, ", O by TMA"),
                yes(pdl, ", PDL")
            )?,
        }
        let b = &self.backward;
        let pre = if !p.needs.quantized {
            "sage_bwd_delta (D)"
        } else if b.groups.count > 1 {
            "sage_bwd_delta (D), s_dO; each head group quantizes its dÔᵀ rows"
        } else if b.fused_preprocess && !p.needs.bf16_transposed {
            "sage_bwd_pre_do (D, dÔ, zeroed dQ accumulator in one pass where aligned; else sage_bwd_delta + dO quantization)"
        } else {
            "sage_bwd_delta (D) + dO quantization"
        };
        writeln!(f, "backward pre   {pre}")?;
        writeln!(
            f,
            "backward main  {} ({}{}{}{}{}, {} B shared memory)",
            b.main.name(),
            match b.staged {
                Some(StagedBackward::Sage) => "staged sagebwd path",
                Some(StagedBackward::Bf16) => "staged BF16 path",
                None if matches!(b.main, BackwardMain::Scalar) => "scalar reference",
                None => "gathering path",
            },
            yes(b.persistent, ", persistent grid"),
            yes(b.bf16_tma_dq || b.sage_tma_dq, ", dQ by TMA reduces"),
            yes(b.sage_tma_stage, ", query blocks by TMA"),
            yes(b.main_pdl, ", PDL"),
            b.main_smem
        )?;
        if b.groups.count > 1 {
            writeln!(
                f,
                "head groups    {} of {} (batch, head) rows, two streams",
                b.groups.count, b.groups.rows
            )?;
        }
        write!(
            f,
            "backward post  {}{}",
            if b.post_dq_sage {
                "sage_bwd_post_dq_int8"
            } else {
                "sage_bwd_post_dq"
            },
            yes(!b.direct_dkdv, " + sage_bwd_post_dkdv")
        )
    }
}

/// The kernel map of `docs/ARCHITECTURE.md`: for each preset, architecture, head dimension and mask, the forward and
/// backward main kernels at N = 1k … 16k (adjacent N with the same kernels merged), under the default tuning.
pub fn kernel_map_markdown() -> String {
    let ns = [1024, 2048, 4096, 8192, 16384];
    let mut out = String::from(
        "| preset | arch | d | causal | N | forward | backward main | head groups |\n|---|---|---|---|---|---|---|---|\n");
    let label = |n: usize| format!("{}k", n / 1024);
    for preset in ["fpa", "sagebwd", "int8-all"] {
        let cfg = Config::preset(preset).expect("built-in preset");
        for arch in ["sm_90a", "sm_80"] {
            for d in [64, 128] {
                for causal in [false, true] {
                    let row = |n: usize| {
                        let s = Shape {
                            batch: 16384 / n,
                            heads_q: 2048 / d,
                            heads_kv: 2048 / d,
                            n_q: n,
                            n_k: n,
                            head_dim: d,
                        };
                        let p = KernelPlan::choose(arch, &cfg, &s, causal, &Tuning::default());
                        let groups = if p.backward.groups.count > 1 {
                            format!("{}", p.backward.groups.count)
                        } else {
                            "1".into()
                        };
                        (p.forward.name(), p.backward.main.name(), groups)
                    };
                    let mut i = 0;
                    while i < ns.len() {
                        let r = row(ns[i]);
                        let mut j = i;
                        while j + 1 < ns.len() && row(ns[j + 1]) == r {
                            j += 1;
                        }
                        let range = if i == j {
                            label(ns[i])
                        } else {
                            format!("{}–{}", label(ns[i]), label(ns[j]))
                        };
                        out += &format!(
                            "| `{preset}` | {arch} | {d} | {} | {range} | `{}` | `{}` | {} |\n",
                            if causal { "yes" } else { "no" },
                            r.0,
                            r.1,
                            r.2
                        );
                        i = j + 1;
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(n: usize, d: usize, gqa: usize) -> Shape {
        Shape {
            batch: 16384 / n,
            heads_q: 2048 / d,
            heads_kv: 2048 / d / gqa,
            n_q: n,
            n_k: n,
            head_dim: d,
        }
    }

    fn plan(preset: &str, arch: &str, n: usize, d: usize, causal: bool) -> KernelPlan {
        KernelPlan::choose(
            arch,
            &Config::preset(preset).unwrap(),
            &shape(n, d, 1),
            causal,
            &Tuning::default(),
        )
    }

    /// The plan as a table: (preset, arch, N, d, causal) → (forward, backward main, head groups; 0: several).
    #[test]
    fn the_plan_table() {
        // (preset, arch, N, d, causal, forward, backward main, head groups)
        type Case = (
            &'static str,
            &'static str,
            usize,
            usize,
            bool,
            &'static str,
            &'static str,
            usize,
        );
        let cases: &[Case] = &[
            (
                "sagebwd",
                "sm_90a",
                4096,
                128,
                true,
                "sage_fwd_sm90_int8_persistent",
                "sage_bwd_main_sm90_int8_tma_stage",
                1,
            ),
            (
                "sagebwd",
                "sm_90a",
                16384,
                128,
                false,
                "sage_fwd_sm90_int8_persistent",
                "sage_bwd_main_sm90_int8_tma_stage",
                0,
            ),
            (
                "sagebwd",
                "sm_90a",
                1024,
                64,
                true,
                "sage_fwd_sm90_int8_persistent",
                "sage_bwd_main_sm90_int8_tma_dq",
                1,
            ),
            (
                "sagebwd",
                "sm_80",
                4096,
                128,
                true,
                "sage_fwd_sm80",
                "sage_bwd_main_sm80",
                1,
            ),
            (
                "fpa",
                "sm_90a",
                1024,
                128,
                false,
                "sage_fwd_sm90_bf16_persistent_grouped",
                "sage_bwd_main_sm90_bf16_persistent_tma_dq",
                1,
            ),
            (
                "fpa",
                "sm_90a",
                8192,
                128,
                false,
                "sage_fwd_sm90_bf16_pairs",
                "sage_bwd_main_sm90_bf16_persistent_tma_dq",
                1,
            ),
            (
                "fpa",
                "sm_90a",
                4096,
                128,
                true,
                "sage_fwd_sm90_bf16_persistent",
                "sage_bwd_main_sm90_bf16_persistent_tma_dq",
                1,
            ),
            (
                "fpa",
                "sm_90a",
                2048,
                128,
                true,
                "sage_fwd_sm90_bf16_persistent_grouped",
                "sage_bwd_main_sm90_bf16_persistent_tma_dq",
                1,
            ),
            (
                "fpa",
                "sm_90a",
                16384,
                128,
                true,
                "sage_fwd_sm90_bf16_persistent",
                "sage_bwd_main_sm90_bf16_persistent_tma_dq",
                1,
            ),
            (
                "fpa",
                "sm_90a",
                16384,
                64,
                false,
                "sage_fwd_sm90_bf16_persistent",
                "sage_bwd_main_sm80",
                1,
            ),
            (
                "fpa",
                "sm_90a",
                4096,
                64,
                false,
                "sage_fwd_sm90_bf16_persistent",
                "sage_bwd_main_sm90_bf16_persistent",
                1,
            ),
            (
                "fpa",
                "sm_90a",
                8192,
                64,
                false,
                "sage_fwd_sm90_bf16_persistent",
                "sage_bwd_main_sm80",
                1,
            ),
            (
                "fpa",
                "sm_80",
                1024,
                64,
                false,
                "sage_fwd_sm80",
                "sage_bwd_main_sm80",
                1,
            ),
            (
                "int8-all",
                "sm_90a",
                4096,
                128,
                false,
                "sage_fwd_sm90_int8_persistent",
                "sage_bwd_main_sm80",
                1,
            ),
        ];
        for &(preset, arch, n, d, causal, fwd, bwd, groups) in cases {
            let p = plan(preset, arch, n, d, causal);
            let what = format!("{preset} {arch} N {n} d {d} causal {causal}");
            assert_eq!(p.forward.name(), fwd, "{what}");
            assert_eq!(p.backward.main.name(), bwd, "{what}");
            if groups == 0 {
                assert!(p.backward.groups.count > 1, "{what}: head groups expected");
            } else {
                assert_eq!(p.backward.groups.count, groups, "{what}");
            }
        }
    }

    #[test]
    fn q_smoothing_and_gqa_change_the_plan() {
        let mut cfg = Config::sagebwd();
        cfg.smooth_q = true;
        let p = KernelPlan::choose("sm_90a", &cfg, &shape(4096, 128, 1), false, &Tuning::default());
        assert_eq!(p.forward, ForwardKernel::Mma(ForwardPath::StagedInt8));
        assert_eq!(
            p.backward.main,
            BackwardMain::Mma,
            "Q-smoothing leaves the staged sagebwd backward"
        );
        let gqa = KernelPlan::choose(
            "sm_90a",
            &Config::sagebwd(),
            &shape(16384, 128, 4),
            false,
            &Tuning::default(),
        );
        assert_eq!(gqa.backward.groups.count, 1, "GQA runs in one group");
        assert!(!gqa.backward.direct_dkdv);
        // N_q not a multiple of the query block: the d 128 kernel without TMA staging
        let ragged = Shape {
            n_q: 1000,
            ..shape(1024, 128, 1)
        };
        let p = KernelPlan::choose("sm_90a", &Config::sagebwd(), &ragged, false, &Tuning::default());
        assert_eq!(p.backward.main.name(), "sage_bwd_main_sm90_int8");
    }

    #[test]
    fn overrides_reach_the_plan() {
        let t = Tuning {
            forward: Some(ForwardOverride::Mma),
            backward_persistent: Some(true),
            ..Tuning::default()
        };
        let p = KernelPlan::choose("sm_90a", &Config::sagebwd(), &shape(4096, 128, 1), false, &t);
        assert_eq!(p.forward, ForwardKernel::Mma(ForwardPath::StagedInt8));
        assert_eq!(p.backward.main.name(), "sage_bwd_main_sm90_int8_persistent");
        let scalar = Tuning {
            tensor_cores: false,
            ..Tuning::default()
        };
        let p = KernelPlan::choose("sm_90a", &Config::sagebwd(), &shape(4096, 128, 1), false, &scalar);
        assert_eq!(
            (p.forward, p.backward.main),
            (ForwardKernel::Scalar, BackwardMain::Scalar)
        );
        assert_eq!(
            p.prepare.needs,
            QuantNeeds {
                quantized: true,
                bf16_transposed: true,
                natural_v_do: true
            }
        );
        let lean = Tuning {
            backward_groups: GroupPolicy::Lean,
            ..Tuning::default()
        };
        let p = KernelPlan::choose("sm_90a", &Config::sagebwd(), &shape(1024, 128, 1), false, &lean);
        assert!(p.backward.groups.count > 1 && !p.prepare.qk_hat_t_in_forward);
    }

    #[test]
    fn tuning_from_variables_rejects_garbage() {
        let vars = |pairs: &'static [(&'static str, &'static str)]| {
            move |name: &str| pairs.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string())
        };
        assert_eq!(Tuning::from_vars(vars(&[])).unwrap(), Tuning::default());
        let t = Tuning::from_vars(vars(&[
            ("SAGEBWD_FORWARD_WGMMA", "bf16-pairs"),
            ("SAGEBWD_BWD_PERSIST", "0"),
            ("SAGEBWD_PDL", "0"),
            ("SAGEBWD_PERSISTENT_SMS", "4"),
        ]))
        .unwrap();
        assert_eq!(t.forward, Some(ForwardOverride::Bf16Pairs));
        assert_eq!(t.backward_persistent, Some(false));
        assert!(!t.pdl && !t.pdl_on("sm_90a"));
        assert_eq!(t.persistent_sms, Some(4));
        for bad in [
            ("SAGEBWD_FORWARD_WGMMA", "wsp9"),
            ("SAGEBWD_PDL", "yes"),
            ("SAGEBWD_BWD_GROUPS", "0"),
            ("SAGEBWD_PERSISTENT_SMS", "0"),
            ("SAGEBWD_QKT_FWD", "2"),
        ] {
            let e = Tuning::from_vars(|n| (n == bad.0).then(|| bad.1.to_string()))
                .unwrap_err()
                .to_string();
            assert!(e.contains(bad.0), "{bad:?}: {e}");
        }
        for (name, o) in ForwardOverride::NAMES {
            assert_eq!(ForwardOverride::parse(name).unwrap(), o);
            assert_eq!(o.name(), name);
        }
    }

    #[test]
    fn fused_e4m3_v_only_for_the_fp8_forward_and_only_when_asked() {
        let fp8 = Config::preset("p-e4m3").unwrap();
        let on = Tuning::from_vars(|n| (n == "SAGEBWD_V8_FUSED").then(|| "1".to_string())).unwrap();
        assert!(on.fused_v_e4m3 && !Tuning::default().fused_v_e4m3);
        let s = shape(1024, 128, 2);
        let default = KernelPlan::choose("sm_90a", &fp8, &s, false, &Tuning::default());
        assert!(default.prepare.v_e4m3 && !default.prepare.v_e4m3_fused);
        assert!(
            default
                .to_string()
                .contains("sage_v_amax_partial → sage_quantize_v_e4m3"),
            "{default}"
        );
        let fused = KernelPlan::choose("sm_90a", &fp8, &s, true, &on);
        assert!(fused.prepare.v_e4m3 && fused.prepare.v_e4m3_fused);
        assert!(
            fused
                .to_string()
                .contains("sage_k_mean_partial_v8 → sage_k_mean_v8 → sage_quantize_qkv_v8"),
            "{fused}"
        );
        // No other configuration takes it, whatever the tuning says (off sm_90a the FP8 forward itself is refused
        // with a clear error: src/forward.rs).
        for cfg in [Config::sagebwd(), Config::fpa()] {
            let p = KernelPlan::choose("sm_90a", &cfg, &s, false, &on);
            assert!(!p.prepare.v_e4m3 && !p.prepare.v_e4m3_fused, "{}", cfg.label());
        }
    }

    #[test]
    fn tma_copies_only_where_the_folded_key_view_holds() {
        let s = |n_q, n_k| Shape {
            batch: 2,
            heads_q: 4,
            heads_kv: 2,
            n_q,
            n_k,
            head_dim: 128,
        };
        for (n_q, n_k) in [(1024, 1024), (1, 16), (4097, 4096), (100, 48)] {
            assert!(tma_kq_fits(&s(n_q, n_k)), "{n_q} {n_k}");
        }
        // A head's keys must be whole 16-key groups of the folded view; rows must fit the kernel's 32-bit arithmetic.
        for (n_q, n_k) in [(1024, 1023), (64, 4097), (16, 8)] {
            assert!(!tma_kq_fits(&s(n_q, n_k)), "{n_q} {n_k}");
        }
        assert!(!tma_kq_fits(&s(1 << 28, 1024)));
        let p = KernelPlan::choose("sm_90a", &Config::sagebwd(), &s(64, 4097), false, &Tuning::default());
        assert!(
            matches!(p.forward, ForwardKernel::Int8Persistent { tma_kq: false, .. }),
            "{p:?}"
        );
    }

    #[test]
    fn persistent_backward_grid_only_where_measured_faster() {
        let persistent = |preset: &str, d, causal, n| plan(preset, "sm_90a", n, d, causal).backward.persistent;
        for causal in [true, false] {
            for n in [1024, 4096] {
                assert!(persistent("fpa", 64, causal, n) && persistent("fpa", 128, causal, n));
            }
            assert!(!persistent("fpa", 64, causal, 8192));
            assert!(persistent("fpa", 128, causal, 8192) && persistent("fpa", 128, causal, 16384));
            for n in [1024, 4096, 16384] {
                assert!(!persistent("sagebwd", 128, causal, n) && !persistent("sagebwd", 64, causal, n));
            }
        }
        // sagebwd d 64 without the TMA-dQ plain-grid kernel: persistent at causal N ≤ 1k only.
        let t = Tuning {
            sage_d64_tma_dq: false,
            ..Tuning::default()
        };
        let p = |n, causal| KernelPlan::choose("sm_90a", &Config::sagebwd(), &shape(n, 64, 1), causal, &t).backward;
        assert!(p(1024, true).persistent && !p(4096, true).persistent && !p(1024, false).persistent);
        assert_eq!(p(4096, true).main.name(), "sage_bwd_main_sm90_int8");
        // Never off Hopper.
        assert!(!plan("fpa", "sm_80", 1024, 128, false).backward.persistent);
    }

    #[test]
    fn group_policy_defaults_to_auto_and_rejects_garbage() {
        assert_eq!(GroupPolicy::parse(None).unwrap(), GroupPolicy::Auto);
        assert_eq!(GroupPolicy::parse(Some("auto")).unwrap(), GroupPolicy::Auto);
        assert_eq!(GroupPolicy::parse(Some("off")).unwrap(), GroupPolicy::Count(1));
        assert_eq!(GroupPolicy::parse(Some("1")).unwrap(), GroupPolicy::Count(1));
        assert_eq!(GroupPolicy::parse(Some("lean")).unwrap(), GroupPolicy::Lean);
        assert_eq!(GroupPolicy::parse(Some("3")).unwrap(), GroupPolicy::Count(3));
        for bad in ["0", "-2", "many", "2.5"] {
            assert!(GroupPolicy::parse(Some(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_plan_prints_every_stage() {
        let text = plan("sagebwd", "sm_90a", 4096, 128, true).to_string();
        for stage in [
            "preparation",
            "forward",
            "backward pre",
            "backward main",
            "backward post",
            "sage_fwd_sm90_int8_persistent",
        ] {
            assert!(text.contains(stage), "{stage} missing in\n{text}");
        }
        let map = kernel_map_markdown();
        assert!(map.contains("| `sagebwd` | sm_90a | 128 | yes | 1k–16k | `sage_fwd_sm90_int8_persistent` | `sage_bwd_main_sm90_int8_tma_stage` |"), "{map}");
    }
}
