//! HF tensor names → the GGUF names, layouts and values convert_hf_to_gguf.py writes, per family.
//!
//! - renames (`model.layers.N.self_attn.q_proj.weight` → `blk.N.attn_q.weight`, ...): zero-copy;
//! - llama/mistral `q_proj`/`k_proj`: rows permuted from HF's rotate-half order (i, i + d/2) to
//!   llama.cpp's interleaved pairs (2i, 2i + 1), as the converter's `permute` does;
//! - MoE `mlp.experts.E.{gate,up,down}_proj.weight`: stacked into `ffn_*_exps.weight`;
//! - MLA `kv_b_proj.weight` `[H·(nope+v), kv_lora]`: split into `attn_k_b` (torch
//!   `[H, kv_lora, nope]`, k transposed per head) and `attn_v_b` (`[H, v, kv_lora]`);
//! - FP8 e4m3 weights with `weight_scale_inv` blocks: dequantized to F32, `f32(q) × scale` of the
//!   element's block (blocks are partial at the right and bottom edges), exactly as torch's
//!   `q.float() * scale` is;
//! - Llama 3.1+ `rope_freqs.weight`: computed from the rope parameters (config.rs);
//! - gemma's norms: `1 + w` in f32 (HF computes `x·(1 + w.float())`; the converter stores it);
//! - gemma and glm4moe's `post_attention_layernorm` is `post_attention_norm` (gemma's pre-FFN
//!   norm `ffn_norm`, its post-FFN norm `post_ffw_norm`).
//!
//! - gpt-oss's fused experts: `gate_up_proj` de-interleaved into gate and up and transposed,
//!   `down_proj` transposed, as the converter does for unquantized experts; MXFP4 `_blocks` /
//!   `_scales` repacked into GGML MXFP4 blocks as the converter repacks them.
//!
//! Tensors of layers past `num_hidden_layers` (DeepSeek's MTP block) and `rotary_emb.inv_freq`
//! buffers are skipped; any other unknown tensor is refused by name.

use super::config::Hparams;
use super::safetensors::{fp8_e4m3_to_f32, StDtype, StFile};
use crate::arch::Arch;
use crate::ggml_type::GgmlType;
use crate::gguf::GgufError;
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

/// A source tensor: (file, index in that file's list), with its FP8 scales when block-scaled.
#[derive(Clone, Copy, Debug)]
pub struct Src {
    pub t: (usize, usize),
    pub scale: Option<(usize, usize)>,
    /// The FP8 scale block (rows, cols): one scale per block, row-major over the blocks.
    pub block: (usize, usize),
}

/// How a GGUF tensor is made from the folder's.
#[derive(Clone, Debug)]
pub enum Recipe {
    /// Served from the safetensors map as is.
    Direct((usize, usize)),
    /// Dequantized (FP8) or copied, unchanged in layout.
    Copy(Src),
    /// Rows permuted to llama.cpp's RoPE pairs, `n_head` heads.
    Permute { src: Src, n_head: usize },
    /// Experts stacked, expert 0 first.
    Stack(Vec<Src>),
    /// MLA kv_b's k part, transposed per head.
    KB {
        src: Src,
        n_head: usize,
        nope: usize,
        v: usize,
    },
    /// MLA kv_b's v part.
    VB {
        src: Src,
        n_head: usize,
        nope: usize,
        v: usize,
    },
    /// Values computed from config.json (f32).
    Const(Vec<f32>),
    /// Gemma's norms: HF computes x·(1 + w) (in f32); the GGUF holds 1 + w (F32).
    PlusOne(Src),
    /// gpt-oss's fused experts: `gate_up_proj` `[E, d, 2·ff]` (gate and up interleaved by column)
    /// → gate (`which` 0) or up (1) `[E, ff, d]`; its bias `[E, 2·ff]` → `[E, ff]`; `down_proj`
    /// `[E, ff, d]` → `[E, d, ff]` (transposed, `which` 2).
    GptOss { src: Src, which: usize, bias: bool },
    /// gpt-oss's MXFP4 experts: `_blocks` `[E, rows, G, 16]` (value 2i in byte i's low nibble,
    /// 2i+1 in its high one) and `_scales` `[E, rows, G]` (E8M0) → GGML MXFP4 rows (scale byte,
    /// then values j and j+16 in byte j); gate (`which` 0) and up (1) take every other row of
    /// gate_up, down (`which` 2) all of them.
    Mxfp4 {
        blocks: (usize, usize),
        scales: (usize, usize),
        which: usize,
    },
}

