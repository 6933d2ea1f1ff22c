//! `sagebwd train`: pre-train a Llama-style model with SageBwd (or exact / FlashAttention-like)
//! attention. With no arguments: the `tiny` model on the built-in sample, `fpa` then `sagebwd`, and a
//! plot of both loss curves.

use crate::args::DeviceArg;
use anyhow::{bail, Context, Result};
use clap::Args;
use sagebwd_train::config::ModelConfig;
use sagebwd_train::data::{decode_text, split_documents, tokenize_documents, tokenize_files, SplitTokens};
use sagebwd_train::metrics::read_records;
use sagebwd_train::optim::AdamWConfig;
use sagebwd_train::plot::{plot_losses, Curve};
use sagebwd_train::shards::{read_shard, read_shard_dir};
use sagebwd_train::tokenizer::Tokenizer;
use sagebwd_train::train::{train, Corpus, DeviceChoice, RunOptions, RunSummary, TrainConfig};
use sagebwd_train::{sample, Error as TrainError};
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct TrainArgs {
    /// Training data: text files (.txt, .xz, .zst; documents separated by RS 0x1E), token shards
    /// (.bin) or directories of shards from `sagebwd tokenize`. Default: the built-in sample
    /// (12 public-domain books).
    #[arg(value_name = "DATA")]
    pub data: Vec<PathBuf>,
    /// Validation data (same kinds). Default: every document with index % --val-every == 1 of the
    /// text inputs, plus the val shards of shard directories.
    #[arg(long, value_name = "DATA")]
    pub val: Vec<PathBuf>,
    /// Document-level split of text inputs: document i is validation iff i % N == 1.
    #[arg(long, default_value_t = 10, value_name = "N")]
    pub val_every: usize,
    /// Attention: fpa, sagebwd, int8-all, exact; several (comma-separated) train one run each. The
    /// method flags below (--int8, --bf16, --smooth-k, ...) apply to every listed preset but exact;
    /// each run is named RUNS_DIR/NAME-LABEL by its configuration's label (e.g. sagebwd-smoothK).
    #[arg(long, value_delimiter = ',', default_value = "fpa,sagebwd")]
    pub preset: Vec<String>,
    #[command(flatten)]
    pub method: crate::method_args::MethodFlags,
    /// At each evaluation, also trace the attention error per layer (dS, dQ, dK cosine of the run's
    /// configuration against exact f64 attention, one head of the first 256 tokens of one validation
    /// sequence, on the CPU) and the QK-norm gains' RMS into metrics.jsonl; `report` draws them.
    #[arg(long)]
    pub trace: bool,
    /// Model size: tiny (~3.4M with the GPT-2 embedding, 0.2M in the blocks), small (~30M),
    /// base (~124M), medium (~360M). Default: tiny; on a GPU, with the built-in sample and none of
    /// --model, --seq, --batch, --steps given, the sample's GPU run (see --steps).
    #[arg(long)]
    pub model: Option<String>,
    /// Override the model width.
    #[arg(long)]
    pub dim: Option<usize>,
    /// Override the number of layers.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Override the number of query heads.
    #[arg(long)]
    pub heads: Option<usize>,
    /// Key/value heads (grouped-query attention); default: as many as query heads.
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Override the SwiGLU hidden width.
    #[arg(long)]
    pub ffn: Option<usize>,
    /// Turn QK-norm off (it is on by default: the second paper found it necessary for SageBwd).
    #[arg(long)]
    pub no_qk_norm: bool,
    /// Untie the LM head from the token embedding.
    #[arg(long)]
    pub untied: bool,
    /// Sequence length [default: 128; the sample's GPU run: 512].
    #[arg(long)]
    pub seq: Option<usize>,
    /// Sequences per micro-batch [default: 4; the sample's GPU run: 8].
    #[arg(long)]
    pub batch: Option<usize>,
    /// Micro-batches accumulated per optimizer step (tokens per step = batch × seq × accum × gpus).
    #[arg(long, default_value_t = 1)]
    pub accum: usize,
    /// GPUs to train on, data parallel: each takes `--batch` sequences of every micro-step and the
    /// gradients are summed with NCCL (needs `libnccl.so` on LD_LIBRARY_PATH when above 1).
    #[arg(long, default_value_t = 1)]
    pub gpus: usize,
    /// Optimizer steps [default: 200]. On a GPU, the built-in sample with none of --model, --seq,
    /// --batch, --steps trains `small` at sequence 512, 8 sequences per step, 500 steps (2M tokens,
    /// about 2.5 passes over the sample's training books): the tiny model's curves stop near 6.4
    /// nats within seconds there and say nothing.
    #[arg(long)]
    pub steps: Option<u64>,
    /// Peak learning rate; default by model size: tiny 5e-3, small 2e-3, base 6e-4, medium 3e-4.
    #[arg(long)]
    pub lr: Option<f32>,
    /// Final learning rate of the cosine decay; default lr / 10.
    #[arg(long)]
    pub min_lr: Option<f32>,
    /// Warmup steps [default: 20; the sample's GPU run: 25].
    #[arg(long)]
    pub warmup: Option<u64>,
    /// AdamW weight decay (matrices only).
    #[arg(long, default_value_t = 0.1)]
    pub wd: f32,
    /// Largest global gradient norm (0: off).
    #[arg(long, default_value_t = 1.0)]
    pub clip: f32,
    /// Evaluate the validation loss every N steps (and at the end).
    #[arg(long, default_value_t = 50)]
    pub eval_every: u64,
    /// Validation tokens per evaluation.
    #[arg(long, default_value_t = 8192)]
    pub eval_tokens: usize,
    /// Write a checkpoint every N steps (and at the end).
    #[arg(long, default_value_t = 100)]
    pub ckpt_every: u64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Run name: runs go to RUNS_DIR/NAME-PRESET. Default: `sample` on the built-in data, else `run`.
    #[arg(long)]
    pub name: Option<String>,
    /// Directory holding run directories.
    #[arg(long, default_value = "runs")]
    pub runs_dir: PathBuf,
    /// Continue the runs from their checkpoints (losses continue exactly). The checkpoint's tensors and
    /// metadata are verified (CRC32), and every setting that differs from the recorded run is listed;
    /// those that change the run (data, model, attention, seed, batch, learning-rate schedule, steps,
    /// optimizer) are refused unless --force-resume. A preset without a checkpoint starts from step 0.
    #[arg(long, conflicts_with = "overwrite")]
    pub resume: bool,
    /// With --resume: continue even with settings that change the run's meaning (the run's
    /// config.json then records the new settings).
    #[arg(long, requires = "resume")]
    pub force_resume: bool,
    /// Replace a run already in RUNS_DIR/NAME-PRESET: its run files (config.json, metrics.jsonl,
    /// checkpoint, summary.json, loss.png) are removed first. Without it (or --resume) a used run
    /// directory is refused.
    #[arg(long)]
    pub overwrite: bool,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Where to train: auto (the GPU when one is usable, else the CPU with a note saying why), cpu,
    /// cuda. The GPU needs head dimension 64 or 128 and a preset other than `exact`.
    #[arg(long, value_enum, default_value = "auto")]
    pub device: DeviceArg,
}

