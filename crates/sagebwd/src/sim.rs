//! Simulator of the quantized method: follows `docs/ALGORITHM.md` step by step (same groups, scales,
//! rounding, scale order, BF16 rounding of 16-bit operands), so that GPU kernels can be compared with
//! it value by value.

use crate::config::{Config, DeltaFrom, Format, Fp8OperandScale, Precision, Product};
use crate::error::Result;
use crate::fp8::Fp8;
use crate::quant::{dequant, dequant_add, quantize_rows, GroupScale};
use crate::reference::visible_keys;
use crate::tensor::{bf16, Inputs, Shape};
use rayon::prelude::*;
use std::f32::consts::{LN_2, LOG2_E};

/// The quantized operands and scales of ALGORITHM.md §2.1 / §3 (layouts as listed there).
#[derive(Clone, Debug, Default)]
pub struct Quantized {
    /// `[B, H_q, N_q, d]`, quantized from `Q_s`.
    pub q_hat: Vec<i8>,
    /// `[B, H_q, ⌈N_q/B_q⌉]`.
    pub q_scale: Vec<f32>,
    /// `[B, H_kv, N_k, d]`, quantized from `K_s = K − K_m`.
    pub k_hat: Vec<i8>,
    /// `[B, H_kv, ⌈N_k/B_kv⌉]`.
    pub k_scale: Vec<f32>,
    /// `[B, H_kv, N_k, d]`.
    pub v_hat: Vec<i8>,
    /// `[B, H_kv, ⌈N_k/B_kv⌉]`.
    pub v_scale: Vec<f32>,
    /// `[B, H_kv, d]` (zeros when K-smoothing is off).
    pub k_mean: Vec<f32>,
    /// `[B, H_q, N_q]`: `b_r = fl(cλ · q_r·K_m)`, the base-2 score offset that K-smoothing removes
    /// from row `r` (zeros when K-smoothing is off; ALGORITHM.md §3).
    pub row_offset: Vec<f32>,
    /// `[B, H_q, ⌈N_q/B_q⌉, d]` when Q-smoothing is on, else empty.
    pub q_mean: Vec<f32>,
    /// `[B, H_q, N_q, d]` when dO was given, else empty.
    pub do_hat: Vec<i8>,
    /// `[B, H_q, ⌈N_q/B_q⌉]` when dO was given, else empty.
    pub do_scale: Vec<f32>,
}

/// Forward results.
#[derive(Clone, Debug, Default)]
pub struct Forward {
    /// `[B, H_q, N_q, d]`, BF16 values.
    pub o: Vec<f32>,
    /// `[B, H_q, N_q]`, base-2 log-sum-exp of the smoothed scores (ALGORITHM.md §4).
    pub lse2: Vec<f32>,
    /// `[B, H_q, N_q]`, natural log-sum-exp of the true scores `c Q Kᵀ` (the exported LSE).
    pub lse: Vec<f32>,
}

/// Backward results.
#[derive(Clone, Debug, Default)]
pub struct Gradients {
    /// `[B, H_q, N_q, d]`, BF16 values.
    pub dq: Vec<f32>,
    /// `[B, H_kv, N_k, d]`, BF16 values.
    pub dk: Vec<f32>,
    /// `[B, H_kv, N_k, d]`, BF16 values.
    pub dv: Vec<f32>,
    /// `[B, H_q, N_q]`, `D = rowsum(dO ∘ O)`.
    pub delta: Vec<f32>,
}

/// The backward intermediates of ALGORITHM.md §6, each `[B, H_q, N_q, N_k]`.
#[derive(Clone, Debug, Default)]
pub struct Intermediates {
    pub p: Vec<f32>,
    pub dp: Vec<f32>,
    pub ds: Vec<f32>,
}

/// Everything one simulation produces.
#[derive(Clone, Debug, Default)]
pub struct SimOutput {
    pub quant: Quantized,
    pub fwd: Forward,
    /// Present when the inputs carry dO.
    pub grads: Option<Gradients>,
    /// Present when asked for and the inputs carry dO.
    pub inter: Option<Intermediates>,
}

/// Runs the quantized method of `cfg` on `inp` (inputs are rounded to BF16 first).
pub fn simulate(inp: &Inputs, cfg: &Config, want_intermediates: bool) -> Result<SimOutput> {
    simulate_with(inp, cfg, want_intermediates, bf16)
}

/// Keeps a value as it is: the simulator with this instead of `bf16` runs its 16-bit products in
/// FP32, which is how the tests check its structure against the exact reference to float tolerance.
pub fn keep_f32(x: f32) -> f32 {
    x
}

/// [`simulate`] with the rounding `r16` applied wherever ALGORITHM.md rounds to BF16
/// (operands of 16-bit products, outputs); `bf16` is the method, [`keep_f32`] a test instrument.
pub fn simulate_with(inp: &Inputs, cfg: &Config, want_intermediates: bool, r16: fn(f32) -> f32) -> Result<SimOutput> {
    cfg.validate()?;
    let mut inp = inp.clone();
    inp.validate()?;
    inp.q
        .iter_mut()
        .chain(&mut inp.k)
        .chain(&mut inp.v)
        .for_each(|x| *x = r16(*x));
    if let Some(d) = &mut inp.d_o {
        d.iter_mut().for_each(|x| *x = r16(*x));
    }
    let s = inp.shape;
    let prep = prepare(&inp, cfg);
    let heads: Vec<(Forward, Option<HeadGrads>)> = (0..s.batch * s.heads_q)
        .into_par_iter()
        .map(|bh| {
            let h = HeadCtx::new(&inp, cfg, &prep, bh, r16);
            if cfg.pds.is_default() {
                let fwd = h.forward();
                let grads = inp.d_o.as_ref().map(|_| h.backward(&fwd, want_intermediates));
                (fwd, grads)
            } else {
                let v = Fp8Copies::new(&h, &prep, bh);
                let (fwd, o_prime) = h.forward_pds(&v);
                let grads = inp
                    .d_o
                    .as_ref()
                    .map(|_| h.backward_pds(&v, &fwd, o_prime.as_deref(), want_intermediates));
                (fwd, grads)
            }
        })
        .collect();
    Ok(assemble(&inp, prep, heads, want_intermediates, r16))
}

/// Quantized operands, plus the smoothed K the Q-smoothing bias needs.
struct Prepared {
    quant: Quantized,
    /// `K_s = K − K_m` in FP32, `[B, H_kv, N_k, d]`.
    k_s: Vec<f32>,
}

fn mean_rows(x: &[f32], d: usize) -> Vec<f32> {
    let n = x.len() / d;
    let mut sum = vec![0.0f64; d];
    for row in x.chunks(d) {
        sum.iter_mut().zip(row).for_each(|(s, &v)| *s += v as f64);
    }
    sum.iter().map(|s| (s / n as f64) as f32).collect()
}

