//! RMSNorm: `y = x · g / sqrt(mean(x²) + ε)` over rows of width `n`.

use super::ROW_CHUNK;
use rayon::prelude::*;

/// Writes `y` and returns `rstd = 1/sqrt(mean(x²) + ε)` per row (the backward needs it).
pub fn forward(x: &[f32], gain: &[f32], eps: f32, y: &mut [f32]) -> Vec<f32> {
    let n = gain.len();
    let mut rstd = vec![0.0f32; x.len() / n];
    y.par_chunks_mut(n)
        .zip(x.par_chunks(n))
        .zip(rstd.par_iter_mut())
        .for_each(|((yr, xr), rs)| {
            let ms = xr.iter().map(|v| v * v).sum::<f32>() / n as f32;
            *rs = 1.0 / (ms + eps).sqrt();
            yr.iter_mut()
                .zip(xr)
                .zip(gain)
                .for_each(|((o, &v), &g)| *o = v * *rs * g);
        });
    rstd
}

/// Adds the input gradient to `dx` and the gain gradient to `dgain`.
///
/// With `u = g ∘ dy`: `dx = rstd · u − x · rstd³ · (u·x) / n`, `dg = Σ_rows dy ∘ x · rstd`.
pub fn backward(dy: &[f32], x: &[f32], gain: &[f32], rstd: &[f32], dx: &mut [f32], dgain: &mut [f32]) {
    let n = gain.len();
    let partial: Vec<Vec<f32>> = dx
        .par_chunks_mut(n * ROW_CHUNK)
        .enumerate()
        .map(|(c, dx_chunk)| {
            let mut dg = vec![0.0f32; n];
            for (i, dxr) in dx_chunk.chunks_mut(n).enumerate() {
                let row = c * ROW_CHUNK + i;
                let (xr, dyr, rs) = (&x[row * n..(row + 1) * n], &dy[row * n..(row + 1) * n], rstd[row]);
                let ux: f32 = dyr.iter().zip(gain).zip(xr).map(|((d, g), v)| d * g * v).sum();
                let coef = rs * rs * rs * ux / n as f32;
                for j in 0..n {
                    dxr[j] += rs * gain[j] * dyr[j] - xr[j] * coef;
                    dg[j] += dyr[j] * xr[j] * rs;
                }
            }
            dg
        })
        .collect();
    for dg in partial {
        dgain.iter_mut().zip(&dg).for_each(|(a, b)| *a += b);
    }
}
