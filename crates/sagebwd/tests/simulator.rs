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
        (
            Shape {
                batch: 2,
                heads_q: 4,
                heads_kv: 2,
                n_q: 77,
                n_k: 300,
                head_dim: 32,
            },
            true,
        ),
        (
            Shape {
                batch: 1,
                heads_q: 2,
                heads_kv: 1,
                n_q: 150,
                n_k: 70,
                head_dim: 48,
            },
            true,
        ),
        (
            Shape {
                batch: 1,
                heads_q: 3,
                heads_kv: 3,
                n_q: 129,
                n_k: 257,
                head_dim: 128,
            },
            false,
        ),
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

/// K-smoothing subtracts a per-row constant from the scores: exact attention on `(Q, K − K_m)` has
/// the same output and gradients, and an LSE lower by `c·q_r·K_m` (the `b_r` of ALGORITHM.md §3).
#[test]
fn k_smoothing_leaves_exact_attention_unchanged() {
    let s = Shape {
        batch: 1,
        heads_q: 2,
        heads_kv: 1,
        n_q: 100,
        n_k: 130,
        head_dim: 64,
    };
    let mut inp = random(s, true, 1.0, 11, true);
    inp.k
        .iter_mut()
        .enumerate()
        .for_each(|(i, x)| *x += if i % 64 == 3 { 8.0 } else { 0.5 });
    let mut smoothed = inp.clone();
    let d = s.head_dim;
    let mean: Vec<f64> = (0..d)
        .map(|c| (0..s.n_k).map(|j| inp.k[j * d + c] as f64).sum::<f64>() / s.n_k as f64)
        .collect();
    smoothed
        .k
        .iter_mut()
        .enumerate()
        .for_each(|(i, x)| *x -= mean[i % d] as f32);
    let (a, b) = (exact(&inp, false).unwrap(), exact(&smoothed, false).unwrap());
    assert!(compare(&b.o, &a.o).rel_l2 < 1e-6);
    let (ga, gb) = (a.grads.unwrap(), b.grads.unwrap());
    assert!(compare(&gb.dq, &ga.dq).rel_l2 < 1e-5);
    assert!(compare(&gb.dv, &ga.dv).rel_l2 < 1e-6);
    for r in 0..s.heads_q * s.n_q {
        let qk_m: f64 = (0..d).map(|c| inp.q[r * d + c] as f64 * mean[c]).sum();
        let shift = a.lse[r] - b.lse[r] - s.softmax_scale() * qk_m;
        assert!(shift.abs() < 1e-3, "row {r}: {shift}");
    }
}

/// Inputs that INT8 represents exactly: small integers times 2^-4, every quantization block holding a
/// ±127, K = K0 + a channel offset with K0 of zero token mean (rows come in ± pairs) and, per query
/// block, Q = Q0 + an offset likewise. Then K_m is the offset, K̂ = K0·16, Q̂ = Q0·16 and every scale
/// is 2^-4 exactly, so INT8 products #1, #3 and #5 are exact and the whole method — scale order, cλ
/// folding, the K-smoothing row offset b_r, the Q-smoothing bias β — must reproduce `fpa` to FP32
/// accuracy. Any bookkeeping error (a dropped b_r, β or scale) shows as an O(1) difference.
fn exactly_quantizable(s: Shape, causal: bool, seed: u64, block_q: usize, block_kv: usize) -> sagebwd::Inputs {
    let mut inp = random(s, causal, 1.0, seed, true);
    let d = s.head_dim;
    let int = |x: f32, lim: f32| (x * 40.0).round().clamp(-lim, lim);
    let paired = |t: &mut Vec<f32>, n: usize, block: usize, offset: &dyn Fn(usize, usize) -> f32| {
        for (h, th) in t.chunks_mut(n * d).enumerate() {
            for r in 0..n {
                for c in 0..d {
                    let base = if r % 2 == 1 {
                        -th[(r - 1) * d + c]
                    } else {
                        int(th[r * d + c], 100.0)
                    };
                    th[r * d + c] = base;
                }
            }
            for b0 in (0..n).step_by(block) {
                th[b0 * d] = 127.0;
                if b0 + 1 < n {
                    th[(b0 + 1) * d] = -127.0;
                }
            }
            for r in 0..n {
                for c in 0..d {
                    th[r * d + c] = (th[r * d + c] + offset(h * n + r, c)) / 16.0;
                }
            }
        }
    };
    paired(&mut inp.k, s.n_k, block_kv, &|_, c| (c % 3) as f32);
    // Column 0 holds the ±127 entries: no offset there, so Q stays exact without Q-smoothing too.
    paired(&mut inp.q, s.n_q, block_q, &|r, c| {
        if c == 0 {
            0.0
        } else {
            ((r / block_q + c) % 2) as f32
        }
    });
    paired(&mut inp.v, s.n_k, block_kv, &|_, _| 0.0);
    paired(inp.d_o.as_mut().unwrap(), s.n_q, block_q, &|_, _| 0.0);
    inp
}

