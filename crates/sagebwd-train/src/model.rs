//! The model: its weights (also the layout of gradients and optimizer states), initialization, and
//! the forward + backward pass over one micro-batch.

use crate::backend::Backend;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::layers::{attention, embedding, loss, mlp, rmsnorm, rotary::Rotary};
use crate::rng::Rng;
use serde::{Deserialize, Serialize};

/// One transformer block's tensors. Matrices are `[out, in]`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub wq: Vec<f32>,
    pub wk: Vec<f32>,
    pub wv: Vec<f32>,
    pub wo: Vec<f32>,
    /// `[head_dim]` gains shared by all heads; empty without QK-norm.
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    pub mlp_norm: Vec<f32>,
    pub w_gate: Vec<f32>,
    pub w_up: Vec<f32>,
    pub w_down: Vec<f32>,
}

/// All tensors of the model. The same type holds gradients and AdamW moments.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Weights {
    /// `[vocab, dim]`.
    pub tok_emb: Vec<f32>,
    pub layers: Vec<Layer>,
    pub final_norm: Vec<f32>,
    /// `[vocab, dim]`; empty when the embedding is tied.
    pub lm_head: Vec<f32>,
}

/// A tensor's name, shape and whether weight decay applies (matrices yes; norm gains no).
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub decay: bool,
}

/// The model's tensors in a fixed order, with shapes.
pub struct ParamLayout {
    pub specs: Vec<TensorSpec>,
    pub total: usize,
    /// Parameters outside the embedding and LM head.
    pub non_embedding: usize,
}

impl ParamLayout {
    pub fn new(cfg: &ModelConfig) -> ParamLayout {
        let (d, hd, f, v) = (cfg.dim, cfg.head_dim(), cfg.ffn_hidden, cfg.vocab_size);
        let (qw, kvw) = (cfg.n_heads * hd, cfg.n_kv_heads * hd);
        let spec = |name: String, shape: Vec<usize>| TensorSpec {
            decay: shape.len() > 1,
            name,
            shape,
        };
        let mut specs = vec![spec("tok_emb".into(), vec![v, d])];
        for l in 0..cfg.n_layers {
            let name = |t: &str| format!("layers.{l}.{t}");
            specs.push(spec(name("attn_norm"), vec![d]));
            specs.push(spec(name("wq"), vec![qw, d]));
            specs.push(spec(name("wk"), vec![kvw, d]));
            specs.push(spec(name("wv"), vec![kvw, d]));
            specs.push(spec(name("wo"), vec![d, qw]));
            if cfg.qk_norm {
                specs.push(spec(name("q_norm"), vec![hd]));
                specs.push(spec(name("k_norm"), vec![hd]));
            }
            specs.push(spec(name("mlp_norm"), vec![d]));
            specs.push(spec(name("w_gate"), vec![f, d]));
            specs.push(spec(name("w_up"), vec![f, d]));
            specs.push(spec(name("w_down"), vec![d, f]));
        }
        specs.push(spec("final_norm".into(), vec![d]));
        if !cfg.tied_embeddings {
            specs.push(spec("lm_head".into(), vec![v, d]));
        }
        let size = |s: &TensorSpec| s.shape.iter().product::<usize>();
        let total = specs.iter().map(size).sum();
        let embedding: usize = specs
            .iter()
            .filter(|s| s.name == "tok_emb" || s.name == "lm_head")
            .map(size)
            .sum();
        ParamLayout {
            specs,
            total,
            non_embedding: total - embedding,
        }
    }
}

impl Weights {
    /// Zeros in the layout of `cfg` (gradients, optimizer moments).
    pub fn zeros(cfg: &ModelConfig) -> Weights {
        let mut w = Weights::default();
        let layout = ParamLayout::new(cfg);
        w.fill_from(&layout, |spec| vec![0.0; spec.shape.iter().product()]);
        w
    }

    /// Initialization: matrices N(0, 0.02²), the output projections of each residual branch
    /// (`wo`, `w_down`) scaled by 1/sqrt(2·layers) as in GPT-2, norm gains 1.
    pub fn init(cfg: &ModelConfig, rng: &mut Rng) -> Weights {
        let residual_scale = 1.0 / (2.0 * cfg.n_layers as f64).sqrt();
        let mut w = Weights::default();
        w.fill_from(&ParamLayout::new(cfg), |spec| {
            let n: usize = spec.shape.iter().product();
            if spec.shape.len() == 1 {
                return vec![1.0; n];
            }
            let is_residual_out = spec.name.ends_with(".wo") || spec.name.ends_with(".w_down");
            let std = 0.02 * if is_residual_out { residual_scale } else { 1.0 };
            (0..n).map(|_| (rng.normal() * std) as f32).collect()
        });
        w
    }

