//! `config.json` → the GGUF metadata llama.cpp's convert_hf_to_gguf.py would write for it, so the
//! model config is built by one code path ([`crate::config::ModelConfig::from_header`], with its
//! strictness) whatever the source.
//!
//! Strict like the GGUF allowlist: every key of config.json is either read (and its value one the
//! reference computes, else refused by name), or listed in [`IGNORED`] as not changing the math
//! (provenance, training-only settings, generation defaults), or refused by name. Both spellings
//! are read: transformers 5's `rope_parameters` (with `rope_theta` inside) and the older
//! `rope_scaling` (`type` or `rope_type`) with a top-level `rope_theta`.
//!
//! Families read: llama, mistral, qwen2, qwen3, qwen3_moe, glm4_moe, gemma2, gemma3_text,
//! gpt_oss (experts in BF16/F32 or MXFP4), deepseek_v3, deepseek_v32,
//! glm_moe_dsa. Others (multimodal gemma3, deepseek_v2) are refused by name: convert them with
//! convert_hf_to_gguf.py.

use crate::arch::Arch;
use crate::gguf::MetaValue;
use serde_json::{Map, Value};
use std::cell::RefCell;
use std::collections::HashSet;

/// Keys that do not change the forward pass of the reference (one sequence, no cache, eval).
pub const IGNORED: &[(&str, &str)] = &[
    ("architectures", "the class name: model_type selects the family"),
    ("transformers_version", "provenance"),
    ("_name_or_path", "provenance"),
    ("dtype", "the storage type: each tensor's own dtype is read"),
    ("torch_dtype", "the storage type: each tensor's own dtype is read"),
    ("use_cache", "generation setting"),
    ("initializer_range", "training only"),
    ("attention_dropout", "training only (eval has no dropout)"),
    ("bos_token_id", "tokenizer bookkeeping"),
    ("eos_token_id", "tokenizer bookkeeping"),
    ("pad_token_id", "tokenizer bookkeeping"),
    ("output_router_logits", "training only (router loss)"),
    ("router_aux_loss_coef", "training only (router loss)"),
    ("aux_loss_alpha", "training only (router loss)"),
    ("seq_aux", "training only (router loss)"),
    ("ep_size", "expert-parallel deployment setting"),
    ("chunk_size_feed_forward", "memory setting; the same math"),
    ("id2label", "classification heads"),
    ("label2id", "classification heads"),
    ("problem_type", "classification heads"),
    ("is_encoder_decoder", "false for these decoders"),
    ("output_attentions", "output selection"),
    ("output_hidden_states", "output selection"),
    ("return_dict", "output selection"),
    (
        "pretraining_tp",
        "a split of the same products (transformers 5 ignores it)",
    ),
    (
        "max_window_layers",
        "read only with use_sliding_window, which must be false",
    ),
    (
        "num_nextn_predict_layers",
        "the MTP block after the main layers: not part of the forward pass",
    ),
    ("tokenizer_class", "tokenizer bookkeeping"),
    ("auto_map", "remote-code class names"),
    ("max_position_embeddings", "the context length (used as such)"),
];

/// What the weight mapping needs beyond the metadata.
#[derive(Clone, Debug)]
pub struct Hparams {
    pub arch: Arch,
    pub d_model: usize,
    pub vocab: usize,
    pub ffn: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub tied: bool,
    /// llama/mistral: q/k rows are permuted from HF's rotate-half order to llama.cpp's pairs.
    pub permute_qk: bool,
    /// MLA: (qk_nope, v_head_dim), for splitting kv_b.
    pub mla: Option<(usize, usize)>,
    pub n_experts: usize,
    /// Llama 3.1+ per-pair frequency divisors (`rope_freqs.weight`).
    pub rope_freqs: Option<Vec<f32>>,
    /// How FP8 weights are scaled, from `quantization_config`.
    pub fp8: Option<Fp8Scheme>,
    /// gpt-oss's experts are MXFP4 (`quant_method` mxfp4: `_blocks` and `_scales` tensors).
    pub mxfp4: bool,
}

/// The FP8 weight scaling a checkpoint declares. Every scheme dequantizes as
/// `f32(value) × scale` of the element's block.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fp8Scheme {
    /// DeepSeek-V3 / GLM-5 (`quant_method` fp8): `weight_scale_inv` per (rows × cols) block,
    /// partial at the edges.
    Block(usize, usize),
    /// compressed-tensors (`float-quantized`): `weight_scale` per tensor, per output channel
    /// (`strategy` tensor / channel) or per block (`block_structure`).
    Compressed { strategy: Fp8Strategy },
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fp8Strategy {
    Tensor,
    Channel,
    Block(usize, usize),
}

/// config.json translated: the GGUF metadata and the weight mapping's parameters.
#[derive(Debug)]
pub struct Translated {
    pub metadata: Vec<(String, MetaValue)>,
    pub hp: Hparams,
}

/// Reads config.json keys, recording which were read.
struct Cfg<'a> {
    obj: &'a Map<String, Value>,
    used: RefCell<HashSet<String>>,
}

type R<T> = Result<T, String>;

