//! SwiGLU: `a = silu(g) ∘ u` with `silu(g) = g · σ(g)`.

use rayon::prelude::*;

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

pub fn swiglu_forward(g: &[f32], u: &[f32]) -> Vec<f32> {
    g.par_iter()
        .zip(u.par_iter())
        .map(|(&g, &u)| g * sigmoid(g) * u)
        .collect()
}

/// Returns `(dg, du)`; `silu'(g) = σ(g) · (1 + g · (1 − σ(g)))`.
pub fn swiglu_backward(da: &[f32], g: &[f32], u: &[f32]) -> (Vec<f32>, Vec<f32>) {
    da.par_iter()
        .zip(g.par_iter())
        .zip(u.par_iter())
        .map(|((&da, &g), &u)| {
            let s = sigmoid(g);
            (da * u * s * (1.0 + g * (1.0 - s)), da * g * s)
        })
        .unzip()
}

use super::{linear, rmsnorm};
use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::model::Layer;

/// Activations the MLP block's backward needs.
pub struct MlpCache {
    x: Vec<f32>,
    h: Vec<f32>,
    rstd: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    act: Vec<f32>,
}

/// Returns `x + W_down (silu(W_gate h) ∘ W_up h)` with `h = RMSNorm(x)`, and the cache.
pub fn forward(be: &dyn Backend, cfg: &ModelConfig, p: &Layer, x: Vec<f32>) -> (Vec<f32>, MlpCache) {
    let (dim, f) = (cfg.dim, cfg.ffn_hidden);
    let mut h = vec![0.0f32; x.len()];
    let rstd = rmsnorm::forward(&x, &p.mlp_norm, cfg.norm_eps, &mut h);
    let gate = linear::forward(be, &h, &p.w_gate, dim, f);
    let up = linear::forward(be, &h, &p.w_up, dim, f);
    let act = swiglu_forward(&gate, &up);
    let mut out = linear::forward(be, &act, &p.w_down, f, dim);
    out.par_iter_mut().zip(x.par_iter()).for_each(|(y, r)| *y += r);
    (
        out,
        MlpCache {
            x,
            h,
            rstd,
            gate,
            up,
            act,
        },
    )
}

/// Given `∂L/∂out`, returns `∂L/∂x` and adds the weight gradients to `g`.
pub fn backward(
    be: &dyn Backend,
    cfg: &ModelConfig,
    p: &Layer,
    c: MlpCache,
    d_out: Vec<f32>,
    g: &mut Layer,
) -> Vec<f32> {
    let (dim, f) = (cfg.dim, cfg.ffn_hidden);
    let tokens = c.x.len() / dim;
    let mut d_act = vec![0.0f32; tokens * f];
    linear::backward(be, &d_out, &c.act, &p.w_down, f, dim, &mut d_act, &mut g.w_down);
    let (d_gate, d_up) = swiglu_backward(&d_act, &c.gate, &c.up);
    let mut dh = vec![0.0f32; tokens * dim];
    linear::backward(be, &d_gate, &c.h, &p.w_gate, dim, f, &mut dh, &mut g.w_gate);
    linear::backward(be, &d_up, &c.h, &p.w_up, dim, f, &mut dh, &mut g.w_up);
    let mut dx = d_out;
    rmsnorm::backward(&dh, &c.x, &p.mlp_norm, &c.rstd, &mut dx, &mut g.mlp_norm);
    dx
}
