//! The CPU backend: f32 products ([`super::gemm`]) and attention from the `sagebwd` crate.

use super::{
    gemm::{gemm, gemm_at},
    Attention, AttnGrads, AttnShape, Backend,
};
use crate::error::Result;

pub struct CpuBackend {
    pub attention: Attention,
}

impl CpuBackend {
    pub fn new(attention: Attention) -> CpuBackend {
        CpuBackend { attention }
    }

    fn inputs(shape: AttnShape, q: &[f32], k: &[f32], v: &[f32], d_o: Option<&[f32]>) -> sagebwd::Inputs {
        sagebwd::Inputs {
            shape: sagebwd::Shape {
                batch: shape.batch,
                heads_q: shape.heads_q,
                heads_kv: shape.heads_kv,
                n_q: shape.seq,
                n_k: shape.seq,
                head_dim: shape.head_dim,
            },
            causal: true,
            q: q.to_vec(),
            k: k.to_vec(),
            v: v.to_vec(),
            d_o: d_o.map(|d| d.to_vec()),
        }
    }
}

fn to_f32(x: Vec<f64>) -> Vec<f32> {
    x.into_iter().map(|v| v as f32).collect()
}

impl Backend for CpuBackend {
    fn describe(&self) -> String {
        format!(
            "cpu ({} threads), attention {}",
            rayon::current_num_threads(),
            self.attention.name()
        )
    }

    fn gemm(&self, out: &mut [f32], a: &[f32], b: &[f32], m: usize, k: usize, n: usize, accumulate: bool) {
        gemm(out, a, b, m, k, n, accumulate)
    }

    fn gemm_at(&self, out: &mut [f32], a_t: &[f32], b: &[f32], m: usize, k: usize, n: usize, accumulate: bool) {
        gemm_at(out, a_t, b, m, k, n, accumulate)
    }

    fn attention_forward(&self, shape: AttnShape, q: &[f32], k: &[f32], v: &[f32]) -> Result<Vec<f32>> {
        let inp = Self::inputs(shape, q, k, v, None);
        Ok(match &self.attention {
            Attention::Exact => to_f32(sagebwd::reference::exact(&inp, false)?.o),
            Attention::Method { config, .. } => sagebwd::sim::simulate(&inp, config, false)?.fwd.o,
        })
    }

    /// Recomputes the forward inside the backward (the simulator is deterministic, so its O equals the
    /// forward's); `o` is not needed on the CPU.
    fn attention_backward(
        &self,
        shape: AttnShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        _o: &[f32],
        d_o: &[f32],
    ) -> Result<AttnGrads> {
        let inp = Self::inputs(shape, q, k, v, Some(d_o));
        let missing = || sagebwd::Error::Config("attention returned no gradients although dO was given".into());
        Ok(match &self.attention {
            Attention::Exact => {
                let g = sagebwd::reference::exact(&inp, false)?.grads.ok_or_else(missing)?;
                AttnGrads {
                    dq: to_f32(g.dq),
                    dk: to_f32(g.dk),
                    dv: to_f32(g.dv),
                }
            }
            Attention::Method { config, .. } => {
                let g = sagebwd::sim::simulate(&inp, config, false)?.grads.ok_or_else(missing)?;
                AttnGrads {
                    dq: g.dq,
                    dk: g.dk,
                    dv: g.dv,
                }
            }
        })
    }
}
