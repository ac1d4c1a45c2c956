//! The reference's numeric building blocks: f32 storage, f64 accumulation.
//!
//! Every dot product sums in f64 over eight fixed lanes (element i goes to lane i mod 8, each lane
//! in ascending i), then adds the lanes pairwise ([`dot64`] is the definition). The order is fixed
//! by the code, so results depend neither on the instruction set nor on the thread count. The
//! inputs are f32 values widened to f64, so each product is exact in f64 (24 + 24 significant
//! bits < 53, and no product of two f32 leaves f64's normal range): a fused multiply-add rounds
//! exactly as a multiply-then-add does. The AVX-512 build of [`matmul_t`] uses FMA (one
//! instruction for two flops, the only way to the FMA peak), the others multiply then add, and
//! the tests hold every build to [`dot64`] bit for bit.
//!
//! Speed comes only from doing many such sums at once, never from another order. A task takes
//! a block of weight rows (`fill` dequantizes them once, to f32); k then runs in one pass up to
//! [`ONE_PASS_MAX`], in passes of [`K_BLOCK`] above: the pass's slice of those rows is widened
//! once into an f64 panel, the tokens' inputs are widened once a call, and a tile of
//! [`TOKENS`] tokens × [`ROWS`] rows advances its lanes (one 8-wide register per output, kept
//! in registers for the whole pass) over it. The tile's tokens' slice stays in L1 while the
//! tile walks down the panel, which stays in L2; the lanes go to memory between passes. Each
//! lane still sums its elements in ascending k, so tiles, passes, edges (partial tiles of 4 or
//! 1 tokens and single rows) and tasks all give [`dot64`]'s bits.

use rayon::prelude::*;

/// Weight rows per register tile (3 rows × 8 tokens: 24 of the 32 AVX-512 registers hold lanes).
const ROWS: usize = 3;
/// Tokens per register tile (then 4, then 1 for the remainder).
const TOKENS: usize = 8;
/// Elements of k per pass (a multiple of 8): a tile's tokens' slice is `TOKENS · K_BLOCK · 8`
/// bytes (16 KiB, in L1), a task's widened panel `rows · K_BLOCK · 8` (in L2).
const K_BLOCK: usize = 256;
/// The longest k run in one pass.
const ONE_PASS_MAX: usize = 2048;
/// Most weight rows per rayon task (a multiple of [`ROWS`]): more rows amortize reading the
/// tokens' inputs, fewer give more tasks for many threads (see [`rows_per_task`]).
const MAX_ROWS_PER_TASK: usize = 48;

/// `x [n, k] · wᵀ` for `w [m, k]` (torch layout), giving `[n, m]`.
pub fn matmul_t(x: &[f32], n: usize, k: usize, w: &[f32], m: usize) -> Vec<f32> {
    assert_eq!(w.len(), m * k, "matmul_t: w is not [m, k]");
    matmul_t_with(x, n, k, m, |first, out| {
        out.copy_from_slice(&w[first * k..first * k + out.len()])
    })
}

