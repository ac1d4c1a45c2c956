//! Model hyper-parameters read from GGUF metadata: the llama family, deepseek2 (MLA + MoE) and
//! the GQA/MoE families (qwen2, qwen3, qwen3moe, glm4moe, gemma2, gemma3, gpt-oss; their extras in
//! [`FamilyExtras`]).
//! Both the reference and the engine build their models from a [`ModelConfig`], so a
//! `config-drift` fault is a deliberate difference between two of these, never an accident.

use crate::gguf::{GgufHeader, MetaValue};

pub use crate::arch::{Arch, ConfigError};

/// MoE router scoring function (`expert_gating_func`: 1 softmax, 2 sigmoid).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    Softmax,
    Sigmoid,
}

/// Multi-head latent attention dims (deepseek2).
#[derive(Clone, Debug, PartialEq)]
pub struct MlaConfig {
    /// `None` when the model has a plain attn_q instead of q_a/q_b.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope: usize,
    pub qk_rope: usize,
    pub v_head_dim: usize,
}

/// Mixture-of-experts routing and sizes.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub n_experts: usize,
    pub n_used: usize,
    pub n_shared: usize,
    pub expert_ffn: usize,
    /// The first `n_dense_lead` layers use a dense FFN.
    pub n_dense_lead: usize,
    pub weights_scale: f32,
    pub weights_norm: bool,
    pub gating: Gating,
    pub n_groups: usize,
    pub n_groups_used: usize,
}

/// The DSA lightning indexer (deepseek32, glm-dsa): per query, score every causal key with
/// `Σ_h w_h·relu(q_h·k)` (q from q_b on the normed q_a, one LayerNorm'd key per token, w from
/// weights_proj, scaled 1/sqrt(head_dim·n_heads)) and attend only to the `top_k` best.
#[derive(Clone, Debug, PartialEq)]
pub struct IndexerConfig {
    pub n_heads: usize,
    pub head_dim: usize,
    pub top_k: usize,
    /// Per layer: true for a `full` indexer layer, false for a `shared` one that reuses the
    /// previous full layer's selection (GLM-5.x; all full when the file has no types array).
    pub full: Vec<bool>,
    /// RoPE on the first rope-dim entries of each indexer head: NeoX halves (deepseek32) or
    /// interleaved pairs (glm-dsa), as llama-cpp-python 0.3.36's vendored llama.cpp builds them.
    pub rope_neox: bool,
    /// The key LayerNorm's epsilon (1e-6, HF's value; llama.cpp's deepseek32 loader fixes it too).
    pub k_norm_eps: f32,
}

/// YaRN rope scaling, the one representation for every source: GGUF
/// (`{arch}.rope.scaling.type = yarn` and `rope.scaling.{factor, original_context_length,
/// yarn_beta_fast, yarn_beta_slow, yarn_attn_factor, yarn_log_multiplier}`) and HF's
/// `rope_scaling` / `rope_parameters` (`factor`, `original_max_position_embeddings`,
/// `beta_fast`, `beta_slow`, `attention_factor`, `mscale_all_dim`, `truncate`). The frequencies
/// and the cos/sin factor are HF's `_compute_yarn_parameters` ([`YarnConfig::inv_freq`],
/// [`YarnConfig::attention_factor`]).
#[derive(Clone, Debug, PartialEq)]
pub struct YarnConfig {
    pub factor: f32,
    pub original_context: usize,
    /// 0.1·mscale_all_dim, as llama.cpp stores it for deepseek2 (MLA families: the softmax
    /// scale is multiplied by (1 + log_multiplier·ln factor)²).
    pub log_multiplier: f32,
    /// The ramp's bounds in rotations (HF defaults 32 and 1).
    pub beta_fast: f32,
    pub beta_slow: f32,
    /// HF's `attention_factor` when given explicitly (GGUF `yarn_attn_factor`); else it is
    /// derived from the factor (see [`YarnConfig::attention_factor`]).
    pub attn_factor: Option<f32>,
    /// HF's `truncate`: round the ramp's bounds to whole dims (HF's default). GGUF cannot say:
    /// the released gpt-oss configs set it false, so gpt-oss files take false; llama.cpp
    /// always truncates.
    pub truncate: bool,
}

