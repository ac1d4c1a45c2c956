//! What llmdiff reads of a GGUF file, per architecture: an allowlist, not a guess.
//!
//! Code cannot tell whether a metadata key or tensor it does not know changes the model's math,
//! so every `{arch}.*` key and every tensor of a file is classified:
//! - **used**: the reference reads it and honours it (the engine builds from the same config);
//! - **skipped**: knowingly ignored, with the reason (provenance, tokenizer extras, quantization
//!   bookkeeping, the MTP/nextn block appended after the main layers, a duplicate of used data);
//! - **unknown**: anything else. An unknown `{arch}.*` key or tensor is refused (exit 2, naming it)
//!   unless the user names it in [`GgufHeader::allow_unknown`] (`--allow-unknown KEY`).
//!
//! Keys outside `{arch}.*` (general.*, tokenizer.*, split.*, ...) are classified too, for
//! `inspect`, but an unknown one there is not refused: it cannot change the forward pass.

use crate::arch::{Arch, ConfigError};
use crate::gguf::{GgufHeader, MetaValue};
use std::fmt;

/// How llmdiff treats one key or tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Used,
    /// Knowingly ignored; the reason.
    Skipped(&'static str),
    /// Outside the sets; the reason when one is known (a value llmdiff does not implement).
    Unknown(&'static str),
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::Used => "used",
            Role::Skipped(_) => "skipped",
            Role::Unknown(_) => "unknown",
        }
    }
    pub fn reason(self) -> &'static str {
        match self {
            Role::Used => "",
            Role::Skipped(r) | Role::Unknown(r) => r,
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.reason() {
            "" => f.write_str(self.name()),
            r => write!(f, "{} ({r})", self.name()),
        }
    }
}

/// `{arch}.` keys every family's reference reads and honours (suffixes after the prefix): the
/// dense GQA skeleton.
const BASE_USED: &[&str] = &[
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "rope.dimension_count",
    "vocab_size",
];

/// llama's own: linear rope scaling (Llama 3.1+'s factors are the `rope_freqs` tensor).
const LLAMA_USED: &[&str] = &["rope.scaling.type", "rope.scaling.factor"];

/// The experts of the MoE families.
const MOE_USED: &[&str] = &["expert_count", "expert_used_count", "expert_feed_forward_length"];

/// Softmax/sigmoid routing with weights scaled and optionally renormalised (qwen3moe and the
/// grouped, shared-expert routing of deepseek2 and glm4moe).
const ROUTED_USED: &[&str] = &["expert_weights_scale"];

/// deepseek2-style routing: a shared expert, leading dense layers, groups, gating, the MTP block.
const GROUPED_USED: &[&str] = &[
    "leading_dense_block_count",
    "expert_shared_count",
    "expert_weights_norm",
    "expert_gating_func",
    "expert_group_count",
    "expert_group_used_count",
    "nextn_predict_layers",
];

/// MLA (deepseek2 and the DSA families built on it).
const MLA_USED: &[&str] = &[
    "attention.q_lora_rank",
    "attention.kv_lora_rank",
    "attention.key_length_mla",
    "attention.value_length_mla",
];

/// Sliding windows (gemma2/3, gpt-oss) and their local RoPE base.
const SWA_USED: &[&str] = &["attention.sliding_window", "rope.freq_base_swa"];

/// gemma's soft-capping.
const SOFTCAP_USED: &[&str] = &["attn_logit_softcapping", "final_logit_softcapping"];

/// deepseek32 / glm-dsa: the DSA indexer.
const DSA_USED: &[&str] = &[
    "attention.indexer.head_count",
    "attention.indexer.key_length",
    "attention.indexer.top_k",
    "attention.indexer.types",
];

/// The `{arch}.` key groups each family's reference reads and honours.
fn used_keys(arch: Arch) -> &'static [&'static [&'static str]] {
    match arch {
        Arch::Llama => &[BASE_USED, LLAMA_USED],
        Arch::Deepseek2 => &[BASE_USED, MLA_USED, MOE_USED, ROUTED_USED, GROUPED_USED],
        Arch::Deepseek32 | Arch::GlmDsa => &[BASE_USED, MLA_USED, MOE_USED, ROUTED_USED, GROUPED_USED, DSA_USED],
        Arch::Qwen2 | Arch::Qwen3 => &[BASE_USED],
        Arch::Qwen3Moe => &[BASE_USED, MOE_USED, ROUTED_USED],
        Arch::Glm4Moe => &[BASE_USED, MOE_USED, ROUTED_USED, GROUPED_USED],
        Arch::Gemma2 | Arch::Gemma3 => &[BASE_USED, SWA_USED, SOFTCAP_USED],
        Arch::GptOss => &[BASE_USED, SWA_USED, MOE_USED],
    }
}

