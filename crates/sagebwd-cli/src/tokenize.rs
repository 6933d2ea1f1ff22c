//! `sagebwd tokenize INPUT... -o DIR`: GPT-2 token shards (llm.c format) from text corpora, using
//! all cores. Format and split rule: `sagebwd_train::shards` and `sagebwd_train::data`.

use anyhow::{bail, Context, Result};
use clap::Args;
use sagebwd_train::data::tokenize_files;
use sagebwd_train::shards::write_shard;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// Text files (.txt, .xz, .zst); documents separated by RS (0x1E) + newline.
    #[arg(value_name = "INPUT", required = true)]
    pub inputs: Vec<PathBuf>,
    /// Output directory for val_000000.bin, train_NNNNNN.bin and info.json (info-train.json /
    /// info-val.json with --split train / val, so both splits can share a directory).
    #[arg(short, long)]
    pub output: PathBuf,
    /// Document i (counted across all inputs in order) is validation iff i % N == 1; 0: no
    /// validation split (everything is training data).
    #[arg(long, default_value_t = 100, value_name = "N")]
    pub val_every: usize,
    /// Which split the documents go to: `auto` (by --val-every), `train` (all), `val` (all: for a
    /// corpus that is already split, like ../shared/data's val.txt.xz).
    #[arg(long, default_value = "auto", value_parser = ["auto", "train", "val"])]
    pub split: String,
    /// Largest training shard, in tokens.
    #[arg(long, default_value_t = 100_000_000)]
    pub shard_tokens: usize,
    /// Replace an earlier tokenization in the output directory: its shards and info file (of the
    /// split written: all of them with --split auto) are removed first. Without it, a directory that
    /// holds any (auto) or that split's (train/val) shards or info file is refused.
    #[arg(long)]
    pub overwrite: bool,
}

/// The files of `dir` that a tokenization of `split` would write or that `train` would read as the
/// same split: shards (`*train*.bin`, `*val*.bin`) and info files.
fn conflicting(dir: &Path, split: &str) -> Result<Vec<PathBuf>> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for e in entries {
        let e = e.with_context(|| format!("{}", dir.display()))?;
        let name = e.file_name().to_string_lossy().into_owned();
        let shard = name.ends_with(".bin");
        let hit = match split {
            "train" => (shard && name.contains("train")) || name == "info-train.json" || name == "info.json",
            "val" => (shard && name.contains("val")) || name == "info-val.json" || name == "info.json",
            _ => {
                (shard && (name.contains("train") || name.contains("val")))
                    || name.starts_with("info") && name.ends_with(".json")
            }
        };
        if hit {
            out.push(e.path());
        }
    }
    out.sort();
    Ok(out)
}

pub fn run(a: TokenizeArgs) -> Result<()> {
    if a.shard_tokens == 0 {
        bail!("--shard-tokens must be at least 1");
    }
    let start = Instant::now();
    let paths: Vec<&Path> = a.inputs.iter().map(PathBuf::as_path).collect();
    let val_every = if a.split == "auto" { a.val_every } else { 0 };
    let mut s = tokenize_files(&paths, val_every)?;
    if a.split == "val" {
        std::mem::swap(&mut s.train, &mut s.val);
        std::mem::swap(&mut s.train_docs, &mut s.val_docs);
        std::mem::swap(&mut s.train_bytes, &mut s.val_bytes);
    }
    if s.train.is_empty() && s.val.is_empty() {
        bail!(
            "no text in {}",
            a.inputs
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let old = conflicting(&a.output, &a.split)?;
    let non_empty = a.split == "auto" && std::fs::read_dir(&a.output).is_ok_and(|mut d| d.next().is_some());
    if (!old.is_empty() || non_empty) && !a.overwrite {
        let what = if old.is_empty() {
            "is not empty".to_string()
        } else {
            let names: Vec<String> = old
                .iter()
                .take(5)
                .map(|p| p.file_name().unwrap_or_default().to_string_lossy().into_owned())
                .collect();
            format!(
                "holds an earlier tokenization ({}{})",
                names.join(", "),
                if old.len() > 5 { ", …" } else { "" }
            )
        };
        bail!(
            "{} {what}; give --overwrite to replace it, or another --output",
            a.output.display()
        );
    }
    for p in &old {
        std::fs::remove_file(p).with_context(|| format!("removing the earlier {}", p.display()))?;
    }
    std::fs::create_dir_all(&a.output).with_context(|| format!("{}", a.output.display()))?;
    let mut shards = Vec::new();
    let mut listed = Vec::new();
    if !s.val.is_empty() {
        let p = a.output.join("val_000000.bin");
        write_shard(&p, &s.val)?;
        listed.push(sagebwd_train::shards::listed(&p, s.val.len())?);
        shards.push(p);
    }
    for (i, chunk) in s.train.chunks(a.shard_tokens).enumerate() {
        let p = a.output.join(format!("train_{i:06}.bin"));
        write_shard(&p, chunk)?;
        listed.push(sagebwd_train::shards::listed(&p, chunk.len())?);
        shards.push(p);
    }
    let secs = start.elapsed().as_secs_f64();
    let info = serde_json::json!({
        "tokenizer": "gpt2 (r50k_base), end-of-text 50256 after every document",
        "format": "llm.c: 256 x int32 header (magic 20240520, version 1, token count), then uint16 tokens",
        "split": a.split,
        "val_every": val_every,
        "train": { "documents": s.train_docs, "tokens": s.train.len(), "bytes": s.train_bytes },
        "val": { "documents": s.val_docs, "tokens": s.val.len(), "bytes": s.val_bytes },
        "inputs": a.inputs.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        // What `sagebwd train` checks the directory's shards against (name, tokens, bytes, CRC32).
        "shards": listed,
    });
    // One info file per split when the splits are tokenized separately into the same directory.
    let info_name = if a.split == "auto" {
        "info.json".to_string()
    } else {
        format!("info-{}.json", a.split)
    };
    let info_path = a.output.join(info_name);
    sagebwd_train::output::write_file(&info_path, serde_json::to_string_pretty(&info)?.as_bytes())?;
    let tokens = s.train.len() + s.val.len();
    println!(
        "{} training documents ({} tokens) and {} validation documents ({} tokens) → {} shards in {} ({:.1} s, {:.2} M tokens/s, {} threads)",
        s.train_docs,
        s.train.len(),
        s.val_docs,
        s.val.len(),
        shards.len(),
        a.output.display(),
        secs,
        tokens as f64 / secs / 1e6,
        rayon::current_num_threads()
    );
    Ok(())
}
