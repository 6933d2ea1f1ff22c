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
    // Exponentials in chunks of 8 (vectorized, no libm call), summed in f64 per chunk.
    let mut sum = 0.0f64;
    for chunk in row.chunks_mut(8) {
        let mut part = 0.0f32;
        for z in chunk.iter_mut() {
            *z = exp_nonpositive(*z - max);
            part += *z;
        }
        sum += part as f64;
    }
    let loss = max as f64 + sum.ln() - target_logit as f64;
    if let Some(scale) = scale {
        let k = (scale as f64 / sum) as f32;
        row.iter_mut().for_each(|p| *p *= k);
        row[target] -= scale;
    }
    loss
}

/// `e^x` for `x ≤ 0` (softmax arguments after subtracting the maximum), branch-free so that loops
/// over it vectorize: `e^x = 2^n · 2^f` with `n = round(x·log₂e)`, `|f| ≤ 1/2`, and `2^f` from its
/// degree-6 Taylor polynomial (truncation below 2e-7 relative). Results below `e^-87` flush to 0,
/// which is what an f32 softmax probability that small is anyway.
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    const SHIFTER: f32 = 12_582_912.0; // 1.5 · 2^23: adding and subtracting it rounds to an integer
    let t = x.max(-87.0) * std::f32::consts::LOG2_E;
    let n = (t + SHIFTER) - SHIFTER;
    let f = (t - n) * std::f32::consts::LN_2;
    let p = 1.0 + f * (1.0 + f * (0.5 + f * (1.0 / 6.0 + f * (1.0 / 24.0 + f * (1.0 / 120.0 + f * (1.0 / 720.0))))));
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    let y = p * scale;
    if x < -87.0 { 0.0 } else { y }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_is_accurate_on_the_softmax_range() {
        let mut worst = 0.0f64;
        for i in 0..=200_000 {
            let x = -(i as f32) * 87.0 / 200_000.0;
            let want = (x as f64).exp();
            worst = worst.max((exp_nonpositive(x) as f64 - want).abs() / want);
        }
        // The error is dominated by rounding x·log₂e to f32 (2^-24 relative of up to 126), ≈ 5e-6 at
        // the far end; near 0, where probabilities matter, it is a few ulps.
        assert!(worst < 1e-5, "worst relative error {worst:e}");
        assert!((exp_nonpositive(-1e-3) as f64 - (-1e-3f64).exp()).abs() < 3e-7);
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-100.0), 0.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
    }
}
