//! Engine selection and the bookkeeping around it that needs no GPU: which models the GPU path
//! refuses (and that `auto` then falls back to the CPU), the clipping factor, the FLOP count used
//! for MFU, and the CPU engine's state round trip.

use sagebwd_train::backend::Attention;
use sagebwd_train::config::ModelConfig;
use sagebwd_train::engine::{clip_factor, CpuEngine, Engine};
use sagebwd_train::gpu::unsupported_reason;
use sagebwd_train::model::{Batch, Model, ParamLayout, Weights};
use sagebwd_train::optim::AdamWConfig;
use sagebwd_train::rng::Rng;
use sagebwd_train::train::{make_engine, DeviceChoice};

mod common;

fn model(dim: usize, heads: usize) -> ModelConfig {
    ModelConfig {
        vocab_size: 100,
        dim,
        n_layers: 2,
        n_heads: heads,
        n_kv_heads: heads,
        ffn_hidden: 64,
        max_seq_len: 64,
        ..ModelConfig::preset("tiny").unwrap()
    }
}

#[test]
fn the_gpu_path_names_what_it_cannot_run() {
    let fpa = Attention::parse("fpa").unwrap();
    let why = unsupported_reason(&model(32, 4), &fpa).expect("head dim 8 is not supported");
    assert!(why.contains("head dim") && why.contains("8"), "{why}");
    let exact = Attention::parse("exact").unwrap();
    assert!(unsupported_reason(&model(128, 2), &exact).unwrap().contains("exact"));
    assert!(unsupported_reason(&model(128, 2), &fpa).is_none());
    assert!(unsupported_reason(&model(256, 2), &Attention::parse("sagebwd").unwrap()).is_none());
    // Every size preset runs on the GPU kernels.
    for name in ["tiny", "small", "base", "medium"] {
        assert!(
            unsupported_reason(&ModelConfig::preset(name).unwrap(), &fpa).is_none(),
            "{name}"
        );
    }
}

#[test]
fn auto_falls_back_to_the_cpu_for_a_model_the_gpu_cannot_run() {
    let mut cfg = common::one_step_config(model(32, 4), "sagebwd");
    let w = Weights::init(&cfg.model, &mut Rng::new(1));
    let e = make_engine(&cfg, w.clone(), DeviceChoice::Auto, false).unwrap();
    assert!(e.describe().starts_with("cpu"), "{}", e.describe());
    // Forcing the GPU for it is an error that says why, never a silent CPU run.
    cfg.attention = "fpa".into();
    let err = make_engine(&cfg, w, DeviceChoice::Cuda, false)
        .err()
        .expect("must fail")
        .to_string();
    assert!(err.contains("head dim"), "{err}");
}

#[test]
fn clipping_factor() {
    assert_eq!(clip_factor(0.5, 1.0), 1.0);
    assert_eq!(clip_factor(4.0, 1.0), 0.25);
    assert_eq!(clip_factor(4.0, 0.0), 1.0, "0 turns clipping off");
}

/// `flops_per_token(0)` is 6 × the weights of every product; the layout counts the same weights plus
/// the norm gains (and the embedding once), so the two must agree exactly.
#[test]
fn flop_count_matches_the_parameter_layout() {
    for name in ["tiny", "small", "base"] {
        for tied in [true, false] {
            let cfg = ModelConfig {
                tied_embeddings: tied,
                n_kv_heads: 1,
                ..ModelConfig::preset(name).unwrap()
            };
            let layout = ParamLayout::new(&cfg);
            let gains: usize = layout
                .specs
                .iter()
                .filter(|s| s.shape.len() == 1)
                .map(|s| s.shape[0])
                .sum();
            let head = cfg.vocab_size * cfg.dim;
            let product_weights = layout.non_embedding - gains + head;
            assert_eq!(
                cfg.flops_per_token(0),
                6.0 * product_weights as f64,
                "{name} tied={tied}"
            );
            let attention = cfg.flops_per_token(1000) - cfg.flops_per_token(0);
            assert_eq!(attention, 6.0 * (cfg.n_layers * 1000 * cfg.dim) as f64);
        }
    }
}

/// Export then import into a fresh engine gives the same next loss (the checkpoint path).
#[test]
fn cpu_engine_state_round_trips() {
    let cfg = model(32, 2);
    let attn = Attention::parse("fpa").unwrap();
    let mut a = CpuEngine::new(
        Model::new(cfg.clone(), Weights::init(&cfg, &mut Rng::new(3))),
        AdamWConfig::default(),
        attn.clone(),
    );
    let tokens: Vec<u32> = (0..32).map(|i| (i * 7 % 100) as u32).collect();
    let b = Batch {
        inputs: &tokens[..16],
        targets: &tokens[16..],
        batch: 1,
        seq: 16,
    };
    a.zero_grads().unwrap();
    a.forward_backward(&b, 1.0 / 16.0).unwrap();
    let norm = a.grad_norm().unwrap();
    a.update(1e-2, clip_factor(norm, 1.0)).unwrap();
    let mut fresh = CpuEngine::new(
        Model::new(cfg.clone(), Weights::zeros(&cfg)),
        AdamWConfig::default(),
        attn,
    );
    fresh.import(a.export().unwrap()).unwrap();
    assert_eq!(a.loss(&b).unwrap(), fresh.loss(&b).unwrap());
    assert_eq!(fresh.export().unwrap().adam_t, 1);
}
