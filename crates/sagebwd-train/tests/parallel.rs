//! Data parallelism without GPUs: `DataParallel` over CPU engines must compute the same step as one
//! engine on the whole micro-batch (up to f32 summation order), keep its replicas identical, split
//! uneven batches, and refuse several GPUs on the CPU.

use sagebwd_train::backend::Attention;
use sagebwd_train::config::ModelConfig;
use sagebwd_train::engine::{CpuEngine, Engine};
use sagebwd_train::model::{Batch, Model, Weights};
use sagebwd_train::optim::AdamWConfig;
use sagebwd_train::parallel::{shares, DataParallel};
use sagebwd_train::rng::Rng;
use sagebwd_train::train::{make_engine, DeviceChoice, TrainConfig};

mod common;

const SEQ: usize = 16;

fn model() -> ModelConfig {
    ModelConfig {
        vocab_size: 97,
        dim: 32,
        n_layers: 2,
        n_heads: 2,
        n_kv_heads: 1,
        ffn_hidden: 48,
        max_seq_len: 32,
        ..ModelConfig::preset("tiny").unwrap()
    }
}

fn engine(w: &Weights) -> CpuEngine {
    CpuEngine::new(
        Model::new(model(), w.clone()),
        AdamWConfig::default(),
        Attention::parse("sagebwd").unwrap(),
    )
}

fn tokens(sequences: usize, seed: u64) -> (Vec<u32>, Vec<u32>) {
    let mut rng = Rng::new(seed);
    let all: Vec<u32> = (0..sequences * SEQ + 1).map(|_| (rng.next_u64() % 97) as u32).collect();
    (all[..sequences * SEQ].to_vec(), all[1..].to_vec())
}

fn max_rel_diff(a: &Weights, b: &Weights) -> f64 {
    let (mut diff, mut norm) = (0.0f64, 0.0f64);
    for (x, y) in a.tensors().into_iter().zip(b.tensors()) {
        for (p, q) in x.iter().zip(y) {
            diff = diff.max((p - q).abs() as f64);
            norm = norm.max(p.abs() as f64);
        }
    }
    diff / norm.max(1e-30)
}

#[test]
fn shares_are_contiguous_and_balanced() {
    for n in 0..12 {
        for r in 1..5 {
            let s = shares(n, r);
            assert_eq!(s.len(), r);
            let mut next = 0;
            for &(first, len) in &s {
                assert_eq!(first, next, "n {n}, replicas {r}: {s:?}");
                assert!(len == n / r || len == n / r + 1, "n {n}, replicas {r}: {s:?}");
                next += len;
            }
            assert_eq!(next, n);
        }
    }
}

/// Two accumulated micro-batches and two optimizer steps, on 1 engine and on 2 (and 3) replicas.
#[test]
fn replicas_compute_the_single_engine_step_and_stay_identical() {
    let w = Weights::init(&model(), &mut Rng::new(7));
    for (replicas, sequences) in [(2, 4), (3, 4), (2, 3)] {
        let mut single = engine(&w);
        let mut group = DataParallel::new((0..replicas).map(|_| engine(&w)).collect()).unwrap();
        for step in 0..2u64 {
            let scale = 1.0 / (2 * sequences * SEQ) as f32;
            single.zero_grads().unwrap();
            group.zero_grads().unwrap();
            let (mut l1, mut l2) = (0.0, 0.0);
            for micro in 0..2 {
                let (inputs, targets) = tokens(sequences, 100 * step + micro);
                let b = Batch {
                    inputs: &inputs,
                    targets: &targets,
                    batch: sequences,
                    seq: SEQ,
                };
                l1 += single.forward_backward(&b, scale).unwrap();
                l2 += group.forward_backward(&b, scale).unwrap();
            }
            assert!(
                (l1 - l2).abs() < 1e-5 * l1.abs(),
                "{replicas} replicas, step {step}: loss {l1} vs {l2}"
            );
            let (n1, n2) = (single.grad_norm().unwrap(), group.grad_norm().unwrap());
            assert!(
                (n1 - n2).abs() < 1e-4 * n1,
                "{replicas} replicas, step {step}: gradient norm {n1} vs {n2}"
            );
            let g = max_rel_diff(&single.gradients().unwrap(), &group.gradients().unwrap());
            assert!(g < 1e-4, "{replicas} replicas, step {step}: gradients differ by {g:e}");
            single.update(1e-2, 0.5).unwrap();
            group.update(1e-2, 0.5).unwrap();
        }
        let after = single.export().unwrap().weights;
        let moved = max_rel_diff(&w, &after);
        assert!(
            moved > 1e-3,
            "the steps must move the weights for the comparison to mean anything ({moved:e})"
        );
        let d = max_rel_diff(&after, &group.export().unwrap().weights);
        assert!(
            d < 1e-4,
            "{replicas} replicas: weights differ from the single engine's by {d:e}"
        );
        for i in 1..replicas {
            let same = max_rel_diff(
                &group.replica(0).export().unwrap().weights,
                &group.replica(i).export().unwrap().weights,
            );
            assert_eq!(same, 0.0, "replica {i} drifted from replica 0");
        }
    }
}

#[test]
fn several_gpus_on_the_cpu_is_an_error_that_says_what_to_do() {
    let model = ModelConfig {
        n_heads: 1,
        n_kv_heads: 1,
        dim: 64,
        ..model()
    };
    let cfg = TrainConfig {
        gpus: 2,
        ..common::one_step_config(model, "sagebwd")
    };
    assert_eq!(cfg.tokens_per_step(), 2 * SEQ);
    let w = Weights::init(&cfg.model, &mut Rng::new(1));
    let err = make_engine(&cfg, w, DeviceChoice::Cpu, false)
        .err()
        .expect("must fail")
        .to_string();
    assert!(err.contains("--device cuda") && err.contains("--gpus 1"), "{err}");
    let zero = TrainConfig { gpus: 0, ..cfg };
    assert!(zero.validate().unwrap_err().to_string().contains("GPUs"));
}
