//! `sagebwd accuracy --plot`: relative L2 error of O, dQ, dK, dV against σ, one panel per tensor and
//! one line per configuration (so an `--isolate` run shows at a glance which product hurts where).

use anyhow::{anyhow, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use sagebwd_train::plot::{register_font, COLORS};
use std::path::Path;

const PANELS: [&str; 4] = ["O", "dQ", "dK", "dV"];

/// One configuration's errors: `(tensor, σ, relative L2)` points.
pub struct Series {
    pub label: String,
    pub points: Vec<(&'static str, f32, f64)>,
}

/// Draws the panels into `path` (`.png` or `.svg`).
pub fn plot(series: &[Series], path: &Path, title: &str) -> Result<()> {
    register_font();
    let size = (1200, 800);
    let svg = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("svg"));
    let drawn = if svg {
        draw(SVGBackend::new(path, size).into_drawing_area(), series, title)
    } else {
        draw(BitMapBackend::new(path, size).into_drawing_area(), series, title)
    };
    drawn.map_err(|e| anyhow!("{}: cannot draw the plot: {e}", path.display()))
}

type DrawResult = std::result::Result<(), Box<dyn std::error::Error>>;

fn color(i: usize) -> RGBColor {
    if i < COLORS.len() {
        COLORS[i]
    } else {
        RGBColor(40, 40, 40)
    }
}

fn draw<DB: DrawingBackend>(root: DrawingArea<DB, Shift>, series: &[Series], title: &str) -> DrawResult
where
    DB::ErrorType: 'static,
{
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 22))?;
    let finite = |v: f64| v.is_finite() && v > 0.0;
    let all: Vec<(f32, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| (p.1, p.2)))
        .filter(|p| finite(p.1))
        .collect();
    if all.is_empty() {
        return Err("no finite, positive errors to plot".into());
    }
    let (x_min, x_max) = all
        .iter()
        .fold((f32::MAX, f32::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let (x_lo, x_hi) = if x_min == x_max {
        (x_min - 0.5, x_max + 0.5)
    } else {
        (x_min, x_max)
    };
    let (y_min, y_max) = all
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
    for (panel, area) in PANELS.iter().zip(root.split_evenly((2, 2))) {
        let mut chart = ChartBuilder::on(&area)
            .caption(*panel, ("sans-serif", 18))
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(60)
            .build_cartesian_2d(x_lo..x_hi, (y_min * 0.8..y_max * 1.25).log_scale())?;
        chart
            .configure_mesh()
            .x_desc("σ of Q and K")
            .y_desc("relative L2 error")
            .y_label_formatter(&|y| format!("{y:.0e}"))
            .label_style(("sans-serif", 13))
            .draw()?;
        for (i, s) in series.iter().enumerate() {
            let pts: Vec<(f32, f64)> = s
                .points
                .iter()
                .filter(|p| p.0 == *panel && finite(p.2))
                .map(|p| (p.1, p.2))
                .collect();
            let c = color(i);
            chart
                .draw_series(LineSeries::new(pts.clone(), c.stroke_width(2)))?
                .label(s.label.as_str())
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], c.stroke_width(2)));
            chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, c.filled())))?;
        }
        if *panel == "O" {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .label_font(("sans-serif", 12))
                .draw()?;
        }
    }
    root.present()?;
    Ok(())
}
