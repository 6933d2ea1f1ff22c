//! FP8 formats of Hopper's tensor cores, e4m3 (OCP "E4M3FN": no infinity, max 448) and e5m2 (IEEE-like,
//! max 57344), and the conversions of PTX `cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32`: round to nearest, ties
//! to even, magnitudes beyond the largest finite value (infinities included) saturate to it, NaN stays
//! NaN. Subnormals are kept. A model of the FP8 tensor core's limited-precision sum is in [`TensorSum`].

/// One of the two FP8 formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Fp8 {
    E4m3,
    E5m2,
}

impl Fp8 {
    /// Mantissa (fraction) bits.
    pub const fn mantissa_bits(self) -> i32 {
        match self {
            Fp8::E4m3 => 3,
            Fp8::E5m2 => 2,
        }
    }

    /// The exponent of the smallest normal number (−6 and −14).
    pub const fn min_normal_exp(self) -> i32 {
        match self {
            Fp8::E4m3 => -6,
            Fp8::E5m2 => -14,
        }
    }

    /// The largest finite value: 448 and 57344.
    pub const fn max(self) -> f32 {
        match self {
            Fp8::E4m3 => 448.0,
            Fp8::E5m2 => 57344.0,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Fp8::E4m3 => "e4m3",
            Fp8::E5m2 => "e5m2",
        }
    }

    /// The value of the code `b` (NaN codes give NaN, e5m2's infinity codes ±∞).
    pub fn decode(self, b: u8) -> f32 {
        let m = self.mantissa_bits();
        let e_bits = 7 - m;
        let bias = (1 << (e_bits - 1)) - 1;
        let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
        let e = ((b as i32) >> m) & ((1 << e_bits) - 1);
        let f = (b as i32) & ((1 << m) - 1);
        let all_ones = (1 << e_bits) - 1;
        match self {
            Fp8::E4m3 if e == all_ones && f == (1 << m) - 1 => return f32::NAN,
            Fp8::E5m2 if e == all_ones => return if f == 0 { sign * f32::INFINITY } else { f32::NAN },
            _ => {}
        }
        let mag = if e == 0 {
            f as f32 * 2f32.powi(1 - bias - m)
        } else {
            (((1 << m) + f) as f32) * 2f32.powi(e - bias - m)
        };
        sign * mag
    }

    /// `cvt.rn.satfinite` of one FP32 value: the code of the nearest representable value (ties to
    /// the even code), saturated to ±max.
    pub fn encode(self, x: f32) -> u8 {
        let m = self.mantissa_bits();
        let bias = (1 << (6 - m)) - 1;
        let nan = match self {
            Fp8::E4m3 => 0x7f,
            Fp8::E5m2 => 0x7f,
        };
        if x.is_nan() {
            return nan;
        }
        let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
        let a = (x as f64).abs();
        let max = self.max() as f64;
        let q = if a >= max {
            max
        } else {
            // The exponent of a (f32 subnormals are far below every FP8 value: clamped like the rest).
            let e = if a == 0.0 {
                self.min_normal_exp()
            } else {
                a.log2().floor() as i32
            };
            let e = e.max(self.min_normal_exp());
            let quantum = 2f64.powi(e - m);
            ((a / quantum).round_ties_even() * quantum).min(max)
        };
        if q == 0.0 {
            return sign;
        }
        let e = q.log2().floor() as i32;
        let code = if e < self.min_normal_exp() {
            (q / 2f64.powi(self.min_normal_exp() - m)) as u8
        } else {
            let frac = (q / 2f64.powi(e - m)) as i32 - (1 << m);
            (((e + bias) << m) | frac) as u8
        };
        sign | code
    }

    /// `decode(encode(x))`: x rounded to this format.
    pub fn round(self, x: f32) -> f32 {
        self.decode(self.encode(x))
    }

    /// The power-of-two scale `s = 2^e`, smallest with `amax / s ≤ max`, so that `x / s` is exact and
    /// fits (0 for an all-zero group). Power-of-two scales fold into any other factor without rounding.
    pub fn pow2_scale(self, amax: f32) -> f32 {
        if amax == 0.0 {
            return 0.0;
        }
        let mut e = (amax as f64 / self.max() as f64).log2().ceil() as i32;
        while amax as f64 / 2f64.powi(e) > self.max() as f64 {
            e += 1;
        }
        while e > -149 && amax as f64 / 2f64.powi(e - 1) <= self.max() as f64 {
            e -= 1;
        }
        2f64.powi(e) as f32
    }

    /// `x / s` rounded to this format (`s` a power of two from [`Fp8::pow2_scale`]; 0 gives 0).
    pub fn quantize(self, x: f32, s: f32) -> f32 {
        if s == 0.0 {
            0.0
        } else {
            self.round((x as f64 / s as f64) as f32)
        }
    }
}

