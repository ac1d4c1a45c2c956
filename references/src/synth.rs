//! Deterministic random-weight GGUF models (`llmdiff synth`), for llama, deepseek2, glm-dsa,
//! qwen3 and qwen3moe in the llama.cpp tensor layout (deepseek2 and glm-dsa with the
//! attn_k_b/attn_v_b split; glm-dsa with the DSA indexer on its `full` layers and the MTP/nextn
//! block the converter appends; qwen3 with its per-head q/k norms; qwen3moe's metadata only the
//! keys its allowlist takes), in any supported type or a preset's per-tensor mix ([`TypeMix`]).
//!
//! Every tensor's values come from its own RNG stream, seeded by (seed, tensor name, chunk), so
//! the bytes do not depend on thread count or tensor order; a tensor is generated and written a
//! group of chunks at a time, so memory stays bounded whatever its size. Weights are scaled to
//! keep activations near unit variance and the logits peaked (std ≈ 4), so outputs are not flat.

use crate::config::{Arch, Gating, IndexerConfig, MlaConfig, ModelConfig, MoeConfig};
use crate::ggml_type::GgmlType;
use crate::gguf::{value_type, MetaValue};
use crate::quant::{quantize, QuantError};
use crate::writer::{meta_bool, meta_f32, meta_str, meta_str_array, meta_u32, GgufWriter, TensorSpec};
use rayon::prelude::*;
use std::io::{self, Write};

/// A model to synthesize: its config and the weight types.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthSpec {
    pub name: String,
    pub config: ModelConfig,
    /// Type of the 2-D (and expert) weights.
    pub weight_type: GgmlType,
    /// Type of token_embd.
    pub embd_type: GgmlType,
    /// A per-tensor type mix over `weight_type` (the field is named for the first kind, the
    /// `_K_M` mixes): see [`TypeMix`]. None: every weight is `weight_type` (token_embd
    /// `embd_type`); `synth --quant` sets it so.
    pub more_bits: Option<TypeMix>,
}

/// Per-tensor weight types beyond a spec's `weight_type`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum TypeMix {
    /// llama.cpp's `_K_M` mixes (`--quant Q4_K_M`, `Q5_K_M`): this type (Q6_K) for the output
    /// matrix (token_embd when tied), and for attn_v and ffn_down in the layers
    /// [`use_more_bits`] picks.
    KM(GgmlType),
    /// A preset's rule table, like unsloth's UD quants: `(name, type)`, the name without its
    /// `blk.N.` prefix (`attn_v_b.weight`, `indexer.proj.weight`, `token_embd.weight`); the
    /// first rule naming a tensor gives its type, a tensor no rule names keeps the default.
    /// A type whose blocks do not fit the rows falls back as llama.cpp's quantizer does.
    Rules(&'static [(&'static str, GgmlType)]),
}

impl TypeMix {
    /// The rule table's type for tensor `name` (None for `KM` and for names it does not list).
    pub fn rule_for(&self, name: &str) -> Option<GgmlType> {
        let TypeMix::Rules(rules) = self else { return None };
        let tail = name
            .strip_prefix("blk.")
            .and_then(|r| r.split_once('.'))
            .filter(|(idx, _)| idx.parse::<usize>().is_ok())
            .map_or(name, |(_, t)| t);
        rules.iter().find(|(n, _)| *n == tail).map(|(_, t)| *t)
    }
}

/// GLM-5's weights in a mix like unsloth's UD quants: Q4_K embeddings and q projections, Q6_K
/// output and attn_v_b, Q8_0 for the small latent projections, the shared expert and the indexer,
/// Q5_K attn_output and expert down, IQ4_XS expert gate/up and dense down, F16 indexer proj.
/// Norms, the router, the routing bias and the indexer's k_norm stay F32.
pub const GLM5_UD_MIX: &[(&str, GgmlType)] = &[
    ("token_embd.weight", GgmlType::Q4K),
    ("output.weight", GgmlType::Q6K),
    ("attn_q_a.weight", GgmlType::Q4K),
    ("attn_q_b.weight", GgmlType::Q4K),
    ("attn_kv_a_mqa.weight", GgmlType::Q8_0),
    ("attn_k_b.weight", GgmlType::Q8_0),
    ("attn_v_b.weight", GgmlType::Q6K),
    ("attn_output.weight", GgmlType::Q5K),
    ("ffn_gate.weight", GgmlType::Q4K),
    ("ffn_up.weight", GgmlType::Q4K),
    ("ffn_down.weight", GgmlType::IQ4XS),
    ("ffn_gate_exps.weight", GgmlType::IQ4XS),
    ("ffn_up_exps.weight", GgmlType::IQ4XS),
    ("ffn_down_exps.weight", GgmlType::Q5K),
    ("ffn_gate_shexp.weight", GgmlType::Q8_0),
    ("ffn_up_shexp.weight", GgmlType::Q8_0),
    ("ffn_down_shexp.weight", GgmlType::Q8_0),
    ("indexer.attn_q_b.weight", GgmlType::Q8_0),
    ("indexer.attn_k.weight", GgmlType::Q8_0),
    ("indexer.proj.weight", GgmlType::F16),
    ("nextn.eh_proj.weight", GgmlType::Q8_0),
];

