//! `llmdiff entropy --server URL`: the entropy check of a live OpenAI-compatible deployment from
//! its top-k logprobs (see [`crate::server`] for the requests and [`crate::topk`] for the entropy
//! bracket), and with `MODEL.gguf --against-reference` the reference run on the server's own
//! tokens with top-k KL statistics, top-k overlap and the first top-1 disagreement. How entries
//! become positions (alignment, token ids) is [`crate::server_view`]'s.

use super::shared::{finish, print_summary, print_verdict, thresholds, Extra};
use crate::cli::EntropyArgs;
use crate::entropy::{kld_stats, overall, read_prompts, KldPosition, PromptInput};
use crate::kld_verdict::{judge, Band, Cause, PosKld, Profile, RepeatProbe};
use crate::logprobs::{log_softmax, top_k};
use crate::output::open_model;
use crate::server::{complete_all, PromptBody, ServerOptions};
use crate::server_view::{prompt_entries, prompt_entropy, topk_signals, Alignment, TokenSpace};
use crate::topk::{overlap, row_logprob, topk_kld};
use anyhow::{bail, Context};
use references::forward::Reference;
use references::tap::NoTap;
use references::tokenizer::Tokenizer;
use references::ModelConfig;
use reports::{EntropyRun, ServerSource, TokenDisagreement, TopkOverlap, ENTROPY_FORMAT};
use std::process::ExitCode;
use std::time::Instant;

