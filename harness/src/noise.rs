//! The decision rule's noise model: how large a local error (the candidate's output against the
//! reference op re-run, in f64, on the candidate's own inputs) a *correct* implementation at the
//! candidate's precision can make, and so the bound a tap's local error is held to.
//!
//! A correct op whose values are stored with unit roundoff u (bf16 2^-8, f16 2^-11, f32 2^-24,
//! fp8 e4m3 2^-4) and which accumulates wider errs, per output element, by about u·a, where a is
//! the element's noise scale computed by the replay on the candidate's inputs
//! (`references::forward::replay`): for a sum of products y = Σ wᵢxᵢ, a = √(Σ (wᵢxᵢ)²) + |y|
//! (one rounding per product, independent signs, plus the output's rounding); for attention the
//! probabilities' sensitivity to rounded scores; for the norms 2|y|; for a residual add
//! √(x² + p²) + |y|. Over a tap, the expected local rel_l2 is u·rho with rho = rms(a)/rms(y),
//! and the bound is [`SAFETY`]·u·rho. With tensor parallelism the all-reduce of row-parallel
//! partial sums (o_proj, FFN down) rounds each partial once more: the products' part of rho
//! is added again there.
//!
//! The worst-case bound of a dot product, K·u·Σ|wᵢxᵢ|/|y|, is not used: with f32 accumulation
//! the reduction length does not enter, and the worst case is above 1 at K in the thousands,
//! so it could not see a head off by 2 %. A reduction-length term would belong only to a
//! narrow accumulator (fp8 tensor-core GEMMs); use a `--baseline` for such engines.
//!
//! The bound never drops below the f32 column of the end-to-end thresholds (5e-5), so at f32 the
//! rule reproduces the old verdicts, and a user override (`--tolerance`) or a healthy baseline
//! (`--baseline`, its observed local error × [`crate::compare::BASELINE_MARGIN`]) replaces the model.

use crate::compare::{ActDtype, Tolerances, BASELINE_MARGIN};
use references::tap::TapKey;

/// The safety factor on u·rho, calibrated on healthy runs (ARCHITECTURE.md, "Decision rule and
/// noise model", gives the figures): the worst healthy local error over every tap sat below
/// 0.8·u·rho, so 1.5 leaves about 2× while a head off by 2 % (local error 0.02 on that head
/// against about 2u·1.5 = 0.012 in bf16) stays visible.
pub const SAFETY: f64 = 1.5;

/// A bound and where it came from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bound {
    pub value: f64,
    pub source: &'static str,
}

/// The local-error bound of `key` for noise scale `rho` at `dtype`.
pub fn local_bound(tol: &Tolerances, key: &TapKey, dtype: ActDtype, rho: f64) -> Bound {
    if let Some(v) = tol.user(key) {
        return Bound {
            value: v,
            source: "tolerance",
        };
    }
    let floor = tol.floor(key);
    if let Some(b) = tol.baseline(key).and_then(|b| b.local) {
        return Bound {
            value: floor.max(BASELINE_MARGIN * b),
            source: "baseline",
        };
    }
    let model = SAFETY * dtype.unit_roundoff() * rho;
    if model > floor {
        Bound {
            value: model,
            source: "model",
        }
    } else {
        Bound {
            value: floor,
            source: "floor",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::compare::Baseline;

    #[test]
    fn bounds_by_precedence() {
        let mut t = Tolerances::default();
        let k: TapKey = "blk.2.attn_out".parse().unwrap();
        // f32: the floor dominates the model.
        assert_eq!(local_bound(&t, &k, ActDtype::F32, 3.0).source, "floor");
        let b = local_bound(&t, &k, ActDtype::Bf16, 2.0);
        assert_eq!((b.value, b.source), (SAFETY * 2.0 / 256.0, "model"));
        t.add_baseline(
            "blk.2.attn_out",
            Baseline {
                local: Some(1e-3),
                end_to_end: 1e-2,
            },
        );
        let b = local_bound(&t, &k, ActDtype::Bf16, 2.0);
        assert_eq!((b.value, b.source), (BASELINE_MARGIN * 1e-3, "baseline"));
        t.set("blk.*.attn_out=0.5").unwrap();
        assert_eq!(local_bound(&t, &k, ActDtype::Bf16, 2.0).value, 0.5);
    }
}
