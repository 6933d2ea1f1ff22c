//! Rotary position embedding, half-split pairing (channel `i` rotates with `i + d/2`, as in
//! GPT-NeoX and Hugging Face Llama): `(x₁, x₂) ↦ (x₁ cos θ − x₂ sin θ, x₁ sin θ + x₂ cos θ)` with
//! `θ = t · base^(−2i/d)` at position `t`.

use rayon::prelude::*;

pub struct Rotary {
    half: usize,
    /// `[max_seq, half]`.
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rotary {
    pub fn new(head_dim: usize, max_seq: usize, base: f32) -> Rotary {
        let half = head_dim / 2;
        let (mut cos, mut sin) = (Vec::with_capacity(max_seq * half), Vec::with_capacity(max_seq * half));
        for t in 0..max_seq {
            for i in 0..half {
                let freq = (base as f64).powf(-2.0 * i as f64 / head_dim as f64);
                let angle = t as f64 * freq;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        Rotary { half, cos, sin }
    }

    /// The `[max_seq, head_dim / 2]` cosine and sine tables (the GPU path uploads them).
    pub fn tables(&self) -> (&[f32], &[f32]) {
        (&self.cos, &self.sin)
    }

    /// Rotates `x` (`[batch·seq, heads·head_dim]`) in place; `inverse` applies the transposed rotation,
    /// which is the backward (a rotation's Jacobian is the rotation).
    pub fn apply(&self, x: &mut [f32], seq: usize, heads: usize, inverse: bool) {
        let (half, width) = (self.half, heads * 2 * self.half);
        let sign = if inverse { -1.0 } else { 1.0 };
        x.par_chunks_mut(width).enumerate().for_each(|(row, xr)| {
            let t = row % seq;
            let (cos, sin) = (&self.cos[t * half..(t + 1) * half], &self.sin[t * half..(t + 1) * half]);
            for head in xr.chunks_mut(2 * half) {
                let (x1, x2) = head.split_at_mut(half);
                for i in 0..half {
                    let (a, b, s) = (x1[i], x2[i], sign * sin[i]);
                    x1[i] = a * cos[i] - b * s;
                    x2[i] = a * s + b * cos[i];
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inverse_undoes_the_rotation_and_position_zero_is_identity() {
        let r = Rotary::new(8, 16, 10_000.0);
        let orig: Vec<f32> = (0..3 * 16).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut x = orig.clone();
        r.apply(&mut x, 3, 2, false);
        assert_eq!(&x[..16], &orig[..16], "position 0 must not rotate");
        assert!(x[16..].iter().zip(&orig[16..]).any(|(a, b)| (a - b).abs() > 1e-3));
        r.apply(&mut x, 3, 2, true);
        for (a, b) in x.iter().zip(&orig) {
            assert!((a - b).abs() < 1e-6);
        }
    }
}
