//! `sagebwd bench`: forward, backward and forward + backward throughput of the CUDA kernels over
//! the standard shape sweep of docs/PERFORMANCE.md (B·N = 16384 tokens, H·D = 2048, D ∈ {64, 128},
//! N from 1k to 16k, causal and not).
//!
//! Timing (the device library's METHOD.md): CUDA events recorded on the kernels' stream around the
//! public API calls `Gpu::forward` (quantization + forward kernel) and `Gpu::backward` (preprocess,
//! main, postprocess), after warm-up, median of many repetitions, inputs rotated among several
//! device-resident sets so that the 60 MB L2 never holds the next run's operands. Everything the
//! API does between the events counts: allocations, poison fills, quantization, pre/post kernels.
//! The Q/K/V and dO quantization kernels are also timed on their own (they are public) so their
//! share can be reported separately.
//!
//! The bench never falls back to the CPU simulator: without a GPU it is an error.

use crate::args::{describe, ConfigArgs};
use anyhow::{bail, ensure, Context, Result};
use clap::{Args, ValueEnum};
use cudarc::driver::{sys, CudaEvent};
use indicatif::{ProgressBar, ProgressStyle};
use sagebwd::inputs::random;
use sagebwd::{Config, Shape};
use sagebwd_cuda::energy::EnergyMeter;
use sagebwd_cuda::pool::Pool;
use sagebwd_cuda::quantize::{quantize_do, quantize_inputs};
use sagebwd_cuda::{DeviceInputs, Gpu, GroupPolicy};
use serde::Serialize;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Head dimensions D to run, comma-separated.
    #[arg(short = 'd', long, value_delimiter = ',', default_value = "64,128")]
    pub head_dim: Vec<usize>,
    /// Sequence lengths N to run, comma-separated (B = tokens / N).
    #[arg(
        short = 'n',
        long,
        value_delimiter = ',',
        default_value = "1024,2048,4096,8192,16384"
    )]
    pub n: Vec<usize>,
    /// Causal mask: on, off, or both.
    #[arg(long, value_enum, default_value_t = CausalArg::Both)]
    pub causal: CausalArg,
    /// Tokens per step, B·N (the batch is tokens / N).
    #[arg(long, default_value_t = 16384)]
    pub tokens: usize,
    /// Model width H·D (the head count is hidden / D).
    #[arg(long, default_value_t = 2048)]
    pub hidden: usize,
    /// Timed repetitions per point (forward then backward; each gives fwd, bwd and fwd+bwd).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub reps: u64,
    /// Fewest timed repetitions per point, even past --max-time.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    pub min_reps: u64,
    /// Untimed forward + backward runs per point before timing.
    #[arg(long, default_value_t = 2)]
    pub warmup: u64,
    /// Seconds of timed forward + backward per point after which no further repetition starts
    /// (keeps the slow scalar kernels' sweep short; --min-reps still run).
    #[arg(long, default_value_t = 10.0)]
    pub max_time: f64,
    /// Device-resident input sets (Q, K, V, dO) rotated among; 3 × 256 MiB at the standard sweep.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..))]
    pub input_sets: u64,
    /// Seed of the random inputs (Gaussian, σ = 1, rounded to BF16).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Time the scalar reference kernels instead of the tensor-core ones (the library's default).
    #[arg(long)]
    pub scalar: bool,
    /// Run the sagebwd backward in head groups at every shape so that its peak memory stays within
    /// cuDNN's (`Gpu::set_backward_groups(GroupPolicy::Lean)`, as SAGEBWD_BWD_GROUPS=lean). The default
    /// does so only where it is free (non-causal N ≥ 8k); elsewhere lean is slower by up to ~20 % (N 1k,
    /// causal) on an H200. Reported as ours-<preset>-lean.
    #[arg(long)]
    pub lean_memory: bool,
    /// Time in checked mode: every output buffer is filled with a NaN/−128 poison before the
    /// kernels write it, as in the verification runs (off by default: the fills are not part of
    /// the method).
    #[arg(long)]
    pub checked: bool,
    /// Also measure board energy per forward + backward (NVML's energy counter): after the timing, a
    /// phase of back-to-back forward + backward runs lasting SECS per point reports joules per pass,
    /// mean board power and the SM clock. Worth it because a GPU at its power cap runs at the clock
    /// its energy allows (docs/PERFORMANCE.md). The counter updates every 20–100 ms: 3 s or more
    /// gives ~1 %. 0: off.
    #[arg(long, value_name = "SECS", default_value_t = 0.0)]
    pub energy: f64,
    /// Also write the results as JSON to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Compile the kernels of the chosen head dimensions for ARCH (e.g. sm_90a) into the cache
    /// ($SAGEBWD_CACHE_DIR) and exit; needs NVRTC, no GPU.
    #[arg(long, value_name = "ARCH")]
    pub precompile: Option<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum CausalArg {
    On,
    Off,
    Both,
}

