//! `llmdiff golden bless`: run a model (a repository file or a synth recipe) on a few short prompts
//! and write a golden file for `gate`: taps, top-k per position, a greedy continuation and the
//! token texts `gate --server` maps a server's logprobs with. `--update FILE` re-blesses a file
//! from its own recipe (a format 1 file comes back as format 2).

use crate::cli::{BackendArg, BlessArgs, GoldenArgs, GoldenCommand};
use crate::entropy::{tokenize_prompts, PromptInput};
use crate::golden::{
    golden_json, materialize, portable_path, position_of, repo_root_of, run_prompt, sha256_file, token_texts,
    GateThresholds, Golden, GoldenPrompt, ModelSource, SynthRecipe, GOLDEN_CONTINUATION, GOLDEN_FORMAT, GOLDEN_MAGIC,
};
use crate::output::write_atomic;
use crate::runner::Runner;
use anyhow::{bail, Context};
use references::ModelConfig;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

pub fn run(a: &GoldenArgs) -> anyhow::Result<ExitCode> {
    match &a.command {
        GoldenCommand::Bless(b) => bless(b),
    }
}

/// What to bless, validated before any work.
struct BlessPlan {
    out: PathBuf,
    root: PathBuf,
    model: ModelSource,
    engine: bool,
    tp: usize,
    thresholds: GateThresholds,
    prompts: Vec<PromptInput>,
    max_tokens: usize,
    /// Greedy continuation length.
    n_continuation: usize,
    /// Record tap summaries (false: a positions-only file).
    taps: bool,
}