impl YarnConfig {
    /// Per rotary pair i of a `dim`-wide rotary part with base `base`: HF's YaRN inverse
    /// frequency, `interp·(1 − e_i) + extrap·e_i` with `extrap = base^(−2i/dim)`,
    /// `interp = extrap / factor` and `e_i = 1 − clamp((i − low) / (high − low), 0, 1)` between
    /// the correction dims of `beta_fast` and `beta_slow` at the original context.
    pub fn inv_freq(&self, base: f64, dim: usize) -> Vec<f64> {
        let d = dim as f64;
        let corr =
            |rot: f64| d * (self.original_context as f64 / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln());
        let (mut low, mut high) = (corr(self.beta_fast as f64), corr(self.beta_slow as f64));
        if self.truncate {
            low = low.floor();
            high = high.ceil();
        }
        let (low, mut high) = (low.max(0.0), high.min(d - 1.0));
        if low == high {
            high += 0.001;
        }
        (0..dim / 2)
            .map(|i| {
                let extrap = base.powf(-((2 * i) as f64) / d);
                let interp = extrap / self.factor as f64;
                let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                let e = 1.0 - ramp;
                interp * (1.0 - e) + extrap * e
            })
            .collect()
    }

    /// The factor on cos and sin (so on q and k): the explicit `attn_factor`, else
    /// `0.1·ln(factor) + 1` (HF's `yarn_get_mscale`; 1 at factor ≤ 1). MLA families take 1:
    /// their files (and llama.cpp) assume `mscale = mscale_all_dim`, which cancels it, and scale
    /// the softmax by [`YarnConfig::log_multiplier`] instead.
    pub fn attention_factor(&self, mla: bool) -> f64 {
        match (self.attn_factor, mla) {
            (Some(a), _) => a as f64,
            (None, true) => 1.0,
            (None, false) if self.factor <= 1.0 => 1.0,
            (None, false) => 0.1 * (self.factor as f64).ln() + 1.0,
        }
    }
}

/// RoPE frequency scaling of the llama family (beyond `rope.freq_base`), as llama.cpp applies it:
/// θ_i = pos · base^(−2i/rope_dim) / (linear_factor · freq_factor_i).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RopeScaling {
    /// `rope.scaling.type = "linear"`: every angle divided by `rope.scaling.factor`.
    pub linear_factor: Option<f32>,
    /// Llama 3.1+: the file has `rope_freqs.weight` (`[rope_dim / 2]` f32), the per-pair divisors
    /// llama.cpp's converter derives from HF's `rope_type = "llama3"` (factor, low/high frequency
    /// factors, original context). The forward passes read the tensor itself.
    pub freq_factors: bool,
}

impl RopeScaling {
    /// True when RoPE is the plain `base^(−2i/d)` rotation.
    pub fn is_none(&self) -> bool {
        self.linear_factor.is_none() && !self.freq_factors
    }
}

/// What the GQA/MoE families add beyond llama's block (all off for llama and deepseek2).
///
/// Values llama.cpp's loader fixes that are not in the file, taken as it takes them (llama.cpp
/// as vendored by llama-cpp-python 0.3.36, `src/models/{gemma2,gemma3,qwen3moe}.cpp`):
/// - gemma2/gemma3 attention scale: 1/√head_dim, except 1/√(d_model / n_heads) for the 27B
///   models (46 gemma2 layers, 62 gemma3 layers);
/// - gemma2's sliding-window layers: every 2nd, starting with layer 0 (`il % 2 < 1`);
///   gemma3's: all but every 6th (`il % 6 < 5`); a window of 4096 when gemma2's file has none;
/// - gemma3's local RoPE base: `rope.freq_base_swa`, else `rope.freq_base`;
/// - gpt-oss's sliding-window layers: every 2nd, starting with layer 0; its clamped SwiGLU's
///   α = 1.702 and limit 7 (llama.cpp's `LLM_FFN_SWIGLU_OAI_MOE`);
/// - qwen3moe renormalises its top-k routing weights (`norm_topk_prob`) unconditionally.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FamilyExtras {
    /// Sliding-window length: a layer marked in `swa_layers` masks keys with q − k ≥ window.
    pub sliding_window: Option<usize>,
    /// Per layer: true for a sliding-window (local) layer.
    pub swa_layers: Vec<bool>,
    /// RoPE base of the sliding-window layers (gemma3's local base; 0 without a window).
    pub rope_base_swa: f32,
    /// Attention-score soft-capping `c·tanh(s/c)` (gemma2).
    pub attn_softcap: Option<f32>,
    /// Final-logit soft-capping `c·tanh(z/c)` (gemma2, gemma3 when set).
    pub final_softcap: Option<f32>,
    /// Attention scale when it is not 1/√head_dim (gemma 27B).
    pub attn_scale: Option<f64>,
}

