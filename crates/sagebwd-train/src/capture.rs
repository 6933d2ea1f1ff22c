//! The real attention inputs of a model: one forward + backward over a batch that records, for every
//! layer, the Q, K, V its attention saw (after QK-norm and rotary) and the output gradient dO it got.
//! The model runs on the CPU; a backend wrapper records the attention backward's arguments (the
//! backward visits the layers last to first, each once).

use crate::backend::{cpu::CpuBackend, Attention, AttnGrads, AttnShape, Backend};
use crate::error::{Error, Result};
use crate::model::{Batch, Model, Weights};
use std::sync::Mutex;

/// One layer's attention inputs, `[batch, heads, seq, head_dim]` (K and V with the kv heads).
#[derive(Clone, Debug)]
pub struct LayerTensors {
    pub layer: usize,
    pub shape: AttnShape,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub d_o: Vec<f32>,
}

/// What [`capture`] returns: the batch's mean loss and every layer's tensors, first layer first.
pub struct Captured {
    pub loss: f64,
    pub layers: Vec<LayerTensors>,
}

struct Recorder<'a> {
    inner: &'a dyn Backend,
    calls: Mutex<Vec<(AttnShape, [Vec<f32>; 4])>>,
}

impl Backend for Recorder<'_> {
    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn gemm(&self, out: &mut [f32], a: &[f32], b: &[f32], m: usize, k: usize, n: usize, accumulate: bool) {
        self.inner.gemm(out, a, b, m, k, n, accumulate)
    }

    fn gemm_at(&self, out: &mut [f32], a_t: &[f32], b: &[f32], m: usize, k: usize, n: usize, accumulate: bool) {
        self.inner.gemm_at(out, a_t, b, m, k, n, accumulate)
    }

    fn attention_forward(&self, shape: AttnShape, q: &[f32], k: &[f32], v: &[f32]) -> Result<Vec<f32>> {
        self.inner.attention_forward(shape, q, k, v)
    }

    fn attention_backward(
        &self,
        shape: AttnShape,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        o: &[f32],
        d_o: &[f32],
    ) -> Result<AttnGrads> {
        let tensors = [q.to_vec(), k.to_vec(), v.to_vec(), d_o.to_vec()];
        self.calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((shape, tensors));
        self.inner.attention_backward(shape, q, k, v, o, d_o)
    }
}

/// Runs `weights` (a model of `model`'s configuration) forward and backward over `batch` on the CPU
/// with `attention`, and returns each layer's attention inputs. The weights are not changed.
pub fn capture(
    model: &crate::config::ModelConfig,
    weights: Weights,
    attention: Attention,
    batch: &Batch,
) -> Result<Captured> {
    let m = Model::new(model.clone(), weights);
    let cpu = CpuBackend::new(attention);
    let rec = Recorder {
        inner: &cpu,
        calls: Mutex::new(Vec::new()),
    };
    let mut grads = Weights::zeros(model);
    let scale = 1.0 / batch.targets.len().max(1) as f32;
    let loss = m.forward_backward(&rec, batch, &mut grads, scale)?;
    let calls = rec.calls.into_inner().unwrap_or_else(|e| e.into_inner());
    if calls.len() != model.n_layers {
        return Err(Error::Config(format!(
            "captured {} attention calls for {} layers",
            calls.len(),
            model.n_layers
        )));
    }
    let n = calls.len();
    let mut layers: Vec<LayerTensors> = calls
        .into_iter()
        .enumerate()
        .map(|(i, (shape, [q, k, v, d_o]))| LayerTensors {
            layer: n - 1 - i,
            shape,
            q,
            k,
            v,
            d_o,
        })
        .collect();
    layers.reverse();
    Ok(Captured { loss, layers })
}

impl LayerTensors {
    /// The attention problem of sequence `seq` of the batch, query heads `heads` (each with its kv
    /// head; None: all heads) and the first `tokens` tokens (causal: a prefix is a complete problem;
    /// its dO is the one the full sequence got).
    pub fn problem(&self, seq: usize, heads: Option<&[usize]>, tokens: usize) -> Result<sagebwd::Inputs> {
        let s = self.shape;
        if seq >= s.batch {
            return Err(Error::Config(format!(
                "sequence {seq} is beyond the batch of {}",
                s.batch
            )));
        }
        let n = tokens.min(s.seq);
        if n == 0 {
            return Err(Error::Config("the problem needs at least one token".into()));
        }
        let group = s.heads_q / s.heads_kv;
        let all: Vec<usize> = (0..s.heads_q).collect();
        let heads = heads.unwrap_or(&all);
        if let Some(h) = heads.iter().find(|&&h| h >= s.heads_q) {
            return Err(Error::Config(format!(
                "head {h} is beyond the layer's {} heads",
                s.heads_q
            )));
        }
        let hd = s.head_dim;
        let take = |t: &[f32], nh: usize, hs: &mut dyn Iterator<Item = usize>| -> Vec<f32> {
            let mut out = Vec::new();
            for h in hs {
                let start = ((seq * nh + h) * s.seq) * hd;
                out.extend_from_slice(&t[start..start + n * hd]);
            }
            out
        };
        // With a subset of heads, each query head gets its own copy of its kv head (no GQA sharing).
        let (kv_heads, heads_kv): (Vec<usize>, usize) = if heads.len() == s.heads_q {
            ((0..s.heads_kv).collect(), s.heads_kv)
        } else {
            (heads.iter().map(|h| h / group).collect(), heads.len())
        };
        Ok(sagebwd::Inputs {
            shape: sagebwd::Shape {
                batch: 1,
                heads_q: heads.len(),
                heads_kv,
                n_q: n,
                n_k: n,
                head_dim: hd,
            },
            causal: true,
            q: take(&self.q, s.heads_q, &mut heads.iter().copied()),
            k: take(&self.k, s.heads_kv, &mut kv_heads.iter().copied()),
            v: take(&self.v, s.heads_kv, &mut kv_heads.iter().copied()),
            d_o: Some(take(&self.d_o, s.heads_q, &mut heads.iter().copied())),
        })
    }
}

/// A checkpoint read without knowing its model first: the run configuration from its metadata, the
/// weights, and the step it was written at.
pub struct Trained {
    pub config: crate::train::TrainConfig,
    pub weights: Weights,
    pub step: Option<u64>,
}

/// Reads the checkpoint at `path` (its metadata names the model, whose shapes the weights must have).
pub fn load_trained(path: &std::path::Path) -> Result<Trained> {
    let err = |msg: String| Error::Checkpoint { path: path.into(), msg };
    let bytes = std::fs::read(path).map_err(crate::error::io_err(path))?;
    let (_, header) =
        safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| err(format!("not a safetensors file ({e})")))?;
    let meta = header
        .metadata()
        .as_ref()
        .and_then(|m| m.get("meta"))
        .ok_or_else(|| err("not a sagebwd-train checkpoint (no run metadata)".into()))?;
    let meta: serde_json::Value = serde_json::from_str(meta).map_err(|e| err(format!("bad run metadata: {e}")))?;
    drop(bytes);
    let config: crate::train::TrainConfig =
        serde_json::from_value(meta["config"].clone()).map_err(|e| err(format!("bad run configuration: {e}")))?;
    let ck = crate::checkpoint::load(path, &Weights::zeros(&config.model))?;
    Ok(Trained {
        config,
        weights: ck.weights,
        step: meta["step"].as_u64(),
    })
}
