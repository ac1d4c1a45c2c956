//! The run documents llmdiff writes with `--json` and renders to HTML. Versioned: readers check
//! `format` against [`DIFF_FORMAT`] and refuse other versions with a regeneration hint.
//!
//! JSON has no inf or NaN: serde_json writes a non-finite float as `null`. Every float field here
//! therefore reads `null` back as NaN (see [`lenient`]), so a saved run with a canary or a shape
//! mismatch in it re-renders instead of failing to parse. Fields added after format 1 are optional
//! (`#[serde(default)]`), so older documents of the same format still read.

use serde::{Deserialize, Serialize};

/// Version of [`DiffRun`]; bump on any incompatible change.
pub const DIFF_FORMAT: u32 = 1;

/// Error metrics of one tap, engine (a) against reference (b). Definitions:
/// cosine; rel_l2 = |a−b|/|b|; max_abs; nmse = Σ(a−b)²/Σb²; sqnr_db = 20·log10(|b|/|a−b|);
/// nonfinite = count of non-finite values in a; canary_left = fraction of a still holding the canary.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Metrics {
    #[serde(deserialize_with = "lenient::f64")]
    pub cosine: f64,
    #[serde(deserialize_with = "lenient::f64")]
    pub rel_l2: f64,
    #[serde(deserialize_with = "lenient::f64")]
    pub max_abs: f64,
    #[serde(deserialize_with = "lenient::f64")]
    pub nmse: f64,
    #[serde(deserialize_with = "lenient::f64")]
    pub sqnr_db: f64,
    pub nonfinite: u64,
    #[serde(deserialize_with = "lenient::f64")]
    pub canary_left: f64,
}

/// One compared tap.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TapRow {
    /// The printed tap key, e.g. `blk.3.attn_out@r1`.
    pub tap: String,
    pub layer: Option<u32>,
    pub site: String,
    pub rank: Option<u32>,
    pub shape: [usize; 2],
    pub metrics: Metrics,
    /// The end-to-end rel_l2 threshold of this tap (its verdict where it has no local error).
    #[serde(deserialize_with = "lenient::f64")]
    pub threshold: f64,
    /// The verdict: the tap is a divergence (see [`TapRow::local`] for which rule decided).
    pub over: bool,
    /// Whether the end-to-end rel_l2 alone is over `threshold` (context: under bf16 most healthy
    /// taps drift past it while their ops are right). Absent in documents before it existed.
    #[serde(default)]
    pub over_end_to_end: bool,
    /// The local error: the reference op re-run on the candidate's own captured inputs against
    /// the candidate's output, and its bound. Present where the inputs were captured: the tap
    /// is then over when its end-to-end rel_l2 exceeds the f32 floor *and* its local error
    /// exceeds the bound (or a canary/non-finite value is left). Absent: the end-to-end rule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local: Option<LocalError>,
    /// At a top-k selection tap (`indexer_topk`; `moe_topk` where its op cannot be re-run on the
    /// candidate's inputs): the selection rule's verdict, which decides the tap instead of
    /// rel_l2 on index values.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selection: Option<SelectionVerdict>,
}

/// A top-k selection judged against the reference's scores: keys clearly above the cut-off
/// (margin over `sigmas` × the candidate's noise) must be chosen, keys clearly below must not,
/// and the near-tie rest by overall overlap.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SelectionVerdict {
    /// Which scores the rule read: "replayed" (the reference op on the candidate's own inputs)
    /// or "reference" (the reference's end-to-end scores).
    pub scores: String,
    /// The candidate's score noise per row, relative to the row's largest |score|.
    #[serde(deserialize_with = "lenient::f64")]
    pub noise_rel: f64,
    #[serde(deserialize_with = "lenient::f64")]
    pub sigmas: f64,
    /// Rows with more candidates than k (where the selection had a choice).
    pub rows_with_choice: usize,
    /// Chosen keys shared with the reference's top-k, over all rows.
    #[serde(deserialize_with = "lenient::f64")]
    pub overlap: f64,
    #[serde(deserialize_with = "lenient::f64")]
    pub min_overlap: f64,
    /// Keys inside the near-tie band.
    pub near_ties: usize,
    /// Broken constraints (clear misses, clear intruders, malformed rows), and the first.
    pub violations: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_violation: Option<String>,
    pub agrees: bool,
}

