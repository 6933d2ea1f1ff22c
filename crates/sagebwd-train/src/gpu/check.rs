//! The GPU-vs-CPU check of the training step (`sagebwd train-check`): the same small model, the
//! same initial weights and token batches, through [`GpuEngine`] (BF16 products) and
//! [`CpuEngine`](crate::engine::CpuEngine) (f32), attention `fpa`.
//!
//! What is compared, and the tolerances (derived, not tuned):
//! - the loss of one micro-batch, and every parameter's gradient (relative L2 distance). The GPU
//!   rounds each product's operands to BF16 (relative rounding error ≤ 2⁻⁹, RMS 2⁻⁹/√3 ≈ 1.1e-3
//!   per operand, so ≈ 1.6e-3 for a product of two rounded operands). A gradient passes through
//!   at most 4 products per layer plus the LM head, the BF16 logits and attention, and the forward
//!   rounds each layer's 2 residual branches (the `wo` and `down` outputs) to BF16 before adding
//!   them to the FP32 residual (≤ 6L + 5 roundings, 17 for L = 2); the backward rounds each
//!   norm's output gradient (the dx products' BF16 output) once more, 2L + 1 single roundings of
//!   ≈ 1.1e-3 (5 for L = 2). The errors add like independent noise: √(17 · 1.6² + 5 · 1.1²) · 1e-3
//!   ≈ 7.0e-3. Tolerance 2e-2 (≈ 3σ) for matrices; norm gains are sums over all tokens of products that
//!   largely cancel, which inflates the relative error of the sum, so they get 5e-2. The loss (a
//!   mean of log-probabilities, each off by ≈ √(1.6² + 1.1²)·1e-3 ≈ 2e-3 relative in its logits of
//!   size ~1: the product's operands and the BF16 logits themselves) gets 1e-2 nats.
//! - a short training run (AdamW, clipping, the schedule) of `steps` steps: the final losses must
//!   agree within 2 %, which catches optimizer-state and update bugs the gradient check cannot see.

use super::GpuEngine;
use crate::backend::Attention;
use crate::config::ModelConfig;
use crate::engine::{clip_factor, CpuEngine, Engine};
use crate::error::Result;
use crate::model::{Batch, Model, Weights};
use crate::optim::{AdamWConfig, Schedule};
use crate::rng::Rng;

pub const TOL_LOSS: f64 = 1e-2;
pub const TOL_MATRIX: f64 = 2e-2;
pub const TOL_GAIN: f64 = 5e-2;
pub const TOL_TRAJECTORY: f64 = 2e-2;

/// One compared quantity.
pub struct Row {
    pub name: String,
    pub cpu_norm: f64,
    pub rel_l2: f64,
    pub tolerance: f64,
}

impl Row {
    pub fn ok(&self) -> bool {
        self.rel_l2.is_finite() && self.rel_l2 <= self.tolerance
    }
}

pub struct Report {
    pub model: ModelConfig,
    pub batch: usize,
    pub seq: usize,
    pub device: String,
    pub loss_cpu: f64,
    pub loss_gpu: f64,
    pub grads: Vec<Row>,
    pub steps: usize,
    pub final_loss_cpu: f64,
    pub final_loss_gpu: f64,
}

impl Report {
    pub fn loss_ok(&self) -> bool {
        (self.loss_cpu - self.loss_gpu).abs() <= TOL_LOSS
    }
    pub fn trajectory_ok(&self) -> bool {
        ((self.final_loss_cpu - self.final_loss_gpu) / self.final_loss_cpu).abs() <= TOL_TRAJECTORY
    }
    pub fn ok(&self) -> bool {
        self.loss_ok() && self.trajectory_ok() && self.grads.iter().all(Row::ok)
    }
}

/// The checked models: GQA + QK-norm + tied embeddings, and plain heads without QK-norm, untied.
pub fn models() -> Vec<ModelConfig> {
    let base = ModelConfig {
        vocab_size: 1000,
        dim: 128,
        n_layers: 2,
        n_heads: 2,
        n_kv_heads: 1,
        ffn_hidden: 320,
        max_seq_len: 512,
        rope_theta: 10_000.0,
        norm_eps: 1e-5,
        qk_norm: true,
        tied_embeddings: true,
    };
    vec![
        base.clone(),
        ModelConfig {
            n_kv_heads: 2,
            qk_norm: false,
            tied_embeddings: false,
            dim: 256,
            n_heads: 2,
            ..base
        },
    ]
}

