//! `diff-layers` core: join engine and reference taps on the key as they arrive, compare each,
//! find the first divergence in execution order, isolate the op there, and classify the fault.

use crate::capture::{lockstep, progress, Captured, Side, StitchTap};
use crate::compare::{metrics, ActDtype, Tolerances};
use crate::diagnose::{diagnose, DiagContext};
use crate::layer_range::LayerRange;
use crate::local_rows::RowSample;
use crate::noise::{head_bound, local_bound_sum};
use crate::selection::{compare_rows, compare_taps, Noise, Rule};
use crate::slice::{
    engine_full, is_partial_sum, reference_part, reference_slice, reference_weight_rows, weight_shard_shape, Store,
};
use crate::weight_rows::WeightSampling;
use anyhow::bail;
use engine::{Engine, EngineOptions};
use references::config::ModelConfig;
use references::forward::replay::Replayed;
use references::forward::Reference;
use references::tap::{rank_columns, Site, TapKey};
use references::GgufFile;
use reports::{
    DiffRun, DtypeInfo, HeadLocal, HeadProfile, LocalError, Location, Metrics, RoutingAgreement, TapRow, Timings,
    DIFF_FORMAT,
};
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;
use std::time::Instant;

/// What to diff.
pub struct DiffPlan<'a> {
    pub file: &'a GgufFile,
    pub model_name: String,
    pub tokens: Vec<u32>,
    /// The engine's options: TP degree, backend (cpu or cuda), faults.
    pub engine: EngineOptions,
    pub tolerances: Tolerances,
    pub dtype: ActDtype,
    pub stop_at_first: bool,
    /// Run the last `decode_steps` tokens through the engine's decode path (KV cache), one at a
    /// time, instead of the prefill. The engine's taps are then stitched row by row.
    pub decode_steps: usize,
    pub repro: String,
    /// Compare every row of the weight taps (`--full-weights`) instead of a sample of rows per
    /// shard ([`crate::weight_rows`]).
    pub full_weights: bool,
}

/// A replay on a sample of rows, with the sample.
type SampledReplay = (Rc<RowSample>, Rc<Replayed>);

struct Comparator<'a> {
    plan: &'a DiffPlan<'a>,
    config: &'a ModelConfig,
    reference: &'a Reference<'a>,
    /// The dtype the noise model assumes (the plan's, or the dump's).
    dtype: ActDtype,
    /// Rows compared end to end whose verdict waits for their layer to be complete on both
    /// sides (the local error needs the layer's inputs), as (key, row index).
    pending: Vec<(TapKey, usize)>,
    /// Replays by unranked key (None: not replayable), dropped with their layer.
    replays: HashMap<TapKey, Option<Rc<Replayed>>>,
    /// Replays on a sample of token rows (see [`crate::local_rows`]), with the sample.
    sampled: HashMap<TapKey, Option<SampledReplay>>,
    /// Seconds spent in replays.
    /// At the first divergence (when decided by the local rule): the replay, sliced like the
    /// tap, and the per-head profile of an attention tap.
    first_local: Option<(TapKey, Vec<f32>, Option<HeadProfile>)>,
    eng: Store,
    refs: Store,
    waiting: Vec<TapKey>,
    rows: Vec<TapRow>,
    first_over: Option<TapKey>,
    /// The taps of the first divergent layer and the one before, kept for the diagnosis.
    frozen_eng: Store,
    frozen_ref: Store,
    compare_s: f64,
    /// Of `compare_s`: re-running reference ops on the engine's inputs (the local error).
    replay_s: f64,
    /// Per MoE layer: the lowest share of tokens with identical expert sets over its moe_topk taps.
    routing: BTreeMap<u32, f64>,
    /// Every key the reference emitted (for the candidate's `missing` list).
    ref_keys: Vec<TapKey>,
    /// Taps whose size differs from the reference's slice, as `key: engine [r, w] vs n values`.
    shape_errors: Vec<String>,
    /// The candidate's DSA indexer scores in its activations' dtype (the engine without
    /// `--indexer-fp8`): its `indexer_score` is held to that dtype's bound, not fp8's. False for
    /// a foreign dump, whose indexer may score in fp8.
    indexer_exact: bool,
    /// The last `full` DSA indexer layer's scores the selection rule read (a `shared` layer
    /// reuses them), and whether they were replayed on the candidate's inputs.
    indexer_scores: Option<(usize, Rc<Vec<f32>>, &'static str)>,
    /// A candidate's declared column ranges (format 2 `sharded`), used instead of `rank_columns`.
    slices: BTreeMap<TapKey, std::ops::Range<usize>>,
    /// Unranked weight keys some engine tap diverged at: the reference's weight is kept.
    kept_weights: std::collections::HashSet<TapKey>,
}

impl<'a> Comparator<'a> {
    fn new(plan: &'a DiffPlan<'a>, config: &'a ModelConfig, reference: &'a Reference<'a>, dtype: ActDtype) -> Self {
        Comparator {
            plan,
            config,
            reference,
            dtype,
            pending: Vec::new(),
            replays: HashMap::new(),
            sampled: HashMap::new(),
            first_local: None,
            eng: Store::new(),
            refs: Store::new(),
            waiting: Vec::new(),
            rows: Vec::new(),
            first_over: None,
            frozen_eng: Store::new(),
            frozen_ref: Store::new(),
            compare_s: 0.0,
            replay_s: 0.0,
            routing: BTreeMap::new(),
            ref_keys: Vec::new(),
            shape_errors: Vec::new(),
            indexer_scores: None,
            slices: BTreeMap::new(),
            kept_weights: Default::default(),
            indexer_exact: false,
        }
    }

