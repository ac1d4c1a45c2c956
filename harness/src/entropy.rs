//! Next-token distribution health: per-prompt entropy statistics, top-5 recurrence, repetition
//! of a greedy continuation, the verdict (`healthy`, `flat`, `degenerate`), and KL-divergence
//! statistics against the reference (llama-perplexity's definitions). Also the prompts-file reader
//! shared by `entropy`, `gate` and `golden`.

use crate::logprobs::{entropy, log_softmax, top_k};
use anyhow::{bail, Context};
use references::tokenizer::Tokenizer;
use references::GgufFile;
use reports::{EntropyThresholds, KldStats, PromptEntropy};
use std::collections::HashMap;
use std::path::Path;

/// The calibrated thresholds (measured figures in golden/entropy-calibration.json; method in
/// README.md, section `entropy`).
pub fn default_thresholds() -> EntropyThresholds {
    EntropyThresholds {
        flat_norm_entropy: 0.6,
        flat_top1_logprob: -4.0,
        degenerate_repetition: 0.6,
        degenerate_top5_recurrence: 0.6,
        kld_position: 0.05,
    }
}

/// One prompt to run.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptInput {
    pub label: String,
    /// `Some` for a text prompt (tokenized later), `None` when ids were given.
    pub text: Option<String>,
    pub tokens: Option<Vec<u32>>,
}

/// Reads a prompts file: one prompt per line, or JSONL of `{"prompt": TEXT}` / `{"tokens": [ids]}`
/// (JSONL when the first non-blank line starts with `{`). Blank lines are skipped. Errors name the line.
pub fn read_prompts(path: &Path) -> anyhow::Result<Vec<PromptInput>> {
    let text = crate::output::read_text(path)?;
    parse_prompts(&text).with_context(|| path.display().to_string())
}

/// [`read_prompts`] on text.
pub fn parse_prompts(text: &str) -> anyhow::Result<Vec<PromptInput>> {
    let lines: Vec<(usize, &str)> = text
        .lines()
        .enumerate()
        .map(|(i, l)| (i + 1, l.trim_end_matches('\r')))
        .filter(|(_, l)| !l.trim().is_empty())
        .collect();
    let Some(first) = lines.first() else {
        bail!("the prompts file is empty")
    };
    let jsonl = first.1.trim_start().starts_with('{');
    let mut out = Vec::with_capacity(lines.len());
    for (n, line) in lines {
        if !jsonl {
            out.push(PromptInput {
                label: shorten(line),
                text: Some(line.to_string()),
                tokens: None,
            });
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| anyhow::anyhow!("line {n}: not JSON ({e})"))?;
        let obj = v
            .as_object()
            .ok_or_else(|| anyhow::anyhow!("line {n}: expected an object with \"prompt\" or \"tokens\""))?;
        match (obj.get("prompt"), obj.get("tokens")) {
            (Some(p), None) => {
                let p = p
                    .as_str()
                    .ok_or_else(|| anyhow::anyhow!("line {n}: \"prompt\" must be a string"))?;
                if p.is_empty() {
                    bail!("line {n}: \"prompt\" is empty");
                }
                out.push(PromptInput {
                    label: shorten(p),
                    text: Some(p.to_string()),
                    tokens: None,
                });
            }
            (None, Some(t)) => {
                let ids = t
                    .as_array()
                    .filter(|a| !a.is_empty())
                    .ok_or_else(|| anyhow::anyhow!("line {n}: \"tokens\" must be a non-empty array of ids"))?
                    .iter()
                    .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
                    .collect::<Option<Vec<u32>>>()
                    .ok_or_else(|| anyhow::anyhow!("line {n}: \"tokens\" must hold non-negative integer ids"))?;
                out.push(PromptInput {
                    label: format!("tokens:{}", ids.len()),
                    text: None,
                    tokens: Some(ids),
                });
            }
            _ => bail!("line {n}: expected exactly one of \"prompt\" or \"tokens\""),
        }
    }
    Ok(out)
}

fn shorten(s: &str) -> String {
    let mut out: String = s.chars().take(48).collect();
    if s.chars().count() > 48 {
        out.push('…');
    }
    out
}

/// Token ids of every prompt, tokenized with the model's tokenizer and checked against the vocabulary.
pub fn tokenize_prompts(file: &GgufFile, prompts: &[PromptInput], vocab: usize) -> anyhow::Result<Vec<Vec<u32>>> {
    let mut tok: Option<Tokenizer> = None;
    let mut out = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let ids = match (&p.tokens, &p.text) {
            (Some(t), _) => t.clone(),
            (None, Some(text)) => {
                if tok.is_none() {
                    tok = Some(Tokenizer::for_model(file)?);
                }
                tok.as_ref().expect("set above").encode(text, true)?
            }
            (None, None) => bail!("prompt {}: no text and no tokens", i + 1),
        };
        if ids.is_empty() {
            bail!("prompt {} ({}): no tokens", i + 1, p.label);
        }
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            bail!(
                "prompt {} ({}): token id {bad} is outside the vocabulary ({vocab})",
                i + 1,
                p.label
            );
        }
        out.push(ids);
    }
    Ok(out)
}

