//! The training loop: gradient accumulation, clipping, AdamW, the schedule, periodic validation,
//! metrics, checkpoints, exact resume, and a clean stop on a non-finite loss.

use crate::backend::Attention;
use crate::checkpoint;
use crate::config::ModelConfig;
use crate::engine::{clip_factor, CpuEngine, Engine, EngineState};
use crate::error::{io_err, Error, Result};
use crate::gpu::GpuEngine;
use crate::loader::{validation_batches, Loader, LoaderState};
use crate::metrics::{bits_per_byte, MetricsLog, Record};
use crate::model::{Batch, Model, ParamLayout, Weights};
use crate::optim::{AdamWConfig, Schedule};
use crate::parallel::DataParallel;
use crate::rng::Rng;
use crate::rundir;
use indicatif::{ProgressBar, ProgressStyle};
use sagebwd_cuda::energy::Energy;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Everything that defines a run (saved in `config.json` and in every checkpoint).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    pub model: ModelConfig,
    /// `fpa`, `sagebwd`, `int8-all` or `exact`; with `method`, that configuration's
    /// [`crate::method::run_label`].
    pub attention: String,
    /// The exact attention configuration (every product's precision, smoothing, block sizes) when the
    /// run was given one; None: the preset `attention`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<sagebwd::Config>,
    /// Trace the attention error per layer at each evaluation ([`crate::trace`]).
    #[serde(default)]
    pub trace: bool,
    pub seq_len: usize,
    pub micro_batch: usize,
    pub grad_accum: usize,
    pub steps: u64,
    pub lr: f32,
    pub min_lr: f32,
    pub warmup: u64,
    pub adamw: AdamWConfig,
    /// Largest global gradient norm (0: no clipping).
    pub grad_clip: f32,
    pub eval_every: u64,
    /// Target tokens of the validation split evaluated each time.
    pub eval_tokens: usize,
    pub checkpoint_every: u64,
    pub seed: u64,
    /// Data-parallel replicas, one per GPU (1: a single device). Older run directories have no
    /// such field: one.
    #[serde(default = "one")]
    pub gpus: usize,
}

fn one() -> usize {
    1
}

impl TrainConfig {
    /// Tokens per optimizer step: micro-batch × sequence × accumulation × GPUs.
    pub fn tokens_per_step(&self) -> usize {
        self.sequences_per_micro_step() * self.seq_len * self.grad_accum
    }

    /// Sequences of one micro-step over all replicas (what the loader hands out at a time).
    pub fn sequences_per_micro_step(&self) -> usize {
        self.micro_batch * self.gpus
    }

    pub fn validate(&self) -> Result<()> {
        self.model.validate()?;
        self.attention_spec()?;
        let positive = [
            ("sequence length", self.seq_len),
            ("micro-batch", self.micro_batch),
            ("gradient accumulation", self.grad_accum),
            ("GPUs", self.gpus),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(Error::Config(format!("{name} must be at least 1")));
            }
        }
        if self.steps == 0 {
            return Err(Error::Config("steps must be at least 1".into()));
        }
        if self.seq_len > self.model.max_seq_len {
            return Err(Error::Config(format!(
                "sequence length {} exceeds the model's maximum {}",
                self.seq_len, self.model.max_seq_len
            )));
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(Error::Config(format!(
                "learning rate must be positive, got {}",
                self.lr
            )));
        }
        if !(self.min_lr.is_finite() && self.min_lr >= 0.0 && self.min_lr <= self.lr) {
            return Err(Error::Config(format!(
                "the final learning rate (--min-lr) must be between 0 and the peak --lr {}, got {}",
                self.lr, self.min_lr
            )));
        }
        let non_negative = [
            ("weight decay (--wd)", self.adamw.weight_decay),
            ("gradient clip (--clip)", self.grad_clip),
        ];
        for (name, v) in non_negative {
            if !(v.is_finite() && v >= 0.0) {
                return Err(Error::Config(format!("{name} must be a finite number ≥ 0, got {v}")));
            }
        }
        let a = &self.adamw;
        if !((0.0..1.0).contains(&a.beta1) && (0.0..1.0).contains(&a.beta2) && a.eps.is_finite() && a.eps > 0.0) {
            return Err(Error::Config(format!(
                "AdamW needs 0 ≤ β1, β2 < 1 and ε > 0, got β1 {}, β2 {}, ε {}",
                a.beta1, a.beta2, a.eps
            )));
        }
        Ok(())
    }
}

