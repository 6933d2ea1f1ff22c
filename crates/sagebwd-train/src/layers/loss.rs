//! The LM head and softmax cross-entropy, fused and computed in chunks of tokens so that the
//! `tokens × vocab` logits never exist at once (50257 logits per token).

use crate::backend::{gemm::transpose, Backend};
use rayon::prelude::*;

/// Tokens per chunk: 256 × 50257 f32 logits are 51 MB.
const CHUNK: usize = 256;

/// Where the backward writes: `d_hidden += ∂L/∂hidden`, `d_table += ∂L/∂table`, for the loss
/// `scale · Σ_tokens −log p(target)`.
pub struct LossGrad<'a> {
    pub scale: f32,
    pub d_hidden: &'a mut [f32],
    pub d_table: &'a mut [f32],
}

/// Sum over tokens of `−ln p(target)` (nats, f64), with logits `hidden · tableᵀ` (`table` is
/// `[vocab, dim]`); with `grad`, also the backward.
pub fn lm_head_loss(
    be: &dyn Backend,
    hidden: &[f32],
    table: &[f32],
    dim: usize,
    targets: &[u32],
    mut grad: Option<LossGrad>,
) -> f64 {
    let vocab = table.len() / dim;
    let table_t = transpose(table, vocab, dim);
    let mut total = 0.0f64;
    // One buffer for all chunks: allocating 51 MB per chunk costs page faults every time.
    let mut buffer = vec![0.0f32; CHUNK.min(targets.len()) * vocab];
    for c0 in (0..targets.len()).step_by(CHUNK) {
        let c = CHUNK.min(targets.len() - c0);
        let h = &hidden[c0 * dim..(c0 + c) * dim];
        let logits = &mut buffer[..c * vocab];
        be.gemm(logits, h, &table_t, c, dim, vocab, false);
        let scale = grad.as_ref().map(|g| g.scale);
        let losses: Vec<f64> = logits
            .par_chunks_mut(vocab)
            .zip(&targets[c0..c0 + c])
            .map(|(row, &t)| softmax_xent_row(row, t as usize, scale))
            .collect();
        total += losses.iter().sum::<f64>();
        if let Some(g) = grad.as_mut() {
            // `logits` now holds ∂L/∂logits.
            be.gemm(&mut g.d_hidden[c0 * dim..(c0 + c) * dim], logits, table, c, vocab, dim, true);
            be.gemm_at(g.d_table, logits, h, vocab, c, dim, true);
        }
    }
    total
}

/// Returns `−ln softmax(row)[target]`; with `scale`, overwrites `row` with
/// `scale · (softmax(row) − onehot(target))`.
fn softmax_xent_row(row: &mut [f32], target: usize, scale: Option<f32>) -> f64 {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &z| m.max(z));
    let target_logit = row[target];
    let mut sum = 0.0f64;
    for z in row.iter_mut() {
        *z = (*z - max).exp();
        sum += *z as f64;
    }
    let loss = max as f64 + sum.ln() - target_logit as f64;
    if let Some(scale) = scale {
        let k = (scale as f64 / sum) as f32;
        row.iter_mut().for_each(|p| *p *= k);
        row[target] -= scale;
    }
    loss
}
