//! One gpt-oss block, as HF's modeling_gpt_oss.py computes it and llama.cpp's converter stores
//! it (gate_up de-interleaved into `ffn_gate_exps`/`ffn_up_exps`, experts F32 or MXFP4):
//! RMSNorm, q/k/v with biases, NeoX RoPE (with YaRN when the file declares it), causal GQA with attention sinks and a sliding window
//! on every other layer (layer 0 first), o_proj with bias, residual, RMSNorm (stored as
//! `post_attention_norm`), then the MoE: router logits x·Wᵀ + b, the top-k logits softmaxed
//! among themselves, and each expert's clamped SwiGLU
//! `(clamp(up, ±7) + 1) · g·σ(1.702·g)` with `g = min(gate, 7)`, all projections biased.

use super::{emit, emit_weight, linear, ops, ForwardError, Mat, Reference};
use crate::tap::{Site, Tap, TapKey, WeightKind};
use rayon::prelude::*;

/// The clamped SwiGLU's constants (llama.cpp's `LLM_FFN_SWIGLU_OAI_MOE`, HF's `alpha`, `limit`).
const ALPHA: f64 = 1.702;
const LIMIT: f64 = 7.0;

pub(super) fn layer(
    r: &Reference,
    l: usize,
    x: Vec<f32>,
    n: usize,
    tap: &mut dyn Tap,
) -> Result<Vec<f32>, ForwardError> {
    let c = &r.config;
    let fam = &c.family;
    let (d, hd, nh, nkv) = (c.d_model, c.head_dim, c.n_heads, c.n_kv_heads);
    let name = |s: &str| format!("blk.{l}.{s}.weight");
    let bias = |s: &str| format!("blk.{l}.{s}.bias");
    let key = |s: Site| TapKey::layer(l, s);

    let [wq, wk, wv, wo] = super::attn_weights(r, l, tap)?;
    let h = ops::rms_norm(&x, d, &r.vector(&name("attn_norm"), d)?, c.rms_eps);
    emit(tap, key(Site::AttnNorm), &h, n);
    let mut q = biased(r, &h, n, &wq, &bias("attn_q"))?;
    let mut k = biased(r, &h, n, &wk, &bias("attn_k"))?;
    let v = biased(r, &h, n, &wv, &bias("attn_v"))?;
    let swa = fam.is_swa(l);
    let base = if swa { fam.rope_base_swa } else { c.rope_base };
    // YaRN (the released gpt-oss configs declare it): HF's frequencies and cos/sin factor.
    let yarn = c
        .yarn
        .as_ref()
        .map(|y| (y.inv_freq(base as f64, c.rope_dim), y.attention_factor(false)));
    for (t, (q_t, k_t)) in q.chunks_mut(nh * hd).zip(k.chunks_mut(nkv * hd)).enumerate() {
        for row in [q_t, k_t] {
            match &yarn {
                Some((inv_freq, scale)) => super::yarn::rope_neox(row, hd, t, inv_freq, *scale),
                None => ops::rope_neox(row, hd, t, c.rope_dim, base),
            }
        }
    }
    emit(tap, key(Site::Q), &q, n);
    emit(tap, key(Site::K), &k, n);
    emit(tap, key(Site::V), &v, n);
    let sinks = r.vector(&name("attn_sinks"), nh)?;
    let mask = ops::AttnMask {
        window: if swa { fam.sliding_window } else { None },
        softcap: None,
        sinks: Some(&sinks),
    };
    let attn = ops::causal_attention_masked(&q, &k, &v, n, nh, nkv, hd, hd, 1.0 / (hd as f64).sqrt(), mask);
    if tap.wants(&key(Site::AttnSink)) {
        let window = if swa { fam.sliding_window } else { None };
        let mass = sink_mass(&q, &k, n, nh, nkv, hd, window, &sinks);
        tap.record_owned(&key(Site::AttnSink), mass, [n, nh]);
    }
    emit(tap, key(Site::AttnOut), &attn, n);
    let proj = biased(r, &attn, n, &wo, &bias("attn_output"))?;
    emit(tap, key(Site::AttnProj), &proj, n);
    let x = ops::add(&x, &proj);
    emit(tap, key(Site::ResidAttn), &x, n);

    let h = ops::rms_norm(&x, d, &r.vector(&name("post_attention_norm"), d)?, c.rms_eps);
    emit(tap, key(Site::FfnNorm), &h, n);
    let out = moe(r, l, &h, n, tap)?;
    emit(tap, key(Site::FfnOut), &out, n);
    let x = ops::add(&x, &out);
    emit(tap, key(Site::ResidOut), &x, n);
    Ok(x)
}

/// The `attn_sink` tap `[n, H]`: per query and head, the probability the sink takes,
/// `1 / (1 + Σ_s exp(score_s − sink))` over the keys the query sees (scores scaled 1/√hd).
#[allow(clippy::too_many_arguments)]
pub fn sink_mass(
    q: &[f32],
    k: &[f32],
    n: usize,
    nh: usize,
    nkv: usize,
    hd: usize,
    window: Option<usize>,
    sinks: &[f32],
) -> Vec<f32> {
    let (group, scale) = (nh / nkv.max(1), 1.0 / (hd as f64).sqrt());
    let mut out = Vec::with_capacity(n * nh);
    for t in 0..n {
        let first = window.map_or(0, |w| (t + 1).saturating_sub(w.max(1)));
        for h in 0..nh {
            let qh = &q[(t * nh + h) * hd..(t * nh + h + 1) * hd];
            let kvh = h / group.max(1);
            let sink = sinks[h] as f64;
            let scores: Vec<f64> = (first..=t)
                .map(|s| ops::dot64(qh, &k[(s * nkv + kvh) * hd..(s * nkv + kvh + 1) * hd]) * scale)
                .collect();
            let max = scores.iter().copied().fold(sink, f64::max);
            let keys: f64 = scores.iter().map(|s| (s - max).exp()).sum();
            let own = (sink - max).exp();
            out.push((own / (own + keys)) as f32);
        }
    }
    out
}