/// Per-position distribution figures of one prompt's logits.
pub struct Positions {
    pub entropies: Vec<f64>,
    pub top1: Vec<f64>,
    pub top5: Vec<Vec<u32>>,
    pub nonfinite: u64,
}

/// Entropy, top-1 log-probability and top-5 ids at every position of `logits` `[n, vocab]`.
pub fn positions(logits: &[f32], vocab: usize) -> Positions {
    let mut p = Positions {
        entropies: Vec::new(),
        top1: Vec::new(),
        top5: Vec::new(),
        nonfinite: logits.iter().filter(|x| !x.is_finite()).count() as u64,
    };
    for row in logits.chunks(vocab) {
        let lp = log_softmax(row);
        let top = top_k(&lp, 5);
        p.entropies.push(entropy(&lp));
        p.top1.push(top.first().map_or(f64::NAN, |t| t.1));
        p.top5.push(top.iter().map(|t| t.0).collect());
    }
    p
}

/// The five most recurrent top-5 tokens with their position counts, and the share of all
/// position×5 slots they take.
pub fn top5_recurrence(top5: &[Vec<u32>]) -> (f64, Vec<(u32, usize)>) {
    let mut count: HashMap<u32, usize> = HashMap::new();
    for ids in top5 {
        for &id in ids {
            *count.entry(id).or_default() += 1;
        }
    }
    let mut v: Vec<(u32, usize)> = count.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    v.truncate(5);
    let slots: usize = top5.iter().map(|t| t.len()).sum();
    let share = if slots == 0 {
        0.0
    } else {
        v.iter().map(|x| x.1).sum::<usize>() as f64 / slots as f64
    };
    (share, v)
}

/// 1 − distinct/total over the 3-grams of `tokens` (0 with fewer than four tokens): 0 for text that
/// never repeats a 3-gram, near 1 for `elaselaselas`.
pub fn repetition(tokens: &[u32]) -> f64 {
    if tokens.len() < 4 {
        return 0.0;
    }
    let grams: Vec<&[u32]> = tokens.windows(3).collect();
    let distinct: std::collections::HashSet<&[u32]> = grams.iter().copied().collect();
    1.0 - distinct.len() as f64 / grams.len() as f64
}

/// The verdict and the crossed thresholds for one prompt.
pub fn verdict(p: &PromptEntropy, t: &EntropyThresholds) -> (String, Vec<String>) {
    let mut degenerate = Vec::new();
    let mut flat = Vec::new();
    if p.nonfinite > 0 {
        degenerate.push(format!("{} non-finite logits", p.nonfinite));
    }
    if p.repetition > t.degenerate_repetition {
        degenerate.push(format!(
            "continuation repeats itself (repetition {:.2} > {})",
            p.repetition, t.degenerate_repetition
        ));
    }
    if p.top5_recurrence > t.degenerate_top5_recurrence {
        degenerate.push(format!(
            "the same tokens fill every position's top-5 (recurrence {:.2} > {})",
            p.top5_recurrence, t.degenerate_top5_recurrence
        ));
    }
    if p.norm_entropy.is_nan() || p.norm_entropy > t.flat_norm_entropy {
        flat.push(format!(
            "H / ln V {:.3} > {} (near uniform)",
            p.norm_entropy, t.flat_norm_entropy
        ));
    }
    if p.mean_top1_logprob.is_nan() || p.mean_top1_logprob < t.flat_top1_logprob {
        flat.push(format!(
            "mean top-1 logprob {:.2} < {}",
            p.mean_top1_logprob, t.flat_top1_logprob
        ));
    }
    // Flat wins when the distributions themselves are flat: recurrence and repetition follow from it.
    if !flat.is_empty() {
        flat.extend(degenerate);
        ("flat".into(), flat)
    } else if !degenerate.is_empty() {
        ("degenerate".into(), degenerate)
    } else {
        ("healthy".into(), Vec::new())
    }
}

/// The run's verdict: healthy when every prompt is; otherwise the more common of flat/degenerate
/// (flat on a tie).
pub fn overall(prompts: &[PromptEntropy]) -> String {
    let n_flat = prompts.iter().filter(|p| p.verdict == "flat").count();
    let n_deg = prompts.iter().filter(|p| p.verdict == "degenerate").count();
    match (n_flat, n_deg) {
        (0, 0) => "healthy",
        (f, d) if f >= d => "flat",
        _ => "degenerate",
    }
    .to_string()
}