impl CausalArg {
    fn values(self) -> &'static [bool] {
        match self {
            CausalArg::On => &[true],
            CausalArg::Off => &[false],
            CausalArg::Both => &[false, true],
        }
    }
}

/// One shape of the sweep.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Point {
    shape: Shape,
    causal: bool,
}

impl Point {
    /// Forward FLOPs by the FlashAttention convention: 4·B·H·N_q·N_k·D, halved when causal.
    fn fwd_flops(&self) -> f64 {
        let s = &self.shape;
        let full = 4.0 * (s.batch * s.heads_q) as f64 * s.n_q as f64 * s.n_k as f64 * s.head_dim as f64;
        if self.causal {
            full / 2.0
        } else {
            full
        }
    }

    fn label(&self) -> String {
        let s = &self.shape;
        format!(
            "D={} N={} B={} H={} {}",
            s.head_dim,
            s.n_q,
            s.batch,
            s.heads_q,
            if self.causal { "causal" } else { "full" }
        )
    }
}

/// The sweep in run order (D, then causal, then N), each shape checked against tokens and hidden.
fn sweep(a: &BenchArgs) -> Result<Vec<Point>> {
    ensure!(
        !a.head_dim.is_empty() && !a.n.is_empty(),
        "--head-dim and --n need at least one value"
    );
    let mut points = Vec::new();
    for &d in &a.head_dim {
        ensure!(
            d > 0 && a.hidden.is_multiple_of(d),
            "--hidden {} is not a multiple of head dim {d}",
            a.hidden
        );
        for &causal in a.causal.values() {
            for &n in &a.n {
                ensure!(
                    n > 0 && a.tokens.is_multiple_of(n),
                    "--tokens {} is not a multiple of N = {n}",
                    a.tokens
                );
                let heads = a.hidden / d;
                let shape = Shape {
                    batch: a.tokens / n,
                    heads_q: heads,
                    heads_kv: heads,
                    n_q: n,
                    n_k: n,
                    head_dim: d,
                };
                points.push(Point { shape, causal });
            }
        }
    }
    Ok(points)
}

/// Median of a non-empty sample (mean of the two middle values for an even count).
fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let m = s.len() / 2;
    if s.len().is_multiple_of(2) {
        (s[m - 1] + s[m]) / 2.0
    } else {
        s[m]
    }
}

/// Tera-operations per second of `flops` done in `ms` milliseconds.
fn tops(flops: f64, ms: f64) -> f64 {
    flops / (ms * 1e-3) / 1e12
}

// ---------------------------------------------------------------------------------------------
// Device helpers: events, memory.

fn cuda<T>(what: &str, r: std::result::Result<T, cudarc::driver::DriverError>) -> Result<T> {
    r.map_err(|e| anyhow::anyhow!("CUDA {what}: {e:?}"))
}

/// An event that can time (cudarc's default events have timing disabled).
fn mark(gpu: &Gpu) -> Result<CudaEvent> {
    cuda(
        "event record",
        gpu.dev.stream.record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)),
    )
}

fn sync(gpu: &Gpu) -> Result<()> {
    cuda("synchronize", gpu.dev.stream.synchronize())
}

/// Peak device memory of one forward + backward, counting one input set (Q, K, V, dO) plus what
/// the calls allocate, as the SDPA script counts it.
#[derive(Clone, Copy, Debug, Default, Serialize)]
struct MemPeak {
    /// Pool high-water mark of live allocations (None without memory pools).
    live: Option<u64>,
    /// Drop of cuMemGetInfo's free memory from a trimmed pool to samples taken after the forward
    /// and after the backward returned (no synchronization in between): reserved bytes.
    reserved: u64,
}

fn input_bytes(s: &Shape) -> u64 {
    2 * (2 * s.q_len() + 2 * s.kv_len()) as u64
}

fn peak_memory(gpu: &Gpu, pool: Option<&Pool>, x: &DeviceInputs, cfg: &Config) -> Result<MemPeak> {
    sync(gpu)?;
    if let Some(p) = pool {
        p.trim()?;
    }
    let free0 = gpu.dev.free_memory()?;
    let used0 = pool.map(Pool::reset_high).transpose()?;
    let (fwd, saved) = gpu.forward(x, cfg)?;
    let free1 = gpu.dev.free_memory()?;
    let grads = gpu.backward(x, &fwd, &saved, d_o(x)?)?;
    let free2 = gpu.dev.free_memory()?;
    sync(gpu)?;
    let live = match (pool, used0) {
        (Some(p), Some(u0)) => Some(p.high()?.saturating_sub(u0) + input_bytes(&x.shape)),
        _ => None,
    };
    drop((fwd, saved, grads));
    let reserved = (free0.saturating_sub(free1.min(free2))) as u64 + input_bytes(&x.shape);
    Ok(MemPeak { live, reserved })
}

