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
            GroupScale { scale: amax / 127.0, inv: 127.0 / amax }
        }
    }

    /// The scale of the group made of `values`.
    pub fn of(values: impl IntoIterator<Item = f32>) -> GroupScale {
        GroupScale::from_amax(values.into_iter().fold(0.0f32, |m, x| m.max(x.abs())))
    }

    /// `clamp(rne(fl(x · inv)), −127, 127)`. The product is rounded to f32 first (no FMA).
    #[inline]
    pub fn quantize(&self, x: f32) -> i8 {
        let y = x * self.inv;
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

    #[test]
    fn zero_group_has_zero_scale_and_no_nan() {
        let (q, s) = quantize_rows(&[0.0; 8], 4, 2);
        assert_eq!(s, vec![0.0]);
        assert!(q.iter().all(|&v| v == 0));
        assert_eq!(dequant(0, 0.0, 5.0), 0.0);
    }

    #[test]
    fn tiny_groups_are_not_flushed_by_an_epsilon() {
        // dS entries of a trained model are ~1e-7: they must still use the full INT8 range.
        let x = [1e-7f32, -3e-8, 5e-8, 0.0];
        let (q, s) = quantize_rows(&x, 4, 1);
        assert_eq!(q[0], 127);
        assert!((q[1] as f32 * s[0] - x[1]).abs() <= 0.5 * s[0]);
    }
}