/// One tensor of the virtual GGUF.
#[derive(Clone, Debug)]
pub struct Planned {
    pub name: String,
    pub ty: GgmlType,
    pub ne: Vec<u64>,
    pub recipe: Recipe,
}

fn ggml(d: StDtype) -> GgmlType {
    match d {
        StDtype::F32 | StDtype::F8E4M3 => GgmlType::F32,
        StDtype::F16 => GgmlType::F16,
        StDtype::BF16 => GgmlType::BF16,
        StDtype::U8 => GgmlType::MXFP4, // only gpt-oss's MXFP4 blocks get this far
    }
}

/// A layer tensor's HF suffix → its GGUF suffix (after `blk.N.`), for the renamed ones.
fn rename(rest: &str, arch: Arch) -> Option<&'static str> {
    // The families whose post-attention norm is its own tensor (gemma: then a pre-FFN norm;
    // glm4moe: the converter names its pre-FFN norm so).
    match (arch, rest) {
        (Arch::Gemma2 | Arch::Gemma3 | Arch::Glm4Moe | Arch::GptOss, "post_attention_layernorm.weight") => {
            return Some("post_attention_norm.weight")
        }
        (Arch::Gemma2 | Arch::Gemma3, "pre_feedforward_layernorm.weight") => return Some("ffn_norm.weight"),
        (Arch::Gemma2 | Arch::Gemma3, "post_feedforward_layernorm.weight") => return Some("post_ffw_norm.weight"),
        _ => {}
    }
    Some(match rest {
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_proj.bias" => "attn_q.bias",
        "self_attn.k_proj.bias" => "attn_k.bias",
        "self_attn.v_proj.bias" => "attn_v.bias",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.o_proj.bias" => "attn_output.bias",
        "self_attn.sinks" => "attn_sinks.weight",
        "mlp.router.weight" => "ffn_gate_inp.weight",
        "mlp.router.bias" => "ffn_gate_inp.bias",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        "mlp.gate.weight" => "ffn_gate_inp.weight",
        "mlp.gate.e_score_correction_bias" => "exp_probs_b.bias",
        "mlp.shared_experts.gate_proj.weight" => "ffn_gate_shexp.weight",
        "mlp.shared_experts.up_proj.weight" => "ffn_up_shexp.weight",
        "mlp.shared_experts.down_proj.weight" => "ffn_down_shexp.weight",
        "self_attn.q_a_proj.weight" => "attn_q_a.weight",
        "self_attn.q_a_layernorm.weight" => "attn_q_a_norm.weight",
        "self_attn.q_b_proj.weight" => "attn_q_b.weight",
        "self_attn.kv_a_proj_with_mqa.weight" => "attn_kv_a_mqa.weight",
        "self_attn.kv_a_layernorm.weight" => "attn_kv_a_norm.weight",
        "self_attn.indexer.wq_b.weight" => "indexer.attn_q_b.weight",
        "self_attn.indexer.wk.weight" => "indexer.attn_k.weight",
        "self_attn.indexer.k_norm.weight" => "indexer.k_norm.weight",
        "self_attn.indexer.k_norm.bias" => "indexer.k_norm.bias",
        "self_attn.indexer.weights_proj.weight" => "indexer.proj.weight",
        _ => return None,
    })
}

