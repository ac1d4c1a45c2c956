//! Classification of the first divergence into a fault class, each with a sentence of evidence
//! an engineer can act on. The classes: `config-drift` (the engine's model config differs from
//! the reference's), `unwritten-output` (the tap still holds the canary its buffer was filled
//! with), `nonfinite` (NaN/Inf), `missing-reduction` (a rank's partial sum where the all-reduced
//! value belongs), `stale-output` (a buffer from an earlier op or step), `routing-flip` (MoE
//! experts chosen differently), `kv-cache` (a decode step's KV cache slot holds the wrong entry), `head-permutation` (heads in the wrong order), `transposed-weight`,
//! `scale-mismatch` (a constant factor off), `rope` (positions rotated wrongly), `precision`
//! (small relative error, cosine near 1), `dequantization` (a weight decoded wrongly: a wrong
//! dequantizer, a quantized weight's integers without their scales, a 16-bit float read as the
//! other one), `wrong-layer` (a weight loaded from another layer's tensors), `selection-mismatch`
//! (a DSA indexer's keys the scores rule out) and `unknown`. A decode step's DSA indexer scoring
//! its own key from a stale key-cache slot is `kv-cache` too. Checks run from the most specific evidence to the least;
//! the first that holds decides, and `unknown` is said rather than a confident guess.

use crate::compare::ActDtype;
use crate::compare::{cosine, metrics};
use crate::slice::{engine_full, reference_slice, Store};
use references::config::ModelConfig;
use references::forward::Reference;
use references::tap::{rank_columns, Site, TapKey, WeightKind};
use reports::{Diagnosis, HeadProfile, TapRow};

/// What the diagnosis can look at: both configs and the taps of the divergent layer and the one
/// before it.
pub struct DiagContext<'a> {
    pub config: &'a ModelConfig,
    pub engine_config: &'a ModelConfig,
    pub tp: usize,
    pub eng: &'a Store,
    pub refs: &'a Store,
    pub rows: &'a [TapRow],
    pub n_tokens: usize,
    /// Rows `0..n_prefill` ran as one prefill; the rows after it each ran as a decode step over
    /// the KV cache (`n_prefill == n_tokens` when nothing was decoded).
    pub n_prefill: usize,
    /// The per-head local errors at the divergent tap (llama attention taps).
    pub head_profile: Option<&'a HeadProfile>,
    /// The candidate's compute dtype.
    pub dtype: ActDtype,
    /// The reference, for the weights of other layers (a weight loaded from the wrong layer);
    /// `None` where there is none to ask.
    pub reference: Option<&'a Reference<'a>>,
}

impl DiagContext<'_> {
    /// The threshold a tap was held to (from its row), or the f32 default.
    pub fn threshold_hint(&self, key: &TapKey) -> f64 {
        let s = key.to_string();
        self.rows
            .iter()
            .find(|r| r.tap == s)
            .map_or(1e-3, |r| r.local.as_ref().map_or(r.threshold, |l| l.bound))
    }
}

fn found(class: &str, confidence: &str, explanation: String) -> Diagnosis {
    Diagnosis {
        class: class.to_string(),
        explanation,
        confidence: confidence.to_string(),
    }
}

fn ranges(ids: &[usize]) -> String {
    match (ids.first(), ids.last()) {
        (Some(a), Some(b)) if b >= a && b - a + 1 == ids.len() && ids.len() > 1 => format!("{a}..{b}"),
        _ => format!("{ids:?}"),
    }
}

/// Differences between the two configs, as `field: reference → engine`.
fn config_drift(a: &ModelConfig, b: &ModelConfig) -> Vec<String> {
    let mut out = Vec::new();
    let mut check = |name: &str, x: String, y: String| {
        if x != y {
            out.push(format!("{name}: {x} in the file, {y} in the engine"));
        }
    };
    check("rms_eps", format!("{}", a.rms_eps), format!("{}", b.rms_eps));
    check("rope_base", format!("{}", a.rope_base), format!("{}", b.rope_base));
    check("rope_dim", format!("{}", a.rope_dim), format!("{}", b.rope_dim));
    check("n_heads", format!("{}", a.n_heads), format!("{}", b.n_heads));
    check("n_kv_heads", format!("{}", a.n_kv_heads), format!("{}", b.n_kv_heads));
    let scale = |c: &ModelConfig| c.moe.as_ref().map(|m| m.weights_scale);
    check(
        "expert_weights_scale",
        format!("{:?}", scale(a)),
        format!("{:?}", scale(b)),
    );
    let rest = |c: &ModelConfig| {
        c.moe
            .as_ref()
            .map(|m| (m.n_experts, m.n_used, m.n_shared, m.gating, m.n_groups, m.n_groups_used))
    };
    check("moe routing", format!("{:?}", rest(a)), format!("{:?}", rest(b)));
    check("mla", format!("{:?}", a.mla), format!("{:?}", b.mla));
    let top_k = |c: &ModelConfig| c.indexer.as_ref().map_or("none".to_string(), |ix| ix.top_k.to_string());
    check("indexer top_k", top_k(a), top_k(b));
    let layout = |c: &ModelConfig| {
        c.indexer.as_ref().map_or("none", |ix| {
            if ix.rope_neox {
                "NEOX halves"
            } else {
                "interleaved pairs"
            }
        })
    };
    check("indexer rope layout", layout(a).into(), layout(b).into());
    check("yarn", format!("{:?}", a.yarn), format!("{:?}", b.yarn));
    out
}

