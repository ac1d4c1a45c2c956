//! `llmdiff entropy --server URL`: the entropy check of a live OpenAI-compatible deployment from
//! its top-k logprobs (see [`crate::server`] for the requests and [`crate::topk`] for the entropy
//! bracket), and with `MODEL.gguf --against-reference` the reference run on the server's own
//! tokens with top-k KL statistics, top-k overlap and the first top-1 disagreement.
//!
//! Alignment. OpenAI's echo semantics put at entry i the distribution that predicted token i.
//! llama-cpp-python (0.3.x) does so only when the prompt starts with BOS; without BOS (SmolLM2)
//! its entry i is the distribution *after* token i. The greedy continuation tells them apart: at
//! temperature 0 each generated token is the top-1 of the distribution that predicted it, so the
//! alignment under which more generated tokens are their entry's top-1 is taken (and reported).

use crate::cli::EntropyArgs;
use crate::commands::entropy::{load_thresholds, print_summary};
use crate::entropy::{default_thresholds, kld_stats, overall, read_prompts, repetition, top5_recurrence, verdict};
use crate::entropy::{KldPosition, PromptInput};
use crate::logprobs::{log_softmax, top_k};
use crate::output::open_model;
use crate::server::{complete_all, Completion, PromptBody, ServerOptions};
use crate::topk::{entropy_bracket, overlap, topk_kld};
use anyhow::{bail, Context};
use references::forward::Reference;
use references::tap::NoTap;
use references::tokenizer::Tokenizer;
use references::ModelConfig;
use reports::{EntropyRun, PromptEntropy, ServerSource, TokenDisagreement, TopkOverlap, ENTROPY_FORMAT};
use std::collections::HashMap;
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Token strings to ids: the model's own ids where a string names exactly one token, otherwise
/// (or without a model) an interned id above the vocabulary.
struct TokenSpace {
    /// Tokens that decode to valid UTF-8 on their own (`None`: more than one).
    by_str: HashMap<String, Option<u32>>,
    /// Tokens holding part of a UTF-8 sequence, by their text with the U+FFFD dropped.
    partial: HashMap<String, Option<u32>>,
    interned: HashMap<String, u32>,
    names: Vec<String>,
    base: u32,
}

/// Python's `decode("utf-8", errors="ignore")` drops what ours turns into U+FFFD.
fn norm(s: &str) -> String {
    s.replace('\u{fffd}', "")
}

impl TokenSpace {
    fn new(tok: Option<&Tokenizer>, vocab: usize) -> TokenSpace {
        let mut by_str: HashMap<String, Option<u32>> = HashMap::new();
        let mut partial: HashMap<String, Option<u32>> = HashMap::new();
        if let Some(t) = tok {
            for id in 0..t.vocab_size() as u32 {
                if let Ok(s) = t.decode(&[id]) {
                    let map = if s.contains('\u{fffd}') {
                        &mut partial
                    } else {
                        &mut by_str
                    };
                    map.entry(norm(&s)).and_modify(|e| *e = None).or_insert(Some(id));
                }
            }
        }
        TokenSpace {
            by_str,
            partial,
            interned: HashMap::new(),
            names: Vec::new(),
            base: vocab as u32,
        }
    }

    /// The model's id of a token string, when unambiguous.
    fn model_id(&self, s: &str) -> Option<u32> {
        match self.by_str.get(s) {
            Some(id) => *id,
            None => self.partial.get(&norm(s)).copied().flatten(),
        }
    }

    /// A model id, or an interned one.
    fn id(&mut self, s: &str) -> u32 {
        if let Some(id) = self.model_id(s) {
            return id;
        }
        if let Some(&id) = self.interned.get(s) {
            return id;
        }
        let id = self.base + self.names.len() as u32;
        self.names.push(s.to_string());
        self.interned.insert(s.to_string(), id);
        id
    }
}

/// One completion cut into positions.
struct Parsed {
    /// Entries that belong to the prompt (the rest are the continuation).
    n_prompt: usize,
}

fn split(c: &Completion, prompt_chars: usize) -> anyhow::Result<Parsed> {
    if c.entries.iter().all(|e| e.text_offset.is_some()) {
        let n_prompt = c
            .entries
            .iter()
            .take_while(|e| e.text_offset.is_some_and(|o| o < prompt_chars))
            .count();
        return Ok(Parsed { n_prompt });
    }
    bail!("the response's logprobs have no text_offset: cannot tell the echoed prompt from the continuation")
}

