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

/// Error metrics of one tap, engine (a) against reference (b). Definitions (DESIGN.md):
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
    /// The rel_l2 threshold this tap was held to.
    #[serde(deserialize_with = "lenient::f64")]
    pub threshold: f64,
    pub over: bool,
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
    pub repro: String,
    pub timings_s: Timings,
    /// MoE routing agreement per MoE layer, from the moe_topk taps (empty for dense models and
    /// for runs written before this field existed).
    #[serde(default)]
    pub routing: Vec<RoutingAgreement>,
}

/// How many tokens pick the same experts on both sides at one MoE layer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RoutingAgreement {
    pub layer: u32,
    /// Share of tokens whose expert set (order ignored) is identical in engine and reference.
    #[serde(deserialize_with = "lenient::f64")]
    pub agree_frac: f64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Timings {
    pub engine: f64,
    pub reference: f64,
    pub compare: f64,
    pub total: f64,
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