/// A model of the FP8 tensor core's sum (`wgmma` e4m3/e5m2 → FP32). The products of two FP8 values
/// are exact. `mantissa_bits = 0`: each k = 32 instruction adds its 32 products exactly and rounds the
/// result to FP32 (an ideal FP32 accumulator). `mantissa_bits = b > 0`: each instruction aligns its
/// products and the running accumulator to the largest exponent among them and truncates every term
/// to `b` significant bits there (the ~14 bits DeepSeek-V3 reports for Hopper), then sums.
/// `promote > 0`: every `promote` reduction elements the tensor-core accumulator is added to an FP32
/// register sum (one FADD per value) and restarts at 0; `promote = 0`: it never does (the accumulator
/// itself carries the whole reduction).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize, Default)]
pub struct TensorSum {
    pub mantissa_bits: u32,
    pub promote: usize,
}

/// The `k` of one FP8 `wgmma` instruction.
pub const WGMMA_K: usize = 32;

/// The running state of one output value's tensor-core reduction.
#[derive(Clone, Copy, Debug)]
pub struct TcAcc {
    /// The FP32 register sum (used when promoting).
    pub reg: f32,
    /// The tensor core's accumulator.
    pub tc: f32,
}

impl TensorSum {
    /// A reduction starting from `init` (the FP32 value the products are added to).
    pub fn start(&self, init: f32) -> TcAcc {
        if self.promote == 0 {
            TcAcc { reg: 0.0, tc: init }
        } else {
            TcAcc { reg: init, tc: 0.0 }
        }
    }

    /// Adds `terms` (exact products), the first of which is reduction element `index0`: instruction
    /// boundaries are the multiples of [`WGMMA_K`], promotion boundaries the multiples of `promote`.
    pub fn add(&self, acc: &mut TcAcc, terms: &[f64], index0: usize) {
        let mut i = 0;
        while i < terms.len() {
            let at = index0 + i;
            let end = (i + WGMMA_K - at % WGMMA_K).min(terms.len());
            acc.tc = self.chunk(acc.tc, &terms[i..end]);
            i = end;
            if self.promote > 0 && (index0 + i).is_multiple_of(self.promote) {
                acc.reg += acc.tc;
                acc.tc = 0.0;
            }
        }
    }

    /// The final FP32 value.
    pub fn finish(&self, acc: TcAcc) -> f32 {
        if self.promote == 0 {
            acc.tc
        } else {
            acc.reg + acc.tc
        }
    }