    /// The reference's part for `key`: the declared range where the candidate gave one.
    fn slice_of<'c>(&self, key: &TapKey, full: &'c Captured) -> std::borrow::Cow<'c, [f32]> {
        match self.slices.get(key) {
            Some(r) if r.end <= full.shape[1] => crate::compare::columns(&full.data, full.shape[1], r.clone()).into(),
            _ => reference_part(self.config, self.plan.engine.tp, key, full),
        }
    }

    fn on_tap(&mut self, side: Side, c: Captured) -> bool {
        let t0 = Instant::now();
        let key = c.key;
        match side {
            Side::Engine => {
                self.eng.insert(key, c);
                if is_partial_sum(&key) {
                    // Kept for the missing-reduction check, never compared to a slice.
                } else if self.refs.contains_key(&key.unranked()) {
                    self.compare(&key);
                } else {
                    self.waiting.push(key);
                }
            }
            Side::Reference => {
                self.ref_keys.push(key);
                self.refs.insert(key, c);
                let ready: Vec<TapKey> = self.waiting.iter().filter(|k| k.unranked() == key).copied().collect();
                self.waiting.retain(|k| k.unranked() != key);
                for k in ready {
                    self.compare(&k);
                }
            }
        }
        self.evict();
        self.compare_s += t0.elapsed().as_secs_f64();
        // With --stop-at-first, stop once the reference has moved a layer past the divergence, so
        // every earlier tap has been compared.
        match (self.plan.stop_at_first, self.first_over) {
            (true, Some(k)) => {
                let r_at = self.refs.keys().map(progress).max().unwrap_or(0);
                r_at <= progress(&k)
            }
            _ => true,
        }
    }

    fn compare(&mut self, key: &TapKey) {
        let e = &self.eng[key];
        let r = &self.refs[&key.unranked()];
        let sampled = matches!(key.site, Site::Weight(_)) && (e.rows.is_some() || r.rows.is_some());
        let (want, shape_error) = if sampled {
            // A weight on a sample of rows: its whole shape is checked, then the rows compared.
            let (config, tp) = (self.config, self.plan.engine.tp);
            let shard = weight_shard_shape(config, tp, key, r.shape);
            let want = (e.shape == shard)
                .then(|| reference_weight_rows(config, tp, key, e.rows.as_deref(), r))
                .flatten()
                .filter(|w| w.len() == e.data.len());
            let why = format!("{key} is {:?} where the reference's shard is {shard:?}", e.shape);
            (want.map(std::borrow::Cow::Owned), why)
        } else {
            let want = self.slice_of(key, r);
            let why = format!(
                "{key} is {:?} where the reference's is {} values ({} per token)",
                e.shape,
                want.len(),
                want.len() / e.shape[0].max(1)
            );
            (Some(want).filter(|w| w.len() == e.data.len()), why)
        };
        let m = if let Some(want) = &want {
            metrics(&e.data, want)
        } else {
            self.shape_errors.push(shape_error);
            Metrics {
                cosine: 0.0,
                rel_l2: f64::INFINITY,
                max_abs: f64::INFINITY,
                nmse: f64::INFINITY,
                sqnr_db: f64::NEG_INFINITY,
                nonfinite: 0,
                canary_left: 0.0,
            }
        };
        if let (Site::MoeTopk, Some(layer)) = (key.site, key.layer) {
            let agree = routing_agreement(&e.data, want.as_deref().unwrap_or(&[]), e.shape[1]);
            let slot = self.routing.entry(layer).or_insert(agree);
            *slot = slot.min(agree);
        }
        let threshold = self.e2e_threshold(key);
        // NaN rel_l2 counts as over.
        let over = m.rel_l2.is_nan() || m.rel_l2 > threshold || m.canary_left > 0.0;
        self.pending.push((*key, self.rows.len()));
        self.rows.push(TapRow {
            tap: key.to_string(),
            layer: key.layer,
            site: key.site.name(),
            rank: key.rank,
            shape: e.shape,
            metrics: m,
            threshold,
            over: false,
            over_end_to_end: over,
            local: None,
            selection: None,
        });
        if matches!(key.site, Site::Weight(_)) {
            // A weight's verdict is end to end and final here (no replay reads it): an agreeing
            // one is dropped now rather than held for three layers; a divergent one is kept, with
            // the reference's, for the diagnosis.
            if over {
                self.kept_weights.insert(key.unranked());
            } else {
                self.eng.remove(key);
            }
        }
    }

    /// The end-to-end threshold: a user override, else the dtype's column (raised to a healthy
    /// baseline's end-to-end error × margin where one was given).
    fn e2e_threshold(&self, key: &TapKey) -> f64 {
        let t = &self.plan.tolerances;
        t.user(key).unwrap_or_else(|| {
            let base = t.threshold(key, self.dtype);
            match t.baseline(key) {
                Some(b) if !matches!(key.site, Site::Weight(_) | Site::MoeTopk) => {
                    base.max(crate::compare::BASELINE_MARGIN * b.end_to_end)
                }
                _ => base,
            }
        })
    }

    /// Progress capped at the output (the output taps count as one step after the last layer).
    fn capped(&self, key: &TapKey) -> u64 {
        progress(key).min(self.config.n_layers as u64 + 1)
    }

    /// The reference op of `key` (unranked) re-run on the candidate's captured inputs, once.
    fn replay(&mut self, key: &TapKey) -> Option<Rc<Replayed>> {
        let full = key.unranked();
        if let Some(r) = self.replays.get(&full) {
            return r.clone();
        }
        let t0 = Instant::now();
        let r = if full.site == Site::Embed {
            // No float inputs: the reference's own lookup is the op's answer.
            self.refs.get(&full).map(|c| {
                Rc::new(Replayed {
                    out: c.data.clone(),
                    rho: 1.0,
                    rho_sum: 0.0,
                    rho_heads: Vec::new(),
                    rows: None,
                    reduction: 0,
                })
            })
        } else {
            let (config, tp, eng) = (self.config, self.plan.engine.tp, &self.eng);
            let inputs = |k: &TapKey| engine_full(config, tp, eng, k);
            let n = self.plan.tokens.len();
            // A replay that fails (a weight the file lacks) leaves the end-to-end rule.
            self.reference
                .replay_local(&full, &inputs, n)
                .ok()
                .flatten()
                .map(Rc::new)
        };
        self.replays.insert(full, r.clone());
        self.replay_s += t0.elapsed().as_secs_f64();
        r
    }

    /// The replay of `key` (unranked) on a sample of token rows chosen from its end-to-end
    /// errors, once; `None` where every row is to be replayed (few rows, the embedding, an op
    /// that cannot be replayed on a subset) or the op is not replayable.
    fn replay_sampled(&mut self, key: &TapKey) -> Option<SampledReplay> {
        let full = key.unranked();
        if let Some(r) = self.sampled.get(&full) {
            return r.clone();
        }
        let t0 = Instant::now();
        let (config, tp, eng) = (self.config, self.plan.engine.tp, &self.eng);
        let n = self.plan.tokens.len();
        let block = match (&config.mla, full.site) {
            (None, Site::Q | Site::K | Site::V | Site::AttnOut) => config.head_dim,
            _ => 0,
        };
        // Cache taps are not [n, width]: replayed whole.
        let r = (!matches!(full.site, Site::Embed | Site::KvCacheK | Site::KvCacheV))
            .then(|| Some((engine_full(config, tp, eng, &full)?, self.refs.get(&full)?)))
            .flatten()
            .and_then(|(e, r)| crate::local_rows::choose(&e, &r.data, n, block))
            .and_then(|sample| {
                let inputs = |k: &TapKey| engine_full(config, tp, eng, k);
                let rep = self
                    .reference
                    .replay_rows(&full, &inputs, n, &sample.rows)
                    .ok()
                    .flatten()?;
                rep.rows.is_some().then(|| (Rc::new(sample), Rc::new(rep)))
            });
        self.replay_s += t0.elapsed().as_secs_f64();
        self.sampled.insert(full, r.clone());
        r
    }

    /// Whether every tap's local error is computed (below f32, or with a baseline), not only
    /// those above the f32 floor.
    fn every_tap(&self) -> bool {
        self.dtype != ActDtype::F32 || self.plan.tolerances.has_baseline()
    }

    /// Decides the pending rows whose layer (capped progress) is at most `upto`, in key order.
    fn settle(&mut self, upto: u64) {
        let mut ready: Vec<(TapKey, usize)> = Vec::new();
        let cap = self.config.n_layers as u64 + 1;
        self.pending.retain(|&(k, i)| {
            if progress(&k).min(cap) <= upto {
                ready.push((k, i));
                false
            } else {
                true
            }
        });
        ready.sort();
        for (key, i) in ready {
            self.decide(&key, i);
        }
    }

    /// The verdict of one row: a canary, a non-finite value or a shape error is over; a tap whose
    /// op can be re-run on the candidate's inputs is over when its end-to-end rel_l2 exceeds the
    /// f32 floor and its local error exceeds its bound; any other tap keeps the end-to-end rule.
    fn decide(&mut self, key: &TapKey, i: usize) {
        let m = self.rows[i].metrics.clone();
        let hard = m.canary_left > 0.0 || m.nonfinite > 0 || !m.rel_l2.is_finite();
        // A DSA selection is judged by the selection rule, not by rel_l2 on index values.
        if !hard && key.site == Site::IndexerTopk {
            if let Some(v) = self.judge_indexer(key) {
                let over = !v.agrees;
                self.rows[i].selection = Some(v);
                self.rows[i].over = over;
                if over && self.first_over.is_none_or(|f| *key < f) {
                    self.first_over = Some(*key);
                    self.first_local = None;
                }
                return;
            }
        }
        let gate = self.plan.tolerances.floor(key);
        // At f32 without a baseline, a tap under the floor cannot be over and a tap after the
        // first divergence cannot be first: their replays are skipped (the old cost).
        let every_tap = self.every_tap();
        let needed = every_tap || (m.rel_l2 > gate && self.first_over.is_none_or(|f| *key < f));
        let wants_local = !hard && !matches!(key.site, Site::Weight(_)) && !is_partial_sum(key) && needed;
        let mut local_over = None;
        let mut detail = None;
        if wants_local {
            if let Some((local, over, slice, profile)) = self.local_error(key) {
                local_over = Some(over);
                detail = Some((slice, profile));
                self.rows[i].local = Some(local);
            }
        }
        // Expert ids whose op cannot be re-run on the candidate's router logits: the selection
        // rule on the reference's routing scores (a near-tie flip is not a divergence).
        if !hard && local_over.is_none() && key.site == Site::MoeTopk {
            self.rows[i].selection = self.judge_routing(key);
        }
        let over = if hard {
            true
        } else {
            match (local_over, &self.rows[i].selection) {
                (Some(o), _) => o && m.rel_l2 > gate,
                (None, Some(sel)) => !sel.agrees,
                (None, None) => self.rows[i].over_end_to_end,
            }
        };
        self.rows[i].over = over;
        if over && self.first_over.is_none_or(|f| *key < f) {
            self.first_over = Some(*key);
            self.first_local = detail.map(|(slice, profile)| (*key, slice, profile));
        }
    }

    /// The selection rule at a DSA `indexer_topk` tap: the candidate's keys against the indexer's
    /// scores of the layer's `full` layer, re-run on the candidate's attn_norm and q_a where the
    /// dump has them (else the reference's own), with fp8 scoring noise.
    fn judge_indexer(&mut self, key: &TapKey) -> Option<reports::SelectionVerdict> {
        let l = key.layer? as usize;
        let ix = self.config.indexer.as_ref()?;
        let top_k = ix.top_k;
        let full = (0..=l).rev().find(|&j| ix.full.get(j).copied().unwrap_or(true))?;
        let (scores, src) = match &self.indexer_scores {
            Some((f, s, src)) if *f == full => (s.clone(), *src),
            _ => {
                let sk = TapKey::layer(full, Site::IndexerScore);
                let got = match self.replay(&sk) {
                    Some(r) => (Rc::new(r.out.clone()), "replayed"),
                    None => (Rc::new(self.refs.get(&sk)?.data.clone()), "reference"),
                };
                self.indexer_scores = Some((full, got.0.clone(), got.1));
                got
            }
        };
        let n = self.plan.tokens.len();
        // A rank's copy is the whole selection (every rank runs the replicated indexer).
        let e = self.eng.get(key)?;
        if scores.len() != n * n || e.data.len() != n * top_k {
            return None;
        }
        let rule = Rule::default();
        Some(compare_taps(&scores, &e.data, n, top_k, &rule).verdict(&rule, src))
    }

    /// The selection rule at a `moe_topk` tap: the candidate's expert ids against the routing
    /// scores of the router logits (re-run on the candidate's ffn_norm where it has it, else the
    /// reference's), with the candidate's noise: the router logits' error (local where replayed,
    /// else end to end) or 4 unit roundoffs of its dtype, whichever is larger.
    fn judge_routing(&mut self, key: &TapKey) -> Option<reports::SelectionVerdict> {
        let l = key.layer? as usize;
        let lk = TapKey::layer(l, Site::MoeLogits);
        let (logits, src) = match self.replay(&lk) {
            Some(r) => (r.out.clone(), "replayed"),
            None => (self.refs.get(&lk)?.data.clone(), "reference"),
        };
        let rows = self.reference.routing_choice_scores(l, &logits).ok().flatten()?;
        let e = self.eng.get(key).filter(|_| key.rank.is_none())?;
        let k = e.shape[1].max(1);
        let chosen: Vec<Vec<usize>> = e
            .data
            .chunks(k)
            .map(|r| {
                r.iter()
                    .map(|&v| {
                        if v >= 0.0 && v.fract() == 0.0 {
                            v as usize
                        } else {
                            usize::MAX
                        }
                    })
                    .collect()
            })
            .collect();
        let name = lk.to_string();
        let logit_err = self
            .rows
            .iter()
            .find(|r| r.tap == name)
            .and_then(|r| match (src, &r.local) {
                ("replayed", Some(local)) => Some(local.rel_l2),
                ("replayed", None) => None,
                _ => Some(r.metrics.rel_l2),
            });
        let rel = (4.0 * self.dtype.unit_roundoff()).max(logit_err.filter(|v| v.is_finite()).unwrap_or(0.0));
        let rule = Rule {
            noise: Noise { abs: 0.0, rel },
            ..Rule::default()
        };
        Some(compare_rows(&rows, &chosen, k, &rule).verdict(&rule, src))
    }

    /// The local error of `key` against its replay: (the row's entry, whether it is over, the
    /// replay sliced like the tap, the per-head profile at an attention tap).
    fn local_error(&mut self, key: &TapKey) -> Option<(LocalError, bool, Vec<f32>, Option<HeadProfile>)> {
        if self.every_tap() {
            if let Some(local) = self.sampled_local_error(key) {
                return Some((local, false, Vec::new(), None));
            }
        }
        let rep = self.replay(key)?;
        let e = self.eng.get(key)?;
        let n = self.plan.tokens.len();
        if n == 0 || rep.out.len() % n != 0 {
            return None;
        }
        let full = Captured::whole(key.unranked(), [n, rep.out.len() / n], rep.out.clone());
        let want = self.slice_of(key, &full).into_owned();
        if want.len() != e.data.len() {
            return None;
        }
        let lm = metrics(&e.data, &want);
        let tp = self.plan.engine.tp;
        let all_reduced = tp > 1 && matches!(key.site, Site::AttnProj | Site::FfnOut);
        let rho = rep.rho + if all_reduced { rep.rho_sum } else { 0.0 };
        let tol = &self.plan.tolerances;
        // Production indexers score in fp8 whatever the activations' dtype (the engine only
        // with --indexer-fp8).
        let bound_dtype = if key.site == Site::IndexerScore && !self.indexer_exact {
            ActDtype::Fp8E4m3
        } else {
            self.dtype
        };
        let b = local_bound_sum(tol, key, bound_dtype, rho, rep.rho_sum, rep.reduction);
        let mut over = lm.rel_l2.is_nan() || lm.rel_l2 > b.value;
        let profile = self.head_profile(key, &e.data, &want, &rep, e.shape[1]);
        if let Some(p) = &profile {
            over |= p.heads.iter().any(|h| h.rel_l2.is_nan() || h.rel_l2 > h.bound);
        }
        let local = LocalError {
            rel_l2: lm.rel_l2,
            bound: b.value,
            rho,
            source: b.source.to_string(),
            rows: None,
            heads: profile.as_ref().map_or_else(Vec::new, |p| p.heads.clone()),
        };
        Some((local, over, want, profile))
    }

    /// The local error of `key` estimated on a sample of rows, when that estimate is clearly
    /// under its bound (below [`crate::local_rows::ESCALATE`] × the bound, in total and at every
    /// head of an attention tap); `None` sends the tap to the full replay.
    fn sampled_local_error(&mut self, key: &TapKey) -> Option<LocalError> {
        let (sample, rep) = self.replay_sampled(key)?;
        let e = self.eng.get(key)?;
        let n = self.plan.tokens.len();
        let rows = sample.rows.len();
        if rows == 0 || rep.out.len() % rows != 0 {
            return None;
        }
        let full = Captured::whole(key.unranked(), [rows, rep.out.len() / rows], rep.out.clone());
        let want = reference_slice(self.config, self.plan.engine.tp, key, &full);
        let mine = references::forward::replay::select_rows(&e.data, n, &sample.rows);
        let width = e.shape[1];
        if want.len() != mine.len() || mine.len() != rows * width {
            return None;
        }
        let w = &sample.weights;
        let est = crate::local_rows::weighted_rel_l2(&mine, &want, width, 0..width, w);
        let tp = self.plan.engine.tp;
        let all_reduced = tp > 1 && matches!(key.site, Site::AttnProj | Site::FfnOut);
        let rho = rep.rho + if all_reduced { rep.rho_sum } else { 0.0 };
        let tol = &self.plan.tolerances;
        let b = local_bound_sum(tol, key, self.dtype, rho, rep.rho_sum, rep.reduction);
        let clear = |x: f64, bound: f64| x.is_finite() && x <= crate::local_rows::ESCALATE * bound;
        if !clear(est, b.value) {
            return None;
        }
        let c = self.config;
        let mut heads = Vec::new();
        if c.mla.is_none() && matches!(key.site, Site::Q | Site::K | Site::V | Site::AttnOut) {
            let hd = c.head_dim;
            if hd == 0 || width % hd != 0 {
                return None;
            }
            let offset = key
                .rank
                .and_then(|r| rank_columns(key.site, c, tp, r as usize))
                .map_or(0, |cols| cols.start / hd);
            for h in 0..width / hd {
                let rel = crate::local_rows::weighted_rel_l2(&mine, &want, width, h * hd..(h + 1) * hd, w);
                let rho_h = rep.rho_heads.get(offset + h).copied().unwrap_or(rep.rho);
                let bound = head_bound(tol, key, self.dtype, rho_h, offset + h).value;
                if !clear(rel, bound) {
                    return None;
                }
                heads.push(HeadLocal {
                    head: offset + h,
                    rel_l2: rel,
                    bound,
                    scale: crate::local_rows::weighted_scale(&mine, &want, width, h * hd..(h + 1) * hd, w),
                });
            }
        }
        Some(LocalError {
            rel_l2: est,
            bound: b.value,
            rho,
            source: b.source.to_string(),
            rows: Some(rows),
            heads,
        })
    }

    /// Per-head local errors at a llama attention tap (q, k, v, attn_out): each head's rel_l2,
    /// bound (its own rho where the replay gives one) and fitted scale.
    fn head_profile(
        &self,
        key: &TapKey,
        eng: &[f32],
        want: &[f32],
        rep: &Replayed,
        width: usize,
    ) -> Option<HeadProfile> {
        let c = self.config;
        if c.mla.is_some() || !matches!(key.site, Site::Q | Site::K | Site::V | Site::AttnOut) {
            return None;
        }
        let hd = c.head_dim;
        if hd == 0 || width % hd != 0 {
            return None;
        }
        let n_heads = width / hd;
        let offset = self
            .slices
            .get(key)
            .cloned()
            .or_else(|| {
                key.rank
                    .and_then(|r| rank_columns(key.site, c, self.plan.engine.tp, r as usize))
            })
            .map_or(0, |cols| cols.start / hd);
        let mut heads = Vec::with_capacity(n_heads);
        for h in 0..n_heads {
            let cols = h * hd..(h + 1) * hd;
            let a = crate::compare::columns(eng, width, cols.clone());
            let b = crate::compare::columns(want, width, cols);
            let hm = metrics(&a, &b);
            let (ab, bb) = a.iter().zip(&b).fold((0f64, 0f64), |(x, y), (&p, &q)| {
                (x + p as f64 * q as f64, y + q as f64 * q as f64)
            });
            let rho = rep.rho_heads.get(offset + h).copied().unwrap_or(rep.rho);
            let head = offset + h;
            heads.push(HeadLocal {
                head,
                rel_l2: hm.rel_l2,
                bound: head_bound(&self.plan.tolerances, key, self.dtype, rho, head).value,
                scale: if bb > 0.0 { ab / bb } else { f64::NAN },
            });
        }
        Some(HeadProfile {
            tap: key.to_string(),
            heads,
        })
    }

    /// The divergent weight `key`'s kept taps back whole ([`crate::weight_rows::unsample`]).
    fn whole_weights(&mut self, key: &TapKey, engine: &dyn Fn(&TapKey) -> Option<Captured>) {
        crate::slice::unsample(key, self.reference, &mut self.frozen_eng, &mut self.frozen_ref, engine);
    }

    /// Decides every row left (both sides are done).
    fn settle_all(&mut self) {
        self.evict();
        self.settle(u64::MAX);
        self.freeze();
    }

    /// Keeps the taps of the first divergent layer and the one before it for the diagnosis.
    fn freeze(&mut self) {
        if let Some(first) = self.first_over {
            let lo = progress(&first).saturating_sub(1);
            let window = |k: &TapKey| (lo..=progress(&first)).contains(&progress(k));
            for (k, v) in self.eng.iter().filter(|(k, _)| window(k)) {
                self.frozen_eng.entry(*k).or_insert_with(|| v.clone());
            }
            for (k, v) in self.refs.iter().filter(|(k, _)| window(k)) {
                self.frozen_ref.entry(*k).or_insert_with(|| v.clone());
            }
        }
    }

    /// Decides the rows of every layer complete on both sides, then drops taps more than three
    /// layers behind both sides (their layer and its inputs are decided by then), freezing the
    /// divergent window first.
    fn evict(&mut self) {
        let e_at = self.eng.keys().map(|k| self.capped(k)).max().unwrap_or(0);
        let r_at = self.refs.keys().map(|k| self.capped(k)).max().unwrap_or(0);
        let level = e_at.min(r_at);
        if level >= 2 {
            self.settle(level - 2);
        }
        self.freeze();
        let keep_from = level.saturating_sub(3);
        let waiting = &self.waiting;
        let cap = self.config.n_layers as u64 + 1;
        self.eng
            .retain(|k, _| progress(k).min(cap) >= keep_from || waiting.contains(k));
        // A reference weight is compared by the time the engine has moved past its layer (an
        // engine taps its layer's weights first).
        let kept = &self.kept_weights;
        self.refs.retain(|k, _| {
            progress(k).min(cap) >= keep_from
                && (!matches!(k.site, Site::Weight(_)) || progress(k) >= e_at || kept.contains(k))
        });
        self.replays.retain(|k, _| progress(k).min(cap) >= keep_from);
        self.sampled.retain(|k, _| progress(k).min(cap) >= keep_from);
    }
}