/// Token streams for a run, and the text bytes each token id stands for (for bits per byte).
pub struct Corpus {
    pub train: Vec<u16>,
    pub val: Vec<u16>,
    pub token_bytes: Vec<u32>,
    /// Where the data came from, for the log.
    pub description: String,
}

/// How to run: where, whether to resume, and what to show.
pub struct RunOptions {
    pub dir: PathBuf,
    /// Continue the run in `dir` from its checkpoint (a directory without one starts the run).
    pub resume: bool,
    /// Replace a run already in `dir` (its run files are removed first; see [`crate::rundir`]).
    pub overwrite: bool,
    /// Resume even when settings that change the run's meaning differ from the recorded ones.
    pub force_resume: bool,
    pub progress: bool,
    /// Stop (as if interrupted) once this many steps are done; for tests of `resume`.
    pub stop_after: Option<u64>,
    pub device: DeviceChoice,
}

/// Where to train.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DeviceChoice {
    /// The GPU when one is usable (driver, NVRTC, cuBLASLt, a supported head dimension), else the
    /// CPU with a note saying why.
    #[default]
    Auto,
    Cpu,
    Cuda,
}

/// Builds the engine for `cfg` with initial `weights` on the chosen device: one engine, or with
/// `cfg.gpus > 1` one GPU engine per GPU in a [`DataParallel`] group.
pub fn make_engine(
    cfg: &TrainConfig,
    weights: Weights,
    device: DeviceChoice,
    verbose: bool,
) -> Result<Box<dyn Engine>> {
    let attention = cfg.attention_spec()?;
    if cfg.gpus > 1 {
        return data_parallel_gpus(cfg, &weights, device, attention);
    }
    let cpu = |weights: Weights, attention: Attention| -> Box<dyn Engine> {
        Box::new(CpuEngine::new(
            Model::new(cfg.model.clone(), weights),
            cfg.adamw.clone(),
            attention,
        ))
    };
    match device {
        DeviceChoice::Cpu => Ok(cpu(weights, attention)),
        DeviceChoice::Cuda => Ok(Box::new(GpuEngine::new(
            cfg.model.clone(),
            &weights,
            cfg.adamw.clone(),
            attention,
        )?)),
        DeviceChoice::Auto => {
            let threads = rayon::current_num_threads();
            if let Some(why) = crate::gpu::unsupported_reason(&cfg.model, &attention) {
                if verbose {
                    eprintln!("note: training on the CPU ({threads} threads): {why}");
                }
                return Ok(cpu(weights, attention));
            }
            match GpuEngine::new(cfg.model.clone(), &weights, cfg.adamw.clone(), attention.clone()) {
                Ok(e) => Ok(Box::new(e)),
                Err(why) => {
                    if verbose {
                        eprintln!(
                            "note: training on the CPU ({threads} threads): no usable GPU: {}",
                            gpu_reason(why)
                        );
                    }
                    Ok(cpu(weights, attention))
                }
            }
        }
    }
}

/// Why a GPU engine could not start, without the "GPU: " prefix its errors display with.
fn gpu_reason(e: Error) -> String {
    match e {
        Error::Gpu(msg) => msg,
        other => other.to_string(),
    }
}

