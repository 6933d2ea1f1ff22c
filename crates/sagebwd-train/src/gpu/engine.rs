//! [`GpuEngine`]: the model's forward and backward on the GPU, written out layer by layer.
//!
//! Tensors (T = batch · seq tokens, D = dim, W = (heads_q + 2 heads_kv) · head_dim, F = ffn):
//! - parameters, gradients, AdamW moments: flat FP32 buffers in [`Weights::named`] order (so one
//!   kernel computes the gradient norm; `wq|wk|wv` and `w_gate|w_up` are adjacent, so each pair is
//!   one product), plus a BF16 copy of the parameters that AdamW refreshes;
//! - per layer, saved for the backward: block input `x` (FP32), normalized `h` (BF16) and rstd, the
//!   fused projection `qkv` (BF16, `[T, W]`), QK-norm rstd, attention inputs/outputs and
//!   sagebwd-cuda's saved state, `o` in token layout (BF16), the MLP's input, normalized input,
//!   `gate|up` (BF16, `[T, 2F]`: the largest activation, read twice more) and SwiGLU output (BF16);
//! - backward scratch shared by the layers.

use super::blas::{Blas, Out};
use super::kernels::{adam_chunks, AdamChunk, HeadsDims, TrainKernels, NORM_BLOCK_ROWS, STRIDE_BLOCKS};
use super::profile::Profile;
use super::{cuda_err, Error, Result};
use crate::backend::Attention;
use crate::config::ModelConfig;
use crate::engine::{Engine, EngineState};
use crate::layers::rotary::Rotary;
use crate::model::{Batch, ParamLayout, Weights};
use crate::optim::AdamWConfig;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr, ValidAsZeroBits};
use sagebwd_cuda::energy::EnergyMeter;
use sagebwd_cuda::pool::Pool;
use sagebwd_cuda::{DeviceForward, DeviceInputs, Gpu, SavedForBackward};
use std::sync::Arc;

/// Tokens per chunk of the LM head: the BF16 logits of a chunk are `chunk × vocab` (1.6 GB at 16384).
const HEAD_CHUNK: usize = 16384;
/// NaN, the poison of freshly allocated activation buffers.
const POISON: u32 = 0x7fc0_0000;

fn addr<T>(s: &CudaSlice<T>, stream: &Arc<CudaStream>) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

/// A tensor inside a flat buffer.
#[derive(Clone, Debug)]
struct Slot {
    name: String,
    offset: usize,
    len: usize,
    decay: bool,
}

/// Element offsets of one layer's tensors in the flat buffers.
#[derive(Clone, Copy, Debug, Default)]
struct LayerParams {
    attn_norm: usize,
    wqkv: usize,
    wo: usize,
    q_norm: usize,
    k_norm: usize,
    mlp_norm: usize,
    w_gate_up: usize,
    w_down: usize,
}

/// An FP32 or BF16 device buffer with its base address.
struct Buf<T> {
    data: CudaSlice<T>,
    ptr: u64,
}

impl<T> Buf<T> {
    /// Address of element `i`.
    fn at(&self, i: usize) -> u64 {
        self.ptr + (i * std::mem::size_of::<T>()) as u64
    }
}

/// One layer's saved activations.
struct LayerActs {
    x: Buf<f32>,
    h_attn: Buf<u16>,
    rstd_attn: Buf<f32>,
    qkv: Buf<u16>,
    q_rstd: Buf<f32>,
    k_rstd: Buf<f32>,
    attn_in: DeviceInputs,
    attn_out: Option<(DeviceForward, SavedForBackward)>,
    o_tok: Buf<u16>,
    x_mid: Buf<f32>,
    h_mlp: Buf<u16>,
    rstd_mlp: Buf<f32>,
    gate_up: Buf<u16>,
    act: Buf<u16>,
}

/// Every buffer of one micro-batch shape.
struct Acts {
    batch: usize,
    seq: usize,
    tokens: Buf<u32>,
    targets: Buf<u32>,
    layers: Vec<LayerActs>,
    x_final: Buf<f32>,
    /// The BF16 output of a block's last product (`wo`, `down`), added to the residual by the next norm.
    branch: Buf<u16>,
    hidden: Buf<u16>,
    rstd_final: Buf<f32>,
    /// BF16 logits of one chunk of tokens, overwritten by their gradient (`xent`).
    logits: Buf<u16>,
    row_loss: Buf<f32>,
    // backward scratch
    dx: Buf<f32>,
    dx_bf16: Buf<u16>,
    /// ∂ of a norm's output (BF16, as the dx products write it; read by the RMSNorm backward).
    dh: Buf<u16>,
    d_hidden: Buf<u16>,
    d_act: Buf<u16>,
    d_gate_up: Buf<u16>,
    d_o_tok: Buf<u16>,
    d_o: CudaSlice<u16>,
    d_qkv: Buf<u16>,
    /// The QK-norm gains' gradient partials of `qkv_heads_backward` (`[2, blocks, head_dim]`), sized by
    /// `HeadsDims::gain_partial_len` for this batch shape (`ensure_acts` reallocates per shape).
    gain_partial: Buf<f32>,
    /// The RMSNorm backward's gain-gradient partials.
    partial: Buf<f32>,
}

