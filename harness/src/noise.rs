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
//! so it could not see a head off by 2 %.
//!
//! A reduction-length term enters only where the accumulator itself is narrow: FP8 (e4m3)
//! tensor-core GEMMs, whose MMA accumulator keeps about 14 significant bits rather than f32's
//! 24 (the limitation DeepSeek-V3's report measured on Hopper, and why engines promote the
//! partial sums to f32 every 128 products). Each addition of a K-long sum then rounds the
//! running sum Sⱼ, of size about √j·σ for products of rms σ with independent signs, by
//! u_acc·|Sⱼ|; the K errors add in quadrature to u_acc·√(Σⱼ j)·σ = u_acc·√(K/2)·√(Σ pᵢ²). Over a
//! tap that is u_acc·√(K/2)·rho_sum, with rho_sum the products' part of rho, added to u·rho
//! before the safety factor ([`local_bound_sum`], [`accumulator_roundoff`]). It applies to the
//! fp8 compute dtype only (a dump declaring `llmdiff.compute_dtype = fp8-e4m3`, or its values
//! detected as such); bf16 and f16 GEMMs accumulate in f32, where the term is below 1e-4 of the
//! storage term and left out. An fp8 engine that promotes every 128 products has K = 128 for the
//! narrow part: its errors sit under the term, so the bound stays conservative; an engine whose
//! noise the model does not predict at all takes a `--baseline`.
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

/// The unit roundoff of the accumulator of `dtype`'s GEMMs where it is narrower than f32:
/// fp8 e4m3 tensor-core MMAs keep about 14 significant bits (module doc); `None` elsewhere.
pub fn accumulator_roundoff(dtype: ActDtype) -> Option<f64> {
    match dtype {
        ActDtype::Fp8E4m3 => Some(2f64.powi(-14)),
        _ => None,
    }
}

/// [`local_bound`] of a tap whose op ends in a sum of `reduction` products (`rho_sum` their part
/// of rho): the model adds the narrow accumulator's term u_acc·√(K/2)·rho_sum where `dtype`'s
/// GEMMs have one (fp8); otherwise it is [`local_bound`].
pub fn local_bound_sum(
    tol: &Tolerances,
    key: &TapKey,
    dtype: ActDtype,
    rho: f64,
    rho_sum: f64,
    reduction: usize,
) -> Bound {
    let extra = match accumulator_roundoff(dtype) {
        Some(u_acc) if reduction > 0 => u_acc * (reduction as f64 / 2.0).sqrt() * rho_sum / dtype.unit_roundoff(),
        _ => 0.0,
    };
    local_bound(tol, key, dtype, rho + extra)
}

/// The bound of one head's local error at an attention tap: a user override; else the healthy
/// baseline's error of that head × the margin where the baseline has per-head figures (its
/// per-head profile: heads differ in noise, a quiet head is held tighter than the tap); else
/// [`local_bound`] with the head's own rho.
pub fn head_bound(tol: &Tolerances, key: &TapKey, dtype: ActDtype, rho: f64, head: usize) -> Bound {
    if tol.user(key).is_none() {
        if let Some(b) = tol.head_baseline(key, head) {
            return Bound {
                value: tol.floor(key).max(BASELINE_MARGIN * b),
                source: "baseline",
            };
        }
    }
    local_bound(tol, key, dtype, rho)
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

    #[test]
    fn a_head_baseline_sets_that_heads_bound() {
        let mut t = Tolerances::default();
        let k: TapKey = "blk.2.attn_out@r1".parse().unwrap();
        t.add_baseline(
            "blk.2.attn_out",
            Baseline {
                local: Some(1e-3),
                end_to_end: 1e-2,
            },
        );
        t.add_head_baseline("blk.2.attn_out@r0", 4, 2e-4);
        t.add_head_baseline("blk.2.attn_out", 4, 1e-4);
        let b = head_bound(&t, &k, ActDtype::Bf16, 2.0, 4);
        assert_eq!((b.value, b.source), (BASELINE_MARGIN * 2e-4, "baseline"));
        // A head without per-head figures keeps the tap's baseline bound.
        assert_eq!(head_bound(&t, &k, ActDtype::Bf16, 2.0, 5).value, BASELINE_MARGIN * 1e-3);
        t.set("*=0.5").unwrap();
        assert_eq!(head_bound(&t, &k, ActDtype::Bf16, 2.0, 4).value, 0.5);
    }

    #[test]
    fn the_reduction_term_is_fp8s_only() {
        let t = Tolerances::default();
        let k: TapKey = "blk.2.ffn_out".parse().unwrap();
        // bf16 and f16 accumulate in f32: the reduction length changes nothing.
        for d in [ActDtype::Bf16, ActDtype::F16, ActDtype::F32] {
            assert_eq!(local_bound_sum(&t, &k, d, 3.0, 2.0, 8192), local_bound(&t, &k, d, 3.0));
        }
        // fp8: u·rho + u_acc·√(K/2)·rho_sum, times the safety factor.
        let (u, u_acc) = (2f64.powi(-4), 2f64.powi(-14));
        let b = local_bound_sum(&t, &k, ActDtype::Fp8E4m3, 3.0, 2.0, 8192);
        let want = SAFETY * (u * 3.0 + u_acc * 64.0 * 2.0);
        assert!((b.value - want).abs() < 1e-12 * want, "{} vs {want}", b.value);
        assert_eq!(b.source, "model");
        // Not a sum (K 0): the storage term alone.
        assert_eq!(
            local_bound_sum(&t, &k, ActDtype::Fp8E4m3, 3.0, 0.0, 0).value,
            SAFETY * u * 3.0
        );
    }
}
