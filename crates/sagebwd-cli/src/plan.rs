//! `sagebwd plan`: which kernels run for a configuration, shape and GPU architecture — without a GPU.

use crate::args::ConfigArgs;
use anyhow::{bail, Result};
use clap::Args;
use sagebwd::Shape;
use sagebwd_cuda::{KernelPlan, Tuning};

#[derive(Args, Debug)]
pub struct PlanArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Head dimension (the GPU kernels take 64 and 128).
    #[arg(short = 'd', long, default_value_t = 128)]
    pub head_dim: usize,
    /// Sequence length (queries and keys, unless --n-k is given).
    #[arg(short = 'n', long, default_value_t = 4096)]
    pub n: usize,
    /// Key sequence length (default: N).
    #[arg(long)]
    pub n_k: Option<usize>,
    /// Batch size.
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    /// Query heads.
    #[arg(long, default_value_t = 16)]
    pub heads: usize,
    /// Key/value heads (GQA; default: the query heads).
    #[arg(long)]
    pub heads_kv: Option<usize>,
    /// Causal mask (aligned to the end when the lengths differ).
    #[arg(long)]
    pub causal: bool,
    /// GPU architecture as NVRTC names it: sm_90a (H100, H200), sm_80 (A100), sm_86, sm_89, …
    #[arg(long, default_value = "sm_90a")]
    pub arch: String,
    /// Apply the SAGEBWD_* tuning variables of the environment (default: the plan's own choice).
    #[arg(long)]
    pub env: bool,
    /// Print the whole kernel map (every preset, architecture, head dimension, mask and N) as Markdown.
    #[arg(long)]
    pub map: bool,
}

pub fn run(a: PlanArgs) -> Result<()> {
    if a.map {
        print!("{}", sagebwd_cuda::plan::kernel_map_markdown());
        return Ok(());
    }
    let cfg = a.config.config()?;
    if !a.arch.starts_with("sm_") {
        bail!(
            "--arch {}: expected an NVRTC architecture such as sm_90a or sm_80",
            a.arch
        );
    }
    let shape = Shape {
        batch: a.batch,
        heads_q: a.heads,
        heads_kv: a.heads_kv.unwrap_or(a.heads),
        n_q: a.n,
        n_k: a.n_k.unwrap_or(a.n),
        head_dim: a.head_dim,
    };
    sagebwd_cuda::check_supported(&shape, &cfg)?;
    let tuning = if a.env { Tuning::from_env()? } else { Tuning::default() };
    let plan = KernelPlan::choose(&a.arch, &cfg, &shape, a.causal, &tuning);
    println!(
        "{} on {}, B {} H {}/{} N {}×{} d {}{}:",
        cfg.label(),
        a.arch,
        shape.batch,
        shape.heads_q,
        shape.heads_kv,
        shape.n_q,
        shape.n_k,
        shape.head_dim,
        if a.causal { ", causal" } else { "" }
    );
    println!("{plan}");
    Ok(())
}
