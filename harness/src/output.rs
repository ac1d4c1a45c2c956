//! Shared helpers for commands: opening models with one-line errors, and JSON forms of the
//! references crate's types (which stays free of serde).

use anyhow::Context;
use references::config::{Gating, ModelConfig};
use references::{GgufFile, MetaValue};
use serde_json::{json, Value};
use std::path::Path;

/// The unknown keys and tensors `--allow-unknown` accepts, set once by [`set_allow_unknown`].
static ALLOW_UNKNOWN: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();

/// Records `--allow-unknown` for every model [`open_model`] opens afterwards.
pub fn set_allow_unknown(keys: Vec<String>) {
    let _ = ALLOW_UNKNOWN.set(keys);
}

/// Opens a GGUF file; the error names the file and byte offset. The file carries the
/// `--allow-unknown` names (see `references::allowlist`).
pub fn open_model(path: &Path) -> anyhow::Result<GgufFile> {
    if !path.exists() {
        anyhow::bail!("{}: no such file", path.display());
    }
    let mut file = GgufFile::open(path).with_context(|| "cannot read the model".to_string())?;
    file.header.allow_unknown = ALLOW_UNKNOWN.get().cloned().unwrap_or_default();
    Ok(file)
}

/// A metadata value as JSON. Arrays longer than `summarize_over` become
/// `{"array": elem_type, "len": N, "head": [...]}`.
pub fn meta_json(v: &MetaValue, summarize_over: usize) -> Value {
    match v {
        MetaValue::U8(x) => json!(x),
        MetaValue::I8(x) => json!(x),
        MetaValue::U16(x) => json!(x),
        MetaValue::I16(x) => json!(x),
        MetaValue::U32(x) => json!(x),
        MetaValue::I32(x) => json!(x),
        MetaValue::F32(x) => json!(x),
        MetaValue::Bool(x) => json!(x),
        MetaValue::String(s) => json!(s),
        MetaValue::U64(x) => json!(x),
        MetaValue::I64(x) => json!(x),
        MetaValue::F64(x) => json!(x),
        MetaValue::Array { elem_type, items } => {
            if items.len() > summarize_over {
                let head: Vec<Value> = items.iter().take(8).map(|i| meta_json(i, summarize_over)).collect();
                json!({"array_type": elem_type, "len": items.len(), "head": head})
            } else {
                Value::Array(items.iter().map(|i| meta_json(i, summarize_over)).collect())
            }
        }
    }
}

pub fn config_json(c: &ModelConfig) -> Value {
    let mla = c.mla.as_ref().map(|m| {
        json!({"q_lora_rank": m.q_lora_rank, "kv_lora_rank": m.kv_lora_rank, "qk_nope": m.qk_nope,
               "qk_rope": m.qk_rope, "v_head_dim": m.v_head_dim})
    });
    let moe = c.moe.as_ref().map(|m| {
        json!({"n_experts": m.n_experts, "n_used": m.n_used, "n_shared": m.n_shared, "expert_ffn": m.expert_ffn,
               "n_dense_lead": m.n_dense_lead, "weights_scale": m.weights_scale, "weights_norm": m.weights_norm,
               "gating": match m.gating { Gating::Softmax => "softmax", Gating::Sigmoid => "sigmoid" },
               "n_groups": m.n_groups, "n_groups_used": m.n_groups_used})
    });
    let yarn = c.yarn.as_ref().map(
        |y| json!({"factor": y.factor, "original_context": y.original_context, "log_multiplier": y.log_multiplier}),
    );
    let mut doc = json!({
        "arch": c.arch.name(), "n_layers": c.n_layers, "d_model": c.d_model, "n_heads": c.n_heads,
        "n_kv_heads": c.n_kv_heads, "head_dim": c.head_dim, "ffn_dim": c.ffn_dim, "vocab": c.vocab,
        "rms_eps": c.rms_eps, "rope_base": c.rope_base, "rope_dim": c.rope_dim,
        "context_length": c.context_length, "tied_embeddings": c.tied_embeddings,
        "mla": mla, "moe": moe, "yarn": yarn,
    });
    // Shown only when present, so documents of unscaled models keep their form.
    if !c.rope_scaling.is_none() {
        doc["rope_scaling"] = json!({"linear_factor": c.rope_scaling.linear_factor,
                                     "freq_factors": c.rope_scaling.freq_factors});
    }
    doc
}

/// A progress bar on stderr, hidden when `show` is false or stderr is not a terminal.
pub fn progress_bar(show: bool, what: &str) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if !show || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{prefix} [{bar:40}] {bytes}/{total_bytes} {eta}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_prefix(what.to_string());
    bar
}

/// Writes `bytes` to a temp file beside `path`, then renames it over `path`, so a crash never
/// leaves a half-written file over a good one.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut tmp = tempfile::NamedTempFile::new_in(dir).with_context(|| format!("cannot write in {}", dir.display()))?;
    tmp.write_all(bytes)?;
    persist(tmp, path)
}

/// Renames a finished temp file over `path`. Temp files are created 0600; results are meant to be
/// shared (bug attachments, CI artifacts, models), so they become 0644 first.
pub fn persist(tmp: tempfile::NamedTempFile, path: &Path) -> anyhow::Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        tmp.as_file().set_permissions(std::fs::Permissions::from_mode(0o644))?;
    }
    tmp.persist(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}