/// The reference, cut to the engine's `n_layers` when it has one (the first N layers, then the
/// output norm and head), or to a layer range's end.
fn truncated_reference<'a>(plan: &DiffPlan<'a>, range: Option<&LayerRange>) -> anyhow::Result<Reference<'a>> {
    let mut reference = Reference::new(plan.file)?;
    if let Some(r) = range {
        if plan.engine.n_layers.is_some() || r.layers.end > reference.config.n_layers {
            bail!(
                "--layers takes no --n-layers and ends at the model's {} layers",
                reference.config.n_layers
            );
        }
        reference.config.n_layers = r.layers.end;
    }
    if let Some(n) = plan.engine.n_layers {
        if n == 0 || n > reference.config.n_layers {
            bail!("--n-layers {n}: the model has {} layers", reference.config.n_layers);
        }
        reference.config.n_layers = n;
    }
    Ok(reference)
}

/// Which weight rows both sides are asked for: a sample per shard, or every row
/// (`full_weights`).
fn weight_sampling(plan: &DiffPlan, config: &ModelConfig) -> WeightSampling {
    WeightSampling {
        full: plan.full_weights,
        tp: plan.engine.tp,
        config: config.clone(),
    }
}

/// Runs the diff and builds the run document.
pub fn run_diff(plan: &DiffPlan) -> anyhow::Result<DiffRun> {
    run_diff_against(plan, plan.file)
}