/// The torch shape config.json implies for a layer tensor (None: not checked here; the
/// reference checks every tensor's dims when it loads it).
fn expected_shape(rest: &str, hp: &Hparams) -> Option<Vec<usize>> {
    let (d, hd, nh, nkv) = (hp.d_model, hp.head_dim, hp.n_heads, hp.n_kv_heads);
    if hp.mla.is_some() {
        return match rest {
            "input_layernorm.weight" | "post_attention_layernorm.weight" => Some(vec![d]),
            _ => None,
        };
    }
    Some(match rest {
        "input_layernorm.weight" | "post_attention_layernorm.weight" => vec![d],
        "self_attn.q_proj.weight" => vec![nh * hd, d],
        "self_attn.k_proj.weight" | "self_attn.v_proj.weight" => vec![nkv * hd, d],
        "self_attn.o_proj.weight" => vec![d, nh * hd],
        "self_attn.q_norm.weight" | "self_attn.k_norm.weight" => vec![hd],
        "mlp.gate_proj.weight" | "mlp.up_proj.weight" if hp.n_experts == 0 => vec![hp.ffn, d],
        "mlp.down_proj.weight" if hp.n_experts == 0 => vec![d, hp.ffn],
        "mlp.gate.weight" => vec![hp.n_experts, d],
        _ => return None,
    })
}

/// One layer's experts of one projection: expert index → (HF name, source).
type Experts = BTreeMap<usize, (String, Src)>;

