//! The simulator against the exact reference, and the properties ALGORITHM.md promises.

use sagebwd::inputs::random;
use sagebwd::metrics::compare;
use sagebwd::reference::exact;
use sagebwd::sim::{keep_f32, simulate, simulate_with};
use sagebwd::{Config, Product, Shape};

fn shapes() -> Vec<(Shape, bool)> {
    vec![
        (Shape::square(1, 2, 200, 64), false),
        (Shape::square(1, 2, 200, 64), true),
        // GQA, odd lengths, N_q != N_k both ways, causal end-aligned.
        (Shape { batch: 2, heads_q: 4, heads_kv: 2, n_q: 77, n_k: 300, head_dim: 32 }, true),
        (Shape { batch: 1, heads_q: 2, heads_kv: 1, n_q: 150, n_k: 70, head_dim: 48 }, true),
        (Shape { batch: 1, heads_q: 3, heads_kv: 3, n_q: 129, n_k: 257, head_dim: 128 }, false),
    ]
}

/// With every product 16-bit but the rounding to BF16 switched off (operands kept in FP32) and no
/// smoothing, the simulator is exact attention computed in FP32: its results must match the f64
/// reference to FP32 accuracy. The worst case is a gradient whose entries cancel: with sums of
/// N ≤ 300 terms, FP32 accumulation error is ≲ N·2^-24·Σ|terms| and the terms exceed the result by
/// at most ~10× here, so 1e-4 relative L2 has a wide margin while any structural error (a wrong
/// scale, block, mask or head) is O(1).
#[test]
fn unrounded_fpa_is_exact_attention() {
    let mut cfg = Config::fpa();
    cfg.block_q = 32; // several blocks even on short sequences
    cfg.block_kv = 48;
    for (seed, (s, causal)) in shapes().into_iter().enumerate() {
        let inp = random(s, causal, 2.0, seed as u64, true);
        let sim = simulate_with(&inp, &cfg, true, keep_f32).unwrap();
        let ex = exact(&inp, true).unwrap();
        let (g, eg) = (sim.grads.as_ref().unwrap(), ex.grads.as_ref().unwrap());
        let (it, eit) = (sim.inter.as_ref().unwrap(), ex.inter.as_ref().unwrap());
        let lse: Vec<f32> = sim.fwd.lse.clone();
        for (name, x, r) in [
            ("o", &sim.fwd.o, &ex.o),
            ("lse", &lse, &ex.lse),
            ("dq", &g.dq, &eg.dq),
            ("dk", &g.dk, &eg.dk),
            ("dv", &g.dv, &eg.dv),
            ("D", &g.delta, &eg.delta),
            ("p", &it.p, &eit.p),
            ("dp", &it.dp, &eit.dp),
            ("ds", &it.ds, &eit.ds),
        ] {
            let m = compare(x, r);
            assert!(m.rel_l2 < 1e-4, "{name} {s:?} causal={causal}: {m:?}");
        }
    }
}

/// K-smoothing subtracts a per-row constant from the scores: the unquantized forward must not
/// change (to FP32 accuracy), and the exported LSE (corrected by c·q·K_m) must not either.
#[test]
fn k_smoothing_leaves_the_unquantized_forward_unchanged() {
    let s = Shape { batch: 1, heads_q: 2, heads_kv: 1, n_q: 100, n_k: 130, head_dim: 64 };
    let mut inp = random(s, true, 1.0, 11, false);
    // A large shared channel offset in K: what smoothing removes.
    inp.k.iter_mut().enumerate().for_each(|(i, x)| *x += if i % 64 == 3 { 8.0 } else { 0.5 });
    let mut on = Config::fpa();
    on.smooth_k = true;
    let a = simulate_with(&inp, &Config::fpa(), false, keep_f32).unwrap();
    let b = simulate_with(&inp, &on, false, keep_f32).unwrap();
    let ex = exact(&inp, false).unwrap();
    assert!(compare(&b.fwd.o, &ex.o).rel_l2 < 1e-5);
    let up = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    assert!(compare(&b.fwd.o, &up(&a.fwd.o)).rel_l2 < 1e-5);
    assert!(compare(&b.fwd.lse, &ex.lse).rel_l2 < 1e-6);
    // ...while the smoothed K has (near) zero mean per channel.
    assert!(b.quant.k_mean.iter().zip(0..).all(|(&m, c)| (m - if c % 64 == 3 { 8.0 } else { 0.5 }).abs() < 0.5));
}

