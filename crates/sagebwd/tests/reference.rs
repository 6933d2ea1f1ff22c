//! The exact reference against finite differences, and its structural properties.

use sagebwd::inputs::random;
use sagebwd::reference::exact;
use sagebwd::{Inputs, Shape};

/// `L = Σ O ∘ dO` in f64, from the exact forward.
fn loss(inp: &Inputs) -> f64 {
    let e = exact(inp, false).unwrap();
    e.o.iter()
        .zip(inp.d_o.as_ref().unwrap())
        .map(|(o, g)| o * *g as f64)
        .sum()
}

/// Central differences of L at `n` random coordinates of Q, K and V, compared with the exact
/// gradients. Inputs are f32, so a step of 1e-2 keeps the truncation error (O(h²) ≈ 1e-4 of the
/// curvature) and the f32 rounding of the perturbed input (the step is exact in f32 for |x| < 1) small:
/// we require agreement to 1e-6 absolute + 1e-3 relative.
fn check_fd(shape: Shape, causal: bool, seed: u64) {
    let inp = random(shape, causal, 1.0, seed, true);
    // f32 inputs, not BF16-rounded steps: undo nothing, perturb in f32.
    let g = exact(&inp, false).unwrap().grads.unwrap();
    let h = 1.0f32 / 64.0; // exactly representable, x ± h exact for the BF16-valued inputs here
    let mut worst: f64 = 0.0;
    for (name, len) in [("q", shape.q_len()), ("k", shape.kv_len()), ("v", shape.kv_len())] {
        for t in 0..6 {
            let idx = (seed as usize * 7919 + t * 104_729) % len;
            let perturbed = |delta: f32| {
                let mut p = inp.clone();
                let tensor = match name {
                    "q" => &mut p.q,
                    "k" => &mut p.k,
                    _ => &mut p.v,
                };
                tensor[idx] += delta;
                loss(&p)
            };
            let fd = (perturbed(h) - perturbed(-h)) / (2.0 * h as f64);
            let an = match name {
                "q" => g.dq[idx],
                "k" => g.dk[idx],
                _ => g.dv[idx],
            };
            let err = (fd - an).abs() / (1e-6 + 1e-3 * an.abs().max(fd.abs()).max(1.0));
            worst = worst.max(err);
            assert!(
                err < 1.0,
                "{name}[{idx}] {shape:?} causal={causal}: fd {fd} vs analytic {an}"
            );
        }
    }
    assert!(worst.is_finite());
}

#[test]
fn gradients_match_finite_differences() {
    check_fd(Shape::square(1, 2, 9, 8), false, 1);
    check_fd(Shape::square(1, 2, 9, 8), true, 2);
    // GQA (2 query heads per kv head) and N_q != N_k, causal end-aligned.
    let s = Shape {
        batch: 2,
        heads_q: 4,
        heads_kv: 2,
        n_q: 5,
        n_k: 11,
        head_dim: 16,
    };
    check_fd(s, true, 3);
    check_fd(Shape { n_q: 11, n_k: 5, ..s }, true, 4);
}

#[test]
fn softmax_rows_sum_to_one_and_ds_rows_to_zero() {
    let s = Shape {
        batch: 1,
        heads_q: 2,
        heads_kv: 1,
        n_q: 13,
        n_k: 7,
        head_dim: 32,
    };
    let inp = random(s, true, 2.0, 5, true);
    let e = exact(&inp, true).unwrap();
    let it = e.inter.unwrap();
    for r in 0..s.heads_q * s.n_q {
        let row = &it.p[r * s.n_k..(r + 1) * s.n_k];
        let sum: f64 = row.iter().sum();
        let dsum: f64 = it.ds[r * s.n_k..(r + 1) * s.n_k].iter().sum();
        let qr = r % s.n_q;
        if qr < s.n_q - s.n_k {
            // Causal, end-aligned, N_q > N_k: the first rows see no key at all.
            assert_eq!(sum, 0.0);
            assert_eq!(e.lse[r], f64::INFINITY);
            assert!(e.o[r * 32..(r + 1) * 32].iter().all(|&x| x == 0.0));
        } else {
            assert!((sum - 1.0).abs() < 1e-12, "row {r}: {sum}");
            assert!(dsum.abs() < 1e-12, "row {r}: {dsum}");
            // Visible keys: j <= r + n_k - n_q.
            let vis = qr + s.n_k + 1 - s.n_q;
            assert!(row[..vis].iter().all(|&p| p > 0.0) && row[vis..].iter().all(|&p| p == 0.0));
        }
    }
}

#[test]
fn gqa_equals_repeated_kv_heads() {
    let s = Shape {
        batch: 1,
        heads_q: 4,
        heads_kv: 2,
        n_q: 10,
        n_k: 10,
        head_dim: 8,
    };
    let inp = random(s, false, 1.0, 9, true);
    let mut rep = inp.clone();
    rep.shape.heads_kv = 4;
    let per = s.n_k * s.head_dim;
    let expand = |t: &[f32]| {
        (0..4)
            .flat_map(|h| t[(h / 2) * per..(h / 2 + 1) * per].to_vec())
            .collect::<Vec<_>>()
    };
    rep.k = expand(&inp.k);
    rep.v = expand(&inp.v);
    let (a, b) = (exact(&inp, false).unwrap(), exact(&rep, false).unwrap());
    assert_eq!(a.o, b.o);
    let (ga, gb) = (a.grads.unwrap(), b.grads.unwrap());
    for h in 0..2 {
        for i in 0..per {
            let sum = gb.dk[2 * h * per + i] + gb.dk[(2 * h + 1) * per + i];
            assert!((ga.dk[h * per + i] - sum).abs() < 1e-12);
        }
    }
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let s = Shape::square(1, 1, 4, 8);
    let mut inp = random(s, false, 1.0, 1, true);
    inp.k[3] = f32::NAN;
    let e = exact(&inp, false).unwrap_err().to_string();
    assert!(e.contains("`k`") && e.contains("index 3"), "{e}");
    let mut inp = random(s, false, 1.0, 1, true);
    inp.v.pop();
    assert!(exact(&inp, false)
        .unwrap_err()
        .to_string()
        .contains("`v` has 31 elements"));
}