/// Peak dense BF16 tensor throughput used for MFU, FLOP/s (H100/H200 SXM datasheet; PERFORMANCE.md).
const HOPPER_BF16_PEAK: f64 = 989e12;

/// The size of a run: the model and how many tokens it sees, from the arguments and the defaults.
struct RunSize {
    model: String,
    seq: usize,
    batch: usize,
    steps: u64,
    warmup: u64,
}

/// The values of [`RunSize`] that the arguments leave open.
struct SizeDefaults {
    model: &'static str,
    seq: usize,
    batch: usize,
    steps: u64,
    warmup: u64,
}

/// The defaults everywhere but the sample's GPU run.
const GENERAL: SizeDefaults = SizeDefaults {
    model: "tiny",
    seq: 128,
    batch: 4,
    steps: 200,
    warmup: 20,
};

/// The built-in sample on a GPU (`--steps`' help says why).
const SAMPLE_GPU: SizeDefaults = SizeDefaults {
    model: "small",
    seq: 512,
    batch: 8,
    steps: 500,
    warmup: 25,
};

impl RunSize {
    fn of(a: &TrainArgs) -> RunSize {
        let untouched = a.model.is_none() && a.seq.is_none() && a.batch.is_none() && a.steps.is_none();
        let exact = a.preset.iter().any(|p| p.trim().eq_ignore_ascii_case("exact")); // the CPU's reference
        let gpu_sample =
            a.data.is_empty() && untouched && !exact && a.device != DeviceArg::Cpu && a.gpus == 1 && sample_gpu(a);
        let d = if gpu_sample { &SAMPLE_GPU } else { &GENERAL };
        RunSize {
            model: a.model.clone().unwrap_or_else(|| d.model.into()),
            seq: a.seq.unwrap_or(d.seq),
            batch: a.batch.unwrap_or(d.batch),
            steps: a.steps.unwrap_or(d.steps),
            warmup: a.warmup.unwrap_or(d.warmup),
        }
    }
}

