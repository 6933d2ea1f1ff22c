//! Per-step metrics as JSON lines (`metrics.jsonl` in the run directory), and bits per byte.

use crate::error::{io_err, Result};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};

/// One line of `metrics.jsonl`. Training steps carry `loss`, `lr`, `grad_norm`; evaluation lines
/// (`kind = "val"`) carry `val_loss` and `val_bpb`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub kind: String,
    pub step: u64,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub loss: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub lr: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub grad_norm: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub val_loss: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub val_bpb: Option<f64>,
    pub tokens_seen: u64,
    /// Seconds of training since the run started (resumed runs continue the count).
    pub time: f64,
}

/// Bits per byte of text: `loss` (nats per token) × tokens / bytes / ln 2.
pub fn bits_per_byte(loss_nats_per_token: f64, tokens: u64, bytes: u64) -> f64 {
    loss_nats_per_token * tokens as f64 / bytes.max(1) as f64 / std::f64::consts::LN_2
}

pub struct MetricsLog {
    path: PathBuf,
}

/// The lines of a metrics file: the records with their text, and the numbers (from 1) of the lines that
/// are not a record (a line cut short by a kill, or damaged on disk).
pub struct Lines {
    pub records: Vec<(String, Record)>,
    pub damaged: Vec<usize>,
}

/// Reads `path` line by line (an absent file has no lines).
pub fn read_lines(path: &Path) -> Result<Lines> {
    let text = match std::fs::read(path) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(io_err(path)(e)),
    };
    let mut out = Lines {
        records: Vec::new(),
        damaged: Vec::new(),
    };
    for (i, l) in text.lines().enumerate() {
        if l.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Record>(l) {
            Ok(r) => out.records.push((l.to_string(), r)),
            Err(_) => out.damaged.push(i + 1),
        }
    }
    Ok(out)
}

/// "3 damaged lines (12, 40, 41)", for warnings.
pub fn describe_damaged(path: &Path, damaged: &[usize]) -> String {
    let shown: Vec<String> = damaged.iter().take(20).map(|n| n.to_string()).collect();
    let more = if damaged.len() > 20 { ", …" } else { "" };
    format!(
        "{}: {} damaged line(s) that are not metrics records (line {}{more})",
        path.display(),
        damaged.len(),
        shown.join(", ")
    )
}

impl MetricsLog {
    /// A new, empty `dir/metrics.jsonl` (the run directory was claimed as new or cleared).
    pub fn create(dir: &Path) -> Result<MetricsLog> {
        let path = dir.join("metrics.jsonl");
        crate::output::write_file(&path, b"")?;
        Ok(MetricsLog { path })
    }

    /// Opens `dir/metrics.jsonl` of a resumed run, keeping only the records of steps before
    /// `keep_before` (the steps after the checkpoint are trained again, so the file never holds a
    /// step twice). When records must go, the kept ones are written to a new file renamed over the
    /// old one, so a kill during the rewrite leaves the old file whole. Damaged lines are reported on
    /// stderr with their line numbers and returned; they are not carried into the rewrite.
    pub fn resume(dir: &Path, keep_before: u64) -> Result<(MetricsLog, Vec<usize>)> {
        let path = dir.join("metrics.jsonl");
        let lines = read_lines(&path)?;
        if !lines.damaged.is_empty() {
            eprintln!(
                "warning: {}; they are left out of the resumed log",
                describe_damaged(&path, &lines.damaged)
            );
        }
        let drop_any = lines.records.iter().any(|(_, r)| r.step >= keep_before);
        let exists = path.exists();
        if drop_any || !lines.damaged.is_empty() || !exists {
            let mut body = String::new();
            for (text, r) in &lines.records {
                if r.step < keep_before {
                    body.push_str(text);
                    body.push('\n');
                }
            }
            crate::output::write_with(&path, |tmp| {
                let mut f = std::fs::File::create(tmp).map_err(io_err(tmp))?;
                let half = body.len() / 2;
                f.write_all(&body.as_bytes()[..half]).map_err(io_err(tmp))?;
                crate::output::fault_point("metrics-rewrite");
                f.write_all(&body.as_bytes()[half..]).map_err(io_err(tmp))
            })?;
        }
        Ok((MetricsLog { path }, lines.damaged))
    }

    pub fn append(&self, r: &Record) -> Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&self.path)
            .map_err(io_err(&self.path))?;
        // One write per line: a kill cuts at most the last line, which the next resume reports.
        let line = format!("{}\n", serde_json::to_string(r).expect("records serialize"));
        f.write_all(line.as_bytes()).map_err(io_err(&self.path))
    }
}

/// All records of a run directory's `metrics.jsonl`; damaged lines are reported on stderr (count and
/// line numbers), never skipped silently.
pub fn read_records(dir: &Path) -> Result<Vec<Record>> {
    let path = dir.join("metrics.jsonl");
    if !path.exists() {
        return Err(io_err(&path)(std::io::Error::from(std::io::ErrorKind::NotFound)));
    }
    let lines = read_lines(&path)?;
    if !lines.damaged.is_empty() {
        eprintln!("warning: {}; they are skipped", describe_damaged(&path, &lines.damaged));
    }
    Ok(lines.records.into_iter().map(|(_, r)| r).collect())
}
