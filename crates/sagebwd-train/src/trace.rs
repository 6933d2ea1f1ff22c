//! The attention error per layer during training (`--trace`): at each evaluation, the current weights
//! run one validation sequence's first [`TRACE_TOKENS`] tokens forward and backward on the CPU with
//! exact attention ([`crate::capture`]); for one head of every layer the run's configuration
//! (simulated bit-exactly, `sagebwd::sim`) is compared with exact f64 attention on those real Q, K,
//! V, dO: the cosine of dS, dQ and dK. With the RMS of the layer's QK-norm gains it goes into
//! `metrics.jsonl` as a `kind = "trace"` line (other readers skip its extra fields), and
//! [`plot_traces`] draws it.

use crate::backend::Attention;
use crate::capture::capture;
use crate::engine::Engine;
use crate::error::{io_err, Error, Result};
use crate::model::{Batch, Weights};
use crate::plot::{register_font, COLORS};
use crate::train::TrainConfig;
use plotters::coord::Shift;
use plotters::prelude::*;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Tokens of the traced slice (from the start of the first validation sequence).
pub const TRACE_TOKENS: usize = 256;
/// The traced query head of every layer.
pub const TRACE_HEAD: usize = 0;

/// One layer's trace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerTrace {
    pub layer: usize,
    pub ds_cos: f64,
    pub dq_cos: f64,
    pub dk_cos: f64,
    pub ds_rel_l2: f64,
    /// RMS of the QK-norm gains (None without QK-norm).
    pub q_gain_rms: Option<f64>,
    pub k_gain_rms: Option<f64>,
}

/// One `kind = "trace"` line of `metrics.jsonl`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceRecord {
    pub kind: String,
    pub step: u64,
    pub tokens_seen: u64,
    pub time: f64,
    /// The traced configuration's label.
    pub config: String,
    /// Tokens and head of the slice.
    pub tokens: usize,
    pub head: usize,
    /// Wall-clock seconds the trace took (weights download, CPU forward + backward, comparisons).
    pub seconds: f64,
    pub layers: Vec<LayerTrace>,
}

fn rms(x: &[f32]) -> Option<f64> {
    (!x.is_empty()).then(|| (x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / x.len() as f64).sqrt())
}

/// The trace of `weights` on the sequence `tokens` (inputs and targets, `n + 1` tokens or more) for the
/// configuration `config`.
pub fn trace_layers(
    model: &crate::config::ModelConfig,
    weights: Weights,
    config: &sagebwd::Config,
    tokens: &[u32],
) -> Result<Vec<LayerTrace>> {
    let n = TRACE_TOKENS.min(tokens.len().saturating_sub(1)).min(model.max_seq_len);
    if n == 0 {
        return Err(Error::Data("the trace needs at least 2 tokens".into()));
    }
    let gains: Vec<(Option<f64>, Option<f64>)> = weights
        .layers
        .iter()
        .map(|l| (rms(&l.q_norm), rms(&l.k_norm)))
        .collect();
    let batch = Batch {
        inputs: &tokens[..n],
        targets: &tokens[1..n + 1],
        batch: 1,
        seq: n,
    };
    let captured = capture(model, weights, Attention::Exact, &batch)?;
    let mut out = Vec::new();
    for (l, layer) in captured.layers.iter().enumerate() {
        let inp = layer.problem(0, Some(&[TRACE_HEAD]), n)?;
        let ex = sagebwd::reference::exact(&inp, true)?;
        let sim = sagebwd::sim::simulate(&inp, config, true)?;
        let missing = || Error::Data("attention returned no gradients although dO was given".into());
        let (eg, g) = (
            ex.grads.as_ref().ok_or_else(missing)?,
            sim.grads.as_ref().ok_or_else(missing)?,
        );
        let (ei, si) = (
            ex.inter.as_ref().ok_or_else(missing)?,
            sim.inter.as_ref().ok_or_else(missing)?,
        );
        let ds = sagebwd::metrics::compare(&si.ds, &ei.ds);
        out.push(LayerTrace {
            layer: l,
            ds_cos: ds.cos,
            dq_cos: sagebwd::metrics::cosine(&g.dq, &eg.dq),
            dk_cos: sagebwd::metrics::cosine(&g.dk, &eg.dk),
            ds_rel_l2: ds.rel_l2,
            q_gain_rms: gains[l].0,
            k_gain_rms: gains[l].1,
        });
    }
    Ok(out)
}