/// Per-position KLD(ref ‖ test) and the figures for same-top-1 and Δp, from two logits rows.
pub struct KldPosition {
    pub kld: f64,
    pub same_top1: bool,
    /// p(next) − p_ref(next), when the next token is known.
    pub dp: Option<f64>,
}

/// KLD at every position; `next[i]` is the token after position i, when known.
pub fn kld_positions(test: &[f32], reference: &[f32], vocab: usize, next: &[Option<u32>]) -> Vec<KldPosition> {
    test.chunks(vocab)
        .zip(reference.chunks(vocab))
        .enumerate()
        .map(|(i, (t, r))| {
            let lt = log_softmax(t);
            let lr = log_softmax(r);
            let kld: f64 = lr
                .iter()
                .zip(&lt)
                .filter(|(r, _)| r.is_finite())
                .map(|(&r, &t)| r.exp() * (r - t))
                .sum();
            let top = |l: &[f64]| top_k(l, 1).first().map(|x| x.0);
            KldPosition {
                kld: if kld.is_nan() { f64::INFINITY } else { kld.max(0.0) },
                same_top1: top(&lt) == top(&lr),
                dp: next
                    .get(i)
                    .copied()
                    .flatten()
                    .map(|id| lt[id as usize].exp() - lr[id as usize].exp()),
            }
        })
        .collect()
}

/// Linear-interpolated quantile of sorted values.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let x = q * (sorted.len() - 1) as f64;
    let (lo, hi) = (x.floor() as usize, x.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (x - lo as f64)
}

/// llama-perplexity's KL statistics over positions.
pub fn kld_stats(pos: &[KldPosition], threshold: f64) -> KldStats {
    let n = pos.len();
    let vals: Vec<f64> = pos.iter().map(|p| p.kld).collect();
    let mean = vals.iter().sum::<f64>() / n.max(1) as f64;
    let var = if n > 1 {
        vals.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64
    } else {
        0.0
    };
    let mut sorted = vals.clone();
    sorted.sort_by(f64::total_cmp);
    let dps: Vec<f64> = pos.iter().filter_map(|p| p.dp).collect();
    KldStats {
        n_positions: n,
        mean,
        mean_se: (var / n.max(1) as f64).sqrt(),
        median: quantile(&sorted, 0.5),
        p90: quantile(&sorted, 0.9),
        p99: quantile(&sorted, 0.99),
        p99_9: quantile(&sorted, 0.999),
        max: sorted.last().copied().unwrap_or(f64::NAN),
        same_top1_pct: 100.0 * pos.iter().filter(|p| p.same_top1).count() as f64 / n.max(1) as f64,
        rms_dp_pct: if dps.is_empty() {
            0.0
        } else {
            100.0 * (dps.iter().map(|d| d * d).sum::<f64>() / dps.len() as f64).sqrt()
        },
        first_over: vals.iter().position(|&v| v.is_nan() || v > threshold),
        threshold,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_plain_and_jsonl() {
        let p = parse_prompts("hello\n\nworld\n").unwrap();
        assert_eq!(p.len(), 2);
        let j = parse_prompts("{\"prompt\":\"a\"}\n{\"tokens\":[1,2]}\n").unwrap();
        assert_eq!(j[1].tokens, Some(vec![1, 2]));
        let e = parse_prompts("{\"prompt\":\"a\"}\n{\"tokens\":[-1]}\n").unwrap_err();
        assert!(e.to_string().starts_with("line 2:"), "{e}");
        assert!(parse_prompts("\n  \n").is_err());
    }

    #[test]
    fn repetition_and_recurrence() {
        assert_eq!(repetition(&[1, 2, 3, 4, 5, 6]), 0.0);
        assert!(repetition(&[1, 2, 1, 2, 1, 2, 1, 2, 1, 2]) > 0.7);
        let (s, top) = top5_recurrence(&vec![vec![1, 2, 3, 4, 5]; 4]);
        assert_eq!(s, 1.0);
        assert_eq!(top.len(), 5);
    }

    #[test]
    fn kld_zero_on_self_and_positive_otherwise() {
        let a = [1.0f32, 2.0, 3.0, 0.5];
        let b = [3.0f32, 2.0, 1.0, 0.5];
        let same = kld_positions(&a, &a, 4, &[Some(2)]);
        assert!(same[0].kld.abs() < 1e-15 && same[0].same_top1);
        let diff = kld_positions(&b, &a, 4, &[Some(2)]);
        assert!(diff[0].kld > 0.1 && !diff[0].same_top1);
        let s = kld_stats(&diff, 0.05);
        assert_eq!(s.first_over, Some(0));
    }
}