/// The DSA indexer's tensors (glm-dsa's `shared` indexer layers carry none).
const DSA_BLOCK_TENSORS: &[&str] = &[
    "indexer.k_norm.weight",
    "indexer.k_norm.bias",
    "indexer.proj.weight",
    "indexer.attn_k.weight",
    "indexer.attn_q_b.weight",
];

/// `{arch}.` keys knowingly ignored, per architecture, with the reason.
const LLAMA_SKIPPED: &[(&str, &str)] = &[
    (
        "rope.scaling.finetuned",
        "bookkeeping: whether the model was fine-tuned at the scaled length",
    ),
    (
        "rope.scaling.original_context_length",
        "only YaRN uses it; linear scaling and rope_freqs do not",
    ),
];
const DEEPSEEK2_SKIPPED: &[(&str, &str)] = &[(
    "rope.scaling.finetuned",
    "bookkeeping: whether the model was fine-tuned at the scaled length",
)];

/// Keys outside `{arch}.*` that llmdiff reads.
const OTHER_USED: &[&str] = &[
    "general.architecture",
    "general.alignment",
    "split.no",
    "split.count",
    "split.tensors.count",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_space_prefix",
];

/// Per-block tensors of qwen2 (q/k/v biases), qwen3 (q/k norms) and qwen3moe (experts).
const QWEN_BLOCK_TENSORS: &[&str] = &[
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_q.bias",
    "attn_k.bias",
    "attn_v.bias",
    "attn_q_norm.weight",
    "attn_k_norm.weight",
    "attn_output.weight",
    "ffn_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_exps.weight",
    "ffn_up_exps.weight",
    "ffn_down_exps.weight",
];
/// glm4moe: its pre-FFN norm is `post_attention_norm` (HF's post_attention_layernorm).
const GLM4MOE_BLOCK_TENSORS: &[&str] = &[
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_q.bias",
    "attn_k.bias",
    "attn_v.bias",
    "attn_q_norm.weight",
    "attn_k_norm.weight",
    "attn_output.weight",
    "post_attention_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
    "ffn_gate_inp.weight",
    "exp_probs_b.bias",
    "ffn_gate_exps.weight",
    "ffn_up_exps.weight",
    "ffn_down_exps.weight",
    "ffn_gate_shexp.weight",
    "ffn_up_shexp.weight",
    "ffn_down_shexp.weight",
];
/// gemma2/gemma3: pre and post norms around attention and FFN; gemma3's q/k norms.
const GEMMA_BLOCK_TENSORS: &[&str] = &[
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_q_norm.weight",
    "attn_k_norm.weight",
    "attn_output.weight",
    "post_attention_norm.weight",
    "ffn_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
    "post_ffw_norm.weight",
];

/// gpt-oss: biases everywhere, attention sinks, the pre-FFN norm as `post_attention_norm`.
const GPT_OSS_BLOCK_TENSORS: &[&str] = &[
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_q.bias",
    "attn_k.bias",
    "attn_v.bias",
    "attn_output.weight",
    "attn_output.bias",
    "attn_sinks.weight",
    "post_attention_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_inp.bias",
    "ffn_gate_exps.weight",
    "ffn_gate_exps.bias",
    "ffn_up_exps.weight",
    "ffn_up_exps.bias",
    "ffn_down_exps.weight",
    "ffn_down_exps.bias",
];

/// Per-block tensors (`blk.N.{name}`) each architecture uses.
const LLAMA_BLOCK_TENSORS: &[&str] = &[
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
];
const DEEPSEEK2_BLOCK_TENSORS: &[&str] = &[
    "attn_norm.weight",
    "attn_q.weight",
    "attn_q_a.weight",
    "attn_q_a_norm.weight",
    "attn_q_b.weight",
    "attn_kv_a_mqa.weight",
    "attn_kv_a_norm.weight",
    "attn_k_b.weight",
    "attn_v_b.weight",
    "attn_output.weight",
    "ffn_norm.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
    "ffn_gate_inp.weight",
    "exp_probs_b.bias",
    "ffn_gate_exps.weight",
    "ffn_up_exps.weight",
    "ffn_down_exps.weight",
    "ffn_gate_shexp.weight",
    "ffn_up_shexp.weight",
    "ffn_down_shexp.weight",
];