/// `cfg.gpus` GPU engines (GPUs 0, 1, …) with the same initial weights. Several GPUs were asked
/// for explicitly, so there is no CPU fallback: any failure is an error.
fn data_parallel_gpus(
    cfg: &TrainConfig,
    weights: &Weights,
    device: DeviceChoice,
    attention: Attention,
) -> Result<Box<dyn Engine>> {
    let n = cfg.gpus;
    if device == DeviceChoice::Cpu {
        return Err(Error::Config(format!(
            "{n} GPUs were asked for with the CPU as the device; use --device cuda (or auto), or --gpus 1"
        )));
    }
    if let Some(why) = crate::gpu::unsupported_reason(&cfg.model, &attention) {
        return Err(Error::Gpu(why));
    }
    let replicas = (0..n)
        .map(|i| {
            GpuEngine::on(i, cfg.model.clone(), weights, cfg.adamw.clone(), attention.clone())
                .map_err(|e| Error::Gpu(format!("replica {} of {n} (GPU {i}): {}", i + 1, gpu_reason(e))))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Box::new(DataParallel::new(replicas)?))
}

/// What a finished run reports.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RunSummary {
    pub dir: PathBuf,
    pub attention: String,
    /// The run's exact attention configuration ([`TrainConfig::method`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<sagebwd::Config>,
    pub steps: u64,
    pub tokens_seen: u64,
    pub final_train_loss: f64,
    pub final_val_loss: Option<f64>,
    pub final_val_bpb: Option<f64>,
    pub seconds: f64,
    pub tokens_per_second: f64,
    /// Tokens per step / the median step time after this session's first 3 steps (None with fewer
    /// than 5 steps): the throughput without the first steps' warm-up (kernel loading, product
    /// planning, memory-pool growth).
    #[serde(default)]
    pub steady_tokens_per_second: Option<f64>,
    /// Board energy per token over the same steps (J), where the engine reads its GPUs' energy
    /// counters (NVML): at the power cap a step's time follows its energy (docs/TRAINING.md).
    #[serde(default)]
    pub steady_joules_per_token: Option<f64>,
    /// Mean board power over those steps (W, summed over GPUs).
    #[serde(default)]
    pub steady_board_watts: Option<f64>,
    /// The engine's description (device, products, attention).
    #[serde(default)]
    pub device: String,
    /// Peak device memory of the run (GPU only): the memory pool's high-water mark of live
    /// allocations, above what was in use before the engine started.
    #[serde(default)]
    pub peak_memory: Option<u64>,
    /// Training FLOPs per token ([`ModelConfig::flops_per_token`]).
    #[serde(default)]
    pub flops_per_token: f64,
    /// Data-parallel GPUs (1 on the CPU); MFU divides by their combined peak.
    #[serde(default = "one")]
    pub gpus: usize,
}

/// Training state that a checkpoint restores.
struct State {
    step: u64,
    tokens_seen: u64,
    elapsed: f64,
}

/// What identifies a run's data: token counts and CRC32s of both splits (recorded in every checkpoint,
/// so `--resume` on other data is noticed).
pub fn data_fingerprint(corpus: &Corpus) -> serde_json::Value {
    let crc = |t: &[u16]| {
        let mut h = crc32fast::Hasher::new();
        for chunk in t.chunks(1 << 16) {
            let bytes: Vec<u8> = chunk.iter().flat_map(|x| x.to_le_bytes()).collect();
            h.update(&bytes);
        }
        format!("{:08x}", h.finalize())
    };
    serde_json::json!({
        "train_tokens": corpus.train.len(),
        "train_crc32": crc(&corpus.train),
        "val_tokens": corpus.val.len(),
        "val_crc32": crc(&corpus.val),
    })
}