pub fn diagnose(ctx: &DiagContext, key: &TapKey, row: &TapRow) -> Diagnosis {
    let m = &row.metrics;
    let drift = config_drift(ctx.config, ctx.engine_config);
    if !drift.is_empty() {
        return found(
            "config-drift",
            "high",
            format!(
                "the engine and the reference read different hyper-parameters ({}); first visible at {key}",
                drift.join("; ")
            ),
        );
    }
    if m.canary_left > 0.0 {
        return found(
            "unwritten-output",
            "high",
            format!(
                "canary left {:.0} % in {key}: the custom op never wrote {} of its output buffer",
                m.canary_left * 100.0,
                if m.canary_left >= 0.999 { "any" } else { "part" }
            ),
        );
    }
    if let Some(sel) = row
        .selection
        .as_ref()
        .filter(|s| !s.agrees && key.site == Site::IndexerTopk)
    {
        return found(
            "selection-mismatch",
            "high",
            format!(
                "the indexer at {key} selects keys the reference's scores rule out ({} broken constraints over {} queries with a choice; overlap {:.0} %, {} near-ties allowed at {:.1} noises of {:.3} relative){}: the scores or the top-k over them are wrong, not rounded",
                sel.violations,
                sel.rows_with_choice,
                100.0 * sel.overlap,
                sel.near_ties,
                sel.sigmas,
                sel.noise_rel,
                sel.first_violation.as_ref().map_or(String::new(), |v| format!("; first: {v}"))
            ),
        );
    }
    let (Some(e), Some(r)) = (ctx.eng.get(key), ctx.refs.get(&key.unranked())) else {
        return found(
            "unknown",
            "low",
            format!("{key} diverged (rel_l2 {:.3e}), but its taps were not kept", m.rel_l2),
        );
    };
    if let Site::Weight(kind) = key.site {
        return weight_diagnosis(ctx, key, kind, &e.data, e.shape);
    }
    let want = reference_slice(ctx.config, ctx.tp, key, r);
    if m.nonfinite > 0 {
        let idx = e.data.iter().position(|x| !x.is_finite()).unwrap_or(0);
        let width = e.shape[1].max(1);
        let ref_max = want.iter().fold(0f32, |a, &x| a.max(x.abs()));
        let why = if ref_max > 65504.0 {
            format!("; the reference reaches |x| = {ref_max:.3e} there, beyond f16's 65504: an f16 overflow")
        } else {
            String::new()
        };
        return found(
            "nonfinite",
            "high",
            format!(
                "first non-finite value in {key} at token {}, column {}: {}{why}",
                idx / width,
                idx % width,
                e.data[idx]
            ),
        );
    }
    if key.site == Site::IndexerScore {
        if let Some(d) = indexer_cache(ctx, key, &e.data, &want, e.shape[1], row.threshold) {
            return d;
        }
    }
    if matches!(key.site, Site::KvCacheK | Site::KvCacheV) {
        return kv_cache(ctx, key, &e.data, &want, e.shape[1], row.threshold);
    }
    if let Some(d) = missing_reduction(ctx, key, &e.data) {
        return d;
    }
    if let Some(d) = stale(ctx, key, &e.data) {
        return d;
    }
    if let Some(d) = unread_buffer(key, &e.data, &want) {
        return d;
    }
    if let Some(d) = decode_only(ctx, key, &e.data, &want, e.shape[1], row.threshold) {
        return d;
    }
    if matches!(key.site, Site::Q | Site::K | Site::KPe) {
        if let Some(d) = rope(key, &e.data, &want, e.shape[1], row.threshold) {
            return d;
        }
    }
    if key.site == Site::MoeTopk {
        let k = e.shape[1].max(1);
        let same = e.data.chunks(k).zip(want.chunks(k)).filter(|(a, b)| a == b).count();
        let n = e.data.len() / k;
        let logits = TapKey {
            site: Site::MoeLogits,
            ..*key
        };
        let logit_err = ctx
            .rows
            .iter()
            .find(|r| r.tap == logits.to_string())
            .map(|r| r.metrics.rel_l2);
        return found(
            "routing-flip",
            "high",
            format!(
                "{} of {n} tokens route to different experts at {key} ({:.0} % identical expert sets){}",
                n - same,
                100.0 * same as f64 / n as f64,
                logit_err.map_or(String::new(), |e| format!("; router logits differ by rel_l2 {e:.2e}"))
                    + &row
                        .selection
                        .as_ref()
                        .and_then(|s| s.first_violation.as_ref())
                        .map_or(String::new(), |v| { format!("; beyond a near-tie: {v}") })
            ),
        );
    }
    if let Some(d) = head_permutation(ctx, key, &e.data, &want) {
        return d;
    }
    if let Some(d) = head_scale(ctx, key) {
        return d;
    }
    if let Some(d) = norm_eps(ctx, key, &e.data, &want, e.shape[1]) {
        return d;
    }
    precision_or_scale(ctx, key, &e.data, &want, m.rel_l2, m.cosine)
}

