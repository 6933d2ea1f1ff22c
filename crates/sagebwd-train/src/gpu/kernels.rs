//! The training step's own kernels (`kernels/*.cu`): NVRTC-compiled for the GPU at hand through
//! sagebwd-cuda's compiler and on-disk cache, and typed launchers. Arguments are raw device
//! addresses (`u64`), so that views into the flat parameter buffers need no borrow juggling; every
//! launcher documents the layouts it expects.

use super::{cuda_err, Result};
use cudarc::driver::{CudaFunction, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};
use sagebwd_cuda::runtime::{compile_program_cached, Device};
use std::sync::Arc;

const COMMON: &str = include_str!("../../kernels/common.cuh");
/// The sources, each compiled as `common.cuh` + the file.
pub const SOURCES: [(&str, &str); 3] = [
    ("layers.cu", include_str!("../../kernels/layers.cu")),
    ("loss.cu", include_str!("../../kernels/loss.cu")),
    ("optimizer.cu", include_str!("../../kernels/optimizer.cu")),
];

/// NVRTC options: default (fused multiply-add allowed) floating point; the CPU path is the
/// reference within the tolerances of the GPU-vs-CPU check, not bit for bit.
pub fn options(arch: &str) -> Vec<String> {
    vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()]
}

/// `common.cuh` + the file, with `#line` directives so that NVRTC's messages name the right file.
pub fn full_source(name: &str, body: &str) -> String {
    format!("#line 1 \"common.cuh\"\n{COMMON}\n#line 1 \"{name}\"\n{body}\n")
}

/// Compiles every source for `arch` (through the cache). Needs NVRTC, no GPU.
pub fn compile_all(arch: &str) -> Result<Vec<Vec<u8>>> {
    SOURCES
        .iter()
        .map(|&(name, body)| {
            let what = format!("training kernels {name} for {arch}");
            Ok(compile_program_cached(
                name,
                &full_source(name, body),
                &options(arch),
                &format!("train-{arch}"),
                &what,
            )?)
        })
        .collect()
}

/// `HeadsDims` of layers.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct HeadsDims {
    pub batch: i32,
    pub seq: i32,
    pub heads_q: i32,
    pub heads_kv: i32,
    pub head_dim: i32,
    pub qk_norm: i32,
    pub eps: f32,
}
unsafe impl DeviceRepr for HeadsDims {}

impl HeadsDims {
    fn slots(&self) -> usize {
        (self.heads_q + 2 * self.heads_kv) as usize
    }
    /// The heads kernels' grid (layers.cu, `token_lane`): head_dim / 8 lanes per token, which must
    /// tile a warp; HEADS_THREADS per block, so 32 / lanes positions per warp (4 at d = 64); x over
    /// the positions of a sequence, y over the sequences. The kernels index in 32 bits.
    fn launch(&self) -> Result<LaunchConfig> {
        let lanes = self.head_dim as usize / 8;
        if self.head_dim % 8 != 0 || lanes == 0 || 32 % lanes != 0 {
            return Err(super::Error::Gpu(format!(
                "the heads kernels need a head dimension of 8, 16, …, 256; got {}",
                self.head_dim
            )));
        }
        let (batch, seq) = (self.batch as usize, self.seq as usize);
        // The largest tensor is the fused projection `[batch · seq, slots · head_dim]`.
        if batch * seq * self.slots() * self.head_dim as usize >= 1 << 31 || batch > 65535 {
            return Err(super::Error::Gpu(format!(
                "the heads kernels index in 32 bits: {batch} × {seq} tokens × {} slots × {} is too large",
                self.slots(),
                self.head_dim
            )));
        }
        let positions = HEADS_THREADS as usize / lanes;
        Ok(LaunchConfig {
            grid_dim: (seq.div_ceil(positions) as u32, batch as u32, 1),
            block_dim: (HEADS_THREADS, 1, 1),
            shared_mem_bytes: 0,
        })
    }

