//! Golden files for the CI gate (`golden/gate-*.json`): a versioned format (magic + format number)
//! with provenance (model sha256, llmdiff version, backend, TP, tokens, thresholds), per-tap summary
//! statistics with a fixed down-sampled fingerprint, and per-position top-k log-probabilities and
//! entropy. `llmdiff golden bless` writes them (never by hand); `llmdiff gate` re-runs and compares.
//!
//! Format 2 (format 1 is still read) adds what a live server can be checked against without the
//! model file (`gate --server`): top-20 instead of top-8 per position, each prompt's greedy
//! continuation with the distribution that predicted each of its tokens, the vocabulary size, the
//! text of every token id the file uses (a server's logprobs are keyed by token text), and the
//! server-gate thresholds. A file may also hold no taps (`bless --no-taps`: positions only).

use crate::logprobs::{entropy, log_softmax, top_k};
use crate::runner::Runner;
use anyhow::{bail, Context};
use references::tap::{Site, Tap, TapKey};
use references::GgufFile;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

/// The magic string every golden file starts with.
pub const GOLDEN_MAGIC: &str = "llmdiff-golden";
/// Version of [`Golden`] written by this llmdiff; bump on any incompatible change.
pub const GOLDEN_FORMAT: u32 = 2;
/// The oldest format still read (format 1 lacks what `gate --server` needs; the local gate reads it).
pub const GOLDEN_FORMAT_MIN: u32 = 1;
/// Values kept per tap: evenly spaced over the flattened tensor.
pub const FINGERPRINT_LEN: usize = 64;
/// Top-k kept per position (format 1 kept 8; 20 matches vLLM's default `--max-logprobs`).
pub const GOLDEN_TOP_K: usize = 20;
/// Greedy continuation length blessed by default.
pub const GOLDEN_CONTINUATION: usize = 8;
/// The longest continuation a golden file may ask a server for.
pub const MAX_CONTINUATION: usize = 4096;

/// Where the model comes from, portably: a path relative to the repository root, or a synth recipe.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ModelSource {
    Path { path: String },
    Synth { synth: SynthRecipe },
}

/// `llmdiff synth --preset P --quant Q --seed S`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SynthRecipe {
    pub preset: String,
    pub quant: Option<String>,
    pub seed: u64,
}

/// The tolerances a golden file is checked with.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GateThresholds {
    /// Per tap: relative L2 of the fingerprint, and relative change of norm, mean, std, min, max
    /// (each relative to the tensor's norm / std / max |value|).
    pub tap_rel: f64,
    /// Per position: |Δ logprob| of the golden top-k tokens.
    pub logprob_abs: f64,
    /// Per position: |Δ entropy| (nats).
    pub entropy_abs: f64,
    /// `gate --server` (format 2; defaults when absent).
    #[serde(default)]
    pub server: ServerGateThresholds,
}

impl Default for GateThresholds {
    fn default() -> Self {
        GateThresholds {
            tap_rel: 1e-4,
            logprob_abs: 1e-3,
            entropy_abs: 1e-3,
            server: ServerGateThresholds::default(),
        }
    }
}

/// What `gate --server` allows a deployment. A server is not the reference: llama.cpp quantizes
/// activations to Q8 and keeps an f16 KV cache, vLLM runs bf16 kernels, so these are distribution
/// tolerances, not bit tolerances (calibrated in README `gate --server`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServerGateThresholds {
    /// Per position: KLD(golden ‖ server) over the server's top-k set, both renormalized (nats).
    pub kld_position: f64,
    /// Per golden file: the mean of those KLDs (nats).
    pub kld_mean: f64,
    /// Per golden file: positions whose top-1 token is the golden's, in percent, at least.
    pub min_top1_pct: f64,
    /// A top-1 or greedy-token difference is a near-tie, not a failure, when the golden's logprob
    /// of the server's token is within this many nats of the golden's top-1.
    pub tie_margin: f64,
}