#[test]
fn exactly_quantizable_inputs_make_int8_products_exact() {
    let shapes = [
        (
            Shape {
                batch: 1,
                heads_q: 2,
                heads_kv: 1,
                n_q: 96,
                n_k: 160,
                head_dim: 32,
            },
            true,
        ),
        (
            Shape {
                batch: 1,
                heads_q: 2,
                heads_kv: 2,
                n_q: 128,
                n_k: 64,
                head_dim: 64,
            },
            false,
        ),
    ];
    for (i, (s, causal)) in shapes.into_iter().enumerate() {
        let inp = exactly_quantizable(s, causal, 50 + i as u64, 32, 64);
        let mut fpa = Config::fpa();
        (fpa.block_q, fpa.block_kv) = (32, 64);
        let want = simulate_with(&inp, &fpa, false, keep_f32).unwrap();
        for smooth_q in [false, true] {
            let mut cfg = fpa.clone();
            cfg.smooth_k = true;
            cfg.smooth_q = smooth_q;
            for p in [Product::QkFwd, Product::QkBwd, Product::Dp] {
                cfg.set(p, sagebwd::Precision::Int8);
            }
            let got = simulate_with(&inp, &cfg, false, keep_f32).unwrap();
            let up = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
            assert!(
                got.quant.k_scale.iter().all(|&x| x == 1.0 / 16.0),
                "{:?}",
                got.quant.k_scale
            );
            assert!(got.quant.q_scale.iter().all(|&x| x == 1.0 / 16.0));
            assert!(
                got.quant.row_offset.iter().any(|&b| b.abs() > 0.1),
                "K has a mean to remove"
            );
            let (g, w) = (got.grads.as_ref().unwrap(), want.grads.as_ref().unwrap());
            for (name, x, r) in [
                ("o", &got.fwd.o, &want.fwd.o),
                ("lse", &got.fwd.lse, &want.fwd.lse),
                ("dq", &g.dq, &w.dq),
                ("dk", &g.dk, &w.dk),
                ("dv", &g.dv, &w.dv),
            ] {
                let m = compare(x, &up(r));
                assert!(m.rel_l2 < 1e-5, "{name} {s:?} smooth_q={smooth_q}: {m:?}");
            }
        }
    }
}