/// Whether the sample's GPU run applies: a GPU that can train is there (with `--device auto`, where it is not the
/// run stays the CPU's, and the engine says why).
fn sample_gpu(a: &TrainArgs) -> bool {
    match sagebwd_train::gpu::probe() {
        Ok(device) => {
            let d = &SAMPLE_GPU;
            eprintln!(
                "{device}: the built-in sample's GPU run ({} model, sequence {}, {} steps; --model/--seq/--batch/--steps \
                 choose another)",
                d.model, d.seq, d.steps
            );
            true
        }
        // --device cuda without a usable GPU fails in the engine, with the reason
        Err(_) => a.device == DeviceArg::Cuda,
    }
}

pub fn run(a: TrainArgs) -> Result<()> {
    if let Some(n) = a.threads {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()
            .context("--threads")?;
    }
    let size = RunSize::of(&a);
    // Every preset's configuration is checked before the first run starts (and before the data is read).
    let configs = a
        .preset
        .iter()
        .map(|p| train_config(&a, &size, p).with_context(|| format!("--preset {p}")))
        .collect::<Result<Vec<_>>>()?;
    let name = a.name.clone().unwrap_or_else(|| {
        if a.data.is_empty() {
            "sample".into()
        } else {
            "run".into()
        }
    });
    if name.is_empty() || name.contains('/') || name == "." || name == ".." {
        bail!("--name must be a plain name (no '/'), got {name:?}");
    }
    let mut seen = std::collections::HashSet::new();
    if let Some(dup) = configs.iter().find(|c| !seen.insert(c.attention.clone())) {
        bail!(
            "--preset lists {} twice: both runs would share one run directory",
            dup.attention
        );
    }
    let corpus = load_corpus(&a)?;
    let mut summaries = Vec::new();
    for cfg in configs {
        let dir = a
            .runs_dir
            .join(format!("{name}-{}", sagebwd_train::method::file_label(&cfg.attention)));
        eprintln!("\n== {} → {}", cfg.attention, dir.display());
        if let Some(c) = &cfg.method {
            eprintln!("attention: {}", crate::args::describe(c));
            if a.device != DeviceArg::Cpu {
                if let Some(w) = sagebwd_train::method::kernel_warning(c) {
                    eprintln!("note: {w}");
                }
            }
        }
        let device = match a.device {
            DeviceArg::Auto => DeviceChoice::Auto,
            DeviceArg::Cpu => DeviceChoice::Cpu,
            DeviceArg::Cuda => DeviceChoice::Cuda,
        };
        let opts = RunOptions {
            dir,
            resume: a.resume,
            overwrite: a.overwrite,
            force_resume: a.force_resume,
            progress: true,
            stop_after: None,
            device,
        };
        let s = train(&cfg, &corpus, &opts)?;
        eprintln!("{}", summary_line(&s));
        summaries.push(s);
    }
    let plot = if summaries.len() > 1 {
        a.runs_dir.join(format!("{name}-compare.png"))
    } else {
        summaries[0].dir.join("loss.png")
    };
    let curves: Vec<Curve> = summaries
        .iter()
        .map(|s| {
            Ok(Curve {
                label: s.attention.clone(),
                records: read_records(&s.dir)?,
            })
        })
        .collect::<std::result::Result<_, TrainError>>()?;
    let on = if summaries[0].device.starts_with("cpu") {
        "CPU"
    } else {
        "GPU"
    };
    plot_losses(
        &curves,
        &plot,
        &format!("{name}: loss vs tokens ({} model, {on})", size.model),
    )?;
    println!(
        "{}",
        crate::report::table(&summaries.iter().map(|s| s.dir.clone()).collect::<Vec<_>>())?
    );
    for line in gaps(&summaries) {
        println!("{line}");
    }
    println!("loss curves: {}", plot.display());
    let dirs: Vec<PathBuf> = summaries.iter().map(|s| s.dir.clone()).collect();
    if let Some(trace) = crate::report::draw_traces(&dirs, &plot, &name)? {
        println!("attention error per layer: {}", trace.display());
    }
    Ok(())
}