/// A tap's local error and what it was held to.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LocalError {
    /// rel_l2 of the candidate's output against the reference op on the candidate's inputs.
    #[serde(deserialize_with = "lenient::f64")]
    pub rel_l2: f64,
    /// The bound it was held to.
    #[serde(deserialize_with = "lenient::f64")]
    pub bound: f64,
    /// The op's noise scale on these inputs (a correct op at unit roundoff u errs by about u·rho).
    #[serde(deserialize_with = "lenient::f64")]
    pub rho: f64,
    /// Where the bound came from: "model" (safety × u × rho), "floor" (the f32 threshold, when
    /// above the model's), "baseline" (a healthy run's error × margin) or "tolerance" (a user override).
    pub source: String,
    /// When the local error was estimated on a sample of token rows (well under its bound, so
    /// not replayed on every row): how many rows. Absent: every row was replayed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rows: Option<usize>,
    /// Per head at an attention tap of the GQA families (q, k, v, attn_out): each head's local
    /// error and bound (empty elsewhere). A `--baseline` of this run sets per-head bounds from it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub heads: Vec<HeadLocal>,
}

/// Per-head local error at an attention tap: each head's rel_l2 against the reference op on the
/// candidate's inputs, its bound, and the least-squares scale s of candidate ≈ s · replay.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HeadLocal {
    pub head: usize,
    #[serde(deserialize_with = "lenient::f64")]
    pub rel_l2: f64,
    #[serde(deserialize_with = "lenient::f64")]
    pub bound: f64,
    #[serde(deserialize_with = "lenient::f64")]
    pub scale: f64,
}

/// The per-head local-error profile at the first divergence (attention taps only).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HeadProfile {
    pub tap: String,
    pub heads: Vec<HeadLocal>,
}

/// The candidate's compute dtype, which sets the noise model's unit roundoff.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DtypeInfo {
    /// "f32", "bf16", "f16" or "fp8-e4m3".
    pub name: String,
    /// How it was learned: "engine options", "dump metadata", "dump tensor dtypes",
    /// "detected from values" or "default".
    pub source: String,
    #[serde(deserialize_with = "lenient::f64")]
    pub unit_roundoff: f64,
    /// The noise model's safety factor.
    #[serde(deserialize_with = "lenient::f64")]
    pub safety: f64,
}

/// Where the first divergence is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Location {
    pub tap: String,
    pub layer: Option<u32>,
    pub site: String,
    pub rank: Option<u32>,
}

/// Op isolation at a tap: the reference op re-run on the engine's own captured inputs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Isolation {
    pub tap: String,
    /// Error of the engine output against the reference run end to end.
    #[serde(deserialize_with = "lenient::f64")]
    pub end_to_end_rel_l2: f64,
    /// Error of the engine output against the reference op on the engine's inputs.
    #[serde(deserialize_with = "lenient::f64")]
    pub isolated_rel_l2: f64,
    /// "introduced" when the op itself is wrong, "propagated" when only its inputs were.
    pub verdict: String,
}

/// Per-head cosine matrix at an attention tap (engine heads × reference heads).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HeadMatrix {
    pub tap: String,
    pub n_heads: usize,
    /// Row-major `[engine_head][reference_head]`.
    #[serde(deserialize_with = "lenient::vec_f64")]
    pub cosine: Vec<f64>,
}

/// The fault class and the evidence for it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Diagnosis {
    pub class: String,
    pub explanation: String,
    /// "high" when the evidence is specific to the class, "low" for a best guess.
    pub confidence: String,
}

