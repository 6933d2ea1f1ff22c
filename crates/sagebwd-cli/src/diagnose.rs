//! `sagebwd diagnose CHECKPOINT`: the attention error of a configuration on a trained model's real
//! layers (the seed paper's Table 2). One batch runs forward and backward on the CPU, recording every
//! layer's Q, K, V (after QK-norm and rotary) and dO; on each layer, the configuration and each
//! product quantized alone run in the CPU simulator (bit-exact to the kernels) against exact f64
//! attention.

use crate::args::{describe, ConfigArgs};
use anyhow::{anyhow, bail, Result};
use clap::Args;
use plotters::coord::Shift;
use plotters::prelude::*;
use sagebwd::io::{write_tensors, OutDtype, OutTensor};
use sagebwd::metrics::{compare, Metrics};
use sagebwd::reference::{exact, visible_keys};
use sagebwd::{Config, Inputs, Product};
use sagebwd_train::backend::Attention;
use sagebwd_train::capture::{capture, load_trained, LayerTensors};
use sagebwd_train::checkpoint;
use sagebwd_train::data::{decode_text, split_documents, tokenize_documents};
use sagebwd_train::model::Batch;
use sagebwd_train::plot::{register_font, COLORS};
use sagebwd_train::sample;
use serde::Serialize;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct DiagnoseArgs {
    /// A run's checkpoint (checkpoint.safetensors) or its run directory.
    #[arg(value_name = "CHECKPOINT")]
    pub checkpoint: PathBuf,
    /// Text (the validation documents, index % 10 == 1) or token shards to take the batch from.
    /// Default: the built-in sample's validation books.
    #[arg(long, value_name = "DATA")]
    pub data: Vec<PathBuf>,
    /// Tokens of the sequence run through the model; default: the run's sequence length.
    #[arg(long)]
    pub seq: Option<usize>,
    /// Where the sequence starts in the token stream.
    #[arg(long, default_value_t = 0)]
    pub offset: usize,
    /// Compare on the first N tokens of the sequence only (a causal prefix is a complete problem);
    /// default: all of them.
    #[arg(long)]
    pub tokens: Option<usize>,
    /// Query heads to compare, comma-separated (each with its kv head); default: all.
    #[arg(long, value_delimiter = ',')]
    pub heads: Vec<usize>,
    /// Attention the model runs while capturing: exact (f64, default) or a preset.
    #[arg(long, default_value = "exact")]
    pub capture_with: String,
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Skip the isolation runs (each product INT8 alone, all others BF16, K-smoothing on).
    #[arg(long)]
    pub no_isolate: bool,
    /// Print JSON instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Draw the per-layer errors of the configuration into this PNG or SVG file.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
    /// Write this layer's q, k, v, do (F32, [1, H, N, d]) to the file given by -o, for `sagebwd attn`.
    #[arg(long, value_name = "LAYER", requires = "output")]
    pub export: Option<usize>,
    /// The file `--export` writes.
    #[arg(short, long, requires = "export")]
    pub output: Option<PathBuf>,
}

const TENSORS: [&str; 8] = ["D", "P", "dP", "dS", "O", "dQ", "dK", "dV"];

#[derive(Serialize)]
struct Comparison {
    config: String,
    tensor: &'static str,
    #[serde(flatten)]
    metrics: Metrics,
}

#[derive(Serialize)]
struct LayerReport {
    layer: usize,
    /// Standard deviation of the layer's Q and K values (the σ of `sagebwd accuracy`).
    sigma_q: f64,
    sigma_k: f64,
    /// RMS of the exact P, dP, dS over the causally visible entries.
    rms_p: f64,
    rms_dp: f64,
    rms_ds: f64,
    comparisons: Vec<Comparison>,
}

#[derive(Serialize)]
struct Report {
    checkpoint: PathBuf,
    step: Option<u64>,
    model: String,
    config: String,
    config_description: String,
    capture_with: String,
    loss: f64,
    tokens: usize,
    heads: Vec<usize>,
    engine: &'static str,
    layers: Vec<LayerReport>,
}