fn summary_line(s: &RunSummary) -> String {
    let val = match (s.final_val_loss, s.final_val_bpb) {
        (Some(l), Some(b)) => format!(", validation loss {l:.4} ({b:.3} bits/byte)"),
        _ => String::new(),
    };
    let model_flops = s.tokens_per_second * s.flops_per_token;
    let mfu = if s.device.contains("H100") || s.device.contains("H200") {
        let peak = HOPPER_BF16_PEAK * s.gpus.max(1) as f64;
        let per = if s.gpus > 1 {
            format!(" ({} GPUs × {:.0})", s.gpus, HOPPER_BF16_PEAK / 1e12)
        } else {
            String::new()
        };
        let steady = s.steady_tokens_per_second.map_or(String::new(), |r| {
            format!(" (steady {:.1} %)", 100.0 * r * s.flops_per_token / peak)
        });
        format!(
            ", MFU {:.1} %{steady} of {:.0} TFLOP/s{per}",
            100.0 * model_flops / peak,
            peak / 1e12
        )
    } else {
        String::new()
    };
    let memory = s.peak_memory.map_or(String::new(), |m| {
        format!(", peak memory {:.2} GiB", m as f64 / (1u64 << 30) as f64)
    });
    // Board energy (NVML) over the same steady steps: tokens per joule is the cost figure.
    let energy = match (s.steady_joules_per_token, s.steady_board_watts) {
        (Some(j), Some(w)) if j > 0.0 => format!(", {:.0} tokens/J at {w:.0} W board (steady)", 1.0 / j),
        _ => String::new(),
    };
    // Steady state: the median step after the first 3 (warm-up: kernel loading, product planning).
    let steady = s
        .steady_tokens_per_second
        .map_or(String::new(), |r| format!(", steady {r:.0}"));
    format!(
        "{}: {} steps, {} tokens in {:.0} s of training steps ({:.0} tokens/s{steady}, {:.1} model TFLOP/s{mfu}{memory}{energy}), last step's train loss {:.4}{val}",
        s.attention,
        s.steps,
        s.tokens_seen,
        s.seconds,
        s.tokens_per_second,
        model_flops / 1e12,
        s.final_train_loss
    )
}

/// Each run against the `fpa` run of the same invocation: the validation-loss gap (or, without validation, the last
/// train loss's) and the throughput ratio. Empty without an `fpa` run.
fn gaps(summaries: &[RunSummary]) -> Vec<String> {
    let Some(base) = summaries.iter().find(|s| s.attention == "fpa") else {
        return Vec::new();
    };
    let rate = |s: &RunSummary| s.steady_tokens_per_second.unwrap_or(s.tokens_per_second);
    summaries
        .iter()
        .filter(|s| s.attention != "fpa")
        .map(|s| {
            let (what, ours, theirs) = match (s.final_val_loss, base.final_val_loss) {
                (Some(x), Some(y)) => ("validation loss", x, y),
                _ => ("last train loss", s.final_train_loss, base.final_train_loss),
            };
            format!(
                "{} vs fpa: {what} {:+.4} nats ({:+.2} %), {:.2}x the tokens/s",
                s.attention,
                ours - theirs,
                100.0 * (ours - theirs) / theirs,
                rate(s) / rate(base)
            )
        })
        .collect()
}

fn train_config(a: &TrainArgs, size: &RunSize, preset: &str) -> Result<TrainConfig> {
    sagebwd_train::backend::Attention::parse(preset.trim().to_ascii_lowercase().as_str())?;
    let mut model = ModelConfig::preset(&size.model)?;
    model.dim = a.dim.unwrap_or(model.dim);
    model.n_layers = a.layers.unwrap_or(model.n_layers);
    model.n_heads = a.heads.unwrap_or(model.n_heads);
    model.n_kv_heads = a.kv_heads.unwrap_or(model.n_heads);
    model.ffn_hidden = a.ffn.unwrap_or(model.ffn_hidden);
    model.qk_norm = !a.no_qk_norm;
    model.tied_embeddings = !a.untied;
    model.max_seq_len = model.max_seq_len.max(size.seq);
    let lr = a.lr.unwrap_or(match size.model.trim().to_ascii_lowercase().as_str() {
        "tiny" => 5e-3,
        "small" => 2e-3,
        "base" => 6e-4,
        _ => 3e-4,
    });
    let method = a.method.config(preset)?;
    let cfg = TrainConfig {
        model,
        attention: method
            .as_ref()
            .map_or_else(|| preset.trim().to_ascii_lowercase(), sagebwd_train::method::run_label),
        method,
        trace: a.trace,
        seq_len: size.seq,
        micro_batch: size.batch,
        grad_accum: a.accum,
        steps: size.steps,
        lr,
        min_lr: a.min_lr.unwrap_or(lr / 10.0),
        warmup: size.warmup,
        adamw: AdamWConfig {
            weight_decay: a.wd,
            ..Default::default()
        },
        grad_clip: a.clip,
        eval_every: a.eval_every,
        eval_tokens: a.eval_tokens,
        checkpoint_every: a.ckpt_every,
        seed: a.seed,
        gpus: a.gpus,
    };
    cfg.validate()?;
    Ok(cfg)
}

