//! One deepseek2 block (DeepSeek-V2/V3, GLM-style): multi-head latent attention with kv_b
//! reassembled from attn_k_b/attn_v_b, then a dense SwiGLU FFN (leading layers) or a routed MoE
//! with a shared expert. Written from the GGUF conversion (llama.cpp's deepseek2 graph) and HF's modeling_deepseek_v3.py.

use super::{dense_ffn, emit, emit_weight, linear, ops, swiglu_ffn, ForwardError, Mat, Reference};
use crate::config::{Gating, MoeConfig};
use crate::tap::{Site, Tap, TapKey, WeightKind};
use rayon::prelude::*;

/// One block; `dsa` is the DSA indexer state for deepseek32 / glm-dsa (`None` for deepseek2).
pub(super) fn layer(
    r: &Reference,
    l: usize,
    x: Vec<f32>,
    n: usize,
    tap: &mut dyn Tap,
    dsa: Option<&mut super::dsa::DsaState>,
) -> Result<Vec<f32>, ForwardError> {
    let c = &r.config;
    let d = c.d_model;
    let name = |s: &str| format!("blk.{l}.{s}.weight");
    let h = ops::rms_norm(&x, d, &r.vector(&name("attn_norm"), d)?, c.rms_eps);
    emit(tap, TapKey::layer(l, Site::AttnNorm), &h, n);
    let attn = mla(r, l, &h, n, tap, dsa)?;
    let wo = r.matrix(&name("attn_output"), d, attn.len() / n)?;
    emit_weight(tap, l, WeightKind::O, &wo);
    let proj = linear(&attn, n, &wo);
    emit(tap, TapKey::layer(l, Site::AttnProj), &proj, n);
    let x = ops::add(&x, &proj);
    emit(tap, TapKey::layer(l, Site::ResidAttn), &x, n);

    let h = ops::rms_norm(&x, d, &r.vector(&name("ffn_norm"), d)?, c.rms_eps);
    emit(tap, TapKey::layer(l, Site::FfnNorm), &h, n);
    let out = match &c.moe {
        Some(moe) if c.is_moe_layer(l) => moe_ffn(r, l, moe, &h, n, tap)?,
        _ => dense_ffn(r, l, &h, n, tap)?,
    };
    emit(tap, TapKey::layer(l, Site::FfnOut), &out, n);
    let x = ops::add(&x, &out);
    emit(tap, TapKey::layer(l, Site::ResidOut), &x, n);
    Ok(x)
}

/// kv_b `[H·(nope+v), kv_lora]` from the llama.cpp split: k_b is stored per head transposed,
/// torch `[H, kv_lora, nope]` (ne {nope, kv_lora, H}); v_b is torch `[H, v, kv_lora]`.
/// kv_b = cat([k_bᵀ, v_b], dim=1).reshape(H·(nope+v), kv_lora).
pub fn reassemble_kv_b(
    k_b: &[f32],
    v_b: &[f32],
    n_heads: usize,
    nope: usize,
    v: usize,
    kv_lora: usize,
) -> Mat<'static> {
    let rows_per_head = nope + v;
    let mut data = vec![0f32; n_heads * rows_per_head * kv_lora];
    for h in 0..n_heads {
        for j in 0..nope {
            let row = &mut data[(h * rows_per_head + j) * kv_lora..(h * rows_per_head + j + 1) * kv_lora];
            for (ci, out) in row.iter_mut().enumerate() {
                *out = k_b[(h * kv_lora + ci) * nope + j];
            }
        }
        for i in 0..v {
            let dst = (h * rows_per_head + nope + i) * kv_lora;
            let src = (h * v + i) * kv_lora;
            data[dst..dst + kv_lora].copy_from_slice(&v_b[src..src + kv_lora]);
        }
    }
    Mat::from_f32(n_heads * rows_per_head, kv_lora, data)
}

