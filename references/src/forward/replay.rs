//! Op isolation: re-run one reference op on inputs taken from elsewhere (the engine's own
//! captured taps), to tell an op that introduced an error from one that only propagated it.

use super::{deepseek2, linear, ops, swiglu_ffn, ForwardError, Reference};
use crate::config::Arch;
use crate::tap::{Site, TapKey};

/// Inputs by (unranked) tap key; `None` when the capture does not have that tap.
pub type Inputs<'a> = dyn Fn(&TapKey) -> Option<Vec<f32>> + 'a;

impl Reference<'_> {
    /// The reference op that produces `key` (unranked), computed from `inputs` over `n` tokens.
    /// `Ok(None)` when the op is not replayable here or an input is missing.
    pub fn replay(&self, key: &TapKey, inputs: &Inputs, n: usize) -> Result<Option<Vec<f32>>, ForwardError> {
        let c = &self.config;
        let d = c.d_model;
        let Some(l) = key.layer.map(|l| l as usize) else {
            return Ok(match key.site {
                Site::OutputNorm => {
                    let x = match inputs(&TapKey::layer(c.n_layers - 1, Site::ResidOut)) {
                        Some(x) => x,
                        None => return Ok(None),
                    };
                    Some(ops::rms_norm(&x, d, &self.vector("output_norm.weight", d)?, c.rms_eps))
                }
                _ => None,
            });
        };
        let at = |s: Site| inputs(&TapKey::layer(l, s));
        let resid_in = || {
            if l == 0 {
                inputs(&TapKey::global(Site::Embed))
            } else {
                inputs(&TapKey::layer(l - 1, Site::ResidOut))
            }
        };
        let name = |s: &str| format!("blk.{l}.{s}.weight");
        let out = match key.site {
            Site::AttnNorm => resid_in().map(|x| (x, "attn_norm")),
            Site::FfnNorm => at(Site::ResidAttn).map(|x| (x, "ffn_norm")),
            _ => None,
        };
        if let Some((x, norm)) = out {
            return Ok(Some(ops::rms_norm(&x, d, &self.vector(&name(norm), d)?, c.rms_eps)));
        }
        Ok(match key.site {
            Site::ResidAttn => match (resid_in(), at(Site::AttnProj)) {
                (Some(x), Some(p)) => Some(ops::add(&x, &p)),
                _ => None,
            },
            Site::ResidOut => match (at(Site::ResidAttn), at(Site::FfnOut)) {
                (Some(x), Some(f)) => Some(ops::add(&x, &f)),
                _ => None,
            },
            Site::AttnProj => match at(Site::AttnOut) {
                Some(a) => {
                    let width = a.len() / n;
                    Some(linear(&a, n, &self.matrix(&name("attn_output"), d, width)?))
                }
                None => None,
            },
            Site::FfnOut if !c.is_moe_layer(l) => match at(Site::FfnNorm) {
                Some(h) => {
                    let f = c.ffn_dim;
                    let gate = self.matrix(&name("ffn_gate"), f, d)?;
                    let up = self.matrix(&name("ffn_up"), f, d)?;
                    let down = self.matrix(&name("ffn_down"), d, f)?;
                    Some(swiglu_ffn(&h, n, &gate, &up, &down).2)
                }
                None => None,
            },
            Site::AttnOut => match (c.arch, at(Site::Q), at(Site::K), at(Site::V)) {
                (Arch::Llama, Some(q), Some(k), Some(v)) => {
                    let hd = c.head_dim;
                    Some(ops::causal_attention(
                        &q,
                        &k,
                        &v,
                        n,
                        c.n_heads,
                        c.n_kv_heads,
                        hd,
                        hd,
                        1.0 / (hd as f64).sqrt(),
                    ))
                }
                (Arch::Deepseek2, Some(q), Some(k_nope), Some(v)) => {
                    at(Site::KPe).map(|k_pe| deepseek2::mla_attention(c, &q, &k_nope, &k_pe, &v, n, None))
                }
                // DSA: the attention is replayed on the recorded selection (the candidate's own
                // indices), so it is judged apart from the indexer.
                (Arch::Deepseek32 | Arch::GlmDsa, Some(q), Some(k_nope), Some(v)) => {
                    match (at(Site::KPe), at(Site::IndexerTopk)) {
                        (Some(k_pe), Some(sel)) => super::dsa::selection_from_tap(&sel, n)
                            .map(|keys| deepseek2::mla_attention(c, &q, &k_nope, &k_pe, &v, n, Some(&keys))),
                        _ => None,
                    }
                }
                _ => None,
            },
            _ => None,
        })
    }
}