/// At an evaluation of a `--trace` run: traces the engine's current weights on the first validation
/// sequence and appends the record to `dir/metrics.jsonl`. Nothing for `exact` runs (nothing to
/// compare) or without validation data.
pub fn at_evaluation(
    cfg: &TrainConfig,
    engine: &dyn Engine,
    val: &[(Vec<u32>, Vec<u32>, usize)],
    dir: &Path,
    at: (u64, u64, f64),
) -> Result<()> {
    let Attention::Method { name, config } = cfg.attention_spec()? else {
        return Ok(());
    };
    let Some((inputs, targets, _)) = val.first() else {
        return Ok(());
    };
    let t0 = Instant::now();
    let seq = cfg.seq_len.min(inputs.len());
    // inputs and targets are shifted by one: the sequence is inputs[..seq] then its last target.
    let mut tokens = inputs[..seq].to_vec();
    tokens.push(targets[seq - 1]);
    let weights = engine.export()?.weights;
    let layers = trace_layers(&cfg.model, weights, &config, &tokens)?;
    let rec = TraceRecord {
        kind: "trace".into(),
        step: at.0,
        tokens_seen: at.1,
        time: at.2,
        config: name,
        tokens: TRACE_TOKENS.min(seq),
        head: TRACE_HEAD,
        seconds: t0.elapsed().as_secs_f64(),
        layers,
    };
    let path = dir.join("metrics.jsonl");
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(&path)
        .map_err(io_err(&path))?;
    writeln!(f, "{}", serde_json::to_string(&rec).expect("records serialize")).map_err(io_err(&path))
}

/// The trace records of a run directory (none for runs without `--trace`).
pub fn read_traces(dir: &Path) -> Result<Vec<TraceRecord>> {
    let path = dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
    Ok(text
        .lines()
        .filter(|l| l.contains("\"trace\""))
        .filter_map(|l| serde_json::from_str::<TraceRecord>(l).ok())
        .filter(|r| r.kind == "trace")
        .collect())
}

/// Where [`plot_traces`] draws for the loss chart `loss_chart`: `NAME-trace.EXT` beside it.
pub fn trace_chart_path(loss_chart: &Path) -> PathBuf {
    let stem = loss_chart
        .file_stem()
        .map_or("report".into(), |s| s.to_string_lossy().into_owned());
    let ext = loss_chart
        .extension()
        .map_or("png".into(), |s| s.to_string_lossy().into_owned());
    loss_chart.with_file_name(format!("{stem}-trace.{ext}"))
}

/// Draws the traces of `runs` (label, records) into `path`: 1 − cosine of dS, dQ, dK (log scale) and
/// the QK-norm gains' RMS against tokens, one line per run and layer. Returns false (and draws
/// nothing) when no run has a trace.
pub fn plot_traces(runs: &[(String, Vec<TraceRecord>)], path: &Path, title: &str) -> Result<bool> {
    if runs.iter().all(|(_, r)| r.is_empty()) {
        return Ok(false);
    }
    register_font();
    let size = (1200, 800);
    let drawn = if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("svg")) {
        draw(SVGBackend::new(path, size).into_drawing_area(), runs, title)
    } else {
        draw(BitMapBackend::new(path, size).into_drawing_area(), runs, title)
    };
    drawn.map_err(|e| Error::Data(format!("{}: cannot draw the trace: {e}", path.display())))?;
    Ok(true)
}

type DrawResult = std::result::Result<(), Box<dyn std::error::Error>>;

/// The value a panel shows of one layer's trace.
type Pick = fn(&LayerTrace) -> Option<f64>;

fn color(i: usize) -> RGBColor {
    if i < COLORS.len() {
        COLORS[i]
    } else {
        let (r, g, b) = Palette99::pick(i).rgb();
        RGBColor(r, g, b)
    }
}

fn points(recs: &[TraceRecord], layer: usize, f: Pick, log: bool) -> Vec<(f64, f64)> {
    recs.iter()
        .filter_map(|r| Some((r.tokens_seen as f64, f(r.layers.get(layer)?)?)))
        .filter(|p| p.1.is_finite() && (!log || p.1 > 0.0))
        .collect()
}

