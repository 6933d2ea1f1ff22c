//! Runs a configuration on the chosen device: the CPU simulator or the CUDA kernels.

use crate::args::DeviceArg;
use anyhow::Result;
use sagebwd::sim::{simulate, SimOutput};
use sagebwd::{Config, Inputs};

/// A device that runs the quantized method.
pub enum Backend {
    Cpu,
}

impl Backend {
    /// Picks the device. `auto` falls back to the CPU, saying so on stderr.
    pub fn select(arg: DeviceArg) -> Result<Backend> {
        match arg {
            DeviceArg::Cpu => Ok(Backend::Cpu),
            DeviceArg::Auto => {
                eprintln!("note: this build has no GPU backend; running the CPU simulator (bit-level model of the kernels)");
                Ok(Backend::Cpu)
            }
            DeviceArg::Cuda => anyhow::bail!("this build has no CUDA backend yet; use --device cpu"),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Backend::Cpu => "cpu-simulator",
        }
    }

    /// Runs forward (and backward when `inp` has dO). Intermediates come from the simulator only.
    pub fn run(&self, inp: &Inputs, cfg: &Config, want_intermediates: bool) -> Result<SimOutput> {
        match self {
            Backend::Cpu => Ok(simulate(inp, cfg, want_intermediates)?),
        }
    }
}
