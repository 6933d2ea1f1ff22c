//! `sagebwd report RUN...`: the loss curves of several runs in one chart, and a table of their final
//! losses.

use anyhow::{bail, Result};
use clap::Args;
use sagebwd_train::metrics::{read_records, Record};
use sagebwd_train::plot::{plot_losses, Curve};
use sagebwd_train::train::{read_config, read_summary};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// Run directories (each holds metrics.jsonl and config.json).
    #[arg(value_name = "RUN", required = true)]
    pub runs: Vec<PathBuf>,
    /// Output chart, .png or .svg. Default: report.png next to the first run.
    #[arg(short, long)]
    pub output: Option<PathBuf>,
    /// Chart title.
    #[arg(long, default_value = "loss vs tokens")]
    pub title: String,
}

pub fn run(a: ReportArgs) -> Result<()> {
    let mut curves = Vec::new();
    for dir in &a.runs {
        if !dir.join("metrics.jsonl").exists() {
            bail!("{}: not a run directory (no metrics.jsonl)", dir.display());
        }
        curves.push(Curve {
            label: label(dir),
            records: read_records(dir)?,
        });
    }
    let out = a.output.clone().unwrap_or_else(|| {
        a.runs[0]
            .parent()
            .unwrap_or(std::path::Path::new("."))
            .join("report.png")
    });
    plot_losses(&curves, &out, &a.title)?;
    println!("{}", table(&a.runs)?);
    println!("loss curves: {}", out.display());
    if let Some(trace) = draw_traces(&a.runs, &out, &a.title)? {
        println!("attention error per layer: {}", trace.display());
    }
    Ok(())
}

/// The per-layer attention traces of `runs` (those trained with `--trace`), drawn beside the loss
/// chart `out`; None when no run has one.
pub fn draw_traces(runs: &[PathBuf], out: &std::path::Path, title: &str) -> Result<Option<PathBuf>> {
    use sagebwd_train::trace::{plot_traces, read_traces, trace_chart_path};
    let traces = runs
        .iter()
        .map(|d| Ok((label(d), read_traces(d)?)))
        .collect::<Result<Vec<_>>>()?;
    let path = trace_chart_path(out);
    let title =
        format!("{title}: attention error per layer vs exact f64 (one head, first tokens of a validation sequence)");
    Ok(plot_traces(&traces, &path, &title)?.then_some(path))
}

fn label(dir: &std::path::Path) -> String {
    dir.file_name()
        .map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned())
}

/// A text table of each run's attention, tokens per step, steps, final losses and, from its `summary.json`
/// (the last training session's), steady tokens/s and tokens per joule of board energy (GPU runs).
pub fn table(runs: &[PathBuf]) -> Result<String> {
    let mut out = format!(
        "{:<24} {:>16} {:>9} {:>6} {:>11} {:>10} {:>9} {:>8} {:>9} {:>6}\n",
        "run", "attention", "tok/step", "steps", "tokens", "train loss*", "val loss", "val bpb", "tok/s", "tok/J"
    );
    for dir in runs {
        let records = read_records(dir)?;
        let cfg = read_config(dir).ok();
        let summary = read_summary(dir).ok();
        let last = |f: fn(&Record) -> Option<f64>| records.iter().rev().find_map(f);
        let fmt = |v: Option<f64>, p: usize| v.map_or("-".to_string(), |x| format!("{x:.p$}"));
        let rate = summary
            .as_ref()
            .map(|s| s.steady_tokens_per_second.unwrap_or(s.tokens_per_second));
        let per_joule = summary
            .as_ref()
            .and_then(|s| s.steady_joules_per_token)
            .filter(|j| *j > 0.0)
            .map(|j| 1.0 / j);
        out += &format!(
            "{:<24} {:>16} {:>9} {:>6} {:>11} {:>10} {:>9} {:>8} {:>9} {:>6}\n",
            label(dir),
            cfg.as_ref().map_or("?".into(), |c| c.attention.clone()),
            cfg.as_ref().map_or("?".into(), |c| c.tokens_per_step().to_string()),
            records.iter().filter(|r| r.kind == "train").count(),
            records.last().map_or(0, |r| r.tokens_seen),
            // the mean of the last 10 steps: one step's loss is noisy
            fmt(mean_last_train(&records, 10), 4),
            fmt(last(|r| r.val_loss), 4),
            fmt(last(|r| r.val_bpb), 3),
            fmt(rate, 0),
            fmt(per_joule, 0),
        );
    }
    out += "* train loss: the mean of the last 10 steps' losses (one step's loss is noisy; the run summary's \"last step's train loss\" is the final step alone)";
    Ok(out.trim_end().to_string())
}

fn mean_last_train(records: &[Record], n: usize) -> Option<f64> {
    let losses: Vec<f64> = records
        .iter()
        .filter(|r| r.kind == "train")
        .filter_map(|r| r.loss)
        .collect();
    let tail = &losses[losses.len().saturating_sub(n)..];
    (!tail.is_empty()).then(|| tail.iter().sum::<f64>() / tail.len() as f64)
}