/// Multi-head latent attention; returns the attention output `[n, H·v]` (before o_proj).
fn mla(
    r: &Reference,
    l: usize,
    h: &[f32],
    n: usize,
    tap: &mut dyn Tap,
    mut dsa: Option<&mut super::dsa::DsaState>,
) -> Result<Vec<f32>, ForwardError> {
    let c = &r.config;
    let m = c.mla.as_ref().expect("deepseek2 has MLA");
    let (d, nh) = (c.d_model, c.n_heads);
    let (nope, rope, dv, kvl) = (m.qk_nope, m.qk_rope, m.v_head_dim, m.kv_lora_rank);
    let dq = nope + rope;
    let name = |s: &str| format!("blk.{l}.{s}.weight");
    let key = |s: Site| TapKey::layer(l, s);

    // Queries (and, for the DSA families, the indexer's selection from the normed q_a).
    let mut selection = None;
    let mut q = match m.q_lora_rank {
        Some(ql) => {
            let wqa = r.matrix(&name("attn_q_a"), ql, d)?;
            let wqb = r.matrix(&name("attn_q_b"), nh * dq, ql)?;
            emit_weight(tap, l, WeightKind::QA, &wqa);
            emit_weight(tap, l, WeightKind::QB, &wqb);
            let qa = linear(h, n, &wqa);
            emit(tap, key(Site::QA), &qa, n);
            let qa = ops::rms_norm(&qa, ql, &r.vector(&name("attn_q_a_norm"), ql)?, c.rms_eps);
            if let Some(state) = dsa.as_deref_mut() {
                selection = Some(super::dsa::select(r, l, h, &qa, n, tap, state)?);
            }
            linear(&qa, n, &wqb)
        }
        None => {
            let wq = r.matrix(&name("attn_q"), nh * dq, d)?;
            emit_weight(tap, l, WeightKind::Q, &wq);
            linear(h, n, &wq)
        }
    };
    for (t, q_t) in q.chunks_mut(nh * dq).enumerate() {
        super::yarn::mla_rope(c, q_t, dq, nope, t, rope, false);
    }
    emit(tap, key(Site::Q), &q, n);

    // Latent and shared rope key.
    let wkva = r.matrix(&name("attn_kv_a_mqa"), kvl + rope, d)?;
    emit_weight(tap, l, WeightKind::KvA, &wkva);
    let kva = linear(h, n, &wkva);
    let mut latent = Vec::with_capacity(n * kvl);
    let mut k_pe = Vec::with_capacity(n * rope);
    for (t, row) in kva.chunks(kvl + rope).enumerate() {
        latent.extend_from_slice(&row[..kvl]);
        let mut pe = row[kvl..].to_vec();
        super::yarn::mla_rope(c, &mut pe, rope, 0, t, rope, false);
        k_pe.extend(pe);
    }
    let latent = ops::rms_norm(&latent, kvl, &r.vector(&name("attn_kv_a_norm"), kvl)?, c.rms_eps);
    emit(tap, key(Site::KvLatent), &latent, n);
    emit(tap, key(Site::KPe), &k_pe, n);

    // Per-head keys and values from kv_b.
    let k_b = r.load(&name("attn_k_b"), &[nope, kvl, nh])?;
    let v_b = r.load(&name("attn_v_b"), &[kvl, dv, nh])?;
    let kv_b = reassemble_kv_b(&k_b, &v_b, nh, nope, dv, kvl);
    emit_weight(tap, l, WeightKind::KvB, &kv_b);
    let kv = linear(&latent, n, &kv_b);
    let mut k_nope = Vec::with_capacity(n * nh * nope);
    let mut v = Vec::with_capacity(n * nh * dv);
    for head in kv.chunks(nope + dv) {
        k_nope.extend_from_slice(&head[..nope]);
        v.extend_from_slice(&head[nope..]);
    }
    emit(tap, key(Site::K), &k_nope, n);
    emit(tap, key(Site::V), &v, n);

    if dsa.is_some() && selection.is_none() {
        return Err(ForwardError::BadTensor {
            name: name("attn_q_a"),
            msg: "the DSA indexer needs q_a (q_lora_rank)".into(),
        });
    }
    let attn = mla_attention(c, &q, &k_nope, &k_pe, &v, n, selection.as_deref());
    emit(tap, key(Site::AttnOut), &attn, n);
    Ok(attn)
}

