//! `sagebwd accuracy`: error of a configuration against exact f64 attention on random inputs.

use crate::accuracy_plot::{plot, Series};
use crate::args::{describe, ConfigArgs, DeviceArg};
use crate::backend::Backend;
use anyhow::Result;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use sagebwd::inputs::{add_key_channel_offset, random};
use sagebwd::metrics::{compare, Metrics};
use sagebwd::reference::exact;
use sagebwd::{Config, Product, Shape};
use serde::Serialize;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct AccuracyArgs {
    /// Batch size B.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Query heads H.
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// Key/value heads (GQA when smaller than --heads); default: --heads.
    #[arg(long)]
    pub heads_kv: Option<usize>,
    /// Query sequence length N.
    #[arg(short = 'n', long, default_value_t = 1024)]
    pub n: usize,
    /// Key sequence length; default: N. The causal mask is aligned to the end when they differ.
    #[arg(long)]
    pub n_k: Option<usize>,
    /// Head dimension d.
    #[arg(short = 'd', long, default_value_t = 128)]
    pub head_dim: usize,
    /// Causal mask.
    #[arg(long)]
    pub causal: bool,
    /// Standard deviations of Q and K to sweep, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,3,5,8,10")]
    pub sigma: Vec<f32>,
    /// Add to K a per-channel offset shared by all tokens, drawn with this standard deviation (the
    /// structure of real keys that K-smoothing removes); 0 = none.
    #[arg(long, default_value_t = 0.0)]
    pub k_offset: f32,
    /// Random seed (each σ uses seed + its index).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Run each of the 7 products quantized alone (all others BF16, K-smoothing on) instead of
    /// the configuration: which product hurts, and how much.
    #[arg(long)]
    pub isolate: bool,
    /// Skip the P, dP, dS intermediates (they take B·H·N² memory).
    #[arg(long)]
    pub no_intermediates: bool,
    /// Also draw the relative L2 error of O, dQ, dK, dV against σ into this PNG or SVG file
    /// (one line per configuration: with --isolate, one per quantized product).
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
    /// Print JSON records instead of tables.
    #[arg(long, conflicts_with = "csv")]
    pub json: bool,
    /// Print CSV records instead of tables.
    #[arg(long)]
    pub csv: bool,
    /// Where to run the method.
    #[arg(long, value_enum, default_value_t = DeviceArg::Auto)]
    pub device: DeviceArg,
}

const TENSORS: [&str; 8] = ["O", "dQ", "dK", "dV", "D", "P", "dP", "dS"];

/// One comparison: one configuration, one σ, one tensor.
#[derive(Serialize)]
struct Record {
    config: String,
    sigma: f32,
    tensor: &'static str,
    #[serde(flatten)]
    metrics: Metrics,
}

