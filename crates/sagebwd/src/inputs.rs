//! Random test problems (Gaussian Q, K with standard deviation σ, V and dO with σ = 1, rounded to BF16), and
//! the magnitude bounds of the inputs the method represents ([`check_magnitudes`], called by `Inputs::validate`).

use crate::tensor::{Inputs, Shape};
use rand::{rngs::StdRng, Rng, SeedableRng};
use rand_distr::StandardNormal;

fn gaussian(rng: &mut StdRng, n: usize, sigma: f32) -> Vec<f32> {
    (0..n).map(|_| sigma * rng.sample::<f32, _>(StandardNormal)).collect()
}

/// A reproducible random problem. `sigma_qk` is the standard deviation of Q and K.
pub fn random(shape: Shape, causal: bool, sigma_qk: f32, seed: u64, with_do: bool) -> Inputs {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut inp = Inputs {
        shape,
        causal,
        q: gaussian(&mut rng, shape.q_len(), sigma_qk),
        k: gaussian(&mut rng, shape.kv_len(), sigma_qk),
        v: gaussian(&mut rng, shape.kv_len(), 1.0),
        d_o: with_do.then(|| gaussian(&mut rng, shape.q_len(), 1.0)),
    };
    inp.round_to_bf16();
    inp
}

/// Adds to K a per-(batch, kv head, channel) offset drawn from N(0, std²), the same for every token:
/// the shared channel offset real keys carry, which K-smoothing exists to remove.
pub fn add_key_channel_offset(inp: &mut Inputs, std: f32, seed: u64) {
    let d = inp.shape.head_dim;
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5EED_0FF5E7);
    for head in inp.k.chunks_mut(inp.shape.n_k * d) {
        let offset = gaussian(&mut rng, d, std);
        for row in head.chunks_mut(d) {
            row.iter_mut()
                .zip(&offset)
                .for_each(|(x, o)| *x = crate::tensor::bf16(*x + o));
        }
    }
}

/// The smallest nonzero input magnitude, 2⁻¹²⁰ ≈ 7.5e-37. The quantizer's `inv = fl(127/amax)` is +inf
/// for a group with `0 < amax < 127/FLT_MAX ≈ 3.7e-37` (and then `0·inf = NaN`); BF16 and F32 inputs
/// can be that small (BF16 normals reach 1.2e-38, subnormals 9e-41). Rejecting every nonzero value below
/// 2⁻¹²⁰ keeps each input group's amax either 0 (an all-zero group, scale 0) or ≥ 2⁻¹²⁰.
pub const MIN_MAGNITUDE: f32 = 7.523_164e-37; // 2^-120

/// The largest bound on a score in log2 units, `|a·sc| = |q·k|·c·log2 e`, accepted: 2¹⁶. The forward's
/// running max `m = fl(a·sc)` is an f32 with an ulp of `2^(e−23)` at `|t| ∈ [2^e, 2^(e+1))`, while
/// `p = exp2(fma(a, sc, −m))` takes the exact product: `p ≤ 2^(8 + ulp/2)` (8 from the lazy rescale
/// threshold). At `|t| ≥ 2³¹` the ulp is 2⁸ and `p` overflows to +inf (O = NaN, LSE = +inf: the bound
/// the forward breaks at). The backward's `exp2(fma(a, sc, −L))` with the f32 LSE `L` is off by up to
/// `ulp(L)/2` in the exponent: below 2¹⁶ that is 2⁻⁸ (0.27 % in P, BF16's own rounding), above it the
/// normalized P exceeds 1 by more than BF16 resolution and the gradients are wrong, though finite.
pub const MAX_SCORE_LOG2: f64 = 65536.0;

/// The largest estimate of an output or intermediate magnitude accepted: 2¹²⁰, 2⁸ below FLT_MAX, the
/// room the INT8 dequantization products `fl(s_a·s_b)` and the FP32 accumulators need.
pub const MAX_VALUE_ESTIMATE: f64 = 1.329_228e36; // 2^120

/// The largest value of `t` and its flat index.
fn max_abs(t: &[f32]) -> (usize, f32) {
    t.iter().enumerate().fold(
        (0, 0.0f32),
        |best, (i, &x)| if x.abs() > best.1 { (i, x.abs()) } else { best },
    )
}