/// Some heads (at most half) are over their local bound, each by an error a single scale
/// factor explains (its rel_l2 within its bound of |s − 1|), while the others are within theirs.
fn head_scale(ctx: &DiagContext, key: &TapKey) -> Option<Diagnosis> {
    let p = ctx.head_profile.filter(|p| p.tap == key.to_string())?;
    let over: Vec<_> = p.heads.iter().filter(|h| h.rel_l2 > h.bound).collect();
    if over.is_empty() || over.len() * 2 > p.heads.len() {
        return None;
    }
    let explained = over.iter().all(|h| {
        let off = (h.scale - 1.0).abs();
        h.scale.is_finite() && off > h.bound && (h.rel_l2 - off).abs() <= h.bound.max(0.1 * off)
    });
    if !explained {
        return None;
    }
    let said: Vec<String> = over
        .iter()
        .map(|h| {
            format!(
                "head {} is off by a scale of {:.4} (local rel_l2 {:.2e} on that head, bound {:.1e})",
                h.head, h.scale, h.rel_l2, h.bound
            )
        })
        .collect();
    Some(found(
        "scale-mismatch",
        "high",
        format!(
            "at {key}, {}; the other {} heads are within their bounds: per-head local error against the reference op on the candidate's own inputs",
            said.join("; "),
            p.heads.len() - over.len()
        ),
    ))
}

/// At an RMSNorm tap, every token's row is the reference's times its own scale, and the scales
/// fit one different eps: y = x·w/√(ms + eps′) against x·w/√(ms + eps) gives
/// eps′ = (ms + eps)/s² − ms per token, ms the row's mean square of the norm's input.
fn norm_eps(ctx: &DiagContext, key: &TapKey, eng: &[f32], want: &[f32], width: usize) -> Option<Diagnosis> {
    let c = ctx.config;
    let input = match (key.site, key.layer) {
        (Site::AttnNorm, Some(0)) => TapKey::global(Site::Embed),
        (Site::AttnNorm, Some(l)) => TapKey::layer(l as usize - 1, Site::ResidOut),
        (Site::FfnNorm, Some(l)) => TapKey::layer(l as usize, Site::ResidAttn),
        (Site::OutputNorm, None) => TapKey::layer(c.n_layers.checked_sub(1)?, Site::ResidOut),
        _ => return None,
    };
    let x = engine_full(c, ctx.tp, ctx.eng, &input)?;
    let d = c.d_model;
    if key.rank.is_some() || width != d || x.len() != eng.len() || want.len() != eng.len() {
        return None;
    }
    let eps = c.rms_eps as f64;
    let mut fits = Vec::new();
    for ((e, r), xr) in eng.chunks(d).zip(want.chunks(d)).zip(x.chunks(d)) {
        let (er, rr) = e.iter().zip(r).fold((0f64, 0f64), |(a, b), (&p, &q)| {
            (a + p as f64 * q as f64, b + q as f64 * q as f64)
        });
        if rr == 0.0 {
            continue;
        }
        let s = er / rr;
        let resid: f64 = e
            .iter()
            .zip(r)
            .map(|(&p, &q)| (p as f64 - s * q as f64).powi(2))
            .sum::<f64>()
            / rr;
        let ms = xr.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / d as f64;
        fits.push((s, resid.sqrt(), (ms + eps) / (s * s) - ms));
    }
    let bound = ctx.threshold_hint(key);
    if fits.len() < 2 || fits.iter().any(|f| f.1 > 2.0 * bound.max(1e-6) || !f.2.is_finite()) {
        return None;
    }
    let mut eps_fit: Vec<f64> = fits.iter().map(|f| f.2).collect();
    eps_fit.sort_by(f64::total_cmp);
    let med = eps_fit[eps_fit.len() / 2];
    let spread_s = fits.iter().map(|f| f.0).fold(f64::NEG_INFINITY, f64::max)
        - fits.iter().map(|f| f.0).fold(f64::INFINITY, f64::min);
    if med <= 0.0 || (med / eps.max(1e-30) - 1.0).abs() < 1.0 || spread_s <= bound {
        return None;
    }
    let consistent = eps_fit.iter().filter(|&&e| (e / med - 1.0).abs() < 0.5).count() * 2 > eps_fit.len();
    consistent.then(|| {
        found(
            "config-drift",
            "high",
            format!(
                "every token's row of {key} is the reference's times its own scale, as an RMSNorm with eps ≈ {med:.2e} gives where the file says {eps:.1e}: the candidate normalizes with a different rms eps (config drift)"
            ),
        )
    })
}