/// MLA attention from roped `q [n, H·(nope+rope)]`, `k_nope [n, H·nope]`, the shared roped
/// `k_pe [n, rope]` and `v [n, H·v]`: score = (q_nope·k_nope + q_pe·k_pe)·scale, over every
/// causal key, or over only `keys[t]` for query t (the DSA indexer's selection).
pub(crate) fn mla_attention(
    c: &crate::config::ModelConfig,
    q: &[f32],
    k_nope: &[f32],
    k_pe: &[f32],
    v: &[f32],
    n: usize,
    keys: Option<&[Vec<usize>]>,
) -> Vec<f32> {
    let m = c.mla.as_ref().expect("deepseek2 has MLA");
    let (nh, nope, rope, dv) = (c.n_heads, m.qk_nope, m.qk_rope, m.v_head_dim);
    let dq = nope + rope;
    // Full per-head keys [k_nope | k_pe] so one dot gives q_nope·k_nope + q_pe·k_pe.
    let mut k = Vec::with_capacity(n * nh * dq);
    for t in 0..n {
        for head in 0..nh {
            k.extend_from_slice(&k_nope[(t * nh + head) * nope..(t * nh + head + 1) * nope]);
            k.extend_from_slice(&k_pe[t * rope..(t + 1) * rope]);
        }
    }
    let mut scale = 1.0 / (dq as f64).sqrt();
    if let Some(y) = &c.yarn {
        // HF/llama.cpp: mscale = 0.1·mscale_all_dim·ln(factor) + 1, applied squared.
        let mscale = 1.0 + y.log_multiplier as f64 * (y.factor as f64).ln();
        scale *= mscale * mscale;
    }
    match keys {
        Some(keys) => super::dsa::sparse_attention(q, &k, v, n, nh, dq, dv, scale, keys),
        None => ops::causal_attention(q, &k, v, n, nh, nh, dq, dv, scale),
    }
}

/// The routed experts chosen for one token and their mixing weights.
#[derive(Clone, Debug, PartialEq)]
pub struct Routing {
    /// Ascending expert ids.
    pub experts: Vec<usize>,
    /// Weight of each id in `experts`.
    pub weights: Vec<f64>,
}

/// DeepSeek-V3 routing for one token's router logits.
pub fn route(logits: &[f32], moe: &MoeConfig, bias: Option<&[f32]>) -> Routing {
    let n_exp = moe.n_experts;
    let scores: Vec<f64> = match moe.gating {
        Gating::Sigmoid => logits.iter().map(|&z| 1.0 / (1.0 + (-(z as f64)).exp())).collect(),
        Gating::Softmax => {
            let mut s: Vec<f64> = logits.iter().map(|&z| z as f64).collect();
            ops::softmax(&mut s);
            s
        }
    };
    let mut choice: Vec<f64> = match bias {
        Some(b) => scores.iter().zip(b).map(|(s, &b)| s + b as f64).collect(),
        None => scores.clone(),
    };
    if moe.n_groups > 1 {
        let per_group = n_exp / moe.n_groups;
        let mut group_scores: Vec<(f64, usize)> = (0..moe.n_groups)
            .map(|g| {
                let mut s: Vec<f64> = choice[g * per_group..(g + 1) * per_group].to_vec();
                s.sort_by(|a, b| b.total_cmp(a));
                (s.iter().take(2).sum(), g)
            })
            .collect();
        group_scores.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        for &(_, g) in &group_scores[moe.n_groups_used..] {
            choice[g * per_group..(g + 1) * per_group]
                .iter_mut()
                .for_each(|v| *v = f64::NEG_INFINITY);
        }
    }
    let mut order: Vec<usize> = (0..n_exp).collect();
    order.sort_by(|&a, &b| choice[b].total_cmp(&choice[a]).then(a.cmp(&b)));
    let mut experts: Vec<usize> = order[..moe.n_used].to_vec();
    experts.sort_unstable();
    let mut weights: Vec<f64> = experts.iter().map(|&e| scores[e]).collect();
    if moe.weights_norm {
        let sum: f64 = weights.iter().sum();
        weights.iter_mut().for_each(|w| *w /= sum);
    }
    weights.iter_mut().for_each(|w| *w *= moe.weights_scale as f64);
    Routing { experts, weights }
}

