//! `llmdiff entropy`: per-prompt next-token entropy, top-5 recurrence and continuation
//! repetition, a `healthy`/`flat`/`degenerate` verdict, and with `--against-reference` the KL
//! statistics of the backend against the reference.

use crate::cli::EntropyArgs;
use crate::entropy::{
    default_thresholds, kld_positions, kld_stats, overall, positions, read_prompts, repetition, tokenize_prompts,
    top5_recurrence, verdict, KldPosition, Runner,
};
use crate::output::{open_model, write_atomic};
use anyhow::{bail, Context};
use engine::FaultSpec;
use references::forward::Reference;
use references::tap::NoTap;
use references::tokenizer::Tokenizer;
use references::ModelConfig;
use reports::{EntropyRun, EntropyThresholds, PromptEntropy, ENTROPY_FORMAT};
use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

/// The thresholds a run uses: `--thresholds FILE` or the defaults, then `--kld-threshold`.
pub fn thresholds(a: &EntropyArgs) -> anyhow::Result<EntropyThresholds> {
    let mut t = match &a.thresholds {
        Some(p) => load_thresholds(p)?,
        None => default_thresholds(),
    };
    if let Some(k) = a.kld_threshold {
        t.kld_position = k;
    }
    Ok(t)
}

/// Thresholds from a file: `{"thresholds": {...}}` or the bare object.
fn load_thresholds(path: &Path) -> anyhow::Result<EntropyThresholds> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).with_context(|| path.display().to_string())?;
    let t = v.get("thresholds").cloned().unwrap_or(v);
    serde_json::from_value(t).with_context(|| format!("{}: bad thresholds", path.display()))
}

pub fn run(a: &EntropyArgs) -> anyhow::Result<ExitCode> {
    if a.live.server.is_some() {
        return crate::commands::entropy_server::run(a);
    }
    let t0 = Instant::now();
    let Some(model) = a.model.as_ref() else {
        bail!("MODEL.gguf is required without --server")
    };
    // Validate everything before any forward pass.
    let prompts = read_prompts(&a.prompts)?;
    let faults: Vec<FaultSpec> = a
        .inject
        .iter()
        .map(|s| s.parse::<FaultSpec>().map_err(|e| anyhow::anyhow!("--inject {s}: {e}")))
        .collect::<Result<_, _>>()?;
    let thresholds = thresholds(a)?;
    let file = open_model(model)?;
    let config = ModelConfig::from_header(&file.header)?;
    let vocab = config.vocab;
    let tokens = tokenize_prompts(&file, &prompts, vocab)?;
    let tokenizer = Tokenizer::from_gguf(&file.header).ok();
    let stop = tokenizer.as_ref().and_then(|t| t.eos_id());
    let mut runner = Runner::new(&file, a.backend, a.tp, faults.clone())?;
    let reference = if a.against_reference {
        Some(Reference::new(&file)?)
    } else {
        None
    };
    let mut all_kld: Vec<KldPosition> = Vec::new();
    let mut out = Vec::with_capacity(prompts.len());
    for (i, (p, toks)) in prompts.iter().zip(&tokens).enumerate() {
        eprintln!("[{}/{}] {} ({} tokens)", i + 1, prompts.len(), p.label, toks.len());
        let logits = runner.logits(toks, &mut NoTap)?;
        let pos = positions(&logits, vocab);
        let n = toks.len();
        let (recurrence, recurring) = top5_recurrence(&pos.top5);
        let (continuation, decode_rows) = runner.greedy(toks, a.max_new_tokens, stop)?;
        let (mut ref_entropies, mut kld_series) = (Vec::new(), Vec::new());
        let kld = match &reference {
            Some(r) => {
                // The prompt's positions (prefill) and the continuation's (decode steps), against
                // one reference pass over the prompt and all but the last generated token.
                let mut seq = toks.clone();
                seq.extend_from_slice(&continuation[..continuation.len().saturating_sub(1)]);
                let ref_logits = r.forward(&seq, &mut NoTap)?;
                let mut test = logits.clone();
                test.extend_from_slice(&decode_rows);
                let mut full = toks.clone();
                full.extend_from_slice(&continuation);
                let next: Vec<Option<u32>> = (0..seq.len()).map(|j| full.get(j + 1).copied()).collect();
                let k = kld_positions(&test, &ref_logits, vocab, &next);
                ref_entropies = positions(&ref_logits[..n * vocab], vocab).entropies;
                kld_series = k.iter().map(|p| p.kld).collect();
                let stats = kld_stats(&k, thresholds.kld_position);
                all_kld.extend(k);
                Some(stats)
            }
            None => None,
        };
        let finite_h: Vec<f64> = pos.entropies.iter().copied().filter(|h| h.is_finite()).collect();
        let mean_entropy = pos.entropies.iter().sum::<f64>() / n as f64;
        let mut pe = PromptEntropy {
            label: p.label.clone(),
            n_tokens: n,
            verdict: String::new(),
            reasons: Vec::new(),
            mean_entropy,
            min_entropy: finite_h.iter().copied().fold(f64::INFINITY, f64::min),
            norm_entropy: mean_entropy / (vocab as f64).ln(),
            mean_top1_logprob: pos.top1.iter().sum::<f64>() / n as f64,
            top5_recurrence: recurrence,
            recurring_top5: recurring,
            repetition: repetition(&continuation),
            continuation_text: tokenizer.as_ref().and_then(|t| t.decode(&continuation).ok()),
            continuation,
            nonfinite: pos.nonfinite,
            kld,
            entropies: pos.entropies.clone(),
            reference_entropies: ref_entropies,
            kld_positions: kld_series,
            entropy_upper: None,
            topk_residual: None,
            overlap: None,
        };
        let (v, reasons) = verdict(&pe, &thresholds);
        pe.verdict = v;
        pe.reasons = reasons;
        out.push(pe);
    }
    let kld = reference.as_ref().map(|_| kld_stats(&all_kld, thresholds.kld_position));
    let agreement = kld
        .as_ref()
        .map(|k| if k.first_over.is_none() { "agree" } else { "diverged" }.to_string());
    let run = EntropyRun {
        format: ENTROPY_FORMAT,
        llmdiff_version: env!("CARGO_PKG_VERSION").to_string(),
        model: model.display().to_string(),
        backend: runner.backend_name().to_string(),
        tp: a.tp,
        injected: faults.iter().map(|f| f.to_string()).collect(),
        vocab,
        max_new_tokens: a.max_new_tokens,
        thresholds,
        verdict: overall(&out),
        agreement,
        prompts: out,
        kld,
        seconds: t0.elapsed().as_secs_f64(),
        server: None,
        overlap: None,
    };
    finish(a, &run, || print_summary(&run, tokenizer.as_ref()))
}