/// Plans every GGUF tensor of the folder, in the converter's order (globals, then layers).
pub fn plan(hp: &Hparams, files: &[StFile], paths: &[PathBuf]) -> Result<Vec<Planned>, GgufError> {
    let err = |t: (usize, usize), msg: String| GgufError {
        file: paths[t.0].display().to_string(),
        offset: 0,
        msg: format!("tensor {}: {msg}", files[t.0].tensors[t.1].name),
    };
    let mut by_name: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
    for (fi, f) in files.iter().enumerate() {
        for (ti, t) in f.tensors.iter().enumerate() {
            if by_name.insert(&t.name, (fi, ti)).is_some() {
                return Err(err((fi, ti), "in two shards".into()));
            }
        }
    }
    let st = |t: (usize, usize)| &files[t.0].tensors[t.1];
    // Scales belong to their weights.
    use super::config::{Fp8Scheme, Fp8Strategy};
    let scale_suffix = match hp.fp8 {
        Some(Fp8Scheme::Compressed { .. }) => ".weight_scale",
        _ => ".weight_scale_inv",
    };
    // (the scale tensor, its block) of an FP8 weight; None for the other dtypes.
    type Scaled = Option<((usize, usize), (usize, usize))>;
    let scale_of = |w: &str, t: (usize, usize)| -> Result<Scaled, GgufError> {
        let s = w.strip_suffix(".weight").map(|p| format!("{p}{scale_suffix}"));
        let scale = s.as_deref().and_then(|s| by_name.get(s)).copied();
        let wt = st(t);
        match (wt.dtype, scale) {
            (StDtype::F8E4M3, None) => Err(err(t, format!("F8_E4M3 without its {}", &scale_suffix[1..]))),
            (StDtype::F8E4M3, Some(s)) => {
                let Some(scheme) = hp.fp8 else {
                    return Err(err(t, "F8_E4M3, but config.json has no quantization_config".into()));
                };
                let [rows, cols] = wt.shape[..] else {
                    return Err(err(
                        t,
                        format!("F8_E4M3 of shape {:?}: only 2-D weights are scaled", wt.shape),
                    ));
                };
                let (br, bc) = match scheme {
                    Fp8Scheme::Block(r, c)
                    | Fp8Scheme::Compressed {
                        strategy: Fp8Strategy::Block(r, c),
                    } => (r, c),
                    Fp8Scheme::Compressed {
                        strategy: Fp8Strategy::Tensor,
                    } => (rows.max(1), cols.max(1)),
                    Fp8Scheme::Compressed {
                        strategy: Fp8Strategy::Channel,
                    } => (1, cols.max(1)),
                };
                let n_blocks = rows.div_ceil(br) * cols.div_ceil(bc);
                let sc = st(s);
                if sc.n_elems() != n_blocks || sc.dtype != StDtype::F32 {
                    return Err(err(
                        s,
                        format!(
                            "{} {:?}, expected F32 with {n_blocks} scales ({br}×{bc} blocks of {rows}×{cols})",
                            sc.dtype.name(),
                            sc.shape
                        ),
                    ));
                }
                Ok(Some((s, (br, bc))))
            }
            (_, Some(s)) => Err(err(s, "a scale for a weight that is not F8_E4M3".into())),
            (_, None) => Ok(None),
        }
    };
    let src = |name: &str, t| -> Result<Src, GgufError> {
        let sc = scale_of(name, t)?;
        Ok(Src {
            t,
            scale: sc.map(|s| s.0),
            block: sc.map_or((1, 1), |s| s.1),
        })
    };
    let ne_of = |shape: &[usize]| shape.iter().rev().map(|&d| d as u64).collect::<Vec<u64>>();
    let out_ty = |s: &Src| ggml(st(s.t).dtype);
    let mut globals = Vec::new();
    let mut layers: Vec<Vec<Planned>> = vec![Vec::new(); hp.n_layers];
    // (layer, which) → expert index → source
    let mut experts: BTreeMap<(usize, &'static str), Experts> = BTreeMap::new();
    for (&name, &t) in &by_name {
        if name.ends_with(scale_suffix) {
            let w = name.replace(scale_suffix, ".weight");
            if !by_name.contains_key(w.as_str()) {
                return Err(err(t, "a scale without its weight".into()));
            }
            continue;
        }
        if name.ends_with("rotary_emb.inv_freq") {
            continue; // a buffer recomputed from config.json
        }
        let direct_or_copy = |s: Src| {
            if s.scale.is_some() {
                Recipe::Copy(s)
            } else {
                Recipe::Direct(s.t)
            }
        };
        let global = match name {
            "model.embed_tokens.weight" => Some("token_embd.weight"),
            "model.norm.weight" => Some("output_norm.weight"),
            "lm_head.weight" => {
                if hp.tied {
                    continue; // the converter skips it: the output is the embeddings
                }
                Some("output.weight")
            }
            _ => None,
        };
        if let Some(g) = global {
            let s = src(name, t)?;
            let shape = &st(t).shape;
            let want = if g == "output_norm.weight" {
                vec![hp.d_model]
            } else {
                vec![hp.vocab, hp.d_model]
            };
            if *shape != want {
                return Err(err(t, format!("shape {shape:?}, config.json implies {want:?}")));
            }
            let plus_one = hp.arch.is_gemma() && g == "output_norm.weight";
            globals.push(Planned {
                name: g.into(),
                ty: if plus_one { GgmlType::F32 } else { out_ty(&s) },
                ne: ne_of(shape),
                recipe: if plus_one {
                    Recipe::PlusOne(s)
                } else {
                    direct_or_copy(s)
                },
            });
            continue;
        }
        let Some(rest) = name.strip_prefix("model.layers.") else {
            return Err(err(
                t,
                format!("not a tensor of a {} checkpoint llmdiff knows", hp.arch.name()),
            ));
        };
        let (l, rest) = rest.split_once('.').unwrap_or((rest, ""));
        let Ok(l) = l.parse::<usize>() else {
            return Err(err(t, "not a tensor llmdiff knows".into()));
        };
        if l >= hp.n_layers {
            continue; // the MTP block after num_hidden_layers (not part of the forward pass)
        }
        let s = src(name, t)?;
        let shape = st(t).shape.clone();
        if let Some(want) = expected_shape(rest, hp) {
            if shape != want {
                return Err(err(t, format!("shape {shape:?}, config.json implies {want:?}")));
            }
        }
        if hp.arch == Arch::GptOss && hp.mxfp4 && rest.starts_with("mlp.experts.") && rest.ends_with("_scales") {
            continue; // read with its _blocks
        }
        if hp.arch == Arch::GptOss && hp.mxfp4 && rest.starts_with("mlp.experts.") && rest.ends_with("_blocks") {
            let base = name.strip_suffix("_blocks").expect("checked");
            let Some(&sc) = by_name.get(format!("{base}_scales").as_str()) else {
                return Err(err(t, "MXFP4 blocks without their _scales".into()));
            };
            let (bs, ss) = (&st(t).shape, &st(sc).shape);
            let (n, d, ffn) = (hp.n_experts, hp.d_model, hp.ffn);
            let (rows, inner) = if rest.contains("gate_up") {
                (2 * ffn, d)
            } else {
                (d, ffn)
            };
            let want_b = [n, rows, inner / 32, 16];
            if st(t).dtype != StDtype::U8 || bs[..] != want_b || inner % 32 != 0 {
                return Err(err(
                    t,
                    format!("{} {bs:?}, config.json implies U8 {want_b:?}", st(t).dtype.name()),
                ));
            }
            if st(sc).dtype != StDtype::U8 || ss[..] != want_b[..3] {
                return Err(err(
                    sc,
                    format!("{} {ss:?}, expected U8 {:?}", st(sc).dtype.name(), &want_b[..3]),
                ));
            }
            let ne = |r: usize| vec![inner as u64, r as u64, n as u64];
            let mk = |g: &str, which: usize, r: usize| Planned {
                name: format!("blk.{l}.{g}"),
                ty: GgmlType::MXFP4,
                ne: ne(r),
                recipe: Recipe::Mxfp4 {
                    blocks: t,
                    scales: sc,
                    which,
                },
            };
            if rest.contains("gate_up") {
                layers[l].push(mk("ffn_gate_exps.weight", 0, ffn));
                layers[l].push(mk("ffn_up_exps.weight", 1, ffn));
            } else {
                layers[l].push(mk("ffn_down_exps.weight", 2, d));
            }
            continue;
        }
        if st(t).dtype == StDtype::U8 {
            return Err(err(
                t,
                "dtype U8: only gpt-oss's MXFP4 expert blocks (quant_method mxfp4) are read".into(),
            ));
        }
        if hp.arch == Arch::GptOss {
            let n = hp.n_experts;
            let planned = |g: &str, which: usize, bias: bool, ne: Vec<u64>| Planned {
                name: format!("blk.{l}.{g}"),
                ty: out_ty(&s),
                ne,
                recipe: Recipe::GptOss { src: s, which, bias },
            };
            let dims_ok = |want: &[usize]| shape[..] == *want;
            let (ffn, d) = (hp.ffn, hp.d_model);
            let (nu, fu, du) = (n as u64, ffn as u64, d as u64);
            let bad = |w: &[usize]| err(t, format!("shape {shape:?}, config.json implies {w:?}"));
            match rest {
                "mlp.experts.gate_up_proj" => {
                    if !dims_ok(&[n, d, 2 * ffn]) {
                        return Err(bad(&[n, d, 2 * ffn]));
                    }
                    layers[l].push(planned("ffn_gate_exps.weight", 0, false, vec![du, fu, nu]));
                    layers[l].push(planned("ffn_up_exps.weight", 1, false, vec![du, fu, nu]));
                    continue;
                }
                "mlp.experts.gate_up_proj_bias" => {
                    if !dims_ok(&[n, 2 * ffn]) {
                        return Err(bad(&[n, 2 * ffn]));
                    }
                    layers[l].push(planned("ffn_gate_exps.bias", 0, true, vec![fu, nu]));
                    layers[l].push(planned("ffn_up_exps.bias", 1, true, vec![fu, nu]));
                    continue;
                }
                "mlp.experts.down_proj" => {
                    if !dims_ok(&[n, ffn, d]) {
                        return Err(bad(&[n, ffn, d]));
                    }
                    layers[l].push(planned("ffn_down_exps.weight", 2, false, vec![fu, du, nu]));
                    continue;
                }
                "mlp.experts.down_proj_bias" => {
                    if !dims_ok(&[n, d]) {
                        return Err(bad(&[n, d]));
                    }
                    layers[l].push(Planned {
                        name: format!("blk.{l}.ffn_down_exps.bias"),
                        ty: out_ty(&s),
                        ne: vec![du, nu],
                        recipe: direct_or_copy(s),
                    });
                    continue;
                }
                _ => {}
            }
        }
        if let Some(e) = rest.strip_prefix("mlp.experts.") {
            let (idx, which) = e.split_once('.').unwrap_or((e, ""));
            let which: &'static str = match which {
                "gate_proj.weight" => "ffn_gate_exps.weight",
                "up_proj.weight" => "ffn_up_exps.weight",
                "down_proj.weight" => "ffn_down_exps.weight",
                _ => return Err(err(t, "not an expert tensor llmdiff knows".into())),
            };
            let Some(idx) = idx.parse::<usize>().ok().filter(|&i| i < hp.n_experts) else {
                return Err(err(t, format!("expert index outside the {} experts", hp.n_experts)));
            };
            experts
                .entry((l, which))
                .or_default()
                .insert(idx, (name.to_string(), s));
            continue;
        }
        if rest == "self_attn.kv_b_proj.weight" {
            let Some((nope, v)) = hp.mla else {
                return Err(err(t, "kv_b_proj in a model without MLA".into()));
            };
            let nh = hp.n_heads;
            if shape.len() != 2 || shape[0] != nh * (nope + v) {
                return Err(err(
                    t,
                    format!(
                        "shape {shape:?}, config.json implies [{}, kv_lora_rank]",
                        nh * (nope + v)
                    ),
                ));
            }
            let kvl = shape[1] as u64;
            let ty = out_ty(&s);
            layers[l].push(Planned {
                name: format!("blk.{l}.attn_k_b.weight"),
                ty,
                ne: vec![nope as u64, kvl, nh as u64],
                recipe: Recipe::KB {
                    src: s,
                    n_head: nh,
                    nope,
                    v,
                },
            });
            layers[l].push(Planned {
                name: format!("blk.{l}.attn_v_b.weight"),
                ty,
                ne: vec![kvl, v as u64, nh as u64],
                recipe: Recipe::VB {
                    src: s,
                    n_head: nh,
                    nope,
                    v,
                },
            });
            continue;
        }
        let Some(g) = rename(rest, hp.arch) else {
            return Err(err(
                t,
                format!("not a tensor of a {} checkpoint llmdiff knows", hp.arch.name()),
            ));
        };
        let permute = hp.permute_qk && matches!(rest, "self_attn.q_proj.weight" | "self_attn.k_proj.weight");
        if hp.arch.is_gemma() && rest.ends_with("norm.weight") {
            layers[l].push(Planned {
                name: format!("blk.{l}.{g}"),
                ty: GgmlType::F32,
                ne: ne_of(&shape),
                recipe: Recipe::PlusOne(s),
            });
            continue;
        }
        let recipe = if permute {
            let n_head = if rest.starts_with("self_attn.q") {
                hp.n_heads
            } else {
                hp.n_kv_heads
            };
            if shape.len() != 2 || shape[0] % (2 * n_head) != 0 {
                return Err(err(t, format!("shape {shape:?}: rows are not {n_head} heads of pairs")));
            }
            Recipe::Permute { src: s, n_head }
        } else {
            direct_or_copy(s)
        };
        layers[l].push(Planned {
            name: format!("blk.{l}.{g}"),
            ty: out_ty(&s),
            ne: ne_of(&shape),
            recipe,
        });
    }
    for ((l, which), exps) in experts {
        if exps.len() != hp.n_experts {
            let missing = (0..hp.n_experts).find(|e| !exps.contains_key(e)).unwrap_or(0);
            return Err(GgufError {
                file: paths[0].parent().map(|p| p.display().to_string()).unwrap_or_default(),
                offset: 0,
                msg: format!(
                    "layer {l}: expert {missing}'s {which} is missing ({} of {})",
                    exps.len(),
                    hp.n_experts
                ),
            });
        }
        let first = exps[&0].1;
        let (ty0, shape0) = (out_ty(&first), st(first.t).shape.clone());
        for (name, s) in exps.values() {
            if out_ty(s) != ty0 || st(s.t).shape != shape0 {
                return Err(err(
                    s.t,
                    format!("{name}: experts of one layer differ in dtype or shape"),
                ));
            }
        }
        let mut ne = ne_of(&shape0);
        ne.push(hp.n_experts as u64);
        layers[l].push(Planned {
            name: format!("blk.{l}.{which}"),
            ty: ty0,
            ne,
            recipe: Recipe::Stack(exps.into_values().map(|(_, s)| s).collect()),
        });
    }
    if let Some(f) = &hp.rope_freqs {
        globals.push(Planned {
            name: "rope_freqs.weight".into(),
            ty: GgmlType::F32,
            ne: vec![f.len() as u64],
            recipe: Recipe::Const(f.clone()),
        });
    }
    let mut out = globals;
    for mut l in layers {
        l.sort_by(|a, b| a.name.cmp(&b.name));
        out.extend(l);
    }
    Ok(out)
}