/// [`matmul_t`] for a `w [m, k]` given by `fill(first, out)`, which writes rows `first..` of `w`
/// (`out.len() / k` of them) as f32: each task asks for its own rows, so a stored weight is
/// dequantized a few rows at a time and never whole.
///
/// Output `[t, r]` is `dot64(x[t], w[r])` rounded to f32, bit for bit: lane j sums
/// `x[t][i] · w[r][i]` for i ≡ j (mod 8), i < k − k mod 8, in ascending i (FMA or multiply-add:
/// the same bits, see the module doc); the last k mod 8 products go to lanes 0, 1, ...; the lanes
/// are added pairwise, `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))`.
pub fn matmul_t_with(x: &[f32], n: usize, k: usize, m: usize, fill: impl Fn(usize, &mut [f32]) + Sync) -> Vec<f32> {
    assert_eq!(x.len(), n * k, "matmul_t: x is not [n, k]");
    if k == 0 || n == 0 {
        return vec![0.0; n * m];
    }
    let build = Build::detect();
    let k8 = k - k % 8;
    let token_tiles = tiles(n, TOKENS);
    let xp = pack_tokens(x, k, &token_tiles);
    let rpt = rows_per_task(m);
    let kc = pass_len(k8);
    // Each task fills a `[n, rpt]` block for its rows, scattered into `[n, m]` below.
    let mut blocks = vec![0f32; m.div_ceil(rpt) * n * rpt];
    blocks.par_chunks_mut(n * rpt).enumerate().for_each_init(
        || (vec![0f32; rpt * k], vec![0f64; rpt * kc], vec![[0f64; 8]; rpt * n]),
        |(w32, panel, lanes), (p, block)| {
            let n_rows = rpt.min(m - p * rpt);
            let w32 = &mut w32[..n_rows * k];
            fill(p * rpt, w32);
            let row_groups = tiles(n_rows, ROWS);
            // lanes[r * n + t]: the 8 lanes of row r · token t.
            let lanes = &mut lanes[..n_rows * n];
            lanes.fill([0.0; 8]);
            for c0 in (0..k8).step_by(kc) {
                let len = kc.min(k8 - c0);
                let panel = &mut panel[..n_rows * len];
                pack_panel(build, w32, k, c0, len, &row_groups, panel);
                for &(t0, tt) in &token_tiles {
                    let x_tile = &xp[t0 * k8 + c0 * tt..t0 * k8 + (c0 + len) * tt];
                    for &(r0, rr) in &row_groups {
                        let w_group = &panel[r0 * len..(r0 + rr) * len];
                        pass(build, rr, tt, x_tile, w_group, &mut lanes[r0 * n + t0..], n);
                    }
                }
            }
            // The tail into lanes 0.., then the pairwise lane sum: `dot64` exactly.
            for (r, w_r) in w32.chunks_exact(k).enumerate() {
                for t in 0..n {
                    let l = &mut lanes[r * n + t];
                    for (j, i) in (k8..k).enumerate() {
                        l[j] += x[t * k + i] as f64 * w_r[i] as f64;
                    }
                    block[t * rpt + r] = reduce_lanes(l) as f32;
                }
            }
        },
    );
    let mut out = vec![0f32; n * m];
    for (p, block) in blocks.chunks_exact(n * rpt).enumerate() {
        let rows = rpt.min(m - p * rpt);
        let cols = p * rpt..p * rpt + rows;
        for (out_t, block_t) in out.chunks_exact_mut(m).zip(block.chunks_exact(rpt)) {
            out_t[cols.clone()].copy_from_slice(&block_t[..rows]);
        }
    }
    out
}

/// Elements of k per pass: all of `k8` up to [`ONE_PASS_MAX`] (each tile's lanes then go to
/// memory once), [`K_BLOCK`] above.
fn pass_len(k8: usize) -> usize {
    if k8 <= ONE_PASS_MAX {
        k8.max(8)
    } else {
        K_BLOCK
    }
}

/// `0..len` cut into (start, size) tiles of `big`, then 4, then 1 (the sizes [`pass`] has).
fn tiles(len: usize, big: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut at = 0;
    for size in [big, 4.min(big), 1] {
        while at + size <= len {
            out.push((at, size));
            at += size;
        }
    }
    out
}

/// The tokens' inputs widened to f64 once, in the order the tiles read them: tile (t0, T) holds
/// `k8 · T` values from `t0 · k8`, chunk by chunk (8 elements of k), token by token within a
/// chunk: `x[t0 + u][c + j]` is at `t0 · k8 + c · T + u · 8 + j` (c a multiple of 8). A pass over
/// `c0..c0 + len` is then one contiguous slice per tile.
fn pack_tokens(x: &[f32], k: usize, token_tiles: &[(usize, usize)]) -> Vec<f64> {
    let k8 = k - k % 8;
    let n = token_tiles.last().map_or(0, |&(t0, tt)| t0 + tt);
    let mut xp = vec![0f64; n * k8];
    for &(t0, tt) in token_tiles {
        let tile = &mut xp[t0 * k8..(t0 + tt) * k8];
        for (c, chunk) in tile.chunks_exact_mut(8 * tt).enumerate() {
            for (u, dst) in chunk.chunks_exact_mut(8).enumerate() {
                let src = &x[(t0 + u) * k + c * 8..(t0 + u) * k + c * 8 + 8];
                dst.iter_mut().zip(src).for_each(|(d, &s)| *d = s as f64);
            }
        }
    }
    xp
}

