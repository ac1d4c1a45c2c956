//! Format 2 dumps under tensor parallelism (docs/tp-dumps.md): each ranked tensor's declared
//! layout ([`TpLayout`]), each rank's effective model config, and the checks a layout makes
//! possible beyond the tap-by-tap comparison:
//!
//! - **config** ([`config_check`]), before any tensor: every rank's config against the
//!   reference's (GGUF metadata) and against each other; a difference is `config-drift` naming
//!   the key and the ranks;
//! - **replicas**: every rank's copy of a replicated or gathered tap against the lowest rank's
//!   (which stands as the unranked tap the comparator sees);
//! - **partials**: a rank's pre-reduce partial (`KEY@rN#partial`, input columns A:B) against the
//!   reference's per-rank partial, the reference op replayed on the candidate's own input shard
//!   with every other input column zero (so the reference weight's same shard only). A partial
//!   that misses its own shard is tried against every other rank's shard of the weight: a match
//!   is a `head-permutation` naming the ranks and heads (a swapped or duplicated weight shard,
//!   found from activations alone).
//!
//! - **vocab-parallel embedding** (`embed@rN#partial`, `partial(A:B)` over the vocabulary): the
//!   reference's rows of the rank's tokens in A:B, zeros elsewhere; a shifted slice is named;
//! - **expert parallelism** (`ffn_out@rN#partial`, `experts(ids)`): the sum over the declared
//!   experts of each routed token's weight × the expert's output, routed by the rank's own
//!   `moe_logits`; an expert computed with another's weights, or an undeclared expert computed,
//!   is `expert-misplaced`.
//!
//! Classes these checks add to `diagnose`'s: `rank-disagreement` (a replicated tap's copies
//! differ across ranks), `wrong-partial` (a partial no weight shard explains), `expert-misplaced`
//! and, from
//! [`crate::fingerprint`], `weight-mismatch`; a shard found on the wrong rank, or a weight loaded
//! whole, is `head-permutation`, as in the engine's own diagnosis.
//!
//! The counts of what was compared go into the run document (`tp_layout`), so "none skipped" is
//! checkable: every tensor of the files is a compared tap, a replica checked against rank 0's, or
//! a partial, or the dump was refused.

use crate::capture::{progress, Captured};
use crate::compare::{metrics, ActDtype, Tolerances};
use crate::dump::Dump;
use crate::tp_meta::{full_width, partial_inputs};
use anyhow::{bail, Context};
use references::config::ModelConfig;
use references::forward::Reference;
use references::tap::{Site, TapKey};
use reports::{Diagnosis, DiffRun, Location, TapRow, TpLayoutReport};
use std::collections::BTreeMap;
use std::ops::Range;

/// The result of comparing the ranks' configs (before any tensor).
#[derive(Clone, Debug, Default)]
pub struct ConfigCheck {
    /// Values compared (each rank's key with the reference's, and across ranks).
    pub keys: usize,
    /// One line per drifting key, naming the ranks.
    pub drift: Vec<String>,
}

/// The reference's value of an adapter config key, and where it comes from (tolerance relative).
fn reference_value(c: &ModelConfig, key: &str) -> Option<(f64, f64)> {
    let exact = 0.0;
    Some(match key {
        "rope_theta" => (c.rope_base as f64, 1e-6),
        // Recovered from the inverse frequencies in f32: a few ulps.
        "rope_theta_effective" => (c.rope_base as f64, 1e-4),
        "rms_norm_eps" => (c.rms_eps as f64, 1e-6),
        "num_attention_heads" => (c.n_heads as f64, exact),
        "num_key_value_heads" if c.mla.is_none() => (c.n_kv_heads as f64, exact),
        "head_dim" if c.mla.is_none() => (c.head_dim as f64, exact),
        "hidden_size" => (c.d_model as f64, exact),
        "intermediate_size" if c.moe.is_none() => (c.ffn_dim as f64, exact),
        "vocab_size" => (c.vocab as f64, exact),
        "num_hidden_layers" => (c.n_layers as f64, exact),
        _ => return None,
    })
}

