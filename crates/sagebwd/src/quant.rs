//! The quantizer of ALGORITHM.md §2.2, shared by the simulator and mirrored by the GPU kernels.

/// One group's scale and its quantizing reciprocal. `scale == 0` marks an all-zero group.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupScale {
    /// `fl(amax / 127)`, used to dequantize.
    pub scale: f32,
    /// `fl(127 / amax)`, used to quantize (0 for an all-zero group).
    pub inv: f32,
}

impl GroupScale {
    /// The scale of a group whose largest magnitude is `amax` (no epsilon, ALGORITHM.md §2.2).
    #[inline]
    pub fn from_amax(amax: f32) -> GroupScale {
        if amax == 0.0 {
            GroupScale { scale: 0.0, inv: 0.0 }
        } else {
            GroupScale {
                scale: amax / 127.0,
                inv: 127.0 / amax,
            }
        }
    }

    /// The scale of the group made of `values`.
    pub fn of(values: impl IntoIterator<Item = f32>) -> GroupScale {
        GroupScale::from_amax(values.into_iter().fold(0.0f32, |m, x| m.max(x.abs())))
    }

    /// `clamp(rne(x · inv), −127, 127)` with the product **exact**, not rounded to f32 first
    /// (ALGORITHM.md §2.2). The product of two f32 values is exact in f64 (24 + 24 significand bits
    /// ≤ 53, exponents far inside f64's range), so this is the kernels' one FMA
    /// `fma(x, inv, 1.5·2²³) − 1.5·2²³` (= `x.mul_add(inv, 1.5·2²³) − 1.5·2²³` for |x·inv| < 2²²;
    /// tested below) without a software FMA.
    #[inline]
    pub fn quantize(&self, x: f32) -> i8 {
        let y = x as f64 * self.inv as f64;
        y.round_ties_even().clamp(-127.0, 127.0) as i8
    }
}

/// Dequantize an exact INT32 accumulator: `fl(float(acc) · fl(s_a · s_b))` (ALGORITHM.md §2.3).
#[inline]
pub fn dequant(acc: i32, s_a: f32, s_b: f32) -> f32 {
    acc as f32 * (s_a * s_b)
}

/// Dequantize-and-accumulate (ALGORITHM.md §2.3, products #2, #4, #7): `fma(float(acc), fl(s_a · s_b),
/// sum)`, one rounding (`f32::mul_add` is the IEEE fused multiply-add, as `__fmaf_rn` in the kernels).
pub fn dequant_add(acc: i32, s_a: f32, s_b: f32, sum: f32) -> f32 {
    (acc as f32).mul_add(s_a * s_b, sum)
}

/// Quantizes `rows` rows of `width` values (a row-major block) as one group into `out`.
pub fn quantize_block(block: &[f32], out: &mut [i8]) -> f32 {
    let g = GroupScale::of(block.iter().copied());
    for (o, &x) in out.iter_mut().zip(block) {
        *o = g.quantize(x);
    }
    g.scale
}