fn weight_diagnosis(ctx: &DiagContext, key: &TapKey, kind: WeightKind, eng: &[f32], shape: [usize; 2]) -> Diagnosis {
    let c = ctx.config;
    let full = ctx.refs.get(&key.unranked()).expect("checked by caller");
    let want = reference_slice(c, ctx.tp, key, full);
    if eng.len() != want.len() {
        let want_rows = want.len() / full.shape[1].max(1);
        let holds_full = eng.len() == full.data.len();
        return found(
            "head-permutation",
            "high",
            format!(
                "{key} is {:?} where rank {} should hold [{want_rows}, {}] of the reference's {:?}{}",
                shape,
                key.rank.unwrap_or(0),
                full.shape[1],
                full.shape,
                if holds_full {
                    format!(
                        ": {} was loaded unsharded, so every rank computes with rank 0's heads",
                        kind.name()
                    )
                } else {
                    ": the shard has the wrong size".to_string()
                }
            ),
        );
    }
    // Does this rank hold another rank's shard?
    if let Some(rank) = key.rank {
        for other in 0..ctx.tp as u32 {
            if other == rank {
                continue;
            }
            let other_key = TapKey {
                rank: Some(other),
                ..*key
            };
            let theirs = reference_slice(c, ctx.tp, &other_key, full);
            if theirs.len() == eng.len() && metrics(eng, &theirs).rel_l2 < 1e-6 {
                let heads = |r: u32| {
                    rank_columns(Site::Weight(kind), c, ctx.tp, r as usize).map(|rows| {
                        let per_head = rows.len() * ctx.tp / c.n_heads.max(1);
                        let ids: Vec<usize> = (rows.start / per_head.max(1)..rows.end / per_head.max(1)).collect();
                        ranges(&ids)
                    })
                };
                let (mine, held) = (heads(rank).unwrap_or_default(), heads(other).unwrap_or_default());
                let swapped = ctx.eng.get(&other_key).is_some_and(|o| {
                    let mine_ref = reference_slice(c, ctx.tp, key, full);
                    o.data.len() == mine_ref.len() && metrics(&o.data, &mine_ref).rel_l2 < 1e-6
                });
                let cause = if swapped {
                    format!("ranks {rank} and {other} exchanged their {} shards", kind.name())
                } else if other == 0 {
                    format!(
                        "{} was loaded unsharded (every rank computes with rank 0's heads)",
                        kind.name()
                    )
                } else {
                    format!("the {} shards are assigned to the wrong ranks", kind.name())
                };
                return found(
                    "head-permutation",
                    "high",
                    format!("{key} holds rank {other}'s heads {held} instead of heads {mine}: {cause}"),
                );
            }
        }
    }
    // Same values, another arrangement: a layout (transpose/reshape) fault.
    let mut a: Vec<u32> = eng.iter().map(|x| x.to_bits()).collect();
    let mut b: Vec<u32> = want.iter().map(|x| x.to_bits()).collect();
    a.sort_unstable();
    b.sort_unstable();
    if a == b {
        return found(
            "transposed-weight",
            "high",
            format!(
                "{key} holds exactly the reference's values in another arrangement: a transpose/reshape mix-up when the loader reassembled it{}",
                if kind == WeightKind::KvB { " (k_b reshaped instead of transposed?)" } else { "" }
            ),
        );
    }
    if let Some(d) = other_layer(ctx, key, kind, eng) {
        return d;
    }
    if let Some(d) = raw_blocks(key, eng, &want, shape[1]) {
        return d;
    }
    if let Some(d) = other_float(key, eng, &want) {
        return d;
    }
    let ratio = scale_ratio(eng, &want);
    if let Some(s) = ratio.filter(|s| (s - 1.0).abs() > 1e-3) {
        return found(
            "scale-mismatch",
            "high",
            format!("{key} equals the reference's shard times {s:.4}"),
        );
    }
    let cos = cosine(eng, &want);
    let rel = metrics(eng, &want).rel_l2;
    let ty = ctx.tensor_type_hint(key);
    if rel < 0.1 && cos > 0.99 && kind == WeightKind::Router {
        if let (Some(layer), Some(flips)) = (key.layer, routing_flips(ctx, key)) {
            return found(
                "routing-flip",
                "high",
                format!("{key} is the reference's router rounded to a lower precision (rel_l2 {rel:.2e}); downstream, {flips} at blk.{layer}.moe_topk"),
            );
        }
    }
    if rel < 0.1 && cos > 0.99 {
        return found(
            "precision",
            "high",
            format!("{key} is the reference's weight rounded to a lower precision (rel_l2 {rel:.2e}, cosine {cos:.5}): the loader re-rounded it{ty}"),
        );
    }
    found(
        "dequantization",
        "high",
        format!("{key}: the engine's dequantized values differ from the reference's on the same bytes (rel_l2 {rel:.2e}, cosine {cos:.3}){ty}: the engine's dequantizer for this type is wrong"),
    )
}

/// The weight equals the reference's weight of the same kind in another layer (this rank's part
/// of it): the loader read that layer's tensors. The nearest layers are tried first (at most 16).
fn other_layer(ctx: &DiagContext, key: &TapKey, kind: WeightKind, eng: &[f32]) -> Option<Diagnosis> {
    let (reference, layer) = (ctx.reference?, key.layer? as usize);
    let n = ctx.config.n_layers;
    let mut order: Vec<usize> = (0..n).filter(|&l| l != layer).collect();
    order.sort_by_key(|&l| (l.abs_diff(layer), l));
    for l in order.into_iter().take(16) {
        let Ok(Some(w)) = reference.weight(l, kind) else {
            continue;
        };
        if w.rows * w.cols < eng.len() {
            continue;
        }
        let other_key = TapKey {
            layer: Some(l as u32),
            ..*key
        };
        let full = crate::capture::Captured::whole(other_key.unranked(), [w.rows, w.cols], w.to_f32());
        let theirs = reference_slice(ctx.config, ctx.tp, &other_key, &full);
        // Below f32 the loader rounds float weights to the compute dtype: equal up to that.
        let tol = (2.0 * ctx.dtype.unit_roundoff()).max(1e-6);
        let rel = (theirs.len() == eng.len()).then(|| metrics(eng, &theirs).rel_l2);
        if let Some(rel) = rel.filter(|&r| r < tol) {
            let on = key.rank.map_or(String::new(), |r| format!(" on rank {r}"));
            return Some(found(
                "wrong-layer",
                "high",
                format!(
                    "{key} is the reference's {} (rel_l2 {rel:.1e}), not its own layer's: the loader read layer {l}'s tensors for layer {layer}{on} (a layer index slip)",
                    TapKey::layer(l, key.site)
                ),
            ));
        }
    }
    None
}