fn ranks_list(r: &[usize]) -> String {
    let s: Vec<String> = r.iter().map(|x| x.to_string()).collect();
    format!("rank{} {}", if r.len() > 1 { "s" } else { "" }, s.join(","))
}

/// Every rank's config against the reference's and against each other's.
pub fn config_check(dump: &Dump, c: &ModelConfig) -> ConfigCheck {
    let mut out = ConfigCheck::default();
    let keys: std::collections::BTreeSet<&String> = dump.ranks.values().flat_map(|r| r.config.keys()).collect();
    for key in keys {
        // Across ranks: group the ranks by the value they hold (absent is a value too).
        let mut groups: BTreeMap<String, Vec<usize>> = BTreeMap::new();
        for (&r, m) in &dump.ranks {
            let v = m.config.get(key).map_or("(absent)".to_string(), |v| v.to_string());
            groups.entry(v).or_default().push(r);
            out.keys += 1;
        }
        if groups.len() > 1 {
            let parts: Vec<String> = groups.iter().map(|(v, rs)| format!("{} {v}", ranks_list(rs))).collect();
            out.drift
                .push(format!("{key} differs across ranks: {}", parts.join("; ")));
        }
        // The RoPE type: the reference's scaling as the file states it.
        if key == "rope_type" {
            let want = if c.rope_scaling.freq_factors {
                "llama3"
            } else if c.rope_scaling.linear_factor.is_some() {
                "linear"
            } else if c.yarn.is_some() {
                "yarn"
            } else {
                "default"
            };
            let bad: Vec<usize> = dump
                .ranks
                .iter()
                .filter(|(_, m)| m.config.get(key).and_then(|v| v.as_str()).is_some_and(|v| v != want))
                .map(|(&r, _)| r)
                .collect();
            out.keys += dump.ranks.len();
            if let Some(&r) = bad.first() {
                out.drift.push(format!(
                    "rope_type: {} {} where the reference's is {want} (GGUF{})",
                    ranks_list(&bad),
                    dump.ranks[&r].config[key],
                    if c.rope_scaling.freq_factors {
                        " rope_freqs.weight"
                    } else {
                        " metadata"
                    }
                ));
            }
        }
        // Against the reference (the GGUF metadata the reference reads).
        if let Some((want, tol)) = reference_value(c, key) {
            let mut bad: BTreeMap<String, Vec<usize>> = BTreeMap::new();
            for (&r, m) in &dump.ranks {
                out.keys += 1;
                let Some(v) = m.config.get(key).and_then(|v| v.as_f64()) else {
                    continue;
                };
                if (v - want).abs() > tol * want.abs() {
                    bad.entry(v.to_string()).or_default().push(r);
                }
            }
            for (v, ranks) in bad {
                out.drift.push(format!(
                    "{key}: {} {v} where the reference's (GGUF metadata) is {want}",
                    ranks_list(&ranks)
                ));
            }
        }
    }
    out
}

/// A partial re-computed by the reference from a given input shard placed at given columns.
fn reference_partial(
    reference: &Reference,
    dump: &Dump,
    c: &ModelConfig,
    key: &TapKey,
    input_rank: u32,
    at: &Range<usize>,
    n: usize,
) -> anyhow::Result<Option<Vec<f32>>> {
    let mut inputs: BTreeMap<TapKey, Vec<f32>> = BTreeMap::new();
    for &site in partial_inputs(key.site) {
        let k = TapKey {
            site,
            rank: Some(input_rank),
            ..*key
        };
        let Some(full_w) = full_width(c, site).filter(|_| dump.keys().any(|x| *x == k)) else {
            return Ok(None);
        };
        let t: Captured = dump.tensor(&k, c)?;
        if t.shape[1] != at.len() || at.end > full_w {
            return Ok(None);
        }
        let mut full = vec![0f32; n * full_w];
        for row in 0..n {
            full[row * full_w + at.start..row * full_w + at.end]
                .copy_from_slice(&t.data[row * at.len()..(row + 1) * at.len()]);
        }
        inputs.insert(k.unranked(), full);
    }
    let get = |k: &TapKey| inputs.get(k).cloned();
    Ok(reference.replay(&key.unranked(), &get, n)?)
}

