//! What `diff-layers` re-runs and measures at the first divergence, for the report: the
//! divergent op and the one before it re-run on the reference's own inputs (isolation), and
//! the head-by-head cosine matrix of the divergent tap (or the nearest one that has heads).

use crate::compare::{head_cosines, metrics};
use crate::diagnose::DiagContext;
use crate::slice::engine_full;
use references::forward::Reference;
use references::tap::{Site, TapKey, WeightKind};
use reports::{HeadMatrix, Isolation};

/// The sites whose op is re-run at a divergence: the divergent one and the one before it.
pub fn isolate(reference: &Reference, ctx: &DiagContext, key: &TapKey) -> anyhow::Result<Vec<Isolation>> {
    let mut out = Vec::new();
    let Some(layer) = key.layer else { return Ok(out) };
    let order: Vec<Site> = Site::ACTIVATIONS.iter().copied().filter(|s| !s.is_global()).collect();
    let idx = order.iter().position(|s| *s == key.site);
    let candidates: Vec<Site> = match idx {
        Some(i) => order[i.saturating_sub(1)..=i].to_vec(),
        None => return Ok(out),
    };
    for site in candidates {
        let full = TapKey::layer(layer as usize, site);
        let (Some(eng_out), Some(ref_out)) = (engine_full(ctx.config, ctx.tp, ctx.eng, &full), ctx.refs.get(&full))
        else {
            continue;
        };
        let inputs = |k: &TapKey| engine_full(ctx.config, ctx.tp, ctx.eng, k);
        let Some(replayed) = reference.replay(&full, &inputs, ctx.n_tokens)? else {
            continue;
        };
        if replayed.len() != eng_out.len() {
            continue;
        }
        let e2e = metrics(&eng_out, &ref_out.data).rel_l2;
        let iso = metrics(&eng_out, &replayed).rel_l2;
        let thr = ctx.threshold_hint(&full);
        out.push(Isolation {
            tap: full.to_string(),
            end_to_end_rel_l2: e2e,
            isolated_rel_l2: iso,
            verdict: if iso <= thr { "propagated" } else { "introduced" }.to_string(),
        });
    }
    Ok(out)
}

/// The head matrix for the report: at the divergent tap itself, or, when it has none (a weight
/// whose shape differs, a non-attention site), at the first over-threshold attention tap of the
/// same layer, where a head permutation or an unsharded kv_b shows as a shifted diagonal.
pub fn heads_at_divergence(ctx: &DiagContext, key: &TapKey) -> Option<HeadMatrix> {
    head_matrix(ctx, key).or_else(|| {
        let attn = [Site::Q, Site::K, Site::V, Site::AttnOut];
        ctx.rows
            .iter()
            .filter(|r| r.over_end_to_end && r.layer == key.layer)
            .filter_map(|r| r.tap.parse::<TapKey>().ok())
            .filter(|k| attn.contains(&k.site))
            .find_map(|k| head_matrix(ctx, &k))
    })
}

/// The per-head cosine matrix at an attention tap or the kv_b / q weights.
fn head_matrix(ctx: &DiagContext, key: &TapKey) -> Option<HeadMatrix> {
    let c = ctx.config;
    let full = key.unranked();
    let (per_head, n_heads) = match (&c.mla, key.site) {
        (None, Site::Q | Site::AttnOut) => (c.head_dim, c.n_heads),
        (None, Site::K | Site::V) => (c.head_dim, c.n_kv_heads),
        (Some(m), Site::Q) => (m.qk_nope + m.qk_rope, c.n_heads),
        (Some(m), Site::K) => (m.qk_nope, c.n_heads),
        (Some(m), Site::V | Site::AttnOut) => (m.v_head_dim, c.n_heads),
        (Some(m), Site::Weight(WeightKind::KvB)) => (m.qk_nope + m.v_head_dim, c.n_heads),
        _ => return None,
    };
    let eng = engine_full(c, ctx.tp, ctx.eng, &full)?;
    let reference = &ctx.refs.get(&full)?.data;
    if eng.len() != reference.len() {
        return None;
    }
    let cosine = if let Site::Weight(_) = key.site {
        // Rows per head: compare each engine head's row block with each reference head's.
        let width = reference.len() / (n_heads * per_head);
        let block = per_head * width;
        let mut m = Vec::with_capacity(n_heads * n_heads);
        for he in 0..n_heads {
            for hr in 0..n_heads {
                m.push(crate::compare::cosine(
                    &eng[he * block..(he + 1) * block],
                    &reference[hr * block..(hr + 1) * block],
                ));
            }
        }
        m
    } else {
        head_cosines(&eng, n_heads, reference, n_heads, per_head)
    };
    Some(HeadMatrix {
        tap: full.to_string(),
        n_heads,
        cosine,
    })
}