/// The architecture a header names, if llmdiff runs it.
pub fn arch_of(h: &GgufHeader) -> Result<Arch, ConfigError> {
    let name = h
        .get("general.architecture")
        .and_then(|v| v.as_str())
        .ok_or_else(|| ConfigError::Missing("general.architecture".into()))?;
    match name {
        "llama" => Ok(Arch::Llama),
        "deepseek2" => Ok(Arch::Deepseek2),
        "qwen2" => Ok(Arch::Qwen2),
        "qwen3" => Ok(Arch::Qwen3),
        "qwen3moe" => Ok(Arch::Qwen3Moe),
        "glm4moe" => Ok(Arch::Glm4Moe),
        "gemma2" => Ok(Arch::Gemma2),
        "gemma3" => Ok(Arch::Gemma3),
        "gpt-oss" => Ok(Arch::GptOss),
        "deepseek32" => Ok(Arch::Deepseek32),
        "glm-dsa" => Ok(Arch::GlmDsa),
        other => Err(ConfigError::UnsupportedArch(other.to_string())),
    }
}

/// The role of metadata key `key` (with its value) in a file of architecture `arch`.
pub fn classify_key(arch: Arch, key: &str, value: &MetaValue) -> Role {
    let prefix = format!("{}.", arch.name());
    let Some(suffix) = key.strip_prefix(&prefix) else {
        return classify_other_key(key);
    };
    let skipped = match arch {
        Arch::Llama => LLAMA_SKIPPED,
        Arch::Deepseek2 | Arch::Deepseek32 | Arch::GlmDsa | Arch::Glm4Moe => DEEPSEEK2_SKIPPED,
        _ => &[],
    };
    if let Some((_, why)) = skipped.iter().find(|(k, _)| *k == suffix) {
        return Role::Skipped(why);
    }
    if used_keys(arch).iter().any(|g| g.contains(&suffix)) {
        return Role::Used;
    }
    // The MLA families' YaRN (forward/yarn.rs: HF's frequencies on q, k_pe and the DSA
    // indexer; the softmax scale from the log multiplier).
    if arch.is_mla() && suffix.starts_with("rope.scaling.") {
        return match suffix {
            "rope.scaling.type" if matches!(value.as_str(), Some("none" | "yarn")) => Role::Used,
            "rope.scaling.factor"
            | "rope.scaling.original_context_length"
            | "rope.scaling.yarn_log_multiplier"
            | "rope.scaling.yarn_beta_fast"
            | "rope.scaling.yarn_beta_slow"
            | "rope.scaling.yarn_attn_factor"
            | "rope.scaling.yarn_ext_factor" => Role::Used,
            _ => Role::Unknown(""),
        };
    }
    // gpt-oss's YaRN (forward/yarn.rs): every key llama.cpp's converter writes for it.
    if arch == Arch::GptOss && suffix.starts_with("rope.scaling.") {
        return match suffix {
            "rope.scaling.type" if matches!(value.as_str(), Some("none" | "yarn")) => Role::Used,
            "rope.scaling.factor"
            | "rope.scaling.original_context_length"
            | "rope.scaling.yarn_beta_fast"
            | "rope.scaling.yarn_beta_slow"
            | "rope.scaling.yarn_attn_factor"
            | "rope.scaling.yarn_ext_factor" => Role::Used,
            _ => Role::Unknown(""),
        };
    }
    Role::Unknown("")
}

fn classify_other_key(key: &str) -> Role {
    if OTHER_USED.contains(&key) {
        return Role::Used;
    }
    if key.starts_with("general.") {
        return Role::Skipped("provenance");
    }
    if key.starts_with("quantize.") {
        return Role::Skipped("quantization bookkeeping");
    }
    if key.starts_with("tokenizer.chat_template") {
        return Role::Skipped("chat template: llmdiff feeds raw token ids");
    }
    if key.starts_with("tokenizer.ggml.") && key.ends_with("_token_id") {
        return Role::Skipped("a special token llmdiff does not insert");
    }
    if key.starts_with("tokenizer.ggml.add_") {
        return Role::Skipped("a special token llmdiff does not insert");
    }
    Role::Unknown("")
}