fn d_o(x: &DeviceInputs) -> Result<&cudarc::driver::CudaSlice<u16>> {
    x.d_o.as_ref().context("input set without dO")
}

// ---------------------------------------------------------------------------------------------
// Timing.

/// Repetition limits of one point.
#[derive(Clone, Copy, Debug)]
struct Reps {
    max: usize,
    min: usize,
    max_ms: f64,
}

/// Runs `body` (which records three events around two stages and returns them) up to `reps.max`
/// times over the rotating input sets, keeping one repetition queued ahead of the one being read
/// so the GPU never idles between them, and stops early once the finished repetitions took
/// `reps.max_ms` (with at least `reps.min`). Returns per repetition (stage 1 ms, stage 2 ms).
fn time_stages<F>(
    sets: &[DeviceInputs],
    reps: Reps,
    mut tick: impl FnMut(usize),
    mut body: F,
) -> Result<Vec<(f64, f64)>>
where
    F: FnMut(&DeviceInputs) -> Result<[CudaEvent; 3]>,
{
    let read = |e: &[CudaEvent; 3]| -> Result<(f64, f64)> {
        let a = cuda("event elapsed", e[0].elapsed_ms(&e[1]))? as f64;
        let b = cuda("event elapsed", e[1].elapsed_ms(&e[2]))? as f64;
        Ok((a, b))
    };
    let mut done: Vec<(f64, f64)> = Vec::new();
    let mut pending: Option<[CudaEvent; 3]> = None;
    for rep in 0..reps.max {
        let events = body(&sets[rep % sets.len()])?;
        if let Some(prev) = pending.replace(events) {
            done.push(read(&prev)?);
            tick(done.len());
        }
        let spent: f64 = done.iter().map(|(a, b)| a + b).sum();
        if done.len() + 1 >= reps.min && spent >= reps.max_ms {
            break;
        }
    }
    if let Some(last) = pending {
        done.push(read(&last)?);
        tick(done.len());
    }
    Ok(done)
}

/// Forward + backward with events before, between and after.
fn fwd_bwd(gpu: &Gpu, x: &DeviceInputs, cfg: &Config) -> Result<[CudaEvent; 3]> {
    let e0 = mark(gpu)?;
    let (fwd, saved) = gpu.forward(x, cfg)?;
    let e1 = mark(gpu)?;
    let _grads = gpu.backward(x, &fwd, &saved, d_o(x)?)?;
    let e2 = mark(gpu)?;
    // Outputs are freed here, stream-ordered after e2: outside the timed region.
    Ok([e0, e1, e2])
}

/// The Q/K/V quantization (first stage of `Gpu::forward`) and the dO quantization (part of the
/// backward preprocess), timed alone through the crate's public quantize module: what the kernel
/// paths of `cfg` need of them (nothing for all-BF16 presets on the tensor-core paths).
fn quant_only(gpu: &Gpu, x: &DeviceInputs, cfg: &Config) -> Result<[CudaEvent; 3]> {
    let k = gpu.kernels(x.shape.head_dim)?;
    let e0 = mark(gpu)?;
    let q = quantize_inputs(gpu, &k, x, cfg)?;
    let e1 = mark(gpu)?;
    let _qdo = quantize_do(gpu, &k, x, d_o(x)?, q.needs)?;
    let e2 = mark(gpu)?;
    Ok([e0, e1, e2])
}

/// Back-to-back forward + backward for `secs` between two synchronized reads of the energy counter;
/// the SM clock is sampled half-way, when a power cap has had time to pull it down (in the first
/// tens of ms it still reads the maximum).
fn energy_phase(
    gpu: &Gpu,
    sets: &[DeviceInputs],
    cfg: &Config,
    meter: &EnergyMeter,
    secs: f64,
) -> Result<EnergyRecord> {
    sync(gpu)?;
    let span = meter.start()?;
    let reps = Reps {
        max: usize::MAX,
        min: 1,
        max_ms: secs * 1e3,
    };
    let mut clock = None;
    let passes = time_stages(
        sets,
        reps,
        |_| {
            if clock.is_none() && span.elapsed_secs() >= secs / 2.0 {
                clock = meter.sm_clock_mhz().ok();
            }
        },
        |x| fwd_bwd(gpu, x, cfg),
    )?
    .len();
    sync(gpu)?;
    let e = meter.since(&span)?;
    let clock = match clock {
        Some(c) => c,
        None => meter.sm_clock_mhz()?,
    };
    Ok(EnergyRecord {
        joules_per_fwdbwd: e.per(passes).context("no forward + backward in the energy phase")?,
        watts: e.watts(),
        sm_clock_mhz: clock,
        passes,
        seconds: e.seconds,
    })
}

