//! The method switches of `sagebwd train` (`--int8`, `--bf16`, `--smooth-k`, `--smooth-q`,
//! `--dq-correction`, block sizes): the same flags as `accuracy` and `attn`, applied to each preset
//! that `--preset` lists.

use crate::args::OnOff;
use anyhow::{bail, Result};
use clap::Args;
use sagebwd::{Config, Precision, Product};

#[derive(Args, Clone, Debug, Default)]
pub struct MethodFlags {
    /// Products to switch to INT8 in every listed preset, comma-separated: qk, pv, qk-bwd, dv, dp,
    /// dq, dk (or 1..7).
    #[arg(long, value_delimiter = ',', value_name = "PRODUCTS")]
    pub int8: Vec<String>,
    /// Products to switch to BF16 in every listed preset (same names as --int8).
    #[arg(long, value_delimiter = ',', value_name = "PRODUCTS")]
    pub bf16: Vec<String>,
    /// K-smoothing on or off in every listed preset; default: each preset's own (on but in fpa).
    #[arg(long, value_name = "on|off")]
    pub smooth_k: Option<OnOff>,
    /// Q-smoothing (per-block mean of Q, bias added back).
    #[arg(long)]
    pub smooth_q: bool,
    /// Add the exact K-smoothing correction rowsum(dS)·K_m to dQ.
    #[arg(long)]
    pub dq_correction: bool,
    /// Query rows per quantization block, B_q (the GPU kernels take only the default, 64).
    #[arg(long)]
    pub block_q: Option<usize>,
    /// Key/value rows per quantization block, B_kv (the GPU kernels take only the default, 128).
    #[arg(long)]
    pub block_kv: Option<usize>,
}

impl MethodFlags {
    fn any(&self) -> bool {
        !self.int8.is_empty()
            || !self.bf16.is_empty()
            || self.smooth_k.is_some()
            || self.smooth_q
            || self.dq_correction
            || self.block_q.is_some()
            || self.block_kv.is_some()
    }

    /// The configuration of `preset` with the flags applied; None for `exact` (the f64 reference,
    /// which takes no flags).
    pub fn config(&self, preset: &str) -> Result<Option<Config>> {
        if preset.trim().eq_ignore_ascii_case("exact") {
            if self.any() {
                bail!("attention `exact` is the f64 reference: --int8/--bf16/--smooth-k/--smooth-q/--dq-correction/--block-q/--block-kv do not apply to it");
            }
            return Ok(None);
        }
        let Ok(mut cfg) = Config::preset(preset) else {
            let names = sagebwd_train::backend::ATTENTION_NAMES.join(", ");
            bail!(
                "unknown attention preset `{}` (expected one of: {names})",
                preset.trim()
            );
        };
        self.apply_to(&mut cfg)?;
        Ok(Some(cfg))
    }

    /// Applies the switches to `cfg` and validates the result: the products named by --int8/--bf16 (one product
    /// in both is an error), K-smoothing where given, Q-smoothing and the dQ correction where asked, the block
    /// sizes where given. `train` and the single-configuration commands (`ConfigArgs`) share it.
    pub fn apply_to(&self, cfg: &mut Config) -> Result<()> {
        if let Some(name) = self
            .int8
            .iter()
            .find(|n| self.bf16.iter().any(|b| b.trim().eq_ignore_ascii_case(n.trim())))
        {
            bail!("product `{name}` is given to both --int8 and --bf16");
        }
        for (list, prec) in [(&self.int8, Precision::Int8), (&self.bf16, Precision::Bf16)] {
            for name in list {
                cfg.set(Product::parse(name)?, prec);
            }
        }
        if let Some(s) = self.smooth_k {
            cfg.smooth_k = matches!(s, OnOff::On);
        }
        cfg.smooth_q |= self.smooth_q;
        cfg.dq_smooth_k_correction |= self.dq_correction;
        cfg.block_q = self.block_q.unwrap_or(cfg.block_q);
        cfg.block_kv = self.block_kv.unwrap_or(cfg.block_kv);
        cfg.validate()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_apply_to_the_preset() {
        let none = MethodFlags::default();
        assert_eq!(none.config("sagebwd").unwrap(), Some(Config::sagebwd()));
        assert_eq!(none.config("exact").unwrap(), None);
        let f = MethodFlags {
            bf16: vec!["dq".into(), "dk".into()],
            smooth_k: Some(OnOff::Off),
            ..Default::default()
        };
        let c = f.config("sagebwd").unwrap().unwrap();
        assert!(!c.is_int8(Product::Dq) && !c.is_int8(Product::Dk) && c.is_int8(Product::Dv) && !c.smooth_k);
        assert!(f.config("exact").is_err());
        let both = MethodFlags {
            int8: vec!["dq".into()],
            bf16: vec!["dq".into()],
            ..Default::default()
        };
        assert!(both.config("fpa").is_err());
        let bad = MethodFlags {
            block_q: Some(0),
            ..Default::default()
        };
        assert!(bad.config("fpa").is_err());
        assert!(MethodFlags {
            int8: vec!["dx".into()],
            ..Default::default()
        }
        .config("fpa")
        .is_err());
    }
}
