//! Command-line arguments shared by several subcommands: the method's configuration, the device.

use anyhow::{bail, Result};
use clap::{Args, ValueEnum};
use sagebwd::config::{DEFAULT_BLOCK_KV, DEFAULT_BLOCK_Q};
use sagebwd::{Config, Precision, Product};

/// Which products run in INT8, smoothing, block sizes (docs/ALGORITHM.md).
#[derive(Args, Clone, Debug)]
pub struct ConfigArgs {
    /// Starting configuration: fpa (all BF16 = FlashAttention), sagebwd (all INT8 but dp),
    /// int8-all (all seven INT8), or a P / dS quantization variant of sagebwd (ALGORITHM.md §10;
    /// simulator only): int8-row128, int8-row64, int8-axis, p-e4m3, p-e4m3-ds-axis, p-e4m3-ds-e4m3,
    /// p-e4m3-ds-e5m2, fp8-tensor, int8-axis-delta-p, p-e4m3-ds-axis-delta-p, p-e4m3-ds-e4m3-delta-p.
    #[arg(long, default_value = "sagebwd", value_parser = preset_names())]
    pub preset: String,
    /// FP8 tensor-core sum model of the variants (ALGORITHM.md §10.5): significant bits kept per
    /// k = 32 instruction (0 = exact FP32).
    #[arg(long, default_value_t = 0)]
    pub fp8_sum_bits: u32,
    /// FP8 tensor-core sum model: promote the accumulator into an FP32 register sum every this many
    /// reduction elements (a multiple of 32; 0 = never).
    #[arg(long, default_value_t = 0)]
    pub fp8_promote: usize,
    /// Products to switch to INT8, comma-separated: qk, pv, qk-bwd, dv, dp, dq, dk (or 1..7).
    #[arg(long, value_delimiter = ',', value_name = "PRODUCTS")]
    pub int8: Vec<String>,
    /// Products to switch to BF16, comma-separated (same names as --int8).
    #[arg(long, value_delimiter = ',', value_name = "PRODUCTS")]
    pub bf16: Vec<String>,
    /// K-smoothing (subtract the token mean of K before quantizing); default: the preset's.
    #[arg(long, value_name = "on|off")]
    pub smooth_k: Option<OnOff>,
    /// Q-smoothing (per-block mean of Q, bias added back); off by default.
    #[arg(long)]
    pub smooth_q: bool,
    /// Add the exact K-smoothing correction rowsum(dS)·K_m to dQ (off by default).
    #[arg(long)]
    pub dq_correction: bool,
    /// Query rows per quantization block, B_q.
    #[arg(long, default_value_t = DEFAULT_BLOCK_Q)]
    pub block_q: usize,
    /// Key/value rows per quantization block, B_kv.
    #[arg(long, default_value_t = DEFAULT_BLOCK_KV)]
    pub block_kv: usize,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

fn preset_names() -> clap::builder::PossibleValuesParser {
    let names: Vec<&'static str> = sagebwd::config::PRESETS
        .into_iter()
        .chain(sagebwd::config::VARIANTS)
        .collect();
    clap::builder::PossibleValuesParser::new(names)
}

impl ConfigArgs {
    pub fn config(&self) -> Result<Config> {
        let mut cfg = Config::preset(&self.preset)?;
        if self.fp8_sum_bits > 0 || self.fp8_promote > 0 {
            if !cfg.pds.any_fp8() {
                bail!(
                    "--fp8-sum-bits / --fp8-promote apply to the FP8 variants only (preset {})",
                    self.preset
                );
            }
            cfg.pds.fp8_sum = sagebwd::fp8::TensorSum {
                mantissa_bits: self.fp8_sum_bits,
                promote: self.fp8_promote,
            };
        }
        crate::method_args::MethodFlags {
            int8: self.int8.clone(),
            bf16: self.bf16.clone(),
            smooth_k: self.smooth_k,
            smooth_q: self.smooth_q,
            dq_correction: self.dq_correction,
            block_q: Some(self.block_q),
            block_kv: Some(self.block_kv),
        }
        .apply_to(&mut cfg)?;
        Ok(cfg)
    }
}

/// Where the method runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    /// The GPU when one is usable, else the CPU simulator (with a message saying so).
    Auto,
    /// The CPU simulator (bit-level model of the kernels).
    Cpu,
    /// The CUDA kernels; an error if no GPU is usable.
    Cuda,
}

/// Describes a configuration in words, for table headers.
pub fn describe(cfg: &Config) -> String {
    let list = |p: Precision| {
        let v: Vec<&str> = Product::ALL
            .into_iter()
            .filter(|x| cfg.get(*x) == p)
            .map(|x| x.name())
            .collect();
        if v.is_empty() {
            "-".to_string()
        } else {
            v.join(",")
        }
    };
    format!(
        "{} (int8: {}; bf16: {}), K-smoothing {}{}{}, B_q={}, B_kv={}",
        cfg.label(),
        list(Precision::Int8),
        list(Precision::Bf16),
        if cfg.smooth_k { "on" } else { "off" },
        if cfg.smooth_q { ", Q-smoothing on" } else { "" },
        if cfg.dq_smooth_k_correction {
            ", dQ correction on"
        } else {
            ""
        },
        cfg.block_q,
        cfg.block_kv
    )
}
