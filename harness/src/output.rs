//! Shared helpers for commands: opening models with one-line errors, JSON forms of the
//! references crate's types (which stays free of serde), atomic writes (results and synthesized
//! models) and shell quoting of printed commands.

use anyhow::Context;
use references::config::{Gating, ModelConfig};
use references::{GgufFile, MetaValue};
use serde_json::{json, Value};
use std::path::Path;

/// Checks that `path` is a regular file (after symlinks) before it is opened: a device
/// (`/dev/zero`), a FIFO or a directory named as a model, dump, golden file or run document would
/// hang a read or hash for ever, or fail obscurely.
pub fn check_regular(path: &Path) -> anyhow::Result<()> {
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => anyhow::bail!("{}: no such file", path.display()),
        Err(e) => anyhow::bail!("cannot read {}: {e}", path.display()),
        Ok(m) if !m.is_file() => anyhow::bail!("{}: not a regular file", path.display()),
        Ok(_) => Ok(()),
    }
}

/// Reads a regular file as text ([`check_regular`] first).
pub fn read_text(path: &Path) -> anyhow::Result<String> {
    check_regular(path)?;
    std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
}

/// The unknown keys and tensors `--allow-unknown` accepts, set once by [`set_allow_unknown`].
static ALLOW_UNKNOWN: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();

/// Records `--allow-unknown` for every model [`open_model`] opens afterwards.
pub fn set_allow_unknown(keys: Vec<String>) {
    let _ = ALLOW_UNKNOWN.set(keys);
}

/// Opens a GGUF file (the first shard of a split one opens them all) or an HF checkpoint folder
/// (config.json + safetensors, read as its GGUF conversion: `references::hf`); the error names the
/// file and byte offset. The model carries the `--allow-unknown` names (see `references::allowlist`).
pub fn open_model(path: &Path) -> anyhow::Result<GgufFile> {
    if !path.is_dir() {
        check_regular(path)?;
    }
    let mut file = references::source::open(path).with_context(|| "cannot read the model".to_string())?;
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

/// The name every temp file of an atomic write starts with; the writer's pid follows
/// (`.llmdiff-tmp-PID-XXXXXX`), so a later run can tell a crashed writer's leftover from a live one's.
pub const TEMP_PREFIX: &str = ".llmdiff-tmp-";

/// Whether process `pid` is alive (unknown counts as alive). A zombie (killed, not yet reaped:
/// in a container whose init does not reap) is dead.
fn alive(pid: i32) -> bool {
    #[cfg(unix)]
    {
        // SAFETY: signal 0 checks for the process's existence and sends nothing.
        let r = unsafe { libc::kill(pid, 0) };
        if r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
            return false;
        }
        // /proc/PID/stat: "PID (COMM) STATE ..."; COMM may hold spaces and parentheses.
        let zombie = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rsplit_once(')').map(|(_, rest)| rest.trim_start().starts_with('Z')));
        zombie != Some(true)
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        true
    }
}

/// Removes the temp files in `dir` that a writer killed mid-write left (its pid is gone).
pub fn clean_stale_temps(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(TEMP_PREFIX)) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<i32>().ok()) else {
            continue;
        };
        if pid > 0 && pid != std::process::id() as i32 && !alive(pid) && e.file_type().is_ok_and(|t| t.is_file()) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// A temp file in `dir` for an atomic write, named [`TEMP_PREFIX`]`PID-…`, after removing any a
/// crashed writer left there.
pub fn temp_in(dir: &Path) -> anyhow::Result<tempfile::NamedTempFile> {
    clean_stale_temps(dir);
    tempfile::Builder::new()
        .prefix(&format!("{TEMP_PREFIX}{}-", std::process::id()))
        .tempfile_in(dir)
        .with_context(|| format!("cannot write in {}", dir.display()))
}

/// Writes `bytes` to a temp file beside `path`, then renames it over `path`, so a crash never
/// leaves a half-written file over a good one (and the next write removes the crashed one's temp).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    use std::io::Write;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut tmp = temp_in(dir)?;
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

/// Writes `spec` to `out` through a temp file in the same directory, renamed at the end, so a
/// failure never leaves a half-written model behind.
pub fn write_spec(
    spec: &references::synth::SynthSpec,
    seed: u64,
    out: &Path,
    show_progress: bool,
) -> anyhow::Result<u64> {
    let dir = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let tmp = temp_in(dir)?;
    let bar = progress_bar(show_progress, "synth");
    let bytes = references::synth::write_model(
        spec,
        seed,
        std::io::BufWriter::with_capacity(1 << 20, tmp.as_file()),
        |done, total| {
            bar.set_length(total);
            bar.set_position(done);
        },
    )
    .with_context(|| format!("writing {}", out.display()))?;
    bar.finish_and_clear();
    persist(tmp, out)?;
    Ok(bytes)
}

/// `s` as one shell word: unchanged when it is made of characters no POSIX shell treats
/// specially, else in single quotes (a `'` inside written `'\''`). Every path and argument of
/// a printed reproduction command goes through this, so pasting the command runs only llmdiff.
pub fn shell_quote(s: &str) -> String {
    let plain = !s.is_empty()
        && s.chars().all(|c| {
            c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/' | ',' | ':' | '=' | '@' | '+' | '%')
        });
    if plain {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// `s` for a terminal or a CI log: every control character (ESC, CR, LF, BEL, ...) written as an
/// escape (`\u{1b}`), so text from a file or a server can neither move the cursor, clear the
/// screen nor forge lines of its own.
pub fn term(s: &str) -> String {
    if !s.chars().any(char::is_control) {
        return s.to_string();
    }
    s.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}