fn plan(a: &BlessArgs) -> anyhow::Result<BlessPlan> {
    if let Some(path) = &a.update {
        let text = crate::output::read_text(path)?;
        let v: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
        let field = |k: &str| {
            v.get(k)
                .cloned()
                .with_context(|| format!("{}: no \"{k}\" to re-bless from", path.display()))
        };
        let model: ModelSource = serde_json::from_value(field("model")?).context("bad \"model\"")?;
        let backend = field("backend")?.as_str().unwrap_or("reference").to_string();
        let tp = field("tp")?.as_u64().unwrap_or(1) as usize;
        let thresholds: GateThresholds = v
            .get("thresholds")
            .and_then(|t| serde_json::from_value(t.clone()).ok())
            .unwrap_or_default();
        thresholds
            .validate()
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        if tp == 0 {
            bail!("{}: tp is 0", path.display());
        }
        let prompts = field("prompts")?
            .as_array()
            .context("\"prompts\" is not an array")?
            .iter()
            .map(|p| {
                let tokens: Vec<u32> = serde_json::from_value(p.get("tokens").cloned().unwrap_or_default())?;
                Ok(PromptInput {
                    label: p.get("label").and_then(|l| l.as_str()).unwrap_or("").to_string(),
                    text: None,
                    tokens: Some(tokens),
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        // Format 1 files have no n_continuation (they get the default) and always have taps.
        let n_continuation = v
            .get("n_continuation")
            .and_then(|n| n.as_u64())
            .map_or(GOLDEN_CONTINUATION, |n| n as usize);
        let taps = field("prompts")?.as_array().is_some_and(|ps| {
            ps.iter()
                .any(|p| p.get("taps").and_then(|t| t.as_array()).is_some_and(|t| !t.is_empty()))
        });
        return Ok(BlessPlan {
            out: path.clone(),
            root: repo_root_of(path)?,
            model,
            engine: backend != "reference",
            tp,
            thresholds,
            prompts,
            max_tokens: usize::MAX,
            n_continuation,
            taps,
        });
    }
    let Some(out) = &a.output else {
        bail!("golden bless needs -o golden/gate-NAME.json (or --update FILE)")
    };
    let name = out.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if !(name.starts_with("gate-") && name.ends_with(".json")) {
        bail!("{}: golden files for the gate are named gate-NAME.json", out.display());
    }
    let root = repo_root_of(out)?;
    let model = match (&a.model, &a.synth) {
        (Some(m), None) => ModelSource::Path {
            path: portable_path(m, &root)?,
        },
        (None, Some(p)) => ModelSource::Synth {
            synth: SynthRecipe {
                preset: p.clone(),
                quant: a.quant.clone(),
                seed: a.seed,
            },
        },
        _ => bail!("golden bless needs --model PATH or --synth PRESET"),
    };
    let backend = a.engine.backend_or(BackendArg::Reference);
    if backend == BackendArg::Cuda {
        bail!("golden files are blessed on the reference or the cpu engine (the gate reruns them on any backend)");
    }
    if !a.engine.inject.is_empty() {
        bail!("--inject: a golden file records a healthy run; inject faults at gate time");
    }
    a.engine.engine_options(backend)?;
    let mut prompts: Vec<PromptInput> = a
        .prompt
        .iter()
        .map(|p| PromptInput {
            label: p.chars().take(48).collect(),
            text: Some(p.clone()),
            tokens: None,
        })
        .collect();
    for t in &a.tokens {
        let ids = t
            .split(',')
            .map(|x| x.trim().parse::<u32>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| anyhow::anyhow!("--tokens {t:?}: expected comma-separated token ids"))?;
        prompts.push(PromptInput {
            label: format!("tokens:{}", ids.len()),
            text: None,
            tokens: Some(ids),
        });
    }
    if prompts.is_empty() {
        bail!("golden bless needs at least one --prompt or --tokens");
    }
    if a.max_tokens == 0 {
        bail!("--max-tokens must be positive");
    }
    let mut thresholds = GateThresholds::default();
    if let Some(x) = a.tap_rel {
        thresholds.tap_rel = x;
    }
    if let Some(x) = a.logprob_abs {
        thresholds.logprob_abs = x;
    }
    Ok(BlessPlan {
        out: out.clone(),
        root,
        model,
        engine: backend != BackendArg::Reference,
        tp: a.engine.tp(),
        thresholds,
        prompts,
        max_tokens: a.max_tokens,
        n_continuation: a.continuation,
        taps: !a.no_taps,
    })
}

fn bless(a: &BlessArgs) -> anyhow::Result<ExitCode> {
    let p = plan(a)?;
    let model = materialize(&p.model, &p.root)?;
    let sha = sha256_file(&model.path)?;
    let file = model.open()?;
    let vocab = ModelConfig::from_header(&file.header)?.vocab;
    let tokens = tokenize_prompts(&file, &p.prompts, vocab)?;
    let tokenizer = references::tokenizer::Tokenizer::for_model(&file).ok();
    let stop = tokenizer.as_ref().and_then(|t| t.eos_id());
    let kind = p.engine.then_some(engine::BackendKind::Cpu);
    let opts = engine::EngineOptions {
        tp: p.tp,
        ..engine::EngineOptions::default()
    };
    let mut runner = Runner::new(&file, kind, opts)?;
    let mut prompts = Vec::new();
    for (input, toks) in p.prompts.iter().zip(tokens) {
        let toks: Vec<u32> = toks.into_iter().take(p.max_tokens).collect();
        let (taps, positions, _) = run_prompt(&mut runner, &toks, vocab, p.taps)?;
        // Step 0 was predicted by the last prompt position; step t ≥ 1 by decode row t − 1.
        let (continuation, rows) = runner.greedy(&toks, p.n_continuation, stop)?;
        let mut continuation_positions: Vec<_> = positions.last().cloned().into_iter().collect();
        continuation_positions.extend(rows.chunks(vocab).map(|r| position_of(r).0));
        continuation_positions.truncate(continuation.len());
        prompts.push(GoldenPrompt {
            label: input.label.clone(),
            text: tokenizer.as_ref().and_then(|t| t.decode(&toks).ok()),
            tokens: toks,
            continuation,
            positions,
            continuation_positions,
            taps,
        });
    }
    let used = prompts.iter().flat_map(|p| {
        let tops = p
            .positions
            .iter()
            .chain(&p.continuation_positions)
            .flat_map(|x| x.top.iter().map(|t| t.0));
        p.tokens.iter().chain(&p.continuation).copied().chain(tops)
    });
    let token_text = match &tokenizer {
        Some(t) => token_texts(t, vocab, used.collect::<std::collections::BTreeSet<u32>>()),
        None => Default::default(),
    };
    let control_tokens: Vec<u32> = match &tokenizer {
        Some(t) => token_text
            .keys()
            .copied()
            .filter(|&id| t.token_type(id) == Some(references::tokenizer::TokenType::Control))
            .collect(),
        None => Vec::new(),
    };
    let rel_out = p
        .out
        .file_name()
        .map(|n| Path::new("golden").join(n))
        .unwrap_or_else(|| p.out.clone());
    let g = Golden {
        magic: GOLDEN_MAGIC.to_string(),
        format: GOLDEN_FORMAT,
        llmdiff_version: env!("CARGO_PKG_VERSION").to_string(),
        bless_command: crate::golden::bless_hint(&rel_out),
        model: p.model,
        model_sha256: sha,
        backend: runner.backend_name().to_string(),
        tp: p.tp,
        thresholds: p.thresholds,
        vocab,
        n_continuation: p.n_continuation,
        token_text,
        control_tokens,
        prompts,
    };
    write_atomic(&p.out, golden_json(&g)?.as_bytes())?;
    let n_taps: usize = g.prompts.iter().map(|p| p.taps.len()).sum();
    if a.json {
        println!(
            "{}",
            serde_json::json!({"output": p.out.display().to_string(), "model_sha256": g.model_sha256,
                               "backend": g.backend, "tp": g.tp, "prompts": g.prompts.len(), "taps": n_taps})
        );
    } else {
        eprintln!(
            "blessed {}: {} TP {}, {} prompt(s), {} taps, model sha256 {}",
            p.out.display(),
            g.backend,
            g.tp,
            g.prompts.len(),
            n_taps,
            &g.model_sha256[..16]
        );
    }
    Ok(ExitCode::SUCCESS)
}
