//! The LM head and softmax cross-entropy, fused and computed in chunks of tokens so that the
//! `tokens × vocab` logits never exist at once (50257 logits per token).
//!
//! The logits are computed transposed, `[vocab, tokens]` = `table · hiddenᵀ`: the embedding table is
//! then read row by row as stored (no transpose of the 50257 × dim table), the three products (logits,
//! ∂hidden, ∂table) have the shapes the GEMM runs fastest, and the softmax runs down the vocabulary
//! with the tokens of a chunk as vector lanes.

use crate::backend::{gemm::transpose, Backend};
use rayon::prelude::*;

/// Tokens per chunk: 64 × 50257 f32 logits are 13 MB, which the softmax passes and the two backward
/// products re-read from cache (measured on 2 cores: 64 tokens per chunk made forward + backward of
/// the tiny model 1.3× faster than 256).
const CHUNK: usize = 64;
/// Vocabulary rows per parallel task in the softmax passes.
const ROWS_PER_TASK: usize = 512;

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
    let mut total = 0.0f64;
    // One buffer for all chunks: allocating 51 MB per chunk costs page faults every time.
    let mut buffer = vec![0.0f32; CHUNK.min(targets.len()) * vocab];
    for c0 in (0..targets.len()).step_by(CHUNK) {
        let c = CHUNK.min(targets.len() - c0);
        let h = &hidden[c0 * dim..(c0 + c) * dim];
        let logits_t = &mut buffer[..vocab * c];
        be.gemm(logits_t, table, &transpose(h, c, dim), vocab, dim, c, false);
        let scale = grad.as_ref().map(|g| g.scale);
        total += softmax_xent_columns(logits_t, c, &targets[c0..c0 + c], scale);
        if let Some(g) = grad.as_mut() {
            // `logits_t` now holds ∂L/∂logitsᵀ.
            be.gemm_at(
                &mut g.d_hidden[c0 * dim..(c0 + c) * dim],
                logits_t,
                table,
                c,
                vocab,
                dim,
                true,
            );
            be.gemm(g.d_table, logits_t, h, vocab, c, dim, true);
        }
    }
    total
}

/// For logits stored `[vocab, c]` (column `j` is token `j`), returns `Σ_j −ln softmax(column j)[t_j]`;
/// with `scale`, overwrites the logits with `scale · (softmax − onehot(target))`. Maxima and sums are
/// combined over row blocks in block order, so the result does not depend on the thread count.
fn softmax_xent_columns(l: &mut [f32], c: usize, targets: &[u32], scale: Option<f32>) -> f64 {
    let target_logit: Vec<f32> = targets
        .iter()
        .enumerate()
        .map(|(j, &t)| l[t as usize * c + j])
        .collect();
    let block_max: Vec<Vec<f32>> = l
        .par_chunks(ROWS_PER_TASK * c)
        .map(|blk| {
            let mut m = vec![f32::NEG_INFINITY; c];
            for row in blk.chunks_exact(c) {
                m.iter_mut()
                    .zip(row)
                    .for_each(|(m, &z)| *m = if z > *m { z } else { *m });
            }
            m
        })
        .collect();
    let mut max = vec![f32::NEG_INFINITY; c];
    for bm in &block_max {
        max.iter_mut().zip(bm).for_each(|(m, &z)| *m = m.max(z));
    }
    let block_sum: Vec<Vec<f64>> = l
        .par_chunks_mut(ROWS_PER_TASK * c)
        .map(|blk| {
            let mut s = vec![0.0f64; c];
            for row in blk.chunks_exact_mut(c) {
                for ((z, &m), s) in row.iter_mut().zip(&max).zip(s.iter_mut()) {
                    *z = exp_nonpositive(*z - m);
                    *s += *z as f64;
                }
            }
            s
        })
        .collect();
    let mut sum = vec![0.0f64; c];
    for bs in &block_sum {
        sum.iter_mut().zip(bs).for_each(|(s, &b)| *s += b);
    }
    let loss: f64 = (0..c)
        .map(|j| max[j] as f64 + sum[j].ln() - target_logit[j] as f64)
        .sum();
    if let Some(scale) = scale {
        let k: Vec<f32> = sum.iter().map(|&s| (scale as f64 / s) as f32).collect();
        l.par_chunks_mut(c)
            .for_each(|row| row.iter_mut().zip(&k).for_each(|(p, &k)| *p *= k));
        for (j, &t) in targets.iter().enumerate() {
            l[t as usize * c + j] -= scale;
        }
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
    if x < -87.0 {
        0.0
    } else {
        y
    }
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