impl Default for ServerGateThresholds {
    fn default() -> Self {
        ServerGateThresholds {
            kld_position: 0.25,
            kld_mean: 0.02,
            min_top1_pct: 90.0,
            tie_margin: 0.5,
        }
    }
}

/// Summary of one tapped tensor.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TapSummary {
    pub tap: String,
    pub shape: [usize; 2],
    pub norm: f64,
    pub mean: f64,
    pub std: f64,
    pub min: f64,
    pub max: f64,
    pub nonfinite: u64,
    /// `FINGERPRINT_LEN` values at flat indices i·len/FINGERPRINT_LEN (null where non-finite).
    pub fingerprint: Vec<Option<f32>>,
}

/// One position's next-token distribution.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PositionGolden {
    pub entropy: f64,
    /// `[[id, logprob], ..]`, descending.
    pub top: Vec<(u32, f64)>,
}

/// One prompt of a golden file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GoldenPrompt {
    pub label: String,
    /// Format 2: the prompt's text, decoded from `tokens` (what `gate --server` sends unless
    /// `--send-tokens`; the server's echo must tokenize it back to `tokens`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
    pub tokens: Vec<u32>,
    /// Format 2: the greedy continuation (stopped early at the end-of-sequence token).
    #[serde(default)]
    pub continuation: Vec<u32>,
    /// Position i: the distribution after `tokens[..=i]`.
    pub positions: Vec<PositionGolden>,
    /// Format 2: step t: the distribution that predicted `continuation[t]` (step 0 repeats the
    /// last prompt position).
    #[serde(default)]
    pub continuation_positions: Vec<PositionGolden>,
    /// Empty in a positions-only file (`bless --no-taps`).
    pub taps: Vec<TapSummary>,
}

/// A golden file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Golden {
    pub magic: String,
    pub format: u32,
    pub llmdiff_version: String,
    /// The command that re-blesses this file.
    pub bless_command: String,
    pub model: ModelSource,
    pub model_sha256: String,
    /// "reference" or "cpu".
    pub backend: String,
    pub tp: usize,
    pub thresholds: GateThresholds,
    /// Format 2: the model's vocabulary size (bounds a server's entropy bracket).
    #[serde(default)]
    pub vocab: usize,
    /// Format 2: the continuation length asked for at bless time.
    #[serde(default)]
    pub n_continuation: usize,
    /// Format 2: the decoded text of each token id the file uses (prompts, top-k lists,
    /// continuations) whose text names that token alone in the vocabulary; a server's logprobs
    /// are keyed by token text, so `gate --server` needs no model file.
    #[serde(default)]
    pub token_text: std::collections::BTreeMap<u32, String>,
    /// Format 2: the control tokens among them (`<|im_end|>`): a server may render those as
    /// empty text (llama-cpp-python does), so `gate --server` reads "" as one of them.
    #[serde(default)]
    pub control_tokens: Vec<u32>,
    pub prompts: Vec<GoldenPrompt>,
}

/// The command that re-blesses `path` from its own recipe.
pub fn bless_hint(path: &Path) -> String {
    format!("llmdiff golden bless --update {}", path.display())
}

/// Reads and checks the magic and format of a golden file; errors carry the bless hint.
pub fn read_golden(path: &Path) -> anyhow::Result<Golden> {
    let text = crate::output::read_text(path)?;
    let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    if v.get("magic").and_then(|m| m.as_str()) != Some(GOLDEN_MAGIC) {
        bail!(
            "{}: not an llmdiff golden file (no \"magic\": \"{GOLDEN_MAGIC}\")",
            path.display()
        );
    }
    let format = v.get("format").and_then(|f| f.as_u64()).unwrap_or(0);
    if !(GOLDEN_FORMAT_MIN as u64..=GOLDEN_FORMAT as u64).contains(&format) {
        bail!(
            "{}: golden format {format}, this llmdiff reads formats {GOLDEN_FORMAT_MIN} to {GOLDEN_FORMAT}; re-bless it: {}",
            path.display(),
            bless_hint(path)
        );
    }
    let g: Golden = serde_json::from_value(v).with_context(|| {
        format!(
            "{}: malformed golden file; re-bless it: {}",
            path.display(),
            bless_hint(path)
        )
    })?;
    g.validate().map_err(|e| {
        anyhow::anyhow!(
            "{}: invalid golden file: {e}; re-bless it: {}",
            path.display(),
            bless_hint(path)
        )
    })?;
    Ok(g)
}

