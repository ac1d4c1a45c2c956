//! The reference's numeric building blocks: f32 storage, f64 accumulation.
//!
//! Every dot product sums in f64 over eight fixed lanes (element i goes to lane i mod 8), then
//! adds the lanes pairwise ([`dot64`] is the definition). The order is fixed by the code, so
//! results do not depend on the instruction set. The inputs are f32 values widened to f64, so
//! each product is exact in f64 (24 + 24 significant bits < 53): a fused multiply-add rounds
//! exactly as a multiply-then-add does. The AVX-512 build of [`matmul_t`] uses FMA, the others
//! do not, and the tests hold every build to [`dot64`] bit for bit.
//!
//! Speed comes only from doing many such sums at once: a block of [`ROWS`] weight rows ×
//! [`TOKENS`] tokens keeps its lanes in registers while k runs, so each widened weight chunk
//! feeds eight tokens and each token chunk feeds three rows; a long k (over 2 · [`K_BLOCK`])
//! runs in passes of [`K_BLOCK`] (the lanes kept between passes, so each still sums in
//! ascending k) so that the tokens' inputs stay in cache across a task's rows.

use rayon::prelude::*;

/// Weight rows per register block (3 rows × 8 tokens: 24 of the 32 AVX-512 registers).
const ROWS: usize = 3;
/// Tokens per register block (then 4, then 1 for the remainder).
const TOKENS: usize = 8;
/// Weight rows per rayon task.
const ROWS_PER_TASK: usize = 24;
/// Elements of k per pass over a task's rows and tokens when k is long (a multiple of 8): a pass
/// reads every token's `K_BLOCK` values (8 KiB a token in f64) for each row triple, so they stay
/// in cache instead of streaming the whole `[n, k]` input from memory once per triple. The lanes
/// carry over from pass to pass, so each lane still sums its elements in ascending k order. Up
/// to `2 · K_BLOCK` the whole k is one pass (a pass costs a load and store of the lanes).
const K_BLOCK: usize = 1024;

/// `x [n, k] · wᵀ` for `w [m, k]` (torch layout), giving `[n, m]`.
pub fn matmul_t(x: &[f32], n: usize, k: usize, w: &[f32], m: usize) -> Vec<f32> {
    assert_eq!(w.len(), m * k, "matmul_t: w is not [m, k]");
    matmul_t_with(x, n, k, m, |first, out| {
        out.copy_from_slice(&w[first * k..first * k + out.len()])
    })
}

/// [`matmul_t`] for a `w [m, k]` given by `fill(first, out)`, which writes rows `first..` of `w`
/// (`out.len() / k` of them) as f32: each task asks for its own rows, so a stored weight is
/// dequantized a few rows at a time, into a buffer that stays in cache, and never whole.
pub fn matmul_t_with(x: &[f32], n: usize, k: usize, m: usize, fill: impl Fn(usize, &mut [f32]) + Sync) -> Vec<f32> {
    assert_eq!(x.len(), n * k, "matmul_t: x is not [n, k]");
    if k == 0 || n == 0 {
        return vec![0.0; n * m];
    }
    let x64: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let k8 = k - k % 8;
    // Each task fills a `[n, ROWS_PER_TASK]` block for its rows, so the scatter into `[n, m]`
    // below copies whole 96-byte rows.
    let mut blocks = vec![0f32; m.div_ceil(ROWS_PER_TASK) * n * ROWS_PER_TASK];
    blocks.par_chunks_mut(n * ROWS_PER_TASK).enumerate().for_each_init(
        || (vec![0f32; ROWS_PER_TASK * k], vec![[0f64; 8]; ROWS_PER_TASK * n]),
        |(w_rows, lanes), (p, block)| {
            let n_rows = ROWS_PER_TASK.min(m - p * ROWS_PER_TASK);
            let w_rows = &mut w_rows[..n_rows * k];
            fill(p * ROWS_PER_TASK, w_rows);
            if k8 <= 2 * K_BLOCK {
                // One pass: each tile's lanes live in registers from the first chunk to the sum.
                let mut r = 0;
                while r + ROWS <= n_rows {
                    one_pass_tiles::<ROWS>(&x64, n, k, &w_rows[r * k..(r + ROWS) * k], r, block);
                    r += ROWS;
                }
                for r in r..n_rows {
                    one_pass_tiles::<1>(&x64, n, k, &w_rows[r * k..(r + 1) * k], r, block);
                }
                return;
            }
            // lanes[r * n + t]: the 8 lanes of row r · token t.
            let lanes = &mut lanes[..n_rows * n];
            lanes.iter_mut().for_each(|l| *l = [0.0; 8]);
            for c0 in (0..k8).step_by(K_BLOCK) {
                let c = c0..(c0 + K_BLOCK).min(k8);
                let mut r = 0;
                while r + ROWS <= n_rows {
                    token_tiles::<ROWS>(
                        &x64,
                        n,
                        k,
                        &w_rows[r * k..(r + ROWS) * k],
                        c.clone(),
                        &mut lanes[r * n..],
                    );
                    r += ROWS;
                }
                for r in r..n_rows {
                    token_tiles::<1>(&x64, n, k, &w_rows[r * k..(r + 1) * k], c.clone(), &mut lanes[r * n..]);
                }
            }
            // The tail into lanes 0.., then the pairwise lane sum: `dot64` exactly.
            for r in 0..n_rows {
                let w_r = &w_rows[r * k..(r + 1) * k];
                for t in 0..n {
                    let l = &mut lanes[r * n + t];
                    for (j, i) in (k8..k).enumerate() {
                        l[j] += x64[t * k + i] * w_r[i] as f64;
                    }
                    block[t * ROWS_PER_TASK + r] = reduce_lanes(l) as f32;
                }
            }
        },
    );
    let mut out = vec![0f32; n * m];
    for (p, block) in blocks.chunks_exact(n * ROWS_PER_TASK).enumerate() {
        let rows = ROWS_PER_TASK.min(m - p * ROWS_PER_TASK);
        let cols = p * ROWS_PER_TASK..p * ROWS_PER_TASK + rows;
        for (out_t, block_t) in out.chunks_exact_mut(m).zip(block.chunks_exact(ROWS_PER_TASK)) {
            out_t[cols.clone()].copy_from_slice(&block_t[..rows]);
        }
    }
    out
}

