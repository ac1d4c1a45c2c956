//! The DSA (DeepSeek Sparse Attention) lightning indexer of `deepseek32` (DeepSeek-V3.2) and
//! `glm-dsa` (GLM-5), and the sparse MLA attention over the keys it selects. The rest of those
//! blocks is deepseek2's MLA + MoE (`deepseek2.rs` calls in here).
//!
//! Per layer with a `full` indexer, for query t and every causal key s ≤ t:
//! `score[t][s] = Σ_h w[t][h] · relu(q[t][h] · k[s])`, where
//! - `q = indexer.attn_q_b · qr` (`qr` = the MLA's normed q_a), `n_heads` heads of `head_dim`;
//! - `k = LayerNorm(indexer.attn_k · x)` (weight and bias, eps 1e-6), one key per token;
//! - RoPE on the first rope-dim entries of every q head and of k (the layout is `[rope | nope]`):
//!   NeoX halves for deepseek32, interleaved pairs for glm-dsa — the choices of
//!   llama-cpp-python 0.3.36's vendored llama.cpp (`src/models/deepseek32.cpp`: `ROPE_TYPE_NEOX`;
//!   `glm-dsa.cpp`: `ROPE_TYPE_NORM`), matching HF transformers 5.x (`apply_rotary_pos_emb` vs
//!   `apply_rotary_pos_emb_interleave` in the indexers). Other llama.cpp versions differed;
//! - `w = indexer.proj · x / sqrt(head_dim · n_heads)` (HF: softmax_scale·n_heads^−½, which is the
//!   same because relu commutes with a positive scale).
//!
//! llama.cpp also multiplies q and k by a Hadamard matrix before scoring; it is orthogonal, so the
//! scores are unchanged and the reference does not apply it. The query attends to the `top_k`
//! keys of highest score (all its keys while it has at most `top_k`); ties go to the earlier key.
//! A glm-dsa `shared` layer (GGUF `attention.indexer.types` false) has no indexer tensors and
//! reuses the previous `full` layer's selection.

use super::{emit, emit_weight, linear, ops, ForwardError, Reference};
use crate::tap::{Site, Tap, TapKey, WeightKind};

/// The selection carried from a `full` indexer layer to the `shared` layers after it.
#[derive(Default)]
pub(crate) struct DsaState {
    prev: Option<Vec<Vec<usize>>>,
}

/// LayerNorm over rows of `d` with weight and bias, in f64.
pub fn layer_norm(x: &[f32], d: usize, w: &[f32], b: &[f32], eps: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(d) {
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / d as f64;
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / d as f64;
        let inv = 1.0 / (var + eps as f64).sqrt();
        out.extend(
            row.iter()
                .zip(w.iter().zip(b))
                .map(|(&v, (&w, &b))| ((v as f64 - mean) * inv * w as f64 + b as f64) as f32),
        );
    }
    out
}

/// Index scores `[n][t+1]` (row t holds keys 0..=t) from roped `q [n, H·D]`, `k [n, D]` and the
/// pre-scaled head weights `w [n, H]`.
pub fn index_scores(q: &[f32], k: &[f32], w: &[f32], n: usize, n_heads: usize, head_dim: usize) -> Vec<Vec<f64>> {
    (0..n)
        .map(|t| {
            (0..=t)
                .map(|s| {
                    let ks = &k[s * head_dim..(s + 1) * head_dim];
                    (0..n_heads)
                        .map(|h| {
                            let qh = &q[(t * n_heads + h) * head_dim..(t * n_heads + h + 1) * head_dim];
                            w[t * n_heads + h] as f64 * ops::dot64(qh, ks).max(0.0)
                        })
                        .sum()
                })
                .collect()
        })
        .collect()
}

/// The `top_k` best keys of each row of causal scores, ascending; every key while a row has at
/// most `top_k`. Ties go to the earlier key.
pub fn top_k_keys(scores: &[Vec<f64>], top_k: usize) -> Vec<Vec<usize>> {
    scores
        .iter()
        .map(|row| {
            let mut order: Vec<usize> = (0..row.len()).collect();
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            order.truncate(top_k);
            order.sort_unstable();
            order
        })
        .collect()
}

/// The `[n, n]` layout of the `indexer_score` tap (row t = query t; keys after t hold 0).
fn flatten_scores(scores: &[Vec<f64>], n: usize) -> Vec<f32> {
    let mut flat = vec![0f32; n * n];
    for (t, row) in scores.iter().enumerate() {
        for (s, &v) in row.iter().enumerate() {
            flat[t * n + s] = v as f32;
        }
    }
    flat
}