/// The `_K_M` mix names `synth --quant` takes beyond the plain types: (name, weight type), the
/// promoted tensors in Q6_K (see [`SynthSpec::more_bits`]).
pub const K_M_MIXES: [(&str, GgmlType); 2] = [("Q4_K_M", GgmlType::Q4K), ("Q5_K_M", GgmlType::Q5K)];

/// llama.cpp's layer choice for the `_K_M` mixes' promoted attn_v and ffn_down: the first and
/// last eighth of the layers and every third one between.
pub fn use_more_bits(layer: usize, n_layers: usize) -> bool {
    let eighth = n_layers / 8;
    layer < eighth || layer >= 7 * n_layers / 8 || (layer - eighth) % 3 == 2
}

/// Preset names, with one line each for `--list-presets`.
pub const PRESETS: &[(&str, &str)] = &[
    ("llama-tiny", "llama, 2 layers, d 256, 8/4 heads, vocab 512, Q8_0 (about 1.5 MB)"),
    ("smollm2-135m", "SmolLM2-135M's exact shapes and types: 30 layers, d 576, 9/3 heads, vocab 49152, Q4_1 + Q8_0 embd"),
    ("deepseek-v3-mini", "deepseek2 MLA + MoE: 3 layers (1 dense), 8 heads, 8 experts in 4 groups, shared expert, sigmoid"),
    ("glm5-mini", "glm-dsa (GLM-5): 64 heads, qk_nope 192, rope 64, v 256, kv_lora 512 (kv_b [28672, 512]), d 512, 3 layers (1 dense) + MTP block, 8 experts, DSA indexer 32x128 with top_k 16 (GLM-5: 2048; prompts over 16 tokens exercise the selection), UD-style quant mix"),
    ("glm5-1layer", "glm-dsa at GLM-5's full width for cost measurements: d 6144, 64 heads, q_lora 2048, one MoE layer of 256 experts (top 8, ffn 2048), indexer 32x128 top_k 2048, vocab 32000, UD-style mix (about 6 GB)"),
    ("qwen3-mini", "qwen3 (q/k RMSNorm, NeoX RoPE): 4 layers, d 512, 8/4 heads of 64, ffn 1024, vocab 1024, Q8_0"),
    ("qwen3moe-mini", "qwen3moe: as qwen3-mini with 8 softmax-routed experts (top 2, renormalised) of ffn 256 in every layer"),
];

/// A qwen3 (or, with `moe`, qwen3moe) config: llama's block with per-head q/k norms and NeoX RoPE.
fn qwen3(
    n_layers: usize,
    d: usize,
    heads: usize,
    kv: usize,
    ffn: usize,
    vocab: usize,
    moe: Option<MoeConfig>,
) -> ModelConfig {
    ModelConfig {
        arch: if moe.is_some() { Arch::Qwen3Moe } else { Arch::Qwen3 },
        n_layers,
        d_model: d,
        n_heads: heads,
        n_kv_heads: kv,
        head_dim: d / heads,
        ffn_dim: ffn,
        vocab,
        rms_eps: 1e-6,
        rope_base: 1000000.0,
        rope_dim: d / heads,
        context_length: 4096,
        tied_embeddings: false,
        mla: None,
        moe,
        yarn: None,
        rope_scaling: Default::default(),
        family: Default::default(),
        indexer: None,
        nextn_layers: 0,
    }
}

fn llama(name: &str, n_layers: usize, d: usize, heads: usize, kv: usize, ffn: usize, vocab: usize) -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        n_layers,
        d_model: d,
        n_heads: heads,
        n_kv_heads: kv,
        head_dim: d / heads,
        ffn_dim: ffn,
        vocab,
        rms_eps: 1e-5,
        rope_base: if name == "smollm2-135m" { 100000.0 } else { 10000.0 },
        rope_dim: d / heads,
        context_length: 8192,
        tied_embeddings: name == "smollm2-135m",
        mla: None,
        moe: None,
        yarn: None,
        rope_scaling: Default::default(),
        family: Default::default(),
        indexer: None,
        nextn_layers: 0,
    }
}