impl<'a> Cfg<'a> {
    fn get(&self, k: &str) -> Option<&'a Value> {
        self.used.borrow_mut().insert(k.to_string());
        self.obj.get(k).filter(|v| !v.is_null())
    }
    fn usize_opt(&self, k: &str) -> R<Option<usize>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .filter(|&x| x < 1 << 32)
                .map(|x| Some(x as usize))
                .ok_or_else(|| format!("key {k}: expected a count, got {v}")),
        }
    }
    fn usize(&self, k: &str) -> R<usize> {
        self.usize_opt(k)?.ok_or_else(|| format!("missing key {k}"))
    }
    fn f64_opt(&self, k: &str) -> R<Option<f64>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .map(Some)
                .ok_or_else(|| format!("key {k}: expected a number, got {v}")),
        }
    }
    fn bool_or(&self, k: &str, default: bool) -> R<bool> {
        match self.get(k) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| format!("key {k}: expected true or false, got {v}")),
        }
    }
    fn str_opt(&self, k: &str) -> R<Option<&'a str>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_str()
                .map(Some)
                .ok_or_else(|| format!("key {k}: expected a string, got {v}")),
        }
    }
    /// `k` must be absent or `want` (a value the reference computes).
    fn expect(&self, k: &str, want: &Value, why: &str) -> R<()> {
        match self.get(k) {
            Some(v) if v != want => Err(format!("key {k} = {v}: {why} (llmdiff computes {want})")),
            _ => Ok(()),
        }
    }
    /// The keys neither read nor ignored.
    fn unknown(&self) -> Vec<String> {
        let used = self.used.borrow();
        let ignored: HashSet<&str> = IGNORED.iter().map(|(k, _)| *k).collect();
        let mut out: Vec<String> = self
            .obj
            .keys()
            .filter(|k| !used.contains(*k) && !ignored.contains(k.as_str()))
            .cloned()
            .collect();
        out.sort();
        out
    }
}

/// The rope parameters: transformers 5's `rope_parameters` or the older `rope_scaling` +
/// top-level `rope_theta`, as one map with `rope_type` and `rope_theta`.
fn rope_params(c: &Cfg) -> R<Map<String, Value>> {
    let mut out = Map::new();
    if let Some(theta) = c.get("rope_theta") {
        out.insert("rope_theta".into(), theta.clone());
    }
    for key in ["rope_scaling", "rope_parameters"] {
        if let Some(v) = c.get(key) {
            let m = v
                .as_object()
                .ok_or_else(|| format!("key {key}: expected an object, got {v}"))?;
            for (k, v) in m {
                let k = if k == "type" { "rope_type" } else { k.as_str() };
                out.insert(k.to_string(), v.clone());
            }
        }
    }
    Ok(out)
}

fn u32v(x: usize) -> MetaValue {
    MetaValue::U32(x as u32)
}