    /// Floats of the QK-norm gain partials `qkv_heads_backward` writes: `[2, blocks, head_dim]`
    /// (query gain, key gain; one row per block, its tokens' terms summed; layers.cu `store_block_terms`).
    pub fn gain_partial_len(&self) -> Result<usize> {
        Ok(2 * self.gain_partial_blocks()? * self.head_dim as usize)
    }

    fn gain_partial_blocks(&self) -> Result<usize> {
        let cfg = self.launch()?;
        Ok((cfg.grid_dim.0 * cfg.grid_dim.1) as usize)
    }
}

pub struct TrainKernels {
    stream: Arc<CudaStream>,
    embed_forward: CudaFunction,
    embed_backward: CudaFunction,
    rmsnorm_forward: CudaFunction,
    rmsnorm_backward: CudaFunction,
    sum_partials: CudaFunction,
    sum_partials_pair: CudaFunction,
    qkv_heads_forward: CudaFunction,
    qkv_heads_backward: CudaFunction,
    permute_heads: CudaFunction,
    swiglu_forward: CudaFunction,
    swiglu_forward_x8: CudaFunction,
    swiglu_backward: CudaFunction,
    swiglu_backward_x8: CudaFunction,
    cast_bf16: CudaFunction,
    xent: CudaFunction,
    xent_staged: CudaFunction,
    adamw: CudaFunction,
    sum_squares: CudaFunction,
    fill_u32: CudaFunction,
}

const BLOCK: u32 = 256;
/// Threads per block of the heads kernels (`HEADS_THREADS` in layers.cu).
const HEADS_THREADS: u32 = 128;
/// Threads of `xent_staged` (`XENT_STAGED_THREADS` in loss.cu).
const XENT_STAGED_THREADS: u32 = 512;
/// Rows per block of the fused RMSNorm backward (its `rows_per_block`), and its warps (`NORM_WARPS`).
pub const NORM_BLOCK_ROWS: usize = 32;
const NORM_WARPS: usize = 8;
/// Blocks of the grid-stride kernels (sum_squares partials, casts, fills).
pub const STRIDE_BLOCKS: usize = 1024;

/// Elements per block of the AdamW launch.
const ADAM_CHUNK: usize = 32 * 1024;

/// A piece of the flat parameter buffers with one weight-decay setting (`AdamChunk` in optimizer.cu).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdamChunk {
    pub start: i64,
    pub len: i32,
    pub decay: i32,
}
unsafe impl cudarc::driver::DeviceRepr for AdamChunk {}
unsafe impl cudarc::driver::ValidAsZeroBits for AdamChunk {}

/// Splits tensors `(offset, len, decay)` into chunks of at most `ADAM_CHUNK` elements, in order.
pub fn adam_chunks(tensors: impl IntoIterator<Item = (usize, usize, bool)>) -> Vec<AdamChunk> {
    let mut chunks = Vec::new();
    for (offset, len, decay) in tensors {
        for start in (0..len).step_by(ADAM_CHUNK) {
            let n = ADAM_CHUNK.min(len - start);
            chunks.push(AdamChunk {
                start: (offset + start) as i64,
                len: n as i32,
                decay: decay as i32,
            });
        }
    }
    chunks
}