impl Reference<'_> {
    /// The scores whose top-k picks layer `l`'s experts, from router logits `[n, n_experts]`
    /// (the `moe_logits` tap): the gating function's output plus the selection bias where the
    /// file has one (`exp_probs_b`), or the logits themselves for gpt-oss. `None` where the
    /// choice is not a plain top-k of per-expert scores (grouped routing that drops groups), or
    /// the layer has no MoE.
    pub fn routing_choice_scores(&self, l: usize, logits: &[f32]) -> Result<Option<Vec<Vec<f64>>>, ForwardError> {
        let c = &self.config;
        let Some(m) = c.moe.as_ref().filter(|_| c.is_moe_layer(l)) else {
            return Ok(None);
        };
        if m.n_experts == 0 || logits.len() % m.n_experts != 0 || (m.n_groups > 1 && m.n_groups_used < m.n_groups) {
            return Ok(None);
        }
        if c.arch == crate::config::Arch::GptOss {
            return Ok(Some(
                logits
                    .chunks(m.n_experts)
                    .map(|z| z.iter().map(|&v| v as f64).collect())
                    .collect(),
            ));
        }
        let bias_name = format!("blk.{l}.exp_probs_b.bias");
        let bias = match self.file.tensor(&bias_name) {
            Some(_) => Some(self.load(&bias_name, &[m.n_experts])?),
            None => None,
        };
        Ok(Some(
            logits
                .chunks(m.n_experts)
                .map(|z| {
                    let mut s: Vec<f64> = z.iter().map(|&v| v as f64).collect();
                    match m.gating {
                        Gating::Sigmoid => s.iter_mut().for_each(|v| *v = 1.0 / (1.0 + (-*v).exp())),
                        Gating::Softmax => ops::softmax(&mut s),
                    }
                    if let Some(b) = &bias {
                        s.iter_mut().zip(b).for_each(|(v, &b)| *v += b as f64);
                    }
                    s
                })
                .collect(),
        ))
    }
}

/// Expert parallelism's per-rank partial, in pieces: each token's routed experts and weights,
/// and any expert's SwiGLU output on every token, so a rank's partial (the sum over the experts
/// it holds of `weight × expert(token)` for the tokens routed there) can be rebuilt for any
/// expert placement, including a wrong one.
pub struct ExpertParts {
    /// Per token: its routed experts (ascending) and their weights.
    pub routes: Vec<Routing>,
}

impl Reference<'_> {
    /// Layer `l`'s routing from router logits `z` (`[n, n_experts]`, the `moe_logits` tap), as
    /// the MoE block routes: `None` where the layer has no routed experts of this kind (dense,
    /// gpt-oss) or `z` has the wrong size.
    pub fn expert_routes(&self, l: usize, z: &[f32], n: usize) -> Result<Option<ExpertParts>, ForwardError> {
        let c = &self.config;
        let Some(m) = c.moe.as_ref().filter(|_| c.is_moe_layer(l)) else {
            return Ok(None);
        };
        if c.arch == crate::config::Arch::GptOss || m.n_experts == 0 || z.len() != n * m.n_experts {
            return Ok(None);
        }
        let bias_name = format!("blk.{l}.exp_probs_b.bias");
        let bias = match self.file.tensor(&bias_name) {
            Some(_) => Some(self.load(&bias_name, &[m.n_experts])?),
            None => None,
        };
        Ok(Some(ExpertParts {
            routes: z.chunks(m.n_experts).map(|zt| route(zt, m, bias.as_deref())).collect(),
        }))
    }

    /// Routed expert `e` of layer `l` (its SwiGLU, unweighted) on every row of `h` (`[n, d]`,
    /// the ffn_norm output).
    pub fn expert_ffn(&self, l: usize, e: usize, h: &[f32], n: usize) -> Result<Vec<f32>, ForwardError> {
        let c = &self.config;
        let m = c.moe.as_ref().ok_or_else(|| ForwardError::BadTensor {
            name: format!("blk.{l}.ffn_gate_exps.weight"),
            msg: "not a MoE model".into(),
        })?;
        let [gate, up, down] = expert(self, l, e, c.d_model, m.expert_ffn)?;
        Ok(swiglu_ffn(h, n, &gate, &up, &down).2)
    }
}