pub struct GpuEngine {
    gpu: Gpu,
    k: TrainKernels,
    blas: Blas,
    cfg: ModelConfig,
    attention: Attention,
    attn_cfg: sagebwd::Config,
    adamw: AdamWConfig,
    slots: Vec<Slot>,
    layers: Vec<LayerParams>,
    tok_emb: usize,
    final_norm: usize,
    head: usize,
    params: Buf<f32>,
    params_bf16: Buf<u16>,
    grads: Buf<f32>,
    adam_m: Buf<f32>,
    adam_v: Buf<f32>,
    adam_t: u64,
    /// The AdamW launch's work list: the flat buffers in chunks of one weight decay each.
    adam_chunks: Buf<AdamChunk>,
    norm_partial: Buf<f64>,
    rope_cos: Buf<f32>,
    rope_sin: Buf<f32>,
    acts: Option<Acts>,
    /// The memory pool every buffer comes from (None without stream-ordered allocation), and the
    /// bytes in use in it before the engine allocated anything.
    pool: Option<Pool>,
    base_used: u64,
    /// GPU time per phase when `SAGEBWD_PROFILE=1`.
    profile: Option<Profile>,
    /// The board's energy counter (None without NVML or on a GPU without the counter).
    energy: Option<EnergyMeter>,
}

impl GpuEngine {
    /// Opens GPU 0, compiles the kernels (or reads them from the cache) and uploads `weights`.
    pub fn new(cfg: ModelConfig, weights: &Weights, adamw: AdamWConfig, attention: Attention) -> Result<GpuEngine> {
        GpuEngine::on(0, cfg, weights, adamw, attention)
    }

    /// As [`GpuEngine::new`], on the GPU with this ordinal.
    pub fn on(
        ordinal: usize,
        cfg: ModelConfig,
        weights: &Weights,
        adamw: AdamWConfig,
        attention: Attention,
    ) -> Result<GpuEngine> {
        if let Some(why) = super::unsupported_reason(&cfg, &attention) {
            return Err(Error::Gpu(why));
        }
        let attn_cfg = match &attention {
            Attention::Method { config, .. } => config.clone(),
            Attention::Exact => unreachable!("rejected by unsupported_reason"),
        };
        let gpu = Gpu::open(ordinal).map_err(|e| Error::Gpu(e.to_string()))?;
        gpu.set_poison(false); // see `set_checked`
        let pool = Pool::of(&gpu)?;
        let mut base_used = 0;
        if let Some(p) = &pool {
            // Freed blocks stay in the pool (as in PyTorch's caching allocator): the attention
            // kernels' per-call buffers would otherwise be mapped afresh after every synchronization.
            p.keep_freed_memory()?;
            base_used = p.reset_high()?;
        }
        let stream = gpu.dev.stream.clone();
        let k = TrainKernels::load(&gpu.dev)?;
        gpu.kernels(cfg.head_dim())?; // compile the attention kernels now, not inside the first step
        let blas = Blas::new(stream.clone())?;
        let layout = ParamLayout::new(&cfg);
        let mut slots = Vec::new();
        let mut offset = 0;
        for (name, t) in weights.named() {
            let decay = layout.specs.iter().find(|s| s.name == name).is_some_and(|s| s.decay);
            slots.push(Slot {
                name,
                offset,
                len: t.len(),
                decay,
            });
            offset += t.len();
        }
        let total = offset;
        let find = |name: &str| slots.iter().find(|s| s.name == name).map(|s| s.offset);
        let need = |name: &str| find(name).ok_or_else(|| Error::Gpu(format!("parameter {name} missing")));
        let mut layers = Vec::new();
        for l in 0..cfg.n_layers {
            let n = |t: &str| format!("layers.{l}.{t}");
            let p = LayerParams {
                attn_norm: need(&n("attn_norm"))?,
                wqkv: need(&n("wq"))?,
                wo: need(&n("wo"))?,
                q_norm: find(&n("q_norm")).unwrap_or(0),
                k_norm: find(&n("k_norm")).unwrap_or(0),
                mlp_norm: need(&n("mlp_norm"))?,
                w_gate_up: need(&n("w_gate"))?,
                w_down: need(&n("w_down"))?,
            };
            // The fused products rely on adjacency (the order of `Weights::named`).
            let (qw, kvw) = (
                cfg.n_heads * cfg.head_dim() * cfg.dim,
                cfg.n_kv_heads * cfg.head_dim() * cfg.dim,
            );
            if need(&n("wk"))? != p.wqkv + qw
                || need(&n("wv"))? != p.wqkv + qw + kvw
                || need(&n("w_up"))? != p.w_gate_up + cfg.ffn_hidden * cfg.dim
            {
                return Err(Error::Gpu(
                    "parameter layout: wq|wk|wv or w_gate|w_up are not adjacent".into(),
                ));
            }
            layers.push(p);
        }
        let tok_emb = need("tok_emb")?;
        let head = if cfg.tied_embeddings { tok_emb } else { need("lm_head")? };
        let final_norm = need("final_norm")?;
        let rope = Rotary::new(cfg.head_dim(), cfg.max_seq_len, cfg.rope_theta);
        let (cos, sin) = rope.tables();
        let upload_f32 = |v: &[f32]| -> Result<Buf<f32>> {
            let data = stream.clone_htod(v).map_err(|e| cuda_err("upload", e))?;
            let ptr = addr(&data, &stream);
            Ok(Buf { data, ptr })
        };
        let flat: Vec<f32> = weights.tensors().into_iter().flat_map(|t| t.iter().copied()).collect();
        let chunks = adam_chunks(slots.iter().map(|s| (s.offset, s.len, s.decay)));
        let chunks = stream.clone_htod(&chunks).map_err(|e| cuda_err("upload", e))?;
        let e = GpuEngine {
            adam_chunks: Buf {
                ptr: addr(&chunks, &stream),
                data: chunks,
            },
            params: upload_f32(&flat)?,
            // Zero padding after the last tensor: the padded LM-head product reads up to
            // `padded_vocab − vocab` rows past an untied head (see `lm_head`).
            params_bf16: zeros(&stream, total + (padded_vocab(&cfg) - cfg.vocab_size) * cfg.dim)?,
            // Zero padding after the last tensor: the LM head's weight gradient is computed over the
            // padded width (see `lm_head`).
            grads: zeros(&stream, total + (padded_vocab(&cfg) - cfg.vocab_size) * cfg.dim)?,
            adam_m: zeros(&stream, total)?,
            adam_v: zeros(&stream, total)?,
            norm_partial: zeros(&stream, STRIDE_BLOCKS)?,
            rope_cos: upload_f32(cos)?,
            rope_sin: upload_f32(sin)?,
            k,
            blas,
            cfg,
            attention,
            attn_cfg,
            adamw,
            slots,
            layers,
            tok_emb,
            final_norm,
            head,
            adam_t: 0,
            acts: None,
            pool,
            base_used,
            profile: Profile::from_env(),
            energy: EnergyMeter::open(&gpu.dev).ok(),
            gpu,
        };
        e.refresh_bf16()?;
        Ok(e)
    }

