//! Extreme magnitudes: for inputs scaled over the whole f32 range the simulator either returns finite
//! outputs close to the exact f64 reference or the named `OutOfRange` error, never NaN or Inf.

use sagebwd::inputs::{random, MIN_MAGNITUDE};
use sagebwd::metrics::compare;
use sagebwd::reference::exact;
use sagebwd::sim::simulate;
use sagebwd::{Config, Error, Inputs, Shape};

fn shape() -> Shape {
    Shape {
        batch: 1,
        heads_q: 2,
        heads_kv: 1,
        n_q: 80,
        n_k: 96,
        head_dim: 32,
    }
}

fn scaled(inp: &Inputs, sq: f32, sk: f32, sv: f32, sdo: f32) -> Inputs {
    let mut x = inp.clone();
    x.q.iter_mut().for_each(|v| *v *= sq);
    x.k.iter_mut().for_each(|v| *v *= sk);
    x.v.iter_mut().for_each(|v| *v *= sv);
    if let Some(d) = &mut x.d_o {
        d.iter_mut().for_each(|v| *v *= sdo);
    }
    x.round_to_bf16();
    x
}

fn configs() -> Vec<Config> {
    ["fpa", "sagebwd", "int8-all"]
        .iter()
        .map(|p| Config::preset(p).unwrap())
        .collect()
}

/// Checks one problem: the named error, or finite outputs that match the reference.
fn check(inp: &Inputs, what: &str) -> bool {
    let mut accepted = false;
    for cfg in configs() {
        match simulate(inp, &cfg, false) {
            Err(Error::OutOfRange { tensor, bound, .. }) => {
                assert!(
                    ["q", "k", "v", "do"].contains(&tensor.as_str()) && !bound.is_empty(),
                    "{what}"
                );
                assert!(
                    exact(inp, false).is_err(),
                    "{what}: the reference accepts what the method rejects"
                );
            }
            Err(e) => panic!("{what} ({}): unexpected error {e}", cfg.label()),
            Ok(out) => {
                accepted = true;
                let ex = exact(inp, false).unwrap();
                let g = out.grads.as_ref().unwrap();
                let eg = ex.grads.as_ref().unwrap();
                for (name, x, r) in [
                    ("o", &out.fwd.o, &ex.o),
                    ("lse", &out.fwd.lse, &ex.lse),
                    ("dq", &g.dq, &eg.dq),
                    ("dk", &g.dk, &eg.dk),
                    ("dv", &g.dv, &eg.dv),
                ] {
                    assert!(
                        x.iter().all(|v| v.is_finite()),
                        "{what} ({}): non-finite {name}",
                        cfg.label()
                    );
                    let m = compare(x, r);
                    // A reference below f32's normal range (true values of 1e-60) underflows to 0 in any
                    // f32 computation: finite zeros are the right answer there, with no cosine.
                    let representable = r.iter().any(|v| v.abs() > 1e-30);
                    assert!(
                        !representable || m.cos > 0.9,
                        "{what} ({}): {name} cos {} against the exact reference",
                        cfg.label(),
                        m.cos
                    );
                }
            }
        }
    }
    accepted
}

#[test]
fn q_and_k_magnitudes_from_tiny_to_huge_give_sane_outputs_or_the_named_error() {
    let base = random(shape(), true, 1.0, 11, true);
    let mut accepted = Vec::new();
    for e in (-18..=8).step_by(2) {
        let s = 10f32.powi(e);
        if check(&scaled(&base, s, s, 1.0, 1.0), &format!("q, k × 1e{e}")) {
            accepted.push(e);
        }
    }
    // Ordinary magnitudes are accepted, huge ones rejected.
    assert!(
        accepted.contains(&0) && accepted.contains(&-10) && !accepted.contains(&8),
        "{accepted:?}"
    );
}

#[test]
fn v_and_do_magnitudes_from_tiny_to_huge_give_sane_outputs_or_the_named_error() {
    let base = random(shape(), false, 1.0, 12, true);
    for e in [-30, -20, -10, 0, 10, 15, 17, 20, 30] {
        let s = 10f32.powi(e);
        check(&scaled(&base, 1.0, 1.0, s, 1.0), &format!("v × 1e{e}"));
        check(&scaled(&base, 1.0, 1.0, 1.0, s), &format!("do × 1e{e}"));
        check(&scaled(&base, 1.0, 1.0, s, s), &format!("v, do × 1e{e}"));
    }
}

#[test]
fn single_extreme_values_are_named() {
    let base = random(shape(), false, 1.0, 13, true);
    // One q value of 1e11: scores far beyond 2^31 (the forward's overflow: NaN O, LSE = +inf).
    let mut big = base.clone();
    big.q[100] = 1e11;
    let e = simulate(&big, &Config::sagebwd(), false).unwrap_err().to_string();
    assert!(e.contains("input `q`") && e.contains("2^16"), "{e}");
    // One subnormal-range k value: 127/amax would be +inf for an all-tiny group.
    let mut tiny = base.clone();
    tiny.k[7] = 1e-38;
    let e = simulate(&tiny, &Config::sagebwd(), false).unwrap_err().to_string();
    assert!(e.contains("input `k` at flat index 7") && e.contains("2^-120"), "{e}");
    // A whole K block at the smallest accepted magnitude quantizes with a finite scale.
    let mut small = base.clone();
    small.k[..32 * 64]
        .iter_mut()
        .for_each(|x| *x = if *x >= 0.0 { MIN_MAGNITUDE } else { -MIN_MAGNITUDE });
    assert!(check(&small, "a K block at 2^-120"));
}