impl FamilyExtras {
    /// True when layer `l` is a sliding-window layer.
    pub fn is_swa(&self, l: usize) -> bool {
        self.sliding_window.is_some() && self.swa_layers.get(l).copied().unwrap_or(false)
    }
}

/// Everything a forward pass needs to know about a model's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub n_layers: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// Per-head dim of q/k for llama (d_model / n_heads).
    pub head_dim: usize,
    /// Dense FFN hidden size.
    pub ffn_dim: usize,
    pub vocab: usize,
    pub rms_eps: f32,
    pub rope_base: f32,
    pub rope_dim: usize,
    pub context_length: usize,
    /// True when there is no `output` tensor and token_embd is reused.
    pub tied_embeddings: bool,
    pub mla: Option<MlaConfig>,
    pub moe: Option<MoeConfig>,
    pub yarn: Option<YarnConfig>,
    /// Llama-family frequency scaling (linear, `rope_freqs`); default for deepseek2.
    pub rope_scaling: RopeScaling,
    /// The GQA/MoE families' extras (default for llama and deepseek2).
    pub family: FamilyExtras,
    /// The DSA indexer (deepseek32, glm-dsa); `None` for the other families.
    pub indexer: Option<IndexerConfig>,
    /// MTP/nextn blocks the file appends after the `n_layers` model layers
    /// (`nextn_predict_layers`): a speculative-decoding head, never run.
    pub nextn_layers: usize,
}

struct Meta<'a> {
    h: &'a GgufHeader,
    arch: &'static str,
}

impl Meta<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }
    fn opt(&self, k: &str) -> Option<&MetaValue> {
        self.h.get(&self.key(k))
    }
    fn usize_opt(&self, k: &str) -> Result<Option<usize>, ConfigError> {
        match self.opt(k) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .filter(|&x| x < (1 << 32))
                .map(Some)
                .ok_or_else(|| ConfigError::Bad {
                    key: self.key(k),
                    msg: format!("expected a count, got {v}"),
                }),
        }
    }
    fn usize(&self, k: &str) -> Result<usize, ConfigError> {
        self.usize_opt(k)?.ok_or_else(|| ConfigError::Missing(self.key(k)))
    }
    fn f32_or(&self, k: &str, default: f32) -> Result<f32, ConfigError> {
        match self.opt(k) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .map(|x| x as f32)
                .filter(|x| x.is_finite())
                .ok_or_else(|| ConfigError::Bad {
                    key: self.key(k),
                    msg: format!("expected a finite number, got {v}"),
                }),
        }
    }
}

