//! The CPU backend's ops: matmul (`x·Wᵀ`), RMSNorm, RoPE (NORM and NEOX), softmax, causal
//! GQA and MLA attention, and SwiGLU. They are the engine's own fast code: row-parallel with
//! rayon, with inner loops over `chunks_exact` and fixed-width accumulators that LLVM
//! auto-vectorizes. Every op here has a slow scalar twin in the test module and is tested
//! against it (candle's fast/slow pairs).
//!
//! Each output element is computed by exactly one task in a fixed order, so results do not depend
//! on the thread count.

use crate::dequant::{dequantize, isa, Isa};
use rayon::prelude::*;
use references::GgmlType;

/// Lanes of the dot-product accumulator (two AVX registers' worth, or four SSE ones).
const LANES: usize = 16;

/// A row-major `[rows, cols]` f32 matrix view; for weights, torch layout `[out, in]`.
#[derive(Clone, Copy, Debug)]
pub struct Mat<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
}

impl<'a> Mat<'a> {
    pub fn row(&self, row_idx: usize) -> &'a [f32] {
        &self.data[row_idx * self.cols..(row_idx + 1) * self.cols]
    }
}

/// A row-major quantized `[rows, cols]` matrix: each row is `row_bytes` of ggml blocks.
#[derive(Clone, Copy, Debug)]
pub struct QMat<'a> {
    pub ty: GgmlType,
    pub bytes: &'a [u8],
    pub rows: usize,
    pub cols: usize,
    pub row_bytes: usize,
}

/// A weight as a matmul reads it: f32, or quantized and decoded on the fly.
#[derive(Clone, Copy, Debug)]
pub enum WeightRef<'a> {
    F32(Mat<'a>),
    Quant(QMat<'a>),
}

impl WeightRef<'_> {
    pub fn rows(&self) -> usize {
        match self {
            WeightRef::F32(m) => m.rows,
            WeightRef::Quant(q) => q.rows,
        }
    }
    pub fn cols(&self) -> usize {
        match self {
            WeightRef::F32(m) => m.cols,
            WeightRef::Quant(q) => q.cols,
        }
    }
}

/// The dot product of two equal-length slices, in f32 over [`LANES`] independent accumulators.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; LANES];
    let ca = a.chunks_exact(LANES);
    let cb = b.chunks_exact(LANES);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (xa, xb) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += xa[l] * xb[l];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    reduce_lanes(acc) + tail
}

/// Pairwise reduction of the lanes.
#[inline(always)]
fn reduce_lanes(mut acc: [f32; LANES]) -> f32 {
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            acc[l] += acc[l + width];
        }
    }
    acc[0]
}

/// Four dot products of four x rows with one w row, loading w once; each result is bit-identical
/// to [`dot`] of that pair (same lanes, same order).
#[inline(always)]
fn dot4(xs: [&[f32]; 4], w: &[f32]) -> [f32; 4] {
    let n = w.len();
    let (x0, x1, x2, x3) = (&xs[0][..n], &xs[1][..n], &xs[2][..n], &xs[3][..n]);
    let (mut a0, mut a1, mut a2, mut a3) = ([0f32; LANES], [0f32; LANES], [0f32; LANES], [0f32; LANES]);
    let chunks = w
        .chunks_exact(LANES)
        .zip(x0.chunks_exact(LANES))
        .zip(x1.chunks_exact(LANES))
        .zip(x2.chunks_exact(LANES))
        .zip(x3.chunks_exact(LANES));
    for ((((wc, c0), c1), c2), c3) in chunks {
        for l in 0..LANES {
            a0[l] += c0[l] * wc[l];
            a1[l] += c1[l] * wc[l];
            a2[l] += c2[l] * wc[l];
            a3[l] += c3[l] * wc[l];
        }
    }
    let n_full = n / LANES * LANES;
    let tail = |x: &[f32]| -> f32 {
        let mut t = 0f32;
        for (a, b) in x[n_full..].iter().zip(&w[n_full..]) {
            t += a * b;
        }
        t
    };
    [
        reduce_lanes(a0) + tail(x0),
        reduce_lanes(a1) + tail(x1),
        reduce_lanes(a2) + tail(x2),
        reduce_lanes(a3) + tail(x3),
    ]
}