/// Runs the diff with the engine loading `engine_file` while the reference reads `plan.file`:
/// a perturbed copy of the weights (same shapes) against the original, to measure what size of
/// change the taps can still localize.
pub fn run_diff_against(plan: &DiffPlan, engine_file: &GgufFile) -> anyhow::Result<DiffRun> {
    run_diff_inner(plan, engine_file, None)
}

/// Runs the diff over a layer range only (`--layers A..B`, see [`crate::layer_range`]): both
/// sides start at layer A from the range's residual.
pub fn run_diff_range(plan: &DiffPlan, range: &LayerRange) -> anyhow::Result<DiffRun> {
    run_diff_inner(plan, plan.file, Some(range))
}

fn run_diff_inner(plan: &DiffPlan, engine_file: &GgufFile, range: Option<&LayerRange>) -> anyhow::Result<DiffRun> {
    let t0 = Instant::now();
    // A fault that does not apply is refused before the reference runs.
    engine::check_faults(engine_file, &plan.engine)?;
    let reference = truncated_reference(plan, range)?;
    if range.is_some() && plan.decode_steps > 0 {
        bail!("--decode-steps with --layers is not supported: the range's K/V cache would need the prefill from its first layer; diff the prefill");
    }
    // Counted from here: the reference's pass to the range's residual reads weights too.
    let bytes0 = references::forward::weight_bytes_read();
    let residuals = match range {
        Some(r) => r.residuals(engine_file, &reference, &plan.tokens, &plan.engine)?,
        None => Default::default(),
    };
    let opts = range.map_or_else(|| plan.engine.clone(), |r| r.engine_options(&plan.engine));
    let config = reference.config.clone();
    let tokens = &plan.tokens;
    // The engine's --compute-dtype names the dtype; a plan's explicit one wins.
    let (dtype, dtype_source) = match (plan.dtype, plan.engine.compute_dtype) {
        (ActDtype::F32, engine::ComputeDtype::F32) => (ActDtype::F32, "default"),
        (ActDtype::F32 | ActDtype::Half, engine::ComputeDtype::Bf16) => (ActDtype::Bf16, "engine options"),
        (ActDtype::F32 | ActDtype::Half, engine::ComputeDtype::F16) => (ActDtype::F16, "engine options"),
        (d, _) => (d, "given"),
    };
    let n_prefill = tokens
        .len()
        .checked_sub(plan.decode_steps)
        .filter(|&p| p > 0)
        .ok_or_else(|| {
            anyhow::anyhow!(
                "--decode-steps {} leaves no prompt tokens for the prefill ({} tokens)",
                plan.decode_steps,
                tokens.len()
            )
        })?;
    let mut cmp = Comparator::new(plan, &config, &reference, dtype);
    cmp.indexer_exact = !plan.engine.indexer_fp8;
    let sampling = weight_sampling(plan, &config);
    let (e, r, d) = lockstep(
        &sampling,
        // The engine loads on its own thread while the reference is already running (its taps
        // wait in the comparator for the engine's); it comes back for the diagnosis.
        |tap| -> Result<(Engine, f64), engine::EngineError> {
            let t_load = Instant::now();
            let mut engine = Engine::load(engine_file, opts)?;
            let load_s = t_load.elapsed().as_secs_f64();
            if engine.backend_name() != "cpu" {
                // Which cuda mode ran (real ranks over NCCL or simulated ranks on one GPU);
                // stderr, so that --json output stays one document.
                eprintln!("backend: {}", engine.backend_description());
            }
            if let Some(res) = &residuals.engine {
                residuals.record_entry(tap, Some(res), tokens.len());
                engine.prefill_from(tokens, res, tap)?;
            } else if n_prefill == tokens.len() {
                engine.prefill(tokens, tap)?;
            } else {
                let mut stitch = StitchTap::new(Some(sampling.clone()));
                engine.prefill(&tokens[..n_prefill], &mut stitch)?;
                for &t in &tokens[n_prefill..] {
                    engine.decode(t, &mut stitch)?;
                }
                stitch.replay(tap);
            }
            Ok((engine, load_s))
        },
        // The K/V cache each decode step read, as a correct cache holds it.
        |tap| {
            let mut tap = references::tap::DecodeCacheTap::new(tap, tokens.len(), n_prefill);
            residuals.record_entry(&mut tap, residuals.reference.as_ref(), tokens.len());
            let out = match range {
                Some(r) => reference.forward_span(tokens, r.span(residuals.reference.clone()), &mut tap),
                None => reference.forward(tokens, &mut tap),
            };
            out.map(|_| ())
        },
        |side, c| cmp.on_tap(side, c),
    );
    let (engine, engine_load_s) = e.result?;
    r.result?;
    // Every row's verdict before asking the engine for its config at the divergence.
    cmp.settle_all();
    if let Some(k) = cmp.first_over {
        cmp.whole_weights(&k, &|key: &TapKey| {
            let (Some(layer), Site::Weight(kind), Some(rank)) = (key.layer, key.site, key.rank) else {
                return None;
            };
            let (data, shape) = engine.weight_f32(layer as usize, kind, rank as usize)?;
            Some(Captured::whole(*key, shape, data))
        });
    }
    let engine_config = cmp
        .first_over
        .map(|k| engine.effective_config(k.layer.unwrap_or(0) as usize, k.rank.unwrap_or(0) as usize));
    let sides = Sides {
        backend: engine.backend_name().to_string(),
        engine_config,
        engine: (e.seconds, e.capture_s, e.wait_s),
        engine_load_s,
        reference: (r.seconds, r.capture_s, r.wait_s),
        compare_wait_s: d.wait_s,
        bytes0,
        n_prefill,
        t0,
        dtype_source,
    };
    let mut run = finish(plan, &reference, cmp, sides)?;
    run.layer_range = range.map(LayerRange::info);
    Ok(run)
}