    fn fill_from(&mut self, layout: &ParamLayout, mut make: impl FnMut(&TensorSpec) -> Vec<f32>) {
        let n_layers = layout.specs.iter().filter(|s| s.name.ends_with(".attn_norm")).count();
        self.layers = vec![Layer::default(); n_layers];
        for spec in &layout.specs {
            let data = make(spec);
            *self.get_mut(&spec.name).expect("layout names are the tensor names") = data;
        }
    }

    /// The tensor with the layout name `name`.
    pub fn get_mut(&mut self, name: &str) -> Option<&mut Vec<f32>> {
        match name {
            "tok_emb" => return Some(&mut self.tok_emb),
            "final_norm" => return Some(&mut self.final_norm),
            "lm_head" => return Some(&mut self.lm_head),
            _ => {}
        }
        let rest = name.strip_prefix("layers.")?;
        let (idx, field) = rest.split_once('.')?;
        let l = self.layers.get_mut(idx.parse::<usize>().ok()?)?;
        Some(match field {
            "attn_norm" => &mut l.attn_norm,
            "wq" => &mut l.wq,
            "wk" => &mut l.wk,
            "wv" => &mut l.wv,
            "wo" => &mut l.wo,
            "q_norm" => &mut l.q_norm,
            "k_norm" => &mut l.k_norm,
            "mlp_norm" => &mut l.mlp_norm,
            "w_gate" => &mut l.w_gate,
            "w_up" => &mut l.w_up,
            "w_down" => &mut l.w_down,
            _ => return None,
        })
    }

    /// Every non-empty tensor with its layout name, in a fixed order.
    pub fn named(&self) -> Vec<(String, &Vec<f32>)> {
        let mut out = vec![("tok_emb".to_string(), &self.tok_emb)];
        for (i, l) in self.layers.iter().enumerate() {
            let fields = [
                ("attn_norm", &l.attn_norm),
                ("wq", &l.wq),
                ("wk", &l.wk),
                ("wv", &l.wv),
                ("wo", &l.wo),
                ("q_norm", &l.q_norm),
                ("k_norm", &l.k_norm),
                ("mlp_norm", &l.mlp_norm),
                ("w_gate", &l.w_gate),
                ("w_up", &l.w_up),
                ("w_down", &l.w_down),
            ];
            out.extend(fields.into_iter().map(|(f, t)| (format!("layers.{i}.{f}"), t)));
        }
        out.extend([
            ("final_norm".to_string(), &self.final_norm),
            ("lm_head".to_string(), &self.lm_head),
        ]);
        out.retain(|(_, t)| !t.is_empty());
        out
    }

    /// Every non-empty tensor, in the order of [`Weights::named`].
    pub fn tensors(&self) -> Vec<&Vec<f32>> {
        self.named().into_iter().map(|(_, t)| t).collect()
    }

    /// Every non-empty tensor, mutable, in the order of [`Weights::named`].
    pub fn tensors_mut(&mut self) -> Vec<&mut Vec<f32>> {
        let mut out = vec![&mut self.tok_emb];
        for l in &mut self.layers {
            out.extend([
                &mut l.attn_norm,
                &mut l.wq,
                &mut l.wk,
                &mut l.wv,
                &mut l.wo,
                &mut l.q_norm,
                &mut l.k_norm,
                &mut l.mlp_norm,
                &mut l.w_gate,
                &mut l.w_up,
                &mut l.w_down,
            ]);
        }
        out.extend([&mut self.final_norm, &mut self.lm_head]);
        out.retain(|t| !t.is_empty());
        out
    }

    /// Sets every value to zero, keeping the allocations.
    pub fn zero(&mut self) {
        self.tensors_mut().into_iter().for_each(|t| t.fill(0.0));
    }
}

/// One micro-batch: `inputs` and `targets` are `[batch, seq]` token ids (targets shifted by one).
pub struct Batch<'a> {
    pub inputs: &'a [u32],
    pub targets: &'a [u32],
    pub batch: usize,
    pub seq: usize,
}

/// The model and its fixed tables.
pub struct Model {
    pub cfg: ModelConfig,
    pub weights: Weights,
    rope: Rotary,
}

