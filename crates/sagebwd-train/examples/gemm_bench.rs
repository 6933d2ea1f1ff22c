//! GFLOP/s of the CPU GEMM on the shapes one training step of the `tiny` model runs:
//! `cargo run --release -p sagebwd-train --example gemm_bench`.

use sagebwd_train::backend::gemm::{gemm, gemm_at, transpose};
use std::time::Instant;

fn main() {
    let shapes = [
        ("logitsᵀ = E·hᵀ", false, 50257, 64, 256),
        ("dh = dlogits·E", true, 256, 50257, 64),
        ("dE = dlogitsᵀ·h", false, 50257, 256, 64),
        ("mlp up", false, 1024, 64, 176),
        ("dW mlp", true, 176, 1024, 64),
    ];
    for (name, at, m, k, n) in shapes {
        let a = vec![0.5f32; m * k];
        let b = vec![0.25f32; k * n];
        let mut out = vec![0.0f32; m * n];
        let reps = (2e9 / (2.0 * (m * k * n) as f64)).ceil() as usize;
        let t = Instant::now();
        for _ in 0..reps {
            if at {
                gemm_at(&mut out, &a, &b, m, k, n, false);
            } else {
                gemm(&mut out, &a, &b, m, k, n, false);
            }
        }
        let s = t.elapsed().as_secs_f64();
        println!(
            "{name:<18} {m:>6}×{k:>6}×{n:>6}: {:6.1} GFLOP/s",
            2.0 * (m * k * n * reps) as f64 / s / 1e9
        );
    }
    let table = vec![0.5f32; 50257 * 64];
    let t = Instant::now();
    for _ in 0..10 {
        std::hint::black_box(transpose(&table, 50257, 64));
    }
    println!("transpose 50257×64: {:.1} ms", t.elapsed().as_secs_f64() * 100.0);
}