/// Names the heads (or columns) of an input range.
fn describe(c: &ModelConfig, site: Site, r: &Range<usize>) -> String {
    let hd = match (&c.mla, site) {
        (None, Site::AttnProj) => c.head_dim,
        (Some(m), Site::AttnProj) => m.v_head_dim,
        _ => 0,
    };
    if hd > 0 && r.start.is_multiple_of(hd) && r.end.is_multiple_of(hd) {
        format!("heads {}-{}", r.start / hd, r.end / hd - 1)
    } else {
        format!("columns {}:{}", r.start, r.end)
    }
}

fn weight_name(site: Site) -> &'static str {
    match site {
        Site::AttnProj => "o_proj",
        _ => "down_proj",
    }
}

fn row(key: &TapKey, shape: [usize; 2], m: reports::Metrics, threshold: f64, over: bool) -> TapRow {
    TapRow {
        tap: key.to_string(),
        layer: key.layer,
        site: key.site.name(),
        rank: key.rank,
        shape,
        metrics: m,
        threshold,
        over,
        over_end_to_end: over,
        local: None,
        selection: None,
    }
}

/// The order of a key for "which came first": layer progress, then the unranked key's order,
/// ranked (rank-local) before reduced.
fn order(key: &TapKey) -> (u64, TapKey, bool) {
    (progress(key), key.unranked(), key.rank.is_none())
}

/// Where the per-rank partial checks put what they find.
struct Checks<'a> {
    run: &'a mut DiffRun,
    compared: &'a mut BTreeMap<String, usize>,
    findings: &'a mut Vec<Finding>,
    lines: &'a mut Vec<String>,
}

impl Checks<'_> {
    /// Compares a partial with the reference's: its row in `taps`; `true` when over.
    fn compare(&mut self, key: &TapKey, got: &Captured, want: &[f32], thr: f64) -> anyhow::Result<bool> {
        if want.len() != got.data.len() {
            bail!(
                "{key}#partial is {:?} where the reference's partial is {} values",
                got.shape,
                want.len()
            );
        }
        *self.compared.entry("partial".to_string()).or_default() += 1;
        let m = metrics(&got.data, want);
        let over = m.rel_l2.is_nan() || m.rel_l2 > thr || m.nonfinite > 0;
        self.run.taps.push(row(key, got.shape, m, thr, over));
        Ok(over)
    }

    fn find(&mut self, key: TapKey, class: &'static str, confidence: &'static str, explanation: String) {
        self.lines.push(format!("{class}: {explanation}"));
        self.findings.push(Finding {
            key,
            class,
            confidence,
            explanation,
        });
    }
}

/// The shifts of a vocabulary slice tried when a rank's embedding partial misses its own:
/// every other rank's slice, then up to this many rows either way.
const EMBED_SHIFTS: i64 = 64;