/// One pass's weight panel: columns `c0..c0 + len` of the task's rows `w32 [rows, k]` widened to
/// f64, group (r0, R) at `r0 · len`, chunk by chunk, row by row within a chunk:
/// `w[r0 + r][c0 + c + j]` at `r0 · len + c · R + r · 8 + j`. Each element is widened once a task
/// and then read by every token, so this must be cheap next to the products: the AVX-512 build
/// widens 8 at a time.
fn pack_panel(
    build: Build,
    w32: &[f32],
    k: usize,
    c0: usize,
    len: usize,
    groups: &[(usize, usize)],
    panel: &mut [f64],
) {
    #[cfg(target_arch = "x86_64")]
    if build == Build::Avx512 {
        // SAFETY: `Build::Avx512` is only detected on a CPU with AVX-512F.
        return unsafe { pack_panel_avx512(w32, k, c0, len, groups, panel) };
    }
    let _ = build;
    pack_panel_portable(w32, k, c0, len, groups, panel)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pack_panel_avx512(
    w32: &[f32],
    k: usize,
    c0: usize,
    len: usize,
    groups: &[(usize, usize)],
    panel: &mut [f64],
) {
    pack_panel_portable(w32, k, c0, len, groups, panel)
}

#[inline(always)]
fn pack_panel_portable(w32: &[f32], k: usize, c0: usize, len: usize, groups: &[(usize, usize)], panel: &mut [f64]) {
    for &(r0, rr) in groups {
        let group = &mut panel[r0 * len..(r0 + rr) * len];
        for (c, chunk) in group.chunks_exact_mut(8 * rr).enumerate() {
            for (r, dst) in chunk.chunks_exact_mut(8).enumerate() {
                let at = (r0 + r) * k + c0 + c * 8;
                let src: &[f32; 8] = w32[at..at + 8].try_into().expect("8 values");
                dst.copy_from_slice(&src.map(f64::from));
            }
        }
    }
}

/// Weight rows per task: [`MAX_ROWS_PER_TASK`], fewer when that would leave under four tasks a
/// thread (a multiple of [`ROWS`], at least one tile). Only the speed depends on it.
fn rows_per_task(m: usize) -> usize {
    let per_thread = m / (4 * rayon::current_num_threads()).max(1);
    (per_thread / ROWS * ROWS).clamp(ROWS, MAX_ROWS_PER_TASK)
}

/// The instruction set the matmul's inner loops use, detected at run time (the results are the
/// same on every one; only the speed differs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
enum Build {
    /// AVX-512F with FMA: one register per output's 8 lanes.
    Avx512,
    /// AVX2: the portable code compiled wider.
    Avx2,
    /// Any CPU.
    Portable,
}

impl Build {
    fn detect() -> Build {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
                return Build::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return Build::Avx2;
            }
        }
        Build::Portable
    }
}

/// One pass of an `r`-row × `t`-token tile (the shapes [`tiles`] gives): see [`pass_tile`].
#[inline(always)]
fn pass(build: Build, r: usize, t: usize, x: &[f64], w: &[f64], lanes: &mut [[f64; 8]], ls: usize) {
    match (r, t) {
        (ROWS, TOKENS) => pass_tile::<ROWS, TOKENS>(build, x, w, lanes, ls),
        (ROWS, 4) => pass_tile::<ROWS, 4>(build, x, w, lanes, ls),
        (ROWS, 1) => pass_tile::<ROWS, 1>(build, x, w, lanes, ls),
        (1, TOKENS) => pass_tile::<1, TOKENS>(build, x, w, lanes, ls),
        (1, 4) => pass_tile::<1, 4>(build, x, w, lanes, ls),
        (1, 1) => pass_tile::<1, 1>(build, x, w, lanes, ls),
        _ => unreachable!("tile {r} x {t}"),
    }
}

/// Advances the lanes of `R` weight rows × `T` tokens over one pass of `len` elements:
/// `lanes[r * ls + u][j] += x[c·T + u·8 + j] · w[c·R + r·8 + j]` for the chunks c = 0, 8, ...,
/// len − 8 in order (`x` and `w` packed as [`pack_tokens`] and [`pack_panel`] lay them out,
/// `x.len() = T · len`, `w.len() = R · len`; `lanes` from (first row, first token), row stride
/// `ls`).
#[inline(always)]
fn pass_tile<const R: usize, const T: usize>(build: Build, x: &[f64], w: &[f64], lanes: &mut [[f64; 8]], ls: usize) {
    let len = x.len() / T;
    assert!(len.is_multiple_of(8) && x.len() == T * len && w.len() == R * len);
    assert!(lanes.len() >= (R - 1) * ls + T);
    match build {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Build::Avx512` is only detected on a CPU with AVX-512F and FMA; the bounds are
        // asserted above.
        Build::Avx512 => unsafe { pass_avx512::<R, T>(x, w, lanes, ls) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Build::Avx2` is only detected on a CPU with AVX2.
        Build::Avx2 => unsafe { pass_avx2::<R, T>(x, w, lanes, ls) },
        _ => pass_portable::<R, T>(x, w, lanes, ls),
    }
}