impl ModelConfig {
    /// Reads the config of a llama or deepseek2 GGUF.
    pub fn from_header(h: &GgufHeader) -> Result<ModelConfig, ConfigError> {
        let arch = crate::allowlist::arch_of(h)?;
        crate::allowlist::check(h)?;
        let prefix = arch.name();
        let m = Meta { h, arch: prefix };
        let block_count = m.usize("block_count")?;
        // deepseek2 files may append the MTP/nextn block(s) after the model's layers.
        let nextn = match arch {
            Arch::Deepseek2 | Arch::Deepseek32 | Arch::GlmDsa | Arch::Glm4Moe => {
                m.usize_opt("nextn_predict_layers")?.unwrap_or(0)
            }
            _ => 0,
        };
        if nextn >= block_count && block_count > 0 {
            return Err(ConfigError::Bad {
                key: m.key("nextn_predict_layers"),
                msg: format!("{nextn} leaves none of the {block_count} blocks to the model"),
            });
        }
        let n_layers = block_count.saturating_sub(nextn);
        let d_model = m.usize("embedding_length")?;
        let n_heads = m.usize("attention.head_count")?;
        let n_kv_heads = m.usize_opt("attention.head_count_kv")?.unwrap_or(n_heads);
        let ffn_dim = m.usize("feed_forward_length")?;
        let embd = h
            .tensor("token_embd.weight")
            .ok_or_else(|| ConfigError::Missing("tensor token_embd.weight".into()))?;
        let vocab = match m.usize_opt("vocab_size")? {
            Some(v) => v,
            None => *embd.ne.get(1).unwrap_or(&0) as usize,
        };
        let nonzero = |k: &str, v: usize| {
            if v == 0 {
                Err(ConfigError::Bad {
                    key: m.key(k),
                    msg: "must be > 0".into(),
                })
            } else {
                Ok(v)
            }
        };
        nonzero("block_count", n_layers)?;
        nonzero("embedding_length", d_model)?;
        nonzero("attention.head_count", n_heads)?;
        nonzero("attention.head_count_kv", n_kv_heads)?;
        nonzero("vocab_size", vocab)?;
        if n_heads % n_kv_heads != 0 {
            return Err(ConfigError::Bad {
                key: m.key("attention.head_count_kv"),
                msg: format!("{n_kv_heads} does not divide head_count {n_heads}"),
            });
        }
        let head_dim = match m.usize_opt("attention.key_length")? {
            Some(k) if !arch.is_mla() => k,
            _ => d_model / n_heads,
        };
        if !arch.is_mla() {
            if let Some(v) = m.usize_opt("attention.value_length")? {
                if v != head_dim {
                    return Err(ConfigError::Bad {
                        key: m.key("attention.value_length"),
                        msg: format!("{v} differs from the key length {head_dim}: not implemented"),
                    });
                }
            }
        }
        let rms_eps = m.f32_or("attention.layer_norm_rms_epsilon", 1e-5)?;
        let rope_base = m.f32_or("rope.freq_base", 10000.0)?;
        let context_length = m.usize_opt("context_length")?.unwrap_or(4096);
        let tied_embeddings = h.tensor("output.weight").is_none();

        let (mla, moe, rope_dim) = match arch {
            Arch::Llama | Arch::Qwen2 | Arch::Qwen3 | Arch::Gemma2 | Arch::Gemma3 => {
                (None, None, m.usize_opt("rope.dimension_count")?.unwrap_or(head_dim))
            }
            // qwen3moe: llama.cpp's graph passes norm_w = true (norm_topk_prob) unconditionally.
            Arch::Qwen3Moe => (
                None,
                moe_config(&m, Gating::Softmax, true)?,
                m.usize_opt("rope.dimension_count")?.unwrap_or(head_dim),
            ),
            // gpt-oss: its routing (softmax over the top-k logits) is gpt_oss.rs' own.
            Arch::GptOss => (
                None,
                moe_config(&m, Gating::Softmax, false)?,
                m.usize_opt("rope.dimension_count")?.unwrap_or(head_dim),
            ),
            // glm4moe: sigmoid gating unless the file says otherwise (llama.cpp's loader).
            Arch::Glm4Moe => (
                None,
                moe_config(&m, Gating::Sigmoid, false)?,
                m.usize_opt("rope.dimension_count")?.unwrap_or(head_dim),
            ),
            Arch::Deepseek2 | Arch::Deepseek32 | Arch::GlmDsa => {
                let qk_rope = m.usize("rope.dimension_count")?;
                let qk_head = match m.usize_opt("attention.key_length_mla")? {
                    Some(k) => k,
                    None => m.usize("attention.key_length")?,
                };
                let v_head_dim = match m.usize_opt("attention.value_length_mla")? {
                    Some(v) => v,
                    None => m.usize("attention.value_length")?,
                };
                if qk_rope > qk_head || qk_rope % 2 != 0 {
                    return Err(ConfigError::Bad {
                        key: m.key("rope.dimension_count"),
                        msg: format!("rope dim {qk_rope} must be even and at most the key length {qk_head}"),
                    });
                }
                let q_lora_rank = m.usize_opt("attention.q_lora_rank")?.filter(|&r| r > 0);
                let kv_lora_rank = m.usize("attention.kv_lora_rank")?;
                let mla = MlaConfig {
                    q_lora_rank,
                    kv_lora_rank,
                    qk_nope: qk_head - qk_rope,
                    qk_rope,
                    v_head_dim,
                };
                // llama.cpp's glm-dsa loader defaults to sigmoid gating.
                let gating = if arch == Arch::GlmDsa {
                    Gating::Sigmoid
                } else {
                    Gating::Softmax
                };
                let moe = moe_config(&m, gating, false)?;
                (Some(mla), moe, qk_rope)
            }
        };
        let scaling_type = match m.opt("rope.scaling.type") {
            None => None,
            Some(v) => Some(v.as_str().ok_or_else(|| ConfigError::Bad {
                key: m.key("rope.scaling.type"),
                msg: format!("expected a string, got {v}"),
            })?),
        };
        let unsupported_scaling = |t: &str| ConfigError::Bad {
            key: m.key("rope.scaling.type"),
            msg: format!(
                "{t:?} rope scaling is not implemented for {prefix} (llmdiff would compute a different model)"
            ),
        };
        let mut rope_scaling = RopeScaling::default();
        let yarn = match (scaling_type, arch) {
            (None | Some("none"), _) => None,
            (Some("yarn"), a) if a.is_mla() || a == Arch::GptOss => {
                let ext = m.f32_or("rope.scaling.yarn_ext_factor", 1.0)?;
                if ext != 1.0 {
                    return Err(ConfigError::Bad {
                        key: m.key("rope.scaling.yarn_ext_factor"),
                        msg: format!("{ext}: only HF's YaRN (extrapolation factor 1) is implemented"),
                    });
                }
                let factor = m.f32_or("rope.scaling.factor", 1.0)?;
                if factor <= 0.0 {
                    return Err(ConfigError::Bad {
                        key: m.key("rope.scaling.factor"),
                        msg: format!("{factor} must be > 0"),
                    });
                }
                Some(YarnConfig {
                    factor,
                    original_context: m
                        .usize_opt("rope.scaling.original_context_length")?
                        .unwrap_or(context_length),
                    log_multiplier: m.f32_or("rope.scaling.yarn_log_multiplier", 0.0)?,
                    beta_fast: m.f32_or("rope.scaling.yarn_beta_fast", 32.0)?,
                    beta_slow: m.f32_or("rope.scaling.yarn_beta_slow", 1.0)?,
                    attn_factor: match m.opt("rope.scaling.yarn_attn_factor") {
                        Some(_) => Some(m.f32_or("rope.scaling.yarn_attn_factor", 1.0)?),
                        None => None,
                    },
                    truncate: a != Arch::GptOss,
                })
            }
            (Some("linear"), Arch::Llama) => {
                let factor = m.f32_or("rope.scaling.factor", 1.0)?;
                if factor <= 0.0 {
                    return Err(ConfigError::Bad {
                        key: m.key("rope.scaling.factor"),
                        msg: format!("{factor} must be > 0"),
                    });
                }
                rope_scaling.linear_factor = (factor != 1.0).then_some(factor);
                None
            }
            (Some(t), _) => return Err(unsupported_scaling(t)),
        };
        if let Some(t) = h.tensor("rope_freqs.weight") {
            if arch != Arch::Llama {
                return Err(ConfigError::Bad {
                    key: "tensor rope_freqs.weight".into(),
                    msg: format!("per-pair rope frequency factors are not implemented for {prefix}"),
                });
            }
            let want = (rope_dim / 2) as u64;
            if t.ne != [want] || t.ty != crate::GgmlType::F32 {
                return Err(ConfigError::Bad {
                    key: "tensor rope_freqs.weight".into(),
                    msg: format!("{} {:?}, expected F32 [{want}] (rope_dim / 2)", t.ty, t.ne),
                });
            }
            rope_scaling.freq_factors = true;
        }
        if !arch.is_mla() && (rope_dim % 2 != 0 || rope_dim > head_dim) {
            return Err(ConfigError::Bad {
                key: m.key("rope.dimension_count"),
                msg: format!("{rope_dim} is odd or larger than the head"),
            });
        }
        let family = family_extras(&m, arch, n_layers, d_model, n_heads, rope_base)?;
        let indexer = if arch.has_indexer() {
            Some(indexer_config(&m, arch, n_layers, rope_dim)?)
        } else {
            None
        };
        Ok(ModelConfig {
            arch,
            n_layers,
            d_model,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn_dim,
            vocab,
            rms_eps,
            rope_base,
            rope_dim,
            context_length,
            tied_embeddings,
            mla,
            moe,
            yarn,
            rope_scaling,
            family,
            indexer,
            nextn_layers: nextn,
        })
    }

