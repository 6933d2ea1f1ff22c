//! Runs a configuration on the chosen device: the CPU simulator or the CUDA kernels.

use crate::args::DeviceArg;
use anyhow::{Context, Result};
use sagebwd::sim::{simulate, SimOutput};
use sagebwd::{Config, Inputs};
use sagebwd_cuda::Gpu;

/// A device that runs the quantized method.
pub enum Backend {
    Cpu,
    Cuda(Box<Gpu>),
}

impl Backend {
    /// Picks the device. `auto` takes the GPU when one is usable and otherwise falls back to the
    /// CPU simulator, saying why on stderr.
    pub fn select(arg: DeviceArg) -> Result<Backend> {
        match arg {
            DeviceArg::Cpu => Ok(Backend::Cpu),
            DeviceArg::Cuda => Ok(Backend::Cuda(Box::new(Gpu::new().context("--device cuda")?))),
            DeviceArg::Auto => match Gpu::new() {
                Ok(gpu) => {
                    eprintln!("device: {}", gpu.describe());
                    Ok(Backend::Cuda(Box::new(gpu)))
                }
                Err(e) => {
                    eprintln!("note: no usable GPU ({e}); running the CPU simulator, a bit-level model of the kernels");
                    Ok(Backend::Cpu)
                }
            },
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Backend::Cpu => "cpu-simulator",
            Backend::Cuda(_) => "cuda",
        }
    }

    /// Runs forward (and backward when `inp` has dO). The P, dP, dS intermediates live only inside
    /// the GPU kernels, so only the simulator returns them.
    pub fn run(&self, inp: &Inputs, cfg: &Config, want_intermediates: bool) -> Result<SimOutput> {
        match self {
            Backend::Cpu => Ok(simulate(inp, cfg, want_intermediates)?),
            Backend::Cuda(gpu) => Ok(gpu.run(inp, cfg)?),
        }
    }
}
