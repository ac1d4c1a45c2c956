//! `llmdiff gate --server URL`: gate a live OpenAI-compatible deployment (vLLM, SGLang, TGI,
//! llama.cpp's server) against golden files, with no model file needed: each golden prompt is sent
//! as its text, or with `--send-tokens` as its token ids (`echo`, `logprobs: K`, temperature 0,
//! `max_tokens` = the golden continuation); the echo must give back the golden's tokens. The
//! server's top-k logprobs are read as positions ([`crate::server_view`]) and mapped to ids
//! through the golden file's `token_text`.
//!
//! Checks, one JUnit case each:
//! - `prompt N / server positions`: every prompt position, and every greedy step while the
//!   continuation still equals the golden's: KLD(golden ‖ server) over the server's top-k set, both
//!   renormalized ([`crate::topk::topk_kld`], as `entropy --server`; a server token outside the
//!   golden's top-20 gets the golden's 20th logprob, the most it can have), within
//!   `kld_position`; and the top-1 token the golden's, unless the golden's own logprobs put the
//!   server's token within `tie_margin` nats of its top-1 (a near-tie).
//! - `prompt N / greedy continuation`: the server's greedy tokens equal the golden's up to the
//!   first difference, which passes only as a near-tie.
//! - `prompt N / entropy`: the entropy verdict from the server's top-k (`healthy`).
//! - `agreement`: the calibrated verdict of [`crate::kld_verdict`] over every compared position,
//!   the rule and thresholds `entropy --server --against-reference` uses (golden/kld-calibration.json):
//!   *within numeric noise* passes, *broken* fails, *precision loss* fails unless
//!   `--precision-loss-exit 0`; its named cause and evidence are in the case and the message. The
//!   golden file's `kld_mean` and `min_top1_pct` are no longer the decision (same top-1 is reported).

use super::shared::case_of;
use crate::cli::GateArgs;
use crate::entropy::{default_thresholds, kld_stats, KldPosition};
use crate::golden::{bless_hint, Check, Golden, PositionGolden};
use crate::kld_verdict::{judge, Band, PosKld, Profile};
use crate::server::{complete_all, PromptBody};
use crate::server_view::{prompt_entropy, topk_signals, Alignment, TokenSpace};
use crate::topk::{overlap, topk_kld};
use anyhow::bail;
use reports::{GateServerFigures, GateSuite, ServerSource, TokenDisagreement, TopkOverlap};
use std::path::Path;
use std::time::Instant;

/// What one server position is compared with.
struct Compared {
    kld: f64,
    same_top1: bool,
    /// The golden's logprob gap between its top-1 and the server's top-1 (0 when they agree).
    gap: f64,
    golden_top1: u32,
    /// The server's own text of its top-1.
    server_top1_text: String,
    overlap_at_k: f64,
    jaccard: f64,
}

/// The golden's logprob of `id`: listed, or (outside its top-k) the last listed one, an upper bound.
fn golden_logprob(g: &PositionGolden, id: u32) -> f64 {
    g.top
        .iter()
        .find(|t| t.0 == id)
        .or(g.top.last())
        .map_or(f64::NEG_INFINITY, |t| t.1)
}

fn compare(server: &[(u32, f64)], server_top1_text: &str, g: &PositionGolden) -> Option<Compared> {
    let (set, lps): (Vec<u32>, Vec<f64>) = server.iter().copied().unzip();
    let (&server_top1, &golden_top1) = (set.first()?, &g.top.first()?.0);
    let golden_top: Vec<u32> = g.top.iter().take(set.len()).map(|t| t.0).collect();
    let (overlap_at_k, jaccard) = overlap(&set, &golden_top, set.len());
    Some(Compared {
        kld: topk_kld(&set, &lps, |id| golden_logprob(g, id)),
        same_top1: server_top1 == golden_top1,
        gap: g.top[0].1 - golden_logprob(g, server_top1),
        golden_top1,
        server_top1_text: server_top1_text.to_string(),
        overlap_at_k,
        jaccard,
    })
}

/// Checks a golden file can be gated against a server: format 2, with token texts.
pub fn check_servable(path: &Path, g: &Golden) -> anyhow::Result<()> {
    if g.format < 2 || g.token_text.is_empty() || g.vocab == 0 {
        bail!(
            "{}: golden format {} has no token texts, vocabulary size or continuation, which gate --server needs; re-bless it: {}",
            path.display(),
            g.format,
            bless_hint(path)
        );
    }
    Ok(())
}