/// The spec for a preset name.
pub fn preset(name: &str) -> Option<SynthSpec> {
    let (config, weight_type, embd_type) = match name {
        "llama-tiny" => (llama(name, 2, 256, 8, 4, 512, 512), GgmlType::Q8_0, GgmlType::Q8_0),
        "smollm2-135m" => (llama(name, 30, 576, 9, 3, 1536, 49152), GgmlType::Q4_1, GgmlType::Q8_0),
        "deepseek-v3-mini" => (
            deepseek2(
                3,
                256,
                8,
                512,
                512,
                MlaConfig {
                    q_lora_rank: Some(256),
                    kv_lora_rank: 256,
                    qk_nope: 32,
                    qk_rope: 16,
                    v_head_dim: 32,
                },
                MoeConfig {
                    n_experts: 8,
                    n_used: 2,
                    n_shared: 1,
                    expert_ffn: 128,
                    n_dense_lead: 1,
                    weights_scale: 2.5,
                    weights_norm: true,
                    gating: Gating::Sigmoid,
                    n_groups: 4,
                    n_groups_used: 2,
                },
            ),
            GgmlType::Q8_0,
            GgmlType::Q8_0,
        ),
        "glm5-mini" => (
            glm_dsa(
                3,
                512,
                1024,
                512,
                Some(256),
                MoeConfig {
                    n_experts: 8,
                    n_used: 2,
                    n_shared: 1,
                    expert_ffn: 256,
                    n_dense_lead: 1,
                    weights_scale: 2.5,
                    weights_norm: true,
                    gating: Gating::Sigmoid,
                    n_groups: 4,
                    n_groups_used: 2,
                },
                (16, vec![true, true, false]),
                1,
            ),
            GgmlType::Q8_0,
            GgmlType::Q8_0,
        ),
        "glm5-1layer" => (
            glm_dsa(
                1,
                6144,
                12288,
                32000,
                Some(2048),
                MoeConfig {
                    n_experts: 256,
                    n_used: 8,
                    n_shared: 1,
                    expert_ffn: 2048,
                    n_dense_lead: 0,
                    weights_scale: 2.5,
                    weights_norm: true,
                    gating: Gating::Sigmoid,
                    n_groups: 1,
                    n_groups_used: 1,
                },
                (2048, vec![true]),
                0,
            ),
            GgmlType::Q8_0,
            GgmlType::Q8_0,
        ),
        "qwen3-mini" => (qwen3(4, 512, 8, 4, 1024, 1024, None), GgmlType::Q8_0, GgmlType::Q8_0),
        "qwen3moe-mini" => (
            qwen3(
                4,
                512,
                8,
                4,
                1024,
                1024,
                Some(MoeConfig {
                    n_experts: 8,
                    n_used: 2,
                    n_shared: 0,
                    expert_ffn: 256,
                    n_dense_lead: 0,
                    weights_scale: 1.0,
                    weights_norm: true,
                    gating: Gating::Softmax,
                    n_groups: 1,
                    n_groups_used: 1,
                }),
            ),
            GgmlType::Q8_0,
            GgmlType::Q8_0,
        ),
        _ => return None,
    };
    // The GLM-5 presets carry a UD-style per-tensor mix; `synth --quant` replaces it.
    let more_bits = match name {
        "glm5-mini" | "glm5-1layer" => Some(TypeMix::Rules(GLM5_UD_MIX)),
        _ => None,
    };
    Some(SynthSpec {
        name: name.to_string(),
        config,
        weight_type,
        embd_type,
        more_bits,
    })
}

/// A glm-dsa (GLM-5, HF `GlmMoeDsa`) config with GLM-5's attention: 64 heads, MLA with kv_lora
/// 512, qk_nope 192, rope 64, v 256 (q_lora as given), rms eps 1e-5, and its DSA indexer of 32
/// heads of 128 with `(top_k, per-layer full/shared)`; `nextn` MTP blocks follow the layers.
#[allow(clippy::too_many_arguments)]
fn glm_dsa(
    n_layers: usize,
    d: usize,
    ffn: usize,
    vocab: usize,
    q_lora_rank: Option<usize>,
    moe: MoeConfig,
    (top_k, full): (usize, Vec<bool>),
    nextn: usize,
) -> ModelConfig {
    let mla = MlaConfig {
        q_lora_rank,
        kv_lora_rank: 512,
        qk_nope: 192,
        qk_rope: 64,
        v_head_dim: 256,
    };
    ModelConfig {
        arch: Arch::GlmDsa,
        rms_eps: 1e-5,
        indexer: Some(IndexerConfig {
            n_heads: 32,
            head_dim: 128,
            top_k,
            full,
            rope_neox: false,
            k_norm_eps: 1e-6,
        }),
        nextn_layers: nextn,
        ..deepseek2(n_layers, d, 64, ffn, vocab, mla, moe)
    }
}

/// A deepseek2 config in the llama.cpp MLA layout (head_count_kv = 1).
pub fn deepseek2(
    n_layers: usize,
    d: usize,
    heads: usize,
    ffn: usize,
    vocab: usize,
    mla: MlaConfig,
    moe: MoeConfig,
) -> ModelConfig {
    ModelConfig {
        arch: Arch::Deepseek2,
        n_layers,
        d_model: d,
        n_heads: heads,
        n_kv_heads: 1,
        head_dim: d / heads,
        ffn_dim: ffn,
        vocab,
        rms_eps: 1e-6,
        rope_base: 10000.0,
        rope_dim: mla.qk_rope,
        context_length: 4096,
        tied_embeddings: false,
        mla: Some(mla),
        moe: Some(moe),
        yarn: None,
        rope_scaling: Default::default(),
        family: Default::default(),
        indexer: None,
        nextn_layers: 0,
    }
}

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug)]
enum Init {
    /// N(0, (gain²/fan_in)), fan_in = ne[0].
    Linear(f32),
    /// 1 + 0.1·N(0,1) (norm weights).
    Norm,
    /// N(0, std²).
    Normal(f32),
}

struct Planned {
    spec: TensorSpec,
    init: Init,
}

fn pick_type(want: GgmlType, ne0: u64) -> GgmlType {
    // K-quants need rows of 256 and the 32-blocks rows of 32: fall back as llama.cpp's quantizer does.
    [want, GgmlType::Q8_0, GgmlType::F16]
        .into_iter()
        .find(|t| ne0.is_multiple_of(t.block_elems() as u64))
        .unwrap()
}