    fn chunk(&self, tc: f32, terms: &[f64]) -> f32 {
        if self.mantissa_bits == 0 {
            return (tc as f64 + terms.iter().sum::<f64>()) as f32;
        }
        let amax = terms.iter().fold((tc as f64).abs(), |m, t| m.max(t.abs()));
        if amax == 0.0 {
            return tc;
        }
        let q = 2f64.powi(amax.log2().floor() as i32 + 1 - self.mantissa_bits as i32);
        let tr = |x: f64| (x / q).trunc() * q;
        (tr(tc as f64) + terms.iter().map(|&t| tr(t)).sum::<f64>()) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_codes(f: Fp8) -> Vec<(u8, f32)> {
        (0..=255u8).map(|b| (b, f.decode(b))).collect()
    }

    #[test]
    fn known_values() {
        assert_eq!(Fp8::E4m3.decode(0x7e), 448.0);
        assert_eq!(Fp8::E4m3.decode(0x08), 2f32.powi(-6)); // min normal
        assert_eq!(Fp8::E4m3.decode(0x01), 2f32.powi(-9)); // min subnormal
        assert!(Fp8::E4m3.decode(0x7f).is_nan() && Fp8::E4m3.decode(0xff).is_nan());
        assert_eq!(Fp8::E4m3.decode(0x38), 1.0);
        assert_eq!(Fp8::E5m2.decode(0x7b), 57344.0);
        assert_eq!(Fp8::E5m2.decode(0x04), 2f32.powi(-14));
        assert_eq!(Fp8::E5m2.decode(0x01), 2f32.powi(-16));
        assert_eq!(Fp8::E5m2.decode(0x7c), f32::INFINITY);
        assert_eq!(Fp8::E5m2.decode(0xfc), f32::NEG_INFINITY);
        assert!(Fp8::E5m2.decode(0x7d).is_nan());
        assert_eq!(Fp8::E5m2.decode(0x3c), 1.0);
        // The number of NaN codes: e4m3 2, e5m2 6.
        assert_eq!(all_codes(Fp8::E4m3).iter().filter(|c| c.1.is_nan()).count(), 2);
        assert_eq!(all_codes(Fp8::E5m2).iter().filter(|c| c.1.is_nan()).count(), 6);
    }

    /// Every finite code converts back to itself (−0 included); infinities saturate; NaN stays NaN.
    #[test]
    fn every_code_round_trips() {
        for f in [Fp8::E4m3, Fp8::E5m2] {
            for (b, v) in all_codes(f) {
                if v.is_nan() {
                    assert!(f.decode(f.encode(v)).is_nan());
                } else if v.is_infinite() {
                    assert_eq!(f.decode(f.encode(v)), v.signum() * f.max(), "{f:?} {b:#x}");
                } else {
                    assert_eq!(f.encode(v), b, "{f:?} {b:#x} = {v}");
                }
            }
        }
    }

    /// Between two neighbouring finite values: just below the midpoint goes down, just above goes up,
    /// the midpoint itself goes to the even code; beyond the max saturates; half the smallest
    /// subnormal rounds to 0 (even), a hair above it to the smallest subnormal.
    #[test]
    fn rounding_boundaries() {
        for f in [Fp8::E4m3, Fp8::E5m2] {
            let mut pos: Vec<(u8, f32)> = all_codes(f)
                .into_iter()
                .filter(|(b, v)| b & 0x80 == 0 && v.is_finite())
                .collect();
            pos.sort_by(|a, b| a.1.partial_cmp(&b.1).unwrap());
            for w in pos.windows(2) {
                let ((b0, lo), (b1, hi)) = (w[0], w[1]);
                let mid = (lo + hi) / 2.0; // exact in f32
                let even = if b0 & 1 == 0 { b0 } else { b1 };
                for s in [1.0f32, -1.0] {
                    let sb = if s < 0.0 { 0x80 } else { 0 };
                    assert_eq!(f.encode(s * mid), even | sb, "{f:?} mid {mid}");
                    let below = f32::from_bits(mid.to_bits() - 1);
                    let above = f32::from_bits(mid.to_bits() + 1);
                    assert_eq!(f.encode(s * below), b0 | sb, "{f:?} below {mid}");
                    assert_eq!(f.encode(s * above), b1 | sb, "{f:?} above {mid}");
                }
            }
            let max_code = pos.last().unwrap().0;
            for x in [f.max() * 1.01, f.max() * 1e6, f32::MAX, f32::INFINITY] {
                assert_eq!(f.encode(x), max_code);
                assert_eq!(f.encode(-x), max_code | 0x80);
            }
            let tiny = pos[1].1;
            assert_eq!(f.encode(tiny / 2.0), 0);
            assert_eq!(f.encode(f32::from_bits((tiny / 2.0).to_bits() + 1)), pos[1].0);
            assert_eq!(f.encode(-tiny / 4.0), 0x80);
            assert_eq!(f.encode(1e-40), 0); // an f32 subnormal
        }
    }

    #[test]
    fn pow2_scale_fits_and_is_tight() {
        for f in [Fp8::E4m3, Fp8::E5m2] {
            for amax in [1e-30f32, 3e-7, 1.0, 448.0, 449.0, 5e4, 3e30] {
                let s = f.pow2_scale(amax);
                assert_eq!(s.to_bits() & 0x007f_ffff, 0, "power of two");
                assert!(amax / s <= f.max() && amax / s > f.max() / 2.0, "{f:?} {amax} {s}");
                assert_eq!(f.quantize(amax, s) * s, f.round(amax / s) * s);
            }
            assert_eq!(f.pow2_scale(0.0), 0.0);
            assert_eq!(f.quantize(1.0, 0.0), 0.0);
        }
    }

    #[test]
    fn tensor_sum_exact_and_truncated() {
        let exact = TensorSum::default();
        let terms: Vec<f64> = (0..100).map(|i| 1.0 + i as f64 * 2f64.powi(-20)).collect();
        let mut a = exact.start(0.0);
        exact.add(&mut a, &terms, 0);
        assert!((exact.finish(a) as f64 - terms.iter().sum::<f64>()).abs() < 1e-4);
        // 14 bits: a large accumulator swallows small products entirely (truncated, not rounded).
        let t14 = TensorSum {
            mantissa_bits: 14,
            promote: 0,
        };
        let mut a = t14.start(2f32.powi(14));
        t14.add(&mut a, &[0.75; 32], 0);
        assert_eq!(t14.finish(a), 2f32.powi(14));
        // Promotion every 32: each chunk starts from 0, so the products survive.
        let p = TensorSum {
            mantissa_bits: 14,
            promote: 32,
        };
        let mut a = p.start(2f32.powi(14));
        p.add(&mut a, &[0.75; 32], 0);
        assert_eq!(p.finish(a), 2f32.powi(14) + 24.0);
        // Instruction boundaries follow the reduction index: 40 terms from index 24 are chunks 8 + 32.
        let mut a = t14.start(0.0);
        t14.add(&mut a, &[1.0; 40], 24);
        assert_eq!(t14.finish(a), 40.0);
    }
}
