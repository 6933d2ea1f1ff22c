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
        bail!("no text in {}", a.inputs.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "));
    }
    std::fs::create_dir_all(&a.output).with_context(|| format!("{}", a.output.display()))?;
    let mut shards = Vec::new();
    if !s.val.is_empty() {
        let p = a.output.join("val_000000.bin");
        write_shard(&p, &s.val)?;
        shards.push(p);
    }
    for (i, chunk) in s.train.chunks(a.shard_tokens).enumerate() {
        let p = a.output.join(format!("train_{i:06}.bin"));
        write_shard(&p, chunk)?;
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
    });
    // One info file per split when the splits are tokenized separately into the same directory.
    let info_name = if a.split == "auto" { "info.json".to_string() } else { format!("info-{}.json", a.split) };
    let info_path = a.output.join(info_name);
    std::fs::write(&info_path, serde_json::to_string_pretty(&info)?).with_context(|| format!("{}", info_path.display()))?;
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