/// Translates config.json (`obj`) into GGUF metadata. The error is one line naming the key.
pub fn translate(obj: &Map<String, Value>) -> R<Translated> {
    let c = Cfg {
        obj,
        used: RefCell::new(HashSet::new()),
    };
    let model_type = c.str_opt("model_type")?.ok_or("missing key model_type")?;
    let arch = match model_type {
        "llama" | "mistral" => Arch::Llama,
        "qwen2" => Arch::Qwen2,
        "qwen3" => Arch::Qwen3,
        "qwen3_moe" => Arch::Qwen3Moe,
        "deepseek_v3" => Arch::Deepseek2,
        "deepseek_v32" => Arch::Deepseek32,
        "glm_moe_dsa" => Arch::GlmDsa,
        "glm4_moe" => Arch::Glm4Moe,
        "gemma2" => Arch::Gemma2,
        "gemma3_text" => Arch::Gemma3,
        "gpt_oss" => Arch::GptOss,
        "gemma3" | "deepseek_v2" => {
            return Err(format!(
                "model_type {model_type}: not read from HF folders yet (convert it with llama.cpp's convert_hf_to_gguf.py and give the GGUF)"
            ))
        }
        t => return Err(format!("model_type {t}: not an architecture llmdiff runs")),
    };
    let a = arch.name();
    let mut md: Vec<(String, MetaValue)> = vec![("general.architecture".into(), MetaValue::String(a.into()))];
    let mut put = |k: &str, v: MetaValue| md.push((format!("{a}.{k}"), v));

    let n_layers = c.usize("num_hidden_layers")?;
    let d = c.usize("hidden_size")?;
    let n_heads = c.usize("num_attention_heads")?;
    let mut n_kv = c.usize_opt("num_key_value_heads")?.unwrap_or(n_heads);
    let vocab = c.usize("vocab_size")?;
    let tied = c.bool_or("tie_word_embeddings", false)?;
    let rms_eps = c.f64_opt("rms_norm_eps")?.unwrap_or(1e-6);
    let ctx = c.usize_opt("max_position_embeddings")?.unwrap_or(4096);
    let ffn = c.usize("intermediate_size")?;
    if n_heads == 0 || d == 0 {
        return Err("num_attention_heads and hidden_size must be > 0".into());
    }
    let gemma = arch.is_gemma();
    if gemma {
        // Gemma: GELU-tanh (hidden_activation; older configs say hidden_act).
        for k in ["hidden_activation", "hidden_act"] {
            if let Some(a) = c.str_opt(k)? {
                if a != "gelu_pytorch_tanh" {
                    return Err(format!(
                        "key {k} = {a:?}: llmdiff computes gemma's FFN with gelu_pytorch_tanh"
                    ));
                }
            }
        }
        c.expect(
            "use_bidirectional_attention",
            &Value::Bool(false),
            "bidirectional attention is not implemented",
        )?;
    } else {
        let act = c.str_opt("hidden_act")?.unwrap_or("silu");
        if act != "silu" {
            return Err(format!(
                "key hidden_act = {act:?}: llmdiff computes SwiGLU with silu for {model_type}"
            ));
        }
    }
    c.expect("mlp_bias", &Value::Bool(false), "MLP biases are not implemented")?;
    let qwen = matches!(
        arch,
        Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe | Arch::Glm4Moe | Arch::GptOss
    );
    if !qwen {
        c.expect(
            "attention_bias",
            &Value::Bool(false),
            "attention biases are not implemented here",
        )?;
    } else {
        c.get("attention_bias"); // the bias tensors are used when present
    }
    // Sliding windows: none of these families' references has one.
    if c.bool_or("use_sliding_window", false)? {
        return Err(
            "key use_sliding_window = true: sliding-window attention is not implemented for this family".into(),
        );
    }
    let mut window = None;
    if gemma || arch == Arch::GptOss {
        window = c.usize_opt("sliding_window")?;
        // llama.cpp fixes which layers slide (gemma2 and gpt-oss every other from 0, gemma3 five
        // of six); the file's layer_types must say the same.
        let period = if arch == Arch::Gemma3 { 6 } else { 2 };
        let want: Vec<Value> = (0..n_layers)
            .map(|l| {
                Value::from(if l % period < period - 1 {
                    "sliding_attention"
                } else {
                    "full_attention"
                })
            })
            .collect();
        match c.get("layer_types") {
            Some(t) if t != &Value::Array(want) => {
                return Err(format!(
                    "key layer_types = {t}: llama.cpp's {} pattern (and so the reference's) is {} sliding of every {period}",
                    arch.name(),
                    period - 1
                ))
            }
            Some(_) => {
                c.get("_sliding_window_pattern");
                c.get("sliding_window_pattern");
            }
            None => {
                for k in ["_sliding_window_pattern", "sliding_window_pattern"] {
                    if let Some(p) = c.usize_opt(k)? {
                        if p != period {
                            return Err(format!("key {k} = {p}: the reference's {} pattern is {period}", arch.name()));
                        }
                    }
                }
            }
        }
    } else if model_type == "mistral" {
        if let Some(w) = c.get("sliding_window") {
            return Err(format!(
                "key sliding_window = {w}: mistral's sliding window is not implemented (the reference attends to every position)"
            ));
        }
    } else {
        c.get("sliding_window"); // read only with use_sliding_window (false)
    }
    if let Some(types) = c.get("layer_types").filter(|_| !gemma && arch != Arch::GptOss) {
        let ok = types.as_array().is_some_and(|t| {
            t.iter()
                .all(|x| matches!(x.as_str(), Some("full_attention") | Some("indexed_attention")))
        });
        if !ok {
            return Err(format!(
                "key layer_types = {types}: only full attention is implemented for {model_type}"
            ));
        }
    }
    let partial = c.f64_opt("partial_rotary_factor")?;

    put("block_count", u32v(n_layers));
    put("context_length", u32v(ctx));
    put("embedding_length", u32v(d));
    put("feed_forward_length", u32v(ffn));
    put("attention.head_count", u32v(n_heads));
    put("attention.layer_norm_rms_epsilon", MetaValue::F32(rms_eps as f32));
    if arch == Arch::Llama || arch.is_mla() {
        // As the converter writes it (the qwen families take the vocabulary from the embeddings).
        put("vocab_size", u32v(vocab));
    }

    // RoPE.
    let mut rope = rope_params(&c)?;
    if arch == Arch::Gemma3 {
        // transformers 5: per layer type; older: rope_theta (global) + rope_local_base_freq.
        let local = match (rope.remove("full_attention"), rope.remove("sliding_attention")) {
            (Some(full), Some(sliding)) => {
                if rope.keys().any(|k| k != "rope_theta") {
                    return Err("rope_parameters: per-layer-type and flat keys mixed".into());
                }
                let flat = |v: Value, which: &str| -> R<Map<String, Value>> {
                    v.as_object()
                        .cloned()
                        .ok_or_else(|| format!("rope_parameters.{which}: expected an object"))
                };
                let sliding = flat(sliding, "sliding_attention")?;
                if sliding.get("rope_type").and_then(|v| v.as_str()).unwrap_or("default") != "default"
                    || sliding.keys().any(|k| k != "rope_type" && k != "rope_theta")
                {
                    return Err(format!(
                        "rope_parameters.sliding_attention = {}: only default rope is implemented on local layers",
                        Value::Object(sliding)
                    ));
                }
                rope = flat(full, "full_attention")?;
                sliding.get("rope_theta").and_then(|v| v.as_f64()).unwrap_or(10000.0)
            }
            (None, None) => c.f64_opt("rope_local_base_freq")?.unwrap_or(10000.0),
            _ => return Err("rope_parameters: full_attention without sliding_attention or the reverse".into()),
        };
        put("rope.freq_base_swa", MetaValue::F32(local as f32));
    }
    let rope_theta = rope.get("rope_theta").and_then(|v| v.as_f64()).unwrap_or(10000.0);
    if !(arch == Arch::Gemma2 && rope_theta == 10000.0) {
        // (convert_hf_to_gguf.py writes none for gemma2: llama.cpp's default is 10000.)
        put("rope.freq_base", MetaValue::F32(rope_theta as f32));
    }
    // glm4moe's partial rotary (transformers 5 puts it among the rope parameters).
    let partial = match (rope.remove("partial_rotary_factor"), partial) {
        (Some(v), _) => Some(
            v.as_f64()
                .ok_or("rope parameter partial_rotary_factor: expected a number")?,
        ),
        (None, p) => p,
    };
    if partial.is_some_and(|p| p != 1.0) && arch != Arch::Glm4Moe {
        return Err(format!(
            "partial_rotary_factor = {partial:?}: partial rotary is not implemented for {model_type}"
        ));
    }
    let rope_type = rope
        .get("rope_type")
        .and_then(|v| v.as_str())
        .unwrap_or("default")
        .to_string();
    let rope_known: &[&str] = match rope_type.as_str() {
        "default" => &["rope_type", "rope_theta"],
        "linear" => &["rope_type", "rope_theta", "factor"],
        "llama3" => &[
            "rope_type",
            "rope_theta",
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ],
        "yarn" => &[
            "rope_type",
            "rope_theta",
            "factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
        ],
        t => {
            return Err(format!(
                "rope type {t:?}: not implemented (llmdiff computes default, linear, llama3 and, for the MLA families, yarn rope)"
            ))
        }
    };
    if let Some(k) = rope.keys().find(|k| !rope_known.contains(&k.as_str())) {
        return Err(format!(
            "rope parameter {k} (rope type {rope_type}): not understood by llmdiff"
        ));
    }
    let num = |k: &str, default: f64| -> R<f64> {
        match rope.get(k) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| format!("rope parameter {k}: expected a number, got {v}")),
        }
    };
    let mut rope_freqs = None;
    let head_dim_cfg = c.usize_opt("head_dim")?;
    let head_dim = head_dim_cfg.unwrap_or(d / n_heads);
    match rope_type.as_str() {
        "default" => {}
        "linear" => {
            if arch != Arch::Llama {
                return Err(format!("rope type linear: not implemented for {model_type}"));
            }
            put("rope.scaling.type", MetaValue::String("linear".into()));
            put("rope.scaling.factor", MetaValue::F32(num("factor", 1.0)? as f32));
        }
        "llama3" => {
            if arch != Arch::Llama {
                return Err(format!("rope type llama3: not implemented for {model_type}"));
            }
            rope_freqs = Some(llama3_factors(
                rope_theta,
                head_dim,
                num("factor", 8.0)?,
                num("low_freq_factor", 1.0)?,
                num("high_freq_factor", 4.0)?,
                num("original_max_position_embeddings", 8192.0)?,
            ));
        }
        "yarn" => {
            // The reference's YaRN (config.rs) takes the factor, the original context and
            // DeepSeek's log multiplier; beta_fast/slow and mscale must be its fixed values.
            if num("beta_fast", 32.0)? != 32.0 || num("beta_slow", 1.0)? != 1.0 {
                return Err("rope parameters beta_fast/beta_slow: only 32/1 are implemented".into());
            }
            let mscale = num("mscale", 1.0)?;
            let mscale_all = rope.get("mscale_all_dim").and_then(|v| v.as_f64());
            if !arch.is_mla() && (rope.contains_key("mscale") || mscale_all.is_some()) {
                return Err(format!(
                    "rope parameters mscale/mscale_all_dim: DeepSeek's YaRN attention factor is not implemented for {model_type}"
                ));
            }
            if arch.is_mla() && mscale_all.is_some_and(|m| m != mscale) {
                return Err(format!(
                    "rope parameters mscale {mscale} and mscale_all_dim {mscale_all:?} differ: not implemented"
                ));
            }
            put("rope.scaling.type", MetaValue::String("yarn".into()));
            put("rope.scaling.factor", MetaValue::F32(num("factor", 1.0)? as f32));
            if let Some(o) = rope.get("original_max_position_embeddings").and_then(|v| v.as_u64()) {
                put("rope.scaling.original_context_length", MetaValue::U32(o as u32));
            }
            if let Some(m) = mscale_all {
                // convert_hf_to_gguf.py's deepseek2 writes 0.1 × mscale_all_dim.
                put("rope.scaling.yarn_log_multiplier", MetaValue::F32((0.1 * m) as f32));
            }
        }
        _ => unreachable!("refused above"),
    }

    let mut mla = None;
    let mut n_experts = 0;
    match arch {
        Arch::Gemma2 | Arch::Gemma3 => {
            put("attention.head_count_kv", u32v(n_kv));
            put("attention.key_length", u32v(head_dim));
            put("attention.value_length", u32v(head_dim));
            // The reference scales scores by 1/√head_dim, or 1/√(d/heads) for the 27B layer counts
            // (llama.cpp's constants: the file has no key for it).
            let big = if arch == Arch::Gemma2 { 46 } else { 62 };
            let want = if n_layers == big { d / n_heads } else { head_dim };
            if let Some(q) = c.usize_opt("query_pre_attn_scalar")? {
                if q != want {
                    return Err(format!(
                        "key query_pre_attn_scalar = {q}: llama.cpp (and the reference) scale attention by 1/√{want} for this {} shape",
                        arch.name()
                    ));
                }
            }
            let final_cap = c.f64_opt("final_logit_softcapping")?;
            let attn_cap = c.f64_opt("attn_logit_softcapping")?;
            if arch == Arch::Gemma2 {
                put("attn_logit_softcapping", MetaValue::F32(attn_cap.unwrap_or(0.0) as f32));
                put(
                    "final_logit_softcapping",
                    MetaValue::F32(final_cap.unwrap_or(0.0) as f32),
                );
                put("attention.sliding_window", u32v(window.unwrap_or(4096)));
            } else {
                if let Some(a) = attn_cap {
                    return Err(format!("key attn_logit_softcapping = {a}: not implemented for gemma3"));
                }
                if let Some(f) = final_cap {
                    put("final_logit_softcapping", MetaValue::F32(f as f32));
                }
                if let Some(w) = window {
                    put("attention.sliding_window", u32v(w));
                }
            }
        }
        Arch::GptOss => {
            put("attention.head_count_kv", u32v(n_kv));
            put("attention.key_length", u32v(head_dim));
            put("attention.value_length", u32v(head_dim));
            if let Some(w) = window {
                put("attention.sliding_window", u32v(w));
            }
            // llama.cpp's clamped SwiGLU constants (LLM_FFN_SWIGLU_OAI_MOE): not in the file.
            c.expect(
                "swiglu_alpha",
                &Value::from(1.702),
                "the clamped SwiGLU's alpha is fixed",
            )?;
            c.expect("swiglu_limit", &Value::from(7.0), "the clamped SwiGLU's limit is fixed")?;
            n_experts = c.usize("num_local_experts")?;
            put("expert_count", u32v(n_experts));
            put("expert_used_count", u32v(c.usize("num_experts_per_tok")?));
            put("expert_feed_forward_length", u32v(ffn));
        }
        Arch::Glm4Moe => {
            put("attention.head_count_kv", u32v(n_kv));
            put("attention.key_length", u32v(head_dim));
            put("attention.value_length", u32v(head_dim));
            put(
                "rope.dimension_count",
                u32v((head_dim as f64 * partial.unwrap_or(0.5)) as usize),
            );
            c.get("use_qk_norm"); // the q/k norm tensors are used when present
            n_experts = c.usize("n_routed_experts")?;
            put("expert_count", u32v(n_experts));
            put("expert_used_count", u32v(c.usize("num_experts_per_tok")?));
            put("expert_feed_forward_length", u32v(c.usize("moe_intermediate_size")?));
            put(
                "expert_shared_count",
                u32v(c.usize_opt("n_shared_experts")?.unwrap_or(0)),
            );
            put(
                "leading_dense_block_count",
                u32v(c.usize_opt("first_k_dense_replace")?.unwrap_or(0)),
            );
            put("expert_group_count", u32v(c.usize_opt("n_group")?.unwrap_or(1)));
            put("expert_group_used_count", u32v(c.usize_opt("topk_group")?.unwrap_or(1)));
            put("expert_gating_func", MetaValue::U32(2));
            if let Some(s) = c.f64_opt("routed_scaling_factor")? {
                put("expert_weights_scale", MetaValue::F32(s as f32));
            }
            if c.bool_or("norm_topk_prob", false)? {
                put("expert_weights_norm", MetaValue::Bool(true));
            }
            // The MTP layers after num_hidden_layers are skipped (not part of the forward pass).
            put("nextn_predict_layers", u32v(0));
        }
        Arch::Llama | Arch::Qwen2 | Arch::Qwen3 | Arch::Qwen3Moe => {
            put("attention.head_count_kv", u32v(n_kv));
            put("attention.key_length", u32v(head_dim));
            put("attention.value_length", u32v(head_dim));
            if arch == Arch::Llama {
                put("rope.dimension_count", u32v(head_dim));
            }
            if arch == Arch::Qwen3Moe {
                // transformers 5 writes num_local_experts, earlier versions num_experts.
                n_experts = match c.usize_opt("num_local_experts")? {
                    Some(n) => n,
                    None => c.usize("num_experts")?,
                };
                c.expect("decoder_sparse_step", &Value::from(1), "MoE on every layer only")?;
                c.expect("mlp_only_layers", &Value::Array(vec![]), "MoE on every layer only")?;
                // llama.cpp's qwen3moe graph renormalises the top-k weights whatever the key says.
                c.expect(
                    "norm_topk_prob",
                    &Value::Bool(true),
                    "the top-k weights are renormalised",
                )?;
                put("expert_count", u32v(n_experts));
                put("expert_used_count", u32v(c.usize("num_experts_per_tok")?));
                put("expert_feed_forward_length", u32v(c.usize("moe_intermediate_size")?));
            }
        }
        Arch::Deepseek2 | Arch::Deepseek32 | Arch::GlmDsa => {
            c.expect(
                "rope_interleave",
                &Value::Bool(true),
                "MLA's rope is computed on interleaved pairs",
            )?;
            if let Some(s) = c.str_opt("scoring_func")? {
                if s != "sigmoid" {
                    return Err(format!(
                        "key scoring_func = {s:?}: {model_type} routes with sigmoid scores"
                    ));
                }
            }
            if let Some(s) = c.str_opt("topk_method")? {
                if s != "noaux_tc" {
                    return Err(format!("key topk_method = {s:?}: {model_type} selects noaux_tc"));
                }
            }
            c.expect(
                "moe_layer_freq",
                &Value::from(1),
                "MoE on every layer after the dense lead",
            )?;
            let nope = c.usize("qk_nope_head_dim")?;
            let rope_d = c.usize("qk_rope_head_dim")?;
            let v = c.usize("v_head_dim")?;
            if let Some(q) = c.usize_opt("qk_head_dim")? {
                if q != nope + rope_d {
                    return Err(format!(
                        "key qk_head_dim = {q}: not qk_nope_head_dim + qk_rope_head_dim"
                    ));
                }
            }
            let kv_lora = c.usize("kv_lora_rank")?;
            // convert_hf_to_gguf.py: MLA as MQA with latent-sized heads.
            n_kv = 1;
            put("attention.head_count_kv", u32v(1));
            put("attention.key_length", u32v(kv_lora + rope_d));
            put("attention.value_length", u32v(kv_lora));
            put("attention.key_length_mla", u32v(nope + rope_d));
            put("attention.value_length_mla", u32v(v));
            put("attention.kv_lora_rank", u32v(kv_lora));
            if let Some(q) = c.usize_opt("q_lora_rank")? {
                put("attention.q_lora_rank", u32v(q));
            }
            put("rope.dimension_count", u32v(rope_d));
            n_experts = c.usize("n_routed_experts")?;
            let first_dense = c.usize_opt("first_k_dense_replace")?.unwrap_or(0);
            if let Some(t) = c.get("mlp_layer_types") {
                let want: Vec<Value> = (0..n_layers)
                    .map(|l| Value::from(if l < first_dense { "dense" } else { "sparse" }))
                    .collect();
                if t != &Value::Array(want) {
                    return Err(format!(
                        "key mlp_layer_types = {t}: only {first_dense} dense layers, then MoE, are implemented"
                    ));
                }
            }
            put("leading_dense_block_count", u32v(first_dense));
            put("expert_count", u32v(n_experts));
            put("expert_used_count", u32v(c.usize("num_experts_per_tok")?));
            put("expert_feed_forward_length", u32v(c.usize("moe_intermediate_size")?));
            put(
                "expert_shared_count",
                u32v(c.usize_opt("n_shared_experts")?.unwrap_or(0)),
            );
            put("expert_group_count", u32v(c.usize_opt("n_group")?.unwrap_or(1)));
            put("expert_group_used_count", u32v(c.usize_opt("topk_group")?.unwrap_or(1)));
            put("expert_gating_func", MetaValue::U32(2));
            if let Some(s) = c.f64_opt("routed_scaling_factor")? {
                put("expert_weights_scale", MetaValue::F32(s as f32));
            }
            if c.bool_or("norm_topk_prob", false)? {
                put("expert_weights_norm", MetaValue::Bool(true));
            }
            if arch.has_indexer() {
                put("attention.indexer.head_count", u32v(c.usize("index_n_heads")?));
                put("attention.indexer.key_length", u32v(c.usize("index_head_dim")?));
                put("attention.indexer.top_k", u32v(c.usize("index_topk")?));
                if let Some(t) = c.get("indexer_types") {
                    let full: Option<Vec<MetaValue>> = t.as_array().and_then(|a| {
                        a.iter()
                            .map(|x| match x.as_str() {
                                Some("full") => Some(MetaValue::Bool(true)),
                                Some("shared") => Some(MetaValue::Bool(false)),
                                _ => None,
                            })
                            .collect()
                    });
                    let items =
                        full.ok_or_else(|| format!("key indexer_types = {t}: expected \"full\"/\"shared\" per layer"))?;
                    put(
                        "attention.indexer.types",
                        MetaValue::Array {
                            elem_type: crate::gguf::value_type::BOOL,
                            items,
                        },
                    );
                }
            }
            mla = Some((nope, v));
        }
    }
    let mxfp4 = c
        .obj
        .get("quantization_config")
        .and_then(|q| q.get("quant_method"))
        .and_then(|m| m.as_str())
        == Some("mxfp4");
    let fp8 = if mxfp4 {
        if arch != Arch::GptOss {
            return Err(format!(
                "quantization_config.quant_method = \"mxfp4\": read for gpt_oss only, not {model_type}"
            ));
        }
        let q = c
            .get("quantization_config")
            .and_then(|q| q.as_object())
            .ok_or("quantization_config")?;
        if let Some(k) = q
            .keys()
            .find(|k| !matches!(k.as_str(), "quant_method" | "modules_to_not_convert"))
        {
            return Err(format!("quantization_config.{k}: not understood by llmdiff"));
        }
        None
    } else {
        quantization(&c)?
    };
    let unknown = c.unknown();
    if let Some(k) = unknown.first() {
        return Err(format!(
            "key {k} in config.json: llmdiff cannot tell whether it changes the {model_type} model ({} unknown: {})",
            unknown.len(),
            unknown.join(", ")
        ));
    }
    Ok(Translated {
        metadata: md,
        hp: Hparams {
            arch,
            d_model: d,
            vocab,
            ffn,
            n_layers,
            n_heads,
            n_kv_heads: n_kv,
            head_dim,
            tied,
            permute_qk: arch == Arch::Llama,
            mla,
            n_experts,
            rope_freqs,
            fp8,
            mxfp4,
        },
    })
}

