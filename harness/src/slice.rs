//! Joining the two sides' taps under tensor parallelism: which part of the reference's full
//! tensor a rank's tap corresponds to ([`reference_slice`]), and the engine's full tensor put back
//! together from its rank slices ([`engine_full`]), and a divergent weight's sampled taps put
//! back whole for the diagnosis ([`unsample`]). Used by the diff and by the diagnosis.

use crate::capture::Captured;
use crate::compare::columns;
use references::config::ModelConfig;
use references::forward::Reference;
use references::tap::{rank_columns, weight_in_columns, Site, TapKey};
use std::borrow::Cow;
use std::collections::BTreeMap;

/// Taps of one side, by key.
pub type Store = BTreeMap<TapKey, Captured>;

/// Sites whose rank-local form is a partial sum before the all-reduce, not a slice (the
/// vocab-parallel embedding's too: each rank contributes the rows it owns).
pub fn is_partial_sum(key: &TapKey) -> bool {
    key.rank.is_some() && matches!(key.site, Site::AttnProj | Site::FfnOut | Site::Embed)
}

/// The part of the reference's full tensor that an engine tap corresponds to.
pub fn reference_slice(c: &ModelConfig, tp: usize, key: &TapKey, full: &Captured) -> Vec<f32> {
    reference_part(c, tp, key, full).into_owned()
}

/// [`reference_slice`], borrowed where the part is contiguous (an unranked tap, a replicated one,
/// a column-parallel weight's rows): no copy of a whole weight per comparison.
pub fn reference_part<'a>(c: &ModelConfig, tp: usize, key: &TapKey, full: &'a Captured) -> Cow<'a, [f32]> {
    let Some(rank) = key.rank.map(|r| r as usize) else {
        return Cow::Borrowed(&full.data);
    };
    let width = full.shape[1];
    match key.site {
        Site::Weight(kind) => {
            if let Some(r) = rank_columns(key.site, c, tp, rank) {
                Cow::Borrowed(&full.data[r.start * width..r.end * width])
            } else if let Some(cols) = weight_in_columns(kind, c, tp, rank) {
                Cow::Owned(columns(&full.data, width, cols))
            } else {
                Cow::Borrowed(&full.data)
            }
        }
        site => match rank_columns(site, c, tp, rank) {
            Some(cols) if cols.end <= width && cols.len() < width => Cow::Owned(columns(&full.data, width, cols)),
            _ => Cow::Borrowed(&full.data),
        },
    }
}

/// The engine's full tensor at an unranked key: its own unranked tap, or its rank slices put
/// back together (rows for column-parallel weights, columns for activations).
pub fn engine_full(c: &ModelConfig, tp: usize, eng: &Store, key: &TapKey) -> Option<Vec<f32>> {
    if let Some(t) = eng.get(key) {
        return Some(t.data.clone());
    }
    let parts: Vec<&Captured> = (0..tp)
        .map(|r| {
            eng.get(&TapKey {
                rank: Some(r as u32),
                ..*key
            })
        })
        .collect::<Option<_>>()?;
    if is_partial_sum(&TapKey { rank: Some(0), ..*key }) {
        return None;
    }
    if let Site::Weight(kind) = key.site {
        if rank_columns(key.site, c, tp, 0).is_some() {
            // Column-parallel: each rank holds whole rows.
            return Some(parts.iter().flat_map(|p| p.data.iter().copied()).collect());
        }
        if weight_in_columns(kind, c, tp, 0).is_none() {
            // Replicated on every rank.
            return Some(parts[0].data.clone());
        }
        // Row-parallel: each rank holds input columns; fall through to the column join.
    } else if rank_columns(key.site, c, tp, 0).is_none() {
        // Replicated on every rank.
        return Some(parts[0].data.clone());
    }
    let n = parts[0].shape[0];
    let mut out = Vec::new();
    for t in 0..n {
        for p in &parts {
            let w = p.shape[1];
            out.extend_from_slice(&p.data[t * w..(t + 1) * w]);
        }
    }
    Some(out)
}

/// A weight tap's whole shape at `key` given the reference's whole `[rows, cols]`: a rank's shard
/// (its row range of a column-parallel weight, its input columns of a row-parallel one), or the
/// whole weight (unranked, replicated).
pub fn weight_shard_shape(c: &ModelConfig, tp: usize, key: &TapKey, whole: [usize; 2]) -> [usize; 2] {
    let (Site::Weight(kind), Some(rank)) = (key.site, key.rank.map(|r| r as usize)) else {
        return whole;
    };
    if let Some(r) = rank_columns(key.site, c, tp, rank) {
        return [r.len(), whole[1]];
    }
    match weight_in_columns(kind, c, tp, rank) {
        Some(cols) => [whole[0], cols.len()],
        None => whole,
    }
}

/// The reference's values for a weight tap at `key` that holds rows `rows` of its shard (`None`:
/// every row), from the reference's `full` (which may itself hold a sample of rows): the same
/// rows of the part [`reference_part`] gives. `None` when `full` lacks one of those rows.
pub fn reference_weight_rows(
    c: &ModelConfig,
    tp: usize,
    key: &TapKey,
    rows: Option<&[usize]>,
    full: &Captured,
) -> Option<Vec<f32>> {
    let Site::Weight(kind) = key.site else { return None };
    let width = full.shape[1];
    let rank = key.rank.map(|r| r as usize);
    let row_range = rank.and_then(|r| rank_columns(key.site, c, tp, r));
    let cols = match (&row_range, rank) {
        (None, Some(r)) => weight_in_columns(kind, c, tp, r).unwrap_or(0..width),
        _ => 0..width,
    };
    let (offset, n_rows) = row_range.map_or((0, full.shape[0]), |r| (r.start, r.len()));
    if cols.end > width {
        return None;
    }
    let local: Vec<usize> = rows.map_or_else(|| (0..n_rows).collect(), <[usize]>::to_vec);
    let mut out = Vec::with_capacity(local.len() * cols.len());
    for i in local {
        let g = offset + i;
        if i >= n_rows || g >= full.shape[0] {
            return None;
        }
        let at = match &full.rows {
            None => g,
            Some(have) => have.binary_search(&g).ok()?,
        };
        out.extend_from_slice(&full.data[at * width + cols.start..at * width + cols.end]);
    }
    Some(out)
}

/// Puts the divergent weight `key`'s kept taps back whole where they hold a sample of rows (the
/// reference's read from the file again, each engine rank's from `engine`), so that the
/// diagnosis (a transpose, another rank's shard, the head matrix) reads whole weights, as it
/// does under `--full-weights`. Only the one weight is decoded whole.
pub fn unsample(
    key: &TapKey,
    reference: &Reference,
    eng: &mut Store,
    refs: &mut Store,
    engine: &dyn Fn(&TapKey) -> Option<Captured>,
) {
    let (Some(layer), Site::Weight(kind)) = (key.layer, key.site) else {
        return;
    };
    let full = key.unranked();
    if refs.get(&full).is_some_and(|c| c.rows.is_some()) {
        if let Ok(Some(m)) = reference.weight(layer as usize, kind) {
            let shape = [m.rows, m.cols];
            refs.insert(full, Captured::whole(full, shape, m.to_f32()));
        }
    }
    let sampled: Vec<TapKey> = eng
        .iter()
        .filter(|(k, c)| k.unranked() == full && c.rows.is_some())
        .map(|(k, _)| *k)
        .collect();
    for k in sampled {
        if let Some(c) = engine(&k) {
            eng.insert(k, c);
        }
    }
}
