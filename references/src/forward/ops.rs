//! The reference's numeric building blocks: f32 storage, f64 accumulation.
//!
//! Every dot product sums in f64 over eight fixed lanes (element i goes to lane i mod 8), then
//! adds the lanes pairwise. The order is fixed by the code, so results do not depend on the
//! instruction set: the AVX2 build of [`matmul_t`] is the same Rust, only compiled wider.

use rayon::prelude::*;

/// `x [n, k] · wᵀ` for `w [m, k]` (torch layout), giving `[n, m]`.
pub fn matmul_t(x: &[f32], n: usize, k: usize, w: &[f32], m: usize) -> Vec<f32> {
    assert_eq!(x.len(), n * k, "matmul_t: x is not [n, k]");
    assert_eq!(w.len(), m * k, "matmul_t: w is not [m, k]");
    let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    // Output transposed ([m, n]) so each task owns whole rows; transposed back at the end.
    let mut out_t = vec![0f32; m * n];
    const ROWS_PER_TASK: usize = 16;
    out_t
        .par_chunks_mut(ROWS_PER_TASK * n)
        .enumerate()
        .for_each(|(task_idx, chunk)| {
            let row0 = task_idx * ROWS_PER_TASK;
            for (i, out_row) in chunk.chunks_mut(n).enumerate() {
                let w_row = &w[(row0 + i) * k..(row0 + i + 1) * k];
                dot_rows(&x64, k, w_row, out_row);
            }
        });
    let mut out = vec![0f32; n * m];
    for r in 0..m {
        for t in 0..n {
            out[t * m + r] = out_t[r * n + t];
        }
    }
    out
}

