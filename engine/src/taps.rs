//! The engine's side of the two-phase tap protocol. Before a step, [`TapPlan::build`] asks the
//! tap `wants` for every key the step could emit; ranks (threads) then copy wanted tensors into
//! their own [`RankTaps`] at the moment they exist, and the driver records them in rank order
//! after each phase, followed by the unranked forms it assembles (gathered columns, reduced sums).

use crate::backend::{Backend, Buf};
use references::tap::{Recorded, Site, Tap, TapKey, WeightKind};
use std::collections::HashSet;

/// The keys a tap asked for in this step.
#[derive(Debug, Default)]
pub struct TapPlan {
    wanted: HashSet<TapKey>,
}

impl TapPlan {
    /// Asks `tap` about every key a step over `n_layers` layers on `tp` ranks can emit.
    pub fn build(tap: &dyn Tap, n_layers: usize, tp: usize) -> TapPlan {
        let mut wanted = HashSet::new();
        if tap.wants_nothing() {
            return TapPlan { wanted };
        }
        let mut ask = |key: TapKey| {
            if tap.wants(&key) {
                wanted.insert(key);
            }
        };
        let ranks = || std::iter::once(None).chain((0..tp).map(|r| Some(r as u32)));
        for site in [Site::Embed, Site::OutputNorm, Site::Logits] {
            for rank in ranks() {
                ask(TapKey {
                    layer: None,
                    site,
                    rank,
                });
            }
        }
        let sites = Site::ACTIVATIONS
            .into_iter()
            .filter(|s| !s.is_global())
            .chain(WeightKind::ALL.into_iter().map(Site::Weight));
        for site in sites {
            for l in 0..n_layers {
                for rank in ranks() {
                    ask(TapKey {
                        layer: Some(l as u32),
                        site,
                        rank,
                    });
                }
            }
        }
        TapPlan { wanted }
    }

    pub fn wants(&self, key: &TapKey) -> bool {
        self.wanted.contains(key)
    }

    pub fn is_empty(&self) -> bool {
        self.wanted.is_empty()
    }
}

/// How a rank's tensor relates to the unranked (full) tensor at the same site.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Emit {
    /// Every rank computes the whole tensor; the unranked form is rank 0's.
    Replicated,
    /// The rank holds a column slice; the unranked form is the gather of all ranks in order.
    Column,
    /// The rank holds a partial sum; the driver emits the reduced unranked form itself.
    Partial,
}

/// A tensor held back for the gather of a column-parallel site.
#[derive(Debug)]
pub struct GatherPart {
    pub key: TapKey,
    pub n_rows: usize,
    pub data: Vec<f32>,
}

/// One rank's copies from one phase.
#[derive(Debug)]
pub struct RankTaps<'p> {
    plan: &'p TapPlan,
    rank_idx: usize,
    layer: Option<u32>,
    pub records: Vec<Recorded>,
    pub gathers: Vec<GatherPart>,
}

impl<'p> RankTaps<'p> {
    pub fn new(plan: &'p TapPlan, rank_idx: usize, layer: Option<usize>) -> Self {
        RankTaps {
            plan,
            rank_idx,
            layer: layer.map(|l| l as u32),
            records: Vec::new(),
            gathers: Vec::new(),
        }
    }

    fn key(&self, site: Site, ranked: bool) -> TapKey {
        TapKey {
            layer: self.layer,
            site,
            rank: ranked.then_some(self.rank_idx as u32),
        }
    }

    /// True when either form of `site` is wanted (e.g. to fill an output buffer with the canary).
    pub fn wants_site(&self, site: Site) -> bool {
        self.plan.wants(&self.key(site, true)) || self.plan.wants(&self.key(site, false))
    }