/// One expert's SwiGLU matrices, sliced out of the stacked `*_exps` tensors.
fn expert<'a>(r: &Reference<'a>, l: usize, e: usize, d: usize, eff: usize) -> Result<[Mat<'a>; 3], ForwardError> {
    let slice = |s: &str, rows: usize, cols: usize| -> Result<Mat<'a>, ForwardError> {
        let t = r.tensor(&format!("blk.{l}.{s}.weight"))?;
        let want = [cols as u64, rows as u64, t.ne.get(2).copied().unwrap_or(0)];
        if t.ne.len() != 3 || t.ne[..2] != want[..2] || (want[2] as usize) <= e {
            return Err(ForwardError::BadTensor {
                name: t.name.clone(),
                msg: format!("dims {:?}, expert {e}", t.ne),
            });
        }
        r.stored_rows(t, e * rows, rows)
    };
    Ok([
        slice("ffn_gate_exps", eff, d)?,
        slice("ffn_up_exps", eff, d)?,
        slice("ffn_down_exps", d, eff)?,
    ])
}

pub(super) fn moe_ffn(
    r: &Reference,
    l: usize,
    moe: &MoeConfig,
    h: &[f32],
    n: usize,
    tap: &mut dyn Tap,
) -> Result<Vec<f32>, ForwardError> {
    let d = r.config.d_model;
    let n_exp = moe.n_experts;
    let router = r.matrix(&format!("blk.{l}.ffn_gate_inp.weight"), n_exp, d)?;
    emit_weight(tap, l, WeightKind::Router, &router);
    let logits = linear(h, n, &router);
    emit(tap, TapKey::layer(l, Site::MoeLogits), &logits, n);
    let bias_name = format!("blk.{l}.exp_probs_b.bias");
    let bias = match r.file.tensor(&bias_name) {
        Some(_) => Some(r.load(&bias_name, &[n_exp])?),
        None => None,
    };
    let routes: Vec<Routing> = logits.chunks(n_exp).map(|z| route(z, moe, bias.as_deref())).collect();
    let topk: Vec<f32> = routes
        .iter()
        .flat_map(|rt| rt.experts.iter().map(|&e| e as f32))
        .collect();
    emit(tap, TapKey::layer(l, Site::MoeTopk), &topk, n);
    moe_mix(r, l, moe, h, n, &routes)
}