/// `out[t] = x64[t] · w_row` for every token t, dispatching to a wider build where available.
fn dot_rows(x64: &[f64], k: usize, w_row: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports AVX-512F, checked just above.
            return unsafe { dot_rows_avx512(x64, k, w_row, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { dot_rows_avx2(x64, k, w_row, out) };
        }
    }
    dot_rows_portable(x64, k, w_row, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_rows_avx512(x64: &[f64], k: usize, w_row: &[f32], out: &mut [f32]) {
    dot_rows_portable(x64, k, w_row, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dot_rows_avx2(x64: &[f64], k: usize, w_row: &[f32], out: &mut [f32]) {
    dot_rows_portable(x64, k, w_row, out)
}

/// Tokens in tiles of 8, then 4, then one at a time share each widened weight chunk (8 tiles
/// keep 8 independent f64 add chains in flight, which hides the add latency). Every token's sum
/// keeps the 8-lane order of [`dot64`], so the result equals one `dot64` per token.
#[inline(always)]
fn dot_rows_portable(x64: &[f64], k: usize, w_row: &[f32], out: &mut [f32]) {
    let n = out.len();
    let mut t = 0;
    while t + 8 <= n {
        dot_tile::<8>(x64, k, w_row, t, out);
        t += 8;
    }
    while t + 4 <= n {
        dot_tile::<4>(x64, k, w_row, t, out);
        t += 4;
    }
    for (u, o) in out.iter_mut().enumerate().skip(t) {
        *o = dot64(&x64[u * k..(u + 1) * k], w_row) as f32;
    }
}

/// `out[t0 + u] = x64[t0 + u] · w_row` for the `T` tokens of one tile.
#[inline(always)]
fn dot_tile<const T: usize>(x64: &[f64], k: usize, w_row: &[f32], t0: usize, out: &mut [f32]) {
    let k8 = k - k % 8;
    let xs: [&[f64]; T] = std::array::from_fn(|u| &x64[(t0 + u) * k..(t0 + u + 1) * k]);
    let mut lanes = [[0f64; 8]; T];
    for (c, w) in w_row[..k8].chunks_exact(8).enumerate() {
        let w: [f64; 8] = std::array::from_fn(|j| w[j] as f64);
        for (acc, x) in lanes.iter_mut().zip(&xs) {
            let x: &[f64; 8] = x[c * 8..c * 8 + 8].try_into().expect("8 lanes");
            for j in 0..8 {
                acc[j] += x[j] * w[j];
            }
        }
    }
    for (u, (acc, x)) in lanes.iter_mut().zip(&xs).enumerate() {
        for (j, idx) in (k8..k).enumerate() {
            acc[j] += x[idx] * w_row[idx] as f64;
        }
        out[t0 + u] = reduce_lanes(acc) as f32;
    }
}

#[inline(always)]
fn reduce_lanes(l: &[f64; 8]) -> f64 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// Σ a·b in f64 with the fixed 8-lane order described in the module doc.
#[inline(always)]
pub fn dot64(a: &[f64], b: &[f32]) -> f64 {
    let mut lanes = [0f64; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (xa, xb) in (&mut ca).zip(&mut cb) {
        for i in 0..8 {
            lanes[i] += xa[i] * xb[i] as f64;
        }
    }
    for (i, (&xa, &xb)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        lanes[i] += xa * xb as f64;
    }
    reduce_lanes(&lanes)
}

/// RMSNorm of each row of `x [n, d]`, times `w [d]`: x · w / sqrt(mean(x²) + eps).
pub fn rms_norm(x: &[f32], d: usize, w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = vec![0f32; x.len()];
    for (row, o) in x.chunks(d).zip(out.chunks_mut(d)) {
        let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / d as f64;
        let inv = 1.0 / (ms + eps as f64).sqrt();
        for i in 0..d {
            o[i] = (row[i] as f64 * inv * w[i] as f64) as f32;
        }
    }
    out
}

/// RoPE, llama.cpp's NORM style, in place on `v` (one head's rotary part, even length):
/// pairs (2i, 2i+1) rotate by pos·base^(−2i/n_dims).
pub fn rope_norm(v: &mut [f32], pos: usize, n_dims: usize, base: f32) {
    for i in 0..n_dims / 2 {
        let theta = pos as f64 * (base as f64).powf(-2.0 * i as f64 / n_dims as f64);
        let (sin, cos) = theta.sin_cos();
        let (x0, x1) = (v[2 * i] as f64, v[2 * i + 1] as f64);
        v[2 * i] = (x0 * cos - x1 * sin) as f32;
        v[2 * i + 1] = (x0 * sin + x1 * cos) as f32;
    }
}

/// Softmax in place over f64 scores.
pub fn softmax(s: &mut [f64]) {
    let max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let mut sum = 0.0;
    for v in s.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in s.iter_mut() {
        *v /= sum;
    }
}

pub fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

/// silu(gate) · up, elementwise.
pub fn swiglu(gate: &[f32], up: &[f32]) -> Vec<f32> {
    gate.iter()
        .zip(up)
        .map(|(&g, &u)| (silu(g as f64) * u as f64) as f32)
        .collect()
}

pub fn add(a: &[f32], b: &[f32]) -> Vec<f32> {
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}

/// Causal multi-head attention over one sequence.
/// `q [n, H·dk]`, `k [n, KVh·dk]`, `v [n, KVh·dv]`; query head h reads kv head h / (H / KVh).
/// Returns `[n, H·dv]`.
pub fn causal_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n: usize,
    n_heads: usize,
    n_kv_heads: usize,
    dk: usize,
    dv: usize,
    scale: f64,
) -> Vec<f32> {
    let group = n_heads / n_kv_heads;
    let mut out = vec![0f32; n * n_heads * dv];
    out.par_chunks_mut(n_heads * dv).enumerate().for_each(|(t, out_t)| {
        let mut scores = vec![0f64; t + 1];
        let mut acc = vec![0f64; dv];
        for h in 0..n_heads {
            let kvh = h / group;
            let qh = &q[(t * n_heads + h) * dk..(t * n_heads + h + 1) * dk];
            for (s, score) in scores.iter_mut().enumerate() {
                let kh = &k[(s * n_kv_heads + kvh) * dk..(s * n_kv_heads + kvh + 1) * dk];
                *score = qh.iter().zip(kh).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * scale;
            }
            softmax(&mut scores);
            acc.iter_mut().for_each(|a| *a = 0.0);
            for (s, &p) in scores.iter().enumerate() {
                let vh = &v[(s * n_kv_heads + kvh) * dv..(s * n_kv_heads + kvh + 1) * dv];
                for (a, &x) in acc.iter_mut().zip(vh) {
                    *a += p * x as f64;
                }
            }
            for (o, a) in out_t[h * dv..(h + 1) * dv].iter_mut().zip(&acc) {
                *o = *a as f32;
            }
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmul_matches_naive() {
        let (n, k, m) = (3, 19, 5);
        let x: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let w: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.11).cos()).collect();
        let y = matmul_t(&x, n, k, &w, m);
        for t in 0..n {
            for r in 0..m {
                let naive: f64 = (0..k).map(|i| x[t * k + i] as f64 * w[r * k + i] as f64).sum();
                assert!((y[t * m + r] as f64 - naive).abs() < 1e-6);
            }
        }
    }

    #[test]
    fn token_tiles_equal_single_dots() {
        // 13 tokens: one tile of 8, one of 4, one single.
        let (n, k, m) = (13, 37, 3);
        let x: Vec<f32> = (0..n * k).map(|i| (i as f32 * 0.731).sin() * 3.0).collect();
        let w: Vec<f32> = (0..m * k).map(|i| (i as f32 * 0.277).cos()).collect();
        let y = matmul_t(&x, n, k, &w, m);
        for t in 0..n {
            let xt: Vec<f64> = x[t * k..(t + 1) * k].iter().map(|&v| v as f64).collect();
            for r in 0..m {
                assert_eq!(y[t * m + r], dot64(&xt, &w[r * k..(r + 1) * k]) as f32);
            }
        }
    }

    #[test]
    fn rope_rotates_pairs_and_keeps_norm() {
        let mut v = vec![1.0f32, 0.0, 0.5, 0.5];
        rope_norm(&mut v, 3, 4, 10000.0);
        assert!((v[0] - 3f32.cos()).abs() < 1e-6 && (v[1] - 3f32.sin()).abs() < 1e-6);
        let n2: f32 = v[2] * v[2] + v[3] * v[3];
        assert!((n2 - 0.5).abs() < 1e-6);
        let mut z = vec![1.0f32, 2.0];
        rope_norm(&mut z, 0, 2, 10000.0);
        assert_eq!(z, vec![1.0, 2.0]);
    }

    #[test]
    fn attention_first_token_copies_its_value() {
        let q = vec![0.3f32; 4];
        let k = vec![0.1f32; 2];
        let v = vec![1.5f32, -2.0];
        let out = causal_attention(&q, &k, &v, 1, 2, 1, 2, 2, 1.0);
        assert_eq!(out, vec![1.5, -2.0, 1.5, -2.0]);
    }
}