/// One line per run and layer (a dashed second line from `dashed`, when given).
fn draw_lines<DB, CT>(
    chart: &mut ChartContext<'_, DB, CT>,
    runs: &[(String, Vec<TraceRecord>)],
    pick: Pick,
    dashed: Option<Pick>,
    log: bool,
) -> DrawResult
where
    DB: DrawingBackend,
    DB::ErrorType: 'static,
    CT: CoordTranslate<From = (f64, f64)>,
{
    let mut index = 0;
    for (label, recs) in runs {
        let n_layers = recs.iter().map(|r| r.layers.len()).max().unwrap_or(0);
        for l in 0..n_layers {
            let c = color(index);
            index += 1;
            chart
                .draw_series(LineSeries::new(points(recs, l, pick, log), c.stroke_width(2)))?
                .label(format!("{label} layer {l}"))
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], c.stroke_width(2)));
            if let Some(d) = dashed {
                chart.draw_series(DashedLineSeries::new(points(recs, l, d, log), 6, 4, c.stroke_width(2)))?;
            }
        }
    }
    Ok(())
}

fn draw<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    runs: &[(String, Vec<TraceRecord>)],
    title: &str,
) -> DrawResult
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 22))?;
    let k_gain: Pick = |t| t.k_gain_rms;
    let panels: [(&str, Pick, bool); 4] = [
        ("1 − cos dS", |t| Some(1.0 - t.ds_cos), true),
        ("1 − cos dQ", |t| Some(1.0 - t.dq_cos), true),
        ("1 − cos dK", |t| Some(1.0 - t.dk_cos), true),
        ("QK-norm gain RMS (q solid, k dashed)", |t| t.q_gain_rms, false),
    ];
    let x_max = runs
        .iter()
        .flat_map(|(_, r)| r.iter().map(|t| t.tokens_seen))
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    let lines: usize = runs
        .iter()
        .map(|(_, r)| r.iter().map(|t| t.layers.len()).max().unwrap_or(0))
        .sum();
    for ((name, pick, log), area) in panels.into_iter().zip(root.split_evenly((2, 2))) {
        let mut values: Vec<f64> = Vec::new();
        for t in runs.iter().flat_map(|(_, recs)| recs.iter().flat_map(|r| &r.layers)) {
            values.extend(pick(t));
            if !log {
                values.extend(k_gain(t));
            }
        }
        values.retain(|v| v.is_finite() && (!log || *v > 0.0));
        if values.is_empty() {
            continue;
        }
        let (lo, hi) = values
            .iter()
            .fold((f64::MAX, f64::MIN), |(a, b), &v| (a.min(v), b.max(v)));
        let mut builder = ChartBuilder::on(&area);
        builder
            .caption(name, ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(60);
        if log {
            let mut chart = builder.build_cartesian_2d(0.0..x_max, (lo * 0.8..hi * 1.25).log_scale())?;
            chart
                .configure_mesh()
                .x_desc("tokens")
                .x_label_formatter(&|x| crate::plot::human_count(*x))
                .y_label_formatter(&|y| format!("{y:.0e}"))
                .label_style(("sans-serif", 13))
                .draw()?;
            draw_lines(&mut chart, runs, pick, None, true)?;
            if name.ends_with("dS") && lines <= 16 {
                chart
                    .configure_series_labels()
                    .position(SeriesLabelPosition::UpperRight)
                    .background_style(WHITE.mix(0.85))
                    .border_style(BLACK)
                    .label_font(("sans-serif", 11))
                    .draw()?;
            }
        } else {
            let pad = ((hi - lo) * 0.1).max(1e-3);
            let mut chart = builder.build_cartesian_2d(0.0..x_max, (lo - pad)..(hi + pad))?;
            chart
                .configure_mesh()
                .x_desc("tokens")
                .x_label_formatter(&|x| crate::plot::human_count(*x))
                .label_style(("sans-serif", 13))
                .draw()?;
            draw_lines(&mut chart, runs, pick, Some(k_gain), false)?;
        }
    }
    root.present()?;
    Ok(())
}
