//! The CPU matrix product `out (+)= A · B` (row-major, f32), cache-blocked and parallel over row
//! blocks of `out`. Every output element is summed over `k` in the same order whatever the thread
//! count, so results are bit-for-bit reproducible (the resume test depends on it).

use rayon::prelude::*;

/// Output rows computed together: each loaded row of B is used `MR` times (6 rows × 16 columns are
/// twelve 8-wide accumulators, which with two B vectors and a broadcast fill the 16 AVX2 registers).
const MR: usize = 6;
/// Output columns per tile: `MR × NB` accumulators stay in L1.
const NB: usize = 64;
/// Reduction length per pass: a `KB × NB` block of B (64 KB) stays in L2 while every row tile of
/// the task's rows uses it.
const KB: usize = 256;
/// Largest row block per parallel task (smaller when that leaves too few tasks for the threads).
const MB: usize = 64;

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
    if m == 0 || n == 0 || k == 0 {
        if !accumulate {
            out.fill(0.0);
        }
        return;
    }
    let fma = has_avx2_fma();
    // Rows per task: at most MB, and at least 4 tasks per thread when the matrix allows it.
    let threads = rayon::current_num_threads().max(1);
    let rows_per_task = (m.div_ceil(4 * threads).div_ceil(MR) * MR).clamp(MR, MB);
    out.par_chunks_mut(rows_per_task * n)
        .enumerate()
        .for_each(|(task, out_rows)| {
            let rows = out_rows.len() / n;
            let row0 = task * rows_per_task;
            // Full 16-wide column strips go through the AVX2 register kernel, the rest through `tile`.
            // The first k-block overwrites `out` unless accumulating (no separate zero fill: `out` can be
            // 50 MB of logits). With few columns, the column strips are the innermost loop so that each
            // A tile is read from memory once; with many, the B strip is (it stays in L1).
            let simd_cols = if fma { n / 16 * 16 } else { 0 };
            let strips: Vec<(usize, bool)> = (0..simd_cols)
                .step_by(16)
                .map(|n0| (n0, true))
                .chain((simd_cols..n).step_by(NB).map(|n0| (n0, false)))
                .collect();
            let run = |out_rows: &mut [f32], r0: usize, k0: usize, (n0, simd): (usize, bool)| {
                let r1 = (r0 + MR).min(rows);
                let a_src = ASource {
                    a,
                    m,
                    k,
                    row0: row0 + r0,
                };
                let k1 = (k0 + KB).min(k);
                let overwrite = k0 == 0 && !accumulate;
                let dst = &mut out_rows[r0 * n..r1 * n];
                if simd {
                    // SAFETY: AVX2 and FMA are present (simd is only set then); rows r0..r1 of this task,
                    // columns n0..n0+16 ≤ n and reduction k0..k1 ≤ k are in bounds.
                    unsafe { avx2_strip::<AT>(dst, &a_src, b, k0, k1, n, n0, overwrite) }
                } else {
                    tile::<false, AT>(dst, &a_src, b, k0, k1, n, n0, overwrite);
                }
            };
            if n <= 256 {
                for k0 in (0..k).step_by(KB) {
                    for r0 in (0..rows).step_by(MR) {
                        strips.iter().for_each(|&st| run(out_rows, r0, k0, st));
                    }
                }
            } else {
                for &st in &strips {
                    for k0 in (0..k).step_by(KB) {
                        for r0 in (0..rows).step_by(MR) {
                            run(out_rows, r0, k0, st);
                        }
                    }
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
    /// [`ASource::at`] without the bounds check.
    ///
    /// # Safety
    /// `r` must be a row of this source's block and `kk < k`.
    #[inline(always)]
    unsafe fn at_unchecked<const AT: bool>(&self, r: usize, kk: usize) -> f32 {
        if AT {
            *self.a.get_unchecked(kk * self.m + self.row0 + r)
        } else {
            *self.a.get_unchecked((self.row0 + r) * self.k + kk)
        }
    }

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
use avx2::strip as avx2_strip;

/// Without x86-64 the SIMD path is never taken (`has_avx2_fma` is false).
#[cfg(not(target_arch = "x86_64"))]
#[allow(clippy::too_many_arguments)]
unsafe fn avx2_strip<const AT: bool>(
    out: &mut [f32],
    a: &ASource,
    b: &[f32],
    k0: usize,
    k1: usize,
    n: usize,
    n0: usize,
    overwrite: bool,
) {
    tile::<false, AT>(out, a, b, k0, k1, n, n0, overwrite)
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{ASource, MR};
    use std::arch::x86_64::*;

    /// `out[r, n0..n0+16] += Σ_{kk in k0..k1} a[r, kk] · b[kk, n0..n0+16]` for the (≤ MR) rows of
    /// `out_rows`, with the accumulators in registers.
    /// (`overwrite`: `=` instead of `+=`.)
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn strip<const AT: bool>(
        out_rows: &mut [f32],
        a: &ASource,
        b: &[f32],
        k0: usize,
        k1: usize,
        n: usize,
        n0: usize,
        overwrite: bool,
    ) {
        match out_rows.len() / n {
            6 => kernel::<6, AT>(out_rows, a, b, k0, k1, n, n0, overwrite),
            5 => kernel::<5, AT>(out_rows, a, b, k0, k1, n, n0, overwrite),
            4 => kernel::<4, AT>(out_rows, a, b, k0, k1, n, n0, overwrite),
            3 => kernel::<3, AT>(out_rows, a, b, k0, k1, n, n0, overwrite),
            2 => kernel::<2, AT>(out_rows, a, b, k0, k1, n, n0, overwrite),
            _ => kernel::<1, AT>(out_rows, a, b, k0, k1, n, n0, overwrite),
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn kernel<const R: usize, const AT: bool>(
        out_rows: &mut [f32],
        a: &ASource,
        b: &[f32],
        k0: usize,
        k1: usize,
        n: usize,
        n0: usize,
        overwrite: bool,
    ) {
        const { assert!(R <= MR) };
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let bp = b.as_ptr();
        for kk in k0..k1 {
            let b0 = _mm256_loadu_ps(bp.add(kk * n + n0));
            let b1 = _mm256_loadu_ps(bp.add(kk * n + n0 + 8));
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let av = _mm256_set1_ps(a.at_unchecked::<AT>(r, kk));
                acc_r[0] = _mm256_fmadd_ps(av, b0, acc_r[0]);
                acc_r[1] = _mm256_fmadd_ps(av, b1, acc_r[1]);
            }
        }
        let op = out_rows.as_mut_ptr();
        for (r, acc_r) in acc.iter().enumerate() {
            let dst = op.add(r * n + n0);
            if overwrite {
                _mm256_storeu_ps(dst, acc_r[0]);
                _mm256_storeu_ps(dst.add(8), acc_r[1]);
            } else {
                _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), acc_r[0]));
                _mm256_storeu_ps(dst.add(8), _mm256_add_ps(_mm256_loadu_ps(dst.add(8)), acc_r[1]));
            }
        }
    }
}

/// Adds to one `rows × NB` tile of `out` (columns from `n0`) the products over `k0..k1`
/// (`overwrite`: stores them instead).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn tile<const FMA: bool, const AT: bool>(
    out_rows: &mut [f32],
    a_src: &ASource,
    b: &[f32],
    k0: usize,
    k1: usize,
    n: usize,
    n0: usize,
    overwrite: bool,
) {
    let rows = out_rows.len() / n;
    let width = NB.min(n - n0);
    let mut acc = [[0.0f32; NB]; MR];
    if width == NB {
        for kk in k0..k1 {
            let b_row: &[f32; NB] = b[kk * n + n0..kk * n + n0 + NB].try_into().unwrap();
            for (r, acc_r) in acc.iter_mut().enumerate().take(rows) {
                madd::<FMA, NB>(acc_r, a_src.at::<AT>(r, kk), b_row);
            }
        }
    } else {
        for kk in k0..k1 {
            let b_row = &b[kk * n + n0..kk * n + n0 + width];
            for (r, acc_r) in acc.iter_mut().enumerate().take(rows) {
                let a_val = a_src.at::<AT>(r, kk);
                for (c, &bv) in acc_r[..width].iter_mut().zip(b_row) {
                    *c = if FMA { a_val.mul_add(bv, *c) } else { *c + a_val * bv };
                }
            }
        }
    }
    for r in 0..rows {
        let dst = &mut out_rows[r * n + n0..r * n + n0 + width];
        if overwrite {
            dst.copy_from_slice(&acc[r][..width]);
        } else {
            dst.iter_mut().zip(&acc[r][..width]).for_each(|(o, s)| *o += s);
        }
    }
}

#[inline(always)]
fn madd<const FMA: bool, const W: usize>(acc: &mut [f32; NB], a_val: f32, b_row: &[f32; W]) {
    for i in 0..W {
        acc[i] = if FMA {
            a_val.mul_add(b_row[i], acc[i])
        } else {
            acc[i] + a_val * b_row[i]
        };
    }
}

/// `dst[cols×rows] = srcᵀ` for `src[rows×cols]`, in 32×32 blocks, parallel over blocks of `src` rows.
pub fn transpose(src: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    assert_eq!(src.len(), rows * cols);
    const T: usize = 32;
    let mut dst = vec![0.0f32; src.len()];
    let dst_addr = dst.as_mut_ptr() as usize;
    (0..rows.div_ceil(T)).into_par_iter().for_each(|rb| {
        let dst = dst_addr as *mut f32;
        let (r0, r1) = (rb * T, ((rb + 1) * T).min(rows));
        for c0 in (0..cols).step_by(T) {
            for c in c0..(c0 + T).min(cols) {
                for r in r0..r1 {
                    // SAFETY: c < cols and r < rows, so the index is inside `dst`; tasks write
                    // disjoint rows r0..r1 of every destination row, so no two write one element.
                    unsafe { *dst.add(c * rows + r) = src[r * cols + c] };
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

    /// Shapes cover: ragged rows (not a multiple of 6) and columns (not of 16), k over one k-block
    /// (256), n over 256 (the other loop order), and both `=` and `+=`.
    #[test]
    fn gemm_matches_naive_on_ragged_shapes() {
        let mut rng = Rng::new(1);
        let shapes = [
            (1, 1, 1),
            (5, 3, 7),
            (9, 130, 65),
            (4, 64, 64),
            (17, 33, 200),
            (7, 600, 40),
            (13, 300, 300),
        ];
        for &(m, k, n) in &shapes {
            let a: Vec<f32> = (0..m * k).map(|_| rng.normal() as f32).collect();
            let b: Vec<f32> = (0..k * n).map(|_| rng.normal() as f32).collect();
            let want = naive(&a, &b, m, k, n);
            for accumulate in [true, false] {
                let base = if accumulate { 1.0 } else { 0.0 };
                let mut out = vec![1.0f32; m * n];
                gemm(&mut out, &a, &b, m, k, n, accumulate);
                let mut out_t = vec![1.0f32; m * n];
                gemm_at(&mut out_t, &transpose(&a, m, k), &b, m, k, n, accumulate);
                for ((o, ot), w) in out.iter().zip(&out_t).zip(&want) {
                    let tol = 1e-5 * (k as f64).sqrt() * (1.0 + w.abs());
                    assert!(
                        (*o as f64 - base - w).abs() < tol,
                        "{m}x{k}x{n} acc={accumulate}: {o} vs {w}+{base}"
                    );
                    assert_eq!(o, ot, "{m}x{k}x{n}: transposed A gives another sum");
                }
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