/// Every value is an integer in [−127, 127] and each block of 32 along a row is the reference's
/// block times its own factor: a quantized weight's integers used without their block scales
/// (Q8_0 blocks handed un-dequantized to a layer that expects float weights).
fn raw_blocks(key: &TapKey, eng: &[f32], want: &[f32], cols: usize) -> Option<Diagnosis> {
    const BLOCK: usize = 32;
    let ints = eng.iter().all(|&x| x.fract() == 0.0 && x.abs() <= 127.0);
    if !ints || !cols.is_multiple_of(BLOCK) || eng.iter().all(|&x| x == 0.0) || want.iter().all(|&x| x.fract() == 0.0) {
        return None;
    }
    let mut factors = Vec::new();
    for (e, w) in eng.chunks(BLOCK).zip(want.chunks(BLOCK)) {
        if w.iter().all(|&x| x == 0.0) {
            if e.iter().any(|&x| x != 0.0) {
                return None;
            }
            continue;
        }
        let s = scale_ratio(e, w)?;
        factors.push(s);
    }
    factors.sort_by(f64::total_cmp);
    let (lo, hi) = (*factors.first()?, *factors.last()?);
    Some(found(
        "dequantization",
        "high",
        format!(
            "{key} holds integers in [−127, 127], each block of {BLOCK} the reference's block times its own factor ({lo:.3e} to {hi:.3e} over {} blocks): the quantized blocks' integers were used without their block scales (Q8_0 handed un-dequantized to a layer built for float weights)",
            factors.len()
        ),
    ))
}

/// The weight is the reference's 16-bit float values with their bits read as the other 16-bit
/// float (F16 bits decoded as BF16, or BF16 as F16): a dtype slip in the loader.
fn other_float(key: &TapKey, eng: &[f32], want: &[f32]) -> Option<Diagnosis> {
    use half::{bf16, f16};
    let f16_as_bf16 = |w: f32| {
        let h = f16::from_f32(w);
        (h.to_f32() == w).then(|| bf16::from_bits(h.to_bits()).to_f32())
    };
    let bf16_as_f16 = |w: f32| {
        let b = bf16::from_f32(w);
        (b.to_f32() == w).then(|| f16::from_bits(b.to_bits()).to_f32())
    };
    let same = |a: f32, b: Option<f32>| b.is_some_and(|b| a == b || (a.is_nan() && b.is_nan()));
    let differs = eng.iter().zip(want).any(|(a, b)| a != b);
    let (stored, read) = if !differs {
        return None;
    } else if eng.iter().zip(want).all(|(&a, &w)| same(a, f16_as_bf16(w))) {
        ("F16", "BF16")
    } else if eng.iter().zip(want).all(|(&a, &w)| same(a, bf16_as_f16(w))) {
        ("BF16", "F16")
    } else {
        return None;
    };
    Some(found(
        "dequantization",
        "high",
        format!(
            "every value of {key} is the reference's {stored} value with its 16 bits read as {read}: the loader decoded an {stored} tensor as {read} (a dtype slip)"
        ),
    ))
}

/// A DSA `indexer_score` tap whose decode rows hold, in the entry of the step's own key, exactly
/// 0 where the reference's is not, every other entry agreeing as well as the prefill rows do:
/// the step scored its keys before writing its own key to the indexer's key cache (a stale slot
/// holding zeros).
fn indexer_cache(
    ctx: &DiagContext,
    key: &TapKey,
    eng: &[f32],
    want: &[f32],
    width: usize,
    threshold: f64,
) -> Option<Diagnosis> {
    let (p, n) = (ctx.n_prefill, eng.len() / width.max(1));
    if p >= n || want.len() != eng.len() || width != n {
        return None;
    }
    // The prefill rows' error is the noise level (end to end: below f32 it can exceed the tap's
    // threshold while the tap is judged on its local error).
    let prefill = metrics(&eng[..p * width], &want[..p * width]).rel_l2;
    // A decode row is stale when its own key's score is exactly 0 where the reference's is not,
    // while its other keys agree as well as the prefill rows do (within the threshold).
    let noise = threshold.max(2.0 * prefill);
    let mut stale = Vec::new();
    for t in p..n {
        let (e, w) = (&eng[t * width..t * width + t], &want[t * width..t * width + t]);
        let (own_e, own_w) = (eng[t * width + t], want[t * width + t]);
        let others = if t == 0 { 0.0 } else { metrics(e, w).rel_l2 };
        if others > noise {
            return None;
        }
        if own_e == 0.0 && own_w != 0.0 {
            stale.push(t);
        } else if (own_e - own_w).abs() as f64 > noise * own_w.abs().max(f32::MIN_POSITIVE) as f64 {
            return None;
        }
    }
    let first = *stale.first()?;
    Some(found(
        "kv-cache",
        "high",
        format!(
            "at the decode step of position {first}, {key} scores the step's own key 0 where the reference scores {:.3e}; every other key's score agrees, and so do the {p} prefill rows (decode positions {} differ the same way): the step read the indexer's key cache before writing its own key to slot {first} (a stale slot holding zeros), so the indexer's cache write/read order is wrong",
            want[first * width + first],
            ranges(&stale)
        ),
    ))
}