/// ALGORITHM.md §3: smoothing and quantization of Q, K, V, dO.
fn prepare(inp: &Inputs, cfg: &Config) -> Prepared {
    let s = inp.shape;
    let d = s.head_dim;
    let mut qz = Quantized::default();
    let mut k_s = Vec::with_capacity(s.kv_len());
    for kh in inp.k.chunks(s.n_k * d) {
        let mean = if cfg.smooth_k { mean_rows(kh, d) } else { vec![0.0; d] };
        for row in kh.chunks(d) {
            k_s.extend(row.iter().zip(&mean).map(|(x, m)| x - m));
        }
        qz.k_mean.extend(mean);
    }
    let per_head = |t: &[f32], n: usize, block: usize| -> (Vec<i8>, Vec<f32>) {
        let (mut hat, mut scale) = (Vec::new(), Vec::new());
        for th in t.chunks(n * d) {
            let (h, sc) = quantize_rows(th, d, block);
            hat.extend(h);
            scale.extend(sc);
        }
        (hat, scale)
    };
    (qz.k_hat, qz.k_scale) = per_head(&k_s, s.n_k, cfg.block_kv);
    (qz.v_hat, qz.v_scale) = per_head(&inp.v, s.n_k, cfg.block_kv);
    let mut q_s = Vec::with_capacity(s.q_len());
    for qh in inp.q.chunks(s.n_q * d) {
        for qblock in qh.chunks(cfg.block_q * d) {
            if cfg.smooth_q {
                let mean = mean_rows(qblock, d);
                for row in qblock.chunks(d) {
                    q_s.extend(row.iter().zip(&mean).map(|(x, m)| x - m));
                }
                qz.q_mean.extend(mean);
            } else {
                q_s.extend_from_slice(qblock);
            }
        }
    }
    (qz.q_hat, qz.q_scale) = per_head(&q_s, s.n_q, cfg.block_q);
    if let Some(d_o) = &inp.d_o {
        (qz.do_hat, qz.do_scale) = per_head(d_o, s.n_q, cfg.block_q);
    }
    // b_r = fl(cλ · fl(Σ_d Q[r]·K_m)) per query row, with the K_m of its kv head.
    let c_log2e = s.softmax_scale() as f32 * LOG2_E;
    qz.row_offset = inp
        .q
        .chunks(d)
        .enumerate()
        .map(|(row, q)| {
            let bh = row / s.n_q;
            let kvh = (bh / s.heads_q) * s.heads_kv + (bh % s.heads_q) / s.group();
            let km = &qz.k_mean[kvh * d..(kvh + 1) * d];
            c_log2e * q.iter().zip(km).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() as f32
        })
        .collect();
    Prepared { k_s, quant: qz }
}

/// The INT8 forward's lazy rescaling (ALGORITHM.md §4), in base-2 units: the running max moves to a
/// key block's row max only when that exceeds it by more than this, so `p = exp2(t − m) ≤ 2⁸` (up to
/// the rounding of `fl(m + 8)`) and most blocks leave `m`, and so `O`, unrescaled (`α = 1`). With
/// BF16 #1 the running max is the eager `max(m, row max)`.
pub const RESCALE_SLACK: f32 = 8.0;

/// The INT8 forward's running max after a key block whose row max is `row_max` (ALGORITHM.md §4): `fl(−∞ + 8) = −∞`,
/// so the first block with a visible key always moves it; a NaN row max never does.
#[inline]
pub fn next_running_max(m_old: f32, row_max: f32) -> f32 {
    if row_max > m_old + RESCALE_SLACK {
        row_max
    } else {
        m_old
    }
}

#[inline]
fn dot_i8(a: &[i8], b: &[i8]) -> i32 {
    a.iter().zip(b).map(|(&x, &y)| x as i32 * y as i32).sum()
}

/// FP32 dot product (eight partial sums: the order is free, ALGORITHM.md §1).
#[inline]
fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ra.iter().zip(rb).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

#[inline]
fn axpy_i8(acc: &mut [i32], a: i8, x: &[i8]) {
    let a = a as i32;
    acc.iter_mut().zip(x).for_each(|(y, &v)| *y += a * v as i32);
}

#[inline]
fn axpy_f32(acc: &mut [f32], a: f32, x: &[f32]) {
    acc.iter_mut().zip(x).for_each(|(y, &v)| *y += a * v);
}

/// One (batch, query head) with views of its operands.
struct HeadCtx<'a> {
    s: Shape,
    cfg: &'a Config,
    causal: bool,
    /// `fl(c · log2 e)`.
    c_log2e: f32,
    q_hat: &'a [i8],
    q_scale: &'a [f32],
    q_mean: &'a [f32],
    /// `b_r` of each row (ALGORITHM.md §3).
    row_offset: &'a [f32],
    k: &'a [f32],
    k_hat: &'a [i8],
    k_scale: &'a [f32],
    k_mean: &'a [f32],
    v: &'a [f32],
    v_hat: &'a [i8],
    v_scale: &'a [f32],
    q: &'a [f32],
    d_o: &'a [f32],
    do_hat: &'a [i8],
    do_scale: &'a [f32],
    /// Q-smoothing bias `β[query block, key]` (FP32), empty when off.
    beta: Vec<f32>,
    /// The BF16 rounding (or the identity, see [`simulate_with`]).
    r16: fn(f32) -> f32,
}

/// One head's backward results before the GQA reduction.
struct HeadGrads {
    dq: Vec<f32>,
    /// Unscaled (no `c`) FP32 dK of this query head.
    dk: Vec<f32>,
    dv: Vec<f32>,
    delta: Vec<f32>,
    inter: Option<Intermediates>,
}

/// Phase A of the backward for one query block: everything the key-block phase needs.
struct QBlock {
    rows: usize,
    dq: Vec<f32>,
    /// INT8 P̂ and dŜ of the block's rows, `rows × N_k`; one scale per key block.
    p_hat: Vec<i8>,
    p_scale: Vec<f32>,
    ds_hat: Vec<i8>,
    ds_scale: Vec<f32>,
    /// `bf16(P)`, `bf16(dS)` when a 16-bit product consumes them, `rows × N_k`.
    p_bf: Vec<f32>,
    ds_bf: Vec<f32>,
    /// Column sums of the FP32 dS over this block's rows (Q-smoothing), `N_k`.
    ds_colsum: Vec<f32>,
    inter: Option<Intermediates>,
}

/// `exp2(a·sc − shift)` of one score's two factors (`HeadCtx::score_parts`): fused `exp2(fma(a, sc, −shift))`, one
/// rounding (INT8 #1 in the forward, §4; INT8 #3 in the backward, §5), else `exp2(fl(fl(a·sc) − shift))`. The kernels'
/// counterpart in the backward is backward_main.cu `p_of_score`.
#[inline]
fn exp2_of_score(a: f32, sc: f32, shift: f32, fused: bool) -> f32 {
    if fused { a.mul_add(sc, -shift) } else { a * sc - shift }.exp2()
}

