//! The P / dS quantization variants of ALGORITHM.md §10 against the §2 method and the exact reference.

use sagebwd::config::{Format, PdsQuant, VARIANTS};
use sagebwd::inputs::random;
use sagebwd::metrics::compare;
use sagebwd::reference::exact;
use sagebwd::sim::simulate;
use sagebwd::{Config, Shape};

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The variant code path with groups spelled out as the §2.1 ones (so `pds` is not the default and the
/// variant path runs) gives the `sagebwd` preset's results bit for bit: the reference of the study is
/// unchanged, and the variant path's INT8 groups are the §2 quantizer.
#[test]
fn variant_path_with_the_default_groups_is_sagebwd_bit_for_bit() {
    let cases = [
        (Shape::square(1, 2, 300, 64), false, 1.0, 64, 128),
        (Shape::square(1, 2, 300, 64), true, 5.0, 64, 128),
        (
            Shape {
                batch: 1,
                heads_q: 4,
                heads_kv: 2,
                n_q: 150,
                n_k: 230,
                head_dim: 32,
            },
            true,
            3.0,
            32,
            64,
        ),
    ];
    for (seed, (s, causal, sigma, bq, bkv)) in cases.into_iter().enumerate() {
        let inp = random(s, causal, sigma, 40 + seed as u64, true);
        let mut base = Config::sagebwd();
        (base.block_q, base.block_kv) = (bq, bkv);
        let mut explicit = base.clone();
        explicit.pds = PdsQuant {
            p_fwd: Format::Int8 { rows: 1, cols: bkv },
            p_bwd: Format::Int8 { rows: bq, cols: bkv },
            ds_dq: Format::Int8 { rows: bq, cols: bkv },
            ds_dk: Format::Int8 { rows: bq, cols: 0 },
            ..PdsQuant::default()
        };
        assert!(!explicit.pds.is_default());
        let a = simulate(&inp, &base, true).unwrap();
        let b = simulate(&inp, &explicit, true).unwrap();
        assert_eq!(bits(&a.fwd.o), bits(&b.fwd.o), "O {s:?}");
        assert_eq!(bits(&a.fwd.lse), bits(&b.fwd.lse), "lse {s:?}");
        let (ga, gb) = (a.grads.unwrap(), b.grads.unwrap());
        assert_eq!(bits(&ga.dq), bits(&gb.dq), "dQ {s:?}");
        assert_eq!(bits(&ga.dk), bits(&gb.dk), "dK {s:?}");
        assert_eq!(bits(&ga.dv), bits(&gb.dv), "dV {s:?}");
        let (ia, ib) = (a.inter.unwrap(), b.inter.unwrap());
        assert_eq!(bits(&ia.p), bits(&ib.p));
        assert_eq!(bits(&ia.ds), bits(&ib.ds));
    }
}

/// The `sagebwd` preset is still the §2 method (no variant field set).
#[test]
fn sagebwd_preset_keeps_the_default_quantization() {
    assert!(Config::sagebwd().pds.is_default());
    assert!(Config::sagebwd().has_kernels());
    for v in VARIANTS {
        let c = Config::preset(v).unwrap();
        assert!(!c.has_kernels() && c.validate().is_ok(), "{v}");
        assert_eq!(c.label(), v);
        assert_eq!(c.precision, Config::sagebwd().precision);
    }
}

/// Every variant is an approximation of attention: its errors against f64 are small and of the size
/// its format allows (INT8 groups ≤ the tile's error; FP8 formats within 3-bit (e4m3) or 2-bit (e5m2)
/// mantissa errors), at σ = 1 where the paper's Table 1 is. A wrong scale or group would be O(1).
#[test]
fn variants_are_accurate_to_their_format() {
    let s = Shape::square(1, 2, 256, 64);
    for causal in [false, true] {
        let inp = random(s, causal, 1.0, 7, true);
        let ex = exact(&inp, false).unwrap();
        let eg = ex.grads.as_ref().unwrap();
        let base = simulate(&inp, &Config::sagebwd(), false).unwrap();
        let err = |o: &sagebwd::sim::SimOutput| {
            let g = o.grads.as_ref().unwrap();
            [
                compare(&o.fwd.o, &ex.o).rel_l2,
                compare(&g.dq, &eg.dq).rel_l2,
                compare(&g.dk, &eg.dk).rel_l2,
                compare(&g.dv, &eg.dv).rel_l2,
            ]
        };
        let e0 = err(&base);
        for v in VARIANTS {
            let e = err(&simulate(&inp, &Config::preset(v).unwrap(), false).unwrap());
            let bound = if v.contains("e5m2") {
                0.12
            } else if v.starts_with("int8") {
                1.05 * e0.iter().cloned().fold(0.0, f64::max)
            } else {
                0.08
            };
            for (name, x) in ["O", "dQ", "dK", "dV"].iter().zip(e) {
                assert!(
                    x.is_finite() && x < bound && x > 1e-4,
                    "{v} causal={causal} {name}: {x} (bound {bound}, sagebwd {e0:?})"
                );
            }
        }
    }
}