/// `block[t][r0 + r] = x64[t] · w_rows[r]` for the `R` rows and every token t, in tiles of 8,
/// 4 and 1 tokens, k in one pass.
fn one_pass_tiles<const R: usize>(x64: &[f64], n: usize, k: usize, w_rows: &[f32], r0: usize, block: &mut [f32]) {
    let mut t = 0;
    let mut tile = |t: usize, sums: &[[f64; R]]| {
        for (u, s) in sums.iter().enumerate() {
            for (r, &v) in s.iter().enumerate() {
                block[(t + u) * ROWS_PER_TASK + r0 + r] = v as f32;
            }
        }
    };
    while t + TOKENS <= n {
        tile(t, &dot_block::<R, TOKENS>(&x64[t * k..(t + TOKENS) * k], k, w_rows));
        t += TOKENS;
    }
    while t + 4 <= n {
        tile(t, &dot_block::<R, 4>(&x64[t * k..(t + 4) * k], k, w_rows));
        t += 4;
    }
    for t in t..n {
        tile(t, &dot_block::<R, 1>(&x64[t * k..(t + 1) * k], k, w_rows));
    }
}

/// `sums[u][r] = x[u] · w[r]` for `T` token rows of `x` and `R` weight rows of `w`, each equal to
/// [`dot64`]: the 8 lanes of the whole chunks (on the widest build the CPU has), then the tail
/// into lanes 0.., then the pairwise lane sum.
#[inline(always)]
fn dot_block<const R: usize, const T: usize>(x: &[f64], k: usize, w: &[f32]) -> [[f64; R]; T] {
    let k8 = k - k % 8;
    let mut lanes = chunk_lanes::<R, T>(x, k, w, 0..k8, None);
    std::array::from_fn(|u| {
        std::array::from_fn(|r| {
            let l = &mut lanes[u][r];
            for (j, i) in (k8..k).enumerate() {
                l[j] += x[u * k + i] * w[r * k + i] as f64;
            }
            reduce_lanes(l)
        })
    })
}

/// Adds the chunks `c` of `x64[t] · w_rows[r]` to `lanes[r * n + t]` for the `R` rows and every
/// token t, in tiles of 8, 4 and 1 tokens.
fn token_tiles<const R: usize>(
    x64: &[f64],
    n: usize,
    k: usize,
    w_rows: &[f32],
    c: std::ops::Range<usize>,
    lanes: &mut [[f64; 8]],
) {
    let mut t = 0;
    while t + TOKENS <= n {
        tile_pass::<R, TOKENS>(x64, n, k, w_rows, c.clone(), t, lanes);
        t += TOKENS;
    }
    while t + 4 <= n {
        tile_pass::<R, 4>(x64, n, k, w_rows, c.clone(), t, lanes);
        t += 4;
    }
    for t in t..n {
        tile_pass::<R, 1>(x64, n, k, w_rows, c.clone(), t, lanes);
    }
}

