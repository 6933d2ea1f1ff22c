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

impl MetricsLog {
    /// Opens `dir/metrics.jsonl`, keeping only the records of steps before `keep_before` (a resumed
    /// run rewrites what came after its checkpoint, so the file never holds a step twice).
    pub fn open(dir: &Path, keep_before: u64) -> Result<MetricsLog> {
        let path = dir.join("metrics.jsonl");
        let kept: Vec<String> = match std::fs::read_to_string(&path) {
            Ok(text) => text
                .lines()
                .filter(|l| serde_json::from_str::<Record>(l).is_ok_and(|r| r.step < keep_before))
                .map(String::from)
                .collect(),
            Err(_) => Vec::new(),
        };
        let mut body = kept.join("\n");
        if !body.is_empty() {
            body.push('\n');
        }
        std::fs::write(&path, body).map_err(io_err(&path))?;
        Ok(MetricsLog { path })
    }

    pub fn append(&self, r: &Record) -> Result<()> {
        let mut f = std::fs::OpenOptions::new().append(true).open(&self.path).map_err(io_err(&self.path))?;
        writeln!(f, "{}", serde_json::to_string(r).expect("records serialize")).map_err(io_err(&self.path))
    }
}

/// All records of a run directory's `metrics.jsonl`.
pub fn read_records(dir: &Path) -> Result<Vec<Record>> {
    let path = dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
    Ok(text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect())
}
