//! The boundary between the model and the hardware: matrix products and the attention op.
//!
//! The model (`crate::model`) is written once against [`Backend`]. The CPU backend
//! ([`cpu::CpuBackend`]) runs the products in f32 with rayon and attention through the `sagebwd`
//! crate (exact f64 reference or the quantized-method simulator). A GPU backend will implement the
//! same trait with cuBLASLt GEMMs and the `sagebwd-cuda` kernels (keeping tensors on the device is a
//! later step: the trait takes host slices today).

pub mod cpu;
pub mod gemm;

use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

/// Which attention the model runs: the exact f64 reference, or the quantized method with a
/// `sagebwd::Config` (presets `fpa`, `sagebwd`, `int8-all`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Attention {
    Exact,
    Method { name: String, config: sagebwd::Config },
}

/// Names accepted by [`Attention::parse`].
pub const ATTENTION_NAMES: [&str; 4] = ["fpa", "sagebwd", "int8-all", "exact"];

impl Attention {
    pub fn parse(name: &str) -> Result<Attention> {
        let name = name.trim().to_ascii_lowercase();
        if name == "exact" {
            return Ok(Attention::Exact);
        }
        match sagebwd::Config::preset(&name) {
            Ok(config) => Ok(Attention::Method { name, config }),
            Err(_) => Err(Error::Config(format!(
                "unknown attention preset `{name}` (expected one of: {})",
                ATTENTION_NAMES.join(", ")
            ))),
        }
    }

    pub fn name(&self) -> &str {
        match self {
            Attention::Exact => "exact",
            Attention::Method { name, .. } => name,
        }
    }
}

/// Shape of one causal self-attention call: Q is `[batch, heads_q, seq, head_dim]`, K and V are
/// `[batch, heads_kv, seq, head_dim]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    pub batch: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub seq: usize,
    pub head_dim: usize,
}

/// Gradients of the attention inputs, in their layouts.
pub struct AttnGrads {
    pub dq: Vec<f32>,
    pub dk: Vec<f32>,
    pub dv: Vec<f32>,
}

/// What the model needs from the hardware.
pub trait Backend: Send + Sync {
    /// A short description for logs ("cpu (2 threads), attention sagebwd").
    fn describe(&self) -> String;
    /// `out[m×n] = a[m×k] · b[k×n]` (row-major), or `+=` when `accumulate`. (BLAS-style argument
    /// list: operands, then the three sizes.)
    #[allow(clippy::too_many_arguments)]
    fn gemm(&self, out: &mut [f32], a: &[f32], b: &[f32], m: usize, k: usize, n: usize, accumulate: bool);
    /// `out[m×n] = a_tᵀ · b[k×n]` with `a_t` stored `k×m`, or `+=` when `accumulate`.
    #[allow(clippy::too_many_arguments)]
    fn gemm_at(&self, out: &mut [f32], a_t: &[f32], b: &[f32], m: usize, k: usize, n: usize, accumulate: bool);
    /// Causal attention forward: returns O, `[batch, heads_q, seq, head_dim]`.
    fn attention_forward(&self, shape: AttnShape, q: &[f32], k: &[f32], v: &[f32]) -> Result<Vec<f32>>;
    /// Causal attention backward given the output gradient `d_o` (O is the forward's output).
    fn attention_backward(
        &self,
        shape: AttnShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        o: &[f32],
        d_o: &[f32],
    ) -> Result<AttnGrads>;
}