/// A threshold as a golden file or an option gives it: a finite number ≥ 0.
pub fn check_threshold(name: &str, x: f64) -> Result<(), String> {
    if x.is_finite() && x >= 0.0 {
        Ok(())
    } else {
        Err(format!("{name} is {x}: a threshold must be a finite number >= 0"))
    }
}

/// `value` against tolerance `tol` as a ratio (over 1: over the tolerance). At equality it passes,
/// also at a tolerance of 0 (0 / 0 is 0 here, not NaN); NaN is over.
pub fn ratio(value: f64, tol: f64) -> f64 {
    if value.is_nan() || tol.is_nan() {
        f64::INFINITY
    } else if value <= tol {
        if tol > 0.0 {
            value / tol
        } else {
            0.0
        }
    } else if tol > 0.0 {
        value / tol
    } else {
        f64::INFINITY
    }
}

impl GateThresholds {
    /// Every threshold finite and ≥ 0; `min_top1_pct` within 0..=100.
    pub fn validate(&self) -> Result<(), String> {
        check_threshold("thresholds.tap_rel", self.tap_rel)?;
        check_threshold("thresholds.logprob_abs", self.logprob_abs)?;
        check_threshold("thresholds.entropy_abs", self.entropy_abs)?;
        let s = &self.server;
        check_threshold("thresholds.server.kld_position", s.kld_position)?;
        check_threshold("thresholds.server.kld_mean", s.kld_mean)?;
        check_threshold("thresholds.server.tie_margin", s.tie_margin)?;
        if !(s.min_top1_pct.is_finite() && (0.0..=100.0).contains(&s.min_top1_pct)) {
            return Err(format!(
                "thresholds.server.min_top1_pct is {}: a percentage within 0..=100",
                s.min_top1_pct
            ));
        }
        Ok(())
    }
}