fn plan(spec: &SynthSpec) -> Vec<Planned> {
    let c = &spec.config;
    let (d, vocab) = (c.d_model as u64, c.vocab as u64);
    let mut out = Vec::new();
    let mix = spec.more_bits;
    let mut push = |name: String, ty: GgmlType, ne: &[u64], init: Init| {
        let ty = mix.and_then(|m| m.rule_for(&name)).unwrap_or(ty);
        let ty = if ty == GgmlType::F32 { ty } else { pick_type(ty, ne[0]) };
        out.push(Planned {
            spec: TensorSpec::new(name, ty, ne),
            init,
        });
    };
    let w = spec.weight_type;
    let more_bits = match spec.more_bits {
        Some(TypeMix::KM(t)) => Some(t),
        _ => None,
    };
    let tied_more = more_bits.filter(|_| c.tied_embeddings);
    push(
        "token_embd.weight".into(),
        tied_more.unwrap_or(spec.embd_type),
        &[d, vocab],
        Init::Normal(1.0),
    );
    // The MTP/nextn blocks follow the model's layers: each a full MoE layer plus its nextn tensors.
    for l in 0..c.n_layers + c.nextn_layers {
        let b = |s: &str| format!("blk.{l}.{s}.weight");
        // attn_v and ffn_down (dense, expert and shared) of the layers a `_K_M` mix promotes.
        let wm = more_bits.filter(|_| use_more_bits(l, c.n_layers)).unwrap_or(w);
        push(b("attn_norm"), GgmlType::F32, &[d], Init::Norm);
        match &c.mla {
            None => {
                let (h, kv, hd) = (c.n_heads as u64, c.n_kv_heads as u64, c.head_dim as u64);
                push(b("attn_q"), w, &[d, h * hd], Init::Linear(1.0));
                push(b("attn_k"), w, &[d, kv * hd], Init::Linear(1.0));
                push(b("attn_v"), wm, &[d, kv * hd], Init::Linear(1.0));
                push(b("attn_output"), w, &[h * hd, d], Init::Linear(1.0));
                if matches!(c.arch, Arch::Qwen3 | Arch::Qwen3Moe) {
                    push(b("attn_q_norm"), GgmlType::F32, &[hd], Init::Norm);
                    push(b("attn_k_norm"), GgmlType::F32, &[hd], Init::Norm);
                }
            }
            Some(m) => {
                let h = c.n_heads as u64;
                let (nope, rope, v, kvl) = (
                    m.qk_nope as u64,
                    m.qk_rope as u64,
                    m.v_head_dim as u64,
                    m.kv_lora_rank as u64,
                );
                match m.q_lora_rank {
                    Some(ql) => {
                        push(b("attn_q_a"), w, &[d, ql as u64], Init::Linear(1.0));
                        push(b("attn_q_a_norm"), GgmlType::F32, &[ql as u64], Init::Norm);
                        push(b("attn_q_b"), w, &[ql as u64, h * (nope + rope)], Init::Linear(1.0));
                    }
                    None => push(b("attn_q"), w, &[d, h * (nope + rope)], Init::Linear(1.0)),
                }
                push(b("attn_kv_a_mqa"), w, &[d, kvl + rope], Init::Linear(1.0));
                push(b("attn_kv_a_norm"), GgmlType::F32, &[kvl], Init::Norm);
                // k_b is stored transposed per head: torch [H, kv_lora, nope] -> ne [nope, kv_lora, H].
                // Its fan-in in the forward pass is kv_lora, not ne[0].
                push(
                    b("attn_k_b"),
                    w,
                    &[nope, kvl, h],
                    Init::Normal(1.0 / (kvl as f32).sqrt()),
                );
                push(b("attn_v_b"), w, &[kvl, v, h], Init::Linear(1.0));
                push(b("attn_output"), w, &[h * v, d], Init::Linear(1.0));
                // The DSA indexer: on `full` layers (and the MTP block); `shared` ones carry none.
                if let (Some(ix), Some(ql)) = (&c.indexer, m.q_lora_rank) {
                    if l >= c.n_layers || ix.full.get(l).copied().unwrap_or(true) {
                        let (ih, id) = (ix.n_heads as u64, ix.head_dim as u64);
                        push(b("indexer.k_norm"), GgmlType::F32, &[id], Init::Norm);
                        push(
                            format!("blk.{l}.indexer.k_norm.bias"),
                            GgmlType::F32,
                            &[id],
                            Init::Normal(0.05),
                        );
                        push(b("indexer.proj"), w, &[d, ih], Init::Linear(1.0));
                        push(b("indexer.attn_k"), w, &[d, id], Init::Linear(1.0));
                        push(b("indexer.attn_q_b"), w, &[ql as u64, ih * id], Init::Linear(1.0));
                    }
                }
            }
        }
        push(b("ffn_norm"), GgmlType::F32, &[d], Init::Norm);
        match &c.moe {
            Some(m) if c.is_moe_layer(l) => {
                let (n, eff) = (m.n_experts as u64, m.expert_ffn as u64);
                push(b("ffn_gate_inp"), GgmlType::F32, &[d, n], Init::Linear(1.0));
                if m.gating == Gating::Sigmoid {
                    push(
                        format!("blk.{l}.exp_probs_b.bias"),
                        GgmlType::F32,
                        &[n],
                        Init::Normal(0.05),
                    );
                }
                push(b("ffn_gate_exps"), w, &[d, eff, n], Init::Linear(1.0));
                push(b("ffn_up_exps"), w, &[d, eff, n], Init::Linear(1.0));
                push(b("ffn_down_exps"), wm, &[eff, d, n], Init::Linear(1.0));
                if m.n_shared > 0 {
                    let sh = eff * m.n_shared as u64;
                    push(b("ffn_gate_shexp"), w, &[d, sh], Init::Linear(1.0));
                    push(b("ffn_up_shexp"), w, &[d, sh], Init::Linear(1.0));
                    push(b("ffn_down_shexp"), wm, &[sh, d], Init::Linear(1.0));
                }
            }
            _ => {
                let f = c.ffn_dim as u64;
                push(b("ffn_gate"), w, &[d, f], Init::Linear(1.0));
                push(b("ffn_up"), w, &[d, f], Init::Linear(1.0));
                push(b("ffn_down"), wm, &[f, d], Init::Linear(1.0));
            }
        }
        if l >= c.n_layers {
            // The nextn tensors llama.cpp's converter writes for GLM's MTP block (the checkpoint
            // shares the trunk's embeddings and lm_head, so no nextn.embed_tokens or
            // nextn.shared_head_head).
            push(b("nextn.eh_proj"), w, &[2 * d, d], Init::Linear(1.0));
            push(b("nextn.enorm"), GgmlType::F32, &[d], Init::Norm);
            push(b("nextn.hnorm"), GgmlType::F32, &[d], Init::Norm);
            push(b("nextn.shared_head_norm"), GgmlType::F32, &[d], Init::Norm);
        }
    }
    push("output_norm.weight".into(), GgmlType::F32, &[d], Init::Norm);
    if !c.tied_embeddings {
        push(
            "output.weight".into(),
            more_bits.unwrap_or(w),
            &[d, vocab],
            Init::Linear(4.0),
        );
    }
    out
}

