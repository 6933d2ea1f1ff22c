//! Where a training step runs: the [`Engine`] trait and its CPU implementation. The training loop
//! (`train.rs`) drives an engine; the GPU engine is [`crate::gpu::GpuEngine`].
//!
//! An engine owns the model's weights, their gradients and the AdamW state. The loop asks it for
//! forward + backward passes over micro-batches (accumulating gradients), the gradient norm, and an
//! update; checkpoints move the whole state through host [`Weights`].

use crate::backend::{cpu::CpuBackend, Attention, Backend};
use crate::error::Result;
use crate::model::{Batch, Model, ParamLayout, Weights};
use crate::optim::{grad_norm, scale, AdamW, AdamWConfig};

/// Weights and optimizer state, on the host.
pub struct EngineState {
    pub weights: Weights,
    pub adam_m: Weights,
    pub adam_v: Weights,
    pub adam_t: u64,
}

pub trait Engine {
    /// One line for the log: device and attention.
    fn describe(&self) -> String;
    /// Sets the gradients to zero (start of a step).
    fn zero_grads(&mut self) -> Result<()>;
    /// Mean loss (nats per token) of the micro-batch; adds `grad_scale × ∂(summed loss)/∂θ` to the
    /// gradients.
    fn forward_backward(&mut self, b: &Batch, grad_scale: f32) -> Result<f64>;
    /// Mean loss of the micro-batch, forward only.
    fn loss(&mut self, b: &Batch) -> Result<f64>;
    /// Global L2 norm of the gradients.
    fn grad_norm(&mut self) -> Result<f64>;
    /// AdamW update with learning rate `lr` after multiplying the gradients by `grad_scale`
    /// (the clipping factor, 1 when not clipping).
    fn update(&mut self, lr: f32, grad_scale: f32) -> Result<()>;
    /// The gradients accumulated since [`Engine::zero_grads`], on the host (for checks).
    fn gradients(&self) -> Result<Weights>;
    fn export(&self) -> Result<EngineState>;
    fn import(&mut self, s: EngineState) -> Result<()>;
    /// Peak device memory in bytes since the engine started, where the engine can tell.
    fn peak_memory(&self) -> Option<u64> {
        None
    }
    /// The board energy counter of the engine's GPUs (mJ, summed; NVML), where the engine can tell.
    /// Differences between two reads are the energy spent in between.
    fn energy_millijoules(&self) -> Option<u64> {
        None
    }
}

/// The clipping factor: `max_norm / norm` when the norm exceeds a positive `max_norm`, else 1.
pub fn clip_factor(norm: f64, max_norm: f64) -> f32 {
    if max_norm > 0.0 && norm > max_norm {
        (max_norm / norm) as f32
    } else {
        1.0
    }
}

/// f32 model, rayon products, attention from the `sagebwd` crate (exact or simulated).
pub struct CpuEngine {
    pub model: Model,
    pub opt: AdamW,
    pub grads: Weights,
    backend: CpuBackend,
}

impl CpuEngine {
    pub fn new(model: Model, adamw: AdamWConfig, attention: Attention) -> CpuEngine {
        let layout = ParamLayout::new(&model.cfg);
        let opt = AdamW::new(adamw, &layout, Weights::zeros(&model.cfg));
        let grads = Weights::zeros(&model.cfg);
        CpuEngine {
            model,
            opt,
            grads,
            backend: CpuBackend::new(attention),
        }
    }
}

impl Engine for CpuEngine {
    fn describe(&self) -> String {
        self.backend.describe()
    }

    fn zero_grads(&mut self) -> Result<()> {
        self.grads.zero();
        Ok(())
    }

    fn forward_backward(&mut self, b: &Batch, grad_scale: f32) -> Result<f64> {
        self.model
            .forward_backward(&self.backend, b, &mut self.grads, grad_scale)
    }

    fn loss(&mut self, b: &Batch) -> Result<f64> {
        self.model.loss(&self.backend, b)
    }

    fn grad_norm(&mut self) -> Result<f64> {
        Ok(grad_norm(&self.grads))
    }

    fn update(&mut self, lr: f32, grad_scale: f32) -> Result<()> {
        if grad_scale != 1.0 {
            scale(&mut self.grads, grad_scale);
        }
        self.opt.step(&mut self.model.weights, &self.grads, lr);
        Ok(())
    }

    fn gradients(&self) -> Result<Weights> {
        Ok(self.grads.clone())
    }

    fn export(&self) -> Result<EngineState> {
        Ok(EngineState {
            weights: self.model.weights.clone(),
            adam_m: self.opt.m.clone(),
            adam_v: self.opt.v.clone(),
            adam_t: self.opt.t,
        })
    }

    fn import(&mut self, s: EngineState) -> Result<()> {
        self.model.weights = s.weights;
        self.opt.m = s.adam_m;
        self.opt.v = s.adam_v;
        self.opt.t = s.adam_t;
        Ok(())
    }
}