/// Rounds to fp8 e4m3 (3 mantissa bits, subnormals below 2⁻⁶, saturating at ±448; ties to even,
/// as torch's and CUDA's conversions round).
pub fn round_e4m3(x: f64) -> f64 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let a = x.abs().min(448.0);
    let e = a.log2().floor().max(-6.0);
    let step = 2f64.powf(e - 3.0);
    ((a / step).round_ties_even() * step).min(448.0).copysign(x)
}

/// Quantizes `row` to fp8 e4m3 in groups of 128 with a per-group scale amax/448, as vLLM stores
/// the indexer's q and its key cache; returns the dequantized values.
pub fn fp8_groups(row: &mut [f32]) {
    for g in row.chunks_mut(128) {
        let amax = g.iter().fold(0f64, |m, &v| m.max((v as f64).abs()));
        if amax == 0.0 {
            continue;
        }
        let scale = amax / 448.0;
        g.iter_mut()
            .for_each(|v| *v = (round_e4m3(*v as f64 / scale) * scale) as f32);
    }
}

/// The indexer's roped q `[n, H·D]`, roped key `[n, D]` and scaled head weights `[n, H]`.
type IndexerQkw = (Vec<f32>, Vec<f32>, Vec<f32>);

/// Layer `l`'s indexer inputs: roped q `[n, H·D]`, roped key `[n, D]` and the scaled head
/// weights `[n, H]`, from `x` (the attn_norm output) and `qr` (the normed q_a). With
/// [`Reference::indexer_fp8`], q and k are rounded to fp8 per head (groups of 128) after RoPE.
fn indexer_qkw(r: &Reference, l: usize, x: &[f32], qr: &[f32], n: usize) -> Result<IndexerQkw, ForwardError> {
    let c = &r.config;
    let ix = c.indexer.as_ref().expect("a DSA model has an indexer");
    let m = c.mla.as_ref().expect("a DSA model has MLA");
    let (h, dh, rope) = (ix.n_heads, ix.head_dim, m.qk_rope);
    let ql = m.q_lora_rank.ok_or_else(|| ForwardError::BadTensor {
        name: format!("blk.{l}.attn_q_a.weight"),
        msg: "the DSA indexer needs q_a (q_lora_rank)".into(),
    })?;
    let name = |s: &str| format!("blk.{l}.indexer.{s}");
    let wq = r.matrix(&name("attn_q_b.weight"), h * dh, ql)?;
    let wk = r.matrix(&name("attn_k.weight"), dh, c.d_model)?;
    let wp = r.matrix(&name("proj.weight"), h, c.d_model)?;
    let mut q = linear(qr, n, &wq);
    let k = linear(x, n, &wk);
    let mut k = layer_norm(
        &k,
        dh,
        &r.vector(&name("k_norm.weight"), dh)?,
        &r.vector(&name("k_norm.bias"), dh)?,
        ix.k_norm_eps,
    );
    for t in 0..n {
        let (qt, kt) = (&mut q[t * h * dh..(t + 1) * h * dh], &mut k[t * dh..(t + 1) * dh]);
        super::yarn::mla_rope(c, qt, dh, 0, t, rope, ix.rope_neox);
        super::yarn::mla_rope(c, kt, dh, 0, t, rope, ix.rope_neox);
    }
    if r.indexer_fp8 {
        q.chunks_mut(dh).for_each(fp8_groups);
        k.chunks_mut(dh).for_each(fp8_groups);
    }
    let scale = 1.0 / ((dh * h) as f64).sqrt();
    let w: Vec<f32> = linear(x, n, &wp).iter().map(|&v| (v as f64 * scale) as f32).collect();
    Ok((q, k, w))
}