/// Trains `cfg` on `corpus` in `opts.dir`.
pub fn train(cfg: &TrainConfig, corpus: &Corpus, opts: &RunOptions) -> Result<RunSummary> {
    cfg.validate()?;
    let ckpt_path = opts.dir.join(checkpoint::FILE_NAME);
    // A resume into a directory without a checkpoint starts the run (a preset of a list that had not
    // started, or a run stopped before its first checkpoint: nothing of it can be continued).
    let resuming = opts.resume && ckpt_path.exists();
    let claim = match (resuming, opts.resume, opts.overwrite) {
        (true, _, _) => rundir::Claim::Resume,
        (false, true, _) | (false, false, true) => rundir::Claim::Overwrite,
        _ => rundir::Claim::New,
    };
    if opts.resume && !resuming && opts.progress {
        eprintln!(
            "note: {} holds no checkpoint: the run starts at step 0",
            opts.dir.display()
        );
    }
    let _lock = rundir::claim(&opts.dir, claim)?;
    let layout = ParamLayout::new(&cfg.model);
    let weights = Weights::init(&cfg.model, &mut Rng::new(cfg.seed));
    let mut engine = make_engine(cfg, weights, opts.device, opts.progress)?;
    let mut loader = Loader::new(
        corpus.train.clone(),
        cfg.seq_len,
        cfg.sequences_per_micro_step(),
        cfg.seed,
    )?;
    let data = data_fingerprint(corpus);
    let mut state = State {
        step: 0,
        tokens_seen: 0,
        elapsed: 0.0,
    };
    // The checkpoint this run wrote (or resumed from) and verified: the only one a divergence message names.
    let mut last_good: Option<PathBuf> = None;
    let log = if resuming {
        state = restore(&ckpt_path, cfg, &data, opts.force_resume, engine.as_mut(), &mut loader)?;
        last_good = Some(ckpt_path.clone());
        write_config(&opts.dir, cfg)?;
        MetricsLog::resume(&opts.dir, state.step + 1)?.0
    } else {
        write_config(&opts.dir, cfg)?;
        MetricsLog::create(&opts.dir)?
    };
    let signals = crate::signals::Guard::install();
    // A resumed run that has nothing left to do still reports its last losses.
    let kept = crate::metrics::read_records(&opts.dir)?;
    let mut last_loss = kept.iter().rev().find_map(|r| r.loss).unwrap_or(f64::NAN);
    let mut last_val = kept.iter().rev().find_map(|r| Some((r.val_loss?, r.val_bpb?)));
    let val = validation_batches(
        &corpus.val,
        cfg.seq_len,
        cfg.sequences_per_micro_step(),
        cfg.eval_tokens,
    );
    if opts.progress {
        print_header(cfg, &layout, engine.as_ref(), corpus, loader.windows(), &state);
    }
    let schedule = Schedule {
        max_lr: cfg.lr,
        min_lr: cfg.min_lr,
        warmup: cfg.warmup,
        total: cfg.steps,
    };
    let bar = progress_bar(opts.progress, cfg.steps, state.step);
    let session_start = (state.elapsed, state.tokens_seen);
    let end = opts.stop_after.map_or(cfg.steps, |s| s.min(cfg.steps));
    let mut step_secs = Vec::new();
    // Board energy of the steady steps (see EnergyWindow): the counter with the time of each read.
    let origin = Instant::now();
    let read_energy = |e: &dyn Engine| e.energy_millijoules().map(|mj| (mj, origin.elapsed().as_secs_f64()));
    let mut energy = EnergyWindow::default();
    while state.step < end {
        if step_secs.len() == 3 {
            energy.open(read_energy(engine.as_ref()));
        }
        let t0 = Instant::now();
        let lr = schedule.lr(state.step);
        let (loss, norm) = step(cfg, engine.as_mut(), &mut loader, lr)
            .map_err(|e| diverged(e, state.step + 1, last_good.as_deref()))?;
        state.step += 1;
        state.tokens_seen += cfg.tokens_per_step() as u64;
        step_secs.push(t0.elapsed().as_secs_f64());
        energy.step_done();
        state.elapsed += step_secs.last().copied().unwrap_or(0.0);
        last_loss = loss;
        log.append(&Record {
            kind: "train".into(),
            step: state.step,
            loss: Some(loss),
            lr: Some(lr as f64),
            grad_norm: Some(norm),
            tokens_seen: state.tokens_seen,
            time: state.elapsed,
            ..Default::default()
        })?;
        let done = state.step == cfg.steps;
        let eval_now = !val.is_empty() && (state.step.is_multiple_of(cfg.eval_every.max(1)) || done);
        let interrupted = signals.received();
        let save_now = state.step.is_multiple_of(cfg.checkpoint_every.max(1))
            || done
            || Some(state.step) == opts.stop_after
            || interrupted.is_some();
        // The counter is read only around evaluations and checkpoints (the session's last step has both or a
        // checkpoint), never between two steps: an NVML read there would keep the GPU waiting.
        let before_extra = if eval_now || save_now {
            read_energy(engine.as_ref())
        } else {
            None
        };
        if eval_now {
            let (val_loss, bpb) = evaluate(engine.as_mut(), &val, &corpus.token_bytes)?;
            last_val = Some((val_loss, bpb));
            log.append(&Record {
                kind: "val".into(),
                step: state.step,
                val_loss: Some(val_loss),
                val_bpb: Some(bpb),
                tokens_seen: state.tokens_seen,
                time: state.elapsed,
                ..Default::default()
            })?;
            if cfg.trace {
                crate::trace::at_evaluation(
                    cfg,
                    engine.as_ref(),
                    &val,
                    &opts.dir,
                    (state.step, state.tokens_seen, state.elapsed),
                )?;
            }
        }
        if save_now {
            save(&ckpt_path, cfg, &data, engine.as_ref(), &loader, &state)?;
            // Read back and verified: only then is it the last good checkpoint.
            checkpoint::load(&ckpt_path, &Weights::zeros(&cfg.model))?;
            last_good = Some(ckpt_path.clone());
        }
        if eval_now || save_now {
            energy.pause(before_extra, read_energy(engine.as_ref()));
        }
        // Training throughput: step time only (evaluations and checkpoints excluded), as in the summary.
        let rate = (state.tokens_seen - session_start.1) as f64 / (state.elapsed - session_start.0).max(1e-9);
        bar.set_message(format!(
            "loss {loss:.3} | {rate:.0} tok/s{}",
            last_val.map_or(String::new(), |(v, _)| format!(" | val {v:.3}"))
        ));
        bar.set_position(state.step);
        if let Some(signal) = interrupted {
            bar.finish_and_clear();
            return Err(Error::Interrupted {
                signal: signal.into(),
                step: state.step,
                saved: format!("checkpoint written to {}; continue with --resume", ckpt_path.display()),
            });
        }
    }
    bar.finish_and_clear();
    let session_tokens = state.tokens_seen - session_start.1;
    let energy = energy.per_token(cfg.tokens_per_step());
    let session_secs = state.elapsed - session_start.0;
    let summary = RunSummary {
        dir: opts.dir.clone(),
        attention: cfg.attention.clone(),
        method: cfg.method.clone(),
        steps: state.step,
        tokens_seen: state.tokens_seen,
        final_train_loss: last_loss,
        final_val_loss: last_val.map(|v| v.0),
        final_val_bpb: last_val.map(|v| v.1),
        seconds: state.elapsed,
        tokens_per_second: session_tokens as f64 / session_secs.max(1e-9),
        steady_tokens_per_second: steady_rate(&step_secs, cfg.tokens_per_step()),
        steady_joules_per_token: energy.map(|e| e.0),
        steady_board_watts: energy.map(|e| e.1),
        device: engine.describe(),
        peak_memory: engine.peak_memory(),
        flops_per_token: cfg.model.flops_per_token(cfg.seq_len),
        gpus: cfg.gpus,
    };
    write_summary(&opts.dir, &summary)?;
    Ok(summary)
}