/// `t[tok, j] = dot(x[tok], w_rows[j])` for one tile of `width` W rows (`t` is `[n, width]`).
#[inline(always)]
fn tile_generic(x: &[f32], n_in: usize, w_rows: &[f32], width: usize, t: &mut [f32]) {
    let n = x.len() / n_in;
    let mut tok = 0;
    while tok + 4 <= n {
        let xs = [
            &x[tok * n_in..(tok + 1) * n_in],
            &x[(tok + 1) * n_in..(tok + 2) * n_in],
            &x[(tok + 2) * n_in..(tok + 3) * n_in],
            &x[(tok + 3) * n_in..(tok + 4) * n_in],
        ];
        for j in 0..width {
            let d = dot4(xs, &w_rows[j * n_in..(j + 1) * n_in]);
            for k in 0..4 {
                t[(tok + k) * width + j] = d[k];
            }
        }
        tok += 4;
    }
    for tok in tok..n {
        let xr = &x[tok * n_in..(tok + 1) * n_in];
        for j in 0..width {
            t[tok * width + j] = dot(xr, &w_rows[j * n_in..(j + 1) * n_in]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    pub(super) unsafe fn tile_avx512(x: &[f32], n_in: usize, w_rows: &[f32], width: usize, t: &mut [f32]) {
        super::tile_generic(x, n_in, w_rows, width, t)
    }
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn tile_avx2(x: &[f32], n_in: usize, w_rows: &[f32], width: usize, t: &mut [f32]) {
        super::tile_generic(x, n_in, w_rows, width, t)
    }
}

/// [`tile_generic`] compiled for the widest ISA this CPU has. Rust never contracts `a·b + c`
/// into an FMA, so every ISA gives bit-identical results.
fn tile(x: &[f32], n_in: usize, w_rows: &[f32], width: usize, t: &mut [f32]) {
    match isa() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `isa()` checked the CPU has every feature `tile_avx512` is compiled for.
        Isa::Avx512 => unsafe { x86::tile_avx512(x, n_in, w_rows, width, t) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, for AVX2 and FMA.
        Isa::Avx2 => unsafe { x86::tile_avx2(x, n_in, w_rows, width, t) },
        _ => tile_generic(x, n_in, w_rows, width, t),
    }
}

/// Rows of W per matmul task: enough work to amortize a task, few enough to balance 2–16 cores.
const MATMUL_TILE_ROWS: usize = 32;

/// Computes one tile of W rows `[row0, row0 + width)` for every token into `t` `[n, width]`.
/// A quantized tile is decoded to f32 once (a few KiB, cache-resident) and reused by every token.
fn matmul_tile(x: &[f32], w: WeightRef<'_>, row0: usize, width: usize, t: &mut [f32]) {
    let n_in = w.cols();
    match w {
        WeightRef::F32(m) => tile(x, n_in, &m.data[row0 * n_in..(row0 + width) * n_in], width, t),
        WeightRef::Quant(q) => {
            let bytes = &q.bytes[row0 * q.row_bytes..(row0 + width) * q.row_bytes];
            let mut rows = vec![0f32; width * n_in];
            dequantize(q.ty, bytes, &mut rows).expect("weight shard lengths are checked at load");
            tile(x, n_in, &rows, width, t);
        }
    }
}

/// `out[n, w.rows] = x[n, w.cols] · wᵀ`, for f32 or quantized weights.
pub fn matmul_any(x: &[f32], n: usize, w: WeightRef<'_>, out: &mut [f32]) {
    let (n_out, n_in) = (w.rows(), w.cols());
    assert_eq!(x.len(), n * n_in, "matmul: x is not [n, in]");
    assert_eq!(out.len(), n * n_out, "matmul: out is not [n, out]");
    if n_out == 0 || n == 0 {
        return;
    }
    if n == 1 {
        out.par_chunks_mut(MATMUL_TILE_ROWS)
            .enumerate()
            .for_each(|(tile_idx, o)| {
                let width = o.len();
                matmul_tile(x, w, tile_idx * MATMUL_TILE_ROWS, width, o);
            });
        return;
    }
    // Tiles of W rows; each task computes its tile for every x row (W read once per tile).
    let n_tiles = n_out.div_ceil(MATMUL_TILE_ROWS);
    let tiles: Vec<Vec<f32>> = (0..n_tiles)
        .into_par_iter()
        .map(|tile_idx| {
            let row0 = tile_idx * MATMUL_TILE_ROWS;
            let width = (row0 + MATMUL_TILE_ROWS).min(n_out) - row0;
            let mut t = vec![0f32; n * width];
            matmul_tile(x, w, row0, width, &mut t);
            t
        })
        .collect();
    for (tile_idx, t) in tiles.iter().enumerate() {
        let row0 = tile_idx * MATMUL_TILE_ROWS;
        let width = t.len() / n;
        for tok_idx in 0..n {
            out[tok_idx * n_out + row0..tok_idx * n_out + row0 + width]
                .copy_from_slice(&t[tok_idx * width..(tok_idx + 1) * width]);
        }
    }
}

/// `out[n, w.rows] = x[n, w.cols] · wᵀ` for an f32 weight.
pub fn matmul(x: &[f32], n: usize, w: Mat<'_>, out: &mut [f32]) {
    matmul_any(x, n, WeightRef::F32(w), out)
}

/// RMSNorm over rows of width `weight.len()`: `out = x / sqrt(mean(x²) + eps) · weight`, with
/// the mean of squares accumulated in f64.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    assert_eq!(x.len(), out.len(), "rms_norm: x and out differ in length");
    assert!(d > 0 && x.len().is_multiple_of(d), "rms_norm: x is not [n, d]");
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss: f64 = xr.iter().map(|&v| v as f64 * v as f64).sum();
        let scale = (1.0 / (ss / d as f64 + eps as f64).sqrt()) as f32;
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * scale * g;
        }
    }
}