/// A `diff-layers` run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DiffRun {
    pub format: u32,
    pub llmdiff_version: String,
    pub model: String,
    pub backend: String,
    pub tp: usize,
    pub tokens: Vec<u32>,
    pub injected: Vec<String>,
    /// "agree" or "diverged".
    pub verdict: String,
    pub first_divergence: Option<Location>,
    pub diagnosis: Option<Diagnosis>,
    pub isolation: Vec<Isolation>,
    pub heads: Option<HeadMatrix>,
    pub taps: Vec<TapRow>,
    /// Taps one side emitted that the other did not (listed, never guessed).
    pub unmatched: Vec<String>,
    /// Reference activation taps the candidate dump lacks (`--candidate` runs only; listed, not
    /// guessed). Empty for engine runs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub missing: Vec<String>,
    /// The unknown metadata keys and tensors the user accepted with `--allow-unknown KEY` (the
    /// run went ahead at the user's risk: llmdiff does not know whether they change the math).
    /// Absent when none were given.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow_unknown: Vec<String>,
    pub repro: String,
    pub timings_s: Timings,
    /// MoE routing agreement per MoE layer, from the moe_topk taps (empty for dense models and
    /// for runs written before this field existed).
    #[serde(default)]
    pub routing: Vec<RoutingAgreement>,
    /// The compute dtype the decision rule assumed (absent in documents before it existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<DtypeInfo>,
    /// Per-head local errors at the first divergence, when it is an attention tap.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_profile: Option<HeadProfile>,
    /// The healthy baselines (`--baseline`) the bounds came from, if any.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub baselines: Vec<String>,
    /// Paths of the model this run could not exercise (a prompt within a sliding window or the
    /// indexer's top_k, no MoE layer reached), so an agreement is not mistaken for coverage.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub coverage_warnings: Vec<String>,
    /// A format 2 (tensor-parallel) candidate dump: what its declared layouts made comparable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_layout: Option<TpLayoutReport>,
    /// A `--layers A..B` run: both sides ran only layers A..B from one residual.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer_range: Option<LayerRangeInfo>,
}

/// What a `--layers A..B` run ran: layers `start..end` (end excluded) from the residual of
/// `residual_from` (reference, engine, or a dump's path; "embeddings" when start is 0), and
/// whether the output norm and head ran (only when `end` is the model's last layer; otherwise
/// the verdict is on the range's layer taps).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LayerRangeInfo {
    pub start: usize,
    pub end: usize,
    pub residual_from: String,
    pub head: bool,
}

/// What a tensor-parallel candidate dump's declared layouts made comparable, and what the
/// rank-level checks found (docs/tp-dumps.md).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TpLayoutReport {
    pub tp: usize,
    /// Tensors in the dump's files (each one counted below, or the dump was refused).
    pub tensors: usize,
    /// Tensor class (a site, or `site#partial`) → its declared layout on each rank, in rank order.
    pub layouts: std::collections::BTreeMap<String, Vec<String>>,
    /// Comparisons by kind: `replicated` (the lowest rank's copy against the reference),
    /// `replica` (another rank's copy against it), `sharded`, `partial` (against the reference's
    /// per-rank partial), `unranked`, `partial-unchecked` (its input shard not in the dump).
    pub compared: std::collections::BTreeMap<String, usize>,
    /// Config values compared (per rank, against the reference and across ranks).
    pub config_keys: usize,
    pub config_drift: Vec<String>,
    pub replica_disagreements: Vec<String>,
    pub partial_findings: Vec<String>,
    /// Weight fingerprints that miss the reference's slice for their declared layout.
    #[serde(default)]
    pub weight_findings: Vec<String>,
    /// Weight fingerprints whose sha256 equals the reference slice's (f32 little-endian).
    #[serde(default)]
    pub weight_hashes_equal: usize,
    /// The TP plans the ranks recorded (one when they agree).
    pub tp_plan: Vec<String>,
}

/// The most tensor-parallel ranks a run document may name.
pub const MAX_TP: usize = 4096;