    /// Runs `f`; with profiling on, adds its GPU time to `phase`.
    fn timed<T>(&self, phase: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        match &self.profile {
            Some(profile) => profile.time(self.stream(), phase, f),
            None => f(),
        }
    }

    /// Checked mode of the attention kernels ([`Gpu::set_poison`]): off by default (training);
    /// `train-check` turns it on. The engine's own buffers are poisoned once, when allocated.
    pub fn set_checked(&self, on: bool) {
        self.gpu.set_poison(on);
    }

    pub(super) fn stream(&self) -> &Arc<CudaStream> {
        &self.gpu.dev.stream
    }

    /// The flat FP32 gradient buffer (for the data-parallel all-reduce).
    pub(super) fn grads_mut(&mut self) -> &mut CudaSlice<f32> {
        &mut self.grads.data
    }

    /// Casts the FP32 parameters into their BF16 copy (the zero padding after them stays).
    fn refresh_bf16(&self) -> Result<()> {
        self.k
            .cast_bf16(self.params.ptr, self.params_bf16.ptr, self.params.data.len())
    }

    fn heads_dims(&self, batch: usize, seq: usize) -> HeadsDims {
        let c = &self.cfg;
        HeadsDims {
            batch: batch as i32,
            seq: seq as i32,
            heads_q: c.n_heads as i32,
            heads_kv: c.n_kv_heads as i32,
            head_dim: c.head_dim() as i32,
            qk_norm: c.qk_norm as i32,
            eps: c.norm_eps,
        }
    }

    fn padded_vocab(&self) -> usize {
        padded_vocab(&self.cfg)
    }