fn random_batch(rng: &mut Rng, vocab: usize, batch: usize, seq: usize) -> (Vec<u32>, Vec<u32>) {
    // A learnable stream (token t+1 = a small function of token t, with noise), so a few steps of
    // training move the loss.
    let mut inputs = Vec::with_capacity(batch * seq);
    let mut targets = Vec::with_capacity(batch * seq);
    for _ in 0..batch {
        let mut tok = rng.below(vocab) as u32;
        for _ in 0..seq {
            let next = if rng.uniform() < 0.7 {
                (tok * 7 + 3) % vocab as u32
            } else {
                rng.below(vocab) as u32
            };
            inputs.push(tok);
            targets.push(next);
            tok = next;
        }
    }
    (inputs, targets)
}

/// Runs the check for `model` on the GPU (errors when there is none).
pub fn run(model: &ModelConfig, batch: usize, seq: usize, steps: usize) -> Result<Report> {
    let attention = Attention::parse("fpa")?;
    let adamw = AdamWConfig::default();
    let weights = Weights::init(model, &mut Rng::new(7));
    let mut gpu = GpuEngine::new(model.clone(), &weights, adamw.clone(), attention.clone())?;
    gpu.set_checked(true);
    let mut cpu = CpuEngine::new(Model::new(model.clone(), weights), adamw, attention);
    let mut rng = Rng::new(11);
    let (inputs, targets) = random_batch(&mut rng, model.vocab_size, batch, seq);
    let b = Batch {
        inputs: &inputs,
        targets: &targets,
        batch,
        seq,
    };
    let scale = 1.0 / (batch * seq) as f32;
    let mut losses = [0.0f64; 2];
    let mut grads = Vec::new();
    for (i, e) in [&mut cpu as &mut dyn Engine, &mut gpu].into_iter().enumerate() {
        e.zero_grads()?;
        losses[i] = e.forward_backward(&b, scale)?;
        grads.push(e.gradients()?);
    }
    let rows = compare(&grads[0], &grads[1]);
    let schedule = Schedule {
        max_lr: 3e-3,
        min_lr: 3e-4,
        warmup: 3,
        total: steps as u64,
    };
    let mut finals = [0.0f64; 2];
    for (i, e) in [&mut cpu as &mut dyn Engine, &mut gpu].into_iter().enumerate() {
        let mut data = Rng::new(13);
        for s in 0..steps {
            let (inp, tgt) = random_batch(&mut data, model.vocab_size, batch, seq);
            e.zero_grads()?;
            finals[i] = e.forward_backward(
                &Batch {
                    inputs: &inp,
                    targets: &tgt,
                    batch,
                    seq,
                },
                scale,
            )?;
            let norm = e.grad_norm()?;
            e.update(schedule.lr(s as u64), clip_factor(norm, 1.0))?;
        }
    }
    Ok(Report {
        model: model.clone(),
        batch,
        seq,
        device: gpu.describe(),
        loss_cpu: losses[0],
        loss_gpu: losses[1],
        grads: rows,
        steps,
        final_loss_cpu: finals[0],
        final_loss_gpu: finals[1],
    })
}

fn compare(cpu: &Weights, gpu: &Weights) -> Vec<Row> {
    cpu.named()
        .into_iter()
        .zip(gpu.named())
        .map(|((name, c), (_, g))| {
            let reference: Vec<f64> = c.iter().map(|&x| x as f64).collect();
            let tolerance = if name.ends_with("norm") { TOL_GAIN } else { TOL_MATRIX };
            Row {
                rel_l2: sagebwd::metrics::rel_l2(g, &reference),
                cpu_norm: reference.iter().map(|x| x * x).sum::<f64>().sqrt(),
                tolerance,
                name,
            }
        })
        .collect()
}
