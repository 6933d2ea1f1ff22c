//! Problem shapes and host tensors. Every tensor is row-major `B × H × N × d` (heads before tokens),
//! stored as `f32` whose values are BF16-representable when they are inputs.

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// Dimensions of one attention problem. Queries have `heads_q` heads, keys/values `heads_kv`
/// (grouped-query attention when `heads_kv < heads_q`; query head `h` reads kv head
/// `h / (heads_q / heads_kv)`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shape {
    pub batch: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub n_q: usize,
    pub n_k: usize,
    pub head_dim: usize,
}

/// Largest head dimension the CPU paths accept.
pub const MAX_HEAD_DIM_CPU: usize = 256;

impl Shape {
    /// `batch × heads × n × d`, the same for queries and keys, no GQA.
    pub fn square(batch: usize, heads: usize, n: usize, head_dim: usize) -> Shape {
        Shape {
            batch,
            heads_q: heads,
            heads_kv: heads,
            n_q: n,
            n_k: n,
            head_dim,
        }
    }

    pub fn q_len(&self) -> usize {
        self.batch * self.heads_q * self.n_q * self.head_dim
    }
    pub fn kv_len(&self) -> usize {
        self.batch * self.heads_kv * self.n_k * self.head_dim
    }
    /// Query heads that share one kv head.
    pub fn group(&self) -> usize {
        self.heads_q / self.heads_kv
    }
    /// Softmax scale `c = 1/sqrt(d)`.
    pub fn softmax_scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }

    /// Checks that the shape describes a non-empty, well-formed problem.
    pub fn validate(&self) -> Result<()> {
        let dims = [
            ("batch", self.batch),
            ("heads_q", self.heads_q),
            ("heads_kv", self.heads_kv),
            ("n_q", self.n_q),
            ("n_k", self.n_k),
            ("head_dim", self.head_dim),
        ];
        for (name, v) in dims {
            if v == 0 {
                return Err(Error::Shape(format!("{name} is 0: empty problems are not supported")));
            }
        }
        if !self.heads_q.is_multiple_of(self.heads_kv) {
            return Err(Error::Shape(format!(
                "query heads ({}) must be a multiple of key/value heads ({})",
                self.heads_q, self.heads_kv
            )));
        }
        if self.head_dim > MAX_HEAD_DIM_CPU {
            return Err(Error::HeadDim {
                got: self.head_dim,
                supported: format!("the CPU paths support 1..={MAX_HEAD_DIM_CPU}"),
            });
        }
        // INT32 accumulation is exact only for reductions shorter than 2^31 / 127^2 = 133,143.
        let longest = self.n_q.max(self.n_k).max(self.head_dim);
        if longest > 131_072 {
            return Err(Error::Shape(format!(
                "sequence length {longest} exceeds 131072, where INT32 accumulation stays exact"
            )));
        }
        Ok(())
    }
}

/// The inputs of one problem: Q, K, V and optionally the output gradient dO.
#[derive(Clone, Debug)]
pub struct Inputs {
    pub shape: Shape,
    pub causal: bool,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub d_o: Option<Vec<f32>>,
}

impl Inputs {
    /// Checks the shape, the tensor lengths, that every value is finite, and that the magnitudes are
    /// ones the method represents (`inputs::check_magnitudes`).
    pub fn validate(&self) -> Result<()> {
        self.shape.validate()?;
        let s = &self.shape;
        let mut tensors: Vec<(&str, &[f32], usize)> = vec![
            ("q", &self.q, s.q_len()),
            ("k", &self.k, s.kv_len()),
            ("v", &self.v, s.kv_len()),
        ];
        if let Some(d_o) = &self.d_o {
            tensors.push(("do", d_o, s.q_len()));
        }
        for (name, t, want) in tensors {
            if t.len() != want {
                return Err(Error::Shape(format!(
                    "tensor `{name}` has {} elements, expected {want} for shape {s:?}",
                    t.len()
                )));
            }
            check_finite(name, t)?;
        }
        crate::inputs::check_magnitudes(self)
    }

    /// Rounds every input to BF16 (the precision the GPU kernels take them in).
    pub fn round_to_bf16(&mut self) {
        round_bf16_slice(&mut self.q);
        round_bf16_slice(&mut self.k);
        round_bf16_slice(&mut self.v);
        if let Some(d) = &mut self.d_o {
            round_bf16_slice(d);
        }
    }
}

/// The first NaN or Inf in `t` as an error.
pub fn check_finite(name: &str, t: &[f32]) -> Result<()> {
    match t.iter().position(|x| !x.is_finite()) {
        Some(index) => Err(Error::NonFinite {
            tensor: name.to_string(),
            index,
            value: t[index],
        }),
        None => Ok(()),
    }
}

/// Round to the nearest BF16 (ties to even), returned as f32.
#[inline]
pub fn bf16(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

pub fn round_bf16_slice(t: &mut [f32]) {
    t.iter_mut().for_each(|x| *x = bf16(*x));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shape_validation_names_the_problem() {
        assert!(Shape::square(1, 2, 16, 64).validate().is_ok());
        let e = Shape::square(1, 2, 0, 64).validate().unwrap_err().to_string();
        assert!(e.contains("n_q is 0"), "{e}");
        let mut s = Shape::square(1, 3, 16, 64);
        s.heads_kv = 2;
        assert!(s.validate().unwrap_err().to_string().contains("multiple"));
        let e = Shape::square(1, 1, 16, 512).validate().unwrap_err();
        assert!(matches!(e, Error::HeadDim { got: 512, .. }));
    }

    #[test]
    fn bf16_rounds_to_nearest_even() {
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
        assert_eq!(bf16(1.0 + 1.0 / 256.0), 1.0);
        assert_eq!(bf16(1.0 + 3.0 / 256.0), 1.0 + 4.0 / 256.0);
    }
}