fn blocks(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(BLOCK as usize).max(1) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A grid with `per_token` threads for every token: x over them (blocks of a whole number of warps),
/// y = position, z = sequence, so that kernels find their token without dividing.
fn token_grid(per_token: usize, batch: usize, seq: usize) -> Result<LaunchConfig> {
    if seq > 65535 || batch > 65535 {
        return Err(super::Error::Gpu(format!(
            "the token kernels take at most 65,535 positions and sequences per micro-batch; got {batch} × {seq}"
        )));
    }
    let block = per_token.div_ceil(32).clamp(1, 32) * 32;
    Ok(LaunchConfig {
        grid_dim: (per_token.div_ceil(block) as u32, seq as u32, batch as u32),
        block_dim: (block as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

fn warps(rows: usize) -> LaunchConfig {
    blocks(rows * 32)
}

fn grid_stride(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(BLOCK as usize).clamp(1, STRIDE_BLOCKS) as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `launch!(self, kernel, config, args...)`: binds every argument to a local first (the launch
/// builder keeps references), then launches on the engine's stream.
macro_rules! launch {
    ($self:ident, $f:ident, $cfg:expr, $($arg:expr),+ $(,)?) => {
        launch!(@bind $self, $f, $cfg, []; $($arg),+)
    };
    (@bind $self:ident, $f:ident, $cfg:expr, [$($bound:ident)*]; $head:expr $(, $tail:expr)*) => {{
        let v = $head;
        launch!(@bind $self, $f, $cfg, [$($bound)* v]; $($tail),*)
    }};
    (@bind $self:ident, $f:ident, $cfg:expr, [$($bound:ident)*]; ) => {{
        let mut b = $self.stream.launch_builder(&$self.$f);
        $( b.arg(&$bound); )*
        unsafe { b.launch($cfg) }.map(|_| ()).map_err(|e| cuda_err(concat!("launch ", stringify!($f)), e))
    }};
}

impl TrainKernels {
    pub fn load(dev: &Device) -> Result<TrainKernels> {
        let mut m = Vec::new();
        for cubin in compile_all(&dev.arch)? {
            m.push(dev.load(cubin)?);
        }
        let f = |i: usize, n: &str| {
            m[i].load_function(n)
                .map_err(|e| cuda_err(&format!("load function {n}"), e))
        };
        Ok(TrainKernels {
            stream: dev.stream.clone(),
            embed_forward: f(0, "embed_forward")?,
            embed_backward: f(0, "embed_backward")?,
            rmsnorm_forward: f(0, "rmsnorm_forward")?,
            rmsnorm_backward: f(0, "rmsnorm_backward")?,
            sum_partials: f(0, "sum_partials")?,
            sum_partials_pair: f(0, "sum_partials_pair")?,
            qkv_heads_forward: f(0, "qkv_heads_forward")?,
            qkv_heads_backward: f(0, "qkv_heads_backward")?,
            permute_heads: f(0, "permute_heads")?,
            swiglu_forward: f(0, "swiglu_forward")?,
            swiglu_forward_x8: f(0, "swiglu_forward_x8")?,
            swiglu_backward: f(0, "swiglu_backward")?,
            swiglu_backward_x8: f(0, "swiglu_backward_x8")?,
            cast_bf16: f(0, "cast_bf16")?,
            xent: f(1, "xent")?,
            xent_staged: f(1, "xent_staged")?,
            adamw: f(2, "adamw")?,
            sum_squares: f(2, "sum_squares")?,
            fill_u32: f(2, "fill_u32")?,
        })
    }

    /// `x[t] = table[tokens[t]]`, FP32 `[tokens, dim]`.
    pub fn embed_forward(&self, tokens: u64, table: u64, x: u64, n_tokens: usize, dim: usize) -> Result<()> {
        let cfg = LaunchConfig {
            grid_dim: (n_tokens as u32, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(self, embed_forward, cfg, tokens, table, x, dim as i32)
    }

    pub fn embed_backward(&self, tokens: u64, dx: u64, d_table: u64, n_tokens: usize, dim: usize) -> Result<()> {
        let cfg = LaunchConfig {
            grid_dim: (n_tokens as u32, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(self, embed_backward, cfg, tokens, dx, d_table, dim as i32)
    }

    /// FP32 `x [rows, n]` → BF16 `y`, FP32 `rstd [rows]`.
    #[allow(clippy::too_many_arguments)]
    /// `residual`: `(branch, x_out)` — normalize `x_out = x + branch` (BF16 branch, FP32 sum written
    /// to `x_out`) instead of `x`: the residual add of the block's last product, fused.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_forward(
        &self,
        x: u64,
        residual: Option<(u64, u64)>,
        gain: u64,
        y: u64,
        rstd: u64,
        n: usize,
        rows: usize,
        eps: f32,
    ) -> Result<()> {
        let (branch, x_out) = residual.unwrap_or((0, 0));
        // 16-byte accesses need n % 4 == 0 and 16-byte aligned rows (x, x_out, gain) and 8-byte aligned y and branch rows.
        let vec = n.is_multiple_of(4)
            && x.is_multiple_of(16)
            && x_out % 16 == 0
            && gain.is_multiple_of(16)
            && y.is_multiple_of(8)
            && branch % 8 == 0;
        launch!(
            self,
            rmsnorm_forward,
            warps(rows),
            x,
            branch,
            x_out,
            gain,
            y,
            rstd,
            n as i32,
            rows as i64,
            eps,
            vec as i32
        )
    }

    /// The RMSNorm backward from `dy` (BF16): `dx += ∂/∂x` (FP32), `dx_bf16` = BF16 copy of the new dx, and
    /// `d_gain += Σ_rows dy ∘ x · rstd` through `partial` (≥ ⌈rows / NORM_BLOCK_ROWS⌉ × n floats).
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_backward(
        &self,
        dy: u64,
        x: u64,
        gain: u64,
        rstd: u64,
        dx: u64,
        dx_bf16: u64,
        partial: u64,
        d_gain: u64,
        n: usize,
        rows: usize,
    ) -> Result<()> {
        let chunks = rows.div_ceil(NORM_BLOCK_ROWS);
        let smem = NORM_WARPS * n * 4; // one row of gain sums per warp
        if smem > 48 << 10 {
            // Over the default limit (n > 1536): opt in; the launch fails with a clear error past the GPU's maximum.
            let attr = cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            self.rmsnorm_backward
                .set_attribute(attr, smem as i32)
                .map_err(|e| cuda_err(&format!("RMSNorm backward of width {n}: {smem} B of shared memory"), e))?;
        }
        let cfg = LaunchConfig {
            grid_dim: (chunks as u32, 1, 1),
            block_dim: ((NORM_WARPS * 32) as u32, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        let vec = n.is_multiple_of(4)
            && [x, gain, dx].iter().all(|p| p % 16 == 0)
            && dy.is_multiple_of(8)
            && dx_bf16.is_multiple_of(8);
        launch!(
            self,
            rmsnorm_backward,
            cfg,
            dy,
            x,
            gain,
            rstd,
            dx,
            dx_bf16,
            partial,
            n as i32,
            rows as i64,
            NORM_BLOCK_ROWS as i32,
            vec as i32
        )?;
        self.sum_partials(partial, d_gain, n, chunks)
    }

    /// `out[c] += Σ_k partial[k, c]` over `chunks` rows of partial sums.
    fn sum_partials(&self, partial: u64, out: u64, n: usize, chunks: usize) -> Result<()> {
        // COL_TILE × PARTIAL_LANES threads (layers.cu).
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(32) as u32, 1, 1),
            block_dim: (32, 32, 1),
            shared_mem_bytes: 0,
        };
        launch!(self, sum_partials, cfg, partial, out, n as i32, chunks as i32)
    }

    #[allow(clippy::too_many_arguments)]
    pub fn qkv_heads_forward(
        &self,
        d: HeadsDims,
        qkv: u64,
        q_gain: u64,
        k_gain: u64,
        cos: u64,
        sin: u64,
        q: u64,
        k: u64,
        v: u64,
        q_rstd: u64,
        k_rstd: u64,
    ) -> Result<()> {
        let cfg = d.launch()?;
        launch!(
            self,
            qkv_heads_forward,
            cfg,
            d,
            qkv,
            q_gain,
            k_gain,
            cos,
            sin,
            q,
            k,
            v,
            q_rstd,
            k_rstd
        )
    }

    /// With QK-norm, `gain_partial` (≥ [`HeadsDims::gain_partial_len`] floats) receives the block
    /// partials of the gains' gradients; [`Self::sum_gain_partials`] adds them to the gradients.
    #[allow(clippy::too_many_arguments)]
    pub fn qkv_heads_backward(
        &self,
        d: HeadsDims,
        dq: u64,
        dk: u64,
        dv: u64,
        qkv: u64,
        q_gain: u64,
        k_gain: u64,
        q_rstd: u64,
        k_rstd: u64,
        cos: u64,
        sin: u64,
        d_qkv: u64,
        gain_partial: u64,
    ) -> Result<()> {
        let mut cfg = d.launch()?;
        if d.qk_norm != 0 {
            // Each warp's sums of the terms over its tokens: `[warps][2][head_dim]` floats (≤ 8 KB).
            cfg.shared_mem_bytes = (HEADS_THREADS / 32) * 2 * d.head_dim as u32 * 4;
        }
        launch!(
            self,
            qkv_heads_backward,
            cfg,
            d,
            dq,
            dk,
            dv,
            qkv,
            q_gain,
            k_gain,
            q_rstd,
            k_rstd,
            cos,
            sin,
            d_qkv,
            gain_partial
        )
    }

    /// `q_gain_grad[c] += Σ_blocks partial[0, block, c]`, `k_gain_grad[c] += Σ_blocks partial[1, block, c]`
    /// (fixed order): the QK-norm gains' gradients from `qkv_heads_backward`'s partials, one launch.
    pub fn sum_gain_partials(&self, d: HeadsDims, partial: u64, q_gain_grad: u64, k_gain_grad: u64) -> Result<()> {
        let (n, chunks) = (d.head_dim as usize, d.gain_partial_blocks()?);
        // COL_TILE × PARTIAL_LANES threads (layers.cu); y: which gain.
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(32) as u32, 2, 1),
            block_dim: (32, 32, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            self,
            sum_partials_pair,
            cfg,
            partial,
            q_gain_grad,
            k_gain_grad,
            n as i32,
            chunks as i32
        )
    }

    /// BF16 `[batch, heads, seq, hd]` → `[batch·seq, heads·hd]` (`to_tokens`) or back.
    #[allow(clippy::too_many_arguments)]
    pub fn permute_heads(
        &self,
        src: u64,
        dst: u64,
        batch: usize,
        seq: usize,
        heads: usize,
        head_dim: usize,
        to_tokens: bool,
    ) -> Result<()> {
        let cfg = token_grid(heads * head_dim / 8, batch, seq)?;
        launch!(
            self,
            permute_heads,
            cfg,
            src,
            dst,
            batch as i32,
            seq as i32,
            heads as i32,
            head_dim as i32,
            to_tokens as i32
        )
    }

    /// `act = silu(gate) ∘ up` from `gu = [gate | up]`, BF16 `[batch · seq, 2f]` → `[batch · seq, f]`.
    pub fn swiglu_forward(&self, gu: u64, act: u64, f: usize, batch: usize, seq: usize) -> Result<()> {
        if f.is_multiple_of(8) {
            launch!(
                self,
                swiglu_forward_x8,
                token_grid(f / 8, batch, seq)?,
                gu,
                act,
                f as i32
            )
        } else {
            launch!(self, swiglu_forward, token_grid(f, batch, seq)?, gu, act, f as i32)
        }
    }

    /// `d_gu = [∂gate | ∂up]` from `d_act`, BF16.
    pub fn swiglu_backward(&self, d_act: u64, gu: u64, d_gu: u64, f: usize, batch: usize, seq: usize) -> Result<()> {
        if f.is_multiple_of(8) {
            launch!(
                self,
                swiglu_backward_x8,
                token_grid(f / 8, batch, seq)?,
                d_act,
                gu,
                d_gu,
                f as i32
            )
        } else {
            launch!(
                self,
                swiglu_backward,
                token_grid(f, batch, seq)?,
                d_act,
                gu,
                d_gu,
                f as i32
            )
        }
    }

    /// FP32 → BF16, `n` values.
    pub fn cast_bf16(&self, x: u64, y: u64, n: usize) -> Result<()> {
        launch!(self, cast_bf16, grid_stride(n), x, y, n as i64)
    }

    /// Per-row cross-entropy of BF16 logits `[rows, ld]` (first `vocab` columns; `ld` a multiple
    /// of 8, 16-byte aligned rows); with `want_grad` the BF16 gradient overwrites the logits.
    #[allow(clippy::too_many_arguments)]
    pub fn xent(
        &self,
        logits: u64,
        ld: usize,
        targets: u64,
        row_loss: u64,
        rows: usize,
        vocab: usize,
        scale: f32,
        want_grad: bool,
    ) -> Result<()> {
        if !ld.is_multiple_of(8) || !logits.is_multiple_of(16) || vocab > ld {
            return Err(super::Error::Gpu(format!("xent: row width {ld} (vocabulary {vocab}) must be a multiple of 8 ≥ the vocabulary, rows 16-byte aligned")));
        }
        // The row staged in shared memory (one DRAM read per logit) when the GPU lets a block hold it
        // (100.6 KB for GPT-2's vocabulary; H100/H200 allow 227 KB); else the streaming kernel.
        let smem = ld * 2;
        let attr = cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        if std::env::var_os("SAGEBWD_XENT_STREAM").is_none()
            && self.xent_staged.set_attribute(attr, smem as i32).is_ok()
        {
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (XENT_STAGED_THREADS, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            return launch!(
                self,
                xent_staged,
                cfg,
                logits,
                ld as i64,
                targets,
                row_loss,
                vocab as i32,
                scale,
                want_grad as i32
            );
        }
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            self,
            xent,
            cfg,
            logits,
            ld as i64,
            targets,
            row_loss,
            vocab as i32,
            scale,
            want_grad as i32
        )
    }

    /// AdamW over the flat buffers in one launch: one block per [`AdamChunk`] of `chunks`
    /// (`n_chunks` of them, on the device; see [`adam_chunks`]).
    #[allow(clippy::too_many_arguments)]
    pub fn adamw(
        &self,
        p: u64,
        p_bf16: u64,
        g: u64,
        m: u64,
        v: u64,
        chunks: u64,
        n_chunks: usize,
        lr: f32,
        c: &crate::optim::AdamWConfig,
        bc1: f32,
        bc2: f32,
        grad_scale: f32,
    ) -> Result<()> {
        // Chunks with start and length multiples of 4 take 16-byte accesses (optimizer.cu): the buffers must be aligned.
        if [p, g, m, v].iter().any(|a| a % 16 != 0) || !p_bf16.is_multiple_of(8) {
            return Err(super::Error::Gpu(
                "adamw: the flat buffers must be 16-byte aligned (the BF16 copy 8-byte)".into(),
            ));
        }
        let cfg = LaunchConfig {
            grid_dim: (n_chunks as u32, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            self,
            adamw,
            cfg,
            p,
            p_bf16,
            g,
            m,
            v,
            chunks,
            lr,
            c.beta1,
            c.beta2,
            c.eps,
            c.weight_decay,
            bc1,
            bc2,
            grad_scale
        )
    }

    /// Writes `STRIDE_BLOCKS`-at-most partial sums of squares (FP64) to `partial`; returns how many.
    pub fn sum_squares(&self, x: u64, n: usize, partial: u64) -> Result<usize> {
        let cfg = grid_stride(n);
        launch!(self, sum_squares, cfg, x, n as i64, partial)?;
        Ok(cfg.grid_dim.0 as usize)
    }

    pub fn fill_u32(&self, x: u64, n_words: usize, value: u32) -> Result<()> {
        launch!(self, fill_u32, grid_stride(n_words), x, n_words as i64, value)
    }
}

#[cfg(test)]
mod tests {
    use super::{adam_chunks, token_grid, ADAM_CHUNK};

    #[test]
    fn token_grid_gives_every_token_its_threads_in_whole_warps() {
        // base model: 36 slots × 8 lanes per token; heads × d/8 for the permutes; a wide model.
        for (per_token, block, blocks_x) in [(288, 288, 1), (96, 96, 1), (1600, 1024, 2), (5, 32, 1)] {
            let cfg = token_grid(per_token, 16, 1024).unwrap();
            assert_eq!(cfg.block_dim, (block, 1, 1), "{per_token} threads per token");
            assert_eq!(cfg.grid_dim, (blocks_x, 1024, 16));
            assert!(cfg.grid_dim.0 * cfg.block_dim.0 >= per_token as u32);
        }
        assert!(token_grid(288, 1, 70_000).is_err());
        assert!(token_grid(288, 70_000, 1).is_err());
    }

    #[test]
    fn heads_grid_gives_each_warp_whole_tokens_of_one_sequence() {
        let dims = |batch, seq, heads_q, heads_kv, head_dim| super::HeadsDims {
            batch,
            seq,
            heads_q,
            heads_kv,
            head_dim,
            qk_norm: 1,
            eps: 1e-6,
        };
        // base: 8 lanes per token at d = 64, 16 positions per 128-thread block: 64 blocks per
        // sequence, 1,024 in all (resident in one wave at 8 blocks per SM on 132 SMs).
        let base = dims(16, 1024, 12, 12, 64);
        let cfg = base.launch().unwrap();
        assert_eq!((cfg.grid_dim, cfg.block_dim), ((64, 16, 1), (128, 1, 1)));
        assert_eq!(base.gain_partial_len().unwrap(), 2 * 1024 * 64);
        // train-check's odd length: 203 positions → 13 blocks, the last one partly past the end.
        assert_eq!(dims(2, 203, 2, 1, 64).launch().unwrap().grid_dim, (13, 2, 1));
        // d = 128: 16 lanes, 8 positions per block.
        assert_eq!(dims(1, 4096, 16, 16, 128).launch().unwrap().grid_dim, (512, 1, 1));
        assert!(
            dims(1, 64, 2, 1, 96).launch().is_err(),
            "96 / 8 = 12 lanes do not tile a warp"
        );
        // 32-bit indices: the fused projection must hold < 2^31 elements.
        assert!(dims(64, 8192, 32, 32, 128).launch().is_err());
    }

    #[test]
    fn adam_chunks_cover_every_element_once_with_its_tensors_decay() {
        // A small tensor, one of exactly two chunks, one with a remainder, and an empty one.
        let tensors = [
            (0, 768, false),
            (768, 2 * ADAM_CHUNK, true),
            (768 + 2 * ADAM_CHUNK, ADAM_CHUNK + 5, true),
            (768 + 3 * ADAM_CHUNK + 5, 0, false),
        ];
        let chunks = adam_chunks(tensors);
        assert_eq!(chunks.len(), 1 + 2 + 2);
        let mut next = 0i64;
        for c in &chunks {
            assert_eq!(c.start, next, "chunks are contiguous and in order");
            assert!(c.len > 0 && c.len as usize <= ADAM_CHUNK);
            let owner = tensors
                .iter()
                .find(|t| (t.0 as i64) <= c.start && c.start < (t.0 + t.1) as i64)
                .unwrap();
            assert!(
                c.start + c.len as i64 <= (owner.0 + owner.1) as i64,
                "a chunk stays inside its tensor"
            );
            assert_eq!(c.decay, owner.2 as i32);
            next += c.len as i64;
        }
        assert_eq!(next as usize, 768 + 3 * ADAM_CHUNK + 5);
    }
}
