//! The CPU matrix product `out (+)= A · B` (row-major, f32), cache-blocked and parallel over row
//! blocks of `out`. Every output element is summed over `k` in the same order whatever the thread
//! count, so results are bit-for-bit reproducible (the resume test depends on it).

use rayon::prelude::*;

/// Output rows computed together: each loaded row of B is used `MR` times.
const MR: usize = 4;
/// Output columns per tile: `MR × NB` accumulators stay in L1.
const NB: usize = 64;

/// `out[m×n] = a[m×k] · b[k×n]`, or `+=` when `accumulate`.
pub fn gemm(out: &mut [f32], a: &[f32], b: &[f32], m: usize, k: usize, n: usize, accumulate: bool) {
    gemm_any::<false>(out, a, b, m, k, n, accumulate)
}

/// `out[m×n] = a_tᵀ · b[k×n]` with `a_t` stored as `k×m` (weight gradients `dW = dYᵀ X` without a
/// transpose), or `+=` when `accumulate`.
pub fn gemm_at(out: &mut [f32], a_t: &[f32], b: &[f32], m: usize, k: usize, n: usize, accumulate: bool) {
    gemm_any::<true>(out, a_t, b, m, k, n, accumulate)
}

fn gemm_any<const AT: bool>(out: &mut [f32], a: &[f32], b: &[f32], m: usize, k: usize, n: usize, accumulate: bool) {
    assert_eq!(out.len(), m * n, "gemm: out is not m×n");
    assert_eq!(a.len(), m * k, "gemm: a is not m×k");
    assert_eq!(b.len(), k * n, "gemm: b is not k×n");
    if !accumulate {
        out.fill(0.0);
    }
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    let fma = has_avx2_fma();
    out.par_chunks_mut(MR * n).enumerate().for_each(|(block, out_rows)| {
        let a_src = ASource { a, m, k, row0: block * MR };
        for n0 in (0..n).step_by(NB) {
            if fma {
                // SAFETY: the CPU supports AVX2 and FMA (checked at run time above).
                unsafe { tile_avx2::<AT>(out_rows, &a_src, b, k, n, n0) }
            } else {
                tile::<false, AT>(out_rows, &a_src, b, k, n, n0)
            }
        }
    });
}

fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The A operand of one row block: `a[m×k]`, or `a[k×m]` read transposed when `AT`.
struct ASource<'a> {
    a: &'a [f32],
    m: usize,
    k: usize,
    row0: usize,
}

impl ASource<'_> {
    #[inline(always)]
    fn at<const AT: bool>(&self, r: usize, kk: usize) -> f32 {
        if AT {
            self.a[kk * self.m + self.row0 + r]
        } else {
            self.a[(self.row0 + r) * self.k + kk]
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<const AT: bool>(out_rows: &mut [f32], a: &ASource, b: &[f32], k: usize, n: usize, n0: usize) {
    tile::<true, AT>(out_rows, a, b, k, n, n0)
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn tile_avx2<const AT: bool>(out_rows: &mut [f32], a: &ASource, b: &[f32], k: usize, n: usize, n0: usize) {
    tile::<false, AT>(out_rows, a, b, k, n, n0)
}

/// One `rows × NB` tile of `out` starting at column `n0`, summed over all of `k`.
#[inline(always)]
fn tile<const FMA: bool, const AT: bool>(out_rows: &mut [f32], a_src: &ASource, b: &[f32], k: usize, n: usize, n0: usize) {
    let rows = out_rows.len() / n;
    let width = NB.min(n - n0);
    let mut acc = [[0.0f32; NB]; MR];
    if width == NB {
        for kk in 0..k {
            let b_row: &[f32; NB] = b[kk * n + n0..kk * n + n0 + NB].try_into().unwrap();
            for r in 0..rows {
                let a_val = a_src.at::<AT>(r, kk);
                madd::<FMA, NB>(&mut acc[r], a_val, b_row);
            }
        }
    } else {
        for kk in 0..k {
            let b_row = &b[kk * n + n0..kk * n + n0 + width];
            for r in 0..rows {
                let a_val = a_src.at::<AT>(r, kk);
                for (c, &bv) in acc[r][..width].iter_mut().zip(b_row) {
                    *c = if FMA { a_val.mul_add(bv, *c) } else { *c + a_val * bv };
                }
            }
        }
    }
    for r in 0..rows {
        let dst = &mut out_rows[r * n + n0..r * n + n0 + width];
        dst.iter_mut().zip(&acc[r][..width]).for_each(|(o, s)| *o += s);
    }
}

#[inline(always)]
fn madd<const FMA: bool, const W: usize>(acc: &mut [f32; NB], a_val: f32, b_row: &[f32; W]) {
    for i in 0..W {
        acc[i] = if FMA { a_val.mul_add(b_row[i], acc[i]) } else { acc[i] + a_val * b_row[i] };
    }
}

/// `dst[cols×rows] = srcᵀ` for `src[rows×cols]`, in cache-sized blocks.
pub fn transpose(src: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    assert_eq!(src.len(), rows * cols);
    let mut dst = vec![0.0f32; src.len()];
    const T: usize = 32;
    dst.par_chunks_mut(T * rows).enumerate().for_each(|(cb, dst_rows)| {
        let c0 = cb * T;
        let c_end = (c0 + T).min(cols);
        for r0 in (0..rows).step_by(T) {
            for r in r0..(r0 + T).min(rows) {
                for c in c0..c_end {
                    dst_rows[(c - c0) * rows + r] = src[r * cols + c];
                }
            }
        }
    });
    dst
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    fn naive(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f64> {
        let mut out = vec![0.0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k).map(|p| a[i * k + p] as f64 * b[p * n + j] as f64).sum();
            }
        }
        out
    }

    #[test]
    fn gemm_matches_naive_on_ragged_shapes() {
        let mut rng = Rng::new(1);
        for &(m, k, n) in &[(1, 1, 1), (5, 3, 7), (9, 130, 65), (4, 64, 64), (17, 33, 200)] {
            let a: Vec<f32> = (0..m * k).map(|_| rng.normal() as f32).collect();
            let b: Vec<f32> = (0..k * n).map(|_| rng.normal() as f32).collect();
            let want = naive(&a, &b, m, k, n);
            let mut out = vec![1.0f32; m * n];
            gemm(&mut out, &a, &b, m, k, n, true);
            let mut out_t = vec![1.0f32; m * n];
            gemm_at(&mut out_t, &transpose(&a, m, k), &b, m, k, n, true);
            for ((o, ot), w) in out.iter().zip(&out_t).zip(&want) {
                assert!((*o as f64 - 1.0 - w).abs() < 1e-4 * (1.0 + w.abs()), "{m}x{k}x{n}: {o} vs {w}+1");
                assert_eq!(o, ot, "{m}x{k}x{n}: transposed A gives another sum");
            }
        }
    }

    #[test]
    fn transpose_swaps_indices() {
        let src: Vec<f32> = (0..35 * 70).map(|x| x as f32).collect();
        let t = transpose(&src, 35, 70);
        for r in 0..35 {
            for c in 0..70 {
                assert_eq!(t[c * 35 + r], src[r * 70 + c]);
            }
        }
    }
}