/// The run directory's `summary.json`: the last session's [`RunSummary`] (`sagebwd report` reads its
/// throughput and energy), written atomically.
pub const SUMMARY_FILE: &str = "summary.json";

fn write_summary(dir: &Path, s: &RunSummary) -> Result<()> {
    let text = serde_json::to_string_pretty(s).map_err(|e| Error::Data(format!("run summary: {e}")))?;
    crate::output::write_file(&dir.join(SUMMARY_FILE), text.as_bytes())
}

/// Reads a run directory's `summary.json` (absent for runs from before it existed, or still running).
pub fn read_summary(dir: &Path) -> Result<RunSummary> {
    let path = dir.join(SUMMARY_FILE);
    let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
    serde_json::from_str(&text).map_err(|e| Error::Data(format!("{}: {e}", path.display())))
}

/// Tokens per step over the median of the step times after the first 3 (None with fewer than 5 steps).
pub fn steady_rate(step_secs: &[f64], tokens_per_step: usize) -> Option<f64> {
    if step_secs.len() < 5 {
        return None;
    }
    let mut t = step_secs[3..].to_vec();
    t.sort_by(f64::total_cmp);
    let median = if t.len() % 2 == 1 {
        t[t.len() / 2]
    } else {
        0.5 * (t[t.len() / 2 - 1] + t[t.len() / 2])
    };
    Some(tokens_per_step as f64 / median.max(1e-12))
}

/// A counter read: (mJ, seconds since the run's origin).
type EnergyRead = (u64, f64);

/// Where the window's figure ends: the read, the steps done by then, and the excluded energy and time then.
#[derive(Clone, Copy, Debug, PartialEq)]
struct WindowEnd {
    at: EnergyRead,
    steps: usize,
    excluded: EnergyRead,
}