/// Measured numbers of one point; times in ms (medians), throughput in TOPS.
#[derive(Clone, Debug, Serialize)]
struct Record {
    #[serde(rename = "impl")]
    implementation: String,
    head_dim: usize,
    n: usize,
    batch: usize,
    heads: usize,
    causal: bool,
    fwd_flops: f64,
    fwd_ms: f64,
    bwd_ms: f64,
    fwdbwd_ms: f64,
    fwd_tops: f64,
    bwd_tops: f64,
    fwdbwd_tops: f64,
    reps: usize,
    /// Q, K, V quantization alone (included in fwd_ms).
    quant_ms: f64,
    /// dO quantization alone (included in bwd_ms).
    quant_do_ms: f64,
    /// One input set + the high-water mark of what forward + backward allocate (see `mem_method`).
    peak_mem_bytes: u64,
    /// The same from free device memory (pool reservations included).
    peak_mem_reserved_bytes: u64,
    /// Board energy per forward + backward (J), mean board power (W) and SM clock (MHz, sampled while
    /// the phase ran) of the `--energy` phase; absent without it.
    #[serde(skip_serializing_if = "Option::is_none")]
    energy: Option<EnergyRecord>,
    fwd_ms_all: Vec<f64>,
    bwd_ms_all: Vec<f64>,
    /// Wall-clock span (Unix seconds) of the timed repetitions, so that an SM-clock and power log taken beside
    /// the bench (scripts/gpu/bench.sh) can be matched to each point: the H200 reaches its 700 W cap at some
    /// shapes and lowers its clock.
    timed_unix_s: [f64; 2],
}

#[derive(Clone, Copy, Debug, Serialize)]
struct EnergyRecord {
    joules_per_fwdbwd: f64,
    watts: f64,
    sm_clock_mhz: u32,
    passes: usize,
    seconds: f64,
}

/// What every point of one sweep shares.
struct Bench<'a> {
    gpu: &'a Gpu,
    pool: Option<Pool>,
    cfg: &'a Config,
    name: &'a str,
    reps: Reps,
    warmup: usize,
    bar: ProgressBar,
    /// NVML and the seconds of the energy phase (`--energy`).
    energy: Option<(EnergyMeter, f64)>,
}

/// Times one point: warm-up, peak memory, forward/backward repetitions, quantization alone.
fn run_point(b: &Bench, sets: &[DeviceInputs], p: &Point) -> Result<Record> {
    let (gpu, cfg, reps, label) = (b.gpu, b.cfg, b.reps, p.label());
    b.bar.set_message(format!("{label}: warm-up"));
    for i in 0..b.warmup {
        fwd_bwd(gpu, &sets[i % sets.len()], cfg)?;
    }
    sync(gpu)?;
    let mem = peak_memory(gpu, b.pool.as_ref(), &sets[0], cfg)?;
    let tick = |i| b.bar.set_message(format!("{label}: rep {i}/{}", reps.max));
    let t_start = unix_seconds();
    let timed = time_stages(sets, reps, tick, |x| fwd_bwd(gpu, x, cfg))?;
    let timed_unix_s = [t_start, unix_seconds()];
    b.bar.set_message(format!("{label}: quantization alone"));
    // Memory-bound and short: a quarter of the time budget is plenty.
    let quant_reps = Reps {
        max: reps.max,
        min: reps.min.min(3),
        max_ms: reps.max_ms / 4.0,
    };
    let quant = time_stages(sets, quant_reps, |_| {}, |x| quant_only(gpu, x, cfg))?;

    let energy = match &b.energy {
        Some((meter, secs)) => {
            b.bar.set_message(format!("{label}: energy"));
            Some(energy_phase(gpu, sets, cfg, meter, *secs)?)
        }
        None => None,
    };

    let fwd: Vec<f64> = timed.iter().map(|t| t.0).collect();
    let bwd: Vec<f64> = timed.iter().map(|t| t.1).collect();
    let both: Vec<f64> = timed.iter().map(|t| t.0 + t.1).collect();
    let flops = p.fwd_flops();
    let (fwd_ms, bwd_ms, fwdbwd_ms) = (median(&fwd), median(&bwd), median(&both));
    let s = &p.shape;
    Ok(Record {
        implementation: b.name.to_string(),
        head_dim: s.head_dim,
        n: s.n_q,
        batch: s.batch,
        heads: s.heads_q,
        causal: p.causal,
        fwd_flops: flops,
        fwd_ms,
        bwd_ms,
        fwdbwd_ms,
        fwd_tops: tops(flops, fwd_ms),
        bwd_tops: tops(2.5 * flops, bwd_ms),
        fwdbwd_tops: tops(3.5 * flops, fwdbwd_ms),
        reps: timed.len(),
        quant_ms: median(&quant.iter().map(|t| t.0).collect::<Vec<_>>()),
        quant_do_ms: median(&quant.iter().map(|t| t.1).collect::<Vec<_>>()),
        peak_mem_bytes: mem.live.unwrap_or(mem.reserved),
        peak_mem_reserved_bytes: mem.reserved,
        energy,
        fwd_ms_all: fwd,
        bwd_ms_all: bwd,
        timed_unix_s,
    })
}

