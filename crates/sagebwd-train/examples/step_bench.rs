//! Time of one forward + backward of a model on the CPU, and of its LM head alone:
//! `cargo run --release -p sagebwd-train --example step_bench [model] [attention] [tokens]`.

use sagebwd_train::backend::{cpu::CpuBackend, Attention};
use sagebwd_train::config::ModelConfig;
use sagebwd_train::layers::loss::{lm_head_loss, LossGrad};
use sagebwd_train::model::{Batch, Model, Weights};
use sagebwd_train::rng::Rng;
use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let cfg = ModelConfig::preset(args.get(1).map_or("tiny", String::as_str)).unwrap();
    let be = CpuBackend::new(Attention::parse(args.get(2).map_or("sagebwd", String::as_str)).unwrap());
    let tokens: usize = args.get(3).map_or(512, |s| s.parse().unwrap());
    let seq = 128.min(tokens);
    let mut rng = Rng::new(1);
    let model = Model::new(cfg.clone(), Weights::init(&cfg, &mut rng));
    let ids: Vec<u32> = (0..tokens + 1).map(|_| rng.below(cfg.vocab_size) as u32).collect();
    let batch = Batch {
        inputs: &ids[..tokens],
        targets: &ids[1..],
        batch: tokens / seq,
        seq,
    };
    let mut grads = Weights::zeros(&cfg);
    let reps = 5;
    let t = Instant::now();
    for _ in 0..reps {
        model
            .forward_backward(&be, &batch, &mut grads, 1.0 / tokens as f32)
            .unwrap();
    }
    let step = t.elapsed().as_secs_f64() / reps as f64;
    let hidden = vec![0.1f32; tokens * cfg.dim];
    let (mut dh, mut dt) = (vec![0.0f32; hidden.len()], vec![0.0f32; model.weights.tok_emb.len()]);
    let t = Instant::now();
    for _ in 0..reps {
        let g = LossGrad {
            scale: 1.0,
            d_hidden: &mut dh,
            d_table: &mut dt,
        };
        lm_head_loss(&be, &hidden, &model.weights.tok_emb, cfg.dim, &ids[1..], Some(g));
    }
    let head = t.elapsed().as_secs_f64() / reps as f64;
    println!(
        "{tokens} tokens: forward+backward {:.0} ms ({:.0} tokens/s), of which LM head + loss {:.0} ms",
        step * 1e3,
        tokens as f64 / step,
        head * 1e3
    );
}