/// The quantized operands obey §2.2: values in [-127, 127], the group maximum at ±127, and each
/// entry within half a step of the value it encodes.
#[test]
fn quantized_operands_follow_the_quantizer() {
    let s = Shape {
        batch: 1,
        heads_q: 2,
        heads_kv: 2,
        n_q: 100,
        n_k: 200,
        head_dim: 64,
    };
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
            for (name, x, r) in [
                ("o", &out.fwd.o, &ex.o),
                ("dq", &g.dq, &eg.dq),
                ("dk", &g.dk, &eg.dk),
                ("dv", &g.dv, &eg.dv),
            ] {
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
    let bf = simulate(&inp, &Config::fpa(), false).unwrap();
    // dP only feeds dS, hence dQ and dK: O and dV are untouched, dQ and dK move.
    assert_eq!(base.fwd.o, bf.fwd.o);
    let (g, gb) = (base.grads.unwrap(), bf.grads.unwrap());
    assert_eq!(g.dv, gb.dv);
    assert_ne!(g.dq, gb.dq);
    assert_ne!(g.dk, gb.dk);
    let dv_only = simulate(&inp, &Config::isolate(Product::Dv), false)
        .unwrap()
        .grads
        .unwrap();
    assert_ne!(dv_only.dv, gb.dv);
    assert_eq!(dv_only.dq, gb.dq);
}

/// The dQ smooth-K correction acts on INT8 dQ only, changes it, and keeps it accurate; Q-smoothing
/// with every product INT8 stays accurate too.
#[test]
fn dq_correction_and_q_smoothing_with_int8_products() {
    let s = Shape {
        batch: 1,
        heads_q: 2,
        heads_kv: 1,
        n_q: 130,
        n_k: 130,
        head_dim: 64,
    };
    let mut inp = random(s, true, 1.0, 41, true);
    inp.k
        .iter_mut()
        .enumerate()
        .for_each(|(i, x)| *x += if i % 64 < 4 { 3.0 } else { 0.0 });
    let ex = exact(&inp, false).unwrap();
    let eg = ex.grads.unwrap();
    let base = simulate(&inp, &Config::int8_all(), false).unwrap().grads.unwrap();
    let mut cfg = Config::int8_all();
    cfg.dq_smooth_k_correction = true;
    let corr = simulate(&inp, &cfg, false).unwrap().grads.unwrap();
    assert_ne!(corr.dq, base.dq);
    assert_eq!(corr.dk, base.dk);
    assert!(compare(&corr.dq, &eg.dq).cos > 0.99);
    cfg.set(Product::Dq, sagebwd::Precision::Bf16);
    let bf = simulate(&inp, &cfg, false).unwrap().grads.unwrap();
    let mut off = cfg.clone();
    off.dq_smooth_k_correction = false;
    assert_eq!(
        bf.dq,
        simulate(&inp, &off, false).unwrap().grads.unwrap().dq,
        "no effect on BF16 dQ"
    );
    let mut sq = Config::int8_all();
    sq.smooth_q = true;
    let out = simulate(&inp, &sq, false).unwrap();
    let g = out.grads.unwrap();
    for (name, x, r) in [("o", &out.fwd.o, &ex.o), ("dq", &g.dq, &eg.dq), ("dk", &g.dk, &eg.dk)] {
        assert!(compare(x, r).cos > 0.99, "{name}");
    }
}

#[test]
fn bad_configuration_is_an_error() {
    let inp = random(Shape::square(1, 1, 8, 8), false, 1.0, 1, false);
    let mut cfg = Config::sagebwd();
    cfg.block_q = 0;
    assert!(simulate(&inp, &cfg, false).unwrap_err().to_string().contains("block_q"));
}

/// A query block of all-zero rows has s_Q = 0, so its INT8 score scale fl(fl(s_Q·cλ)·s_K) is 0 and
/// the fused softmax argument fma(a, 0, −m) of ALGORITHM.md §4 is −m (no −∞·0 = NaN: masked keys
/// never enter the product). Those rows attend uniformly to their visible keys (t = 0, as in the
/// exact reference, where their scores are 0 too), and everything stays finite and accurate.
#[test]
fn zero_query_block_gives_uniform_attention() {
    let s = Shape {
        batch: 1,
        heads_q: 2,
        heads_kv: 1,
        n_q: 200,
        n_k: 200,
        head_dim: 64,
    };
    for causal in [true, false] {
        let mut inp = random(s, causal, 2.0, 41, true);
        let d = s.head_dim;
        // Rows 64..128 of head 0 (query block 1 with B_q = 64): all zero.
        inp.q[64 * d..128 * d].iter_mut().for_each(|x| *x = 0.0);
        let ex = exact(&inp, false).unwrap();
        let eg = ex.grads.as_ref().unwrap();
        for cfg in [Config::sagebwd(), Config::int8_all(), Config::fpa()] {
            let out = simulate(&inp, &cfg, false).unwrap();
            assert_eq!(out.quant.q_scale[1], 0.0, "{}: the zero block's scale", cfg.label());
            let g = out.grads.unwrap();
            for (name, x, r) in [
                ("o", &out.fwd.o, &ex.o),
                ("dq", &g.dq, &eg.dq),
                ("dk", &g.dk, &eg.dk),
                ("dv", &g.dv, &eg.dv),
            ] {
                assert!(
                    x.iter().all(|v| v.is_finite()),
                    "{} {name} causal={causal}: not finite",
                    cfg.label()
                );
                let m = compare(x, r);
                assert!(m.cos > 0.99, "{} {name} causal={causal}: {m:?}", cfg.label());
            }
            // A zero row's O is the mean of V over its visible keys (uniform p = exp2(−m) = 1).
            for r in 64..128 {
                let vis = if causal { r + 1 } else { s.n_k };
                for c in [0, d - 1] {
                    let mean = (0..vis).map(|j| inp.v[j * d + c] as f64).sum::<f64>() / vis as f64;
                    let o = out.fwd.o[r * d + c] as f64;
                    assert!(
                        (o - mean).abs() < 2e-2 * (1.0 + mean.abs()),
                        "{} row {r} col {c}: {o} vs {mean}",
                        cfg.label()
                    );
                }
            }
        }
    }
}

/// The lazy running max (ALGORITHM.md §4): it moves only past a slack of 8 (base-2 units).
#[test]
fn running_max_moves_only_past_the_slack() {
    use sagebwd::sim::{next_running_max, RESCALE_SLACK};
    assert_eq!(RESCALE_SLACK, 8.0);
    assert_eq!(
        next_running_max(f32::NEG_INFINITY, -3.0),
        -3.0,
        "the first visible block moves it"
    );
    assert_eq!(
        next_running_max(f32::NEG_INFINITY, f32::NEG_INFINITY),
        f32::NEG_INFINITY
    );
    assert_eq!(next_running_max(1.0, 9.0), 1.0, "a rise of exactly 8 keeps it");
    assert_eq!(next_running_max(1.0, 9.5), 9.5);
    assert_eq!(next_running_max(1.0, -20.0), 1.0);
    assert_eq!(next_running_max(1.0, f32::NAN), 1.0);
}

/// Scores that rise along the keys, block by block, through the INT8 forward's lazy running max
/// (ALGORITHM.md §4): exactly quantizable operands (as `exactly_quantizable`: K block b's channel 0
/// holds n·s_b with integers n and a 127, s_b = (4 + 3b)/32, so fl(amax/127) = s_b and K̂ = n exactly;
/// Q's channel 0 is 127·2⁻⁶ on every row), no K-smoothing, so that the INT8 #1 scores are the FP32
/// products `fpa` computes and the method with INT8 #1 alone (lazy max) must reproduce `fpa` (eager max)
/// to FP32 accuracy. The block maxima rise by ~4.2 base-2 units per block of 32 keys (the running max
/// kept over a block, p up to 2⁸, then moved) and jump by ~60 in the last two blocks (moved at once);
/// the test checks that both cases occur. An error in the stale-max bookkeeping (l or O rescaled by a
/// wrong α, lse from the wrong m) is O(1) here: consecutive blocks' weights differ by a factor of ~18.
/// Tolerances: the scores reach ~85 base-2 units, and the two paths round them differently (INT8:
/// fl(a·sc) with sc = fl(fl(s_Q·cλ)·s_K), three roundings; BF16: fl(cλ·Σ)), by up to ~3·2⁻²⁴·85 ≈ 1.5e-5
/// absolute, so p differs by ~1e-5 relative: O and lse get 1e-5 as `exactly_quantizable_inputs_make_
/// int8_products_exact`; the gradients, where dS = P(dP − D) cancels (its rows sum to 0) and amplifies
/// that ~10× (measured 4.8e-5 for dQ), get 1e-4.
#[test]
fn rising_scores_through_the_lazy_running_max() {
    use sagebwd::sim::next_running_max;
    let (n_q, n_k, d, bkv) = (70, 256, 64, 32);
    let s = Shape {
        batch: 1,
        heads_q: 1,
        heads_kv: 1,
        n_q,
        n_k,
        head_dim: d,
    };
    let mut inp = random(s, false, 1.0, 5, true);
    let q0 = 127.0 / 64.0;
    for r in 0..n_q {
        inp.q[r * d..(r + 1) * d].fill(0.0);
        inp.q[r * d] = q0;
        inp.q[r * d + 1] = ((r % 5) as f32 - 2.0) / 64.0;
    }
    let s_b = |b: usize| {
        if b < 6 {
            (4 + 3 * b) as f32 / 32.0
        } else {
            (54 + b) as f32 / 32.0
        }
    };
    for j in 0..n_k {
        let (b, jl) = (j / bkv, j % bkv);
        let n0 = if jl == bkv - 1 { 127.0 } else { (4 * jl) as f32 };
        inp.k[j * d..(j + 1) * d].fill(0.0);
        inp.k[j * d] = n0 * s_b(b);
        inp.k[j * d + 1] = ((j % 7) as f32 - 3.0) * s_b(b);
    }
    // The design: some blocks keep the running max (a rise of ≤ 8), some move it.
    let c_log2e = (1.0 / (d as f32).sqrt()) * std::f32::consts::LOG2_E;
    let (mut m, mut kept, mut moved) = (f32::NEG_INFINITY, 0, 0);
    for b in 0..n_k / bkv {
        let row_max = q0 * 127.0 * s_b(b) * c_log2e;
        let m_new = next_running_max(m, row_max);
        if b > 0 {
            if m_new == m {
                kept += 1
            } else {
                moved += 1
            }
        }
        m = m_new;
    }
    assert!(kept >= 2 && moved >= 2, "kept {kept}, moved {moved}");
    let mut fpa = Config::fpa();
    (fpa.block_q, fpa.block_kv) = (32, bkv);
    fpa.smooth_k = false;
    let want = simulate_with(&inp, &fpa, false, keep_f32).unwrap();
    let mut cfg = fpa.clone();
    cfg.set(Product::QkFwd, sagebwd::Precision::Int8);
    let got = simulate_with(&inp, &cfg, false, keep_f32).unwrap();
    assert!(
        got.quant.k_scale.iter().enumerate().all(|(b, &x)| x == s_b(b)),
        "{:?}",
        got.quant.k_scale
    );
    let up = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<_>>();
    let (g, w) = (got.grads.as_ref().unwrap(), want.grads.as_ref().unwrap());
    for (name, x, r, tol) in [
        ("o", &got.fwd.o, &want.fwd.o, 1e-5),
        ("lse", &got.fwd.lse, &want.fwd.lse, 1e-5),
        ("dq", &g.dq, &w.dq, 1e-4),
        ("dk", &g.dk, &w.dk, 1e-4),
        ("dv", &g.dv, &w.dv, 1e-4),
    ] {
        let m = compare(x, &up(r));
        assert!(m.rel_l2 < tol, "{name}: {m:?}");
    }
}