/// Board energy of a run's steady steps (all after this session's first 3, as [`steady_rate`]): the energy
/// counter (mJ, with the time in s) read when the first of them starts, then before and after each
/// evaluation or checkpoint. The figure covers the steps up to the last read before one, less the
/// evaluations and checkpoints in between; it is a difference of two reads, so read errors do not add up:
/// NVML's counter advances in updates every 20–100 ms, and summing per-step differences over ~40 ms
/// steps read ~20 % high (measured with an earlier per-step form of this code). No read falls between two steps.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EnergyWindow {
    start: Option<EnergyRead>,
    steps: usize,
    /// Energy (mJ) and time (s) of the evaluations and checkpoints since `start`.
    excluded: EnergyRead,
    /// The last read at the end of a step.
    end: Option<WindowEnd>,
    /// A read failed inside the window: no figure.
    broken: bool,
}

impl EnergyWindow {
    /// The window starts (a read at the start of the first steady step; None: no counter, no figure).
    pub fn open(&mut self, at: Option<EnergyRead>) {
        *self = EnergyWindow {
            start: at,
            broken: at.is_none(),
            ..Default::default()
        };
    }

    /// A step ended (no read).
    pub fn step_done(&mut self) {
        if self.start.is_some() {
            self.steps += 1;
        }
    }

    /// Work that is not a step (an evaluation, a checkpoint) ran right after a step, between the reads
    /// `before` (also the end of the steps so far) and `after`.
    pub fn pause(&mut self, before: Option<EnergyRead>, after: Option<EnergyRead>) {
        if self.start.is_none() {
            return;
        }
        match (before, after) {
            (Some(b), Some(a)) => {
                self.end = Some(WindowEnd {
                    at: b,
                    steps: self.steps,
                    excluded: self.excluded,
                });
                self.excluded.0 += a.0.saturating_sub(b.0);
                self.excluded.1 += (a.1 - b.1).max(0.0);
            }
            _ => self.broken = true,
        }
    }

    /// (Joules per token, mean board watts) over the window's steps, each of `tokens_per_step`; None
    /// without a counter, after a failed read, with fewer than 2 steady steps, or over less than
    /// [`Self::MIN_SECS`] of steps (a handful of counter updates: a figure off by tens of %).
    pub fn per_token(&self, tokens_per_step: usize) -> Option<(f64, f64)> {
        let start = self.start?;
        let WindowEnd {
            at: end,
            steps,
            excluded,
        } = self.end?;
        if self.broken || steps < 2 {
            return None;
        }
        let e = Energy {
            joules: end.0.saturating_sub(start.0).saturating_sub(excluded.0) as f64 * 1e-3,
            seconds: end.1 - start.1 - excluded.1,
        };
        if e.seconds < Self::MIN_SECS {
            return None;
        }
        Some((e.per(steps * tokens_per_step)?, e.watts()))
    }

    /// The shortest window reported: NVML's counter advances every 20–100 ms, so 2 s hold 20–100 updates.
    pub const MIN_SECS: f64 = 2.0;
}

/// One optimizer step: accumulated gradients over `grad_accum` micro-batches, clipping, AdamW.
/// Returns the step's mean loss and the gradient norm before clipping.
fn step(cfg: &TrainConfig, engine: &mut dyn Engine, loader: &mut Loader, lr: f32) -> Result<(f64, f64)> {
    engine.zero_grads()?;
    let scale = 1.0 / cfg.tokens_per_step() as f32;
    let mut loss = 0.0;
    for _ in 0..cfg.grad_accum {
        let (inputs, targets) = loader.next_batch();
        let batch = Batch {
            inputs: &inputs,
            targets: &targets,
            batch: cfg.sequences_per_micro_step(),
            seq: cfg.seq_len,
        };
        loss += engine.forward_backward(&batch, scale)? / cfg.grad_accum as f64;
    }
    let norm = engine.grad_norm()?;
    if !loss.is_finite() || !norm.is_finite() {
        return Err(Error::Diverged(format!("loss {loss}, gradient norm {norm}")));
    }
    engine.update(lr, clip_factor(norm, cfg.grad_clip as f64))?;
    Ok((loss, norm))
}