    /// Allocates (and poisons) the buffers of a `batch × seq` micro-batch, unless they exist.
    fn ensure_acts(&mut self, batch: usize, seq: usize) -> Result<()> {
        if self.acts.as_ref().is_some_and(|a| a.batch == batch && a.seq == seq) {
            return Ok(());
        }
        self.acts = None; // free the old shape first
        let c = self.cfg.clone();
        let (t, d, hd, f) = (batch * seq, c.dim, c.head_dim(), c.ffn_hidden);
        let (qw, kvw) = (c.n_heads * hd, c.n_kv_heads * hd);
        let w = qw + 2 * kvw;
        let chunk = HEAD_CHUNK.min(t);
        let vp = self.padded_vocab();
        let s = self.stream().clone();
        let shape = sagebwd::Shape {
            batch,
            heads_q: c.n_heads,
            heads_kv: c.n_kv_heads,
            n_q: seq,
            n_k: seq,
            head_dim: hd,
        };
        let mut layers = Vec::with_capacity(c.n_layers);
        for _ in 0..c.n_layers {
            layers.push(LayerActs {
                x: poisoned(&self.k, &s, t * d)?,
                h_attn: poisoned(&self.k, &s, t * d)?,
                rstd_attn: poisoned(&self.k, &s, t)?,
                qkv: poisoned(&self.k, &s, t * w)?,
                q_rstd: poisoned(&self.k, &s, t * c.n_heads)?,
                k_rstd: poisoned(&self.k, &s, t * c.n_kv_heads)?,
                attn_in: DeviceInputs {
                    shape,
                    causal: true,
                    q: poisoned(&self.k, &s, t * qw)?.data,
                    k: poisoned(&self.k, &s, t * kvw)?.data,
                    v: poisoned(&self.k, &s, t * kvw)?.data,
                    d_o: None,
                },
                attn_out: None,
                o_tok: poisoned(&self.k, &s, t * qw)?,
                x_mid: poisoned(&self.k, &s, t * d)?,
                h_mlp: poisoned(&self.k, &s, t * d)?,
                rstd_mlp: poisoned(&self.k, &s, t)?,
                gate_up: poisoned(&self.k, &s, t * 2 * f)?,
                act: poisoned(&self.k, &s, t * f)?,
            });
        }
        let gain_partial_len = if c.qk_norm {
            self.heads_dims(batch, seq).gain_partial_len()?
        } else {
            1
        };
        self.acts = Some(Acts {
            batch,
            seq,
            tokens: zeros(&s, t)?,
            targets: zeros(&s, t)?,
            layers,
            x_final: poisoned(&self.k, &s, t * d)?,
            branch: poisoned(&self.k, &s, t * d)?,
            hidden: poisoned(&self.k, &s, t * d)?,
            rstd_final: poisoned(&self.k, &s, t)?,
            logits: poisoned(&self.k, &s, chunk * vp)?,
            row_loss: poisoned(&self.k, &s, t)?,
            dx: poisoned(&self.k, &s, t * d)?,
            dx_bf16: poisoned(&self.k, &s, t * d)?,
            dh: poisoned(&self.k, &s, t * d)?,
            d_hidden: poisoned(&self.k, &s, t * d)?,
            d_act: poisoned(&self.k, &s, t * f)?,
            d_gate_up: poisoned(&self.k, &s, t * 2 * f)?,
            d_o_tok: poisoned(&self.k, &s, t * qw)?,
            d_o: poisoned::<u16>(&self.k, &s, t * qw)?.data,
            d_qkv: poisoned(&self.k, &s, t * w)?,
            gain_partial: poisoned(&self.k, &s, gain_partial_len)?,
            partial: poisoned(&self.k, &s, t.div_ceil(NORM_BLOCK_ROWS) * d)?,
        });
        Ok(())
    }

    /// The forward pass; returns the summed loss (nats). With `grad_scale`, also the backward.
    fn run(&mut self, b: &Batch, grad_scale: Option<f32>) -> Result<f64> {
        crate::model::check_batch(&self.cfg, b)?;
        // A data-parallel replica runs in its own thread; cuBLASLt uses the thread's current context.
        self.gpu
            .dev
            .ctx
            .bind_to_thread()
            .map_err(|e| cuda_err("bind context", e))?;
        self.ensure_acts(b.batch, b.seq)?;
        let mut a = self.acts.take().expect("allocated above");
        let result = self.run_with(&mut a, b, grad_scale);
        self.acts = Some(a);
        result
    }

    fn run_with(&mut self, a: &mut Acts, b: &Batch, grad_scale: Option<f32>) -> Result<f64> {
        let s = self.stream().clone();
        s.memcpy_htod(b.inputs, &mut a.tokens.data)
            .map_err(|e| cuda_err("upload tokens", e))?;
        s.memcpy_htod(b.targets, &mut a.targets.data)
            .map_err(|e| cuda_err("upload targets", e))?;
        let (t, d) = (b.batch * b.seq, self.cfg.dim);
        let first_x = a.layers.first().map_or(a.x_final.ptr, |l| l.x.ptr);
        self.timed("embedding", || {
            self.k
                .embed_forward(a.tokens.ptr, self.params.at(self.tok_emb), first_x, t, d)
        })?;
        for l in 0..self.cfg.n_layers {
            let prev_x_mid = l.checked_sub(1).map(|p| a.layers[p].x_mid.ptr);
            self.layer_forward(l, &mut a.layers[l], prev_x_mid, a.branch.ptr, b, grad_scale.is_some())?;
        }
        let c = &self.cfg;
        // x_final = x_mid + down(...) of the last layer (the embedding itself without layers).
        let (x_in, residual) = match a.layers.last() {
            Some(last) => (last.x_mid.ptr, Some((a.branch.ptr, a.x_final.ptr))),
            None => (a.x_final.ptr, None),
        };
        self.timed("norms: forward", || {
            self.k.rmsnorm_forward(
                x_in,
                residual,
                self.params.at(self.final_norm),
                a.hidden.ptr,
                a.rstd_final.ptr,
                d,
                t,
                c.norm_eps,
            )
        })?;
        self.lm_head(a, t, grad_scale)?;
        if grad_scale.is_some() {
            self.backward(a, t)?;
        }
        // Read after the backward is enqueued, so the GPU never waits for the host mid-step. A
        // non-finite loss still stops the step: the caller gets the error before any update.
        let row_loss = s
            .clone_dtoh(&a.row_loss.data)
            .map_err(|e| cuda_err("download losses", e))?;
        let total: f64 = row_loss.iter().map(|&x| x as f64).sum();
        if !total.is_finite() {
            return Err(Error::Diverged(format!("loss {total} on the GPU")));
        }
        // Attention state is only needed by the backward.
        a.layers.iter_mut().for_each(|l| l.attn_out = None);
        Ok(total)
    }