/// Which elements RoPE rotates together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// llama.cpp NORM: adjacent pairs (2i, 2i+1).
    Norm,
    /// NEOX: pairs (i, i + rope_dim/2).
    Neox,
}

/// Where the rotated dims sit in a row: `n_heads` heads of `head_stride` elements, each rotating
/// `rope_dim` dims starting at `offset` within the head.
#[derive(Clone, Copy, Debug)]
pub struct RopeLayout {
    pub n_heads: usize,
    pub head_stride: usize,
    pub offset: usize,
    pub rope_dim: usize,
}

/// A GQA layer's RoPE in one step: q's and k's layouts, rows at positions `pos0 ..`, the base,
/// the pair style and the frequency scaling (see `Backend::rope_qk_cache`).
#[derive(Clone, Copy, Debug)]
pub struct QkRope<'a> {
    pub q: RopeLayout,
    pub k: RopeLayout,
    pub pos0: usize,
    pub base: f32,
    pub style: RopeStyle,
    pub freqs: RopeFreqs<'a>,
}

/// RoPE on `x` (`[n, n_heads·head_stride]`), row `i` at position `pos0 + i`, with
/// θ_i = pos·base^(−2i/rope_dim) computed in f64.
pub fn rope(x: &mut [f32], layout: RopeLayout, pos0: usize, base: f32, style: RopeStyle) {
    rope_scaled(x, layout, pos0, base, style, RopeFreqs::default())
}

/// RoPE frequency scaling beyond the base (llama.cpp's): pair i's angle is divided by
/// `divisor · factors[i]`. `divisor` is the linear scaling factor (1 without); `factors` is Llama
/// 3.1+'s `rope_freqs.weight`, rope_dim/2 long (None: all 1).
#[derive(Clone, Copy, Debug)]
pub struct RopeFreqs<'a> {
    pub divisor: f32,
    pub factors: Option<&'a [f32]>,
}

impl RopeFreqs<'_> {
    /// True when no pair's angle is scaled (the plain rotation).
    pub fn is_none(&self) -> bool {
        self.divisor == 1.0 && self.factors.is_none()
    }
}

impl Default for RopeFreqs<'_> {
    fn default() -> Self {
        RopeFreqs {
            divisor: 1.0,
            factors: None,
        }
    }
}