/// Vocab-parallel embedding partials (`embed@rN#partial`, `partial(A:B)` over the vocabulary):
/// rank N looks up only the tokens of its slice A:B, zeros elsewhere. Compared with the
/// reference's rows for the same tokens; a miss is tried against shifted slices (another rank's,
/// or off by a few rows): a match is a `head-permutation` naming the rows the rank really holds.
fn embed_partials(
    ch: &mut Checks,
    dump: &Dump,
    reference: &Reference,
    tolerances: &Tolerances,
    dtype: ActDtype,
) -> anyhow::Result<()> {
    let c = &reference.config;
    let d = c.d_model;
    let embeds: Vec<(TapKey, Range<usize>)> = dump
        .partial_ranges
        .iter()
        .filter(|(k, _)| k.site == Site::Embed)
        .map(|(k, r)| (*k, r.clone()))
        .collect();
    if embeds.is_empty() {
        return Ok(());
    }
    let toks = &dump.tokens;
    // The rows of the tokens of `range` as a table holding vocabulary rows shifted by `s` gives them.
    let partial = |range: &Range<usize>, s: i64| -> anyhow::Result<Vec<f32>> {
        let ids: Vec<u32> = toks
            .iter()
            .map(|&t| (t as i64 + s).clamp(0, c.vocab as i64 - 1) as u32)
            .collect();
        let mut x = reference.embedding(&ids)?;
        for (i, &t) in toks.iter().enumerate() {
            let v = t as i64 + s;
            if !range.contains(&(t as usize)) || v < 0 || v >= c.vocab as i64 {
                x[i * d..(i + 1) * d].iter_mut().for_each(|v| *v = 0.0);
            }
        }
        Ok(x)
    };
    for (key, range) in &embeds {
        let rank = key.rank.expect("partials are ranked");
        let got = dump.tensor(key, c)?;
        let thr = tolerances.threshold(key, dtype);
        let want = partial(range, 0)?;
        if !ch.compare(key, &got, &want, thr)? {
            continue;
        }
        let n_in = toks.iter().filter(|&&t| range.contains(&(t as usize))).count();
        let mut shifts: Vec<(i64, Option<u32>)> = embeds
            .iter()
            .filter(|(k, r)| k != key && r.len() == range.len())
            .map(|(k, r)| (r.start as i64 - range.start as i64, k.rank))
            .collect();
        shifts.extend((-EMBED_SHIFTS..=EMBED_SHIFTS).filter(|&s| s != 0).map(|s| (s, None)));
        let mut explained = None;
        for (s, other) in shifts {
            let p = partial(range, s)?;
            if metrics(&got.data, &p).rel_l2 <= thr {
                let held = format!("{}:{}", range.start as i64 + s, range.end as i64 + s);
                explained = Some(match other {
                    Some(o) => format!(
                        "{key} (rank {rank}'s vocab-parallel embedding partial) looks its tokens up in vocabulary rows {held} (rank {o}'s slice), not its declared {}:{}: rank {rank} holds rank {o}'s embedding shard",
                        range.start, range.end
                    ),
                    None => format!(
                        "{key} (rank {rank}'s vocab-parallel embedding partial) looks its tokens up in vocabulary rows {held}, its declared slice {}:{} shifted by {s}: each of its tokens gets the row of token id + {s}",
                        range.start, range.end
                    ),
                });
                break;
            }
        }
        match explained {
            Some(x) => ch.find(*key, "head-permutation", "high", x),
            None => {
                let m = metrics(&got.data, &want);
                ch.find(
                    *key,
                    "wrong-partial",
                    "low",
                    format!(
                        "{key} (rank {rank}'s vocab-parallel embedding partial, vocabulary {}:{}, {n_in} of {} tokens in it) differs from the reference's rows for those tokens (zeros elsewhere), rel_l2 {:.2e}; no shifted slice explains it",
                        range.start,
                        range.end,
                        toks.len(),
                        m.rel_l2
                    ),
                )
            }
        }
    }
    Ok(())
}

/// A rank's own copy of a replicated tap (else the unranked tap), or None.
fn rank_input(dump: &Dump, c: &ModelConfig, key: TapKey, rank: usize) -> anyhow::Result<Option<Vec<f32>>> {
    if let Some((_, t)) = dump.copies(&key, c)?.into_iter().find(|(r, _)| *r == rank) {
        return Ok(Some(t.data));
    }
    if dump.keys().any(|k| *k == key) {
        return Ok(Some(dump.tensor(&key, c)?.data));
    }
    Ok(None)
}