/// "N of M tokens route to different experts" at the layer's moe_topk, if any flipped.
fn routing_flips(ctx: &DiagContext, key: &TapKey) -> Option<String> {
    let topk = TapKey::layer(key.layer? as usize, Site::MoeTopk);
    let e = engine_full(ctx.config, ctx.tp, ctx.eng, &topk)?;
    let r = &ctx.refs.get(&topk)?;
    let k = r.shape[1].max(1);
    let n = r.data.len() / k;
    let same = e.chunks(k).zip(r.data.chunks(k)).filter(|(a, b)| a == b).count();
    (same < n).then(|| format!("{} of {n} tokens route to different experts", n - same))
}

impl DiagContext<'_> {
    fn tensor_type_hint(&self, _key: &TapKey) -> String {
        String::new()
    }
}

/// `a ≈ s·b` for one scalar s: returns s when the fit is near exact.
fn scale_ratio(a: &[f32], b: &[f32]) -> Option<f64> {
    let (ab, bb): (f64, f64) = a.iter().zip(b).fold((0.0, 0.0), |(x, y), (&p, &q)| {
        (x + p as f64 * q as f64, y + q as f64 * q as f64)
    });
    if bb == 0.0 {
        return None;
    }
    let s = ab / bb;
    let resid: f64 = a.iter().zip(b).map(|(&p, &q)| (p as f64 - s * q as f64).powi(2)).sum();
    (resid / (s * s * bb) < 1e-8).then_some(s)
}

fn missing_reduction(ctx: &DiagContext, key: &TapKey, eng: &[f32]) -> Option<Diagnosis> {
    if ctx.tp < 2 {
        return None;
    }
    if matches!(key.site, Site::ResidAttn | Site::ResidOut) {
        return unreduced_residual(ctx, key, eng);
    }
    if !matches!(key.site, Site::AttnProj | Site::FfnOut) {
        return None;
    }
    let base = key.unranked();
    for r in 0..ctx.tp as u32 {
        let partial = ctx.eng.get(&TapKey { rank: Some(r), ..base })?;
        if partial.data.len() == eng.len() && metrics(eng, &partial.data).rel_l2 < 1e-6 {
            let summed: Vec<f32> = (0..eng.len())
                .map(|i| {
                    (0..ctx.tp as u32)
                        .filter_map(|q| ctx.eng.get(&TapKey { rank: Some(q), ..base }))
                        .map(|p| p.data[i])
                        .sum()
                })
                .collect();
            let sum_err = ctx.refs.get(&base).map(|r| metrics(&summed, &r.data).rel_l2);
            return Some(found(
                "missing-reduction",
                "high",
                format!(
                    "{base} equals rank {r}'s partial sum: the all-reduce did not run{}",
                    sum_err.map_or(String::new(), |e| format!(
                        " (the sum of the {} partials matches the reference to rel_l2 {e:.1e})",
                        ctx.tp
                    ))
                ),
            ));
        }
    }
    None
}

/// A rank's residual tap diverges: did it add one rank's partial sum (before the all-reduce)
/// instead of the reduced sum? The engine taps the reduced `attn_proj`/`ffn_out` once (rank 0's
/// copy), so another rank's missing reduction first shows in its own residual:
/// `resid@rR - (its input residual @rR)` is compared with every rank's partial.
fn unreduced_residual(ctx: &DiagContext, key: &TapKey, eng: &[f32]) -> Option<Diagnosis> {
    let layer = key.layer? as usize;
    let rank = key.rank?;
    let (input, partial_site) = match key.site {
        Site::ResidAttn if layer == 0 => (TapKey::global(Site::Embed), Site::AttnProj),
        Site::ResidAttn => (TapKey::ranked(layer - 1, Site::ResidOut, rank as usize), Site::AttnProj),
        Site::ResidOut => (TapKey::ranked(layer, Site::ResidAttn, rank as usize), Site::FfnOut),
        _ => return None,
    };
    let x = ctx.eng.get(&input).or_else(|| ctx.eng.get(&input.unranked()))?;
    if x.data.len() != eng.len() {
        return None;
    }
    let added: Vec<f32> = eng.iter().zip(&x.data).map(|(a, b)| a - b).collect();
    let base = TapKey::layer(layer, partial_site);
    let norm = |v: &[f32]| v.iter().map(|&a| a as f64 * a as f64).sum::<f64>().sqrt();
    for q in 0..ctx.tp as u32 {
        let partial = ctx.eng.get(&TapKey { rank: Some(q), ..base })?;
        // The subtraction loses about u·|x|/|partial| of the partial (and below f32 the stored
        // sum and partial were each rounded once): allow 1e-4 at f32, 4·u·(1 + |x|/|partial|) below.
        let tol = if ctx.dtype == ActDtype::F32 {
            1e-4
        } else {
            let ratio = norm(&x.data) / norm(&partial.data).max(f64::MIN_POSITIVE);
            (4.0 * ctx.dtype.unit_roundoff() * (1.0 + ratio)).max(1e-4)
        };
        if partial.data.len() != added.len() || metrics(&added, &partial.data).rel_l2 >= tol {
            continue;
        }
        let reduced = ctx
            .refs
            .get(&base)
            .map(|r| metrics(&added, &r.data).rel_l2)
            .map_or(String::new(), |e| {
                format!(" (the reduced {base} differs from what it added by rel_l2 {e:.2e})")
            });
        return Some(found(
            "missing-reduction",
            "high",
            format!(
                "{key} = its input {input} + rank {q}'s partial {}: rank {rank} added {} partial sum instead of the all-reduced one, so the all-reduce did not reach it{reduced}",
                TapKey { rank: Some(q), ..base },
                if q == rank { "its own" } else { "another rank's" },
            ),
        ));
    }
    None
}