    /// The paths a run of `n_tokens` cannot exercise, one sentence each, so a healthy verdict is
    /// not mistaken for coverage: a sliding window the sequence never exceeds, MoE layers the
    /// model never reaches (every layer a leading dense one). Empty when every path runs.
    pub fn coverage_warnings(&self, n_tokens: usize) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(w) = self.family.sliding_window {
            if n_tokens <= w && self.family.swa_layers.iter().any(|&s| s) {
                out.push(format!(
                    "{n_tokens} tokens are within the sliding window of {w}: the sliding-window layers ran as full attention"
                ));
            }
        }
        if let Some(ix) = &self.indexer {
            if n_tokens <= ix.top_k {
                out.push(format!(
                    "{n_tokens} tokens are at or below the indexer's top_k ({}): every query attended to all its keys, so the sparse selection was not exercised; use a prompt longer than {} tokens",
                    ix.top_k, ix.top_k
                ));
            }
        }
        if let Some(m) = &self.moe {
            if m.n_dense_lead >= self.n_layers {
                out.push(format!(
                    "all {} layers are leading dense layers: no MoE layer was run",
                    self.n_layers
                ));
            }
        }
        out
    }

    /// True when layer `layer_idx` routes through experts.
    pub fn is_moe_layer(&self, layer_idx: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| layer_idx >= m.n_dense_lead)
    }
}