/// `quantization_config`: DeepSeek-style block FP8 (`quant_method` fp8, `fmt` e4m3,
/// `weight_block_size`), or compressed-tensors' FP8 weights (per tensor, per channel or per block;
/// activations dynamic or none); anything else is refused by name.
fn quantization(c: &Cfg) -> R<Option<Fp8Scheme>> {
    let Some(q) = c.get("quantization_config") else {
        return Ok(None);
    };
    let q = q.as_object().ok_or("key quantization_config: expected an object")?;
    let method = q.get("quant_method").and_then(|v| v.as_str()).unwrap_or("?");
    match method {
        "fp8" => {}
        "compressed-tensors" => return compressed_tensors(q).map(Some),
        _ => {
            return Err(format!(
                "quantization_config.quant_method = {method:?}: llmdiff reads block-scaled fp8 (DeepSeek-V3 style) and compressed-tensors fp8 only"
            ))
        }
    }
    for (k, v) in q {
        match k.as_str() {
            "quant_method" => {}
            "fmt" if v.as_str() == Some("e4m3") => {}
            "activation_scheme" => {} // activations: the reference computes in f32/f64, no quantization
            "weight_block_size" => {}
            "modules_to_not_convert" => {} // those tensors are simply stored unquantized
            _ => return Err(format!("quantization_config.{k} = {v}: not understood by llmdiff")),
        }
    }
    let b = q
        .get("weight_block_size")
        .and_then(|v| v.as_array())
        .and_then(|a| match a[..] {
            [Value::Number(ref r), Value::Number(ref c)] => Some((r.as_u64()? as usize, c.as_u64()? as usize)),
            _ => None,
        })
        .filter(|&(r, c)| r > 0 && c > 0)
        .ok_or("quantization_config.weight_block_size: expected [rows, cols]")?;
    Ok(Some(Fp8Scheme::Block(b.0, b.1)))
}