/// The elements of `s` as stored (or dequantized to f32 when FP8), and their size in bytes.
fn elements(s: &Src, files: &[StFile]) -> (Vec<u8>, usize) {
    let f = &files[s.t.0];
    let t = &f.tensors[s.t.1];
    let data = f.data(t);
    let out = match s.scale {
        None => (data.to_vec(), t.dtype.size()),
        Some(sc) => {
            let sf = &files[sc.0];
            let st = &sf.tensors[sc.1];
            let scales: Vec<f32> = sf
                .data(st)
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
                .collect();
            let (rows, cols) = (t.shape[0], t.shape[1]);
            let (br, bc) = s.block;
            let sc_cols = cols.div_ceil(bc);
            let mut out = Vec::with_capacity(rows * cols * 4);
            for r in 0..rows {
                for c in 0..cols {
                    let q = fp8_e4m3_to_f32(data[r * cols + c]);
                    let scale = scales[(r / br) * sc_cols + c / bc];
                    out.extend_from_slice(&(q * scale).to_le_bytes());
                }
            }
            sf.release(st);
            (out, 4)
        }
    };
    f.release(t);
    out
}

/// The derived tensors written: the map and each one's (offset, bytes), in plan order.
pub struct Derived {
    pub map: Option<Mmap>,
    pub offsets: Vec<(u64, u64)>,
}