/// Training and validation tokens from the arguments (or the built-in sample).
fn load_corpus(a: &TrainArgs) -> Result<Corpus> {
    let tok = Tokenizer::gpt2();
    let token_bytes = tok.token_byte_lengths(sagebwd_train::config::GPT2_VOCAB);
    if a.data.is_empty() {
        let text = decode_text(sample::SAMPLE_FILE, sample::SAMPLE_XZ)?;
        let docs = split_documents(&text);
        let s = tokenize_documents(&docs, a.val_every);
        let description = format!(
            "{} ({} training / {} validation books)",
            sample::SAMPLE_NAME,
            s.train_docs,
            s.val_docs
        );
        return Ok(Corpus {
            train: s.train,
            val: s.val,
            token_bytes,
            description,
        });
    }
    let (mut train, mut val) = read_inputs(&a.data, a.val_every)?;
    if !a.val.is_empty() {
        let (v_train, v_val) = read_inputs(&a.val, 0)?;
        val = [v_train, v_val].concat();
    }
    if train.is_empty() {
        bail!("the training data is empty: no tokens in {}", list(&a.data));
    }
    if val.is_empty() {
        eprintln!("note: no validation tokens (give --val, or more documents than --val-every); validation is skipped");
    }
    let description = list(&a.data);
    train.shrink_to_fit();
    Ok(Corpus {
        train,
        val,
        token_bytes,
        description,
    })
}

fn list(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Reads text files (tokenized and split), shard files and shard directories.
pub(crate) fn read_inputs(paths: &[PathBuf], val_every: usize) -> Result<(Vec<u16>, Vec<u16>)> {
    let (mut train, mut val) = (Vec::new(), Vec::new());
    let mut texts: Vec<&Path> = Vec::new();
    for p in paths {
        if p.is_dir() {
            let (t, v) = read_shard_dir(p)?;
            train.extend(t);
            val.extend(v);
        } else if p.extension().is_some_and(|e| e == "bin") {
            train.extend(read_shard(p)?);
        } else if p.exists() {
            texts.push(p);
        } else {
            bail!("{}: no such file or directory", p.display());
        }
    }
    if !texts.is_empty() {
        let SplitTokens {
            train: t,
            val: v,
            train_bytes,
            val_bytes,
            ..
        } = tokenize_files(&texts, val_every)?;
        if train_bytes + val_bytes == 0 {
            bail!(
                "the corpus is empty: no text in {}",
                texts
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        train.extend(t);
        val.extend(v);
    }
    Ok((train, val))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(joules_per_token: Option<f64>) -> RunSummary {
        RunSummary {
            dir: "runs/x".into(),
            attention: "sagebwd".into(),
            method: None,
            steps: 500,
            tokens_seen: 8_192_000,
            final_train_loss: 4.0412,
            final_val_loss: None,
            final_val_bpb: None,
            seconds: 20.0,
            tokens_per_second: 410_000.0,
            steady_tokens_per_second: Some(410_761.0),
            steady_joules_per_token: joules_per_token,
            steady_board_watts: joules_per_token.map(|_| 676.0),
            device: "NVIDIA H200".into(),
            peak_memory: None,
            flops_per_token: 0.0,
            gpus: 1,
        }
    }

    #[test]
    fn gaps_compare_each_run_with_fpa() {
        let mut fpa = summary(None);
        fpa.attention = "fpa".into();
        fpa.final_val_loss = Some(4.0);
        fpa.steady_tokens_per_second = Some(400_000.0);
        let mut sage = summary(None);
        sage.final_val_loss = Some(4.02);
        sage.steady_tokens_per_second = Some(500_000.0);
        let lines = gaps(&[fpa.clone(), sage.clone()]);
        assert_eq!(
            lines,
            ["sagebwd vs fpa: validation loss +0.0200 nats (+0.50 %), 1.25x the tokens/s"]
        );
        sage.final_val_loss = None;
        assert!(gaps(&[fpa, sage.clone()])[0].contains("last train loss +0.0000"));
        assert!(gaps(&[sage]).is_empty());
    }

    #[test]
    fn summary_shows_tokens_per_joule_when_the_engine_measured_energy() {
        let line = summary_line(&summary(Some(676.0 / 410_761.0)));
        assert!(line.contains("steady 410761"), "{line}");
        assert!(line.contains(", 608 tokens/J at 676 W board (steady))"), "{line}");
        assert!(!summary_line(&summary(None)).contains("tokens/J"));
    }
}