/// One tile of `T` tokens from `t0` × `R` rows over the chunks `c`: its lanes loaded from
/// `lanes`, advanced, stored back.
#[inline(always)]
fn tile_pass<const R: usize, const T: usize>(
    x64: &[f64],
    n: usize,
    k: usize,
    w_rows: &[f32],
    c: std::ops::Range<usize>,
    t0: usize,
    lanes: &mut [[f64; 8]],
) {
    let init: Lanes<R, T> = std::array::from_fn(|u| std::array::from_fn(|r| lanes[r * n + t0 + u]));
    let out = chunk_lanes::<R, T>(&x64[t0 * k..(t0 + T) * k], k, w_rows, c, Some(&init));
    for (u, l_u) in out.iter().enumerate() {
        for (r, l) in l_u.iter().enumerate() {
            lanes[r * n + t0 + u] = *l;
        }
    }
}

type Lanes<const R: usize, const T: usize> = [[[f64; 8]; R]; T];

/// `init` (zeros when None) plus the products of the 8-element chunks starting in `c` (8-aligned, within k), lane
/// j of (u, r) summing elements j, j + 8, ... of row u of `x` times row r of `w`, in order.
#[inline(always)]
fn chunk_lanes<const R: usize, const T: usize>(
    x: &[f64],
    k: usize,
    w: &[f32],
    c: std::ops::Range<usize>,
    init: Option<&Lanes<R, T>>,
) -> Lanes<R, T> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports AVX-512F and FMA, checked just above.
            return unsafe { chunk_lanes_avx512::<R, T>(x, k, w, c, init) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2, checked just above.
            return unsafe { chunk_lanes_avx2::<R, T>(x, k, w, c, init) };
        }
    }
    chunk_lanes_portable::<R, T>(x, k, w, c, init)
}

/// AVX-512: lane j of register (u, r) is lane j of that sum; per chunk, R widened weight loads
/// and T token loads feed R·T fused multiply-adds.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn chunk_lanes_avx512<const R: usize, const T: usize>(
    x: &[f64],
    k: usize,
    w: &[f32],
    c: std::ops::Range<usize>,
    init: Option<&Lanes<R, T>>,
) -> Lanes<R, T> {
    use std::arch::x86_64::*;
    assert!(x.len() >= T * k && w.len() >= R * k && c.end <= k - k % 8 && c.start % 8 == 0);
    let mut acc: [[__m512d; R]; T] = match init {
        // SAFETY: every `init` entry is 8 f64.
        Some(init) => std::array::from_fn(|u| std::array::from_fn(|r| unsafe { _mm512_loadu_pd(init[u][r].as_ptr()) })),
        None => [[_mm512_setzero_pd(); R]; T],
    };
    for c in c.step_by(8) {
        // SAFETY: c + 8 ≤ k, and every row start is below the lengths asserted above.
        let wv: [__m512d; R] =
            std::array::from_fn(|r| unsafe { _mm512_cvtps_pd(_mm256_loadu_ps(w.as_ptr().add(r * k + c))) });
        for (u, acc_u) in acc.iter_mut().enumerate() {
            // SAFETY: as above.
            let xv = unsafe { _mm512_loadu_pd(x.as_ptr().add(u * k + c)) };
            for (a, wr) in acc_u.iter_mut().zip(&wv) {
                *a = _mm512_fmadd_pd(xv, *wr, *a);
            }
        }
    }
    let mut lanes = [[[0f64; 8]; R]; T];
    for (l_u, a_u) in lanes.iter_mut().zip(&acc) {
        for (l, a) in l_u.iter_mut().zip(a_u) {
            // SAFETY: `l` is 8 f64.
            unsafe { _mm512_storeu_pd(l.as_mut_ptr(), *a) };
        }
    }
    lanes
}

/// AVX2: the portable code, compiled wider.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn chunk_lanes_avx2<const R: usize, const T: usize>(
    x: &[f64],
    k: usize,
    w: &[f32],
    c: std::ops::Range<usize>,
    init: Option<&Lanes<R, T>>,
) -> Lanes<R, T> {
    chunk_lanes_portable::<R, T>(x, k, w, c, init)
}