pub fn run(a: DiagnoseArgs) -> Result<()> {
    let path = if a.checkpoint.is_dir() {
        a.checkpoint.join(checkpoint::FILE_NAME)
    } else {
        a.checkpoint.clone()
    };
    if !path.exists() {
        bail!("{}: no such checkpoint", path.display());
    }
    let trained = load_trained(&path)?;
    let run = &trained.config;
    let cfg = a.config.config()?;
    let capture_with = Attention::parse(&a.capture_with)?;
    let seq = a.seq.unwrap_or(run.seq_len);
    if seq == 0 || seq > run.model.max_seq_len {
        bail!(
            "--seq must be in 1..={} (the model's maximum), got {seq}",
            run.model.max_seq_len
        );
    }
    let stream = tokens(&a.data)?;
    if stream.len() < a.offset + seq + 1 {
        bail!(
            "the data has {} tokens: too few for a sequence of {seq} (+1) from --offset {}",
            stream.len(),
            a.offset
        );
    }
    let window: Vec<u32> = stream[a.offset..a.offset + seq + 1].iter().map(|&t| t as u32).collect();
    let batch = Batch {
        inputs: &window[..seq],
        targets: &window[1..],
        batch: 1,
        seq,
    };
    eprintln!(
        "capturing {} layers of {} over {seq} tokens (attention {}, CPU)",
        run.model.n_layers,
        run.model.describe(),
        capture_with.name()
    );
    let captured = capture(&run.model, trained.weights, capture_with.clone(), &batch)?;
    let n = a.tokens.unwrap_or(seq).min(seq);
    let heads = if a.heads.is_empty() { None } else { Some(&a.heads[..]) };
    if let Some(l) = a.export {
        let layer = captured.layers.get(l).ok_or_else(|| {
            anyhow!(
                "--export {l}: the model has {} layers (0..{})",
                captured.layers.len(),
                captured.layers.len()
            )
        })?;
        let out = a.output.as_ref().expect("clap requires -o with --export");
        export(layer, &layer.problem(0, heads, n)?, out, &path)?;
        eprintln!("layer {l}: q, k, v, do written to {}", out.display());
    }
    let mut configs = vec![cfg.clone()];
    if !a.no_isolate {
        configs.extend(Product::ALL.into_iter().map(|p| {
            let mut c = Config::isolate(p);
            (c.block_q, c.block_kv) = (cfg.block_q, cfg.block_kv);
            c
        }));
    }
    let mut layers = Vec::new();
    for layer in &captured.layers {
        eprintln!(
            "layer {}: exact f64 and {} simulated configurations",
            layer.layer,
            configs.len()
        );
        layers.push(diagnose_layer(layer.layer, &layer.problem(0, heads, n)?, &configs)?);
    }
    let report = Report {
        checkpoint: path.clone(),
        step: trained.step,
        model: run.model.describe(),
        config: cfg.label(),
        config_description: describe(&cfg),
        capture_with: capture_with.name().to_string(),
        loss: captured.loss,
        tokens: n,
        heads: a.heads.clone(),
        engine: "CPU simulator (sagebwd::sim, bit-exact to the kernels) vs exact f64",
        layers,
    };
    if let Some(p) = &a.plot {
        plot(&report, p)?;
        eprintln!("plot: {}", p.display());
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_tables(&report);
    }
    Ok(())
}

/// The token stream the batch is taken from: the validation part of `data` (else its training part).
fn tokens(data: &[PathBuf]) -> Result<Vec<u16>> {
    if data.is_empty() {
        let text = decode_text(sample::SAMPLE_FILE, sample::SAMPLE_XZ)?;
        return Ok(tokenize_documents(&split_documents(&text), 10).val);
    }
    let (train, val) = crate::train::read_inputs(data, 10)?;
    Ok(if val.is_empty() { train } else { val })
}

fn sigma(x: &[f32]) -> f64 {
    let n = x.len().max(1) as f64;
    let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n;
    (x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n).sqrt()
}

/// RMS of `[B, H, N_q, N_k]` values over the entries the causal mask keeps.
fn visible_rms(x: &[f64], inp: &Inputs) -> f64 {
    let s = inp.shape;
    let (mut sum, mut count) = (0.0, 0usize);
    for (row, chunk) in x.chunks(s.n_k).enumerate() {
        let vis = visible_keys(&s, inp.causal, row % s.n_q);
        sum += chunk[..vis].iter().map(|v| v * v).sum::<f64>();
        count += vis;
    }
    (sum / count.max(1) as f64).sqrt()
}