/// [`rope`] with frequency scaling: θ_i = pos·base^(−2i/rope_dim) / (divisor·factors[i]).
pub fn rope_scaled(x: &mut [f32], layout: RopeLayout, pos0: usize, base: f32, style: RopeStyle, freqs: RopeFreqs) {
    let width = layout.n_heads * layout.head_stride;
    let half = layout.rope_dim / 2;
    if width == 0 || half == 0 {
        return;
    }
    if let Some(f) = freqs.factors {
        assert_eq!(f.len(), half, "rope_scaled: one frequency factor per rotated pair");
    }
    let inv_freq: Vec<f64> = (0..half)
        .map(|i| {
            let ff = freqs.factors.map_or(1.0, |f| f[i] as f64);
            (base as f64).powf(-2.0 * i as f64 / layout.rope_dim as f64) / (freqs.divisor as f64 * ff)
        })
        .collect();
    for (row_idx, row) in x.chunks_exact_mut(width).enumerate() {
        let pos = (pos0 + row_idx) as f64;
        let cs: Vec<(f32, f32)> = inv_freq
            .iter()
            .map(|f| {
                let a = pos * f;
                (a.cos() as f32, a.sin() as f32)
            })
            .collect();
        for head in row.chunks_exact_mut(layout.head_stride) {
            let r = &mut head[layout.offset..layout.offset + layout.rope_dim];
            for (i, &(c, s)) in cs.iter().enumerate() {
                let (a, b) = match style {
                    RopeStyle::Norm => (2 * i, 2 * i + 1),
                    RopeStyle::Neox => (i, i + half),
                };
                let (x0, x1) = (r[a], r[b]);
                r[a] = x0 * c - x1 * s;
                r[b] = x0 * s + x1 * c;
            }
        }
    }
}

/// In-place softmax of one row, max-subtracted, with the sum in f64.
pub fn softmax(row: &mut [f32]) {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if max == f32::NEG_INFINITY {
        return;
    }
    let mut sum = 0f64;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in row.iter_mut() {
        *v *= inv;
    }
}

/// SiLU(gate)·up, element-wise, into `gate`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// Soft-capping `cap·tanh(x/cap)` (gemma2's attention scores, gemma's final logits), in f64.
pub fn softcap(x: f32, cap: f32) -> f32 {
    (cap as f64 * (x as f64 / cap as f64).tanh()) as f32
}

/// GELU (tanh approximation, gemma's `gelu_pytorch_tanh`) of gate times up, into `gate`.
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    let k = (2.0 / std::f64::consts::PI).sqrt();
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g as f64;
        *g = (0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh()) * u as f64) as f32;
    }
}

/// Shapes for causal GQA attention over a cache.
#[derive(Clone, Copy, Debug)]
pub struct GqaShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    /// Sliding window (gemma's local layers): a query at position p reads keys p − window + 1 ..= p.
    pub window: Option<usize>,
    /// Score soft-capping `c·tanh(s/c)` after the scale (gemma2).
    pub softcap: Option<f32>,
}

impl GqaShape {
    /// True when the attention has no window and no soft-cap (what every device kernel runs).
    pub fn is_plain(&self) -> bool {
        self.window.is_none() && self.softcap.is_none()
    }
}

/// Causal GQA attention: `q` `[n, H·hd]` for positions `pos0..pos0+n`, `k`/`v` `[T, KV·hd]`
/// (T ≥ pos0+n) with query head h reading kv head h / (H/KV). Writes `out` `[n, H·hd]`.
pub fn gqa_attention(q: &[f32], k: &[f32], v: &[f32], pos0: usize, s: GqaShape, out: &mut [f32]) {
    let (hd, kvw) = (s.head_dim, s.n_kv_heads * s.head_dim);
    let group = s.n_heads / s.n_kv_heads;
    out.par_chunks_mut(hd).enumerate().for_each(|(slot_idx, o)| {
        let (tok_idx, head_idx) = (slot_idx / s.n_heads, slot_idx % s.n_heads);
        let kv_off = (head_idx / group) * hd;
        let qh = &q[slot_idx * hd..(slot_idx + 1) * hd];
        let n_ctx = pos0 + tok_idx + 1;
        let first = s.window.map_or(0, |w| n_ctx.saturating_sub(w.max(1)));
        let mut p: Vec<f32> = (first..n_ctx)
            .map(|j| {
                let score = dot(qh, &k[j * kvw + kv_off..j * kvw + kv_off + hd]) * s.scale;
                s.softcap.map_or(score, |c| softcap(score, c))
            })
            .collect();
        softmax(&mut p);
        o.fill(0.0);
        for (j, &pj) in (first..n_ctx).zip(p.iter()) {
            let vr = &v[j * kvw + kv_off..j * kvw + kv_off + hd];
            for (a, &b) in o.iter_mut().zip(vr) {
                *a += pj * b;
            }
        }
    });
}

