//! The engine's DSA (DeepSeek Sparse Attention) ops for `glm-dsa` (GLM-5) and `deepseek32`, on
//! the host: the lightning indexer's key norm, its scores, fp8 rounding of its q and key cache,
//! the top-k selection, and MLA attention over the selected keys only. The CPU backend runs these;
//! a device backend runs its own kernels and keeps these as the slow side of its self-check.
//!
//! As vLLM runs it (`Indexer` in its deepseek_v2.py: every projection a `ReplicatedLinear`), the
//! indexer is replicated, not sharded: every rank computes the same scores and selection from the
//! replicated attn_norm output and normed q_a. Per layer with its own indexer, for the query at
//! position p and every key s ≤ p: `score = Σ_h w_h · relu(q_h · k_s)`, with `q = q_b(qr)` roped,
//! `k = LayerNorm(wk · x)` roped (the key cache holds it), `w = proj · x / sqrt(D·H)`. The query
//! attends to the `top_k` highest-scoring keys (every key while it has at most `top_k`), ties to the
//! earlier key. The selection is taken on the host from the downloaded scores, like the MoE routes.

use crate::cpu_ops::{dot, mla_slot, MlaShape};
use crate::weights::round_fp8_e4m3;
use rayon::prelude::*;

/// The indexer's head geometry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexShape {
    pub n_heads: usize,
    pub head_dim: usize,
}

/// LayerNorm over rows of `weight.len()` with weight and bias (mean and variance in f64).
pub fn layer_norm(x: &[f32], weight: &[f32], bias: &[f32], eps: f32, out: &mut [f32]) {
    let d = weight.len();
    assert!(d > 0 && x.len().is_multiple_of(d) && out.len() == x.len() && bias.len() == d);
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let mean = xr.iter().map(|&v| v as f64).sum::<f64>() / d as f64;
        let var = xr.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / d as f64;
        let inv = 1.0 / (var + eps as f64).sqrt();
        for ((o, &v), (&g, &b)) in or.iter_mut().zip(xr).zip(weight.iter().zip(bias)) {
            *o = ((v as f64 - mean) * inv) as f32 * g + b;
        }
    }
}

/// Index scores `out` `[n, pos0+n]` of queries `q` `[n, H·D]` (positions `pos0..pos0+n`) over the
/// key cache `k` `[T, D]` (T ≥ pos0+n) with head weights `w` `[n, H]`; keys after a query's
/// position hold 0.
pub fn index_scores(q: &[f32], k: &[f32], w: &[f32], pos0: usize, s: IndexShape, out: &mut [f32]) {
    let (h, dh) = (s.n_heads, s.head_dim);
    let n = w.len() / h.max(1);
    let width = pos0 + n;
    assert!(q.len() == n * h * dh && out.len() == n * width && k.len() >= width * dh);
    out.par_chunks_mut(width).enumerate().for_each(|(t, row)| {
        let qt = &q[t * h * dh..(t + 1) * h * dh];
        let wt = &w[t * h..(t + 1) * h];
        for (key, o) in row.iter_mut().enumerate() {
            *o = if key <= pos0 + t {
                let ks = &k[key * dh..(key + 1) * dh];
                qt.chunks_exact(dh)
                    .zip(wt)
                    .map(|(qh, &wh)| wh * dot(qh, ks).max(0.0))
                    .sum()
            } else {
                0.0
            };
        }
    });
}

/// The `top_k` best keys of each score row (`[n, width]`, row t holding keys `0..=pos0+t`),
/// ascending; every key while a row has at most `top_k`; ties to the earlier key.
pub fn select_top_k(scores: &[f32], n: usize, pos0: usize, top_k: usize) -> Vec<Vec<usize>> {
    let width = pos0 + n;
    (0..n)
        .map(|t| {
            let row = &scores[t * width..t * width + pos0 + t + 1];
            let mut order: Vec<usize> = (0..row.len()).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            order.truncate(top_k);
            order.sort_unstable();
            order
        })
        .collect()
}

/// A selection as the `[n, top_k]` key table the sparse attention op reads (positions as f32,
/// −1 padding), which is also the `indexer_topk` tap's layout.
pub fn key_table(sel: &[Vec<usize>], top_k: usize) -> Vec<f32> {
    let mut flat = vec![-1f32; sel.len() * top_k];
    for (row, keys) in flat.chunks_mut(top_k).zip(sel) {
        for (o, &s) in row.iter_mut().zip(keys) {
            *o = s as f32;
        }
    }
    flat
}

/// Rounds each row of `width` to fp8 e4m3 in groups of 128 with a per-group scale amax/448, as
/// vLLM stores the indexer's q and key cache.
pub fn fp8_groups(x: &mut [f32], width: usize) {
    for row in x.chunks_mut(width.max(1)) {
        for g in row.chunks_mut(128) {
            let amax = g.iter().fold(0f32, |m, &v| m.max(v.abs()));
            if amax == 0.0 || !amax.is_finite() {
                continue;
            }
            let scale = amax / 448.0;
            g.iter_mut().for_each(|v| *v = round_fp8_e4m3(*v / scale) * scale);
        }
    }
}