fn diagnose_layer(layer: usize, inp: &Inputs, configs: &[Config]) -> Result<LayerReport> {
    let ex = exact(inp, true)?;
    let (eg, ei) = (
        ex.grads.as_ref().expect("inputs carry dO"),
        ex.inter.as_ref().expect("intermediates asked for"),
    );
    let mut comparisons = Vec::new();
    for cfg in configs {
        let out = sagebwd::sim::simulate(inp, cfg, true)?;
        let (g, it) = (
            out.grads.as_ref().expect("inputs carry dO"),
            out.inter.as_ref().expect("intermediates asked for"),
        );
        let pairs: [(&'static str, &[f32], &[f64]); 8] = [
            ("D", &g.delta, &eg.delta),
            ("P", &it.p, &ei.p),
            ("dP", &it.dp, &ei.dp),
            ("dS", &it.ds, &ei.ds),
            ("O", &out.fwd.o, &ex.o),
            ("dQ", &g.dq, &eg.dq),
            ("dK", &g.dk, &eg.dk),
            ("dV", &g.dv, &eg.dv),
        ];
        for (tensor, x, r) in pairs {
            comparisons.push(Comparison {
                config: cfg.label(),
                tensor,
                metrics: compare(x, r),
            });
        }
    }
    Ok(LayerReport {
        layer,
        sigma_q: sigma(&inp.q),
        sigma_k: sigma(&inp.k),
        rms_p: visible_rms(&ei.p, inp),
        rms_dp: visible_rms(&ei.dp, inp),
        rms_ds: visible_rms(&ei.ds, inp),
        comparisons,
    })
}

fn export(layer: &LayerTensors, inp: &Inputs, out: &Path, from: &Path) -> Result<()> {
    let s = inp.shape;
    let qd = vec![s.batch, s.heads_q, s.n_q, s.head_dim];
    let kd = vec![s.batch, s.heads_kv, s.n_k, s.head_dim];
    let d_o = inp.d_o.as_ref().expect("captured problems carry dO");
    let t = [
        OutTensor {
            name: "q",
            dims: qd.clone(),
            values: &inp.q,
            dtype: OutDtype::F32,
        },
        OutTensor {
            name: "k",
            dims: kd.clone(),
            values: &inp.k,
            dtype: OutDtype::F32,
        },
        OutTensor {
            name: "v",
            dims: kd,
            values: &inp.v,
            dtype: OutDtype::F32,
        },
        OutTensor {
            name: "do",
            dims: qd,
            values: d_o,
            dtype: OutDtype::F32,
        },
    ];
    let meta = HashMap::from([
        ("source".to_string(), from.display().to_string()),
        ("layer".to_string(), layer.layer.to_string()),
        ("causal".to_string(), "true".to_string()),
    ]);
    Ok(write_tensors(out, &t, meta)?)
}

fn find<'a>(l: &'a LayerReport, config: &str, tensor: &str) -> Option<&'a Metrics> {
    l.comparisons
        .iter()
        .find(|c| c.config == config && c.tensor == tensor)
        .map(|c| &c.metrics)
}