/// Quantizes a `n × d` row-major matrix in blocks of `block_rows` rows (the last may be short).
/// Returns (values, one scale per block).
pub fn quantize_rows(x: &[f32], d: usize, block_rows: usize) -> (Vec<i8>, Vec<f32>) {
    let mut q = vec![0i8; x.len()];
    let scales = x
        .chunks(block_rows * d)
        .zip(q.chunks_mut(block_rows * d))
        .map(|(xb, qb)| quantize_block(xb, qb))
        .collect();
    (q, scales)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rayon::prelude::*;

    #[test]
    fn quantizer_rounds_ties_to_even_and_hits_127() {
        let g = GroupScale::from_amax(127.0);
        assert_eq!(g.scale, 1.0);
        assert_eq!(g.quantize(2.5), 2);
        assert_eq!(g.quantize(3.5), 4);
        assert_eq!(g.quantize(-2.5), -2);
        assert_eq!(g.quantize(127.0), 127);
        assert_eq!(g.quantize(-127.0), -127);
        // The largest entry always maps to ±127 and never to -128.
        for amax in [1e-30f32, 1e-7, 0.3, 7.0, 3e20] {
            let g = GroupScale::from_amax(amax);
            assert_eq!(g.quantize(amax), 127);
            assert_eq!(g.quantize(-amax), -127);
        }
    }

    /// The kernels' rounding: one FMA with the magic constant 1.5·2²³ (any sign) or 2²³ (x ≥ 0).
    fn fma_rule(x: f32, inv: f32) -> i8 {
        const M: f32 = 12_582_912.0;
        (x.mul_add(inv, M) - M).clamp(-127.0, 127.0) as i8
    }
    fn fma_rule_pos(x: f32, inv: f32) -> i8 {
        const M: f32 = 8_388_608.0;
        (x.mul_add(inv, M) - M) as i8
    }
    /// The rule before 2026-12-01: the product rounded to f32, then to an integer.
    fn old_rule(x: f32, inv: f32) -> i8 {
        (x * inv).round_ties_even().clamp(-127.0, 127.0) as i8
    }

    #[test]
    fn product_is_exact_before_rounding_to_an_integer() {
        // Double rounding: fl(x·inv) lands exactly on k + ½ while the exact product does not.
        // inv = 1 − 2⁻²⁴ (the f32 below 1) = fl(127/amax) for amax = 127 + 2⁻¹⁷ (one ulp above 127).
        let amax = f32::from_bits(127.0f32.to_bits() + 1);
        let g = GroupScale::from_amax(amax);
        assert_eq!(g.inv, 1.0 - f32::EPSILON / 2.0);
        // x = 2.5 + 2⁻²²: exact x·inv = 2.5 + 0.375·2⁻²² − 2⁻⁴⁶, which f32 (ulp 2⁻²² there) rounds to
        // 2.5, and rne(2.5) = 2; the exact product is above 2.5, so x̂ = 3.
        let x = f32::from_bits(2.5f32.to_bits() + 1);
        assert_eq!(x * g.inv, 2.5);
        assert_eq!(old_rule(x, g.inv), 2);
        assert_eq!(g.quantize(x), 3);
        assert_eq!(g.quantize(-x), -3);
        assert_eq!(fma_rule(x, g.inv), 3);
        assert_eq!(fma_rule_pos(x, g.inv), 3);
        // And from below: inv = 1 + 2⁻²³ = fl(127/amax) for amax = 127 − 2⁻¹⁶ (two ulps below 127),
        // x = 3.5 − 2⁻²¹: exact x·inv = 3.5 − 0.25·2⁻²² − 2⁻⁴⁴, which f32 rounds to 3.5 (rne → 4); the
        // exact product is below 3.5, so x̂ = 3.
        let g = GroupScale::from_amax(f32::from_bits(127.0f32.to_bits() - 2));
        assert_eq!(g.inv, 1.0 + f32::EPSILON);
        let x = f32::from_bits(3.5f32.to_bits() - 2);
        assert_eq!(x * g.inv, 3.5);
        assert_eq!(old_rule(x, g.inv), 4);
        assert_eq!(g.quantize(x), 3);
        assert_eq!(g.quantize(-x), -3);
        assert_eq!(fma_rule(-x, g.inv), -3);
        assert_eq!(fma_rule_pos(x, g.inv), 3);
        // Exact ties still go to even.
        let one = GroupScale::from_amax(127.0);
        for (x, q) in [
            (0.5f32, 0i8),
            (1.5, 2),
            (2.5, 2),
            (126.5, 126),
            (-0.5, 0),
            (-1.5, -2),
            (-126.5, -126),
        ] {
            assert_eq!(one.quantize(x), q);
            assert_eq!(fma_rule(x, one.inv), q);
        }
    }

    #[test]
    fn f64_product_equals_the_kernels_fma() {
        // Pseudo-random groups over a wide range of magnitudes: the simulator's f64 rule, the kernels'
        // FMA (both magic constants) agree on every entry |x| ≤ amax, the largest entry maps to
        // ±127, and the old rule differs somewhere (so a one-sided revert would be caught above).
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut differ = 0;
        for _ in 0..2000 {
            let e = (next() % 120) as i32 - 60;
            let amax = (1.0 + (next() >> 40) as f32 / (1u64 << 24) as f32) * 2f32.powi(e);
            let g = GroupScale::from_amax(amax);
            assert_eq!(g.quantize(amax), 127);
            assert_eq!(g.quantize(-amax), -127);
            assert_eq!(fma_rule(amax, g.inv), 127);
            assert_eq!(fma_rule_pos(amax, g.inv), 127);
            for _ in 0..200 {
                let u = (next() >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
                                                                     // Half the entries near a half-integer step, where double rounding can show.
                let x = if next() & 1 == 0 {
                    u * amax
                } else {
                    let k = (next() % 127) as f32 + 0.5;
                    let t = f32::from_bits((k / g.inv).to_bits().wrapping_add((next() % 5) as u32).wrapping_sub(2));
                    t.min(amax)
                };
                for x in [x, -x] {
                    let q = g.quantize(x);
                    assert_eq!(q, fma_rule(x, g.inv), "x {x:e} inv {:e}", g.inv);
                    assert!((-127..=127).contains(&q));
                    if x >= 0.0 {
                        assert_eq!(q, fma_rule_pos(x, g.inv));
                    }
                    differ += (q != old_rule(x, g.inv)) as usize;
                }
            }
        }
        assert!(differ > 0);
    }

    #[test]
    fn zero_group_has_zero_scale_and_no_nan() {
        let (q, s) = quantize_rows(&[0.0; 8], 4, 2);
        assert_eq!(s, vec![0.0]);
        assert!(q.iter().all(|&v| v == 0));
        assert_eq!(dequant(0, 0.0, 5.0), 0.0);
        // inv = 0: every entry (and the kernels' FMA, masked zeros included) gives 0.
        let g = GroupScale::from_amax(0.0);
        for x in [0.0f32, -0.0, 1.0] {
            assert_eq!(g.quantize(x), 0);
            assert_eq!(fma_rule(x, g.inv), 0);
            assert_eq!(fma_rule_pos(x.abs(), g.inv), 0);
        }
    }

    #[test]
    fn tiny_groups_are_not_flushed_by_an_epsilon() {
        // dS entries of a trained model are ~1e-7: they must still use the full INT8 range.
        let x = [1e-7f32, -3e-8, 5e-8, 0.0];
        let (q, s) = quantize_rows(&x, 4, 1);
        assert_eq!(q[0], 127);
        assert!((q[1] as f32 * s[0] - x[1]).abs() <= 0.5 * s[0]);
    }

    /// The kernels compute a group's scale `fl(amax / 127)` as `fl(q0 + fl(amax − q0·127)·y)` with
    /// `q0 = fl(amax·y)`, `y = fl(1/127)` (two FMAs, `div127_rn` in common.cuh) instead of an IEEE
    /// division. That is correctly rounded for every non-negative finite f32 — checked here on all 2³¹.
    #[test]
    fn div127_by_reciprocal_is_exact() {
        let y = 1.0f32 / 127.0;
        let bad = (0u32..0x7f80_0000)
            .into_par_iter()
            .filter(|&bits| {
                let x = f32::from_bits(bits);
                let q0 = x * y;
                (-q0).mul_add(127.0, x).mul_add(y, q0).to_bits() != (x / 127.0).to_bits()
            })
            .count();
        assert_eq!(bad, 0);
    }
}