/// The role of tensor `name` in a file of architecture `arch` with `block_count` blocks, of which
/// the first `n_layers` are the model's (the rest are the MTP/nextn block).
pub fn classify_tensor(arch: Arch, block_count: usize, n_layers: usize, name: &str) -> Role {
    match name {
        "token_embd.weight" | "output_norm.weight" | "output.weight" => return Role::Used,
        "rope_freqs.weight" if arch == Arch::Llama => return Role::Used,
        _ => {}
    }
    let Some(rest) = name.strip_prefix("blk.") else {
        return Role::Unknown("");
    };
    let Some((idx, tail)) = rest.split_once('.') else {
        return Role::Unknown("");
    };
    let Ok(idx) = idx.parse::<usize>() else {
        return Role::Unknown("");
    };
    if idx >= block_count {
        return Role::Unknown("block index past block_count");
    }
    if idx >= n_layers {
        return Role::Skipped("MTP/nextn block (speculative-decoding head, not the model)");
    }
    let block = match arch {
        Arch::Llama => LLAMA_BLOCK_TENSORS,
        Arch::Deepseek2 | Arch::Deepseek32 | Arch::GlmDsa => DEEPSEEK2_BLOCK_TENSORS,
        // The dense qwens stop before the router and experts.
        Arch::Qwen2 | Arch::Qwen3 => &QWEN_BLOCK_TENSORS[..14],
        Arch::Qwen3Moe => QWEN_BLOCK_TENSORS,
        Arch::Glm4Moe => GLM4MOE_BLOCK_TENSORS,
        Arch::Gemma2 | Arch::Gemma3 => GEMMA_BLOCK_TENSORS,
        Arch::GptOss => GPT_OSS_BLOCK_TENSORS,
    };
    if block.contains(&tail) || (arch.has_indexer() && DSA_BLOCK_TENSORS.contains(&tail)) {
        return Role::Used;
    }
    if arch.is_mla() && tail == "attn_kv_b.weight" {
        return Role::Skipped("the same weights as attn_k_b and attn_v_b, which are used");
    }
    Role::Unknown("")
}

/// Every key and tensor of a header with its role.
pub struct Audit {
    pub arch: Arch,
    pub keys: Vec<(String, Role)>,
    pub tensors: Vec<(String, Role)>,
}

/// `block_count` and the number of model layers (block_count less `nextn_predict_layers`).
pub fn layer_counts(h: &GgufHeader, arch: Arch) -> (usize, usize) {
    let get = |k: &str| {
        h.get(&format!("{}.{k}", arch.name()))
            .and_then(|v| v.as_u64())
            .map_or(0, |v| v.min(u32::MAX as u64) as usize)
    };
    let blocks = get("block_count");
    let nextn = if arch.is_mla() || arch == Arch::Glm4Moe {
        get("nextn_predict_layers")
    } else {
        0
    };
    (blocks, blocks.saturating_sub(nextn))
}

/// Classifies every key and tensor of `h`.
pub fn audit(h: &GgufHeader) -> Result<Audit, ConfigError> {
    let arch = arch_of(h)?;
    let (blocks, layers) = layer_counts(h, arch);
    Ok(Audit {
        arch,
        keys: h
            .metadata
            .iter()
            .map(|(k, v)| (k.clone(), classify_key(arch, k, v)))
            .collect(),
        tensors: h
            .tensors
            .iter()
            .map(|t| (t.name.clone(), classify_tensor(arch, blocks, layers, &t.name)))
            .collect(),
    })
}

fn note(why: &str) -> String {
    match why {
        "" => String::new(),
        w => format!(" ({w})"),
    }
}

/// Refuses the first unknown `{arch}.*` key or tensor not named in `h.allow_unknown`.
pub fn check(h: &GgufHeader) -> Result<(), ConfigError> {
    let a = audit(h)?;
    let prefix = format!("{}.", a.arch.name());
    let allowed = |name: &str| h.allow_unknown.iter().any(|k| k == name);
    for (k, role) in &a.keys {
        if let Role::Unknown(why) = role {
            if k.starts_with(&prefix) && !allowed(k) {
                return Err(ConfigError::Unknown {
                    what: "metadata key",
                    name: k.clone(),
                    arch: a.arch.name(),
                    note: note(why),
                });
            }
        }
    }
    for (t, role) in &a.tensors {
        if let Role::Unknown(why) = role {
            if !allowed(t) {
                return Err(ConfigError::Unknown {
                    what: "tensor",
                    name: t.clone(),
                    arch: a.arch.name(),
                    note: note(why),
                });
            }
        }
    }
    Ok(())
}