/// Every value of a custom op's output is zero, no canary is left, and the reference's is not
/// zero: the buffer read holds its initial contents, so nothing wrote it in this step.
fn unread_buffer(key: &TapKey, eng: &[f32], want: &[f32]) -> Option<Diagnosis> {
    if !key.site.is_custom_op_output() || eng.iter().any(|&x| x != 0.0) || want.iter().all(|&x| x == 0.0) {
        return None;
    }
    Some(found(
        "stale-output",
        "low",
        format!(
            "every value of {key} is 0 while the reference's is not, and no canary is left: the caller read a buffer nothing wrote in this step, still holding its initial zeros (a stale buffer; on a later layer or step it would hold old values), or the op zero-filled its output and computed nothing"
        ),
    ))
}

/// The prefill rows agree and only the rows that ran as decode steps diverge: the op sees
/// different state in decode than in the prefill (the KV cache), since every earlier tap agreed.
fn decode_only(
    ctx: &DiagContext,
    key: &TapKey,
    eng: &[f32],
    want: &[f32],
    width: usize,
    threshold: f64,
) -> Option<Diagnosis> {
    let (p, n) = (ctx.n_prefill, eng.len() / width.max(1));
    if p >= n || want.len() != eng.len() {
        return None;
    }
    let rows = |r: std::ops::Range<usize>| {
        metrics(
            &eng[r.start * width..r.end * width],
            &want[r.start * width..r.end * width],
        )
        .rel_l2
    };
    let (prefill, decode) = (rows(0..p), rows(p..n));
    let (worst_at, worst_step) = (p..n)
        .map(|t| (t, rows(t..t + 1)))
        .fold((p, 0f64), |a, b| if b.1 > a.1 { b } else { a });
    let first_at = (p..n).find(|&t| rows(t..t + 1) > threshold).unwrap_or(p);
    (prefill <= threshold && decode > threshold).then(|| {
        found(
            "unknown",
            "low",
            format!(
                "only decode diverges at {key}: the {p} prefill rows agree (rel_l2 {prefill:.1e}) but the {} decode rows do not (rel_l2 {decode:.2e}; first over at decode step {} (token {first_at}), worst step {} at {worst_step:.2e}), while every earlier tap agrees on every row: in decode the op reads state the prefill does not (the KV cache), so suspect the cache write/read path (slot mapping, positions)",
                n - p,
                first_at - p + 1,
                worst_at - p + 1
            ),
        )
    })
}

/// A decode step's K/V cache differs from what a correct cache holds (the step's own k/v rows
/// of every position so far): names the first step and slot that differ and, when it matches
/// one, the position whose entry the slot holds (a slot mapping off by some rows), or says the
/// slot is empty (never written).
fn kv_cache(ctx: &DiagContext, key: &TapKey, eng: &[f32], want: &[f32], width: usize, threshold: f64) -> Diagnosis {
    let n = ctx.n_tokens;
    let what = if key.site == Site::KvCacheK { "K" } else { "V" };
    let rows = eng.len() / width.max(1);
    let steps = references::tap::cache_steps(rows, n).filter(|_| want.len() == eng.len() && width > 0);
    let Some(d) = steps else {
        return found(
            "kv-cache",
            "medium",
            format!("the {what} cache the decode steps read differs at {key} (its shape {rows}×{width} does not split into decode steps over {n} tokens)"),
        );
    };
    let row = |x: &[f32], r: usize| x[r * width..(r + 1) * width].to_vec();
    let differs = |a: &[f32], b: &[f32]| metrics(a, b).rel_l2 > threshold.max(1e-6);
    // The last step's reference rows: the correct entry of every position.
    let last = references::tap::cache_step_rows(n, d, d - 1);
    for i in 0..d {
        let r = references::tap::cache_step_rows(n, d, i);
        let pos = n - d + i;
        let bad: Vec<usize> = (0..r.len())
            .filter(|&s| differs(&row(eng, r.start + s), &row(want, r.start + s)))
            .collect();
        if bad.is_empty() {
            continue;
        }
        // What each differing slot holds (the first few).
        let holds = |slot: usize| {
            let got = row(eng, r.start + slot);
            if got.iter().all(|&x| x == 0.0) {
                return format!("slot {slot} is empty (zeros)");
            }
            match (0..last.len()).find(|&q| !differs(&got, &row(want, last.start + q))) {
                Some(q) => format!("slot {slot} holds the {what} of position {q}"),
                None => format!("slot {slot} differs from the {what} of every position"),
            }
        };
        let said: Vec<String> = bad.iter().take(3).map(|&s| holds(s)).collect();
        let more = if bad.len() > 3 {
            format!("; {} of its {} slots differ: {}", bad.len(), r.len(), ranges(&bad))
        } else {
            String::new()
        };
        let holds = said.join(", ") + &more;
        let slot = bad[0];
        return found(
            "kv-cache",
            "high",
            format!(
                "at the decode step of position {pos}, the {what} cache read at {key} is wrong from slot {slot}: {holds}; every earlier tap agrees, so the cache write/read path (slot mapping, positions) is wrong"
            ),
        );
    }
    found(
        "kv-cache",
        "low",
        format!("the {what} cache the decode steps read differs at {key}, spread below any single slot's bound"),
    )
}