/// Expert-parallel partials (`ffn_out@rN#partial`, `experts(ids)`): rank N's MoE output before
/// the reduce is the sum over the experts it holds of each routed token's weight times the
/// expert's output. The reference rebuilds it from the rank's own `ffn_norm` and `moe_logits`
/// (its routing) and the declared ids. A miss is tried with one expert's weights replaced by
/// any other expert's (the tokens routed to e computed with x's weights), then with one held
/// expert replaced by one the rank does not declare (tokens and weights): a match is
/// `expert-misplaced`, naming the rank and the experts. Shared experts are not part of it.
fn expert_partials(
    ch: &mut Checks,
    dump: &Dump,
    reference: &Reference,
    tolerances: &Tolerances,
    dtype: ActDtype,
) -> anyhow::Result<()> {
    let c = &reference.config;
    let (n, d) = (dump.tokens.len(), c.d_model);
    for (key, ids) in &dump.expert_ids {
        let (rank, l) = (key.rank.expect("ranked") as usize, key.layer.expect("layer") as usize);
        let h = rank_input(dump, c, TapKey::layer(l, Site::FfnNorm), rank)?;
        let z = rank_input(dump, c, TapKey::layer(l, Site::MoeLogits), rank)?;
        let (Some(h), Some(z)) = (h.filter(|h| h.len() == n * d), z) else {
            ch.lines.push(format!(
                "{key}#partial: not compared (the rank's ffn_norm and moe_logits, its routing inputs, are not in the dump)"
            ));
            *ch.compared.entry("partial-unchecked".to_string()).or_default() += 1;
            continue;
        };
        let Some(parts) = reference.expert_routes(l, &z, n)? else {
            bail!("{key}#partial: the rank's moe_logits are not [n_tokens, n_experts] router logits of a routed MoE layer");
        };
        let mut ys: BTreeMap<usize, Vec<f32>> = BTreeMap::new();
        let mut y = |x: usize| -> anyhow::Result<Vec<f32>> {
            if let std::collections::btree_map::Entry::Vacant(v) = ys.entry(x) {
                v.insert(reference.expert_ffn(l, x, &h, n)?);
            }
            Ok(ys[&x].clone())
        };
        // Expert slot e's tokens, weighted, through expert x's weights.
        let mut contrib = |e: usize, x: usize, acc: &mut [f64], sign: f64| -> anyhow::Result<()> {
            let yx = y(x)?;
            for (t, rt) in parts.routes.iter().enumerate() {
                if let Some(i) = rt.experts.iter().position(|&v| v == e) {
                    let w = sign * rt.weights[i];
                    for j in 0..d {
                        acc[t * d + j] += w * yx[t * d + j] as f64;
                    }
                }
            }
            Ok(())
        };
        let mut want = vec![0f64; n * d];
        for &e in ids {
            contrib(e as usize, e as usize, &mut want, 1.0)?;
        }
        let to32 = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
        let got = dump.tensor(key, c)?;
        let thr = tolerances.threshold(key, dtype);
        if !ch.compare(key, &got, &to32(&want), thr)? {
            continue;
        }
        let n_exp = c.moe.as_ref().map_or(0, |m| m.n_experts);
        let routed = |e: usize| parts.routes.iter().filter(|rt| rt.experts.contains(&e)).count();
        let held: Vec<String> = ids.iter().map(|e| e.to_string()).collect();
        let held = held.join(",");
        let mut explained = None;
        'search: for &e in ids {
            let e = e as usize;
            for (swap_tokens, x) in (0..n_exp)
                .filter(|&x| x != e)
                .map(|x| (false, x))
                .chain((0..n_exp).filter(|x| !ids.contains(&(*x as u32))).map(|x| (true, x)))
            {
                let mut cand = want.clone();
                contrib(e, e, &mut cand, -1.0)?;
                if swap_tokens {
                    contrib(x, x, &mut cand, 1.0)?;
                } else {
                    contrib(e, x, &mut cand, 1.0)?;
                }
                if metrics(&got.data, &to32(&cand)).rel_l2 <= thr {
                    explained = Some(if swap_tokens {
                        format!(
                            "{key} (rank {rank}'s expert-parallel partial, declared experts({held})) is the sum over experts {held} with expert {x} (its {} routed tokens and weights) in expert {e}'s place: rank {rank} computes expert {x}, which it does not declare, and not expert {e}",
                            routed(x)
                        )
                    } else {
                        format!(
                            "{key} (rank {rank}'s expert-parallel partial, declared experts({held})) computes expert {e}'s {} routed tokens with expert {x}'s weights: rank {rank} holds expert {x}'s weights in expert {e}'s slot",
                            routed(e)
                        )
                    });
                    break 'search;
                }
            }
        }
        match explained {
            Some(x) => ch.find(*key, "expert-misplaced", "high", x),
            None => {
                let m = metrics(&got.data, &to32(&want));
                ch.find(
                    *key,
                    "wrong-partial",
                    "low",
                    format!(
                        "{key} (rank {rank}'s expert-parallel partial) differs from the reference's sum over its declared experts({held}) on the rank's own routing, rel_l2 {:.2e}; no single misplaced expert explains it",
                        m.rel_l2
                    ),
                )
            }
        }
    }
    Ok(())
}