/// Seconds since the Unix epoch (0 if the system clock is before it).
fn unix_seconds() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

// ---------------------------------------------------------------------------------------------
// Inputs.

/// `count` random input sets for `shape`, generated on parallel host threads and uploaded.
fn input_sets(gpu: &Gpu, shape: Shape, count: usize, seed: u64) -> Result<Vec<DeviceInputs>> {
    let hosts = std::thread::scope(|scope| {
        let jobs: Vec<_> = (0..count as u64)
            .map(|i| scope.spawn(move || random(shape, false, 1.0, seed + i, true)))
            .collect();
        jobs.into_iter()
            .map(|j| j.join())
            .collect::<std::result::Result<Vec<_>, _>>()
    })
    .map_err(|_| anyhow::anyhow!("input generation thread panicked"))?;
    hosts
        .iter()
        .map(|h| gpu.upload(h).context("uploading an input set"))
        .collect()
}

/// Points the input sets at another shape of the same element counts (the standard sweep keeps
/// B·N·H·D fixed, so one upload serves every point).
fn reshape(sets: &mut [DeviceInputs], p: &Point) {
    for x in sets {
        x.shape = p.shape;
        x.causal = p.causal;
    }
}

// ---------------------------------------------------------------------------------------------
// Output.

fn table(records: &[Record]) -> String {
    let energy = records.iter().any(|r| r.energy.is_some());
    let mut out = String::from(
        "| D | N | B | H | causal | fwd ms | bwd ms | fwd+bwd ms | fwd TOPS | bwd TOPS | fwd+bwd TOPS | quant QKV ms | quant dO ms | peak MiB | reps |",
    );
    out.push_str(if energy {
        " J / fwd+bwd | board W | SM MHz |\n"
    } else {
        "\n"
    });
    out.push_str(&"|---".repeat(if energy { 18 } else { 15 }));
    out.push_str("|\n");
    for r in records {
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.3} | {:.3} | {:.3} | {:.2} | {:.2} | {:.2} | {:.3} | {:.3} | {:.0} | {} |",
            r.head_dim,
            r.n,
            r.batch,
            r.heads,
            if r.causal { "yes" } else { "no" },
            r.fwd_ms,
            r.bwd_ms,
            r.fwdbwd_ms,
            r.fwd_tops,
            r.bwd_tops,
            r.fwdbwd_tops,
            r.quant_ms,
            r.quant_do_ms,
            r.peak_mem_bytes as f64 / (1u64 << 20) as f64,
            r.reps
        ));
        match (energy, r.energy) {
            (false, _) => {}
            (true, Some(e)) => out.push_str(&format!(
                " {:.4} | {:.0} | {} |",
                e.joules_per_fwdbwd, e.watts, e.sm_clock_mhz
            )),
            (true, None) => out.push_str(" – | – | – |"),
        }
        out.push('\n');
    }
    out
}

#[derive(Serialize)]
struct Report<'a> {
    tool: &'static str,
    version: &'static str,
    device: String,
    #[serde(rename = "impl")]
    implementation: &'a str,
    config: String,
    /// Which kernel path of sagebwd-cuda ran: "tensor-core" or "scalar".
    kernels: &'static str,
    timing: &'static str,
    flops: &'static str,
    mem_method: &'static str,
    settings: Settings,
    results: &'a [Record],
}

#[derive(Serialize)]
struct Settings {
    tokens: usize,
    hidden: usize,
    reps: u64,
    min_reps: u64,
    warmup: u64,
    max_time_s: f64,
    input_sets: u64,
    seed: u64,
    lean_memory: bool,
    energy_s: f64,
}

const TIMING: &str = "CUDA events on the kernels' stream around Gpu::forward (quantization + forward) and \
                      Gpu::backward (preprocess, main, postprocess), after warm-up; median over repetitions; \
                      inputs rotated among device-resident sets; the CUDA memory pool keeps freed memory \
                      (release threshold = max), as PyTorch's caching allocator does";
const FLOPS: &str = "fwd = 4*B*H*N*N*D (halved for causal), bwd = 2.5 x fwd, fwd+bwd = 3.5 x fwd";
const MEM_POOL: &str = "one input set (Q,K,V,dO) + high-water mark of live allocations during forward+backward \
                        (CUDA memory pool USED_MEM_HIGH; like torch.cuda.max_memory_allocated)";
const MEM_FREE: &str = "one input set (Q,K,V,dO) + drop of free device memory (cuMemGetInfo) sampled after forward \
                        and after backward (no memory pools on this device)";

// ---------------------------------------------------------------------------------------------