    /// Layer `l`. Its input `la.x` is the embedding (first layer) or, fused into its first norm,
    /// the previous layer's `x_mid` plus the previous `down` product in `branch`. Leaves its own
    /// `down` product in `branch` for the next norm.
    #[allow(clippy::too_many_arguments)]
    fn layer_forward(
        &self,
        l: usize,
        la: &mut LayerActs,
        prev_x_mid: Option<u64>,
        branch: u64,
        b: &Batch,
        keep: bool,
    ) -> Result<()> {
        let c = &self.cfg;
        let p = self.layers[l];
        let (t, d, hd, f) = (b.batch * b.seq, c.dim, c.head_dim(), c.ffn_hidden);
        let (qw, kvw) = (c.n_heads * hd, c.n_kv_heads * hd);
        let w = qw + 2 * kvw;
        let (pf, pb) = (&self.params, &self.params_bf16);
        let s = self.stream();
        // attention block
        let (x_in, residual) = match prev_x_mid {
            Some(x_mid) => (x_mid, Some((branch, la.x.ptr))),
            None => (la.x.ptr, None),
        };
        self.timed("norms: forward", || {
            self.k.rmsnorm_forward(
                x_in,
                residual,
                pf.at(p.attn_norm),
                la.h_attn.ptr,
                la.rstd_attn.ptr,
                d,
                t,
                c.norm_eps,
            )
        })?;
        self.timed("products: qkv", || {
            self.blas
                .linear(la.qkv.ptr, w, la.h_attn.ptr, pb.at(p.wqkv), t, d, w, Out::Bf16, None)
        })?;
        let (q, k, v) = (addr(&la.attn_in.q, s), addr(&la.attn_in.k, s), addr(&la.attn_in.v, s));
        let hdims = self.heads_dims(b.batch, b.seq);
        self.timed("heads: QK-norm, rotary, layout", || {
            self.k.qkv_heads_forward(
                hdims,
                la.qkv.ptr,
                pf.at(p.q_norm),
                pf.at(p.k_norm),
                self.rope_cos.ptr,
                self.rope_sin.ptr,
                q,
                k,
                v,
                la.q_rstd.ptr,
                la.k_rstd.ptr,
            )
        })?;
        let (fwd, saved) = self.timed("attention forward", || {
            Ok(self.gpu.forward(&la.attn_in, &self.attn_cfg)?)
        })?;
        self.timed("heads: permutes", || {
            self.k
                .permute_heads(addr(&fwd.o, s), la.o_tok.ptr, b.batch, b.seq, c.n_heads, hd, true)
        })?;
        la.attn_out = keep.then_some((fwd, saved));
        // x_mid = x + bf16(o · W_oᵀ), the sum in the MLP norm (a BF16 product output, as under autocast).
        self.timed("products: wo", || {
            self.blas
                .linear(branch, d, la.o_tok.ptr, pb.at(p.wo), t, qw, d, Out::Bf16, None)
        })?;
        // MLP block
        self.timed("norms: forward", || {
            self.k.rmsnorm_forward(
                la.x.ptr,
                Some((branch, la.x_mid.ptr)),
                pf.at(p.mlp_norm),
                la.h_mlp.ptr,
                la.rstd_mlp.ptr,
                d,
                t,
                c.norm_eps,
            )
        })?;
        self.timed("products: gate|up", || {
            self.blas.linear(
                la.gate_up.ptr,
                2 * f,
                la.h_mlp.ptr,
                pb.at(p.w_gate_up),
                t,
                d,
                2 * f,
                Out::Bf16,
                None,
            )
        })?;
        self.timed("swiglu", || {
            self.k.swiglu_forward(la.gate_up.ptr, la.act.ptr, f, b.batch, b.seq)
        })?;
        self.timed("products: down", || {
            self.blas
                .linear(branch, d, la.act.ptr, pb.at(p.w_down), t, f, d, Out::Bf16, None)
        })
    }

