//! The GPU training step (CUDA): BF16 products in cuBLASLt, FP32 master weights, gradients and
//! AdamW moments, fused kernels for everything between the products (`kernels/*.cu`), and attention
//! through the `sagebwd-cuda` kernels (any preset, `fpa` included) — llm.c style: every tensor of
//! the step is allocated once per micro-batch shape, and the forward and backward are written out
//! layer by layer in [`engine`].
//!
//! Precision: the residual stream, norms, softmax cross-entropy and every gradient are FP32; the
//! operands of the products (normalized activations, attention inputs and outputs, the SwiGLU
//! activation, the incoming gradients of each product) are rounded to BF16, as in mixed-precision
//! training. The CPU engine (f32 throughout) is the reference: `sagebwd train-check` compares the
//! two on a small model.

pub mod blas;
pub mod check;
pub mod engine;
pub mod kernels;
pub mod parallel;
mod profile;

pub use engine::GpuEngine;

pub use crate::error::{Error, Result};

pub(crate) fn cuda_err(what: &str, e: cudarc::driver::DriverError) -> Error {
    Error::Gpu(format!("CUDA {what}: {e:?}"))
}

/// Whether a GPU engine could start here (GPU 0 with its driver, NVRTC for the attention kernels, cuBLASLt), without
/// building one: the GPU's description, or why not.
pub fn probe() -> Result<String> {
    let gpu = sagebwd_cuda::Gpu::open(0).map_err(|e| Error::Gpu(e.to_string()))?; // checks NVRTC too
    blas::Blas::new(gpu.dev.stream.clone())?;
    Ok(gpu.describe())
}

/// Why the GPU path cannot run this model, if it cannot (checked before any device work).
pub fn unsupported_reason(model: &crate::config::ModelConfig, attention: &crate::backend::Attention) -> Option<String> {
    let hd = model.head_dim();
    if !sagebwd_cuda::runtime::HEAD_DIMS.contains(&hd) {
        return Some(format!(
            "the GPU attention kernels support head dimensions {:?}, the model has {hd} (dim {} / {} heads)",
            sagebwd_cuda::runtime::HEAD_DIMS,
            model.dim,
            model.n_heads
        ));
    }
    if matches!(attention, crate::backend::Attention::Exact) {
        return Some(
            "attention `exact` is the f64 CPU reference; the GPU runs the presets fpa, sagebwd, int8-all".into(),
        );
    }
    None
}