/// Turns a failure inside a step into the divergence message (non-finite values anywhere in the
/// step mean the run diverged); other errors pass through.
fn diverged(e: Error, step: u64, last_good: Option<&Path>) -> Error {
    let non_finite = matches!(
        &e,
        Error::Diverged(_) | Error::Attention(sagebwd::Error::NonFinite { .. })
    );
    if !non_finite {
        return e;
    }
    let kept = match last_good {
        Some(ckpt) => format!("the last good checkpoint is kept at {}", ckpt.display()),
        None => "this run had written no checkpoint yet".to_string(),
    };
    Error::Diverged(format!(
        "training diverged at step {step} (NaN/Inf: {e}); stopped without updating the weights; {kept}. Try a lower --lr, QK-norm, or fewer tokens per step"
    ))
}

/// Mean validation loss (nats per token) and bits per byte.
pub fn evaluate(
    engine: &mut dyn Engine,
    val: &[(Vec<u32>, Vec<u32>, usize)],
    token_bytes: &[u32],
) -> Result<(f64, f64)> {
    let (mut nats, mut tokens, mut bytes) = (0.0f64, 0u64, 0u64);
    for (inputs, targets, n) in val {
        let batch = Batch {
            inputs,
            targets,
            batch: *n,
            seq: inputs.len() / n,
        };
        nats += engine.loss(&batch)? * targets.len() as f64;
        tokens += targets.len() as u64;
        bytes += targets
            .iter()
            .map(|&t| token_bytes.get(t as usize).copied().unwrap_or(0) as u64)
            .sum::<u64>();
    }
    let loss = nats / tokens.max(1) as f64;
    Ok((loss, bits_per_byte(loss, tokens, bytes)))
}

fn save(
    path: &Path,
    cfg: &TrainConfig,
    data: &serde_json::Value,
    engine: &dyn Engine,
    loader: &Loader,
    s: &State,
) -> Result<()> {
    let st = engine.export()?;
    let meta = serde_json::json!({
        "config": cfg,
        "data": data,
        "step": s.step,
        "adam_t": st.adam_t,
        "tokens_seen": s.tokens_seen,
        "elapsed": s.elapsed,
        "loader": loader.state,
        // The step draws no random numbers: the data order (seed + loader position) is the only
        // randomness after initialization, so these two restore it exactly.
        "rng": { "seed": cfg.seed, "loader": loader.state },
    });
    checkpoint::save(path, &st.weights, &st.adam_m, &st.adam_v, &meta)
}

/// Settings that may change on `--resume`: the evaluation and checkpoint cadence do not change what the
/// run computes, and `steps` extends (or shortens) the run, which is what resuming with a new step
/// count is for; the cosine decay then spans the new total from the next step on (said in the note).
const FREE_ON_RESUME: [&str; 4] = ["eval_every", "eval_tokens", "checkpoint_every", "steps"];

/// Every leaf where `a` and `b` differ, as `(dotted.path, a, b)`.
fn json_diff(prefix: &str, a: &serde_json::Value, b: &serde_json::Value, out: &mut Vec<(String, String, String)>) {
    match (a, b) {
        (serde_json::Value::Object(x), serde_json::Value::Object(y)) => {
            let mut keys: Vec<&String> = x.keys().chain(y.keys()).collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                let null = serde_json::Value::Null;
                let p = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                json_diff(&p, x.get(k).unwrap_or(&null), y.get(k).unwrap_or(&null), out);
            }
        }
        _ if a != b => out.push((prefix.to_string(), a.to_string(), b.to_string())),
        _ => {}
    }
}

/// Compares the recorded configuration and data with this invocation's: prints every difference, and
/// refuses those that change the run's meaning (anything but [`FREE_ON_RESUME`]) unless `force`.
fn check_resume_settings(path: &Path, saved: &serde_json::Value, now: &serde_json::Value, force: bool) -> Result<()> {
    let mut diffs = Vec::new();
    json_diff("", saved, now, &mut diffs);
    if diffs.is_empty() {
        return Ok(());
    }
    let free = |name: &str| FREE_ON_RESUME.iter().any(|f| name == format!("config.{f}"));
    let list = diffs
        .iter()
        .map(|(n, a, b)| format!("{n}: {a} → {b}"))
        .collect::<Vec<_>>()
        .join("; ");
    let binding: Vec<&str> = diffs.iter().filter(|d| !free(&d.0)).map(|d| d.0.as_str()).collect();
    if binding.is_empty() || force {
        let stretched = if diffs.iter().any(|d| d.0 == "config.steps") {
            " (the learning-rate decay now spans the new step count)"
        } else {
            ""
        };
        eprintln!("note: resuming with settings that differ from the recorded ones: {list}{stretched}");
        return Ok(());
    }
    Err(Error::Checkpoint {
        path: path.into(),
        msg: format!(
            "--resume with settings that change the run ({}): {list}. Resume with the recorded settings, or pass --force-resume to continue with the new ones",
            binding.join(", ")
        ),
    })
}