/// The DSA indexer of a deepseek32 / glm-dsa file (`{arch}.attention.indexer.*`).
fn indexer_config(m: &Meta, arch: Arch, n_layers: usize, rope_dim: usize) -> Result<IndexerConfig, ConfigError> {
    let n_heads = m.usize("attention.indexer.head_count")?;
    let head_dim = m.usize("attention.indexer.key_length")?;
    let top_k = m.usize("attention.indexer.top_k")?;
    if n_heads == 0 || top_k == 0 || head_dim < rope_dim {
        return Err(ConfigError::Bad {
            key: m.key("attention.indexer.key_length"),
            msg: format!("{n_heads} heads of {head_dim} (rope {rope_dim}), top_k {top_k}: not a valid indexer"),
        });
    }
    let full = match m.opt("attention.indexer.types") {
        None => vec![true; n_layers],
        Some(v) => {
            let bad = |msg: String| ConfigError::Bad {
                key: m.key("attention.indexer.types"),
                msg,
            };
            let items = v.as_array().ok_or_else(|| bad(format!("expected an array, got {v}")))?;
            let mut full = Vec::with_capacity(n_layers);
            for it in items.iter().take(n_layers) {
                full.push(match it {
                    MetaValue::Bool(b) => *b,
                    other => other.as_u64().ok_or_else(|| bad(format!("bad entry {other}")))? != 0,
                });
            }
            if full.len() < n_layers {
                return Err(bad(format!("{} entries for {n_layers} layers", full.len())));
            }
            if full.first() == Some(&false) {
                return Err(bad(
                    "layer 0 is `shared`: there is no earlier full layer to reuse".into()
                ));
            }
            full
        }
    };
    Ok(IndexerConfig {
        n_heads,
        head_dim,
        top_k,
        full,
        rope_neox: arch == Arch::Deepseek32,
        k_norm_eps: 1e-6,
    })
}