/// Writes `--json-out` and `--html`, prints the JSON or the human summary, and maps the verdict to
/// the exit code (0 healthy and agreeing, 1 otherwise). Shared by the local and `--server` checks.
pub fn finish(a: &EntropyArgs, run: &EntropyRun, print_human: impl FnOnce()) -> anyhow::Result<ExitCode> {
    if let Some(p) = &a.json_out {
        write_atomic(p, serde_json::to_string_pretty(run)?.as_bytes())?;
    }
    if let Some(p) = &a.html {
        write_atomic(p, reports::render_entropy(run).as_bytes())?;
        eprintln!("report: {}", p.display());
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(run)?);
    } else {
        print_human();
    }
    let ok = run.verdict == "healthy" && run.agreement.as_deref() != Some("diverged");
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

pub fn print_summary(run: &EntropyRun, tok: Option<&Tokenizer>) {
    let ln_v = (run.vocab as f64).ln();
    println!(
        "{}: {} prompts, {} TP {}{}; ln V = {:.2}",
        run.model,
        run.prompts.len(),
        run.backend,
        run.tp,
        if run.injected.is_empty() {
            String::new()
        } else {
            format!(", injected {}", run.injected.join(" "))
        },
        ln_v
    );
    println!(
        "\n  {:<4} {:<10} {:>6} {:>6} {:>7} {:>7} {:>6} {:>5} {:>9}  prompt",
        "#", "verdict", "H", "minH", "H/lnV", "top1lp", "rec5", "rep", "KLD"
    );
    for (i, p) in run.prompts.iter().enumerate() {
        println!(
            "  {:<4} {:<10} {:>6.3} {:>6.3} {:>7.4} {:>7.2} {:>6.2} {:>5.2} {:>9}  {}",
            i + 1,
            p.verdict,
            p.mean_entropy,
            p.min_entropy,
            p.norm_entropy,
            p.mean_top1_logprob,
            p.top5_recurrence,
            p.repetition,
            p.kld.as_ref().map_or("-".to_string(), |k| format!("{:.2e}", k.mean)),
            p.label
        );
    }
    for (i, p) in run.prompts.iter().enumerate().filter(|(_, p)| p.verdict != "healthy") {
        let names: Vec<String> = p
            .recurring_top5
            .iter()
            .map(|(id, n)| {
                let s = tok
                    .and_then(|t| t.decode(&[*id]).ok())
                    .unwrap_or_else(|| id.to_string());
                format!("{s:?}×{n}")
            })
            .collect();
        println!("\n  #{} {}: {}", i + 1, p.verdict, p.reasons.join("; "));
        println!("     recurring top-5: {}", names.join(" "));
        if let Some(t) = &p.continuation_text {
            println!("     continuation: {t:?}");
        }
    }
    if let Some(k) = &run.kld {
        println!(
            "\n  KLD vs reference over {} positions: mean {:.6} ± {:.6}, median {:.6}, p90 {:.6}, p99 {:.6}, p99.9 {:.6}, max {:.6}",
            k.n_positions, k.mean, k.mean_se, k.median, k.p90, k.p99, k.p99_9, k.max
        );
        println!("  same top-1 {:.2} %, RMS Δp {:.3} %", k.same_top1_pct, k.rms_dp_pct);
        // Name the prompt and position of the first one over.
        let first = run
            .prompts
            .iter()
            .enumerate()
            .find_map(|(i, p)| p.kld.as_ref().and_then(|k| k.first_over).map(|pos| (i, pos)));
        match first {
            Some((i, pos)) => println!(
                "  DIVERGED: first position over KLD {}: prompt #{} position {}",
                k.threshold,
                i + 1,
                pos
            ),
            None => println!("  AGREE: every position's KLD within {}", k.threshold),
        }
    }
    println!(
        "\nverdict: {}{}  ({:.1}s)",
        run.verdict,
        run.agreement
            .as_ref()
            .map_or(String::new(), |a| format!(", against the reference: {a}")),
        run.seconds
    );
}