impl Model {
    pub fn new(cfg: ModelConfig, weights: Weights) -> Model {
        let rope = Rotary::new(cfg.head_dim(), cfg.max_seq_len, cfg.rope_theta);
        Model { cfg, weights, rope }
    }

    /// Mean cross-entropy (nats per token) of the batch, forward only.
    pub fn loss(&self, be: &dyn Backend, b: &Batch) -> Result<f64> {
        Ok(self.run(be, b, None)? / b.targets.len() as f64)
    }

    /// Mean cross-entropy of the batch; adds `grad_scale × ∂(summed loss)/∂θ` into `grads`
    /// (pass `1 / (tokens × accumulation steps)` for the gradient of the mean over a whole step).
    pub fn forward_backward(&self, be: &dyn Backend, b: &Batch, grads: &mut Weights, grad_scale: f32) -> Result<f64> {
        Ok(self.run(be, b, Some((grads, grad_scale)))? / b.targets.len() as f64)
    }

    /// Summed loss in nats; the backward when `grads` is given.
    fn run(&self, be: &dyn Backend, b: &Batch, grads: Option<(&mut Weights, f32)>) -> Result<f64> {
        let (cfg, w) = (&self.cfg, &self.weights);
        check_batch(cfg, b)?;
        let dims = attention::Dims {
            batch: b.batch,
            seq: b.seq,
        };
        let mut x = embedding::forward(&w.tok_emb, cfg.dim, b.inputs);
        let mut caches = Vec::with_capacity(cfg.n_layers);
        for layer in &w.layers {
            let (after_attn, attn_cache) = attention::forward(be, cfg, &self.rope, layer, x, dims)?;
            let (after_mlp, mlp_cache) = mlp::forward(be, cfg, layer, after_attn);
            x = after_mlp;
            caches.push((attn_cache, mlp_cache));
        }
        let mut hidden = vec![0.0f32; x.len()];
        let final_rstd = rmsnorm::forward(&x, &w.final_norm, cfg.norm_eps, &mut hidden);
        let head = if cfg.tied_embeddings { &w.tok_emb } else { &w.lm_head };
        let Some((g, scale)) = grads else {
            return Ok(loss::lm_head_loss(be, &hidden, head, cfg.dim, b.targets, None));
        };
        let mut d_hidden = vec![0.0f32; hidden.len()];
        let d_head = if cfg.tied_embeddings {
            &mut g.tok_emb
        } else {
            &mut g.lm_head
        };
        let lg = loss::LossGrad {
            scale,
            d_hidden: &mut d_hidden,
            d_table: d_head,
        };
        let total = loss::lm_head_loss(be, &hidden, head, cfg.dim, b.targets, Some(lg));
        let mut dx = vec![0.0f32; x.len()];
        rmsnorm::backward(&d_hidden, &x, &w.final_norm, &final_rstd, &mut dx, &mut g.final_norm);
        for (l, (attn_cache, mlp_cache)) in caches.into_iter().enumerate().rev() {
            dx = mlp::backward(be, cfg, &w.layers[l], mlp_cache, dx, &mut g.layers[l]);
            dx = attention::backward(
                be,
                cfg,
                &self.rope,
                &w.layers[l],
                attn_cache,
                dx,
                &mut g.layers[l],
                dims,
            )?;
        }
        embedding::backward(&mut g.tok_emb, cfg.dim, b.inputs, &dx);
        Ok(total)
    }
}

/// Checks a batch against the model: sizes, sequence length, token ids (both engines call it).
pub(crate) fn check_batch(cfg: &ModelConfig, b: &Batch) -> Result<()> {
    use crate::error::Error;
    let n = b.batch * b.seq;
    if n == 0 || b.inputs.len() != n || b.targets.len() != n {
        return Err(Error::Config(format!(
            "batch of {} inputs / {} targets does not match batch {} × sequence {}",
            b.inputs.len(),
            b.targets.len(),
            b.batch,
            b.seq
        )));
    }
    if b.seq > cfg.max_seq_len {
        return Err(Error::Config(format!(
            "sequence length {} exceeds the model's maximum {}",
            b.seq, cfg.max_seq_len
        )));
    }
    if let Some(&t) = b
        .inputs
        .iter()
        .chain(b.targets)
        .find(|&&t| t as usize >= cfg.vocab_size)
    {
        return Err(Error::Data(format!(
            "token id {t} is outside the vocabulary of {} tokens",
            cfg.vocab_size
        )));
    }
    Ok(())
}
