//! `sagebwd`: INT8 attention for training — accuracy studies, attention on your own tensors.

mod accuracy;
mod accuracy_plot;
mod args;
mod attn;
mod backend;
mod bench;
mod diagnose;
mod method_args;
mod plan;
mod report;
mod tokenize;
mod train;
mod train_check;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "sagebwd",
    version,
    about = "SageBwd: INT8 attention forward and backward, for training transformers",
    long_about = "SageBwd: INT8 attention forward and backward (6 of the 7 attention products on INT8 \
                  tensor cores), with an exact f64 reference and a simulator of the quantized method.\n\n\
                  The method is specified in docs/ALGORITHM.md. Every product can be switched between \
                  INT8 and BF16 on its own (--int8/--bf16, or --isolate) to see which one hurts."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Measure the error of a configuration against exact f64 attention on random inputs
    /// (Gaussian Q, K of standard deviation σ; V, dO with σ = 1).
    Accuracy(accuracy::AccuracyArgs),
    /// Run attention on Q, K, V (and dO) read from a safetensors file; write O, LSE (dQ, dK, dV).
    Attn(attn::AttnArgs),
    /// Pre-train a Llama-style language model with SageBwd attention, on the GPU when there is
    /// one, else on the CPU. With no arguments: the tiny model on the built-in sample, fpa then
    /// sagebwd, with both loss curves.
    Train(train::TrainArgs),
    /// The attention error on a trained model's real layers (the paper's Table 2): capture each
    /// layer's Q, K, V and dO from one batch of a checkpoint, compare a configuration and each
    /// product alone with exact f64 attention (CPU simulator), per layer; --export writes a layer
    /// for `attn`.
    Diagnose(diagnose::DiagnoseArgs),
    /// Check the GPU training step against the CPU one: loss, every parameter gradient and a short
    /// training run on small models (needs a GPU; exit code 1 beyond the tolerances).
    TrainCheck(train_check::TrainCheckArgs),
    /// Tokenize text corpora (GPT-2 BPE) into llm.c-format token shards, using all cores.
    Tokenize(tokenize::TokenizeArgs),
    /// Draw the loss curves of several runs in one PNG/SVG and print their final losses.
    Report(report::ReportArgs),
    /// Time forward, backward and forward + backward on the GPU over the standard shape sweep
    /// (B·N = 16384, H·D = 2048, D ∈ {64, 128}, N = 1k..16k, causal and not): TOPS, peak memory.
    Bench(bench::BenchArgs),
    /// Print which kernels run for a configuration, shape and GPU architecture (no GPU needed);
    /// `--map` prints the whole kernel map.
    Plan(plan::PlanArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Accuracy(a) => accuracy::run(a),
        Command::Attn(a) => attn::run(a),
        Command::Train(a) => train::run(a),
        Command::Diagnose(a) => diagnose::run(a),
        Command::TrainCheck(a) => train_check::run(a),
        Command::Tokenize(a) => tokenize::run(a),
        Command::Report(a) => report::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Plan(a) => plan::run(a),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        // An interrupted training wrote its final checkpoint: the conventional exit status of SIGINT.
        Err(e)
            if matches!(
                e.downcast_ref::<sagebwd_train::Error>(),
                Some(sagebwd_train::Error::Interrupted { .. })
            ) =>
        {
            eprintln!("{e:#}");
            ExitCode::from(130)
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