pub fn run(a: &EntropyArgs) -> anyhow::Result<ExitCode> {
    let t0 = Instant::now();
    // Credentials in the URL go in a header, never into output.
    let url = crate::server::redact_url(&a.live.server.clone().unwrap_or_default());
    let prompts = read_prompts(&a.prompts)?;
    let e = &a.engine;
    if e.backend.is_some() || e.tp.is_some() || !e.inject.is_empty() || e.cuda_graphs.is_some() || e.ranks.is_some() {
        bail!("--backend, --tp, --inject, --cuda-graphs and --ranks apply to a local run, not to --server");
    }
    if a.live.top_logprobs == 0 {
        bail!("--top-logprobs must be at least 1");
    }
    if a.against_reference && a.model.is_none() {
        bail!("--against-reference with --server needs MODEL.gguf");
    }
    let thresholds = thresholds(a)?;
    let calibration = a.verdict.calibration()?;
    let deployed = a.model.as_ref().map(|m| open_model(m)).transpose()?;
    let trusted = a.trusted_model.as_ref().map(|m| open_model(m)).transpose()?;
    // The reference side (tokenizer, BOS, forward pass): the trusted source when given.
    let file = trusted.as_ref().or(deployed.as_ref());
    let metadata_diff = match (&deployed, &trusted) {
        (Some(d), Some(t)) => metadata_differences(&d.header, &t.header),
        _ => Vec::new(),
    };
    let config = file.map(|f| ModelConfig::from_header(&f.header)).transpose()?;
    let vocab = match (&config, a.vocab) {
        (Some(c), _) => c.vocab,
        (None, Some(v)) if v > 0 => v,
        _ => bail!("--server without MODEL.gguf needs --vocab N (the vocabulary size)"),
    };
    let tokenizer = file.and_then(|f| Tokenizer::for_model(f).ok());
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
    let opts = a.live.options(a.max_new_tokens, a.live.deadline_from(t0));
    eprintln!(
        "{} prompts to {} ({} at a time, top-{})",
        prompts.len(),
        url,
        opts.concurrency,
        opts.top_k
    );
    let completions = complete_all(&opts, &bodies)?;
    let n_prompts: Vec<usize> = completions
        .iter()
        .zip(&prompt_chars)
        .enumerate()
        .map(|(i, (c, &n))| prompt_entries(c, n).with_context(|| format!("prompt {}", i + 1)))
        .collect::<anyhow::Result<_>>()?;
    let mut extra = Extra::default();
    for (i, (c, &n)) in completions.iter().zip(&n_prompts).enumerate() {
        if let Some(w) = c.truncation_warning(n, a.max_new_tokens) {
            eprintln!("warning: prompt {}: {w}", i + 1);
            extra.warnings.push(format!("prompt {}: {w}", i + 1));
        }
    }
    let (align, v_open, v_shift) = Alignment::detect(&completions, &n_prompts);
    let shifted = align == Alignment::Shifted;
    let alignment = align.name();
    eprintln!(
        "alignment: {alignment} (greedy tokens that are their entry's top-1: openai {v_open}, shifted {v_shift})"
    );

    let mut space = TokenSpace::new(tokenizer.as_ref(), vocab);
    let bos = tokenizer.as_ref().filter(|t| t.add_bos()).and_then(|t| t.bos_id());
    let reference = match (file, a.against_reference) {
        (Some(f), true) => Some(Reference::new(f)?),
        _ => None,
    };
    let k = a.live.top_logprobs;
    let mut out = Vec::with_capacity(prompts.len());
    let mut all_kld: Vec<KldPosition> = Vec::new();
    let (mut ov_sum, mut jac_sum, mut ov_n) = (0.0, 0.0, 0usize);
    let mut first_dis: Option<TokenDisagreement> = None;
    let mut profile = Profile {
        reference_is_deployed_file: trusted.is_none(),
        ..Profile::default()
    };
    let mut pos_kld: Vec<PosKld> = Vec::new();
    for (pi, ((p, c), &np)) in prompts.iter().zip(&completions).zip(&n_prompts).enumerate() {
        // The server's token sequence (without BOS) as ids.
        let ids: Vec<u32> = c.entries.iter().map(|e| space.id(&e.token)).collect();
        let has_bos = bos.is_some() && !shifted;
        // ctx(i): tokens of `ids` the entry's distribution has seen.
        let ctx = |i: usize| align.context(i);
        let signals = topk_signals(c, np, align, k, vocab, &mut space);
        if signals.lower.is_empty() {
            bail!(
                "prompt {}: the server gave no prompt logprobs (does it honour echo?)",
                pi + 1
            );
        }
        let continuation: Vec<u32> = ids[np.min(ids.len())..].to_vec();
        let text_chars: Vec<char> = c.text.chars().collect();
        let cont_text: String = text_chars[prompt_chars[pi].min(text_chars.len())..].iter().collect();
        // Against the reference, on the server's tokens.
        let mut kld = None;
        let mut p_overlap = None;
        let mut series = Vec::new();
        if let Some(r) = &reference {
            if let Some(bad) = c.entries.iter().find(|e| space.model_id(&e.token).is_none()) {
                bail!(
                    "prompt {}: the server's token {:?} does not map to one token of MODEL.gguf's vocabulary (a different tokenizer?)",
                    pi + 1,
                    bad.token
                );
            }
            let mut shift = None;
            if let (Some(tok), Some(text)) = (&tokenizer, &p.text) {
                let ours = tok.encode(text, false)?;
                // What the server should count: the prompt's tokens and the BOS the model expects.
                let expected = ours.len() + usize::from(bos.is_some());
                shift = c.prompt_tokens.map(|n| n as i64 - expected as i64);
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
            profile.prompt_token_shift.push(shift);
            let ref_logits = r.forward(&full[..rows_needed], &mut NoTap)?;
            let first_pos = pos_kld.len();
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
                let (set, lps) = space.listed_set(top, k);
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
                let kld_here = topk_kld(&set, &lps, row_logprob(&lr));
                pos_kld.push(PosKld {
                    prompt: pi,
                    // The index in the server's own sequence (BOS, when the model adds one, is 0).
                    pos: row,
                    len: rows_needed,
                    kld: kld_here,
                    same_top1: same,
                });
                pos.push(KldPosition {
                    kld: kld_here,
                    same_top1: same,
                    dp: next.zip(server_next).map(|(id, ls)| ls.exp() - lr[id as usize].exp()),
                });
            }
            debug_assert!(pos_kld[first_pos..].iter().all(|p| p.len == rows_needed));
            series = pos_kld[first_pos..].iter().map(|p| p.kld).collect();
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
        let mut pe = prompt_entropy(
            &p.label,
            np + usize::from(bos.is_some() && !shifted),
            &signals,
            continuation,
            Some(cont_text),
            vocab,
            &thresholds,
        );
        pe.kld = kld;
        // Per compared position, in sequence order from the first one the server gave a
        // distribution for (what the verdict's position profile reads).
        pe.kld_positions = series;
        pe.overlap = p_overlap;
        profile.entropy_verdicts.push(pe.verdict.clone());
        out.push(pe);
    }
    let kld = reference.as_ref().map(|_| kld_stats(&all_kld, thresholds.kld_position));
    // The calibrated verdict: the distribution of per-position KLD against the healthy floor.
    let mut verdict = reference.as_ref().map(|_| judge(&pos_kld, &profile, &calibration));
    // The repeated-span probe tells a RoPE fault from a uniform one when the server gives no
    // position 0: by default sent only when it can change the cause (a rise the prompts read as
    // uniform), so a healthy server sees no extra request. A probe that cannot be run (no word tokens, an
    // echo that is not ours, a request that fails) is skipped with a note.
    if let (Some(v), Some(r), Some(tok)) = (&verdict, &reference, &tokenizer) {
        let wanted = match a.repeat_probe.as_str() {
            "always" => true,
            "never" => false,
            _ => v.cause == Cause::UniformShift,
        };
        if wanted {
            let has_bos = bos.is_some() && !shifted;
            match repeat_probe(&opts, r, tok, &mut space, bos.filter(|_| has_bos), align, vocab, k) {
                Ok(p) => {
                    eprintln!(
                        "repeated-span probe: {} sequences, mean KLD on the repeats {:.4}, on the first copy {:.4} ({:.2}×)",
                        p.sequences, p.repeat_mean, p.first_mean, p.ratio
                    );
                    profile.repeat_probe = Some(p);
                    verdict = Some(judge(&pos_kld, &profile, &calibration));
                }
                Err(e) => eprintln!("note: the repeated-span probe was skipped: {e:#}"),
            }
        }
    }
    if let Some(v) = &verdict {
        extra.set_verdict(v, a.verdict.precision_loss_exit)?;
        if !metadata_diff.is_empty() {
            extra.html_lines.push(format!(
                "the deployed file's metadata differs from --trusted-model's: {}",
                metadata_diff.join("; ")
            ));
        }
        if let Some(doc) = extra.kld_verdict.as_mut() {
            doc["metadata_differences"] = serde_json::json!(metadata_diff);
        }
    }
    let mut agreement = verdict.as_ref().map(|v| v.band_name.clone());
    if a.chat {
        let (Some(r), Some(tok), Some(f)) = (&reference, &tokenizer, file) else {
            bail!("--chat needs MODEL.gguf and --against-reference");
        };
        let c = chat_check(&prompts, &opts, r, tok, f, &mut space, vocab, k, &calibration)?;
        for l in &c.lines {
            eprintln!("chat: {l}");
        }
        extra.html_lines.extend(c.lines.iter().map(|l| format!("chat: {l}")));
        if c.failed {
            // The chat path is broken even where the completions path is not.
            agreement = Some("broken".to_string());
        }
        extra.chat = Some(c.doc);
    }
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
            .map_or_else(|| a.live.served_model.clone(), |m| m.display().to_string()),
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
            served_model: a.live.served_model.clone(),
            top_k: k,
            alignment: alignment.to_string(),
            kld_support: "server_topk".to_string(),
        }),
        overlap: overlap_all,
    };
    finish(a, &run, &extra, || {
        print_summary(&run, tokenizer.as_ref());
        print_server_summary(&run);
        if let Some(v) = &verdict {
            print_verdict(v);
            for m in &metadata_diff {
                println!(
                    "    the deployed file differs from --trusted-model: {}",
                    crate::output::term(m)
                );
            }
        }
    })
}

