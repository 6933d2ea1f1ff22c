//! Loss curves of one or more runs in one chart (PNG or SVG by the file extension). Text is drawn
//! with the DejaVu Sans font compiled into the binary, so no system fonts are needed.

use crate::error::{Error, Result};
use crate::metrics::Record;
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::Path;
use std::sync::Once;

/// One run's curves: training loss per step and validation loss, against tokens seen.
pub struct Curve {
    pub label: String,
    pub records: Vec<Record>,
}

/// Registers the embedded DejaVu Sans as plotters' "sans-serif" (idempotent).
pub fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The font is a valid TrueType file shipped by the `dejavu` crate.
        let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, dejavu::sans::regular());
    });
}

/// The palette of every chart the project draws.
pub const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

/// Draws every curve into `path` (`.png` or `.svg`).
/// The chart is drawn into a temporary file renamed over `path` (see [`crate::output`]): a failed plot
/// leaves an existing chart untouched, and a device node or directory at `path` is refused.
pub fn plot_losses(curves: &[Curve], path: &Path, title: &str) -> Result<()> {
    register_font();
    crate::output::resolve_target(path)?;
    let size = (1000, 600);
    let ext = path.extension().map(|e| e.to_string_lossy().to_ascii_lowercase());
    let is_svg = match ext.as_deref() {
        Some("svg") => true,
        Some("png") => false,
        other => {
            return Err(Error::Plot(format!(
                "{}: the chart's file name must end in .png or .svg (got {})",
                path.display(),
                other.map_or("no extension".into(), |e| format!(".{e}"))
            )))
        }
    };
    let finite = curves
        .iter()
        .flat_map(|c| &c.records)
        .any(|r| r.loss.or(r.val_loss).is_some_and(f64::is_finite));
    if !finite {
        let names: Vec<&str> = curves.iter().map(|c| c.label.as_str()).collect();
        return Err(Error::Plot(format!(
            "{}: no finite losses to plot in the runs {}; the file was not written",
            path.display(),
            names.join(", ")
        )));
    }
    crate::output::write_with(path, |tmp| {
        let result = if is_svg {
            draw(SVGBackend::new(tmp, size).into_drawing_area(), curves, title)
        } else {
            draw(BitMapBackend::new(tmp, size).into_drawing_area(), curves, title)
        };
        result.map_err(|e| Error::Plot(format!("{}: cannot draw the chart: {e}", path.display())))
    })
}

type DrawResult = std::result::Result<(), Box<dyn std::error::Error>>;

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, curves: &[Curve], title: &str) -> DrawResult
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let train = |c: &Curve| -> Vec<(f64, f64)> {
        c.records
            .iter()
            .filter(|r| r.kind == "train")
            .filter_map(|r| Some((r.tokens_seen as f64, r.loss?)))
            .collect()
    };
    let val = |c: &Curve| -> Vec<(f64, f64)> {
        c.records
            .iter()
            .filter(|r| r.kind == "val")
            .filter_map(|r| Some((r.tokens_seen as f64, r.val_loss?)))
            .collect()
    };
    let all: Vec<(f64, f64)> = curves
        .iter()
        .flat_map(|c| train(c).into_iter().chain(val(c)))
        .filter(|p| p.1.is_finite())
        .collect();
    if all.is_empty() {
        return Err("no finite losses to plot".into());
    }
    let x_max = all.iter().map(|p| p.0).fold(1.0, f64::max);
    let y_min = all.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    // The first steps sit near ln(vocab); cap the axis so the interesting part is visible.
    let y_max = all
        .iter()
        .map(|p| p.1)
        .fold(f64::NEG_INFINITY, f64::max)
        .min(y_min + 6.0);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 24))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x_max, (y_min - 0.1)..(y_max + 0.1))?;
    chart
        .configure_mesh()
        .x_desc("tokens seen")
        .y_desc("loss (nats/token)")
        .x_label_formatter(&|x| human_count(*x))
        .y_label_formatter(&|y| format!("{y:.1}"))
        .label_style(("sans-serif", 15))
        .draw()?;
    for (i, c) in curves.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        // Per-step losses, lightly smoothed (a trailing mean of 5 steps) so that curves that lie on
        // top of each other stay distinguishable; validation points are exact.
        let pts = smooth(&train(c), 5);
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))?
            .label(format!("{} train", c.label))
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color.stroke_width(2)));
        let v = val(c);
        chart
            .draw_series(v.iter().map(|&p| Circle::new(p, 5, color.filled())))?
            .label(format!("{} validation", c.label))
            .legend(move |(x, y)| Circle::new((x + 10, y), 5, color.filled()));
        chart.draw_series(LineSeries::new(v, color.stroke_width(1)))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .draw()?;
    root.present()?;
    Ok(())
}

/// `12000` → `12k`, `3500000` → `3.5M`.
pub(crate) fn human_count(x: f64) -> String {
    let trim = |s: String| s.trim_end_matches(".0").to_string();
    if x.abs() >= 1e9 {
        trim(format!("{:.1}", x / 1e9)) + "G"
    } else if x.abs() >= 1e6 {
        trim(format!("{:.1}", x / 1e6)) + "M"
    } else if x.abs() >= 1e3 {
        trim(format!("{:.1}", x / 1e3)) + "k"
    } else {
        format!("{x:.0}")
    }
}

/// Trailing moving average over `window` points (training loss is noisy per step).
fn smooth(pts: &[(f64, f64)], window: usize) -> Vec<(f64, f64)> {
    (0..pts.len())
        .map(|i| {
            let lo = (i + 1).saturating_sub(window);
            let ys = &pts[lo..=i];
            (pts[i].0, ys.iter().map(|p| p.1).sum::<f64>() / ys.len() as f64)
        })
        .filter(|p| p.1.is_finite())
        .collect()
}