/// Diffs a foreign engine's tensor dump (see [`crate::dump`]) against the reference on the dump's
/// tokens (`plan.tokens`, `plan.engine.tp` must be the dump's). The dump's tensors are fed, in execution
/// order, into the same comparator as the engine's taps; the run's backend is "candidate".
/// Reference activation taps the dump lacks are listed in `missing`; a tap whose width differs
/// from the reference's is a format error. There is no engine config, so config drift is not checked.
pub fn run_diff_candidate(plan: &DiffPlan, dump: &crate::dump::Dump) -> anyhow::Result<DiffRun> {
    run_diff_candidate_inner(plan, dump, None)
}

/// [`run_diff_candidate`] over a layer range: the reference starts at layer A from the range's
/// residual (by default the dump's own `blk.{A-1}.resid_out`), and only the dump's taps of the
/// range are compared.
pub fn run_diff_candidate_range(
    plan: &DiffPlan,
    dump: &crate::dump::Dump,
    range: &LayerRange,
) -> anyhow::Result<DiffRun> {
    run_diff_candidate_inner(plan, dump, Some(range))
}

fn run_diff_candidate_inner(
    plan: &DiffPlan,
    dump: &crate::dump::Dump,
    range: Option<&LayerRange>,
) -> anyhow::Result<DiffRun> {
    let t0 = Instant::now();
    let reference = truncated_reference(plan, range)?;
    let bytes0 = references::forward::weight_bytes_read();
    let config = reference.config.clone();
    // Keys, tokens and widths against the model before the reference runs (a range's dump
    // holds the whole model's taps).
    let mut whole = config.clone();
    if let Some(r) = range {
        whole.n_layers = r.total;
    }
    dump.check_model(&whole)?;
    let residual = match range {
        Some(r) => r.candidate_residual(dump, &reference, &plan.tokens)?,
        None => None,
    };
    let tokens = &plan.tokens;
    // The plan's dtype when the caller chose one, else the dump's (metadata, tensor dtypes, values).
    let (dtype, dtype_source) = if plan.dtype != ActDtype::F32 {
        (plan.dtype, "given")
    } else {
        dump.compute_dtype(&config)?
    };
    // Format 2: the ranks' configs against the reference's and each other's, before any tensor.
    let tp_config = (!dump.ranks.is_empty()).then(|| crate::layout::config_check(dump, &config));
    let mut cmp = Comparator::new(plan, &config, &reference, dtype);
    cmp.slices = dump.declared_slices.clone();
    let sampling = weight_sampling(plan, &config);
    let (e, r, d) = lockstep(
        &sampling,
        |tap| -> anyhow::Result<()> {
            for key in dump.keys() {
                if range.is_none_or(|r| r.keeps(key)) && tap.wants(key) {
                    let c = dump.tensor(key, &config)?;
                    if matches!(key.site, Site::Weight(_)) {
                        // A whole weight in a dump is sampled as the engine's are.
                        let width = c.shape[1];
                        references::tap::record_weight(tap, key, c.shape, |rows| match rows {
                            Some(rows) => references::tap::select_rows(&c.data, width, rows),
                            None => c.data,
                        });
                    } else {
                        tap.record(key, &c.data, c.shape);
                    }
                }
            }
            Ok(())
        },
        |tap| {
            let out = match range {
                Some(r) => reference.forward_span(tokens, r.span(residual.clone()), tap),
                None => reference.forward(tokens, tap),
            };
            out.map(|_| ())
        },
        |side, c| cmp.on_tap(side, c),
    );
    e.result?;
    r.result?;
    if let Some(bad) = cmp.shape_errors.first() {
        bail!("candidate dump: {bad} (wrong shape for this model)");
    }
    cmp.settle_all();
    if let Some(k) = cmp.first_over {
        cmp.whole_weights(&k, &|key: &TapKey| dump.tensor(key, &config).ok());
    }
    let have: std::collections::BTreeSet<TapKey> = dump.keys().map(|k| k.unranked()).collect();
    let missing: Vec<String> = cmp
        .ref_keys
        .iter()
        .filter(|k| !matches!(k.site, Site::Weight(_)) && !have.contains(k))
        .map(|k| k.to_string())
        .collect();
    let sides = Sides {
        backend: "candidate".to_string(),
        engine_config: Some(config.clone()),
        engine: (e.seconds, e.capture_s, e.wait_s),
        engine_load_s: 0.0,
        reference: (r.seconds, r.capture_s, r.wait_s),
        compare_wait_s: d.wait_s,
        bytes0,
        // A dump with decode steps: the prefill's rows, then one row per step.
        n_prefill: dump.n_prefill.unwrap_or(tokens.len()),
        t0,
        dtype_source,
    };
    let mut run = finish(plan, &reference, cmp, sides)?;
    run.missing = missing;
    run.layer_range = range.map(LayerRange::info);
    if let Some(cfg) = tp_config {
        crate::layout::apply(&mut run, dump, &reference, plan.file, &plan.tolerances, dtype, cfg)?;
    }
    if let Some(d) = run.diagnosis.as_mut() {
        if d.class == "stale-output" {
            // A dump has no canary: "never written" and "written as zeros" look the same.
            let at = run.first_divergence.as_ref().map_or("", |f| f.tap.as_str());
            d.explanation = format!(
                "every value of {at} is 0 in the dump while the reference's is not: the op's output was zeroed, or never written and read as a zero-initialized buffer (a dump carries no canary, so the two cannot be told apart); the op's inputs in the dump agree, so look at the op itself"
            );
        }
    }
    Ok(run)
}