/// compressed-tensors: one config group of FP8 weights (`type` float, 8 bits, symmetric,
/// static), activations dynamic (quantized by the deployment per token: the reference computes
/// them exactly) or absent; no KV-cache scheme, no sparsity.
fn compressed_tensors(q: &Map<String, Value>) -> R<Fp8Scheme> {
    let bad = |k: &str, v: &Value| Err(format!("quantization_config.{k} = {v}: not implemented by llmdiff"));
    let mut strategy = None;
    for (k, v) in q {
        match k.as_str() {
            "quant_method" | "quantization_status" | "version" | "global_compression_ratio" | "ignore" => {}
            "format" if matches!(v.as_str(), Some("float-quantized") | Some("naive-quantized")) => {}
            "kv_cache_scheme" | "sparsity_config" | "transform_config"
                if v.is_null() || v.as_object().is_some_and(|m| m.is_empty()) => {}
            "config_groups" => {
                let groups = v
                    .as_object()
                    .ok_or("quantization_config.config_groups: expected an object")?;
                if groups.len() != 1 {
                    return bad(k, v);
                }
                let g = groups
                    .values()
                    .next()
                    .and_then(|g| g.as_object())
                    .ok_or("config_groups: not an object")?;
                for (gk, gv) in g {
                    match gk.as_str() {
                        "targets" | "format" => {}
                        "output_activations" if gv.is_null() => {}
                        "input_activations"
                            if gv.is_null() || gv.get("dynamic").and_then(|d| d.as_bool()) == Some(true) => {}
                        "weights" => {
                            let w = gv.as_object().ok_or("config_groups weights: not an object")?;
                            let get = |k: &str| w.get(k).filter(|v| !v.is_null());
                            if get("num_bits").and_then(|v| v.as_u64()) != Some(8)
                                || get("type").and_then(|v| v.as_str()) != Some("float")
                                || get("symmetric").and_then(|v| v.as_bool()) == Some(false)
                                || get("dynamic").and_then(|v| v.as_bool()) == Some(true)
                                || get("group_size").is_some()
                                || get("actorder").is_some()
                            {
                                return bad(&format!("config_groups.{gk}"), gv);
                            }
                            strategy = Some(match get("strategy").and_then(|v| v.as_str()) {
                                Some("tensor") => Fp8Strategy::Tensor,
                                Some("channel") => Fp8Strategy::Channel,
                                Some("block") => {
                                    let b = get("block_structure")
                                        .and_then(|v| v.as_array())
                                        .and_then(|a| {
                                            Some((a.first()?.as_u64()? as usize, a.get(1)?.as_u64()? as usize))
                                        })
                                        .filter(|&(r, c)| r > 0 && c > 0)
                                        .ok_or("config_groups weights.block_structure: expected [rows, cols]")?;
                                    Fp8Strategy::Block(b.0, b.1)
                                }
                                _ => return bad(&format!("config_groups.{gk}.strategy"), gv),
                            });
                        }
                        _ => return bad(&format!("config_groups.{gk}"), gv),
                    }
                }
            }
            _ => return bad(k, v),
        }
    }
    let strategy = strategy.ok_or("quantization_config: no config group with FP8 weights")?;
    Ok(Fp8Scheme::Compressed { strategy })
}