/// +1 per generated token that is its entry's top-1 under OpenAI alignment, and under the shifted one.
fn alignment_votes(c: &Completion, n_prompt: usize) -> (usize, usize) {
    let top1 = |i: usize| {
        c.entries
            .get(i)
            .and_then(|e| e.top.as_ref())
            .and_then(|t| t.first())
            .map(|t| t.0.as_str())
    };
    let mut openai = 0;
    let mut shifted = 0;
    for i in n_prompt..c.entries.len() {
        let tok = c.entries[i].token.as_str();
        if top1(i) == Some(tok) {
            openai += 1;
        }
        if i > 0 && top1(i - 1) == Some(tok) {
            shifted += 1;
        }
    }
    (openai, shifted)
}

pub fn run(a: &EntropyArgs) -> anyhow::Result<ExitCode> {
    let t0 = Instant::now();
    let url = a.server.clone().unwrap_or_default();
    let prompts = read_prompts(&a.prompts)?;
    if !a.inject.is_empty() || a.tp != 1 {
        bail!("--inject and --tp apply to a local backend, not to --server");
    }
    if a.top_logprobs == 0 {
        bail!("--top-logprobs must be at least 1");
    }
    if a.against_reference && a.model.is_none() {
        bail!("--against-reference with --server needs MODEL.gguf");
    }
    let mut thresholds = match &a.thresholds {
        Some(p) => load_thresholds(p)?,
        None => default_thresholds(),
    };
    if let Some(k) = a.kld_threshold {
        thresholds.kld_position = k;
    }
    let file = a.model.as_ref().map(|m| open_model(m)).transpose()?;
    let config = file.as_ref().map(|f| ModelConfig::from_header(&f.header)).transpose()?;
    let vocab = match (&config, a.vocab) {
        (Some(c), _) => c.vocab,
        (None, Some(v)) if v > 0 => v,
        _ => bail!("--server without MODEL.gguf needs --vocab N (the vocabulary size)"),
    };
    let tokenizer = file.as_ref().and_then(|f| Tokenizer::from_gguf(&f.header).ok());
    // What each prompt is sent as, and how long it is in characters of the echoed text.
    let mut bodies = Vec::with_capacity(prompts.len());
    let mut prompt_chars = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        match p {
            PromptInput { text: Some(t), .. } => {
                bodies.push(PromptBody::Text(t.clone()));
                prompt_chars.push(t.chars().count());
            }
            PromptInput { tokens: Some(ids), .. } => {
                let Some(tok) = &tokenizer else {
                    bail!("prompt {}: token-id prompts with --server need MODEL.gguf", i + 1)
                };
                let text = tok
                    .decode(ids)
                    .with_context(|| format!("prompt {}: cannot decode its ids", i + 1))?;
                prompt_chars.push(text.chars().count());
                bodies.push(PromptBody::Tokens(ids.clone()));
            }
            _ => bail!("prompt {}: no text and no tokens", i + 1),
        }
    }
    let opts = ServerOptions {
        url: url.clone(),
        model: a.served_model.clone(),
        api_key: a
            .api_key
            .clone()
            .or_else(|| std::env::var("OPENAI_API_KEY").ok())
            .filter(|k| !k.is_empty()),
        top_k: a.top_logprobs,
        max_tokens: a.max_new_tokens,
        timeout: Duration::from_secs_f64(a.timeout.clamp(0.1, 86_400.0)),
        retries: a.retries,
        backoff: Duration::from_millis(500),
        concurrency: a.concurrency.max(1),
    };
    eprintln!(
        "{} prompts to {} ({} at a time, top-{})",
        prompts.len(),
        url,
        opts.concurrency,
        opts.top_k
    );
    let completions = complete_all(&opts, &bodies)?;
    let parsed: Vec<Parsed> = completions
        .iter()
        .zip(&prompt_chars)
        .enumerate()
        .map(|(i, (c, &n))| split(c, n).with_context(|| format!("prompt {}", i + 1)))
        .collect::<anyhow::Result<_>>()?;
    let (mut v_open, mut v_shift) = (0, 0);
    for (c, p) in completions.iter().zip(&parsed) {
        let (o, s) = alignment_votes(c, p.n_prompt);
        v_open += o;
        v_shift += s;
    }
    let shifted = v_shift > v_open;
    let alignment = if shifted { "shifted" } else { "openai" };
    eprintln!(
        "alignment: {alignment} (greedy tokens that are their entry's top-1: openai {v_open}, shifted {v_shift})"
    );

    let mut space = TokenSpace::new(tokenizer.as_ref(), vocab);
    let bos = tokenizer.as_ref().filter(|t| t.add_bos()).and_then(|t| t.bos_id());
    let reference = match (&file, a.against_reference) {
        (Some(f), true) => Some(Reference::new(f)?),
        _ => None,
    };
    let k = a.top_logprobs;
    let mut out = Vec::with_capacity(prompts.len());
    let mut all_kld: Vec<KldPosition> = Vec::new();
    let (mut ov_sum, mut jac_sum, mut ov_n) = (0.0, 0.0, 0usize);
    let mut first_dis: Option<TokenDisagreement> = None;
    for (pi, ((p, c), parts)) in prompts.iter().zip(&completions).zip(&parsed).enumerate() {
        let np = parts.n_prompt;
        // The server's token sequence (without BOS) as ids.
        let ids: Vec<u32> = c.entries.iter().map(|e| space.id(&e.token)).collect();
        let has_bos = bos.is_some() && !shifted;
        // ctx(i): tokens of `ids` the entry's distribution has seen.
        let ctx = |i: usize| if shifted { i + 1 } else { i };
        let mut ent_lo = Vec::new();
        let mut ent_hi = Vec::new();
        let mut resid = Vec::new();
        let mut top1 = Vec::new();
        let mut top5 = Vec::new();
        for (i, e) in c.entries.iter().enumerate() {
            let Some(top) = &e.top else { continue };
            if ctx(i) > np {
                continue;
            }
            let lps: Vec<f64> = top.iter().map(|t| t.1).collect();
            let b = entropy_bracket(&lps, k, vocab);
            ent_lo.push(b.lower);
            ent_hi.push(b.upper);
            resid.push(b.residual);
            top1.push(lps.first().copied().unwrap_or(f64::NAN));
            top5.push(top.iter().take(5.min(k)).map(|t| space.id(&t.0)).collect::<Vec<u32>>());
        }
        if ent_lo.is_empty() {
            bail!(
                "prompt {}: the server gave no prompt logprobs (does it honour echo?)",
                pi + 1
            );
        }
        let n = ent_lo.len() as f64;
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        let continuation: Vec<u32> = ids[np.min(ids.len())..].to_vec();
        let text_chars: Vec<char> = c.text.chars().collect();
        let cont_text: String = text_chars[prompt_chars[pi].min(text_chars.len())..].iter().collect();
        let (recurrence, recurring) = top5_recurrence(&top5);
        // Against the reference, on the server's tokens.
        let mut kld = None;
        let mut p_overlap = None;
        if let Some(r) = &reference {
            if let Some(bad) = c.entries.iter().find(|e| space.model_id(&e.token).is_none()) {
                bail!(
                    "prompt {}: the server's token {:?} does not map to one token of MODEL.gguf's vocabulary (a different tokenizer?)",
                    pi + 1,
                    bad.token
                );
            }
            if let (Some(tok), Some(text)) = (&tokenizer, &p.text) {
                let ours = tok.encode(text, false)?;
                if ours != ids[..np] {
                    eprintln!(
                        "  prompt {}: our tokenization differs from the server's ({} vs {} tokens); using the server's",
                        pi + 1,
                        ours.len(),
                        np
                    );
                }
            }
            let mut full: Vec<u32> = Vec::with_capacity(ids.len() + 1);
            full.extend(bos.filter(|_| has_bos));
            full.extend_from_slice(&ids);
            let off = usize::from(has_bos);
            let rows_needed = c
                .entries
                .iter()
                .enumerate()
                .filter(|(_, e)| e.top.is_some())
                .map(|(i, _)| (ctx(i) + off).saturating_sub(1) + 1)
                .max()
                .unwrap_or(0)
                .min(full.len());
            let ref_logits = r.forward(&full[..rows_needed], &mut NoTap)?;
            let mut pos = Vec::new();
            let (mut os, mut js, mut on) = (0.0, 0.0, 0usize);
            for (i, e) in c.entries.iter().enumerate() {
                let Some(top) = &e.top else { continue };
                let Some(row) = (ctx(i) + off).checked_sub(1) else {
                    continue;
                };
                if row >= rows_needed {
                    continue;
                }
                let lr = log_softmax(&ref_logits[row * vocab..(row + 1) * vocab]);
                let mut set = Vec::new();
                let mut lps = Vec::new();
                for (s, lp) in top.iter().take(k) {
                    if let Some(id) = space.model_id(s) {
                        if !set.contains(&id) {
                            set.push(id);
                            lps.push(*lp);
                        }
                    }
                }
                if set.is_empty() {
                    continue;
                }
                let ref_top: Vec<u32> = top_k(&lr, set.len()).iter().map(|t| t.0).collect();
                let (o, j) = overlap(&set, &ref_top, set.len());
                os += o;
                js += j;
                on += 1;
                let same = set[0] == ref_top[0];
                if !same && first_dis.is_none() {
                    let name = |id: u32| {
                        tokenizer
                            .as_ref()
                            .and_then(|t| t.decode(&[id]).ok())
                            .unwrap_or_else(|| id.to_string())
                    };
                    first_dis = Some(TokenDisagreement {
                        prompt: pi + 1,
                        position: row,
                        server_token: top[0].0.clone(),
                        reference_token: name(ref_top[0]),
                    });
                }
                let next = full.get(row + 1).copied();
                let server_next = next.and_then(|id| {
                    top.iter()
                        .find(|t| space.model_id(&t.0) == Some(id))
                        .map(|t| t.1)
                        .or(if shifted { None } else { e.logprob })
                });
                pos.push(KldPosition {
                    kld: topk_kld(&set, &lps, &lr),
                    same_top1: same,
                    dp: next.zip(server_next).map(|(id, ls)| ls.exp() - lr[id as usize].exp()),
                });
            }
            kld = Some(kld_stats(&pos, thresholds.kld_position));
            all_kld.extend(pos);
            p_overlap = Some(TopkOverlap {
                k,
                overlap_at_k: os / on.max(1) as f64,
                jaccard: js / on.max(1) as f64,
                first_top1_disagreement: None,
            });
            ov_sum += os;
            jac_sum += js;
            ov_n += on;
        }
        let mean_entropy = mean(&ent_lo);
        let mut pe = PromptEntropy {
            label: p.label.clone(),
            n_tokens: np + usize::from(bos.is_some() && !shifted),
            verdict: String::new(),
            reasons: Vec::new(),
            mean_entropy,
            min_entropy: ent_lo.iter().copied().fold(f64::INFINITY, f64::min),
            norm_entropy: mean_entropy / (vocab as f64).ln(),
            mean_top1_logprob: top1.iter().sum::<f64>() / n,
            top5_recurrence: recurrence,
            recurring_top5: recurring,
            repetition: repetition(&continuation),
            continuation,
            continuation_text: Some(cont_text),
            nonfinite: top1.iter().filter(|x| x.is_nan() || **x == f64::INFINITY).count() as u64,
            kld,
            entropy_upper: Some(mean(&ent_hi)),
            topk_residual: Some(mean(&resid)),
            overlap: p_overlap,
            // Per-position lower bounds (the server gives top-k only).
            entropies: ent_lo.clone(),
            reference_entropies: Vec::new(),
            kld_positions: Vec::new(),
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
    let overlap_all = reference.as_ref().map(|_| TopkOverlap {
        k,
        overlap_at_k: ov_sum / ov_n.max(1) as f64,
        jaccard: jac_sum / ov_n.max(1) as f64,
        first_top1_disagreement: first_dis.clone(),
    });
    let run = EntropyRun {
        format: ENTROPY_FORMAT,
        llmdiff_version: env!("CARGO_PKG_VERSION").to_string(),
        model: a
            .model
            .as_ref()
            .map_or_else(|| a.served_model.clone(), |m| m.display().to_string()),
        backend: format!("server {url}"),
        tp: 1,
        injected: Vec::new(),
        vocab,
        max_new_tokens: a.max_new_tokens,
        thresholds,
        verdict: overall(&out),
        agreement,
        prompts: out,
        kld,
        seconds: t0.elapsed().as_secs_f64(),
        server: Some(ServerSource {
            url: url.clone(),
            served_model: a.served_model.clone(),
            top_k: k,
            alignment: alignment.to_string(),
            kld_support: "server_topk".to_string(),
        }),
        overlap: overlap_all,
    };
    crate::commands::entropy::finish(a, &run, || {
        print_summary(&run, tokenizer.as_ref());
        print_server_summary(&run);
    })
}

fn print_server_summary(run: &EntropyRun) {
    let Some(s) = &run.server else { return };
    println!(
        "\n  from the server's top-{} logprobs ({} alignment): H above is a lower bound",
        s.top_k, s.alignment
    );
    println!("  {:<4} {:>8} {:>8} {:>9}  prompt", "#", "H_lo", "H_hi", "residual");
    for (i, p) in run.prompts.iter().enumerate() {
        println!(
            "  {:<4} {:>8.3} {:>8.3} {:>9.4}  {}",
            i + 1,
            p.mean_entropy,
            p.entropy_upper.unwrap_or(f64::NAN),
            p.topk_residual.unwrap_or(f64::NAN),
            p.label
        );
    }
    if let Some(o) = &run.overlap {
        println!(
            "  top-{} overlap with the reference: overlap@k {:.3}, Jaccard {:.3}; KLD over the server's top-k, both sides renormalized",
            o.k, o.overlap_at_k, o.jaccard
        );
        match &o.first_top1_disagreement {
            Some(d) => println!(
                "  first top-1 disagreement: prompt #{} position {}: server {:?}, reference {:?}",
                d.prompt, d.position, d.server_token, d.reference_token
            ),
            None => println!("  top-1 agrees at every position"),
        }
    }
}