/// What the engine side left for [`finish`].
struct Sides {
    backend: String,
    /// The engine's config at the first divergence (config drift), if it diverged.
    engine_config: Option<ModelConfig>,
    /// Each side's (seconds, capture seconds, wait seconds).
    engine: (f64, f64, f64),
    /// Of the engine's seconds: its load.
    engine_load_s: f64,
    reference: (f64, f64, f64),
    compare_wait_s: f64,
    /// [`references::forward::weight_bytes_read`] at the start.
    bytes0: u64,
    n_prefill: usize,
    t0: Instant,
    /// How the compute dtype was learned.
    dtype_source: &'static str,
}

/// Localizes, diagnoses and isolates the first divergence and builds the run document.
fn finish(plan: &DiffPlan, reference: &Reference, mut cmp: Comparator, sides: Sides) -> anyhow::Result<DiffRun> {
    let config = cmp.config;
    let tokens = &plan.tokens;
    cmp.settle_all();
    let mut rows = std::mem::take(&mut cmp.rows);
    if rows.is_empty() {
        // A verdict of agreement needs at least one compared value.
        bail!("0 taps compared: the two sides share no tap, so there is nothing to agree on");
    }
    rows.sort_by_key(|r| r.tap.parse::<TapKey>().expect("printed keys parse"));
    let unmatched: Vec<String> = cmp.waiting.iter().map(|k| k.to_string()).collect();
    let n = tokens.len();
    let dtype = cmp.dtype;
    let head_profile = cmp.first_local.as_ref().and_then(|(_, _, p)| p.clone());
    // Below f32, the classifiers look at the local view: the candidate against the reference op
    // on its own inputs (end to end, every tap carries the drift of the layers before it).
    let mut local_refs;
    let diag_refs = match (&cmp.first_local, dtype) {
        (Some((k, slice, _)), d) if d != ActDtype::F32 && k.rank.is_none() => {
            local_refs = cmp.frozen_ref.clone();
            if let Some(c) = local_refs.get_mut(k) {
                c.data = slice.clone();
            }
            &local_refs
        }
        _ => &cmp.frozen_ref,
    };
    let (first, diagnosis, isolation, heads) = match (cmp.first_over, &sides.engine_config) {
        (Some(k), Some(engine_config)) => {
            let ctx = DiagContext {
                config,
                engine_config,
                tp: plan.engine.tp,
                eng: &cmp.frozen_eng,
                refs: diag_refs,
                rows: &rows,
                n_tokens: n,
                n_prefill: sides.n_prefill,
                head_profile: head_profile.as_ref(),
                dtype,
                reference: Some(reference),
            };
            let mut row = rows
                .iter()
                .find(|r| r.tap == k.to_string())
                .expect("first divergence has a row")
                .clone();
            if let (Some(l), true) = (&row.local, dtype != ActDtype::F32) {
                // The local view: the local error stands for rel_l2 and its bound for the threshold.
                row.metrics.rel_l2 = l.rel_l2;
                row.threshold = l.bound;
                if let Some((_, slice, _)) = &cmp.first_local {
                    if let Some(e) = cmp.frozen_eng.get(&k) {
                        if e.data.len() == slice.len() {
                            row.metrics.cosine = crate::compare::cosine(&e.data, slice);
                        }
                    }
                }
            }
            let diagnosis = diagnose(&ctx, &k, &row);
            // Isolation and the head matrix report the end-to-end view.
            let ctx = DiagContext {
                refs: &cmp.frozen_ref,
                ..ctx
            };
            let isolation = crate::isolate::isolate(reference, &ctx, &k)?;
            let heads = crate::isolate::heads_at_divergence(&ctx, &k);
            let loc = Location {
                tap: k.to_string(),
                layer: k.layer,
                site: k.site.name(),
                rank: k.rank,
            };
            (Some(loc), Some(diagnosis), isolation, heads)
        }
        _ => (None, None, Vec::new(), None),
    };
    Ok(DiffRun {
        format: DIFF_FORMAT,
        llmdiff_version: env!("CARGO_PKG_VERSION").to_string(),
        model: plan.model_name.clone(),
        backend: sides.backend,
        tp: plan.engine.tp,
        tokens: tokens.clone(),
        injected: plan.engine.faults.iter().map(|f| f.to_string()).collect(),
        verdict: if first.is_some() { "diverged" } else { "agree" }.to_string(),
        first_divergence: first,
        diagnosis,
        isolation,
        heads,
        taps: rows,
        unmatched,
        missing: Vec::new(),
        allow_unknown: plan.file.header.allow_unknown.clone(),
        repro: plan.repro.clone(),
        routing: cmp
            .routing
            .iter()
            .map(|(&layer, &agree_frac)| RoutingAgreement { layer, agree_frac })
            .collect(),
        timings_s: Timings {
            engine: sides.engine.0,
            reference: sides.reference.0,
            compare: cmp.compare_s,
            replay: cmp.replay_s,
            total: sides.t0.elapsed().as_secs_f64(),
            engine_capture: sides.engine.1,
            engine_wait: sides.engine.2,
            engine_load: sides.engine_load_s,
            reference_capture: sides.reference.1,
            reference_wait: sides.reference.2,
            compare_wait: sides.compare_wait_s,
            reference_weight_bytes: references::forward::weight_bytes_read().saturating_sub(sides.bytes0),
        },
        dtype: Some(DtypeInfo {
            name: dtype.name().to_string(),
            source: sides.dtype_source.to_string(),
            unit_roundoff: dtype.unit_roundoff(),
            safety: crate::noise::SAFETY,
        }),
        head_profile,
        baselines: plan.tolerances.baseline_names().to_vec(),
        coverage_warnings: cmp.config.coverage_warnings(tokens.len()),
        tp_layout: None,
        layer_range: None,
    })
}

/// Share of tokens (rows of `k` expert ids) whose expert sets agree, order ignored.
fn routing_agreement(eng: &[f32], reference: &[f32], k: usize) -> f64 {
    let k = k.max(1);
    if eng.len() != reference.len() || eng.is_empty() {
        return 0.0;
    }
    let sorted = |c: &[f32]| {
        let mut v = c.to_vec();
        v.sort_by(f32::total_cmp);
        v
    };
    let n = eng.len() / k;
    let same = eng
        .chunks(k)
        .zip(reference.chunks(k))
        .filter(|(a, b)| sorted(a) == sorted(b))
        .count();
    same as f64 / n as f64
}