/// The lanes of the whole 8-element chunks, multiply then add.
#[inline(always)]
fn chunk_lanes_portable<const R: usize, const T: usize>(
    x: &[f64],
    k: usize,
    w: &[f32],
    c: std::ops::Range<usize>,
    init: Option<&Lanes<R, T>>,
) -> Lanes<R, T> {
    let mut lanes = init.copied().unwrap_or([[[0f64; 8]; R]; T]);
    for c in c.step_by(8) {
        let wv: [[f64; 8]; R] = std::array::from_fn(|r| std::array::from_fn(|j| w[r * k + c + j] as f64));
        for (u, l_u) in lanes.iter_mut().enumerate() {
            let xv: &[f64] = &x[u * k + c..u * k + c + 8];
            for (l, wr) in l_u.iter_mut().zip(&wv) {
                for j in 0..8 {
                    l[j] += xv[j] * wr[j];
                }
            }
        }
    }
    lanes
}

#[inline(always)]
fn reduce_lanes(l: &[f64; 8]) -> f64 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

/// Σ a·b in f64 with the fixed 8-lane order described in the module doc (`a` in f32 or f64).
#[inline(always)]
pub fn dot64<A: Copy + Into<f64>>(a: &[A], b: &[f32]) -> f64 {
    let mut lanes = [0f64; 8];
    let mut ca = a.chunks_exact(8);
    let mut cb = b.chunks_exact(8);
    for (xa, xb) in (&mut ca).zip(&mut cb) {
        for i in 0..8 {
            lanes[i] += xa[i].into() * xb[i] as f64;
        }
    }
    for (i, (&xa, &xb)) in ca.remainder().iter().zip(cb.remainder()).enumerate() {
        lanes[i] += xa.into() * xb as f64;
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

/// RoPE, llama.cpp's NORM style, in place on one row of heads: in each `head_dim` chunk of
/// `row`, the `n_dims` values from `offset` rotate in pairs (2i, 2i+1) by pos·base^(−2i/n_dims).
pub fn rope_norm(row: &mut [f32], head_dim: usize, offset: usize, pos: usize, n_dims: usize, base: f32) {
    rope_norm_scaled(row, head_dim, offset, pos, n_dims, base, 1.0, None)
}

/// [`rope_norm`] with llama.cpp's frequency scaling: pair i's angle is
/// pos·base^(−2i/n_dims) / (`divisor` · `freq_factors[i]`) (`divisor` is the linear scaling factor,
/// 1 without; `freq_factors` is Llama 3.1+'s `rope_freqs.weight`, n_dims/2 long).
#[allow(clippy::too_many_arguments)]
pub fn rope_norm_scaled(
    row: &mut [f32],
    head_dim: usize,
    offset: usize,
    pos: usize,
    n_dims: usize,
    base: f32,
    divisor: f64,
    freq_factors: Option<&[f32]>,
) {
    let angles: Vec<(f64, f64)> = (0..n_dims / 2)
        .map(|i| {
            let ff = freq_factors.map_or(1.0, |f| f[i] as f64);
            (pos as f64 * (base as f64).powf(-2.0 * i as f64 / n_dims as f64) / (divisor * ff)).sin_cos()
        })
        .collect();
    for head in row.chunks_mut(head_dim) {
        for (pair, &(sin, cos)) in head[offset..offset + n_dims].chunks_exact_mut(2).zip(&angles) {
            let (x0, x1) = (pair[0] as f64, pair[1] as f64);
            pair[0] = (x0 * cos - x1 * sin) as f32;
            pair[1] = (x0 * sin + x1 * cos) as f32;
        }
    }
}

/// RoPE, NeoX style (qwen, gemma, glm4moe, gpt-oss), in place on one row of heads: in each
/// `head_dim` chunk, the first `n_dims` values rotate as halves, pair (i, i + n_dims/2) by
/// pos·base^(−2i/n_dims); the rest of the head is left alone (glm4moe's partial rotary).
pub fn rope_neox(row: &mut [f32], head_dim: usize, pos: usize, n_dims: usize, base: f32) {
    let half = n_dims / 2;
    let angles: Vec<(f64, f64)> = (0..half)
        .map(|i| (pos as f64 * (base as f64).powf(-2.0 * i as f64 / n_dims as f64)).sin_cos())
        .collect();
    for head in row.chunks_mut(head_dim) {
        for (i, &(sin, cos)) in angles.iter().enumerate() {
            let (x0, x1) = (head[i] as f64, head[i + half] as f64);
            head[i] = (x0 * cos - x1 * sin) as f32;
            head[i + half] = (x0 * sin + x1 * cos) as f32;
        }
    }
}

/// Soft-capping `cap·tanh(x/cap)` (gemma2's attention scores and final logits).
pub fn softcap(x: f64, cap: f64) -> f64 {
    cap * (x / cap).tanh()
}

/// GELU, tanh approximation (gemma's `gelu_pytorch_tanh`).
pub fn gelu_tanh(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

/// gelu_tanh(gate) · up, elementwise (gemma's GeGLU FFN).
pub fn geglu(gate: &[f32], up: &[f32]) -> Vec<f32> {
    gate.iter()
        .zip(up)
        .map(|(&g, &u)| (gelu_tanh(g as f64) * u as f64) as f32)
        .collect()
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
#[allow(clippy::too_many_arguments)]
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
    causal_attention_masked(q, k, v, n, n_heads, n_kv_heads, dk, dv, scale, AttnMask::default())
}

/// What [`causal_attention_masked`] adds to plain causal attention.
#[derive(Clone, Copy, Debug, Default)]
pub struct AttnMask<'a> {
    /// Sliding window: position t attends to keys s with t − s < window.
    pub window: Option<usize>,
    /// Scores soft-capped `c·tanh(s/c)` after scaling, before the mask and softmax (gemma2).
    pub softcap: Option<f64>,
    /// Attention sinks, one logit per query head (gpt-oss): a key-less column in each head's
    /// softmax that takes probability mass and contributes no value.
    pub sinks: Option<&'a [f32]>,
}

/// [`causal_attention`] with a sliding window and score soft-capping.
#[allow(clippy::too_many_arguments)]
pub fn causal_attention_masked(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n: usize,
    n_heads: usize,
    n_kv_heads: usize,
    dk: usize,
    dv: usize,
    scale: f64,
    mask: AttnMask,
) -> Vec<f32> {
    let group = n_heads / n_kv_heads;
    let mut out = vec![0f32; n * n_heads * dv];
    out.par_chunks_mut(n_heads * dv).enumerate().for_each(|(t, out_t)| {
        let first = mask.window.map_or(0, |w| (t + 1).saturating_sub(w.max(1)));
        let mut scores = vec![0f64; t + 1 - first];
        let mut acc = vec![0f64; dv];
        for h in 0..n_heads {
            let kvh = h / group;
            let qh = &q[(t * n_heads + h) * dk..(t * n_heads + h + 1) * dk];
            for (i, score) in scores.iter_mut().enumerate() {
                let s = first + i;
                let kh = &k[(s * n_kv_heads + kvh) * dk..(s * n_kv_heads + kvh + 1) * dk];
                *score = dot64(qh, kh) * scale;
                if let Some(c) = mask.softcap {
                    *score = softcap(*score, c);
                }
            }
            match mask.sinks {
                None => softmax(&mut scores),
                Some(sinks) => {
                    let sink = sinks[h] as f64;
                    let max = scores.iter().copied().fold(sink, f64::max);
                    let sum = scores.iter().map(|s| (s - max).exp()).sum::<f64>() + (sink - max).exp();
                    scores.iter_mut().for_each(|s| *s = (*s - max).exp() / sum);
                }
            }
            acc.iter_mut().for_each(|a| *a = 0.0);
            for (i, &p) in scores.iter().enumerate() {
                let s = first + i;
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
    fn every_sum_equals_dot64_bit_for_bit() {
        // Shapes with partial token tiles and partial panels; values spanning many binades so a
        // different summation order would show in the low bits.
        for (n, k, m) in [
            (1, 5, 1),
            (13, 37, 3),
            (8, 64, 16),
            (17, 576, 35),
            (3, 1536, 20),
            (5, 1029, 7),
        ] {
            let x: Vec<f32> = (0..n * k)
                .map(|i| (i as f32 * 0.731).sin() * 10f32.powi((i % 9) as i32 - 4))
                .collect();
            let w: Vec<f32> = (0..m * k)
                .map(|i| (i as f32 * 0.277).cos() * (1 + i % 5) as f32)
                .collect();
            let y = matmul_t(&x, n, k, &w, m);
            for t in 0..n {
                let xt: Vec<f64> = x[t * k..(t + 1) * k].iter().map(|&v| v as f64).collect();
                for r in 0..m {
                    assert_eq!(
                        y[t * m + r],
                        dot64(&xt, &w[r * k..(r + 1) * k]) as f32,
                        "n {n} k {k} t {t} r {r}"
                    );
                }
            }
        }
        assert_eq!(matmul_t(&[], 2, 0, &[], 3), vec![0.0; 6]);
    }

    #[test]
    fn every_build_gives_the_same_lanes() {
        let (k, r, t) = (77, 3, 8);
        let x: Vec<f64> = (0..t * k).map(|i| ((i as f32 * 0.731).sin() * 1e3) as f64).collect();
        let w: Vec<f32> = (0..r * k)
            .map(|i| (i as f32 * 0.277).cos() / (1 + i % 7) as f32)
            .collect();
        let z = Some(&[[[0.0; 8]; 3]; 8]);
        let portable = chunk_lanes_portable::<3, 8>(&x, k, &w, 0..k - k % 8, z);
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
                // SAFETY: checked just above.
                assert_eq!(
                    unsafe { chunk_lanes_avx512::<3, 8>(&x, k, &w, 0..k - k % 8, z) },
                    portable
                );
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                // SAFETY: checked just above.
                assert_eq!(
                    unsafe { chunk_lanes_avx2::<3, 8>(&x, k, &w, 0..k - k % 8, z) },
                    portable
                );
            }
        }
        assert_eq!(chunk_lanes::<3, 8>(&x, k, &w, 0..k - k % 8, z), portable);
    }

    #[test]
    fn rope_rotates_pairs_and_keeps_norm() {
        // Two heads of 5: one value left alone, then 4 rotated (pairs at angles 3 and 3/100).
        let mut v = vec![9.0f32, 1.0, 0.0, 0.5, 0.5, 9.0, 0.0, 1.0, 0.5, 0.5];
        rope_norm(&mut v, 5, 1, 3, 4, 10000.0);
        for head in v.chunks(5) {
            assert_eq!(head[0], 9.0);
            let n1 = head[1] * head[1] + head[2] * head[2];
            assert!((n1 - 1.0).abs() < 1e-6 && (head[3] * head[3] + head[4] * head[4] - 0.5).abs() < 1e-6);
        }
        assert!((v[1] - 3f32.cos()).abs() < 1e-6 && (v[2] - 3f32.sin()).abs() < 1e-6);
        assert!((v[6] + 3f32.sin()).abs() < 1e-6 && (v[7] - 3f32.cos()).abs() < 1e-6);
        let (a, b) = (
            0.5 * 0.03f32.cos() - 0.5 * 0.03f32.sin(),
            0.5 * 0.03f32.sin() + 0.5 * 0.03f32.cos(),
        );
        assert!((v[3] - a).abs() < 1e-6 && (v[4] - b).abs() < 1e-6);
        let mut z = vec![1.0f32, 2.0];
        rope_norm(&mut z, 2, 0, 0, 2, 10000.0);
        assert_eq!(z, vec![1.0, 2.0]);
    }

    #[test]
    fn neox_rotates_halves() {
        // One head of 6, 4 rotated: pairs (0, 2) at angle 3 and (1, 3) at 3/100; 4 and 5 untouched.
        let mut v = vec![1.0f32, 1.0, 0.0, 0.0, 7.0, 8.0];
        rope_neox(&mut v, 6, 3, 4, 10000.0);
        assert!((v[0] - 3f32.cos()).abs() < 1e-6 && (v[2] - 3f32.sin()).abs() < 1e-6);
        assert!((v[1] - 0.03f32.cos()).abs() < 1e-6 && (v[3] - 0.03f32.sin()).abs() < 1e-6);
        assert_eq!(&v[4..], &[7.0, 8.0]);
    }

    #[test]
    fn window_of_one_copies_each_value() {
        let (q, k) = (vec![0.3f32, -0.2, 0.5], vec![0.1f32, 0.4, -0.7]);
        let v = vec![1.5f32, -2.0, 4.0];
        let mask = AttnMask {
            window: Some(1),
            softcap: Some(1.0),
            sinks: None,
        };
        // A sink of logit 0 beside one key of logit 0 halves that key's weight.
        let sinks = [0.0f32];
        let half = AttnMask {
            sinks: Some(&sinks),
            ..AttnMask::default()
        };
        assert_eq!(
            causal_attention_masked(&[0.0], &[0.0], &[3.0], 1, 1, 1, 1, 1, 1.0, half),
            vec![1.5]
        );
        assert_eq!(causal_attention_masked(&q, &k, &v, 3, 1, 1, 1, 1, 1.0, mask), v);
        assert!((softcap(100.0, 5.0) - 5.0).abs() < 1e-9 && (gelu_tanh(0.0)).abs() < 1e-12);
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
