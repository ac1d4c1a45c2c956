//! Model hyper-parameters read from GGUF metadata: the llama family and deepseek2 (MLA + MoE).
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

/// YaRN rope scaling (DeepSeek-V2/V3 long-context variants).
#[derive(Clone, Debug, PartialEq)]
pub struct YarnConfig {
    pub factor: f32,
    pub original_context: usize,
    /// 0.1·mscale_all_dim, as llama.cpp stores it.
    pub log_multiplier: f32,
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
    /// The DSA indexer (deepseek32, glm-dsa); `None` for the other families.
    pub indexer: Option<IndexerConfig>,
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
            Arch::Deepseek2 | Arch::Deepseek32 | Arch::GlmDsa => m.usize_opt("nextn_predict_layers")?.unwrap_or(0),
            Arch::Llama => 0,
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
            Some(k) if arch == Arch::Llama => k,
            _ => d_model / n_heads,
        };
        if arch == Arch::Llama {
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
            Arch::Llama => (None, None, m.usize_opt("rope.dimension_count")?.unwrap_or(head_dim)),
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
                let n_experts = m.usize_opt("expert_count")?.unwrap_or(0);
                let moe = if n_experts > 0 {
                    let gating = match m.usize_opt("expert_gating_func")? {
                        // llama.cpp's glm-dsa loader defaults to sigmoid.
                        None if arch == Arch::GlmDsa => Gating::Sigmoid,
                        None | Some(1) => Gating::Softmax,
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
                            msg: format!("{n_used} of {n_experts} experts in {n_groups_used}/{n_groups} groups is not a valid routing"),
                        });
                    }
                    Some(MoeConfig {
                        n_experts,
                        n_used,
                        n_shared: m.usize_opt("expert_shared_count")?.unwrap_or(0),
                        expert_ffn: m.usize("expert_feed_forward_length")?,
                        n_dense_lead: m.usize_opt("leading_dense_block_count")?.unwrap_or(0),
                        weights_scale: m.f32_or("expert_weights_scale", 1.0)?,
                        weights_norm: matches!(m.opt("expert_weights_norm"), Some(MetaValue::Bool(true))),
                        gating,
                        n_groups,
                        n_groups_used,
                    })
                } else {
                    None
                };
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
            (Some("yarn"), a) if a.is_mla() => Some(YarnConfig {
                factor: m.f32_or("rope.scaling.factor", 1.0)?,
                original_context: m
                    .usize_opt("rope.scaling.original_context_length")?
                    .unwrap_or(context_length),
                log_multiplier: m.f32_or("rope.scaling.yarn_log_multiplier", 0.0)?,
            }),
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
        if arch == Arch::Llama && (rope_dim % 2 != 0 || rope_dim > head_dim) {
            return Err(ConfigError::Bad {
                key: m.key("rope.dimension_count"),
                msg: format!("{rope_dim} is odd or larger than the head"),
            });
        }
        let indexer = if arch.has_indexer() {
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
            Some(IndexerConfig {
                n_heads,
                head_dim,
                top_k,
                full,
                rope_neox: arch == Arch::Deepseek32,
                k_norm_eps: 1e-6,
            })
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
            indexer,
        })
    }

    /// True when layer `layer_idx` routes through experts.
    pub fn is_moe_layer(&self, layer_idx: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| layer_idx >= m.n_dense_lead)
    }
}