impl<'a> HeadCtx<'a> {
    fn new(inp: &'a Inputs, cfg: &'a Config, prep: &'a Prepared, bh: usize, r16: fn(f32) -> f32) -> HeadCtx<'a> {
        let s = inp.shape;
        let d = s.head_dim;
        let kvh = (bh / s.heads_q) * s.heads_kv + (bh % s.heads_q) / s.group();
        let (nqb, nkb) = (s.n_q.div_ceil(cfg.block_q), s.n_k.div_ceil(cfg.block_kv));
        let qz = &prep.quant;
        let qr = bh * s.n_q * d..(bh + 1) * s.n_q * d;
        let kr = kvh * s.n_k * d..(kvh + 1) * s.n_k * d;
        let opt = |t: &'a [f32], r: std::ops::Range<usize>| if t.is_empty() { t } else { &t[r] };
        let opt8 = |t: &'a [i8], r: std::ops::Range<usize>| if t.is_empty() { t } else { &t[r] };
        let mut h = HeadCtx {
            s,
            cfg,
            causal: inp.causal,
            c_log2e: s.softmax_scale() as f32 * LOG2_E,
            q_hat: &qz.q_hat[qr.clone()],
            q_scale: &qz.q_scale[bh * nqb..(bh + 1) * nqb],
            row_offset: &qz.row_offset[bh * s.n_q..(bh + 1) * s.n_q],
            q_mean: opt(&qz.q_mean, bh * nqb * d..(bh + 1) * nqb * d),
            k_hat: &qz.k_hat[kr.clone()],
            k_scale: &qz.k_scale[kvh * nkb..(kvh + 1) * nkb],
            k: &inp.k[kr.clone()],
            k_mean: &qz.k_mean[kvh * d..(kvh + 1) * d],
            v: &inp.v[kr.clone()],
            v_hat: &qz.v_hat[kr.clone()],
            v_scale: &qz.v_scale[kvh * nkb..(kvh + 1) * nkb],
            q: &inp.q[qr.clone()],
            d_o: inp.d_o.as_deref().map_or(&[][..], |t| &t[qr.clone()]),
            do_hat: opt8(&qz.do_hat, qr.clone()),
            do_scale: opt(&qz.do_scale, bh * nqb..(bh + 1) * nqb),
            beta: Vec::new(),
            r16,
        };
        if cfg.smooth_q {
            let k_s = &prep.k_s[kr];
            h.beta = (0..nqb)
                .flat_map(|b| {
                    let qm = &h.q_mean[b * d..(b + 1) * d];
                    k_s.chunks(d)
                        .map(move |kj| qm.iter().zip(kj).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() as f32)
                })
                .collect();
        }
        h
    }

    fn d(&self) -> usize {
        self.s.head_dim
    }

    fn row<'b, T>(&self, t: &'b [T], r: usize) -> &'b [T] {
        &t[r * self.d()..(r + 1) * self.d()]
    }

    /// Base-2 score `t[r, j] = fl(a · sc)` (ALGORITHM.md §4) with the given precision of the QKᵀ
    /// product, as its two factors `(a, sc)`: INT8 `a = float(acc)` (exact) of the smoothed operands
    /// (off by `−b_r` from the true score), `sc = fl(fl(s_Q·cλ)·s_K)`; BF16 `a` = the FP32 sum of Q·K,
    /// `sc = cλ`. With Q-smoothing (INT8) `a = t` itself (β added) and `sc = 1`, so that
    /// `fma(a, sc, −m) = fl(t − m)`: the unfused form the specification keeps there. INT8 #1 and #3
    /// fuse (`fma(a, sc, −m)` in the forward, §4; `fma(a, sc, −L)` in the backward, §5); BF16 rounds `t = fl(a·sc)` first.
    #[inline]
    /// One key block of §4's online softmax for query row r, keys j0..j0 + t.len(): the score parts into `a`, the new
    /// running max (lazy for INT8 #1) and α; the exponentials into `t`: p = exp2(fma(a, sc, −fl(m_use − off))), one
    /// rounding, for INT8 #1, exp2(fl(t − fl(m_use − off))) for BF16 #1 (`off` = 0, or §10.2's FP8 offset, which
    /// makes them P′ = 2^off · p). Returns (m_new, α).
    #[allow(clippy::too_many_arguments)] // the row, its block, its two buffers, the running max and the offset
    fn softmax_block(
        &self,
        prec: Precision,
        r: usize,
        j0: usize,
        a: &mut [(f32, f32)],
        t: &mut [f32],
        m: f32,
        off: f32,
    ) -> (f32, f32) {
        let fused = prec == Precision::Int8;
        for (jj, aj) in a.iter_mut().enumerate() {
            *aj = self.score_parts(prec, r, j0 + jj);
        }
        // The row max of t = fl(a·sc).
        let row_max = a.iter().fold(f32::NEG_INFINITY, |acc, &(x, sc)| acc.max(x * sc));
        let m_new = if fused {
            next_running_max(m, row_max)
        } else {
            m.max(row_max)
        };
        let m_use = if m_new == f32::NEG_INFINITY { 0.0 } else { m_new };
        let alpha = (m - m_use).exp2();
        let shift = m_use - off;
        t.iter_mut()
            .zip(a.iter())
            .for_each(|(p, &(x, sc))| *p = exp2_of_score(x, sc, shift, fused));
        (m_new, alpha)
    }

    fn score_parts(&self, prec: Precision, r: usize, j: usize) -> (f32, f32) {
        let (qb, kb) = (r / self.cfg.block_q, j / self.cfg.block_kv);
        match prec {
            Precision::Int8 => {
                let acc = dot_i8(self.row(self.q_hat, r), self.row(self.k_hat, j));
                let sc = (self.q_scale[qb] * self.c_log2e) * self.k_scale[kb];
                if self.cfg.smooth_q {
                    (acc as f32 * sc + self.c_log2e * self.beta[qb * self.s.n_k + j], 1.0)
                } else {
                    (acc as f32, sc)
                }
            }
            Precision::Bf16 => (dot_f32(self.row(self.q, r), self.row(self.k, j)), self.c_log2e),
        }
    }

    /// ALGORITHM.md §4, one query row at a time (rows are independent).
    fn forward(&self) -> Forward {
        let (s, d, bkv) = (self.s, self.d(), self.cfg.block_kv);
        let int8 = self.cfg.is_int8(Product::Pv);
        let prec = self.cfg.get(Product::QkFwd);
        let mut o = vec![0.0f32; s.n_q * d];
        let mut lse2 = vec![0.0f32; s.n_q];
        let mut lse = vec![0.0f32; s.n_q];
        o.par_chunks_mut(d)
            .zip(lse2.par_iter_mut())
            .zip(lse.par_iter_mut())
            .enumerate()
            .for_each(|(r, ((orow, lse2_r), lse_r))| {
                let vis = visible_keys(&s, self.causal, r);
                let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
                let mut t = vec![0.0f32; bkv];
                let mut a = vec![(0.0f32, 0.0f32); bkv];
                let mut pv_i = vec![0i32; d];
                let mut pv_f = vec![0.0f32; d];
                for j0 in (0..vis).step_by(bkv) {
                    let j1 = (j0 + bkv).min(vis);
                    let t = &mut t[..j1 - j0];
                    let (m_new, alpha) = self.softmax_block(prec, r, j0, &mut a[..j1 - j0], t, m, 0.0);
                    l = l * alpha + t.iter().sum::<f32>();
                    let kb = j0 / bkv;
                    if int8 {
                        let g = GroupScale::of(t.iter().copied());
                        pv_i.fill(0);
                        for (jj, &p) in t.iter().enumerate() {
                            axpy_i8(&mut pv_i, g.quantize(p), self.row(self.v_hat, j0 + jj));
                        }
                        for (ov, &acc) in orow.iter_mut().zip(&pv_i) {
                            *ov = dequant_add(acc, g.scale, self.v_scale[kb], *ov * alpha);
                        }
                    } else {
                        pv_f.fill(0.0);
                        for (jj, &p) in t.iter().enumerate() {
                            axpy_f32(&mut pv_f, (self.r16)(p), self.row(self.v, j0 + jj));
                        }
                        for (ov, &x) in orow.iter_mut().zip(&pv_f) {
                            *ov = *ov * alpha + x;
                        }
                    }
                    m = m_new;
                }
                if l == 0.0 {
                    orow.fill(0.0);
                    *lse2_r = f32::INFINITY;
                    *lse_r = f32::INFINITY;
                    return;
                }
                let r_l = 1.0 / l; // O = fl(O · fl(1/l)), ALGORITHM.md §4
                orow.iter_mut().for_each(|x| *x = (self.r16)(*x * r_l));
                *lse2_r = m + l.log2();
                if prec == Precision::Int8 {
                    *lse2_r += self.row_offset[r]; // back to the true (unsmoothed) scores
                }
                *lse_r = *lse2_r * LN_2;
            });
        Forward { o, lse2, lse }
    }

    /// ALGORITHM.md §5. Phase A (parallel over query blocks) computes the tiles and dQ; phase B
    /// (parallel over key blocks) accumulates dK and dV from the stored quantized tiles.
    fn backward(&self, fwd: &Forward, want: bool) -> HeadGrads {
        let (s, d) = (self.s, self.d());
        let delta: Vec<f32> = (0..s.n_q)
            .map(|r| dot_f32(self.row(&fwd.o, r), self.row(self.d_o, r)))
            .collect();
        let nqb = s.n_q.div_ceil(self.cfg.block_q);
        let blocks: Vec<QBlock> = (0..nqb)
            .into_par_iter()
            .map(|qb| self.q_block(qb, fwd, &delta, want))
            .collect();
        let mut dk = vec![0.0f32; s.n_k * d];
        let mut dv = vec![0.0f32; s.n_k * d];
        let chunk = self.cfg.block_kv * d;
        dk.par_chunks_mut(chunk)
            .zip(dv.par_chunks_mut(chunk))
            .enumerate()
            .for_each(|(kb, (dkb, dvb))| {
                self.k_block(kb, &blocks, dkb, dvb);
            });
        let mut dq = Vec::with_capacity(s.n_q * d);
        let mut inter = want.then(Intermediates::default);
        for b in blocks {
            dq.extend(b.dq);
            if let (Some(all), Some(bi)) = (inter.as_mut(), b.inter) {
                all.p.extend(bi.p);
                all.dp.extend(bi.dp);
                all.ds.extend(bi.ds);
            }
        }
        HeadGrads {
            dq,
            dk,
            dv,
            delta,
            inter,
        }
    }

    fn q_block(&self, qb: usize, fwd: &Forward, delta: &[f32], want: bool) -> QBlock {
        let (s, d, cfg) = (self.s, self.d(), self.cfg);
        let (bq, bkv, nk) = (cfg.block_q, cfg.block_kv, s.n_k);
        let r0 = qb * bq;
        let rows = bq.min(s.n_q - r0);
        let nkb = nk.div_ceil(bkv);
        let (p_i8, ds_i8) = (
            cfg.is_int8(Product::Dv),
            cfg.is_int8(Product::Dq) || cfg.is_int8(Product::Dk),
        );
        let mut out = QBlock {
            rows,
            dq: vec![0.0; rows * d],
            p_hat: vec![0; rows * nk],
            p_scale: vec![0.0; nkb],
            ds_hat: vec![0; rows * nk],
            ds_scale: vec![0.0; nkb],
            p_bf: if p_i8 { vec![] } else { vec![0.0; rows * nk] },
            ds_bf: if cfg.is_int8(Product::Dk) {
                vec![]
            } else {
                vec![0.0; rows * nk]
            },
            ds_colsum: if cfg.smooth_q && cfg.is_int8(Product::Dk) {
                vec![0.0; nk]
            } else {
                vec![]
            },
            inter: want.then(|| Intermediates {
                p: vec![0.0; rows * nk],
                dp: vec![0.0; rows * nk],
                ds: vec![0.0; rows * nk],
            }),
        };
        let mut rowsum_ds = vec![0.0f32; rows];
        // INT8 scores are of the smoothed K: compare them with the LSE of the smoothed scores.
        let lse2_used: Vec<f32> = (r0..r0 + rows)
            .map(|r| match cfg.get(Product::QkBwd) {
                Precision::Int8 => fwd.lse2[r] - self.row_offset[r],
                Precision::Bf16 => fwd.lse2[r],
            })
            .collect();
        let (qk, dp_prec) = (cfg.get(Product::QkBwd), cfg.get(Product::Dp));
        let mut p = vec![0.0f32; rows * bkv];
        let mut ds = vec![0.0f32; rows * bkv];
        let mut acc_i = vec![0i32; d];
        let mut acc_f = vec![0.0f32; d];
        for kb in 0..nkb {
            let j0 = kb * bkv;
            let w = bkv.min(nk - j0);
            let vis: Vec<usize> = (0..rows)
                .map(|i| visible_keys(&s, self.causal, r0 + i).saturating_sub(j0).min(w))
                .collect();
            if vis.iter().all(|&v| v == 0) {
                continue; // a fully masked tile: the kernels skip it, every quantity is 0.
            }
            // P, dP, dS of the tile (masked entries 0).
            for i in 0..rows {
                let r = r0 + i;
                for jj in 0..w {
                    let (pi, dsi) = (&mut p[i * bkv + jj], &mut ds[i * bkv + jj]);
                    if jj >= vis[i] {
                        (*pi, *dsi) = (0.0, 0.0);
                        continue;
                    }
                    let j = j0 + jj;
                    // INT8 #3: p = exp2(fma(a, sc, −L)), one rounding (§5, as the forward's #1); BF16: fl(t − L).
                    let (a, sc) = self.score_parts(qk, r, j);
                    *pi = exp2_of_score(a, sc, lse2_used[i], qk == Precision::Int8);
                    let dp = match dp_prec {
                        Precision::Bf16 => dot_f32(self.row(self.d_o, r), self.row(self.v, j)),
                        Precision::Int8 => dequant(
                            dot_i8(self.row(self.do_hat, r), self.row(self.v_hat, j)),
                            self.do_scale[qb],
                            self.v_scale[kb],
                        ),
                    };
                    *dsi = *pi * (dp - delta[r]);
                    rowsum_ds[i] += *dsi;
                    if let Some(it) = out.inter.as_mut() {
                        it.dp[i * nk + j] = dp;
                    }
                }
            }
            let gp = GroupScale::of((0..rows).flat_map(|i| p[i * bkv..i * bkv + w].iter().copied()));
            let gs = GroupScale::of((0..rows).flat_map(|i| ds[i * bkv..i * bkv + w].iter().copied()));
            out.p_scale[kb] = gp.scale;
            out.ds_scale[kb] = gs.scale;
            for i in 0..rows {
                for jj in 0..w {
                    let (x, y) = (p[i * bkv + jj], ds[i * bkv + jj]);
                    let at = i * nk + j0 + jj;
                    out.p_hat[at] = gp.quantize(x);
                    out.ds_hat[at] = gs.quantize(y);
                    if !out.p_bf.is_empty() {
                        out.p_bf[at] = (self.r16)(x);
                    }
                    if !out.ds_bf.is_empty() {
                        out.ds_bf[at] = (self.r16)(y);
                    }
                    if !out.ds_colsum.is_empty() {
                        out.ds_colsum[j0 + jj] += y;
                    }
                    if let Some(it) = out.inter.as_mut() {
                        it.p[at] = if p_i8 {
                            out.p_hat[at] as f32 * gp.scale
                        } else {
                            (self.r16)(x)
                        };
                        it.ds[at] = if ds_i8 {
                            out.ds_hat[at] as f32 * gs.scale
                        } else {
                            (self.r16)(y)
                        };
                    }
                }
            }
            // #6: dQ of the block's rows.
            for i in 0..rows {
                let dq = &mut out.dq[i * d..(i + 1) * d];
                if cfg.is_int8(Product::Dq) {
                    acc_i.fill(0);
                    for jj in 0..vis[i] {
                        axpy_i8(&mut acc_i, out.ds_hat[i * nk + j0 + jj], self.row(self.k_hat, j0 + jj));
                    }
                    for (x, &a) in dq.iter_mut().zip(&acc_i) {
                        *x += dequant(a, gs.scale, self.k_scale[kb]);
                    }
                } else {
                    acc_f.fill(0.0);
                    for jj in 0..vis[i] {
                        axpy_f32(&mut acc_f, (self.r16)(ds[i * bkv + jj]), self.row(self.k, j0 + jj));
                    }
                    dq.iter_mut().zip(&acc_f).for_each(|(x, a)| *x += a);
                }
            }
        }
        if cfg.dq_smooth_k_correction && cfg.is_int8(Product::Dq) {
            for (dq_row, &rs) in out.dq.chunks_mut(d).zip(&rowsum_ds).take(rows) {
                for (x, &km) in dq_row.iter_mut().zip(self.k_mean) {
                    *x += rs * km;
                }
            }
        }
        out
    }

    /// dV and dK (unscaled) of key block `kb`, summed over query blocks in order.
    fn k_block(&self, kb: usize, blocks: &[QBlock], dk: &mut [f32], dv: &mut [f32]) {
        let (d, cfg) = (self.d(), self.cfg);
        let j0 = kb * cfg.block_kv;
        let mut acc_i = vec![0i32; dk.len()];
        let mut acc_f = vec![0.0f32; dk.len()];
        for (qb, blk) in blocks.iter().enumerate() {
            let r0 = qb * cfg.block_q;
            // #4 dV += Pᵀ dO
            if cfg.is_int8(Product::Dv) {
                self.tile_t_times_i8(&mut acc_i, &blk.p_hat, blk.rows, j0, |i| self.row(self.do_hat, r0 + i));
                dv.iter_mut()
                    .zip(&acc_i)
                    .for_each(|(x, &a)| *x = dequant_add(a, blk.p_scale[kb], self.do_scale[qb], *x));
            } else {
                self.tile_t_times_f32(&mut acc_f, &blk.p_bf, blk.rows, j0, |i| self.row(self.d_o, r0 + i));
                dv.iter_mut().zip(&acc_f).for_each(|(x, a)| *x += a);
            }
            // #7 dK += dSᵀ Q
            if cfg.is_int8(Product::Dk) {
                self.tile_t_times_i8(&mut acc_i, &blk.ds_hat, blk.rows, j0, |i| self.row(self.q_hat, r0 + i));
                dk.iter_mut()
                    .zip(&acc_i)
                    .for_each(|(x, &a)| *x = dequant_add(a, blk.ds_scale[kb], self.q_scale[qb], *x));
                if cfg.smooth_q {
                    let qm = &self.q_mean[qb * d..(qb + 1) * d];
                    for (jj, dkj) in dk.chunks_mut(d).enumerate() {
                        axpy_f32(dkj, blk.ds_colsum[j0 + jj], qm);
                    }
                }
            } else {
                self.tile_t_times_f32(&mut acc_f, &blk.ds_bf, blk.rows, j0, |i| self.row(self.q, r0 + i));
                dk.iter_mut().zip(&acc_f).for_each(|(x, a)| *x += a);
            }
        }
    }

    /// `acc = Aᵀ B` over one tile: `A` holds the tile's rows (`rows × N_k`, columns `j0..`), `acc`
    /// one row of `d` per key, `b(i)` the `i`-th row of the other operand. Exact in INT32.
    fn tile_t_times_i8<'b>(&self, acc: &mut [i32], a: &[i8], rows: usize, j0: usize, b: impl Fn(usize) -> &'b [i8]) {
        let (d, nk) = (self.d(), self.s.n_k);
        acc.fill(0);
        for i in 0..rows {
            let bi = b(i);
            for (jj, acc_j) in acc.chunks_mut(d).enumerate() {
                let x = a[i * nk + j0 + jj];
                if x != 0 {
                    axpy_i8(acc_j, x, bi);
                }
            }
        }
    }

    /// [`Self::tile_t_times_i8`] for a 16-bit product (FP32 accumulation).
    fn tile_t_times_f32<'b>(&self, acc: &mut [f32], a: &[f32], rows: usize, j0: usize, b: impl Fn(usize) -> &'b [f32]) {
        let (d, nk) = (self.d(), self.s.n_k);
        acc.fill(0.0);
        for i in 0..rows {
            let bi = b(i);
            for (jj, acc_j) in acc.chunks_mut(d).enumerate() {
                let x = a[i * nk + j0 + jj];
                if x != 0.0 {
                    axpy_f32(acc_j, x, bi);
                }
            }
        }
    }
}

