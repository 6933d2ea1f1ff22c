//! `sagebwd train-check`: the GPU training step against the CPU one (loss, every gradient, a short
//! training run) on small models; exit code 1 when anything is outside its tolerance. The
//! comparison and the derivation of the tolerances live in `sagebwd_train::gpu::check`.

use anyhow::{bail, Result};
use clap::Args;
use sagebwd_train::gpu::check;

#[derive(Args, Debug)]
pub struct TrainCheckArgs {
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 2)]
    pub batch: usize,
    /// Sequence length (odd lengths exercise the attention kernels' partial blocks).
    #[arg(long, default_value_t = 200)]
    pub seq: usize,
    /// Training steps of the trajectory comparison.
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
}

pub fn run(a: TrainCheckArgs) -> Result<()> {
    let mut all_ok = true;
    for model in check::models() {
        let r = check::run(&model, a.batch, a.seq, a.steps)?;
        println!("\n# model {}; batch {} × seq {}", r.model.describe(), r.batch, r.seq);
        println!("GPU: {}", r.device);
        let verdict = |ok: bool| if ok { "ok" } else { "FAIL" };
        println!(
            "loss: cpu {:.6}, gpu {:.6}, |diff| {:.2e} (tolerance {:.0e}) {}",
            r.loss_cpu,
            r.loss_gpu,
            (r.loss_cpu - r.loss_gpu).abs(),
            check::TOL_LOSS,
            verdict(r.loss_ok())
        );
        println!("| gradient | CPU L2 norm | rel L2 GPU vs CPU | tolerance | |");
        println!("|---|---|---|---|---|");
        for row in &r.grads {
            println!(
                "| {} | {:.3e} | {:.2e} | {:.0e} | {} |",
                row.name,
                row.cpu_norm,
                row.rel_l2,
                row.tolerance,
                verdict(row.ok())
            );
        }
        println!(
            "after {} training steps: loss cpu {:.4}, gpu {:.4}, relative diff {:.2e} (tolerance {:.0e}) {}",
            r.steps,
            r.final_loss_cpu,
            r.final_loss_gpu,
            ((r.final_loss_cpu - r.final_loss_gpu) / r.final_loss_cpu).abs(),
            check::TOL_TRAJECTORY,
            verdict(r.trajectory_ok())
        );
        all_ok &= r.ok();
    }
    if !all_ok {
        bail!("the GPU training step disagrees with the CPU one beyond the tolerances (see FAIL above)");
    }
    println!("\nall checks passed");
    Ok(())
}