impl DiffRun {
    /// The invariants a run document read from a file must hold before it is rendered, so that
    /// no size taken from the file exceeds the data it describes: a verdict of `agree` or
    /// `diverged` over at least one tap; `1 <= tp <= MAX_TP` and every rank below `tp`; every
    /// layer (of a tap, the first divergence or a routing row) below the number of taps (each
    /// layer up to the last compared one has a tap); a head matrix of `n_heads`² cosines with
    /// `n_heads` at most the number of cosines; a first divergence that is one of the taps.
    pub fn validate(&self) -> Result<(), String> {
        if self.verdict != "agree" && self.verdict != "diverged" {
            return Err(format!(
                "verdict {:?}: expected \"agree\" or \"diverged\"",
                self.verdict
            ));
        }
        if self.taps.is_empty() {
            return Err("no taps: a verdict needs at least one compared tap".into());
        }
        if self.tp == 0 || self.tp > MAX_TP {
            return Err(format!("tp {} (expected 1..={MAX_TP})", self.tp));
        }
        let n = self.taps.len();
        let layer_ok = |l: Option<u32>| l.is_none_or(|l| (l as usize) < n);
        let rank_ok = |r: Option<u32>| r.is_none_or(|r| (r as usize) < self.tp);
        for t in &self.taps {
            if !layer_ok(t.layer) {
                return Err(format!("tap {:?}: layer {:?} beyond the {n} taps", t.tap, t.layer));
            }
            if !rank_ok(t.rank) {
                return Err(format!("tap {:?}: rank {:?} beyond tp {}", t.tap, t.rank, self.tp));
            }
        }
        if let Some(f) = &self.first_divergence {
            if !layer_ok(f.layer) || !rank_ok(f.rank) || !self.taps.iter().any(|t| t.tap == f.tap) {
                return Err(format!("first_divergence {:?} is not one of the taps", f.tap));
            }
        }
        if (self.verdict == "diverged") != self.first_divergence.is_some() {
            return Err("the verdict and first_divergence disagree".into());
        }
        for r in &self.routing {
            if !layer_ok(Some(r.layer)) {
                return Err(format!("routing layer {} beyond the {n} taps", r.layer));
            }
        }
        if let Some(h) = &self.heads {
            if h.n_heads == 0 || h.n_heads.checked_mul(h.n_heads) != Some(h.cosine.len()) {
                return Err(format!(
                    "heads: {} cosines for n_heads {} (expected n_heads²)",
                    h.cosine.len(),
                    h.n_heads
                ));
            }
        }
        Ok(())
    }
}

/// How many tokens pick the same experts on both sides at one MoE layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RoutingAgreement {
    pub layer: u32,
    /// Share of tokens whose expert set (order ignored) is identical in engine and reference.
    #[serde(deserialize_with = "lenient::f64")]
    pub agree_frac: f64,
}

/// Wall seconds of a `diff-layers` run by stage. The engine, the reference and the comparator
/// run at once (lockstep), so the stages overlap and do not add up to `total`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Timings {
    /// The engine side, start to last tap (its load included: the reference runs meanwhile).
    pub engine: f64,
    /// The reference side, start to last tap.
    pub reference: f64,
    /// The comparator's work (comparing, replaying, deciding), excluding its waits for taps.
    pub compare: f64,
    pub total: f64,
    /// Of `compare`: re-running reference ops on the engine's captured inputs (local errors).
    #[serde(default)]
    pub replay: f64,
    /// Of `engine`: seconds blocked handing taps to the comparator (it was behind).
    #[serde(default)]
    pub engine_wait: f64,
    /// Of `engine`: loading the model (reading, dequantizing or uploading its weights).
    #[serde(default)]
    pub engine_load: f64,
    /// Of `engine`: seconds spent copying its taps out (what capture cost it).
    #[serde(default)]
    pub engine_capture: f64,
    /// Of `reference`: seconds blocked handing taps to the comparator.
    #[serde(default)]
    pub reference_wait: f64,
    /// Of `reference`: seconds spent copying its taps out, weights dequantized for their taps
    /// included.
    #[serde(default)]
    pub reference_capture: f64,
    /// Seconds the comparator waited for a tap from either side.
    #[serde(default)]
    pub compare_wait: f64,
    /// Bytes of stored weights the reference read (dequantized) over the run, replays included:
    /// a MoE layer's routed experts only.
    #[serde(default)]
    pub reference_weight_bytes: u64,
}

// ---------------------------------------------------------------------------------------------
// `entropy` run documents (issue #6). Kept in one block so merges with the rendering work stay easy.
// ---------------------------------------------------------------------------------------------