/// Rejects finite inputs that the method cannot represent, naming the tensor, the index and the bound:
/// nonzero magnitudes below [`MIN_MAGNITUDE`]; scores whose Cauchy–Schwarz bound
/// `max‖q_i‖ · max(‖k_j‖, ‖k_j − k̄‖) · c · log2 e` (per batch and head; the second norm is K after
/// K-smoothing) exceeds [`MAX_SCORE_LOG2`]; and inputs whose bounds on O's accumulator
/// (`2⁹·N_k·max|v|`), dP and D (`d·max|dO|·max|v|`), dQ (`2c·N_k·max|k|·dP`), dK (`2c·N_q·max|q|·dP`) and
/// dV (`N_q·max|dO|`) exceed [`MAX_VALUE_ESTIMATE`]. INT32 accumulation is exact for `N ≤ 131072`
/// (`127²·d` per product, at most `2³¹` summed over `d ≤ 256` channels; the shape check enforces it).
pub fn check_magnitudes(inp: &Inputs) -> crate::Result<()> {
    let s = inp.shape;
    let d = s.head_dim;
    let mut tensors: Vec<(&str, &[f32])> = vec![("q", &inp.q), ("k", &inp.k), ("v", &inp.v)];
    if let Some(d_o) = &inp.d_o {
        tensors.push(("do", d_o));
    }
    for (name, t) in &tensors {
        if let Some(index) = t.iter().position(|x| *x != 0.0 && x.abs() < MIN_MAGNITUDE) {
            return Err(crate::Error::OutOfRange {
                tensor: name.to_string(),
                index,
                value: t[index],
                bound: format!(
                    "nonzero magnitudes must be at least 2^-120 ≈ {MIN_MAGNITUDE:e} (the quantizer's 127/amax overflows below 127/FLT_MAX ≈ 3.7e-37); use 0 or rescale the tensor"
                ),
            });
        }
    }
    let c = s.softmax_scale();
    let norm = |row: &[f32]| row.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>().sqrt();
    for b in 0..s.batch {
        for hk in 0..s.heads_kv {
            let base = (b * s.heads_kv + hk) * s.n_k * d;
            let k = &inp.k[base..base + s.n_k * d];
            let mut mean = vec![0.0f64; d];
            k.chunks(d).for_each(|row| {
                row.iter()
                    .zip(&mut mean)
                    .for_each(|(&x, m)| *m += x as f64 / s.n_k as f64)
            });
            let kn = k
                .chunks(d)
                .map(|row| {
                    norm(row).max(
                        row.iter()
                            .zip(&mean)
                            .map(|(&x, m)| (x as f64 - m).powi(2))
                            .sum::<f64>()
                            .sqrt(),
                    )
                })
                .fold(0.0, f64::max);
            for hq in hk * s.group()..(hk + 1) * s.group() {
                let qbase = (b * s.heads_q + hq) * s.n_q * d;
                let (row, qn) = inp.q[qbase..qbase + s.n_q * d]
                    .chunks(d)
                    .map(norm)
                    .enumerate()
                    .fold((0, 0.0), |m, (i, n)| if n > m.1 { (i, n) } else { m });
                let t = qn * kn * c * std::f64::consts::LOG2_E;
                if t > MAX_SCORE_LOG2 {
                    let (i, v) = max_abs(&inp.q[qbase + row * d..qbase + (row + 1) * d]);
                    return Err(crate::Error::OutOfRange {
                        tensor: "q".into(),
                        index: qbase + row * d + i,
                        value: v,
                        bound: format!(
                            "scores of batch {b}, head {hq} may reach {t:.3e} in log2 units (max‖q_i‖ {qn:.3e} at row {row} × max‖k_j‖ {kn:.3e} × 1/√d × log2 e), above the bound 2^16 = {MAX_SCORE_LOG2}: the f32 running max and LSE cannot resolve such scores (the forward overflows from 2^31); rescale Q or K (QK-norm)"
                        ),
                    });
                }
            }
        }
    }
    let (vi, v) = max_abs(&inp.v);
    let (ki, k) = max_abs(&inp.k);
    let (qi, q) = max_abs(&inp.q);
    let (v, k, q) = (v as f64, k as f64, q as f64);
    let (nq, nk) = (s.n_q as f64, s.n_k as f64);
    let over = |tensor: &str, index: usize, value: f64, what: String| crate::Error::OutOfRange {
        tensor: tensor.into(),
        index,
        value: value as f32,
        bound: format!("{what}, above the bound 2^120 ≈ {MAX_VALUE_ESTIMATE:e} (FLT_MAX/2^8); rescale the inputs"),
    };
    let o_acc = 512.0 * nk * v;
    if o_acc > MAX_VALUE_ESTIMATE {
        return Err(over(
            "v",
            vi,
            v,
            format!("O's accumulator 2^9·N_k·max|v| may reach {o_acc:.3e}"),
        ));
    }
    if let Some(d_o) = &inp.d_o {
        let (gi, g) = max_abs(d_o);
        let g = g as f64;
        let dp = d as f64 * g * v;
        let estimates = [
            ("dP = dO·Vᵀ and D = rowsum(dO∘O): d·max|dO|·max|v|", dp, "do", gi, g),
            ("dQ: 2c·N_k·max|k|·d·max|dO|·max|v|", 2.0 * c * nk * k * dp, "k", ki, k),
            ("dK: 2c·N_q·max|q|·d·max|dO|·max|v|", 2.0 * c * nq * q * dp, "q", qi, q),
            ("dV: N_q·max|dO|", nq * g, "do", gi, g),
        ];
        for (what, est, tensor, index, value) in estimates {
            if est > MAX_VALUE_ESTIMATE {
                return Err(over(tensor, index, value, format!("{what} may reach {est:.3e}")));
            }
        }
    }
    Ok(())
}
