//! The attention method of a run: the preset name or the exact `sagebwd::Config` recorded in its
//! [`TrainConfig`], and which configurations leave the GPU's fast (staged) kernels.

use crate::backend::Attention;
use crate::error::{Error, Result};
use crate::train::TrainConfig;
use sagebwd::config::{DEFAULT_BLOCK_KV, DEFAULT_BLOCK_Q};
use sagebwd::{Config, Precision, Product};

impl TrainConfig {
    /// The attention the run trains with: the recorded configuration when there is one (its label
    /// must be the run's `attention`), else the preset named by `attention`.
    pub fn attention_spec(&self) -> Result<Attention> {
        match &self.method {
            None => Attention::parse(&self.attention),
            Some(config) => {
                config.validate()?;
                let label = run_label(config);
                if label != self.attention {
                    return Err(Error::Config(format!(
                        "the run's attention `{}` does not name its configuration (`{label}`)",
                        self.attention
                    )));
                }
                Ok(Attention::Method {
                    name: label,
                    config: config.clone(),
                })
            }
        }
    }
}

/// The name of a configuration in run directories, tables and legends: [`Config::label`], with the
/// block sizes appended where they are not the defaults.
pub fn run_label(cfg: &Config) -> String {
    let mut s = cfg.label();
    if cfg.block_q != DEFAULT_BLOCK_Q || cfg.block_kv != DEFAULT_BLOCK_KV {
        s.push_str(&format!("-bq{}-bkv{}", cfg.block_q, cfg.block_kv));
    }
    s
}

/// `label` made safe as a file name part: `int8[qk,dv]+smoothK` → `int8_qk-dv_+smoothK`.
pub fn file_label(label: &str) -> String {
    label
        .chars()
        .map(|c| match c {
            ',' => '-',
            c if c.is_ascii_alphanumeric() || "+-_.".contains(c) => c,
            _ => '_',
        })
        .collect()
}

/// Why `cfg` runs slowly on the GPU (or not at all), if it does, from the kernel plan
/// ([`sagebwd_cuda::KernelPlan::choose`] on Hopper at a training shape): the fast kernels are the staged ones (the
/// forward when `qk` and `pv` are both INT8 or both BF16, the backward when its five products are all BF16 or exactly
/// the `sagebwd` mix without Q-smoothing and the dQ correction); anything else runs on the general (gathering)
/// `mma.sync` kernels.
pub fn kernel_warning(cfg: &Config) -> Option<String> {
    if !cfg.has_kernels() || cfg.block_q != DEFAULT_BLOCK_Q || cfg.block_kv != DEFAULT_BLOCK_KV {
        return Some(format!(
            "`{}` has no GPU kernel (the GPU kernels take B_q = {DEFAULT_BLOCK_Q}, B_kv = {DEFAULT_BLOCK_KV} and the \
             per-block INT8 P/dS of docs/ALGORITHM.md §1–5): this configuration trains on the CPU only",
            run_label(cfg)
        ));
    }
    use sagebwd_cuda::plan::{BackwardMain, ForwardKernel, ForwardPath};
    let shape = sagebwd::Shape {
        batch: 16,
        heads_q: 12,
        heads_kv: 12,
        n_q: 1024,
        n_k: 1024,
        head_dim: 64,
    };
    let plan = sagebwd_cuda::KernelPlan::choose("sm_90a", cfg, &shape, true, &sagebwd_cuda::Tuning::default());
    let mut slow = Vec::new();
    if matches!(plan.forward, ForwardKernel::Mma(ForwardPath::Gather)) {
        slow.push("the forward mixes INT8 and BF16 (qk, pv)".to_string());
    } else if matches!(plan.forward, ForwardKernel::Mma(_)) {
        slow.push("the forward runs on the mma.sync kernel (Q-smoothing)".to_string());
    }
    if plan.backward.staged.is_none() && matches!(plan.backward.main, BackwardMain::Mma) {
        let int8 = |p: Product| cfg.get(p) == Precision::Int8;
        let bwd = [Product::QkBwd, Product::Dv, Product::Dp, Product::Dq, Product::Dk];
        let why = if bwd.iter().all(|p| int8(*p) == (*p != Product::Dp)) {
            "Q-smoothing or the dQ correction is on"
        } else {
            "the backward's products are neither all BF16 nor the sagebwd mix (INT8 but dp)"
        };
        slow.push(why.to_string());
    }
    (!slow.is_empty()).then(|| {
        format!(
            "`{}` runs on the GPU's general (slow) attention kernels: {}",
            run_label(cfg),
            slow.join("; ")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_paths_have_no_warning_and_others_do() {
        assert!(kernel_warning(&Config::fpa()).is_none());
        assert!(kernel_warning(&Config::sagebwd()).is_none());
        let mut no_smooth = Config::sagebwd();
        no_smooth.smooth_k = false;
        assert!(
            kernel_warning(&no_smooth).is_none(),
            "K-smoothing does not change the kernel"
        );
        let mut smooth_q = Config::sagebwd();
        smooth_q.smooth_q = true;
        assert!(kernel_warning(&smooth_q).unwrap().contains("Q-smoothing"));
        let mut bf16_grads = Config::sagebwd();
        bf16_grads
            .set(Product::Dq, Precision::Bf16)
            .set(Product::Dk, Precision::Bf16);
        assert!(kernel_warning(&bf16_grads).unwrap().contains("neither"));
        assert!(kernel_warning(&Config::int8_all()).is_some());
        let mut fwd = Config::fpa();
        fwd.set(Product::QkFwd, Precision::Int8);
        assert!(kernel_warning(&fwd).unwrap().contains("forward"));
        let mut blocks = Config::sagebwd();
        blocks.block_q = 32;
        assert!(kernel_warning(&blocks).unwrap().contains("CPU only"));
        assert_eq!(run_label(&blocks), "sagebwd-bq32-bkv128");
    }

    #[test]
    fn a_preset_run_and_its_recorded_configuration_are_the_same_attention() {
        let cfg = |attention: &str, method: Option<Config>| TrainConfig {
            model: crate::config::ModelConfig::preset("tiny").unwrap(),
            attention: attention.into(),
            method,
            trace: false,
            seq_len: 16,
            micro_batch: 1,
            grad_accum: 1,
            steps: 1,
            lr: 1e-3,
            min_lr: 1e-4,
            warmup: 1,
            adamw: Default::default(),
            grad_clip: 1.0,
            eval_every: 1,
            eval_tokens: 16,
            checkpoint_every: 1,
            seed: 1,
            gpus: 1,
        };
        // A run directory written before configurations were recorded resumes under the new command line.
        let old = cfg("sagebwd", None).attention_spec().unwrap();
        assert_eq!(old, cfg("sagebwd", Some(Config::sagebwd())).attention_spec().unwrap());
        let mut off = Config::sagebwd();
        off.smooth_k = false;
        assert_ne!(old, cfg("sagebwd-smoothK", Some(off.clone())).attention_spec().unwrap());
        let e = cfg("sagebwd", Some(off)).attention_spec().unwrap_err().to_string();
        assert!(e.contains("does not name its configuration"), "{e}");
    }

    #[test]
    fn file_labels_are_plain() {
        assert_eq!(file_label("int8[qk,dv]+smoothK"), "int8_qk-dv_+smoothK");
        assert_eq!(file_label("sagebwd"), "sagebwd");
    }
}
