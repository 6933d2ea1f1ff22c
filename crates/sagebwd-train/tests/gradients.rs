//! The hand-written backward against central finite differences, on a tiny model with exact
//! attention, for every parameter tensor and every combination of tied/untied embeddings and
//! QK-norm on/off; and properties of the model that a wrong forward would break.

use sagebwd_train::backend::{cpu::CpuBackend, Attention};
use sagebwd_train::config::ModelConfig;
use sagebwd_train::layers::ROW_CHUNK;
use sagebwd_train::model::{Batch, Model, ParamLayout, Weights};
use sagebwd_train::rng::Rng;

const BATCH: usize = 2;
const SEQ: usize = 8;

fn tiny_config(tied: bool, qk_norm: bool) -> ModelConfig {
    ModelConfig {
        vocab_size: 37,
        dim: 16,
        n_layers: 2,
        n_heads: 4,
        n_kv_heads: 2, // grouped-query attention is exercised too
        ffn_hidden: 24,
        max_seq_len: 32,
        rope_theta: 10_000.0,
        norm_eps: 1e-5,
        qk_norm,
        tied_embeddings: tied,
    }
}

/// Weights with standard deviation ~0.3 and gains spread around 1, so that every path carries a
/// gradient well above f32 rounding noise (the 0.02 of training initialization would not).
fn test_model(cfg: &ModelConfig, seed: u64) -> Model {
    let mut rng = Rng::new(seed);
    let mut w = Weights::init(cfg, &mut rng);
    for t in w.tensors_mut() {
        for x in t.iter_mut() {
            *x = if *x == 1.0 {
                1.0 + 0.3 * rng.normal() as f32
            } else {
                *x * 15.0
            };
        }
    }
    Model::new(cfg.clone(), w)
}

fn tokens(cfg: &ModelConfig, seed: u64) -> (Vec<u32>, Vec<u32>) {
    let mut rng = Rng::new(seed);
    let seq: Vec<u32> = (0..BATCH * SEQ + 1).map(|_| rng.below(cfg.vocab_size) as u32).collect();
    (seq[..BATCH * SEQ].to_vec(), seq[1..].to_vec())
}

/// Relative L2 error of `got` against `want`.
fn rel_l2(got: &[f64], want: &[f64]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(a, b)| (a - b).powi(2)).sum();
    let den: f64 = want.iter().map(|b| b * b).sum();
    (num / den.max(1e-30)).sqrt()
}

/// Tolerances. The loss (~4 nats) is computed in f32, so one evaluation carries a rounding error of
/// about 1e-6 (a few ulps of 4, times the depth of the network); with a step of 3e-3 the central
/// difference carries 1e-6 / 6e-3 ≈ 2e-4 of noise per entry, plus a truncation error of order
/// step² × (third derivative): with these deliberately large weights the worst tensor (the tied
/// embedding without QK-norm) measures 2.6e-3 relative L2, the others below 1e-3 (step 1e-2 gave
/// 2.8e-2 there: truncation, not a bug). The bound of 1% of each tensor's gradient norm keeps a 4×
/// margin and is far below what a missing term, wrong sign or transposed product gives (order 1).
const STEP: f32 = 3e-3;
const REL_TOL: f64 = 1e-2;

fn check_gradients(tied: bool, qk_norm: bool) {
    let cfg = tiny_config(tied, qk_norm);
    let be = CpuBackend::new(Attention::Exact);
    let mut model = test_model(&cfg, 11);
    let (inputs, targets) = tokens(&cfg, 5);
    let batch = Batch {
        inputs: &inputs,
        targets: &targets,
        batch: BATCH,
        seq: SEQ,
    };
    let mut grads = Weights::zeros(&cfg);
    model
        .forward_backward(&be, &batch, &mut grads, 1.0 / (BATCH * SEQ) as f32)
        .unwrap();
    let layout = ParamLayout::new(&cfg);
    for spec in &layout.specs {
        let analytic: Vec<f64> = grads
            .clone()
            .get_mut(&spec.name)
            .unwrap()
            .iter()
            .map(|&g| g as f64)
            .collect();
        let n = analytic.len();
        let mut numeric = vec![0.0f64; n];
        for (i, num) in numeric.iter_mut().enumerate() {
            let orig = model.weights.get_mut(&spec.name).unwrap()[i];
            let mut loss_at = |x: f32| {
                model.weights.get_mut(&spec.name).unwrap()[i] = x;
                model.loss(&be, &batch).unwrap()
            };
            *num = (loss_at(orig + STEP) - loss_at(orig - STEP)) / (2.0 * STEP as f64);
            model.weights.get_mut(&spec.name).unwrap()[i] = orig;
        }
        let err = rel_l2(&analytic, &numeric);
        let norm = numeric.iter().map(|x| x * x).sum::<f64>().sqrt();
        assert!(
            norm > 1e-3,
            "{}: the gradient is ~0 ({norm:e}), the check would be vacuous",
            spec.name
        );
        assert!(
            err < REL_TOL,
            "{} (tied={tied}, qk_norm={qk_norm}): relative L2 error {err:.2e} of the backward against finite differences",
            spec.name
        );
    }
}