/// Postprocess (ALGORITHM.md §5): `c` scaling, GQA reduction, BF16 rounding; collects all heads.
fn assemble(
    inp: &Inputs,
    prep: Prepared,
    heads: Vec<(Forward, Option<HeadGrads>)>,
    want: bool,
    r16: fn(f32) -> f32,
) -> SimOutput {
    let s = inp.shape;
    let c = s.softmax_scale() as f32;
    let mut out = SimOutput {
        quant: prep.quant,
        ..Default::default()
    };
    let has_grads = inp.d_o.is_some();
    let mut g = Gradients::default();
    let mut dk_sum = vec![0.0f32; if has_grads { s.kv_len() } else { 0 }];
    let mut dv_sum = dk_sum.clone();
    let mut inter = Intermediates::default();
    let per_kv = s.n_k * s.head_dim;
    for (bh, (fwd, grads)) in heads.into_iter().enumerate() {
        out.fwd.o.extend(fwd.o);
        out.fwd.lse2.extend(fwd.lse2);
        out.fwd.lse.extend(fwd.lse);
        if let Some(hg) = grads {
            let kvh = (bh / s.heads_q) * s.heads_kv + (bh % s.heads_q) / s.group();
            let range = kvh * per_kv..(kvh + 1) * per_kv;
            dk_sum[range.clone()].iter_mut().zip(&hg.dk).for_each(|(a, b)| *a += b);
            dv_sum[range].iter_mut().zip(&hg.dv).for_each(|(a, b)| *a += b);
            g.dq.extend(hg.dq.iter().map(|&x| r16(c * x)));
            g.delta.extend(hg.delta);
            if let Some(it) = hg.inter {
                inter.p.extend(it.p);
                inter.dp.extend(it.dp);
                inter.ds.extend(it.ds);
            }
        }
    }
    if has_grads {
        g.dk = dk_sum.iter().map(|&x| r16(c * x)).collect();
        g.dv = dv_sum.iter().map(|&x| r16(x)).collect();
        out.grads = Some(g);
        out.inter = want.then_some(inter);
    }
    out
}

