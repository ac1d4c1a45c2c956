//! `llmdiff synth`: deterministic random-weight GGUF models from a preset or explicit dims.

use crate::cli::{DimArgs, SynthArgs};
use crate::output::{config_json, write_spec};
use anyhow::{bail, Context};
use references::synth::{preset, SynthSpec, TypeMix, K_M_MIXES, PRESETS};
use references::writer::{parse_size, SplitLimit};
use references::GgmlType;
use serde_json::json;
use std::process::ExitCode;

pub fn run(a: &SynthArgs) -> anyhow::Result<ExitCode> {
    if a.list_presets {
        for (name, about) in PRESETS {
            println!("{name:<18} {about}");
        }
        return Ok(ExitCode::SUCCESS);
    }
    let spec = plan(a)?;
    let Some(out) = &a.output else {
        bail!("synth needs -o OUT.gguf")
    };
    let split = match (a.split_max_tensors, &a.split_max_size) {
        (Some(n), _) => Some(SplitLimit::Tensors(n as usize)),
        (None, Some(s)) => Some(SplitLimit::Bytes(parse_size(s).with_context(|| {
            format!("--split-max-size {s:?}: expected a positive byte count, optionally with K, M or G (e.g. 4G)")
        })?)),
        (None, None) => None,
    };
    let bytes = write_spec(&spec, a.seed, out, !a.json)?;
    let out = &match split {
        Some(limit) => split_output(out, limit)?,
        None => out.clone(),
    };
    if a.json {
        let doc = json!({"output": out.display().to_string(), "preset": spec.name, "weight_type": quant_name(&spec),
                         "seed": a.seed, "tensor_bytes": bytes, "config": config_json(&spec.config)});
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        eprintln!(
            "wrote {} ({}, {}, seed {}, {:.1} MiB of tensors)",
            out.display(),
            spec.name,
            quant_name(&spec),
            a.seed,
            bytes as f64 / (1 << 20) as f64
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Splits the model just written at `out` into shards cut by `limit` beside it (`out` less
/// `.gguf` is the prefix), removes `out`, and returns the first shard's path.
fn split_output(out: &std::path::Path, limit: SplitLimit) -> anyhow::Result<std::path::PathBuf> {
    let file = references::GgufFile::open(out).with_context(|| format!("reading back {}", out.display()))?;
    let prefix = out.with_extension("");
    let paths = references::writer::write_split(&file, limit, &prefix)
        .with_context(|| format!("writing the shards of {}", out.display()))?;
    drop(file);
    std::fs::remove_file(out).with_context(|| format!("removing {}", out.display()))?;
    Ok(paths[0].clone())
}

/// The spec's weight type, its `_K_M` mix name, or `mix` for a preset's per-tensor mix.
fn quant_name(spec: &SynthSpec) -> String {
    match spec.more_bits {
        Some(TypeMix::KM(_)) => format!("{}_M", spec.weight_type.name()),
        Some(TypeMix::Rules(_)) => "mix".to_string(),
        None => spec.weight_type.name().to_string(),
    }
}

/// Turns the arguments into a validated spec before any work starts.
pub fn plan(a: &SynthArgs) -> anyhow::Result<SynthSpec> {
    let base = match (&a.preset, &a.arch) {
        (Some(p), _) => preset(p).with_context(|| {
            let names: Vec<&str> = PRESETS.iter().map(|(n, _)| *n).collect();
            format!("unknown preset {p:?} (presets: {})", names.join(", "))
        })?,
        (None, Some(arch)) => {
            let mut s = preset(if arch == "llama" {
                "llama-tiny"
            } else {
                "deepseek-v3-mini"
            })
            .expect("base preset");
            s.name = format!("custom-{arch}");
            s
        }
        (None, None) => bail!("synth needs --preset NAME or --arch llama|deepseek2 (see --list-presets)"),
    };
    let mut spec = apply_dims(base, &a.dims)?;
    if let Some(q) = &a.quant {
        let mix = K_M_MIXES
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(q) || n.replace('_', "").eq_ignore_ascii_case(q));
        let ty = match mix {
            Some((_, ty)) => *ty,
            None => GgmlType::from_name(q).with_context(|| {
                let mut names: Vec<&str> = GgmlType::ALL.iter().map(|t| t.name()).collect();
                names.extend(K_M_MIXES.iter().map(|(n, _)| *n));
                format!("unknown quant type {q:?} (types: {})", names.join(", "))
            })?,
        };
        if !references::quant::can_quantize(ty) {
            bail!("synth cannot write {ty}: llmdiff reads it but has no quantizer for it (of the newer types it writes IQ4_NL, IQ4_XS, MXFP4, TQ1_0 and TQ2_0)");
        }
        spec.weight_type = ty;
        spec.embd_type = ty;
        // Every weight in `ty` (or the `_K_M` mix): a preset's own per-tensor mix is dropped.
        spec.more_bits = mix.map(|_| TypeMix::KM(GgmlType::Q6K));
    }
    Ok(spec)
}

fn apply_dims(mut s: SynthSpec, d: &DimArgs) -> anyhow::Result<SynthSpec> {
    let c = &mut s.config;
    if let Some(v) = d.n_layers {
        c.n_layers = v;
        // The indexer's full/shared pattern repeats over the new layer count.
        if let Some(ix) = c.indexer.as_mut().filter(|ix| !ix.full.is_empty()) {
            let pattern = ix.full.clone();
            ix.full = (0..v).map(|l| pattern[l % pattern.len()]).collect();
        }
    }
    if let Some(v) = d.d_model {
        c.d_model = v;
    }
    if let Some(v) = d.n_heads {
        c.n_heads = v;
    }
    if let Some(v) = d.n_kv_heads {
        c.n_kv_heads = v;
    }
    if let Some(v) = d.ffn_dim {
        c.ffn_dim = v;
    }
    if let Some(v) = d.vocab {
        c.vocab = v;
    }
    if let (Some(v), Some(moe)) = (d.n_experts, c.moe.as_mut()) {
        moe.n_experts = v;
        moe.n_groups = moe.n_groups.min(v).max(1);
        moe.n_groups_used = moe.n_groups_used.min(moe.n_groups);
        moe.n_used = moe.n_used.min(v);
    }
    if let Some(moe) = c.moe.as_mut() {
        if let Some(v) = d.n_experts_used {
            if v == 0 || v > moe.n_experts {
                bail!("--n-experts-used {v}: 1 to the {} experts", moe.n_experts);
            }
            moe.n_used = v;
            // Grouped routing must still offer v experts: every group stays eligible.
            moe.n_groups_used = moe.n_groups;
        }
        if let Some(v) = d.expert_ffn {
            if v == 0 || v % 32 != 0 {
                bail!("--expert-ffn must be a positive multiple of 32 (the quant block size)");
            }
            moe.expert_ffn = v;
        }
        if let Some(v) = d.n_dense_lead {
            moe.n_dense_lead = v;
        }
    } else if d.n_experts_used.is_some() || d.expert_ffn.is_some() || d.n_dense_lead.is_some() {
        bail!("--n-experts-used, --expert-ffn and --n-dense-lead are for MoE models (deepseek2)");
    }
    if c.n_layers == 0 || c.d_model == 0 || c.n_heads == 0 || c.n_kv_heads == 0 || c.ffn_dim == 0 {
        bail!("dims must be positive");
    }
    if c.d_model % 32 != 0 || c.ffn_dim % 32 != 0 {
        bail!("--d-model and --ffn-dim must be multiples of 32 (the quant block size)");
    }
    if c.vocab < 259 {
        bail!("--vocab must be at least 259 (3 control tokens + 256 byte tokens)");
    }
    if c.mla.is_none() {
        if c.d_model % c.n_heads != 0 || c.n_heads % c.n_kv_heads != 0 {
            bail!("--n-heads must divide --d-model, and --n-kv-heads must divide --n-heads");
        }
        c.head_dim = c.d_model / c.n_heads;
        c.rope_dim = c.head_dim;
    } else {
        c.n_kv_heads = 1;
        c.head_dim = c.d_model / c.n_heads.max(1);
    }
    if let Some(moe) = &c.moe {
        if moe.n_experts % moe.n_groups != 0 || moe.n_dense_lead > c.n_layers {
            bail!("{} experts do not split into {} groups", moe.n_experts, moe.n_groups);
        }
    }
    Ok(s)
}
