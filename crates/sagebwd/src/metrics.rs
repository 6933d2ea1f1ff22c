//! Error metrics of SAGEBWD.md §6: cosine similarity, relative L2, relative L1, RMSE, of a result `x`
//! against a reference `r`, both flattened. Non-finite reference entries (an empty row's `+∞` LSE)
//! are skipped when `x` has the same value there; any other non-finite value makes every metric NaN.

use serde::Serialize;

/// All four metrics of one comparison.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Metrics {
    pub cos: f64,
    pub rel_l2: f64,
    pub rel_l1: f64,
    pub rmse: f64,
}

/// Compares `x` with the reference `r` (same length).
pub fn compare<X: Copy + Into<f64>>(x: &[X], r: &[f64]) -> Metrics {
    assert_eq!(x.len(), r.len(), "compare: length mismatch");
    let (mut xr, mut xx, mut rr, mut e2, mut e1, mut r1, mut n) = (0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0usize);
    for (&xi, &ri) in x.iter().zip(r) {
        let xi: f64 = xi.into();
        if !ri.is_finite() && xi == ri {
            continue;
        }
        let e = xi - ri;
        xr += xi * ri;
        xx += xi * xi;
        rr += ri * ri;
        e2 += e * e;
        e1 += e.abs();
        r1 += ri.abs();
        n += 1;
    }
    let div = |a: f64, b: f64| {
        if b == 0.0 {
            if a == 0.0 {
                0.0
            } else {
                f64::INFINITY
            }
        } else {
            a / b
        }
    };
    let cos = if xx == 0.0 && rr == 0.0 {
        1.0
    } else {
        xr / (xx.sqrt() * rr.sqrt())
    };
    Metrics {
        cos,
        rel_l2: div(e2.sqrt(), rr.sqrt()),
        rel_l1: div(e1, r1),
        rmse: if n == 0 { 0.0 } else { (e2 / n as f64).sqrt() },
    }
}

pub fn cosine<X: Copy + Into<f64>>(x: &[X], r: &[f64]) -> f64 {
    compare(x, r).cos
}

pub fn rel_l2<X: Copy + Into<f64>>(x: &[X], r: &[f64]) -> f64 {
    compare(x, r).rel_l2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_of_known_vectors() {
        let r = [3.0, 4.0];
        let m = compare(&[3.0f64, 4.0], &r);
        assert_eq!((m.cos, m.rel_l2, m.rel_l1, m.rmse), (1.0, 0.0, 0.0, 0.0));
        let m = compare(&[3.0f64, 5.0], &r);
        assert!((m.rel_l2 - 0.2).abs() < 1e-12);
        assert!((m.rel_l1 - 1.0 / 7.0).abs() < 1e-12);
        assert!((m.rmse - (0.5f64).sqrt()).abs() < 1e-12);
        assert!((m.cos - 29.0 / (5.0 * 34f64.sqrt())).abs() < 1e-12);
        let m = compare(&[-3.0f64, -4.0], &r);
        assert!((m.cos + 1.0).abs() < 1e-12);
    }

    #[test]
    fn nan_is_never_a_good_result() {
        let m = compare(&[f64::NAN, 1.0], &[1.0, 1.0]);
        assert!(m.cos.is_nan() && m.rel_l2.is_nan());
        // A matching +inf (empty causal row) is skipped, a mismatching one is not.
        let m = compare(&[f64::INFINITY, 1.0], &[f64::INFINITY, 1.0]);
        assert_eq!(m.rel_l2, 0.0);
        assert!(compare(&[1.0f64, 1.0], &[f64::INFINITY, 1.0]).rel_l2.is_nan());
    }
}