fn restore(
    path: &Path,
    cfg: &TrainConfig,
    data: &serde_json::Value,
    force: bool,
    engine: &mut dyn Engine,
    loader: &mut Loader,
) -> Result<State> {
    let ck = checkpoint::load(path, &Weights::zeros(&cfg.model))?;
    let err = |msg: String| Error::Checkpoint { path: path.into(), msg };
    let saved: TrainConfig =
        serde_json::from_value(ck.meta["config"].clone()).map_err(|e| err(format!("bad config: {e}")))?;
    if saved.model != cfg.model {
        return Err(err(
            "the run was started with another model; resume with the same model settings".into(),
        ));
    }
    let recorded = serde_json::json!({ "config": saved, "data": ck.meta["data"] });
    let now = serde_json::json!({ "config": cfg, "data": data });
    check_resume_settings(path, &recorded, &now, force)?;
    let field = |name: &str| {
        ck.meta[name]
            .as_u64()
            .ok_or_else(|| err(format!("metadata `{name}` is missing")))
    };
    let loader_state: LoaderState =
        serde_json::from_value(ck.meta["loader"].clone()).map_err(|e| err(format!("bad loader state: {e}")))?;
    engine.import(EngineState {
        weights: ck.weights,
        adam_m: ck.adam_m,
        adam_v: ck.adam_v,
        adam_t: field("adam_t")?,
    })?;
    loader.restore(loader_state);
    Ok(State {
        step: field("step")?,
        tokens_seen: field("tokens_seen")?,
        elapsed: ck.meta["elapsed"].as_f64().unwrap_or(0.0),
    })
}

fn write_config(dir: &Path, cfg: &TrainConfig) -> Result<()> {
    let text = serde_json::to_string_pretty(cfg).expect("config serializes");
    crate::output::write_file(&dir.join("config.json"), text.as_bytes())
}

/// Reads a run directory's `config.json`.
pub fn read_config(dir: &Path) -> Result<TrainConfig> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(io_err(&path))?;
    serde_json::from_str(&text).map_err(|e| Error::Data(format!("{}: {e}", path.display())))
}

fn print_header(cfg: &TrainConfig, layout: &ParamLayout, be: &dyn Engine, corpus: &Corpus, windows: usize, s: &State) {
    eprintln!(
        "model: {}: {:.2}M parameters ({:.2}M outside the embeddings)",
        cfg.model.describe(),
        layout.total as f64 / 1e6,
        layout.non_embedding as f64 / 1e6
    );
    eprintln!(
        "tokens per step: {} = micro-batch {} × sequence {} × accumulation {} × GPUs {}",
        cfg.tokens_per_step(),
        cfg.micro_batch,
        cfg.seq_len,
        cfg.grad_accum,
        cfg.gpus
    );
    eprintln!(
        "data: {}: {} training tokens ({windows} windows), {} validation tokens",
        corpus.description,
        corpus.train.len(),
        corpus.val.len()
    );
    eprintln!(
        "backend: {}; {} steps, lr {:.1e} (warmup {}, cosine to {:.1e}), AdamW wd {}, clip {}",
        be.describe(),
        cfg.steps,
        cfg.lr,
        cfg.warmup,
        cfg.min_lr,
        cfg.adamw.weight_decay,
        cfg.grad_clip
    );
    if s.step > 0 {
        eprintln!("resuming at step {} ({} tokens seen)", s.step, s.tokens_seen);
    }
}

fn progress_bar(show: bool, total: u64, at: u64) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    let style = ProgressStyle::with_template("{bar:30} {pos}/{len} steps | {msg} | ETA {eta}")
        .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    bar.set_position(at);
    bar
}
