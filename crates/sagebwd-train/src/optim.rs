//! AdamW with FP32 moments, global gradient-norm clipping, and the warmup + cosine schedule.

use crate::model::{ParamLayout, Weights};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        }
    }
}

/// AdamW state: first and second moments in the model's layout, and the number of updates taken.
pub struct AdamW {
    pub cfg: AdamWConfig,
    pub m: Weights,
    pub v: Weights,
    pub t: u64,
    /// Per tensor (in `Weights::tensors` order): whether weight decay applies.
    decay: Vec<bool>,
}

impl AdamW {
    pub fn new(cfg: AdamWConfig, layout: &ParamLayout, zeros: Weights) -> AdamW {
        let decay = ordered_decay_flags(layout, &zeros);
        AdamW {
            cfg,
            m: zeros.clone(),
            v: zeros,
            t: 0,
            decay,
        }
    }

    /// One update with learning rate `lr`: decoupled weight decay on matrices only, bias-corrected
    /// moments.
    pub fn step(&mut self, params: &mut Weights, grads: &Weights, lr: f32) {
        self.t += 1;
        let c = &self.cfg;
        let bc1 = 1.0 - c.beta1.powi(self.t as i32);
        let bc2 = 1.0 - c.beta2.powi(self.t as i32);
        let tensors = params
            .tensors_mut()
            .into_iter()
            .zip(grads.tensors())
            .zip(self.m.tensors_mut())
            .zip(self.v.tensors_mut());
        for ((((p, g), m), v), &decay) in tensors.zip(&self.decay) {
            let wd = if decay { c.weight_decay } else { 0.0 };
            p.par_iter_mut()
                .zip(g.par_iter())
                .zip(m.par_iter_mut())
                .zip(v.par_iter_mut())
                .for_each(|(((p, &g), m), v)| {
                    *m = c.beta1 * *m + (1.0 - c.beta1) * g;
                    *v = c.beta2 * *v + (1.0 - c.beta2) * g * g;
                    let update = (*m / bc1) / ((*v / bc2).sqrt() + c.eps);
                    *p -= lr * (update + wd * *p);
                });
        }
    }
}

/// Per tensor of `zeros` (in `Weights::named` order): the layout's decay flag.
fn ordered_decay_flags(layout: &ParamLayout, zeros: &Weights) -> Vec<bool> {
    let decay_of = |name: &str| layout.specs.iter().find(|s| s.name == name).is_some_and(|s| s.decay);
    zeros.named().iter().map(|(name, _)| decay_of(name)).collect()
}

/// Global L2 norm of all gradients (f64 partial sums in a fixed order: reproducible).
pub fn grad_norm(grads: &Weights) -> f64 {
    let mut total = 0.0f64;
    for t in grads.tensors() {
        let partial: Vec<f64> = t
            .par_chunks(1 << 14)
            .map(|c| c.iter().map(|&x| x as f64 * x as f64).sum())
            .collect();
        total += partial.iter().sum::<f64>();
    }
    total.sqrt()
}

/// Scales the gradients so their global norm is at most `max_norm` (no-op when `max_norm <= 0`).
pub fn clip(grads: &mut Weights, norm: f64, max_norm: f64) {
    if max_norm > 0.0 && norm > max_norm {
        scale(grads, (max_norm / norm) as f32);
    }
}

/// Multiplies every gradient by `k`.
pub fn scale(grads: &mut Weights, k: f32) {
    grads
        .tensors_mut()
        .into_iter()
        .for_each(|t| t.par_iter_mut().for_each(|g| *g *= k));
}

/// Linear warmup to `max_lr` over `warmup` steps, then cosine decay to `min_lr` at `total`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    pub max_lr: f32,
    pub min_lr: f32,
    pub warmup: u64,
    pub total: u64,
}

impl Schedule {
    /// Learning rate for step `step` (0-based).
    pub fn lr(&self, step: u64) -> f32 {
        if step < self.warmup {
            return self.max_lr * (step + 1) as f32 / self.warmup as f32;
        }
        let span = self.total.saturating_sub(self.warmup).max(1);
        let progress = ((step - self.warmup) as f32 / span as f32).min(1.0);
        let cosine = 0.5 * (1.0 + (std::f32::consts::PI * progress).cos());
        self.min_lr + (self.max_lr - self.min_lr) * cosine
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

    #[test]
    fn schedule_warms_up_then_decays_to_the_minimum() {
        let s = Schedule {
            max_lr: 1.0,
            min_lr: 0.1,
            warmup: 10,
            total: 110,
        };
        assert!((s.lr(0) - 0.1).abs() < 1e-6);
        assert!((s.lr(9) - 1.0).abs() < 1e-6);
        assert!((s.lr(10) - 1.0).abs() < 1e-6);
        assert!((s.lr(60) - 0.55).abs() < 1e-5);
        assert!((s.lr(110) - 0.1).abs() < 1e-6);
        assert!(s.lr(30) > s.lr(31));
    }

    #[test]
    fn clipping_bounds_the_global_norm() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let mut g = Weights::zeros(&ModelConfig { vocab_size: 10, ..cfg });
        g.final_norm[0] = 3.0;
        g.layers[0].wq[5] = 4.0;
        let n = grad_norm(&g);
        assert!((n - 5.0).abs() < 1e-9);
        clip(&mut g, n, 1.0);
        assert!((grad_norm(&g) - 1.0).abs() < 1e-6);
    }

    /// The first AdamW step moves every parameter with a non-zero gradient by `lr` against its
    /// sign (bias correction makes |m̂/√v̂| = 1), and decays matrices but not gains.
    #[test]
    fn first_adamw_step_has_unit_size_and_decay_only_on_matrices() {
        let cfg = ModelConfig {
            vocab_size: 10,
            ..ModelConfig::preset("tiny").unwrap()
        };
        let layout = ParamLayout::new(&cfg);
        let mut opt = AdamW::new(
            AdamWConfig {
                weight_decay: 0.5,
                ..Default::default()
            },
            &layout,
            Weights::zeros(&cfg),
        );
        let mut p = Weights::zeros(&cfg);
        p.final_norm[0] = 1.0;
        p.layers[0].wq[0] = 1.0;
        let mut g = Weights::zeros(&cfg);
        g.final_norm[0] = -0.3;
        g.layers[0].wq[0] = 2.0;
        opt.step(&mut p, &g, 0.01);
        assert!((p.final_norm[0] - 1.01).abs() < 1e-6, "{}", p.final_norm[0]);
        assert!(
            (p.layers[0].wq[0] - (1.0 - 0.01 - 0.01 * 0.5)).abs() < 1e-6,
            "{}",
            p.layers[0].wq[0]
        );
    }
}