/// Layer `l`'s index scores re-run on a candidate's own `attn_norm` output `x` and q_a before
/// its norm (`qa`, `[n, q_lora]`): the `[n, n]` tap and its noise scale rho for fp8 scoring
/// (each score `Σ_h w_h·relu(q_h·k)` with q and k rounded once each: per score
/// `a = √2·√(Σ_h w_h²·[q_h·k > 0]·Σ_i (q_hi·k_i)²) + |score|`, rho = rms(a)/rms(score) over the
/// causal entries). Errors when the layer has no indexer tensors (a `shared` layer).
pub fn replay_scores(
    r: &Reference,
    l: usize,
    x: &[f32],
    qa: &[f32],
    n: usize,
) -> Result<(Vec<f32>, f64), ForwardError> {
    let c = &r.config;
    let ix = c.indexer.as_ref().expect("a DSA model has an indexer");
    let ql = c.mla.as_ref().and_then(|m| m.q_lora_rank).unwrap_or(0);
    let qr = ops::rms_norm(
        qa,
        ql,
        &r.vector(&format!("blk.{l}.attn_q_a_norm.weight"), ql)?,
        c.rms_eps,
    );
    let (q, k, w) = indexer_qkw(r, l, x, &qr, n)?;
    let (h, dh) = (ix.n_heads, ix.head_dim);
    let scores = index_scores(&q, &k, &w, n, h, dh);
    let (mut aa, mut yy) = (0f64, 0f64);
    for (t, row) in scores.iter().enumerate() {
        for (s, &y) in row.iter().enumerate() {
            let ks = &k[s * dh..(s + 1) * dh];
            let mut sq = 0f64;
            for hh in 0..h {
                let qh = &q[(t * h + hh) * dh..(t * h + hh + 1) * dh];
                if ops::dot64(qh, ks) > 0.0 {
                    let wt = w[t * h + hh] as f64;
                    sq += wt
                        * wt
                        * qh.iter()
                            .zip(ks)
                            .map(|(&a, &b)| (a as f64 * b as f64).powi(2))
                            .sum::<f64>();
                }
            }
            let a = std::f64::consts::SQRT_2 * sq.sqrt() + y.abs();
            aa += a * a;
            yy += y * y;
        }
    }
    let rho = if yy > 0.0 { (aa / yy).sqrt() } else { 1.0 };
    Ok((flatten_scores(&scores, n), rho))
}

/// Runs layer `l`'s indexer (or reuses the previous full layer's selection on a `shared` layer)
/// on `x` (the attn_norm output) and `qr` (the normed q_a); taps its scores and selection.
pub(super) fn select(
    r: &Reference,
    l: usize,
    x: &[f32],
    qr: &[f32],
    n: usize,
    tap: &mut dyn Tap,
    state: &mut DsaState,
) -> Result<Vec<Vec<usize>>, ForwardError> {
    let c = &r.config;
    let ix = c.indexer.as_ref().expect("a DSA model has an indexer");
    let sel = if ix.full.get(l).copied().unwrap_or(true) {
        // The indexer's weights (w.idx_q_b, w.idx_k, w.idx_proj), as every rank's replica holds them.
        for kind in [WeightKind::IdxQB, WeightKind::IdxK, WeightKind::IdxProj] {
            if let Some(w) = r.weight(l, kind)? {
                emit_weight(tap, l, kind, &w);
            }
        }
        let (q, k, w) = indexer_qkw(r, l, x, qr, n)?;
        let scores = index_scores(&q, &k, &w, n, ix.n_heads, ix.head_dim);
        let key = TapKey::layer(l, Site::IndexerScore);
        if tap.wants(&key) {
            tap.record_owned(&key, flatten_scores(&scores, n), [n, n]);
        }
        top_k_keys(&scores, ix.top_k)
    } else {
        state.prev.clone().ok_or_else(|| ForwardError::BadTensor {
            name: format!("blk.{l}"),
            msg: "a `shared` indexer layer with no earlier `full` layer".into(),
        })?
    };
    let key = TapKey::layer(l, Site::IndexerTopk);
    if tap.wants(&key) {
        let mut flat = vec![-1f32; n * ix.top_k];
        for (t, keys) in sel.iter().enumerate() {
            for (j, &s) in keys.iter().enumerate() {
                flat[t * ix.top_k + j] = s as f32;
            }
        }
        emit(tap, key, &flat, n);
    }
    state.prev = Some(sel.clone());
    Ok(sel)
}

/// Reads an `indexer_topk` tap (`[n, top_k]`, −1 padding) back into per-query key lists; `None`
/// when an entry is not a key position at or before its query.
pub fn selection_from_tap(data: &[f32], n: usize) -> Option<Vec<Vec<usize>>> {
    let width = data.len().checked_div(n)?;
    data.chunks(width.max(1))
        .take(n)
        .enumerate()
        .map(|(t, row)| {
            row.iter()
                .filter(|&&v| v >= 0.0)
                .map(|&v| (v.fract() == 0.0 && (v as usize) <= t).then_some(v as usize))
                .collect::<Option<Vec<usize>>>()
        })
        .collect()
}