pub fn run(a: BenchArgs) -> Result<()> {
    ensure!(
        a.energy.is_finite() && a.energy >= 0.0,
        "--energy takes seconds ≥ 0 (0: off), got {}",
        a.energy
    );
    let cfg = a.config.config()?;
    let points = sweep(&a)?;
    if let Some(arch) = &a.precompile {
        return precompile(arch, &a.head_dim);
    }
    let gpu = Gpu::new().context("sagebwd bench needs a CUDA GPU (it never falls back to the CPU simulator)")?;
    // Timing runs without the poison fills of checked mode (verify.sh checks the same kernels with them).
    gpu.set_poison(a.checked);
    for p in &points {
        sagebwd_cuda::check_supported(&p.shape, &cfg)?;
    }
    if a.scalar {
        gpu.set_tensor_cores(false);
    }
    if a.lean_memory {
        gpu.set_backward_groups(GroupPolicy::Lean);
    }
    let kernels = if gpu.tensor_cores() { "tensor-core" } else { "scalar" };
    let name = format!(
        "ours-{}{}{}",
        cfg.label(),
        if a.scalar { "-scalar" } else { "" },
        if a.lean_memory { "-lean" } else { "" }
    );
    eprintln!(
        "device: {}; config: {}; {kernels} kernels",
        gpu.describe(),
        describe(&cfg)
    );
    // A failing point ends the sweep, but the points already measured are still reported.
    let (records, failure) = run_sweep(&gpu, &cfg, &a, &points, &name)?;
    let pool_used = Pool::of(&gpu)?.is_some();

    println!(
        "# sagebwd bench: {}, {kernels} kernels, on {}\n",
        describe(&cfg),
        gpu.describe()
    );
    print!("{}", table(&records));
    println!(
        "\nTOPS: {FLOPS}. Times: {TIMING}. Peak memory: {}.",
        if pool_used { MEM_POOL } else { MEM_FREE }
    );
    if let Some(path) = &a.json {
        let report = Report {
            tool: "sagebwd bench",
            version: env!("CARGO_PKG_VERSION"),
            device: gpu.describe(),
            implementation: &name,
            config: describe(&cfg),
            kernels,
            timing: TIMING,
            flops: FLOPS,
            mem_method: if pool_used { MEM_POOL } else { MEM_FREE },
            settings: Settings {
                tokens: a.tokens,
                hidden: a.hidden,
                reps: a.reps,
                min_reps: a.min_reps,
                warmup: a.warmup,
                max_time_s: a.max_time,
                input_sets: a.input_sets,
                seed: a.seed,
                lean_memory: a.lean_memory,
                energy_s: a.energy,
            },
            results: &records,
        };
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    failure.map_or(Ok(()), Err)
}

/// Every point, with a progress bar weighted by each point's FLOPs (cost grows with N).
/// Returns the records and, if a point failed, its error (the sweep stops there).
fn run_sweep(
    gpu: &Gpu,
    cfg: &Config,
    a: &BenchArgs,
    points: &[Point],
    name: &str,
) -> Result<(Vec<Record>, Option<anyhow::Error>)> {
    let pool = Pool::of(gpu)?;
    if let Some(p) = &pool {
        p.keep_freed_memory()?;
    }
    let work: Vec<u64> = points.iter().map(|p| (p.fwd_flops() / 1e9).ceil() as u64).collect();
    let bar = ProgressBar::new(work.iter().sum());
    bar.set_style(ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {bar:30} {percent:>3}% eta {eta} {msg}",
    )?);
    let energy = match a.energy {
        s if s > 0.0 => Some((
            EnergyMeter::open(&gpu.dev).context("--energy reads the GPU's energy counter through NVML")?,
            s,
        )),
        _ => None,
    };
    let bench = Bench {
        gpu,
        pool,
        cfg,
        name,
        bar,
        energy,
        reps: Reps {
            max: a.reps as usize,
            min: a.min_reps.min(a.reps) as usize,
            max_ms: a.max_time * 1e3,
        },
        warmup: a.warmup as usize,
    };
    let quiet_bar = !std::io::stderr().is_terminal();
    let mut sets: Vec<DeviceInputs> = Vec::new();
    let mut records = Vec::new();
    for (p, w) in points.iter().zip(work) {
        let t0 = Instant::now();
        let measured = ensure_sets(gpu, &mut sets, p, a)
            .and_then(|()| load_kernels(gpu, p.shape.head_dim, &bench.bar))
            .and_then(|()| {
                reshape(&mut sets, p);
                run_point(&bench, &sets, p)
            })
            .with_context(|| format!("{name} at {}", p.label()));
        let r = match measured {
            Ok(r) => r,
            Err(e) => {
                bench.bar.finish_and_clear();
                return Ok((records, Some(e)));
            }
        };
        if quiet_bar {
            // No terminal (logs, the device script): one line per point instead of the bar.
            let energy = r.energy.map_or(String::new(), |e| {
                format!(
                    ", {:.4} J per fwd+bwd at {:.0} W and {} MHz",
                    e.joules_per_fwdbwd, e.watts, e.sm_clock_mhz
                )
            });
            eprintln!(
                "{name} {}: fwd+bwd {:.3} ms = {:.2} TOPS, {} reps{energy}, {:.1} s",
                p.label(),
                r.fwdbwd_ms,
                r.fwdbwd_tops,
                r.reps,
                t0.elapsed().as_secs_f64()
            );
        }
        records.push(r);
        bench.bar.inc(w);
    }
    bench.bar.finish_and_clear();
    Ok((records, None))
}