/// The MoE block of a file (`None` without `expert_count`), with the gating and top-k
/// renormalisation the architecture's loader defaults to.
fn moe_config(m: &Meta, default_gating: Gating, force_norm: bool) -> Result<Option<MoeConfig>, ConfigError> {
    let n_experts = m.usize_opt("expert_count")?.unwrap_or(0);
    let moe = if n_experts > 0 {
        let gating = match m.usize_opt("expert_gating_func")? {
            None => default_gating,
            Some(1) => Gating::Softmax,
            Some(2) => Gating::Sigmoid,
            Some(g) => {
                return Err(ConfigError::Bad {
                    key: m.key("expert_gating_func"),
                    msg: format!("unknown gating {g}"),
                })
            }
        };
        let n_used = m.usize("expert_used_count")?;
        let n_groups = m.usize_opt("expert_group_count")?.unwrap_or(1).max(1);
        let n_groups_used = m.usize_opt("expert_group_used_count")?.unwrap_or(n_groups).max(1);
        if n_used == 0 || n_used > n_experts || n_experts % n_groups != 0 || n_groups_used > n_groups {
            return Err(ConfigError::Bad {
                key: m.key("expert_used_count"),
                msg: format!(
                    "{n_used} of {n_experts} experts in {n_groups_used}/{n_groups} groups is not a valid routing"
                ),
            });
        }
        Some(MoeConfig {
            n_experts,
            n_used,
            n_shared: m.usize_opt("expert_shared_count")?.unwrap_or(0),
            expert_ffn: m.usize("expert_feed_forward_length")?,
            n_dense_lead: m.usize_opt("leading_dense_block_count")?.unwrap_or(0),
            weights_scale: m.f32_or("expert_weights_scale", 1.0)?,
            weights_norm: force_norm || matches!(m.opt("expert_weights_norm"), Some(MetaValue::Bool(true))),
            gating,
            n_groups,
            n_groups_used,
        })
    } else {
        None
    };
    Ok(moe)
}

/// [`FamilyExtras`] of a file: sliding windows, soft-capping and gemma's attention scale.
fn family_extras(
    m: &Meta,
    arch: Arch,
    n_layers: usize,
    d_model: usize,
    n_heads: usize,
    rope_base: f32,
) -> Result<FamilyExtras, ConfigError> {
    let mut f = FamilyExtras::default();
    let cap = |k: &str| -> Result<Option<f32>, ConfigError> {
        let v = m.f32_or(k, 0.0)?;
        if v < 0.0 {
            return Err(ConfigError::Bad {
                key: m.key(k),
                msg: format!("{v} must be >= 0"),
            });
        }
        Ok((v > 0.0).then_some(v))
    };
    let (period, big_layers) = match arch {
        Arch::Gemma2 => (2, 46),
        Arch::Gemma3 => (6, 62),
        Arch::GptOss => (2, 0),
        _ => return Ok(f),
    };
    let window = match (arch, m.usize_opt("attention.sliding_window")?) {
        (Arch::Gemma2, None) => Some(4096),
        (_, w) => w.filter(|&w| w > 0),
    };
    if window.is_some() {
        f.sliding_window = window;
        f.swa_layers = (0..n_layers).map(|l| l % period < period - 1).collect();
        f.rope_base_swa = m.f32_or("rope.freq_base_swa", rope_base)?;
    }
    if arch == Arch::Gemma2 {
        f.attn_softcap = cap("attn_logit_softcapping")?;
    }
    f.final_softcap = cap("final_logit_softcapping")?;
    if n_layers == big_layers {
        f.attn_scale = Some(1.0 / ((d_model / n_heads) as f64).sqrt());
    }
    Ok(f)
}