/// GGUF metadata for a spec, in llama.cpp's key names, with a byte-level BPE vocabulary.
pub fn metadata(spec: &SynthSpec) -> Vec<(String, MetaValue)> {
    let c = &spec.config;
    let a = c.arch.name();
    let k = |s: &str| format!("{a}.{s}");
    let mut m = vec![
        meta_str("general.architecture", a),
        meta_str("general.name", &format!("llmdiff-synth {}", spec.name)),
        meta_u32("general.alignment", 32),
        meta_u32(&k("block_count"), (c.n_layers + c.nextn_layers) as u32),
        meta_u32(&k("context_length"), c.context_length as u32),
        meta_u32(&k("embedding_length"), c.d_model as u32),
        meta_u32(&k("feed_forward_length"), c.ffn_dim as u32),
        meta_u32(&k("attention.head_count"), c.n_heads as u32),
        meta_u32(&k("attention.head_count_kv"), c.n_kv_heads as u32),
        meta_f32(&k("rope.freq_base"), c.rope_base),
        meta_f32(&k("attention.layer_norm_rms_epsilon"), c.rms_eps),
        meta_u32(&k("vocab_size"), c.vocab as u32),
        meta_u32(&k("rope.dimension_count"), c.rope_dim as u32),
    ];
    if let Some(mla) = &c.mla {
        m.push(meta_u32(
            &k("attention.q_lora_rank"),
            mla.q_lora_rank.unwrap_or(0) as u32,
        ));
        m.push(meta_u32(&k("attention.kv_lora_rank"), mla.kv_lora_rank as u32));
        m.push(meta_u32(
            &k("attention.key_length"),
            (mla.kv_lora_rank + mla.qk_rope) as u32,
        ));
        m.push(meta_u32(&k("attention.value_length"), mla.kv_lora_rank as u32));
        m.push(meta_u32(
            &k("attention.key_length_mla"),
            (mla.qk_nope + mla.qk_rope) as u32,
        ));
        m.push(meta_u32(&k("attention.value_length_mla"), mla.v_head_dim as u32));
    }
    if let Some(ix) = &c.indexer {
        m.push(meta_u32(&k("attention.indexer.head_count"), ix.n_heads as u32));
        m.push(meta_u32(&k("attention.indexer.key_length"), ix.head_dim as u32));
        m.push(meta_u32(&k("attention.indexer.top_k"), ix.top_k as u32));
        let full = (0..c.n_layers).map(|l| MetaValue::Bool(ix.full.get(l).copied().unwrap_or(true)));
        m.push((
            k("attention.indexer.types"),
            MetaValue::Array {
                elem_type: value_type::BOOL,
                items: full.collect(),
            },
        ));
    }
    if c.nextn_layers > 0 {
        m.push(meta_u32(&k("nextn_predict_layers"), c.nextn_layers as u32));
    }
    if let Some(moe) = c.moe.as_ref().filter(|_| c.arch == Arch::Qwen3Moe) {
        // qwen3moe's keys: softmax routing and the renormalisation are the architecture's own.
        m.push(meta_u32(&k("expert_feed_forward_length"), moe.expert_ffn as u32));
        m.push(meta_u32(&k("expert_count"), moe.n_experts as u32));
        m.push(meta_u32(&k("expert_used_count"), moe.n_used as u32));
    } else if let Some(moe) = &c.moe {
        m.push(meta_u32(&k("leading_dense_block_count"), moe.n_dense_lead as u32));
        m.push(meta_u32(&k("expert_feed_forward_length"), moe.expert_ffn as u32));
        m.push(meta_u32(&k("expert_count"), moe.n_experts as u32));
        m.push(meta_u32(&k("expert_used_count"), moe.n_used as u32));
        m.push(meta_u32(&k("expert_shared_count"), moe.n_shared as u32));
        m.push(meta_f32(&k("expert_weights_scale"), moe.weights_scale));
        m.push(meta_bool(&k("expert_weights_norm"), moe.weights_norm));
        m.push(meta_u32(
            &k("expert_gating_func"),
            if moe.gating == Gating::Sigmoid { 2 } else { 1 },
        ));
        m.push(meta_u32(&k("expert_group_count"), moe.n_groups as u32));
        m.push(meta_u32(&k("expert_group_used_count"), moe.n_groups_used as u32));
    }
    let (tokens, types) = synth_vocab(c.vocab);
    m.push(meta_str("tokenizer.ggml.model", "gpt2"));
    m.push(meta_str("tokenizer.ggml.pre", "default"));
    m.push(meta_str_array("tokenizer.ggml.tokens", &tokens));
    let types = types.into_iter().map(MetaValue::I32).collect();
    m.push((
        "tokenizer.ggml.token_type".into(),
        MetaValue::Array {
            elem_type: value_type::I32,
            items: types,
        },
    ));
    m.push((
        "tokenizer.ggml.merges".into(),
        MetaValue::Array {
            elem_type: value_type::STRING,
            items: vec![],
        },
    ));
    m.push(meta_u32("tokenizer.ggml.bos_token_id", 1));
    m.push(meta_u32("tokenizer.ggml.eos_token_id", 2));
    m.push(meta_bool("tokenizer.ggml.add_bos_token", false));
    m
}