/// (Re)creates the input sets when the point needs other element counts than the current ones.
fn ensure_sets(gpu: &Gpu, sets: &mut Vec<DeviceInputs>, p: &Point, a: &BenchArgs) -> Result<()> {
    let fits = |x: &DeviceInputs| x.q.len() == p.shape.q_len() && x.k.len() == p.shape.kv_len();
    if !sets.is_empty() && sets.iter().all(fits) {
        return Ok(());
    }
    sets.clear();
    sync(gpu)?;
    let need = sagebwd_cuda::device_bytes(&p.shape, true) as u64 + a.input_sets * input_bytes(&p.shape);
    let free = gpu.dev.free_memory()? as u64;
    if need + (512 << 20) > free {
        bail!(
            "{} needs about {:.2} GiB of device memory with {} input sets, {:.2} GiB are free",
            p.label(),
            need as f64 / (1u64 << 30) as f64,
            a.input_sets,
            free as f64 / (1u64 << 30) as f64
        );
    }
    *sets = input_sets(gpu, p.shape, a.input_sets as usize, a.seed)?;
    Ok(())
}

/// Kernel loading (NVRTC compile or cache read) happens once per head dimension, never in a timing.
fn load_kernels(gpu: &Gpu, head_dim: usize, bar: &ProgressBar) -> Result<()> {
    bar.set_message(format!(
        "loading the D={head_dim} kernels (a cold NVRTC compile takes about a minute)"
    ));
    gpu.kernels(head_dim)
        .with_context(|| format!("loading the kernels for head dim {head_dim}"))?;
    Ok(())
}

