//! A bias-free linear layer `y = x Wᵀ` with `W` stored `[out, in]` (as PyTorch does).

use crate::backend::{gemm::transpose, Backend};

/// `y[tokens, out] = x[tokens, in] · Wᵀ`.
pub fn forward(be: &dyn Backend, x: &[f32], w: &[f32], n_in: usize, n_out: usize) -> Vec<f32> {
    let tokens = x.len() / n_in;
    let w_t = transpose(w, n_out, n_in);
    let mut y = vec![0.0f32; tokens * n_out];
    be.gemm(&mut y, x, &w_t, tokens, n_in, n_out, false);
    y
}

/// Adds `dy · W` to `dx` and `dyᵀ · x` to `dw`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    be: &dyn Backend,
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    n_in: usize,
    n_out: usize,
    dx: &mut [f32],
    dw: &mut [f32],
) {
    let tokens = x.len() / n_in;
    be.gemm(dx, dy, w, tokens, n_out, n_in, true);
    be.gemm_at(dw, dy, x, n_out, tokens, n_in, true);
}