/// A byte-level vocabulary: 3 control tokens, the 256 GPT-2 byte symbols, then filler tokens.
fn synth_vocab(vocab: usize) -> (Vec<String>, Vec<i32>) {
    let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        .map(String::from)
        .to_vec();
    let mut types = vec![3, 3, 3];
    for b in 0..=255u8 {
        tokens.push(gpt2_byte_char(b).to_string());
        types.push(1);
    }
    for i in tokens.len()..vocab {
        tokens.push(format!("<synth_{i}>"));
        types.push(4);
    }
    tokens.truncate(vocab);
    types.truncate(vocab);
    (tokens, types)
}

/// GPT-2's `bytes_to_unicode`: printable bytes map to themselves, the rest to U+0100 onwards.
pub fn gpt2_byte_char(b: u8) -> char {
    let printable = |x: u8| (b'!'..=b'~').contains(&x) || (0xA1..=0xAC).contains(&x) || (0xAE..=0xFF).contains(&x);
    if printable(b) {
        return b as char;
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).expect("valid scalar")
}

#[derive(Debug, thiserror::Error)]
pub enum SynthError {
    #[error(transparent)]
    Io(#[from] io::Error),
    #[error(transparent)]
    Quant(#[from] QuantError),
    #[error("vocab {0} is too small: the synthetic vocabulary needs at least 259 tokens")]
    VocabTooSmall(usize),
}

/// Writes the model to `w`, one tensor at a time (a group of RNG chunks at a time within it),
/// calling `progress(done, total)` in tensor-data bytes as it goes. Returns the number of bytes
/// of tensor data.
pub fn write_model<W: Write>(
    spec: &SynthSpec,
    seed: u64,
    w: W,
    mut progress: impl FnMut(u64, u64),
) -> Result<u64, SynthError> {
    if spec.config.vocab < 259 {
        return Err(SynthError::VocabTooSmall(spec.config.vocab));
    }
    let planned = plan(spec);
    let specs = planned.iter().map(|p| p.spec.clone()).collect();
    let total: u64 = planned.iter().map(|p| p.spec.n_bytes()).sum();
    let mut gw = GgufWriter::new(w, &metadata(spec), specs)?;
    let mut done = 0;
    for p in &planned {
        let n = p.spec.ne.iter().product::<u64>() as usize;
        let n_chunks = n.div_ceil(CHUNK);
        gw.write_tensor_with(|out| -> Result<(), SynthError> {
            for group in (0..n_chunks).step_by(GROUP) {
                let parts: Vec<Result<Vec<u8>, QuantError>> = (group..(group + GROUP).min(n_chunks))
                    .into_par_iter()
                    .map(|ci| chunk_bytes(p, seed, ci, CHUNK.min(n - ci * CHUNK)))
                    .collect();
                for part in parts {
                    let part = part?;
                    out.write_all(&part)?;
                    done += part.len() as u64;
                }
                progress(done, total);
            }
            Ok(())
        })?;
    }
    gw.finish()?;
    Ok(total)
}

/// Elements per RNG chunk (a multiple of every block size).
const CHUNK: usize = 1 << 16;
/// Chunks generated (in parallel) before they are written: 4 Mi elements, about 16 MiB of f32.
const GROUP: usize = 64;

/// Chunk `ci` (of `len` elements) of tensor `p`, quantized.
fn chunk_bytes(p: &Planned, seed: u64, ci: usize, len: usize) -> Result<Vec<u8>, QuantError> {
    let fan_in = p.spec.ne[0] as f32;
    let base = seed ^ fnv1a(p.spec.name.as_bytes());
    let mut rng = Rng::new(base.wrapping_add((ci as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)));
    let vals: Vec<f32> = (0..len)
        .map(|_| {
            let z = rng.normal();
            match p.init {
                Init::Linear(gain) => z * gain / fan_in.sqrt(),
                Init::Norm => 1.0 + 0.1 * z,
                Init::Normal(s) => z * s,
            }
        })
        .collect();
    quantize(p.spec.ty, &vals)
}

fn fnv1a(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// xoshiro256** seeded by splitmix64, with Box–Muller normals.
struct Rng {
    s: [u64; 4],
    spare: Option<f32>,
}

impl Rng {
    fn new(mut seed: u64) -> Rng {
        let mut next = || {
            seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = seed;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
            spare: None,
        }
    }
    fn next_u64(&mut self) -> u64 {
        let r = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        r
    }
    /// Uniform in (0, 1].
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f32 {
        if let Some(z) = self.spare.take() {
            return z;
        }
        let (u1, u2) = (self.uniform(), self.uniform());
        let r = (-2.0 * u1.ln()).sqrt();
        let t = 2.0 * std::f64::consts::PI * u2;
        self.spare = Some((r * t.sin()) as f32);
        (r * t.cos()) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_bytes_are_a_bijection() {
        let chars: std::collections::HashSet<char> = (0..=255u8).map(gpt2_byte_char).collect();
        assert_eq!(chars.len(), 256);
        assert_eq!(gpt2_byte_char(b' '), 'Ġ');
        assert_eq!(gpt2_byte_char(b'\n'), 'Ċ');
        assert_eq!(gpt2_byte_char(b'a'), 'a');
    }

    #[test]
    fn normals_have_unit_variance() {
        let mut r = Rng::new(7);
        let xs: Vec<f64> = (0..100_000).map(|_| r.normal() as f64).collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64;
        assert!(mean.abs() < 0.02, "{mean}");
        assert!((var - 1.0).abs() < 0.02, "{var}");
    }

    #[test]
    fn qwen3_presets_read_back_as_their_config() {
        for name in ["qwen3-mini", "qwen3moe-mini"] {
            let spec = preset(name).unwrap();
            let mut bytes = Vec::new();
            write_model(&spec, 0, &mut bytes, |_, _| {}).unwrap();
            let dir = std::env::temp_dir().join(format!("llmdiff-synth-{name}-{}.gguf", std::process::id()));
            std::fs::write(&dir, &bytes).unwrap();
            let file = crate::GgufFile::open(&dir).unwrap();
            let got = ModelConfig::from_header(&file.header);
            std::fs::remove_file(&dir).ok();
            assert_eq!(got.unwrap(), spec.config, "{name}");
            assert!(file.tensor("blk.3.attn_k_norm.weight").is_some(), "{name}");
        }
    }

    #[test]
    fn glm5_mini_has_the_seed_story_kv_b() {
        let s = preset("glm5-mini").unwrap();
        let m = s.config.mla.as_ref().unwrap();
        assert_eq!(
            (s.config.n_heads * (m.qk_nope + m.v_head_dim), m.kv_lora_rank),
            (28672, 512)
        );
    }

    #[test]
    fn glm5_mini_reads_back_as_glm_dsa_with_its_mix() {
        let spec = preset("glm5-mini").unwrap();
        let mut bytes = Vec::new();
        write_model(&spec, 0, &mut bytes, |_, _| {}).unwrap();
        let path = std::env::temp_dir().join(format!("llmdiff-synth-glm5-mini-{}.gguf", std::process::id()));
        std::fs::write(&path, &bytes).unwrap();
        let file = crate::GgufFile::open(&path).unwrap();
        std::fs::remove_file(&path).ok();
        let got = ModelConfig::from_header(&file.header).unwrap();
        assert_eq!(got, spec.config);
        assert_eq!(
            (got.arch, got.n_layers, got.nextn_layers, got.rms_eps),
            (Arch::GlmDsa, 3, 1, 1e-5)
        );
        let ix = got.indexer.as_ref().unwrap();
        assert_eq!(
            (ix.n_heads, ix.head_dim, ix.top_k, ix.full.as_slice()),
            (32, 128, 16, &[true, true, false][..])
        );
        // Every tensor is one the reference uses, except the MTP block's, which it skips.
        let (blocks, layers) = crate::allowlist::layer_counts(&file.header, got.arch);
        assert_eq!((blocks, layers), (4, 3));
        for t in file.tensors() {
            let role = crate::allowlist::classify_tensor(got.arch, blocks, layers, &t.name);
            match t.name.starts_with("blk.3.") {
                true => assert!(
                    matches!(role, crate::allowlist::Role::Skipped(_)),
                    "{}: {role:?}",
                    t.name
                ),
                false => assert_eq!(role, crate::allowlist::Role::Used, "{}", t.name),
            }
        }
        let ty = |name: &str| file.tensor(name).unwrap_or_else(|| panic!("no {name}")).ty;
        use GgmlType::*;
        for (name, want) in [
            ("token_embd.weight", Q4K),
            ("output.weight", Q6K),
            ("output_norm.weight", F32),
            ("blk.0.attn_q_a.weight", Q4K),
            ("blk.0.attn_q_b.weight", Q4K),
            ("blk.0.attn_kv_a_mqa.weight", Q8_0),
            ("blk.0.attn_k_b.weight", Q8_0),
            ("blk.0.attn_v_b.weight", Q6K),
            ("blk.0.attn_output.weight", Q5K),
            ("blk.0.ffn_gate.weight", Q4K),
            ("blk.0.ffn_up.weight", Q4K),
            ("blk.0.ffn_down.weight", IQ4XS),
            ("blk.1.ffn_gate_exps.weight", IQ4XS),
            ("blk.1.ffn_up_exps.weight", IQ4XS),
            ("blk.1.ffn_down_exps.weight", Q5K),
            ("blk.1.ffn_gate_shexp.weight", Q8_0),
            ("blk.1.ffn_down_shexp.weight", Q8_0),
            ("blk.1.ffn_gate_inp.weight", F32),
            ("blk.1.exp_probs_b.bias", F32),
            ("blk.1.attn_q_a_norm.weight", F32),
            ("blk.1.indexer.attn_q_b.weight", Q8_0),
            ("blk.1.indexer.attn_k.weight", Q8_0),
            ("blk.1.indexer.proj.weight", F16),
            ("blk.1.indexer.k_norm.weight", F32),
            ("blk.1.indexer.k_norm.bias", F32),
            ("blk.3.nextn.eh_proj.weight", Q8_0),
            ("blk.3.nextn.enorm.weight", F32),
            ("blk.3.nextn.hnorm.weight", F32),
            ("blk.3.nextn.shared_head_norm.weight", F32),
            ("blk.3.ffn_down_exps.weight", Q5K),
        ] {
            assert_eq!(ty(name), want, "{name}");
        }
        assert_eq!(file.tensor("blk.1.attn_k_b.weight").unwrap().ne, [192, 512, 64]);
        assert_eq!(
            file.tensor("blk.0.indexer.attn_q_b.weight").unwrap().ne,
            [256, 32 * 128]
        );
        assert_eq!(file.tensor("blk.3.nextn.eh_proj.weight").unwrap().ne, [1024, 512]);
        // Layer 2 is `shared`: it reuses layer 1's selection and carries no indexer.
        assert!(file.tensors().iter().all(|t| !t.name.starts_with("blk.2.indexer.")));
        // `--quant` (more_bits None) puts every weight in one type again.
        let mut plain = spec.clone();
        plain.more_bits = None;
        let p = plan(&plain);
        let ty = |name: &str| p.iter().find(|t| t.spec.name == name).unwrap().spec.ty;
        assert_eq!(ty("blk.1.ffn_gate_exps.weight"), Q8_0);
        assert_eq!(ty("blk.0.indexer.proj.weight"), Q8_0);
        assert_eq!(ty("blk.0.attn_norm.weight"), F32);
    }

    #[test]
    fn glm5_1layer_is_glm5_s_width() {
        let s = preset("glm5-1layer").unwrap();
        let c = &s.config;
        let moe = c.moe.as_ref().unwrap();
        let ix = c.indexer.as_ref().unwrap();
        assert_eq!(
            (c.arch, c.n_layers, c.nextn_layers, c.d_model, c.vocab),
            (Arch::GlmDsa, 1, 0, 6144, 32000)
        );
        assert_eq!(
            (moe.n_experts, moe.n_used, moe.expert_ffn, moe.n_dense_lead),
            (256, 8, 2048, 0)
        );
        assert_eq!((ix.top_k, ix.full.as_slice()), (2048, &[true][..]));
        let p = plan(&s);
        let total: u64 = p.iter().map(|t| t.spec.n_bytes()).sum();
        assert!((5 << 30..8 << 30).contains(&total), "{total} bytes");
    }

    #[test]
    fn k_m_mix_promotes_llama_cpp_s_layers() {
        // llama.cpp's use_more_bits over 32 layers: 0..4, 28..32 and 6, 9, .., 27.
        let picked: Vec<usize> = (0..32).filter(|&l| use_more_bits(l, 32)).collect();
        assert_eq!(picked, [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]);
        let mut s = preset("llama-tiny").unwrap();
        s.config.n_layers = 16;
        s.config.d_model = 512;
        s.config.head_dim = 64;
        s.config.rope_dim = 64;
        s.weight_type = GgmlType::Q4K;
        s.embd_type = GgmlType::Q4K;
        s.more_bits = Some(TypeMix::KM(GgmlType::Q6K));
        let ty = |name: &str| plan(&s).into_iter().find(|p| p.spec.name == name).unwrap().spec.ty;
        assert_eq!(ty("output.weight"), GgmlType::Q6K);
        assert_eq!(ty("token_embd.weight"), GgmlType::Q4K);
        for l in 0..16 {
            let want = if use_more_bits(l, 16) {
                GgmlType::Q6K
            } else {
                GgmlType::Q4K
            };
            assert_eq!(ty(&format!("blk.{l}.attn_v.weight")), want, "layer {l}");
            assert_eq!(ty(&format!("blk.{l}.ffn_down.weight")), want, "layer {l}");
            assert_eq!(ty(&format!("blk.{l}.attn_k.weight")), GgmlType::Q4K, "layer {l}");
        }
    }
}
