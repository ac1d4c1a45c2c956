//! One gemma2 / gemma3 block, as HF's modeling_gemma2/gemma3.py compute it and llama.cpp's
//! converter stores it (Gemma's `1 + w` RMSNorm weights are stored with the `+1` already folded
//! in, so the norms here are plain RMSNorms): RMSNorm, q/k/v, per-head q/k RMSNorm (gemma3),
//! NeoX RoPE (gemma3's sliding-window layers with the local base), causal GQA scaled by
//! [`crate::config::FamilyExtras::attn_scale`] or 1/√head_dim, scores soft-capped (gemma2),
//! a sliding window on the local layers, o_proj, post-attention RMSNorm, residual, pre-FFN
//! RMSNorm, GeGLU (GELU-tanh) FFN, post-FFN RMSNorm, residual. The √d_model embedding scale and
//! the final-logit soft-capping are applied around the blocks by [`super::Reference::forward`].
//!
//! Taps: `attn_proj` and `ffn_out` are the post-normed outputs, the values added to the residual.

use super::{emit, emit_weight, linear, ops, ForwardError, Reference};
use crate::config::Arch;
use crate::tap::{Site, Tap, TapKey, WeightKind};

pub(super) fn layer(
    r: &Reference,
    l: usize,
    x: Vec<f32>,
    n: usize,
    tap: &mut dyn Tap,
) -> Result<Vec<f32>, ForwardError> {
    let c = &r.config;
    let fam = &c.family;
    let (d, hd, nh, nkv, f) = (c.d_model, c.head_dim, c.n_heads, c.n_kv_heads, c.ffn_dim);
    let name = |s: &str| format!("blk.{l}.{s}.weight");
    let key = |s: Site| TapKey::layer(l, s);
    let norm = |t: &[f32], s: &str| -> Result<Vec<f32>, ForwardError> {
        Ok(ops::rms_norm(t, d, &r.vector(&name(s), d)?, c.rms_eps))
    };

    let [wq, wk, wv, wo] = super::attn_weights(r, l, tap)?;
    let gate = r.matrix(&name("ffn_gate"), f, d)?;
    let up = r.matrix(&name("ffn_up"), f, d)?;
    let down = r.matrix(&name("ffn_down"), d, f)?;
    for (kind, w) in [
        (WeightKind::Gate, &gate),
        (WeightKind::Up, &up),
        (WeightKind::Down, &down),
    ] {
        emit_weight(tap, l, kind, w);
    }

    let h = norm(&x, "attn_norm")?;
    emit(tap, key(Site::AttnNorm), &h, n);
    let mut q = linear(&h, n, &wq);
    let mut k = linear(&h, n, &wk);
    let v = linear(&h, n, &wv);
    for (s, y) in [("attn_q_norm", &mut q), ("attn_k_norm", &mut k)] {
        // gemma3 requires its q/k norms (as llama.cpp's loader); gemma2 has none.
        if c.arch == Arch::Gemma3 || r.file.tensor(&name(s)).is_some() {
            *y = ops::rms_norm(y, hd, &r.vector(&name(s), hd)?, c.rms_eps);
        }
    }
    let swa = fam.is_swa(l);
    let base = if swa { fam.rope_base_swa } else { c.rope_base };
    for (t, (q_t, k_t)) in q.chunks_mut(nh * hd).zip(k.chunks_mut(nkv * hd)).enumerate() {
        for row in [q_t, k_t] {
            ops::rope_neox(row, hd, t, c.rope_dim, base);
        }
    }
    emit(tap, key(Site::Q), &q, n);
    emit(tap, key(Site::K), &k, n);
    emit(tap, key(Site::V), &v, n);
    let mask = ops::AttnMask {
        window: if swa { fam.sliding_window } else { None },
        softcap: fam.attn_softcap.map(|s| s as f64),
        sinks: None,
    };
    let scale = fam.attn_scale.unwrap_or(1.0 / (hd as f64).sqrt());
    let attn = ops::causal_attention_masked(&q, &k, &v, n, nh, nkv, hd, hd, scale, mask);
    emit(tap, key(Site::AttnOut), &attn, n);
    let proj = norm(&linear(&attn, n, &wo), "post_attention_norm")?;
    emit(tap, key(Site::AttnProj), &proj, n);
    let x = ops::add(&x, &proj);
    emit(tap, key(Site::ResidAttn), &x, n);

    let h = norm(&x, "ffn_norm")?;
    emit(tap, key(Site::FfnNorm), &h, n);
    let g = linear(&h, n, &gate);
    let u = linear(&h, n, &up);
    emit(tap, key(Site::FfnGate), &g, n);
    emit(tap, key(Site::FfnUp), &u, n);
    let out = norm(&linear(&ops::geglu(&g, &u), n, &down), "post_ffw_norm")?;
    emit(tap, key(Site::FfnOut), &out, n);
    let x = ops::add(&x, &out);
    emit(tap, key(Site::ResidOut), &x, n);
    Ok(x)
}