/// The MoE layer's output on `h` (the ffn_norm output) for the given routes: the routed experts
/// weighted, plus the shared experts.
pub(super) fn moe_mix(
    r: &Reference,
    l: usize,
    moe: &MoeConfig,
    h: &[f32],
    n: usize,
    routes: &[Routing],
) -> Result<Vec<f32>, ForwardError> {
    let d = r.config.d_model;
    let (n_exp, eff) = (moe.n_experts, moe.expert_ffn);
    // Each routed expert's tokens, in expert order.
    let used: Vec<(usize, Vec<(usize, f64)>)> = (0..n_exp)
        .map(|e| {
            let users: Vec<(usize, f64)> = routes
                .iter()
                .enumerate()
                .filter_map(|(t, rt)| rt.experts.iter().position(|&x| x == e).map(|i| (t, rt.weights[i])))
                .collect();
            (e, users)
        })
        .filter(|(_, users)| !users.is_empty())
        .collect();
    // The experts run in parallel (each product parallel inside too); their outputs are mixed
    // below in expert order, so the sums are the same as one expert after another.
    let ys: Vec<Vec<f32>> = used
        .par_iter()
        .map(|(e, users)| {
            let [gate, up, down] = expert(r, l, *e, d, eff)?;
            let xs: Vec<f32> = users
                .iter()
                .flat_map(|&(t, _)| h[t * d..(t + 1) * d].iter().copied())
                .collect();
            Ok(swiglu_ffn(&xs, users.len(), &gate, &up, &down).2)
        })
        .collect::<Result<_, ForwardError>>()?;
    let mut out = vec![0f64; n * d];
    for ((_, users), y) in used.iter().zip(&ys) {
        for (i, &(t, w)) in users.iter().enumerate() {
            for j in 0..d {
                out[t * d + j] += w * y[i * d + j] as f64;
            }
        }
    }
    if moe.n_shared > 0 {
        let sh = eff * moe.n_shared;
        let name = |s: &str| format!("blk.{l}.{s}.weight");
        let gate = r.matrix(&name("ffn_gate_shexp"), sh, d)?;
        let up = r.matrix(&name("ffn_up_shexp"), sh, d)?;
        let down = r.matrix(&name("ffn_down_shexp"), d, sh)?;
        let (_, _, y) = swiglu_ffn(h, n, &gate, &up, &down);
        for (o, &v) in out.iter_mut().zip(&y) {
            *o += v as f64;
        }
    }
    Ok(out.into_iter().map(|v| v as f32).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kv_b_reassembly_transposes_k_b_only() {
        // 2 heads, nope 2, v 1, kv_lora 3. k_b stored [H, kv_lora, nope]; v_b [H, v, kv_lora].
        let (nh, nope, v, kvl) = (2, 2, 1, 3);
        let k_b: Vec<f32> = (0..nh * kvl * nope).map(|i| i as f32).collect();
        let v_b: Vec<f32> = (0..nh * v * kvl).map(|i| 100.0 + i as f32).collect();
        let m = reassemble_kv_b(&k_b, &v_b, nh, nope, v, kvl);
        assert_eq!((m.rows, m.cols), (6, 3));
        // Head 0, k row j=1: k_b[0][c][1] for c = 0..3 = 1, 3, 5.
        let data = m.to_f32();
        assert_eq!(&data[3..6], &[1.0, 3.0, 5.0]);
        // Head 0, v row: v_b[0][0][:].
        assert_eq!(&data[6..9], &[100.0, 101.0, 102.0]);
        // Head 1, k row j=0: k_b[1][c][0] = 6, 8, 10.
        assert_eq!(&data[9..12], &[6.0, 8.0, 10.0]);
    }

    fn moe(groups: usize, used_groups: usize) -> MoeConfig {
        MoeConfig {
            n_experts: 8,
            n_used: 2,
            n_shared: 0,
            expert_ffn: 4,
            n_dense_lead: 0,
            weights_scale: 2.0,
            weights_norm: true,
            gating: Gating::Sigmoid,
            n_groups: groups,
            n_groups_used: used_groups,
        }
    }

    #[test]
    fn routing_picks_top_k_and_normalizes() {
        let logits = [0.0, 3.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0];
        let rt = route(&logits, &moe(1, 1), None);
        assert_eq!(rt.experts, vec![1, 4]);
        assert!((rt.weights.iter().sum::<f64>() - 2.0).abs() < 1e-12);
    }

    #[test]
    fn group_limit_masks_weaker_groups_and_bias_only_steers() {
        // Groups of 2: {0,1} {2,3} {4,5} {6,7}. Group 0 has the two largest singles? No: group 3
        // has a higher sum of top-2.
        let logits = [3.0, -5.0, 0.0, 0.0, 0.0, 0.0, 2.0, 2.0];
        let rt = route(&logits, &moe(4, 1), None);
        assert_eq!(rt.experts, vec![6, 7]);
        // A bias that favours expert 2 moves the choice but not the weights' source.
        let bias = [0.0, 0.0, 5.0, 5.0, 0.0, 0.0, 0.0, 0.0];
        let rt = route(&logits, &moe(4, 1), Some(&bias));
        assert_eq!(rt.experts, vec![2, 3]);
        assert!(
            (rt.weights[0] - 1.0).abs() < 1e-12,
            "equal unbiased scores split the scale"
        );
    }
}
