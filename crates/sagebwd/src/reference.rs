//! Exact attention forward and backward in f64: the oracle everything else is measured against.
//!
//! Per (batch, query head): `P = softmax(c Q Kᵀ + mask)`, `O = P V`, `D = rowsum(dO ∘ O)`,
//! `dP = dO Vᵀ`, `dS = P ∘ (dP − D)`, `dQ = c dS K`, `dK = c dSᵀ Q`, `dV = Pᵀ dO`; dK and dV of the
//! query heads that share a kv head (GQA) are summed. Rows are independent, so they run in parallel;
//! dK and dV are reduced over rows in parallel chunks of keys.

use crate::error::Result;
use crate::tensor::{Inputs, Shape};
use rayon::prelude::*;

/// Exact gradients.
#[derive(Clone, Debug, Default)]
pub struct ExactGrads {
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
    /// `D = rowsum(dO ∘ O)`, `[B, H_q, N_q]`.
    pub delta: Vec<f64>,
}

/// Exact intermediates `P = softmax(c Q Kᵀ)`, `dP = dO Vᵀ`, `dS = P ∘ (dP − D)`, each `[B, H_q, N_q, N_k]`.
#[derive(Clone, Debug, Default)]
pub struct ExactInter {
    pub p: Vec<f64>,
    pub dp: Vec<f64>,
    pub ds: Vec<f64>,
}

/// Exact results, same layouts as the simulator's.
#[derive(Clone, Debug, Default)]
pub struct Exact {
    pub o: Vec<f64>,
    /// Natural log-sum-exp of `c Q Kᵀ` per query row (`+∞` for a row that sees no key).
    pub lse: Vec<f64>,
    pub grads: Option<ExactGrads>,
    pub inter: Option<ExactInter>,
}

/// Keys visible to query row `r` under the end-aligned causal mask (ALGORITHM.md §8): `0..visible`.
#[inline]
pub fn visible_keys(shape: &Shape, causal: bool, r: usize) -> usize {
    if !causal {
        return shape.n_k;
    }
    // Key j is visible iff j <= r + (n_k - n_q).
    let count = r as i64 + shape.n_k as i64 - shape.n_q as i64 + 1;
    count.clamp(0, shape.n_k as i64) as usize
}

#[inline]
fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[inline]
fn axpy(y: &mut [f64], a: f64, x: &[f64]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
}

/// One query head's gradients: dQ, dK, dV, D.
type HeadGrads = (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>);

/// One query head's results.
struct Head {
    o: Vec<f64>,
    lse: Vec<f64>,
    grads: Option<HeadGrads>,
    inter: Option<(Vec<f64>, Vec<f64>, Vec<f64>)>,
}

