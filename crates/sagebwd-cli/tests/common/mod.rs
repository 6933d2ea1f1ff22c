//! What the CLI's end-to-end tests share: running the binary, a small corpus, a model small enough that a
//! few steps take well under a second on the CPU (the GPT-2 vocabulary stays).
// Each test file uses a different part of this module.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Output};

/// The `sagebwd` binary with `args` in `cwd`, fault injection off (see `sagebwd_train::output::fault_point`).
pub fn command(args: &[&str], cwd: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_sagebwd"));
    c.args(args)
        .current_dir(cwd)
        .env_remove("SAGEBWD_FAULT")
        .env_remove("SAGEBWD_FAULT_AFTER");
    c
}

/// Runs `sagebwd args` in `cwd` to completion.
pub fn sagebwd(args: &[&str], cwd: &Path) -> Output {
    command(args, cwd).output().expect("runs")
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `corpus.txt` in `dir`: `docs` short documents separated by RS + newline.
pub fn write_corpus(dir: &Path, docs: usize) {
    let docs: Vec<String> = (0..docs)
        .map(|i| {
            format!("Document {i}. The cat sat on the mat, and the dog sat on the log. It was day {i} of the year.\n")
        })
        .collect();
    std::fs::write(dir.join("corpus.txt"), docs.join("\u{1e}\n")).unwrap();
}

/// The model and evaluation options of a CPU run of a few steps.
pub const SMALL_MODEL: [&str; 16] = [
    "--dim",
    "16",
    "--layers",
    "1",
    "--heads",
    "2",
    "--ffn",
    "32",
    "--seq",
    "16",
    "--batch",
    "2",
    "--eval-every",
    "2",
    "--eval-tokens",
    "64",
];