/// Writes every non-direct tensor of `plan` to an unlinked temporary file and maps it.
pub fn write_derived(
    plan: &[Planned],
    _hp: &Hparams,
    files: &[StFile],
    paths: &[PathBuf],
) -> Result<Derived, GgufError> {
    if plan.iter().all(|p| matches!(p.recipe, Recipe::Direct(_))) {
        return Ok(Derived {
            map: None,
            offsets: Vec::new(),
        });
    }
    static SEQ: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let path = std::env::temp_dir().join(format!(
        ".llmdiff-hf-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let io = |e: std::io::Error| GgufError {
        file: path.display().to_string(),
        offset: 0,
        msg: format!(
            "writing the converted tensors of {} (set TMPDIR to a folder with room): {e}",
            paths[0].parent().map(|p| p.display().to_string()).unwrap_or_default()
        ),
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(io)?;
    let result = (|| {
        let mut w = std::io::BufWriter::new(&file);
        let mut pos = 0u64;
        let mut offsets = Vec::new();
        for p in plan {
            let start = pos;
            let mut put = |bytes: &[u8]| -> std::io::Result<()> {
                w.write_all(bytes)?;
                pos += bytes.len() as u64;
                Ok(())
            };
            match &p.recipe {
                Recipe::Direct(_) => continue,
                Recipe::Copy(s) => put(&elements(s, files).0).map_err(io)?,
                Recipe::GptOss { src, which, bias } => {
                    let (e, es) = elements(src, files);
                    let shape = &files[src.t.0].tensors[src.t.1].shape;
                    let mut out = Vec::with_capacity(e.len());
                    let el = |i: usize| &e[i * es..(i + 1) * es];
                    if *bias {
                        // [E, 2ff] → [E, ff]: every other column from `which`.
                        let (n, w) = (shape[0], shape[1]);
                        for x in 0..n {
                            for j in 0..w / 2 {
                                out.extend_from_slice(el(x * w + 2 * j + which));
                            }
                        }
                    } else if *which < 2 {
                        // [E, d, 2ff] → [E, ff, d]: out[x][j][c] = src[x][c][2j + which].
                        let (n, d, w) = (shape[0], shape[1], shape[2]);
                        for x in 0..n {
                            for j in 0..w / 2 {
                                for c in 0..d {
                                    out.extend_from_slice(el((x * d + c) * w + 2 * j + which));
                                }
                            }
                        }
                    } else {
                        // [E, ff, d] → [E, d, ff]: out[x][r][c] = src[x][c][r].
                        let (n, f, d) = (shape[0], shape[1], shape[2]);
                        for x in 0..n {
                            for r in 0..d {
                                for c in 0..f {
                                    out.extend_from_slice(el((x * f + c) * d + r));
                                }
                            }
                        }
                    }
                    put(&out).map_err(io)?
                }
                Recipe::Mxfp4 { blocks, scales, which } => {
                    let (bf, sf) = (&files[blocks.0], &files[scales.0]);
                    let (bt, stt) = (&bf.tensors[blocks.1], &sf.tensors[scales.1]);
                    let (b, sc) = (bf.data(bt), sf.data(stt));
                    let (n, rows, g) = (bt.shape[0], bt.shape[1], bt.shape[2]);
                    let out_rows: Vec<usize> = if *which < 2 {
                        (0..rows / 2).map(|j| 2 * j + which).collect()
                    } else {
                        (0..rows).collect()
                    };
                    let mut out = Vec::with_capacity(n * out_rows.len() * g * 17);
                    for x in 0..n {
                        for &r in &out_rows {
                            for k in 0..g {
                                let i = (x * rows + r) * g + k;
                                out.push(sc[i]);
                                let blk = &b[i * 16..(i + 1) * 16];
                                let v = |j: usize| (blk[j / 2] >> (4 * (j % 2))) & 0x0F;
                                out.extend((0..16).map(|j| v(j) | (v(j + 16) << 4)));
                            }
                        }
                    }
                    bf.release(bt);
                    sf.release(stt);
                    put(&out).map_err(io)?
                }
                Recipe::PlusOne(s) => {
                    let (e, es) = elements(s, files);
                    let ty = if s.scale.is_some() {
                        GgmlType::F32
                    } else {
                        ggml(files[s.t.0].tensors[s.t.1].dtype)
                    };
                    let mut w = vec![0f32; e.len() / es];
                    crate::dequant::dequantize(ty, &e, &mut w).expect("sizes checked at open");
                    let b: Vec<u8> = w.iter().flat_map(|x| (1.0f32 + x).to_le_bytes()).collect();
                    put(&b).map_err(io)?
                }
                Recipe::Const(v) => {
                    let b: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                    put(&b).map_err(io)?
                }
                Recipe::Stack(srcs) => {
                    for s in srcs {
                        put(&elements(s, files).0).map_err(io)?;
                    }
                }
                Recipe::Permute { src, n_head } => {
                    let (e, es) = elements(src, files);
                    let cols = files[src.t.0].tensors[src.t.1].shape[1];
                    let row = cols * es;
                    let rows = e.len() / row;
                    let hd = rows / n_head;
                    let half = hd / 2;
                    let mut out = Vec::with_capacity(e.len());
                    for h in 0..*n_head {
                        for i in 0..half {
                            for j in 0..2 {
                                let r = h * hd + j * half + i;
                                out.extend_from_slice(&e[r * row..(r + 1) * row]);
                            }
                        }
                    }
                    put(&out).map_err(io)?
                }
                Recipe::KB { src, n_head, nope, v } | Recipe::VB { src, n_head, nope, v } => {
                    let (e, es) = elements(src, files);
                    let kvl = files[src.t.0].tensors[src.t.1].shape[1];
                    let per = nope + v;
                    let mut out = Vec::with_capacity(e.len());
                    let at = |r: usize, c: usize| &e[(r * kvl + c) * es..(r * kvl + c + 1) * es];
                    let k = matches!(p.recipe, Recipe::KB { .. });
                    for h in 0..*n_head {
                        if k {
                            // [H, kv_lora, nope]: out[h][c][j] = kv_b[h·per + j][c]
                            for c in 0..kvl {
                                for j in 0..*nope {
                                    out.extend_from_slice(at(h * per + j, c));
                                }
                            }
                        } else {
                            // [H, v, kv_lora]: out[h][r][c] = kv_b[h·per + nope + r][c]
                            for r in 0..*v {
                                for c in 0..kvl {
                                    out.extend_from_slice(at(h * per + nope + r, c));
                                }
                            }
                        }
                    }
                    put(&out).map_err(io)?
                }
            }
            let n = pos - start;
            let pad = (32 - pos % 32) % 32;
            w.write_all(&vec![0u8; pad as usize]).map_err(io)?;
            pos += pad;
            offsets.push((start, n));
        }
        w.flush().map_err(io)?;
        drop(w);
        // SAFETY: a private read-only map of a file this process created and no one else knows
        // (unlinked below).
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Ok(Derived {
            map: Some(map),
            offsets,
        })
    })();
    let _ = std::fs::remove_file(&path);
    result
}