/// The repeated-span probe's shape: sequences, span length, copies of the span.
const PROBE_SEQUENCES: usize = 8;
const PROBE_SPAN: usize = 12;
const PROBE_COPIES: usize = 3;

/// The probe's token sequences: distinct random word tokens (a space, then three or more ASCII
/// lowercase letters: text that decodes and re-encodes to the token alone and names it
/// unambiguously in the server's echo), a fixed draw, each span repeated [`PROBE_COPIES`] times,
/// kept when the whole sequence's text tokenizes back to it (it is sent as text). Empty when the
/// vocabulary has too few such tokens.
pub fn probe_sequences(tok: &Tokenizer, space: &TokenSpace) -> Vec<Vec<u32>> {
    let n = tok.vocab_size() as u64;
    let mut state: u64 = 0x5EED_0045;
    // splitmix64: the same draw on every run and platform.
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut out = Vec::new();
    let mut used = std::collections::HashSet::new();
    let mut tries = 0;
    while out.len() < PROBE_SEQUENCES && n > 0 {
        let mut span = Vec::with_capacity(PROBE_SPAN);
        while span.len() < PROBE_SPAN {
            tries += 1;
            if tries > 200_000 {
                return Vec::new();
            }
            let id = (next() % n) as u32;
            let Ok(s) = tok.decode(&[id]) else { continue };
            let word = s
                .strip_prefix(' ')
                .is_some_and(|w| w.len() >= 3 && w.chars().all(|c| c.is_ascii_lowercase()));
            if word
                && !used.contains(&id)
                && space.model_id(&s) == Some(id)
                && tok.encode(&s, false).ok().as_deref() == Some(&[id][..])
            {
                used.insert(id);
                span.push(id);
            }
        }
        let seq = span.repeat(PROBE_COPIES);
        // Sent as text (llama-cpp-python's server takes no token-id prompts): it must tokenize
        // back to these very ids.
        if tok.decode(&seq).ok().and_then(|t| tok.encode(&t, false).ok()).as_ref() == Some(&seq) {
            out.push(seq);
        }
    }
    out
}