#[test]
fn gradients_match_finite_differences_tied_with_qk_norm() {
    check_gradients(true, true);
}

#[test]
fn gradients_match_finite_differences_untied_without_qk_norm() {
    check_gradients(false, false);
}

#[test]
fn gradients_match_finite_differences_untied_with_qk_norm() {
    check_gradients(false, true);
}

#[test]
fn gradients_match_finite_differences_tied_without_qk_norm() {
    check_gradients(true, false);
}

/// A tied model equals an untied one whose LM head is a copy of the embedding, and its embedding
/// gradient is the sum of the untied model's embedding and LM-head gradients.
#[test]
fn tied_embedding_gradient_is_the_sum_of_both_uses() {
    let be = CpuBackend::new(Attention::Exact);
    let tied = test_model(&tiny_config(true, true), 3);
    let mut untied_w = tied.weights.clone();
    untied_w.lm_head = untied_w.tok_emb.clone();
    let untied = Model::new(tiny_config(false, true), untied_w);
    let (inputs, targets) = tokens(&tied.cfg, 9);
    let batch = Batch {
        inputs: &inputs,
        targets: &targets,
        batch: BATCH,
        seq: SEQ,
    };
    let (mut g_tied, mut g_untied) = (Weights::zeros(&tied.cfg), Weights::zeros(&untied.cfg));
    let l1 = tied.forward_backward(&be, &batch, &mut g_tied, 1.0).unwrap();
    let l2 = untied.forward_backward(&be, &batch, &mut g_untied, 1.0).unwrap();
    assert_eq!(l1, l2);
    for ((t, e), h) in g_tied.tok_emb.iter().zip(&g_untied.tok_emb).zip(&g_untied.lm_head) {
        assert!((t - (e + h)).abs() <= 1e-5 * (1.0 + t.abs()), "{t} vs {e} + {h}");
    }
}

/// RMSNorm is invariant to the scale of its input, so with QK-norm scaling W_q by 8 leaves the loss
/// unchanged; without it the attention logits grow and the loss changes.
#[test]
fn qk_norm_makes_the_loss_invariant_to_the_scale_of_wq() {
    let be = CpuBackend::new(Attention::Exact);
    for qk_norm in [true, false] {
        let mut model = test_model(&tiny_config(true, qk_norm), 4);
        let (inputs, targets) = tokens(&model.cfg, 2);
        let batch = Batch {
            inputs: &inputs,
            targets: &targets,
            batch: BATCH,
            seq: SEQ,
        };
        let before = model.loss(&be, &batch).unwrap();
        model.weights.layers[0].wq.iter_mut().for_each(|x| *x *= 8.0);
        let after = model.loss(&be, &batch).unwrap();
        let changed = (before - after).abs() > 1e-3;
        assert_eq!(changed, !qk_norm, "qk_norm={qk_norm}: loss {before} → {after}");
    }
}

/// Weight-gradient reductions are chunked by rows; a batch longer than one chunk must give the same
/// gradient whatever the chunking (here: against finite differences on one gain entry).
#[test]
fn row_chunked_reductions_cover_every_row() {
    const _: () = assert!(BATCH * SEQ < ROW_CHUNK, "the gradient checks above use a single chunk");
    let cfg = tiny_config(true, true);
    let be = CpuBackend::new(Attention::Exact);
    let mut model = test_model(&cfg, 8);
    let (b, t) = (3, 30); // 90 tokens: two row chunks
    let mut rng = Rng::new(1);
    let seq: Vec<u32> = (0..b * t + 1).map(|_| rng.below(cfg.vocab_size) as u32).collect();
    let batch = Batch {
        inputs: &seq[..b * t],
        targets: &seq[1..],
        batch: b,
        seq: t,
    };
    let mut g = Weights::zeros(&cfg);
    model
        .forward_backward(&be, &batch, &mut g, 1.0 / (b * t) as f32)
        .unwrap();
    let analytic = g.final_norm[3] as f64;
    let orig = model.weights.final_norm[3];
    model.weights.final_norm[3] = orig + STEP;
    let up = model.loss(&be, &batch).unwrap();
    model.weights.final_norm[3] = orig - STEP;
    let down = model.loss(&be, &batch).unwrap();
    let numeric = (up - down) / (2.0 * STEP as f64);
    assert!(
        (analytic - numeric).abs() < 2e-2 * numeric.abs().max(1e-2),
        "{analytic} vs {numeric}"
    );
}