    /// Logits in chunks of tokens, cross-entropy; with `grad_scale`, ∂hidden into `d_hidden` and
    /// the head's gradient.
    fn lm_head(&self, a: &Acts, t: usize, grad_scale: Option<f32>) -> Result<()> {
        let (d, v, vp) = (self.cfg.dim, self.cfg.vocab_size, self.padded_vocab());
        let head = self.params_bf16.at(self.head);
        for c0 in (0..t).step_by(HEAD_CHUNK) {
            let n = HEAD_CHUNK.min(t - c0);
            // All `vp` (padded) logits are computed: an odd output width (50,257) makes cuBLASLt fall back to
            // slow kernels (measured 95 TFLOP/s). The rows of the table past the vocabulary are the next
            // parameters or the zero padding of `params_bf16`: finite, and ignored by `xent`.
            // BF16 logits, as under PyTorch's autocast: half the bytes of FP32 for the product to write and
            // the cross-entropy to read, and the gradient overwrites them (no second buffer). The loss and
            // the softmax are computed in FP32 from them (train-check's tolerances count this rounding).
            self.timed("products: lm head", || {
                self.blas
                    .linear(a.logits.ptr, vp, a.hidden.at(c0 * d), head, n, d, vp, Out::Bf16, None)
            })?;
            let scale = grad_scale.unwrap_or(0.0);
            self.timed("cross-entropy", || {
                self.k.xent(
                    a.logits.ptr,
                    vp,
                    a.targets.at(c0),
                    a.row_loss.at(c0),
                    n,
                    v,
                    scale,
                    grad_scale.is_some(),
                )
            })?;
            if grad_scale.is_some() {
                // `logits` now holds ∂logits. Reduction over the padded width: `xent` wrote zeros into the padding columns.
                self.timed("products: lm head dx", || {
                    self.blas
                        .linear_dx(a.d_hidden.at(c0 * d), a.logits.ptr, vp, head, n, d, vp, Out::Bf16)
                })?;
                // Also over the padded width (at the odd width cuBLASLt ran it at 504 TFLOP/s, padded at 832: +3.5 %
                // tok/s): the padding columns of ∂logits are exactly zero, so the
                // `vp − v` gradient rows past the table get `+ 0` and keep their values — the next tensors'
                // gradients (tied: layer 0's), or the zero padding at the end of `grads` (untied head, the last tensor).
                self.timed("products: lm head dw", || {
                    self.blas.linear_dw(
                        self.grads.at(self.head),
                        a.logits.ptr,
                        vp,
                        a.hidden.at(c0 * d),
                        n,
                        d,
                        vp,
                    )
                })?;
            }
        }
        Ok(())
    }

    fn backward(&self, a: &mut Acts, t: usize) -> Result<()> {
        let c = &self.cfg;
        let d = c.dim;
        let s = self.stream();
        s.memset_zeros(&mut a.dx.data).map_err(|e| cuda_err("memset", e))?;
        self.timed("norms: backward + gain sums", || {
            self.k.rmsnorm_backward(
                a.d_hidden.ptr,
                a.x_final.ptr,
                self.params.at(self.final_norm),
                a.rstd_final.ptr,
                a.dx.ptr,
                a.dx_bf16.ptr,
                a.partial.ptr,
                self.grads.at(self.final_norm),
                d,
                t,
            )
        })?;
        for l in (0..c.n_layers).rev() {
            self.layer_backward(l, a, t)?;
        }
        let tokens = a.tokens.ptr;
        self.timed("embedding", || {
            self.k
                .embed_backward(tokens, a.dx.ptr, self.grads.at(self.tok_emb), t, d)
        })
    }