/// Sends the repeated-span probe (one greedy token each) and compares the server's top-k with the
/// reference on the probe's tokens: [`RepeatProbe`].
#[allow(clippy::too_many_arguments)]
fn repeat_probe(
    opts: &ServerOptions,
    r: &Reference,
    tok: &Tokenizer,
    space: &mut TokenSpace,
    bos: Option<u32>,
    align: Alignment,
    vocab: usize,
    k: usize,
) -> anyhow::Result<RepeatProbe> {
    let seqs = probe_sequences(tok, space);
    if seqs.is_empty() {
        bail!("the vocabulary has too few plain word tokens for it");
    }
    let mut o = opts.clone();
    o.max_tokens = 1;
    // An auxiliary check: one retry at most.
    o.retries = o.retries.min(1);
    let bodies: Vec<PromptBody> = seqs
        .iter()
        .map(|s| tok.decode(s).map(PromptBody::Text))
        .collect::<Result<_, _>>()?;
    let comps = complete_all(&o, &bodies)?;
    let off = usize::from(bos.is_some());
    let mut pos = Vec::new();
    for (si, (seq, c)) in seqs.iter().zip(&comps).enumerate() {
        let echo_ok = c.entries.len() >= seq.len()
            && c.entries
                .iter()
                .zip(seq)
                .all(|(e, &id)| space.model_id(&e.token) == Some(id));
        if !echo_ok {
            bail!("sequence {}: the server's echo is not the probe's tokens", si + 1);
        }
        let mut full: Vec<u32> = bos.into_iter().collect();
        full.extend_from_slice(seq);
        let logits = r.forward(&full, &mut NoTap)?;
        for (i, e) in c.entries.iter().enumerate().take(seq.len()) {
            let Some(top) = &e.top else { continue };
            let Some(row) = (align.context(i) + off).checked_sub(1) else {
                continue;
            };
            if row < off || row >= full.len() {
                continue;
            }
            let lr = log_softmax(&logits[row * vocab..(row + 1) * vocab]);
            let (set, lps) = space.listed_set(top, k);
            if set.is_empty() {
                continue;
            }
            let same = top_k(&lr, 1).first().map(|t| t.0) == Some(set[0]);
            pos.push(PosKld {
                prompt: si,
                pos: row - off,
                len: seq.len(),
                kld: topk_kld(&set, &lps, row_logprob(&lr)),
                same_top1: same,
            });
        }
    }
    Ok(RepeatProbe::from_positions(&pos, seqs.len(), PROBE_SPAN, PROBE_COPIES))
}

/// The scalar metadata keys whose values differ between the deployed file and the trusted one
/// (`key: deployed vs trusted`), arrays (vocabularies) left out: a metadata fault named directly.
fn metadata_differences(
    deployed: &references::gguf::GgufHeader,
    trusted: &references::gguf::GgufHeader,
) -> Vec<String> {
    use references::gguf::MetaValue;
    let scalar = |v: &MetaValue| !matches!(v, MetaValue::Array { .. });
    let show = |v: Option<&MetaValue>| v.map_or("(absent)".to_string(), |v| crate::output::meta_json(v, 8).to_string());
    let mut keys: Vec<&str> = deployed
        .metadata
        .iter()
        .chain(&trusted.metadata)
        .filter(|(_, v)| scalar(v))
        .map(|(k, _)| k.as_str())
        .collect();
    keys.sort_unstable();
    keys.dedup();
    keys.into_iter()
        .filter(|k| *k != "general.name" && !k.starts_with("general.file"))
        .filter_map(|k| {
            let (d, t) = (deployed.get(k), trusted.get(k));
            (d != t).then(|| format!("{k}: {} vs {}", show(d), show(t)))
        })
        .collect()
}

/// What `--chat` found.
struct ChatOutcome {
    doc: serde_json::Value,
    lines: Vec<String>,
    failed: bool,
}