/// What the TP checks found, to be merged into the run.
struct Finding {
    key: TapKey,
    class: &'static str,
    confidence: &'static str,
    explanation: String,
}

/// Runs the replica and partial checks of a format 2 dump and merges them, and the config check,
/// into the comparator's run: rows for the partials, the counts, and the first divergence and
/// diagnosis where a rank-level finding comes first (or the run had none).
pub fn apply(
    run: &mut DiffRun,
    dump: &Dump,
    reference: &Reference,
    file: &references::GgufFile,
    tolerances: &Tolerances,
    dtype: ActDtype,
    cfg: ConfigCheck,
) -> anyhow::Result<()> {
    let c = &reference.config;
    let n = dump.tokens.len();
    let mut compared: BTreeMap<String, usize> = BTreeMap::new();
    let replicated: std::collections::BTreeSet<String> = dump.replicated_keys().map(|k| k.to_string()).collect();
    for r in &run.taps {
        let kind = if dump.declared_slices.keys().any(|k| k.to_string() == r.tap) {
            "sharded"
        } else if replicated.contains(&r.tap) {
            "replicated"
        } else {
            "unranked"
        };
        *compared.entry(kind.to_string()).or_default() += 1;
    }
    let mut findings: Vec<Finding> = Vec::new();
    let mut replica_lines = Vec::new();
    // Replicas: each rank's copy against the lowest rank's (which the comparator compared).
    let keys: Vec<TapKey> = dump.replicated_keys().copied().collect();
    for key in keys {
        let copies = dump.copies(&key, c)?;
        let Some(((r0, first), rest)) = copies.split_first() else {
            continue;
        };
        // Ranks whose copy of a reduced tap is their own pre-reduce partial.
        let mut unreduced = Vec::new();
        for (r, copy) in &copies {
            let pk = TapKey {
                rank: Some(*r as u32),
                ..key
            };
            if dump.partial_ranges.contains_key(&pk) || dump.expert_ids.contains_key(&pk) {
                let p = dump.tensor(&pk, c)?;
                if p.data.len() == copy.data.len() && metrics(&copy.data, &p.data).rel_l2 < 1e-6 {
                    unreduced.push(*r);
                }
            }
        }
        let mut differs = Vec::new();
        for (r, copy) in rest {
            *compared.entry("replica".to_string()).or_default() += 1;
            let m = metrics(&copy.data, &first.data);
            let thr = tolerances.floor(&key);
            if m.rel_l2.is_nan() || m.rel_l2 > thr || m.nonfinite > 0 {
                let line = format!(
                    "{key}: rank {r}'s copy differs from rank {r0}'s (rel_l2 {:.2e}, threshold {thr:.1e})",
                    m.rel_l2
                );
                replica_lines.push(line.clone());
                differs.push((*r, line));
            }
        }
        if !unreduced.is_empty() && (!differs.is_empty() || unreduced.len() == copies.len()) {
            let r = unreduced[0];
            findings.push(Finding {
                key: TapKey {
                    rank: Some(r as u32),
                    ..key
                },
                class: "missing-reduction",
                confidence: "high",
                explanation: format!(
                    "{key}: {}'s copy equals {} own pre-reduce partial ({key}@rN#partial): the all-reduce did not run there{}",
                    ranks_list(&unreduced),
                    if unreduced.len() > 1 { "their" } else { "its" },
                    if differs.is_empty() { String::new() } else { ", so the ranks' copies differ".to_string() }
                ),
            });
        } else if let Some((r, line)) = differs.first() {
            findings.push(Finding {
                key: TapKey {
                    rank: Some(*r as u32),
                    ..key
                },
                class: "rank-disagreement",
                confidence: "high",
                explanation: format!("{line}: a replicated tensor must be the same on every rank"),
            });
        }
    }
    // Partials: against the reference's per-rank partial from the same weight shard.
    let mut partial_lines = Vec::new();
    let partials: Vec<(TapKey, Range<usize>)> = dump
        .partial_ranges
        .iter()
        .filter(|(k, _)| k.site != Site::Embed)
        .map(|(k, r)| (*k, r.clone()))
        .collect();
    let mut checks = Checks {
        run: &mut *run,
        compared: &mut compared,
        findings: &mut findings,
        lines: &mut partial_lines,
    };
    embed_partials(&mut checks, dump, reference, tolerances, dtype)?;
    expert_partials(&mut checks, dump, reference, tolerances, dtype)?;
    for (key, range) in &partials {
        let rank = key.rank.expect("partials are ranked");
        let e = dump.tensor(key, c)?;
        let thr = tolerances.threshold(key, dtype);
        let Some(want) = reference_partial(reference, dump, c, key, rank, range, n)? else {
            partial_lines.push(format!(
                "{key}#partial: not compared (its input shard {} is not in the dump with the same range)",
                partial_inputs(key.site)
                    .iter()
                    .map(|s| s.name())
                    .collect::<Vec<_>>()
                    .join("/")
            ));
            *compared.entry("partial-unchecked".to_string()).or_default() += 1;
            continue;
        };
        *compared.entry("partial".to_string()).or_default() += 1;
        let m = if want.len() == e.data.len() {
            metrics(&e.data, &want)
        } else {
            bail!(
                "{key}#partial is {:?} where the reference's partial is {} values",
                e.shape,
                want.len()
            );
        };
        let over = m.rel_l2.is_nan() || m.rel_l2 > thr || m.nonfinite > 0;
        run.taps.push(row(key, e.shape, m.clone(), thr, over));
        if !over {
            continue;
        }
        // Which weight shard (or whose input) explains it?
        let mut explained = None;
        for (other, orange) in &partials {
            if other.layer != key.layer || other.site != key.site || other == key || orange.len() != range.len() {
                continue;
            }
            let orank = other.rank.expect("ranked");
            if let Some(p) = reference_partial(reference, dump, c, key, rank, orange, n)? {
                if metrics(&e.data, &p).rel_l2 <= thr {
                    explained = Some(format!(
                        "{key} (rank {rank}'s partial) is its own {} multiplied by {}'s {} for {} (rank {orank}'s shard), not its own {}: rank {rank} holds rank {orank}'s {} shard (rel_l2 {:.2e} against its own shard's partial)",
                        describe(c, key.site, range),
                        weight_name(key.site),
                        "columns",
                        describe(c, key.site, orange),
                        describe(c, key.site, range),
                        weight_name(key.site),
                        m.rel_l2
                    ));
                    break;
                }
            }
            if let Some(p) = reference_partial(reference, dump, c, key, orank, range, n)? {
                if metrics(&e.data, &p).rel_l2 <= thr {
                    explained = Some(format!(
                        "{key} (rank {rank}'s partial) is rank {orank}'s input ({}) multiplied by rank {rank}'s {} shard: rank {rank} reduced another rank's activations",
                        describe(c, key.site, orange),
                        weight_name(key.site)
                    ));
                    break;
                }
            }
        }
        let (class, confidence, explanation) = match explained {
            Some(x) => ("head-permutation", "high", x),
            None => (
                "wrong-partial",
                "low",
                format!(
                    "{key} (rank {rank}'s pre-reduce partial) differs from the reference's partial from the same {} shard ({}) on the rank's own input, rel_l2 {:.2e}; no other rank's shard explains it",
                    weight_name(key.site),
                    describe(c, key.site, range),
                    m.rel_l2
                ),
            ),
        };
        partial_lines.push(format!("{class}: {explanation}"));
        findings.push(Finding {
            key: *key,
            class,
            confidence,
            explanation,
        });
    }
    // Weight fingerprints against the reference's slices.
    let mut prints = Vec::new();
    for (&rank, m) in &dump.ranks {
        for (k, v) in &m.weights {
            let key: TapKey = k
                .parse()
                .map_err(|e: String| anyhow::anyhow!("weight fingerprint {k}: {e}"))?;
            if key.rank != Some(rank as u32) {
                bail!("weight fingerprint {k} in rank {rank}'s file");
            }
            let fp: crate::fingerprint::Fingerprint = serde_json::from_value(v.clone())
                .with_context(|| format!("weight fingerprint {k}: not a fingerprint (docs/tp-dumps.md)"))?;
            prints.push((rank, key, fp));
        }
    }
    let mut weight_lines = Vec::new();
    let mut hashes_equal = 0;
    for ch in crate::fingerprint::check(file, c, &prints)? {
        *compared.entry("weight".to_string()).or_default() += 1;
        hashes_equal += usize::from(ch.hash_equal);
        if let Some(f) = ch.finding {
            let class = if f.contains("rank ") || f.contains("loaded whole") {
                "head-permutation"
            } else {
                "weight-mismatch"
            };
            weight_lines.push(format!("{class}: {f}"));
            findings.push(Finding {
                key: ch.key,
                class,
                confidence: if class == "weight-mismatch" { "low" } else { "high" },
                explanation: format!("weight fingerprint: {f}"),
            });
        }
    }
    run.taps
        .sort_by_key(|r| r.tap.parse::<TapKey>().map(|k| order(&k)).ok());
    // Merge: a rank-level finding before (or at the layer of) the first divergence wins.
    findings.sort_by_key(|f| order(&f.key));
    if let Some(f) = findings.first() {
        let first = run.first_divergence.as_ref().and_then(|l| l.tap.parse::<TapKey>().ok());
        let wins = first.is_none_or(|k| progress(&f.key) <= progress(&k));
        if wins {
            run.verdict = "diverged".to_string();
            run.first_divergence = Some(Location {
                tap: f.key.to_string(),
                layer: f.key.layer,
                site: f.key.site.name(),
                rank: f.key.rank,
            });
            // The activations' own diagnosis, where there was one, stays as evidence.
            let before = match (&first, &run.diagnosis) {
                (Some(k), Some(d)) => format!(" (the activations: {} at {k}: {})", d.class, d.explanation),
                _ => String::new(),
            };
            run.diagnosis = Some(Diagnosis {
                class: f.class.to_string(),
                explanation: format!("{}{before}", f.explanation),
                confidence: f.confidence.to_string(),
            });
        }
    }
    // Config drift comes before any tensor: it names the cause of whatever diverged.
    if !cfg.drift.is_empty() {
        run.verdict = "diverged".to_string();
        let at = run
            .first_divergence
            .as_ref()
            .map_or("no tap diverged".to_string(), |l| format!("first visible at {}", l.tap));
        run.diagnosis = Some(Diagnosis {
            class: "config-drift".to_string(),
            explanation: format!(
                "the ranks' effective model configs differ ({}); {at}",
                cfg.drift.join("; ")
            ),
            confidence: "high".to_string(),
        });
    }
    let mut layouts: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for m in dump.ranks.values() {
        for (class, l) in &m.layout {
            layouts.entry(class.clone()).or_default().push(l.to_string());
        }
    }
    let plans: std::collections::BTreeSet<&str> = dump.ranks.values().map(|m| m.tp_plan.as_str()).collect();
    run.tp_layout = Some(TpLayoutReport {
        tp: dump.tp,
        tensors: dump.n_tensors,
        layouts,
        compared,
        config_keys: cfg.keys,
        config_drift: cfg.drift,
        replica_disagreements: replica_lines,
        partial_findings: partial_lines,
        weight_findings: weight_lines,
        weight_hashes_equal: hashes_equal,
        tp_plan: plans.into_iter().map(str::to_string).collect(),
    });
    Ok(())
}