    fn layer_backward(&self, l: usize, a: &mut Acts, t: usize) -> Result<()> {
        let c = &self.cfg;
        let p = self.layers[l];
        let (d, hd, f) = (c.dim, c.head_dim(), c.ffn_hidden);
        let (qw, kvw) = (c.n_heads * hd, c.n_kv_heads * hd);
        let w = qw + 2 * kvw;
        let (pf, pb, g) = (&self.params, &self.params_bf16, &self.grads);
        let s = self.stream().clone();
        let (batch, seq) = (a.batch, a.seq);
        let la = &mut a.layers[l];
        // MLP block: out = x_mid + W_down · act. dx_bf16 is the BF16 copy of dx that the last
        // RMSNorm backward wrote.
        self.timed("products: down dx", || {
            self.blas
                .linear_dx(a.d_act.ptr, a.dx_bf16.ptr, d, pb.at(p.w_down), t, f, d, Out::Bf16)
        })?;
        self.timed("products: down dw", || {
            self.blas
                .linear_dw(g.at(p.w_down), a.dx_bf16.ptr, d, la.act.ptr, t, f, d)
        })?;
        self.timed("swiglu", || {
            self.k
                .swiglu_backward(a.d_act.ptr, la.gate_up.ptr, a.d_gate_up.ptr, f, batch, seq)
        })?;
        self.timed("products: gate|up dx", || {
            self.blas.linear_dx(
                a.dh.ptr,
                a.d_gate_up.ptr,
                2 * f,
                pb.at(p.w_gate_up),
                t,
                d,
                2 * f,
                Out::Bf16,
            )
        })?;
        self.timed("products: gate|up dw", || {
            self.blas
                .linear_dw(g.at(p.w_gate_up), a.d_gate_up.ptr, 2 * f, la.h_mlp.ptr, t, d, 2 * f)
        })?;
        self.timed("norms: backward + gain sums", || {
            self.k.rmsnorm_backward(
                a.dh.ptr,
                la.x_mid.ptr,
                pf.at(p.mlp_norm),
                la.rstd_mlp.ptr,
                a.dx.ptr,
                a.dx_bf16.ptr,
                a.partial.ptr,
                g.at(p.mlp_norm),
                d,
                t,
            )
        })?;
        // attention block: out = x + W_o · attention(...)
        self.timed("products: wo dx", || {
            self.blas
                .linear_dx(a.d_o_tok.ptr, a.dx_bf16.ptr, d, pb.at(p.wo), t, qw, d, Out::Bf16)
        })?;
        self.timed("products: wo dw", || {
            self.blas
                .linear_dw(g.at(p.wo), a.dx_bf16.ptr, d, la.o_tok.ptr, t, qw, d)
        })?;
        self.timed("heads: permutes", || {
            self.k
                .permute_heads(a.d_o_tok.ptr, addr(&a.d_o, &s), batch, seq, c.n_heads, hd, false)
        })?;
        let (fwd, saved) = la
            .attn_out
            .take()
            .ok_or_else(|| Error::Gpu("attention state missing in the backward".into()))?;
        let grads = self.timed("attention backward", || {
            Ok(self.gpu.backward(&la.attn_in, &fwd, &saved, &a.d_o)?)
        })?;
        let hdims = self.heads_dims(batch, seq);
        let (dq, dk, dv) = (addr(&grads.dq, &s), addr(&grads.dk, &s), addr(&grads.dv, &s));
        self.timed("heads: backward", || {
            self.k.qkv_heads_backward(
                hdims,
                dq,
                dk,
                dv,
                la.qkv.ptr,
                pf.at(p.q_norm),
                pf.at(p.k_norm),
                la.q_rstd.ptr,
                la.k_rstd.ptr,
                self.rope_cos.ptr,
                self.rope_sin.ptr,
                a.d_qkv.ptr,
                a.gain_partial.ptr,
            )
        })?;
        drop(grads);
        if c.qk_norm {
            // The heads backward's block partials `[2, blocks, hd]` (query gain, key gain).
            self.timed("norms: QK-norm gain sums", || {
                self.k
                    .sum_gain_partials(hdims, a.gain_partial.ptr, g.at(p.q_norm), g.at(p.k_norm))
            })?;
        }
        self.timed("products: qkv dx", || {
            self.blas
                .linear_dx(a.dh.ptr, a.d_qkv.ptr, w, pb.at(p.wqkv), t, d, w, Out::Bf16)
        })?;
        self.timed("products: qkv dw", || {
            self.blas
                .linear_dw(g.at(p.wqkv), a.d_qkv.ptr, w, la.h_attn.ptr, t, d, w)
        })?;
        self.timed("norms: backward + gain sums", || {
            self.k.rmsnorm_backward(
                a.dh.ptr,
                la.x.ptr,
                pf.at(p.attn_norm),
                la.rstd_attn.ptr,
                a.dx.ptr,
                a.dx_bf16.ptr,
                a.partial.ptr,
                g.at(p.attn_norm),
                d,
                t,
            )
        })
    }

    fn download_flat(&self, b: &Buf<f32>) -> Result<Weights> {
        let flat = self.stream().clone_dtoh(&b.data).map_err(|e| cuda_err("download", e))?;
        let mut w = Weights::zeros(&self.cfg);
        for slot in &self.slots {
            let t = w
                .get_mut(&slot.name)
                .ok_or_else(|| Error::Gpu(format!("tensor {} missing", slot.name)))?;
            t.copy_from_slice(&flat[slot.offset..slot.offset + slot.len]);
        }
        Ok(w)
    }
}

impl Drop for GpuEngine {
    /// Prints the profile (`SAGEBWD_PROFILE=1`).
    fn drop(&mut self) {
        if let Some(profile) = &self.profile {
            profile.print(self.attention.name());
        }
    }
}

impl Engine for GpuEngine {
    fn describe(&self) -> String {
        format!(
            "{} ({}), cuBLASLt BF16 products, attention {} (sagebwd-cuda)",
            self.gpu.dev.name,
            self.gpu.dev.arch,
            self.attention.name()
        )
    }

