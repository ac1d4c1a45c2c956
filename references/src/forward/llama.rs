//! One llama block: RMSNorm, q/k/v, NORM RoPE (with linear or Llama 3.1 `rope_freqs` scaling), causal GQA, o_proj, residual, SwiGLU FFN.

use super::{dense_ffn, emit, linear, ops, ForwardError, Reference};
use crate::tap::{Site, Tap, TapKey};

pub(super) fn layer(
    r: &Reference,
    l: usize,
    x: Vec<f32>,
    n: usize,
    tap: &mut dyn Tap,
) -> Result<Vec<f32>, ForwardError> {
    let c = &r.config;
    let (d, hd, nh, nkv) = (c.d_model, c.head_dim, c.n_heads, c.n_kv_heads);
    let name = |s: &str| format!("blk.{l}.{s}.weight");
    let key = |s: Site| TapKey::layer(l, s);

    let [wq, wk, wv, wo] = super::attn_weights(r, l, tap)?;

    let h = ops::rms_norm(&x, d, &r.vector(&name("attn_norm"), d)?, c.rms_eps);
    emit(tap, key(Site::AttnNorm), &h, n);
    let mut q = linear(&h, n, &wq);
    let mut k = linear(&h, n, &wk);
    let v = linear(&h, n, &wv);
    let freq_factors = if c.rope_scaling.freq_factors {
        Some(r.vector("rope_freqs.weight", c.rope_dim / 2)?)
    } else {
        None
    };
    let divisor = c.rope_scaling.linear_factor.map_or(1.0, |f| f as f64);
    for (t, (q_t, k_t)) in q.chunks_mut(nh * hd).zip(k.chunks_mut(nkv * hd)).enumerate() {
        for row in [q_t, k_t] {
            ops::rope_norm_scaled(row, hd, 0, t, c.rope_dim, c.rope_base, divisor, freq_factors.as_deref());
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

    let h = ops::rms_norm(&x, d, &r.vector(&name("ffn_norm"), d)?, c.rms_eps);
    emit(tap, key(Site::FfnNorm), &h, n);
    let out = dense_ffn(r, l, &h, n, tap)?;
    emit(tap, key(Site::FfnOut), &out, n);
    let x = ops::add(&x, &out);
    emit(tap, key(Site::ResidOut), &x, n);
    Ok(x)
}