fn head(s: &Shape, causal: bool, q: &[f64], k: &[f64], v: &[f64], d_o: Option<&[f64]>, want: bool) -> Head {
    let (nq, nk, d) = (s.n_q, s.n_k, s.head_dim);
    let c = s.softmax_scale();
    // P and lse, row by row.
    let mut p = vec![0.0f64; nq * nk];
    let mut lse = vec![f64::INFINITY; nq];
    p.par_chunks_mut(nk)
        .zip(lse.par_iter_mut())
        .enumerate()
        .for_each(|(r, (prow, lse_r))| {
            let vis = visible_keys(s, causal, r);
            if vis == 0 {
                return;
            }
            let qr = &q[r * d..(r + 1) * d];
            let mut m = f64::NEG_INFINITY;
            for j in 0..vis {
                prow[j] = c * dot(qr, &k[j * d..(j + 1) * d]);
                m = m.max(prow[j]);
            }
            let mut l = 0.0;
            for x in &mut prow[..vis] {
                *x = (*x - m).exp();
                l += *x;
            }
            prow[..vis].iter_mut().for_each(|x| *x /= l);
            *lse_r = m + l.ln();
        });
    let mut o = vec![0.0f64; nq * d];
    o.par_chunks_mut(d).enumerate().for_each(|(r, orow)| {
        for (j, &pj) in p[r * nk..(r + 1) * nk].iter().enumerate() {
            if pj != 0.0 {
                axpy(orow, pj, &v[j * d..(j + 1) * d]);
            }
        }
    });
    let Some(d_o) = d_o else {
        return Head {
            o,
            lse,
            grads: None,
            inter: want.then(|| (p, vec![], vec![])),
        };
    };
    let delta: Vec<f64> = (0..nq)
        .map(|r| dot(&o[r * d..(r + 1) * d], &d_o[r * d..(r + 1) * d]))
        .collect();
    let mut dp = vec![0.0f64; nq * nk];
    let mut ds = vec![0.0f64; nq * nk];
    let mut dq = vec![0.0f64; nq * d];
    dp.par_chunks_mut(nk)
        .zip(ds.par_chunks_mut(nk))
        .zip(dq.par_chunks_mut(d))
        .enumerate()
        .for_each(|(r, ((dprow, dsrow), dqrow))| {
            let dor = &d_o[r * d..(r + 1) * d];
            for j in 0..visible_keys(s, causal, r) {
                dprow[j] = dot(dor, &v[j * d..(j + 1) * d]);
                dsrow[j] = p[r * nk + j] * (dprow[j] - delta[r]);
                axpy(dqrow, c * dsrow[j], &k[j * d..(j + 1) * d]);
            }
        });
    // dK = c dSᵀ Q and dV = Pᵀ dO, in parallel chunks of keys (reads stay row-contiguous).
    const CHUNK: usize = 16;
    let mut dk = vec![0.0f64; nk * d];
    let mut dv = vec![0.0f64; nk * d];
    dk.par_chunks_mut(CHUNK * d)
        .zip(dv.par_chunks_mut(CHUNK * d))
        .enumerate()
        .for_each(|(ci, (dkc, dvc))| {
            let j0 = ci * CHUNK;
            for r in 0..nq {
                let (qr, dor) = (&q[r * d..(r + 1) * d], &d_o[r * d..(r + 1) * d]);
                for jj in 0..dkc.len() / d {
                    let (dsv, pv) = (ds[r * nk + j0 + jj], p[r * nk + j0 + jj]);
                    if dsv != 0.0 {
                        axpy(&mut dkc[jj * d..(jj + 1) * d], c * dsv, qr);
                    }
                    if pv != 0.0 {
                        axpy(&mut dvc[jj * d..(jj + 1) * d], pv, dor);
                    }
                }
            }
        });
    Head {
        o,
        lse,
        grads: Some((dq, dk, dv, delta)),
        inter: want.then_some((p, dp, ds)),
    }
}

/// Exact attention on `inp` (its values taken as they are, in f64).
pub fn exact(inp: &Inputs, want_intermediates: bool) -> Result<Exact> {
    inp.validate()?;
    let s = inp.shape;
    let (d, nq, nk) = (s.head_dim, s.n_q, s.n_k);
    let up = |t: &[f32]| t.iter().map(|&x| x as f64).collect::<Vec<f64>>();
    let (q, k, v) = (up(&inp.q), up(&inp.k), up(&inp.v));
    let d_o = inp.d_o.as_deref().map(up);
    let heads: Vec<Head> = (0..s.batch * s.heads_q)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / s.heads_q, bh % s.heads_q);
            let kvh = b * s.heads_kv + h / s.group();
            let qs = &q[bh * nq * d..(bh + 1) * nq * d];
            let ks = &k[kvh * nk * d..(kvh + 1) * nk * d];
            let vs = &v[kvh * nk * d..(kvh + 1) * nk * d];
            let dos = d_o.as_ref().map(|t| &t[bh * nq * d..(bh + 1) * nq * d]);
            head(&s, inp.causal, qs, ks, vs, dos, want_intermediates)
        })
        .collect();
    let mut out = Exact::default();
    let has_grads = d_o.is_some();
    let mut grads = ExactGrads {
        dk: vec![0.0; s.kv_len()],
        dv: vec![0.0; s.kv_len()],
        ..Default::default()
    };
    let mut inter = ExactInter::default();
    for (bh, hd) in heads.into_iter().enumerate() {
        out.o.extend(hd.o);
        out.lse.extend(hd.lse);
        if let Some((dq, dk, dv, delta)) = hd.grads {
            let kvh = (bh / s.heads_q) * s.heads_kv + (bh % s.heads_q) / s.group();
            let range = kvh * nk * d..(kvh + 1) * nk * d;
            grads.dk[range.clone()].iter_mut().zip(&dk).for_each(|(a, b)| *a += b);
            grads.dv[range].iter_mut().zip(&dv).for_each(|(a, b)| *a += b);
            grads.dq.extend(dq);
            grads.delta.extend(delta);
        }
        if let Some((p, dp, ds)) = hd.inter {
            inter.p.extend(p);
            inter.dp.extend(dp);
            inter.ds.extend(ds);
        }
    }
    out.grads = has_grads.then_some(grads);
    out.inter = want_intermediates.then_some(inter);
    Ok(out)
}