/// The FP8 copies of V, dO, K_s, Q of one (batch, query head) (ALGORITHM.md §10.1): values `x / s` rounded
/// to e4m3, one power-of-two scale per channel (or per tensor), `[N, d]` and `[d]`. Empty when no product
/// of the configuration is FP8.
struct Fp8Copies {
    v: Vec<f32>,
    v_s: Vec<f32>,
    d_o: Vec<f32>,
    do_s: Vec<f32>,
    k: Vec<f32>,
    k_s: Vec<f32>,
    q: Vec<f32>,
    q_s: Vec<f32>,
}

/// The FP8 copy of one (batch, head)'s `[N, d]` values `x` (§10.1): each `x / s` rounded to e4m3, with one
/// power-of-two scale per channel (or per tensor); returns the rounded values and the `[d]` scales. Also what the GPU
/// check compares the kernels' e4m3 V̂ᵀ with.
pub fn fp8_copy(x: &[f32], d: usize, scale: Fp8OperandScale) -> (Vec<f32>, Vec<f32>) {
    let mut amax = vec![0.0f32; d];
    for row in x.chunks(d) {
        amax.iter_mut().zip(row).for_each(|(m, v)| *m = m.max(v.abs()));
    }
    if scale == Fp8OperandScale::Tensor {
        let t = amax.iter().fold(0.0f32, |m, &v| m.max(v));
        amax.fill(t);
    }
    let s: Vec<f32> = amax.iter().map(|&a| Fp8::E4m3.pow2_scale(a)).collect();
    let q = x
        .chunks(d)
        .flat_map(|row| row.iter().zip(&s).map(|(&v, &sc)| Fp8::E4m3.quantize(v, sc)))
        .collect();
    (q, s)
}