fn print_tables(r: &Report) {
    println!(
        "sagebwd diagnose: {} (step {})",
        r.checkpoint.display(),
        r.step.map_or("?".into(), |s| s.to_string())
    );
    println!(
        "model {}; batch loss {:.4} (captured with attention {})",
        r.model, r.loss, r.capture_with
    );
    println!("configuration: {}", r.config_description);
    println!(
        "{} tokens, heads {}; {}",
        r.tokens,
        if r.heads.is_empty() {
            "all".into()
        } else {
            format!("{:?}", r.heads)
        },
        r.engine
    );
    println!("\nper layer: σ of Q and K, RMS of the exact P, dP, dS (visible entries)");
    println!(
        "{:>5} {:>9} {:>9} {:>10} {:>10} {:>10}",
        "layer", "σ_Q", "σ_K", "RMS P", "RMS dP", "RMS dS"
    );
    for l in &r.layers {
        println!(
            "{:>5} {:>9.4} {:>9.4} {:>10.3e} {:>10.3e} {:>10.3e}",
            l.layer, l.sigma_q, l.sigma_k, l.rms_p, l.rms_dp, l.rms_ds
        );
    }
    for (title, pick) in [
        (
            "cosine similarity",
            (|m: &Metrics| format!("{:.6}", m.cos)) as fn(&Metrics) -> String,
        ),
        ("relative L2 error", |m: &Metrics| format!("{:.3e}", m.rel_l2)),
    ] {
        let configs: Vec<String> = {
            let mut v: Vec<String> = Vec::new();
            for c in r.layers.iter().flat_map(|l| &l.comparisons) {
                if !v.contains(&c.config) {
                    v.push(c.config.clone());
                }
            }
            v
        };
        let width = configs.iter().map(String::len).max().unwrap_or(6).max(6);
        println!("\n{title} vs exact f64 (δ = D)");
        print!("{:width$} {:>5}", "config", "layer");
        TENSORS.iter().for_each(|t| print!(" {t:>9}"));
        println!();
        for c in &configs {
            for l in &r.layers {
                print!("{c:width$} {:>5}", l.layer);
                for t in TENSORS {
                    print!(" {:>9}", find(l, c, t).map_or("-".into(), pick));
                }
                println!();
            }
        }
    }
}

type DrawResult = std::result::Result<(), Box<dyn std::error::Error>>;

fn plot(r: &Report, path: &Path) -> Result<()> {
    register_font();
    let size = (1200, 600);
    let drawn = if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("svg")) {
        draw(SVGBackend::new(path, size).into_drawing_area(), r)
    } else {
        draw(BitMapBackend::new(path, size).into_drawing_area(), r)
    };
    drawn.map_err(|e| anyhow!("{}: cannot draw the plot: {e}", path.display()))
}

fn color(i: usize) -> RGBColor {
    if i < COLORS.len() {
        COLORS[i]
    } else {
        let (r, g, b) = Palette99::pick(i).rgb();
        RGBColor(r, g, b)
    }
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, r: &Report) -> DrawResult
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let root = root.titled(
        &format!("{} vs exact f64 per layer ({} tokens)", r.config, r.tokens),
        ("sans-serif", 22),
    )?;
    type Panel = (&'static str, fn(&Metrics) -> f64);
    let panels: [Panel; 2] = [("relative L2 error", |m| m.rel_l2), ("1 − cosine", |m| 1.0 - m.cos)];
    let last = r.layers.iter().map(|l| l.layer).max().unwrap_or(0) as f64;
    for ((name, pick), area) in panels.into_iter().zip(root.split_evenly((1, 2))) {
        let series: Vec<(&str, Vec<(f64, f64)>)> = TENSORS
            .iter()
            .map(|&t| {
                let pts = r
                    .layers
                    .iter()
                    .filter_map(|l| Some((l.layer as f64, pick(find(l, &r.config, t)?))))
                    .filter(|p| p.1.is_finite() && p.1 > 0.0)
                    .collect();
                (t, pts)
            })
            .collect();
        let all: Vec<f64> = series.iter().flat_map(|s| s.1.iter().map(|p| p.1)).collect();
        if all.is_empty() {
            continue;
        }
        let (lo, hi) = all.iter().fold((f64::MAX, f64::MIN), |(a, b), &v| (a.min(v), b.max(v)));
        let mut chart = ChartBuilder::on(&area)
            .caption(name, ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(60)
            .build_cartesian_2d(-0.25..last + 0.25, (lo * 0.8..hi * 1.25).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("layer")
            .x_labels(r.layers.len() + 1)
            .y_label_formatter(&|y| format!("{y:.0e}"))
            .x_label_formatter(&|x| format!("{x:.0}"))
            .label_style(("sans-serif", 13))
            .draw()?;
        for (i, (label, pts)) in series.into_iter().enumerate() {
            let c = color(i);
            let label = if label == "D" { "δ (D)" } else { label };
            chart
                .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))?
                .label(label)
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], c.stroke_width(2)));
            chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, c.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 12))
            .draw()?;
    }
    root.present()?;
    Ok(())
}