/// `x·wᵀ + b` with the bias vector named `b`.
fn biased(r: &Reference, x: &[f32], n: usize, w: &Mat, b: &str) -> Result<Vec<f32>, ForwardError> {
    let b = r.vector(b, w.rows)?;
    Ok(add_rows(linear(x, n, w), &b))
}

pub(super) fn add_rows(mut y: Vec<f32>, b: &[f32]) -> Vec<f32> {
    for row in y.chunks_mut(b.len()) {
        for (v, &bv) in row.iter_mut().zip(b) {
            *v = (*v as f64 + bv as f64) as f32;
        }
    }
    y
}

/// gpt-oss routing for one token: the `n_used` largest logits (ties to the lower id), their
/// softmax as weights; ids ascending.
pub fn route(logits: &[f32], n_used: usize) -> (Vec<usize>, Vec<f64>) {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let mut experts = order[..n_used].to_vec();
    experts.sort_unstable();
    let mut w: Vec<f64> = experts.iter().map(|&e| logits[e] as f64).collect();
    ops::softmax(&mut w);
    (experts, w)
}

/// The clamped SwiGLU of one expert's gate and up rows.
pub fn swiglu_oai(gate: &[f32], up: &[f32]) -> Vec<f32> {
    gate.iter()
        .zip(up)
        .map(|(&g, &u)| {
            let g = (g as f64).min(LIMIT);
            let u = (u as f64).clamp(-LIMIT, LIMIT);
            ((u + 1.0) * g / (1.0 + (-ALPHA * g).exp())) as f32
        })
        .collect()
}

fn moe(r: &Reference, l: usize, h: &[f32], n: usize, tap: &mut dyn Tap) -> Result<Vec<f32>, ForwardError> {
    let c = &r.config;
    let moe = c
        .moe
        .as_ref()
        .ok_or_else(|| ForwardError::MissingTensor(format!("blk.{l}.ffn_gate_inp.weight (gpt-oss.expert_count)")))?;
    let (d, n_exp, eff) = (c.d_model, moe.n_experts, moe.expert_ffn);
    let router = r.matrix(&format!("blk.{l}.ffn_gate_inp.weight"), n_exp, d)?;
    emit_weight(tap, l, WeightKind::Router, &router);
    let logits = add_rows(
        linear(h, n, &router),
        &r.vector(&format!("blk.{l}.ffn_gate_inp.bias"), n_exp)?,
    );
    emit(tap, TapKey::layer(l, Site::MoeLogits), &logits, n);
    let routes: Vec<(Vec<usize>, Vec<f64>)> = logits.chunks(n_exp).map(|z| route(z, moe.n_used)).collect();
    let topk: Vec<f32> = routes.iter().flat_map(|(e, _)| e.iter().map(|&e| e as f32)).collect();
    emit(tap, TapKey::layer(l, Site::MoeTopk), &topk, n);

    let stacked = |s: &str, rows: usize, cols: usize| -> Result<(Vec<Mat>, Vec<f32>), ForwardError> {
        let t = r.tensor(&format!("blk.{l}.{s}.weight"))?;
        if t.ne != [cols as u64, rows as u64, n_exp as u64] {
            return Err(ForwardError::BadTensor {
                name: t.name.clone(),
                msg: format!("dims {:?}, expected {:?}", t.ne, [cols, rows, n_exp]),
            });
        }
        let mats = (0..n_exp)
            .map(|e| r.stored_rows(t, e * rows, rows))
            .collect::<Result<_, _>>()?;
        let b = r.load(&format!("blk.{l}.{s}.bias"), &[rows, n_exp])?;
        Ok((mats, b))
    };
    let (gates, bg) = stacked("ffn_gate_exps", eff, d)?;
    let (ups, bu) = stacked("ffn_up_exps", eff, d)?;
    let (downs, bd) = stacked("ffn_down_exps", d, eff)?;
    // Each routed expert's tokens, in expert order; the experts run in parallel and are mixed
    // below in expert order, so the sums are those of one expert after another.
    let used: Vec<(usize, Vec<(usize, f64)>)> = (0..n_exp)
        .map(|e| {
            let users: Vec<(usize, f64)> = routes
                .iter()
                .enumerate()
                .filter_map(|(t, (ex, w))| ex.iter().position(|&x| x == e).map(|i| (t, w[i])))
                .collect();
            (e, users)
        })
        .filter(|(_, users)| !users.is_empty())
        .collect();
    let ys: Vec<Vec<f32>> = used
        .par_iter()
        .map(|(e, users)| {
            let e = *e;
            let xs: Vec<f32> = users
                .iter()
                .flat_map(|&(t, _)| h[t * d..(t + 1) * d].iter().copied())
                .collect();
            let m = users.len();
            let g = add_rows(linear(&xs, m, &gates[e]), &bg[e * eff..(e + 1) * eff]);
            let u = add_rows(linear(&xs, m, &ups[e]), &bu[e * eff..(e + 1) * eff]);
            add_rows(linear(&swiglu_oai(&g, &u), m, &downs[e]), &bd[e * d..(e + 1) * d])
        })
        .collect();
    let mut out = vec![0f64; n * d];
    for ((_, users), y) in used.iter().zip(&ys) {
        for (i, &(t, w)) in users.iter().enumerate() {
            for j in 0..d {
                out[t * d + j] += w * y[i * d + j] as f64;
            }
        }
    }
    Ok(out.into_iter().map(|v| v as f32).collect())
}