    /// True when some form of `site` will be recorded from this rank (the ranked form, or the
    /// unranked one where this rank contributes to it).
    fn records_site(&self, site: Site, how: Emit) -> bool {
        self.plan.wants(&self.key(site, true))
            || (self.plan.wants(&self.key(site, false))
                && match how {
                    Emit::Replicated => self.rank_idx == 0,
                    Emit::Column => true,
                    Emit::Partial => false,
                })
    }

    /// [`RankTaps::emit`] for a backend buffer: downloaded only when a form of `site` is wanted
    /// (the copy is made now, so later in-place ops do not change what is recorded).
    pub fn emit_buf(&mut self, be: &dyn Backend, site: Site, data: &Buf, width: usize, how: Emit) {
        if self.records_site(site, how) {
            let host = be.download(data);
            self.emit(site, &host, width, how);
        }
    }

    /// Copies `data` (`[n_rows, width]`) for whichever forms of `site` are wanted.
    pub fn emit(&mut self, site: Site, data: &[f32], width: usize, how: Emit) {
        let n_rows = data.len().checked_div(width).unwrap_or(0);
        let ranked = self.key(site, true);
        if self.plan.wants(&ranked) {
            self.records.push(Recorded {
                key: ranked,
                shape: [n_rows, width],
                data: data.to_vec(),
            });
        }
        let unranked = self.key(site, false);
        if !self.plan.wants(&unranked) {
            return;
        }
        match how {
            Emit::Replicated if self.rank_idx == 0 => self.records.push(Recorded {
                key: unranked,
                shape: [n_rows, width],
                data: data.to_vec(),
            }),
            Emit::Column => self.gathers.push(GatherPart {
                key: unranked,
                n_rows,
                data: data.to_vec(),
            }),
            _ => {}
        }
    }
}

/// Concatenates `[n, w_r]` column slices in rank order into `[n, Σ w_r]`.
pub fn gather_columns(parts: &[&[f32]], n_rows: usize) -> (Vec<f32>, usize) {
    let widths: Vec<usize> = parts.iter().map(|p| p.len().checked_div(n_rows).unwrap_or(0)).collect();
    let total: usize = widths.iter().sum();
    let mut out = Vec::with_capacity(n_rows * total);
    for row_idx in 0..n_rows {
        for (p, &w) in parts.iter().zip(&widths) {
            out.extend_from_slice(&p[row_idx * w..(row_idx + 1) * w]);
        }
    }
    (out, total)
}

/// Records the ranks' copies in rank order, then the gathered unranked forms.
pub fn flush(tap: &mut dyn Tap, ranks: Vec<RankTaps<'_>>) {
    let mut gathers: Vec<(TapKey, usize, Vec<Vec<f32>>)> = Vec::new();
    for rt in ranks {
        for r in rt.records {
            tap.record_owned(&r.key, r.data, r.shape);
        }
        for g in rt.gathers {
            match gathers.iter_mut().find(|(k, _, _)| *k == g.key) {
                Some((_, _, parts)) => parts.push(g.data),
                None => gathers.push((g.key, g.n_rows, vec![g.data])),
            }
        }
    }
    for (key, n_rows, parts) in gathers {
        let refs: Vec<&[f32]> = parts.iter().map(|p| p.as_slice()).collect();
        let (data, width) = gather_columns(&refs, n_rows);
        tap.record_owned(&key, data, [n_rows, width]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use references::tap::{CollectTap, NoTap};

    #[test]
    fn a_tap_that_wants_nothing_plans_nothing_and_others_are_asked() {
        assert!(TapPlan::build(&NoTap, 4, 2).is_empty());
        // The same answer without the shortcut (a filter that refuses every key).
        assert!(TapPlan::build(&CollectTap::new(|_: &TapKey| false), 4, 2).is_empty());
        let want = TapKey::ranked(3, Site::AttnOut, 1);
        let plan = TapPlan::build(&CollectTap::new(move |k: &TapKey| *k == want), 4, 2);
        assert!(plan.wants(&want) && !plan.wants(&TapKey::ranked(2, Site::AttnOut, 1)));
    }
}