/// Version of [`EntropyRun`]; bump on any incompatible change.
pub const ENTROPY_FORMAT: u32 = 1;

/// The thresholds an `entropy` verdict was made with (calibrated; see golden/entropy-calibration.json).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EntropyThresholds {
    /// `flat` when the mean normalized entropy H / ln V is above this.
    pub flat_norm_entropy: f64,
    /// `flat` when the mean top-1 log-probability is below this (nats).
    pub flat_top1_logprob: f64,
    /// `degenerate` when the greedy continuation's repetition score is above this.
    pub degenerate_repetition: f64,
    /// `degenerate` when the top-5 recurrence across positions is above this.
    pub degenerate_top5_recurrence: f64,
    /// Against the reference: a position whose KLD (nats) is above this diverges.
    pub kld_position: f64,
}

/// KL-divergence statistics against the reference, as llama-perplexity's `--kl-divergence` gives
/// them. KLD(pos) = Σ p_ref (log p_ref − log p), in f64.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KldStats {
    pub n_positions: usize,
    pub mean: f64,
    /// Standard error of the mean.
    pub mean_se: f64,
    pub median: f64,
    pub p90: f64,
    pub p99: f64,
    pub p99_9: f64,
    pub max: f64,
    /// Positions whose top-1 token is the reference's, in percent.
    pub same_top1_pct: f64,
    /// RMS of p(next token) − p_ref(next token), over positions with a next token, in percent.
    pub rms_dp_pct: f64,
    /// The first position whose KLD is over the threshold (prompt-local index; for the overall
    /// statistics, the index into all positions in prompt order).
    pub first_over: Option<usize>,
    pub threshold: f64,
}

/// One prompt's next-token distribution statistics.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PromptEntropy {
    /// The prompt text (or `tokens:N` for a token-id prompt), shortened.
    pub label: String,
    pub n_tokens: usize,
    /// "healthy", "flat" or "degenerate".
    pub verdict: String,
    /// Which thresholds were crossed, one phrase each.
    pub reasons: Vec<String>,
    pub mean_entropy: f64,
    pub min_entropy: f64,
    /// mean H / ln V.
    pub norm_entropy: f64,
    pub mean_top1_logprob: f64,
    /// Share of the position×top-5 slots taken by the five most recurrent tokens (1 = the same
    /// five tokens in every position's top-5).
    pub top5_recurrence: f64,
    /// The five most recurrent top-5 tokens, with the number of positions they appear in.
    pub recurring_top5: Vec<(u32, usize)>,
    /// 1 − distinct/total over the 3-grams of the greedy continuation (0 when too short).
    pub repetition: f64,
    pub continuation: Vec<u32>,
    pub continuation_text: Option<String>,
    /// Non-finite logits seen.
    pub nonfinite: u64,
    pub kld: Option<KldStats>,
    /// Entropy (nats) at every prompt position, on the backend that ran.
    #[serde(default)]
    pub entropies: Vec<f64>,
    /// With --against-reference: the reference's entropy at the same positions.
    #[serde(default)]
    pub reference_entropies: Vec<f64>,
    /// With --against-reference: KLD at every compared position (prompt, then decode steps).
    #[serde(default)]
    pub kld_positions: Vec<f64>,
    /// From a server's top-k logprobs only (`--server`): `mean_entropy` and `min_entropy` are then
    /// lower bounds and this is the mean upper bound (the mass outside the top-k spread uniformly).
    #[serde(default)]
    pub entropy_upper: Option<f64>,
    /// From a server: the mean probability mass outside the returned top-k (1 − Σ p_i).
    #[serde(default)]
    pub topk_residual: Option<f64>,
    /// From a server with `--against-reference`: top-k set agreement with the reference.
    #[serde(default)]
    pub overlap: Option<TopkOverlap>,
}

/// How the server's top-k sets overlap the reference's, and the first position whose top-1 differs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TopkOverlap {
    pub k: usize,
    /// Mean |S_server ∩ S_ref| / k over positions.
    #[serde(deserialize_with = "lenient::f64")]
    pub overlap_at_k: f64,
    /// Mean |S_server ∩ S_ref| / |S_server ∪ S_ref|.
    #[serde(deserialize_with = "lenient::f64")]
    pub jaccard: f64,
    /// The first position (row index into the sequence) whose top-1 token differs, with both tokens.
    pub first_top1_disagreement: Option<TokenDisagreement>,
}

