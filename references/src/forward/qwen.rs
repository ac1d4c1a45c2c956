//! One qwen2 / qwen3 / qwen3moe block, as HF's modeling_qwen2/qwen3/qwen3_moe.py compute it and
//! llama.cpp's converter stores it: RMSNorm, q/k/v (qwen2: with biases), per-head q/k RMSNorm
//! (qwen3, qwen3moe), NeoX RoPE (halves, no permutation in the file), causal GQA, o_proj,
//! residual, then a dense SwiGLU FFN or (qwen3moe) softmax-routed experts with the top-k weights
//! renormalised. [`gqa_block`] is shared with glm4moe, which adds partial rotary and a shared expert.

use super::{dense_ffn, emit, linear, ops, ForwardError, Reference};
use crate::config::Arch;
use crate::tap::{Site, Tap, TapKey};

pub(super) fn layer(
    r: &Reference,
    l: usize,
    x: Vec<f32>,
    n: usize,
    tap: &mut dyn Tap,
) -> Result<Vec<f32>, ForwardError> {
    gqa_block(r, l, x, n, tap, "ffn_norm")
}

/// Adds `bias` (when the file has `name`) to every row of `y`.
pub(super) fn add_bias(r: &Reference, name: &str, y: &mut [f32], width: usize) -> Result<(), ForwardError> {
    if r.file.tensor(name).is_some() {
        let b = r.vector(name, width)?;
        for row in y.chunks_mut(width) {
            for (v, &bv) in row.iter_mut().zip(&b) {
                *v = (*v as f64 + bv as f64) as f32;
            }
        }
    }
    Ok(())
}

/// Per-head RMSNorm of `y` (`[n, heads·hd]`) by `name` (`[hd]`), when the file has it or the
/// architecture requires it (qwen3, qwen3moe: as llama.cpp's loader, a missing norm is an error).
pub(super) fn head_norm(r: &Reference, name: &str, y: Vec<f32>, hd: usize) -> Result<Vec<f32>, ForwardError> {
    let required = matches!(r.config.arch, Arch::Qwen3 | Arch::Qwen3Moe);
    if r.file.tensor(name).is_none() && !required {
        return Ok(y);
    }
    Ok(ops::rms_norm(&y, hd, &r.vector(name, hd)?, r.config.rms_eps))
}

/// The GQA block of qwen2/3, qwen3moe and glm4moe: the optional parts (q/k/v biases, q/k norms,
/// experts, a shared expert, a router bias) are used when the file has them (the allowlist says
/// which each architecture may have); `ffn_norm` names the pre-FFN norm tensor.
pub(super) fn gqa_block(
    r: &Reference,
    l: usize,
    x: Vec<f32>,
    n: usize,
    tap: &mut dyn Tap,
    ffn_norm: &str,
) -> Result<Vec<f32>, ForwardError> {
    let c = &r.config;
    let (d, hd, nh, nkv) = (c.d_model, c.head_dim, c.n_heads, c.n_kv_heads);
    let name = |s: &str| format!("blk.{l}.{s}.weight");
    let bias = |s: &str| format!("blk.{l}.{s}.bias");
    let key = |s: Site| TapKey::layer(l, s);

    let [wq, wk, wv, wo] = super::attn_weights(r, l, tap)?;

    let h = ops::rms_norm(&x, d, &r.vector(&name("attn_norm"), d)?, c.rms_eps);
    emit(tap, key(Site::AttnNorm), &h, n);
    let mut q = linear(&h, n, &wq);
    let mut k = linear(&h, n, &wk);
    let mut v = linear(&h, n, &wv);
    add_bias(r, &bias("attn_q"), &mut q, nh * hd)?;
    add_bias(r, &bias("attn_k"), &mut k, nkv * hd)?;
    add_bias(r, &bias("attn_v"), &mut v, nkv * hd)?;
    let mut q = head_norm(r, &name("attn_q_norm"), q, hd)?;
    let mut k = head_norm(r, &name("attn_k_norm"), k, hd)?;
    for (t, (q_t, k_t)) in q.chunks_mut(nh * hd).zip(k.chunks_mut(nkv * hd)).enumerate() {
        for row in [q_t, k_t] {
            ops::rope_neox(row, hd, t, c.rope_dim, c.rope_base);
        }
    }
    emit(tap, key(Site::Q), &q, n);
    emit(tap, key(Site::K), &k, n);
    emit(tap, key(Site::V), &v, n);
    let attn = ops::causal_attention(&q, &k, &v, n, nh, nkv, hd, hd, 1.0 / (hd as f64).sqrt());
    emit(tap, key(Site::AttnOut), &attn, n);
    let proj = linear(&attn, n, &wo);
    emit(tap, key(Site::AttnProj), &proj, n);
    let x = ops::add(&x, &proj);
    emit(tap, key(Site::ResidAttn), &x, n);

    let h = ops::rms_norm(&x, d, &r.vector(&name(ffn_norm), d)?, c.rms_eps);
    emit(tap, key(Site::FfnNorm), &h, n);
    let out = match &c.moe {
        Some(moe) if c.is_moe_layer(l) => super::deepseek2::moe_ffn(r, l, moe, &h, n, tap)?,
        _ => dense_ffn(r, l, &h, n, tap)?,
    };
    emit(tap, key(Site::FfnOut), &out, n);
    let x = ops::add(&x, &out);
    emit(tap, key(Site::ResidOut), &x, n);
    Ok(x)
}