    fn zero_grads(&mut self) -> Result<()> {
        let s = self.stream().clone();
        s.memset_zeros(&mut self.grads.data).map_err(|e| cuda_err("memset", e))
    }

    fn forward_backward(&mut self, b: &Batch, grad_scale: f32) -> Result<f64> {
        Ok(self.run(b, Some(grad_scale))? / b.targets.len() as f64)
    }

    fn loss(&mut self, b: &Batch) -> Result<f64> {
        self.profile.as_ref().inspect(|p| p.set_paused(true));
        let loss = self.run(b, None);
        self.profile.as_ref().inspect(|p| p.set_paused(false));
        Ok(loss? / b.targets.len() as f64)
    }

    fn grad_norm(&mut self) -> Result<f64> {
        let n = self
            .k
            .sum_squares(self.grads.ptr, self.grads.data.len(), self.norm_partial.ptr)?;
        let partial = self
            .stream()
            .clone_dtoh(&self.norm_partial.data)
            .map_err(|e| cuda_err("download", e))?;
        Ok(partial[..n].iter().sum::<f64>().sqrt())
    }

    fn update(&mut self, lr: f32, grad_scale: f32) -> Result<()> {
        self.adam_t += 1;
        let c = &self.adamw;
        let bc1 = 1.0 - c.beta1.powi(self.adam_t as i32);
        let bc2 = 1.0 - c.beta2.powi(self.adam_t as i32);
        let (chunks, n_chunks) = (self.adam_chunks.ptr, self.adam_chunks.data.len());
        let (p, pb, g, m, v) = (
            self.params.ptr,
            self.params_bf16.ptr,
            self.grads.ptr,
            self.adam_m.ptr,
            self.adam_v.ptr,
        );
        self.timed("optimizer", || {
            self.k
                .adamw(p, pb, g, m, v, chunks, n_chunks, lr, c, bc1, bc2, grad_scale)
        })?;
        self.profile.as_ref().inspect(|p| p.step_done());
        Ok(())
    }

    fn gradients(&self) -> Result<Weights> {
        self.download_flat(&self.grads)
    }

    fn export(&self) -> Result<EngineState> {
        Ok(EngineState {
            weights: self.download_flat(&self.params)?,
            adam_m: self.download_flat(&self.adam_m)?,
            adam_v: self.download_flat(&self.adam_v)?,
            adam_t: self.adam_t,
        })
    }

    fn import(&mut self, st: EngineState) -> Result<()> {
        let s = self.stream().clone();
        upload_flat(&s, &st.weights, &mut self.params)?;
        upload_flat(&s, &st.adam_m, &mut self.adam_m)?;
        upload_flat(&s, &st.adam_v, &mut self.adam_v)?;
        self.adam_t = st.adam_t;
        self.refresh_bf16()
    }

    fn peak_memory(&self) -> Option<u64> {
        let high = self.pool.as_ref()?.high().ok()?;
        Some(high.saturating_sub(self.base_used))
    }

    fn energy_millijoules(&self) -> Option<u64> {
        self.energy.as_ref()?.millijoules().ok()
    }
}

/// The vocabulary rounded up to a multiple of 64: the LM head's product width (see `lm_head`).
fn padded_vocab(cfg: &ModelConfig) -> usize {
    cfg.vocab_size.div_ceil(64) * 64
}

/// Writes host weights (in `Weights::named` order) into a flat buffer.
fn upload_flat(s: &Arc<CudaStream>, w: &Weights, b: &mut Buf<f32>) -> Result<()> {
    let flat: Vec<f32> = w.tensors().into_iter().flat_map(|t| t.iter().copied()).collect();
    if flat.len() != b.data.len() {
        return Err(Error::Gpu(format!(
            "state has {} values, the model {}",
            flat.len(),
            b.data.len()
        )));
    }
    s.memcpy_htod(&flat, &mut b.data).map_err(|e| cuda_err("upload", e))
}

fn zeros<T: DeviceRepr + ValidAsZeroBits>(s: &Arc<CudaStream>, n: usize) -> Result<Buf<T>> {
    let data = s.alloc_zeros::<T>(n.max(1)).map_err(|e| cuda_err("allocation", e))?;
    let ptr = addr(&data, s);
    Ok(Buf { data, ptr })
}

/// A buffer filled with NaN (FP32) / NaN pairs (BF16) / 0x7fc00000 words, so that a value the step
/// forgets to write shows up as NaN in the loss or the gradients instead of stale data.
fn poisoned<T: DeviceRepr + ValidAsZeroBits>(k: &TrainKernels, s: &Arc<CudaStream>, n: usize) -> Result<Buf<T>> {
    let b = zeros::<T>(s, n)?;
    let words = (n.max(1) * std::mem::size_of::<T>()) / 4;
    if words > 0 {
        k.fill_u32(
            b.ptr,
            words,
            if std::mem::size_of::<T>() == 2 {
                0x7fc0_7fc0
            } else {
                POISON
            },
        )?;
    }
    Ok(b)
}