/// `--chat`: each text prompt as a one-turn conversation, rendered with the model's chat template
/// and sent to `/v1/chat/completions`; the server's prompt token count against the rendering's
/// ([`crate::chat::TemplateFinding`]), and its answer's top-k logprobs against the reference run on
/// the rendered prompt and the server's answer tokens, judged by the calibrated rule.
#[allow(clippy::too_many_arguments)]
fn chat_check(
    prompts: &[PromptInput],
    opts: &crate::server::ServerOptions,
    r: &Reference,
    tok: &Tokenizer,
    f: &references::gguf::GgufFile,
    space: &mut TokenSpace,
    vocab: usize,
    k: usize,
    calibration: &crate::kld_verdict::Calibration,
) -> anyhow::Result<ChatOutcome> {
    use crate::chat::{render, send, TemplateFinding};
    let template = match f.header.get("tokenizer.chat_template") {
        Some(references::gguf::MetaValue::String(t)) => t.clone(),
        _ => bail!("--chat: the model has no tokenizer.chat_template"),
    };
    let name = |id: Option<u32>| id.and_then(|i| tok.token_str(i).ok()).unwrap_or_default().to_string();
    let (bos_s, eos_s) = (name(tok.bos_id()), name(tok.eos_id()));
    let bos = tok.bos_id().filter(|_| tok.add_bos());
    let mut pos_kld = Vec::new();
    let mut findings = Vec::new();
    let mut lines = Vec::new();
    let mut failed = false;
    for (pi, p) in prompts.iter().enumerate() {
        let Some(text) = &p.text else { continue };
        let with_gen = render(&template, text, &bos_s, &eos_s, true)?;
        let without = render(&template, text, &bos_s, &eos_s, false)?;
        let ids: Vec<u32> = bos.into_iter().chain(tok.encode(&with_gen, true)?).collect();
        let n_without = usize::from(bos.is_some()) + tok.encode(&without, true)?.len();
        let ans = send(opts, text).with_context(|| format!("--chat prompt {}", pi + 1))?;
        let finding = TemplateFinding::from_counts(ans.prompt_tokens, ids.len(), n_without);
        if matches!(
            finding,
            TemplateFinding::WrongTemplate | TemplateFinding::MissingGenerationPrompt
        ) {
            failed = true;
            lines.push(format!(
                "prompt {}: {} (server {} prompt tokens; the model's template {}, without the generation prompt {})",
                pi + 1,
                finding.describe(),
                ans.prompt_tokens.unwrap_or(0),
                ids.len(),
                n_without
            ));
        }
        // The answer against the reference on the rendered prompt.
        let answer: Vec<Option<u32>> = ans.entries.iter().map(|e| space.model_id(&e.token)).collect();
        let known = answer.iter().take_while(|a| a.is_some()).count();
        let mut seq = ids.clone();
        seq.extend(answer[..known].iter().flatten());
        let rows = (ids.len() + known.saturating_sub(1)).min(seq.len());
        let logits = r.forward(&seq[..rows], &mut NoTap)?;
        for (j, e) in ans.entries.iter().enumerate().take(known) {
            let Some(top) = &e.top else { continue };
            let row = ids.len() + j - 1;
            if row >= rows {
                break;
            }
            let lr = log_softmax(&logits[row * vocab..(row + 1) * vocab]);
            let (set, lps) = space.listed_set(top, k);
            if set.is_empty() {
                continue;
            }
            let ref_top = top_k(&lr, 1)[0].0;
            pos_kld.push(PosKld {
                prompt: pi,
                pos: j,
                len: known,
                kld: topk_kld(&set, &lps, row_logprob(&lr)),
                same_top1: set[0] == ref_top,
            });
        }
        findings.push(serde_json::json!({
            "prompt": pi + 1,
            "finding": finding,
            "server_prompt_tokens": ans.prompt_tokens,
            "template_tokens": ids.len(),
            "template_tokens_without_generation_prompt": n_without,
            "answer": ans.text,
        }));
    }
    if findings.is_empty() {
        bail!("--chat: no text prompt to send as a conversation");
    }
    let verdict = (!pos_kld.is_empty()).then(|| judge(&pos_kld, &Profile::default(), calibration));
    if let Some(v) = &verdict {
        lines.push(format!(
            "answers against the reference on the rendered prompt: {}",
            v.headline
        ));
        failed |= v.band == Band::Broken;
    }
    if !failed {
        lines.push("the server's prompt is the model's chat template on every prompt".into());
    }
    Ok(ChatOutcome {
        doc: serde_json::json!({"prompts": findings, "verdict": verdict}),
        lines,
        failed,
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
            crate::output::term(&p.label)
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