impl Fp8Copies {
    fn new(h: &HeadCtx, prep: &Prepared, bh: usize) -> Fp8Copies {
        let (s, d) = (h.s, h.d());
        let mut c = Fp8Copies {
            v: vec![],
            v_s: vec![],
            d_o: vec![],
            do_s: vec![],
            k: vec![],
            k_s: vec![],
            q: vec![],
            q_s: vec![],
        };
        let pds = &h.cfg.pds;
        let sc = pds.fp8_operand_scale;
        if pds.p_fwd.is_fp8() {
            (c.v, c.v_s) = fp8_copy(h.v, d, sc);
        }
        if pds.p_bwd.is_fp8() && !h.d_o.is_empty() {
            (c.d_o, c.do_s) = fp8_copy(h.d_o, d, sc);
        }
        if pds.ds_dq.is_fp8() {
            let kvh = (bh / s.heads_q) * s.heads_kv + (bh % s.heads_q) / s.group();
            (c.k, c.k_s) = fp8_copy(&prep.k_s[kvh * s.n_k * d..(kvh + 1) * s.n_k * d], d, sc);
            (c.q, c.q_s) = fp8_copy(h.q, d, sc);
        }
        c
    }
}

/// One quantized 8-bit operand tile set of the backward (`rows × N_k` of a query block): the values the
/// product multiplies (INT8 codes, or FP8 values in units of the scale) and, for INT8, each entry's group scale.
struct Quant8 {
    val: Vec<f32>,
    hat: Vec<i8>,
    scale: Vec<f32>,
}

/// Quantizes the visible entries of `x` (`rows × nk`, masked entries 0) with `fmt`: INT8 groups of
/// `rows_g × cols_g` inside each `rows × B_kv` tile (§10.2), or FP8 with the scale `fp8_scale`
/// (1 for P: its fixed scale is already in P′, §10.2).
fn quantize_tiles(x: &[f32], rows: usize, nk: usize, bq: usize, bkv: usize, fmt: Format, fp8_scale: f32) -> Quant8 {
    match fmt {
        Format::Fp8(f) => Quant8 {
            val: x.iter().map(|&v| f.quantize(v, fp8_scale)).collect(),
            hat: vec![],
            scale: vec![],
        },
        Format::Int8 { rows: gr, cols: gc } => {
            let gr = if gr == 0 { bq } else { gr };
            let gc = if gc == 0 { bkv } else { gc };
            let mut hat = vec![0i8; x.len()];
            let mut scale = vec![0.0f32; x.len()];
            for j0 in (0..nk).step_by(bkv) {
                let w = bkv.min(nk - j0);
                for i0 in (0..rows).step_by(gr) {
                    for c0 in (0..w).step_by(gc) {
                        let (i1, c1) = ((i0 + gr).min(rows), (c0 + gc).min(w));
                        let at = |i: usize, c: usize| i * nk + j0 + c;
                        let g = GroupScale::of((i0..i1).flat_map(|i| (c0..c1).map(move |c| x[at(i, c)])));
                        for i in i0..i1 {
                            for c in c0..c1 {
                                hat[at(i, c)] = g.quantize(x[at(i, c)]);
                                scale[at(i, c)] = g.scale;
                            }
                        }
                    }
                }
            }
            Quant8 {
                val: vec![],
                hat,
                scale,
            }
        }
    }
}

/// Phase one of the variant backward for one query block: P′, dS′ (`rows × N_k`, masked 0) and dP.
struct TileSet {
    rows: usize,
    p: Vec<f32>,
    ds: Vec<f32>,
    dp: Vec<f32>,
}