/// The quantized operands obey §2.2: values in [-127, 127], the group maximum at ±127, and each
/// entry within half a step of the value it encodes.
#[test]
fn quantized_operands_follow_the_quantizer() {
    let s = Shape { batch: 1, heads_q: 2, heads_kv: 2, n_q: 100, n_k: 200, head_dim: 64 };
    let inp = random(s, false, 3.0, 12, true);
    let cfg = Config::sagebwd();
    let out = simulate(&inp, &cfg, false).unwrap();
    let qz = &out.quant;
    let d = s.head_dim;
    for h in 0..2 {
        for (b, &scale) in qz.k_scale[h * 2..h * 2 + 2].iter().enumerate() {
            let rows = (b * 128)..((b + 1) * 128).min(200);
            let mut max_abs = 0;
            for r in rows {
                for c in 0..d {
                    let at = (h * 200 + r) * d + c;
                    let ks = inp.k[at] - qz.k_mean[h * d + c];
                    let kh = qz.k_hat[at];
                    assert!(kh != -128);
                    max_abs = max_abs.max((kh as i32).abs());
                    assert!((kh as f32 * scale - ks).abs() <= 0.5 * scale * 1.0001 + 1e-6, "k[{at}]");
                }
            }
            assert_eq!(max_abs, 127);
        }
    }
    assert_eq!(qz.q_scale.len(), 2 * 2);
    assert_eq!(qz.do_scale.len(), 2 * 2);
    assert_eq!(qz.v_scale.len(), 2 * 2);
}

/// Accuracy of the quantized presets against the exact reference at σ = 1 (SAGEBWD.md §5: O and
/// dV degrade mildly, dQ/dK more). These floors are loose physical expectations, not tuned values:
/// an INT8 step is 1/254 of a group's range, so a correct implementation is far above them.
#[test]
fn quantized_presets_are_accurate_at_sigma_one() {
    let s = Shape::square(1, 2, 256, 64);
    for causal in [false, true] {
        let inp = random(s, causal, 1.0, 21, true);
        let ex = exact(&inp, false).unwrap();
        let eg = ex.grads.as_ref().unwrap();
        for cfg in [Config::sagebwd(), Config::int8_all(), Config::fpa()] {
            let out = simulate(&inp, &cfg, false).unwrap();
            let g = out.grads.unwrap();
            for (name, x, r) in [("o", &out.fwd.o, &ex.o), ("dq", &g.dq, &eg.dq), ("dk", &g.dk, &eg.dk), ("dv", &g.dv, &eg.dv)] {
                let m = compare(x, r);
                assert!(m.cos > 0.99, "{} {name}: {m:?}", cfg.label());
            }
        }
    }
}

/// Switching one product to INT8 changes the results, and only products downstream of it.
#[test]
fn isolation_changes_only_downstream_results() {
    let s = Shape::square(1, 1, 130, 64);
    let inp = random(s, false, 2.0, 31, true);
    let base = simulate(&inp, &Config::isolate(Product::Dp), false).unwrap();
    let mut cfg_bf = Config::fpa();
    cfg_bf.smooth_k = true;
    let bf = simulate(&inp, &cfg_bf, false).unwrap();
    // dP only feeds dS, hence dQ and dK: O and dV are untouched, dQ and dK move.
    assert_eq!(base.fwd.o, bf.fwd.o);
    let (g, gb) = (base.grads.unwrap(), bf.grads.unwrap());
    assert_eq!(g.dv, gb.dv);
    assert_ne!(g.dq, gb.dq);
    assert_ne!(g.dk, gb.dk);
    let dv_only = simulate(&inp, &Config::isolate(Product::Dv), false).unwrap().grads.unwrap();
    assert_ne!(dv_only.dv, gb.dv);
    assert_eq!(dv_only.dq, gb.dq);
}

/// Q-smoothing and the dQ correction are exact rewrites in exact arithmetic: with unrounded 16-bit
/// products they must reproduce exact attention too.
#[test]
fn q_smoothing_and_dq_correction_are_exact_rewrites() {
    let s = Shape { batch: 1, heads_q: 2, heads_kv: 1, n_q: 90, n_k: 90, head_dim: 32 };
    let inp = random(s, true, 2.0, 41, true);
    let mut cfg = Config::fpa();
    cfg.smooth_k = true;
    cfg.smooth_q = true;
    cfg.dq_smooth_k_correction = true;
    cfg.block_q = 32;
    let out = simulate_with(&inp, &cfg, false, keep_f32).unwrap();
    let ex = exact(&inp, false).unwrap();
    let (g, eg) = (out.grads.unwrap(), ex.grads.unwrap());
    for (name, x, r) in [("o", &out.fwd.o, &ex.o), ("dq", &g.dq, &eg.dq), ("dk", &g.dk, &eg.dk), ("dv", &g.dv, &eg.dv)] {
        assert!(compare(x, r).rel_l2 < 1e-4, "{name}");
    }
    assert!(compare(&out.fwd.lse, &ex.lse).rel_l2 < 1e-6);
}

#[test]
fn bad_configuration_is_an_error() {
    let inp = random(Shape::square(1, 1, 8, 8), false, 1.0, 1, false);
    let mut cfg = Config::sagebwd();
    cfg.block_q = 0;
    assert!(simulate(&inp, &cfg, false).unwrap_err().to_string().contains("block_q"));
}