/// Gates one golden file against the server.
pub fn gate_one(
    path: &Path,
    g: &Golden,
    a: &GateArgs,
    deadline: Option<std::time::Instant>,
) -> anyhow::Result<GateSuite> {
    let t0 = Instant::now();
    let mut th = g.thresholds.server.clone();
    if let Some(x) = a.kld_threshold {
        th.kld_position = x;
    }
    if let Some(x) = a.min_top1 {
        th.min_top1_pct = x;
    }
    let k = a.live.top_logprobs;
    let calibration = a.verdict.calibration()?;
    let opts = a.live.options(g.n_continuation.max(1), deadline);
    let bodies: Vec<PromptBody> = g
        .prompts
        .iter()
        .map(|p| match (&p.text, a.send_tokens) {
            (Some(t), false) => PromptBody::Text(t.clone()),
            _ => PromptBody::Tokens(p.tokens.clone()),
        })
        .collect();
    eprintln!(
        "{}: {} prompts to {} ({} at a time, top-{}, {} greedy tokens)",
        path.display(),
        bodies.len(),
        opts.url,
        opts.concurrency,
        k,
        g.n_continuation
    );
    let t_req = Instant::now();
    let completions = complete_all(&opts, &bodies)?;
    let request_seconds = t_req.elapsed().as_secs_f64();
    let n_prompts: Vec<usize> = g.prompts.iter().map(|p| p.tokens.len()).collect();
    for (i, (c, &n)) in completions.iter().zip(&n_prompts).enumerate() {
        if c.entries.len() < n {
            bail!(
                "prompt {}: the server echoed {} logprob entries for a {n}-token prompt (does it honour echo with token-id prompts?)",
                i + 1,
                c.entries.len()
            );
        }
    }
    let (align, _, _) = Alignment::detect(&completions, &n_prompts);
    // A continuation cut short for length checks fewer greedy tokens than the golden's: said.
    let warnings: Vec<String> = completions
        .iter()
        .zip(&n_prompts)
        .enumerate()
        .filter_map(|(i, (c, &n))| {
            c.truncation_warning(n, g.n_continuation)
                .map(|w| format!("warning: prompt {}: {w}", i + 1))
        })
        .collect();
    for w in &warnings {
        eprintln!("{w}");
    }
    let mut space = TokenSpace::from_texts(g.token_text.iter().map(|(&id, s)| (id, s.clone())), g.vocab);
    let text = |id: u32| g.token_text.get(&id).cloned().unwrap_or_else(|| format!("#{id}"));
    // A control token rendered as empty text (llama-cpp-python) equals any control token.
    let empty = space.id("");
    let same = |server: u32, golden: u32| server == golden || (server == empty && g.control_tokens.contains(&golden));
    let entropy_thresholds = default_thresholds();

    let mut cases = Vec::new();
    let mut all: Vec<KldPosition> = Vec::new();
    let (mut ov_sum, mut jac_sum, mut ov_n) = (0.0, 0.0, 0usize);
    let mut first_dis: Option<TokenDisagreement> = None;
    // The golden was blessed from the original model: a metadata fault of the deployment shows.
    let mut profile = Profile::default();
    let mut pos_kld: Vec<PosKld> = Vec::new();
    let (mut greedy_compared, mut greedy_equal) = (0, 0);
    for (pi, (p, c)) in g.prompts.iter().zip(&completions).enumerate() {
        let n = p.tokens.len();
        let ids: Vec<u32> = c.entries.iter().map(|e| space.id(&e.token)).collect();
        // The echo must be our prompt: a server that adds BOS or re-tokenizes is not comparable.
        if let Some(i) = (0..n).find(|&i| g.token_text.contains_key(&p.tokens[i]) && !same(ids[i], p.tokens[i])) {
            bail!(
                "prompt {}: the server echoed {:?} at position {i} where the golden prompt has {:?} (a different tokenizer, or a BOS added?{})",
                pi + 1,
                c.entries[i].token,
                text(p.tokens[i]),
                if a.send_tokens { "" } else { " --send-tokens sends the exact ids" }
            );
        }
        let server_cont = &ids[n..];
        profile
            .prompt_token_shift
            .push(c.prompt_tokens.map(|t| t as i64 - n as i64));
        let first_pos = pos_kld.len();
        // Greedy steps that still follow the golden continuation.
        let n_same = server_cont
            .iter()
            .zip(&p.continuation)
            .take_while(|(&s, &g)| same(s, g))
            .count();

        let mut pos_checks = Vec::new();
        for (i, e) in c.entries.iter().enumerate() {
            let Some(top) = &e.top else { continue };
            let seen = align.context(i);
            let (item, golden) = match seen {
                0 => continue,
                s if s <= n => (format!("pos {}", s - 1), &p.positions[s - 1]),
                s if s - n <= n_same && s - n < p.continuation_positions.len() => {
                    (format!("step {}", s - n), &p.continuation_positions[s - n])
                }
                _ => continue,
            };
            let mut server: Vec<(u32, f64)> = Vec::with_capacity(k);
            for (s, lp) in top.iter().take(k) {
                // "" stands for the golden's likeliest control token here.
                let control = g.control_tokens.iter().copied();
                let id = match control.max_by(|&a, &b| golden_logprob(golden, a).total_cmp(&golden_logprob(golden, b)))
                {
                    Some(c) if s.is_empty() => c,
                    // An ambiguous key (see server_view::AMBIGUOUS_LISTED) is left out.
                    _ if space.model_id(s).is_some() && space.listed_id(s).is_none() => continue,
                    _ => space.id(s),
                };
                if !server.iter().any(|x| x.0 == id) {
                    server.push((id, *lp));
                }
            }
            let Some(cmp) = compare(&server, &top[0].0, golden) else {
                continue;
            };
            pos_kld.push(PosKld {
                prompt: pi,
                pos: seen - 1,
                len: 0,
                kld: cmp.kld,
                same_top1: cmp.same_top1,
            });
            all.push(KldPosition {
                kld: cmp.kld,
                same_top1: cmp.same_top1,
                dp: None,
            });
            ov_sum += cmp.overlap_at_k;
            jac_sum += cmp.jaccard;
            ov_n += 1;
            if !cmp.same_top1 && first_dis.is_none() {
                first_dis = Some(TokenDisagreement {
                    prompt: pi + 1,
                    position: seen - 1,
                    server_token: cmp.server_top1_text.clone(),
                    reference_token: text(cmp.golden_top1),
                });
            }
            let mut ratio = crate::golden::ratio(cmp.kld, th.kld_position);
            let mut detail = format!("top-k KLD {:.4} (≤ {})", cmp.kld, th.kld_position);
            if !cmp.same_top1 {
                let tie = cmp.gap < th.tie_margin;
                detail = format!(
                    "top-1 {:?}, golden {:?} ({} gap {:.3} nats in the golden, tie margin {}); {detail}",
                    cmp.server_top1_text,
                    text(cmp.golden_top1),
                    if tie { "a near-tie:" } else { "not a near-tie:" },
                    cmp.gap,
                    th.tie_margin
                );
                if !tie {
                    ratio = f64::INFINITY;
                }
            }
            pos_checks.push(Check { item, ratio, detail });
        }
        let len = pos_kld[first_pos..].iter().map(|p| p.pos + 1).max().unwrap_or(0);
        for p in &mut pos_kld[first_pos..] {
            p.len = len;
        }
        if pos_checks.is_empty() {
            bail!(
                "prompt {}: the server gave no prompt logprobs (does it honour echo?)",
                pi + 1
            );
        }
        cases.push(case_of(
            format!("prompt {} / server positions", pi + 1),
            pos_checks,
            false,
        ));

        // The greedy continuation.
        let compared = server_cont.len().min(p.continuation.len());
        greedy_compared += compared.min(n_same + 1);
        greedy_equal += n_same;
        let greedy = if n_same < compared {
            let (s, want) = (server_cont[n_same], p.continuation[n_same]);
            let gap = p
                .continuation_positions
                .get(n_same)
                .map_or(f64::INFINITY, |g| g.top[0].1 - golden_logprob(g, s));
            Check {
                item: format!("step {n_same}"),
                ratio: crate::golden::ratio(gap, th.tie_margin),
                detail: format!(
                    "greedy token {n_same} is {:?}, golden {:?} (gap {gap:.3} nats in the golden; a near-tie within {} passes); server continuation {:?}",
                    c.entries[n + n_same].token,
                    text(want),
                    th.tie_margin,
                    c.entries[n..].iter().map(|e| e.token.as_str()).collect::<String>()
                ),
            }
        } else {
            Check {
                item: "continuation".into(),
                ratio: 0.0,
                detail: format!("{compared} greedy tokens equal the golden's"),
            }
        };
        cases.push(case_of(
            format!("prompt {} / greedy continuation", pi + 1),
            vec![greedy],
            false,
        ));

        // The entropy verdict from the server's top-k, as `entropy --server` gives it.
        let signals = topk_signals(c, n, align, k, g.vocab, &mut space);
        let pe = prompt_entropy(
            &p.label,
            n,
            &signals,
            server_cont.to_vec(),
            None,
            g.vocab,
            &entropy_thresholds,
        );
        let healthy = pe.verdict == "healthy";
        profile.entropy_verdicts.push(pe.verdict.clone());
        cases.push(case_of(
            format!("prompt {} / entropy", pi + 1),
            vec![Check {
                item: "verdict".into(),
                ratio: if healthy { 0.0 } else { f64::INFINITY },
                detail: format!(
                    "{} (H_lo {:.3}, H/lnV {:.3}, top-1 logprob {:.2}, top-5 recurrence {:.2}, repetition {:.2}){}",
                    pe.verdict,
                    pe.mean_entropy,
                    pe.norm_entropy,
                    pe.mean_top1_logprob,
                    pe.top5_recurrence,
                    pe.repetition,
                    if healthy {
                        String::new()
                    } else {
                        format!(": {}", pe.reasons.join("; "))
                    }
                ),
            }],
            false,
        ));
    }

    if all.is_empty() {
        // A pass needs at least one compared value.
        bail!(
            "{}: no server position could be compared with the golden file",
            path.display()
        );
    }
    let kld = kld_stats(&all, th.kld_position);
    let verdict = judge(&pos_kld, &profile, &calibration);
    let t = &verdict.thresholds;
    let ratio = match verdict.band {
        Band::WithinNoise => (verdict.mean_x_floor / t.noise_mean).max(verdict.p99_x_floor / t.noise_p99),
        Band::PrecisionLoss if a.verdict.precision_loss_exit == 0 => 1.0,
        _ => f64::INFINITY,
    };
    let agreement = vec![Check {
        item: verdict.band_name.clone(),
        ratio,
        detail: format!(
            "{}; {}; same top-1 at {:.1} % of positions{}",
            verdict.headline,
            verdict.evidence.join("; "),
            kld.same_top1_pct,
            if verdict.band == Band::PrecisionLoss && a.verdict.precision_loss_exit == 0 {
                " (precision loss accepted: --precision-loss-exit 0)"
            } else {
                ""
            }
        ),
    }];
    let mut agreement = agreement;
    if a.min_top1.is_some() {
        // Asked for explicitly: the share of positions with the golden's top-1 as well.
        agreement.push(Check {
            item: "same top-1".into(),
            ratio: crate::golden::ratio(100.0 - kld.same_top1_pct, 100.0 - th.min_top1_pct),
            detail: format!(
                "same top-1 at {:.1} % of positions (≥ {} %)",
                kld.same_top1_pct, th.min_top1_pct
            ),
        });
    }
    cases.push(case_of("agreement".into(), agreement, false));

    let failed: Vec<&reports::GateCase> = cases.iter().filter(|c| !c.passed).collect();
    let figures = format!(
        "top-k KLD mean {:.4} (max {:.4}) over {} positions, same top-1 {:.1} %, greedy {greedy_equal}/{greedy_compared} equal",
        kld.mean, kld.max, kld.n_positions, kld.same_top1_pct
    );
    let figures = format!("{}; {figures}", verdict.headline);
    let message = match failed.first() {
        Some(c) => {
            let f = &c.failures[0];
            format!(
                "{} of {} cases failed; first: {} {}: {}; {figures}",
                failed.len(),
                cases.len(),
                c.name,
                f.item,
                f.detail
            )
        }
        None => figures,
    };
    let message = std::iter::once(message).chain(warnings).collect::<Vec<_>>().join("; ");
    Ok(GateSuite {
        golden: path.display().to_string(),
        verdict: if failed.is_empty() { "pass" } else { "fail" }.to_string(),
        backend: format!("server {}", opts.url),
        tp: 1,
        message: Some(message),
        cases,
        seconds: t0.elapsed().as_secs_f64(),
        server: Some(GateServerFigures {
            source: ServerSource {
                url: opts.url.clone(),
                served_model: opts.model.clone(),
                top_k: k,
                alignment: align.name().to_string(),
                kld_support: "server_topk, golden top-20 with its 20th logprob as the bound".to_string(),
            },
            kld,
            overlap: TopkOverlap {
                k,
                overlap_at_k: ov_sum / ov_n.max(1) as f64,
                jaccard: jac_sum / ov_n.max(1) as f64,
                first_top1_disagreement: first_dis,
            },
            n_greedy_compared: greedy_compared,
            n_greedy_equal: greedy_equal,
            request_seconds,
        }),
    })
}