/// One position where the server's top-1 token is not the reference's.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenDisagreement {
    /// 1-based prompt number (0 in a per-prompt record).
    pub prompt: usize,
    pub position: usize,
    pub server_token: String,
    pub reference_token: String,
}

/// Where an `entropy --server` run's figures came from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ServerSource {
    pub url: String,
    pub served_model: String,
    /// top_logprobs requested per position.
    pub top_k: usize,
    /// How the server's logprob entries were aligned to positions: "openai" (entry i is the
    /// distribution that predicted token i) or "shifted" (entry i is the distribution after token
    /// i, as llama-cpp-python's echo gives it for a model without BOS).
    pub alignment: String,
    /// How the top-k KLD is normalized (e.g. "server_topk").
    pub kld_support: String,
}

/// An `entropy` run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EntropyRun {
    pub format: u32,
    pub llmdiff_version: String,
    pub model: String,
    pub backend: String,
    pub tp: usize,
    pub injected: Vec<String>,
    pub vocab: usize,
    pub max_new_tokens: usize,
    pub thresholds: EntropyThresholds,
    /// Overall: "healthy", "flat" or "degenerate".
    pub verdict: String,
    /// With --against-reference: "agree" or "diverged".
    pub agreement: Option<String>,
    pub prompts: Vec<PromptEntropy>,
    /// With --against-reference: over all positions of all prompts.
    pub kld: Option<KldStats>,
    pub seconds: f64,
    /// With `--server`: the deployment checked.
    #[serde(default)]
    pub server: Option<ServerSource>,
    /// With `--server --against-reference`: over all positions of all prompts.
    #[serde(default)]
    pub overlap: Option<TopkOverlap>,
}

/// Deserializers that read JSON `null` (serde_json's form of inf and NaN) back as NaN.
pub mod lenient {
    use serde::{Deserialize, Deserializer};

    pub fn f64<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
    }

    pub fn vec_f64<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f64>, D::Error> {
        Ok(Vec::<Option<f64>>::deserialize(d)?
            .into_iter()
            .map(|v| v.unwrap_or(f64::NAN))
            .collect())
    }
}

// ---------------------------------------------------------------------------------------------
// `gate` run documents: one suite per golden file, one case per tap group and per prompt.

/// How one compared item went.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GateCheck {
    /// What was compared, e.g. `blk.3.attn_out@r1` or `pos 4`.
    pub item: String,
    /// The worst measure / its threshold (≤ 1 passes).
    pub ratio: f64,
    pub detail: String,
}

/// One case: a tap group (embed, a layer, output) or one prompt's positions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GateCase {
    pub name: String,
    pub passed: bool,
    pub skipped: bool,
    /// Worst measure / threshold over the case.
    pub worst_ratio: f64,
    pub failures: Vec<GateCheck>,
}

/// The outcome of one golden file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GateSuite {
    pub golden: String,
    /// "pass" or "fail".
    pub verdict: String,
    pub backend: String,
    pub tp: usize,
    /// One line on the first failure in execution order, with the bless hint.
    pub message: Option<String>,
    pub cases: Vec<GateCase>,
    pub seconds: f64,
    /// `gate --server`: the deployment and its agreement figures with the golden file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<GateServerFigures>,
}

/// What `gate --server` measured against one golden file: top-k KLD statistics over every compared
/// position (prompt positions, then greedy steps while the continuation agrees), top-k overlap with
/// the golden's top-k and the first top-1 disagreement, and the greedy continuation's agreement.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GateServerFigures {
    pub source: ServerSource,
    pub kld: KldStats,
    pub overlap: TopkOverlap,
    /// Greedy tokens compared with the golden's continuation, and how many of them were equal
    /// before the first difference.
    pub n_greedy_compared: usize,
    pub n_greedy_equal: usize,
    /// Seconds spent waiting for the server.
    pub request_seconds: f64,
}