/// AVX-512: register (u, r) holds the 8 lanes of token u · row r; per chunk, R panel loads and
/// T token loads (both sequential in memory) feed R·T fused multiply-adds. Bounds as
/// [`pass_tile`] asserts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn pass_avx512<const R: usize, const T: usize>(x: &[f64], w: &[f64], lanes: &mut [[f64; 8]], ls: usize) {
    use std::arch::x86_64::*;
    let chunks = x.len() / (8 * T);
    let (x, w, lanes) = (x.as_ptr(), w.as_ptr(), lanes.as_mut_ptr());
    // SAFETY (every pointer below): within the bounds `pass_tile` asserted.
    let mut acc: [[__m512d; R]; T] =
        std::array::from_fn(|u| std::array::from_fn(|r| unsafe { _mm512_loadu_pd((*lanes.add(r * ls + u)).as_ptr()) }));
    for c in 0..chunks {
        let (xc, wc) = unsafe { (x.add(c * 8 * T), w.add(c * 8 * R)) };
        let wv: [__m512d; R] = std::array::from_fn(|r| unsafe { _mm512_loadu_pd(wc.add(r * 8)) });
        for (u, acc_u) in acc.iter_mut().enumerate() {
            let xv = unsafe { _mm512_loadu_pd(xc.add(u * 8)) };
            for (a, wr) in acc_u.iter_mut().zip(&wv) {
                *a = _mm512_fmadd_pd(xv, *wr, *a);
            }
        }
    }
    for (u, acc_u) in acc.iter().enumerate() {
        for (r, a) in acc_u.iter().enumerate() {
            unsafe { _mm512_storeu_pd((*lanes.add(r * ls + u)).as_mut_ptr(), *a) };
        }
    }
}

/// AVX2: the portable code, compiled wider.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn pass_avx2<const R: usize, const T: usize>(x: &[f64], w: &[f64], lanes: &mut [[f64; 8]], ls: usize) {
    pass_portable::<R, T>(x, w, lanes, ls)
}

/// The pass with multiply then add, lane by lane.
#[inline(always)]
fn pass_portable<const R: usize, const T: usize>(x: &[f64], w: &[f64], lanes: &mut [[f64; 8]], ls: usize) {
    let mut acc: [[[f64; 8]; R]; T] = std::array::from_fn(|u| std::array::from_fn(|r| lanes[r * ls + u]));
    for (xc, wc) in x.chunks_exact(8 * T).zip(w.chunks_exact(8 * R)) {
        for (acc_u, xv) in acc.iter_mut().zip(xc.chunks_exact(8)) {
            for (a, wr) in acc_u.iter_mut().zip(wc.chunks_exact(8)) {
                for j in 0..8 {
                    a[j] += xv[j] * wr[j];
                }
            }
        }
    }
    for (u, acc_u) in acc.iter().enumerate() {
        for (r, a) in acc_u.iter().enumerate() {
            lanes[r * ls + u] = *a;
        }
    }
}

/// The pairwise sum of an output's 8 lanes.
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
            (13, 777, 49),
            (10, 2 * ONE_PASS_MAX + 77, 8),
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
        // A pass of each tile shape on lanes already holding values, on every build this CPU has.
        let (len, ls) = (72, 11);
        let x: Vec<f64> = (0..TOKENS * len)
            .map(|i| ((i as f32 * 0.731).sin() * 1e3) as f64)
            .collect();
        let w: Vec<f64> = (0..ROWS * len)
            .map(|i| ((i as f32 * 0.277).cos() / (1 + i % 7) as f32) as f64)
            .collect();
        let init: Vec<[f64; 8]> = (0..ROWS * ls)
            .map(|i| std::array::from_fn(|j| (i * 8 + j) as f64 * 0.013 - 0.2))
            .collect();
        for (r, t) in [(ROWS, TOKENS), (ROWS, 4), (ROWS, 1), (1, TOKENS), (1, 4), (1, 1)] {
            let run = |build| {
                let mut lanes = init.clone();
                pass(build, r, t, &x[..t * len], &w[..r * len], &mut lanes, ls);
                lanes
            };
            let portable = run(Build::Portable);
            assert_ne!(portable, init);
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("fma") {
                    assert_eq!(run(Build::Avx512), portable, "avx512 {r} x {t}");
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    assert_eq!(run(Build::Avx2), portable, "avx2 {r} x {t}");
                }
            }
            assert_eq!(run(Build::detect()), portable);
        }
    }

    #[test]
    fn thread_count_changes_no_bit() {
        // Shapes whose tasks split differently on 1, 2 and 3 threads (rows per task follows the
        // thread count), k over several passes with a tail.
        for (n, k, m) in [(11, ONE_PASS_MAX + 2 * K_BLOCK + 13, 101), (9, 600, 50)] {
            let x: Vec<f32> = (0..n * k)
                .map(|i| (i as f32 * 0.731).sin() * 10f32.powi((i % 9) as i32 - 4))
                .collect();
            let w: Vec<f32> = (0..m * k)
                .map(|i| (i as f32 * 0.277).cos() * (1 + i % 5) as f32)
                .collect();
            let on = |threads| {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                pool.install(|| (rows_per_task(m), matmul_t(&x, n, k, &w, m)))
            };
            let (one, two, three) = (on(1), on(2), on(3));
            assert_ne!(one.0, three.0, "the split must differ for the test to mean something");
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&one.1), bits(&two.1));
            assert_eq!(bits(&one.1), bits(&three.1));
        }
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