/// Shapes for causal MLA attention over an expanded cache.
#[derive(Clone, Copy, Debug)]
pub struct MlaShape {
    pub n_heads: usize,
    pub nope: usize,
    pub rope: usize,
    pub v_dim: usize,
    pub scale: f32,
}

/// Causal MLA attention. `q` `[n, H·(nope+rope)]` per head `[q_nope | q_pe]`; caches `k_nope`
/// `[T, H·nope]`, `k_pe` `[T, rope]` (shared by all heads), `v` `[T, H·v]`. Writes `out` `[n, H·v]`.
pub fn mla_attention(q: &[f32], k_nope: &[f32], k_pe: &[f32], v: &[f32], pos0: usize, s: MlaShape, out: &mut [f32]) {
    out.par_chunks_mut(s.v_dim).enumerate().for_each(|(slot_idx, o)| {
        let keys = 0..pos0 + slot_idx / s.n_heads + 1;
        mla_slot(q, k_nope, k_pe, v, s, slot_idx, keys, o);
    });
}

/// One (token, head) slot of MLA attention (`slot_idx` = token·H + head) over the cache rows
/// `keys`, in their order, into `o` `[v]`: causal attention reads rows `0..=p`, the DSA's sparse
/// attention its selected rows.
#[allow(clippy::too_many_arguments)]
pub(crate) fn mla_slot(
    q: &[f32],
    k_nope: &[f32],
    k_pe: &[f32],
    v: &[f32],
    s: MlaShape,
    slot_idx: usize,
    keys: impl Iterator<Item = usize> + Clone,
    o: &mut [f32],
) {
    let qw = s.nope + s.rope;
    let (kw, vw) = (s.n_heads * s.nope, s.n_heads * s.v_dim);
    let head_idx = slot_idx % s.n_heads;
    let (q_nope, q_pe) = q[slot_idx * qw..(slot_idx + 1) * qw].split_at(s.nope);
    let mut p: Vec<f32> = keys
        .clone()
        .map(|j| {
            let kn = &k_nope[j * kw + head_idx * s.nope..j * kw + (head_idx + 1) * s.nope];
            let kp = &k_pe[j * s.rope..(j + 1) * s.rope];
            (dot(q_nope, kn) + dot(q_pe, kp)) * s.scale
        })
        .collect();
    softmax(&mut p);
    o.fill(0.0);
    for (j, &pj) in keys.zip(&p) {
        let vr = &v[j * vw + head_idx * s.v_dim..j * vw + (head_idx + 1) * s.v_dim];
        for (a, &b) in o.iter_mut().zip(vr) {
            *a += pj * b;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn matmul_slow(x: &[f32], n: usize, w: &[f32], n_out: usize, n_in: usize) -> Vec<f32> {
        let mut out = vec![0f32; n * n_out];
        for i in 0..n {
            for o in 0..n_out {
                let mut s = 0f64;
                for k in 0..n_in {
                    s += x[i * n_in + k] as f64 * w[o * n_in + k] as f64;
                }
                out[i * n_out + o] = s as f32;
            }
        }
        out
    }

    fn rms_norm_slow(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
        let d = w.len();
        x.chunks(d)
            .flat_map(|r| {
                let ms = r.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / d as f64;
                let s = 1.0 / (ms + eps as f64).sqrt();
                r.iter().zip(w).map(move |(v, g)| (*v as f64 * s * *g as f64) as f32)
            })
            .collect()
    }

    fn softmax_slow(row: &[f32]) -> Vec<f32> {
        let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let e: Vec<f64> = row.iter().map(|v| (*v as f64 - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|v| (v / s) as f32).collect()
    }

    /// Rotates one head's rope dims the slow way: each pair by its own angle.
    fn rope_slow(x: &[f32], l: RopeLayout, pos0: usize, base: f32, style: RopeStyle) -> Vec<f32> {
        let mut y = x.to_vec();
        let width = l.n_heads * l.head_stride;
        for (r, row) in y.chunks_mut(width).enumerate() {
            let pos = (pos0 + r) as f64;
            for h in 0..l.n_heads {
                for i in 0..l.rope_dim / 2 {
                    let theta = pos * (base as f64).powf(-2.0 * i as f64 / l.rope_dim as f64);
                    let (a, b) = match style {
                        RopeStyle::Norm => (2 * i, 2 * i + 1),
                        RopeStyle::Neox => (i, i + l.rope_dim / 2),
                    };
                    let base_idx = h * l.head_stride + l.offset;
                    let (x0, x1) = (row[base_idx + a] as f64, row[base_idx + b] as f64);
                    row[base_idx + a] = (x0 * theta.cos() - x1 * theta.sin()) as f32;
                    row[base_idx + b] = (x0 * theta.sin() + x1 * theta.cos()) as f32;
                }
            }
        }
        y
    }

    #[test]
    fn window_and_softcap() {
        let (n, h, hd) = (5, 2, 4);
        let q = rand_vec(1, n * h * hd);
        let k = rand_vec(2, n * h * hd);
        let v = rand_vec(3, n * h * hd);
        let plain = GqaShape {
            n_heads: h,
            n_kv_heads: h,
            head_dim: hd,
            scale: 0.5,
            window: None,
            softcap: None,
        };
        // A window of 1: every query reads only its own key, so the output is its own v row.
        let mut out = vec![f32::NAN; n * h * hd];
        gqa_attention(
            &q,
            &k,
            &v,
            0,
            GqaShape {
                window: Some(1),
                ..plain
            },
            &mut out,
        );
        assert_eq!(out, v);
        // A window as long as the sequence is full attention.
        let (mut full, mut wide) = (vec![0.0; out.len()], vec![0.0; out.len()]);
        gqa_attention(&q, &k, &v, 0, plain, &mut full);
        gqa_attention(
            &q,
            &k,
            &v,
            0,
            GqaShape {
                window: Some(n),
                ..plain
            },
            &mut wide,
        );
        assert_eq!(full, wide);
        // A soft-cap far above the scores changes little; a tight one changes the output.
        let (mut loose, mut tight) = (vec![0.0; out.len()], vec![0.0; out.len()]);
        gqa_attention(
            &q,
            &k,
            &v,
            0,
            GqaShape {
                softcap: Some(1e4),
                ..plain
            },
            &mut loose,
        );
        gqa_attention(
            &q,
            &k,
            &v,
            0,
            GqaShape {
                softcap: Some(0.05),
                ..plain
            },
            &mut tight,
        );
        assert!(max_rel(&loose, &full) < 1e-5);
        assert!(max_rel(&tight, &full) > 1e-3);
    }

    fn gqa_slow(q: &[f32], k: &[f32], v: &[f32], pos0: usize, s: GqaShape) -> Vec<f32> {
        let n = q.len() / (s.n_heads * s.head_dim);
        let hd = s.head_dim;
        let kvw = s.n_kv_heads * hd;
        let mut out = vec![0f32; q.len()];
        for t in 0..n {
            for h in 0..s.n_heads {
                let kvh = h / (s.n_heads / s.n_kv_heads);
                let qh = &q[(t * s.n_heads + h) * hd..][..hd];
                let scores: Vec<f32> = (0..=pos0 + t)
                    .map(|j| {
                        let kj = &k[j * kvw + kvh * hd..][..hd];
                        (qh.iter().zip(kj).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * s.scale as f64) as f32
                    })
                    .collect();
                let p = softmax_slow(&scores);
                for d in 0..hd {
                    let acc: f64 = p
                        .iter()
                        .enumerate()
                        .map(|(j, pj)| *pj as f64 * v[j * kvw + kvh * hd + d] as f64)
                        .sum();
                    out[(t * s.n_heads + h) * hd + d] = acc as f32;
                }
            }
        }
        out
    }

    fn rand_vec(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn max_rel(a: &[f32], b: &[f32]) -> f32 {
        let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn matmul_fast_matches_slow(n in 1usize..6, n_out in 1usize..80, n_in in 1usize..70, seed in 0u64..1000) {
            let x = rand_vec(seed, n * n_in);
            let w = rand_vec(seed + 1, n_out * n_in);
            let mut out = vec![0f32; n * n_out];
            matmul(&x, n, Mat { data: &w, rows: n_out, cols: n_in }, &mut out);
            let slow = matmul_slow(&x, n, &w, n_out, n_in);
            prop_assert!(max_rel(&out, &slow) < 1e-5);
        }

        #[test]
        fn rms_norm_fast_matches_slow(n in 1usize..4, d in 1usize..100, seed in 0u64..1000) {
            let x = rand_vec(seed, n * d);
            let w = rand_vec(seed + 7, d);
            let mut out = vec![0f32; n * d];
            rms_norm(&x, &w, 1e-5, &mut out);
            prop_assert!(max_rel(&out, &rms_norm_slow(&x, &w, 1e-5)) < 1e-6);
        }

        #[test]
        fn softmax_fast_matches_slow(n in 1usize..200, seed in 0u64..1000) {
            let mut x: Vec<f32> = rand_vec(seed, n).iter().map(|v| v * 30.0).collect();
            let slow = softmax_slow(&x);
            softmax(&mut x);
            prop_assert!(max_rel(&x, &slow) < 1e-6);
        }

        #[test]
        fn rope_fast_matches_slow(n in 1usize..5, heads in 1usize..4, half in 1usize..8, extra in 0usize..6,
                                   pos0 in 0usize..300, neox in proptest::bool::ANY, seed in 0u64..1000) {
            let rope_dim = 2 * half;
            let l = RopeLayout { n_heads: heads, head_stride: rope_dim + extra, offset: extra, rope_dim };
            let style = if neox { RopeStyle::Neox } else { RopeStyle::Norm };
            let x = rand_vec(seed, n * heads * l.head_stride);
            let slow = rope_slow(&x, l, pos0, 10000.0, style);
            let mut fast = x.clone();
            rope(&mut fast, l, pos0, 10000.0, style);
            prop_assert!(max_rel(&fast, &slow) < 1e-5);
        }

        #[test]
        fn gqa_fast_matches_slow(n in 1usize..5, pos0 in 0usize..6, kv in 1usize..3, group in 1usize..4,
                                 hd in 1usize..20, seed in 0u64..1000) {
            let h = kv * group;
            let s = GqaShape { window: None, softcap: None, n_heads: h, n_kv_heads: kv, head_dim: hd, scale: 1.0 / (hd as f32).sqrt() };
            let t = pos0 + n;
            let q = rand_vec(seed, n * h * hd);
            let k = rand_vec(seed + 1, t * kv * hd);
            let v = rand_vec(seed + 2, t * kv * hd);
            let mut out = vec![f32::NAN; n * h * hd];
            gqa_attention(&q, &k, &v, pos0, s, &mut out);
            prop_assert!(max_rel(&out, &gqa_slow(&q, &k, &v, pos0, s)) < 1e-5);
        }
    }

    #[test]
    fn quantized_matmul_matches_dequantized_f32() {
        // Q8_0 rows built by hand: d = 1/64, q = small integers.
        let (n_out, n_in) = (37, 64);
        let mut bytes = Vec::new();
        let mut w = Vec::new();
        for r in 0..n_out {
            for b in 0..n_in / 32 {
                bytes.extend_from_slice(&half::f16::from_f32(1.0 / 64.0).to_le_bytes());
                for i in 0..32 {
                    let q = ((r * 7 + b * 3 + i * 5) % 31) as i8 - 15;
                    bytes.push(q as u8);
                    w.push(q as f32 / 64.0);
                }
            }
        }
        let q = QMat {
            ty: GgmlType::Q8_0,
            bytes: &bytes,
            rows: n_out,
            cols: n_in,
            row_bytes: 34 * n_in / 32,
        };
        for n in [1, 3, 4, 9] {
            let x = rand_vec(n as u64, n * n_in);
            let mut out = vec![0f32; n * n_out];
            matmul_any(&x, n, WeightRef::Quant(q), &mut out);
            assert!(max_rel(&out, &matmul_slow(&x, n, &w, n_out, n_in)) < 1e-5, "n {n}");
        }
    }

    #[test]
    fn dot4_is_bit_identical_to_dot() {
        let w = rand_vec(9, 77);
        let xs: Vec<Vec<f32>> = (0..4).map(|k| rand_vec(k, 77)).collect();
        let d = dot4([&xs[0], &xs[1], &xs[2], &xs[3]], &w);
        for k in 0..4 {
            assert_eq!(d[k].to_bits(), dot(&xs[k], &w).to_bits());
        }
    }

    #[test]
    fn mla_equals_gqa_on_concatenated_keys() {
        // MLA with per-head [k_nope | shared k_pe] is GQA with KV = H over the concatenated keys.
        let (n, pos0, h, nope, rp, vd) = (3, 2, 4, 6, 4, 5);
        let t = pos0 + n;
        let q = rand_vec(1, n * h * (nope + rp));
        let kn = rand_vec(2, t * h * nope);
        let kp = rand_vec(3, t * rp);
        let v = rand_vec(4, t * h * vd);
        let scale = 0.3;
        let mut out = vec![f32::NAN; n * h * vd];
        let s = MlaShape {
            n_heads: h,
            nope,
            rope: rp,
            v_dim: vd,
            scale,
        };
        mla_attention(&q, &kn, &kp, &v, pos0, s, &mut out);
        // Build full keys and pad v to the key width for the slow GQA.
        let hd = nope + rp;
        let mut k_full = vec![0f32; t * h * hd];
        let mut v_full = vec![0f32; t * h * hd];
        for j in 0..t {
            for hh in 0..h {
                k_full[(j * h + hh) * hd..][..nope].copy_from_slice(&kn[(j * h + hh) * nope..][..nope]);
                k_full[(j * h + hh) * hd + nope..][..rp].copy_from_slice(&kp[j * rp..][..rp]);
                v_full[(j * h + hh) * hd..][..vd].copy_from_slice(&v[(j * h + hh) * vd..][..vd]);
            }
        }
        let g = GqaShape {
            window: None,
            softcap: None,
            n_heads: h,
            n_kv_heads: h,
            head_dim: hd,
            scale,
        };
        let slow = gqa_slow(&q, &k_full, &v_full, pos0, g);
        let slow_v: Vec<f32> = slow.chunks(hd).flat_map(|c| c[..vd].to_vec()).collect();
        assert!(max_rel(&out, &slow_v) < 1e-5);
    }

    #[test]
    fn swiglu_matches_definition() {
        let mut g = vec![-3.0f32, 0.0, 0.5, 4.0];
        let u = vec![2.0f32, 1.0, -1.0, 0.25];
        let want: Vec<f32> = g
            .iter()
            .zip(&u)
            .map(|(a, b)| (*a as f64 / (1.0 + (-*a as f64).exp()) * *b as f64) as f32)
            .collect();
        swiglu(&mut g, &u);
        assert!(max_rel(&g, &want) < 1e-6);
    }

    /// `rope_scaled` divides pair i's angle by divisor·factors[i]: checked against the rotation
    /// written out, and the unscaled `rope` at a position that makes the angles equal.
    #[test]
    fn rope_scaled_divides_each_pair_angle() {
        let l = RopeLayout {
            n_heads: 2,
            head_stride: 6,
            offset: 2,
            rope_dim: 4,
        };
        let x = rand_vec(3, 2 * 12);
        let factors = [1.0f32, 8.0];
        let mut y = x.clone();
        rope_scaled(
            &mut y,
            l,
            5,
            10000.0,
            RopeStyle::Norm,
            RopeFreqs {
                divisor: 2.0,
                factors: Some(&factors[..]),
            },
        );
        for (r, (xr, yr)) in x.chunks(12).zip(y.chunks(12)).enumerate() {
            let pos = (5 + r) as f64;
            for h in 0..2 {
                for i in 0..2 {
                    let theta = pos * 10000f64.powf(-(i as f64) / 2.0) / (2.0 * factors[i] as f64);
                    let a = h * 6 + 2 + 2 * i;
                    let (x0, x1) = (xr[a] as f64, xr[a + 1] as f64);
                    assert!((yr[a] as f64 - (x0 * theta.cos() - x1 * theta.sin())).abs() < 1e-5);
                    assert!((yr[a + 1] as f64 - (x0 * theta.sin() + x1 * theta.cos())).abs() < 1e-5);
                }
                assert_eq!(
                    &yr[h * 6..h * 6 + 2],
                    &xr[h * 6..h * 6 + 2],
                    "dims before the offset stay"
                );
            }
        }
        let (mut plain, mut unit) = (x.clone(), x.clone());
        rope(&mut plain, l, 5, 10000.0, RopeStyle::Neox);
        rope_scaled(
            &mut unit,
            l,
            5,
            10000.0,
            RopeStyle::Neox,
            RopeFreqs {
                divisor: 1.0,
                factors: Some(&[1.0f32, 1.0][..]),
            },
        );
        assert_eq!(plain, unit);
    }
}