/// MLA attention of each query over only its selected keys: as [`crate::cpu_ops::mla_attention`]
/// with query t reading the cache rows listed in row t of `keys` (`[n, top_k]`, −1 padding).
#[allow(clippy::too_many_arguments)]
pub fn mla_attention_sparse(
    q: &[f32],
    k_nope: &[f32],
    k_pe: &[f32],
    v: &[f32],
    s: MlaShape,
    keys: &[f32],
    top_k: usize,
    out: &mut [f32],
) {
    out.par_chunks_mut(s.v_dim).enumerate().for_each(|(slot_idx, o)| {
        let t = slot_idx / s.n_heads;
        let row = &keys[t * top_k..(t + 1) * top_k];
        let sel = row.iter().filter(|&&j| j >= 0.0).map(|&j| j as usize);
        mla_slot(q, k_nope, k_pe, v, s, slot_idx, sel, o);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu_ops::mla_attention;

    #[test]
    fn selection_keeps_every_key_until_there_are_more_and_breaks_ties_early() {
        // Rows of a 4-token prefill: [1], [0.5, 2], [3, 1, 3], [0, 5, 4, 6].
        let mut s = vec![0f32; 16];
        for (t, row) in [vec![1.0], vec![0.5, 2.0], vec![3.0, 1.0, 3.0], vec![0.0, 5.0, 4.0, 6.0]]
            .iter()
            .enumerate()
        {
            s[t * 4..t * 4 + row.len()].copy_from_slice(row);
        }
        let sel = select_top_k(&s, 4, 0, 2);
        assert_eq!(sel, vec![vec![0], vec![0, 1], vec![0, 2], vec![1, 3]]);
        assert_eq!(key_table(&sel[..2], 2), vec![0.0, -1.0, 0.0, 1.0]);
        // A decode row at position 3 (pos0 3, one query) reads keys 0..=3.
        assert_eq!(select_top_k(&[0.0, 5.0, 4.0, 6.0], 1, 3, 2), vec![vec![1, 3]]);
    }

    #[test]
    fn scores_drop_negative_head_products_and_future_keys() {
        // One key dim, two heads: q products 2·k and −3·k; weights 1 and 10.
        let s = IndexShape {
            n_heads: 2,
            head_dim: 1,
        };
        let (q, k, w) = ([2.0, -3.0, 1.0, 1.0], [1.0, 2.0], [1.0, 10.0, 1.0, 1.0]);
        let mut out = vec![9f32; 4];
        index_scores(&q, &k, &w, 0, s, &mut out);
        assert_eq!(out, vec![2.0, 0.0, 2.0, 4.0]);
    }

    #[test]
    fn sparse_attention_over_every_key_is_causal_attention() {
        let s = MlaShape {
            n_heads: 2,
            nope: 3,
            rope: 2,
            v_dim: 2,
            scale: 0.4,
        };
        let n = 4;
        let f = |len: usize, a: f32| -> Vec<f32> { (0..len).map(|i| (i as f32 * a).sin()).collect() };
        let (q, kn, kp, v) = (f(n * 2 * 5, 0.37), f(n * 6, 0.91), f(n * 2, 0.53), f(n * 4, 0.29));
        let all: Vec<Vec<usize>> = (0..n).map(|t| (0..=t).collect()).collect();
        let mut a = vec![0f32; n * 4];
        let mut b = vec![0f32; n * 4];
        mla_attention_sparse(&q, &kn, &kp, &v, s, &key_table(&all, n), n, &mut a);
        mla_attention(&q, &kn, &kp, &v, 0, s, &mut b);
        assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-6));
        // One key: the output is that key's value.
        let one = vec![vec![1usize]; n];
        mla_attention_sparse(&q, &kn, &kp, &v, s, &key_table(&one, 1), 1, &mut a);
        assert_eq!(&a[3 * 4..3 * 4 + 2], &v[4..6]);
    }

    #[test]
    fn layer_norm_and_fp8_groups() {
        let mut out = [0f32; 4];
        layer_norm(&[1.0, 2.0, 3.0, 4.0], &[1.0; 4], &[0.5; 4], 0.0, &mut out);
        let want = [-1.3416408, -0.4472136, 0.4472136, 1.3416408].map(|v: f32| v + 0.5);
        assert!(out.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-6));
        let mut x = [448.0f32, 1.0, 0.3, -17.0];
        fp8_groups(&mut x, 4);
        // The group's scale is 1 (amax 448): plain e4m3 rounding.
        assert_eq!(x, [448.0, 1.0, 0.3125, -16.0]);
    }
}