fn stale(ctx: &DiagContext, key: &TapKey, eng: &[f32]) -> Option<Diagnosis> {
    let layer = key.layer?;
    let prev = TapKey {
        layer: Some(layer.checked_sub(1)?),
        ..*key
    };
    let earlier = ctx
        .eng
        .get(&prev)
        .map(|p| &p.data)
        .or_else(|| ctx.refs.get(&prev.unranked()).map(|p| &p.data))?;
    let earlier: Vec<f32> = if earlier.len() == eng.len() {
        earlier.clone()
    } else {
        let r = ctx.refs.get(&prev.unranked())?;
        reference_slice(ctx.config, ctx.tp, &prev, r)
    };
    (earlier.len() == eng.len() && metrics(eng, &earlier).rel_l2 < 1e-5).then(|| {
        found(
            "stale-output",
            "high",
            format!("{key} equals {prev} (the previous layer's values): the op's output buffer was read before this layer wrote it"),
        )
    })
}

/// Position 0 agrees (RoPE rotates by 0 there) while later positions diverge, growing with
/// position: the rotary embedding differs.
fn rope(key: &TapKey, eng: &[f32], want: &[f32], width: usize, threshold: f64) -> Option<Diagnosis> {
    let n = eng.len() / width.max(1);
    if n < 3 {
        return None;
    }
    let row = |t: usize| metrics(&eng[t * width..(t + 1) * width], &want[t * width..(t + 1) * width]).rel_l2;
    let (first, later) = (row(0), (1..n).map(row).fold(0f64, f64::max));
    (first <= threshold && later > 10.0 * threshold).then(|| {
        found(
            "rope",
            "high",
            format!("{key}: position 0 agrees (rel_l2 {first:.1e}) but later positions diverge (up to {later:.2e}): the rotary embedding differs (NEOX vs NORM pairs, or base/dims)"),
        )
    })
}

fn head_permutation(ctx: &DiagContext, key: &TapKey, eng: &[f32], want: &[f32]) -> Option<Diagnosis> {
    let c = ctx.config;
    let hd = match (&c.mla, key.site) {
        (None, Site::Q | Site::K | Site::V | Site::AttnOut) => c.head_dim,
        (Some(m), Site::Q) => m.qk_nope + m.qk_rope,
        (Some(m), Site::K) => m.qk_nope,
        (Some(m), Site::V | Site::AttnOut) => m.v_head_dim,
        _ => return None,
    };
    let full_ref = &ctx.refs.get(&key.unranked())?.data;
    let n_ref_heads = full_ref.len() / ctx.n_tokens / hd;
    let n_eng_heads = eng.len() / ctx.n_tokens / hd;
    let _ = want;
    let cos = crate::compare::head_cosines(eng, n_eng_heads, full_ref, n_ref_heads, hd);
    let offset = key
        .rank
        .and_then(|r| rank_columns(key.site, c, ctx.tp, r as usize))
        .map_or(0, |cols| cols.start / hd);
    let mut moved = Vec::new();
    for he in 0..n_eng_heads {
        let row = &cos[he * n_ref_heads..(he + 1) * n_ref_heads];
        let (best, &bc) = row.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1))?;
        if bc < 0.999 {
            return None;
        }
        if best != offset + he {
            moved.push((offset + he, best));
        }
    }
    if moved.is_empty() {
        return None;
    }
    let (from, to): (Vec<usize>, Vec<usize>) = moved.iter().copied().unzip();
    Some(found(
        "head-permutation",
        "high",
        format!(
            "per-head cosine at {key}: engine heads {} match reference heads {} (cosine > 0.999)",
            ranges(&from),
            ranges(&to)
        ),
    ))
}

fn precision_or_scale(ctx: &DiagContext, key: &TapKey, eng: &[f32], want: &[f32], rel: f64, cos: f64) -> Diagnosis {
    // bf16 first: a bf16 value within f16's range is also f16-representable, so testing f16
    // first would misname a bf16 tensor. Below f32 compute, a tensor in the compute dtype is the
    // norm, not a finding.
    let ty = match ActDtype::detect([eng].into_iter()) {
        ActDtype::F32 => None,
        d if ctx.dtype == ActDtype::F32 => Some(d.name()),
        _ => None,
    };
    if let Some(ty) = ty.filter(|_| rel < 1e-2) {
        return found(
            "precision",
            "high",
            format!("every value of {key} is exactly {ty}-representable and the error (rel_l2 {rel:.2e}) is at {ty}'s rounding level: a tensor kept in {ty}"),
        );
    }
    if let Some(s) = scale_ratio(eng, want).filter(|s| (s - 1.0).abs() > 1e-3) {
        return found(
            "scale-mismatch",
            "high",
            format!("{key} equals the reference times {s:.4} (cosine {cos:.6})"),
        );
    }
    if rel < 1e-2 && cos > 0.9999 {
        return found(
            "precision",
            "low",
            format!("{key} differs at rounding level (rel_l2 {rel:.2e}, cosine {cos:.6})"),
        );
    }
    found(
        "unknown",
        "low",
        format!("{key} diverges (rel_l2 {rel:.2e}, cosine {cos:.4}); no class's evidence holds"),
    )
}