/// Attention of `q [n, H·dk]` over only the selected keys of each query (`k [n, H·dk]`,
/// `v [n, H·dv]`, one K/V head per query head).
#[allow(clippy::too_many_arguments)]
pub fn sparse_attention(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    n: usize,
    n_heads: usize,
    dk: usize,
    dv: usize,
    scale: f64,
    keys: &[Vec<usize>],
) -> Vec<f32> {
    let mut out = vec![0f32; n * n_heads * dv];
    for (t, out_t) in out.chunks_mut(n_heads * dv).enumerate() {
        let sel = &keys[t];
        let mut scores = vec![0f64; sel.len()];
        for h in 0..n_heads {
            let qh = &q[(t * n_heads + h) * dk..(t * n_heads + h + 1) * dk];
            for (score, &s) in scores.iter_mut().zip(sel) {
                *score = ops::dot64(qh, &k[(s * n_heads + h) * dk..(s * n_heads + h + 1) * dk]) * scale;
            }
            ops::softmax(&mut scores);
            let mut acc = vec![0f64; dv];
            for (&p, &s) in scores.iter().zip(sel) {
                for (a, &x) in acc
                    .iter_mut()
                    .zip(&v[(s * n_heads + h) * dv..(s * n_heads + h + 1) * dv])
                {
                    *a += p * x as f64;
                }
            }
            for (o, a) in out_t[h * dv..(h + 1) * dv].iter_mut().zip(&acc) {
                *o = *a as f32;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_keeps_every_key_until_there_are_more_and_breaks_ties_early() {
        let scores = vec![vec![1.0], vec![0.5, 2.0], vec![3.0, 1.0, 3.0], vec![0.0, 5.0, 4.0, 6.0]];
        let sel = top_k_keys(&scores, 2);
        assert_eq!(sel, vec![vec![0], vec![0, 1], vec![0, 2], vec![1, 3]]);
        let ties = top_k_keys(&[vec![1.0, 1.0, 1.0]], 2);
        assert_eq!(ties, vec![vec![0, 1]]);
    }

    #[test]
    fn relu_drops_negative_head_products() {
        // One key dim, two heads: head products 2·1 and −3·1; weights 1 and 10.
        let q = [2.0, -3.0];
        let k = [1.0];
        let w = [1.0, 10.0];
        let s = index_scores(&q, &k, &w, 1, 2, 1);
        assert_eq!(s, vec![vec![2.0]]);
    }

    #[test]
    fn sparse_attention_with_every_key_is_causal_attention() {
        let (n, h, dk, dv) = (4, 2, 3, 2);
        let q: Vec<f32> = (0..n * h * dk).map(|i| (i as f32 * 0.37).sin()).collect();
        let k: Vec<f32> = (0..n * h * dk).map(|i| (i as f32 * 0.91).cos()).collect();
        let v: Vec<f32> = (0..n * h * dv).map(|i| i as f32 * 0.1).collect();
        let all: Vec<Vec<usize>> = (0..n).map(|t| (0..=t).collect()).collect();
        let a = sparse_attention(&q, &k, &v, n, h, dk, dv, 0.5, &all);
        let b = ops::causal_attention(&q, &k, &v, n, h, h, dk, dv, 0.5);
        assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-6));
        // One key only: the output is that key's value.
        let one: Vec<Vec<usize>> = (0..n).map(|_| vec![0]).collect();
        let c = sparse_attention(&q, &k, &v, n, h, dk, dv, 0.5, &one);
        assert_eq!(&c[3 * h * dv..3 * h * dv + dv], &v[..dv]);
    }

    #[test]
    fn neox_rope_rotates_halves_and_norm_rotates_pairs() {
        let mut a = [1.0f32, 0.0, 0.0, 0.0];
        super::super::ops::rope_neox(&mut a, 4, 1, 4, 10000.0);
        // Pair (0, 2) rotated by 1 rad.
        assert!((a[0] - 1f32.cos()).abs() < 1e-6 && (a[2] - 1f32.sin()).abs() < 1e-6 && a[1] == 0.0);
        let mut b = [1.0f32, 0.0, 0.0, 0.0];
        ops::rope_norm(&mut b, 4, 0, 1, 4, 10000.0);
        assert!((b[0] - 1f32.cos()).abs() < 1e-6 && (b[1] - 1f32.sin()).abs() < 1e-6 && b[2] == 0.0);
    }

    #[test]
    fn selection_tap_round_trips_and_rejects_future_keys() {
        let data = [0.0, -1.0, 0.0, 1.0, 1.0, 2.0];
        assert_eq!(
            selection_from_tap(&data, 3),
            Some(vec![vec![0], vec![0, 1], vec![1, 2]])
        );
        assert_eq!(selection_from_tap(&[1.0, -1.0], 1), None);
    }
}