impl<'a> HeadCtx<'a> {
    /// The forward of ALGORITHM.md §10 (`pds` not the default): §4 with P quantized as `p_fwd` says. Also
    /// returns O′ (the unquantized-P output, FP32) when §10.4's δ asks for it.
    fn forward_pds(&self, f8: &Fp8Copies) -> (Forward, Option<Vec<f32>>) {
        let (s, d, bkv) = (self.s, self.d(), self.cfg.block_kv);
        let pds = self.cfg.pds;
        let prec = self.cfg.get(Product::QkFwd);
        let int8_pv = self.cfg.is_int8(Product::Pv);
        let fused = prec == Precision::Int8;
        let want_prime = pds.delta == DeltaFrom::UnquantizedP;
        // §10.2: e4m3 P is P′ = exp2(t − (m − off)) = 2^off · p, off = log2(448) minus the lazy slack.
        let fp8 = int8_pv && pds.p_fwd.is_fp8();
        let off = if !fp8 {
            0.0
        } else if fused {
            448f32.log2() - RESCALE_SLACK
        } else {
            448f32.log2()
        };
        let cols = match pds.p_fwd {
            Format::Int8 { cols: 0, .. } => bkv,
            Format::Int8 { cols, .. } => cols,
            Format::Fp8(_) => bkv,
        };
        let ts = pds.fp8_sum;
        let mut o = vec![0.0f32; s.n_q * d];
        let mut o_prime = vec![0.0f32; if want_prime { s.n_q * d } else { 0 }];
        let mut lse2 = vec![0.0f32; s.n_q];
        let mut lse = vec![0.0f32; s.n_q];
        let op_chunks: Vec<&mut [f32]> = if want_prime {
            o_prime.chunks_mut(d).collect()
        } else {
            (0..s.n_q).map(|_| &mut [][..]).collect()
        };
        o.par_chunks_mut(d)
            .zip(op_chunks)
            .zip(lse2.par_iter_mut())
            .zip(lse.par_iter_mut())
            .enumerate()
            .for_each(|(r, (((orow, oprow), lse2_r), lse_r))| {
                let vis = visible_keys(&s, self.causal, r);
                let (mut m, mut l) = (f32::NEG_INFINITY, 0.0f32);
                let mut t = vec![0.0f32; bkv];
                let mut a = vec![(0.0f32, 0.0f32); bkv];
                let mut pv_i = vec![0i32; d];
                let mut pv_f = vec![0.0f32; d];
                let mut terms = vec![0.0f64; bkv];
                for j0 in (0..vis).step_by(bkv) {
                    let j1 = (j0 + bkv).min(vis);
                    let t = &mut t[..j1 - j0];
                    let (m_new, alpha) = self.softmax_block(prec, r, j0, &mut a[..j1 - j0], t, m, off);
                    l = l * alpha + t.iter().sum::<f32>();
                    let kb = j0 / bkv;
                    if want_prime {
                        pv_f.fill(0.0);
                        for (jj, &p) in t.iter().enumerate() {
                            axpy_f32(&mut pv_f, p, self.row(self.v, j0 + jj));
                        }
                        oprow.iter_mut().zip(&pv_f).for_each(|(ov, &x)| *ov = *ov * alpha + x);
                    }
                    if !int8_pv {
                        pv_f.fill(0.0);
                        for (jj, &p) in t.iter().enumerate() {
                            axpy_f32(&mut pv_f, (self.r16)(p), self.row(self.v, j0 + jj));
                        }
                        orow.iter_mut().zip(&pv_f).for_each(|(ov, &x)| *ov = *ov * alpha + x);
                    } else if fp8 {
                        let pt: Vec<f32> = t.iter().map(|&p| Fp8::E4m3.round(p)).collect();
                        for (c, ov) in orow.iter_mut().enumerate() {
                            let terms = &mut terms[..pt.len()];
                            for (jj, x) in terms.iter_mut().enumerate() {
                                *x = pt[jj] as f64 * f8.v[(j0 + jj) * d + c] as f64;
                            }
                            let mut acc = ts.start(*ov * alpha);
                            ts.add(&mut acc, terms, j0);
                            *ov = ts.finish(acc);
                        }
                    } else {
                        for (si, seg) in t.chunks(cols).enumerate() {
                            let g = GroupScale::of(seg.iter().copied());
                            pv_i.fill(0);
                            for (jj, &p) in seg.iter().enumerate() {
                                axpy_i8(&mut pv_i, g.quantize(p), self.row(self.v_hat, j0 + si * cols + jj));
                            }
                            for (ov, &acc) in orow.iter_mut().zip(&pv_i) {
                                let base = if si == 0 { *ov * alpha } else { *ov };
                                *ov = dequant_add(acc, g.scale, self.v_scale[kb], base);
                            }
                        }
                    }
                    m = m_new;
                }
                if l == 0.0 {
                    orow.fill(0.0);
                    oprow.fill(0.0);
                    *lse2_r = f32::INFINITY;
                    *lse_r = f32::INFINITY;
                    return;
                }
                let r_l = 1.0 / l;
                if fp8 {
                    orow.iter_mut()
                        .zip(&f8.v_s)
                        .for_each(|(x, &sv)| *x = (self.r16)((*x * r_l) * sv));
                } else {
                    orow.iter_mut().for_each(|x| *x = (self.r16)(*x * r_l));
                }
                oprow.iter_mut().for_each(|x| *x *= r_l);
                *lse2_r = (m - off) + l.log2();
                if prec == Precision::Int8 {
                    *lse2_r += self.row_offset[r];
                }
                *lse_r = *lse2_r * LN_2;
            });
        (Forward { o, lse2, lse }, want_prime.then_some(o_prime))
    }