/// Llama 3.1+ per-pair divisors, as convert_hf_to_gguf.py computes them (in f32).
fn llama3_factors(base: f64, dim: usize, factor: f64, low: f64, high: f64, old_ctx: f64) -> Vec<f32> {
    let (factor, low, high, old_ctx) = (factor as f32, low as f32, high as f32, old_ctx as f32);
    let low_wavelen = old_ctx / low;
    let high_wavelen = old_ctx / high;
    (0..dim / 2)
        .map(|i| {
            let freq = 1.0f32 / (base as f32).powf((2 * i) as f32 / dim as f32);
            let wavelen = (2.0 * std::f64::consts::PI) as f32 / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (old_ctx / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn llama(extra: Value) -> Map<String, Value> {
        let mut c = json!({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100, "intermediate_size": 128});
        for (k, v) in extra.as_object().unwrap() {
            c[k] = v.clone();
        }
        c.as_object().unwrap().clone()
    }

    fn meta(t: &Translated, k: &str) -> Option<String> {
        t.metadata.iter().find(|(key, _)| key == k).map(|(_, v)| v.to_string())
    }

    #[test]
    fn both_rope_spellings_give_the_same_metadata() {
        let new = translate(&llama(
            json!({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}),
        ))
        .unwrap();
        let old = translate(&llama(
            json!({"rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 5e5}),
        ))
        .unwrap();
        let old2 = translate(&llama(
            json!({"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 5e5}),
        ))
        .unwrap();
        for t in [&old, &old2] {
            assert_eq!(format!("{:?}", t.metadata), format!("{:?}", new.metadata));
        }
        assert_eq!(meta(&new, "llama.rope.scaling.type").as_deref(), Some("\"linear\""));
        assert_eq!(meta(&new, "llama.rope.freq_base").as_deref(), Some("500000"));
        // llama3 in the old spelling: the frequency factors, 1 above the high band, 8 below the low.
        let t = translate(&llama(
            json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}, "rope_theta": 10000.0}),
        ))
        .unwrap();
        let f = t.hp.rope_freqs.unwrap();
        assert_eq!((f.len(), f[0], f[7]), (8, 1.0, 8.0));
    }

    #[test]
    fn what_changes_the_math_and_is_not_understood_is_refused_by_name() {
        let cases = [
            (
                json!({"rope_scaling": {"type": "dynamic", "factor": 2.0}}),
                "\"dynamic\"",
            ),
            (json!({"rope_parameters": {"rope_type": "longrope"}}), "\"longrope\""),
            (
                json!({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "foo": 1}}),
                "rope parameter foo",
            ),
            (json!({"hidden_act": "gelu"}), "hidden_act"),
            (json!({"mlp_bias": true}), "mlp_bias"),
            (json!({"attention_bias": true}), "attention_bias"),
            (json!({"partial_rotary_factor": 0.5}), "partial_rotary_factor"),
            (json!({"use_sliding_window": true}), "use_sliding_window"),
            (json!({"some_new_knob": 3}), "key some_new_knob"),
            (json!({"quantization_config": {"quant_method": "gptq"}}), "quant_method"),
            (
                json!({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3"}}),
                "weight_block_size",
            ),
        ];
        for (extra, want) in cases {
            let e = translate(&llama(extra.clone()))
                .err()
                .unwrap_or_else(|| panic!("{extra} accepted"));
            assert!(e.contains(want), "{extra}: {e}");
        }
        let mut m = llama(json!({}));
        m.insert("model_type".into(), "mistral".into());
        m.insert("sliding_window".into(), 4096.into());
        assert!(translate(&m).unwrap_err().contains("sliding_window"));
        m.insert("sliding_window".into(), Value::Null);
        assert!(translate(&m).is_ok(), "mistral without a window is llama");
    }

    #[test]
    fn yarn_for_mla_is_written_as_the_converter_writes_it() {
        let c = json!({"model_type": "deepseek_v3", "hidden_size": 64, "num_attention_heads": 4,
            "num_hidden_layers": 2, "vocab_size": 100, "intermediate_size": 96, "moe_intermediate_size": 24,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "kv_lora_rank": 32, "q_lora_rank": 48,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 16, "v_head_dim": 16, "rope_theta": 10000.0,
            "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}});
        let t = translate(c.as_object().unwrap()).unwrap();
        assert_eq!(meta(&t, "deepseek2.rope.scaling.type").as_deref(), Some("\"yarn\""));
        assert_eq!(
            meta(&t, "deepseek2.rope.scaling.original_context_length").as_deref(),
            Some("4096")
        );
        assert_eq!(
            meta(&t, "deepseek2.rope.scaling.yarn_log_multiplier").as_deref(),
            Some("0.1")
        );
        let mut bad = c.clone();
        bad["rope_scaling"]["beta_fast"] = json!(16);
        assert!(translate(bad.as_object().unwrap()).unwrap_err().contains("beta_fast"));
        let mut bad = c.clone();
        bad["rope_interleave"] = json!(false);
        assert!(translate(bad.as_object().unwrap())
            .unwrap_err()
            .contains("rope_interleave"));
        let mut bad = c;
        bad["scoring_func"] = json!("softmax");
        assert!(translate(bad.as_object().unwrap())
            .unwrap_err()
            .contains("scoring_func"));
    }

    #[test]
    fn gemma3_reads_both_rope_spellings() {
        let base = json!({"model_type": "gemma3_text", "hidden_size": 64, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 7, "vocab_size": 100,
            "intermediate_size": 64, "sliding_window": 4, "query_pre_attn_scalar": 16,
            "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention",
                            "sliding_attention", "full_attention", "sliding_attention"]});
        let mut new = base.clone();
        new["rope_parameters"] = json!({"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}});
        let mut old = base.clone();
        old["rope_theta"] = json!(1e6);
        old["rope_local_base_freq"] = json!(1e4);
        let (a, b) = (
            translate(new.as_object().unwrap()).unwrap(),
            translate(old.as_object().unwrap()).unwrap(),
        );
        assert_eq!(format!("{:?}", a.metadata), format!("{:?}", b.metadata));
        assert_eq!(meta(&a, "gemma3.rope.freq_base_swa").as_deref(), Some("10000"));
        let mut bad = base.clone();
        bad["layer_types"][0] = json!("full_attention");
        assert!(translate(bad.as_object().unwrap()).unwrap_err().contains("layer_types"));
        let mut bad = base;
        bad["query_pre_attn_scalar"] = json!(32);
        assert!(translate(bad.as_object().unwrap())
            .unwrap_err()
            .contains("query_pre_attn_scalar"));
    }
}
