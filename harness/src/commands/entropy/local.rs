//! `llmdiff entropy` on a local backend: per-prompt next-token entropy, top-5 recurrence and
//! continuation repetition, a `healthy`/`flat`/`degenerate` verdict, and with
//! `--against-reference` the KL statistics of the backend against the reference and the same
//! calibrated verdict as `--server` (`kld_verdict`): per-position KLD over the backend's top-k
//! (`--top-logprobs`, both sides renormalized there, as a server's top-k allows), judged against
//! the healthy floor.

use super::shared::{finish, print_summary, print_verdict, thresholds, Extra};
use crate::cli::{BackendArg, EntropyArgs};
use crate::entropy::{
    kld_positions, kld_stats, overall, positions, read_prompts, repetition, tokenize_prompts, top5_recurrence, verdict,
    KldPosition,
};
use crate::kld_verdict::{judge, PosKld, Profile};
use crate::logprobs::{log_softmax, top_k};
use crate::output::open_model;
use crate::runner::Runner;
use crate::topk::{row_logprob, topk_kld};
use anyhow::bail;
use references::forward::Reference;
use references::tap::NoTap;
use references::tokenizer::Tokenizer;
use references::ModelConfig;
use reports::{EntropyRun, PromptEntropy, ENTROPY_FORMAT};
use std::process::ExitCode;
use std::time::Instant;

/// The local check: the backend `a` names, on every prompt, with the reference beside it when
/// `--against-reference`.
pub fn run(a: &EntropyArgs) -> anyhow::Result<ExitCode> {
    let t0 = Instant::now();
    let Some(model) = a.model.as_ref() else {
        bail!("MODEL.gguf is required without --server")
    };
    // Validate everything before any forward pass.
    if a.trusted_model.is_some() || a.chat {
        bail!(
            "--trusted-model and --chat apply to --server --against-reference (a local run's reference is MODEL.gguf)"
        );
    }
    let prompts = read_prompts(&a.prompts)?;
    let (kind, opts) = a.engine.engine_options(a.engine.backend_or(BackendArg::Reference))?;
    let thresholds = thresholds(a)?;
    let calibration = a.verdict.calibration()?;
    let k = a.live.top_logprobs.max(1);
    let file = open_model(model)?;
    let config = ModelConfig::from_header(&file.header)?;
    let vocab = config.vocab;
    let tokens = tokenize_prompts(&file, &prompts, vocab)?;
    let tokenizer = Tokenizer::for_model(&file).ok();
    let stop = tokenizer.as_ref().and_then(|t| t.eos_id());
    let mut runner = Runner::new(&file, kind, opts)?;
    let reference = if a.against_reference {
        Some(Reference::new(&file)?)
    } else {
        None
    };
    let mut all_kld: Vec<KldPosition> = Vec::new();
    let mut pos_kld: Vec<PosKld> = Vec::new();
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
                pos_kld.extend(topk_positions(&test, &ref_logits, vocab, k, i));
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
    // The calibrated verdict, as for a server: the engine on this machine is judged by the same
    // floor (the reference and the engine read the same file, so only the engine is under test).
    let profile = Profile {
        entropy_verdicts: out.iter().map(|p| p.verdict.clone()).collect(),
        ..Profile::default()
    };
    let verdict = reference.as_ref().map(|_| judge(&pos_kld, &profile, &calibration));
    let mut extra = Extra::default();
    if let Some(v) = &verdict {
        extra.set_verdict(v, a.verdict.precision_loss_exit)?;
    }
    let agreement = verdict.as_ref().map(|v| v.band_name.clone());
    let run = EntropyRun {
        format: ENTROPY_FORMAT,
        llmdiff_version: env!("CARGO_PKG_VERSION").to_string(),
        model: model.display().to_string(),
        backend: runner.backend_name().to_string(),
        tp: a.engine.tp(),
        injected: a.engine.injected(),
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
    finish(a, &run, &extra, || {
        print_summary(&run, tokenizer.as_ref());
        if let Some(v) = &verdict {
            print_verdict(v);
        }
    })
}

/// One prompt's per-position KLDs over the backend's top-`k` tokens (both distributions
/// renormalized over that set, the statistic a server's top-k logprobs give), for the verdict.
fn topk_positions(test: &[f32], reference: &[f32], vocab: usize, k: usize, prompt: usize) -> Vec<PosKld> {
    let len = test.len().min(reference.len()) / vocab.max(1);
    (0..len)
        .map(|j| {
            let row = j * vocab..(j + 1) * vocab;
            let (lt, lr) = (log_softmax(&test[row.clone()]), log_softmax(&reference[row]));
            let top = top_k(&lt, k);
            let set: Vec<u32> = top.iter().map(|t| t.0).collect();
            let lps: Vec<f64> = top.iter().map(|t| t.1).collect();
            let ref_top = top_k(&lr, 1);
            PosKld {
                prompt,
                pos: j,
                len,
                kld: topk_kld(&set, &lps, row_logprob(&lr)),
                same_top1: set.first() == ref_top.first().map(|t| &t.0),
            }
        })
        .collect()
}