impl Golden {
    /// The invariants a golden file must hold before any work starts (every one is a way a
    /// hand-edited or truncated file would otherwise pass, panic or run for ever): thresholds
    /// finite and ≥ 0 (`min_top1_pct` within 0..=100); at least one prompt, each with tokens and
    /// one position per token, every position with a finite entropy ≥ 0 and a non-empty top list
    /// of finite logprobs ≤ 0; at most as many continuation positions as continuation tokens;
    /// token ids within the vocabulary when it is known; tap names that are tap keys with a
    /// fingerprint of at most [`FINGERPRINT_LEN`] values; a model sha256 of 64 hex digits; TP ≥ 1
    /// and a backend of `reference` or `cpu`.
    pub fn validate(&self) -> Result<(), String> {
        self.thresholds.validate()?;
        if !(self.model_sha256.len() == 64 && self.model_sha256.bytes().all(|b| b.is_ascii_hexdigit())) {
            return Err("model_sha256 is not 64 hex digits".into());
        }
        if self.tp == 0 {
            return Err("tp is 0".into());
        }
        if self.n_continuation > MAX_CONTINUATION {
            return Err(format!(
                "n_continuation {} (at most {MAX_CONTINUATION})",
                self.n_continuation
            ));
        }
        if self.backend != "reference" && self.backend != "cpu" {
            return Err(format!("backend {:?}: expected \"reference\" or \"cpu\"", self.backend));
        }
        if self.prompts.is_empty() {
            return Err("no prompts: nothing to gate is not a pass".into());
        }
        let in_vocab = |id: u32| self.vocab == 0 || (id as usize) < self.vocab;
        let check_pos = |where_: &str, p: &PositionGolden| -> Result<(), String> {
            if !(p.entropy.is_finite() && p.entropy >= 0.0) {
                return Err(format!("{where_}: entropy {} is not a finite number >= 0", p.entropy));
            }
            if p.top.is_empty() {
                return Err(format!("{where_}: an empty top list"));
            }
            if p.top.len() > 4 * GOLDEN_TOP_K {
                return Err(format!(
                    "{where_}: {} top entries (at most {})",
                    p.top.len(),
                    4 * GOLDEN_TOP_K
                ));
            }
            for &(id, lp) in &p.top {
                if !(lp.is_finite() && lp <= 1e-6) {
                    return Err(format!(
                        "{where_}: logprob {lp} of token {id} is not a finite number <= 0"
                    ));
                }
                if !in_vocab(id) {
                    return Err(format!(
                        "{where_}: token {id} is outside the vocabulary ({})",
                        self.vocab
                    ));
                }
            }
            Ok(())
        };
        for (pi, p) in self.prompts.iter().enumerate() {
            let at = format!("prompt {}", pi + 1);
            if p.tokens.is_empty() {
                return Err(format!("{at}: no tokens"));
            }
            if p.positions.len() != p.tokens.len() {
                return Err(format!(
                    "{at}: {} positions for {} tokens (one per token)",
                    p.positions.len(),
                    p.tokens.len()
                ));
            }
            if p.continuation_positions.len() > p.continuation.len() {
                return Err(format!(
                    "{at}: {} continuation positions for {} continuation tokens",
                    p.continuation_positions.len(),
                    p.continuation.len()
                ));
            }
            if let Some(id) = p.tokens.iter().chain(&p.continuation).find(|&&id| !in_vocab(id)) {
                return Err(format!("{at}: token {id} is outside the vocabulary ({})", self.vocab));
            }
            for (i, pos) in p.positions.iter().enumerate() {
                check_pos(&format!("{at} position {i}"), pos)?;
            }
            for (i, pos) in p.continuation_positions.iter().enumerate() {
                check_pos(&format!("{at} continuation step {i}"), pos)?;
            }
            for tap in &p.taps {
                if tap.tap.parse::<TapKey>().is_err() {
                    return Err(format!("{at}: {:?} is not a tap key", tap.tap));
                }
                if tap.fingerprint.len() > FINGERPRINT_LEN {
                    return Err(format!(
                        "{at} {}: fingerprint of {} values",
                        tap.tap,
                        tap.fingerprint.len()
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Writes a golden file: the header pretty-printed, one tap or position per line (diff-friendly).
pub fn golden_json(g: &Golden) -> anyhow::Result<String> {
    use std::fmt::Write;
    let mut head = g.clone();
    head.prompts.clear();
    let head = serde_json::to_string_pretty(&head)?;
    let head = head.trim_end().trim_end_matches('}').trim_end();
    let head = head.strip_suffix("\"prompts\": []").unwrap_or(head);
    let mut s = String::from(head);
    s.push_str("\"prompts\": [\n");
    for (pi, p) in g.prompts.iter().enumerate() {
        let _ = write!(
            s,
            "    {{\n      \"label\": {},\n{}      \"tokens\": {},\n      \"continuation\": {},\n",
            serde_json::to_string(&p.label)?,
            match &p.text {
                Some(t) => format!("      \"text\": {},\n", serde_json::to_string(t)?),
                None => String::new(),
            },
            serde_json::to_string(&p.tokens)?,
            serde_json::to_string(&p.continuation)?
        );
        for (name, list) in [
            ("positions", &p.positions),
            ("continuation_positions", &p.continuation_positions),
        ] {
            let _ = writeln!(s, "      \"{name}\": [");
            for (i, pos) in list.iter().enumerate() {
                let sep = if i + 1 < list.len() { "," } else { "" };
                let _ = writeln!(s, "        {}{sep}", serde_json::to_string(pos)?);
            }
            s.push_str("      ],\n");
        }
        s.push_str("      \"taps\": [\n");
        for (i, t) in p.taps.iter().enumerate() {
            let sep = if i + 1 < p.taps.len() { "," } else { "" };
            let _ = writeln!(s, "        {}{sep}", serde_json::to_string(t)?);
        }
        let sep = if pi + 1 < g.prompts.len() { "," } else { "" };
        let _ = writeln!(s, "      ]\n    }}{sep}");
    }
    s.push_str("  ]\n}\n");
    Ok(s)
}

/// The summary of one tensor.
pub fn summarize(tap: &str, data: &[f32], shape: [usize; 2]) -> TapSummary {
    let finite: Vec<f64> = data.iter().filter(|x| x.is_finite()).map(|&x| x as f64).collect();
    let n = finite.len().max(1) as f64;
    let mean = finite.iter().sum::<f64>() / n;
    let var = finite.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n;
    let len = data.len();
    let fingerprint = if len == 0 {
        Vec::new()
    } else {
        (0..FINGERPRINT_LEN.min(len))
            .map(|i| {
                let x = data[i * len / FINGERPRINT_LEN.min(len)];
                x.is_finite().then_some(x)
            })
            .collect()
    };
    TapSummary {
        tap: tap.to_string(),
        shape,
        norm: finite.iter().map(|x| x * x).sum::<f64>().sqrt(),
        mean,
        std: var.sqrt(),
        min: finite.iter().copied().fold(f64::INFINITY, f64::min),
        max: finite.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        nonfinite: (len - finite.len()) as u64,
        fingerprint,
    }
}

/// A tap that summarizes every activation as it is recorded (weights are skipped: they are
/// covered by the activations they produce, and would make golden files slow to write).
#[derive(Default)]
pub struct SummaryTap {
    pub taps: Vec<TapSummary>,
    /// Record nothing (a positions-only golden file).
    pub off: bool,
}

impl Tap for SummaryTap {
    fn wants(&self, key: &TapKey) -> bool {
        !self.off && !matches!(key.site, Site::Weight(_))
    }
    fn record(&mut self, key: &TapKey, data: &[f32], shape: [usize; 2]) {
        self.taps.push(summarize(&key.to_string(), data, shape));
    }
}

/// What one prompt's run gives: tap summaries, per-position goldens, per-position log-probabilities.
pub type PromptRun = (Vec<TapSummary>, Vec<PositionGolden>, Vec<Vec<f64>>);

/// One logits row as a golden position, and its log-probabilities.
pub fn position_of(row: &[f32]) -> (PositionGolden, Vec<f64>) {
    let lp = log_softmax(row);
    let pos = PositionGolden {
        entropy: entropy(&lp),
        top: top_k(&lp, GOLDEN_TOP_K),
    };
    (pos, lp)
}

/// Runs one prompt: tap summaries (none when `taps` is false) and per-position top-k and entropy.
pub fn run_prompt(runner: &mut Runner, tokens: &[u32], vocab: usize, taps: bool) -> anyhow::Result<PromptRun> {
    let mut tap = SummaryTap {
        off: !taps,
        ..SummaryTap::default()
    };
    let logits = runner.logits(tokens, &mut tap)?;
    let (positions, logps) = logits.chunks(vocab).map(position_of).unzip();
    Ok((tap.taps, positions, logps))
}

/// The text of each id in `ids` that names that token alone in the vocabulary (what a server's
/// logprobs are keyed by); ambiguous or undecodable ids are left out.
pub fn token_texts(
    tok: &references::tokenizer::Tokenizer,
    vocab: usize,
    ids: impl IntoIterator<Item = u32>,
) -> std::collections::BTreeMap<u32, String> {
    let space = crate::server_view::TokenSpace::new(Some(tok), vocab);
    ids.into_iter()
        .filter_map(|id| {
            let text = tok.decode(&[id]).ok()?;
            (space.model_id(&text) == Some(id)).then_some((id, text))
        })
        .collect()
}

/// sha256 of a file, hex.
pub fn sha256_file(path: &Path) -> anyhow::Result<String> {
    use std::io::Read;
    let mut h = Sha256::new();
    // An HF checkpoint folder: config.json, then its safetensors files in name order.
    let files: Vec<std::path::PathBuf> = if path.is_dir() {
        let mut st: Vec<_> = std::fs::read_dir(path)
            .with_context(|| format!("cannot list {}", path.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        st.sort();
        std::iter::once(path.join("config.json")).chain(st).collect()
    } else {
        vec![path.to_path_buf()]
    };
    for file in files {
        crate::output::check_regular(&file)?;
        let mut f = std::fs::File::open(&file).with_context(|| format!("cannot open {}", file.display()))?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// The repository root a golden file's relative paths are resolved against: the parent of the
/// directory holding it (golden files live in `golden/`).
pub fn repo_root_of(golden_path: &Path) -> anyhow::Result<PathBuf> {
    let dir = golden_path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let dir = dir
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", dir.display()))?;
    Ok(dir.parent().map(Path::to_path_buf).unwrap_or(dir))
}

/// A model ready to run: the file, kept alive with its temp dir when synthesized.
pub struct MaterializedModel {
    pub path: PathBuf,
    pub _dir: Option<tempfile::TempDir>,
}

impl MaterializedModel {
    pub fn open(&self) -> anyhow::Result<GgufFile> {
        crate::output::open_model(&self.path)
    }
}

/// Synthesizes a recipe into a temp dir.
pub fn synthesize(r: &SynthRecipe) -> anyhow::Result<MaterializedModel> {
    let mut spec =
        references::synth::preset(&r.preset).with_context(|| format!("unknown synth preset {:?}", r.preset))?;
    if let Some(q) = &r.quant {
        let ty = references::GgmlType::from_name(q).with_context(|| format!("unknown quant type {q:?}"))?;
        spec.weight_type = ty;
        spec.embd_type = ty;
    }
    let dir = tempfile::tempdir()?;
    let path = dir.path().join(format!("{}.gguf", r.preset));
    crate::output::write_spec(&spec, r.seed, &path, false)?;
    Ok(MaterializedModel { path, _dir: Some(dir) })
}

/// The model a golden file names, found relative to `root` or synthesized.
pub fn materialize(source: &ModelSource, root: &Path) -> anyhow::Result<MaterializedModel> {
    match source {
        ModelSource::Synth { synth } => synthesize(synth),
        ModelSource::Path { path } => {
            let p = root.join(path);
            if !p.exists() {
                bail!(
                    "model {} (from the golden file, relative to {}) does not exist; .ci/run fetches the real SmolLM2 into .cache/",
                    path,
                    root.display()
                );
            }
            Ok(MaterializedModel { path: p, _dir: None })
        }
    }
}

/// A model path as stored in a golden file: relative to `root`, which must hold it.
pub fn portable_path(model: &Path, root: &Path) -> anyhow::Result<String> {
    // Lexical, not canonical: `.cache/` may be a symlink to a shared cache outside the repository,
    // and the stored path must name it as the repository sees it.
    let abs = std::path::absolute(model).with_context(|| format!("cannot resolve {}", model.display()))?;
    let mut norm = PathBuf::new();
    for c in abs.components() {
        match c {
            std::path::Component::CurDir => {}
            std::path::Component::ParentDir => {
                norm.pop();
            }
            c => norm.push(c),
        }
    }
    let rel = norm
        .strip_prefix(root)
        .ok()
        .ok_or_else(|| {
            anyhow::anyhow!(
                "{} is outside the repository root {}: golden files store portable paths; put the model under the repository (e.g. .cache/) or use --synth",
                model.display(),
                root.display()
            )
        })?;
    Ok(rel.to_string_lossy().into_owned())
}

/// How one compared item went (the report schema's type).
pub use reports::GateCheck as Check;

fn rel(a: f64, b: f64, scale: f64) -> f64 {
    if a == b {
        0.0
    } else {
        (a - b).abs() / scale.max(1e-30)
    }
}

/// Compares a tap summary with its golden one; `Some(check)` with ratio > 1 when over tolerance.
pub fn compare_tap(new: &TapSummary, old: &TapSummary, t: &GateThresholds) -> Check {
    let fail = |detail: String| Check {
        item: old.tap.clone(),
        ratio: f64::INFINITY,
        detail,
    };
    if new.shape != old.shape {
        return fail(format!("shape {:?}, golden {:?}", new.shape, old.shape));
    }
    if new.nonfinite != old.nonfinite {
        return fail(format!("{} non-finite values, golden {}", new.nonfinite, old.nonfinite));
    }
    let nulls_differ = new
        .fingerprint
        .iter()
        .zip(&old.fingerprint)
        .any(|(a, b)| a.is_some() != b.is_some());
    if nulls_differ || new.fingerprint.len() != old.fingerprint.len() {
        return fail("fingerprint has non-finite values where the golden has none (or the reverse)".into());
    }
    let (mut d2, mut b2) = (0f64, 0f64);
    for (a, b) in new.fingerprint.iter().zip(&old.fingerprint) {
        if let (Some(a), Some(b)) = (a, b) {
            d2 += (*a as f64 - *b as f64).powi(2);
            b2 += (*b as f64).powi(2);
        }
    }
    let amax = old.max.abs().max(old.min.abs());
    let measures = [
        (
            "fingerprint rel_l2",
            if d2 == 0.0 {
                0.0
            } else {
                d2.sqrt() / b2.sqrt().max(1e-30)
            },
        ),
        ("norm", rel(new.norm, old.norm, old.norm)),
        ("mean", rel(new.mean, old.mean, old.std)),
        ("std", rel(new.std, old.std, old.std)),
        ("min", rel(new.min, old.min, amax)),
        ("max", rel(new.max, old.max, amax)),
    ];
    let (name, worst) = measures
        .iter()
        .copied()
        .fold(("", 0.0f64), |acc, m| if m.1.is_nan() || m.1 > acc.1 { m } else { acc });
    Check {
        item: old.tap.clone(),
        ratio: ratio(worst, t.tap_rel),
        detail: format!(
            "{name} {worst:.3e} > {:.0e} (norm {:.6e}, golden {:.6e})",
            t.tap_rel, new.norm, old.norm
        ),
    }
}

/// Compares one position's distribution with its golden one.
pub fn compare_position(pos_idx: usize, logp: &[f64], old: &PositionGolden, t: &GateThresholds) -> Check {
    let h = entropy(logp);
    let mut worst = (
        ratio(rel(h, old.entropy, 1.0), t.entropy_abs),
        format!("entropy {h:.6}, golden {:.6}", old.entropy),
    );
    for &(id, lp) in &old.top {
        let now = logp.get(id as usize).copied().unwrap_or(f64::NEG_INFINITY);
        let r = ratio((now - lp).abs(), t.logprob_abs);
        if r > worst.0 {
            worst = (r, format!("logprob of token {id} {now:.6}, golden {lp:.6}"));
        }
    }
    let top1 = top_k(logp, 1).first().map(|x| x.0);
    if let Some(&(want, _)) = old.top.first() {
        if top1 != Some(want) {
            worst = (
                f64::INFINITY,
                format!(
                    "top-1 token {}, golden {want}; {}",
                    top1.map_or("-".into(), |t| t.to_string()),
                    worst.1
                ),
            );
        }
    }
    Check {
        item: format!("pos {pos_idx}"),
        ratio: worst.0,
        detail: worst.1,
    }
}