    /// The backward of ALGORITHM.md §10: §5 with P and dS quantized as `p_bwd`, `ds_dq`, `ds_dk` say.
    fn backward_pds(&self, f8: &Fp8Copies, fwd: &Forward, o_prime: Option<&[f32]>, want: bool) -> HeadGrads {
        let (s, d, cfg) = (self.s, self.d(), self.cfg);
        let pds = cfg.pds;
        let (bq, bkv, nk) = (cfg.block_q, cfg.block_kv, s.n_k);
        let o_for_delta = o_prime.unwrap_or(&fwd.o);
        let delta: Vec<f32> = (0..s.n_q)
            .map(|r| dot_f32(self.row(o_for_delta, r), self.row(self.d_o, r)))
            .collect();
        let nqb = s.n_q.div_ceil(bq);
        let nkb = nk.div_ceil(bkv);
        let p_fp8 = cfg.is_int8(Product::Dv) && pds.p_bwd.is_fp8();
        // §10.2: with e4m3 P the backward computes P′ = 448·P (the offset in L) and dS′ = 448·dS.
        let shift = if p_fp8 { 448f32.log2() } else { 0.0 };
        let inv_g = if p_fp8 { 1.0 / 448.0f32 } else { 1.0 };
        let (qk, dp_prec) = (cfg.get(Product::QkBwd), cfg.get(Product::Dp));
        let tiles: Vec<TileSet> = (0..nqb)
            .into_par_iter()
            .map(|qb| {
                let r0 = qb * bq;
                let rows = bq.min(s.n_q - r0);
                let mut ts = TileSet {
                    rows,
                    p: vec![0.0; rows * nk],
                    ds: vec![0.0; rows * nk],
                    dp: vec![0.0; rows * nk],
                };
                for i in 0..rows {
                    let r = r0 + i;
                    let lse2 = match qk {
                        Precision::Int8 => fwd.lse2[r] - self.row_offset[r],
                        Precision::Bf16 => fwd.lse2[r],
                    };
                    let big_l = lse2 - shift;
                    for j in 0..visible_keys(&s, self.causal, r) {
                        let (a, sc) = self.score_parts(qk, r, j);
                        let p = exp2_of_score(a, sc, big_l, qk == Precision::Int8);
                        let kb = j / bkv;
                        let dp = match dp_prec {
                            Precision::Bf16 => dot_f32(self.row(self.d_o, r), self.row(self.v, j)),
                            Precision::Int8 => dequant(
                                dot_i8(self.row(self.do_hat, r), self.row(self.v_hat, j)),
                                self.do_scale[qb],
                                self.v_scale[kb],
                            ),
                        };
                        ts.p[i * nk + j] = p;
                        ts.dp[i * nk + j] = dp;
                        ts.ds[i * nk + j] = p * (dp - delta[r]);
                    }
                }
                ts
            })
            .collect();
        // §10.3: one power-of-two dS scale per (batch, head) from the amax of the whole dS′.
        let ds_amax = tiles
            .iter()
            .flat_map(|t| t.ds.iter())
            .fold(0.0f32, |m, &v| m.max(v.abs()));
        let ds_scale = match pds.ds_dq {
            Format::Fp8(f) => f.pow2_scale(ds_amax),
            Format::Int8 { .. } => 1.0,
        };
        let quant = |t: &TileSet, x: &[f32], fmt: Format, sc: f32| quantize_tiles(x, t.rows, nk, bq, bkv, fmt, sc);
        let pq: Vec<Quant8> = tiles.par_iter().map(|t| quant(t, &t.p, pds.p_bwd, 1.0)).collect();
        let dsq: Vec<Quant8> = tiles.par_iter().map(|t| quant(t, &t.ds, pds.ds_dq, ds_scale)).collect();
        let dsk: Vec<Quant8> = if pds.ds_dk == pds.ds_dq {
            vec![]
        } else {
            tiles.par_iter().map(|t| quant(t, &t.ds, pds.ds_dk, ds_scale)).collect()
        };
        let dsk = if dsk.is_empty() { &dsq } else { &dsk };
        let ts = pds.fp8_sum;
        let seg_len = |f: Format, along_rows: bool, full: usize| match f {
            Format::Int8 { rows, cols } => {
                let n = if along_rows { rows } else { cols };
                if n == 0 {
                    full
                } else {
                    n
                }
            }
            Format::Fp8(_) => full,
        };
        // #6 dQ, per query block (a tile's partial sum added to dQ).
        let dq_blocks: Vec<Vec<f32>> = (0..nqb)
            .into_par_iter()
            .map(|qb| {
                let (t, q8) = (&tiles[qb], &dsq[qb]);
                let r0 = qb * bq;
                let mut dq = vec![0.0f32; t.rows * d];
                let mut terms = vec![0.0f64; bkv];
                for i in 0..t.rows {
                    let vis = visible_keys(&s, self.causal, r0 + i);
                    let dqr = &mut dq[i * d..(i + 1) * d];
                    for kb in 0..nkb {
                        let j0 = kb * bkv;
                        let w = bkv.min(nk - j0).min(vis.saturating_sub(j0));
                        if w == 0 {
                            continue;
                        }
                        if cfg.is_int8(Product::Dq) && !pds.ds_dq.is_fp8() {
                            let seg = seg_len(pds.ds_dq, false, bkv);
                            for c0 in (0..w).step_by(seg) {
                                let c1 = (c0 + seg).min(w);
                                let sg = q8.scale[i * nk + j0 + c0];
                                for (c, x) in dqr.iter_mut().enumerate() {
                                    let acc: i32 = (c0..c1)
                                        .map(|jj| {
                                            q8.hat[i * nk + j0 + jj] as i32 * self.k_hat[(j0 + jj) * d + c] as i32
                                        })
                                        .sum();
                                    *x += dequant(acc, sg, self.k_scale[kb]);
                                }
                            }
                        } else if cfg.is_int8(Product::Dq) {
                            for (c, x) in dqr.iter_mut().enumerate() {
                                let terms = &mut terms[..w];
                                for (jj, y) in terms.iter_mut().enumerate() {
                                    *y = q8.val[i * nk + j0 + jj] as f64 * f8.k[(j0 + jj) * d + c] as f64;
                                }
                                let mut acc = ts.start(0.0);
                                ts.add(&mut acc, terms, 0);
                                *x += ts.finish(acc);
                            }
                        } else {
                            for jj in 0..w {
                                axpy_f32(dqr, (self.r16)(t.ds[i * nk + j0 + jj]), self.row(self.k, j0 + jj));
                            }
                        }
                    }
                    if cfg.is_int8(Product::Dq) && pds.ds_dq.is_fp8() {
                        dqr.iter_mut().zip(&f8.k_s).for_each(|(x, &sk)| *x *= ds_scale * sk);
                    }
                    if p_fp8 {
                        dqr.iter_mut().for_each(|x| *x *= inv_g);
                    }
                }
                dq
            })
            .collect();
        // #4 dV and #7 dK, per key.
        let mut dk = vec![0.0f32; nk * d];
        let mut dv = vec![0.0f32; nk * d];
        dk.par_chunks_mut(d)
            .zip(dv.par_chunks_mut(d))
            .enumerate()
            .for_each(|(j, (dkj, dvj))| {
                let mut terms = vec![0.0f64; s.n_q];
                // One product over all queries; `fmt` INT8 groups are dequantized per segment of rows.
                let product = |out: &mut [f32],
                               q8: &[Quant8],
                               fmt: Format,
                               prec: Precision,
                               hat: &[i8],
                               scale: &[f32],
                               val8: &[f32],
                               bf: &dyn Fn(&TileSet, usize) -> f32,
                               other: &[f32],
                               terms: &mut Vec<f64>| {
                    if prec == Precision::Bf16 {
                        for (qb, t) in tiles.iter().enumerate() {
                            for i in 0..t.rows {
                                let x = bf(t, i * nk + j);
                                if x != 0.0 {
                                    axpy_f32(out, x, self.row(other, qb * bq + i));
                                }
                            }
                        }
                    } else if let Format::Fp8(_) = fmt {
                        for (c, x) in out.iter_mut().enumerate() {
                            let mut n = 0;
                            for (qb, t) in tiles.iter().enumerate() {
                                for i in 0..t.rows {
                                    terms[n] = q8[qb].val[i * nk + j] as f64 * val8[(qb * bq + i) * d + c] as f64;
                                    n += 1;
                                }
                            }
                            let mut acc = ts.start(0.0);
                            ts.add(&mut acc, &terms[..n], 0);
                            *x = ts.finish(acc);
                        }
                    } else {
                        let seg = seg_len(fmt, true, bq);
                        for (qb, t) in tiles.iter().enumerate() {
                            for i0 in (0..t.rows).step_by(seg) {
                                let i1 = (i0 + seg).min(t.rows);
                                let sg = q8[qb].scale[i0 * nk + j];
                                for (c, x) in out.iter_mut().enumerate() {
                                    let acc: i32 = (i0..i1)
                                        .map(|i| q8[qb].hat[i * nk + j] as i32 * hat[(qb * bq + i) * d + c] as i32)
                                        .sum();
                                    *x = dequant_add(acc, sg, scale[qb], *x);
                                }
                            }
                        }
                    }
                };
                let r16 = self.r16;
                product(
                    dvj,
                    &pq,
                    pds.p_bwd,
                    cfg.get(Product::Dv),
                    self.do_hat,
                    self.do_scale,
                    &f8.d_o,
                    &|t, k| r16(t.p[k]),
                    self.d_o,
                    &mut terms,
                );
                if cfg.is_int8(Product::Dv) && p_fp8 {
                    dvj.iter_mut().zip(&f8.do_s).for_each(|(x, &sd)| *x *= sd * inv_g);
                }
                product(
                    dkj,
                    dsk,
                    pds.ds_dk,
                    cfg.get(Product::Dk),
                    self.q_hat,
                    self.q_scale,
                    &f8.q,
                    &|t, k| r16(t.ds[k]),
                    self.q,
                    &mut terms,
                );
                if cfg.is_int8(Product::Dk) && pds.ds_dk.is_fp8() {
                    dkj.iter_mut().zip(&f8.q_s).for_each(|(x, &sq)| *x *= ds_scale * sq);
                }
                if p_fp8 {
                    dkj.iter_mut().for_each(|x| *x *= inv_g);
                }
            });
        let inter = want.then(|| {
            let mut it = Intermediates::default();
            for (qb, t) in tiles.iter().enumerate() {
                let deq = |q: &Quant8, k: usize, fp8_s: f32| {
                    if q.val.is_empty() {
                        q.hat[k] as f32 * q.scale[k]
                    } else {
                        q.val[k] * fp8_s
                    }
                };
                for k in 0..t.rows * nk {
                    it.p.push(if cfg.is_int8(Product::Dv) {
                        deq(&pq[qb], k, 1.0) * inv_g
                    } else {
                        (self.r16)(t.p[k]) * inv_g
                    });
                    it.dp.push(t.dp[k]);
                    let ds_int8 = cfg.is_int8(Product::Dq) || cfg.is_int8(Product::Dk);
                    it.ds.push(if ds_int8 {
                        deq(&dsq[qb], k, ds_scale) * inv_g
                    } else {
                        (self.r16)(t.ds[k]) * inv_g
                    });
                }
            }
            it
        });
        HeadGrads {
            dq: dq_blocks.concat(),
            dk,
            dv,
            delta,
            inter,
        }
    }
}
