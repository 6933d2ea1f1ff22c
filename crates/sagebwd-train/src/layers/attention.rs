//! The attention block: RMSNorm → Q, K, V projections → optional QK-norm → rotary → causal attention
//! (through the backend: exact or the quantized method) → output projection → residual add.

use super::{linear, rmsnorm, rotary::Rotary};
use crate::backend::{AttnShape, Backend};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::Layer;
use rayon::prelude::*;

/// Dimensions of one call: `tokens = batch × seq`.
#[derive(Clone, Copy)]
pub struct Dims {
    pub batch: usize,
    pub seq: usize,
}

/// Activations the backward needs.
pub struct AttnCache {
    x: Vec<f32>,
    h: Vec<f32>,
    rstd: Vec<f32>,
    /// Projections before QK-norm, `[tokens, heads·hd]`.
    q_proj: Vec<f32>,
    k_proj: Vec<f32>,
    q_rstd: Vec<f32>,
    k_rstd: Vec<f32>,
    /// Attention inputs and output, `[batch, heads, seq, hd]`.
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    o: Vec<f32>,
    /// `o` as `[tokens, heads·hd]`, the output projection's input.
    o_tokens: Vec<f32>,
}

fn attn_shape(cfg: &ModelConfig, d: Dims) -> AttnShape {
    AttnShape {
        batch: d.batch,
        heads_q: cfg.n_heads,
        heads_kv: cfg.n_kv_heads,
        seq: d.seq,
        head_dim: cfg.head_dim(),
    }
}

/// `[batch·seq, heads·hd]` → `[batch, heads, seq, hd]`, or back when `inverse`.
pub fn permute_heads(x: &[f32], d: Dims, heads: usize, hd: usize, inverse: bool) -> Vec<f32> {
    let mut out = vec![0.0f32; x.len()];
    out.par_chunks_mut(d.seq * heads * hd).enumerate().for_each(|(b, ob)| {
        let xb = &x[b * d.seq * heads * hd..(b + 1) * d.seq * heads * hd];
        for t in 0..d.seq {
            for h in 0..heads {
                let tok = (t * heads + h) * hd;
                let head = (h * d.seq + t) * hd;
                let (src, dst) = if inverse { (head, tok) } else { (tok, head) };
                ob[dst..dst + hd].copy_from_slice(&xb[src..src + hd]);
            }
        }
    });
    out
}

/// Returns `x + attention(x)` and the cache.
pub fn forward(
    be: &dyn Backend,
    cfg: &ModelConfig,
    rope: &Rotary,
    p: &Layer,
    x: Vec<f32>,
    d: Dims,
) -> Result<(Vec<f32>, AttnCache)> {
    let (dim, hd) = (cfg.dim, cfg.head_dim());
    let (q_width, kv_width) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
    let mut h = vec![0.0f32; x.len()];
    let rstd = rmsnorm::forward(&x, &p.attn_norm, cfg.norm_eps, &mut h);
    let q_proj = linear::forward(be, &h, &p.wq, dim, q_width);
    let k_proj = linear::forward(be, &h, &p.wk, dim, kv_width);
    let v_tok = linear::forward(be, &h, &p.wv, dim, kv_width);
    let (mut q_tok, mut k_tok) = (q_proj.clone(), k_proj.clone());
    let (mut q_rstd, mut k_rstd) = (Vec::new(), Vec::new());
    if cfg.qk_norm {
        q_rstd = rmsnorm::forward(&q_proj, &p.q_norm, cfg.norm_eps, &mut q_tok);
        k_rstd = rmsnorm::forward(&k_proj, &p.k_norm, cfg.norm_eps, &mut k_tok);
    }
    rope.apply(&mut q_tok, d.seq, cfg.n_heads, false);
    rope.apply(&mut k_tok, d.seq, cfg.n_kv_heads, false);
    let q = permute_heads(&q_tok, d, cfg.n_heads, hd, false);
    let k = permute_heads(&k_tok, d, cfg.n_kv_heads, hd, false);
    let v = permute_heads(&v_tok, d, cfg.n_kv_heads, hd, false);
    let o = be.attention_forward(attn_shape(cfg, d), &q, &k, &v)?;
    let o_tokens = permute_heads(&o, d, cfg.n_heads, hd, true);
    let mut out = linear::forward(be, &o_tokens, &p.wo, q_width, dim);
    out.par_iter_mut().zip(x.par_iter()).for_each(|(y, r)| *y += r);
    Ok((
        out,
        AttnCache {
            x,
            h,
            rstd,
            q_proj,
            k_proj,
            q_rstd,
            k_rstd,
            q,
            k,
            v,
            o,
            o_tokens,
        },
    ))
}

/// Given `d_out = ∂L/∂(x + attention(x))`, returns `∂L/∂x` and adds the weight gradients to `g`.
/// (The forward's arguments plus the cache, the upstream gradient and the gradient sink.)
#[allow(clippy::too_many_arguments)]
pub fn backward(
    be: &dyn Backend,
    cfg: &ModelConfig,
    rope: &Rotary,
    p: &Layer,
    c: AttnCache,
    d_out: Vec<f32>,
    g: &mut Layer,
    d: Dims,
) -> Result<Vec<f32>> {
    let (dim, hd) = (cfg.dim, cfg.head_dim());
    let (q_width, kv_width) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
    let tokens = d.batch * d.seq;
    let mut d_o_tokens = vec![0.0f32; tokens * q_width];
    linear::backward(be, &d_out, &c.o_tokens, &p.wo, q_width, dim, &mut d_o_tokens, &mut g.wo);
    let d_o = permute_heads(&d_o_tokens, d, cfg.n_heads, hd, false);
    let grads = be.attention_backward(attn_shape(cfg, d), &c.q, &c.k, &c.v, &c.o, &d_o)?;
    let mut dq_tok = permute_heads(&grads.dq, d, cfg.n_heads, hd, true);
    let mut dk_tok = permute_heads(&grads.dk, d, cfg.n_kv_heads, hd, true);
    let dv_tok = permute_heads(&grads.dv, d, cfg.n_kv_heads, hd, true);
    rope.apply(&mut dq_tok, d.seq, cfg.n_heads, true);
    rope.apply(&mut dk_tok, d.seq, cfg.n_kv_heads, true);
    if cfg.qk_norm {
        dq_tok = qk_norm_backward(&dq_tok, &c.q_proj, &p.q_norm, &c.q_rstd, &mut g.q_norm);
        dk_tok = qk_norm_backward(&dk_tok, &c.k_proj, &p.k_norm, &c.k_rstd, &mut g.k_norm);
    }
    let mut dh = vec![0.0f32; tokens * dim];
    linear::backward(be, &dq_tok, &c.h, &p.wq, dim, q_width, &mut dh, &mut g.wq);
    linear::backward(be, &dk_tok, &c.h, &p.wk, dim, kv_width, &mut dh, &mut g.wk);
    linear::backward(be, &dv_tok, &c.h, &p.wv, dim, kv_width, &mut dh, &mut g.wv);
    let mut dx = d_out; // the residual path
    rmsnorm::backward(&dh, &c.x, &p.attn_norm, &c.rstd, &mut dx, &mut g.attn_norm);
    Ok(dx)
}

fn qk_norm_backward(dy: &[f32], x: &[f32], gain: &[f32], rstd: &[f32], dgain: &mut [f32]) -> Vec<f32> {
    let mut dx = vec![0.0f32; dy.len()];
    rmsnorm::backward(dy, x, gain, rstd, &mut dx, dgain);
    dx
}