/// Fills the kernel cache for `arch` without a GPU (the device script then skips NVRTC).
fn precompile(arch: &str, head_dims: &[usize]) -> Result<()> {
    for &d in head_dims {
        sagebwd_cuda::runtime::compile_all(arch, d).with_context(|| format!("precompiling {arch}, head dim {d}"))?;
    }
    let dir = sagebwd_cuda::runtime::cache_dir()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| "(no cache dir)".into());
    println!("kernels for {arch}, head dims {head_dims:?}: cached in {dir}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    fn args(extra: &[&str]) -> BenchArgs {
        let mut v = vec!["bench"];
        v.extend_from_slice(extra);
        Cli::try_parse_from(v).unwrap().bench
    }

    #[test]
    fn standard_sweep_has_twenty_points_of_constant_size() {
        let pts = sweep(&args(&[])).unwrap();
        assert_eq!(pts.len(), 2 * 2 * 5);
        for p in &pts {
            let s = p.shape;
            assert_eq!(s.batch * s.n_q, 16384);
            assert_eq!(s.heads_q * s.head_dim, 2048);
            // One upload serves every point.
            assert_eq!(s.q_len(), 16384 * 2048);
        }
        assert_eq!(
            pts[0].shape,
            Shape {
                batch: 16,
                heads_q: 32,
                heads_kv: 32,
                n_q: 1024,
                n_k: 1024,
                head_dim: 64
            }
        );
        assert!(!pts[0].causal && pts[5].causal);
    }

    #[test]
    fn restricting_flags_and_bad_sizes() {
        let pts = sweep(&args(&["--head-dim", "128", "-n", "4096", "--causal", "on"])).unwrap();
        assert_eq!(pts.len(), 1);
        assert!(pts[0].causal && pts[0].shape.batch == 4 && pts[0].shape.heads_q == 16);
        let err = sweep(&args(&["-n", "3000"])).unwrap_err().to_string();
        assert!(err.contains("not a multiple of N = 3000"), "{err}");
        let err = sweep(&args(&["-d", "96"])).unwrap_err().to_string();
        assert!(err.contains("head dim 96"), "{err}");
        assert!(args(&["--lean-memory"]).lean_memory && !args(&[]).lean_memory);
    }

    #[test]
    fn flops_follow_the_flashattention_convention() {
        let p = sweep(&args(&["-d", "128", "-n", "4096", "--causal", "off"])).unwrap()[0];
        let f = 4.0 * 4.0 * 16.0 * 4096.0 * 4096.0 * 128.0;
        assert_eq!(p.fwd_flops(), f);
        assert_eq!(Point { causal: true, ..p }.fwd_flops(), f / 2.0);
        // 1 ms for 1e12 operations is 1000 TOPS.
        assert!((tops(1e12, 1.0) - 1000.0).abs() < 1e-9);
    }

    #[test]
    fn median_of_odd_and_even_samples() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[7.0]), 7.0);
    }

    fn record() -> Record {
        Record {
            implementation: "ours-sagebwd".into(),
            head_dim: 128,
            n: 4096,
            batch: 4,
            heads: 16,
            causal: true,
            fwd_flops: 1e12,
            fwd_ms: 1.0,
            bwd_ms: 2.0,
            fwdbwd_ms: 3.0,
            fwd_tops: 1000.0,
            bwd_tops: 1250.0,
            fwdbwd_tops: 1166.7,
            reps: 20,
            quant_ms: 0.1,
            quant_do_ms: 0.05,
            peak_mem_bytes: 3 << 30,
            peak_mem_reserved_bytes: 3 << 30,
            energy: None,
            fwd_ms_all: vec![1.0],
            bwd_ms_all: vec![2.0],
            timed_unix_s: [1.0, 2.0],
        }
    }

    #[test]
    fn energy_columns_only_when_measured() {
        let mut with = record();
        with.energy = Some(EnergyRecord {
            joules_per_fwdbwd: 0.6721,
            watts: 631.2,
            sm_clock_mhz: 1980,
            passes: 9388,
            seconds: 10.0,
        });
        let t = table(&[with.clone(), record()]);
        let rows: Vec<&str> = t.lines().collect();
        assert!(rows[0].ends_with("| J / fwd+bwd | board W | SM MHz |"), "{t}");
        // Every row has the same number of cells as the header.
        let cells = |l: &str| l.matches('|').count();
        assert!(rows.iter().all(|l| cells(l) == cells(rows[0])), "{t}");
        assert!(rows[2].ends_with("| 0.6721 | 631 | 1980 |"), "{t}");
        assert!(rows[3].ends_with("| – | – | – |"), "{t}");
        assert!(!table(&[record()]).contains("J / fwd+bwd"));
        let v = serde_json::to_value(&with).unwrap();
        assert_eq!(v["energy"]["sm_clock_mhz"], 1980);
        assert!(serde_json::to_value(record()).unwrap().get("energy").is_none());
    }

    #[test]
    fn negative_energy_seconds_are_refused_before_any_gpu_work() {
        let e = run(args(&["--energy=-1"])).unwrap_err().to_string();
        assert!(e.contains("--energy takes seconds"), "{e}");
    }

    #[test]
    fn table_has_one_row_per_record() {
        let t = table(&[record(), record()]);
        assert_eq!(t.lines().count(), 4);
        assert!(
            t.contains("| 128 | 4096 | 4 | 16 | yes | 1.000 | 2.000 | 3.000 | 1000.00 |"),
            "{t}"
        );
        assert!(t.contains("| 3072 | 20 |"), "{t}");
    }

    /// scripts/gpu/compare.py reads these keys from both our JSON and bench_sdpa.py's.
    #[test]
    fn json_has_the_keys_compare_py_reads() {
        let records = [record()];
        let report = Report {
            tool: "sagebwd bench",
            version: "0",
            device: "GPU".into(),
            implementation: "ours-sagebwd",
            config: "c".into(),
            kernels: "scalar",
            timing: TIMING,
            flops: FLOPS,
            mem_method: MEM_POOL,
            settings: Settings {
                tokens: 16384,
                hidden: 2048,
                reps: 20,
                min_reps: 3,
                warmup: 2,
                max_time_s: 10.0,
                input_sets: 3,
                seed: 0,
                lean_memory: false,
                energy_s: 0.0,
            },
            results: &records,
        };
        let v = serde_json::to_value(&report).unwrap();
        for key in ["device", "tool", "config", "settings", "results"] {
            assert!(v.get(key).is_some(), "{key}");
        }
        let r = &v["results"][0];
        for key in [
            "impl",
            "head_dim",
            "n",
            "causal",
            "fwd_tops",
            "bwd_tops",
            "fwdbwd_tops",
            "fwd_ms",
            "bwd_ms",
            "fwdbwd_ms",
            "quant_ms",
            "quant_do_ms",
            "peak_mem_bytes",
            "timed_unix_s",
        ] {
            assert!(r.get(key).is_some(), "{key}");
        }
        assert_eq!(r["impl"], "ours-sagebwd");
    }

    /// Without a GPU the bench is an error that says so; it never falls back to the simulator.
    #[test]
    fn no_gpu_is_an_error_not_a_fallback() {
        if Gpu::new().is_ok() {
            return; // a GPU machine: this would run a real benchmark
        }
        let err = format!(
            "{:#}",
            run(args(&["-d", "64", "-n", "1024", "--causal", "off"])).unwrap_err()
        );
        assert!(
            err.contains("needs a CUDA GPU") && err.contains("never falls back"),
            "{err}"
        );
        assert_eq!(err.lines().count(), 1, "{err}");
    }
}