pub fn run(a: AccuracyArgs) -> Result<()> {
    let shape = Shape {
        batch: a.batch,
        heads_q: a.heads,
        heads_kv: a.heads_kv.unwrap_or(a.heads),
        n_q: a.n,
        n_k: a.n_k.unwrap_or(a.n),
        head_dim: a.head_dim,
    };
    shape.validate()?;
    if !(a.k_offset.is_finite() && a.k_offset >= 0.0) {
        anyhow::bail!(
            "--k-offset must be a finite standard deviation >= 0, got {}",
            a.k_offset
        );
    }
    if a.sigma.iter().any(|s| !(s.is_finite() && *s > 0.0)) {
        anyhow::bail!("--sigma values must be positive and finite, got {:?}", a.sigma);
    }
    let base = a.config.config()?;
    let configs: Vec<Config> = if a.isolate {
        Product::ALL
            .into_iter()
            .map(|p| {
                let mut c = Config::isolate(p);
                (c.block_q, c.block_kv) = (base.block_q, base.block_kv);
                c
            })
            .collect()
    } else {
        vec![base.clone()]
    };
    let backend = if base.has_kernels() {
        Backend::select(a.device)?
    } else if matches!(a.device, DeviceArg::Cuda) {
        anyhow::bail!("preset {} is a simulated design variant (docs/ALGORITHM.md §10): no GPU kernel implements it; use --device cpu", base.label());
    } else {
        Backend::Cpu
    };
    let want_inter = !a.no_intermediates;
    let bar = ProgressBar::new((a.sigma.len() * (1 + configs.len())) as u64);
    bar.set_style(ProgressStyle::with_template("{spinner} [{elapsed_precise}] {bar:30} {pos}/{len} {msg}").unwrap());
    let mut records = Vec::new();
    for (i, &sigma) in a.sigma.iter().enumerate() {
        let mut inp = random(shape, a.causal, sigma, a.seed + i as u64, true);
        if a.k_offset != 0.0 {
            add_key_channel_offset(&mut inp, a.k_offset, a.seed + i as u64);
        }
        bar.set_message(format!("σ={sigma}: exact f64 reference"));
        let ex = exact(&inp, want_inter)?;
        bar.inc(1);
        let eg = ex.grads.as_ref().expect("inputs carry dO");
        for cfg in &configs {
            bar.set_message(format!("σ={sigma}: {} on {}", cfg.label(), backend.name()));
            let out = backend.run(&inp, cfg, want_inter)?;
            bar.inc(1);
            let g = out.grads.as_ref().expect("inputs carry dO");
            let mut pairs: Vec<(&'static str, &[f32], &[f64])> = vec![
                ("O", &out.fwd.o, &ex.o),
                ("dQ", &g.dq, &eg.dq),
                ("dK", &g.dk, &eg.dk),
                ("dV", &g.dv, &eg.dv),
                ("D", &g.delta, &eg.delta),
            ];
            if let (Some(it), Some(eit)) = (&out.inter, &ex.inter) {
                pairs.extend([
                    ("P", &it.p[..], &eit.p[..]),
                    ("dP", &it.dp, &eit.dp),
                    ("dS", &it.ds, &eit.ds),
                ]);
            }
            for (tensor, x, r) in pairs {
                records.push(Record {
                    config: cfg.label(),
                    sigma,
                    tensor,
                    metrics: compare(x, r),
                });
            }
        }
    }
    bar.finish_and_clear();
    if let Some(path) = &a.plot {
        let series: Vec<Series> = configs
            .iter()
            .map(|c| Series {
                label: c.label(),
                points: records
                    .iter()
                    .filter(|r| r.config == c.label())
                    .map(|r| (r.tensor, r.sigma, r.metrics.rel_l2))
                    .collect(),
            })
            .collect();
        let title = format!(
            "{} vs exact f64: N={}, d={}, {} ({})",
            if a.isolate {
                "each product INT8 alone".to_string()
            } else {
                base.label()
            },
            shape.n_q,
            shape.head_dim,
            if a.causal { "causal" } else { "non-causal" },
            backend.name()
        );
        plot(&series, path, &title)?;
        eprintln!("plot: {}", path.display());
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&records)?);
    } else if a.csv {
        println!("config,sigma,tensor,cos,rel_l2,rel_l1,rmse");
        for r in &records {
            let m = r.metrics;
            println!(
                "{},{},{},{},{},{},{}",
                r.config, r.sigma, r.tensor, m.cos, m.rel_l2, m.rel_l1, m.rmse
            );
        }
    } else {
        print_tables(&a, shape, &configs, &backend, &records);
    }
    Ok(())
}

fn print_tables(a: &AccuracyArgs, s: Shape, configs: &[Config], backend: &Backend, records: &[Record]) {
    let what = if a.isolate {
        "each product INT8 alone (isolation)".to_string()
    } else {
        describe(&configs[0])
    };
    println!("sagebwd accuracy: {what}");
    println!(
        "shape B={} H={} (kv {}) N={} (keys {}) d={}, {}, K channel offset σ={}, seed {}; {} vs exact f64",
        s.batch,
        s.heads_q,
        s.heads_kv,
        s.n_q,
        s.n_k,
        s.head_dim,
        if a.causal { "causal" } else { "non-causal" },
        a.k_offset,
        a.seed,
        backend.name()
    );
    let width = configs.iter().map(|c| c.label().len()).max().unwrap_or(6).max(6);
    for (title, pick) in [
        (
            "cosine similarity",
            (|m: &Metrics| format!("{:.6}", m.cos)) as fn(&Metrics) -> String,
        ),
        ("relative L2 error", |m: &Metrics| format!("{:.2e}", m.rel_l2)),
    ] {
        println!("\n{title}");
        print!("{:width$} {:>5}", "config", "σ");
        TENSORS.iter().for_each(|t| print!(" {t:>9}"));
        println!();
        for cfg in configs {
            let label = cfg.label();
            for &sigma in &a.sigma {
                print!("{label:width$} {sigma:>5}");
                for t in TENSORS {
                    let cell = records
                        .iter()
                        .find(|r| r.config == label && r.sigma == sigma && r.tensor == t)
                        .map_or("-".to_string(), |r| pick(&r.metrics));
                    print!(" {cell:>9}");
                }
                println!();
            }
        }
    }
}
